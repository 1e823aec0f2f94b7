#include "kv/kv_size.h"

#include "common/units.h"

#include <algorithm>
#include <cctype>
#include <cstdio>
#include <map>
#include <tuple>

#include "gguf/gguf.h"
#include "kv/kv_layout.h"

namespace kv {

namespace {

// Generous bounds on any one shape number, so that products below stay far from overflow
// before the checked multiplications even start.
constexpr int64_t kMaxDim = int64_t(1) << 24;
constexpr int64_t kMaxLayers = int64_t(1) << 16;

bool mul_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_mul_overflow(a, b, out); }
bool add_ok(int64_t a, int64_t b, int64_t* out) { return !__builtin_add_overflow(a, b, out); }

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

std::string lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// dtypes

const std::vector<KvSizeDtype>& kv_size_dtypes() {
  static const std::vector<KvSizeDtype> d = {
      {"f32", 32, false},     {"f16", 16, false},     {"bf16", 16, false}, {"fp8_e4m3", 8, true},
      {"fp8_e5m2", 8, true},  {"int8", 8, true},      {"int4", 4, true},
  };
  return d;
}

// The engine's names (parse_kv_dtype), so that kv-size takes exactly what serve and generate take.
Result<KvSizeDtype> kv_size_dtype(const std::string& name) {
  Result<KvDtype> d = parse_kv_dtype(name);
  if (!d) return Result<KvSizeDtype>::error(d.message());
  for (const auto& s : kv_size_dtypes())
    if (s.name == kv_dtype_name(*d)) return s;
  return Result<KvSizeDtype>::error(std::string("kv-size has no entry for ") + kv_dtype_name(*d));
}

// ---------------------------------------------------------------------------------------------
// spec

const char* kv_group_kind_name(KvGroupKind k) {
  switch (k) {
    case KvGroupKind::kGlobal: return "global";
    case KvGroupKind::kLocal: return "local";
    case KvGroupKind::kLatent: return "latent";
  }
  return "?";
}

int64_t KvLayerGroupSpec::values_per_token_per_layer() const {
  if (kind == KvGroupKind::kLatent) return latent_dim + rope_dim;
  return n_head_kv * (k_dim + v_dim);
}

int64_t KvLayerGroupSpec::tokens_kept(int64_t seq_len) const {
  if (kind == KvGroupKind::kLocal && window > 0) return std::min(seq_len, window);
  return seq_len;
}

std::string KvLayerGroupSpec::label() const {
  switch (kind) {
    case KvGroupKind::kGlobal: return "global";
    case KvGroupKind::kLocal: return "local (window " + std::to_string(window) + ")";
    case KvGroupKind::kLatent:
      return "latent (" + std::to_string(latent_dim) + " + " + std::to_string(rope_dim) + " rope)";
  }
  return "?";
}

int64_t KvSizeSpec::n_layers() const {
  int64_t n = 0;
  for (const auto& g : groups) n += g.n_layers;
  return n;
}

int64_t KvSizeSpec::group_size() const {
  int64_t kv = -1;
  for (const auto& g : groups) {
    if (g.kind == KvGroupKind::kLatent) return 0;
    if (kv >= 0 && g.n_head_kv != kv) return 0;
    kv = g.n_head_kv;
  }
  if (kv <= 0 || n_head <= 0 || n_head % kv != 0) return 0;
  return n_head / kv;
}

namespace {
std::string sharing_name(int64_t n_head, int64_t group_size) {
  if (group_size == 1) return "MHA";
  if (group_size == n_head) return "MQA";
  return "GQA";
}
}  // namespace

std::string KvSizeSpec::variant() const {
  bool latent = false, local = false, global = false;
  for (const auto& g : groups) {
    latent |= g.kind == KvGroupKind::kLatent;
    local |= g.kind == KvGroupKind::kLocal;
    global |= g.kind == KvGroupKind::kGlobal;
  }
  if (latent) return "MLA";
  if (local && global) return "hybrid";
  int64_t gs = group_size();
  if (gs == 0) return "per-layer";
  return sharing_name(n_head, gs);
}

std::string KvSizeSpec::variant_description() const {
  const std::string v = variant();
  const int64_t gs = group_size();
  auto sharing = [&]() -> std::string {
    if (gs == 0) return "kv heads vary by layer";
    std::string s = sharing_name(n_head, gs);
    if (s == "MHA") return "MHA (" + std::to_string(n_head) + " heads, each its own K/V)";
    return s + " (group size " + std::to_string(gs) + ": " + std::to_string(n_head) + " query heads / " +
           std::to_string(n_head / gs) + " kv head" + (n_head / gs == 1 ? "" : "s") + ")";
  };
  if (v == "MLA") {
    for (const auto& g : groups)
      if (g.kind == KvGroupKind::kLatent)
        return "MLA (latent " + std::to_string(g.latent_dim) + " + rope " + std::to_string(g.rope_dim) +
               " per token per layer, no separate K and V)";
  }
  if (v == "hybrid") {
    int64_t nl = 0, ng = 0, w = 0;
    for (const auto& g : groups) {
      if (g.kind == KvGroupKind::kLocal) {
        nl += g.n_layers;
        w = std::max(w, g.window);
      } else {
        ng += g.n_layers;
      }
    }
    return "hybrid: " + std::to_string(nl) + " local (sliding window " + std::to_string(w) + ") + " +
           std::to_string(ng) + " global layers; " + sharing();
  }
  return sharing();
}

Status KvSizeSpec::validate() const {
  if (groups.empty()) return Status::error("no layer with a KV cache");
  if (n_layers() > kMaxLayers) return Status::error("too many layers: " + std::to_string(n_layers()));
  for (const auto& g : groups) {
    auto in = [](int64_t v) { return v >= 0 && v <= kMaxDim; };
    if (g.n_layers <= 0) return Status::error("layer group with no layers");
    if (!in(g.n_head_kv) || !in(g.k_dim) || !in(g.v_dim) || !in(g.latent_dim) || !in(g.rope_dim) || g.window < 0)
      return Status::error("layer group shape out of range");
    if (g.kind == KvGroupKind::kLatent) {
      if (g.latent_dim <= 0) return Status::error("latent group needs kv_lora_rank > 0");
    } else {
      if (g.n_head_kv <= 0 || g.k_dim <= 0 || g.v_dim <= 0)
        return Status::error("attention group needs kv heads and head dims > 0");
      if (g.kind == KvGroupKind::kLocal && g.window <= 0) return Status::error("local group needs a window > 0");
    }
  }
  return Status::ok();
}

// ---------------------------------------------------------------------------------------------
// arithmetic

Result<KvSizeReport> compute_kv_size(const KvSizeSpec& spec, const KvSizeOptions& opt) {
  if (Status st = spec.validate(); !st) return st;
  if (opt.seq_len < 1) return Result<KvSizeReport>::error("--seq-len must be at least 1");
  if (opt.batch < 1) return Result<KvSizeReport>::error("--batch must be at least 1");
  if (opt.dtype.bits <= 0 || opt.dtype.bits > 64) return Result<KvSizeReport>::error("bad dtype width");
  if (opt.scale_group < 0) return Result<KvSizeReport>::error("--scale-group must be >= 0");
  const bool scales = opt.dtype.quantized && opt.scale_group > 0;
  const auto too_big = Result<KvSizeReport>::error("KV size overflows 64-bit arithmetic: lower --seq-len or --batch");

  KvSizeReport r;
  r.options = opt;
  for (const auto& g : spec.groups) {
    KvGroupSize s;
    s.group = g;
    s.tokens_kept = g.tokens_kept(opt.seq_len);
    s.values_per_token_per_layer = g.values_per_token_per_layer();
    int64_t bits = s.values_per_token_per_layer * opt.dtype.bits;  // bounded by validate()
    int64_t scale_bits = 0;
    if (scales) {
      int64_t n_scales = g.kind == KvGroupKind::kLatent
                             ? ceil_div(g.latent_dim + g.rope_dim, opt.scale_group)
                             : g.n_head_kv * (ceil_div(g.k_dim, opt.scale_group) + ceil_div(g.v_dim, opt.scale_group));
      scale_bits = n_scales * opt.scale_bits;
      bits += scale_bits;
    }
    s.bits_per_token_per_layer = bits;
    int64_t seq_scale = 0;
    if (!mul_ok(bits, g.n_layers, &s.bits_per_token) || !mul_ok(s.bits_per_token, s.tokens_kept, &s.bits_per_sequence) ||
        !mul_ok(s.bits_per_sequence, opt.batch, &s.bits_per_batch) || !mul_ok(scale_bits, g.n_layers, &seq_scale) ||
        !mul_ok(seq_scale, s.tokens_kept, &seq_scale))
      return too_big;
    if (!add_ok(r.bits_per_token, s.bits_per_token, &r.bits_per_token) ||
        !add_ok(r.bits_per_sequence, s.bits_per_sequence, &r.bits_per_sequence) ||
        !add_ok(r.bits_per_batch, s.bits_per_batch, &r.bits_per_batch) ||
        !add_ok(r.scale_bits_per_sequence, seq_scale, &r.scale_bits_per_sequence))
      return too_big;
    r.groups.push_back(s);
  }
  return r;
}

std::string group_thousands(int64_t v) {
  std::string digits = std::to_string(v < 0 ? -v : v);
  std::string out;
  for (size_t i = 0; i < digits.size(); ++i) {
    if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
    out += digits[i];
  }
  return v < 0 ? "-" + out : out;
}

std::string binary_size(double bytes) { return format_bytes(bytes); }

std::string format_kv_bits(int64_t bits) {
  std::string b = group_thousands(bits / 8);
  if (bits % 8 != 0) {
    char frac[16];
    std::snprintf(frac, sizeof frac, "%g", static_cast<double>(bits % 8) / 8.0);
    b += std::string(frac).substr(1);  // ".5"
  }
  std::string s = b + (bits == 8 ? " byte" : " bytes");
  if (bits >= 8 * 1024) s += " (" + binary_size(bits_to_bytes(bits)) + ")";
  return s;
}

// ---------------------------------------------------------------------------------------------
// GGUF

namespace {

class GgufReader {
 public:
  GgufReader(const GgufFile& f, std::string prefix) : f_(f), p_(std::move(prefix)) {}

