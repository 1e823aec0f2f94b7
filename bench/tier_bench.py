#!/usr/bin/env python3
"""KV tiers: time to first token from RAM-less recompute vs the L2 disk tier vs the L3 Redis
tier, and swap vs recompute preemption.

Documents of --sizes tokens (2k, 4k, 8k) are cut from data/text/emma.txt (then
pride_and_prejudice.txt) with the model's own tokenizer (tests/reference/tokenizer_ref.py,
built from the GGUF: same ids as kvserve), one distinct document per size and repeat (other text
offsets, so no request of a phase shares a prefix with another). Each is sent as a raw prompt to
/v1/completions (stream, temperature 0, --max-tokens 1); TTFT is client-side, from sending the
request to the first SSE chunk carrying text. Every server is fresh and gets one short warm-up
request (below --kv-tier-min-tokens) before it is measured. Per repeat:

  compute + L2  server A (--kv-disk-dir D, empty, write-back) computes the documents: their TTFT
                is TTFT_compute (nothing is read from or written to the tier meanwhile: the docs
                fit the 1 GiB RAM cache). A is stopped (SIGTERM; waited for: a write-back server
                writes its RAM-cached prefix pages down on the way out), server A' starts on the
                same D and asks the same documents: TTFT_L2. Checked: cached_tokens ~ prompt and
                kvserve:kv_tier_hits_total{tier="disk"} > 0. The pages come from the OS page
                cache here (written seconds before), not from the device.
  L3            a real redis-server (--redis-server, a free port, --save '' --appendonly no, its
                own temp dir; FLUSHALL between repeats). Instance A (--kv-redis, --kv-tier-write
                through, no disk) computes the documents (TTFT_compute_write_through, for
                reference), the script waits until A's kv_tier_pages_written_total{tier="redis"}
                stops growing, stops A, then instance B (another port, same Redis, no disk) asks
                the same documents: TTFT_L3 (checked: hits{tier="redis"} > 0).
  swap          preemption at 4k context: two --swap-prompt (4096) token prompts and a RAM KV
                budget (--kv-cache-memory, computed from `kvserve kv-size`) of both prompts plus
                --swap-headroom tokens, so the two sequences fit until they have generated about
                headroom/2 tokens each, then the newer one is preempted. Sequence 1 (prompt 1,
                --swap-gen1 tokens, ignore_eos) starts; when its first token arrives sequence 2
                (prompt 2, --swap-gen2 tokens) is sent. Both streamed; per-token arrival times
                recorded. Same prompts on two fresh servers that differ only in
                --preemption-mode (swap | recompute, both with a --kv-disk-dir, write-back), the
                order alternating per repeat. Reported per mode: kvserve:num_preemptions_total,
                tier pages loaded, each sequence's TTFT / end-to-end / largest inter-token gap,
                the wall time, and resume_s = time from sequence 1's last token to sequence 2's
                next token (the preempted sequence resuming: recomputing, or loading, the part of
                its KV the RAM cache lost while it waited). Ratios swap / recompute of medians.

Medians over --repeats (3). Progress on stderr; server logs in bench/out/tier_logs/.

  python3 bench/tier_bench.py                          # 2k/4k/8k, 3 repeats, everything (~5-8 min)
  python3 bench/tier_bench.py --repeats 1 --sizes 2048 # smoke run
  python3 bench/tier_bench.py --phases disk swap       # no Redis
  python3 bench/tier_bench.py --replot                 # table and plot from the JSON only

Output: bench/out/tier_bench.json, bench/out/tier_bench.png (grouped bars of TTFT per document
size: recompute, L2, L3, ratios annotated; a second panel for the swap scenario).
"""
from __future__ import annotations

import argparse
import atexit
import datetime as dt
import http.client
import json
import math
import os
import re
import shutil
import signal
import socket
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
from serve_bench import free_port, http_get, sse_events  # noqa: E402

T_START = time.time()
PHASES = ["disk", "redis", "swap"]


def log(msg: str) -> None:
    print(f"[tier_bench {time.time() - T_START:6.1f}s] {msg}", file=sys.stderr, flush=True)


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return a / b if a is not None and b else None


# ----------------------------------------------------------------------------- processes

_LIVE: list[subprocess.Popen] = []  # every child still running: killed on any exit


def _kill_all() -> None:
    for p in list(_LIVE):
        if p.poll() is None:
            try:
                p.kill()
                p.wait(timeout=10)
            except Exception:  # noqa: BLE001
                pass
        _LIVE.remove(p)


atexit.register(_kill_all)


def _on_sigterm(signum, frame):  # noqa: ARG001 - turn SIGTERM into an exception: finally blocks run
    raise SystemExit(f"tier_bench: signal {signum}")


class Proc:
    """One kvserve process (serve or router) on a loopback port; its log goes to log_path."""

    def __init__(self, name: str, cmd: list[str], port: int, log_path: Path):
        self.name, self.cmd, self.port, self.log_path = name, cmd, port, log_path
        self.url = f"http://127.0.0.1:{port}"
        self.proc: subprocess.Popen | None = None
        self.model_id = "default"
        self._log = None

    def start(self, timeout: float) -> "Proc":
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        log(f"{self.name}: {' '.join(self.cmd[1:])}")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True)
        _LIVE.append(self.proc)
        deadline = time.time() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} during startup "
                                   f"(log {self.log_path}):\n{self.tail()}")
            try:
                if http_get(self.port, "/health", timeout=2)[0] == 200:
                    break
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"{self.name} not healthy after {timeout}s (log {self.log_path}):\n{self.tail()}")
            time.sleep(0.1)
        try:
            st, body = http_get(self.port, "/v1/models")
            if st == 200:
                self.model_id = json.loads(body)["data"][0]["id"]
        except (OSError, ValueError, KeyError, IndexError):
            pass
        return self

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def pid(self) -> int | None:
        return self.proc.pid if self.alive() else None

    def text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def tail(self, n: int = 25) -> str:
        return "\n".join(self.text().replace("\r", "\n").splitlines()[-n:])

    def stop(self, timeout: float = 30) -> dict:
        """SIGTERM, then wait for the exit (killed after timeout). Returns exit code and seconds."""
        if self.proc is None:
            return {}
        t0 = time.perf_counter()
        killed = False
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                log(f"{self.name}: still running {timeout:.0f} s after SIGTERM: killed")
                self.proc.kill()
                self.proc.wait()
                killed = True
        if self.proc in _LIVE:
            _LIVE.remove(self.proc)
        if self._log:
            self._log.close()
        return {"exit_code": self.proc.returncode, "stop_s": time.perf_counter() - t0, "killed": killed}


