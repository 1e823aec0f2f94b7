// kvserve perplexity: perplexity of a text file, computed the way llama.cpp's llama-perplexity
// does, and the KL divergence of this run's next-token distributions from a saved base run.
//
// Method (llama.cpp tools/perplexity/perplexity.cpp, perplexity()): the whole file is
// tokenized once (BOS prepended when the model's metadata says add_bos; one trailing "\n"
// dropped, as llama.cpp's -f does), cut into non-overlapping windows of --ctx tokens (a
// trailing partial window is dropped; at least two windows are required). Each window is a
// fresh sequence; when the model adds BOS, the window's first token is replaced by BOS. Only
// the second half is scored: the logits at positions [ctx/2, ctx-1) predict tokens
// [ctx/2+1, ctx). PPL = exp(mean NLL); its ± is ppl × stderr of the NLL mean.
//
// --save-logits FILE writes the base of a later --kld-base comparison. Storing every
// log-prob is too big (llama.cpp's uint16 form is 96 KiB per token for a 49k vocab), so each
// scored token keeps its top-K log-probs plus the mass of everything else:
//
//   line 1   "kvserve-logits 1\n"
//   line 2   one JSON object + "\n": model fingerprint, n_vocab, ctx, first, n_windows,
//            n_scored_per_window, tokens_xxh64 (of every window's tokens as fed), add_bos,
//            top_k, record_bytes, kv_cache_dtype, and a "format" string repeating this layout
//   records  n_windows × n_scored_per_window, in window then position order, little-endian:
//              f32 nll                 -log p(next token)
//              f32 tail_logprob        log of the probability outside the top K (may be -inf)
//              i32 ids[K]              top-K token ids, most probable first
//              f32 logprobs[K]         their log-probs
//
// KL(base ‖ this) is then computed over K+1 outcomes (the K base ids, and "anything else"):
// exact for the mass the base puts on its top K, and a lower bound overall (merging outcomes
// never raises a KL). With K = 64 (--save-top-k) the tail holds 8% of the mass on average
// for SmolLM2 on Pride and Prejudice, and f32-vs-f16 KV reads 9% below its K = 4096 value
// (4% at K = 256); log-probs stay f32 because KLs of 1e-7 are what the precise dtypes show.
// Top-1 agreement compares the base's first id with this run's argmax. A base file is
// untrusted input: its header must match this run and its ids must be in the vocabulary.
#include <filesystem>
#include <sys/stat.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>

#include "tokenizer/utf8.h"
#include "commands.h"
#include "common/units.h"
#include "engine/sequence_runner.h"
#include "kernels/ops.h"
#include "loaded_model.h"

namespace kvtools {

namespace {

constexpr const char* kLogitsMagic = "kvserve-logits 1\n";
constexpr int kMinCtx = 16;
// Logit rows held at once (rows × n_vocab floats): bounded so a 262k vocab stays near 64 MiB.
constexpr int64_t kLogitBufferBytes = 64ll << 20;

struct PerplexityOptions {
  std::string model = kDefaultModel;
  std::string text;
  int ctx = 512;
  int chunks = 0;  // 0 = every full window
  int batch = 512;
  int threads = 0;
  int top_k = 64;
  int max_model_len = 0;  // 0: no limit on positions
  bool past_trained = false;
  bool json = false;
  std::string save_logits, kld_base;
  KvOptions kvo;
  EvictionOptions evo;
};

// --- statistics

struct MeanErr {
  double mean, err;  // err: standard error of the mean
};
MeanErr mean_and_err(double sum, double sum2, int64_t n) {
  if (n <= 0) return {0, 0};
  const double m = sum / n, var = sum2 / n - m * m;
  return {m, n > 1 && var > 0 ? std::sqrt(var / (n - 1)) : 0.0};
}

// Linear interpolation between order statistics, as llama.cpp's percentile().
double percentile(const std::vector<float>& sorted, double q) {
  if (sorted.empty()) return 0;
  const double p = q * (sorted.size() - 1);
  const size_t i = static_cast<size_t>(p);
  const double f = p - i;
  return (1 - f) * sorted[i] + f * sorted[std::min(i + 1, sorted.size() - 1)];
}

struct Totals {
  int64_t n = 0;
  double nll = 0, nll2 = 0;
  // Against a base (--kld-base).
  double nll_base = 0, nll_base2 = 0, nll_nll_base = 0, kld = 0, kld2 = 0;
  int64_t same_top = 0;
  std::vector<float> kld_values;
};

// --- the logits file

struct LogitsHeader {
  std::string fingerprint, tokens_hash, kv_dtype, model;
  int64_t n_vocab = 0, ctx = 0, first = 0, n_windows = 0, n_scored = 0, top_k = 0, record_bytes = 0;
  bool add_bos = false;

