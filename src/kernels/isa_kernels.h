// Internal to src/kernels: the per-ISA builds of the ops and attention kernels, and what they
// share with the baseline code.
//
// ops_impl.h and attention_impl.h are compiled three times, into namespaces kv::scalar
// (ops_scalar.cpp, attention_scalar.cpp: x86-64 baseline flags), kv::avx2 (*_avx2.cpp) and
// kv::avx512 (*_avx512.cpp), each with that ISA's compiler flags; each build exports one table
// of entry points. ops.cpp and attention.cpp pick the table of kernel_isa() per call.
//
// ODR: code compiled with AVX flags must never stand in for baseline code. Everything an
// *_impl.h defines lives in its per-ISA namespace (most of it in an anonymous namespace inside),
// and the per-ISA code instantiates no template and calls no inline function of another
// namespace that the compiler could emit out of line: a weak copy compiled for AVX-512 could be
// the one the linker keeps for the scalar path. What needs a container or a thread-local
// buffer gets it from the baseline functions below. tests/check_isa_objects.py enforces this
// on the object files (no weak symbol outside the ISA namespaces with an AVX instruction, no
// AVX instruction in a baseline object).
#pragma once
#include <cstdint>

#include "kernels/attention.h"
#include "kernels/isa.h"
#include "kernels/ops.h"

namespace kv {

// One ISA's build of ops.h's fast entry points (same contracts).
struct OpsKernels {
  decltype(&kv::rms_norm) rms_norm;
  decltype(&kv::rope) rope;
  decltype(&kv::silu_mul) silu_mul;
  decltype(&kv::gelu_mul) gelu_mul;
  decltype(&kv::softmax) softmax;
  decltype(&kv::add_inplace) add_inplace;
  decltype(&kv::max_value) max_value;
  decltype(&kv::exp_scaled) exp_scaled;
  decltype(&kv::collect_ge) collect_ge;
  decltype(&kv::first_gt) first_gt;
  decltype(&kv::key_score_pages) key_score_pages;
};

// One ISA's build of attention.h's kernels (same contracts).
struct AttentionKernels {
  decltype(&kv::paged_attention) attention;
  decltype(&kv::paged_attention_partial) partial;
  decltype(&kv::paged_attention_partial_heads) partial_heads;
  decltype(&kv::attention_merge) merge;
  decltype(&kv::paged_attention_prefetch) prefetch;
};

namespace scalar {
extern const OpsKernels kOps;
extern const AttentionKernels kAttention;
}  // namespace scalar
namespace avx2 {
extern const OpsKernels kOps;
extern const AttentionKernels kAttention;
}  // namespace avx2
namespace avx512 {
extern const OpsKernels kOps;
extern const AttentionKernels kAttention;
}  // namespace avx512

// ---- baseline helpers the per-ISA builds call (ops.cpp, attention.cpp) -----------------------

// cos/sin of RoPE pair i at one position: per thread, recomputed when (n_rot, base, scale, pos)
// change (the model ropes Q and then K of a token at the same position: the second call is free).
// Angles formed in float64: pos·freq at pos ~ 10^4 loses ~10^-3 rad in float32.
struct RopeAngles {
  const float* cos;  // [n_rot / 2]
  const float* sin;  // [n_rot / 2]
};
RopeAngles rope_angles(int n_rot, int64_t pos, float freq_base, float freq_scale);

// The calling thread's scratch for the portable attention path: a page tile dequantized to
// floats three ways (each kAttnMaxBlockSize × kAttnMaxHeadDim floats, 64-byte aligned).
struct AttnTileScratch {
  float* kf;  // [bs][hd] keys as read
  float* kt;  // [hd][bs] keys channel-major
  float* vf;  // [bs][hd] values
};
AttnTileScratch attention_tile_scratch();
// The calling thread's buffer of at least n int64 (page indices of a sparse block table);
// valid until the thread's next call.
int64_t* attention_index_scratch(int64_t n);

}  // namespace kv
