// Tokenizer tests: HF conformance on the SmolLM2 corpus (tests/data/tokenizer/, made by
// tests/tokenizer/oracle.py), round trips, incremental detokenization, special-token parsing
// and from_gguf errors on in-memory GGUFs.
#include <gtest/gtest.h>

#include <chrono>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>
#include <string>
#include <thread>
#include <vector>

#include "gguf/gguf.h"
#include "test_tokenizer_util.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace kv {
namespace {

using tok_test::GgufBuilder;

const std::string kModel = std::string(KV_SOURCE_DIR) + "/models/SmolLM2-135M-Instruct.Q4_1.gguf";
const std::string kCorpus = std::string(KV_SOURCE_DIR) + "/tests/data/tokenizer/smollm2_corpus.jsonl";

// Loaded once; a missing model is a failure, not a skip.
struct Smol {
  std::unique_ptr<GgufFile> file;
  std::unique_ptr<Tokenizer> tok;
  std::string error;
};
const Smol& smol() {
  static const Smol s = [] {
    Smol r;
    auto f = GgufFile::open(kModel);
    if (!f) {
      r.error = kModel + " cannot be opened (" + f.message() + "): run `make models`";
      return r;
    }
    r.file = std::move(*f);
    auto t = Tokenizer::from_gguf(*r.file);
    if (!t) {
      r.error = "from_gguf: " + t.message();
      return r;
    }
    r.tok = std::move(*t);
    return r;
  }();
  return s;
}
#define REQUIRE_SMOL()                    \
  const Smol& S = smol();                 \
  ASSERT_TRUE(S.tok != nullptr) << S.error; \
  const Tokenizer& tok = *S.tok

struct Case {
  std::string text;
  std::vector<int32_t> ids, ids_raw;
};
std::vector<Case> load_corpus() {
  std::vector<Case> out;
  std::ifstream in(kCorpus);
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    Case c{j["text"].get<std::string>(), j["ids"].get<std::vector<int32_t>>(), {}};
    c.ids_raw = j.contains("ids_raw") ? j["ids_raw"].get<std::vector<int32_t>>() : c.ids;
    out.push_back(std::move(c));
  }
  return out;
}

std::string show(const std::vector<int32_t>& v) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ',';
    s += std::to_string(v[i]);
  }
  return s + "]";
}

TEST(Tokenizer, SmolMetadata) {
  REQUIRE_SMOL();
  EXPECT_EQ(tok.model_kind(), "gpt2");
  EXPECT_EQ(tok.pre_kind(), "smollm");
  EXPECT_EQ(tok.n_vocab(), 49152);
  EXPECT_EQ(tok.bos_id(), 1);
  EXPECT_EQ(tok.eos_id(), 2);
  EXPECT_FALSE(tok.add_bos());
  EXPECT_TRUE(tok.is_eog(2));   // <|im_end|> (EOS)
  EXPECT_TRUE(tok.is_eog(0));   // <|endoftext|>
  EXPECT_FALSE(tok.is_eog(1));  // <|im_start|>
  EXPECT_FALSE(tok.is_eog(28));
  EXPECT_EQ(tok.token_type(1), TokenType::kControl);
  EXPECT_EQ(tok.find_token("<|im_start|>"), 1);
}

// The bar: every corpus string gives exactly HF's ids, both with special-token parsing (the
// HF default) and without it (HF encode_special_tokens=True).
TEST(Tokenizer, SmolCorpusMatchesHuggingFace) {
  REQUIRE_SMOL();
  const std::vector<Case> corpus = load_corpus();
  ASSERT_GE(corpus.size(), 2000u) << kCorpus << " missing or short: run tests/tokenizer/oracle.py";
  size_t ok = 0, ok_raw = 0, shown = 0;
  for (const Case& c : corpus) {
    const std::vector<int32_t> got = tok.encode(c.text, /*add_special=*/true, /*parse_special=*/true);
    const std::vector<int32_t> raw = tok.encode(c.text, /*add_special=*/false, /*parse_special=*/false);
    ok += got == c.ids;
    ok_raw += raw == c.ids_raw;
    if ((got != c.ids || raw != c.ids_raw) && shown++ < 10) {
      ADD_FAILURE() << "text " << nlohmann::json(c.text).dump() << "\n  want " << show(c.ids) << "\n  got  "
                    << show(got) << "\n  want raw " << show(c.ids_raw) << "\n  got raw  " << show(raw);
    }
  }
  EXPECT_EQ(ok, corpus.size());
  EXPECT_EQ(ok_raw, corpus.size());
  std::printf("[ corpus ] %zu/%zu identical (parse_special), %zu/%zu (raw)\n", ok, corpus.size(), ok_raw,
              corpus.size());
}

