#include "tokenizer/bpe_tokenizer.h"

#include <mutex>
#include <algorithm>
#include <functional>

#include "gguf/gguf.h"
#include "tokenizer/utf8.h"

namespace kv {
namespace {

// GPT-2's bytes_to_unicode(): printable Latin-1 bytes stand for themselves, the other 68 bytes
// are shifted to U+0100.. in byte order, so every byte has a visible one-character spelling.
std::array<uint32_t, 256> byte_to_cp() {
  std::array<uint32_t, 256> m{};
  uint32_t extra = 0;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
    m[b] = printable ? b : 256 + extra++;
  }
  return m;
}

// The bytes a byte-level spelling stands for; false if `text` is not such a spelling.
bool unspell(const std::string& text, const std::array<int16_t, 324>& cp_to_byte, std::string& out) {
  out.clear();
  for (size_t i = 0; i < text.size();) {
    const utf8::Step st = utf8::next(text, i);
    if (st.kind != utf8::Kind::kValid || st.cp >= cp_to_byte.size() || cp_to_byte[st.cp] < 0) return false;
    out += static_cast<char>(cp_to_byte[st.cp]);
    i += st.n;
  }
  return true;
}

struct Sym {
  int32_t id;  // -1 once merged into its left neighbour
  int32_t prev, next;
};
struct Cand {
  int32_t rank, left, right, lid, rid, id;
  bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : left > o.left; }
};

}  // namespace

Result<std::unique_ptr<Tokenizer>> BpeTokenizer::create(const GgufFile& f) {
  using R = Result<std::unique_ptr<Tokenizer>>;
  std::unique_ptr<BpeTokenizer> t(new BpeTokenizer());
  t->kind_ = "gpt2";

  Result<std::string> pre = f.get_string("tokenizer.ggml.pre", "");
  if (!pre) return pre.status();
  t->pre_ = *pre;
  Result<PreTokenizerSpec> spec = pre_tokenizer_spec(*pre);
  if (!spec) return spec.status();
  Result<std::unique_ptr<PreTokenizer>> pt = PreTokenizer::create(spec->regexes);
  if (!pt) return pt.status();
  t->pre_tok_ = std::move(*pt);
  t->ignore_merges_ = spec->ignore_merges;
  t->add_bos_ = spec->add_bos;  // the metadata may override it in load_common

  Status st = t->load_common(f);
  if (!st) return st;
  const int32_t n = t->n_vocab();

  // Byte spellings and the byte-level decoding of every token.
  const std::array<uint32_t, 256> b2c = byte_to_cp();
  std::array<int16_t, 324> c2b;
  c2b.fill(-1);
  for (int b = 0; b < 256; ++b) {
    c2b[b2c[b]] = static_cast<int16_t>(b);
    t->byte_spelling_[b].clear();
    utf8::append(t->byte_spelling_[b], b2c[b]);
    t->byte_id_[b] = t->find_token(t->byte_spelling_[b]);
  }
  t->bytes_.resize(n);
  for (int32_t id = 0; id < n; ++id) {
    const TokenType ty = t->types_[id];
    const bool raw = ty == TokenType::kControl || ty == TokenType::kUserDefined;
    // A token that is not a byte-level spelling (mislabelled special) stands for its text.
    if (raw || !unspell(t->tokens_[id], c2b, t->bytes_[id])) t->bytes_[id] = t->tokens_[id];
  }

  const GgufValue* merges = f.find("tokenizer.ggml.merges");
  if (merges == nullptr) return R::error("byte-level BPE GGUF has no tokenizer.ggml.merges");
  if (merges->type != GgufType::ARRAY || merges->arr_type != GgufType::STRING) {
    return R::error("tokenizer.ggml.merges is not an array of strings");
  }
  t->merges_.reserve(merges->arr.size());
  for (size_t r = 0; r < merges->arr.size(); ++r) {
    const std::string& m = merges->arr[r].str;
    const size_t sp = m.find(' ', 1);
    const auto bad = [&](const std::string& why) {
      return R::error("tokenizer.ggml.merges[" + std::to_string(r) + "] = \"" + m + "\": " + why);
    };
    if (sp == std::string::npos || sp + 1 >= m.size()) return bad("not two tokens separated by a space");
    const std::string a = m.substr(0, sp), b = m.substr(sp + 1);
    const int32_t ia = t->find_token(a), ib = t->find_token(b), iab = t->find_token(a + b);
    if (ia < 0) return bad("left token \"" + a + "\" is not in the vocabulary");
    if (ib < 0) return bad("right token \"" + b + "\" is not in the vocabulary");
    if (iab < 0) return bad("merged token \"" + a + b + "\" is not in the vocabulary");
    // A repeated pair keeps its last rank, as HF's merge map does.
    t->merges_[pair_key(ia, ib)] = Merge{static_cast<int32_t>(r), iab};
  }

  t->build_special_matcher();
  return std::unique_ptr<Tokenizer>(std::move(t));
}

