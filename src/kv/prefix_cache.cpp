#include "kv/prefix_cache.h"

#include <xxhash.h>

#include <algorithm>
#include <cassert>
#include <chrono>
#include <cstring>

namespace kv {

namespace {
void put_u32(std::vector<uint8_t>* b, uint32_t v) {
  for (int i = 0; i < 4; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
void put_u64(std::vector<uint8_t>* b, uint64_t v) {
  for (int i = 0; i < 8; ++i) b->push_back(static_cast<uint8_t>(v >> (8 * i)));
}
bool same_page(const int32_t* a, const int32_t* b, int32_t block_size) {
  return std::memcmp(a, b, sizeof(int32_t) * static_cast<size_t>(block_size)) == 0;
}
}  // namespace

std::string PageHash::hex() const {
  static const char* kDigits = "0123456789abcdef";
  std::string s(32, '0');
  for (int i = 0; i < 16; ++i) {
    s[15 - i] = kDigits[(hi >> (4 * i)) & 15];
    s[31 - i] = kDigits[(lo >> (4 * i)) & 15];
  }
  return s;
}

PrefixCache::PrefixCache(PagePool& pool, uint64_t model_fingerprint, int32_t kv_dtype_tag, Clock clock, WindowGroup window)
    : pool_(pool),
      block_size_(pool.layout().block_size),
      model_fingerprint_(model_fingerprint),
      kv_dtype_tag_(kv_dtype_tag),
      clock_(std::move(clock)),
      wpool_(window.pool),
      window_(window.window) {
  assert(block_size_ > 0);
  page_node_.assign(pool.n_pages(), -1);
  if (wpool_) {
    assert(window_ > 0 && wpool_->layout().block_size == block_size_);
    wpage_node_.assign(wpool_->n_pages(), -1);
  }
}

PrefixCache::~PrefixCache() {
  assert(stats_.pinned_pages == 0 && "PrefixCache destroyed while requests pin it");
  for (int32_t p = 0; p < static_cast<int32_t>(page_node_.size()); ++p)
    if (page_node_[p] >= 0) pool_.release(p);
  for (int32_t p = 0; p < static_cast<int32_t>(wpage_node_.size()); ++p)
    if (wpage_node_[p] >= 0) wpool_->release(p);
}

uint64_t PrefixCache::now() const {
  if (clock_) return clock_();
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch()).count());
}

// ---- hashes ------------------------------------------------------------------------------

PageHash PrefixCache::chain_hash(const PageHash& parent, const int32_t* tokens, int32_t block_size, uint64_t model_fingerprint,
                                 int32_t kv_dtype_tag, std::string_view ns) {
  // Explicit little-endian with length prefixes, so the address is the same on every host
  // and no two (namespace, tokens) pairs serialize alike.
  std::vector<uint8_t> buf;
  buf.reserve(48 + ns.size() + 4 * static_cast<size_t>(block_size));
  put_u32(&buf, kChainHashVersion);
  put_u64(&buf, parent.lo);
  put_u64(&buf, parent.hi);
  put_u64(&buf, model_fingerprint);
  put_u32(&buf, static_cast<uint32_t>(kv_dtype_tag));
  put_u64(&buf, ns.size());
  buf.insert(buf.end(), ns.begin(), ns.end());
  put_u32(&buf, static_cast<uint32_t>(block_size));
  for (int32_t i = 0; i < block_size; ++i) put_u32(&buf, static_cast<uint32_t>(tokens[i]));
  XXH128_hash_t h = XXH3_128bits(buf.data(), buf.size());
  return PageHash{h.low64, h.high64};
}

std::vector<PageHash> PrefixCache::hash_pages(std::string_view ns, const int32_t* tokens, int64_t n_tokens) const {
  std::vector<PageHash> out;
  PageHash h;
  for (int64_t k = 0; k < n_tokens / block_size_; ++k) {
    h = chain_hash(h, tokens + k * block_size_, block_size_, model_fingerprint_, kv_dtype_tag_, ns);
    out.push_back(h);
  }
  return out;
}

// Least recently used first, each node after its ancestors: a store that keeps what came last
// keeps the most recent prefixes, and sees a page after the page it continues.
void PrefixCache::for_each_page(const std::function<void(const PageHash&, const PageHash&, const std::string&, const int32_t*, int32_t,
                                                        int32_t, uint64_t)>& f) const {
  std::vector<int32_t> order;
  for (int32_t x = 0; x < static_cast<int32_t>(nodes_.size()); ++x)
    if (nodes_[x].live && nodes_[x].parent >= 0) order.push_back(x);
  std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return nodes_[a].last_access < nodes_[b].last_access; });
  std::vector<char> done(nodes_.size(), 0);
  std::vector<int32_t> path;
  for (int32_t x : order) {
    path.clear();
    for (int32_t y = x; nodes_[y].parent >= 0 && !done[y]; y = nodes_[y].parent) path.push_back(y);
    for (auto it = path.rbegin(); it != path.rend(); ++it) {
      const int32_t y = *it;
      done[y] = 1;
      const Node& n = nodes_[y];
      for (size_t k = 0; k < n.pages.size(); ++k)
        f(n.hashes[k], page_parent(y, static_cast<int32_t>(k)), ns_of(y), n.tokens.data() + k * block_size_, n.pages[k],
          n.wpages.empty() ? -1 : n.wpages[k], n.last_access);
    }
  }
}

