// libFuzzer targets for what reads untrusted text: the tokenizers, the chat-template engine and
// the OpenAI request parser. One binary; KV_FUZZ_TARGET picks the target (scripts/run_fuzz.sh):
//
//   tokenizer  input = text. For both real tokenizers (SmolLM2's byte-level BPE, Gemma 3's
//              SentencePiece BPE): every id is in the vocabulary; decode(encode(text)) == text
//              for well-formed UTF-8 (BPE; SPM where the text has no leading space and no
//              U+2581, which its normalizer rewrites); the incremental detokenizer, fed one id
//              at a time, gives exactly decode().
//   template   input = a template source, then a NUL, then message text. Parsing and rendering
//              never crash; loops and recursion are bounded (libFuzzer's -timeout and
//              -rss_limit_mb catch what is not). The rest also goes through SmolLM2's real
//              template as message content.
//   request    input = a request body. parse_json_body + both request parsers (and /tokenize,
//              /detokenize) either succeed or throw ApiError with a 4xx status and a message;
//              nothing else escapes.
//
// The models come from KV_FUZZ_MODELS (default: models/ under the working directory).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gguf/gguf.h"
#include "server/openai_request.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

namespace {

enum class Target { kTokenizer, kTemplate, kRequest };

struct Loaded {
  std::unique_ptr<kv::GgufFile> file;
  std::unique_ptr<kv::Tokenizer> tok;
};

Target g_target = Target::kTokenizer;
std::vector<Loaded> g_models;  // [0] SmolLM2 (BPE), [1] Gemma 3 (SPM) when present
std::optional<kv::ChatTemplate> g_chat;
kv::ApiContext g_ctx;

[[noreturn]] void die(const char* what) {
  std::fprintf(stderr, "fuzz_text: %s\n", what);
  std::abort();
}

Loaded load(const std::string& path, bool required) {
  Loaded l;
  auto f = kv::GgufFile::open(path);
  if (!f) {
    if (required) die(("cannot open " + path + ": " + f.message()).c_str());
    return l;
  }
  l.file = std::move(*f);
  auto t = kv::Tokenizer::from_gguf(*l.file);
  if (!t) die(("tokenizer of " + path + ": " + t.message()).c_str());
  l.tok = std::move(*t);
  return l;
}

bool valid_utf8(std::string_view s) { return kv::utf8::is_valid(s); }

// Byte-level BPE spells byte b as one code point: b itself where printable, else 256 + n (GPT-2's
// bytes_to_unicode). A vocabulary may lack some (SmolLM2 has no token for 0x04): such a byte is
// dropped by encode, here and in HuggingFace alike, so texts with one are no round-trip case.
std::vector<bool> g_bpe_byte_ok;

void init_bpe_bytes(const kv::Tokenizer& tok) {
  g_bpe_byte_ok.assign(256, false);
  int n = 0;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    const uint32_t cp = printable ? static_cast<uint32_t>(b) : 256u + static_cast<uint32_t>(n++);
    std::string u;
    if (cp < 0x80) u += static_cast<char>(cp);
    else { u += static_cast<char>(0xC0 | (cp >> 6)); u += static_cast<char>(0x80 | (cp & 0x3F)); }
    g_bpe_byte_ok[b] = tok.find_token(u) >= 0;
  }
}

bool bpe_bytes_ok(std::string_view text) {
  for (unsigned char c : text)
    if (!g_bpe_byte_ok[c]) return false;
  return true;
}

void check_tokenizer(const kv::Tokenizer& tok, std::string_view text, bool spm) {
  for (bool parse_special : {false, true}) {
    const std::vector<int32_t> ids = tok.encode(text, /*add_special=*/false, parse_special);
    for (int32_t id : ids)
      if (id < 0 || id >= tok.n_vocab()) die("token id outside the vocabulary");
    const std::string back = tok.decode(ids, /*special=*/true);
    // Round trip: exact for byte-level BPE on well-formed text; SentencePiece normalizes spaces
    // to U+2581 and strips nothing else here.
    const bool exempt = spm ? (text.empty() || text[0] == ' ' || text.find("\xE2\x96\x81") != std::string_view::npos)
                            : !bpe_bytes_ok(text);
    if (!parse_special && valid_utf8(text) && !exempt && back != text)
      die(spm ? "SPM: decode(encode(text)) != text" : "BPE: decode(encode(text)) != text");
    // The stream decoder agrees with decode() on the same ids.
    kv::IncrementalDetokenizer det(tok, /*special=*/true);
    std::string streamed;
    for (int32_t id : ids) streamed += det.push(id);
    streamed += det.flush();
    if (valid_utf8(back) && streamed != back) die("incremental detokenizer != decode");
  }
}

