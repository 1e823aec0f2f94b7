// KV tiers below RAM: the blob format (page_store.h), the disk store (L2), the Redis store (L3,
// standalone and Redis Cluster, against real redis-server processes started here) and the tier
// manager moving pages between a PagePool and the stores.
#include <arpa/inet.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <hiredis/hiredis.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <xxhash.h>

#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "kv/disk_store.h"
#include "kv/page_pool.h"
#include "kv/page_store.h"
#include "kv/redis_store.h"
#include "kv/tier_manager.h"

using namespace kv;
namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

namespace {

// ---- helpers ------------------------------------------------------------------------------

std::string make_tmpdir(const char* tag) {
  std::string t = ::testing::TempDir() + "kvtier_" + tag + "_XXXXXX";
  std::vector<char> buf(t.begin(), t.end());
  buf.push_back('\0');
  const char* d = ::mkdtemp(buf.data());
  EXPECT_NE(d, nullptr) << "mkdtemp " << t;
  return d ? std::string(d) : std::string();
}

struct TmpDir {
  std::string path;
  explicit TmpDir(const char* tag) : path(make_tmpdir(tag)) {}
  ~TmpDir() {
    std::error_code ec;
    if (!path.empty()) fs::remove_all(path, ec);
  }
};

std::string read_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>());
}
void write_bytes(const std::string& path, const std::string& s) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f.write(s.data(), static_cast<std::streamsize>(s.size()));
}
void flip_byte(const std::string& path, size_t off) {
  std::string s = read_bytes(path);
  ASSERT_LT(off, s.size()) << path;
  s[off] = static_cast<char>(s[off] ^ 0x5a);
  write_bytes(path, s);
}

PageHash hash_of(uint64_t i) { return PageHash{0x9e3779b97f4a7c15ull * (i + 1), 0xc2b2ae3d27d4eb4full ^ (i * 0x100000001b3ull)}; }

std::vector<int32_t> tokens_for(int32_t n, int32_t seed) {
  std::vector<int32_t> t(n);
  for (int32_t i = 0; i < n; ++i) t[i] = seed * 1000 + i * 7 + 3;
  return t;
}

std::vector<uint8_t> payload_for(size_t n, uint32_t seed) {
  std::vector<uint8_t> p(n);
  std::mt19937 rng(seed);
  for (auto& b : p) b = static_cast<uint8_t>(rng());
  return p;
}

constexpr int32_t kBlobBs = 16;
const PageIdentity kId{0x1122334455667788ull, 0xabcdef01u, kBlobBs, 0x0badf00dcafef00dull};

std::string make_blob(uint64_t i, size_t payload = 1000, const PageIdentity& id = kId) {
  const auto tok = tokens_for(id.block_size, static_cast<int32_t>(i));
  const auto p = payload_for(payload, static_cast<uint32_t>(i));
  return encode_blob(id, hash_of(i), PageHash{}, tok.data(), 0, p);
}

BlobCheck check_i(const std::string& blob, uint64_t i, const PageIdentity& id = kId) {
  const auto tok = tokens_for(id.block_size, static_cast<int32_t>(i));
  return check_blob(blob, id, hash_of(i), tok.data());
}

// ---- blob format --------------------------------------------------------------------------

TEST(KvTierBlob, RoundTripAndHeader) {
  const auto tok = tokens_for(kBlobBs, 5);
  const auto p = payload_for(777, 5);
  const std::string b = encode_blob(kId, hash_of(5), PageHash{}, tok.data(), kBlobFlagKeyStats, p);
  BlobHeader h;
  ASSERT_EQ(check_blob(b, kId, hash_of(5), tok.data(), &h), BlobCheck::kOk);
  EXPECT_EQ(h.id.fingerprint, kId.fingerprint);
  EXPECT_EQ(h.id.format_tag, kId.format_tag);
  EXPECT_EQ(h.id.block_size, kId.block_size);
  EXPECT_EQ(h.id.ns_tag, kId.ns_tag);
  EXPECT_EQ(h.hash, hash_of(5));
  EXPECT_EQ(h.flags, kBlobFlagKeyStats);
  EXPECT_EQ(h.tokens, tok);
  EXPECT_EQ(h.payload_bytes, 777u);
  EXPECT_EQ(h.header_bytes + h.payload_bytes, b.size());
  // The documented layout: magic 8, versions 4 + 4, fingerprint 8, format tag 4, block size 4,
  // namespace 8, hash 16, flags 4, parent hash 16 (version 2), tokens 4 each, payload size 8,
  // payload XXH3 8, header XXH3 8.
  EXPECT_EQ(h.header_bytes, 100u + 4u * kBlobBs);
  EXPECT_EQ(b.compare(0, 8, std::string("KVSPAGE\0", 8)), 0);
  EXPECT_EQ(std::memcmp(b.data() + h.header_bytes, p.data(), p.size()), 0);
  // decode_header alone agrees.
  BlobHeader h2;
  ASSERT_EQ(decode_header(b, &h2), BlobCheck::kOk);
  EXPECT_EQ(h2.header_bytes, h.header_bytes);
  // An empty payload is a valid blob too.
  const std::string e = encode_blob(kId, hash_of(5), PageHash{}, tok.data(), 0, {});
  EXPECT_EQ(check_blob(e, kId, hash_of(5), tok.data()), BlobCheck::kOk);
  EXPECT_STREQ(blob_check_name(BlobCheck::kCorrupt), "corrupt");
}

TEST(KvTierBlob, IdentityMismatchIsForeign) {
  const std::string b = make_blob(3);
  ASSERT_EQ(check_i(b, 3), BlobCheck::kOk);
  const auto tok = tokens_for(64, 3);  // long enough for any block size below
  PageIdentity id = kId;
  id.fingerprint ^= 1;
  EXPECT_EQ(check_blob(b, id, hash_of(3), tok.data()), BlobCheck::kForeign) << "fingerprint";
  id = kId;
  id.format_tag ^= 0x100;
  EXPECT_EQ(check_blob(b, id, hash_of(3), tok.data()), BlobCheck::kForeign) << "format tag";
  id = kId;
  id.block_size = 32;
  EXPECT_EQ(check_blob(b, id, hash_of(3), tok.data()), BlobCheck::kForeign) << "block size";
  id = kId;
  id.ns_tag = namespace_tag("another tenant");
  EXPECT_EQ(check_blob(b, id, hash_of(3), tok.data()), BlobCheck::kForeign) << "namespace";
  PageHash h = hash_of(3);
  h.lo ^= 1;
  EXPECT_EQ(check_blob(b, kId, h, tok.data()), BlobCheck::kForeign) << "hash.lo";
  h = hash_of(3);
  h.hi ^= 0x8000000000000000ull;
  EXPECT_EQ(check_blob(b, kId, h, tok.data()), BlobCheck::kForeign) << "hash.hi";
  for (int32_t pos : {0, 7, kBlobBs - 1}) {
    auto t2 = tokens_for(kBlobBs, 3);
    t2[pos] += 1;
    EXPECT_EQ(check_blob(b, kId, hash_of(3), t2.data()), BlobCheck::kForeign) << "token " << pos;
  }
  EXPECT_NE(namespace_tag("a"), namespace_tag("b"));
  EXPECT_EQ(namespace_tag("tenant"), namespace_tag(std::string("tenant")));
}

TEST(KvTierBlob, DamageIsCorrupt) {
  const std::string b = make_blob(4, 300);
  BlobHeader h;
  ASSERT_EQ(decode_header(b, &h), BlobCheck::kOk);
  // Every payload byte.
  for (size_t i = h.header_bytes; i < b.size(); ++i) {
    std::string d = b;
    d[i] = static_cast<char>(d[i] ^ 0x01);
    ASSERT_EQ(check_i(d, 4), BlobCheck::kCorrupt) << "payload byte " << i;
  }
  // Every header byte after the two version words (those make it foreign, below), magic included.
  for (size_t i = 0; i < h.header_bytes; ++i) {
    if (i >= 8 && i < 16) continue;
    std::string d = b;
    d[i] = static_cast<char>(d[i] ^ 0x80);
    ASSERT_EQ(check_i(d, 4), BlobCheck::kCorrupt) << "header byte " << i;
  }
  // Truncated anywhere, padded.
  for (size_t n = 0; n < b.size(); ++n) ASSERT_EQ(check_i(b.substr(0, n), 4), BlobCheck::kCorrupt) << "truncated to " << n;
  EXPECT_EQ(check_i(b.substr(0, b.size() - 1), 4), BlobCheck::kCorrupt);
  EXPECT_EQ(check_i(b + '\0', 4), BlobCheck::kCorrupt);
  EXPECT_EQ(check_i(b + "xyz", 4), BlobCheck::kCorrupt);
  // Bad magic.
  std::string m = b;
  m[0] = 'X';
  EXPECT_EQ(check_i(m, 4), BlobCheck::kCorrupt);
  EXPECT_EQ(decode_header(m, &h), BlobCheck::kCorrupt);
  EXPECT_EQ(check_i(std::string(), 4), BlobCheck::kCorrupt);
}

TEST(KvTierBlob, OtherVersionIsForeign) {
  const std::string b = make_blob(6);
  auto set_u32 = [](std::string* s, size_t off, uint32_t v) {
    for (int k = 0; k < 4; ++k) (*s)[off + k] = static_cast<char>(v >> (8 * k));
  };
  std::string v2 = b;  // blob version word at offset 8
  set_u32(&v2, 8, kBlobVersion + 1);
  BlobHeader h;
  EXPECT_EQ(decode_header(v2, &h), BlobCheck::kForeign);
  EXPECT_EQ(check_i(v2, 6), BlobCheck::kForeign);
  set_u32(&v2, 8, 0);
  EXPECT_EQ(check_i(v2, 6), BlobCheck::kForeign);
  std::string c2 = b;  // chain-hash version word at offset 12
  set_u32(&c2, 12, PrefixCache::kChainHashVersion + 1);
  EXPECT_EQ(check_i(c2, 6), BlobCheck::kForeign);
  // A future version's blob may be shorter than ours: still foreign, not corrupt.
  EXPECT_EQ(check_i(v2.substr(0, 20), 6), BlobCheck::kForeign);
}

TEST(KvTierBlob, Version1BlobsAreStillRead) {
  // Version 2 added the parent's hash after the flags; a version 1 blob (a disk tier or a Redis
  // written before) still loads, with no parent.
  const std::string b2 = make_blob(6);
  BlobHeader h2;
  ASSERT_EQ(decode_header(b2, &h2), BlobCheck::kOk);
  std::string b1 = b2;
  b1.erase(60, 16);  // magic 8, versions 8, fingerprint 8, tag 4, block size 4, ns 8, hash 16, flags 4
  for (int k = 0; k < 4; ++k) b1[8 + k] = static_cast<char>(k == 0 ? 1 : 0);
  const size_t covered = 60 + 4 * size_t(kBlobBs) + 16;
  const uint64_t x = XXH3_64bits(b1.data(), covered);
  for (int k = 0; k < 8; ++k) b1[covered + k] = static_cast<char>(x >> (8 * k));
  BlobHeader h1;
  ASSERT_EQ(decode_header(b1, &h1), BlobCheck::kOk);
  EXPECT_EQ(h1.parent, PageHash{});
  EXPECT_EQ(h1.header_bytes + 16, h2.header_bytes);
  EXPECT_EQ(check_i(b1, 6), BlobCheck::kOk);
  // And the parent a version 2 blob names comes back.
  const auto tok = tokens_for(kBlobBs, 8);
  const std::string c = encode_blob(kId, hash_of(8), hash_of(7), tok.data(), 0, payload_for(10, 1));
  BlobHeader hc;
  ASSERT_EQ(decode_header(c, &hc), BlobCheck::kOk);
  EXPECT_EQ(hc.parent, hash_of(7));
}

// ---- KvLayout::format_tag ----------------------------------------------------------------

KvLayout layout_of(KvDtype d, int32_t v_from_k = 0, std::vector<KvDtype> per_layer = {}) {
  KvLayout l;
  l.n_layer = 2;
  l.n_head_kv = 2;
  l.head_dim = 64;
  l.block_size = 16;
  l.dtype = d;
  l.v_from_k = v_from_k;
  l.layer_dtypes = std::move(per_layer);
  return l;
}

TEST(KvTierFormatTag, NamesThePageFormat) {
  const KvLayout a = layout_of(KvDtype::kF16), a2 = layout_of(KvDtype::kF16);
  EXPECT_EQ(a.format_tag(), a2.format_tag());
  // An override that says what the base dtype says stores pages identically.
  EXPECT_EQ(a.format_tag(), layout_of(KvDtype::kF16, 0, {KvDtype::kF16, KvDtype::kF16}).format_tag());
  EXPECT_NE(a.format_tag(), layout_of(KvDtype::kF16, 0, {KvDtype::kInt8, KvDtype::kF16}).format_tag());
  EXPECT_NE(a.format_tag(), layout_of(KvDtype::kF16, 0, {KvDtype::kF16, KvDtype::kInt8}).format_tag());
  EXPECT_NE(layout_of(KvDtype::kF16, 0, {KvDtype::kInt8, KvDtype::kF16}).format_tag(),
            layout_of(KvDtype::kF16, 0, {KvDtype::kF16, KvDtype::kInt8}).format_tag());
  EXPECT_NE(a.format_tag(), layout_of(KvDtype::kInt8).format_tag());
  KvLayout b = a;
  b.block_size = 32;
  EXPECT_NE(a.format_tag(), b.format_tag());
  b = a;
  b.n_head_kv = 4;
  EXPECT_NE(a.format_tag(), b.format_tag());
  b = a;
  b.head_dim = 128;
  EXPECT_NE(a.format_tag(), b.format_tag());
  b = a;
  b.n_layer = 3;
  EXPECT_NE(a.format_tag(), b.format_tag());
  EXPECT_NE(a.format_tag(), layout_of(KvDtype::kF16, 16).format_tag());
}

// ---- DiskStore ----------------------------------------------------------------------------

std::unique_ptr<DiskStore> open_disk(const std::string& dir, int64_t max_bytes = int64_t(1) << 30, const PageIdentity& id = kId) {
  auto r = DiskStore::open(dir, max_bytes, id);
  EXPECT_TRUE(r.is_ok()) << r.message();
  return r ? std::move(*r) : nullptr;
}

// Pages 0..n-1 of kId's namespace as put() takes them, page i with a payload of payload(i) bytes.
struct Batch {
  std::vector<PageHash> hs;
  std::vector<uint64_t> ns;
  std::vector<std::string> bs;
};
template <class F>
Batch batch_of(int n, F payload) {
  Batch b;
  for (int i = 0; i < n; ++i) {
    b.hs.push_back(hash_of(i));
    b.ns.push_back(kId.ns_tag);
    b.bs.push_back(make_blob(i, payload(i)));
  }
  return b;
}

bool put1(PageStore& s, uint64_t i, const std::string& blob, uint64_t ns = kId.ns_tag) {
  const PageHash h = hash_of(i);
  const std::string b = blob;
  return s.put(std::span<const PageHash>(&h, 1), std::span<const uint64_t>(&ns, 1), std::span<const std::string>(&b, 1)).at(0);
}
std::optional<std::string> get1(PageStore& s, uint64_t i, uint64_t ns = kId.ns_tag) {
  const PageHash h = hash_of(i);
  auto v = s.get(ns, std::span<const PageHash>(&h, 1));
  return v.empty() ? std::nullopt : v[0];
}

