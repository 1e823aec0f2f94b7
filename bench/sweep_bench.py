#!/usr/bin/env python3
"""Serving throughput sweep: kvserve vs llama-server, closed loop, no shared prefix.

Both servers are started once (slots for the largest user count) and stay up for the whole run;
the sweep interleaves them per (users, temperature) cell, alternating which goes first, so both
see the same machine conditions. In each cell U client threads each send streaming chat
completions back to back (closed loop):

  * a short, distinct user message per request ("Write a short story about <topic> number
    <rep-cell-user-k>."): nothing but the chat template's few tokens can come from a prefix cache;
    both servers get the same prompts in the same cell; --prompt-cache on (default) lets both reuse
    those tokens as they do by default (cached_tokens_mean per cell: kvserve matches them in its radix
    tree, llama-server in the slot's previous prompt), off makes both prefill every prompt token;
  * max_tokens --max-tokens (64), ignore_eos (both servers accept it), so every request
    generates exactly max_tokens tokens;
  * temperature T and top_p --top-p (1.0), top_k --top-k (0 = off) and min_p --min-p (0 = off)
    sent explicitly: llama-server would otherwise apply its own default top_k 40 / min_p 0.05,
    and the two servers would sample from different distributions; a per-request seed when T > 0.

Clients: one kept-alive HTTP connection per user (as OpenAI SDK clients do; --no-keep-alive opens
one per request), started spread over the first half of the warm-up (--ramp): users released at
the same instant stay in lock step under continuous batching (they finish at the same step, so
they reconnect and prefill together), which is not what traffic looks like.

Timeline of a cell: warm-up (--warmup s, not counted), then the measured window (--duration s),
then the clients stop issuing and the in-flight requests drain (not counted).

  tok/s (headline)   completion tokens streamed inside the window / window: every content chunk
                     whose arrival falls in the window (x tokens per chunk, 1.0 for both servers),
                     whether its request finished inside the window or not;
  finished tok/s     completion tokens (usage.completion_tokens) of the requests that *finished*
                     inside the window / window: the same quantity quantised to whole requests, so
                     noisy when a window holds only a few request lifetimes (U=1 with short windows;
                     U=64, where one 64-token request takes ~10 s on 2 cores); kept for reference;
  TTFT               send -> first non-empty content chunk, for first chunks that arrived in the window;
  ITL                gaps between consecutive content chunks of a request (client-side arrival
                     times), for gaps that ended in the window; TPOT p50 over finished requests.

Also recorded: CPU seconds of the server (and of the idle other server, and of this client) during
the window, TCP connects, errors with their timing, and for kvserve the /metrics deltas over the
window: the step profile (share of each kvserve:step_phase_seconds{phase} sum), engine steps,
tokens per step, ms per step, preemptions. The machine's busy CPU time (/proc/stat) minus the
server's, the idle peer's and the client's gives "other cores": a cell where other processes took
more than 0.25 cores is listed under anomalies and its kvserve/llama-server ratio is flagged
"contended" (llama-server's spinning thread barrier stalls for seconds when a core is taken away,
kvserve degrades to about half: such ratios say nothing about either engine).

With --repeats N each cell runs N times per config; the summary holds medians over repeats.

  python3 bench/sweep_bench.py                          # 4 user counts x 2 temperatures x 2 configs
  python3 bench/sweep_bench.py --quick --configs kvserve
  python3 bench/sweep_bench.py --top-p 0.95 --users 1,16 --repeats 3

Output: bench/out/sweep_bench.json, bench/out/sweep_bench.png (matplotlib; skipped if absent),
server logs in bench/out/sweep_logs/. Progress on stderr. Uses bench/serve_bench.py's server
and SSE machinery.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve_bench as sb  # noqa: E402
from serve_bench import (ROOT, DEFAULT_KVSERVE, DEFAULT_LLAMA_SERVER, DEFAULT_MODEL, Server,  # noqa: E402
                         binary_info, free_port, fmt, host_info, http_get, loadavg, machine_busy_s, pct, proc_cpu_s,
                         server_cmd, sse_events)

ALL_CONFIGS = ["kvserve", "llama-server"]
PHASES = ["schedule", "forward_matmul", "forward_attention", "forward_logits", "sample", "postprocess"]
T_START = time.time()


def log(msg: str) -> None:
    print(f"[sweep_bench {time.time() - T_START:6.1f}s] {msg}", file=sys.stderr, flush=True)


sb.log = log  # serve_bench.Server logs through its module's log(): same prefix and clock as ours

_TOPICS = ["a lighthouse keeper", "a lost robot", "the last dragon", "a time-travelling cat",
           "a haunted library", "two rival chefs", "a pirate astronomer", "a talking river",
           "the moon's night off", "a clockmaker's apprentice", "a desert city", "a shy volcano",
           "an underwater train", "the forgotten king", "a garden on Mars", "a detective owl",
           "a snowstorm in July", "the painter's ghost", "a bridge of glass", "a runaway balloon"]


# ----------------------------------------------------------------------------- client

class Client:
    """One user's HTTP connection. keep_alive: reuse it across requests as OpenAI SDK clients do (the
    connection is reopened after an error or a server-side close); otherwise a new one per request."""

    def __init__(self, port: int, timeout: float, keep_alive: bool):
        self.port, self.timeout, self.keep_alive = port, timeout, keep_alive
        self.conn: http.client.HTTPConnection | None = None
        self.connects = 0

    def _close(self):
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    def _send(self, payload: str) -> http.client.HTTPResponse:
        reused = self.conn is not None
        for attempt in (0, 1):
            if self.conn is None:
                self.conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=self.timeout)
                self.connects += 1
            try:
                self.conn.request("POST", "/v1/chat/completions", payload, {"Content-Type": "application/json"})
                return self.conn.getresponse()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._close()
                if not reused or attempt == 1:  # a stale kept-alive socket gets one retry on a fresh one
                    raise
        raise AssertionError("unreachable")

    def request(self, body: dict) -> dict:
        """One streaming chat completion; absolute perf_counter times of send, content chunks, end."""
        res = {"ok": False, "t_send": time.perf_counter(), "t_end": None, "chunk_t": [],
               "ct": None, "pt": None, "cached": None, "finish_reason": None, "error": None, "status": None}
        try:
            r = self._send(json.dumps(body))
            res["status"] = r.status
            if r.status != 200:
                res["error"] = f"HTTP {r.status}: {r.read()[:300].decode('utf-8', 'replace')}"
                self._close()
                return res
            done = False
            for ev in sse_events(r):
                if ev is None:
                    done = True
                    break
                if "error" in ev:
                    res["error"] = f"stream error: {json.dumps(ev['error'])[:300]}"
                    break
                for ch in ev.get("choices") or []:
                    if (ch.get("delta") or {}).get("content"):
                        res["chunk_t"].append(time.perf_counter())
                    if ch.get("finish_reason"):
                        res["finish_reason"] = ch["finish_reason"]
                u = ev.get("usage")
                if u:
                    res["ct"], res["pt"] = u.get("completion_tokens"), u.get("prompt_tokens")
                    res["cached"] = (u.get("prompt_tokens_details") or {}).get("cached_tokens")
            res["t_end"] = time.perf_counter()
            if done:
                res["ok"] = True
                if self.keep_alive:
                    r.read()  # the rest of the chunked body, so the connection can carry the next request
                    if r.will_close:
                        self._close()
                else:
                    self._close()
            else:
                res["error"] = res["error"] or "stream ended without [DONE]"
                self._close()
        except Exception as e:  # noqa: BLE001 - every client-side failure is an error of the cell
            res["error"] = f"{type(e).__name__}: {e}"
            self._close()
        if res["t_end"] is None:
            res["t_end"] = time.perf_counter()
        return res


def request_body(model_id: str, args, temp: float, rep: int, cell: int, user: int, k: int, cfg: str) -> dict:
    topic = _TOPICS[(7 * user + 3 * k + cell) % len(_TOPICS)]
    body = {"model": model_id,
            "messages": [{"role": "user", "content": f"Write a short story about {topic} number {rep}-{cell}-{user}-{k}."}],
            "max_tokens": args.max_tokens, "temperature": temp, "top_p": args.top_p,
            "top_k": args.top_k, "min_p": args.min_p, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    if cfg == "llama-server" and args.prompt_cache == "off":
        body["cache_prompt"] = False  # the slot's previous prompt is not reused (kvserve: --no-enable-prefix-caching)
    if temp > 0:
        body["seed"] = (rep * 1_000_003 + cell * 10_007 + user * 101 + k) & 0x7FFFFFFF
    return body


# ----------------------------------------------------------------------------- /metrics, /proc

_LINE_RE = re.compile(r'^(kvserve:[a-z_]+)(?:\{([^}]*)\})?\s+([0-9.eE+-]+|NaN|[+-]Inf)$')


def aborted(m: dict) -> float:
    """kvserve:request_aborted_total summed over its reasons."""
    return sum(v for k, v in m.items() if k.startswith("kvserve:request_aborted_total"))


def rejected(m: dict) -> float:
    """kvserve:request_rejected_total summed over its reasons."""
    return sum(v for k, v in m.items() if k.startswith("kvserve:request_rejected_total"))


def scrape(port: int) -> dict:
    """kvserve /metrics -> {name or name{labels}: value}; {} when unreachable."""
    try:
        st, text = http_get(port, "/metrics", timeout=10)
    except OSError:
        return {}
    if st != 200:
        return {}
    out = {}
    for line in text.splitlines():
        m = _LINE_RE.match(line.strip())
        if m and "_bucket" not in m.group(1):
            out[m.group(1) + (f"{{{m.group(2)}}}" if m.group(2) else "")] = float(m.group(3))
    return out


def step_profile(m0: dict, m1: dict, wall: float) -> dict | None:
    if not m0 or not m1:
        return None
    d = {p: m1.get(f'kvserve:step_phase_seconds_sum{{phase="{p}"}}', 0.0)
         - m0.get(f'kvserve:step_phase_seconds_sum{{phase="{p}"}}', 0.0) for p in PHASES}
    tot = sum(d.values())
    steps = m1.get("kvserve:engine_steps_total", 0) - m0.get("kvserve:engine_steps_total", 0)
    gen = m1.get("kvserve:generation_tokens_total", 0) - m0.get("kvserve:generation_tokens_total", 0)
    return {"share": {p: (v / tot if tot > 0 else None) for p, v in d.items()},
            "seconds": d, "phases_total_s": tot,
            "engine_busy_frac": tot / wall if wall > 0 else None,
            "engine_steps": steps, "generation_tokens": gen,
            "tokens_per_step": gen / steps if steps else None,
            "ms_per_step": 1e3 * tot / steps if steps else None,
            "preemptions": m1.get("kvserve:num_preemptions_total", 0) - m0.get("kvserve:num_preemptions_total", 0),
            "rejected": rejected(m1) - rejected(m0),
            "aborted": aborted(m1) - aborted(m0)}


def delta(a, b):
    return None if a is None or b is None else b - a


# ----------------------------------------------------------------------------- one cell

def run_cell(cfg: str, srv: Server, other: Server | None, args, users: int, temp: float,
             rep: int, cell: int) -> dict:
    stop = threading.Event()
    results: list[dict] = []
    lock = threading.Lock()

    clients = [Client(srv.port, args.timeout, args.keep_alive) for _ in range(users)]
    ramp = args.warmup * args.ramp

    def client(u: int):
        # spread the starts over the first part of the warm-up: U users released at once stay in lock step
        # (they all finish at the same engine step) and burst U connects at the server
        time.sleep(ramp * u / users)
        c, k = clients[u], 0
        while not stop.is_set():
            r = c.request(request_body(srv.model_id, args, temp, rep, cell, u, k, cfg))
            with lock:
                results.append(r)
            k += 1
            if not r["ok"]:
                time.sleep(0.05)  # do not spin on a refusing server
        c._close()

    threads = [threading.Thread(target=client, args=(u,), daemon=True) for u in range(users)]
    t_start = time.perf_counter()
    for t in threads:
        t.start()
    time.sleep(args.warmup)
    is_kv = cfg == "kvserve"
    m0 = scrape(srv.port) if is_kv else {}
    cpu0, ocpu0, ccpu0 = proc_cpu_s(srv.proc.pid), proc_cpu_s(other.proc.pid if other else None), time.process_time()
    mcpu0 = machine_busy_s()
    ws = time.perf_counter()
    time.sleep(max(0.0, ws + args.duration - time.perf_counter()))
    we = time.perf_counter()
    cpu1, ocpu1, ccpu1 = proc_cpu_s(srv.proc.pid), proc_cpu_s(other.proc.pid if other else None), time.process_time()
    mcpu1 = machine_busy_s()
    m1 = scrape(srv.port) if is_kv else {}
    stop.set()
    for t in threads:
        t.join(timeout=args.timeout + 5)
    drain = time.perf_counter() - we
    hung = sum(t.is_alive() for t in threads)
    dur = we - ws

    with lock:
        res = list(results)
    ok = [r for r in res if r["ok"]]
    fin = [r for r in ok if ws <= r["t_end"] < we]          # finished inside the window
    errs = [r for r in res if not r["ok"]]
    fin_toks = sum(r["ct"] if r["ct"] is not None else len(r["chunk_t"]) for r in fin)
    all_toks = sum(r["ct"] if r["ct"] is not None else len(r["chunk_t"]) for r in ok)
    all_chunks = sum(len(r["chunk_t"]) for r in ok)
    tpc = all_toks / all_chunks if all_chunks else 1.0        # tokens per content chunk (1.0 when streamed per token)
    # every token streamed inside the window, by requests finished in it, started in it, or spanning it
    chunks_in = sum(1 for r in res for t in r["chunk_t"] if ws <= t < we)
    # latencies of what happened inside the window: first tokens that arrived in it, gaps that ended in it
    ttft = [r["chunk_t"][0] - r["t_send"] for r in ok if r["chunk_t"] and ws <= r["chunk_t"][0] < we]
    itl = [b - a for r in ok for a, b in zip(r["chunk_t"], r["chunk_t"][1:]) if ws <= b < we]
    tpot = [(r["chunk_t"][-1] - r["chunk_t"][0]) / (r["ct"] - 1) for r in fin
            if r["chunk_t"] and r["ct"] and r["ct"] > 1]
    wrong_len = [r for r in ok if r["ct"] is not None and r["ct"] != args.max_tokens]
    no_usage = sum(1 for r in ok if r["ct"] is None)
    ms = lambda x: None if x is None else 1e3 * x  # noqa: E731
    out = {
        "config": cfg, "users": users, "temperature": temp, "repeat": rep,
        "window_s": dur, "warmup_s": ws - t_start, "drain_s": drain,
        # headline: completion tokens streamed inside the window / window
        "tok_per_s": chunks_in * tpc / dur,
        # completion tokens of the requests that finished inside the window / window (quantised to whole
        # requests: noisy when a window holds few request lifetimes, i.e. at U=1 and at large U)
        "finished_tok_per_s": fin_toks / dur,
        "req_per_s": len(fin) / dur,
        "requests": len(fin), "requests_total": len(res), "completion_tokens_finished": fin_toks,
        "errors": len(errs), "errors_in_window": sum(1 for r in errs if ws <= r["t_end"] < we),
        "error_samples": sorted({r["error"] for r in errs})[:5],
        # [seconds from cell start to send, seconds from send to failure, error] of the first failures
        "error_timing": [[round(r["t_send"] - t_start, 3), round(r["t_end"] - r["t_send"], 3), r["error"][:80]]
                         for r in sorted(errs, key=lambda r: r["t_send"])[:10]],
        "http_5xx": sum(1 for r in errs if (r["status"] or 0) >= 500),
        "connects": sum(c.connects for c in clients),
        "hung_clients": hung,
        "wrong_completion_tokens": len(wrong_len), "missing_usage": no_usage,
        "prompt_tokens_mean": statistics.fmean([r["pt"] for r in ok if r["pt"] is not None]) if any(r["pt"] is not None for r in ok) else None,
        # prompt tokens served from the server's prompt cache (usage.prompt_tokens_details.cached_tokens, both report it)
        "cached_tokens_mean": statistics.fmean([r["cached"] for r in ok if r["cached"] is not None]) if any(r["cached"] is not None for r in ok) else None,
        "tokens_per_chunk": tpc if all_chunks else None,
        "ttft_n": len(ttft), "itl_n": len(itl),
        "ttft_p50_ms": ms(pct(ttft, 50)), "ttft_p99_ms": ms(pct(ttft, 99)),
        "itl_p50_ms": ms(pct(itl, 50)), "itl_p99_ms": ms(pct(itl, 99)),
        "tpot_p50_ms": ms(pct(tpot, 50)),
        "server_cpu_s": delta(cpu0, cpu1), "idle_peer_cpu_s": delta(ocpu0, ocpu1), "client_cpu_s": ccpu1 - ccpu0,
        "loadavg": loadavg(),
    }
    out["server_cores"] = out["server_cpu_s"] / dur if out["server_cpu_s"] is not None else None
    # cores used by everything else on the machine during the window (other jobs, kernel): > ~0.2 means
    # the cell was measured under contention and its absolute numbers are not representative
    mb = delta(mcpu0, mcpu1)
    out["other_cores"] = (None if mb is None or out["server_cpu_s"] is None
                          else max(0.0, (mb - out["server_cpu_s"] - out["client_cpu_s"] - (out["idle_peer_cpu_s"] or 0)) / dur))
    if is_kv:
        out["step_profile"] = step_profile(m0, m1, dur)
    sp = out.get("step_profile") or {}
    log(f"{cfg:12} U={users:<3} T={temp:<4} rep{rep}: {out['tok_per_s']:7.1f} tok/s (finished {out['finished_tok_per_s']:.1f}), "
        f"{out['requests']} req, "
        f"TTFT p50/p99 {fmt(out['ttft_p50_ms'])}/{fmt(out['ttft_p99_ms'])} ms, "
        f"ITL p50/p99 {fmt(out['itl_p50_ms'], 1)}/{fmt(out['itl_p99_ms'], 1)} ms, "
        f"server {fmt(out['server_cores'], 2)} cores, client {out['client_cpu_s'] / dur:.2f} cores, "
        f"other {fmt(out['other_cores'], 2)} cores"
        + (f", {fmt(sp.get('tokens_per_step'), 1)} tok/step" if sp else "")
        + (f", ERRORS {out['errors']} {out['error_samples'][:2]}" if out["errors"] else "")
        + (f", {len(wrong_len)} with completion_tokens != {args.max_tokens}" if wrong_len else "")
        + (f", {hung} clients still hung" if hung else ""))
    if sp and sp.get("share"):
        log("   step profile: " + ", ".join(f"{p} {100 * (v or 0):.1f}%" for p, v in sp["share"].items())
            + f" (engine busy {100 * (sp['engine_busy_frac'] or 0):.0f}% of the window, {fmt(sp['ms_per_step'], 2)} ms/step)")
    return out


# ----------------------------------------------------------------------------- aggregation

CONTENDED_CORES = 0.25  # cores used by other processes during a window above which the cell is flagged

MEDIAN_KEYS = ["tok_per_s", "finished_tok_per_s", "req_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "tpot_p50_ms",
               "requests", "errors", "http_5xx", "wrong_completion_tokens", "connects",
               "tokens_per_chunk", "prompt_tokens_mean", "cached_tokens_mean", "server_cores", "other_cores", "idle_peer_cpu_s", "client_cpu_s"]


def med(vals):
    vals = [v for v in vals if v is not None]
    return statistics.median(vals) if vals else None


def summarize(raw: list[dict]) -> dict:
    """summary[cfg][temp][users] = medians over repeats (+ step profile medians for kvserve)."""
    out: dict = {}
    for r in raw:
        out.setdefault(r["config"], {}).setdefault(tkey(r["temperature"]), {}).setdefault(str(r["users"]), []).append(r)
    for cfg, temps in out.items():
        for t, by_u in temps.items():
            for u, reps in by_u.items():
                s = {k: med([r.get(k) for r in reps]) for k in MEDIAN_KEYS}
                s["repeats"] = len(reps)
                s["errors_total"] = sum(r["errors"] for r in reps)
                profs = [r["step_profile"] for r in reps if r.get("step_profile")]
                if profs:
                    s["step_profile_share"] = {p: med([pr["share"][p] for pr in profs]) for p in PHASES}
                    for k in ["engine_busy_frac", "tokens_per_step", "ms_per_step"]:
                        s[k] = med([pr[k] for pr in profs])
                by_u[u] = s
    return out


def tkey(t: float) -> str:
    return f"{t:g}"


def ratios(summ: dict, users: list[int], temps: list[float]) -> dict:
    out: dict = {"kvserve_over_llama_server": {}, "kvserve_users16_over_users1": {}}
    kv, ll = summ.get("kvserve", {}), summ.get("llama-server", {})
    for t in map(tkey, temps):
        for u in map(str, users):
            a, b = (kv.get(t) or {}).get(u), (ll.get(t) or {}).get(u)
            if a and b:
                cell = {}
                for k in ["tok_per_s", "finished_tok_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms"]:
                    if a.get(k) and b.get(k):
                        cell[k] = a[k] / b[k]
                # other processes took CPU while one side was measured: the ratio compares unequal conditions
                cell["contended"] = max(a.get("other_cores") or 0, b.get("other_cores") or 0) > CONTENDED_CORES
                out["kvserve_over_llama_server"].setdefault(t, {})[u] = cell
        k16, k1 = ((kv.get(t) or {}).get("16") or {}).get("tok_per_s"), ((kv.get(t) or {}).get("1") or {}).get("tok_per_s")
        if k16 and k1:
            out["kvserve_users16_over_users1"][t] = k16 / k1
            if max(kv[t]["16"].get("other_cores") or 0, kv[t]["1"].get("other_cores") or 0) > CONTENDED_CORES:
                out.setdefault("kvserve_users16_over_users1_contended", []).append(t)
    return out


def plot(summ: dict, users: list[int], temps: list[float], path: Path, title: str) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not available: no plot")
        return False
    colors = {"kvserve": "#1f77b4", "llama-server": "#ff7f0e"}
    styles, markers = ["-", "--", ":", "-."], ["o", "s", "^", "D"]
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    for cfg, by_t in summ.items():
        for i, t in enumerate(map(tkey, temps)):
            by_u = by_t.get(t) or {}
            us = [u for u in users if str(u) in by_u]
            if not us:
                continue
            lbl = f"{cfg} T={t}"
            for ax, key in [(axes[0], "tok_per_s"), (axes[1], "ttft_p50_ms"), (axes[2], "itl_p50_ms")]:
                ys = [by_u[str(u)].get(key) for u in us]
                pts = [(u, y) for u, y in zip(us, ys) if y is not None]
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[i % len(styles)], marker=markers[i % len(markers)],
                        color=colors.get(cfg), label=lbl)
                if key == "tok_per_s":
                    # first temperature labelled above its points, the others below and to the right
                    off = (0, 6) if i == 0 else (12, -12 * i)
                    for x, y in pts:
                        ax.annotate(f"{y:.0f}", (x, y), textcoords="offset points", xytext=off,
                                    ha="center", fontsize=7, color=colors.get(cfg))
    for ax, ttl in [(axes[0], "aggregate output tok/s (higher is better)"),
                    (axes[1], "TTFT p50, ms (lower is better)"),
                    (axes[2], "ITL p50, ms (lower is better)")]:
        ax.set_xscale("log")
        ax.minorticks_off()
        ax.set_xticks(users)
        ax.set_xticklabels([str(u) for u in users])
        ax.set_xlabel("concurrent users (closed loop)")
        ax.set_title(ttl, fontsize=10)
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.08)
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    log(f"wrote {path}")
    return True


# ----------------------------------------------------------------------------- main

def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", default=",".join(ALL_CONFIGS), help=f"comma list of {ALL_CONFIGS}")
    ap.add_argument("--users", default="1,4,16,64", help="comma list of concurrent user counts")
    ap.add_argument("--temperatures", default="0.7,0", help="comma list of temperatures")
    ap.add_argument("--top-p", type=float, default=1.0, help="top_p sent with every request")
    ap.add_argument("--top-k", type=int, default=0, help="top_k sent with every request (0 = off on both servers)")
    ap.add_argument("--min-p", type=float, default=0.0, help="min_p sent with every request (0 = off on both servers)")
    ap.add_argument("--prompt-cache", choices=["on", "off"], default="on",
                    help="on (default): both servers reuse cached prompt prefixes as they do by default (kvserve's "
                         "radix cache, llama-server's slot cache); off: neither does (kvserve --no-enable-prefix-caching, "
                         "llama-server cache_prompt false per request)")
    ap.add_argument("--max-tokens", type=int, default=64, help="tokens generated per request (ignore_eos)")
    ap.add_argument("--duration", type=float, default=20.0, help="measured window per cell (s)")
    ap.add_argument("--warmup", type=float, default=3.0, help="warm-up per cell before the window (s, not counted)")
    ap.add_argument("--ramp", type=float, default=0.5, help="client starts spread over this fraction of the warm-up")
    ap.add_argument("--no-keep-alive", dest="keep_alive", action="store_false",
                    help="a new TCP connection per request (default: one kept-alive connection per user)")
    ap.add_argument("--repeats", type=int, default=1, help="runs of every cell per config (medians reported)")
    ap.add_argument("--quick", action="store_true", help="smoke run: users 1,4; 4 s windows; 1 s warm-up; first temperature only")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--kvserve", type=Path, default=DEFAULT_KVSERVE)
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--kv-cache-memory", default="2GiB", help="kvserve --kv-cache-memory")
    ap.add_argument("--llama-np", type=int, default=0, help="llama-server -np (default: the largest user count)")
    ap.add_argument("--llama-ctx-per-slot", type=int, default=512, help="llama-server -c = np x this")
    ap.add_argument("--kvserve-arg", action="append", default=[], help="extra kvserve serve argument (repeatable)")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    ap.add_argument("--timeout", type=float, default=300, help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=float, default=120)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "sweep_bench.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "sweep_bench.png")
    args = ap.parse_args()
    users = sorted({int(x) for x in args.users.split(",") if x.strip()})
    temps = [float(x) for x in args.temperatures.split(",") if x.strip()]
    if args.quick:
        users, temps = [1, 4], temps[:1]
        args.duration, args.warmup = 4.0, 1.0
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    for c in configs:
        if c not in ALL_CONFIGS:
            ap.error(f"unknown config {c!r} (choose from {ALL_CONFIGS})")
    if not users or min(users) < 1 or not temps:
        ap.error("need at least one user count >= 1 and one temperature")
    if not args.model.exists():
        ap.error(f"model not found: {args.model}")
    max_u = max(users)
    np_ = args.llama_np or max_u

    host = host_info()
    la = host["loadavg_start"]
    if la and os.cpu_count() and la[0] > 0.5 * os.cpu_count():
        log(f"WARNING: load average {la} on {os.cpu_count()} cores before start: something else is running, "
            f"absolute numbers will be noisy (the kvserve/llama-server ratios are measured under the same load)")

    # serve_bench.server_cmd builds both command lines; kvserve-cache = prefix caching on (prompts are distinct)
    cmd_args = types.SimpleNamespace(
        model=args.model, kvserve=args.kvserve, llama_server=args.llama_server, threads=args.threads,
        kvserve_arg=["--max-num-seqs", str(max(max_u, 1)), "--kv-cache-memory", args.kv_cache_memory] + args.kvserve_arg,
        llama_slots=np_, llama_ctx_per_slot=args.llama_ctx_per_slot, llama_arg=["--no-webui"] + args.llama_arg)
    logdir = args.out.parent / "sweep_logs"
    servers: dict[str, Server] = {}
    skipped: dict[str, str] = {}
    server_info: dict = {}
    for cfg in configs:
        binary = args.kvserve if cfg == "kvserve" else args.llama_server
        if not Path(binary).exists():
            msg = f"{binary} not found" + (" (build it with bench/peer/build_llama.sh)" if cfg == "llama-server"
                                           else " (cmake --build build)")
            log(f"{cfg}: SKIPPED: {msg}")
            skipped[cfg] = msg
            continue
        port = free_port()
        srv = Server(cfg, server_cmd(("kvserve-cache" if args.prompt_cache == "on" else "kvserve") if cfg == "kvserve" else cfg,
                                    cmd_args, port), port,
                     logdir / f"{cfg}.log")
        try:
            srv.start(args.startup_timeout)
        except RuntimeError as e:
            log(f"{cfg}: SKIPPED: {e}")
            skipped[cfg] = str(e)
            continue
        servers[cfg] = srv
        server_info[cfg] = {"cmd": srv.cmd, "log": str(srv.log_path), "binary": binary_info(Path(binary)),
                            "model_id": srv.model_id}

    raw: list[dict] = []
    anomalies: list[dict] = []
    try:
        if not servers:
            log("no server could run")
        cell = 0
        for rep in range(args.repeats):
            for t in temps:
                for u in users:
                    order = list(servers) if cell % 2 == 0 else list(reversed(servers))
                    for cfg in order:
                        srv = servers[cfg]
                        if not srv.alive():
                            if not any(a["config"] == cfg and a["what"] == "server died" for a in anomalies):
                                anomalies.append({"config": cfg, "what": "server died", "exit_code": srv.proc.returncode,
                                                  "log_tail": srv.tail(20)})
                                log(f"{cfg}: DIED (exit {srv.proc.returncode}); log tail:\n{srv.tail(20)}")
                            continue
                        other = next((s for c, s in servers.items() if c != cfg), None)
                        r = run_cell(cfg, srv, other, args, u, t, rep, cell)
                        raw.append(r)
                        for k in ["errors", "wrong_completion_tokens", "missing_usage", "hung_clients"]:
                            if r[k]:
                                anomalies.append({"config": cfg, "users": u, "temperature": t, "repeat": rep,
                                                  "what": k, "count": r[k], "samples": r["error_samples"]})
                        if (r["other_cores"] or 0) > CONTENDED_CORES:
                            anomalies.append({"config": cfg, "users": u, "temperature": t, "repeat": rep,
                                              "what": "other processes used CPU during the window",
                                              "other_cores": round(r["other_cores"], 2)})
                            log(f"   WARNING: {r['other_cores']:.2f} cores used by other processes during this window")
                    cell += 1
    except KeyboardInterrupt:
        log("interrupted: writing what was measured")
    finally:
        for cfg, srv in servers.items():
            if cfg == "kvserve" and srv.alive():
                server_info[cfg]["final_metrics"] = {k: v for k, v in scrape(srv.port).items() if k.endswith("_total")}
            rc = srv.stop()
            server_info[cfg]["exit_code"] = rc
            b_end = binary_info(Path(srv.cmd[0]))
            if b_end != server_info[cfg]["binary"]:
                server_info[cfg]["binary_at_end"] = b_end
                anomalies.append({"config": cfg, "what": "binary changed on disk during the run (the running server "
                                  "is the old one)", "before": server_info[cfg]["binary"], "after": b_end})
            if rc not in (0, -signal.SIGTERM, None, 143):
                anomalies.append({"config": cfg, "what": "server exited uncleanly on SIGTERM", "exit_code": rc,
                                  "log_tail": srv.tail(10)})
            # server-side warnings/errors in its log
            bad = [ln for ln in srv.tail(100000).splitlines()
                   if re.search(r"\b(error|fatal|abort|exception|assert)\b", ln, re.I)]
            server_info[cfg]["log_error_lines"] = len(bad)
            if bad:
                server_info[cfg]["log_error_samples"] = bad[:10]

    summ = summarize(raw)
    rat = ratios(summ, users, temps)
    host["loadavg_end"] = loadavg()
    result = {
        "benchmark": "sweep_bench", "host": host,
        "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
        "params": {**{k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                   "users_list": users, "temperatures_list": temps},
        "method": "closed loop; tok/s = completion tokens of requests finished inside the measured window / window; "
                  "TTFT/ITL pooled over those requests from client-side SSE arrival times; medians over repeats",
        "servers": server_info, "skipped": skipped,
        "summary": summ, "ratios": rat, "anomalies": anomalies, "raw": raw,
        "wall_total_s": time.time() - T_START,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")
    if summ:
        plot(summ, users, temps, args.plot,
             f"sweep_bench: {result['model']}, {args.threads} threads, max_tokens {args.max_tokens}, top_p {args.top_p}, "
             f"{args.duration:g} s windows, {host['cpu_model']} x{host['nproc']}")

    # human summary
    e = sys.stderr
    print(f"\n== sweep_bench summary (medians over {args.repeats} repeat{'s' if args.repeats > 1 else ''}) ==", file=e)
    print(f"{'config':13} {'T':>4} {'U':>3} {'tok/s':>8} {'finished':>8} {'req':>5} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'ITL p50':>8} {'ITL p99':>8} {'cores':>5} {'other':>5} {'err':>4}", file=e)
    for cfg, by_t in summ.items():
        for t, by_u in by_t.items():
            for u in map(str, users):
                s = by_u.get(u)
                if s:
                    print(f"{cfg:13} {t:>4} {u:>3} {fmt(s['tok_per_s'], 1):>8} {fmt(s['finished_tok_per_s'], 1):>8} "
                          f"{fmt(s['requests']):>5} "
                          f"{fmt(s['ttft_p50_ms']):>9} {fmt(s['ttft_p99_ms']):>9} {fmt(s['itl_p50_ms'], 1):>8} "
                          f"{fmt(s['itl_p99_ms'], 1):>8} {fmt(s['server_cores'], 2):>5} {fmt(s['other_cores'], 2):>5} {s['errors_total']:>4}", file=e)
    for t, by_u in rat["kvserve_over_llama_server"].items():
        print(f"kvserve/llama-server tok/s at T={t}: " + ", ".join(
            f"U={u} {fmt(c.get('tok_per_s'), 2)}" + (" (CONTENDED)" if c.get("contended") else "")
            for u, c in by_u.items()), file=e)
    for t, v in rat["kvserve_users16_over_users1"].items():
        print(f"kvserve tok/s 16 users / 1 user at T={t}: {v:.2f}"
              + (" (CONTENDED)" if t in rat.get("kvserve_users16_over_users1_contended", []) else ""), file=e)
    for t, by_u in (summ.get("kvserve") or {}).items():
        for u, s in by_u.items():
            if s.get("step_profile_share"):
                print(f"kvserve step profile T={t} U={u}: " + ", ".join(
                    f"{p} {100 * (v or 0):.1f}%" for p, v in s["step_profile_share"].items()), file=e)
    print(f"anomalies: {len(anomalies)}" + (" (see 'anomalies' in the JSON)" if anomalies else ""), file=e)
    for c, m in skipped.items():
        print(f"skipped {c}: {m.splitlines()[0]}", file=e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
