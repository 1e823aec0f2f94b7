"""KV tiers below RAM through real processes: `kvserve serve` on the real model, a real
`redis-server` (Debian) on loopback, the official `openai` client.

- L2 (--kv-disk-dir): a restart finds yesterday's prefixes; corrupt or truncated page files are
  detected, dropped and recomputed, with the same answer as a miss.
- L3 (--kv-redis): a prefix computed on instance A is a hit on instance B; Redis stopped or
  frozen fails no request, and hits resume when it is back.
- Namespaces (cache_salt, API key) hold in every tier: checked through the API and by reading
  the stored keys.
- --preemption-mode swap: preempted sequences resume from the tier with the same output.
Greedy decoding everywhere: a hit must give exactly the text a miss gives.
"""
from __future__ import annotations

import glob
import os
import shutil
import signal
import subprocess
import tempfile
import time

import pytest
import requests
import xxhash
from openai import OpenAI

from kvserve_server import MODEL_NAME, SLOWDOWN, Redis, Server, free_port

MAX_LEN = 2048
# ~1100 tokens of distinct text per salt / seed, so nothing is shared by accident.
BASE = open(os.path.join(os.path.dirname(__file__), "..", "..", "data", "text", "emma.txt"), encoding="utf-8").read()


def doc(offset: int, chars: int = 4400) -> str:
    return BASE[20000 + offset: 20000 + offset + chars]


def tier_server(*extra: str, kv_memory: str = "48MiB") -> Server:
    return Server("--debug", *extra, max_model_len=MAX_LEN, kv_memory=kv_memory)


def ask(server: Server, prompt: str, max_tokens: int = 12, api_key: str = "unused", **extra):
    c = OpenAI(base_url=server.url + "/v1", api_key=api_key, max_retries=0, timeout=120 * SLOWDOWN)
    try:
        r = c.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=max_tokens, temperature=0,
                                 extra_body=extra or None)
    finally:
        c.close()
    return r.choices[0].text, r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens


def tier(server: Server, name: str, tier_name: str) -> float:
    return server.metrics().get(f'kvserve:{name}{{tier="{tier_name}"}}', 0.0)


def assert_clean(server: Server):
    server.wait_clean()


def stop(server: Server):
    server.stop()
    assert server.proc.returncode == 0, server.output()


@pytest.fixture
def redis():
    r = Redis()
    yield r
    r.close()


@pytest.fixture
def disk_dir():
    d = tempfile.mkdtemp(prefix="kvserve-l2-")
    yield d
    shutil.rmtree(d, ignore_errors=True)


def wait_written(server: Server, tier_name: str, at_least: int, timeout: float = 20):
    deadline = time.time() + timeout * SLOWDOWN
    while tier(server, "kv_tier_pages_written_total", tier_name) < at_least:
        if time.time() > deadline:
            pytest.fail(f"{tier_name}: fewer than {at_least} pages written: {server.metrics()}")
        time.sleep(0.05)


# ---- L2: disk ---------------------------------------------------------------------------------

def test_restart_with_the_same_disk_dir_hits(disk_dir):
    p = doc(0)
    a = tier_server("--kv-disk-dir", disk_dir)
    try:
        cold, n_prompt, cached = ask(a, p)
        assert cached == 0 and n_prompt > 900
        assert_clean(a)
    finally:
        stop(a)  # write-back: a clean stop writes every cached page down
    files = glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp"))
    assert len(files) >= n_prompt // 16
    b = tier_server("--kv-disk-dir", disk_dir)
    try:
        assert b.metrics()['kvserve:kv_tier_pages_stored{tier="disk"}'] == len(files)
        warm, _, cached = ask(b, p)
        assert warm == cold
        assert cached >= n_prompt - 16 - 1, cached
        assert tier(b, "kv_tier_hits_total", "disk") >= n_prompt // 16 - 1
        assert b.metrics()["kvserve:kv_tier_loaded_pages_total"] >= n_prompt // 16 - 1
        assert_clean(b)
    finally:
        stop(b)