PrefixTreeView PrefixCache::view(int32_t max_nodes, int32_t n_head_tokens) const {
  PrefixTreeView v;
  v.now = now();
  // One walk from the roots gives every node its namespace and depth.
  struct Seen {
    int32_t node, ns;
    int64_t depth;
  };
  std::vector<Seen> all;
  for (const auto& [ns, root] : roots_) {
    const int32_t k = static_cast<int32_t>(v.namespaces.size());
    v.namespaces.push_back(ns);
    v.ns_pages.push_back(0);
    v.ns_nodes.push_back(0);
    std::vector<std::pair<int32_t, int64_t>> todo = {{root, 0}};
    while (!todo.empty()) {
      auto [x, depth] = todo.back();
      todo.pop_back();
      const Node& n = nodes_[x];
      if (x != root) {
        all.push_back({x, k, depth - static_cast<int64_t>(n.tokens.size())});
        v.ns_pages[k] += static_cast<int32_t>(n.pages.size());
        ++v.ns_nodes[k];
      }
      for (const auto& [key, c] : n.children) todo.push_back({c, depth + static_cast<int64_t>(nodes_[c].tokens.size())});
    }
  }
  v.n_nodes = static_cast<int32_t>(all.size());
  // The most recent first; a parent is never older than its children, so the chosen set is
  // nearly closed under ancestors already, and ties are closed below.
  const size_t keep = std::min(all.size(), static_cast<size_t>(std::max(max_nodes, 0)));
  auto newer = [&](const Seen& a, const Seen& b) { return nodes_[a.node].last_access > nodes_[b.node].last_access; };
  std::nth_element(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(keep), all.end(), newer);
  std::vector<Seen> chosen(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(keep));
  std::set<int32_t> have;
  for (const Seen& s : chosen) have.insert(s.node);
  for (size_t i = 0; i < chosen.size(); ++i) {
    const int32_t p = nodes_[chosen[i].node].parent;
    if (nodes_[p].parent >= 0 && have.insert(p).second)
      chosen.push_back({p, chosen[i].ns, chosen[i].depth - static_cast<int64_t>(nodes_[p].tokens.size())});
  }
  std::sort(chosen.begin(), chosen.end(), [](const Seen& a, const Seen& b) { return a.depth != b.depth ? a.depth < b.depth : a.node < b.node; });
  for (const Seen& s : chosen) {
    const Node& n = nodes_[s.node];
    PrefixTreeView::Node out;
    out.id = s.node;
    out.parent = nodes_[n.parent].parent >= 0 ? n.parent : -1;
    out.ns = s.ns;
    out.n_pages = static_cast<int32_t>(n.pages.size());
    out.depth_tokens = s.depth;
    out.hits = n.hits;
    out.last_access = n.last_access;
    out.pinned = n.lock > 0;
    out.head.assign(n.tokens.begin(), n.tokens.begin() + std::min<int64_t>(static_cast<int64_t>(n.tokens.size()), std::max(n_head_tokens, 0)));
    v.nodes.push_back(std::move(out));
  }
  return v;
}

const std::string& PrefixCache::ns_of(int32_t x) const {
  while (nodes_[x].parent >= 0) x = nodes_[x].parent;
  return nodes_[x].ns;
}

PageHash PrefixCache::parent_hash(int32_t x) const { return node(x).parent < 0 ? PageHash{} : node(x).hashes.back(); }
PageHash PrefixCache::page_parent(int32_t x, int32_t k) const { return k > 0 ? node(x).hashes[k - 1] : parent_hash(node(x).parent); }

PageHash PrefixCache::page_hash(const PrefixHandle& h) const {
  if (h.empty()) return PageHash{};
  assert(is_valid(h));
  return node(h.node).hashes.back();
}

std::vector<int32_t> PrefixCache::path_nodes(const PrefixHandle& h) const {
  std::vector<int32_t> path;
  if (h.empty()) return path;
  assert(is_valid(h));
  for (int32_t x = h.node; node(x).parent >= 0; x = node(x).parent) path.push_back(x);
  std::reverse(path.begin(), path.end());
  return path;
}

std::vector<int32_t> PrefixCache::path_pages(const PrefixHandle& h) const {
  std::vector<int32_t> out;
  for (int32_t x : path_nodes(h)) out.insert(out.end(), node(x).pages.begin(), node(x).pages.end());
  return out;
}

