// Speculative decoding with drafts taken from the text itself (no draft model):
//
//   ngram   prompt lookup (vLLM's "ngram", llama.cpp's lookup decoding): the context's last n
//           tokens (n from prompt_lookup_max down to prompt_lookup_min) are searched for in
//           the request's own prompt + output; the tokens that followed their most recent
//           earlier occurrence are the draft.
//   suffix  SuffixDecoding (Oliaro et al., 2024): the context's longest suffix (≤ depth/2
//           tokens) is looked up in two places, the request's own prompt + output (every
//           occurrence, found by one backward scan: no per-request memory) and a suffix trie of
//           bounded depth with occurrence counts over the recent outputs of the request's
//           namespace. From the match, the draft follows the most frequent continuation while
//           its estimated probability (count ratios multiplied along the path) stays ≥ min_prob,
//           for at most alpha × (match length) tokens: long, frequent matches draft long. The
//           source with the higher expected number of accepted tokens wins.
//
// The engine verifies a draft d1..dk by running [last token, d1..dk] as one short chunk with
// logits at every position, then draws the token of each position with the sequence's own
// sampler, in order: d_i is accepted when the draw equals it, and the first draw that differs
// is the step's last token. For a deterministic draft this is the standard rejection rule
// (accept d with probability p(d); otherwise draw from p without d, renormalised), and since
// every emitted token costs one draw of the sampler's PRNG, seeded output is the same token for
// token as without speculation (greedy included). Rejected positions' KV is dropped (the
// block table's tail is truncated; see Engine::postprocess).
#pragma once
#include <cstdint>
#include <deque>
#include <functional>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/status.h"
#include "engine/sampler.h"

namespace kv {

class ConstraintMatcher;

// What a request changes in a row before its draw, beyond the sampler's own parameters.
struct DrawRules {
  // Structured output: only the tokens it allows; it advances by each token drawn, so a draft's
  // row j is masked by the walk past draft[0, j), as unspeculated; the logprobs see its mask
  // (vLLM applies the grammar's bitmask before its sampler).
  ConstraintMatcher* constraint = nullptr;
  // OpenAI's logit_bias, sorted by id: added to the row the sampler draws from, not to the
  // logprobs' (vLLM's raw logprobs).
  const std::vector<std::pair<int32_t, float>>* logit_bias = nullptr;
  // vLLM's min_tokens: rows j < n_banned_rows draw without these ids (mask_tokens: the choice's
  // end-of-generation and stop ids); the logprobs do not see it either.
  const std::vector<int32_t>* banned = nullptr;
  int32_t n_banned_rows = 0;
};

struct SpecConfig {
  enum class Method { kNone, kNgram, kSuffix } method = Method::kNone;
  int32_t num_speculative_tokens = 5;  // most draft tokens per sequence and step
  // ngram
  int32_t prompt_lookup_min = 2;
  int32_t prompt_lookup_max = 4;
  // suffix
  int32_t suffix_max_depth = 32;       // trie depth: pattern (≤ depth / 2) + continuation
  float suffix_min_prob = 0.1f;        // a continuation stops below this estimated probability
  float suffix_alpha = 1.0f;           // draft length ≤ alpha × match length
  int32_t suffix_cache_tokens = 65536; // output tokens per namespace kept in its trie
  // Scheduling: drafts are made only while the step's decode tokens (one per decoding
  // sequence, plus drafts) stay within this; beyond it the batch is compute-bound on a CPU and
  // a rejected draft would cost throughput. 0 = no limit.
  int32_t max_batch_tokens = 8;
  // Adaptive length: a draft token is worth its cost while the chance that it and every token
  // before it are accepted exceeds draft_cost (a draft token's compute as a fraction of a decode
  // step at batch 1). The per-token acceptance is learnt per sequence (SpecStats).
  // Measured on a 2-core AVX2 host with the default q8x2 activations: a chunk of 2 / 3 / 6 tokens
  // costs 1.3 / 1.7 / 3.0 decode steps (README).
  float draft_cost = 0.3f;