def test_pages_computed_with_other_activation_precision_are_never_taken(disk_dir):
    """--act-quant q8 computes other KV bytes than the default q8x2: a q8x2 server that took a q8
    server's pages answered with the q8 server's text (a user test). Now the activations'
    precision is part of what names a page: the default misses them, q8 again finds them."""
    p = doc(3000)
    a = tier_server("--kv-disk-dir", disk_dir, "--act-quant", "q8")
    try:
        _, n_prompt, cached = ask(a, p)
        assert cached == 0
    finally:
        stop(a)
    b = tier_server("--kv-disk-dir", disk_dir)
    try:
        _, _, cached = ask(b, p)
        assert cached == 0 and tier(b, "kv_tier_hits_total", "disk") == 0
    finally:
        stop(b)
    c = tier_server("--kv-disk-dir", disk_dir, "--act-quant", "q8")
    try:
        _, _, cached = ask(c, p)
        assert cached >= n_prompt - 16 - 1, cached
    finally:
        stop(c)


def test_prompt_logprobs_requests_load_nothing_from_the_disk(disk_dir):
    """A prompt-logprob request computes its whole prompt (the cache keeps K/V, not logits): it must
    not read the prompt's pages from the disk either (it loaded 24-31 pages for nothing), nor count
    as a prefix-cache lookup (an lm-eval run showed a hit rate near 0)."""
    p, other = doc(0), doc(9000)
    a = tier_server("--kv-disk-dir", disk_dir)
    try:
        ask(a, p)
        ask(a, other)
    finally:
        stop(a)
    b = tier_server("--kv-disk-dir", disk_dir)
    try:
        m0 = b.metrics()
        r = requests.post(b.url + "/v1/completions", json={"prompt": p, "max_tokens": 0, "prompt_logprobs": 1}, timeout=120 * SLOWDOWN)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        m1 = b.metrics()
        assert m1["kvserve:kv_tier_loaded_pages_total"] == m0["kvserve:kv_tier_loaded_pages_total"] == 0
        assert m1["kvserve:prefix_cache_queries_total"] == m0["kvserve:prefix_cache_queries_total"]
        # the control: a plain request for the other prompt loads its pages and counts its lookup
        _, n_prompt, cached = ask(b, other)
        assert cached > 0 and b.metrics()["kvserve:kv_tier_loaded_pages_total"] > 0
        assert b.metrics()["kvserve:prefix_cache_queries_total"] == m1["kvserve:prefix_cache_queries_total"] + n_prompt
        assert_clean(b)
    finally:
        stop(b)


