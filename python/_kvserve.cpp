// kvserve._kvserve: the engine in the Python process (python/kvserve/__init__.py wraps it in
// vLLM's shapes: LLM, SamplingParams, RequestOutput).
//
// Requests travel as OpenAI request bodies (JSON text) through the server's own parser
// (server/openai_request.h), so defaults, limits, seeds and error messages are the server's.
// generate() submits every request of a call to the engine thread at once (continuous
// batching) and collects their events with the GIL released; Ctrl-C cancels what is still
// running, waits until its pages are back, and raises KeyboardInterrupt.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <cctype>
#include <functional>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <optional>
#include <string>
#include <vector>

#include "common/thread_pool.h"
#include "common/units.h"
#include "engine/engine.h"
#include "gguf/gguf.h"
#include "kernels/attention.h"
#include "kernels/matmul.h"
#include "model/llama.h"
#include "server/openai_request.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace py = pybind11;

namespace {

// kvserve.RequestError (a ValueError defined in Python): set by set_error_class at import.
py::object g_error_class;

// The thread that finalizes Python (the main thread) keeps the GIL through it: it never parks.
unsigned long g_main_thread = 0;

bool python_finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

// Releases the GIL for its scope. Taking it back while Python finalizes (the main thread exits
// with this thread still in generate()) ends the thread with pthread_exit, a forced unwind, which
// out of pybind11's gil_scoped_release (its destructor is noexcept) aborted the process: SIGABRT,
// exit code 134 (a user test). This thread parks instead, after on_park (a call ends its requests,
// so the engine goes idle): the process is about to exit. The destructor lets a forced unwind that
// starts between the check and taking the GIL pass on.
class NoGil {
 public:
  explicit NoGil(std::function<void()> on_park = {}) : on_park_(std::move(on_park)), state_(PyEval_SaveThread()) {}
  ~NoGil() noexcept(false) {
    if (python_finalizing() && PyThread_get_thread_ident() != g_main_thread) {
      if (on_park_) on_park_();
      for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
    }
    PyEval_RestoreThread(state_);
  }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  std::function<void()> on_park_;
  PyThreadState* state_;
};

// An ApiError on its way to Python, with the index of the request that caused it.
struct RequestFailure {
  kv::ApiError error;
  int64_t index = -1;
};

// The engine's messages name the server's flags; here they are LLM()'s arguments (a user test:
// "raise --kv-cache-memory" told a Python user of a flag they never saw).
std::string in_python_words(std::string msg) {
  static const std::pair<const char*, const char*> kFlags[] = {
      {"--kv-cache-memory", "kv_cache_memory"}, {"--max-num-batched-tokens", "max_num_batched_tokens"},
      {"--max-num-seqs", "max_num_seqs"},       {"--max-model-len", "max_model_len"},
      {"--max-n", "max_n"},                     {"--kv-cache-dtype", "kv_cache_dtype"},
      {"--block-size", "block_size"}};
  for (const auto& [flag, arg] : kFlags)
    for (size_t at = msg.find(flag); at != std::string::npos; at = msg.find(flag, at)) {
      const size_t end = at + std::strlen(flag);
      if (end < msg.size() && (std::isalnum(static_cast<unsigned char>(msg[end])) || msg[end] == '-')) {  // a longer flag
        at = end;
        continue;
      }
      msg.replace(at, end - at, arg);
    }
  return msg;
}

[[noreturn]] void fail(const std::string& msg) { throw py::value_error(in_python_words(msg)); }

struct StderrProgress : kv::LoadProgress {
  void on_tensor(int done, int total) override {
    std::fprintf(stderr, "\rkvserve: loading weights: %d/%d layers", done, total);
    if (done == total) std::fprintf(stderr, "\n");
  }
};

// One choice of one request, as its events arrive.
struct Choice {
  std::string text;
  std::vector<int32_t> tokens;
  std::vector<kv::TokenLogprob> logprobs;
  std::string finish_reason;
  std::string stop_string;  // the engine's stop_reason: the stop string, or the stop token id (-1: neither)
  int32_t stop_token = -1;
};

struct Pending {
  kv::ApiRequest ar;
  std::shared_ptr<kv::RequestStream> stream;
  std::vector<Choice> choices;
  std::optional<std::vector<kv::TokenLogprob>> prompt_logprobs;  // the kPrompt event (prompt_logprobs ≥ 0)
  bool done = false;
  std::optional<kv::ApiError> error;
};

class PyEngine {
 public:
  PyEngine(const std::string& model, const std::string& kv_cache_dtype, const std::string& kv_cache_memory, int block_size,
           bool enable_prefix_caching, int max_num_seqs, int max_num_batched_tokens, int max_model_len, int max_n, int threads,
           const std::string& kv_cache_dtype_layers, const std::string& act_quant, const std::string& served_model_name, bool quiet,
           const std::string& speculative_config, const std::string& chat_template, bool past_trained_context,
           int jump_forward_tokens) {
    // Before the model loads: as the CLI's ranges (0 = the default: every core, the model's context).
    if (threads < 0 || threads > 256) fail("threads must be in [0, 256] (0 or None: every core), got " + std::to_string(threads));
    if (jump_forward_tokens < 0 || jump_forward_tokens > 256)  // serve's --jump-forward-tokens range
      fail("jump_forward_tokens must be in [0, 256] (0: off), got " + std::to_string(jump_forward_tokens));
    if (max_model_len < 0 || max_model_len > (1 << 24))  // serve's --max-model-len range
      fail("max_model_len must be in [0, " + std::to_string(1 << 24) + "] (0 or None: the model's context), got " + std::to_string(max_model_len));
    if (!act_quant.empty()) {
      if (act_quant != "q8" && act_quant != "q8x2") fail("act_quant must be \"q8x2\" or \"q8\", got \"" + act_quant + "\"");
      kv::set_act_quant(act_quant == "q8" ? kv::ActQuant::kQ8 : kv::ActQuant::kQ8x2);
    }
    auto f = kv::GgufFile::open(model);
    if (!f) fail(f.message());
    file_ = std::move(*f);
    auto tok = kv::Tokenizer::from_gguf(*file_);
    if (!tok) fail(model + ": tokenizer: " + tok.message());
    tok_ = std::move(*tok);
    // The template before the weights: a bad chat_template fails at once.
    std::string no_chat;
    auto chat = kv::model_chat_template(*file_, chat_template, &no_chat);
    if (!chat) fail("chat_template " + chat.message());
    chat_ = std::move(*chat);
    if (!chat_ && !quiet && no_chat.find("does not parse") != std::string::npos)
      std::fprintf(stderr, "kvserve: warning: %s; chat() is off (chat_template= picks one)\n", no_chat.c_str());
    StderrProgress progress;
    auto m = kv::LlamaModel::load(*file_, kv::detect_isa(), quiet ? nullptr : &progress);
    if (!m) fail(model + ": " + m.message());
    model_ = std::move(*m);
    const kv::ModelConfig& mc = model_->config();

    kv::EngineConfig ec;
    if (block_size < 1 || block_size > kv::kAttnMaxBlockSize)  // as --block-size: the attention kernels' page limit
      fail("block_size must be in [1, " + std::to_string(kv::kAttnMaxBlockSize) + "], got " + std::to_string(block_size));
    if (max_num_seqs < 1) fail("max_num_seqs must be positive");
    if (max_num_batched_tokens < 1) fail("max_num_batched_tokens must be positive");
    if (max_n < 1) fail("max_n must be positive");
    ec.block_size = block_size;
    ec.enable_prefix_caching = enable_prefix_caching;
    ec.max_num_seqs = max_num_seqs;
    ec.max_num_batched_tokens = max_num_batched_tokens;
    ec.max_model_len = max_model_len > 0 ? max_model_len : (mc.n_ctx_train > 0 ? mc.n_ctx_train : 4096);
    // As serve's --max-model-len: past the training context, a warning (quiet or not: not a loading line).
    if (const std::string w = kv::max_model_len_warning(ec.max_model_len, mc.n_ctx_train, past_trained_context, "max_model_len",
                                                        "past_trained_context=True");
        !w.empty())
      std::fprintf(stderr, "kvserve: warning: %s\n", w.c_str());
    ec.max_n = max_n;
    ec.jump_forward_tokens = jump_forward_tokens;
    ec.max_queue = 1 << 30;  // one call submits all its prompts; the engine queues them
    if (!speculative_config.empty()) {  // vLLM's speculative_config, as --speculative-config
      nlohmann::json j = nlohmann::json::parse(speculative_config, nullptr, false);
      if (j.is_discarded()) fail("speculative_config is not valid JSON");
      try {
        ec.spec = kv::parse_spec_config(j, "speculative_config");
      } catch (const kv::ApiError& e) {
        fail(e.message);
      }
    }
    ec.n_threads = threads > 0 ? threads : kv::default_thread_count();
    auto bytes = kv::parse_kv_cache_memory(kv_cache_memory);
    if (!bytes) fail("kv_cache_memory: " + bytes.message());
    ec.kv_cache_bytes = *bytes;
    auto dtype = kv::parse_kv_dtype(kv_cache_dtype);
    if (!dtype) fail("kv_cache_dtype: " + dtype.message());
    ec.kv_dtype = *dtype;
    if (!kv_cache_dtype_layers.empty()) {
      auto l = kv::parse_kv_dtype_layers(kv_cache_dtype_layers, mc.n_layer, *dtype);
      if (!l) fail("kv_cache_dtype_layers: " + l.message());
      ec.kv_layer_dtypes = std::move(*l);
    }
    const kv::KvLayout layout = model_->kv_layout(block_size, ec.kv_dtype, ec.kv_layer_dtypes);
    if (kv::Status st = layout.validate(); !st) fail(st.message());
    // (the engine says what holds no page: the staging tiles, the sliding-window layers)
    engine_ = std::make_unique<kv::Engine>(*model_, *tok_, ec);
    if (!engine_->init_status()) fail(engine_->init_status().message());
    ctx_ = kv::make_api_context(*tok_, chat_ ? &*chat_ : nullptr, model, served_model_name, ec.max_model_len, ec.max_n);
    // As serve: a request without max_tokens gets what the cache holds for one sequence, when that
    // is less than max_model_len (every such request was refused: "needs 512 KV pages ... 364").
    ctx_.kv_capacity_tokens = static_cast<int64_t>(eng().pool().n_pages()) * block_size;
    constraints_ = std::make_unique<kv::ConstraintCompiler>(*tok_, model_->config().n_vocab);
    ctx_.constraints = constraints_.get();
    if (!quiet && ctx_.kv_capacity_tokens < ec.max_model_len)
      std::fprintf(stderr, "kvserve: the KV cache holds %lld tokens, less than one sequence of max_model_len %d: max_tokens=None gets "
                   "at most what the cache leaves after the prompt (raise kv_cache_memory or lower max_model_len)\n",
                   static_cast<long long>(ctx_.kv_capacity_tokens), ec.max_model_len);
    if (!quiet)
      std::fprintf(stderr, "kvserve: %s (%s, %d layers), kernels %s, %d threads; KV cache %s %s = %lld tokens\n", mc.name.c_str(),
                   mc.arch.c_str(), mc.n_layer, kv::isa_name(kv::detect_isa()), ec.n_threads,
                   kv::format_bytes(eng().pool().total_bytes()).c_str(), layout.describe().c_str(),
                   static_cast<long long>(eng().pool().n_pages()) * block_size);
    engine_->start();
  }

