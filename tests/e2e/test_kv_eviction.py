"""Long-context KV policies through the real server and the official `openai` client: the
per-request `kv_eviction` field, usage.kv_eviction, the server default (--kv-eviction), the
metrics, bad input as OpenAI-style 400s, and every page back after each test."""
from __future__ import annotations

import openai
import pytest
import requests

from kvserve_server import MODEL_NAME, Server

# ~300 tokens: several pages beyond a 96-token budget
LONG = " ".join(f"Item {i} of the list is the word {w}." for i, w in enumerate(["apple", "river", "stone", "cloud", "maple"] * 8))


def complete(client, **kw):
    return client.completions.create(model=MODEL_NAME, prompt=LONG, max_tokens=40, temperature=0, **kw)


def test_request_field_evicts_and_reports_usage(server, client):
    before = server.metrics()
    r = complete(client, extra_body={"kv_eviction": {"policy": "h2o", "budget": 96}})
    ev = r.usage.model_extra["kv_eviction"]
    assert ev["policy"].startswith("h2o budget 96")
    assert ev["tokens_evicted"] >= r.usage.prompt_tokens - 96
    assert 0 < ev["tokens_kept"] <= 96
    after = server.metrics()
    assert after["kvserve:kv_evicted_tokens_total"] - before.get("kvserve:kv_evicted_tokens_total", 0) == ev["tokens_evicted"]
    assert after["kvserve:kv_kept_tokens_count"] == before.get("kvserve:kv_kept_tokens_count", 0) + 1
    # without the field: no policy, nothing reported, the full text
    full = complete(client)
    assert "kv_eviction" not in (full.usage.model_extra or {})


@pytest.mark.parametrize("policy", ["window", "sinks", "snapkv"])
def test_each_policy_streams_and_choices_share_the_evicted_prompt(server, client, policy):
    chunks = list(complete(client, n=2, stream=True, stream_options={"include_usage": True},
                           extra_body={"kv_eviction": {"policy": policy, "budget": 128}}))
    usage = chunks[-1].usage
    assert usage.completion_tokens == 80
    ev = usage.model_extra["kv_eviction"]
    assert ev["tokens_evicted"] > 0 and ev["tokens_kept"] <= 2 * 128
    assert {c.choices[0].index for c in chunks if c.choices} == {0, 1}


@pytest.mark.parametrize("field, message", [
    ({"policy": "lru", "budget": 64}, "unknown KV eviction policy"),
    ({"policy": "quest", "budget": 64}, 'Quest is {"sparse": "quest", "sparse_pages": K}'),
    ({"policy": "sinks"}, "needs a budget"),
    ({"policy": "sinks", "budget": 16}, "leaves no room to evict"),
    ({"policy": "h2o", "budget": 64, "colour": 1}, "unknown field 'colour'"),
    ({"policy": "h2o", "budget": -5}, "'kv_eviction.budget': -5 is below the minimum"),
    ({"sparse": "quest"}, "needs sparse_pages"),
    ({"sparse": "quest", "sparse_pages": 4}, "--kv-sparse quest"),  # this server keeps no key summaries
    ("snapkv", "expected an object"),
    # settings that would do nothing (answered 200 before, the budget dropped; a user test)
    ({"budget": 256}, "a budget needs a \"policy\""),
    ({"policy": "none", "budget": 256}, "a budget needs a \"policy\""),
    ({"sink_tokens": 8}, "needs a \"policy\""),
    ({"policy": "window", "budget": 256, "obs_window": 8}, "needs \"policy\": \"snapkv\""),
    # a user test: sparse_pages alone turned a server's Quest off, and window took sink_tokens and kept none
    ({"sparse_pages": 4}, "needs \"sparse\": \"quest\""),
    ({"sparse": "none", "sparse_pages": 4}, "needs \"sparse\": \"quest\""),
    ({"policy": "window", "budget": 128, "sink_tokens": 4}, "window keeps no sink tokens"),
])
def test_bad_kv_eviction_is_a_400(server, client, field, message):
    with pytest.raises(openai.BadRequestError) as e:
        complete(client, extra_body={"kv_eviction": field})
    err = e.value.body
    assert err["param"].startswith("kv_eviction"), err
    assert message in err["message"], err
    assert "--kv-budget" not in err["message"], err  # a request's error names its field, not the CLI's flag


