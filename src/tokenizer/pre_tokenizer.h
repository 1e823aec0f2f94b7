// Pre-tokenizers for byte-level BPE: the regex list each tokenizer.ggml.pre value stands for
// (the same lists llama.cpp's llama-vocab.cpp uses, and the same splits the models' own
// HuggingFace tokenizer.json pipelines make), run with PCRE2 (UTF + UCP, JIT when available).
//
// Each regex of the list splits every fragment the previous ones produced; matches and the
// text between them both become fragments ("isolated" splitting). Immutable after creation;
// split() is safe from any thread.
#pragma once
#include <cstddef>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kv {

struct PreTokenizerSpec {
  std::vector<std::string> regexes;
  bool ignore_merges = false;  // a fragment that is a whole vocab token is taken as is (llama3)
  bool add_bos = false;        // default when tokenizer.ggml.add_bos_token is absent
};

// The spec for a tokenizer.ggml.pre value ("" means absent: llama.cpp's "default"), or an
// error naming the supported values.
Result<PreTokenizerSpec> pre_tokenizer_spec(const std::string& pre);

class PreTokenizer {
 public:
  struct Span {
    size_t off, len;  // [off, off + len) of the text given to split()
  };
  static Result<std::unique_ptr<PreTokenizer>> create(const std::vector<std::string>& regexes);
  ~PreTokenizer();
  PreTokenizer(const PreTokenizer&) = delete;
  PreTokenizer& operator=(const PreTokenizer&) = delete;

  // text must be well-formed UTF-8 (see utf8::is_valid). Appends the fragments, in order, to
  // out; they tile the text exactly.
  void split(std::string_view text, std::vector<Span>& out) const;

 private:
  PreTokenizer() = default;
  std::vector<void*> codes_;  // pcre2_code_8*, one per regex
};

}  // namespace kv
