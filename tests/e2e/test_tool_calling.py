"""Tool calling (src/server/tool_calls.h): OpenAI's `tools` and `tool_choice` as vLLM serves them,
through the official `openai` client against a real server.

Oracles independent of the server: `jsonschema` validates every call's arguments against its
tool's `parameters` (sampling at temperature 1 over several seeds explores what the constraint
lets through; the same requests without it do not all validate); the tools' names are the
request's; transformers' own Jinja renderer (render_jinja_template, what apply_chat_template uses)
and HuggingFace `tokenizers` give the ids a conversation with tool calls and a tool result must
render to. SmolLM2-135M and Gemma 3 270M never write a hermes `<tool_call>` unasked (tried at
temperatures 0 and 0.7), so "auto" is exercised end to end with the answer forced into that
format by a regex constraint (vLLM also takes a structured-output constraint beside "auto").
"""
from __future__ import annotations

import json
import os
import sys

import jsonschema
import pytest
import requests
from openai import BadRequestError, OpenAI

from kvserve_server import MODEL, MODEL_NAME, ROOT, SLOWDOWN, Router, Server

sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import tokenizer_ref  # noqa: E402

GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")

WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME_PARAMS = {
    "type": "object",
    "properties": {"timezone": {"type": "string", "maxLength": 20}, "h24": {"type": "boolean"}},
    "required": ["timezone", "h24"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The current weather in a city.",
                                            "parameters": WEATHER_PARAMS}}
TIME = {"type": "function", "function": {"name": "get_time", "description": "The time in a timezone.", "parameters": TIME_PARAMS}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
ASK = [{"role": "user", "content": "What is the weather like in Paris right now?"}]
NO_WS = {"structured_outputs": {"disable_any_whitespace": True}}

# A ChatML template that shows tools and calls in the hermes format (as Qwen 2.5's does): the
# tools as JSON in the system turn, an assistant turn's calls as <tool_call> tags with their
# arguments through tojson (a mapping, not a string), tool results as <tool_response>.
HERMES_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- 'You may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) or (message.role == 'assistant' and not message.tool_calls) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for tool_call in message.tool_calls %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.function.name + '", "arguments": ' + tool_call.function.arguments | tojson + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

# A conversation that goes on after a call: the assistant's call (content null, arguments as
# OpenAI sends them: JSON text), the tool's result, and a follow-up question.
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
FOLLOW_UP = ASK + [{"role": "assistant", "content": None, "tool_calls": [CALL]},
                   {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21, "sky": "clear"}'},
                   {"role": "user", "content": "So, should I take an umbrella?"}]


def chat(client, **kw):
    kw.setdefault("model", MODEL_NAME)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(**kw)


def valid(arguments: str, schema) -> bool:
    try:
        jsonschema.validate(json.loads(arguments), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def reassemble(chunks):
    """What a client makes of a streamed choice: its content, its calls ({id, name, arguments}
    by index: id and name from a call's first delta, arguments concatenated), the finish reason,
    and how many chunks carried argument text."""
    content, calls, reason, arg_chunks = "", [], None, 0
    for ch in chunks:
        if not ch.choices:
            continue
        c = ch.choices[0]
        content += c.delta.content or ""
        for tc in c.delta.tool_calls or []:
            if tc.index == len(calls):
                assert tc.id and tc.type == "function" and tc.function.name, tc
                calls.append({"id": tc.id, "name": tc.function.name, "arguments": ""})
            else:
                assert tc.id is None and tc.function.name is None, tc  # only a call's first delta names it
            calls[tc.index]["arguments"] += tc.function.arguments or ""
            arg_chunks += bool(tc.function.arguments)
        reason = c.finish_reason or reason
    return content, calls, reason, arg_chunks


def calls_of(message):
    return [{"name": tc.function.name, "arguments": tc.function.arguments} for tc in message.tool_calls or []]


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """A server that takes tool_choice "auto" (vLLM's --enable-auto-tool-choice --tool-call-parser
    hermes) with a template that shows tools and calls in the hermes format."""
    path = tmp_path_factory.mktemp("hermes") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE, encoding="utf-8")
    path = str(path)
    s = Server("--debug", "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--chat-template", path,
               max_model_len=1024, kv_memory="64MiB")
    c = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60 * SLOWDOWN)
    yield s, c
    c.close()
    s.wait_clean()
    s.stop()
    assert s.proc.returncode == 0, s.output()