@pytest.mark.parametrize("policy", ["window", "sinks"])
def test_a_prompt_from_the_prefix_cache_is_cut_to_the_budget_as_a_computed_one(server, policy):
    """A prompt of whole pages + 1 whose pages all come from the prefix cache ends with a run of
    one token. That run did not count as the prompt's end, so window and sinks kept the whole
    prompt (972 of 961 tokens on a 64-token budget) and the greedy answer depended on what the
    cache held (found by a user test). Three requests: nothing cached, cached, another salt."""
    words = " ".join(f"Item {i}: the lamp {i % 11} costs {i * 13 % 97} dollars in shop {i % 7}." for i in range(24))
    ids = requests.post(server.url + "/tokenize", json={"prompt": words}).json()["tokens"]
    ids = ids[:16 * (len(ids) // 16 - 1) + 1]  # whole pages + 1
    assert 200 < len(ids) < 500
    got = []
    for salt in (f"{policy}-a", f"{policy}-a", f"{policy}-b"):
        r = requests.post(server.url + "/v1/completions", json={
            "model": MODEL_NAME, "prompt": ids, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "kv_eviction": {"policy": policy, "budget": 64}, "cache_salt": salt}).json()
        got.append((r["choices"][0]["text"], r["usage"]["kv_eviction"]["tokens_kept"],
                    r["usage"]["prompt_tokens_details"]["cached_tokens"]))
    assert got[1][2] == len(ids) - 1 and got[0][2] == got[2][2] == 0, got  # the second came from the cache
    assert got[0][:2] == got[1][:2] == got[2][:2], got
    assert got[1][1] <= 64 + 16, got


def test_server_default_and_quest():
    """--kv-eviction sinks is every request's default; a request may opt out; Quest requests
    work on a server started with --kv-sparse quest."""
    s = Server("--debug", "--kv-eviction", "sinks", "--kv-budget", "64", "--kv-sparse", "quest", "--kv-sparse-pages", "2")
    try:
        url = s.url + "/v1/completions"
        body = {"model": MODEL_NAME, "prompt": LONG, "max_tokens": 24, "temperature": 0}
        r = requests.post(url, json=body, timeout=60).json()
        ev = r["usage"]["kv_eviction"]
        assert ev["policy"].startswith("sinks budget 64") and "quest 2 pages" in ev["policy"]
        assert ev["tokens_evicted"] > 0 and ev["tokens_kept"] <= 64
        r = requests.post(url, json={**body, "kv_eviction": {"policy": "none"}}, timeout=60).json()
        assert "kv_eviction" not in r["usage"]
        # {} is the field's absence, as null: the server's default (it dropped the policy; a user test)
        for empty in ({}, None):
            r = requests.post(url, json={**body, "kv_eviction": empty}, timeout=60).json()
            assert r["usage"]["kv_eviction"]["policy"].startswith("sinks budget 64"), r
        r = requests.post(url, json={**body, "kv_eviction": {"sparse": "quest", "sparse_pages": 3}}, timeout=60).json()
        assert r["usage"]["kv_eviction"]["tokens_evicted"] == 0
        assert r["usage"]["kv_eviction"]["tokens_kept"] == r["usage"]["total_tokens"] - 1
        s.wait_clean()
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_bad_server_flags_fail_fast():
    import subprocess
    from kvserve_server import KVSERVE, MODEL
    for flags, msg in [(["--kv-eviction", "h2o"], "needs a budget"),
                       (["--kv-sparse", "quest"], "--kv-sparse-pages"),
                       (["--kv-eviction", "sinks", "--kv-budget", "8"], "leaves no room"),
                       (["--kv-offload-cold", "--kv-budget", "512"], "need Quest sparse reads"),
                       (["--kv-sparse", "quest", "--kv-sparse-pages", "2", "--kv-offload-cold", "--kv-budget", "32"],
                        "leaves no room for cold pages"),
                       (["--kv-sparse", "quest", "--kv-sparse-pages", "2", "--kv-offload-cold", "--kv-budget", "512",
                         "--kv-offload-dir", "/nonexistent/dir"], "cannot create a spill file"),
                       # accepted and ignored before (a user test)
                       (["--kv-offload-dir", "/nonexistent/dir"], "needs --kv-offload-cold"),
                       (["--kv-eviction", "window", "--kv-budget", "128", "--kv-sink-tokens", "4"], "window keeps no sink tokens")]:
        p = subprocess.run([KVSERVE, "serve", "-m", MODEL, *flags], capture_output=True, text=True, timeout=60)
        assert p.returncode != 0
        assert msg in p.stderr, p.stderr


def test_cold_pages_go_to_disk_and_come_back(tmp_path, request):
    """--kv-offload-cold: a 300-token prompt on a 96-token RAM budget streams its answer; the
    metrics show pages written to the spill file and read back; at the end no page and no slot
    of the spill file is held."""
    s = Server("--debug", "--kv-sparse", "quest", "--kv-sparse-pages", "2", "--kv-offload-cold", "--kv-budget", "96",
               "--kv-offload-dir", str(tmp_path))
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        # ignore_eos: both answers run their 40 tokens whatever two pages let the model see
        chunks = list(client.completions.create(model=MODEL_NAME, prompt=LONG, max_tokens=40, temperature=0, n=2, stream=True,
                                                stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
        usage = chunks[-1].usage
        assert usage.completion_tokens == 80
        ev = usage.model_extra["kv_eviction"]
        assert ev["policy"] == "quest 2 pages, cold pages to disk beyond 96 tokens", ev
        assert ev["tokens_evicted"] == 0 and ev["tokens_kept"] <= 2 * 96
        # a request's own Quest reads keep the server's cold pages and RAM budget (they were dropped)
        r = client.completions.create(model=MODEL_NAME, prompt=LONG, max_tokens=8, temperature=0,
                                      extra_body={"kv_eviction": {"sparse": "quest", "sparse_pages": 3}})
        assert r.usage.model_extra["kv_eviction"]["policy"] == "quest 3 pages, cold pages to disk beyond 96 tokens"
        s.wait_clean()
        m = s.metrics()
        assert m["kvserve:kv_cold_pages_out_total"] > 0 and m["kvserve:kv_cold_pages_in_total"] > 0, m
        assert m["kvserve:kv_cold_errors_total"] == 0
        assert m["kvserve:kv_cold_pages"] == 0
        assert list(tmp_path.iterdir()) == []  # the spill file is unlinked: nothing outlives the server
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_cold_pages_under_load_answer_as_alone(tmp_path):
    """Three users at once on a KV cache that holds little more than their RAM budgets: every
    page Quest picks comes back (a fetch short of room sends down a page the layer does not
    read, and the scheduler keeps what one layer reads free), so each greedy answer equals the
    one it gets alone. Before, fetches that found no room read without their page (a user test:
    28,609 skips on a 32 MiB cache, text that changed with the load)."""
    s = Server("--debug", "--kv-sparse", "quest", "--kv-sparse-pages", "4", "--kv-offload-cold", "--kv-budget", "128",
               "--kv-offload-dir", str(tmp_path), "--no-enable-prefix-caching", kv_memory="16MiB", max_model_len=1024)
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        prompts = [LONG.replace("apple", w) for w in ("pear", "plum", "fig")]

        def ask(p):
            return client.completions.create(model=MODEL_NAME, prompt=p, max_tokens=120, temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text
        alone = [ask(p) for p in prompts]
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(3) as ex:
            together = list(ex.map(ask, prompts))
        assert together == alone
        s.wait_clean()
        m = s.metrics()
        assert m["kvserve:kv_cold_no_room_total"] == 0, m
        assert m["kvserve:kv_cold_room_swaps_total"] > 0, m
        assert m["kvserve:kv_cold_pages_in_total"] > 0 and m["kvserve:kv_cold_pages"] == 0
    finally:
        s.stop()
    assert s.proc.returncode == 0


# ~40 tokens; with max_model_len 256 and 400 new tokens the sequence passes the limit twice
STORY = ("The history of the city begins with a small fishing village on the river. Over the centuries it grew into "
         "a busy port, and its merchants traded wool, salt and timber with towns along the coast.")


def test_past_max_model_len_reindexes_like_generate():
    """A request with an evicting policy goes on past max_model_len (StreamingLLM re-indexing): the
    server's text is `kvserve generate`'s (the single-sequence path that test_reindex_reference.py
    checks against a float64 oracle), usage and /metrics count the positions given back, forked
    choices (shared pages, copied before their keys are re-rotated) finish too, and every page
    comes back. Without an evicting policy the request is refused as before."""
    import subprocess
    from kvserve_server import KVSERVE, MODEL, ROOT
    s = Server("--debug", "--block-size", "16", max_model_len=256)
    try:
        url = s.url + "/v1/completions"
        body = {"model": MODEL_NAME, "prompt": STORY, "max_tokens": 400, "temperature": 0,
                "kv_eviction": {"policy": "sinks", "budget": 128}}
        before = s.metrics()
        r = requests.post(url, json=body, timeout=120)
        assert r.status_code == 200, r.text
        r = r.json()
        assert r["choices"][0]["finish_reason"] == "length" and r["usage"]["completion_tokens"] == 400
        ev = r["usage"]["kv_eviction"]
        # past 256 positions twice: each re-index closes the evicted pages (whole pages)
        assert ev["positions_reindexed"] >= 2 * 128 and ev["positions_reindexed"] % 16 == 0, ev
        assert ev["tokens_kept"] <= 128
        after = s.metrics()
        assert after["kvserve:kv_reindexed_tokens_total"] - before.get("kvserve:kv_reindexed_tokens_total", 0) == ev["positions_reindexed"]
        g = subprocess.run([KVSERVE, "generate", "-m", MODEL, "-p", STORY, "-n", "400", "--ctx", "256", "--temp", "0",
                            "--block-size", "16", "--kv-eviction", "sinks", "--kv-budget", "128", "--threads", "2"],
                           capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert g.returncode == 0, g.stderr[-2000:]
        assert g.stdout[:-1] == r["choices"][0]["text"]
        assert f"{ev['positions_reindexed']} positions re-indexed" in g.stderr, g.stderr[-500:]
        # through the engine (generate --speculative-config): the policy holds there too (no drafts under it)
        g2 = subprocess.run(g.args + ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'],
                            capture_output=True, text=True, timeout=120, cwd=ROOT)
        assert g2.returncode == 0 and g2.stdout == g.stdout, g2.stderr[-2000:]
        assert "do not speculate" in g2.stderr
        # n = 2, sampled and streamed: the choices share the prompt's pages until re-indexing copies them
        chunks = list(openai.OpenAI(base_url=s.url + "/v1", api_key="x").completions.create(
            model=MODEL_NAME, prompt=STORY, max_tokens=300, temperature=0.8, seed=7, n=2, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True, "kv_eviction": {"policy": "h2o", "budget": 128}}))
        finish = {c.choices[0].index: c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason}
        assert finish == {0: "length", 1: "length"}
        assert chunks[-1].usage.completion_tokens == 600
        assert chunks[-1].usage.model_extra["kv_eviction"]["positions_reindexed"] > 0
        s.wait_clean()
        # no evicting policy: max_model_len holds
        r = requests.post(url, json={**body, "kv_eviction": {"policy": "none"}}, timeout=60)
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
        r = requests.post(url, json={**body, "max_tokens": 100, "kv_eviction": {"policy": "none"}}, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 256 - 40
        # a budget that cannot leave room below max_model_len
        r = requests.post(url, json={**body, "kv_eviction": {"policy": "sinks", "budget": 300}}, timeout=60)
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
        s.wait_clean()
    finally:
        s.stop()


def test_router_lets_max_tokens_pass_max_model_len_with_the_backends_default_policy():
    """A backend whose default policy evicts serves max_tokens past max_model_len without a
    kv_eviction field; the router validates requests as its backends will only when told their
    default (`router --kv-eviction`): without it, it refuses as for a backend that keeps every token."""
    from kvserve_server import Router
    s = Server("--debug", "--block-size", "16", "--kv-eviction", "sinks", "--kv-budget", "128", max_model_len=256)
    routers = []
    try:
        body = {"model": MODEL_NAME, "prompt": STORY, "max_tokens": 300, "temperature": 0}
        routers.append(Router("--replica", s.url, "--kv-eviction", "sinks", max_model_len=256))
        r = requests.post(routers[0].url + "/v1/completions", json=body, timeout=120)
        assert r.status_code == 200, r.text
        r = r.json()
        assert r["usage"]["completion_tokens"] == 300 and r["usage"]["kv_eviction"]["positions_reindexed"] > 0, r["usage"]
        routers.append(Router("--replica", s.url, max_model_len=256))
        r = requests.post(routers[1].url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and "maximum context length" in r.json()["error"]["message"], r.text
        s.wait_clean()
    finally:
        for x in routers:
            x.stop()
        s.stop()


def test_a_small_pool_admits_by_the_budget():
    """A pool of 11 pages (176 tokens) runs a 300-token completion under --kv-eviction sinks
    --kv-budget 64, and under a request's own policy: admission counts what a sequence holds at
    once (the prompt, then the budget), not its whole context. Without a policy the same request
    is refused with a 400 naming max_tokens."""
    s = Server("--debug", "--kv-eviction", "sinks", "--kv-budget", "64", kv_memory="4MiB")
    try:
        client = openai.OpenAI(base_url=s.url + "/v1", api_key="none")
        kw = dict(model=MODEL_NAME, prompt="Once upon a time", max_tokens=300, temperature=0, extra_body={"ignore_eos": True})
        r = client.completions.create(**kw)
        assert r.usage.completion_tokens == 300
        assert r.usage.model_extra["kv_eviction"]["tokens_kept"] <= 64
        r = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "kv_eviction": {"policy": "h2o", "budget": 96}}})
        assert r.usage.completion_tokens == 300
        assert r.usage.model_extra["kv_eviction"]["tokens_kept"] <= 96
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(**{**kw, "extra_body": {"kv_eviction": {"policy": "none"}}})
        assert e.value.body["param"] == "max_tokens" and "raise --kv-cache-memory" in e.value.body["message"], e.value.body
        s.wait_clean()
    finally:
        s.stop()
    assert s.proc.returncode == 0


def test_quest_reads_a_prompt_whole_whatever_the_cache_left_of_it():
    """Quest reads sparsely in decode runs only. A prompt's last run is as short as the prefix
    cache leaves it (8 tokens after 992 cached); read sparsely, the same greedy request answered
    differently once its prompt was cached (a user test)."""
    s = Server("--debug", "--kv-sparse", "quest", "--kv-sparse-pages", "8", max_model_len=2048, kv_memory="256MiB")
    try:
        text = open(__import__("pathlib").Path(__file__).parents[2] / "data/text/emma.txt").read()[:80000]
        ids = requests.post(s.url + "/tokenize", json={"prompt": text}).json()["tokens"]
        prompt = requests.post(s.url + "/detokenize", json={"tokens": ids[18000:19000]}).json()["prompt"]
        body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 32, "temperature": 0}
        outs = []
        for _ in range(2):
            r = requests.post(s.url + "/v1/completions", json=body, timeout=120).json()
            outs.append((r["choices"][0]["text"], r["usage"]["prompt_tokens_details"]["cached_tokens"]))
        assert outs[0][1] == 0 and outs[1][1] > 900, outs
        assert outs[0][0] == outs[1][0], outs
        s.wait_clean()
    finally:
        s.stop()
