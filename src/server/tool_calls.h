// Tool calling: OpenAI's `tools` and `tool_choice` on /v1/chat/completions, served as vLLM serves
// them (docs/structured_output.md, "Tool calling").
//
//   "none"     the tools go to the chat template (its `tools` variable, as transformers passes
//              them); the answer is text.
//   named      {"type": "function", "function": {"name": X}}: the answer keeps to X's `parameters`
//              schema (the structured-output compiler, engine/structured_output.h) and is one call
//              of X whose arguments are the generated text; finish_reason is the engine's
//              ("stop"), as OpenAI and vLLM report it for a named choice.
//   "required" the answer keeps to vLLM's schema: a JSON array of at least one
//              {"name": <a tool's name>, "parameters": <that tool's schema>}; each item is a call;
//              finish_reason "tool_calls" when it stopped.
//   "auto"     (the default when tools are given) only with --enable-auto-tool-choice
//              --tool-call-parser hermes, else a 400 with vLLM's message: the answer is free text,
//              parsed once written (parse_hermes_tool_calls); finish_reason "tool_calls" when it
//              holds a call.
//
// Request side (tool_request.cpp): parse_tool_list, parse_tool_choice, tool_constraint and
// parse_tool_calls_message throw ApiError naming the field. Response side (tool_output.cpp):
// ToolCallStream turns one choice's text into the message's content and tool_calls, whole or as
// stream deltas; the two are the same by construction (the whole is the stream fed at once).
#pragma once
#include <cstdint>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "engine/structured_output.h"

namespace kv {

struct ApiContext;
class Fields;

struct ToolChoice {
  enum class Kind { kNone, kNamed, kRequired, kAuto } kind = Kind::kNone;
  std::string name;             // kNamed: the function
  bool parallel = true;         // parallel_tool_calls: false makes "required" one call
};

// One of the request's tools (`tools[i]`, type "function").
struct ToolSpec {
  std::string name;
  // Its `parameters` schema, keys in the client's order; null when not given (a call then takes
  // an object with no properties, as vLLM's schema has it).
  nlohmann::ordered_json parameters;
  // What the chat template sees, as vLLM dumps a tool: {"type": "function", "function": {"name",
  // "description", "parameters", ...the client's other members}, ...}, absent members as null.
  nlohmann::ordered_json for_template;
};

// `tools`: absent or null → none. Each must be {"type": "function", "function": {"name": a
// non-empty string unique in the list, "description"?: string, "parameters"?: object}}; the
// list must not be empty (vLLM's rule). Parameters are checked for shape here and compiled only
// when a tool choice constrains the answer (tool_constraint).
std::vector<ToolSpec> parse_tool_list(const Fields& f);

// `tool_choice` (and `parallel_tool_calls`) against the tools, as vLLM checks them: absent with
// tools → "auto"; a choice other than "none" needs tools; a named function must be one of them;
// "auto" needs ctx.tool_call_parser (the router, ctx.constraints_forwarded, leaves it to its
// backends).
ToolChoice parse_tool_choice(const Fields& f, const std::vector<ToolSpec>& tools, const ApiContext& ctx);

// The constraint a named or "required" choice puts on the answer (kNone for "none" and "auto").
// any_whitespace: vLLM's structured_outputs.disable_any_whitespace, negated.
OutputConstraint tool_constraint(const ToolChoice& choice, const std::vector<ToolSpec>& tools, bool any_whitespace);
// The field a failed compile of tool_constraint's schema names: the tool whose parameters do not
// compile alone (compiling each; "tools" when each does).
std::string tool_compile_error_param(const ToolChoice& choice, const std::vector<ToolSpec>& tools, ConstraintCompiler& compiler);

// An assistant message's `tool_calls` (`name` = "messages[i].tool_calls") as the chat template
// sees them: [{"id"?, "type": "function", "function": {"name", "arguments": <object>}}], the
// arguments' JSON text parsed (vLLM's and transformers' templates read them as a mapping; an
// empty or null one is {}). An empty list is null (the template takes the plain assistant path).
nlohmann::ordered_json parse_tool_calls_message(const nlohmann::json& v, const std::string& name, const std::string& pointer);

// ---- response side

struct ToolCall {
  std::string id;         // "call_<24 hex>"
  std::string name;
  std::string arguments;  // JSON text
};

// The hermes format (Hermes 2 Pro, Qwen 2.5/3, SmolLM3): `<tool_call>{"name": ..., "arguments":
// {...}}</tool_call>`, as vLLM's hermes parser reads it: every tag's body (to its closing tag, or
// to the end of the text when it has none) must be a JSON object with a string "name" and an
// "arguments" member, else nothing is a call and the whole text is the content. With calls, the
// content is the text before the first tag (none when that is empty); text after a tag is
// dropped. Arguments are re-serialized as Python's json.dumps writes them (", " and ": "), as
// vLLM's are. Unlike vLLM's parser, a closing tag inside a JSON string does not end a call.
struct HermesResult {
  bool called = false;
  std::optional<std::string> content;
  std::vector<ToolCall> calls;  // ids empty
};
HermesResult parse_hermes_tool_calls(const std::string& text);

// One choice of a request with a tool choice: its text, pushed as it comes, becomes the response
// message's content and tool_calls, and the chunks' deltas, in vLLM's shapes (under "none" the
// text is the content, as without tools; the HTTP layer then keeps its plain text path):
//   named:    the first push opens the call ({"tool_calls": [{"index": 0, "id", "type":
//             "function", "function": {"name", "arguments": <text>}}]}), later pushes add
//             {"tool_calls": [{"index": 0, "function": {"arguments": <text>}}]};
//   required: a call opens once its name has been written, then its arguments' text streams;
//             the array's own brackets and separators are no one's text;
//   auto:     text streams as content until it may be starting a "<tool_call>" tag; from the
//             first tag on it is held, and at the end either becomes the calls (one delta each,
//             whole) or, if they do not parse, content.
// Not thread-safe; one per choice.
class ToolCallStream {
 public:
  explicit ToolCallStream(ToolChoice choice);
  ~ToolCallStream();
  ToolCallStream(ToolCallStream&&) noexcept;
  ToolCallStream& operator=(ToolCallStream&&) noexcept;

  // The deltas (a chat.completion.chunk's "delta" objects) this text releases; may be none.
  std::vector<nlohmann::ordered_json> push(const std::string& text);
  // At the choice's end: the last deltas; *finish_reason becomes what the response reports.
  std::vector<nlohmann::ordered_json> finish(std::string* finish_reason);
  // After finish: the whole response's message {"role", "content", "refusal", "tool_calls"?};
  // content is null when there are calls and no text beside them.
  nlohmann::ordered_json message() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace kv