# ---- named: one call of that function, its arguments the constrained text


def test_named_tool_choice_calls_that_function_with_valid_arguments(client):
    choices = []
    for seed in (1, 2, 3):
        r = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=seed, n=4, max_tokens=60,
                 extra_body=NO_WS if seed != 3 else None)
        choices += r.choices
    finished = [c for c in choices if c.finish_reason == "stop"]  # OpenAI's and vLLM's reason for a named choice
    assert len(finished) >= 8, [(c.finish_reason, calls_of(c.message)) for c in choices]
    for c in choices:
        assert c.finish_reason in ("stop", "length")
        assert c.message.content is None
        assert len(c.message.tool_calls) == 1
        tc = c.message.tool_calls[0]
        assert tc.type == "function" and tc.id.startswith("call_") and tc.function.name == "get_weather"
    for c in finished:
        jsonschema.validate(json.loads(c.message.tool_calls[0].function.arguments), WEATHER_PARAMS)
    assert len({c.message.tool_calls[0].id for c in choices}) == len(choices)
    # Without the constraint (the tools only shown to the template, which SmolLM2's ignores) the
    # same requests do not all give valid arguments.
    free = [c for seed in (1, 2) for c in chat(client, tools=TOOLS, tool_choice="none", temperature=1.0, seed=seed, n=4,
                                               max_tokens=60).choices]
    assert all(c.message.tool_calls is None for c in free)
    assert not all(valid(c.message.content, WEATHER_PARAMS) for c in free)


def test_required_gives_at_least_one_call_of_the_tools(client):
    choices = []
    for seed in (4, 5, 6):
        choices += chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed, n=4, max_tokens=150,
                        extra_body=NO_WS).choices
    finished = [c for c in choices if c.finish_reason != "length"]
    assert len(finished) >= 8, [(c.finish_reason, calls_of(c.message)) for c in choices]
    for c in finished:
        assert c.finish_reason == "tool_calls"
        assert c.message.content is None
        assert len(c.message.tool_calls) >= 1
        for tc in c.message.tool_calls:
            assert tc.function.name in SCHEMAS
            jsonschema.validate(json.loads(tc.function.arguments), SCHEMAS[tc.function.name])
    # parallel_tool_calls=false: one call
    for c in chat(client, tools=TOOLS, tool_choice="required", parallel_tool_calls=False, temperature=1.0, seed=7, n=4,
                  max_tokens=100, extra_body=NO_WS).choices:
        if c.finish_reason == "tool_calls":
            assert len(c.message.tool_calls) == 1
    # without the constraint: text, and not a valid array of calls
    free = chat(client, tools=TOOLS, tool_choice="none", temperature=1.0, seed=4, n=4, max_tokens=150).choices
    assert not all(_valid_calls(c.message.content) for c in free)


def _valid_calls(text):
    try:
        items = json.loads(text)
        return isinstance(items, list) and items and all(valid(json.dumps(i["parameters"]), SCHEMAS[i["name"]]) for i in items)
    except (ValueError, KeyError, TypeError):
        return False


@pytest.mark.parametrize("tool_choice", [NAMED, "required"], ids=["named", "required"])
def test_streamed_calls_reassemble_to_the_whole_response(client, tool_choice):
    """As vLLM streams them: a call's first delta has its index, id, type and name, then its
    arguments' text comes in pieces; the pieces make the non-streamed response's arguments, and
    the finish reason is the same."""
    for seed in (8, 9):
        kw = dict(tools=TOOLS, tool_choice=tool_choice, temperature=1.0, seed=seed, max_tokens=120, extra_body=NO_WS)
        whole = chat(client, **kw).choices[0]
        content, calls, reason, arg_chunks = reassemble(chat(client, stream=True, **kw))
        assert content == ""
        assert reason == whole.finish_reason
        assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == calls_of(whole.message)
        assert arg_chunks > 3  # streamed as generated, not at the end
        assert all(c["id"].startswith("call_") for c in calls)


