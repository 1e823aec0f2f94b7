#!/usr/bin/env python3
"""Quality of the long-context KV policies: `kvserve perplexity` with each policy and budget.

For every text, context length, policy and budget (a fraction of the window), runs
`kvserve perplexity --kv-eviction P --kv-budget B` (or `--kv-sparse quest --kv-sparse-pages K`)
and the full cache on the same windows. The first half of each window is the prompt, the rest
is decoded token by token (teacher forcing) and scored, so the model sees exactly what the
policy kept at each step (tools/cmd_perplexity.cpp, kv/kv_eviction.h).

  python3 bench/eviction_quality.py                       # SmolLM2, both texts, 4k and 8k
  python3 bench/eviction_quality.py --ctx 4096 --texts data/text/emma.txt --chunks 1

Output: bench/out/eviction_quality_<model stem>.json (one record per run), a markdown table on
stdout (ΔPPL % vs the full cache) and docs/eviction_quality.png (ΔPPL vs budget per policy).
Progress on stderr. Needs build/kvserve (make build) and the texts (make text).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
POLICIES = ["window", "sinks", "h2o", "snapkv", "quest"]
FRACTIONS = [0.125, 0.25, 0.5]


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args, text: Path, ctx: int, chunks: int, extra: list[str]) -> dict:
    cmd = [str(args.kvserve), "perplexity", "-m", str(args.model), "-f", str(text), "--ctx", str(ctx), "--chunks", str(chunks),
           "--kv-cache-memory", args.kv_memory, "--json"] + extra
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr}")
    r = json.loads(p.stdout)
    r["wall_s"] = time.time() - t0
    return r


def policy_args(policy: str, budget: int, bs: int) -> list[str]:
    if policy == "quest":  # pages read per query beyond the sink and own pages
        return ["--kv-sparse", "quest", "--kv-sparse-pages", str(max(1, budget // bs))]
    return ["--kv-eviction", policy, "--kv-budget", str(budget)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--texts", type=Path, nargs="+",
                    default=[ROOT / "data" / "text" / "pride_and_prejudice.txt", ROOT / "data" / "text" / "emma.txt"])
    ap.add_argument("--ctx", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--chunks", type=int, nargs="+", default=[2, 1], help="windows per context length (same order as --ctx)")
    ap.add_argument("--policies", nargs="+", default=POLICIES)
    ap.add_argument("--fractions", type=float, nargs="+", default=FRACTIONS)
    ap.add_argument("--kv-memory", default="1GiB")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "eviction_quality.png")
    ap.add_argument("--replot", action="store_true", help="no runs: the table and plot from --out's records")
    args = ap.parse_args()
    chunks = dict(zip(args.ctx, args.chunks + [args.chunks[-1]] * len(args.ctx)))
    out = args.out or ROOT / "bench" / "out" / f"eviction_quality_{args.model.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)

    if args.replot:  # table and plot from an earlier run's records
        records = json.loads(out.read_text())
        report(args, records)
        return
    records = []
    n_runs = len(args.texts) * len(args.ctx) * (1 + len(args.policies) * len(args.fractions))
    done = 0
    t_start = time.time()
    for text in args.texts:
        for ctx in args.ctx:
            base = run(args, text, ctx, chunks[ctx], [])
            done += 1
            log(f"[{done}/{n_runs}] {text.stem} ctx {ctx} full cache: PPL {base['ppl']:.4f} ({base['wall_s']:.0f} s)")
            records.append({"text": text.stem, "ctx": ctx, "policy": "full", "fraction": 1.0, "budget": ctx,
                            "ppl": base["ppl"], "ppl_stderr": base["ppl_stderr"], "delta_pct": 0.0, "run": base})
            for policy in args.policies:
                for frac in args.fractions:
                    budget = int(ctx * frac)
                    r = run(args, text, ctx, chunks[ctx], policy_args(policy, budget, args.block_size))
                    d = 100.0 * (r["ppl"] / base["ppl"] - 1.0)
                    done += 1
                    el = time.time() - t_start
                    log(f"[{done}/{n_runs}] {text.stem} ctx {ctx} {policy} {frac:.1%} (budget {budget}): PPL {r['ppl']:.4f} "
                        f"({d:+.2f}%), {r['wall_s']:.0f} s, ETA {el / done * (n_runs - done) / 60:.0f} min")
                    records.append({"text": text.stem, "ctx": ctx, "policy": policy, "fraction": frac, "budget": budget,
                                    "ppl": r["ppl"], "ppl_stderr": r["ppl_stderr"], "delta_pct": d, "run": r})
                    out.write_text(json.dumps(records, indent=1))
    report(args, records)


def report(args, records: list[dict]) -> None:
    out = args.out or ROOT / "bench" / "out" / f"eviction_quality_{args.model.stem}.json"
    # markdown: one row per (text, ctx, policy), columns per budget fraction
    print("| text | ctx | full PPL | policy | " + " | ".join(f"{f:.1%} budget" for f in args.fractions) + " |")
    print("|---|---|---|---|" + "---|" * len(args.fractions))
    for text in args.texts:
        for ctx in args.ctx:
            base = next(r for r in records if r["text"] == text.stem and r["ctx"] == ctx and r["policy"] == "full")
            for policy in args.policies:
                cells = []
                for f in args.fractions:
                    r = next(r for r in records if r["text"] == text.stem and r["ctx"] == ctx and r["policy"] == policy and r["fraction"] == f)
                    cells.append(f"{r['ppl']:.3f} ({r['delta_pct']:+.2f}%)")
                print(f"| {text.stem} | {ctx} | {base['ppl']:.3f} | {policy} | " + " | ".join(cells) + " |")
    log(f"wrote {out}")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    panels = [(t.stem, c) for t in args.texts for c in args.ctx]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.6), squeeze=False)
    for ax, (t, c) in zip(axes[0], panels):
        for policy in args.policies:
            pts = sorted((r["fraction"], r["delta_pct"]) for r in records if r["text"] == t and r["ctx"] == c and r["policy"] == policy)
            ax.plot([100 * p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
        ax.axhline(0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks([100 * f for f in args.fractions], [f"{100 * f:g}%" for f in args.fractions])
        ax.set_yscale("symlog", linthresh=1)
        ax.set_title(f"{t}, ctx {c}", fontsize=9)
        ax.set_xlabel("KV budget (quest: pages read)")
        ax.set_ylabel("ΔPPL vs full cache (%)")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{args.model.stem}: perplexity under each KV policy (lower is better)", fontsize=10)
    fig.tight_layout()
    args.plot.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.plot, dpi=110)
    log(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
