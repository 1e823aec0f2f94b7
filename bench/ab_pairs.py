#!/usr/bin/env python3
"""Two kvserve binaries, paired: is a change faster on a noisy host?

On a shared VM single runs of `kvserve bench` move ±15% from minute to minute, more than most
changes gain. This runs binary A and binary B back to back, N times, alternating which goes
first, and reports the ratio B/A of each pair: its median, quartiles and how many pairs B won.
A pair sees nearly the same machine state, so the ratios scatter much less than the runs.

  cp build/kvserve /tmp/kvserve.before     # then rebuild with the change
  python3 bench/ab_pairs.py --a /tmp/kvserve.before --b build/kvserve --rounds 16 \\
      -- -p 0 -n 128 -r 2
  python3 bench/ab_pairs.py --a … --b … --key prefill_tok_s -- -p 512 -n 0 -r 2
  python3 bench/ab_pairs.py --a build/kvserve --b build/kvserve --b-env KV_WALK=0 -- -p 0 -n 128 -r 2

--a-env / --b-env KEY=VALUE (repeatable) set environment variables for one side only (a switch
read from the environment, one binary; KEY= with nothing after it removes KEY for that side).

Everything after `--` goes to `kvserve bench` (which gets `--json` added). JSON to --out
(default bench/out/ab_pairs.json); one progress line per pair on stderr.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def bench_json(binary, bench_args, env=None, cwd=None):
    """`binary bench <bench_args> --json`'s JSON; exits with its stderr's tail if it fails."""
    out = subprocess.run([binary, "bench", *bench_args, "--json"], capture_output=True, text=True, env=env, cwd=cwd)
    if out.returncode != 0:
        sys.exit(f"{binary} bench failed ({out.returncode}): {out.stderr.strip()[-500:]}")
    return json.loads(out.stdout)


def side_env(assignments):
    """os.environ with KEY=VALUE assignments applied (KEY= removes KEY); None when there are none."""
    if not assignments:
        return None
    env = dict(os.environ)
    for a in assignments:
        k, sep, v = a.partition("=")
        if not sep or not k:
            sys.exit(f"--a-env/--b-env take KEY=VALUE, got {a!r}")
        if v:
            env[k] = v
        else:
            env.pop(k, None)
    return env


def run(binary, bench_args, key, env=None):
    value = bench_json(binary, bench_args, env=env).get(key)
    if value is None:
        sys.exit(f"{binary} bench: no '{key}' in its JSON (a -p 0 run has no prefill_tok_s)")
    return float(value)


def quartiles(values):
    s = sorted(values)
    return s[len(s) // 4], s[(3 * len(s)) // 4]


def main():
    argv = sys.argv[1:]
    bench_args = []
    if "--" in argv:
        i = argv.index("--")
        argv, bench_args = argv[:i], argv[i + 1:]
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="the reference binary")
    ap.add_argument("--b", required=True, help="the binary with the change")
    ap.add_argument("--rounds", type=int, default=12, help="pairs (default 12)")
    ap.add_argument("--key", default="decode_tok_s", help="field of kvserve bench's JSON (higher is better)")
    ap.add_argument("--a-env", action="append", default=[], metavar="KEY=VALUE", help="environment of A's runs (repeatable)")
    ap.add_argument("--b-env", action="append", default=[], metavar="KEY=VALUE", help="environment of B's runs (repeatable)")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "out", "ab_pairs.json"))
    args = ap.parse_args(argv)
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    for b in (args.a, args.b):
        if not os.access(b, os.X_OK):
            ap.error(f"not an executable: {b}")

    env_a, env_b = side_env(args.a_env), side_env(args.b_env)
    pairs = []
    t0 = time.time()
    for r in range(args.rounds):
        if r % 2 == 0:
            vb = run(args.b, bench_args, args.key, env_b)
            va = run(args.a, bench_args, args.key, env_a)
        else:
            va = run(args.a, bench_args, args.key, env_a)
            vb = run(args.b, bench_args, args.key, env_b)
        pairs.append({"a": va, "b": vb, "ratio": vb / va, "b_first": r % 2 == 0})
        print(f"[ab_pairs {time.time() - t0:6.1f}s] pair {r + 1}/{args.rounds}: A {va:.1f}  B {vb:.1f}  B/A {vb / va:.3f}",
              file=sys.stderr, flush=True)

    ratios = [p["ratio"] for p in pairs]
    q1, q3 = quartiles(ratios)
    result = {
        "a": args.a, "b": args.b, "a_env": args.a_env, "b_env": args.b_env, "key": args.key, "bench_args": bench_args, "rounds": args.rounds,
        "median_a": statistics.median(p["a"] for p in pairs),
        "median_b": statistics.median(p["b"] for p in pairs),
        "ratio_median": statistics.median(ratios), "ratio_q1": q1, "ratio_q3": q3,
        "b_wins": sum(r > 1 for r in ratios),
        "load_avg_end": os.getloadavg()[0],
        "pairs": pairs,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    print(f"{args.key}: A median {result['median_a']:.1f}, B median {result['median_b']:.1f}; "
          f"B/A median {result['ratio_median']:.3f} (quartiles {q1:.3f}..{q3:.3f}), "
          f"B faster in {result['b_wins']} of {args.rounds} pairs; wrote {args.out}")


if __name__ == "__main__":
    main()
