"""OpenAI's batch form of /v1/completions (`prompt` a list of strings or of token-id lists),
through the official `openai` client and raw HTTP against the real server: each prompt is its
own engine request of n choices, choice i of prompt p is the response's choice p * n + i, usage
sums every prompt and choice, a stream interleaves the choices and ends with one usage chunk and
one [DONE], a bad prompt anywhere refuses the whole request before anything runs, and a client
that goes away cancels every one of its requests."""
from __future__ import annotations

import json
import socket
import time

import pytest
import requests

from kvserve_server import ABORTED_CLIENT, FINISHED, MAX_MODEL_LEN, MODEL_NAME, SLOWDOWN, Server

PROMPTS = ["The capital of France is", "Once upon a time, in a small village by the sea,", "def fib(n):", "1, 2, 3, 4,"]


def complete(client, prompt, **kw):
    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return client.completions.create(model=MODEL_NAME, prompt=prompt, **kw)


def test_a_batch_gives_each_prompt_its_answer_alone(server, client):
    alone = [complete(client, p) for p in PROMPTS]
    r = complete(client, PROMPTS)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.text for c in r.choices] == [a.choices[0].text for a in alone]
    assert [c.finish_reason for c in r.choices] == [a.choices[0].finish_reason for a in alone]
    assert r.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert r.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # Token-id lists: the same prompts, the same answers.
    ids = [requests.post(server.url + "/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS]
    by_ids = complete(client, ids)
    assert [c.text for c in by_ids.choices] == [c.text for c in r.choices]
    assert by_ids.usage.prompt_tokens == sum(len(t) for t in ids) == r.usage.prompt_tokens
    # A list of one prompt, of either kind, is one prompt as before.
    assert [c.text for c in complete(client, [PROMPTS[1]]).choices] == [alone[1].choices[0].text]
    assert [c.text for c in complete(client, [ids[1]]).choices] == [alone[1].choices[0].text]


def test_a_batch_logprobs_are_per_choice(client):
    alone = [complete(client, p, max_tokens=5, logprobs=2) for p in PROMPTS[:2]]
    r = complete(client, PROMPTS[:2], max_tokens=5, logprobs=2)
    for c, a in zip(r.choices, alone):
        lp, want = c.logprobs, a.choices[0].logprobs
        assert "".join(lp.tokens) == c.text
        assert lp.tokens == want.tokens and lp.text_offset == want.text_offset and lp.text_offset[0] == 0
        assert lp.token_logprobs == pytest.approx(want.token_logprobs, abs=1e-5)


def test_two_prompts_with_n2_give_four_choices_in_order(client):
    greedy = complete(client, PROMPTS[:2], n=2)
    assert [c.index for c in greedy.choices] == [0, 1, 2, 3]
    texts = [c.text for c in greedy.choices]
    assert texts[0] == texts[1] == complete(client, PROMPTS[0]).choices[0].text
    assert texts[2] == texts[3] == complete(client, PROMPTS[1]).choices[0].text
    assert greedy.usage.completion_tokens == 4 * 12
    # Sampled with a seed: prompt p's choices are those of the prompt sent alone with that seed.
    kw = dict(n=2, temperature=1.0, seed=7, max_tokens=10)
    batch = complete(client, PROMPTS[:2], **kw)
    alone = [complete(client, p, **kw) for p in PROMPTS[:2]]
    assert [c.text for c in batch.choices] == [c.text for a in alone for c in a.choices]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)


def test_a_streamed_batch_interleaves_choices_and_ends_once(server, client):
    want = complete(client, PROMPTS[:3], n=2)
    texts, finishes, usage = [""] * 6, [[] for _ in range(6)], []
    for ch in complete(client, PROMPTS[:3], n=2, stream=True, stream_options={"include_usage": True}):
        if ch.usage:
            assert ch.choices == []
            usage.append(ch.usage)
            continue
        assert len(ch.choices) == 1
        c = ch.choices[0]
        texts[c.index] += c.text
        if c.finish_reason:
            finishes[c.index].append(c.finish_reason)
    assert texts == [c.text for c in want.choices]
    assert finishes == [[c.finish_reason] for c in want.choices]
    assert len(usage) == 1
    assert usage[0].prompt_tokens == want.usage.prompt_tokens and usage[0].completion_tokens == want.usage.completion_tokens
    # On the wire: the choices' chunks interleave (the prompts run together) and one [DONE] ends it.
    body = {"model": MODEL_NAME, "prompt": PROMPTS[:3], "max_tokens": 12, "temperature": 0, "stream": True}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60 * SLOWDOWN)
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    order = [json.loads(e)["choices"][0]["index"] for e in events[:-1]]
    assert set(order) == {0, 1, 2}
    assert order != sorted(order), order  # not one prompt after the other


