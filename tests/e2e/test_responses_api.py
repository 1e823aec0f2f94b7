"""OpenAI's Responses API (src/server/responses_api.h): POST /v1/responses and the stored responses,
through the official `openai` client against a real server on the real model.

Oracles independent of the Responses code: the `openai` client's own types (a Response and every
stream event validated strictly with pydantic, `output_text`, the `responses.stream` helper); the
chat endpoint of the same server (at temperature 0 the same conversation gives the same text and
the same prompt tokens); `jsonschema` for structured output and call arguments; transformers' Jinja
renderer and HuggingFace `tokenizers` for a conversation with a call and its output; /metrics for
the pages a vanished stream leaves.
"""
from __future__ import annotations

import json
import os
import sys

import jsonschema
import pytest
import requests
from openai import BadRequestError, NotFoundError, OpenAI
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from kvserve_server import MODEL, MODEL_NAME, ROOT, SLOWDOWN, Router, Server, leave_mid_stream

sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import tokenizer_ref  # noqa: E402

EVENT = TypeAdapter(ResponseStreamEvent)
WEATHER_PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.", "parameters": WEATHER_PARAMS}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 30}, "age": {"type": "integer", "minimum": 0}},
          "required": ["name", "age"], "additionalProperties": False}


def create(c, **kw):
    kw.setdefault("model", MODEL_NAME)
    if kw.get("stream"):
        return c.responses.create(**kw)
    raw = c.responses.with_raw_response.create(**kw)
    Response.model_validate_json(raw.http_response.text)  # strictly: every field the client's type requires, with its type
    return raw.parse()


def chat_text(c, messages, **kw):
    r = c.chat.completions.create(model=MODEL_NAME, messages=messages, **kw)
    return r.choices[0].message.content, r.usage.prompt_tokens


def test_a_string_input_gives_a_response_in_openais_shape(client):
    r = create(client, input="Name a colour.", temperature=0, max_output_tokens=24, metadata={"k": "v"}, user="u1")
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL_NAME
    assert r.status in ("completed", "incomplete") and r.output_text
    msg = r.output[0]
    assert msg.type == "message" and msg.id.startswith("msg_") and msg.role == "assistant"
    assert msg.content[0].type == "output_text" and msg.content[0].annotations == []
    u = r.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens_details.reasoning_tokens == 0
    assert r.metadata == {"k": "v"} and r.user == "u1" and r.max_output_tokens == 24 and r.temperature == 0
    # OpenAI's limits count characters, not bytes (64 'é' were refused; a black-box test)
    wide = {"é" * 64: "é" * 512}
    assert create(client, input="Hi.", max_output_tokens=2, metadata=wide).metadata == wide
    assert r.truncation == "disabled" and r.store is True and r.tools == [] and r.parallel_tool_calls is True
    # the same conversation through chat
    text, prompt = chat_text(client, [{"role": "user", "content": "Name a colour."}], temperature=0, max_tokens=24)
    assert r.output_text == text and u.input_tokens == prompt


