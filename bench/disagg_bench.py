#!/usr/bin/env python3
"""Disaggregated serving and replica routing: colocated vs 1 prefill + 1 decode instance, and
prefix-affinity vs round-robin routing over 2 replicas, both behind `kvserve router`.

Part "pd" (--parts pd): does moving long prefills off the decoding instance keep inter-token
latency steady on this 2-core machine, at the same throughput?

  colocated       one `kvserve serve --threads 2` (role both, no Redis): long prefills run in
                  the same engine steps as the short requests' decode steps.
  P/D             a throw-away redis-server (free loopback port, --save '' --appendonly no),
                  `serve --role prefill --threads 1 --kv-redis`, `serve --role decode --threads 1
                  --kv-redis` and `router --prefill URL --decode URL`; clients talk to the router.
                  Prompts of >= --prefill-min-tokens (256: the long documents, not the ~60-90-token
                  chat turns, whose prefill is cheaper than a Redis round trip) are computed on the
                  prefill instance, whose pages the decode instance then finds in Redis.

  Workload, open loop at fixed arrival times drawn from a seeded RNG (the same schedule, the same
  prompts, for both configs of a repeat; every server fresh per config and repeat):
    short   chat completions at Poisson rate --short-rate (1.0/s): a distinct ~30-60-token user
            message each ("Request r-i. <synthetic sentences>"), streamed, max_tokens 64,
            temperature 0.7 with a per-request seed, ignore_eos (every request makes 64 tokens);
    long    every --long-interval s (15, random phase): a distinct --long-tokens (4096) token
            document cut from data/text/*.txt with the model's own tokenizer (consecutive windows,
            no shared prefix) + a question, as a raw /v1/completions prompt, streamed, max_tokens
            16, temperature 0, ignore_eos. usage.prompt_tokens is checked to be ~4096.
  Timeline: --warmup s (5, not counted) + --duration s (60, the window) + --tail s (3: arrivals go
  on so that the last requests of the window still see load), then the in-flight requests drain.
  Before the schedule each config gets two warm-up requests (a chat turn, and a ~500-token
  completion, which in P/D goes through the prefill instance and Redis).

  Metrics (client-side SSE arrival times):
    TTFT    send -> first non-empty content chunk, of the requests *sent* in the window
            (short: p50/p99; long: p50);
    ITL     gaps between consecutive content chunks of short requests that *ended* in the window
            (p50/p99/max);
    end-to-end  send -> the stream's end, of short requests sent in the window (p50/p99): the
            wait for a whole answer, which TTFT and ITL each show only part of;
    tok/s   content chunks (1 token each) of all requests that arrived in the window / window:
            both configs get the same offered load, so equal tok/s means neither fell behind;
    errors  HTTP errors, stream errors, missing [DONE], wrong completion token counts;
  plus per process CPU cores over the window, the cores other processes took (/proc/stat), and
  /metrics deltas of every kvserve process (prefill handoffs, Redis tier hits, cached tokens).
  Target: "P/D ITL p99 <= 1/2 colocated".

Part "replicas" (--parts replicas): 2 replicas (`serve --threads 1`, small --kv-cache-memory)
behind one router, --routing cache-aware (the default: a new prefix goes to the least loaded
replica, which keeps it), --routing ring (consistent hashing with bounded loads) and --routing
round-robin (--rr-modes picks). Per mode fresh replicas and a fresh router, so every mode
starts cold; the mode order rotates per repeat.

  Multi-tenant load: --tenants T (8) tenants, each with its own ~--tenant-tokens (1000) token
  system prompt (a header naming the tenant + its own passage of the novels: distinct from the
  first token on, so the router's affinity key, the first 128 tokens, differs per tenant). Closed
  loop: --users U (8) users, each picking a tenant at random per request (seeded per user and
  repeat: the same sequence in both modes) and asking a short distinct question (chat
  completion, streamed, max_tokens 16, temperature --rr-temperature (0.7) with a per-request seed,
  ignore_eos). Users start spread over the
  first half of the warm-up.
  KV per replica: --replica-kv-frac (0.6) of all tenants' cacheable system-prompt tokens (whole
  16-token pages of the template-rendered prefix, counted with the local tokenizer) + room for
  every user's private pages, x the model's KV bytes per token (`kvserve kv-size`; SmolLM2 f16:
  23,040 B): a replica holds its half of the tenants under affinity, round-robin makes each
  replica cycle through all of them. --replica-kv-memory overrides.
  Before the closed loop every tenant is asked once, one at a time (calibration: the router's
  per-backend counters tell which replica took it, i.e. the tenant -> replica map of affinity).
  Then --replica-warmup s (5, not counted), then --duration s measured.

  Metrics: TTFT p50/p99 (first content chunks that arrived in the window), prefix hit rate =
  sum cached_tokens / sum prompt_tokens (usage.prompt_tokens_details.cached_tokens of requests
  finished in the window), requests/s (finished in the window), per-replica requests (router
  /metrics kvserve:router_requests_total{backend=...} over the window), the tenant split,
  replica-side prefix-cache hits / evictions / preemptions.
  Target: "affinity TTFT p50 >= 2x lower than round-robin", for the router's default (cache-aware).

With --repeats N everything runs N times (P/D: colocated then P/D per repeat) and the summary
holds medians over repeats. Progress on stderr; server logs in bench/out/disagg_logs/; every
child (kvserve, router, redis-server) is killed on exit, on an error and on SIGTERM. Loopback only.

  python3 bench/disagg_bench.py                                    # both parts, 1 repeat (~6 min)
  python3 bench/disagg_bench.py --parts pd --repeats 3             # P/D only, medians of 3
  python3 bench/disagg_bench.py --duration 20 --repeats 1          # smoke run
  python3 bench/disagg_bench.py --replot                           # table and plot from the JSON

The defaults assume an AVX-512 host (4k-token prefill in ~7 s on 2 threads). Without AVX-512,
kvserve's attention takes its portable path and a 4096-token prefill takes minutes: the open loop
then backs up (flagged under anomalies). There, scale the documents and prompts down:
  python3 bench/disagg_bench.py --long-tokens 1024 --long-interval 20 --tenant-tokens 500

Output: bench/out/disagg_bench.json, docs/disagg_bench.png (left: latency percentiles colocated
vs P/D; right: TTFT and hit rate, affinity vs round-robin), a table on stdout.
"""
from __future__ import annotations

import argparse
import datetime as dt
import http.client
import json
import math
import os
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT / "tests" / "reference"))
import tier_bench as tb  # noqa: E402  (Docs: token-exact windows of the novels; Redis: a throw-away redis-server)
from serve_bench import (binary_info, free_port, host_info, http_get, machine_busy_s, make_text, pct,  # noqa: E402
                         proc_cpu_s, sse_events)

T_START = time.time()
PARTS = ["pd", "replicas"]
PD_CONFIGS = ["colocated", "pd"]
RR_MODES = ["cache-aware", "ring", "round-robin"]  # the router's --routing values
AFFINITY_MODES = ("cache-aware", "ring")
CONTENDED_CORES = 0.25  # cores other processes took during a window above which it is flagged


def log(msg: str) -> None:
    print(f"[disagg_bench {time.time() - T_START:6.1f}s] {msg}", file=sys.stderr, flush=True)


tb.log = log  # tier_bench's Docs and Redis log through their module's log(): same prefix and clock


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return a / b if a is not None and b else None


def ms(x):
    return None if x is None else 1e3 * x


# ----------------------------------------------------------------------------- processes

def _on_signal(signum, frame):  # noqa: ARG001 - an exception, so that finally blocks stop the children
    raise SystemExit(f"disagg_bench: signal {signum}")


class Proc(tb.Proc):
    """tier_bench's process (killed on any exit with tier_bench's children); its stop also counts
    the error lines of the log."""

    def stop(self, timeout: float = 30) -> dict:
        res = super().stop(timeout)
        if not res:
            return res
        bad = [ln for ln in self.text().splitlines() if re.search(r"\b(error|fatal|abort|exception|assert|failed)\b", ln, re.I)]
        return {**res, "stop_s": round(res["stop_s"], 3), "log": str(self.log_path), "log_error_lines": len(bad),
                "log_error_samples": bad[:5]}


