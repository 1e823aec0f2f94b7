"""One binary for every x86-64 CPU (issue 17): KV_ISA forces a kernel build through the real
binary, `kvserve inspect` and the load log say which one runs, forcing more than the CPU has
falls back with a warning, and greedy text is the numpy oracle's on every path."""
import functools
import json
import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
KVSERVE = os.environ.get("KVSERVE_BIN", os.path.join(ROOT, "build", "kvserve"))
MODEL = os.path.join(ROOT, "models", "SmolLM2-135M-Instruct.Q4_1.gguf")
ISAS = ["scalar", "avx2", "avx512"]


def run(*args, isa=None, timeout=120):
    env = dict(os.environ)
    env.pop("KV_ISA", None)
    if isa is not None:
        env["KV_ISA"] = isa
    return subprocess.run([KVSERVE, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


@functools.lru_cache(maxsize=None)
def cpu_isas():
    r = run("inspect", "-m", MODEL, "--json")
    assert r.returncode == 0, r.stderr
    k = json.loads(r.stdout)["kernels"]
    assert k["cpu"][0] == "scalar" and k["isa"] == k["cpu"][-1]  # the best one by default
    return tuple(k["cpu"])


def test_inspect_names_the_kernels():
    cpu = cpu_isas()
    r = run("inspect", "-m", MODEL)
    assert r.returncode == 0, r.stderr
    line = next(l for l in r.stdout.splitlines() if l.startswith("kernels"))
    assert line.split()[1] == cpu[-1]
    for isa in cpu:
        r = run("inspect", "-m", MODEL, "--json", isa=isa)
        assert json.loads(r.stdout)["kernels"]["isa"] == isa
        assert "warning" not in r.stderr


def cpuinfo_flags():
    with open("/proc/cpuinfo") as f:
        line = next((l for l in f if l.startswith("flags")), "")
    return set(line.split(":", 1)[-1].split())


def linux_grants_amx():
    """arch_prctl(ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) from this process: Linux 5.16+ grants it."""
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    sys_arch_prctl, req_xcomp_perm, xtiledata = 158, 0x1023, 18  # x86-64
    return libc.syscall(sys_arch_prctl, req_xcomp_perm, xtiledata) == 0


def test_inspect_says_whether_batched_matmuls_use_amx():
    # The oracle is the kernel's own CPU report (AMX-INT8 tiles on an AVX-512 VNNI CPU) and
    # whether Linux lets a process use the tile state.
    flags = cpuinfo_flags()
    has = {"amx_tile", "amx_int8", "avx512_vnni"} <= flags and linux_grants_amx()
    r = run("inspect", "-m", MODEL, "--json")
    assert json.loads(r.stdout)["kernels"]["amx"] == has
    env = dict(os.environ, KV_AMX="0")
    r = subprocess.run([KVSERVE, "inspect", "-m", MODEL, "--json"], capture_output=True, text=True, env=env, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kernels"]["amx"] is False
    if has:  # below AVX-512 the matmul runs the AVX2 kernel, which has no AMX path
        assert json.loads(run("inspect", "-m", MODEL, "--json", isa="avx2").stdout)["kernels"]["amx"] is False


def test_forcing_an_isa_the_cpu_lacks_falls_back_with_a_warning():
    cpu = cpu_isas()
    for want in ["avx512", "sse9"]:
        if want in cpu:
            continue
        r = run("inspect", "-m", MODEL, "--json", isa=want)
        assert r.returncode == 0, r.stderr
        assert json.loads(r.stdout)["kernels"]["isa"] == cpu[-1]
        assert f"KV_ISA={want}" in r.stderr and "warning" in r.stderr
        assert r.stderr.count("warning") == 1


@functools.lru_cache(maxsize=None)
def oracle_chat_prompt():
    """The golden chat_single prompt (its text encodes to exactly its tokens) and the decoded text
    of the numpy oracle's first 16 greedy tokens."""
    with open(os.path.join(ROOT, "tests/data/golden/golden.json")) as f:
        g = json.load(f)
    p = next(p for p in g["prompts"] if p["name"] == "chat_single")
    import sys
    sys.path.insert(0, os.path.join(ROOT, "tests", "reference"))
    import tokenizer_ref  # the oracle tokenizer (HF `tokenizers` built from the GGUF)
    tok = tokenizer_ref.load_tokenizer(MODEL)
    assert tok.encode(p["text"]).ids == p["tokens"]
    return p["text"], tok.decode(p["greedy"][:16])


@pytest.mark.parametrize("isa", ISAS)
def test_greedy_text_is_the_oracles_on_every_isa(isa):
    """`generate` (greedy) under KV_ISA=isa: the load log names the kernels actually used, and the
    text is the oracle's. An ISA this CPU lacks runs the best it has, after a warning."""
    cpu = cpu_isas()
    text, want = oracle_chat_prompt()
    r = run("generate", "-m", MODEL, "-p", text, "-n", "16", isa=isa, timeout=300)
    assert r.returncode == 0, r.stderr
    used = isa if isa in cpu else cpu[-1]
    assert f"kernels: {used}," in r.stderr
    assert ("warning" in r.stderr) == (isa not in cpu)
    assert r.stdout.rstrip("\n") == want


@pytest.mark.skipif(shutil.which("qemu-x86_64") is None, reason="needs qemu-x86_64 (Debian qemu-user)")
def test_runs_on_a_cpu_without_avx():
    """Under QEMU's plain x86-64 CPU (qemu64: no AVX, no SSE4) the binary starts and picks the
    scalar kernels; a -march=native build dies there of SIGILL before main. (The kernel tests
    under the same CPU: ctest kernels_on_baseline_cpu.)"""
    r = subprocess.run(["qemu-x86_64", "-cpu", "qemu64", KVSERVE, "inspect", "-m", MODEL, "--json"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["kernels"] == {"isa": "scalar", "cpu": ["scalar"], "amx": False}
