"""StreamingLLM re-indexing on `kvserve perplexity --max-model-len L` against a float64 oracle.

A sequence with an evicting KV policy may run past the positions its model may use: when its next
position would be L, the holes eviction left are closed, kept pages move down to consecutive
page indices, and their keys, cached after RoPE, are re-rotated by the distance they moved
(kv/kv_reindex.h). The oracle here gets the same result another way, StreamingLLM's own: it caches
keys *before* RoPE and rotates every cached key by its current position in every forward, so a
re-index is only a renumbering of positions. Spec (written from the design, not the C++):

  * Eviction as in test_eviction_reference.py (pages of 16 positions, checks after the prompt pass
    and whenever a decoded token fills a page, sink / recent pages, scores).
  * Before a token would get position L, the cache is compacted: the tokens of live pages keep
    their order and get positions 0, 1, 2, ...; every page is live again; per-page scores follow
    their pages. Decoding goes on from the new length; the next check is when a page fills.
  * A decode chunk never crosses a page boundary or position L.

The oracle runs in subprocesses (one BLAS thread each); its output is committed as a golden
(tests/data/golden/reindex_oracle.json) under a fingerprint of everything it reads, as the eviction
oracle's. Regenerate with

  python3 tests/py/test_reindex_reference.py write-golden
"""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_eviction_reference as E  # noqa: E402  (eviction spec helpers, the text, the kvserve runner)
from test_cli_perplexity import read_logits_file  # noqa: E402

ROOT = E.ROOT
BLOCK = E.BLOCK
# kvserve (f16 KV) against float64: the eviction oracle's bounds. Measured here (see the note in
# the docs): PPL within 1.3e-4 relative, per-token NLL within 0.012.
PPL_REL_TOL = E.PPL_REL_TOL
NLL_ABS_TOL = E.NLL_ABS_TOL

# name -> (policy, budget, max_model_len, extra flags). The windows are 256 tokens, prompt 128.
CASES = {
    # 4 sink tokens + recent: the page after the sink page is evicted first, then each page that
    # leaves the recent area; re-indexed twice per window.
    "sinks_L144": ("sinks", 64, 144, []),
    # a limit that is not a page boundary: the chunk before it stops mid-page
    "sinks_L130": ("sinks", 64, 130, []),
    # scored policies: scores follow their pages through the move
    "h2o_L150": ("h2o", 96, 150, []),
    "snapkv_w8_L140": ("snapkv", 96, 140, ["--kv-obs-window", "8"]),
}


def forward_prerope(model, tokens, cache, p0, live, hook=None):
    """tokens at positions p0.. through every layer; cache.k[il] holds keys *before* RoPE at
    positions 0..p0-1 (appended to here), rotated by their positions in every call."""
    import llama_ref as R

    cfg = model.cfg
    tokens = np.asarray(tokens, dtype=np.int64)
    T = len(tokens)
    S = p0 + T
    pos = p0 + np.arange(T)
    H, Hkv, D = cfg.n_head, cfg.n_head_kv, cfg.head_dim
    mask = np.repeat(live, BLOCK)[:S]
    x = model.tok_embd[tokens]
    for il, L in enumerate(model.layers):
        h = R.rms_norm(x, L.attn_norm, cfg.rms_eps)
        q = R.rope((h @ L.wq.T).reshape(T, H, D), pos, cfg.n_rot, cfg.rope_base, cfg.rope_style)
        k = (h @ L.wk.T).reshape(T, Hkv, D)
        v = (h @ L.wv.T).reshape(T, Hkv, D)
        cache.k[il] = k if p0 == 0 else np.concatenate([cache.k[il][:p0], k])
        cache.v[il] = v if p0 == 0 else np.concatenate([cache.v[il][:p0], v])
        keys = R.rope(cache.k[il], np.arange(S), cfg.n_rot, cfg.rope_base, cfg.rope_style)
        a, probs = R.attention(q, keys, cache.v[il], p0, mask, return_probs=True)
        if hook is not None:
            hook(il, probs)
        x = x + a.reshape(T, H * D) @ L.wo.T
        h = R.rms_norm(x, L.ffn_norm, cfg.rms_eps)
        x = x + (R.silu(h @ L.w_gate.T) * (h @ L.w_up.T)) @ L.w_down.T
    return R.rms_norm(x, model.output_norm, cfg.rms_eps)


class PreRopeCache:
    def __init__(self, n_layer):
        self.k = [None] * n_layer
        self.v = [None] * n_layer


