"""A second server with --api-key and a one-request queue: 401s without the right key, 429
when the queue is full (SIGTERM and drain: test_shutdown.py)."""
from __future__ import annotations

import threading

import pytest
import requests

from kvserve_server import MODEL_NAME, Server

KEY = "sk-test-0123456789"


@pytest.fixture(scope="module")
def keyed():
    s = Server("--api-key", KEY, "--max-num-seqs", "1", "--max-queue", "1", "--served-model-name", "smol")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.output()


def body(**kw):
    b = {"model": "smol", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
    b.update(kw)
    return b


def error_of(r, status):
    assert r.status_code == status, r.text
    e = r.json()["error"]
    assert set(e) == {"message", "type", "param", "code"}
    return e


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong"},
    {"Authorization": "Bearer " + KEY[:-1]},
    {"Authorization": "Bearer " + KEY + "x"},
    {"Authorization": KEY},
    {"Authorization": "Basic " + KEY},
    {"Authorization": "Bearer "},
])
def test_401_without_the_key(keyed, headers):
    for path in ("/v1/completions", "/v1/chat/completions"):
        e = error_of(requests.post(keyed.url + path, json=body(), headers=headers), 401)
        assert e["code"] == "invalid_api_key"
        # A header without the Bearer form (none, the key alone, Basic, an empty key) says how to
        # send one, as OpenAI does; only a wrong key in that form is "incorrect".
        bearer = headers.get("Authorization", "").startswith("Bearer ") and len(headers["Authorization"]) > 7
        assert ("Incorrect API key" in e["message"]) == bearer, e["message"]
        assert ("Bearer auth" in e["message"]) == (not bearer), e["message"]
    error_of(requests.get(keyed.url + "/v1/models", headers=headers), 401)


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer  "])
def test_the_bearer_scheme_is_case_insensitive(keyed, scheme):
    """RFC 7235: the scheme's case does not matter (a user test: "bearer <key>" was an
    "Incorrect API key")."""
    r = requests.post(keyed.url + "/v1/completions", json=body(), headers={"Authorization": scheme + " " + KEY})
    assert r.status_code == 200, r.text


def test_key_accepted(keyed):
    from openai import AuthenticationError, OpenAI
    ok = OpenAI(base_url=keyed.url + "/v1", api_key=KEY, max_retries=0)
    r = ok.completions.create(model="smol", prompt="Hello", max_tokens=2, temperature=0)
    assert r.model == "smol" and r.usage.completion_tokens == 2
    # the file stem is accepted too, as an alias of the served name
    assert ok.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=1).model == "smol"
    bad = OpenAI(base_url=keyed.url + "/v1", api_key="nope", max_retries=0)
    with pytest.raises(AuthenticationError):
        bad.models.list()
    assert requests.get(keyed.url + "/health").status_code == 200  # probes stay open


def test_429_when_queue_full(keyed):
    auth = {"Authorization": "Bearer " + KEY}
    statuses, lock = [], threading.Lock()

    def run():
        r = requests.post(keyed.url + "/v1/completions", json=body(max_tokens=48, ignore_eos=True), headers=auth, timeout=120)
        with lock:
            statuses.append((r.status_code, r.json()))

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(s for s, _ in statuses)
    assert 200 in codes and 429 in codes, codes
    assert set(codes) <= {200, 429}
    for s, j in statuses:
        if s == 429:
            assert j["error"]["code"] == "rate_limit_exceeded"
    # and it still serves
    assert requests.post(keyed.url + "/v1/completions", json=body(), headers=auth).status_code == 200
    # the refusals by reason: an overload is not a request that can never run (a user test)
    before = keyed.metrics()
    too_long = requests.post(keyed.url + "/v1/completions", json=body(prompt="word " * 3000, max_tokens=16), headers=auth)
    assert too_long.status_code == 400, too_long.text
    after = keyed.metrics()
    full, invalid = 'kvserve:request_rejected_total{reason="queue_full"}', 'kvserve:request_rejected_total{reason="invalid"}'
    assert after[full] == before[full] >= codes.count(429)
    assert after[invalid] == before[invalid] + 1


