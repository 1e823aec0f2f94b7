#include "tokenizer/tokenizer.h"

#include <algorithm>

#include "gguf/gguf.h"
#include "tokenizer/bpe_tokenizer.h"
#include "tokenizer/spm_tokenizer.h"
#include "tokenizer/utf8.h"

namespace kv {
namespace {

// Token texts that end generation whatever their id (llama.cpp's heuristic list, trimmed to
// the texts of families we may serve).
constexpr const char* kEogTexts[] = {
    "<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
    "<EOT>", "_<EOT>", "<|end_of_text|>", "<end_of_utterance>", "<eos>", "[EOS]", "[EOT]",
};

Result<int32_t> read_id(const GgufFile& f, const std::string& key, int32_t n_vocab) {
  const GgufValue* v = f.find(key);
  if (v == nullptr) return int32_t{-1};
  if (!v->is_int()) {
    return Result<int32_t>::error(key + " has type " + gguf_type_name(v->type) + ", expected an integer");
  }
  if (v->i < 0 || v->i >= n_vocab) {
    return Result<int32_t>::error(key + " = " + std::to_string(v->i) + " is outside the vocabulary [0, " +
                                  std::to_string(n_vocab) + ")");
  }
  return static_cast<int32_t>(v->i);
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> Tokenizer::from_gguf(const GgufFile& f) {
  using R = Result<std::unique_ptr<Tokenizer>>;
  const GgufValue* model = f.find("tokenizer.ggml.model");
  if (model == nullptr) return R::error("GGUF has no tokenizer.ggml.model: no tokenizer in this file");
  if (model->type != GgufType::STRING) return R::error("tokenizer.ggml.model is not a string");
  if (model->str == "gpt2") return BpeTokenizer::create(f);
  if (model->str == "llama") return SpmTokenizer::create(f);
  return R::error("tokenizer.ggml.model = \"" + model->str + "\" is not supported (supported: gpt2, llama)");
}

Status Tokenizer::load_common(const GgufFile& f) {
  const GgufValue* toks = f.find("tokenizer.ggml.tokens");
  if (toks == nullptr) return Status::error("GGUF has no tokenizer.ggml.tokens");
  if (toks->type != GgufType::ARRAY || toks->arr_type != GgufType::STRING) {
    return Status::error("tokenizer.ggml.tokens is not an array of strings");
  }
  if (toks->arr.empty()) return Status::error("tokenizer.ggml.tokens is empty");
  if (toks->arr.size() > static_cast<size_t>(INT32_MAX)) return Status::error("tokenizer.ggml.tokens is too long");
  const size_t n = toks->arr.size();
  tokens_.reserve(n);
  token_to_id_.reserve(n);
  for (size_t i = 0; i < n; ++i) {
    tokens_.push_back(toks->arr[i].str);
    token_to_id_[toks->arr[i].str] = static_cast<int32_t>(i);
  }

  types_.assign(n, TokenType::kNormal);
  if (const GgufValue* tt = f.find("tokenizer.ggml.token_type")) {
    if (tt->type != GgufType::ARRAY || tt->arr.size() != n) {
      return Status::error("tokenizer.ggml.token_type has " + std::to_string(tt->arr.size()) +
                           " entries, tokenizer.ggml.tokens has " + std::to_string(n));
    }
    for (size_t i = 0; i < n; ++i) {
      const GgufValue& v = tt->arr[i];
      if (!v.is_int() || v.i < 0 || v.i > 6) {
        return Status::error("tokenizer.ggml.token_type[" + std::to_string(i) + "] is not a type in 0..6");
      }
      types_[i] = static_cast<TokenType>(v.i);
    }
  }

  const int32_t nv = n_vocab();
  Result<int32_t> bos = read_id(f, "tokenizer.ggml.bos_token_id", nv);
  if (!bos) return bos.status();
  Result<int32_t> eos = read_id(f, "tokenizer.ggml.eos_token_id", nv);
  if (!eos) return eos.status();
  bos_ = *bos, eos_ = *eos;

  Result<bool> add_bos = f.get_bool("tokenizer.ggml.add_bos_token", add_bos_);
  if (!add_bos) return add_bos.status();
  Result<bool> add_eos = f.get_bool("tokenizer.ggml.add_eos_token", add_eos_);
  if (!add_eos) return add_eos.status();
  add_bos_ = *add_bos, add_eos_ = *add_eos;
  if (add_bos_ && bos_ < 0) return Status::error("tokenizer.ggml.add_bos_token is true but there is no bos_token_id");
  if (add_eos_ && eos_ < 0) return Status::error("tokenizer.ggml.add_eos_token is true but there is no eos_token_id");

  // End of generation: EOS, the explicit EOT / EOM / FIM ids, and tokens whose text says so.
  std::vector<int32_t> eog;
  if (eos_ >= 0) eog.push_back(eos_);
  for (const char* key : {"tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id",
                          "tokenizer.ggml.fim_pad_token_id", "tokenizer.ggml.fim_rep_token_id",
                          "tokenizer.ggml.fim_sep_token_id"}) {
    Result<int32_t> id = read_id(f, key, nv);
    if (!id) return id.status();
    if (*id >= 0) eog.push_back(*id);
  }
  for (const char* text : kEogTexts) {
    auto it = token_to_id_.find(text);
    if (it != token_to_id_.end()) eog.push_back(it->second);
  }
  std::sort(eog.begin(), eog.end());
  eog.erase(std::unique(eog.begin(), eog.end()), eog.end());
  eog_ids_ = std::move(eog);
  return Status::ok();
}

int32_t Tokenizer::find_token(std::string_view text) const {
  auto it = token_to_id_.find(std::string(text));
  return it == token_to_id_.end() ? -1 : it->second;
}

bool Tokenizer::is_eog(int32_t id) const {
  return std::binary_search(eog_ids_.begin(), eog_ids_.end(), id);
}

std::string Tokenizer::decode(const std::vector<int32_t>& ids, bool special) const {
  std::string out;
  for (int32_t id : ids) out += token_bytes(id, special);
  return out;
}

void Tokenizer::build_special_matcher(const std::vector<bool>* skip) {
  trie_.clear();
  trie_id_.assign(1, -1);
  trie_control_.assign(1, false);
  for (int32_t id = 0; id < n_vocab(); ++id) {
    const TokenType t = types_[id];
    if ((t != TokenType::kControl && t != TokenType::kUserDefined) || tokens_[id].empty()) continue;
    if (skip != nullptr && (*skip)[id]) continue;
    uint64_t node = 0;
    for (unsigned char c : tokens_[id]) {
      auto [it, added] = trie_.try_emplace((node << 8) | c, static_cast<int32_t>(trie_id_.size()));
      if (added) {
        trie_id_.push_back(-1);
        trie_control_.push_back(false);
      }
      node = static_cast<uint64_t>(it->second);
    }
    trie_id_[node] = id;  // duplicates: the last id wins, as in token_to_id_
    trie_control_[node] = t == TokenType::kControl;
  }
}

void Tokenizer::split_special(std::string_view text, bool parse_special, std::vector<Segment>& out) const {
  size_t plain = 0;  // start of the pending plain-text run
  for (size_t i = 0; i < text.size();) {
    // Longest special token starting at i.
    uint64_t node = 0;
    int32_t best = -1;
    size_t best_len = 0;
    for (size_t k = i; k < text.size(); ++k) {
      auto it = trie_.find((node << 8) | static_cast<unsigned char>(text[k]));
      if (it == trie_.end()) break;
      node = static_cast<uint64_t>(it->second);
      if (trie_id_[node] >= 0 && (parse_special || !trie_control_[node])) {
        best = trie_id_[node];
        best_len = k + 1 - i;
      }
    }
    if (best < 0) {
      ++i;
      continue;
    }
    if (i > plain) out.push_back({-1, plain, i - plain});
    out.push_back({best, i, best_len});
    i += best_len;
    plain = i;
  }
  if (plain < text.size()) out.push_back({-1, plain, text.size() - plain});
}

std::string IncrementalDetokenizer::push(int32_t id) {
  pending_ += tok_.token_bytes(id, special_);
  std::string out;
  size_t i = 0;
  while (i < pending_.size()) {
    const utf8::Step st = utf8::next(pending_, i);
    if (st.kind == utf8::Kind::kIncomplete) break;  // wait for the next token's bytes
    if (st.kind == utf8::Kind::kValid) {
      out.append(pending_, i, st.n);
    } else {
      out += "\xEF\xBF\xBD";  // can never become valid: replace now rather than stall
    }
    i += st.n;
  }
  pending_.erase(0, i);
  return out;
}

std::string IncrementalDetokenizer::flush() {
  std::string out = utf8::sanitize(pending_);
  pending_.clear();
  return out;
}

}  // namespace kv
