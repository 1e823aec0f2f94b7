// Reading the members of an OpenAI request body: typed, range-checked access (Fields) and the
// errors the request parsers throw (ApiError, naming the field). Shared by openai_request.cpp and
// tool_request.cpp; not for the HTTP layer, which calls the parsers.
//
// Per thread, what the last body parse_json_body read leaves behind: the literals of its integers
// beyond 64 bits (nlohmann parses them as doubles; a range error shows the client's own text), and
// the body's text when it may hold values whose key order matters (JSON schemas, tools), to read
// them back in the client's order (the parsed json sorts keys).
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>

#include "server/api_error.h"

namespace kv {

// parse_json_body, before it parses `body`: forgets the last body's literals and keeps this one's
// text if it may hold a schema or tools.
void begin_body(const std::string& body);
// parse_json_body's pass over the body: a number literal, noted if its value is an integer beyond 64 bits.
void note_number_literal(std::string_view text);

std::string type_word(const nlohmann::json& v);  // "a string", "an object", ...
[[noreturn]] void type_error(const std::string& name, const std::string& expected, const nlohmann::json& got);
[[noreturn]] void value_error(const std::string& name, const std::string& why);
[[noreturn]] void unsupported(const std::string& name, const std::string& why);

// How the client wrote the number v holds (v.dump() when it is not a literal of the last body).
std::string number_text(const nlohmann::json& v);
std::string num_text(double x);
// An integer literal beyond 64 bits parses as a decimal: refused as out of [lo, hi], not as a type.
void huge_integer_check(const std::string& name, const nlohmann::json& v, int64_t lo, int64_t hi);

// v as the client wrote it, keys in their order: the value at `pointer` (a JSON pointer,
// "/tools/0/function/parameters") in the last body read, if that body holds v there; else v.
// The body's ordered parse is made at the first call and kept (a request's tools read it once
// per tool) until OrderedBodyScope ends.
nlohmann::ordered_json in_client_order(const nlohmann::json& v, const std::string& pointer);

// Held by a request parser while it runs: at its end in_client_order's parse of the body is freed
// (a parsed 8 MiB body is several times that; one kept per HTTP thread adds up).
struct OrderedBodyScope {
  OrderedBodyScope() = default;
  OrderedBodyScope(const OrderedBodyScope&) = delete;
  OrderedBodyScope& operator=(const OrderedBodyScope&) = delete;
  ~OrderedBodyScope();
};

// A JSON schema given as an object or as its text: the text xgrammar compiles, with the keys in
// the client's order (an object's properties are generated in the order the schema lists them,
// as OpenAI and vLLM do: "reasoning" before "answer" is a choice the client made). pointer: where
// the schema sits in the request body. name: the field errors name.
std::string schema_text(const std::string& name, const nlohmann::json& v, const std::string& pointer);

// Typed, range-checked access to the members of one request object. A member that is absent
// or null counts as not given (OpenAI's clients send null for "default").
class Fields {
 public:
  explicit Fields(const nlohmann::json& o) : o_(o) {}

  const nlohmann::json* get(const char* name) const {
    auto it = o_.find(name);
    if (it == o_.end() || it->is_null()) return nullptr;
    return &*it;
  }
  std::optional<double> number(const char* name, double lo, double hi, bool lo_open = false) const;
  std::optional<int64_t> integer(const char* name, int64_t lo, int64_t hi) const;
  std::optional<bool> boolean(const char* name) const;
  std::optional<std::string> string(const char* name) const;
  // Present and not null, not false, not an empty string/array/object: the client asked for it.
  bool requested(const char* name) const;

 private:
  const nlohmann::json& o_;
};

}  // namespace kv