std::vector<int32_t> PrefixCache::path_window_pages(const PrefixHandle& h) const {
  std::vector<int32_t> out;
  for (int32_t x : path_nodes(h)) {
    const Node& n = node(x);
    if (n.wpages.empty()) out.insert(out.end(), n.pages.size(), -1);
    else out.insert(out.end(), n.wpages.begin(), n.wpages.end());
  }
  return out;
}

// ---- tree helpers ------------------------------------------------------------------------

uint64_t PrefixCache::page_key(const int32_t* tokens) const { return XXH3_64bits(tokens, sizeof(int32_t) * block_size_); }

int32_t PrefixCache::find_child(const Node& n, const int32_t* page_tokens) const {
  auto [b, e] = n.children.equal_range(page_key(page_tokens));
  for (auto it = b; it != e; ++it)
    if (same_page(node(it->second).tokens.data(), page_tokens, block_size_)) return it->second;
  return -1;
}

int32_t PrefixCache::root_for(const std::string& ns) const {
  auto it = roots_.find(ns);
  return it == roots_.end() ? -1 : it->second;
}

PrefixCache::Walk PrefixCache::walk(int32_t root, const int32_t* tokens, int64_t max_pages, std::vector<int32_t>* pages,
                                    std::vector<int32_t>* wpages) const {
  Walk w;
  w.node = root;
  int64_t done = 0;
  while (done < max_pages) {
    const int32_t c = find_child(node(w.node), tokens + done * block_size_);
    if (c < 0) break;
    const Node& cn = node(c);
    const int32_t n_edge = static_cast<int32_t>(cn.pages.size());
    int32_t k = 0;
    while (k < n_edge && done < max_pages && same_page(cn.tokens.data() + int64_t(k) * block_size_, tokens + done * block_size_, block_size_)) {
      if (pages) pages->push_back(cn.pages[k]);
      if (wpages) wpages->push_back(cn.wpages.empty() ? -1 : cn.wpages[k]);
      ++k;
      ++done;
    }
    if (k < n_edge) {
      w.child = c;
      w.n_in_child = k;  // >= 1: find_child matched the first page
      break;
    }
    w.node = c;
  }
  w.n_pages = done;
  return w;
}

int32_t PrefixCache::new_node() {
  int32_t x;
  if (!free_nodes_.empty()) {
    x = free_nodes_.back();
    free_nodes_.pop_back();
  } else {
    x = static_cast<int32_t>(nodes_.size());
    nodes_.emplace_back();
  }
  Node& n = nodes_[x];
  const uint32_t gen = n.gen;  // generations survive reuse so stale handles stay stale
  n = Node{};
  n.gen = gen;
  n.live = true;
  return x;
}

int32_t PrefixCache::split(int32_t x, int32_t k) {
  const int32_t y = new_node();  // may move nodes_: take references after
  Node& X = nodes_[x];
  Node& Y = nodes_[y];
  assert(k > 0 && k < static_cast<int32_t>(X.pages.size()));
  const int64_t n_tok = int64_t(k) * block_size_;
  Y.parent = X.parent;
  Y.lock = X.lock;  // every pin through X passes through Y
  Y.last_access = X.last_access;
  Y.hits = X.hits;  // every hit through X passed through Y
  Y.tokens.assign(X.tokens.begin(), X.tokens.begin() + n_tok);
  Y.pages.assign(X.pages.begin(), X.pages.begin() + k);
  Y.hashes.assign(X.hashes.begin(), X.hashes.begin() + k);
  X.tokens.erase(X.tokens.begin(), X.tokens.begin() + n_tok);
  X.pages.erase(X.pages.begin(), X.pages.begin() + k);
  X.hashes.erase(X.hashes.begin(), X.hashes.begin() + k);
  for (int32_t p : Y.pages) page_node_[p] = y;
  if (wpool_) {
    Y.wpages.assign(X.wpages.begin(), X.wpages.begin() + k);
    X.wpages.erase(X.wpages.begin(), X.wpages.begin() + k);
    for (int32_t p : Y.wpages)
      if (p >= 0) {
        wpage_node_[p] = y;
        ++Y.n_wpages;
        --X.n_wpages;
      }
  }
  // Y takes X's slot under the parent (same first page, same key); X hangs under Y.
  Node& P = nodes_[Y.parent];
  auto [b, e] = P.children.equal_range(page_key(Y.tokens.data()));
  for (auto it = b; it != e; ++it)
    if (it->second == x) {
      it->second = y;
      break;
    }
  Y.children.emplace(page_key(X.tokens.data()), x);
  X.parent = y;
  wlru_update(x);
  wlru_update(y);
  // X keeps its id, path, pins, time and LRU state; Y has a child so it is not a leaf.
  return y;
}

