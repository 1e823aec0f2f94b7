// Engine counters and latency histograms. The engine owns them (it is the one that knows);
// /metrics only reads a snapshot and renders it in Prometheus text format, names in vLLM's
// style (kvserve:...).
#pragma once
#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "engine/request.h"
#include "kv/cold_store.h"
#include "kv/page_store.h"

namespace kv {

class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size() + 1, 0) {}
  // A histogram kept elsewhere (counts per bucket, last = +Inf).
  Histogram(std::vector<double> bounds, std::vector<uint64_t> counts, double sum, uint64_t count)
      : bounds_(std::move(bounds)), counts_(std::move(counts)), sum_(sum), count_(count) {}
  void observe(double v);
  const std::vector<double>& bounds() const { return bounds_; }
  const std::vector<uint64_t>& counts() const { return counts_; }  // per bucket, last = +Inf
  double sum() const { return sum_; }
  uint64_t count() const { return count_; }

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;
  double sum_ = 0;
  uint64_t count_ = 0;
};

// The phases of one engine step, in order. The forward's share is split three ways by the
// model's own timers (LlamaModel::ForwardTimes).
enum class StepPhase { kSchedule, kMatmul, kAttention, kLogits, kSample, kPostprocess, kCount };
const char* step_phase_name(StepPhase p);
inline constexpr int kNumStepPhases = static_cast<int>(StepPhase::kCount);

// Prompt tails (engine.h, EngineConfig::tier_prompt_tails): the prefill side stored one (or
// dropped it: the write queue was full); the decode side installed one, or found it but could not
// use it (the full pages before it were gone by admission).
enum class TailEvent { kStored, kDropped, kLoaded, kUnused };
inline const char* tail_event_name(TailEvent e) {
  static const char* const names[] = {"stored", "dropped", "loaded", "unused"};
  return names[static_cast<int>(e)];
}

// Why a request finished, as vLLM's finished_reason label spells it (kvserve:request_success_total):
// its stop condition, its length limit (max_tokens or max_model_len), or cancelled (any CancelReason).
enum class FinishReason { kStop, kLength, kAbort };
inline constexpr int kNumFinishReasons = 3;
inline const char* finish_reason_name(FinishReason r) {
  static const char* const names[] = {"stop", "length", "abort"};
  return names[static_cast<int>(r)];
}

