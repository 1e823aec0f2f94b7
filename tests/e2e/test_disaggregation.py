"""Prefill/decode disaggregation and replicas behind `kvserve router`, through real processes:
`kvserve serve --role prefill|decode` sharing a real `redis-server`, the router in front, the
official `openai` client.

- 1 prefill + 1 decode + router give the greedy output of one instance, streamed or not; the
  decode instance reports the prompt as cached (its pages came from the prefill instance).
- The prefill instance killed mid-load fails no request: the decode instance computes.
- 2 replicas + router: requests sharing a system prompt go to one replica, and the prefix hit
  rate is at least 90% of one instance's on the same requests; a replica killed loses no request.
- The router answers bad requests itself (400, OpenAI-shaped), 503 when no backend is up.
"""
from __future__ import annotations

import concurrent.futures as cf
import os
import signal
import subprocess
import sys
import time

import pytest
import requests
from openai import OpenAI

from kvserve_server import (KVSERVE, MODEL, MODEL_NAME, SLOWDOWN, Redis, Router, Server, assert_kept_alive_as_quick_as_new,
                            first_token_ms, free_port, succeeded)

MAX_LEN = 2048
BASE = open(os.path.join(os.path.dirname(__file__), "..", "..", "data", "text", "emma.txt"), encoding="utf-8").read()


def doc(offset: int, chars: int = 3000) -> str:
    return BASE[40000 + offset: 40000 + offset + chars]


def client(url: str) -> OpenAI:
    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120 * SLOWDOWN)


def complete(url: str, prompt: str, max_tokens: int = 12, stream: bool = False):
    c = client(url)
    try:
        if stream:
            text, usage = "", None
            for ch in c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
                if ch.choices:
                    text += ch.choices[0].text
                if ch.usage:
                    usage = ch.usage
        else:
            r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0)
            text, usage = r.choices[0].text, r.usage
    finally:
        c.close()
    return text, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens


def chat(url: str, system: str, question: str, max_tokens: int = 8):
    c = client(url)
    try:
        r = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "system", "content": system},
                                                                  {"role": "user", "content": question}],
                                      max_tokens=max_tokens, temperature=0)
    finally:
        c.close()
    return r.choices[0].message.content, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


@pytest.fixture
def redis():
    r = Redis()
    yield r
    r.close()


def role_server(role: str, redis: Redis, *extra: str) -> Server:
    return Server("--debug", "--role", role, "--kv-redis", redis.url, *extra, max_model_len=MAX_LEN, kv_memory="64MiB")


def stop_all(*procs):
    for p in procs:
        if p is not None:
            p.stop()


# ---- prefill / decode -------------------------------------------------------------------------

def test_prefill_and_decode_give_the_output_of_one_instance(redis):
    prompts = [doc(0), doc(5000, 2000), "Name three rivers in Europe:" + doc(9000, 800)]
    solo = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
    try:
        expected = [complete(solo.url, p)[0] for p in prompts]
    finally:
        solo.stop()
    pre = dec = router = None
    try:
        pre = role_server("prefill", redis)
        dec = role_server("decode", redis)
        assert requests.get(pre.url + "/health").json()["role"] == "prefill"
        router = Router("--prefill", pre.url, "--decode", dec.url, max_model_len=MAX_LEN)
        tails = full_tails = 0
        for i, p in enumerate(prompts):
            text, n_prompt, cached = complete(router.url, p, stream=(i == 1))
            assert text == expected[i], i
            # The decode instance found every full page the prefill instance stored and the prompt's
            # partly filled last page: it computed only the prompt's last token.
            assert cached == n_prompt - 1, (i, n_prompt, cached)
            t = n_prompt - (n_prompt - 1) // 16 * 16  # the last page's tokens (1: the last token alone)
            tails += 2 <= t < 16
            full_tails += t == 16  # a full last page: stored as any page (write-through), installed as a tail
        assert tails >= 2 and full_tails >= 1
        m_dec, m_pre = dec.metrics(), pre.metrics()
        assert m_dec['kvserve:kv_tier_prompt_tails_total{result="loaded"}'] == tails + full_tails
        assert m_dec['kvserve:kv_tier_prompt_tails_total{result="unused"}'] == 0
        assert m_pre['kvserve:kv_tier_prompt_tails_total{result="stored"}'] == tails
        assert m_pre['kvserve:kv_tier_prompt_tails_total{result="dropped"}'] == 0
        # The same prompts again: the decode instance holds their full pages in RAM and still takes
        # each tail the prefill instance stores anew (read once: Redis keeps no tail behind).
        n_keys = len(redis.keys())
        again = 0
        for i, p in enumerate(prompts):
            text, n_prompt, cached = complete(router.url, p)
            assert text == expected[i] and cached == n_prompt - 1, (i, n_prompt, cached)
            again += 2 <= n_prompt - (n_prompt - 1) // 16 * 16  # a full last page is a tail here too
        m_dec = dec.metrics()
        assert m_dec['kvserve:kv_tier_prompt_tails_total{result="loaded"}'] == tails + full_tails + again
        assert len(redis.keys()) == n_keys
        # A prefill instance answers one token, whatever was asked, once its pages are stored.
        r = requests.post(pre.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": doc(20000, 1500), "max_tokens": 50,
                                                             "temperature": 0})
        assert r.status_code == 200 and r.headers["X-KVServe-Prefill-Stored"] == "1"
        assert r.json()["usage"]["completion_tokens"] == 1
        m = router.metrics()
        assert m['kvserve:router_prefills_total{result="ok"}'] == 6  # each prompt twice
        assert m['kvserve:router_prefills_total{result="failed"}'] == 0
        assert dec.metrics()['kvserve:kv_tier_hits_total{tier="redis"}'] >= 3
        # Keys live in the shared Redis, under the model's fingerprint and format.
        assert any(k.startswith("kvs:") for k in redis.keys())
        dec.wait_clean()
        pre.wait_clean()
    finally:
        stop_all(router, dec, pre)