void PrefixCache::lru_add(int32_t x) {
  Node& n = nodes_[x];
  if (n.in_lru) return;
  lru_.insert({n.last_access, x});
  n.in_lru = true;
}

void PrefixCache::lru_remove(int32_t x) {
  Node& n = nodes_[x];
  if (!n.in_lru) return;
  lru_.erase({n.last_access, x});
  n.in_lru = false;
}

void PrefixCache::update_lru(int32_t x) {
  const Node& n = nodes_[x];
  const bool evictable = n.live && n.parent >= 0 && n.lock == 0 && n.children.empty();
  if (evictable)
    lru_add(x);
  else
    lru_remove(x);
}

void PrefixCache::touch_path(int32_t x, uint64_t t) {
  // max() keeps parent.last_access >= child.last_access even if the clock stalls or steps back.
  for (; x >= 0; x = nodes_[x].parent) {
    Node& n = nodes_[x];
    if (n.last_access >= t) continue;
    const bool was = n.in_lru, wwas = n.in_wlru;
    lru_remove(x);
    if (wwas) wlru_.erase({n.last_access, x});
    n.last_access = t;
    if (was) lru_add(x);
    if (wwas) wlru_.insert({n.last_access, x});
  }
}

void PrefixCache::wlru_update(int32_t x) {
  Node& n = nodes_[x];
  const bool want = n.live && n.n_wpages > 0;
  if (want == n.in_wlru) return;
  if (want)
    wlru_.insert({n.last_access, x});
  else
    wlru_.erase({n.last_access, x});
  n.in_wlru = want;
}

void PrefixCache::drop_wpage(Node& n, int32_t k) {
  const int32_t p = n.wpages[k];
  assert(p >= 0);
  wpage_node_[p] = -1;
  wpool_->release(p);
  n.wpages[k] = -1;
  --n.n_wpages;
  --stats_.cached_window_pages;
  ++stats_.evicted_window_pages;
}

void PrefixCache::remove_node(int32_t x) {
  // The caller has unlinked x from its parent and released its pages.
  Node& n = nodes_[x];
  lru_remove(x);
  n.n_wpages = 0;  // the caller released them
  wlru_update(x);
  n.live = false;
  ++n.gen;
  n.tokens = {};
  n.pages = {};
  n.hashes = {};
  n.wpages = {};
  n.children = {};
  n.ns = {};
  free_nodes_.push_back(x);
}

bool PrefixCache::is_valid(const PrefixHandle& h) const {
  if (h.empty()) return true;
  return h.node < static_cast<int32_t>(nodes_.size()) && node(h.node).live && node(h.node).gen == h.gen && node(h.node).parent >= 0;
}

// ---- lookup ------------------------------------------------------------------------------

int64_t PrefixCache::usable_pages(const std::vector<int32_t>& wpages) const {
  // The deepest P whose window [window_first_page(P), P) has no tombstone; P = 0 always is.
  int64_t last_hole = -1;  // deepest tombstone seen in [0, P)
  int64_t best = 0;
  for (int64_t P = 1; P <= static_cast<int64_t>(wpages.size()); ++P) {
    if (wpages[P - 1] < 0) last_hole = P - 1;
    if (last_hole < window_first_page(P)) best = P;
  }
  return best;
}

PrefixMatch PrefixCache::match(const std::string& ns, const int32_t* tokens, int64_t n_tokens) {
  PrefixMatch m;
  const int32_t root = root_for(ns);
  if (root < 0 || n_tokens <= 1) return m;
  int64_t max_pages = (n_tokens - 1) / block_size_;
  if (wpool_) {
    // Walk the whole matching path, then keep its longest usable part.
    walk(root, tokens, max_pages, nullptr, &m.window_pages);
    max_pages = usable_pages(m.window_pages);
    m.window_pages.resize(max_pages);
    for (int64_t k = 0; k < window_first_page(max_pages); ++k) m.window_pages[k] = -1;
  }
  const Walk w = walk(root, tokens, max_pages, &m.pages);
  const int32_t end = w.child >= 0 ? split(w.child, w.n_in_child) : w.node;
  m.n_tokens = w.n_pages * block_size_;
  if (end != root) m.handle = PrefixHandle{end, nodes_[end].gen};
  if (!wpool_) {
    // Every page that can follow the path starts a child of end (a split left the rest of
    // the walked edge as one): the longest run of the query's next tokens, leaving the last.
    const int64_t cap = std::min<int64_t>(block_size_ - 1, n_tokens - 1 - m.n_tokens);
    const int32_t* q = tokens + m.n_tokens;
    for (const auto& kc : nodes_[end].children) {
      const Node& c = node(kc.second);
      int32_t k = 0;
      while (k < cap && c.tokens[k] == q[k]) ++k;
      if (k > m.n_partial) {
        m.n_partial = k;
        m.partial_page = c.pages[0];
      }
    }
  }
  return m;
}

