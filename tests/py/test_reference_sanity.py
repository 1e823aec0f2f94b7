"""Sanity checks of the numpy oracle itself (tests/reference/llama_ref.py).

If these fail, the golden files in tests/data/golden are not worth comparing against.
Run: python -m pytest tests/py/test_reference_sanity.py -q   (~1 minute on 2 cores)
"""

import struct
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "reference"))

gguf = pytest.importorskip("gguf")
import llama_ref  # noqa: E402

MODEL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"{MODEL} not present")

ENGLISH = (
    "The history of the bicycle begins in the early nineteenth century, when inventors in "
    "Europe built wooden machines that riders pushed along with their feet. These early "
    "designs were heavy and uncomfortable, but they showed that a person could balance on two "
    "wheels. Over the next decades, engineers added pedals, chains, and rubber tires. By the "
    "end of the century, the bicycle had become cheap enough for ordinary workers to buy, and "
    "it changed the way people lived. Young people could visit friends in nearby towns, women "
    "gained a new kind of freedom, and doctors praised cycling as healthy exercise. Today, "
    "millions of people around the world ride bicycles to work, to school, and for fun."
)


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(str(MODEL))


@pytest.fixture(scope="module")
def model():
    return llama_ref.load_model(MODEL)


@pytest.fixture(scope="module")
def english_tokens():
    tokenizer_ref = pytest.importorskip("tokenizer_ref")
    tok = tokenizer_ref.load_tokenizer(MODEL)
    ids = tokenizer_ref.encode(tok, ENGLISH)
    assert 100 < len(ids) < 200
    return ids


def _tensor(reader, name):
    return next(t for t in reader.tensors if t.name == name)


def _f16(b):
    return struct.unpack("<e", bytes(b))[0]


def test_q4_1_block_by_hand(reader, model):
    t = _tensor(reader, "blk.0.attn_q.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q4_1
    raw = np.asarray(t.data).reshape(-1)          # uint8, rows of 18 blocks x 20 bytes
    n_in = int(t.shape[0])
    row_bytes = n_in // 32 * 20
    for row, blk in [(0, 0), (0, 1), (137, 5), (575, 17)]:
        b = raw[row * row_bytes + blk * 20: row * row_bytes + (blk + 1) * 20]
        d, m, qs = _f16(b[0:2]), _f16(b[2:4]), b[4:20]
        expect = np.empty(32)
        for j in range(16):
            expect[j] = d * (int(qs[j]) & 0xF) + m
            expect[j + 16] = d * (int(qs[j]) >> 4) + m
        got_pkg = gguf.quants.dequantize(b.reshape(1, 20), t.tensor_type).reshape(32)
        got_model = model.layers[0].wq[row, blk * 32:(blk + 1) * 32]
        np.testing.assert_allclose(got_pkg, expect, rtol=0, atol=1e-6 * max(1, abs(m)))
        np.testing.assert_allclose(got_model, expect, rtol=0, atol=1e-6 * max(1, abs(m)))
        assert len(set(int(q) & 0xF for q in qs) | set(int(q) >> 4 for q in qs)) > 1


def test_q8_0_block_by_hand(reader, model):
    t = _tensor(reader, "token_embd.weight")
    assert t.tensor_type == gguf.GGMLQuantizationType.Q8_0
    raw = np.asarray(t.data).reshape(-1)
    row_bytes = int(t.shape[0]) // 32 * 34
    for row, blk in [(0, 0), (1000, 3), (49151, 17)]:
        b = raw[row * row_bytes + blk * 34: row * row_bytes + (blk + 1) * 34]
        d = _f16(b[0:2])
        expect = d * b[2:34].view(np.int8).astype(np.float64)
        np.testing.assert_allclose(model.tok_embd[row, blk * 32:(blk + 1) * 32], expect,
                                   rtol=0, atol=1e-9)


def test_config(model):
    c = model.cfg
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff) == \
        ("llama", 30, 576, 9, 3, 64, 1536)
    assert (c.vocab, c.n_rot, c.rope_base, c.rope_style) == (49152, 64, 100000.0, "norm")
    assert abs(c.rms_eps - 1e-5) < 1e-9
    assert model.output is model.tok_embd            # tied: no output.weight in the file


def test_perplexity_norm_vs_neox(model, english_tokens):
    ppl_norm = llama_ref.perplexity(model, english_tokens, rope_style="norm")
    ppl_neox = llama_ref.perplexity(model, english_tokens, rope_style="neox")
    print(f"perplexity over {len(english_tokens)} tokens: norm {ppl_norm:.2f}, neox {ppl_neox:.2f}")
    assert ppl_norm < 30
    assert ppl_neox > 3 * ppl_norm


def test_causal_and_kv_cache_consistent(model, english_tokens):
    ids = english_tokens[:24]
    full = llama_ref.forward(model, ids, dtype=np.float64)
    prefix = llama_ref.forward(model, ids[:10], dtype=np.float64)
    np.testing.assert_allclose(full[:10], prefix, rtol=0, atol=1e-9)    # causal mask
    cont, rows = llama_ref.greedy(model, ids[:10], 4, return_logits=True)
    again = llama_ref.forward(model, ids[:10] + cont[:3], dtype=np.float64)
    np.testing.assert_allclose(rows, again[9:], rtol=0, atol=1e-9)     # cache == recompute
    assert cont == [int(i) for i in again[9:].argmax(-1)]


def test_greedy_is_sensible(model):
    tokenizer_ref = pytest.importorskip("tokenizer_ref")
    tok = tokenizer_ref.load_tokenizer(MODEL)
    ids = tokenizer_ref.encode(tok, "The capital of France is Paris. The capital of Italy is")
    text = tok.decode(llama_ref.greedy(model, ids, 3))
    assert "Rome" in text, text


def test_tokenizer_splits_digits():
    tokenizer_ref = pytest.importorskip("tokenizer_ref")
    tok = tokenizer_ref.load_tokenizer(MODEL)
    ids = tokenizer_ref.encode(tok, "<|im_start|>user\nIn 2024 I paid 1234 dollars.<|im_end|>")
    pieces = [tok.id_to_token(i) for i in ids]
    assert pieces[0] == "<|im_start|>" and pieces[-1] == "<|im_end|>"
    assert ["2", "0", "2", "4"] == pieces[pieces.index("2"):pieces.index("2") + 4]
    assert tok.decode(ids, skip_special_tokens=False) == \
        "<|im_start|>user\nIn 2024 I paid 1234 dollars.<|im_end|>"
