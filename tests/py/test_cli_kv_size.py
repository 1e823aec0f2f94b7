"""`kvserve kv-size` against the real binary (build/kvserve): presets, the local models, small
GGUFs written here with the gguf package (MLA, per-layer kv heads, explicit window pattern),
and the error cases."""
import json
import os
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVSERVE = os.environ.get("KVSERVE_BIN", os.path.join(ROOT, "build", "kvserve"))
SMOL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
GEMMA = os.path.join(ROOT, "models", "gemma-3-270m-Q4_K_M.gguf")
GiB = 1 << 30


def run(*args):
    if not os.path.exists(KVSERVE):
        pytest.fail(f"{KVSERVE} is missing: run `make build`")
    return subprocess.run([KVSERVE, "kv-size", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def kv_json(*args):
    r = run(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def model(path):
    if not os.path.exists(path):
        pytest.fail(f"{path} is missing: run `make models`")
    return path


def test_llama2_70b_mha_worked_example():
    # 2 (K,V) x 80 layers x 64 kv heads x 128 x 2 bytes x 4096 tokens = 10 GiB exactly.
    # One of the seeds prints half of this (it drops the K+V factor 2); the tool must not.
    j = kv_json("--preset", "llama-2-70b", "--seq-len", "4096", "--kv-cache-dtype", "f16")
    assert j["total"]["bytes_per_sequence"] == 10_737_418_240 == 10 * GiB
    assert j["total"]["bytes_per_token"] == 2_621_440
    assert j["groups"][0]["bytes_per_token_per_layer"] == 32768
    assert j["attention"]["variant"] == "MHA"
    assert j["attention"]["group_size"] == 1
    assert j["dtype"] == "f16" and j["bytes_per_element"] == 2
    assert "binary" in j["units"]


def test_human_output_has_units():
    r = run("--preset", "llama-2-70b", "--seq-len", "4096", "--kv-cache-dtype", "f16")
    assert r.returncode == 0, r.stderr
    assert "10,737,418,240 bytes (10.00 GiB)" in r.stdout
    assert "MHA" in r.stdout
    assert "1 GiB = 1024^3" in r.stdout


def test_gqa_is_one_eighth():
    mha = kv_json("--preset", "llama-2-70b", "--seq-len", "4096")["total"]["bytes_per_sequence"]
    for name in ("llama-2-70b-gqa", "llama-3-70b"):
        j = kv_json("--preset", name, "--seq-len", "4096")
        assert j["total"]["bytes_per_sequence"] * 8 == mha
        assert j["attention"] == {**j["attention"], "variant": "GQA", "group_size": 8}


def test_7b_mha():
    j = kv_json("--preset", "7b-mha", "--seq-len", "4096")
    assert j["total"]["bytes_per_token"] == 524_288
    assert j["total"]["bytes_per_sequence"] == 2 * GiB


def test_deepseek_v2_mla():
    j = kv_json("--preset", "deepseek-v2", "--seq-len", "4096")
    assert j["attention"]["variant"] == "MLA"
    g = j["groups"][0]
    assert g["kind"] == "latent" and g["values_per_token_per_layer"] == 576
    assert j["total"]["bytes_per_token"] == 60 * 576 * 2
    assert j["total"]["bytes_per_sequence"] == 60 * 576 * 2 * 4096


def test_gemma3_27b_hybrid_32k():
    j = kv_json("--preset", "gemma-3-27b", "--seq-len", "32768")
    assert j["attention"]["variant"] == "hybrid"
    groups = {g["kind"]: g for g in j["groups"]}
    assert groups["global"]["n_layers"] == 10 and groups["local"]["n_layers"] == 52
    assert groups["local"]["window"] == 1024 and groups["local"]["tokens_kept"] == 1024
    per_layer_token = 2 * 16 * 128 * 2
    assert j["total"]["bytes_per_sequence"] == per_layer_token * (10 * 32768 + 52 * 1024)


def test_batch_and_dtypes():
    base = kv_json("--preset", "llama-3-70b", "--seq-len", "4096", "--kv-cache-dtype", "int8")
    half = kv_json("--preset", "llama-3-70b", "--seq-len", "4096", "--kv-cache-dtype", "int4")
    assert half["total"]["bytes_per_sequence"] * 2 == base["total"]["bytes_per_sequence"]
    assert any("scales" in n for n in half["notes"]) and half["scales_included"] is False
    b8 = kv_json("--preset", "llama-3-70b", "--seq-len", "4096", "--batch", "8")
    assert b8["total"]["bytes_per_batch"] == 8 * b8["total"]["bytes_per_sequence"]
    f32 = kv_json("--preset", "llama-3-70b", "--seq-len", "4096", "--kv-cache-dtype", "f32")
    assert f32["total"]["bytes_per_sequence"] == 4 * base["total"]["bytes_per_sequence"]
    scaled = kv_json("--preset", "llama-3-70b", "--seq-len", "1", "--kv-cache-dtype", "int8", "--scale-group", "32")
    assert scaled["scales_included"] is True
    assert scaled["total"]["bytes_per_token"] == 80 * 8 * 256 + 80 * 8 * 2 * 4 * 2


def test_preset_list():
    r = run("--preset", "list")
    assert r.returncode == 0, r.stderr
    for name in ("llama-2-70b", "llama-3-70b", "llama-2-7b", "deepseek-v2", "gemma-3-27b", "smollm2-135m", "gemma-3-270m"):
        assert name in r.stdout


def test_smollm2_gguf():
    j = kv_json("-m", model(SMOL), "--seq-len", "4096")
    assert j["source"] == "gguf"
    assert j["attention"]["variant"] == "GQA" and j["attention"]["group_size"] == 3
    assert j["total"]["bytes_per_token"] == 23_040
    assert j["total"]["bytes_per_sequence"] == 23_040 * 4096
    assert j["total"] == kv_json("--preset", "smollm2-135m", "--seq-len", "4096")["total"]


def test_gemma3_270m_gguf():
    j = kv_json("-m", model(GEMMA), "--seq-len", "32768")
    assert j["attention"]["variant"] == "hybrid"
    groups = {g["kind"]: g for g in j["groups"]}
    assert groups["global"]["n_layers"] == 3
    assert groups["local"]["n_layers"] == 15 and groups["local"]["window"] == 512
    assert groups["local"]["n_head_kv"] == 1 and groups["local"]["k_dim"] == 256
    assert j["total"]["bytes_per_sequence"] == 1024 * (3 * 32768 + 15 * 512)
    assert j["total"] == kv_json("--preset", "gemma-3-270m", "--seq-len", "32768")["total"]


def write_gguf(path, arch, fill):
    gguf = pytest.importorskip("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    fill(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return str(path)


def test_deepseek2_gguf(tmp_path):
    def fill(w):
        w.add_block_count(4)
        w.add_embedding_length(256)
        w.add_head_count(8)
        w.add_head_count_kv(8)
        w.add_kv_lora_rank(64)
        w.add_rope_dimension_count(16)
        w.add_key_length(64 + 16)
        w.add_value_length(64)
    j = kv_json("-m", write_gguf(tmp_path / "ds.gguf", "deepseek2", fill), "--seq-len", "100")
    assert j["attention"]["variant"] == "MLA"
    assert j["groups"][0]["values_per_token_per_layer"] == 80
    assert j["total"]["bytes_per_sequence"] == 4 * 80 * 2 * 100


def test_per_layer_kv_heads_and_pattern(tmp_path):
    def fill(w):
        w.add_block_count(4)
        w.add_embedding_length(256)
        w.add_head_count(8)
        w.add_head_count_kv([2, 4, 2, 4])
        w.add_key_length(32)
        w.add_value_length(16)  # K and V head dims differ
        w.add_sliding_window(10)
        w.add_sliding_window_pattern([True, False, True, False])
    j = kv_json("-m", write_gguf(tmp_path / "mix.gguf", "gemma2", fill), "--seq-len", "100")
    groups = {g["kind"]: g for g in j["groups"]}
    assert groups["local"]["n_head_kv"] == 2 and groups["global"]["n_head_kv"] == 4
    assert groups["local"]["values_per_token_per_layer"] == 2 * (32 + 16)
    assert j["total"]["bytes_per_sequence"] == 2 * 2 * 48 * 2 * 10 + 2 * 4 * 48 * 2 * 100


@pytest.mark.parametrize("args, needle", [
    (["--preset", "llama-9000b"], "unknown preset"),
    (["-m", "/nonexistent/model.gguf"], "not found"),
    (["-m", "README.md"], "GGUF"),
    (["--preset", "llama-2-7b", "--kv-cache-dtype", "q3"], "dtype"),
    (["--preset", "llama-2-7b", "--seq-len", "0"], "seq-len"),
    ([], "--preset"),
])
def test_errors(args, needle):
    r = run(*args)
    assert r.returncode == 1
    assert needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""


def test_missing_metadata(tmp_path):
    def fill(w):
        w.add_head_count(8)
    r = run("-m", write_gguf(tmp_path / "bad.gguf", "llama", fill))
    assert r.returncode == 1
    assert "llama.block_count" in r.stderr


def test_parse_error_is_nonzero():
    assert run("--preset", "llama-2-7b", "--seq-len", "abc").returncode != 0
    assert run("--preset", "llama-2-7b", "-m", SMOL).returncode != 0