def _router_counts(router, dec_url):
    m = router.metrics()
    return ({k.split('result="')[1][:-2]: v for k, v in m.items() if k.startswith("kvserve:router_prefills_total")},
            m[f'kvserve:router_requests_total{{backend="{dec_url}",role="decode"}}'],
            sum(v for k, v in m.items() if k.startswith("kvserve:router_backend_failures_total")))


def test_prefill_for_responses_refusals_disconnects_and_a_lost_tier(redis):
    """A user test's P/D findings, each shown on the previous build:
    - /v1/responses: the prefill instance answered before its pages were down (decode found gaps);
    - a request the prefill instance refuses (4xx: a wrong key) is answered from there, counted
      neither as a backend failure nor sent to decode;
    - a client that leaves during the prefill cancels it there, and nothing goes to decode;
    - with Redis gone, the prefill instance says its pages are not stored (it said 1), and the
      router counts not_stored instead of ok, while the answer still comes (decode computes)."""
    pre = dec = router = None
    try:
        pre = Server("--debug", "--role", "prefill", "--kv-redis", redis.url, "--api-key", "k1", max_model_len=8192,
                     kv_memory="256MiB", api_key="k1")
        dec = Server("--debug", "--role", "decode", "--kv-redis", redis.url, "--api-key", "k1", max_model_len=MAX_LEN,
                     kv_memory="64MiB", api_key="k1")
        router = Router("--prefill", pre.url, "--decode", dec.url, max_model_len=MAX_LEN)
        c = OpenAI(base_url=router.url + "/v1", api_key="k1", max_retries=0, timeout=120 * SLOWDOWN)
        r = c.responses.create(model=MODEL_NAME, input=doc(30000, 2500), max_output_tokens=8, temperature=0)
        assert r.usage.input_tokens_details.cached_tokens == r.usage.input_tokens - 1, r.usage
        direct = requests.post(pre.url + "/v1/responses", headers={"Authorization": "Bearer k1"},
                               json={"model": MODEL_NAME, "input": doc(34000, 1500)}, timeout=60)
        assert direct.status_code == 200 and direct.headers["X-KVServe-Prefill-Stored"] == "1"
        counts, to_dec, failures = _router_counts(router, dec.url)
        assert counts["ok"] == 1 and failures == 0

        # a wrong key: the prefill instance's 401, straight back
        bad = requests.post(router.url + "/v1/completions", headers={"Authorization": "Bearer nope"},
                            json={"model": MODEL_NAME, "prompt": doc(36000, 1500), "max_tokens": 4}, timeout=60)
        assert bad.status_code == 401 and bad.json()["error"]["code"] == "invalid_api_key", bad.text
        counts2, to_dec2, failures2 = _router_counts(router, dec.url)
        assert counts2["refused"] == 1 and to_dec2 == to_dec and failures2 == 0, (counts2, to_dec2, failures2)

        # a client that leaves during a long prefill (~7k tokens, 8k context on the prefill side)
        import json as _json
        import socket
        body = _json.dumps({"model": MODEL_NAME, "prompt": BASE[50000:50000 + 30000], "max_tokens": 4}).encode()
        s = socket.create_connection(("127.0.0.1", router.port))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        aborted = pre.metrics().get('kvserve:request_aborted_total{reason="client"}', 0)
        t0 = time.time()
        while pre.metrics()["kvserve:num_requests_running"] == 0:
            assert time.time() - t0 < 30 * SLOWDOWN
            time.sleep(0.02)
        s.close()
        while pre.metrics().get('kvserve:request_aborted_total{reason="client"}', 0) < aborted + 1:
            assert time.time() - t0 < 30 * SLOWDOWN, "the prefill ran on after its client left"
            time.sleep(0.05)
        time.sleep(0.3)
        counts3, to_dec3, _ = _router_counts(router, dec.url)
        assert counts3["cancelled"] == 1 and to_dec3 == to_dec2, (counts3, to_dec3)
        assert router.metrics()["kvserve:router_client_disconnects_total"] == 1
        pre.wait_clean()

        # Redis gone: the answer comes, computed by decode; the prefill says so
        redis.stop()
        r = c.completions.create(model=MODEL_NAME, prompt=doc(38000, 1500), max_tokens=4, temperature=0)
        assert r.usage.completion_tokens == 4
        counts4, _, _ = _router_counts(router, dec.url)
        assert counts4["not_stored"] == 1 and counts4["ok"] == 1, counts4
        direct = requests.post(pre.url + "/v1/completions", headers={"Authorization": "Bearer k1"},
                               json={"model": MODEL_NAME, "prompt": doc(40000, 1500)}, timeout=60)
        assert direct.status_code == 200 and direct.headers["X-KVServe-Prefill-Stored"] == "0"
        c.close()
        dec.wait_clean()
    finally:
        stop_all(router, dec, pre)


