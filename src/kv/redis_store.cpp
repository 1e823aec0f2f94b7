#include "kv/redis_store.h"

#include <hiredis/hiredis.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>

namespace kv {

namespace {
using SteadyClock = std::chrono::steady_clock;
constexpr int kBackoffMinMs = 500;
constexpr int kBackoffMaxMs = 8000;

struct ReplyDeleter {
  void operator()(redisReply* r) const {
    if (r) freeReplyObject(r);
  }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

constexpr const char* kWantAddress = "want redis://HOST[:PORT] (port 6379 by default) or HOST:PORT";

// An address: redis://HOST[:PORT][/] or HOST:PORT; from_user: an address given to us, whose host
// must be a host name or an IPv4 address (a bare word like "notaurl" was taken as a host on
// port 6379 and failed only at the first lookup, as "Redis down"); else Redis's own (a MOVED
// reply's HOST:PORT). Messages name the address, not the flag.
Result<RedisStore::Endpoint> parse_addr(const std::string& a, bool from_user) {
  using R = Result<RedisStore::Endpoint>;
  std::string shown;  // printable on one line
  for (unsigned char c : a) shown += c >= 0x20 && c < 0x7f ? static_cast<char>(c) : '?';
  std::string s = a;
  const bool scheme = s.rfind("redis://", 0) == 0;
  if (scheme) s = s.substr(8);
  if (const size_t other = s.find("://"); other != std::string::npos)  // http://, rediss:// (TLS), ...
    return R::error(shown + ": " + shown.substr(0, other) + ":// is not a plain Redis address; " + kWantAddress);
  if (s.find('@') != std::string::npos)  // the message leaves the password out of the log
    return R::error("redis://…@" + shown.substr(shown.rfind('@') + 1) +
                    ": credentials in the address are not supported (no AUTH is sent); use a Redis "
                    "without requirepass, reachable only by the servers");
  while (!s.empty() && s.back() == '/') s.pop_back();
  if (const size_t db = s.find_first_of("/?"); db != std::string::npos)  // redis://host:port/3, ?db=2: it said bad port
    return R::error(shown + ": a database number is not supported (pages go to database 0); " + kWantAddress);
  const size_t colon = s.rfind(':');
  RedisStore::Endpoint e;
  e.host = colon == std::string::npos ? s : s.substr(0, colon);
  e.port = 6379;
  if (colon != std::string::npos) {
    try {
      size_t used = 0;
      e.port = std::stoi(s.substr(colon + 1), &used);
      if (used != s.size() - colon - 1 || !std::isdigit(static_cast<unsigned char>(s[colon + 1]))) throw std::invalid_argument("port");
    } catch (...) {
      return R::error(shown + ": bad port; " + kWantAddress);
    }
  }
  if (e.host.empty() || e.port <= 0 || e.port > 65535) return R::error(shown + ": " + kWantAddress);
  if (from_user) {
    if (!scheme && colon == std::string::npos) return R::error("'" + shown + "' is not a Redis address; " + kWantAddress);
    for (char c : e.host)
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '-' && c != '_')
        return R::error("'" + shown + "': the host must be a host name or an IPv4 address; " + kWantAddress);
  }
  return e;
}

timeval to_tv(int ms) { return timeval{ms / 1000, (ms % 1000) * 1000}; }
}  // namespace

Result<RedisStore::Endpoint> RedisStore::parse_address(const std::string& address) { return parse_addr(address, /*from_user=*/true); }

uint16_t redis_key_slot(std::string_view key) {
  // Redis Cluster: only the part inside the first {...} is hashed, when non-empty.
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  uint16_t crc = 0;  // CRC16-XMODEM (poly 0x1021, init 0), as the cluster spec defines it
  for (unsigned char c : key) {
    crc ^= static_cast<uint16_t>(c) << 8;
    for (int b = 0; b < 8; ++b) crc = (crc & 0x8000) ? static_cast<uint16_t>((crc << 1) ^ 0x1021) : static_cast<uint16_t>(crc << 1);
  }
  return crc & 16383;
}

struct RedisStore::Conn {
  redisContext* ctx = nullptr;
  Endpoint at;
  bool answered = false;  // this connection has had a reply (so it was good once)
  SteadyClock::time_point retry_at{};
  int backoff_ms = 0;
  ~Conn() {
    if (ctx) redisFree(ctx);
  }
};

struct RedisStore::ThreadConns {
  std::map<Endpoint, Conn> by_node;
};

Result<std::unique_ptr<RedisStore>> RedisStore::create(const std::vector<std::string>& addrs, const PageIdentity& id, int32_t ttl_s,
                                                       int32_t timeout_ms) {
  std::vector<Endpoint> seeds;
  for (const auto& a : addrs) {
    auto e = parse_address(a);
    if (!e) return Result<std::unique_ptr<RedisStore>>::error("--kv-redis " + e.message());
    seeds.push_back(*e);
  }
  if (seeds.empty()) return Result<std::unique_ptr<RedisStore>>::error("--kv-redis: no address");
  // hiredis 0.14 writes with write(): a connection Redis closed would raise SIGPIPE and kill the
  // process. Ignored process-wide (the server does so anyway); failures come back as EPIPE.
  std::signal(SIGPIPE, SIG_IGN);
  return std::unique_ptr<RedisStore>(new RedisStore(std::move(seeds), id, ttl_s, timeout_ms));
}

RedisStore::RedisStore(std::vector<Endpoint> seeds, const PageIdentity& id, int32_t ttl_s, int32_t timeout_ms)
    : seeds_(std::move(seeds)), id_(id), ttl_s_(ttl_s), timeout_ms_(timeout_ms) {}

RedisStore::~RedisStore() = default;

std::string RedisStore::key(uint64_t ns_tag, const PageHash& h) const {
  char buf[128];
  std::snprintf(buf, sizeof buf, "kvs:%016llx:%08x:%016llx:", static_cast<unsigned long long>(id_.fingerprint), id_.format_tag,
                static_cast<unsigned long long>(ns_tag));
  return buf + h.hex();
}

RedisStore::ThreadConns& RedisStore::conns() {
  std::lock_guard<std::mutex> l(mu_);
  auto& p = threads_[std::this_thread::get_id()];
  if (!p) p = std::make_unique<ThreadConns>();
  return *p;
}

RedisStore::Conn* RedisStore::conn(ThreadConns& tc, const Endpoint& e) {
  Conn& c = tc.by_node[e];
  if (c.ctx) return &c;
  if (SteadyClock::now() < c.retry_at) return nullptr;  // backing off
  c.answered = false;
  c.at = e;
  c.ctx = redisConnectWithTimeout(e.host.c_str(), e.port, to_tv(timeout_ms_));
  if (!c.ctx || c.ctx->err) {
    fail(tc, e);
    return nullptr;
  }
  redisSetTimeout(c.ctx, to_tv(timeout_ms_));
  // hiredis frees its read buffer whenever it is empty and over 16 KiB, i.e. after every page
  // (a page is ~100 KB to 2 MB), and grows it again by doubling for the next: keep it. One page
  // of memory per connection; a 256-page GET batch took 53-81 ms of user CPU, now 8-35 ms.
  c.ctx->reader->maxbuf = 0;
  return &c;
}

// The node answers: its next failure starts the backoff afresh. An outage that was told (fail)
// is told over too.
void RedisStore::answers(Conn& c) {
  if (c.backoff_ms != 0) {
    std::lock_guard<std::mutex> l(mu_);
    if (std::exchange(told_down_[c.at], false)) std::fprintf(stderr, "kv tier: redis %s:%d answers again\n", c.at.host.c_str(), c.at.port);
  }
  c.backoff_ms = 0;
}

void RedisStore::fail(ThreadConns& tc, const Endpoint& e) {
  Conn& c = tc.by_node[e];
  // The first failure after the node last answered is told (the counter alone says nothing of
  // why): a timeout, a refused connection, a reset. Later ones in the same outage stay quiet.
  // Each thread has its own connection: the outage is told by the first that meets it.
  bool tell = false;
  if (c.backoff_ms == 0) {
    std::lock_guard<std::mutex> l(mu_);
    tell = !std::exchange(told_down_[e], true);
  }
  if (tell)
    std::fprintf(stderr, "kv tier: redis %s:%d failed (%s, timeout %d ms): its pages miss and writes drop for %d ms, "
                 "then longer while it keeps failing (up to %d ms)\n",
                 e.host.c_str(), e.port, c.ctx && c.ctx->err ? c.ctx->errstr : "no connection", timeout_ms_, kBackoffMinMs,
                 kBackoffMaxMs);
  if (c.ctx) redisFree(c.ctx);
  c.ctx = nullptr;
  c.backoff_ms = c.backoff_ms == 0 ? kBackoffMinMs : std::min(kBackoffMaxMs, c.backoff_ms * 2);
  c.retry_at = SteadyClock::now() + std::chrono::milliseconds(c.backoff_ms);
  std::lock_guard<std::mutex> l(mu_);
  ++errors_;
}

void RedisStore::reply_error(const std::string& err) {
  const std::string kind = err.substr(0, err.find(' '));
  std::lock_guard<std::mutex> l(mu_);
  ++errors_;
  if (errors_told_.insert(kind).second)
    std::fprintf(stderr, "kv tier: redis answered an error: %s (pages it refuses are not stored or read; told once per kind)\n",
                 err.c_str());
}

void RedisStore::discover(ThreadConns& tc) {
  {
    std::lock_guard<std::mutex> l(mu_);
    if (discovered_) return;
  }
  for (const Endpoint& e : seeds_) {
    Conn* c = conn(tc, e);
    if (!c) continue;
    Reply r(static_cast<redisReply*>(redisCommand(c->ctx, "CLUSTER SLOTS")));
    if (!r) {
      fail(tc, e);
      continue;
    }
    answers(*c);
    std::vector<std::pair<std::pair<int, int>, Endpoint>> slots;
    const bool cluster = r->type == REDIS_REPLY_ARRAY && r->elements > 0;
    if (cluster)
      for (size_t i = 0; i < r->elements; ++i) {
        const redisReply* s = r->element[i];
        if (s->type != REDIS_REPLY_ARRAY || s->elements < 3 || s->element[2]->type != REDIS_REPLY_ARRAY ||
            s->element[2]->elements < 2)
          continue;
        Endpoint m;
        m.host = s->element[2]->element[0]->str ? s->element[2]->element[0]->str : "";
        if (m.host.empty()) m.host = e.host;  // a node may report an empty IP: the one we reached
        m.port = static_cast<int>(s->element[2]->element[1]->integer);
        slots.push_back({{static_cast<int>(s->element[0]->integer), static_cast<int>(s->element[1]->integer)}, m});
      }
    std::lock_guard<std::mutex> l(mu_);
    discovered_ = true;
    cluster_ = cluster && !slots.empty();
    slots_ = std::move(slots);
    return;
  }
}

RedisStore::Endpoint RedisStore::node_for(const std::string& key) const {
  std::lock_guard<std::mutex> l(mu_);
  if (cluster_) {
    const int slot = redis_key_slot(key);
    for (const auto& [range, ep] : slots_)
      if (slot >= range.first && slot <= range.second) return ep;
    return seeds_[0];
  }
  // Standalone servers: spread keys by their chain hash (the key's last 32 hex digits).
  const uint64_t h = std::stoull(key.substr(key.size() - 16), nullptr, 16);
  return seeds_[h % seeds_.size()];
}

std::vector<std::optional<std::string>> RedisStore::run(const std::vector<std::string>& keys,
                                                        const std::vector<std::vector<std::string>>& argvs, bool want_value) {
  ThreadConns& tc = conns();
  discover(tc);
  std::vector<std::optional<std::string>> out(keys.size());
  std::map<Endpoint, std::vector<size_t>> by_node;
  for (size_t i = 0; i < keys.size(); ++i) by_node[node_for(keys[i])].push_back(i);
  struct Redirect {
    size_t i;
    Endpoint to;
    bool ask;
  };
  std::vector<Redirect> redirects;
  auto send = [&](Conn* c, const std::vector<std::string>& argv, bool asking) {
    if (asking) redisAppendCommand(c->ctx, "ASKING");
    std::vector<const char*> p;
    std::vector<size_t> n;
    for (const auto& a : argv) {
      p.push_back(a.data());
      n.push_back(a.size());
    }
    redisAppendCommandArgv(c->ctx, static_cast<int>(argv.size()), p.data(), n.data());
  };
  // Reads one reply; false on a connection failure.
  auto read = [&](Conn* c, size_t i, bool collect_redirect) -> bool {
    void* raw = nullptr;
    if (redisGetReply(c->ctx, &raw) != REDIS_OK) return false;
    answers(*c);
    c->answered = true;
    Reply r(static_cast<redisReply*>(raw));
    if (r->type == REDIS_REPLY_STRING && want_value) {
      out[i] = std::string(r->str, r->len);
    } else if (r->type == REDIS_REPLY_STATUS) {
      if (!want_value) out[i] = std::string();
    } else if (r->type == REDIS_REPLY_INTEGER) {
      if (!want_value) out[i] = std::to_string(r->integer);
    } else if (r->type == REDIS_REPLY_ERROR) {
      const std::string err(r->str, r->len);  // "MOVED 3999 127.0.0.1:6381" / "ASK ..."
      const bool moved = err.rfind("MOVED ", 0) == 0, ask = err.rfind("ASK ", 0) == 0;
      const size_t sp = err.rfind(' ');
      if (!moved && !ask) {  // OOM, NOAUTH, READONLY, ...: the page is not stored (or not read)
        reply_error(err);
      } else if (collect_redirect && sp != std::string::npos) {
        auto ep = parse_addr(err.substr(sp + 1), /*from_user=*/false);
        if (ep) redirects.push_back({i, *ep, ask});
        if (moved) {
          std::lock_guard<std::mutex> l(mu_);
          discovered_ = false;  // the slot map changed: ask again next time
          ++redirects_;
        }
      }
    }
    return true;
  };
  for (auto& [ep, idx] : by_node) {
    Conn* c = conn(tc, ep);
    if (!c) continue;  // down: misses / dropped writes
    for (int attempt = 0; attempt < 2; ++attempt) {
      const bool was_good = c->answered;
      for (size_t i : idx) send(c, argvs[i], false);
      size_t n_read = 0;
      while (n_read < idx.size() && read(c, idx[n_read], true)) ++n_read;
      if (n_read == idx.size()) break;
      // A connection that worked before and now reads EOF or a reset before its first reply was
      // closed by the other side while idle (Redis restarted, or closed it at its `timeout`):
      // connect once more and resend (every command here may run twice), instead of losing the
      // batch and backing off from a Redis that is up. A timeout is not retried.
      const bool closed_idle = c->ctx->err == REDIS_ERR_EOF ||
                               (c->ctx->err == REDIS_ERR_IO && (errno == ECONNRESET || errno == EPIPE));
      if (attempt == 0 && n_read == 0 && was_good && closed_idle) {
        redisFree(c->ctx);
        c->ctx = nullptr;
        if ((c = conn(tc, ep))) continue;
      } else {
        fail(tc, ep);
      }
      break;
    }
  }
  for (const Redirect& r : redirects) {  // one hop, as the cluster spec asks
    Conn* c = conn(tc, r.to);
    if (!c) continue;
    send(c, argvs[r.i], r.ask);
    if (r.ask) {
      void* raw = nullptr;
      if (redisGetReply(c->ctx, &raw) != REDIS_OK) {
        fail(tc, r.to);
        continue;
      }
      freeReplyObject(raw);
    }
    if (!read(c, r.i, false)) fail(tc, r.to);
  }
  return out;
}

int64_t RedisStore::ttl_ms(int32_t depth) const {
  if (ttl_s_ <= 0) return 0;
  const int64_t full = int64_t(ttl_s_) * 1000;
  const int64_t d = depth < 0 || depth > kTtlDepthCap ? kTtlDepthCap : depth;
  return full + (kTtlDepthCap - d) * full / (2 * kTtlDepthCap);
}

std::vector<bool> RedisStore::put(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags, std::span<const std::string> blobs) {
  return put(hashes, ns_tags, blobs, {});
}

std::vector<bool> RedisStore::put(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags, std::span<const std::string> blobs,
                                  std::span<const int32_t> depths) {
  std::vector<std::string> keys;
  std::vector<std::vector<std::string>> argvs;
  for (size_t i = 0; i < hashes.size(); ++i) {
    keys.push_back(key(ns_tags[i], hashes[i]));
    std::vector<std::string> a = {"SET", keys.back(), blobs[i]};
    if (ttl_s_ > 0) {
      a.push_back("PX");
      a.push_back(std::to_string(ttl_ms(i < depths.size() ? depths[i] : -1)));
    }
    argvs.push_back(std::move(a));
  }
  const auto res = run(keys, argvs, false);
  std::vector<bool> ok(res.size());
  for (size_t i = 0; i < res.size(); ++i) ok[i] = res[i].has_value();
  return ok;
}

std::vector<RedisStore::PutResult> RedisStore::put_missing(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags,
                                                           std::span<const std::string> blobs) {
  return put_missing(hashes, ns_tags, blobs, {});
}

std::vector<RedisStore::PutResult> RedisStore::put_missing(std::span<const PageHash> hashes, std::span<const uint64_t> ns_tags,
                                                           std::span<const std::string> blobs, std::span<const int32_t> depths) {
  std::vector<std::string> keys;
  std::vector<std::vector<std::string>> argvs;
  for (size_t i = 0; i < hashes.size(); ++i) {
    keys.push_back(key(ns_tags[i], hashes[i]));
    argvs.push_back({"EXISTS", keys.back()});
  }
  const auto held = run(keys, argvs, false);
  std::vector<PutResult> out(hashes.size(), PutResult::kFailed);
  std::vector<size_t> idx;  // the second round: SET the missing, refresh the held
  std::vector<std::string> keys2;
  std::vector<std::vector<std::string>> argvs2;
  for (size_t i = 0; i < hashes.size(); ++i) {
    if (!held[i]) continue;  // unreachable: left failed
    if (*held[i] != "1" && blobs[i].empty()) {  // a probe: nothing to store
      out[i] = PutResult::kMissing;
      continue;
    }
    idx.push_back(i);
    keys2.push_back(keys[i]);
    const std::string ttl = std::to_string(ttl_ms(i < depths.size() ? depths[i] : -1));
    if (*held[i] == "1") {
      argvs2.push_back(ttl_s_ > 0 ? std::vector<std::string>{"PEXPIRE", keys[i], ttl} : std::vector<std::string>{"TOUCH", keys[i]});
    } else {
      std::vector<std::string> a = {"SET", keys[i], blobs[i]};
      if (ttl_s_ > 0) {
        a.push_back("PX");
        a.push_back(ttl);
      }
      argvs2.push_back(std::move(a));
    }
  }
  if (idx.empty()) return out;
  const auto res = run(keys2, argvs2, false);
  for (size_t k = 0; k < idx.size(); ++k) {
    const size_t i = idx[k];
    if (!res[k]) continue;
    // EXPIRE / TOUCH answer 0 when the key went between the two rounds: then it was not refreshed
    // (and not stored); counted as failed, the next eviction stores it.
    if (*held[i] == "1") out[i] = *res[k] == "1" ? PutResult::kHeld : PutResult::kFailed;
    else out[i] = PutResult::kStored;
  }
  return out;
}

std::vector<std::optional<std::string>> RedisStore::get(uint64_t ns_tag, std::span<const PageHash> hashes) {
  return get(ns_tag, hashes, -1);
}

std::vector<std::optional<std::string>> RedisStore::get(uint64_t ns_tag, std::span<const PageHash> hashes, int64_t first_depth) {
  std::vector<std::string> keys;
  std::vector<std::vector<std::string>> argvs;
  for (const PageHash& h : hashes) {
    keys.push_back(key(ns_tag, h));
    argvs.push_back({"EXISTS", keys.back()});
  }
  // A prefix is usable up to its first gap: the pages after it are not fetched (a 4k-token
  // prompt missing its second page would otherwise move ~90 MB for nothing).
  const auto exists = run(keys, argvs, false);
  size_t n = 0;
  while (n < keys.size() && exists[n] && *exists[n] == "1") ++n;
  std::vector<std::optional<std::string>> out(hashes.size());
  if (n == 0) return out;
  // With a TTL, each GET is followed by a PEXPIRE in the same pipeline: a page read is in use,
  // its expiry starts again, graded by its depth (the PEXPIRE's integer reply reads as nullopt here).
  const size_t per = ttl_s_ > 0 ? 2 : 1;
  std::vector<std::string> keys2;
  std::vector<std::vector<std::string>> argvs2;
  for (size_t i = 0; i < n; ++i) {
    keys2.push_back(keys[i]);
    argvs2.push_back({"GET", keys[i]});
    if (per == 2) {
      keys2.push_back(keys[i]);
      const int64_t d = first_depth < 0 ? -1 : std::min<int64_t>(first_depth + int64_t(i), kTtlDepthCap);
      argvs2.push_back({"PEXPIRE", keys[i], std::to_string(ttl_ms(static_cast<int32_t>(d)))});
    }
  }
  auto got = run(keys2, argvs2, true);
  for (size_t i = 0; i < n; ++i) out[i] = std::move(got[i * per]);
  return out;
}

void RedisStore::remove(uint64_t ns_tag, const PageHash& h) {
  const std::string k = key(ns_tag, h);
  run({k}, {{"DEL", k}}, false);
}

void RedisStore::fill_stats(TierStats* s) const {
  std::lock_guard<std::mutex> l(mu_);
  s->errors += errors_;
}

}  // namespace kv
