#include <cstdio>

#include "commands.h"
#include "common/units.h"
#include "kernels/attention.h"
#include "loaded_model.h"
#include "server/openai_request.h"

namespace kvtools {

void fail(const std::string& msg) {
  std::fprintf(stderr, "error: %s\n", msg.c_str());
  throw CLI::RuntimeError(1);
}

void add_kv_options(CLI::App* cmd, KvOptions* kvo) {
  cmd->add_option("--kv-cache-memory", kvo->memory, "KV cache budget: bytes (2GiB, 512MiB) or a fraction of RAM (0.25)")
      ->capture_default_str();
  cmd->add_option("--block-size", kvo->block_size, "token positions per KV page")
      ->check(number_in(1, kv::kAttnMaxBlockSize))
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype", kvo->dtype,
                  "KV page element type: auto (= f16), f32, f16, bf16, fp8_e4m3 (fp8), fp8_e5m2, int8, int4")
      ->capture_default_str();
  cmd->add_option("--kv-cache-dtype-layers", kvo->layer_dtypes,
                  "per-layer KV dtypes over --kv-cache-dtype, e.g. \"0-1:f16,28-29:f16\"");
  cmd->add_option("--act-quant", kvo->act_quant,
                  "activations of quantized matmuls: q8x2 (default: two 8-bit levels, ~15 bits, matches the float "
                  "oracle) or q8 (one level, llama.cpp's precision: ~1.4x faster batched decode, see README)")
      ->check(CLI::IsMember({"q8x2", "q8"}));
}

void add_eviction_options(CLI::App* cmd, EvictionOptions* eo) {
  cmd->add_option("--kv-eviction", eo->policy,
                  "long-context KV policy: none, window (recent tokens only), sinks (StreamingLLM: sink + recent tokens), "
                  "h2o (heavy hitters by accumulated attention), snapkv (the last queries vote)")
      ->check(CLI::IsMember({"none", "window", "sinks", "h2o", "snapkv"}))
      ->capture_default_str();
  cmd->add_option("--kv-budget", eo->budget, "tokens of KV kept per sequence (whole pages; the global layers); with --kv-offload-cold, kept in RAM")->check(non_negative());
  cmd->add_option("--kv-sink-tokens", eo->sink_tokens, "tokens kept from the start (sinks, h2o, snapkv; default 4)")
      ->check(non_negative());
  cmd->add_option("--kv-recent-tokens", eo->recent_tokens,
                  "tokens kept at the end (default: the budget after sinks for window/sinks, half for h2o, a quarter for snapkv)");
  cmd->add_option("--kv-obs-window", eo->obs_window, "SnapKV: prompt queries that vote at the end of a prompt (default 32)")
      ->check(positive());
  cmd->add_option("--kv-sparse", eo->sparse, "sparse reads: none or quest (read the pages whose keys can score high)")
      ->check(CLI::IsMember({"none", "quest"}))
      ->capture_default_str();
  cmd->add_option("--kv-sparse-pages", eo->sparse_pages, "Quest: pages read per decode query beyond sink and recent pages")
      ->check(non_negative());
  cmd->add_flag("--kv-offload-cold", eo->offload_cold,
                "hot and cold pages (with --kv-sparse quest): a sequence keeps --kv-budget tokens of KV in RAM, the least recently "
                "read pages go to a spill file on disk and come back when Quest picks them");
  cmd->add_option("--kv-offload-dir", eo->offload_dir, "directory of the cold-page spill file (default: --kv-disk-dir, else /tmp)");
}

std::unique_ptr<kv::ColdStore> make_cold_store(const EvictionOptions& eo, kv::PagePool& pool) {
  if (!eo.offload_cold) return nullptr;
  pool.enable_key_stats();
  auto c = kv::ColdStore::create(eo.offload_dir.empty() ? "/tmp" : eo.offload_dir, pool);
  if (!c) fail(c.message());
  return std::move(*c);
}

nlohmann::json cold_store_json(const kv::ColdStore& cold, const kv::PagePool& pool) {
  const kv::ColdStats c = cold.stats();
  return {{"pages_out", c.pages_out},         {"pages_in", c.pages_in},     {"prefetches", c.prefetches},
          {"prefetch_hits", c.prefetch_hits}, {"errors", c.errors},         {"no_room", c.no_room},
          {"fetch_seconds", c.fetch_seconds}, {"file_bytes", c.file_bytes}, {"ram_pool_pages", pool.n_pages()},
          {"ram_pool_tokens", int64_t(pool.n_pages()) * pool.layout().block_size}};
}

