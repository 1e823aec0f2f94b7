"""Shared by make_golden_gemma3.py and make_golden_mla.py: one prompt's golden entry, in the
format of tests/reference/make_golden.py (SmolLM2), computed from any oracle module that has
new_cache(model), forward_hidden(model, tokens, cache) and logits_from_hidden(model, h)
(gemma3_ref, mla_ref). Teacher-forced logits are computed in row chunks so a 700-token
prompt over a 262144-token vocabulary never holds [T, vocab] float64 at once."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from llama_ref import log_softmax
from make_golden import N_GREEDY, TOP_K, dist_positions, r5, sha256_file  # noqa: F401


def run_prompt(ref, model, tokens, dist_pos, n_greedy=N_GREEDY, chunk=64):
    """Returns (entry fields, {position: log-softmax row float64}) for one prompt."""
    T = len(tokens)
    cache = ref.new_cache(model)
    h = ref.forward_hidden(model, tokens, cache)
    top_ids, top_lp, nll, rows = [], [], [], {}
    for s in range(0, T, chunk):
        lp = log_softmax(ref.logits_from_hidden(model, h[s:s + chunk]))
        top = np.argsort(-lp, axis=1, kind="stable")[:, :TOP_K]
        top_ids.append(top)
        top_lp.append(np.take_along_axis(lp, top, axis=1))
        for r in range(lp.shape[0]):
            p = s + r
            if p + 1 < T:
                nll.append(-lp[r, tokens[p + 1]])
            if p in dist_pos:
                rows[p] = lp[r].copy()
    top_ids, top_lp = np.concatenate(top_ids), np.concatenate(top_lp)

    cont, margins, glps = [], [], []
    hl = h[-1:]
    for i in range(n_greedy):
        logits = ref.logits_from_hidden(model, hl)[0]
        nxt = int(np.argmax(logits))
        srt = np.partition(logits, -2)[-2:]
        margins.append(float(srt[1] - srt[0]))
        glps.append(float(log_softmax(logits)[nxt]))
        cont.append(nxt)
        if i + 1 < n_greedy:
            hl = ref.forward_hidden(model, [nxt], cache)
    nll = np.asarray(nll)
    entry = {
        "n_tokens": T,
        "tokens": [int(t) for t in tokens],
        "top1": [int(t) for t in top_ids[:, 0]],
        "top5_ids": [[int(t) for t in r] for r in top_ids],
        "top5_logprobs": [r5(r) for r in top_lp],
        "mean_nll": float(nll.mean()) if T > 1 else None,
        "perplexity": float(np.exp(nll.mean())) if T > 1 else None,
        "greedy": cont,
        "greedy_logprobs": r5(glps),
        "greedy_top2_margin": r5(margins),
    }
    return entry, rows


def write_golden(out: Path, index: dict, dist_rows: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    dist = np.stack(dist_rows).astype("<f2")
    dist.tofile(out / index["dist"]["file"])
    index["dist"]["shape"] = [int(dist.shape[0]), int(dist.shape[1])]
    with open(out / "golden.json", "w") as f:
        json.dump(index, f, separators=(",", ":"), ensure_ascii=False)
        f.write("\n")
