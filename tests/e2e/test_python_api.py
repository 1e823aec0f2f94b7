"""The Python API (python/kvserve, vLLM's LLM / SamplingParams) against independent oracles:
the numpy reference's greedy continuations (tests/data/golden), HuggingFace `tokenizers` for
prompt ids, and the real server (same seed, same text; same error messages) through `openai`.

Imports the package `make build` puts in build/python (the module is built by CMake from the
same library as the server); `pip install .` builds the same package (docs/python.md).
"""
from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time

import pytest

from kvserve_server import MAX_MODEL_LEN, MAX_N, MODEL, ROOT

sys.path.insert(0, os.path.join(ROOT, "build", "python"))
kvserve = pytest.importorskip("kvserve", reason="build/python/kvserve missing: make build (needs pybind11)")
from kvserve import LLM, RequestError, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=8)


@pytest.fixture(scope="module")
def llm():
    # The server fixture's limits (tests/e2e/conftest.py), so both refuse the same things.
    m = LLM(MODEL, kv_cache_memory="48MiB", max_num_seqs=32, max_num_batched_tokens=256,
            max_model_len=MAX_MODEL_LEN, max_n=MAX_N, quiet=True)
    yield m
    m.close()


@pytest.fixture(autouse=True)
def pages_back(request):
    yield
    if "llm" in request.fixturenames:
        m = request.getfixturevalue("llm")
        assert m.kv_stats()["pages_in_use"] == 0
        m.check_integrity()


def golden():
    with open(os.path.join(ROOT, "tests/data/golden/golden.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("spec", [None, {"method": "ngram", "num_speculative_tokens": 4, "max_batch_tokens": 0}],
                         ids=["plain", "speculative"])
def test_greedy_matches_the_numpy_oracle(spec):
    # Token ids in, token ids out: every golden prompt, one call, up to the first near-tie of
    # the oracle's top two (where float64 and the engine's rounding may pick differently).
    # With speculative decoding (drafts verified in the batch) the same tokens.
    g = golden()
    prompts = [{"prompt_token_ids": p["tokens"]} for p in g["prompts"]]
    with LLM(MODEL, kv_cache_memory="64MiB", max_model_len=1024, quiet=True, speculative_config=spec) as big:
        outs = big.generate(prompts, SamplingParams(temperature=0, max_tokens=g["n_greedy"], ignore_eos=True), use_tqdm=False)
        assert big.kv_stats()["pages_in_use"] == 0
    compared = 0
    for p, o in zip(g["prompts"], outs):
        assert o.prompt_token_ids == p["tokens"]
        n = next((i for i, m in enumerate(p["greedy_top2_margin"]) if m < 0.02), len(p["greedy"]))
        assert o.outputs[0].token_ids[:n] == p["greedy"][:n], p["name"]
        compared += n
    assert compared >= 100


def test_prompt_ids_match_huggingface_tokenizers(llm):
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import tokenizer_ref
    tok = tokenizer_ref.load_tokenizer(MODEL)
    texts = ["Hello, world!", "  two  spaces\tand a tab", "naïve café 12345 ünïcödé", "def f(x):\n    return x**2"]
    outs = llm.generate(texts, SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    for t, o in zip(texts, outs):
        assert o.prompt == t
        assert o.prompt_token_ids == tok.encode(t).ids
    assert llm.get_tokenizer().encode(texts[0]) == tok.encode(texts[0]).ids
    # decode keeps special tokens unless asked, as HuggingFace's (vLLM's get_tokenizer()).
    ids = tok.encode("<|im_start|>user\nHi there<|im_end|>").ids
    assert llm.get_tokenizer().decode(ids) == tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>" in llm.get_tokenizer().decode(ids)
    assert llm.get_tokenizer().decode(ids, skip_special_tokens=True) == tok.decode(ids, skip_special_tokens=True)


def test_output_shape_like_vllm(llm):
    sp = SamplingParams(temperature=0.8, seed=5, max_tokens=12, logprobs=3, n=2)
    (o,) = llm.generate(["Once upon a time"], sp, use_tqdm=False)
    assert o.finished and o.request_id and len(o.outputs) == 2
    for i, c in enumerate(o.outputs):
        assert c.index == i and c.finish_reason in ("stop", "length")
        assert len(c.logprobs) == len(c.token_ids) > 0
        assert c.cumulative_logprob == pytest.approx(sum(next(iter(e.values())).logprob for e in c.logprobs), abs=1e-4)
        for tid, e in zip(c.token_ids, c.logprobs):
            assert next(iter(e)) == tid  # the chosen token first
            ranked = sorted((lp for lp in e.values() if lp.rank is not None), key=lambda lp: lp.rank)
            assert len(ranked) == 3 and all(a.logprob >= b.logprob for a, b in zip(ranked, ranked[1:]))
        assert c.text == llm.get_tokenizer().decode(c.token_ids, skip_special_tokens=True)
    # Without logprobs: none, as vLLM.
    (o,) = llm.generate("Once upon a time", SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert o.outputs[0].logprobs is None and o.outputs[0].cumulative_logprob is None
    assert o.outputs[0].finish_reason == "length" and o.outputs[0].stop_reason is None


def test_stop_strings_and_stop_reason(llm):
    (o,) = llm.generate("Count: one, two, three,", SamplingParams(temperature=0, max_tokens=32, stop=[" five", " six"]),
                        use_tqdm=False)
    c = o.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == " five"
    assert " five" not in c.text and c.text.startswith(" four")


def test_stop_token_ids_end_a_choice_as_vllm_does(llm, server):
    # vLLM's stop_token_ids: the choice ends at the first of them, finish "stop", stop_reason the id;
    # the stop token's text is left out unless include_stop_str_in_output (vLLM's detokenizer skips
    # the token that stopped the choice; it was kept here, found by a black-box test); ignore_eos
    # does not stop them.
    prompt = "Count: one, two, three,"
    (full,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    ids = full.outputs[0].token_ids
    t = ids[4]
    k = ids.index(t)
    (o,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t, 10]), use_tqdm=False)
    c = o.outputs[0]
    assert c.token_ids == ids[:k + 1] and c.finish_reason == "stop" and c.stop_reason == t
    assert llm._decode([t]) and c.text == llm._decode(ids[:k]) and full.outputs[0].text.startswith(c.text)
    (o,) = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=[t, 10], include_stop_str_in_output=True),
                        use_tqdm=False)
    assert o.outputs[0].text == llm._decode(ids[:k + 1]) and o.outputs[0].stop_reason == t
    # the server gives the same, streamed or not, with vLLM's stop_reason
    import requests
    for include in (False, True):
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "stop_token_ids": [t, 10], "include_stop_str_in_output": include}
        r = requests.post(server.url + "/v1/completions", timeout=60, json=body).json()
        want = llm._decode(ids[:k + 1] if include else ids[:k])
        assert r["choices"][0]["text"] == want and r["choices"][0]["finish_reason"] == "stop", r
        assert r["choices"][0]["stop_reason"] == t, r
        s = requests.post(server.url + "/v1/completions", timeout=60, json={**body, "stream": True}, stream=True)
        events = [json.loads(line[6:]) for line in s.iter_lines(decode_unicode=True) if line.startswith("data: {")]
        assert "".join(ch["text"] for e in events for ch in e["choices"]) == want
        assert [ch["stop_reason"] for e in events for ch in e["choices"] if ch.get("finish_reason")] == [t]
    # a control token, past ignore_eos: ends the choice, and its text is not in the output
    chat = [{"role": "user", "content": "Say hi."}]
    im_end = llm._engine.tokenize("<|im_end|>", False)
    assert len(im_end) == 1
    (o,) = llm.chat(chat, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True, stop_token_ids=im_end), use_tqdm=False)
    c = o.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == im_end[0] and c.token_ids[-1] == im_end[0]
    assert "<|im_end|>" not in c.text and len(c.token_ids) < 64