  ~PyEngine() {
    if (engine_) engine_->stop();  // no GIL games in a destructor: the engine thread never takes it
  }

  // Stops the engine thread and frees the KV pool; later calls raise. Idempotent.
  // Calls of generate() running on other threads end first: their requests are cancelled and they
  // raise (the engine they hold must not go away under them).
  // From a signal handler inside generate() (the same thread), close() cannot wait for that call: it
  // marks the engine closing, and the call, once it has ended its requests, frees the engine.
  void close() {
    if (!engine_) return;
    {
      std::lock_guard<std::mutex> l(calls_mu_);
      closing_ = true;
      if (std::find(call_threads_.begin(), call_threads_.end(), std::this_thread::get_id()) != call_threads_.end()) return;
    }
    NoGil nogil;
    {
      std::unique_lock<std::mutex> l(calls_mu_);
      ++waiting_closers_;
      calls_cv_.wait(l, [&] { return call_threads_.empty(); });
      --waiting_closers_;
    }
    free_engine();
  }

  void free_engine() {
    std::lock_guard<std::mutex> l(free_mu_);  // two closers: one frees
    if (!engine_) return;
    engine_->stop();
    engine_.reset();
  }

  std::string model_name() const { return ctx_.model_names.at(0); }
  int32_t max_model_len() const { return ctx_.max_model_len; }
  int64_t kv_capacity_tokens() const { return ctx_.kv_capacity_tokens; }
  bool has_chat_template() const { return ctx_.chat_template != nullptr; }