def test_items_instructions_and_roles_render_as_chat_does(client):
    items = [{"role": "developer", "content": "Answer briefly."},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2+2?"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "4.", "annotations": []}]},
             {"role": "user", "content": "And 3+3?"}]
    r = create(client, input=items, instructions="You are a calculator.", temperature=0, max_output_tokens=20)
    as_chat = [{"role": "system", "content": "You are a calculator."}, {"role": "system", "content": "Answer briefly."},
               {"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}, {"role": "user", "content": "And 3+3?"}]
    text, prompt = chat_text(client, as_chat, temperature=0, max_tokens=20)
    assert (r.output_text, r.usage.input_tokens) == (text, prompt)
    assert r.instructions == "You are a calculator."


def test_max_output_tokens_makes_it_incomplete(client):
    r = create(client, input="Write a long story about a dragon.", max_output_tokens=5, temperature=0)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[0].status == "incomplete" and r.usage.output_tokens == 5


def _events(stream):
    out = []
    for ev in stream:
        EVENT.validate_python(ev.model_dump(by_alias=True))
        out.append(ev)
    return out


def test_stream_events_in_order_and_deltas_make_the_whole_text(client):
    whole = create(client, input="Name three fruits.", temperature=0, max_output_tokens=30)
    evs = _events(create(client, input="Name three fruits.", temperature=0, max_output_tokens=30, stream=True))
    assert [e.sequence_number for e in evs] == list(range(len(evs)))
    types = [e.type for e in evs]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed" if whole.status == "completed" else "response.incomplete"]
    assert set(types[4:-4]) == {"response.output_text.delta"}
    deltas = "".join(e.delta for e in evs if e.type == "response.output_text.delta")
    final = evs[-1].response
    assert deltas == final.output_text == whole.output_text == evs[-4].text
    assert all(e.item_id == final.output[0].id for e in evs if e.type == "response.output_text.delta")
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert client.responses.retrieve(final.id).output_text == deltas  # a streamed response is stored too


def test_raw_stream_has_event_lines_and_no_done(server):
    body = {"model": MODEL_NAME, "input": "Hi", "max_output_tokens": 5, "stream": True}
    with requests.post(server.url + "/v1/responses", json=body, stream=True, timeout=60) as r:
        assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/event-stream")
        text = r.content.decode()
    blocks = [b for b in text.split("\n\n") if b]
    for b in blocks:
        ev, data = b.split("\n")
        assert ev.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[6:])["type"] == ev[7:]
    assert "[DONE]" not in text


def test_the_stream_helper_gets_the_final_response(client):
    fmt = {"format": {"type": "json_schema", "name": "yn", "schema": {"type": "object", "properties": {"a": {"enum": ["yes", "no"]}},
                                                                       "required": ["a"], "additionalProperties": False}}}
    with client.responses.stream(model=MODEL_NAME, input="Is the sky blue?", text=fmt, max_output_tokens=40, temperature=0) as s:
        deltas = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "completed" and json.loads(final.output_text)["a"] in ("yes", "no") and deltas == final.output_text


@pytest.mark.parametrize("seed", range(4))
def test_json_schema_output_validates(client, seed):
    fmt = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    r = create(client, input="Describe a person as JSON.", text=fmt, temperature=1.0, extra_body={"seed": seed}, max_output_tokens=80)
    assert r.text.format.type == "json_schema"
    if r.status == "completed":
        jsonschema.validate(json.loads(r.output_text), PERSON)


def test_json_object_output_is_json(client):
    r = create(client, input="Give me a JSON object about a dog.", text={"format": {"type": "json_object"}}, temperature=0,
               max_output_tokens=60)
    if r.status == "completed":
        assert isinstance(json.loads(r.output_text), dict)


def test_a_call_cut_short_by_max_output_tokens_can_be_continued(client):
    """A call's arguments are opaque text (OpenAI, vLLM): the server's own incomplete call, its
    arguments not JSON yet, made every continuation a 400 (a user test)."""
    r = create(client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
               temperature=0, max_output_tokens=5)
    assert r.status == "incomplete" and r.output[0].type == "function_call"
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.output[0].arguments)
    r2 = create(client, input="Never mind. Say hello.", previous_response_id=r.id, max_output_tokens=8, temperature=0)
    assert r2.status in ("completed", "incomplete") and r2.usage.input_tokens > r.usage.input_tokens


@pytest.mark.parametrize("seed", range(3))
def test_a_named_function_gives_a_call_with_valid_arguments(client, seed):
    r = create(client, input="What is the weather in Paris?", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
               temperature=1.0, extra_body={"seed": seed}, max_output_tokens=60)
    fc = r.output[0]
    assert fc.type == "function_call" and fc.name == "get_weather" and fc.id.startswith("fc_") and fc.call_id.startswith("call_")
    assert r.output_text == "" and r.tools[0].name == "get_weather" and r.tool_choice.name == "get_weather"
    if r.status == "completed":
        jsonschema.validate(json.loads(fc.arguments), WEATHER_PARAMS)


