"""The stored Gemma 3 tokenizer corpus is current and its oracle is sound: same strings as
make_corpus_gemma.py, same ids as HF (transformers' GGUF loader), every documented exception
still real and explained, the SentencePiece library agreeing with the reference everywhere, and
llama.cpp (when the peer build exists) differing only in its two known ways.
Skips only when the Gemma model file is missing (`make models`)."""
from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests", "tokenizer"))

from make_corpus_gemma import make_corpus  # noqa: E402
import oracle_gemma  # noqa: E402

CORPUS = os.path.join(ROOT, "tests/data/tokenizer/gemma3_corpus.jsonl")
MODEL = os.path.join(ROOT, "models", oracle_gemma.GGUF_NAME)
pytestmark = pytest.mark.skipif(not os.path.exists(MODEL), reason=f"{MODEL} missing: run `make models`")


@pytest.fixture(scope="module")
def rows():
    with open(CORPUS, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@pytest.fixture(scope="module")
def texts(rows):
    return [r["text"] for r in rows]


@pytest.fixture(scope="module")
def hf_tok():
    return oracle_gemma.build_transformers(os.path.join(ROOT, "models"))


@pytest.fixture(scope="module")
def sp():
    return oracle_gemma.build_sentencepiece(MODEL)


@pytest.fixture(scope="module")
def hf(hf_tok, texts):
    return oracle_gemma.encode_both(hf_tok, texts)


@pytest.fixture(scope="module")
def ref(texts):
    return oracle_gemma.encode_both(oracle_gemma.build_reference(MODEL), texts)


def test_corpus_is_current(rows):
    assert [r["text"] for r in rows] == make_corpus()
    assert len(rows) >= 2000
    assert os.path.getsize(CORPUS) < 2 * 1024 * 1024


def test_ids_match_transformers(rows, hf):
    ids, raw = hf
    assert [r["ids"] for r in rows] == ids
    assert [r["ids_raw"] for r in rows] == raw


def test_exceptions_are_exactly_the_long_space_runs(rows, hf, ref):
    (a, a_raw), (b, b_raw) = hf, ref
    n_exc = 0
    for i, r in enumerate(rows):
        differs = a[i] != b[i] or a_raw[i] != b_raw[i]
        assert ("exception" in r) == differs, r["text"]
        if differs:
            n_exc += 1
            assert r["exception"] == oracle_gemma.EXCEPTION
            assert oracle_gemma.LONG_RUN.search(r["text"]), r["text"]
            assert (r["expect"], r["expect_raw"]) == (b[i], b_raw[i])
    assert 0 < n_exc < len(rows) // 5


def test_sentencepiece_agrees_with_reference(texts, ref, sp):
    assert sp.encode(texts) == ref[1]


def test_space_run_exception_is_real(hf_tok, sp):
    # 32 spaces: transformers' GGUF loader ranks "▁ ▁" above all longer runs (position order) and
    # gives 16 + 16; SentencePiece and the score-ordered reference give 31 + 1, the 1 joining "b".
    text = "x" + " " * 32 + "b"
    assert hf_tok.encode(text, add_special_tokens=False).ids == [236781, 152, 152, 236763]
    assert sp.encode(text) == [236781, 167, 518]


def test_llama_cpp_differs_only_in_known_ways(rows, texts):
    import compare_llama_cpp as llc
    if not llc.available():
        pytest.skip("no peer llama.cpp build (bench/peer/build_llama.sh)")
    ll, ll_raw = llc.llama_cpp_ids(llc.build_driver(), texts)
    c = llc.compare(rows, ll, ll_raw)
    assert c["unexplained"] == []
    assert c["same"] > 0.85 * len(rows)
    assert c["exceptions_confirmed"] > 0
