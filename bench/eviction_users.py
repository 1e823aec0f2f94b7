#!/usr/bin/env python3
"""Decode speed of many long conversations under each KV policy, through the server.

`eviction_speed.py` measures one sequence (`kvserve bench --context C`): there every token
reads all the weights once, so a 25% budget can at best be (W + K) / (W + K/4) faster than
the full cache (about 2.0x for SmolLM2 at 8k, where the weights W are 97 MB and the f16 KV of
8k tokens K is 189 MB). A server holding long conversations decodes them together: the
weights are read once per step for all of them, each reads its own KV, and the KV is what
eviction shrinks. This script measures that case.

One server (`kvserve serve`, f16 KV, prefix cache on, started with `--kv-sparse quest` so that
Quest's key summaries exist; the other policies and the full cache are chosen per request by
the `kv_eviction` field). A document of C tokens (Pride and Prejudice) is prefilled once; then,
per policy, U users at once each send the document plus a question of their own (so each
sequence owns its tail) as a streamed completion of --gen tokens (temperature 0.7,
`ignore_eos`). The aggregate decode rate is counted in the window where all U are decoding:
from the last user's first token to the first user's last token, tokens received in that
window over its length. Policies run once per round, rounds interleaved; ratios are against
the full cache of the same round, then medians over rounds. The step profile of each run
(`kvserve:step_phase_seconds` from /metrics) is in the JSON.

The users share the document's pages (one prefill): a layer's shared KV (6 MB at 8k for
SmolLM2) stays in L3 while the users read it, so the full cache is bound by attention arithmetic
here, not by DRAM as distinct documents would be (docs/eviction.md, Decode speed).

  python3 bench/eviction_users.py                          # 16 users at 8k, 25% budgets
  python3 bench/eviction_users.py --users 4 16 --context 4096 --rounds 3

Output: bench/out/eviction_users_<model stem>.json, a markdown table on stdout and
docs/eviction_users.png. Progress on stderr. Run on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_bench import Server, free_port, log  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ["full", "sinks", "h2o", "snapkv", "quest"]


def post(port: int, path: str, body: dict, timeout: float = 600) -> dict:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def phase_sums(port: int) -> dict[str, float]:
    """kvserve:step_phase_seconds_sum per phase, from /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvserve:step_phase_seconds_sum{"):
            out[line.split('phase="')[1].split('"')[0]] = float(line.rsplit(" ", 1)[1])
    return out


def kv_field(policy: str, budget: int) -> dict:
    if policy == "full":
        return {"policy": "none"}  # the server keeps Quest's summaries; this request reads every page
    if policy == "quest":
        return {"sparse": "quest", "sparse_pages": max(1, budget // 16)}
    return {"policy": policy, "budget": budget}


def one_round(client, port: int, model_id: str, docs: list[list[int]], questions: list[list[int]], policy: str,
              budget: int, gen: int, seed: int) -> dict:
    """U streamed completions at once; the aggregate rate in the window where all decode."""
    n = len(questions)
    stamps: list[list[float]] = [[] for _ in range(n)]
    errors: list[str] = []
    kept: list[object] = [None] * n
    barrier = threading.Barrier(n)

    def user(i: int) -> None:
        try:
            barrier.wait()
            stream = client.completions.create(
                model=model_id, prompt=docs[i % len(docs)] + questions[i], max_tokens=gen, temperature=0.7, seed=seed + i, stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "kv_eviction": kv_field(policy, budget)})
            for ch in stream:
                if ch.choices and ch.choices[0].text:
                    stamps[i].append(time.perf_counter())
                if ch.usage is not None:
                    ev = (getattr(ch.usage, "model_extra", None) or {}).get("kv_eviction")
                    kept[i] = ev
        except Exception as e:  # noqa: BLE001
            errors.append(f"user {i}: {e}")

    threads = [threading.Thread(target=user, args=(i,)) for i in range(n)]
    before = phase_sums(port)
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    after = phase_sums(port)
    spent = {k: after[k] - before.get(k, 0.0) for k in after}
    total = sum(spent.values()) or 1.0
    if errors:
        raise RuntimeError("; ".join(errors[:3]))
    start = max(s[0] for s in stamps)
    end = min(s[-1] for s in stamps)
    in_window = sum(1 for s in stamps for x in s if start < x <= end)
    rate = in_window / (end - start) if end > start else float("nan")
    per_user = [(len(s) - 1) / (s[-1] - s[0]) for s in stamps if len(s) > 1]
    return {"aggregate_decode_tok_s": rate, "window_s": end - start, "tokens_in_window": in_window,
            "per_user_tok_s_median": statistics.median(per_user), "wall_s": wall,
            "chunks": [len(s) for s in stamps], "kv_eviction": kept[0],
            "step_phase_share": {k: v / total for k, v in spent.items()}, "step_seconds": total}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--text", type=Path, default=ROOT / "data" / "text" / "pride_and_prejudice.txt")
    ap.add_argument("--context", type=int, default=8192, help="document tokens")
    ap.add_argument("--users", type=int, nargs="+", default=[16])
    ap.add_argument("--distinct", action="store_true",
                    help="each user reads a document of its own (consecutive parts of --text and --text2): "
                         "every sequence's KV comes from DRAM, at the price of one prefill per user")
    ap.add_argument("--text2", type=Path, default=ROOT / "data" / "text" / "emma.txt")
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--gen", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--kv-cache-memory", default="6GiB")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "eviction_users.png")
    args = ap.parse_args()
    out = args.out or ROOT / "bench" / "out" / f"eviction_users_{args.model.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: load average {load:.2f}: another process may skew the numbers")

    from openai import OpenAI

    port = free_port()
    max_users = max(args.users)
    srv = Server("kvserve", [str(args.kvserve), "serve", "-m", str(args.model), "--port", str(port),
                             "--kv-sparse", "quest", "--kv-sparse-pages", "1", "--kv-cache-memory", args.kv_cache_memory,
                             "--max-num-seqs", str(max(16, max_users)),
                             "--max-model-len", str(args.context + 64 + args.gen),
                             "--past-trained-context"],  # an 8k document + question + answer passes SmolLM2's 8,192
                 port, ROOT / "bench" / "out" / "eviction_users_server.log")
    srv.start(120)
    client = OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", timeout=1200, max_retries=0)
    budget = int(args.context * args.fraction)
    recs = []
    try:
        ids = post(port, "/tokenize", {"prompt": args.text.read_text()})["tokens"]
        n_docs = max_users if args.distinct else 1
        if n_docs * args.context > len(ids):
            ids += post(port, "/tokenize", {"prompt": args.text2.read_text(), "add_special_tokens": False})["tokens"]
        if n_docs * args.context > len(ids):
            sys.exit(f"the texts have {len(ids)} tokens, fewer than {n_docs} documents of {args.context}")
        docs = [ids[k * args.context:(k + 1) * args.context] for k in range(n_docs)]
        questions = [post(port, "/tokenize", {"prompt": f"\n\nQuestion {i + 1}: what happens in chapter {i + 1}? Answer:",
                                              "add_special_tokens": False})["tokens"] for i in range(max_users)]
        for k, doc in enumerate(docs):
            t = time.time()
            log(f"prefilling {args.context}-token document {k + 1}/{len(docs)} once (prefix cache)")
            client.completions.create(model=srv.model_id, prompt=doc, max_tokens=1, temperature=0,
                                      extra_body={"kv_eviction": {"policy": "none"}})
            log(f"  {time.time() - t:.1f} s")
        n_total = args.rounds * len(args.users) * len(args.policies)
        t0 = time.time()
        for rnd in range(args.rounds):
            for u in args.users:
                for policy in args.policies:
                    r = one_round(client, port, srv.model_id, docs, questions[:u], policy, budget, args.gen, args.seed + 100 * rnd)
                    recs.append({"round": rnd, "users": u, "policy": policy,
                                 "budget": budget if policy != "full" else args.context, **r})
                    el = time.time() - t0
                    share = ", ".join(f"{k} {v:.0%}" for k, v in r["step_phase_share"].items() if v >= 0.01)
                    log(f"[{len(recs)}/{n_total}] round {rnd + 1} {u} users {policy}: {r['aggregate_decode_tok_s']:.1f} tok/s "
                        f"(window {r['window_s']:.1f} s; steps: {share}; ETA {el / len(recs) * (n_total - len(recs)) / 60:.1f} min)")
                    out.write_text(json.dumps({"context": args.context, "fraction": args.fraction, "records": recs}, indent=1))
    finally:
        srv.stop()

    full = {(r["round"], r["users"]): r["aggregate_decode_tok_s"] for r in recs if r["policy"] == "full"}
    summary = []
    for u in args.users:
        for p in args.policies:
            rs = [r for r in recs if r["users"] == u and r["policy"] == p]
            ratios = [r["aggregate_decode_tok_s"] / full[(r["round"], u)] for r in rs if (r["round"], u) in full]
            summary.append({"users": u, "policy": p,
                            "aggregate_decode_tok_s": statistics.median(r["aggregate_decode_tok_s"] for r in rs),
                            "ratio_vs_full": statistics.median(ratios) if ratios else None,
                            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None})
    out.write_text(json.dumps({"context": args.context, "fraction": args.fraction, "distinct": args.distinct, "load_avg_start": load,
                               "rounds": args.rounds, "summary": summary, "records": recs}, indent=1))
    print("| users | " + " | ".join(p + ("" if p == "full" else f" {args.fraction:.0%}") for p in args.policies) + " |")
    print("|---|" + "---|" * len(args.policies))
    for u in args.users:
        cells = []
        for p in args.policies:
            m = next(x for x in summary if x["users"] == u and x["policy"] == p)
            cells.append(f"{m['aggregate_decode_tok_s']:.1f}" + ("" if p == "full" else f" ({m['ratio_vs_full']:.2f}×)"))
        print(f"| {u} | " + " | ".join(cells) + " |")
    if args.rounds > 1:
        print(f"\nratio vs full per round (min..max over {args.rounds} rounds): " + "; ".join(
            f"{x['users']} users {x['policy']} {x['ratio_min']:.2f}..{x['ratio_max']:.2f}" for x in summary if x["policy"] != "full"))
    log(f"wrote {out}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    w = 0.8 / len(args.policies)
    for k, p in enumerate(args.policies):
        ys = [next(x for x in summary if x["users"] == u and x["policy"] == p)["aggregate_decode_tok_s"] for u in args.users]
        ax.bar([i + k * w for i in range(len(args.users))], ys, width=w,
               label=p + ("" if p == "full" else f" {args.fraction:.0%}"))
    ax.set_xticks([i + 0.4 - w / 2 for i in range(len(args.users))], [f"{u} users" for u in args.users])
    ax.set_ylabel("aggregate decode tok/s")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{args.model.stem}, f16 KV, {args.context}-token " + ("documents, one per user" if args.distinct else
                 "document shared") + ": decode per KV policy", fontsize=9)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    log(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
