// libFuzzer target for the GGUF reader: any input must parse or fail with a message, never
// crash, read out of bounds, or allocate beyond what its length justifies. On success every
// value and every tensor byte range is touched so the sanitizers see any bad pointer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "gguf/gguf.h"

namespace {

uint64_t touch(const kv::GgufValue& v) {
  uint64_t h = v.u ^ static_cast<uint64_t>(v.i) ^ static_cast<uint64_t>(v.type);
  h += v.str.size();
  if (!v.str.empty()) h += static_cast<uint8_t>(v.str.front()) + static_cast<uint8_t>(v.str.back());
  for (const auto& e : v.arr) h = h * 31 + touch(e);
  return h;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto r = kv::GgufFile::parse(data, size);
  if (!r) {
    if (r.message().empty()) std::abort();  // every failure must say why
    return 0;
  }
  const kv::GgufFile& f = **r;
  volatile uint64_t sink = f.version() + f.alignment();
  if (f.data_offset() % f.alignment() != 0) std::abort();
  for (const auto& key : f.keys()) {
    const kv::GgufValue* v = f.find(key);
    if (!v) std::abort();
    sink = sink + touch(*v) + v->to_string().size();
    // The typed getters must not hit UB whatever the stored type.
    (void)f.get_int(key, 0);
    (void)f.get_float(key, 0);
    (void)f.get_string(key, "");
    (void)f.get_bool(key, false);
  }
  for (const auto& t : f.tensors()) {
    if (f.find_tensor(t.name) == nullptr) std::abort();
    if (t.data < data || t.n_bytes > size || t.data + t.n_bytes > data + size) std::abort();
    if (t.offset % f.alignment() != 0) std::abort();
    // First and last byte of the tensor: ASan flags either if the range is wrong.
    sink = sink + t.data[0] + t.data[t.n_bytes - 1] + static_cast<uint64_t>(t.rows());
  }
  (void)sink;
  return 0;
}
