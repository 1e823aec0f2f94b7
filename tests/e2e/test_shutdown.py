"""Shutdown and disconnects on a real server: SIGTERM drains (503 + Retry-After for new
requests, /health "draining", in-flight requests finish), --shutdown-timeout ends the rest with
finish_reason "abort", an error event and [DONE]; a second signal exits at once; a client that
leaves a non-streamed request cancels it (its pages come back long before max_tokens);
--request-timeout ends a request with 504 (a stream: abort, error event, [DONE]); a client that
sends its body slowly holds only its own connection; oversized headers get a 4xx."""
from __future__ import annotations

import json
import signal
import socket
import threading
import time

import requests

from kvserve_server import ABORTED_CLIENT, ABORTED_SHUTDOWN, ABORTED_TIMEOUT, Router, Server, succeeded

# A request that must still be running when a timeout or a signal comes: thousands of tokens,
# seconds even on a host that decodes 400 tokens a second (400 tokens once took ~1 s and
# finished inside a 1 s timeout).
LONG = 1500
LONG_LEN = 2048  # --max-model-len of the servers that get LONG requests


def wait_busy(s: Server, timeout: float = 15):
    deadline = time.time() + timeout
    while s.debug_kv()["pages_in_use"] == 0:
        assert time.time() < deadline, "no request started"
        time.sleep(0.02)


def sse_events(r) -> list:
    """Every `data:` payload of a stream, [DONE] as the string."""
    out = []
    for line in r.iter_lines():
        if line.startswith(b"data: "):
            p = line[6:].decode()
            out.append(p if p == "[DONE]" else json.loads(p))
    return out