int64_t PrefixCache::match_length(const std::string& ns, const int32_t* tokens, int64_t n_tokens) const {
  const int32_t root = root_for(ns);
  if (root < 0 || n_tokens <= 1) return 0;
  if (wpool_) {
    std::vector<int32_t> wp;
    walk(root, tokens, (n_tokens - 1) / block_size_, nullptr, &wp);
    return usable_pages(wp) * block_size_;
  }
  return walk(root, tokens, (n_tokens - 1) / block_size_, nullptr).n_pages * block_size_;
}

void PrefixCache::count_query(int64_t n_query_tokens, int64_t n_hit_tokens, const PrefixHandle& hit, int64_t n_partial_tokens) {
  assert(n_hit_tokens >= 0 && n_hit_tokens <= n_query_tokens && n_partial_tokens >= 0 && n_partial_tokens <= n_hit_tokens);
  stats_.queries_tokens += n_query_tokens;
  stats_.hit_tokens += n_hit_tokens;
  stats_.partial_tokens += n_partial_tokens;
  if (hit.empty() || !is_valid(hit)) return;
  for (int32_t x = hit.node; nodes_[x].parent >= 0; x = nodes_[x].parent) ++nodes_[x].hits;
}

// ---- pins --------------------------------------------------------------------------------

void PrefixCache::pin(const PrefixHandle& h) {
  if (h.empty()) return;
  assert(is_valid(h));
  touch_path(h.node, now());
  ++nodes_[h.node].own_pins;
  for (int32_t x = h.node; x >= 0; x = nodes_[x].parent) {
    Node& n = nodes_[x];
    if (n.lock++ == 0) {
      stats_.pinned_pages += static_cast<int32_t>(n.pages.size());
      lru_remove(x);
    }
  }
}

void PrefixCache::unpin(const PrefixHandle& h) {
  if (h.empty()) return;
  assert(is_valid(h) && nodes_[h.node].own_pins > 0);
  touch_path(h.node, now());
  --nodes_[h.node].own_pins;
  for (int32_t x = h.node; x >= 0; x = nodes_[x].parent) {
    Node& n = nodes_[x];
    assert(n.lock > 0);
    if (--n.lock == 0) {
      stats_.pinned_pages -= static_cast<int32_t>(n.pages.size());
      update_lru(x);
    }
  }
}

// ---- insert ------------------------------------------------------------------------------

PrefixInsert PrefixCache::insert(const std::string& ns, const int32_t* tokens, int64_t n_tokens, const int32_t* pages,
                                 const int32_t* window_pages) {
  PrefixInsert r;
  const int64_t n_pages = n_tokens / block_size_;
  if (n_pages <= 0) return r;
  int32_t root = root_for(ns);
  if (root < 0) {
    root = new_node();
    nodes_[root].ns = ns;
    roots_.emplace(ns, root);
  }
  const Walk w = walk(root, tokens, n_pages, &r.pages);
  int32_t end = w.child >= 0 ? split(w.child, w.n_in_child) : w.node;
  // Window tombstones on the already-cached part: take the caller's page where it has one.
  auto adopt_window = [&](Node& n, int32_t x, int64_t pos, int32_t k) {
    const int32_t p = window_pages[pos];
    if (p < 0 || n.wpages[k] >= 0 || is_cached_window(p)) return;
    assert(p < wpool_->n_pages() && wpool_->refcount(p) > 0);
    wpool_->retain(p);
    wpage_node_[p] = x;
    n.wpages[k] = p;
    ++n.n_wpages;
    ++stats_.cached_window_pages;
  };
  if (wpool_ && window_pages) {
    int64_t pos = w.n_pages;  // positions [0, w.n_pages) lie on the path root → end
    for (int32_t x = end; nodes_[x].parent >= 0; x = nodes_[x].parent) {
      Node& n = nodes_[x];
      pos -= static_cast<int64_t>(n.pages.size());
      if (n.n_wpages < static_cast<int32_t>(n.pages.size()))
        for (int32_t k = 0; k < static_cast<int32_t>(n.pages.size()); ++k) adopt_window(n, x, pos + k, k);
      wlru_update(x);
    }
  }
  if (w.n_pages < n_pages) {
    // The rest becomes one new leaf under `end`, adopting the caller's pages.
    const int32_t y = new_node();
    Node& Y = nodes_[y];
    Y.parent = end;
    PageHash h = parent_hash(end);
    for (int64_t k = w.n_pages; k < n_pages; ++k) {
      const int32_t* t = tokens + k * block_size_;
      const int32_t p = pages[k];
      assert(p >= 0 && p < pool_.n_pages() && !is_cached(p) && pool_.refcount(p) > 0);
      pool_.retain(p);
      page_node_[p] = y;
      const PageHash parent = h;
      h = chain_hash(h, t, block_size_, model_fingerprint_, kv_dtype_tag_, ns);
      Y.tokens.insert(Y.tokens.end(), t, t + block_size_);
      Y.pages.push_back(p);
      Y.hashes.push_back(h);
      r.pages.push_back(p);
      if (wpool_) {
        Y.wpages.push_back(-1);
        if (window_pages) adopt_window(Y, y, k, static_cast<int32_t>(Y.wpages.size()) - 1);
      }
      if (listener_) listener_->page_cached(h, parent, ns, t, p, wpool_ ? Y.wpages.back() : -1);
    }
    r.n_new_pages = static_cast<int32_t>(n_pages - w.n_pages);
    nodes_[end].children.emplace(page_key(Y.tokens.data()), y);
    // Pins through `end` do not cover the new leaf: its lock starts at 0.
    update_lru(end);
    end = y;
    wlru_update(y);
    stats_.cached_pages += r.n_new_pages;
    stats_.inserted_pages += r.n_new_pages;
  }
  touch_path(end, now());
  update_lru(end);
  r.handle = PrefixHandle{end, nodes_[end].gen};
  return r;
}

