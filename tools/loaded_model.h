// Loading shared by the commands that run a model: file, weights, tokenizer, KV pool, with
// progress on stderr and one-line errors (thrown as CLI::RuntimeError after printing).
#pragma once
#include "engine/speculative.h"
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "common/thread_pool.h"
#include "gguf/gguf.h"
#include "kv/cold_store.h"
#include "kv/kv_eviction.h"
#include "kv/page_pool.h"
#include "model/llama.h"
#include "tokenizer/tokenizer.h"

namespace kvtools {

struct KvOptions {
  std::string memory = "1GiB";
  int block_size = 16;
  std::string dtype = "auto";
  std::string layer_dtypes;  // --kv-cache-dtype-layers, e.g. "0-1:f16,28-29:f16"
  std::string act_quant;     // --act-quant q8x2|q8 (empty: KV_ACT_QUANT or q8x2); applied by load_model
};

// Long-context KV policies (kv/kv_eviction.h): --kv-eviction, --kv-budget, --kv-sink-tokens,
// --kv-recent-tokens, --kv-obs-window, --kv-sparse quest, --kv-sparse-pages.
struct EvictionOptions {
  std::string policy = "none";
  int64_t budget = 0;
  // -1: not given (the policy's default: 4 sink tokens, a 32-query observation window); given
  // where they would do nothing (no policy, and for the first two no Quest either) they are refused.
  int sink_tokens = -1;
  int recent_tokens = -1;
  int obs_window = -1;
  std::string sparse = "none";
  int sparse_pages = 0;
  bool offload_cold = false;  // --kv-offload-cold
  std::string offload_dir;    // --kv-offload-dir (empty: --kv-disk-dir where the command has it, else /tmp)
};
void add_eviction_options(CLI::App* cmd, EvictionOptions* eo);
// The config the options ask for, validated at this block size (exits with a message).
kv::EvictionConfig make_eviction(const EvictionOptions& eo, int block_size);
// --kv-offload-cold for a command that runs a SequenceRunner on `pool`: the spill file (key
// bounds enabled on the pool first); null when the option is off.
std::unique_ptr<kv::ColdStore> make_cold_store(const EvictionOptions& eo, kv::PagePool& pool);
// The cold store's counters and the RAM pool's size, for a command's JSON output.
nlohmann::json cold_store_json(const kv::ColdStore& cold, const kv::PagePool& pool);

// The KV layout the options ask for, validated (exits with a message when it is not valid).
kv::KvLayout make_kv_layout(const kv::LlamaModel& model, const KvOptions& kvo, int group = 0);
// --kv-cache-dtype-layers as one dtype per model layer (empty: none given), what
// EngineConfig::kv_layer_dtypes wants (a group's layout holds only its own layers' entries).
std::vector<kv::KvDtype> model_layer_dtypes(const kv::LlamaModel& model, const KvOptions& kvo);

struct LoadedModel {
  std::unique_ptr<kv::GgufFile> file;
  std::unique_ptr<kv::LlamaModel> model;
  std::unique_ptr<kv::Tokenizer> tokenizer;
  std::unique_ptr<kv::PagePool> pool;     // KV group 0 (all layers, or the global ones)
  std::unique_ptr<kv::PagePool> pool_g1;  // hybrid models: the sliding-window layers, else null
  std::unique_ptr<kv::ThreadPool> threads;
};

// quiet: no progress lines (for --json output). with_runtime: also make the KV pool and
// thread pool (commands that run the model themselves; `serve` leaves both to the engine).
LoadedModel load_model(const std::string& path, int n_threads, const KvOptions& kvo, bool quiet, bool with_runtime = true);
void add_kv_options(CLI::App* cmd, KvOptions* kvo);

[[noreturn]] void fail(const std::string& msg);

// --speculative-config '{"method": "ngram", "num_speculative_tokens": 5, ...}' (vLLM's shape,
// kv::parse_spec_config); "" = off. A bad value fails with the parser's message.
kv::SpecConfig parse_speculative_option(const std::string& json_text);

}  // namespace kvtools
