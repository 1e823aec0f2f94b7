#!/usr/bin/env python3
"""Golden outputs of the MLA (deepseek2) oracle on the generated random-weight test model, in
the SmolLM2 golden format (make_golden.py).

Re-run (repo root; numpy, gguf, tokenizers; no network; ~30 s):

    python tests/reference/make_golden_mla.py [--out tests/data/golden/mla] [--keep-models DIR]

For each variant it generates the model with make_mla_model.py into a temporary directory
(or --keep-models DIR), checks the weights digest, runs tests/reference/mla_ref.py, and
writes golden.json + golden_dist.f16:
    variant "default": q_lora_rank 0 (attn_q), split attn_k_b/attn_v_b  -> OUT/
    variant "q_lora":  q_lora_rank 96 (attn_q_a, attn_q_a_norm, attn_q_b) -> OUT/q_lora/
Regenerate the model exactly with:
    python tests/reference/make_mla_model.py X.gguf --q-lora-rank {0|96}
and compare golden.json "model.weights_sha256" with make_mla_model.weights_digest_of_file(X).

Prompts are deterministic random ids (make_mla_model.random_ids) plus one English text
tokenized by tests/reference/tokenizer_ref.py (byte-level BPE, "gpt-2" pre-tokenizer); the
vocabulary is 512, so up to 16 full log-softmax rows per prompt are stored (1 KiB each).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import make_mla_model  # noqa: E402
import mla_ref  # noqa: E402
from golden_lib import (N_GREEDY, TOP_K, dist_positions, run_prompt,  # noqa: E402
                        sha256_file, write_golden)
from make_golden import GETTYSBURG  # noqa: E402

REPO = HERE.parent.parent
VARIANTS = {"default": {"q_lora_rank": 0, "layout": "split", "subdir": "."},
            "q_lora": {"q_lora_rank": 96, "layout": "split", "subdir": "q_lora"}}
# (name, length) of random-id prompts; ids from make_mla_model.random_ids(name, length, 511)
RANDOM_PROMPTS = [("random_1", 1), ("random_8", 8), ("random_33", 33), ("random_128", 128),
                  ("random_300", 300)]
N_DIST = 16


def build_prompts(model_path):
    from tokenizer_ref import encode, load_tokenizer
    tok = load_tokenizer(model_path)
    prompts = [(name, "random_ids", None,
                make_mla_model.random_ids(name, n, make_mla_model.N_VOCAB - 1, 0))
               for name, n in RANDOM_PROMPTS]
    prompts.insert(3, ("text_gettysburg", "text", GETTYSBURG, encode(tok, GETTYSBURG)))
    return prompts, tok


def make_variant(name, spec, out_root: Path, model_dir: Path):
    t0 = time.time()
    model_path = model_dir / f"mla_test_{name}.gguf"
    info = make_mla_model.write_model(model_path, spec["q_lora_rank"], spec["layout"])
    assert make_mla_model.weights_digest_of_file(model_path) == info["weights_sha256"]
    model = mla_ref.load_model(model_path)
    cfg = model.cfg
    prompts, tok = build_prompts(model_path)
    prompts_json, dist_rows, dist_index = [], [], []
    for pi, (pname, kind, text, tokens) in enumerate(prompts):
        T = len(tokens)
        positions = dist_positions(T, N_DIST)
        entry, rows = run_prompt(mla_ref, model, tokens, set(positions))
        idx = []
        for p in positions:
            idx.append(len(dist_rows))
            dist_rows.append(rows[p])
            dist_index.append({"prompt": pi, "name": pname, "position": p})
        prompts_json.append({"name": pname, "kind": kind, "text": text,
                             "tokens_are_prefix_of_encode_text": False, **entry,
                             "greedy_text": tok.decode(entry["greedy"], skip_special_tokens=False),
                             "dist_rows": idx})
        print(f"  [{name}] {pname:16s} T={T:3d} ppl={entry['perplexity'] or 0:8.2f} "
              f"min greedy margin={min(entry['greedy_top2_margin']):.3f}", flush=True)
    hp = info["hparams"]
    index = {
        "format_version": 1,
        "generator": "tests/reference/make_golden_mla.py",
        "model": {
            "file": model_path.name,
            "generated_by": f"python tests/reference/make_mla_model.py OUT.gguf "
                            f"--q-lora-rank {spec['q_lora_rank']} --layout {spec['layout']}",
            "sha256": sha256_file(model_path),
            "weights_sha256": info["weights_sha256"],
            "arch": cfg.arch, "layout": cfg.layout,
            "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
            "n_ff": cfg.n_ff, "q_lora_rank": cfg.q_lora_rank, "kv_lora_rank": cfg.kv_lora_rank,
            "qk_nope_head_dim": cfg.qk_nope, "qk_rope_head_dim": cfg.qk_rope,
            "v_head_dim": cfg.v_head, "n_rot": cfg.qk_rope, "rope_style": cfg.rope_style,
            "rope_base": cfg.rope_base, "rms_eps": cfg.rms_eps, "vocab": cfg.vocab,
            "kq_scale": cfg.kq_scale, "leading_dense_block_count": cfg.n_layer_dense_lead,
            "seed": hp["seed"], "tensor_type": "F32", "tied_output": False,
        },
        "oracle": "tests/reference/mla_ref.py: numpy float64, naive MLA (K/V decompressed per "
                  "head), equal to the absorbed form to 1e-12",
        "tokenizer": "random_ids prompts: ids as given; text prompt: tests/reference/"
                     "tokenizer_ref.py (byte-level BPE, gpt-2 pre-tokenizer, no BOS)",
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
    out = out_root / spec["subdir"]
    write_golden(out, index, dist_rows)
    print(f"[{name}] wrote {out} ({len(dist_rows)} dist rows) in {time.time() - t0:.0f}s", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description="write tests/data/golden/mla/*")
    ap.add_argument("--out", default=str(REPO / "tests/data/golden/mla"))
    ap.add_argument("--keep-models", default=None, help="write the .gguf files here (else a temp dir)")
    ap.add_argument("--variant", choices=sorted(VARIANTS), action="append")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as td:
        model_dir = Path(args.keep_models) if args.keep_models else Path(td)
        model_dir.mkdir(parents=True, exist_ok=True)
        for name in args.variant or sorted(VARIANTS):
            make_variant(name, VARIANTS[name], Path(args.out), model_dir)


if __name__ == "__main__":
    main()
