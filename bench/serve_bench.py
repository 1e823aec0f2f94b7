#!/usr/bin/env python3
"""Serving benchmark: prefix caching under concurrent streaming clients (issue 4).

Starts one server at a time, waits for /health, runs the workloads with concurrent streaming
clients, stops it, and moves to the next config:

  kvserve-cache     build/kvserve serve --enable-prefix-caching
  kvserve-nocache   build/kvserve serve --no-enable-prefix-caching
  llama-server      llama.cpp's server (bench/peer/build_llama.sh) with its own prompt caching:
                    one slot per user (-np 16), cache_prompt on (its default), --cache-reuse 256

Workloads (chat completions, stream=true, temperature 0, ignore_eos so every request yields
exactly max_tokens tokens):

  shared    (1) U users (16) share one ~1,000-token system prompt, each asks a distinct short
            question, all at once; R rounds (3). Round 0 is cold (nothing cached yet), rounds
            1.. are warm. Questions differ in every round, so only the system prompt repeats.
  multiturn (2) U users (8) x T turns (4): each user opens with its own ~500-token document
            and a question; every later turn resends the whole history (previous user messages
            and the assistant's actual replies) plus a new question. Users run concurrently,
            each user's turns in order.

TTFT is measured client-side at the first SSE chunk carrying non-empty content. Per config and
workload the JSON holds TTFT p50/p99, requests/s, output tokens/s, wall time, prompt and
cached tokens (usage.prompt_tokens_details.cached_tokens), and for kvserve the prefix-cache
hit rate from /metrics (delta of kvserve:prefix_cache_hits_total / _queries_total). With
--repeats N every workload runs N times per config (a different system prompt / documents
each time, so each repeat starts cold) and the headline numbers are medians over repeats.

Also checked, and listed under "anomalies": HTTP errors, cached_tokens reported by a server
with caching off, cached_tokens that disagree with the /metrics hit delta, warm requests that
missed the shared prefix, and greedy outputs that differ between kvserve with and without
the cache.

Only the Python standard library is needed to run; matplotlib for the plot (skipped if absent).

  python3 bench/serve_bench.py                 # everything, 2 repeats: ~6-7 min on 2 cores
  python3 bench/serve_bench.py --quick         # smoke run: fewer users/rounds/turns
  python3 bench/serve_bench.py --configs kvserve-cache,kvserve-nocache --workloads shared

Output: bench/out/serve_bench.json, bench/out/serve_bench.png, server logs in
bench/out/serve_logs/. Progress goes to stderr.
"""
from __future__ import annotations

import argparse
import http.client
import json
import os
import random
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_MODEL = ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_KVSERVE = ROOT / "build" / "kvserve"
DEFAULT_LLAMA_SERVER = ROOT / "bench" / "peer" / "work" / "build" / "bin" / "llama-server"
ALL_CONFIGS = ["kvserve-cache", "kvserve-nocache", "llama-server"]
ALL_WORKLOADS = ["shared", "multiturn"]

T_START = time.time()


def log(msg: str) -> None:
    print(f"[serve_bench {time.time() - T_START:6.1f}s] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------- text generation
# Deterministic English-like text. SmolLM2's tokenizer gives ~1.25 tokens per word on it;
# the real token counts are taken from usage.prompt_tokens and reported.

_SUBJECTS = ["the support team", "every customer", "the billing system", "our warehouse",
             "the mobile app", "a premium account", "the shipping partner", "each order",
             "the refund policy", "the help desk", "a new subscriber", "the loyalty program",
             "the returns portal", "an enterprise client", "the delivery driver", "the catalog"]
_VERBS = ["must confirm", "should review", "will never share", "can update", "has to verify",
          "may extend", "needs to record", "is allowed to cancel", "should explain",
          "will schedule", "must escalate", "can waive", "should document", "will replace"]
_OBJECTS = ["the delivery address", "any late fee", "the warranty period", "a damaged parcel",
            "the payment method", "the order history", "a gift card balance", "the invoice",
            "the tracking number", "a missing item", "the contract terms", "a store credit",
            "the account password", "the return label", "a price adjustment", "the receipt"]
_TAILS = ["before closing the ticket", "within two business days", "when the customer asks",
          "unless a manager approves", "after checking the records", "during peak season",
          "for orders above fifty dollars", "in a polite and short reply", "on the same call",
          "if the item was opened", "only after identity checks", "as stated in section four"]


def sentence(rng: random.Random) -> str:
    s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)} {rng.choice(_TAILS)}."
    return s[0].upper() + s[1:]


def make_text(seed: str, n_words: int) -> str:
    rng = random.Random(seed)
    out, words = [], 0
    while words < n_words:
        s = sentence(rng)
        out.append(s)
        words += len(s.split())
    return " ".join(out)