  std::vector<int32_t> tokenize(const std::string& text, bool add_special) const {
    return tok_->encode(text, add_special, /*parse_special=*/true);
  }
  py::bytes detokenize_bytes(const std::vector<int64_t>& ids, bool special) const {
    std::vector<int32_t> in(ids.size());
    for (size_t i = 0; i < ids.size(); ++i) {
      if (ids[i] < 0 || ids[i] >= tok_->n_vocab())
        fail("token id " + std::to_string(ids[i]) + " is outside the vocabulary [0, " + std::to_string(tok_->n_vocab()) + ")");
      in[i] = static_cast<int32_t>(ids[i]);
    }
    return py::bytes(tok_->decode(in, special));
  }
  py::bytes token_bytes(int32_t id) const {
    if (id < 0 || id >= tok_->n_vocab()) fail("token id " + std::to_string(id) + " is outside the vocabulary");
    return py::bytes(tok_->token_bytes(id));
  }
  bool is_eog(int32_t id) const { return id >= 0 && id < tok_->n_vocab() && tok_->is_eog(id); }

  // A chat body's messages rendered by the template (chat_template: this call's, as generate
  // takes it) → (text, token ids): what chat() would run, refusals included (/tokenize's path).
  py::tuple render_chat(const std::string& body, const std::string& chat_template) const {
    std::optional<kv::ChatTemplate> own_template;
    kv::ApiContext ctx = ctx_;
    if (!chat_template.empty()) {
      auto t = kv::load_chat_template(chat_template);
      if (!t) throw RequestFailure{kv::ApiError{400, "chat_template " + t.message(), "invalid_request_error", "chat_template", "invalid_chat_template"}, -1};
      own_template = std::move(*t);
      ctx.chat_template = &*own_template;
    }
    try {
      kv::TokenizeRequest r = kv::parse_tokenize_request(kv::parse_json_body(body, ctx), ctx);
      return py::make_tuple(py::str(r.text), r.ids);
    } catch (const kv::ApiError& e) {
      throw RequestFailure{e, -1};
    }
  }

