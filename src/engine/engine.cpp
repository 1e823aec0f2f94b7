#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <optional>

#include <xxhash.h>

#include "common/units.h"
#include "engine/sampler.h"
#include "kernels/attention.h"
#include "kernels/matmul.h"
#include "kernels/ops.h"
#include "kv/kv_reindex.h"

namespace kv {

using Clock = std::chrono::steady_clock;

namespace {
double seconds(Clock::time_point a, Clock::time_point b) { return std::chrono::duration<double>(b - a).count(); }

// Longest suffix of `text` that is a proper prefix of some stop string: that much must be
// held back, since the next token may complete the stop string.
size_t stop_holdback(const std::string& text, const std::vector<std::string>& stops) {
  size_t keep = 0;
  for (const auto& s : stops)
    for (size_t k = std::min(text.size(), s.size() - 1); k > keep; --k)
      if (text.compare(text.size() - k, k, s, 0, k) == 0) {
        keep = k;
        break;
      }
  return keep;
}

// One row's entry for the logprobs: the model's log-probability of `tok` (the raw logits'
// log-softmax: the exponentials by the sampler's vector kernel, on a copy of the row, summed in
// double), the top k candidates (a structured output's masked -inf tokens are not candidates)
// and, with_rank, 1 + the tokens with a higher logit.
TokenLogprob row_logprob(const float* lg, int32_t nv, int32_t tok, int32_t k, bool with_rank, LogprobScratch* ws) {
  const float mx = max_value(lg, nv);
  ws->row.assign(lg, lg + nv);
  ws->blocks.resize(static_cast<size_t>((nv + kExpBlock - 1) / kExpBlock));
  const double lz = mx + std::log(exp_scaled(ws->row.data(), nv, mx, 1.f, ws->blocks.data()));  // log-partition of the raw logits
  std::vector<std::pair<float, int32_t>>* cand = &ws->cand;
  TokenLogprob tl;
  if (k > 0) {
    top_k_select(lg, nv, std::min(k, nv), cand);
    for (const auto& [v, id] : *cand)
      if (v != -std::numeric_limits<float>::infinity()) tl.top.emplace_back(id, static_cast<float>(double(v) - lz));
  }
  tl.token = tok;
  tl.logprob = static_cast<float>(double(lg[tok]) - lz);  // same arithmetic as `top`
  if (with_rank) {
    int32_t above = 0;
    for (int32_t v = 0; v < nv; ++v) above += lg[v] > lg[tok];
    tl.rank = above + 1;
  }
  return tl;
}

// Rows of prompt logprobs one step computes, at most (each is an n_vocab row of logits: 64 MiB
// of them, so Gemma 3's 262,144-token vocabulary gets 64 rows a step, SmolLM2's 341).
int64_t prompt_logit_rows_cap(int32_t n_vocab) {
  return std::max<int64_t>(16, (int64_t(64) << 20) / (int64_t(n_vocab) * int64_t(sizeof(float))));
}
}  // namespace

// Shared by every choice (sequence) of one request.
struct RequestState {
  Request req;
  int32_t n_unfinished = 0;
  int32_t completion_tokens = 0;
  int32_t n_length = 0;     // choices that finished at their length limit (max_tokens, max_model_len)
  int32_t cached_tokens = -1;  // prompt tokens found in the prefix cache at first admission
  int64_t kv_tokens_kept = 0, kv_tokens_evicted = 0, kv_tokens_reindexed = 0;  // KV policy outcome, summed over finished choices
  bool forked = false;      // n > 1: children created after the prompt's prefill
  bool first_token = false;
  // When it was first scheduled (admitted to the batch) and drew its first token: the request
  // phase histograms (kvserve:request_{queue,prefill,decode,inference}_time_seconds).
  std::optional<Clock::time_point> scheduled_at, first_token_at;
  // min_tokens > 0: the ids a choice may not draw before it has min_tokens tokens (the
  // tokenizer's end-of-generation ids and the request's stop_token_ids, as vLLM's
  // all_stop_token_ids).
  std::vector<int32_t> min_tokens_mask;
  // prompt_logprobs ≥ 0: the next prompt token whose logprob is owed (the first has none), the
  // entries computed so far (tokens 1..prompt_lp_next-1; they survive a preemption), and whether
  // the kPrompt event went out.
  int32_t prompt_lp_next = 1;
  std::vector<TokenLogprob> prompt_lps;
  bool prompt_sent = false;
};

struct Engine::Sequence {
  uint64_t id = 0;
  std::shared_ptr<RequestState> rs;
  int32_t index = 0;               // choice index
  std::vector<int32_t> tokens;     // prompt + generated
  int32_t n_prompt = 0;
  int64_t n_computed = 0;          // positions whose K/V are in pages
  BlockTable table;
  BlockTable table_g1;  // hybrid models: the sliding-window layers' pages (-1: slid out, freed)
  Sampler sampler;
  IncrementalDetokenizer detok;
  std::string held;                // decoded text not yet emitted (stop-string holdback)
  // min_tokens: held[0, stop_floor) came from the first min_tokens tokens; a stop string must end
  // past it (vLLM checks stop strings in the text of later tokens only).
  size_t stop_floor = 0;
  int32_t n_generated = 0;
  Clock::time_point last_token_time;
  PrefixHandle pin;                // the cached prefix this sequence reuses (pinned)
  int64_t published = 0;           // tokens of full pages already handed to the prefix cache
  int32_t lpm_skips = 0;           // times passed over by the lpm policy
  // Long-context KV policy (kv/kv_eviction.h): the request's or the server's default.
  EvictionConfig evict;
  std::vector<float> scores;       // h2o / snapkv: attention mass per logical page
  int64_t evicted_tokens = 0;      // over the sequence's life (preemptions included)
  int64_t first_evicted_page = -1; // pages from here on are never published as a prefix
  int64_t reindexed = 0;           // positions given back by re-indexing (kv/kv_reindex.h)
  ColdTable cold;                  // --kv-offload-cold: which pages of the table are on disk
  // Lower tiers: a lookup in flight (the sequence is loading and is not admitted meanwhile).
  uint64_t tier_ticket = 0;
  bool tier_checked = false;       // looked (or decided not to look) below RAM
  Clock::time_point tier_deadline;
  // Swap mode: preempted with its pages written down. Until it is admitted again it looks below
  // RAM whenever the RAM cache holds less of it than at its last fruitless lookup.
  bool swapped = false;
  int64_t tier_fetch_ram = 0;      // RAM pages when the last lookup started
  int64_t tier_miss_at = -1;       // RAM pages when a lookup last came back short (-1: none)
  std::string tail_blob;           // the prompt's tail page, found below RAM; installed by admit()
  // Speculative decoding (engine/speculative.h): the request's or the server's configuration,
  // and this step's draft with the run that verifies it ([last token, draft...]).
  SpecConfig spec;
  SpecStats spec_stats;
  std::vector<int32_t> draft;
  std::vector<int32_t> spec_run;
  bool draft_forced = false;  // the draft is the constraint's forced text (jump-forward), not a guess
  SpecStats forced_stats;     // how much of its forced drafts the model took (jump-forward's length)
  // Structured output: this choice's walk through the request's constraint (null: none).
  std::unique_ptr<ConstraintMatcher> constraint;