kv::EvictionConfig make_eviction(const EvictionOptions& eo, int block_size) {
  kv::EvictionConfig c;
  auto p = kv::parse_eviction_policy(eo.policy);
  if (!p) fail(p.message());
  c.policy = *p;
  if (c.policy == kv::EvictionPolicy::kNone) {  // these would do nothing: say so rather than run without them
    if (eo.budget > 0 && !eo.offload_cold)
      fail("--kv-budget needs --kv-eviction POLICY (sinks, h2o, snapkv, window), or --kv-offload-cold with --kv-sparse quest");
    if (eo.sparse != "quest" && (eo.sink_tokens >= 0 || eo.recent_tokens >= 0))  // Quest reads its sink and recent pages
      fail("--kv-sink-tokens and --kv-recent-tokens need --kv-eviction POLICY or --kv-sparse quest");
  }
  if (eo.obs_window >= 0 && c.policy != kv::EvictionPolicy::kSnapKV) fail("--kv-obs-window needs --kv-eviction snapkv");
  // window keeps no sink tokens (sinks is window plus sinks): a user test's request for 4 got none, silently
  if (eo.sink_tokens >= 0 && c.policy == kv::EvictionPolicy::kWindow)
    fail("--kv-sink-tokens: window keeps no sink tokens; --kv-eviction sinks keeps them and a recent window");
  if (!eo.offload_dir.empty() && !eo.offload_cold) fail("--kv-offload-dir needs --kv-offload-cold (the directory of its spill file)");
  c.budget = eo.budget;
  if (eo.sink_tokens >= 0) c.sink_tokens = eo.sink_tokens;
  c.recent_tokens = eo.recent_tokens;
  if (eo.obs_window >= 0) c.obs_window = eo.obs_window;
  if (eo.sparse == "quest") {
    if (eo.sparse_pages <= 0) fail("--kv-sparse quest needs --kv-sparse-pages N (pages read per query beyond sink and recent pages)");
    c.sparse_pages = eo.sparse_pages;
  } else if (eo.sparse_pages > 0) {
    fail("--kv-sparse-pages needs --kv-sparse quest");
  }
  c.offload_cold = eo.offload_cold;
  if (kv::Status st = c.validate(block_size); !st) fail(st.message());
  return c;
}

std::vector<kv::KvDtype> model_layer_dtypes(const kv::LlamaModel& model, const KvOptions& kvo) {
  auto dtype = kv::parse_kv_dtype(kvo.dtype);
  if (!dtype) fail(dtype.message());
  if (kvo.layer_dtypes.empty()) return {};
  auto l = kv::parse_kv_dtype_layers(kvo.layer_dtypes, model.config().n_layer, *dtype);
  if (!l) fail(l.message());
  return std::move(*l);
}

kv::KvLayout make_kv_layout(const kv::LlamaModel& model, const KvOptions& kvo, int group) {
  auto dtype = kv::parse_kv_dtype(kvo.dtype);
  if (!dtype) fail(dtype.message());
  std::vector<kv::KvDtype> layers = model_layer_dtypes(model, kvo);
  kv::KvLayout layout = model.kv_layout(kvo.block_size, *dtype, std::move(layers), group);
  if (kv::Status st = layout.validate(); !st) fail(st.message());
  return layout;
}

namespace {
struct StderrProgress : kv::LoadProgress {
  void on_tensor(int done, int total) override {
    std::fprintf(stderr, "\rloading weights: %d/%d layers", done, total);
    if (done == total) std::fprintf(stderr, "\n");
  }
};
}  // namespace

std::string one_line(const std::string& s) {
  std::string out;
  out.reserve(s.size());
  for (unsigned char c : s) out += (c < 0x20 || c == 0x7f) ? '?' : static_cast<char>(c);
  return out;
}

