"""vLLM's include_stop_str_in_output and truncate_prompt_tokens, through the `openai` client.

The oracle for each is the same server's answer to the request that means the same without the
field: the text up to the stop string, with the stop string appended; the greedy answer to the
prompt's last k tokens sent as the prompt (HuggingFace `tokenizers` gives the ids).
"""
from __future__ import annotations

import os
import sys

import pytest
import requests

from kvserve_server import MODEL, MODEL_NAME, ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import tokenizer_ref  # noqa: E402

PROMPT = "The list of colours in the rainbow is"


def test_include_stop_str_in_output(client):
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0).choices[0].text
    words = free.split()
    assert len(words) >= 4
    stop = " " + words[2]  # a word inside the answer, spanning tokens or not
    at = free.index(stop)
    kw = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop, "never-there"])
    plain = client.completions.create(**kw).choices[0]
    assert plain.text == free[:at] and plain.finish_reason == "stop"
    incl = client.completions.create(extra_body={"include_stop_str_in_output": True}, **kw).choices[0]
    assert incl.text == free[:at + len(stop)] and incl.finish_reason == "stop"
    streamed = "".join(c.choices[0].text for c in client.completions.create(stream=True, extra_body={"include_stop_str_in_output": True},
                                                                            **kw) if c.choices)
    assert streamed == incl.text
    # two stops at the same place: the longer one is the one kept
    two = client.completions.create(extra_body={"include_stop_str_in_output": True},
                                    **{**kw, "stop": [stop[:2], stop]}).choices[0]
    assert two.text == free[:at + len(stop)]


def test_stop_reason_says_what_stopped_the_choice_as_vllm(client):
    """vLLM's stop_reason on every choice: the stop string matched, the stop token's id, or null
    (end of text, length); in a stream, on the chunk that finishes the choice. It was missing."""
    free = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0).choices[0]
    stop = " " + free.text.split()[2]
    for api in ("completions", "chat"):
        def ask(**kw):
            if api == "chat":
                return client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": PROMPT}],
                                                      temperature=0, **kw)
            return client.completions.create(model=MODEL_NAME, prompt=PROMPT, temperature=0, **kw)
        text = lambda c: c.message.content if api == "chat" else c.text  # noqa: E731
        answer = text(ask(max_tokens=24).choices[0])
        word = " " + answer.split()[1] if api == "chat" else stop
        c = ask(max_tokens=24, stop=[word, "never-there"]).choices[0]
        assert c.finish_reason == "stop" and c.model_extra["stop_reason"] == word, c
        c = ask(max_tokens=3).choices[0]
        assert c.finish_reason == "length" and c.model_extra["stop_reason"] is None, c
        chunks = [ch for ch in ask(max_tokens=24, stop=[word], stream=True) if ch.choices]
        ends = [ch.choices[0] for ch in chunks if ch.choices[0].finish_reason]
        assert len(ends) == 1 and ends[0].model_extra["stop_reason"] == word, ends
    c = client.chat.completions.create(model=MODEL_NAME, messages=[{"role": "user", "content": "Say hi."}], max_tokens=64,
                                       temperature=0).choices[0]
    assert c.finish_reason == "stop" and c.model_extra["stop_reason"] is None  # the end of text: null, as vLLM


def test_truncate_prompt_tokens_keeps_the_last_tokens(client, server):
    tok = tokenizer_ref.load_tokenizer(MODEL)
    ids = tok.encode("Once upon a time, in a small village by the sea, there lived an old fisherman who").ids
    assert len(ids) > 12
    short = client.completions.create(model=MODEL_NAME, prompt=ids[-8:], max_tokens=8, temperature=0)
    cut = client.completions.create(model=MODEL_NAME, prompt=ids, max_tokens=8, temperature=0, echo=True,
                                    extra_body={"truncate_prompt_tokens": 8})
    assert cut.usage.prompt_tokens == 8
    assert cut.choices[0].text == tok.decode(ids[-8:]) + short.choices[0].text
    # chat: the rendered conversation's last tokens
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hello there, how are you?"}],
                                                                 "max_tokens": 2, "truncate_prompt_tokens": 5}, timeout=30).json()
    assert r["usage"]["prompt_tokens"] == 5
    # -1: at most max_model_len (512) tokens of a longer prompt
    long_ids = (ids * 60)[:600]
    r = requests.post(server.url + "/v1/completions", json={"prompt": long_ids, "max_tokens": 0, "echo": True,
                                                            "truncate_prompt_tokens": -1}, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == 512
    # a prompt already shorter is left as it is
    same = client.completions.create(model=MODEL_NAME, prompt=ids[-8:], max_tokens=8, temperature=0, extra_body={"truncate_prompt_tokens": 100})
    assert same.choices[0].text == short.choices[0].text and same.usage.prompt_tokens == 8


def test_python_api_include_stop_str_and_truncation(server):
    sys.path.insert(0, os.path.join(ROOT, "build", "python"))
    kvserve = pytest.importorskip("kvserve")
    llm = kvserve.LLM(MODEL, kv_cache_memory="16MiB", max_model_len=512, quiet=True)
    try:
        free = llm.generate([PROMPT], kvserve.SamplingParams(temperature=0, max_tokens=24))[0].outputs[0].text
        stop = " " + free.split()[2]
        o = llm.generate([PROMPT], kvserve.SamplingParams(temperature=0, max_tokens=24, stop=[stop],
                                                          include_stop_str_in_output=True))[0].outputs[0]
        assert o.text == free[:free.index(stop) + len(stop)] and o.stop_reason == stop
        out = llm.generate([PROMPT], kvserve.SamplingParams(temperature=0, max_tokens=4, truncate_prompt_tokens=3))[0]
        assert len(out.prompt_token_ids) == 3
    finally:
        llm.close()


def test_skip_special_tokens_false_writes_control_tokens_as_vllm(server):
    """vLLM's skip_special_tokens (it was refused): false puts control tokens' text in the output,
    spelled as HuggingFace's decode(skip_special_tokens=False) (the oracle); the default leaves
    them out. A forced control token (logit_bias) shows which."""
    tok = tokenizer_ref.load_tokenizer(MODEL)
    im_start = tok.token_to_id("<|im_start|>")
    body = {"prompt": "Hello", "max_tokens": 3, "temperature": 0, "logit_bias": {str(im_start): 100}, "logprobs": 0}
    for skip in (True, False):
        r = requests.post(server.url + "/v1/completions", json={**body, "skip_special_tokens": skip}, timeout=60).json()
        c = r["choices"][0]
        ids = [tok.token_to_id(t) if tok.token_to_id(t) is not None else None for t in c["logprobs"]["tokens"]]
        assert ids[0] == im_start, c
        assert c["text"] == tok.decode([im_start] * 3, skip_special_tokens=skip), (skip, c["text"])
        s = requests.post(server.url + "/v1/completions", json={**body, "skip_special_tokens": skip, "stream": True}, timeout=60, stream=True)
        streamed = "".join(ch["text"] for line in s.iter_lines(decode_unicode=True) if line.startswith("data: {")
                           for ch in __import__("json").loads(line[6:])["choices"])
        assert streamed == c["text"]