// Bytes with a single-byte token. SmolLM2's vocabulary lacks a few (0xF1-0xF7, 0xFF, ...: lead
// bytes of planes 4+ and bytes UTF-8 never uses); HF drops such bytes and so do we.
std::vector<bool> byte_tokens(const Tokenizer& tok) {
  std::vector<bool> has(256, false);
  for (int32_t id = 0; id < tok.n_vocab(); ++id) {
    const std::string b = tok.token_bytes(id);
    if (b.size() == 1) has[static_cast<unsigned char>(b[0])] = true;
  }
  return has;
}

TEST(Tokenizer, SmolRoundTrip) {
  REQUIRE_SMOL();
  const std::vector<bool> has = byte_tokens(tok);
  size_t n_lossy = 0;
  for (const Case& c : load_corpus()) {
    ASSERT_TRUE(utf8::is_valid(c.text));
    std::string want;
    for (char ch : c.text) if (has[static_cast<unsigned char>(ch)]) want += ch;
    n_lossy += want != c.text;
    EXPECT_EQ(tok.decode(tok.encode(c.text, true, true), /*special=*/true), want);
    EXPECT_EQ(tok.decode(tok.encode(c.text, false, false)), want);
  }
  EXPECT_LT(n_lossy, 400u);  // only random characters of planes 4+ and C0 controls lose bytes
}

TEST(Tokenizer, SmolSpeed) {
  const Smol& S = smol();
  ASSERT_TRUE(S.file != nullptr) << S.error;
  auto fresh = Tokenizer::from_gguf(*S.file);  // cold cache
  ASSERT_TRUE(fresh) << fresh.message();
  const std::vector<Case> corpus = load_corpus();
  ASSERT_FALSE(corpus.empty());
  size_t n_tokens = 0;
  const auto t0 = std::chrono::steady_clock::now();
  for (const Case& c : corpus) n_tokens += (*fresh)->encode(c.text, true, true).size();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  std::printf("[ speed  ] %zu strings, %zu tokens in %.3f s: %.0f strings/s, %.2f Mtok/s (cold cache)\n",
              corpus.size(), n_tokens, s, corpus.size() / s, n_tokens / s / 1e6);
  EXPECT_LT(s, 1.0);
}

// Pathological lengths stay fast (no quadratic BPE, no regex blow-up, no JIT stack failure).
TEST(Tokenizer, SmolLongInputs) {
  REQUIRE_SMOL();
  const auto t0 = std::chrono::steady_clock::now();
  for (const std::string& s : {std::string(200000, 'a'), std::string(200000, ' '), std::string(100000, '7'),
                               std::string(50000, '\n') + "x", std::string(40000, '!') + "abc"}) {
    const auto ids = tok.encode(s, false, true);
    EXPECT_EQ(tok.decode(ids), s);
  }
  const double sec = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(sec, 2.0);
  std::printf("[ long   ] 590 KB of pathological runs in %.3f s\n", sec);
}

TEST(Tokenizer, SmolConcurrentEncode) {
  REQUIRE_SMOL();
  const std::vector<Case> corpus = load_corpus();
  std::vector<int> bad(4, 0);
  std::vector<std::thread> th;
  for (int t = 0; t < 4; ++t) {
    th.emplace_back([&, t] {
      for (size_t i = t; i < corpus.size(); i += 2) bad[t] += tok.encode(corpus[i].text, true, true) != corpus[i].ids;
    });
  }
  for (auto& x : th) x.join();
  for (int b : bad) EXPECT_EQ(b, 0);
}

TEST(Tokenizer, SmolSpecialParsing) {
  REQUIRE_SMOL();
  const std::string chat = "<|im_start|>user\nHi<|im_end|>";
  const auto on = tok.encode(chat, false, true);
  const auto off = tok.encode(chat, false, false);
  ASSERT_GE(on.size(), 3u);
  EXPECT_EQ(on.front(), 1);
  EXPECT_EQ(on.back(), 2);
  for (int32_t id : off) EXPECT_GT(id, 16) << "control token parsed with parse_special=false";
  EXPECT_EQ(tok.decode(off), chat);
  EXPECT_EQ(tok.decode(on), "user\nHi");  // control tokens hidden unless special
  EXPECT_EQ(tok.decode(on, true), chat);
  // Glued and partial spellings.
  const auto glued = tok.encode("word<|endoftext|>word", false, true);
  EXPECT_EQ(std::count(glued.begin(), glued.end(), 0), 1);
  for (int32_t id : tok.encode("<|im_ <|im_start <|endoftext", false, true)) EXPECT_GT(id, 16);
  // add_special adds nothing for SmolLM2 (add_bos_token false).
  EXPECT_EQ(tok.encode("hello", true, true), tok.encode("hello", false, true));
  // Digits are split one by one (the smollm pre-tokenizer).
  const auto digits = tok.encode("x  12345", false, true);
  EXPECT_EQ(digits.size(), 7u) << show(digits);
}

