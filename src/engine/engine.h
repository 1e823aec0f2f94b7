// The engine: one thread that owns every KV page, batches all running sequences into one
// forward per step (continuous batching), and streams tokens back to requests.
//
//   step() = schedule → forward → postprocess
//
// Scheduling: running decodes first, then prefills chunked into what is left of
// max_num_batched_tokens, at most max_num_seqs sequences. When pages run out the newest
// running sequence is preempted (pages freed, recomputed later). Requests that can never
// fit are rejected by submit(); a full waiting queue rejects with 429.
//
// Threading: submit()/metrics() may be called from any thread; step() and everything it
// touches belong to the engine thread started by start() (or to the caller of step() in
// tests, when start() was not called).
#pragma once
#include <atomic>
#include <condition_variable>
#include <deque>
#include <list>
#include <memory>
#include <mutex>
#include <thread>
#include <unordered_set>
#include <vector>

#include "common/status.h"
#include "common/thread_pool.h"
#include "engine/kv_snapshot.h"
#include "engine/metrics.h"
#include "engine/request.h"
#include "engine/sampler.h"
#include "engine/speculative.h"
#include "kv/page_pool.h"
#include "kv/prefix_cache.h"
#include "kv/cold_store.h"
#include "kv/tier_manager.h"
#include "model/llama.h"
#include "tokenizer/tokenizer.h"

namespace kv {

struct EngineConfig {
  int32_t max_num_batched_tokens = 512;
  int32_t max_num_seqs = 64;
  // A prompt with more than this many tokens left is a long prefill: it gets at most this many
  // before the waiting requests are admitted, then what the step leaves (0: no cap).
  int32_t long_prefill_tokens = 0;
  int32_t max_model_len = 4096;   // prompt + generated tokens per sequence
  int32_t max_queue = 256;        // waiting requests before submit() answers 429
  int32_t max_n = 16;             // largest `n` accepted
  int32_t block_size = 16;
  KvDtype kv_dtype = KvDtype::kF16;
  std::vector<KvDtype> kv_layer_dtypes;  // per-layer overrides; empty = every layer kv_dtype
  int64_t kv_cache_bytes = int64_t(1) << 30;
  int32_t n_threads = 2;
  bool enable_prefix_caching = true;
  // fcfs: admit in arrival order. lpm: among the first waiting requests prefer the longest
  // cached prefix (as SGLang does); a request passed over kLpmMaxSkips times goes next.
  enum class Policy { kFcfs, kLpm } policy = Policy::kFcfs;
  // Long-context KV policy of requests that do not choose one (kv/kv_eviction.h). Quest sparse
  // reads need the pool's key bounds, kept only when this default enables them.
  EvictionConfig kv_policy;
  // KV tiers below RAM (kv/tier_manager.h): disk (L2) and Redis (L3). Need prefix caching.
  TierConfig tiers;
  // Hot and cold pages (kv/cold_store.h), when kv_policy.offload_cold: the directory of the
  // spill file (empty: tiers.disk_dir, else /tmp).
  std::string kv_offload_dir;
  // What a preempted sequence's pages become. recompute: they stay in the RAM prefix cache
  // only, and what was evicted from it is recomputed. swap: they are also written to the tiers
  // at once, and resuming looks for them there.
  enum class Preemption { kRecompute, kSwap } preemption = Preemption::kRecompute;
  // A request waits for a lower-tier lookup at most this long plus tier_timeout_per_page_s a
  // page, then computes instead (the lookup's pages still land in the cache when they come).
  double tier_timeout_s = 1.0;
  double tier_timeout_per_page_s = 0.002;
  // Prompt tails (prefill/decode disaggregation, docs/disaggregation.md). The tier keeps full
  // pages; a prompt's last, partly filled page would be recomputed by whoever decodes it. A
  // prefill instance (kStore) writes that page too when its request ends, to the shared store
  // alone (TierManager::store_tail), keyed by the chain hash of the page with its unused slots
  // set to -1 (no full page has it); a decode instance (kFetch) asks for it in the lookup of the
  // full pages (not on its own), reads it once (it is removed) and computes only the prompt's
  // last token. A prompt that ends on a page boundary has a full last page, stored as any page.
  // Unquantized (unstaged) KV layouts only: a quantized layout keeps a filling page elsewhere.
  enum class PromptTails { kOff, kStore, kFetch } tier_prompt_tails = PromptTails::kOff;
  // Speculative decoding of requests that do not choose (engine/speculative.h); off by default.
  SpecConfig spec;
  // Jump-forward under a structured-output constraint: the tokens of the text the constraint
  // forces next (the rest of a key, a literal) go into the step as a draft, verified as any
  // draft, so a choice says them in one step instead of one step each (0: off). Exact: each
  // position is still drawn from the model's masked distribution.
  int32_t jump_forward_tokens = 16;
};

// Staging slots per quantized layer the engine's pool needs: one partly filled page per
// running sequence (forks of n > 1 included) plus the pages one step's tokens can fill.
inline int32_t staging_slots(const EngineConfig& cfg) {
  return cfg.max_num_seqs + cfg.max_n + cfg.max_num_batched_tokens / cfg.block_size + 4;
}

// Why submit() refused: an HTTP status and a message for the client.
struct Rejection {
  int32_t http_status = 0;  // 0: accepted
  std::string message;
  std::string param;        // the request field at fault, if any
};

class Engine {
 public:
  Engine(LlamaModel& model, const Tokenizer& tok, const EngineConfig& cfg);
  ~Engine();

