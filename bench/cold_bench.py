#!/usr/bin/env python3
"""Hot and cold pages: a long conversation on a RAM budget, against everything in RAM.

Gemma 3 270M (32k context) by default. Three configurations, each measured in this run:
  full   every page in RAM, full attention (the quality and speed reference)
  quest  every page in RAM, Quest reads --sparse-pages pages per query
  cold   Quest as above, RAM budget --budget tokens per sequence (--kv-offload-cold): the
         least recently read pages live in a spill file and come back when Quest picks them;
         the KV pool itself is sized below the context, so the budget is what makes it fit.

Decode: `kvserve bench --context C -n G --repeat R` (tok/s, medians). Quality: `kvserve
perplexity --ctx C --chunks 1` on a real text (the first half of the window is the prompt, the
second half is scored token by token), for full and cold (--ppl-configs): quest and cold read
the same pages, so their logits are bit-identical (tests/unit/test_cold_pages.cpp).

  python3 bench/cold_bench.py                                   # 32000 tokens, 8192 in RAM
  python3 bench/cold_bench.py --context 8192 --budget 2048      # quicker

Output: bench/out/cold_bench_<model stem>.json, a markdown table on stdout, docs/cold_bench.png.
Progress on stderr. Run on an idle machine.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run_json(cmd: list[str]) -> tuple[dict, float]:
    log("$ " + " ".join(cmd))
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        log(p.stderr[-3000:])
        raise SystemExit(f"failed: {' '.join(cmd)}")
    return json.loads(p.stdout[p.stdout.find("{"):]), time.time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "gemma-3-270m-Q4_K_M.gguf")
    ap.add_argument("--text", type=Path, default=ROOT / "data" / "text" / "pride_and_prejudice.txt")
    ap.add_argument("--context", type=int, default=32000)
    ap.add_argument("--budget", type=int, default=8192, help="RAM budget of the cold configuration (tokens)")
    ap.add_argument("--sparse-pages", type=int, default=64)
    ap.add_argument("--gen", type=int, default=64)
    # Gemma 3's decode cannot roll back to the context (its sliding-window pages are gone), so
    # every repeat prefills the whole context again: one repeat by default.
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--configs", nargs="+", default=["full", "quest", "cold"])
    # quest and cold have the same logits (tests/unit/test_cold_pages.cpp): one PPL run of the two
    ap.add_argument("--ppl-configs", nargs="*", default=["full", "cold"])
    ap.add_argument("--resume", action="store_true", help="keep the configurations --out already holds")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "cold_bench.png")
    args = ap.parse_args()
    out = args.out or ROOT / "bench" / "out" / f"cold_bench_{args.model.stem}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: load average {load:.2f}: another process may skew the numbers")
    quest = ["--kv-sparse", "quest", "--kv-sparse-pages", str(args.sparse_pages)]
    # The cold run's pool: the budget plus what one step reads back (3 global layers pick their
    # own pages) and a margin; far below the context, so the budget is what makes it fit.
    cold_mem = f"{(args.budget + 4 * (args.sparse_pages + 8) * 16 + 2048) * 3 * 1024 // (1 << 20) + 24}MiB"  # + the sliding-window pool
    extra = {
        "full": ["--kv-cache-memory", "2GiB"],
        "quest": ["--kv-cache-memory", "2GiB", *quest],
        "cold": ["--kv-cache-memory", cold_mem, *quest, "--kv-offload-cold", "--kv-budget", str(args.budget)],
    }
    recs = {}
    if args.resume and out.exists():  # configurations measured by an earlier run of the same setup
        recs = {k: v for k, v in json.loads(out.read_text())["results"].items() if k in args.configs}
    t_start = time.time()
    steps = len(args.configs) + len([c for c in args.configs if c in args.ppl_configs])
    k = 0
    def save() -> None:
        res = {"model": args.model.name, "context": args.context, "budget": args.budget, "sparse_pages": args.sparse_pages,
               "gen": args.gen, "repeat": args.repeat, "cold_pool": cold_mem, "host": os.uname().nodename,
               "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
               "results": recs}
        out.write_text(json.dumps(res, indent=2) + "\n")

    for cfg in args.configs:
        if cfg in recs:
            log(f"{cfg}: kept from {out}")
            continue
        k += 1
        log(f"[{k}/{steps}] decode, {cfg} ({time.time() - t_start:.0f} s elapsed)")
        j, secs = run_json([str(args.kvserve), "bench", "-m", str(args.model), "-p", "0", "--context", str(args.context), "-n",
                            str(args.gen), "--repeat", str(args.repeat), "--json", *extra[cfg]])
        rec = {"decode_tok_s": j["decode_tok_s"], "decode_tok_s_min": j["decode_tok_s_min"], "decode_tok_s_max": j["decode_tok_s_max"],
               "context_prefill_s": j.get("context_prefill_s"), "bench_seconds": secs, "kv_cold_decode": j.get("kv_cold")}
        if cfg in args.ppl_configs:
            k += 1
            log(f"[{k}/{steps}] perplexity, {cfg} ({time.time() - t_start:.0f} s elapsed)")
            # cold: 128 scored positions a forward, so that what their Quest picks read back fits the small pool
            p, secs = run_json([str(args.kvserve), "perplexity", "-m", str(args.model), "-f", str(args.text), "--ctx",
                                str(args.context // 2 * 2), "--chunks", "1", "--json", *(["-b", "128"] if cfg == "cold" else []),
                                *extra[cfg]])
            rec.update({"ppl": p["ppl"], "ppl_stderr": p.get("ppl_stderr"), "ppl_seconds": secs, "kv_cold_ppl": p.get("kv_cold")})
        recs[cfg] = rec
        save()
        log(f"  {cfg}: {json.dumps(rec)}")
    save()
    log(f"wrote {out}")
    base = recs.get("full", {})
    print("| config | decode tok/s (min–max) | vs full | PPL | ΔPPL vs full |")
    print("|---|---|---|---|---|")
    for cfg, r in recs.items():
        ratio = r["decode_tok_s"] / base["decode_tok_s"] if base else float("nan")
        ppl = r.get("ppl")
        dppl = f"{(ppl / base['ppl'] - 1) * 100:+.2f}%" if ppl and base.get("ppl") else "–"
        print(f"| {cfg} | {r['decode_tok_s']:.1f} ({r['decode_tok_s_min']:.1f}–{r['decode_tok_s_max']:.1f}) | {ratio:.2f}× | "
              f"{ppl:.3f} | {dppl} |" if ppl else f"| {cfg} | {r['decode_tok_s']:.1f} | {ratio:.2f}× | – | – |")
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        names = list(recs)
        fig, axes = plt.subplots(1, 2, figsize=(9, 3.6))
        axes[0].bar(names, [recs[n]["decode_tok_s"] for n in names], color=["#888", "#4a8", "#48c"][: len(names)])
        axes[0].set_ylabel("decode tok/s")
        axes[0].set_title(f"decode at {args.context} tokens")
        pn = [n for n in names if "ppl" in recs[n]]
        if pn:
            axes[1].bar(pn, [recs[n]["ppl"] for n in pn], color=["#888", "#48c"][: len(pn)])
            axes[1].set_ylabel("perplexity")
            axes[1].set_title(f"PPL, {args.context}-token window")
        fig.suptitle(f"{args.model.stem}: cold pages, {args.budget} tokens of KV in RAM", fontsize=10)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=110)
        log(f"wrote {args.plot}")
    except ImportError:
        log("matplotlib missing: no plot")


if __name__ == "__main__":
    main()