def test_none_answers_text(client):
    r = chat(client, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=20)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.message.content and c.finish_reason in ("stop", "length")


def test_a_conversation_goes_on_after_a_call(client, hermes):
    """The assistant's call and the tool's result are accepted and rendered as transformers renders
    them (vLLM's messages: the call's arguments parsed into a mapping, the tools dumped with every
    declared member), and the model answers."""
    from transformers.utils.chat_template_utils import render_jinja_template
    s, hc = hermes
    tools_as_vllm_dumps = [{"type": "function", "function": {"name": t["function"]["name"], "description": t["function"]["description"],
                                                             "parameters": t["function"]["parameters"]}} for t in TOOLS]
    as_vllm = json.loads(json.dumps(FOLLOW_UP))
    as_vllm[1]["content"] = ""  # null content: an empty text, as vLLM's string content format has it
    as_vllm[1]["tool_calls"][0]["function"]["arguments"] = json.loads(CALL["function"]["arguments"])
    rendered, _ = render_jinja_template(conversations=[as_vllm], tools=tools_as_vllm_dumps, chat_template=HERMES_TEMPLATE,
                                        add_generation_prompt=True)
    assert '"arguments": {"city": "Paris", "unit": "celsius"}' in rendered[0]  # a mapping, not a quoted string
    want = tokenizer_ref.encode(tokenizer_ref.load_tokenizer(MODEL), rendered[0])
    got = requests.post(s.url + "/tokenize", json={"messages": FOLLOW_UP, "tools": TOOLS}, timeout=30).json()["tokens"]
    assert got == want
    r = hc.chat.completions.create(model=MODEL_NAME, messages=FOLLOW_UP, tools=TOOLS, tool_choice="none", temperature=0,
                                   max_tokens=16)
    assert r.usage.prompt_tokens == len(want)
    assert r.choices[0].message.content
    # SmolLM2's own template ignores tools and calls: the conversation still renders and answers
    r = chat(client, messages=FOLLOW_UP, temperature=0, max_tokens=16)
    assert r.choices[0].message.content and r.choices[0].finish_reason in ("stop", "length")


# ---- "auto" with the hermes parser

FORCED_CALL = (r'Let me check\.\n<tool_call>\n\{"name": "get_weather", "arguments": \{"city": "[A-Z][a-z]{2,10}", '
               r'"unit": "(celsius|fahrenheit)"\}\}\n</tool_call>')
FORCED_TWO = r'<tool_call>\{"name": "get_time", "arguments": \{"timezone": "[A-Z][a-z]{2,8}", "h24": (true|false)\}\}</tool_call>' * 2
FORCED_BAD = r'Sure\. <tool_call>\{"name": "get_weather"\}</tool_call>'


def test_auto_parses_hermes_calls(hermes):
    s, hc = hermes
    for seed in (1, 2):
        r = hc.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=seed, max_tokens=80,
                                       extra_body={"structured_outputs": {"regex": FORCED_CALL}})
        c = r.choices[0]
        assert c.finish_reason == "tool_calls"
        assert c.message.content == "Let me check.\n"  # the text before the first tag
        [tc] = c.message.tool_calls
        assert tc.function.name == "get_weather" and tc.id.startswith("call_")
        jsonschema.validate(json.loads(tc.function.arguments), WEATHER_PARAMS)
        assert tc.function.arguments.startswith('{"city": "')  # re-serialized as vLLM's json.dumps writes it
    r = hc.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, tool_choice="auto", temperature=1.0, seed=3,
                                   max_tokens=80, extra_body={"structured_outputs": {"regex": FORCED_TWO}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content is None
    assert [tc.function.name for tc in c.message.tool_calls] == ["get_time", "get_time"]
    for tc in c.message.tool_calls:
        jsonschema.validate(json.loads(tc.function.arguments), TIME_PARAMS)
    # a call whose JSON lacks its arguments: no call, the whole text is the content (vLLM's rule)
    r = hc.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=4, max_tokens=80,
                                   extra_body={"structured_outputs": {"regex": FORCED_BAD}})
    c = r.choices[0]
    assert c.finish_reason == "stop" and c.message.tool_calls is None
    assert c.message.content == 'Sure. <tool_call>{"name": "get_weather"}</tool_call>'
    # free text: the content, as it is
    r = hc.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=20)
    c = r.choices[0]
    assert c.message.tool_calls is None and c.message.content and c.finish_reason in ("stop", "length")


