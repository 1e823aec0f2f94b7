// The reference dequantizers and fp16/bf16 conversions against an independent implementation:
// golden data written by tests/reference/make_dequant_golden.py from the `gguf` Python package
// (gguf.quants.dequantize) and numpy, over real tensors of the two test models.
//
// Stored rows must match bit for bit: every product in the dequantization formulas is exact in
// float32 and both sides apply the single final rounding (the add of a min) in the same order,
// so there is no legitimate 1-ulp slack (see quant_ref.cpp). The full-tensor checksums differ
// only by summation order (numpy pairwise vs compensated here), hence the tight tolerance.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <immintrin.h>
#include <fstream>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <vector>

#include "kernels/isa.h"
#include "gguf/gguf.h"
#include "kernels/quant.h"

namespace kv {
namespace {

namespace fs = std::filesystem;

const std::string kRoot = KV_SOURCE_DIR;
const std::string kGoldenDir = kRoot + "/tests/data/dequant_golden";

class ByteReader {
 public:
  explicit ByteReader(std::vector<char> b) : b_(std::move(b)) {}
  template <typename T>
  T get() {
    T v{};
    if (pos_ + sizeof(T) > b_.size()) {
      ok_ = false;
      return v;
    }
    std::memcpy(&v, b_.data() + pos_, sizeof(T));
    pos_ += sizeof(T);
    return v;
  }
  std::string str(size_t n) {
    if (pos_ + n > b_.size()) {
      ok_ = false;
      return {};
    }
    std::string s(b_.data() + pos_, n);
    pos_ += n;
    return s;
  }
  bool ok() const { return ok_; }
  bool at_end() const { return pos_ == b_.size(); }

