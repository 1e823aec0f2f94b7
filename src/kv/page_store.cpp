#include "kv/page_store.h"

#include <xxhash.h>

#include <cstring>

namespace kv {

namespace {
constexpr char kMagic[8] = {'K', 'V', 'S', 'P', 'A', 'G', 'E', '\0'};

void put_u32(std::string* s, uint32_t v) {
  for (int b = 0; b < 4; ++b) s->push_back(static_cast<char>(v >> (8 * b)));
}
void put_u64(std::string* s, uint64_t v) {
  for (int b = 0; b < 8; ++b) s->push_back(static_cast<char>(v >> (8 * b)));
}

struct Reader {
  std::string_view s;
  size_t off = 0;
  bool ok = true;
  uint64_t get(int n) {
    if (off + n > s.size()) {
      ok = false;
      return 0;
    }
    uint64_t v = 0;
    for (int b = 0; b < n; ++b) v |= uint64_t(static_cast<uint8_t>(s[off + b])) << (8 * b);
    off += n;
    return v;
  }
  uint32_t u32() { return static_cast<uint32_t>(get(4)); }
  uint64_t u64() { return get(8); }
};
}  // namespace

uint64_t namespace_tag(std::string_view ns) { return XXH3_64bits(ns.data(), ns.size()); }

const char* blob_check_name(BlobCheck c) {
  switch (c) {
    case BlobCheck::kOk: return "ok";
    case BlobCheck::kCorrupt: return "corrupt";
    case BlobCheck::kForeign: return "foreign";
  }
  return "?";
}

std::string encode_blob(const PageIdentity& id, const PageHash& hash, const PageHash& parent, const int32_t* tokens,
                        uint32_t flags, std::span<const uint8_t> payload) {
  std::string s;
  s.reserve(112 + 4 * size_t(id.block_size) + payload.size());
  s.append(kMagic, sizeof kMagic);
  put_u32(&s, kBlobVersion);
  put_u32(&s, PrefixCache::kChainHashVersion);
  put_u64(&s, id.fingerprint);
  put_u32(&s, id.format_tag);
  put_u32(&s, static_cast<uint32_t>(id.block_size));
  put_u64(&s, id.ns_tag);
  put_u64(&s, hash.lo);
  put_u64(&s, hash.hi);
  put_u32(&s, flags);
  put_u64(&s, parent.lo);
  put_u64(&s, parent.hi);
  for (int32_t i = 0; i < id.block_size; ++i) put_u32(&s, static_cast<uint32_t>(tokens[i]));
  put_u64(&s, payload.size());
  put_u64(&s, XXH3_64bits(payload.data(), payload.size()));
  put_u64(&s, XXH3_64bits(s.data(), s.size()));
  s.append(reinterpret_cast<const char*>(payload.data()), payload.size());
  return s;
}

BlobCheck decode_header(std::string_view blob, BlobHeader* out) {
  if (blob.size() < sizeof kMagic || std::memcmp(blob.data(), kMagic, sizeof kMagic) != 0) return BlobCheck::kCorrupt;
  Reader r{blob, sizeof kMagic};
  const uint32_t blob_version = r.u32();
  const uint32_t chain_version = r.u32();
  if (!r.ok) return BlobCheck::kCorrupt;
  // Another version's header may have another shape: foreign, not corrupt, and not parsed.
  if ((blob_version != kBlobVersion && blob_version != 1) || chain_version != PrefixCache::kChainHashVersion)
    return BlobCheck::kForeign;
  BlobHeader h;
  h.id.fingerprint = r.u64();
  h.id.format_tag = r.u32();
  h.id.block_size = static_cast<int32_t>(r.u32());
  h.id.ns_tag = r.u64();
  h.hash.lo = r.u64();
  h.hash.hi = r.u64();
  h.flags = r.u32();
  if (blob_version >= 2) {
    h.parent.lo = r.u64();
    h.parent.hi = r.u64();
  }
  if (!r.ok || h.id.block_size <= 0 || h.id.block_size > 4096) return BlobCheck::kCorrupt;
  h.tokens.resize(h.id.block_size);
  for (auto& t : h.tokens) t = static_cast<int32_t>(r.u32());
  h.payload_bytes = r.u64();
  h.payload_xxh3 = r.u64();
  const size_t covered = r.off;
  const uint64_t header_xxh3 = r.u64();
  if (!r.ok || header_xxh3 != XXH3_64bits(blob.data(), covered)) return BlobCheck::kCorrupt;
  h.header_bytes = r.off;
  *out = std::move(h);
  return BlobCheck::kOk;
}

BlobCheck check_blob(std::string_view blob, const PageIdentity& id, const PageHash& hash, const int32_t* tokens,
                     BlobHeader* header) {
  BlobHeader h;
  const BlobCheck c = decode_header(blob, &h);
  if (c != BlobCheck::kOk) return c;
  if (blob.size() != h.header_bytes + h.payload_bytes) return BlobCheck::kCorrupt;  // truncated or padded
  if (XXH3_64bits(blob.data() + h.header_bytes, h.payload_bytes) != h.payload_xxh3) return BlobCheck::kCorrupt;
  if (h.id.fingerprint != id.fingerprint || h.id.format_tag != id.format_tag || h.id.block_size != id.block_size ||
      h.id.ns_tag != id.ns_tag || !(h.hash == hash))
    return BlobCheck::kForeign;
  if (std::memcmp(h.tokens.data(), tokens, sizeof(int32_t) * size_t(id.block_size)) != 0) return BlobCheck::kForeign;
  if (header) *header = std::move(h);
  return BlobCheck::kOk;
}

}  // namespace kv
