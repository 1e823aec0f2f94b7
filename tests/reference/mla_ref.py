#!/usr/bin/env python3
"""Independent numpy oracle for Multi-head Latent Attention models (DeepSeek-V2 family,
GGUF arch "deepseek2"), dense FFN layers only. Float64 throughout.

Shares GGUF reading / dequantization / RMSNorm / RoPE with tests/reference/llama_ref.py.
Semantics follow the vendored llama.cpp (bench/peer/work/.../vendor/llama.cpp:
src/models/deepseek2.cpp, conversion/deepseek.py) and HF modeling_deepseek.py.

GGUF layout (numpy shapes are the reversed GGUF dims; H = n_head, C = kv_lora_rank,
dn = qk_nope_head_dim, dr = qk_rope_head_dim = rope.dimension_count, dv = v_head_dim):

  metadata deepseek2.*                     meaning
  attention.kv_lora_rank          C
  attention.q_lora_rank           required by llama.cpp unless n_layer is 26/27 ("lite");
                                  0 = no query LoRA (attn_q), > 0: attn_q_a/attn_q_a_norm/attn_q_b
  rope.dimension_count            dr
  attention.key_length_mla        dn + dr   } present = "MLA" layout: split attn_k_b / attn_v_b
  attention.value_length_mla      dv        } (what the current converter writes); then
  attention.key_length            C + dr      (the absorbed MQA head: latent + rope)
  attention.value_length          C
  attention.head_count_kv         1
  (legacy GGUFs: no *_mla keys, key_length = dn + dr, value_length = dv, one attn_kv_b)
  leading_dense_block_count       layers < this use the dense SwiGLU FFN (all, here)
  rope.scaling.* / yarn_log_multiplier  not supported here: the oracle refuses YaRN models

  tensor blk.N.*                 numpy shape
  attn_norm                      [n_embd]
  attn_q                         [H*(dn+dr), n_embd]    per head: [q_nope (dn) | q_pe (dr)]
  attn_q_a / attn_q_a_norm / attn_q_b   [q_lora, n_embd] / [q_lora] / [H*(dn+dr), q_lora]
  attn_kv_a_mqa                  [C + dr, n_embd]       rows: [latent c (C) | k_pe (dr)]
  attn_kv_a_norm                 [C]                    RMSNorm of the latent only
  attn_k_b                       [H, C, dn]             W_UK^T per head (k_nope = attn_k_b[h].T @ c)
  attn_v_b                       [H, dv, C]             W_UV per head    (v      = attn_v_b[h]   @ c)
  attn_kv_b (legacy)             [H*(dn+dv), C]         per head rows [W_UK (dn) | W_UV (dv)]
  attn_output                    [n_embd, H*dv]
  ffn_norm, ffn_gate, ffn_up, ffn_down   as llama

Forward of one layer (naive form: decompress K and V per head):
  h     = rms_norm(x, attn_norm)
  q     = h @ Wq.T                      (or rms_norm(h @ Wq_a.T, q_a_norm) @ Wq_b.T)
  q_nope, q_pe = q[..., :dn], rope_norm(q[..., dn:])              per head
  kv    = h @ Wkv_a.T ;  c = rms_norm(kv[:, :C], kv_a_norm) ;  k_pe = rope_norm(kv[:, C:])
  k_h   = [c @ W_UK[h].T | k_pe]     (k_pe shared by all heads)     v_h = c @ W_UV[h].T
  a_h   = softmax(kq_scale * q_h k_h^T + causal) v_h,   kq_scale = 1/sqrt(dn + dr)
          (llama.cpp: mscale^2 / sqrt(dn + dr); mscale = 1 without YaRN. With YaRN, from
          reading llama-context.cpp + deepseek2.cpp, not exercised here:
          mscale = 1 + 0.1 * mscale_all_dim * ln(factor), where mscale_all_dim =
          rope.scaling.yarn_log_multiplier / 0.1 and factor = rope.scaling.factor; the RoPE
          itself then gets YaRN frequency correction with a net magnitude factor of 1)
  x     = x + concat_h(a_h) @ Wo.T ;  x = x + swiglu FFN
  rope_norm: GGML_ROPE_TYPE_NORM (adjacent pairs), theta_i = pos * base^(-2i/dr), i < dr/2.
  Cache per layer and position: c (normed latent, C) and k_pe (roped, dr): the
  [d_latent + d_rope] MLA page row of DESIGN.md.

The absorbed form (what llama.cpp runs, what a paged MLA kernel runs) is in
attention_absorbed(); tests/py/test_mla_reference.py checks it equals the naive one.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_ref import _field, dequant_tensor, log_softmax, rms_norm, rope, silu  # noqa: E402


@dataclass
class Config:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_ff: int
    q_lora_rank: int          # 0: attn_q
    kv_lora_rank: int
    qk_nope: int
    qk_rope: int
    v_head: int
    rope_base: float
    rms_eps: float
    vocab: int
    n_ctx_train: int
    n_layer_dense_lead: int
    layout: str               # "split" (attn_k_b / attn_v_b) or "legacy" (attn_kv_b)
    kq_scale: float
    rope_style: str = "norm"


@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: np.ndarray | None       # [H*(dn+dr), n_embd]
    wq_a: np.ndarray | None
    q_a_norm: np.ndarray | None
    wq_b: np.ndarray | None
    wkv_a: np.ndarray           # [C+dr, n_embd]
    kv_a_norm: np.ndarray       # [C]
    w_uk: np.ndarray            # [H, dn, C]   k_nope[h] = W_UK[h] @ c
    w_uv: np.ndarray            # [H, dv, C]   v[h]      = W_UV[h] @ c
    wo: np.ndarray              # [n_embd, H*dv]
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


@dataclass
class Model:
    cfg: Config
    tok_embd: np.ndarray
    output_norm: np.ndarray
    output: np.ndarray
    layers: list = field(default_factory=list)
    path: str = ""
    tensor_types: dict = field(default_factory=dict)


def load_config(reader, tensor_names) -> Config:
    arch = _field(reader, "general.architecture")
    if arch != "deepseek2":
        raise ValueError(f"mla_ref: architecture {arch!r} is not deepseek2")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    n_layer = int(a("block_count"))
    n_head = int(a("attention.head_count"))
    C = int(a("attention.kv_lora_rank"))
    dr = int(a("rope.dimension_count"))
    k_mla, v_mla = a("attention.key_length_mla"), a("attention.value_length_mla")
    if k_mla is not None and v_mla is not None and int(k_mla) and int(v_mla):
        layout, dk, dv = "split", int(k_mla), int(v_mla)
        assert "blk.0.attn_k_b.weight" in tensor_names, "MLA keys present but no attn_k_b"
    else:
        layout, dk, dv = "legacy", int(a("attention.key_length")), int(a("attention.value_length"))
        assert "blk.0.attn_kv_b.weight" in tensor_names, "no *_mla keys and no attn_kv_b"
    st = a("rope.scaling.type")
    if (st not in (None, "none")) or a("rope.scaling.yarn_log_multiplier") is not None:
        raise NotImplementedError("mla_ref: RoPE scaling (YaRN) not implemented")
    n_dense = int(a("leading_dense_block_count", 0))
    if n_dense < n_layer:
        raise NotImplementedError("mla_ref: MoE layers not implemented (leading_dense_block_count "
                                  f"{n_dense} < block_count {n_layer})")
    vocab = a("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return Config(
        arch=arch, n_layer=n_layer, n_embd=int(a("embedding_length")), n_head=n_head,
        n_ff=int(a("feed_forward_length")), q_lora_rank=int(a("attention.q_lora_rank", 0) or 0),
        kv_lora_rank=C, qk_nope=dk - dr, qk_rope=dr, v_head=dv,
        rope_base=float(a("rope.freq_base", 10000.0)),
        rms_eps=float(a("attention.layer_norm_rms_epsilon")),
        vocab=int(vocab), n_ctx_train=int(a("context_length", 0)),
        n_layer_dense_lead=n_dense, layout=layout,
        kq_scale=1.0 / math.sqrt(dk),   # mscale = 1: no YaRN
    )


def load_model(path, dtype=np.float64) -> Model:
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    cfg = load_config(reader, tensors)
    get = lambda name: dequant_tensor(tensors[name], dtype)
    H, C, dn, dr, dv = cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_rope, cfg.v_head
    tok_embd = get("token_embd.weight")
    output = get("output.weight") if "output.weight" in tensors else tok_embd
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        if cfg.layout == "split":
            w_uk = get(p + "attn_k_b.weight").transpose(0, 2, 1)      # [H, C, dn] -> [H, dn, C]
            w_uv = get(p + "attn_v_b.weight")                         # [H, dv, C]
        else:
            kvb = get(p + "attn_kv_b.weight").reshape(H, dn + dv, C)
            w_uk, w_uv = kvb[:, :dn, :], kvb[:, dn:, :]
        has_q_lora = cfg.q_lora_rank > 0
        layers.append(Layer(
            attn_norm=get(p + "attn_norm.weight"),
            wq=None if has_q_lora else get(p + "attn_q.weight"),
            wq_a=get(p + "attn_q_a.weight") if has_q_lora else None,
            q_a_norm=get(p + "attn_q_a_norm.weight") if has_q_lora else None,
            wq_b=get(p + "attn_q_b.weight") if has_q_lora else None,
            wkv_a=get(p + "attn_kv_a_mqa.weight"), kv_a_norm=get(p + "attn_kv_a_norm.weight"),
            w_uk=np.ascontiguousarray(w_uk), w_uv=np.ascontiguousarray(w_uv),
            wo=get(p + "attn_output.weight"),
            ffn_norm=get(p + "ffn_norm.weight"), w_gate=get(p + "ffn_gate.weight"),
            w_up=get(p + "ffn_up.weight"), w_down=get(p + "ffn_down.weight"),
        ))
    m = Model(cfg=cfg, tok_embd=tok_embd, output_norm=get("output_norm.weight"), output=output,
              layers=layers, path=str(path),
              tensor_types={n: t.tensor_type.name for n, t in tensors.items()})
    L0 = layers[0]
    assert tok_embd.shape == (cfg.vocab, cfg.n_embd)
    assert L0.wkv_a.shape == (C + dr, cfg.n_embd) and L0.kv_a_norm.shape == (C,)
    assert L0.w_uk.shape == (H, dn, C) and L0.w_uv.shape == (H, dv, C)
    assert L0.wo.shape == (cfg.n_embd, H * dv)
    qw = L0.wq if L0.wq is not None else L0.wq_b
    assert qw.shape[0] == H * (dn + dr)
    return m


# ---------------------------------------------------------------- cache and attention

class LatentCache:
    """Per layer: c [S, C] (normed latent) and k_pe [S, dr] (roped), grown by doubling."""

    def __init__(self, n_layer):
        self.c = [None] * n_layer
        self.kpe = [None] * n_layer
        self.n_past = 0

    def append(self, il, c, kpe):
        n0, n1 = self.n_past, self.n_past + len(c)
        if self.c[il] is None or n1 > len(self.c[il]):
            cap = max(n1, 2 * (0 if self.c[il] is None else len(self.c[il])), 64)
            nc, nk = np.empty((cap, c.shape[1]), c.dtype), np.empty((cap, kpe.shape[1]), kpe.dtype)
            if self.c[il] is not None:
                nc[:n0], nk[:n0] = self.c[il][:n0], self.kpe[il][:n0]
            self.c[il], self.kpe[il] = nc, nk
        self.c[il][n0:n1], self.kpe[il][n0:n1] = c, kpe
        return self.c[il][:n1], self.kpe[il][:n1]


def _softmax_causal(scores, q_pos0):
    """scores [H, T, S] (already scaled); causal mask for queries at q_pos0 + t."""
    T, S = scores.shape[-2:]
    mask = np.arange(S)[None, :] > (q_pos0 + np.arange(T))[:, None]
    scores = scores + np.where(mask, -np.inf, 0.0)
    scores = scores - scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    return p / p.sum(axis=-1, keepdims=True)


def attention_naive(L: Layer, cfg: Config, q_nope, q_pe, c, kpe, q_pos0):
    """q_nope [T, H, dn], q_pe [T, H, dr] (roped); c [S, C], kpe [S, dr] (roped).
    Decompresses K and V for every head. Returns [T, H, dv]."""
    k_nope = np.einsum("hdc,sc->hsd", L.w_uk, c)                  # [H, S, dn]
    v = np.einsum("hec,sc->hse", L.w_uv, c)                       # [H, S, dv]
    H, S = k_nope.shape[:2]
    k = np.concatenate([k_nope, np.broadcast_to(kpe[None], (H, S, kpe.shape[1]))], axis=-1)
    q = np.concatenate([q_nope, q_pe], axis=-1).transpose(1, 0, 2)  # [H, T, dn+dr]
    p = _softmax_causal(np.matmul(q, k.transpose(0, 2, 1)) * cfg.kq_scale, q_pos0)
    return np.matmul(p, v).transpose(1, 0, 2)                     # [T, H, dv]


def attention_absorbed(L: Layer, cfg: Config, q_nope, q_pe, c, kpe, q_pos0):
    """Same result as attention_naive, never materialising per-head K or V:
       q_abs[t,h]  = W_UK[h]^T q_nope[t,h]                 (C values; = attn_k_b[h] @ q_nope)
       score[h,t,s] = kq_scale * (q_abs[t,h] . c[s] + q_pe[t,h] . k_pe[s])
                    = kq_scale * [q_abs | q_pe] . [c | k_pe]  (one MQA head of width C + dr)
       o_lat[t,h]  = sum_s softmax(score)[h,t,s] c[s]       (C values; V is the latent itself)
       out[t,h]    = W_UV[h] o_lat[t,h]                     (dv values)
    The scale stays 1/sqrt(dn + dr), not 1/sqrt(C + dr)."""
    q_abs = np.einsum("hdc,thd->htc", L.w_uk, q_nope)             # [H, T, C]
    qcat = np.concatenate([q_abs, q_pe.transpose(1, 0, 2)], axis=-1)  # [H, T, C+dr]
    kcat = np.concatenate([c, kpe], axis=-1)                      # [S, C+dr]
    p = _softmax_causal(np.matmul(qcat, kcat.T) * cfg.kq_scale, q_pos0)  # [H, T, S]
    o_lat = np.matmul(p, c)                                       # [H, T, C]
    return np.einsum("hec,htc->the", L.w_uv, o_lat)               # [T, H, dv]


def new_cache(model: Model) -> LatentCache:
    return LatentCache(model.cfg.n_layer)


def forward_hidden(model: Model, tokens, cache: LatentCache | None = None, absorbed=False):
    cfg = model.cfg
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    pos0 = cache.n_past if cache is not None else 0
    positions = pos0 + np.arange(T)
    H, C, dn, dr = cfg.n_head, cfg.kv_lora_rank, cfg.qk_nope, cfg.qk_rope
    attn = attention_absorbed if absorbed else attention_naive
    x = model.tok_embd[tokens]
    for il, L in enumerate(model.layers):
        h = rms_norm(x, L.attn_norm, cfg.rms_eps)
        if L.wq is not None:
            q = h @ L.wq.T
        else:
            q = rms_norm(h @ L.wq_a.T, L.q_a_norm, cfg.rms_eps) @ L.wq_b.T
        q = q.reshape(T, H, dn + dr)
        q_nope = q[..., :dn]
        q_pe = rope(np.ascontiguousarray(q[..., dn:]), positions, dr, cfg.rope_base, "norm")
        kv = h @ L.wkv_a.T                                        # [T, C + dr]
        c = rms_norm(kv[:, :C], L.kv_a_norm, cfg.rms_eps)
        kpe = rope(np.ascontiguousarray(kv[:, None, C:]), positions, dr, cfg.rope_base, "norm")[:, 0]
        if cache is not None:
            c, kpe = cache.append(il, c, kpe)
        a = attn(L, cfg, q_nope, q_pe, c, kpe, pos0).reshape(T, -1)
        x = x + a @ L.wo.T
        h = rms_norm(x, L.ffn_norm, cfg.rms_eps)
        x = x + (silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
    if cache is not None:
        cache.n_past += T
    return rms_norm(x, model.output_norm, cfg.rms_eps)


def logits_from_hidden(model: Model, h):
    return h @ model.output.T


def forward(model: Model, tokens, dtype=np.float32, absorbed=False) -> np.ndarray:
    return logits_from_hidden(model, forward_hidden(model, tokens, None, absorbed)).astype(
        dtype, copy=False)


def forward_and_greedy(model: Model, tokens, n, all_logits=True):
    cache = new_cache(model)
    h = forward_hidden(model, tokens, cache)
    tf = logits_from_hidden(model, h) if all_logits else None
    h = h[-1:]
    out, rows = [], []
    for i in range(n):
        logits = logits_from_hidden(model, h)[0]
        nxt = int(np.argmax(logits))
        out.append(nxt)
        rows.append(logits)
        if i + 1 < n:
            h = forward_hidden(model, [nxt], cache)
    rows = np.stack(rows) if rows else np.zeros((0, model.cfg.vocab))
    return tf, out, rows


def greedy(model: Model, tokens, n, return_logits=False):
    _, cont, rows = forward_and_greedy(model, tokens, n, all_logits=False)
    return (cont, rows) if return_logits else cont


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--tokens", required=True, help="comma-separated token ids")
    ap.add_argument("--greedy", type=int, default=0)
    args = ap.parse_args(argv)
    model = load_model(args.model)
    print(model.cfg, file=sys.stderr)
    tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    tf, cont, _ = forward_and_greedy(model, tokens, args.greedy)
    lp = log_softmax(tf)
    top = np.argsort(-lp[-1])[:5]
    print("last position top-5:", ", ".join(f"{i}:{lp[-1, i]:.4f}" for i in top))
    if cont:
        print("greedy:", ",".join(map(str, cont)))


if __name__ == "__main__":
    main()