  // Thread-safe. Validates against the limits (max_model_len, pool capacity, max_n, queue)
  // and enqueues. On rejection nothing is enqueued and the stream receives nothing.
  Rejection submit(Request req);
  // Several requests as one (completions' batch form: one per prompt): each is checked as
  // submit checks it, then all are queued, or none. The queue counts each as one request (as
  // submit counts a request of n choices); a batch larger than max_num_seqs + max_queue could
  // never be queued and is a 400. On a rejection *failed (if given) is the index of the request
  // at fault, -1 when it is the batch (the queue, its size).
  Rejection submit_all(std::vector<Request> reqs, int32_t* failed = nullptr);
  // A request refused at admission before it reached submit (the server's parser refuses
  // max_tokens alone past max_model_len): counted as submit counts its 400s
  // (kvserve:request_rejected_total{reason="invalid"}). Any thread.
  void count_rejection();
  uint64_t next_request_id() { return next_id_.fetch_add(1); }

  void start();  // engine thread runs step() until stop()
  void stop();
  // One iteration; returns false when there was nothing to do. Engine thread only.
  bool step();

  MetricsSnapshot metrics() const;           // thread-safe
  // Why the engine cannot serve as configured (e.g. --kv-disk-dir not writable), or ok.
  const Status& init_status() const { return init_status_; }
  // Waits until the tiers' queued writes are done (tests, shutdown). Thread-safe.
  void flush_tiers();
  // TierManager::write_mark / wait_written (true at once without tiers). Thread-safe.
  uint64_t tier_write_mark() const;
  bool wait_tier_writes(uint64_t mark, double timeout_s);
  uint64_t tier_lost_writes() const;  // TierManager::lost_writes (0 without tiers). Thread-safe.
  // Pool integrity, and every page's refcount equals the number of block-table entries
  // holding it. Thread-safe: waits for the current step to end.
  Status check_integrity() const;
  const EngineConfig& config() const { return cfg_; }
  const PagePool& pool() const { return *pool_; }
  const PagePool* pool_g1() const { return pool_g1_.get(); }  // hybrid models, else null
  // Pages held by requests (block tables). Cached-only pages (held by the prefix cache alone)
  // are not "in use": they are reclaimable. Thread-safe.
  int32_t pages_in_use() const { return pages_in_use_.load(); }
  int32_t pages_cached() const { return pages_cached_.load(); }
  // Hybrid models: sliding-window pages held by the prefix cache (pages_in_use counts both pools).
  int32_t window_pages_cached() const { return window_pages_cached_.load(); }
  // The KV dashboard's snapshots (kv_snapshot.h): while subscribed, the engine thread publishes
  // one at the end of a step at most every 250 ms. Thread-safe.
  SnapshotFeed& dashboard_feed() const { return dash_.feed(); }