TEST(KvTierDiskStore, PutGetRoundTrip) {
  TmpDir t("disk");
  auto s = open_disk(t.path);
  ASSERT_TRUE(s);
  EXPECT_STREQ(s->name(), "disk");
  auto [hs, ns, bs] = batch_of(5, [](int i) { return size_t(500 + i); });
  EXPECT_FALSE(s->may_contain(hs[0]));
  ASSERT_EQ(s->put(hs, ns, bs), std::vector<bool>(hs.size(), true));
  EXPECT_EQ(s->n_pages(), 5);
  int64_t total = 0;
  for (const auto& b : bs) total += static_cast<int64_t>(b.size());
  EXPECT_EQ(s->bytes(), total);
  auto got = s->get(kId.ns_tag, hs);
  ASSERT_EQ(got.size(), 5u);
  for (int i = 0; i < 5; ++i) {
    ASSERT_TRUE(got[i].has_value()) << i;
    EXPECT_EQ(*got[i], bs[i]);
    EXPECT_TRUE(s->may_contain(hs[i]));
    EXPECT_TRUE(fs::exists(s->path_of(hs[i])));
    EXPECT_EQ(read_bytes(s->path_of(hs[i])), bs[i]);
  }
  // The documented layout: ROOT/<first 2 hex>/<hex>.kvp, ROOT under dir.
  const std::string hex = hs[0].hex();
  EXPECT_EQ(s->path_of(hs[0]), s->root() + "/" + hex.substr(0, 2) + "/" + hex + ".kvp");
  EXPECT_EQ(fs::path(s->root()).parent_path(), fs::path(t.path));
  // Nothing left in tmp/.
  EXPECT_TRUE(fs::is_empty(fs::path(s->root()) / "tmp"));
  TierStats st;
  s->fill_stats(&st);
  EXPECT_EQ(st.pages_stored, 5);
  EXPECT_EQ(st.bytes_stored, total);
  EXPECT_EQ(st.errors, 0);
  // remove()
  s->remove(kId.ns_tag, hs[2]);
  EXPECT_FALSE(s->may_contain(hs[2]));
  EXPECT_FALSE(fs::exists(s->path_of(hs[2])));
  EXPECT_EQ(s->n_pages(), 4);
}

TEST(KvTierDiskStore, GetStopsAtFirstAbsent) {
  TmpDir t("disk");
  auto s = open_disk(t.path);
  ASSERT_TRUE(s);
  ASSERT_TRUE(put1(*s, 0, make_blob(0)));
  ASSERT_TRUE(put1(*s, 2, make_blob(2)));
  std::vector<PageHash> hs = {hash_of(0), hash_of(1), hash_of(2)};
  auto got = s->get(kId.ns_tag, hs);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(got[0].has_value());
  EXPECT_FALSE(got[1].has_value());
  EXPECT_FALSE(got[2].has_value());  // present, but after the gap
  // A file deleted behind the store's back: a miss and an error, and it leaves the index.
  fs::remove(s->path_of(hash_of(0)));
  got = s->get(kId.ns_tag, hs);
  EXPECT_FALSE(got[0].has_value());
  EXPECT_FALSE(s->may_contain(hash_of(0)));
  TierStats st;
  s->fill_stats(&st);
  EXPECT_EQ(st.errors, 1);
}

TEST(KvTierDiskStore, ReopenRebuildsIndex) {
  TmpDir t("disk");
  std::vector<std::string> bs;
  {
    auto s = open_disk(t.path);
    ASSERT_TRUE(s);
    for (int i = 0; i < 4; ++i) {
      bs.push_back(make_blob(i, 400));
      ASSERT_TRUE(put1(*s, i, bs.back()));
    }
  }
  auto s = open_disk(t.path);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->dropped_at_open(), 0);
  EXPECT_EQ(s->n_pages(), 4);
  EXPECT_EQ(s->bytes(), 4 * static_cast<int64_t>(bs[0].size()));
  for (int i = 0; i < 4; ++i) {
    EXPECT_TRUE(s->may_contain(hash_of(i)));
    auto g = get1(*s, i);
    ASSERT_TRUE(g.has_value()) << i;
    EXPECT_EQ(*g, bs[i]);
    EXPECT_EQ(check_i(*g, i), BlobCheck::kOk);
  }
}

TEST(KvTierDiskStore, CorruptBeforeOpenIsDroppedAfterOpenIsCaughtByCheck) {
  TmpDir t("disk");
  std::string p_hdr, p_trunc, p_ok, p_late, p_renamed;
  {
    auto s = open_disk(t.path);
    ASSERT_TRUE(s);
    for (int i = 0; i < 5; ++i) ASSERT_TRUE(put1(*s, i, make_blob(i, 400)));
    p_hdr = s->path_of(hash_of(0));
    p_trunc = s->path_of(hash_of(1));
    p_ok = s->path_of(hash_of(2));
    p_late = s->path_of(hash_of(3));
    p_renamed = s->path_of(hash_of(4));
  }
  flip_byte(p_hdr, 20);  // inside the header (the fingerprint): its checksum fails
  {
    std::string b = read_bytes(p_trunc);
    write_bytes(p_trunc, b.substr(0, b.size() - 1));
  }
  // A valid blob under another page's name: not ours.
  const std::string other = fs::path(p_renamed).parent_path().string() + "/" + hash_of(99).hex() + ".kvp";
  fs::rename(p_renamed, other);
  auto s = open_disk(t.path);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->dropped_at_open(), 3);
  EXPECT_FALSE(fs::exists(p_hdr));
  EXPECT_FALSE(fs::exists(p_trunc));
  EXPECT_FALSE(fs::exists(other));
  EXPECT_FALSE(s->may_contain(hash_of(0)));
  EXPECT_FALSE(s->may_contain(hash_of(1)));
  EXPECT_FALSE(s->may_contain(hash_of(99)));
  EXPECT_TRUE(s->may_contain(hash_of(2)));
  EXPECT_TRUE(s->may_contain(hash_of(3)));
  EXPECT_EQ(s->n_pages(), 2);
  EXPECT_TRUE(fs::exists(p_ok));

  // Corrupted after open: the store hands the bytes back; the check rejects them.
  flip_byte(p_late, fs::file_size(p_late) - 10);  // a payload byte
  auto g = get1(*s, 3);
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(check_i(*g, 3), BlobCheck::kCorrupt);
  auto g2 = get1(*s, 2);
  ASSERT_TRUE(g2.has_value());
  EXPECT_EQ(check_i(*g2, 2), BlobCheck::kOk);
}

TEST(KvTierDiskStore, StaleTmpFileRemovedAtOpen) {
  TmpDir t("disk");
  std::string root;
  {
    auto s = open_disk(t.path);
    ASSERT_TRUE(s);
    ASSERT_TRUE(put1(*s, 0, make_blob(0)));
    root = s->root();
  }
  const std::string tmp = root + "/tmp/" + hash_of(7).hex() + ".3.tmp";
  write_bytes(tmp, make_blob(7).substr(0, 50));  // a write interrupted by a crash
  ASSERT_TRUE(fs::exists(tmp));
  auto s = open_disk(t.path);
  ASSERT_TRUE(s);
  EXPECT_FALSE(fs::exists(tmp));
  EXPECT_EQ(s->dropped_at_open(), 1);
  EXPECT_EQ(s->n_pages(), 1);
  EXPECT_FALSE(s->may_contain(hash_of(7)));
  EXPECT_TRUE(s->may_contain(hash_of(0)));
}

TEST(KvTierDiskStore, LruByBytes) {
  TmpDir t("disk");
  const std::string b0 = make_blob(0, 1000);
  const int64_t n = static_cast<int64_t>(b0.size());
  auto s = open_disk(t.path, 3 * n);
  ASSERT_TRUE(s);
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(put1(*s, i, make_blob(i, 1000)));
  EXPECT_EQ(s->bytes(), 3 * n);
  ASSERT_TRUE(get1(*s, 0).has_value());  // 0 is now the most recent; 1 the least
  ASSERT_TRUE(put1(*s, 3, make_blob(3, 1000)));
  EXPECT_EQ(s->n_pages(), 3);
  EXPECT_EQ(s->bytes(), 3 * n);
  EXPECT_FALSE(s->may_contain(hash_of(1)));
  EXPECT_FALSE(fs::exists(s->path_of(hash_of(1))));
  EXPECT_FALSE(get1(*s, 1).has_value());
  for (int i : {0, 2, 3}) {
    EXPECT_TRUE(s->may_contain(hash_of(i))) << i;
    EXPECT_TRUE(get1(*s, i).has_value()) << i;
  }
  // Recency now 0, 2, 3 (the gets above, in that order); re-putting 0 refreshes it: 2, 3, 0.
  ASSERT_TRUE(put1(*s, 0, make_blob(0, 1000)));
  ASSERT_TRUE(put1(*s, 4, make_blob(4, 1000)));
  EXPECT_FALSE(s->may_contain(hash_of(2)));
  EXPECT_TRUE(s->may_contain(hash_of(0)));
  EXPECT_TRUE(s->may_contain(hash_of(3)));
  EXPECT_TRUE(s->may_contain(hash_of(4)));
  // A blob larger than the budget is refused and evicts nothing.
  EXPECT_FALSE(put1(*s, 5, make_blob(5, 4 * 1000)));
  EXPECT_EQ(s->n_pages(), 3);
  // Reopened with a smaller budget: trimmed at once.
  s.reset();
  s = open_disk(t.path, 2 * n);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->n_pages(), 2);
  EXPECT_LE(s->bytes(), 2 * n);
}

TEST(KvTierDiskStore, OverBudgetAPrefixLosesItsTailNotItsHead) {
  // A prefix's pages come in chain order. Plain LRU evicted the first page first, which left the
  // rest on disk and unreachable (a lookup stops at the first gap; a user test saw a 26-page
  // prompt keep 14 useless pages). The head must be what stays, also across a restart.
  TmpDir t("disk");
  const int64_t n = static_cast<int64_t>(make_blob(0, 1000).size());
  auto s = open_disk(t.path, 3 * n);
  ASSERT_TRUE(s);
  auto [hs, ns, bs] = batch_of(5, [](int) { return size_t(1000); });
  s->put(hs, ns, bs);
  EXPECT_EQ(s->n_pages(), 3);
  for (int i = 0; i < 3; ++i) EXPECT_TRUE(s->may_contain(hash_of(i))) << i;
  auto got = s->get(kId.ns_tag, hs);
  EXPECT_TRUE(got[0] && got[1] && got[2] && !got[3]);
  // A later prefix pushes this one out from its tail too.
  std::vector<PageHash> hs2 = {hash_of(10), hash_of(11)};
  s->put(hs2, std::vector<uint64_t>(2, kId.ns_tag), std::vector<std::string>{make_blob(10, 1000), make_blob(11, 1000)});
  EXPECT_TRUE(s->may_contain(hash_of(0)));
  EXPECT_FALSE(s->may_contain(hash_of(1)));
  EXPECT_FALSE(s->may_contain(hash_of(2)));
  // Reopened with room for one: the newest file is the newest prefix's head.
  s.reset();
  s = open_disk(t.path, n);
  ASSERT_TRUE(s);
  EXPECT_TRUE(s->may_contain(hash_of(10)));
  EXPECT_FALSE(s->may_contain(hash_of(11)));
}

// Pages of a chain: page i names page i - 1 as its parent (the chain's first page: none).
std::string chain_blob(uint64_t i, uint64_t first, size_t payload = 1000) {
  const auto tok = tokens_for(kId.block_size, static_cast<int32_t>(i));
  const auto p = payload_for(payload, static_cast<uint32_t>(i));
  return encode_blob(kId, hash_of(i), i > first ? hash_of(i - 1) : PageHash{}, tok.data(), 0, p);
}
// put() of pages ids (in that order) of the chain starting at first.
void put_chain(PageStore& s, std::vector<uint64_t> ids, uint64_t first) {
  std::vector<PageHash> hs;
  std::vector<std::string> bs;
  for (uint64_t i : ids) {
    hs.push_back(hash_of(i));
    bs.push_back(chain_blob(i, first));
  }
  s.put(hs, std::vector<uint64_t>(ids.size(), kId.ns_tag), bs);
}
// How many pages of the chain first..first+n-1 a lookup gets (it stops at the first gap).
int reachable(PageStore& s, uint64_t first, int n) {
  std::vector<PageHash> hs;
  for (int i = 0; i < n; ++i) hs.push_back(hash_of(first + i));
  auto got = s.get(kId.ns_tag, hs);
  int k = 0;
  while (k < n && got[k]) ++k;
  return k;
}

TEST(KvTierDiskStore, AcrossTurnsAPrefixLosesItsTailNotItsHead) {
  // Turn 1 wrote pages 0-3; turn 2, later, continues them with 4-7. Plain LRU held 0-3 as the
  // oldest and deleted the head first, leaving 4-7 on disk and unreachable. With the blobs'
  // parent links the pages no stored page continues go first: the tail.
  TmpDir t("disk");
  const int64_t n = static_cast<int64_t>(chain_blob(0, 0).size());
  auto s = open_disk(t.path, 6 * n);
  ASSERT_TRUE(s);
  put_chain(*s, {0, 1, 2, 3}, 0);
  put_chain(*s, {4, 5, 6, 7}, 0);
  EXPECT_EQ(s->n_pages(), 6);
  EXPECT_EQ(reachable(*s, 0, 8), 6);
  // Another conversation (10-12) arrives: the older chain's tail goes, not its head.
  put_chain(*s, {10, 11, 12}, 10);
  EXPECT_EQ(s->n_pages(), 6);
  EXPECT_EQ(reachable(*s, 0, 8), 3);
  EXPECT_EQ(reachable(*s, 10, 3), 3);
  // A restart reads the links from the blobs: trimmed to 4 pages, both heads stay, and the
  // least recently used leaf (the first chain's page 2) went first.
  s.reset();
  s = open_disk(t.path, 4 * n);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->n_pages(), 4);
  EXPECT_EQ(reachable(*s, 0, 8) + reachable(*s, 10, 3), 4);
  EXPECT_GE(reachable(*s, 0, 8), 1);
  EXPECT_GE(reachable(*s, 10, 3), 1);
}

TEST(KvTierDiskStore, ChildrenWrittenBeforeTheirParentsStillGoFirst) {
  // Write-back writes what RAM evicts, and RAM evicts its leaves first: a prefix's deeper
  // pages reach the disk before its head, in separate batches.
  TmpDir t("disk");
  const int64_t n = static_cast<int64_t>(chain_blob(0, 0).size());
  auto s = open_disk(t.path, 4 * n);
  ASSERT_TRUE(s);
  put_chain(*s, {5, 6, 7}, 0);
  put_chain(*s, {3, 4}, 0);
  put_chain(*s, {0, 1, 2}, 0);
  EXPECT_EQ(s->n_pages(), 4);
  EXPECT_EQ(reachable(*s, 0, 8), 4);
  // Two branches on a shared head (pages 0-1): page 2 (older) and page 3 (newer) both continue
  // page 1. Over the budget the older branch goes; the shared head stays while a branch needs it.
  TmpDir t2("disk");
  auto s2 = open_disk(t2.path, 3 * n);
  ASSERT_TRUE(s2);
  put_chain(*s2, {0, 1}, 0);
  const auto tok2 = tokens_for(kId.block_size, 2), tok3 = tokens_for(kId.block_size, 3);
  const auto p = payload_for(1000, 9);
  const PageHash a = hash_of(2), b = hash_of(3);
  const std::vector<std::string> ba = {encode_blob(kId, a, hash_of(1), tok2.data(), 0, p)};
  const std::vector<std::string> bb = {encode_blob(kId, b, hash_of(1), tok3.data(), 0, p)};
  s2->put(std::span<const PageHash>(&a, 1), std::vector<uint64_t>{kId.ns_tag}, ba);
  s2->put(std::span<const PageHash>(&b, 1), std::vector<uint64_t>{kId.ns_tag}, bb);
  EXPECT_EQ(s2->n_pages(), 3);  // the older branch (page 2) went
  EXPECT_TRUE(s2->may_contain(hash_of(0)));
  EXPECT_TRUE(s2->may_contain(hash_of(1)));
  EXPECT_FALSE(s2->may_contain(a));
  EXPECT_TRUE(s2->may_contain(b));
}

