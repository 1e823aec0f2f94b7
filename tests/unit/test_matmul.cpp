// matmul: every weight format × every ISA this CPU has × shapes that hit every tail.
//
// Three checks:
//  1. Against matmul_ref (exact: dequantized weights, double accumulation). The quantized
//     paths quantize activations per 32-block in two 8-bit levels (matmul.h, QAct):
//       q1 = round(x·127/amax), r = x − d·q1 (d = amax/127), q2 = round(r·32258/amax),
//       x̂ = D·(254·q1 + q2), D = amax/32258.
//     Error per element: |x − x̂| ≤ |r − D·q2| + |q1|·|d − 254·D|. The first term is the
//     rounding of q2: ≤ D/2 = amax/64516 (plus a few float ulps of r·id2: relative 1e-7 of
//     it); the second is the float rounding of the two scales: |d − 254·D| ≤ 2·2^-24·amax/127,
//     times |q1| ≤ 127, i.e. ≤ 1.2e-7·amax = 0.8% of the first term. The kernel's integer sums
//     are exact, so the quantization error on y[r,c] is bounded by
//       Σ_b (amax_b / 64516) · Σ_{i∈b} |w_ci|        (×1.05 for the terms above),
//     computed per output from the dequantized weights. On top comes float rounding of the
//     per-block steps (float(i): Q8_0 only, 2^-24 relative; the fma chain over ≤ 48 blocks):
//     2e-6·Σ|x·w| plus, for Q4_1 and Q4_K, 2e-6·Σ|x|·|m| (the min term can cancel against the
//     rest). Q5_0, Q4_K and Q6_K are repacked losslessly into integer quants with per-block
//     (Q6_K: per-16) scales, so the same bound holds for them. Tolerance for F32/F16 weights:
//     float rounding only, 2e-6·Σ|x·w|.
//     The bound is 127× tighter than the single-level one (amax_b/254 per element), whose
//     typical error (a random walk, ≈ sqrt(n/12)·d·|w|) exceeds it several-fold:
//     SingleLevelFailsTwoLevelBound checks that dropping the second level fails it.
//  2. Fast ISAs against the scalar path: same integers, same float steps in the same order,
//     so the result must be bit-identical (checked with memcmp), in both activation modes.
//  3. Batch invariance: row r alone, inside any batch size, with 1 or 2 threads, gives the
//     same bits.
// Plus parts of mixed types packed as one matrix, and real tensors of every quantized type of
// gemma-3-270m-Q4_K_M.gguf (Q5_0, Q4_K, Q6_K, Q8_0).
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <map>
#include <random>
#include <thread>
#include <vector>

#include "common/huge_alloc.h"
#include "common/thread_pool.h"
#include "gguf/gguf.h"
#include "kernels/matmul.h"
#include "kernels/prefetch.h"
#include "kernels/quant.h"