 private:
  struct Sequence;
  struct Plan;
  void drain_incoming();
  // submit's checks of one request against the limits (not the queue); status 0: it may run.
  Rejection check_request(const Request& req) const;
  bool schedule(Plan* plan);
  bool ensure_pages(Sequence& s, int64_t n_new);
  void preempt(Sequence& s);
  // StreamingLLM re-indexing (kv/kv_reindex.h) of a sequence whose next position is
  // max_model_len: false when a shared page found no room for its copy (try again next step).
  bool reindex(Sequence& s);
  // Whether s may go past max_model_len: an evicting policy whose budget is below it.
  bool goes_past_context(const Sequence& s) const;
  void postprocess(Plan& plan, const float* logits);
  void sample_all(int32_t n_vocab);  // draws_[i].token (and logprobs) for every draw, on the pool
  void prompt_logprobs_all(int32_t n_vocab);  // every prompt_rows_ entry, on the pool
  void finish(Sequence& s, const char* reason);
  // finish()'s events: s's kFinish, and its siblings' when n > 1 and they were never forked.
  void push_finish(Sequence& s, const char* reason);
  void release(Sequence& s);  // hands full pages to the prefix cache, then frees the table
  void publish(Sequence& s);  // hands newly completed full pages to the prefix cache
  bool admit(Sequence& s, int64_t budget, int32_t* n_out);
  int32_t prefill_chunk(const Sequence& s, int64_t want) const;  // a prompt chunk within the pages' room
  std::list<std::unique_ptr<Sequence>>::iterator pick_waiting();
  void publish_gauges();
  void maybe_finish_request(Sequence& s);  // the last choice is done: queues the stream's end
  void end_finished_streams();              // ends the queued streams (after publish_gauges)
  Sequence* fork(Sequence& parent, int32_t index);
  // The KV policy a request runs under: its own, or the server's default (a request's Quest
  // reads on a cold-page server keep the cold pages and the server's RAM budget).
  EvictionConfig policy_of(const RequestParams& p) const;
  void annotate(Sequence& s, BatchSeq& b);  // eviction scores / sparse reads for s's run
  void maybe_evict(Sequence& s, int32_t n_run);
  // Evicts what the policy says now (prompt_end: also between page boundaries).
  void evict_now(Sequence& s, bool prompt_end);
  void record_kv_outcome(Sequence& s);
  void lookup_tiers();        // starts lower-tier lookups for waiting requests (RAM misses)
  void install_tier_pages();  // pages the lookups found: into the pool and the prefix cache
  void swap_out(Sequence& s); // preemption in swap mode: the full pages go to the tiers
  // Prompt tails (EngineConfig::tier_prompt_tails): the tail's length t (tokens [n_prompt - t,
  // n_prompt)), 0 when the sequence has none worth moving (t < 2, or a policy or layout that
  // rules it out); with tokens, the prompt's tokens through its last page, unused slots -1.
  int32_t prompt_tail(const Sequence& s, std::vector<int32_t>* tokens = nullptr) const;
  void store_prompt_tail(Sequence& s);                       // prefill side, as its request ends
  void store_finished_path(const Sequence& s);               // write-through: as a sequence ends
  bool install_prompt_tail(Sequence& s, int64_t n_matched);  // decode side, in admit()
  // admit(): the match's partly matching page copied into a page of s's own, its first
  // n_partial slots kept (PrefixMatch::n_partial). False: s computes those tokens.
  bool copy_partial_page(Sequence& s, const PrefixMatch& m);
  // Speculative decoding: s.draft for this step (at most k_cap tokens, none when s cannot
  // speculate); then, after the verification forward, the accepted prefix's bookkeeping.
  // k_cap: the most draft tokens (max_batch_tokens' room and the decodes' last row tile's);
  // n_decoding: the step's decoding sequences.
  int32_t make_draft(Sequence& s, int32_t k_cap, int32_t n_decoding);
  void settle_draft(Sequence& s, int32_t n_accepted);
  void loop();
  // KV dashboard (kv_snapshot.h): this step's runs into the timelines; a snapshot when one is due.
  void note_runs(const Plan& plan, std::chrono::steady_clock::time_point t0);
  void publish_dashboard(std::chrono::steady_clock::time_point started);

