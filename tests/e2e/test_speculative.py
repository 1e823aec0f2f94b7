"""Speculative decoding through the real server and the `openai` client (docs/speculative.md).

The shared server has no --speculative-config: each request turns it on with its own
"speculative" object (or off with false). Greedy and seeded output must not change, the
kvserve:spec_decode_* counters must move, every page must come back (the autouse fixture), and
a bad configuration is a 400 naming the field.
"""
from __future__ import annotations

import pytest
import requests

from kvserve_server import MODEL_NAME

LINE = "the quick brown fox jumps over the lazy dog"
REPEAT = [{"role": "user", "content": f"Repeat this line five times, one per line:\n{LINE}\n{LINE}\n"}]
CODE = [{"role": "user", "content": "Copy this code exactly:\n\ndef add(a, b):\n    return a + b\n\n"
                                    "def sub(a, b):\n    return a - b\n\ndef mul(a, b):\n    return a * b\n"}]
NGRAM = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
SUFFIX = {"method": "suffix", "num_speculative_tokens": 6}


def spec_counts(server) -> tuple[float, float]:
    m = server.metrics()
    return m.get("kvserve:spec_decode_num_draft_tokens_total", 0), m.get("kvserve:spec_decode_num_accepted_tokens_total", 0)


@pytest.mark.parametrize("spec", [NGRAM, SUFFIX], ids=["ngram", "suffix"])
@pytest.mark.parametrize("messages", [REPEAT, CODE], ids=["repeat", "code"])
def test_greedy_output_is_unchanged_and_drafts_are_accepted(server, client, spec, messages):
    plain = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=60, temperature=0,
                                           extra_body={"speculative": False})
    d0, a0 = spec_counts(server)
    fast = client.chat.completions.create(model=MODEL_NAME, messages=messages, max_tokens=60, temperature=0,
                                          extra_body={"speculative": spec})
    d1, a1 = spec_counts(server)
    assert fast.choices[0].message.content == plain.choices[0].message.content
    assert fast.choices[0].finish_reason == plain.choices[0].finish_reason
    assert fast.usage.completion_tokens == plain.usage.completion_tokens
    assert d1 > d0, "no draft was verified"
    assert a1 > a0, "no draft token was accepted on a prompt that repeats itself"
    assert a1 - a0 <= d1 - d0


def test_seeded_sampling_streams_the_same_text(client):
    def run(spec):
        chunks = client.chat.completions.create(model=MODEL_NAME, messages=REPEAT, max_tokens=48, temperature=0.8,
                                                top_p=0.95, seed=1234, stream=True, extra_body={"speculative": spec})
        return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert run(NGRAM) == run(False)


def test_stop_string_and_max_tokens_inside_a_draft(client):
    plain = client.chat.completions.create(model=MODEL_NAME, messages=REPEAT, max_tokens=40, temperature=0,
                                           extra_body={"speculative": False}).choices[0].message.content
    assert "\n" in plain.strip()
    stop_out = client.chat.completions.create(model=MODEL_NAME, messages=REPEAT, max_tokens=40, temperature=0,
                                              stop=["lazy"], extra_body={"speculative": NGRAM})
    assert stop_out.choices[0].finish_reason == "stop"
    assert stop_out.choices[0].message.content == plain[:plain.index("lazy")]
    for n in (1, 3, 7, 13):
        r = client.chat.completions.create(model=MODEL_NAME, messages=REPEAT, max_tokens=n, temperature=0,
                                           extra_body={"speculative": NGRAM})
        assert r.usage.completion_tokens <= n
        assert plain.startswith(r.choices[0].message.content)


def test_n_greater_than_one(client):
    r = client.chat.completions.create(model=MODEL_NAME, messages=CODE, max_tokens=30, temperature=0, n=3,
                                       extra_body={"speculative": NGRAM})
    texts = {c.message.content for c in r.choices}
    assert len(r.choices) == 3 and len(texts) == 1  # greedy: every choice the same


def test_a_lookup_max_alone_sets_the_min_as_vllm_does(server):
    # vLLM takes {"prompt_lookup_max": 1} alone (its min follows); this was a 400 (default min 2 > max 1).
    r = requests.post(server.url + "/v1/chat/completions", timeout=60,
                      json={"model": MODEL_NAME, "messages": REPEAT, "max_tokens": 8, "temperature": 0,
                            "speculative": {"method": "ngram", "prompt_lookup_max": 1}})
    assert r.status_code == 200, r.text
    plain = requests.post(server.url + "/v1/chat/completions", timeout=60,
                          json={"model": MODEL_NAME, "messages": REPEAT, "max_tokens": 8, "temperature": 0})
    assert r.json()["choices"][0]["message"]["content"] == plain.json()["choices"][0]["message"]["content"]


@pytest.mark.parametrize("spec,param", [
    ({"method": "eagle"}, "speculative.method"),
    ({"num_speculative_tokens": 99}, "speculative.num_speculative_tokens"),
    ({"prompt_lookup_min": 5, "prompt_lookup_max": 3}, "speculative"),
    ({"draft_model": "x"}, "speculative"),
    ({"num_speculative_tokens": 3}, "speculative"),  # no method: vLLM refuses it; this silently meant ngram
    ("yes", "speculative"),
])
def test_bad_configuration_is_a_400_naming_the_field(server, spec, param):
    r = requests.post(server.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL_NAME, "messages": REPEAT, "max_tokens": 4, "speculative": spec})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"