  bool enabled() const { return method != Method::kNone && num_speculative_tokens > 0; }
  Status validate() const;
  std::string describe() const;  // e.g. "ngram k=5 n=2..4"
};
// A sequence's acceptance so far, as an exponentially decayed count of accepted draft tokens and
// of tokens tried (an accepted token, or the first rejected one). From a 1-in-2 prior.
struct SpecStats {
  double accepted = 1.0, tried = 2.0;
  int32_t idle_steps = 0;  // steps without a draft since the last probe
  void observe(int32_t n_draft, int32_t n_accepted) {
    constexpr double kDecay = 0.9;
    accepted = kDecay * accepted + n_accepted;
    tried = kDecay * tried + n_accepted + (n_accepted < n_draft ? 1 : 0);
  }
  double rate() const { return accepted / tried; }
  // Draft length worth verifying: the largest k with rate^k > draft_cost, at most k_max; when
  // that is 0, one token every kProbeEvery steps, so a sequence that starts repeating is noticed.
  int32_t worth(int32_t k_max, float draft_cost);
  static constexpr int32_t kProbeEvery = 8;
};

const char* spec_method_name(SpecConfig::Method m);
bool parse_spec_method(const std::string& s, SpecConfig::Method* out);

// Verification: row j of rows[n_rows][nv] is drawn by `sampler` with history + draft[0, j);
// draft[j] is accepted when the draw equals it, and the first draw that differs (or the last
// row's) ends it. The draws go to *out (accepted drafts, then one more); on_draw(j, row, token)
// sees each, with the constraint's mask but not the biases or min_tokens' (the sampler itself
// rewrites a copy in row_buf[nv]). history is restored. draft null: one row, a plain draw. rules:
// what the request changes in each row (DrawRules); a draft token they rule out is never accepted.
void verify_draft(Sampler& sampler, const float* rows, int32_t n_rows, int32_t nv, const std::vector<int32_t>* draft,
                  std::vector<int32_t>& history, size_t n_prompt, SamplerScratch* scratch, float* row_buf,
                  std::vector<int32_t>* out, const DrawRules& rules,
                  const std::function<void(int32_t, const float*, int32_t)>& on_draw);

// Prompt lookup over tokens[0, n): appends at most k_max tokens to *out; returns how many.
int32_t ngram_draft(const int32_t* tokens, int64_t n, const SpecConfig& cfg, int32_t k_max, std::vector<int32_t>* out);

struct SuffixDraft {
  std::vector<int32_t> tokens;
  int32_t match_len = 0;
  double score = 0;  // expected accepted tokens: the sum of the path's estimated probabilities
};

// SuffixDecoding over the text itself: every occurrence in t[0, n - 1) of the longest suffix of
// t[0, n) (≤ max_match tokens) that occurs earlier, then the most frequent continuation.
// O(n × average match length), no memory kept.
SuffixDraft suffix_draft_self(const int32_t* t, int64_t n, int32_t max_match, int32_t k_max, float min_prob, float alpha);

// A trie of every substring of length ≤ max_depth of the sequences added, with occurrence
// counts.
class SuffixTrie {
 public:
  explicit SuffixTrie(int32_t max_depth);
  // Adds (delta = +1) or removes (delta = -1, for a sequence added before) every substring of
  // t[0, n) of length ≤ max_depth.
  void add(const int32_t* t, int64_t n, int32_t delta);
  // The longest suffix of ctx[0, n) (≤ max_depth / 2) with a continuation in the trie, then its
  // most frequent continuation.
  SuffixDraft propose(const int32_t* ctx, int64_t n, int32_t k_max, float min_prob, float alpha) const;
  int64_t n_nodes() const { return static_cast<int64_t>(nodes_.size()); }
  int64_t n_live_nodes() const { return live_; }

 private:
  struct Node {
    int32_t token;
    int32_t count;
    int32_t first_child;
    int32_t next_sibling;
  };
  int32_t child(int32_t node, int32_t token) const;
  int32_t child_or_add(int32_t node, int32_t token);
  static uint64_t key(int32_t node, int32_t token) { return (uint64_t(uint32_t(node)) << 32) | uint32_t(token); }

  int32_t max_depth_;
  std::vector<Node> nodes_;  // [0] is the root
  std::unordered_map<uint64_t, int32_t> children_;
  int64_t live_ = 0;             // nodes with count > 0
};

// Per namespace: a trie over the outputs of its recent requests (at most cache_tokens tokens;
// the oldest go first). Engine-thread only.
class SuffixCache {
 public:
  explicit SuffixCache(const SpecConfig& cfg) : cfg_(cfg) {}
  void add_output(const std::string& ns, const int32_t* t, int64_t n);
  const SuffixTrie* trie(const std::string& ns) const;

 private:
  struct Space {
    explicit Space(int32_t depth) : trie(depth) {}
    SuffixTrie trie;
    std::deque<std::vector<int32_t>> outputs;
    int64_t tokens = 0;
  };
  SpecConfig cfg_;
  std::unordered_map<std::string, Space> spaces_;
};

}  // namespace kv
