// GGUF reader: round trips through a hand-written in-memory GGUF, every hostile case the
// reader promises to reject with a message naming the problem, and the real models.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>
#include <vector>

#include "gguf/gguf.h"

namespace kv {
namespace {

using Bytes = std::vector<uint8_t>;

template <typename T>
void put(Bytes& b, T x) {
  uint8_t tmp[sizeof(T)];
  std::memcpy(tmp, &x, sizeof(T));
  b.insert(b.end(), tmp, tmp + sizeof(T));
}
void put_str(Bytes& b, const std::string& s) {
  put<uint64_t>(b, s.size());
  b.insert(b.end(), s.begin(), s.end());
}
void append(Bytes& b, const Bytes& more) { b.insert(b.end(), more.begin(), more.end()); }

// Encoded payloads of one value (without its type tag).
template <typename T>
Bytes scalar(T x) {
  Bytes b;
  put(b, x);
  return b;
}
Bytes str_payload(const std::string& s) {
  Bytes b;
  put_str(b, s);
  return b;
}
// An array header (element type, count) followed by already-encoded elements.
Bytes arr_payload(GgufType elem, uint64_t count, const Bytes& elems) {
  Bytes b;
  put<uint32_t>(b, static_cast<uint32_t>(elem));
  put<uint64_t>(b, count);
  append(b, elems);
  return b;
}

// Writes a GGUF file by hand. Tensor data is laid out at aligned offsets; the last tensor
// ends exactly at the end of the file, so every proper prefix of a file with tensors is
// truncated somewhere that matters.
struct GgufWriter {
  struct Tensor {
    std::string name;
    std::vector<uint64_t> ne;
    uint32_t type;
    Bytes data;
    int64_t offset = -1;  // -1: computed
  };
  uint32_t version = 3;
  uint64_t layout_alignment = 32;
  Bytes kv_bytes;
  uint64_t n_kv = 0;
  std::vector<Tensor> tensors;
  int64_t n_kv_override = -1, n_tensors_override = -1;
  bool write_data = true;  // false: stop after the tensor infos (hostile offsets)

  GgufWriter& kv(const std::string& key, GgufType t, const Bytes& payload) {
    put_str(kv_bytes, key);
    put<uint32_t>(kv_bytes, static_cast<uint32_t>(t));
    append(kv_bytes, payload);
    ++n_kv;
    return *this;
  }
  GgufWriter& kv_raw_type(const std::string& key, uint32_t t, const Bytes& payload) {
    put_str(kv_bytes, key);
    put<uint32_t>(kv_bytes, t);
    append(kv_bytes, payload);
    ++n_kv;
    return *this;
  }
  GgufWriter& tensor(const std::string& name, std::vector<uint64_t> ne, GgmlType type, int64_t offset = -1) {
    uint64_t n = 1;
    for (auto d : ne) n *= d;
    TypeTraits tt{};
    uint64_t n_bytes = 0;
    if (type_traits(static_cast<uint32_t>(type), &tt) && n % tt.block_elems == 0 && n < (1u << 20))
      n_bytes = n / tt.block_elems * tt.block_bytes;
    Bytes data(n_bytes);
    for (size_t k = 0; k < data.size(); ++k) data[k] = static_cast<uint8_t>(k * 7 + tensors.size());
    tensors.push_back({name, std::move(ne), static_cast<uint32_t>(type), std::move(data), offset});
    return *this;
  }

