// The response side of the Responses API (responses_api.h): a choice's text → output items and
// the stream's events.
#include <map>

#include "server/api_error.h"
#include "server/openai_response.h"
#include "server/responses_api.h"
#include "server/tool_calls.h"

namespace kv {

using ordered = nlohmann::ordered_json;

std::string make_item_id(const char* prefix) {
  static const char* kHex = "0123456789abcdef";
  const uint64_t a = random_seed(), b = random_seed();
  std::string id = std::string(prefix) + "_";
  for (int i = 0; i < 16; ++i) id += kHex[(a >> (4 * i)) & 15];
  for (int i = 0; i < 16; ++i) id += kHex[(b >> (4 * i)) & 15];
  return id;
}

ordered input_items_page(const StoredResponse& s, const InputItemsQuery& q) {
  const size_t n = std::min(s.n_input, s.conversation.size());
  std::vector<size_t> order(n);
  for (size_t i = 0; i < n; ++i) order[i] = q.ascending ? i : n - 1 - i;
  auto position = [&](const std::string& id, const char* param) {
    for (size_t k = 0; k < n; ++k)
      if (s.conversation[order[k]].value("id", "") == id) return k;
    throw ApiError{400, "No input item with id '" + id + "' in this response.", "invalid_request_error", param, "invalid_value"};
  };
  size_t from = q.after.empty() ? 0 : position(q.after, "after") + 1;
  size_t to = q.before.empty() ? n : position(q.before, "before");
  to = std::max(to, from);
  const size_t end = std::min(to, from + static_cast<size_t>(q.limit));
  ordered data = ordered::array();
  for (size_t k = from; k < end; ++k) {
    ordered item = s.conversation[order[k]];
    // a message's text given as a string is listed as the one part OpenAI makes of it
    if (item.value("type", "") == "message" && item.contains("content") && item["content"].is_string()) {
      const bool assistant = item.value("role", "") == "assistant";
      ordered part = {{"type", assistant ? "output_text" : "input_text"}, {"text", item["content"]}};
      if (assistant) part["annotations"] = ordered::array();
      item["content"] = ordered::array({part});
    }
    if (item.value("type", "") == "message" && !item.contains("status")) item["status"] = "completed";
    data.push_back(std::move(item));
  }
  ordered page = {{"object", "list"}, {"data", data}};
  page["first_id"] = data.empty() ? ordered(nullptr) : data.front()["id"];
  page["last_id"] = data.empty() ? ordered(nullptr) : data.back()["id"];
  page["has_more"] = end < to;
  return page;
}

ordered responses_usage(const Usage& u) {
  return {{"input_tokens", u.prompt_tokens},
          // cache_write_tokens (OpenAI's explicit caching) is not counted here: 0, as the client's type needs an integer.
          {"input_tokens_details", {{"cached_tokens", u.cached_tokens}, {"cache_write_tokens", 0}}},
          {"output_tokens", u.completion_tokens},
          {"output_tokens_details", {{"reasoning_tokens", 0}}},
          {"total_tokens", u.prompt_tokens + u.completion_tokens}};
}

std::string responses_sse(const std::vector<ordered>& events) {
  std::string out;
  for (const ordered& e : events) out += "event: " + e.at("type").get<std::string>() + "\ndata: " + dump_json(e) + "\n\n";
  return out;
}

struct ResponseBuilder::Impl {
  const Tokenizer& tok;
  bool with_logprobs = false;
  ordered response;
  std::optional<ToolCallStream> tools;  // a tool choice other than "none"
  int64_t seq = 0;
  std::vector<ordered>* events = nullptr;  // where the call being made puts its events

  // The open message item (output index, -1: none), its text and logprobs.
  int32_t msg = -1;
  std::string text;
  ordered text_lps = ordered::array();
  // Open function_call items: the tool stream's call index → output index.
  std::map<size_t, int32_t> calls;
  std::vector<TokenLogprob> held_lps;  // logprobs of text a tool stream holds back

  explicit Impl(const Tokenizer& t) : tok(t) {}