def system_prompt(rep: int, n_words: int) -> str:
    head = (f"You are the customer service assistant of Northwind Outfitters (policy book, "
            f"edition {rep + 1}). Follow every rule below and answer briefly.\n\n")
    return head + make_text(f"system-{rep}", n_words)


_QTOPICS = ["a late package", "a broken zipper", "changing my address", "a double charge",
            "the warranty on boots", "a gift card", "returning a tent", "my loyalty points",
            "an invoice copy", "cancelling an order", "a missing sleeping bag", "store credit",
            "a wrong size jacket", "express shipping", "a price drop", "resetting my password"]


def question(rep: int, rnd: int, user: int) -> str:
    t = _QTOPICS[(user + 5 * rnd) % len(_QTOPICS)]
    return f"Hi, this is customer {rep}-{rnd}-{user}. Can you help me with {t} (order {1000 + 37 * user + 101 * rnd})?"


def followup(user: int, turn: int) -> str:
    asks = ["Can you summarise that in one sentence?", "What should I do first?",
            "Is there anything in the document about deadlines?", "Who should I contact?",
            "Thanks. What are the risks?", "Give me one more detail, please."]
    return f"{asks[(user + turn) % len(asks)]} (turn {turn})"


# ----------------------------------------------------------------------------- CPU accounting (/proc)

_TICK = os.sysconf("SC_CLK_TCK")


def proc_cpu_s(pid: int | None) -> float | None:
    """utime + stime of a process (all its threads), seconds."""
    if pid is None:
        return None
    try:
        f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


def machine_busy_s() -> float | None:
    """Busy CPU seconds of the whole machine so far (all cores; /proc/stat, idle and iowait excluded)."""
    try:
        f = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return (sum(f[:8]) - f[3] - f[4]) / _TICK
    except (OSError, ValueError, IndexError):
        return None


def loadavg() -> list[float] | None:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return None


# ----------------------------------------------------------------------------- host info (the benches' JSON)

def host_info() -> dict:
    def run(cmd):
        try:
            return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None
    model = None
    for line in (run(["lscpu"]) or "").splitlines():
        if line.startswith("Model name:"):
            model = line.split(":", 1)[1].strip()
    return {"cpu_model": model, "nproc": os.cpu_count(), "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "uname": " ".join(os.uname()), "loadavg_start": loadavg(),
            "git_commit": run(["git", "rev-parse", "HEAD"]),
            "git_dirty_files": len((run(["git", "status", "--porcelain", "--untracked-files=no"]) or "").splitlines())}


def binary_info(p: Path) -> dict:
    try:
        st = p.stat()
        return {"path": str(p), "mtime": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(st.st_mtime)), "size": st.st_size}
    except OSError:
        return {"path": str(p), "missing": True}


# ----------------------------------------------------------------------------- HTTP client

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(port: int, path: str, timeout: float = 5.0) -> tuple[int, str]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        return r.status, r.read().decode("utf-8", "replace")
    finally:
        conn.close()


def sse_events(r):
    """The JSON events of a server-sent-event response, then None at `data: [DONE]`."""
    while True:
        line = r.readline()
        if not line:
            return
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            yield None
            return
        yield json.loads(data)


def stream_chat(port: int, model: str, messages: list, max_tokens: int, timeout: float) -> dict:
    """One streaming chat completion. Returns timings (seconds from send), text, usage."""
    body = json.dumps({
        "model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True,
    })
    res = {"ok": False, "ttft": None, "e2e": None, "text": "", "n_content_chunks": 0,
           "usage": None, "error": None, "finish_reason": None}
    t0 = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", "/v1/chat/completions", body, {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            res["error"] = f"HTTP {r.status}: {r.read()[:300].decode('utf-8', 'replace')}"
            return res
        parts = []
        done = False
        for ev in sse_events(r):
            if ev is None:
                done = True
                break
            if "error" in ev:
                res["error"] = f"stream error: {json.dumps(ev['error'])[:300]}"
                return res
            for ch in ev.get("choices") or []:
                c = (ch.get("delta") or {}).get("content")
                if c:
                    if res["ttft"] is None:
                        res["ttft"] = time.perf_counter() - t0
                    parts.append(c)
                    res["n_content_chunks"] += 1
                if ch.get("finish_reason"):
                    res["finish_reason"] = ch["finish_reason"]
            if ev.get("usage"):
                res["usage"] = ev["usage"]
        res["e2e"] = time.perf_counter() - t0
        if res["ttft"] is None:       # nothing but empty deltas: count the end as first token
            res["ttft"] = res["e2e"]
        res["text"] = "".join(parts)
        res["ok"] = done
        if not done:
            res["error"] = "stream ended without [DONE]"
    except Exception as e:  # noqa: BLE001 - report every client-side failure
        res["error"] = f"{type(e).__name__}: {e}"
    finally:
        conn.close()
    return res


