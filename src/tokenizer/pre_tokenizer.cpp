#define PCRE2_CODE_UNIT_WIDTH 8
#include "tokenizer/pre_tokenizer.h"

#include <pcre2.h>

#include "tokenizer/utf8.h"

namespace kv {
namespace {

// GPT-2's split as HuggingFace ByteLevel(use_regex=True) runs it. llama.cpp drops the final
// "|\s+": the text it leaves unmatched becomes a fragment anyway, so the result is the same.
constexpr const char* kGpt2 =
    "'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+";
constexpr const char* kLlama3 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";
constexpr const char* kQwen2 =
    "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}"
    "| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

struct Entry {
  const char* names;  // space-separated tokenizer.ggml.pre values
  PreTokenizerSpec spec;
};

const std::vector<Entry>& table() {
  static const std::vector<Entry> t = {
      // Digits one by one, then GPT-2: HF Sequence[Digits(individual_digits), ByteLevel].
      {"smollm starcoder refact command-r codeshell exaone minerva", {{"\\p{N}", kGpt2}, false, false}},
      {"gpt2 gpt-2 phi-2 mpt olmo jais jina-es jina-de jina-v2-es jina-v2-de", {{kGpt2}, false, false}},
      {"llama3 llama-v3 llama-bpe falcon3 pixtral", {{kLlama3}, true, true}},
      {"dbrx smaug-bpe", {{kLlama3}, false, false}},
      {"qwen2 deepseek-r1-qwen", {{kQwen2}, false, false}},
      // llama.cpp's fallback for an unknown or absent value.
      {"default",
       {{"[\\p{P}\\$\\+<=>\\^~\\|]+", kGpt2, "\\p{N}+", "[0-9][0-9][0-9]"}, false, false}},
  };
  return t;
}

// PCRE2 10.42 ships Unicode 14 tables; HF tokenizers (Oniguruma, Rust char) use Unicode 16, the
// reference the models' tokenizers run on. These are the code points Unicode 15-16 made letters
// or numbers (found by probing every code point through HF's ByteLevel pre-tokenizer and PCRE2;
// nothing changed category the other way). Harmless duplicates when PCRE2's tables are newer.
constexpr const char* kLetterExtra =
    "\\x{1c89}-\\x{1c8a}\\x{a7cb}-\\x{a7cd}\\x{a7da}-\\x{a7dc}\\x{105c0}-\\x{105f3}"
    "\\x{10d4a}-\\x{10d65}\\x{10d6f}-\\x{10d85}\\x{10ec2}-\\x{10ec4}\\x{1123f}-\\x{11240}"
    "\\x{11380}-\\x{11389}\\x{1138b}\\x{1138e}\\x{11390}-\\x{113b5}\\x{113b7}\\x{113d1}"
    "\\x{113d3}\\x{11bc0}-\\x{11be0}\\x{11f02}\\x{11f04}-\\x{11f10}\\x{11f12}-\\x{11f33}"
    "\\x{1342f}\\x{13441}-\\x{13446}\\x{13460}-\\x{143fa}\\x{16100}-\\x{1611d}"
    "\\x{16d40}-\\x{16d6c}\\x{18cff}\\x{1b132}\\x{1b155}\\x{1df25}-\\x{1df2a}"
    "\\x{1e030}-\\x{1e06d}\\x{1e4d0}-\\x{1e4eb}\\x{1e5d0}-\\x{1e5ed}\\x{1e5f0}\\x{2b739}"
    "\\x{2ebf0}-\\x{2ee5d}\\x{31350}-\\x{323af}";
constexpr const char* kNumberExtra =
    "\\x{10d40}-\\x{10d49}\\x{116d0}-\\x{116e3}\\x{11bf0}-\\x{11bf9}\\x{11f50}-\\x{11f59}"
    "\\x{16130}-\\x{16139}\\x{16d70}-\\x{16d79}\\x{1ccf0}-\\x{1ccf9}\\x{1d2c0}-\\x{1d2d3}"
    "\\x{1e4f0}-\\x{1e4f9}\\x{1e5f1}-\\x{1e5fa}";
// Unicode White_Space, what Oniguruma's \s is. PCRE2's \s (with UCP) also takes U+180E, which
// Unicode stopped calling a space in 6.3.
constexpr const char* kSpace = "\\t-\\r \\x{85}\\x{a0}\\x{1680}\\x{2000}-\\x{200a}\\x{2028}\\x{2029}\\x{202f}\\x{205f}\\x{3000}";

// Rewrites \p{L}, \p{N}, \s and \S of a pattern into the explicit classes above, inside and
// outside [...] alike, so PCRE2 classifies characters as HF does.
std::string pin_unicode_classes(const std::string& re) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < re.size(); ++i) {
    const char c = re[i];
    if (c == '\\' && i + 1 < re.size()) {
      const std::string_view rest(re.data() + i, re.size() - i);
      std::string body;
      bool negated = false;
      size_t len = 0;
      if (rest.substr(0, 5) == "\\p{L}") {
        body = std::string("\\p{L}") + kLetterExtra, len = 5;
      } else if (rest.substr(0, 5) == "\\p{N}") {
        body = std::string("\\p{N}") + kNumberExtra, len = 5;
      } else if (rest.substr(0, 2) == "\\s") {
        body = kSpace, len = 2;
      } else if (rest.substr(0, 2) == "\\S" && !in_class) {
        body = kSpace, len = 2, negated = true;
      }
      if (len == 0) {  // any other escape: copy it whole
        out += c;
        out += re[++i];
        continue;
      }
      out += in_class ? body : (negated ? "[^" : "[") + body + "]";
      i += len - 1;
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out += c;
      if (i + 1 < re.size() && re[i + 1] == '^') out += re[++i];
      if (i + 1 < re.size() && re[i + 1] == ']') out += re[++i];  // literal ] first
      continue;
    }
    if (c == ']' && in_class) in_class = false;
    out += c;
  }
  return out;
}

