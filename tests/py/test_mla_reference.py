"""Sanity checks of the MLA (deepseek2) oracle, tests/reference/mla_ref.py, and of the test
model generator, tests/reference/make_mla_model.py. Cheap (a few seconds): the model is
generated into a temporary directory.

Run: python -m pytest tests/py/test_mla_reference.py -q
"""

import json
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests" / "reference"))

gguf = pytest.importorskip("gguf")
import make_mla_model  # noqa: E402
import mla_ref  # noqa: E402

GOLDEN = REPO / "tests" / "data" / "golden" / "mla"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    d = tmp_path_factory.mktemp("mla")
    out = {}
    for layout in ("split", "legacy"):
        for q in (0, 96):
            p = d / f"mla_{layout}_{q}.gguf"
            info = make_mla_model.write_model(p, q, layout)
            out[(layout, q)] = (p, info, mla_ref.load_model(p))
    return out


@pytest.fixture(scope="module")
def ids():
    return make_mla_model.random_ids("pytest", 70, make_mla_model.N_VOCAB - 1, 0)


def test_config_and_layout(models):
    _, info, m = models[("split", 0)]
    c = m.cfg
    assert (c.arch, c.layout, c.n_layer, c.n_embd, c.n_head, c.n_ff) == ("deepseek2", "split", 4, 256, 8, 512)
    assert (c.kv_lora_rank, c.qk_nope, c.qk_rope, c.v_head, c.q_lora_rank) == (64, 32, 16, 32, 0)
    assert c.n_layer_dense_lead == c.n_layer and c.rope_style == "norm"
    assert c.kq_scale == pytest.approx(1 / np.sqrt(32 + 16))        # not 1/sqrt(C + dr)
    r = gguf.GGUFReader(str(models[("split", 0)][0]))
    shapes = {t.name: [int(x) for x in t.shape] for t in r.tensors}   # GGUF dims, ne0 first
    assert shapes["blk.0.attn_k_b.weight"] == [32, 64, 8]             # {dn, C, H}
    assert shapes["blk.0.attn_v_b.weight"] == [64, 32, 8]             # {C, dv, H}
    assert shapes["blk.0.attn_kv_a_mqa.weight"] == [256, 64 + 16]
    assert shapes["blk.0.attn_q.weight"] == [256, 8 * 48]
    assert "blk.0.attn_kv_b.weight" not in shapes
    assert models[("split", 96)][2].cfg.q_lora_rank == 96
    assert models[("legacy", 0)][2].cfg.layout == "legacy"


def test_generation_is_deterministic(tmp_path, models):
    p = tmp_path / "again.gguf"
    info = make_mla_model.write_model(p, 0, "split")
    assert info["weights_sha256"] == models[("split", 0)][1]["weights_sha256"]
    assert make_mla_model.weights_digest_of_file(p) == info["weights_sha256"]
    assert p.read_bytes() == models[("split", 0)][0].read_bytes()


@pytest.mark.skipif(not (GOLDEN / "golden.json").exists(), reason="no MLA golden")
def test_weights_match_committed_golden(models):
    """The generator still writes the weights the golden was computed from (on any machine)."""
    for sub, q in ((".", 0), ("q_lora", 96)):
        g = json.loads((GOLDEN / sub / "golden.json").read_text())
        assert g["model"]["weights_sha256"] == models[("split", q)][1]["weights_sha256"]


@pytest.mark.parametrize("key", [("split", 0), ("split", 96), ("legacy", 0)])
def test_absorbed_equals_naive(models, ids, key):
    m = models[key][2]
    naive = mla_ref.forward(m, ids, np.float64)
    absorbed = mla_ref.forward(m, ids, np.float64, absorbed=True)
    assert naive.std() > 1.0                                          # not a degenerate model
    np.testing.assert_allclose(absorbed, naive, rtol=0, atol=1e-10)
    # and step by step through the latent cache
    cache = mla_ref.new_cache(m)
    h = [mla_ref.forward_hidden(m, ids[:50], cache, absorbed=True)]
    for t in ids[50:]:
        h.append(mla_ref.forward_hidden(m, [t], cache, absorbed=True))
    np.testing.assert_allclose(mla_ref.logits_from_hidden(m, np.concatenate(h)), naive,
                               rtol=0, atol=1e-10)


