#include "tokenizer/chat_template.h"

#include <regex>

#include <sys/stat.h>

#include <fstream>
#include <sstream>

#include "builtin_chat_templates.h"
#include "gguf/gguf.h"
#include "tokenizer/jinja_interp.h"
#include "tokenizer/jinja_parser.h"

namespace kv {
namespace {

Result<std::string> render_values(const jinja::Template& t, jinja::Value messages, bool add_generation_prompt,
                                  const std::string& bos, const std::string& eos, const jinja::Value& extra) {
  if (!extra.is_object()) return Result<std::string>::error("chat template: extra variables must be a JSON object");
  std::vector<std::pair<std::string, jinja::Value>> globals;
  globals.emplace_back("messages", std::move(messages));
  globals.emplace_back("add_generation_prompt", jinja::Value(add_generation_prompt));
  globals.emplace_back("bos_token", jinja::Value(bos));
  globals.emplace_back("eos_token", jinja::Value(eos));
  globals.emplace_back("tools", jinja::Value::none());
  globals.emplace_back("documents", jinja::Value::none());
  for (const auto& kv : extra.obj()) globals.push_back(kv);
  jinja::Interp interp(t, jinja::Limits{});
  try {
    return interp.render(globals);
  } catch (const jinja::Error& e) {
    if (e.kind == "TemplateError") return Result<std::string>::error(e.what());
    return Result<std::string>::error("chat template error at " + jinja::describe_pos(t.source, interp.error_pos()) +
                                      ": " + e.kind + ": " + e.what());
  } catch (const std::bad_alloc&) {
    return Result<std::string>::error("chat template error: out of memory");
  } catch (const std::exception& e) {
    return Result<std::string>::error(std::string("chat template error: ") + e.what());
  }
}

}  // namespace

Result<ChatTemplate> ChatTemplate::parse(const std::string& source) {
  try {
    ChatTemplate ct;
    ct.source_ = source;
    ct.tmpl_ = jinja::parse_template(source);
    static const std::regex loops_over_content(R"(for\s+\w+\s+in\s+\w+\s*(\[\s*['"]content['"]\s*\]|\.content\b))");
    ct.iterates_content_ = std::regex_search(source, loops_over_content);
    return ct;
  } catch (const jinja::Error& e) {
    return Result<ChatTemplate>::error("chat template syntax error: " + std::string(e.what()));
  } catch (const std::exception& e) {
    return Result<ChatTemplate>::error(std::string("chat template syntax error: ") + e.what());
  }
}

Result<std::string> ChatTemplate::render(const std::vector<ChatMessage>& msgs, bool add_generation_prompt,
                                         const std::string& bos_token, const std::string& eos_token,
                                         const nlohmann::ordered_json& extra) const {
  jinja::Array arr;
  arr.reserve(msgs.size());
  for (const auto& m : msgs) {
    jinja::Object o;
    o.emplace_back("role", jinja::Value(m.role));
    if ((m.given_as_parts || !m.parts.empty()) && iterates_content_) {
      jinja::Array parts;
      for (const auto& p : m.parts) parts.push_back(jinja::Value::object({{"type", jinja::Value("text")}, {"text", jinja::Value(p)}}));
      o.emplace_back("content", jinja::Value::array(std::move(parts)));
    } else {
      o.emplace_back("content", jinja::Value(m.content));
    }
    if (m.extra.is_object())
      for (const auto& [key, v] : m.extra.items()) o.emplace_back(key, jinja::Value::from_json(v));
    arr.push_back(jinja::Value::object(std::move(o)));
  }
  return render_values(*tmpl_, jinja::Value::array(std::move(arr)), add_generation_prompt, bos_token, eos_token,
                       jinja::Value::from_json(extra));
}

Result<std::string> ChatTemplate::render_json(const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                              const std::string& bos_token, const std::string& eos_token,
                                              const nlohmann::ordered_json& extra) const {
  if (!messages.is_array()) return Result<std::string>::error("chat template: messages must be a JSON array");
  return render_values(*tmpl_, jinja::Value::from_json(messages), add_generation_prompt, bos_token, eos_token,
                       jinja::Value::from_json(extra));
}

std::vector<std::string> builtin_chat_template_names() {
  std::vector<std::string> names;
  for (const auto& t : builtin::k_chat_templates) names.emplace_back(t.name);
  return names;
}

Result<ChatTemplate> load_chat_template(const std::string& spec) {
  for (const auto& t : builtin::k_chat_templates)
    if (spec == t.name) return ChatTemplate::parse(t.source);
  const bool looks_inline = spec.find("{{") != std::string::npos || spec.find("{%") != std::string::npos;
  std::ifstream in(spec, std::ios::binary);
  if (!in) {
    if (looks_inline) {
      Result<ChatTemplate> t = ChatTemplate::parse(spec);
      if (!t) return Result<ChatTemplate>::error("(taken as the template itself) " + t.message());
      return t;
    }
    std::string names;
    for (const auto& n : builtin_chat_template_names()) names += (names.empty() ? "" : ", ") + n;
    return Result<ChatTemplate>::error(spec + ": no such file, and not a built-in template (" +
                                       names + ") nor a template (no {{ or {%)");
  }
  struct stat st {};
  if (stat(spec.c_str(), &st) != 0 || !S_ISREG(st.st_mode)) return Result<ChatTemplate>::error(spec + ": not a regular file");
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return Result<ChatTemplate>::error(spec + ": cannot read the file");
  if (text.str().find_first_not_of(" \t\r\n") == std::string::npos) return Result<ChatTemplate>::error(spec + ": the file is empty");
  Result<ChatTemplate> t = ChatTemplate::parse(text.str());
  if (!t) return Result<ChatTemplate>::error(spec + ": " + t.message());
  return t;
}

Result<std::optional<ChatTemplate>> model_chat_template(const GgufFile& file, const std::string& spec,
                                                        std::string* warning) {
  using R = Result<std::optional<ChatTemplate>>;
  if (!spec.empty()) {
    Result<ChatTemplate> t = load_chat_template(spec);
    if (!t) return R::error(t.message());
    return std::optional<ChatTemplate>(std::move(*t));
  }
  const GgufValue* src = file.find("tokenizer.chat_template");
  if (!src || src->str.empty()) {
    if (warning) *warning = "the model has no chat template (tokenizer.chat_template)";
    return std::optional<ChatTemplate>();
  }
  Result<ChatTemplate> t = ChatTemplate::parse(src->str);
  if (!t) {
    if (warning) *warning = "the model's chat template does not parse (" + t.message() + ")";
    return std::optional<ChatTemplate>();
  }
  return std::optional<ChatTemplate>(std::move(*t));
}

}  // namespace kv
