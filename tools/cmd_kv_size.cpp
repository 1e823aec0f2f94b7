// `kvserve kv-size (-m PATH | --preset NAME) [--seq-len N] [--batch B] [--kv-cache-dtype D]
//                 [--scale-group G] [--json]`: what the KV cache costs, per layer group.
//
// The arithmetic lives in src/kv/kv_size.h; this file parses flags and prints. Errors (unknown
// preset, missing file, not a GGUF, missing metadata) are one line on stderr, exit 1.
#include <cstdio>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>

#include "commands.h"
#include "gguf/gguf.h"
#include "kv/kv_size.h"

namespace kvtools {

namespace {

using Json = nlohmann::ordered_json;

[[noreturn]] void fail_cli(const std::string& msg) {
  std::fprintf(stderr, "kvserve kv-size: %s\n", one_line(msg).c_str());
  throw CLI::RuntimeError(1);
}

// Whole bytes as an integer, otherwise (int4 and an odd count) a number with .5.
Json bytes_json(int64_t bits) {
  if (kv::bits_whole_bytes(bits)) return Json(bits / 8);
  return Json(kv::bits_to_bytes(bits));
}

const char* kUnitsNote = "bytes; human sizes use binary prefixes (1 KiB = 1024 bytes, 1 MiB = 1024^2, 1 GiB = 1024^3)";

std::string scales_note(const kv::KvSizeOptions& o) {
  if (!o.dtype.quantized) return "";
  if (o.scale_group > 0)
    return "includes one " + std::to_string(o.scale_bits) + "-bit scale per " + std::to_string(o.scale_group) +
           " elements of each K, V or latent row";
  return o.dtype.name + " counts bare elements only (" + std::to_string(o.dtype.bits) +
         " bits each); the scales a quantized page carries are excluded (add --scale-group N for one 16-bit scale per N elements)";
}

Json to_json(const kv::KvSizeSpec& spec, const std::string& source, const kv::KvSizeReport& r) {
  const auto& o = r.options;
  Json j;
  j["model"] = spec.name;
  j["source"] = source;
  j["architecture"] = spec.architecture;
  Json att;
  att["variant"] = spec.variant();
  att["n_head"] = spec.n_head;
  if (spec.group_size() > 0) att["group_size"] = spec.group_size();
  att["description"] = spec.variant_description();
  j["attention"] = att;
  j["n_layers"] = spec.n_layers();
  j["dtype"] = o.dtype.name;
  j["bits_per_element"] = o.dtype.bits;
  j["bytes_per_element"] = o.dtype.bits % 8 == 0 ? Json(o.dtype.bits / 8) : Json(o.dtype.bits / 8.0);
  j["quantized"] = o.dtype.quantized;
  j["scales_included"] = o.dtype.quantized && o.scale_group > 0;
  if (o.dtype.quantized && o.scale_group > 0) {
    j["scale_group"] = o.scale_group;
    j["scale_bytes_per_sequence"] = bytes_json(r.scale_bits_per_sequence);
  }
  j["seq_len"] = o.seq_len;
  j["batch"] = o.batch;
  Json groups = Json::array();
  for (const auto& g : r.groups) {
    Json x;
    x["kind"] = kv::kv_group_kind_name(g.group.kind);
    x["label"] = g.group.label();
    x["n_layers"] = g.group.n_layers;
    if (g.group.kind == kv::KvGroupKind::kLatent) {
      x["kv_lora_rank"] = g.group.latent_dim;
      x["rope_dim"] = g.group.rope_dim;
    } else {
      x["n_head_kv"] = g.group.n_head_kv;
      x["k_dim"] = g.group.k_dim;
      x["v_dim"] = g.group.v_dim;
    }
    x["window"] = g.group.kind == kv::KvGroupKind::kLocal ? Json(g.group.window) : Json(nullptr);
    x["tokens_kept"] = g.tokens_kept;
    x["values_per_token_per_layer"] = g.values_per_token_per_layer;
    x["bytes_per_token_per_layer"] = bytes_json(g.bits_per_token_per_layer);
    x["bytes_per_token"] = bytes_json(g.bits_per_token);
    x["bytes_per_sequence"] = bytes_json(g.bits_per_sequence);
    x["bytes_per_batch"] = bytes_json(g.bits_per_batch);
    groups.push_back(x);
  }
  j["groups"] = groups;
  Json t;
  t["bytes_per_token"] = bytes_json(r.bits_per_token);
  t["bytes_per_token_average"] = kv::bits_to_bytes(r.bits_per_sequence) / static_cast<double>(o.seq_len);
  t["bytes_per_sequence"] = bytes_json(r.bits_per_sequence);
  t["bytes_per_batch"] = bytes_json(r.bits_per_batch);
  j["total"] = t;
  j["units"] = kUnitsNote;
  std::string note = scales_note(o);
  j["notes"] = Json::array();
  if (!spec.notes.empty()) j["notes"].push_back(spec.notes);
  if (!note.empty()) j["notes"].push_back(note);
  return j;
}

void print_text(const kv::KvSizeSpec& spec, const std::string& source, const kv::KvSizeReport& r) {
  const auto& o = r.options;
  std::printf("model           %s (%s)\n", one_line(spec.name).c_str(), source.c_str());
  std::printf("architecture    %s, %lld layers\n", one_line(spec.architecture).c_str(),
              static_cast<long long>(spec.n_layers()));
  std::printf("attention       %s\n", spec.variant_description().c_str());
  std::string per_elem = o.dtype.bits % 8 == 0 ? std::to_string(o.dtype.bits / 8) : std::to_string(o.dtype.bits / 8.0).substr(0, 3);
  std::printf("KV dtype        %s, %s byte%s per element%s\n", o.dtype.name.c_str(), per_elem.c_str(),
              o.dtype.bits == 8 ? "" : "s", o.dtype.quantized && o.scale_group == 0 ? " (bare elements, scales excluded)" : "");
  std::printf("sequence        %s tokens, batch %s\n", kv::group_thousands(o.seq_len).c_str(),
              kv::group_thousands(o.batch).c_str());
  std::printf("units           %s\n", kUnitsNote);
  for (const auto& g : r.groups) {
    std::printf("\n");
    if (g.group.kind == kv::KvGroupKind::kLatent) {
      std::printf("%s: %lld layers x (%lld latent + %lld rope) = %lld values per token per layer\n",
                  g.group.label().c_str(), static_cast<long long>(g.group.n_layers),
                  static_cast<long long>(g.group.latent_dim), static_cast<long long>(g.group.rope_dim),
                  static_cast<long long>(g.values_per_token_per_layer));
    } else {
      std::printf("%s: %lld layers x %lld kv head%s x (K %lld + V %lld) = %lld values per token per layer\n",
                  g.group.label().c_str(), static_cast<long long>(g.group.n_layers),
                  static_cast<long long>(g.group.n_head_kv), g.group.n_head_kv == 1 ? "" : "s",
                  static_cast<long long>(g.group.k_dim), static_cast<long long>(g.group.v_dim),
                  static_cast<long long>(g.values_per_token_per_layer));
    }
    std::printf("  per token per layer   %s\n", kv::format_kv_bits(g.bits_per_token_per_layer).c_str());
    std::printf("  per token             %s\n", kv::format_kv_bits(g.bits_per_token).c_str());
    std::printf("  per sequence          %s  (%s tokens kept per layer)\n", kv::format_kv_bits(g.bits_per_sequence).c_str(),
                kv::group_thousands(g.tokens_kept).c_str());
    std::printf("  per batch             %s\n", kv::format_kv_bits(g.bits_per_batch).c_str());
  }
  std::printf("\ntotal (all layer groups)\n");
  std::printf("  per token             %s%s\n", kv::format_kv_bits(r.bits_per_token).c_str(),
              r.groups.size() > 1 ? "  (a token inside every window)" : "");
  if (r.groups.size() > 1) {
    const double avg = kv::bits_to_bytes(r.bits_per_sequence) / static_cast<double>(o.seq_len);
    char buf[64];
    std::snprintf(buf, sizeof buf, "%.1f", avg);
    std::printf("  per token, average    %s bytes (%s)  (per sequence / seq-len)\n", buf, kv::binary_size(avg).c_str());
  }
  std::printf("  per sequence          %s\n", kv::format_kv_bits(r.bits_per_sequence).c_str());
  std::printf("  per batch             %s\n", kv::format_kv_bits(r.bits_per_batch).c_str());
  if (!spec.notes.empty()) std::printf("note: %s\n", one_line(spec.notes).c_str());
  if (std::string n = scales_note(o); !n.empty()) std::printf("note: %s\n", n.c_str());
}

void print_presets(bool json) {
  if (json) {
    Json arr = Json::array();
    for (const auto& p : kv::kv_size_presets())
      arr.push_back({{"name", p.name}, {"aliases", p.aliases}, {"variant", p.spec.variant()}, {"description", p.description}});
    std::printf("%s\n", arr.dump(2).c_str());
    return;
  }
  for (const auto& p : kv::kv_size_presets()) {
    std::string names = p.name;
    for (const auto& a : p.aliases) names += ", " + a;
    std::printf("%-40s %s\n", names.c_str(), p.description.c_str());
  }
}

}  // namespace

void add_kv_size_command(CLI::App& app) {
  struct Opts {
    std::string path;
    std::string preset;
    int64_t seq_len = 4096;
    int64_t batch = 1;
    std::string dtype = "f16";
    int64_t scale_group = 0;
    bool json = false;
  };
  auto opts = std::make_shared<Opts>();
  CLI::App* cmd = app.add_subcommand(
      "kv-size", "KV cache bytes per token, per sequence and per batch, for each layer group of a model or preset");
  auto* m = cmd->add_option("-m,--model", opts->path, "GGUF model file");
  auto* p = cmd->add_option("--preset", opts->preset, "a known model shape (`--preset list` shows them)");
  m->excludes(p);
  p->excludes(m);
  cmd->add_option("--seq-len", opts->seq_len, "tokens per sequence")->capture_default_str();
  cmd->add_option("--batch", opts->batch, "sequences")->capture_default_str();
  cmd->add_option("--kv-cache-dtype", opts->dtype, "f32, f16, bf16, fp8_e4m3, fp8_e5m2, int8, int4")->capture_default_str();
  cmd->add_option("--scale-group", opts->scale_group,
                  "quantized dtypes: count one 16-bit scale per this many elements of each row (0 = bare elements)")
      ->capture_default_str();
  cmd->add_flag("--json", opts->json, "print one JSON object");
  cmd->callback([opts] {
    if (opts->preset == "list") {
      print_presets(opts->json);
      return;
    }
    if (opts->path.empty() && opts->preset.empty()) fail_cli("give -m PATH or --preset NAME (--preset list shows the presets)");
    auto dtype = kv::kv_size_dtype(opts->dtype);
    if (!dtype) fail_cli(dtype.message());

    kv::KvSizeSpec spec;
    std::string source;
    if (!opts->preset.empty()) {
      auto s = kv::kv_size_preset(opts->preset);
      if (!s) fail_cli(s.message());
      spec = *s;
      source = "preset";
    } else {
      std::string hint = missing_model_hint(opts->path);
      if (!hint.empty()) fail_cli(hint);
      auto file = kv::GgufFile::open(opts->path);
      if (!file) fail_cli(file.message());
      auto s = kv::kv_size_spec_from_gguf(**file);
      if (!s) fail_cli(opts->path + ": " + s.message());
      spec = *s;
      source = "gguf";
    }

    kv::KvSizeOptions o;
    o.seq_len = opts->seq_len;
    o.batch = opts->batch;
    o.dtype = *dtype;
    o.scale_group = opts->scale_group;
    auto r = kv::compute_kv_size(spec, o);
    if (!r) fail_cli(r.message());
    if (opts->json)
      std::printf("%s\n", to_json(spec, source, *r).dump(2, ' ', false, Json::error_handler_t::replace).c_str());
    else
      print_text(spec, source, *r);
  });
}

}  // namespace kvtools
