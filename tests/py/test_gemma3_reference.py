"""Sanity checks of the Gemma 3 oracle (tests/reference/gemma3_ref.py) and its tokenizer
(tests/reference/spm_tokenizer_ref.py). If these fail, tests/data/golden/gemma3 is not worth
comparing against.

Run: python -m pytest tests/py/test_gemma3_reference.py -q   (~2 minutes on 2 cores, ~3 GB RAM)
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "reference"))

gguf = pytest.importorskip("gguf")
import gemma3_ref  # noqa: E402

MODEL = REPO / "models" / "gemma-3-270m-Q4_K_M.gguf"
GOLDEN = REPO / "tests" / "data" / "golden" / "gemma3"
pytestmark = pytest.mark.skipif(not MODEL.exists(), reason=f"{MODEL} not present")


@pytest.fixture(scope="module")
def reader():
    return gguf.GGUFReader(str(MODEL))


@pytest.fixture(scope="module")
def model():
    return gemma3_ref.load_model(MODEL)


@pytest.fixture(scope="module")
def tok():
    pytest.importorskip("sentencepiece")
    pytest.importorskip("google.protobuf")
    import spm_tokenizer_ref
    return spm_tokenizer_ref.load_tokenizer(MODEL)


@pytest.fixture(scope="module")
def long_ids(tok):
    from make_golden import C_CODE, GETTYSBURG, LONG_PROSE
    ids = tok.encode(LONG_PROSE + "\n" + GETTYSBURG + "\n" + C_CODE)[:530]
    assert len(ids) == 530
    return ids


def test_config(model):
    c = model.cfg
    assert (c.arch, c.n_layer, c.n_embd, c.n_head, c.n_head_kv, c.head_dim, c.n_ff) == \
        ("gemma3", 18, 640, 4, 1, 256, 2048)
    assert c.global_layers == [5, 11, 17]
    assert (c.n_swa, c.rope_base, c.rope_base_swa, c.n_rot, c.rope_style) == \
        (512, 1e6, 1e4, 256, "neox")
    assert c.attn_scale == 1 / 16 and c.final_logit_softcap == 0.0
    assert c.embd_scale == pytest.approx(np.sqrt(640)) and c.vocab == 262144
    assert abs(c.rms_eps - 1e-6) < 1e-12
    assert model.output is model.tok_embd


def _is_bf16(a):
    return (np.asarray(a, np.float32).view(np.uint32) & 0xFFFF) == 0


def test_norm_weights_already_include_plus_one(reader):
    """Gemma3RMSNorm computes x * (1 + w) on bf16 weights w; llama.cpp's converter stores
    1 + w. Every stored value minus 1 is a bf16 number, the stored values mostly are not."""
    norms = [t for t in reader.tensors if t.name.endswith("norm.weight")]
    assert len(norms) == 18 * 6 + 1
    n_bf16 = n_all = 0
    for t in norms:
        a = np.asarray(t.data, np.float32)
        assert _is_bf16(a - np.float32(1)).all(), t.name
        n_bf16 += int(_is_bf16(a).sum())
        n_all += a.size
    assert n_bf16 / n_all < 0.97


def test_attention_mask_window_rule():
    m = gemma3_ref.attention_mask(np.array([0, 511, 512, 600]), np.arange(601), 512)
    visible = [np.flatnonzero(~r) for r in m]
    assert list(visible[0]) == [0]
    assert (visible[1][0], visible[1][-1], len(visible[1])) == (0, 511, 512)
    assert (visible[2][0], visible[2][-1], len(visible[2])) == (1, 512, 512)   # key 0 gone
    assert (visible[3][0], visible[3][-1], len(visible[3])) == (89, 600, 512)
    full = gemma3_ref.attention_mask(np.array([600]), np.arange(601), 0)
    assert (~full).sum() == 601


def test_chunked_and_cached_equal_full(model, long_ids):
    """Prefill in chunks and decode one token at a time through the KV cache, across the
    window boundary: same hidden states as one full pass (causality + cache + window)."""
    full = gemma3_ref.forward_hidden(model, long_ids)
    cache = gemma3_ref.new_cache(model)
    parts = [gemma3_ref.forward_hidden(model, long_ids[:300], cache),
             gemma3_ref.forward_hidden(model, long_ids[300:515], cache)]
    parts += [gemma3_ref.forward_hidden(model, [t], cache) for t in long_ids[515:]]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-9)

    # the sliding window: nothing changes before position 512, something does after
    nowin = gemma3_ref.forward_hidden(model, long_ids, None, window_override=0)
    np.testing.assert_array_equal(nowin[:512], full[:512])
    d = np.abs(nowin[512:] - full[512:]).max(axis=1)
    assert (d > 1e-4).all(), d
    lw = gemma3_ref.logits_from_hidden(model, full[-1:])
    ln = gemma3_ref.logits_from_hidden(model, nowin[-1:])
    lpw, lpn = gemma3_ref.log_softmax(lw)[0], gemma3_ref.log_softmax(ln)[0]
    kl = float(np.sum(np.exp(lpw) * (lpw - lpn)))
    print(f"KL(window || no window) at position 529: {kl:.2e}")
    assert kl > 1e-4


def test_greedy_is_sensible(model, tok):
    ids = tok.encode("The capital of France is Paris. The capital of Italy is")
    assert ids[0] == 2                                                 # BOS
    assert "Rome" in tok.decode(gemma3_ref.greedy(model, ids, 3))


def test_tokenizer_matches_llama_cpp_ids(tok):
    """Ids printed by llama.cpp's llama_tokenize(add_special, parse_special) for these texts."""
    assert tok.encode("<start_of_turn>user\nHello there, how are you?<end_of_turn>\n"
                      "<start_of_turn>model\n") == \
        [2, 105, 2364, 107, 9259, 993, 236764, 1217, 659, 611, 236881, 106, 107, 105, 4368, 107]
    assert tok.encode("The capital of France is") == [2, 818, 5279, 529, 7001, 563]
    ids = tok.encode("Hi   there\n\n  x 😀 ﬁ 12345 \t\tend")
    assert ids == [2, 10979, 139, 13534, 108, 138, 236781, 163543, 97940, 236743, 236770,
                   236778, 236800, 236812, 236810, 236743, 255969, 643]
    assert tok.decode(ids[1:]) == "Hi   there\n\n  x 😀 ﬁ 12345 \t\tend"


@pytest.mark.skipif(not (GOLDEN / "golden.json").exists(), reason="no Gemma 3 golden")
def test_golden_reproduces(model, tok):
    """Recompute the shortest golden prompt: tokens, top-5, and its stored dist row."""
    from golden_lib import run_prompt
    g = json.loads((GOLDEN / "golden.json").read_text())
    assert g["model"]["file"] == MODEL.name
    p = g["prompts"][0]
    assert p["name"] == "prose_short" and tok.encode(p["text"]) == p["tokens"]
    last = p["n_tokens"] - 1
    entry, rows = run_prompt(gemma3_ref, model, p["tokens"], {last}, n_greedy=2)
    assert entry["top5_ids"] == p["top5_ids"] and entry["greedy"] == p["greedy"][:2]
    np.testing.assert_allclose(entry["top5_logprobs"], p["top5_logprobs"], atol=2e-5)
    dist = np.fromfile(GOLDEN / "golden_dist.f16", dtype="<f2").reshape(g["dist"]["shape"])
    r = p["dist_rows"][0]
    assert g["dist"]["rows"][r]["position"] == last
    np.testing.assert_allclose(dist[r], rows[last], rtol=2e-3, atol=2e-3)
