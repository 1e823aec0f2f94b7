"""lm-eval-harness's own API client (`local-completions`: lm_eval.models.openai_completions.
LocalCompletionsAPI) scoring continuations through the server, as `lm_eval --model
local-completions --model_args base_url=.../v1/completions` does for its loglikelihood tasks.

The oracle is the float64 numpy forward's golden file (tests/data/golden/golden.json, made by
tests/reference/make_golden.py): for a prompt, its greedy continuation and each greedy token's
logprob. lm-eval tokenizes with HuggingFace's tokenizer (built here from the GGUF by
tests/reference/tokenizer_ref.py and saved as a local tokenizer.json), sends token ids with
`echo: true, logprobs: 1, max_tokens: 1`, and sums the continuation's logprobs; is_greedy is
whether each was the top logprob. lm-eval is installed without its declared dependencies
(requirements-nodeps.txt: they pull PyTorch); the client itself needs none of them.
"""
from __future__ import annotations

import concurrent.futures
import json
import os
import sys

import pytest

from kvserve_server import MODEL, MODEL_NAME, ROOT

sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
import tokenizer_ref  # noqa: E402

lm_eval_api = pytest.importorskip("lm_eval.models.openai_completions", reason="lm-eval missing: make deps")
from lm_eval.api.instance import Instance  # noqa: E402

GOLDEN = json.load(open(os.path.join(ROOT, "tests", "data", "golden", "golden.json"), encoding="utf-8"))
N_CONT = 4  # greedy tokens scored
# kvserve's logprobs against the float64 oracle: within 0.01 a token on these prompts
# (tests/e2e/test_prompt_logprobs.py); a sum of four within 0.04.
SUM_TOL = 0.04


def off_loop(fn, *args, **kwargs):
    """lm-eval's concurrent client calls asyncio.run(), which refuses a thread whose event loop
    runs (the session's Playwright browser keeps one on the main thread): a thread of its own."""
    with concurrent.futures.ThreadPoolExecutor(1) as ex:
        return ex.submit(fn, *args, **kwargs).result()


@pytest.fixture(scope="module")
def lm(server, tmp_path_factory):
    d = tmp_path_factory.mktemp("tokenizer")
    tokenizer_ref.load_tokenizer(MODEL).save(str(d / "tokenizer.json"))
    # eos_token: the prefix of loglikelihood_rolling's first window (lm-eval's prefix_token_id)
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>"}))
    return lm_eval_api.LocalCompletionsAPI(base_url=server.url + "/v1/completions", model=MODEL_NAME, tokenizer_backend="huggingface",
                                           tokenizer=str(d), num_concurrent=2, max_retries=1, batch_size=4)


def cases():
    """(context, continuation, the oracle's summed logprob, whether each token is the oracle's top
    one) for text prompts: the greedy continuation after a whole prompt, and spans of the prompt
    itself after its own prefix (teacher-forced: every token in the oracle's top 5 there). Only
    where context and continuation tokenize apart, the context does not end in white space
    (lm-eval moves that to the continuation, _encode_pair, and other tokens would be scored) and no
    near tie at the top could turn on a rounding difference."""
    tok = tokenizer_ref.load_tokenizer(MODEL)
    out = []
    for p in GOLDEN["prompts"]:
        if p["kind"] != "text" or p["n_tokens"] > 400:
            continue
        t = p["tokens"]
        ctx, cont = tok.decode(t), tok.decode(p["greedy"][:N_CONT])
        if (min(p["greedy_top2_margin"][:N_CONT]) >= 0.05 and ctx == ctx.rstrip()
                and tok.encode(ctx + cont).ids == t + p["greedy"][:N_CONT]):
            out.append((ctx, cont, sum(p["greedy_logprobs"][:N_CONT]), True))
        for k in range(8, len(t) - N_CONT, max(8, len(t) // 6)):
            ctx, cont = tok.decode(t[:k]), tok.decode(t[k:k + N_CONT])
            if ctx != ctx.rstrip() or tok.encode(ctx).ids != t[:k] or tok.encode(ctx + cont).ids != t[:k + N_CONT]:
                continue
            ids = [p["top5_ids"][k - 1 + j] for j in range(N_CONT)]
            lps = [p["top5_logprobs"][k - 1 + j] for j in range(N_CONT)]
            if any(t[k + j] not in ids[j] for j in range(N_CONT)) or any(lp[0] - lp[1] < 0.05 for lp in lps):
                continue
            want = sum(lps[j][ids[j].index(t[k + j])] for j in range(N_CONT))
            out.append((ctx, cont, want, all(ids[j][0] == t[k + j] for j in range(N_CONT))))
    return out


def test_loglikelihood_matches_the_oracle(lm):
    cs = cases()
    assert len(cs) >= 6 and any(c[3] for c in cs) and not all(c[3] for c in cs), "the golden file changed: pick other cases"
    reqs = [Instance(request_type="loglikelihood", doc={}, arguments=(ctx, cont), idx=i) for i, (ctx, cont, _, _) in enumerate(cs)]
    # the same contexts with a continuation the model does not write: a word put first
    reqs += [Instance(request_type="loglikelihood", doc={}, arguments=(ctx, " zebra" + cont), idx=len(cs) + i)
             for i, (ctx, cont, _, _) in enumerate(cs)]
    got = off_loop(lm.loglikelihood, reqs, disable_tqdm=True)
    for (ctx, cont, want, want_greedy), (lp, greedy) in zip(cs, got[:len(cs)]):
        assert greedy == want_greedy, (ctx[-40:], cont)
        assert lp == pytest.approx(want, abs=SUM_TOL), (ctx[-40:], cont, lp, want)
    for (_, _, want, _), (lp, greedy) in zip(cs, got[len(cs):]):
        assert not greedy and lp < want - 5  # " zebra" costs nats


def test_loglikelihood_rolling_is_the_sum_of_every_tokens_logprob(lm, client):
    """Perplexity tasks (wikitext): lm-eval scores a whole text in windows, its first token after
    the end-of-text token; the sum equals the server's echoed logprobs of the same tokens (whose
    values test_prompt_logprobs.py holds to the oracle)."""
    tok = tokenizer_ref.load_tokenizer(MODEL)
    p = next(p for p in GOLDEN["prompts"] if p["name"] == "prose_gettysburg")
    text = tok.decode(p["tokens"])
    (rolling,) = off_loop(lm.loglikelihood_rolling, [Instance(request_type="loglikelihood_rolling", doc={}, arguments=(text,), idx=0)],
                                          disable_tqdm=True)
    eot = lm.eot_token_id
    assert eot == 0  # SmolLM2's <|endoftext|>
    r = client.completions.create(model=MODEL_NAME, prompt=[eot] + p["tokens"], max_tokens=0, echo=True, logprobs=0)
    assert rolling == pytest.approx(sum(r.choices[0].logprobs.token_logprobs[1:]), abs=1e-3)
