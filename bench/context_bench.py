#!/usr/bin/env python3
"""Long-context decode: kvserve (f16 / int8 / int4 KV pages) vs llama.cpp (f16 / q8_0 KV).

For every context length N, decodes --gen tokens after N tokens already in the cache:
  kvserve    `kvserve bench -d N -p 0 -n GEN --json --kv-cache-dtype D` (the context is
             prefilled once per run, each of --kvserve-repeat repeats decodes and rolls back)
  llama.cpp  `llama-bench -m MODEL -d N -p 0 -n GEN -fa 1 -t T -r 1 -o json [-ctk K -ctv K]`
             (llama-bench prefills the depth before each repetition)
Runs alternate between the engines inside each round (the order flips every round), so both
see the same machine state; --rounds R rounds, medians (and min/max) across rounds. The
machine's read bandwidth is measured once (`kvserve bench --measure-bandwidth`, a read loop
over 1 GiB on the same threads), and every run's effective bandwidth (bytes one decode token
reads: weights + the KV of the average context position, times tok/s) is put beside it.

Writes bench/out/context_bench.json (every raw run, medians, kvserve/llama.cpp ratios at each
N for f16 vs f16 and int8 vs q8_0, effective GB/s and its fraction of the machine's) and
bench/out/context_bench.png (copied to docs/context_bench.png). Progress on stderr.

  python3 bench/context_bench.py [--contexts 0,1024,4096,8192] [--rounds 3] [--gen 64]
                                 [--kvserve build/kvserve] [--wait-load 1.5] [--idle-gate 0.3]
"""
import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# llama.cpp q8_0: blocks of 32 int8 values + one f16 scale = 34 bytes per 32 elements.
LLAMA_KV_BYTES_PER_ELEM = {"f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32, "f32": 4.0}
# Which kvserve KV dtype each llama.cpp KV type is compared with.
PAIRS = {"f16": "f16", "q8_0": "int8"}


def log(msg):
    print(msg, file=sys.stderr, flush=True)


def csv_list(s, conv=str):
    return [conv(x) for x in s.split(",") if x.strip()]


def run_json(cmd, timeout):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=timeout)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stderr[-2000:]}")
    return json.loads(p.stdout)


def kvserve_cmd(a, n, dtype, extra=()):
    return [a.kvserve, "bench", "-m", a.model, "-t", str(a.threads), "-d", str(n), "-p", "0", "-n", str(a.gen),
            "--repeat", str(a.kvserve_repeat), "--kv-cache-dtype", dtype, "--json", *extra]


def llama_cmd(a, n, kv):
    cmd = [a.llama_bench, "-m", a.model, "-d", str(n), "-p", "0", "-n", str(a.gen), "-fa", "1", "-t", str(a.threads),
           "-r", "1", "-o", "json"]
    if kv != "f16":
        cmd += ["-ctk", kv, "-ctv", kv]
    return cmd


def summary(xs):
    xs = [x for x in xs if x is not None]
    if not xs:
        return None
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "n": len(xs)}


def wait_for_quiet(max_load, max_wait):
    if max_load <= 0:
        return
    t0 = time.time()
    while os.getloadavg()[0] >= max_load and time.time() - t0 < max_wait:
        log(f"waiting for load < {max_load} (now {os.getloadavg()[0]:.2f}, {time.time() - t0:.0f} s so far)")
        time.sleep(30)
    if os.getloadavg()[0] >= max_load:
        log(f"warning: load still {os.getloadavg()[0]:.2f} after {max_wait} s; running anyway")


def cpu_busy(seconds=2.0):
    """Cores' worth of CPU time used by everything on the machine over `seconds` (/proc/stat)."""
    def snap():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v), v[3] + v[4]  # total, idle + iowait
    t0, i0 = snap()
    time.sleep(seconds)
    t1, i1 = snap()
    total = t1 - t0
    return (os.cpu_count() or 1) * (1 - (i1 - i0) / total) if total > 0 else 0.0