namespace kv {
namespace {

// A random f16 bit pattern for a positive scale in [lo, hi).
uint16_t rand_half(std::mt19937& rng, float lo, float hi) {
  std::uniform_real_distribution<float> u(lo, hi);
  return fp32_to_fp16(u(rng));
}

// Raw GGUF bytes for an [n_out, n_in] matrix of `type` with random contents.
std::vector<uint8_t> random_weights(GgmlType type, int64_t n_in, int64_t n_out, std::mt19937& rng) {
  const int64_t rb = row_bytes(type, n_in);
  std::vector<uint8_t> buf(static_cast<size_t>(rb * n_out));
  std::uniform_int_distribution<int> byte(0, 255);
  std::normal_distribution<float> nd(0.0f, 0.5f);
  for (int64_t o = 0; o < n_out; ++o) {
    uint8_t* row = buf.data() + o * rb;
    switch (type) {
      case GgmlType::F32:
        for (int64_t i = 0; i < n_in; ++i) {
          float v = nd(rng);
          std::memcpy(row + 4 * i, &v, 4);
        }
        break;
      case GgmlType::F16:
        for (int64_t i = 0; i < n_in; ++i) {
          uint16_t h = fp32_to_fp16(nd(rng));
          std::memcpy(row + 2 * i, &h, 2);
        }
        break;
      case GgmlType::Q4_0:
      case GgmlType::Q4_1:
      case GgmlType::Q5_0:
      case GgmlType::Q8_0: {
        const int64_t bb = type_block_bytes(type);
        for (int64_t b = 0; b < n_in / 32; ++b) {
          uint8_t* blk = row + b * bb;
          for (int64_t k = 0; k < bb; ++k) blk[k] = static_cast<uint8_t>(byte(rng));
          uint16_t d = rand_half(rng, 0.001f, 0.05f);
          std::memcpy(blk, &d, 2);
          if (type == GgmlType::Q4_1) {
            uint16_t m = rand_half(rng, -0.3f, 0.1f);
            std::memcpy(blk + 2, &m, 2);
          }
        }
        break;
      }
      default:  // K-quants: random bytes with sane f16 super-block scales
        for (int64_t k = 0; k < rb; ++k) row[k] = static_cast<uint8_t>(byte(rng));
        for (int64_t b = 0; b < n_in / 256; ++b) {
          uint8_t* blk = row + b * type_block_bytes(type);
          uint16_t d = rand_half(rng, 0.001f, 0.01f);
          if (type == GgmlType::Q4_K) {
            std::memcpy(blk, &d, 2);
            std::memcpy(blk + 2, &d, 2);
          } else {
            std::memcpy(blk + 208, &d, 2);
          }
        }
        break;
    }
  }
  return buf;
}

std::vector<float> random_x(int64_t n, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) v = nd(rng);
  // A few outliers and an all-zero block make amax and d = 0 cases real.
  if (n >= 64) {
    x[3] *= 20.0f;
    for (int i = 32; i < 64; ++i) x[static_cast<size_t>(i)] = 0.0f;
  }
  return x;
}

std::vector<Isa> isas() {
  std::vector<Isa> v{Isa::kScalar};
  // detect_isa honours KV_ISA; ask for each explicitly and keep the ones the CPU has.
  for (const char* name : {"avx2", "avx512"}) {
    setenv("KV_ISA", name, 1);
    Isa i = detect_isa();
    if (std::strcmp(isa_name(i), name) == 0) v.push_back(i);
  }
  unsetenv("KV_ISA");
  return v;
}

bool quantized(GgmlType t) {
  return t == GgmlType::Q4_0 || t == GgmlType::Q4_1 || t == GgmlType::Q8_0 || t == GgmlType::Q5_0 ||
         t == GgmlType::Q4_K || t == GgmlType::Q6_K;
}

// |min| of the 32-element block b of a raw row, for the formats with an additive min (the
// term that can cancel): Q4_1's m; Q4_K's dmin·m of the sub-block (ggml's get_scale_min_k4).
double block_min(GgmlType type, const uint8_t* row, int64_t b) {
  if (type == GgmlType::Q4_1) {
    uint16_t mh;
    std::memcpy(&mh, row + b * 20 + 2, 2);
    return std::fabs(static_cast<double>(fp16_to_fp32(mh)));
  }
  if (type == GgmlType::Q4_K) {
    const uint8_t* blk = row + (b / 8) * 144;
    const uint8_t* q = blk + 4;
    const int j = static_cast<int>(b % 8);
    const int m = j < 4 ? q[j + 4] & 63 : (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    uint16_t dmin;
    std::memcpy(&dmin, blk + 2, 2);
    return std::fabs(static_cast<double>(fp16_to_fp32(dmin)) * m);
  }
  return 0.0;
}

// Outputs of y outside the tolerance documented at the top (failures reported when report).
// levels: 2 = the two-level bound (default mode), 1 = the single-level bound (amax/254).
int count_outside_tol(GgmlType type, const RawMatrix& raw, const std::vector<float>& x, int64_t n_rows,
                      const std::vector<float>& y, const std::string& what, int levels, bool report,
                      double* worst_ratio = nullptr) {
  const int64_t n_in = raw.n_in, n_out = raw.n_out;
  std::vector<float> ref(static_cast<size_t>(n_rows * n_out));
  matmul_ref(raw, x.data(), n_rows, ref.data());
  std::vector<float> wrow(static_cast<size_t>(n_in));
  const int64_t rb = row_bytes(type, n_in);
  const double step = levels == 2 ? 64516.0 : 254.0;  // amax / (max error per element)
  int bad = 0;
  for (int64_t c = 0; c < n_out; ++c) {
    const uint8_t* wraw = static_cast<const uint8_t*>(raw.data) + c * rb;
    EXPECT_TRUE(dequantize_row_ref(type, wraw, wrow.data(), n_in));
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* xr = x.data() + r * n_in;
      double bound = 0, mag = 0;
      for (int64_t b = 0; b < n_in; b += 32) {
        double amax = 0, wsum = 0, xsum = 0;
        for (int64_t i = b; i < b + 32 && i < n_in; ++i) {
          amax = std::max(amax, std::fabs(static_cast<double>(xr[i])));
          wsum += std::fabs(static_cast<double>(wrow[static_cast<size_t>(i)]));
          xsum += std::fabs(static_cast<double>(xr[i]));
          mag += std::fabs(static_cast<double>(xr[i]) * wrow[static_cast<size_t>(i)]);
        }
        bound += amax / step * wsum;
        mag += xsum * block_min(type, wraw, b / 32);
      }
      const double q = quantized(type) ? bound : 0.0;
      const double tol = q * 1.05 + 2e-6 * mag + 1e-30;
      const double got = y[static_cast<size_t>(r * n_out + c)], want = ref[static_cast<size_t>(r * n_out + c)];
      if (worst_ratio && q > 0) *worst_ratio = std::max(*worst_ratio, std::fabs(got - want) / q);
      if (!(std::fabs(got - want) <= tol) && bad++ < 5 && report)
        ADD_FAILURE() << what << " r=" << r << " c=" << c << " got " << got << " want " << want << " tol " << tol;
    }
  }
  return bad;
}

// Checks y against the exact result with the two-level tolerance documented at the top.
void expect_close_to_ref(GgmlType type, const RawMatrix& raw, const std::vector<float>& x, int64_t n_rows,
                         const std::vector<float>& y, const std::string& what, double* worst_ratio = nullptr) {
  EXPECT_EQ(count_outside_tol(type, raw, x, n_rows, y, what, 2, true, worst_ratio), 0) << what;
}

struct Case {
  GgmlType type;
  std::vector<int64_t> n_ins;
};

class MatmulTest : public ::testing::Test {
 protected:
  void TearDown() override { set_act_quant(ActQuant::kQ8x2); }
  ThreadPool pool1_{1};
  ThreadPool pool2_{2};
};

TEST_F(MatmulTest, AllFormatsIsasShapesAgainstRefAndScalar) {
  std::mt19937 rng(1234);
  const std::vector<Case> cases = {
      {GgmlType::Q4_1, {32, 64, 96, 576, 1536}}, {GgmlType::Q8_0, {32, 64, 96, 576, 1536}},
      {GgmlType::Q4_0, {32, 96, 576}},           {GgmlType::F32, {32, 7, 96, 576}},
      {GgmlType::F16, {32, 17, 576}},            {GgmlType::Q5_0, {32, 64, 96, 640, 1536}},
      {GgmlType::Q4_K, {256, 512, 1024}},        {GgmlType::Q6_K, {256, 512, 1024}},
  };
  const std::vector<int64_t> n_outs = {1, 3, 15, 16, 17, 63, 64, 65, 960};
  const std::vector<int64_t> rows_list = {1, 2, 3, 4, 5, 7, 8, 33};
  const std::vector<Isa> all_isas = isas();
  const bool gemv_one = gemv_one_stream();
  int n_checked = 0;
  std::map<std::string, double> worst;  // per type: largest |error| / two-level quantization bound
  for (const Case& cs : cases) {
    for (int64_t n_in : cs.n_ins) {
      for (int64_t n_out : n_outs) {
        // Keep the exhaustive grid quick: the widest shapes only with a few row counts.
        auto w = random_weights(cs.type, n_in, n_out, rng);
        RawMatrix raw{cs.type, w.data(), n_in, n_out};
        std::vector<float> x = random_x(33 * n_in, rng);
        for (int64_t n_rows : rows_list)
        for (ActQuant mode : {ActQuant::kQ8x2, ActQuant::kQ8}) {
          if (n_in * n_out > 100000 && n_rows != 1 && n_rows != 5 && n_rows != 33) continue;
          // Single-level (comparison mode): only quantized weights, fewer shapes.
          if (mode == ActQuant::kQ8 && (!quantized(cs.type) || (n_rows != 1 && n_rows != 5))) continue;
          set_act_quant(mode);
          std::vector<float> y_scalar;
          for (Isa isa : all_isas) {
            auto p = PackedMatrix::pack(raw, isa);
            ASSERT_TRUE(p.is_ok()) << p.message();
            EXPECT_EQ(p->n_out(), n_out);
            for (ThreadPool* pool : {&pool1_, &pool2_})
            for (bool one_stream : {false, true}) {
              if (one_stream && n_rows != 1) continue;  // the GEMV's two ways (kernels/prefetch.h)
              set_gemv_one_stream_for_testing(one_stream);
              std::vector<float> y(static_cast<size_t>(n_rows * n_out), -1.0f);
              matmul(*p, x.data(), n_rows, y.data(), *pool);
              std::string what = std::string(type_name(cs.type)) + " " + isa_name(isa) + " n_in=" +
                                 std::to_string(n_in) + " n_out=" + std::to_string(n_out) +
                                 " rows=" + std::to_string(n_rows) + " threads=" + std::to_string(pool->size()) +
                                 (mode == ActQuant::kQ8 ? " single-level" : "") + (one_stream ? " one-stream" : "");
              if (y_scalar.empty()) {
                if (mode == ActQuant::kQ8x2)
                  expect_close_to_ref(cs.type, raw, x, n_rows, y, what, &worst[type_name(cs.type)]);
                else
                  EXPECT_EQ(count_outside_tol(cs.type, raw, x, n_rows, y, what, 1, true), 0) << what;
                y_scalar = y;
              } else {
                EXPECT_EQ(0, std::memcmp(y.data(), y_scalar.data(), y.size() * 4)) << what << " differs from scalar";
              }
              ++n_checked;
            }
          }
        }
      }
    }
  }
  set_gemv_one_stream_for_testing(gemv_one);
  EXPECT_GT(n_checked, 1000);
  std::printf("  worst |error| / two-level quantization bound:");
  for (const auto& [name, ratio] : worst)
    if (ratio > 0) std::printf(" %s %.3f", name.c_str(), ratio);
  std::printf("\n");
}

// The two-level bound must be tight enough that the single-level error breaks it: a kernel
// that dropped (or mis-scaled) the second level would not pass the test above.
TEST_F(MatmulTest, SingleLevelFailsTwoLevelBound) {
  std::mt19937 rng(4321);
  for (GgmlType type : {GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q5_0, GgmlType::Q4_K,
                        GgmlType::Q6_K}) {
    const bool k_quant = type_block_elems(type) == 256;
    for (int64_t n_in : {k_quant ? int64_t{256} : int64_t{32}, k_quant ? int64_t{512} : int64_t{576}, int64_t{1536}}) {
      const int64_t n_out = 64, n_rows = 4;
      auto w = random_weights(type, n_in, n_out, rng);
      RawMatrix raw{type, w.data(), n_in, n_out};
      std::vector<float> x = random_x(n_rows * n_in, rng);
      auto p = PackedMatrix::pack(raw, detect_isa());
      ASSERT_TRUE(p.is_ok());
      std::vector<float> y1(static_cast<size_t>(n_rows * n_out)), y2(y1.size());
      set_act_quant(ActQuant::kQ8);
      matmul(*p, x.data(), n_rows, y1.data(), pool2_);
      set_act_quant(ActQuant::kQ8x2);
      matmul(*p, x.data(), n_rows, y2.data(), pool2_);
      const std::string what = std::string(type_name(type)) + " n_in=" + std::to_string(n_in);
      const int outside1 = count_outside_tol(type, raw, x, n_rows, y1, what, 2, false);
      EXPECT_EQ(count_outside_tol(type, raw, x, n_rows, y1, what, 1, true), 0) << what;
      EXPECT_EQ(count_outside_tol(type, raw, x, n_rows, y2, what, 2, true), 0) << what;
      // Most outputs of the single-level path are outside the two-level bound.
      EXPECT_GT(outside1, n_rows * n_out / 2) << what << ": single-level passes the two-level bound";
    }
  }
}

TEST_F(MatmulTest, BatchInvariance) {
  std::mt19937 rng(99);
  for (ActQuant mode : {ActQuant::kQ8x2, ActQuant::kQ8})
  for (GgmlType type : {GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::F32, GgmlType::Q5_0,
                        GgmlType::Q4_K, GgmlType::Q6_K}) {
    if (mode == ActQuant::kQ8 && type == GgmlType::F32) continue;
    set_act_quant(mode);
    const int64_t n_in = type_block_elems(type) == 256 ? 512 : 576, n_out = 200, max_rows = 70;
    auto w = random_weights(type, n_in, n_out, rng);
    RawMatrix raw{type, w.data(), n_in, n_out};
    std::vector<float> x = random_x(max_rows * n_in, rng);
    for (Isa isa : isas()) {
      auto p = PackedMatrix::pack(raw, isa);
      ASSERT_TRUE(p.is_ok());
      // Each row alone, single-threaded: the reference bits.
      std::vector<float> alone(static_cast<size_t>(max_rows * n_out));
      for (int64_t r = 0; r < max_rows; ++r) matmul(*p, x.data() + r * n_in, 1, alone.data() + r * n_out, pool1_);
      for (ThreadPool* pool : {&pool1_, &pool2_}) {
        for (int64_t n_rows : {2, 3, 4, 5, 9, 33, 64, 65, 70}) {
          // Rows at an offset, so a row sits at a different place in the row tiles.
          for (int64_t off : {int64_t{0}, max_rows - n_rows}) {
            std::vector<float> y(static_cast<size_t>(n_rows * n_out));
            matmul(*p, x.data() + off * n_in, n_rows, y.data(), *pool);
            EXPECT_EQ(0, std::memcmp(y.data(), alone.data() + off * n_out, y.size() * 4))
                << type_name(type) << " " << isa_name(isa) << " rows=" << n_rows << " off=" << off << (mode == ActQuant::kQ8 ? " single-level" : "")
                << " threads=" << pool->size();
          }
        }
      }
    }
  }
}

// The AMX kernel (batches of >= kAmxMinRows rows on CPUs with AMX-INT8) against the VNNI kernel,
// bit for bit: whole tiles, short remainders on VNNI (17, 27, 33, 100), long ones on AMX (28, 31,
// 44), partial last groups, both activation modes, one and two threads.
TEST_F(MatmulTest, AmxEqualsVnniBitForBit) {
  if (!cpu_has_amx()) GTEST_SKIP() << "no AMX-INT8 (or Linux did not grant the tile state)";
  std::mt19937 rng(2024);
  for (ActQuant mode : {ActQuant::kQ8x2, ActQuant::kQ8})
    for (GgmlType type : {GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q5_0, GgmlType::Q4_K, GgmlType::Q6_K}) {
      set_act_quant(mode);
      const int64_t n_in = type_block_elems(type) == 256 ? 768 : 608, n_out = 77;
      auto w = random_weights(type, n_in, n_out, rng);
      auto p = PackedMatrix::pack(RawMatrix{type, w.data(), n_in, n_out}, Isa::kAvx512);
      ASSERT_TRUE(p.is_ok());
      for (int64_t n_rows : {16, 17, 27, 28, 31, 32, 33, 44, 100}) {
        std::vector<float> x = random_x(n_rows * n_in, rng);
        std::vector<float> amx(static_cast<size_t>(n_rows * n_out)), vnni(amx.size());
        for (ThreadPool* pool : {&pool1_, &pool2_}) {
          ASSERT_TRUE(set_amx_for_testing(true));
          matmul(*p, x.data(), n_rows, amx.data(), *pool);
          set_amx_for_testing(false);
          matmul(*p, x.data(), n_rows, vnni.data(), *pool);
          EXPECT_EQ(0, std::memcmp(amx.data(), vnni.data(), amx.size() * 4))
              << type_name(type) << " rows=" << n_rows << (mode == ActQuant::kQ8 ? " single-level" : "")
              << " threads=" << pool->size();
        }
      }
    }
  set_amx_for_testing(true);
}

// The same at the extremes the AMX kernel's float level sum relies on being exact (every weight
// at its largest quant, every activation at ±127 on the first level): 4-bit sums reach
// 254 · 60,960 + 60,960 < 2^24 there.
TEST_F(MatmulTest, AmxEqualsVnniAtExtremeSums) {
  if (!cpu_has_amx()) GTEST_SKIP() << "no AMX-INT8 (or Linux did not grant the tile state)";
  std::mt19937 rng(99);
  struct Case {
    GgmlType type;
    int64_t q_begin, q_end;  // quant bytes within a block
    uint8_t fill;
  };
  for (const Case& cs : {Case{GgmlType::Q4_0, 2, 18, 0xFF}, Case{GgmlType::Q4_1, 4, 20, 0xFF}, Case{GgmlType::Q5_0, 2, 22, 0xFF},
                         Case{GgmlType::Q8_0, 2, 34, 0x81}, Case{GgmlType::Q4_K, 16, 144, 0xFF}})
    for (ActQuant mode : {ActQuant::kQ8x2, ActQuant::kQ8}) {
      set_act_quant(mode);
      const int64_t n_in = type_block_elems(cs.type) == 256 ? 768 : 608, n_out = 48;
      auto w = random_weights(cs.type, n_in, n_out, rng);
      const int64_t bb = type_block_bytes(cs.type), blocks = n_in / type_block_elems(cs.type);
      for (int64_t o = 0; o < n_out; ++o)
        for (int64_t b = 0; b < blocks; ++b) {
          uint8_t* blk = w.data() + o * row_bytes(cs.type, n_in) + b * bb;
          std::memset(blk + cs.q_begin, cs.fill, static_cast<size_t>(cs.q_end - cs.q_begin));
        }
      auto p = PackedMatrix::pack(RawMatrix{cs.type, w.data(), n_in, n_out}, Isa::kAvx512);
      ASSERT_TRUE(p.is_ok());
      const int64_t n_rows = 32;
      std::vector<float> x = random_x(n_rows * n_in, rng);
      for (int64_t r = 0; r < 8; ++r)  // rows of ±1: q1 = ±127 everywhere, q2 = 0
        for (int64_t i = 0; i < n_in; ++i) x[r * n_in + i] = (r % 2 == 0 ? 1.0f : -1.0f) * (r < 4 ? 1.0f : 3.5f);
      for (int64_t r = 8; r < 12; ++r)  // ±1 with a small second-level residue
        for (int64_t i = 0; i < n_in; ++i) x[r * n_in + i] = (i % 32 == 0 ? 1.0f : 0.9961f) * (r % 2 == 0 ? 1.0f : -1.0f);
      std::vector<float> amx(static_cast<size_t>(n_rows * n_out)), vnni(amx.size());
      ASSERT_TRUE(set_amx_for_testing(true));
      matmul(*p, x.data(), n_rows, amx.data(), pool2_);
      set_amx_for_testing(false);
      matmul(*p, x.data(), n_rows, vnni.data(), pool2_);
      EXPECT_EQ(0, std::memcmp(amx.data(), vnni.data(), amx.size() * 4))
          << type_name(cs.type) << (mode == ActQuant::kQ8 ? " single-level" : "");
    }
  set_amx_for_testing(true);
}

TEST_F(MatmulTest, FusedPartsEqualSeparate) {
  std::mt19937 rng(7);
  const int64_t n_in = 576;
  auto a = random_weights(GgmlType::Q4_1, n_in, 576, rng);
  auto b = random_weights(GgmlType::Q4_1, n_in, 190, rng);  // not a multiple of 16
  auto c = random_weights(GgmlType::Q4_1, n_in, 194, rng);
  std::vector<float> x = random_x(3 * n_in, rng);
  RawMatrix ra{GgmlType::Q4_1, a.data(), n_in, 576}, rb{GgmlType::Q4_1, b.data(), n_in, 190},
      rc{GgmlType::Q4_1, c.data(), n_in, 194};
  const Isa isa = detect_isa();
  auto fused = PackedMatrix::pack({ra, rb, rc}, isa);
  ASSERT_TRUE(fused.is_ok());
  ASSERT_EQ(fused->n_out(), 960);
  std::vector<float> yf(3 * 960);
  matmul(*fused, x.data(), 3, yf.data(), pool2_);
  int64_t col = 0;
  for (const RawMatrix* r : {&ra, &rb, &rc}) {
    auto p = PackedMatrix::pack(*r, isa);
    std::vector<float> y(static_cast<size_t>(3 * r->n_out));
    matmul(*p, x.data(), 3, y.data(), pool2_);
    for (int64_t row = 0; row < 3; ++row)
      EXPECT_EQ(0, std::memcmp(&y[static_cast<size_t>(row * r->n_out)], &yf[static_cast<size_t>(row * 960 + col)],
                               static_cast<size_t>(r->n_out) * 4));
    col += r->n_out;
  }
}

// Parts of different quantized types packed as one matrix give, column for column, the bits
// of each part packed alone: every ISA, single row and batches, 1 and 2 threads.
TEST_F(MatmulTest, MixedTypePartsEqualSeparate) {
  std::mt19937 rng(17);
  struct Mix {
    std::vector<std::pair<GgmlType, int64_t>> parts;
    int64_t n_in;
  };
  const std::vector<Mix> mixes = {
      // Gemma 3 270M's QKV where attn_v is Q8_0.
      {{{GgmlType::Q5_0, 1024}, {GgmlType::Q5_0, 256}, {GgmlType::Q8_0, 256}}, 640},
      // Type changes on multiples of 16; same-type neighbours may meet anywhere; ragged end.
      {{{GgmlType::Q4_K, 48}, {GgmlType::Q6_K, 32}, {GgmlType::Q4_K, 17}}, 512},
      {{{GgmlType::Q8_0, 16}, {GgmlType::Q4_0, 32}, {GgmlType::Q4_1, 16}, {GgmlType::Q5_0, 16},
        {GgmlType::Q6_K, 16}, {GgmlType::Q4_K, 33}},
       256},
      {{{GgmlType::Q5_0, 100}, {GgmlType::Q5_0, 28}, {GgmlType::Q8_0, 20}}, 640},
  };
  for (ActQuant mode : {ActQuant::kQ8x2, ActQuant::kQ8}) {
    set_act_quant(mode);
    for (const Mix& mix : mixes) {
      std::vector<std::vector<uint8_t>> bufs;
      std::vector<RawMatrix> raws;
      int64_t n_out = 0;
      for (const auto& [type, n] : mix.parts) {
        bufs.push_back(random_weights(type, mix.n_in, n, rng));
        raws.push_back(RawMatrix{type, bufs.back().data(), mix.n_in, n});
        n_out += n;
      }
      std::vector<float> x = random_x(64 * mix.n_in, rng);
      for (Isa isa : isas()) {
        auto fused = PackedMatrix::pack(raws, isa);
        ASSERT_TRUE(fused.is_ok()) << fused.message();
        ASSERT_EQ(fused->n_out(), n_out);
        for (int64_t n_rows : {1, 5, 64})
          for (ThreadPool* pool : {&pool1_, &pool2_}) {
            std::vector<float> yf(static_cast<size_t>(n_rows * n_out));
            matmul(*fused, x.data(), n_rows, yf.data(), *pool);
            int64_t col = 0;
            for (const RawMatrix& r : raws) {
              auto p = PackedMatrix::pack(r, isa);
              ASSERT_TRUE(p.is_ok()) << p.message();
              std::vector<float> y(static_cast<size_t>(n_rows * r.n_out));
              matmul(*p, x.data(), n_rows, y.data(), *pool);
              for (int64_t row = 0; row < n_rows; ++row)
                EXPECT_EQ(0, std::memcmp(&y[static_cast<size_t>(row * r.n_out)], &yf[static_cast<size_t>(row * n_out + col)],
                                         static_cast<size_t>(r.n_out) * 4))
                    << type_name(r.type) << " part at column " << col << " " << isa_name(isa) << " rows=" << n_rows
                    << " threads=" << pool->size();
              col += r.n_out;
            }
          }
      }
    }
  }
}

// Real weights: one tensor of each quantized type in gemma-3-270m-Q4_K_M.gguf (and its mixed
// QKV), against the exact reference, every ISA bit-identical, batch-invariant.
TEST_F(MatmulTest, GemmaTensors) {
  const std::string path = std::string(KV_SOURCE_DIR) + "/models/gemma-3-270m-Q4_K_M.gguf";
  auto file = GgufFile::open(path);
  ASSERT_TRUE(file.is_ok()) << path << ": " << file.message() << " (run `make models`)";
  auto raw_of = [&](const std::string& name, int64_t max_rows = 0) {
    const GgufTensor* t = (*file)->find_tensor(name);
    EXPECT_NE(t, nullptr) << name;
    if (!t) return RawMatrix{GgmlType::F32, nullptr, 0, 0};
    const int64_t rows = max_rows > 0 ? std::min(max_rows, t->rows()) : t->rows();
    return RawMatrix{t->type, t->data, t->ne[0], rows};
  };
  struct Item {
    std::vector<RawMatrix> parts;
    std::vector<GgmlType> want_types;
  };
  const std::vector<Item> items = {
      {{raw_of("blk.0.attn_q.weight")}, {GgmlType::Q5_0}},
      {{raw_of("blk.0.attn_output.weight")}, {GgmlType::Q4_K}},
      {{raw_of("blk.0.ffn_down.weight")}, {GgmlType::Q6_K}},
      {{raw_of("blk.2.ffn_down.weight")}, {GgmlType::Q4_K}},
      {{raw_of("blk.0.attn_v.weight")}, {GgmlType::Q8_0}},
      // The tied output matrix, its first 1000 rows (the whole is 262144).
      {{raw_of("token_embd.weight", 1000)}, {GgmlType::Q8_0}},
      {{raw_of("blk.0.attn_q.weight"), raw_of("blk.0.attn_k.weight"), raw_of("blk.0.attn_v.weight")},
       {GgmlType::Q5_0, GgmlType::Q8_0}},
  };
  std::mt19937 rng(2718);
  const int64_t n_rows = 6;
  for (const Item& it : items) {
    int64_t n_out = 0;
    for (const RawMatrix& r : it.parts) {
      ASSERT_NE(r.data, nullptr);
      n_out += r.n_out;
    }
    const int64_t n_in = it.parts[0].n_in;
    std::string what = "gemma";
    for (const RawMatrix& r : it.parts) what += std::string(" ") + type_name(r.type) + "[" + std::to_string(r.n_out) + "x" + std::to_string(r.n_in) + "]";
    std::vector<float> x = random_x(n_rows * n_in, rng);
    std::vector<float> y_first;
    for (Isa isa : isas()) {
      auto p = PackedMatrix::pack(it.parts, isa);
      ASSERT_TRUE(p.is_ok()) << what << ": " << p.message();
      EXPECT_EQ(p->segment_types(), it.want_types) << what;
      std::vector<float> y(static_cast<size_t>(n_rows * n_out));
      matmul(*p, x.data(), n_rows, y.data(), pool2_);
      if (y_first.empty()) {
        // Against the exact answer, part by part.
        int64_t col = 0;
        for (const RawMatrix& r : it.parts) {
          std::vector<float> yp(static_cast<size_t>(n_rows * r.n_out));
          for (int64_t row = 0; row < n_rows; ++row)
            std::memcpy(&yp[static_cast<size_t>(row * r.n_out)], &y[static_cast<size_t>(row * n_out + col)],
                        static_cast<size_t>(r.n_out) * 4);
          expect_close_to_ref(r.type, r, x, n_rows, yp, what + " " + isa_name(isa));
          col += r.n_out;
        }
        y_first = y;
      } else {
        EXPECT_EQ(0, std::memcmp(y.data(), y_first.data(), y.size() * 4)) << what << " " << isa_name(isa) << " differs from scalar";
      }
      // Each row alone, one thread: the same bits as in the batch.
      for (int64_t row = 0; row < n_rows; ++row) {
        std::vector<float> y1(static_cast<size_t>(n_out));
        matmul(*p, x.data() + row * n_in, 1, y1.data(), pool1_);
        EXPECT_EQ(0, std::memcmp(y1.data(), &y[static_cast<size_t>(row * n_out)], y1.size() * 4))
            << what << " " << isa_name(isa) << " row " << row << " alone differs from the batch";
      }
    }
  }
}

TEST_F(MatmulTest, PackRejectsBadInput) {
  std::vector<uint8_t> w(1024);  // room for every matrix below that packs (16 rows of Q8_0: 544 bytes)
  EXPECT_FALSE(PackedMatrix::pack(std::vector<RawMatrix>{}, Isa::kScalar).is_ok());
  EXPECT_FALSE(PackedMatrix::pack(RawMatrix{GgmlType::Q4_1, w.data(), 48, 2}, Isa::kScalar).is_ok());
  EXPECT_FALSE(PackedMatrix::pack({RawMatrix{GgmlType::Q4_1, w.data(), 32, 2}, RawMatrix{GgmlType::Q8_0, w.data(), 32, 1}},
                                  Isa::kScalar)
                   .is_ok());
  EXPECT_FALSE(PackedMatrix::pack({RawMatrix{GgmlType::Q4_1, w.data(), 32, 2}, RawMatrix{GgmlType::Q4_1, w.data(), 64, 1}},
                                  Isa::kScalar)
                   .is_ok());
  EXPECT_FALSE(PackedMatrix::pack(RawMatrix{GgmlType::Q5_1, w.data(), 32, 2}, Isa::kScalar).is_ok());
  // Types may mix only on a multiple of 16 outputs, and only between quantized types.
  EXPECT_FALSE(PackedMatrix::pack({RawMatrix{GgmlType::Q5_0, w.data(), 32, 17}, RawMatrix{GgmlType::Q8_0, w.data(), 32, 1}},
                                  Isa::kScalar)
                   .is_ok());
  EXPECT_TRUE(PackedMatrix::pack({RawMatrix{GgmlType::Q5_0, w.data(), 32, 16}, RawMatrix{GgmlType::Q8_0, w.data(), 32, 1}},
                                 Isa::kScalar)
                  .is_ok());
  EXPECT_FALSE(PackedMatrix::pack({RawMatrix{GgmlType::Q8_0, w.data(), 32, 16}, RawMatrix{GgmlType::F32, w.data(), 32, 1}},
                                  Isa::kScalar)
                   .is_ok());
  // K-quants need n_in to be a multiple of 256, also when mixed.
  std::vector<uint8_t> big(16 * 210 * 2);
  EXPECT_FALSE(PackedMatrix::pack(RawMatrix{GgmlType::Q6_K, big.data(), 128, 2}, Isa::kScalar).is_ok());
  EXPECT_FALSE(PackedMatrix::pack({RawMatrix{GgmlType::Q8_0, big.data(), 288, 16}, RawMatrix{GgmlType::Q4_K, big.data(), 288, 1}},
                                  Isa::kScalar)
                   .is_ok());
  EXPECT_TRUE(PackedMatrix::pack(RawMatrix{GgmlType::Q4_1, w.data(), 32, 4}, Isa::kScalar).is_ok());
}


// Packed matrices of 64 KiB to 2 MiB share 2 MiB-aligned slabs (common/huge_alloc.h): one
// after another in a slab, 64-byte aligned, never overlapping, and each slab goes back to the
// system with its last buffer, whatever order they are freed in.
TEST(HugeAlloc, MidSizedBuffersShareSlabsAndReleaseThem) {
  if (const char* e = std::getenv("KV_HUGEPAGES"); e && std::strcmp(e, "0") == 0) GTEST_SKIP() << "slabs off";
  const size_t before = huge_slabs();
  constexpr size_t kMiB = size_t(1) << 20;
  constexpr int kN = 40;  // 40 MiB: at least one new slab, at most two
  std::vector<uint8_t*> p(kN);
  for (int i = 0; i < kN; ++i) {
    p[i] = static_cast<uint8_t*>(huge_alloc(kMiB - 100));  // rounded up to 64 bytes: 1 MiB - 64
    ASSERT_EQ(reinterpret_cast<uintptr_t>(p[i]) % 64, 0u);
    std::memset(p[i], i + 1, kMiB - 100);
  }
  EXPECT_GE(huge_slabs(), before + 1);
  EXPECT_LE(huge_slabs(), before + 2);
  int breaks = 0;
  for (int i = 1; i < kN; ++i) {
    if (p[i] == p[i - 1] + (kMiB - 64)) continue;  // next in the same slab
    ++breaks;  // a new slab: its start is 2 MiB-aligned
    EXPECT_EQ(reinterpret_cast<uintptr_t>(p[i]) % (2 * kMiB), 0u) << i;
  }
  EXPECT_LE(breaks, 2);
  for (int i = 0; i < kN; ++i) {  // no buffer overlaps the next
    ASSERT_EQ(p[i][0], i + 1) << i;
    ASSERT_EQ(p[i][kMiB - 101], i + 1) << i;
  }
  std::mt19937 rng(3);
  std::shuffle(p.begin(), p.end(), rng);
  for (uint8_t* q : p) huge_free(q);
  EXPECT_EQ(huge_slabs(), before);
  // small and large buffers are not slab buffers
  void* small = huge_alloc(1000);
  void* large = huge_alloc(3 * kMiB);
  EXPECT_EQ(huge_slabs(), before);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(large) % (2 * kMiB), 0u);
  huge_free(small);
  huge_free(large);
  huge_free(nullptr);
}