def test_min_tokens_as_vllm_and_as_the_server(llm, client):
    # vLLM's SamplingParams.min_tokens: no end of text and no stop string before that many tokens;
    # the same text as the server's min_tokens.
    msgs = [{"role": "user", "content": "Say OK."}]
    (free,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    f = free.outputs[0]
    assert f.finish_reason == "stop" and llm._engine.is_eog(f.token_ids[-1]) and len(f.token_ids) < 20
    for stop in (None, ["."]):
        (o,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=48, min_tokens=20, stop=stop), use_tqdm=False)
        c = o.outputs[0]
        assert len(c.token_ids) >= 20 and not any(llm._engine.is_eog(t) for t in c.token_ids[:20])
        if stop is None:
            assert c.text.startswith(f.text) and c.text != f.text
        else:
            assert len(c.text) > f.text.find(".")  # the "." in the first 20 tokens did not end it
        r = client.chat.completions.create(model=server_model(client), messages=msgs, temperature=0, max_tokens=48, stop=stop,
                                           extra_body={"min_tokens": 20})
        assert r.choices[0].message.content == c.text and r.choices[0].finish_reason == c.finish_reason
    # Bad values: the server's messages.
    for sp, word in [(SamplingParams(min_tokens=-1), "below the minimum of 0"),
                     (SamplingParams(max_tokens=4, min_tokens=5), "5 is more than max_tokens (4)"),
                     (SamplingParams(min_tokens=1.5), "expected an integer")]:
        with pytest.raises(RequestError, match="min_tokens") as ei:
            llm.generate("hello", sp, use_tqdm=False)
        assert word in str(ei.value) and ei.value.param == "min_tokens"


def test_prefix_cache_hit_is_reported(llm):
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    llm.generate(prompt, GREEDY, use_tqdm=False)
    (o,) = llm.generate(prompt, GREEDY, use_tqdm=False)
    assert o.num_cached_tokens >= 64


