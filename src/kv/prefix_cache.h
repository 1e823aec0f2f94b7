// PrefixCache: full KV pages of finished (or preempted) sequences, kept in a radix tree per
// namespace so later requests that start with the same tokens reuse them instead of
// recomputing.
//
// Shape. One tree per namespace. A node's edge is a run of whole pages: tokens
// [n_pages * block_size] and the pages holding their K/V. Siblings differ in their first page's
// tokens; nodes split where sequences diverge, always at a page boundary. The tail (partial)
// page of a sequence is never cached, so a cached page is never written again.
//
// Ownership. The cache holds exactly one pool reference on every page in the tree (taken by
// insert() with pool.retain(), dropped by evict() with pool.release()). A request that reuses
// cached pages takes its own reference for each page it puts in its block table and pins the
// node (pin/unpin): a per-node lock count, incremented along the path to the root. Pinned
// nodes are never evicted. Unpinned nodes are evictable, leaves first, least recently used
// first; "recently used" means the last pin, unpin or insert that touched the node, by the
// injected clock. A page leaves the pool's used count only when its last holder lets go, so
// evicting an unpinned page that a request still holds drops the cache's reference and frees
// nothing (see ensure_free()).
//
// Handles. match() and insert() return a PrefixHandle naming the deepest node of the path.
// The path a handle names (its pages, in order) never changes while the node lives: a split
// always creates the new node *above* the existing one. A pinned handle stays valid until
// unpinned. An unpinned handle stays valid until the next evict()/ensure_free(), which may
// shorten or remove its node; is_valid() tells.
//
// Namespaces and trust. Requests in different namespaces never share a page: each namespace
// has its own tree and the namespace is part of every chain hash. A namespace is whatever
// string the engine passes: the request's cache_salt, and, when the server authenticates
// callers, the caller's key as well. A caller-chosen salt alone is not a security boundary:
// anyone who sends the same salt shares the namespace and can probe it by timing (a cache hit
// answers faster). Isolation between tenants holds only when the engine adds something the
// caller cannot choose (the authenticated key) to the namespace.
//
// Partial pages. A match ends at a page boundary, but the query's next tokens may begin a
// cached page (a sibling prompt that diverged mid-page: the chat template's last tokens before
// the user's message, say). match() names the cached page after the path with the longest
// such run; the engine copies it into a page of its own and computes from the first token
// that differs, as SGLang's token-granular radix tree would reuse them. The tree itself stays
// in whole pages.
//
// Chain hash. Each cached page has a 128-bit content address: XXH3_128bits (seed 0) over
//   u32 kChainHashVersion | u64 parent.lo | u64 parent.hi      (zero parent for a first page)
//   | u64 model_fingerprint | u32 kv_dtype_tag | u64 len(ns) | ns bytes
//   | u32 block_size | u32 token × block_size
// all little-endian, so any language and host can recompute it. Equal hashes mean equal page
// contents for the same model and KV format; the disk and Redis tiers and prefill/decode
// transfer key pages by it. A golden test freezes the format: changing it invalidates every
// stored page, so bump kChainHashVersion when you do.
//
// Sliding-window layer group (hybrid models such as Gemma 3). The model's local layers keep
// their K/V in a second pool whose pages a query needs only inside its window. The cache then
// holds, beside each position's global page, that position's window-group page, or -1 when it
// is gone (a tombstone). A cached prefix of P pages is usable only when the window pages the
// next query sees are all present: positions [P·bs - window + 1, P·bs), i.e. pages
// [window_first_page(P), P). match() returns the longest such P. Window pages go two ways:
// with their position, when evict() drops the global page; or alone, by ensure_free_window()
// when the window pool needs room — first those no match ending at a node end can read, then
// the rest, least recently used node first, its earliest pages first. Window
// eviction ignores pins: a request holds its own reference on every window page it reads, so
// dropping the cache's reference never takes a page from a running request; it only shortens
// what later requests can reuse. A tombstone is refilled when a later insert() brings the page
// again.
//
// Threading. Not thread-safe. The engine thread owns the cache, like the PagePool it wraps;
// other threads read stats() only through a snapshot the engine copies under its own lock.
#pragma once
#include <algorithm>
#include <cstdint>
#include <functional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include "common/status.h"
#include "kv/page_pool.h"

