// SentencePiece-style BPE (tokenizer.ggml.model = "llama"): Gemma and Llama 2 style vocabularies
// with a score per piece and <0xXX> byte tokens. Conforms to HuggingFace `tokenizers` as
// transformers builds it from such a GGUF (GemmaTokenizer / LlamaTokenizer):
//
//   1. Control tokens (with parse_special) and user-defined tokens are matched whole in the raw
//      text, leftmost-longest (the base class's matcher), except user-defined tokens made only of
//      spaces: Gemma's indentation runs, stored by llama.cpp's converter as "  ".. (31 spaces).
//   2. Each remaining text fragment is normalized: ' ' -> U+2581 "▁" (and, with
//      tokenizer.ggml.add_space_prefix, a "▁" in front of a fragment that starts the text and
//      does not already start with one, as HF's Metaspace prepend_scheme="first").
//   3. The space-run pieces, spelled "▁▁".., are matched longest-first in the normalized text and
//      never merge with a neighbour (SentencePiece's user-defined symbols). A literal "▁" in the
//      input is a space like any other, as in SentencePiece and HF.
//   4. Between them, BPE over characters: the adjacent pair whose concatenation is a NORMAL piece
//      with the highest score merges first; equal scores: the longer left part, then the longer
//      right part, then the lower id (HF's merge order, transformers' generate_merges), then the
//      leftmost pair. A character the vocabulary lacks becomes its UTF-8 bytes as <0xXX> tokens
//      (<unk> if a byte token is missing); bytes that are not well-formed UTF-8 become byte tokens.
//
// Where this deliberately differs from the transformers GGUF converter: a run of 32 or more
// spaces. The converter orders Gemma's merges by token position, so "▁ ▁" outranks every longer
// run and 32 spaces become 16 + 16; the sentencepiece library, HF's GemmaConverter fed a
// tokenizer.model (user-defined pieces at score 0, as Gemma's has them) and llama.cpp all cut the
// run longest-first: 31 + 1, and so does kvserve (tests/tokenizer/oracle_gemma.py re-checks the
// case). llama.cpp in turn differs from HF and sentencepiece on a literal "▁" next to spaces and
// on "</s>" (it retypes it as control); kvserve follows HF there.
//
// BOS is added by default when the vocabulary has one (tokenizer.ggml.add_bos_token overrides).
// Checked against an oracle on Gemma 3 only: add_space_prefix = true (Llama 2 style) follows HF's
// Metaspace code but has no model here to confirm it, and decode() does not strip the prefix.
//
// decode: "▁" -> ' ', <0xXX> -> the byte, control tokens only when asked. Immutable after
// construction; encode() keeps its scratch space in thread_local buffers, so concurrent calls
// are safe.
#pragma once
#include <array>
#include <memory>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "tokenizer/tokenizer.h"

namespace kv {

class SpmTokenizer final : public Tokenizer {
 public:
  static Result<std::unique_ptr<Tokenizer>> create(const GgufFile& f);

  std::vector<int32_t> encode(std::string_view text, bool add_special, bool parse_special) const override;
  std::string token_bytes(int32_t id, bool special = false) const override;

  bool add_space_prefix() const { return add_space_prefix_; }
  float score(int32_t id) const { return scores_[id]; }

 private:
  // Appends the ids of one plain-text fragment (raw bytes, before normalization).
  void encode_fragment(std::string_view raw, bool starts_text, std::vector<int32_t>& out) const;
  // Appends the ids of a normalized run that holds no frozen piece.
  void bpe(std::string_view run, std::vector<int32_t>& out) const;

  std::vector<float> scores_;
  std::vector<std::string> bytes_;  // per token: the bytes it decodes to ("▁" -> ' ', <0xXX> -> byte)
  // Pieces as the model spells them ("▁▁" for a run of two spaces) -> id: every token for the
  // first lookup of a character, NORMAL ones only as merge results. Views into spelled_.
  std::vector<std::string> spelled_;
  std::unordered_map<std::string_view, int32_t> piece_id_;
  std::unordered_map<std::string_view, int32_t> merge_id_;
  size_t max_merge_len_ = 0;  // longest NORMAL piece, in bytes: longer pairs never merge
  // Frozen pieces: user-defined tokens made only of spaces / "▁", i.e. "▁" x k once spelled.
  std::vector<int32_t> frozen_by_run_;  // [k] = id of the frozen piece "▁" x k, or -1
  std::array<int32_t, 256> byte_id_{};  // <0xXX> token per byte, -1 if the vocabulary lacks it
  int32_t unk_ = -1;
  bool add_space_prefix_ = true;
};

}  // namespace kv
