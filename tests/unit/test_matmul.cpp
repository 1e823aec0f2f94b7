// matmul: every weight format × every ISA this CPU has × shapes that hit every tail.
//
// Three checks:
//  1. Against matmul_ref (exact: dequantized weights, double accumulation). The quantized
//     paths quantize activations to 8 bits per 32-block (q = round(x·127/amax)), an error of
//     at most amax_b/254 per element. The error on y[r,c] is bounded by
//       Σ_b (amax_b / 254) · Σ_{i∈b} |w_ci|        (plus float rounding, far smaller),
//     computed per output from the dequantized weights; we allow that bound ×1.05 + 2e-6·Σ|x·w|.
//     Tolerance for F32/F16/K-quant weights: float rounding only, 2e-6·Σ|x·w|.
//  2. Fast ISAs against the scalar path: same integers, same float steps in the same order,
//     so the result must be bit-identical (checked with memcmp).
//  3. Batch invariance: row r alone, inside any batch size, with 1 or 2 threads, gives the
//     same bits.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "common/thread_pool.h"
#include "kernels/matmul.h"
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

bool quantized(GgmlType t) { return t == GgmlType::Q4_0 || t == GgmlType::Q4_1 || t == GgmlType::Q8_0; }

// Checks y against the exact result with the tolerance documented at the top.
void expect_close_to_ref(GgmlType type, const RawMatrix& raw, const std::vector<float>& x, int64_t n_rows,
                         const std::vector<float>& y, const std::string& what) {
  const int64_t n_in = raw.n_in, n_out = raw.n_out;
  std::vector<float> ref(static_cast<size_t>(n_rows * n_out));
  matmul_ref(raw, x.data(), n_rows, ref.data());
  std::vector<float> wrow(static_cast<size_t>(n_in));
  const int64_t rb = row_bytes(type, n_in);
  int bad = 0;
  for (int64_t c = 0; c < n_out; ++c) {
    ASSERT_TRUE(dequantize_row_ref(type, static_cast<const uint8_t*>(raw.data) + c * rb, wrow.data(), n_in));
    for (int64_t r = 0; r < n_rows; ++r) {
      const float* xr = x.data() + r * n_in;
      double bound = 0, mag = 0;
      for (int64_t b = 0; b < n_in; b += 32) {
        double amax = 0, wsum = 0;
        for (int64_t i = b; i < b + 32 && i < n_in; ++i) {
          amax = std::max(amax, std::fabs(static_cast<double>(xr[i])));
          wsum += std::fabs(static_cast<double>(wrow[static_cast<size_t>(i)]));
          mag += std::fabs(static_cast<double>(xr[i]) * wrow[static_cast<size_t>(i)]);
        }
        bound += amax / 254.0 * wsum;
      }
      const double tol = (quantized(type) ? bound * 1.05 : 0.0) + 2e-6 * mag + 1e-30;
      const double got = y[static_cast<size_t>(r * n_out + c)], want = ref[static_cast<size_t>(r * n_out + c)];
      if (!(std::fabs(got - want) <= tol) && bad++ < 5)
        ADD_FAILURE() << what << " r=" << r << " c=" << c << " got " << got << " want " << want << " tol " << tol;
    }
  }
  EXPECT_EQ(bad, 0) << what;
}

struct Case {
  GgmlType type;
  std::vector<int64_t> n_ins;
};

class MatmulTest : public ::testing::Test {
 protected:
  ThreadPool pool1_{1};
  ThreadPool pool2_{2};
};