  // bodies: OpenAI request bodies (completions, or chat when `chat`). progress(k) is called
  // with the GIL held each time k more requests are done.
  // chat_template (chat only): this call's template instead of the engine's, as load_chat_template takes it.
  py::list generate(const std::vector<std::string>& bodies, bool chat, py::object progress, const std::string& chat_template) {
    kv::Engine& engine = eng();
    CallGuard call(*this);
    std::optional<kv::ChatTemplate> own_template;
    kv::ApiContext ctx = ctx_;
    if (chat && !chat_template.empty()) {
      auto t = kv::load_chat_template(chat_template);
      if (!t) throw RequestFailure{kv::ApiError{400, "chat_template " + t.message(), "invalid_request_error", "chat_template", "invalid_chat_template"}, -1};
      own_template = std::move(*t);
      ctx.chat_template = &*own_template;
    }
    std::vector<Pending> items(bodies.size());
    // Every body is checked before anything runs: a bad one fails the call, and nothing is lost.
    for (size_t i = 0; i < bodies.size(); ++i) {
      try {
        const nlohmann::json body = kv::parse_json_body(bodies[i], ctx);
        items[i].ar = chat ? kv::parse_chat_request(body, ctx) : kv::parse_completion_request(body, ctx);
        // A prompt of generate() is one prompt; the server's batch form (several in one body) is
        // generate's own list.
        if (items[i].ar.prompts.size() != 1)
          throw kv::ApiError{400, "Invalid value for 'prompt': one prompt per item of generate() (got " + std::to_string(items[i].ar.prompts.size()) +
                                      "); give several prompts as generate()'s list.",
                             "invalid_request_error", "prompt", "invalid_value"};
      } catch (const kv::ApiError& e) {
        throw RequestFailure{e, static_cast<int64_t>(i)};
      }
      items[i].choices.resize(items[i].ar.params.n);
    }
    auto waiter = std::make_shared<kv::StreamWaiter>();
    size_t n_submitted = 0;
    std::optional<RequestFailure> refused;
    {
      NoGil nogil;
      for (; n_submitted < items.size(); ++n_submitted) {
        Pending& it = items[n_submitted];
        it.stream = std::make_shared<kv::RequestStream>();
        it.stream->set_waiter(waiter, n_submitted);
        kv::Request r;
        r.id = engine.next_request_id();
        r.prompt = it.ar.prompts[0];
        r.params = it.ar.params;
        r.stream = it.stream;
        if (kv::Rejection rej = engine.submit(std::move(r)); rej.http_status != 0) {
          refused = RequestFailure{kv::from_rejection(rej, chat), static_cast<int64_t>(n_submitted)};
          refused->error.message = in_python_words(refused->error.message);
          break;
        }
      }
    }
    const size_t n = n_submitted;
    if (refused) {  // the ones before it were accepted: they are cancelled, their pages come back
      for (size_t i = 0; i < n; ++i) items[i].stream->cancel();
      NoGil nogil;
      wait_all(items, n, *waiter);
    }
    if (refused) throw *refused;

    size_t n_done = 0;
    std::vector<uint64_t> ready;
    // Ends this call's requests and waits for their pages (GIL released): Ctrl-C, close(), a
    // progress callback that raised.
    auto end_all = [&](kv::CancelReason why) {
      for (size_t i = 0; i < n; ++i) items[i].stream->cancel(why);
      NoGil nogil;
      wait_all(items, n, *waiter);
    };
    while (n_done < n) {
      size_t newly = 0;
      {
        NoGil nogil([&] {  // Python exits under this call: its requests end with it
          for (size_t i = 0; i < n; ++i) items[i].stream->cancel(kv::CancelReason::kShutdown);
        });
        waiter->wait(&ready, std::chrono::milliseconds(100));
        newly = drain(items, &ready);
      }
      n_done += newly;
      if (newly > 0 && !progress.is_none()) {
        try {
          progress(newly);
        } catch (py::error_already_set&) {  // the bar raised (a broken pipe, Ctrl-C inside it): as Ctrl-C, nothing left running
          end_all(kv::CancelReason::kClient);
          throw;
        }
      }
      if (closing_) {  // close() on another thread: this call's requests end here
        end_all(kv::CancelReason::kShutdown);
        throw std::runtime_error("this LLM was closed while generate() ran");
      }
      if (PyErr_CheckSignals() != 0) {  // Ctrl-C (or another handler that raised)
        py::error_already_set interrupted;
        end_all(kv::CancelReason::kClient);
        throw interrupted;
      }
    }
    for (size_t i = 0; i < n; ++i)
      if (items[i].error) throw RequestFailure{*items[i].error, static_cast<int64_t>(i)};

    py::list out;
    for (size_t i = 0; i < n; ++i) out.append(to_python(items[i]));
    return out;
  }

