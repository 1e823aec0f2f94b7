// A request as the engine sees it, and the stream its results flow back through.
//
// Threading: an HTTP thread builds a Request and hands it to Engine::submit(); from then on
// the engine thread owns the request's state and pushes events into its RequestStream; the
// HTTP thread pops them (blocking with a timeout) and may cancel() at any time.
#pragma once
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "engine/sampler.h"
#include "engine/speculative.h"
#include "engine/structured_output.h"
#include "kv/kv_eviction.h"

namespace kv {

struct RequestParams {
  SamplingParams sampling;
  int32_t max_tokens = 16;           // new tokens per choice; 0: the prompt alone (its KV, its prompt_logprobs)
  std::vector<std::string> stop;     // stop strings: matched across token boundaries
  bool include_stop_str = false;     // vLLM's include_stop_str_in_output: the matched stop string is emitted
  bool skip_special_tokens = true;   // vLLM's: false writes special tokens' text (<|im_start|>) into the output
  // Token ids that end a choice as end-of-generation does (vLLM's stop_token_ids; not under
  // ignore_eos's control): the token's text is kept, unless it is a control token.
  std::vector<int32_t> stop_token_ids;
  // OpenAI's logit_bias: (token id, bias) sorted by id, added to the logits before the draw
  // (the logprobs are the model's, without them, as vLLM's).
  std::vector<std::pair<int32_t, float>> logit_bias;
  bool ignore_eos = false;
  // vLLM's min_tokens: until a choice has generated this many tokens, its end-of-generation ids
  // and stop_token_ids cannot be drawn (logit -inf, ignore_eos or not) and no stop string ends it
  // (one may end in the text of a later token). Logprobs stay those of the raw logits.
  int32_t min_tokens = 0;
  int32_t n = 1;                     // choices; they share the prompt's pages
  int32_t logprobs = -1;             // -1: none; k ≥ 0: chosen token's logprob + top k alternatives
  // vLLM's prompt_logprobs (completions' echo with logprobs): -1 none; k ≥ 0: each prompt token
  // after the first, its logprob given the tokens before it, its rank and the top k, sent as
  // one kPrompt event before the request's first token. Such a request takes no prompt tokens
  // from the prefix cache (their logits were never computed), though its pages go there.
  int32_t prompt_logprobs = -1;
  std::string cache_namespace;       // tenant / cache_salt (prefix cache isolation)
  // Long-context KV policy for this request (kv/kv_eviction.h); unset: the server's default.
  bool kv_policy_set = false;
  EvictionConfig kv_policy;
  // Speculative decoding: the server's default, off, on (the server's configuration, or ngram
  // with its defaults when the server has none), or this request's own configuration.
  enum class Spec { kDefault, kOff, kOn, kCustom } spec_choice = Spec::kDefault;
  SpecConfig spec;  // kCustom
  // Structured output (engine/structured_output.h): compiled by whoever built the request; each
  // choice walks it with its own matcher. Null: free text.
  std::shared_ptr<const CompiledConstraint> constraint;
};

struct TokenLogprob {
  int32_t token = 0;
  float logprob = 0.f;
  std::vector<std::pair<int32_t, float>> top;  // best first
  int32_t rank = 0;  // prompt logprobs: 1 + the tokens more likely than `token`; 0: not computed
};

// One thing that happened to one choice of a request.
struct StreamEvent {
  // kPrompt (prompt_logprobs ≥ 0): once per request, before its first kText, index 0; logprobs
  // holds the prompt's tokens 1..n-1 (the first has none), for every choice.
  enum Kind { kText, kFinish, kError, kPrompt } kind = kText;
  int32_t index = 0;                 // choice index
  std::string text;                  // kText: newly completed text (may be empty with logprobs)
  std::vector<TokenLogprob> logprobs;  // kText: one per token this event covers
  std::string finish_reason;         // kFinish: "stop" | "length" | "abort"
  std::string error;                 // kError: message
  int32_t http_status = 0;           // kError: suggested status
  // kText: the token ids drawn since the last event, the end-of-generation token included
  // (events may carry tokens and no text: text held back for a stop string or a UTF-8 tail).
  std::vector<int32_t> tokens;
  // kText: the end-of-generation token's logprob (logprobs ≥ 0 only); it is not part of the
  // text, so `logprobs` leaves it out. Completions' logprobs and the Python API's show it (as
  // vLLM, and OpenAI's legacy completions: lm-eval's echo scoring takes the last entry for the
  // drawn token); chat's do not (OpenAI's chat shows no end token).
  std::vector<TokenLogprob> eog_logprobs;
  // kFinish "stop": what stopped the choice, vLLM's stop_reason: the stop string matched, or the
  // stop_token_ids id drawn (neither: the end-of-generation token, stop_reason null).
  std::string stop_string;
  int32_t stop_token = -1;
};

struct Usage {
  int32_t prompt_tokens = 0;
  int32_t completion_tokens = 0;
  int32_t cached_tokens = 0;
  // KV policy (kv/kv_eviction.h) outcome, summed over the choices; policy "none": both 0.
  std::string kv_policy = "none";
  int64_t kv_tokens_kept = 0;     // at the end, in kept pages
  int64_t kv_tokens_evicted = 0;  // evicted over the request's life
  int64_t kv_tokens_reindexed = 0;  // positions given back by re-indexing past max_model_len
};

// One waiter for many streams (the Python API's generate(): one thread reads every request of
// a call). A stream given it with RequestStream::set_waiter(w, key) reports its key on every
// push/finish, so the reader visits only the streams with news, not all of them.
class StreamWaiter {
 public:
  // Waits up to `timeout` for a report; moves the keys reported since the last call into *ready
  // (a key may appear more than once).
  void wait(std::vector<uint64_t>* ready, std::chrono::milliseconds timeout);
  void notify(uint64_t key);

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<uint64_t> ready_;
};

// Why a request was cancelled (kvserve:request_aborted_total's `reason` label).
enum class CancelReason : uint8_t { kNone, kClient, kTimeout, kShutdown, kError };
inline constexpr int kNumCancelReasons = 5;
const char* cancel_reason_name(CancelReason r);  // "client", "timeout", "shutdown", "error"

class RequestStream {
 public:
  // Before submit: every later push/finish_all also notifies w.
  void set_waiter(std::shared_ptr<StreamWaiter> w, uint64_t key) {
    waiter_ = std::move(w);
    waiter_key_ = key;
  }
  // Engine side.
  void push(StreamEvent ev);
  void finish_all(const Usage& usage);  // after the last choice finished; wakes the reader
  // Reader side: waits up to `timeout` for events and appends them to out; returns false once
  // the request is done (out then holds the last events), true while more may come.
  bool pop(std::vector<StreamEvent>* out, std::chrono::milliseconds timeout);
  bool done() const;
  Usage usage() const;
  // The first reason given is kept (a shutdown that cancels a request whose client then goes
  // away still counts as the shutdown's).
  void cancel(CancelReason why = CancelReason::kClient) {
    uint8_t none = 0;
    cancelled_.compare_exchange_strong(none, static_cast<uint8_t>(why));
  }
  bool cancelled() const { return cancelled_.load() != 0; }
  CancelReason cancel_reason() const { return static_cast<CancelReason>(cancelled_.load()); }

 private:
  mutable std::mutex mu_;
  std::condition_variable cv_;
  std::deque<StreamEvent> events_;
  bool done_ = false;
  Usage usage_;
  std::atomic<uint8_t> cancelled_{0};  // a CancelReason
  std::shared_ptr<StreamWaiter> waiter_;
  uint64_t waiter_key_ = 0;
};

struct Request {
  uint64_t id = 0;
  std::vector<int32_t> prompt;
  RequestParams params;
  std::shared_ptr<RequestStream> stream;
  std::chrono::steady_clock::time_point arrival = std::chrono::steady_clock::now();
};

}  // namespace kv