  // Absent → dflt; present with a wrong type → error.
  Result<int64_t> integer(const std::string& key, int64_t dflt) const {
    auto r = f_.get_int(p_ + key, dflt);
    if (!r) return r;
    if (r.value() < 0 || r.value() > kMaxDim)
      return Result<int64_t>::error("metadata '" + p_ + key + "' out of range: " + std::to_string(r.value()));
    return r;
  }
  Result<int64_t> required(const std::string& key) const {
    if (!f_.has(p_ + key)) return Result<int64_t>::error("missing metadata '" + p_ + key + "'");
    return integer(key, 0);
  }
  // One number or one per layer.
  Result<std::vector<int64_t>> per_layer(const std::string& key, int64_t n_layer, int64_t dflt) const {
    const GgufValue* v = f_.find(p_ + key);
    if (v && v->type == GgufType::ARRAY) {
      if (static_cast<int64_t>(v->arr.size()) != n_layer)
        return Result<std::vector<int64_t>>::error("metadata '" + p_ + key + "' has " + std::to_string(v->arr.size()) +
                                                   " entries for " + std::to_string(n_layer) + " layers");
      std::vector<int64_t> out;
      for (const auto& e : v->arr) {
        if (!e.is_int() || e.i < 0 || e.i > kMaxDim)
          return Result<std::vector<int64_t>>::error("metadata '" + p_ + key + "' should hold small non-negative integers");
        out.push_back(e.i);
      }
      return out;
    }
    auto x = integer(key, dflt);
    if (!x) return x.status();
    return std::vector<int64_t>(static_cast<size_t>(n_layer), x.value());
  }
  const GgufValue* find(const std::string& key) const { return f_.find(p_ + key); }
  const std::string& prefix() const { return p_; }