def test_required_streams_function_call_events(client):
    evs = _events(create(client, input="Weather in Rome?", tools=[WEATHER], tool_choice="required", temperature=0,
                         max_output_tokens=80, stream=True))
    types = [e.type for e in evs]
    assert "response.function_call_arguments.delta" in types and "response.function_call_arguments.done" in types
    final = evs[-1].response
    calls = [o for o in final.output if o.type == "function_call"]
    assert calls and len(calls) == len(final.output)
    for fc in calls:  # each call's deltas make its arguments, and its done event says so
        args = "".join(e.delta for e in evs if e.type == "response.function_call_arguments.delta" and e.item_id == fc.id)
        done = next(e for e in evs if e.type == "response.function_call_arguments.done" and e.item_id == fc.id)
        assert args == fc.arguments == done.arguments
        if final.status == "completed":
            jsonschema.validate(json.loads(args), WEATHER_PARAMS)


@pytest.fixture(scope="module")
def hermes(tmp_path_factory):
    """A server whose template shows tools, calls and results (test_tool_calling.py's hermes template)."""
    from test_tool_calling import HERMES_TEMPLATE
    path = tmp_path_factory.mktemp("hermes") / "hermes.jinja"
    path.write_text(HERMES_TEMPLATE, encoding="utf-8")
    s = Server("--debug", "--chat-template", str(path), max_model_len=1024, kv_memory="64MiB")
    c = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60 * SLOWDOWN)
    yield s, c
    c.close()
    s.stop()


