// The request side of the Responses API (responses_api.h): a Responses body → the chat request.
#include <algorithm>
#include <limits>

#include "server/request_fields.h"
#include "server/responses_api.h"

namespace kv {

using nlohmann::json;
using ordered = nlohmann::ordered_json;

namespace {

// A chat message built from the conversation, and the field it came from (for errors).
struct Built {
  ordered msg;
  std::string source;
};

// Characters of UTF-8 text (the body parsed as UTF-8): OpenAI's metadata limits count them, not
// bytes (64 'é' were refused; a black-box test).
size_t utf8_chars(const std::string& t) {
  size_t n = 0;
  for (unsigned char c : t) n += (c & 0xC0) != 0x80;
  return n;
}

// Runs fn; an error naming a bare field of the object at `prefix` (Fields names its own fields
// alone: 'text', 'arguments') names it in full, prefix.field, as the other errors do.
template <typename F>
auto under(const std::string& prefix, F&& fn) -> decltype(fn()) {
  try {
    return fn();
  } catch (ApiError& e) {
    if (!e.param.empty() && e.param.find_first_of(".[") == std::string::npos) {
      const std::string q = "'" + e.param + "'";
      if (size_t at = e.message.find(q); at != std::string::npos) e.message.replace(at, q.size(), "'" + prefix + "." + e.param + "'");
      e.param = prefix + "." + e.param;
    }
    throw;
  }
}

// One content part list or string → the chat content (a string, or text parts). output_text is an
// assistant's; images, files and audio are refused (a text-only model).
ordered message_content(const json& content, const std::string& role, const std::string& name) {
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) type_error(name, "a string or an array of content parts", content);
  if (content.empty()) value_error(name, "must not be an empty array.");
  ordered parts = ordered::array();
  for (size_t k = 0; k < content.size(); ++k) {
    const std::string pname = name + "[" + std::to_string(k) + "]";
    const json& part = content[k];
    if (!part.is_object()) type_error(pname, "an object", part);
    Fields pf(part);
    auto type = under(pname, [&] { return pf.string("type"); });
    if (!type) missing_parameter(pname + ".type");
    if (*type == "output_text" || *type == "refusal") {
      if (role != "assistant")
        value_error(pname + ".type", "'" + *type + "' parts are an assistant's output; a " + role + " message takes 'input_text'.");
    } else if (*type == "input_image" || *type == "input_file" || *type == "input_audio") {
      throw bad_request("Content part type '" + *type + "' is not supported: this server serves a text-only model.", pname + ".type",
                        "unsupported_parameter");
    } else if (*type != "input_text") {
      value_error(pname + ".type", "'" + *type + "'; expected 'input_text' (or, in an assistant message, 'output_text').");
    }
    const char* field = *type == "refusal" ? "refusal" : "text";
    auto text = under(pname, [&] { return pf.string(field); });
    if (!text) missing_parameter(pname + "." + field);
    parts.push_back({{"type", "text"}, {"text", *text}});
  }
  return parts;
}

// An input item as the conversation keeps it: the client's, type made explicit.
// Every item gets an id (GET /v1/responses/{id}/input_items lists them by it).
ordered normalized(const json& item, const std::string& pointer) {
  ordered o = in_client_order(item, pointer);
  if (!o.contains("type")) o["type"] = "message";
  if (!o.contains("id")) {
    const std::string type = o["type"].get<std::string>();
    o["id"] = make_item_id(type == "function_call" ? "fc" : type == "function_call_output" ? "fco" : "msg");
  }
  return o;
}

// Checks one input item (name: "input[i]"); throws naming the field.
void check_item_fields(const json& item, const std::string& name);

void check_item(const json& item, const std::string& name) {
  under(name, [&] { check_item_fields(item, name); });
}

void check_item_fields(const json& item, const std::string& name) {
  if (!item.is_object()) type_error(name, "an object (a message or a function call item)", item);
  Fields f(item);
  const std::string type = f.string("type").value_or("message");
  if (type == "message") {
    const json* role = f.get("role");
    if (!role) missing_parameter(name + ".role");
    if (!role->is_string()) type_error(name + ".role", "a string", *role);
    const std::string r = role->get<std::string>();
    if (r != "user" && r != "assistant" && r != "system" && r != "developer")
      value_error(name + ".role", "'" + r + "'. Supported roles: user, assistant, system, developer.");
    const json* content = f.get("content");
    if (!content) missing_parameter(name + ".content");
    message_content(*content, r, name + ".content");
  } else if (type == "function_call") {
    for (const char* k : {"call_id", "name", "arguments"}) {
      if (!f.get(k)) missing_parameter(name + "." + k);
      f.string(k);
    }
    if (f.string("name")->empty()) value_error(name + ".name", "must not be empty.");
    // arguments are opaque text to OpenAI and vLLM: a call cut short by max_output_tokens is the
    // server's own output, and its continuation must be taken (it was a 400; a user test).
    // JSON text reaches the template as its mapping, anything else as the text (to_messages).
  } else if (type == "function_call_output") {
    if (!f.get("call_id")) missing_parameter(name + ".call_id");
    f.string("call_id");
    const json* out = f.get("output");
    if (!out) missing_parameter(name + ".output");
    if (!out->is_string()) message_content(*out, "tool", name + ".output");
  } else if (type == "reasoning") {
    unsupported(name + ".type", "'reasoning' items: this model does not reason.");
  } else if (type == "item_reference") {
    unsupported(name + ".type", "'item_reference' items; send the item itself, or continue with previous_response_id.");
  } else {
    value_error(name + ".type", "'" + type + "'; expected 'message', 'function_call' or 'function_call_output'.");
  }
}

// The conversation's items from `from` on → chat messages (after the system message of the
// instructions). A function_call joins the assistant turn just before it (its text, or other
// calls), as a chat answer holds its content and its calls in one message.
void to_messages(const std::vector<ordered>& items, const std::vector<std::string>& sources, size_t from, std::vector<Built>* out) {
  for (size_t i = from; i < items.size(); ++i) {
    const ordered& it = items[i];
    const std::string type = it.value("type", "message");
    if (type == "message") {
      const std::string role = it.at("role").get<std::string>();
      out->push_back({{{"role", role}, {"content", message_content(json::parse(it.at("content").dump()), role, sources[i] + ".content")}},
                      sources[i]});
    } else if (type == "function_call") {
      // The chat parser takes JSON text; text that is not JSON goes as a JSON string of itself.
      std::string args = it.at("arguments").get<std::string>();
      if (!args.empty() && json::parse(args, nullptr, /*allow_exceptions=*/false).is_discarded()) args = json(args).dump();
      ordered call = {{"id", it.at("call_id")}, {"type", "function"}, {"function", {{"name", it.at("name")}, {"arguments", args}}}};
      if (!out->empty() && out->back().msg.at("role") == "assistant") {
        ordered& m = out->back().msg;
        if (!m.contains("tool_calls")) m["tool_calls"] = ordered::array();
        m["tool_calls"].push_back(std::move(call));
      } else {
        out->push_back({{{"role", "assistant"}, {"content", nullptr}, {"tool_calls", ordered::array({std::move(call)})}}, sources[i]});
      }
    } else {  // function_call_output
      const ordered& o = it.at("output");
      ordered content = o.is_string() ? o : message_content(json::parse(o.dump()), "tool", sources[i] + ".output");
      out->push_back({{{"role", "tool"}, {"tool_call_id", it.at("call_id")}, {"content", std::move(content)}}, sources[i]});
    }
  }
}

// A chat error's field, as the Responses request names it.
void rename_param(ApiError& e, const std::vector<Built>& msgs) {
  std::string p = e.param;
  auto replace_prefix = [&](const std::string& from, const std::string& to) {
    if (p.rfind(from, 0) != 0) return false;
    p = to + p.substr(from.size());
    return true;
  };
  if (p.rfind("messages[", 0) == 0) {
    const size_t close = p.find(']');
    const size_t k = static_cast<size_t>(std::stoul(p.substr(9, close - 9)));
    std::string rest = p.substr(close + 1);
    if (rest.rfind(".tool_calls", 0) == 0) rest.clear();  // the call items are named by the message's source
    if (rest.rfind(".tool_call_id", 0) == 0) rest = ".call_id";
    p = (k < msgs.size() ? msgs[k].source : "input") + rest;
  } else if (p.rfind("tools[", 0) == 0) {
    if (size_t at = p.find(".function"); at != std::string::npos) p.erase(at, 9);
  } else {
    replace_prefix("messages", "input") || replace_prefix("response_format", "text.format") ||
        replace_prefix("max_completion_tokens", "max_output_tokens") || replace_prefix("logprobs", "include");
  }
  if (p == e.param) return;
  if (p == "max_output_tokens")  // chat's hint about 0 (prompt_logprobs) is no Responses field's
    if (size_t at = e.message.find(" (0 only with"); at != std::string::npos) e.message.erase(at);
  const std::string q = "'" + e.param + "'";
  if (size_t at = e.message.find(q); at != std::string::npos) e.message.replace(at, q.size(), "'" + p + "'");
  e.param = p;
}

// Responses' flat function tools → chat tools ({"type": "function", "function": {...}}).
ordered chat_tools(const json& tools, ordered* echoed) {
  if (!tools.is_array()) type_error("tools", "an array of tools", tools);
  ordered out = ordered::array();
  for (size_t i = 0; i < tools.size(); ++i) {
    const std::string name = "tools[" + std::to_string(i) + "]";
    const json& t = tools[i];
    if (!t.is_object()) type_error(name, "an object", t);
    Fields tf(t);
    auto type = tf.string("type");
    if (!type) missing_parameter(name + ".type");
    if (*type != "function")
      unsupported(name + ".type", "only \"function\" tools are served (got \"" + *type + "\"); built-in tools (web search, file search, ...) are OpenAI's.");
    if (tf.get("function"))
      value_error(name, "the Responses API takes a function tool flat: {\"type\": \"function\", \"name\", \"parameters\"}, not under 'function'.");
    if (!tf.get("name")) missing_parameter(name + ".name");
    tf.string("name");
    if (const json* s = tf.get("strict"); s && !s->is_boolean()) type_error(name + ".strict", "a boolean", *s);
    ordered fn = in_client_order(t, "/tools/" + std::to_string(i));
    fn.erase("type");
    out.push_back({{"type", "function"}, {"function", fn}});
    ordered e = {{"type", "function"},
                 {"name", t.at("name")},
                 {"description", fn.contains("description") ? fn["description"] : ordered(nullptr)},
                 {"parameters", fn.contains("parameters") ? fn["parameters"] : ordered(nullptr)},
                 {"strict", fn.contains("strict") ? fn["strict"] : ordered(nullptr)}};
    echoed->push_back(std::move(e));
  }
  return out;
}

ordered chat_tool_choice(const json& v) {
  if (v.is_string()) return v.get<std::string>();  // checked by the chat parser
  if (!v.is_object()) type_error("tool_choice", "a string or an object", v);
  Fields f(v);
  const std::string type = f.string("type").value_or("");
  if (type != "function")
    unsupported("tool_choice", "only \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"name\": ...} are served (got type \"" + type + "\").");
  if (f.get("function")) value_error("tool_choice", "the Responses API names the function flat: {\"type\": \"function\", \"name\": \"my_function\"}.");
  auto name = f.string("name");
  if (!name) missing_parameter("tool_choice.name");
  return {{"type", "function"}, {"function", {{"name", *name}}}};
}

ordered chat_response_format(const json& text, ordered* echoed) {
  if (!text.is_object()) type_error("text", "an object", text);
  Fields tf(text);
  if (auto verbosity = tf.string("verbosity"); verbosity && *verbosity != "medium")
    unsupported("text.verbosity", "only \"medium\" (the default).");
  *echoed = {{"format", {{"type", "text"}}}};
  const json* fmt = tf.get("format");
  if (!fmt) return nullptr;
  if (!fmt->is_object()) type_error("text.format", "an object", *fmt);
  Fields ff(*fmt);
  auto type = ff.string("type");
  if (!type) missing_parameter("text.format.type");
  (*echoed)["format"] = in_client_order(*fmt, "/text/format");
  if (*type == "text") return nullptr;
  if (*type == "json_object") return {{"type", "json_object"}};
  if (*type != "json_schema") value_error("text.format.type", "'" + *type + "'; expected 'text', 'json_schema' or 'json_object'.");
  if (!ff.get("name")) missing_parameter("text.format.name");
  ff.string("name");
  const json* schema = ff.get("schema");
  if (!schema) missing_parameter("text.format.schema");
  if (!schema->is_object()) type_error("text.format.schema", "a JSON schema object", *schema);
  if (const json* s = ff.get("strict"); s && !s->is_boolean()) type_error("text.format.strict", "a boolean", *s);
  ordered js = {{"name", fmt->at("name")}, {"schema", in_client_order(*schema, "/text/format/schema")}};
  if (ff.get("strict")) js["strict"] = fmt->at("strict");
  return {{"type", "json_schema"}, {"json_schema", std::move(js)}};
}

void check_metadata(const json& m) {
  if (!m.is_object()) type_error("metadata", "an object of string values", m);
  if (m.size() > 16) value_error("metadata", "at most 16 keys, got " + std::to_string(m.size()) + ".");
  for (auto it = m.begin(); it != m.end(); ++it) {
    if (utf8_chars(it.key()) > 64) value_error("metadata", "key '" + it.key().substr(0, 64) + "...' is longer than 64 characters.");
    if (!it->is_string()) type_error("metadata." + it.key(), "a string", *it);
    if (utf8_chars(it->get<std::string>()) > 512) value_error("metadata." + it.key(), "is longer than 512 characters.");
  }
}

}  // namespace

