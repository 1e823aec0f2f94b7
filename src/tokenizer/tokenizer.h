// Tokenizers driven by GGUF metadata (tokenizer.ggml.*): byte-level BPE ("gpt2" model with a
// pre-tokenizer chosen by tokenizer.ggml.pre) and SentencePiece-style BPE ("llama": Gemma,
// Llama 2 style vocabularies with scores and <0xXX> byte fallback).
// Immutable after construction; safe to use from any thread.
#pragma once
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
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

  // Errors (never crashes) on missing or inconsistent tokenizer.ggml.* metadata: no token list,
  // token_type / scores of the wrong length or type, merges naming unknown tokens, special ids
  // out of range, an unknown tokenizer.ggml.pre. tokenizer.ggml.model "gpt2" (byte-level BPE) and
  // "llama" (SentencePiece-style BPE, see spm_tokenizer.h) are supported.

  // add_special: prepend BOS / append EOS as the metadata says (tokenizer.ggml.add_bos_token…).
  // parse_special: control tokens spelled in the text become their single id (leftmost-longest
  // match, as HuggingFace does for added special tokens); otherwise they are tokenized as plain
  // text. User-defined tokens (type 4) are always matched whole, as in HF and llama.cpp.
  // Text that is not well-formed UTF-8 is accepted: each ill-formed byte becomes a pre-token of
  // its own (encoded as its byte token), valid runs around it are tokenized normally.
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
  const std::vector<int32_t>& eog_ids() const { return eog_ids_; }  // sorted
  const std::string& token_text(int32_t id) const { return tokens_[id]; }
  // The id whose vocab text is exactly `text` (as stored: byte-level spelling for BPE), or -1.
  int32_t find_token(std::string_view text) const;
  TokenType token_type(int32_t id) const { return types_[id]; }
  const std::string& model_kind() const { return kind_; }      // "gpt2", "llama", ...
  const std::string& pre_kind() const { return pre_; }         // "smollm", ...

 protected:
  std::vector<std::string> tokens_;
  std::vector<TokenType> types_;
  std::vector<int32_t> eog_ids_;  // sorted
  std::unordered_map<std::string, int32_t> token_to_id_;  // duplicates: the last id wins (as HF)

  // Reads tokens, token_type, special ids and add_* flags; fills the members above.
  Status load_common(const GgufFile& f);

  // Text split around special tokens: a segment is either plain text [off, off + len) or one
  // special token id.
  struct Segment {
    int32_t id;  // -1 for plain text
    size_t off, len;
  };
  // Builds the matcher over control (type 3) and user-defined (type 4) tokens, leaving out the
  // ids for which skip[id] is true (a subclass that matches them itself).
  void build_special_matcher(const std::vector<bool>* skip = nullptr);
  void split_special(std::string_view text, bool parse_special, std::vector<Segment>& out) const;

  int32_t bos_ = -1, eos_ = -1;
  bool add_bos_ = false, add_eos_ = false;
  std::string kind_, pre_;

 private:
  // Byte trie over the special tokens' texts: node -> (byte -> child); trie_id_[node] ends there.
  std::unordered_map<uint64_t, int32_t> trie_;  // key (node << 8) | byte
  std::vector<int32_t> trie_id_;                 // per node: token id or -1
  std::vector<bool> trie_control_;               // per node: the token there is CONTROL
};

// Turns a stream of token ids into text without ever emitting half a UTF-8 character: bytes
// of an incomplete character wait for the next token; bytes that can never become a valid
// character (stray continuation byte, bad lead byte) are emitted as U+FFFD at once, so the
// stream never stalls. One per sequence; not thread-safe.
class IncrementalDetokenizer {
 public:
  explicit IncrementalDetokenizer(const Tokenizer& tok, bool special = false) : tok_(tok), special_(special) {}
  // Returns the text that became complete with this token (possibly empty).
  std::string push(int32_t id);
  // Whatever is still pending (invalid or truncated UTF-8 is replaced by U+FFFD).
  std::string flush();
  // The end of a generation: the bytes of a character the last tokens left incomplete are
  // dropped, never emitted as U+FFFD (vLLM's incremental detokenizer holds them back for good).
  void finish() { pending_.clear(); }

 private:
  const Tokenizer& tok_;
  bool special_;
  std::string pending_;
};

}  // namespace kv
