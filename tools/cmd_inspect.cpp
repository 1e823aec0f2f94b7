// `kvserve inspect [-m PATH] [--json]`: what a GGUF model is and what its KV cache costs, and
// which kernels (ISA build) this machine would run it with.
//
// One description (a JSON object) is built from the file; the text view and --json print
// the same facts. Hyperparameters come from the `{arch}.*` keys the way llama.cpp names
// them. A missing file prints the fetch hint, a corrupt one a one-line error; both exit 1.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <map>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "commands.h"
#include "kernels/isa.h"
#include "kernels/kv_tile.h"
#include "kernels/matmul.h"
#include "common/units.h"
#include "gguf/gguf.h"

namespace kvtools {

namespace {

using Json = nlohmann::ordered_json;

// llama_ftype names for general.file_type (the "mostly" type of the weights).
const char* file_type_name(int64_t ft) {
  static const std::map<int64_t, const char*> names = {
      {0, "F32"},     {1, "F16"},     {2, "Q4_0"},    {3, "Q4_1"},    {7, "Q8_0"},
      {8, "Q5_0"},    {9, "Q5_1"},    {10, "Q2_K"},   {11, "Q3_K_S"}, {12, "Q3_K_M"},
      {13, "Q3_K_L"}, {14, "Q4_K_S"}, {15, "Q4_K_M"}, {16, "Q5_K_S"}, {17, "Q5_K_M"},
      {18, "Q6_K"},   {32, "BF16"},
  };
  auto it = names.find(ft);
  return it == names.end() ? "unknown" : it->second;
}

// Reads the model description; the first bad metadata value becomes the error.
class Describer {
 public:
  explicit Describer(const kv::GgufFile& f) : f_(f) {}

  kv::Result<Json> run() {
    Json j;
    j["path"] = f_.path();
    j["file_size"] = f_.file_size();
    j["gguf_version"] = f_.version();
    j["alignment"] = f_.alignment();
    const std::string arch = str("general.architecture", "");
    j["architecture"] = arch;
    j["name"] = str("general.name", "");
    const std::string p = arch + ".";

    const int64_t n_layer = integer(p + "block_count", 0);
    const int64_t n_embd = integer(p + "embedding_length", 0);
    const int64_t n_head = per_layer_max(p + "attention.head_count", n_layer);
    std::vector<int64_t> n_head_kv = per_layer(p + "attention.head_count_kv", n_layer, n_head);
    const int64_t head_dim = integer(p + "attention.key_length", n_head > 0 ? n_embd / n_head : 0);
    const int64_t head_dim_v = integer(p + "attention.value_length", head_dim);
    const int64_t kv_lora_rank = integer(p + "attention.kv_lora_rank", 0);
    const int64_t rope_dim = integer(p + "rope.dimension_count", head_dim);
    const int64_t sliding_window = integer(p + "attention.sliding_window", 0);
    int64_t kv_max = 0;
    for (int64_t h : n_head_kv) kv_max = std::max(kv_max, h);
    const bool kv_uniform = std::all_of(n_head_kv.begin(), n_head_kv.end(), [&](int64_t h) { return h == kv_max; });

    Json hp;
    hp["n_layer"] = n_layer;
    hp["n_embd"] = n_embd;
    hp["n_ff"] = per_layer_max(p + "feed_forward_length", n_layer);
    hp["n_head"] = n_head;
    if (kv_uniform) hp["n_head_kv"] = kv_max;
    else hp["n_head_kv"] = n_head_kv;
    hp["head_dim"] = head_dim;
    if (head_dim_v != head_dim) hp["head_dim_v"] = head_dim_v;
    hp["rope_freq_base"] = number(p + "rope.freq_base", 10000.0);
    hp["rope_dim"] = rope_dim;
    hp["rms_eps"] = number(p + "attention.layer_norm_rms_epsilon", 0.0);
    hp["context_length"] = integer(p + "context_length", 0);
    hp["sliding_window"] = sliding_window > 0 ? Json(sliding_window) : Json(nullptr);
    if (kv_lora_rank > 0) hp["kv_lora_rank"] = kv_lora_rank;
    j["hparams"] = hp;

    Json att;
    if (kv_lora_rank > 0) {
      att["variant"] = "MLA";
    } else if (!kv_uniform) {
      att["variant"] = "per-layer";
    } else if (kv_max == n_head) {
      att["variant"] = "MHA";
    } else if (kv_max == 1) {
      att["variant"] = "MQA";
      att["group_size"] = n_head;
    } else {
      att["variant"] = "GQA";
      if (kv_max > 0) att["group_size"] = n_head / kv_max;
    }
    j["attention"] = att;

    // K and V values per token summed over layers; MLA caches one latent + rope key instead.
    int64_t elems_per_token = 0;
    if (kv_lora_rank > 0) {
      elems_per_token = n_layer * (kv_lora_rank + rope_dim);
    } else {
      for (int64_t h : n_head_kv) elems_per_token += h * (head_dim + head_dim_v);
    }
    Json kvb;
    auto bytes = [&](int64_t half_bytes_per_elem) {
      int64_t half = elems_per_token * half_bytes_per_elem;
      return half % 2 == 0 ? Json(half / 2) : Json(half / 2.0);
    };
    kvb["f32"] = bytes(8);
    kvb["f16"] = bytes(4);
    kvb["bf16"] = bytes(4);
    kvb["fp8"] = bytes(2);
    kvb["int8"] = bytes(2);
    kvb["int4"] = bytes(1);
    j["kv_bytes_per_token"] = kvb;
    // What kvserve's pages really take per token (pages of 16, scales and zero points
    // included; see kernels/kv_tile.h), for every --kv-cache-dtype.
    if (kv_lora_rank == 0 && head_dim == head_dim_v && head_dim % 16 == 0) {
      Json pb;
      for (int e = 0; e < kv::kKvElemCount; ++e) {
        const auto el = static_cast<kv::KvElem>(e);
        int64_t b = 0;
        for (int64_t h : n_head_kv) b += h * (kv::kv_k_tile_bytes(el, 16, int(head_dim)) + kv::kv_v_tile_bytes(el, 16, int(head_dim)));
        pb[kv::kv_elem_name(el)] = b % 16 == 0 ? Json(b / 16) : Json(b / 16.0);
      }
      j["kv_page_bytes_per_token"] = pb;
    }

    const int64_t ft = integer("general.file_type", -1);
    j["file_type"] = ft >= 0 ? Json(file_type_name(ft)) : Json(nullptr);
    Json types = Json::object();
    std::map<std::string, std::pair<int64_t, uint64_t>> hist;  // name -> (count, bytes)
    uint64_t total = 0;
    for (const auto& t : f_.tensors()) {
      auto& e = hist[kv::type_name(t.type)];
      ++e.first;
      e.second += t.n_bytes;
      total += t.n_bytes;
    }
    for (const auto& [name, e] : hist) types[name] = {{"count", e.first}, {"bytes", e.second}};
    j["tensors"] = {{"count", f_.tensors().size()}, {"total_bytes", total}, {"by_type", types}};

    Json tok;
    tok["model"] = str("tokenizer.ggml.model", "");
    tok["pre"] = str("tokenizer.ggml.pre", "");
    const kv::GgufValue* tokens = f_.find("tokenizer.ggml.tokens");
    tok["vocab_size"] = tokens && tokens->type == kv::GgufType::ARRAY ? tokens->arr.size() : 0;
    j["tokenizer"] = tok;
    const kv::GgufValue* tmpl = f_.find("tokenizer.chat_template");
    j["chat_template"] = {{"present", tmpl != nullptr}, {"length", tmpl ? tmpl->str.size() : 0}};

    if (!err_.empty()) return kv::Result<Json>::error(err_);
    return j;
  }

