#!/usr/bin/env python3
"""Jump-forward under structured outputs (docs/structured_output.md): answer speed with and without.

The same server binary runs twice per repeat, with its default (--jump-forward-tokens 16) and
with --jump-forward-tokens 0, in alternating order. Each run answers the same chat requests
constrained by a JSON schema (greedy, or seeded at --temperature: either way both runs must give
the same texts, checked), first one
at a time (1 user), then --users at once. Reported per setting: generated tokens per second of
wall time over the whole run (prefill and HTTP included, as a client sees it), engine steps, and
the jump-forward counters (forced tokens put into steps, and those the model took).

  python3 bench/jump_forward_bench.py                  # 3 repeats, 12 requests, 1 and 4 users
  python3 bench/jump_forward_bench.py --whitespace any # vLLM's default free whitespace

Output: bench/out/jump_forward_bench.json and bench/out/jump_forward_bench.png.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import ROOT, DEFAULT_MODEL, Server, free_port, log, scrape_metrics  # noqa: E402

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "occupation": {"type": "string"},
        "favourite_colour": {"type": "string", "enum": ["red", "green", "blue", "yellow"]},
        "is_student": {"type": "boolean"},
        "hometown": {"type": "string"},
    },
    "required": ["name", "age", "occupation", "favourite_colour", "is_student", "hometown"],
    "additionalProperties": False,
}
WHO = ["a pirate", "a cat", "a teacher from Paris", "a student", "a dog", "a king", "a doctor", "an old sailor",
       "a child", "a chef", "a robot", "a farmer", "a painter", "a pilot", "a baker", "a nurse"]


def ask(port: int, model: str, who: str, max_tokens: int, no_ws: bool, temperature: float = 0.0, seed: int = 0) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": f"Describe {who} as JSON."}], "max_tokens": max_tokens,
            "temperature": temperature, "seed": seed, "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}
    if no_ws:
        body["structured_outputs"] = {"disable_any_whitespace": True}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        out = json.loads(r.read())
    return {"text": out["choices"][0]["message"]["content"], "tokens": out["usage"]["completion_tokens"]}


def workload(port: int, model: str, prompts: list[str], users: int, max_tokens: int, no_ws: bool, temperature: float) -> dict:
    results: list[dict | None] = [None] * len(prompts)
    nxt = iter(range(len(prompts)))
    lock = threading.Lock()

    def user():
        while True:
            with lock:
                i = next(nxt, None)
            if i is None:
                return
            results[i] = ask(port, model, prompts[i], max_tokens, no_ws, temperature, seed=1000 + i)

    m0 = scrape_metrics(port)
    t0 = time.perf_counter()
    ts = [threading.Thread(target=user) for _ in range(users)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    m1 = scrape_metrics(port)
    d = lambda k: m1.get(k, 0.0) - m0.get(k, 0.0)  # noqa: E731
    tokens = sum(r["tokens"] for r in results)
    return {"users": users, "requests": len(prompts), "tokens": tokens, "wall_s": wall, "tok_s": tokens / wall,
            "steps": d("kvserve:engine_steps_total"),
            "forced_tokens": d("kvserve:jump_forward_draft_tokens_total"),
            "forced_taken": d("kvserve:jump_forward_accepted_tokens_total"),
            "texts": [r["text"] for r in results]}


def plot(res: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    users = sorted({int(k) for k in res["summary"]["on"]})
    fig, ax = plt.subplots(figsize=(6, 3.5))
    w = 0.38
    for j, (setting, label) in enumerate((("off", "jump-forward off"), ("on", "jump-forward on (default)"))):
        vals = [res["summary"][setting][str(u)]["tok_s"] for u in users]
        bars = ax.bar([i + (j - 0.5) * w for i in range(len(users))], vals, w, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=8)
    ax.set_xticks(range(len(users)), [f"{u} user{'s' if u > 1 else ''}" for u in users])
    ax.set_ylabel("generated tok/s (wall, medians)")
    t = res["params"]["temperature"]
    ax.set_title(f"JSON-schema answers, {Path(res['model']).name}, " + ("greedy" if t == 0 else f"T={t:g}, seeded"), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=12)
    ap.add_argument("--users", type=int, default=4, help="concurrent users of the second workload (the first is 1)")
    ap.add_argument("--max-tokens", type=int, default=120)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy; above: sampled with a seed per request (the texts must still match)")
    ap.add_argument("--whitespace", choices=["none", "any"], default="none",
                    help="none: disable_any_whitespace (the JSON's layout is forced too); any: vLLM's default")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "jump_forward_bench.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "jump_forward_bench.png")
    a = ap.parse_args()
    prompts = [WHO[i % len(WHO)] + ("" if i < len(WHO) else f" number {i}") for i in range(a.requests)]
    runs = {"on": [], "off": []}
    mismatches = 0
    for rep in range(a.repeats):
        order = ("on", "off") if rep % 2 == 0 else ("off", "on")
        texts = {}
        for setting in order:
            port = free_port()
            cmd = [str(a.kvserve), "serve", "-m", str(a.model), "--port", str(port), "--threads", str(a.threads)]
            if setting == "off":
                cmd += ["--jump-forward-tokens", "0"]
            srv = Server(f"kvserve[{setting}]", cmd, port, ROOT / "bench" / "out" / "jump_forward_logs" / f"{setting}.log")
            srv.start(120)
            try:
                for users in (1, a.users):
                    r = workload(port, srv.model_id, prompts, users, a.max_tokens, a.whitespace == "none", a.temperature)
                    texts[(setting, users)] = r.pop("texts")
                    r["repeat"] = rep
                    runs[setting].append(r)
                    log(f"rep {rep} {setting:3s} users {users}: {r['tok_s']:.1f} tok/s, {r['steps']:.0f} steps, "
                        f"forced {r['forced_tokens']:.0f} taken {r['forced_taken']:.0f}")
            finally:
                srv.stop()
        for users in (1, a.users):
            mismatches += sum(x != y for x, y in zip(texts[("on", users)], texts[("off", users)]))
    summary = {s: {str(u): {k: statistics.median(r[k] for r in runs[s] if r["users"] == u)
                            for k in ("tok_s", "steps", "forced_tokens", "forced_taken", "wall_s")}
                   for u in (1, a.users)} for s in runs}
    res = {"benchmark": "jump_forward_bench", "host": platform.node(), "cpu": platform.processor() or platform.machine(),
           "model": str(a.model), "params": vars(a) | {"model": str(a.model), "kvserve": str(a.kvserve), "out": str(a.out),
                                                       "plot": str(a.plot)},
           "summary": summary, "ratio_on_off": {str(u): summary["on"][str(u)]["tok_s"] / summary["off"][str(u)]["tok_s"]
                                                for u in (1, a.users)},
           "text_mismatches": mismatches, "runs": runs}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(res, indent=2))
    log(f"wrote {a.out}")
    if plot(res, a.plot):
        log(f"wrote {a.plot}")
    for u in (1, a.users):
        on, off = summary["on"][str(u)], summary["off"][str(u)]
        print(f"{u} user(s): on {on['tok_s']:.1f} tok/s ({on['steps']:.0f} steps, {on['forced_taken']:.0f} of "
              f"{on['forced_tokens']:.0f} forced tokens taken) vs off {off['tok_s']:.1f} ({off['steps']:.0f} steps): "
              f"x{on['tok_s'] / off['tok_s']:.2f}")
    print(f"answers that differ between on and off: {mismatches} (must be 0)")
    return 0 if mismatches == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
