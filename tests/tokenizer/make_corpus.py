#!/usr/bin/env python3
"""Deterministic tokenizer conformance corpus (seeded): prints one JSON string per line.

    python3 tests/tokenizer/make_corpus.py > corpus.txt        # or import make_corpus()

Covers what byte-level BPE pre-tokenizers get wrong: prose, code, digit runs, whitespace runs
(spaces, tabs, newlines, mixed, trailing), CJK, emoji incl. ZWJ sequences, combining marks,
RTL, special-token spellings (whole, partial, glued), contractions, URLs, JSON, very long
words and random unicode (valid scalar values only: the oracle takes Python str).
"""
from __future__ import annotations

import json
import random
import sys

SEED = 20240601
N_MIN = 2000

PROSE = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a truth universally acknowledged, that a single man in possession of a good fortune must be in want of a wife.",
    "We'll see what they're doing; I'd rather you'd've told me. You're RIGHT, it's FINE, WE'LL GO.",
    "Mr. O'Neil's dog—a beagle—barked at 3 a.m. (again!).",
    "Hello, world! How are you today?",
    "In 1492, Columbus sailed the ocean blue; in 1969, humans walked on the Moon.",
    "She said: \"Don't stop.\" He replied, 'Why not?'",
    "Large language models predict the next token given a prefix.",
    "  Leading spaces, trailing spaces   ",
    "ALL CAPS SENTENCE WITH NUMBERS 123 AND SYMBOLS #@!",
]
CODE = [
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "#include <stdio.h>\nint main(void) {\n\tprintf(\"%d\\n\", 42);\n\treturn 0;\n}\n",
    "fn main() {\n    let v: Vec<i32> = (0..10).map(|x| x * x).collect();\n    println!(\"{:?}\", v);\n}",
    "const add = (a, b) => a + b;\nconsole.log(add(1, 2)); // 3\n",
    "SELECT id, name FROM users WHERE age >= 18 ORDER BY name DESC LIMIT 10;",
    "for i in $(seq 1 10); do echo \"$i\"; done\n",
    "public class Hello { public static void main(String[] args) { System.out.println(\"Hi\"); } }",
    "<div class=\"container\"><p>Hello &amp; welcome</p></div>",
    "x = [1,2,3]\r\ny = {'a': 1, \"b\": 2.5e-3}\r\n",
    "package main\n\nimport \"fmt\"\n\nfunc main() {\n\tfmt.Println(\"hello\")\n}\n",
    "    \n\t\n  \t  x  \n\n\n",
    "if (a&&b||!c) { x <<= 2; y >>= 3; z ^= ~w; }",
]
CJK = ["你好，世界！", "日本語のテキストです。", "한국어 문장입니다.", "中文和English混合text", "東京タワーは333メートル"]
EMOJI = ["😀", "👍🏽", "👨‍👩‍👧‍👦", "🏳️‍🌈", "❤️", "🇯🇵", "🧑🏿‍💻", "🙂🙃", "✨🚀🔥"]
ACCENTS = ["café", "naïve", "Ångström", "résumé", "e\u0301", "a\u0308\u0301", "Zalgo: Z\u0351\u0352\u0353a\u0354\u0355l", "straße", "Øresund"]
RTL = ["مرحبا بالعالم", "שלום עולם", "العربية 123 English", "\u202bembedded\u202c", "١٢٣٤٥ ۱۲۳"]
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|endoftext|>", "<repo_name>", "<file_sep>", "<jupyter_code>",
           "<empty_output>", "<|im_", "<|im_start", "im_end|>", "<|", "|>", "<|endoftext", "<<|im_start|>>",
           "<|im_start|><|im_end|>", "<|IM_START|>", "< |im_start| >"]
CONTRACTIONS = ["'s", "'t", "'re", "'ve", "'m", "'ll", "'d", "'S", "'LL", "'RE", "'Ve", "''s", "'", "’s"]
URLS = ["https://example.com/path?q=1&r=two#frag", "http://localhost:8080/api/v1/items/42",
        "mailto:someone@example.org", "ftp://files.example.net/pub/a_b-c.tar.gz"]
