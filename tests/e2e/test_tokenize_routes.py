"""POST /tokenize and /detokenize (vLLM's and llama-server's shapes) against HuggingFace
`tokenizers` (the oracle built from the same GGUF) and the server's own chat prompts."""
from __future__ import annotations

import os
import sys

import requests

from kvserve_server import MODEL, MODEL_NAME, ROOT, Server

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


def test_llama_server_tokenize_options_and_add_special_tokens(server):
    """llama-server's /tokenize options (found ignored by a black-box test): parse_special (false:
    "<|im_end|>" typed is text), with_pieces ([{"id", "piece"}], bytes when not UTF-8 alone), and
    add_special (its default false: no BOS); vLLM's add_special_tokens on /v1/completions too.
    Oracles: HuggingFace tokenizers (encode_special_tokens for parse_special false), and Gemma 3's
    transformers tokenizer for the BOS."""
    tok = tokenizer_ref.load_tokenizer(MODEL)
    text = "Hi<|im_end|> é😀"
    t = lambda **kw: requests.post(server.url + "/tokenize", json={"content": text, **kw}, timeout=10).json()  # noqa: E731
    assert t()["tokens"] == tok.encode(text).ids
    tok.encode_special_tokens = True
    assert t(parse_special=False)["tokens"] == tok.encode(text).ids and tok.token_to_id("<|im_end|>") not in t(parse_special=False)["tokens"]
    tok.encode_special_tokens = False
    pieces = t(with_pieces=True)["tokens"]
    assert [p["id"] for p in pieces] == tok.encode(text).ids
    got = b"".join(p["piece"].encode() if isinstance(p["piece"], str) else bytes(p["piece"]) for p in pieces)
    assert got == text.encode() and any(isinstance(p["piece"], list) for p in pieces)  # the emoji's bytes split across tokens

    sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizer"))
    import oracle_gemma
    gemma_tok = oracle_gemma.build_transformers(os.path.join(ROOT, "models"))
    g = Server(model=os.path.join(ROOT, "models", oracle_gemma.GGUF_NAME), max_model_len=512, kv_memory="32MiB")
    try:
        with_bos, without = gemma_tok.encode("Hi there").ids, gemma_tok.encode("Hi there", add_special_tokens=False).ids
        assert with_bos == [2] + without
        tk = lambda body: requests.post(g.url + "/tokenize", json=body, timeout=10).json()["tokens"]  # noqa: E731
        assert tk({"content": "Hi there"}) == without and tk({"content": "Hi there", "add_special": True}) == with_bos
        assert tk({"prompt": "Hi there"}) == with_bos and tk({"prompt": "Hi there", "add_special_tokens": False}) == without
        usage = lambda **kw: requests.post(g.url + "/v1/completions", json={"prompt": "Hi there", "max_tokens": 1, **kw},  # noqa: E731
                                           timeout=60).json()["usage"]["prompt_tokens"]
        assert usage() == len(with_bos) and usage(add_special_tokens=False) == len(without)  # the flag was ignored here
    finally:
        g.stop()


def test_bad_tokenize_requests(server):
    for path, body, param in [("/tokenize", {}, "prompt"), ("/tokenize", {"prompt": 3}, "prompt"),
                              ("/detokenize", {}, "tokens"), ("/detokenize", {"tokens": [1, 10**9]}, "tokens"),
                              ("/detokenize", {"tokens": [-1]}, "tokens"), ("/detokenize", {"tokens": "abc"}, "tokens"),
                              # two texts: which one's tokens would be a guess
                              ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "messages"),
                              ("/tokenize", {"prompt": "a", "content": "b"}, "content"),
                              # what chat completions refuses, since it would change the prompt
                              ("/tokenize", {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                                             "add_generation_prompt": True, "continue_final_message": True}, "continue_final_message"),
                              # the template's tools are checked as chat's (tests/e2e/test_tool_calling.py renders them)
                              ("/tokenize", {"messages": [{"role": "user", "content": "a"}],
                                             "tools": [{"type": "function"}]}, "tools[0].function")]:
        r = requests.post(server.url + path, json=body, timeout=10)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param
    assert requests.post(server.url + "/tokenize", json={"model": "nope", "prompt": "x"}, timeout=10).status_code == 404
    assert requests.get(server.url + "/tokenize", timeout=10).status_code == 405


def test_continue_final_message_leaves_the_last_turn_open_as_transformers(server, client):
    """vLLM's continue_final_message (it was refused here): the prompt ends inside the last message,
    as transformers' apply_chat_template(continue_final_message=True) renders it (the oracle, on
    SmolLM2's own template from the GGUF), and the model goes on with that message."""
    from gguf import GGUFReader
    from transformers.utils.chat_template_utils import render_jinja_template
    field = GGUFReader(MODEL).fields["tokenizer.chat_template"]
    source = bytes(field.parts[field.data[0]]).decode("utf-8")
    tok = tokenizer_ref.load_tokenizer(MODEL)
    for last in ("The capital of France is", "  Paris,  ", [{"type": "text", "text": "Yes."}, {"type": "text", "text": "The capital is"}]):
        msgs = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": last}]
        # parts reach a string-content template joined by "\n", as vLLM passes them (the oracle takes the string)
        joined = last if isinstance(last, str) else "\n".join(p["text"] for p in last)
        want, _ = render_jinja_template(conversations=[[msgs[0], {**msgs[1], "content": joined}]], chat_template=source,
                                        continue_final_message=True)
        j = requests.post(server.url + "/tokenize", json={"messages": msgs, "continue_final_message": True,
                                                            "add_generation_prompt": False}, timeout=10).json()
        assert j["tokens"] == tok.encode(want[0]).ids, (last, want[0], tok.decode(j["tokens"]))
        assert not want[0].rstrip().endswith("<|im_end|>")
    msgs = [{"role": "user", "content": "What is the capital of France?"}, {"role": "assistant", "content": "The capital of France is"}]
    r = client.chat.completions.create(model=MODEL_NAME, messages=msgs, max_tokens=4, temperature=0,
                                       extra_body={"continue_final_message": True, "add_generation_prompt": False})
    assert "Paris" in r.choices[0].message.content, r.choices[0].message.content
