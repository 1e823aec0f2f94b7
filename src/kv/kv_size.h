// KV cache size arithmetic: how many bytes a model's KV cache costs per token, per sequence and
// per batch, for every layer group (global full attention, sliding-window local, MLA latent).
//
// Used by `kvserve kv-size` and meant for the engine's start-up capacity report. Pure
// arithmetic, exact in integers: sizes are kept in bits so that 4-bit elements stay exact.
//
//   global layer: n_head_kv × (k_dim + v_dim) values per token (K and V), every token of the
//                 sequence is kept;
//   local layer:  the same values per token, but only min(seq_len, window) tokens are kept;
//   latent layer: (kv_lora_rank + rope_dim) values per token (MLA caches one compressed latent
//                 plus the shared rope key; there is no separate K and V), every token kept.
//
// Element sizes are the bare element widths (f32 4, f16/bf16 2, fp8/int8 1, int4 0.5 bytes).
// Quantized dtypes also carry scales beside the page (../../DESIGN.md "Page"); those are
// excluded unless KvSizeOptions::scale_group > 0 asks for one scale per scale_group elements.
#pragma once
#include <cstdint>
#include <string>
#include <vector>

#include "common/status.h"

namespace kv {

class GgufFile;

// An element type a KV page can be stored in, for size purposes.
struct KvSizeDtype {
  std::string name;      // canonical: f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8, int4
  int bits = 16;         // bits per element
  bool quantized = false;  // needs scales (fp8 / int8 / int4)
};
// Names and aliases: f32|fp32, f16|fp16|auto, bf16, fp8_e4m3|fp8, fp8_e5m2, int8, int4.
Result<KvSizeDtype> kv_size_dtype(const std::string& name);
const std::vector<KvSizeDtype>& kv_size_dtypes();

enum class KvGroupKind { kGlobal, kLocal, kLatent };
const char* kv_group_kind_name(KvGroupKind k);  // "global", "local", "latent"

// n_layers layers that share one cache shape.
struct KvLayerGroupSpec {
  KvGroupKind kind = KvGroupKind::kGlobal;
  int64_t n_layers = 0;
  int64_t n_head_kv = 0;   // global / local
  int64_t k_dim = 0;       // K head dim (global / local)
  int64_t v_dim = 0;       // V head dim (global / local; may differ from k_dim)
  int64_t window = 0;      // local: tokens kept (sliding window); 0 otherwise
  int64_t latent_dim = 0;  // latent: kv_lora_rank
  int64_t rope_dim = 0;    // latent: decoupled rope key dim (qk_rope_head_dim)

  // Cached values (elements) per token per layer.
  int64_t values_per_token_per_layer() const;
  // Tokens one layer of this group keeps for a sequence of seq_len tokens.
  int64_t tokens_kept(int64_t seq_len) const;
  // "global", "local (window 1024)", "latent (512 + 64 rope)".
  std::string label() const;
};

struct KvSizeSpec {
  std::string name;          // preset name or file path
  std::string architecture;  // llama, gemma3, deepseek2, ...
  int64_t n_head = 0;        // query heads (for the variant label)
  std::vector<KvLayerGroupSpec> groups;
  std::string notes;         // where the numbers come from; caveats

  int64_t n_layers() const;
  // "MHA", "GQA", "MQA", "MLA", "hybrid", or "per-layer" (varying kv heads, no windows).
  std::string variant() const;
  // Query heads per kv head when uniform (1 = MHA); 0 when not meaningful (MLA, mixed).
  int64_t group_size() const;
  // One line: "GQA (group size 8: 64 query heads / 8 kv heads)", "hybrid: 52 local (window
  // 1024) + 10 global layers, GQA group size 2", "MLA (latent 512 + rope 64)".
  std::string variant_description() const;
  Status validate() const;
};

struct KvSizeOptions {
  int64_t seq_len = 4096;
  int64_t batch = 1;
  KvSizeDtype dtype{"f16", 16, false};
  // Quantized dtypes: one scale of scale_bits per scale_group elements of each cached row
  // (a K head row, a V head row, or a latent row), rounded up. 0 = bare elements only.
  int64_t scale_group = 0;
  int scale_bits = 16;
};

// Sizes are in bits (exact for 4-bit elements); bytes = bits / 8.
struct KvGroupSize {
  KvLayerGroupSpec group;
  int64_t tokens_kept = 0;                // per layer, per sequence
  int64_t values_per_token_per_layer = 0;
  int64_t bits_per_token_per_layer = 0;   // including scales when asked
  int64_t bits_per_token = 0;             // × n_layers (a token inside the window)
  int64_t bits_per_sequence = 0;          // × tokens_kept
  int64_t bits_per_batch = 0;             // × batch
};

struct KvSizeReport {
  KvSizeOptions options;
  std::vector<KvGroupSize> groups;
  int64_t bits_per_token = 0;     // all layers, for a token that every window still holds
  int64_t bits_per_sequence = 0;  // seq_len tokens, windows applied
  int64_t bits_per_batch = 0;     // batch sequences
  int64_t scale_bits_per_sequence = 0;  // share of bits_per_sequence that is scales
};

Result<KvSizeReport> compute_kv_size(const KvSizeSpec& spec, const KvSizeOptions& opt);

// Bytes from bits: exact when a multiple of 8 (always, unless int4 meets an odd count).
inline bool bits_whole_bytes(int64_t bits) { return bits % 8 == 0; }
inline double bits_to_bytes(int64_t bits) { return static_cast<double>(bits) / 8.0; }
// "10,737,418,240 bytes (10.00 GiB)"; "0.5 bytes"; binary prefixes (1 KiB = 1024 bytes).
std::string format_kv_bits(int64_t bits);
std::string group_thousands(int64_t v);  // 10737418240 -> "10,737,418,240"
std::string binary_size(double bytes);   // "10.00 GiB", "22.50 KiB", "512 B"

// From a GGUF's `{arch}.*` metadata (llama.cpp names). Errors name the missing key.
// The sliding window ({arch}.attention.sliding_window, 0 if none) and which of the L layers
// use it: {arch}.attention.sliding_window_pattern (per-layer flags or a period), else
// llama.cpp's default period for the architecture. notes: where the pattern came from.
Result<int64_t> sliding_window_layers(const GgufFile& f, int64_t L, std::vector<bool>* local, std::string* notes);
Result<KvSizeSpec> kv_size_spec_from_gguf(const GgufFile& f);

struct KvSizePreset {
  std::string name;
  std::vector<std::string> aliases;
  std::string description;
  KvSizeSpec spec;
};
const std::vector<KvSizePreset>& kv_size_presets();
Result<KvSizeSpec> kv_size_preset(const std::string& name);

}  // namespace kv