 private:
  void fail(const std::string& msg) {
    if (err_.empty()) err_ = msg;
  }
  std::string str(const std::string& key, const std::string& dflt) {
    auto r = f_.get_string(key, dflt);
    if (!r) fail(r.message());
    return r ? r.value() : dflt;
  }
  int64_t integer(const std::string& key, int64_t dflt) {
    auto r = f_.get_int(key, dflt);
    if (!r) fail(r.message());
    return r ? r.value() : dflt;
  }
  double number(const std::string& key, double dflt) {
    auto r = f_.get_float(key, dflt);
    if (!r) fail(r.message());
    return r ? r.value() : dflt;
  }
  // A hyperparameter that is either one number or one number per layer (e.g. OpenELM).
  std::vector<int64_t> per_layer(const std::string& key, int64_t n_layer, int64_t dflt) {
    const kv::GgufValue* v = f_.find(key);
    if (v && v->type == kv::GgufType::ARRAY) {
      std::vector<int64_t> out;
      for (const auto& e : v->arr) {
        if (!e.is_int()) {
          fail("metadata '" + key + "' should be numbers, holds " + kv::gguf_type_name(e.type));
          return {};
        }
        out.push_back(e.i);
      }
      if (static_cast<int64_t>(out.size()) != n_layer)
        fail("metadata '" + key + "' has " + std::to_string(out.size()) + " entries for " +
             std::to_string(n_layer) + " layers");
      return out;
    }
    int64_t x = integer(key, dflt);
    // n_layer comes from the file: cap what a hostile value may allocate.
    return std::vector<int64_t>(static_cast<size_t>(std::clamp<int64_t>(n_layer, 0, 1 << 16)), x);
  }
  int64_t per_layer_max(const std::string& key, int64_t n_layer) {
    int64_t m = 0;
    for (int64_t x : per_layer(key, n_layer, 0)) m = std::max(m, x);
    return m;
  }

