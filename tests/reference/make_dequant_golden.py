#!/usr/bin/env python3
"""Golden data for the C++ reference dequantizers (tests/unit/test_dequant_golden.cpp).

Independent of the C++ code: tensors are read with the `gguf` package's GGUFReader and
dequantized with gguf.quants.dequantize (numpy); fp16 with numpy's own float16.

Writes into tests/data/dequant_golden/:
  <model-stem>__<tensor>.bin   one per chosen tensor (format below)
  conversions.bin              fp16/bf16 conversion cases (format below)

Tensor file (little-endian):
  char[8]  "KVDQGLD1"
  u32      ggml type number
  u32      n_dims;   i64 ne[n_dims]       (GGUF order, ne[0] contiguous)
  u16 len + bytes    tensor name
  u16 len + bytes    model path relative to the repo root
  f64      sum, sum of |x|, sum of x^2 over the FULL dequantized tensor (float32 values
           widened to float64, numpy pairwise summation)
  u32      n_rows_stored; i64 row_index[n_rows_stored]
  f32      values[n_rows_stored][ne[0]]   dequantized rows, in row_index order

conversions.bin:
  char[8]  "KVCONV01"
  u64      FNV-1a 64 of the 65536 float32 values numpy gives for every half bit pattern
           (np.arange(65536).view(float16).astype(float32)), as little-endian bytes
  u32      n_cases; then per case: u32 float32 bits, u16 numpy float16 bits,
           u16 gguf BF16 bits (ggml's fp32->bf16 rule)

Run from anywhere:  python3 tests/reference/make_dequant_golden.py [--conversions-only]
"""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import numpy as np

try:
    import gguf
    from gguf.quants import dequantize
except ImportError:  # pragma: no cover
    sys.exit("pip install gguf (the package llama.cpp publishes)")

ROOT = Path(__file__).resolve().parents[2]
OUT = ROOT / "tests" / "data" / "dequant_golden"

# (model, tensor). Chosen to cover every type present in the two files; the largest tensors
# (token embeddings) make the full-tensor checksums meaningful.
CHOICES = [
    ("models/SmolLM2-135M-Instruct.Q4_1.gguf", "token_embd.weight"),        # Q8_0
    ("models/SmolLM2-135M-Instruct.Q4_1.gguf", "blk.0.ffn_down.weight"),    # Q4_1, ne0 1536
    ("models/SmolLM2-135M-Instruct.Q4_1.gguf", "blk.29.attn_k.weight"),     # Q4_1, ne0 576
    ("models/SmolLM2-135M-Instruct.Q4_1.gguf", "output_norm.weight"),       # F32
    ("models/gemma-3-270m-Q4_K_M.gguf", "token_embd.weight"),               # Q8_0, 262144 rows
    ("models/gemma-3-270m-Q4_K_M.gguf", "blk.0.attn_output.weight"),        # Q4_K, ne0 1024
    ("models/gemma-3-270m-Q4_K_M.gguf", "blk.2.ffn_down.weight"),           # Q4_K, ne0 2048
    ("models/gemma-3-270m-Q4_K_M.gguf", "blk.0.ffn_down.weight"),           # Q6_K
    ("models/gemma-3-270m-Q4_K_M.gguf", "blk.0.attn_q.weight"),             # Q5_0
    ("models/gemma-3-270m-Q4_K_M.gguf", "blk.0.attn_v.weight"),             # Q8_0
    ("models/gemma-3-270m-Q4_K_M.gguf", "blk.0.attn_q_norm.weight"),        # F32
]
N_HEAD_ROWS = 2          # rows 0..1, plus the last row (the tensor's tail)
CHUNK_ROWS = 8192        # bounds memory when checksumming the 167M-element gemma embedding


def fnv1a64(data: bytes) -> int:
    h = 0xCBF29CE484222325
    for b in data:
        h ^= b
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return h