def test_short_prompts_skip_the_prefill_instance(redis):
    pre = dec = router = None
    try:
        pre = role_server("prefill", redis)
        dec = role_server("decode", redis)
        router = Router("--prefill", pre.url, "--decode", dec.url, "--prefill-min-tokens", "64", max_model_len=MAX_LEN)
        text, n_prompt, cached = complete(router.url, "The capital of France is", max_tokens=4)
        assert n_prompt < 64 and cached == 0 and text
        m = router.metrics()
        assert m['kvserve:router_prefills_total{result="skipped"}'] == 1
        assert m['kvserve:router_prefills_total{result="ok"}'] == 0
    finally:
        stop_all(router, dec, pre)


def batch(url: str, prompts: list, max_tokens: int = 10, stream: bool = False):
    """One completions request holding several prompts (OpenAI's batch form): the choices' texts
    in index order, and the usage."""
    c = client(url)
    try:
        if not stream:
            r = c.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=max_tokens, temperature=0)
            assert [ch.index for ch in r.choices] == list(range(len(prompts)))
            return [ch.text for ch in r.choices], r.usage
        texts, usage = [""] * len(prompts), None
        for ch in c.completions.create(model=MODEL_NAME, prompt=prompts, max_tokens=max_tokens, temperature=0, stream=True,
                                       stream_options={"include_usage": True}):
            for choice in ch.choices:
                texts[choice.index] += choice.text
            usage = ch.usage or usage
        return texts, usage
    finally:
        c.close()


def test_a_batch_of_prompts_is_prefilled_and_decoded_whole(redis):
    # The router sends a batch whole: to the prefill instance when its longest prompt is long
    # enough (every prompt is prefilled there, the short one too), then to the decode instance,
    # which finds every prompt's pages, and answers as one instance would.
    prompts = [doc(0, 1500), "Name three rivers in Europe:", doc(6000, 1200)]
    solo = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
    try:
        expected, solo_usage = batch(solo.url, prompts)
    finally:
        solo.stop()
    pre = dec = router = None
    try:
        pre = role_server("prefill", redis)
        dec = role_server("decode", redis)
        router = Router("--prefill", pre.url, "--decode", dec.url, max_model_len=MAX_LEN)
        for stream in (False, True):
            texts, usage = batch(router.url, prompts, stream=stream)
            assert texts == expected, stream
            assert usage.prompt_tokens == solo_usage.prompt_tokens
            # Each long prompt's last token alone was computed on the decode instance; the short one
            # (less than a page: nothing goes through the tier) whole.
            n_short = requests.post(router.url + "/tokenize", json={"prompt": prompts[1]}).json()["count"]
            assert n_short < 16
            assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens - 2 - n_short, (stream, usage)
        m = router.metrics()
        assert m['kvserve:router_prefills_total{result="ok"}'] == 2
        assert succeeded(pre.metrics()) == 2 * len(prompts)
        # min_tokens goes through the prefill instance too (it forces one token: min_tokens is not
        # its business), and the decode instance holds the end off.
        c = client(router.url)
        try:
            r = c.completions.create(model=MODEL_NAME, prompt=prompts[0], max_tokens=10, temperature=0, extra_body={"min_tokens": 10})
        finally:
            c.close()
        assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens_details.cached_tokens == r.usage.prompt_tokens - 1
        assert router.metrics()['kvserve:router_prefills_total{result="ok"}'] == 3
        # A batch of short prompts only skips the prefill instance.
        texts, usage = batch(router.url, ["The capital of France is", "1, 2, 3,"], max_tokens=4)
        assert all(texts) and router.metrics()['kvserve:router_prefills_total{result="skipped"}'] == 1
        dec.wait_clean()
        pre.wait_clean()
    finally:
        stop_all(router, dec, pre)