TEST(KvTierDiskStore, APromptLargerThanTheBudgetKeepsItsHead) {
  // A user test: a 63-page prompt written in chain order (write-through, a clean stop), 16 pages
  // per batch, on a 45-page budget kept 33-41 head pages and 4-12 pages after a gap. The pages
  // after the gap cannot be reached: they go before any reachable page.
  TmpDir t("disk");
  const int64_t n = static_cast<int64_t>(chain_blob(0, 0).size());
  auto s = open_disk(t.path, 45 * n);
  ASSERT_TRUE(s);
  for (uint64_t b = 0; b < 63; b += 16) {
    std::vector<uint64_t> ids;
    for (uint64_t i = b; i < std::min<uint64_t>(63, b + 16); ++i) ids.push_back(i);
    put_chain(*s, ids, 0);
  }
  EXPECT_EQ(s->n_pages(), 45);
  EXPECT_EQ(reachable(*s, 0, 63), 45);
  // Pages whose parent is gone (here: written after it was deleted) go before reachable leaves,
  // however recent they are.
  put_chain(*s, {60, 61, 62}, 0);
  EXPECT_EQ(s->n_pages(), 45);
  EXPECT_EQ(reachable(*s, 0, 63), 45);
  for (uint64_t i : {60, 61, 62}) EXPECT_FALSE(s->may_contain(hash_of(i))) << i;
}

TEST(KvTierDiskStore, TouchMakesAPrefixRecent) {
  TmpDir t("disk");
  const int64_t n = static_cast<int64_t>(chain_blob(0, 0).size());
  auto s = open_disk(t.path, 4 * n);
  ASSERT_TRUE(s);
  put_chain(*s, {0, 1}, 0);
  put_chain(*s, {10, 11}, 10);
  const std::vector<PageHash> old = {hash_of(1), hash_of(0)};
  s->touch(old);  // 0-1 used again: 10-11 is now the least recently used
  put_chain(*s, {20, 21}, 20);
  EXPECT_EQ(reachable(*s, 0, 2), 2);
  EXPECT_EQ(reachable(*s, 20, 2), 2);
  EXPECT_EQ(reachable(*s, 10, 2), 0);
}

TEST(KvTierDiskStore, PagesAreOrderedByTheirLastUseNotByWhenTheyArrive) {
  // A clean stop writes a RAM cache's older pages before its newest; write-back writes a page
  // when RAM drops it. Each page carries its last use, and that is its recency here, across a
  // restart too (the files' times).
  TmpDir t("disk");
  const int64_t n = static_cast<int64_t>(chain_blob(0, 0).size());
  const int64_t now = DiskStore::now_ns(), sec = 1000000000;
  auto put_used = [&](DiskStore& s, std::vector<uint64_t> ids, uint64_t first, int64_t used) {
    std::vector<PageHash> hs;
    std::vector<std::string> bs;
    for (uint64_t i : ids) {
      hs.push_back(hash_of(i));
      bs.push_back(chain_blob(i, first));
    }
    s.put(hs, std::vector<uint64_t>(ids.size(), kId.ns_tag), bs, std::vector<int64_t>(ids.size(), used));
  };
  {
    auto s = open_disk(t.path, 4 * n);
    ASSERT_TRUE(s);
    put_used(*s, {0, 1}, 0, now - 10 * sec);   // used last
    put_used(*s, {10, 11}, 10, now - 30 * sec);  // arrives later, used earlier
    put_used(*s, {20, 21}, 20, now - 20 * sec);  // over budget: 10-11 go, not 0-1
    EXPECT_EQ(reachable(*s, 0, 2), 2);
    EXPECT_EQ(reachable(*s, 20, 2), 2);
    EXPECT_EQ(reachable(*s, 10, 2), 0);
    // A refresh with an older use than the store knows changes nothing (nor the files' times).
    const std::vector<PageHash> h0 = {hash_of(1), hash_of(0)};
    s->touch(h0, std::vector<int64_t>(2, now - 40 * sec));
  }
  // After a restart with room for 2 pages, by the files' times: 20-21 (used at now - 20 s) is
  // older than 0-1 (now - 10 s).
  auto s = open_disk(t.path, 2 * n);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->n_pages(), 2);
  EXPECT_EQ(reachable(*s, 0, 2), 2);
}

TEST(KvTierDiskStore, AFullFilesystemMakesRoomFromTheOldestPages) {
  // The filesystem fills before --kv-disk-bytes does (a small tmpfs here): the store evicts its
  // least recently used pages and writes. It used to drop every later write.
  TmpDir t("diskfull");
  const std::string mnt = t.path + "/mnt";
  fs::create_directories(mnt);
  if (std::system(("mount -t tmpfs -o size=600k tmpfs " + mnt + " 2>/dev/null").c_str()) != 0)
    GTEST_SKIP() << "cannot mount a tmpfs here (needs root)";
  struct Unmount {
    std::string m;
    ~Unmount() { (void)!std::system(("umount " + m).c_str()); }
  } unmount{mnt};
  {
    auto s = open_disk(mnt, int64_t(1) << 30);
    ASSERT_TRUE(s);
    testing::internal::CaptureStderr();
    for (int i = 0; i < 30; ++i) EXPECT_TRUE(put1(*s, i, make_blob(i, 64 * 1024))) << i;  // 64 KiB each, ~1.9 MiB in all
    // the operator is told, once (nothing said it: a user test)
    const std::string told = testing::internal::GetCapturedStderr();
    EXPECT_NE(told.find("is full at"), std::string::npos) << told;
    EXPECT_EQ(told.find("is full at"), told.rfind("is full at")) << told;
    EXPECT_GT(s->n_pages(), 2);
    EXPECT_LT(s->n_pages(), 30);
    EXPECT_TRUE(get1(*s, 29).has_value());
    EXPECT_FALSE(s->may_contain(hash_of(0)));
  }
}

TEST(KvTierDiskStore, IdentityPicksSubdirectory) {
  TmpDir t("disk");
  PageIdentity other_fp = kId, other_fmt = kId, other_ns = kId;
  other_fp.fingerprint ^= 0xff;
  other_fmt.format_tag ^= 0xff;
  other_ns.ns_tag ^= 0xff;
  auto a = open_disk(t.path, int64_t(1) << 30, kId);
  auto b = open_disk(t.path, int64_t(1) << 30, other_fp);
  auto c = open_disk(t.path, int64_t(1) << 30, other_fmt);
  ASSERT_TRUE(a && b && c);
  EXPECT_NE(a->root(), b->root());
  EXPECT_NE(a->root(), c->root());
  EXPECT_NE(b->root(), c->root());
  {
    // The namespace is in the hash, not the directory: d's is a's, which a holds locked (two
    // servers on one directory deleted each other's pages).
    auto d = DiskStore::open(t.path, int64_t(1) << 30, other_ns);
    ASSERT_FALSE(d.is_ok());
    EXPECT_NE(d.message().find("in use by another kvserve process (pid " + std::to_string(::getpid()) + ")"), std::string::npos)
        << d.message();
    const std::string root_a = a->root();
    auto a2 = std::move(a);
    a2.reset();
    auto d2 = open_disk(t.path, int64_t(1) << 30, other_ns);
    ASSERT_TRUE(d2);
    EXPECT_EQ(d2->root(), root_a);
    d2.reset();
    a = open_disk(t.path, int64_t(1) << 30, kId);
    ASSERT_TRUE(a);
  }
  char sub[40];
  std::snprintf(sub, sizeof sub, "%016llx-%08x", static_cast<unsigned long long>(kId.fingerprint), kId.format_tag);
  EXPECT_EQ(fs::path(a->root()).filename().string(), sub);
  ASSERT_TRUE(put1(*a, 0, make_blob(0)));
  EXPECT_FALSE(b->may_contain(hash_of(0)));
  EXPECT_FALSE(get1(*b, 0).has_value());
  EXPECT_FALSE(fs::exists(b->path_of(hash_of(0))));
  EXPECT_FALSE(get1(*c, 0).has_value());
  // Reopening b does not touch a's files.
  b.reset();
  b = open_disk(t.path, int64_t(1) << 30, other_fp);
  EXPECT_EQ(b->dropped_at_open(), 0);
  EXPECT_TRUE(fs::exists(a->path_of(hash_of(0))));
}

TEST(KvTierDiskStore, OpenFailsWhenDirCannotBeCreated) {
  TmpDir t("disk");
  write_bytes(t.path + "/file", "x");  // a regular file where a directory should go (fails as root too)
  auto r = DiskStore::open(t.path + "/file/sub", 1 << 20, kId);
  EXPECT_FALSE(r.is_ok());
  EXPECT_NE(r.message().find("cannot create"), std::string::npos) << r.message();
}

size_t count_of(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t at = text.find(what); at != std::string::npos; at = text.find(what, at + 1)) ++n;
  return n;
}

TEST(KvTierDiskStore, RemovedWhileOpenIsRecreatedAndLockedAgain) {
  // rm -rf of --kv-disk-dir while a server ran: tmp/ was never recreated, so every later write
  // failed, silently; the index kept listing the deleted pages, and the lock file was gone (a
  // second server could open the directory). Now the next put (or a get finding a file gone)
  // recreates the directory and the lock, drops the lost pages from the index, tells stderr once.
  TmpDir t("diskrm");
  auto s = open_disk(t.path);
  ASSERT_TRUE(s);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(put1(*s, i, make_blob(i)));
  const std::string root = s->root();
  fs::remove_all(t.path);
  ::testing::internal::CaptureStderr();
  EXPECT_TRUE(put1(*s, 10, make_blob(10)));
  EXPECT_TRUE(put1(*s, 11, make_blob(11)));
  std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(err, root + " was removed while in use (4 of its 4 pages gone with it)"), 1u) << err;
  EXPECT_EQ(s->n_pages(), 2);  // the index no longer lists what rm took
  EXPECT_EQ(s->bytes(), 2 * int64_t(make_blob(10).size()));
  for (uint64_t i = 0; i < 4; ++i) EXPECT_FALSE(s->may_contain(hash_of(i))) << i;
  EXPECT_TRUE(fs::is_directory(root + "/tmp"));
  EXPECT_TRUE(fs::exists(s->path_of(hash_of(10))));
  EXPECT_TRUE(get1(*s, 11) == make_blob(11));
  TierStats st;
  s->fill_stats(&st);
  EXPECT_EQ(st.pages_stored, 2);
  EXPECT_GE(st.errors, 1);  // the removal is counted
  {
    // The lock is held again: a second store (another server) is refused, naming this process.
    auto d = DiskStore::open(t.path, int64_t(1) << 30, kId);
    ASSERT_FALSE(d.is_ok());
    EXPECT_NE(d.message().find("in use by another kvserve process (pid " + std::to_string(::getpid()) + ")"), std::string::npos)
        << d.message();
  }

  // Removed again, and noticed by a read this time (a lookup finds its file gone).
  fs::remove_all(t.path);
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(get1(*s, 10).has_value());
  err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(err, " was removed while in use"), 1u) << err;
  EXPECT_EQ(s->n_pages(), 0);
  EXPECT_TRUE(fs::is_directory(root + "/tmp"));
  EXPECT_TRUE(fs::exists(root + "/lock"));
  EXPECT_FALSE(DiskStore::open(t.path, int64_t(1) << 30, kId).is_ok());
  ::testing::internal::CaptureStderr();
  EXPECT_TRUE(put1(*s, 12, make_blob(12)));
  EXPECT_EQ(::testing::internal::GetCapturedStderr(), "");  // nothing more to tell

  // What was written after the removal is found after a restart.
  s.reset();
  s = open_disk(t.path);
  ASSERT_TRUE(s);
  EXPECT_EQ(s->n_pages(), 1);
  EXPECT_EQ(s->dropped_at_open(), 0);
  EXPECT_TRUE(get1(*s, 12) == make_blob(12));
}

TEST(KvTierDiskStore, ARefreshNoticesAFileOrTheDirectoryGone) {
  // Refreshes (touch, and a put of a page the index lists) set the file's time and ignored a
  // failure: a page whose file was deleted stayed listed (a put of it answered "stored" and
  // wrote nothing), and after rm -rf a server that only refreshed never recreated the directory.
  TmpDir t("disktouch");
  auto s = open_disk(t.path);
  ASSERT_TRUE(s);
  for (uint64_t i = 0; i < 4; ++i) ASSERT_TRUE(put1(*s, i, make_blob(i)));
  const std::string root = s->root();
  const int64_t later = DiskStore::now_ns() + int64_t(1000000000);
  // One file deleted: a refresh drops it from the index.
  ASSERT_EQ(::unlink(s->path_of(hash_of(1)).c_str()), 0);
  const std::vector<PageHash> one = {hash_of(1)};
  s->touch(one, std::vector<int64_t>{later});
  EXPECT_EQ(s->n_pages(), 3);
  EXPECT_FALSE(s->may_contain(hash_of(1)));
  // Another deleted, then written again: the put stores it (it only refreshed the listing).
  ASSERT_EQ(::unlink(s->path_of(hash_of(2)).c_str()), 0);
  const std::vector<PageHash> two = {hash_of(2)};
  const std::vector<uint64_t> tags = {kId.ns_tag};
  const std::vector<std::string> blobs = {make_blob(2)};
  EXPECT_EQ(s->put(two, tags, blobs, std::vector<int64_t>{later}), std::vector<bool>{true});
  EXPECT_TRUE(fs::exists(s->path_of(hash_of(2))));
  EXPECT_TRUE(get1(*s, 2) == make_blob(2));
  // The whole directory removed, and only refreshes come: the first one recovers the store.
  fs::remove_all(t.path);
  ::testing::internal::CaptureStderr();
  const std::vector<PageHash> zero = {hash_of(0)};
  s->touch(zero, std::vector<int64_t>{later + 1000});
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(err, root + " was removed while in use"), 1u) << err;
  EXPECT_EQ(s->n_pages(), 0);
  EXPECT_EQ(s->bytes(), 0);
  EXPECT_TRUE(fs::is_directory(root + "/tmp"));
  EXPECT_FALSE(DiskStore::open(t.path, int64_t(1) << 30, kId).is_ok());  // locked again
  EXPECT_TRUE(put1(*s, 5, make_blob(5)));
  EXPECT_TRUE(get1(*s, 5) == make_blob(5));
}

TEST(KvTierDiskStore, ADirectoryRemovedAndTakenByAnotherServerTurnsTheStoreOff) {
  // Between the removal and this store noticing it, another server opened the directory (the
  // lock file was gone): the directory is the other's now. This store stops using it, deleting
  // nothing of the other's.
  TmpDir t("disktaken");
  auto a = open_disk(t.path);
  ASSERT_TRUE(a);
  ASSERT_TRUE(put1(*a, 0, make_blob(0)));
  fs::remove_all(t.path);
  auto b = open_disk(t.path);  // the lock file is gone: a second store opens it
  ASSERT_TRUE(b);
  ASSERT_TRUE(put1(*b, 0, make_blob(0)));
  ::testing::internal::CaptureStderr();
  EXPECT_FALSE(put1(*a, 1, make_blob(1)));
  EXPECT_FALSE(put1(*a, 2, make_blob(2)));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(err, "another kvserve process (pid " + std::to_string(::getpid()) + ") has locked it since"), 1u) << err;
  EXPECT_EQ(a->n_pages(), 0);
  EXPECT_FALSE(get1(*a, 0).has_value());
  a->remove(kId.ns_tag, hash_of(0));
  a.reset();
  EXPECT_TRUE(get1(*b, 0) == make_blob(0));  // b's page untouched
  EXPECT_FALSE(DiskStore::open(t.path, int64_t(1) << 30, kId).is_ok());  // b's lock still held
}