namespace kv {

// 128-bit chain hash of one page (XXH3-128: lo = low64, hi = high64).
struct PageHash {
  uint64_t lo = 0;
  uint64_t hi = 0;
  bool operator==(const PageHash&) const = default;
  std::string hex() const;  // 32 hex digits, hi then lo
};

// Names the deepest node of a cached path. node < 0: the empty path (nothing matched or
// inserted); pin/unpin of an empty handle do nothing.
struct PrefixHandle {
  int32_t node = -1;
  uint32_t gen = 0;  // the node's generation when the handle was made (detects stale handles)
  bool empty() const { return node < 0; }
};

struct PrefixMatch {
  std::vector<int32_t> pages;  // [n_tokens / block_size] cached page ids, in sequence order
  // Hybrid models: [pages.size()] window-group pages of the same positions; -1 before
  // window_first_page (pages no later query sees). Empty without a window pool.
  std::vector<int32_t> window_pages;
  int64_t n_tokens = 0;        // tokens covered: a multiple of block_size, at most n_query - 1
  PrefixHandle handle;         // the node holding the last matched page; pin before evicting
  // The token after the match, inside a page: a cached page right after the matched path
  // whose first n_partial tokens (0 < n_partial < block_size, n_tokens + n_partial <=
  // n_query - 1) are the query's next ones, the longest such run among the candidates. The
  // caller may copy the page and keep those slots (copy-on-write) instead of computing them.
  // The page is the cache's (not pinned by the handle): copy it before any eviction. -1 / 0:
  // none; always none with a window pool (hybrid models).
  int32_t partial_page = -1;
  int32_t n_partial = 0;
};

struct PrefixInsert {
  int32_t n_new_pages = 0;     // caller pages the cache adopted (pool.retain'ed)
  std::vector<int32_t> pages;  // [n_pages] the cached page for every inserted position: the
                               // caller's own page where adopted, else the copy already cached
  PrefixHandle handle;         // the node holding the last inserted page
};

// Counters owned by the cache; /metrics reads a copy.
struct PrefixCacheStats {
  int64_t queries_tokens = 0;  // prompt tokens looked up at admission (count_query)
  int64_t hit_tokens = 0;      // of those, served from the cache
  int64_t partial_tokens = 0;  // of those, copied from a partly matching page (PrefixMatch::n_partial)
  int64_t inserted_pages = 0;  // pages adopted by insert()
  int64_t evicted_pages = 0;   // cache references dropped by evict()
  int32_t cached_pages = 0;    // pages in the tree now (the cache holds one reference on each)
  int32_t pinned_pages = 0;    // of those, in nodes pinned by at least one request
  int32_t evictable_pages = 0; // cached - pinned
  // Sliding-window layer group (hybrid models); 0 without one.
  int32_t cached_window_pages = 0;    // window pages in the tree now (one reference each)
  int64_t evicted_window_pages = 0;   // cache references on window pages dropped
};

// A bounded picture of the trees for the KV dashboard (view()).
struct PrefixTreeView {
  struct Node {
    int32_t id = 0;
    int32_t parent = -1;         // -1: a first-level node (its parent is the namespace's root)
    int32_t ns = 0;              // index into namespaces
    int32_t n_pages = 0;         // pages on this node's edge
    int64_t depth_tokens = 0;    // tokens before the edge (the path from the root)
    int64_t hits = 0;            // admissions whose cached prefix ran through this node (count_query)
    uint64_t last_access = 0;    // the clock's time of the last pin, unpin or insert through it
    bool pinned = false;         // a running request reads it
    std::vector<int32_t> head;   // the edge's first tokens (at most n_head_tokens)
  };
  std::vector<std::string> namespaces;  // every namespace with a tree
  std::vector<int32_t> ns_pages;        // [namespaces] cached pages
  std::vector<int32_t> ns_nodes;        // [namespaces] nodes (roots not counted)
  std::vector<Node> nodes;              // the most recently used, parents before children
  int32_t n_nodes = 0;                  // nodes in every tree (roots not counted)
  uint64_t now = 0;                     // the clock when viewed: a node's age is now - last_access
};

// The sliding-window layer group's pool and window (tokens), for hybrid models.
struct WindowGroup {
  PagePool* pool = nullptr;
  int32_t window = 0;  // a query at position p sees keys in (p - window, p]
};

// Told about pages entering and leaving the cache (the tier manager writes them below RAM).
// Every call comes while the cache still holds the pages named, so their contents are readable.
// wpage (hybrid models): the position's window-group page, -1 when the cache holds none.
// parent: the chain hash of the page before (PageHash{} for a namespace's first page).
// last_use: the page's node's last use, on the cache's clock (steady_clock ns unless injected).
struct PageListener {
  virtual ~PageListener() = default;
  // insert() adopted `page` as the page with chain hash h (its tokens: block_size of them).
  virtual void page_cached(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens,
                           int32_t page, int32_t wpage = -1) = 0;
  // evict() is dropping the cache's reference on `page` (and on wpage with it).
  virtual void page_evicted(const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* tokens,
                            int32_t page, int32_t wpage = -1, uint64_t last_use = 0) = 0;
  // Hybrid models: ensure_free_window() is dropping the window page wpage of a position still
  // cached (global page `page`) while a match ending at a node end could read it (the pages no
  // such match reads go unannounced).
  virtual void window_page_evicted(const PageHash&, const PageHash&, const std::string&, const int32_t*, int32_t, int32_t,
                                   uint64_t /*last_use*/ = 0) {}
};

class PrefixCache {
 public:
  // Monotonic time, any unit; only the order matters. Tests inject a counter.
  using Clock = std::function<uint64_t()>;
  static constexpr uint32_t kChainHashVersion = 2;  // 2: the dtype tag is KvLayout::format_tag()

