#!/usr/bin/env python3
"""kvserve vs llama.cpp on the same GGUF, same threads, interleaved runs.

Runs `kvserve bench` and llama.cpp's `llama-bench` (built by bench/peer/build_llama.sh from
the llama.cpp sources in the llama-cpp-python sdist) alternately, one repeat each per round,
so both see the same machine state. Reports medians, min/max, and kvserve/llama.cpp ratios
as JSON (bench/out/peer_compare.json) and a bar plot (bench/out/peer_compare.png).

  python3 bench/peer/compare.py [--model PATH] [--threads 2] [--rounds 5]
                                [--prompt 512] [--gen 128] [--depth 0]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def run_json(cmd):
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out)


def kvserve_once(a):
    cmd = [os.path.join(ROOT, "build/kvserve"), "bench", "-m", a.model, "--threads", str(a.threads),
           "--prompt-tokens", str(a.prompt), "--gen-tokens", str(a.gen), "--context", str(a.depth),
           "--repeat", "1", "--json"] + (["--kv-cache-dtype", a.kv_dtype] if a.kv_dtype else [])
    j = run_json(cmd)
    return j.get("prefill_tok_s"), j.get("decode_tok_s"), j.get("decode_effective_gb_s")


def llama_once(a, llama_bench):
    cmd = [llama_bench, "-m", a.model, "-t", str(a.threads), "-p", str(a.prompt), "-n", str(a.gen),
           "-d", str(a.depth), "-r", "1", "-o", "json"]
    if a.flash_attn is not None:
        cmd += ["-fa", a.flash_attn]
    if a.llama_kv_type:
        cmd += ["-ctk", a.llama_kv_type, "-ctv", a.llama_kv_type]
    cmd += a.llama_arg
    pp = tg = None
    for row in run_json(cmd):
        if row["n_prompt"] > 0 and row["n_gen"] == 0:
            pp = row["avg_ts"]
        if row["n_gen"] > 0 and row["n_prompt"] == 0:
            tg = row["avg_ts"]
    return pp, tg


def summary(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--depth", type=int, default=0)
    ap.add_argument("--kv-dtype", default=None, help="kvserve --kv-cache-dtype")
    ap.add_argument("--flash-attn", default=None, help="llama-bench -fa (on|off|auto)")
    ap.add_argument("--llama-kv-type", default=None, help="llama-bench -ctk/-ctv (f16, q8_0)")
    ap.add_argument("--llama-arg", action="append", default=[],
                    help="extra llama-bench argument (repeatable), e.g. --llama-arg=--repack --llama-arg=0 where "
                         "llama.cpp's AMX path crashes (Intel AMX hosts, README)")
    ap.add_argument("--out", default="bench/out/peer_compare")
    a = ap.parse_args()

    subprocess.run([os.path.join(ROOT, "bench/peer/build_llama.sh")], check=True, cwd=ROOT)
    llama_bench = os.path.join(ROOT, "bench/peer/work/build/bin/llama-bench")
    k_pp, k_tg, k_bw, l_pp, l_tg = [], [], [], [], []
    load0 = os.getloadavg()[0]
    for r in range(a.rounds):
        t0 = time.time()
        pp, tg, bw = kvserve_once(a)
        k_pp.append(pp), k_tg.append(tg), k_bw.append(bw)
        lpp, ltg = llama_once(a, llama_bench)
        l_pp.append(lpp), l_tg.append(ltg)
        log(f"round {r + 1}/{a.rounds} ({time.time() - t0:.0f} s): kvserve pp {pp or 0:.1f} tg {tg or 0:.1f} | "
            f"llama.cpp pp {lpp or 0:.1f} tg {ltg or 0:.1f}  (load {os.getloadavg()[0]:.2f})")
    res = {
        "model": a.model, "threads": a.threads, "prompt_tokens": a.prompt, "gen_tokens": a.gen, "depth": a.depth,
        "rounds": a.rounds, "load_avg_start": load0, "load_avg_end": os.getloadavg()[0],
        "kvserve": {"prefill_tok_s": summary(k_pp), "decode_tok_s": summary(k_tg), "decode_effective_gb_s": summary(k_bw)},
        "llama_cpp": {"prefill_tok_s": summary(l_pp), "decode_tok_s": summary(l_tg),
                      "flash_attn": a.flash_attn, "kv_type": a.llama_kv_type or "f16"},
    }
    ratios = {}
    for key in ("prefill_tok_s", "decode_tok_s"):
        k, l = res["kvserve"][key], res["llama_cpp"][key]
        if k and l:
            ratios[key] = k["median"] / l["median"]
    res["ratio_kvserve_over_llama_cpp"] = ratios
    os.makedirs(os.path.dirname(os.path.join(ROOT, a.out)), exist_ok=True)
    with open(os.path.join(ROOT, a.out + ".json"), "w") as f:
        json.dump(res, f, indent=2)
    print(json.dumps(res, indent=2))
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, axes = plt.subplots(1, 2, figsize=(8, 3.5))
        for ax, key, title in ((axes[0], "prefill_tok_s", f"prefill pp{a.prompt}"), (axes[1], "decode_tok_s", f"decode tg{a.gen} @ depth {a.depth}")):
            vals = [res["kvserve"][key], res["llama_cpp"][key]]
            meds = [v["median"] if v else 0 for v in vals]
            errs = [[m - (v["min"] if v else 0) for m, v in zip(meds, vals)], [(v["max"] if v else 0) - m for m, v in zip(meds, vals)]]
            ax.bar(["kvserve", "llama.cpp"], meds, yerr=errs, color=["#2a7", "#888"], capsize=4)
            ax.set_title(title + (f"  ({ratios[key]:.2f}x)" if key in ratios else ""))
            ax.set_ylabel("tokens/s")
        fig.suptitle(f"{os.path.basename(a.model)}, {a.threads} threads, median of {a.rounds}")
        fig.tight_layout()
        fig.savefig(os.path.join(ROOT, a.out + ".png"), dpi=110)
        log(f"plot: {a.out}.png")
    except ImportError:
        log("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