def test_a_batch_goes_whole_to_one_replica():
    a = b = router = None
    try:
        a = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        b = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        prompts = ["The capital of France is", doc(100, 400), "def fib(n):", "1, 2, 3,"]
        expected, _ = batch(a.url, prompts)
        router = Router("--replica", a.url, "--replica", b.url, max_model_len=MAX_LEN)
        for stream in (False, True):
            texts, usage = batch(router.url, prompts, stream=stream)
            assert texts == expected
            assert usage.completion_tokens == 10 * len(prompts)
        per = [succeeded(s.metrics()) for s in (a, b)]
        n = len(prompts)  # `a` answered the batch once alone; the router's two went whole to one replica
        assert per in ([3 * n, 0], [n, 2 * n]), per
        m = router.metrics()
        routed = [m[f'kvserve:router_requests_total{{backend="{s.url}",role="replica"}}'] for s in (a, b)]
        assert routed in ([2, 0], [0, 2]), routed  # the same first prompt: the same replica, both times
        # A bad prompt anywhere: the router answers the 400 itself, naming it.
        r = requests.post(router.url + "/v1/completions", json={"prompt": [[1, 2], [3, 10**9]]})
        assert r.status_code == 400 and "prompt[1]" in r.json()["error"]["message"], r.text
        a.wait_clean()
        b.wait_clean()
    finally:
        stop_all(router, a, b)


def test_prefill_instance_killed_mid_load_fails_no_request(redis):
    prompts = [doc(1000 * i, 2500) for i in range(6)]
    solo = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
    try:
        expected = [complete(solo.url, p, max_tokens=6)[0] for p in prompts]
    finally:
        solo.stop()
    pre = dec = router = None
    try:
        pre = role_server("prefill", redis, "--max-num-batched-tokens", "64")  # slow prefill: a kill lands mid-load
        dec = role_server("decode", redis)
        router = Router("--prefill", pre.url, "--decode", dec.url, max_model_len=MAX_LEN)
        with cf.ThreadPoolExecutor(len(prompts)) as ex:
            futs = [ex.submit(complete, router.url, p, 6, i % 2 == 0) for i, p in enumerate(prompts)]
            time.sleep(1.0)
            pre.proc.send_signal(signal.SIGKILL)
            got = [f.result(timeout=300 * SLOWDOWN)[0] for f in futs]
        assert got == expected
        m = router.metrics()
        assert m['kvserve:router_prefills_total{result="failed"}'] >= 1, m
        # With the prefill side gone for good, requests still succeed: decode computes. The
        # metrics tell that from a failing instance (no request is sent to a down one).
        before = router.metrics()
        assert complete(router.url, prompts[0], max_tokens=6)[0] == expected[0]
        m = router.metrics()
        assert m['kvserve:router_prefills_total{result="no_backend"}'] == before['kvserve:router_prefills_total{result="no_backend"}'] + 1, m
        assert m['kvserve:router_prefills_total{result="failed"}'] == before['kvserve:router_prefills_total{result="failed"}'], m
        dec.wait_clean()
    finally:
        stop_all(router, dec, pre)


def test_roles_need_a_shared_tier():
    for role in ("prefill", "decode"):
        r = subprocess.run([KVSERVE, "serve", "-m", MODEL, "--port", str(free_port()), "--role", role], capture_output=True,
                           text=True, timeout=60)
        assert r.returncode != 0 and "--kv-redis" in r.stderr, r.stderr


# ---- replicas ---------------------------------------------------------------------------------

def tenant_load():
    """Four tenants, each with its own ~600-token system prompt, asking 5 questions each,
    interleaved as they would arrive."""
    systems = [f"You answer questions about this text (tenant {t}).\n" + doc(7000 * t, 2400) for t in range(4)]
    questions = ["Who is the main character?", "Where does it happen?", "Summarise it in one line.", "What year is it?",
                 "Name one object in it."]
    return [(systems[t], q) for q in questions for t in range(4)]


def hit_rate(url: str, load) -> float:
    cached = total = 0
    for system, q in load:
        _, n, c = chat(url, system, q, max_tokens=2)
        cached += c
        total += n
    return cached / total