  // block_size is the pool's. model_fingerprint identifies the weights (and anything else
  // that changes K/V: architecture, rope scaling); kv_dtype_tag identifies the page format
  // (KvLayout::format_tag(): every layer's dtype and the tile format version). Both only feed the chain hash. A null clock means
  // std::chrono::steady_clock in nanoseconds. window: the sliding-window group of a hybrid
  // model (its pool must have pool's block size), else empty.
  PrefixCache(PagePool& pool, uint64_t model_fingerprint, int32_t kv_dtype_tag, Clock clock = nullptr, WindowGroup window = {});
  // Drops every cache reference (pool.release per cached page). Asserts nothing is pinned.
  ~PrefixCache();
  PrefixCache(const PrefixCache&) = delete;
  PrefixCache& operator=(const PrefixCache&) = delete;

  int32_t block_size() const { return block_size_; }
  bool has_window() const { return wpool_ != nullptr; }
  // First page a query at position n_pages * block_size reads in the window group.
  int64_t window_first_page(int64_t n_pages) const {
    return std::max<int64_t>(0, n_pages * block_size_ - window_ + 1) / block_size_;
  }

  // Pages adopted and evicted are reported to l (null: nobody). Not owned.
  void set_listener(PageListener* l) { listener_ = l; }

  // --- lookup -----------------------------------------------------------------------------
  // The longest cached prefix of tokens[0, n_tokens) in namespace ns, in whole pages, and at
  // most (n_tokens - 1) / block_size pages: at least one token is always left to compute,
  // because the engine needs logits from the last prompt position. Changes no page,
  // refcount, pin, LRU time or stat; it may split a node so the handle ends exactly at the
  // last matched page (tree shape only). The caller then pins the handle and takes its own
  // reference on each page it keeps (pool.retain). Hybrid models: only prefixes whose window
  // pages are all present count (see above); the caller retains window_pages too.
  PrefixMatch match(const std::string& ns, const int32_t* tokens, int64_t n_tokens);
  // Tokens match() would return, without splitting anything (for lpm ordering).
  int64_t match_length(const std::string& ns, const int32_t* tokens, int64_t n_tokens) const;
  // Adds one admission's lookup to the stats: n_query_tokens prompt tokens, n_hit_tokens of
  // them from the cache, n_partial_tokens of those copied from a partly matching page. Called
  // once per admission that commits, not per match() (lpm ordering and failed admissions look
  // up without counting). hit: the match's handle (valid), whose path counts one hit per node
  // (PrefixTreeView::Node::hits).
  void count_query(int64_t n_query_tokens, int64_t n_hit_tokens, const PrefixHandle& hit = {}, int64_t n_partial_tokens = 0);

  // --- pins -----------------------------------------------------------------------------
  // Lock (unlock) every node from the handle's node up to the root; refreshes their LRU time.
  // Every pin must be matched by one unpin of the same handle. The handle must be valid.
  void pin(const PrefixHandle& h);
  void unpin(const PrefixHandle& h);
  bool is_valid(const PrefixHandle& h) const;

