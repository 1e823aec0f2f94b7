"""Structured outputs (src/engine/structured_output.h): a JSON schema, JSON, a regex, a list of
choices or a GBNF grammar constrains what a choice says, in each shape clients send it (OpenAI's
response_format, vLLM's guided_* and structured_outputs, llama.cpp's json_schema and grammar).

The oracles are independent of the constraint's compiler (xgrammar): `jsonschema` validates the
JSON outputs, Python's `re` matches the regex ones, HuggingFace `tokenizers` spells the vocabulary.
Sampling at temperature 1 with several seeds explores what the constraint lets through: a choice
that ends ("stop") must satisfy it every time. A small model given free rein breaks every one of
these constraints (checked: the same requests without the constraint).
"""
from __future__ import annotations

import json
import math
import os
import re
import sys
import threading

import jsonschema
import pytest
import requests
from openai import BadRequestError, OpenAI

from kvserve_server import MODEL, MODEL_NAME, ROOT, SLOWDOWN, Router, Server

sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import tokenizer_ref  # noqa: E402

GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "pets": {"type": "array", "items": {"enum": ["cat", "dog", "fish"]}, "maxItems": 3},
        "admin": {"type": "boolean"},
    },
    "required": ["name", "age", "pets", "admin"],
    "additionalProperties": False,
}
ASK = [{"role": "user", "content": "Describe a person who owns pets, as JSON."}]
NO_WS = {"structured_outputs": {"disable_any_whitespace": True}}  # vLLM's: no free whitespace (a small model spends tokens on it)


def chat(client, **kw):
    kw.setdefault("model", MODEL_NAME)
    kw.setdefault("messages", ASK)
    return client.chat.completions.create(**kw)


def finished(choices):
    return [c for c in choices if c.finish_reason == "stop"]


def test_json_schema_outputs_validate(client):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    outs = []
    for seed in (1, 2):
        r = chat(client, response_format=fmt, temperature=1.0, seed=seed, n=4, max_tokens=120,
                 extra_body={"structured_outputs": {"disable_any_whitespace": True}} if seed == 2 else None)
        outs += r.choices
    done = finished(outs)
    assert len(done) >= 6, [c.message.content for c in outs]
    for c in done:
        jsonschema.validate(json.loads(c.message.content), PERSON)
    # without the constraint the same request answers in prose
    free = chat(client, temperature=1.0, seed=1, n=4, max_tokens=120)
    assert not all(_is_valid(c.message.content, PERSON) for c in free.choices)


def _is_valid(text, schema):
    try:
        jsonschema.validate(json.loads(text), schema)
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def _keys_in_order(text):
    pairs = json.loads(text, object_pairs_hook=lambda kv: kv)
    return [k for k, _ in pairs]