TEST(Tokenizer, SmolInvalidUtf8) {
  REQUIRE_SMOL();
  const std::string bad = std::string("ab\x80") + "c\xe2\x82" + " d\xc3\xc3\xa9\xed\xa0\x80";
  const auto ids = tok.encode(bad, false, true);
  EXPECT_EQ(tok.decode(ids), bad);
}

TEST(Tokenizer, IncrementalDetokenizerEmoji) {
  REQUIRE_SMOL();
  const std::string text = "Hi 😀! 👨‍👩‍👧‍👦 family, 🇯🇵 flag, café 漢字";
  const auto ids = tok.encode(text, false, true);
  IncrementalDetokenizer d(tok);
  std::string out;
  int empty_pushes = 0;
  for (int32_t id : ids) {
    std::string piece = d.push(id);
    EXPECT_TRUE(utf8::is_valid(piece)) << "half a character emitted at token " << id;
    empty_pushes += piece.empty();
    out += piece;
  }
  out += d.flush();
  EXPECT_EQ(out, text);
  EXPECT_GT(empty_pushes, 0) << "expected at least one emoji split across byte tokens";
}

TEST(Tokenizer, IncrementalDetokenizerInvalid) {
  REQUIRE_SMOL();
  // Byte tokens: find the ids of single bytes through encode of invalid UTF-8.
  const auto lone = tok.encode(std::string("\x80"), false, false);  // stray continuation byte
  const auto lead = tok.encode(std::string("\xF0\x9F"), false, false);  // truncated 4-byte lead
  ASSERT_EQ(lone.size(), 1u);
  IncrementalDetokenizer d(tok);
  EXPECT_EQ(d.push(lone[0]), "\xEF\xBF\xBD");  // can never become valid: replaced at once
  std::string s;
  for (int32_t id : lead) s += d.push(id);
  EXPECT_EQ(s, "");                             // might still complete
  EXPECT_EQ(d.flush(), "\xEF\xBF\xBD");          // truncated at the end: one U+FFFD
  EXPECT_EQ(d.flush(), "");
  // A truncated lead followed by ASCII: the lead becomes U+FFFD and the ASCII survives.
  IncrementalDetokenizer d2(tok);
  std::string s2;
  for (int32_t id : lead) s2 += d2.push(id);
  for (int32_t id : tok.encode("ok", false, false)) s2 += d2.push(id);
  EXPECT_EQ(s2 + d2.flush(), "\xEF\xBF\xBDok");
  // The end of a generation drops a truncated character instead (as vLLM): nothing is left.
  IncrementalDetokenizer d3(tok);
  for (int32_t id : lead) EXPECT_EQ(d3.push(id), "");
  d3.finish();
  EXPECT_EQ(d3.flush(), "");
}

