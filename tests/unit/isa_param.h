// Kernel tests run once per ISA build (scalar, avx2, avx512: src/kernels/isa.h) in one process;
// an ISA this CPU lacks is skipped. The previous choice is restored after each test.
#pragma once
#include <gtest/gtest.h>

#include <string>

#include "kernels/isa.h"

namespace kvtest {

class IsaTest : public ::testing::TestWithParam<kv::Isa> {
 protected:
  void SetUp() override {
    if (kv::set_kernel_isa_for_testing(GetParam()) != GetParam())
      GTEST_SKIP() << "this CPU has no " << kv::isa_name(GetParam());
  }
  void TearDown() override { kv::set_kernel_isa_for_testing(saved_); }
  kv::Isa saved_ = kv::kernel_isa();
};

inline std::string isa_param_name(const ::testing::TestParamInfo<kv::Isa>& p) { return kv::isa_name(p.param); }

}  // namespace kvtest

// Instantiates TEST_P(suite, ...) (suite derives from kvtest::IsaTest) for every ISA.
#define KV_INSTANTIATE_FOR_EVERY_ISA(suite)                                                                  \
  INSTANTIATE_TEST_SUITE_P(Isa, suite, ::testing::Values(kv::Isa::kScalar, kv::Isa::kAvx2, kv::Isa::kAvx512), \
                           kvtest::isa_param_name)
