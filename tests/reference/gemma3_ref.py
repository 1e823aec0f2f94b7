#!/usr/bin/env python3
"""Independent numpy oracle for the Gemma 3 forward pass (GGUF arch "gemma3").

Shares the GGUF reading, dequantization (gguf.quants.dequantize, float64), RMSNorm, RoPE and
KV cache of tests/reference/llama_ref.py; no code of the C++ engine. Everything is float64.

The architecture as the GGUF describes it (llama.cpp src/models/gemma3.cpp,
llama-hparams.{h,cpp}, conversion/gemma.py of the vendored llama.cpp in bench/peer/work):

  x0 = token_embd[tok] * sqrt(n_embd)           (exact sqrt(640); HF rounds it to bf16 25.25,
                                                  llama.cpp and this oracle do not)
  per layer il:
    h  = rms_norm(x, attn_norm)
    q  = h @ Wq.T -> [T, n_head, 256];  k = h @ Wk.T -> [T, n_head_kv, 256];  v = h @ Wv.T
    q  = rms_norm_per_head(q, attn_q_norm);  k = rms_norm_per_head(k, attn_k_norm)
    q, k = rope_neox(q, k, base = rope_base_swa if swa(il) else rope_base), all 256 dims
    q  = q * attn_scale                         (1/sqrt(head_dim) = 1/16; 1/sqrt(n_embd/n_head)
                                                  only for the 62-layer 27B, as llama.cpp)
    a  = softmax(q k^T + mask) v                (no further 1/sqrt(d) scaling)
         mask: key j visible to the query at position p iff j <= p and, on sliding-window
         layers, p - j < n_swa  (llama_hparams::is_masked_swa: masked iff p - j >= n_swa),
         i.e. the window is the n_swa = 512 positions (p-512, p], the query's own included
    x  = x + rms_norm(a @ Wo.T, post_attention_norm)
    h  = rms_norm(x, ffn_norm)
    x  = x + rms_norm((gelu_tanh(h @ Wgate.T) * (h @ Wup.T)) @ Wdown.T, post_ffw_norm)
  logits = rms_norm(x, output_norm) @ token_embd.T   (tied; output.weight if present)
  logits = c * tanh(logits / c) if gemma3.final_logit_softcapping = c is set (not in 270m)

  * Norm weights: used as stored (y = x/rms * w). The converter already added Gemma's +1
    (Gemma3RMSNorm computes x * (1 + w)): every stored norm weight minus 1 is exactly a
    bfloat16 value, the stored weights themselves are not (checked in
    tests/py/test_gemma3_reference.py).
  * Sliding-window layers: gemma3.attention.sliding_window_pattern if present (array of bools
    per layer, or an int n), else n = 6; layer il is sliding iff il % n < n - 1. With n = 6 and
    18 layers: global (full attention) layers are 5, 11, 17; all others slide.
  * RoPE bases: global layers gemma3.rope.freq_base (1e6); sliding layers
    gemma3.rope.freq_base_swa if present, else 10000 (llama.cpp's default; the 270m GGUF has
    no such key). NEOX style (rotate (x[i], x[i+128])), theta_i = pos * base^(-2i/256).
  * RMSNorm eps: gemma3.attention.layer_norm_rms_epsilon (1e-6) for every norm incl. QK-norm.

Same API as llama_ref: load_model, forward_hidden(model, tokens, cache), logits_from_hidden,
forward, forward_and_greedy, greedy, perplexity.

CLI: python tests/reference/gemma3_ref.py --model models/gemma-3-270m-Q4_K_M.gguf \
        (--tokens 2,818,5279 | --text "...") [--greedy N]
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import gguf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_ref import (KVCache, _field, dequant_tensor, log_softmax,  # noqa: E402
                       rms_norm, rope)


@dataclass
class Config:
    arch: str
    n_layer: int
    n_embd: int
    n_head: int
    n_head_kv: int
    head_dim: int
    n_ff: int
    n_rot: int
    rope_base: float          # global (full-attention) layers
    rope_base_swa: float      # sliding-window layers
    rms_eps: float
    vocab: int
    n_ctx_train: int
    n_swa: int                # sliding window size (0: no sliding layers)
    swa_layers: list          # [n_layer] bool: layer uses the sliding window
    attn_scale: float         # query scale applied after RoPE
    final_logit_softcap: float  # 0: none
    embd_scale: float
    rope_style: str = "neox"

    @property
    def global_layers(self):
        return [i for i, s in enumerate(self.swa_layers) if not s]


@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    q_norm: np.ndarray
    k_norm: np.ndarray
    post_attn_norm: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray
    post_ffn_norm: np.ndarray


@dataclass
class Model:
    cfg: Config
    tok_embd: np.ndarray
    output_norm: np.ndarray
    output: np.ndarray
    layers: list = field(default_factory=list)
    path: str = ""
    tensor_types: dict = field(default_factory=dict)


def swa_pattern(reader, arch: str, n_layer: int, n_swa: int) -> list:
    """llama_model_base::load_swa_pattern(ml, 6) + llama_hparams::set_swa_pattern(n, false)."""
    if n_swa <= 0:
        return [False] * n_layer
    key = f"{arch}.attention.sliding_window_pattern"
    f = reader.fields.get(key)
    if f is not None:
        v = f.contents()
        if isinstance(v, list):
            assert len(v) >= n_layer, (key, len(v))
            return [bool(x) for x in v[:n_layer]]
        n = int(v)
    else:
        n = 6
    return [n == 0 or (il % n < n - 1) for il in range(n_layer)]


def load_config(reader) -> Config:
    arch = _field(reader, "general.architecture")
    if arch != "gemma3":
        raise ValueError(f"gemma3_ref: architecture {arch!r} is not gemma3")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    n_layer = int(a("block_count"))
    n_embd = int(a("embedding_length"))
    n_head = int(a("attention.head_count"))
    head_dim = int(a("attention.key_length", n_embd // n_head))
    assert int(a("attention.value_length", head_dim)) == head_dim
    vocab = a("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    n_swa = int(a("attention.sliding_window", 0) or 0)
    # gemma_pytorch config: query_pre_attn_scalar = n_embd / n_head for 27B, head_dim otherwise;
    # llama.cpp keys this on the layer count (62 = 27B).
    attn_scale = (1.0 / math.sqrt(n_embd // n_head) if n_layer == 62
                  else 1.0 / math.sqrt(head_dim))
    return Config(
        arch=arch, n_layer=n_layer, n_embd=n_embd, n_head=n_head,
        n_head_kv=int(a("attention.head_count_kv", n_head)), head_dim=head_dim,
        n_ff=int(a("feed_forward_length")),
        n_rot=int(a("rope.dimension_count", head_dim)),
        rope_base=float(a("rope.freq_base", 10000.0)),
        rope_base_swa=float(a("rope.freq_base_swa", 10000.0)),
        rms_eps=float(a("attention.layer_norm_rms_epsilon")),
        vocab=int(vocab), n_ctx_train=int(a("context_length", 0)),
        n_swa=n_swa, swa_layers=swa_pattern(reader, arch, n_layer, n_swa),
        attn_scale=attn_scale,
        final_logit_softcap=float(a("final_logit_softcapping", 0.0) or 0.0),
        embd_scale=math.sqrt(n_embd),
    )


def load_model(path, dtype=np.float64) -> Model:
    reader = gguf.GGUFReader(str(path))
    cfg = load_config(reader)
    tensors = {t.name: t for t in reader.tensors}
    get = lambda name: dequant_tensor(tensors[name], dtype)
    tok_embd = get("token_embd.weight")
    output = get("output.weight") if "output.weight" in tensors else tok_embd
    layers = []
    for i in range(cfg.n_layer):
        p = f"blk.{i}."
        layers.append(Layer(
            attn_norm=get(p + "attn_norm.weight"),
            wq=get(p + "attn_q.weight"), wk=get(p + "attn_k.weight"),
            wv=get(p + "attn_v.weight"), wo=get(p + "attn_output.weight"),
            q_norm=get(p + "attn_q_norm.weight"), k_norm=get(p + "attn_k_norm.weight"),
            post_attn_norm=get(p + "post_attention_norm.weight"),
            ffn_norm=get(p + "ffn_norm.weight"),
            w_gate=get(p + "ffn_gate.weight"), w_up=get(p + "ffn_up.weight"),
            w_down=get(p + "ffn_down.weight"),
            post_ffn_norm=get(p + "post_ffw_norm.weight"),
        ))
    m = Model(cfg=cfg, tok_embd=tok_embd, output_norm=get("output_norm.weight"), output=output,
              layers=layers, path=str(path),
              tensor_types={n: t.tensor_type.name for n, t in tensors.items()})
    L0 = layers[0]
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    assert tok_embd.shape == (cfg.vocab, cfg.n_embd), tok_embd.shape
    assert L0.wq.shape == (H * D, cfg.n_embd) and L0.wk.shape == (Hkv * D, cfg.n_embd)
    assert L0.wv.shape == (Hkv * D, cfg.n_embd) and L0.wo.shape == (cfg.n_embd, H * D)
    assert L0.q_norm.shape == (D,) and L0.k_norm.shape == (D,)
    assert L0.w_gate.shape == (cfg.n_ff, cfg.n_embd) and L0.w_down.shape == (cfg.n_embd, cfg.n_ff)
    return m


# ---------------------------------------------------------------- building blocks

def gelu_tanh(x):
    """GELU, tanh approximation (ggml_gelu; HF gelu_pytorch_tanh)."""
    return 0.5 * x * (1.0 + np.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x * x * x)))


def attention_mask(q_pos, k_pos, window: int = 0):
    """[T, S] bool, True = masked. Causal; with window > 0 also masks keys with
    q_pos - k_pos >= window (llama.cpp LLAMA_SWA_TYPE_STANDARD)."""
    d = np.asarray(q_pos)[:, None] - np.asarray(k_pos)[None, :]
    m = d < 0
    if window > 0:
        m |= d >= window
    return m


def attention(q, k, v, q_pos0, scale=1.0, window=0):
    """q: [T, H, D]; k, v: [S, Hkv, D] at key positions 0..S-1, query t at q_pos0 + t.
    Softmax(scale * q k^T + mask) v with GQA (head h reads kv head h // (H / Hkv))."""
    T, H, D = q.shape
    S, Hkv, Dv = v.shape
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D)
    scores = np.matmul(qg, k.transpose(1, 2, 0)).reshape(Hkv, G, T, S) * scale
    mask = attention_mask(q_pos0 + np.arange(T), np.arange(S), window)
    scores = scores + np.where(mask, -np.inf, 0.0)
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.matmul(p.reshape(Hkv, G * T, S), v.transpose(1, 0, 2))
    return out.reshape(Hkv, G, T, Dv).transpose(2, 0, 1, 3).reshape(T, H, Dv)


