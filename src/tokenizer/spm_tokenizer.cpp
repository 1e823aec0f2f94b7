#include "tokenizer/spm_tokenizer.h"

#include <algorithm>
#include <cmath>

#include "gguf/gguf.h"
#include "tokenizer/utf8.h"

namespace kv {
namespace {

constexpr std::string_view kSpace = "\xE2\x96\x81";  // U+2581, SentencePiece's visible space
constexpr size_t kKeepScratch = 1 << 16;  // thread_local scratch elements kept between calls

// "<0xXX>" -> XX (either hex case, as HF's ByteFallback decoder accepts), or -1.
int parse_byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  int v = 0;
  for (size_t k = 3; k < 5; ++k) {
    const char c = t[k];
    const int d = c >= '0' && c <= '9'   ? c - '0'
                  : c >= 'A' && c <= 'F' ? c - 'A' + 10
                  : c >= 'a' && c <= 'f' ? c - 'a' + 10
                                         : -1;
    if (d < 0) return -1;
    v = v * 16 + d;
  }
  return v;
}

// Number of "▁" if t is made only of spaces and "▁" (a whitespace-run piece), else 0.
size_t space_run_length(std::string_view t) {
  size_t n = 0;
  for (size_t i = 0; i < t.size();) {
    if (t[i] == ' ') {
      ++i;
    } else if (t.substr(i, kSpace.size()) == kSpace) {
      i += kSpace.size();
    } else {
      return 0;
    }
    ++n;
  }
  return n;
}

std::string spaces_to_text(std::string_view t) {  // "▁" -> ' '
  std::string out;
  out.reserve(t.size());
  for (size_t i = 0; i < t.size();) {
    if (t.substr(i, kSpace.size()) == kSpace) {
      out += ' ';
      i += kSpace.size();
    } else {
      out += t[i++];
    }
  }
  return out;
}

struct Sym {
  int32_t id;
  uint32_t off, len;  // bytes of the run this symbol covers
  uint32_t n_chars;   // characters, for HF's tie-break on part lengths
  int32_t prev, next;
  bool frozen;  // a byte-fallback or unknown symbol: never merges
};

// A possible merge of syms[left] and syms[right] into `id`. Better first: higher score, longer
// left part, longer right part, lower id (the order of transformers' generate_merges), leftmost.
struct Cand {
  float score;
  uint32_t n_left, n_right;
  int32_t id, left, right, lid, rid;
};
bool worse(const Cand& a, const Cand& b) {
  if (a.score != b.score) return a.score < b.score;
  if (a.n_left != b.n_left) return a.n_left < b.n_left;
  if (a.n_right != b.n_right) return a.n_right < b.n_right;
  if (a.id != b.id) return a.id > b.id;
  return a.left > b.left;
}

Result<int32_t> read_optional_id(const GgufFile& f, const std::string& key, int32_t n_vocab) {
  const GgufValue* v = f.find(key);
  if (v == nullptr) return int32_t{-1};
  if (!v->is_int() || v->i < 0 || v->i >= n_vocab) {
    return Result<int32_t>::error(key + " is not a token id in [0, " + std::to_string(n_vocab) + ")");
  }
  return static_cast<int32_t>(v->i);
}

}  // namespace

