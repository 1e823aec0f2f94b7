// Which instruction set the kernels run. One binary serves every x86-64 CPU: the library is
// compiled for the plain x86-64 baseline (SSE2), and the hot kernels once more per ISA — files
// named *_avx2.cpp / *_avx512.cpp get that ISA's compiler flags (CMakeLists.txt) — and are
// picked at run time from what the CPU has. Nothing outside those files may assume more than
// the baseline (tests/check_isa_objects.py checks the object files).
#pragma once

namespace kv {

// kAvx2 = AVX2 + FMA + F16C; kAvx512 = AVX-512 F/BW/VL/DQ/VNNI (+ the AVX2 set).
enum class Isa { kScalar, kAvx2, kAvx512 };

// Whether this CPU can run the kernels of `isa`. Always true for kScalar; false for the others
// in a KV_SCALAR_ONLY build or off x86.
bool cpu_has(Isa isa);
// The CPU converts f16 <-> f32 in hardware (F16C; every AVX2 CPU has it).
bool cpu_has_f16c();
// Intel AMX with int8 (Sapphire Rapids and later) on an AVX-512 CPU, and Linux granted this
// process the tile state (arch_prctl ARCH_REQ_XCOMP_PERM, asked once here). The batched matmul
// uses it (kernels/matmul_amx_avx512.cpp); KV_AMX=0 turns it off.
bool cpu_has_amx();

// The best ISA this CPU has, lowered by env KV_ISA=scalar|avx2|avx512. Asking for more than the
// CPU has gives the best it has, and an unknown name is ignored; either prints one warning on
// stderr per process. Reads the environment at each call.
Isa detect_isa();

const char* isa_name(Isa isa);  // "scalar", "avx2", "avx512"

// The ISA the attention, op and KV-tile kernels dispatch to: detect_isa() at first use, then
// fixed for the process (a matmul runs the ISA its PackedMatrix was packed for, which the
// model loaders also take from detect_isa()). Thread-safe.
Isa kernel_isa();
// Tests run every path in one process: switches kernel_isa() to `isa`, capped at what the CPU
// has; returns the ISA now in use. Must not race with running kernels.
Isa set_kernel_isa_for_testing(Isa isa);

}  // namespace kv
