"""A real `build/kvserve serve` process on the real SmolLM2 model, for the e2e tests.

(Kept apart from conftest.py so tests can import it by a name no other test folder uses.)
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVSERVE = os.environ.get("KVSERVE_BIN", os.path.join(ROOT, "build", "kvserve"))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
# kvserve:request_aborted_total by reason (client, timeout, shutdown, error)
ABORTED_CLIENT = 'kvserve:request_aborted_total{reason="client"}'
ABORTED_TIMEOUT = 'kvserve:request_aborted_total{reason="timeout"}'
ABORTED_SHUTDOWN = 'kvserve:request_aborted_total{reason="shutdown"}'
# kvserve:request_success_total by finished_reason (vLLM's label): stop, length, abort
FINISHED = 'kvserve:request_success_total{{finished_reason="{}"}}'


def succeeded(metrics: dict[str, float]) -> float:
    """Requests that finished without being cancelled (stop + length), from Server.metrics()."""
    return sum(metrics.get(FINISHED.format(r), 0.0) for r in ("stop", "length"))


MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the file's stem: the default served name
MAX_MODEL_LEN = 512
MAX_N = 4
# A sanitized server (scripts/run_sanitizers.sh) is several times slower: waits scale by this.
SLOWDOWN = float(os.environ.get("KV_TEST_SLOWDOWN", "1"))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def leave_mid_stream(server, path: str, body: dict, marker: bytes, n: int = 2, timeout: float = 3) -> None:
    """A raw socket (so the moment of closing is ours): POST a streamed body, read until `marker`
    came n times, check the request holds KV pages, hang up; then the engine must free them and
    count a client abort within `timeout` s (× SLOWDOWN). Reads /metrics, which never waits for
    the engine's state lock (the integrity check in /debug/kv does)."""
    def pages_used():
        return server.metrics()["kvserve:kv_cache_pages_used"]

    before = server.metrics()[ABORTED_CLIENT]
    data = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        s.sendall(head + data)
        got = b""
        while got.count(marker) < n:
            chunk = s.recv(4096)
            assert chunk, got
            got += chunk
        assert got.startswith(b"HTTP/1.1 200")
        assert pages_used() > 0
    finally:
        s.close()
    t0 = time.time()
    while pages_used() != 0 or server.metrics()[ABORTED_CLIENT] <= before:
        assert time.time() - t0 < timeout * SLOWDOWN, server.metrics()
        time.sleep(0.02)


def first_token_ms(http, url: str, k: int) -> float:
    """Milliseconds from sending a streamed chat (prompt varied by k) through `http` (a
    `requests.Session`, or the `requests` module: a new connection) to its first content chunk."""
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"Count to {k}."}],
            "max_tokens": 4, "temperature": 0, "stream": True}
    t0 = time.perf_counter()
    first = None
    with http.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60 * SLOWDOWN) as r:
        assert r.status_code == 200, r.text
        for line in r.iter_lines():
            if first is None and line.startswith(b"data: {"):
                ch = json.loads(line[6:])["choices"]
                if ch and ch[0]["delta"].get("content"):
                    first = (time.perf_counter() - t0) * 1e3
    assert first is not None
    return first