@pytest.mark.parametrize("pattern", [FORCED_CALL, FORCED_TWO, FORCED_BAD], ids=["call", "two", "malformed"])
def test_auto_streamed_is_the_whole_response(hermes, pattern):
    """Text streams as content until it may be a "<tool_call>" tag; from the first tag it is held
    and, at the end, sent as the calls (or, if they do not parse, as content)."""
    _, hc = hermes
    kw = dict(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=5, max_tokens=80,
              extra_body={"structured_outputs": {"regex": pattern}})
    whole = hc.chat.completions.create(**kw).choices[0]
    content, calls, reason, _ = reassemble(hc.chat.completions.create(stream=True, **kw))
    assert reason == whole.finish_reason
    assert content == (whole.message.content or "")
    assert [{"name": c["name"], "arguments": c["arguments"]} for c in calls] == calls_of(whole.message)


# ---- refusals

USER = {"role": "user", "content": "hi"}
BROKEN = {"type": "function", "function": {"name": "broken", "parameters": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}}
BAD = [
    ("tools not a list", dict(tools=WEATHER), "tools"),
    ("tools empty", dict(tools=[]), "tools"),
    ("tool not an object", dict(tools=["get_weather"]), "tools[0]"),
    ("tool of another type", dict(tools=[{"type": "custom", "function": {"name": "f"}}]), "tools[0].type"),
    ("tool without function", dict(tools=[{"type": "function"}]), "tools[0].function"),
    ("function without name", dict(tools=[{"type": "function", "function": {"description": "x"}}]), "tools[0].function.name"),
    ("function name empty", dict(tools=[{"type": "function", "function": {"name": ""}}]), "tools[0].function.name"),
    ("function name twice", dict(tools=[WEATHER, {"type": "function", "function": {"name": "get_weather"}}], tool_choice="none"),
     "tools[1].function.name"),
    ("parameters a string", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": "{}"}}], tool_choice="none"),
     "tools[0].function.parameters"),
    ("parameters not an object", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
                                      tool_choice="none"), "tools[0].function.parameters"),
    ("named parameters do not compile", dict(tools=[WEATHER, BROKEN], tool_choice={"type": "function", "function": {"name": "broken"}}),
     "tools[1].function.parameters"),
    ("required parameters do not compile", dict(tools=[WEATHER, BROKEN], tool_choice="required"), "tools[1].function.parameters"),
    ("tool_choice unknown", dict(tools=TOOLS, tool_choice="sometimes"), "tool_choice"),
    ("tool_choice not a tool", dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
    ("tool_choice without function", dict(tools=TOOLS, tool_choice={"type": "function"}), "tool_choice"),
    ("tool_choice a number", dict(tools=TOOLS, tool_choice=3), "tool_choice"),
    ("tool_choice without tools", dict(tool_choice="required"), "tool_choice"),
    ("auto by default", dict(tools=TOOLS), "tool_choice"),
    ("auto", dict(tools=TOOLS, tool_choice="auto"), "tool_choice"),
    ("named and a constraint", dict(tools=TOOLS, tool_choice=NAMED, response_format={"type": "json_object"}), "tool_choice"),
    ("required and a constraint", dict(tools=TOOLS, tool_choice="required", guided_regex="a+"), "tool_choice"),
    ("tools twice", dict(tools=TOOLS, tool_choice="none", chat_template_kwargs={"tools": []}), "chat_template_kwargs"),
    ("functions", dict(functions=[{"name": "f", "parameters": {}}]), "functions"),
    ("tool result without id", dict(messages=[USER, {"role": "tool", "content": "x"}]), "messages[1].tool_call_id"),
    ("tool result id a number", dict(messages=[USER, {"role": "tool", "content": "x", "tool_call_id": 5}]), "messages[1].tool_call_id"),
    ("tool result without content", dict(messages=[USER, {"role": "tool", "tool_call_id": "a"}]), "messages[1].content"),
    ("calls on a user message", dict(messages=[{"role": "user", "content": "x", "tool_calls": [CALL]}]), "messages[0].tool_calls"),
    ("calls not a list", dict(messages=[USER, {"role": "assistant", "tool_calls": CALL}]), "messages[1].tool_calls"),
    ("call arguments not JSON", dict(messages=[USER, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{city: Paris"}}]}]),
     "messages[1].tool_calls[0].function.arguments"),
    ("call without name", dict(messages=[USER, {"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"arguments": "{}"}}]}]), "messages[1].tool_calls[0].function.name"),
    ("call without function", dict(messages=[USER, {"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}]),
     "messages[1].tool_calls[0].function"),
    ("function role", dict(messages=[{"role": "function", "name": "f", "content": "x"}]), "messages[0].role"),
    ("legacy function_call", dict(messages=[USER, {"role": "assistant", "content": "", "function_call": {"name": "f"}}]),
     "messages[1].function_call"),
    # from a black-box test: each got a 200 whose arguments broke the schema, or named the wrong field
    ("description a number", dict(tools=[{"type": "function", "function": {"name": "f", "description": 5}}], tool_choice="none"),
     "tools[0].function.description"),
    ("parameters an enum, no type", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {"enum": [1, 2]}}}],
                                         tool_choice="none"), "tools[0].function.parameters"),
    ("parameters anyOf, no type", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "anyOf": [{"type": "string"}, {"type": "object"}]}}}], tool_choice="none"), "tools[0].function.parameters"),
    ("allOf of two (xgrammar ignores it)", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}}, {"properties": {"b": {"type": "boolean"}}}]}}}],
        tool_choice={"type": "function", "function": {"name": "f"}}), "tools[0].function.parameters"),
    ("if/then (xgrammar ignores it)", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"k": {"type": "string"}}, "if": {"properties": {"k": {"const": "x"}}},
        "then": {"required": ["v"]}}}}], tool_choice="required"), "tools[0].function.parameters"),
    ("uniqueItems deep (xgrammar ignores it)", dict(tools=[{"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}}}],
        tool_choice={"type": "function", "function": {"name": "f"}}), "tools[0].function.parameters"),
]


@pytest.mark.parametrize("name,body,param", BAD, ids=[b[0] for b in BAD])
def test_bad_tool_requests_are_400s_naming_the_field(server, name, body, param):
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": [USER], "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, (name, r.text)
    err = r.json()["error"]
    assert err["param"] == param, (name, err)
    assert err["type"] == "invalid_request_error" and err["message"]
    assert ".cc:" not in err["message"]


def test_auto_without_the_flags_is_vllms_400(client):
    with pytest.raises(BadRequestError, match='"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser'):
        chat(client, tools=TOOLS, max_tokens=4)


def test_the_flags_are_checked_at_start(hermes):
    import subprocess
    from kvserve_server import KVSERVE
    for flags, needle in [(["--enable-auto-tool-choice"], "needs --tool-call-parser"),
                          (["--tool-call-parser", "hermes"], "needs --enable-auto-tool-choice"),
                          (["--enable-auto-tool-choice", "--tool-call-parser", "mistral"], "mistral")]:
        p = subprocess.run([KVSERVE, "serve", "-m", MODEL, *flags], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0 and needle in p.stderr + p.stdout, (flags, p.stderr)


# ---- other models and front ends


def test_gemma3_named_tool_choice():
    """Gemma 3's SentencePiece vocabulary under a tool's schema (its template ignores tools)."""
    s = Server("--debug", "--chat-template", "gemma3", model=GEMMA)
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60 * SLOWDOWN)
        name = c.models.list().data[0].id
        r = c.chat.completions.create(model=name, messages=ASK, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=2, n=3,
                                      max_tokens=60, extra_body=NO_WS)
        done = [ch for ch in r.choices if ch.finish_reason == "stop"]
        assert len(done) >= 2, [calls_of(ch.message) for ch in r.choices]
        for ch in r.choices:
            assert ch.message.content is None and [tc.function.name for tc in ch.message.tool_calls] == ["get_weather"]
        for ch in done:
            jsonschema.validate(json.loads(ch.message.tool_calls[0].function.arguments), WEATHER_PARAMS)
        c.close()
        s.wait_clean()
    finally:
        s.stop()


def test_the_router_passes_tool_requests_on():
    b = Server()
    try:
        r = Router("--replica", b.url)
        try:
            c = OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=60 * SLOWDOWN)
            out = chat(c, tools=TOOLS, tool_choice=NAMED, temperature=1.0, seed=3, max_tokens=60, extra_body=NO_WS).choices[0]
            assert out.message.tool_calls[0].function.name == "get_weather"
            _, calls, reason, _ = reassemble(chat(c, tools=TOOLS, tool_choice="required", temperature=1.0, seed=3, max_tokens=120,
                                                  stream=True, extra_body=NO_WS))
            assert calls and reason in ("tool_calls", "length")
            # a follow-up conversation passes too
            assert chat(c, messages=FOLLOW_UP, max_tokens=4).choices[0].message.content is not None
            # "auto" is its backend's to refuse (this one runs without the flags); a bad tool the router's
            with pytest.raises(BadRequestError, match="--enable-auto-tool-choice"):
                chat(c, tools=TOOLS, max_tokens=4)
            with pytest.raises(BadRequestError) as e:
                chat(c, tools=[WEATHER, WEATHER], tool_choice="none", max_tokens=4)
            assert e.value.body["param"] == "tools[1].function.name"
            c.close()
        finally:
            r.stop()
    finally:
        b.stop()