  Bytes build() const {
    Bytes b{'G', 'G', 'U', 'F'};
    put<uint32_t>(b, version);
    put<uint64_t>(b, n_tensors_override >= 0 ? n_tensors_override : tensors.size());
    put<uint64_t>(b, n_kv_override >= 0 ? n_kv_override : n_kv);
    append(b, kv_bytes);
    std::vector<uint64_t> offsets;
    uint64_t off = 0;
    for (const auto& t : tensors) {
      uint64_t o = t.offset >= 0 ? static_cast<uint64_t>(t.offset) : off;
      offsets.push_back(o);
      off = (o + t.data.size() + layout_alignment - 1) / layout_alignment * layout_alignment;
    }
    for (size_t k = 0; k < tensors.size(); ++k) {
      const auto& t = tensors[k];
      put_str(b, t.name);
      put<uint32_t>(b, static_cast<uint32_t>(t.ne.size()));
      for (auto d : t.ne) put<uint64_t>(b, d);
      put<uint32_t>(b, t.type);
      put<uint64_t>(b, offsets[k]);
    }
    if (tensors.empty() || !write_data) return b;
    while (b.size() % layout_alignment) b.push_back(0);
    size_t data_start = b.size();
    for (size_t k = 0; k < tensors.size(); ++k) {
      size_t end = data_start + offsets[k] + tensors[k].data.size();
      if (b.size() < end) b.resize(end, 0);
      if (!tensors[k].data.empty())
        std::memcpy(b.data() + data_start + offsets[k], tensors[k].data.data(), tensors[k].data.size());
    }
    return b;
  }
};

Result<std::unique_ptr<GgufFile>> parse(const Bytes& b) { return GgufFile::parse(b.data(), b.size()); }

// Expects a parse error whose message contains `needle`.
void expect_error(const Bytes& b, const std::string& needle) {
  auto r = parse(b);
  ASSERT_FALSE(r) << "parsed a file that should fail with '" << needle << "'";
  EXPECT_NE(r.message().find(needle), std::string::npos) << "message: " << r.message();
}

// A small valid file with every value type, nested arrays and two tensors.
GgufWriter small_file() {
  GgufWriter w;
  w.kv("general.architecture", GgufType::STRING, str_payload("llama"));
  w.kv("t.u8", GgufType::U8, scalar<uint8_t>(200));
  w.kv("t.i8", GgufType::I8, scalar<int8_t>(-5));
  w.kv("t.u16", GgufType::U16, scalar<uint16_t>(60000));
  w.kv("t.i16", GgufType::I16, scalar<int16_t>(-30000));
  w.kv("t.u32", GgufType::U32, scalar<uint32_t>(4000000000u));
  w.kv("t.i32", GgufType::I32, scalar<int32_t>(-2000000000));
  w.kv("t.f32", GgufType::F32, scalar<float>(1.5f));
  w.kv("t.bool", GgufType::BOOL, scalar<uint8_t>(1));
  w.kv("t.string", GgufType::STRING, str_payload("h\xc3\xa9llo"));
  w.kv("t.u64", GgufType::U64, scalar<uint64_t>(18000000000000000000ull));
  w.kv("t.i64", GgufType::I64, scalar<int64_t>(std::numeric_limits<int64_t>::min()));
  w.kv("t.f64", GgufType::F64, scalar<double>(3.141592653589793));
  Bytes ints;
  for (int32_t x : {1, -2, 3}) put(ints, x);
  w.kv("t.arr_i32", GgufType::ARRAY, arr_payload(GgufType::I32, 3, ints));
  Bytes strs;
  put_str(strs, "a");
  put_str(strs, "bc");
  put_str(strs, "");
  w.kv("t.arr_str", GgufType::ARRAY, arr_payload(GgufType::STRING, 3, strs));
  // [[1, 2], [3]] of u8
  Bytes inner = arr_payload(GgufType::U8, 2, {1, 2});
  append(inner, arr_payload(GgufType::U8, 1, {3}));
  w.kv("t.arr_nested", GgufType::ARRAY, arr_payload(GgufType::ARRAY, 2, inner));
  w.kv("t.arr_empty", GgufType::ARRAY, arr_payload(GgufType::F32, 0, {}));
  w.tensor("a.weight", {4, 2}, GgmlType::F32);
  w.tensor("b.weight", {32, 3}, GgmlType::Q8_0);
  return w;
}

TEST(Gguf, RoundTripEveryValueType) {
  auto r = parse(small_file().build());
  ASSERT_TRUE(r) << r.message();
  const GgufFile& f = **r;
  EXPECT_EQ(f.version(), 3u);
  ASSERT_EQ(f.keys().size(), 17u);
  EXPECT_EQ(f.keys()[0], "general.architecture");
  EXPECT_EQ(f.keys()[16], "t.arr_empty");

  EXPECT_EQ(f.get_string("general.architecture", "").value(), "llama");
  EXPECT_EQ(f.find("t.u8")->type, GgufType::U8);
  EXPECT_EQ(f.get_int("t.u8", 0).value(), 200);
  EXPECT_EQ(f.get_int("t.i8", 0).value(), -5);
  EXPECT_EQ(f.get_int("t.u16", 0).value(), 60000);
  EXPECT_EQ(f.get_int("t.i16", 0).value(), -30000);
  EXPECT_EQ(f.get_int("t.u32", 0).value(), 4000000000LL);
  EXPECT_EQ(f.get_int("t.i32", 0).value(), -2000000000);
  EXPECT_EQ(f.get_float("t.f32", 0).value(), 1.5);
  EXPECT_EQ(f.get_bool("t.bool", false).value(), true);
  EXPECT_EQ(f.get_string("t.string", "").value(), "h\xc3\xa9llo");
  EXPECT_EQ(f.find("t.u64")->u, 18000000000000000000ull);
  EXPECT_FALSE(f.get_int("t.u64", 0)) << "a u64 beyond int64 must not wrap silently";
  EXPECT_EQ(f.get_int("t.i64", 0).value(), std::numeric_limits<int64_t>::min());
  EXPECT_DOUBLE_EQ(f.get_float("t.f64", 0).value(), 3.141592653589793);

  const GgufValue* a = f.find("t.arr_i32");
  ASSERT_TRUE(a);
  EXPECT_EQ(a->type, GgufType::ARRAY);
  EXPECT_EQ(a->arr_type, GgufType::I32);
  ASSERT_EQ(a->arr.size(), 3u);
  EXPECT_EQ(a->arr[1].i, -2);
  const GgufValue* s = f.find("t.arr_str");
  ASSERT_EQ(s->arr.size(), 3u);
  EXPECT_EQ(s->arr[1].str, "bc");
  EXPECT_EQ(s->arr[2].str, "");
  const GgufValue* n = f.find("t.arr_nested");
  ASSERT_EQ(n->arr_type, GgufType::ARRAY);
  ASSERT_EQ(n->arr.size(), 2u);
  ASSERT_EQ(n->arr[0].arr.size(), 2u);
  EXPECT_EQ(n->arr[0].arr[1].u, 2u);
  ASSERT_EQ(n->arr[1].arr.size(), 1u);
  EXPECT_EQ(n->arr[1].arr[0].u, 3u);
  EXPECT_EQ(f.find("t.arr_empty")->arr.size(), 0u);
  EXPECT_FALSE(n->to_string().empty());

  // Defaults and type mismatches.
  EXPECT_EQ(f.get_int("missing", 7).value(), 7);
  auto bad = f.get_int("t.string", 0);
  ASSERT_FALSE(bad);
  EXPECT_NE(bad.message().find("should be a number"), std::string::npos);
  EXPECT_FALSE(f.get_string("t.u8", ""));
}

TEST(Gguf, TensorDirectory) {
  GgufWriter w = small_file();
  Bytes b = w.build();
  auto r = parse(b);
  ASSERT_TRUE(r) << r.message();
  const GgufFile& f = **r;
  ASSERT_EQ(f.tensors().size(), 2u);
  EXPECT_EQ(f.data_offset() % 32, 0u);
  const GgufTensor* t = f.find_tensor("b.weight");
  ASSERT_TRUE(t);
  EXPECT_EQ(t->type, GgmlType::Q8_0);
  EXPECT_EQ(t->ne, (std::vector<int64_t>{32, 3}));
  EXPECT_EQ(t->n_elements, 96);
  EXPECT_EQ(t->rows(), 3);
  EXPECT_EQ(t->n_bytes, 3u * 34u);
  EXPECT_EQ(t->offset, 32u);  // F32 [4, 2] = 32 bytes, already aligned
  EXPECT_EQ(t->data, b.data() + f.data_offset() + 32);
  EXPECT_EQ(std::memcmp(t->data, w.tensors[1].data.data(), t->n_bytes), 0);
  EXPECT_EQ(f.find_tensor("a.weight")->n_bytes, 32u);
  EXPECT_EQ(f.find_tensor("nope"), nullptr);
}

TEST(Gguf, Versions2And3) {
  for (uint32_t v : {2u, 3u}) {
    GgufWriter w = small_file();
    w.version = v;
    auto r = parse(w.build());
    ASSERT_TRUE(r) << "v" << v << ": " << r.message();
    EXPECT_EQ((*r)->version(), v);
    EXPECT_EQ((*r)->tensors().size(), 2u);
  }
}

TEST(Gguf, AlignmentHonoured) {
  GgufWriter w;
  w.layout_alignment = 256;
  w.kv("general.alignment", GgufType::U32, scalar<uint32_t>(256));
  w.tensor("x", {3}, GgmlType::F32);   // 12 bytes, next one goes to 256
  w.tensor("y", {5}, GgmlType::F16);
  Bytes b = w.build();
  auto r = parse(b);
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ((*r)->alignment(), 256u);
  EXPECT_EQ((*r)->data_offset() % 256, 0u);
  EXPECT_EQ((*r)->find_tensor("y")->offset, 256u);
  EXPECT_EQ((*r)->find_tensor("y")->data, b.data() + (*r)->data_offset() + 256);

  // An offset aligned to 32 but not to the declared 256 is rejected.
  GgufWriter w2 = w;
  w2.tensors[1].offset = 32;
  expect_error(w2.build(), "not aligned to 256");

  for (uint32_t bad : {0u, 3u, 48u}) {
    GgufWriter w3;
    w3.kv("general.alignment", GgufType::U32, scalar<uint32_t>(bad));
    expect_error(w3.build(), "power of two");
  }
  GgufWriter w4;
  w4.kv("general.alignment", GgufType::STRING, str_payload("32"));
  expect_error(w4.build(), "power of two");
}

TEST(Gguf, EmptyFileWithNoTensorsOrMetadata) {
  GgufWriter w;
  auto r = parse(w.build());
  ASSERT_TRUE(r) << r.message();
  EXPECT_TRUE((*r)->tensors().empty());
  EXPECT_TRUE((*r)->keys().empty());
}

// ---- hostile files --------------------------------------------------------------------

TEST(GgufHostile, WrongMagic) {
  Bytes b = small_file().build();
  b[0] = 'X';
  expect_error(b, "not a GGUF");
  expect_error(Bytes{'G', 'G'}, "not a GGUF");
  expect_error(Bytes{}, "not a GGUF");
  std::string text = "<html>not a model</html>";
  expect_error(Bytes(text.begin(), text.end()), "not a GGUF");
}

TEST(GgufHostile, Version1AndUnknownVersions) {
  GgufWriter w = small_file();
  w.version = 1;
  expect_error(w.build(), "version 1 is not supported");
  w.version = 4;
  expect_error(w.build(), "unsupported GGUF version 4");
  w.version = 0;
  expect_error(w.build(), "unsupported GGUF version 0");
  w.version = 3u << 24;
  expect_error(w.build(), "big-endian");
}

TEST(GgufHostile, TruncatedAtEveryByte) {
  Bytes full = small_file().build();
  ASSERT_TRUE(parse(full));
  for (size_t n = 0; n < full.size(); ++n) {
    // A fresh heap copy of exactly n bytes so ASan sees any read past the prefix.
    std::unique_ptr<uint8_t[]> p(new uint8_t[n + 1]);
    std::memcpy(p.get(), full.data(), n);
    auto r = GgufFile::parse(p.get(), n);
    ASSERT_FALSE(r) << "prefix of " << n << " of " << full.size() << " bytes parsed";
    const std::string& m = r.message();
    EXPECT_TRUE(m.find("truncated") != std::string::npos || m.find("past the end") != std::string::npos ||
                m.find("exceeds what the file can hold") != std::string::npos ||
                m.find("not a GGUF") != std::string::npos)
        << "prefix " << n << ": " << m;
  }
}

TEST(GgufHostile, BitFlipsNeverCrash) {
  Bytes full = small_file().build();
  int parsed = 0, failed = 0;
  for (size_t k = 0; k < full.size(); ++k) {
    for (int bit = 0; bit < 8; ++bit) {
      Bytes b = full;
      b[k] ^= static_cast<uint8_t>(1u << bit);
      auto r = parse(b);
      if (r) {
        ++parsed;
        // Touch everything the parser handed out.
        for (const auto& [key, v] : (*r)->metadata()) (void)v.to_string();
        for (const auto& t : (*r)->tensors()) {
          ASSERT_GE(t.data, b.data());
          ASSERT_LE(t.data + t.n_bytes, b.data() + b.size());
        }
      } else {
        ++failed;
        EXPECT_FALSE(r.message().empty());
      }
    }
  }
  EXPECT_GT(parsed, 0);  // flips in values and data bytes still parse
  EXPECT_GT(failed, 0);
}

TEST(GgufHostile, AbsurdCounts) {
  GgufWriter w = small_file();
  w.n_kv_override = int64_t{1} << 60;
  expect_error(w.build(), "metadata count");
  GgufWriter w2 = small_file();
  w2.n_tensors_override = int64_t{1} << 62;
  expect_error(w2.build(), "tensor count");
  // A count that fits the bound but not the content still ends as truncation, not a crash.
  GgufWriter w3 = small_file();
  w3.n_kv_override = 40;
  EXPECT_FALSE(parse(w3.build()));
}

TEST(GgufHostile, StringLengthPastEnd) {
  GgufWriter w;
  Bytes p;
  put<uint64_t>(p, 1000);
  p.insert(p.end(), {'a', 'b'});
  w.kv("general.name", GgufType::STRING, p);
  expect_error(w.build(), "runs past the end");
  GgufWriter w2;
  Bytes p2;
  put<uint64_t>(p2, ~uint64_t{0});
  w2.kv("general.name", GgufType::STRING, p2);
  expect_error(w2.build(), "string length");
  // The key itself.
  Bytes b = GgufWriter{}.build();
  b[16] = 1;  // n_kv = 1
  put<uint64_t>(b, uint64_t{1} << 63);
  b.resize(b.size() + 16, 0);
  expect_error(b, "metadata key: string length");
}

TEST(GgufHostile, ArrayCountPastEnd) {
  GgufWriter w;
  w.kv("tokenizer.ggml.tokens", GgufType::ARRAY, arr_payload(GgufType::STRING, uint64_t{1} << 61, {}));
  expect_error(w.build(), "array count");
  GgufWriter w2;
  w2.kv("x", GgufType::ARRAY, arr_payload(GgufType::U8, 100, {1, 2, 3}));
  expect_error(w2.build(), "exceeds what the file can hold");
}

TEST(GgufHostile, MetadataValueBudget) {
  // 1-byte elements cost ~100 bytes each in memory: past 4M values the file is refused even
  // though it holds the bytes, so a big hostile file cannot make us allocate 100x its size.
  const uint64_t n = (uint64_t{1} << 22) + 1;
  GgufWriter w;
  w.kv("huge", GgufType::ARRAY, arr_payload(GgufType::U8, n, Bytes(n, 0)));
  expect_error(w.build(), "metadata values per file");
  // The budget is per file, not per array.
  const uint64_t half = (uint64_t{1} << 21) + 1;
  GgufWriter w2;
  w2.kv("a", GgufType::ARRAY, arr_payload(GgufType::U8, half, Bytes(half, 0)));
  w2.kv("b", GgufType::ARRAY, arr_payload(GgufType::U8, half, Bytes(half, 0)));
  expect_error(w2.build(), "metadata values per file");
}

TEST(GgufHostile, NestedArrayDepthBomb) {
  // 64 levels of single-element arrays.
  Bytes inner = arr_payload(GgufType::U8, 1, {7});
  for (int d = 0; d < 63; ++d) inner = arr_payload(GgufType::ARRAY, 1, inner);
  GgufWriter w;
  w.kv("bomb", GgufType::ARRAY, inner);
  expect_error(w.build(), "nested deeper than");
  // Four levels are fine.
  Bytes ok = arr_payload(GgufType::U8, 1, {7});
  for (int d = 0; d < 3; ++d) ok = arr_payload(GgufType::ARRAY, 1, ok);
  GgufWriter w2;
  w2.kv("ok", GgufType::ARRAY, ok);
  EXPECT_TRUE(parse(w2.build()));
}

TEST(GgufHostile, UnknownValueType) {
  GgufWriter w;
  w.kv_raw_type("x", 13, scalar<uint32_t>(0));
  expect_error(w.build(), "unknown value type 13");
  GgufWriter w2;
  w2.kv_raw_type("x", 0xffffffffu, scalar<uint32_t>(0));
  expect_error(w2.build(), "unknown value type");
  GgufWriter w3;
  Bytes p;
  put<uint32_t>(p, 99);
  put<uint64_t>(p, 0);
  w3.kv("x", GgufType::ARRAY, p);
  expect_error(w3.build(), "unknown array element type 99");
  GgufWriter w4;
  w4.kv("x", GgufType::BOOL, scalar<uint8_t>(2));
  expect_error(w4.build(), "bool value 2");
}

TEST(GgufHostile, UnknownTensorType) {
  GgufWriter w;
  w.tensor("t", {32}, GgmlType::F32);
  w.tensors[0].type = 4;  // Q4_2: removed from ggml long ago
  expect_error(w.build(), "unknown tensor type 4");
  w.tensors[0].type = 1000;
  expect_error(w.build(), "unknown tensor type 1000");
}

TEST(GgufHostile, Dimensions) {
  GgufWriter w;
  w.tensor("t", {2, 2, 2, 2, 2}, GgmlType::F32);
  expect_error(w.build(), "5 dimensions");
  GgufWriter w0;
  w0.tensor("t", {}, GgmlType::F32);
  expect_error(w0.build(), "0 dimensions");
  GgufWriter wz;
  wz.tensor("t", {4, 0}, GgmlType::F32);
  expect_error(wz.build(), "dimension 0 out of range");
  GgufWriter wh;
  wh.tensor("t", {~uint64_t{0}}, GgmlType::F32);
  expect_error(wh.build(), "out of range");
  GgufWriter wo;
  wo.tensor("t", {uint64_t{1} << 40, uint64_t{1} << 40, uint64_t{1} << 40, uint64_t{1} << 40}, GgmlType::F32);
  expect_error(wo.build(), "shape overflows");
  GgufWriter wb;
  wb.tensor("t", {uint64_t{1} << 30, uint64_t{1} << 30}, GgmlType::F32);
  expect_error(wb.build(), "shape overflows");
}

TEST(GgufHostile, RowNotMultipleOfBlock) {
  GgufWriter w;
  w.tensor("t", {33, 2}, GgmlType::Q4_0);
  expect_error(w.build(), "not a multiple of the Q4_0 block size 32");
  GgufWriter w2;
  w2.tensor("t", {128}, GgmlType::Q4_K);
  expect_error(w2.build(), "block size 256");
}

TEST(GgufHostile, OffsetNotAligned) {
  GgufWriter w;
  w.tensor("a", {8}, GgmlType::F32, 0);
  w.tensor("b", {8}, GgmlType::F32, 36);
  expect_error(w.build(), "offset 36 is not aligned to 32");
}

TEST(GgufHostile, DataPastEnd) {
  GgufWriter w;
  w.tensor("t", {64}, GgmlType::F32);
  Bytes b = w.build();
  b.pop_back();
  expect_error(b, "runs past the end");
  // Offsets so large that offset + size would wrap around a 64-bit sum.
  for (uint64_t off : {~uint64_t{0} - 31, uint64_t{1} << 63, uint64_t{0x7fffffffffffffe0}}) {
    GgufWriter w2;
    w2.write_data = false;
    w2.tensor("t", {64}, GgmlType::F32, static_cast<int64_t>(off & 0x7fffffffffffffe0ull));
    Bytes b2 = w2.build();
    // Patch the raw offset (the last 8 bytes of the tensor info) and pad with some data.
    std::memcpy(b2.data() + b2.size() - 8, &off, 8);
    b2.resize(b2.size() + 512, 0);
    auto r = parse(b2);
    ASSERT_FALSE(r) << off;
    EXPECT_TRUE(r.message().find("past the end") != std::string::npos ||
                r.message().find("not aligned") != std::string::npos)
        << r.message();
  }
  // Tensors whose infos run past the end of the file: data section starts past the end.
  GgufWriter w3;
  w3.write_data = false;
  w3.tensor("t", {64}, GgmlType::F32);
  expect_error(w3.build(), "past the end");
}

TEST(GgufHostile, DuplicateKey) {
  GgufWriter w;
  w.kv("general.name", GgufType::STRING, str_payload("a"));
  w.kv("general.name", GgufType::U32, scalar<uint32_t>(1));
  expect_error(w.build(), "duplicate metadata key 'general.name'");
}

TEST(GgufHostile, DuplicateTensorName) {
  GgufWriter w;
  w.tensor("blk.0.attn_q.weight", {32}, GgmlType::F32);
  w.tensor("blk.0.attn_q.weight", {32}, GgmlType::F32);
  expect_error(w.build(), "duplicate tensor name 'blk.0.attn_q.weight'");
}

TEST(GgufHostile, NonFiniteFloatAsInt) {
  GgufWriter w;
  w.kv("x.nan", GgufType::F32, scalar<float>(std::nanf("")));
  w.kv("x.big", GgufType::F64, scalar<double>(1e300));
  auto r = parse(w.build());
  ASSERT_TRUE(r) << r.message();
  EXPECT_FALSE((*r)->get_int("x.nan", 0));
  EXPECT_FALSE((*r)->get_int("x.big", 0));
}

TEST(GgufHostile, OpenMissingAndNonRegular) {
  auto r = GgufFile::open("/nonexistent/model.gguf");
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("cannot open"), std::string::npos) << r.message();
  auto d = GgufFile::open("/tmp");
  ASSERT_FALSE(d);
  EXPECT_NE(d.message().find("not a regular file"), std::string::npos) << d.message();
}

// ---- the real models -------------------------------------------------------------------

std::unique_ptr<GgufFile> open_model(const std::string& name) {
  std::string path = std::string(KV_SOURCE_DIR) + "/models/" + name;
  if (!std::filesystem::exists(path)) {
    ADD_FAILURE() << path << " is missing: run `make models`";
    return nullptr;
  }
  auto r = GgufFile::open(path);
  if (!r) {
    ADD_FAILURE() << r.message();
    return nullptr;
  }
  return std::move(*r);
}

TEST(GgufModel, SmolLM2) {
  auto f = open_model("SmolLM2-135M-Instruct.Q4_1.gguf");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->version(), 3u);
  EXPECT_EQ(f->get_string("general.architecture", "").value(), "llama");
  EXPECT_EQ(f->get_int("llama.block_count", 0).value(), 30);
  EXPECT_EQ(f->get_int("llama.attention.head_count", 0).value(), 9);
  EXPECT_EQ(f->get_int("llama.attention.head_count_kv", 0).value(), 3);
  EXPECT_EQ(f->tensors().size(), 272u);
  const GgufTensor* t = f->find_tensor("token_embd.weight");
  ASSERT_TRUE(t);
  EXPECT_EQ(t->type, GgmlType::Q8_0);
  EXPECT_EQ(t->ne, (std::vector<int64_t>{576, 49152}));
  EXPECT_EQ(t->n_bytes, 576u / 32 * 34 * 49152);
  EXPECT_EQ(f->find("tokenizer.ggml.tokens")->arr.size(), 49152u);
  EXPECT_EQ(f->find("tokenizer.ggml.merges")->arr.size(), 48900u);
  // Tensor data is in the file and aligned.
  for (const auto& tt : f->tensors()) {
    EXPECT_EQ(tt.offset % f->alignment(), 0u) << tt.name;
    EXPECT_LE(f->data_offset() + tt.offset + tt.n_bytes, f->file_size()) << tt.name;
  }
}

TEST(GgufModel, Gemma3) {
  auto f = open_model("gemma-3-270m-Q4_K_M.gguf");
  ASSERT_TRUE(f);
  EXPECT_EQ(f->get_string("general.architecture", "").value(), "gemma3");
  EXPECT_EQ(f->get_int("gemma3.block_count", 0).value(), 18);
  EXPECT_EQ(f->get_int("gemma3.attention.sliding_window", 0).value(), 512);
  EXPECT_EQ(f->tensors().size(), 236u);
  EXPECT_EQ(f->find("tokenizer.ggml.tokens")->arr.size(), 262144u);
}

}  // namespace
}  // namespace kv
