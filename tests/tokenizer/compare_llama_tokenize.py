#!/usr/bin/env python3
"""Third opinion: compare a sample of the stored corpus ids with llama.cpp's llama-tokenize.

    python3 tests/tokenizer/compare_llama_tokenize.py --bin path/to/llama-tokenize [--every 10]

Runs `llama-tokenize -m <gguf> -f <file> --ids --no-escape` (parse_special on, llama.cpp's
default here, and add_bos as the GGUF says: off for SmolLM2) for every --every-th corpus line
and prints the strings where llama.cpp differs from the HF oracle ids stored in the corpus.
Differences are llama.cpp-vs-HF facts (kvserve matches HF); they are listed, not failed on.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", required=True)
    ap.add_argument("--model", default=os.path.join(ROOT, "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--corpus", default=os.path.join(ROOT, "tests/data/tokenizer/smollm2_corpus.jsonl"))
    ap.add_argument("--every", type=int, default=10)
    args = ap.parse_args()
    rows = [json.loads(l) for l in open(args.corpus, encoding="utf-8")][:: args.every]
    same = 0
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "p.txt")
        for row in rows:
            if not row["text"]:
                same += 1  # llama-tokenize refuses an empty prompt
                continue
            with open(path, "w", encoding="utf-8", newline="") as f:
                f.write(row["text"])
            p = subprocess.run([args.bin, "-m", args.model, "-f", path, "--ids", "--no-escape", "--log-disable"],
                               capture_output=True, text=True)
            line = [l for l in p.stdout.splitlines() if l.startswith("[")]
            ids = json.loads(line[-1]) if line else None
            if ids == row["ids"]:
                same += 1
            else:
                print(f"DIFF {row['text']!r}\n  hf/kvserve {row['ids']}\n  llama.cpp  {ids}")
    print(f"llama-tokenize: {same}/{len(rows)} identical to the HF oracle")


if __name__ == "__main__":
    main()
