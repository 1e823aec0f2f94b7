#!/usr/bin/env python3
"""Prompt reuse on a hybrid (sliding-window) model: Gemma 3 270M, kvserve vs llama-server.

Gemma 3's local layers attend to a 512-token window. A server that keeps only each
sequence's window for those layers cannot resume a cached prefix longer than the window
unless it kept the window's pages *at the prefix's end*. kvserve's prefix cache keeps the
sliding-window pages beside the global ones and counts a prefix as a hit only when the window
its next query reads is there (src/kv/prefix_cache.h). llama-server keeps a per-slot cache
(`cache_prompt`), and for SWA models reuses it only as far as its SWA cache allows, unless
started with `--swa-full` (a full-size cache for the local layers too).

Workload (sequential, one request at a time, so TTFT is pure prompt processing): per repeat
a fresh ~1,400-token document (different every repeat, so the first question is cold), then
Q questions about it (`/v1/completions`, stream, temperature 0, max_tokens 8): prompt =
document + question. Question 0 is cold; 1..Q-1 share the document with what came before.
With --passage-words N each question comes after its own N-word passage: the shared prefix
then ends more than a window before the end of the previous request, which a cache that keeps
only each sequence's last window cannot resume from.

Configs: kvserve-cache, kvserve-nocache, llama-server (defaults), llama-server-swa-full.
Reported per config: TTFT p50 cold and warm, warm/cold ratio, tokens reported cached.
Checked: kvserve's greedy outputs with and without the cache are identical.

  python3 bench/hybrid_prefix_bench.py                  # ~4 min on 2 cores
  python3 bench/hybrid_prefix_bench.py --configs kvserve-cache,kvserve-nocache --repeats 2

Output: bench/out/hybrid_prefix_bench.json and .png; server logs in bench/out/serve_logs/.
"""
from __future__ import annotations

import argparse
import http.client
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import ROOT, Server, free_port, loadavg, log, make_text, sse_events  # noqa: E402

DEFAULT_MODEL = ROOT / "models" / "gemma-3-270m-Q4_K_M.gguf"
DEFAULT_KVSERVE = ROOT / "build" / "kvserve"
DEFAULT_LLAMA_SERVER = ROOT / "bench" / "peer" / "work" / "build" / "bin" / "llama-server"
ALL_CONFIGS = ["kvserve-cache", "kvserve-nocache", "llama-server", "llama-server-swa-full"]
QUESTIONS = [
    "Which town is named first?", "What colour is mentioned most?", "Who speaks last?",
    "How many people are named?", "What is the weather like?", "Where does the story end?",
]