  // --- insert ---------------------------------------------------------------------------
  // Caches the full pages of a sequence: tokens[0, n_pages * block_size) with their pages
  // [n_pages]; n_pages = n_tokens / block_size (tokens past the last full page are ignored).
  // Positions already cached keep the cached page (the caller's duplicate is not taken: the
  // caller still releases it as usual). New positions adopt the caller's page: pool.retain,
  // so the caller must hold it (refcount >= 1), it must be fully written, and nobody may
  // write it again. A page id may be cached at one position only. Refreshes the LRU time of
  // the path. Called when a request finishes or is preempted, before it releases its block
  // table; may also be called while it runs (then pin the returned handle until it ends).
  // window_pages (hybrid models): the caller's window-group pages of the same positions, -1
  // where it no longer holds one; each one present is adopted where the cache has none for
  // its position (a new position, or a tombstone), under the same rules as pages.
  PrefixInsert insert(const std::string& ns, const int32_t* tokens, int64_t n_tokens, const int32_t* pages,
                      const int32_t* window_pages = nullptr);

  // --- eviction -------------------------------------------------------------------------
  // Drops the cache's reference on up to n_pages unpinned pages: the least recently used
  // leaf first, from its last page backwards; a node left empty is removed and its parent
  // may become an evictable leaf. Returns how many references were dropped (pages actually
  // freed = those the cache was the last holder of). evict(0) is always safe and does nothing.
  int32_t evict(int32_t n_pages);
  // Evicts, LRU first, until pool.n_free() >= n_free or nothing unpinned is left. Returns
  // whether pool.n_free() >= n_free. When every unpinned cached page is held by the cache
  // alone (the engine keeps this true by pinning what its running requests share), it
  // succeeds exactly when pool.n_free() + n_evictable_pages() >= n_free: check that first
  // to avoid evicting for nothing.
  bool ensure_free(int32_t n_free);
  // Window group: drops the cache's reference on window pages until the window pool has
  // n_free free pages, skipping pages a request also holds (dropping those frees nothing):
  // first the pages no match ending at a node end reads, then any; LRU node first, earliest
  // positions first. Returns whether the pool has n_free free pages.
  bool ensure_free_window(int32_t n_free);
  // Window pages only the cache holds (what ensure_free_window can free at most).
  int32_t n_evictable_window_pages() const;

  // --- hashes ---------------------------------------------------------------------------
  static PageHash chain_hash(const PageHash& parent, const int32_t* tokens, int32_t block_size, uint64_t model_fingerprint,
                             int32_t kv_dtype_tag, std::string_view ns);
  // Chain hashes of every full page of tokens[0, n_tokens) in ns: [n_tokens / block_size].
  std::vector<PageHash> hash_pages(std::string_view ns, const int32_t* tokens, int64_t n_tokens) const;
  // Hash of the last page on the handle's path (zero for an empty handle).
  PageHash page_hash(const PrefixHandle& h) const;
  // Calls f(hash, parent hash, namespace, tokens, page, window page or -1, last use) for every
  // cached page (a shutdown writing them down): least recently used nodes first, each after its
  // ancestors. last use: the node's, on the cache's clock.
  void for_each_page(const std::function<void(const PageHash&, const PageHash&, const std::string&, const int32_t*, int32_t, int32_t,
                                              uint64_t)>& f) const;
  // Pages on the handle's path, root first.
  std::vector<int32_t> path_pages(const PrefixHandle& h) const;
  // Their window-group pages (hybrid models; -1 where none), root first.
  std::vector<int32_t> path_window_pages(const PrefixHandle& h) const;
  // The max_nodes most recently used nodes (ties: any) and their ancestors, each with its edge's
  // first n_head_tokens tokens; counts per namespace over every node. O(nodes); changes nothing.
  PrefixTreeView view(int32_t max_nodes, int32_t n_head_tokens) const;

  // --- accounting -----------------------------------------------------------------------
  int32_t n_cached_pages() const { return stats_.cached_pages; }
  int32_t n_pinned_pages() const { return stats_.pinned_pages; }
  int32_t n_evictable_pages() const { return stats_.cached_pages - stats_.pinned_pages; }
  int32_t n_namespaces() const { return static_cast<int32_t>(roots_.size()); }
  PrefixCacheStats stats() const;
  bool is_cached(int32_t page) const { return page >= 0 && page < static_cast<int32_t>(page_node_.size()) && page_node_[page] >= 0; }
  bool is_cached_window(int32_t page) const {
    return page >= 0 && page < static_cast<int32_t>(wpage_node_.size()) && wpage_node_[page] >= 0;
  }
  int32_t n_cached_window_pages() const { return stats_.cached_window_pages; }

