// kvserve: the command line over the kvserve library.
#include <sys/stat.h>

#include <cstdio>
#include <cstring>
#include <new>
#include <string>

#include "commands.h"
#include "kernels/isa.h"
#include "kv_version.h"

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
  app.set_version_flag("--version", [] {
    return std::string("kvserve ") + KV_VERSION + ", kernels for this CPU: " + kv::isa_name(kv::detect_isa());
  });
  // CLI11 says only "A subcommand is required" for a word it does not know.
  if (argc > 1 && argv[1][0] != '-') {
    std::string names;
    bool known = false;
    for (const CLI::App* sub : app.get_subcommands([](const CLI::App*) { return true; })) {
      known = known || sub->check_name(argv[1]);
      names += (names.empty() ? "" : ", ") + sub->get_name();
    }
    if (!known) {
      std::fprintf(stderr, "kvserve: no command '%s' (the commands: %s; kvserve COMMAND --help)\n", argv[1], names.c_str());
      return 106;
    }
  }
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