void run_template(std::string_view data) {
  const size_t nul = data.find('\0');
  const std::string src(data.substr(0, nul));
  const std::string content(nul == std::string_view::npos ? std::string_view() : data.substr(nul + 1));
  std::vector<kv::ChatMessage> msgs = {{"system", "be brief"}, {"user", content}, {"assistant", "ok"}, {"user", "again"}};
  if (auto t = kv::ChatTemplate::parse(src)) {
    auto r = t->render(msgs, true, "<s>", "</s>");
    if (!r && r.message().empty()) die("a render error without a message");
  } else if (t.message().empty()) {
    die("a parse error without a message");
  }
  if (g_chat) {
    auto r = g_chat->render(msgs, true, g_ctx.bos_text, g_ctx.eos_text);
    if (!r) die("the model's own template failed on plain messages");
    if (r->find(content) == std::string::npos) die("the message content is missing from the rendered prompt");
  }
}

void run_request(std::string_view data) {
  const std::string body(data);
  for (bool chat : {false, true}) {
    try {
      const nlohmann::json j = kv::parse_json_body(body, g_ctx);
      kv::ApiRequest r = chat ? kv::parse_chat_request(j, g_ctx) : kv::parse_completion_request(j, g_ctx);
      if (r.prompts.empty()) die("an accepted request with no prompt");
      if (chat && r.prompts.size() != 1) die("a chat request with several prompts");
      for (const auto& prompt : r.prompts) {
        if (prompt.empty()) die("an accepted request with an empty prompt");
        for (int32_t id : prompt)
          if (id < 0 || id >= g_ctx.tok->n_vocab()) die("an accepted prompt token outside the vocabulary");
      }
      if (r.params.n < 1 || r.params.n > g_ctx.max_n) die("n outside its bounds");
      if (r.params.max_tokens < 1) die("max_tokens < 1 accepted");
      if (r.params.min_tokens < 0 || r.params.min_tokens > r.params.max_tokens) die("min_tokens outside [0, max_tokens] accepted");
    } catch (const kv::ApiError& e) {
      if (e.status < 400 || e.status >= 500 || e.message.empty()) die("an ApiError that is not a 4xx with a message");
    }
  }
  for (bool detok : {false, true}) {  // /tokenize and /detokenize
    try {
      const nlohmann::json j = kv::parse_json_body(body, g_ctx);
      const std::vector<int32_t> ids = detok ? kv::parse_detokenize_request(j, g_ctx) : kv::parse_tokenize_request(j, g_ctx).ids;
      for (int32_t id : ids)
        if (id < 0 || id >= g_ctx.tok->n_vocab()) die("/tokenize or /detokenize let a token outside the vocabulary through");
      if (detok) (void)g_ctx.tok->decode(ids);
    } catch (const kv::ApiError& e) {
      if (e.status < 400 || e.status >= 500 || e.message.empty()) die("an ApiError that is not a 4xx with a message");
    }
  }
}

}  // namespace

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  const char* t = std::getenv("KV_FUZZ_TARGET");
  const std::string target = t ? t : "tokenizer";
  if (target == "tokenizer") g_target = Target::kTokenizer;
  else if (target == "template") g_target = Target::kTemplate;
  else if (target == "request") g_target = Target::kRequest;
  else die("KV_FUZZ_TARGET must be tokenizer, template or request");
  const char* dir = std::getenv("KV_FUZZ_MODELS");
  const std::string models = dir ? dir : "models";
  g_models.push_back(load(models + "/SmolLM2-135M-Instruct.Q4_1.gguf", true));
  init_bpe_bytes(*g_models[0].tok);
  if (!g_bpe_byte_ok['a'] || !g_bpe_byte_ok[' '] || !g_bpe_byte_ok[0xC3]) die("the byte-level spelling table is wrong");
  Loaded gemma = load(models + "/gemma-3-270m-Q4_K_M.gguf", false);
  if (gemma.tok) g_models.push_back(std::move(gemma));
  const kv::GgufValue* src = g_models[0].file->find("tokenizer.chat_template");
  if (!src) die("SmolLM2 has no chat template");
  auto chat = kv::ChatTemplate::parse(src->str);
  if (!chat) die("SmolLM2's chat template does not parse");
  g_chat = std::move(*chat);
  g_ctx = kv::make_api_context(*g_models[0].tok, &*g_chat, models + "/SmolLM2-135M-Instruct.Q4_1.gguf", "", 2048, 4);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view in(reinterpret_cast<const char*>(data), size);
  switch (g_target) {
    case Target::kTokenizer:
      for (size_t i = 0; i < g_models.size(); ++i) check_tokenizer(*g_models[i].tok, in, i == 1);
      break;
    case Target::kTemplate: run_template(in); break;
    case Target::kRequest: run_request(in); break;
  }
  return 0;
}
