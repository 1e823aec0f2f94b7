#!/usr/bin/env python3
"""Gemma 3 tokenizer oracle: ids for the make_corpus_gemma.py strings from HuggingFace.

    python3 tests/tokenizer/oracle_gemma.py [--models models] [--out tests/data/tokenizer/gemma3_corpus.jsonl]

Writes one {"text", "ids", "ids_raw"} object per line:
  ids     == kvserve encode(text, add_special=true, parse_special=true)
             == HF tokenizer(text).input_ids (defaults: <bos> prepended, special tokens matched)
  ids_raw == kvserve encode(text, add_special=false, parse_special=false)
             == HF with encode_special_tokens=True and add_special_tokens=False

The oracle (A) is transformers' own GGUF path, GemmaTokenizer.from_pretrained(models, gguf_file=...)
(what AutoTokenizer dispatches to). It needs no torch to tokenize, but its GGUF reader module
imports torch at the top, so a stand-in module is installed when torch is missing.

Two independent references judge it (both over the whole corpus, every run):
  B  tests/reference/tokenizer_ref.py: `tokenizers` built as transformers' GemmaConverter builds
     tokenizer.json from Gemma's tokenizer.model (merges ordered by piece score; user-defined
     pieces score 0 there).
  C  the `sentencepiece` library itself, over a ModelProto rebuilt from the GGUF (BPE,
     byte_fallback, identity normalizer, no dummy prefix); it has no notion of parsing control
     tokens or adding BOS, so it is compared in the raw mode.
A and B differ only on runs of 32 or more spaces (or U+2581): A orders Gemma merges by token
position, so "▁ ▁" outranks every longer run and 32 spaces become 16 + 16, where SentencePiece,
B and llama.cpp (tests/tokenizer/compare_llama_cpp.py) cut the run longest-first: 31 + 1. Those
rows keep A's ids in "ids"/"ids_raw" and add
  "exception": "space-run-32", "expect": B's ids, "expect_raw": B's raw ids (== C's),
which kvserve must produce instead. The script fails if A and B differ on any other row, if an
exception row has no such run, or if B and C differ anywhere.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import sys
import types

import gguf

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
from make_corpus_gemma import make_corpus  # noqa: E402
import tokenizer_ref  # noqa: E402

GGUF_NAME = "gemma-3-270m-Q4_K_M.gguf"
LONG_RUN = re.compile("[ \u2581]{32,}")
EXCEPTION = "space-run-32"


def build_transformers(models_dir: str):
    """Oracle A: the tokenizers backend of transformers' GemmaTokenizer loaded from the GGUF."""
    import transformers  # noqa: F401  (before the stand-in: transformers probes for torch itself)
    from transformers import GemmaTokenizer
    stub = None
    if "torch" not in sys.modules and importlib.util.find_spec("torch") is None:
        stub = types.ModuleType("torch")
        stub.__getattr__ = lambda name: type(name, (), {})  # annotations in the GGUF reader module
        sys.modules["torch"] = stub
    try:
        tok = GemmaTokenizer.from_pretrained(models_dir, gguf_file=GGUF_NAME)
    finally:
        if stub is not None:  # only the GGUF reader module keeps it; nothing else may see it
            del sys.modules["torch"]
    return tok.backend_tokenizer


def build_reference(path: str):
    """Reference B (tokenizer_ref.py)."""
    return tokenizer_ref.load_tokenizer(path)


def build_sentencepiece(path: str):
    """Reference C: sentencepiece over a ModelProto rebuilt from the GGUF's pieces."""
    import sentencepiece as spm
    from sentencepiece import sentencepiece_model_pb2 as pb
    r = gguf.GGUFReader(path)
    field = lambda k: r.fields[k].contents()  # noqa: E731
    m = pb.ModelProto()
    for t, ty, s in zip(field("tokenizer.ggml.tokens"), field("tokenizer.ggml.token_type"),
                        field("tokenizer.ggml.scores")):
        p = m.pieces.add()
        p.piece = "\u2581" * len(t) if ty == 4 and t and set(t) <= {" ", "\u2581"} else t
        p.score, p.type = (0.0 if ty == 4 else s), ty
    ts = m.trainer_spec
    ts.model_type, ts.vocab_size, ts.byte_fallback = 2, len(m.pieces), True  # 2 = BPE
    ts.unk_id, ts.bos_id, ts.eos_id, ts.pad_id = (field("tokenizer.ggml.unknown_token_id"),
                                                  field("tokenizer.ggml.bos_token_id"),
                                                  field("tokenizer.ggml.eos_token_id"),
                                                  field("tokenizer.ggml.padding_token_id"))
    ns = m.normalizer_spec
    ns.name, ns.add_dummy_prefix, ns.remove_extra_whitespaces, ns.escape_whitespaces = "identity", False, False, True
    sp = spm.SentencePieceProcessor()
    sp.LoadFromSerializedProto(m.SerializeToString())
    return sp


def encode_both(tok, texts: list[str]) -> tuple[list[list[int]], list[list[int]]]:
    """(ids with <bos> and special tokens parsed, raw ids) for a `tokenizers.Tokenizer`."""
    old = tok.encode_special_tokens
    tok.encode_special_tokens = False
    ids = [e.ids for e in tok.encode_batch(texts, add_special_tokens=True)]
    tok.encode_special_tokens = True
    raw = [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)]
    tok.encode_special_tokens = old
    return ids, raw


def judge(texts, a, a_raw, b, b_raw, c_raw) -> list[str]:
    """Problems with the oracle rows (empty when A is right or a documented exception everywhere)."""
    problems = []
    for i, t in enumerate(texts):
        if b_raw[i] != c_raw[i]:
            problems.append(f"reference B and sentencepiece disagree on {t!r}")
        if (a[i] != b[i] or a_raw[i] != b_raw[i]) and not LONG_RUN.search(t):
            problems.append(f"transformers and reference B disagree on {t!r} (no 32+ space run)")
    return problems


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.path.join(ROOT, "models"))
    ap.add_argument("--out", default=os.path.join(ROOT, "tests/data/tokenizer/gemma3_corpus.jsonl"))
    args = ap.parse_args()
    path = os.path.join(args.models, GGUF_NAME)
    if not os.path.exists(path):
        raise SystemExit(f"{path} missing: run `make models`")
    corpus = make_corpus()
    a, a_raw = encode_both(build_transformers(args.models), corpus)
    b, b_raw = encode_both(build_reference(path), corpus)
    c_raw = build_sentencepiece(path).encode(corpus)
    problems = judge(corpus, a, a_raw, b, b_raw, c_raw)
    if problems:
        raise SystemExit("oracle: references disagree, not writing:\n  " + "\n  ".join(problems[:20]))
    n_exc = 0
    with open(args.out, "w", encoding="utf-8") as f:
        for i, s in enumerate(corpus):
            row = {"text": s, "ids": a[i], "ids_raw": a_raw[i]}
            if a[i] != b[i] or a_raw[i] != b_raw[i]:
                row.update({"exception": EXCEPTION, "expect": b[i], "expect_raw": b_raw[i]})
                n_exc += 1
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"oracle: {len(corpus)} strings -> {args.out} ({os.path.getsize(args.out)} bytes); "
          f"{len(corpus) - n_exc} plain, {n_exc} '{EXCEPTION}' exceptions; sentencepiece agrees with "
          f"the reference on all {len(corpus)}")


if __name__ == "__main__":
    main()
