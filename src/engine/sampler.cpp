#include "engine/sampler.h"

#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

namespace kv {

int32_t argmax(const float* x, int32_t n) {
  int32_t best = 0;
  for (int32_t i = 1; i < n; ++i)
    if (x[i] > x[best]) best = i;  // first maximum wins: stable tie-break
  return best;
}

Sampler::Sampler(const SamplingParams& p) : p_(p), state_(p.seed ^ 0x9E3779B97F4A7C15ull) {}

double Sampler::next_uniform() {
  // splitmix64: tiny, well distributed, and identical everywhere.
  uint64_t z = (state_ += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) * (1.0 / 9007199254740992.0);
}

int32_t Sampler::sample(float* logits, int32_t n_vocab, const std::vector<int32_t>& history, size_t n_prompt) {
  if ((p_.presence_penalty != 0.f || p_.frequency_penalty != 0.f) && history.size() > n_prompt) {
    std::unordered_map<int32_t, int32_t> counts;
    for (size_t i = n_prompt; i < history.size(); ++i) ++counts[history[i]];
    for (auto [id, c] : counts) {
      if (id < 0 || id >= n_vocab) continue;
      logits[id] -= p_.presence_penalty + p_.frequency_penalty * static_cast<float>(c);
    }
  }
  if (p_.repetition_penalty != 1.f && !history.empty()) {
    std::unordered_set<int32_t> seen(history.begin(), history.end());
    for (int32_t id : seen) {
      if (id < 0 || id >= n_vocab) continue;
      float& l = logits[id];
      l = l > 0 ? l / p_.repetition_penalty : l * p_.repetition_penalty;
    }
  }
  if (p_.temperature <= 0.f) return argmax(logits, n_vocab);

  // Candidates sorted by logit, highest first (ties by id, for determinism).
  cand_.clear();
  cand_.reserve(n_vocab);
  for (int32_t i = 0; i < n_vocab; ++i) cand_.emplace_back(logits[i], i);
  auto by_logit = [](const auto& a, const auto& b) { return a.first > b.first || (a.first == b.first && a.second < b.second); };
  size_t n = cand_.size();
  if (p_.top_k > 0 && static_cast<size_t>(p_.top_k) < n) {
    std::partial_sort(cand_.begin(), cand_.begin() + p_.top_k, cand_.end(), by_logit);
    n = p_.top_k;
  } else {
    std::sort(cand_.begin(), cand_.end(), by_logit);
  }
  // Softmax at temperature over the kept candidates.
  const float mx = cand_[0].first;
  double sum = 0;
  std::vector<double> prob(n);
  for (size_t i = 0; i < n; ++i) sum += (prob[i] = std::exp((cand_[i].first - mx) / p_.temperature));
  for (auto& q : prob) q /= sum;
  // min-p: drop tokens below min_p × the top probability.
  if (p_.min_p > 0.f) {
    size_t keep = 1;
    while (keep < n && prob[keep] >= p_.min_p * prob[0]) ++keep;
    n = keep;
  }
  // top-p: smallest prefix whose mass reaches top_p.
  if (p_.top_p < 1.f) {
    double acc = 0;
    size_t keep = 0;
    while (keep < n) {
      acc += prob[keep++];
      if (acc >= p_.top_p) break;
    }
    n = std::max<size_t>(keep, 1);
  }
  double total = 0;
  for (size_t i = 0; i < n; ++i) total += prob[i];
  double u = next_uniform() * total;
  for (size_t i = 0; i < n; ++i) {
    u -= prob[i];
    if (u < 0) return cand_[i].second;
  }
  return cand_[n - 1].second;
}

}  // namespace kv
