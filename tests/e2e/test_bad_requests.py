"""A corpus of bad requests: each gets the right 4xx and an OpenAI-shaped error body
{"error": {"message", "type", "param", "code"}}; afterwards the server still answers."""
from __future__ import annotations

import json
import socket
import zlib

import pytest
import requests

from kvserve_server import MAX_MODEL_LEN, MAX_N, MODEL_NAME

C = "/v1/completions"
CH = "/v1/chat/completions"
JSON = {"Content-Type": "application/json"}
MSG = [{"role": "user", "content": "hi"}]


def comp(**kw):
    body = {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}
    body.update(kw)
    return json.dumps(body).encode()


def chat(**kw):
    body = {"model": MODEL_NAME, "messages": MSG, "max_tokens": 2}
    body.update(kw)
    return json.dumps(body).encode()


def without(body: bytes, key: str) -> bytes:
    d = json.loads(body)
    del d[key]
    return json.dumps(d).encode()


IVE = "invalid_request_error"

# (name, method, path, headers, body, status, param or None for "don't care")
CORPUS = [
    # --- body is not a JSON object
    ("empty body", "POST", C, JSON, b"", 400, None),
    ("truncated json", "POST", C, JSON, b'{"prompt": "hi"', 400, None),
    ("not json", "POST", CH, JSON, b"hello there", 400, None),
    ("json array", "POST", C, JSON, b'[1, 2, 3]', 400, None),
    ("json string", "POST", CH, JSON, b'"hi"', 400, None),
    ("json null", "POST", C, JSON, b"null", 400, None),
    ("trailing garbage", "POST", C, JSON, b'{"prompt": "hi"} x', 400, None),
    # found by tests/fuzz/fuzz_text.cpp (request): nlohmann throws out_of_range, not parse_error
    ("number beyond double", "POST", C, JSON, b'{"prompt": "hi", "max_tokens": 1e400}', 400, None),
    ("max_completion_tokens 0", "POST", CH, JSON, chat(max_completion_tokens=0), 400, "max_completion_tokens"),
    ("invalid utf-8 in prompt", "POST", C, JSON, b'{"prompt": "caf\xe9 \xff", "max_tokens": 2}', 400, None),
    ("invalid utf-8 in message", "POST", CH, JSON, b'{"messages": [{"role": "user", "content": "\xc3\x28"}]}', 400, None),
    ("overlong utf-8", "POST", C, JSON, b'{"prompt": "\xc0\xaf"}', 400, None),
    ("lone surrogate escape", "POST", C, JSON, b'{"prompt": "\\ud800"}', 400, None),
    ("deep nesting", "POST", C, JSON, b'{"prompt": ' + b"[" * 100000 + b"]" * 100000 + b"}", 400, None),
    # --- model
    ("unknown model", "POST", C, JSON, comp(model="gpt-4"), 404, "model"),
    ("unknown model chat", "POST", CH, JSON, chat(model="llama-70b"), 404, "model"),
    ("model wrong type", "POST", C, JSON, comp(model=5), 400, "model"),
    # --- prompt
    ("missing prompt", "POST", C, JSON, without(comp(), "prompt"), 400, "prompt"),
    ("prompt number", "POST", C, JSON, comp(prompt=42), 400, "prompt"),
    ("prompt object", "POST", C, JSON, comp(prompt={"text": "hi"}), 400, "prompt"),
    ("prompt empty list", "POST", C, JSON, comp(prompt=[]), 400, "prompt"),
    ("prompt empty string", "POST", C, JSON, comp(prompt=""), 400, "prompt"),
    ("prompt token out of vocab", "POST", C, JSON, comp(prompt=[1, 2, 10**9]), 400, "prompt"),
    ("prompt negative token", "POST", C, JSON, comp(prompt=[1, -5]), 400, "prompt"),
    ("prompt mixed list", "POST", C, JSON, comp(prompt=[1, "a"]), 400, "prompt"),
    # OpenAI's batch form (several prompts) is served; its prompts must be of one kind, none empty, none too long
    ("batch of strings and ids", "POST", C, JSON, comp(prompt=["a", [1, 2]]), 400, "prompt"),
    ("batch of ids and strings", "POST", C, JSON, comp(prompt=[[1, 2], "a"]), 400, "prompt"),
    ("batch with an empty string", "POST", C, JSON, comp(prompt=["a", ""]), 400, "prompt"),
    ("batch with a number", "POST", C, JSON, comp(prompt=["a", 5]), 400, "prompt"),
    ("batch with a prompt too long", "POST", C, JSON, comp(prompt=["a", [100] * (MAX_MODEL_LEN + 10)]), 400, "prompt"),
    ("prompt too long", "POST", C, JSON, comp(prompt=[100] * (MAX_MODEL_LEN + 10)), 400, None),
    # --- messages
    ("missing messages", "POST", CH, JSON, without(chat(), "messages"), 400, "messages"),
    ("empty messages", "POST", CH, JSON, chat(messages=[]), 400, "messages"),
    ("messages string", "POST", CH, JSON, chat(messages="hi"), 400, "messages"),
    ("message not object", "POST", CH, JSON, chat(messages=["hi"]), 400, "messages[0]"),
    ("bad role", "POST", CH, JSON, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    ("missing role", "POST", CH, JSON, chat(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    ("role number", "POST", CH, JSON, chat(messages=[{"role": 1, "content": "hi"}]), 400, "messages[0].role"),
    # tool calling (tests/e2e/test_tool_calling.py has the rest)
    ("tool role without tool_call_id", "POST", CH, JSON, chat(messages=[{"role": "tool", "content": "x"}]), 400,
     "messages[0].tool_call_id"),
    ("function role", "POST", CH, JSON, chat(messages=[{"role": "function", "name": "f", "content": "x"}]), 400,
     "messages[0].role"),
    ("tool_calls on a user message", "POST", CH, JSON,
     chat(messages=[{"role": "user", "content": "x", "tool_calls": [{"id": "a", "type": "function",
                                                                     "function": {"name": "f", "arguments": "{}"}}]}]), 400,
     "messages[0].tool_calls"),
    ("missing content", "POST", CH, JSON, chat(messages=[{"role": "user"}]), 400, "messages[0].content"),
    ("null user content", "POST", CH, JSON, chat(messages=[{"role": "user", "content": None}]), 400, "messages[0].content"),
    ("content number", "POST", CH, JSON, chat(messages=[{"role": "user", "content": 7}]), 400, "messages[0].content"),
    ("image part", "POST", CH, JSON,
     chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "http://x/y.png"}}]}]), 400,
     "messages[0].content[0].type"),
    ("text part without text", "POST", CH, JSON, chat(messages=[{"role": "user", "content": [{"type": "text"}]}]), 400,
     "messages[0].content[0].text"),
    # --- max_tokens
    ("negative max_tokens", "POST", C, JSON, comp(max_tokens=-1), 400, "max_tokens"),
    ("zero max_tokens", "POST", C, JSON, comp(max_tokens=0), 400, "max_tokens"),
    ("huge max_tokens", "POST", C, JSON, comp(max_tokens=10**12), 400, "max_tokens"),
    ("max_tokens over 2^64", "POST", C, JSON, b'{"prompt": "hi", "max_tokens": 99999999999999999999999}', 400, "max_tokens"),
    ("max_tokens over max_model_len", "POST", CH, JSON, chat(max_tokens=MAX_MODEL_LEN + 1), 400, "max_tokens"),
    ("max_completion_tokens over", "POST", CH, JSON, chat(max_completion_tokens=MAX_MODEL_LEN * 2), 400,
     "max_completion_tokens"),
    ("prompt + max_tokens over", "POST", C, JSON, comp(prompt=[100] * 300, max_tokens=300), 400, None),
    ("max_tokens string", "POST", C, JSON, comp(max_tokens="10"), 400, "max_tokens"),
    ("max_tokens float", "POST", C, JSON, comp(max_tokens=2.5), 400, "max_tokens"),
    # --- sampling
    ("temperature too high", "POST", C, JSON, comp(temperature=2.5), 400, "temperature"),
    ("temperature negative", "POST", CH, JSON, chat(temperature=-0.1), 400, "temperature"),
    ("temperature string", "POST", C, JSON, comp(temperature="hot"), 400, "temperature"),
    ("top_p zero", "POST", C, JSON, comp(top_p=0), 400, "top_p"),
    ("top_p above one", "POST", C, JSON, comp(top_p=1.5), 400, "top_p"),
    ("top_k below -1", "POST", C, JSON, comp(top_k=-5), 400, "top_k"),
    ("min_p above one", "POST", C, JSON, comp(min_p=2), 400, "min_p"),
    ("presence_penalty out of range", "POST", C, JSON, comp(presence_penalty=3), 400, "presence_penalty"),
    ("frequency_penalty out of range", "POST", CH, JSON, chat(frequency_penalty=-2.5), 400, "frequency_penalty"),
    ("repetition_penalty zero", "POST", C, JSON, comp(repetition_penalty=0), 400, "repetition_penalty"),
    ("seed string", "POST", C, JSON, comp(seed="abc"), 400, "seed"),
    ("seed float", "POST", C, JSON, comp(seed=1.5), 400, "seed"),
    ("seed beyond 64 bits", "POST", C, JSON, comp(seed=2**64), 400, "seed"),
    ("max_tokens beyond 64 bits", "POST", C, JSON, comp(max_tokens=-(10**30)), 400, "max_tokens"),
    # --- n
    ("n zero", "POST", C, JSON, comp(n=0), 400, "n"),
    ("n over limit", "POST", C, JSON, comp(n=MAX_N + 1), 400, "n"),
    ("n string", "POST", CH, JSON, chat(n="2"), 400, "n"),
    ("best_of differs from n", "POST", C, JSON, comp(best_of=3), 400, "best_of"),
    # --- stop
    ("stop number", "POST", C, JSON, comp(stop=5), 400, "stop"),
    ("stop list with number", "POST", C, JSON, comp(stop=["a", 5]), 400, "stop"),
    ("stop empty string", "POST", C, JSON, comp(stop=""), 400, "stop"),
    ("stop too many", "POST", C, JSON, comp(stop=[f"s{i}" for i in range(17)]), 400, "stop"),
    # --- stream
    ("stream string", "POST", C, JSON, comp(stream="yes"), 400, "stream"),
    ("stream_options without stream", "POST", CH, JSON, chat(stream_options={"include_usage": True}), 400, "stream_options"),
    ("stream_options not object", "POST", CH, JSON, chat(stream=True, stream_options=True), 400, "stream_options"),
    ("include_usage string", "POST", CH, JSON, chat(stream=True, stream_options={"include_usage": "yes"}), 400,
     "include_usage"),
    # --- logprobs
    ("completion logprobs too many", "POST", C, JSON, comp(logprobs=21), 400, "logprobs"),
    ("completion logprobs negative", "POST", C, JSON, comp(logprobs=-1), 400, "logprobs"),
    ("completion logprobs bool", "POST", C, JSON, comp(logprobs=True), 400, "logprobs"),
    ("chat logprobs int", "POST", CH, JSON, chat(logprobs=5), 400, "logprobs"),
    ("top_logprobs too many", "POST", CH, JSON, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    ("top_logprobs without logprobs", "POST", CH, JSON, chat(top_logprobs=2), 400, "top_logprobs"),
    # --- unsupported features
    # tools without tool_choice: "auto" (vLLM's default), which needs --enable-auto-tool-choice
    ("tools, auto by default", "POST", CH, JSON,
     chat(tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}]), 400, "tool_choice"),
    ("tools empty", "POST", CH, JSON, chat(tools=[], tool_choice="none"), 400, "tools"),
    ("functions", "POST", CH, JSON, chat(functions=[{"name": "f", "parameters": {}}]), 400, "functions"),
    ("tool_choice required without tools", "POST", CH, JSON, chat(tool_choice="required"), 400, "tool_choice"),
    # structured outputs (tests/e2e/test_structured_output.py): malformed ones
    ("response_format unknown type", "POST", CH, JSON, chat(response_format={"type": "xml"}), 400, "response_format"),
    ("response_format schema missing", "POST", CH, JSON,
     chat(response_format={"type": "json_schema", "json_schema": {"name": "x"}}), 400, "response_format"),
    ("logit_bias", "POST", C, JSON, comp(logit_bias={"50256": -100}), 400, "logit_bias"),
    ("echo not a bool", "POST", C, JSON, comp(echo="yes"), 400, "echo"),
    ("zero max_tokens without echo", "POST", CH, JSON, chat(max_tokens=0), 400, "max_tokens"),
    ("prompt_logprobs over the maximum", "POST", C, JSON, comp(prompt_logprobs=21), 400, "prompt_logprobs"),
    ("suffix", "POST", C, JSON, comp(suffix="end"), 400, "suffix"),
    # vLLM's min_tokens: a non-negative integer, at most max_tokens (given, or the default)
    ("min_tokens over max_tokens", "POST", C, JSON, comp(min_tokens=10), 400, "min_tokens"),
    ("min_tokens over the default max_tokens", "POST", C, JSON, without(comp(min_tokens=17), "max_tokens"), 400, "min_tokens"),
    ("min_tokens over max_completion_tokens", "POST", CH, JSON, chat(max_tokens=None, max_completion_tokens=4, min_tokens=5), 400,
     "min_tokens"),
    ("min_tokens over the chat default", "POST", CH, JSON, chat(max_tokens=None, min_tokens=MAX_MODEL_LEN), 400, "min_tokens"),
    ("min_tokens negative", "POST", C, JSON, comp(min_tokens=-1), 400, "min_tokens"),
    ("min_tokens decimal", "POST", C, JSON, comp(min_tokens=1.5), 400, "min_tokens"),
    ("min_tokens string", "POST", C, JSON, comp(min_tokens="1"), 400, "min_tokens"),
    ("min_tokens bool", "POST", C, JSON, comp(min_tokens=True), 400, "min_tokens"),
    ("min_tokens beyond 64 bits", "POST", C, JSON, comp(min_tokens=2**70), 400, "min_tokens"),
    # vLLM extensions not implemented: refused, not ignored (they answered 200 without effect).
    ("stop_token_ids out of the vocabulary", "POST", C, JSON, comp(stop_token_ids=[10**9]), 400, "stop_token_ids"),
    ("stop_token_ids negative", "POST", C, JSON, comp(stop_token_ids=[-1]), 400, "stop_token_ids"),
    ("stop_token_ids not ids", "POST", C, JSON, comp(stop_token_ids="abc"), 400, "stop_token_ids"),
    ("include_stop_str_in_output not a bool", "POST", C, JSON, comp(include_stop_str_in_output="yes", stop=["a"]), 400,
     "include_stop_str_in_output"),
    ("continue_final_message with add_generation_prompt", "POST", CH, JSON,
     chat(continue_final_message=True, add_generation_prompt=True), 400, "continue_final_message"),
    # More of them, found by a user test (each answered 200 as if it had not been sent).
    ("guided_json not a schema", "POST", CH, JSON, chat(guided_json="not json"), 400, "guided_json"),
    ("guided_choice empty", "POST", C, JSON, comp(guided_choice=[]), 400, "guided_choice"),
    ("llama.cpp grammar undefined rule", "POST", C, JSON, comp(grammar="root ::= missing"), 400, "grammar"),
    ("prompt_logprobs negative", "POST", CH, JSON, chat(prompt_logprobs=-1), 400, "prompt_logprobs"),
    ("truncate_prompt_tokens 0", "POST", C, JSON, comp(truncate_prompt_tokens=0), 400, "truncate_prompt_tokens"),
    ("truncate_prompt_tokens -2", "POST", CH, JSON, chat(truncate_prompt_tokens=-2), 400, "truncate_prompt_tokens"),
    ("echo on chat", "POST", CH, JSON, chat(echo=True), 400, "echo"),
    ("skip_special_tokens not a bool", "POST", CH, JSON, chat(skip_special_tokens="no"), 400, "skip_special_tokens"),
    ("typical_p", "POST", C, JSON, comp(typical_p=0.5), 400, "typical_p"),
    ("mirostat", "POST", C, JSON, comp(mirostat=2), 400, "mirostat"),
    ("dry_multiplier", "POST", CH, JSON, chat(dry_multiplier=0.8), 400, "dry_multiplier"),
    ("xtc_probability", "POST", CH, JSON, chat(xtc_probability=0.5), 400, "xtc_probability"),
    ("bad_words", "POST", C, JSON, comp(bad_words=["the"]), 400, "bad_words"),
    ("response_format a string on completions", "POST", C, JSON, comp(response_format="json"), 400, "response_format"),
    ("llama.cpp repeat_penalty", "POST", C, JSON, comp(repeat_penalty=1.3), 400, "repeat_penalty"),
    ("llama.cpp top_n_sigma", "POST", CH, JSON, chat(top_n_sigma=2), 400, "top_n_sigma"),
    # llama-server's length and time limits: accepted and ignored before (a chat with n_predict 3
    # ran to the end of the context), found by a user test.
    ("llama.cpp n_predict", "POST", CH, JSON, chat(n_predict=3), 400, "n_predict"),
    ("llama.cpp n_predict on completions", "POST", C, JSON, comp(n_predict=3), 400, "n_predict"),
    ("llama.cpp t_max_predict_ms", "POST", C, JSON, comp(t_max_predict_ms=500), 400, "t_max_predict_ms"),
    ("a request's template without --trust-request-chat-template", "POST", CH, JSON, chat(chat_template="{{ 1 }}"), 400, "chat_template"),
    ("use_beam_search", "POST", C, JSON, comp(use_beam_search=True), 400, "use_beam_search"),
    ("chat_template that does not parse", "POST", CH, JSON, chat(chat_template="{% for m in messages %}"), 400, "chat_template"),
    ("chat_template_kwargs not an object", "POST", CH, JSON, chat(chat_template_kwargs=[1]), 400, "chat_template_kwargs"),
    ("chat_template_kwargs setting messages", "POST", CH, JSON, chat(chat_template_kwargs={"messages": []}), 400, "chat_template_kwargs"),
    ("audio modality", "POST", CH, JSON, chat(modalities=["text", "audio"]), 400, "modalities"),
    ("cache_salt empty", "POST", C, JSON, comp(cache_salt=""), 400, "cache_salt"),
    ("cache_salt number", "POST", C, JSON, comp(cache_salt=3), 400, "cache_salt"),
    # Without keys a salt spelled as a tenant's namespace could reach that tenant's pages in a
    # shared disk or Redis tier.
    ("cache_salt a tenant's prefix", "POST", C, JSON, comp(cache_salt="key:0123456789abcdef/"), 400, "cache_salt"),
    # --- routes and methods
    ("unknown route", "GET", "/v1/nothing", {}, b"", 404, None),
    ("unknown POST route", "POST", "/v2/completions", JSON, comp(), 404, None),
    ("unknown model route", "GET", "/v1/models/gpt-4", {}, b"", 404, None),
    ("GET completions", "GET", C, {}, b"", 405, None),
    ("GET chat", "GET", CH, {}, b"", 405, None),
    ("DELETE completions", "DELETE", C, {}, b"", 405, None),
    ("PUT chat", "PUT", CH, JSON, chat(), 405, None),
    ("POST models", "POST", "/v1/models", JSON, b"{}", 405, None),
    ("POST health", "POST", "/health", JSON, b"{}", 405, None),
    # --- size
    ("oversized body", "POST", C, JSON, b'{"prompt": "' + b"a" * (9 << 20) + b'"}', 413, None),
]