def test_chat_applies_the_template(llm):
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    (o,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
    assert "<|im_start|>user\nWhat is 2+2?<|im_end|>" in o.prompt and o.prompt.endswith("<|im_start|>assistant\n")
    assert o.outputs[0].text.strip()
    outs = llm.chat([msgs, msgs[1:]], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(outs) == 2 and outs[0].prompt != outs[1].prompt


def test_chat_template_per_call_and_per_engine(llm):
    # vLLM's LLM.chat(chat_template=...): this call's template (a built-in name here), rendered as
    # transformers renders it (templates/chatml.jinja), instead of SmolLM2's own (default system prompt).
    from transformers.utils.chat_template_utils import render_jinja_template
    msgs = [{"role": "user", "content": "What is 2+2?"}]
    with open(os.path.join(ROOT, "templates", "chatml.jinja"), encoding="utf-8") as f:
        want, _ = render_jinja_template(conversations=[msgs], chat_template=f.read(), add_generation_prompt=True)
    (o,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, chat_template="chatml")
    assert o.prompt == want[0] == "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    (own,) = llm.chat(msgs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
    assert own.prompt != o.prompt  # the next call is back on the model's template
    with pytest.raises(RequestError, match="not a built-in template"):
        llm.chat(msgs, chat_template="nope", use_tqdm=False)
    # Per engine (the server's --chat-template); a bad one fails before the weights load.
    with LLM(MODEL, chat_template="chatml", kv_cache_memory="16MiB", quiet=True) as other:
        (o2,) = other.chat(msgs, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
        assert o2.prompt == want[0] and o2.outputs[0].token_ids == o.outputs[0].token_ids
    with pytest.raises(ValueError, match="chat_template nope: no such file, and not a built-in template"):
        LLM(MODEL, chat_template="nope", quiet=True)


def test_tokenizer_apply_chat_template_renders_as_transformers(llm):
    # As transformers' tokenizer.apply_chat_template (vLLM's get_tokenizer() is one): SmolLM2's own
    # template from the GGUF rendered by transformers' Jinja renderer, tokenized by HF tokenizers.
    from gguf import GGUFReader
    from transformers.utils.chat_template_utils import render_jinja_template
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import tokenizer_ref
    hf = tokenizer_ref.load_tokenizer(MODEL)
    field = GGUFReader(MODEL).fields["tokenizer.chat_template"]
    source = bytes(field.parts[field.data[0]]).decode("utf-8")
    tok = llm.get_tokenizer()
    tools = [{"type": "function", "function": {"name": "get_time", "description": "Current time",
                                               "parameters": {"type": "object", "properties": {}}}}]
    convs = [[{"role": "user", "content": "Hi there"}],
             [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "naïve café?"},
              {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "<|im_end|> typed"}]]
    for gen in (False, True):
        want, _ = render_jinja_template(conversations=convs, chat_template=source, add_generation_prompt=gen)
        assert tok.apply_chat_template(convs, tokenize=False, add_generation_prompt=gen) == want
        assert tok.apply_chat_template(convs[1], add_generation_prompt=gen) == hf.encode(want[1], add_special_tokens=False).ids
    # tools and extra keyword arguments are the template's variables, as LLM.chat's chat_template_kwargs
    t = "{% for m in messages %}[{{ m['role'] }}|{{ flavour }}|{{ tools | length if tools else 0 }}]{{ m['content'] }}{% endfor %}"
    want, _ = render_jinja_template(conversations=[convs[0]], chat_template=t, tools=tools, flavour="mint")
    assert tok.apply_chat_template(convs[0], tools, chat_template=t, tokenize=False, flavour="mint") == want[0]
    (o,) = llm.chat(convs[0], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False, chat_template=t,
                    chat_template_kwargs={"flavour": "mint"})
    assert o.prompt == "[user|mint|0]Hi there"
    assert o.prompt_token_ids == tok.apply_chat_template(convs[0], chat_template=t, flavour="mint")
    with pytest.raises(TypeError, match="return_tensors"):
        tok.apply_chat_template(convs[0], return_tensors="np")
    with pytest.raises(RequestError, match="'bos_token' is set by the server"):
        tok.apply_chat_template(convs[0], bos_token="<x>")


def test_same_seed_same_text_as_the_server(llm, server, client):
    # The server and the Python API parse the same request the same way; with a seed, sampling
    # is reproducible, so text and token counts agree exactly.
    cases = [
        dict(prompt="The three most important ideas in computer science are", temperature=0.9, top_p=0.95, seed=11, max_tokens=24, n=2),
        dict(prompt="Once upon a time", temperature=1.2, top_k=40, seed=3, max_tokens=20, presence_penalty=0.5),
        dict(prompt="def fib(n):", temperature=0.7, min_p=0.1, seed=99, max_tokens=24, stop=["\n\n"]),
    ]
    for case in cases:
        std = {k: v for k, v in case.items() if k not in ("top_k", "min_p")}
        extra = {k: v for k, v in case.items() if k in ("top_k", "min_p")}  # vLLM's fields, beyond OpenAI's
        r = client.completions.create(model=server_model(client), extra_body=extra, **std)
        sp = SamplingParams(**{k: v for k, v in case.items() if k != "prompt"})
        (o,) = llm.generate(case["prompt"], sp, use_tqdm=False)
        assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == [c.text for c in o.outputs]
        assert [c.finish_reason for c in sorted(r.choices, key=lambda c: c.index)] == [c.finish_reason for c in o.outputs]
        assert r.usage.completion_tokens == sum(len(c.token_ids) for c in o.outputs)
    msgs = [{"role": "user", "content": "Write a haiku about caches."}]
    r = client.chat.completions.create(model=server_model(client), messages=msgs, temperature=0.8, seed=21, max_tokens=30)
    (o,) = llm.chat(msgs, SamplingParams(temperature=0.8, seed=21, max_tokens=30), use_tqdm=False)
    assert r.choices[0].message.content == o.outputs[0].text


def server_model(client) -> str:
    return client.models.list().data[0].id


def test_errors_carry_the_servers_messages(llm, server):
    import requests
    bad = [
        ({"temperature": 5}, SamplingParams(temperature=5)),
        ({"n": 99}, SamplingParams(n=99)),
        ({"kv_eviction": {"policy": "lru"}}, SamplingParams(kv_eviction={"policy": "lru"})),
        ({"max_tokens": 100}, SamplingParams(max_tokens=100)),  # with the long prompt: over max_model_len
    ]
    long_prompt = "word " * (MAX_MODEL_LEN - 50)
    for fields, sp in bad:
        prompt = long_prompt if "max_tokens" in fields else "hello"
        body = {"model": server_model_http(server), "prompt": prompt, **fields}
        r = requests.post(server.url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 400, r.text
        want = r.json()["error"]
        with pytest.raises(RequestError) as ei:
            llm.generate(["fine", prompt], [SamplingParams(max_tokens=2), sp], use_tqdm=False)
        e = ei.value
        assert str(e) == want["message"] and e.status == 400 and e.param == want["param"] and e.index == 1
    with pytest.raises(TypeError):
        LLM(MODEL, gpu_memory_utilization=0.9)
    # A seed beyond 64 bits: its digits, as the server shows them (it showed 1.8446744073709552e+19).
    r = requests.post(server.url + "/v1/completions", json={"prompt": "hello", "seed": 2**64}, timeout=30)
    with pytest.raises(RequestError) as ei:
        llm.generate("hello", SamplingParams(seed=2**64), use_tqdm=False)
    assert str(ei.value) == r.json()["error"]["message"] == \
        "Invalid value for 'seed': 18446744073709551616 is above the maximum of 9223372036854775807."


def test_empty_messages_are_refused_as_the_server_does(llm, server):
    # llm.chat([]) returned [] where the server answers 400 for "messages": [].
    import requests
    r = requests.post(server.url + "/v1/chat/completions", json={"model": server_model_http(server), "messages": []},
                      timeout=30)
    assert r.status_code == 400, r.text
    want = r.json()["error"]
    ok = [{"role": "user", "content": "hi"}]
    for messages, index in [([], 0), ([[]], 0), ([ok, []], 1)]:
        with pytest.raises(ValueError) as ei:
            llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False)
        e = ei.value
        assert isinstance(e, RequestError) and str(e) == want["message"], (messages, str(e))
        assert e.status == 400 and e.param == "messages" and e.code == want["code"] and e.index == index


def server_model_http(server) -> str:
    import requests
    return requests.get(server.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def test_a_bad_model_file_is_an_exception_not_a_crash(tmp_path):
    bad = tmp_path / "bad.gguf"
    with open(MODEL, "rb") as f:
        bad.write_bytes(f.read(200_000))
    with pytest.raises(ValueError):
        LLM(str(bad), quiet=True)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        LLM(MODEL, kv_cache_dtype="int3", quiet=True)
    with pytest.raises(ValueError):
        LLM(str(tmp_path / "missing.gguf"), quiet=True)
    for kw, word in [({"threads": -1}, r"threads must be in \[0, 256\]"), ({"threads": 1000}, "threads"),
                     ({"max_model_len": -5}, r"max_model_len must be in \[0, ")]:
        with pytest.raises(ValueError, match=word):
            LLM(MODEL, quiet=True, **kw)
    with pytest.raises(ValueError, match="must be more than 0"):
        LLM(MODEL, quiet=True, kv_cache_memory=0)
    # vLLM refuses a speculative_config that names no method (nor draft model); this silently meant ngram
    with pytest.raises(ValueError, match="'method' is required"):
        LLM(MODEL, quiet=True, speculative_config={"num_speculative_tokens": 3})


def test_arguments_of_the_wrong_type_are_a_type_error(llm):
    # They were accepted (seed="x": random.Random takes strings), or failed somewhere else
    # (LLM(None): "None: cannot open"; sampling params as a dict: AttributeError '_body').
    with pytest.raises(TypeError, match="model is the path"):
        LLM(None, quiet=True)
    with pytest.raises(TypeError, match="seed is an int"):
        LLM(MODEL, seed="x", quiet=True)
    with pytest.raises(TypeError, match="sampling_params is a SamplingParams"):
        llm.generate(["a"], {"temperature": 0})
    with pytest.raises(TypeError, match="sampling_params is a SamplingParams"):
        llm.generate(["a"], [{"temperature": 0}])
    # a tuple of ids is a token-id prompt, as a list is
    ids = llm.generate([504, 3575, 282], GREEDY, use_tqdm=False)[0]
    assert llm.generate((504, 3575, 282), GREEDY, use_tqdm=False)[0].outputs[0].text == ids.outputs[0].text
    # The tokenizer says what it takes, not pybind11's signature dump (a black-box test)
    tok = llm.get_tokenizer()
    for call, word in [(lambda: tok.encode(5), "encode\\(\\) takes a str, not int"),
                       (lambda: tok.encode("x", add_special_tokens="no"), "add_special_tokens is a bool"),
                       (lambda: tok.decode("abc"), "takes a list of token ids, not str"),
                       (lambda: tok.decode([1.5]), "not a list holding float")]:
        with pytest.raises(TypeError, match=word) as ei:
            call()
        assert "incompatible function arguments" not in str(ei.value)
    with pytest.raises(ValueError, match=r"token id 1099511627776 is outside the vocabulary \[0, 49152\)"):
        tok.decode([2 ** 40])
    import numpy as np
    assert tok.decode(np.array([504, 3575])) == tok.decode([504, 3575]) and tok.decode(np.int64(504)) == tok.decode([504])


def test_max_tokens_none_fits_a_kv_cache_smaller_than_max_model_len():
    # As the server's chat default: a cache holding less than one max_model_len sequence gave
    # "needs 512 KV pages (8192 tokens) but the whole KV cache has 364" for every such call.
    small = LLM(MODEL, kv_cache_memory="12MiB", quiet=True)  # 8,192-token context, ~500 tokens of cache
    try:
        assert small._engine.max_model_len > small._engine.kv_capacity_tokens > 0
        out = small.chat([{"role": "user", "content": "Count from 1 to 5."}], SamplingParams(temperature=0, max_tokens=None),
                         use_tqdm=False)[0]
        assert out.outputs[0].finish_reason in ("stop", "length") and out.outputs[0].text
        long = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)
        got = small.generate("Once upon a time", long, use_tqdm=False)[0]
        assert got.outputs[0].finish_reason == "length"
        assert len(got.prompt_token_ids) + len(got.outputs[0].token_ids) == small._engine.kv_capacity_tokens
        small.check_integrity()
    finally:
        small.close()


def test_a_cache_too_small_says_why_in_the_arguments_words():
    # It said "kv_cache_memory 8MiB holds no page (one page is 123.75 KiB)": neither the 16 MiB given
    # nor the reason (the staging tiles of quantized pages), which the server says, in its flags' words.
    with pytest.raises(ValueError) as ei:
        LLM(MODEL, kv_cache_memory="16MiB", kv_cache_dtype="int4", max_model_len=128, quiet=True)
    msg = str(ei.value)
    assert "kv_cache_memory 16.00 MiB holds no page" in msg and "staging tiles" in msg and "max_num_seqs" in msg, msg
    assert "--" not in msg, msg


def test_a_value_json_cannot_carry_is_refused_where_it_is_set():
    # NaN and infinity have no JSON form: the error names the field when the parameters are built.
    for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
        for v in (float("nan"), float("inf"), -float("inf")):
            with pytest.raises(RequestError, match=f"'{name}'") as ei:
                SamplingParams(**{name: v})
            assert ei.value.param == name


def test_200_prompts_in_one_call_match_200_calls(llm):
    # Batch invariance: continuous batching of 200 requests (greedy and seeded sampling, other
    # lengths, shared prefixes) gives each the tokens it gets alone.
    words = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu".split()
    prompts, params = [], []
    for i in range(200):
        prompts.append(f"Item {i}: " + " ".join(words[(i * 7 + j) % len(words)] for j in range(3 + i % 9)))
        if i % 2:
            params.append(SamplingParams(temperature=0, max_tokens=3 + i % 4))
        else:
            params.append(SamplingParams(temperature=0.9, top_p=0.9, seed=i, max_tokens=3 + i % 4))
    together = llm.generate(prompts, params, use_tqdm=False)
    alone = [llm.generate(p, sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    for a, b in zip(together, alone):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text


def test_the_gil_is_released_while_the_engine_runs(llm):
    ticks = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    t = threading.Thread(target=spin)
    t.start()
    t0 = time.monotonic()
    # At least 0.5 s of engine work on any host (one call took 0.19 s on a fast one).
    while time.monotonic() - t0 < 0.5:
        llm.generate(["Tell me a story"] * 4, SamplingParams(temperature=0, max_tokens=64, ignore_eos=True), use_tqdm=False)
    elapsed = time.monotonic() - t0
    stop.set()
    t.join()
    # A thread that needs the GIL every millisecond ran through the calls (held, it would not).
    assert elapsed > 0.2 and ticks[0] > 0.3 * elapsed / 0.0011


def test_ctrl_c_cancels_and_returns_every_page(llm):
    timer = threading.Timer(0.7, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        llm.generate(["A long story begins"] * 8, SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                     use_tqdm=False)
    assert time.monotonic() - t0 < 10  # cancelled, not run to max_tokens
    timer.join()
    assert llm.kv_stats()["pages_in_use"] == 0
    llm.check_integrity()
    (o,) = llm.generate("still works", GREEDY, use_tqdm=False)  # the engine keeps serving
    assert len(o.outputs[0].token_ids) == 8


def test_progress_bar_counts_every_prompt(llm, capsys):
    outs = llm.generate(["a", "b", "c"], SamplingParams(temperature=0, max_tokens=2), use_tqdm=True)
    assert len(outs) == 3
    assert "3/3" in capsys.readouterr().err


def test_a_progress_bar_that_raises_leaves_nothing_running(llm, monkeypatch):
    """A bar whose update raises (a broken stderr pipe, a wrapped bar, Ctrl-C inside it) left the
    call's requests decoding to max_tokens, holding their pages (a user test): now, as Ctrl-C,
    they are cancelled and their pages are back before the exception reaches the caller."""
    import tqdm.auto

    class Broken:
        def __init__(self, *a, **kw):
            pass

        def update(self, n):
            raise BrokenPipeError("stderr is gone")

        def close(self):
            pass

    monkeypatch.setattr(tqdm.auto, "tqdm", Broken)
    t0 = time.monotonic()
    with pytest.raises(BrokenPipeError):
        llm.generate(["A long story begins", "Once"] + ["A long story begins"] * 6,
                     [SamplingParams(temperature=0, max_tokens=1)] + [SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)] * 7)
    assert time.monotonic() - t0 < 10
    assert llm.kv_stats()["pages_in_use"] == 0  # at once: not after the others ran to 400 tokens


def test_exiting_with_a_generate_running_on_another_thread_exits_cleanly():
    """Python finalizing while a daemon thread waits in generate() aborted the process (SIGABRT,
    exit code 134, "terminate called without an active exception"; a user test): the exit code
    is the script's."""
    import subprocess
    script = (f"import sys, threading, time\nsys.path.insert(0, {os.path.join(ROOT, 'build', 'python')!r})\n"
              "from kvserve import LLM, SamplingParams\n"
              f"llm = LLM({MODEL!r}, threads=1, kv_cache_memory='32MiB', quiet=True)\n"
              "threading.Thread(target=lambda: llm.generate(['story'] * 2, SamplingParams(max_tokens=500, ignore_eos=True),"
              " use_tqdm=False), daemon=True).start()\n"
              "time.sleep(1)\n"
              "if len(sys.argv) > 1: raise SystemExit('main failed')\n")
    for args, code in (([], 0), (["fail"], 1)):
        r = subprocess.run([sys.executable, "-c", script, *args], capture_output=True, text=True, timeout=120)
        assert r.returncode == code and "terminate called" not in r.stderr, (r.returncode, r.stderr[-2000:])
    # the main thread closing an LLM while Python finalizes (a __del__) takes the GIL back: it is
    # the finalizing thread, and must not park
    closer = (f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'build', 'python')!r})\n"
              "from kvserve import LLM, SamplingParams\n"
              "class Holder:\n"
              f"    def __init__(self): self.llm = LLM({MODEL!r}, threads=1, kv_cache_memory='32MiB', quiet=True)\n"
              "    def __del__(self): self.llm.close(); print('closed')\n"
              "h = Holder()\n"
              "h.llm.generate('hi', SamplingParams(max_tokens=2), use_tqdm=False)\n")
    r = subprocess.run([sys.executable, "-c", closer], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "closed" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_a_forked_child_is_told_to_make_its_own_llm(llm):
    """A forked child has the engine's memory but not its threads: its call waited forever (a
    user test). It raises instead; the parent's LLM is unaffected."""
    pid = os.fork()
    if pid == 0:  # the child: a hang here would be caught by the alarm
        signal.alarm(20)
        try:
            llm.generate("x", GREEDY, use_tqdm=False)
            os._exit(4)
        except RuntimeError as e:
            os._exit(3 if "created in another process" in str(e) else 5)
        except BaseException:
            os._exit(6)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 3, status
    assert len(llm.generate("parent", GREEDY, use_tqdm=False)[0].outputs[0].token_ids) == 8


def test_max_tokens_none_counts_the_truncated_prompt_and_numpy_values_are_taken(llm):
    """max_tokens None left room for the whole prompt when truncate_prompt_tokens kept less of it
    (1 token generated for 100 kept of 400; a user test); NumPy ints and floats, as vLLM takes
    them, were a JSON error."""
    np = pytest.importorskip("numpy")
    (o,) = llm.generate("hello world " * 200, SamplingParams(temperature=0, max_tokens=None, truncate_prompt_tokens=100,
                                                              ignore_eos=True), use_tqdm=False)
    assert len(o.prompt_token_ids) == 100
    assert len(o.prompt_token_ids) + len(o.outputs[0].token_ids) == min(MAX_MODEL_LEN, llm._engine.kv_capacity_tokens)
    ids = llm.get_tokenizer().encode("The capital of France is")
    (a,) = llm.generate({"prompt_token_ids": np.array(ids, dtype=np.int64)},
                        SamplingParams(temperature=np.float32(0.0), max_tokens=np.int64(4), seed=np.int64(1)), use_tqdm=False)
    (b,) = llm.generate({"prompt_token_ids": ids}, SamplingParams(temperature=0.0, max_tokens=4, seed=1), use_tqdm=False)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids and len(a.outputs[0].token_ids) == 4


def test_an_evicting_policy_goes_past_max_model_len(llm):
    # StreamingLLM re-indexing (docs/eviction.md): 700 tokens from a 512-position engine.
    sp = SamplingParams(temperature=0, max_tokens=700, ignore_eos=True, kv_eviction={"policy": "sinks", "budget": 128})
    out = llm.generate(["Once upon a time"], sp, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 700 and out.outputs[0].finish_reason == "length"
    assert out.kv_tokens_reindexed > 0 and out.kv_tokens_kept <= 128
    with pytest.raises(ValueError, match="maximum context length"):  # without a policy the limit holds
        llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=700), use_tqdm=False)


def test_close_while_another_thread_generates():
    # close() used to free the engine under a running generate(): that thread hung forever and
    # the interpreter aborted at exit. Now the running call's requests are cancelled and it raises.
    m = LLM(MODEL, kv_cache_memory="48MiB", quiet=True)
    outcome = {}

    def work():
        try:
            m.generate(["x"] * 2, SamplingParams(max_tokens=2000, ignore_eos=True), use_tqdm=False)
            outcome["result"] = "finished"
        except RuntimeError as e:
            outcome["result"] = str(e)

    t = threading.Thread(target=work)
    t.start()
    time.sleep(1.0)
    m.close()
    t.join(30)
    assert not t.is_alive()
    assert outcome["result"] == "this LLM was closed while generate() ran"
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        m.generate("x", use_tqdm=False)


def test_close_while_another_thread_checks_integrity():
    # check_integrity() walks the pool without the GIL: a close() on another thread freed the
    # engine under it (only generate() calls were waited for). A use after free seldom crashes
    # without ASan (this module is not built with it): this checks the outcome, not the memory.
    outcome = {}
    started = threading.Event()

    def work():
        try:
            while True:
                m.check_integrity()
                started.set()
        except RuntimeError as e:
            outcome["result"] = str(e)

    for _ in range(4):
        m = LLM(MODEL, kv_cache_memory="48MiB", quiet=True)
        m.generate(["x " * 300] * 4, SamplingParams(max_tokens=4), use_tqdm=False)
        started.clear()
        t = threading.Thread(target=work)
        t.start()
        started.wait(30)
        m.close()
        t.join(30)
        assert not t.is_alive()
        assert outcome.pop("result") == "this LLM was closed"


def test_close_from_a_signal_handler_inside_generate():
    # The handler runs on the thread that is inside generate(): close() cannot wait for that call
    # (it hung forever); the call ends its requests, raises, and frees the engine itself.
    m = LLM(MODEL, kv_cache_memory="256MiB", quiet=True)
    old = signal.signal(signal.SIGALRM, lambda *a: m.close())
    try:
        signal.setitimer(signal.ITIMER_REAL, 1.0)
        with pytest.raises(RuntimeError, match="this LLM was closed while generate"):
            m.generate(["x"] * 2, SamplingParams(max_tokens=3000, ignore_eos=True), use_tqdm=False)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, old)
    with pytest.raises(RuntimeError, match="this LLM was closed"):
        m.kv_stats()
    m.close()  # again: nothing left to do


