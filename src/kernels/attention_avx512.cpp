// The paged attention kernels built for AVX-512 F/BW/VL/DQ/VNNI (CMakeLists.txt flags *_avx512.cpp).
#if !defined(__AVX512F__) || !defined(__AVX512BW__)
#error "attention_avx512.cpp needs the AVX-512 flags (CMakeLists.txt gives them to *_avx512.cpp)"
#endif
// GCC 12 warns that _mm512_undefined_ps()'s deliberate self-initialisation is uninitialised at
// every inlined intrinsic that uses it (GCC bug 105593); nothing here reads undefined lanes.
#pragma GCC diagnostic ignored "-Wuninitialized"
#if !defined(__clang__)  // a GCC-only group (clang warns that it does not know it)
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define KV_ISA_NS avx512
#include "kernels/attention_impl.h"
