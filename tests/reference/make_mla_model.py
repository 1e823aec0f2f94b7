#!/usr/bin/env python3
"""Write a small random-weight dense DeepSeek-V2 (MLA) GGUF, the way llama.cpp's converter
(conversion/deepseek.py of the vendored llama.cpp) lays it out, for the MLA oracle and golden.

    python tests/reference/make_mla_model.py OUT.gguf [--q-lora-rank 0] [--layout split|legacy]

Defaults: 4 layers, n_embd 256, 8 heads, kv_lora_rank 64, qk_rope_head_dim 16,
qk_nope_head_dim 32, v_head_dim 32, n_ff 512, all layers dense (leading_dense_block_count =
block_count), no RoPE scaling, rope base 10000, rms eps 1e-6, untied output.weight, all
tensors F32. Vocabulary: 512 byte-level BPE tokens (the 256 GPT-2 byte symbols, 255 merges
learnt deterministically from a fixed English text, "<|endoftext|>" = 511 as BOS/EOS,
tokenizer.ggml.pre "gpt-2", no BOS added), enough for llama.cpp to load the file and tokenize.

Determinism: weights come from a counter-based generator (splitmix64 of a per-tensor key
derived from the tensor name and --seed, integer arithmetic only), mapped to uniform values
with exact IEEE operations and stored as F32, so the tensor bytes are identical on every
machine and numpy version. The file bytes also depend on the `gguf` package's writer; the
golden records both the file's sha256 and weights_sha256, a digest of the tensor names and
bytes only (see weights_digest()).

Layout "split" (default): attention.key_length_mla / value_length_mla present, attn_k_b
[H][C][dn] and attn_v_b [H][dv][C] (GGUF dims reversed), key_length = C + dr,
value_length = C, head_count_kv = 1: what current converters write and what this
llama.cpp requires when the *_mla keys are present. Layout "legacy": one attn_kv_b
[H*(dn+dv)][C], key_length = dn + dr, value_length = dv, head_count_kv = n_head, no *_mla
keys (old GGUFs; llama.cpp then runs the non-absorbed MHA path).
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
from pathlib import Path

import numpy as np
import gguf

DEFAULTS = dict(n_layer=4, n_embd=256, n_head=8, kv_lora_rank=64, qk_rope=16, qk_nope=32,
                v_head=32, n_ff=512, q_lora_rank=0, rope_base=10000.0, rms_eps=1e-6,
                n_ctx=4096, seed=1234)
N_VOCAB = 512

TRAIN_TEXT = """\
Four score and seven years ago our fathers brought forth on this continent, a new nation, \
conceived in Liberty, and dedicated to the proposition that all men are created equal. Now we \
are engaged in a great civil war, testing whether that nation, or any nation so conceived and \
so dedicated, can long endure. We are met on a great battle-field of that war. We have come to \
dedicate a portion of that field, as a final resting place for those who here gave their lives \
that that nation might live. It is altogether fitting and proper that we should do this.
The village sat at the bend of a slow brown river, and for most of the year nothing much \
happened there. In spring the water rose and the fields along the bank turned soft and dark; \
in summer the children swam near the old mill and the farmers argued about the price of \
grain. The baker opened his shop before dawn, and by the time the church bell rang seven the \
smell of fresh bread had reached every street.
def main(argv): return 0  # 0123456789 + - * / = ( ) [ ] { } < > : ; , . ! ? ' "
"""

MASK64 = np.uint64(0xFFFFFFFFFFFFFFFF)


# ------------------------------------------------------------------ deterministic values

def splitmix64(x: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def tensor_key(name: str, seed: int) -> np.uint64:
    h = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    return np.uint64(int.from_bytes(h[:8], "little"))


def uniform(name: str, n: int, seed: int) -> np.ndarray:
    """n float64 values in [-1, 1), exactly reproducible: 53-bit integers scaled by 2^-52."""
    with np.errstate(over="ignore"):
        x = splitmix64(tensor_key(name, seed) + np.arange(n, dtype=np.uint64) *
                       np.uint64(0xD1B54A32D192ED03))
    return (x >> np.uint64(11)).astype(np.float64) * (2.0 ** -52) - 1.0


def weight(name: str, shape, std: float, seed: int, mean: float = 0.0) -> np.ndarray:
    """Uniform with the given standard deviation (half-width std * sqrt(3)), as float32."""
    n = int(np.prod(shape))
    u = uniform(name, n, seed) * (std * np.sqrt(3.0)) + mean
    return u.astype(np.float32).reshape(shape)


def random_ids(name: str, n: int, vocab: int, seed: int) -> list[int]:
    """Deterministic token ids in [0, vocab)."""
    with np.errstate(over="ignore"):
        x = splitmix64(tensor_key(name, seed) + np.arange(n, dtype=np.uint64))
    return [int(v) for v in (x % np.uint64(vocab))]


# ------------------------------------------------------------------ tokenizer

def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def train_bpe(text: str, n_merges: int) -> list[tuple[str, str]]:
    """Plain byte-level BPE training; ties broken by the lexicographically smallest pair."""
    b2u = bytes_to_unicode()
    words = re.findall(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+",
                       text)
    counts: dict[tuple, int] = {}
    for w in words:
        sym = tuple(b2u[b] for b in w.encode("utf-8"))
        counts[sym] = counts.get(sym, 0) + 1
    merges = []
    for _ in range(n_merges):
        pairs: dict[tuple[str, str], int] = {}
        for sym, c in counts.items():
            for a, b in zip(sym, sym[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + c
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        new_counts = {}
        for sym, c in counts.items():
            out, i = [], 0
            while i < len(sym):
                if i + 1 < len(sym) and (sym[i], sym[i + 1]) == best:
                    out.append(sym[i] + sym[i + 1])
                    i += 2
                else:
                    out.append(sym[i])
                    i += 1
            new_counts[tuple(out)] = new_counts.get(tuple(out), 0) + c
        counts = new_counts
    return merges


def vocab() -> tuple[list[str], list[int], list[str]]:
    b2u = bytes_to_unicode()
    tokens = [b2u[b] for b in range(256)]
    merges = []
    for a, b in train_bpe(TRAIN_TEXT, N_VOCAB - 257):
        if a + b not in tokens:
            tokens.append(a + b)
        merges.append(f"{a} {b}")
    while len(tokens) < N_VOCAB - 1:            # text too short for all merges: pad
        tokens.append(f"[PAD{len(tokens)}]")
    tokens.append("<|endoftext|>")
    types = [int(gguf.TokenType.NORMAL)] * (N_VOCAB - 1) + [int(gguf.TokenType.CONTROL)]
    types = [int(gguf.TokenType.UNUSED) if t.startswith("[PAD") else ty
             for t, ty in zip(tokens, types)]
    return tokens, types, merges


# ------------------------------------------------------------------ model

def build_tensors(hp: dict, layout: str) -> dict[str, np.ndarray]:
    s = hp["seed"]
    E, H, C = hp["n_embd"], hp["n_head"], hp["kv_lora_rank"]
    dn, dr, dv, F, QL = hp["qk_nope"], hp["qk_rope"], hp["v_head"], hp["n_ff"], hp["q_lora_rank"]
    t: dict[str, np.ndarray] = {}
    t["token_embd.weight"] = weight("token_embd", (N_VOCAB, E), 1.0, s)
    t["output_norm.weight"] = weight("output_norm", (E,), 0.1, s, mean=1.0)
    t["output.weight"] = weight("output", (N_VOCAB, E), 3.0 / np.sqrt(E), s)
    for i in range(hp["n_layer"]):
        p = f"blk.{i}."
        w = lambda n, shape, std, mean=0.0: weight(p + n, shape, std, s, mean)
        t[p + "attn_norm.weight"] = w("attn_norm", (E,), 0.1, 1.0)
        if QL > 0:
            t[p + "attn_q_a.weight"] = w("attn_q_a", (QL, E), 1.0 / np.sqrt(E))
            t[p + "attn_q_a_norm.weight"] = w("attn_q_a_norm", (QL,), 0.1, 1.0)
            t[p + "attn_q_b.weight"] = w("attn_q_b", (H * (dn + dr), QL), 1.5 / np.sqrt(QL))
        else:
            t[p + "attn_q.weight"] = w("attn_q", (H * (dn + dr), E), 1.5 / np.sqrt(E))
        t[p + "attn_kv_a_mqa.weight"] = w("attn_kv_a_mqa", (C + dr, E), 1.5 / np.sqrt(E))
        t[p + "attn_kv_a_norm.weight"] = w("attn_kv_a_norm", (C,), 0.1, 1.0)
        # the HF kv_b_proj [H*(dn+dv), C], per head rows [k_nope (dn) | v (dv)]
        w_uk = w("w_uk", (H, dn, C), 1.5 / np.sqrt(C))
        w_uv = w("w_uv", (H, dv, C), 1.0 / np.sqrt(C))
        if layout == "split":
            t[p + "attn_k_b.weight"] = np.ascontiguousarray(w_uk.transpose(0, 2, 1))  # [H, C, dn]
            t[p + "attn_v_b.weight"] = w_uv                                           # [H, dv, C]
        else:
            t[p + "attn_kv_b.weight"] = np.concatenate([w_uk, w_uv], axis=1).reshape(H * (dn + dv), C)
        t[p + "attn_output.weight"] = w("attn_output", (E, H * dv), 1.0 / np.sqrt(H * dv))
        t[p + "ffn_norm.weight"] = w("ffn_norm", (E,), 0.1, 1.0)
        t[p + "ffn_gate.weight"] = w("ffn_gate", (F, E), 1.0 / np.sqrt(E))
        t[p + "ffn_up.weight"] = w("ffn_up", (F, E), 1.0 / np.sqrt(E))
        t[p + "ffn_down.weight"] = w("ffn_down", (E, F), 1.0 / np.sqrt(F))
    return t


def weights_digest(tensors: dict[str, np.ndarray]) -> str:
    """sha256 over (name, shape, float32 little-endian bytes) of every tensor, sorted by name:
    independent of the GGUF writer's layout."""
    h = hashlib.sha256()
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype="<f4")
        h.update(name.encode() + b"\0" + repr(a.shape).encode() + b"\0")
        h.update(a.tobytes())
    return h.hexdigest()


