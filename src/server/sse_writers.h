// The wire formats of a streamed response (HttpServer::stream_sse): what the stream's start,
// each engine event and its end become. ChatSseWriter: chat and completions chunks per choice,
// the usage chunk, [DONE]. ResponsesSseWriter: the Responses API's typed events (no [DONE]),
// a finished response handed to the store. "" writes nothing (an empty chunk would end the body).
// One request's; not thread-safe.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/request.h"
#include "server/api_error.h"
#include "server/openai_response.h"
#include "server/responses_api.h"
#include "server/tool_calls.h"

namespace kv {

class Tokenizer;

class SseWriter {
 public:
  virtual ~SseWriter() = default;
  virtual std::string begin() = 0;
  virtual std::string event(StreamEvent& ev) = 0;
  // ended: why the server cut the request short (shutdown, deadline), if it did.
  virtual std::string end(const std::optional<ApiError>& ended, const Usage& usage) = 0;
};

// The engine's kPrompt event (index: its prompt's first choice, p * n) fills that prompt's
// logprobs; null for an index past the prompts.
const PromptResult* take_prompt(std::vector<PromptResult>& prompts, int32_t n_per_prompt, StreamEvent& ev);

// The chat and completions stream: chunks per choice, the usage chunk, [DONE].
class ChatSseWriter : public SseWriter {
 public:
  ResponseMeta meta;
  int32_t n = 1;                            // choices in all (prompts × n)
  bool with_logprobs = false;
  std::vector<TextOffset> text_offset;      // per choice, completions' logprobs.text_offset
  std::vector<std::string> finish_reasons;  // per choice, once finished
  int64_t completion_tokens = 0;            // streamed so far, every choice (continuous_usage_stats)
  std::vector<PromptResult> prompts;        // echo, prompt_logprobs
  int32_t n_per_prompt = 1;
  bool prompt_lp_events = false;            // the engine sends kPrompt (params.prompt_logprobs ≥ 0)
  std::vector<ToolCallStream> tools;        // per choice, under a tool choice other than "none"
  const Tokenizer* tok = nullptr;

  std::string begin() override;
  std::string event(StreamEvent& ev) override;
  std::string end(const std::optional<ApiError>& ended, const Usage& usage) override;

 private:
  // A choice's chunk; with continuous_usage_stats it carries the usage so far.
  std::string chunk(nlohmann::ordered_json j) const;
};

// The Responses stream (responses_api.h): typed events, no [DONE]; on_done gets a finished
// response (the store).
class ResponsesSseWriter : public SseWriter {
 public:
  // on_done: false when the response was not kept (its final event then says store false).
  ResponsesSseWriter(std::unique_ptr<ResponseBuilder> b, bool logprobs, std::function<bool(const ResponseBuilder&)> on_done);

  std::string begin() override;
  std::string event(StreamEvent& ev) override;
  std::string end(const std::optional<ApiError>& ended, const Usage& usage) override;

 private:
  std::unique_ptr<ResponseBuilder> builder_;
  bool logprobs_ = false;
  std::function<bool(const ResponseBuilder&)> on_done_;
  std::string last_events(std::vector<nlohmann::ordered_json> events);  // the final events, once on_done_ has run
  std::string finish_reason_;
  bool failed_ = false;
};

}  // namespace kv