TEST(KvTierDiskStore, WriteFailuresAreToldOncePerKind) {
  // A write failure was only counted in /metrics. It is told on stderr now, once per errno,
  // naming the directory and the error, as the Redis store tells its errors.
  TmpDir t("diskerr");
  auto s = open_disk(t.path);
  ASSERT_TRUE(s);
  // Pages whose subdirectory is a regular file (ENOTDIR, even as root), and one whose file name
  // is taken by a directory (EISDIR).
  std::vector<uint64_t> notdir;
  uint64_t isdir = 0;
  std::set<std::string> subdirs;
  for (uint64_t i = 100; notdir.size() < 3 || isdir == 0; ++i) {
    const fs::path p = s->path_of(hash_of(i));
    if (!subdirs.insert(p.parent_path().string()).second) continue;
    if (notdir.size() < 3) {
      write_bytes(p.parent_path().string(), "not a directory");
      notdir.push_back(i);
    } else {
      fs::create_directories(p / "x");
      isdir = i;
    }
  }
  uint64_t good = 0;  // a page whose subdirectory is fine
  while (subdirs.count(s->path_of(hash_of(good)).substr(0, s->root().size() + 3))) ++good;
  ::testing::internal::CaptureStderr();
  for (uint64_t i : notdir) EXPECT_FALSE(put1(*s, i, make_blob(i))) << i;
  EXPECT_FALSE(put1(*s, isdir, make_blob(isdir)));
  EXPECT_TRUE(put1(*s, good, make_blob(good)));
  const std::string err = ::testing::internal::GetCapturedStderr();
  EXPECT_EQ(count_of(err, "kv tier: disk: "), 2u) << err;
  EXPECT_EQ(count_of(err, "writing a page in " + s->root() + " failed: " + std::strerror(ENOTDIR)), 1u) << err;
  EXPECT_EQ(count_of(err, "writing a page in " + s->root() + " failed: " + std::strerror(EISDIR)), 1u) << err;
  TierStats st;
  s->fill_stats(&st);
  EXPECT_EQ(st.errors, 4);
  EXPECT_EQ(st.pages_stored, 1);
  EXPECT_TRUE(fs::is_empty(s->root() + "/tmp"));  // the failed writes' temp files are gone
}

// ---- TierManager with a real PagePool ------------------------------------------------------

constexpr uint64_t kFingerprint = 0xfeedfacecafebeefull;

void fill_page(PagePool& pool, int32_t page, uint32_t seed) {
  const KvLayout& L = pool.layout();
  std::mt19937 rng(seed);
  for (int32_t l = 0; l < L.n_layer; ++l) {
    uint8_t* k = pool.k_data(l, page);
    for (int64_t i = 0; i < L.k_layer_page_bytes(l); ++i) k[i] = static_cast<uint8_t>(rng());
    if (L.v_layer_page_bytes(l) > 0) {
      uint8_t* v = pool.v_data(l, page);
      for (int64_t i = 0; i < L.v_layer_page_bytes(l); ++i) v[i] = static_cast<uint8_t>(rng());
    }
    if (pool.has_key_stats()) {
      uint8_t* kb = pool.key_stats(l, page);
      for (int64_t i = 0; i < key_stats_bytes_per_page(L); ++i) kb[i] = static_cast<uint8_t>(rng());
    }
  }
}

// Every byte of page a of pool pa equals page b of pool pb (K and V of every layer, bounds).
void expect_same_page(const PagePool& pa, int32_t a, const PagePool& pb, int32_t b) {
  const KvLayout& L = pa.layout();
  for (int32_t l = 0; l < L.n_layer; ++l) {
    EXPECT_EQ(std::memcmp(pa.k_data(l, a), pb.k_data(l, b), L.k_layer_page_bytes(l)), 0) << "K layer " << l;
    if (L.v_layer_page_bytes(l) > 0) {
      EXPECT_EQ(std::memcmp(pa.v_data(l, a), pb.v_data(l, b), L.v_layer_page_bytes(l)), 0) << "V layer " << l;
    }
    if (pa.has_key_stats() && pb.has_key_stats()) {
      EXPECT_EQ(std::memcmp(pa.key_stats(l, a), pb.key_stats(l, b), size_t(key_stats_bytes_per_page(L))), 0)
          << "bounds layer " << l;
    }
  }
}

std::unique_ptr<TierManager> make_tiers(const TierConfig& cfg, const KvLayout& L, bool bounds = false) {
  auto r = TierManager::create(cfg, L, bounds, kFingerprint);
  EXPECT_TRUE(r.is_ok()) << r.message();
  return r ? std::move(*r) : nullptr;
}

// Polls until the lookup `ticket` is back (at most 5 s).
std::optional<TierManager::Loaded> wait_loaded(TierManager& t, uint64_t ticket) {
  const auto deadline = Clock::now() + std::chrono::seconds(5);
  while (Clock::now() < deadline) {
    for (auto& l : t.poll())
      if (l.ticket == ticket) return std::move(l);
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return std::nullopt;
}

struct TierCase {
  const char* name;
  KvLayout layout;
  bool bounds;
};

class KvTierManagerLayouts : public ::testing::TestWithParam<TierCase> {};

TEST_P(KvTierManagerLayouts, WriteBackFetchInstallRoundTrip) {
  const TierCase& c = GetParam();
  ASSERT_TRUE(c.layout.validate().is_ok()) << c.layout.validate().message();
  const int32_t bs = c.layout.block_size;
  TmpDir t("tm");
  TierConfig cfg;
  cfg.disk_dir = t.path;
  auto tm = make_tiers(cfg, c.layout, c.bounds);
  ASSERT_TRUE(tm);
  PagePool pool(c.layout, 6, 4), pool2(c.layout, 6, 4);
  if (c.bounds) {
    pool.enable_key_stats();
    pool2.enable_key_stats();
  }
  tm->set_pool(&pool);
  std::atomic<int> notified{0};
  tm->set_notify([&] { ++notified; });
  const std::string ns = "tenant-a";
  const auto tokens = tokens_for(3 * bs, 11);
  for (int32_t p = 0; p < 3; ++p) fill_page(pool, p, 100 + p);
  // Write-back: adoption by the cache writes nothing, eviction writes.
  tm->page_cached(hash_of(0), PageHash{}, ns, tokens.data(), 0);
  tm->flush();
  EXPECT_EQ(tm->disk()->n_pages(), 0);
  for (int32_t p = 0; p < 3; ++p) tm->page_evicted(hash_of(p), PageHash{}, ns, tokens.data() + p * bs, p);
  tm->flush();
  EXPECT_EQ(tm->disk()->n_pages(), 3);
  EXPECT_TRUE(tm->may_contain(hash_of(1)));
  EXPECT_FALSE(tm->may_contain(hash_of(7)));
  // The pool pages change after the write (reused): the stored copy must not.
  for (int32_t p = 0; p < 3; ++p) fill_page(pool, p, 999 + p);
  PagePool ref(c.layout, 6, 4);
  if (c.bounds) ref.enable_key_stats();
  for (int32_t p = 0; p < 3; ++p) fill_page(ref, p, 100 + p);

  const uint64_t ticket = tm->fetch(ns, {hash_of(0), hash_of(1), hash_of(2)}, tokens, 0);
  EXPECT_GT(ticket, 0u);
  auto got = wait_loaded(*tm, ticket);
  ASSERT_TRUE(got.has_value()) << "lookup did not finish";
  EXPECT_GE(notified.load(), 1);
  EXPECT_EQ(got->ns, ns);
  EXPECT_EQ(got->first_page, 0);
  EXPECT_EQ(got->tokens, tokens);
  ASSERT_EQ(got->blobs.size(), 3u);
  for (int32_t p = 0; p < 3; ++p) {
    ASSERT_TRUE(tm->install(got->blobs[p], pool2, 5 - p));
    expect_same_page(ref, p, pool2, 5 - p);
  }
  auto st = tm->stats();
  ASSERT_EQ(st.size(), 1u);
  EXPECT_EQ(st[0].s.tier, "disk");
  EXPECT_EQ(st[0].s.hits, 3);
  EXPECT_EQ(st[0].s.pages_written, 3);
  EXPECT_EQ(st[0].s.corrupt, 0);
  EXPECT_EQ(st[0].s.pages_stored, 3);
  EXPECT_GT(st[0].s.bytes_in, 0);
  EXPECT_EQ(st[0].load_count, 1u);

  // Pages found again later: first_page > 0 picks the right tokens.
  const uint64_t t2 = tm->fetch(ns, {hash_of(1), hash_of(2)}, tokens, 1);
  auto got2 = wait_loaded(*tm, t2);
  ASSERT_TRUE(got2.has_value());
  ASSERT_EQ(got2->blobs.size(), 2u);
  EXPECT_EQ(got2->blobs[0], got->blobs[1]);

  // A new manager on the same directory (a restart) serves the pages too.
  tm.reset();
  auto tm2 = make_tiers(cfg, c.layout, c.bounds);
  ASSERT_TRUE(tm2);
  tm2->set_pool(&pool);
  const uint64_t t3 = tm2->fetch(ns, {hash_of(0), hash_of(1), hash_of(2)}, tokens, 0);
  auto got3 = wait_loaded(*tm2, t3);
  ASSERT_TRUE(got3.has_value());
  ASSERT_EQ(got3->blobs.size(), 3u);
  PagePool pool3(c.layout, 3, 4);
  if (c.bounds) pool3.enable_key_stats();
  for (int32_t p = 0; p < 3; ++p) {
    ASSERT_TRUE(tm2->install(got3->blobs[p], pool3, p));
    expect_same_page(ref, p, pool3, p);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, KvTierManagerLayouts,
    ::testing::Values(TierCase{"f16", layout_of(KvDtype::kF16), false}, TierCase{"int8", layout_of(KvDtype::kInt8), false},
                      TierCase{"mixed", layout_of(KvDtype::kF16, 0, {KvDtype::kInt8, KvDtype::kF16}), false},
                      TierCase{"f16_bounds", layout_of(KvDtype::kF16), true},
                      TierCase{"int8_bounds", layout_of(KvDtype::kInt8), true},
                      TierCase{"mla_f16", layout_of(KvDtype::kF16, 16), false}),
    [](const ::testing::TestParamInfo<TierCase>& i) { return std::string(i.param.name); });

struct TmFixture {
  KvLayout layout = layout_of(KvDtype::kF16);
  int32_t bs = layout.block_size;
  TmpDir dir{"tm"};
  TierConfig cfg;
  std::unique_ptr<TierManager> tm;
  PagePool pool{layout, 8, 4};
  std::string ns = "ns";
  std::vector<int32_t> tokens = tokens_for(4 * layout.block_size, 21);
  TmFixture() {
    cfg.disk_dir = dir.path;
    tm = make_tiers(cfg, layout);
    if (tm) tm->set_pool(&pool);
    for (int32_t p = 0; p < 4; ++p) fill_page(pool, p, 50 + p);
  }
  void store(int32_t p) { tm->store(hash_of(p), PageHash{}, ns, tokens.data() + p * bs, p); }
  std::optional<TierManager::Loaded> lookup(int32_t n) {
    std::vector<PageHash> hs;
    for (int32_t p = 0; p < n; ++p) hs.push_back(hash_of(p));
    return wait_loaded(*tm, tm->fetch(ns, hs, tokens, 0));
  }
};

TEST(KvTierManager, LookupEndsAtFirstAbsentPage) {
  TmFixture f;
  ASSERT_TRUE(f.tm);
  f.store(0);
  f.store(2);
  f.tm->flush();
  auto got = f.lookup(3);
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->blobs.size(), 1u);
  PagePool other(f.layout, 2, 4);
  ASSERT_TRUE(f.tm->install(got->blobs[0], other, 1));
  expect_same_page(f.pool, 0, other, 1);
  auto st = f.tm->stats();
  EXPECT_EQ(st[0].s.hits, 1);
  EXPECT_EQ(st[0].s.misses, 1);
  // Nothing at all.
  std::vector<PageHash> none = {hash_of(40), hash_of(41)};
  auto g2 = wait_loaded(*f.tm, f.tm->fetch(f.ns, none, f.tokens, 0));
  ASSERT_TRUE(g2.has_value());
  EXPECT_TRUE(g2->blobs.empty());
}

TEST(KvTierManager, CorruptFileIsDroppedAndCounted) {
  TmFixture f;
  ASSERT_TRUE(f.tm);
  for (int32_t p = 0; p < 3; ++p) f.store(p);
  f.tm->flush();
  const std::string path0 = f.tm->disk()->path_of(hash_of(0));
  ASSERT_TRUE(fs::exists(path0));
  flip_byte(path0, fs::file_size(path0) / 2);  // a payload byte: only the full check sees it
  auto got = f.lookup(3);
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(got->blobs.empty());
  auto st = f.tm->stats();
  EXPECT_EQ(st[0].s.corrupt, 1);
  EXPECT_EQ(st[0].s.hits, 0);
  EXPECT_FALSE(fs::exists(path0));
  EXPECT_FALSE(f.tm->disk()->may_contain(hash_of(0)));
  EXPECT_EQ(f.tm->disk()->n_pages(), 2);

  // A bad second page: the first comes back alone.
  const std::string path2 = f.tm->disk()->path_of(hash_of(2));
  flip_byte(path2, 20);
  std::vector<PageHash> hs = {hash_of(1), hash_of(2)};
  auto g2 = wait_loaded(*f.tm, f.tm->fetch(f.ns, hs, f.tokens, 1));
  ASSERT_TRUE(g2.has_value());
  ASSERT_EQ(g2->blobs.size(), 1u);
  EXPECT_EQ(check_blob(g2->blobs[0], PageIdentity{kFingerprint, f.layout.format_tag(), f.bs, namespace_tag(f.ns)}, hash_of(1),
                       f.tokens.data() + f.bs),
            BlobCheck::kOk);
  st = f.tm->stats();
  EXPECT_EQ(st[0].s.corrupt, 2);
  EXPECT_EQ(st[0].s.hits, 1);
  EXPECT_FALSE(fs::exists(path2));
}

TEST(KvTierManager, WrongTokensAreForeignAndDropped) {
  TmFixture f;
  ASSERT_TRUE(f.tm);
  f.store(0);
  f.tm->flush();
  auto toks = f.tokens;
  toks[3] += 1;  // same hash, other tokens (a hash collision): never served
  std::vector<PageHash> hs = {hash_of(0)};
  auto got = wait_loaded(*f.tm, f.tm->fetch(f.ns, hs, toks, 0));
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(got->blobs.empty());
  EXPECT_EQ(f.tm->stats()[0].s.corrupt, 1);
}

TEST(KvTierManager, WriteThroughAndNoRewrite) {
  TmpDir dir("tm");
  const KvLayout L = layout_of(KvDtype::kF16);
  TierConfig cfg;
  cfg.disk_dir = dir.path;
  cfg.write_through = true;
  auto tm = make_tiers(cfg, L);
  ASSERT_TRUE(tm);
  PagePool pool(L, 4, 4);
  tm->set_pool(&pool);
  fill_page(pool, 0, 1);
  const auto tok = tokens_for(L.block_size, 1);
  tm->page_cached(hash_of(0), PageHash{}, "n", tok.data(), 0);
  tm->flush();
  EXPECT_EQ(tm->disk()->n_pages(), 1);
  tm->page_evicted(hash_of(0), PageHash{}, "n", tok.data(), 0);  // already written: not again
  tm->page_cached(hash_of(0), PageHash{}, "n", tok.data(), 0);
  tm->flush();
  EXPECT_EQ(tm->stats()[0].s.pages_written, 1);
  // No pool set: nothing is written (and nothing crashes). (One store per directory at a time.)
  tm.reset();
  auto tm2 = make_tiers(cfg, L);
  tm2->page_cached(hash_of(1), PageHash{}, "n", tok.data(), 0);
  tm2->flush();
  EXPECT_EQ(tm2->stats()[0].s.pages_written, 0);
}

TEST(KvTierManager, APageRamLetsGoAgainIsRefreshedNotRewritten) {
  // Write-back: prefix A (pages 0-1) goes down, then prefix B (10-11). A is used again in RAM and
  // evicted again: the disk holds it, so it is refreshed (not rewritten), and a third prefix
  // pushes out B, the least recently used, instead of A.
  const KvLayout L = layout_of(KvDtype::kF16);
  PagePool pool(L, 8, 4);
  for (int32_t p = 0; p < 6; ++p) fill_page(pool, p, 70 + p);
  const auto tok = tokens_for(6 * L.block_size, 5);
  const int32_t bs = L.block_size;
  TierConfig cfg;
  int64_t blob = 0;
  {
    TmpDir probe("tm");
    cfg.disk_dir = probe.path;
    auto tm = make_tiers(cfg, L);
    ASSERT_TRUE(tm);
    tm->set_pool(&pool);
    tm->page_evicted(hash_of(0), PageHash{}, "n", tok.data(), 0);
    tm->flush();
    blob = tm->disk()->bytes();
  }
  ASSERT_GT(blob, 0);
  TmpDir dir("tm");
  cfg.disk_dir = dir.path;
  cfg.disk_bytes = 4 * blob;
  auto tm = make_tiers(cfg, L);
  ASSERT_TRUE(tm);
  tm->set_pool(&pool);
  auto evict = [&](uint64_t h, int32_t k, int32_t page) {  // page k of the prefix starting at h - k
    tm->page_evicted(hash_of(h), k > 0 ? hash_of(h - 1) : PageHash{}, "n", tok.data() + page * bs, page);
    tm->flush();
  };
  evict(0, 0, 0);
  evict(1, 1, 1);
  evict(10, 0, 2);
  evict(11, 1, 3);
  evict(1, 1, 1);  // A again, leaves first as RAM evicts
  evict(0, 0, 0);
  EXPECT_EQ(tm->stats()[0].s.pages_written, 4);
  evict(20, 0, 4);
  evict(21, 1, 5);
  const DiskStore* d = tm->disk();
  EXPECT_EQ(d->n_pages(), 4);
  for (uint64_t h : {0, 1, 20, 21}) EXPECT_TRUE(d->may_contain(hash_of(h))) << h;
  for (uint64_t h : {10, 11}) EXPECT_FALSE(d->may_contain(hash_of(h))) << h;
}

// Hybrid models: a page's blob carries its window-group page when one is given; a write with
// it replaces a stored blob without it, never the other way round; install() fills both pools
// byte for byte and refuses a window page the blob lacks; the window layout joins the tag.
TEST(KvTierManager, HybridBlobsCarryTheWindowPage) {
  TmpDir dir("tm");
  const KvLayout L = layout_of(KvDtype::kF16);
  KvLayout W = layout_of(KvDtype::kInt8);
  W.n_layer = 5;
  EXPECT_NE(TierManager::format_tag(L, &W), TierManager::format_tag(L, nullptr));
  KvLayout W2 = W;
  W2.dtype = KvDtype::kF16;
  EXPECT_NE(TierManager::format_tag(L, &W), TierManager::format_tag(L, &W2));
  TierConfig cfg;
  cfg.disk_dir = dir.path;
  auto r = TierManager::create(cfg, L, false, kFingerprint, &W);
  ASSERT_TRUE(r.is_ok()) << r.message();
  auto tm = std::move(*r);
  PagePool pool(L, 4, 4), wpool(W, 4, 4);
  tm->set_pool(&pool);
  tm->set_window_pool(&wpool);
  fill_page(pool, 0, 1);
  fill_page(pool, 1, 2);
  fill_page(wpool, 2, 3);
  const auto tok = tokens_for(2 * L.block_size, 1);
  const std::string ns = "n";
  tm->page_evicted(hash_of(0), PageHash{}, ns, tok.data(), 0);  // no window page: written without
  tm->page_evicted(hash_of(1), PageHash{}, ns, tok.data() + L.block_size, 1, 2);
  tm->flush();
  EXPECT_EQ(tm->stats()[0].s.pages_written, 2);
  tm->page_evicted(hash_of(1), PageHash{}, ns, tok.data() + L.block_size, 1);  // has it with the window page: no
  tm->flush();
  EXPECT_EQ(tm->stats()[0].s.pages_written, 2);
  std::vector<PageHash> hs = {hash_of(0), hash_of(1)};
  auto got = wait_loaded(*tm, tm->fetch(ns, hs, tok, 0));
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->blobs.size(), 2u);
  EXPECT_FALSE(TierManager::has_window(got->blobs[0]));
  EXPECT_TRUE(TierManager::has_window(got->blobs[1]));
  PagePool pool2(L, 4, 4), wpool2(W, 4, 4);
  EXPECT_FALSE(tm->install(got->blobs[0], pool2, 0, &wpool2, 0));  // a window page it does not have
  EXPECT_TRUE(tm->install(got->blobs[0], pool2, 0));
  expect_same_page(pool, 0, pool2, 0);
  ASSERT_TRUE(tm->install(got->blobs[1], pool2, 1, &wpool2, 3));
  expect_same_page(pool, 1, pool2, 1);
  expect_same_page(wpool, 2, wpool2, 3);
  // The window pool drops the position's window page (write-back): written again, with it.
  fill_page(wpool, 1, 4);
  tm->window_page_evicted(hash_of(0), PageHash{}, ns, tok.data(), 0, 1);
  tm->flush();
  EXPECT_EQ(tm->stats()[0].s.pages_written, 3);
  got = wait_loaded(*tm, tm->fetch(ns, {hash_of(0)}, tok, 0));
  ASSERT_TRUE(got.has_value() && got->blobs.size() == 1u);
  ASSERT_TRUE(tm->install(got->blobs[0], pool2, 2, &wpool2, 0));
  expect_same_page(wpool, 1, wpool2, 0);
  // A blob of another window format is foreign to this manager.
  auto other = TierManager::create(cfg, L, false, kFingerprint, &W2);
  ASSERT_TRUE(other.is_ok());
  got = wait_loaded(**other, (*other)->fetch(ns, {hash_of(0)}, tok, 0));
  ASSERT_TRUE(got.has_value());
  EXPECT_TRUE(got->blobs.empty());
}