def weights_digest_of_file(path) -> str:
    r = gguf.GGUFReader(str(path))
    return weights_digest({t.name: np.asarray(t.data).reshape(
        tuple(int(d) for d in reversed(list(t.shape)))) for t in r.tensors})


def write_model(out, q_lora_rank=None, layout="split", **overrides) -> dict:
    hp = dict(DEFAULTS)
    hp.update({k: v for k, v in overrides.items() if v is not None})
    if q_lora_rank is not None:
        hp["q_lora_rank"] = q_lora_rank
    if layout not in ("split", "legacy"):
        raise ValueError(layout)
    E, H, C = hp["n_embd"], hp["n_head"], hp["kv_lora_rank"]
    dn, dr, dv = hp["qk_nope"], hp["qk_rope"], hp["v_head"]
    tensors = build_tensors(hp, layout)
    tokens, types, merges = vocab()

    arch = "deepseek2"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name("kvserve MLA test model (random weights)")
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    w.add_context_length(hp["n_ctx"])
    w.add_embedding_length(E)
    w.add_block_count(hp["n_layer"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_head_count(H)
    w.add_layer_norm_rms_eps(hp["rms_eps"])
    w.add_rope_freq_base(hp["rope_base"])
    w.add_rope_dimension_count(dr)
    w.add_vocab_size(N_VOCAB)
    w.add_leading_dense_block_count(hp["n_layer"])
    w.add_q_lora_rank(hp["q_lora_rank"])          # required by llama.cpp for non-"lite" layer counts
    w.add_kv_lora_rank(C)
    if layout == "split":
        w.add_head_count_kv(1)
        w.add_key_length(C + dr)
        w.add_value_length(C)
        w.add_key_length_mla(dn + dr)
        w.add_value_length_mla(dv)
    else:
        w.add_head_count_kv(H)
        w.add_key_length(dn + dr)
        w.add_value_length(dv)
    w.add_expert_feed_forward_length(hp["n_ff"])   # read unconditionally by llama.cpp
    w.add_expert_shared_count(0)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(N_VOCAB - 1)
    w.add_eos_token_id(N_VOCAB - 1)
    w.add_add_bos_token(False)
    for name, a in tensors.items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return {"hparams": hp, "layout": layout, "weights_sha256": weights_digest(tensors),
            "n_vocab": N_VOCAB}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--q-lora-rank", type=int, default=None)
    ap.add_argument("--layout", choices=["split", "legacy"], default="split")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    info = write_model(args.out, args.q_lora_rank, args.layout, seed=args.seed)
    print(f"wrote {args.out} ({Path(args.out).stat().st_size / 1e6:.1f} MB) {info}", file=sys.stderr)


if __name__ == "__main__":
    main()