  const kv::GgufFile& f_;
  std::string err_;
};


std::string show(const Json& v) {
  if (v.is_string()) return one_line(v.get<std::string>());
  if (v.is_null()) return "none";
  if (v.is_number_float()) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "%g", v.get<double>());
    return buf;
  }
  return v.dump(-1, ' ', false, Json::error_handler_t::replace);
}

void print_text(const Json& j) {
  const Json& hp = j["hparams"];
  const Json& att = j["attention"];
  std::printf("file            %s (%s, GGUF v%s, alignment %s)\n", show(j["path"]).c_str(),
              kv::format_bytes(j["file_size"].get<double>()).c_str(), show(j["gguf_version"]).c_str(),
              show(j["alignment"]).c_str());
  std::printf("architecture    %s\n", show(j["architecture"]).c_str());
  std::printf("name            %s\n", show(j["name"]).c_str());
  std::printf("hyperparameters\n");
  for (const auto& [k, v] : hp.items()) std::printf("  %-15s %s\n", k.c_str(), show(v).c_str());
  std::string variant = show(att["variant"]);
  if (att.contains("group_size")) variant += " (group size " + show(att["group_size"]) + ")";
  std::printf("attention       %s\n", variant.c_str());
  std::printf("KV bytes/token ");
  for (const auto& [k, v] : j["kv_bytes_per_token"].items()) std::printf(" %s=%s", k.c_str(), show(v).c_str());
  std::printf("\n");
  if (j.contains("kv_page_bytes_per_token")) {
    std::printf("KV page bytes/token (kvserve pages of 16, scales included)\n               ");
    for (const auto& [k, v] : j["kv_page_bytes_per_token"].items()) std::printf(" %s=%s", k.c_str(), show(v).c_str());
    std::printf("\n");
  }
  const Json& t = j["tensors"];
  std::printf("file type       %s\n", show(j["file_type"]).c_str());
  std::printf("tensors         %s, %s of weights\n", show(t["count"]).c_str(),
              kv::format_bytes(t["total_bytes"].get<double>()).c_str());
  for (const auto& [name, e] : t["by_type"].items())
    std::printf("  %-6s %5s tensors  %s\n", name.c_str(), show(e["count"]).c_str(),
                kv::format_bytes(e["bytes"].get<double>()).c_str());
  const Json& tok = j["tokenizer"];
  std::printf("tokenizer       %s (pre: %s), vocab %s\n", show(tok["model"]).c_str(), show(tok["pre"]).c_str(),
              show(tok["vocab_size"]).c_str());
  if (j["chat_template"]["present"].get<bool>())
    std::printf("chat template   yes (%s chars)\n", show(j["chat_template"]["length"]).c_str());
  else
    std::printf("chat template   no\n");
  const Json& k = j["kernels"];
  std::string cpu;
  for (const auto& x : k["cpu"]) cpu += (cpu.empty() ? "" : ", ") + x.get<std::string>();
  std::printf("kernels         %s (this CPU runs: %s; KV_ISA=scalar|avx2|avx512 lowers the choice)%s\n",
              show(k["isa"]).c_str(), cpu.c_str(),
              k["amx"].get<bool>() ? "; batched matmuls on AMX tiles (KV_AMX=0 turns that off)" : "");
}

// The kernel ISA the other commands would use here, and every one this CPU can run.
Json kernels_description() {
  Json cpu = Json::array();
  for (kv::Isa isa : {kv::Isa::kScalar, kv::Isa::kAvx2, kv::Isa::kAvx512})
    if (kv::cpu_has(isa)) cpu.push_back(kv::isa_name(isa));
  const kv::Isa isa = kv::detect_isa();
  return {{"isa", kv::isa_name(isa)}, {"cpu", cpu}, {"amx", isa == kv::Isa::kAvx512 && kv::amx_enabled()}};
}

[[noreturn]] void fail_cli(const std::string& msg) {
  std::fprintf(stderr, "kvserve inspect: %s\n", one_line(msg).c_str());
  throw CLI::RuntimeError(1);
}

}  // namespace

void add_inspect_command(CLI::App& app) {
  struct Opts {
    std::string path = kDefaultModel;
    bool json = false;
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand("inspect", "describe a GGUF model: hyperparameters, tensors, KV cost per token");
  cmd->add_option("-m,--model", opts->path, "GGUF model file")->capture_default_str();
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->callback([opts] {
    std::string hint = missing_model_hint(opts->path);
    if (!hint.empty()) fail_cli(hint);
    auto file = kv::GgufFile::open(opts->path);
    if (!file) fail_cli(file.message());
    auto desc = Describer(**file).run();
    if (!desc) fail_cli(opts->path + ": " + desc.message());
    (*desc)["kernels"] = kernels_description();
    if (opts->json)
      std::printf("%s\n", desc->dump(2, ' ', false, Json::error_handler_t::replace).c_str());
    else
      print_text(*desc);
  });
}

}  // namespace kvtools