def test_a_conversation_continued_later_keeps_its_head_over_the_disk_budget(disk_dir):
    # Turn 1 goes to disk; turn 2, in a later server life, extends it; an unrelated prompt then
    # pushes the disk over its budget. Plain LRU deleted turn 1's pages first (the oldest), and
    # with them every page after: turn 2 became a miss. Leaves go first now: turn 2 loses its tail.
    turn1 = doc(0, 3000)
    turn2 = turn1 + doc(3000, 3000)
    other = doc(40000, 3000)
    files = lambda: glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp"))  # noqa: E731
    a = tier_server("--kv-disk-dir", disk_dir)
    try:
        _, n1, _ = ask(a, turn1)
    finally:
        stop(a)  # write-back: a clean stop writes every cached page down
    pages1 = len(files())
    assert pages1 >= n1 // 16 - 1
    page_bytes = max(os.path.getsize(f) for f in files())
    b = tier_server("--kv-disk-dir", disk_dir)
    try:
        _, n2, cached = ask(b, turn2)
        assert cached >= n1 - 32, cached  # turn 1's pages, from disk
    finally:
        stop(b)
    pages2 = len(files())
    assert pages2 > pages1 + 20
    # Room for turn 2 and half of the other prompt: about half of that prompt's pages must go.
    budget = (pages2 + (pages2 - pages1) // 2) * page_bytes
    c = tier_server("--kv-disk-dir", disk_dir, "--kv-disk-bytes", str(budget))
    try:
        ask(c, other)
    finally:
        stop(c)
    assert sum(os.path.getsize(f) for f in files()) <= budget
    d = tier_server("--kv-disk-dir", disk_dir, "--kv-disk-bytes", str(budget))
    try:
        _, _, cached = ask(d, turn2)
        assert cached >= n1 - 32, (cached, n1, n2)  # at least turn 1 still comes from disk
        assert_clean(d)
    finally:
        stop(d)


CONV, OTHER1, OTHER2 = doc(0, 1600), doc(20000, 1600), doc(30000, 1600)  # ~370 tokens each


def conversation_on_disk(disk_dir: str, write: tuple[str, ...]) -> tuple[int, int, int]:
    """One server life asks CONV and stops: (its prompt tokens, its pages on disk, a budget with
    room for them and half as many more)."""
    a = tier_server("--kv-disk-dir", disk_dir, *write)
    try:
        _, n_conv, _ = ask(a, CONV)
    finally:
        stop(a)
    files = glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp"))
    assert len(files) >= n_conv // 16 - 1
    return n_conv, len(files), (len(files) + len(files) // 2) * max(os.path.getsize(f) for f in files)


def assert_next_start_finds_conversation(disk_dir: str, budget: int, write: tuple[str, ...], n_conv: int):
    c = tier_server("--kv-disk-dir", disk_dir, "--kv-disk-bytes", str(budget), *write)
    try:
        _, _, cached = ask(c, CONV)
        assert cached >= n_conv - 32, (cached, n_conv)
        assert_clean(c)
    finally:
        stop(c)


@pytest.mark.parametrize("mode", ["back", "through"])
def test_the_prefix_used_last_before_a_stop_is_what_the_next_start_finds(disk_dir, mode):
    # A conversation goes to disk; the next life loads it, serves two other prompts, then the
    # conversation again (from RAM), and stops. Its disk holds the conversation and half of
    # another prompt. The disk ordered pages by when they reached it, and its copy of the
    # conversation carried the load's time: write-back's stop wrote the other prompts first
    # (older in RAM) and trimmed the conversation away before its refresh came; write-through
    # trimmed it during the life and wrote nothing at the stop. Either way the next start missed.
    write = ("--kv-tier-write", mode)
    n_conv, _, budget = conversation_on_disk(disk_dir, write)
    b = tier_server("--kv-disk-dir", disk_dir, "--kv-disk-bytes", str(budget), *write)
    try:
        for prompt in (CONV, OTHER1, OTHER2, CONV):
            _, _, cached = ask(b, prompt)
            if prompt is CONV:
                assert cached >= n_conv - 32, cached  # from disk, then from RAM
    finally:
        stop(b)
    assert sum(os.path.getsize(f) for f in glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp"))) <= budget
    assert_next_start_finds_conversation(disk_dir, budget, write, n_conv)


def test_write_through_rewrites_a_prefix_its_disk_dropped_while_ram_served_it(disk_dir):
    # Write-through writes a page when it fills, and only then. Two other prompts push the
    # conversation off the disk while RAM keeps it; the conversation is served again from RAM.
    # Nothing wrote it again: a crash (no clean stop) lost it. Now a finished request hands its
    # whole path down again: what the disk holds is refreshed, what it dropped is rewritten.
    write = ("--kv-tier-write", "through")
    n_conv, n_pages, budget = conversation_on_disk(disk_dir, write)
    shutil.rmtree(disk_dir)
    b = tier_server("--kv-disk-dir", disk_dir, "--kv-disk-bytes", str(budget), *write)
    try:
        for prompt in (CONV, OTHER1, OTHER2):
            ask(b, prompt)
        written = tier(b, "kv_tier_pages_written_total", "disk")
        _, _, cached = ask(b, CONV)
        assert cached >= n_conv - 32, cached  # from RAM
        deadline = time.time() + 10 * SLOWDOWN
        while tier(b, "kv_tier_pages_written_total", "disk") < written + n_pages - 2 and time.time() < deadline:
            time.sleep(0.1)
        time.sleep(0.5)  # the writer's last batch
        b.proc.kill()  # no clean stop: only what was written counts
        b.proc.wait()
    finally:
        b.stop()
    assert_next_start_finds_conversation(disk_dir, budget, write, n_conv)


def test_corrupt_and_truncated_page_files_are_recomputed(disk_dir):
    p = doc(5000)
    a = tier_server("--kv-disk-dir", disk_dir)
    try:
        cold, n_prompt, _ = ask(a, p)
    finally:
        stop(a)
    files = sorted(glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp")))
    assert files
    # Flip one payload byte in every file: headers stay valid, so the start-up scan keeps them and
    # the load-time checksum must catch them.
    for f in files:
        with open(f, "r+b") as fh:
            fh.seek(-100, os.SEEK_END)
            b = fh.read(1)
            fh.seek(-100, os.SEEK_END)
            fh.write(bytes([b[0] ^ 0x40]))
    b = tier_server("--kv-disk-dir", disk_dir)
    try:
        text, _, cached = ask(b, p)
        assert text == cold and cached == 0
        m = b.metrics()
        assert m['kvserve:kv_tier_corrupt_total{tier="disk"}'] >= 1
        assert m['kvserve:kv_tier_hits_total{tier="disk"}'] == 0
        # and the log says so, not only the counter
        assert "kv tier: disk: 1 stored pages failed their checks" in b.output(), b.output()[-2000:]
        assert_clean(b)
    finally:
        stop(b)
    # The corrupt first page was deleted and rewritten by the recompute; now truncate every file:
    # the start-up scan drops them all.
    files = sorted(glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp")))
    for f in files:
        os.truncate(f, os.path.getsize(f) - 1)
    c = tier_server("--kv-disk-dir", disk_dir)
    try:
        m = c.metrics()
        assert m['kvserve:kv_tier_pages_stored{tier="disk"}'] == 0
        assert m['kvserve:kv_tier_corrupt_total{tier="disk"}'] >= len(files)
        assert f"removed {len(files)} files at start that were corrupt" in c.output(), c.output()[-2000:]
        text, _, cached = ask(c, p)
        assert text == cold and cached == 0
    finally:
        stop(c)
    assert not glob.glob(os.path.join(disk_dir, "*", "tmp", "*"))


def test_bad_disk_dir_is_a_clear_error(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    from kvserve_server import KVSERVE, MODEL
    r = subprocess.run([KVSERVE, "serve", "-m", MODEL, "--port", str(free_port()), "--kv-disk-dir", str(blocker / "x")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    assert "--kv-disk-dir" in r.stderr and "cannot create" in r.stderr, r.stderr[-2000:]


def test_a_second_server_on_the_same_disk_dir_is_refused(tmp_path):
    """Two servers on one --kv-disk-dir deleted each other's pages (a start-up trim) and trusted
    stale indexes; the second is now refused, naming the first; after the first stops it starts.
    A Redis address with a password is refused without printing the password."""
    from kvserve_server import KVSERVE, MODEL
    disk_dir = str(tmp_path / "disk")
    a = tier_server("--kv-disk-dir", disk_dir)
    try:
        r = subprocess.run([KVSERVE, "serve", "-m", MODEL, "--port", str(free_port()), "--kv-disk-dir", disk_dir],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert f"is in use by another kvserve process (pid {a.proc.pid})" in r.stderr, r.stderr[-2000:]
    finally:
        a.stop()
    b = tier_server("--kv-disk-dir", disk_dir)
    b.stop()
    r = subprocess.run([KVSERVE, "serve", "-m", MODEL, "--port", str(free_port()), "--kv-redis", "redis://:s3cret@127.0.0.1:6390"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "credentials" in r.stderr and "s3cret" not in r.stderr, r.stderr[-2000:]


def test_a_disk_dir_removed_while_serving_is_recreated_and_locked_again(disk_dir):
    """`rm -rf` of --kv-disk-dir while the server ran was never recovered: every later write
    failed (tmp/ was gone), silently; kv_tier_pages_stored kept counting the deleted pages, and
    the lock file was gone, so a second server could open the directory. Now the store recreates
    the directory and its lock, says so once, and pages written after it are found again, also
    after a restart."""
    from kvserve_server import KVSERVE, MODEL
    first, second = doc(60000, 3000), doc(70000, 3000)
    a = tier_server("--kv-disk-dir", disk_dir, "--kv-tier-write", "through")
    try:
        _, n1, _ = ask(a, first)
        wait_written(a, "disk", n1 // 16)
        assert_clean(a)
        written = tier(a, "kv_tier_pages_written_total", "disk")
        assert tier(a, "kv_tier_pages_stored", "disk") == written
        shutil.rmtree(disk_dir)
        answer, n2, cached = ask(a, second)
        assert cached == 0
        wait_written(a, "disk", written + n2 // 16)
        # Every page of the second prompt is on disk, and the deleted ones are no longer counted.
        deadline = time.time() + 10 * SLOWDOWN
        while True:
            files = glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp"))
            m = a.metrics()
            if len(files) >= n2 // 16 and m['kvserve:kv_tier_pages_stored{tier="disk"}'] == len(files):
                break
            assert time.time() < deadline, (len(files), n2 // 16, m)
            time.sleep(0.1)
        assert m['kvserve:kv_tier_write_drops_total{tier="disk"}'] == 0, m
        assert m['kvserve:kv_tier_errors_total{tier="disk"}'] >= 1, m  # the removal
        assert a.output().count("was removed while in use") == 1, a.output()
        # The lock is held again: a second server on the directory is refused.
        r = subprocess.run([KVSERVE, "serve", "-m", MODEL, "--port", str(free_port()), "--kv-disk-dir", disk_dir],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert f"is in use by another kvserve process (pid {a.proc.pid})" in r.stderr, r.stderr[-2000:]
        assert_clean(a)
    finally:
        stop(a)
    # A clean stop may write more (pages RAM still holds that the removal took: store_finished_path).
    on_disk = glob.glob(os.path.join(disk_dir, "*", "*", "*.kvp"))
    assert set(files) <= set(on_disk)
    b = tier_server("--kv-disk-dir", disk_dir)
    try:
        assert tier(b, "kv_tier_pages_stored", "disk") == len(on_disk)
        warm, _, cached = ask(b, second)
        assert warm == answer
        assert cached >= n2 - 16 - 1, cached
    finally:
        stop(b)


def test_a_disk_budget_smaller_than_a_page_or_a_fraction_of_ram_is_refused(tmp_path):
    """--kv-disk-bytes below one page's blob started and then dropped every write; 0.5 was read
    as half the RAM (the --kv-cache-memory parser). Both are refused at start, before anything is
    written to the directory; a budget of exactly one page starts."""
    import re
    from kvserve_server import KVSERVE, MODEL
    disk_dir = tmp_path / "disk"
    serve = [KVSERVE, "serve", "-m", MODEL, "--port", str(free_port()), "--kv-disk-dir", str(disk_dir)]
    r = subprocess.run(serve + ["--kv-disk-bytes", "100KiB"], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0
    m = re.search(r"--kv-disk-bytes 100\.00 KiB is smaller than one page on disk: a page of 16 tokens is [0-9.]+ KiB \(([0-9]+) bytes",
                  r.stderr)
    assert m, r.stderr[-2000:]
    page = int(m.group(1))
    assert page > 16 * 22 * 1024  # SmolLM2's f16 KV: 22.5 KiB per token
    assert not os.path.exists(disk_dir)
    for frac in ["0.5", "1.0", ".25"]:
        r = subprocess.run(serve + ["--kv-disk-bytes", frac], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert f"--kv-disk-bytes: '{frac}' would be a fraction of RAM" in r.stderr and "20GiB" in r.stderr, r.stderr[-2000:]
        assert "loading weights" not in r.stderr  # refused before the model loads
    assert not os.path.exists(disk_dir)
    # --max-body-size read the same parser: 0.5 was half the RAM for a request body.
    for cmd in [serve, [KVSERVE, "router", "--listen", f"127.0.0.1:{free_port()}", "--replica", "http://127.0.0.1:9"]]:
        r = subprocess.run(cmd + ["--max-body-size", "0.5"], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and "--max-body-size: '0.5' would be a fraction of RAM" in r.stderr, r.stderr[-2000:]
    r = subprocess.run(serve + ["--kv-disk-bytes", str(page - 1)], capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "smaller than one page on disk" in r.stderr, r.stderr[-2000:]
    a = tier_server("--kv-disk-dir", str(disk_dir), "--kv-disk-bytes", str(page))
    stop(a)


def test_bad_redis_address_is_a_clear_error():
    from kvserve_server import KVSERVE, MODEL
    for addr, words in [("http://127.0.0.1:6379", "http:// is not a plain Redis address"),
                        ("rediss://127.0.0.1:6379", "rediss:// is not a plain Redis address"),
                        ("redis://127.0.0.1:port", "bad port"),
                        ("redis://127.0.0.1:6379/3", "a database number is not supported"),
                        ("redis://127.0.0.1:6379?db=2", "a database number is not supported")]:
        r = subprocess.run([KVSERVE, "serve", "-m", MODEL, "--port", str(free_port()), "--kv-redis", addr],
                           capture_output=True, text=True, timeout=60)
        assert r.returncode != 0
        assert words in r.stderr, r.stderr[-2000:]
    # a tier's settings without that tier did nothing, silently
    for flags, words in [(["--kv-tier-write", "through"], "--kv-tier-write: sets how pages reach a KV tier"),
                         (["--kv-tier-min-tokens", "5"], "--kv-tier-min-tokens: sets how pages reach a KV tier"),
                         (["--kv-redis-ttl", "60", "--kv-disk-dir", "/tmp/unused"], "--kv-redis-ttl requires --kv-redis"),
                         (["--kv-redis-timeout-ms", "60"], "--kv-redis-timeout-ms requires --kv-redis"),
                         (["--kv-disk-bytes", "1GiB"], "--kv-disk-bytes requires --kv-disk-dir")]:
        r = subprocess.run([KVSERVE, "serve", "-m", MODEL, "--port", str(free_port()), *flags], capture_output=True, text=True, timeout=60)
        assert r.returncode != 0 and words in r.stderr, (flags, r.stderr[-2000:])


# ---- L3: Redis ---------------------------------------------------------------------------------

def test_a_prefix_computed_on_one_instance_is_a_hit_on_another(redis):
    p = doc(10000)
    a = tier_server("--kv-redis", redis.url, "--kv-tier-write", "through")
    b = tier_server("--kv-redis", redis.url)
    try:
        cold, n_prompt, _ = ask(a, p)
        wait_written(a, "redis", n_prompt // 16)
        warm, _, cached = ask(b, p)
        assert warm == cold
        assert cached >= n_prompt - 16 - 1
        assert tier(b, "kv_tier_hits_total", "redis") >= n_prompt // 16 - 1
        assert_clean(a)
        assert_clean(b)
    finally:
        stop(a)
        stop(b)


def test_redis_down_or_frozen_fails_no_request_and_hits_resume(redis):
    a = tier_server("--kv-redis", redis.url, "--kv-tier-write", "through", "--kv-redis-timeout-ms", "100")
    b = tier_server("--kv-redis", redis.url, "--kv-redis-timeout-ms", "100")
    try:
        p = doc(15000)
        cold, n_prompt, _ = ask(a, p)
        wait_written(a, "redis", n_prompt // 16)
        # Frozen (SIGSTOP): every command times out; B computes instead, same answer.
        redis.proc.send_signal(signal.SIGSTOP)
        t0 = time.time()
        text, _, cached = ask(b, p)
        assert text == cold and cached == 0
        assert time.time() - t0 < 30 * SLOWDOWN  # (sanitized builds: KV_TEST_SLOWDOWN)
        # The outage is told with its cause (a read timeout: EAGAIN), once per connection, not
        # only counted.
        told = [ln for ln in b.output().splitlines() if ln.startswith(f"kv tier: redis 127.0.0.1:{redis.port} failed")]
        assert 1 <= len(told) <= 2, b.output()[-2000:]
        assert all("(Resource temporarily unavailable, timeout 100 ms)" in ln for ln in told), told
        redis.proc.send_signal(signal.SIGCONT)
        # Dead: killed and restarted empty on the same port.
        redis.stop()
        q = doc(20000)
        cold_q, n_q, _ = ask(a, q)
        assert tier(b, "kv_tier_errors_total", "redis") + tier(a, "kv_tier_errors_total", "redis") >= 1
        redis.start()
        # Hits resume once the backoff ends: A writes a new prompt through, B finds it.
        r = doc(25000)
        deadline = time.time() + 30
        while True:
            cold_r, n_r, _ = ask(a, r, max_tokens=2)
            time.sleep(0.5)
            if tier(a, "kv_tier_pages_written_total", "redis") > 0 and len(redis.keys()) >= n_r // 16:
                break
            if time.time() > deadline:
                pytest.fail(f"A never wrote to the restarted Redis: {a.metrics()}")
            r = doc(25000 + int(time.time() * 1000) % 5000)  # a fresh prompt: A's RAM already holds the last
        warm_r, _, cached = ask(b, r, max_tokens=2)
        assert warm_r == cold_r and cached >= n_r - 16 - 1
        # the end of the outage is told as its start was
        assert f"kv tier: redis 127.0.0.1:{redis.port} answers again" in a.output(), a.output()[-2000:]
        assert_clean(a)
        assert_clean(b)
    finally:
        if redis.proc.poll() is None:
            redis.proc.send_signal(signal.SIGCONT)
        stop(a)
        stop(b)


@pytest.mark.parametrize("mode", ["back", "through"])
def test_a_prefix_redis_lost_reaches_it_again_when_ram_lets_it_go(redis, mode):
    """Redis restarts empty (or evicts) while instance A still serves a prefix it wrote. A used to
    remember the pages as written and never sent them again: another instance found nothing.
    Now A asks Redis when RAM lets the pages go, and stores what Redis lost. The restart also
    closed A's idle connections: their next batch is sent again on a new one, not lost."""
    p = doc(45000)
    fillers = [doc(50000), doc(55000), doc(60000)]
    a = tier_server("--kv-redis", redis.url, "--kv-tier-write", mode)
    b = None
    try:
        cold, n_prompt, _ = ask(a, p)
        if mode == "back":
            for f in fillers[:2]:  # RAM (48 MiB, ~2 prompts) lets P go: written then
                ask(a, f)
        wait_written(a, "redis", n_prompt // 16)
        redis.stop()
        redis.start()  # empty
        assert redis.keys() == []
        if mode == "back":
            text, _, cached = ask(a, p)  # RAM and Redis lack it: recomputed, in RAM again
            assert text == cold and cached == 0
        for f in fillers:  # RAM lets P go again
            ask(a, f)
        a.wait_clean()
        # The writer drains its queue: the count stops moving.
        last, deadline = -1.0, time.time() + 30 * SLOWDOWN
        while (now := tier(a, "kv_tier_pages_written_total", "redis") + tier(a, "kv_tier_write_drops_total", "redis")) != last:
            assert time.time() < deadline, a.metrics()
            last = now
            time.sleep(0.5)
        b = tier_server("--kv-redis", redis.url)
        warm, _, cached = ask(b, p)
        assert warm == cold
        assert cached >= n_prompt - 16 - 1, (cached, n_prompt, a.metrics())
        # The connections the restart closed were opened again at their next batch: nothing lost.
        assert tier(a, "kv_tier_errors_total", "redis") == 0
        assert tier(a, "kv_tier_write_drops_total", "redis") == 0
        assert_clean(b)
    finally:
        stop(a)
        if b:
            stop(b)


def test_namespaces_hold_in_every_tier(redis, disk_dir):
    p = doc(30000)
    a = tier_server("--kv-redis", redis.url, "--kv-disk-dir", disk_dir, "--kv-tier-write", "through")
    b = tier_server("--kv-redis", redis.url)
    try:
        cold, n_prompt, _ = ask(a, p, cache_salt="alice")
        wait_written(a, "redis", n_prompt // 16)
        # Through the API: another salt, or none, never hits alice's pages, on either instance.
        for s in (b, a):
            text, _, cached = ask(s, p, cache_salt="bob")
            assert text == cold and cached == 0
        text, _, cached = ask(b, p)
        assert text == cold and cached == 0
        text, _, cached = ask(b, p, cache_salt="alice")
        assert text == cold and cached >= n_prompt - 17
        # In the store: every key names its namespace by a hash, never the salt itself.
        keys = redis.keys()
        tags = {k.split(":")[3] for k in keys}
        alice = f"{xxhash.xxh3_64_intdigest(b'alice'):016x}"
        bob = f"{xxhash.xxh3_64_intdigest(b'bob'):016x}"
        assert alice in tags and bob in tags
        assert not any("alice" in k or "bob" in k for k in keys)
        assert all(k.startswith("kvs:") and len(k.split(":")) == 5 for k in keys)
        assert sum(k.split(":")[3] == alice for k in keys) >= n_prompt // 16
    finally:
        stop(a)
        stop(b)


def test_api_keys_are_namespaces_in_the_shared_tier(redis):
    p = doc(35000)
    a = Server("--debug", "--api-key", "key-of-tenant-a", "--kv-redis", redis.url, "--kv-tier-write", "through",
               max_model_len=MAX_LEN)
    b = Server("--debug", "--api-key", "key-of-tenant-b", "--kv-redis", redis.url, max_model_len=MAX_LEN)
    a2 = Server("--debug", "--api-key", "key-of-tenant-a", "--kv-redis", redis.url, max_model_len=MAX_LEN)
    try:
        cold, n_prompt, _ = ask(a, p, api_key="key-of-tenant-a")
        wait_written(a, "redis", n_prompt // 16)
        text, _, cached = ask(b, p, api_key="key-of-tenant-b")
        assert text == cold and cached == 0  # same prompt, same salt (none), another tenant
        text, _, cached = ask(a2, p, api_key="key-of-tenant-a")
        assert text == cold and cached >= n_prompt - 17  # the same tenant on another instance
        assert not any("key-of-tenant" in k for k in redis.keys())
    finally:
        for s in (a, b, a2):
            stop(s)


# ---- swap preemption -----------------------------------------------------------------------------

def test_swap_preemption_resumes_with_the_same_output(disk_dir):
    import concurrent.futures as cf
    prompts = [doc(40000 + 5000 * i, 3000) for i in range(3)]
    # Alone: the reference outputs.
    ref = tier_server(kv_memory="64MiB")
    try:
        want = [ask(ref, p, max_tokens=64)[0] for p in prompts]
    finally:
        stop(ref)
    # Together in a pool too small for all three: some get preempted and swap out to disk.
    s = tier_server("--kv-disk-dir", disk_dir, "--preemption-mode", "swap", "--max-num-batched-tokens", "512",
                    kv_memory="40MiB")
    try:
        with cf.ThreadPoolExecutor(3) as ex:
            got = list(ex.map(lambda p: ask(s, p, max_tokens=64)[0], prompts))
        assert got == want
        m = s.metrics()
        assert m["kvserve:num_preemptions_total"] >= 1, m
        assert m['kvserve:kv_tier_pages_written_total{tier="disk"}'] >= 1
        assert_clean(s)
    finally:
        stop(s)


def test_swapped_sequences_behind_a_blocked_head_do_not_load_their_pages_over_and_over(disk_dir):
    """A waiting head that could not fit emptied the prefix cache at each step for nothing, pages
    just loaded for the swapped sequences behind it among them, and two of those passed the room
    check against the same evictable pages, each install evicting the other's: a user test saw
    ~1,400 pages loaded from disk for ~150 used (outputs right, disk reads and TTFT wasted). Pages
    loaded are now bounded by what the prompts and the swap-ins can use."""
    import concurrent.futures as cf
    prompts = [doc(60000 + 2000 * i, 700) for i in range(8)]
    s = tier_server("--kv-disk-dir", disk_dir, "--preemption-mode", "swap", "--kv-cache-dtype", "int8",
                    "--kv-cache-dtype-layers", "0-1:f16,28-29:f16", kv_memory="48MiB")
    try:
        want = [ask(s, p, max_tokens=250)[0] for p in prompts]  # alone, one after another
        m0 = s.metrics()
        with cf.ThreadPoolExecutor(8) as ex:
            got = list(ex.map(lambda p: ask(s, p, max_tokens=250)[0], prompts))
        assert got == want
        m1 = s.metrics()
        preempted = m1["kvserve:num_preemptions_total"] - m0["kvserve:num_preemptions_total"]
        loaded = m1["kvserve:kv_tier_loaded_pages_total"] - m0["kvserve:kv_tier_loaded_pages_total"]
        pages_per_seq = (180 + 250) // 16 + 2  # a prompt of ~170 tokens and its 250 new ones
        assert preempted >= 2, m1  # the case under test happened
        # each prompt's pages once, and each swap-in a sequence's pages, with room for one more each
        bound = 2 * (len(prompts) + preempted) * pages_per_seq
        assert loaded <= bound, (loaded, bound, preempted)
        assert_clean(s)
    finally:
        stop(s)
