#!/usr/bin/env python3
"""The portable binary against a -march=native one: batch-1 prefill and decode, same machine, one run.

The default build is portable (no -march=native; the kernels pick AVX-512 / AVX2 / scalar code at
run time, docs/ARCHITECTURE.md §3). This measures what that costs against a binary compiled for
the machine itself, e.g. one built from the last commit before the change:

    git worktree add /tmp/native 4869a00 && cmake -S /tmp/native -B /tmp/native/build -G Ninja \\
        -DKV_PYTHON=OFF && cmake --build /tmp/native/build -j2 --target kvserve
    python3 bench/isa_bench.py --ref /tmp/native/build/kvserve --new build/kvserve

Rounds alternate the two binaries (ABAB...), so a host that slows down mid-run slows both; the
figures are medians over rounds of `kvserve bench`'s own medians. Output: bench/out/isa_bench.json
(and a table on stdout). The portable binary also runs with KV_ISA forced to each lower ISA.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ab_pairs import bench_json  # noqa: E402


def bench(binary: str, model: str, isa: str | None, args) -> dict:
    env = dict(os.environ)
    if isa:
        env["KV_ISA"] = isa
    return bench_json(binary, ["-m", model, "-p", str(args.prompt), "-n", str(args.gen), "-r", str(args.repeat)],
                      env=env, cwd=ROOT)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ref", required=True, help="the -march=native binary")
    ap.add_argument("--new", default=os.path.join(ROOT, "build", "kvserve"), help="the portable binary")
    ap.add_argument("-m", "--model", default=os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--lower-isas", default="", help="comma list of KV_ISA values to also run the portable binary with (e.g. avx2,scalar)")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "out", "isa_bench.json"))
    args = ap.parse_args()

    runs = [("native", args.ref, None), ("portable", args.new, None)]
    runs += [(f"portable KV_ISA={i}", args.new, i) for i in args.lower_isas.split(",") if i]
    samples: dict[str, list[dict]] = {name: [] for name, _, _ in runs}
    for r in range(args.rounds):
        for name, binary, isa in runs:
            res = bench(binary, args.model, isa, args)
            samples[name].append(res)
            print(f"round {r + 1}/{args.rounds} {name:<24} isa {res['isa']:<7} prefill {res['prefill_tok_s']:8.1f} "
                  f"decode {res['decode_tok_s']:7.1f} tok/s", file=sys.stderr, flush=True)

    def med(name, key):
        return statistics.median(s[key] for s in samples[name])

    out = {"model": os.path.basename(args.model), "prompt_tokens": args.prompt, "gen_tokens": args.gen, "rounds": args.rounds,
           "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?"),
           "results": {}}
    for name, _, _ in runs:
        out["results"][name] = {"isa": samples[name][0]["isa"], "prefill_tok_s": med(name, "prefill_tok_s"),
                                "decode_tok_s": med(name, "decode_tok_s"),
                                "decode_tok_s_rounds": [s["decode_tok_s"] for s in samples[name]]}
    base = out["results"]["native"]
    for name, r in out["results"].items():
        r["prefill_vs_native"] = r["prefill_tok_s"] / base["prefill_tok_s"]
        r["decode_vs_native"] = r["decode_tok_s"] / base["decode_tok_s"]
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"{'binary':<26}{'isa':<8}{'prefill tok/s':>14}{'decode tok/s':>14}{'decode vs native':>18}")
    for name, r in out["results"].items():
        print(f"{name:<26}{r['isa']:<8}{r['prefill_tok_s']:>14.1f}{r['decode_tok_s']:>14.1f}{r['decode_vs_native']:>18.3f}")
    print(f"(medians of {args.rounds} alternating rounds; {args.out})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