def test_a_function_call_output_follow_up_renders_as_transformers_does(hermes):
    from test_tool_calling import HERMES_TEMPLATE
    from transformers.utils.chat_template_utils import render_jinja_template
    s, c = hermes
    args = '{"city": "Paris", "unit": "celsius"}'
    items = [{"role": "user", "content": "What is the weather in Paris?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": args},
             {"type": "function_call_output", "call_id": "call_1", "output": "22 C and sunny"}]
    r = create(c, input=items, tools=[WEATHER], tool_choice="none", temperature=0, max_output_tokens=16)
    tools_as_vllm = [{"type": "function", "function": {"name": "get_weather", "description": WEATHER["description"],
                                                        "parameters": WEATHER_PARAMS}}]
    conv = [{"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function",
                                                                  "function": {"name": "get_weather", "arguments": json.loads(args)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22 C and sunny"}]
    rendered, _ = render_jinja_template(conversations=[conv], tools=tools_as_vllm, chat_template=HERMES_TEMPLATE, add_generation_prompt=True)
    assert "<tool_response>" in rendered[0] and '"city": "Paris"' in rendered[0]
    want = tokenizer_ref.encode(tokenizer_ref.load_tokenizer(MODEL), rendered[0])
    chat_msgs = [conv[0], {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                                  "function": {"name": "get_weather", "arguments": args}}]}, conv[2]]
    chat_tools = [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    got = requests.post(s.url + "/tokenize", json={"messages": chat_msgs, "tools": chat_tools}, timeout=30).json()["tokens"]
    assert got == want and r.usage.input_tokens == len(want)
    text, prompt = chat_text(c, chat_msgs, tools=chat_tools, tool_choice="none", temperature=0, max_tokens=16)
    assert (r.output_text, r.usage.input_tokens) == (text, prompt)


def test_previous_response_id_continues_from_the_cache(client):
    a = create(client, input="Tell me one fact about the moon.", temperature=0, max_output_tokens=40)
    b = create(client, input="Tell me another.", previous_response_id=a.id, temperature=0, max_output_tokens=30)
    assert b.previous_response_id == a.id
    assert b.usage.input_tokens_details.cached_tokens > 0
    assert b.usage.input_tokens_details.cached_tokens >= a.usage.input_tokens // 16 * 16 - 16
    whole = create(client, input=[{"role": "user", "content": "Tell me one fact about the moon."}, *[o.model_dump() for o in a.output],
                                  {"role": "user", "content": "Tell me another."}], temperature=0, max_output_tokens=30, store=False)
    assert (b.output_text, b.usage.input_tokens) == (whole.output_text, whole.usage.input_tokens)
    # instructions are not carried over: a third turn with its own
    c3 = create(client, input="Thanks.", previous_response_id=b.id, instructions="Be terse.", temperature=0, max_output_tokens=8)
    assert c3.instructions == "Be terse." and c3.usage.input_tokens > b.usage.input_tokens


def test_input_items_list_the_whole_conversation_with_ids_and_pages(client, server):
    """GET /v1/responses/{id}/input_items through the client: every item the response was made
    from (the chain's earlier inputs and outputs, then its own input), newest first by default,
    each with an id; the client's auto-paging over limit 2 gives the same list; bad queries are 400s."""
    a = create(client, input="Name a colour.", temperature=0, max_output_tokens=8)
    b = create(client, input=[{"role": "user", "content": [{"type": "input_text", "text": "And a fruit?"}]},
                              {"type": "message", "role": "user", "content": "Just one."}],
               previous_response_id=a.id, temperature=0, max_output_tokens=8)
    asc = client.responses.input_items.list(b.id, order="asc", limit=100)
    assert not asc.has_more and asc.first_id == asc.data[0].id and asc.last_id == asc.data[-1].id
    items = [i.model_dump(exclude_none=True) for i in asc.data]
    assert [(i["type"], i["role"]) for i in items] == [("message", "user"), ("message", "assistant"), ("message", "user"), ("message", "user")]
    assert items[0]["content"] == [{"type": "input_text", "text": "Name a colour."}]  # a string, as OpenAI lists it
    assert items[1]["id"] == a.output[0].id and items[1]["content"][0]["text"] == a.output_text
    assert items[2]["content"][0]["text"] == "And a fruit?" and items[3]["content"][0]["text"] == "Just one."
    ids = [i["id"] for i in items]
    assert len(set(ids)) == 4 and all(i.startswith("msg_") for i in ids)
    # the same ids on every read; a's own list is its one input item
    assert [i.id for i in client.responses.input_items.list(b.id)] == ids[::-1]  # desc by default, auto-paged
    assert [i.id for i in client.responses.input_items.list(b.id, limit=2)] == ids[::-1]
    assert [i.id for i in client.responses.input_items.list(a.id)] == ids[:1]
    page = client.responses.input_items.list(b.id, order="asc", limit=2, after=ids[0])
    assert [i.id for i in page.data] == ids[1:3] and page.has_more
    before = requests.get(f"{server.url}/v1/responses/{b.id}/input_items", params={"order": "asc", "before": ids[2]}, timeout=10).json()
    assert [i["id"] for i in before["data"]] == ids[:2] and before["has_more"] is False
    for params, param in (({"limit": "0"}, "limit"), ({"limit": "101"}, "limit"), ({"limit": "x"}, "limit"),
                          ({"order": "up"}, "order"), ({"after": "msg_nope"}, "after")):
        r = requests.get(f"{server.url}/v1/responses/{b.id}/input_items", params=params, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (params, r.text)
    with pytest.raises(NotFoundError):
        client.responses.input_items.list("resp_nope")


def test_get_delete_and_404(client, server):
    r = create(client, input="Hello!", max_output_tokens=8)
    got = client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    d = requests.delete(f"{server.url}/v1/responses/{r.id}", timeout=10)
    assert d.status_code == 200 and d.json() == {"id": r.id, "object": "response", "deleted": True}
    for call in (lambda: client.responses.retrieve(r.id), lambda: client.responses.delete(r.id),
                 lambda: create(client, input="x", previous_response_id=r.id)):
        with pytest.raises(NotFoundError) as e:
            call()
        err = e.value.body
        assert err["type"] == "invalid_request_error" and r.id in err["message"] and "param" in err and "code" in err


def test_store_false_is_not_kept(client):
    r = create(client, input="Hi", max_output_tokens=4, store=False)
    assert r.store is False
    with pytest.raises(NotFoundError):
        client.responses.retrieve(r.id)


def test_the_store_is_bounded_and_evicts_the_least_recently_used():
    s = Server("--max-stored-responses", "2")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        a, b = (create(c, input=f"Say {w}", max_output_tokens=2) for w in ("a", "b"))
        c.responses.retrieve(a.id)  # a is used: b is now the oldest
        d = create(c, input="Say d", max_output_tokens=2)
        with pytest.raises(NotFoundError):
            c.responses.retrieve(b.id)
        assert c.responses.retrieve(a.id).id == a.id and c.responses.retrieve(d.id).id == d.id
        c.close()
    finally:
        s.stop()
    s = Server("--max-stored-responses", "0")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0)
        r = create(c, input="Hi", max_output_tokens=2)
        assert r.store is False  # nothing is kept, and the response says so
        with pytest.raises(NotFoundError):
            c.responses.retrieve(r.id)
        with pytest.raises(BadRequestError) as e:
            create(c, input="Hi", previous_response_id=r.id, max_output_tokens=2)
        assert e.value.body["param"] == "previous_response_id" and "--max-stored-responses" in e.value.body["message"]
        c.close()
    finally:
        s.stop()


def test_a_stored_response_belongs_to_its_api_key():
    s = Server("--api-key", "key-a", "--api-key", "key-b")
    try:
        ca = OpenAI(base_url=s.url + "/v1", api_key="key-a", max_retries=0)
        cb = OpenAI(base_url=s.url + "/v1", api_key="key-b", max_retries=0)
        r = create(ca, input="Tell me a secret about cats.", max_output_tokens=20, temperature=0)
        for call in (lambda: cb.responses.retrieve(r.id), lambda: cb.responses.delete(r.id),
                     lambda: create(cb, input="More.", previous_response_id=r.id, max_output_tokens=2)):
            with pytest.raises(NotFoundError):
                call()
        assert ca.responses.retrieve(r.id).id == r.id
        more = create(ca, input="More.", previous_response_id=r.id, max_output_tokens=2, temperature=0)
        assert more.usage.input_tokens_details.cached_tokens > 0
        ca.close(), cb.close()
    finally:
        s.stop()


def test_a_continuation_keeps_the_cache_salt(client):
    a = create(client, input="List four planets.", temperature=0, max_output_tokens=30, extra_body={"cache_salt": "tenant-x"})
    b = create(client, input="And one more.", previous_response_id=a.id, temperature=0, max_output_tokens=4)
    assert b.usage.input_tokens_details.cached_tokens > 0  # under the salt of a, whose pages those are
    c = create(client, input="And one more.", previous_response_id=a.id, temperature=0, max_output_tokens=4,
               extra_body={"cache_salt": "tenant-y"})
    assert c.usage.input_tokens_details.cached_tokens == 0  # another salt reaches none of them


def test_logprobs_with_include(client):
    r = create(client, input="Say hello.", temperature=0, max_output_tokens=8, include=["message.output_text.logprobs"], top_logprobs=3)
    part = r.output[0].content[0]
    assert len(part.logprobs) == r.usage.output_tokens
    assert all(len(lp.top_logprobs) == 3 and lp.logprob <= 0 for lp in part.logprobs)
    assert all(lp.top_logprobs[0].logprob >= lp.logprob - 1e-6 for lp in part.logprobs)  # temperature 0 draws the top token
    assert "".join(lp.token for lp in part.logprobs) == part.text
    assert r.top_logprobs == 3
    plain = create(client, input="Say hello.", temperature=0, max_output_tokens=8)
    assert plain.output[0].content[0].logprobs == [] and plain.output_text == part.text
    evs = _events(create(client, input="Say hello.", temperature=0, max_output_tokens=8, include=["message.output_text.logprobs"],
                         top_logprobs=1, stream=True))
    streamed = [lp for e in evs if e.type == "response.output_text.delta" for lp in e.logprobs]
    assert [lp.token for lp in streamed] == [lp.token for lp in part.logprobs]


def test_truncation_auto_drops_the_oldest_items(server, client):
    long_turns = []
    for k in range(12):
        long_turns += [{"role": "user", "content": f"Question {k}: " + "tell me about the history of tea " * 4},
                       {"role": "assistant", "content": "Tea was first drunk in China, long ago. " * 3}]
    items = long_turns + [{"role": "user", "content": "Summarize."}]
    with pytest.raises(BadRequestError) as e:
        create(client, input=items, max_output_tokens=32)
    assert e.value.body["param"] == "input"
    r = create(client, input=items, max_output_tokens=32, truncation="auto", temperature=0)
    assert r.truncation == "auto" and r.usage.input_tokens + 32 <= 512 and r.output_text


def test_truncation_auto_drops_whole_turns(server, client):
    """The kept part starts at a user message: dropping one item at a time left an assistant turn
    first, which Gemma 3's template refuses (a user test). Oracle: the chat endpoint given the
    last user message alone, at temperature 0."""
    items = [{"role": "user", "content": "tell me about the history of tea " * 80},
             {"role": "assistant", "content": "Tea is old."},
             {"role": "user", "content": "Summarize."}]
    r = create(client, input=items, max_output_tokens=16, truncation="auto", temperature=0)
    chat = client.chat.completions.create(model=MODEL_NAME, messages=items[2:], max_tokens=16, temperature=0)
    assert r.usage.input_tokens == chat.usage.prompt_tokens
    assert r.output_text == chat.choices[0].message.content


BAD = [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": []}, "input"),
    ({"input": [5]}, "input[0]"),
    ({"input": [{"role": "user"}]}, "input[0].content"),
    ({"input": [{"content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}]},
     "input[1].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ({"input": [{"role": "user", "content": [{"text": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "x"}]}]}, "input[0].content[0].type"),
    ({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}, {"type": "bogus"}]}, "input[2].type"),
    ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}]}, "input[0].arguments"),  # text, opaque: "{nope" is taken
    # a wrong type deep in an item names its path (it named the bare field; a black-box test)
    ({"input": [{"role": "user", "content": [{"type": "input_text", "text": 1}]}]}, "input[0].content[0].text"),
    ({"input": [{"type": "function_call", "call_id": 5, "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
    ({"input": [{"type": "function_call_output", "call_id": "c"}]}, "input[0].output"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": "x", "instructions": 3}, "instructions"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": "9"}, "max_output_tokens"),
    ({"input": "x", "temperature": 3}, "temperature"),
    ({"input": "x", "top_p": 0}, "top_p"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{"type": "function"}]}, "tools[0].name"),
    ({"input": "x", "tools": [{"type": "function", "function": {"name": "f"}}]}, "tools[0]"),
    ({"input": "x", "tools": [WEATHER, WEATHER], "tool_choice": "none"}, "tools[1].name"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "string"}}], "tool_choice": "none"}, "tools[0].parameters"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice"),
    ({"input": "x", "tools": [WEATHER]}, "tool_choice"),  # "auto" needs the parser flags, as chat
    ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format.type"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "schema": PERSON}}}, "text.format.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object", "uniqueItems": True,
                                                                                        "properties": {"a": {"type": "array", "uniqueItems": True}}}}}},
     "text.format"),
    ({"input": "x", "include": ["file_search_call.results"]}, "include[0]"),
    ({"input": "x", "top_logprobs": 21}, "top_logprobs"),
    ({"input": "x", "metadata": {"k": 1}}, "metadata.k"),
    ({"input": "x", "metadata": {"k": "é" * 513}}, "metadata.k"),
    ({"input": "x", "metadata": {"é" * 65: "v"}}, "metadata"),
    ({"input": "x", "truncation": "sometimes"}, "truncation"),
    ({"input": "x", "background": True}, "background"),
    ({"input": "x", "prompt": {"id": "pmpt_1"}}, "prompt"),
    ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning.effort"),
    ({"input": "x", "conversation": "conv_1"}, "conversation"),
    ({"input": "x", "previous_response_id": 7}, "previous_response_id"),
    ({"input": "x", "store": "yes"}, "store"),
    ({"input": "x", "model": "gpt-4o"}, "model"),
    ({"input": "x", "priority": 5}, "priority"),
]