# ---- from a black-box test of the first version


def test_required_rebases_every_reference_of_a_tool(client):
    """"required" embeds each tool's schema in an array: its references ("#/definitions/..",
    draft-07's, as zod and pydantic v1 write them; "#/properties/.."; "#" itself) are to its own
    root. They failed to compile (definitions) or, for "#", silently pointed at the wrapper array."""
    opts = {"type": "object", "properties": {"opts": {"$ref": "#/definitions/Opts"}, "again": {"$ref": "#/properties/opts"}},
            "required": ["opts", "again"], "additionalProperties": False,
            "definitions": {"Opts": {"type": "object", "properties": {"safe": {"type": "boolean"}}, "required": ["safe"],
                                     "additionalProperties": False}}}
    tree = {"type": "object", "properties": {"v": {"type": "integer", "minimum": 0, "maximum": 9},
                                             "kids": {"type": "array", "items": {"$ref": "#"}, "maxItems": 1}},
            "required": ["v", "kids"], "additionalProperties": False}
    tools = [{"type": "function", "function": {"name": "configure", "parameters": opts}},
             {"type": "function", "function": {"name": "tree", "parameters": tree}}]
    schemas = {"configure": opts, "tree": tree}
    seen = set()
    for seed in range(4):
        r = chat(client, tools=tools, tool_choice="required", temperature=1.0, seed=seed, max_tokens=120, extra_body=NO_WS)
        for tc in r.choices[0].message.tool_calls:
            # "#" once meant the wrapper array: a kid was a list of {"name", "parameters"} calls
            assert '"name"' not in tc.function.arguments and "[[" not in tc.function.arguments, tc.function.arguments
            try:  # the calls whose JSON is whole (the last may be cut by max_tokens; a tree nests on)
                args = json.loads(tc.function.arguments)
            except ValueError:
                continue
            jsonschema.validate(args, schemas[tc.function.name])
            seen.add(tc.function.name)
    assert "configure" in seen  # measured: two whole configure calls on seed 1


