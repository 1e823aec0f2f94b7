// Each `kvserve <command>` lives in its own cmd_*.cpp and adds itself to the CLI here.
// Commands are thin: parse flags, call the library, print. Errors a user can act on go to
// stderr with a non-zero exit.
#pragma once
#include <CLI/CLI.hpp>

namespace kvtools {

void add_inspect_command(CLI::App& app);
void add_generate_command(CLI::App& app);
void add_bench_command(CLI::App& app);
void add_serve_command(CLI::App& app);
void add_kv_size_command(CLI::App& app);
void add_perplexity_command(CLI::App& app);
void add_router_command(CLI::App& app);

// Default model path (the one `make models` fetches) and the hint printed when it is missing.
inline constexpr const char* kDefaultModel = "models/SmolLM2-135M-Instruct.Q4_1.gguf";
std::string missing_model_hint(const std::string& path);
// File strings are untrusted: error lines stay single-line and printable.
std::string one_line(const std::string& s);

}  // namespace kvtools
