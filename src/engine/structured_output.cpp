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

#include "engine/xgrammar_log.h"
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

namespace {
// The tokens `m` allows next into bits (xgrammar's bitmask: bit v % 32 of word v / 32 = token v).
void fill_bitmask(xgrammar::GrammarMatcher& m, std::vector<int32_t>& bits) {
  DLTensor t{};
  int64_t shape[1] = {static_cast<int64_t>(bits.size())};
  t.data = bits.data();
  t.device = DLDevice{kDLCPU, 0};
  t.ndim = 1;
  t.dtype = xgrammar::GetBitmaskDLType();
  t.shape = shape;
  m.FillNextTokenBitmask(&t, 0);
}
}  // namespace

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

// ---- which of xgrammar's warnings leave the output's constraint whole ----------------------------

const nlohmann::json* resolve_ref(const nlohmann::json& root, const nlohmann::json& node, int depth = 0) {
  if (!node.is_object() || depth > 16) return &node;
  auto ref = node.find("$ref");
  if (ref == node.end() || !ref->is_string()) return &node;
  const std::string r = ref->get<std::string>();
  if (r == "#") return &root;
  if (r.rfind("#/", 0) != 0) return &node;
  try {
    const nlohmann::json& target = root.at(nlohmann::json::json_pointer(r.substr(1)));
    return resolve_ref(root, target, depth + 1);
  } catch (const std::exception&) {
    return &node;
  }
}

// A JSON value's JSON Schema type ("integer" for a whole number, a float like 2.0 included).
std::string json_type(const nlohmann::json& v) {
  if (v.is_null()) return "null";
  if (v.is_boolean()) return "boolean";
  if (v.is_number_integer() || (v.is_number_float() && std::trunc(v.get<double>()) == v.get<double>())) return "integer";
  if (v.is_number()) return "number";
  if (v.is_string()) return "string";
  if (v.is_array()) return "array";
  return "object";
}

// The JSON types a schema's values can have, as far as its own keywords say; empty: any.
std::vector<std::string> value_types(const nlohmann::json& s) {
  std::vector<std::string> out;
  if (!s.is_object()) return out;
  if (auto t = s.find("type"); t != s.end()) {
    if (t->is_string()) out.push_back(t->get<std::string>());
    else if (t->is_array())
      for (const auto& e : *t)
        if (e.is_string()) out.push_back(e.get<std::string>());
  } else if (auto c = s.find("const"); c != s.end()) {
    out.push_back(json_type(*c));
  } else if (auto e = s.find("enum"); e != s.end() && e->is_array()) {
    for (const auto& v : *e) out.push_back(json_type(v));
  } else if (s.contains("properties") || s.contains("required") || s.contains("additionalProperties")) {
    out.push_back("object");
  } else if (s.contains("items") || s.contains("prefixItems")) {
    out.push_back("array");
  }
  return out;
}

// Two oneOf branches no value can match both of: their types differ (integer within number), or
// both are objects requiring a property whose const values differ (a discriminated union, as
// Pydantic writes one).
bool disjoint(const nlohmann::json& root, const nlohmann::json& a0, const nlohmann::json& b0) {
  const nlohmann::json& a = *resolve_ref(root, a0);
  const nlohmann::json& b = *resolve_ref(root, b0);
  const auto ta = value_types(a), tb = value_types(b);
  if (ta.empty() || tb.empty()) return false;
  auto overlap = [](const std::string& x, const std::string& y) {
    return x == y || (x == "number" && y == "integer") || (x == "integer" && y == "number");
  };
  bool types_meet = false;
  for (const auto& x : ta)
    for (const auto& y : tb) types_meet = types_meet || overlap(x, y);
  if (!types_meet) return true;
  if (ta != std::vector<std::string>{"object"} || tb != std::vector<std::string>{"object"}) return false;
  auto props_a = a.find("properties"), props_b = b.find("properties");
  auto req_a = a.find("required"), req_b = b.find("required");
  if (props_a == a.end() || props_b == b.end() || req_a == a.end() || req_b == b.end()) return false;
  auto needs = [](const nlohmann::json& req, const std::string& k) {
    return req.is_array() && std::find(req.begin(), req.end(), k) != req.end();
  };
  auto const_of = [&](const nlohmann::json& p) -> const nlohmann::json* {
    const nlohmann::json& q = *resolve_ref(root, p);
    if (!q.is_object()) return nullptr;
    if (auto c = q.find("const"); c != q.end()) return &*c;
    if (auto e = q.find("enum"); e != q.end() && e->is_array() && e->size() == 1) return &(*e)[0];
    return nullptr;
  };
  for (const auto& [k, pa] : props_a->items()) {
    auto pb = props_b->find(k);
    if (pb == props_b->end() || !needs(*req_a, k) || !needs(*req_b, k)) continue;
    const nlohmann::json *ca = const_of(pa), *cb = const_of(*pb);
    if (ca && cb && *ca != *cb) return true;
  }
  return false;
}