def usage_numbers(res: dict) -> tuple[int | None, int | None, int | None]:
    u = res.get("usage") or {}
    pt, ct = u.get("prompt_tokens"), u.get("completion_tokens")
    det = u.get("prompt_tokens_details") or {}
    cached = det.get("cached_tokens")
    return pt, ct, cached


_METRIC_RE = re.compile(r"^(kvserve:[a-z_]+)\s+([0-9.eE+-]+)$")


def scrape_metrics(port: int) -> dict:
    try:
        st, text = http_get(port, "/metrics")
    except OSError:
        return {}
    if st != 200:
        return {}
    out = {}
    for line in text.splitlines():
        m = _METRIC_RE.match(line.strip())
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


# ----------------------------------------------------------------------------- servers

class Server:
    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.proc: subprocess.Popen | None = None
        self.model_id = "default"

    def start(self, timeout: float) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        log(f"{self.name}: starting: {' '.join(self.cmd)}")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=ROOT, start_new_session=True)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during startup "
                                   f"(log {self.log_path}):\n{self.tail()}")
            try:
                st, _ = http_get(self.port, "/health", timeout=2)
                if st == 200:
                    break
            except OSError:
                pass
            time.sleep(0.25)
        else:
            self.stop()
            raise RuntimeError(f"{self.name} not healthy after {timeout}s (log {self.log_path})")
        try:
            st, body = http_get(self.port, "/v1/models")
            if st == 200:
                self.model_id = json.loads(body)["data"][0]["id"]
        except Exception:  # noqa: BLE001
            pass
        log(f"{self.name}: healthy on port {self.port} (model id {self.model_id!r})")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: did not stop within 15 s of SIGTERM, killing")
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        rc = self.proc.returncode
        log(f"{self.name}: stopped (exit {rc})")
        return rc


def server_cmd(cfg: str, args, port: int) -> list[str]:
    model = str(args.model)
    if cfg.startswith("kvserve"):
        cmd = [str(args.kvserve), "serve", "-m", model, "--port", str(port),
               "--threads", str(args.threads),
               "--enable-prefix-caching" if cfg == "kvserve-cache" else "--no-enable-prefix-caching"]
        return cmd + args.kvserve_arg
    if cfg == "llama-server":
        slots = args.llama_slots
        return [str(args.llama_server), "-m", model, "--host", "127.0.0.1", "--port", str(port),
                "--threads", str(args.threads), "--threads-batch", str(args.threads),
                "-np", str(slots), "-c", str(slots * args.llama_ctx_per_slot),
                "--cache-reuse", "256"] + args.llama_arg
    raise ValueError(cfg)


# ----------------------------------------------------------------------------- stats

def pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100.0
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(results: list[dict], wall: float) -> dict:
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    e2e = [r["e2e"] for r in ok]
    pts = [usage_numbers(r) for r in ok]
    out_tok = sum((ct if ct is not None else r["n_content_chunks"]) for r, (_, ct, _) in zip(ok, pts))
    prompt_tok = sum(pt or 0 for pt, _, _ in pts)
    cached = [c for _, _, c in pts if c is not None]
    return {
        "requests": len(results), "errors": len(results) - len(ok),
        "wall_s": wall,
        "ttft_p50_ms": 1e3 * pct(ttft, 50) if ttft else None,
        "ttft_p99_ms": 1e3 * pct(ttft, 99) if ttft else None,
        "ttft_mean_ms": 1e3 * statistics.fmean(ttft) if ttft else None,
        "e2e_p50_ms": 1e3 * pct(e2e, 50) if e2e else None,
        "req_per_s": len(ok) / wall if wall > 0 else None,
        "output_tok_per_s": out_tok / wall if wall > 0 else None,
        "output_tokens": out_tok,
        "prompt_tokens": prompt_tok,
        "cached_tokens": sum(cached) if cached else None,
        "cached_frac": (sum(cached) / prompt_tok) if cached and prompt_tok else None,
    }


def metric_delta(before: dict, after: dict) -> dict:
    q = after.get("kvserve:prefix_cache_queries_total", 0) - before.get("kvserve:prefix_cache_queries_total", 0)
    h = after.get("kvserve:prefix_cache_hits_total", 0) - before.get("kvserve:prefix_cache_hits_total", 0)
    if not before and not after:
        return {}
    return {"prefix_queries_tokens": q, "prefix_hits_tokens": h,
            "prefix_hit_rate": (h / q) if q > 0 else None,
            "preemptions": after.get("kvserve:num_preemptions_total", 0) - before.get("kvserve:num_preemptions_total", 0),
            "evictions": after.get("kvserve:prefix_cache_evictions_total", 0) - before.get("kvserve:prefix_cache_evictions_total", 0)}


