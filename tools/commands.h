// Each `kvserve <command>` lives in its own cmd_*.cpp and adds itself to the CLI here.
// Commands are thin: parse flags, call the library, print. Errors a user can act on go to
// stderr with a non-zero exit.
#pragma once
#include <CLI/CLI.hpp>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

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

// Numeric flag checks. CLI11's Range lets NaN through (every comparison with NaN is false), so
// `--temp nan` reached the sampler and hung or crashed it; and its PositiveNumber says "0 not in
// range 0 to 1.79…e308". These refuse anything that is not a finite number in [lo, hi].
inline CLI::Validator number_in(double lo, double hi, bool lo_open = false) {
  auto text = [](double v) {
    if (v >= 1e300) return std::string("∞");
    std::string t = std::to_string(v);
    t.erase(t.find_last_not_of('0') + 1);
    if (!t.empty() && t.back() == '.') t.pop_back();
    return t;
  };
  // No upper bound reads [lo, ∞): infinity itself is not a number a flag takes.
  const std::string range = (lo_open ? "(" : "[") + text(lo) + ", " + text(hi) + (hi >= 1e300 ? ")" : "]");
  return CLI::Validator(
      [lo, hi, lo_open, range](std::string& s) -> std::string {
        double v = 0;
        size_t used = 0;
        try {
          v = std::stod(s, &used);
        } catch (...) {
          used = 0;
        }
        if (used == 0 || used != s.size() || !std::isfinite(v)) return "'" + s + "' is not a finite number";
        if (v < lo || v > hi || (lo_open && v == lo)) return s + " is not in " + range;
        return std::string();
      },
      range);
}
inline CLI::Validator positive() { return number_in(0, 1e308, true); }
// A text flag that means nothing empty: `--api-key "$KEY"` with KEY unset started a server that
// refused every request (an empty key matches no header), `--served-model-name ""` an unnamed model.
inline CLI::Validator non_empty() {
  return CLI::Validator([](std::string& s) { return s.empty() ? std::string("must not be empty") : std::string(); }, "TEXT");
}
inline CLI::Validator non_negative() { return number_in(0, 1e308); }
// A 64-bit seed as written: [0, 2^64), and -1 (a random one) when minus_one. CLI11's uint64_t
// took -5 (wrapped) and 2^64 (as -1) silently.
inline CLI::Validator seed_number(bool minus_one) {
  return CLI::Validator(
      [minus_one](std::string& s) -> std::string {
        uint64_t v = 0;
        const auto [end, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
        if ((minus_one && s == "-1") || (ec == std::errc() && end == s.data() + s.size())) return "";
        return std::string("must be ") + (minus_one ? "-1 (a random seed) or " : "") + "an integer in [0, 18446744073709551615], got " + s;
      },
      "SEED");
}

// --allowed-origins (serve, router): vLLM's JSON list ('["*"]', '[]') or a comma-separated list.
// Throws std::invalid_argument (the message) on a malformed list.
std::vector<std::string> parse_allowed_origins(const std::string& s);
inline void add_allowed_origins_option(CLI::App* cmd, std::string* value) {
  cmd->add_option("--allowed-origins", *value,
                  "origins whose web pages may call the API (CORS), as vLLM's: '[\"*\"]' (any, the default), "
                  "'[\"http://localhost:3000\"]', or '[]' (none); a comma-separated list works too")
      ->capture_default_str()
      ->check([](const std::string& s) {
        try {
          parse_allowed_origins(s);
          return std::string();
        } catch (const std::invalid_argument& e) {
          return std::string(e.what());
        }
      });
}

}  // namespace kvtools
