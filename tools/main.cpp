// kvserve: the command line over the kvserve library.
#include <sys/stat.h>

#include <cstdio>
#include <new>

#include "commands.h"

namespace kvtools {
std::string missing_model_hint(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) return "";
  std::string hint = "model file not found: " + path;
  if (path == kDefaultModel) hint += " (run `make models` to fetch it)";
  return hint;
}
}  // namespace kvtools

int main(int argc, char** argv) {
  CLI::App app{"kvserve: a KV-cache-centred LLM inference engine for CPUs"};
  app.require_subcommand(1);
  kvtools::add_inspect_command(app);
  kvtools::add_generate_command(app);
  kvtools::add_bench_command(app);
  kvtools::add_serve_command(app);
  kvtools::add_kv_size_command(app);
  kvtools::add_perplexity_command(app);
  kvtools::add_router_command(app);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  } catch (const std::bad_alloc&) {  // a budget under MemAvailable can still not fit beside the rest
    std::fprintf(stderr, "error: out of memory: give a smaller --kv-cache-memory (or free memory)\n");
    return 1;
  }
  return 0;
}