def test_a_bad_prompt_anywhere_refuses_the_batch_before_anything_runs(server, client):
    import openai
    before = server.metrics()
    too_long = "hello " * (MAX_MODEL_LEN + 10)
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, [PROMPTS[0], too_long, PROMPTS[1]], max_tokens=16)
    err = e.value.body
    assert err["param"] == "prompt" and "prompt[1]" in err["message"] and "maximum context length" in err["message"], err
    # A prompt whose completion would not fit either.
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, [PROMPTS[0], PROMPTS[1]], max_tokens=MAX_MODEL_LEN - 8)
    assert "prompt[1]" in e.value.body["message"]
    # Token ids outside the vocabulary: named by the parser.
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, [[1, 2], [3, 10**9]])
    assert "prompt[1]" in e.value.body["message"] and e.value.body["param"] == "prompt"
    # An empty prompt, and kinds mixed (OpenAI's schema has no such form).
    r = requests.post(server.url + "/v1/completions", json={"prompt": [[1, 2], []]})
    assert r.status_code == 400 and "prompt[1] is empty" in r.json()["error"]["message"]
    r = requests.post(server.url + "/v1/completions", json={"prompt": ["a", [1, 2]]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_type"
    after = server.metrics()
    for name in ("kvserve:prompt_tokens_total", "kvserve:generation_tokens_total", FINISHED.format("stop"), FINISHED.format("length"),
                 "kvserve:engine_steps_total"):
        assert after[name] == before[name], name  # nothing ran
    assert after["kvserve:kv_cache_pages_used"] == 0
    # More prompts than the server ever queues at once (--max-num-seqs 32 + --max-queue 128): a 400, not a 429.
    r = requests.post(server.url + "/v1/completions", json={"prompt": ["hi"] * 161, "max_tokens": 1})
    assert r.status_code == 400 and "161 prompts" in r.json()["error"]["message"], r.text
    assert server.metrics()["kvserve:engine_steps_total"] == before["kvserve:engine_steps_total"]


def _batch_body(stream: bool) -> bytes:
    return json.dumps({"model": MODEL_NAME, "prompt": PROMPTS[:3], "max_tokens": 400, "temperature": 0, "ignore_eos": True,
                       "stream": stream}).encode()


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_goes_away_cancels_every_prompt(server, stream):
    before = server.metrics()[ABORTED_CLIENT]
    body = _batch_body(stream)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    s = socket.create_connection(("127.0.0.1", server.port), timeout=30)
    try:
        s.sendall(head + body)
        if stream:
            data = b""
            while data.count(b"data: ") < 4:
                chunk = s.recv(4096)
                assert chunk, data
                data += chunk
            assert data.startswith(b"HTTP/1.1 200")
        else:
            t0, generated = time.time(), server.metrics()["kvserve:generation_tokens_total"]
            while server.metrics()["kvserve:generation_tokens_total"] < generated + 3:
                assert time.time() - t0 < 30 * SLOWDOWN
                time.sleep(0.02)
        assert server.metrics()["kvserve:num_requests_running"] == 3
        assert server.metrics()["kvserve:kv_cache_pages_used"] > 0
    finally:
        s.close()
    t0 = time.time()
    while True:
        m = server.metrics()
        if m["kvserve:kv_cache_pages_used"] == 0 and m[ABORTED_CLIENT] == before + 3:
            break
        assert time.time() - t0 < 5 * SLOWDOWN, m
        time.sleep(0.02)
    assert m["kvserve:num_requests_running"] == 0


def test_the_queue_counts_each_prompt_of_a_batch():
    # Two sequence slots and one queue place: a batch of 3 fits an idle server (two run, one
    # waits); then any further prompt finds the queue full (429), and a batch of 4 can never fit (400).
    s = Server("--debug", "--max-num-seqs", "2", "--max-queue", "1")
    try:
        url = s.url + "/v1/completions"
        r = requests.post(url, json={"prompt": ["a", "b", "c", "d"], "max_tokens": 1})
        assert r.status_code == 400 and "--max-num-seqs + --max-queue" in r.json()["error"]["message"], r.text
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(1) as ex:
            long = ex.submit(requests.post, url, json={"prompt": ["a", "b", "c"], "max_tokens": 200, "ignore_eos": True,
                                                       "temperature": 0}, timeout=120 * SLOWDOWN)
            t0 = time.time()
            while s.metrics()["kvserve:num_requests_waiting"] < 1:
                assert time.time() - t0 < 30 * SLOWDOWN and not long.done(), long.result().text if long.done() else ""
                time.sleep(0.01)
            r = requests.post(url, json={"prompt": ["x", "y"], "max_tokens": 1})
            assert r.status_code == 429 and r.headers["Retry-After"] == "1", r.text
            done = long.result()
        assert done.status_code == 200 and [c["index"] for c in done.json()["choices"]] == [0, 1, 2]
        assert done.json()["usage"]["completion_tokens"] == 600
        assert requests.post(url, json={"prompt": ["x", "y"], "max_tokens": 1}).status_code == 200
        s.wait_clean()
    finally:
        s.stop()
