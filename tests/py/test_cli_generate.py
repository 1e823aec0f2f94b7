"""`kvserve generate` and `kvserve bench` as a user runs them: real binary, real model."""
import json
import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVSERVE = os.environ.get("KVSERVE_BIN", os.path.join(ROOT, "build", "kvserve"))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def run(*args, timeout=120):
    return subprocess.run([KVSERVE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_greedy_generation_matches_the_oracle_continuation():
    # golden.json holds the numpy oracle's greedy continuation of each prompt; chat prompts are
    # exactly encode(text) (text prompts are truncated to a token count, so they cannot be
    # passed as text).
    with open(os.path.join(ROOT, "tests/data/golden/golden.json")) as f:
        g = json.load(f)
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import tokenizer_ref  # the oracle tokenizer (HF `tokenizers` built from the GGUF)
    tok = tokenizer_ref.load_tokenizer(MODEL)
    checked = 0
    for p in g["prompts"]:
        if p["kind"] != "chat":
            continue
        if tok.encode(p["text"]).ids != p["tokens"]:
            continue
        r = run("generate", "-m", MODEL, "-p", p["text"], "-n", "32")
        assert r.returncode == 0, r.stderr
        want = tok.decode(p["greedy"])
        assert r.stdout.rstrip("\n") == want
        checked += 1
    assert checked >= 1


def test_sampling_is_reproducible_with_a_seed():
    args = ["generate", "-m", MODEL, "-p", "Once upon a time", "-n", "24", "--temp", "0.9", "--top-p", "0.95"]
    a = run(*args, "--seed", "7")
    b = run(*args, "--seed", "7")
    c = run(*args, "--seed", "8")
    assert a.returncode == 0 and b.returncode == 0 and c.returncode == 0
    assert a.stdout == b.stdout
    assert a.stdout != c.stdout
    # No seed: a fresh one each run (as llama.cpp), printed so that the run can be repeated.
    d = run(*args)
    seed = d.stderr.split("seed: ")[1].split()[0]
    assert run(*args, "--seed", seed).stdout == d.stdout
    assert run(*args).stdout != d.stdout


def test_seeds_outside_64_bits_are_refused():
    """-5 wrapped to 2^64 - 5 and 2^64 became -1 (a random seed), silently: now a usage error."""
    for bad in ["-5", "18446744073709551616", "1.5", "abc"]:
        r = run("generate", "-m", MODEL, "-p", "Hi", "-n", "1", "--seed", bad)
        assert r.returncode != 0 and "--seed: must be -1 (a random seed) or an integer in [0, 18446744073709551615]" in r.stderr, (bad, r.stderr)
    r = run("bench", "-m", MODEL, "--seed", "-1")
    assert r.returncode != 0 and "--seed: must be an integer in [0, 18446744073709551615], got -1" in r.stderr
    # a random seed is one the server and the Python API take back (they stop at 2^63 - 1)
    for _ in range(6):
        seed = int(run("generate", "-m", MODEL, "-p", "Hi", "-n", "1", "--temp", "1").stderr.split("seed: ")[1].split()[0])
        assert 0 <= seed < 2**63
    # the largest seed is a seed (it was -1's random one): two runs agree
    args = ["generate", "-m", MODEL, "-p", "Once upon a time", "-n", "8", "--temp", "1.0", "--seed", "18446744073709551615"]
    assert run(*args).stdout == run(*args).stdout


def test_missing_model_says_how_to_fetch_it(tmp_path):
    r = run("generate", "-m", str(tmp_path / "nope.gguf"), "-p", "hi")
    assert r.returncode != 0
    assert "not found" in r.stderr


def test_corrupt_model_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.gguf"
    with open(MODEL, "rb") as f:
        bad.write_bytes(f.read(200_000))
    r = run("generate", "-m", str(bad), "-p", "hi")
    assert r.returncode != 0
    assert r.stderr.strip().count("\n") == 0  # one line
    assert "error:" in r.stderr


def patched_model(tmp_path, name: str, patch) -> str:
    """A copy of the model with bytes changed in place (metadata or a tensor's shape)."""
    data = bytearray(open(MODEL, "rb").read())
    patch(data)
    out = tmp_path / name
    out.write_bytes(bytes(data))
    return str(out)


def test_unusable_metadata_and_shapes_are_refused_at_load(tmp_path):
    import struct

    def nan_eps(data):
        key = b"llama.attention.layer_norm_rms_epsilon"
        at = data.index(key) + len(key)
        assert struct.unpack_from("<I", data, at)[0] == 6  # GGUF float32
        struct.pack_into("<f", data, at + 4, float("nan"))

    def short_embedding(data):
        # tensor info: name, n_dims (u32), ne[] (u64 each), type, offset. 49,152 rows become 49,000.
        key = b"token_embd.weight"
        at = data.index(key) + len(key)
        assert struct.unpack_from("<I", data, at)[0] == 2
        assert struct.unpack_from("<Q", data, at + 12)[0] == 49152
        struct.pack_into("<Q", data, at + 12, 49000)

    for name, patch, words in (("nan_eps.gguf", nan_eps, "layer_norm_rms_epsilon is nan, not in (0, 1]"),
                               ("short_embd.gguf", short_embedding, "token_embd.weight has 49000 rows but the vocabulary has 49152 tokens")):
        path = patched_model(tmp_path, name, patch)
        r = run("generate", "-m", path, "-p", "hi", "-n", "2", timeout=60)
        assert r.returncode != 0 and words in r.stderr, r.stderr[-2000:]
        os.remove(path)


def test_prompt_longer_than_the_context_is_refused():
    r = run("generate", "-m", MODEL, "-p", "word " * 200, "--ctx", "64")
    assert r.returncode != 0
    assert "context" in r.stderr


def test_bad_flags_exit_nonzero():
    assert run("generate", "-m", MODEL, "-p", "x", "--temp", "-1").returncode != 0
    assert run("generate", "-m", MODEL).returncode != 0  # -p is required
    assert run("frobnicate").returncode != 0


def test_empty_text_flags_are_refused_at_start():
    # --api-key "$KEY" with KEY unset started a server that answered every request 401 (a
    # black-box test); an unnamed model answered to "" alone.
    for cmd in (["serve", "-m", MODEL], ["router", "-m", MODEL, "--replica", "http://127.0.0.1:9"]):
        for flag in ("--api-key", "--served-model-name"):
            r = run(*cmd, flag, "", timeout=10)
            assert r.returncode != 0 and f"{flag}: must not be empty" in r.stderr, (cmd, flag, r.stderr)


def test_bad_allowed_origins_and_redis_addresses_are_refused_at_start():
    # `--allowed-origins garbage` and `--kv-redis notaurl` started a server (the first allowed no
    # page, the second failed every tier lookup; a black-box test). Now each is one line and exit
    # code 105 (CLI11's validation error) before the weights load. An origin is what a browser's
    # Origin header can hold, since CORS compares them exactly: "*" or scheme://host[:port].
    import socket
    serve, router = ["serve", "-m", MODEL], ["router", "-m", MODEL, "--replica", "http://127.0.0.1:9"]
    for origins, words in (("garbage", "'garbage' is not an origin: want * or scheme://host[:port]"),
                           ('["localhost:3000"]', "'localhost:3000' is not an origin"),
                           ("http://localhost:3000/", "no trailing slash (a browser's Origin has none): http://localhost:3000"),
                           ("https://example.com/app", "an origin has no path"),
                           ("ftp://example.com", "the scheme must be http or https"),
                           ("http://Example.com", "the host in lower case"),
                           ("http://localhost:80", "leaves the default port out of its Origin; write http://localhost"),
                           ("http://localhost:99999", "the port must be a number in [1, 65535]"),
                           ("*, http://a b", "'http://a b' is not an origin")):
        for cmd in (serve, router):
            r = run(*cmd, "--allowed-origins", origins, timeout=30)
            assert r.returncode == 105 and r.stderr.startswith("--allowed-origins: ") and words in r.stderr, (cmd, origins, r.stderr)
            assert "loading weights" not in r.stderr and len(r.stderr.strip().splitlines()) <= 2, r.stderr
    for addr, words in (("notaurl", "'notaurl' is not a Redis address; want redis://HOST[:PORT] (port 6379 by default) or HOST:PORT"),
                        ("redis://not a host:6379", "the host must be a host name or an IPv4 address"),
                        ("127.0.0.1:6379,nope", "'nope' is not a Redis address"),
                        (",", "no address"),
                        ("http://127.0.0.1:6379", "http:// is not a plain Redis address")):
        r = run(*serve, "--kv-redis", addr, timeout=30)
        assert r.returncode == 105 and r.stderr.startswith("--kv-redis: ") and words in r.stderr, (addr, r.returncode, r.stderr)
        assert "loading weights" not in r.stderr, r.stderr
    # What can match (and the forms the Redis tier parses) passes the checks: the start then stops
    # at the port in use, still before the weights.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = str(taken.getsockname()[1])
        for flags in (["--allowed-origins", '["*", "http://localhost:3000", "https://[::1]:8443", "http://127.0.0.1"]'],
                      ["--allowed-origins", "https://example.com, http://a-b.example.org:8080"],
                      ["--kv-redis", "redis://127.0.0.1:6379", "--kv-redis", "localhost:6380,redis://localhost,redis://h:1/"]):
            r = run(*serve, "--host", "127.0.0.1", "--port", port, *flags, timeout=30)
            assert r.returncode != 0 and "cannot listen on 127.0.0.1:" + port in r.stderr, (flags, r.stderr)


def test_version_and_an_unknown_command():
    r = run("--version", timeout=10)
    assert r.returncode == 0 and r.stdout.startswith("kvserve git ") and "kernels for this CPU" in r.stdout, r
    r = run("frobnicate", timeout=10)
    assert r.returncode != 0 and "no command 'frobnicate'" in r.stderr and "serve" in r.stderr, r.stderr


def test_what_needs_no_model_fails_before_the_weights_load():
    # A KV dtype or budget that cannot parse used to fail only after the weights had loaded.
    for cmd in (["generate", "-m", MODEL, "-p", "hi", "-n", "2"], ["bench", "-m", MODEL, "-p", "8", "-n", "2", "-r", "1"]):
        r = run(*cmd, "--kv-cache-dtype", "q4_0", timeout=30)
        assert r.returncode != 0 and "llama.cpp's q4_0 is a different format" in r.stderr, r.stderr
        assert "loading weights" not in r.stderr
        r = run(*cmd, "--kv-cache-memory", "3XB", timeout=30)
        assert r.returncode != 0 and "cannot read memory size '3XB'" in r.stderr and "loading weights" not in r.stderr, r.stderr
        # 1.5 is a fraction of RAM over the whole; 2TiB reads (and is more than this machine has)
        r = run(*cmd, "--kv-cache-memory", "1.5", timeout=30)
        assert r.returncode != 0 and "more than all of it" in r.stderr and "loading weights" not in r.stderr, r.stderr
        r = run(*cmd, "--kv-cache-memory", "2TiB", timeout=30)
        assert r.returncode != 0 and "is more than the memory available" in r.stderr, r.stderr
    # kv-size takes the engine's names, no more (it took q4, which generate refused).
    assert run("kv-size", "--preset", "llama-2-7b", "--kv-cache-dtype", "q4", timeout=10).returncode != 0
    assert run("kv-size", "--preset", "llama-2-7b", "--kv-cache-dtype", "FP16", timeout=10).returncode == 0


def test_policy_flags_without_a_policy_are_refused():
    # They were ignored: --kv-budget 512 alone ran with the whole cache and said nothing.
    cases = ((["--kv-budget", "512"], "--kv-budget needs --kv-eviction POLICY"),
             (["--kv-sink-tokens", "8"], "--kv-sink-tokens and --kv-recent-tokens need --kv-eviction POLICY or --kv-sparse quest"),
             (["--kv-obs-window", "8", "--kv-eviction", "none"], "--kv-obs-window needs --kv-eviction snapkv"))
    for flags, words in cases:
        r = run("generate", "-m", MODEL, "-p", "hi", "-n", "2", *flags, timeout=60)
        assert r.returncode != 0 and words in r.stderr, r.stderr[-1000:]
    # Quest reads its sink and recent pages: there they mean something.
    r = run("generate", "-m", MODEL, "-p", "hi", "-n", "2", "--kv-sparse", "quest", "--kv-sparse-pages", "4",
            "--kv-sink-tokens", "16", timeout=60)
    assert r.returncode == 0, r.stderr[-1000:]


def test_non_finite_sampling_flags_are_refused():
    # CLI11's ranges let NaN through: `--min-p nan` hung the sampler, `--temp nan --top-p 0.9`
    # crashed it. Each is now a message and exit code 105 (CLI11's validation error), in a moment.
    for cmd in (["generate", "-m", MODEL, "-p", "hi", "-n", "2"], ["bench", "-m", MODEL, "-p", "8", "-n", "2", "-b", "2", "-r", "1"]):
        for flags in (["--temp", "1", "--min-p", "nan"], ["--temp", "nan", "--top-p", "0.9"], ["--top-p", "inf"], ["--temp", "1e400"]):
            r = run(*cmd, *flags, timeout=30)
            assert r.returncode == 105 and "not a finite number" in r.stderr, (cmd, flags, r.returncode, r.stderr)
    r = run("perplexity", "-m", MODEL, "--chunks", "0", timeout=30)
    assert r.returncode != 0 and "--chunks: 0 is not in (0, " in r.stderr, r.stderr


def test_bench_json_has_the_fields():
    r = run("bench", "-m", MODEL, "--prompt-tokens", "64", "--gen-tokens", "8", "--repeat", "1", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    for k in ("prefill_tok_s", "prefill_tok_s_min", "prefill_tok_s_max", "decode_tok_s", "decode_tok_s_min",
              "decode_tok_s_max", "decode_effective_gb_s"):
        assert j[k] > 0, k


def test_bench_measures_the_read_loop_beside_each_decode_repeat():
    # On a VM whose read bandwidth moves between ~40 and ~78 GB/s from minute to minute, one
    # read loop after the run said little about the repeats; each repeat is now paired with a
    # read loop run just before it, and the fraction is the median of the pairs'.
    r = run("bench", "-m", MODEL, "-p", "0", "-n", "8", "--repeat", "3", "--measure-bandwidth",
            "--bandwidth-mib", "64", "--bandwidth-passes", "3", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    pairs = j["decode_bandwidth_pairs"]
    assert len(pairs) == 3
    gb_per_token = j["decode_bytes_per_token"] / 1e9
    for p in pairs:
        assert p["read_gb_s"] > 0 and p["decode_tok_s"] > 0
        assert abs(p["fraction"] - gb_per_token * p["decode_tok_s"] / p["read_gb_s"]) < 1e-9
    assert sorted(p["decode_tok_s"] for p in pairs) == sorted([j["decode_tok_s_min"], j["decode_tok_s"], j["decode_tok_s_max"]])
    assert j["decode_bandwidth_fraction"] == sorted(p["fraction"] for p in pairs)[1]
    assert len(j["machine_bandwidth"]["passes"]) == 3 and j["machine_read_gb_s"] > 0
    assert abs(j["decode_bandwidth_fraction_after"] - j["decode_effective_gb_s"] / j["machine_read_gb_s"]) < 1e-9


def test_bench_batch_runs_the_engine_and_profiles_its_steps():
    # 4 sequences decode together through the engine with sampling; the JSON reports the
    # aggregate rate and where each step's time went (shares of the decode steps, summing to 1).
    r = run("bench", "-m", MODEL, "--batch", "4", "-p", "16", "-n", "12", "--repeat", "1", "--temp", "0.7",
            "--top-p", "0.95", "--json")
    assert r.returncode == 0, r.stderr
    j = json.loads(r.stdout)
    assert j["mode"] == "batch" and j["batch"] == 4 and j["gen_tokens"] == 12
    assert j["sampling"]["temperature"] > 0.69 and j["sampling"]["top_p"] > 0.94
    assert j["decode_tok_s"] > 0 and j["decode_tok_s_per_sequence"] * 4 == j["decode_tok_s"]
    phases = j["step_phase_share"]
    assert set(phases) == {"schedule", "forward_matmul", "forward_attention", "forward_logits", "sample", "postprocess"}
    assert abs(sum(phases.values()) - 1) < 1e-6
    assert phases["forward_matmul"] > 0 and phases["sample"] > 0
    # Prompts longer than a step's token budget: the first sequences decode while the last ones
    # still prefill. The decode window starts once every prompt is computed (it used to start
    # after n_seq tokens in all, then failed "expected more"). -d adds context to each prompt
    # (it used to be ignored with --batch).
    long = run("bench", "-m", MODEL, "--batch", "4", "-p", "8", "-d", "32", "-n", "6", "--chunk", "32", "--repeat", "1",
               "--temp", "0.7", "--json")
    assert long.returncode == 0, long.stderr
    jl = json.loads(long.stdout)
    assert jl["decode_tok_s"] > 0 and jl["context"] == 32 and jl["prompt_tokens"] == 40
    # A pool too small for the batch is a clear error, not a crash.
    bad = run("bench", "-m", MODEL, "--batch", "64", "-p", "512", "-n", "512", "--kv-cache-memory", "8MiB", "--json")
    assert bad.returncode != 0 and "does not hold" in bad.stderr


def test_a_kv_budget_beyond_the_machines_memory_is_refused():
    # The pool is allocated whole at start: 30GiB threw an uncaught bad_alloc (abort), 1.0 (all
    # of RAM) the same, 0.99 was OOM-killed. Now a message naming the memory available, exit 1.
    for budget in ("200GiB", "1.0"):
        r = run("generate", "-m", MODEL, "-p", "Hi", "-n", "2", "--kv-cache-memory", budget, timeout=60)
        assert r.returncode == 1 and "more than the memory available" in r.stderr, (budget, r.returncode, r.stderr)


def test_generate_offloads_cold_pages_and_gives_quests_text():
    # `generate --kv-offload-cold` always failed ("cold pages need a cold store"): generate never
    # made one. Cold pages come back bit for bit, so the text is Quest's without offloading.
    prompt = "The quick brown fox jumps over the lazy dog. " * 12
    quest = ["-p", prompt, "-n", "24", "--temp", "0", "--kv-sparse", "quest", "--kv-sparse-pages", "2"]
    cold = run("generate", "-m", MODEL, *quest, "--kv-offload-cold", "--kv-budget", "112")
    warm = run("generate", "-m", MODEL, *quest)
    assert cold.returncode == 0 and warm.returncode == 0, cold.stderr
    assert "cold pages to disk beyond 112 tokens" in cold.stderr
    assert cold.stdout == warm.stdout and cold.stdout.strip()


def test_a_budget_the_quantized_layers_staging_fills_says_so_and_the_start_line_adds_up():
    # int8 pages fill in f16 staging tiles held apart from the pages (41 MiB at the defaults for
    # SmolLM2): 12 MiB was refused as "holds no page (one page is 208 KiB)", and at 48 MiB the start
    # line said "47.89 MiB int8, 35 pages" where 35 pages are 7 MiB.
    r = run("serve", "-m", MODEL, "--kv-cache-memory", "12MiB", "--kv-cache-dtype", "int8", "--port", "65432", timeout=60)
    assert r.returncode == 1 and "staging" in r.stderr and "--max-num-seqs" in r.stderr, r.stderr[-600:]
    p = subprocess.Popen([KVSERVE, "serve", "-m", MODEL, "--kv-cache-memory", "12MiB", "--kv-cache-dtype", "int8",
                          "--max-num-seqs", "4", "--max-n", "1", "--max-num-batched-tokens", "64", "--port", "65431"],
                         stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, cwd=ROOT)
    try:
        line = next(l for l in p.stderr if l.startswith("KV cache:") or l.startswith("error"))
    finally:
        p.kill()
        p.wait()
    m = re.match(r"KV cache: ([\d.]+) MiB int8, (\d+) pages of 16 tokens .*\(([\d.]+) KiB per token\) \+ ([\d.]+) MiB f16 staging", line)
    assert m, line
    pages_mib, n_pages, per_token_kib, staging_mib = float(m[1]), int(m[2]), float(m[3]), float(m[4])
    assert abs(pages_mib - n_pages * 16 * per_token_kib / 1024) < 0.02, line
    assert pages_mib + staging_mib <= 12.0 + 0.01 and n_pages > 30, line


def test_a_budget_the_window_layers_fill_is_refused_at_start():
    # Gemma 3's sliding-window layers take ~16 MiB first; with 8 MiB `serve` once started with 0
    # global pages and refused every request. Both serve and generate now say why, at start.
    gemma = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")
    for cmd in (["serve", "--port", "65432"], ["generate", "-p", "Hi"]):
        r = run(cmd[0], "-m", gemma, "--kv-cache-memory", "8MiB", *cmd[1:], timeout=60)
        assert r.returncode == 1, (cmd, r.returncode, r.stderr[-500:])
        assert "holds no page" in r.stderr and "the sliding-window layers take" in r.stderr, r.stderr[-500:]


def test_cli_values_the_server_refuses_are_refused_and_a_long_bench_warns(tmp_path):
    # generate took --top-p 0 and decoded greedily (the server and Python refuse top_p 0); perplexity
    # gave a number for a binary file; the router took one backend twice (twice its share); bench
    # ran past the trained context without the warning serve gives.
    r = run("generate", "-m", MODEL, "-p", "hi", "-n", "2", "--top-p", "0", "--temp", "1", timeout=30)
    assert r.returncode != 0 and "--top-p must be more than 0" in r.stderr, r.stderr
    binary = tmp_path / "bytes.bin"
    binary.write_bytes(bytes(range(256)) * 8)
    r = run("perplexity", "-m", MODEL, "-f", str(binary), timeout=30)
    assert r.returncode != 0 and "is not UTF-8 text" in r.stderr, r.stderr
    r = run("router", "--replica", "http://127.0.0.1:9", "--replica", "http://127.0.0.1:9", "--listen", "127.0.0.1:65430", timeout=30)
    assert r.returncode != 0 and "is given twice" in r.stderr, r.stderr
    r = run("bench", "-m", MODEL, "-p", "8190", "-n", "4", "-r", "1", "--kv-cache-memory", "1GiB", timeout=120)
    assert r.returncode == 0 and "past the 8192 this model was trained on" in r.stderr, r.stderr[-500:]


def test_min_tokens_holds_off_the_end_of_text():
    # vLLM's min_tokens as a flag: the greedy answer to "Say OK." ends after a few tokens; with
    # --min-tokens 20 it goes on past them, the same text first, on both paths (the sequence
    # runner, and the engine's under --speculative-config); more than -n is refused.
    prompt = "<|im_start|>user\nSay OK.<|im_end|>\n<|im_start|>assistant\n"
    free = run("generate", "-m", MODEL, "-p", prompt, "-n", "40")
    assert free.returncode == 0, free.stderr
    n_free = int(re.search(r"generated: (\d+) tokens", free.stderr).group(1))
    assert n_free < 20
    held = run("generate", "-m", MODEL, "-p", prompt, "-n", "40", "--min-tokens", "20")
    assert held.returncode == 0, held.stderr
    assert int(re.search(r"generated: (\d+) tokens", held.stderr).group(1)) >= 20
    assert held.stdout.startswith(free.stdout.rstrip("\n")) and len(held.stdout) > len(free.stdout)
    spec = run("generate", "-m", MODEL, "-p", prompt, "-n", "40", "--min-tokens", "20", "--speculative-config", '{"method": "ngram"}')
    assert spec.returncode == 0 and spec.stdout == held.stdout, spec.stderr
    r = run("generate", "-m", MODEL, "-p", "hi", "-n", "4", "--min-tokens", "5", timeout=30)
    assert r.returncode != 0 and "--min-tokens 5 is more than -n 4" in r.stderr, r.stderr
