#!/usr/bin/env python3
"""Where does fp8_e4m3 KV-cache error come from? Simulated KV quantization on SmolLM2.

Runs the numpy Llama oracle (tests/reference/llama_ref.py, float32) over windows of a text
the way `kvserve perplexity` does (non-overlapping windows of --ctx tokens, positions
[ctx/2, ctx-1) scored), with its attention replaced by one that reads quantize->dequantize'd
K and V tiles exactly as kvserve's paged cache stores them (src/kernels/kv_tile.cpp):

  * pages of 16 tokens; a page's K/V are first rounded to f16 (the staging tile) and
    quantized when the page is full; a query reads its OWN page at f16 and every earlier
    page quantized (src/kv/page_pool.h);
  * fp8 (kvserve): one f32 scale per (page, kv head) tile, scale = amax / max_finite,
    round-to-nearest-even, saturating; keys first less a per-channel f16 zero point (the
    channel's midpoint over the page), the scale then sized for the residuals (e4m3_kmid;
    before: e4m3_tile);
  * int8 / int4 (kvserve): K per channel over the page's 16 tokens, V per token (int8: one
    group of head_dim channels; int4: groups of 32), {scale, min} stored as f16.

Schemes (name: K / V):
  f16                 f16 / f16 (the staging rounding alone)
  e4m3_tile      (a)  kvserve's first fp8_e4m3: per-(page, head) scale / same
  e4m3_kchan     (b)  e4m3 with per-(page, channel) key scale / per-tile V scale
  e4m3_noscale   (c)  plain e4m3 cast, no scale (saturating) / same
  e5m2_tile      (d)  kvserve's first fp8_e5m2 / same
  int8, int4     (e)  kvserve int8 / int4
  e4m3_tile_Konly     e4m3_tile K / f16 V      (attribution)
  e4m3_tile_Vonly     f16 K / e4m3_tile V      (attribution)
  e4m3_kzp            e4m3 keys with a per-(page, channel) zero point (midpoint) and scale
                      (the {scale, min} layout int8 keys use) / per-tile V scale
  e4m3_mant           e4m3's 3-bit mantissa with unlimited exponent range, no scale (what
                      no choice of scale can beat) / same
  e4m3_kmid           kvserve fp8_e4m3: keys with a per-(page, channel) f16 zero point
                      (midpoint) and ONE per-tile f32 scale for the residual / per-tile V scale
  e5m2_kmid           kvserve fp8_e5m2: the same with e5m2 codes / e5m2 per-tile V scale

Outputs (JSON, --out): per scheme and layer the relative error ||X^-X||/||X|| of K and V
(clean run's K/V, f32 reference), the relative error of that layer's attention output when
only that layer's K/V are quantized, the RMS error of the pre-softmax scores; per scheme the
end-to-end KL(base||scheme) over the full vocabulary, same-top-1 rate, PPL and dPPL vs an
f32-KV base run, on the scored positions. Plus diagnostics of the tile-scale hypothesis
(fraction of scaled values falling below e4m3's normal range).

Example (about 2-3 min per window on one core):
  OPENBLAS_NUM_THREADS=1 nice -n 10 python3 bench/fp8_kv_analysis.py --windows 2
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests" / "reference"))

BS = 16  # kvserve page size (token slots per page)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0

# ------------------------------------------------------------------ fp8 rounding

def fp_round(x, mbits, emin, maxv, unbounded=False):
    """Round float32 x to a float format with `mbits` mantissa bits, minimum normal exponent
    `emin` (subnormals below), round-to-nearest-even, saturating to +-maxv (like kvserve's
    fp32_to_fp8_*). unbounded=True: no subnormals and no saturation (mantissa rounding only)."""
    x = np.asarray(x, np.float32)
    a = np.abs(x)
    _, e = np.frexp(a)                       # a = f * 2^e, f in [0.5, 1)
    E = e.astype(np.int32) - 1
    if not unbounded:
        E = np.maximum(E, emin)
    ulp = np.ldexp(np.float32(1), E - mbits).astype(np.float32)
    q = (np.rint(a / ulp) * ulp).astype(np.float32)   # exact: division by a power of two
    if not unbounded:
        q = np.minimum(q, np.float32(maxv))
    q = np.where(a == 0, np.float32(0), q)
    return np.copysign(q, x).astype(np.float32)


def e4m3(x):
    return fp_round(x, 3, -6, E4M3_MAX)


def e5m2(x):
    return fp_round(x, 2, -14, E5M2_MAX)


def check_fp8_rounding():
    """Our rounding vs ml_dtypes on every finite f16 value (scaled into fp8's range) plus
    random f32s. Returns a dict of mismatch counts (None if ml_dtypes is missing)."""
    try:
        import ml_dtypes
    except ImportError:
        return None
    h = np.arange(0, 1 << 16, dtype=np.uint16).view(np.float16).astype(np.float32)
    h = h[np.isfinite(h)]
    rng = np.random.default_rng(0)
    r = (rng.standard_normal(200000) * np.exp2(rng.uniform(-20, 10, 200000))).astype(np.float32)
    out = {}
    for name, f, dt, mx in (("e4m3", e4m3, ml_dtypes.float8_e4m3fn, E4M3_MAX),
                            ("e5m2", e5m2, ml_dtypes.float8_e5m2, E5M2_MAX)):
        bad = 0
        for xs in (h, h / 64, h * 16, r):
            xs = np.clip(xs, -mx, mx)   # ml_dtypes gives NaN/inf past max; kvserve saturates
            ref = xs.astype(dt).astype(np.float32)
            bad += int(np.sum(ref != f(xs)))
        out[name] = bad
    return out


# ------------------------------------------------------------------ tile quantizers
# Inputs: X [S, Hkv, D] float32 with S a multiple of BS. Output: dequantized, same shape.

def f16(x):
    return x.astype(np.float16).astype(np.float32)


def pages(x):
    S, H, D = x.shape
    return x.reshape(S // BS, BS, H, D)       # [P, tok, H, D]


def q_fp8_tile(x, rnd, maxv):
    """kvserve: one scale per (page, head): scale = amax / max, value = rnd(x / scale) * scale."""
    p = pages(f16(x))
    amax = np.abs(p).max(axis=(1, 3), keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(maxv), np.float32(1)).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    y = np.clip(p * inv, -maxv, maxv)
    return (rnd(y) * scale).astype(np.float32).reshape(x.shape)


def q_fp8_chan(x, rnd, maxv):
    """Per (page, head, channel) scale over the page's 16 tokens."""
    p = pages(f16(x))
    amax = np.abs(p).max(axis=1, keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(maxv), np.float32(1)).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    y = np.clip(p * inv, -maxv, maxv)
    return (rnd(y) * scale).astype(np.float32).reshape(x.shape)


def q_fp8_chan_zp(x, rnd, maxv):
    """Per (page, head, channel) zero point (midpoint, f16) and scale (f16), like int8 keys."""
    p = pages(f16(x))
    mn, mx = p.min(axis=1, keepdims=True), p.max(axis=1, keepdims=True)
    z = f16((mn + mx) / 2)
    r = np.abs(p - z).max(axis=1, keepdims=True)
    scale = f16(np.where(r > 0, r / np.float32(maxv), np.float32(1)))
    scale = np.where(scale > 0, scale, np.float32(1))
    inv = (np.float32(1) / scale).astype(np.float32)
    y = np.clip((p - z) * inv, -maxv, maxv)
    return (z + rnd(y) * scale).astype(np.float32).reshape(x.shape)


def q_fp8_kmid(x, rnd, maxv):
    """Per (page, head, channel) f16 zero point z = the channel's midpoint over the page's
    tokens, and ONE f32 scale per (page, head) tile for the residual x - z."""
    p = pages(f16(x))
    mn, mx = p.min(axis=1, keepdims=True), p.max(axis=1, keepdims=True)
    z = f16((mn + mx) / 2)
    r = (p - z).astype(np.float32)
    amax = np.abs(r).max(axis=(1, 3), keepdims=True)
    scale = np.where(amax > 0, amax / np.float32(maxv), np.float32(1)).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    y = np.clip(r * inv, -maxv, maxv)
    return (z + rnd(y) * scale).astype(np.float32).reshape(x.shape)


def q_fp8_noscale(x, rnd, maxv):
    return rnd(np.clip(f16(x), -maxv, maxv))


def q_mant3(x):
    return fp_round(f16(x), 3, 0, 0, unbounded=True)


def _asym(g, axis, levels):
    """kv_tile.cpp quantize_group over `axis`: f16 {scale, min}, q = rint((x - min) / scale)."""
    mn, mx = g.min(axis=axis, keepdims=True), g.max(axis=axis, keepdims=True)
    s = f16((mx - mn) / np.float32(levels))
    z = f16(mn)
    inv = np.where(s > 0, np.float32(1) / np.where(s > 0, s, 1), np.float32(0)).astype(np.float32)
    q = np.clip(np.rint((g - z) * inv), 0, levels)
    return (z + s * q).astype(np.float32)


def q_int_k(x, levels):
    """Keys: one {scale, min} per (page, head, channel) over the page's tokens."""
    return _asym(pages(f16(x)), 1, levels).reshape(x.shape)


def q_int_v(x, levels, group):
    """Values: one {scale, min} per (token, head, group of `group` channels)."""
    S, H, D = x.shape
    g = f16(x).reshape(S, H, D // group, group)
    return _asym(g, 3, levels).reshape(x.shape)


def ident(x):
    return x


def make_schemes(head_dim):
    g4 = 32 if head_dim % 32 == 0 else 16
    t4 = lambda x: q_fp8_tile(x, e4m3, E4M3_MAX)
    return {
        # name: (K quantizer, V quantizer)
        "f16": (f16, f16),
        "e4m3_tile": (t4, t4),
        "e4m3_kchan": (lambda x: q_fp8_chan(x, e4m3, E4M3_MAX), t4),
        "e4m3_noscale": (lambda x: q_fp8_noscale(x, e4m3, E4M3_MAX),) * 2,
        "e5m2_tile": (lambda x: q_fp8_tile(x, e5m2, E5M2_MAX),) * 2,
        "int8": (lambda x: q_int_k(x, 255), lambda x: q_int_v(x, 255, head_dim)),
        "int4": (lambda x: q_int_k(x, 15), lambda x: q_int_v(x, 15, g4)),
        "e4m3_tile_Konly": (t4, f16),
        "e4m3_tile_Vonly": (f16, t4),
        "e4m3_kzp": (lambda x: q_fp8_chan_zp(x, e4m3, E4M3_MAX), t4),
        "e4m3_mant": (q_mant3, q_mant3),
        "e4m3_kmid": (lambda x: q_fp8_kmid(x, e4m3, E4M3_MAX), t4),
        "e5m2_kmid": (lambda x: q_fp8_kmid(x, e5m2, E5M2_MAX),
                      lambda x: q_fp8_tile(x, e5m2, E5M2_MAX)),
    }


# ------------------------------------------------------------------ attention / forward

def attention_paged(q, k_q, v_q, k_s, v_s):
    """Causal GQA attention, queries at positions 0..T-1 over keys 0..T-1 (T = len(q)).
    Keys/values in the query's own page come from k_s/v_s (f16 staging), earlier pages from
    k_q/v_q (quantized). k_s None: all from k_q/v_q. Returns [T, H, D] and the scores."""
    T, H, D = q.shape
    S, Hkv, _ = k_q.shape
    G = H // Hkv
    qg = q.reshape(T, Hkv, G, D).transpose(1, 2, 0, 3).reshape(Hkv, G * T, D)
    inv_sqrt = np.float32(1 / np.sqrt(D))
    s = (np.matmul(qg, k_q.transpose(1, 2, 0)) * inv_sqrt).reshape(Hkv, G, T, S)
    same = None
    if k_s is not None:
        qp, kp = np.arange(T) // BS, np.arange(S) // BS
        same = qp[:, None] == kp[None, :]                        # [T, S]
        s_s = (np.matmul(qg, k_s.transpose(1, 2, 0)) * inv_sqrt).reshape(Hkv, G, T, S)
        s = np.where(same, s_s, s)
    mask = np.arange(S)[None, :] > np.arange(T)[:, None]
    s = np.where(mask, -np.inf, s)
    p = np.exp(s - s.max(axis=-1, keepdims=True))
    p /= p.sum(axis=-1, keepdims=True)
    p = p.reshape(Hkv, G * T, S)
    if same is None:
        out = np.matmul(p, v_q.transpose(1, 0, 2))
    else:
        sm = np.broadcast_to(same, (G, T, S)).reshape(G * T, S)
        out = np.matmul(np.where(sm, 0, p), v_q.transpose(1, 0, 2)) + \
            np.matmul(np.where(sm, p, 0), v_s.transpose(1, 0, 2))
    out = out.reshape(Hkv, G, T, D).transpose(2, 0, 1, 3).reshape(T, H, D)
    return out.astype(np.float32), s


def forward(model, tokens, kq=None, vq=None, capture=None):
    """Oracle forward (llama_ref.forward_hidden) with kvserve's paged quantized KV. kq/vq None:
    f32 KV (the base). capture: list to receive (q, k, v) per layer. Returns final-normed
    hidden states [T, n_embd]."""
    import llama_ref as R
    cfg = model.cfg
    T = len(tokens)
    pos = np.arange(T)
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    x = model.tok_embd[np.asarray(tokens)]
    pad = (-T) % BS
    for L in model.layers:
        h = R.rms_norm(x, L.attn_norm, cfg.rms_eps)
        q = (h @ L.wq.T).reshape(T, H, D)
        k = (h @ L.wk.T).reshape(T, Hkv, D)
        v = (h @ L.wv.T).reshape(T, Hkv, D)
        q = R.rope(q, pos, cfg.n_rot, cfg.rope_base, cfg.rope_style)
        k = R.rope(k, pos, cfg.n_rot, cfg.rope_base, cfg.rope_style)
        if capture is not None:
            capture.append((q, k, v))
        if kq is None:
            a, _ = attention_paged(q, k, v, None, None)
        else:
            kp = np.concatenate([k, np.zeros((pad, Hkv, D), k.dtype)]) if pad else k
            vp = np.concatenate([v, np.zeros((pad, Hkv, D), v.dtype)]) if pad else v
            a, _ = attention_paged(q, kq(kp)[:T], vq(vp)[:T], f16(k), f16(v))
        x = x + a.reshape(T, H * D) @ L.wo.T
        h = R.rms_norm(x, L.ffn_norm, cfg.rms_eps)
        x = x + (R.silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
    return R.rms_norm(x, model.output_norm, cfg.rms_eps)


def log_softmax(z):
    z = z.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


# ------------------------------------------------------------------ per-layer statistics

def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def layer_stats(caps, schemes, n_tok):
    """Per layer: K/V relative errors, attention-output error with only this layer's K/V
    quantized (clean q), RMS of the pre-softmax score error (own page at f16 as in kvserve,
    causal entries only). Also tile-scale diagnostics."""
    T = n_tok - n_tok % BS                                  # whole pages only
    causal = np.arange(T)[None, :] <= np.arange(T)[:, None]
    other = causal & ((np.arange(T)[None, :] // BS) != (np.arange(T)[:, None] // BS))
    per = {n: {"k_rel": [], "v_rel": [], "attn_rel": [], "score_rms": []} for n in schemes}
    diag = {"k_tile_over_chan_amax_median": [], "k_frac_below_e4m3_normal_tile": [],
            "v_frac_below_e4m3_normal_tile": [], "k_frac_below_e4m3_normal_noscale": [],
            "k_amax": [], "v_amax": [], "k_score_std": [],
            "k_chan_mean_over_std_max": []}
    for q, k, v in caps:
        q, k, v = q[:T], k[:T], v[:T]
        ref, s_ref = attention_paged(q, k, v, None, None)
        # diagnostics of the tile-scale hypothesis
        for name, x in (("k", k), ("v", v)):
            p = pages(f16(x))
            amax_t = np.abs(p).max(axis=(1, 3), keepdims=True)
            y = np.abs(p) * (E4M3_MAX / amax_t)
            diag[f"{name}_frac_below_e4m3_normal_tile"].append(float(np.mean((y < 2 ** -6) & (p != 0))))
            diag[f"{name}_amax"].append(float(np.abs(x).max()))
        pk = pages(f16(k))
        amax_c = np.abs(pk).max(axis=1)                       # [P, H, D]
        amax_t = amax_c.max(axis=2, keepdims=True)
        diag["k_tile_over_chan_amax_median"].append(float(np.median(amax_t / np.maximum(amax_c, 1e-30))))
        diag["k_frac_below_e4m3_normal_noscale"].append(float(np.mean(np.abs(k) < 2 ** -6)))
        cm, cs = pk.mean(axis=1), pk.std(axis=1)
        diag["k_chan_mean_over_std_max"].append(float(np.median((np.abs(cm) / np.maximum(cs, 1e-30)).max(axis=-1))))
        sr = s_ref[..., other]
        diag["k_score_std"].append(float(sr.std()))
        for n, (fk, fv) in schemes.items():
            kh, vh = fk(k), fv(v)
            per[n]["k_rel"].append(rel(kh, k))
            per[n]["v_rel"].append(rel(vh, v))
            out, s = attention_paged(q, kh, vh, f16(k), f16(v))
            per[n]["attn_rel"].append(rel(out, ref))
            with np.errstate(invalid="ignore"):   # -inf - -inf off the causal entries
                ds = (s - s_ref)[..., causal]
            per[n]["score_rms"].append(float(np.sqrt(np.mean(ds ** 2))))
    return per, diag


# ------------------------------------------------------------------ C++ cross-check

SHIM = r"""
#include <vector>
#include <cstdint>
#include "kernels/kv_tile.h"
using namespace kv;
extern "C" void roundtrip(int is_v, int elem, int bs, int hd, const float* in, float* out) {
  const KvElem e = static_cast<KvElem>(elem);
  std::vector<uint8_t> st(kv_stage_tile_bytes(bs, hd));
  std::vector<uint8_t> t(is_v ? kv_v_tile_bytes(e, bs, hd) : kv_k_tile_bytes(e, bs, hd));
  for (int j = 0; j < bs; ++j)
    (is_v ? kv_write_v : kv_write_k)(st.data(), KvElem::kF16, bs, hd, j, in + j * hd);
  (is_v ? kv_quantize_v : kv_quantize_k)(reinterpret_cast<const uint16_t*>(st.data()), e, bs, hd, t.data());
  (is_v ? kv_read_v : kv_read_k)(t.data(), e, bs, hd, bs, out);
}
"""


def check_cpp(caps, head_dim, layers=(0, 1, 15, 29)):
    """Compiles src/kernels/kv_tile.cpp (+ quant_ref.cpp for the f16 conversions) with a
    round-trip shim into a temp dir and compares its quantize->dequantize of the real K/V
    tiles with this script's simulation. Returns {scheme: {K/V: max |diff|}}."""
    import ctypes
    import subprocess
    import tempfile
    d = tempfile.mkdtemp(prefix="kvchk")
    Path(d, "shim.cpp").write_text(SHIM)
    lib = os.path.join(d, "libkvchk.so")
    subprocess.run(["g++", "-O2", "-std=c++20", "-shared", "-fPIC", f"-I{ROOT / 'src'}", os.path.join(d, "shim.cpp"),
                    str(ROOT / "src/kernels/kv_tile.cpp"), str(ROOT / "src/kernels/quant_ref.cpp"), "-o", lib],
                   check=True)
    so = ctypes.CDLL(lib)
    ptr = lambda a: a.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    # kvserve's fp8 pages: keys with a per-channel zero point (kmid), values per-tile scaled
    elems = {"e4m3_kmid": 3, "e5m2_kmid": 4, "int8": 5, "int4": 6}
    sch = make_schemes(head_dim)
    out = {}
    for n, el in elems.items():
        out[n] = {"K": 0.0, "V": 0.0, "tiles": 0}
        for il in layers:
            _, k, v = caps[il]
            T = len(k) - len(k) % BS
            for is_v, x in ((0, k[:T]), (1, v[:T])):
                sim = sch[n][is_v](x)
                for p in range(T // BS):
                    for h in range(x.shape[1]):
                        tin = np.ascontiguousarray(x[p * BS:(p + 1) * BS, h], np.float32)
                        tout = np.empty_like(tin)
                        so.roundtrip(is_v, el, BS, head_dim, ptr(tin), ptr(tout))
                        dmax = float(np.abs(tout - sim[p * BS:(p + 1) * BS, h]).max())
                        key = "V" if is_v else "K"
                        out[n][key] = max(out[n][key], dmax)
                        out[n]["tiles"] += 1
    return out


# ------------------------------------------------------------------ main

def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog=__doc__.split("\n\n", 1)[1])
    ap.add_argument("--model", default=str(ROOT / "models/SmolLM2-135M-Instruct.Q4_1.gguf"))
    ap.add_argument("--text", default=str(ROOT / "data/text/pride_and_prejudice.txt"))
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--windows", type=int, default=2, help="first N windows of --ctx tokens (default 2)")
    ap.add_argument("--schemes", default="all", help="comma-separated subset of the schemes, or all")
    ap.add_argument("--stats-window", type=int, default=0, help="window whose clean K/V give the per-layer stats")
    ap.add_argument("--check-cpp", action="store_true",
                    help="also compile src/kernels/kv_tile.cpp (g++) and check the simulation against it")
    ap.add_argument("--out", default=str(ROOT / "bench/out/fp8_kv_analysis.json"))
    ap.add_argument("--plot", default=str(ROOT / "bench/out/fp8_kv_analysis.png"), help="'' for none")
    ap.add_argument("--replot", action="store_true", help="only redraw --plot from an existing --out JSON")
    args = ap.parse_args(argv)
    if args.replot:
        plot(json.load(open(args.out)), args.plot)
        return

    import gguf
    import llama_ref
    import tokenizer_ref

    t0 = time.time()
    reader = gguf.GGUFReader(args.model)
    f = reader.fields.get("tokenizer.ggml.add_bos_token")
    add_bos = bool(f.contents()) if f is not None else False
    bos = reader.fields["tokenizer.ggml.bos_token_id"].contents()
    text = open(args.text, encoding="utf-8").read()
    if text.endswith("\n"):
        text = text[:-1]
    ids = tokenizer_ref.encode(tokenizer_ref.load_tokenizer(reader), text)
    if add_bos:
        ids = [bos] + ids
    model = llama_ref.load_model(args.model, dtype=np.float32)
    cfg = model.cfg
    log = lambda *a: print(f"[{time.time() - t0:7.1f}s]", *a, file=sys.stderr, flush=True)
    log(f"{len(ids)} tokens; {cfg.arch} L={cfg.n_layer} H={cfg.n_head} Hkv={cfg.n_head_kv} D={cfg.head_dim}")

    schemes = make_schemes(cfg.head_dim)
    if args.schemes != "all":
        schemes = {n: schemes[n] for n in args.schemes.split(",")}
    rounding = check_fp8_rounding()
    log("fp8 rounding vs ml_dtypes, mismatches:", rounding)

    ctx, first = args.ctx, args.ctx // 2
    nll = {n: [] for n in ["base"] + list(schemes)}
    kl = {n: [] for n in schemes}
    top1 = {n: [] for n in schemes}
    stats = diag = cpp_check = None
    for w in range(args.windows):
        win = list(ids[w * ctx:(w + 1) * ctx])
        if add_bos:
            win[0] = bos
        inp, targets = win[:-1], np.asarray(win[first + 1:])
        caps = [] if w == args.stats_window else None
        h = forward(model, inp, capture=caps)
        lp_b = log_softmax(h[first:] @ model.output.T)
        nll["base"].append(-lp_b[np.arange(len(targets)), targets])
        log(f"window {w}: base PPL {np.exp(nll['base'][-1].mean()):.4f}")
        if caps is not None:
            if args.check_cpp:
                cpp_check = check_cpp(caps, cfg.head_dim)
                log("simulation vs kv_tile.cpp, max |diff| over real tiles:", cpp_check)
            stats, diag = layer_stats(caps, schemes, len(inp))
            del caps
            log("per-layer stats done")
        pb = np.exp(lp_b)
        for n, (fk, fv) in schemes.items():
            h = forward(model, inp, fk, fv)
            lp = log_softmax(h[first:] @ model.output.T)
            nll[n].append(-lp[np.arange(len(targets)), targets])
            kl[n].append((pb * (lp_b - lp)).sum(axis=1))
            top1[n].append(lp.argmax(1) == lp_b.argmax(1))
            log(f"window {w}: {n:16s} dNLL {np.mean(nll[n][-1] - nll['base'][-1]):+.5f} "
                f"KL {kl[n][-1].mean():.3e}")

    nb = np.concatenate(nll["base"])
    ppl_b = float(np.exp(nb.mean()))
    res = {"model": os.path.relpath(args.model, ROOT), "text": os.path.relpath(args.text, ROOT),
           "ctx": ctx, "windows": args.windows, "n_scored": int(len(nb)), "page_size": BS,
           "oracle": "tests/reference/llama_ref.py, float32 weights and activations",
           "base": "f32 KV", "ppl_base": ppl_b, "fp8_rounding_mismatches_vs_ml_dtypes": rounding,
           "max_abs_diff_vs_kv_tile_cpp": cpp_check,
           "schemes": {}, "diagnostics_per_layer": diag, "stats_window": args.stats_window}
    print(f"base PPL {ppl_b:.4f} over {len(nb)} scored tokens, {args.windows} window(s) of {ctx}")
    hdr = (f"{'scheme':17s} {'K rel':>8s} {'V rel':>8s} {'attn rel':>9s} {'score rms':>9s} "
           f"{'dPPL %':>8s} {'+-':>6s} {'mean KL':>9s} {'KL p99':>9s} {'top1 %':>7s}")
    print(hdr)
    for n in schemes:
        d = np.concatenate(nll[n]) - nb
        ppl = float(np.exp(np.concatenate(nll[n]).mean()))
        # delta PPL's standard error from the paired per-token NLL differences (to first order)
        se = 100 * float(np.exp(d.mean())) * d.std() / np.sqrt(len(d) - 1)
        k = np.concatenate(kl[n])
        st = stats[n]
        r = {"ppl": ppl, "delta_ppl": ppl - ppl_b, "delta_ppl_pct": 100 * (ppl / ppl_b - 1),
             "delta_ppl_pct_stderr": se, "kl_mean": float(k.mean()), "kl_p99": float(np.percentile(k, 99)),
             "top1_agreement": float(np.concatenate(top1[n]).mean()),
             "k_rel_mean": float(np.mean(st["k_rel"])), "v_rel_mean": float(np.mean(st["v_rel"])),
             "attn_rel_mean": float(np.mean(st["attn_rel"])),
             "score_rms_mean": float(np.mean(st["score_rms"])), "per_layer": st}
        res["schemes"][n] = r
        print(f"{n:17s} {r['k_rel_mean']:8.2e} {r['v_rel_mean']:8.2e} {r['attn_rel_mean']:9.2e} "
              f"{r['score_rms_mean']:9.2e} {r['delta_ppl_pct']:+8.3f} {se:6.3f} {r['kl_mean']:9.2e} "
              f"{r['kl_p99']:9.2e} {100 * r['top1_agreement']:7.2f}")
    print("diagnostics (median over layers):",
          {k: float(np.median(v)) for k, v in diag.items()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    with open(args.out, "w") as fo:
        json.dump(res, fo, indent=1)
    log("wrote", args.out)

    if args.plot:
        plot(res, args.plot)
        log("wrote", args.plot)


def plot(res, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(1, 3, figsize=(15, 4.4))
    sch = res["schemes"]
    show = [n for n in ("e4m3_tile", "e4m3_kchan", "e4m3_noscale", "e4m3_kzp", "e4m3_kmid", "e5m2_tile",
                        "e5m2_kmid", "int8", "int4")
            if n in sch]
    for n in show:
        st = sch[n]["per_layer"]
        lab = f"{n} (KL {sch[n]['kl_mean']:.1e}, dPPL {sch[n]['delta_ppl_pct']:+.2f}%)"
        ax[0].semilogy(st["k_rel"], label=lab)
        ax[1].semilogy(st["score_rms"], label=n)
        ax[2].semilogy(st["attn_rel"], label=n)
    for a, t in zip(ax, ("K: ||K^-K|| / ||K||", "RMS error of pre-softmax scores q.k/sqrt(d)",
                         "attention output rel. error (that layer's KV only)")):
        a.set_title(t, fontsize=10)
        a.set_xlabel("layer")
        a.grid(alpha=.3)
    ax[0].legend(fontsize=7)
    fig.suptitle(f"SmolLM2-135M simulated KV quantization: per-layer errors on window {res['stats_window']}; "
                 f"KL / dPPL vs f32 KV over {res['windows']} window(s) of {res['ctx']} ({res['n_scored']} scored tokens)",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)

if __name__ == "__main__":
    main()