// Every oneOf in the schema has branches no two of which a value could match, so treating it as
// anyOf (what xgrammar does when it cannot prove that itself) generates the same values.
bool oneofs_disjoint(const nlohmann::json& root, const nlohmann::json& node, int depth = 0) {
  if (depth > 64) return false;
  if (node.is_array()) {
    for (const auto& e : node)
      if (!oneofs_disjoint(root, e, depth + 1)) return false;
    return true;
  }
  if (!node.is_object()) return true;
  if (auto o = node.find("oneOf"); o != node.end() && o->is_array())
    for (size_t i = 0; i < o->size(); ++i)
      for (size_t j = i + 1; j < o->size(); ++j)
        if (!disjoint(root, (*o)[i], (*o)[j])) return false;
  for (const auto& [k, v] : node.items())
    if (k != "const" && k != "enum" && k != "default" && k != "examples" && !oneofs_disjoint(root, v, depth + 1)) return false;
  return true;
}

// xgrammar warnings that leave the constraint whole: a regex's escaped punctuation ("\#" is "#",
// as in every dialect), and a oneOf it could not prove disjoint that is disjoint by types or a
// discriminator (oneofs_disjoint).
bool benign_warning(const std::string& w, const OutputConstraint& c) {
  static const std::string kEscape = "Escape sequence '\\";  // then the escaped character
  if (size_t at = w.find(kEscape); at != std::string::npos && at + kEscape.size() < w.size()) {
    const unsigned char ch = static_cast<unsigned char>(w[at + kEscape.size()]);
    if (ch < 0x80 && !std::isalnum(ch)) return true;
  }
  if (w.find("oneOf") != std::string::npos && c.kind == OutputConstraint::Kind::kJsonSchema) {
    const nlohmann::json j = nlohmann::json::parse(c.spec, nullptr, false);
    return !j.is_discarded() && oneofs_disjoint(j, j);
  }
  return false;
}

// vLLM's grammar_is_likely_lark: no line (comments "#" and "//" removed) defines an EBNF rule.
bool is_lark(const std::string& g) {
  size_t at = 0;
  while (at <= g.size()) {
    size_t end = g.find('\n', at);
    if (end == std::string::npos) end = g.size();
    std::string line = g.substr(at, end - at);
    for (const char* c : {"#", "//"})
      if (size_t k = line.find(c); k != std::string::npos) line.resize(k);
    if (line.find("::=") != std::string::npos) return false;
    at = end + 1;
  }
  return true;
}