def serve_cmd(args, port: int, threads: int, kv_memory: str, max_len: int, extra: list[str]) -> list[str]:
    return [str(args.kvserve), "serve", "-m", str(args.model), "--host", "127.0.0.1", "--port", str(port),
            "--threads", str(threads), "--kv-cache-memory", kv_memory, "--max-model-len", str(max_len)] + extra


def router_cmd(args, port: int, max_len: int, extra: list[str]) -> list[str]:
    return [str(args.kvserve), "router", "-m", str(args.model), "--listen", f"127.0.0.1:{port}",
            "--max-model-len", str(max_len)] + extra


def pool_tokens(p: Proc) -> int | None:
    m = re.search(r"KV cache: .*?(\d+) pages of (\d+) tokens = (\d+) tokens", p.text())
    return int(m.group(3)) if m else None


# ----------------------------------------------------------------------------- /metrics

_MLINE = re.compile(r'^(kvserve:[A-Za-z0-9_:]+)(\{[^}]*\})?\s+(\S+)$')


def scrape(port: int) -> dict[str, float]:
    """kvserve:* samples (histogram buckets left out) -> {name or name{labels}: value}; {} if unreachable."""
    try:
        st, text = http_get(port, "/metrics", timeout=10)
    except OSError:
        return {}
    if st != 200:
        return {}
    out = {}
    for line in text.splitlines():
        m = _MLINE.match(line.strip())
        if m and not m.group(1).endswith("_bucket"):
            try:
                out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
            except ValueError:
                pass
    return out


def counter_deltas(m0: dict, m1: dict) -> dict[str, float]:
    """Deltas of every counter (names ending in _total, _sum, _count) between two scrapes; zeros left out."""
    out = {}
    for k, v in m1.items():
        base = k.split("{", 1)[0]
        if base.endswith(("_total", "_sum", "_count")):
            d = v - m0.get(k, 0.0)
            if d:
                out[k.replace("kvserve:", "")] = d
    return out


def g(d: dict, name: str, labels: str = "") -> float:
    """A value from counter_deltas() output (0 when absent)."""
    return d.get(name + (f"{{{labels}}}" if labels else ""), 0.0)


# ----------------------------------------------------------------------------- HTTP client