def new_cache(model: Model) -> KVCache:
    return KVCache(model.cfg.n_layer)


def forward_hidden(model: Model, tokens, cache: KVCache | None = None, window_override=None):
    """Run tokens (at positions cache.n_past ...) through all layers; returns the final-normed
    hidden states [T, n_embd] and appends K/V to `cache` if given. window_override: use this
    window on the sliding layers instead of n_swa (0 = no window: for tests only)."""
    cfg = model.cfg
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    pos0 = cache.n_past if cache is not None else 0
    positions = pos0 + np.arange(T)
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    window = cfg.n_swa if window_override is None else window_override
    x = model.tok_embd[tokens] * cfg.embd_scale
    for il, L in enumerate(model.layers):
        swa = cfg.swa_layers[il]
        base = cfg.rope_base_swa if swa else cfg.rope_base
        h = rms_norm(x, L.attn_norm, cfg.rms_eps)
        q = rms_norm((h @ L.wq.T).reshape(T, H, D), L.q_norm, cfg.rms_eps)
        k = rms_norm((h @ L.wk.T).reshape(T, Hkv, D), L.k_norm, cfg.rms_eps)
        v = (h @ L.wv.T).reshape(T, Hkv, D)
        q = rope(q, positions, cfg.n_rot, base, "neox") * cfg.attn_scale
        k = rope(k, positions, cfg.n_rot, base, "neox")
        if cache is not None:
            k, v = cache.append(il, k, v)
        a = attention(q, k, v, pos0, 1.0, window if swa else 0).reshape(T, H * D)
        x = x + rms_norm(a @ L.wo.T, L.post_attn_norm, cfg.rms_eps)
        h = rms_norm(x, L.ffn_norm, cfg.rms_eps)
        f = (gelu_tanh(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
        x = x + rms_norm(f, L.post_ffn_norm, cfg.rms_eps)
    if cache is not None:
        cache.n_past += T
    return rms_norm(x, model.output_norm, cfg.rms_eps)


def logits_from_hidden(model: Model, h):
    z = h @ model.output.T
    c = model.cfg.final_logit_softcap
    if c:
        z = c * np.tanh(z / c)
    return z


def forward(model: Model, tokens, dtype=np.float32, window_override=None) -> np.ndarray:
    """Teacher-forced logits [T, vocab] (T * 262144 * 8 bytes in float64: keep T modest)."""
    h = forward_hidden(model, tokens, None, window_override)
    return logits_from_hidden(model, h).astype(dtype, copy=False)


def forward_and_greedy(model: Model, tokens, n, all_logits=True):
    """One prefill (kept in a KV cache), then n greedy steps. Returns (teacher-forced logits
    [T, vocab] float64 or None, greedy ids [n], logits that chose each id [n, vocab])."""
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


def perplexity(model: Model, tokens, window_override=None) -> float:
    lp = log_softmax(forward(model, tokens, np.float64, window_override))
    tokens = np.asarray(tokens)
    nll = -lp[np.arange(len(tokens) - 1), tokens[1:]]
    return float(np.exp(nll.mean()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help="comma-separated token ids (include BOS = 2 yourself)")
    g.add_argument("--text", help="text, tokenized with spm_tokenizer_ref.py (BOS added)")
    ap.add_argument("--greedy", type=int, default=0)
    args = ap.parse_args(argv)
    t0 = time.time()
    model = load_model(args.model)
    print(f"loaded {args.model} in {time.time() - t0:.1f}s: {model.cfg}", file=sys.stderr)
    tok = None
    if args.text is not None:
        from spm_tokenizer_ref import load_tokenizer
        tok = load_tokenizer(args.model)
        tokens = tok.encode(args.text)
    else:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    print("tokens:", ",".join(map(str, tokens)))
    tf, cont, _ = forward_and_greedy(model, tokens, args.greedy)
    lp = log_softmax(tf)
    if len(tokens) > 1:
        nll = -lp[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
        print(f"perplexity: {np.exp(nll.mean()):.3f}")
    top = np.argsort(-lp[-1])[:5]
    print("last position top-5:", ", ".join(f"{i}:{lp[-1, i]:.4f}" for i in top))
    if cont:
        print("greedy:", ",".join(map(str, cont)))
        if tok is not None:
            print("greedy text:", repr(tok.decode(cont)))


if __name__ == "__main__":
    main()