def test_max_model_len_past_the_training_context_warns_once(capfd):
    # As `kvserve serve --max-model-len`: SmolLM2 was trained on 8,192 positions; past it, one warning
    # (quiet or not), unless past_trained_context=True says it is meant. Above serve's range: refused.
    with pytest.raises(ValueError, match=r"max_model_len must be in \[0, 16777216\].*got 100000000"):
        LLM(MODEL, max_model_len=10**8, quiet=True)
    capfd.readouterr()
    warning = "warning: max_model_len 16384 is past the model's training context (8192 tokens"
    for kw, warned in [({}, True), ({"past_trained_context": True}, False)]:
        with LLM(MODEL, max_model_len=16384, kv_cache_memory="48MiB", quiet=True, **kw) as m:
            assert m._engine.max_model_len == 16384
        assert capfd.readouterr().err.count(warning) == (1 if warned else 0)
    with LLM(MODEL, max_model_len=8192, kv_cache_memory="48MiB", quiet=True) as m:  # up to it: nothing said
        assert m._engine.max_model_len == 8192
    assert "training context" not in capfd.readouterr().err


def test_block_size_is_the_servers_range():
    # Python took block sizes up to 256; above the attention kernels' 64 a long prompt segfaulted.
    with pytest.raises(ValueError, match=r"block_size must be in \[1, 64\], got 128"):
        LLM(MODEL, block_size=128, quiet=True)