def test_replicas_keep_each_prefix_on_one_replica(redis):
    load = tenant_load()
    solo = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
    try:
        solo_rate = hit_rate(solo.url, load)
    finally:
        solo.stop()
    a = b = router = None
    try:
        a = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        b = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        router = Router("--replica", a.url, "--replica", b.url, max_model_len=MAX_LEN)
        rate = hit_rate(router.url, load)
        assert rate >= 0.9 * solo_rate, (rate, solo_rate)
        m = router.metrics()
        # Cache-aware routing: each tenant's first request is new (the least loaded replica), the
        # rest go where it went.
        assert m['kvserve:router_affinity_total{result="new"}'] == 4, m
        assert m['kvserve:router_affinity_total{result="owner"}'] == len(load) - 4, m
        per = [m[f'kvserve:router_requests_total{{backend="{s.url}",role="replica"}}'] for s in (a, b)]
        assert sum(per) == len(load) and min(per) > 0, per  # both used, each tenant whole
        assert per == [10, 10], per  # four tenants seen one at a time split 2 / 2

        # A replica killed: its tenants move to the other, no request fails.
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait()
        for system, q in load[:8]:
            assert chat(router.url, system, q, max_tokens=2)[0] is not None
        m = router.metrics()
        assert m[f'kvserve:router_backend_up{{backend="{b.url}",role="replica"}}'] == 0
        a.wait_clean()
    finally:
        stop_all(router, a, b)


def test_a_full_replica_sends_its_requests_to_the_other():
    """A replica whose queue is full answers 429; nothing has reached the client yet, so the
    router tries the other replica (a user test saw 5 of 8 requests refused while one replica
    sat idle: cache-aware routing kept the shared prefix on its owner). Streamed and not."""
    a = b = router = None
    try:
        # Room for 3 each (1 running + 2 queued): the owner of the shared prefix cannot take all 4
        # requests below, and the two together always can. With room for exactly 4 (a queue of 1)
        # the test was flaky: a request waits in the queue until the engine's next step takes it,
        # so for a moment both replicas could look full.
        a = Server("--debug", "--max-num-seqs", "1", "--max-queue", "2", max_model_len=MAX_LEN, kv_memory="64MiB")
        b = Server("--debug", "--max-num-seqs", "1", "--max-queue", "2", max_model_len=MAX_LEN, kv_memory="64MiB")
        router = Router("--replica", a.url, "--replica", b.url, max_model_len=MAX_LEN)
        system = "You answer questions about rivers, briefly and exactly. " * 4

        def one(i: int):
            body = {"model": MODEL_NAME, "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"River {i}?"}],
                    "max_tokens": 48, "ignore_eos": True, "temperature": 0, "stream": i % 2 == 1}
            r = requests.post(router.url + "/v1/chat/completions", json=body, timeout=120)
            return r.status_code, r.headers.get("Retry-After")

        with cf.ThreadPoolExecutor(4) as pool:
            got = list(pool.map(one, range(4)))
        assert [c for c, _ in got] == [200] * 4, got
        m = router.metrics()
        assert m["kvserve:router_backend_full_total"] >= 1, m
        per = [m[f'kvserve:router_requests_total{{backend="{s.url}",role="replica"}}'] for s in (a, b)]
        assert min(per) > 0, per
        # Both full (8 > 6): the 429 reaches the client, with Retry-After.
        with cf.ThreadPoolExecutor(8) as pool:
            got = list(pool.map(one, range(8)))
        assert any(c == 429 and ra for c, ra in got), got
        for s in (a, b):
            s.wait_clean(timeout=30)
    finally:
        stop_all(router, a, b)


def test_frozen_backends_are_left_together_and_a_stored_response_behind_one_is_a_503():
    """Health checks run at once: three backends that accept connections and never answer are all
    left within one check's timeout (one by one they took 2 s each: 6 s here). A stored response
    on a replica that froze is a retryable 503 (it was the 404 of an unknown id), and a streamed
    client that leaves is counted once in router_client_disconnects_total (streams were not)."""
    import socket
    frozen = []
    for _ in range(3):
        sk = socket.socket()
        sk.bind(("127.0.0.1", 0))
        sk.listen(64)  # connections queue; nothing is ever read or answered
        frozen.append(sk)
    a = router = None
    try:
        a = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        t0 = time.time()
        router = Router("--replica", a.url, *[f for sk in frozen for f in ("--replica", f"127.0.0.1:{sk.getsockname()[1]}")],
                        max_model_len=MAX_LEN, health_interval=0.2)
        while sum(not b["up"] for b in requests.get(router.url + "/health", timeout=10).json()["backends"]) < 3:
            time.sleep(0.05)
        assert time.time() - t0 < 5, "the frozen backends' checks ran one after another"

        c = client(router.url)
        stream = c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Count to 300."}],
                                           max_tokens=300, stream=True)
        for i, _ in enumerate(stream):
            if i == 3:
                break
        stream.close()
        t1 = time.time()
        while a.metrics()["kvserve:num_requests_running"] != 0 or router.metrics()["kvserve:router_client_disconnects_total"] < 1:
            assert time.time() - t1 < 10, router.metrics()["kvserve:router_client_disconnects_total"]
            time.sleep(0.05)
        time.sleep(0.5)
        assert router.metrics()["kvserve:router_client_disconnects_total"] == 1

        resp = c.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=4)
        a.proc.send_signal(signal.SIGSTOP)
        try:
            while any(b["up"] for b in requests.get(router.url + "/health", timeout=10).json()["backends"]):
                time.sleep(0.05)
            got = requests.get(f"{router.url}/v1/responses/{resp.id}", timeout=30)
            assert got.status_code == 503 and got.headers.get("Retry-After"), got.text
            assert got.json()["error"]["code"] == "backend_unavailable"
            cont = requests.post(router.url + "/v1/responses", json={"model": MODEL_NAME, "input": "more", "previous_response_id": resp.id},
                                 timeout=30)
            assert cont.status_code == 503 and cont.json()["error"]["param"] == "previous_response_id", cont.text
        finally:
            a.proc.send_signal(signal.SIGCONT)
        while not requests.get(router.url + "/health", timeout=10).json()["backends"][0]["up"]:
            time.sleep(0.05)
        assert c.responses.retrieve(resp.id).id == resp.id
        c.close()
    finally:
        stop_all(router, a)
        for sk in frozen:
            sk.close()


