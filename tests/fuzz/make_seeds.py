#!/usr/bin/env python3
"""Writes the seed corpus for fuzz_gguf: a few tiny valid GGUF files (a few KB each) made
with the reference `gguf` package's GGUFWriter, covering every value type, nested arrays,
v2/v3-shaped headers, a custom alignment and the tensor types kvserve computes with.

Run from the repository root: python3 tests/fuzz/make_seeds.py
"""
import os
import sys

import numpy as np
from gguf import GGUFWriter, GGMLQuantizationType

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus_gguf")


def write(name, arch, fill, alignment=None):
    path = os.path.join(OUT, name)
    w = GGUFWriter(path, arch)
    if alignment is not None:
        w.add_custom_alignment(alignment)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"{path}: {os.path.getsize(path)} bytes")


def every_type(w):
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -30000)
    w.add_uint32("t.u32", 4000000000)
    w.add_int32("t.i32", -2000000000)
    w.add_float32("t.f32", 1.5)
    w.add_bool("t.bool", True)
    w.add_string("t.string", "h\u00e9llo")
    w.add_uint64("t.u64", 18000000000000000000)
    w.add_int64("t.i64", -(2**63))
    w.add_float64("t.f64", 3.141592653589793)
    w.add_array("t.arr_i32", [1, -2, 3])
    w.add_array("t.arr_str", ["a", "bc", ""])
    w.add_array("t.arr_nested", [[1, 2], [3]])
    w.add_array("t.arr_f32", [0.5, -1.25])
    w.add_tensor("a.weight", np.arange(8, dtype=np.float32).reshape(2, 4))


def tiny_llama(w):
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(32)
    w.add_feed_forward_length(64)
    w.add_head_count(4)
    w.add_head_count_kv(2)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["a", "b", "ab", "<s>"])
    w.add_token_types([1, 1, 1, 3])
    w.add_token_merges(["a b"])
    w.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")
    rng = np.random.default_rng(0)
    w.add_tensor("token_embd.weight", rng.standard_normal((4, 32), dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    w.add_tensor("blk.0.attn_q.weight", rng.standard_normal((32, 32)).astype(np.float16))
    # Pre-quantized bytes: GGUFWriter takes raw blocks when given a byte shape and a type.
    q8 = rng.integers(0, 255, size=(2, 34), dtype=np.uint8)  # 2 rows of one Q8_0 block
    w.add_tensor("blk.0.attn_k.weight", q8, raw_dtype=GGMLQuantizationType.Q8_0)
    q4 = rng.integers(0, 255, size=(2, 20), dtype=np.uint8)  # Q4_1
    w.add_tensor("blk.0.attn_v.weight", q4, raw_dtype=GGMLQuantizationType.Q4_1)


def gemma_like(w):
    w.add_block_count(2)
    w.add_embedding_length(16)
    w.add_head_count(2)
    w.add_head_count_kv(1)
    w.add_key_length(8)
    w.add_sliding_window(4)
    w.add_tokenizer_model("llama")
    w.add_token_list(["x", "y"])
    w.add_token_scores([0.0, -1.0])
    rng = np.random.default_rng(1)
    qk = rng.integers(0, 255, size=(1, 144), dtype=np.uint8)  # one Q4_K super-block
    w.add_tensor("blk.0.ffn_up.weight", qk, raw_dtype=GGMLQuantizationType.Q4_K)
    q6 = rng.integers(0, 255, size=(1, 210), dtype=np.uint8)  # one Q6_K super-block
    w.add_tensor("blk.0.ffn_down.weight", q6, raw_dtype=GGMLQuantizationType.Q6_K)


def metadata_only(w):
    w.add_name("no tensors")
    w.add_array("t.empty", [])


def main():
    os.makedirs(OUT, exist_ok=True)
    write("every_type.gguf", "test", every_type)
    write("tiny_llama.gguf", "llama", tiny_llama)
    write("gemma_like.gguf", "gemma3", gemma_like, alignment=64)
    write("metadata_only.gguf", "test", metadata_only)
    # GGUFWriter always writes v3; v2 has the same little-endian layout, so patch the field.
    with open(os.path.join(OUT, "every_type.gguf"), "rb") as f:
        data = bytearray(f.read())
    data[4:8] = (2).to_bytes(4, "little")
    with open(os.path.join(OUT, "every_type_v2.gguf"), "wb") as f:
        f.write(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