def tensor_file(model_rel: str, name: str) -> None:
    path = ROOT / model_rel
    if not path.exists():
        sys.exit(f"{path} missing: run `make models`")
    reader = gguf.GGUFReader(path)
    t = next((t for t in reader.tensors if t.name == name), None)
    if t is None:
        sys.exit(f"{name} not in {model_rel}")
    qtype = gguf.GGMLQuantizationType(t.tensor_type)
    ne = [int(x) for x in t.shape]              # GGUF order
    raw = t.data                                # [rows, row bytes] (or [rows, ne0] for F32)
    n_rows = int(np.prod(ne[1:])) if len(ne) > 1 else 1
    raw = raw.reshape(n_rows, -1)

    s = sa = ss = 0.0
    for r0 in range(0, n_rows, CHUNK_ROWS):
        x = dequantize(raw[r0:r0 + CHUNK_ROWS], qtype).astype(np.float64)
        s += float(np.sum(x))
        sa += float(np.sum(np.abs(x)))
        ss += float(np.sum(x * x))

    rows = sorted(set(list(range(min(N_HEAD_ROWS, n_rows))) + [n_rows - 1]))
    vals = np.concatenate([dequantize(raw[r:r + 1], qtype).reshape(-1) for r in rows])
    assert vals.dtype == np.float32 and vals.size == len(rows) * ne[0]

    out = bytearray(b"KVDQGLD1")
    out += struct.pack("<II", int(qtype), len(ne)) + struct.pack(f"<{len(ne)}q", *ne)
    for s_ in (name, model_rel):
        b = s_.encode()
        out += struct.pack("<H", len(b)) + b
    out += struct.pack("<ddd", s, sa, ss)
    out += struct.pack("<I", len(rows)) + struct.pack(f"<{len(rows)}q", *rows)
    out += vals.astype("<f4").tobytes()
    dst = OUT / f"{Path(model_rel).stem}__{name}.bin"
    dst.write_bytes(bytes(out))
    print(f"{dst.relative_to(ROOT)}: {qtype.name} ne={ne} rows={rows} sum={s:.6g} "
          f"sumsq={ss:.6g} ({len(out)} bytes)")


def conversion_cases() -> np.ndarray:
    """float32 bit patterns that stress rounding: ties and their neighbours around every
    7th half value (an odd stride, so both even and odd halves: ties-to-even tells them
    apart), the subnormal/normal and overflow boundaries, specials, random values."""
    rng = np.random.default_rng(1234)
    halves = np.arange(0, 0x7C00, 7, dtype=np.uint16).view(np.float16).astype(np.float64)
    nxt = (np.arange(0, 0x7C00, 7, dtype=np.uint16) + 1).view(np.float16).astype(np.float64)
    mid = ((halves + nxt) / 2).astype(np.float32)   # exact: a tie in float32
    cases = [mid.view(np.uint32)]
    cases += [mid.view(np.uint32) + 1, mid.view(np.uint32) - 1]
    special = np.array([0.0, -0.0, np.inf, -np.inf, 65504.0, 65519.99, 65520.0, 65536.0,
                        2.0**-14, 2.0**-24, 2.0**-25, 2.0**-25 * 1.0000001, 2.0**-26,
                        1e-45, -1e-45, 3.0e38], dtype=np.float32).view(np.uint32)
    nans = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FA12345], dtype=np.uint32)
    rand = (rng.standard_normal(2000) * np.exp2(rng.integers(-26, 17, 2000))).astype(np.float32)
    cases += [special, nans, rand.view(np.uint32)]
    c = np.concatenate(cases)
    return np.concatenate([c, c ^ np.uint32(0x80000000)])  # both signs


def conversions_file() -> None:
    table = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16).astype(np.float32)
    h = fnv1a64(table.astype("<f4").tobytes())
    bits = conversion_cases()
    f = bits.view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        f16 = f.astype(np.float16).view(np.uint16)
    bf16 = gguf.quants.quantize(f.reshape(1, -1), gguf.GGMLQuantizationType.BF16).view(np.uint16)
    bf16 = bf16.reshape(-1)
    rec = np.zeros(bits.size, dtype=[("f", "<u4"), ("h", "<u2"), ("b", "<u2")])
    rec["f"], rec["h"], rec["b"] = bits, f16, bf16
    out = b"KVCONV01" + struct.pack("<QI", h, bits.size) + rec.tobytes()
    dst = OUT / "conversions.bin"
    dst.write_bytes(out)
    print(f"{dst.relative_to(ROOT)}: {bits.size} cases, table fnv1a64={h:016x} ({len(out)} bytes)")


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if "--conversions-only" not in sys.argv:  # the tensor checksums take a few minutes
        for model_rel, name in CHOICES:
            tensor_file(model_rel, name)
    conversions_file()
    total = sum(p.stat().st_size for p in OUT.iterdir())
    print(f"total {total} bytes")
    assert total < 1_000_000, "golden data must stay under 1 MB"


if __name__ == "__main__":
    main()