struct MetricsSnapshot {
  int64_t num_requests_running = 0;
  int64_t num_requests_waiting = 0;
  int64_t kv_pages_total = 0;
  int64_t kv_pages_used = 0;
  double kv_cache_usage_perc = 0;  // 0..1, as vLLM reports it
  int64_t num_preemptions_total = 0;
  int64_t prompt_tokens_total = 0;
  int64_t generation_tokens_total = 0;
  int64_t request_success_total[kNumFinishReasons] = {};  // finished requests by FinishReason (aborted ones too, as vLLM)
  int64_t request_rejected_total = 0;        // every refusal at admission
  int64_t request_rejected_queue_full = 0;   // of which 429s: the queue (--max-queue) was full
  int64_t request_aborted_total[kNumCancelReasons] = {};  // by CancelReason
  // Owned by the prefix cache, copied here each step.
  int64_t prefix_cache_queries_total = 0;   // prompt tokens looked up
  int64_t prefix_cache_hits_total = 0;      // of those, tokens found cached
  int64_t prefix_cache_partial_hits_total = 0;  // of those, copied from a partly matching page
  int64_t prefix_cache_evictions_total = 0; // pages evicted
  int64_t prefix_cache_cached_pages = 0;
  // Hybrid models: the sliding-window layers' pages the cache holds, and those dropped alone.
  int64_t prefix_cache_window_pages = 0;
  int64_t prefix_cache_window_evictions_total = 0;
  int64_t kv_evicted_tokens_total = 0;  // tokens whose KV a long-context policy evicted
  int64_t kv_reindexed_tokens_total = 0;  // positions given back by re-indexing past max_model_len
  int64_t kv_reindex_preemptions_total = 0;  // of those, by preempting at the limit and recomputing
  Histogram ttft{{}}, itl{{}}, e2e{{}};
  // vLLM's per-request phases (seconds): waiting before first scheduled, scheduled to first
  // token, first token to finish, scheduled to finish; and its per-request token counts.
  Histogram queue_time{{}}, prefill_time{{}}, decode_time{{}}, inference_time{{}};
  Histogram request_prompt_tokens{{}}, request_generation_tokens{{}};
  Histogram kv_kept_tokens{{}};       // per finished sequence under an eviction policy
  std::vector<Histogram> step_phase;  // [kNumStepPhases] seconds per step and phase
  // KV tiers below RAM (kv/tier_manager.h), one entry per store; empty without tiers.
  struct Tier {
    TierStats s;
    Histogram load{{}};  // seconds per lookup that found pages in this tier
  };
  std::vector<Tier> tiers;
  int64_t tier_loaded_pages_total = 0;   // pages copied from a lower tier into the pool
  int64_t tier_load_timeouts_total = 0;  // lookups a request stopped waiting for
  // Prompt tails (P/D): the partly filled last page of a prompt, stored by a prefill instance
  // and installed by a decode instance (engine.h, EngineConfig::tier_prompt_tails).
  int64_t tier_tails_total[4] = {};  // by TailEvent
  // Hot and cold pages of live sequences (kv/cold_store.h); has_cold: --kv-offload-cold is on.
  bool has_cold = false;
  ColdStats cold;
  uint64_t steps_total = 0;           // steps that ran a forward
  // Speculative decoding (vLLM's spec_decode_* names): drafts verified, their tokens, the
  // tokens accepted, and accepted tokens per draft position (index 0 = the first draft token).
  int64_t spec_drafts_total = 0;
  int64_t spec_draft_tokens_total = 0;
  int64_t spec_accepted_tokens_total = 0;
  std::vector<int64_t> spec_accepted_per_pos;
  // Jump-forward under structured outputs: the constraint's forced tokens put into a step, and
  // those the model took (not counted as speculative drafts).
  int64_t jump_forward_draft_tokens_total = 0;
  int64_t jump_forward_accepted_tokens_total = 0;
};

std::string render_prometheus(const MetricsSnapshot& m);

class Metrics {
 public:
  Metrics();
  // All mutators are engine-thread only except rejections (submit runs on HTTP threads);
  // the mutex makes snapshots consistent.
  void set_gauges(int64_t running, int64_t waiting, int64_t pages_total, int64_t pages_used);
  void set_prefix_cache(int64_t queries, int64_t hits, int64_t evictions, int64_t cached_pages, int64_t window_pages = 0,
                        int64_t window_evictions = 0, int64_t partial_hits = 0);
  void add_preemption();
  void add_spec(int32_t n_draft, int32_t n_accepted);  // one verified draft
  void add_jump_forward(int32_t n_draft, int32_t n_accepted);  // one verified forced draft
  void add_evicted_tokens(int64_t n);
  void add_reindexed_tokens(int64_t n, bool by_preemption = false);
  void add_tier_loaded_pages(int64_t n);
  void add_tier_load_timeout();
  void add_tier_tail(TailEvent e);
  void observe_kv_kept(int64_t tokens);
  void add_prompt_tokens(int64_t n);
  void add_generation_tokens(int64_t n);
  // A finished request: counted by reason (kAbort when `aborted` is not kNone, whatever `reason`
  // says) and, when aborted, by its CancelReason too.
  void add_finished(FinishReason reason, CancelReason aborted);
  void add_rejected(bool queue_full);
  void observe_ttft(double s);
  void observe_itl(double s);
  void observe_e2e(double s);
  // A finished request's phases (a negative time: it never reached that phase) and token counts.
  void observe_request(double queue_s, double prefill_s, double decode_s, double inference_s, int64_t prompt_tokens,
                       int64_t generation_tokens);
  // One step's seconds per phase ([kNumStepPhases], indexed by StepPhase).
  void observe_step(const double* phase_seconds);
  MetricsSnapshot snapshot() const;

 private:
  mutable std::mutex mu_;
  MetricsSnapshot m_;
};

}  // namespace kv