  nlohmann::json to_json() const {
    return {{"format", "after this line: n_windows*n_scored_per_window records of {f32 nll, f32 tail_logprob, i32 ids[top_k], "
                       "f32 logprobs[top_k]}, little-endian; ids most probable first; see tools/cmd_perplexity.cpp"},
            {"model", model},
            {"model_fingerprint", fingerprint},
            {"n_vocab", n_vocab},
            {"ctx", ctx},
            {"first", first},
            {"n_windows", n_windows},
            {"n_scored_per_window", n_scored},
            {"tokens_xxh64", tokens_hash},
            {"add_bos", add_bos},
            {"top_k", top_k},
            {"record_bytes", record_bytes},
            {"kv_cache_dtype", kv_dtype}};
  }
};

int64_t record_bytes_for(int64_t k) { return 8 + 8 * k; }

// One record's fields inside a window's block of records.
struct RecordView {
  const uint8_t* p;
  int64_t k;
  float nll() const { return load_f32(p); }
  float tail_logprob() const { return load_f32(p + 4); }
  int32_t id(int64_t i) const {
    int32_t v;
    std::memcpy(&v, p + 8 + 4 * i, 4);
    return v;
  }
  float logprob(int64_t i) const { return load_f32(p + 8 + 4 * k + 4 * i); }
  static float load_f32(const uint8_t* q) {
    float v;
    std::memcpy(&v, q, 4);
    return v;
  }
};

// Reads and checks a base file's header against this run; leaves `in` at the first record.
LogitsHeader open_base(const std::string& path, std::ifstream& in, const LogitsHeader& want) {
  in.open(path, std::ios::binary);
  if (!in) fail("--kld-base: cannot open " + path);
  std::string magic, line;
  std::getline(in, magic);
  if (magic + "\n" != kLogitsMagic) fail("--kld-base: " + path + " is not a kvserve logits file (made by --save-logits)");
  std::getline(in, line);
  LogitsHeader h;
  try {
    auto j = nlohmann::json::parse(line);
    h.fingerprint = j.at("model_fingerprint");
    h.tokens_hash = j.at("tokens_xxh64");
    h.kv_dtype = j.at("kv_cache_dtype");
    h.model = j.at("model");
    h.n_vocab = j.at("n_vocab");
    h.ctx = j.at("ctx");
    h.first = j.at("first");
    h.n_windows = j.at("n_windows");
    h.n_scored = j.at("n_scored_per_window");
    h.top_k = j.at("top_k");
    h.record_bytes = j.at("record_bytes");
    h.add_bos = j.at("add_bos");
  } catch (const std::exception& e) {
    fail("--kld-base: " + path + " has a bad header: " + one_line(e.what()));
  }
  const std::string base = "--kld-base " + path + " ";
  if (h.fingerprint != want.fingerprint || h.n_vocab != want.n_vocab)
    fail(base + "was made with a different model (" + one_line(h.model) + ", fingerprint " + one_line(h.fingerprint) + "; this run: " +
         want.model + ", " + want.fingerprint + ")");
  if (h.ctx != want.ctx) fail(base + "was made with --ctx " + std::to_string(h.ctx) + ", this run uses --ctx " + std::to_string(want.ctx));
  if (h.n_windows != want.n_windows)
    fail(base + "holds " + std::to_string(h.n_windows) + " windows, this run scores " + std::to_string(want.n_windows) +
         " (use the same text and --chunks)");
  if (h.tokens_hash != want.tokens_hash || h.add_bos != want.add_bos)
    fail(base + "was made from a different text (token hash " + one_line(h.tokens_hash) + ", this run " + want.tokens_hash + ")");
  if (h.first != want.first || h.n_scored != want.n_scored || h.top_k < 1 || h.top_k > want.n_vocab ||
      h.record_bytes != record_bytes_for(h.top_k))
    fail(base + "has an inconsistent header");
  const std::streamoff start = in.tellg();
  in.seekg(0, std::ios::end);
  const std::streamoff size = in.tellg();
  if (size - start != h.n_windows * h.n_scored * h.record_bytes)
    fail(base + "is truncated or has trailing data (" + std::to_string(size - start) + " record bytes, expected " +
         std::to_string(h.n_windows * h.n_scored * h.record_bytes) + ")");
  in.seekg(start);
  return h;
}

// --- scoring one logits row

struct RowResult {
  float nll, kld;
  bool same_top;
  float nll_base;
};

// logits: [n_vocab] for the position predicting `target`. scratch: [n_vocab]. base: this
// position's base record, or null. save: where to write this position's record, or null.
RowResult score_row(const float* logits, int64_t nv, int32_t target, float* scratch, std::vector<std::pair<float, int32_t>>& heap,
                    const RecordView* base, uint8_t* save, int64_t save_k) {
  int32_t argmax = 0;
  for (int64_t i = 0; i < nv; ++i) {
    scratch[i] = logits[i];
    if (logits[i] > logits[argmax]) argmax = static_cast<int32_t>(i);
  }
  const double lse = kv::softmax(scratch, nv);  // scratch = p
  double total = 0;
  for (int64_t i = 0; i < nv; ++i) total += scratch[i];
  RowResult r{static_cast<float>(lse - logits[target]), 0.f, false, 0.f};
  auto tail_of = [&](auto id_at, int64_t k) {  // log p(outside the ids), no cancellation issue:
    double head = 0;                            // both sums add the same float p values
    for (int64_t i = 0; i < k; ++i) head += scratch[id_at(i)];
    const double tail = std::max(0.0, total - head) / total;
    return tail > 0 ? std::log(tail) : -INFINITY;
  };
  if (base) {
    double kl = 0;
    for (int64_t i = 0; i < base->k; ++i) {
      const double lpb = base->logprob(i);
      kl += std::exp(lpb) * (lpb - (logits[base->id(i)] - lse));
    }
    const double lpb_tail = base->tail_logprob();
    if (std::isfinite(lpb_tail)) {
      const double lpc_tail = std::max(tail_of([&](int64_t i) { return base->id(i); }, base->k), -1e30);
      kl += std::exp(lpb_tail) * (lpb_tail - lpc_tail);
    }
    r.kld = static_cast<float>(kl);
    r.same_top = base->id(0) == argmax;
    r.nll_base = base->nll();
  }
  if (save) {
    // Top K by logit: a min-heap of the K best seen, ordered by (logit, then lower id first).
    auto better = [](const std::pair<float, int32_t>& a, const std::pair<float, int32_t>& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    };
    heap.clear();
    for (int64_t i = 0; i < nv; ++i) {
      std::pair<float, int32_t> e{logits[i], static_cast<int32_t>(i)};
      if (static_cast<int64_t>(heap.size()) < save_k) {
        heap.push_back(e);
        std::push_heap(heap.begin(), heap.end(), better);
      } else if (better(e, heap.front())) {
        std::pop_heap(heap.begin(), heap.end(), better);
        heap.back() = e;
        std::push_heap(heap.begin(), heap.end(), better);
      }
    }
    std::sort(heap.begin(), heap.end(), better);
    const float tail = static_cast<float>(tail_of([&](int64_t i) { return heap[i].second; }, save_k));
    std::memcpy(save, &r.nll, 4);
    std::memcpy(save + 4, &tail, 4);
    for (int64_t i = 0; i < save_k; ++i) {
      const float lp = static_cast<float>(heap[i].first - lse);
      std::memcpy(save + 8 + 4 * i, &heap[i].second, 4);
      std::memcpy(save + 8 + 4 * save_k + 4 * i, &lp, 4);
    }
  }
  return r;
}

std::string hex64(uint64_t v) {
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

std::string fmt_duration(double s) {
  char buf[32];
  const int t = static_cast<int>(s + 0.5);
  if (t >= 3600)
    std::snprintf(buf, sizeof buf, "%dh%02dm%02ds", t / 3600, t / 60 % 60, t % 60);
  else
    std::snprintf(buf, sizeof buf, "%dm%02ds", t / 60, t % 60);
  return buf;
}

// --- the command

void run_perplexity(const PerplexityOptions& o) {
  using clock = std::chrono::steady_clock;
  // Cheap checks first: a bad flag should not wait for the model to load.
  if (o.ctx < kMinCtx) fail("--ctx " + std::to_string(o.ctx) + " is too small (at least " + std::to_string(kMinCtx) + ")");
  if (o.ctx % 2 != 0) fail("--ctx " + std::to_string(o.ctx) + " is odd: the scored second half starts at ctx/2, use an even --ctx");
  if (!o.save_logits.empty() && o.save_logits == o.kld_base) fail("--save-logits and --kld-base name the same file");
  if (struct stat st {}; !o.save_logits.empty() && stat(o.save_logits.c_str(), &st) == 0 && S_ISDIR(st.st_mode))
    fail("--save-logits " + o.save_logits + " is a directory: give a file name");
  std::string text;
  {
    std::ifstream in(o.text, std::ios::binary);
    if (!in) fail("text file not found or unreadable: " + o.text + (o.text.rfind("data/text/", 0) == 0 ? " (run `make text` to fetch it)" : ""));
    std::ostringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  if (!text.empty() && text.back() == '\n') text.pop_back();  // as llama.cpp's -f
  if (text.empty()) fail(std::filesystem::is_directory(o.text) ? o.text + " is a directory, not a text file" : "text file " + o.text + " is empty");
  // A binary file tokenizes to byte tokens and gives a number that means nothing.
  if (!kv::utf8::is_valid(text)) fail(o.text + " is not UTF-8 text");

  const bool progress_tty = isatty(fileno(stderr));
  LoadedModel lm = load_model(o.model, o.threads, o.kvo, false);
  const auto& cfg = lm.model->config();
  const kv::KvLayout& layout = lm.pool->layout();
  // KV bytes one token costs: every layer group (a sliding-window group only while the
  // token is inside its window, which it always is when ctx <= window).
  const double kv_bytes_per_token = layout.bytes_per_token() + (lm.pool_g1 ? lm.pool_g1->layout().bytes_per_token() : 0.0);
  const std::string kv_desc = layout.describe();
  // Positions a window uses: its length, or --max-model-len when re-indexing keeps them below.
  const int64_t positions = o.max_model_len > 0 ? std::min(o.ctx, o.max_model_len) : o.ctx;
  if (positions > cfg.n_ctx_train && !o.past_trained)
    fail("--ctx " + std::to_string(o.ctx) + " exceeds the model's context length " + std::to_string(cfg.n_ctx_train) +
         " (--max-model-len with an evicting --kv-eviction keeps positions below it; --past-trained-context measures past it)");
  const int64_t pool_tokens = int64_t(lm.pool->n_pages()) * layout.block_size;
  // With cold pages the pool holds the budget, one slice of new positions and what Quest reads back.
  const int64_t need_tokens = o.evo.offload_cold ? std::min<int64_t>(o.ctx, o.evo.budget + 2 * int64_t(o.batch)) : o.ctx;
  if (pool_tokens < need_tokens)
    fail("--kv-cache-memory " + o.kvo.memory + " holds " + std::to_string(pool_tokens) + " tokens, --ctx needs " + std::to_string(need_tokens));

  auto t_tok = clock::now();
  const std::vector<int32_t> tokens = lm.tokenizer->encode(text, true, false);
  const double tok_s = std::chrono::duration<double>(clock::now() - t_tok).count();
  const int64_t n_tok = static_cast<int64_t>(tokens.size());
  if (n_tok < 2 * int64_t(o.ctx))
    fail(o.text + " tokenizes to only " + std::to_string(n_tok) + " tokens; --ctx " + std::to_string(o.ctx) + " needs at least " +
         std::to_string(2 * int64_t(o.ctx)) + " (two windows)");
  const int64_t n_win_max = n_tok / o.ctx;
  const int64_t n_win = o.chunks > 0 ? std::min<int64_t>(o.chunks, n_win_max) : n_win_max;
  const int64_t ctx = o.ctx, first = ctx / 2, n_scored = ctx - 1 - first;
  const int64_t nv = cfg.n_vocab;
  const bool add_bos = lm.tokenizer->add_bos() && lm.tokenizer->bos_id() >= 0;

  // Every window exactly as fed (BOS in front when the model adds it): what the base file's
  // token hash covers.
  std::vector<int32_t> windows(tokens.begin(), tokens.begin() + n_win * ctx);
  if (add_bos)
    for (int64_t w = 0; w < n_win; ++w) windows[w * ctx] = lm.tokenizer->bos_id();

  LogitsHeader here;
  here.model = o.model;
  here.fingerprint = hex64(lm.model->fingerprint());
  here.tokens_hash = hex64(XXH64(windows.data(), windows.size() * sizeof(int32_t), 0));
  here.kv_dtype = kv_desc;
  here.n_vocab = nv;
  here.ctx = ctx;
  here.first = first;
  here.n_windows = n_win;
  here.n_scored = n_scored;
  here.add_bos = add_bos;
  here.top_k = std::min<int64_t>(o.top_k, nv);
  here.record_bytes = record_bytes_for(here.top_k);

  std::ifstream base_in;
  LogitsHeader base_h;
  if (!o.kld_base.empty()) base_h = open_base(o.kld_base, base_in, here);
  std::ofstream save_out;
  const std::string save_tmp = o.save_logits + ".tmp";
  if (!o.save_logits.empty()) {
    save_out.open(save_tmp, std::ios::binary | std::ios::trunc);
    if (!save_out) fail("--save-logits: cannot write " + save_tmp);
    save_out << kLogitsMagic << here.to_json().dump() << "\n";
  }

  std::fprintf(stderr, "perplexity: %s: %lld tokens (tokenized in %.2f s), %lld windows of %lld, scoring %lld tokens each%s\n",
               o.text.c_str(), static_cast<long long>(n_tok), tok_s, static_cast<long long>(n_win), static_cast<long long>(ctx),
               static_cast<long long>(n_scored), add_bos ? ", BOS first" : "");

  const int64_t rows_cap = std::max<int64_t>(1, std::min<int64_t>(o.batch, kLogitBufferBytes / (nv * 4)));
  std::unique_ptr<kv::ColdStore> cold = make_cold_store(o.evo, *lm.pool);  // outlives seq, which holds its slots
  kv::SequenceRunner seq(*lm.model, *lm.pool, lm.pool_g1.get(), *lm.threads, o.batch);
  const kv::EvictionConfig evc = make_eviction(o.evo, layout.block_size);
  if (kv::Status st = seq.set_eviction(evc, cold.get()); !st) fail(st.message());
  seq.set_max_positions(o.max_model_len);
  if (o.max_model_len > 0 && first > o.max_model_len) fail("--max-model-len " + std::to_string(o.max_model_len) + " is below the window's prompt half (" + std::to_string(first) + " tokens)");
  if (evc.active()) std::fprintf(stderr, "perplexity: KV policy %s (the first half of each window is the prompt, the rest decoded)\n", evc.describe(layout.block_size).c_str());
  int64_t kept_sum = 0, evicted_sum = 0, reindexed_sum = 0;
  const int nth = lm.threads->size();
  std::vector<float> logits;                                  // [rows][n_vocab]
  std::vector<std::vector<float>> scratch(nth, std::vector<float>(nv));
  std::vector<std::vector<std::pair<float, int32_t>>> heaps(nth);
  std::vector<uint8_t> base_block(o.kld_base.empty() ? 0 : n_scored * base_h.record_bytes);   // one window
  std::vector<uint8_t> save_block(o.save_logits.empty() ? 0 : n_scored * here.record_bytes);  // one window
  std::vector<RowResult> rows(n_scored);
  Totals tot;
  tot.kld_values.reserve(o.kld_base.empty() ? 0 : n_win * n_scored);

  const auto t0 = clock::now();
  auto last_print = t0;
  for (int64_t w = 0; w < n_win; ++w) {
    const int32_t* win = windows.data() + w * ctx;
    if (!o.kld_base.empty() && !base_in.read(reinterpret_cast<char*>(base_block.data()), static_cast<std::streamsize>(base_block.size())))
      fail("--kld-base: read error in window " + std::to_string(w));
    for (int64_t j = 0; j < (o.kld_base.empty() ? 0 : n_scored); ++j) {  // ids index logits rows: check them
      RecordView bv{base_block.data() + j * base_h.record_bytes, base_h.top_k};
      for (int64_t i = 0; i < bv.k; ++i)
        if (bv.id(i) < 0 || bv.id(i) >= nv) fail("--kld-base " + o.kld_base + " is corrupt: token id " + std::to_string(bv.id(i)) + " out of range");
    }
    seq.reset();
    if (kv::Status st = seq.feed(win, first, false); !st) fail(st.message());
    // Positions [first, ctx-1) in slices of rows_cap; the last token is never an input.
    for (int64_t p0 = first; p0 < ctx - 1; p0 += rows_cap) {
      const int64_t n = std::min(rows_cap, ctx - 1 - p0);
      if (kv::Status st = seq.feed_all_logits(win + p0, n, &logits); !st) fail(st.message());
      lm.threads->run([&](int ith, int nth_run) {
        int64_t b, e;
        kv::ThreadPool::split(n, ith, nth_run, 1, &b, &e);
        for (int64_t r = b; r < e; ++r) {
          const int64_t j = p0 - first + r;  // scored index inside the window
          RecordView bv{base_block.data() + j * base_h.record_bytes, base_h.top_k};
          rows[j] = score_row(logits.data() + r * nv, nv, win[p0 + r + 1], scratch[ith].data(), heaps[ith],
                              o.kld_base.empty() ? nullptr : &bv, o.save_logits.empty() ? nullptr : save_block.data() + j * here.record_bytes,
                              here.top_k);
        }
      });
    }
    // Reduced in position order: the sums do not depend on the thread count.
    for (const RowResult& r : rows) {
      tot.nll += r.nll;
      tot.nll2 += double(r.nll) * r.nll;
      if (!o.kld_base.empty()) {
        tot.nll_base += r.nll_base;
        tot.nll_base2 += double(r.nll_base) * r.nll_base;
        tot.nll_nll_base += double(r.nll) * r.nll_base;
        tot.kld += r.kld;
        tot.kld2 += double(r.kld) * r.kld;
        tot.same_top += r.same_top;
        tot.kld_values.push_back(r.kld);
      }
    }
    tot.n += n_scored;
    kept_sum += seq.kept_tokens();
    evicted_sum += seq.evicted_tokens();
    reindexed_sum += seq.reindexed_tokens();
    if (!o.save_logits.empty() && !save_out.write(reinterpret_cast<const char*>(save_block.data()), static_cast<std::streamsize>(save_block.size()))) {
      std::remove(save_tmp.c_str());
      fail("--save-logits: write error on " + save_tmp);
    }

    const auto now = clock::now();
    const bool last = w + 1 == n_win;
    if (progress_tty || last || now - last_print >= std::chrono::seconds(5)) {
      last_print = now;
      const double el = std::chrono::duration<double>(now - t0).count();
      const double tps = (w + 1) * (ctx - 1) / el;
      std::fprintf(stderr, "%s[%lld/%lld] PPL %.4f", progress_tty ? "\r" : "", static_cast<long long>(w + 1),
                   static_cast<long long>(n_win), std::exp(tot.nll / tot.n));
      if (!o.kld_base.empty()) std::fprintf(stderr, ", KLD %.6f", tot.kld / tot.n);
      std::fprintf(stderr, ", %.0f tok/s, %s elapsed, ETA %s   %s", tps, fmt_duration(el).c_str(),
                   fmt_duration(el / (w + 1) * (n_win - w - 1)).c_str(), progress_tty && !last ? "" : "\n");
    }
  }
  const double seconds = std::chrono::duration<double>(clock::now() - t0).count();
  if (!o.save_logits.empty()) {
    save_out.close();
    if (!save_out || std::rename(save_tmp.c_str(), o.save_logits.c_str()) != 0) {
      std::remove(save_tmp.c_str());
      fail("--save-logits: cannot finish " + o.save_logits);
    }
  }
  seq.reset();
  if (kv::Status st = lm.pool->check_integrity(); !st || lm.pool->n_used() != 0) fail("KV pool integrity: " + st.message());

  // --- report
  const MeanErr ln_ppl = mean_and_err(tot.nll, tot.nll2, tot.n);
  const double ppl = std::exp(ln_ppl.mean), ppl_err = ppl * ln_ppl.err;
  const double tps = n_win * (ctx - 1) / seconds;
  nlohmann::json j;
  j["model"] = o.model;
  j["text"] = o.text;
  j["n_text_tokens"] = n_tok;
  j["ctx"] = ctx;
  j["n_windows"] = n_win;
  j["n_tokens_scored"] = tot.n;
  j["ppl"] = ppl;
  j["ppl_stderr"] = ppl_err;
  j["kv_cache_dtype"] = kv::kv_dtype_name(layout.dtype);
  j["kv_eviction"] = {{"policy", kv::eviction_policy_name(evc.policy)}, {"budget", evc.budget}, {"sink_tokens", evc.sinks()},
                      {"recent_tokens", evc.evicts() ? evc.recent(layout.block_size) : 0}, {"obs_window", evc.obs_window},
                      {"sparse", evc.sparse() ? "quest" : "none"}, {"sparse_pages", evc.sparse_pages},
                      {"kept_tokens_per_window", double(kept_sum) / n_win}, {"evicted_tokens_per_window", double(evicted_sum) / n_win},
                      {"max_model_len", o.max_model_len}, {"reindexed_tokens_per_window", double(reindexed_sum) / n_win}};
  if (cold) j["kv_cold"] = cold_store_json(*cold, *lm.pool);
  if (!o.kvo.layer_dtypes.empty()) j["kv_cache_dtype_layers"] = o.kvo.layer_dtypes;
  j["kv_cache_layout"] = kv_desc;  // the dtype per layer range, as the page pool holds it
  j["kv_bytes_per_token"] = kv_bytes_per_token;
  j["threads"] = nth;
  j["seconds"] = seconds;
  j["tokens_per_s"] = tps;
  if (!o.save_logits.empty()) {
    j["saved_logits"] = o.save_logits;
    j["saved_logits_top_k"] = here.top_k;
  }
  double ppl_base = 0, dppl = 0, dppl_err = 0;
  MeanErr kl{}, ln_base{};
  std::vector<float>& kv_sorted = tot.kld_values;
  double top1 = 0, top1_err = 0;
  if (!o.kld_base.empty()) {
    ln_base = mean_and_err(tot.nll_base, tot.nll_base2, tot.n);
    ppl_base = std::exp(ln_base.mean);
    const double ppl_base_err = ppl_base * ln_base.err;
    // Covariance of the two NLL means (the same tokens are scored twice), as llama.cpp.
    const double cov = (tot.nll_nll_base / tot.n - ln_ppl.mean * ln_base.mean) / std::max<int64_t>(1, tot.n - 1);
    dppl = ppl - ppl_base;
    dppl_err = std::sqrt(std::max(0.0, ppl_err * ppl_err + ppl_base_err * ppl_base_err - 2.0 * ppl * ppl_base * cov));
    kl = mean_and_err(tot.kld, tot.kld2, tot.n);
    std::sort(kv_sorted.begin(), kv_sorted.end());
    top1 = double(tot.same_top) / tot.n;
    top1_err = tot.n > 1 ? std::sqrt(top1 * (1 - top1) / (tot.n - 1)) : 0.0;
    j["kld_base"] = o.kld_base;
    j["kld_base_kv_cache_dtype"] = base_h.kv_dtype;
    j["kld_top_k"] = base_h.top_k;
    j["ppl_base"] = ppl_base;
    j["delta_ppl"] = dppl;
    j["delta_ppl_stderr"] = dppl_err;
    j["kld"] = {{"mean", kl.mean},
                {"stderr", kl.err},
                {"median", percentile(kv_sorted, 0.5)},
                {"p90", percentile(kv_sorted, 0.9)},
                {"p99", percentile(kv_sorted, 0.99)},
                {"p99_9", percentile(kv_sorted, 0.999)},
                {"max", kv_sorted.back()}};
    j["top1_agreement"] = top1;
    j["top1_agreement_stderr"] = top1_err;
  }
  if (o.json) {
    std::printf("%s\n", j.dump().c_str());
    return;
  }
  std::printf("Final estimate: PPL = %.4f +/- %.5f\n", ppl, ppl_err);
  std::printf("  %lld tokens scored in %lld windows of %lld; KV %s, %s per token; %.1f s, %.0f tok/s\n", static_cast<long long>(tot.n),
              static_cast<long long>(n_win), static_cast<long long>(ctx), kv_desc.c_str(), kv::format_bytes(kv_bytes_per_token).c_str(),
              seconds, tps);
  if (!o.save_logits.empty()) std::printf("  saved top-%lld log-probs to %s\n", static_cast<long long>(here.top_k), o.save_logits.c_str());
  if (!o.kld_base.empty()) {
    std::printf("Versus %s (KV %s):\n", o.kld_base.c_str(), base_h.kv_dtype.c_str());
    std::printf("  PPL(base)     : %.4f\n  PPL - base    : %+.5f +/- %.5f\n", ppl_base, dppl, dppl_err);
    std::printf("  Mean KLD      : %.6g +/- %.2g\n", kl.mean, kl.err);
    std::printf("  KLD median    : %.6g\n  KLD 90%%       : %.6g\n  KLD 99%%       : %.6g\n  KLD 99.9%%     : %.6g\n  KLD max       : %.6g\n",
                percentile(kv_sorted, 0.5), percentile(kv_sorted, 0.9), percentile(kv_sorted, 0.99), percentile(kv_sorted, 0.999),
                static_cast<double>(kv_sorted.back()));
    std::printf("  Same top-1    : %.3f +/- %.3f %%\n", 100 * top1, 100 * top1_err);
  }
}

}  // namespace

void add_perplexity_command(CLI::App& app) {
  auto o = std::make_shared<PerplexityOptions>();
  CLI::App* cmd = app.add_subcommand("perplexity", "perplexity of a text file (llama-perplexity's method); KL divergence vs a saved base");
  cmd->add_option("-m,--model", o->model, "GGUF model path")->capture_default_str();
  cmd->add_option("-f,--file", o->text, "text file (UTF-8)")->required();
  cmd->add_option("-c,--ctx", o->ctx, "window length in tokens (even; the second half is scored)")->capture_default_str();
  cmd->add_option("--chunks", o->chunks, "score at most this many windows (default: all)")->check(positive());
  cmd->add_option("-b,--batch-size,--chunk", o->batch, "prefill chunk size in tokens")->check(number_in(1, 1 << 16))->capture_default_str();
  cmd->add_option("-t,--threads", o->threads, "threads (default: all cores)")->check(number_in(1, 256));
  cmd->add_option("--save-logits", o->save_logits, "save this run's top-K log-probs per scored token (the base for --kld-base)");
  cmd->add_option("--save-top-k", o->top_k, "K for --save-logits")->check(number_in(1, 4096))->capture_default_str();
  cmd->add_option("--kld-base", o->kld_base, "compare with a --save-logits file: KL divergence, top-1 agreement, PPL difference");
  cmd->add_option("--max-model-len", o->max_model_len,
                  "positions the model may use (default: no limit); past them an evicting --kv-eviction re-indexes the kept "
                  "pages (StreamingLLM), else the run fails")
      ->check(non_negative());
  cmd->add_flag("--past-trained-context", o->past_trained, "allow positions past the model's trained context (to measure what happens there)");
  cmd->add_flag("--json", o->json, "one JSON object on stdout (progress stays on stderr)");
  add_kv_options(cmd, &o->kvo);  // --kv-cache-memory, --block-size, --kv-cache-dtype, --kv-cache-dtype-layers
  add_eviction_options(cmd, &o->evo);  // --kv-eviction, --kv-budget, --kv-sparse quest, ...
  cmd->callback([o] { run_perplexity(*o); });
}

}  // namespace kvtools
