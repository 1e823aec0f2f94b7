// SpecConfig's names, checks and description, apart from the proposers (speculative.cpp), so
// that the request parser links without the sampler (the fuzzers build it from its sources).
#include "engine/speculative.h"

namespace kv {

const char* spec_method_name(SpecConfig::Method m) {
  switch (m) {
    case SpecConfig::Method::kNgram: return "ngram";
    case SpecConfig::Method::kSuffix: return "suffix";
    default: return "none";
  }
}

bool parse_spec_method(const std::string& s, SpecConfig::Method* out) {
  if (s == "ngram") *out = SpecConfig::Method::kNgram;
  else if (s == "suffix") *out = SpecConfig::Method::kSuffix;
  else if (s == "none" || s.empty()) *out = SpecConfig::Method::kNone;
  else return false;
  return true;
}

Status SpecConfig::validate() const {
  if (num_speculative_tokens < 0 || num_speculative_tokens > 32)
    return Status::error("num_speculative_tokens must be between 0 and 32");
  if (prompt_lookup_min < 1 || prompt_lookup_max < prompt_lookup_min || prompt_lookup_max > 64)
    return Status::error("prompt_lookup_min and prompt_lookup_max must satisfy 1 <= min <= max <= 64");
  if (suffix_max_depth < 1 || suffix_max_depth > 64) return Status::error("suffix_max_depth must be between 1 and 64");
  if (!(suffix_min_prob >= 0.f && suffix_min_prob <= 1.f)) return Status::error("suffix_min_prob must be between 0 and 1");
  if (!(suffix_alpha > 0.f && suffix_alpha <= 64.f)) return Status::error("suffix_alpha must be in (0, 64]");
  if (suffix_cache_tokens < 0) return Status::error("suffix_cache_tokens must be >= 0");
  if (max_batch_tokens < 0) return Status::error("max_batch_tokens must be >= 0");
  if (!(draft_cost >= 0.f && draft_cost < 1.f)) return Status::error("draft_cost must be in [0, 1)");
  return Status::ok();
}

std::string SpecConfig::describe() const {
  if (!enabled()) return "none";
  std::string s = std::string(spec_method_name(method)) + " k=" + std::to_string(num_speculative_tokens);
  if (method == Method::kNgram) s += " n=" + std::to_string(prompt_lookup_min) + ".." + std::to_string(prompt_lookup_max);
  if (method == Method::kSuffix) s += " depth=" + std::to_string(suffix_max_depth);
  return s;
}

}  // namespace kv