def median_of(dicts: list[dict], key: str):
    vals = [d[key] for d in dicts if d.get(key) is not None]
    return statistics.median(vals) if vals else None


def run_concurrent(fn, items: list, workers: int) -> list:
    """Run fn(item) for every item in parallel threads, released together by a barrier."""
    barrier = threading.Barrier(len(items))

    def go(it):
        barrier.wait()
        return fn(it)

    with ThreadPoolExecutor(max_workers=max(workers, len(items))) as ex:
        return list(ex.map(go, items))


# ----------------------------------------------------------------------------- workloads

class Ctx:
    """Per-run state: anomalies found, texts for cross-config comparison."""

    def __init__(self):
        self.anomalies: list[dict] = []
        self.texts: dict[str, dict] = {}   # cfg -> {key: text}

    def anomaly(self, cfg: str, workload: str, what: str, **detail) -> None:
        a = {"config": cfg, "workload": workload, "what": what, **detail}
        self.anomalies.append(a)
        log(f"ANOMALY {cfg}/{workload}: {what} {json.dumps(detail)[:300]}")


def check_results(ctx: Ctx, cfg: str, wl: str, results: list[dict], keys: list[str]) -> None:
    for r, k in zip(results, keys):
        if not r["ok"]:
            ctx.anomaly(cfg, wl, "request failed", key=k, error=r["error"])
            continue
        ctx.texts.setdefault(cfg, {})[k] = r["text"]
        pt, ct, cached = usage_numbers(r)
        if r["usage"] is None:
            ctx.anomaly(cfg, wl, "no usage in the stream (include_usage was set)", key=k)
        if cfg == "kvserve-nocache" and cached:
            ctx.anomaly(cfg, wl, "cached_tokens > 0 with caching off", key=k, cached_tokens=cached)
        if cached is not None and pt is not None and cached > pt:
            ctx.anomaly(cfg, wl, "cached_tokens > prompt_tokens", key=k, cached_tokens=cached, prompt_tokens=pt)
        if ct is not None and ct != r["_max_tokens"]:
            ctx.anomaly(cfg, wl, "completion_tokens != max_tokens with ignore_eos", key=k,
                        completion_tokens=ct, max_tokens=r["_max_tokens"], finish_reason=r["finish_reason"])


def check_metrics_vs_usage(ctx: Ctx, cfg: str, wl: str, summ: dict, md: dict) -> None:
    if not md or summ.get("cached_tokens") is None:
        return
    if abs(md["prefix_hits_tokens"] - summ["cached_tokens"]) > 0:
        ctx.anomaly(cfg, wl, "sum of usage cached_tokens != /metrics prefix_cache_hits delta",
                    cached_tokens_sum=summ["cached_tokens"], metrics_hits=md["prefix_hits_tokens"])


def workload_shared(ctx: Ctx, cfg: str, srv: Server, args, rep: int) -> dict:
    sysp = system_prompt(rep, args.system_words)
    rounds = []
    for rnd in range(args.rounds):
        items = [(rnd, u) for u in range(args.users)]
        keys = [f"shared/r{rep}/round{rnd}/u{u}" for u in range(args.users)]

        def one(it):
            rnd_, u = it
            msgs = [{"role": "system", "content": sysp},
                    {"role": "user", "content": question(rep, rnd_, u)}]
            r = stream_chat(srv.port, srv.model_id, msgs, args.max_tokens, args.timeout)
            r["_max_tokens"] = args.max_tokens
            return r

        m0 = scrape_metrics(srv.port)
        t0 = time.perf_counter()
        res = run_concurrent(one, items, args.users)
        wall = time.perf_counter() - t0
        m1 = scrape_metrics(srv.port)
        summ = summarize(res, wall)
        md = metric_delta(m0, m1)
        summ.update(md)
        check_results(ctx, cfg, "shared", res, keys)
        check_metrics_vs_usage(ctx, cfg, "shared", summ, md)
        # the shared system prompt must be a hit on every warm request (cache on)
        if rnd > 0 and cfg == "kvserve-cache":
            sys_tok = min((usage_numbers(r)[0] or 0) for r in res if r["ok"]) if any(r["ok"] for r in res) else 0
            for r, k in zip(res, keys):
                c = usage_numbers(r)[2]
                if r["ok"] and c is not None and c < 0.8 * (sys_tok - 64):
                    ctx.anomaly(cfg, "shared", "warm request missed the shared system prompt", key=k,
                                cached_tokens=c, prompt_tokens=usage_numbers(r)[0])
        summ["round"] = rnd
        summ["per_request"] = per_request(res)
        rounds.append(summ)
        log(f"{cfg} shared rep{rep} round{rnd} ({'cold' if rnd == 0 else 'warm'}): "
            f"{summ['requests']} req in {wall:.2f}s, TTFT p50 {fmt(summ['ttft_p50_ms'])} ms "
            f"p99 {fmt(summ['ttft_p99_ms'])} ms, {fmt(summ['req_per_s'], 2)} req/s, "
            f"{fmt(summ['output_tok_per_s'])} out tok/s, prompt {summ['prompt_tokens']} "
            f"cached {summ['cached_tokens']}"
            + (f", hit rate {fmt(100 * summ['prefix_hit_rate'])}%" if summ.get("prefix_hit_rate") is not None else "")
            + (f", ERRORS {summ['errors']}" if summ["errors"] else ""))
    warm = [r for r in rounds if r["round"] > 0]
    return {"rounds": rounds, "cold": rounds[0], "warm": pool_rounds(warm) if warm else None,
            "prompt_tokens_per_request": rounds[0]["prompt_tokens"] / max(1, rounds[0]["requests"] - rounds[0]["errors"])}