def test_properties_come_in_the_schemas_order(server, client):
    """OpenAI and vLLM generate an object's properties in the order the schema lists them (a
    "reasoning" before its "answer" is a choice the client made); the parsed body's sorted keys
    put "answer" first."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string", "maxLength": 12},
                                               "answer": {"type": "integer"}, "Zed": {"type": "boolean"}},
              "required": ["reasoning", "answer", "Zed"], "additionalProperties": False}
    want = ["reasoning", "answer", "Zed"]
    shapes = [{"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}}},
              {"guided_json": schema}, {"guided_json": json.dumps(schema)}, {"json_schema": schema},
              {"structured_outputs": {"json": schema, "disable_any_whitespace": True}}]
    for shape in shapes:
        r = requests.post(server.url + "/v1/completions", timeout=60,
                          json={"prompt": "JSON:", "max_tokens": 60, "temperature": 0, **shape})
        c = r.json()["choices"][0]
        assert c["finish_reason"] == "stop", (shape, c)
        assert _keys_in_order(c["text"]) == want, (list(shape), c["text"])
    # through the openai client too (it serializes the dict in its own order)
    r = chat(client, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
             temperature=0, max_tokens=60)
    assert _keys_in_order(r.choices[0].message.content) == want


def test_json_object_mode_gives_json(client):
    for seed in (3, 4):
        r = chat(client, response_format={"type": "json_object"}, temperature=0.8, seed=seed, n=2, max_tokens=150)
        for c in r.choices:
            if c.finish_reason == "stop":
                json.loads(c.message.content)
    g = chat(client, messages=[{"role": "user", "content": "Give the name and age of a cat as a JSON object."}],
             response_format={"type": "json_object"}, temperature=0, max_tokens=150)
    assert g.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(g.choices[0].message.content), dict)
    # an object, as OpenAI's JSON mode, even where the model would rather write a number
    r = client.completions.create(model=MODEL_NAME, prompt="The population of the city, as a number:", temperature=1.0,
                                  seed=5, n=4, max_tokens=40, extra_body={"structured_outputs": {"json_object": True}})
    for c in r.choices:
        assert c.text.lstrip().startswith("{"), c.text


@pytest.mark.parametrize("shape", ["guided_regex", "structured_outputs"])
def test_regex_output_matches_in_full(client, shape):
    pattern = r"(Mon|Tue|Wed) [0-9]{1,2}:[0-5][0-9] (am|pm)"
    body = {"guided_regex": pattern} if shape == "guided_regex" else {"structured_outputs": {"regex": pattern}}
    r = client.completions.create(model=MODEL_NAME, prompt="The meeting is on", temperature=1.0, seed=5, n=4,
                                  max_tokens=20, extra_body=body)
    assert len(finished(r.choices)) == 4
    for c in r.choices:
        assert re.fullmatch(pattern, c.text), c.text


def test_choice_output_is_one_of_them(client):
    choices = ["Paris", "London", "Rome, Italy", 'say "hi"']
    seen = set()
    for seed in (6, 7):
        r = chat(client, messages=[{"role": "user", "content": "Name a city."}], temperature=1.0, seed=seed, n=4,
                 max_tokens=10, extra_body={"guided_choice": choices})
        for c in r.choices:
            assert c.finish_reason == "stop" and c.message.content in choices, c.message.content
            seen.add(c.message.content)
    assert len(seen) >= 2  # temperature 1: not one answer forced


@pytest.mark.parametrize("field,grammar", [
    ("grammar", 'root ::= colour " " number\ncolour ::= "red" | "green" | "blue"\nnumber ::= [1-9] [0-9]?'),  # llama.cpp's GBNF
    # vLLM's xgrammar backend takes Lark too (no "::=" rule; start rule "start"); it was a 400 here
    ("guided_grammar", 'start: color " " NUMBER\ncolor: "red" | "green" | "blue"\nNUMBER: /[1-9][0-9]?/'),
], ids=["gbnf", "lark"])
def test_grammars_as_llama_cpp_and_vllm_take_them(client, field, grammar):
    r = client.completions.create(model=MODEL_NAME, prompt="A colour and a number:", temperature=1.0, seed=8, n=4,
                                  max_tokens=10, extra_body={field: grammar})
    for c in r.choices:
        assert c.finish_reason == "stop" and re.fullmatch(r"(red|green|blue) [1-9][0-9]?", c.text), c.text


def test_llama_cpp_json_schema_field(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}
    r = chat(client, temperature=0, max_tokens=30, extra_body={"json_schema": schema})
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)


def test_streamed_output_is_the_same_text(client):
    kw = dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, temperature=0.9,
              seed=11, max_tokens=120)
    whole = chat(client, **kw).choices[0].message.content
    parts = [ch.choices[0].delta.content or "" for ch in chat(client, stream=True, **kw) if ch.choices]
    assert "".join(parts) == whole


def test_logprobs_are_over_the_allowed_tokens(client):
    """As vLLM (the mask is applied before the sampler): the alternatives are tokens the choice
    list allows, and their probabilities add up to (nearly) one."""
    tok = tokenizer_ref.load_tokenizer(MODEL)
    choices = ["yes", "no"]
    r = chat(client, messages=[{"role": "user", "content": "Is water wet?"}], temperature=0, max_tokens=5,
             logprobs=True, top_logprobs=20, extra_body={"guided_choice": choices})
    first = r.choices[0].logprobs.content[0]
    alts = first.top_logprobs
    assert alts and all(any(ch.startswith(a.token) for ch in choices) for a in alts), [a.token for a in alts]
    assert math.isclose(sum(math.exp(a.logprob) for a in alts), 1.0, rel_tol=1e-3)
    assert r.choices[0].message.content in choices
    # every allowed first token: a prefix of a choice that is one token of the vocabulary
    allowed = {t for ch in choices for i in range(1, len(ch) + 1) if (t := ch[:i]) and tok.token_to_id(t) is not None}
    assert {a.token for a in alts} <= allowed


def test_bad_constraints_are_400s_with_the_reason(server):
    def post(body):
        return requests.post(server.url + "/v1/chat/completions",
                             json={"messages": ASK, "max_tokens": 4, **body}, timeout=30)
    cases = [
        ({"guided_regex": "(("}, "parenthesis"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "nonsense"}}, "nonsense"),
        ({"guided_grammar": "root ::= foo"}, "foo"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a", 1]}, "guided_choice"),
        ({"guided_choice": ["a"], "guided_regex": "b"}, "one structured-output constraint"),
        ({"response_format": {"type": "xml"}}, "json_schema"),
        ({"response_format": {"type": "json_schema"}}, "json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "schema"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structural_tag"),
        ({"structured_outputs": {"regx": "a+"}}, "unknown field 'regx'"),
        ({"structured_outputs": {}}, "names no constraint"),
        ({"structured_outputs": {"disable_any_whitespace": True}}, "names no constraint"),
        # a language with no text in it compiled, and answered "" with "stop" (a user test)
        ({"guided_grammar": 'root ::= a\na ::= a "x"'}, "matches no text"),
        ({"guided_regex": "[^\\s\\S]"}, "matches no text"),
    ]
    for body, needle in cases:
        r = post(body)
        assert r.status_code == 400, (body, r.text)
        msg = r.json()["error"]["message"]
        assert needle in msg, (body, msg)
        assert ".cc:" not in msg  # the library's source position is not the client's business
    assert post({"response_format": {"type": "text"}}).status_code == 200


def _obj(prop, **extra):
    return {"type": "object", "properties": {"a": prop}, "required": ["a"], "additionalProperties": False, **extra}


# Constraints xgrammar compiles without a part of them (it logs a warning, or nothing) and whose
# "stop" answers then broke them (a black-box test, validated with jsonschema): refused, naming why.
PARTLY_ENFORCED = [
    ("pattern and maxLength", {"guided_json": _obj({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3})}, "minLength/maxLength"),
    ("pattern and minLength", {"guided_json": _obj({"type": "string", "pattern": "^[a-z]+$", "minLength": 8})}, "minLength/maxLength"),
    ("required key not listed", {"guided_json": {"type": "object", "required": ["zzz"]}}, "required property 'zzz'"),
    ("not", {"guided_json": _obj({"type": "integer", "minimum": 0, "maximum": 9, "not": {"enum": [0, 1]}})}, "'not'"),
    ("overlapping oneOf", {"guided_json": _obj({"oneOf": [{"type": "integer", "maximum": 5}, {"type": "number", "maximum": 5}]})}, "oneOf"),
    ("multipleOf on a number", {"guided_json": _obj({"type": "number", "multipleOf": 0.25})}, "multipleOf"),
    ("limits beside $ref", {"guided_json": {**_obj({"$ref": "#/$defs/p", "minimum": 50}), "$defs": {"p": {"type": "integer"}}}},
     "beside '$ref'"),
    ("enum outside its type", {"guided_json": {"enum": [1], "type": "string"}}, "'enum' value 1"),
    ("const outside its type", {"guided_json": {"const": "a", "type": "integer"}}, "'const'"),
    ("lookahead in a pattern", {"guided_json": _obj({"type": "string", "pattern": "^(?=z)[a-z]{2}$"})}, "Lookahead"),
    ("a $ref to a URL", {"guided_json": _obj({"$ref": "https://example.com/s.json"})}, "URI"),
    ("empty anyOf", {"guided_json": {"anyOf": []}}, "empty 'anyOf'"),
    ("overlapping oneOf of types", {"guided_json": {"oneOf": [{"type": "integer"}, {"type": "number"}]}}, "oneOf"),
    ("regex \\Z", {"guided_regex": "x\\Z"}, "not recognized"),
    ("regex anchor inside", {"guided_regex": "a$b"}, "middle"),
    ("regex POSIX class", {"guided_regex": "[[:alpha:]]{2}"}, "POSIX"),
    ("POSIX class in a schema pattern", {"guided_json": _obj({"type": "string", "pattern": "^[[:alpha:]]+$"})}, "POSIX"),
    ("regex \\x{41}", {"guided_regex": "\\x{41}"}, "\\x{"),
    ("response_format without a type", {"response_format": {}}, "response_format.type"),
    ("json_schema without a name", {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "integer"}}}}, "name"),
    ("json_schema with a bad name", {"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}}, "name"),
]


@pytest.mark.parametrize("body,needle", [c[1:] for c in PARTLY_ENFORCED], ids=[c[0] for c in PARTLY_ENFORCED])
def test_constraints_enforced_only_in_part_are_400s(server, body, needle):
    for _ in range(2):  # the second time too: xgrammar's cache compiles a constraint once, and warns once
        r = requests.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert needle in err["message"] and ".cc:" not in err["message"], err
    assert requests.get(server.url + "/health", timeout=10).status_code == 200


def test_what_is_enforced_in_full_still_runs(client):
    # the neighbours of the refusals above: a discriminated oneOf, a $ref with a description,
    # integer multipleOf, a pattern or lengths alone; llama-server's json_object with a schema
    cases = [
        _obj({"oneOf": [{"type": "object", "properties": {"k": {"const": "x"}}, "required": ["k"], "additionalProperties": False},
                        {"type": "object", "properties": {"k": {"const": "y"}}, "required": ["k"], "additionalProperties": False}]}),
        {**_obj({"$ref": "#/$defs/p", "description": "d"}), "$defs": {"p": {"type": "integer", "minimum": 3, "maximum": 9}}},
        _obj({"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100}),
        _obj({"type": "string", "pattern": "^[a-z]{2,3}$"}),
        _obj({"type": "string", "minLength": 2, "maxLength": 4}),
    ]
    for schema in cases:
        r = chat(client, temperature=1.0, seed=3, max_tokens=60, extra_body={"guided_json": schema, **NO_WS})
        c = r.choices[0]
        assert c.finish_reason == "stop", (schema, c)
        jsonschema.validate(json.loads(c.message.content), schema)
    # Pydantic's discriminated union (oneOf of $refs, a const "kind" each), and oneOf over distinct types:
    # disjoint, so xgrammar's anyOf reading of them is exact (the first check refused them: a re-test)
    union = {"type": "object", "properties": {"pet": {"oneOf": [{"$ref": "#/$defs/Cat"}, {"$ref": "#/$defs/Dog"}],
                                                      "discriminator": {"propertyName": "kind"}}},
             "required": ["pet"], "additionalProperties": False,
             "$defs": {"Cat": {"type": "object", "properties": {"kind": {"const": "cat", "type": "string"}, "lives": {"type": "integer"}},
                               "required": ["kind", "lives"], "additionalProperties": False},
                       "Dog": {"type": "object", "properties": {"kind": {"const": "dog", "type": "string"}, "good": {"type": "boolean"}},
                               "required": ["kind", "good"], "additionalProperties": False}}}
    optional = {"oneOf": [{"type": "null"}, {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
                                             "additionalProperties": False}]}
    for schema in (union, optional):
        r = chat(client, temperature=1.0, seed=3, max_tokens=60, extra_body={"guided_json": schema, **NO_WS})
        assert r.choices[0].finish_reason == "stop", r.choices[0]
        jsonschema.validate(json.loads(r.choices[0].message.content), schema)
    # escaped punctuation is that character in every regex dialect (re.escape writes it): not refused
    r = chat(client, temperature=0, max_tokens=10, extra_body={"guided_regex": re.escape("C# & F#")})
    assert r.choices[0].message.content == "C# & F#"
    schema = {"type": "integer", "minimum": 10, "maximum": 99}
    r = chat(client, temperature=1.0, seed=5, max_tokens=8, response_format={"type": "json_object", "schema": schema})
    assert r.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(r.choices[0].message.content), schema)  # was any JSON object: the schema was ignored


def test_the_responses_endpoint_refuses_the_chat_endpoints_constraints(server):
    # They gave free text there; OpenAI answers an unknown parameter with a 400.
    for field, value in [("guided_regex", "[0-9]{3}"), ("structured_outputs", {"regex": "[0-9]"}), ("grammar", "root ::= \"a\""),
                         ("response_format", {"type": "json_object"}), ("guided_choice", ["a", "b"])]:
        r = requests.post(server.url + "/v1/responses", json={"input": "Say hi", "max_output_tokens": 4, field: value}, timeout=30)
        assert r.status_code == 400, (field, r.text)
        err = r.json()["error"]
        assert err["param"] == field and err["code"] == "unknown_parameter" and "text.format" in err["message"], err
    r = requests.post(server.url + "/v1/responses", json={"input": "Say hi", "max_output_tokens": 4, "max_tool_calls": 2}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tool_calls", r.text
    r = requests.post(server.url + "/v1/responses", json={"input": "Say hi", "max_output_tokens": 2, "service_tier": "auto",
                                                          "prompt_cache_key": "k", "safety_identifier": "u1"}, timeout=30)
    assert r.status_code == 200, r.text


def test_preempted_constrained_requests_stay_valid():
    """8 constrained choices in a cache too small for them all: preemption recomputes, the
    constraint's state carries over, every finished answer validates, every page comes back."""
    s = Server("--debug", kv_memory="8MiB")
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=120 * SLOWDOWN)
        fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
        results = [None] * 8

        def one(i):
            results[i] = chat(c, response_format=fmt, temperature=1.0, seed=100 + i, max_tokens=100,
                              extra_body={"structured_outputs": {"disable_any_whitespace": True}}).choices[0]
        ts = [threading.Thread(target=one, args=(i,)) for i in range(8)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert s.metrics().get("kvserve:num_preemptions_total", 0) > 0, "the cache was not small enough to preempt"
        for ch in results:
            if ch.finish_reason == "stop":
                jsonschema.validate(json.loads(ch.message.content), PERSON)
        assert len(finished(results)) >= 6
        c.close()
        s.wait_clean()
    finally:
        s.stop()


def test_router_passes_constraints_on():
    b = Server()
    try:
        r = Router("--replica", b.url)
        try:
            c = OpenAI(base_url=r.url + "/v1", api_key="x", max_retries=0, timeout=60 * SLOWDOWN)
            out = chat(c, temperature=1.0, seed=3, max_tokens=10, extra_body={"guided_choice": ["alpha", "beta"]})
            assert out.choices[0].message.content in ("alpha", "beta")
            with pytest.raises(BadRequestError, match="parenthesis"):
                chat(c, max_tokens=4, extra_body={"guided_regex": "(("})
            c.close()
        finally:
            r.stop()
    finally:
        b.stop()


def test_sentencepiece_vocabulary_gemma3():
    """Gemma 3's vocabulary (SentencePiece, ▁ for spaces, <0xXX> byte pieces) is handed over as
    bytes too: its outputs satisfy a schema and a regex with spaces and a newline."""
    s = Server("--debug", "--chat-template", "gemma3", model=GEMMA)
    try:
        c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60 * SLOWDOWN)
        name = c.models.list().data[0].id
        r = c.chat.completions.create(model=name, messages=ASK, temperature=1.0, seed=2, n=3, max_tokens=120,
                                      response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                                      extra_body={"structured_outputs": {"disable_any_whitespace": True}})
        done = finished(r.choices)
        assert len(done) >= 2, [ch.message.content for ch in r.choices]
        for ch in done:
            jsonschema.validate(json.loads(ch.message.content), PERSON)
        pattern = r"[A-Z][a-z]{1,8} [a-z]{1,8}\n[0-9]{1,3}"
        r = c.completions.create(model=name, prompt="Write:", temperature=1.0, seed=4, n=3, max_tokens=20,
                                 extra_body={"guided_regex": pattern})
        for ch in r.choices:
            assert ch.finish_reason == "stop" and re.fullmatch(pattern, ch.text), ch.text
        c.close()
        s.wait_clean()
    finally:
        s.stop()