// ---- eviction ----------------------------------------------------------------------------

int32_t PrefixCache::evict(int32_t n_pages) {
  int32_t done = 0;
  while (done < n_pages && !lru_.empty()) {
    const int32_t x = lru_.begin()->second;
    Node& n = nodes_[x];
    assert(n.lock == 0 && n.children.empty() && !n.pages.empty());
    const int32_t n_edge = static_cast<int32_t>(n.pages.size());
    const int32_t take = std::min(n_pages - done, n_edge);
    if (take == n_edge) {
      // The whole leaf goes; its parent may become an evictable leaf in turn.
      const int32_t parent = n.parent;
      Node& p = nodes_[parent];
      auto [b, e] = p.children.equal_range(page_key(n.tokens.data()));
      for (auto it = b; it != e; ++it)
        if (it->second == x) {
          p.children.erase(it);
          break;
        }
      if (listener_)
        for (size_t k = 0; k < n.pages.size(); ++k)
          listener_->page_evicted(n.hashes[k], page_parent(x, static_cast<int32_t>(k)), ns_of(x),
                                  n.tokens.data() + k * block_size_, n.pages[k], n.wpages.empty() ? -1 : n.wpages[k],
                                  n.last_access);
      for (int32_t page : n.pages) {
        page_node_[page] = -1;
        pool_.release(page);
      }
      for (int32_t k = 0; k < static_cast<int32_t>(n.wpages.size()); ++k)
        if (n.wpages[k] >= 0) drop_wpage(n, k);
      remove_node(x);
      if (nodes_[parent].parent < 0 && nodes_[parent].children.empty()) {
        roots_.erase(nodes_[parent].ns);
        remove_node(parent);
      } else {
        update_lru(parent);
      }
    } else {
      // Shorten the leaf from its deepest page; its first page (and so its key) stays.
      for (int32_t k = 0; k < take; ++k) {
        const int32_t page = n.pages.back();
        if (listener_)
          listener_->page_evicted(n.hashes.back(), page_parent(x, static_cast<int32_t>(n.hashes.size()) - 1), ns_of(x),
                                  n.tokens.data() + n.tokens.size() - block_size_, page, n.wpages.empty() ? -1 : n.wpages.back(),
                                  n.last_access);
        if (wpool_) {
          if (n.wpages.back() >= 0) drop_wpage(n, static_cast<int32_t>(n.wpages.size()) - 1);
          n.wpages.pop_back();
        }
        n.pages.pop_back();
        n.hashes.pop_back();
        n.tokens.resize(n.tokens.size() - block_size_);
        page_node_[page] = -1;
        pool_.release(page);
      }
      ++n.gen;  // a handle to this node would now name a shorter path
      wlru_update(x);
    }
    done += take;
  }
  stats_.cached_pages -= done;
  stats_.evicted_pages += done;
  return done;
}

bool PrefixCache::ensure_free(int32_t n_free) {
  while (pool_.n_free() < n_free && !lru_.empty()) evict(n_free - pool_.n_free());
  return pool_.n_free() >= n_free;
}

