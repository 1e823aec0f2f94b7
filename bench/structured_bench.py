#!/usr/bin/env python3
"""What a structured-output constraint costs: decode tok/s with and without one, same requests.

Starts `kvserve serve` on the default model and runs, for each user count, clients that each
stream up to `--tokens` tokens of continued text at temperature 0.7, alternating the kinds of
round: free text (ignore_eos), a regex of lower-case words (`[a-z ]+`), a JSON schema (an array
of short strings), and a regex with a large counted repetition (`[a-z ]{800}`: every position a
new state of the compiled grammar, so xgrammar's per-state mask cache never hits). Decode
tok/s of a round = the tokens after each request's first / the time from the first request's
first token to the last request's last (prefill, HTTP set-up and the outputs' lengths left
out). The JSON keeps every round, the medians per kind and each kind's ratio to free text.

    python3 bench/structured_bench.py --users 1,8 --repeats 5 --out bench/out/structured_bench.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time

import requests

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests", "e2e"))


def start(bin_path: str, port: int, *extra: str) -> subprocess.Popen:
    """`kvserve serve` on the default model (also bench/score_bench.py's), once /health answers."""
    p = subprocess.Popen([bin_path, "serve", "--port", str(port), "--threads", "2", *(extra or ("--max-model-len", "1024"))],
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return p
        except requests.RequestException:
            pass
        time.sleep(0.1)
    p.kill()
    sys.exit("kvserve did not start")


def body(kind: str, n_tokens: int, seed: int) -> dict:
    b = {"prompt": "Here is a list of words about the sea:", "max_tokens": n_tokens, "temperature": 0.7, "seed": seed}
    if kind == "free":
        b["ignore_eos"] = True
    elif kind == "regex":
        b["guided_regex"] = "[a-z ]+"
    elif kind == "regex_counted":
        b["guided_regex"] = "[a-z ]{800}"
    elif kind == "json_schema":
        b["guided_json"] = {"type": "array", "items": {"type": "string", "maxLength": 12}}
    return b


def round_(url: str, kind: str, users: int, n_tokens: int, seed: int) -> dict:
    times = [[] for _ in range(users)]  # arrival time of each streamed token

    def one(i):
        b = body(kind, n_tokens, seed * 100 + i)
        b["stream"] = True
        with requests.post(url + "/v1/completions", json=b, stream=True, timeout=300) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith(b"data: {") and b'"text":""' not in line.replace(b" ", b""):
                    times[i].append(time.perf_counter())
    ts = [threading.Thread(target=one, args=(i,)) for i in range(users)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    firsts = [t[0] for t in times if t]
    lasts = [t[-1] for t in times if t]
    decoded = sum(max(0, len(t) - 1) for t in times)
    dt = max(lasts) - min(firsts) if firsts else 0.0
    return {"kind": kind, "users": users, "tokens": decoded, "seconds": dt, "tok_s": decoded / dt if dt > 0 else 0.0}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kvserve", default=os.path.join(ROOT, "build", "kvserve"))
    ap.add_argument("--users", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--port", type=int, default=18931)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "structured_bench.json"))
    a = ap.parse_args()
    proc = start(a.kvserve, a.port)
    url = f"http://127.0.0.1:{a.port}"
    kinds = ["free", "regex", "json_schema", "regex_counted"]
    rounds = []
    try:
        for kind in kinds:  # warm-up: the compiles, the prefix cache
            round_(url, kind, 1, 8, 0)
        for users in [int(u) for u in a.users.split(",")]:
            for rep in range(a.repeats):
                for kind in kinds:
                    r = round_(url, kind, users, a.tokens, rep + 1)
                    rounds.append(r)
                    print(f"[{users} users, repeat {rep + 1}/{a.repeats}] {kind}: {r['tok_s']:.1f} tok/s "
                          f"({r['tokens']} tokens)", file=sys.stderr, flush=True)
    finally:
        proc.terminate()
        proc.wait()
    summary = {}
    for users in sorted({r["users"] for r in rounds}):
        med = {k: statistics.median(r["tok_s"] for r in rounds if r["users"] == users and r["kind"] == k) for k in kinds}
        summary[str(users)] = {"median_tok_s": med, "ratio_to_free": {k: med[k] / med["free"] for k in kinds}}
        print(f"{users} users: " + ", ".join(f"{k} {med[k]:.1f} tok/s ({med[k] / med['free']:.3f})" for k in kinds),
              file=sys.stderr)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"host": os.uname().nodename, "tokens": a.tokens, "repeats": a.repeats, "rounds": rounds,
                   "summary": summary}, f, indent=1)


if __name__ == "__main__":
    main()