def test_parameters_without_a_type_are_an_object(client):
    """{} and a schema of properties alone gave numbers and strings as arguments: they are objects."""
    for params in ({}, {"properties": {"x": {"type": "integer"}}, "required": ["x"]}):
        tools = [{"type": "function", "function": {"name": "f", "parameters": params}}]
        for seed in (1, 2):
            r = chat(client, tools=tools, tool_choice={"type": "function", "function": {"name": "f"}}, temperature=1.0, seed=seed,
                     max_tokens=40, extra_body=NO_WS)
            args = r.choices[0].message.tool_calls[0].function.arguments
            if r.choices[0].finish_reason == "stop":
                assert isinstance(json.loads(args), dict), args


def test_unenforced_schema_keywords_are_refused_for_response_format_too(server):
    """xgrammar logs a warning and ignores allOf of several schemas, if/then, uniqueItems, ...: the
    output broke the schema with finish_reason "stop". Refused, as what would change the answer is;
    a property merely named "if" is a name, not the keyword."""
    bad = {"type": "object", "properties": {"a": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}}}
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 8, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": bad}}}, timeout=30)
    assert r.status_code == 400 and "uniqueItems" in r.json()["error"]["message"], r.text
    ok = {"type": "object", "properties": {"if": {"type": "string", "maxLength": 5}}, "required": ["if"], "additionalProperties": False}
    r = requests.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 30, "temperature": 0, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": ok}}, **NO_WS}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_stop_string_inside_required_calls_is_not_tool_calls(client):
    """finish_reason "tool_calls" tells a client the calls are whole: a stop string that ends the
    text inside the JSON leaves "stop" (as a named choice reports it)."""
    free = chat(client, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60, extra_body=NO_WS).choices[0]
    args = free.message.tool_calls[0].function.arguments
    cut = args[len(args) // 2:len(args) // 2 + 2]
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60, stop=[cut], extra_body=NO_WS).choices[0]
    assert r.finish_reason == "stop"


