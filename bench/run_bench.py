#!/usr/bin/env python3
"""`make bench`: the headline comparison against llama.cpp (bench/peer/compare.py) for
prefill and decode at depth 0, then the kernel micro-benchmarks (build/bench_matmul).
Results land in bench/out/ as JSON (and PNG plots)."""
import argparse
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", default=os.environ.get("BENCH_ROUNDS", "5"),
                    help="compare.py rounds (default: $BENCH_ROUNDS or 5)")
    ap.add_argument("--no-kernels", action="store_true",
                    help="skip the kernel micro-benchmarks (the whole bench_matmul suite: many minutes)")
    a = ap.parse_args()
    os.makedirs(os.path.join(ROOT, "bench/out"), exist_ok=True)
    subprocess.run([sys.executable, "bench/peer/compare.py", "--rounds", str(a.rounds)], check=True, cwd=ROOT)
    mm = os.path.join(ROOT, "build/bench_matmul")
    if os.path.exists(mm) and not a.no_kernels:
        print("kernel micro-benchmarks: bench/out/matmul.json", file=sys.stderr)
        subprocess.run([mm, "--benchmark_format=console", "--benchmark_out=bench/out/matmul.json",
                        "--benchmark_out_format=json", "--benchmark_repetitions=3",
                        "--benchmark_report_aggregates_only=true"], check=True, cwd=ROOT)


if __name__ == "__main__":
    main()