  py::dict stats() const {
    py::dict d;
    d["pages_in_use"] = eng().pages_in_use();
    d["pages_cached"] = eng().pages_cached();
    d["pages_total"] = eng().pool().n_pages();
    d["block_size"] = eng().config().block_size;
    return d;
  }

  void check_integrity() {
    const kv::Engine& engine = eng();
    CallGuard call(*this);  // it runs without the GIL: a close() on another thread waits for it
    kv::Status st;
    {
      NoGil nogil;
      st = engine.check_integrity();
    }
    if (!st) throw std::runtime_error("KV integrity check failed: " + st.message());
  }

 private:
  kv::Engine& eng() const {
    if (!engine_ || closing_) throw std::runtime_error("this LLM was closed");
    return *engine_;
  }

  // Records a running generate() for close(); taken with the GIL held, after eng() succeeded. The
  // last call to end after a close() from inside a call frees the engine.
  struct CallGuard {
    explicit CallGuard(PyEngine& e) : e(e) {
      std::lock_guard<std::mutex> l(e.calls_mu_);
      e.call_threads_.push_back(std::this_thread::get_id());
    }
    ~CallGuard() {
      bool free_now = false;
      {
        std::lock_guard<std::mutex> l(e.calls_mu_);
        e.call_threads_.erase(std::find(e.call_threads_.begin(), e.call_threads_.end(), std::this_thread::get_id()));
        if (e.call_threads_.empty()) {
          e.calls_cv_.notify_all();
          free_now = e.closing_ && e.waiting_closers_ == 0;
        }
      }
      if (free_now) {
        NoGil nogil;
        e.free_engine();
      }
    }
    PyEngine& e;
  };

