#!/usr/bin/env python3
"""StreamingLLM re-indexing: what it costs within the trained context, what it buys past it.

A sequence with an evicting KV policy goes on past max_model_len: when its next position would be
the limit, the holes eviction left are closed and the kept keys re-rotated (kv/kv_reindex.h), so
its positions stay below the limit. `kvserve perplexity --max-model-len L` applies it while
teacher-forcing the second half of each window.

Part 1, the price (inside the trained context): for each text, 4k windows, a 25% budget, the
policy with original positions against the same policy re-indexing at an artificial limit L
(2304: re-indexed every ~1,300 tokens), and the full cache. ΔPPL against the full cache.

Part 2, past the trained context (SmolLM2: 8,192 positions): windows of 16,000 tokens (8,000 of
prompt, 8,000 decoded), per-token NLL by position for the full cache (positions up to 16k), sinks
at a 2,048 budget with original positions (up to 16k), and the same re-indexing at 8,192.

  python3 bench/reindex_quality.py                 # both parts (~6 min on 2 cores)
  python3 bench/reindex_quality.py --part 1

Output: bench/out/reindex_quality.json, markdown tables on stdout, docs/reindex_quality.png
(part 2's NLL by position). Progress on stderr. Needs build/kvserve and the texts (make text).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "py"))
from test_cli_perplexity import read_logits_file  # noqa: E402  (the --save-logits format)


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args, text: Path, ctx: int, chunks: int, extra: list[str], logits: Path | None = None) -> dict:
    cmd = [str(args.kvserve), "perplexity", "-m", str(args.model), "-f", str(text), "--ctx", str(ctx), "--chunks", str(chunks),
           "--kv-cache-memory", args.kv_memory, "--json", *extra]
    if logits is not None:
        cmd += ["--save-logits", str(logits), "--save-top-k", "1"]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"failed: {' '.join(cmd)}\n{p.stderr[-3000:]}")
    r = json.loads(p.stdout)
    r["wall_s"] = time.time() - t0
    r["args"] = extra
    if logits is not None:
        _, recs = read_logits_file(logits)
        r["nll_tokens"] = recs["nll"].tolist()
    log(f"  {text.stem} ctx {ctx} {' '.join(extra) or 'full cache'}: PPL {r['ppl']:.4f}, "
        f"re-indexed {r['kv_eviction']['reindexed_tokens_per_window']:.0f}/window ({r['wall_s']:.0f} s)")
    return r


def part1(args) -> list[dict]:
    log("part 1: the price of re-indexing inside the trained context")
    out = []
    budget = args.ctx1 // 4
    for text in args.texts:
        full = run(args, text, args.ctx1, 2, [])
        rows = {"text": text.stem, "ctx": args.ctx1, "budget": budget, "limit": args.limit1, "full": full["ppl"], "policies": {}}
        for policy in args.policies:
            ev = ["--kv-eviction", policy, "--kv-budget", str(budget)]
            orig = run(args, text, args.ctx1, 2, ev)
            re = run(args, text, args.ctx1, 2, ev + ["--max-model-len", str(args.limit1)])
            rows["policies"][policy] = {"original": orig["ppl"], "reindexed": re["ppl"],
                                        "reindexed_per_window": re["kv_eviction"]["reindexed_tokens_per_window"]}
        out.append(rows)
    return out


def part2(args, tmp: Path) -> dict:
    log(f"part 2: past the trained context ({args.trained} positions), windows of {args.ctx2}")
    text = args.texts[0]
    ev = ["--kv-eviction", "sinks", "--kv-budget", str(args.budget2)]
    runs = {
        "full cache (positions to 16k)": ["--past-trained-context"],
        f"sinks {args.budget2} (positions to 16k)": ev + ["--past-trained-context"],
        f"sinks {args.budget2}, re-indexed at {args.trained}": ev + ["--max-model-len", str(args.trained)],
    }
    res = {"text": text.stem, "ctx": args.ctx2, "trained": args.trained, "runs": {}}
    for name, extra in runs.items():
        r = run(args, text, args.ctx2, 2, extra, tmp / "l.bin")
        res["runs"][name] = {"ppl": r["ppl"], "nll_tokens": r["nll_tokens"],
                             "reindexed_per_window": r["kv_eviction"]["reindexed_tokens_per_window"]}
    return res


def bucketed(nll: list[float], first: int, n_scored: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean NLL per bucket of `width` positions, both windows together: (position centres, means)."""
    a = np.asarray(nll).reshape(-1, n_scored).mean(axis=0)  # [n_scored], averaged over windows
    n = n_scored // width
    return first + width * (np.arange(n) + 0.5), a[:n * width].reshape(n, width).mean(axis=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--texts", type=Path, nargs="+",
                    default=[ROOT / "data" / "text" / "pride_and_prejudice.txt", ROOT / "data" / "text" / "emma.txt"])
    ap.add_argument("--part", type=int, choices=[1, 2], help="run only this part")
    ap.add_argument("--policies", nargs="+", default=["sinks", "h2o", "snapkv"])
    ap.add_argument("--ctx1", type=int, default=4096)
    ap.add_argument("--limit1", type=int, default=2304)
    ap.add_argument("--ctx2", type=int, default=16000)
    ap.add_argument("--budget2", type=int, default=2048)
    ap.add_argument("--trained", type=int, default=8192, help="the model's trained context (SmolLM2: 8192)")
    ap.add_argument("--kv-memory", default="1GiB")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "reindex_quality.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "reindex_quality.png")
    args = ap.parse_args()
    for t in args.texts:
        if not t.exists():
            sys.exit(f"{t} is missing: run `make text`")
    res = {"model": args.model.name}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.out.exists() and args.part is not None:  # keep the other part's results
        res.update({k: v for k, v in json.loads(args.out.read_text()).items() if k.startswith("part")})
    with tempfile.TemporaryDirectory() as d:
        if args.part in (None, 1):
            res["part1"] = part1(args)
            args.out.write_text(json.dumps(res, indent=1))
        if args.part in (None, 2):
            res["part2"] = part2(args, Path(d))
    args.out.write_text(json.dumps(res, indent=1))
    log(f"wrote {args.out}")

    if "part1" in res:
        print(f"\nPart 1: ΔPPL vs the full cache, {args.ctx1}-token windows, budget {args.ctx1 // 4} (25%), "
              f"re-indexed at {args.limit1}\n")
        print("| text | full PPL | policy | original positions | re-indexed | re-indexed positions per window |")
        print("|---|---|---|---|---|---|")
        for row in res["part1"]:
            for p, v in row["policies"].items():
                d0 = 100 * (v["original"] / row["full"] - 1)
                d1 = 100 * (v["reindexed"] / row["full"] - 1)
                print(f"| {row['text']} | {row['full']:.3f} | {p} | {v['original']:.3f} ({d0:+.2f}%) | "
                      f"{v['reindexed']:.3f} ({d1:+.2f}%) | {v['reindexed_per_window']:.0f} |")
    if "part2" in res:
        p2 = res["part2"]
        first = p2["ctx"] // 2
        n_scored = p2["ctx"] - 1 - first
        print(f"\nPart 2: {p2['text']}, windows of {p2['ctx']} (prompt {first}), PPL of the decoded half and of the tokens "
              f"past position {p2['trained']}\n")
        print("| run | PPL, all decoded | PPL past the trained context | re-indexed positions per window |")
        print("|---|---|---|---|")
        for name, v in p2["runs"].items():
            a = np.asarray(v["nll_tokens"]).reshape(-1, n_scored)
            past = a[:, p2["trained"] - first:]
            print(f"| {name} | {v['ppl']:.3f} | {np.exp(past.mean()):.3f} | {v['reindexed_per_window']:.0f} |")
        try:
            import matplotlib
            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            log("matplotlib missing: no plot")
            return
        fig, ax = plt.subplots(figsize=(8, 4.5))
        for name, v in p2["runs"].items():
            x, y = bucketed(v["nll_tokens"], first, n_scored, 500)
            ax.plot(x, np.exp(y), marker="o", ms=3, label=name)
        ax.axvline(p2["trained"], color="grey", ls="--", lw=1)
        ax.text(p2["trained"], ax.get_ylim()[1], " trained context", va="top", fontsize=8, color="grey")
        ax.set_xlabel("position in the text (window of %d tokens, first %d are the prompt)" % (p2["ctx"], first))
        ax.set_ylabel("perplexity per 500 tokens")
        ax.set_title(f"{res['model']}: past the trained context, {p2['text']}")
        ax.legend(fontsize=8)
        fig.tight_layout()
        args.plot.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(args.plot, dpi=110)
        log(f"wrote {args.plot}")


if __name__ == "__main__":
    main()