class Server(Proc):
    """One `kvserve serve` on a free port."""

    def __init__(self, name: str, kvserve: Path, model: Path, threads: int, extra: list[str], log_path: Path):
        port = free_port()
        super().__init__(name, [str(kvserve), "serve", "-m", str(model), "-t", str(threads), "--port", str(port)] + extra,
                         port, log_path)


class Redis:
    """A throw-away redis-server: loopback, a free port, no persistence, its own directory."""

    def __init__(self, binary: str, workdir: Path, log_path: Path):
        self.port = free_port()
        self.dir = workdir
        self.log_path = log_path
        self.cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                    "--dir", str(workdir), "--daemonize", "no"]
        self.proc = None

    def start(self) -> "Redis":
        self.dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        log(f"redis: {' '.join(repr(a) if a == '' else a for a in self.cmd)}")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, cwd=self.dir,
                                     start_new_session=True)
        _LIVE.append(self.proc)
        deadline = time.time() + 20
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode} (log {self.log_path})")
            try:
                if self.cmd_("PING") == "PONG":
                    return self
            except OSError:
                pass
            if time.time() > deadline:
                raise RuntimeError(f"redis-server not answering PING (log {self.log_path})")
            time.sleep(0.1)

    def cmd_(self, *args: str):
        """One command over RESP; simple replies only (+, -, :, $)."""
        payload = f"*{len(args)}\r\n" + "".join(f"${len(a.encode())}\r\n{a}\r\n" for a in args)
        with socket.create_connection(("127.0.0.1", self.port), timeout=30) as s:
            s.sendall(payload.encode())
            f = s.makefile("rb")
            line = f.readline().rstrip(b"\r\n")
            kind, rest = line[:1], line[1:].decode()
            if kind == b"+":
                return rest
            if kind == b"-":
                raise RuntimeError(f"redis: {rest}")
            if kind == b":":
                return int(rest)
            if kind == b"$":
                n = int(rest)
                return None if n < 0 else f.read(n + 2)[:-2].decode(errors="replace")
            raise RuntimeError(f"redis: unexpected reply {line!r}")

    def used_memory(self) -> int | None:
        info = self.cmd_("INFO", "memory") or ""
        m = re.search(r"^used_memory:(\d+)", info, re.M)
        return int(m.group(1)) if m else None

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc in _LIVE:
            _LIVE.remove(self.proc)
        self._log.close()


# ----------------------------------------------------------------------------- HTTP

_MLINE = re.compile(r"^(kvserve:[A-Za-z0-9_:]+)(\{[^}]*\})?\s+(\S+)$")


