// Tokenizers driven by GGUF metadata (tokenizer.ggml.*): byte-level BPE ("gpt2" model with a
// pre-tokenizer chosen by tokenizer.ggml.pre) and, later, SentencePiece-style ("llama").
// Immutable after construction; safe to use from any thread.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "common/status.h"

namespace kv {

class GgufFile;

enum class TokenType : int32_t {  // as in tokenizer.ggml.token_type
  kUndefined = 0, kNormal = 1, kUnknown = 2, kControl = 3, kUserDefined = 4, kUnused = 5, kByte = 6,
};

class Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> from_gguf(const GgufFile& f);
  virtual ~Tokenizer() = default;

  // add_special: prepend BOS / append EOS as the metadata says (tokenizer.ggml.add_bos_token…).
  // parse_special: control / user-defined tokens spelled in the text become their single id
  // (as HuggingFace does for added tokens); otherwise they are tokenized as plain text.
  virtual std::vector<int32_t> encode(std::string_view text, bool add_special,
                                      bool parse_special) const = 0;
  // The bytes a token stands for (may be part of a UTF-8 character). Control tokens give
  // their text only when `special` is true.
  virtual std::string token_bytes(int32_t id, bool special = false) const = 0;
  std::string decode(const std::vector<int32_t>& ids, bool special = false) const;

  int32_t n_vocab() const { return static_cast<int32_t>(tokens_.size()); }
  int32_t bos_id() const { return bos_; }
  int32_t eos_id() const { return eos_; }
  bool add_bos() const { return add_bos_; }
  // End of generation: EOS, EOT and similar ids from the metadata.
  bool is_eog(int32_t id) const;
  const std::string& token_text(int32_t id) const { return tokens_[id]; }
  TokenType token_type(int32_t id) const { return types_[id]; }
  const std::string& model_kind() const { return kind_; }      // "gpt2", "llama", ...
  const std::string& pre_kind() const { return pre_; }         // "smollm", ...

 protected:
  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  std::vector<int32_t> eog_ids_;
  int32_t bos_ = -1, eos_ = -1;
  bool add_bos_ = false, add_eos_ = false;
  std::string kind_, pre_;
};

// Turns a stream of token ids into text without ever emitting half a UTF-8 character: bytes
// of an incomplete character wait for the next token. One per sequence; not thread-safe.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tok, bool special = false) : tok_(tok), special_(special) {}
  // Returns the text that became complete with this token (possibly empty).
  std::string push(int32_t id);
  // Whatever is still pending (invalid or truncated UTF-8 is replaced by U+FFFD).
  std::string flush();

 private:
  const Tokenizer& tok_;
  bool special_;
  std::string pending_;
};

}  // namespace kv