  // Moves the events of the streams in *ready (keys = item indices; consumed) into their
  // choices; returns how many requests became done.
  static size_t drain(std::vector<Pending>& items, std::vector<uint64_t>* ready) {
    size_t newly = 0;
    std::vector<kv::StreamEvent> events;
    for (uint64_t i : *ready) {
      Pending& it = items[i];
      if (it.done) continue;  // a repeated key, or a report after the end
      const bool more = it.stream->pop(&events, std::chrono::milliseconds(0));
      for (auto& ev : events) {
        if (ev.index < 0 || ev.index >= static_cast<int32_t>(it.choices.size())) continue;
        Choice& c = it.choices[ev.index];
        if (ev.kind == kv::StreamEvent::kText) {
          c.text += ev.text;
          c.tokens.insert(c.tokens.end(), ev.tokens.begin(), ev.tokens.end());
          for (auto& lp : ev.logprobs) c.logprobs.push_back(std::move(lp));
          for (auto& lp : ev.eog_logprobs) c.logprobs.push_back(std::move(lp));
        } else if (ev.kind == kv::StreamEvent::kPrompt) {
          it.prompt_logprobs = std::move(ev.logprobs);
        } else if (ev.kind == kv::StreamEvent::kFinish) {
          c.finish_reason = ev.finish_reason;
          c.stop_string = ev.stop_string;  // no Python object here: this runs without the GIL
          c.stop_token = ev.stop_token;
        } else if (!it.error) {
          it.error = kv::from_event(ev);
        }
      }
      events.clear();
      if (!more) {
        it.done = true;
        ++newly;
      }
    }
    ready->clear();
    return newly;
  }

  static void wait_all(std::vector<Pending>& items, size_t n, kv::StreamWaiter& waiter) {
    size_t done = 0;
    for (size_t i = 0; i < n; ++i) done += items[i].done;
    std::vector<uint64_t> ready;
    while (done < n) {
      waiter.wait(&ready, std::chrono::milliseconds(100));
      done += drain(items, &ready);
    }
  }

  py::dict to_python(const Pending& it) const {
    py::dict d;
    d["prompt_token_ids"] = it.ar.prompts[0];
    const kv::Usage u = it.stream->usage();
    d["prompt_tokens"] = u.prompt_tokens;
    d["completion_tokens"] = u.completion_tokens;
    d["cached_tokens"] = u.cached_tokens;
    d["kv_tokens_kept"] = u.kv_tokens_kept;
    d["kv_tokens_evicted"] = u.kv_tokens_evicted;
    d["kv_tokens_reindexed"] = u.kv_tokens_reindexed;
    d["with_logprobs"] = it.ar.logprobs;
    if (it.prompt_logprobs) {  // (token, logprob, rank, top) for prompt tokens 1..n-1
      py::list plps;
      for (const auto& lp : *it.prompt_logprobs) plps.append(py::make_tuple(lp.token, lp.logprob, lp.rank, lp.top));
      d["prompt_logprobs"] = plps;
    } else {
      d["prompt_logprobs"] = py::none();
    }
    py::list choices;
    for (size_t j = 0; j < it.choices.size(); ++j) {
      const Choice& c = it.choices[j];
      py::dict cd;
      cd["index"] = j;
      cd["text"] = py::bytes(c.text);  // UTF-8; decoded (with replacement) in Python
      cd["token_ids"] = c.tokens;
      cd["finish_reason"] = c.finish_reason;
      if (!c.stop_string.empty()) cd["stop_reason"] = py::bytes(c.stop_string).attr("decode")("utf-8", "replace");
      else cd["stop_reason"] = c.stop_token >= 0 ? py::object(py::int_(c.stop_token)) : py::object(py::none());
      if (it.ar.logprobs) {
        py::list lps;
        for (const auto& lp : c.logprobs) lps.append(py::make_tuple(lp.token, lp.logprob, lp.top));
        cd["logprobs"] = lps;
      } else {
        cd["logprobs"] = py::none();
      }
      choices.append(cd);
    }
    d["choices"] = choices;
    return d;
  }