@pytest.mark.parametrize("body,param", BAD, ids=[p + f"#{i}" for i, (_, p) in enumerate(BAD)])
def test_bad_requests_are_4xx_naming_the_field(server, body, param):
    r = requests.post(server.url + "/v1/responses", json=body, timeout=30)
    assert 400 <= r.status_code < 500, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error" and err["message"]


def test_a_client_that_leaves_mid_stream_frees_its_pages(server):
    leave_mid_stream(server, "/v1/responses", {"model": MODEL_NAME, "input": "Write a very long story about a dragon.",
                                               "max_output_tokens": 400, "stream": True}, b"response.output_text.delta")


def test_through_the_router():
    b1, b2 = Server(), Server()
    try:
        r = Router("--replica", b1.url, "--replica", b2.url)
        try:
            c = OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=60 * SLOWDOWN)
            a = create(c, input="Name a river.", temperature=0, max_output_tokens=20)
            evs = _events(create(c, input="Name a river.", temperature=0, max_output_tokens=20, stream=True))
            assert evs[-1].response.output_text == a.output_text
            # the id-based requests find the instance that stored it
            for _ in range(3):
                nxt = create(c, input="Another one.", previous_response_id=a.id, temperature=0, max_output_tokens=10)
                assert nxt.usage.input_tokens_details.cached_tokens > 0
            assert c.responses.retrieve(a.id).id == a.id
            listed = c.responses.input_items.list(nxt.id, order="asc", limit=2)  # the query goes through too
            assert [i.role for i in listed.data] == ["user", "assistant"] and listed.has_more
            c.responses.delete(a.id)
            with pytest.raises(NotFoundError):
                c.responses.retrieve(a.id)
            with pytest.raises(NotFoundError):
                create(c, input="x", previous_response_id=a.id, max_output_tokens=2)
            with pytest.raises(BadRequestError) as e:  # checked by the router, in the server's words
                create(c, input=[{"role": "user", "content": [{"type": "input_audio"}]}])
            assert e.value.body["param"] == "input[0].content[0].type"
            c.close()
        finally:
            r.stop()
    finally:
        b1.stop()
        b2.stop()


