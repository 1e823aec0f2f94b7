#!/usr/bin/env python3
"""kvserve perplexity vs llama.cpp's llama-perplexity: same GGUF, same text, same windows.

Both tokenize the whole file, cut it into windows of --ctx tokens and score the second half
of each window (llama.cpp tools/perplexity/perplexity.cpp). llama.cpp quantizes matmul
activations to 8 bits (Q8_1), kvserve to ~15 bits, so the two PPLs differ by a fraction of a
percent; the float64 oracle sides with kvserve (tests/py/test_cli_perplexity.py).

Prints one JSON object (also written to bench/out/ppl_compare.json):
  {"text", "model", "threads", "results": [{"ctx", "kvserve": {...}, "llama_cpp": {...},
   "ppl_rel_diff"}]}

  python3 bench/ppl_compare.py [--ctx 512 1024] [--chunks N] [--threads 2]
                               [--text data/text/pride_and_prejudice.txt] [--model PATH]

Needs build/kvserve (make build), the text (make text) and llama-perplexity
(bench/peer/build_llama.sh, or: cmake --build bench/peer/work/build --target llama-perplexity).
"""
import argparse
import json
import os
import re
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_kvserve(a, ctx):
    cmd = [a.kvserve, "perplexity", "-m", a.model, "-f", a.text, "--ctx", str(ctx), "--threads", str(a.threads),
           "--kv-cache-dtype", a.kv_dtype, "--json"]
    if a.chunks:
        cmd += ["--chunks", str(a.chunks)]
    log("$ " + " ".join(cmd))
    t0 = time.time()
    r = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, cwd=ROOT)  # progress stays on stderr
    wall = time.time() - t0
    if r.returncode != 0:
        sys.exit("kvserve failed (its error is above)")
    j = json.loads(r.stdout)
    return {"ppl": j["ppl"], "ppl_stderr": j["ppl_stderr"], "n_windows": j["n_windows"], "n_tokens_scored": j["n_tokens_scored"],
            "n_text_tokens": j["n_text_tokens"], "kv_cache_dtype": j["kv_cache_dtype"], "seconds_eval": j["seconds"],
            "tokens_per_s": j["tokens_per_s"], "seconds_wall": wall, "command": " ".join(cmd)}


def run_llama(a, ctx):
    cmd = [a.llama_perplexity, "-m", a.model, "-f", a.text, "-c", str(ctx), "-t", str(a.threads),
           "-ctk", a.kv_dtype, "-ctv", a.kv_dtype]
    if a.chunks:
        cmd += ["--chunks", str(a.chunks)]
    log("$ " + " ".join(cmd) + "   (no progress shown: its log is parsed)")
    t0 = time.time()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - t0
    out = r.stdout + r.stderr
    m = re.search(r"Final estimate: PPL = ([0-9.]+) \+/- ([0-9.]+)", out)
    if r.returncode != 0 or not m:
        sys.exit(f"llama-perplexity failed:\n{out[-2000:]}")
    n = re.search(r"calculating perplexity over (\d+) chunks", out)
    n_win = int(n.group(1)) if n else None
    res = {"ppl": float(m.group(1)), "ppl_stderr": float(m.group(2)), "n_windows": n_win, "seconds_wall": wall,
           "command": " ".join(cmd)}
    # llama.cpp's log lines carry a timestamp (minutes.seconds.ms.us since start): evaluation
    # time = from "calculating perplexity" to "Final estimate" (excludes loading).
    ts = r"(\d+)\.(\d+)\.(\d+)\.(\d+) I "
    t_a = re.search(ts + r"perplexity: calculating", out)
    t_b = re.search(ts + r"Final estimate", out)
    if t_a and t_b and n_win:
        sec = lambda m: int(m.group(1)) * 60 + int(m.group(2)) + int(m.group(3)) / 1e3 + int(m.group(4)) / 1e6
        res["seconds_eval"] = sec(t_b) - sec(t_a)
        res["tokens_per_s"] = n_win * ctx / res["seconds_eval"]
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "text", "pride_and_prejudice.txt"))
    ap.add_argument("--ctx", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--chunks", type=int, default=0, help="windows per run (default: all)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-dtype", default="f16", help="KV type on both sides (f16 or f32)")
    ap.add_argument("--kvserve", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--llama-perplexity", default=os.path.join(ROOT, "bench", "peer", "work", "build", "bin", "llama-perplexity"))
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "ppl_compare.json"))
    a = ap.parse_args()
    for path, hint in ((a.kvserve, "make build"), (a.text, "make text"), (a.model, "make models"),
                       (a.llama_perplexity, "bench/peer/build_llama.sh")):
        if not os.path.exists(path):
            sys.exit(f"missing {path} (run {hint})")

    results = []
    for ctx in a.ctx:
        kv = run_kvserve(a, ctx)
        log(f"  kvserve   ctx {ctx}: PPL {kv['ppl']:.4f} +/- {kv['ppl_stderr']:.4f} ({kv['seconds_wall']:.0f} s)")
        ll = run_llama(a, ctx)
        log(f"  llama.cpp ctx {ctx}: PPL {ll['ppl']:.4f} +/- {ll['ppl_stderr']:.4f} ({ll['seconds_wall']:.0f} s)")
        if ll["n_windows"] is not None and ll["n_windows"] != kv["n_windows"]:
            sys.exit(f"window counts differ: kvserve {kv['n_windows']}, llama.cpp {ll['n_windows']}")
        results.append({"ctx": ctx, "kvserve": kv, "llama_cpp": ll, "ppl_rel_diff": kv["ppl"] / ll["ppl"] - 1})

    report = {"model": os.path.relpath(a.model, ROOT), "text": os.path.relpath(a.text, ROOT), "threads": a.threads,
              "kv_cache_dtype": a.kv_dtype, "date": time.strftime("%Y-%m-%d %H:%M"), "results": results}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(report, f, indent=2)
    print(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
