#include "engine/speculative.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "engine/structured_output.h"
#include "kernels/ops.h"

namespace kv {

void verify_draft(Sampler& sampler, const float* rows, int32_t n_rows, int32_t nv, const std::vector<int32_t>* draft,
                  std::vector<int32_t>& history, size_t n_prompt, SamplerScratch* scratch, float* row_buf,
                  std::vector<int32_t>* out, const DrawRules& rules,
                  const std::function<void(int32_t, const float*, int32_t)>& on_draw) {
  const size_t n0 = history.size();
  ConstraintMatcher* constraint = rules.constraint && !rules.constraint->terminated() ? rules.constraint : nullptr;
  const bool bias = rules.logit_bias && !rules.logit_bias->empty();
  for (int32_t j = 0; j < n_rows; ++j) {
    const float* lg = rows + int64_t(j) * nv;
    const float* seen = lg;  // the row the logprobs see
    const bool banned = rules.banned && !rules.banned->empty() && j < rules.n_banned_rows;
    int32_t tok;
    if (constraint || bias || banned) {
      if (constraint) {  // disallowed tokens at −inf, for the draw and the logprobs
        thread_local std::vector<float> masked;
        masked.assign(lg, lg + nv);
        constraint->mask(masked.data(), nv);
        seen = masked.data();
      }
      std::copy(seen, seen + nv, row_buf);  // the row drawn from: that, plus the biases
      if (bias)
        for (const auto& [id, b] : *rules.logit_bias)
          if (id < nv) row_buf[id] += b;
      if (banned) {
        std::vector<float> kept;  // under a constraint that allows only the end (it is complete), the constraint wins
        if (constraint)
          for (int32_t id : *rules.banned) kept.push_back(id < nv ? row_buf[id] : 0.f);
        mask_tokens(row_buf, nv, *rules.banned);
        if (constraint && max_value(row_buf, nv) == -std::numeric_limits<float>::infinity())
          for (size_t i = 0; i < kept.size(); ++i)
            if ((*rules.banned)[i] < nv) row_buf[(*rules.banned)[i]] = kept[i];
      }
      tok = sampler.reads_only() ? argmax(row_buf, nv) : sampler.sample(row_buf, nv, history, n_prompt, scratch);
      // The next row's mask is the walk's past this token, as it would be a step later unspeculated.
      if (constraint && (!constraint->accept(tok) || constraint->terminated())) constraint = nullptr;
    } else if (sampler.reads_only()) {
      tok = argmax(lg, nv);  // what sample() returns, without a copy of the row
    } else {
      std::copy(lg, lg + nv, row_buf);  // the sampler rewrites its row
      tok = sampler.sample(row_buf, nv, history, n_prompt, scratch);
    }
    if (on_draw) on_draw(j, seen, tok);
    out->push_back(tok);
    if (!draft || j + 1 >= n_rows || j >= static_cast<int32_t>(draft->size()) || tok != (*draft)[j]) break;
    history.push_back(tok);  // the next row's draw sees the accepted token, as it would unspeculated
  }
  history.resize(n0);
}

int32_t SpecStats::worth(int32_t k_max, float draft_cost) {
  const double r = std::clamp(rate(), 1e-3, 0.999);
  int32_t k = 0;
  for (double p = r; k < k_max && p > draft_cost; p *= r) ++k;
  if (k > 0 || draft_cost <= 0) {
    idle_steps = 0;
    return draft_cost <= 0 ? k_max : k;
  }
  if (++idle_steps < kProbeEvery) return 0;
  idle_steps = 0;
  return std::min(k_max, 1);
}

int32_t ngram_draft(const int32_t* t, int64_t n, const SpecConfig& cfg, int32_t k_max, std::vector<int32_t>* out) {
  if (k_max <= 0) return 0;
  for (int32_t m = std::min<int64_t>(cfg.prompt_lookup_max, n - 1); m >= cfg.prompt_lookup_min; --m) {
    const int32_t* pat = t + n - m;
    // Most recent earlier occurrence: start positions from n - m - 1 down to 0.
    for (int64_t i = n - m - 1; i >= 0; --i) {
      if (t[i + m - 1] != pat[m - 1] || !std::equal(pat, pat + m - 1, t + i)) continue;
      const int64_t from = i + m;
      const int32_t k = static_cast<int32_t>(std::min<int64_t>(k_max, n - from));
      out->insert(out->end(), t + from, t + from + k);
      return k;
    }
  }
  return 0;
}

SuffixDraft suffix_draft_self(const int32_t* t, int64_t n, int32_t max_match, int32_t k_max, float min_prob, float alpha) {
  SuffixDraft d;
  if (k_max <= 0 || n < 2) return d;
  // For each earlier end e (t[e] followed by t[e + 1]), the length of the common suffix of
  // t[0, e] and t[0, n); keep the ends with the longest one.
  std::vector<int64_t> next;  // indices of the tokens that followed the best matches
  int32_t best = 0;
  for (int64_t e = n - 2; e >= 0; --e) {
    if (t[e] != t[n - 1]) continue;
    int32_t len = 1;
    while (len < max_match && e - len >= 0 && t[e - len] == t[n - 1 - len]) ++len;
    if (len > best) {
      best = len;
      next.clear();
    }
    if (len == best) next.push_back(e + 1);
  }
  if (best == 0) return d;
  d.match_len = best;
  const int32_t limit = std::min<int32_t>(k_max, std::max(1, static_cast<int32_t>(std::ceil(alpha * best))));
  double prob = 1.0;
  std::vector<std::pair<int32_t, int32_t>> counts;  // (token, occurrences)
  while (static_cast<int32_t>(d.tokens.size()) < limit && !next.empty()) {
    counts.clear();
    for (int64_t c : next) {
      if (c >= n) continue;
      auto it = std::find_if(counts.begin(), counts.end(), [&](const auto& p) { return p.first == t[c]; });
      if (it == counts.end()) counts.emplace_back(t[c], 1);
      else ++it->second;
    }
    if (counts.empty()) break;
    int32_t total = 0;
    auto top = counts.begin();
    for (auto it = counts.begin(); it != counts.end(); ++it) {
      total += it->second;
      if (it->second > top->second || (it->second == top->second && it->first < top->first)) top = it;
    }
    prob *= double(top->second) / total;
    if (prob < min_prob) break;
    const int32_t tok = top->first;
    d.tokens.push_back(tok);
    d.score += prob;
    size_t w = 0;
    for (int64_t c : next)
      if (c < n && t[c] == tok) next[w++] = c + 1;
    next.resize(w);
  }
  return d;
}

// ---- SuffixTrie ---------------------------------------------------------------------------

SuffixTrie::SuffixTrie(int32_t max_depth) : max_depth_(max_depth) { nodes_.push_back({-1, 0, -1, -1}); }

int32_t SuffixTrie::child(int32_t node, int32_t token) const {
  auto it = children_.find(key(node, token));
  return it == children_.end() ? -1 : it->second;
}

int32_t SuffixTrie::child_or_add(int32_t node, int32_t token) {
  auto [it, fresh] = children_.try_emplace(key(node, token), static_cast<int32_t>(nodes_.size()));
  if (fresh) {
    nodes_.push_back({token, 0, -1, nodes_[node].first_child});
    nodes_[node].first_child = it->second;
  }
  return it->second;
}

void SuffixTrie::add(const int32_t* t, int64_t n, int32_t delta) {
  // Every substring t[i, i + d) with d ≤ max_depth: one walk per start.
  for (int64_t i = 0; i < n; ++i) {
    int32_t node = 0;
    for (int64_t j = i; j < std::min<int64_t>(n, i + max_depth_); ++j) {
      node = delta > 0 ? child_or_add(node, t[j]) : child(node, t[j]);
      if (node < 0) break;  // removing what was never added
      Node& x = nodes_[node];
      const bool was_live = x.count > 0;
      x.count = std::max(0, x.count + delta);
      live_ += (x.count > 0) - was_live;
    }
  }
}

SuffixDraft SuffixTrie::propose(const int32_t* ctx, int64_t n, int32_t k_max, float min_prob, float alpha) const {
  SuffixDraft d;
  if (k_max <= 0 || n == 0) return d;
  // Longest suffix present with a live continuation: the deepest first.
  auto has_live_child = [&](int32_t x) {
    for (int32_t c = nodes_[x].first_child; c >= 0; c = nodes_[c].next_sibling)
      if (nodes_[c].count > 0) return true;
    return false;
  };
  int32_t node = -1;
  for (int32_t m = static_cast<int32_t>(std::min<int64_t>(max_depth_ / 2, n)); m >= 1; --m) {
    int32_t x = 0;
    for (int64_t j = n - m; j < n && x >= 0; ++j) {
      x = child(x, ctx[j]);
      if (x >= 0 && nodes_[x].count == 0) x = -1;
    }
    if (x >= 0 && has_live_child(x)) {
      node = x;
      d.match_len = m;
      break;
    }
  }
  if (node < 0) return d;
  const int32_t limit = std::min<int32_t>(k_max, std::max(1, static_cast<int32_t>(std::ceil(alpha * d.match_len))));
  double prob = 1.0;
  while (static_cast<int32_t>(d.tokens.size()) < limit) {
    int32_t best = -1, total = 0;
    for (int32_t c = nodes_[node].first_child; c >= 0; c = nodes_[c].next_sibling) {
      total += nodes_[c].count;
      if (nodes_[c].count > 0 && (best < 0 || nodes_[c].count > nodes_[best].count ||
                                  (nodes_[c].count == nodes_[best].count && nodes_[c].token < nodes_[best].token)))
        best = c;
    }
    if (best < 0) break;  // the pattern's end (depth limit or the text's end)
    prob *= double(nodes_[best].count) / total;
    if (prob < min_prob) break;
    d.tokens.push_back(nodes_[best].token);
    d.score += prob;
    node = best;
  }
  return d;
}

// ---- SuffixCache --------------------------------------------------------------------------

void SuffixCache::add_output(const std::string& ns, const int32_t* t, int64_t n) {
  if (cfg_.suffix_cache_tokens <= 0 || n <= 0) return;
  constexpr size_t kMaxSpaces = 256;
  if (spaces_.size() >= kMaxSpaces && !spaces_.count(ns)) spaces_.erase(spaces_.begin());  // bounded; any one goes
  Space& sp = spaces_.try_emplace(ns, cfg_.suffix_max_depth).first->second;
  n = std::min<int64_t>(n, cfg_.suffix_cache_tokens);
  sp.outputs.emplace_back(t, t + n);
  sp.trie.add(t, n, +1);
  sp.tokens += n;
  while (sp.tokens > cfg_.suffix_cache_tokens) {
    const std::vector<int32_t>& old = sp.outputs.front();
    sp.trie.add(old.data(), static_cast<int64_t>(old.size()), -1);
    sp.tokens -= static_cast<int64_t>(old.size());
    sp.outputs.pop_front();
  }
  // Removal leaves dead nodes behind: rebuild once they are the majority.
  if (sp.trie.n_nodes() > 4096 && sp.trie.n_nodes() > 2 * sp.trie.n_live_nodes()) {
    sp.trie = SuffixTrie(cfg_.suffix_max_depth);
    for (const auto& o : sp.outputs) sp.trie.add(o.data(), static_cast<int64_t>(o.size()), +1);
  }
}

const SuffixTrie* SuffixCache::trie(const std::string& ns) const {
  auto it = spaces_.find(ns);
  return it == spaces_.end() ? nullptr : &it->second.trie;
}

}  // namespace kv