def test_the_router_checks_api_keys_before_anything_else():
    """`kvserve router --api-key`: as the server, every route but /health and /metrics needs a
    key, checked before the body is validated (a user test: the router answered /v1/models and
    /tokenize to anyone, and a bad body with a 400 before the backend's 401); the header goes on
    to the backends, which check the same keys."""
    a = router = None
    try:
        a = Server("--debug", "--api-key", "k1", "--api-key", "k2", max_model_len=MAX_LEN, kv_memory="64MiB", api_key="k1")
        router = Router("--replica", a.url, "--api-key", "k1", "--api-key", "k2", max_model_len=MAX_LEN)
        for method, path, body in (("GET", "/v1/models", None), ("POST", "/tokenize", {"prompt": "hi"}),
                                   ("POST", "/v1/chat/completions", {"model": MODEL_NAME, "messages": "not a list"}),
                                   ("GET", "/v1/responses/resp_x", None)):
            for headers in ({}, {"Authorization": "Bearer wrong"}):
                r = requests.request(method, router.url + path, json=body, headers=headers, timeout=30)
                assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key", (path, headers, r.text)
                assert r.headers["WWW-Authenticate"] == "Bearer"
        assert requests.get(router.url + "/health", timeout=10).status_code == 200
        assert requests.get(router.url + "/metrics", timeout=10).status_code == 200
        for key in ("k1", "k2"):
            c = OpenAI(base_url=router.url + "/v1", api_key=key, max_retries=0, timeout=60 * SLOWDOWN)
            assert c.models.list().data[0].id == MODEL_NAME
            assert c.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3).usage.completion_tokens == 3
            c.close()
    finally:
        stop_all(router, a)


def test_a_backend_serving_another_model_is_left_out():
    """A Gemma 3 instance behind a SmolLM2 router answered half the requests with a 404 (a user
    test): the health check reads the model a backend serves and leaves such a backend out, with
    a line in the log."""
    a = g = router = None
    try:
        a = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        g = Server("--debug", model=os.path.join(os.path.dirname(MODEL), "gemma-3-270m-Q4_K_M.gguf"), max_model_len=MAX_LEN, kv_memory="64MiB")
        router = Router("--replica", a.url, "--replica", g.url, max_model_len=MAX_LEN)
        while [b["up"] for b in requests.get(router.url + "/health", timeout=10).json()["backends"]] != [True, False]:
            time.sleep(0.05)
        for i in range(6):
            text, _, _ = complete(router.url, f"Request {i}: the capital of France is", max_tokens=2)
            assert text
        assert "serves model 'gemma-3-270m-Q4_K_M', not 'SmolLM2-135M-Instruct.Q4_1'" in router.output()
    finally:
        stop_all(router, a, g)