def test_a_stream_cut_by_the_request_timeout_fails_with_what_it_streamed():
    """--request-timeout ends a stream with response.failed: its error code one of OpenAI's (the
    client's types refused "request_timeout"), the message item closed incomplete with the text
    already streamed (it stayed in_progress and empty), the usage so far, and the failed response
    stored (GET was a 404; a black-box test)."""
    from openai.types.responses import ResponseFailedEvent
    s = Server("--request-timeout", "1", max_model_len=8192, kv_memory="256MiB")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60 * SLOWDOWN)
        fmt = {"format": {"type": "json_schema", "name": "long", "schema": {
            "type": "object", "properties": {"a": {"type": "string", "minLength": 20000}}, "required": ["a"]}}}
        events = list(c.responses.create(model=MODEL_NAME, input="Write.", text=fmt, max_output_tokens=6000, stream=True))
        failed = events[-1]
        assert failed.type == "response.failed", [e.type for e in events[-4:]]
        ResponseFailedEvent.model_validate(failed.model_dump(mode="json", by_alias=True))  # the code is one of its literals
        r = failed.response
        assert r.error.code == "server_error" and "timeout" in r.error.message
        streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert streamed and r.output[0].status == "incomplete" and r.output[0].content[0].text == streamed
        assert r.usage.output_tokens > 0
        assert c.responses.retrieve(r.id).status == "failed"
        assert s.metrics()["kvserve:kv_cache_pages_used"] == 0
    finally:
        s.stop()


def test_a_response_the_store_cannot_keep_says_store_false():
    """A response larger than --stored-responses-memory alone is not kept: it said store true and
    GET was a 404 (a black-box test). Whole and streamed, it now says false; a small one is kept."""
    s = Server("--stored-responses-memory", "3000")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60 * SLOWDOWN)
        small = c.responses.create(model=MODEL_NAME, input="Hi.", max_output_tokens=2, temperature=0)
        assert small.store is True and c.responses.retrieve(small.id).id == small.id
        big = dict(model=MODEL_NAME, input="Tell me a story.", max_output_tokens=40, temperature=0,
                   include=["message.output_text.logprobs"], top_logprobs=5)
        r = c.responses.create(**big)
        assert r.store is False
        with pytest.raises(NotFoundError):
            c.responses.retrieve(r.id)
        last = list(c.responses.create(**big, stream=True))[-1]
        assert last.type in ("response.completed", "response.incomplete") and last.response.store is False
    finally:
        s.stop()