 private:
  const GgufFile& f_;
  std::string p_;
};

// llama.cpp's default layer pattern for architectures whose GGUF carries only
// `sliding_window`: llama_hparams::set_swa_pattern(n) makes layer il local unless
// il % n == n - 1 (i.e. (il + 1) % n == 0 is global).
int64_t default_swa_period(const std::string& arch) {
  if (arch == "gemma3") return 6;  // 5 local : 1 global
  if (arch == "gemma2") return 2;  // alternating
  if (arch == "cohere2") return 4;
  return 0;
}

}  // namespace

Result<int64_t> sliding_window_layers(const GgufFile& f, int64_t L, std::vector<bool>* local, std::string* notes_out) {
  using R = Result<int64_t>;
  auto arch_r = f.get_string("general.architecture", "");
  if (!arch_r) return arch_r.status();
  const std::string arch = arch_r.value();
  GgufReader g(f, arch + ".");
  std::vector<bool>& is_local = *local;
  is_local.assign(static_cast<size_t>(L), false);
  std::string notes;
  auto win = g.integer("attention.sliding_window", 0);
  if (!win) return win.status();
  const int64_t window = win.value();
  if (window > 0) {
    const GgufValue* pat = g.find("attention.sliding_window_pattern");
    int64_t period = 0;
    if (pat && pat->type == GgufType::ARRAY) {
      // Per-layer flags: true = sliding window.
      if (static_cast<int64_t>(pat->arr.size()) != L)
        return R::error("metadata '" + arch + ".attention.sliding_window_pattern' has " +
                        std::to_string(pat->arr.size()) + " entries for " + std::to_string(L) + " layers");
      for (int64_t il = 0; il < L; ++il) {
        if (!pat->arr[il].is_int())
          return R::error("metadata '" + arch + ".attention.sliding_window_pattern' should hold booleans");
        is_local[il] = pat->arr[il].i != 0;
      }
      notes = "layer pattern from " + arch + ".attention.sliding_window_pattern";
    } else {
      if (pat) {
        auto p = g.integer("attention.sliding_window_pattern", 0);
        if (!p) return p.status();
        period = p.value();
        notes = "layer pattern: every " + std::to_string(period) + "th layer global (" + arch +
                ".attention.sliding_window_pattern)";
      } else {
        period = default_swa_period(arch);
        if (period > 0)
          notes = "layer pattern: every " + std::to_string(period) + "th layer global (llama.cpp's default for " + arch +
                  "; the GGUF stores only sliding_window)";
      }
      if (period > 0) {
        for (int64_t il = 0; il < L; ++il) is_local[il] = il % period < period - 1;
      } else {
        notes = arch + ".attention.sliding_window is set but the layer pattern is unknown: all layers counted as global (upper bound)";
      }
    }
  }
  if (notes_out) *notes_out = notes;
  return window;
}

Result<KvSizeSpec> kv_size_spec_from_gguf(const GgufFile& f) {
  using R = Result<KvSizeSpec>;
  auto arch_r = f.get_string("general.architecture", "");
  if (!arch_r) return arch_r.status();
  const std::string arch = arch_r.value();
  if (arch.empty()) return R::error("missing metadata 'general.architecture'");
  GgufReader g(f, arch + ".");

  auto n_layer = g.required("block_count");
  if (!n_layer) return n_layer.status();
  if (n_layer.value() < 1 || n_layer.value() > kMaxLayers)
    return R::error("metadata '" + arch + ".block_count' out of range: " + std::to_string(n_layer.value()));
  const int64_t L = n_layer.value();
  if (!f.has(arch + ".attention.head_count")) return R::error("missing metadata '" + arch + ".attention.head_count'");
  auto heads = g.per_layer("attention.head_count", L, 0);
  if (!heads) return heads.status();
  const int64_t n_head = *std::max_element(heads->begin(), heads->end());
  auto heads_kv = g.per_layer("attention.head_count_kv", L, n_head);  // llama.cpp: defaults to n_head
  if (!heads_kv) return heads_kv.status();

  KvSizeSpec spec;
  spec.name = f.path();
  spec.architecture = arch;
  spec.n_head = n_head;

  // MLA: one latent row (kv_lora_rank) plus the decoupled rope key per token per layer.
  auto rank = g.integer("attention.kv_lora_rank", 0);
  if (!rank) return rank.status();
  if (rank.value() > 0) {
    int64_t rope = 0;
    if (g.find("rope.dimension_count")) {
      auto r = g.integer("rope.dimension_count", 0);
      if (!r) return r.status();
      rope = r.value();
    } else if (g.find("attention.qk_rope_head_dim")) {
      auto r = g.integer("attention.qk_rope_head_dim", 0);
      if (!r) return r.status();
      rope = r.value();
    } else {
      return R::error("missing metadata '" + arch + ".rope.dimension_count' (MLA rope dim)");
    }
    KvLayerGroupSpec lg;
    lg.kind = KvGroupKind::kLatent;
    lg.n_layers = L;
    lg.latent_dim = rank.value();
    lg.rope_dim = rope;
    spec.groups.push_back(lg);
    spec.notes = "MLA: " + arch + ".attention.kv_lora_rank + rope.dimension_count values per token per layer";
    if (Status st = spec.validate(); !st) return st;
    return spec;
  }

  // K and V head dims: key_length / value_length, else n_embd / n_head.
  int64_t k_dim = 0, v_dim = 0;
  if (g.find("attention.key_length")) {
    auto k = g.integer("attention.key_length", 0);
    if (!k) return k.status();
    k_dim = k.value();
  } else {
    auto e = g.integer("embedding_length", 0);
    if (!e) return e.status();
    if (e.value() <= 0 || n_head <= 0)
      return R::error("missing metadata '" + arch + ".attention.key_length' (and no embedding_length / head_count to derive it)");
    k_dim = e.value() / n_head;
  }
  auto v = g.integer("attention.value_length", k_dim);
  if (!v) return v.status();
  v_dim = v.value();
  // Sliding-window layers may use other head dims (llama.cpp's key_length_swa / value_length_swa).
  auto k_swa = g.integer("attention.key_length_swa", k_dim);
  if (!k_swa) return k_swa.status();
  auto v_swa = g.integer("attention.value_length_swa", g.find("attention.key_length_swa") ? k_swa.value() : v_dim);
  if (!v_swa) return v_swa.status();

  // Which layers are sliding-window (local).
  std::vector<bool> is_local;
  std::string notes;
  auto win = sliding_window_layers(f, L, &is_local, &notes);
  if (!win) return win.status();
  const int64_t window = win.value();

  // Group layers with the same shape; layers with no kv heads cache nothing.
  std::map<std::tuple<int, int64_t>, int64_t> counts;  // (kind, n_head_kv) -> layers
  std::vector<std::tuple<int, int64_t>> order;
  int64_t no_kv = 0;
  for (int64_t il = 0; il < L; ++il) {
    const int64_t hkv = (*heads_kv)[il];
    if (hkv == 0) {
      ++no_kv;
      continue;
    }
    auto key = std::make_tuple(is_local[il] ? 1 : 0, hkv);
    if (counts[key]++ == 0) order.push_back(key);
  }
  std::stable_sort(order.begin(), order.end(), [](const auto& a, const auto& b) { return std::get<0>(a) < std::get<0>(b); });
  for (const auto& key : order) {
    KvLayerGroupSpec lg;
    lg.kind = std::get<0>(key) ? KvGroupKind::kLocal : KvGroupKind::kGlobal;
    lg.n_layers = counts[key];
    lg.n_head_kv = std::get<1>(key);
    const bool local = lg.kind == KvGroupKind::kLocal;
    lg.k_dim = local ? k_swa.value() : k_dim;
    lg.v_dim = local ? v_swa.value() : v_dim;
    lg.window = local ? window : 0;
    spec.groups.push_back(lg);
  }
  if (no_kv > 0) notes += std::string(notes.empty() ? "" : "; ") + std::to_string(no_kv) + " layers without kv heads cache nothing";
  spec.notes = notes;
  if (Status st = spec.validate(); !st) return R::error(f.path() + ": " + st.message());
  return spec;
}

// ---------------------------------------------------------------------------------------------
// presets

namespace {

KvLayerGroupSpec attn(KvGroupKind kind, int64_t layers, int64_t kv_heads, int64_t head_dim, int64_t window = 0) {
  KvLayerGroupSpec g;
  g.kind = kind;
  g.n_layers = layers;
  g.n_head_kv = kv_heads;
  g.k_dim = head_dim;
  g.v_dim = head_dim;
  g.window = window;
  return g;
}

KvSizePreset dense(std::string name, std::vector<std::string> aliases, std::string desc, std::string arch,
                   int64_t layers, int64_t heads, int64_t kv_heads, int64_t head_dim, std::string notes) {
  KvSizePreset p;
  p.name = name;
  p.aliases = std::move(aliases);
  p.description = std::move(desc);
  p.spec.name = std::move(name);
  p.spec.architecture = std::move(arch);
  p.spec.n_head = heads;
  p.spec.groups = {attn(KvGroupKind::kGlobal, layers, kv_heads, head_dim)};
  p.spec.notes = std::move(notes);
  return p;
}

// Gemma 3 layout: layer il is global when (il + 1) % 6 == 0, otherwise local.
KvSizePreset gemma3(std::string name, std::string desc, int64_t layers, int64_t heads, int64_t kv_heads,
                    int64_t head_dim, int64_t window, std::string notes) {
  int64_t global = layers / 6;
  KvSizePreset p;
  p.name = name;
  p.description = std::move(desc);
  p.spec.name = std::move(name);
  p.spec.architecture = "gemma3";
  p.spec.n_head = heads;
  p.spec.groups = {attn(KvGroupKind::kGlobal, global, kv_heads, head_dim),
                   attn(KvGroupKind::kLocal, layers - global, kv_heads, head_dim, window)};
  p.spec.notes = std::move(notes);
  return p;
}

std::vector<KvSizePreset> make_presets() {
  std::vector<KvSizePreset> v;
  // The seeds' worked example: Llama-2-70B counted as MHA (every head its own K/V). One
  // sequence of 4,096 tokens in fp16 = 2 × 80 × 64 × 128 × 2 × 4096 = 10,737,418,240 bytes
  // (10 GiB). The released checkpoint is GQA with 8 kv heads: see llama-2-70b-gqa.
  v.push_back(dense("llama-2-70b", {"llama-2-70b-mha", "70b-mha"},
                    "Llama-2-70B as MHA (the worked example): 80 layers, 64 heads = 64 kv heads, head_dim 128",
                    "llama", 80, 64, 64, 128,
                    "worked example counts every head's K/V; the released checkpoint uses GQA (see llama-2-70b-gqa)"));
  v.push_back(dense("llama-2-70b-gqa", {}, "Llama-2-70B as released: GQA 64/8, 80 layers, head_dim 128", "llama", 80,
                    64, 8, 128, "GQA with 8 kv heads: 1/8 of the MHA figure"));
  v.push_back(dense("llama-3-70b", {"llama-3.1-70b"}, "Llama-3(.1)-70B: GQA 64/8, 80 layers, head_dim 128", "llama", 80,
                    64, 8, 128, ""));
  v.push_back(dense("llama-2-7b", {"7b-mha"}, "Llama-2-7B / a 7B MHA: 32 layers, 32 heads = 32 kv heads, head_dim 128",
                    "llama", 32, 32, 32, 128, ""));
  {
    // DeepSeek-V2: 60 layers, 128 heads, kv_lora_rank 512, qk_rope_head_dim 64 (the model's
    // config.json). MLA caches c_KV (512) + the shared rope key (64) per token per layer.
    KvSizePreset p;
    p.name = "deepseek-v2";
    p.description = "DeepSeek-V2: MLA, 60 layers, kv_lora_rank 512 + rope 64 = 576 values per token per layer";
    p.spec.name = p.name;
    p.spec.architecture = "deepseek2";
    p.spec.n_head = 128;
    KvLayerGroupSpec g;
    g.kind = KvGroupKind::kLatent;
    g.n_layers = 60;
    g.latent_dim = 512;
    g.rope_dim = 64;
    p.spec.groups = {g};
    p.spec.notes = "latent only: no per-head K and V are cached";
    v.push_back(std::move(p));
  }
  // Gemma 3 27B, from its Hugging Face text_config (as mirrored in AI-Hypercomputer/maxtext
  // MaxText/utils/ckpt_conversion/utils/hf_model_configs.py, gemma3_27b_config):
  // num_hidden_layers 62, num_attention_heads 32, num_key_value_heads 16, head_dim 128,
  // sliding_window 1024, sliding_window_pattern 6. With llama.cpp's set_swa_pattern(6)
  // (layer il global iff (il + 1) % 6 == 0) that is 10 global and 52 local layers, matching
  // the Gemma 3 report's "5 local layers for every global layer, starting with a local layer".
  v.push_back(gemma3("gemma-3-27b", "Gemma-3-27B: hybrid 52 local (window 1024) + 10 global, GQA 32/16, head_dim 128", 62,
                     32, 16, 128, 1024, "HF config: 62 layers, 32/16 heads, head_dim 128, sliding_window 1024, pattern 6"));
  v.push_back(dense("smollm2-135m", {"smollm2"},
                    "SmolLM2-135M (models/SmolLM2-135M-Instruct.Q4_1.gguf): GQA 9/3, 30 layers, head_dim 64", "llama",
                    30, 9, 3, 64, "matches the local GGUF"));
  v.push_back(gemma3("gemma-3-270m", "Gemma-3-270M (models/gemma-3-270m-Q4_K_M.gguf): hybrid 15 local (window 512) + 3 global, MQA 4/1, head_dim 256",
                     18, 4, 1, 256, 512, "matches the local GGUF"));
  return v;
}

}  // namespace

const std::vector<KvSizePreset>& kv_size_presets() {
  static const std::vector<KvSizePreset> p = make_presets();
  return p;
}

Result<KvSizeSpec> kv_size_preset(const std::string& name) {
  const std::string n = lower(name);
  for (const auto& p : kv_size_presets()) {
    if (p.name == n) return p.spec;
    for (const auto& a : p.aliases)
      if (a == n) return p.spec;
  }
  std::string names;
  for (const auto& p : kv_size_presets()) names += (names.empty() ? "" : ", ") + p.name;
  return Result<KvSizeSpec>::error("unknown preset '" + name + "' (one of: " + names + "; or --preset list)");
}

}  // namespace kv
