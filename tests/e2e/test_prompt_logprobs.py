"""Completions' `echo` and vLLM's `prompt_logprobs`: the model's logprob of every prompt token.

What lm-eval-harness's loglikelihood tasks send (`echo: true, logprobs: 1, max_tokens: 1` over a
batch of token-id prompts) and what vLLM's `prompt_logprobs` returns. The oracle is the float64
numpy forward (tests/reference/llama_ref.py, gemma3_ref.py) through its golden files
(tests/data/golden/, made by tests/reference/make_golden*.py): per position the top 5
log-softmax values and the mean NLL of the prompt's tokens given their prefixes.

kvserve against the oracle, measured on these prompts (SmolLM2): a token's logprob within 0.0097,
the top 5 values within 0.018, the mean NLL within 0.0011. The bounds sit ~3x above; a prompt
read one position off, or logits taken from the wrong row, misses them by whole nats.
"""
from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest
import requests
from openai import BadRequestError, OpenAI

from kvserve_server import MODEL_NAME, ROOT, SLOWDOWN, Server

TOKEN_TOL = 0.03
TOP5_TOL = 0.05
MEAN_NLL_TOL = 0.005

GOLDEN = json.load(open(os.path.join(ROOT, "tests", "data", "golden", "golden.json"), encoding="utf-8"))
PROMPTS = {p["name"]: p for p in GOLDEN["prompts"]}


def check_against_oracle(golden: dict, token_logprobs: list, top_logprobs: list, k: int = 5) -> None:
    """token_logprobs / top_logprobs: the server's, one per prompt token (the first None), for
    logprobs=k (its top k values are compared with the oracle's)."""
    toks = golden["tokens"]
    assert len(token_logprobs) == len(toks) and token_logprobs[0] is None and top_logprobs[0] is None
    tl = np.asarray(token_logprobs[1:], dtype=float)
    assert abs(-tl.mean() - golden["mean_nll"]) <= MEAN_NLL_TOL, (golden["name"], -tl.mean(), golden["mean_nll"])
    for pos in range(len(toks) - 1):
        ids, lps = golden["top5_ids"][pos], golden["top5_logprobs"][pos]
        if toks[pos + 1] in ids:  # the oracle's value of this very token
            assert abs(tl[pos] - lps[ids.index(toks[pos + 1])]) <= TOKEN_TOL, (golden["name"], pos)
        top = sorted(top_logprobs[pos + 1].values(), reverse=True)[:k]
        assert np.max(np.abs(np.asarray(top) - np.asarray(lps[:k]))) <= TOP5_TOL, (golden["name"], pos, top, lps)


@pytest.mark.parametrize("name", ["prose_short", "code_python", "chat_multi_turn", "prose_long_512"])
def test_echoed_prompt_logprobs_match_the_oracle(client, server, name):
    g = PROMPTS[name]
    # prose_long_512 fills max_model_len (512): only max_tokens 0 fits, in two 256-token chunks
    max_tokens = 0 if g["n_tokens"] >= 512 else 1
    r = client.completions.create(model=MODEL_NAME, prompt=g["tokens"], max_tokens=max_tokens, echo=True, logprobs=5, temperature=0)
    c = r.choices[0]
    n = g["n_tokens"]
    assert c.logprobs.tokens.__len__() == n + max_tokens
    check_against_oracle(g, c.logprobs.token_logprobs[:n], c.logprobs.top_logprobs[:n])
    # The echoed text is the prompt's, then the completion's; offsets count characters.
    prompt_text = requests.post(server.url + "/detokenize", json={"tokens": g["tokens"]}, timeout=10).json()["prompt"]
    assert c.text.startswith(prompt_text) and c.logprobs.text_offset[0] == 0
    assert c.logprobs.text_offset[n - 1] == len(prompt_text) - len(c.logprobs.tokens[n - 1])
    assert r.usage.prompt_tokens == n and r.usage.completion_tokens == max_tokens
    assert c.finish_reason == "length"