Result<std::unique_ptr<Tokenizer>> SpmTokenizer::create(const GgufFile& f) {
  using R = Result<std::unique_ptr<Tokenizer>>;
  std::unique_ptr<SpmTokenizer> t(new SpmTokenizer());
  t->kind_ = "llama";
  Result<std::string> pre = f.get_string("tokenizer.ggml.pre", "");
  if (!pre) return pre.status();
  t->pre_ = *pre;  // informational: SentencePiece has no pre-tokenizer regexes
  // A SentencePiece vocabulary that does not say otherwise gets BOS, if it has one (transformers
  // drops add_bos_token when there is no bos_token).
  t->add_bos_ = f.has("tokenizer.ggml.bos_token_id");
  Status st = t->load_common(f);
  if (!st) return st;
  Result<bool> prefix = f.get_bool("tokenizer.ggml.add_space_prefix", true);
  if (!prefix) return prefix.status();
  t->add_space_prefix_ = *prefix;
  const int32_t n = t->n_vocab();
  Result<int32_t> unk = read_optional_id(f, "tokenizer.ggml.unknown_token_id", n);
  if (!unk) return unk.status();
  t->unk_ = *unk;

  const GgufValue* scores = f.find("tokenizer.ggml.scores");
  if (scores == nullptr) return R::error("SentencePiece GGUF has no tokenizer.ggml.scores");
  if (scores->type != GgufType::ARRAY || (scores->arr_type != GgufType::F32 && scores->arr_type != GgufType::F64)) {
    return R::error("tokenizer.ggml.scores is not an array of floats");
  }
  if (scores->arr.size() != static_cast<size_t>(n)) {
    return R::error("tokenizer.ggml.scores has " + std::to_string(scores->arr.size()) +
                    " entries, tokenizer.ggml.tokens has " + std::to_string(n));
  }
  t->scores_.resize(n);
  for (int32_t id = 0; id < n; ++id) {
    const double s = scores->arr[id].f;
    if (!std::isfinite(s)) return R::error("tokenizer.ggml.scores[" + std::to_string(id) + "] is not a finite number");
    t->scores_[id] = static_cast<float>(s);
  }

  // Spelling, decoding and the lookup tables.
  t->spelled_.resize(n);
  t->bytes_.resize(n);
  std::vector<bool> frozen(n, false);
  for (int32_t id = 0; id < n; ++id) {
    const std::string& text = t->tokens_[id];
    const TokenType ty = t->types_[id];
    const size_t run = ty == TokenType::kUserDefined ? space_run_length(text) : 0;
    if (run > 0) {
      // llama.cpp's converter stores these as real spaces; the model's piece is "▁" x run.
      frozen[id] = true;
      t->spelled_[id].reserve(run * kSpace.size());
      for (size_t k = 0; k < run; ++k) t->spelled_[id] += kSpace;
      if (t->frozen_by_run_.size() <= run) t->frozen_by_run_.resize(run + 1, -1);
      t->frozen_by_run_[run] = id;  // duplicates: the last id wins, as everywhere else
    } else {
      t->spelled_[id] = text;
    }
    const int byte = parse_byte_token(text);
    if (ty == TokenType::kByte && byte < 0) {
      return R::error("tokenizer.ggml.tokens[" + std::to_string(id) + "] = \"" + text +
                      "\" has type BYTE but is not spelled <0xXX>");
    }
    t->bytes_[id] = byte >= 0 ? std::string(1, static_cast<char>(byte)) : spaces_to_text(text);
  }
  t->piece_id_.reserve(n);
  for (int32_t id = 0; id < n; ++id) {
    const std::string_view sp = t->spelled_[id];
    t->piece_id_[sp] = id;
    if (t->types_[id] == TokenType::kNormal && !sp.empty()) {
      t->merge_id_[sp] = id;
      t->max_merge_len_ = std::max(t->max_merge_len_, sp.size());
    }
  }
  for (int b = 0; b < 256; ++b) {
    static const char* kHex = "0123456789ABCDEF";
    const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
    auto it = t->piece_id_.find(name);
    t->byte_id_[b] = it == t->piece_id_.end() ? -1 : it->second;
  }

  t->build_special_matcher(&frozen);
  return std::unique_ptr<Tokenizer>(std::move(t));
}

std::string SpmTokenizer::token_bytes(int32_t id, bool special) const {
  if (id < 0 || id >= n_vocab()) return {};
  const TokenType ty = types_[id];
  if (ty == TokenType::kControl || ty == TokenType::kUnknown || ty == TokenType::kUnused) {
    return special ? tokens_[id] : std::string();
  }
  return bytes_[id];
}

std::vector<int32_t> SpmTokenizer::encode(std::string_view text, bool add_special, bool parse_special) const {
  std::vector<int32_t> out;
  out.reserve(text.size() / 3 + 2);
  if (add_special && add_bos_) out.push_back(bos_);
  thread_local std::vector<Segment> segs;
  segs.clear();
  split_special(text, parse_special, segs);
  for (const Segment& s : segs) {
    if (s.id >= 0) {
      out.push_back(s.id);
    } else {
      encode_fragment(text.substr(s.off, s.len), s.off == 0, out);
    }
  }
  if (add_special && add_eos_) out.push_back(eos_);
  return out;
}

