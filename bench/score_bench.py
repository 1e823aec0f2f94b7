#!/usr/bin/env python3
"""What scoring a prompt costs: lm-eval-harness's loglikelihood payload against a plain prefill.

Starts `kvserve serve` on the default model, cuts the text (`make text`) into `--windows` windows
of `--tokens` tokens and sends them as one completions request in OpenAI's batch form (token-id
prompts), each round with a fresh `cache_salt` so no page comes from the prefix cache:

- plain: `max_tokens: 1` (the prefill, one logit row per prompt);
- score: lm-eval-harness's payload (`echo: true, logprobs: 1, max_tokens: 1`): a logit row,
  its log-softmax, rank and top 1 at every position.

Scored tok/s = the prompts' tokens / the request's wall time. The JSON keeps every round, the
medians and score / plain; the score rounds' mean NLL (the windows' perplexity, every position
after the first) is printed beside `kvserve perplexity`'s kind of figure.

    python3 bench/score_bench.py --windows 8 --tokens 512 --repeats 3 --out bench/out/score_bench.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import sys
import time

import requests

from structured_bench import start

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bin", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--text", default=os.path.join(ROOT, "data", "text", "pride_and_prejudice.txt"))
    ap.add_argument("--windows", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--port", type=int, default=18791)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "score_bench.json"))
    a = ap.parse_args()

    url = f"http://127.0.0.1:{a.port}"
    proc = start(a.bin, a.port, "--max-model-len", str(a.tokens + 8), "--kv-cache-memory", "512MiB")
    try:
        with open(a.text, encoding="utf-8") as f:
            text = f.read(a.windows * a.tokens * 8)
        ids = requests.post(url + "/tokenize", json={"prompt": text, "add_special_tokens": False}, timeout=60).json()["tokens"]
        if len(ids) < a.windows * a.tokens:
            sys.exit(f"the text has {len(ids)} tokens, fewer than {a.windows} x {a.tokens}")
        windows = [ids[i * a.tokens:(i + 1) * a.tokens] for i in range(a.windows)]
        n_tok = a.windows * a.tokens
        rounds, nll = [], None
        for rep in range(a.repeats):
            for mode in ("plain", "score"):
                body = {"prompt": windows, "max_tokens": 1, "temperature": 0, "cache_salt": f"score-bench-{rep}-{mode}"}
                if mode == "score":
                    body.update(echo=True, logprobs=1)
                t0 = time.perf_counter()
                r = requests.post(url + "/v1/completions", json=body, timeout=600)
                dt = time.perf_counter() - t0
                r.raise_for_status()
                j = r.json()
                assert j["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
                if mode == "score":
                    lps = [lp for c in j["choices"] for lp in c["logprobs"]["token_logprobs"][1:a.tokens]]
                    nll = -sum(lps) / len(lps)
                rounds.append({"repeat": rep, "mode": mode, "seconds": dt, "tok_s": n_tok / dt})
                print(f"[{rep + 1}/{a.repeats}] {mode:5s} {n_tok / dt:8.1f} tok/s ({dt:.2f} s)", file=sys.stderr, flush=True)
        med = {m: statistics.median(x["tok_s"] for x in rounds if x["mode"] == m) for m in ("plain", "score")}
        out = {
            "host": {"cpu": platform.processor() or platform.machine(), "nproc": os.cpu_count()},
            "model": "SmolLM2-135M-Instruct.Q4_1 (the server's default)",
            "windows": a.windows, "tokens_per_window": a.tokens, "repeats": a.repeats,
            "median_tok_s": med, "score_over_plain": med["score"] / med["plain"],
            "score_mean_nll": nll, "score_perplexity": math.exp(nll) if nll is not None else None,
            "rounds": rounds,
        }
        os.makedirs(os.path.dirname(a.out), exist_ok=True)
        with open(a.out, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=1)
        print(json.dumps({k: out[k] for k in ("median_tok_s", "score_over_plain", "score_perplexity")}, indent=1))
    finally:
        proc.terminate()
        proc.wait(timeout=30)


if __name__ == "__main__":
    main()
