"""A real `build/kvserve serve` process on the real SmolLM2 model, for the e2e tests.

(Kept apart from conftest.py so tests can import it by a name no other test folder uses.)
"""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time

import pytest
import requests

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVSERVE = os.environ.get("KVSERVE_BIN", os.path.join(ROOT, "build", "kvserve"))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the file's stem: the default served name
MAX_MODEL_LEN = 512
MAX_N = 4


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *extra: str, model: str = MODEL, max_model_len: int = MAX_MODEL_LEN, kv_memory: str = "48MiB"):
        if not os.path.exists(KVSERVE):
            pytest.fail(f"{KVSERVE} is missing: run `make build`")
        if not os.path.exists(model):
            pytest.fail(f"{model} is missing: run `make models`")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="kvserve-e2e-", suffix=".log", delete=False)
        cmd = [KVSERVE, "serve", "-m", model, "--port", str(self.port), "--threads", "2",
               "--kv-cache-memory", kv_memory, "--max-model-len", str(max_model_len), "--max-n", str(MAX_N), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.time() + 60
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
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def debug_kv(self) -> dict:
        return requests.get(self.url + "/debug/kv", timeout=5).json()

    def wait_clean(self, timeout: float = 5) -> dict:
        """Every KV page back and the pool's integrity check passing; returns /debug/kv. Polls:
        the page count is published at the end of the engine step that answered, which a fast
        client can overtake."""
        deadline = time.time() + timeout
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