bool has_name(const char* names, const std::string& name) {
  std::string_view all(names);
  while (!all.empty()) {
    const size_t sp = all.find(' ');
    if (all.substr(0, sp) == name) return true;
    if (sp == std::string_view::npos) break;
    all.remove_prefix(sp + 1);
  }
  return false;
}

}  // namespace

Result<PreTokenizerSpec> pre_tokenizer_spec(const std::string& pre) {
  const std::string name = pre.empty() ? "default" : pre;
  std::string known;
  for (const Entry& e : table()) {
    if (has_name(e.names, name)) return e.spec;
    known += known.empty() ? "" : " ";
    known += e.names;
  }
  return Result<PreTokenizerSpec>::error("tokenizer.ggml.pre = \"" + pre +
                                         "\" is not supported (known: " + known + ")");
}

PreTokenizer::~PreTokenizer() {
  for (void* c : codes_) pcre2_code_free(static_cast<pcre2_code*>(c));
}

Result<std::unique_ptr<PreTokenizer>> PreTokenizer::create(const std::vector<std::string>& regexes) {
  std::unique_ptr<PreTokenizer> p(new PreTokenizer());
  for (const std::string& re_in : regexes) {
    const std::string re = pin_unicode_classes(re_in);
    int err = 0;
    PCRE2_SIZE err_off = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(re.data()), re.size(),
                                     PCRE2_UTF | PCRE2_UCP, &err, &err_off, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return Result<std::unique_ptr<PreTokenizer>>::error(
          "pre-tokenizer regex /" + re + "/ does not compile at offset " + std::to_string(err_off) +
          ": " + reinterpret_cast<const char*>(msg));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // best effort: the interpreter is the fallback
    p->codes_.push_back(code);
  }
  return p;
}

void PreTokenizer::split(std::string_view text, std::vector<Span>& out) const {
  std::vector<Span> cur{{0, text.size()}}, next;
  pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
  for (void* c : codes_) {
    const auto* code = static_cast<const pcre2_code*>(c);
    next.clear();
    for (const Span& f : cur) {
      const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data() + f.off);
      size_t last = 0, pos = 0;
      while (pos < f.len) {
        int rc = pcre2_match(code, subject, f.len, pos, PCRE2_NO_UTF_CHECK, md, nullptr);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT) {  // very long runs: retry on the heap-based interpreter
          rc = pcre2_match(code, subject, f.len, pos, PCRE2_NO_UTF_CHECK | PCRE2_NO_JIT, md, nullptr);
        }
        if (rc < 0) break;  // no (further) match; any other error leaves the rest unsplit
        const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
        const size_t s = ov[0], e = ov[1];
        if (e == s) {  // empty match: step over one character
          pos = s + utf8::next(text.substr(f.off, f.len), s).n;
          continue;
        }
        if (s > last) next.push_back({f.off + last, s - last});
        next.push_back({f.off + s, e - s});
        last = pos = e;
      }
      if (last < f.len) next.push_back({f.off + last, f.len - last});
    }
    cur.swap(next);
  }
  pcre2_match_data_free(md);
  out.insert(out.end(), cur.begin(), cur.end());
}

}  // namespace kv