TEST(KvTierManager, PendingBudgetDropsWrites) {
  TmpDir dir("tm");
  const KvLayout L = layout_of(KvDtype::kF16);
  TierConfig cfg;
  cfg.disk_dir = dir.path;
  cfg.max_pending_bytes = 1;  // nothing fits
  auto tm = make_tiers(cfg, L);
  ASSERT_TRUE(tm);
  PagePool pool(L, 2, 4);
  tm->set_pool(&pool);
  const auto tok = tokens_for(L.block_size, 1);
  tm->store(hash_of(0), PageHash{}, "n", tok.data(), 0);
  tm->flush();
  auto st = tm->stats();
  EXPECT_EQ(st[0].s.write_drops, 1);
  EXPECT_EQ(tm->disk()->n_pages(), 0);
}

// ---- Redis: processes ---------------------------------------------------------------------

const char* redis_server_path() {
  static const char* p = [] {
    for (const char* c : {"/usr/bin/redis-server", "/usr/local/bin/redis-server"})
      if (::access(c, X_OK) == 0) return c;
    return static_cast<const char*>(nullptr);
  }();
  return p;
}
const char* redis_cli_path() {
  static const char* p = [] {
    for (const char* c : {"/usr/bin/redis-cli", "/usr/local/bin/redis-cli"})
      if (::access(c, X_OK) == 0) return c;
    return static_cast<const char*>(nullptr);
  }();
  return p;
}

bool port_bindable(int port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(fd);
  return ok;
}

// A free loopback port (the kernel's pick); with_bus: port + 10000 free too (cluster bus).
int free_port(bool with_bus = false) {
  static std::set<int> handed_out;
  for (int attempt = 0; attempt < 200; ++attempt) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = 0;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    socklen_t len = sizeof a;
    int port = 0;
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0 && ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) == 0)
      port = ntohs(a.sin_port);
    ::close(fd);
    if (port == 0 || handed_out.count(port)) continue;
    if (with_bus && (port + 10000 > 65535 || handed_out.count(port + 10000) || !port_bindable(port + 10000))) continue;
    handed_out.insert(port);
    if (with_bus) handed_out.insert(port + 10000);
    return port;
  }
  return 0;
}

// fork/exec with stdin from /dev/null and output to log; the child dies with this process.
pid_t spawn(const std::vector<std::string>& args, const std::string& log) {
  std::vector<char*> argv;
  for (const auto& a : args) argv.push_back(const_cast<char*>(a.c_str()));
  argv.push_back(nullptr);
  const pid_t parent = ::getpid();
  const pid_t pid = ::fork();
  if (pid != 0) return pid;
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != parent) ::_exit(127);
  const int in = ::open("/dev/null", O_RDONLY);
  const int out = ::open(log.c_str(), O_WRONLY | O_CREAT | O_APPEND, 0644);
  if (in >= 0) ::dup2(in, 0);
  if (out >= 0) {
    ::dup2(out, 1);
    ::dup2(out, 2);
  }
  ::execv(argv[0], argv.data());
  ::_exit(127);
}

