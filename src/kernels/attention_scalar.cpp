// The paged attention kernels built for the x86-64 baseline (SSE2): what any CPU runs, and KV_ISA=scalar.
#define KV_ISA_NS scalar
#include "kernels/attention_impl.h"
