// Structured outputs (engine/structured_output.h) on SmolLM2's real vocabulary: the mask a
// constraint gives equals the set of tokens an independent check over each token's bytes allows
// (std::regex on the text so far + the token), control tokens never pass, end-of-generation
// passes exactly when the text is complete, and the sampler's draw (engine/speculative.h) keeps
// to the mask.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <regex>
#include <atomic>
#include <string>
#include <thread>
#include <vector>

#include "engine/sampler.h"
#include "engine/speculative.h"
#include "engine/structured_output.h"
#include "model_fixture.h"

namespace {

using kv::ConstraintCompiler;
using kv::ConstraintMatcher;
using kv::OutputConstraint;

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

OutputConstraint regex(const std::string& r) {
  OutputConstraint c;
  c.kind = OutputConstraint::Kind::kRegex;
  c.spec = r;
  return c;
}

// Tokens the mask leaves at their logit (all logits 0 going in).
std::vector<bool> allowed(ConstraintMatcher& m, int32_t nv) {
  std::vector<float> lg(nv, 0.f);
  const int32_t n = m.mask(lg.data(), nv);
  std::vector<bool> ok(nv);
  int32_t count = 0;
  for (int32_t v = 0; v < nv; ++v) count += ok[v] = lg[v] == 0.f;
  EXPECT_EQ(count, n);
  return ok;
}

// "[0-9]{1,3}-[a-z]+": after `text`, token v may come next iff text + bytes(v) is a prefix of a
// full match. A prefix check by regex: the pattern's prefixes, written out by hand for this one.
bool digits_dash_letters_prefix(const std::string& s) {
  static const std::regex p(R"([0-9]{0,3}|[0-9]{1,3}-[a-z]*)");
  return std::regex_match(s, p);
}

TEST(StructuredOutput, RegexMaskIsTheTokensThatKeepAMatchPossible) {
  const kv::Tokenizer* tok = kvtest::smollm2_tokenizer();
  kv::LlamaModel* model = kvtest::smollm2_model();
  ASSERT_TRUE(tok && model);
  const int32_t nv = model->config().n_vocab;
  ConstraintCompiler cc(*tok, nv);
  ConstraintMatcher m(cc.compile(regex("[0-9]{1,3}-[a-z]+")));
  std::string text;
  // A path through the constraint: "1", "2", "-", "ab", then the end (SmolLM2 spells digits one
  // token each).
  for (const std::string next : {"1", "2", "-", "ab"}) {
    const std::vector<bool> ok = allowed(m, nv);
    int32_t n_ok = 0;
    for (int32_t v = 0; v < nv; ++v) {
      const bool control = tok->token_type(v) == kv::TokenType::kControl;
      const std::string b = v < tok->n_vocab() && !control ? tok->token_bytes(v) : "";
      const bool want = !b.empty() && digits_dash_letters_prefix(text + b);
      if (tok->is_eog(v)) {
        EXPECT_FALSE(ok[v]) << "end allowed after '" << text << "'";
        continue;
      }
      EXPECT_EQ(ok[v], want) << "token " << v << " '" << b << "' after '" << text << "'";
      n_ok += want;
    }
    EXPECT_GT(n_ok, 0);
    const int32_t id = tok->find_token(next);
    ASSERT_GE(id, 0) << next;
    ASSERT_TRUE(m.accept(id));
    text += next;
  }
  // "12-ab" is complete: end of generation is allowed, and more letters.
  EXPECT_TRUE(m.complete());
  const std::vector<bool> ok = allowed(m, nv);
  EXPECT_TRUE(ok[tok->eos_id()]);
  EXPECT_TRUE(ok[tok->find_token("c")]);
  EXPECT_FALSE(ok[tok->find_token("1")]);
  EXPECT_FALSE(m.accept(tok->find_token("1")));  // refused, and nothing changed
  EXPECT_TRUE(m.complete());
  EXPECT_TRUE(m.accept(tok->eos_id()));
  EXPECT_TRUE(m.terminated());
}

TEST(StructuredOutput, ChoicesWithQuotesAndNewlines) {
  const kv::Tokenizer* tok = kvtest::smollm2_tokenizer();
  kv::LlamaModel* model = kvtest::smollm2_model();
  ASSERT_TRUE(tok && model);
  ConstraintCompiler cc(*tok, model->config().n_vocab);
  OutputConstraint c;
  c.kind = OutputConstraint::Kind::kChoice;
  c.choices = {"say \"hi\"", "a\\b", "x\ny"};
  for (const std::string& want : c.choices) {
    ConstraintMatcher m(cc.compile(c));
    for (int32_t id : tok->encode(want, false, false)) ASSERT_TRUE(m.accept(id)) << want;
    EXPECT_TRUE(m.complete()) << want;
  }
  c.choices = {"bell\a"};
  EXPECT_THROW(cc.compile(c), std::invalid_argument);
}

TEST(StructuredOutput, BadConstraintsThrowWithTheLibrarysReason) {
  const kv::Tokenizer* tok = kvtest::smollm2_tokenizer();
  kv::LlamaModel* model = kvtest::smollm2_model();
  ASSERT_TRUE(tok && model);
  ConstraintCompiler cc(*tok, model->config().n_vocab);
  try {
    cc.compile(regex("(("));
    FAIL() << "no throw";
  } catch (const std::invalid_argument& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("invalid regex: "), std::string::npos) << msg;
    EXPECT_EQ(msg.find(".cc:"), std::string::npos) << msg;
  }
  OutputConstraint g;
  g.kind = OutputConstraint::Kind::kGrammar;
  g.spec = "root ::= undefined_rule";
  EXPECT_THROW(cc.compile(g), std::invalid_argument);
}