// ThreadPool::deal / next: every unit is handed out exactly once, each thread's own range
// front to back, and a thread that falls behind is helped: its range's back goes to the others.
TEST(ThreadPoolSteal, EveryUnitOnceAndASlowThreadIsHelped) {
  for (int nth : {2, 3}) {
    ThreadPool pool(nth);
    for (int64_t n : {int64_t(0), int64_t(1), int64_t(2), int64_t(5), int64_t(997)}) {
      for (int64_t chunk : {int64_t(1), int64_t(7), int64_t(1000)}) {
        std::vector<std::atomic<int>> taken(static_cast<size_t>(n));
        std::vector<std::atomic<int>> by(static_cast<size_t>(n));
        std::vector<int64_t> last_begin(static_cast<size_t>(nth), -1);
        std::atomic<bool> own_in_order{true};
        pool.deal(n, chunk);
        pool.run([&](int ith, int run_nth) {
          ASSERT_EQ(run_nth, nth);
          int64_t own_b, own_e;
          ThreadPool::split(n, ith, nth, 1, &own_b, &own_e);
          int64_t b, e;
          while (pool.next(ith, &b, &e)) {
            ASSERT_LT(b, e);
            ASSERT_LE(e - b, std::max<int64_t>(1, chunk));
            if (b >= own_b && b < own_e) {  // its own: ascending
              if (b <= last_begin[static_cast<size_t>(ith)]) own_in_order = false;
              last_begin[static_cast<size_t>(ith)] = b;
            }
            for (int64_t i = b; i < e; ++i) {
              taken[static_cast<size_t>(i)].fetch_add(1);
              by[static_cast<size_t>(i)].store(ith);
            }
            // Thread 0 is slow: the others finish their ranges and take the back of its.
            if (ith == 0 && n > 100) std::this_thread::sleep_for(std::chrono::microseconds(200));
          }
        });
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(taken[static_cast<size_t>(i)].load(), 1) << "nth " << nth << " n " << n << " unit " << i;
        EXPECT_TRUE(own_in_order.load());
        if (n > 100 && chunk < 100) {
          int64_t b0, e0;
          ThreadPool::split(n, 0, nth, 1, &b0, &e0);
          int helped = 0;
          for (int64_t i = b0; i < e0; ++i) helped += by[static_cast<size_t>(i)].load() != 0;
          EXPECT_GT(helped, (e0 - b0) / 4) << "nth " << nth << " chunk " << chunk;
          EXPECT_EQ(by[static_cast<size_t>(b0)].load(), 0);  // its front stays its own
        }
      }
    }
  }
}

}  // namespace
}  // namespace kv
