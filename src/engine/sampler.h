// Token sampling from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.
//
// The distribution (what each token's probability is for given parameters):
//   penalties → [top-k by logit] → softmax at temperature over what is kept → min-p (drop
//   tokens below min_p × the top probability) → top-p (the smallest highest-first prefix
//   whose mass, normalised before min-p, reaches top_p) → draw from what is left.
// Ties in the ordering go to the lower token id.
//
// Cost: O(n_vocab) with a small constant; the vocabulary is never sorted.
//   - temperature only: max, then exp in place with per-block sums (one vectorised pass), then
//     an inverse-CDF walk over the block sums and inside one block;
//   - top-k: a size-k min-heap behind a one-compare threshold test, then the k sorted;
//   - top-p / min-p: a threshold pass collects the few tokens that can be in the kept set
//     (a threshold low enough that the rest cannot hold 1 - top_p of the mass, lowered only
//     when the first guess held too little); up to kSortMax of them are sorted, more (a flat
//     row) go through a radix select on their float bits that sorts only one bucket;
//   - penalties: counts of the tokens actually seen, kept incrementally per sequence.
//
// Determinism: one uniform draw per token from the sampler's own PRNG (splitmix64), so the
// same seed, logits and history give the same token on every run of the same build and ISA
// path (the vectorised exp differs from the scalar one in the last bits).
// A Sampler belongs to one sequence; different Samplers may run on different threads.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace kv {

struct SamplingParams {
  float temperature = 0.f;   // 0 = greedy
  int32_t top_k = 0;         // 0 = off
  float top_p = 1.f;         // 1 = off
  float min_p = 0.f;         // 0 = off
  float repetition_penalty = 1.f;  // llama.cpp/HF style: logit/p if >0 else logit*p, over seen tokens
  float presence_penalty = 0.f;    // OpenAI: logit -= presence if the token was generated
  float frequency_penalty = 0.f;   // OpenAI: logit -= frequency × times generated
  uint64_t seed = 0;
};

// Scratch one thread reuses across calls (sized to the candidates, at most n_vocab).
struct SamplerScratch {
  std::vector<std::pair<float, int32_t>> cand;  // [n_cand] (value, token id)
  std::vector<double> prob;                     // [n_cand]
  std::vector<int32_t> idx;                     // [n_vocab] candidate ids from the threshold pass
  std::vector<double> block_sums;               // [ceil(n_vocab / kExpBlock)]
  std::vector<double> bucket_mass;              // [Sampler::kBuckets] top-p radix select
};

// Scratch of one thread's logprob entries (Engine's row_logprob): the row's exponentials, their
// block sums, the top k.
struct LogprobScratch {
  std::vector<float> row;                       // [n_vocab]
  std::vector<double> blocks;                   // [ceil(n_vocab / kExpBlock)]
  std::vector<std::pair<float, int32_t>> cand;  // [k]
};

class Sampler {
 public:
  static constexpr size_t kSortMax = 2048;   // candidates sorted outright up to this many
  static constexpr uint32_t kBuckets = 4096;  // top-p radix-select buckets (128 per binade)
  explicit Sampler(const SamplingParams& p);
  // Picks the next token from logits[n_vocab] given the ids seen so far (prompt + output);
  // the presence/frequency penalties count only history[n_prompt:] (generated tokens).
  // history must only grow between calls (a shorter one resets the penalty counts).
  // Overwrites logits (penalties, then probabilities). scratch: null uses the Sampler's own.
  int32_t sample(float* logits, int32_t n_vocab, const std::vector<int32_t>& history, size_t n_prompt = 0,
                 SamplerScratch* scratch = nullptr);
  const SamplingParams& params() const { return p_; }
  // Whether sample() reads the row only: greedy without penalties, when it is argmax(logits).
  bool reads_only() const {
    return p_.temperature <= 0.f && p_.presence_penalty == 0.f && p_.frequency_penalty == 0.f &&
           p_.repetition_penalty == 1.f;
  }
  // The history lost n_dropped of its already counted tokens (StreamingLLM re-indexing drops
  // evicted tokens from a sequence's list) and its prompt is now n_prompt long: the penalty
  // counts keep every token seen, and counting goes on from the shorter history.
  void history_dropped(size_t n_dropped, size_t n_prompt) {
    n_seen_ = n_seen_ > n_dropped ? n_seen_ - n_dropped : 0;
    n_prompt_seen_ = n_prompt;
  }

 private:
  double next_uniform();  // [0, 1)
  void apply_penalties(float* logits, int32_t n_vocab, const std::vector<int32_t>& history, size_t n_prompt);
  int32_t sample_top_k(float* logits, int32_t n_vocab, SamplerScratch& ws);
  int32_t sample_full(float* logits, int32_t n_vocab, SamplerScratch& ws);
  int32_t draw_sorted(const SamplerScratch& ws, size_t n);  // top-p, then one draw from cand[0, n)
  int32_t draw(const SamplerScratch& ws, size_t n);         // one draw from cand[0, n) by prob
  // top-p over many unsorted candidates: moves the kept ones to cand[0, n) and returns n.
  size_t top_p_select(SamplerScratch& ws, double total);

  SamplingParams p_;
  uint64_t state_;
  // Penalty state: token → occurrences, over history[0, n_seen_) and history[n_prompt, n_seen_).
  std::vector<std::pair<int32_t, int32_t>> seen_;       // sorted by token: (token, count in all history)
  std::vector<std::pair<int32_t, int32_t>> generated_;  // sorted by token: (token, count after the prompt)
  size_t n_seen_ = 0;
  size_t n_prompt_seen_ = 0;
  SamplerScratch own_;
};

// Sets logits[id] = -inf for every id of `ids` inside [0, n_vocab): those tokens cannot be drawn
// (vLLM's min_tokens keeps a choice's end-of-generation and stop ids out this way).
void mask_tokens(float* logits, int32_t n_vocab, const std::vector<int32_t>& ids);

// The first index of x's largest value; NaN entries are ignored; 0 when no entry is above -inf.
int32_t argmax(const float* x, int32_t n);

// The k highest entries of x[n] by (value desc, index asc), written to out sorted that way.
// O(n + k log k · (number of heap replacements)); k ≤ n.
void top_k_select(const float* x, int32_t n, int32_t k, std::vector<std::pair<float, int32_t>>* out);

}  // namespace kv