def test_a_batch_of_prompts_shares_one_constraint(client):
    """OpenAI's batch form: each prompt's choices walk the constraint on their own."""
    r = client.completions.create(model=MODEL_NAME, prompt=["The weather is", "My answer is", "Colour:"], n=2,
                                  temperature=1.0, seed=12, max_tokens=6, extra_body={"guided_choice": ["sunny", "rainy", "grey"]})
    assert sorted(c.index for c in r.choices) == list(range(6))
    for c in r.choices:
        assert c.finish_reason == "stop" and c.text in ("sunny", "rainy", "grey"), c.text


# Jump-forward (EngineConfig::jump_forward_tokens, on by default): the text a constraint forces
# next goes into one step as a draft, verified as any draft. The oracle is the same server
# binary with it off (--jump-forward-tokens 0): every answer, greedy and seeded-sampled, must be
# the same text with the same log-probabilities, in fewer engine steps. The same holds for
# n-gram drafts under a constraint (--speculative-config), which are cut to what it allows.
JUMP_CASES = [
    ("json_schema", dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}, max_tokens=100)),
    ("json_schema_no_ws", dict(response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
                               max_tokens=100, extra_body=NO_WS)),
    ("regex", dict(messages=[{"role": "user", "content": "When is the meeting?"}], max_tokens=40,
                   extra_body={"guided_regex": r"The meeting is on (Monday|Tuesday) the [0-9]{1,2}(st|nd|rd|th) of (January|February)\."})),
    ("choice", dict(messages=[{"role": "user", "content": "Name a famous painting."}], max_tokens=30,
                    extra_body={"guided_choice": ["The Starry Night by Vincent van Gogh", "The Mona Lisa by Leonardo da Vinci"]})),
    ("grammar", dict(messages=[{"role": "user", "content": "Report the weather."}], max_tokens=40,
                     extra_body={"guided_grammar": 'root ::= "Weather report: " sky ", temperature " [0-9]+ " degrees Celsius."\n'
                                                   'sky ::= "sunny" | "cloudy" | "rainy"'})),
]


