#include "engine/structured_output.h"

#include <dlpack/dlpack.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cmath>
#include <limits>
#include <optional>
#include <regex>
#include <stdexcept>
#include <nlohmann/json.hpp>
#include <xgrammar/xgrammar.h>

#include "tokenizer/tokenizer.h"

namespace kv {

const char* constraint_kind_name(OutputConstraint::Kind k) {
  switch (k) {
    case OutputConstraint::Kind::kJson: return "json";
    case OutputConstraint::Kind::kJsonSchema: return "json_schema";
    case OutputConstraint::Kind::kRegex: return "regex";
    case OutputConstraint::Kind::kChoice: return "choice";
    case OutputConstraint::Kind::kGrammar: return "grammar";
    case OutputConstraint::Kind::kNone: break;
  }
  return "none";
}

class CompiledConstraint {
 public:
  explicit CompiledConstraint(xgrammar::CompiledGrammar g) : grammar(std::move(g)) {}
  xgrammar::CompiledGrammar grammar;
};

struct ConstraintCompiler::Impl {
  xgrammar::GrammarCompiler compiler;
  explicit Impl(const xgrammar::TokenizerInfo& info)
      : compiler(info, /*max_threads=*/1, /*cache_enabled=*/true, /*max_memory_bytes=*/int64_t(256) << 20) {}
};

ConstraintCompiler::ConstraintCompiler(const Tokenizer& tok, int32_t n_vocab) : tok_(tok), n_vocab_(n_vocab) {}
ConstraintCompiler::~ConstraintCompiler() = default;

namespace {

// A string as an EBNF literal: "…" with \\, \", \n, \r, \t escaped; other control characters
// are refused (no choice a user would list has them).
std::string ebnf_literal(const std::string& s) {
  std::string out = "\"";
  for (unsigned char c : s) {
    switch (c) {
      case '\\': out += "\\\\"; break;
      case '"': out += "\\\""; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      default:
        if (c < 0x20) throw std::invalid_argument("a choice contains the control character " + std::to_string(int(c)) + ".");
        out += static_cast<char>(c);
    }
  }
  return out + "\"";
}

// xgrammar's error text without its log prefix ("[hh:mm:ss] /path/file.cc:94: ") and trailing
// blank lines: what the client reads.
std::string xgrammar_message(std::string msg) {
  static const std::regex prefix(R"(^\s*(\[[0-9:]+\]\s*)?\S+\.(cc|h):[0-9]+:\s*)");
  msg = std::regex_replace(msg, prefix, "", std::regex_constants::format_first_only);
  while (!msg.empty() && std::isspace(static_cast<unsigned char>(msg.back()))) msg.pop_back();
  return msg;
}

}  // namespace

std::shared_ptr<const CompiledConstraint> ConstraintCompiler::compile(const OutputConstraint& c) {
  std::call_once(init_, [&] {
    const int32_t n_tok = std::min(tok_.n_vocab(), n_vocab_);  // ids past the logits are never drawn
    std::vector<std::string> vocab(n_tok);
    std::vector<int32_t> stop;
    for (int32_t id = 0; id < n_tok; ++id) {
      if (tok_.token_type(id) != TokenType::kControl) vocab[id] = tok_.token_bytes(id, false);
      if (tok_.is_eog(id)) stop.push_back(id);
    }
    xgrammar::TokenizerInfo info(vocab, xgrammar::VocabType::RAW, n_vocab_, stop, false);
    impl_ = std::make_unique<Impl>(info);
  });
  // Compiles run side by side (xgrammar's compiler is thread-safe, its cache too): one client's
  // slow schema holds its own HTTP thread, not the others' compiles.
  try {
    switch (c.kind) {
      case OutputConstraint::Kind::kJson:  // a JSON object, as OpenAI's JSON mode gives
        return std::make_shared<CompiledConstraint>(impl_->compiler.CompileJSONSchema(R"({"type": "object"})", c.any_whitespace));
      case OutputConstraint::Kind::kJsonSchema:
        refuse_unenforced(c.spec);
        return std::make_shared<CompiledConstraint>(impl_->compiler.CompileJSONSchema(c.spec, c.any_whitespace));
      case OutputConstraint::Kind::kRegex:
        return std::make_shared<CompiledConstraint>(impl_->compiler.CompileRegex(c.spec));
      case OutputConstraint::Kind::kGrammar:
        return std::make_shared<CompiledConstraint>(impl_->compiler.CompileGrammar(c.spec, "root"));
      case OutputConstraint::Kind::kChoice: {
        if (c.choices.empty()) throw std::invalid_argument("the list of choices is empty.");
        std::string g = "root ::= ";
        for (size_t i = 0; i < c.choices.size(); ++i) g += (i ? " | " : "") + ebnf_literal(c.choices[i]);
        return std::make_shared<CompiledConstraint>(impl_->compiler.CompileGrammar(g, "root"));
      }
      case OutputConstraint::Kind::kNone: break;
    }
  } catch (const std::invalid_argument&) {
    throw;
  } catch (const std::exception& e) {  // xgrammar reports a bad schema, regex or grammar by throwing
    throw std::invalid_argument(std::string("invalid ") + constraint_kind_name(c.kind) + ": " + xgrammar_message(e.what()));
  }
  throw std::invalid_argument("no constraint given");
}

namespace {

// The first keyword of a schema that xgrammar accepts and does not enforce (it logs a warning
// and generates as if it were absent: an allOf of two objects gave a number, uniqueItems
// repeated items), with the JSON pointer where it is; empty when none. Walks schema positions
// only, so a property named "if" is a name, not the keyword.
std::string first_unenforced(const nlohmann::json& node, const std::string& at) {
  if (!node.is_object()) return "";
  static const char* kUnenforced[] = {"if", "then", "else", "dependentRequired", "dependentSchemas", "dependencies",
                                      "contains", "minContains", "maxContains", "unevaluatedProperties", "unevaluatedItems"};
  auto found = [&](const std::string& what) {  // appended, not `+`: GCC 12 saw a -Wrestrict overlap in the chain
    std::string w = what;
    w.append(" at ").append(at.empty() ? std::string("the top") : at);
    return w;
  };
  for (const char* k : kUnenforced)
    if (node.contains(k)) return found(std::string("'").append(k).append("'"));
  if (auto u = node.find("uniqueItems"); u != node.end() && u->is_boolean() && u->get<bool>()) return found("'uniqueItems'");
  if (auto a = node.find("allOf"); a != node.end() && a->is_array() && a->size() > 1)
    return found("'allOf' of " + std::to_string(a->size()) + " schemas");
  for (const char* maps : {"properties", "patternProperties", "$defs", "definitions"})
    if (auto m = node.find(maps); m != node.end() && m->is_object())
      for (const auto& [name, sub] : m->items())
        if (std::string w = first_unenforced(sub, at + "/" + maps + "/" + name); !w.empty()) return w;
  for (const char* one : {"items", "additionalProperties", "not", "propertyNames", "additionalItems"})
    if (auto m = node.find(one); m != node.end())
      if (std::string w = first_unenforced(*m, at + "/" + one); !w.empty()) return w;
  for (const char* list : {"anyOf", "oneOf", "allOf", "prefixItems", "items"})
    if (auto m = node.find(list); m != node.end() && m->is_array())
      for (size_t i = 0; i < m->size(); ++i)
        if (std::string w = first_unenforced((*m)[i], at + "/" + list + "/" + std::to_string(i)); !w.empty()) return w;
  return "";
}

}  // namespace

void ConstraintCompiler::refuse_unenforced(const std::string& schema) {
  nlohmann::json j = nlohmann::json::parse(schema, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return;  // xgrammar says what is wrong with it
  if (std::string w = first_unenforced(j, ""); !w.empty())
    throw std::invalid_argument("invalid JSON schema: " + w + " is not enforced by the structured-output compiler (xgrammar); "
                                "the output would not keep to it, so the schema is refused");
}

struct ConstraintMatcher::Impl {
  std::shared_ptr<const CompiledConstraint> compiled;  // kept alive for the matcher
  xgrammar::GrammarMatcher matcher;
  std::vector<int32_t> bits;  // xgrammar's bitmask: bit v % 32 of word v / 32 set = token v allowed
  explicit Impl(std::shared_ptr<const CompiledConstraint> c)
      : compiled(std::move(c)),
        matcher(compiled->grammar),
        bits(xgrammar::GetBitmaskSize(compiled->grammar.GetTokenizerInfo().GetVocabSize())) {}
  void fill() {
    DLTensor t{};
    int64_t shape[1] = {static_cast<int64_t>(bits.size())};
    t.data = bits.data();
    t.device = DLDevice{kDLCPU, 0};
    t.ndim = 1;
    t.dtype = xgrammar::GetBitmaskDLType();
    t.shape = shape;
    matcher.FillNextTokenBitmask(&t, 0);
  }
};

ConstraintMatcher::ConstraintMatcher(std::shared_ptr<const CompiledConstraint> c) : impl_(std::make_unique<Impl>(std::move(c))) {}
ConstraintMatcher::~ConstraintMatcher() = default;
ConstraintMatcher::ConstraintMatcher(ConstraintMatcher&&) noexcept = default;
ConstraintMatcher& ConstraintMatcher::operator=(ConstraintMatcher&&) noexcept = default;

int32_t ConstraintMatcher::mask(float* logits, int32_t n_vocab) {
  impl_->fill();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const std::vector<int32_t>& stop = impl_->matcher.GetStopTokenIds();
  std::vector<float> stop_logits;
  for (int32_t id : stop) stop_logits.push_back(id < n_vocab ? logits[id] : kNegInf);
  int32_t n_allowed = 0;
  for (int32_t w = 0; w * 32 < n_vocab; ++w) {
    const uint32_t word = w < static_cast<int32_t>(impl_->bits.size()) ? static_cast<uint32_t>(impl_->bits[w]) : 0u;
    const int32_t v0 = w * 32, v1 = std::min(n_vocab, v0 + 32);
    if (word == ~0u && v1 - v0 == 32) {
      n_allowed += 32;
      continue;
    }
    if (word == 0) {  // most words under a narrow constraint
      std::fill(logits + v0, logits + v1, kNegInf);
      continue;
    }
    const int32_t n = v1 - v0;
    n_allowed += std::popcount(n == 32 ? word : word & ((1u << n) - 1));
    for (int32_t i = 0; i < n; ++i) logits[v0 + i] = (word >> i & 1u) ? logits[v0 + i] : kNegInf;  // branch-free
  }
  if (n_allowed == 0)
    for (size_t i = 0; i < stop.size(); ++i)
      if (stop[i] < n_vocab) logits[stop[i]] = stop_logits[i];
  return n_allowed;
}

bool ConstraintMatcher::accept(int32_t token) { return impl_->matcher.AcceptToken(token); }

bool ConstraintMatcher::complete() const { return impl_->matcher.IsCompleted(); }

bool ConstraintMatcher::terminated() const { return impl_->matcher.IsTerminated(); }

}  // namespace kv