  std::unique_ptr<kv::GgufFile> file_;
  std::unique_ptr<kv::Tokenizer> tok_;
  std::unique_ptr<kv::LlamaModel> model_;
  std::optional<kv::ChatTemplate> chat_;
  std::unique_ptr<kv::Engine> engine_;
  kv::ApiContext ctx_;
  std::unique_ptr<kv::ConstraintCompiler> constraints_;  // structured outputs (ctx_.constraints)
  std::mutex calls_mu_;
  std::condition_variable calls_cv_;
  std::vector<std::thread::id> call_threads_;  // threads inside generate() (calls_mu_)
  int waiting_closers_ = 0;                    // close() calls waiting for them (calls_mu_)
  std::mutex free_mu_;
  std::atomic<bool> closing_{false};  // close() began: running calls end, new ones are refused
};

}  // namespace

PYBIND11_MODULE(_kvserve, m) {
  m.doc() = "kvserve engine bindings (use the kvserve package: LLM, SamplingParams)";
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  m.def("set_error_class", [](py::object cls) { g_error_class = std::move(cls); });
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const RequestFailure& f) {
      const kv::ApiError& e = f.error;
      py::object cls = g_error_class ? g_error_class : py::reinterpret_borrow<py::object>(PyExc_ValueError);
      py::object exc = cls(e.message, e.status, e.type, e.param.empty() ? py::object(py::none()) : py::str(e.param),
                           e.code.empty() ? py::object(py::none()) : py::str(e.code), f.index);
      PyErr_SetObject(cls.ptr(), exc.ptr());
    }
  });
  py::class_<PyEngine>(m, "Engine")
      .def(py::init<const std::string&, const std::string&, const std::string&, int, bool, int, int, int, int, int, const std::string&,
                    const std::string&, const std::string&, bool, const std::string&, const std::string&, bool, int>(),
           py::arg("model"), py::arg("kv_cache_dtype") = "auto", py::arg("kv_cache_memory") = "1GiB", py::arg("block_size") = 16,
           py::arg("enable_prefix_caching") = true, py::arg("max_num_seqs") = 64, py::arg("max_num_batched_tokens") = 512,
           py::arg("max_model_len") = 0, py::arg("max_n") = 16, py::arg("threads") = 0, py::arg("kv_cache_dtype_layers") = "",
           py::arg("act_quant") = "", py::arg("served_model_name") = "", py::arg("quiet") = false,
           py::arg("speculative_config") = "", py::arg("chat_template") = "", py::arg("past_trained_context") = false,
           py::arg("jump_forward_tokens") = kv::EngineConfig{}.jump_forward_tokens)
      .def("close", &PyEngine::close)
      .def_property_readonly("model_name", &PyEngine::model_name)
      .def_property_readonly("max_model_len", &PyEngine::max_model_len)
      .def_property_readonly("kv_capacity_tokens", &PyEngine::kv_capacity_tokens)
      .def_property_readonly("has_chat_template", &PyEngine::has_chat_template)
      .def("tokenize", &PyEngine::tokenize, py::arg("text"), py::arg("add_special") = true)
      .def("detokenize_bytes", &PyEngine::detokenize_bytes, py::arg("ids"), py::arg("special") = false)
      .def("token_bytes", &PyEngine::token_bytes, py::arg("id"))
      .def("is_eog", &PyEngine::is_eog, py::arg("id"))
      .def("render_chat", &PyEngine::render_chat, py::arg("body"), py::arg("chat_template") = "")
      .def("generate", &PyEngine::generate, py::arg("bodies"), py::arg("chat"), py::arg("progress") = py::none(),
           py::arg("chat_template") = "")
      .def("stats", &PyEngine::stats)
      .def("check_integrity", &PyEngine::check_integrity);
}