  LlamaModel& model_;
  const Tokenizer& tok_;
  EngineConfig cfg_;
  std::unique_ptr<PagePool> pool_;
  std::unique_ptr<PagePool> pool_g1_;  // hybrid models: the sliding-window layers' pages
  int32_t window_g1_ = 0;
  void slide(Sequence& s);
  std::unique_ptr<PrefixCache> cache_;  // after pool_: destroyed first, releasing into the pool
  std::unique_ptr<TierManager> tiers_;  // after cache_: destroyed before it
  std::unordered_set<uint64_t> tail_tickets_;  // tier lookups whose last page is a prompt tail
  int64_t cold_no_room_told_ = 0;        // kv_cold_no_room_total when last logged
  std::chrono::steady_clock::time_point cold_no_room_told_at_{};
  std::unique_ptr<ColdStore> cold_;     // --kv-offload-cold: pages of live sequences beyond their budget
  void attach_cold(Sequence& s);        // s's cold table, when its policy offloads
  void maybe_offload(Sequence& s);      // after a run: s's cold pages down to its budget
  void cut_prefix(Sequence& s, int64_t first_gone_page);  // pages from there on are never published
  int64_t cold_cap(const Sequence& s, int64_t n) const;  // a run's length within s's RAM budget
  int64_t cold_extra(const Sequence& t, int64_t n_new) const;  // pages past t's budget one layer's reads may hold
  // Pages kept free for the cold pages the running sequences read back during a step, s's own
  // (running n_new more tokens) included; s null: the running ones' alone (ColdStore::keep_free).
  int64_t cold_reserve(const Sequence* s, int64_t n_new) const;
  Status init_status_;
  std::atomic<bool> tier_ready_{false};  // a lookup finished: step again
  std::unique_ptr<ThreadPool> threads_;
  Metrics metrics_;
  mutable DashboardRecorder dash_;  // engine thread, but for its feed

  // Submission queue (any thread → engine thread).
  mutable std::mutex in_mu_;
  std::condition_variable in_cv_;
  std::deque<Request> incoming_;
  std::atomic<int32_t> n_waiting_total_{0};  // incoming + waiting, for the 429 check
  // running_.size() for the 429 check: stored where running_ grows (admission, forks), so submit
  // never counts a slot twice, and at each step's end (publish_gauges), where it shrinks: a stale,
  // larger count in between only refuses sooner.
  std::atomic<int32_t> n_running_seqs_{0};

  // Engine-thread state; state_mu_ is held for a whole step so other threads can inspect it.
  mutable std::mutex state_mu_;
  mutable std::atomic<int32_t> inspectors_{0};  // threads waiting for state_mu_
  std::list<std::unique_ptr<Sequence>> waiting_;   // FCFS; preempted go to the front
  std::list<std::unique_ptr<Sequence>> running_;   // admission order (oldest first)
  std::vector<float> logits_;
  // Tokens to draw this step: a sequence and its logit rows (forks share their parent's). A
  // speculative run has one row per position: row i verifies draft token i (engine/speculative.h).
  struct Draw {
    Sequence* seq;
    const float* logits;  // [n_rows][n_vocab]
    int32_t n_rows = 1;
    std::vector<int32_t> out;         // the tokens drawn (accepted drafts, then one more)
    std::vector<TokenLogprob> lps;    // one per token of `out` (logprobs ≥ 0 only)
  };
  std::vector<Draw> draws_;
  // This step's prompt-logprob rows (RequestParams::prompt_logprobs): a row, the prompt token it
  // predicts, the top k asked for, and where its entry goes (the request's prompt_lps).
  struct PromptRow {
    const float* logits;
    int32_t token;
    int32_t k;
    TokenLogprob* out;
  };
  std::vector<PromptRow> prompt_rows_;
  struct SampleWorkspace {
    std::vector<float> row;  // [n_vocab] the row the sampler may rewrite
    SamplerScratch sampler;
    LogprobScratch logprob;
  };
  std::vector<SampleWorkspace> sample_ws_;  // one per pool thread
  std::unique_ptr<SuffixCache> suffix_cache_;  // suffix drafts: recent outputs per namespace
  bool staged_kv_ = false;                     // some layer quantizes pages when they fill
  double sample_seconds_ = 0;               // this step's sampling time, for the step profile
  std::atomic<int32_t> pages_in_use_{0};
  std::atomic<int32_t> pages_cached_{0};
  std::atomic<int32_t> window_pages_cached_{0};
  std::vector<int32_t> held_scratch_;  // [n_pages], reused by publish_gauges
  std::vector<std::pair<std::shared_ptr<RequestStream>, Usage>> finishing_;  // this step's finished requests
  static constexpr int kLpmWindow = 64;
  static constexpr int kLpmMaxSkips = 8;
  std::atomic<uint64_t> next_id_{1};
  uint64_t next_seq_id_ = 1;

  std::thread thread_;
  std::atomic<bool> stop_{false};
};

}  // namespace kv
