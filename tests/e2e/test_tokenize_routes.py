"""POST /tokenize and /detokenize (vLLM's and llama-server's shapes) against HuggingFace
`tokenizers` (the oracle built from the same GGUF) and the server's own chat prompts."""
from __future__ import annotations

import os
import sys

import requests

from kvserve_server import MODEL, MODEL_NAME, ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import tokenizer_ref  # noqa: E402

TEXTS = ["Hello, world!", "naïve café 12345 ünïcödé", "def f(x):\n    return x**2", "<|im_start|>user\nhi<|im_end|>"]


def test_tokenize_matches_huggingface_and_round_trips(server):
    tok = tokenizer_ref.load_tokenizer(MODEL)
    for t in TEXTS:
        r = requests.post(server.url + "/tokenize", json={"model": MODEL_NAME, "prompt": t}, timeout=10)
        assert r.status_code == 200, r.text
        j = r.json()
        assert j["tokens"] == tok.encode(t).ids and j["count"] == len(j["tokens"]) and j["max_model_len"] > 0
        # llama-server's field names give the same
        assert requests.post(server.url + "/tokenize", json={"content": t}, timeout=10).json()["tokens"] == j["tokens"]
        d = requests.post(server.url + "/detokenize", json={"tokens": j["tokens"]}, timeout=10).json()
        assert d["prompt"] == t and d["content"] == d["prompt"]  # special tokens kept, as vLLM and llama-server


def test_tokenize_returns_token_strings_as_huggingface(server):
    # vLLM's return_token_strs: convert_ids_to_tokens, the vocabulary's spelling ("Ġworld")
    tok = tokenizer_ref.load_tokenizer(MODEL)
    for t in TEXTS:
        j = requests.post(server.url + "/tokenize", json={"prompt": t, "return_token_strs": True}, timeout=10).json()
        assert j["token_strs"] == [tok.id_to_token(i) for i in tok.encode(t).ids], j
    assert "token_strs" not in requests.post(server.url + "/tokenize", json={"prompt": "x"}, timeout=10).json()


def test_detokenize_keeps_special_tokens_as_huggingface(server):
    """vLLM's /detokenize is tokenizer.decode(ids) (skip_special_tokens=False), llama-server's renders
    special pieces too: a chat prompt comes back with its <|im_start|> / <|im_end|> markers."""
    tok = tokenizer_ref.load_tokenizer(MODEL)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."},
            {"role": "assistant", "content": "The Nile."}, {"role": "user", "content": "Another?"}]
    ids = requests.post(server.url + "/tokenize", json={"messages": msgs}, timeout=10).json()["tokens"]
    ids = ids + [tok.token_to_id("<|endoftext|>")]  # and an end-of-generation id
    want = tok.decode(ids, skip_special_tokens=False)
    assert "<|im_start|>system\nBe brief.<|im_end|>" in want and want.endswith("<|endoftext|>")
    d = requests.post(server.url + "/detokenize", json={"tokens": ids}, timeout=10).json()
    assert d["prompt"] == want and d["content"] == want


def test_tokenize_messages_counts_what_chat_completions_prefills(server, client):
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a river."}]
    j = requests.post(server.url + "/tokenize", json={"messages": msgs}, timeout=10).json()
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=1, temperature=0)
    assert j["count"] == r.usage.prompt_tokens


def test_bad_tokenize_requests(server):
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "abc"}, "tokens"),
                              # two texts: which one's tokens would be a guess
                              ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
                              ("/tokenize", {"prompt": "a", "content": "b"}, "content"),
                              # what chat completions refuses, since it would change the prompt
                              ("/tokenize", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                             "add_generation_prompt": False, "continue_final_message": True}, "continue_final_message"),
                              # the template's tools are checked as chat's (tests/e2e/test_tool_calling.py renders them)
                              ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                                             "tools": [{"type": "function"}]}, "tools[0].function")]:
        r = requests.post(server.url + path, json=body, timeout=10)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param
    assert requests.post(server.url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=10).status_code == 404
    assert requests.get(server.url + "/tokenize", timeout=10).status_code == 405
