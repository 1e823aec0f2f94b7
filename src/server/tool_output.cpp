// The response side of tool calling (tool_calls.h): a choice's text → content and tool calls.
#include <algorithm>
#include <string_view>

#include "server/openai_request.h"
#include "server/tool_calls.h"

namespace kv {

using ordered = nlohmann::ordered_json;

namespace {

constexpr std::string_view kOpenTag = "<tool_call>";
constexpr std::string_view kCloseTag = "</tool_call>";
constexpr size_t kNone = std::string::npos;

bool is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

// JSON text as Python's json.dumps(v, ensure_ascii=False) writes it (", " and ": " between
// members): the arguments text vLLM's parsers give, so a client sees the same string.
void python_dumps(const ordered& v, std::string* out) {
  if (v.is_object()) {
    *out += '{';
    bool first = true;
    for (const auto& [key, val] : v.items()) {
      if (!first) *out += ", ";
      first = false;
      *out += ordered(key).dump();
      *out += ": ";
      python_dumps(val, out);
    }
    *out += '}';
  } else if (v.is_array()) {
    *out += '[';
    for (size_t i = 0; i < v.size(); ++i) {
      if (i > 0) *out += ", ";
      python_dumps(v[i], out);
    }
    *out += ']';
  } else {
    *out += v.dump();
  }
}

// Where the closing tag of a call whose body starts at `from` is: the first one outside a JSON
// string (an argument may quote the tag); kNone when there is none.
size_t closing_tag(const std::string& text, size_t from) {
  bool in_string = false, escaped = false;
  for (size_t i = from; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (text.compare(i, kCloseTag.size(), kCloseTag) == 0) {
      return i;
    }
  }
  return kNone;
}

std::string new_call_id() {
  static const char* kHex = "0123456789abcdef";
  const uint64_t a = random_seed(), b = random_seed();
  std::string id = "call_";
  for (int i = 0; i < 16; ++i) id += kHex[(a >> (4 * i)) & 15];
  for (int i = 0; i < 8; ++i) id += kHex[(b >> (4 * i)) & 15];
  return id;
}

// The calls of a "required" answer as its text comes: [{"name": "f", "parameters": {...}}, ...].
// The constraint makes the text JSON of that shape; this follows its structure only (strings
// and their escapes, nesting, each item's members), so it can stop anywhere and go on.
class RequiredScanner {
 public:
  struct Item {
    std::string name;
    bool named = false;          // its name's string has closed
    size_t args_begin = kNone;   // its "parameters" value: [args_begin, args_end) of the text
    size_t args_end = 0;
  };

  void feed(const std::string& more) {
    text_ += more;
    for (; pos_ < text_.size(); ++pos_) step(pos_);
  }
  const std::vector<Item>& items() const { return items_; }
  std::string arguments(const Item& it) const { return it.args_begin == kNone ? "" : text_.substr(it.args_begin, it.args_end - it.args_begin); }

 private:
  enum class Member { kKey, kColon, kValue, kAfter };  // where an item (depth 2) is
  enum class Value { kNone, kString, kContainer, kScalar };

  void step(size_t i) {
    const char c = text_[i];
    if (in_string_) {
      if (escaped_) escaped_ = false;
      else if (c == '\\') escaped_ = true;
      else if (c == '"') {
        in_string_ = false;
        if (depth_ == 2) string_closed(i);
      }
    } else {
      if (depth_ == 2 && value_ == Value::kScalar && (c == ',' || c == '}' || is_space(c))) end_value(i);
      switch (c) {
        case '"':
          in_string_ = true;
          string_begin_ = i;
          if (depth_ == 2 && member_ == Member::kValue) begin_value(i, Value::kString);
          break;
        case '{':
        case '[':
          if (depth_ == 2 && member_ == Member::kValue) begin_value(i, Value::kContainer);
          if (++depth_ == 2) {
            items_.emplace_back();
            member_ = Member::kKey;
          }
          break;
        case '}':
        case ']':
          if (--depth_ == 2 && value_ == Value::kContainer) end_value(i + 1);
          break;
        case ':':
          if (depth_ == 2 && member_ == Member::kColon) member_ = Member::kValue;
          break;
        case ',':
          if (depth_ == 2) member_ = Member::kKey;
          break;
        default:
          if (depth_ == 2 && member_ == Member::kValue && value_ == Value::kNone && !is_space(c)) begin_value(i, Value::kScalar);
      }
    }
    if (args_open_) items_.back().args_end = i + 1;
  }