def test_structured_outputs_as_vllm_takes_them(llm, client):
    """vLLM's StructuredOutputsParams: every finished output satisfies its constraint (jsonschema,
    re), the same seed gives the server's text, and a bad regex is the server's 400 message."""
    import re

    import jsonschema
    from kvserve import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15}, "pop": {"type": "integer"}},
              "required": ["city", "pop"], "additionalProperties": False}
    sp = SamplingParams(temperature=1.0, seed=9, n=3, max_tokens=60,
                        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    out = llm.generate(["A city and its population as JSON:"], sp)[0].outputs
    for o in out:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), schema)
    assert sum(o.finish_reason == "stop" for o in out) >= 2
    server = client.completions.create(model=client.models.list().data[0].id, prompt="A city and its population as JSON:",
                                       temperature=1.0, seed=9, n=3, max_tokens=60,
                                       extra_body={"structured_outputs": {"json": schema, "disable_any_whitespace": True}})
    assert [c.text for c in server.choices] == [o.text for o in out]

    sp = SamplingParams(temperature=1.0, seed=2, n=4, max_tokens=8,
                        structured_outputs=StructuredOutputsParams(regex=r"[A-Z]{2}-[0-9]{3}"))
    for o in llm.generate(["Code:"], sp)[0].outputs:
        assert o.finish_reason == "stop" and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", o.text), o.text
    for o in llm.generate(["Pick:"], SamplingParams(temperature=1.0, seed=3, n=4, max_tokens=5,
                                                   structured_outputs=StructuredOutputsParams(choice=["up", "down"])))[0].outputs:
        assert o.text in ("up", "down")
    with pytest.raises(RequestError, match="parenthesis"):
        llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs=StructuredOutputsParams(regex="((")))
    with pytest.raises(TypeError, match="StructuredOutputsParams"):
        llm.generate(["x"], SamplingParams(max_tokens=2, structured_outputs={"regex": "a"}))


