// The ops built for the x86-64 baseline (SSE2): what any CPU runs, and KV_ISA=scalar.
// The row scans (max_value, collect_ge, first_gt) and Quest's key_score_pages are the references.
#define KV_ISA_NS scalar
#include "kernels/ops_impl.h"

namespace kv::scalar {

const OpsKernels kOps = {rms_norm_portable, rope_portable,       silu_mul_portable, gelu_mul_portable,
                         softmax_portable,  add_inplace_portable, max_value_ref,     exp_scaled_portable,
                         collect_ge_ref,    first_gt_ref,         key_score_pages_ref};

}  // namespace kv::scalar
