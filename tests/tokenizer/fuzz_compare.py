#!/usr/bin/env python3
"""Differential fuzzing of kvserve's tokenizer against the HF oracle (oracle.build_reference).

    python3 tests/tokenizer/fuzz_compare.py [--n 50000] [--seed 1]

Builds tests/tokenizer/tokenize_main.cpp with g++ against src/, feeds it random strings biased
towards the hard cases (Unicode whitespace and numerics next to spaces, letters, marks,
specials) and prints every mismatch. Exit status 1 on any mismatch.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from oracle import GGUF_NAME, build_reference  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
ATOMS = [" ", "  ", "\t", "\n", "\r", "\r\n", "\u00a0", "\u1680", "\u180e", "\u2000", "\u200a", "\u200b",
         "\u2028", "\u2029", "\u202f", "\u205f", "\u3000", "\ufeff", "\u0085", "\x0b", "\x0c", "\x1c", "\x1f",
         "a", "Z", "é", "e\u0301", "\u0301", "ß", "ǅ", "ʰ", "中", "ア", "ㅎ", "ا", "ש", "\u0903", "\u0bcd",
         "1", "9", "٣", "१", "²", "½", "Ⅻ", "①", "𝟙", "𐍈", "'", "'s", "'S", "'ll", "'LL", "’", "\"",
         ".", ",", "-", "_", "/", "\\", "😀", "👍🏽", "\u200d", "🇯", "🇵", "️", "<|im_start|>", "<|im_end|>",
         "<|endoftext|>", "<|", "|>", "<", ">", "$", "+", "=", "^", "~", "|", "`", "©", "€", "\x00", "\x7f"]


def rand_string(rng: random.Random) -> str:
    n = rng.randint(1, 24)
    out = []
    for _ in range(n):
        if rng.random() < 0.15:
            cp = rng.randint(0x20, 0x2FFFF)
            out.append(chr(cp) if not 0xD800 <= cp <= 0xDFFF else "x")
        else:
            out.append(rng.choice(ATOMS))
    return "".join(out)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=50000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--models", default=os.path.join(ROOT, "models"))
    args = ap.parse_args()
    exe = "/tmp/kv_tokenize_main"
    # Only the encoder's sources: other src/tokenizer files (chat templates) may be mid-edit.
    srcs = [os.path.join(HERE, "tokenize_main.cpp"),
            *[os.path.join(ROOT, "src/tokenizer", f) for f in
              ("tokenizer.cpp", "bpe_tokenizer.cpp", "pre_tokenizer.cpp", "utf8.cpp")],
            os.path.join(ROOT, "src/gguf/gguf.cpp"), os.path.join(ROOT, "src/kernels/ggml_types.cpp")]
    subprocess.run(["g++", "-std=c++20", "-O2", "-I" + os.path.join(ROOT, "src"), *srcs, "-lpcre2-8",
                    "-pthread", "-o", exe], check=True)
    rng = random.Random(args.seed)
    texts = [rand_string(rng) for _ in range(args.n)]
    path = os.path.join(args.models, GGUF_NAME)
    ref = build_reference(path)
    want = [e.ids for e in ref.encode_batch(texts, add_special_tokens=True)]
    ref.encode_special_tokens = True
    want_raw = [e.ids for e in ref.encode_batch(texts, add_special_tokens=False)]
    proc = subprocess.run([exe, path], input="".join(json.dumps(t) + "\n" for t in texts),
                          capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    bad = 0
    for i, t in enumerate(texts):
        got, got_raw = json.loads(lines[2 * i]), json.loads(lines[2 * i + 1])
        if got != want[i] or got_raw != want_raw[i]:
            bad += 1
            if bad <= 15:
                print(f"MISMATCH {t!r}\n  hf  {want[i]} raw {want_raw[i]}\n  kv  {got} raw {got_raw}")
    print(f"fuzz: {args.n - bad}/{args.n} identical")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