def stream_request(port: int, path: str, body: dict, timeout: float) -> dict:
    """One streaming request (chat: delta.content; completions: text). perf_counter() times of the send,
    of every non-empty content chunk and of the end; usage numbers; the error if any."""
    chat = path.endswith("/chat/completions")
    res = {"ok": False, "t_send": time.perf_counter(), "t_end": None, "chunk_t": [], "status": None,
           "error": None, "pt": None, "ct": None, "cached": None, "finish_reason": None}
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        res["status"] = r.status
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:300].decode('utf-8', 'replace')}"
        else:
            done = False
            for ev in sse_events(r):
                if ev is None:
                    done = True
                    break
                if "error" in ev:
                    res["error"] = f"stream error: {json.dumps(ev['error'])[:300]}"
                    break
                for ch in ev.get("choices") or []:
                    piece = (ch.get("delta") or {}).get("content") if chat else ch.get("text")
                    if piece:
                        res["chunk_t"].append(time.perf_counter())
                    if ch.get("finish_reason"):
                        res["finish_reason"] = ch["finish_reason"]
                u = ev.get("usage")
                if u:
                    res["pt"], res["ct"] = u.get("prompt_tokens"), u.get("completion_tokens")
                    res["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            if done:
                res["ok"] = True
            elif res["error"] is None:
                res["error"] = "stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - every client-side failure is an error of the run
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    res["t_end"] = time.perf_counter()
    return res


def gaps(r: dict) -> list[float]:
    t = r["chunk_t"]
    return [b - a for a, b in zip(t, t[1:])]


# ----------------------------------------------------------------------------- part pd

def pd_schedule(args, rep: int, docs: tb.Docs) -> list[dict]:
    """The open-loop arrivals of one repeat (identical for both configs): Poisson short chat turns,
    periodic long documents with a random phase; each event carries its request body."""
    rng = random.Random(args.seed * 1_000_003 + rep)
    end = args.warmup + args.duration + args.tail
    evs = []
    t, i = rng.expovariate(args.short_rate), 0
    while t < end:
        words = rng.randint(args.short_words_min, args.short_words_max)
        msg = f"Request {rep}-{i}. " + make_text(f"chat-{args.seed}-{rep}-{i}", words) + " Now tell me a short story about it."
        evs.append({"kind": "short", "t": t, "path": "/v1/chat/completions",
                    "body": {"messages": [{"role": "user", "content": msg}], "max_tokens": args.short_max_tokens,
                             "temperature": 0.7, "seed": rng.randrange(1 << 31), "ignore_eos": True,
                             "stream": True, "stream_options": {"include_usage": True}}})
        t += rng.expovariate(args.short_rate)
        i += 1
    t = rng.uniform(0, args.long_interval)
    while t < args.warmup + args.duration:  # no long request in the tail: it would only lengthen the drain
        text, n = docs.take(args.long_tokens)
        evs.append({"kind": "long", "t": t, "path": "/v1/completions", "doc_tokens_local": n,
                    "body": {"prompt": text + "\n\nQuestion: In one sentence, what happens in the passage above?\nAnswer:",
                             "max_tokens": args.long_max_tokens, "temperature": 0, "ignore_eos": True,
                             "stream": True, "stream_options": {"include_usage": True}}})
        t += args.long_interval
    evs.sort(key=lambda e: e["t"])
    return evs


def warm(front: Proc, args, tag: str) -> None:
    """A chat turn and a ~500-token completion (long enough for the P/D path), not measured."""
    r1 = stream_request(front.port, "/v1/chat/completions",
                        {"model": front.model_id, "messages": [{"role": "user", "content": f"Warm-up {tag}: say hello."}],
                         "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}, args.timeout)
    r2 = stream_request(front.port, "/v1/completions",
                        {"model": front.model_id, "prompt": make_text(f"warmup-{tag}", 400), "max_tokens": 4,
                         "stream": True, "stream_options": {"include_usage": True}}, args.timeout)
    for r in (r1, r2):
        if not r["ok"]:
            raise RuntimeError(f"warm-up request failed: {r['error']}")
    if r2["chunk_t"]:
        log(f"  warm-up {tag}: {r2['pt']}-token completion TTFT {1e3 * (r2['chunk_t'][0] - r2['t_send']):.0f} ms "
            f"(cached {r2['cached']})")


def open_loop(front: Proc, events: list[dict], args, watched: dict[str, Proc]) -> dict:
    """Sends every event at its time (one thread per request), scrapes /metrics and CPU of `watched`
    at the window's edges, waits for the drain. Returns raw results and window data."""
    n = len(events)
    results: list[dict | None] = [None] * n

    def worker(k: int) -> None:
        ev = events[k]
        body = dict(ev["body"], model=front.model_id)
        results[k] = stream_request(front.port, ev["path"], body, args.timeout)

    t0 = time.perf_counter() + 0.3
    ws, we = t0 + args.warmup, t0 + args.warmup + args.duration
    edge: dict[str, dict] = {}

    def sampler() -> None:
        for name, at in (("start", ws), ("end", we)):
            time.sleep(max(0.0, at - time.perf_counter()))
            edge[name] = {"t": time.perf_counter(), "machine": machine_busy_s(), "client": time.process_time(),
                          "cpu": {k: proc_cpu_s(p.pid()) for k, p in watched.items()},
                          "metrics": {k: scrape(p.port) for k, p in watched.items()}}

    before = {k: scrape(p.port) for k, p in watched.items()}  # the whole run too: prefills that end after the window
    smp = threading.Thread(target=sampler, daemon=True)
    smp.start()
    threads, late = [], []
    for k, ev in enumerate(events):
        target = t0 + ev["t"]
        d = target - time.perf_counter()
        if d > 0:
            time.sleep(d)
        late.append(time.perf_counter() - target)
        th = threading.Thread(target=worker, args=(k,), daemon=True)
        th.start()
        threads.append(th)
    smp.join()
    deadline = time.time() + args.drain_timeout
    for th in threads:
        th.join(timeout=max(0.0, deadline - time.time()))
    hung = sum(th.is_alive() for th in threads)
    drain = time.perf_counter() - we
    after = {k: scrape(p.port) for k, p in watched.items()}
    return {"results": results, "t0": t0, "ws": ws, "we": we, "edge": edge, "late": late, "hung": hung,
            "drain_s": drain, "run_deltas": {k: counter_deltas(before.get(k, {}), after.get(k, {})) for k in watched}}


def pd_stats(cfg: str, rep: int, events: list[dict], ol: dict, args, watched: dict[str, Proc]) -> dict:
    ws, we = ol["ws"], ol["we"]
    dur = we - ws
    pairs = [(ev, r) for ev, r in zip(events, ol["results"]) if r is not None]
    short = [r for ev, r in pairs if ev["kind"] == "short"]
    long_ = [(ev, r) for ev, r in pairs if ev["kind"] == "long"]
    ok = [r for _, r in pairs if r["ok"]]
    errs = [r for _, r in pairs if not r["ok"]]
    s_in = [r for r in short if r["ok"] and ws <= r["t_send"] < we and r["chunk_t"]]
    l_in = [r for _, r in long_ if r["ok"] and ws <= r["t_send"] < we and r["chunk_t"]]
    ttft_s = [r["chunk_t"][0] - r["t_send"] for r in s_in]
    ttft_l = [r["chunk_t"][0] - r["t_send"] for r in l_in]
    e2e_s = [r["t_end"] - r["t_send"] for r in s_in]  # the whole answer: what a chat user waits for
    itl = [b - a for r in short for a, b in zip(r["chunk_t"], r["chunk_t"][1:]) if ws <= b < we]
    chunks_in = sum(1 for _, r in pairs for t in r["chunk_t"] if ws <= t < we)
    all_tok = sum(r["ct"] or 0 for r in ok)
    all_chunks = sum(len(r["chunk_t"]) for r in ok)
    tpc = all_tok / all_chunks if all_chunks and all_tok else 1.0
    offered = sum(ev["body"]["max_tokens"] for ev in events if args.warmup <= ev["t"] < args.warmup + args.duration)
    wrong = [r for ev, r in pairs if r["ok"] and r["ct"] is not None and r["ct"] != ev["body"]["max_tokens"]]
    e0, e1 = ol["edge"].get("start", {}), ol["edge"].get("end", {})
    deltas = {k: counter_deltas((e0.get("metrics") or {}).get(k, {}), (e1.get("metrics") or {}).get(k, {})) for k in watched}
    cores = {}
    for k in watched:
        a, b = (e0.get("cpu") or {}).get(k), (e1.get("cpu") or {}).get(k)
        cores[k] = (b - a) / dur if a is not None and b is not None else None
    client = ((e1.get("client") or 0) - (e0.get("client") or 0)) / dur
    mb = (e1.get("machine") - e0.get("machine")) if e0.get("machine") is not None and e1.get("machine") is not None else None
    other = None if mb is None else max(0.0, mb / dur - sum(c or 0 for c in cores.values()) - client)
    lr = [r for _, r in long_ if r["ok"]]
    out = {
        "config": cfg, "repeat": rep, "window_s": dur, "drain_s": ol["drain_s"], "hung": ol["hung"],
        "requests_sent": len(events), "short_sent": sum(1 for e in events if e["kind"] == "short"),
        "long_sent": len(long_), "short_in_window": len(s_in), "long_in_window": len(l_in),
        "dispatch_late_max_ms": ms(max(ol["late"]) if ol["late"] else None),
        "short_ttft_p50_ms": ms(pct(ttft_s, 50)), "short_ttft_p99_ms": ms(pct(ttft_s, 99)),
        "short_itl_p50_ms": ms(pct(itl, 50)), "short_itl_p99_ms": ms(pct(itl, 99)),
        "short_itl_max_ms": ms(max(itl) if itl else None), "short_itl_n": len(itl),
        "short_e2e_p50_ms": ms(pct(e2e_s, 50)), "short_e2e_p99_ms": ms(pct(e2e_s, 99)),
        "long_ttft_p50_ms": ms(pct(ttft_l, 50)), "long_ttft_ms": [ms(x) for x in ttft_l],
        "tok_per_s": chunks_in * tpc / dur, "offered_tok_per_s": offered / dur, "tokens_per_chunk": tpc,
        "errors": len(errs), "errors_in_window": sum(1 for r in errs if ws <= r["t_send"] < we),
        "http_5xx": sum(1 for r in errs if (r["status"] or 0) >= 500),
        "error_samples": sorted({r["error"] for r in errs})[:5],
        "wrong_completion_tokens": len(wrong),
        "short_prompt_tokens_mean": statistics.fmean([r["pt"] for r in short if r["pt"]]) if any(r["pt"] for r in short) else None,
        "short_cached_tokens_mean": statistics.fmean([r["cached"] or 0 for r in short if r["ok"]]) if any(r["ok"] for r in short) else None,
        "long_prompt_tokens": [r["pt"] for r in lr], "long_cached_tokens": [r["cached"] for r in lr],
        "cores": cores, "client_cores": client, "other_cores": other,
        "metric_deltas": deltas, "metric_deltas_run": ol["run_deltas"],
        "requests": [{"kind": ev["kind"], "t_sched": round(ev["t"], 3), "t_send": round(r["t_send"] - ol["t0"], 3),
                      "ttft_ms": ms(r["chunk_t"][0] - r["t_send"]) if r["chunk_t"] else None,
                      "e2e_ms": ms(r["t_end"] - r["t_send"]), "chunks": len(r["chunk_t"]),
                      "max_gap_ms": ms(max(gaps(r))) if len(r["chunk_t"]) > 1 else None,
                      "prompt_tokens": r["pt"], "completion_tokens": r["ct"], "cached_tokens": r["cached"],
                      "error": r["error"]} for ev, r in pairs],
    }
    return out


def pd_config(args, cfg: str, rep: int, events: list[dict], tmp: Path, checks: list[str]) -> dict:
    logs = args.out.parent / "disagg_logs"
    procs: list[Proc] = []
    redis = None
    stops = {}
    try:
        if cfg == "colocated":
            p = free_port()
            srv = Proc("colocated", serve_cmd(args, p, args.threads, args.kv_cache_memory, args.max_model_len,
                                                     shlex.split(args.colocated_args)),
                       p, logs / f"pd_colocated_{rep}.log").start(args.startup_timeout)
            procs.append(srv)
            front, watched = srv, {"colocated": srv}
        else:
            pin = (lambda cpu: ["taskset", "-c", str(cpu)]) if args.pd_pin else (lambda cpu: [])
            redis = tb.Redis(args.redis_server, tmp / f"redis_{rep}", logs / f"pd_redis_{rep}.log")
            redis.cmd = pin(0) + redis.cmd
            redis.start()
            url = f"redis://127.0.0.1:{redis.port}"
            pp, dp, rp = free_port(), free_port(), free_port()
            pre = Proc("prefill", pin(0) + serve_cmd(args, pp, 1, args.kv_cache_memory, args.max_model_len,
                                            ["--role", "prefill", "--kv-redis", url] + shlex.split(args.prefill_args)), pp, logs / f"pd_prefill_{rep}.log")
            procs.append(pre.start(args.startup_timeout))
            dec = Proc("decode", pin(1) + serve_cmd(args, dp, 1, args.kv_cache_memory, args.max_model_len,
                                           ["--role", "decode", "--kv-redis", url] + shlex.split(args.decode_args)), dp, logs / f"pd_decode_{rep}.log")
            procs.append(dec.start(args.startup_timeout))
            rt = Proc("router", pin(0) + router_cmd(args, rp, args.max_model_len,
                                           ["--prefill", pre.url, "--decode", dec.url,
                                            "--prefill-min-tokens", str(args.prefill_min_tokens)]), rp, logs / f"pd_router_{rep}.log")
            procs.append(rt.start(args.startup_timeout))
            for p_ in (pre, dec):
                try:
                    st, body = http_get(p_.port, "/health")
                    log(f"  {p_.name} /health: {st} {body.strip()[:120]}")
                except OSError as e:
                    log(f"  {p_.name} /health: {e}")
            front, watched = rt, {"router": rt, "prefill": pre, "decode": dec}
        warm(front, args, f"{cfg}-{rep}")
        log(f"  rep {rep + 1} {cfg}: {sum(e['kind'] == 'short' for e in events)} short + "
            f"{sum(e['kind'] == 'long' for e in events)} long requests over {args.warmup + args.duration + args.tail:.0f} s")
        mask = os.sched_getaffinity(0)
        if args.pd_pin and cfg != "colocated":
            os.sched_setaffinity(0, {0})  # the load generator's threads start after this: they inherit it
        try:
            ol = open_loop(front, events, args, watched)
        finally:
            os.sched_setaffinity(0, mask)
        res = pd_stats(cfg, rep, events, ol, args, watched)
        if redis is not None:
            try:
                res["redis_keys"] = redis.cmd_("DBSIZE")
                res["redis_used_memory"] = redis.used_memory()
            except (OSError, RuntimeError):
                pass
        res["pool_tokens"] = {k: pool_tokens(p) for k, p in watched.items() if k != "router"}
    finally:
        for p in reversed(procs):
            stops[p.name] = p.stop()
        if redis is not None:
            redis.stop()
    res["stop"] = stops
    f = lambda x, d=0: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    log(f"  rep {rep + 1} {cfg:>9}: short TTFT p50/p99 {f(res['short_ttft_p50_ms'])}/{f(res['short_ttft_p99_ms'])} ms, "
        f"ITL p50/p99/max {f(res['short_itl_p50_ms'], 1)}/{f(res['short_itl_p99_ms'], 1)}/{f(res['short_itl_max_ms'])} ms, "
        f"long TTFT p50 {f(res['long_ttft_p50_ms'])} ms ({len(res['long_ttft_ms'])}), "
        f"{res['tok_per_s']:.1f} tok/s (offered {res['offered_tok_per_s']:.1f}), errors {res['errors']}, "
        f"cores " + ", ".join(f"{k} {f(v, 2)}" for k, v in res["cores"].items()) + f", other {f(res['other_cores'], 2)}")
    # anomalies
    tag = f"pd rep {rep + 1} {cfg}"
    if res["errors"]:
        checks.append(f"{tag}: {res['errors']} failed requests ({res['http_5xx']} HTTP 5xx): {res['error_samples'][:3]}")
    if res["wrong_completion_tokens"]:
        checks.append(f"{tag}: {res['wrong_completion_tokens']} requests with completion_tokens != max_tokens (ignore_eos)")
    if res["hung"]:
        checks.append(f"{tag}: {res['hung']} requests still running {args.drain_timeout:.0f} s after the window")
    for pt in res["long_prompt_tokens"]:
        if pt is None or not (args.long_tokens - 16 <= pt <= args.long_tokens + 64):
            checks.append(f"{tag}: a long request had prompt_tokens {pt} (expected ~{args.long_tokens})")
    for pt, ct in zip(res["long_prompt_tokens"], res["long_cached_tokens"]):
        if cfg == "pd" and (ct or 0) < (pt or 0) - 32:
            checks.append(f"{tag}: a long request was prefilled remotely but the decode instance reported only "
                          f"{ct} of {pt} prompt tokens cached")
        if cfg == "colocated" and (ct or 0) > 32:
            checks.append(f"{tag}: a long request had {ct} cached tokens (documents should share no prefix)")
    if res["other_cores"] is not None and res["other_cores"] > CONTENDED_CORES:
        checks.append(f"{tag}: other processes took {res['other_cores']:.2f} cores during the window (contended)")
    if res["long_ttft_p50_ms"] is not None and res["long_ttft_p50_ms"] > 1e3 * args.long_interval:
        checks.append(f"{tag}: long TTFT p50 {res['long_ttft_p50_ms'] / 1e3:.1f} s > the {args.long_interval:g} s between "
                      f"documents: the prefilling side cannot keep up, the open loop backs up (shorter --long-tokens or "
                      f"a longer --long-interval on this host)")
    if (res["dispatch_late_max_ms"] or 0) > 100:
        checks.append(f"{tag}: a request went out {res['dispatch_late_max_ms']:.0f} ms after its scheduled time")
    if cfg == "pd":  # over the whole schedule (warm-up to drain): a long prefill often ends after the window
        rd = res["metric_deltas_run"].get("router", {})
        failed = g(rd, "router_prefills_total", 'result="failed"')
        if failed:
            checks.append(f"{tag}: router_prefills_total{{result=\"failed\"}} grew by {failed:.0f}")
        okp = g(rd, "router_prefills_total", 'result="ok"')
        res["prefills_ok"], res["prefills_failed"] = okp, failed
        res["prefills_skipped"] = g(rd, "router_prefills_total", 'result="skipped"')
        n_long_ok = sum(1 for x in res["long_prompt_tokens"] if x)
        if okp < n_long_ok:
            checks.append(f"{tag}: {okp:.0f} prefill handoffs for {n_long_ok} long requests")
        dd = res["metric_deltas_run"].get("decode", {})
        res["decode_redis_hit_pages"] = g(dd, "kv_tier_hits_total", 'tier="redis"')
        if n_long_ok and not res["decode_redis_hit_pages"]:
            checks.append(f"{tag}: the decode instance's kv_tier_hits_total{{tier=\"redis\"}} did not grow")
    for name, st in stops.items():
        if st.get("exit_code") not in (0, None) or st.get("killed"):
            checks.append(f"{tag}: {name} exited with {st.get('exit_code')} (killed={st.get('killed')}) on SIGTERM")
    return res


def part_pd(args, docs: tb.Docs, tmp: Path, rec: dict, checks: list[str]) -> None:
    pd = rec["pd"] = {"runs": [], "schedules": []}
    for rep in range(args.repeats):
        events = pd_schedule(args, rep, docs)
        pd["schedules"].append({"repeat": rep, "short": sum(e["kind"] == "short" for e in events),
                                "long": sum(e["kind"] == "long" for e in events),
                                "long_t": [round(e["t"], 2) for e in events if e["kind"] == "long"],
                                "long_doc_tokens_local": [e["doc_tokens_local"] for e in events if e["kind"] == "long"]})
        for cfg in PD_CONFIGS:
            log(f"== pd rep {rep + 1}/{args.repeats}: {cfg}")
            try:
                pd["runs"].append(pd_config(args, cfg, rep, events, tmp, checks))
            except RuntimeError as e:  # a process that would not start or answer: recorded, the next config runs
                log(f"pd rep {rep + 1} {cfg}: FAILED: {e}")
                checks.append(f"pd rep {rep + 1} {cfg}: failed: {str(e)[:600]}")
            summarize_pd(rec)
            args.out.write_text(json.dumps(rec, indent=1))


PD_KEYS = ["short_ttft_p50_ms", "short_ttft_p99_ms", "short_itl_p50_ms", "short_itl_p99_ms", "short_itl_max_ms",
           "short_e2e_p50_ms", "short_e2e_p99_ms",
           "long_ttft_p50_ms", "tok_per_s", "offered_tok_per_s", "errors", "http_5xx", "other_cores",
           "short_prompt_tokens_mean", "prefills_ok", "prefills_skipped", "decode_redis_hit_pages"]


def summarize_pd(rec: dict) -> None:
    pd = rec.get("pd")
    if not pd or not pd.get("runs"):
        return
    summ = {}
    for cfg in PD_CONFIGS:
        rs = [r for r in pd["runs"] if r["config"] == cfg]
        if rs:
            s = {k: med([r.get(k) for r in rs]) for k in PD_KEYS}
            s["repeats"] = len(rs)
            s["errors_total"] = sum(r["errors"] for r in rs)
            s["long_prompt_tokens"] = med([x for r in rs for x in r["long_prompt_tokens"]])
            s["long_cached_tokens"] = med([x for r in rs for x in r["long_cached_tokens"]])
            summ[cfg] = s
    pd["summary"] = summ
    if "colocated" in summ and "pd" in summ:
        a, b = summ["pd"], summ["colocated"]
        pd["ratios_pd_over_colocated"] = {k: ratio(a.get(k), b.get(k)) for k in PD_KEYS[:8]}
        rt = pd["ratios_pd_over_colocated"]["short_itl_p99_ms"]
        pd["target"] = {"text": "P/D ITL p99 <= 1/2 colocated", "ratio": rt, "met": None if rt is None else rt <= 0.5}


# ----------------------------------------------------------------------------- part replicas

_QUESTIONS = ["Who is mentioned first in the passage?", "Where does the passage take place?",
              "What is the mood of the passage?", "Name one person in the passage.",
              "What happens at the end of the passage?", "Who speaks the most in the passage?",
              "Is anyone unhappy in the passage?", "What season is it in the passage?"]
_CLUBS = ["Abbey", "Birch", "Cedar", "Dove", "Elm", "Fern", "Gull", "Heath", "Iris", "Juniper", "Kestrel", "Larch",
          "Maple", "Nettle", "Oak", "Poppy"]


def make_tenants(args, docs: tb.Docs) -> list[dict]:
    """T system prompts of ~tenant_tokens tokens: a header naming the tenant (distinct from the first
    words on: the affinity key is the first 128 tokens) + its own passage of the novels."""
    out = []
    for k in range(args.tenants):
        head = (f"You are the reading assistant of the {_CLUBS[k % len(_CLUBS)]} book club (tenant {k}). Answer every "
                f"question in one short sentence, using only the passage below.\n\nPassage:\n")
        n_head = len(docs._encode(head))
        text, _ = docs.take(max(16, args.tenant_tokens - n_head))
        system = head + text
        # the prefix every request of this tenant shares: the chat template up to the user's message
        n_prefix = len(docs._encode(f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n"))
        out.append({"tenant": k, "system": system, "prefix_tokens": n_prefix,
                    "cacheable_tokens": (n_prefix // args.block_size) * args.block_size})
    return out


def replica_kv_bytes(args, tenants: list[dict]) -> tuple[str, dict]:
    if args.replica_kv_memory:
        return args.replica_kv_memory, {"source": "--replica-kv-memory"}
    try:
        bpt = tb.kv_bytes_per_token(args)
    except Exception as e:  # noqa: BLE001
        log(f"kvserve kv-size failed ({e}): assuming SmolLM2's 23040 bytes per token")
        bpt = 23040
    total = sum(t["cacheable_tokens"] for t in tenants)
    # every user's private pages: its question + answer, rounded up to pages, +1 page for the partial one
    private = args.users * (math.ceil((48 + args.rr_max_tokens) / args.block_size) + 1) * args.block_size
    tokens = int(args.replica_kv_frac * total) + private
    b = tokens * bpt
    info = {"source": "computed", "bytes_per_token": bpt, "tenants_cacheable_tokens": total,
            "frac": args.replica_kv_frac, "private_tokens": private, "tokens": tokens, "bytes": b}
    log(f"replica KV: {args.replica_kv_frac:.2f} x {total} cacheable system-prompt tokens + {private} tokens for "
        f"{args.users} users' own pages = {tokens} tokens x {bpt} B = {b / 2**20:.1f} MiB per replica")
    return str(b), info


def rr_body(args, tenant: dict, u: int, k: int, q: str) -> dict:
    return {"messages": [{"role": "system", "content": tenant["system"]},
                         {"role": "user", "content": f"(user {u}, question {k}) {q}"}],
            "max_tokens": args.rr_max_tokens, "temperature": args.rr_temperature, "seed": 1000 * u + k, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}


def backend_requests(m: dict) -> dict[str, float]:
    out = {}
    for k, v in m.items():
        mm = re.match(r'kvserve:router_requests_total\{backend="([^"]+)"', k)
        if mm:
            out[mm.group(1)] = v
    return out


def replicas_mode(args, mode: str, rep: int, tenants: list[dict], kv_mem: str, checks: list[str]) -> dict:
    logs = args.out.parent / "disagg_logs"
    procs: list[Proc] = []
    stops = {}
    tag = f"replicas rep {rep + 1} {mode}"
    try:
        reps = []
        for name in ("A", "B"):
            p = free_port()
            reps.append(Proc(f"replica {name}", serve_cmd(args, p, args.replica_threads, kv_mem, args.replica_max_len, []),
                             p, logs / f"rr_{mode}_{name}_{rep}.log").start(args.startup_timeout))
            procs.append(reps[-1])
        rp = free_port()
        rt = Proc("router", router_cmd(args, rp, args.replica_max_len,
                                       sum((["--replica", r.url] for r in reps), []) + ["--routing", mode]),
                  rp, logs / f"rr_{mode}_router_{rep}.log").start(args.startup_timeout)
        procs.append(rt)
        names = {r.url: r.name.split()[-1] for r in reps}
        pools = {r.name.split()[-1]: pool_tokens(r) for r in reps}
        # calibration: each tenant once, one at a time: which replica took it
        tmap = {}
        for t in tenants:
            b0 = backend_requests(scrape(rt.port))
            r = stream_request(rt.port, "/v1/chat/completions",
                               dict(rr_body(args, t, -1, t["tenant"], "Say hello."), model=rt.model_id), args.timeout)
            b1 = backend_requests(scrape(rt.port))
            moved = [names.get(u, u) for u in b1 if b1[u] - b0.get(u, 0) > 0]
            tmap[t["tenant"]] = moved[0] if len(moved) == 1 else moved
            if not r["ok"]:
                raise RuntimeError(f"{tag}: calibration request for tenant {t['tenant']} failed: {r['error']}")
            t.setdefault("prompt_tokens_seen", r["pt"])
        split = {n: sorted(k for k, v in tmap.items() if v == n) for n in sorted(set(names.values()))}
        log(f"  {tag}: tenants per replica (calibration) " + ", ".join(f"{n}: {v}" for n, v in split.items())
            + "; pools " + ", ".join(f"{n} {v} tokens" for n, v in pools.items()))

        stop = threading.Event()
        results: list[dict] = []
        lock = threading.Lock()
        ramp = args.replica_warmup * 0.5

        def user(u: int) -> None:
            rng = random.Random(f"{args.seed}-{rep}-{u}")  # the same tenant sequence in both modes
            time.sleep(ramp * u / args.users)
            k = 0
            while not stop.is_set():
                t = tenants[rng.randrange(len(tenants))]
                q = _QUESTIONS[rng.randrange(len(_QUESTIONS))]
                r = stream_request(rt.port, "/v1/chat/completions", dict(rr_body(args, t, u, k, q), model=rt.model_id),
                                   args.timeout)
                r["tenant"], r["user"] = t["tenant"], u
                with lock:
                    results.append(r)
                k += 1
                if not r["ok"]:
                    time.sleep(0.05)  # do not spin on a refusing server

        watched = {"router": rt, "A": reps[0], "B": reps[1]}
        threads = [threading.Thread(target=user, args=(u,), daemon=True) for u in range(args.users)]
        t_start = time.perf_counter()
        for th in threads:
            th.start()
        time.sleep(args.replica_warmup)
        m0 = {k: scrape(p.port) for k, p in watched.items()}
        c0 = {k: proc_cpu_s(p.pid()) for k, p in watched.items()}
        mach0, cl0 = machine_busy_s(), time.process_time()
        ws = time.perf_counter()
        time.sleep(args.duration)
        we = time.perf_counter()
        m1 = {k: scrape(p.port) for k, p in watched.items()}
        c1 = {k: proc_cpu_s(p.pid()) for k, p in watched.items()}
        mach1, cl1 = machine_busy_s(), time.process_time()
        stop.set()
        for th in threads:
            th.join(timeout=args.timeout + 5)
        hung = sum(th.is_alive() for th in threads)
        drain = time.perf_counter() - we
    finally:
        for p in reversed(procs):
            stops[p.name] = p.stop()
    dur = we - ws
    with lock:
        res = list(results)
    ok = [r for r in res if r["ok"]]
    errs = [r for r in res if not r["ok"]]
    fin = [r for r in ok if ws <= r["t_end"] < we]
    ttft = [r["chunk_t"][0] - r["t_send"] for r in ok if r["chunk_t"] and ws <= r["chunk_t"][0] < we]
    pt = sum(r["pt"] or 0 for r in fin)
    ct = sum(r["cached"] or 0 for r in fin)
    deltas = {k: counter_deltas(m0.get(k, {}), m1.get(k, {})) for k in watched}
    b0, b1 = backend_requests(m0.get("router", {})), backend_requests(m1.get("router", {}))
    per_rep = {names.get(u, u): b1[u] - b0.get(u, 0) for u in b1}
    cores = {k: ((c1[k] - c0[k]) / dur if c0.get(k) is not None and c1.get(k) is not None else None) for k in watched}
    client = (cl1 - cl0) / dur
    other = None if mach0 is None or mach1 is None else max(0.0, (mach1 - mach0) / dur - sum(c or 0 for c in cores.values()) - client)
    by_tenant = {}
    for r in fin:
        e = by_tenant.setdefault(r["tenant"], {"requests": 0, "prompt": 0, "cached": 0})
        e["requests"] += 1
        e["prompt"] += r["pt"] or 0
        e["cached"] += r["cached"] or 0
    out = {
        "mode": mode, "repeat": rep, "window_s": dur, "drain_s": drain, "hung": hung, "warmup_s": ws - t_start,
        "kv_cache_memory": kv_mem, "pool_tokens": pools, "tenant_map": tmap, "tenant_split": split,
        "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)), "ttft_n": len(ttft),
        "hit_rate": ct / pt if pt else None, "prompt_tokens": pt, "cached_tokens": ct,
        "req_per_s": len(fin) / dur, "requests": len(fin), "requests_total": len(res),
        "per_replica_requests": per_rep,
        "errors": len(errs), "http_5xx": sum(1 for r in errs if (r["status"] or 0) >= 500),
        "error_samples": sorted({r["error"] for r in errs})[:5],
        "wrong_completion_tokens": sum(1 for r in ok if r["ct"] is not None and r["ct"] != args.rr_max_tokens),
        "by_tenant": {str(k): dict(v, hit_rate=v["cached"] / v["prompt"] if v["prompt"] else None)
                      for k, v in sorted(by_tenant.items())},
        "replica_prefix_hits": {n: g(deltas[n], "prefix_cache_hits_total") for n in ("A", "B")},
        "replica_prefix_queries": {n: g(deltas[n], "prefix_cache_queries_total") for n in ("A", "B")},
        "replica_evictions": {n: g(deltas[n], "prefix_cache_evictions_total") for n in ("A", "B")},
        "replica_preemptions": {n: g(deltas[n], "num_preemptions_total") for n in ("A", "B")},
        "router_affinity": {w: g(deltas["router"], "router_affinity_total", f'result="{w}"') for w in ("owner", "owner_busy", "owner_down")},
        "cores": cores, "client_cores": client, "other_cores": other,
        "metric_deltas": deltas, "stop": stops,
    }
    f = lambda x, d=0: "-" if x is None else f"{x:.{d}f}"  # noqa: E731
    log(f"  {tag}: TTFT p50/p99 {f(out['ttft_p50_ms'])}/{f(out['ttft_p99_ms'])} ms, hit rate "
        f"{f(100 * out['hit_rate'] if out['hit_rate'] is not None else None, 1)}%, {out['req_per_s']:.2f} req/s, "
        f"per replica {per_rep}, evictions {out['replica_evictions']}, preemptions {out['replica_preemptions']}, "
        f"errors {out['errors']}, cores " + ", ".join(f"{k} {f(v, 2)}" for k, v in cores.items()) + f", other {f(other, 2)}")
    if out["errors"]:
        checks.append(f"{tag}: {out['errors']} failed requests ({out['http_5xx']} HTTP 5xx): {out['error_samples'][:3]}")
    if out["wrong_completion_tokens"]:
        checks.append(f"{tag}: {out['wrong_completion_tokens']} requests with completion_tokens != {args.rr_max_tokens}")
    if hung:
        checks.append(f"{tag}: {hung} users still hung after the window")
    if other is not None and other > CONTENDED_CORES:
        checks.append(f"{tag}: other processes took {other:.2f} cores during the window (contended)")
    if mode in AFFINITY_MODES:
        for n, ts in split.items():
            need = sum(tenants[t]["cacheable_tokens"] for t in ts)
            if pools.get(n) and need > pools[n]:
                checks.append(f"{tag}: affinity put {len(ts)} tenants ({need} cacheable tokens) on replica {n}, whose pool "
                              f"holds {pools[n]} tokens: that replica thrashes too")
        if any(not isinstance(v, str) for v in tmap.values()):
            checks.append(f"{tag}: calibration could not tell the replica of some tenants: {tmap}")
    for name, st in stops.items():
        if st.get("exit_code") not in (0, None) or st.get("killed"):
            checks.append(f"{tag}: {name} exited with {st.get('exit_code')} (killed={st.get('killed')}) on SIGTERM")
    return out


def part_replicas(args, docs: tb.Docs, rec: dict, checks: list[str]) -> None:
    tenants = make_tenants(args, docs)
    kv_mem, info = replica_kv_bytes(args, tenants)
    rr = rec["replicas"] = {"tenants": [{k: v for k, v in t.items() if k != "system"} for t in tenants],
                            "kv_cache_memory": kv_mem, "kv_sizing": info, "runs": []}
    for rep in range(args.repeats):
        k = rep % len(args.rr_modes)
        modes = args.rr_modes[k:] + args.rr_modes[:k]
        for mode in modes:
            log(f"== replicas rep {rep + 1}/{args.repeats}: {mode}")
            try:
                rr["runs"].append(replicas_mode(args, mode, rep, tenants, kv_mem, checks))
            except RuntimeError as e:
                log(f"replicas rep {rep + 1} {mode}: FAILED: {e}")
                checks.append(f"replicas rep {rep + 1} {mode}: failed: {str(e)[:600]}")
            rr["tenants"] = [{k: v for k, v in t.items() if k != "system"} for t in tenants]
            summarize_rr(rec)
            args.out.write_text(json.dumps(rec, indent=1))


RR_KEYS = ["ttft_p50_ms", "ttft_p99_ms", "hit_rate", "req_per_s", "errors", "other_cores"]


def summarize_rr(rec: dict) -> None:
    rr = rec.get("replicas")
    if not rr or not rr.get("runs"):
        return
    summ = {}
    for mode in RR_MODES:
        # runs of before cache-aware routing called the ring "affinity"
        rs = [r for r in rr["runs"] if r["mode"] == mode or (mode == "ring" and r["mode"] == "affinity")]
        if rs:
            s = {k: med([r.get(k) for r in rs]) for k in RR_KEYS}
            s["repeats"] = len(rs)
            s["errors_total"] = sum(r["errors"] for r in rs)
            s["per_replica_requests"] = {n: med([r["per_replica_requests"].get(n) for r in rs]) for n in ("A", "B")}
            s["evictions"] = med([sum(r["replica_evictions"].values()) for r in rs])
            s["preemptions"] = med([sum(r["replica_preemptions"].values()) for r in rs])
            s["tenant_split"] = [{n: len(v) for n, v in r["tenant_split"].items()} for r in rs]
            summ[mode] = s
    rr["summary"] = summ
    rr.pop("ratios_round_robin_over_affinity", None)
    rr["ratios_round_robin_over"] = {}
    for mode in AFFINITY_MODES:
        if mode in summ and "round-robin" in summ:
            a, b = summ[mode], summ["round-robin"]
            rr["ratios_round_robin_over"][mode] = {k: ratio(b.get(k), a.get(k)) for k in RR_KEYS[:4]}
    best = next((m for m in AFFINITY_MODES if m in rr["ratios_round_robin_over"]), None)  # the default first
    if best:
        rt = rr["ratios_round_robin_over"][best]["ttft_p50_ms"]
        rr["target"] = {"text": f"affinity ({best}) TTFT p50 >= 2x lower than round-robin", "mode": best, "ratio": rt,
                        "met": None if rt is None else rt >= 2}


# ----------------------------------------------------------------------------- table, plot

def fmt(x, d=0):
    return "-" if x is None else f"{x:.{d}f}"


def print_table(rec: dict) -> None:
    h = rec["host"]
    print(f"disagg_bench: {rec['model']}, {h.get('cpu_model')} x{h.get('nproc')}, medians of {rec['params']['repeats']} "
          f"repeat(s), {rec['params']['duration']:g} s windows, {rec['date']}")
    pd = rec.get("pd") or {}
    if pd.get("summary"):
        s, rt = pd["summary"], pd.get("ratios_pd_over_colocated") or {}
        p = rec["params"]
        print(f"\nP/D vs colocated: short chat {p['short_rate']:g}/s (max_tokens {p['short_max_tokens']}), "
              f"{p['long_tokens']}-token documents every {p['long_interval']:g} s (max_tokens {p['long_max_tokens']})")
        print("| | colocated (1 x 2 threads) | P/D (prefill 1 + decode 1 thread) | P/D / colocated |")
        print("|---|---|---|---|")
        rows = [("short TTFT p50 (ms)", "short_ttft_p50_ms", 0), ("short TTFT p99 (ms)", "short_ttft_p99_ms", 0),
                ("short ITL p50 (ms)", "short_itl_p50_ms", 1), ("short ITL p99 (ms)", "short_itl_p99_ms", 1),
                ("short ITL max (ms)", "short_itl_max_ms", 0), ("short end-to-end p50 (ms)", "short_e2e_p50_ms", 0),
                ("short end-to-end p99 (ms)", "short_e2e_p99_ms", 0), ("long TTFT p50 (ms)", "long_ttft_p50_ms", 0),
                ("tok/s in window", "tok_per_s", 1), ("offered tok/s", "offered_tok_per_s", 1),
                ("long prompt / cached tokens", None, 0), ("short prompt tokens (mean)", "short_prompt_tokens_mean", 0),
                ("prefill handoffs ok / skipped", "prefills", 0), ("errors", "errors_total", 0), ("other cores", "other_cores", 2)]
        for name, k, d in rows:
            c, q = s.get("colocated", {}), s.get("pd", {})
            if k is None:
                print(f"| {name} | {fmt(c.get('long_prompt_tokens'))} / {fmt(c.get('long_cached_tokens'))} | "
                      f"{fmt(q.get('long_prompt_tokens'))} / {fmt(q.get('long_cached_tokens'))} | |")
                continue
            if k == "prefills":
                print(f"| {name} | | {fmt(q.get('prefills_ok'))} / {fmt(q.get('prefills_skipped'))} | |")
                continue
            print(f"| {name} | {fmt(c.get(k), d)} | {fmt(q.get(k), d)} | {fmt(rt.get(k), 2)} |")
        t = pd.get("target")
        if t:
            print(f"target {t['text']}: P/D / colocated = {fmt(t['ratio'], 2)} -> {'MET' if t['met'] else 'NOT MET'}")
    rr = rec.get("replicas") or {}
    if rr.get("summary"):
        s, rts = rr["summary"], rr.get("ratios_round_robin_over") or {}
        p = rec["params"]
        modes = [m for m in RR_MODES if m in s]
        ratio_cols = [m for m in AFFINITY_MODES if m in rts]
        print(f"\nAffinity vs round-robin: {p['tenants']} tenants x ~{p['tenant_tokens']}-token system prompts, "
              f"{p['users']} users closed loop, max_tokens {p['rr_max_tokens']}, KV per replica {rr['kv_cache_memory']} B")
        print("| | " + " | ".join(modes) + "".join(f" | round-robin / {m}" for m in ratio_cols) + " |")
        print("|---|" + "---|" * (len(modes) + len(ratio_cols)))
        for name, k, d, scale in [("TTFT p50 (ms)", "ttft_p50_ms", 0, 1), ("TTFT p99 (ms)", "ttft_p99_ms", 0, 1),
                                  ("prefix hit rate (%)", "hit_rate", 1, 100), ("requests/s", "req_per_s", 2, 1),
                                  ("evictions (pages)", "evictions", 0, 1), ("preemptions", "preemptions", 0, 1),
                                  ("errors", "errors_total", 0, 1), ("other cores", "other_cores", 2, 1)]:
            cells = [fmt(s[m].get(k) * scale if s[m].get(k) is not None else None, d) for m in modes]
            cells += [fmt(rts[m].get(k), 2) for m in ratio_cols]
            print(f"| {name} | " + " | ".join(cells) + " |")
        cells = []
        for m in modes:
            pr = s[m].get("per_replica_requests") or {}
            cells.append(f"{fmt(pr.get('A'))} / {fmt(pr.get('B'))}")
        print("| requests A / B | " + " | ".join(cells) + " |" * (len(ratio_cols) + 1))
        cells = ["; ".join("/".join(str(x.get(n, 0)) for n in ("A", "B")) for x in s[m].get("tenant_split", [])) for m in modes]
        print("| tenants A / B (calibration) | " + " | ".join(cells) + " |" * (len(ratio_cols) + 1))
        t = rr.get("target")
        if t:
            print(f"target {t['text']}: round-robin / {t.get('mode', 'affinity')} = {fmt(t['ratio'], 2)} -> {'MET' if t['met'] else 'NOT MET'}")
    if rec.get("checks"):
        print("\nanomalies:")
        for c in rec["checks"]:
            print(f"  - {c}")


def plot(rec: dict, path: Path) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib missing: no plot")
        return
    pd = (rec.get("pd") or {}).get("summary") or {}
    rr = (rec.get("replicas") or {}).get("summary") or {}
    panels = [x for x, have in (("pd", pd), ("rr", rr)) if have]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(6.2 * len(panels), 4.6), squeeze=False,
                             gridspec_kw={"width_ratios": [5, 3][:len(panels)] if len(panels) == 2 else None})
    for ax, which in zip(axes[0], panels):
        if which == "pd":
            keys = [("short_ttft_p50_ms", "short\nTTFT p50"), ("short_ttft_p99_ms", "short\nTTFT p99"),
                    ("short_itl_p50_ms", "short\nITL p50"), ("short_itl_p99_ms", "short\nITL p99"),
                    ("short_e2e_p99_ms", "short\nend-to-end p99"), ("long_ttft_p50_ms", "long\nTTFT p50")]
            keys = [(k, n) for k, n in keys if any((pd.get(c) or {}).get(k) is not None for c in ("colocated", "pd"))]
            series = [("colocated", "colocated, 1 x 2 threads", "#888888"), ("pd", "P/D, prefill 1 + decode 1 thread", "#1f77b4")]
            rt = rec["pd"].get("ratios_pd_over_colocated") or {}
        else:
            keys = [("ttft_p50_ms", "TTFT p50"), ("ttft_p99_ms", "TTFT p99")]
            series = [("cache-aware", "cache-aware", "#2ca02c"), ("ring", "ring", "#9467bd"), ("round-robin", "round-robin", "#d62728")]
            rt = {}
        summ = pd if which == "pd" else rr
        w = 0.8 / len(series)
        for i, (cfg, label, color) in enumerate(series):
            s = summ.get(cfg)
            if not s:
                continue
            if which == "pd":
                label += f" ({fmt(s.get('tok_per_s'), 0)} tok/s, {s.get('errors_total', 0)} err)"
            else:
                hr = s.get("hit_rate")
                label += f" (hit rate {fmt(100 * hr if hr is not None else None, 0)}%, {fmt(s.get('req_per_s'), 2)} req/s)"
            xs = [j + (i - (len(series) - 1) / 2) * w for j in range(len(keys))]
            ys = [s.get(k) or 0 for k, _ in keys]
            ax.bar(xs, ys, width=w, color=color, label=label)
            for x, y, (k, _) in zip(xs, ys, keys):
                if y:
                    txt = f"{y:.0f}" if y >= 10 else f"{y:.1f}"
                    if which == "pd" and cfg == "pd" and rt.get(k) is not None:
                        txt += f"\n{rt[k]:.2f}x"
                    ax.annotate(txt, (x, y), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
        ax.set_yscale("log")
        ticks = [n for _, n in keys]
        if which == "rr":  # the hit rate, on its own axis, as a third group
            ax2 = ax.twinx()
            for i, (cfg, _label, color) in enumerate(series):
                hr = (summ.get(cfg) or {}).get("hit_rate")
                if hr is None:
                    continue
                x = len(keys) + (i - (len(series) - 1) / 2) * w
                ax2.bar([x], [100 * hr], width=w, color=color, alpha=0.55, hatch="//")
                ax2.annotate(f"{100 * hr:.0f}%", (x, 100 * hr), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=7)
            ax2.set_ylim(0, 130)
            ax2.set_ylabel("prefix hit rate, % (hatched)")
            ticks.append("prefix hit rate\n(cached / prompt tokens)")
        ax.set_xticks(range(len(ticks)), ticks, fontsize=8)
        ax.set_ylabel("ms (log; median over repeats)")
        ax.grid(axis="y", alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="upper left")
        vals = [(summ.get(c) or {}).get(k) or 0 for c, _, _ in series for k, _ in keys]
        if any(vals):
            ax.set_ylim(bottom=min(v for v in vals if v > 0) / 4, top=max(vals) * 8)
        p = rec["params"]
        if which == "pd":
            t = rec["pd"].get("target") or {}
            ax.set_title(f"colocated vs prefill/decode: chat {p['short_rate']:g}/s + {p['long_tokens']}-token docs every "
                         f"{p['long_interval']:g} s\nITL p99 P/D/colocated = {fmt(t.get('ratio'), 2)} (target <= 0.5)", fontsize=9)
        else:
            t = rec["replicas"].get("target") or {}
            ax.set_title(f"2 replicas: {p['tenants']} tenants x ~{p['tenant_tokens']}-token prompts, {p['users']} users\n"
                         f"TTFT p50 round-robin/{t.get('mode', 'affinity')} = {fmt(t.get('ratio'), 2)} (target >= 2)", fontsize=9)
    h = rec["host"]
    fig.suptitle(f"disagg_bench: {rec['model']}, {h.get('cpu_model')} x{h.get('nproc')}\n{rec['params']['duration']:g} s windows, "
                 f"{rec['params']['repeats']} repeat(s), {rec['date'][:10]}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")


# ----------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma list of {PARTS}")
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--texts", type=Path, nargs="+",
                    default=[ROOT / "data" / "text" / "emma.txt", ROOT / "data" / "text" / "pride_and_prejudice.txt"])
    ap.add_argument("--redis-server", default=shutil.which("redis-server") or "/usr/bin/redis-server")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every config (medians reported)")
    ap.add_argument("--duration", type=float, default=60.0, help="measured window per run (s)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=600, help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=float, default=120)
    ap.add_argument("--block-size", type=int, default=16, help="the servers' KV page size (tokens)")
    g_pd = ap.add_argument_group("part pd")
    g_pd.add_argument("--threads", type=int, default=2, help="threads of the colocated server (P/D: 1 + 1)")
    g_pd.add_argument("--kv-cache-memory", default="1GiB", help="--kv-cache-memory of the pd part's servers")
    g_pd.add_argument("--max-model-len", type=int, default=8192)
    g_pd.add_argument("--warmup", type=float, default=5.0, help="schedule time before the window (s, not counted)")
    g_pd.add_argument("--tail", type=float, default=3.0, help="short arrivals after the window (s, not counted)")
    g_pd.add_argument("--drain-timeout", type=float, default=300, help="wait for in-flight requests after the schedule (s)")
    g_pd.add_argument("--short-rate", type=float, default=1.0, help="short chat turns per second (Poisson)")
    g_pd.add_argument("--short-max-tokens", type=int, default=64)
    g_pd.add_argument("--short-words-min", type=int, default=12, help="synthetic words per chat message (~1.3 tokens each)")
    g_pd.add_argument("--short-words-max", type=int, default=34)
    g_pd.add_argument("--long-interval", type=float, default=15.0, help="seconds between long documents")
    g_pd.add_argument("--long-tokens", type=int, default=4096, help="tokens per document")
    g_pd.add_argument("--long-max-tokens", type=int, default=16)
    g_pd.add_argument("--pd-pin", action="store_true",
                      help="P/D as on two machines: the decode instance alone on CPU 1; the prefill instance, Redis, the "
                           "router and the load generator on CPU 0 (taskset / sched_setaffinity). Colocated is unpinned")
    g_pd.add_argument("--prefill-min-tokens", type=int, default=256,
                      help="router: shorter prompts skip the prefill instance (the chat turns are ~60-90 tokens)")
    g_pd.add_argument("--colocated-args", default="", help="more `serve` flags of the colocated server (one string)")
    g_pd.add_argument("--prefill-args", default="", help="more `serve` flags of the prefill instance")
    g_pd.add_argument("--decode-args", default="", help="more `serve` flags of the decode instance")
    g_rr = ap.add_argument_group("part replicas")
    g_rr.add_argument("--tenants", type=int, default=8)
    g_rr.add_argument("--tenant-tokens", type=int, default=1000, help="tokens per tenant system prompt")
    g_rr.add_argument("--users", type=int, default=8, help="closed-loop users")
    g_rr.add_argument("--rr-modes", default=",".join(RR_MODES), help=f"comma list of the router's --routing modes to run: {RR_MODES}")
    g_rr.add_argument("--rr-max-tokens", type=int, default=16)
    g_rr.add_argument("--rr-temperature", type=float, default=0.7, help="sampling temperature of the users' requests")
    g_rr.add_argument("--replica-threads", type=int, default=1)
    g_rr.add_argument("--replica-kv-frac", type=float, default=0.6,
                      help="share of all tenants' cacheable system-prompt tokens one replica's KV holds")
    g_rr.add_argument("--replica-kv-memory", default=None, help="--kv-cache-memory of each replica (overrides the computed size)")
    g_rr.add_argument("--replica-max-len", type=int, default=2048)
    g_rr.add_argument("--replica-warmup", type=float, default=5.0, help="closed loop before the window (s, not counted)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "disagg_bench.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "docs" / "disagg_bench.png")
    ap.add_argument("--replot", action="store_true", help="no runs: the table and plot from --out")
    args = ap.parse_args()

    if args.replot:
        rec = json.loads(args.out.read_text())
        summarize_pd(rec)
        summarize_rr(rec)
        print_table(rec)
        plot(rec, args.plot)
        return 0

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    for p in parts:
        if p not in PARTS:
            ap.error(f"unknown part {p!r} (choose from {PARTS})")
    args.rr_modes = [m.strip() for m in args.rr_modes.split(",") if m.strip()]
    for m in args.rr_modes:
        if m not in RR_MODES:
            ap.error(f"unknown --rr-modes entry {m!r} (choose from {RR_MODES})")
    for what, p in (("model", args.model), ("kvserve", args.kvserve)):
        if not Path(p).exists():
            ap.error(f"{what} not found: {p}")
    for p in args.texts:
        if not p.exists():
            ap.error(f"text not found: {p} (make text)")
    h = subprocess.run([str(args.kvserve), "router", "--help"], capture_output=True, text=True)
    if h.returncode != 0:
        ap.error(f"{args.kvserve} has no working `router` subcommand (exit {h.returncode}): rebuild it")
    if "pd" in parts and not Path(args.redis_server).exists():
        ap.error(f"no redis-server at {args.redis_server} (the P/D part needs one)")

    signal.signal(signal.SIGTERM, _on_signal)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    host = host_info()
    la = host["loadavg_start"]
    if la and os.cpu_count() and la[0] > 0.5 * os.cpu_count():
        log(f"WARNING: load average {la} on {os.cpu_count()} cores before start: something else is running, "
            f"absolute numbers will be noisy")
    rec = {"bench": "disagg_bench", "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
           "host": host, "model": args.model.stem, "kvserve": binary_info(args.kvserve), "parts": parts,
           "params": {k: (str(v) if isinstance(v, Path) else [str(x) for x in v] if isinstance(v, list) else v)
                      for k, v in vars(args).items()},
           "method": "open loop (pd) / closed loop (replicas) streaming clients on loopback; TTFT = send -> first "
                     "non-empty content chunk; ITL = client-side gaps between content chunks; every server fresh per "
                     "config and repeat; medians over repeats",
           "checks": []}
    tmp = Path(tempfile.mkdtemp(prefix="disagg_bench_"))
    try:
        docs = tb.Docs(args.model, args.texts)
        if "pd" in parts:
            t0 = time.time()
            part_pd(args, docs, tmp, rec, rec["checks"])
            log(f"== part pd done in {time.time() - t0:.0f} s")
        if "replicas" in parts:
            t0 = time.time()
            part_replicas(args, docs, rec, rec["checks"])
            log(f"== part replicas done in {time.time() - t0:.0f} s")
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
        rec["checks"].append("run interrupted")
    finally:
        tb._kill_all()  # every child: Proc and Redis register theirs with tier_bench
        shutil.rmtree(tmp, ignore_errors=True)
    rec["runtime_s"] = time.time() - T_START
    rec["host"]["loadavg_end"] = list(os.getloadavg())
    b_end = binary_info(args.kvserve)
    if b_end != rec["kvserve"]:
        rec["checks"].append(f"the kvserve binary changed on disk during the run: {rec['kvserve']} -> {b_end}")
    summarize_pd(rec)
    summarize_rr(rec)
    args.out.write_text(json.dumps(rec, indent=1))
    log(f"wrote {args.out}")
    print_table(rec)
    plot(rec, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
