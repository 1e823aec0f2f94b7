// The paged attention kernels built for AVX2 + FMA + F16C (CMakeLists.txt flags *_avx2.cpp).
#if !defined(__AVX2__) || !defined(__FMA__) || !defined(__F16C__)
#error "attention_avx2.cpp needs -mavx2 -mfma -mf16c (CMakeLists.txt gives them to *_avx2.cpp)"
#endif
#define KV_ISA_NS avx2
#include "kernels/attention_impl.h"