ResponsesRequest parse_responses_request(const json& body, const ApiContext& ctx, const PreviousLookup& previous) {
  Fields f(body);
  OrderedBodyScope ordered_scope;  // tools, schemas and items keep the client's key order
  ResponsesRequest r;

  // A field this endpoint does not know is a 400, as OpenAI's (a constraint meant for the chat
  // endpoint, guided_regex or response_format, gave free text here: a black-box test).
  static const char* kKnown[] = {"model", "input", "instructions", "previous_response_id", "store", "stream", "stream_options",
                                 "temperature", "top_p", "seed", "max_output_tokens", "include", "top_logprobs", "tools",
                                 "tool_choice", "parallel_tool_calls", "max_tool_calls", "text", "metadata", "user",
                                 "safety_identifier", "prompt_cache_key", "service_tier", "cache_salt", "truncation", "reasoning",
                                 "background", "prompt", "conversation", "priority"};
  for (auto it = body.begin(); it != body.end(); ++it) {
    const std::string& key = it.key();  // (clang 14 captures no structured binding in a lambda)
    if (std::find_if(std::begin(kKnown), std::end(kKnown), [&](const char* k) { return key == k; }) != std::end(kKnown)) continue;
    std::string hint;
    if (key == "response_format") hint = " In the Responses API it is 'text.format'.";
    else if (key.rfind("guided_", 0) == 0 || key == "structured_outputs" || key == "grammar" || key == "json_schema")
      hint = " The Responses API constrains output with 'text.format' (json_schema or json_object); regex, choice and grammar constraints are served by /v1/chat/completions and /v1/completions.";
    throw ApiError{400, "Unknown parameter: '" + key + "'." + hint, "invalid_request_error", key, "unknown_parameter"};
  }
  // What this server does not do: refused, not ignored.
  if (const json* m = f.get("max_tool_calls"); m && !m->is_null())
    unsupported("max_tool_calls", "the number of tool calls is not capped here.");
  if (f.boolean("background").value_or(false))
    unsupported("background", "responses run while their request is open; stream them instead.");
  if (f.requested("prompt")) unsupported("prompt", "stored prompt templates are OpenAI's; send the input itself.");
  if (f.requested("conversation")) unsupported("conversation", "use previous_response_id to continue a conversation.");
  if (const json* re = f.get("reasoning")) {
    if (!re->is_object()) type_error("reasoning", "an object", *re);
    Fields rf(*re);
    if (rf.get("effort") && !(rf.string("effort") == std::string("none")))
      unsupported("reasoning.effort", "this model does not reason.");
    if (rf.requested("summary") || rf.requested("generate_summary")) unsupported("reasoning.summary", "this model does not reason.");
  }
  if (auto pr = f.integer("priority", std::numeric_limits<int32_t>::min(), std::numeric_limits<int32_t>::max()); pr && *pr != 0)
    unsupported("priority", "requests are scheduled first come, first served.");
  if (auto v = f.string("truncation"); v && *v != "auto" && *v != "disabled")
    value_error("truncation", "'" + *v + "'; expected 'auto' or 'disabled'.");
  const bool truncate = f.string("truncation").value_or("disabled") == "auto";

  ordered chat = ordered::object();
  if (const json* m = f.get("model")) chat["model"] = *m;
  for (const char* k : {"temperature", "top_p", "seed"})
    if (const json* v = f.get(k)) chat[k] = *v;
  chat["stream"] = f.boolean("stream").value_or(false);
  if (const json* v = f.get("max_output_tokens")) chat["max_completion_tokens"] = *v;

  // include: the output text's logprobs; reasoning's encrypted content is nothing here.
  if (const json* inc = f.get("include")) {
    if (!inc->is_array()) type_error("include", "an array of strings", *inc);
    for (size_t k = 0; k < inc->size(); ++k) {
      const std::string name = "include[" + std::to_string(k) + "]";
      if (!(*inc)[k].is_string()) type_error(name, "a string", (*inc)[k]);
      const std::string s = (*inc)[k].get<std::string>();
      if (s == "message.output_text.logprobs") r.logprobs = true;
      else if (s != "reasoning.encrypted_content") unsupported(name, "'" + s + "'; only 'message.output_text.logprobs' is served.");
    }
  }
  const auto top = f.integer("top_logprobs", 0, ctx.max_logprobs);
  if (r.logprobs) {
    chat["logprobs"] = true;
    chat["top_logprobs"] = top.value_or(0);
  }

  ordered echoed_tools = ordered::array();
  if (const json* t = f.get("tools")) {
    if (t->is_array() && t->empty()) {  // OpenAI's default: no tools
    } else {
      chat["tools"] = chat_tools(*t, &echoed_tools);
    }
  }
  if (const json* tc = f.get("tool_choice")) chat["tool_choice"] = chat_tool_choice(*tc);
  if (const json* p = f.get("parallel_tool_calls")) chat["parallel_tool_calls"] = *p;
  ordered echoed_text = {{"format", {{"type", "text"}}}};
  if (const json* t = f.get("text"))
    if (ordered rf = chat_response_format(*t, &echoed_text); !rf.is_null()) chat["response_format"] = std::move(rf);

  if (const json* m = f.get("metadata")) check_metadata(*m);
  f.string("user");
  if (const json* salt = f.get("cache_salt")) chat["cache_salt"] = *salt;
  const bool storing = static_cast<bool>(previous);
  r.store = f.boolean("store").value_or(true) && storing;  // a server that keeps nothing says so: store false (vLLM's way)

  // The conversation: the previous response's, then this input.
  std::vector<std::string> sources;
  std::shared_ptr<const StoredResponse> prev;
  if (auto id = f.string("previous_response_id")) {
    if (!storing)
      throw bad_request("previous_response_id needs stored responses, and this server keeps none (--max-stored-responses 0); send the whole conversation as input.",
                        "previous_response_id", "unsupported_parameter");
    prev = previous(*id);
    if (!prev) throw ApiError{404, "Previous response with id '" + *id + "' not found.", "invalid_request_error", "previous_response_id", "previous_response_not_found"};
    r.previous_response_id = *id;
    r.conversation = prev->conversation;
    sources.assign(r.conversation.size(), "previous_response_id");
    if (!f.get("cache_salt") && !prev->cache_salt.empty()) chat["cache_salt"] = prev->cache_salt;  // its pages are under that salt
  }
  const json* input = f.get("input");
  if (!input) missing_parameter("input");
  if (input->is_string()) {
    r.conversation.push_back({{"type", "message"}, {"role", "user"}, {"content", input->get<std::string>()}, {"id", make_item_id("msg")}});
    sources.push_back("input");
  } else if (input->is_array()) {
    if (input->empty()) value_error("input", "must not be an empty array.");
    for (size_t i = 0; i < input->size(); ++i) {
      const std::string name = "input[" + std::to_string(i) + "]";
      check_item((*input)[i], name);
      r.conversation.push_back(normalized((*input)[i], "/input/" + std::to_string(i)));
      sources.push_back(name);
    }
  } else {
    type_error("input", "a string or an array of input items", *input);
  }
  if (chat.contains("cache_salt") && chat["cache_salt"].is_string()) r.cache_salt = chat["cache_salt"].get<std::string>();

  // Read in the client's key order now: parsing the chat body below makes it the thread's last body.
  ordered echoed_choice = f.get("tool_choice") ? in_client_order(*f.get("tool_choice"), "/tool_choice") : ordered("auto");
  ordered echoed_metadata = f.get("metadata") ? in_client_order(*f.get("metadata"), "/metadata") : ordered::object();

  ordered system = nullptr;
  if (auto ins = f.string("instructions"); ins && !ins->empty()) system = {{"role", "system"}, {"content", *ins}};

  // The chat request of the conversation from item `from` on.
  std::vector<Built> msgs;
  auto build = [&](size_t from) {
    msgs.clear();
    if (!system.is_null()) msgs.push_back({system, "instructions"});
    to_messages(r.conversation, sources, from, &msgs);
    ordered body_out = chat;
    body_out["messages"] = ordered::array();
    for (const Built& b : msgs) body_out["messages"].push_back(b.msg);
    // Parsed as the chat endpoint parses a body, so its checks and its key order are the same.
    const json cj = parse_json_body(body_out.dump(), ctx);
    try {
      return parse_chat_request(cj, ctx);
    } catch (ApiError& e) {
      rename_param(e, msgs);
      throw;
    }
  };
  r.chat = build(0);
  // truncation "auto": the oldest items go until the prompt and the output fit, whole turns: the
  // kept part starts at a user (or system) message, so an answer or a call's output never comes
  // first (Gemma 3's template refuses a conversation that starts with the assistant: the prompt
  // the server made was a 400; a user test). Shorter conversations render shorter: a binary search.
  const int64_t out_tokens = f.get("max_output_tokens") ? r.chat.params.max_tokens : 1;
  auto fits = [&](const ApiRequest& a) { return static_cast<int64_t>(a.prompts.at(0).size()) + out_tokens <= ctx.max_model_len; };
  if (truncate && !ctx.default_policy_evicts && !fits(r.chat)) {
    auto start_at = [&](size_t k) {
      auto opens_a_turn = [](const ordered& it) {
        return it.value("type", "message") == "message" && it.value("role", "") != "assistant";
      };
      while (k < r.conversation.size() && !opens_a_turn(r.conversation[k])) ++k;
      return k;
    };
    size_t lo = 1, hi = r.conversation.size() - 1;  // the last item always stays
    std::optional<ApiRequest> best;
    size_t best_k = hi;
    while (lo <= hi) {
      const size_t mid = lo + (hi - lo) / 2;
      const size_t k = std::min(start_at(mid), r.conversation.size() - 1);
      ApiRequest a = build(k);
      if (fits(a)) {
        best = std::move(a);
        best_k = k;
        if (mid == 0) break;
        hi = mid - 1;
      } else {
        lo = mid + 1;
      }
    }
    if (best) {
      r.chat = std::move(*best);
      r.n_dropped = static_cast<int32_t>(best_k);
    }  // else: even the last item alone is too long; the engine's 400 says so
  }
  r.chat.stream = f.boolean("stream").value_or(false);

  // The settings the Response object echoes.
  ordered& s = r.settings;
  s["instructions"] = system.is_null() ? ordered(nullptr) : ordered(f.string("instructions").value());
  s["max_output_tokens"] = f.get("max_output_tokens") ? ordered(r.chat.params.max_tokens) : ordered(nullptr);
  s["parallel_tool_calls"] = f.boolean("parallel_tool_calls").value_or(true);
  s["previous_response_id"] = prev ? ordered(r.previous_response_id) : ordered(nullptr);
  s["reasoning"] = nullptr;
  s["store"] = r.store;
  s["temperature"] = f.get("temperature") ? ordered(f.number("temperature", 0, 2).value()) : ordered(1.0);
  s["text"] = echoed_text;
  s["tool_choice"] = std::move(echoed_choice);
  s["tools"] = echoed_tools;
  s["top_logprobs"] = top.value_or(0);
  s["top_p"] = f.get("top_p") ? ordered(f.number("top_p", 0, 1).value()) : ordered(1.0);
  s["truncation"] = truncate ? "auto" : "disabled";
  s["user"] = f.get("user") ? ordered(*f.string("user")) : ordered(nullptr);
  s["metadata"] = std::move(echoed_metadata);
  return r;
}

}  // namespace kv
