// Chat templates: the Jinja program a GGUF carries in `tokenizer.chat_template`, rendered the way
// transformers' apply_chat_template renders it (jinja2 ImmutableSandboxedEnvironment with trim_blocks and
// lstrip_blocks, HF's tojson, raise_exception, namespace, loop controls) — byte for byte on the golden cases
// in tests/data/chat_template/cases.json (made by tests/chat_template/make_cases.py).
//
// Supported Jinja: {{ }}, {% %}, {# #}, whitespace control (-/+), raw; for (tuple unpacking, `if` filter,
// else, loop.index/index0/revindex/first/last/length/previtem/nextitem/cycle, break/continue), if/elif/else,
// set (names, tuples, namespace attributes, block set), macro, filter blocks, with, HF's generation block;
// literals, arithmetic, comparison, `in`, and/or/not, ternary, ~, indexing, attributes, slicing; the filters,
// tests, str/dict methods and globals listed in jinja_builtins.cpp. Anything else is a parse error naming
// the line and column, never a silent mis-render.
//
// Templates come from model files, so they are untrusted: parsing and rendering are bounded (nesting depth,
// evaluation steps, output size) and fail with an error instead of crashing or hanging.
//
// Thread safety: a parsed ChatTemplate is immutable; render() may be called from many threads at once.
#pragma once
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

#include "common/status.h"

namespace kv {

class GgufFile;

namespace jinja {
struct Template;
}

struct ChatMessage {
  std::string role;
  std::string content;
  // Content given as text parts: content is their join with "\n", and a template that loops over
  // a message's content (iterates_content()) is given the parts as [{"type": "text", "text": ...}]
  // instead: vLLM's "string" and "openai" content formats.
  std::vector<std::string> parts = {};
  // Members the template sees beside role and content, as the client gave them (an object, or
  // null): an assistant turn's tool_calls, a tool result's tool_call_id.
  nlohmann::ordered_json extra = nullptr;
  // Content was given as a list of parts, even an empty one: a template that loops over content
  // gets the list ([] included; Gemma 3's then fails on a system message's [0], as transformers'
  // rendering does), not the empty text.
  bool given_as_parts = false;
};

class ChatTemplate {
 public:
  // Parses a template. A syntax error's message names its position: "... at line L, column C".
  static Result<ChatTemplate> parse(const std::string& source);

  // Renders `msgs` with add_generation_prompt, bos_token, eos_token and the members of `extra` (a JSON
  // object: tools, documents, date_string, enable_thinking, ...) as template variables. As in transformers,
  // `tools` and `documents` are None unless `extra` sets them.
  // Errors: a template's raise_exception("msg") returns exactly "msg" (the template's own words, fit for a
  // 400 response); any other failure returns "chat template error at line L, column C: Kind: what".
  Result<std::string> render(const std::vector<ChatMessage>& msgs, bool add_generation_prompt,
                             const std::string& bos_token, const std::string& eos_token,
                             const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  // Same, with messages as JSON objects passed through unchanged (content may be a string, null, or a list
  // of {"type": "text", "text": ...} parts; tool_calls, name, ... are visible to the template). ordered_json
  // keeps key order, which tojson output depends on.
  Result<std::string> render_json(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                  const std::string& bos_token, const std::string& eos_token,
                                  const nlohmann::ordered_json& extra = nlohmann::ordered_json::object()) const;

  const std::string& source() const { return source_; }
  // Whether the template loops over a message's content (`for item in message['content']`), so
  // takes content as a list of parts, as vLLM detects it.
  bool iterates_content() const { return iterates_content_; }

 private:
  ChatTemplate() = default;
  std::string source_;
  bool iterates_content_ = false;
  std::shared_ptr<const jinja::Template> tmpl_;
};

// The templates compiled into the binary (templates/*.jinja), by name: "chatml", "gemma3".
std::vector<std::string> builtin_chat_template_names();

// What `--chat-template SPEC` names, as vLLM's --chat-template and llama.cpp's --chat-template(-file)
// take it: a built-in name, else a readable file, else (if it holds "{{" or "{%") the template itself.
// Errors start with SPEC (a file or a name) or "(taken as the template itself)"; callers prefix their
// option's name.
Result<ChatTemplate> load_chat_template(const std::string& spec);

// The chat template a front end uses: `spec` when it is not empty (an error if it does not load), else
// the GGUF's tokenizer.chat_template, else none. A GGUF template that does not parse is not an error:
// *warning says why there is none (it is also set when the model simply has none).
Result<std::optional<ChatTemplate>> model_chat_template(const GgufFile& file, const std::string& spec,
                                                        std::string* warning);

}  // namespace kv