// Runs a command to completion (killed after timeout); its exit status, or -1.
int run_cmd(const std::vector<std::string>& args, const std::string& log, int timeout_ms) {
  const pid_t pid = spawn(args, log);
  if (pid < 0) return -1;
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  int status = 0;
  for (;;) {
    const pid_t r = ::waitpid(pid, &status, WNOHANG);
    if (r == pid) return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
    if (r < 0 || Clock::now() > deadline) {
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &status, 0);
      return -1;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
}

struct ReplyFree {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using ReplyPtr = std::unique_ptr<redisReply, ReplyFree>;

// A plain hiredis client for inspecting a server.
class Client {
 public:
  explicit Client(int port, int timeout_ms = 500) {
    const timeval tv{timeout_ms / 1000, (timeout_ms % 1000) * 1000};
    c_ = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (c_ && !c_->err) redisSetTimeout(c_, tv);
  }
  ~Client() {
    if (c_) redisFree(c_);
  }
  bool ok() const { return c_ && !c_->err; }
  ReplyPtr cmd(const std::vector<std::string>& args) {
    if (!ok()) return nullptr;
    std::vector<const char*> p;
    std::vector<size_t> n;
    for (const auto& a : args) {
      p.push_back(a.data());
      n.push_back(a.size());
    }
    return ReplyPtr(static_cast<redisReply*>(redisCommandArgv(c_, static_cast<int>(args.size()), p.data(), n.data())));
  }
  long long integer(const std::vector<std::string>& args) {
    auto r = cmd(args);
    return r && r->type == REDIS_REPLY_INTEGER ? r->integer : -100;
  }
  std::string str(const std::vector<std::string>& args) {
    auto r = cmd(args);
    return r && (r->type == REDIS_REPLY_STRING || r->type == REDIS_REPLY_STATUS || r->type == REDIS_REPLY_ERROR)
               ? std::string(r->str, r->len)
               : std::string();
  }
  std::vector<std::string> scan_all() {
    std::vector<std::string> keys;
    std::string cursor = "0";
    do {
      auto r = cmd({"SCAN", cursor, "COUNT", "1000"});
      if (!r || r->type != REDIS_REPLY_ARRAY || r->elements != 2) break;
      cursor = std::string(r->element[0]->str, r->element[0]->len);
      for (size_t i = 0; i < r->element[1]->elements; ++i) keys.emplace_back(r->element[1]->element[i]->str, r->element[1]->element[i]->len);
    } while (cursor != "0");
    return keys;
  }

 private:
  redisContext* c_ = nullptr;
};

bool pings(int port) {
  Client c(port, 200);
  return c.ok() && c.str({"PING"}) == "PONG";
}

// One redis-server process.
class RedisServer {
 public:
  RedisServer() = default;
  RedisServer(const RedisServer&) = delete;
  ~RedisServer() { stop(); }
  // Starts (on port, or a free one) and waits until it answers PING.
  bool start(const std::string& dir, int port, const std::vector<std::string>& extra = {}) {
    stop();
    port_ = port;
    dir_ = dir;
    extra_ = extra;
    std::vector<std::string> args = {redis_server_path(), "--port", std::to_string(port), "--bind", "127.0.0.1", "--save", "",
                                     "--appendonly", "no", "--daemonize", "no", "--dir", dir, "--logfile", ""};
    args.insert(args.end(), extra.begin(), extra.end());
    pid_ = spawn(args, dir + "/redis-" + std::to_string(port) + ".log");
    if (pid_ <= 0) return false;
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (Clock::now() < deadline) {
      if (pings(port)) return true;
      int st;
      if (::waitpid(pid_, &st, WNOHANG) == pid_) {  // died (port taken?)
        pid_ = -1;
        return false;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
    stop();
    return false;
  }
  bool restart() {
    const std::string dir = dir_;
    const std::vector<std::string> extra = extra_;
    return start(dir, port_, extra);
  }
  void stop() {
    if (pid_ > 0) {
      ::kill(pid_, SIGKILL);
      int st;
      ::waitpid(pid_, &st, 0);
    }
    pid_ = -1;
  }
  void pause() { ::kill(pid_, SIGSTOP); }
  void resume() { ::kill(pid_, SIGCONT); }
  int port() const { return port_; }
  std::string addr() const { return "redis://127.0.0.1:" + std::to_string(port_); }
  std::string log() const { return read_bytes(dir_ + "/redis-" + std::to_string(port_) + ".log"); }

 private:
  pid_t pid_ = -1;
  int port_ = 0;
  std::string dir_;
  std::vector<std::string> extra_;
};

std::unique_ptr<RedisStore> make_redis(const std::vector<std::string>& addrs, int32_t ttl_s = 0, int32_t timeout_ms = 100,
                                       const PageIdentity& id = kId) {
  auto r = RedisStore::create(addrs, id, ttl_s, timeout_ms);
  EXPECT_TRUE(r.is_ok()) << r.message();
  return r ? std::move(*r) : nullptr;
}

// ---- Redis: standalone --------------------------------------------------------------------

class KvTierRedis : public ::testing::Test {
 protected:
  static void SetUpTestSuite() { ::signal(SIGPIPE, SIG_IGN); }  // as kvserve serve does
  void SetUp() override {
    if (!redis_server_path()) GTEST_SKIP() << "redis-server not installed (apt-get install redis-server)";
    dir_ = std::make_unique<TmpDir>("redis");
    const int port = free_port();
    ASSERT_GT(port, 0);
    ASSERT_TRUE(server_.start(dir_->path, port)) << "redis-server did not start:\n" << server_.log();
  }
  void TearDown() override {
    server_.stop();
    second_.stop();
    dir_.reset();
  }
  // Polls get(i) until it returns a value (at most timeout); the time it took, or -1.
  double wait_get(RedisStore& s, uint64_t i, int timeout_ms) {
    const auto t0 = Clock::now();
    while (Clock::now() - t0 < std::chrono::milliseconds(timeout_ms)) {
      if (get1(s, i).has_value()) return std::chrono::duration<double>(Clock::now() - t0).count();
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return -1;
  }
  std::unique_ptr<TmpDir> dir_;
  RedisServer server_, second_;
};

TEST_F(KvTierRedis, PutGetRoundTrip) {
  auto s = make_redis({server_.addr()});
  ASSERT_TRUE(s);
  EXPECT_STREQ(s->name(), "redis");
  auto [hs, ns, bs] = batch_of(20, [](int i) { return size_t(3000 + i); });
  bs[5] = std::string("\0\r\n$-1\r\n\0", 9) + bs[5];  // binary-safe values
  ASSERT_EQ(s->put(hs, ns, bs), std::vector<bool>(hs.size(), true));
  auto got = s->get(kId.ns_tag, hs);
  ASSERT_EQ(got.size(), hs.size());
  for (size_t i = 0; i < hs.size(); ++i) {
    ASSERT_TRUE(got[i].has_value()) << i;
    EXPECT_EQ(*got[i], bs[i]) << i;
  }
  // Absent keys: nullopt where absent (a gap in the middle is reported as such).
  std::vector<PageHash> mixed = {hash_of(0), hash_of(500), hash_of(2)};
  got = s->get(kId.ns_tag, mixed);
  ASSERT_EQ(got.size(), 3u);
  EXPECT_TRUE(got[0].has_value());
  EXPECT_FALSE(got[1].has_value());
  // Another namespace does not see them.
  EXPECT_FALSE(get1(*s, 0, kId.ns_tag + 1).has_value());
  // remove()
  s->remove(kId.ns_tag, hash_of(3));
  EXPECT_FALSE(get1(*s, 3).has_value());
  EXPECT_TRUE(get1(*s, 4).has_value());
  EXPECT_TRUE(s->may_contain(hash_of(12345)));
  TierStats st;
  s->fill_stats(&st);
  EXPECT_EQ(st.errors, 0);
  // A second store (another kvserve) shares the pages.
  auto s2 = make_redis({"127.0.0.1:" + std::to_string(server_.port())});
  ASSERT_TRUE(s2);
  auto g = get1(*s2, 7);
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(*g, bs[7]);
}

TEST_F(KvTierRedis, RefusedWritesAreNotWritten) {
  // A full Redis (maxmemory, noeviction) answers SET with an OOM error. Such pages were counted
  // as written, with no error and no log line; put() now says which pages it stored.
  ASSERT_TRUE(server_.start(dir_->path, server_.port(), {"--maxmemory", "4mb", "--maxmemory-policy", "noeviction"}));
  auto s = make_redis({server_.addr()}, 0, 1000);
  ASSERT_TRUE(s);
  auto [hs, ns, bs] = batch_of(40, [](int) { return size_t(128 * 1024); });
  const std::vector<bool> ok = s->put(hs, ns, bs);
  const auto n_ok = std::count(ok.begin(), ok.end(), true);
  EXPECT_GT(n_ok, 0);
  EXPECT_LT(n_ok, 40);
  for (int i = 0; i < 40; ++i) EXPECT_EQ(get1(*s, i).has_value(), bool(ok[i])) << i;
  TierStats st;
  s->fill_stats(&st);
  EXPECT_GE(st.errors, 40 - n_ok);
}

TEST_F(KvTierRedis, KeyNamesFingerprintFormatNamespace) {
  auto s = make_redis({server_.addr()});
  ASSERT_TRUE(s);
  const uint64_t ns = namespace_tag("sk-secret-api-key");
  const std::string k = s->key(ns, hash_of(1));
  char expect[128];
  std::snprintf(expect, sizeof expect, "kvs:%016llx:%08x:%016llx:%s", static_cast<unsigned long long>(kId.fingerprint), kId.format_tag,
                static_cast<unsigned long long>(ns), hash_of(1).hex().c_str());
  EXPECT_EQ(k, expect);
  EXPECT_NE(s->key(ns + 1, hash_of(1)), k);
  ASSERT_TRUE(put1(*s, 1, make_blob(1), ns));
  Client c(server_.port());
  ASSERT_TRUE(c.ok());
  auto keys = c.scan_all();
  ASSERT_EQ(keys.size(), 1u);
  EXPECT_EQ(keys[0], k);
  char fp[17], tag[17];
  std::snprintf(fp, sizeof fp, "%016llx", static_cast<unsigned long long>(kId.fingerprint));
  std::snprintf(tag, sizeof tag, "%016llx", static_cast<unsigned long long>(ns));
  EXPECT_NE(keys[0].find(fp), std::string::npos);
  EXPECT_NE(keys[0].find(tag), std::string::npos);
  EXPECT_EQ(keys[0].find("sk-secret"), std::string::npos);  // the raw namespace never reaches Redis
  EXPECT_EQ(c.integer({"TTL", k}), -1);                      // no TTL configured: no expiry
  // Another model's store uses other keys.
  PageIdentity other = kId;
  other.fingerprint ^= 1;
  auto s2 = make_redis({server_.addr()}, 0, 100, other);
  EXPECT_NE(s2->key(ns, hash_of(1)), k);
  EXPECT_FALSE(get1(*s2, 1, ns).has_value());
}

TEST_F(KvTierRedis, TtlIsSet) {
  auto s = make_redis({server_.addr()}, /*ttl_s=*/1);
  ASSERT_TRUE(s);
  ASSERT_TRUE(put1(*s, 1, make_blob(1)));
  Client c(server_.port());
  EXPECT_EQ(c.integer({"TTL", s->key(kId.ns_tag, hash_of(1))}), 1);
  const long long pttl = c.integer({"PTTL", s->key(kId.ns_tag, hash_of(1))});
  EXPECT_GT(pttl, 0);
  EXPECT_LE(pttl, 1000);
  ASSERT_TRUE(get1(*s, 1).has_value());
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));
  EXPECT_FALSE(get1(*s, 1).has_value());
}

// Calls of one command Redis has served (INFO commandstats), 0 before the first.
long long redis_calls(Client& c, const std::string& cmd) {
  const std::string info = c.str({"INFO", "commandstats"});
  const std::string key = "cmdstat_" + cmd + ":calls=";
  const size_t at = info.find(key);
  return at == std::string::npos ? 0 : std::stoll(info.substr(at + key.size()));
}

TEST_F(KvTierRedis, GetFetchesNothingPastTheFirstGap) {
  // A prefix is usable up to its first gap. get() fetched every page it was asked for (a 4k
  // prompt missing its second page moved ~90 MB for nothing); it asks EXISTS first now and GETs
  // only the leading run.
  auto s = make_redis({server_.addr()});
  ASSERT_TRUE(s);
  auto [hs, ns, bs] = batch_of(20, [](int) { return size_t(64 * 1024); });
  ASSERT_EQ(s->put(hs, ns, bs), std::vector<bool>(hs.size(), true));
  Client c(server_.port());
  ASSERT_EQ(c.integer({"DEL", s->key(kId.ns_tag, hash_of(2))}), 1);
  const long long gets0 = redis_calls(c, "get");
  const auto got = s->get(kId.ns_tag, hs);
  ASSERT_EQ(got.size(), hs.size());
  EXPECT_TRUE(got[0] && *got[0] == bs[0]);
  EXPECT_TRUE(got[1] && *got[1] == bs[1]);
  for (size_t i = 2; i < hs.size(); ++i) EXPECT_FALSE(got[i].has_value()) << i;
  EXPECT_EQ(redis_calls(c, "get") - gets0, 2);  // pages 0 and 1, not the 17 after the gap
  // The first page missing: no GET at all.
  ASSERT_EQ(c.integer({"DEL", s->key(kId.ns_tag, hash_of(0))}), 1);
  const auto none = s->get(kId.ns_tag, hs);
  for (const auto& g : none) EXPECT_FALSE(g.has_value());
  EXPECT_EQ(redis_calls(c, "get") - gets0, 2);
}

TEST_F(KvTierRedis, PutMissingStoresWhatRedisLostAndRefreshesTheRest) {
  auto s = make_redis({server_.addr()}, /*ttl_s=*/60);
  ASSERT_TRUE(s);
  auto [hs, ns, bs] = batch_of(6, [](int i) { return size_t(2000 + i); });
  ASSERT_EQ(s->put(hs, ns, bs), std::vector<bool>(hs.size(), true));
  Client c(server_.port());
  for (int i : {1, 4}) ASSERT_EQ(c.integer({"DEL", s->key(kId.ns_tag, hash_of(i))}), 1);  // evicted
  const std::string k0 = s->key(kId.ns_tag, hash_of(0));
  ASSERT_EQ(c.integer({"EXPIRE", k0, "5"}), 1);  // nearly expired
  const long long sets0 = redis_calls(c, "set");
  using R = PageStore::PutResult;
  const auto res = s->put_missing(hs, ns, bs);
  EXPECT_EQ(res, (std::vector<R>{R::kHeld, R::kStored, R::kHeld, R::kHeld, R::kStored, R::kHeld}));
  EXPECT_EQ(redis_calls(c, "set") - sets0, 2);  // held pages are not sent again
  for (int i = 0; i < 6; ++i) EXPECT_EQ(get1(*s, i), bs[i]) << i;
  EXPECT_GT(c.integer({"TTL", k0}), 50);  // its expiry started again
  // Redis down: every page fails, none is reported held.
  server_.stop();
  EXPECT_EQ(s->put_missing(hs, ns, bs), std::vector<R>(6, R::kFailed));
}

// A page this process wrote or loaded is not proof Redis holds it: Redis evicts, restarts
// empty, or was down when the write came. Such a page leaving RAM again was only "refreshed" on
// the disk and never reached Redis again; now Redis is asked, and it is stored where it is gone.
TEST_F(KvTierRedis, APageRedisLostIsWrittenAgainWhenRamLetsItGo) {
  const KvLayout L = layout_of(KvDtype::kInt8);
  const int32_t bs = L.block_size;
  PagePool pool(L, 4, 4);
  for (int32_t p = 0; p < 3; ++p) fill_page(pool, p, 500 + p);
  const auto tokens = tokens_for(3 * bs, 9);
  for (const bool through : {false, true}) {
    Client c(server_.port());
    ASSERT_EQ(c.str({"FLUSHALL"}), "OK");
    TierConfig cfg;
    cfg.redis = {server_.addr()};
    cfg.write_through = through;
    auto tm = make_tiers(cfg, L);
    ASSERT_TRUE(tm);
    tm->set_pool(&pool);
    auto down = [&] {  // the prefix goes down: cached (write-through) or evicted (write-back)
      for (int32_t p = 0; p < 3; ++p) {
        const PageHash parent = p > 0 ? hash_of(p - 1) : PageHash{};
        if (through) tm->page_cached(hash_of(p), parent, "n", tokens.data() + p * bs, p);
        tm->page_evicted(hash_of(p), parent, "n", tokens.data() + p * bs, p);
      }
      tm->flush();
    };
    down();
    EXPECT_EQ(c.integer({"DBSIZE"}), 3) << through;
    EXPECT_EQ(tm->stats()[0].s.pages_written, 3) << through;
    ASSERT_EQ(c.str({"FLUSHALL"}), "OK");  // Redis restarted empty (or evicted them all)
    for (int32_t p = 2; p >= 0; --p)  // used again in RAM, then let go again
      tm->page_evicted(hash_of(p), p > 0 ? hash_of(p - 1) : PageHash{}, "n", tokens.data() + p * bs, p);
    tm->flush();
    EXPECT_EQ(c.integer({"DBSIZE"}), 3) << through;
    EXPECT_EQ(tm->stats()[0].s.pages_written, 6) << through;
    // Let go once more while Redis holds them: refreshed there, not sent.
    for (int32_t p = 2; p >= 0; --p)
      tm->page_evicted(hash_of(p), p > 0 ? hash_of(p - 1) : PageHash{}, "n", tokens.data() + p * bs, p);
    tm->flush();
    EXPECT_EQ(tm->stats()[0].s.pages_written, 6) << through;
    // (write-through: the first eviction right after the write found them held too)
    EXPECT_EQ(tm->stats()[0].s.pages_refreshed, through ? 6 : 3) << through;

    // While RAM keeps them (a finished request's path): a probe, nothing copied or sent. Held,
    // they are refreshed; lost, they are forgotten as written, and RAM letting them go stores them.
    auto keep = [&] {
      for (int32_t p = 0; p < 3; ++p)
        tm->store(hash_of(p), p > 0 ? hash_of(p - 1) : PageHash{}, "n", tokens.data() + p * bs, p, -1, 0, /*ram_keeps=*/true);
      tm->flush();
    };
    keep();
    EXPECT_EQ(tm->stats()[0].s.pages_refreshed, through ? 9 : 6) << through;
    EXPECT_EQ(tm->stats()[0].s.pages_written, 6) << through;
    ASSERT_EQ(c.str({"FLUSHALL"}), "OK");
    keep();
    EXPECT_EQ(c.integer({"DBSIZE"}), 0) << through;  // a probe sends no page
    EXPECT_EQ(tm->stats()[0].s.pages_written, 6) << through;
    for (int32_t p = 2; p >= 0; --p)
      tm->page_evicted(hash_of(p), p > 0 ? hash_of(p - 1) : PageHash{}, "n", tokens.data() + p * bs, p);
    tm->flush();
    EXPECT_EQ(c.integer({"DBSIZE"}), 3) << through;
    EXPECT_EQ(tm->stats()[0].s.pages_written, 9) << through;
    EXPECT_EQ(tm->stats()[0].s.pages_refreshed, through ? 9 : 6) << through;
  }
}

TEST_F(KvTierRedis, DownIsAMissThenRecovers) {
  auto s = make_redis({server_.addr()}, 0, 100);
  ASSERT_TRUE(s);
  const std::string b = make_blob(1);
  ASSERT_TRUE(put1(*s, 1, b));
  ASSERT_TRUE(get1(*s, 1).has_value());
  TierStats st0;
  s->fill_stats(&st0);
  EXPECT_EQ(st0.errors, 0);

  server_.stop();
  auto t0 = Clock::now();
  EXPECT_FALSE(get1(*s, 1).has_value());
  EXPECT_FALSE(get1(*s, 1).has_value());  // backing off: skipped at once
  EXPECT_FALSE(put1(*s, 2, make_blob(2)));
  const double down_s = std::chrono::duration<double>(Clock::now() - t0).count();
  EXPECT_LT(down_s, 0.5);
  TierStats st1;
  s->fill_stats(&st1);
  EXPECT_GE(st1.errors, 1);

  ASSERT_TRUE(server_.restart()) << server_.log();
  ASSERT_TRUE(put1(*make_redis({server_.addr()}), 1, b));  // the new server is empty (no persistence)
  const double took = wait_get(*s, 1, 10000);
  ASSERT_GE(took, 0) << "no recovery after the backoff";
  EXPECT_LT(took, 8.5);
  auto g = get1(*s, 1);
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(*g, b);
}

// A Redis restarted between two batches closed the store's idle connection: the next batch
// read EOF, was lost (a write dropped, a lookup missed), counted as an error, and the node
// backed off for 0.5 s although it was up. The batch is sent again on a new connection now.
TEST_F(KvTierRedis, ABatchAfterARestartIsSentOnANewConnection) {
  auto s = make_redis({server_.addr()}, 0, 1000);
  ASSERT_TRUE(s);
  for (int round = 0; round < 2; ++round) {
    ASSERT_TRUE(put1(*s, 1, make_blob(1))) << round;  // the connection has answered
    ASSERT_TRUE(server_.restart()) << server_.log();  // empty, and the connection is closed
    if (round == 0) {
      EXPECT_TRUE(put1(*s, 2, make_blob(2)));  // a write
      EXPECT_TRUE(get1(*s, 2).has_value());
    } else {
      EXPECT_FALSE(get1(*s, 1).has_value());  // a lookup: a clean miss (the new Redis is empty)
      EXPECT_TRUE(put1(*s, 3, make_blob(3)));   // and no backoff after it
    }
  }
  TierStats st;
  s->fill_stats(&st);
  EXPECT_EQ(st.errors, 0);
}

TEST_F(KvTierRedis, DownAtStartThenUp) {
  const int port = free_port();
  auto s = make_redis({"redis://127.0.0.1:" + std::to_string(port) + "/"}, 0, 100);
  ASSERT_TRUE(s);
  const auto t0 = Clock::now();
  EXPECT_FALSE(get1(*s, 1).has_value());
  EXPECT_FALSE(put1(*s, 1, make_blob(1)));
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - t0).count(), 0.5);
  TierStats st;
  s->fill_stats(&st);
  EXPECT_GE(st.errors, 1);
  ASSERT_TRUE(second_.start(dir_->path, port));
  ASSERT_TRUE(put1(*make_redis({second_.addr()}), 1, make_blob(1)));
  EXPECT_GE(wait_get(*s, 1, 10000), 0);
}

TEST_F(KvTierRedis, HungServerTimesOut) {
  auto s = make_redis({server_.addr()}, 0, 100);
  ASSERT_TRUE(s);
  ASSERT_TRUE(put1(*s, 1, make_blob(1)));
  server_.pause();  // accepts connections (the kernel does), answers nothing
  const auto t0 = Clock::now();
  EXPECT_FALSE(get1(*s, 1).has_value());
  const double took = std::chrono::duration<double>(Clock::now() - t0).count();
  server_.resume();
  EXPECT_LT(took, 0.6);
  EXPECT_GE(took, 0.08);  // it did wait for the timeout
  TierStats st;
  s->fill_stats(&st);
  EXPECT_GE(st.errors, 1);
  EXPECT_GE(wait_get(*s, 1, 10000), 0);
}

// A node that came back and failed again waits the short backoff again, not a longer one.
TEST_F(KvTierRedis, BackoffResetsAfterRecovery) {
  auto s = make_redis({server_.addr()}, 0, 100);
  ASSERT_TRUE(s);
  double last = 0;
  for (int round = 0; round < 3; ++round) {
    ASSERT_TRUE(put1(*make_redis({server_.addr()}), 1, make_blob(1)));
    ASSERT_GE(wait_get(*s, 1, 10000), 0) << "round " << round;
    server_.stop();
    EXPECT_FALSE(get1(*s, 1).has_value());  // fails: backoff starts
    ASSERT_TRUE(server_.restart());
    ASSERT_TRUE(put1(*make_redis({server_.addr()}), 1, make_blob(1)));
    last = wait_get(*s, 1, 10000);
    ASSERT_GE(last, 0) << "round " << round;
  }
  EXPECT_LT(last, 1.2) << "the third outage waited " << last << " s: backoff kept growing across recoveries";
}

TEST_F(KvTierRedis, SpreadsOverStandaloneServers) {
  ASSERT_TRUE(second_.start(dir_->path, free_port()));
  auto s = make_redis({server_.addr(), second_.addr()});
  ASSERT_TRUE(s);
  auto [hs, ns, bs] = batch_of(32, [](int) { return size_t(200); });
  ASSERT_EQ(s->put(hs, ns, bs), std::vector<bool>(hs.size(), true));
  auto got = s->get(kId.ns_tag, hs);
  for (int i = 0; i < 32; ++i) {
    ASSERT_TRUE(got[i].has_value()) << i;
    EXPECT_EQ(*got[i], bs[i]);
  }
  Client a(server_.port()), b(second_.port());
  const long long na = a.integer({"DBSIZE"}), nb = b.integer({"DBSIZE"});
  EXPECT_GT(na, 0);
  EXPECT_GT(nb, 0);
  EXPECT_EQ(na + nb, 32);
  // One of them down: its pages miss, the other's still hit, up to the prefix's first gap (the
  // first page the stopped server held); each page the up server holds still hits on its own.
  second_.stop();
  got = s->get(kId.ns_tag, hs);
  int lead = 0, on_a = 0;
  while (lead < 32 && a.integer({"EXISTS", s->key(kId.ns_tag, hash_of(lead))}) == 1) ++lead;
  for (int i = 0; i < 32; ++i) {
    EXPECT_EQ(got[i].has_value(), i < lead) << i;
    if (a.integer({"EXISTS", s->key(kId.ns_tag, hash_of(i))}) == 1) {
      ++on_a;
      EXPECT_TRUE(get1(*s, i).has_value()) << i;
    }
  }
  EXPECT_EQ(on_a, na);
}

TEST_F(KvTierRedis, BadAddressesRejected) {
  EXPECT_FALSE(RedisStore::create({}, kId, 0, 100).is_ok());
  EXPECT_FALSE(RedisStore::create({"redis://host:abc"}, kId, 0, 100).is_ok());
  EXPECT_FALSE(RedisStore::create({"host:0"}, kId, 0, 100).is_ok());
  EXPECT_FALSE(RedisStore::create({"host:70000"}, kId, 0, 100).is_ok());
  EXPECT_FALSE(RedisStore::create({"redis://:6379"}, kId, 0, 100).is_ok());
  EXPECT_TRUE(RedisStore::create({"redis://localhost"}, kId, 0, 100).is_ok());
  EXPECT_TRUE(RedisStore::create({"localhost:6379"}, kId, 0, 100).is_ok());
  // A bare word was a host on port 6379 (`--kv-redis notaurl` started; every lookup then failed).
  EXPECT_FALSE(RedisStore::create({"notaurl"}, kId, 0, 100).is_ok());
  EXPECT_FALSE(RedisStore::create({"redis://not a host:6379"}, kId, 0, 100).is_ok());
  EXPECT_FALSE(RedisStore::create({"host:+6379"}, kId, 0, 100).is_ok());
  // Credentials: refused (no AUTH is sent), and the password is not repeated in the message.
  auto cred = RedisStore::create({"redis://:s3cret@127.0.0.1:6391"}, kId, 0, 100);
  ASSERT_FALSE(cred.is_ok());
  EXPECT_NE(cred.message().find("credentials"), std::string::npos) << cred.message();
  EXPECT_EQ(cred.message().find("s3cret"), std::string::npos) << cred.message();
}

// The tier manager over Redis: pages written by one instance load in another, are promoted to
// its disk, and a corrupt value is deleted from Redis.
TEST_F(KvTierRedis, TierManagerL3AndPromotion) {
  const KvLayout L = layout_of(KvDtype::kInt8);
  const int32_t bs = L.block_size;
  PagePool pool(L, 4, 4), pool2(L, 4, 4);
  for (int32_t p = 0; p < 3; ++p) fill_page(pool, p, 300 + p);
  const auto tokens = tokens_for(3 * bs, 5);
  const std::string ns = "tenant";
  {
    TierConfig cfg;
    cfg.redis = {server_.addr()};
    auto a = make_tiers(cfg, L);
    ASSERT_TRUE(a);
    a->set_pool(&pool);
    for (int32_t p = 0; p < 3; ++p) a->page_evicted(hash_of(p), PageHash{}, ns, tokens.data() + p * bs, p);
    a->flush();
    auto st = a->stats();
    ASSERT_EQ(st.size(), 1u);
    EXPECT_EQ(st[0].s.tier, "redis");
    EXPECT_EQ(st[0].s.pages_written, 3);
  }
  Client c(server_.port());
  EXPECT_EQ(c.integer({"DBSIZE"}), 3);
  TmpDir dir("tm");
  TierConfig cfg;
  cfg.disk_dir = dir.path;
  cfg.redis = {server_.addr()};
  auto b = make_tiers(cfg, L);
  ASSERT_TRUE(b);
  b->set_pool(&pool2);
  auto got = wait_loaded(*b, b->fetch(ns, {hash_of(0), hash_of(1), hash_of(2)}, tokens, 0));
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->blobs.size(), 3u);
  for (int32_t p = 0; p < 3; ++p) {
    ASSERT_TRUE(b->install(got->blobs[p], pool2, p));
    expect_same_page(pool, p, pool2, p);
  }
  b->flush();
  EXPECT_EQ(b->disk()->n_pages(), 3);  // promoted into L2
  auto st = b->stats();
  ASSERT_EQ(st.size(), 2u);
  EXPECT_EQ(st[0].s.tier, "disk");
  EXPECT_EQ(st[1].s.tier, "redis");
  EXPECT_EQ(st[1].s.hits, 3);
  EXPECT_EQ(st[0].s.pages_written, 3);
  // Now from L2 alone (Redis down).
  server_.stop();
  auto got2 = wait_loaded(*b, b->fetch(ns, {hash_of(0), hash_of(1), hash_of(2)}, tokens, 0));
  ASSERT_TRUE(got2.has_value());
  EXPECT_EQ(got2->blobs.size(), 3u);
  EXPECT_EQ(b->stats()[0].s.hits, 3);
  ASSERT_TRUE(server_.restart());

  // A corrupt value in Redis: dropped from Redis, counted, not served.
  TierConfig rc;
  rc.redis = {server_.addr()};
  auto r = make_tiers(rc, L);
  ASSERT_TRUE(r);
  r->set_pool(&pool);
  r->store(hash_of(0), PageHash{}, ns, tokens.data(), 0);
  r->flush();
  auto rs = make_redis({server_.addr()}, 0, 100, PageIdentity{kFingerprint, L.format_tag(), bs, 0});
  const std::string key = rs->key(namespace_tag(ns), hash_of(0));
  Client c2(server_.port());
  ASSERT_EQ(c2.integer({"EXISTS", key}), 1);
  std::string v = c2.str({"GET", key});
  ASSERT_FALSE(v.empty());
  v[v.size() - 1] ^= 1;
  ASSERT_EQ(c2.str({"SET", key, v}), "OK");
  auto got3 = wait_loaded(*r, r->fetch(ns, {hash_of(0)}, tokens, 0));
  ASSERT_TRUE(got3.has_value());
  EXPECT_TRUE(got3->blobs.empty());
  EXPECT_EQ(r->stats()[0].s.corrupt, 1);
  EXPECT_EQ(c2.integer({"EXISTS", key}), 0);
}

