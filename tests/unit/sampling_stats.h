// Exact sampling distributions and a chi-square test for the sampler's statistical tests
// (test_sampler.cpp, test_speculative.cpp).
//
// reference_probs: the distribution Sampler documents (penalties, top-k, temperature, min-p,
// top-p), in double precision with a full sort: the exact reference the draws are judged by.
// chi_square: Pearson's statistic over the bins with an expected count ≥ 5 (the rest pooled),
// judged at alpha = 1e-6 (chi2_critical_1e6), so a correct sampler fails with probability 1e-6.
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <vector>

#include "engine/sampler.h"

namespace kvtest {
using kv::SamplingParams;

inline std::vector<double> reference_probs(const std::vector<float>& logits, const SamplingParams& p, const std::vector<int32_t>& history,
                                    size_t n_prompt) {
  const int32_t n = static_cast<int32_t>(logits.size());
  std::vector<double> l(logits.begin(), logits.end());
  std::map<int32_t, int> gen;
  for (size_t i = n_prompt; i < history.size(); ++i) ++gen[history[i]];
  // Ids outside the vocabulary are ignored, as Sampler ignores them (the tests put one in).
  auto in_vocab = [n](int32_t id) { return id >= 0 && id < n; };
  for (auto [id, c] : gen)
    if (in_vocab(id)) l[id] = static_cast<float>(logits[id] - (p.presence_penalty + p.frequency_penalty * c));
  if (p.repetition_penalty != 1.f) {
    std::map<int32_t, int> seen;
    for (int32_t t : history) seen[t] = 1;
    for (auto [id, c] : seen) {
      if (!in_vocab(id)) continue;
      const float v = static_cast<float>(l[id]);
      l[id] = v > 0 ? v / p.repetition_penalty : v * p.repetition_penalty;
    }
  }
  std::vector<int32_t> order(n);
  for (int32_t i = 0; i < n; ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](int32_t a, int32_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); });
  size_t k = order.size();
  if (p.top_k > 0) k = std::min<size_t>(k, p.top_k);
  std::vector<double> q(k);
  double z = 0;
  for (size_t i = 0; i < k; ++i) z += (q[i] = std::exp((l[order[i]] - l[order[0]]) / p.temperature));
  for (auto& x : q) x /= z;
  if (p.min_p > 0) {
    size_t keep = 1;
    while (keep < k && q[keep] >= p.min_p * q[0]) ++keep;
    k = keep;
  }
  if (p.top_p < 1) {
    double acc = 0;
    size_t keep = 0;
    while (keep < k) {
      acc += q[keep++];
      if (acc >= p.top_p) break;
    }
    k = std::max<size_t>(keep, 1);
  }
  std::vector<double> out(n, 0.0);
  double kept = 0;
  for (size_t i = 0; i < k; ++i) kept += q[i];
  for (size_t i = 0; i < k; ++i) out[order[i]] = q[i] / kept;
  return out;
}

// Upper alpha = 1e-6 quantile of chi-square with df degrees of freedom (Wilson–Hilferty; within
// ~1% of the exact quantile for df ≥ 3, conservative enough for a 1e-6 threshold).
inline double chi2_critical_1e6(int df) {
  const double z = 4.753424;  // standard normal upper 1e-6 quantile
  const double a = 2.0 / (9.0 * df);
  return df * std::pow(1 - a + z * std::sqrt(a), 3);
}

struct ChiSquare {
  double stat = 0;
  int df = 0;
  int64_t outside_support = 0;
  bool pass() const { return outside_support == 0 && stat < chi2_critical_1e6(df); }
};

inline ChiSquare chi_square(const std::vector<int64_t>& counts, const std::vector<double>& prob, int64_t n_draws) {
  ChiSquare r;
  double pooled_e = 0, pooled_o = 0;
  int bins = 0;
  for (size_t i = 0; i < prob.size(); ++i) {
    if (prob[i] == 0) {
      r.outside_support += counts[i];
      continue;
    }
    const double e = prob[i] * n_draws;
    if (e < 5) {
      pooled_e += e;
      pooled_o += counts[i];
      continue;
    }
    r.stat += (counts[i] - e) * (counts[i] - e) / e;
    ++bins;
  }
  if (pooled_e > 0) {
    r.stat += (pooled_o - pooled_e) * (pooled_o - pooled_e) / pooled_e;
    ++bins;
  }
  r.df = std::max(bins - 1, 1);
  return r;
}

}  // namespace kvtest
