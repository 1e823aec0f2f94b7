#!/usr/bin/env python3
"""One binary for every x86-64 CPU: checks the object files of a build (ctest `isa_objects`).

The library, the CLI and the Python module are compiled for the x86-64 baseline, except the
kernel files named *_avx2.cpp / *_avx512.cpp, which get that ISA's flags and run only after
kv::cpu_has said yes (src/kernels/isa.h). Two ways an AVX instruction can still reach a CPU
without AVX, and what this script checks against each, by disassembling every object:

1. A baseline object holds an AVX (or SSE3+, BMI, POPCNT ...) instruction: a -march flag crept
   back in, or an intrinsic outside the per-ISA files. Only the few functions that carry their
   own __attribute__((target)) behind a CPU check (ALLOWED_TARGET_FUNCTIONS) may.
2. An ISA object defines a weak (inline / template) function outside the per-ISA namespaces
   (kv::avx2, kv::avx512) whose code uses AVX: the linker keeps one copy of each weak symbol, and
   it may be that one, called from the scalar path.

Usage: check_isa_objects.py BUILD_DIR   (exit 0: clean; 1: violations, listed; 2: nothing found)
"""
import concurrent.futures
import os
import re
import subprocess
import sys

# Target directories (CMakeFiles/<target>.dir) whose objects end up in the shipped binaries.
TARGETS = ("kvserve_lib", "kvserve", "_kvserve")
ISA_OBJECT = re.compile(r"_(avx2|avx512)\.cpp\.o$")
ISA_NAMESPACE = re.compile(r"\bkv::(avx2|avx512)::")
# Functions compiled with a target attribute and called only after a CPU check (demangled
# qualified name; not templates, so the demangled form starts with it).
ALLOWED_TARGET_FUNCTIONS = {
    "kv::(anonymous namespace)::to_f16_f16c",  # src/kernels/kv_tile.cpp, behind kernel_isa()
    "kvtools::(anonymous namespace)::read_sum_avx512",  # tools/cmd_bench.cpp, behind cpu_supports("avx512f")
    "kvtools::(anonymous namespace)::read_sum_avx2",  # tools/cmd_bench.cpp, behind cpu_supports("avx2")
}
# Beyond the x86-64 baseline (SSE2) without a VEX prefix. (tzcnt is left out: GCC emits `rep
# bsf` for __builtin_ctz, which objdump prints as tzcnt and every x86-64 CPU runs as bsf.)
NON_BASELINE = {
    "popcnt", "lzcnt", "movbe", "crc32", "andn", "bextr", "blsi", "blsmsk", "blsr", "bzhi", "pdep", "pext",
    "mulx", "rorx", "sarx", "shlx", "shrx", "adcx", "adox", "pshufb", "palignr", "pmaddubsw", "pmulhrsw",
    "phaddd", "phaddw", "psignb", "psignw", "psignd", "pabsb", "pabsw", "pabsd", "pmulld", "pmuldq",
    "pminsb", "pminsd", "pminud", "pminuw", "pmaxsb", "pmaxsd", "pmaxud", "pmaxuw", "ptest", "blendps",
    "blendpd", "blendvps", "blendvpd", "pblendvb", "pblendw", "roundps", "roundpd", "roundss", "roundsd",
    "dpps", "dppd", "insertps", "extractps", "pextrb", "pextrd", "pextrq", "pinsrb", "pinsrd", "pinsrq",
    "pmovzxbw", "pmovzxbd", "pmovzxbq", "pmovzxwd", "pmovzxwq", "pmovzxdq", "pmovsxbw", "pmovsxbd",
    "pmovsxbq", "pmovsxwd", "pmovsxwq", "pmovsxdq", "packusdw", "pcmpeqq", "pcmpgtq", "mpsadbw",
    "phminposuw", "movntdqa", "pcmpestri", "pcmpestrm", "pcmpistri", "pcmpistrm", "haddps", "haddpd",
    "hsubps", "hsubpd", "addsubps", "addsubpd", "movddup", "movshdup", "movsldup", "lddqu",
}
HEADER = re.compile(r"^[0-9a-f]+ <(.*)>:$")
INSN = re.compile(r"^\s*[0-9a-f]+:\t(?:(?:lock|rep|repz|repnz|notrack|bnd|data16|addr32)\s+)*([a-z][a-z0-9.]*)\s*(.*)$")
# A cheap first pass over a whole disassembly: can it hold any instruction non_baseline flags?
SUSPECT = re.compile(r"\tv(?!err|erw)[a-z]|%[yz]mm|%k[0-7]\b|\t(?:" + "|".join(sorted(NON_BASELINE)) + r")\b")