TEST(Utf8, Sanitize) {
  EXPECT_EQ(utf8::sanitize("a\xC3\xA9"), "a\xC3\xA9");
  EXPECT_EQ(utf8::sanitize("\xE0\x80\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong
  EXPECT_EQ(utf8::sanitize("\xED\xA0\x80"), "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // surrogate
  EXPECT_EQ(utf8::sanitize("\xF0\x9F\x98"), "\xEF\xBF\xBD");                          // truncated
  EXPECT_FALSE(utf8::is_valid("\xF4\x90\x80\x80"));                                  // > U+10FFFF
}

// ---- from_gguf on small in-memory GGUFs ----

// A tiny byte-level vocabulary: <|end|>, the 256 byte spellings, "ab", "abc", " a" (Ġa).
struct Tiny {
  std::vector<std::string> tokens;
  std::vector<int32_t> types;
  std::vector<std::string> merges{"a b", "ab c", "Ġ a"};
  Tiny() {
    tokens.push_back("<|end|>");
    types.push_back(3);
    uint32_t extra = 0;
    for (uint32_t b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      std::string sp;
      utf8::append(sp, printable ? b : 256 + extra++);
      tokens.push_back(sp);
      types.push_back(1);
    }
    for (const char* t : {"ab", "abc", "Ġa"}) {
      tokens.push_back(t);
      types.push_back(1);
    }
  }
  GgufBuilder builder(const std::string& pre = "gpt2") const {
    GgufBuilder b;
    b.str("tokenizer.ggml.model", "gpt2").str("tokenizer.ggml.pre", pre).strs("tokenizer.ggml.tokens", tokens);
    b.i32s("tokenizer.ggml.token_type", types).strs("tokenizer.ggml.merges", merges);
    b.u32("tokenizer.ggml.eos_token_id", 0);
    return b;
  }
};

Result<std::unique_ptr<Tokenizer>> from_bytes(const std::vector<uint8_t>& bytes, std::unique_ptr<GgufFile>& keep) {
  auto f = GgufFile::parse(bytes.data(), bytes.size());
  if (!f) return Result<std::unique_ptr<Tokenizer>>::error("gguf: " + f.message());
  keep = std::move(*f);
  return Tokenizer::from_gguf(*keep);
}

TEST(TokenizerFromGguf, TinyVocabWorks) {
  Tiny tiny;
  const auto bytes = tiny.builder().bytes();
  std::unique_ptr<GgufFile> f;
  auto t = from_bytes(bytes, f);
  ASSERT_TRUE(t) << t.message();
  const Tokenizer& tok = **t;
  const int32_t ab = tok.find_token("ab"), abc = tok.find_token("abc"), sp_a = tok.find_token("Ġa");
  // " ab": "a b" (rank 0) beats "Ġ a" (rank 2), so it is Ġ + ab.
  EXPECT_EQ(tok.encode("abc ab a<|end|>", false, true),
            (std::vector<int32_t>{abc, tok.find_token("Ġ"), ab, sp_a, 0}));
  EXPECT_EQ(tok.encode("ab", false, true), std::vector<int32_t>{ab});
  EXPECT_TRUE(tok.is_eog(0));
  EXPECT_EQ(tok.decode(tok.encode("x\xff y", false, false)), "x\xff y");
}

void expect_error(const GgufBuilder& b, const std::string& needle) {
  const auto bytes = b.bytes();
  std::unique_ptr<GgufFile> f;
  auto t = from_bytes(bytes, f);
  ASSERT_FALSE(t) << "expected an error mentioning " << needle;
  EXPECT_NE(t.message().find(needle), std::string::npos) << t.message();
}

TEST(TokenizerFromGguf, Errors) {
  Tiny tiny;
  {
    Tiny t = tiny;
    t.merges.push_back("a zz");  // unknown right token
    expect_error(t.builder(), "\"zz\" is not in the vocabulary");
  }
  {
    Tiny t = tiny;
    t.merges.push_back("b c");  // "bc" missing
    expect_error(t.builder(), "merged token \"bc\"");
  }
  {
    Tiny t = tiny;
    t.merges.push_back("abc");
    expect_error(t.builder(), "not two tokens");
  }
  {
    Tiny t = tiny;
    t.types.pop_back();
    expect_error(t.builder(), "token_type has");
  }
  {
    Tiny t = tiny;
    t.types[5] = 42;
    expect_error(t.builder(), "token_type[5]");
  }
  expect_error(tiny.builder().u32("tokenizer.ggml.bos_token_id", 100000), "bos_token_id = 100000 is outside");
  expect_error(tiny.builder().boolean("tokenizer.ggml.add_bos_token", true), "no bos_token_id");
  expect_error(tiny.builder("no-such-pre"), "tokenizer.ggml.pre = \"no-such-pre\" is not supported");
  expect_error(GgufBuilder().str("tokenizer.ggml.model", "gpt2"), "no tokenizer.ggml.tokens");
  expect_error(GgufBuilder().str("general.name", "x"), "no tokenizer.ggml.model");
  expect_error(GgufBuilder().str("tokenizer.ggml.model", "llama").strs("tokenizer.ggml.tokens", {"a"}),
               "no tokenizer.ggml.scores");
  expect_error(GgufBuilder().str("tokenizer.ggml.model", "bert").strs("tokenizer.ggml.tokens", {"a"}),
               "\"bert\" is not supported");
  {
    GgufBuilder b;
    b.str("tokenizer.ggml.model", "gpt2").str("tokenizer.ggml.pre", "gpt2").strs("tokenizer.ggml.tokens", tiny.tokens);
    expect_error(b, "no tokenizer.ggml.merges");
  }
}

}  // namespace
}  // namespace kv