def per_request(res: list[dict]) -> list[dict]:
    """Compact per-request record, in completion order of TTFT: [ttft ms, e2e ms, prompt, cached]."""
    out = []
    for r in res:
        pt, ct, cached = usage_numbers(r)
        out.append({"ttft_ms": round(1e3 * r["ttft"], 1) if r["ttft"] is not None else None,
                    "e2e_ms": round(1e3 * r["e2e"], 1) if r["e2e"] is not None else None,
                    "prompt_tokens": pt, "cached_tokens": cached, "error": r["error"]})
    return sorted(out, key=lambda x: x["ttft_ms"] if x["ttft_ms"] is not None else 1e18)


def pool_rounds(rounds: list[dict]) -> dict:
    """Warm rounds together: TTFT percentiles are medians of per-round values; rates over the total."""
    wall = sum(r["wall_s"] for r in rounds)
    reqs = sum(r["requests"] - r["errors"] for r in rounds)
    out = {
        "rounds": len(rounds), "requests": sum(r["requests"] for r in rounds),
        "errors": sum(r["errors"] for r in rounds), "wall_s": wall,
        "ttft_p50_ms": median_of(rounds, "ttft_p50_ms"), "ttft_p99_ms": median_of(rounds, "ttft_p99_ms"),
        "e2e_p50_ms": median_of(rounds, "e2e_p50_ms"),
        "req_per_s": reqs / wall if wall else None,
        "output_tok_per_s": sum(r["output_tokens"] for r in rounds) / wall if wall else None,
        "prompt_tokens": sum(r["prompt_tokens"] for r in rounds),
        "cached_tokens": sum(r["cached_tokens"] for r in rounds) if all(r["cached_tokens"] is not None for r in rounds) else None,
    }
    q = sum(r.get("prefix_queries_tokens", 0) for r in rounds)
    h = sum(r.get("prefix_hits_tokens", 0) for r in rounds)
    out["prefix_hit_rate"] = h / q if q else None
    return out