def wait_for_idle_cpu(max_busy, max_wait):
    """Before a run: wait until the other processes use < max_busy cores (2 s samples). Returns the last sample."""
    t0 = time.time()
    busy = cpu_busy()
    while busy >= max_busy and time.time() - t0 < max_wait:
        log(f"  machine busy ({busy:.2f} cores in use), waiting")
        time.sleep(10)
        busy = cpu_busy()
    return busy


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--contexts", default="0,1024,4096,8192", help="context lengths N, comma-separated")
    ap.add_argument("--gen", type=int, default=64, help="tokens decoded after the context")
    ap.add_argument("--kv-dtypes", default="f16,int8,int4", help="kvserve --kv-cache-dtype values")
    ap.add_argument("--llama-kv", default="f16,q8_0", help="llama-bench -ctk/-ctv values (f16 = its default)")
    ap.add_argument("--kvserve", default=os.path.join(ROOT, "build/kvserve"))
    ap.add_argument("--kvserve-repeat", type=int, default=3,
                    help="decode repeats inside one kvserve run (context prefilled once; median)")
    ap.add_argument("--llama-bench", default=os.path.join(ROOT, "bench/peer/work/build/bin/llama-bench"))
    ap.add_argument("--no-build-peer", action="store_true", help="do not run bench/peer/build_llama.sh")
    ap.add_argument("--bandwidth-mib", type=int, default=1024)
    ap.add_argument("--wait-load", type=float, default=0.0,
                    help="before starting, wait (up to --wait-max s) until the 1-min load average is below this")
    ap.add_argument("--wait-max", type=float, default=3600)
    ap.add_argument("--idle-gate", type=float, default=0.0,
                    help="before each run, wait (up to --idle-gate-max s) until other processes use fewer than this many cores (0 = off)")
    ap.add_argument("--idle-gate-max", type=float, default=900)
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine run")
    ap.add_argument("--out", default="bench/out/context_bench")
    ap.add_argument("--docs-png", default="docs/context_bench.png", help="copy of the plot ('' = none)")
    a = ap.parse_args()
    contexts = csv_list(a.contexts, int)
    kv_dtypes = csv_list(a.kv_dtypes)
    llama_kvs = csv_list(a.llama_kv)
    a.model = os.path.relpath(os.path.join(ROOT, a.model), ROOT) if not os.path.isabs(a.model) else a.model

    if not a.no_build_peer and not os.path.exists(a.llama_bench):
        subprocess.run([os.path.join(ROOT, "bench/peer/build_llama.sh")], check=True, cwd=ROOT, stdout=sys.stderr)
    for exe in (a.kvserve, a.llama_bench):
        if not os.access(exe, os.X_OK):
            sys.exit(f"missing {exe} (build it: cmake --build build --target kvserve; bench/peer/build_llama.sh)")

    wait_for_quiet(a.wait_load, a.wait_max)
    load0 = os.getloadavg()[0]
    log(f"machine read bandwidth ({a.bandwidth_mib} MiB, {a.threads} threads) ... (load {load0:.2f})")
    bw = run_json([a.kvserve, "bench", "-m", a.model, "-t", str(a.threads), "-p", "0", "-n", "0", "--json",
                   "--measure-bandwidth", "--bandwidth-mib", str(a.bandwidth_mib)], a.timeout)
    machine_gb_s = bw["machine_read_gb_s"]
    log(f"machine read bandwidth: {machine_gb_s:.1f} GB/s (passes {', '.join(f'{x:.1f}' for x in bw['machine_bandwidth']['passes'])})")

    weights = None     # bytes of weights one decode token reads (kvserve's count)
    kv_elems = None    # K+V elements per token of context (from kvserve's f16 bytes per token)
    llama_weights = None
    runs = []
    t_start = time.time()
    for r in range(a.rounds):
        for n in contexts:
            jobs = [("kvserve", d) for d in kv_dtypes]
            ljobs = [("llama.cpp", k) for k in llama_kvs]
            order = []  # alternate engines: kvserve, llama.cpp, kvserve, ...
            for i in range(max(len(jobs), len(ljobs))):
                if i < len(jobs):
                    order.append(jobs[i])
                if i < len(ljobs):
                    order.append(ljobs[i])
            if r % 2:
                order.reverse()
            for engine, kv in order:
                busy = wait_for_idle_cpu(a.idle_gate, a.idle_gate_max) if a.idle_gate > 0 else None
                t0 = time.time()
                load = os.getloadavg()[0]
                rec = {"round": r + 1, "context": n, "engine": engine, "kv": kv, "gen_tokens": a.gen, "load_avg": load,
                       "cores_busy_before": busy}
                if engine == "kvserve":
                    j = run_json(kvserve_cmd(a, n, kv), a.timeout)
                    rec.update(decode_tok_s=j["decode_tok_s"], decode_tok_s_min=j["decode_tok_s_min"],
                               decode_tok_s_max=j["decode_tok_s_max"], kv_cache_dtype=j["kv_cache_dtype"],
                               kv_bytes_per_token=j["kv_bytes_per_token"], decode_bytes_per_token=j["decode_bytes_per_token"],
                               effective_gb_s=j["decode_effective_gb_s"], context_prefill_s=j.get("context_prefill_s"),
                               repeat=j["repeat"])
                    weights = j["decode_weight_bytes_per_token"]
                    if j["kv_cache_dtype"] == "f16":
                        kv_elems = j["kv_bytes_per_token"] / 2
                else:
                    rows = run_json(llama_cmd(a, n, kv), a.timeout)
                    row = next(x for x in rows if x["n_gen"] > 0 and x["n_prompt"] == 0)
                    llama_weights = row["model_size"]
                    rec.update(decode_tok_s=row["avg_ts"], samples_ts=row.get("samples_ts"), type_k=row.get("type_k"),
                               type_v=row.get("type_v"), flash_attn=row.get("flash_attn"), model_size=row["model_size"])
                rec["seconds"] = time.time() - t0
                rec["load_avg_after"] = os.getloadavg()[0]
                runs.append(rec)
                log(f"round {r + 1}/{a.rounds} N={n:<5} {engine:<9} {kv:<5} {rec['decode_tok_s']:7.1f} tok/s"
                    f"  ({rec['seconds']:.0f} s, load {load:.2f}, {time.time() - t_start:.0f} s total)")

    # llama.cpp's bytes per token: its weights + its KV type's bytes for kvserve's element count.
    for rec in runs:
        if rec["engine"] == "llama.cpp" and kv_elems and rec["kv"] in LLAMA_KV_BYTES_PER_ELEM:
            kvb = kv_elems * LLAMA_KV_BYTES_PER_ELEM[rec["kv"]]
            rec["kv_bytes_per_token"] = kvb
            rec["decode_bytes_per_token"] = rec["model_size"] + kvb * (rec["context"] + (a.gen - 1) / 2)
            rec["effective_gb_s"] = rec["decode_bytes_per_token"] * rec["decode_tok_s"] / 1e9

    series = {}
    for engine, kvs in (("kvserve", kv_dtypes), ("llama.cpp", llama_kvs)):
        for kv in kvs:
            key = f"{engine} {kv}"
            per_n = {}
            for n in contexts:
                rs = [x for x in runs if x["engine"] == engine and x["kv"] == kv and x["context"] == n]
                tok = summary([x["decode_tok_s"] for x in rs])
                eff = summary([x.get("effective_gb_s") for x in rs])
                per_n[str(n)] = {
                    "decode_tok_s": tok,
                    "effective_gb_s": eff,
                    "fraction_of_machine_bandwidth": eff["median"] / machine_gb_s if eff else None,
                    "kv_bytes_per_token": rs[0].get("kv_bytes_per_token") if rs else None,
                    "decode_bytes_per_token": rs[0].get("decode_bytes_per_token") if rs else None,
                }
            series[key] = per_n
    ratios = {}
    for lkv, kkv in PAIRS.items():
        if lkv in llama_kvs and kkv in kv_dtypes:
            ratios[f"kvserve {kkv} / llama.cpp {lkv}"] = {
                str(n): series[f"kvserve {kkv}"][str(n)]["decode_tok_s"]["median"] /
                series[f"llama.cpp {lkv}"][str(n)]["decode_tok_s"]["median"] for n in contexts}
    res = {
        "model": a.model, "threads": a.threads, "gen_tokens": a.gen, "contexts": contexts, "rounds": a.rounds,
        "kvserve": a.kvserve, "kvserve_repeat": a.kvserve_repeat, "llama_bench": a.llama_bench,
        "llama_bench_flags": "-fa 1 -p 0 -r 1", "kv_dtypes": kv_dtypes, "llama_kv": llama_kvs,
        "weight_bytes_per_token": {"kvserve": weights, "llama.cpp": llama_weights},
        "machine_read_gb_s": machine_gb_s, "machine_bandwidth": bw["machine_bandwidth"],
        "idle_gate_cores": a.idle_gate, "load_avg_start": load0, "load_avg_end": os.getloadavg()[0], "seconds": time.time() - t_start,
        "medians": series, "ratios_kvserve_over_llama_cpp": ratios, "runs": runs,
    }
    out = os.path.join(ROOT, a.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump(res, f, indent=2)
    log(f"results: {a.out}.json")

    # table on stderr
    hdr = f"{'N':>6} " + " ".join(f"{k:>16}" for k in series) + " " + " ".join(f"{k.split(' / ')[0][8:] + '/' + k.split(' ')[-1]:>10}" for k in ratios)
    log(hdr)
    for n in contexts:
        cells = " ".join(f"{series[k][str(n)]['decode_tok_s']['median']:9.1f} ({series[k][str(n)]['effective_gb_s']['median'] if series[k][str(n)]['effective_gb_s'] else 0:4.1f})"
                         for k in series)
        rat = " ".join(f"{ratios[k][str(n)]:10.2f}" for k in ratios)
        log(f"{n:>6} {cells} {rat}")
    log(f"(tok/s, effective GB/s in parentheses; machine read bandwidth {machine_gb_s:.1f} GB/s)")

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = {"kvserve f16": "#1a7f4b", "kvserve int8": "#2a9df4", "kvserve int4": "#8e44ad",
              "llama.cpp f16": "#777777", "llama.cpp q8_0": "#d35400"}
    for key, per_n in series.items():
        style = "-" if key.startswith("kvserve") else "--"
        c = colors.get(key)
        for ax, metric in ((axes[0], "decode_tok_s"), (axes[1], "effective_gb_s")):
            pts = [(n, per_n[str(n)][metric]) for n in contexts if per_n[str(n)][metric]]
            if not pts:
                continue
            xs = [p[0] for p in pts]
            med = [p[1]["median"] for p in pts]
            err = [[m - p[1]["min"] for m, p in zip(med, pts)], [p[1]["max"] - m for m, p in zip(med, pts)]]
            ax.errorbar(xs, med, yerr=err, fmt=style + "o", color=c, label=key, capsize=3, markersize=4)
    axes[0].set_xlabel("context (tokens in the KV cache)")
    axes[0].set_ylabel("decode tokens/s")
    axes[0].set_title(f"decode tg{a.gen} vs context")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=8)
    axes[0].grid(alpha=0.3)
    axes[1].axhline(machine_gb_s, color="k", lw=1, ls=":", label=f"machine read {machine_gb_s:.1f} GB/s")
    axes[1].set_xlabel("context (tokens in the KV cache)")
    axes[1].set_ylabel("effective GB/s (weights + KV read per token × tok/s)")
    axes[1].set_title("effective bandwidth")
    axes[1].set_ylim(bottom=0)
    axes[1].legend(fontsize=8)
    axes[1].grid(alpha=0.3)
    fig.suptitle(f"{os.path.basename(a.model)}, {a.threads} threads, median of {a.rounds} rounds (bars: min–max)")
    fig.tight_layout()
    fig.savefig(out + ".png", dpi=110)
    log(f"plot: {a.out}.png")
    if a.docs_png:
        dst = os.path.join(ROOT, a.docs_png)
        os.makedirs(os.path.dirname(dst), exist_ok=True)
        shutil.copyfile(out + ".png", dst)
        log(f"plot copied to {a.docs_png}")


if __name__ == "__main__":
    main()