def non_baseline(mnemonic, operands):
    if mnemonic.startswith("v") and mnemonic not in ("verr", "verw"):
        return True  # VEX / EVEX
    if re.search(r"%(ymm|zmm)\d|%k[0-7]\b", operands):
        return True
    return mnemonic in NON_BASELINE


def functions_using_isa(obj):
    """{mangled function: first non-baseline instruction} for the object's functions."""
    out = subprocess.run(["objdump", "-d", "-w", "--no-show-raw-insn", obj], capture_output=True, text=True,
                         check=True).stdout
    found, current = {}, None
    if not SUSPECT.search(out):
        return found
    for line in out.splitlines():
        m = HEADER.match(line)
        if m:
            current = m.group(1)
            continue
        if current in found:
            continue
        m = INSN.match(line)
        if m and current and non_baseline(m.group(1), m.group(2)):
            found[current] = f"{m.group(1)} {m.group(2)}".strip()
    return found


def weak_functions(obj):
    """Mangled names of the weak symbols the object defines."""
    out = subprocess.run(["nm", "--defined-only", obj], capture_output=True, text=True, check=True).stdout
    weak = set()
    for line in out.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[1] in ("W", "V", "u"):
            weak.add(parts[2])
    return weak


def demangle(names):
    names = list(names)
    if not names:
        return {}
    out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True, check=True).stdout
    return dict(zip(names, out.splitlines()))


def check(obj, build):
    """Violations of one object, as lines."""
    rel = os.path.relpath(obj, build)
    uses = functions_using_isa(obj)
    bad = []
    if ISA_OBJECT.search(obj):
        suspects = [fn for fn in weak_functions(obj) if fn in uses]
        for fn, name in sorted(demangle(suspects).items()):
            if not ISA_NAMESPACE.search(name):
                bad.append(f"{rel}: weak {name} uses `{uses[fn]}` outside kv::avx2 / kv::avx512 (ODR: the linker may "
                           "keep this copy for the baseline callers)")
    else:
        for fn, name in sorted(demangle(uses).items()):
            if not any(name.startswith(a + "(") for a in ALLOWED_TARGET_FUNCTIONS):
                bad.append(f"{rel}: {name} uses `{uses[fn]}` in a baseline object")
    return bad


def main():
    if len(sys.argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    build = sys.argv[1]
    objects = []
    for t in TARGETS:
        d = os.path.join(build, "CMakeFiles", f"{t}.dir")
        for root, _, files in os.walk(d):
            objects += [os.path.join(root, f) for f in files if f.endswith(".o")]
    if not any(ISA_OBJECT.search(o) for o in objects):
        print(f"no per-ISA objects under {build}/CMakeFiles/{{{','.join(TARGETS)}}}.dir: build first", file=sys.stderr)
        return 2
    n_isa = sum(1 for o in objects if ISA_OBJECT.search(o))
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        bad = [line for lines in pool.map(lambda o: check(o, build), sorted(objects)) for line in lines]
    print(f"check_isa_objects: {len(objects)} objects ({n_isa} per-ISA) in {', '.join(TARGETS)}: "
          f"{'clean' if not bad else str(len(bad)) + ' violations'}")
    for b in bad:
        print("  " + b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