LoadedModel load_model(const std::string& path, int n_threads, const KvOptions& kvo, bool quiet, bool with_runtime) {
  if (std::string hint = missing_model_hint(path); !hint.empty()) fail(hint);
  if (!kvo.act_quant.empty()) kv::set_act_quant(kvo.act_quant == "q8" ? kv::ActQuant::kQ8 : kv::ActQuant::kQ8x2);
  // More threads than CPUs only take turns with each other (each step waits for the slowest).
  if (n_threads > kv::default_thread_count())
    std::fprintf(stderr, "note: -t %d is more threads than this machine's %d CPUs: expect it to be slower than -t %d\n", n_threads,
                 kv::default_thread_count(), kv::default_thread_count());
  // What can be checked without the model fails before the weights load.
  if (auto d = kv::parse_kv_dtype(kvo.dtype); !d) fail("--kv-cache-dtype: " + d.message());
  if (with_runtime)
    if (auto b = kv::parse_kv_cache_memory(kvo.memory); !b) fail(b.message());
  LoadedModel lm;
  auto f = kv::GgufFile::open(path);
  if (!f) fail(f.message());
  lm.file = std::move(*f);
  auto tok = kv::Tokenizer::from_gguf(*lm.file);
  if (!tok) fail(path + ": tokenizer: " + tok.message());
  lm.tokenizer = std::move(*tok);
  StderrProgress progress;
  auto m = kv::LlamaModel::load(*lm.file, kv::detect_isa(), quiet ? nullptr : &progress);
  if (!m) fail(path + ": " + m.message());
  lm.model = std::move(*m);
  if (!with_runtime) return lm;
  auto bytes = kv::parse_kv_cache_memory(kvo.memory);
  if (!bytes) fail(bytes.message());
  kv::KvLayout layout = make_kv_layout(*lm.model, kvo);
  int64_t budget = *bytes;
  if (lm.model->kv_groups().size() > 1) {
    // Sliding-window layers: one sequence needs its window plus one chunk of pages there.
    const kv::KvLayout l1 = make_kv_layout(*lm.model, kvo, 1);
    const int64_t n1 = (lm.model->kv_groups()[1].window + 512) / kvo.block_size + 4;
    lm.pool_g1 = std::make_unique<kv::PagePool>(l1, static_cast<int32_t>(n1));
    budget -= lm.pool_g1->total_bytes();
  }
  int64_t n_pages = kv::PagePool::pages_for_bytes(layout, budget);
  if (n_pages < 1)
    fail("--kv-cache-memory " + kvo.memory + " holds no page (one page is " + kv::format_bytes(layout.page_bytes()) + ")" +
         (lm.pool_g1 ? "; the sliding-window layers take " + kv::format_bytes(double(lm.pool_g1->total_bytes())) + " of it" : std::string()));
  if (n_pages > (int64_t(1) << 30)) n_pages = int64_t(1) << 30;
  lm.pool = std::make_unique<kv::PagePool>(layout, static_cast<int32_t>(n_pages));
  lm.threads = std::make_unique<kv::ThreadPool>(n_threads > 0 ? n_threads : kv::default_thread_count());
  if (!quiet) {
    const auto& c = lm.model->config();
    std::fprintf(stderr, "model: %s (%s, %d layers, %s %d/%d heads), kernels: %s, threads: %d\n", c.name.c_str(), c.arch.c_str(),
                 c.n_layer, c.attention_kind(), c.n_head, c.n_head_kv, kv::isa_name(kv::detect_isa()), lm.threads->size());
    std::fprintf(stderr, "KV cache: %s %s in %lld pages of %d tokens = %lld tokens (%s per token)%s\n",
                 kv::format_bytes(lm.pool->total_bytes()).c_str(), layout.describe().c_str(), static_cast<long long>(n_pages),
                 kvo.block_size, static_cast<long long>(n_pages * kvo.block_size), kv::format_bytes(layout.bytes_per_token()).c_str(),
                 lm.pool_g1 ? (" in the global layers; sliding-window layers: " + kv::format_bytes(lm.pool_g1->total_bytes()) + " (" +
                               std::to_string(lm.pool_g1->n_pages()) + " pages, window " +
                               std::to_string(lm.model->kv_groups()[1].window) + ")").c_str()
                            : "");
  }
  return lm;
}

kv::SpecConfig parse_speculative_option(const std::string& json_text) {
  if (json_text.empty()) return kv::SpecConfig{};
  nlohmann::json j = nlohmann::json::parse(json_text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) fail("--speculative-config is not valid JSON: " + json_text);
  try {
    return kv::parse_spec_config(j, "speculative_config");
  } catch (const kv::ApiError& e) {
    fail("--speculative-config: " + e.message);
  }
}

}  // namespace kvtools
