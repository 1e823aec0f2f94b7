"""`kvserve inspect` against the real binary (build/kvserve) and the real models."""
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVSERVE = os.environ.get("KVSERVE_BIN", os.path.join(ROOT, "build", "kvserve"))
SMOL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")


def run(*args, cwd=ROOT):
    if not os.path.exists(KVSERVE):
        pytest.fail(f"{KVSERVE} is missing: run `make build`")
    return subprocess.run([KVSERVE, "inspect", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def model(path):
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: run `make models`")
    return path


def inspect_json(path):
    r = run("-m", path, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_smollm2_json():
    j = inspect_json(model(SMOL))
    assert j["architecture"] == "llama"
    assert j["gguf_version"] == 3
    hp = j["hparams"]
    assert hp["n_layer"] == 30
    assert hp["n_embd"] == 576
    assert hp["n_ff"] == 1536
    assert hp["n_head"] == 9
    assert hp["n_head_kv"] == 3
    assert hp["head_dim"] == 64
    assert hp["context_length"] == 8192
    assert hp["rope_freq_base"] == pytest.approx(100000.0)
    assert hp["rms_eps"] == pytest.approx(1e-5)
    assert hp["sliding_window"] is None
    assert j["attention"] == {"variant": "GQA", "group_size": 3}
    kvb = j["kv_bytes_per_token"]
    assert kvb["f16"] == 2 * 30 * 3 * 64 * 2 == 23040
    assert kvb["bf16"] == 23040
    assert kvb["f32"] == 46080
    assert kvb["int8"] == kvb["fp8"] == 11520
    assert kvb["int4"] == 5760
    # kvserve's pages of 16, metadata included: per head and layer, K 1024 codes + 4 (tile scale)
    # + 64·2 (f16 zero per channel) = 1156 and V 1024 + 4 = 1028 → 30 · 3 · 2184 / 16
    pb = j["kv_page_bytes_per_token"]
    assert pb["fp8_e4m3"] == pb["fp8_e5m2"] == 30 * 3 * (1156 + 1028) / 16 == 12285
    assert pb["int8"] == 30 * 3 * (1024 + 64 * 4 + 1024 + 16 * 4) / 16 == 13320
    assert pb["f16"] == 23040
    t = j["tensors"]
    assert t["count"] == 272
    assert t["by_type"]["Q8_0"]["count"] == 1
    assert t["by_type"]["Q8_0"]["bytes"] == 576 // 32 * 34 * 49152
    assert t["by_type"]["Q4_1"]["count"] == 210
    assert t["by_type"]["F32"]["count"] == 61
    assert t["total_bytes"] == sum(e["bytes"] for e in t["by_type"].values())
    assert t["total_bytes"] < j["file_size"]
    assert j["file_type"] == "Q4_1"
    assert j["tokenizer"] == {"model": "gpt2", "pre": "smollm", "vocab_size": 49152}
    assert j["chat_template"] == {"present": True, "length": 368}


def test_gemma3_json():
    j = inspect_json(model(GEMMA))
    assert j["architecture"] == "gemma3"
    hp = j["hparams"]
    assert hp["n_layer"] == 18
    assert hp["n_head"] == 4
    assert hp["n_head_kv"] == 1
    assert hp["head_dim"] == 256  # key_length, not n_embd / n_head = 160
    assert hp["sliding_window"] == 512
    assert j["attention"]["variant"] == "MQA"
    assert j["kv_bytes_per_token"]["f16"] == 2 * 18 * 1 * 256 * 2
    assert j["tokenizer"]["model"] == "llama"
    assert j["tokenizer"]["vocab_size"] == 262144
    assert j["file_type"] == "Q4_K_M"
    assert j["chat_template"]["present"] is False


def test_text_output_default_model():
    model(SMOL)
    r = run()  # default path, relative to the repository root
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "llama" in out
    assert "GQA (group size 3)" in out
    assert "f16=23040" in out
    assert "chat template   yes (368 chars)" in out


def one_line_error(r):
    assert r.returncode != 0
    assert r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    return lines[0]


@pytest.mark.parametrize("keep", [1000, 5_000_000, 50_000_000])
def test_truncated_model(tmp_path, keep):
    src = model(SMOL)
    dst = tmp_path / "cut.gguf"  # a name that does not itself say "truncated"
    with open(src, "rb") as f, open(dst, "wb") as g:
        g.write(f.read(keep))
    # The tmp path itself contains "truncated" (the test's name): judge only the message.
    line = one_line_error(run("-m", str(dst))).replace(str(dst), "")
    assert "truncated" in line or "past the end" in line, line


def test_garbage_file(tmp_path):
    p = tmp_path / "garbage.gguf"
    p.write_bytes(b"<html><body>404 not found</body></html>" * 10)
    line = one_line_error(run("-m", str(p), "--json"))
    assert "not a GGUF" in line


def test_missing_file(tmp_path):
    line = one_line_error(run("-m", str(tmp_path / "nope.gguf")))
    assert "not found" in line and "nope.gguf" in line


def test_missing_default_model_hints_make_models(tmp_path):
    # Run from an empty directory so the default relative path does not exist.
    line = one_line_error(run(cwd=tmp_path))
    assert "make models" in line