def test_a_draining_replica_sends_new_requests_to_the_other():
    """A replica told to stop (SIGINT) drains: it finishes what it runs and answers new requests
    503. The router passed that 503 to the client while the other replica was up, until its
    next health check (a rolling restart cost clients errors; found by a user test). Now a 503
    sends the request to the other replica, as a 429 does, streamed or not."""
    a = b = router = r = None
    try:
        a = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        b = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        # Health checks too rare to notice the drain: the requests below meet it themselves.
        router = Router("--replica", a.url, "--replica", b.url, max_model_len=MAX_LEN, health_interval=60)
        shared = "The quick brown fox jumps over the lazy dog. " * 12
        r = requests.post(router.url + "/v1/completions", stream=True, timeout=120, json={
            "model": MODEL_NAME, "prompt": shared + "first", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True})
        lines = r.iter_lines()
        next(lines)  # running: its replica now owns the shared prefix and drains slowly
        owner, other = (a, b) if a.metrics()["kvserve:num_requests_running"] == 1 else (b, a)
        owner.proc.send_signal(signal.SIGINT)
        deadline = time.time() + 10
        while requests.get(owner.url + "/health", timeout=5).status_code != 503:
            assert time.time() < deadline, "the replica did not start draining"
            time.sleep(0.05)
        before = succeeded(other.metrics())
        for stream in (True, False):
            q = requests.post(router.url + "/v1/completions", timeout=60, json={
                "model": MODEL_NAME, "prompt": shared + "second", "max_tokens": 4, "temperature": 0, "stream": stream})
            assert q.status_code == 200, q.text[:300]
            if stream:
                assert q.text.rstrip().endswith("data: [DONE]"), q.text[-300:]
        assert succeeded(other.metrics()) == before + 2
        assert router.metrics()["kvserve:router_retries_total"] >= 1
    finally:
        if r is not None:
            r.close()
        stop_all(router, a, b)


