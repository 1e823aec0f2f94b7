#include "engine/metrics.h"

#include <cstdio>

namespace kv {

void Histogram::observe(double v) {
  size_t i = 0;
  while (i < bounds_.size() && v > bounds_[i]) ++i;
  ++counts_[i];
  sum_ += v;
  ++count_;
}

const char* step_phase_name(StepPhase p) {
  switch (p) {
    case StepPhase::kSchedule: return "schedule";
    case StepPhase::kMatmul: return "forward_matmul";
    case StepPhase::kAttention: return "forward_attention";
    case StepPhase::kLogits: return "forward_logits";
    case StepPhase::kSample: return "sample";
    case StepPhase::kPostprocess: return "postprocess";
    case StepPhase::kCount: break;
  }
  return "?";
}

Metrics::Metrics() {
  // Buckets as vLLM uses for the same series (seconds).
  m_.ttft = Histogram({0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0});
  m_.itl = Histogram({0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0});
  // Step phases span a few microseconds (scheduling one decode) to seconds (a long prefill).
  for (int i = 0; i < kNumStepPhases; ++i)
    m_.step_phase.push_back(Histogram({1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5}));
  m_.kv_kept_tokens = Histogram({64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072});
  m_.e2e = Histogram({0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0});
  m_.queue_time = m_.prefill_time = m_.decode_time = m_.inference_time = m_.e2e;  // vLLM's request_*_time buckets are e2e's
  // vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to past the longest context.
  std::vector<double> counts;
  for (double d = 1; d <= 1e6; d *= 10)
    for (double m : {1.0, 2.0, 5.0}) counts.push_back(d * m);
  m_.request_prompt_tokens = m_.request_generation_tokens = Histogram(counts);
}

void Metrics::set_gauges(int64_t running, int64_t waiting, int64_t pages_total, int64_t pages_used) {
  std::lock_guard<std::mutex> l(mu_);
  m_.num_requests_running = running;
  m_.num_requests_waiting = waiting;
  m_.kv_pages_total = pages_total;
  m_.kv_pages_used = pages_used;
  m_.kv_cache_usage_perc = pages_total > 0 ? double(pages_used) / pages_total : 0;
}
void Metrics::set_prefix_cache(int64_t queries, int64_t hits, int64_t evictions, int64_t cached_pages, int64_t window_pages,
                               int64_t window_evictions, int64_t partial_hits) {
  std::lock_guard<std::mutex> l(mu_);
  m_.prefix_cache_queries_total = queries;
  m_.prefix_cache_hits_total = hits;
  m_.prefix_cache_partial_hits_total = partial_hits;
  m_.prefix_cache_evictions_total = evictions;
  m_.prefix_cache_cached_pages = cached_pages;
  m_.prefix_cache_window_pages = window_pages;
  m_.prefix_cache_window_evictions_total = window_evictions;
}
void Metrics::add_preemption() { std::lock_guard<std::mutex> l(mu_); ++m_.num_preemptions_total; }
void Metrics::add_spec(int32_t n_draft, int32_t n_accepted) {
  std::lock_guard<std::mutex> l(mu_);
  ++m_.spec_drafts_total;
  m_.spec_draft_tokens_total += n_draft;
  m_.spec_accepted_tokens_total += n_accepted;
  if (static_cast<int32_t>(m_.spec_accepted_per_pos.size()) < n_draft) m_.spec_accepted_per_pos.resize(n_draft, 0);
  for (int32_t i = 0; i < n_accepted; ++i) ++m_.spec_accepted_per_pos[i];
}
void Metrics::add_jump_forward(int32_t n_draft, int32_t n_accepted) {
  std::lock_guard<std::mutex> l(mu_);
  m_.jump_forward_draft_tokens_total += n_draft;
  m_.jump_forward_accepted_tokens_total += n_accepted;
}
void Metrics::add_tier_loaded_pages(int64_t n) {
  std::lock_guard<std::mutex> l(mu_);
  m_.tier_loaded_pages_total += n;
}
void Metrics::add_tier_load_timeout() {
  std::lock_guard<std::mutex> l(mu_);
  ++m_.tier_load_timeouts_total;
}
void Metrics::add_tier_tail(TailEvent e) {
  std::lock_guard<std::mutex> l(mu_);
  ++m_.tier_tails_total[static_cast<int>(e)];
}
void Metrics::add_evicted_tokens(int64_t n) { std::lock_guard<std::mutex> l(mu_); m_.kv_evicted_tokens_total += n; }
void Metrics::add_reindexed_tokens(int64_t n, bool by_preemption) {
  std::lock_guard<std::mutex> l(mu_);
  m_.kv_reindexed_tokens_total += n;
  m_.kv_reindex_preemptions_total += by_preemption;
}
void Metrics::observe_kv_kept(int64_t tokens) { std::lock_guard<std::mutex> l(mu_); m_.kv_kept_tokens.observe(double(tokens)); }
void Metrics::add_prompt_tokens(int64_t n) { std::lock_guard<std::mutex> l(mu_); m_.prompt_tokens_total += n; }
void Metrics::add_generation_tokens(int64_t n) { std::lock_guard<std::mutex> l(mu_); m_.generation_tokens_total += n; }
void Metrics::add_finished(FinishReason reason, CancelReason aborted) {
  std::lock_guard<std::mutex> l(mu_);
  if (aborted != CancelReason::kNone) {
    ++m_.request_aborted_total[static_cast<int>(aborted)];
    reason = FinishReason::kAbort;
  }
  ++m_.request_success_total[static_cast<int>(reason)];
}
void Metrics::add_rejected(bool queue_full) {
  std::lock_guard<std::mutex> l(mu_);
  ++m_.request_rejected_total;
  if (queue_full) ++m_.request_rejected_queue_full;
}
void Metrics::observe_ttft(double s) { std::lock_guard<std::mutex> l(mu_); m_.ttft.observe(s); }
void Metrics::observe_itl(double s) { std::lock_guard<std::mutex> l(mu_); m_.itl.observe(s); }
void Metrics::observe_e2e(double s) { std::lock_guard<std::mutex> l(mu_); m_.e2e.observe(s); }
void Metrics::observe_request(double queue_s, double prefill_s, double decode_s, double inference_s, int64_t prompt_tokens,
                              int64_t generation_tokens) {
  std::lock_guard<std::mutex> l(mu_);
  if (queue_s >= 0) m_.queue_time.observe(queue_s);
  if (prefill_s >= 0) m_.prefill_time.observe(prefill_s);
  if (decode_s >= 0) m_.decode_time.observe(decode_s);
  if (inference_s >= 0) m_.inference_time.observe(inference_s);
  m_.request_prompt_tokens.observe(double(prompt_tokens));
  m_.request_generation_tokens.observe(double(generation_tokens));
}
void Metrics::observe_step(const double* phase_seconds) {
  std::lock_guard<std::mutex> l(mu_);
  for (int i = 0; i < kNumStepPhases; ++i) m_.step_phase[i].observe(phase_seconds[i]);
  ++m_.steps_total;
}
MetricsSnapshot Metrics::snapshot() const { std::lock_guard<std::mutex> l(mu_); return m_; }

namespace {
// A counter with one label: HELP and TYPE once, then a line per label value.
void labelled_counter(std::string& out, const char* name, const char* help, const char* label,
                      const std::vector<std::pair<const char*, int64_t>>& values) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n# TYPE ").append(name).append(" counter\n");
  for (const auto& [value, n] : values)
    out.append(name).append("{").append(label).append("=\"").append(value).append("\"} ").append(std::to_string(n)).append("\n");
}

// HELP texts of any length (a fixed buffer once cut a long one, and the value line with it).
void series(std::string& out, const char* type, const char* name, const char* help, double v) {
  char value[32];
  std::snprintf(value, sizeof value, "%.17g", v);
  out.append("# HELP ").append(name).append(" ").append(help).append("\n# TYPE ").append(name).append(" ").append(type);
  out.append("\n").append(name).append(" ").append(value).append("\n");
}
void gauge(std::string& out, const char* name, const char* help, double v) { series(out, "gauge", name, help, v); }
void counter(std::string& out, const char* name, const char* help, double v) { series(out, "counter", name, help, v); }
// The series of one histogram; label is "" or `key="value",` (placed before le).
void histogram_series(std::string& out, const char* name, const std::string& label, const Histogram& h) {
  char buf[320];
  uint64_t cum = 0;
  for (size_t i = 0; i < h.counts().size(); ++i) {
    cum += h.counts()[i];
    if (i < h.bounds().size())
      std::snprintf(buf, sizeof buf, "%s_bucket{%sle=\"%g\"} %llu\n", name, label.c_str(), h.bounds()[i], static_cast<unsigned long long>(cum));
    else
      std::snprintf(buf, sizeof buf, "%s_bucket{%sle=\"+Inf\"} %llu\n", name, label.c_str(), static_cast<unsigned long long>(cum));
    out += buf;
  }
  std::string braces;  // appended ("{" + std::string&& tripped GCC 12's -Wrestrict)
  if (!label.empty()) braces.append("{").append(label, 0, label.size() - 1).append("}");
  std::snprintf(buf, sizeof buf, "%s_sum%s %.17g\n%s_count%s %llu\n", name, braces.c_str(), h.sum(), name, braces.c_str(),
                static_cast<unsigned long long>(h.count()));
  out += buf;
}
void histogram(std::string& out, const char* name, const char* help, const Histogram& h) {
  out.append("# HELP ").append(name).append(" ").append(help).append("\n# TYPE ").append(name).append(" histogram\n");
  histogram_series(out, name, "", h);
}
}  // namespace