def stream_completion(port: int, model: str, prompt: str, max_tokens: int, timeout: float) -> dict:
    """One streaming completion: TTFT (first non-empty text), text, cached tokens if reported."""
    body = json.dumps({"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "stream_options": {"include_usage": True}})
    res = {"ok": False, "ttft": None, "e2e": None, "text": "", "prompt_tokens": None, "cached": None, "error": None}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:300].decode('utf-8', 'replace')}"
            return res
        parts = []
        for ev in sse_events(r):
            if ev is None:
                res["ok"] = True
                break
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    if res["ttft"] is None:
                        res["ttft"] = time.perf_counter() - t0
                    parts.append(ch["text"])
            u = ev.get("usage")
            if u:
                res["prompt_tokens"] = u.get("prompt_tokens")
                res["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            t = ev.get("timings")  # llama-server: prompt tokens taken from its cache
            if t and t.get("cache_n") is not None:
                res["cached"] = t["cache_n"]
        res["e2e"] = time.perf_counter() - t0
        if res["ttft"] is None:
            res["ttft"] = res["e2e"]
        res["text"] = "".join(parts)
    except Exception as e:  # noqa: BLE001 - report every client-side failure
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


def server_cmd(cfg: str, args, port: int) -> list[str]:
    model = str(args.model)
    if cfg.startswith("kvserve"):
        return [str(args.kvserve), "serve", "-m", model, "--port", str(port), "--threads", str(args.threads),
                "--max-model-len", "4096",
                "--enable-prefix-caching" if cfg == "kvserve-cache" else "--no-enable-prefix-caching"]
    cmd = [str(args.llama_server), "-m", model, "--host", "127.0.0.1", "--port", str(port), "--threads", str(args.threads),
           "--threads-batch", str(args.threads), "-np", "1", "-c", "4096"]
    return cmd + (["--swa-full"] if cfg == "llama-server-swa-full" else [])


def run_config(cfg: str, args) -> dict:
    port = free_port()
    srv = Server(cfg, server_cmd(cfg, args, port), port, ROOT / "bench" / "out" / "serve_logs" / f"hybrid-{cfg}.log")
    srv.start(args.startup_timeout)
    reqs = []
    try:
        # Warm-up on an unrelated prompt (first-request costs are not prompt processing).
        stream_completion(port, srv.model_id, "Hello there.", 4, args.timeout)
        for rep in range(args.repeats):
            doc = make_text(f"hybrid-doc-{rep}", args.doc_words)
            for q in range(args.questions):
                passage = "\n\n" + make_text(f"hybrid-passage-{rep}-{q}", args.passage_words) if args.passage_words else ""
                r = stream_completion(port, srv.model_id, doc + passage + "\n\nQuestion: " + QUESTIONS[q % len(QUESTIONS)] + "\nAnswer:",
                                      args.max_tokens, args.timeout)
                if r["error"]:
                    raise RuntimeError(f"{cfg}: {r['error']}")
                r.update(rep=rep, q=q)
                reqs.append(r)
                log(f"{cfg}: repeat {rep} question {q}: ttft {r['ttft']:.3f}s, prompt {r['prompt_tokens']}, cached {r['cached']}")
    finally:
        srv.stop()
    cold = [r["ttft"] for r in reqs if r["q"] == 0]
    warm = [r["ttft"] for r in reqs if r["q"] > 0]
    out = {"ttft_cold_p50": statistics.median(cold), "ttft_warm_p50": statistics.median(warm),
           "warm_cached_p50": statistics.median([r["cached"] or 0 for r in reqs if r["q"] > 0]),
           "prompt_tokens_p50": statistics.median([r["prompt_tokens"] or 0 for r in reqs]), "requests": reqs}
    out["warm_over_cold"] = out["ttft_warm_p50"] / out["ttft_cold_p50"]
    return out


def plot(results: dict, path: Path, title: str) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    cfgs = list(results)
    fig, ax = plt.subplots(figsize=(7.5, 3.8))
    xs = range(len(cfgs))
    ax.bar([x - 0.2 for x in xs], [results[c]["ttft_cold_p50"] for c in cfgs], 0.4, label="cold (new document)")
    ax.bar([x + 0.2 for x in xs], [results[c]["ttft_warm_p50"] for c in cfgs], 0.4, label="warm (same document, new question)")
    ax.set_xticks(list(xs), cfgs, fontsize=8)
    ax.set_ylabel("TTFT p50 (s)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    log(f"plot: {path}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS), help=f"comma list of {ALL_CONFIGS}")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--kvserve", type=Path, default=DEFAULT_KVSERVE)
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3, help="documents (each starts cold)")
    ap.add_argument("--questions", type=int, default=4, help="questions per document (the first is cold)")
    ap.add_argument("--doc-words", type=int, default=1000, help="document length in words (~1.4k tokens)")
    ap.add_argument("--passage-words", type=int, default=0, help="words of a per-question passage after the document")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--startup-timeout", type=float, default=120)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "hybrid_prefix_bench.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "hybrid_prefix_bench.png")
    args = ap.parse_args()
    cfgs = [c for c in args.configs.split(",") if c]
    if any(c.startswith("llama") for c in cfgs) and not args.llama_server.exists():
        log(f"{args.llama_server} missing (LLAMA_WITH_SERVER=1 bench/peer/build_llama.sh): llama-server configs skipped")
        cfgs = [c for c in cfgs if not c.startswith("llama")]
    results, load = {}, {"before": loadavg()}
    for c in cfgs:
        results[c] = run_config(c, args)
    load["after"] = loadavg()
    anomalies = []
    if "kvserve-cache" in results and "kvserve-nocache" in results:
        a, b = results["kvserve-cache"]["requests"], results["kvserve-nocache"]["requests"]
        for x, y in zip(a, b):
            if x["text"] != y["text"]:
                anomalies.append({"what": "kvserve output differs with the cache on", "rep": x["rep"], "q": x["q"]})
    summary = {c: {k: v for k, v in r.items() if k != "requests"} for c, r in results.items()}
    if "kvserve-cache" in results:
        for c in results:
            if c != "kvserve-cache":
                summary["kvserve-cache"][f"warm_ttft_ratio_vs_{c}"] = results["kvserve-cache"]["ttft_warm_p50"] / results[c]["ttft_warm_p50"]
    doc = {"model": str(args.model), "threads": args.threads, "repeats": args.repeats, "questions": args.questions,
           "doc_words": args.doc_words, "passage_words": args.passage_words,
           "loadavg": load, "summary": summary, "anomalies": anomalies, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=2))
    for c, s in summary.items():
        log(f"{c:24s} cold {s['ttft_cold_p50']:.3f}s  warm {s['ttft_warm_p50']:.3f}s  warm/cold {s['warm_over_cold']:.3f}  "
            f"cached p50 {s['warm_cached_p50']} of {s['prompt_tokens_p50']}")
    if anomalies:
        log(f"ANOMALIES: {anomalies}")
    n = int(statistics.median([s["prompt_tokens_p50"] for s in summary.values()]))
    plot(summary, args.plot, f"Gemma 3 270M (sliding window 512): time to first token, ~{n}-token prompts"
         + (f"\nthe shared prefix ends {n - int(summary[cfgs[0]]['warm_cached_p50'] or 0)} tokens before the prompt's end"
            if args.passage_words else ""))
    log(f"json: {args.out}")
    return 1 if anomalies else 0


if __name__ == "__main__":
    sys.exit(main())