def test_no_decode_instance_up_is_a_503_without_loading_the_prefill_instance(redis):
    """With its decode instance down, the router still sent each long prompt to the prefill
    instance, which computed it for nothing, then answered 503 (found by a user test)."""
    pre = dec = router = None
    try:
        pre = role_server("prefill", redis)
        dec = role_server("decode", redis)
        router = Router("--prefill", pre.url, "--decode", dec.url, max_model_len=MAX_LEN)
        dec.stop()
        deadline = time.time() + 10
        while any(x["up"] for x in requests.get(router.url + "/health", timeout=5).json()["backends"] if x["role"] != "prefill"):
            assert time.time() < deadline, "the router did not see the decode instance go"
            time.sleep(0.05)
        r = requests.post(router.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": doc(0), "max_tokens": 4}, timeout=60)
        assert r.status_code == 503, r.text[:300]
        m = router.metrics()
        assert m['kvserve:router_prefills_total{result="ok"}'] == 0 and m['kvserve:router_prefills_total{result="failed"}'] == 0, m
        assert succeeded(pre.metrics()) == 0
    finally:
        stop_all(router, dec, pre)


def test_a_draining_only_replicas_503_keeps_its_retry_after():
    """With no other replica, a draining backend's 503 reaches the client with the backend's own
    Retry-After (the server says 5 s while it drains). Streamed requests got 1 instead (the
    router wrote its own; found by a user test)."""
    a = router = r = None
    try:
        a = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        router = Router("--replica", a.url, max_model_len=MAX_LEN, health_interval=60)
        r = requests.post(router.url + "/v1/completions", stream=True, timeout=120, json={
            "model": MODEL_NAME, "prompt": "Count:", "max_tokens": 1500, "ignore_eos": True, "temperature": 0, "stream": True})
        lines = r.iter_lines()
        next(lines)  # running: the replica drains slowly
        a.proc.send_signal(signal.SIGINT)
        deadline = time.time() + 10
        while requests.get(a.url + "/health", timeout=5).status_code != 503:
            assert time.time() < deadline, "the replica did not start draining"
            time.sleep(0.05)
        q = requests.post(router.url + "/v1/completions", timeout=60, json={
            "model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "stream": True})
        assert q.status_code == 503, q.text[:300]
        assert q.headers.get("Retry-After") == "5", (q.headers, q.text)
        assert q.json()["error"]["code"] == "server_shutting_down", q.text[:300]
        # The router now knows the replica drains: its own 503, with a Retry-After too.
        q = requests.post(router.url + "/v1/completions", timeout=60, json={"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4})
        assert q.status_code == 503 and q.headers.get("Retry-After"), (q.headers, q.text)
    finally:
        if r is not None:
            r.close()
        stop_all(router, a)


def test_the_router_streams_to_a_kept_alive_connection_without_waiting_for_acks():
    """The router's own server sends small writes at once too (see test_openai_api's kept-alive
    test): through it, a kept-alive connection's first token is as early as a new one's."""
    a = router = None
    try:
        a = Server("--debug", max_model_len=MAX_LEN, kv_memory="64MiB")
        router = Router("--replica", a.url, max_model_len=MAX_LEN)
        assert_kept_alive_as_quick_as_new(lambda http, k: first_token_ms(http, router.url, k))
        a.wait_clean(timeout=30)
    finally:
        stop_all(router, a)


def test_router_answers_bad_requests_and_503_without_backends():
    router = Router("--replica", f"http://127.0.0.1:{free_port()}", max_model_len=MAX_LEN, wait_up=False)
    try:
        r = requests.post(router.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = requests.post(router.url + "/v1/chat/completions", data=b"{not json", headers={"Content-Type": "application/json"})
        assert r.status_code == 400 and "error" in r.json()
        r = requests.post(router.url + "/v1/completions", json={"model": "other", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = requests.post(router.url + "/v1/completions", json={"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["code"] == "service_unavailable"
        assert r.headers.get("Retry-After") == "1"
        assert requests.get(router.url + "/health").status_code == 503
        assert requests.get(router.url + "/v1/models").json()["data"][0]["id"] == MODEL_NAME
        assert requests.get(router.url + "/nope").status_code == 404
        # The server's answers for a model by id and a wrong method (the router had no
        # /v1/models/{id}, and answered GET /v1/completions 404; found by a user test).
        card = requests.get(router.url + "/v1/models/" + MODEL_NAME)
        assert card.status_code == 200 and card.json()["id"] == MODEL_NAME and card.json()["object"] == "model"
        r = requests.get(router.url + "/v1/models/gpt-4")
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        r = requests.get(router.url + "/v1/completions")
        assert r.status_code == 405 and r.json()["error"]["code"] == "method_not_allowed" and r.headers["Allow"] == "POST"
        # /tokenize and /detokenize are answered by the router itself (it has the tokenizer and
        # the chat template; they were 404). The ids are those the oracle tokenizer gives, and
        # they come back as the text, special tokens written out.
        sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "reference"))
        import tokenizer_ref  # the HuggingFace `tokenizers` oracle built from the same GGUF
        text = "Rivers of Europe: the Danube, the Rhine."
        t = requests.post(router.url + "/tokenize", json={"prompt": text})
        assert t.status_code == 200 and t.json()["count"] == len(t.json()["tokens"]) > 0, t.text
        assert t.json()["tokens"] == tokenizer_ref.load_tokenizer(MODEL).encode(text).ids
        d = requests.post(router.url + "/detokenize", json={"tokens": t.json()["tokens"]})
        assert d.status_code == 200 and d.json()["prompt"] == text, d.text
        chat_ids = requests.post(router.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
        assert "<|im_start|>" in requests.post(router.url + "/detokenize", json={"tokens": chat_ids}).json()["prompt"]
        assert requests.get(router.url + "/tokenize").status_code == 405
        # A chunked body is held to --max-body-size as a Content-Length is (it was read whole).
        big = (b" " * (1 << 20) if i else b'{"prompt": "hi"' for i in range(12))
        r = requests.post(router.url + "/v1/completions", data=big, headers={"Content-Type": "application/json"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "payload_too_large"
    finally:
        router.stop()
    r = subprocess.run([KVSERVE, "router", "-m", MODEL, "--listen", f"127.0.0.1:{free_port()}"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode != 0 and "--replica" in r.stderr


def test_the_router_warns_of_a_max_model_len_past_the_training_context_as_the_backends_do():
    """It validates requests against --max-model-len like the backends, and said nothing when that
    was past the model's training context (8,192 positions for SmolLM2); now once, unless
    --past-trained-context."""
    warning = "--max-model-len 16384 is past the model's training context (8192 tokens"
    for flags, warned in [((), 1), (("--past-trained-context",), 0)]:
        router = Router("--replica", f"http://127.0.0.1:{free_port()}", *flags, max_model_len=16384, wait_up=False)
        try:
            assert requests.get(router.url + "/v1/models").json()["data"][0]["max_model_len"] == 16384
            assert router.output().count(warning) == warned, router.output()
        finally:
            router.stop()


def test_a_decode_instance_of_another_kv_format_never_takes_the_pages(redis):
    """Pages carry the model fingerprint and KV format in their keys and headers: an int8 decode
    instance finds nothing of an f16 prefill instance's and computes the prompt itself, with the
    output of an int8 instance alone."""
    p = doc(30000, 2500)
    solo = Server("--debug", "--kv-cache-dtype", "int8", max_model_len=MAX_LEN, kv_memory="64MiB")
    try:
        expected = complete(solo.url, p)[0]
    finally:
        solo.stop()
    pre = dec = router = None
    try:
        pre = role_server("prefill", redis)
        dec = role_server("decode", redis, "--kv-cache-dtype", "int8")
        router = Router("--prefill", pre.url, "--decode", dec.url, max_model_len=MAX_LEN)
        text, n_prompt, cached = complete(router.url, p)
        assert text == expected
        assert cached == 0 and n_prompt > 500
        assert router.metrics()['kvserve:router_prefills_total{result="ok"}'] == 1
        assert dec.metrics().get('kvserve:kv_tier_hits_total{tier="redis"}', 0) == 0
        dec.wait_clean()
    finally:
        stop_all(router, dec, pre)
