"""Prefix caching on a hybrid model (Gemma 3 270M: sliding-window layers with a 512-token
window beside global layers), through the real server and the official openai client.

A cached prefix is usable when its global pages and the sliding-window pages of its last
window are present (src/kv/prefix_cache.h). A prompt well past the window is computed once;
later requests sharing it report it in usage.prompt_tokens_details.cached_tokens and answer
exactly as a request that missed the cache (another cache_salt) does.
"""
from __future__ import annotations

import os
import time

import pytest

from kvserve_server import ROOT, Server

GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")
WINDOW = 512

# ~900 tokens of plain prose: past the sliding window, so a hit needs the window's pages.
DOC = " ".join(
    f"Section {i}: the harbour master logged {i * 7 % 13} ships, {i * 5 % 11} barges and "
    f"{i * 3 % 7} ferries before noon, and noted that the tide turned at {6 + i % 5} o'clock."
    for i in range(36)
)


@pytest.fixture(scope="module")
def gemma():
    s = Server("--debug", "--max-num-seqs", "4", "--max-num-batched-tokens", "256",
               model=GEMMA, max_model_len=2048, kv_memory="64MiB")
    yield s
    s.stop()
    assert s.proc.returncode == 0, f"kvserve did not stop cleanly ({s.proc.returncode}):\n{s.output()}"


@pytest.fixture(scope="module")
def gclient(gemma):
    from openai import OpenAI
    c = OpenAI(base_url=gemma.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    yield c
    c.close()


def ask(client, question: str, salt: str):
    t0 = time.perf_counter()
    r = client.completions.create(model="gemma-3-270m-Q4_K_M", prompt=DOC + "\n\nQuestion: " + question + "\nAnswer:",
                                  max_tokens=12, temperature=0, extra_body={"cache_salt": salt})
    return r, time.perf_counter() - t0


def test_hybrid_prefix_hits_past_the_window_and_never_change_output(gemma, gclient):
    first, t_first = ask(gclient, "How many ships were logged in section 3?", "hybrid")
    n_prompt = first.usage.prompt_tokens
    assert n_prompt > WINDOW + 200
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # Another question after the same document: the document's full pages are reused.
    hit, t_hit = ask(gclient, "When did the tide turn in section 9?", "hybrid")
    miss, t_miss = ask(gclient, "When did the tide turn in section 9?", "hybrid-cold")
    cached = hit.usage.prompt_tokens_details.cached_tokens
    assert cached > WINDOW, f"only {cached} of {hit.usage.prompt_tokens} prompt tokens reused"
    assert cached % 16 == 0
    assert miss.usage.prompt_tokens_details.cached_tokens == 0
    assert hit.choices[0].text == miss.choices[0].text
    # The same request again: everything but the last page's tokens is reused.
    again, t_again = ask(gclient, "When did the tide turn in section 9?", "hybrid")
    assert again.usage.prompt_tokens_details.cached_tokens >= hit.usage.prompt_tokens - 16
    assert again.choices[0].text == hit.choices[0].text
    print(f"\nGemma 3, {hit.usage.prompt_tokens}-token prompt: first {t_first:.2f}s, hit ({cached} cached) {t_hit:.2f}s, "
          f"miss {t_miss:.2f}s, repeat {t_again:.2f}s")

    m = gemma.metrics()
    assert m["kvserve:prefix_cache_window_pages"] > 0
    assert m["kvserve:prefix_cache_hits_total"] >= cached
    kv = gemma.wait_clean()
    assert kv["window_pages_cached"] > 0