def test_corpus_is_big_enough():
    assert len(CORPUS) >= 50
    assert len({c[0] for c in CORPUS}) == len(CORPUS)


def check_error_body(r, status, param):
    assert r.status_code == status, r.text[:500]
    assert r.headers["Content-Type"].startswith("application/json")
    body = r.json()
    assert set(body) == {"error"}, body
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("invalid_request_error" if status < 500 and status != 429 else err["type"])
    if param is not None:
        assert err["param"] == param, err


@pytest.mark.parametrize("name,method,path,headers,body,status,param", CORPUS, ids=[c[0] for c in CORPUS])
def test_bad_request(server, name, method, path, headers, body, status, param):
    r = requests.request(method, server.url + path, headers=headers, data=body, timeout=30)
    check_error_body(r, status, param)


def spaced_body(mib: int, closing: bytes = b"}"):
    """A valid completion request padded with `mib` MiB of JSON whitespace, in 1 MiB pieces."""
    yield b'{"prompt": "Hi", "max_tokens": 2'
    for _ in range(mib):
        yield b" " * (1 << 20)
    yield closing


def gzipped(chunks) -> bytes:
    z = zlib.compressobj(9, zlib.DEFLATED, 31)  # gzip framing
    return b"".join(z.compress(c) for c in chunks) + z.flush()


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return int(f.read().split("VmRSS:")[1].split()[0]) / 1024


