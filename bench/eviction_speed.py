#!/usr/bin/env python3
"""Decode speed under each long-context KV policy: `kvserve bench --context C` per policy.

For each context length, the full cache, then each eviction policy at a budget of a fraction
of the context (the context is prefilled, compressed at its end, then decoded from), and Quest
reading that fraction of the pages. Medians over --repeat within a run of `kvserve bench`; with
--rounds N every policy runs once per round, rounds one after another (so a slow minute on a
shared host hits every policy, not one), and the table gives medians over the rounds: tok/s, and
the ratio against the full cache of the same context *in the same round*.

  python3 bench/eviction_speed.py                        # SmolLM2, 1k..8k, 25% budgets
  python3 bench/eviction_speed.py --contexts 8192 --fraction 0.25 --kv-dtype int8
  python3 bench/eviction_speed.py --contexts 8192 --rounds 5 --repeat 1

Output: bench/out/eviction_speed_<model stem>.json, a markdown table on stdout and
docs/eviction_speed.png (decode tok/s vs context per policy). Progress on stderr.
Run on an idle machine: 2 cores, nothing else running.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ["full", "sinks", "h2o", "snapkv", "quest"]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--contexts", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    ap.add_argument("--fraction", type=float, default=0.25)
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1, help="every policy once per round, rounds interleaved")
    ap.add_argument("--kv-dtype", default="f16")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "eviction_speed.png")
    args = ap.parse_args()
    out = args.out or ROOT / "bench" / "out" / f"eviction_speed_{args.model.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: load average {load:.2f}: another process may skew the numbers")

    recs = []
    n_total = len(args.contexts) * len(args.policies) * args.rounds
    t0 = time.time()
    for rnd, ctx, policy in ((k, c, p) for k in range(args.rounds) for c in args.contexts for p in args.policies):
        if True:
            budget = int(ctx * args.fraction)
            extra = []
            if policy == "quest":
                extra = ["--kv-sparse", "quest", "--kv-sparse-pages", str(max(1, budget // 16))]
            elif policy != "full":
                extra = ["--kv-eviction", policy, "--kv-budget", str(budget)]
            cmd = [str(args.kvserve), "bench", "-m", str(args.model), "-p", "0", "-n", str(args.gen), "--context", str(ctx),
                   "--repeat", str(args.repeat), "--kv-cache-dtype", args.kv_dtype, "--kv-cache-memory", "1GiB", "--json"] + extra
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if p.returncode != 0:
                sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr}")
            r = json.loads(p.stdout)
            recs.append({"round": rnd, "context": ctx, "policy": policy, "budget": budget if policy != "full" else ctx,
                         "decode_tok_s": r["decode_tok_s"], "decode_tok_s_min": r["decode_tok_s_min"],
                         "decode_tok_s_max": r["decode_tok_s_max"], "run": r})
            el = time.time() - t0
            log(f"[{len(recs)}/{n_total}] round {rnd + 1} ctx {ctx} {policy}: {r['decode_tok_s']:.1f} tok/s "
                f"(ETA {el / len(recs) * (n_total - len(recs)) / 60:.1f} min)")
            out.write_text(json.dumps({"kv_dtype": args.kv_dtype, "fraction": args.fraction, "load_avg_start": load,
                                       "rounds": args.rounds, "records": recs}, indent=1))
    # medians over rounds: tok/s, and each round's ratio against that round's full cache
    full = {(r["round"], r["context"]): r["decode_tok_s"] for r in recs if r["policy"] == "full"}
    summary = []
    for ctx in args.contexts:
        for p in args.policies:
            rs = [r for r in recs if r["context"] == ctx and r["policy"] == p]
            ratios = [r["decode_tok_s"] / full[(r["round"], ctx)] for r in rs if (r["round"], ctx) in full]
            summary.append({"context": ctx, "policy": p, "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rs),
                            "ratio_vs_full": statistics.median(ratios) if ratios else None,
                            "ratio_min": min(ratios) if ratios else None, "ratio_max": max(ratios) if ratios else None})
    out.write_text(json.dumps({"kv_dtype": args.kv_dtype, "fraction": args.fraction, "load_avg_start": load,
                               "rounds": args.rounds, "summary": summary, "records": recs}, indent=1))
    print("| context | " + " | ".join(f"{p}" + ("" if p == "full" else f" {args.fraction:.0%}") for p in args.policies) + " |")
    print("|---|" + "---|" * len(args.policies))
    for ctx in args.contexts:
        cells = []
        for p in args.policies:
            m = next(x for x in summary if x["context"] == ctx and x["policy"] == p)
            cells.append(f"{m['decode_tok_s']:.1f}" + ("" if p == "full" else f" ({m['ratio_vs_full']:.2f}×)"))
        print(f"| {ctx} | " + " | ".join(cells) + " |")
    if args.rounds > 1:
        print(f"\nratio vs full per round (min..max over {args.rounds} rounds): " + "; ".join(
            f"{x['context']} {x['policy']} {x['ratio_min']:.2f}..{x['ratio_max']:.2f}" for x in summary if x["policy"] != "full"))
    log(f"wrote {out}")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for p in args.policies:
        pts = [(x["context"], x["decode_tok_s"]) for x in summary if x["policy"] == p]
        ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=p + ("" if p == "full" else f" {args.fraction:.0%}"))
    ax.set_xscale("log", base=2)
    ax.set_xticks(args.contexts, [str(c) for c in args.contexts])
    ax.set_xlabel("context (tokens)")
    ax.set_ylabel("decode tok/s (batch 1)")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    ax.set_title(f"{args.model.stem}, {args.kv_dtype} KV: decode speed per KV policy", fontsize=9)
    fig.tight_layout()
    fig.savefig(args.plot, dpi=110)
    log(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
