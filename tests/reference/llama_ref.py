#!/usr/bin/env python3
"""Independent numpy oracle for the Llama-family forward pass, read straight from a GGUF.

Shares no code with the C++ engine. Weights are dequantized with the `gguf` package
(gguf.quants.dequantize) and held in float64; all activations are computed in float64
(load_model(path, dtype=np.float32) for a 2x faster float32 oracle).

Conventions (the ones the C++ engine must match):
  * A GGUF tensor with dims [ne0, ne1] (ne0 = contiguous) is the numpy array [ne1, ne0];
    a projection W is [n_out, n_in] and y = x @ W.T.
  * RMSNorm: x / sqrt(mean(x^2) + eps) * w.
  * RoPE, 'norm' style (GGML_ROPE_TYPE_NORM, llama): rotate adjacent pairs (x[2i], x[2i+1])
    by theta_i = pos * base^(-2i/n_rot), i < n_rot/2. llama.cpp's converter permutes the
    Q/K rows of HF llama checkpoints so that this is the right style for the GGUF.
    'neox' style rotates (x[i], x[i + n_rot/2]) instead (qwen2, gemma, phi3, ...).
  * GQA: query head h reads kv head h // (n_head / n_head_kv).
  * Tied output: logits use output.weight if present, else token_embd.weight.

CLI:
  python tests/reference/llama_ref.py --model models/SmolLM2-135M-Instruct.Q4_1.gguf \
      --tokens 1,2,3 [--greedy N] [--rope-style norm|neox] [--out file.npz]
  (or --text "..." to tokenize with tests/reference/tokenizer_ref.py)
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import gguf

# architecture -> RoPE style, as llama.cpp's llama_model_rope_type() assigns them.
ROPE_STYLE_BY_ARCH = {
    "llama": "norm", "mistral": "norm", "baichuan": "norm", "starcoder": "norm",
    "granite": "norm", "deci": "norm", "minicpm": "norm", "llama4": "norm",
    "qwen2": "neox", "qwen3": "neox", "qwen2moe": "neox", "gemma": "neox", "gemma2": "neox",
    "gemma3": "neox", "phi2": "neox", "phi3": "neox", "stablelm": "neox", "falcon": "neox",
    "gptneox": "neox", "olmo2": "neox",
}


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
    rope_base: float
    rms_eps: float
    vocab: int
    n_ctx_train: int
    rope_style: str


@dataclass
class Layer:
    attn_norm: np.ndarray
    wq: np.ndarray
    wk: np.ndarray
    wv: np.ndarray
    wo: np.ndarray
    ffn_norm: np.ndarray
    w_gate: np.ndarray
    w_up: np.ndarray
    w_down: np.ndarray


@dataclass
class Model:
    cfg: Config
    tok_embd: np.ndarray          # [vocab, n_embd]
    output_norm: np.ndarray       # [n_embd]
    output: np.ndarray            # [vocab, n_embd] (may alias tok_embd)
    layers: list = field(default_factory=list)
    path: str = ""
    tensor_types: dict = field(default_factory=dict)


def _field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def dequant_tensor(t, dtype=np.float64) -> np.ndarray:
    """Dequantize a ReaderTensor to numpy with shape = reversed GGUF dims ([ne1, ne0] for 2-D)."""
    shape = tuple(int(d) for d in reversed(list(t.shape)))
    w = gguf.quants.dequantize(t.data, t.tensor_type)
    return np.asarray(w, dtype=np.float32).reshape(shape).astype(dtype, copy=False)


def load_config(reader) -> Config:
    arch = _field(reader, "general.architecture")
    a = lambda k, d=None: _field(reader, f"{arch}.{k}", d)
    n_embd = int(a("embedding_length"))
    n_head = int(a("attention.head_count"))
    n_head_kv = int(a("attention.head_count_kv", n_head))
    head_dim = int(a("attention.key_length", n_embd // n_head))
    vocab = a("vocab_size")
    if vocab is None:
        vocab = len(reader.fields["tokenizer.ggml.tokens"].data)
    return Config(
        arch=arch,
        n_layer=int(a("block_count")),
        n_embd=n_embd,
        n_head=n_head,
        n_head_kv=n_head_kv,
        head_dim=head_dim,
        n_ff=int(a("feed_forward_length")),
        n_rot=int(a("rope.dimension_count", head_dim)),
        rope_base=float(a("rope.freq_base", 10000.0)),
        rms_eps=float(a("attention.layer_norm_rms_epsilon", 1e-5)),
        vocab=int(vocab),
        n_ctx_train=int(a("context_length", 0)),
        rope_style=ROPE_STYLE_BY_ARCH.get(arch, "norm"),
    )


def load_model(path, dtype=np.float64, rope_style: str | None = None) -> Model:
    reader = gguf.GGUFReader(str(path))
    cfg = load_config(reader)
    if rope_style is not None:
        cfg.rope_style = rope_style
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
            ffn_norm=get(p + "ffn_norm.weight"),
            w_gate=get(p + "ffn_gate.weight"), w_up=get(p + "ffn_up.weight"),
            w_down=get(p + "ffn_down.weight"),
        ))
    m = Model(cfg=cfg, tok_embd=tok_embd, output_norm=get("output_norm.weight"),
              output=output, layers=layers, path=str(path),
              tensor_types={n: t.tensor_type.name for n, t in tensors.items()})
    L0 = layers[0]
    assert tok_embd.shape == (cfg.vocab, cfg.n_embd), tok_embd.shape
    assert L0.wq.shape == (cfg.n_head * cfg.head_dim, cfg.n_embd)
    assert L0.wk.shape == (cfg.n_head_kv * cfg.head_dim, cfg.n_embd)
    assert L0.w_gate.shape == (cfg.n_ff, cfg.n_embd) and L0.w_down.shape == (cfg.n_embd, cfg.n_ff)
    return m


# ---------------------------------------------------------------- building blocks

def rms_norm(x, w, eps):
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * w


def silu(x):
    return x / (1.0 + np.exp(-x))


def rope(x, positions, n_rot, base, style):
    """x: [T, H, D]; positions: [T]. Returns a rotated copy. Only the first n_rot dims rotate."""
    half = n_rot // 2
    inv_freq = base ** (-np.arange(half, dtype=np.float64) * 2.0 / n_rot)     # [half]
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv_freq[None, :]  # [T, half]
    cos = np.cos(ang)[:, None, :].astype(x.dtype)
    sin = np.sin(ang)[:, None, :].astype(x.dtype)
    out = x.copy()
    if style == "norm":
        x0, x1 = x[..., 0:n_rot:2], x[..., 1:n_rot:2]
        out[..., 0:n_rot:2] = x0 * cos - x1 * sin
        out[..., 1:n_rot:2] = x0 * sin + x1 * cos
    elif style == "neox":
        x0, x1 = x[..., :half], x[..., half:n_rot]
        out[..., :half] = x0 * cos - x1 * sin
        out[..., half:n_rot] = x0 * sin + x1 * cos
    else:
        raise ValueError(f"unknown rope style {style!r}")
    return out


class KVCache:
    """Per layer K and V, [n_past, n_head_kv, head_dim], in buffers grown by doubling."""

    def __init__(self, n_layer):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.n_past = 0

    def append(self, il, k, v):
        n0, n1 = self.n_past, self.n_past + len(k)
        buf = self.k[il]
        if buf is None or n1 > len(buf):
            cap = max(n1, 2 * (0 if buf is None else len(buf)), 64)
            nk = np.empty((cap,) + k.shape[1:], k.dtype)
            nv = np.empty((cap,) + v.shape[1:], v.dtype)
            if buf is not None:
                nk[:n0], nv[:n0] = self.k[il][:n0], self.v[il][:n0]
            self.k[il], self.v[il] = nk, nv
        self.k[il][n0:n1], self.v[il][n0:n1] = k, v
        return self.k[il][:n1], self.v[il][:n1]


def attention(q, k, v, q_pos0, key_mask=None, return_probs=False):
    """q: [T, H, D]; k, v: [S, Hkv, D] where keys are positions 0..S-1 and query t is at
    position q_pos0 + t. Causal softmax attention with GQA. Returns [T, H, D].

    key_mask (optional): bool [S] or [T, S], True = the key is visible (on top of the causal
    mask); e.g. the keys of evicted KV pages are False. Every query must see at least one key.
    return_probs: also return the softmax probabilities [H, T, S] (head h = kv*G + g)."""
    T, H, D = q.shape
    S, Hkv, _ = k.shape
    G = H // Hkv
    # head h = kv*G + g: group the G query heads of one kv head as extra rows
    qg = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D)
    kt = k.transpose(1, 2, 0)                                     # [Hkv, D, S]
    scores = np.matmul(qg, kt).reshape(Hkv, G, T, S) / np.sqrt(D)
    qpos = q_pos0 + np.arange(T)
    mask = np.arange(S)[None, :] > qpos[:, None]                  # [T, S] future keys
    if key_mask is not None:
        mask = mask | ~np.broadcast_to(np.asarray(key_mask, dtype=bool), (T, S))
    if mask.any():
        scores += np.where(mask, -np.inf, 0.0)                    # broadcast over heads
    scores -= scores.max(axis=-1, keepdims=True)
    p = np.exp(scores)
    p /= p.sum(axis=-1, keepdims=True)
    out = np.matmul(p.reshape(Hkv, G * T, S), v.transpose(1, 0, 2))  # [Hkv, G*T, D]
    out = out.reshape(Hkv, G, T, D).transpose(2, 0, 1, 3).reshape(T, H, D)
    if return_probs:
        return out, p.reshape(H, T, S)
    return out


def forward_hidden(model: Model, tokens, cache: KVCache | None = None, rope_style=None,
                   key_mask=None, attn_hook=None):
    """Run tokens (at positions cache.n_past ...) through all layers. Returns the final-normed
    hidden states [T, n_embd]. Appends to `cache` if given.

    key_mask (optional): bool [S] or [T, S] over all keys the queries can reach (the cache
    after appending these tokens), True = visible; the same mask in every layer (see attention).
    attn_hook (optional): called as attn_hook(il, probs) per layer with the attention
    probabilities [H, T, S]."""
    cfg = model.cfg
    style = rope_style or cfg.rope_style
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    pos0 = cache.n_past if cache is not None else 0
    positions = pos0 + np.arange(T)
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    x = model.tok_embd[tokens]                                    # [T, n_embd]
    for il, L in enumerate(model.layers):
        h = rms_norm(x, L.attn_norm, cfg.rms_eps)
        q = (h @ L.wq.T).reshape(T, H, D)
        k = (h @ L.wk.T).reshape(T, Hkv, D)
        v = (h @ L.wv.T).reshape(T, Hkv, D)
        q = rope(q, positions, cfg.n_rot, cfg.rope_base, style)
        k = rope(k, positions, cfg.n_rot, cfg.rope_base, style)
        if cache is not None:
            k, v = cache.append(il, k, v)
        if attn_hook is None:
            a = attention(q, k, v, pos0, key_mask)
        else:
            a, probs = attention(q, k, v, pos0, key_mask, return_probs=True)
            attn_hook(il, probs)
        a = a.reshape(T, H * D)
        x = x + a @ L.wo.T
        h = rms_norm(x, L.ffn_norm, cfg.rms_eps)
        x = x + (silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
    if cache is not None:
        cache.n_past += T
    return rms_norm(x, model.output_norm, cfg.rms_eps)


def forward(model: Model, tokens, rope_style=None, dtype=np.float32) -> np.ndarray:
    """Teacher-forced logits for every position: [n_tokens, vocab] (float32 by default;
    pass dtype=np.float64 to keep the full precision of the computation)."""
    h = forward_hidden(model, tokens, None, rope_style)
    return (h @ model.output.T).astype(dtype, copy=False)


def log_softmax(logits, axis=-1):
    logits = np.asarray(logits, dtype=np.float64)
    m = logits.max(axis=axis, keepdims=True)
    return logits - m - np.log(np.exp(logits - m).sum(axis=axis, keepdims=True))


def greedy(model: Model, tokens, n, rope_style=None, return_logits=False):
    """Greedy continuation of n tokens, using a KV cache. Returns the list of new ids
    (and, with return_logits, the float64 logits that chose each of them: [n, vocab])."""
    _, cont, rows = forward_and_greedy(model, tokens, n, rope_style, all_logits=False)
    return (cont, rows) if return_logits else cont


def forward_and_greedy(model: Model, tokens, n, rope_style=None, all_logits=True):
    """One prefill over `tokens` (kept in a KV cache), then n greedy steps from it.
    Returns (teacher-forced logits [T, vocab] float64 or None, greedy ids [n],
    logits that chose each greedy id [n, vocab] float64)."""
    cache = KVCache(model.cfg.n_layer)
    h = forward_hidden(model, tokens, cache, rope_style)
    tf = (h @ model.output.T) if all_logits else None
    h = h[-1:]
    out, rows = [], []
    for i in range(n):
        logits = (h @ model.output.T)[0]
        nxt = int(np.argmax(logits))
        out.append(nxt)
        rows.append(logits)
        if i + 1 < n:
            h = forward_hidden(model, [nxt], cache, rope_style)
    rows = np.stack(rows) if rows else np.zeros((0, model.cfg.vocab))
    return tf, out, rows


def perplexity(model: Model, tokens, rope_style=None) -> float:
    lp = log_softmax(forward(model, tokens, rope_style, dtype=np.float64))
    tokens = np.asarray(tokens)
    nll = -lp[np.arange(len(tokens) - 1), tokens[1:]]
    return float(np.exp(nll.mean()))


# ---------------------------------------------------------------- CLI

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True)
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--tokens", help="comma-separated token ids")
    g.add_argument("--text", help="text, tokenized with tokenizer_ref.py")
    ap.add_argument("--greedy", type=int, default=0, help="greedy continuation length")
    ap.add_argument("--rope-style", choices=["norm", "neox"], default=None,
                    help="override the architecture's RoPE style")
    ap.add_argument("--out", help="save tokens, logits [T, vocab] f32 and greedy ids to .npz")
    args = ap.parse_args(argv)

    t0 = time.time()
    model = load_model(args.model)
    print(f"loaded {args.model} ({model.cfg.arch}, rope {args.rope_style or model.cfg.rope_style}) "
          f"in {time.time() - t0:.1f}s", file=sys.stderr)
    tok = None
    if args.text is not None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from tokenizer_ref import load_tokenizer, encode
        tok = load_tokenizer(args.model)
        tokens = encode(tok, args.text)
    else:
        tokens = [int(t) for t in args.tokens.split(",") if t.strip()]
    print("tokens:", ",".join(map(str, tokens)))

    t0 = time.time()
    logits = forward(model, tokens, args.rope_style)
    lp = log_softmax(logits)
    print(f"forward over {len(tokens)} tokens: {time.time() - t0:.2f}s", file=sys.stderr)
    if len(tokens) > 1:
        nll = -lp[np.arange(len(tokens) - 1), np.asarray(tokens[1:])]
        print(f"perplexity: {np.exp(nll.mean()):.3f}")
    top = np.argsort(-lp[-1])[:5]
    print("last position top-5:", ", ".join(f"{i}:{lp[-1, i]:.4f}" for i in top))
    cont = []
    if args.greedy > 0:
        t0 = time.time()
        cont = greedy(model, tokens, args.greedy, args.rope_style)
        print(f"greedy ({time.time() - t0:.2f}s):", ",".join(map(str, cont)))
        if tok is not None:
            print("greedy text:", repr(tok.decode(cont, skip_special_tokens=False)))
    if args.out:
        np.savez_compressed(args.out, tokens=np.asarray(tokens, np.int32), logits=logits,
                            greedy=np.asarray(cont, np.int32))
        print("wrote", args.out, file=sys.stderr)


if __name__ == "__main__":
    main()
