// OpenAI request bodies → engine requests. Parsing is strict where a mistake would silently
// change what the client gets (types, ranges, unknown models, fields we do not support such
// as audio) and lenient where OpenAI's clients send harmless extras (user,
// metadata, store, ...). Tools and tool choices: server/tool_calls.h.
//
// Every function here throws ApiError (api_error.h) with the status, message and param the
// client should see; the HTTP layer catches it. Thread-safe: ApiContext is read-only.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/request.h"
#include "server/api_error.h"
#include "server/tool_calls.h"

namespace kv {

class Tokenizer;
class ChatTemplate;
struct Rejection;

struct ApiContext {
  const Tokenizer* tok = nullptr;
  const ChatTemplate* chat_template = nullptr;  // nullptr: the model has none; chat answers 400
  std::string bos_text, eos_text;               // template variables bos_token / eos_token
  std::vector<std::string> model_names;         // accepted `model` values; [0] is the served name
  int32_t n_served_names = 1;                    // model_names' first n: --served-model-name's (listed in /v1/models)
  int32_t max_model_len = 4096;
  int32_t max_n = 16;
  int32_t max_stop = 16;      // stop strings per request (OpenAI allows 4)
  int32_t max_logprobs = 20;  // logprobs / top_logprobs upper bound, as OpenAI
  int32_t max_nesting = 64;   // JSON nesting depth accepted in a body
  // The server's default KV policy evicts: requests may ask for more than max_model_len tokens
  // (the engine re-indexes past it, kv/kv_reindex.h), as may a request that sets such a policy.
  bool default_policy_evicts = false;
  // Tokens one sequence's KV can hold (the KV pool's pages × block size; 0: not known). A chat
  // request without max_tokens gets what is left of max_model_len after its prompt, as in vLLM,
  // but no more than this leaves (a server started with a KV cache smaller than one
  // max_model_len sequence refused every such request for pages it would need only if it ran that long).
  int64_t kv_capacity_tokens = 0;
  // A request's own chat_template runs untrusted code on an HTTP thread (bounded, but seconds of CPU
  // for a 100-byte body): only with --trust-request-chat-template, as vLLM.
  bool trust_request_chat_template = false;
  // Structured output (engine/structured_output.h): requests' constraints are compiled with it;
  // null: refused as unsupported, unless constraints_forwarded (the router: checked for shape
  // and passed on, the backend compiles).
  ConstraintCompiler* constraints = nullptr;
  bool constraints_forwarded = false;
  // vLLM's --tool-call-parser, given with --enable-auto-tool-choice ("hermes"); empty: tool_choice
  // "auto" (the default with tools) is refused, as vLLM refuses it without them. The router
  // (constraints_forwarded) passes "auto" on to its backends.
  std::string tool_call_parser;
};

// What the HTTP layer needs beyond the engine's Request.
struct ApiRequest {
  bool chat = false;
  // Token ids, ready for Engine::submit: one prompt, or several for a completions `prompt` in
  // OpenAI's batch form (a list of strings or of token-id lists). Each prompt is one engine
  // request of n choices; choice i of prompt p is the response's choice p * n + i.
  std::vector<std::vector<int32_t>> prompts;
  RequestParams params;
  bool stream = false;
  bool include_usage = false;   // stream_options.include_usage
  bool continuous_usage = false;  // stream_options.continuous_usage_stats (vLLM's), with include_usage
  bool logprobs = false;        // the response carries logprobs
  bool prompt_logprobs = false; // vLLM's prompt_logprobs field was given: the response carries them
  // Completions' echo: each choice begins with its prompt's text (prompt_texts[p]) and, with
  // logprobs, its prompt's tokens (params.prompt_logprobs is then set).
  bool echo = false;
  std::vector<std::string> prompt_texts;
  int32_t truncate_prompt_tokens = 0;  // vLLM's: > 0, a prompt keeps at most its last this many tokens
  // Chat: how each choice's text becomes the message (ToolCallStream); kNone: it is the content.
  ToolChoice tool_choice;
};

// The context of a model file at `model_path`: names accepted as `model` (the served names, or
// the file's stem, first; then the stem and the file name), the template's bos/eos texts.
// Several served names are aliases, as vLLM's --served-model-name a b: responses name the first.
ApiContext make_api_context(const Tokenizer& tok, const ChatTemplate* chat_template, const std::string& model_path,
                            const std::vector<std::string>& served_names, int32_t max_model_len, int32_t max_n);
inline ApiContext make_api_context(const Tokenizer& tok, const ChatTemplate* chat_template, const std::string& model_path,
                                   const std::string& served_name, int32_t max_model_len, int32_t max_n) {
  return make_api_context(tok, chat_template, model_path,
                          served_name.empty() ? std::vector<std::string>{} : std::vector<std::string>{served_name}, max_model_len, max_n);
}

// Parses a body as one JSON object. Rejects bodies that are not UTF-8, not JSON, nested
// deeper than ctx.max_nesting, or not an object.
nlohmann::json parse_json_body(const std::string& body, const ApiContext& ctx);

ApiRequest parse_completion_request(const nlohmann::json& body, const ApiContext& ctx);  // /v1/completions: one prompt or more
ApiRequest parse_chat_request(const nlohmann::json& body, const ApiContext& ctx);        // /v1/chat/completions

// What a client sees when Engine::submit refuses (429 has code rate_limit_exceeded), and when
// a request ends with an error event.
// chat: the request came as messages (the engine names the prompt 'messages'; completions call it 'prompt').
ApiError from_rejection(const Rejection& r, bool chat);
ApiError from_event(const StreamEvent& ev);

// /tokenize: {"prompt": text, "add_special_tokens": true} (vLLM's), {"content": text, "add_special":
// false, "parse_special": true, "with_pieces": false} (llama-server's), or {"messages": [...],
// "add_generation_prompt": true} (the chat template, as /v1/chat/completions, with its refusals)
// → token ids; "return_token_strs": true also asks for each id's vocabulary string (vLLM's).
// /detokenize: {"tokens": [ids]} → the ids, checked against the vocabulary (the handler renders
// special tokens, as vLLM and llama-server).
struct TokenizeRequest {
  std::vector<int32_t> ids;
  std::string text;  // messages: the rendered conversation (the ids' text)
  bool with_pieces = false;  // llama-server's: tokens as [{"id", "piece"}]
  bool token_strs = false;
};
TokenizeRequest parse_tokenize_request(const nlohmann::json& body, const ApiContext& ctx);
std::vector<int32_t> parse_detokenize_request(const nlohmann::json& body, const ApiContext& ctx);

// A speculative-decoding configuration in vLLM's shape (--speculative-config, and a request's
// "speculative" object): {"method": "ngram" | "suffix", "num_speculative_tokens": 5,
// "prompt_lookup_min": 2, "prompt_lookup_max": 4, "suffix_max_depth": 32, "suffix_min_prob":
// 0.1, "suffix_alpha": 1.0, "suffix_cache_tokens": 65536, "max_batch_tokens": 8, "draft_cost": 0.3}; fields not
// given keep their defaults. Throws ApiError (param = `param`) on unknown fields or bad values.
SpecConfig parse_spec_config(const nlohmann::json& v, const std::string& param);

// A seed for a request that did not give one: fresh per call, so n > 1 choices and repeated
// requests differ.
uint64_t random_seed();

}  // namespace kv