TEST_F(MatmulTest, AllFormatsIsasShapesAgainstRefAndScalar) {
  std::mt19937 rng(1234);
  const std::vector<Case> cases = {
      {GgmlType::Q4_1, {32, 64, 96, 576, 1536}}, {GgmlType::Q8_0, {32, 64, 96, 576, 1536}},
      {GgmlType::Q4_0, {32, 96, 576}},           {GgmlType::F32, {32, 7, 96, 576}},
      {GgmlType::F16, {32, 17, 576}},            {GgmlType::Q4_K, {256, 512}},
      {GgmlType::Q6_K, {256, 512}},
  };
  const std::vector<int64_t> n_outs = {1, 3, 15, 16, 17, 63, 64, 65, 960};
  const std::vector<int64_t> rows_list = {1, 2, 3, 4, 5, 7, 8, 33};
  const std::vector<Isa> all_isas = isas();
  int n_checked = 0;
  for (const Case& cs : cases) {
    for (int64_t n_in : cs.n_ins) {
      for (int64_t n_out : n_outs) {
        // Keep the exhaustive grid quick: the widest shapes only with a few row counts.
        auto w = random_weights(cs.type, n_in, n_out, rng);
        RawMatrix raw{cs.type, w.data(), n_in, n_out};
        std::vector<float> x = random_x(33 * n_in, rng);
        for (int64_t n_rows : rows_list) {
          if (n_in * n_out > 100000 && n_rows != 1 && n_rows != 5 && n_rows != 33) continue;
          std::vector<float> y_scalar;
          for (Isa isa : all_isas) {
            auto p = PackedMatrix::pack(raw, isa);
            ASSERT_TRUE(p.is_ok()) << p.message();
            EXPECT_EQ(p->n_out(), n_out);
            for (ThreadPool* pool : {&pool1_, &pool2_}) {
              std::vector<float> y(static_cast<size_t>(n_rows * n_out), -1.0f);
              matmul(*p, x.data(), n_rows, y.data(), *pool);
              std::string what = std::string(type_name(cs.type)) + " " + isa_name(isa) + " n_in=" +
                                 std::to_string(n_in) + " n_out=" + std::to_string(n_out) +
                                 " rows=" + std::to_string(n_rows) + " threads=" + std::to_string(pool->size());
              if (y_scalar.empty()) {
                expect_close_to_ref(cs.type, raw, x, n_rows, y, what);
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
  EXPECT_GT(n_checked, 1000);
}

TEST_F(MatmulTest, BatchInvariance) {
  std::mt19937 rng(99);
  for (GgmlType type : {GgmlType::Q4_1, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::F32}) {
    const int64_t n_in = 576, n_out = 200, max_rows = 70;
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
                << type_name(type) << " " << isa_name(isa) << " rows=" << n_rows << " off=" << off
                << " threads=" << pool->size();
          }
        }
      }
    }
  }
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

TEST_F(MatmulTest, PackRejectsBadInput) {
  std::vector<uint8_t> w(20 * 4);
  EXPECT_FALSE(PackedMatrix::pack(std::vector<RawMatrix>{}, Isa::kScalar).is_ok());
  EXPECT_FALSE(PackedMatrix::pack(RawMatrix{GgmlType::Q4_1, w.data(), 48, 2}, Isa::kScalar).is_ok());
  EXPECT_FALSE(PackedMatrix::pack({RawMatrix{GgmlType::Q4_1, w.data(), 32, 2}, RawMatrix{GgmlType::Q8_0, w.data(), 32, 1}},
                                  Isa::kScalar)
                   .is_ok());
  EXPECT_FALSE(PackedMatrix::pack({RawMatrix{GgmlType::Q4_1, w.data(), 32, 2}, RawMatrix{GgmlType::Q4_1, w.data(), 64, 1}},
                                  Isa::kScalar)
                   .is_ok());
  EXPECT_FALSE(PackedMatrix::pack(RawMatrix{GgmlType::Q5_1, w.data(), 32, 2}, Isa::kScalar).is_ok());
  EXPECT_TRUE(PackedMatrix::pack(RawMatrix{GgmlType::Q4_1, w.data(), 32, 4}, Isa::kScalar).is_ok());
}

}  // namespace
}  // namespace kv