def test_jump_forward_can_be_turned_off_and_changes_nothing(llm):
    """jump_forward_tokens (serve's --jump-forward-tokens): 0 turns it off, and the outputs of a
    constrained request are the same either way (text and logprobs, seeded sampling); a value
    outside serve's range is a ValueError before the weights load."""
    from kvserve import StructuredOutputsParams

    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15}, "population": {"type": "integer"}},
              "required": ["city", "population"], "additionalProperties": False}
    sp = SamplingParams(temperature=1.0, seed=4, n=2, max_tokens=60, logprobs=2,
                        structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True))
    off = LLM(MODEL, kv_cache_memory="48MiB", max_model_len=MAX_MODEL_LEN, quiet=True, jump_forward_tokens=0)
    try:
        a = llm.generate(["A city and its population as JSON:"], sp)[0].outputs
        b = off.generate(["A city and its population as JSON:"], sp)[0].outputs
    finally:
        off.close()
    assert [(o.text, o.token_ids, o.finish_reason) for o in a] == [(o.text, o.token_ids, o.finish_reason) for o in b]
    assert [o.logprobs for o in a] == [o.logprobs for o in b]
    with pytest.raises(ValueError, match="jump_forward_tokens"):
        LLM(MODEL, quiet=True, jump_forward_tokens=300)


