// Token sampling from logits: greedy, temperature, top-k, top-p, min-p, repetition penalty.
// Deterministic for a given seed: the same seed, logits and history give the same token on
// every run and platform (own PRNG and own uniform draw, no std:: distributions).
#pragma once
#include <cstddef>
#include <cstdint>
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

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p);
  // Picks the next token from logits[n_vocab] given the ids seen so far (prompt + output);
  // the presence/frequency penalties count only history[n_prompt:] (generated tokens).
  // May modify logits in place.
  int32_t sample(float* logits, int32_t n_vocab, const std::vector<int32_t>& history, size_t n_prompt = 0);
  const SamplingParams& params() const { return p_; }

 private:
  double next_uniform();  // [0, 1)
  SamplingParams p_;
  uint64_t state_;
  std::vector<std::pair<float, int32_t>> cand_;  // scratch, reused across calls
};

int32_t argmax(const float* x, int32_t n);

}  // namespace kv
