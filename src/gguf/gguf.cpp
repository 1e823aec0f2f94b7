#include "gguf/gguf.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cmath>
#include <cstring>
#include <limits>

namespace kv {

namespace {

constexpr int kMaxArrayDepth = 4;
constexpr uint32_t kMaxDims = 4;
// Each metadata value costs sizeof(GgufValue) (~100 bytes) in memory but may take 1 byte in
// the file, so the file length alone would let a hostile file allocate ~100x its size. Real
// files hold well under 2M values (a 262K-token vocabulary with scores and types, or ~300K
// BPE merges), so a fixed budget bounds memory at a few hundred MB without refusing them.
constexpr uint64_t kMaxMetadataValues = uint64_t{1} << 22;

// Bounds-checked little-endian reader over the file. Every read checks the remaining length;
// the first failure sticks and names what was being read.
class Reader {
 public:
  Reader(const uint8_t* p, size_t n) : p_(p), n_(n) {}
  // Values that metadata may still allocate (see kMaxMetadataValues).
  uint64_t values_left = kMaxMetadataValues;
  size_t pos() const { return pos_; }
  size_t remaining() const { return n_ - pos_; }
  bool failed() const { return !err_.empty(); }
  const std::string& error() const { return err_; }
  void fail(const std::string& what) {
    if (err_.empty()) err_ = what;
  }

  template <typename T>
  bool read(T* out, const char* what) {
    if (failed()) return false;
    if (remaining() < sizeof(T)) {
      fail(std::string("truncated file while reading ") + what + " at offset " +
           std::to_string(pos_));
      return false;
    }
    std::memcpy(out, p_ + pos_, sizeof(T));
    pos_ += sizeof(T);
    return true;
  }

  bool read_string(std::string* out, const char* what) {
    uint64_t len = 0;
    if (!read(&len, what)) return false;
    if (len > remaining()) {
      fail(std::string(what) + ": string length " + std::to_string(len) +
           " runs past the end of the file (offset " + std::to_string(pos_) + ")");
      return false;
    }
    out->assign(reinterpret_cast<const char*>(p_ + pos_), len);
    pos_ += len;
    return true;
  }