  void begin_value(size_t i, Value kind) {
    value_ = kind;
    if (key_ == "parameters") {
      items_.back().args_begin = i;
      args_open_ = true;
    }
  }
  void end_value(size_t end) {
    if (args_open_) items_.back().args_end = end;
    args_open_ = false;
    value_ = Value::kNone;
    member_ = Member::kAfter;
  }
  void string_closed(size_t i) {
    const std::string raw = text_.substr(string_begin_, i + 1 - string_begin_);
    const ordered s = ordered::parse(raw, nullptr, /*allow_exceptions=*/false);
    const std::string decoded = s.is_string() ? s.get<std::string>() : raw;
    if (member_ == Member::kKey) {
      key_ = decoded;
      member_ = Member::kColon;
    } else if (value_ == Value::kString) {
      if (key_ == "name") {
        items_.back().name = decoded;
        items_.back().named = true;
      }
      end_value(i + 1);
    }
  }

  std::string text_;
  size_t pos_ = 0;
  int depth_ = 0;
  bool in_string_ = false, escaped_ = false;
  size_t string_begin_ = 0;
  Member member_ = Member::kKey;
  Value value_ = Value::kNone;
  std::string key_;          // the member whose value is being read
  bool args_open_ = false;   // inside a "parameters" value
  std::vector<Item> items_;
};

ordered open_delta(size_t index, const ToolCall& c) {
  return {{"tool_calls", ordered::array({{{"index", index}, {"id", c.id}, {"type", "function"},
                                          {"function", {{"name", c.name}, {"arguments", c.arguments}}}}})}};
}
ordered arguments_delta(size_t index, const std::string& text) {
  return {{"tool_calls", ordered::array({{{"index", index}, {"function", {{"arguments", text}}}}})}};
}
ordered content_delta(const std::string& text) { return {{"content", text}}; }

}  // namespace

HermesResult parse_hermes_tool_calls(const std::string& text) {
  HermesResult r;
  const size_t first = text.find(kOpenTag);
  if (first == kNone) {
    r.content = text;
    return r;
  }
  std::vector<ToolCall> calls;
  for (size_t at = first; at != kNone;) {
    const size_t body = at + kOpenTag.size();
    const size_t end = closing_tag(text, body);
    const ordered call = ordered::parse(text.substr(body, (end == kNone ? text.size() : end) - body), nullptr, /*allow_exceptions=*/false);
    if (call.is_discarded() || !call.is_object() || !call.contains("name") || !call["name"].is_string() || !call.contains("arguments")) {
      r.content = text;  // as vLLM: one call that does not parse, and the whole text is content
      return r;
    }
    ToolCall tc;
    tc.name = call["name"].get<std::string>();
    python_dumps(call["arguments"], &tc.arguments);
    calls.push_back(std::move(tc));
    at = end == kNone ? kNone : text.find(kOpenTag, end + kCloseTag.size());
  }
  r.called = true;
  r.calls = std::move(calls);
  if (first > 0) r.content = text.substr(0, first);
  return r;
}

struct ToolCallStream::Impl {
  ToolChoice choice;
  std::string text;            // every push
  std::string content;         // what went out as content
  std::vector<ToolCall> calls;
  RequiredScanner scanner;     // "required"
  size_t released = 0;         // "auto": text[0, released) went out as content
  bool in_calls = false;       // "auto": a tag began at `released`; the rest is held

