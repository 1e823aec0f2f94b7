// A memory-mapped GGUF file (v2/v3): header, metadata, tensor directory.
//
// Contract: open()/parse() validate every count, size and offset against the file length
// before using it, so a truncated or hostile file yields an error message naming the problem,
// never a crash or an allocation larger than the file justifies. After a successful open the
// object is immutable and safe to read from any thread; tensor data pointers stay valid for
// the object's lifetime.
#pragma once
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "common/status.h"
#include "kernels/ggml_types.h"

namespace kv {

enum class GgufType : uint32_t {
  U8 = 0, I8 = 1, U16 = 2, I16 = 3, U32 = 4, I32 = 5, F32 = 6, BOOL = 7,
  STRING = 8, ARRAY = 9, U64 = 10, I64 = 11, F64 = 12,
};
const char* gguf_type_name(GgufType t);

// One metadata value. Scalars live in u/i/f (all three are filled for numeric types so callers
// can read whichever width they want); strings in str; arrays in arr (elements of arr_type,
// possibly arrays themselves).
struct GgufValue {
  GgufType type = GgufType::U8;
  uint64_t u = 0;
  int64_t i = 0;
  double f = 0;
  std::string str;
  GgufType arr_type = GgufType::U8;
  std::vector<GgufValue> arr;

  bool is_int() const;  // any integer or bool type
  bool is_float() const { return type == GgufType::F32 || type == GgufType::F64; }
  std::string to_string(size_t max_elems = 8) const;  // for inspect / debugging
};

struct GgufTensor {
  std::string name;
  GgmlType type = GgmlType::F32;
  std::vector<int64_t> ne;  // GGUF order: ne[0] is the contiguous (row) dimension
  int64_t n_elements = 0;
  uint64_t offset = 0;      // relative to the data section
  uint64_t n_bytes = 0;
  const uint8_t* data = nullptr;

  int64_t rows() const;     // product of ne[1..]
};

class GgufFile {
 public:
  // mmaps path read-only and parses it.
  static Result<std::unique_ptr<GgufFile>> open(const std::string& path);
  // Parses a buffer the caller keeps alive (fuzzing, tests). Copies nothing but metadata.
  static Result<std::unique_ptr<GgufFile>> parse(const uint8_t* data, size_t size);
  ~GgufFile();
  GgufFile(const GgufFile&) = delete;
  GgufFile& operator=(const GgufFile&) = delete;

  uint32_t version() const { return version_; }
  uint64_t alignment() const { return alignment_; }
  uint64_t data_offset() const { return data_offset_; }
  size_t file_size() const { return size_; }
  const std::string& path() const { return path_; }

  const std::map<std::string, GgufValue>& metadata() const { return kv_; }
  // Keys in file order (metadata() is sorted).
  const std::vector<std::string>& keys() const { return key_order_; }
  const GgufValue* find(const std::string& key) const;
  bool has(const std::string& key) const { return find(key) != nullptr; }
  // Typed getters: the default when the key is absent; an error when present with a type
  // that cannot convert (e.g. a string where a number belongs).
  Result<int64_t> get_int(const std::string& key, int64_t dflt) const;
  Result<double> get_float(const std::string& key, double dflt) const;
  Result<std::string> get_string(const std::string& key, const std::string& dflt) const;
  Result<bool> get_bool(const std::string& key, bool dflt) const;

  const std::vector<GgufTensor>& tensors() const { return tensors_; }
  const GgufTensor* find_tensor(const std::string& name) const;

 private:
  GgufFile() = default;
  Status parse_impl();

  std::string path_;
  const uint8_t* base_ = nullptr;
  size_t size_ = 0;
  void* map_ = nullptr;  // non-null when we own an mmap
  uint32_t version_ = 0;
  uint64_t alignment_ = 32;
  uint64_t data_offset_ = 0;
  std::map<std::string, GgufValue> kv_;
  std::vector<std::string> key_order_;
  std::vector<GgufTensor> tensors_;
  std::map<std::string, size_t> tensor_index_;
};

}  // namespace kv