 private:
  const uint8_t* p_;
  size_t n_;
  size_t pos_ = 0;
  std::string err_;
};

// Smallest encoded size of one value of a type: bounds array counts before allocating.
uint64_t min_encoded_size(GgufType t) {
  switch (t) {
    case GgufType::U8: case GgufType::I8: case GgufType::BOOL: return 1;
    case GgufType::U16: case GgufType::I16: return 2;
    case GgufType::U32: case GgufType::I32: case GgufType::F32: return 4;
    case GgufType::U64: case GgufType::I64: case GgufType::F64: return 8;
    case GgufType::STRING: return 8;
    case GgufType::ARRAY: return 12;
  }
  return 1;
}

bool valid_value_type(uint32_t t) { return t <= 12; }

bool read_value(Reader& r, GgufType type, GgufValue* v, int depth, const std::string& key) {
  v->type = type;
  auto set_int = [&](int64_t s, uint64_t u) {
    v->i = s;
    v->u = u;
    v->f = static_cast<double>(s);
  };
  switch (type) {
    case GgufType::U8: { uint8_t x; if (!r.read(&x, key.c_str())) return false; set_int(x, x); return true; }
    case GgufType::I8: { int8_t x; if (!r.read(&x, key.c_str())) return false; set_int(x, static_cast<uint64_t>(x)); return true; }
    case GgufType::U16: { uint16_t x; if (!r.read(&x, key.c_str())) return false; set_int(x, x); return true; }
    case GgufType::I16: { int16_t x; if (!r.read(&x, key.c_str())) return false; set_int(x, static_cast<uint64_t>(x)); return true; }
    case GgufType::U32: { uint32_t x; if (!r.read(&x, key.c_str())) return false; set_int(x, x); return true; }
    case GgufType::I32: { int32_t x; if (!r.read(&x, key.c_str())) return false; set_int(x, static_cast<uint64_t>(x)); return true; }
    case GgufType::U64: { uint64_t x; if (!r.read(&x, key.c_str())) return false; v->u = x; v->i = static_cast<int64_t>(x); v->f = static_cast<double>(x); return true; }
    case GgufType::I64: { int64_t x; if (!r.read(&x, key.c_str())) return false; set_int(x, static_cast<uint64_t>(x)); return true; }
    case GgufType::BOOL: {
      uint8_t x;
      if (!r.read(&x, key.c_str())) return false;
      if (x > 1) { r.fail("metadata '" + key + "': bool value " + std::to_string(x) + " is not 0 or 1"); return false; }
      set_int(x, x);
      return true;
    }
    case GgufType::F32: { float x; if (!r.read(&x, key.c_str())) return false; v->f = x; v->i = 0; v->u = 0; return true; }
    case GgufType::F64: { double x; if (!r.read(&x, key.c_str())) return false; v->f = x; v->i = 0; v->u = 0; return true; }
    case GgufType::STRING: return r.read_string(&v->str, key.c_str());
    case GgufType::ARRAY: {
      if (depth >= kMaxArrayDepth) { r.fail("metadata '" + key + "': arrays nested deeper than " + std::to_string(kMaxArrayDepth)); return false; }
      uint32_t et = 0;
      uint64_t count = 0;
      if (!r.read(&et, key.c_str()) || !r.read(&count, key.c_str())) return false;
      if (!valid_value_type(et)) { r.fail("metadata '" + key + "': unknown array element type " + std::to_string(et)); return false; }
      v->arr_type = static_cast<GgufType>(et);
      if (count > r.remaining() / min_encoded_size(v->arr_type)) {
        r.fail("metadata '" + key + "': array count " + std::to_string(count) + " exceeds what the file can hold (truncated or corrupt?)");
        return false;
      }
      if (count > r.values_left) {
        r.fail("metadata '" + key + "': array count " + std::to_string(count) + " exceeds the limit of " +
               std::to_string(kMaxMetadataValues) + " metadata values per file");
        return false;
      }
      r.values_left -= count;
      v->arr.resize(count);
      for (uint64_t k = 0; k < count; ++k)
        if (!read_value(r, v->arr_type, &v->arr[k], depth + 1, key)) return false;
      return true;
    }
  }
  r.fail("metadata '" + key + "': unknown value type");
  return false;
}

}  // namespace

const char* gguf_type_name(GgufType t) {
  static const char* names[] = {"u8", "i8", "u16", "i16", "u32", "i32", "f32",
                                "bool", "string", "array", "u64", "i64", "f64"};
  auto i = static_cast<uint32_t>(t);
  return i < 13 ? names[i] : "?";
}

bool GgufValue::is_int() const {
  switch (type) {
    case GgufType::U8: case GgufType::I8: case GgufType::U16: case GgufType::I16:
    case GgufType::U32: case GgufType::I32: case GgufType::U64: case GgufType::I64:
    case GgufType::BOOL: return true;
    default: return false;
  }
}

std::string GgufValue::to_string(size_t max_elems) const {
  switch (type) {
    case GgufType::STRING: return str.size() > 80 ? "\"" + str.substr(0, 77) + "...\"" : "\"" + str + "\"";
    case GgufType::F32: case GgufType::F64: return std::to_string(f);
    case GgufType::BOOL: return u ? "true" : "false";
    case GgufType::U64: return std::to_string(u);
    case GgufType::ARRAY: {
      std::string s = std::string("[") + gguf_type_name(arr_type) + " x " + std::to_string(arr.size()) + "]";
      if (max_elems > 0 && !arr.empty()) {
        s += " {";
        for (size_t k = 0; k < arr.size() && k < max_elems; ++k) s += (k ? ", " : "") + arr[k].to_string(0);
        if (arr.size() > max_elems) s += ", ...";
        s += "}";
      }
      return s;
    }
    default: return std::to_string(i);
  }
}

int64_t GgufTensor::rows() const {
  int64_t r = 1;
  for (size_t k = 1; k < ne.size(); ++k) r *= ne[k];
  return r;
}

Result<std::unique_ptr<GgufFile>> GgufFile::open(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not hang; the S_ISREG check below rejects it.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) return Result<std::unique_ptr<GgufFile>>::error(path + ": cannot open: " + std::strerror(errno));
  struct stat st {};
  if (fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    return Result<std::unique_ptr<GgufFile>>::error(path + ": not a regular file");
  }
  size_t size = static_cast<size_t>(st.st_size);
  if (size == 0) {
    ::close(fd);
    return Result<std::unique_ptr<GgufFile>>::error(path + ": empty file, not a GGUF model");
  }
  void* map = mmap(nullptr, size, PROT_READ, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (map == MAP_FAILED) return Result<std::unique_ptr<GgufFile>>::error(path + ": mmap failed: " + std::strerror(errno));
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = path;
  f->map_ = map;
  f->base_ = static_cast<const uint8_t*>(map);
  f->size_ = size;
  Status st2 = f->parse_impl();
  if (!st2) return Result<std::unique_ptr<GgufFile>>::error(path + ": " + st2.message());
  return Result<std::unique_ptr<GgufFile>>(std::move(f));
}

Result<std::unique_ptr<GgufFile>> GgufFile::parse(const uint8_t* data, size_t size) {
  std::unique_ptr<GgufFile> f(new GgufFile());
  f->path_ = "<memory>";
  f->base_ = data;
  f->size_ = size;
  Status st = f->parse_impl();
  if (!st) return Result<std::unique_ptr<GgufFile>>::error(st.message());
  return Result<std::unique_ptr<GgufFile>>(std::move(f));
}

GgufFile::~GgufFile() {
  if (map_) munmap(map_, size_);
}

Status GgufFile::parse_impl() {
  Reader r(base_, size_);
  uint32_t magic = 0;
  if (!r.read(&magic, "magic")) return Status::error("too short to be a GGUF file (" + std::to_string(size_) + " bytes): not a GGUF file");
  if (std::memcmp(&magic, "GGUF", 4) != 0) return Status::error("wrong magic: not a GGUF file");
  if (!r.read(&version_, "version")) return Status::error(r.error());
  if (version_ == 1) return Status::error("GGUF version 1 is not supported (re-convert the model; v2 and v3 are)");
  if (version_ == (2u << 24) || version_ == (3u << 24))
    return Status::error("big-endian GGUF (version " + std::to_string(version_ >> 24) + ") is not supported");
  if (version_ != 2 && version_ != 3) return Status::error("unsupported GGUF version " + std::to_string(version_));
  uint64_t n_tensors = 0, n_kv = 0;
  if (!r.read(&n_tensors, "tensor count") || !r.read(&n_kv, "metadata count")) return Status::error(r.error());
  // Each metadata entry takes at least 8 (key len) + 4 (type) + 1 bytes; each tensor info
  // at least 8 + 4 + 8 + 4 + 8.
  if (n_kv > r.remaining() / 13) return Status::error("metadata count " + std::to_string(n_kv) + " exceeds what the file can hold (truncated or corrupt?)");
  if (n_tensors > r.remaining() / 32) return Status::error("tensor count " + std::to_string(n_tensors) + " exceeds what the file can hold (truncated or corrupt?)");

  for (uint64_t k = 0; k < n_kv; ++k) {
    std::string key;
    uint32_t type = 0;
    if (!r.read_string(&key, "metadata key") || !r.read(&type, "metadata type")) return Status::error(r.error());
    if (!valid_value_type(type)) return Status::error("metadata '" + key + "': unknown value type " + std::to_string(type));
    GgufValue v;
    if (!read_value(r, static_cast<GgufType>(type), &v, 0, key)) return Status::error(r.error());
    if (kv_.count(key)) return Status::error("duplicate metadata key '" + key + "'");
    key_order_.push_back(key);
    kv_.emplace(key, std::move(v));
  }

  if (const GgufValue* a = find("general.alignment")) {
    if (!a->is_int() || a->u == 0 || (a->u & (a->u - 1)) != 0 || a->u > (1u << 20))
      return Status::error("general.alignment must be a power of two, got " + a->to_string());
    alignment_ = a->u;
  }

  tensors_.resize(n_tensors);
  for (uint64_t k = 0; k < n_tensors; ++k) {
    GgufTensor& t = tensors_[k];
    uint32_t n_dims = 0, type = 0;
    if (!r.read_string(&t.name, "tensor name") || !r.read(&n_dims, "tensor dims")) return Status::error(r.error());
    if (n_dims == 0 || n_dims > kMaxDims)
      return Status::error("tensor '" + t.name + "': " + std::to_string(n_dims) + " dimensions (1 to 4 allowed)");
    t.ne.resize(n_dims);
    for (auto& d : t.ne) {
      uint64_t x = 0;
      if (!r.read(&x, "tensor shape")) return Status::error(r.error());
      if (x == 0 || x > (1ull << 40)) return Status::error("tensor '" + t.name + "': dimension " + std::to_string(x) + " out of range");
      d = static_cast<int64_t>(x);
    }
    if (!r.read(&type, "tensor type") || !r.read(&t.offset, "tensor offset")) return Status::error(r.error());
    TypeTraits tt;
    if (!type_traits(type, &tt)) return Status::error("tensor '" + t.name + "': unknown tensor type " + std::to_string(type));
    t.type = static_cast<GgmlType>(type);
    __int128 n = 1;
    for (auto d : t.ne) {
      n *= d;
      if (n > (static_cast<__int128>(1) << 50)) return Status::error("tensor '" + t.name + "': shape overflows");
    }
    t.n_elements = static_cast<int64_t>(n);
    if (t.ne[0] % tt.block_elems != 0)
      return Status::error("tensor '" + t.name + "': row length " + std::to_string(t.ne[0]) + " is not a multiple of the " +
                           std::string(tt.name) + " block size " + std::to_string(tt.block_elems));
    t.n_bytes = static_cast<uint64_t>(t.n_elements / tt.block_elems * tt.block_bytes);
    if (tensor_index_.count(t.name)) return Status::error("duplicate tensor name '" + t.name + "'");
    tensor_index_[t.name] = k;
  }

  uint64_t pos = r.pos();
  data_offset_ = (pos + alignment_ - 1) / alignment_ * alignment_;
  if (n_tensors > 0 && data_offset_ > size_) return Status::error("tensor data section starts past the end of the file");
  uint64_t data_size = size_ >= data_offset_ ? size_ - data_offset_ : 0;
  for (auto& t : tensors_) {
    if (t.offset % alignment_ != 0)
      return Status::error("tensor '" + t.name + "': offset " + std::to_string(t.offset) + " is not aligned to " + std::to_string(alignment_));
    if (t.offset > data_size || t.n_bytes > data_size - t.offset)
      return Status::error("tensor '" + t.name + "': data [" + std::to_string(t.offset) + ", +" + std::to_string(t.n_bytes) +
                           ") runs past the end of the file (truncated?)");
    t.data = base_ + data_offset_ + t.offset;
  }
  return Status::ok();
}

const GgufValue* GgufFile::find(const std::string& key) const {
  auto it = kv_.find(key);
  return it == kv_.end() ? nullptr : &it->second;
}

const GgufTensor* GgufFile::find_tensor(const std::string& name) const {
  auto it = tensor_index_.find(name);
  return it == tensor_index_.end() ? nullptr : &tensors_[it->second];
}

Result<int64_t> GgufFile::get_int(const std::string& key, int64_t dflt) const {
  const GgufValue* v = find(key);
  if (!v) return dflt;
  if (v->type == GgufType::U64 && v->u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    return Result<int64_t>::error("metadata '" + key + "' = " + std::to_string(v->u) + " is out of range");
  if (v->is_int()) return v->i;
  if (v->is_float()) {
    // Casting NaN or a value outside int64 is undefined behaviour: reject it instead.
    if (!std::isfinite(v->f) || v->f < -9.2e18 || v->f > 9.2e18)
      return Result<int64_t>::error("metadata '" + key + "' = " + std::to_string(v->f) + " is not a valid integer");
    return static_cast<int64_t>(v->f);
  }
  return Result<int64_t>::error("metadata '" + key + "' should be a number, is " + gguf_type_name(v->type));
}

Result<double> GgufFile::get_float(const std::string& key, double dflt) const {
  const GgufValue* v = find(key);
  if (!v) return dflt;
  if (v->is_int() || v->is_float()) return v->f;
  return Result<double>::error("metadata '" + key + "' should be a number, is " + gguf_type_name(v->type));
}

Result<std::string> GgufFile::get_string(const std::string& key, const std::string& dflt) const {
  const GgufValue* v = find(key);
  if (!v) return dflt;
  if (v->type == GgufType::STRING) return v->str;
  return Result<std::string>::error("metadata '" + key + "' should be a string, is " + gguf_type_name(v->type));
}

Result<bool> GgufFile::get_bool(const std::string& key, bool dflt) const {
  const GgufValue* v = find(key);
  if (!v) return dflt;
  if (v->is_int()) return v->u != 0;
  return Result<bool>::error("metadata '" + key + "' should be a bool, is " + gguf_type_name(v->type));
}

}  // namespace kv
