// OpenAI's Responses API (POST /v1/responses), served over the chat path as vLLM serves it: a
// Responses body becomes a chat request (messages rendered by the chat template, tools, tool
// choice, structured output, sampling), and the chat request's one choice becomes a Response
// object, whole or as a stream of typed events.
//
// Request side (responses_request.cpp): parse_responses_request checks the Responses shape,
// naming the offending field (input[2].content[0].type), builds the chat body from it (input
// items → messages; function_call → an assistant turn's tool_calls, function_call_output → a tool
// message; instructions → a system message first; flat function tools → chat tools; text.format →
// response_format; max_output_tokens → max_completion_tokens) and runs parse_chat_request on it,
// so everything the chat endpoint checks is checked the same way; its errors are renamed back to
// the Responses fields. truncation "auto" drops the oldest conversation items until the prompt
// and max_output_tokens fit max_model_len. Refused with a 400: background, prompt templates,
// conversation, reasoning with an effort or summary, tool types other than function, content
// other than text, reasoning and item_reference input items.
//
// Response side (responses_output.cpp): ResponseBuilder turns the choice's text into output items
// (a message with one output_text part, and/or function_call items through ToolCallStream) and
// the stream's events; the whole response is the stream fed at once, so the two agree.
//
// Thread-safe as the chat parser is (ApiContext is read-only); ResponseBuilder is one request's.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/request.h"
#include "server/openai_request.h"

namespace kv {

class Tokenizer;

// A finished response kept for GET /v1/responses/{id} and for previous_response_id
// (server/response_store.h).
struct StoredResponse {
  nlohmann::ordered_json response;                  // the Response object as it was returned
  std::vector<nlohmann::ordered_json> conversation;  // every input item of the chain, then this response's output items
  std::string tenant;                                // tenant_prefix of the API key that made it ("" without keys)
  std::string cache_salt;                            // the request's cache_salt: a continuation without one keeps it
  size_t n_input = 0;                                // conversation[0, n_input): the input items (the rest: its output)
};

// GET /v1/responses/{id}/input_items: one page of a stored response's input items (every item of
// its conversation before its own output, each with an id), OpenAI's list object. after / before:
// item ids (exclusive cursors in `order`); an id not among the items is a 400.
struct InputItemsQuery {
  int32_t limit = 20;  // 1..100
  bool ascending = false;
  std::string after, before;
};
nlohmann::ordered_json input_items_page(const StoredResponse& s, const InputItemsQuery& q);

// Finds a stored response for previous_response_id (the caller's tenant already applied); null:
// none. An empty function: the server stores nothing, previous_response_id is refused.
using PreviousLookup = std::function<std::shared_ptr<const StoredResponse>(const std::string& id)>;

struct ResponsesRequest {
  ApiRequest chat;                                   // the chat request it became (one choice)
  nlohmann::ordered_json settings;                   // the request's settings, echoed in the Response object
  std::vector<nlohmann::ordered_json> conversation;  // the previous response's conversation, then this input (items)
  bool store = true;
  bool logprobs = false;                             // include: ["message.output_text.logprobs"]
  std::string cache_salt;                            // as given (or inherited), before any tenant prefix
  std::string previous_response_id;
  int32_t n_dropped = 0;                             // truncation "auto": conversation items left out of the prompt
};

// `previous` looks previous_response_id up. storing: the server keeps responses (else store is
// echoed false and previous_response_id is a 400).
ResponsesRequest parse_responses_request(const nlohmann::json& body, const ApiContext& ctx, const PreviousLookup& previous);

// "resp_<32 hex>", "msg_<32 hex>", "fc_<32 hex>".
std::string make_item_id(const char* prefix);

// One response's output, from its choice's text as it comes. Events are the stream's (each with
// "type" and an increasing "sequence_number"); response() is the Response object at any time.
// Not thread-safe.
class ResponseBuilder {
 public:
  ResponseBuilder(const ResponsesRequest& r, std::string id, int64_t created_at, std::string model, const Tokenizer& tok);
  ~ResponseBuilder();
  ResponseBuilder(const ResponseBuilder&) = delete;
  ResponseBuilder& operator=(const ResponseBuilder&) = delete;

  std::vector<nlohmann::ordered_json> begin();  // response.created, response.in_progress
  // Text the choice produced, with its tokens' logprobs (used only when the request included them).
  std::vector<nlohmann::ordered_json> push(const std::string& text, const std::vector<TokenLogprob>& logprobs);
  // The choice ended with finish_reason ("length": status incomplete): the open items' done
  // events, then response.completed or response.incomplete.
  std::vector<nlohmann::ordered_json> finish(const std::string& finish_reason, const Usage& usage);
  // An error ended the response: the open items' done events (incomplete, with what they hold),
  // the "error" event and response.failed (with the usage so far when known).
  std::vector<nlohmann::ordered_json> fail(const ApiError& e, const Usage* usage = nullptr);

  const nlohmann::ordered_json& response() const;
  // The response's store field (false: the store did not keep it, though the request asked).
  void set_store(bool stored);
  const std::vector<nlohmann::ordered_json>& output() const;  // the output items so far

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// "event: <type>\ndata: <json>\n\n" for each event.
std::string responses_sse(const std::vector<nlohmann::ordered_json>& events);

// The Responses usage object: input_tokens (cached_tokens from the prefix cache), output_tokens
// (reasoning_tokens 0), total_tokens.
nlohmann::ordered_json responses_usage(const Usage& u);

}  // namespace kv
