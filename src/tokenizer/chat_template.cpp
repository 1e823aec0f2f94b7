#include "tokenizer/chat_template.h"

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
    return ct;
  } catch (const jinja::Error& e) {
    return Result<ChatTemplate>::error("chat template syntax error: " + std::string(e.what()));
  } catch (const std::exception& e) {
    return Result<ChatTemplate>::error(std::string("chat template syntax error: ") + e.what());
  }
}

Result<std::string> ChatTemplate::render(const std::vector<ChatMessage>& msgs, bool add_generation_prompt,
                                         const std::string& bos_token, const std::string& eos_token,
                                         const nlohmann::json& extra) const {
  jinja::Array arr;
  arr.reserve(msgs.size());
  for (const auto& m : msgs)
    arr.push_back(jinja::Value::object({{"role", jinja::Value(m.role)}, {"content", jinja::Value(m.content)}}));
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

}  // namespace kv