bool PrefixCache::ensure_free_window(int32_t n_free) {
  if (!wpool_) return false;
  // Matches end at node ends (the tree splits where requests diverge, and match() splits
  // where one stops), and a match ending at node x's end reads x's window pages from
  // window_first_page(end(x)) on; no deeper match reads x's earlier ones. So the first pass
  // drops only those earlier pages, the second anything; both oldest node first, earliest
  // positions first, skipping pages a request also holds (dropping those frees nothing).
  for (int pass = 0; pass < 2 && wpool_->n_free() < n_free; ++pass) {
    for (auto it = wlru_.begin(); it != wlru_.end() && wpool_->n_free() < n_free;) {
      const int32_t x = it->second;
      ++it;  // drop_wpage may take x out of the set
      Node& n = nodes_[x];
      const int32_t n_edge = static_cast<int32_t>(n.wpages.size());
      int32_t k_end = n_edge;
      if (pass == 0) {
        int64_t end = 0;  // pages from the root to the end of x
        for (int32_t y = x; nodes_[y].parent >= 0; y = nodes_[y].parent) end += static_cast<int64_t>(nodes_[y].pages.size());
        k_end = static_cast<int32_t>(std::clamp<int64_t>(window_first_page(end) - (end - n_edge), 0, n_edge));
      }
      for (int32_t k = 0; k < k_end && wpool_->n_free() < n_free; ++k)
        if (n.wpages[k] >= 0 && wpool_->refcount(n.wpages[k]) == 1) {
          // (Pass 0's pages no match can read: not worth writing down.)
          if (listener_ && pass == 1)
            listener_->window_page_evicted(n.hashes[k], page_parent(x, k), ns_of(x), n.tokens.data() + k * block_size_,
                                           n.pages[k], n.wpages[k], n.last_access);
          drop_wpage(n, k);
        }
      wlru_update(x);
    }
  }
  return wpool_->n_free() >= n_free;
}

int32_t PrefixCache::n_evictable_window_pages() const {
  int32_t n = 0;
  for (int32_t p = 0; p < static_cast<int32_t>(wpage_node_.size()); ++p) n += wpage_node_[p] >= 0 && wpool_->refcount(p) == 1;
  return n;
}

PrefixCacheStats PrefixCache::stats() const {
  PrefixCacheStats s = stats_;
  s.evictable_pages = s.cached_pages - s.pinned_pages;
  return s;
}

// ---- integrity ---------------------------------------------------------------------------