def workload_multiturn(ctx: Ctx, cfg: str, srv: Server, args, rep: int) -> dict:
    per_turn: list[list[dict]] = [[] for _ in range(args.turns)]
    keys_turn: list[list[str]] = [[] for _ in range(args.turns)]
    lock = threading.Lock()

    def user(u: int):
        msgs = [{"role": "system", "content": "You are a helpful assistant. Answer briefly."},
                {"role": "user", "content": "Here is my document:\n\n" + make_text(f"doc-{rep}-{u}", args.doc_words)
                 + f"\n\nQuestion {u}: what is this document about?"}]
        for t in range(args.turns):
            if t > 0:
                msgs.append({"role": "user", "content": followup(u, t)})
            r = stream_chat(srv.port, srv.model_id, msgs, args.mt_max_tokens, args.timeout)
            r["_max_tokens"] = args.mt_max_tokens
            with lock:
                per_turn[t].append(r)
                keys_turn[t].append(f"multiturn/r{rep}/u{u}/t{t}")
            if not r["ok"]:
                return
            msgs.append({"role": "assistant", "content": r["text"]})

    m0 = scrape_metrics(srv.port)
    t0 = time.perf_counter()
    run_concurrent(user, list(range(args.mt_users)), args.mt_users)
    wall = time.perf_counter() - t0
    m1 = scrape_metrics(srv.port)
    allres = [r for t in per_turn for r in t]
    allkeys = [k for t in keys_turn for k in t]
    summ = summarize(allres, wall)
    md = metric_delta(m0, m1)
    summ.update(md)
    check_results(ctx, cfg, "multiturn", allres, allkeys)
    check_metrics_vs_usage(ctx, cfg, "multiturn", summ, md)
    turns = []
    for t in range(args.turns):
        ok = [r for r in per_turn[t] if r["ok"]]
        tt = [r["ttft"] for r in ok]
        pts = [usage_numbers(r) for r in ok]
        turns.append({"turn": t, "requests": len(per_turn[t]),
                      "ttft_p50_ms": 1e3 * pct(tt, 50) if tt else None,
                      "prompt_tokens_mean": statistics.fmean([p or 0 for p, _, _ in pts]) if pts else None,
                      "cached_tokens_mean": statistics.fmean([c for _, _, c in pts if c is not None])
                      if any(c is not None for _, _, c in pts) else None})
    summ["turns"] = turns
    summ["per_request"] = per_request(allres)
    later = [r["ttft"] for t in per_turn[1:] for r in t if r["ok"]]
    summ["ttft_p50_ms_later_turns"] = 1e3 * pct(later, 50) if later else None
    log(f"{cfg} multiturn rep{rep}: {summ['requests']} req in {wall:.2f}s, TTFT p50 {fmt(summ['ttft_p50_ms'])} ms "
        f"p99 {fmt(summ['ttft_p99_ms'])} ms (turns 1+: p50 {fmt(summ['ttft_p50_ms_later_turns'])} ms), "
        f"{fmt(summ['req_per_s'], 2)} req/s, {fmt(summ['output_tok_per_s'])} out tok/s, "
        f"prompt {summ['prompt_tokens']} cached {summ['cached_tokens']}"
        + (f", hit rate {fmt(100 * summ['prefix_hit_rate'])}%" if summ.get("prefix_hit_rate") is not None else "")
        + (f", ERRORS {summ['errors']}" if summ["errors"] else ""))
    log("   per turn: " + "; ".join(f"t{x['turn']} p50 {fmt(x['ttft_p50_ms'])} ms prompt~{fmt(x['prompt_tokens_mean'])} "
                                    f"cached~{fmt(x['cached_tokens_mean'])}" for x in turns))
    return summ


def fmt(x, nd: int = 0) -> str:
    return "n/a" if x is None else f"{x:.{nd}f}"


# ----------------------------------------------------------------------------- aggregation

HEADLINE_KEYS = ["ttft_p50_ms", "ttft_p99_ms", "req_per_s", "output_tok_per_s", "wall_s",
                 "prefix_hit_rate", "cached_tokens", "prompt_tokens", "errors"]


def headline(reps: list[dict]) -> dict:
    return {k: median_of(reps, k) for k in HEADLINE_KEYS}


def aggregate(raw: dict) -> dict:
    """raw[cfg][wl] = list of per-repeat results -> medians over repeats."""
    agg = {}
    for cfg, wls in raw.items():
        a = {}
        if "shared" in wls and wls["shared"]:
            reps = wls["shared"]
            a["shared_cold"] = headline([r["cold"] for r in reps])
            warm = [r["warm"] for r in reps if r["warm"]]
            a["shared_warm"] = headline(warm) if warm else None
            a["shared_all"] = headline([pool_rounds(r["rounds"]) for r in reps])
        if "multiturn" in wls and wls["multiturn"]:
            reps = wls["multiturn"]
            a["multiturn"] = headline(reps)
            a["multiturn"]["ttft_p50_ms_later_turns"] = median_of(reps, "ttft_p50_ms_later_turns")
        agg[cfg] = a
    return agg


def ratios(agg: dict) -> dict:
    def get(cfg, wl, k):
        return ((agg.get(cfg) or {}).get(wl) or {}).get(k)

    out = {}
    on, off = get("kvserve-cache", "shared_warm", "ttft_p50_ms"), get("kvserve-nocache", "shared_warm", "ttft_p50_ms")
    if on and off:
        out["shared_warm_ttft_p50_cache_over_nocache"] = {"value": on / off, "target": "<= 0.2", "met": on / off <= 0.2}
    for wl in ["shared_warm", "shared_cold", "shared_all"]:
        k, l = get("kvserve-cache", wl, "req_per_s"), get("llama-server", wl, "req_per_s")
        if k and l:
            out[f"{wl}_req_per_s_kvserve_over_llama_server"] = {"value": k / l, "target": ">= 5", "met": k / l >= 5}
    k, l = get("kvserve-cache", "shared_warm", "ttft_p50_ms"), get("llama-server", "shared_warm", "ttft_p50_ms")
    if k and l:
        out["shared_warm_ttft_p50_kvserve_over_llama_server"] = {"value": k / l}
    on, off = get("kvserve-cache", "multiturn", "ttft_p50_ms_later_turns"), get("kvserve-nocache", "multiturn", "ttft_p50_ms_later_turns")
    if on and off:
        out["multiturn_later_turns_ttft_p50_cache_over_nocache"] = {"value": on / off}
    k, l = get("kvserve-cache", "multiturn", "req_per_s"), get("llama-server", "multiturn", "req_per_s")
    if k and l:
        out["multiturn_req_per_s_kvserve_over_llama_server"] = {"value": k / l}
    return out