def test_sigterm_lets_in_flight_requests_finish_and_refuses_new_ones():
    s = Server("--debug", "--shutdown-timeout", "180", max_model_len=LONG_LEN, kv_memory="128MiB")
    got = {}
    # Still running 0.1 s after the signal on a host that decodes ~500 tokens a second (40 were
    # not); the drain timeout leaves room for a sanitizer build on a slow host.
    n = 400

    def stream():
        r = requests.post(s.url + "/v1/completions", stream=True, timeout=240,
                          json={"prompt": "Hi", "max_tokens": n, "ignore_eos": True, "stream": True, "temperature": 0})
        got["stream"] = sse_events(r)

    def plain():
        r = requests.post(s.url + "/v1/completions", timeout=240,
                          json={"prompt": "Hello", "max_tokens": n, "ignore_eos": True, "temperature": 0})
        got["plain"] = (r.status_code, r.json())

    threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
    for t in threads:
        t.start()
    wait_busy(s)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.1)
    h = requests.get(s.url + "/health", timeout=5)
    assert h.status_code == 503 and h.json()["status"] == "draining"
    r = requests.post(s.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
    assert r.status_code == 503 and r.headers.get("Retry-After")
    assert r.json()["error"]["code"] == "server_shutting_down"
    for t in threads:
        t.join(timeout=240)
    ev = got["stream"]
    assert ev[-1] == "[DONE]"
    assert [e["choices"][0]["finish_reason"] for e in ev[:-1] if e["choices"][0].get("finish_reason")] == ["length"]
    code, body = got["plain"]
    assert code == 200 and body["usage"]["completion_tokens"] == n
    s.proc.wait(timeout=240)
    assert s.proc.returncode == 0, s.output()
    assert "drained" in s.output()


def test_shutdown_timeout_ends_streams_with_abort_and_an_error_event():
    s = Server("--debug", "--shutdown-timeout", "1", max_model_len=LONG_LEN, kv_memory="128MiB")
    got = []
    plain = []

    def stream():
        r = requests.post(s.url + "/v1/completions", stream=True, timeout=60,
                          json={"prompt": "Hi", "max_tokens": LONG, "ignore_eos": True, "stream": True, "n": 2})
        got.append(sse_events(r))

    def nonstream():
        r = requests.post(s.url + "/v1/completions", timeout=60, json={"prompt": "Hey", "max_tokens": LONG, "ignore_eos": True})
        plain.append(r)

    threads = [threading.Thread(target=stream) for _ in range(2)] + [threading.Thread(target=nonstream)]
    for t in threads:
        t.start()
    wait_busy(s)
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(timeout=20)
    assert s.proc.returncode == 0, s.output()
    assert time.time() - t0 < 10
    for t in threads:
        t.join(timeout=10)
    assert len(got) == 2
    for ev in got:
        assert ev[-1] == "[DONE]"
        finishes = sorted((c["index"], c["finish_reason"]) for e in ev[:-1] if "choices" in e for c in e["choices"]
                          if c.get("finish_reason"))
        assert finishes == [(0, "abort"), (1, "abort")]
        errors = [e["error"] for e in ev[:-1] if "error" in e]
        assert len(errors) == 1 and errors[0]["code"] == "server_shutting_down"
    (r,) = plain
    assert r.status_code == 503 and r.json()["error"]["code"] == "server_shutting_down"


def test_a_second_signal_exits_at_once():
    s = Server("--debug", "--shutdown-timeout", "60", max_model_len=LONG_LEN, kv_memory="128MiB")
    def long_request():
        try:
            requests.post(s.url + "/v1/completions", timeout=60, json={"prompt": "Hi", "max_tokens": LONG, "ignore_eos": True})
        except requests.ConnectionError:  # the process is gone: that is the point
            pass

    t = threading.Thread(target=long_request, daemon=True)
    t.start()
    wait_busy(s)
    s.proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert s.proc.poll() is None  # draining: the request has 60 s
    t0 = time.time()
    s.proc.send_signal(signal.SIGTERM)
    s.proc.wait(timeout=5)
    assert time.time() - t0 < 2
    assert s.proc.returncode == 128 + signal.SIGTERM


def test_dashboard_streams_end_cleanly_when_the_server_stops():
    """A stopping server cut /dashboard/events without the chunked body's end (requests raised
    ChunkedEncodingError, Chromium logged ERR_INCOMPLETE_CHUNKED_ENCODING; a black-box test): it
    waits for them to end themselves, as they do once it drains."""
    s = Server(max_model_len=512, kv_memory="32MiB")
    got = {}

    def watch():
        try:
            with requests.get(s.url + "/dashboard/events", stream=True, timeout=30) as r:
                got["status"] = r.status_code
                got["bytes"] = sum(len(chunk) for chunk in r.iter_content(chunk_size=None))
                got["clean"] = True
        except requests.exceptions.ChunkedEncodingError as e:
            got["clean"] = False
            got["error"] = repr(e)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    deadline = time.time() + 10
    while "status" not in got:  # the stream is open
        assert time.time() < deadline
        time.sleep(0.05)
    time.sleep(0.3)
    s.proc.send_signal(signal.SIGINT)
    s.proc.wait(timeout=30)
    t.join(timeout=10)
    assert s.proc.returncode == 0
    assert got.get("status") == 200 and got.get("clean") is True, got


def test_a_client_that_leaves_a_non_streamed_request_cancels_it(server):
    # 400 tokens would take seconds; the server sees the socket close within a poll.
    before = server.metrics().get(ABORTED_CLIENT, 0)
    body = json.dumps({"prompt": "Tell me everything", "max_tokens": 400, "ignore_eos": True}).encode()
    sock = socket.create_connection(("127.0.0.1", server.port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    wait_busy(server)
    sock.close()
    t0 = time.time()
    while server.debug_kv()["pages_in_use"] != 0:
        assert time.time() - t0 < 2, "the request kept running after its client left"
        time.sleep(0.02)
    deadline = time.time() + 5
    while server.metrics().get(ABORTED_CLIENT, 0) < before + 1:
        assert time.time() < deadline
        time.sleep(0.05)


def test_a_client_that_leaves_a_non_streamed_request_cancels_it_through_the_router():
    """The same through a router: it watches the client's connection while the backend answers
    and closes the upstream request when the client leaves, so the backend cancels it too."""
    s = Server("--debug", max_model_len=LONG_LEN, kv_memory="128MiB")
    try:
        r = Router("--replica", s.url, max_model_len=LONG_LEN)
        try:
            body = json.dumps({"prompt": "Tell me everything", "max_tokens": LONG, "ignore_eos": True, "n": 2}).encode()
            sock = socket.create_connection(("127.0.0.1", r.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_busy(s)
            sock.close()
            t0 = time.time()
            while s.debug_kv()["pages_in_use"] != 0:
                assert time.time() - t0 < 3, "the backend kept running the request after its client left the router"
                time.sleep(0.02)
            assert s.metrics().get(ABORTED_CLIENT, 0) >= 1
            assert r.metrics()["kvserve:router_client_disconnects_total"] == 1
            # the router still answers, and a finished request is not counted as a disconnect
            ok = requests.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4}, timeout=60)
            assert ok.status_code == 200
            assert r.metrics()["kvserve:router_client_disconnects_total"] == 1
        finally:
            r.stop()
    finally:
        s.stop()


def test_a_client_that_leaves_a_streamed_scoring_request_cancels_it_through_the_router():
    """A streamed request that scores its prompt (prompt_logprobs, max_tokens 0) sends nothing
    until the whole prompt is done: the router watches its client's connection too, and closes
    the upstream request when the client leaves (it ran on for 9-15 s of a 4,000-token prompt),
    without counting it as the backend's failure or trying another backend."""
    # 8 tokens a step: the 2,000-token prompt takes seconds
    s = Server("--debug", "--max-num-batched-tokens", "8", max_model_len=LONG_LEN, kv_memory="128MiB")
    try:
        r = Router("--replica", s.url, max_model_len=LONG_LEN)
        try:
            body = json.dumps({"prompt": list(range(1000, 3000)), "max_tokens": 0, "prompt_logprobs": 5, "stream": True}).encode()
            sock = socket.create_connection(("127.0.0.1", r.port))
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                         b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
            wait_busy(s)
            sock.close()
            t0 = time.time()
            while s.debug_kv()["pages_in_use"] != 0:
                assert time.time() - t0 < 1.5, "the backend kept scoring the prompt after its client left the router"
                time.sleep(0.02)
            assert s.metrics().get(ABORTED_CLIENT, 0) >= 1
            m = r.metrics()
            assert m["kvserve:router_client_disconnects_total"] == 1 and m["kvserve:router_retries_total"] == 0
            ok = requests.post(r.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "stream": True}, timeout=60)
            assert ok.status_code == 200 and ok.text.rstrip().endswith("data: [DONE]")
            assert r.metrics()["kvserve:router_client_disconnects_total"] == 1
        finally:
            r.stop()
    finally:
        s.stop()


def test_a_frozen_backend_is_left_after_the_stall_timeout():
    """A backend that freezes (SIGSTOP: a hung host or a network partition keeps its TCP
    connections open) fails its health checks; after --stall-timeout of silence the router
    leaves its requests instead of waiting for --timeout (600 s): a non-streamed one is sent to
    the other replica and answers 200, a stream ends with a 502 error event and [DONE]. Once
    the frozen backend runs again it cancels what it was running; every page comes back."""
    servers = [Server("--debug", max_model_len=LONG_LEN, kv_memory="128MiB") for _ in range(2)]
    try:
        r = Router(*[f for s in servers for f in ("--replica", s.url)], "--stall-timeout", "2", max_model_len=LONG_LEN)

        def busy() -> Server:
            deadline = time.time() + 15
            while True:
                for s in servers:
                    if s.debug_kv()["pages_in_use"] > 0:
                        return s
                assert time.time() < deadline, "no request started"
                time.sleep(0.02)

        def up(s: Server):
            deadline = time.time() + 15
            while not next(b["up"] for b in requests.get(r.url + "/health", timeout=5).json()["backends"] if b["url"] == s.url):
                assert time.time() < deadline, "the router did not see the backend come back"
                time.sleep(0.05)

        try:
            got = {}

            def plain():
                resp = requests.post(r.url + "/v1/completions", timeout=120,
                                     json={"prompt": "Tell me everything", "max_tokens": 256, "ignore_eos": True})
                got["plain"] = (resp.status_code, resp.json())

            t = threading.Thread(target=plain)
            t.start()
            frozen = busy()
            frozen.proc.send_signal(signal.SIGSTOP)
            try:
                t.join(timeout=120)
                code, body = got["plain"]
                assert code == 200 and body["usage"]["completion_tokens"] == 256, body
                other = next(s for s in servers if s is not frozen)
                assert succeeded(other.metrics()) >= 1
                assert r.metrics()["kvserve:router_stalled_total"] == 1
                assert r.metrics()["kvserve:router_retries_total"] >= 1
            finally:
                frozen.proc.send_signal(signal.SIGCONT)
            frozen.wait_clean(timeout=10)  # it saw its connection closed and cancelled

            up(frozen)
            stream = requests.post(r.url + "/v1/completions", stream=True, timeout=120,
                                   json={"prompt": "Tell me more", "max_tokens": LONG, "ignore_eos": True, "stream": True})
            frozen = busy()
            frozen.proc.send_signal(signal.SIGSTOP)
            t0 = time.time()
            try:
                ev = sse_events(stream)
                assert time.time() - t0 < 15, "the stream waited for the frozen backend"
                assert ev[-1] == "[DONE]"
                errors = [e["error"] for e in ev[:-1] if "error" in e]
                assert len(errors) == 1 and errors[0]["code"] == "bad_gateway" and "stopped answering" in errors[0]["message"], errors
                assert r.metrics()["kvserve:router_stalled_total"] == 2
            finally:
                frozen.proc.send_signal(signal.SIGCONT)
            for s in servers:
                s.wait_clean(timeout=10)
        finally:
            r.stop()
    finally:
        for s in servers:
            s.stop()


def test_request_timeout_ends_requests_with_504():
    s = Server("--debug", "--request-timeout", "1", max_model_len=LONG_LEN, kv_memory="128MiB")
    try:
        t0 = time.time()
        r = requests.post(s.url + "/v1/completions", timeout=30, json={"prompt": "Hi", "max_tokens": LONG, "ignore_eos": True})
        assert r.status_code == 504 and r.json()["error"]["code"] == "request_timeout", r.text
        assert time.time() - t0 < 5
        r = requests.post(s.url + "/v1/completions", stream=True, timeout=30,
                          json={"prompt": "Hi", "max_tokens": LONG, "ignore_eos": True, "stream": True})
        ev = sse_events(r)
        assert ev[-1] == "[DONE]"
        assert [c["finish_reason"] for e in ev[:-1] if "choices" in e for c in e["choices"] if c.get("finish_reason")] == ["abort"]
        assert [e["error"]["code"] for e in ev[:-1] if "error" in e] == ["request_timeout"]
        # A short request is untouched.
        r = requests.post(s.url + "/v1/completions", timeout=30, json={"prompt": "Hi", "max_tokens": 4})
        assert r.status_code == 200
        s.wait_clean()
        # both counted as the deadline's, not as clients that left
        m = s.metrics()
        assert (m[ABORTED_TIMEOUT], m[ABORTED_CLIENT], m[ABORTED_SHUTDOWN]) == (2, 0, 0), m
    finally:
        s.stop()
    assert s.proc.returncode == 0, s.output()


def test_a_slow_body_does_not_hold_up_others(server):
    # One client announces a body and sends it a byte at a time; others are served meanwhile
    # (a connection thread each, from a pool of max_num_seqs + 16).
    body = json.dumps({"prompt": "slow", "max_tokens": 2}).encode()
    slow = socket.create_connection(("127.0.0.1", server.port))
    slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n")
    try:
        for i in range(3):
            slow.sendall(body[i:i + 1])
            t0 = time.time()
            r = requests.post(server.url + "/v1/completions", json={"prompt": "fast", "max_tokens": 2}, timeout=10)
            assert r.status_code == 200 and time.time() - t0 < 3
            time.sleep(0.5)
        slow.sendall(body[3:])
        assert b" 200 " in slow.recv(4096).split(b"\r\n")[0]
    finally:
        slow.close()


def test_oversized_headers_are_refused(server):
    r = requests.get(server.url + "/health", headers={"X-Big": "a" * 100_000}, timeout=10)
    assert 400 <= r.status_code < 500
    assert requests.get(server.url + "/health", timeout=5).status_code == 200


def test_router_drains_on_sigterm_then_ends_what_is_left():
    """The router drains as the server does: in-flight requests through it finish, new ones get
    503 + Retry-After, /health says draining; after --shutdown-timeout a stream still open gets
    an error event and [DONE], a non-streamed request a 503; the router exits 0 and the replica
    gets every page back (the cut requests were cancelled upstream)."""
    s = Server("--debug", max_model_len=LONG_LEN, kv_memory="128MiB")
    try:
        # 400 tokens: still running 0.1 s after the signal on a host that decodes ~500 a second.
        for timeout, max_tokens in (("180", 400), ("1", LONG)):
            r = Router("--replica", s.url, "--shutdown-timeout", timeout, max_model_len=LONG_LEN)
            got = {}

            def stream():
                resp = requests.post(r.url + "/v1/completions", stream=True, timeout=240,
                                     json={"prompt": "Hi", "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                                           "temperature": 0})
                got["stream"] = sse_events(resp)

            def plain():
                resp = requests.post(r.url + "/v1/completions", timeout=240,
                                     json={"prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
                got["plain"] = (resp.status_code, resp.json())

            threads = [threading.Thread(target=stream), threading.Thread(target=plain)]
            for t in threads:
                t.start()
            wait_busy(s)
            r.proc.send_signal(signal.SIGTERM)
            time.sleep(0.1)
            h = requests.get(r.url + "/health", timeout=5)
            assert h.status_code == 503 and h.json()["status"] == "draining"
            late = requests.post(r.url + "/v1/completions", json={"prompt": "late", "max_tokens": 2}, timeout=5)
            assert late.status_code == 503 and late.headers.get("Retry-After")
            assert late.json()["error"]["code"] == "server_shutting_down"
            for t in threads:
                t.join(timeout=240)
            r.proc.wait(timeout=240)
            assert r.proc.returncode == 0, r.output()
            ev, (code, body) = got["stream"], got["plain"]
            assert ev[-1] == "[DONE]"
            if timeout == "180":  # both finish
                assert [e["choices"][0]["finish_reason"] for e in ev[:-1] if e["choices"][0].get("finish_reason")] == ["length"]
                assert code == 200 and body["usage"]["completion_tokens"] == max_tokens
                assert "drained" in r.output()
            else:  # both cut at the timeout, long before LONG tokens
                assert ev[-2]["error"]["code"] == "server_shutting_down"
                assert code == 503 and body["error"]["code"] == "server_shutting_down"
                assert "shutdown timeout" in r.output()
            s.wait_clean(timeout=10)
    finally:
        s.stop()


def test_a_busy_port_is_refused_not_shared(server):
    """A second server, or a router, on a port a server listens on exits with an error, as vLLM
    and llama-server do (cpp-httplib's default SO_REUSEPORT would let it start and take a share
    of the first one's connections); the first keeps answering every request."""
    import subprocess
    from kvserve_server import KVSERVE, MODEL
    for cmd in ([KVSERVE, "serve", "-m", MODEL, "--port", str(server.port), "--served-model-name", "impostor"],
                [KVSERVE, "router", "-m", MODEL, "--listen", f"127.0.0.1:{server.port}", "--replica", server.url]):
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert p.returncode != 0, p.stderr
        assert "cannot listen on 127.0.0.1:%d" % server.port in p.stderr, p.stderr
        if cmd[1] == "serve":  # said before the weights load (it came after them; a black-box test)
            assert "the port is in use" in p.stderr and "loading weights" not in p.stderr, p.stderr
    ids = {requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"] for _ in range(20)}
    assert "impostor" not in ids
