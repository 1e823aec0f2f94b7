// The ops built for AVX2 + FMA + F16C (CMakeLists.txt flags *_avx2.cpp): the portable loops,
// vectorised 8 wide by the compiler. The row scans (max_value, collect_ge, first_gt) and
// Quest's key_bound are the references.
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "ops_avx2.cpp needs -mavx2 -mfma -mf16c (CMakeLists.txt gives them to *_avx2.cpp)"
#endif
#define KV_ISA_NS avx2
#include "kernels/ops_impl.h"

namespace kv::avx2 {

const OpsKernels kOps = {rms_norm_portable, rope_portable,       silu_mul_portable, gelu_mul_portable,
                         softmax_portable,  add_inplace_portable, max_value_ref,     exp_scaled_portable,
                         collect_ge_ref,    first_gt_ref,         key_bound_ref};

}  // namespace kv::avx2
