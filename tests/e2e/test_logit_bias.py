"""OpenAI's logit_bias: {"token id": bias in [-100, 100]} added to the logits before the draw.

Token ids come from HuggingFace `tokenizers` (the oracle); the unbiased request's own logprobs
say what a bias must change: a −100 on the greedy choice leaves the runner-up, +100 on any token
makes it every draw, and the logprobs stay the model's (vLLM's raw logprobs).
"""
from __future__ import annotations

import os
import sys

import pytest
import requests
from openai import BadRequestError

from kvserve_server import MODEL, MODEL_NAME, ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import tokenizer_ref  # noqa: E402

PROMPT = "The capital of France is"


def test_a_large_bias_makes_a_token_every_draw(client):
    tok = tokenizer_ref.load_tokenizer(MODEL)
    cat = tok.token_to_id("Ġcat")
    r = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=1.0, seed=1, n=2,
                                  logit_bias={str(cat): 100})
    for c in r.choices:
        assert c.text == " cat" * 6, c.text
    # chat: the same through the other endpoint, with an int key as the openai client sends it
    r = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       temperature=0, logit_bias={cat: 100})
    assert r.choices[0].message.content == " cat" * 4


def test_a_negative_bias_leaves_the_runner_up_and_the_logprobs_are_the_models(client):
    plain = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2)
    lp = plain.choices[0].logprobs
    best, second = list(lp.top_logprobs[0].items())
    tok = tokenizer_ref.load_tokenizer(MODEL)
    best_id = tok.encode(PROMPT + best[0]).ids[len(tok.encode(PROMPT).ids):]
    assert len(best_id) == 1
    biased = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=2,
                                       logit_bias={str(best_id[0]): -100})
    c = biased.choices[0]
    assert c.text == second[0]
    assert c.logprobs.token_logprobs[0] == pytest.approx(second[1], abs=1e-5)  # the model's, not the biased row's
    assert c.logprobs.top_logprobs[0] == plain.choices[0].logprobs.top_logprobs[0]


def test_bad_biases_are_400s(server):
    for bias, needle in [({"abc": 1}, "not a token id"), ({"-1": 1}, "outside the vocabulary"),
                         ({"99999999": 1}, "outside the vocabulary"), ({"5": 101}, "outside [-100, 100]"),
                         ({"5": "x"}, "a number"), ([5], "an object")]:
        r = requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": bias}, timeout=10)
        assert r.status_code == 400, (bias, r.text)
        err = r.json()["error"]
        assert err["param"] == "logit_bias" and needle in err["message"], (bias, err)
    assert requests.post(server.url + "/v1/completions", json={"prompt": "x", "max_tokens": 1, "logit_bias": {}},
                         timeout=10).status_code == 200


def test_router_validates_and_passes_it_on(server):
    from kvserve_server import Router
    r = Router("--replica", server.url)
    try:
        tok = tokenizer_ref.load_tokenizer(MODEL)
        cat = tok.token_to_id("Ġcat")
        j = requests.post(r.url + "/v1/completions", json={"prompt": PROMPT, "max_tokens": 3, "temperature": 0,
                                                           "logit_bias": {str(cat): 100}}, timeout=30).json()
        assert j["choices"][0]["text"] == " cat" * 3
        assert requests.post(r.url + "/v1/completions", json={"prompt": "x", "logit_bias": {"x": 1}},
                             timeout=30).status_code == 400
    finally:
        r.stop()


def test_openai_client_error_type(client):
    with pytest.raises(BadRequestError, match="logit_bias"):
        client.completions.create(model=MODEL_NAME, prompt="x", max_tokens=1, logit_bias={"5": 200})
