#!/usr/bin/env python3
"""Tokenizer oracle: token ids for the make_corpus.py strings from HuggingFace `tokenizers`.

    python3 tests/tokenizer/oracle.py [--models models] [--out tests/data/tokenizer/smollm2_corpus.jsonl]

Writes one {"text", "ids"} object per line; "ids_raw" is added where parsing special tokens
changes the result (ids with parse_special=false, i.e. tokenizers' encode_special_tokens=True).

Comparison mode (documented contract for tests/unit/test_tokenizer.cpp):
  ids     == kvserve encode(text, add_special=true, parse_special=true)
             == HF tokenizer.encode(text) with defaults (add_special_tokens=True; added special
             tokens are matched in the text). SmolLM2 adds no BOS/EOS (add_bos_token False and the
             real tokenizer.json post-processor adds nothing), so add_special changes nothing here.
  ids_raw == kvserve encode(text, add_special=false, parse_special=false)

Which HF tokenizer: transformers' GGUF path (AutoTokenizer.from_pretrained(dir, gguf_file=...))
is tried first, but (a) in this environment it imports torch, which is not installed, and (b)
its converter (transformers/integrations/gguf/gguf_tokenizer_mapping.py) has no entry for
tokenizer.ggml.pre == "smollm" in GGUF_PRE_TOKENIZER_SPLITS, so it keeps GPT2Tokenizer's plain
ByteLevel(use_regex=True) pre-tokenizer and drops the Digits(individual_digits=True) step that
SmolLM2's real tokenizer.json has. So the oracle is built here from the GGUF vocab + merges with
the real pipeline:
    pre_tokenizer = Sequence[Digits(individual_digits=True),
                             ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]
    decoder = ByteLevel; CONTROL tokens added as special, USER_DEFINED as plain added tokens.
`--check-converter` runs the transformers converter directly (no torch needed) and prints every
corpus string on which it disagrees.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import gguf
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_corpus import make_corpus  # noqa: E402

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"

# tokenizer.ggml.pre -> HF pre-tokenizers (as in the models' own tokenizer.json)
PRE = {
    "smollm": lambda: pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)]),
    "gpt-2": lambda: pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
}


def field(reader, key):
    f = reader.fields.get(key)
    return None if f is None else f.contents()


def build_reference(path: str) -> Tokenizer:
    r = gguf.GGUFReader(path)
    if field(r, "tokenizer.ggml.model") != "gpt2":
        raise SystemExit("oracle: only byte-level BPE (gpt2) GGUFs")
    pre = field(r, "tokenizer.ggml.pre")
    tokens = field(r, "tokenizer.ggml.tokens")
    types = field(r, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field(r, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = PRE[pre]()
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, special=False, normalized=False)
                    for t, ty in zip(tokens, types) if ty == 4])
    assert tok.get_vocab_size() == len(tokens)
    return tok


def build_transformers(models_dir: str):
    """The transformers GGUF converter's tokenizer, or (None, reason)."""
    try:
        from transformers import AutoTokenizer
        t = AutoTokenizer.from_pretrained(models_dir, gguf_file=GGUF_NAME)
        return t.backend_tokenizer, "AutoTokenizer"
    except Exception as e:  # torch missing: call the converter itself
        reason = f"AutoTokenizer failed ({type(e).__name__}); converter called directly"
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer)
    r = gguf.GGUFReader(os.path.join(models_dir, GGUF_NAME))
    d = {}
    for key, name in GGUF_TOKENIZER_MAPPING["tokenizer"].items():
        v = field(r, "tokenizer." + key)
        if v is not None:
            d[name] = v
    bt, _ = convert_gguf_tokenizer(field(r, "general.architecture"), d)
    return bt, reason


def main() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(os.path.dirname(here))
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default=os.path.join(root, "models"))
    ap.add_argument("--out", default=os.path.join(root, "tests/data/tokenizer/smollm2_corpus.jsonl"))
    ap.add_argument("--check-converter", action="store_true")
    args = ap.parse_args()

    path = os.path.join(args.models, GGUF_NAME)
    if not os.path.exists(path):
        raise SystemExit(f"{path} missing: run `make models`")
    ref = build_reference(path)
    corpus = make_corpus()
    enc = ref.encode_batch(corpus, add_special_tokens=True)
    ref.encode_special_tokens = True
    raw = ref.encode_batch(corpus, add_special_tokens=False)
    ref.encode_special_tokens = False
    with open(args.out, "w", encoding="utf-8") as f:
        for s, e, r in zip(corpus, enc, raw):
            row = {"text": s, "ids": e.ids}
            if r.ids != e.ids:
                row["ids_raw"] = r.ids
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    print(f"oracle: {len(corpus)} strings -> {args.out} ({os.path.getsize(args.out)} bytes)")

    if args.check_converter:
        conv, how = build_transformers(args.models)
        print(f"converter: {how}; pre_tokenizer = {conv.pre_tokenizer}")
        bad = [(s, e.ids, c.ids) for s, e, c in
               zip(corpus, enc, conv.encode_batch(corpus, add_special_tokens=True)) if e.ids != c.ids]
        print(f"converter disagrees on {len(bad)}/{len(corpus)} strings")
        for s, e, c in bad[:10]:
            print(f"  {s!r}\n    reference {e}\n    converter {c}")


if __name__ == "__main__":
    main()
