#!/usr/bin/env python3
"""Deterministic tokenizer conformance corpus for Gemma 3 (SentencePiece-style BPE, seeded).

    python3 tests/tokenizer/make_corpus_gemma.py > corpus.txt   # or import make_corpus()

The SmolLM2 corpus (make_corpus.py) aims at byte-level pre-tokenizer regexes; a SentencePiece
vocabulary fails elsewhere, so this one adds what Gemma's tokenizer must get right:
  - whitespace runs: spaces become U+2581 and runs of 2..31 are single user-defined tokens,
    runs of 32 and more must be cut the way SentencePiece cuts them; tab and newline runs are
    user-defined tokens of their own; mixed runs; a literal U+2581 in the text;
  - Gemma's control and user-defined spellings (<start_of_turn>, <unused12>, [multimodal],
    <start_of_image>, HTML tags such as <table> and </td>), whole, partial and glued;
  - characters the vocabulary lacks (byte fallback to <0xXX>): rare CJK, private use, plane
    2-16, C0 controls, emoji sequences;
  - the chat-template shape, code with deep indentation, and the SmolLM2 pools (prose, code,
    CJK, RTL, emoji, numerals, contractions, URLs) for everything else.
Only valid scalar values: the oracle takes Python str (invalid UTF-8 is a C++ unit test).
"""
from __future__ import annotations

import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_corpus as base  # noqa: E402

SEED = 20250312
N_MIN = 2000

SPECIAL = ["<start_of_turn>", "<end_of_turn>", "<bos>", "<eos>", "<pad>", "<unk>", "<mask>", "<unused0>",
           "<unused12>", "<unused6241>", "<unused6242>", "<unused>", "[multimodal]", "<start_of_image>",
           "<end_of_image>", "<start_of_turn", "start_of_turn>", "<<start_of_turn>>", "<start_of_turn><end_of_turn>",
           "<START_OF_TURN>", "< start_of_turn >", "<|im_start|>", "<s>", "</s>", "<table>", "</table>", "<td>",
           "</td>", "<tr><td>x</td></tr>", "<h1>Title</h1>", "<b>bold</b>", "<code>x = 1</code>", "<div class=\"x\">",
           "<br>", "<p>", "<unused1>2", "<eos><eos>", "<bos> hi", "x<end_of_turn>y", "\n<start_of_turn>model\n"]
WS = [" " * n for n in (1, 2, 3, 4, 7, 8, 15, 16, 17, 30, 31, 32, 33, 40, 62, 63, 64, 65, 100)] + \
     ["\t" * n for n in (1, 2, 3, 8, 30, 31, 32, 40)] + \
     ["\n" * n for n in (1, 2, 3, 8, 30, 31, 32, 40)] + \
     [" \n", "\n ", "\t ", " \t", "  \n  ", "\n\t", "\t\n", "\r\n", "\r", "\r\n\r\n", " \r\n", "\u00a0", "\u00a0\u00a0",
      "\u3000", "\u2003", "\u200b", "\u0085", "\f", "\v", "\u2581", "\u2581\u2581", "\u2581 \u2581", " \u2581",
      "\u2581x", "x\u2581", "\u2581" * 40, " \t \t ", "\n \n \n"]
BYTE_FALLBACK = ["\u0000", "\u0001", "\u001f", "\u007f", "\ue000", "\U000f0000", "\U00100000", "\U0002a6d6",
                 "\U0003134a", "\u4dff", "\u9fff", "\ua4d0", "\U0001f9ff\U0001faf8", "\U0001f3f4\U000e0067\U000e0062"
                 "\U000e0073\U000e0063\U000e0074\U000e007f", "\u0378", "\ud7ff", "\ufffd", "\uffff", "\U0010fffd"]
