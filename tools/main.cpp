// kvserve: the command line over the kvserve library.
#include <sys/stat.h>

#include <cstdio>
#include <new>
#include <string>

#include <nlohmann/json.hpp>

#include "commands.h"
#include "kernels/isa.h"
#include "kv_version.h"
#include "server/http_util.h"

namespace kvtools {
std::string missing_model_hint(const std::string& path) {
  struct stat st {};
  if (stat(path.c_str(), &st) == 0) return "";
  std::string hint = "model file not found: " + path;
  if (path == kDefaultModel) hint += " (run `make models` to fetch it)";
  return hint;
}

std::vector<std::string> parse_allowed_origins(const std::string& s) {
  std::vector<std::string> out;
  const size_t first = s.find_first_not_of(" \t");
  if (first != std::string::npos && s[first] == '[') {
    nlohmann::json j = nlohmann::json::parse(s, nullptr, /*allow_exceptions=*/false);
    if (!j.is_array()) throw std::invalid_argument("'" + one_line(s) + "' is not a JSON list of strings");
    for (const auto& o : j) {
      if (!o.is_string() || o.get<std::string>().empty())
        throw std::invalid_argument("'" + one_line(s) + "' is not a JSON list of strings");
      out.push_back(o.get<std::string>());
    }
  } else {
    size_t i = 0;
    while (i <= s.size()) {
      size_t j = s.find(',', i);
      if (j == std::string::npos) j = s.size();
      std::string item = s.substr(i, j - i);
      item.erase(0, item.find_first_not_of(" \t"));
      item.erase(item.find_last_not_of(" \t") + 1);
      if (!item.empty()) out.push_back(item);
      i = j + 1;
    }
  }
  // Each one must be able to match a browser's Origin header (CORS compares them exactly): a
  // garbage value was accepted and allowed nothing, silently.
  for (const std::string& o : out)
    if (std::string why = kv::origin_problem(o); !why.empty()) throw std::invalid_argument(why);
  return out;
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