Status PrefixCache::check_integrity(std::span<const int32_t> other_holders, std::span<const int32_t> other_window_holders) const {
  auto fail = [](const std::string& what, int32_t x) { return Status::error("prefix cache: node " + std::to_string(x) + ": " + what); };
  const int32_t n_pool = pool_.n_pages();
  if (static_cast<int32_t>(page_node_.size()) != n_pool) return Status::error("prefix cache: page map size differs from the pool");
  std::vector<uint8_t> seen(n_pool, 0);
  int32_t n_cached = 0, n_pinned = 0, n_lru = 0, n_reached = 0;
  const int32_t n_wpool = wpool_ ? wpool_->n_pages() : 0;
  if (static_cast<int32_t>(wpage_node_.size()) != n_wpool) return Status::error("prefix cache: window page map size differs from the pool");
  std::vector<uint8_t> wseen(n_wpool, 0);
  int32_t n_wcached = 0, n_wlru = 0;

  for (const auto& [ns, root] : roots_) {
    if (root < 0 || root >= static_cast<int32_t>(nodes_.size())) return Status::error("prefix cache: bad root id for namespace '" + ns + "'");
    const Node& r = node(root);
    if (!r.live || r.parent != -1 || r.ns != ns || !r.pages.empty() || r.in_lru) return fail("malformed root of '" + ns + "'", root);
    if (r.children.empty()) return fail("empty namespace root kept", root);
    // Depth-first over (node, chain hash of its parent's last page).
    std::vector<std::pair<int32_t, PageHash>> stack{{root, PageHash{}}};
    while (!stack.empty()) {
      auto [x, h] = stack.back();
      stack.pop_back();
      const Node& n = node(x);
      ++n_reached;
      if (n.lock < 0 || n.own_pins < 0) return fail("negative lock or pin count", x);
      if (x != root) {
        const size_t np = n.pages.size();
        if (np == 0) return fail("empty edge", x);
        if (n.tokens.size() != np * block_size_ || n.hashes.size() != np) return fail("edge sizes disagree", x);
        for (size_t k = 0; k < np; ++k) {
          const int32_t p = n.pages[k];
          if (p < 0 || p >= n_pool) return fail("invalid page id " + std::to_string(p), x);
          if (seen[p]) return fail("page " + std::to_string(p) + " cached twice", x);
          seen[p] = 1;
          if (page_node_[p] != x) return fail("page map disagrees for page " + std::to_string(p), x);
          if (pool_.refcount(p) < 1) return fail("cached page " + std::to_string(p) + " has refcount 0", x);
          h = chain_hash(h, n.tokens.data() + k * block_size_, block_size_, model_fingerprint_, kv_dtype_tag_, ns);
          if (!(h == n.hashes[k])) return fail("chain hash of page " + std::to_string(p) + " is stale", x);
        }
        if (n.wpages.size() != (wpool_ ? np : 0)) return fail("window page list size disagrees", x);
        int32_t nw = 0;
        for (int32_t p : n.wpages) {
          if (p < 0) continue;
          if (p >= n_wpool) return fail("invalid window page id " + std::to_string(p), x);
          if (wseen[p]) return fail("window page " + std::to_string(p) + " cached twice", x);
          wseen[p] = 1;
          if (wpage_node_[p] != x) return fail("window page map disagrees for page " + std::to_string(p), x);
          if (wpool_->refcount(p) < 1) return fail("cached window page " + std::to_string(p) + " has refcount 0", x);
          ++nw;
        }
        if (nw != n.n_wpages) return fail("window page count is stale", x);
        if ((nw > 0) != n.in_wlru || (n.in_wlru && !wlru_.count({n.last_access, x}))) return fail("window LRU membership is wrong", x);
        n_wlru += n.in_wlru;
        n_wcached += nw;
        n_cached += static_cast<int32_t>(np);
        if (n.lock > 0) n_pinned += static_cast<int32_t>(np);
        const bool evictable = n.lock == 0 && n.children.empty();
        if (evictable != n.in_lru || (n.in_lru && !lru_.count({n.last_access, x}))) return fail("LRU membership is wrong", x);
        n_lru += evictable;
      }
      int32_t child_locks = 0;
      for (const auto& [key, c] : n.children) {
        if (c < 0 || c >= static_cast<int32_t>(nodes_.size()) || !node(c).live) return fail("dead child " + std::to_string(c), x);
        const Node& cn = node(c);
        if (cn.parent != x) return fail("child " + std::to_string(c) + " names another parent", x);
        if (cn.pages.empty() || key != page_key(cn.tokens.data())) return fail("child " + std::to_string(c) + " filed under a wrong key", x);
        if (find_child(n, cn.tokens.data()) != c) return fail("two children share a first page", x);
        if (cn.last_access > n.last_access) return fail("child used more recently than its parent", x);
        child_locks += cn.lock;
        stack.push_back({c, h});
      }
      if (n.lock != n.own_pins + child_locks) return fail("lock count " + std::to_string(n.lock) + " != pins below it", x);
    }
  }
  int32_t n_live = 0;
  for (const Node& n : nodes_) n_live += n.live;
  if (n_live != n_reached) return Status::error("prefix cache: " + std::to_string(n_live - n_reached) + " live nodes unreachable");
  if (static_cast<int32_t>(lru_.size()) != n_lru) return Status::error("prefix cache: LRU set holds stale entries");
  int32_t n_mapped = 0;
  for (int32_t p = 0; p < n_pool; ++p) n_mapped += page_node_[p] >= 0;
  if (n_mapped != n_cached) return Status::error("prefix cache: page map holds pages outside the tree");
  if (static_cast<int32_t>(wlru_.size()) != n_wlru) return Status::error("prefix cache: window LRU set holds stale entries");
  int32_t n_wmapped = 0;
  for (int32_t p = 0; p < n_wpool; ++p) n_wmapped += wpage_node_[p] >= 0;
  if (n_wmapped != n_wcached || n_wcached != stats_.cached_window_pages)
    return Status::error("prefix cache: window pages: map holds " + std::to_string(n_wmapped) + ", tree " + std::to_string(n_wcached) +
                         ", counter " + std::to_string(stats_.cached_window_pages));
  if (!other_window_holders.empty()) {
    if (static_cast<int32_t>(other_window_holders.size()) != n_wpool) return Status::error("prefix cache: other_window_holders size differs from the pool");
    for (int32_t p = 0; p < n_wpool; ++p) {
      const int32_t want = other_window_holders[p] + (wseen[p] ? 1 : 0);
      if (wpool_->refcount(p) != want)
        return Status::error("prefix cache: window page " + std::to_string(p) + " has refcount " + std::to_string(wpool_->refcount(p)) +
                             ", holders " + std::to_string(want));
    }
  }
  if (n_cached != stats_.cached_pages || n_pinned != stats_.pinned_pages)
    return Status::error("prefix cache: counters say " + std::to_string(stats_.cached_pages) + " cached / " + std::to_string(stats_.pinned_pages) +
                         " pinned, tree holds " + std::to_string(n_cached) + " / " + std::to_string(n_pinned));
  if (!other_holders.empty()) {
    if (static_cast<int32_t>(other_holders.size()) != n_pool) return Status::error("prefix cache: other_holders size differs from the pool");
    for (int32_t p = 0; p < n_pool; ++p) {
      const int32_t want = other_holders[p] + (seen[p] ? 1 : 0);
      if (pool_.refcount(p) != want)
        return Status::error("prefix cache: page " + std::to_string(p) + " has refcount " + std::to_string(pool_.refcount(p)) + ", holders " +
                             std::to_string(want) + (seen[p] ? " (cache + others)" : " (others)"));
    }
  }
  return Status::ok();
}

}  // namespace kv