  Sequence(const Tokenizer& tok, const RequestParams& p, const SamplingParams& sp)
      : sampler(sp), detok(tok, /*special=*/!p.skip_special_tokens) {}
  int64_t to_compute() const { return static_cast<int64_t>(tokens.size()) - n_computed; }
  // Prompt logprobs still to compute: their positions' logits must come from runs of this
  // sequence (never from the prefix cache, which keeps K/V, not logits).
  bool owes_prompt_lps() const { return rs->req.params.prompt_logprobs >= 0 && rs->prompt_lp_next < n_prompt; }
};

struct Engine::Plan {
  struct Item {
    Sequence* seq;
    int32_t n;
    bool logits;
    bool draft = false;  // a speculative run: logits at every position (n rows)
    // Prompt logprobs: the run's rows for positions rs->prompt_lp_next - 1 onwards (each
    // predicts the prompt token after it), before the draw's row when `logits`.
    int32_t lp_rows = 0;
  };
  std::vector<Item> items;
  Batch batch;
};

Engine::Engine(LlamaModel& model, const Tokenizer& tok, const EngineConfig& cfg) : model_(model), tok_(tok), cfg_(cfg) {
  KvLayout layout = model.kv_layout(cfg.block_size, cfg.kv_dtype, cfg.kv_layer_dtypes);
  // Staging (quantized layers): one partly filled page per running sequence, plus forks.
  const int32_t n_staging = staging_slots(cfg);
  int64_t n_pages = std::min<int64_t>(PagePool::pages_for_bytes(layout, cfg.kv_cache_bytes, n_staging), int64_t(1) << 30);
  if (model.kv_groups().size() > 1) {
    // Sliding-window layers: each running sequence holds at most its window plus the
    // positions of one step there; the rest of the budget goes to the global layers.
    window_g1_ = model.kv_groups()[1].window;
    const KvLayout l1 = model.kv_layout(cfg.block_size, cfg.kv_dtype, cfg.kv_layer_dtypes, 1);
    const int64_t per_seq = window_g1_ / cfg.block_size + 2;
    const int64_t one = per_seq + cfg.max_num_batched_tokens / cfg.block_size + 2;  // one sequence's worst step
    int64_t n1 = int64_t(cfg.max_num_seqs) * per_seq + cfg.max_num_batched_tokens / cfg.block_size + 4;
    // at most half the budget (more sequences than fit get preempted), at least one sequence
    n1 = std::max(one, std::min(n1, PagePool::pages_for_bytes(l1, cfg.kv_cache_bytes / 2, n_staging)));
    pool_g1_ = std::make_unique<PagePool>(l1, static_cast<int32_t>(std::min<int64_t>(n1, int64_t(1) << 30)), n_staging);
    n_pages = std::min<int64_t>(PagePool::pages_for_bytes(layout, cfg.kv_cache_bytes - pool_g1_->total_bytes(), n_staging),
                                int64_t(1) << 30);
  }
  if (cfg.kv_policy.sparse()) {  // Quest's key summaries come out of the same budget
    const double stats = double(layout.n_layer) * key_stats_bytes_per_page(layout);
    n_pages = static_cast<int64_t>(double(n_pages) * layout.page_bytes() / (layout.page_bytes() + stats));
  }
  pool_ = std::make_unique<PagePool>(layout, static_cast<int32_t>(std::max<int64_t>(n_pages, 0)), n_staging);
  if (n_pages < 1) {  // every request would be refused: say so at start (a Gemma 3 server once started with 0 pages)
    std::string why = "--kv-cache-memory " + format_bytes(double(cfg.kv_cache_bytes)) + " holds no page of the KV cache (one page is " +
                      format_bytes(double(layout.page_bytes())) + ")";
    if (pool_g1_) why += "; the sliding-window layers take " + format_bytes(double(pool_g1_->total_bytes())) + " of it";
    if (pool_->stage_store_bytes() > 0)
      why += "; the f16 staging tiles of the quantized layers' filling pages take " + format_bytes(double(pool_->stage_store_bytes())) +
             " of it (" + std::to_string(n_staging) + " per layer: --max-num-seqs " + std::to_string(cfg.max_num_seqs) + " + " +
             std::to_string(cfg.max_n) + " (--max-n) + " + std::to_string(cfg.max_num_batched_tokens / cfg.block_size) +
             " pages a --max-num-batched-tokens step fills + 4): raise the budget or lower those flags";
    init_status_ = Status::error(why);
  }
  if (cfg.kv_policy.sparse()) pool_->enable_key_stats();
  staged_kv_ = pool_->layout().n_staged_layers() > 0 || (pool_g1_ && pool_g1_->layout().n_staged_layers() > 0);
  threads_ = std::make_unique<ThreadPool>(cfg.n_threads);
  // Hybrid models: the cache also keeps the sliding-window layers' pages, and a prefix counts
  // only with its last window present (prefix_cache.h). The page format tag covers both groups.
  const KvLayout* wlayout = pool_g1_ ? &pool_g1_->layout() : nullptr;
  const uint32_t format_tag = TierManager::format_tag(layout, wlayout);
  // What computed the pages: the model's weights, and the activations' precision, which changes
  // every KV byte (--act-quant q8 pages in a q8x2 server's Redis or disk gave it the q8 server's
  // answers; a user test). The default keeps the weights' fingerprint, so stored pages stay valid.
  const uint64_t kv_source = act_quant() == ActQuant::kQ8 ? XXH3_64bits_withSeed("act-quant q8", 12, model.fingerprint()) : model.fingerprint();
  if (cfg.enable_prefix_caching)
    cache_ = std::make_unique<PrefixCache>(*pool_, kv_source, static_cast<int32_t>(format_tag), nullptr,
                                           WindowGroup{pool_g1_.get(), window_g1_});
  if (cfg.tiers.enabled()) {
    if (!cache_) {
      init_status_ = Status::error("the KV tiers (--kv-disk-dir, --kv-redis) keep prefix-cache pages: enable prefix caching");
    } else {
      auto t = TierManager::create(cfg.tiers, layout, pool_->has_key_stats(), kv_source, wlayout);
      if (!t) {
        init_status_ = t.status();
      } else {
        tiers_ = std::move(*t);
        tiers_->set_pool(pool_.get());
        if (pool_g1_) tiers_->set_window_pool(pool_g1_.get());
        tiers_->set_notify([this] {
          tier_ready_.store(true);
          in_cv_.notify_all();
        });
        cache_->set_listener(tiers_.get());
      }
    }
  }
  if (cfg.kv_policy.offload_cold && init_status_) {
    const std::string dir = !cfg.kv_offload_dir.empty() ? cfg.kv_offload_dir : !cfg.tiers.disk_dir.empty() ? cfg.tiers.disk_dir : "/tmp";
    auto c = ColdStore::create(dir, *pool_);
    if (!c) init_status_ = c.status();
    else cold_ = std::move(*c);
  }
  metrics_.set_gauges(0, 0, pool_->n_pages(), 0);
}

Engine::~Engine() {
  stop();
  std::lock_guard<std::mutex> l(state_mu_);
  if (tiers_) {
    // On the way out every cached page goes down with its last use, so the next start finds the
    // most recent (the tier manager finishes its queue when destroyed). Write-back kept them in
    // RAM until evicted; write-through wrote them when cached, and the disk may have dropped
    // some since, knowing nothing of their use in RAM: those are written again, the rest
    // refreshed. Hybrid models: with the window pages the cache holds, as write-back writes them
    // (a later start uses a prefix only as far as its last window's pages carry them). Every
    // refresh first: the disk trims to its budget after each write batch, and a recent prefix it
    // holds, with an older use on record, would otherwise go before its refresh came.
    cache_->for_each_page([&](const PageHash& h, const PageHash&, const std::string&, const int32_t*, int32_t, int32_t,
                              uint64_t last_use) { tiers_->refresh_held(h, last_use); });
    cache_->for_each_page([&](const PageHash& h, const PageHash& parent, const std::string& ns, const int32_t* t, int32_t p,
                              int32_t wp, uint64_t last_use) { tiers_->store(h, parent, ns, t, p, wp, last_use); });
    cache_->set_listener(nullptr);
    tiers_.reset();
  }
  for (auto* q : {&running_, &waiting_})
    for (auto& s : *q) {
      if (cache_) cache_->unpin(s->pin);
      s->table.release_all(*pool_);
      if (pool_g1_) s->table_g1.release_all(*pool_g1_);
    }
}

Rejection Engine::check_request(const Request& req) const {
  const RequestParams& p = req.params;
  const int64_t n_prompt = static_cast<int64_t>(req.prompt.size());
  auto reject = [](int32_t status, std::string msg, std::string param) { return Rejection{status, std::move(msg), std::move(param)}; };
  if (n_prompt == 0) return reject(400, "The prompt is empty.", "prompt");
  for (int32_t t : req.prompt)
    if (t < 0 || t >= model_.config().n_vocab) return reject(400, "Token id " + std::to_string(t) + " is out of range.", "prompt");
  if (p.n < 1 || p.n > cfg_.max_n) return reject(400, "n must be between 1 and " + std::to_string(cfg_.max_n) + ".", "n");
  if (p.max_tokens < 0) return reject(400, "max_tokens must be at least 0.", "max_tokens");
  if (p.logprobs > model_.config().n_vocab || p.prompt_logprobs > model_.config().n_vocab)
    return reject(400, "At most " + std::to_string(model_.config().n_vocab) + " logprobs (the vocabulary).",
                  p.logprobs > model_.config().n_vocab ? "logprobs" : "prompt_logprobs");
  if (p.min_tokens < 0 || p.min_tokens > p.max_tokens)
    return reject(400, "min_tokens must be between 0 and max_tokens (" + std::to_string(p.max_tokens) + "), got " + std::to_string(p.min_tokens) + ".",
                  "min_tokens");
  // Every front end checks these; a non-finite one would hang or crash the sampler.
  for (auto [v, name] : {std::pair{p.sampling.temperature, "temperature"}, {p.sampling.top_p, "top_p"}, {p.sampling.min_p, "min_p"},
                         {p.sampling.repetition_penalty, "repetition_penalty"}, {p.sampling.presence_penalty, "presence_penalty"},
                         {p.sampling.frequency_penalty, "frequency_penalty"}})
    if (!std::isfinite(v)) return reject(400, std::string(name) + " must be a finite number.", name);
  if (p.kv_policy_set) {
    if (Status st = policy_of(p).validate(cfg_.block_size); !st) return reject(400, st.message(), "kv_eviction");
    if (p.kv_policy.active() && model_.config().mla) return reject(400, "KV eviction and sparse reads are not supported for this model (MLA).", "kv_eviction");
    if (p.kv_policy.sparse() && !pool_->has_key_stats())
      return reject(400, "Quest sparse reads need the server started with --kv-sparse quest (the pages' key summaries are kept only then).", "kv_eviction");
  }
  // An evicting policy whose budget is below max_model_len may go past it (re-indexing); the
  // prompt must still fit, since it is computed whole before it is compressed.
  const EvictionConfig ev = policy_of(p);
  const bool past_context = ev.evicts() && ev.budget < cfg_.max_model_len && n_prompt < cfg_.max_model_len;
  if (n_prompt + p.max_tokens > cfg_.max_model_len && !past_context)
    return reject(400,
                  "This model's maximum context length is " + std::to_string(cfg_.max_model_len) + " tokens. However, you requested " +
                      std::to_string(n_prompt + p.max_tokens) + " tokens (" + std::to_string(n_prompt) + " in the messages, " +
                      std::to_string(p.max_tokens) + " in the completion). Please reduce the length of the messages or completion.",
                  n_prompt >= cfg_.max_model_len ? "messages" : "max_tokens");
  // The most KV one sequence of this request holds at once: its whole context, or under an
  // evicting policy the prompt (computed whole, then cut down) and after it the budget (the
  // page being filled counts in it; one page of slack).
  int64_t tokens_one = std::min<int64_t>(n_prompt + p.max_tokens, cfg_.max_model_len);
  if (ev.evicts()) tokens_one = std::min<int64_t>(tokens_one, std::max<int64_t>(n_prompt + 1, ev.budget + cfg_.block_size));
  int64_t pages_one = BlockTable::pages_for(tokens_one, cfg_.block_size);
  if (cold_ && ev.offload_cold)  // RAM holds the budget, or one layer's reads when they are more
    pages_one = std::min<int64_t>(pages_one, ev.cold_cap_pages(cfg_.block_size, model_.config().n_head_kv) + 2);
  if (pages_one > pool_->n_pages())
    return reject(400,
                  "The request needs " + std::to_string(pages_one) + " KV pages (" + std::to_string(tokens_one) +
                      " tokens" + (ev.evicts() ? " at once under its KV policy" : "") + ") but the whole KV cache has " +
                      std::to_string(pool_->n_pages()) + "; raise --kv-cache-memory.",
                  n_prompt + 1 > pool_->n_pages() * cfg_.block_size ? "messages" : "max_tokens");
  return Rejection{};
}

void Engine::count_rejection() { metrics_.add_rejected(/*queue_full=*/false); }

Rejection Engine::submit(Request req) {
  std::vector<Request> one;
  one.push_back(std::move(req));
  return submit_all(std::move(one));
}

Rejection Engine::submit_all(std::vector<Request> reqs, int32_t* failed) {
  if (failed) *failed = -1;
  auto reject = [&](Rejection r) {
    metrics_.add_rejected(r.http_status == 429);
    return r;
  };
  for (size_t i = 0; i < reqs.size(); ++i)  // every request first: a bad one queues none
    if (Rejection r = check_request(reqs[i]); r.http_status != 0) {
      if (failed) *failed = static_cast<int32_t>(i);
      return reject(std::move(r));
    }
  const auto n_new = static_cast<int64_t>(reqs.size());
  if (n_new > static_cast<int64_t>(cfg_.max_queue) + cfg_.max_num_seqs)  // could never be queued: not a retry later
    return reject(Rejection{400,
                            "A batch of " + std::to_string(n_new) + " prompts is more than this server takes at once (" +
                                std::to_string(static_cast<int64_t>(cfg_.max_queue) + cfg_.max_num_seqs) +
                                ": --max-num-seqs + --max-queue); send fewer prompts per request.",
                            "prompt"});
  {
    std::lock_guard<std::mutex> l(in_mu_);
    // Requests the next step can admit (free sequence slots) are not waiting: a burst of 8 on
    // an idle server with --max-queue 1 got 429s while 16 slots stood free.
    const int32_t free_slots = std::max(0, cfg_.max_num_seqs - n_running_seqs_.load());
    if (n_waiting_total_.load() + n_new > static_cast<int64_t>(cfg_.max_queue) + free_slots)
      return reject(Rejection{429, "The server is busy: " + std::to_string(cfg_.max_queue) + " requests are waiting. Retry later.", ""});
    n_waiting_total_.fetch_add(static_cast<int32_t>(n_new));
    for (Request& r : reqs) incoming_.push_back(std::move(r));
  }
  in_cv_.notify_one();
  return Rejection{};
}

void Engine::start() {
  if (thread_.joinable()) return;
  stop_.store(false);
  thread_ = std::thread([this] { loop(); });
}

void Engine::stop() {
  if (!thread_.joinable()) return;
  stop_.store(true);
  in_cv_.notify_all();
  thread_.join();
}

void Engine::loop() {
  while (!stop_.load()) {
    // Another thread waits for state_mu_ (check_integrity): let it in between steps.
    while (inspectors_.load() > 0 && !stop_.load()) std::this_thread::sleep_for(std::chrono::microseconds(200));
    if (!step()) {
      std::unique_lock<std::mutex> l(in_mu_);
      in_cv_.wait_for(l, std::chrono::milliseconds(20), [&] { return !incoming_.empty() || stop_.load() || tier_ready_.load(); });
    }
  }
}

void Engine::drain_incoming() {
  std::deque<Request> got;
  {
    std::lock_guard<std::mutex> l(in_mu_);
    got.swap(incoming_);
  }
  for (Request& r : got) {
    auto rs = std::make_shared<RequestState>();
    rs->req = std::move(r);
    rs->n_unfinished = rs->req.params.n;
    if (rs->req.params.min_tokens > 0) {
      std::vector<int32_t>& m = rs->min_tokens_mask;
      m = tok_.eog_ids();
      m.insert(m.end(), rs->req.params.stop_token_ids.begin(), rs->req.params.stop_token_ids.end());
      std::sort(m.begin(), m.end());
      m.erase(std::unique(m.begin(), m.end()), m.end());
    }
    auto s = std::make_unique<Sequence>(tok_, rs->req.params, rs->req.params.sampling);
    s->id = next_seq_id_++;
    s->rs = rs;
    s->tokens = rs->req.prompt;
    s->n_prompt = static_cast<int32_t>(s->tokens.size());
    s->evict = policy_of(rs->req.params);
    if (rs->req.params.constraint) s->constraint = std::make_unique<ConstraintMatcher>(rs->req.params.constraint);
    attach_cold(*s);
    switch (rs->req.params.spec_choice) {
      case RequestParams::Spec::kDefault: s->spec = cfg_.spec; break;
      case RequestParams::Spec::kOff: s->spec = SpecConfig{}; break;
      case RequestParams::Spec::kOn:
        s->spec = cfg_.spec;
        if (!s->spec.enabled()) s->spec.method = SpecConfig::Method::kNgram;
        break;
      case RequestParams::Spec::kCustom: s->spec = rs->req.params.spec; break;
    }
    if (s->spec.method == SpecConfig::Method::kSuffix && !suffix_cache_) suffix_cache_ = std::make_unique<SuffixCache>(s->spec);
    waiting_.push_back(std::move(s));
  }
}

bool Engine::ensure_pages(Sequence& s, int64_t n_new) {
  const int32_t bs = cfg_.block_size;
  const int64_t end = s.n_computed + n_new;
  // Copy-on-write: the page receiving position n_computed may be shared (n > 1 forks).
  const int64_t first_page = s.n_computed / bs;
  auto shared_tail = [&](const BlockTable& t, const PagePool& p) {
    return first_page < static_cast<int64_t>(t.pages.size()) && t.pages[first_page] >= 0 && p.refcount(t.pages[first_page]) > 1;
  };
  int32_t need = std::max(BlockTable::pages_for(end, bs) - static_cast<int32_t>(s.table.pages.size()), 0);
  const bool cow = shared_tail(s.table, *pool_);
  const int32_t total = need + (cow ? 1 : 0);
  int32_t need1 = 0;
  bool cow1 = false;
  if (pool_g1_) {
    slide(s);
    need1 = std::max(BlockTable::pages_for(end, bs) - static_cast<int32_t>(s.table_g1.pages.size()), 0);
    cow1 = shared_tail(s.table_g1, *pool_g1_);
    const int32_t total1 = need1 + (cow1 ? 1 : 0);
    if (!pool_g1_->can_allocate(total1) &&
        !(cache_ && pool_g1_->n_free() + cache_->n_evictable_window_pages() >= total1 && cache_->ensure_free_window(total1)))
      return false;
  }
  // Evict only when it can succeed: a waiting head that cannot fit emptied the prefix cache each
  // step for nothing, pages just loaded from a tier for the sequences behind it among them.
  // With cold pages, what the step reads back stays free too (cold_reserve).
  const int64_t keep = total + cold_reserve(&s, n_new);
  if (!pool_->can_allocate(static_cast<int32_t>(std::min<int64_t>(keep, INT32_MAX))) &&
      !(cache_ && pool_->n_free() + cache_->n_evictable_pages() >= keep && cache_->ensure_free(static_cast<int32_t>(keep))))
    return false;
  auto copy_on_write = [&](BlockTable& t, PagePool& p) {
    std::vector<int32_t> fresh;
    p.allocate(1, &fresh);
    const int32_t old = t.pages[first_page];
    if (!p.copy_page(old, fresh[0])) {  // no staging slot for the copy: try again next step
      p.release(fresh[0]);
      return false;
    }
    p.release(old);
    t.pages[first_page] = fresh[0];
    return true;
  };
  if (cow && !copy_on_write(s.table, *pool_)) return false;
  if (cow1 && !copy_on_write(s.table_g1, *pool_g1_)) return false;
  pool_->allocate(need, &s.table.pages);
  if (pool_g1_) pool_g1_->allocate(need1, &s.table_g1.pages);
  return true;
}

void Engine::slide(Sequence& s) {
  // Sliding-window pages no query from position n_computed on can see are freed at once.
  const int64_t first_needed = std::max<int64_t>(0, s.n_computed - window_g1_ + 1) / cfg_.block_size;
  for (int64_t i = 0; i < std::min<int64_t>(first_needed, static_cast<int64_t>(s.table_g1.pages.size())); ++i)
    if (s.table_g1.pages[i] >= 0) {
      pool_g1_->release(s.table_g1.pages[i]);
      s.table_g1.pages[i] = -1;
    }
}

void Engine::preempt(Sequence& s) {
  // Recompute later: the full pages go to the prefix cache (so resuming is mostly a hit),
  // the rest is freed; the tokens (prompt + generated) stay.
  if (tiers_ && cfg_.preemption == EngineConfig::Preemption::kSwap) swap_out(s);
  // Past max_model_len, or past what the whole pool holds (submit admits an evicting request by
  // its budget, so its tokens may outgrow the pool), the whole token list cannot be recomputed:
  // the tokens of evicted pages go (as a re-index would drop them), and the kept ones are
  // recomputed at their new positions.
  ReindexPlan plan;
  const int64_t n_tokens = static_cast<int64_t>(s.tokens.size());
  const bool drop = goes_past_context(s) && (n_tokens > cfg_.max_model_len ||
                                             BlockTable::pages_for(n_tokens + 1, cfg_.block_size) > pool_->n_pages());
  if (drop) {
    evict_now(s, /*prompt_end=*/true);  // a check the runs may have skipped (see reindex)
    plan = plan_reindex(s.table.pages, s.n_computed, cfg_.block_size);
  }
  release(s);
  if (drop && !plan.empty()) {
    s.n_prompt -= static_cast<int32_t>(reindex_tokens(plan, cfg_.block_size, s.n_prompt, &s.tokens));
    s.sampler.history_dropped(static_cast<size_t>(plan.dropped()), static_cast<size_t>(s.n_prompt));
    s.reindexed += plan.dropped();
    metrics_.add_reindexed_tokens(plan.dropped(), /*by_preemption=*/true);
  }
  s.n_computed = 0;
  metrics_.add_preemption();
  dash_.timelines().preempted(s.rs->req.id, dash_.since_epoch(Clock::now()));
}

bool Engine::goes_past_context(const Sequence& s) const {
  return s.evict.evicts() && s.evict.budget < cfg_.max_model_len;
}

bool Engine::reindex(Sequence& s) {
  const int32_t bs = cfg_.block_size;
  // The policy's checks run when a page fills or a prompt ends; a prompt whose last chunk was a
  // single token (run as a decode), with a limit that is not a page boundary, reaches the limit
  // unchecked: check now (a no-op when the checks ran).
  evict_now(s, /*prompt_end=*/true);
  const ReindexPlan plan = plan_reindex(s.table.pages, s.n_computed, bs);
  if (plan.empty() || plan.n_after >= cfg_.max_model_len) return false;  // not with submit's checks
  // Room for copies of shared moved pages (forks; recent prompt pages the prefix cache also holds).
  if (const int32_t n = moved_shared(plan, *pool_, s.table.pages); n > 0 && !pool_->can_allocate(n) && !(cache_ && cache_->ensure_free(n)))
    return false;
  if (pool_g1_)
    if (const int32_t n = moved_shared(plan, *pool_g1_, s.table_g1.pages);
        n > 0 && !pool_g1_->can_allocate(n) && !(cache_ && cache_->ensure_free_window(n)))
      return false;
  PagePool* const pools[2] = {pool_.get(), pool_g1_.get()};
  BlockTable* const tables[2] = {&s.table, &s.table_g1};
  if (!apply_reindex(plan, pools, tables, [&](int g, int32_t page, int32_t n, int64_t d) { model_.shift_keys(*pools[g], g, page, n, d); }))
    return false;
  reindex_pages_of(plan, &s.scores);
  s.n_prompt -= static_cast<int32_t>(reindex_tokens(plan, bs, s.n_prompt, &s.tokens));
  s.sampler.history_dropped(static_cast<size_t>(plan.dropped()), static_cast<size_t>(s.n_prompt));
  s.n_computed = plan.n_after;
  s.reindexed += plan.dropped();
  metrics_.add_reindexed_tokens(plan.dropped());
  return true;
}

bool Engine::schedule(Plan* plan) {
  // Cancelled requests leave first: their pages are free for this very step.
  for (auto it = running_.begin(); it != running_.end();) {
    Sequence& s = **it;
    if (s.rs->req.stream->cancelled()) {
      finish(s, "abort");
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = waiting_.begin(); it != waiting_.end();) {
    Sequence& s = **it;
    if (s.rs->req.stream->cancelled()) {
      finish(s, "abort");
      n_waiting_total_.fetch_sub(1);
      it = waiting_.erase(it);
    } else {
      ++it;
    }
  }

  if (tiers_) {
    install_tier_pages();
    lookup_tiers();
  }

  int64_t budget = cfg_.max_num_batched_tokens;
  // Prompt-logprob runs: at most this many logit rows this step (prompt_logit_rows_cap).
  int64_t lp_room = prompt_logit_rows_cap(model_.config().n_vocab);
  auto lp_limit = [&](const Sequence& s, int64_t want) { return s.owes_prompt_lps() ? std::min(want, lp_room) : want; };
  auto lp_take = [&](const Sequence& s, int64_t n) {
    if (s.owes_prompt_lps()) lp_room -= n;
  };
  // Speculative drafts only while the decode batch stays narrow (memory-bound): decodes plus
  // drafts within max_batch_tokens of the server's configuration (the oldest draft first).
  int64_t spec_room = 0, n_decoding = 0;
  for (const auto& sp : running_) n_decoding += sp->to_compute() == 1;
  // Drafts of several sequences (jump-forward or speculative) fill the last matmul row tile their
  // decodes start, and start no other: there a token is worth 1/n of a step, and a new tile costs
  // about a third of one (SmolLM2, 4 → 5 rows; n-gram drafts at 4 users were ×0.93 of none).
  // Alone, a token is worth the whole step: drafts may go on.
  int64_t tile_room = n_decoding <= 1 ? budget
                                      : (n_decoding + kMatmulRowTile - 1) / kMatmulRowTile * kMatmulRowTile - n_decoding;
  if (cfg_.spec.max_batch_tokens > 0) {
    spec_room = std::max<int64_t>(0, cfg_.spec.max_batch_tokens - n_decoding);
  } else {
    spec_room = budget;
  }
  // 1. Decodes of running sequences, oldest first. Out of pages: preempt the newest.
  for (auto it = running_.begin(); it != running_.end() && budget > 0;) {
    Sequence& s = **it;
    if (s.to_compute() != 1) { ++it; continue; }
    // At the limit, re-index first (kv/kv_reindex.h); either may need pages: preempt for them.
    auto room = [&] { return (s.n_computed < cfg_.max_model_len || reindex(s)) && ensure_pages(s, 1); };
    bool ok = room();
    while (!ok) {
      auto victim = std::prev(running_.end());
      Sequence* v = victim->get();
      preempt(*v);
      waiting_.push_front(std::move(*victim));
      n_waiting_total_.fetch_add(1);
      running_.erase(victim);
      if (v == &s) break;  // s itself was the newest: it waits
      ok = room();
    }
    if (!ok) break;  // s was preempted and removed; everything after it was too
    const int32_t k = make_draft(s, static_cast<int32_t>(std::min<int64_t>({spec_room, tile_room, budget - 1})),
                                 static_cast<int32_t>(n_decoding));
    tile_room -= k;
    plan->items.push_back({&s, 1 + k, true, k > 0});
    budget -= 1 + k;
    spec_room -= k;
    ++it;
  }
  // 2. Running sequences still in their prompt (chunked prefill), then 3. admissions. A prompt
  // with more than long_prefill_tokens left gets at most that many on this first pass, so that a
  // long document does not hold back the short requests waiting behind it (vLLM's
  // long_prefill_token_threshold); 4. what the budget still holds goes back to those chunks.
  const int64_t cap = cfg_.long_prefill_tokens > 0 ? cfg_.long_prefill_tokens : budget;
  std::vector<size_t> capped;  // plan items whose chunk the cap cut
  auto note_capped = [&](const Sequence& s, int32_t n) {
    if (n == cap && s.to_compute() > n) capped.push_back(plan->items.size() - 1);
  };
  for (auto& sp : running_) {
    Sequence& s = *sp;
    if (budget <= 0) break;
    if (s.to_compute() <= 1) continue;
    const int32_t n = prefill_chunk(s, lp_limit(s, std::min(budget, cap)));
    if (n <= 0 || !ensure_pages(s, n)) continue;
    plan->items.push_back({&s, n, n == s.to_compute()});
    budget -= n;
    lp_take(s, n);
    note_capped(s, n);
  }
  // --max-num-seqs counts every sequence, as vLLM's: a request of n choices that has not forked
  // yet (its children come after its prompt) holds n slots from its admission (a user test saw
  // 8 sequences run under --max-num-seqs 4). One of n > max_num_seqs runs alone.
  auto slots_of = [](const Sequence& q) { return q.index == 0 && !q.rs->forked ? std::max(1, q.rs->req.params.n) : 1; };
  int32_t slots = 0;
  for (const auto& q : running_) slots += slots_of(*q);
  while (budget > 0 && !waiting_.empty() && slots < cfg_.max_num_seqs) {
    auto pick = pick_waiting();
    if (pick == waiting_.end()) break;  // every candidate is loading pages from a lower tier
    Sequence& s = **pick;
    if (slots + slots_of(s) > cfg_.max_num_seqs && !running_.empty()) break;  // no overtaking: it waits for its slots
    int32_t n = 0;
    const int64_t want = lp_limit(s, std::min(budget, cap));
    if (want <= 0 || !admit(s, want, &n)) break;  // no overtaking: the chosen request waits for room
    if (!s.rs->scheduled_at) s.rs->scheduled_at = Clock::now();  // a preempted one keeps its first
    slots += slots_of(s);
    running_.push_back(std::move(*pick));
    waiting_.erase(pick);
    n_running_seqs_.store(static_cast<int32_t>(running_.size()));  // before the waiting count drops: submit never over-admits
    n_waiting_total_.fetch_sub(1);
    plan->items.push_back({&s, n, n == s.to_compute()});
    budget -= n;
    lp_take(s, n);
    note_capped(s, n);
  }
  for (size_t i : capped) {
    if (budget <= 0) break;
    Plan::Item& it = plan->items[i];
    Sequence& s = *it.seq;
    const int32_t n = prefill_chunk(s, it.n + lp_limit(s, budget));
    if (n <= it.n || !ensure_pages(s, n)) continue;
    budget -= n - it.n;
    lp_take(s, n - it.n);
    it.n = n;
    it.logits = n == s.to_compute();
  }
  // Livelock guard: running sequences exist but none could advance (every one is mid-prompt
  // and the pool is full). The newest gives its pages back; the next step makes progress.
  if (plan->items.empty() && !running_.empty()) {
    auto victim = std::prev(running_.end());
    preempt(**victim);
    waiting_.push_front(std::move(*victim));
    n_waiting_total_.fetch_add(1);
    running_.erase(victim);
    return true;  // state changed: ask for another step
  }
  for (auto& it : plan->items) {
    const int32_t* toks = it.draft ? it.seq->spec_run.data() : it.seq->tokens.data() + it.seq->n_computed;
    plan->batch.add(it.seq->table.pages.data(), it.seq->n_computed, toks, it.n, it.logits, pool_g1_ ? it.seq->table_g1.pages.data() : nullptr);
    BatchSeq& b = plan->batch.seqs.back();
    if (it.draft) b.n_logits = it.n;
    if (it.seq->owes_prompt_lps()) {
      // Rows for positions [prompt_lp_next - 1, end) of the run, the prompt's last excluded (its
      // row is the draw's). The prefix cache never skips past prompt_lp_next - 1 (admit).
      const Sequence& s = *it.seq;
      const int64_t first = s.rs->prompt_lp_next - 1, end = std::min<int64_t>(s.n_computed + it.n, s.n_prompt - 1);
      it.lp_rows = static_cast<int32_t>(std::max<int64_t>(0, end - std::max<int64_t>(first, s.n_computed)));
      if (it.lp_rows > 0) {
        b.want_logits = true;
        b.n_logits = it.lp_rows + (it.logits ? 1 : 0);
      }
    }
    annotate(*it.seq, b);
  }
  return !plan->items.empty();
}

void Engine::annotate(Sequence& s, BatchSeq& b) {
  if (!s.evict.active()) return;
  // Quest reads sparsely in decode runs only. A prompt's last run is as short as the prefix cache
  // or the chunking leaves it (8 tokens after 992 cached), and read sparsely it made a greedy
  // answer depend on the cache's state and the step size (a user test); the prompt is read whole.
  // With cold pages a prompt past the RAM budget runs in Quest tiles (cold_cap): those read
  // sparsely too, or they would hold every page.
  const bool past_ram = s.cold.attached() && b.pos0 + b.n_tokens > s.evict.budget;
  if (s.evict.sparse() && (b.pos0 >= s.n_prompt || past_ram)) b.quest = &s.evict;
  if (s.cold.attached()) b.cold = &s.cold;
  if (!s.evict.wants_scores()) return;
  const int64_t n_pages = BlockTable::pages_for(b.pos0 + b.n_tokens, cfg_.block_size);
  if (static_cast<int64_t>(s.scores.size()) < n_pages) s.scores.resize(n_pages, 0.f);
  b.page_scores = s.scores.data();
  b.score_from = score_from(s.evict, static_cast<int64_t>(s.tokens.size()), b.pos0, b.n_tokens);
}

// After a run: a sequence whose known tokens are all computed (a prompt just ended, or a
// decode step) evicts when the policy says so, at a prompt's end or when a page has filled.
void Engine::maybe_evict(Sequence& s, int32_t n_run) {
  if (s.n_computed != static_cast<int64_t>(s.tokens.size())) return;  // mid-prompt
  // The run that ends the prompt checks the budget whatever its length: a prompt whose tokens
  // but the last came from the prefix cache ends with a run of one token, and was never cut
  // down (window / sinks kept 972 of a 961-token prompt on a 64-token budget, and a greedy
  // answer then depended on what the cache held).
  evict_now(s, n_run > 1 || s.n_computed - n_run < s.n_prompt);
}

void Engine::evict_now(Sequence& s, bool prompt_end) {
  const int32_t bs = cfg_.block_size;
  const std::vector<int64_t> out = evict_if_due(s.evict, *pool_, s.table.pages, s.n_computed, prompt_end, s.scores);
  if (out.empty()) return;
  s.evicted_tokens += int64_t(out.size()) * bs;
  metrics_.add_evicted_tokens(int64_t(out.size()) * bs);
  cut_prefix(s, out.front());
}

void Engine::cut_prefix(Sequence& s, int64_t first_gone_page) {
  if (s.first_evicted_page >= 0 && first_gone_page >= s.first_evicted_page) return;
  s.first_evicted_page = first_gone_page;
  // The prefix this sequence still holds ends before its first evicted page: pin only that
  // (the evicted pages the cache holds become ordinary, evictable cached pages).
  const int64_t keep = s.first_evicted_page * cfg_.block_size;
  if (cache_ && s.published > keep) {
    PrefixHandle h;
    if (keep > 0)
      h = cache_->insert(s.rs->req.params.cache_namespace, s.tokens.data(), keep, s.table.pages.data(),
                         pool_g1_ ? s.table_g1.pages.data() : nullptr).handle;
    cache_->pin(h);
    cache_->unpin(s.pin);
    s.pin = h;
    s.published = keep;
  }
}

std::list<std::unique_ptr<Engine::Sequence>>::iterator Engine::pick_waiting() {
  // A request loading pages from a lower tier is passed over; nobody waits for it.
  auto head = waiting_.begin();
  while (head != waiting_.end() && (*head)->tier_ticket != 0) ++head;
  if (head == waiting_.end()) return head;
  if (cfg_.policy != EngineConfig::Policy::kLpm || !cache_ || (*head)->lpm_skips >= kLpmMaxSkips) return head;
  // Longest cached prefix among the first few waiting requests; ties keep arrival order.
  auto best = head;
  int64_t best_len = -1;
  int k = 0;
  for (auto it = head; it != waiting_.end() && k < kLpmWindow; ++it, ++k) {
    const Sequence& s = **it;
    if (s.tier_ticket != 0) continue;
    const int64_t len = cache_->match_length(s.rs->req.params.cache_namespace, s.tokens.data(), static_cast<int64_t>(s.tokens.size()));
    if (len > best_len) {
      best = it;
      best_len = len;
    }
  }
  for (auto it = head; it != best; ++it) ++(*it)->lpm_skips;
  return best;
}

// The tokens of s's prompt one step can compute, at most `want`: what its pages and the free
// (or evictable) pages hold, and the cold store's cap.
int32_t Engine::prefill_chunk(const Sequence& s, int64_t want) const {
  const int32_t bs = cfg_.block_size;
  // (free pages, and cached pages that eviction can free)
  int64_t room = (static_cast<int64_t>(s.table.pages.size()) + pool_->n_free() + (cache_ ? cache_->n_evictable_pages() : 0)) * bs -
                 s.n_computed;
  if (pool_g1_) {
    int64_t free1 = pool_g1_->n_free();
    if (cache_ && (free1 + static_cast<int64_t>(s.table_g1.pages.size())) * bs < s.n_computed + std::min(want, s.to_compute()))
      free1 += cache_->n_evictable_window_pages();  // counts the pool: only when short
    room = std::min<int64_t>(room, (static_cast<int64_t>(s.table_g1.pages.size()) + free1) * bs - s.n_computed);
  }
  return static_cast<int32_t>(cold_cap(s, std::min<int64_t>({want, s.to_compute(), room})));
}

bool Engine::admit(Sequence& s, int64_t budget, int32_t* n_out) {
  PrefixMatch m;
  int64_t tail_tokens = 0;     // the prompt tail's tokens installed from a lower tier
  int64_t partial_tokens = 0;  // copied from a partly matching cached page
  if (cache_ && s.n_computed == 0 && s.table.pages.empty()) {
    // A scored policy (h2o, snapkv) computes at least the prompt's last obs_window tokens
    // itself: their queries are what votes at the prompt's end, and a cached page has none.
    int64_t n_match = static_cast<int64_t>(s.tokens.size());
    if (s.evict.wants_scores()) n_match = std::max<int64_t>(0, n_match - s.evict.obs_window);
    // Prompt logprobs: the positions whose logits are still owed are computed here.
    if (s.owes_prompt_lps()) n_match = std::min<int64_t>(n_match, s.rs->prompt_lp_next - 1);
    m = cache_->match(s.rs->req.params.cache_namespace, s.tokens.data(), n_match);
    cache_->pin(m.handle);  // protects the matched pages from the eviction ensure_pages may do
    for (int32_t p : m.pages) pool_->retain(p);
    s.table.pages = m.pages;
    s.n_computed = s.table.n_tokens = m.n_tokens;
    if (pool_g1_) {  // the window's pages of the prefix (-1 before it)
      for (int32_t p : m.window_pages)
        if (p >= 0) pool_g1_->retain(p);
      s.table_g1.pages = m.window_pages;
      s.table_g1.n_tokens = m.n_tokens;
    }
    s.pin = m.handle;
    s.published = m.n_tokens;
    if (!s.tail_blob.empty() && !s.owes_prompt_lps() && install_prompt_tail(s, m.n_tokens))
      tail_tokens = s.n_computed - m.n_tokens;
    else if (s.tail_blob.empty() && copy_partial_page(s, m))
      partial_tokens = m.n_partial;
  }
  const int32_t n = static_cast<int32_t>(cold_cap(s, std::min<int64_t>(budget, s.to_compute())));
  if (!ensure_pages(s, n)) {
    // Undo: the request waits with nothing held.
    if (cache_) cache_->unpin(s.pin);
    s.pin = PrefixHandle{};
    s.published = 0;
    s.table.release_all(*pool_);
    if (pool_g1_) s.table_g1.release_all(*pool_g1_);
    s.n_computed = 0;
    return false;
  }
  // Admitted: a resumed sequence looks below RAM again only after a swap-mode preemption.
  if (!s.tail_blob.empty()) {  // unused: the full pages before it were evicted again meanwhile
    s.tail_blob.clear();
    metrics_.add_tier_tail(tail_tokens > 0 ? TailEvent::kLoaded : TailEvent::kUnused);
  }
  s.tier_checked = true;
  s.swapped = false;
  s.tier_miss_at = -1;
  if (cache_ && s.rs->cached_tokens < 0) {
    // A request that may not use the cache is not a lookup (vLLM leaves prompt_logprobs requests
    // out of its hit rate too): an lm-eval run showed a hit rate near 0.
    if (s.rs->req.params.prompt_logprobs < 0)
      cache_->count_query(static_cast<int64_t>(s.tokens.size()), m.n_tokens + partial_tokens, m.handle, partial_tokens);
    s.rs->cached_tokens = static_cast<int32_t>(std::min<int64_t>(m.n_tokens + partial_tokens + tail_tokens, s.n_prompt));
  }
  *n_out = n;
  return true;
}

// ---- Hot and cold pages (kv/cold_store.h) ---------------------------------------------------

EvictionConfig Engine::policy_of(const RequestParams& p) const {
  if (!p.kv_policy_set) return cfg_.kv_policy;
  EvictionConfig c = p.kv_policy;
  // A request's own Quest reads on a server with cold pages keep the operator's RAM budget (its
  // own budget if it gives one): its config dropped the cold pages (a user test).
  if (cold_ && cfg_.kv_policy.offload_cold && c.sparse() && !c.evicts()) {
    c.offload_cold = true;
    if (c.budget <= 0) c.budget = cfg_.kv_policy.budget;
  }
  return c;
}

void Engine::attach_cold(Sequence& s) {
  if (!cold_ || !s.evict.offload_cold) return;
  // A fetch that finds the pool full takes a page from the prefix cache's evictable ones.
  s.cold.attach(cold_.get(), &s.table.pages, [this](int32_t n) { return cache_ && cache_->ensure_free(n); });
  s.cold.set_cap(s.evict.cold_cap_pages(cfg_.block_size, model_.config().n_head_kv));
}

int64_t Engine::cold_extra(const Sequence& t, int64_t n_new) const {
  // A sequence past its budget may hold cold_extra_pages more than its budget during a step
  // (one layer's reads, when they are more than the budget).
  return t.cold.attached() && t.n_computed + n_new > t.evict.budget
             ? t.evict.cold_extra_pages(cfg_.block_size, model_.config().n_head_kv)
             : 0;
}

int64_t Engine::cold_reserve(const Sequence* s, int64_t n_new) const {
  // What the running sequences (and s, about to run n_new more) may read into: kept free for them.
  if (!cold_) return 0;
  int64_t r = s ? cold_extra(*s, n_new) : 0;
  for (const auto& t : running_)
    if (t.get() != s) r += cold_extra(*t, 0);
  return r;
}

int64_t Engine::cold_cap(const Sequence& s, int64_t n) const {
  // Past its budget a prompt runs in Quest tiles: a longer run would read (so hold) every page.
  if (!s.cold.attached() || s.n_computed + n <= s.evict.budget) return n;
  return std::min<int64_t>(n, std::max<int64_t>(kAttnQTile, s.evict.budget - s.n_computed));
}

void Engine::maybe_offload(Sequence& s) {
  if (!s.cold.attached()) return;
  s.cold.next_step();
  if (s.cold.offload(s.evict, s.n_computed) == 0) return;
  for (int64_t i = 0; i < static_cast<int64_t>(s.table.pages.size()); ++i)
    if (s.table.pages[i] == kColdPage) {
      cut_prefix(s, i);
      break;
    }
}

Engine::Sequence* Engine::fork(Sequence& parent, int32_t index) {
  SamplingParams sp = parent.rs->req.params.sampling;
  sp.seed = sp.seed + static_cast<uint64_t>(index) * 0x9E3779B97F4A7C15ull;
  auto c = std::make_unique<Sequence>(tok_, parent.rs->req.params, sp);
  c->id = next_seq_id_++;
  c->rs = parent.rs;
  c->index = index;
  c->tokens = parent.tokens;
  c->n_prompt = parent.n_prompt;
  c->n_computed = parent.n_computed;
  c->table.pages = parent.table.pages;
  c->table.n_tokens = parent.table.n_tokens;
  for (int32_t p : c->table.pages)
    if (p >= 0) pool_->retain(p);  // shared until written (copy-on-write); -1: evicted
  c->evict = parent.evict;
  c->spec = parent.spec;
  // Forks are made before the first token is drawn: each choice starts the constraint afresh.
  if (parent.rs->req.params.constraint) c->constraint = std::make_unique<ConstraintMatcher>(parent.rs->req.params.constraint);
  c->scores = parent.scores;
  c->evicted_tokens = parent.evicted_tokens;
  c->first_evicted_page = parent.first_evicted_page;
  c->reindexed = parent.reindexed;
  attach_cold(*c);
  if (c->cold.attached()) c->cold.copy_from(parent.cold);
  if (pool_g1_) {
    c->table_g1 = parent.table_g1;
    for (int32_t p : c->table_g1.pages)
      if (p >= 0) pool_g1_->retain(p);
  }
  c->pin = parent.pin;
  c->published = parent.published;
  if (cache_) cache_->pin(c->pin);
  Sequence* raw = c.get();
  running_.push_back(std::move(c));
  n_running_seqs_.store(static_cast<int32_t>(running_.size()));
  return raw;
}

// ---- Speculative decoding (engine/speculative.h) ---------------------------------------------

int32_t Engine::make_draft(Sequence& s, int32_t k_cap, int32_t n_decoding) {
  s.draft.clear();
  s.draft_forced = false;
  const RequestParams& p = s.rs->req.params;
  // Not for a first token (forks of n > 1 are made from it), nor under a long-context KV policy
  // (rejected positions would vote in its scores).
  if (s.n_generated < 1 || s.evict.active()) return 0;
  ConstraintMatcher* constraint = s.constraint && !s.constraint->terminated() ? s.constraint.get() : nullptr;
  const bool forcing = constraint && cfg_.jump_forward_tokens > 0;
  if (!s.spec.enabled() && !forcing) return 0;
  const int32_t bs = cfg_.block_size;
  const int64_t n_tok = static_cast<int64_t>(s.tokens.size());
  // The most tokens a draft may hold here, whatever proposes it.
  int64_t room = std::min<int64_t>(p.max_tokens - s.n_generated - 1, cfg_.max_model_len - n_tok - 1);
  // Drafts use free pages only: making room for a guess is not worth evicting cached pages.
  room = std::min<int64_t>(room, (static_cast<int64_t>(s.table.pages.size()) + pool_->n_free()) * bs - s.n_computed - 1);
  if (pool_g1_) room = std::min<int64_t>(room, (static_cast<int64_t>(s.table_g1.pages.size()) + pool_g1_->n_free()) * bs - s.n_computed - 1);
  // A quantized page is quantized when its last slot is written: a draft must not write it (it
  // may be rejected), so drafts stay inside the page of the run's first token, or the next.
  if (staged_kv_) {
    const int64_t slot = s.n_computed % bs;
    room = std::min<int64_t>(room, slot == bs - 1 ? bs - 1 : bs - 2 - slot);
  }
  if (room <= 0) return 0;
  // Under a constraint, the text it forces next (jump-forward) is the draft whenever there is
  // such text, as long as it pays: the model does not always split it as the tokenizer does
  // (SmolLM2 took 70% of such tokens greedy, 20-40% sampled at temperature 1), so its length
  // follows this sequence's record as a speculative draft's does (SpecStats::worth).
  if (forcing) {
    const int64_t kmax = std::min<int64_t>({room, k_cap, cfg_.jump_forward_tokens});
    std::string text = kmax > 0 ? constraint->forced_text() : std::string();
    // A long literal is split only as far as a draft can use (a token is rarely over 24 bytes;
    // the last token, which the cut may split, is left out below).
    if (static_cast<int64_t>(text.size()) > 24 * (kmax + 1)) text.resize(static_cast<size_t>(24 * (kmax + 1)));
    if (!text.empty()) {
      // The tokenizer's own split (what the model was trained on), less its last token, which the
      // text that follows may extend (a forced `"age` before an unforced `": `); then only what
      // the constraint allows from here (a tokenizer's space prefix, a split it does not take).
      s.draft = tok_.encode(text, /*add_special=*/false, /*parse_special=*/false);
      if (!s.draft.empty()) s.draft.pop_back();
      if (static_cast<int64_t>(s.draft.size()) > kmax) s.draft.resize(static_cast<size_t>(kmax));
      s.draft.resize(static_cast<size_t>(constraint->allowed_prefix(s.draft.data(), static_cast<int32_t>(s.draft.size()))));
      if (!s.draft.empty()) {
        // What a draft row costs against what a token is worth grows with the batch: with a row
        // costing draft_cost of a one-sequence step, n sequences step in 1 + (n − 1)·draft_cost
        // of it and a token is worth 1/n of that (4 users: 0.63 against 0.3 alone).
        const double c = cfg_.spec.draft_cost, n = std::max<int32_t>(1, n_decoding);
        const float cost = static_cast<float>(n * c / (1.0 + (n - 1.0) * c));
        const int32_t k = s.forced_stats.worth(static_cast<int32_t>(s.draft.size()), cost);
        s.draft.resize(static_cast<size_t>(k));
        if (k == 0) return 0;  // forced text the model does not take: no guess of another kind either
      }
    }
    if (!s.draft.empty()) s.draft_forced = true;
  }
  if (s.draft.empty() && s.spec.enabled()) {
    int64_t k = std::min<int64_t>({room, k_cap, s.spec.num_speculative_tokens});
    if (k <= 0) return 0;
    k = s.spec_stats.worth(static_cast<int32_t>(k), s.spec.draft_cost);  // as long as it pays, from this sequence's record
    if (k <= 0) return 0;
    const int32_t* t = s.tokens.data();
    if (s.spec.method == SpecConfig::Method::kNgram) {
      ngram_draft(t, n_tok, s.spec, static_cast<int32_t>(k), &s.draft);
    } else {
      const SpecConfig& c = s.spec;
      SuffixDraft best = suffix_draft_self(t, n_tok, c.suffix_max_depth / 2, static_cast<int32_t>(k), c.suffix_min_prob, c.suffix_alpha);
      if (const SuffixTrie* trie = suffix_cache_ ? suffix_cache_->trie(p.cache_namespace) : nullptr) {
        SuffixDraft other = trie->propose(t, n_tok, static_cast<int32_t>(k), c.suffix_min_prob, c.suffix_alpha);
        if (other.score > best.score) best = std::move(other);
      }
      s.draft = std::move(best.tokens);
    }
    // Under a constraint only the part it allows can be accepted.
    if (constraint) s.draft.resize(static_cast<size_t>(constraint->allowed_prefix(s.draft.data(), static_cast<int32_t>(s.draft.size()))));
  }
  if (s.draft.empty()) return 0;
  const int32_t n = static_cast<int32_t>(s.draft.size());
  if (!ensure_pages(s, 1 + n)) {  // cannot happen with the free pages counted above; be safe
    s.draft.clear();
    return 0;
  }
  s.spec_run.assign(1, s.tokens.back());
  s.spec_run.insert(s.spec_run.end(), s.draft.begin(), s.draft.end());
  return n;
}

void Engine::settle_draft(Sequence& s, int32_t n_accepted) {
  // The accepted drafts' K/V stays (a finished sequence keeps only what its tokens cover); the
  // rejected positions are forgotten, and pages holding nothing else go back to the pool.
  const int32_t bs = cfg_.block_size;
  s.n_computed = std::min<int64_t>(s.n_computed + n_accepted, static_cast<int64_t>(s.tokens.size()));
  s.table.n_tokens = s.n_computed;
  const size_t keep = static_cast<size_t>(BlockTable::pages_for(s.n_computed, bs));
  auto truncate = [&](BlockTable& t, PagePool& pool) {
    while (t.pages.size() > keep) {
      if (t.pages.back() >= 0) pool.release(t.pages.back());
      t.pages.pop_back();
    }
    t.n_tokens = s.n_computed;
  };
  truncate(s.table, *pool_);
  if (pool_g1_) truncate(s.table_g1, *pool_g1_);
  if (s.draft_forced) {
    metrics_.add_jump_forward(static_cast<int32_t>(s.draft.size()), n_accepted);
    s.forced_stats.observe(static_cast<int32_t>(s.draft.size()), n_accepted);
  } else {
    metrics_.add_spec(static_cast<int32_t>(s.draft.size()), n_accepted);
    s.spec_stats.observe(static_cast<int32_t>(s.draft.size()), n_accepted);
  }
  s.draft.clear();
  publish(s);
}

void Engine::postprocess(Plan& plan, const float* logits) {
  const int32_t nv = model_.config().n_vocab;
  const auto now = Clock::now();
  // 1. Bookkeeping, forks (n > 1) and the list of draws, in batch order.
  int64_t r = 0;
  draws_.clear();
  prompt_rows_.clear();
  std::vector<Sequence*> prompt_only;  // max_tokens 0: the prompt was the whole request
  for (auto& it : plan.items) {
    Sequence& s = *it.seq;
    if (it.lp_rows > 0) {  // prompt logprobs: rows before the draw's (schedule)
      RequestState& rs = *s.rs;
      const int64_t first = rs.prompt_lp_next - 1;
      if (first < s.n_computed) {  // a run that skipped owed positions: never planned so
        rs.req.stream->push(StreamEvent{StreamEvent::kError, s.index, "", {}, "", "prompt logprobs lost their positions", 500, {}, {}, "", -1});
        rs.req.stream->cancel(CancelReason::kError);
      } else {
        const size_t at = rs.prompt_lps.size();
        rs.prompt_lps.resize(at + it.lp_rows);
        for (int32_t j = 0; j < it.lp_rows; ++j)
          prompt_rows_.push_back({logits + (r + j) * nv, s.tokens[first + 1 + j], rs.req.params.prompt_logprobs, &rs.prompt_lps[at + j]});
        rs.prompt_lp_next += it.lp_rows;
      }
      r += it.lp_rows;
    }
    // A speculative run: only its first token is known to be right (settle_draft does the rest).
    const int32_t n_known = it.draft ? 1 : it.n;
    s.n_computed += n_known;
    s.table.n_tokens = s.n_computed;
    publish(s);
    maybe_evict(s, n_known);
    maybe_offload(s);
    if (s.n_computed <= s.n_prompt) metrics_.add_prompt_tokens(std::min<int64_t>(it.n, s.n_prompt - (s.n_computed - it.n)));
    if (!it.logits) continue;
    const float* lg = logits + r * nv;
    const int32_t rows = it.draft ? it.n : 1;
    r += rows;
    RequestState& rs = *s.rs;
    if (rs.req.params.max_tokens == 0) {  // nothing to draw: the prompt was the whole request
      prompt_only.push_back(&s);
      continue;
    }
    draws_.push_back({&s, lg, rows, {}, {}});
    if (rs.req.params.n > 1 && !rs.forked && s.index == 0) {
      rs.forked = true;
      for (int32_t i = 1; i < rs.req.params.n; ++i) draws_.push_back({fork(s, i), lg, 1, {}, {}});
    }
    if (!rs.first_token) {
      rs.first_token = true;
      rs.first_token_at = now;
      metrics_.observe_ttft(seconds(rs.req.arrival, now));
    }
  }
  // 2. Prompt logprobs, then sampling, every sequence at once on the thread pool: each draw
  // touches only its own sequence's sampler and its thread's scratch, so the tokens do not
  // depend on the split. A request's prompt logprobs go out when its first draw is made, before
  // its first token.
  const auto t_sample = Clock::now();
  prompt_logprobs_all(nv);
  for (auto& it : plan.items) {
    RequestState& rs = *it.seq->rs;
    if (!it.logits || rs.req.params.prompt_logprobs < 0 || rs.prompt_sent || it.seq->index != 0) continue;
    rs.prompt_sent = true;
    StreamEvent ev;
    ev.kind = StreamEvent::kPrompt;
    ev.logprobs = std::move(rs.prompt_lps);
    rs.prompt_lps = {};
    rs.req.stream->push(std::move(ev));
  }
  sample_all(nv);
  sample_seconds_ = seconds(t_sample, Clock::now());
  for (Sequence* e : prompt_only) {  // every choice ends as it began: "length", no token
    if (cfg_.tier_prompt_tails == EngineConfig::PromptTails::kStore) store_prompt_tail(*e);
    store_finished_path(*e);
    push_finish(*e, "length");
    e->n_prompt = -1;  // removed from running below
  }
  // 3. Tokens, text, stop strings and streaming, in batch order (a speculative draw may bring
  // several tokens; the first that finishes the sequence ends it).
  for (Draw& d : draws_) {
    Sequence* e = d.seq;
    RequestState& rs = *e->rs;
    const RequestParams& p = rs.req.params;
    const double itl = seconds(e->last_token_time, now) / static_cast<double>(d.out.size());
    const char* reason = nullptr;
    StreamEvent finish{StreamEvent::kFinish, e->index, "", {}, "", "", 0, {}, {}, "", -1};
    for (size_t i = 0; i < d.out.size() && !reason; ++i) {
      const int32_t tok = d.out[i];
      StreamEvent ev;
      ev.index = e->index;
      if (!d.lps.empty()) ev.logprobs.push_back(std::move(d.lps[i]));
      e->tokens.push_back(tok);
      ++e->n_generated;
      ++rs.completion_tokens;
      metrics_.add_generation_tokens(1);
      if (e->n_generated > 1) metrics_.observe_itl(itl);
      ev.tokens.push_back(tok);
      const bool stop_id = !p.stop_token_ids.empty() && std::find(p.stop_token_ids.begin(), p.stop_token_ids.end(), tok) != p.stop_token_ids.end();
      // Under a constraint an end of text it accepted ends the choice even with ignore_eos: the
      // text is complete, and what followed was free text (a tool call's arguments went on into chat).
      const bool constraint_done = e->constraint && e->constraint->terminated();
      const bool eog_stops = tok_.is_eog(tok) && (!p.ignore_eos || constraint_done);
      if (eog_stops || (stop_id && tok_.token_type(tok) == TokenType::kControl)) {
        reason = "stop";
        if (stop_id && !eog_stops) finish.stop_token = tok;  // vLLM checks the end of text first
        ev.eog_logprobs.swap(ev.logprobs);  // the end-of-generation token is not part of the text
        // Text held back because it could begin a stop string is the answer's end after all; a
        // character the last tokens left incomplete is not (no U+FFFD the model never wrote).
        e->detok.finish();
        ev.text.swap(e->held);
      } else {
        // A stop id's own text is left out unless include_stop_str_in_output, as vLLM's detokenizer
        // leaves out the token that stopped the choice (its id is still the last of token_ids).
        if (!stop_id || p.include_stop_str) e->held += e->detok.push(tok);
        const bool at_limit = stop_id || e->n_generated >= p.max_tokens ||
                              (!goes_past_context(*e) && static_cast<int64_t>(e->tokens.size()) >= cfg_.max_model_len);
        if (at_limit) e->detok.finish();
        // min_tokens: the text of the first min_tokens tokens ends no stop string (vLLM); one that
        // begins there and ends in a later token's text does.
        if (e->n_generated <= p.min_tokens) e->stop_floor = e->held.size();
        size_t cut = std::string::npos, cut_len = 0;  // the earliest match (the longest of those there)
        const std::string* cut_by = nullptr;
        for (const auto& st : p.stop) {
          size_t at = e->held.find(st, e->stop_floor >= st.size() ? e->stop_floor - st.size() + 1 : 0);
          if (at != std::string::npos && (at < cut || (at == cut && st.size() > cut_len))) {
            cut = at;
            cut_len = st.size();
            cut_by = &st;
          }
        }
        if (cut != std::string::npos) {
          ev.text = e->held.substr(0, cut + (p.include_stop_str ? cut_len : 0));
          e->held.clear();
          e->stop_floor = 0;
          reason = "stop";
          finish.stop_string = *cut_by;
        } else if (at_limit) {
          ev.text.swap(e->held);
          reason = stop_id ? "stop" : "length";
          if (stop_id) finish.stop_token = tok;
        } else {
          const size_t keep = stop_holdback(e->held, p.stop);
          ev.text = e->held.substr(0, e->held.size() - keep);
          e->held.erase(0, e->held.size() - keep);
          e->stop_floor = e->stop_floor > ev.text.size() ? e->stop_floor - ev.text.size() : 0;
        }
      }
      rs.req.stream->push(std::move(ev));  // always carries the token
    }
    e->last_token_time = now;
    if (d.n_rows > 1) settle_draft(*e, static_cast<int32_t>(d.out.size()) - 1);
    // A prefill instance's prompt tail is queued before the client hears of the end: it answers
    // once what it queued is written.
    if (reason && cfg_.tier_prompt_tails == EngineConfig::PromptTails::kStore) store_prompt_tail(*e);
    if (reason) store_finished_path(*e);
    if (reason) {
      if (std::strcmp(reason, "length") == 0) ++rs.n_length;
      finish.finish_reason = reason;
      e->rs->req.stream->push(std::move(finish));
    }
    if (reason) e->n_prompt = -1;  // marks finished; removed from running below
  }
  // Finished sequences leave the batch and give their pages back.
  for (auto it = running_.begin(); it != running_.end();) {
    Sequence& s = **it;
    if (s.n_prompt == -1) {
      if (suffix_cache_ && s.spec.method == SpecConfig::Method::kSuffix) {  // its output feeds later drafts
        const size_t n_prompt = s.rs->req.prompt.size();
        if (s.tokens.size() > n_prompt && s.reindexed == 0)  // a re-indexed list lost tokens
          suffix_cache_->add_output(s.rs->req.params.cache_namespace, s.tokens.data() + n_prompt,
                                    static_cast<int64_t>(s.tokens.size() - n_prompt));
      }
      record_kv_outcome(s);
      release(s);
      maybe_finish_request(s);
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
}

void Engine::sample_all(int32_t nv) {
  const int n_threads = threads_->size();
  if (static_cast<int>(sample_ws_.size()) < n_threads) sample_ws_.resize(n_threads);
  auto work = [&](int ith, int nth) {
    int64_t b = 0, e = 0;
    ThreadPool::split(static_cast<int64_t>(draws_.size()), ith, nth, 1, &b, &e);
    SampleWorkspace& ws = sample_ws_[ith];
    ws.row.resize(nv);
    for (int64_t i = b; i < e; ++i) {
      Draw& d = draws_[i];
      Sequence& s = *d.seq;
      const RequestParams& p = s.rs->req.params;
      d.out.clear();
      d.lps.clear();
      // min_tokens: row j draws the choice's token n_generated + j; the first rows below
      // min_tokens draw without its end-of-generation and stop ids.
      const int32_t n_masked = std::max(0, p.min_tokens - s.n_generated);
      // Row j verifies draft token j (verify_draft); logprobs of each row drawn.
      const std::vector<int32_t>* draft = d.n_rows > 1 ? &s.draft : nullptr;
      verify_draft(s.sampler, d.logits, d.n_rows, nv, draft, s.tokens, static_cast<size_t>(s.n_prompt), &ws.sampler, ws.row.data(),
                   &d.out, DrawRules{s.constraint.get(), &p.logit_bias, n_masked > 0 ? &s.rs->min_tokens_mask : nullptr, n_masked},
                   [&](int32_t, const float* lg, int32_t tok) {
                     // Log-probabilities of the model's distribution (before penalties and temperature).
                     if (p.logprobs >= 0) d.lps.push_back(row_logprob(lg, nv, tok, p.logprobs, false, &ws.logprob));
                   });
    }
  };
  // One sequence is not worth a wake-up of the pool.
  if (draws_.size() <= 1 || n_threads <= 1)
    work(0, 1);
  else
    threads_->run(work);
}

void Engine::prompt_logprobs_all(int32_t nv) {
  if (prompt_rows_.empty()) return;
  const int n_threads = threads_->size();
  if (static_cast<int>(sample_ws_.size()) < n_threads) sample_ws_.resize(n_threads);
  threads_->run([&](int ith, int nth) {
    int64_t b = 0, e = 0;
    ThreadPool::split(static_cast<int64_t>(prompt_rows_.size()), ith, nth, 1, &b, &e);
    for (int64_t i = b; i < e; ++i) {
      const PromptRow& pr = prompt_rows_[i];
      *pr.out = row_logprob(pr.logits, nv, pr.token, pr.k, true, &sample_ws_[ith].logprob);
    }
  });
}

void Engine::publish(Sequence& s) {
  // Full pages enter the cache as soon as they are computed, not when the request ends, so
  // requests arriving together with the same system prompt share it after its first chunk.
  if (!cache_) return;
  const int32_t bs = cfg_.block_size;
  int64_t full = s.n_computed / bs * bs;
  if (s.first_evicted_page >= 0) full = std::min(full, s.first_evicted_page * bs);  // computed without the evicted
  if (full <= s.published) return;
  PrefixInsert ins = cache_->insert(s.rs->req.params.cache_namespace, s.tokens.data(), full, s.table.pages.data(),
                                    pool_g1_ ? s.table_g1.pages.data() : nullptr);
  cache_->pin(ins.handle);  // the deeper path now protects every page this sequence reads
  cache_->unpin(s.pin);
  s.pin = ins.handle;
  s.published = full;
}

void Engine::release(Sequence& s) {
  if (cache_) {
    // Only positions whose K/V are written (n_computed) and only whole pages are cached.
    const int64_t n = s.first_evicted_page >= 0 ? std::min(s.n_computed, s.first_evicted_page * cfg_.block_size) : s.n_computed;
    cache_->insert(s.rs->req.params.cache_namespace, s.tokens.data(), n, s.table.pages.data(),
                   pool_g1_ ? s.table_g1.pages.data() : nullptr);
    cache_->unpin(s.pin);
    s.pin = PrefixHandle{};
  }
  s.published = 0;
  // Recomputed after a preemption: the policy starts over on the whole token list.
  s.scores.clear();
  s.first_evicted_page = -1;
  s.cold.release_all();
  s.table.release_all(*pool_);
  if (pool_g1_) s.table_g1.release_all(*pool_g1_);
}

// ---- KV tiers ---------------------------------------------------------------------------

void Engine::lookup_tiers() {
  const int32_t bs = cfg_.block_size;
  const auto now = Clock::now();
  int k = 0;
  // Pages the waiting sequences ahead need before this one may be admitted (admission takes them
  // in order), and those of the swap-ins asked for in this pass: two swapped sequences behind a
  // blocked head both passed the room check against the same evictable pages, and each install
  // evicted the other's (1,400 pages loaded for ~150 used).
  int64_t ahead = 0, own = 0;
  for (auto& sp : waiting_) {
    if (++k > kLpmWindow) break;
    Sequence& s = *sp;
    ahead += own;  // the sequence before this one's
    own = BlockTable::pages_for(static_cast<int64_t>(s.tokens.size()) + 1, bs);
    if (s.tier_ticket != 0) {
      if (now > s.tier_deadline) {  // too slow: compute instead (the pages still land when they come)
        s.tier_ticket = 0;
        s.tier_miss_at = s.tier_fetch_ram;
        metrics_.add_tier_load_timeout();
      }
      continue;
    }
    if (s.tier_checked || s.n_computed != 0 || !s.table.pages.empty()) continue;
    if (!s.swapped) s.tier_checked = true;  // a new request looks once
    const std::string& ns = s.rs->req.params.cache_namespace;
    // As admit() matches: the last token is always computed, and a scored policy computes its
    // observation window itself.
    int64_t n_match = static_cast<int64_t>(s.tokens.size());
    if (s.evict.wants_scores()) n_match = std::max<int64_t>(0, n_match - s.evict.obs_window);
    // Prompt logprobs: the positions still owed are computed here (admit), never loaded.
    if (s.owes_prompt_lps()) n_match = std::min<int64_t>(n_match, s.rs->prompt_lp_next - 1);
    const int64_t max_pages = n_match > 0 ? (n_match - 1) / bs : 0;
    const int64_t ram = cache_->match_length(ns, s.tokens.data(), n_match) / bs;
    // A decode instance whose RAM holds every full page still asks for the tail (a prompt seen
    // before, prefilled again): else it recomputes the tail, and the tail stays in Redis.
    const int32_t t_own = cfg_.tier_prompt_tails == EngineConfig::PromptTails::kFetch && !s.swapped ? prompt_tail(s) : 0;
    const bool tail_only = t_own > 1 && ram == max_pages && max_pages >= cfg_.tiers.min_pages;
    if (max_pages - ram < cfg_.tiers.min_pages && !tail_only) continue;
    if (s.tier_miss_at >= 0 && ram >= s.tier_miss_at) continue;  // swapped: nothing new to find
    // Swapped: load only when the pool could take the whole sequence back; loading earlier would
    // evict pages the running sequences need, and they would evict these again (thrashing).
    // (Its own RAM pages are evictable but needed: they count on neither side.)
    if (s.swapped) {
      const int64_t avail = int64_t(pool_->n_free()) + cache_->n_evictable_pages() - ram - ahead;
      if (avail < own - ram) continue;
    }
    // A decode instance asks for the prompt's tail page too (one more page, after the full ones).
    std::vector<int32_t> toks;
    const int32_t t = cfg_.tier_prompt_tails == EngineConfig::PromptTails::kFetch && !s.swapped ? prompt_tail(s, &toks) : 0;
    if (t == 0) toks.assign(s.tokens.begin(), s.tokens.begin() + max_pages * bs);
    std::vector<PageHash> hashes = cache_->hash_pages(ns, toks.data(), static_cast<int64_t>(toks.size()));
    if (!tiers_->may_contain(hashes[ram])) {
      s.tier_miss_at = ram;
      continue;
    }
    s.tier_fetch_ram = ram;
    hashes.erase(hashes.begin(), hashes.begin() + ram);
    const double timeout = cfg_.tier_timeout_s + cfg_.tier_timeout_per_page_s * double(hashes.size());
    s.tier_deadline = now + std::chrono::microseconds(static_cast<int64_t>(timeout * 1e6));
    // (A tail of block_size tokens is the prompt's last full page, stored as any other: kept.)
    s.tier_ticket = tiers_->fetch(ns, std::move(hashes), std::move(toks), ram, t > 0 && t < bs);
    if (t > 0) tail_tickets_.insert(s.tier_ticket);
  }
}

void Engine::install_tier_pages() {
  tier_ready_.store(false);
  const int32_t bs = cfg_.block_size;
  for (TierManager::Loaded& L : tiers_->poll()) {
    // The last page asked for may be a prompt's tail: the sequence's own, never the cache's
    // (dropped if the sequence stopped waiting for it).
    std::string tail_blob;
    if (tail_tickets_.erase(L.ticket) > 0) {
      if (static_cast<int64_t>(L.blobs.size()) == L.n_asked) {
        tail_blob = std::move(L.blobs.back());
        L.blobs.pop_back();
      }
      --L.n_asked;
      L.tokens.resize(static_cast<size_t>((L.first_page + L.n_asked) * bs));
    }
    for (auto& s : waiting_)
      if (s->tier_ticket == L.ticket) {
        s->tier_ticket = 0;  // admissible again
        s->tail_blob = std::move(tail_blob);
        if (static_cast<int64_t>(L.blobs.size()) < L.n_asked) s->tier_miss_at = L.first_page;  // (swapped) look again only if RAM loses more
      }
    const int64_t n_found = static_cast<int64_t>(L.blobs.size());
    if (n_found == 0) continue;
    const int64_t end_pages = L.first_page + n_found;
    // The RAM part of the prefix must still be there (it may have been evicted meanwhile, or
    // grown: someone computed some of these pages); pinned while room is made.
    PrefixMatch m = cache_->match(L.ns, L.tokens.data(), end_pages * bs + 1);
    const int64_t ram = static_cast<int64_t>(m.pages.size());
    if (ram < L.first_page || ram >= end_pages) continue;
    // Hybrid models: a prefix of e pages counts only with the window pages of
    // [window_first_page(e), e) (prefix_cache.h); those past the RAM part come from the blobs.
    std::vector<char> has_win;
    auto usable = [&](int64_t limit) {
      if (!pool_g1_) return limit;
      for (int64_t e = limit; e > ram; --e) {
        bool ok = true;
        for (int64_t k = std::max(ram, cache_->window_first_page(e)); k < e && ok; ++k) ok = has_win[k - ram] != 0;
        if (ok) return e;
      }
      return ram;
    };
    if (pool_g1_)
      for (int64_t k = ram; k < end_pages; ++k) has_win.push_back(TierManager::has_window(L.blobs[k - L.first_page]));
    if (usable(end_pages) == ram) continue;
    cache_->pin(m.handle);
    int32_t need = static_cast<int32_t>(end_pages - ram);
    if (!pool_->can_allocate(need)) cache_->ensure_free(need);
    const int64_t end = usable(ram + std::min(need, pool_->n_free()));
    need = static_cast<int32_t>(end - ram);
    std::vector<int32_t> fresh, wfresh, held;
    pool_->allocate(need, &fresh);
    const int64_t wstart = pool_g1_ ? std::max(ram, cache_->window_first_page(end)) : end;
    bool room = true;
    if (pool_g1_ && need > 0) {
      // The window pages the RAM part lends this prefix must survive making room for the new ones.
      for (int64_t k = cache_->window_first_page(end); k < ram; ++k)
        if (m.window_pages[k] >= 0) {
          pool_g1_->retain(m.window_pages[k]);
          held.push_back(m.window_pages[k]);
        }
      const int32_t nw = static_cast<int32_t>(end - wstart);
      if (!pool_g1_->can_allocate(nw)) cache_->ensure_free_window(nw);
      room = pool_g1_->can_allocate(nw);
      if (room) pool_g1_->allocate(nw, &wfresh);
    }
    int32_t n_ok = 0;
    while (room && n_ok < need) {
      const int64_t k = ram + n_ok;
      const int32_t wp = k >= wstart ? wfresh[k - wstart] : -1;
      if (!tiers_->install(L.blobs[k - L.first_page], *pool_, fresh[n_ok], pool_g1_.get(), wp)) break;
      ++n_ok;
    }
    if (pool_g1_ && n_ok < need) n_ok = 0;  // the window rule holds for the whole run only
    if (n_ok > 0) {
      std::vector<int32_t> pages = m.pages;
      pages.insert(pages.end(), fresh.begin(), fresh.begin() + n_ok);
      std::vector<int32_t> wpages;
      if (pool_g1_) {
        wpages.assign(static_cast<size_t>(ram + n_ok), -1);  // the RAM part's are cached already
        for (int64_t k = wstart; k < ram + n_ok; ++k) wpages[k] = wfresh[k - wstart];
      }
      cache_->insert(L.ns, L.tokens.data(), (ram + n_ok) * bs, pages.data(), pool_g1_ ? wpages.data() : nullptr);
    }
    for (int32_t p : fresh) pool_->release(p);  // the cache holds the installed ones
    for (int32_t p : wfresh) pool_g1_->release(p);
    for (int32_t p : held) pool_g1_->release(p);
    cache_->unpin(m.handle);
    metrics_.add_tier_loaded_pages(n_ok);
  }
}

void Engine::swap_out(Sequence& s) {
  const int32_t bs = cfg_.block_size;
  int64_t n = s.n_computed;
  if (s.first_evicted_page >= 0) n = std::min(n, s.first_evicted_page * bs);
  const std::string& ns = s.rs->req.params.cache_namespace;
  const std::vector<PageHash> hashes = cache_->hash_pages(ns, s.tokens.data(), n / bs * bs);
  for (size_t k = 0; k < hashes.size(); ++k) {
    const int32_t wp = pool_g1_ && k < s.table_g1.pages.size() ? s.table_g1.pages[k] : -1;
    tiers_->store(hashes[k], k > 0 ? hashes[k - 1] : PageHash{}, ns, s.tokens.data() + k * bs, s.table.pages[k], wp);
  }
  s.tier_checked = false;  // until resumed, it looks for them below RAM when RAM lets them go
  s.swapped = true;
  s.tier_miss_at = -1;
}

int32_t Engine::prompt_tail(const Sequence& s, std::vector<int32_t>* tokens) const {
  const int32_t bs = cfg_.block_size;
  if (!tiers_ || staged_kv_ || pool_g1_ || s.evict.active() || s.n_prompt < 2) return 0;
  const int64_t full = (s.n_prompt - 1) / bs;  // full pages before it: the cache never matches the tail's page
  const int32_t t = static_cast<int32_t>(s.n_prompt - full * bs);
  if (t < 2) return 0;  // the last token is computed anyway
  if (tokens) {
    tokens->assign(s.tokens.begin(), s.tokens.begin() + s.n_prompt);
    tokens->resize(static_cast<size_t>((full + 1) * bs), -1);
  }
  return t;
}

void Engine::store_prompt_tail(Sequence& s) {
  std::vector<int32_t> toks;
  const int32_t bs = cfg_.block_size;
  // A tail of block_size tokens is a full page: write-through has stored it already.
  if (s.index != 0 || s.n_computed < s.n_prompt || s.first_evicted_page >= 0) return;
  if (const int32_t t = prompt_tail(s, &toks); t == 0 || t == bs) return;
  const int64_t last = static_cast<int64_t>(toks.size()) / bs - 1;
  if (last >= static_cast<int64_t>(s.table.pages.size()) || s.table.pages[last] < 0) return;
  const std::string& ns = s.rs->req.params.cache_namespace;
  const std::vector<PageHash> hashes = cache_->hash_pages(ns, toks.data(), static_cast<int64_t>(toks.size()));
  const PageHash parent = last > 0 ? hashes[last - 1] : PageHash{};
  metrics_.add_tier_tail(tiers_->store_tail(hashes.back(), parent, ns, toks.data() + last * bs, s.table.pages[last])
                             ? TailEvent::kStored
                             : TailEvent::kDropped);
}

bool Engine::copy_partial_page(Sequence& s, const PrefixMatch& m) {
  // Pages whose slots are quantized when the page fills would be quantized twice (the copied
  // slots read back into staging), and a long-context policy keeps per-token state of its own:
  // both compute these tokens instead.
  if (m.n_partial <= 0 || staged_kv_ || pool_g1_ || s.evict.active()) return false;
  const int32_t src = m.partial_page;
  pool_->retain(src);  // the cache's page is unpinned: eviction for room must not free it
  bool ok = pool_->can_allocate(1) || cache_->ensure_free(1);
  std::vector<int32_t> page;
  if (ok) {
    pool_->allocate(1, &page);
    ok = pool_->copy_page(src, page[0]);
    if (!ok) pool_->release(page[0]);
  }
  pool_->release(src);
  if (!ok) return false;
  // Slots [n_partial, block_size) hold the other prompt's tokens: this sequence overwrites
  // them as it computes, and nothing reads a slot before its position is computed.
  s.table.pages.push_back(page[0]);
  s.n_computed = s.table.n_tokens = m.n_tokens + m.n_partial;
  return true;
}

bool Engine::install_prompt_tail(Sequence& s, int64_t n_matched) {
  const int32_t t = prompt_tail(s);
  const int32_t bs = cfg_.block_size;
  // Only right after every full page before it: the tail's slots are positions n_prompt - t...
  if (t == 0 || n_matched != s.n_prompt - t || n_matched % bs != 0) return false;
  if (!pool_->can_allocate(1) && !cache_->ensure_free(1)) return false;
  std::vector<int32_t> page;
  pool_->allocate(1, &page);
  if (!tiers_->install(s.tail_blob, *pool_, page[0])) {
    pool_->release(page[0]);
    return false;
  }
  s.table.pages.push_back(page[0]);
  // ...and the last token is computed here: its logits give the first decoded token.
  s.n_computed = s.table.n_tokens = s.n_prompt - 1;
  return true;
}

void Engine::store_finished_path(const Sequence& s) {
  // Write-through: pages go down as they fill, and only then (a page RAM already held, reused
  // by this sequence, was not written again). When a sequence ends its whole published path
  // goes down once more: the pages the disk holds are refreshed (this use is their recency
  // there), the ones it dropped since, while RAM still served them, are written again (a
  // restart or a crash found the prefix gone), and on hybrid models the last window goes with
  // its window pages, which a later request (or a decode instance) continuing this one needs:
  // pages went down without them as they filled.
  if (!tiers_ || !cache_ || !tiers_->config().write_through || s.pin.empty() || !cache_->is_valid(s.pin)) return;
  const std::vector<int32_t> pages = cache_->path_pages(s.pin);
  const std::vector<int32_t> wpages = pool_g1_ ? cache_->path_window_pages(s.pin) : std::vector<int32_t>();
  const int64_t n = static_cast<int64_t>(pages.size());
  if (n == 0) return;
  const int32_t bs = cfg_.block_size;
  const std::string& ns = s.rs->req.params.cache_namespace;
  const std::vector<PageHash> hashes = cache_->hash_pages(ns, s.tokens.data(), n * bs);
  const int64_t first_window = pool_g1_ ? cache_->window_first_page(n - 1) : n;
  for (int64_t k = 0; k < n; ++k)
    tiers_->store(hashes[k], k > 0 ? hashes[k - 1] : PageHash{}, ns, s.tokens.data() + k * bs, pages[k],
                  k >= first_window ? wpages[k] : -1, 0, /*ram_keeps=*/true);
}

void Engine::flush_tiers() {
  if (tiers_) tiers_->flush();
}

uint64_t Engine::tier_write_mark() const { return tiers_ ? tiers_->write_mark() : 0; }

bool Engine::wait_tier_writes(uint64_t mark, double timeout_s) { return !tiers_ || tiers_->wait_written(mark, timeout_s); }

uint64_t Engine::tier_lost_writes() const { return tiers_ ? tiers_->lost_writes() : 0; }

void Engine::maybe_finish_request(Sequence& s) {
  RequestState& rs = *s.rs;
  if (--rs.n_unfinished > 0) return;
  const CancelReason why = rs.req.stream->cancel_reason();
  const bool aborted = why != CancelReason::kNone;
  Usage u;
  u.prompt_tokens = static_cast<int32_t>(rs.req.prompt.size());
  u.completion_tokens = rs.completion_tokens;
  u.cached_tokens = std::max(rs.cached_tokens, 0);
  const EvictionConfig ev = policy_of(rs.req.params);
  if (ev.active()) {
    u.kv_policy = ev.describe(cfg_.block_size);
    u.kv_tokens_kept = rs.kv_tokens_kept;
    u.kv_tokens_evicted = rs.kv_tokens_evicted;
    u.kv_tokens_reindexed = rs.kv_tokens_reindexed;
  }
  // One reason per request (vLLM's finished_reason): cancelled, else cut by its length limit if
  // any choice was, else stopped. The metrics and the dashboard's row say the same.
  const FinishReason reason = aborted ? FinishReason::kAbort : rs.n_length > 0 ? FinishReason::kLength : FinishReason::kStop;
  // Metrics first: a client that sees its response must also see it counted.
  metrics_.add_finished(reason, why);
  const auto done = Clock::now();
  metrics_.observe_e2e(seconds(rs.req.arrival, done));
  const double unset = -1;
  metrics_.observe_request(rs.scheduled_at ? seconds(rs.req.arrival, *rs.scheduled_at) : unset,
                           rs.scheduled_at && rs.first_token_at ? seconds(*rs.scheduled_at, *rs.first_token_at) : unset,
                           rs.first_token_at ? seconds(*rs.first_token_at, done) : unset,
                           rs.scheduled_at ? seconds(*rs.scheduled_at, done) : unset, u.prompt_tokens, u.completion_tokens);
  finishing_.emplace_back(rs.req.stream, u);  // done at the end of the step, after the gauges
  dash_.timelines().finished(rs.req.id, rs.req.params.cache_namespace, rs.req.arrival, dash_.since_epoch(Clock::now()),
                             finish_reason_name(reason), u.prompt_tokens, u.completion_tokens, u.cached_tokens,
                             rs.req.params.max_tokens * rs.req.params.n, rs.req.params.n);
}

void Engine::end_finished_streams() {
  for (auto& [stream, usage] : finishing_) stream->finish_all(usage);
  finishing_.clear();
}

void Engine::record_kv_outcome(Sequence& s) {
  if (!s.evict.active()) return;
  const int64_t kept = kept_tokens(s.table.pages, s.n_computed, cfg_.block_size);
  s.rs->kv_tokens_kept += kept;
  s.rs->kv_tokens_evicted += s.evicted_tokens;
  s.rs->kv_tokens_reindexed += s.reindexed;
  if (s.evict.evicts()) metrics_.observe_kv_kept(kept);
}

void Engine::push_finish(Sequence& s, const char* reason) {
  s.rs->req.stream->push(StreamEvent{StreamEvent::kFinish, s.index, "", {}, reason, "", 0, {}, {}, "", -1});
  // A request with n > 1 whose children do not exist yet finishes them all at once.
  RequestState& rs = *s.rs;
  const bool length = std::strcmp(reason, "length") == 0;
  rs.n_length += length;
  if (rs.req.params.n > 1 && !rs.forked) {
    rs.forked = true;
    for (int32_t i = 1; i < rs.req.params.n; ++i) {
      rs.req.stream->push(StreamEvent{StreamEvent::kFinish, i, "", {}, reason, "", 0, {}, {}, "", -1});
      rs.n_length += length;
      --rs.n_unfinished;
    }
  }
}

void Engine::finish(Sequence& s, const char* reason) {
  push_finish(s, reason);
  record_kv_outcome(s);
  release(s);
  maybe_finish_request(s);
}

bool Engine::step() {
  std::lock_guard<std::mutex> l(state_mu_);
  const auto t0 = Clock::now();
  drain_incoming();
  Plan plan;
  const size_t running_before = running_.size(), waiting_before = waiting_.size();
  const bool work = schedule(&plan);
  note_runs(plan, t0);
  // Admissions and preemptions are in the gauges before the forward: a long prefill step once
  // showed an admitted request as neither running nor waiting for its whole length.
  if (running_.size() != running_before || waiting_.size() != waiting_before) publish_gauges();
  double phase[kNumStepPhases] = {};
  phase[static_cast<int>(StepPhase::kSchedule)] = seconds(t0, Clock::now());
  sample_seconds_ = 0;
  if (!plan.items.empty()) {
    const size_t n_logits = static_cast<size_t>(plan.batch.n_logit_rows()) * model_.config().n_vocab;
    if (logits_.size() < n_logits) logits_.resize(n_logits);
    PagePool* pools[2] = {pool_.get(), pool_g1_.get()};
    if (cold_) cold_->set_keep_free(cold_reserve(nullptr, 0));  // the room every running sequence past its budget may read into
    Status st = model_.forward(plan.batch, pools, *threads_, logits_.data());
    const LlamaModel::ForwardTimes& ft = model_.last_forward_times();
    phase[static_cast<int>(StepPhase::kAttention)] = ft.attention;
    phase[static_cast<int>(StepPhase::kLogits)] = ft.logits;
    phase[static_cast<int>(StepPhase::kMatmul)] = std::max(0.0, ft.total - ft.attention - ft.logits);
    const auto t_post = Clock::now();
    if (!st) {
      // A forward failure is a bug or a bad token; fail the affected requests, keep serving.
      for (auto& it : plan.items) it.seq->rs->req.stream->push(StreamEvent{StreamEvent::kError, it.seq->index, "", {}, "", st.message(), 500, {}, {}, "", -1});
      for (auto& it : plan.items) it.seq->rs->req.stream->cancel(CancelReason::kError);
    } else {
      postprocess(plan, logits_.data());
    }
    // Prompt logprobs' rows can take 64 MiB (prompt_logit_rows_cap): not kept past their step.
    if (!prompt_rows_.empty() && plan.batch.n_logit_rows() > cfg_.max_num_seqs + 16) std::vector<float>().swap(logits_);
    publish_gauges();
    phase[static_cast<int>(StepPhase::kSample)] = sample_seconds_;
    phase[static_cast<int>(StepPhase::kPostprocess)] = std::max(0.0, seconds(t_post, Clock::now()) - sample_seconds_);
    metrics_.observe_step(phase);
  } else {
    publish_gauges();
  }
  // A client that sees its request done also sees its pages back (pages_in_use, /metrics).
  end_finished_streams();
  if (const auto t_dash = Clock::now(); dash_.end_step(metrics_)) publish_dashboard(t_dash);
  return work;
}

void Engine::publish_gauges() {
  // Cold-page fetches that found no free pool page read without those pages: say so (at most once
  // a minute), or a loaded server's outputs differ from an idle one's with only a counter to show.
  if (cold_) {
    const int64_t no_room = cold_->stats().no_room;
    const auto now = Clock::now();
    if (no_room > cold_no_room_told_ && now - cold_no_room_told_at_ > std::chrono::minutes(1)) {
      std::fprintf(stderr, "kv: %lld cold-page fetches found no free page in the KV cache and were read without it "
                   "(outputs then differ from a less loaded server's; raise --kv-cache-memory or lower --max-num-seqs)\n",
                   static_cast<long long>(no_room - cold_no_room_told_));
      cold_no_room_told_ = no_room;
      cold_no_room_told_at_ = now;
    }
  }
  // Pages held by requests = pages some block table references (the rest of the used pages
  // are held by the prefix cache alone).
  held_scratch_.assign(pool_->n_pages(), 0);
  int32_t held = 0;
  for (auto* q : {&running_, &waiting_})
    for (const auto& s : *q)
      for (int32_t p : s->table.pages)
        if (p >= 0 && !held_scratch_[p]++) ++held;
  const int32_t held_global = held;  // the usage gauge is over the global pool's pages
  if (pool_g1_) {
    held_scratch_.assign(pool_g1_->n_pages(), 0);
    for (auto* q : {&running_, &waiting_})
      for (const auto& s : *q)
        for (int32_t p : s->table_g1.pages)
          if (p >= 0 && !held_scratch_[p]++) ++held;
  }
  pages_in_use_.store(held);
  n_running_seqs_.store(static_cast<int32_t>(running_.size()));
  pages_cached_.store(cache_ ? cache_->n_cached_pages() : 0);
  window_pages_cached_.store(cache_ ? cache_->n_cached_window_pages() : 0);
  metrics_.set_gauges(static_cast<int64_t>(running_.size()), n_waiting_total_.load(), pool_->n_pages(), held_global);
  if (cache_) {
    PrefixCacheStats st = cache_->stats();
    metrics_.set_prefix_cache(st.queries_tokens, st.hit_tokens, st.evicted_pages, st.cached_pages, st.cached_window_pages,
                              st.evicted_window_pages, st.partial_tokens);
  }
}

MetricsSnapshot Engine::metrics() const {
  MetricsSnapshot m = metrics_.snapshot();
  if (cold_) {
    m.has_cold = true;
    m.cold = cold_->stats();
  }
  if (tiers_)
    for (TierSnapshot& t : tiers_->stats())
      m.tiers.push_back({t.s, Histogram(tier_load_buckets(), std::move(t.load_counts), t.load_sum, t.load_count)});
  return m;
}

// ---- KV dashboard (kv_snapshot.h) ------------------------------------------------------

void Engine::note_runs(const Plan& plan, Clock::time_point t0) {
  const double t = dash_.since_epoch(t0);
  for (const auto& it : plan.items) {
    const RequestState& rs = *it.seq->rs;
    // A prompt, or a recompute after preemption; a decode step with a draft also runs several tokens.
    const bool prefill = !it.draft && (it.n > 1 || it.seq->n_computed < it.seq->n_prompt);
    dash_.timelines().ran(rs.req.id, rs.req.params.cache_namespace, rs.req.arrival, t, it.n, prefill, it.logits);
  }
}

void Engine::publish_dashboard(Clock::time_point started) {
  std::vector<DashboardRecorder::Live> live;
  for (auto* q : {&running_, &waiting_})
    for (const auto& s : *q) {
      RequestView v;
      v.id = s->rs->req.id;
      v.index = s->index;
      v.ns = s->rs->req.params.cache_namespace;
      v.state = q == &running_ ? RequestView::kRunning : s->tier_ticket != 0 ? RequestView::kLoading : RequestView::kWaiting;
      v.n_prompt = s->n_prompt;
      v.n_generated = s->n_generated;
      v.max_tokens = s->rs->req.params.max_tokens;
      v.n_choices = s->rs->req.params.n;
      v.n_computed = s->n_computed;
      v.cached_tokens = s->rs->cached_tokens;
      v.arrival = dash_.since_epoch(s->rs->req.arrival);
      live.push_back({std::move(v), &s->table.pages, pool_g1_ ? &s->table_g1.pages : nullptr});
    }
  std::vector<std::pair<std::string, int64_t>> tier_pages;
  if (tiers_)
    for (const TierSnapshot& t : tiers_->stats()) tier_pages.emplace_back(t.s.tier, t.s.pages_stored);
  dash_.publish(std::move(live), *pool_, pool_g1_.get(), cache_.get(), std::move(tier_pages), started);
}

Status Engine::check_integrity() const {
  inspectors_.fetch_add(1);
  std::unique_lock<std::mutex> l(state_mu_);
  inspectors_.fetch_sub(1);
  if (Status st = pool_->check_integrity(); !st) return st;
  // Positions stay below max_model_len (past it, sequences re-index: kv/kv_reindex.h), and a
  // sequence's token list is what its pages cover plus at most the one token not computed yet.
  for (auto* q : {&running_, &waiting_})
    for (const auto& s : *q)
      if (s->n_computed > cfg_.max_model_len || static_cast<int64_t>(s->tokens.size()) > cfg_.max_model_len + 1)
        return Status::error("sequence " + std::to_string(s->id) + ": " + std::to_string(s->n_computed) + " positions computed, " +
                             std::to_string(s->tokens.size()) + " tokens, past max_model_len " + std::to_string(cfg_.max_model_len));
  // Every page reference is held by a sequence's table entry or by the prefix cache.
  std::vector<int32_t> held(pool_->n_pages(), 0);
  for (auto* q : {&running_, &waiting_})
    for (const auto& s : *q)
      for (int32_t p : s->table.pages)
        if (p >= 0) ++held[p];  // -1: evicted
  if (cold_) {  // every slot reference of the spill file is a table's
    int64_t refs = 0;
    for (auto* q : {&running_, &waiting_})
      for (const auto& s : *q)
        if (Status st = s->cold.check(&refs); !st) return st;
    if (refs != cold_->total_refs())
      return Status::error("cold store: " + std::to_string(cold_->total_refs()) + " slot references, " + std::to_string(refs) + " held by tables");
  }
  std::vector<int32_t> held1;
  if (pool_g1_) {  // sliding-window layers: every reference is a table entry or the cache's
    if (Status st = pool_g1_->check_integrity(); !st) return Status::error("sliding-window pool: " + st.message());
    held1.assign(pool_g1_->n_pages(), 0);
    for (auto* q : {&running_, &waiting_})
      for (const auto& s : *q)
        for (int32_t p : s->table_g1.pages)
          if (p >= 0) ++held1[p];
    if (!cache_)
      for (int32_t p = 0; p < pool_g1_->n_pages(); ++p)
        if (held1[p] != pool_g1_->refcount(p))
          return Status::error("sliding-window page " + std::to_string(p) + " has refcount " + std::to_string(pool_g1_->refcount(p)) +
                               " but " + std::to_string(held1[p]) + " holders");
  }
  if (cache_) return cache_->check_integrity(held, held1);
  for (int32_t p = 0; p < pool_->n_pages(); ++p)
    if (held[p] != pool_->refcount(p))
      return Status::error("page " + std::to_string(p) + " has refcount " + std::to_string(pool_->refcount(p)) + " but " +
                           std::to_string(held[p]) + " holders");
  return Status::ok();
}

}  // namespace kv