CHAT = [
    "<bos><start_of_turn>user\nWhat is 2+2?<end_of_turn>\n<start_of_turn>model\n",
    "<start_of_turn>user\nTranslate to French:  \"Good   morning\"\n\n<end_of_turn>\n<start_of_turn>model\nBonjour<end_of_turn>\n",
    "<start_of_turn>system\nYou are terse.<end_of_turn>\n<start_of_turn>user\n<start_of_image>[multimodal]<end_of_image> what?<end_of_turn>",
]
CODE = base.CODE + [
    "class A:\n    def f(self):\n        if x:\n            return [\n                1,\n            ]\n",
    "{\n\t\t\t\"deep\": {\n\t\t\t\t\"deeper\": null\n\t\t\t}\n}",
    "int main() {" + "\n" + " " * 36 + "return 0;\n}",
    "|  a  |  b  |\n|-----|-----|\n|  1  |  2  |",
    "# Title\n\n* item one\n* item two\n\n```python\nprint('x')\n```\n",
]
POOLS = [base.PROSE, CODE, base.CJK, base.EMOJI, base.ACCENTS, base.RTL, SPECIAL, base.CONTRACTIONS, base.URLS,
         base.NUMS, WS, BYTE_FALLBACK, base.UNICODE_EDGE]
WEIGHTS = [4, 3, 2, 2, 2, 2, 3, 1, 1, 2, 5, 2, 1]


def make_corpus(seed: int = SEED) -> list[str]:
    rng = random.Random(seed)
    out: list[str] = []
    for group in (*POOLS, CHAT):
        out.extend(group)
    out += ["", "a", "a" * 1000, "ab" * 700, base.rand_word(rng, 3000), "9" * 500, " " * 300, "\n" * 100,
            "\t" * 100, "😀" * 200, "x" + " " * 50 + "y", "end with spaces   ", "end with newline\n", "\ttab start",
            " leading space", "  two leading", "\u2581leading", "▁▁▁" + " " * 5 + "▁"]
    out.append(json.dumps({"emoji": "😀", "cjk": "漢字", "n": [1, 2]}, ensure_ascii=False, indent=4))
    while len(out) < N_MIN + 200:
        kind = rng.random()
        if kind < 0.6:  # mixtures of pieces with random glue
            parts = []
            for _ in range(rng.randint(1, 8)):
                piece = rng.choice(rng.choices(POOLS, WEIGHTS)[0])
                if len(piece) > 40 and rng.random() < 0.5:
                    a = rng.randrange(len(piece))
                    piece = piece[a:a + rng.randint(1, 40)]
                parts.append(piece)
                parts.append(rng.choice(["", "", " ", "  ", " " * rng.randint(3, 40), "\n", "\t", "\u2581",
                                         base.rand_word(rng, rng.randint(1, 6)), str(rng.randint(0, 99999))]))
            out.append("".join(parts))
        elif kind < 0.75:
            out.append(base.rand_unicode(rng, rng.randint(1, 40)))
        elif kind < 0.85:  # words between whitespace runs of every length
            ws = [" ", "\t", "\n", "\u2581", "\u00a0"]
            out.append("".join(rng.choice(ws) * rng.randint(1, 40) + base.rand_word(rng, rng.randint(0, 5))
                               for _ in range(rng.randint(1, 5))))
        elif kind < 0.93:  # html-ish and special-ish glue
            tags = ["<table>", "</table>", "<tr>", "<td>", "</td>", "<b>", "</b>", "<s>", "<u>", "<unused3>",
                    "<start_of_turn>", "<end_of_turn>", "[multimodal]", "<", ">", "</", "/>", "<eos>", "<bos>"]
            out.append("".join(rng.choice(tags) + rng.choice(["", " ", "x", "\n", "  "]) for _ in range(rng.randint(1, 8))))
        else:  # digit and whitespace runs
            out.append("".join(rng.choice(["1", "23", "456", " ", "  ", "\t", "\n", ".", ",", "x"])
                               for _ in range(rng.randint(1, 30))))
    return out


if __name__ == "__main__":
    for s in make_corpus():
        sys.stdout.write(json.dumps(s, ensure_ascii=False) + "\n")