def test_prompt_logprobs_in_vllms_shape_with_ranks(server):
    """vLLM's field: [null, {"id": {"logprob", "rank", "decoded_token"}}]: the prompt token with its
    rank among all tokens, and the top k ranked 1..k."""
    g = PROMPTS["code_python"]
    body = {"prompt": g["tokens"], "max_tokens": 0, "prompt_logprobs": 3}
    r = requests.post(server.url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    assert c["text"] == "" and c["logprobs"] is None  # no echo: the prompt is not in the text
    plp = c["prompt_logprobs"]
    assert len(plp) == g["n_tokens"] and plp[0] is None
    n_first = 0
    for pos in range(g["n_tokens"] - 1):
        tok = g["tokens"][pos + 1]
        e = {int(k): v for k, v in plp[pos + 1].items()}
        by_rank = sorted(e.items(), key=lambda kv: kv[1]["rank"])
        top = by_rank[:3]
        assert [v["rank"] for _, v in top] == [1, 2, 3]
        assert [v["logprob"] for _, v in top] == sorted((v["logprob"] for _, v in top), reverse=True)
        if tok not in dict(top):  # outside the top 3: a rank past them, a logprob below them
            assert len(e) == 4 and e[tok]["rank"] > 3 and e[tok]["logprob"] <= top[2][1]["logprob"]
            # the oracle agrees it is not the most likely token (allowing a near tie at the top)
            top5 = g["top5_logprobs"][pos]
            assert g["top1"][pos] != tok or top5[0] - top5[1] < 0.05
        else:
            assert len(e) == 3
        n_first += e[tok]["rank"] == 1
        if pos < 4:
            want = requests.post(server.url + "/detokenize", json={"tokens": [tok]}, timeout=10).json()["prompt"]
            assert e[tok]["decoded_token"] == want
    # the oracle's argmax is the prompt's next token as often as our rank 1 is (ties aside)
    assert abs(n_first - sum(g["top1"][p] == g["tokens"][p + 1] for p in range(g["n_tokens"] - 1))) <= 2


def test_a_cached_prompt_is_computed_again_for_its_logprobs(client, server):
    g = PROMPTS["code_c"]
    cold = client.completions.create(model=MODEL_NAME, prompt=g["tokens"], max_tokens=1, echo=True, logprobs=1, temperature=0)
    # the same prompt again: every full page is now in the prefix cache
    plain = client.completions.create(model=MODEL_NAME, prompt=g["tokens"], max_tokens=1, temperature=0)
    assert plain.usage.prompt_tokens_details.cached_tokens >= 192
    warm = client.completions.create(model=MODEL_NAME, prompt=g["tokens"], max_tokens=1, echo=True, logprobs=1, temperature=0)
    assert warm.usage.prompt_tokens_details.cached_tokens == 0  # its positions' logits were never cached
    assert warm.choices[0].logprobs.token_logprobs == cold.choices[0].logprobs.token_logprobs
    assert warm.choices[0].text == cold.choices[0].text
    check_against_oracle(g, warm.choices[0].logprobs.token_logprobs[:-1], warm.choices[0].logprobs.top_logprobs[:-1], k=1)


def lm_eval_loglikelihood(client, requests_):
    """lm-eval-harness's LocalCompletionsAPI for loglikelihood requests (tokenized_requests=True):
    the payload of its _create_payload(generate=False) and the parsing of its parse_logprobs."""
    prompts = [ctx + cont for ctx, cont in requests_]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, temperature=0, max_tokens=1, logprobs=1, seed=1234, echo=True)
    res = []
    for choice, (ctx, _) in zip(sorted(out.choices, key=lambda c: c.index), requests_):
        ctxlen = len(ctx)
        logprobs = sum(choice.logprobs.token_logprobs[ctxlen:-1])
        tops = choice.logprobs.top_logprobs[ctxlen:-1]
        is_greedy = all(tok == max(top.values()) for tok, top in zip(choice.logprobs.token_logprobs[ctxlen:-1], tops))
        res.append((logprobs, is_greedy))
    return res