 private:
  std::vector<char> b_;
  size_t pos_ = 0;
  bool ok_ = true;
};

std::vector<char> read_all(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::vector<char>(std::istreambuf_iterator<char>(f), {});
}

struct Golden {
  std::string file;
  uint32_t type = 0;
  std::vector<int64_t> ne;
  std::string name, model;
  double sum = 0, sum_abs = 0, sum_sq = 0;
  std::vector<int64_t> rows;
  std::vector<float> values;  // [rows.size()][ne[0]]
};

bool load_golden(const std::string& path, Golden* g) {
  ByteReader r(read_all(path));
  if (r.str(8) != "KVDQGLD1") return false;
  g->file = path;
  g->type = r.get<uint32_t>();
  const uint32_t n_dims = r.get<uint32_t>();
  if (!r.ok() || n_dims == 0 || n_dims > 4) return false;
  for (uint32_t i = 0; i < n_dims; ++i) g->ne.push_back(r.get<int64_t>());
  g->name = r.str(r.get<uint16_t>());
  g->model = r.str(r.get<uint16_t>());
  g->sum = r.get<double>();
  g->sum_abs = r.get<double>();
  g->sum_sq = r.get<double>();
  const uint32_t n_rows = r.get<uint32_t>();
  if (!r.ok() || n_rows > 16) return false;
  for (uint32_t i = 0; i < n_rows; ++i) g->rows.push_back(r.get<int64_t>());
  g->values.resize(static_cast<size_t>(n_rows * g->ne[0]));
  for (auto& v : g->values) v = r.get<float>();
  return r.ok() && r.at_end();
}

// Neumaier-compensated sum: error ~eps·sum|x| independent of n, so the only difference left
// against numpy's pairwise sum is numpy's own O(log n · eps) error.
struct Accum {
  double s = 0, c = 0;
  void add(double x) {
    const double t = s + x;
    c += std::fabs(s) >= std::fabs(x) ? (s - t) + x : (x - t) + s;
    s = t;
  }
  double value() const { return s + c; }
};

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

TEST(DequantGolden, RealTensorsMatchGgufPackage) {
  ASSERT_TRUE(fs::is_directory(kGoldenDir))
      << kGoldenDir << " missing: run python3 tests/reference/make_dequant_golden.py";
  std::map<std::string, std::unique_ptr<GgufFile>> models;
  std::set<std::string> types_seen;
  int n_files = 0;
  for (const auto& entry : fs::directory_iterator(kGoldenDir)) {
    if (entry.path().filename() == "conversions.bin" || entry.path().extension() != ".bin")
      continue;
    Golden g;
    ASSERT_TRUE(load_golden(entry.path().string(), &g)) << "malformed golden file " << entry.path();
    SCOPED_TRACE(g.model + " : " + g.name);
    ++n_files;

    auto& model = models[g.model];
    if (!model) {
      const std::string path = kRoot + "/" + g.model;
      ASSERT_TRUE(fs::exists(path)) << path << " is missing: run `make models`";
      auto opened = GgufFile::open(path);
      ASSERT_TRUE(opened.is_ok()) << opened.message();
      model = std::move(opened.value());
    }
    const GgufTensor* t = model->find_tensor(g.name);
    ASSERT_NE(t, nullptr) << "tensor not in model (model file changed? regenerate the golden)";
    ASSERT_EQ(static_cast<uint32_t>(t->type), g.type);
    ASSERT_EQ(t->ne, g.ne);
    types_seen.insert(type_name(t->type));

    const int64_t ne0 = t->ne[0];
    const int64_t n_rows = t->n_elements / ne0;
    const int64_t rb = row_bytes(t->type, ne0);
    std::vector<float> row(static_cast<size_t>(ne0));  // [ne0]

    // Stored rows: bit-identical.
    for (size_t k = 0; k < g.rows.size(); ++k) {
      ASSERT_TRUE(dequantize_row_ref(t->type, t->data + g.rows[k] * rb, row.data(), ne0));
      const float* want = g.values.data() + k * ne0;
      int64_t n_diff = 0, first = -1;
      for (int64_t i = 0; i < ne0; ++i) {
        if (bits_of(row[i]) != bits_of(want[i])) {
          if (first < 0) first = i;
          ++n_diff;
        }
      }
      EXPECT_EQ(n_diff, 0) << "row " << g.rows[k] << ": first mismatch at element " << first
                           << " (block " << first / type_block_elems(t->type) << "): got "
                           << (first >= 0 ? row[first] : 0) << " want "
                           << (first >= 0 ? want[first] : 0);
    }

    // Whole tensor: checksums.
    Accum s, sa, ss;
    for (int64_t r = 0; r < n_rows; ++r) {
      ASSERT_TRUE(dequantize_row_ref(t->type, t->data + r * rb, row.data(), ne0));
      for (float v : row) {
        const double x = v;
        s.add(x);
        sa.add(std::fabs(x));
        ss.add(x * x);
      }
    }
    // Relative to sum|x| (the sum itself may cancel). 1e-12 is ~10^4 eps: far above numpy's
    // pairwise-summation error, far below any single wrong element of these tensors.
    EXPECT_NEAR(s.value(), g.sum, 1e-12 * g.sum_abs);
    EXPECT_NEAR(sa.value(), g.sum_abs, 1e-12 * g.sum_abs);
    EXPECT_NEAR(ss.value(), g.sum_sq, 1e-12 * g.sum_sq);
  }
  EXPECT_GE(n_files, 10) << "golden files missing: run python3 tests/reference/make_dequant_golden.py";
  for (const char* want : {"F32", "Q8_0", "Q4_1", "Q4_K", "Q6_K", "Q5_0"})
    EXPECT_TRUE(types_seen.count(want)) << "no golden tensor of type " << want;
}

// ---- fp16 / bf16 ----------------------------------------------------------------------------

struct ConvCase {
  uint32_t f;
  uint16_t h;
  uint16_t b;
};

bool load_conversions(uint64_t* table_hash, std::vector<ConvCase>* cases) {
  ByteReader r(read_all(kGoldenDir + "/conversions.bin"));
  if (r.str(8) != "KVCONV01") return false;
  *table_hash = r.get<uint64_t>();
  const uint32_t n = r.get<uint32_t>();
  if (!r.ok() || n > (1u << 20)) return false;
  cases->resize(n);
  for (auto& c : *cases) {
    c.f = r.get<uint32_t>();
    c.h = r.get<uint16_t>();
    c.b = r.get<uint16_t>();
  }
  return r.ok() && r.at_end();
}

float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// An independent spelling of the IEEE half definition, in double arithmetic.
double half_value(uint16_t h) {
  const int s = h >> 15, e = (h >> 10) & 31, m = h & 1023;
  const double mag = e == 0 ? std::ldexp(m, -24) : std::ldexp(1024 + m, e - 25);
  return s ? -mag : mag;
}

TEST(Fp16, ExhaustiveToFp32MatchesNumpyAndDefinition) {
  uint64_t want_hash = 0;
  std::vector<ConvCase> cases;
  ASSERT_TRUE(load_conversions(&want_hash, &cases)) << "run python3 tests/reference/make_dequant_golden.py";
  uint64_t h = 0xCBF29CE484222325ull;  // FNV-1a 64 over the little-endian float32 table
  for (uint32_t i = 0; i < 65536; ++i) {
    const float f = fp16_to_fp32(static_cast<uint16_t>(i));
    const uint32_t u = bits_of(f);
    for (int k = 0; k < 4; ++k) {
      h ^= (u >> (8 * k)) & 0xFF;
      h *= 0x100000001B3ull;
    }
    const int e = (i >> 10) & 31;
    if (e == 31) {
      if ((i & 1023) == 0) EXPECT_TRUE(std::isinf(f) && std::signbit(f) == bool(i >> 15)) << i;
      else EXPECT_TRUE(std::isnan(f)) << i;
    } else {
      ASSERT_EQ(static_cast<double>(f), half_value(static_cast<uint16_t>(i))) << i;
      ASSERT_EQ(std::signbit(f), bool(i >> 15)) << i;  // -0 stays -0
    }
  }
  EXPECT_EQ(h, want_hash) << "differs from numpy's float16->float32 table (NaN payloads?)";
}

TEST(Fp16, ExhaustiveRoundTrip) {
  for (uint32_t i = 0; i < 65536; ++i) {
    const uint16_t h = static_cast<uint16_t>(i);
    const uint16_t back = fp32_to_fp16(fp16_to_fp32(h));
    if (((i >> 10) & 31) == 31 && (i & 1023) != 0) {
      // NaN: stays NaN, sign and top payload kept, quiet bit forced.
      EXPECT_EQ(back, h | 0x200) << i;
    } else {
      ASSERT_EQ(back, h) << i;
    }
  }
}

TEST(Fp16, FromFp32MatchesNumpyOnRoundingCases) {
  uint64_t hash = 0;
  std::vector<ConvCase> cases;
  ASSERT_TRUE(load_conversions(&hash, &cases));
  ASSERT_GT(cases.size(), 1000u);
  int n_nan = 0;
  for (const auto& c : cases) {
    const float f = from_bits(c.f);
    const uint16_t got = fp32_to_fp16(f);
    if (std::isnan(f)) {
      // NaN payload policies differ (numpy keeps the payload unquieted, F16C quiets it);
      // both must stay NaN with the sign.
      EXPECT_TRUE(std::isnan(fp16_to_fp32(got)));
      EXPECT_EQ(got >> 15, c.h >> 15);
      ++n_nan;
      continue;
    }
    ASSERT_EQ(got, c.h) << "f32 bits 0x" << std::hex << c.f << " (" << f << ")";
  }
  EXPECT_GT(n_nan, 0);
}

TEST(Bf16, FromFp32MatchesGgufPackage) {
  uint64_t hash = 0;
  std::vector<ConvCase> cases;
  ASSERT_TRUE(load_conversions(&hash, &cases));
  for (const auto& c : cases)
    ASSERT_EQ(fp32_to_bf16(from_bits(c.f)), c.b) << "f32 bits 0x" << std::hex << c.f;
}

TEST(Bf16, ExhaustiveRoundTripAndDequant) {
  std::vector<uint16_t> all(65536);  // [65536] every bf16 bit pattern
  for (uint32_t i = 0; i < 65536; ++i) all[i] = static_cast<uint16_t>(i);
  std::vector<float> out(65536);
  ASSERT_TRUE(dequantize_row_ref(GgmlType::BF16, all.data(), out.data(), 65536));
  for (uint32_t i = 0; i < 65536; ++i) {
    ASSERT_EQ(bits_of(out[i]), i << 16);
    const uint16_t back = fp32_to_bf16(out[i]);
    const bool nan = ((i >> 7) & 0xFF) == 0xFF && (i & 0x7F) != 0;
    ASSERT_EQ(back, nan ? (i | 64) : i) << i;
  }
}

// fp32 -> fp16 against the hardware converter (an implementation sharing nothing with ours)
// over a dense strided sweep of all float32 bit patterns.
__attribute__((target("f16c"))) uint16_t hw_fp32_to_fp16(float f) {
  return static_cast<uint16_t>(_cvtss_sh(f, 0));  // 0 = round to nearest even
}

TEST(Fp16, FromFp32MatchesF16cSweep) {
  if (!kv::cpu_has_f16c()) GTEST_SKIP() << "CPU without F16C";
  int64_t n = 0;
  // Stride 997 (prime) visits every exponent and many mantissa residues: ~4.3M cases.
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 997, ++n) {
    const float f = from_bits(static_cast<uint32_t>(u));
    const uint16_t want = hw_fp32_to_fp16(f);
    const uint16_t got = fp32_to_fp16(f);
    if (got != want) {
      FAIL() << "f32 bits 0x" << std::hex << u << ": got 0x" << got << " want 0x" << want;
    }
  }
  EXPECT_GT(n, 4000000);
}

}  // namespace
}  // namespace kv
