// Errors the OpenAI-compatible API answers with: an HTTP status and the body OpenAI sends,
//   {"error": {"message": ..., "type": ..., "param": ... | null, "code": ... | null}}
// Request parsing throws ApiError; the HTTP layer catches it at the handler boundary and
// writes it out. Nothing else in the server throws on purpose.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

namespace kv {

struct ApiError {
  int status = 400;
  std::string message;
  std::string type = "invalid_request_error";
  std::string param;  // empty: null
  std::string code;   // empty: null
  // Refused as longer than max_model_len allows (max_tokens alone past it, found by the parser
  // before the prompt reaches the engine): an admission refusal, so the server counts it as the
  // engine counts its own (kvserve:request_rejected_total{reason="invalid"}: Engine::count_rejection).
  bool too_long = false;

  nlohmann::ordered_json to_json() const {
    nlohmann::ordered_json e = {{"message", message}, {"type", type}, {"param", nullptr}, {"code", nullptr}};
    if (!param.empty()) e["param"] = param;
    if (!code.empty()) e["code"] = code;
    return nlohmann::ordered_json{{"error", e}};
  }
};

inline ApiError bad_request(std::string message, std::string param = "", std::string code = "") {
  return ApiError{400, std::move(message), "invalid_request_error", std::move(param), std::move(code)};
}

// OpenAI's 400 for a required field that is absent: "Missing required parameter: '<param>'.".
[[noreturn]] inline void missing_parameter(const std::string& param) {
  throw bad_request("Missing required parameter: '" + param + "'.", param, "missing_required_parameter");
}

// The error type OpenAI uses for a status (the openai client maps statuses to exceptions;
// the type is for humans and for clients that switch on it).
inline std::string error_type_for_status(int status) {
  if (status == 429) return "rate_limit_error";
  if (status >= 500) return "server_error";
  return "invalid_request_error";
}

// JSON text that never throws: invalid UTF-8 (a token that is half a character) becomes U+FFFD.
template <typename Json>
std::string dump_json(const Json& j) {
  return j.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace kv