def _answers(client, sampled):
    out = []
    for name, kw in JUMP_CASES:
        kw = dict(kw)
        if sampled:
            kw.update(temperature=1.0, seed=21, n=2)
        else:
            kw.update(temperature=0)
        r = chat(client, logprobs=True, top_logprobs=2, **kw)
        for ch in r.choices:
            lps = [(t.token, round(t.logprob, 4), [(a.token, round(a.logprob, 4)) for a in t.top_logprobs]) for t in ch.logprobs.content]
            out.append((name, sampled, ch.message.content, ch.finish_reason, lps))
    return out


def test_jump_forward_says_the_same_in_fewer_steps(server, client):
    steps = "kvserve:step_phase_seconds_count{phase=\"schedule\"}"
    before = server.metrics()
    on = _answers(client, False) + _answers(client, True)
    after = server.metrics()
    forced = after["kvserve:jump_forward_draft_tokens_total"] - before["kvserve:jump_forward_draft_tokens_total"]
    taken = after["kvserve:jump_forward_accepted_tokens_total"] - before["kvserve:jump_forward_accepted_tokens_total"]
    steps_on = after[steps] - before[steps]
    for extra, label in ((["--jump-forward-tokens", "0"], "off"),
                         (["--jump-forward-tokens", "0", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'], "ngram")):
        s = Server("--debug", *extra)
        try:
            c = OpenAI(base_url=s.url + "/v1", api_key="x", max_retries=0, timeout=60 * SLOWDOWN)
            other = _answers(c, False) + _answers(c, True)
            m = s.metrics()
            c.close()
            s.wait_clean()
        finally:
            s.stop()
        for a, b in zip(on, other):
            assert a == b, f"{a[0]} (sampled: {a[1]}) differs with jump-forward on and {label}:\n{a[2]!r}\n{b[2]!r}"
        assert m["kvserve:jump_forward_draft_tokens_total"] == 0
        if label == "off":
            # a forced token taken saves its choice a step; the two choices of n=2 step together,
            # so at least half as many steps as tokens taken are saved
            assert m[steps] - steps_on >= 0.5 * taken, (m[steps], steps_on, taken)
    assert taken >= 0.5 * forced and taken >= 30, (taken, forced)