def test_logit_bias_as_vllm_takes_it(llm):
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import tokenizer_ref
    cat = tokenizer_ref.load_tokenizer(MODEL).token_to_id("Ġcat")
    out = llm.generate(["The capital of France is"], SamplingParams(temperature=1.0, seed=1, max_tokens=4,
                                                                   logit_bias={cat: 100}))[0].outputs[0]
    assert out.token_ids == [cat] * 4
    with pytest.raises(RequestError, match="outside"):
        llm.generate(["x"], SamplingParams(max_tokens=1, logit_bias={cat: 500}))


def test_prompt_logprobs_are_the_servers(llm, server):
    """SamplingParams(prompt_logprobs=k) gives RequestOutput.prompt_logprobs in vLLM's shape
    ([None, {token id: Logprob}], the prompt token first with its rank), the server's numbers."""
    import json
    import requests
    golden = json.load(open(os.path.join(ROOT, "tests", "data", "golden", "golden.json"), encoding="utf-8"))
    g = next(p for p in golden["prompts"] if p["name"] == "numbers_primes")
    out = llm.generate([{"prompt_token_ids": g["tokens"]}], SamplingParams(max_tokens=0, prompt_logprobs=2))[0]
    assert out.outputs[0].token_ids == [] and out.outputs[0].finish_reason == "length"
    plp = out.prompt_logprobs
    assert len(plp) == g["n_tokens"] and plp[0] is None
    srv = requests.post(server.url + "/v1/completions", json={"prompt": g["tokens"], "max_tokens": 0, "prompt_logprobs": 2},
                        timeout=60).json()["choices"][0]["prompt_logprobs"]
    for mine, theirs, tok in zip(plp[1:], srv[1:], g["tokens"][1:]):
        assert next(iter(mine)) == tok
        assert {k: (v.logprob, v.rank) for k, v in mine.items()} == {int(k): (v["logprob"], v["rank"]) for k, v in theirs.items()}
    # without it: None, as before
    assert llm.generate(["Hi"], GREEDY)[0].prompt_logprobs is None