def test_ignore_eos_ends_a_named_call_when_its_json_is_whole(client):
    """The grammar's end of text ended nothing under ignore_eos: decoding went on unconstrained and
    the arguments ran into chat text. Now the choice ends there, the arguments valid JSON."""
    r = chat(client, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=60, extra_body={"ignore_eos": True, **NO_WS}).choices[0]
    assert r.finish_reason == "stop", r
    assert valid(r.message.tool_calls[0].function.arguments, WEATHER_PARAMS)
    r = chat(client, temperature=0, max_tokens=60, extra_body={"ignore_eos": True, "structured_outputs": {"json": WEATHER_PARAMS,
                                                                                                         "disable_any_whitespace": True}})
    assert r.choices[0].finish_reason == "stop" and valid(r.choices[0].message.content, WEATHER_PARAMS)


def test_auto_keeps_one_call_without_parallel_tool_calls(hermes):
    """parallel_tool_calls false under "auto" was a 400 (LangChain sends it): the first call is kept."""
    _, hc = hermes
    r = hc.chat.completions.create(model=MODEL_NAME, messages=ASK, tools=TOOLS, temperature=1.0, seed=3, max_tokens=80,
                                   parallel_tool_calls=False, extra_body={"structured_outputs": {"regex": FORCED_TWO}})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and len(c.message.tool_calls) == 1


def test_a_required_choice_cut_before_its_first_name_keeps_its_text(client):
    """max_tokens can end a "required" answer before its first call's name is whole: the message had
    no content and no calls, the text was lost (a black-box test). The text is the content now,
    streamed or not, with finish_reason "length"."""
    whole = chat(client, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=60, extra_body=NO_WS).choices[0]
    assert whole.message.tool_calls
    r = chat(client, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=3, extra_body=NO_WS).choices[0]
    assert r.finish_reason == "length" and not r.message.tool_calls, r
    assert r.message.content and r.message.content.startswith("["), r
    streamed = "".join(ch.choices[0].delta.content or "" for ch in chat(client, tools=TOOLS, tool_choice="required", temperature=0,
                                                                        max_tokens=3, stream=True, extra_body=NO_WS) if ch.choices)
    assert streamed == r.message.content