def compare_outputs(ctx: Ctx) -> dict:
    a, b = ctx.texts.get("kvserve-cache", {}), ctx.texts.get("kvserve-nocache", {})
    common = sorted(set(a) & set(b))
    diff = [k for k in common if a[k] != b[k]]
    # multi-turn histories diverge after the first differing reply; count only what is comparable
    if diff:
        ctx.anomaly("kvserve-cache", "*", "greedy output differs from --no-enable-prefix-caching",
                    n_diff=len(diff), n_compared=len(common), first=diff[:5],
                    example={"key": diff[0], "cache": a[diff[0]][:120], "nocache": b[diff[0]][:120]})
    return {"compared": len(common), "different": len(diff), "different_keys": diff[:20]}


def plot(agg: dict, path: Path) -> bool:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib not available: no plot")
        return False
    groups = [("shared_cold", "shared prompt\ncold round"), ("shared_warm", "shared prompt\nwarm rounds"),
              ("multiturn", "multi-turn\nchats")]
    groups = [g for g in groups if any((agg[c].get(g[0]) or {}).get("ttft_p50_ms") for c in agg)]
    cfgs = list(agg)
    colors = {"kvserve-cache": "#1f77b4", "kvserve-nocache": "#9ecae1", "llama-server": "#ff7f0e"}
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6))
    width = 0.8 / max(1, len(cfgs))
    for ax, key, title, logy in [(axes[0], "ttft_p50_ms", "TTFT p50 (ms, log scale, lower is better)", True),
                                 (axes[1], "req_per_s", "requests/s (higher is better)", False)]:
        for i, c in enumerate(cfgs):
            vals = [(agg[c].get(g) or {}).get(key) or 0 for g, _ in groups]
            xs = [j + (i - (len(cfgs) - 1) / 2) * width for j in range(len(groups))]
            ax.bar(xs, vals, width, label=c, color=colors.get(c))
            for x, v in zip(xs, vals):
                if v:
                    ax.annotate(f"{v:.0f}" if v >= 10 else f"{v:.2f}", (x, v), ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(groups)))
        ax.set_xticklabels([lbl for _, lbl in groups])
        ax.set_title(title, fontsize=10)
        if logy:
            ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("kvserve serve_bench: prefix caching (SmolLM2-135M Q4_1, 2 threads)", fontsize=11)
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
    ap.add_argument("--workloads", default=",".join(ALL_WORKLOADS), help=f"comma list of {ALL_WORKLOADS}")
    ap.add_argument("--quick", action="store_true", help="smoke run: 4 users x 2 rounds, 2 chats x 2 turns")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each workload per config (medians reported)")
    ap.add_argument("--model", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--kvserve", type=Path, default=DEFAULT_KVSERVE)
    ap.add_argument("--llama-server", type=Path, default=DEFAULT_LLAMA_SERVER)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--users", type=int, default=16, help="shared: concurrent users per round")
    ap.add_argument("--rounds", type=int, default=3, help="shared: rounds (the first is cold)")
    ap.add_argument("--system-words", type=int, default=830, help="shared: system prompt length in words (~1,000 tokens)")
    ap.add_argument("--max-tokens", type=int, default=16, help="shared: tokens generated per request")
    ap.add_argument("--mt-users", type=int, default=8, help="multiturn: concurrent chats")
    ap.add_argument("--turns", type=int, default=4, help="multiturn: turns per chat")
    ap.add_argument("--doc-words", type=int, default=380, help="multiturn: opening document length in words")
    ap.add_argument("--mt-max-tokens", type=int, default=32, help="multiturn: tokens generated per turn")
    ap.add_argument("--llama-slots", type=int, default=16, help="llama-server -np")
    ap.add_argument("--llama-ctx-per-slot", type=int, default=2048, help="llama-server -c = slots x this")
    ap.add_argument("--kvserve-arg", action="append", default=[], help="extra kvserve serve argument (repeatable)")
    ap.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    ap.add_argument("--timeout", type=float, default=600, help="per-request timeout (s)")
    ap.add_argument("--startup-timeout", type=float, default=120)
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "serve_bench.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "serve_bench.png")
    args = ap.parse_args()
    if args.quick:
        args.users, args.rounds, args.mt_users, args.turns = 4, 2, 2, 2
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    for c in configs:
        if c not in ALL_CONFIGS:
            ap.error(f"unknown config {c!r}")
    for w in workloads:
        if w not in ALL_WORKLOADS:
            ap.error(f"unknown workload {w!r}")
    if not args.model.exists():
        ap.error(f"model not found: {args.model}")

    la = loadavg()
    if la and os.cpu_count() and la[0] > 0.5 * os.cpu_count():
        log(f"WARNING: load average {la} on {os.cpu_count()} cores before start: something else is "
            f"running, numbers will be noisy (compare ratios within one run)")
    ctx = Ctx()
    raw: dict = {}
    server_info: dict = {}
    skipped: dict = {}
    logdir = args.out.parent / "serve_logs"
    for cfg in configs:
        binary = args.llama_server if cfg == "llama-server" else args.kvserve
        if not Path(binary).exists():
            msg = f"{binary} not found" + (" (run bench/peer/build_llama.sh)" if cfg == "llama-server" else " (cmake --build build)")
            log(f"{cfg}: SKIPPED: {msg}")
            skipped[cfg] = msg
            continue
        port = free_port()
        srv = Server(cfg, server_cmd(cfg, args, port), port, logdir / f"{cfg}.log")
        try:
            srv.start(args.startup_timeout)
        except RuntimeError as e:
            log(f"{cfg}: SKIPPED: {e}")
            skipped[cfg] = str(e)
            ctx.anomaly(cfg, "-", "server failed to start", detail=str(e)[:500])
            continue
        server_info[cfg] = {"cmd": srv.cmd, "log": str(srv.log_path), "loadavg_before": loadavg()}
        raw[cfg] = {w: [] for w in workloads}
        try:
            for rep in range(args.repeats):
                for wl in workloads:
                    if not srv.alive():
                        raise RuntimeError("server died")
                    fn = workload_shared if wl == "shared" else workload_multiturn
                    raw[cfg][wl].append(fn(ctx, cfg, srv, args, rep))
                    if not srv.alive():
                        raise RuntimeError("server died")
            if cfg.startswith("kvserve"):
                server_info[cfg]["final_metrics"] = scrape_metrics(port)
        except RuntimeError:
            ctx.anomaly(cfg, "-", "server crashed", exit_code=srv.proc.returncode, log_tail=srv.tail(20))
        finally:
            server_info[cfg]["loadavg_after"] = loadavg()
            rc = srv.stop()
            server_info[cfg]["exit_code"] = rc
            if rc not in (0, -signal.SIGTERM, None, 143):
                ctx.anomaly(cfg, "-", "server exited uncleanly on SIGTERM", exit_code=rc, log_tail=srv.tail(10))

    agg = aggregate(raw)
    cmp_ = compare_outputs(ctx)
    rat = ratios(agg)
    result = {
        "benchmark": "serve_bench",
        "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": {"nproc": os.cpu_count(), "uname": " ".join(os.uname())},
        "model": str(args.model.relative_to(ROOT) if args.model.is_relative_to(ROOT) else args.model),
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "servers": server_info, "skipped": skipped,
        "summary": agg, "ratios": rat, "output_comparison": cmp_,
        "anomalies": ctx.anomalies, "raw": raw,
        "wall_total_s": time.time() - T_START,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    log(f"wrote {args.out}")
    if agg:
        plot(agg, args.plot)

    # human summary
    print("\n== serve_bench summary (medians over %d repeat%s) ==" % (args.repeats, "s" if args.repeats > 1 else ""), file=sys.stderr)
    print(f"{'config':17} {'workload':14} {'TTFT p50':>9} {'TTFT p99':>9} {'req/s':>7} {'out tok/s':>9} {'wall s':>7} {'hit rate':>8} {'err':>4}",
          file=sys.stderr)
    for cfg, a in agg.items():
        for wl, h in a.items():
            if not h or wl == "shared_all":
                continue
            hr = h.get("prefix_hit_rate")
            print(f"{cfg:17} {wl:14} {fmt(h['ttft_p50_ms']):>9} {fmt(h['ttft_p99_ms']):>9} {fmt(h['req_per_s'], 2):>7} "
                  f"{fmt(h['output_tok_per_s']):>9} {fmt(h['wall_s'], 1):>7} {(fmt(100 * hr, 1) + '%') if hr is not None else '-':>8} "
                  f"{fmt(h['errors']):>4}", file=sys.stderr)
    for k, v in rat.items():
        extra = f" (target {v['target']}: {'MET' if v['met'] else 'NOT MET'})" if "target" in v else ""
        print(f"ratio {k}: {v['value']:.3f}{extra}", file=sys.stderr)
    print(f"outputs kvserve cache vs no-cache: {cmp_['different']} of {cmp_['compared']} differ", file=sys.stderr)
    print(f"anomalies: {len(ctx.anomalies)}" + (" (see 'anomalies' in the JSON)" if ctx.anomalies else ""), file=sys.stderr)
    for c, m in skipped.items():
        print(f"skipped {c}: {m.splitlines()[0]}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