  // "auto": text[released, to) goes out as content.
  void release(size_t to, std::vector<ordered>* out) {
    if (to <= released) return;
    const std::string s = text.substr(released, to - released);
    content += s;
    released = to;
    out->push_back(content_delta(s));
  }
};

ToolCallStream::ToolCallStream(ToolChoice choice) : impl_(std::make_unique<Impl>()) { impl_->choice = std::move(choice); }
ToolCallStream::~ToolCallStream() = default;
ToolCallStream::ToolCallStream(ToolCallStream&&) noexcept = default;
ToolCallStream& ToolCallStream::operator=(ToolCallStream&&) noexcept = default;

std::vector<ordered> ToolCallStream::push(const std::string& t) {
  Impl& m = *impl_;
  std::vector<ordered> out;
  m.text += t;
  switch (m.choice.kind) {
    case ToolChoice::Kind::kNamed:
      if (m.calls.empty()) {
        m.calls.push_back({new_call_id(), m.choice.name, t});
        out.push_back(open_delta(0, m.calls[0]));
      } else if (!t.empty()) {
        m.calls[0].arguments += t;
        out.push_back(arguments_delta(0, t));
      }
      break;
    case ToolChoice::Kind::kRequired:
      m.scanner.feed(t);
      for (size_t k = 0; k < m.scanner.items().size(); ++k) {
        const auto& item = m.scanner.items()[k];
        if (!item.named) break;  // a call opens with its name; the next cannot have begun
        std::string args = m.scanner.arguments(item);
        if (k == m.calls.size()) {
          m.calls.push_back({new_call_id(), item.name, std::move(args)});
          out.push_back(open_delta(k, m.calls[k]));
        } else if (args.size() > m.calls[k].arguments.size()) {
          out.push_back(arguments_delta(k, args.substr(m.calls[k].arguments.size())));
          m.calls[k].arguments = std::move(args);
        }
      }
      break;
    case ToolChoice::Kind::kAuto:
      if (m.in_calls) break;
      if (const size_t p = m.text.find(kOpenTag, m.released); p != kNone) {
        m.release(p, &out);
        m.in_calls = true;
      } else {  // hold back a tail that may be the start of a tag
        size_t hold = std::min(kOpenTag.size() - 1, m.text.size() - m.released);
        while (hold > 0 && m.text.compare(m.text.size() - hold, hold, kOpenTag.substr(0, hold)) != 0) --hold;
        m.release(m.text.size() - hold, &out);
      }
      break;
    case ToolChoice::Kind::kNone:
      m.content += t;
      out.push_back(content_delta(t));
      break;
  }
  return out;
}

std::vector<ordered> ToolCallStream::finish(std::string* finish_reason) {
  Impl& m = *impl_;
  std::vector<ordered> out;
  switch (m.choice.kind) {
    case ToolChoice::Kind::kNamed:
      if (m.calls.empty()) {  // nothing was pushed: the call is there all the same
        m.calls.push_back({new_call_id(), m.choice.name, ""});
        out.push_back(open_delta(0, m.calls[0]));
      }
      break;
    case ToolChoice::Kind::kRequired:
      // Only a whole array is calls to make: a stop string can end the text inside the JSON.
      if (*finish_reason == "stop" && !m.calls.empty() && nlohmann::json::accept(m.text)) *finish_reason = "tool_calls";
      // Cut (max_tokens) before a first call's name was whole: the text is the content, not lost
      // (the message had neither content nor calls; a black-box test).
      if (m.calls.empty() && !m.text.empty()) {
        m.content = m.text;
        out.push_back(content_delta(m.text));
      }
      break;
    case ToolChoice::Kind::kAuto:
      if (m.in_calls) {
        HermesResult r = parse_hermes_tool_calls(m.text);
        if (r.called && !m.choice.parallel) r.calls.resize(1);  // parallel_tool_calls false: the first call
        if (r.called) {
          for (size_t k = 0; k < r.calls.size(); ++k) {
            r.calls[k].id = new_call_id();
            m.calls.push_back(std::move(r.calls[k]));
            out.push_back(open_delta(k, m.calls[k]));
          }
          *finish_reason = "tool_calls";
          break;
        }
      }
      m.release(m.text.size(), &out);
      break;
    case ToolChoice::Kind::kNone:
      break;
  }
  return out;
}

ordered ToolCallStream::message() const {
  const Impl& m = *impl_;
  // Content is text the model wrote beside its calls; a forced call has none (null, as OpenAI).
  const bool has_content = ((m.choice.kind == ToolChoice::Kind::kAuto || m.choice.kind == ToolChoice::Kind::kNone) &&
                            (m.calls.empty() || !m.content.empty())) ||
                           (m.choice.kind == ToolChoice::Kind::kRequired && m.calls.empty() && !m.content.empty());
  ordered msg = {{"role", "assistant"}, {"content", has_content ? ordered(m.content) : ordered(nullptr)}, {"refusal", nullptr}};
  if (!m.calls.empty()) {
    ordered calls = ordered::array();
    for (const ToolCall& c : m.calls)
      calls.push_back({{"id", c.id}, {"type", "function"}, {"function", {{"name", c.name}, {"arguments", c.arguments}}}});
    msg["tool_calls"] = std::move(calls);
  }
  return msg;
}

}  // namespace kv
