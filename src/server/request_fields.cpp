#include "server/request_fields.h"

#include <cmath>
#include <cstdlib>
#include <limits>
#include <utility>
#include <vector>

namespace kv {

using nlohmann::json;

namespace {

// The number literals of the last body parse_json_body read on this thread whose value is an
// integer beyond 64 bits (nlohmann parses them as doubles), with that value: a range error shows
// the client's own text, not the double's (18446744073709551616 was "1.8446744073709552e+19").
// At most kMaxBigLiterals are kept; one not found shows as the double does.
constexpr size_t kMaxBigLiterals = 16;
std::vector<std::pair<double, std::string>>& big_literals() {
  thread_local std::vector<std::pair<double, std::string>> t;
  return t;
}

// A copy of the last body parse_json_body read on this thread, when it may hold a JSON schema
// (every field that takes one has "json" in its name), tools (whose parameters are schemas, and
// which a chat template prints in the client's order) or the Responses API's metadata (echoed as given): such values are taken from it in the
// client's key order (in_client_order), which the parsed object (keys sorted) has lost. A copy,
// not a view: a caller may parse a value after the body it came from is gone.
std::string& last_body() {
  thread_local std::string b;
  return b;
}

// last_body() parsed with its keys in order, made when first asked for (OrderedBodyScope frees it).
std::optional<nlohmann::ordered_json>& ordered_body() {
  thread_local std::optional<nlohmann::ordered_json> parsed;
  return parsed;
}

const nlohmann::ordered_json& last_body_ordered() {
  std::optional<nlohmann::ordered_json>& parsed = ordered_body();
  if (!parsed) parsed = nlohmann::ordered_json::parse(last_body(), nullptr, /*allow_exceptions=*/false);
  return *parsed;
}

bool beyond_64_bits(double d) { return std::isfinite(d) && d == std::floor(d) && std::fabs(d) >= 0x1p63; }

}  // namespace

OrderedBodyScope::~OrderedBodyScope() { ordered_body().reset(); }

void begin_body(const std::string& body) {
  big_literals().clear();
  ordered_body().reset();
  if (body.find("json") != std::string::npos || body.find("tool") != std::string::npos || body.find("metadata") != std::string::npos)
    last_body() = body;
  else last_body().clear();
}

void note_number_literal(std::string_view text) {
  if (text.size() < 19 && text.find_first_of("eE") == std::string_view::npos) return;  // within 64 bits
  if (big_literals().size() >= kMaxBigLiterals) return;
  const std::string s(text);
  char* end = nullptr;
  const double d = std::strtod(s.c_str(), &end);
  if (end == s.c_str() + s.size() && beyond_64_bits(d)) big_literals().emplace_back(d, s);
}

std::string type_word(const json& v) {
  switch (v.type()) {
    case json::value_t::string: return "a string";
    case json::value_t::boolean: return "a boolean";
    case json::value_t::number_integer:
    case json::value_t::number_unsigned: return "an integer";
    case json::value_t::number_float: return "a decimal";
    case json::value_t::array: return "an array";
    case json::value_t::object: return "an object";
    default: return "null";
  }
}

void type_error(const std::string& name, const std::string& expected, const json& got) {
  throw bad_request("Invalid type for '" + name + "': expected " + expected + ", but got " + type_word(got) + " instead.", name,
                    "invalid_type");
}

void value_error(const std::string& name, const std::string& why) {
  throw bad_request("Invalid value for '" + name + "': " + why, name, "invalid_value");
}

void unsupported(const std::string& name, const std::string& why) {
  throw bad_request("'" + name + "' is not supported by this server" + (why.empty() ? "." : ": " + why), name, "unsupported_parameter");
}

std::string number_text(const json& v) {
  if (v.is_number_float())
    for (const auto& [d, text] : big_literals())
      if (d == v.get<double>()) return text;
  return v.dump();
}

void huge_integer_check(const std::string& name, const json& v, int64_t lo, int64_t hi) {
  if (!v.is_number_float()) return;
  const double d = v.get<double>();
  if (beyond_64_bits(d))
    value_error(name, number_text(v) + (d > 0 ? " is above the maximum of " + std::to_string(hi) : " is below the minimum of " + std::to_string(lo)) + ".");
}

std::string num_text(double x) {
  if (std::isfinite(x) && x == std::floor(x) && std::fabs(x) < 1e15) return std::to_string(static_cast<long long>(x));
  return number_text(json(x));
}

nlohmann::ordered_json in_client_order(const json& v, const std::string& pointer) {
  const nlohmann::ordered_json& body = last_body_ordered();
  const nlohmann::ordered_json::json_pointer at(pointer);
  if (body.is_object() && body.contains(at)) {
    const nlohmann::ordered_json& found = body.at(at);
    if (json::parse(found.dump()) == v) return found;
  }
  return nlohmann::ordered_json::parse(v.dump());
}

std::string schema_text(const std::string& name, const json& v, const std::string& pointer) {
  using ordered = nlohmann::ordered_json;
  if (v.is_string()) {
    ordered parsed = ordered::parse(v.get<std::string>(), nullptr, /*allow_exceptions=*/false);
    if (parsed.is_discarded() || !(parsed.is_object() || parsed.is_boolean())) value_error(name, "is not a JSON schema (an object).");
    return parsed.dump();
  }
  if (!v.is_object() && !v.is_boolean()) type_error(name, "a JSON schema object", v);
  return in_client_order(v, pointer).dump();
}

std::optional<double> Fields::number(const char* name, double lo, double hi, bool lo_open) const {
  const json* v = get(name);
  if (!v) return std::nullopt;
  if (!v->is_number()) type_error(name, "a number", *v);
  double x = v->get<double>();
  if (!std::isfinite(x)) value_error(name, "must be a finite number.");
  if (lo_open ? !(x > lo) : !(x >= lo))
    value_error(name, num_text(x) + (lo_open ? " must be greater than " : " is below the minimum of ") + num_text(lo) + ".");
  if (x > hi) value_error(name, num_text(x) + " is above the maximum of " + num_text(hi) + ".");
  return x;
}

std::optional<int64_t> Fields::integer(const char* name, int64_t lo, int64_t hi) const {
  const json* v = get(name);
  if (!v) return std::nullopt;
  huge_integer_check(name, *v, lo, hi);
  if (!v->is_number_integer()) type_error(name, "an integer", *v);
  if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
    value_error(name, v->dump() + " is above the maximum of " + std::to_string(hi) + ".");
  int64_t x = v->get<int64_t>();
  if (x < lo) value_error(name, std::to_string(x) + " is below the minimum of " + std::to_string(lo) + ".");
  if (x > hi) value_error(name, std::to_string(x) + " is above the maximum of " + std::to_string(hi) + ".");
  return x;
}

std::optional<bool> Fields::boolean(const char* name) const {
  const json* v = get(name);
  if (!v) return std::nullopt;
  if (!v->is_boolean()) type_error(name, "a boolean", *v);
  return v->get<bool>();
}

std::optional<std::string> Fields::string(const char* name) const {
  const json* v = get(name);
  if (!v) return std::nullopt;
  if (!v->is_string()) type_error(name, "a string", *v);
  return v->get<std::string>();
}

bool Fields::requested(const char* name) const {
  const json* v = get(name);
  if (!v) return false;
  if (v->is_boolean()) return v->get<bool>();
  if (v->is_string() || v->is_array() || v->is_object()) return !v->empty();
  return true;
}

}  // namespace kv
