// Structured outputs: a constraint on what a choice may say, as a mask over the next token.
//
// A constraint is a JSON object (any), an instance of a JSON schema (its properties generated in
// the order the schema lists them), a full match of a regular
// expression, one of a list of strings, or a sentence of an EBNF grammar (GBNF, as llama.cpp and
// vLLM take it). xgrammar (the library vLLM and SGLang use) compiles it against the vocabulary
// once (ConstraintCompiler, on the HTTP thread that parsed the request, so a slow compile never
// holds the engine); each choice then walks it with its own ConstraintMatcher, which masks the
// tokens that cannot continue the text (logit −inf) before the sampler draws, and advances by the
// token drawn. End-of-generation tokens are allowed exactly when the text is complete.
//
// The vocabulary is given to xgrammar as each token's bytes (Tokenizer::token_bytes), so
// byte-level BPE and SentencePiece byte fallback look the same to it; control tokens have no
// bytes and are never allowed, the end-of-generation ones aside.
#pragma once
#include <cstdint>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace kv {

class Tokenizer;

struct OutputConstraint {
  // kJson: a JSON object (OpenAI's JSON mode)
  enum class Kind { kNone, kJson, kJsonSchema, kRegex, kChoice, kGrammar } kind = Kind::kNone;
  std::string spec;                  // kJsonSchema: the schema's JSON text; kRegex; kGrammar (EBNF, root rule "root")
  std::vector<std::string> choices;  // kChoice
  bool any_whitespace = true;        // JSON: any whitespace between tokens (vLLM's default), else none
};
const char* constraint_kind_name(OutputConstraint::Kind k);  // "json", "json_schema", "regex", "choice", "grammar"

class CompiledConstraint;  // xgrammar's compiled grammar for one vocabulary

// One per model. Thread-safe; compiles run side by side.
class ConstraintCompiler {
 public:
  // n_vocab: the model's logits width (≥ the tokenizer's vocabulary).
  ConstraintCompiler(const Tokenizer& tok, int32_t n_vocab);
  ~ConstraintCompiler();
  // Throws std::invalid_argument with a message fit for a 400 (bad schema, regex or grammar).
  std::shared_ptr<const CompiledConstraint> compile(const OutputConstraint& c);

 private:
  // Throws std::invalid_argument when a JSON schema uses a keyword xgrammar would ignore.
  static void refuse_unenforced(const std::string& schema);
  struct Impl;
  const Tokenizer& tok_;
  int32_t n_vocab_;
  std::once_flag init_;
  std::unique_ptr<Impl> impl_;  // built at the first compile (the vocabulary's tables take a moment)
  // Constraints xgrammar warned about (it enforces them only in part), by kind and text → the
  // reason: xgrammar's cache compiles a constraint once, so its second compile warns no more.
  // A compile of a text another thread is compiling waits for that one's verdict (in_flight_):
  // xgrammar's cache would hand it the same grammar without the warning.
  std::mutex refused_mu_;
  std::condition_variable refused_cv_;
  std::unordered_map<std::string, std::string> refused_;
  std::unordered_map<std::string, int> in_flight_;
};

// One choice's walk through a constraint. Not thread-safe; moves with its sequence.
class ConstraintMatcher {
 public:
  explicit ConstraintMatcher(std::shared_ptr<const CompiledConstraint> c);
  ~ConstraintMatcher();
  ConstraintMatcher(ConstraintMatcher&&) noexcept;
  ConstraintMatcher& operator=(ConstraintMatcher&&) noexcept;
  // Sets logits[v] = −inf for every token v < n_vocab the constraint does not allow next.
  // Returns the number of tokens left allowed. Should none be (a grammar with no way on from
  // here), the end-of-generation tokens keep their logits, so the choice ends.
  int32_t mask(float* logits, int32_t n_vocab);
  // Advances past `token`; false (and no change) if the constraint does not allow it.
  bool accept(int32_t token);
  // The text so far is complete (an end-of-generation token is allowed).
  bool complete() const;
  // An end-of-generation token was accepted: the constraint has nothing more to say (under
  // ignore_eos the choice goes on unconstrained).
  bool terminated() const;
  // Jump-forward: the text the constraint forces next (the only text it allows from here, e.g.
  // the rest of a key, or a literal; xgrammar's FindJumpForwardString). Empty when nothing is
  // forced. The walk does not move.
  std::string forced_text();
  // How many of toks[0, n) in a row the constraint allows from here (a draft's part that can
  // be accepted). The walk does not move.
  int32_t allowed_prefix(const int32_t* toks, int32_t n);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kv
