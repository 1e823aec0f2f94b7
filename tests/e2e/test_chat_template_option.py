"""`--chat-template` (vLLM's flag; llama.cpp's --chat-template / --chat-template-file): a chat
template for a GGUF that carries none (our Gemma 3 270M is the base model) or the wrong one.

Oracles: transformers' own Jinja renderer (render_jinja_template, what apply_chat_template uses)
renders the same template source, and transformers' Gemma tokenizer (tests/tokenizer/oracle_gemma.py)
tokenizes the text; the server's chat tokenization and usage must give exactly those ids.
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import requests

from kvserve_server import KVSERVE, MODEL, ROOT, Server

sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizer"))
import oracle_gemma  # noqa: E402

GEMMA = os.path.join(ROOT, "models", oracle_gemma.GGUF_NAME)
GEMMA_ID = "gemma-3-270m-Q4_K_M"

CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "Answer in one word."},
     {"role": "user", "content": "  Name a red fruit.  "}],
    [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello. How can I help?"},
     {"role": "user", "content": [{"type": "text", "text": "Count to three."}]}],
]


def template_source(name: str) -> str:
    with open(os.path.join(ROOT, "templates", name + ".jinja"), encoding="utf-8") as f:
        return f.read()


@pytest.fixture(scope="module")
def gemma_tok():
    return oracle_gemma.build_transformers(os.path.join(ROOT, "models"))


def oracle_ids(gemma_tok, source: str, messages) -> list[int]:
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template(conversations=[messages], chat_template=source, add_generation_prompt=True,
                                        bos_token="<bos>", eos_token="<eos>")
    # The template writes <bos> itself: no special tokens added (apply_chat_template(tokenize=True) does the same).
    return gemma_tok.encode(rendered[0], add_special_tokens=False).ids


@pytest.fixture(scope="module")
def gemma_chat():
    s = Server("--debug", "--chat-template", "gemma3", model=GEMMA, max_model_len=1024, kv_memory="64MiB")
    yield s
    s.stop()
    assert s.proc.returncode == 0, s.output()


def test_a_builtin_template_makes_the_model_chat_as_the_oracle_renders_it(gemma_chat, gemma_tok):
    from openai import OpenAI
    assert requests.get(gemma_chat.url + "/v1/models").json()["data"][0]["chat_template"] is True
    client = OpenAI(base_url=gemma_chat.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    source = template_source("gemma3")
    for conv in CONVERSATIONS:
        want = oracle_ids(gemma_tok, source, conv)
        got = requests.post(gemma_chat.url + "/tokenize", json={"messages": conv}).json()["tokens"]
        assert got == want, conv
        r = client.chat.completions.create(model=GEMMA_ID, messages=conv, max_tokens=4, temperature=0)
        assert r.usage.prompt_tokens == len(want)
        assert r.choices[0].finish_reason in ("stop", "length")
    client.close()
    assert gemma_chat.wait_clean()["pages_in_use"] == 0


def test_the_templates_own_error_is_a_400(gemma_chat):
    # Gemma's template refuses two user turns in a row with raise_exception: its words, a 400.
    r = requests.post(gemma_chat.url + "/v1/chat/completions",
                      json={"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}],
                            "max_tokens": 2})
    assert r.status_code == 400, r.text
    assert "Conversation roles must alternate" in r.json()["error"]["message"]


def test_a_template_file(tmp_path, gemma_tok):
    path = tmp_path / "plain.jinja"
    source = ("{%- for m in messages -%}[{{ m['role'] | upper }}] {{ m['content'] }}\n{%- endfor -%}"
              "{%- if add_generation_prompt -%}[ASSISTANT] {%- endif -%}")
    path.write_text(source)
    s = Server("--chat-template", str(path), model=GEMMA, max_model_len=1024, kv_memory="64MiB")
    try:
        conv = CONVERSATIONS[0]
        got = requests.post(s.url + "/tokenize", json={"messages": conv}).json()["tokens"]
        assert got == oracle_ids(gemma_tok, source, conv)
    finally:
        s.stop()


def test_an_inline_template_replaces_the_models_own():
    # SmolLM2 carries a ChatML template (with a default system prompt); the option wins over it.
    s = Server("--chat-template", "{% for m in messages %}<<{{ m.content }}>>{% endfor %}", model=MODEL)
    try:
        got = requests.post(s.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()
        want = requests.post(s.url + "/tokenize", json={"prompt": "<<hi>>", "add_special_tokens": False}).json()
        assert got["tokens"] == want["tokens"]
    finally:
        s.stop()


@pytest.mark.parametrize("spec,words", [
    ("gemma", "no such file, and not a built-in template (chatml, gemma3)"),
    ("/tmp", "/tmp: not a regular file"),
    ("{% for m in messages %}", "taken as the template itself"),
])
def test_a_bad_template_fails_before_the_weights_load(spec, words):
    r = subprocess.run([KVSERVE, "serve", "-m", GEMMA, "--port", "1", "--chat-template", spec],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert words in r.stderr, r.stderr[-2000:]
    assert "loading weights" not in r.stderr


def test_a_requests_own_template_and_kwargs(server):
    # vLLM's request fields: chat_template (the template's text, only with --trust-request-chat-template,
    # as vLLM: it runs the client's code) and chat_template_kwargs (variables).
    refused = requests.post(server.url + "/v1/chat/completions",
                            json={"messages": [{"role": "user", "content": "hi"}], "chat_template": "{{ 'x' * 30000000 }}"})
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template", refused.text
    assert "--trust-request-chat-template" in refused.json()["error"]["message"]
    trusting = Server("--trust-request-chat-template")
    try:
        own_template_and_kwargs(trusting)
    finally:
        trusting.stop()


def own_template_and_kwargs(server):
    source = "{{ greeting }}{% for m in messages %}|{{ m.role }}:{{ m.content }}{% endfor %}{% if add_generation_prompt %}|>{% endif %}"
    conv = [{"role": "user", "content": "hi"}]
    body = {"messages": conv, "chat_template": source, "chat_template_kwargs": {"greeting": "Hello"}, "max_tokens": 2,
            "temperature": 0}
    got = requests.post(server.url + "/tokenize", json=body).json()["tokens"]
    from transformers.utils.chat_template_utils import render_jinja_template
    rendered, _ = render_jinja_template(conversations=[conv], chat_template=source, add_generation_prompt=True, greeting="Hello")
    want = requests.post(server.url + "/tokenize", json={"prompt": rendered[0], "add_special_tokens": False}).json()["tokens"]
    assert rendered[0] == "Hello|user:hi|>" and got == want
    r = requests.post(server.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and r.json()["usage"]["prompt_tokens"] == len(want), r.text
    # The next request is back on the model's own template; the samplers' "off" values are accepted.
    plain = requests.post(server.url + "/v1/chat/completions",
                          json={"messages": conv, "max_tokens": 2, "typical_p": 1.0, "mirostat": 0, "skip_special_tokens": True,
                                "prompt_logprobs": None, "n_predict": -1, "t_max_predict_ms": 0})
    assert plain.status_code == 200 and plain.json()["usage"]["prompt_tokens"] > len(want), plain.text
    empty = requests.post(server.url + "/v1/chat/completions", json={"messages": conv, "max_tokens": 2, "chat_template": ""})
    assert empty.json()["usage"]["prompt_tokens"] == plain.json()["usage"]["prompt_tokens"]  # "": the default, as vLLM
    bad = requests.post(server.url + "/v1/chat/completions",
                        json={"messages": conv, "chat_template": "{{ raise_exception('no thanks') }}"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "chat_template", bad.text


def test_content_parts_reach_the_template_as_vllm_passes_them(gemma_chat, gemma_tok, server):
    """vLLM gives a template that loops over message['content'] (Gemma 3's) the parts themselves, and
    joins the parts with "\\n" for one that takes content as a string (SmolLM2's ChatML). kvserve
    joined them with nothing for both: "Hello" + "World" reached the model as "HelloWorld"."""
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": " World"}]
    conv = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Very."}]},
            {"role": "user", "content": parts}]
    want = oracle_ids(gemma_tok, template_source("gemma3"), conv)
    assert requests.post(gemma_chat.url + "/tokenize", json={"messages": conv}, timeout=10).json()["tokens"] == want
    # a string-content template: the same tokens as the parts joined by "\n"
    as_parts = requests.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": parts}]}, timeout=10).json()
    joined = requests.post(server.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hello \n World"}]}, timeout=10).json()
    assert as_parts["tokens"] == joined["tokens"]


def test_an_empty_list_of_parts_renders_as_transformers_renders_it(gemma_chat, gemma_tok):
    """Content given as [] reached the template as "": Gemma 3's template then rendered a system
    message of no parts as a "\n\n" prefix, where transformers' rendering (the oracle) fails on
    its content[0]['text']. Now the list goes through: the same error, a 400; an empty user list
    renders as transformers renders it."""
    from transformers.utils.chat_template_utils import render_jinja_template
    conv = [{"role": "system", "content": []}, {"role": "user", "content": "hi"}]
    with pytest.raises(Exception, match="has no element 0"):
        render_jinja_template(conversations=[conv], chat_template=template_source("gemma3"), add_generation_prompt=True,
                              bos_token="<bos>", eos_token="<eos>")
    for path, body in (("/tokenize", {"messages": conv}), ("/v1/chat/completions", {"messages": conv, "max_tokens": 2})):
        r = requests.post(gemma_chat.url + path, json=body, timeout=30)
        assert r.status_code == 400 and "has no element 0" in r.json()["error"]["message"], (path, r.text)
    user_only = [{"role": "user", "content": []}]
    got = requests.post(gemma_chat.url + "/tokenize", json={"messages": user_only}, timeout=30).json()["tokens"]
    assert got == oracle_ids(gemma_tok, template_source("gemma3"), user_only)


def test_input_text_and_refusal_parts_are_text_as_vllm_reads_them(server):
    """vLLM reads "input_text" / "output_text" parts (the Responses API's names) as text, and an
    assistant's "refusal" part as its refusal text; they were refused here as media ("text-only
    model", a black-box test). Media parts are still refused, saying so."""
    tk = lambda msgs: requests.post(server.url + "/tokenize", json={"messages": msgs}, timeout=10)  # noqa: E731
    as_text = tk([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No."}, {"role": "user", "content": "Why?"}]).json()
    for user, assistant in [({"type": "input_text", "text": "Hi"}, {"type": "output_text", "text": "No."}),
                            ({"type": "text", "text": "Hi"}, {"type": "refusal", "refusal": "No."})]:
        r = tk([{"role": "user", "content": [user]}, {"role": "assistant", "content": [assistant]}, {"role": "user", "content": "Why?"}])
        assert r.status_code == 200 and r.json()["tokens"] == as_text["tokens"], r.text
    r = tk([{"role": "user", "content": [{"type": "refusal", "refusal": "x"}]}])
    assert r.status_code == 400 and "'refusal' in an assistant message" in r.json()["error"]["message"]
    r = tk([{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}])
    assert r.status_code == 400 and "text-only model" in r.json()["error"]["message"]