def test_a_burst_of_connections_is_queued_not_reset(keyed):
    """128 clients connecting at the same instant all get answers. The listen backlog is what
    holds them until accept(): Debian's cpp-httplib sets 5, the server raises it to SOMAXCONN
    (`ss` shows a listening socket's backlog as its Send-Q)."""
    import subprocess
    out = subprocess.run(["ss", "-ltnH", f"sport = :{keyed.port}"], capture_output=True, text=True).stdout.split()
    assert out and int(out[2]) >= 128, out
    start = threading.Barrier(128)
    codes, errors = [], []

    def hit():
        start.wait()
        try:
            codes.append(requests.get(keyed.url + "/health", timeout=30).status_code)
        except requests.RequestException as e:  # a reset connection lands here
            errors.append(repr(e))

    threads = [threading.Thread(target=hit) for _ in range(128)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]
    assert codes == [200] * 128


def test_max_model_len_past_the_training_context_warns_once():
    """SmolLM2 was trained on 8,192 positions. A larger --max-model-len was taken silently; the passkey and
    eviction benchmarks pass one on purpose, so it is not refused (vLLM does, unless
    VLLM_ALLOW_LONG_MAX_MODEL_LEN=1) but warned about once, naming the training context (llama.cpp's way);
    --past-trained-context says it is meant."""
    warning = "--max-model-len 16384 is past the model's training context (8192 tokens"
    for flags, warned in [((), True), (("--past-trained-context",), False)]:
        s = Server(*flags, max_model_len=16384)
        try:
            assert requests.get(s.url + "/v1/models", timeout=10).json()["data"][0]["max_model_len"] == 16384
            assert s.output().count(warning) == (1 if warned else 0), s.output()
        finally:
            s.stop()
    s = Server(max_model_len=8192)  # up to the training context: nothing said
    try:
        assert "training context" not in s.output()
    finally:
        s.stop()


