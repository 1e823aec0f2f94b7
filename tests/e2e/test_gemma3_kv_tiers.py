"""KV tiers on a hybrid model (Gemma 3 270M: 15 sliding-window layers with a 512-token window
beside 3 global layers), through real processes: `kvserve serve`, a real `redis-server`, the
official `openai` client.

A page's blob may carry its position's window-group page (write-back: when the cache holds one;
write-through: for the last window of what each request computed), and a prefix loaded from
below RAM is used only as far as the window pages of its last window came with it
(src/kv/tier_manager.h, docs/tiers.md). So:

- disk (L2) across a restart: the same prompt reuses as much as a RAM hit did, with the same
  greedy answer; a prompt that extends it by more than a window reuses the old prompt and
  answers as a miss (another cache_salt) does;
- Redis (L3): a prefix computed on instance A is a hit on instance B, same answer;
- a prompt sharing part of a stored one reuses from disk exactly what the RAM cache would;
- prefill/decode disaggregation: 1 prefill + 1 decode + router give one instance's greedy
  output, the decode instance reusing every full page of the prompt (hybrid models send no
  partly filled tail page: the decode side computes the last page's tokens).
Greedy decoding everywhere: a hit must give exactly the text a miss gives.
"""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time

import pytest
from openai import OpenAI

from kvserve_server import ROOT, SLOWDOWN, Redis, Router, Server
from test_kv_tiers import stop, tier

GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")
MODEL_ID = "gemma-3-270m-Q4_K_M"
WINDOW = 512

# ~900 tokens of plain prose: past the sliding window, so a hit needs the window's pages.
DOC = " ".join(
    f"Section {i}: the harbour master logged {i * 7 % 13} ships, {i * 5 % 11} barges and "
    f"{i * 3 % 7} ferries before noon, and noted that the tide turned at {6 + i % 5} o'clock."
    for i in range(36)
)
# Another ~700 tokens: appended to DOC, more than a window past the cached prefix.
MORE = " ".join(
    f"Later, in entry {i}, the lighthouse keeper wrote that {i * 3 % 17} gulls sat on the pier "
    f"and the wind came from the {('north', 'east', 'south', 'west')[i % 4]}."
    for i in range(30)
)


def gemma_server(*extra: str) -> Server:
    return Server("--debug", "--max-num-seqs", "4", "--max-num-batched-tokens", "256", *extra,
                  model=GEMMA, max_model_len=4096, kv_memory="64MiB")


def ask(server: Server, prompt: str, salt: str = "tiers", max_tokens: int = 12, **extra):
    c = OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120 * SLOWDOWN)
    try:
        r = c.completions.create(model=MODEL_ID, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                 extra_body={"cache_salt": salt, **extra})
    finally:
        c.close()
    return r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


