#!/usr/bin/env python3
"""Quality per KV page dtype: `kvserve perplexity` for every dtype against an f32-KV base.

Runs the base once (f32 pages, --save-logits), then every dtype (and any mixed-precision
layer map) with --kld-base, on the same text and windows, and prints the markdown table of
docs/kv_quality.md: KV bytes per token, PPL, ΔPPL vs f32, mean and p99 KL divergence, top-1
agreement, and the issue's bar where there is one (int8 ≤ +0.2%, fp8_e4m3 ≤ +0.5%,
int4 ≤ +2%, at ctx 1024).

  python3 bench/kv_quality.py --model models/gemma-3-270m-Q4_K_M.gguf --ctx 1024 --chunks 25
  python3 bench/kv_quality.py --ctx 1024 --chunks 25 --mixed "int4:0-1:f16,28-29:f16"

Output: bench/out/kv_quality_<model stem>_ctx<N>.json (one record per run) and the table on
stdout. Progress goes to stderr. Needs build/kvserve (make build) and the text (make text).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DTYPES = ["f16", "bf16", "int8", "fp8_e4m3", "fp8_e5m2", "int4"]
BARS = {"int8": 0.2, "fp8_e4m3": 0.5, "int4": 2.0}  # ΔPPL %, at ctx 1024


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args, dtype: str, layers: str | None, extra: list[str]) -> dict:
    cmd = [str(args.kvserve), "perplexity", "-m", str(args.model), "-f", str(args.text), "--ctx", str(args.ctx),
           "--threads", str(args.threads), "--kv-cache-dtype", dtype, "--json"] + extra
    if args.chunks:
        cmd += ["--chunks", str(args.chunks)]
    if layers:
        cmd += ["--kv-cache-dtype-layers", layers]
    log("$ " + " ".join(cmd))
    t0 = time.time()
    p = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if p.returncode != 0:
        raise SystemExit(f"kvserve perplexity failed ({p.returncode}):\n{p.stderr[-2000:]}")
    j = json.loads(p.stdout)
    log(f"  {dtype}{' + ' + layers if layers else ''}: PPL {j['ppl']:.4f} ({time.time() - t0:.0f} s)")
    return j


def row(j: dict, ctx: int) -> str:
    d = j["kv_cache_dtype"] + (", layers " + j["kv_cache_dtype_layers"] if j.get("kv_cache_dtype_layers") else "")
    k = j.get("kld")
    if not k:
        return f"| {d} (base) | {j['kv_bytes_per_token']:,.0f} | {j['ppl']:.4f} | base | | | | |"
    rel = 100 * j["delta_ppl"] / (j["ppl"] - j["delta_ppl"])
    bar = ""
    if j["kv_cache_dtype"] in BARS and not j.get("kv_cache_dtype_layers") and ctx == 1024:
        b = BARS[j["kv_cache_dtype"]]
        bar = f"≤ +{b}%: " + ("met" if rel <= b else "**not met**")
    return (f"| {d} | {j['kv_bytes_per_token']:,.0f} | {j['ppl']:.4f} | {j['delta_ppl']:+.4f} ({rel:+.2f}%) | "
            f"{k['mean']:.2e} | {k['p99']:.2e} | {100 * j['top1_agreement']:.2f}% | {bar} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--text", type=Path, default=ROOT / "data" / "text" / "pride_and_prejudice.txt")
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--chunks", type=int, default=25, help="windows scored (0: the whole text)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default=",".join(DTYPES))
    ap.add_argument("--mixed", action="append", default=[], help='DTYPE:LAYERMAP, e.g. "int4:0-1:f16,28-29:f16" (repeatable)')
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    out = args.out or ROOT / "bench" / "out" / f"kv_quality_{args.model.stem}_ctx{args.ctx}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    base_file = out.with_suffix(".base.bin")
    runs = [run(args, "f32", None, ["--save-logits", str(base_file)])]
    kld = ["--kld-base", str(base_file)]
    for d in [d for d in args.dtypes.split(",") if d]:
        runs.append(run(args, d, None, kld))
    for m in args.mixed:
        d, layers = m.split(":", 1)
        runs.append(run(args, d, layers, kld))
    out.write_text(json.dumps({"model": str(args.model), "text": str(args.text), "ctx": args.ctx, "chunks": args.chunks,
                               "runs": runs}, indent=2))
    print("| KV dtype | KV bytes/token | PPL | ΔPPL vs f32 | mean KLD | KLD p99 | same top-1 | bar |")
    print("|---|---|---|---|---|---|---|---|")
    for j in runs:
        print(row(j, args.ctx))
    log(f"json: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