std::string render_prometheus(const MetricsSnapshot& m) {
  std::string out;
  gauge(out, "kvserve:num_requests_running", "Sequences in the running batch.", double(m.num_requests_running));
  gauge(out, "kvserve:num_requests_waiting", "Requests waiting to be scheduled.", double(m.num_requests_waiting));
  gauge(out, "kvserve:kv_cache_usage_perc", "Fraction of KV pages in use (1 = full).", m.kv_cache_usage_perc);
  gauge(out, "kvserve:kv_cache_pages_total", "KV pages in the pool (hybrid models: the global layers' pool).", double(m.kv_pages_total));
  gauge(out, "kvserve:kv_cache_pages_used", "KV pages held by sequences (hybrid models: in the global layers' pool).", double(m.kv_pages_used));
  counter(out, "kvserve:num_preemptions_total", "Sequences preempted for lack of KV pages.", double(m.num_preemptions_total));
  counter(out, "kvserve:kv_evicted_tokens_total", "Tokens whose KV a long-context policy (--kv-eviction) evicted.",
          double(m.kv_evicted_tokens_total));
  counter(out, "kvserve:kv_reindexed_tokens_total",
          "Positions given back by re-indexing sequences that went past max_model_len (StreamingLLM; --kv-eviction).",
          double(m.kv_reindexed_tokens_total));
  counter(out, "kvserve:kv_reindex_preemptions_total",
          "Sequences preempted at max_model_len: their evicted tokens dropped, the kept ones recomputed at re-indexed positions.",
          double(m.kv_reindex_preemptions_total));
  counter(out, "kvserve:prompt_tokens_total", "Prompt tokens computed (prefill work: prefix-cache and tier hits are not counted; after a preemption, prompt tokens computed again are, generated tokens computed again are not; vLLM's counts every prompt token once).", double(m.prompt_tokens_total));
  counter(out, "kvserve:generation_tokens_total", "Tokens generated.", double(m.generation_tokens_total));
  // vLLM's series: one per finished_reason, each present from the start (a rate over a series that
  // appears only at its first request misses that request).
  std::vector<std::pair<const char*, int64_t>> finished;
  for (FinishReason r : {FinishReason::kStop, FinishReason::kLength, FinishReason::kAbort})
    finished.push_back({finish_reason_name(r), m.request_success_total[static_cast<int>(r)]});
  labelled_counter(out, "kvserve:request_success_total",
                   "Requests finished, by finished_reason (vLLM's): a stop condition (stop: end of text, a stop string or "
                   "stop_token_ids), the length limit (length: max_tokens or max_model_len; a request of n choices counts "
                   "once, as length if any of its choices was cut), or cancelled (abort: the causes in "
                   "kvserve:request_aborted_total).",
                   "finished_reason", finished);
  std::vector<std::pair<const char*, int64_t>> aborted;
  for (CancelReason r : {CancelReason::kClient, CancelReason::kTimeout, CancelReason::kShutdown, CancelReason::kError})
    aborted.push_back({cancel_reason_name(r), m.request_aborted_total[static_cast<int>(r)]});
  labelled_counter(out, "kvserve:request_aborted_total",
                   "Requests cancelled before they finished, by reason: the client went away (client), --request-timeout "
                   "passed (timeout), the server shut down (shutdown), or the forward failed (error).",
                   "reason", aborted);
  // By reason (a user test: an alert on refusals mixed an overload with requests that can never run).
  labelled_counter(out, "kvserve:request_rejected_total",
                   "Requests refused at admission, by reason: the queue was full (queue_full, 429: --max-queue), or the "
                   "request can never run here (invalid, 400: prompt + max_tokens past max_model_len, max_tokens alone "
                   "past it included, more KV than the cache holds, a batch over --max-num-seqs + --max-queue, a KV policy "
                   "the server cannot apply). Other malformed requests are not counted.",
                   "reason", {{"queue_full", m.request_rejected_queue_full}, {"invalid", m.request_rejected_total - m.request_rejected_queue_full}});
  counter(out, "kvserve:prefix_cache_queries_total", "Prompt tokens looked up in the prefix cache.", double(m.prefix_cache_queries_total));
  counter(out, "kvserve:prefix_cache_hits_total", "Prompt tokens found in the prefix cache.", double(m.prefix_cache_hits_total));
  counter(out, "kvserve:prefix_cache_partial_hits_total",
          "Of the prompt tokens found in the prefix cache, those copied from a partly matching page (copy-on-write).",
          double(m.prefix_cache_partial_hits_total));
  counter(out, "kvserve:prefix_cache_evictions_total", "KV pages evicted from the prefix cache.", double(m.prefix_cache_evictions_total));
  gauge(out, "kvserve:prefix_cache_cached_pages", "KV pages held by the prefix cache.", double(m.prefix_cache_cached_pages));
  gauge(out, "kvserve:prefix_cache_window_pages", "Sliding-window layers' KV pages held by the prefix cache (hybrid models).",
        double(m.prefix_cache_window_pages));
  counter(out, "kvserve:prefix_cache_window_evictions_total",
          "Sliding-window layers' KV pages dropped from the prefix cache (hybrid models).", double(m.prefix_cache_window_evictions_total));
  histogram(out, "kvserve:time_to_first_token_seconds", "Time to first token.", m.ttft);
  histogram(out, "kvserve:inter_token_latency_seconds", "Time between tokens of a sequence.", m.itl);
  histogram(out, "kvserve:e2e_request_latency_seconds", "Request latency from arrival to finish.", m.e2e);
  histogram(out, "kvserve:request_queue_time_seconds", "Time a request waited before it was first scheduled.", m.queue_time);
  histogram(out, "kvserve:request_prefill_time_seconds", "Time from a request's first scheduling to its first token.", m.prefill_time);
  histogram(out, "kvserve:request_decode_time_seconds", "Time from a request's first token to its finish.", m.decode_time);
  histogram(out, "kvserve:request_inference_time_seconds", "Time from a request's first scheduling to its finish.", m.inference_time);
  histogram(out, "kvserve:request_prompt_tokens", "Prompt tokens per finished request.", m.request_prompt_tokens);
  histogram(out, "kvserve:request_generation_tokens", "Generated tokens per finished request (all its choices).", m.request_generation_tokens);
  histogram(out, "kvserve:kv_kept_tokens", "Tokens of KV kept per finished sequence under an eviction policy.", m.kv_kept_tokens);
  if (!m.step_phase.empty()) {
    const char* name = "kvserve:step_phase_seconds";
    out += std::string("# HELP ") + name +
           " Seconds of each engine step spent per phase: schedule, forward_matmul (matmuls, norms, activations), "
           "forward_attention (RoPE, KV writes, paged attention), forward_logits (output projection), sample, postprocess "
           "(detokenize, stop strings, streaming, gauges).\n# TYPE " + name + " histogram\n";
    for (int i = 0; i < kNumStepPhases; ++i)
      histogram_series(out, name, std::string("phase=\"") + step_phase_name(static_cast<StepPhase>(i)) + "\",", m.step_phase[i]);
  }
  counter(out, "kvserve:engine_steps_total", "Engine steps that ran a forward pass.", double(m.steps_total));
  counter(out, "kvserve:spec_decode_num_drafts_total", "Speculative drafts verified.", double(m.spec_drafts_total));
  counter(out, "kvserve:spec_decode_num_draft_tokens_total", "Speculative draft tokens verified.", double(m.spec_draft_tokens_total));
  counter(out, "kvserve:spec_decode_num_accepted_tokens_total", "Speculative draft tokens accepted.",
          double(m.spec_accepted_tokens_total));
  counter(out, "kvserve:jump_forward_draft_tokens_total",
          "Tokens a structured-output constraint forced next (jump-forward), put into a step as a draft.",
          double(m.jump_forward_draft_tokens_total));
  counter(out, "kvserve:jump_forward_accepted_tokens_total", "Jump-forward draft tokens the model's draw took.",
          double(m.jump_forward_accepted_tokens_total));
  if (!m.spec_accepted_per_pos.empty()) {
    const char* name = "kvserve:spec_decode_num_accepted_tokens_per_pos_total";
    out += std::string("# HELP ") + name + " Speculative draft tokens accepted, per position in the draft (0 = first).\n# TYPE " +
           name + " counter\n";
    for (size_t i = 0; i < m.spec_accepted_per_pos.size(); ++i)
      out += std::string(name) + "{position=\"" + std::to_string(i) + "\"} " + std::to_string(m.spec_accepted_per_pos[i]) + "\n";
  }
  if (m.has_cold) {
    const ColdStats& c = m.cold;
    gauge(out, "kvserve:kv_cold_pages", "KV pages of live sequences held in the cold spill file (L2) instead of RAM.", double(c.slots_used));
    gauge(out, "kvserve:kv_cold_file_bytes", "Size of the cold-page spill file.", double(c.file_bytes));
    counter(out, "kvserve:kv_cold_pages_out_total", "KV pages written to the cold spill file.", double(c.pages_out));
    counter(out, "kvserve:kv_cold_pages_in_total", "Cold KV pages read back into RAM because Quest picked them.", double(c.pages_in));
    counter(out, "kvserve:kv_cold_prefetches_total", "Cold KV pages read ahead (the runners-up of a Quest selection).", double(c.prefetches));
    counter(out, "kvserve:kv_cold_prefetch_hits_total", "Cold-page fetches served from a page read ahead.", double(c.prefetch_hits));
    counter(out, "kvserve:kv_cold_bytes_in_total", "Bytes read from the cold spill file.", double(c.bytes_in));
    counter(out, "kvserve:kv_cold_bytes_out_total", "Bytes written to the cold spill file.", double(c.bytes_out));
    counter(out, "kvserve:kv_cold_errors_total", "Cold-page reads or writes that failed (the page was dropped, as if evicted).", double(c.errors));
    counter(out, "kvserve:kv_cold_no_room_total", "Cold-page fetches that found no free RAM page (the page was skipped for that step).",
            double(c.no_room));
    counter(out, "kvserve:kv_cold_room_swaps_total",
            "Resident KV pages a layer did not read, sent to the spill file mid-step to make room for a cold page it did.",
            double(c.room_swaps));
    counter(out, "kvserve:kv_cold_fetch_seconds_total", "Seconds spent bringing cold pages back into RAM.", c.fetch_seconds);
  }
  if (!m.tiers.empty()) {
    counter(out, "kvserve:kv_tier_loaded_pages_total", "KV pages copied from a lower tier (disk, Redis) into RAM.",
            double(m.tier_loaded_pages_total));
    counter(out, "kvserve:kv_tier_load_timeouts_total", "Lower-tier lookups a request stopped waiting for (it computed instead).",
            double(m.tier_load_timeouts_total));
    std::vector<std::pair<const char*, int64_t>> tails;
    for (TailEvent e : {TailEvent::kStored, TailEvent::kDropped, TailEvent::kLoaded, TailEvent::kUnused})
      tails.push_back({tail_event_name(e), m.tier_tails_total[static_cast<int>(e)]});
    labelled_counter(out, "kvserve:kv_tier_prompt_tails_total",
                     "Prompt tails (a prompt's partly filled last page): stored or dropped by a prefill instance; loaded "
                     "(installed instead of recomputed) or unused by a decode instance.",
                     "result", tails);
    struct Series {
      const char* name;
      const char* type;
      const char* help;
      int64_t TierStats::*field;
    };
    const Series series[] = {
        {"kvserve:kv_tier_hits_total", "counter", "KV pages found (and valid) in the tier.", &TierStats::hits},
        {"kvserve:kv_tier_misses_total", "counter", "Lookups that ended in the tier (a page absent or invalid).", &TierStats::misses},
        {"kvserve:kv_tier_bytes_in_total", "counter", "Bytes loaded from the tier.", &TierStats::bytes_in},
        {"kvserve:kv_tier_bytes_out_total", "counter", "Bytes written to the tier.", &TierStats::bytes_out},
        {"kvserve:kv_tier_pages_written_total", "counter", "KV pages written to the tier.", &TierStats::pages_written},
        {"kvserve:kv_tier_pages_refreshed_total", "counter",
         "KV pages written again that the tier still held: refreshed there, not sent (Redis).", &TierStats::pages_refreshed},
        {"kvserve:kv_tier_write_drops_total", "counter", "KV page writes given up (queue full, store down).", &TierStats::write_drops},
        {"kvserve:kv_tier_errors_total", "counter", "I/O and connection failures of the tier.", &TierStats::errors},
        {"kvserve:kv_tier_corrupt_total", "counter", "Stored pages that failed their checks (dropped and recomputed).",
         &TierStats::corrupt},
        {"kvserve:kv_tier_pages_stored", "gauge", "KV pages the tier holds (-1: unknown, a shared store).", &TierStats::pages_stored},
        {"kvserve:kv_tier_bytes_stored", "gauge", "Bytes the tier holds (-1: unknown, a shared store).", &TierStats::bytes_stored},
    };
    char buf[320];
    for (const Series& s : series) {
      std::snprintf(buf, sizeof buf, "# HELP %s %s\n# TYPE %s %s\n", s.name, s.help, s.name, s.type);
      out += buf;
      for (const auto& t : m.tiers) {
        std::snprintf(buf, sizeof buf, "%s{tier=\"%s\"} %lld\n", s.name, t.s.tier.c_str(), static_cast<long long>(t.s.*s.field));
        out += buf;
      }
    }
    const char* name = "kvserve:kv_tier_load_seconds";
    out += std::string("# HELP ") + name + " Seconds per lookup that found KV pages in the tier.\n# TYPE " + name + " histogram\n";
    for (const auto& t : m.tiers) histogram_series(out, name, "tier=\"" + t.s.tier + "\",", t.load);
  }
  return out;
}

}  // namespace kv