def test_a_kv_cache_smaller_than_max_model_len_bounds_the_default_max_tokens():
    """A server whose KV cache holds fewer tokens than one max_model_len sequence (here 8 MiB:
    22 pages of 16 = 352 tokens, against 8,192) refused every chat request without max_tokens:
    the default (the rest of the context, as vLLM's) needed 512 pages. Now the default stops
    where the cache ends, the start log says so, and an explicit max_tokens past it is still a
    400 that names the cache."""
    s = Server(max_model_len=8192, kv_memory="8MiB")
    try:
        out = s.output()
        assert "less than one sequence of max_model_len 8192" in out, out
        cap = int(out.split(" pages of 16 tokens = ")[1].split(" tokens")[0])
        assert 16 <= cap < 8192
        msgs = [{"role": "user", "content": "Count from one to a thousand."}]
        r = requests.post(s.url + "/v1/chat/completions", json={"messages": msgs, "ignore_eos": True, "temperature": 0},
                          timeout=300)
        assert r.status_code == 200, r.text
        usage, choice = r.json()["usage"], r.json()["choices"][0]
        assert usage["total_tokens"] == cap and choice["finish_reason"] == "length", usage
        r = requests.post(s.url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": cap + 16}, timeout=60)
        assert r.status_code == 400 and "raise --kv-cache-memory" in r.json()["error"]["message"], r.text
        m = s.metrics()
        assert m["kvserve:num_requests_running"] == 0 and m["kvserve:kv_cache_pages_used"] == 0
    finally:
        s.stop()


def test_a_burst_within_the_free_sequence_slots_is_not_refused_by_a_short_queue():
    """--max-queue counts requests that wait for a sequence slot. A burst of 8 on an idle server
    with 16 slots and --max-queue 1 got 429s (every request not yet admitted counted as waiting,
    found by a user test); a burst past slots + queue still gets them."""
    s = Server("--max-num-seqs", "16", "--max-queue", "1")
    try:
        # The last burst's requests run long enough that the first 17 still hold slot and queue
        # when the others arrive.
        for burst, want_429, n_tok in [(8, False, 24), (8, False, 24), (24, True, 160)]:
            gate = threading.Barrier(burst)
            codes, lock = [], threading.Lock()

            def one(i):
                gate.wait()
                r = requests.post(s.url + "/v1/completions", timeout=120,
                                  json={"prompt": f"Story {i}", "max_tokens": n_tok, "ignore_eos": True, "temperature": 0})
                with lock:
                    codes.append(r.status_code)

            threads = [threading.Thread(target=one, args=(i,)) for i in range(burst)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert set(codes) <= {200, 429}, codes
            assert (429 in codes) == want_429, codes
            assert codes.count(200) >= min(burst, 17), codes
    finally:
        s.stop()


def test_clients_that_send_their_request_slowly_are_closed_and_others_served():
    """cpp-httplib times out each read, not a request: 100 clients sending their headers a byte a
    second held every connection thread (there are max-num-seqs + 8 + dashboards), and /health
    timed out. Now a connection with no complete request for --http-read-timeout is closed, a body
    still arriving after it is a 408; kept-alive connections and long streams are left alone."""
    import http.client
    import socket
    import time
    s = Server("--debug", "--http-read-timeout", "2", "--max-num-seqs", "4", "--max-dashboards", "1",  # 4 + 8 + 1 threads
               max_model_len=2048, kv_memory="128MiB")
    socks = []
    try:
        # a kept-alive connection asking every 0.25 s for 4 s is served throughout on one socket
        keep = http.client.HTTPConnection("127.0.0.1", s.port, timeout=10)
        for _ in range(16):
            keep.request("GET", "/health")
            assert keep.getresponse().read()
            time.sleep(0.25)
        # 20 slow clients, more than the connection threads
        for _ in range(20):
            c = socket.create_connection(("127.0.0.1", s.port), timeout=10)
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
            socks.append(c)
        t0 = time.time()
        closed = set()
        while len(closed) < len(socks):
            assert time.time() - t0 < 10, f"{len(closed)} of {len(socks)} slow clients were closed"
            for i, c in enumerate(socks):
                if i in closed:
                    continue
                try:
                    c.sendall(b"X")  # a header byte a second: each read is well within httplib's 5 s
                except OSError:
                    closed.add(i)
            time.sleep(0.5)
        assert requests.get(s.url + "/health", timeout=5).status_code == 200
        assert "http: closed" in s.output() and "--http-read-timeout" in s.output()
        # a body trickled a byte a second: 408 once the deadline passes
        b = socket.create_connection(("127.0.0.1", s.port), timeout=10)
        socks.append(b)
        b.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{")
        reply = b""
        for _ in range(10):
            time.sleep(1)
            try:
                b.sendall(b" ")
            except OSError:
                break
        b.settimeout(5)
        try:
            reply = b.recv(4096)
        except OSError:
            pass
        assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
        # a stream longer than the timeout is not cut
        r = requests.post(s.url + "/v1/completions", stream=True, timeout=60,
                          json={"prompt": "Hi", "max_tokens": 1800, "ignore_eos": True, "stream": True, "temperature": 0})
        t0 = time.time()
        lines = [ln for ln in r.iter_lines() if ln]
        assert time.time() - t0 > 2.0 and lines[-1] == b"data: [DONE]", (time.time() - t0, lines[-2:])
        s.wait_clean()
    finally:
        for c in socks:
            c.close()
        s.stop()


def _long_completion(url, results, i, max_tokens):
    try:
        r = requests.post(url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": max_tokens,
                                                         "ignore_eos": True, "temperature": 0}, timeout=120)
        results[i] = r.status_code
    except requests.RequestException as e:  # a connection closed without an answer lands here
        results[i] = repr(e)


def test_requests_past_the_running_slots_queue_in_the_engine_and_none_is_dropped():
    """The connection threads were max-num-seqs + 8 + dashboards: with one sequence slot and a
    queue of 100, the eleventh of 20 clients found no thread, waited unseen, and the watchdog
    (--http-read-timeout) shut it down unanswered as if it were slow; --max-queue was never
    reached. The default now gives every request the engine may hold (running or queued) a
    thread: all 20 are answered."""
    s = Server("--max-num-seqs", "1", "--max-queue", "100", "--max-dashboards", "1", "--http-read-timeout", "2")
    try:
        results = [None] * 20
        threads = [threading.Thread(target=_long_completion, args=(s.url, results, i, 160)) for i in range(20)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [200] * 20, results
        assert "http: closed" not in s.output()
    finally:
        s.stop()


def test_a_complete_request_waiting_for_a_connection_thread_is_served_not_dropped():
    """With the only connection thread held by a running request (--http-threads 1), a second
    client's complete request waits in its socket. The watchdog took it for a client sending
    slowly and shut it down unanswered after --http-read-timeout; it now peeks, finds the
    request's headers, leaves it waiting, and the request is answered once the thread is free."""
    import time
    s = Server("--max-num-seqs", "1", "--http-threads", "1", "--http-read-timeout", "1", max_model_len=2048)
    try:
        results = [None] * 2
        holder = threading.Thread(target=_long_completion, args=(s.url, results, 0, 1500))
        holder.start()
        time.sleep(0.3)
        waiter = threading.Thread(target=_long_completion, args=(s.url, results, 1, 2))
        waiter.start()
        for t in (holder, waiter):
            t.join()
        assert results == [200, 200], results
        assert "waited over" in s.output() and "--http-threads" in s.output(), s.output()[-2000:]
    finally:
        s.stop()


def test_several_served_model_names_are_aliases():
    """vLLM's --served-model-name takes several names (a user test: a vLLM launch line with
    aliases did not start). Each is listed and accepted; responses name the first."""
    from openai import OpenAI
    s = Server("--served-model-name", "foo", "bar")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        assert [m.id for m in c.models.list().data] == ["foo", "bar"]
        for name in ("foo", "bar", MODEL_NAME):
            assert c.completions.create(model=name, prompt="Hi", max_tokens=1).model == "foo"
        assert c.models.retrieve("bar").id == "bar"
        assert requests.post(s.url + "/v1/completions", json={"model": "baz", "prompt": "Hi"}).status_code == 404
    finally:
        s.stop()


def test_max_num_seqs_counts_every_choice():
    """vLLM's max_num_seqs counts each sequence; a request of n choices holds n slots from its
    admission. Forks joined beyond the limit: 4 requests of n = 2 ran 8 sequences under
    --max-num-seqs 4 (a user test)."""
    import time
    s = Server("--max-num-seqs", "4")
    try:
        results, peak, done = [None] * 4, [0], threading.Event()

        def one(i):
            r = requests.post(s.url + "/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 48, "n": 2,
                                                               "ignore_eos": True, "temperature": 0.7}, timeout=120)
            results[i] = (r.status_code, len(r.json().get("choices", [])))

        def watch():
            while not done.is_set():
                peak[0] = max(peak[0], s.metrics().get("kvserve:num_requests_running", 0))
                time.sleep(0.005)

        w = threading.Thread(target=watch)
        w.start()
        threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        done.set()
        w.join()
        assert results == [(200, 2)] * 4, results
        assert 2 <= peak[0] <= 4, peak
        # n at the limit runs (alone); above it is a 400 (--max-n defaults to --max-num-seqs here)
        r = requests.post(s.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4, "n": 4, "temperature": 0.7}, timeout=120)
        assert r.status_code == 200 and len(r.json()["choices"]) == 4, r.text
    finally:
        s.stop()
