"""The stored tokenizer corpus is current: same strings as make_corpus.py, same ids as the HF
oracle (tests/tokenizer/oracle.py), and the transformers-converter discrepancy is still real."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizer"))

from make_corpus import make_corpus  # noqa: E402
from oracle import GGUF_NAME, build_reference  # noqa: E402

CORPUS = os.path.join(ROOT, "tests/data/tokenizer/smollm2_corpus.jsonl")
MODEL = os.path.join(ROOT, "models", GGUF_NAME)


@pytest.fixture(scope="module")
def rows():
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def ref():
    assert os.path.exists(MODEL), f"{MODEL} missing: run `make models`"
    return build_reference(MODEL)


def test_corpus_is_current(rows):
    assert [r["text"] for r in rows] == make_corpus()
    assert len(rows) >= 2000
    assert os.path.getsize(CORPUS) < 3 * 1024 * 1024


def test_ids_match_oracle(rows, ref):
    got = [e.ids for e in ref.encode_batch([r["text"] for r in rows], add_special_tokens=True)]
    assert got == [r["ids"] for r in rows]


def test_converter_drops_digit_split(ref):
    # transformers' GGUF converter has no "smollm" entry: "x  1" keeps GPT-2's " 1" pre-token.
    conv = pytest.importorskip("transformers.integrations.gguf.gguf_tokenizer_mapping")
    from oracle import build_transformers
    bt, _ = build_transformers(os.path.join(ROOT, "models"))
    assert ref.encode("x  1").ids == [104, 256, 33]   # x, "ĠĠ", "1"
    assert bt.encode("x  1").ids == [104, 216, 216, 33]  # x, "Ġ", "Ġ", "1" (wrong)
    del conv