  ordered& output() { return response["output"]; }
  void emit(ordered e) {
    ordered full = {{"type", e.at("type")}, {"sequence_number", seq++}};
    for (auto& [k, v] : e.items())
      if (k != "type") full[k] = std::move(v);
    events->push_back(std::move(full));
  }

  void open_message() {
    close_calls("completed");
    msg = static_cast<int32_t>(output().size());
    output().push_back({{"id", make_item_id("msg")}, {"type", "message"}, {"status", "in_progress"}, {"role", "assistant"}, {"content", ordered::array()}});
    emit({{"type", "response.output_item.added"}, {"output_index", msg}, {"item", output()[msg]}});
    emit({{"type", "response.content_part.added"}, {"item_id", output()[msg]["id"]}, {"output_index", msg}, {"content_index", 0},
          {"part", part()}});
  }
  ordered part() const { return {{"type", "output_text"}, {"text", text}, {"annotations", ordered::array()}, {"logprobs", text_lps}}; }

  void add_text(const std::string& t, const std::vector<TokenLogprob>& lps) {
    if (t.empty() && lps.empty()) return;
    if (msg < 0) open_message();
    ordered lp = with_logprobs ? logprob_content(lps, tok) : ordered::array();
    for (const auto& e : lp) text_lps.push_back(e);
    text += t;
    emit({{"type", "response.output_text.delta"}, {"item_id", output()[msg]["id"]}, {"output_index", msg}, {"content_index", 0},
          {"delta", t}, {"logprobs", std::move(lp)}});
  }

  void close_message(const char* status) {
    if (msg < 0) return;
    ordered& item = output()[msg];
    emit({{"type", "response.output_text.done"}, {"item_id", item["id"]}, {"output_index", msg}, {"content_index", 0}, {"text", text},
          {"logprobs", text_lps}});
    emit({{"type", "response.content_part.done"}, {"item_id", item["id"]}, {"output_index", msg}, {"content_index", 0}, {"part", part()}});
    item["status"] = status;
    item["content"] = ordered::array({part()});
    emit({{"type", "response.output_item.done"}, {"output_index", msg}, {"item", item}});
    msg = -1;
  }

  void close_calls(const char* status) {
    for (auto& [k, at] : calls) {
      ordered& item = output()[at];
      emit({{"type", "response.function_call_arguments.done"}, {"item_id", item["id"]}, {"output_index", at}, {"arguments", item["arguments"]}});
      item["status"] = status;
      emit({{"type", "response.output_item.done"}, {"output_index", at}, {"item", item}});
    }
    calls.clear();
  }

  void add_arguments(int32_t at, const std::string& t) {
    if (t.empty()) return;
    ordered& item = output()[at];
    item["arguments"] = item["arguments"].get<std::string>() + t;
    emit({{"type", "response.function_call_arguments.delta"}, {"item_id", item["id"]}, {"output_index", at}, {"delta", t}});
  }