std::string BpeTokenizer::token_bytes(int32_t id, bool special) const {
  if (id < 0 || id >= n_vocab()) return {};
  const TokenType ty = types_[id];
  if (ty == TokenType::kControl || ty == TokenType::kUnknown || ty == TokenType::kUnused) {
    return special ? tokens_[id] : std::string();
  }
  return bytes_[id];
}

std::vector<int32_t> BpeTokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && add_bos_) out.push_back(bos_);
  std::vector<Segment> segs;
  split_special(text, parse_special, segs);
  for (const Segment& s : segs) {
    if (s.id >= 0) {
      out.push_back(s.id);
    } else {
      encode_text(text.substr(s.off, s.len), out);
    }
  }
  if (add_special && add_eos_) out.push_back(eos_);
  return out;
}

void BpeTokenizer::encode_text(std::string_view text, std::vector<int32_t>& out) const {
  std::vector<PreTokenizer::Span> spans;
  const auto run = [&](std::string_view valid) {
    spans.clear();
    pre_tok_->split(valid, spans);
    for (const PreTokenizer::Span& sp : spans) encode_piece(valid.substr(sp.off, sp.len), out);
  };
  if (utf8::is_valid(text)) return run(text);
  // Ill-formed UTF-8 cannot go through the UTF regexes: valid runs are tokenized as usual and
  // each ill-formed byte stands alone as its byte token.
  size_t start = 0, i = 0;
  while (i < text.size()) {
    const utf8::Step st = utf8::next(text, i);
    if (st.kind == utf8::Kind::kValid) {
      i += st.n;
      continue;
    }
    if (i > start) run(text.substr(start, i - start));
    for (size_t k = 0; k < st.n; ++k) {
      const int32_t id = byte_id_[static_cast<unsigned char>(text[i + k])];
      if (id >= 0) out.push_back(id);
    }
    i += st.n;
    start = i;
  }
  if (i > start) run(text.substr(start, i - start));
}

void BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t>& out) const {
  const bool cacheable = piece.size() <= kCacheMaxPiece;
  if (cacheable) {
    std::shared_lock lock(cache_mu_);
    auto it = cache_.find(std::string(piece));
    if (it != cache_.end()) {
      out.insert(out.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  const size_t first = out.size();
  bpe(piece, out);
  if (cacheable) {
    std::vector<int32_t> ids(out.begin() + static_cast<std::ptrdiff_t>(first), out.end());
    std::unique_lock lock(cache_mu_);
    if (cache_.size() >= kCacheMaxEntries) cache_.clear();  // crude bound; hits are what matter
    cache_.emplace(std::string(piece), std::move(ids));
  }
}

void BpeTokenizer::bpe(std::string_view piece, std::vector<int32_t>& out) const {
  if (ignore_merges_) {
    std::string spelled;
    for (unsigned char c : piece) spelled += byte_spelling_[c];
    const int32_t id = find_token(spelled);
    if (id >= 0) {
      out.push_back(id);
      return;
    }
  }
  thread_local std::vector<Sym> syms;
  thread_local std::vector<Cand> heap;  // min-heap on (rank, left) via std::greater
  syms.clear();
  for (unsigned char c : piece) {
    const int32_t id = byte_id_[c];
    if (id < 0) continue;  // a byte the vocabulary lacks is dropped, as HF does without unk
    const int32_t i = static_cast<int32_t>(syms.size());
    syms.push_back({id, i - 1, i + 1});
  }
  if (syms.empty()) return;
  syms.back().next = -1;
  if (syms.size() == 1) {
    out.push_back(syms[0].id);
    return;
  }
  heap.clear();
  const std::greater<Cand> later;
  const auto consider = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0) return;
    auto it = merges_.find(pair_key(syms[l].id, syms[r].id));
    if (it == merges_.end()) return;
    heap.push_back({it->second.rank, l, r, syms[l].id, syms[r].id, it->second.id});
    std::push_heap(heap.begin(), heap.end(), later);
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) consider(i, i + 1);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), later);
    const Cand c = heap.back();
    heap.pop_back();
    Sym& l = syms[c.left];
    if (l.id != c.lid || l.next != c.right || syms[c.right].id != c.rid) continue;  // stale
    l.id = c.id;
    syms[c.right].id = -1;
    l.next = syms[c.right].next;
    if (l.next >= 0) syms[l.next].prev = c.left;
    consider(l.prev, c.left);
    consider(c.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
}

}  // namespace kv