@pytest.mark.parametrize("path", [C, CH, "/tokenize"])
def test_a_chunked_body_over_the_limit_is_a_413(server, path):
    """cpp-httplib checks its payload limit only against a Content-Length: a chunked body (a
    generator makes requests send one) was read whole, however large."""
    r = requests.post(server.url + path, data=spaced_body(12), headers=JSON, timeout=60)
    check_error_body(r, 413, None)
    assert r.json()["error"]["code"] == "payload_too_large"


def test_a_gzip_body_that_inflates_past_the_limit_is_a_413_and_is_never_inflated_whole(server):
    """400 KB on the wire, 400 MiB inflated: it was inflated into memory (RSS +900 MiB) and
    answered 200. Now the inflating stops at the limit."""
    bomb = gzipped(spaced_body(400))
    assert len(bomb) < 1 << 20
    before = rss_mib(server.proc.pid)
    r = requests.post(server.url + C, data=bomb, headers={**JSON, "Content-Encoding": "gzip"}, timeout=60)
    check_error_body(r, 413, None)
    assert r.headers.get("Connection") == "close"
    assert rss_mib(server.proc.pid) - before < 64


def test_chunked_and_gzip_bodies_under_the_limit_are_read(server):
    for headers, data in [(JSON, spaced_body(1)), ({**JSON, "Content-Encoding": "gzip"}, gzipped(spaced_body(6)))]:
        r = requests.post(server.url + C, data=data, headers=headers, timeout=60)
        assert r.status_code == 200, r.text[:300]
        assert r.json()["usage"]["completion_tokens"] == 2
    r = requests.post(server.url + C, data=b"\x1f\x8b\x08 not gzip", headers={**JSON, "Content-Encoding": "gzip"}, timeout=30)
    check_error_body(r, 400, None)