// A full Redis keeps the newest keys whatever its policy (bench/redis_eviction_order.py), so a
// prefix written head first kept its tail, which no lookup reaches (a user test: 17 of 102
// pages kept, 1 usable). With --kv-redis-ttl each page's TTL is graded by its depth in the prefix
// (1.5·ttl at the head down to ttl), so a volatile-ttl Redis evicts tails first; a read re-grades
// them the same way.
TEST_F(KvTierRedis, DepthGradedTtlsKeepAPrefixHeadInAFullRedis) {
  ASSERT_TRUE(second_.start(dir_->path, free_port(), {"--maxmemory-policy", "volatile-ttl", "--maxmemory-samples", "10"}))
      << second_.log();
  const KvLayout L = layout_of(KvDtype::kInt8);
  const int32_t bs = L.block_size;
  PagePool pool(L, 4, 4);
  for (int32_t p = 0; p < 4; ++p) fill_page(pool, p, 700 + p);
  constexpr int kPages = 64, kRoom = 16;
  const auto tokens = tokens_for(kPages * bs, 9);
  const std::string ns = "graded";
  TierConfig cfg;
  cfg.redis = {second_.addr()};
  cfg.redis_ttl_s = 3600;
  auto t = make_tiers(cfg, L);
  ASSERT_TRUE(t);
  t->set_pool(&pool);
  auto rs = make_redis({second_.addr()}, 3600, 100, PageIdentity{kFingerprint, L.format_tag(), bs, 0});
  auto key = [&](int p) { return rs->key(namespace_tag(ns), hash_of(p)); };
  Client c(second_.port());
  // Room for kRoom pages beyond what Redis holds now.
  t->page_evicted(hash_of(0), PageHash{}, ns, tokens.data(), 0);
  t->flush();
  const long long blob = c.integer({"STRLEN", key(0)});
  ASSERT_GT(blob, 0);
  const std::string info = c.str({"INFO", "memory"});
  const size_t at = info.find("used_memory:");
  ASSERT_NE(at, std::string::npos);
  const long long used = std::stoll(info.substr(at + 12));
  ASSERT_EQ(c.str({"CONFIG", "SET", "maxmemory", std::to_string(used + kRoom * blob)}), "OK");
  for (int p = 1; p < kPages; ++p) t->page_evicted(hash_of(p), hash_of(p - 1), ns, tokens.data() + p * bs, p % 4);
  t->flush();
  int kept = 0, usable = -1;
  for (int p = 0; p < kPages; ++p) {
    const bool has = c.integer({"EXISTS", key(p)}) == 1;
    kept += has;
    if (!has && usable < 0) usable = p;
  }
  if (usable < 0) usable = kPages;
  ASSERT_EQ(c.str({"CONFIG", "SET", "maxmemory", "0"}), "OK");  // no more evictions from here on
  EXPECT_LT(kept, kPages / 2);  // Redis did evict
  EXPECT_GE(usable, 4) << kept << " kept";  // flat TTLs: 0 (the newest pages stay)
  EXPECT_GE(2 * usable, kept) << usable << " usable";
  // Graded: the head outlives the rest (1.5·ttl at depth 0, ttl at kTtlDepthCap).
  const long long head = c.integer({"PTTL", key(0)}), next = c.integer({"PTTL", key(usable - 1)});
  EXPECT_GT(head, 3600LL * 1000);
  EXPECT_LE(head, 5400LL * 1000);
  EXPECT_GT(head, next);
  EXPECT_EQ(rs->ttl_ms(0), 5400LL * 1000);
  EXPECT_EQ(rs->ttl_ms(RedisStore::kTtlDepthCap), 3600LL * 1000);
  EXPECT_EQ(rs->ttl_ms(-1), 3600LL * 1000);  // unknown depth: the TTL given
  // A lookup re-grades what it reads (PEXPIRE by depth): shorten them, read, compare.
  for (int p = 0; p < usable; ++p) ASSERT_EQ(c.integer({"PEXPIRE", key(p), "60000"}), 1) << p;
  std::vector<PageHash> hs;
  for (int p = 0; p < usable; ++p) hs.push_back(hash_of(p));
  auto got = wait_loaded(*t, t->fetch(ns, hs, tokens, 0));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->blobs.size(), size_t(usable));
  const long long h2 = c.integer({"PTTL", key(0)}), t2 = c.integer({"PTTL", key(usable - 1)});
  EXPECT_GT(h2, 3600LL * 1000);
  EXPECT_GT(t2, 3600LL * 1000);
  EXPECT_GT(h2, t2);
}