def test_lm_eval_loglikelihood_requests(client):
    """Contexts with the greedy continuation (is_greedy) and with another one, in one batch; the
    sums equal the logprobs greedy decoding reported for the same tokens."""
    reqs, expected = [], []
    for name in ["prose_short", "numbers_primes", "prose_gettysburg"]:
        ctx = PROMPTS[name]["tokens"]
        gen = client.completions.create(model=MODEL_NAME, prompt=ctx, max_tokens=3, temperature=0, logprobs=1)
        text_ids = [PROMPTS[name]["greedy"][i] for i in range(3)]  # the oracle's greedy continuation
        reqs.append((ctx, text_ids))
        expected.append((sum(gen.choices[0].logprobs.token_logprobs), True))
        other = [text_ids[0], text_ids[1] + 1, text_ids[2]]  # not what greedy decoding writes
        reqs.append((ctx, other))
        expected.append((None, False))
    got = lm_eval_loglikelihood(client, reqs)
    for (lp, greedy), (want_lp, want_greedy) in zip(got, expected):
        assert greedy == want_greedy
        if want_lp is not None:
            assert lp == pytest.approx(want_lp, abs=2e-3)  # a prefill's logits against decode's
    assert got[1][0] < got[0][0]


def test_an_end_of_text_token_is_in_completions_logprobs(client):
    """lm-eval takes token_logprobs[ctxlen:-1] for the continuation: the last entry must be the
    drawn token even when it is the end of text (it was left out, and a yes/no continuation
    whose next token is <|im_end|> lost its own last token: -0.001 for a -4.7 answer)."""
    prompt = "<|im_start|>user\nIs the sky blue? Answer yes or no.<|im_end|>\n<|im_start|>assistant\nyes"
    r = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, echo=True, logprobs=1)
    c = r.choices[0]
    assert c.finish_reason == "stop" and r.usage.completion_tokens == 1
    n = r.usage.prompt_tokens
    assert len(c.logprobs.tokens) == n + 1 and c.logprobs.tokens[-1] == "<|im_end|>"
    assert c.text == prompt  # the end of text is not text
    alone = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, logprobs=1).choices[0]
    assert alone.logprobs.tokens == ["<|im_end|>"] and alone.logprobs.token_logprobs == c.logprobs.token_logprobs[-1:]
    streamed = [t for ch in client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0, logprobs=1, stream=True)
                if ch.choices and ch.choices[0].logprobs for t in ch.choices[0].logprobs.tokens]
    assert streamed == ["<|im_end|>"]


def test_streamed_echo_equals_the_whole_response(client):
    g = PROMPTS["chat_single"]
    kw = dict(model=MODEL_NAME, prompt=g["tokens"], max_tokens=6, echo=True, logprobs=2, temperature=0.8, seed=7, n=2)
    whole = client.completions.create(**kw)
    texts, tokens, lps = {}, {}, {}
    for ch in client.completions.create(stream=True, **kw):
        for c in ch.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.logprobs:
                tokens.setdefault(c.index, []).extend(c.logprobs.tokens)
                lps.setdefault(c.index, []).extend(c.logprobs.token_logprobs)
    for c in whole.choices:
        assert texts[c.index] == c.text
        assert tokens[c.index] == c.logprobs.tokens and lps[c.index] == c.logprobs.token_logprobs
        assert lps[c.index][0] is None


def test_echo_without_logprobs_and_the_prompt_alone(client, server):
    r = client.completions.create(model=MODEL_NAME, prompt="The capital of France is", max_tokens=0, echo=True)
    assert r.choices[0].text == "The capital of France is" and r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 0 and r.choices[0].logprobs is None
    # batch form, n=2: each prompt's choices echo it
    r = client.completions.create(model=MODEL_NAME, prompt=["Once upon", "In a hole"], max_tokens=2, echo=True, n=2, temperature=0)
    assert [c.text[:9] for c in r.choices] == ["Once upon", "Once upon", "In a hole", "In a hole"]
    stream = "".join(c.choices[0].text for c in client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=0,
                                                                               echo=True, stream=True) if c.choices)
    assert stream == "Hello"


def test_chat_prompt_logprobs(server):
    r = requests.post(server.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 0, "prompt_logprobs": 1}, timeout=30)
    assert r.status_code == 200, r.text
    j = r.json()
    plp = j["prompt_logprobs"]
    assert plp[0] is None and len(plp) == j["usage"]["prompt_tokens"]
    assert all(1 <= len(e) <= 2 for e in plp[1:])
    assert j["choices"][0]["message"]["content"] == ""


