// Byte-level BPE (tokenizer.ggml.model = "gpt2"): GPT-2's bytes_to_unicode spelling, merges
// applied lowest rank first (leftmost on ties), as HuggingFace tokenizers' BPE model does.
//
// encode: split out special tokens -> pre-tokenize (regexes of tokenizer.ggml.pre) -> BPE on
// each fragment's bytes. Fragments' ids are memoised in a bounded cache guarded by a
// shared_mutex, so concurrent encode() calls are safe.
#pragma once
#include <array>
#include <memory>
#include <shared_mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer/pre_tokenizer.h"
#include "tokenizer/tokenizer.h"

namespace kv {

class BpeTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> create(const GgufFile& f);

  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const override;
  std::string token_bytes(int32_t id, bool special = false) const override;

  size_t n_merges() const { return merges_.size(); }

 private:
  struct Merge {
    int32_t rank;
    int32_t id;  // the merged token
  };
  static uint64_t pair_key(int32_t a, int32_t b) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
  }
  // Appends the ids of a text run without special tokens (any bytes, valid UTF-8 or not).
  void encode_text(std::string_view text, std::vector<int32_t>& out) const;
  // Appends the ids of one pre-token fragment.
  void encode_piece(std::string_view piece, std::vector<int32_t>& out) const;
  void bpe(std::string_view piece, std::vector<int32_t>& out) const;

  std::unique_ptr<PreTokenizer> pre_tok_;
  bool ignore_merges_ = false;
  std::array<int32_t, 256> byte_id_{};          // token of each single byte, -1 if none
  std::array<std::string, 256> byte_spelling_;  // bytes_to_unicode()[b] as UTF-8
  std::unordered_map<uint64_t, Merge> merges_;  // pair_key(left, right) -> merge
  std::vector<std::string> bytes_;              // per token: the bytes it stands for

  static constexpr size_t kCacheMaxPiece = 128;     // longer fragments are not memoised
  static constexpr size_t kCacheMaxEntries = 1 << 16;
  mutable std::shared_mutex cache_mu_;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache_;
};

}  // namespace kv