NUMS = ["0", "7", "42", "123456789012345678901234567890", "3.14159", "-0.001", "1e-9", "1,000,000",
        "2024-06-01", "12:34:56", "0x1F", "½", "²³", "Ⅻ", "①②③", "٣٤٥", "१२३", "１２３"]
# Where regex engines disagree: U+180E is \s for PCRE2 but not for Unicode >= 6.3 (HF); letters
# and digits new in Unicode 15-16 are unassigned to PCRE2 10.42's tables.
UNICODE_EDGE = ["x  \u180e", "\u180e's", "a\u180eb", "\U0002eded's", "\U00031350\U00031351 x", "𐵀𐵁 9",
                "\U0001e5f1\U0001e5f2", "\u1c89\u1c8a's", "\ufeff\u200bword", "\u2028\u2029 z", "\u0085x",
                "\u1680\u1680a", "\U000113b7'll"]
WS = [" ", "  ", "   ", "\t", "\t\t", "\n", "\n\n", "\r\n", " \n ", "\t \n", "\u00a0", "\u3000", "\u2003", "\u200b", "\u0085", "\f", "\v"]


def rand_unicode(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.3:
            cp = rng.randint(0x20, 0x7E)
        elif r < 0.5:
            cp = rng.randint(0xA0, 0x7FF)
        elif r < 0.8:
            cp = rng.randint(0x800, 0xFFFD)
        else:
            cp = rng.randint(0x10000, 0x10FFFF)
        if 0xD800 <= cp <= 0xDFFF:
            cp = 0xFFFD
        out.append(chr(cp))
    return "".join(out)


def rand_word(rng: random.Random, n: int) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(n))


def make_corpus(seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    # Fixed pieces on their own first: each is a known hard case.
    for group in (PROSE, CODE, CJK, EMOJI, ACCENTS, RTL, SPECIAL, CONTRACTIONS, URLS, NUMS, WS, UNICODE_EDGE):
        out.extend(group)
    out += ["", "a", "a" * 1000, "ab" * 700, rand_word(rng, 3000), "9" * 500, " " * 300, "\n" * 100,
            "😀" * 200, "x" + " " * 50 + "y", "end with spaces   ", "end with newline\n", "\ttab start"]
    out.append(json.dumps({"name": "kvserve", "n": [1, 2, 3], "ok": True, "nested": {"k": None, "f": 1.5}}))
    out.append(json.dumps({"emoji": "😀", "cjk": "漢字"}, ensure_ascii=False, indent=2))
    # Chat-shaped strings, as the server will send them.
    out.append("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
               "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")
    pools = [PROSE, CODE, CJK, EMOJI, ACCENTS, RTL, SPECIAL, CONTRACTIONS, URLS, NUMS, WS, UNICODE_EDGE]
    weights = [4, 3, 2, 2, 2, 2, 2, 2, 1, 3, 4, 1]
    while len(out) < N_MIN + 200:
        kind = rng.random()
        if kind < 0.65:  # mixtures of pieces joined with random glue
            parts = []
            for _ in range(rng.randint(1, 8)):
                pool = rng.choices(pools, weights)[0]
                piece = rng.choice(pool)
                if len(piece) > 40 and rng.random() < 0.5:
                    a = rng.randrange(len(piece))
                    piece = piece[a:a + rng.randint(1, 40)]
                parts.append(piece)
                parts.append(rng.choice(["", "", " ", "  ", "\n", "\t", rand_word(rng, rng.randint(1, 6)), str(rng.randint(0, 99999))]))
            out.append("".join(parts))
        elif kind < 0.8:
            out.append(rand_unicode(rng, rng.randint(1, 40)))
        elif kind < 0.9:  # words with contractions and case
            w = rand_word(rng, rng.randint(1, 12))
            w = w.upper() if rng.random() < 0.3 else w
            out.append(w + rng.choice(CONTRACTIONS) + rng.choice(["", " ", " and more", "\n"]))
        else:  # digit and whitespace runs
            out.append("".join(rng.choice(["1", "23", "456", " ", "  ", "\t", "\n", ".", ",", "x"]) for _ in range(rng.randint(1, 30))))
    return out


if __name__ == "__main__":
    for s in make_corpus():
        sys.stdout.write(json.dumps(s, ensure_ascii=False) + "\n")
