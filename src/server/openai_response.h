// OpenAI response bodies: whole responses (chat.completion, text_completion) and the chunks
// of a Server-Sent Events stream (chat.completion.chunk, text_completion), in the shapes
// OpenAI's API returns, so the official clients parse them unchanged.
#pragma once
#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/request.h"

namespace kv {

class Tokenizer;

struct ResponseMeta {
  std::string id;       // "cmpl-…" or "chatcmpl-…"
  int64_t created = 0;  // unix seconds
  std::string model;
  bool chat = false;
  bool include_usage = false;  // streams: every chunk carries "usage": null, the last one the usage
  // vLLM's continuous_usage_stats: every chunk carries the usage so far instead of null
  // (prompt_tokens, completion_tokens streamed so far over all choices, total_tokens).
  bool continuous_usage = false;
  int32_t prompt_tokens = 0;
  bool echo = false;             // completions' echo: each choice begins with its prompt
  bool prompt_logprobs = false;  // vLLM's prompt_logprobs: per choice (completions) or per response (chat)
};

// One prompt of a request, for echo and prompt_logprobs.
struct PromptResult {
  std::vector<int32_t> ids;
  std::string text;                     // echo: as the client gave it (token ids: their text)
  std::vector<TokenLogprob> logprobs;   // the engine's kPrompt event: tokens 1..n-1
};

// One choice as the non-streaming response reports it, assembled from StreamEvents.
struct ChoiceResult {
  std::string text;
  std::vector<TokenLogprob> logprobs;
  std::string finish_reason;
  std::string stop_string;  // vLLM's stop_reason: the stop string, or the stop token id (-1: neither)
  int32_t stop_token = -1;
  int32_t prompt = 0;  // its prompt's index (completions' batch form: choice / n)
  // Chat under a tool choice: the message ToolCallStream made of the text (content, tool_calls).
  std::optional<nlohmann::ordered_json> message;
};

// Completions' logprobs.text_offset: the offset of each token in the choice's text in characters (code
// points, as OpenAI and vLLM count: Python's len), not bytes. A character split across tokens counts once
// its last byte has come, so a token that completes a character has the offset of that character.
struct TextOffset {
  int64_t chars = 0;  // characters complete so far
  std::string tail;   // the bytes of a character not complete yet
  void add(const std::string& bytes);
};

// A token's text where the API has a string: the text when its bytes are valid UTF-8 alone, else
// OpenAI's "bytes:\xe3\x81" form (so two byte tokens do not both become U+FFFD and collide as keys).
std::string logprob_token_string(const std::string& bytes);

nlohmann::ordered_json usage_json(const Usage& u);

// Chat's (and the Responses output_text's) logprob entries: [{"token", "logprob", "bytes",
// "top_logprobs": [{"token", "logprob", "bytes"}]}], control tokens spelled as their text.
nlohmann::ordered_json logprob_content(const std::vector<TokenLogprob>& lps, const Tokenizer& tok);

// The whole response. with_logprobs: the request asked for logprobs (else "logprobs": null).
// prompts: what meta.echo and meta.prompt_logprobs show (may be empty otherwise).
nlohmann::ordered_json full_response(const ResponseMeta& meta, const std::vector<ChoiceResult>& choices,
                                     const std::vector<PromptResult>& prompts, const Usage& usage, bool with_logprobs,
                                     const Tokenizer& tok);
// vLLM's prompt_logprobs: [null, {"<id>": {"logprob", "rank", "decoded_token"}, ...}, ...], one
// entry per prompt token (the prompt token's own, and the top k).
nlohmann::ordered_json prompt_logprobs_json(const PromptResult& p, const Tokenizer& tok);

// Streaming. text_offset: for completions' logprobs.text_offset, the choice's running offset
// (advanced by this call).
nlohmann::ordered_json chat_role_chunk(const ResponseMeta& meta, int32_t index);
nlohmann::ordered_json text_chunk(const ResponseMeta& meta, int32_t index, const std::string& text, const std::vector<TokenLogprob>* logprobs,
                          TextOffset* text_offset, const Tokenizer& tok);
// A chat chunk whose delta is given (a ToolCallStream's: tool calls, or content), with logprobs.
nlohmann::ordered_json delta_chunk(const ResponseMeta& meta, int32_t index, nlohmann::ordered_json delta,
                                   const std::vector<TokenLogprob>* logprobs, const Tokenizer& tok);
// A choice's first chunk when its prompt is shown (meta.echo, meta.prompt_logprobs): the echoed
// prompt (with its logprobs when with_logprobs), and prompt_logprobs when asked.
nlohmann::ordered_json prompt_chunk(const ResponseMeta& meta, int32_t index, const PromptResult& p, bool with_logprobs,
                                    TextOffset* text_offset, const Tokenizer& tok);
nlohmann::ordered_json finish_chunk(const ResponseMeta& meta, int32_t index, const std::string& reason,
                                    const nlohmann::ordered_json& stop_reason = nullptr);
// vLLM's stop_reason: the stop string that ended a choice, or its stop token id; else null.
nlohmann::ordered_json stop_reason_json(const std::string& stop_string, int32_t stop_token);
nlohmann::ordered_json usage_chunk(const ResponseMeta& meta, const Usage& usage);
// A chunk's usage so far, for continuous_usage_stats (meta.continuous_usage).
nlohmann::ordered_json running_usage(const ResponseMeta& meta, int64_t completion_tokens);

// "data: <json>\n\n"
std::string sse_event(const nlohmann::ordered_json& j);
inline constexpr const char* kSseDone = "data: [DONE]\n\n";

// "cmpl-<32 hex>" / "chatcmpl-<32 hex>"
std::string make_response_id(bool chat);

}  // namespace kv
