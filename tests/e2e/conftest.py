"""End-to-end fixtures: a real `build/kvserve serve` on the real SmolLM2 model.

The main server is session-scoped (started once, --debug, small limits). After every test that
uses it, `pages_freed` checks /debug/kv: no KV page is still held by a request and the pool's
integrity check passes.
"""
from __future__ import annotations

import pytest

from kvserve_server import SLOWDOWN, Server


@pytest.fixture(scope="session")
def server():
    s = Server("--debug", "--max-num-seqs", "32", "--max-num-batched-tokens", "256", "--max-queue", "128")
    yield s
    s.stop()
    assert s.proc.returncode == 0, f"kvserve did not stop cleanly ({s.proc.returncode}):\n{s.output()}"


@pytest.fixture(autouse=True)
def pages_freed(request):
    """After each test on the shared server: every page back, integrity ok."""
    yield
    if "server" not in request.fixturenames:
        return
    request.getfixturevalue("server").wait_clean()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    c = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60 * SLOWDOWN)
    yield c
    c.close()  # idle keep-alive connections would hold the server's shutdown for their timeout


@pytest.fixture(scope="session")
def browser():
    """One headless chromium for every browser test (web_pages.py)."""
    from web_pages import CHROMIUM, sync_api
    if CHROMIUM is None:
        pytest.skip("Debian's chromium is not installed (make deps)")
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()