def test_chat_takes_tools_as_vllm(llm, client):
    """vLLM's LLM.chat(tools=...): the tools go to the template (SmolLM2's ignores them) and the
    output is the generated text; a named tool_choice (a kvserve extra) constrains that text to
    the tool's schema, as the server does: the same seed gives the server's call arguments."""
    import jsonschema
    from kvserve import StructuredOutputsParams

    params = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 15}}, "required": ["city"],
              "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": params}}]
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    plain = llm.chat(msgs, GREEDY, tools=tools, use_tqdm=False)[0].outputs[0].text
    assert plain == llm.chat(msgs, GREEDY, use_tqdm=False)[0].outputs[0].text
    named = {"type": "function", "function": {"name": "get_weather"}}
    sp = SamplingParams(temperature=1.0, seed=6, n=3, max_tokens=40,
                        structured_outputs=StructuredOutputsParams(disable_any_whitespace=True))
    outs = llm.chat(msgs, sp, tools=tools, tool_choice=named, use_tqdm=False)[0].outputs
    for o in outs:
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), params)
    assert sum(o.finish_reason == "stop" for o in outs) >= 2
    server = client.chat.completions.create(model=client.models.list().data[0].id, messages=msgs, tools=tools, tool_choice=named,
                                            temperature=1.0, seed=6, n=3, max_tokens=40,
                                            extra_body={"structured_outputs": {"disable_any_whitespace": True}})
    assert [c.message.tool_calls[0].function.arguments for c in server.choices] == [o.text for o in outs]
    with pytest.raises(RequestError, match="--enable-auto-tool-choice"):
        llm.chat(msgs, GREEDY, tools=tools, tool_choice="auto", use_tqdm=False)