  // A chat delta of the tool stream (tool_calls.h): content, or calls opening or growing.
  void add_delta(const ordered& d) {
    if (d.contains("content") && d["content"].is_string()) {
      add_text(d["content"].get<std::string>(), held_lps);
      held_lps.clear();
    }
    if (!d.contains("tool_calls")) return;
    for (const ordered& c : d["tool_calls"]) {
      const size_t k = c.at("index").get<size_t>();
      const ordered& fn = c.at("function");
      if (c.contains("id")) {  // a new call: what came before it is done
        close_message("completed");
        close_calls("completed");
        const int32_t at = static_cast<int32_t>(output().size());
        output().push_back({{"id", make_item_id("fc")}, {"type", "function_call"}, {"status", "in_progress"}, {"arguments", ""},
                            {"call_id", c.at("id")}, {"name", fn.at("name")}});
        emit({{"type", "response.output_item.added"}, {"output_index", at}, {"item", output()[at]}});
        calls[k] = at;
      }
      if (auto it = calls.find(k); it != calls.end() && fn.contains("arguments")) add_arguments(it->second, fn["arguments"].get<std::string>());
    }
  }
};

ResponseBuilder::ResponseBuilder(const ResponsesRequest& r, std::string id, int64_t created_at, std::string model, const Tokenizer& tok)
    : impl_(std::make_unique<Impl>(tok)) {
  Impl& m = *impl_;
  m.with_logprobs = r.logprobs;
  if (r.chat.tool_choice.kind != ToolChoice::Kind::kNone) m.tools.emplace(r.chat.tool_choice);
  m.response = {{"id", std::move(id)},
                {"object", "response"},
                {"created_at", created_at},
                {"status", "in_progress"},
                {"background", false},
                {"error", nullptr},
                {"incomplete_details", nullptr},
                {"model", std::move(model)},
                {"output", ordered::array()}};
  for (const auto& [k, v] : r.settings.items()) m.response[k] = v;
  m.response["usage"] = nullptr;
}

ResponseBuilder::~ResponseBuilder() = default;

std::vector<ordered> ResponseBuilder::begin() {
  std::vector<ordered> out;
  impl_->events = &out;
  impl_->emit({{"type", "response.created"}, {"response", impl_->response}});
  impl_->emit({{"type", "response.in_progress"}, {"response", impl_->response}});
  return out;
}

std::vector<ordered> ResponseBuilder::push(const std::string& text, const std::vector<TokenLogprob>& logprobs) {
  Impl& m = *impl_;
  std::vector<ordered> out;
  m.events = &out;
  if (!m.tools) {
    m.add_text(text, logprobs);
    return out;
  }
  m.held_lps.insert(m.held_lps.end(), logprobs.begin(), logprobs.end());
  for (const ordered& d : m.tools->push(text)) m.add_delta(d);
  return out;
}

std::vector<ordered> ResponseBuilder::finish(const std::string& finish_reason, const Usage& usage) {
  Impl& m = *impl_;
  std::vector<ordered> out;
  m.events = &out;
  std::string reason = finish_reason;
  if (m.tools)
    for (const ordered& d : m.tools->finish(&reason)) m.add_delta(d);
  const bool cut = finish_reason == "length";
  if (m.output().empty()) m.open_message();  // an empty answer is an empty message, so output_text reads ""
  m.close_message(cut ? "incomplete" : "completed");
  m.close_calls(cut ? "incomplete" : "completed");
  m.response["status"] = cut ? "incomplete" : "completed";
  if (cut) m.response["incomplete_details"] = {{"reason", "max_output_tokens"}};
  m.response["usage"] = responses_usage(usage);
  m.emit({{"type", cut ? "response.incomplete" : "response.completed"}, {"response", m.response}});
  return out;
}

std::vector<ordered> ResponseBuilder::fail(const ApiError& e, const Usage* usage) {
  Impl& m = *impl_;
  std::vector<ordered> out;
  m.events = &out;
  // The open items end incomplete with what they hold: the failed response keeps the text already
  // streamed (its message item stayed in_progress and empty; a black-box test).
  m.close_message("incomplete");
  m.close_calls("incomplete");
  m.emit({{"type", "error"}, {"code", e.code.empty() ? ordered(nullptr) : ordered(e.code)}, {"message", e.message},
          {"param", e.param.empty() ? ordered(nullptr) : ordered(e.param)}});
  m.response["status"] = "failed";
  // response.error.code is one of OpenAI's codes (the client's types refuse "request_timeout"):
  // the server's own code goes in the message.
  const char* code = e.status == 429 ? "rate_limit_exceeded" : "server_error";
  m.response["error"] = {{"code", code}, {"message", e.code.empty() || e.code == code ? e.message : e.code + ": " + e.message}};
  if (usage) m.response["usage"] = responses_usage(*usage);
  m.emit({{"type", "response.failed"}, {"response", m.response}});
  return out;
}

const ordered& ResponseBuilder::response() const { return impl_->response; }

void ResponseBuilder::set_store(bool stored) { impl_->response["store"] = stored; }

const std::vector<ordered>& ResponseBuilder::output() const { return impl_->response["output"].get_ref<const ordered::array_t&>(); }

}  // namespace kv
