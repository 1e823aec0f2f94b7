// Helpers shared by the tokenizer tests: a writer for small in-memory GGUFs (metadata only).
#pragma once
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

namespace kv::tok_test {

class GgufBuilder {
 public:
  GgufBuilder& str(const std::string& k, const std::string& v) {
    key(k, 8);
    s(v);
    ++n_;
    return *this;
  }
  GgufBuilder& u32(const std::string& k, uint32_t v) {
    key(k, 4);
    raw(&v, 4);
    ++n_;
    return *this;
  }
  GgufBuilder& boolean(const std::string& k, bool v) {
    key(k, 7);
    const uint8_t b = v;
    raw(&b, 1);
    ++n_;
    return *this;
  }
  GgufBuilder& strs(const std::string& k, const std::vector<std::string>& v) {
    key(k, 9);
    const uint32_t t = 8;
    raw(&t, 4);
    const uint64_t n = v.size();
    raw(&n, 8);
    for (const auto& x : v) s(x);
    ++n_;
    return *this;
  }
  GgufBuilder& f32s(const std::string& k, const std::vector<float>& v) {
    key(k, 9);
    const uint32_t t = 6;
    raw(&t, 4);
    const uint64_t n = v.size();
    raw(&n, 8);
    for (float x : v) raw(&x, 4);
    ++n_;
    return *this;
  }
  GgufBuilder& i32s(const std::string& k, const std::vector<int32_t>& v) {
    key(k, 9);
    const uint32_t t = 5;
    raw(&t, 4);
    const uint64_t n = v.size();
    raw(&n, 8);
    for (int32_t x : v) raw(&x, 4);
    ++n_;
    return *this;
  }
  std::vector<uint8_t> bytes() const {
    std::vector<uint8_t> out;
    const auto put = [&](const void* p, size_t n) {
      out.insert(out.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
    };
    put("GGUF", 4);
    const uint32_t version = 3;
    put(&version, 4);
    const uint64_t n_tensors = 0;
    put(&n_tensors, 8);
    put(&n_, 8);
    out.insert(out.end(), body_.begin(), body_.end());
    return out;
  }

 private:
  void raw(const void* p, size_t n) {
    body_.insert(body_.end(), static_cast<const uint8_t*>(p), static_cast<const uint8_t*>(p) + n);
  }
  void s(const std::string& v) {
    const uint64_t n = v.size();
    raw(&n, 8);
    raw(v.data(), v.size());
  }
  void key(const std::string& k, uint32_t type) {
    s(k);
    raw(&type, 4);
  }
  std::vector<uint8_t> body_;
  uint64_t n_ = 0;
};

}  // namespace kv::tok_test