def test_chunked_equals_full(models, ids):
    m = models[("split", 96)][2]
    full = mla_ref.forward_hidden(m, ids)
    cache = mla_ref.new_cache(m)
    parts = [mla_ref.forward_hidden(m, ids[:1], cache), mla_ref.forward_hidden(m, ids[1:33], cache),
             mla_ref.forward_hidden(m, ids[33:64], cache)]
    parts += [mla_ref.forward_hidden(m, [t], cache) for t in ids[64:]]
    np.testing.assert_allclose(np.concatenate(parts), full, rtol=0, atol=1e-11)
    # the cache holds the latent row [c (64) | k_pe (16)] per layer and position
    assert cache.c[0][:len(ids)].shape == (70, 64) and cache.kpe[0][:len(ids)].shape == (70, 16)
    np.testing.assert_allclose(np.sqrt(np.mean(cache.c[0][:70] ** 2 / m.layers[0].kv_a_norm ** 2, -1)),
                               1.0, rtol=1e-5)                      # normed latent (eps 1e-6)


def test_split_and_legacy_layouts_agree(models, ids):
    for q in (0, 96):
        a = mla_ref.forward(models[("split", q)][2], ids, np.float64)
        b = mla_ref.forward(models[("legacy", q)][2], ids, np.float64)
        np.testing.assert_array_equal(a, b)


def test_rope_part_is_position_dependent_and_latent_is_not(models, ids):
    """Same token at two positions: the latent c is identical, k_pe differs (RoPE), and
    k_pe at position 0 is the un-rotated projection."""
    m = models[("split", 0)][2]
    cache = mla_ref.new_cache(m)
    mla_ref.forward_hidden(m, [ids[0], ids[0]], cache)
    # layer 0 sees only the embedding, so both positions have the same pre-RoPE inputs
    np.testing.assert_allclose(cache.c[0][0], cache.c[0][1], rtol=0, atol=1e-12)
    assert np.abs(cache.kpe[0][0] - cache.kpe[0][1]).max() > 1e-3
    L = m.layers[0]
    from llama_ref import rms_norm
    h = rms_norm(m.tok_embd[[ids[0]]], L.attn_norm, m.cfg.rms_eps)
    np.testing.assert_allclose(cache.kpe[0][0], (h @ L.wkv_a.T)[0, 64:], rtol=0, atol=1e-12)


@pytest.mark.skipif(not (GOLDEN / "golden.json").exists(), reason="no MLA golden")
def test_golden_reproduces(models):
    """Recompute one golden prompt: the committed numbers still come from this oracle."""
    from golden_lib import run_prompt
    g = json.loads((GOLDEN / "golden.json").read_text())
    p = next(p for p in g["prompts"] if p["name"] == "random_33")
    assert p["tokens"] == make_mla_model.random_ids("random_33", 33, make_mla_model.N_VOCAB - 1, 0)
    m = models[("split", 0)][2]
    entry, rows = run_prompt(mla_ref, m, p["tokens"], {32})
    assert entry["top5_ids"] == p["top5_ids"] and entry["greedy"] == p["greedy"]
    np.testing.assert_allclose(entry["top5_logprobs"], p["top5_logprobs"], atol=2e-5)
    dist = np.fromfile(GOLDEN / "golden_dist.f16", dtype="<f2").reshape(g["dist"]["shape"])
    row = [r for r in g["dist"]["rows"] if r["name"] == "random_33" and r["position"] == 32]
    assert len(row) == 1
    np.testing.assert_allclose(dist[g["dist"]["rows"].index(row[0])], rows[32], rtol=2e-3, atol=2e-3)