// PCRE / Python syntax xgrammar's ECMAScript-style regexes read as something else without a
// warning: a POSIX class ("[[:alpha:]]" is the class "[:alph" then "]"), and "\x{41}" ("x"
// 41 times). Throws std::invalid_argument naming `where`.
void refuse_foreign_regex(const std::string& re, const std::string& where) {
  bool in_class = false;
  for (size_t i = 0; i < re.size(); ++i) {
    const char ch = re[i];
    if (ch == '\\') {
      if (i + 2 < re.size() && re[i + 1] == 'x' && re[i + 2] == '{')
        throw std::invalid_argument(where + " uses \\x{...}, which this regex dialect (ECMAScript's, as JSON Schema's) does not have; write \\xHH or \\uHHHH.");
      ++i;
      continue;
    }
    if (!in_class && ch == '[') {
      in_class = true;
      if (i + 2 < re.size() && re[i + 1] == '[' && re[i + 2] == ':')
        throw std::invalid_argument(where + " uses a POSIX character class ([[:name:]]), which this regex dialect (ECMAScript's, as JSON Schema's) does not have.");
    } else if (in_class && ch == ']') {
      in_class = false;
    }
  }
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
  // A constraint xgrammar enforces only in part is refused: it warns (the warnings are collected
  // here, xgrammar_log.h) and compiles on without the part, so a "stop" answer would break it.
  const std::string key = std::string(constraint_kind_name(c.kind)) + '\n' + c.spec;
  auto refuse = [&](const std::string& why) {
    throw std::invalid_argument(std::string("invalid ") + constraint_kind_name(c.kind) +
                                ": the structured-output compiler (xgrammar) would leave part of it out (\"" + why +
                                "\"), so the output would not keep to it; refused.");
  };
  const bool may_warn = c.kind == OutputConstraint::Kind::kJsonSchema || c.kind == OutputConstraint::Kind::kRegex ||
                        c.kind == OutputConstraint::Kind::kGrammar;
  if (may_warn) {
    std::unique_lock<std::mutex> l(refused_mu_);
    refused_cv_.wait(l, [&] { return in_flight_.find(key) == in_flight_.end(); });
    if (auto it = refused_.find(key); it != refused_.end()) refuse(it->second);
    in_flight_.emplace(key, 1);
  }
  struct Done {  // the verdict is in (refused_ written, or not): the waiting compiles go on
    ConstraintCompiler* self;
    const std::string* key;
    ~Done() {
      if (!key) return;
      {
        std::lock_guard<std::mutex> l(self->refused_mu_);
        self->in_flight_.erase(*key);
      }
      self->refused_cv_.notify_all();
    }
  } done{this, may_warn ? &key : nullptr};
  auto checked = [&](auto&& compile_it) {
    XgrammarWarnings warnings;
    auto g = compile_it();
    std::vector<std::string> real;
    for (const std::string& w : warnings.list())
      if (!benign_warning(w, c)) real.push_back(w);
    if (!real.empty()) {
      const std::string why = xgrammar_message(real.front());
      {
        std::lock_guard<std::mutex> l(refused_mu_);
        if (refused_.size() >= 4096) {  // a bound, not a policy: a refusal costs a compile to find again,
          refused_.clear();             // which warns only if xgrammar's cache forgot the grammar too
          impl_->compiler.ClearCache();
        }
        refused_.emplace(key, why);
      }
      refuse(why);
    }
    // A language with no text in it (every rule recurses with no way out: `root ::= a`, `a ::= a
    // "x"`) compiles, and its first mask allows nothing: the answer would be "" with "stop".
    // Only the first step is looked at: a dead end further in still ends the answer there.
    xgrammar::GrammarMatcher first(g);
    if (!first.IsCompleted()) {
      std::vector<int32_t> bits(xgrammar::GetBitmaskSize(g.GetTokenizerInfo().GetVocabSize()));
      fill_bitmask(first, bits);
      if (std::all_of(bits.begin(), bits.end(), [](int32_t w) { return w == 0; }))
        throw std::invalid_argument(std::string("invalid ") + constraint_kind_name(c.kind) +
                                    ": it matches no text (no token can begin an answer that keeps to it).");
    }
    return std::make_shared<CompiledConstraint>(std::move(g));
  };
  // Compiles run side by side (xgrammar's compiler is thread-safe, its cache too): one client's
  // slow schema holds its own HTTP thread, not the others' compiles.
  try {
    switch (c.kind) {
      case OutputConstraint::Kind::kJson:  // a JSON object, as OpenAI's JSON mode gives
        return std::make_shared<CompiledConstraint>(impl_->compiler.CompileJSONSchema(R"({"type": "object"})", c.any_whitespace));
      case OutputConstraint::Kind::kJsonSchema:
        refuse_unenforced(c.spec);
        return checked([&] { return impl_->compiler.CompileJSONSchema(c.spec, c.any_whitespace); });
      case OutputConstraint::Kind::kRegex:
        refuse_foreign_regex(c.spec, "the regex");
        return checked([&] { return impl_->compiler.CompileRegex(c.spec); });
      case OutputConstraint::Kind::kGrammar:
        // As vLLM tells them apart: a grammar with no "::=" rule is Lark's (start rule "start"),
        // which its xgrammar backend converts; xgrammar compiles Lark itself.
        if (is_lark(c.spec)) return checked([&] { return impl_->compiler.CompileLark(c.spec); });
        return checked([&] { return impl_->compiler.CompileGrammar(c.spec, "root"); });
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
  static const char* kUnenforced[] = {"if", "then", "else", "not", "dependentRequired", "dependentSchemas", "dependencies",
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
  for (const char* k : {"anyOf", "oneOf"})
    if (auto a = node.find(k); a != node.end() && a->is_array() && a->empty())
      return found(std::string("an empty '").append(k).append("' (no value could match it)"));
  // Siblings of a $ref that constrain (draft 2019-09 applies them; xgrammar reads the $ref alone).
  if (node.contains("$ref")) {
    static const char* kAnnotations[] = {"$ref", "description", "title", "default", "examples", "$comment", "deprecated",
                                         "readOnly", "writeOnly", "$defs", "definitions", "$schema", "$id"};
    for (auto it = node.begin(); it != node.end(); ++it) {
      const std::string& k = it.key();  // (clang 14 captures no structured binding in a lambda)
      if (std::find_if(std::begin(kAnnotations), std::end(kAnnotations), [&](const char* a) { return k == a; }) == std::end(kAnnotations))
        return found("'" + k + "' beside '$ref' (only the $ref is applied)");
    }
  }
  // A pattern in another regex dialect's syntax, read as something else (as guided_regex's).
  if (auto p = node.find("pattern"); p != node.end() && p->is_string()) {
    try {
      refuse_foreign_regex(p->get<std::string>(), "its 'pattern'");
    } catch (const std::invalid_argument& e) {
      std::string why = e.what();
      if (!why.empty() && why.back() == '.') why.pop_back();  // found() goes on with " at <where>"
      return found(why);
    }
  }
  // Required keys: xgrammar generates the listed properties only, so one never listed never comes.
  if (auto req = node.find("required"); req != node.end() && req->is_array()) {
    const auto props = node.find("properties");
    for (const auto& r : *req)
      if (r.is_string() && (props == node.end() || !props->is_object() || !props->contains(r.get<std::string>())))
        return found("required property '" + r.get<std::string>() + "' missing from 'properties' (only listed properties are generated)");
  }
  // An enum or const value the schema's own type excludes (xgrammar generates the value anyway).
  if (auto type = node.find("type"); type != node.end() && (type->is_string() || type->is_array())) {
    static const char* kTypes[] = {"null", "boolean", "object", "array", "string", "number", "integer"};
    auto allows = [&](const nlohmann::json& v) {
      const std::string vt = json_type(v);
      auto is = [&](const std::string& t) {
        if (std::find(std::begin(kTypes), std::end(kTypes), t) == std::end(kTypes)) return true;  // unknown: xgrammar says so
        return t == vt || (t == "number" && vt == "integer");
      };
      if (type->is_string()) return is(type->get<std::string>());
      for (const auto& t : *type)
        if (!t.is_string() || is(t.get<std::string>())) return true;
      return false;
    };
    if (auto c = node.find("const"); c != node.end() && !allows(*c))
      return found("'const' " + c->dump() + ", not of the schema's 'type'");
    if (auto e = node.find("enum"); e != node.end() && e->is_array())
      for (const auto& v : *e)
        if (!allows(v)) return found("'enum' value " + v.dump() + ", not of the schema's 'type'");
  }
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
    throw std::invalid_argument("invalid JSON schema: " + w +
                                ": the structured-output compiler (xgrammar) would not keep the output to it, so the schema is refused");
}

struct ConstraintMatcher::Impl {
  std::shared_ptr<const CompiledConstraint> compiled;  // kept alive for the matcher
  xgrammar::GrammarMatcher matcher;
  std::vector<int32_t> bits;  // xgrammar's bitmask: bit v % 32 of word v / 32 set = token v allowed
  explicit Impl(std::shared_ptr<const CompiledConstraint> c)
      : compiled(std::move(c)),
        matcher(compiled->grammar),
        bits(xgrammar::GetBitmaskSize(compiled->grammar.GetTokenizerInfo().GetVocabSize())) {}
  void fill() { fill_bitmask(matcher, bits); }
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

std::string ConstraintMatcher::forced_text() {
  if (impl_->matcher.IsTerminated() || impl_->matcher.IsCompleted()) return {};
  return impl_->matcher.FindJumpForwardString();
}

int32_t ConstraintMatcher::allowed_prefix(const int32_t* toks, int32_t n) {
  int32_t k = 0;
  while (k < n && !impl_->matcher.IsTerminated() && impl_->matcher.AcceptToken(toks[k])) ++k;
  if (k > 0) impl_->matcher.Rollback(k);
  return k;
}

}  // namespace kv