void SpmTokenizer::encode_fragment(std::string_view raw, bool starts_text, std::vector<int32_t>& out) const {
  thread_local std::string norm;
  norm.clear();
  norm.reserve(raw.size() + raw.size() / 2 + kSpace.size());
  if (add_space_prefix_ && starts_text && !raw.empty() && raw[0] != ' ' && raw.substr(0, kSpace.size()) != kSpace) {
    norm += kSpace;
  }
  for (char c : raw) {
    if (c == ' ') {
      norm += kSpace;
    } else {
      norm += c;
    }
  }
  // Cut out the frozen space-run pieces, longest first from the start of each run of "▁". A byte
  // scan is safe: 0xE2 is a lead byte, so E2 96 81 is always a whole "▁".
  const std::string_view s = norm;
  const size_t max_run = frozen_by_run_.empty() ? 0 : frozen_by_run_.size() - 1;
  size_t pending = 0, i = 0;
  while (i < s.size()) {
    if (max_run == 0 || s.compare(i, kSpace.size(), kSpace) != 0) {
      ++i;
      continue;
    }
    size_t n_run = 0;
    while (s.compare(i + n_run * kSpace.size(), kSpace.size(), kSpace) == 0) ++n_run;
    while (n_run > 0) {
      size_t k = std::min(n_run, max_run);
      while (k > 0 && frozen_by_run_[k] < 0) --k;
      if (k == 0) break;  // shorter than every frozen piece: stays in the BPE run
      if (i > pending) bpe(s.substr(pending, i - pending), out);
      out.push_back(frozen_by_run_[k]);
      i += k * kSpace.size();
      n_run -= k;
      pending = i;
    }
    i += n_run * kSpace.size();
  }
  if (pending < s.size()) bpe(s.substr(pending), out);
  if (norm.capacity() > kKeepScratch) std::string().swap(norm);
}

void SpmTokenizer::bpe(std::string_view run, std::vector<int32_t>& out) const {
  thread_local std::vector<Sym> syms;
  thread_local std::vector<Cand> heap;
  syms.clear();
  const auto push = [&](int32_t id, size_t off, size_t len, bool frz) {
    const int32_t i = static_cast<int32_t>(syms.size());
    syms.push_back({id, static_cast<uint32_t>(off), static_cast<uint32_t>(len), 1, i - 1, i + 1, frz});
  };
  const auto push_bytes = [&](size_t off, size_t len) {
    bool all = true;
    for (size_t k = 0; k < len; ++k) all = all && byte_id_[static_cast<unsigned char>(run[off + k])] >= 0;
    if (all) {
      for (size_t k = 0; k < len; ++k) push(byte_id_[static_cast<unsigned char>(run[off + k])], off + k, 1, true);
    } else if (unk_ >= 0 && !(syms.size() > 0 && syms.back().frozen && syms.back().id == unk_)) {
      push(unk_, off, len, true);  // consecutive unknowns fuse into one, as HF's fuse_unk
    }
  };
  for (size_t i = 0; i < run.size();) {
    const utf8::Step st = utf8::next(run, i);
    if (st.kind == utf8::Kind::kValid) {
      auto it = piece_id_.find(run.substr(i, st.n));
      if (it != piece_id_.end()) {
        push(it->second, i, st.n, false);
      } else {
        push_bytes(i, st.n);
      }
    } else {
      for (size_t k = 0; k < st.n; ++k) push_bytes(i + k, 1);  // ill-formed: each byte alone
    }
    i += st.n;
  }
  if (syms.empty()) return;
  syms.back().next = -1;

  heap.clear();
  const auto consider = [&](int32_t l, int32_t r) {
    if (l < 0 || r < 0 || syms[l].frozen || syms[r].frozen) return;
    const size_t len = static_cast<size_t>(syms[l].len) + syms[r].len;
    if (len > max_merge_len_) return;
    auto it = merge_id_.find(run.substr(syms[l].off, len));
    if (it == merge_id_.end()) return;
    heap.push_back({scores_[it->second], syms[l].n_chars, syms[r].n_chars, it->second, l, r, syms[l].id, syms[r].id});
    std::push_heap(heap.begin(), heap.end(), worse);
  };
  for (int32_t i = 0; i + 1 < static_cast<int32_t>(syms.size()); ++i) consider(i, i + 1);
  while (!heap.empty()) {
    std::pop_heap(heap.begin(), heap.end(), worse);
    const Cand c = heap.back();
    heap.pop_back();
    Sym& l = syms[c.left];
    if (l.id != c.lid || l.next != c.right || syms[c.right].id != c.rid) continue;  // stale
    Sym& r = syms[c.right];
    l.id = c.id;
    l.len += r.len;
    l.n_chars += r.n_chars;
    r.id = -1;
    l.next = r.next;
    if (l.next >= 0) syms[l.next].prev = c.left;
    consider(l.prev, c.left);
    consider(c.left, l.next);
  }
  for (int32_t i = 0; i >= 0; i = syms[i].next) out.push_back(syms[i].id);
  // One huge prompt must not pin megabytes of scratch in every thread that ever saw it.
  if (syms.capacity() > kKeepScratch) std::vector<Sym>().swap(syms);
  if (heap.capacity() > kKeepScratch) std::vector<Cand>().swap(heap);
}

}  // namespace kv