def simulate_reindex(model, win, policy, budget, max_pos, sink_tokens=4, recent_tokens=None, obs_window=32,
                     reindex=True):
    """One perplexity window. Returns (nll of positions [first, len-1), number of re-indexes,
    positions dropped by them). reindex=False: original positions, no limit (the eviction oracle's
    semantics, computed this way: the effect the test demands)."""
    import llama_ref as R

    first = len(win) // 2
    n_win = len(win) - 1
    sink_pages, recent_pages = E.policy_pages(policy, budget, sink_tokens, recent_tokens)
    scored = policy in ("h2o", "snapkv")
    live = np.ones(len(win) // BLOCK + 2, dtype=bool)
    score = np.zeros(len(live))
    cache = PreRopeCache(model.cfg.n_layer)
    n = 0  # positions in the cache

    def hook_for(q_pos0, T, min_pos):
        rows = np.arange(T)[q_pos0 + np.arange(T) >= min_pos]

        def hook(il, probs):  # probs [H, T, S]
            per_key = probs[:, rows, :].sum(axis=(0, 1))
            score[:] += np.bincount(np.arange(len(per_key)) // BLOCK, weights=per_key, minlength=len(score))
        return hook if scored else None

    def check(n_tokens):
        n_full = n_tokens // BLOCK
        kept = BLOCK + BLOCK * int(live[:n_full].sum())
        if kept <= budget:
            return
        cand = [i for i in range(sink_pages, n_full - recent_pages) if live[i]]
        if scored:
            cand.sort(key=lambda i: score[i])
        n_ev = 0
        for i in cand:
            if kept <= budget:
                break
            live[i] = False
            kept -= BLOCK
            n_ev += 1
        if policy == "snapkv" and n_ev:
            score[:] = 0

    def compact():
        nonlocal n, live, score
        pages = [j for j in range((n + BLOCK - 1) // BLOCK) if live[j]]
        idx = np.concatenate([np.arange(j * BLOCK, min((j + 1) * BLOCK, n)) for j in pages])
        for il in range(model.cfg.n_layer):
            cache.k[il] = cache.k[il][idx]
            cache.v[il] = cache.v[il][idx]
        new_score = np.zeros(len(live))
        new_score[:len(pages)] = score[pages]
        score = new_score
        live = np.ones(len(live), dtype=bool)
        dropped = n - len(idx)
        n = len(idx)
        return dropped

    min_pos = first - obs_window if policy == "snapkv" else 0
    forward_prerope(model, win[:first], cache, 0, live, hook_for(0, first, min_pos))
    n = first
    check(n)
    nll, n_reindex, n_dropped = [], 0, 0
    t = first  # next input token of the window
    while t < n_win:
        if reindex and n >= max_pos:
            n_dropped += compact()
            n_reindex += 1
        ln = min(BLOCK - n % BLOCK, n_win - t)
        if reindex:
            ln = min(ln, max_pos - n)
        h = forward_prerope(model, win[t:t + ln], cache, n, live, hook_for(n, ln, 0))
        lp = R.log_softmax(h @ model.output.T)
        targets = np.asarray(win[t + 1:t + ln + 1])
        nll.append(-lp[np.arange(ln), targets])
        n += ln
        t += ln
        if n % BLOCK == 0:
            check(n)
    return np.concatenate(nll), n_reindex, n_dropped


def case_kwargs(name):
    policy, budget, max_pos, extra = CASES[name]
    return dict(policy=policy, budget=budget, max_pos=max_pos,
                sink_tokens=E.flag_value(extra, "--kv-sink-tokens", 4),
                recent_tokens=E.flag_value(extra, "--kv-recent-tokens", None),
                obs_window=E.flag_value(extra, "--kv-obs-window", 32))


def oracle(text_path, out_path, names):
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import llama_ref

    _, wins = E.window_tokens(text_path)
    model = llama_ref.load_model(E.MODEL)  # float64
    out = {}
    for name in names:
        res = {"nll": [], "nll_no_reindex": [], "n_reindex": [], "dropped": []}
        for win in wins:
            a, k, d = simulate_reindex(model, win, **case_kwargs(name))
            b, _, _ = simulate_reindex(model, win, **case_kwargs(name), reindex=False)
            res["nll"] += a.tolist()
            res["nll_no_reindex"] += b.tolist()
            res["n_reindex"].append(k)
            res["dropped"].append(d)
        out[name] = res
    with open(out_path, "w") as f:
        json.dump(out, f)


GOLDEN = os.path.join(ROOT, "tests", "data", "golden", "reindex_oracle.json")
SIM_GROUPS = [["sinks_L144", "h2o_L150"], ["sinks_L130", "snapkv_w8_L140"]]


def fingerprint(text):
    return E.hash_inputs(text, E.MODEL, (CASES, E.CTX, E.N_WIN, BLOCK, SIM_GROUPS), ("numpy", "gguf", "tokenizers"),
                         (forward_prerope, simulate_reindex, case_kwargs, oracle, E.policy_pages, E.flag_value,
                          E.window_tokens),
                         ("llama_ref.py", "tokenizer_ref.py"))


def run_oracle(text_path, workdir):
    return E.run_oracle_groups(__file__, text_path, workdir, SIM_GROUPS, "reindex")


def write_golden():
    E.write_golden_file(GOLDEN, fingerprint, run_oracle, "tests/py/test_reindex_reference.py write-golden")


def load_sim(golden, fingerprint_of, run, small_text, refresh):
    """The re-index oracle's results (golden or fresh), NLL lists as arrays."""
    res = E.golden_or_oracle(golden, fingerprint_of, run, small_text, refresh)
    for r in res.values():
        for k in ("nll", "nll_no_reindex"):
            r[k] = np.asarray(r[k])
    return res


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    return E.make_small_text(tmp_path_factory, "reindex")


@pytest.fixture(scope="module")
def sim(small_text):
    assert sorted(sum(SIM_GROUPS, [])) == sorted(CASES)
    return load_sim(GOLDEN, fingerprint, run_oracle, small_text, "python3 tests/py/test_reindex_reference.py write-golden")


def ppl(nll):
    return float(np.exp(np.mean(nll)))


@pytest.mark.parametrize("name", list(CASES))
def test_reindex_matches_the_oracle(small_text, sim, name, tmp_path):
    policy, budget, max_pos, extra = CASES[name]
    j = E.kvserve_json(small_text, "--kv-eviction", policy, "--kv-budget", str(budget), *extra,
                       "--max-model-len", str(max_pos), "--save-logits", str(tmp_path / "l.bin"))
    _, recs = read_logits_file(tmp_path / "l.bin")
    check_reindex(name, j, recs, sim[name], max_pos)


def check_reindex(name, j, recs, s, max_pos):
    """kvserve's perplexity run (JSON j, saved records recs) against the oracle's result s."""
    ev = j["kv_eviction"]
    assert ev["max_model_len"] == max_pos
    # The same positions given back per window as the oracle's compactions ...
    assert min(s["n_reindex"]) >= 1, s["n_reindex"]
    assert ev["reindexed_tokens_per_window"] == pytest.approx(np.mean(s["dropped"])), (ev, s["dropped"])
    # ... re-indexing visibly changes the outcome (so the comparison below can fail) ...
    effect_ppl = abs(ppl(s["nll"]) / ppl(s["nll_no_reindex"]) - 1)
    effect_tok = float(np.abs(s["nll"] - s["nll_no_reindex"]).max())
    assert effect_ppl > 4 * PPL_REL_TOL or effect_tok > 5 * NLL_ABS_TOL, (name, effect_ppl, effect_tok)
    # ... and kvserve's run is the oracle's, as a whole and token by token.
    assert abs(j["ppl"] / ppl(s["nll"]) - 1) < PPL_REL_TOL, (name, j["ppl"], ppl(s["nll"]))
    d = np.abs(recs["nll"] - s["nll"])
    assert d.max() < NLL_ABS_TOL, (name, int(d.argmax()), float(d.max()))


def test_limit_at_or_past_the_window_changes_nothing(small_text):
    base = E.kvserve_json(small_text, "--kv-eviction", "sinks", "--kv-budget", "64")
    same = E.kvserve_json(small_text, "--kv-eviction", "sinks", "--kv-budget", "64", "--max-model-len", str(E.CTX))
    assert same["kv_eviction"]["reindexed_tokens_per_window"] == 0
    assert same["ppl"] == base["ppl"]


def test_limit_without_an_evicting_policy_is_a_clear_error(small_text):
    r = E.run(*E.ppl_args(small_text, "--max-model-len", "160"))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "max_model_len" in last and "--kv-eviction" in last, last
    # a budget above the limit: nothing is evicted before it, so nothing can close
    r = E.run(*E.ppl_args(small_text, "--kv-eviction", "sinks", "--kv-budget", "240", "--max-model-len", "160"))
    assert r.returncode != 0
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error:") and "budget" in last, last


if __name__ == "__main__" and len(sys.argv) == 5 and sys.argv[1] == "oracle":
    oracle(sys.argv[2], sys.argv[3], sys.argv[4].split(","))
elif __name__ == "__main__" and sys.argv[1:] == ["write-golden"]:
    write_golden()