@pytest.fixture
def disk_dir():
    d = tempfile.mkdtemp(prefix="kvserve-gemma-l2-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_disk_tier_across_a_restart_and_past_the_window(disk_dir):
    prompt = DOC + "\n\nQuestion: How many ships were logged in section 3?\nAnswer:"
    longer = DOC + " " + MORE + "\n\nQuestion: Where did the wind come from in entry 5?\nAnswer:"
    a = gemma_server("--kv-disk-dir", disk_dir)
    try:
        cold, n_prompt, cached = ask(a, prompt)
        assert n_prompt > WINDOW + 200 and cached == 0
        again, _, cached_ram = ask(a, prompt)  # what a RAM hit reuses
        assert again == cold and cached_ram > WINDOW
        a.wait_clean()
    finally:
        stop(a)  # write-back: a clean stop writes every cached page down, window pages with theirs
    files = glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp"))
    assert len(files) >= n_prompt // 16
    b = gemma_server("--kv-disk-dir", disk_dir)
    try:
        warm, _, cached = ask(b, prompt)
        assert warm == cold
        assert cached == cached_ram, (cached, cached_ram)
        assert b.metrics()["kvserve:kv_tier_loaded_pages_total"] >= cached // 16 - 1
        # More than a window past what the disk holds: the old prompt's pages are reused (their
        # last window came with them) and the rest computed; the answer is a miss's.
        got, n_longer, cached_longer = ask(b, longer)
        want, _, cached_miss = ask(b, longer, salt="cold")
        assert cached_miss == 0
        assert n_longer > n_prompt + WINDOW
        assert got == want
        assert WINDOW < cached_longer <= n_prompt, (cached_longer, n_prompt)
        kv = b.wait_clean()
        assert kv["window_pages_cached"] > 0
    finally:
        stop(b)


def test_redis_prefix_from_one_instance_is_a_hit_on_another():
    redis = Redis()
    a = gemma_server("--kv-redis", redis.url, "--kv-tier-write", "through")
    b = gemma_server("--kv-redis", redis.url)
    try:
        prompt = DOC + "\n\nQuestion: When did the tide turn in section 9?\nAnswer:"
        cold, n_prompt, _ = ask(a, prompt)
        deadline = time.time() + 20 * SLOWDOWN
        # Every page as it filled, then the last window again with its window pages.
        while tier(a, "kv_tier_pages_written_total", "redis") < n_prompt // 16 + WINDOW // 16:
            assert time.time() < deadline, a.metrics()
            time.sleep(0.05)
        a.wait_clean()
        warm, _, cached = ask(b, prompt)
        assert warm == cold
        assert cached > WINDOW and cached >= n_prompt - 2 * 16, (cached, n_prompt)
        assert tier(b, "kv_tier_hits_total", "redis") >= cached // 16
        b.wait_clean()
    finally:
        stop(a)
        stop(b)
        redis.close()


def test_a_prompt_sharing_part_of_a_stored_one_reuses_what_ram_would(disk_dir):
    # A prompt sharing only the document's first half: the prefix it may reuse is the one whose
    # last window's pages are there. From disk after a restart it must reuse exactly what the
    # RAM cache of a server that computed the same document reuses, and answer as a miss.
    prompt = DOC + "\n\nQuestion: How many barges were logged in section 30?\nAnswer:"
    half = DOC[: len(DOC) // 2] + "\n\nQuestion: How many ferries were logged in section 2?\nAnswer:"
    ram = gemma_server()
    try:
        ask(ram, prompt)
        want, n_half, cached_ram = ask(ram, half)
        ram.wait_clean()
    finally:
        stop(ram)
    a = gemma_server("--kv-disk-dir", disk_dir)
    try:
        ask(a, prompt)
        a.wait_clean()
    finally:
        stop(a)
    b = gemma_server("--kv-disk-dir", disk_dir)
    try:
        got, _, cached = ask(b, half)
        assert n_half > WINDOW // 2
        assert got == want
        assert cached == cached_ram, (cached, cached_ram)
        b.wait_clean()
    finally:
        stop(b)


def test_prefill_and_decode_give_the_output_of_one_instance():
    prompts = [DOC + "\n\nQuestion: How many ferries were logged in section 12?\nAnswer:",
               DOC[: len(DOC) * 2 // 3] + "\n\nSummarise the log in one sentence:"]
    solo = gemma_server()
    try:
        expected = [ask(solo, p)[0] for p in prompts]
    finally:
        stop(solo)
    redis = Redis()
    pre = dec = router = None
    try:
        pre = gemma_server("--role", "prefill", "--kv-redis", redis.url)
        dec = gemma_server("--role", "decode", "--kv-redis", redis.url)
        router = Router("--prefill", pre.url, "--decode", dec.url, model=GEMMA, max_model_len=4096)
        for i, p in enumerate(prompts):
            text, n_prompt, cached = ask(router, p)
            assert text == expected[i], i
            # Every full page before the prompt's last token came from the prefill instance.
            assert cached == (n_prompt - 1) // 16 * 16, (i, n_prompt, cached)
            assert cached > WINDOW
        # Write-through sends pages without their window pages as they fill, then the last
        # window of each prompt again with them (Engine::store_last_window): fewer bytes than
        # every page with its window page (~295 KB per 16-token page here, ~49 KB without; these
        # prompts are short, so their last windows are a third of their pages).
        m = pre.metrics()
        written, out = m['kvserve:kv_tier_pages_written_total{tier="redis"}'], m['kvserve:kv_tier_bytes_out_total{tier="redis"}']
        assert 0 < out < written * 220_000, (out, written)
        dec.wait_clean()
        pre.wait_clean()
    finally:
        for x in (router, pre, dec):
            if x is not None:
                x.stop()
        redis.close()
