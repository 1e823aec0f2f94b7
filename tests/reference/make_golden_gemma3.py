#!/usr/bin/env python3
"""Golden outputs of the Gemma 3 oracle, in the SmolLM2 golden format (make_golden.py).

Re-run (repo root; numpy, gguf, sentencepiece + protobuf; no network; ~5 minutes on 2 cores,
~4 GB RAM):

    python tests/reference/make_golden_gemma3.py \
        [--model models/gemma-3-270m-Q4_K_M.gguf] [--out tests/data/golden/gemma3]

Writes golden.json + golden_dist.f16 (see tests/data/golden/gemma3/README.md). Token ids
come from tests/reference/spm_tokenizer_ref.py (SentencePiece built from the GGUF, BOS
added, special tokens parsed), checked equal to llama.cpp's tokenizer by
tests/reference/compare_llamacpp.py. Logits come from tests/reference/gemma3_ref.py.

The vocabulary is 262144, so a full log-softmax row is 512 KiB in float16: only 4 rows are
stored (the last position of prose_short and chat_single, and positions 600 and 699 of the
700-token prompt whose attention on sliding layers is cut by the 512-token window).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import gemma3_ref  # noqa: E402
from golden_lib import N_GREEDY, TOP_K, run_prompt, sha256_file, write_golden  # noqa: E402
from make_golden import C_CODE, GETTYSBURG, LONG_PROSE, PY_CODE  # noqa: E402
from spm_tokenizer_ref import load_tokenizer  # noqa: E402

REPO = HERE.parent.parent


def gemma_chat(messages) -> str:
    """Gemma's chat format (the GGUF carries no tokenizer.chat_template): turns
    '<start_of_turn>{user|model}\\n{content}<end_of_turn>\\n', a system message prefixed to the
    first user turn, then '<start_of_turn>model\\n'. BOS comes from the tokenizer."""
    out, system = [], None
    for m in messages:
        if m["role"] == "system":
            system = m["content"]
            continue
        content = m["content"]
        if system is not None and m["role"] == "user":
            content, system = system + "\n\n" + content, None
        role = "model" if m["role"] == "assistant" else "user"
        out.append(f"<start_of_turn>{role}\n{content}<end_of_turn>\n")
    return "".join(out) + "<start_of_turn>model\n"


# (name, kind, text or messages, target token count incl. BOS or None = whole, dist positions)
PROMPTS = [
    ("prose_short", "text", "The old lighthouse keeper climbed the spiral stairs every evening "
                            "to light the great lamp at the top of the tower.", None, ["last"]),
    ("numbers_primes", "text", "Here is the list of the first prime numbers: 2, 3, 5, 7, 11, 13, "
                               "17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73.",
     None, []),
    ("chat_single", "chat", [{"role": "user", "content":
                              "What are three simple habits that help people sleep better?"}],
     None, ["last"]),
    ("code_python", "text", PY_CODE, 100, []),
    ("chat_multi_turn", "chat", [
        {"role": "system", "content": "You are a concise assistant who answers in plain English."},
        {"role": "user", "content": "I am planning a trip to Norway in the summer. What should I pack?"},
        {"role": "assistant", "content": "Pack layers: a light waterproof jacket, a warm fleece, "
                                         "comfortable walking shoes, and a hat."},
        {"role": "user", "content": "Which cities would you recommend for a first visit?"},
    ], None, []),
    # 700 tokens: queries past position 511 lose the oldest keys on the 15 sliding layers
    ("long_700_window", "text", LONG_PROSE + "\n" + GETTYSBURG + "\n" + C_CODE, 700, [600, "last"]),
]


def main(argv=None):
    ap = argparse.ArgumentParser(description="write tests/data/golden/gemma3/*")
    ap.add_argument("--model", default=str(REPO / "models/gemma-3-270m-Q4_K_M.gguf"))
    ap.add_argument("--out", default=str(REPO / "tests/data/golden/gemma3"))
    args = ap.parse_args(argv)
    out = Path(args.out)
    t_start = time.time()
    model = gemma3_ref.load_model(args.model)
    cfg = model.cfg
    tok = load_tokenizer(args.model)
    print(f"loaded in {time.time() - t_start:.1f}s; {cfg}", flush=True)

    prompts_json, dist_rows, dist_index = [], [], []
    for pi, (name, kind, src, target, dpos) in enumerate(PROMPTS):
        t0 = time.time()
        text = gemma_chat(src) if kind == "chat" else src
        full = tok.encode(text)
        if target is not None and len(full) < target:
            raise SystemExit(f"prompt {name}: only {len(full)} tokens < {target}")
        tokens = full if target is None else full[:target]
        T = len(tokens)
        positions = sorted({T - 1 if p == "last" else int(p) for p in dpos})
        entry, rows = run_prompt(gemma3_ref, model, tokens, set(positions))
        idx = []
        for p in positions:
            idx.append(len(dist_rows))
            dist_rows.append(rows[p])
            dist_index.append({"prompt": pi, "name": name, "position": p})
        prompts_json.append({"name": name, "kind": kind, "text": text,
                             "tokens_are_prefix_of_encode_text": target is not None,
                             **entry, "greedy_text": tok.decode(entry["greedy"]),
                             "dist_rows": idx})
        m = min(entry["greedy_top2_margin"])
        print(f"[{pi + 1}/{len(PROMPTS)}] {name:16s} T={T:3d} ppl={entry['perplexity']:8.2f} "
              f"min greedy margin={m:.3f} ({time.time() - t0:.0f}s) -> "
              f"{tok.decode(entry['greedy'])[:60]!r}", flush=True)

    index = {
        "format_version": 1,
        "generator": "tests/reference/make_golden_gemma3.py",
        "model": {
            "file": Path(args.model).name,
            "sha256": sha256_file(args.model),
            "arch": cfg.arch, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd,
            "n_head": cfg.n_head, "n_head_kv": cfg.n_head_kv, "head_dim": cfg.head_dim,
            "n_ff": cfg.n_ff, "n_rot": cfg.n_rot, "rope_style": cfg.rope_style,
            "rope_base": cfg.rope_base, "rope_base_swa": cfg.rope_base_swa,
            "n_swa": cfg.n_swa, "global_layers": cfg.global_layers,
            "attn_scale": cfg.attn_scale, "embd_scale": cfg.embd_scale,
            "final_logit_softcap": cfg.final_logit_softcap,
            "rms_eps": cfg.rms_eps, "vocab": cfg.vocab,
            "norm_weights": "used as stored (the converter already added Gemma's +1)",
            "window_rule": "sliding layers: key j visible to query p iff p - n_swa < j <= p",
        },
        "oracle": "tests/reference/gemma3_ref.py: numpy float64, weights dequantized by "
                  "gguf.quants.dequantize",
        "tokenizer": "tests/reference/spm_tokenizer_ref.py (SentencePiece BPE built from the GGUF "
                     "vocab/scores/types, byte fallback, no dummy prefix; control and "
                     "user-defined tokens matched whole; BOS=2 prepended)",
        "chat_format": "<start_of_turn>user\\n...<end_of_turn>\\n ... <start_of_turn>model\\n "
                       "(by hand: the GGUF has no chat template)",
        "top_k": TOP_K,
        "n_greedy": N_GREEDY,
        "logprob_rounding": 5,
        "dist": {
            "file": "golden_dist.f16", "dtype": "float16", "endianness": "little",
            "shape": None,
            "content": "log_softmax of the logits at (prompt, position): the distribution of "
                       "the token following tokens[0..position]",
            "rows": dist_index,
        },
        "prompts": prompts_json,
    }
    write_golden(out, index, dist_rows)
    total = sum(p.stat().st_size for p in out.iterdir() if p.is_file())
    print(f"wrote {out}: {len(dist_rows)} dist rows, directory {total / 1e6:.2f} MB, "
          f"{time.time() - t_start:.0f}s", flush=True)


if __name__ == "__main__":
    main()
