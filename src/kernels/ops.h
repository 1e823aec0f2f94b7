// Element-wise and row-wise operators of the forward pass. Each has a scalar *_ref twin in
// ops_ref.cpp; the fast versions are tested against them with two-sided tolerances.
#pragma once
#include <cstdint>

#include "kernels/isa.h"

namespace kv {

// Two RoPE conventions as GGUF models use them. kNorm (llama arch in GGUF, whose converter
// permuted Q/K rows) rotates adjacent pairs (x[2i], x[2i+1]); kNeox (gemma, qwen, ...) rotates
// (x[i], x[i + n_rot/2]). Pair i turns by pos * freq_base^(-2i/n_rot) * freq_scale.
enum class RopeStyle { kNorm, kNeox };

// y[n] = x / sqrt(mean(x²) + eps) * w   (w may be null: no weight). y may alias x.
void rms_norm(const float* x, const float* w, float* y, int64_t n, float eps);
void rms_norm_ref(const float* x, const float* w, float* y, int64_t n, float eps);

// x: [n_head, head_dim] for one token at position pos; rotates the first n_rot of each head.
void rope(float* x, int n_head, int head_dim, int n_rot, int64_t pos, float freq_base,
          float freq_scale, RopeStyle style);
void rope_ref(float* x, int n_head, int head_dim, int n_rot, int64_t pos, float freq_base,
              float freq_scale, RopeStyle style);

// y[n] = silu(gate) * up. y may alias gate.
void silu_mul(const float* gate, const float* up, float* y, int64_t n);
void silu_mul_ref(const float* gate, const float* up, float* y, int64_t n);
// y[n] = gelu_tanh(gate) * up (Gemma).
void gelu_mul(const float* gate, const float* up, float* y, int64_t n);
void gelu_mul_ref(const float* gate, const float* up, float* y, int64_t n);

// In-place softmax over n values; returns log(sum(exp(x - max))) + max (the log-partition).
// -inf entries (masked) get 0. If every entry is -inf (or n == 0) all become 0 and -inf is
// returned: no probability mass, rather than NaN.
float softmax(float* x, int64_t n);
float softmax_ref(float* x, int64_t n);

// y[n] += x[n]
void add_inplace(float* y, const float* x, int64_t n);

// Sampling over a logit row x[n] (engine/sampler.cpp).
// The largest value of x (-inf when n == 0). NaN entries are ignored.
float max_value(const float* x, int64_t n);
float max_value_ref(const float* x, int64_t n);
// In place x[i] = exp((x[i] - mx) * scale), where mx is the row's max (so the max maps to 1
// and every entry to [0, 1]; -inf maps to 0). block_sums[b], b < ceil(n / kExpBlock), gets the
// sum over block b's entries; the return is the sum of the block sums added in block order,
// which the sampler's inverse-CDF walk retraces block by block.
inline constexpr int64_t kExpBlock = 1024;
double exp_scaled(float* x, int64_t n, float mx, float scale, double* block_sums);
double exp_scaled_ref(float* x, int64_t n, float mx, float scale, double* block_sums);
// The indices i with x[i] ≥ t, ascending, into idx (room for n + 16: the fast path stores whole
// vectors past the last index); *mass = their sum. Returns how many.
int64_t collect_ge(const float* x, int64_t n, float t, int32_t* idx, double* mass);
int64_t collect_ge_ref(const float* x, int64_t n, float t, int32_t* idx, double* mass);
// The first i in [from, n) with x[i] > t, or n (the top-k scan's skip over the row).
int64_t first_gt(const float* x, int64_t from, int64_t n, float t);
int64_t first_gt_ref(const float* x, int64_t from, int64_t n, float t);

// Quest's key summary of one group of keys (a part of a page) and one KV head: the keys'
// channel-wise mean and variance in 8 bits, key_summary_bytes(hd) bytes:
//   f32 mean scale ms, f32 variance scale vs, i8 mean[hd], u8 variance[hd]
// mean_d ≈ ms·mean[d] (ms = max|mean|/127), var_d ≈ vs·variance[d] (vs = max var/255).
inline constexpr int64_t key_summary_bytes(int hd) { return 8 + 2 * int64_t(hd); }
void encode_key_summary(const float* mean, const float* var, int hd, uint8_t* out);
// The summary's decoded mean and variance of channel d (tests and references).
float key_summary_mean(const uint8_t* s, int hd, int d);
float key_summary_var(const uint8_t* s, int hd, int d);

// Quest's page scores (kv/kv_eviction.h), n entries × n_heads KV heads in one call. KV head h
// has the n_rows query rows q[h·n_rows + r] of hd floats, and entry i (a page, or a part of
// one) its key summary b[i] + h·key_summary_bytes(hd) (an entry's heads are contiguous, so a
// call reads each entry's summaries in one run). q·k over the entry's keys has mean q·mu and,
// channels taken as independent, standard deviation sqrt(Σ_d q_d²·var_d):
// out[i·n_heads + h] = max over r of q·mu + spread·sqrt(Σ_d q_d²·var_d), spread being the
// expected maximum of an entry's worth of standard normal draws (quest_spread). The _ref is
// that in double; the AVX-512 path quantizes the query rows (q to int8, q² in two 8-bit
// levels) and is within those steps of it (ops_avx512.cpp, OpsTest.KeyScore).
void key_score_pages(const float* const* q, int n_rows, int n_heads, const uint8_t* const* b, int64_t n, int hd,
                     float spread, float* out);
void key_score_pages_ref(const float* const* q, int n_rows, int n_heads, const uint8_t* const* b, int64_t n, int hd,
                         float spread, float* out);

// The fast entry points above run the build for kernel_isa() (kernels/isa.h): AVX-512
// intrinsics, the portable loops compiled for AVX2 + FMA, or the same loops for the x86-64
// baseline. Tests switch it with set_kernel_isa_for_testing to exercise every path.

}  // namespace kv