def test_bad_echo_and_prompt_logprobs_are_400s(server):
    url = server.url + "/v1/completions"
    for body, param in [({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
                        ({"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
                        ({"prompt": "x", "prompt_logprobs": "3"}, "prompt_logprobs"),
                        ({"prompt": "x", "echo": "yes"}, "echo"),
                        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
                        ({"prompt": "x", "max_tokens": -1, "echo": True}, "max_tokens")]:
        r = requests.post(url, json=body, timeout=10)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == param, (body, r.text)
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "echo": True}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "echo"
    # chat has no echo: its max_tokens 0 hint names prompt_logprobs alone
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "max_tokens": 0}, timeout=10)
    assert r.status_code == 400 and "0 only with prompt_logprobs" in r.json()["error"]["message"]


def test_prompt_logprobs_survive_preemption():
    """Eight prompts of 137-256 tokens at once in a cache of about four: sequences are preempted
    mid-prompt and recomputed; every prompt's logprobs still come whole, as its lone run's."""
    names = ["code_c", "csv_numbers", "chat_multi_turn", "code_python"] * 2
    s = Server("--debug", "--max-num-seqs", "8", "--max-num-batched-tokens", "64", kv_memory="20MiB")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120 * SLOWDOWN)
        kw = dict(model=MODEL_NAME, max_tokens=40, echo=True, logprobs=1, temperature=0)
        alone = {n: c.completions.create(prompt=PROMPTS[n]["tokens"], **kw) for n in set(names)}
        assert s.metrics()["kvserve:num_preemptions_total"] == 0
        results, errors = [None] * len(names), []

        def one(i):
            try:
                results[i] = c.completions.create(prompt=PROMPTS[names[i]]["tokens"], **kw)
            except Exception as e:  # noqa: BLE001
                errors.append(e)
        ts = [threading.Thread(target=one, args=(i,)) for i in range(len(names))]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        assert s.metrics()["kvserve:num_preemptions_total"] > 0
        for name, r in zip(names, results):
            g, lp = PROMPTS[name], r.choices[0].logprobs
            n = g["n_tokens"]
            assert len(lp.token_logprobs) == n + 40
            check_against_oracle(g, lp.token_logprobs[:n], lp.top_logprobs[:n], k=1)
            ref = alone[name].choices[0].logprobs.token_logprobs
            # batched with others, chunked differently: the same logits within the kernels' rounding
            assert np.max(np.abs(np.asarray(lp.token_logprobs[1:n]) - np.asarray(ref[1:n]))) < 2e-3
        s.wait_clean()
    finally:
        s.stop()


def test_router_passes_echo_through(server):
    from kvserve_server import Router
    rt = Router("--replica", server.url)
    try:
        r = requests.post(rt.url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 1, "echo": True,
                                                            "logprobs": 1, "temperature": 0}, timeout=60)
        assert r.status_code == 200, r.text
        c = r.json()["choices"][0]
        assert c["text"].startswith("The capital of France is") and c["logprobs"]["token_logprobs"][0] is None
        assert len(c["logprobs"]["tokens"]) == 6
    finally:
        rt.stop()


GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")


def test_gemma3_prompt_logprobs_match_its_oracle():
    """Gemma 3 (sliding-window layers, a 262,144-token vocabulary: 64 rows of prompt logits a
    step, so the 700-token prompt takes 11 steps, its window pages sliding out meanwhile)."""
    golden = json.load(open(os.path.join(ROOT, "tests", "data", "golden", "gemma3", "golden.json"), encoding="utf-8"))
    s = Server("--debug", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", model=GEMMA, max_model_len=1024, kv_memory="64MiB")
    try:
        for g in golden["prompts"]:
            if g["name"] not in ("numbers_primes", "chat_multi_turn", "long_700_window"):
                continue
            r = requests.post(s.url + "/v1/completions", json={"prompt": g["tokens"], "max_tokens": 1, "echo": True, "logprobs": 5,
                                                               "temperature": 0}, timeout=300 * SLOWDOWN)
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            n = g["n_tokens"]
            check_against_oracle(g, lp["token_logprobs"][:n], lp["top_logprobs"][:n])
            assert lp["tokens"][0] == "<bos>" and lp["text_offset"][:2] == [0, 5]  # the ids' text begins "<bos>"
        s.wait_clean()
    finally:
        s.stop()