// A constraint xgrammar enforces only in part (it warns) is refused however many requests bring
// it at once: xgrammar's cache hands a concurrent compile of the same text the first one's
// grammar without its warning, so without the wait for the first verdict the others got through.
// Then a bound on the remembered refusals must not forget one xgrammar still has cached.
TEST(StructuredOutput, APartlyEnforcedSchemaIsRefusedByConcurrentFirstCompiles) {
  const kv::Tokenizer* tok = kvtest::smollm2_tokenizer();
  kv::LlamaModel* model = kvtest::smollm2_model();
  ASSERT_TRUE(tok && model);
  ConstraintCompiler cc(*tok, model->config().n_vocab);
  constexpr int kThreads = 6, kRounds = 8;
  for (int round = 0; round < kRounds; ++round) {
    OutputConstraint c;
    c.kind = OutputConstraint::Kind::kJsonSchema;
    // pattern beside maxLength: xgrammar keeps the pattern and warns that it drops the length
    c.spec = R"({"type": "object", "description": "round )" + std::to_string(round) +
             R"(", "properties": {"code": {"type": "string", "pattern": "^[A-Z]+$", "maxLength": 4}}, "required": ["code"]})";
    std::atomic<int> go{0}, accepted{0};
    std::vector<std::thread> ts;
    for (int i = 0; i < kThreads; ++i)
      ts.emplace_back([&] {
        ++go;
        while (go.load() < kThreads) std::this_thread::yield();
        try {
          cc.compile(c);
          ++accepted;
        } catch (const std::invalid_argument&) {
        }
      });
    for (auto& t : ts) t.join();
    EXPECT_EQ(accepted.load(), 0) << "round " << round;
  }
}

// The draw under a constraint: greedy takes the best allowed token, sampling draws only allowed
// ones, and the matcher advances by what was drawn.
TEST(StructuredOutput, DrawsStayInsideTheMask) {
  const kv::Tokenizer* tok = kvtest::smollm2_tokenizer();
  kv::LlamaModel* model = kvtest::smollm2_model();
  ASSERT_TRUE(tok && model);
  const int32_t nv = model->config().n_vocab;
  ConstraintCompiler cc(*tok, nv);
  auto compiled = cc.compile(regex("(yes|no)"));
  std::vector<float> logits(nv);
  for (int32_t v = 0; v < nv; ++v) logits[v] = std::sin(0.37f * float(v)) * 4.f;  // any fixed row
  logits[tok->find_token("maybe")] = 100.f;  // the model's favourite is not allowed
  std::vector<float> buf(nv);
  for (float temp : {0.f, 1.f}) {
    for (uint64_t seed = 1; seed <= 20; ++seed) {
      kv::SamplingParams sp;
      sp.temperature = temp;
      sp.seed = seed;
      kv::Sampler sampler(sp);
      ConstraintMatcher m(compiled);
      std::vector<int32_t> hist = {1, 2, 3}, out;
      kv::SamplerScratch ws;
      std::vector<float> seen;
      kv::verify_draft(sampler, logits.data(), 1, nv, nullptr, hist, 3, &ws, buf.data(), &out, kv::DrawRules{&m, nullptr},
                       [&](int32_t, const float* row, int32_t) { seen.assign(row, row + nv); });
      ASSERT_EQ(out.size(), 1u);
      const std::string first = tok->token_bytes(out[0]);
      EXPECT_TRUE(std::string("yes").rfind(first, 0) == 0 || std::string("no").rfind(first, 0) == 0) << first;
      EXPECT_EQ(seen[tok->find_token("maybe")], kNegInf);  // the row the logprobs see is masked
      if (temp == 0.f) {  // greedy: the best of the allowed tokens
        int32_t best = -1;
        for (int32_t v = 0; v < nv; ++v)
          if (seen[v] != kNegInf && (best < 0 || seen[v] > seen[best])) best = v;
        EXPECT_EQ(out[0], best);
      }
      EXPECT_FALSE(m.accept(tok->find_token("maybe")));  // it advanced past `first`
    }
  }
}

}  // namespace

namespace {

// min_tokens under a constraint that is already complete (only an end of generation allowed):
// the constraint wins, and the draw is the best end-of-generation token, not id 0 of an all
// −inf row (Gemma 3's <pad>).
TEST(StructuredOutput, MinTokensDoesNotBanTheOnlyWayOut) {
  const kv::Tokenizer* tok = kvtest::smollm2_tokenizer();
  kv::LlamaModel* model = kvtest::smollm2_model();
  ASSERT_TRUE(tok && model);
  const int32_t nv = model->config().n_vocab;
  ConstraintCompiler cc(*tok, nv);
  ConstraintMatcher m(cc.compile(regex("yes")));
  ASSERT_TRUE(m.accept(tok->find_token("yes")));
  ASSERT_TRUE(m.complete());
  std::vector<int32_t> eog;
  for (int32_t v = 0; v < tok->n_vocab(); ++v)
    if (tok->is_eog(v)) eog.push_back(v);
  ASSERT_GE(eog.size(), 2u);
  std::vector<float> logits(nv, 0.f);
  logits[eog.back()] = 5.f;  // the best end, not id 0
  std::vector<float> buf(nv);
  kv::SamplingParams sp;  // greedy
  kv::Sampler sampler(sp);
  std::vector<int32_t> hist = {1}, out;
  kv::SamplerScratch ws;
  kv::DrawRules rules{&m, nullptr, &eog, 1};
  kv::verify_draft(sampler, logits.data(), 1, nv, nullptr, hist, 1, &ws, buf.data(), &out, rules, nullptr);
  ASSERT_EQ(out.size(), 1u);
  EXPECT_EQ(out[0], eog.back());
}

}  // namespace
