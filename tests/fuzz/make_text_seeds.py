"""Seeds for tests/fuzz/fuzz_text.cpp: tests/fuzz/corpus_{tokenizer,template,request}/.

Run from the repo root (reads the SmolLM2 GGUF for its real chat template):
    python3 tests/fuzz/make_text_seeds.py
"""
import json
import os

import gguf

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FUZZ = os.path.join(ROOT, "tests", "fuzz")


def write(kind: str, name: str, data: bytes):
    d = os.path.join(FUZZ, f"corpus_{kind}")
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


TEXTS = ["Hello, world!", "  two  spaces\tand a tab\n", "naïve café 12345 ünïcödé", "def f(x):\n    return x**2\n",
         "<|im_start|>user\nhi<|im_end|>", "日本語のテキスト 🙂 emoji", "a" * 40, "1234567890 3.14159 -42"]
TEMPLATES = [
    "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}",
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] | trim + ' [/INST]' }}"
    "{% else %}{{ message['content'] }}{% endif %}{% endfor %}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}{{ messages | length }}",
    "{% macro f(x) %}{{ x * 2 }}{% endmacro %}{{ f(3) }}{{ 'a' ~ 'b' }}{{ [1,2,3] | join(',') }}{{ {'a': 1} | tojson }}",
    "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system') }}{% endif %}",
    "{% for i in range(10) %}{% for j in range(10) %}{{ i * j }}{% endfor %}{% endfor %}",
    # Reference cycles through a namespace (the fuzzer found `set ns.n = ns` leaking).
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns %}{% endfor %}{{ messages | length }}",
    "{% set a = namespace(l=[]) %}{% set b = namespace(a=a) %}{% set a.l = [b, a] %}{{ a.l[0].a.l | length }}",
    # A slice inside a tuple subscript (the fuzzer found its node rendered with nothing to slice).
    "{{ messages[1, 2:, 3] | join(',') }}{{ messages[0:2:1] | length }}",
    # int64 edges (the 2026-11-29 campaign: INT64_MIN // -1 trapped, negation, abs, sum and range wrapped,
    # a float past int64 was cast, '%2147483647d' padded for 48 s).
    "{{ range(1, 9223372036854775807, 9223372036854775807) | list }}{{ (-1) ** 3 }}{{ '%d|%5.2f' % (1e10, 2.5) }}"
    "{{ '1e300' | int }}{{ 'a b'.split(none, 9223372036854775807) }}{{ (-9223372036854775807 - 1) % -1 }}"
    "{{ (-9223372036854775807 - 1) // -1 }}",
    "{{ [9223372036854775807, 1] | sum }}{{ -(-9223372036854775807 - 1) | abs }}{{ '%2147483647d' % 1 }}"
    "{{ 'x' | center(1e300) }}",
]
BODIES = [
    {"prompt": "hi", "max_tokens": 4},
    {"messages": [{"role": "user", "content": "hi"}], "temperature": 0.5, "top_p": 0.9, "n": 2, "stop": ["\n"]},
    {"prompt": [1, 2, 3], "logprobs": 2, "seed": 7, "stream": True, "stream_options": {"include_usage": True}},
    {"messages": [{"role": "system", "content": "x"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}],
     "logprobs": True, "top_logprobs": 3, "max_completion_tokens": 5},
    {"prompt": "x", "kv_eviction": {"policy": "snapkv", "budget": 256, "sparse": "quest", "sparse_pages": 4}, "cache_salt": "t1"},
    {"prompt": "x", "temperature": 5}, {"model": "nope", "prompt": "x"}, [1, 2], {"prompt": ""},
    {"prompt": ["hi", "there", ""], "n": 2, "stream": True},  # OpenAI's batch form
    {"prompt": [[1, 2], [3], [4, 5, 6]], "logprobs": 1},
    {"messages": [{"role": "user", "content": "hi"}], "min_tokens": 3, "max_tokens": 8, "stop": ["."], "stop_token_ids": [2]},
]


def main():
    for i, t in enumerate(TEXTS):
        write("tokenizer", f"seed{i}", t.encode())
    write("tokenizer", "seed_bad", b"abc\xff\xfe\xc3(\xe2\x82 end")
    for i, t in enumerate(TEMPLATES):
        write("template", f"seed{i}", t.encode() + b"\0hello there")
    r = gguf.GGUFReader(os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf"))
    f = r.fields["tokenizer.chat_template"]
    write("template", "model_smollm2", bytes(f.parts[f.data[0]]) + b"\0what is 2+2?")
    for i, b in enumerate(BODIES):
        write("request", f"seed{i}", json.dumps(b).encode())
    write("request", "seed_deep", b"[" * 200 + b"]" * 200)
    write("request", "seed_broken", b'{"prompt": "abc", "max_tokens": 1e400, "n": -1')


if __name__ == "__main__":
    main()