def metrics(port: int) -> dict[str, float]:
    st, text = http_get(port, "/metrics", timeout=10)
    if st != 200:
        raise RuntimeError(f"/metrics: HTTP {st}")
    out = {}
    for line in text.splitlines():
        m = _MLINE.match(line.strip())
        if m:
            out[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return out


def mv(m: dict, name: str, tier: str | None = None) -> float:
    return m.get(f"kvserve:{name}" + (f'{{tier="{tier}"}}' if tier else ""), 0.0)


def mdelta(m1: dict, m0: dict, name: str, tier: str | None = None) -> float:
    return mv(m1, name, tier) - mv(m0, name, tier)


def complete(port: int, model: str, prompt: str, max_tokens: int, ignore_eos: bool = False,
             on_token=None, timeout: float = 900) -> dict:
    """One streaming /v1/completions request. Times are time.perf_counter() values; ttft is from
    sending the request to the first chunk with text. Raises on an HTTP or stream error."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if ignore_eos:
        body["ignore_eos"] = True
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    times: list[float] = []
    first_chunk = None
    usage = finish = None
    parts = []
    t0 = time.perf_counter()
    try:
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        r = conn.getresponse()
        if r.status != 200:
            raise RuntimeError(f"HTTP {r.status}: {r.read()[:400].decode('utf-8', 'replace')}")
        done = False
        for ev in sse_events(r):
            now = time.perf_counter()
            if ev is None:
                done = True
                break
            if "error" in ev:
                raise RuntimeError(f"stream error: {json.dumps(ev['error'])[:400]}")
            for ch in ev.get("choices") or []:
                if first_chunk is None:
                    first_chunk = now
                if ch.get("text"):
                    times.append(now)
                    parts.append(ch["text"])
                    if on_token:
                        on_token(len(times))
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
            if ev.get("usage"):
                usage = ev["usage"]
        t_end = time.perf_counter()
        if not done:
            raise RuntimeError("stream ended without [DONE]")
    finally:
        conn.close()
    first = times[0] if times else (first_chunk if first_chunk is not None else t_end)
    u = usage or {}
    return {"t0": t0, "t_end": t_end, "ttft": first - t0, "e2e": t_end - t0, "token_times": times,
            "n_chunks": len(times), "finish_reason": finish, "text": "".join(parts),
            "prompt_tokens": u.get("prompt_tokens"), "completion_tokens": u.get("completion_tokens"),
            "cached_tokens": (u.get("prompt_tokens_details") or {}).get("cached_tokens")}


def warm_up(srv: Server, k: int) -> None:
    complete(srv.port, srv.model_id, f"Warm-up request {k}. Hello", 2)


# ----------------------------------------------------------------------------- documents

class Docs:
    """Consecutive, non-overlapping windows of exact token counts from the texts."""

    def __init__(self, model: Path, texts: list[Path], skip: int = 1000):
        from tokenizer_ref import encode, load_tokenizer
        t0 = time.time()
        self.tok = load_tokenizer(model)
        self._encode = lambda s: encode(self.tok, s)
        self.ids: list[int] = []
        for p in texts:
            ids = self._encode(p.read_text(encoding="utf-8", errors="replace"))
            self.ids.extend(ids[skip:])  # past the Project Gutenberg header
        self.off = 0
        log(f"tokenized {', '.join(p.name for p in texts)}: {len(self.ids)} tokens ({time.time() - t0:.1f} s)")

    def take(self, n: int) -> tuple[str, int]:
        """The next n tokens as text, and its token count re-encoded (what the server will see)."""
        if self.off + n > len(self.ids):
            raise RuntimeError(f"texts too short for {n} more tokens (offset {self.off} of {len(self.ids)})")
        text = self.tok.decode(self.ids[self.off:self.off + n])
        self.off += n + 101
        return text, len(self._encode(text))


# ----------------------------------------------------------------------------- phases

def common_flags(args, max_len: int) -> list[str]:
    return ["--max-model-len", str(max_len)]


def kv_bytes_per_token(args) -> int:
    p = subprocess.run([str(args.kvserve), "kv-size", "-m", str(args.model), "--json"], capture_output=True,
                       text=True, cwd=ROOT, check=True)
    return int(json.loads(p.stdout)["total"]["bytes_per_token"])


def ask_docs(srv: Server, docs: list[tuple[int, str, int]], label: str, r: int, max_tokens: int) -> dict[int, dict]:
    out = {}
    for size, text, _n in docs:
        res = complete(srv.port, srv.model_id, text, max_tokens)
        out[size] = res
        log(f"  rep {r + 1} {label:>9} {size:>5}: TTFT {res['ttft'] * 1000:8.1f} ms  prompt {res['prompt_tokens']}"
            f"  cached {res['cached_tokens']}")
    return out


def phase_disk(args, docs_by_rep, max_len, tmp: Path, rec: dict, checks: list[str]) -> None:
    logs = args.out.parent / "tier_logs"
    for r, docs in enumerate(docs_by_rep):
        d = tmp / f"disk_{r}"
        d.mkdir()
        a = Server("disk A", args.kvserve, args.model, args.threads,
                   common_flags(args, max_len) + ["--kv-disk-dir", str(d)], logs / f"disk_A_{r}.log")
        a.start(args.startup_timeout)
        try:
            warm_up(a, 0)
            m0 = metrics(a.port)
            comp = ask_docs(a, docs, "compute", r, args.max_tokens)
            m1 = metrics(a.port)
        finally:
            st = a.stop(args.stop_timeout)
        n_files = sum(1 for p in d.rglob("*") if p.is_file())
        du = sum(p.stat().st_size for p in d.rglob("*") if p.is_file())
        log(f"  rep {r + 1} disk A stopped in {st['stop_s']:.1f} s (exit {st['exit_code']}): {n_files} files, "
            f"{du / 2**20:.0f} MiB in the tier dir")
        if st["exit_code"] != 0 or st["killed"]:
            checks.append(f"disk rep {r + 1}: server A exit {st['exit_code']} killed={st['killed']} (log {a.log_path})")
        b = Server("disk A'", args.kvserve, args.model, args.threads,
                   common_flags(args, max_len) + ["--kv-disk-dir", str(d)], logs / f"disk_A2_{r}.log")
        b.start(args.startup_timeout)
        try:
            m = re.search(r"KV tiers: disk .*?\(.*?, (\d+) pages found\)", b.text())
            found = int(m.group(1)) if m else None
            warm_up(b, 1)
            n0 = metrics(b.port)
            l2 = {}
            per_doc = {}
            for size, text, n in docs:
                x0 = metrics(b.port)
                res = complete(b.port, b.model_id, text, args.max_tokens)
                x1 = metrics(b.port)
                l2[size] = res
                per_doc[size] = {"hits_disk": mdelta(x1, x0, "kv_tier_hits_total", "disk"),
                                 "loaded_pages": mdelta(x1, x0, "kv_tier_loaded_pages_total"),
                                 "load_timeouts": mdelta(x1, x0, "kv_tier_load_timeouts_total")}
                log(f"  rep {r + 1} {'L2':>9} {size:>5}: TTFT {res['ttft'] * 1000:8.1f} ms  prompt {res['prompt_tokens']}"
                    f"  cached {res['cached_tokens']}  disk hits {per_doc[size]['hits_disk']:.0f}"
                    f"  loaded pages {per_doc[size]['loaded_pages']:.0f}")
            n1 = metrics(b.port)
        finally:
            st2 = b.stop(args.stop_timeout)
        shutil.rmtree(d, ignore_errors=True)
        for size, _t, _n in docs:
            c, l = comp[size], l2[size]
            e = rec["sizes"].setdefault(str(size), {"runs": {}})
            e["runs"].setdefault("compute", []).append(c["ttft"])
            e["runs"].setdefault("l2", []).append(l["ttft"])
            e.setdefault("prompt_tokens", []).append(c["prompt_tokens"])
            e.setdefault("cached_tokens_compute", []).append(c["cached_tokens"])
            e.setdefault("cached_tokens_l2", []).append(l["cached_tokens"])
            e.setdefault("l2_tier", []).append(per_doc[size])
            if c["cached_tokens"]:
                checks.append(f"disk rep {r + 1} {size}: the compute request had {c['cached_tokens']} cached tokens")
            pt = l["prompt_tokens"] or 0
            if (l["cached_tokens"] or 0) < pt - 2 * 16:
                checks.append(f"disk rep {r + 1} {size}: L2 request cached {l['cached_tokens']} of {pt} prompt tokens")
            if per_doc[size]["hits_disk"] <= 0:
                checks.append(f"disk rep {r + 1} {size}: kv_tier_hits_total{{tier=\"disk\"}} did not grow")
            if per_doc[size]["load_timeouts"] > 0:
                checks.append(f"disk rep {r + 1} {size}: {per_doc[size]['load_timeouts']:.0f} tier load timeout(s)")
        rec["disk_runs"].append({
            "repeat": r, "stop_A": st, "stop_A2": st2, "tier_files": n_files, "tier_bytes": du, "pages_found_at_restart": found,
            "A_pages_written_disk": mdelta(m1, m0, "kv_tier_pages_written_total", "disk"),
            "A2_hits_disk": mdelta(n1, n0, "kv_tier_hits_total", "disk"),
            "A2_misses_disk": mdelta(n1, n0, "kv_tier_misses_total", "disk"),
            "A2_loaded_pages": mdelta(n1, n0, "kv_tier_loaded_pages_total"),
            "A2_load_seconds_sum": mdelta(n1, n0, "kv_tier_load_seconds_sum", "disk"),
            "A2_errors_disk": mdelta(n1, n0, "kv_tier_errors_total", "disk"),
            "A2_corrupt_disk": mdelta(n1, n0, "kv_tier_corrupt_total", "disk"),
        })
        for k in ("A2_errors_disk", "A2_corrupt_disk"):
            if rec["disk_runs"][-1][k]:
                checks.append(f"disk rep {r + 1}: {k} = {rec['disk_runs'][-1][k]:.0f}")


def wait_writes(srv: Server, tier: str, timeout: float) -> tuple[float, float]:
    """Polls pages_written_total{tier} until it stops growing (3 equal polls 0.5 s apart)."""
    t0 = time.time()
    last, same = -1.0, 0
    while time.time() - t0 < timeout:
        v = mv(metrics(srv.port), "kv_tier_pages_written_total", tier)
        same = same + 1 if v == last and v > 0 else 0
        if same >= 3:
            return v, time.time() - t0
        last = v
        time.sleep(0.5)
    return last, time.time() - t0


def phase_redis(args, docs_by_rep, max_len, tmp: Path, rec: dict, checks: list[str]) -> None:
    logs = args.out.parent / "tier_logs"
    redis = Redis(args.redis_server, tmp / "redis", logs / "redis.log").start()
    url = f"redis://127.0.0.1:{redis.port}"
    try:
        for r, docs in enumerate(docs_by_rep):
            redis.cmd_("FLUSHALL")
            a = Server("redis A", args.kvserve, args.model, args.threads,
                       common_flags(args, max_len) + ["--kv-redis", url, "--kv-tier-write", "through"],
                       logs / f"redis_A_{r}.log")
            a.start(args.startup_timeout)
            try:
                warm_up(a, 0)
                m0 = metrics(a.port)
                comp = ask_docs(a, docs, "compute-wt", r, args.max_tokens)
                written, waited = wait_writes(a, "redis", 300)
                m1 = metrics(a.port)
            finally:
                st = a.stop(args.stop_timeout)
            keys, mem = redis.cmd_("DBSIZE"), redis.used_memory()
            log(f"  rep {r + 1} redis A: {written:.0f} pages written (settled after {waited:.1f} s), "
                f"redis holds {keys} keys, {(mem or 0) / 2**20:.0f} MiB; A stopped in {st['stop_s']:.1f} s")
            b = Server("redis B", args.kvserve, args.model, args.threads,
                       common_flags(args, max_len) + ["--kv-redis", url], logs / f"redis_B_{r}.log")
            b.start(args.startup_timeout)
            try:
                warm_up(b, 1)
                n0 = metrics(b.port)
                l3, per_doc = {}, {}
                for size, text, n in docs:
                    x0 = metrics(b.port)
                    res = complete(b.port, b.model_id, text, args.max_tokens)
                    x1 = metrics(b.port)
                    l3[size] = res
                    per_doc[size] = {"hits_redis": mdelta(x1, x0, "kv_tier_hits_total", "redis"),
                                     "loaded_pages": mdelta(x1, x0, "kv_tier_loaded_pages_total"),
                                     "load_timeouts": mdelta(x1, x0, "kv_tier_load_timeouts_total"),
                                     "errors_redis": mdelta(x1, x0, "kv_tier_errors_total", "redis")}
                    log(f"  rep {r + 1} {'L3':>9} {size:>5}: TTFT {res['ttft'] * 1000:8.1f} ms  prompt {res['prompt_tokens']}"
                        f"  cached {res['cached_tokens']}  redis hits {per_doc[size]['hits_redis']:.0f}"
                        f"  loaded pages {per_doc[size]['loaded_pages']:.0f}")
                n1 = metrics(b.port)
            finally:
                st2 = b.stop(args.stop_timeout)
            for size, _t, _n in docs:
                c, l = comp[size], l3[size]
                e = rec["sizes"].setdefault(str(size), {"runs": {}})
                e["runs"].setdefault("compute_write_through", []).append(c["ttft"])
                e["runs"].setdefault("l3", []).append(l["ttft"])
                e.setdefault("cached_tokens_l3", []).append(l["cached_tokens"])
                e.setdefault("l3_tier", []).append(per_doc[size])
                e.setdefault("prompt_tokens_l3", []).append(l["prompt_tokens"])
                pt = l["prompt_tokens"] or 0
                if c["cached_tokens"]:
                    checks.append(f"redis rep {r + 1} {size}: the compute request had {c['cached_tokens']} cached tokens")
                if (l["cached_tokens"] or 0) < pt - 2 * 16:
                    checks.append(f"redis rep {r + 1} {size}: L3 request cached {l['cached_tokens']} of {pt} prompt tokens")
                if per_doc[size]["hits_redis"] <= 0:
                    checks.append(f"redis rep {r + 1} {size}: kv_tier_hits_total{{tier=\"redis\"}} did not grow")
                for k in ("load_timeouts", "errors_redis"):
                    if per_doc[size][k] > 0:
                        checks.append(f"redis rep {r + 1} {size}: {k} = {per_doc[size][k]:.0f}")
            rec["redis_runs"].append({
                "repeat": r, "stop_A": st, "stop_B": st2, "A_pages_written_redis": written, "A_write_settle_s": waited,
                "A_write_drops_redis": mdelta(m1, m0, "kv_tier_write_drops_total", "redis"),
                "A_errors_redis": mdelta(m1, m0, "kv_tier_errors_total", "redis"),
                "redis_keys": keys, "redis_used_memory": mem,
                "B_hits_redis": mdelta(n1, n0, "kv_tier_hits_total", "redis"),
                "B_misses_redis": mdelta(n1, n0, "kv_tier_misses_total", "redis"),
                "B_loaded_pages": mdelta(n1, n0, "kv_tier_loaded_pages_total"),
                "B_load_seconds_sum": mdelta(n1, n0, "kv_tier_load_seconds_sum", "redis"),
                "B_errors_redis": mdelta(n1, n0, "kv_tier_errors_total", "redis"),
            })
            if rec["redis_runs"][-1]["A_write_drops_redis"]:
                checks.append(f"redis rep {r + 1}: A dropped {rec['redis_runs'][-1]['A_write_drops_redis']:.0f} page writes")
    finally:
        redis.stop()


def seq_stats(res: dict) -> dict:
    t = res["token_times"]
    gaps = [b - a for a, b in zip(t, t[1:])]
    i = max(range(len(gaps)), key=gaps.__getitem__) if gaps else None
    return {"ttft": res["ttft"], "e2e": res["e2e"], "tokens": len(t), "completion_tokens": res["completion_tokens"],
            "prompt_tokens": res["prompt_tokens"], "cached_tokens": res["cached_tokens"],
            "max_gap": gaps[i] if gaps else None, "max_gap_after_token": (i + 1) if gaps else None,
            "median_gap": statistics.median(gaps) if gaps else None, "finish_reason": res["finish_reason"]}


def swap_once(args, mode: str, p1: str, p2: str, budget_bytes: int, max_len: int, tmp: Path, r: int) -> dict:
    logs = args.out.parent / "tier_logs"
    d = tmp / f"swap_{mode}_{r}"
    d.mkdir()
    srv = Server(f"swap/{mode}", args.kvserve, args.model, args.threads,
                 common_flags(args, max_len) + ["--kv-cache-memory", str(budget_bytes), "--kv-disk-dir", str(d),
                                                "--preemption-mode", mode], logs / f"swap_{mode}_{r}.log")
    srv.start(args.startup_timeout)
    try:
        m = re.search(r"KV cache: .*?(\d+) pages of (\d+) tokens = (\d+) tokens", srv.text())
        pool_tokens = int(m.group(3)) if m else None
        warm_up(srv, 0)
        m0 = metrics(srv.port)
        res: dict[int, dict] = {}
        errs: list[BaseException] = []
        go = threading.Event()

        def run(k: int, prompt: str, n: int, cb=None):
            try:
                res[k] = complete(srv.port, srv.model_id, prompt, n, ignore_eos=True, on_token=cb)
            except BaseException as e:  # noqa: BLE001
                errs.append(e)
                go.set()

        t1 = threading.Thread(target=run, args=(1, p1, args.swap_gen1,
                                                lambda k: go.set() if k >= args.swap_delay_tokens else None))
        t1.start()
        go.wait(timeout=900)
        if errs:
            raise errs[0]
        t2 = threading.Thread(target=run, args=(2, p2, args.swap_gen2))
        t2.start()
        t1.join()
        t2.join()
        if errs:
            raise errs[0]
        m1 = metrics(srv.port)
    finally:
        st = srv.stop(args.stop_timeout)
        shutil.rmtree(d, ignore_errors=True)
    s1, s2 = seq_stats(res[1]), seq_stats(res[2])
    end1 = res[1]["token_times"][-1] if res[1]["token_times"] else res[1]["t_end"]
    after = [t for t in res[2]["token_times"] if t > end1]
    resume = (after[0] - end1) if after else None
    out = {
        "mode": mode, "repeat": r, "pool_tokens": pool_tokens, "stop": st,
        "preemptions": mdelta(m1, m0, "num_preemptions_total"),
        "tier_loaded_pages": mdelta(m1, m0, "kv_tier_loaded_pages_total"),
        "tier_hits_disk": mdelta(m1, m0, "kv_tier_hits_total", "disk"),
        "tier_misses_disk": mdelta(m1, m0, "kv_tier_misses_total", "disk"),
        "tier_lookups_disk": mdelta(m1, m0, "kv_tier_load_seconds_count", "disk"),
        "tier_pages_written_disk": mdelta(m1, m0, "kv_tier_pages_written_total", "disk"),
        "tier_load_timeouts": mdelta(m1, m0, "kv_tier_load_timeouts_total"),
        "prefix_cache_evictions": mdelta(m1, m0, "prefix_cache_evictions_total"),
        "seq1": s1, "seq2": s2,
        "seq2_tokens_after_seq1_end": len(after),
        "resume_s": resume,
        "wall_s": max(res[1]["t_end"], res[2]["t_end"]) - res[1]["t0"],
        "seq2_start_after_seq1_s": res[2]["t0"] - res[1]["t0"],
    }
    g = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    log(f"  rep {r + 1} {mode:>9}: preemptions {out['preemptions']:.0f}, tier pages loaded {out['tier_loaded_pages']:.0f}"
        f" (disk lookups {out['tier_lookups_disk']:.0f}, hits {out['tier_hits_disk']:.0f}, written {out['tier_pages_written_disk']:.0f}); seq1 e2e {g(s1['e2e'])} s"
        f" max gap {g(s1['max_gap'])} s; seq2 TTFT {g(s2['ttft'])} s e2e {g(s2['e2e'])} s max gap {g(s2['max_gap'])} s"
        f" (after token {s2['max_gap_after_token']}); resume {g(resume)} s; wall {g(out['wall_s'])} s")
    return out


def phase_swap(args, docs: Docs, tmp: Path, rec: dict, checks: list[str]) -> None:
    bpt = kv_bytes_per_token(args)
    bs = 16
    prompts = [[docs.take(args.swap_prompt) for _ in range(2)] for _ in range(args.repeats)]
    sw = rec["swap"] = {
        "scenario": "sequence 1 (prompt 1, gen1 tokens) starts; after its first delay_tokens tokens sequence 2 (prompt 2, "
                    "gen2 tokens) is sent; both streamed with ignore_eos, temperature 0. The RAM KV pool holds both prompts "
                    "+ headroom tokens, so the newer sequence is preempted once they have generated ~headroom/2 tokens "
                    "each and resumes when sequence 1 ends. resume_s: sequence 1's last token -> sequence 2's next token. "
                    "Two fresh servers per repeat, identical but for --preemption-mode (both --kv-disk-dir, write-back)",
        "prompt_tokens": args.swap_prompt, "gen1": args.swap_gen1, "gen2": args.swap_gen2,
                        "headroom_tokens": args.swap_headroom, "delay_tokens": args.swap_delay_tokens,
                        "kv_bytes_per_token": bpt, "runs": []}
    for r in range(args.repeats):
        (p1, n1), (p2, n2) = prompts[r]
        pages = math.ceil((n1 + n2 + args.swap_headroom) / bs)
        budget = pages * bs * bpt
        max_len = max(n1, n2) + max(args.swap_gen1, args.swap_gen2) + 32
        sw.setdefault("budget_bytes", []).append(budget)
        log(f"swap rep {r + 1}: prompts {n1} + {n2} tokens, KV budget {pages} pages = {pages * bs} tokens "
            f"({budget / 2**20:.1f} MiB, one 4k sequence is {n1 * bpt / 2**20:.1f} MiB)")
        modes = ["recompute", "swap"] if r % 2 == 0 else ["swap", "recompute"]
        for mode in modes:
            o = swap_once(args, mode, p1, p2, budget, max_len, tmp, r)
            o["prompt_tokens_local"] = [n1, n2]
            sw["runs"].append(o)
            if not o["preemptions"]:
                checks.append(f"swap rep {r + 1} {mode}: no preemption happened")
            if o["pool_tokens"] is not None and o["pool_tokens"] >= n1 + n2 + args.swap_gen1 + args.swap_gen2:
                checks.append(f"swap rep {r + 1} {mode}: the pool ({o['pool_tokens']} tokens) holds both sequences")
            if mode == "swap" and o["preemptions"] and not o["tier_loaded_pages"]:
                checks.append(f"swap rep {r + 1}: swap mode preempted {o['preemptions']:.0f}x but loaded no page "
                              f"from the tier (the preempted sequence resumed from RAM / by recompute)")
            if o["stop"].get("exit_code") != 0:
                checks.append(f"swap rep {r + 1} {mode}: exit {o['stop'].get('exit_code')}")


# ----------------------------------------------------------------------------- summary, plot

def summarize(rec: dict) -> None:
    for size, e in rec["sizes"].items():
        runs = e["runs"]
        e["ttft_compute"] = med(runs.get("compute") or [])
        e["compute_source"] = "disk phase server A (empty tier, write-back)"
        if e["ttft_compute"] is None and runs.get("compute_write_through"):
            e["ttft_compute"] = med(runs["compute_write_through"])
            e["compute_source"] = "redis phase server A (empty tier, write-through)"
        e["ttft_compute_write_through"] = med(runs.get("compute_write_through") or [])
        e["ttft_l2"] = med(runs.get("l2") or [])
        e["ttft_l3"] = med(runs.get("l3") or [])
        e["ratio_l2_compute"] = ratio(e["ttft_l2"], e["ttft_compute"])
        e["ratio_l3_compute"] = ratio(e["ttft_l3"], e["ttft_compute"])
        e["prompt_tokens_median"] = med(e.get("prompt_tokens") or e.get("prompt_tokens_l3") or [])
    sw = rec.get("swap")
    if sw and sw.get("runs"):
        summ = {}
        for mode in ("recompute", "swap"):
            rs = [o for o in sw["runs"] if o["mode"] == mode]
            summ[mode] = {
                "preemptions": med([o["preemptions"] for o in rs]),
                "tier_loaded_pages": med([o["tier_loaded_pages"] for o in rs]),
                "resume_s": med([o["resume_s"] for o in rs]),
                "seq1_max_gap_s": med([o["seq1"]["max_gap"] for o in rs]),
                "seq1_e2e_s": med([o["seq1"]["e2e"] for o in rs]),
                "seq2_ttft_s": med([o["seq2"]["ttft"] for o in rs]),
                "seq2_max_gap_s": med([o["seq2"]["max_gap"] for o in rs]),
                "seq2_e2e_s": med([o["seq2"]["e2e"] for o in rs]),
                "wall_s": med([o["wall_s"] for o in rs]),
            }
        sw["median"] = summ
        sw["ratio_swap_over_recompute"] = {k: ratio(summ["swap"][k], summ["recompute"][k])
                                          for k in summ["swap"] if k.endswith("_s")}


def print_table(rec: dict) -> None:
    f = lambda x, s=1000, d=1: "-" if x is None else f"{x * s:.{d}f}"  # noqa: E731
    print(f"TTFT (ms, median of {rec['repeats']}), {rec['model']}, {rec['threads']} threads, {rec['host']['cpu']}")
    print("| doc tokens | recompute | L2 disk | L3 Redis | L2/compute | L3/compute |")
    print("|---|---|---|---|---|---|")
    for size, e in sorted(rec["sizes"].items(), key=lambda kv: int(kv[0])):
        print(f"| {size} ({f(e.get('prompt_tokens_median'), 1, 0)}) | {f(e['ttft_compute'])} | {f(e['ttft_l2'])} | "
              f"{f(e['ttft_l3'])} | {f(e['ratio_l2_compute'], 1, 3)} | {f(e['ratio_l3_compute'], 1, 3)} |")
    sw = rec.get("swap")
    if sw and sw.get("median"):
        m, rt = sw["median"], sw["ratio_swap_over_recompute"]
        print(f"\nPreemption ({sw['prompt_tokens']}-token prompts, seq1 {sw['gen1']} tokens, seq2 {sw['gen2']} "
              f"tokens, KV budget = both prompts + {sw['headroom_tokens']} tokens), medians:")
        print("| | recompute | swap | swap/recompute |")
        print("|---|---|---|---|")
        print(f"| preemptions | {f(m['recompute']['preemptions'], 1, 0)} | {f(m['swap']['preemptions'], 1, 0)} | |")
        print(f"| tier pages loaded | {f(m['recompute']['tier_loaded_pages'], 1, 0)} | {f(m['swap']['tier_loaded_pages'], 1, 0)} | |")
        for k, name in [("resume_s", "resume (seq1 end -> seq2 next token)"), ("seq2_max_gap_s", "seq2 max inter-token gap"),
                        ("seq2_e2e_s", "seq2 end-to-end"), ("seq1_max_gap_s", "seq1 max inter-token gap"),
                        ("seq1_e2e_s", "seq1 end-to-end"), ("wall_s", "wall, both")]:
            print(f"| {name} (s) | {f(m['recompute'][k], 1, 3)} | {f(m['swap'][k], 1, 3)} | {f(rt.get(k), 1, 2)} |")
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
    sizes = sorted(rec["sizes"], key=int)
    sw = rec.get("swap") or {}
    has_swap = bool(sw.get("median"))
    fig, axes = plt.subplots(1, 2 if has_swap else 1, figsize=(11 if has_swap else 6.5, 4.2), squeeze=False,
                             gridspec_kw={"width_ratios": [3, 2]} if has_swap else None)
    ax = axes[0][0]
    if not sizes:
        ax.set_axis_off()
        ax.text(0.5, 0.5, "no TTFT phase in this run", ha="center", va="center", transform=ax.transAxes)
    series = [("ttft_compute", "recompute", "compute", "#888888"), ("ttft_l2", "L2 disk", "l2", "#1f77b4"),
              ("ttft_l3", "L3 Redis", "l3", "#d62728")]
    w = 0.8 / len(series)
    for i, (key, label, rkey, color) in enumerate(series):
        xs, ys, lo, hi = [], [], [], []
        for j, s in enumerate(sizes):
            e = rec["sizes"][s]
            y = e.get(key)
            if y is None:
                continue
            runs = e["runs"].get(rkey) or [y]
            xs.append(j + (i - 1) * w)
            ys.append(y * 1000)
            lo.append((y - min(runs)) * 1000)
            hi.append((max(runs) - y) * 1000)
        if not xs:
            continue
        ax.bar(xs, ys, width=w, label=label, color=color, yerr=[lo, hi], capsize=2, error_kw={"elinewidth": 0.8})
        for x, y, s in zip(xs, ys, [s for s in sizes if rec["sizes"][s].get(key) is not None]):
            e = rec["sizes"][s]
            rt = None if key == "ttft_compute" else e.get("ratio_l2_compute" if key == "ttft_l2" else "ratio_l3_compute")
            txt = f"{y:.0f} ms" + ("" if rt is None else f"\n{rt:.3f}x")
            ax.annotate(txt, (x, y), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
    if sizes:
        ax.set_yscale("log")
        ax.legend(fontsize=8, loc="upper left")
    ax.set_xticks(range(len(sizes)), [f"{s}" for s in sizes])
    ax.set_xlabel("document (prompt tokens)")
    ax.set_ylabel("TTFT, ms (log; median, bars min-max)")
    ax.grid(axis="y", alpha=0.3, which="both")
    ax.set_title("TTFT: recompute vs KV from L2 disk / L3 Redis (x = tier / recompute)", fontsize=9)
    ymax = max([(rec["sizes"][s].get("ttft_compute") or 0) for s in sizes] or [0]) * 1000
    if ymax:
        ax.set_ylim(top=ymax * 4)
    if has_swap:
        ax2 = axes[0][1]
        m, rt = sw["median"], sw["ratio_swap_over_recompute"]
        keys = [("resume_s", "resume"), ("seq2_max_gap_s", "seq2 max gap"), ("seq1_max_gap_s", "seq1 max gap"),
                ("wall_s", "wall")]
        for i, (mode, color) in enumerate([("recompute", "#888888"), ("swap", "#2ca02c")]):
            vals = [m[mode][k] or 0 for k, _ in keys]
            xs = [j + (i - 0.5) * 0.38 for j in range(len(keys))]
            ax2.bar(xs, vals, width=0.38, color=color,
                    label=f"{mode} (preemptions {m[mode]['preemptions']:.0f}, tier pages loaded {m[mode]['tier_loaded_pages']:.0f})")
            if mode == "swap":
                for x, v, (k, _) in zip(xs, vals, keys):
                    if rt.get(k) is not None:
                        ax2.annotate(f"{rt[k]:.2f}x", (x, v), textcoords="offset points", xytext=(0, 3), ha="center", fontsize=7)
        ax2.set_yscale("log")
        ax2.set_xticks(range(len(keys)), [n for _, n in keys], fontsize=8)
        ax2.set_ylabel("seconds (log; median)")
        ax2.grid(axis="y", alpha=0.3, which="both")
        ax2.legend(fontsize=7, loc="upper left")
        ax2.set_title(f"preemption, {sw['prompt_tokens']}-token prompts: swap vs recompute\n(x = swap / recompute)", fontsize=9)
        top = max(max((m[md][k] or 0) for k, _ in keys) for md in m)
        if top:
            ax2.set_ylim(top=top * 6)
    fig.suptitle(f"{rec['model']}, {rec['threads']} threads, {rec['host']['cpu']}, {rec['date'][:10]}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"wrote {path}")


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


# ----------------------------------------------------------------------------- main

def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kvserve", type=Path, default=ROOT / "build" / "kvserve")
    ap.add_argument("--model", type=Path, default=ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--texts", type=Path, nargs="+",
                    default=[ROOT / "data" / "text" / "emma.txt", ROOT / "data" / "text" / "pride_and_prejudice.txt"])
    ap.add_argument("--sizes", type=int, nargs="+", default=[2048, 4096, 8192], help="document lengths (tokens)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", "-t", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=1)
    ap.add_argument("--phases", nargs="+", choices=PHASES, default=PHASES)
    ap.add_argument("--redis-server", default="/usr/bin/redis-server")
    ap.add_argument("--swap-prompt", type=int, default=4096, help="tokens of each of the two prompts")
    ap.add_argument("--swap-gen1", type=int, default=768, help="tokens sequence 1 generates")
    ap.add_argument("--swap-gen2", type=int, default=256, help="tokens sequence 2 generates")
    ap.add_argument("--swap-headroom", type=int, default=256,
                    help="KV budget beyond the two prompts (tokens): the sequences collide after ~headroom/2 tokens each")
    ap.add_argument("--swap-delay-tokens", type=int, default=1, help="sequence 2 is sent after this many tokens of sequence 1")
    ap.add_argument("--startup-timeout", type=float, default=120)
    ap.add_argument("--stop-timeout", type=float, default=300, help="seconds a SIGTERMed server may take to exit")
    ap.add_argument("--tmp-dir", type=Path, default=None, help="parent of the temp dirs (default: the system's)")
    ap.add_argument("--out", type=Path, default=ROOT / "bench" / "out" / "tier_bench.json")
    ap.add_argument("--plot", type=Path, default=ROOT / "bench" / "out" / "tier_bench.png")
    ap.add_argument("--replot", action="store_true", help="no runs: the table and plot from --out")
    args = ap.parse_args()

    if args.replot:
        rec = json.loads(args.out.read_text())
        summarize(rec)
        print_table(rec)
        plot(rec, args.plot)
        return

    signal.signal(signal.SIGTERM, _on_sigterm)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    load = os.getloadavg()[0]
    if load > 0.5:
        log(f"warning: load average {load:.2f}: another process may skew the numbers")
    if "redis" in args.phases and not Path(args.redis_server).exists():
        log(f"no {args.redis_server}: the L3 phase is skipped")
        args.phases = [p for p in args.phases if p != "redis"]
    rec = {"bench": "tier_bench", "date": dt.datetime.now().astimezone().isoformat(timespec="seconds"),
           "host": {"cpu": cpu_model(), "cores": os.cpu_count(), "load_avg_start": list(os.getloadavg())},
           "model": args.model.stem, "model_path": str(args.model), "kvserve": str(args.kvserve),
           "threads": args.threads, "repeats": args.repeats, "doc_sizes": args.sizes, "max_tokens": args.max_tokens,
           "phases": args.phases,
           "method": "TTFT = client-side time from sending a streaming /v1/completions request (temperature 0) to the "
                     "first SSE chunk with text; one distinct document per size and repeat; every server fresh, one "
                     "short warm-up request; L2 pages are read from the OS page cache (written seconds before); "
                     "medians over repeats",
           "sizes": {}, "disk_runs": [], "redis_runs": [], "checks": []}
    checks = rec["checks"]
    tmp = Path(tempfile.mkdtemp(prefix="tier_bench_", dir=args.tmp_dir))
    (args.out.parent / "tier_logs").mkdir(parents=True, exist_ok=True)  # the servers' logs
    try:
        docs = Docs(args.model, args.texts)
        docs_by_rep = [[(s, *docs.take(s)) for s in args.sizes] for _ in range(args.repeats)]
        max_len = max(n for rep in docs_by_rep for _s, _t, n in rep) + args.max_tokens + 512
        for ph in args.phases:
            t0 = time.time()
            log(f"== phase {ph}")
            if ph == "disk":
                phase_disk(args, docs_by_rep, max_len, tmp, rec, checks)
            elif ph == "redis":
                phase_redis(args, docs_by_rep, max_len, tmp, rec, checks)
            elif ph == "swap":
                phase_swap(args, docs, tmp, rec, checks)
            log(f"== phase {ph} done in {time.time() - t0:.0f} s")
            summarize(rec)
            args.out.write_text(json.dumps(rec, indent=1))
    finally:
        _kill_all()
        shutil.rmtree(tmp, ignore_errors=True)
    rec["runtime_s"] = time.time() - T_START
    rec["host"]["load_avg_end"] = list(os.getloadavg())
    summarize(rec)
    args.out.write_text(json.dumps(rec, indent=1))
    log(f"wrote {args.out}")
    print_table(rec)
    plot(rec, args.plot)


if __name__ == "__main__":
    main()