// Prompt tails (P/D): store_tail writes to Redis alone (not to the prefill side's disk); a lookup
// whose last page is the tail finds it beside the full pages, removes it from Redis (read once)
// and does not copy it into the decode side's disk, while the full pages are promoted as usual.
TEST_F(KvTierRedis, PromptTailGoesToRedisAloneAndIsReadOnce) {
  const KvLayout L = layout_of(KvDtype::kF16);
  const int32_t bs = L.block_size;
  PagePool pool(L, 4, 4), pool2(L, 4, 4);
  for (int32_t p = 0; p < 3; ++p) fill_page(pool, p, 700 + p);
  auto tokens = tokens_for(3 * bs, 9);
  std::fill(tokens.begin() + 2 * bs + 5, tokens.end(), -1);  // page 2: a tail of 5 tokens
  const std::string ns = "tenant";
  TmpDir d1("tail-prefill"), d2("tail-decode");
  TierConfig cfg;
  cfg.disk_dir = d1.path;
  cfg.redis = {server_.addr()};
  cfg.write_through = true;
  auto pre = make_tiers(cfg, L);
  ASSERT_TRUE(pre);
  pre->set_pool(&pool);
  for (int32_t p = 0; p < 2; ++p) pre->page_cached(hash_of(p), PageHash{}, ns, tokens.data() + p * bs, p);
  const uint64_t before = pre->write_mark();
  ASSERT_TRUE(pre->store_tail(hash_of(2), PageHash{}, ns, tokens.data() + 2 * bs, 2));
  EXPECT_GT(pre->write_mark(), before);  // the prefill side's answer waits for it
  pre->flush();
  EXPECT_EQ(pre->disk()->n_pages(), 2);  // the tail is not on the prefill side's disk
  Client c(server_.port());
  EXPECT_EQ(c.integer({"DBSIZE"}), 3);

  cfg.disk_dir = d2.path;
  cfg.write_through = false;
  auto dec = make_tiers(cfg, L);
  ASSERT_TRUE(dec);
  dec->set_pool(&pool2);
  auto got = wait_loaded(*dec, dec->fetch(ns, {hash_of(0), hash_of(1), hash_of(2)}, tokens, 0, /*last_is_tail=*/true));
  ASSERT_TRUE(got.has_value());
  ASSERT_EQ(got->blobs.size(), 3u);
  for (int32_t p = 0; p < 3; ++p) {
    ASSERT_TRUE(dec->install(got->blobs[p], pool2, p));
    expect_same_page(pool, p, pool2, p);
  }
  dec->flush();
  EXPECT_EQ(dec->disk()->n_pages(), 2);     // full pages promoted, the tail not
  EXPECT_EQ(c.integer({"DBSIZE"}), 2);       // the tail was read once and removed
  // Asked for again (a retry), the tail is a miss; the full pages still hit.
  auto again = wait_loaded(*dec, dec->fetch(ns, {hash_of(0), hash_of(1), hash_of(2)}, tokens, 0, true));
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(again->blobs.size(), 2u);

  // Without a shared store there is nowhere to put a tail. (d1 is pre's until pre ends.)
  pre.reset();
  TierConfig disk_only;
  disk_only.disk_dir = d1.path;
  auto local = make_tiers(disk_only, L);
  ASSERT_TRUE(local);
  local->set_pool(&pool);
  EXPECT_FALSE(local->store_tail(hash_of(2), PageHash{}, ns, tokens.data() + 2 * bs, 2));
}

// Promotions that do not fit the pending budget are dropped (counted), the lookup still hits.
TEST_F(KvTierRedis, TierManagerPromotionOverBudgetIsDropped) {
  const KvLayout L = layout_of(KvDtype::kF16);
  PagePool pool(L, 2, 4);
  fill_page(pool, 0, 1);
  const auto tokens = tokens_for(L.block_size, 2);
  {
    TierConfig cfg;
    cfg.redis = {server_.addr()};
    auto a = make_tiers(cfg, L);
    a->set_pool(&pool);
    a->store(hash_of(0), PageHash{}, "n", tokens.data(), 0);
  }  // the destructor finishes the write
  TmpDir dir("tm");
  TierConfig cfg;
  cfg.disk_dir = dir.path;
  cfg.redis = {server_.addr()};
  cfg.max_pending_bytes = L.page_bytes();  // a payload fits, a blob (header + payload) does not
  auto b = make_tiers(cfg, L);
  b->set_pool(&pool);
  auto got = wait_loaded(*b, b->fetch("n", {hash_of(0)}, tokens, 0));
  ASSERT_TRUE(got.has_value());
  EXPECT_EQ(got->blobs.size(), 1u);
  b->flush();
  EXPECT_EQ(b->disk()->n_pages(), 0);
  EXPECT_EQ(b->stats()[0].s.write_drops, 1);
  // The engine thread can still write other pages.
  fill_page(pool, 1, 9);
  b->store(hash_of(1), PageHash{}, "n", tokens.data(), 1);
  b->flush();
  EXPECT_EQ(b->disk()->n_pages(), 1);
}

// The engine thread keeps writing pages while the loader's promotions are dropped: the two
// threads must not share unsynchronized state (run under -fsanitize=thread to see a race).
TEST_F(KvTierRedis, PromotionDropsWhileEngineStores) {
  const KvLayout L = layout_of(KvDtype::kF16);
  const int32_t bs = L.block_size;
  constexpr int kPages = 8;
  PagePool pool(L, kPages, 4);
  for (int32_t p = 0; p < kPages; ++p) fill_page(pool, p, 70 + p);
  const auto tokens = tokens_for(kPages * bs, 3);
  std::vector<PageHash> hs;
  for (int32_t p = 0; p < kPages; ++p) hs.push_back(hash_of(p));
  {
    TierConfig cfg;
    cfg.redis = {server_.addr()};
    auto a = make_tiers(cfg, L);
    a->set_pool(&pool);
    for (int32_t p = 0; p < kPages; ++p) a->store(hs[p], PageHash{}, "n", tokens.data() + p * bs, p);
  }
  TmpDir dir("tm");
  TierConfig cfg;
  cfg.disk_dir = dir.path;
  cfg.redis = {server_.addr()};
  cfg.max_pending_bytes = L.page_bytes();  // promotions (blobs) never fit
  auto b = make_tiers(cfg, L);
  b->set_pool(&pool);
  int loads = 0;
  uint64_t next = 100000;
  for (int round = 0; round < 20; ++round) {
    const uint64_t t = b->fetch("n", hs, tokens, 0);
    bool done = false;
    const auto deadline = Clock::now() + std::chrono::seconds(5);
    while (!done && Clock::now() < deadline) {
      for (int k = 0; k < 50; ++k) {  // the engine evicting pages meanwhile (grows written_)
        b->store(hash_of(next++), PageHash{}, "n", tokens.data(), 0);
      }
      for (auto& l : b->poll())
        if (l.ticket == t) {
          done = true;
          EXPECT_EQ(l.blobs.size(), size_t(kPages));
          ++loads;
        }
    }
  }
  b->flush();
  EXPECT_EQ(loads, 20);
  EXPECT_GE(b->stats()[0].s.write_drops, 20 * kPages);
}

// ---- Redis Cluster ------------------------------------------------------------------------

TEST(KvTierRedisSlot, KnownValues) {
  EXPECT_EQ(redis_key_slot("foo"), 12182);
  EXPECT_EQ(redis_key_slot("bar"), 5061);
  EXPECT_EQ(redis_key_slot("123456789"), 0x31C3 & 16383);  // the CRC16-XMODEM check value
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("{user1000}.followers"));
  EXPECT_EQ(redis_key_slot("{user1000}.following"), redis_key_slot("user1000"));
  EXPECT_NE(redis_key_slot("foo{}{bar}"), redis_key_slot("bar"));  // an empty first tag: the whole key
  EXPECT_EQ(redis_key_slot("foo{{bar}}zap"), redis_key_slot("{bar"));
  EXPECT_EQ(redis_key_slot("foo{bar}{zap}"), redis_key_slot("bar"));
  EXPECT_EQ(redis_key_slot(""), 0);
}

class KvTierRedisCluster : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    ::signal(SIGPIPE, SIG_IGN);
    if (!redis_server_path() || !redis_cli_path()) {
      setup_error_ = "skip";
      return;
    }
    dir_ = new TmpDir("cluster");
    for (int i = 0; i < 3; ++i) {
      const int p = free_port(true);
      if (p == 0) {
        setup_error_ = "no free port";
        return;
      }
      ports_.push_back(p);
    }
    for (int i = 0; i < 3; ++i) {
      const int p = ports_[i];
      if (!nodes_[i].start(dir_->path, p,
                           {"--cluster-enabled", "yes", "--cluster-config-file", dir_->path + "/nodes-" + std::to_string(p) + ".conf",
                            "--cluster-node-timeout", "2000"})) {
        setup_error_ = "node " + std::to_string(p) + " did not start:\n" + nodes_[i].log();
        return;
      }
    }
    std::vector<std::string> create = {redis_cli_path(), "--cluster", "create"};
    for (int p : ports_) create.push_back("127.0.0.1:" + std::to_string(p));
    for (const char* a : {"--cluster-replicas", "0", "--cluster-yes"}) create.push_back(a);
    const std::string log = dir_->path + "/create.log";
    if (run_cmd(create, log, 20000) != 0) {
      setup_error_ = "redis-cli --cluster create failed:\n" + read_bytes(log);
      return;
    }
    const auto deadline = Clock::now() + std::chrono::seconds(15);
    for (;;) {
      int ok = 0;
      for (int p : ports_) {
        Client c(p);
        if (c.str({"CLUSTER", "INFO"}).find("cluster_state:ok") != std::string::npos) ++ok;
      }
      if (ok == 3) break;
      if (Clock::now() > deadline) {
        setup_error_ = "cluster_state never ok";
        return;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
  }
  static void TearDownTestSuite() {
    for (auto& n : nodes_) n.stop();
    delete dir_;
    dir_ = nullptr;
    ports_.clear();
  }
  void SetUp() override {
    if (setup_error_ == "skip") GTEST_SKIP() << "redis-server / redis-cli not installed";
    ASSERT_TRUE(setup_error_.empty()) << setup_error_;
  }
  // The port of the master of slot s (from CLUSTER SLOTS on node 0).
  static int owner(int slot) {
    Client c(ports_[0]);
    auto r = c.cmd({"CLUSTER", "SLOTS"});
    if (!r || r->type != REDIS_REPLY_ARRAY) return -1;
    for (size_t i = 0; i < r->elements; ++i) {
      const redisReply* e = r->element[i];
      if (slot >= e->element[0]->integer && slot <= e->element[1]->integer) return static_cast<int>(e->element[2]->element[1]->integer);
    }
    return -1;
  }
  static int index_of(int port) {
    for (int i = 0; i < 3; ++i)
      if (ports_[i] == port) return i;
    return -1;
  }

  static inline std::string setup_error_;
  static inline std::vector<int> ports_;
  static inline RedisServer nodes_[3];
  static inline TmpDir* dir_ = nullptr;
};

TEST_F(KvTierRedisCluster, PagesSpreadOverMastersFromOneSeed) {
  auto s = make_redis({"redis://127.0.0.1:" + std::to_string(ports_[0])});
  ASSERT_TRUE(s);
  std::vector<PageHash> hs;
  std::vector<uint64_t> ns;
  std::vector<std::string> bs;
  for (int i = 0; i < 64; ++i) {
    hs.push_back(hash_of(1000 + i));
    ns.push_back(kId.ns_tag);
    bs.push_back(make_blob(1000 + i, 256));
  }
  ASSERT_EQ(s->put(hs, ns, bs), std::vector<bool>(hs.size(), true));
  auto got = s->get(kId.ns_tag, hs);
  ASSERT_EQ(got.size(), 64u);
  for (int i = 0; i < 64; ++i) {
    ASSERT_TRUE(got[i].has_value()) << i;
    EXPECT_EQ(*got[i], bs[i]);
  }
  long long total = 0;
  int nonempty = 0;
  for (int p : ports_) {
    const long long n = Client(p).integer({"DBSIZE"});
    total += n;
    nonempty += n > 0 ? 1 : 0;
  }
  EXPECT_EQ(total, 64);
  EXPECT_GT(nonempty, 1);
  // Each key sits on its slot's master, and our slot function agrees with the server's.
  Client c0(ports_[0]);
  for (int i = 0; i < 64; ++i) {
    const std::string k = s->key(kId.ns_tag, hs[i]);
    EXPECT_EQ(c0.integer({"CLUSTER", "KEYSLOT", k}), redis_key_slot(k)) << k;
    const int port = owner(redis_key_slot(k));
    ASSERT_GT(port, 0);
    EXPECT_EQ(Client(port).integer({"EXISTS", k}), 1) << k;
  }
  for (const char* k : {"foo", "bar", "{user1000}.following", "foo{}{bar}", "foo{{bar}}zap", "a{b}c{d}"})
    EXPECT_EQ(c0.integer({"CLUSTER", "KEYSLOT", k}), redis_key_slot(k)) << k;
  // remove() reaches each key on its own master.
  for (int i = 0; i < 8; ++i) s->remove(kId.ns_tag, hs[i]);
  got = s->get(kId.ns_tag, std::span<const PageHash>(hs.data(), 8));
  for (int i = 0; i < 8; ++i) EXPECT_FALSE(got[i].has_value()) << i;
  TierStats st;
  s->fill_stats(&st);
  EXPECT_EQ(st.errors, 0);
}

// A slot that moves while a store runs: ASK during the migration, MOVED after it.
TEST_F(KvTierRedisCluster, FollowsAskAndMoved) {
  auto s = make_redis({"redis://127.0.0.1:" + std::to_string(ports_[0])});
  ASSERT_TRUE(s);
  ASSERT_TRUE(put1(*s, 5000, make_blob(5000)));  // discovers the slot map
  // A page whose slot is empty (so it can move without migrating keys).
  uint64_t pick = 0;
  int slot = -1;
  for (uint64_t i = 6000; i < 7000 && slot < 0; ++i) {
    const std::string k = s->key(kId.ns_tag, hash_of(i));
    const int sl = redis_key_slot(k);
    const int from = owner(sl);
    if (from > 0 && Client(from).integer({"CLUSTER", "COUNTKEYSINSLOT", std::to_string(sl)}) == 0) {
      pick = i;
      slot = sl;
    }
  }
  ASSERT_GE(slot, 0);
  const int from = owner(slot);
  const int to = ports_[(index_of(from) + 1) % 3];
  Client cf(from), ct(to);
  const std::string id_from = cf.str({"CLUSTER", "MYID"}), id_to = ct.str({"CLUSTER", "MYID"});
  ASSERT_EQ(id_from.size(), 40u);
  const std::string sl = std::to_string(slot);
  ASSERT_EQ(ct.str({"CLUSTER", "SETSLOT", sl, "IMPORTING", id_from}), "OK");
  ASSERT_EQ(cf.str({"CLUSTER", "SETSLOT", sl, "MIGRATING", id_to}), "OK");
  // Migrating: the source answers ASK for a key it lacks; the store follows it to the target.
  const std::string blob = make_blob(pick);
  ASSERT_TRUE(put1(*s, pick, blob));
  EXPECT_EQ(ct.integer({"CLUSTER", "COUNTKEYSINSLOT", sl}), 1) << "the write did not reach the importing node";
  EXPECT_EQ(cf.integer({"CLUSTER", "COUNTKEYSINSLOT", sl}), 0);
  auto g = get1(*s, pick);
  ASSERT_TRUE(g.has_value()) << "ASK not followed";
  EXPECT_EQ(*g, blob);
  // Done: the slot belongs to the target everywhere; the store's map is stale (MOVED).
  ASSERT_EQ(ct.str({"CLUSTER", "SETSLOT", sl, "NODE", id_to}), "OK");
  ASSERT_EQ(cf.str({"CLUSTER", "SETSLOT", sl, "NODE", id_to}), "OK");
  for (int p : ports_) {
    if (p != from && p != to) {
      ASSERT_EQ(Client(p).str({"CLUSTER", "SETSLOT", sl, "NODE", id_to}), "OK");
    }
  }
  g = get1(*s, pick);
  ASSERT_TRUE(g.has_value()) << "MOVED not followed";
  EXPECT_EQ(*g, blob);
  g = get1(*s, pick);  // and again, with the refreshed map
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(*g, blob);
  auto r = ct.cmd({"CLUSTER", "COUNTKEYSINSLOT", sl});
  ASSERT_TRUE(r);
  EXPECT_EQ(r->integer, 1);
}

}  // namespace