  // Tree invariants: links, edge sizes, sibling keys, chain hashes recomputed, each cached
  // page in one position only with pool refcount >= 1, lock counts = direct pins + children's
  // locks, the LRU set = exactly the unpinned childless non-root nodes, counters = recount.
  // With other_holders ([pool.n_pages()], references held outside the cache, e.g. counted
  // from block tables) also: refcount(p) == other_holders[p] + (cached ? 1 : 0) for every p,
  // i.e. the cache holds exactly one reference per cached page and none elsewhere.
  // other_window_holders: the same for the window pool (hybrid models).
  Status check_integrity(std::span<const int32_t> other_holders = {}, std::span<const int32_t> other_window_holders = {}) const;

 private:
  struct Node {
    int32_t parent = -1;           // -1: a namespace root
    uint32_t gen = 0;              // bumped when the node shrinks or dies
    bool live = false;
    bool in_lru = false;
    bool in_wlru = false;
    int32_t lock = 0;              // pins through this node (own + descendants')
    int32_t own_pins = 0;          // pins whose handle is this node
    uint64_t last_access = 0;      // never below any child's
    int64_t hits = 0;              // admissions that matched through this node (count_query)
    std::vector<int32_t> tokens;   // [n_pages * block_size] edge tokens
    std::vector<int32_t> pages;    // [n_pages]
    std::vector<PageHash> hashes;  // [n_pages] chain hash of each page
    std::vector<int32_t> wpages;   // [n_pages] window-group page per position, -1: none (hybrid only)
    int32_t n_wpages = 0;          // entries of wpages >= 0
    // Children keyed by a 64-bit hash of their first page's tokens (collisions resolved by
    // comparing tokens).
    std::unordered_multimap<uint64_t, int32_t> children;
    std::string ns;                // roots only
  };
  using LruKey = std::pair<uint64_t, int32_t>;  // (last_access, node)

  uint64_t now() const;
  uint64_t page_key(const int32_t* tokens) const;
  int32_t find_child(const Node& n, const int32_t* page_tokens) const;
  int32_t root_for(const std::string& ns) const;
  // Walk: deepest node fully matched, and pages matched inside the next child (0 if none).
  struct Walk {
    int32_t node = -1;
    int32_t child = -1;
    int32_t n_in_child = 0;
    int64_t n_pages = 0;
  };
  Walk walk(int32_t root, const int32_t* tokens, int64_t max_pages, std::vector<int32_t>* pages,
            std::vector<int32_t>* wpages = nullptr) const;
  // Longest usable prefix (in pages) of a walked path whose window pages are wpages.
  int64_t usable_pages(const std::vector<int32_t>& wpages) const;
  void wlru_update(int32_t x);  // in the window LRU set iff live and holding a window page
  void drop_wpage(Node& n, int32_t k);  // releases n.wpages[k] (>= 0) back to the window pool
  int32_t new_node();
  // Splits node x after k pages (0 < k < size): a new node takes the first k pages and
  // becomes x's parent. Returns the new node. x keeps its id, path, pins and children.
  int32_t split(int32_t x, int32_t k);
  void touch_path(int32_t x, uint64_t t);
  std::vector<int32_t> path_nodes(const PrefixHandle& h) const;  // root first, the root itself excluded
  void lru_add(int32_t x);
  void lru_remove(int32_t x);
  void update_lru(int32_t x);  // in the LRU set iff non-root, unpinned and childless
  void remove_node(int32_t x);
  PageHash parent_hash(int32_t x) const;
  PageHash page_parent(int32_t x, int32_t k) const;  // the chain hash before page k of node x
  const Node& node(int32_t x) const { return nodes_[x]; }

  PagePool& pool_;
  int32_t block_size_;
  uint64_t model_fingerprint_;
  int32_t kv_dtype_tag_;
  Clock clock_;

  std::vector<Node> nodes_;
  std::vector<int32_t> free_nodes_;
  std::unordered_map<std::string, int32_t> roots_;  // namespace -> root node
  std::vector<int32_t> page_node_;                  // [pool.n_pages()] node caching the page, or -1
  std::set<LruKey> lru_;                            // evictable leaves, oldest first
  // Window group (hybrid models; null pool otherwise).
  PagePool* wpool_ = nullptr;
  int32_t window_ = 0;
  std::vector<int32_t> wpage_node_;                 // [wpool.n_pages()] node caching the page, or -1
  std::set<LruKey> wlru_;                           // nodes holding window pages, oldest first
  PrefixCacheStats stats_;
  PageListener* listener_ = nullptr;
  const std::string& ns_of(int32_t x) const;  // the namespace of node x's tree
};

}  // namespace kv