def test_raw_garbage_http(server):
    """Malformed HTTP on a raw socket gets a 4xx (or a closed connection), never a crash."""
    for payload in [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                    b"POST /v1/completions HTTP/1.1\r\nContent-Length: 10\r\n\r\nabc",  # short body, then close
                    b"\x00\x01\x02\x03\r\n\r\n"]:
        with socket.create_connection(("127.0.0.1", server.port), timeout=10) as s:
            s.sendall(payload)
            s.shutdown(socket.SHUT_WR)
            data = s.recv(4096)
            assert data == b"" or data.startswith(b"HTTP/1.1 4"), data[:100]


def test_still_serves_after_corpus(server):
    r = requests.post(server.url + C, json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] == 3
    assert server.proc.poll() is None


def test_integers_beyond_64_bits_are_out_of_range(server):
    """JSON integers past 64 bits parse as decimals; the error says the value is out of range, and
    shows it as the client wrote it (2**64 was shown as 1.8446744073709552e+19)."""
    import requests
    for field, value, want in [
        ("seed", 2**64, "18446744073709551616 is above the maximum of 9223372036854775807."),
        ("seed", 2**64 + 1, "18446744073709551617 is above the maximum of 9223372036854775807."),
        ("seed", -2**63 - 1, "-9223372036854775809 is below the minimum of -9223372036854775808."),
        ("seed", 10**30, "1000000000000000000000000000000 is above the maximum of 9223372036854775807."),
        ("max_tokens", -(10**30), "-1000000000000000000000000000000 is below the minimum of 1."),
        ("min_tokens", 2**70, "1180591620717411303424 is above the maximum of 2147483647."),
        ("temperature", 10**20, "100000000000000000000 is above the maximum of 2."),
    ]:
        r = requests.post(server.url + C, data=comp(**{field: value}), headers=JSON, timeout=30)
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "invalid_value", err
        assert err["message"] == f"Invalid value for '{field}': {want}", err
    # Nested, and written with an exponent: as written.
    r = requests.post(server.url + C, data=b'{"prompt": "hi", "kv_eviction": {"policy": "sinks", "budget": 1e30}}', headers=JSON)
    assert r.json()["error"]["message"] == "Invalid value for 'kv_eviction.budget': 1e30 is above the maximum of 2147483647.", r.text


def test_min_tokens_is_checked_not_refused(server):
    """min_tokens was refused as unsupported whatever its value; now a bad value is an invalid
    value or type (OpenAI's codes) and a good one is served."""
    for body, code, word in [(comp(min_tokens=3), "invalid_value", "3 is more than max_tokens (2)"),
                             (comp(min_tokens=-1), "invalid_value", "below the minimum of 0"),
                             (comp(min_tokens=1.5), "invalid_type", "expected an integer")]:
        r = requests.post(server.url + C, data=body, headers=JSON, timeout=30)
        err = r.json()["error"]
        assert r.status_code == 400 and err["code"] == code and word in err["message"] and err["param"] == "min_tokens", err
    for n in (0, 1, 2):
        r = requests.post(server.url + C, data=comp(min_tokens=n), headers=JSON, timeout=30)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 2, r.text