def assert_kept_alive_as_quick_as_new(ms, n: int = 7) -> None:
    """ms(http, k) times one exchange through `http`: n times over one kept-alive
    `requests.Session` (urllib3 / http.client, after one exchange that opens it) and n times over
    a new connection each (the `requests` module), interleaved. Writes that wait for TCP
    acknowledgements (Nagle's algorithm against the client's delayed ACK) show as the kept-alive
    median ~40 ms above the new one: a new connection ACKs at once."""
    with requests.Session() as kept:
        ms(kept, 0)
        ka, nc = [], []
        for k in range(1, n + 1):
            ka.append(ms(kept, k))
            nc.append(ms(requests, k))
    ka.sort()
    nc.sort()
    assert ka[n // 2] < nc[n // 2] + 20, f"kept-alive {ka} ms vs new connections {nc} ms"


class Server:
    def __init__(self, *extra: str, model: str = MODEL, max_model_len: int = MAX_MODEL_LEN, kv_memory: str = "48MiB",
                 api_key: str | None = None):
        if not os.path.exists(KVSERVE):
            pytest.fail(f"{KVSERVE} is missing: run `make build`")
        if not os.path.exists(model):
            pytest.fail(f"{model} is missing: run `make models`")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}  # for /debug/kv behind --api-key
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-e2e-", suffix=".log", delete=False)
        cmd = [KVSERVE, "serve", "-m", model, "--port", str(self.port), "--threads", "2",
               "--kv-cache-memory", kv_memory, "--max-model-len", str(max_model_len), "--max-n", str(MAX_N), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60 * SLOWDOWN
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"kvserve exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if requests.get(self.url + "/health", timeout=1).status_code == 200:
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                self.stop()
                pytest.fail(f"kvserve did not become healthy:\n{self.output()}")
            time.sleep(0.1)

    def output(self) -> str:
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            return f.read()[-4000:]

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()  # SIGTERM: graceful stop
            try:
                self.proc.wait(timeout=15 * SLOWDOWN)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def debug_kv(self) -> dict:
        return requests.get(self.url + "/debug/kv", headers=self.headers, timeout=5).json()

    def wait_clean(self, timeout: float = 5) -> dict:
        """Every KV page back and the pool's integrity check passing; returns /debug/kv. Polls:
        the page count is published at the end of the engine step that answered, which a fast
        client can overtake."""
        deadline = time.time() + timeout * SLOWDOWN
        while True:
            kv = self.debug_kv()
            if kv["pages_in_use"] == 0 and kv["integrity"]["ok"]:
                return kv
            if time.time() > deadline:
                pytest.fail(f"pages still held or integrity failed after {timeout} s: {kv}")
            time.sleep(0.05)

    def metrics(self) -> dict[str, float]:
        out = {}
        for line in requests.get(self.url + "/metrics", timeout=5).text.splitlines():
            if line and not line.startswith("#"):
                name, _, value = line.rpartition(" ")
                out[name] = float(value)
        return out


class Redis:
    """A real redis-server on a free loopback port, nothing persisted."""

    def __init__(self):
        if not shutil.which("redis-server"):
            pytest.fail("redis-server is missing: run `make deps`")
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvserve-redis-")
        self.proc = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def start(self):
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no", "--dir", self.dir], stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL)
        deadline = time.time() + 10
        while self.cli("PING") != "PONG":
            if time.time() > deadline:
                pytest.fail("redis-server did not start")
            time.sleep(0.05)

    def cli(self, *args: str) -> str:
        r = subprocess.run(["redis-cli", "-p", str(self.port), *args], capture_output=True, text=True, timeout=10)
        return r.stdout.strip()

    def keys(self) -> list[str]:
        return [k for k in self.cli("--scan").splitlines() if k]

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def close(self):
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class Router:
    """A real `build/kvserve router` in front of kvserve instances."""

    def __init__(self, *backend_flags: str, model: str = MODEL, max_model_len: int = MAX_MODEL_LEN, wait_up: bool = True,
                 health_interval: float = 0.2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-router-", suffix=".log", delete=False)
        cmd = [KVSERVE, "router", "-m", model, "--listen", f"127.0.0.1:{self.port}", "--health-interval", str(health_interval),
               "--max-model-len", str(max_model_len), "--max-n", str(MAX_N), *backend_flags]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while True:
            if self.proc.poll() is not None:
                pytest.fail(f"kvserve router exited with {self.proc.returncode}:\n{self.output()}")
            try:
                r = requests.get(self.url + "/health", timeout=1)
                if r.status_code == 200 or (not wait_up and r.status_code == 503):
                    break
            except requests.RequestException:
                pass
            if time.time() > deadline:
                self.stop()
                pytest.fail(f"kvserve router did not become healthy:\n{self.output()}")
            time.sleep(0.05)

    output = Server.output
    stop = Server.stop
    metrics = Server.metrics
