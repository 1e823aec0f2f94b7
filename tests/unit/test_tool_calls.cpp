// Tool calling's response side (server/tool_calls.h): the hermes parser on hand-written answers
// (vLLM's rules: text before the first tag is the content, one call that does not parse and the
// whole answer is content, an unclosed last tag still counts), and ToolCallStream: the deltas of
// an answer pushed a character at a time reassemble to the message of the answer pushed whole,
// for each tool choice.
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <vector>

#include "server/tool_calls.h"

namespace {

using kv::HermesResult;
using kv::ToolCallStream;
using kv::ToolChoice;
using ordered = nlohmann::ordered_json;

HermesResult hermes(const std::string& text) { return kv::parse_hermes_tool_calls(text); }

TEST(HermesParser, TextWithoutATagIsContent) {
  const HermesResult r = hermes("The weather is fine. <tool> is not a tag.");
  EXPECT_FALSE(r.called);
  EXPECT_EQ(r.content, "The weather is fine. <tool> is not a tag.");
  EXPECT_TRUE(r.calls.empty());
}

TEST(HermesParser, TextBeforeACallIsContentAndArgumentsArePythonsJsonDumps) {
  const HermesResult r = hermes("Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\":\"Paris\",\"days\":2,"
                                "\"a\":[1,2.5,{\"b\":null}],\"note\":\"\xC3\xA9\\n\"}}\n</tool_call>");
  ASSERT_TRUE(r.called);
  EXPECT_EQ(r.content, "Let me check.\n");
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].name, "get_weather");
  // The model's key order, ", " and ": " (vLLM re-serializes with json.dumps), non-ASCII kept.
  EXPECT_EQ(r.calls[0].arguments, "{\"city\": \"Paris\", \"days\": 2, \"a\": [1, 2.5, {\"b\": null}], \"note\": \"\xC3\xA9\\n\"}");
}

TEST(HermesParser, TwoCallsAndTheTextAfterThemDropped) {
  const HermesResult r = hermes("<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call>\n"
                                "<tool_call>{\"name\": \"b\", \"arguments\": {\"x\": 1}}</tool_call>\nDone.");
  ASSERT_TRUE(r.called);
  EXPECT_FALSE(r.content.has_value());  // nothing before the first tag: no content (vLLM's None)
  ASSERT_EQ(r.calls.size(), 2u);
  EXPECT_EQ(r.calls[0].name, "a");
  EXPECT_EQ(r.calls[0].arguments, "{}");
  EXPECT_EQ(r.calls[1].name, "b");
  EXPECT_EQ(r.calls[1].arguments, "{\"x\": 1}");
}

TEST(HermesParser, OneMalformedCallLeavesTheWholeTextAsContent) {
  const std::string bad_json = "Sure. <tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {x}}</tool_call>";
  const std::string no_arguments = "<tool_call>{\"name\": \"a\"}</tool_call>";
  const std::string name_not_string = "<tool_call>{\"name\": 3, \"arguments\": {}}</tool_call>";
  const std::string not_object = "<tool_call>[\"a\", {}]</tool_call>";
  const std::string empty = "<tool_call></tool_call>";
  for (const std::string& t : {bad_json, no_arguments, name_not_string, not_object, empty}) {
    const HermesResult r = hermes(t);
    EXPECT_FALSE(r.called) << t;
    EXPECT_EQ(r.content, t);
    EXPECT_TRUE(r.calls.empty());
  }
}

TEST(HermesParser, AnUnclosedLastTagCountsWhenItsJsonIsWhole) {
  HermesResult r = hermes("<tool_call>{\"name\": \"a\", \"arguments\": {\"q\": \"x\"}}\n");
  ASSERT_TRUE(r.called);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments, "{\"q\": \"x\"}");
  // Cut inside its JSON (max_tokens): not a call, the text stays.
  r = hermes("ok <tool_call>{\"name\": \"a\", \"arguments\": {\"q\": \"x");
  EXPECT_FALSE(r.called);
  EXPECT_EQ(r.content, "ok <tool_call>{\"name\": \"a\", \"arguments\": {\"q\": \"x");
}

TEST(HermesParser, AClosingTagInsideAJsonStringDoesNotEndTheCall) {
  const HermesResult r = hermes("<tool_call>{\"name\": \"write\", \"arguments\": {\"text\": \"a </tool_call> b \\\" c\"}}</tool_call>");
  ASSERT_TRUE(r.called);
  ASSERT_EQ(r.calls.size(), 1u);
  EXPECT_EQ(r.calls[0].arguments, "{\"text\": \"a </tool_call> b \\\" c\"}");
}

// What a client makes of a stream's deltas: the content, and each call (by index) with its id and
// name from its first delta and its arguments concatenated.
struct Reassembled {
  std::string content;
  bool any_content = false;
  std::vector<ordered> calls;  // {"id", "name", "arguments"}
};

void apply(const ordered& delta, Reassembled* r) {
  if (delta.contains("content")) {
    r->content += delta["content"].get<std::string>();
    r->any_content = true;
  }
  if (!delta.contains("tool_calls")) return;
  for (const ordered& tc : delta["tool_calls"]) {
    const size_t k = tc["index"].get<size_t>();
    if (k == r->calls.size()) {  // a call's first delta: its id, type and name
      ASSERT_TRUE(tc.contains("id"));
      EXPECT_EQ(tc["type"], "function");
      r->calls.push_back({{"id", tc["id"]}, {"name", tc["function"]["name"]}, {"arguments", ""}});
    }
    ASSERT_LT(k, r->calls.size());
    r->calls[k]["arguments"] = r->calls[k]["arguments"].get<std::string>() + tc["function"]["arguments"].get<std::string>();
  }
}

// Streams `text` a character at a time and checks the reassembled deltas against the message
// of the same text pushed whole (ids aside: each call gets a fresh one); returns that message.
ordered stream_equals_whole(const ToolChoice& choice, const std::string& text, const std::string& engine_reason,
                            std::string* reason_out) {
  ToolCallStream whole(choice);
  whole.push(text);
  std::string whole_reason = engine_reason;
  whole.finish(&whole_reason);
  const ordered msg = whole.message();

  ToolCallStream streamed(choice);
  Reassembled r;
  for (char c : text)
    for (const ordered& d : streamed.push(std::string(1, c))) apply(d, &r);
  std::string streamed_reason = engine_reason;
  for (const ordered& d : streamed.finish(&streamed_reason)) apply(d, &r);

  EXPECT_EQ(streamed_reason, whole_reason) << text;
  if (msg["content"].is_null()) EXPECT_EQ(r.content, "") << text;
  else EXPECT_EQ(r.content, msg["content"].get<std::string>()) << text;
  const size_t n_calls = msg.contains("tool_calls") ? msg["tool_calls"].size() : 0;
  EXPECT_EQ(r.calls.size(), n_calls) << text;
  for (size_t k = 0; k < std::min(n_calls, r.calls.size()); ++k) {
    const ordered& want = msg["tool_calls"][k];
    EXPECT_EQ(r.calls[k]["name"], want["function"]["name"]) << text;
    EXPECT_EQ(r.calls[k]["arguments"], want["function"]["arguments"]) << text;
    EXPECT_EQ(want["id"].get<std::string>().rfind("call_", 0), 0u);
  }
  *reason_out = whole_reason;
  return msg;
}

ToolChoice choice(ToolChoice::Kind kind, const std::string& name = "") {
  ToolChoice c;
  c.kind = kind;
  c.name = name;
  return c;
}

TEST(ToolCallStream, AutoStreamsTextUntilATagAndHoldsTheCallsToTheEnd) {
  const ToolChoice c = choice(ToolChoice::Kind::kAuto);
  std::string reason;
  ordered m = stream_equals_whole(c, "Sure. <tool_call>{\"name\": \"a\", \"arguments\": {\"x\": [1, 2]}}</tool_call>", "stop", &reason);
  EXPECT_EQ(reason, "tool_calls");
  EXPECT_EQ(m["content"], "Sure. ");
  EXPECT_EQ(m["tool_calls"][0]["function"]["arguments"], "{\"x\": [1, 2]}");

  m = stream_equals_whole(c, "<tool_call>{\"name\": \"a\", \"arguments\": {}}</tool_call><tool_call>{\"name\": \"b\", \"arguments\": {}}</tool_call>",
                          "stop", &reason);
  EXPECT_EQ(reason, "tool_calls");
  EXPECT_TRUE(m["content"].is_null());
  EXPECT_EQ(m["tool_calls"].size(), 2u);

  // Text that only looks like the start of a tag goes out as content, in full.
  m = stream_equals_whole(c, "Use <b>bold</b> or <tool_cal", "length", &reason);
  EXPECT_EQ(reason, "length");
  EXPECT_EQ(m["content"], "Use <b>bold</b> or <tool_cal");
  EXPECT_FALSE(m.contains("tool_calls"));

  // A call that does not parse: every character is content, the engine's reason stays.
  m = stream_equals_whole(c, "a <tool_call>{\"name\": \"a\"}</tool_call> b", "stop", &reason);
  EXPECT_EQ(reason, "stop");
  EXPECT_EQ(m["content"], "a <tool_call>{\"name\": \"a\"}</tool_call> b");

  // No text at all: an empty content, not null.
  m = stream_equals_whole(c, "", "stop", &reason);
  EXPECT_EQ(m["content"], "");
}

TEST(ToolCallStream, AutoHoldsBackOnlyWhatMayBeATag) {
  ToolCallStream s(choice(ToolChoice::Kind::kAuto));
  std::vector<ordered> d = s.push("Hello <tool");
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0]["content"], "Hello ");
  d = s.push("box>");  // not a tag after all
  ASSERT_EQ(d.size(), 1u);
  EXPECT_EQ(d[0]["content"], "<toolbox>");
}

TEST(ToolCallStream, RequiredOpensACallAtItsNameAndStreamsItsArguments) {
  const ToolChoice c = choice(ToolChoice::Kind::kRequired);
  std::string reason;
  // Any whitespace between tokens, strings holding brackets, quotes and escapes, a scalar value.
  const std::string text =
      "[ {\n \"name\" : \"get_weather\" , \"parameters\" : { \"city\" : \"P]a}r\\\"is\", \"n\": [1, {\"d\": 2}] } } ,"
      "{\"name\": \"f\\u00e9\", \"parameters\": {}}, {\"parameters\": 42, \"name\": \"g\"}]";
  const ordered m = stream_equals_whole(c, text, "stop", &reason);
  EXPECT_EQ(reason, "tool_calls");
  EXPECT_TRUE(m["content"].is_null());
  ASSERT_EQ(m["tool_calls"].size(), 3u);
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(m["tool_calls"][0]["function"]["arguments"], "{ \"city\" : \"P]a}r\\\"is\", \"n\": [1, {\"d\": 2}] }");
  EXPECT_EQ(m["tool_calls"][1]["function"]["name"], "f\xC3\xA9");
  EXPECT_EQ(m["tool_calls"][1]["function"]["arguments"], "{}");
  EXPECT_EQ(m["tool_calls"][2]["function"]["name"], "g");
  EXPECT_EQ(m["tool_calls"][2]["function"]["arguments"], "42");
  EXPECT_NE(m["tool_calls"][0]["id"], m["tool_calls"][1]["id"]);

  // Cut by max_tokens inside the first call's arguments: the call so far, the reason "length".
  const ordered cut = stream_equals_whole(c, "[{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Par", "length", &reason);
  EXPECT_EQ(reason, "length");
  EXPECT_EQ(cut["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Par");
}

TEST(ToolCallStream, NamedIsOneCallOfTheWholeTextWithTheEnginesReason) {
  const ToolChoice c = choice(ToolChoice::Kind::kNamed, "get_weather");
  std::string reason;
  const ordered m = stream_equals_whole(c, "{\"city\": \"Paris\"}", "stop", &reason);
  EXPECT_EQ(reason, "stop");  // OpenAI's and vLLM's finish_reason for a named choice
  EXPECT_TRUE(m["content"].is_null());
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  EXPECT_EQ(m["tool_calls"][0]["type"], "function");
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(m["tool_calls"][0]["function"]["arguments"], "{\"city\": \"Paris\"}");

  // The first delta opens the call with its id, type, name and the text so far.
  ToolCallStream s(c);
  const std::vector<ordered> d = s.push("{\"ci");
  ASSERT_EQ(d.size(), 1u);
  const ordered& tc = d[0]["tool_calls"][0];
  EXPECT_EQ(tc["index"], 0);
  EXPECT_EQ(tc["type"], "function");
  EXPECT_EQ(tc["function"]["name"], "get_weather");
  EXPECT_EQ(tc["function"]["arguments"], "{\"ci");
  const std::vector<ordered> d2 = s.push("ty\"");
  ASSERT_EQ(d2.size(), 1u);
  EXPECT_FALSE(d2[0]["tool_calls"][0].contains("id"));
  EXPECT_EQ(d2[0]["tool_calls"][0]["function"]["arguments"], "ty\"");
}

}  // namespace
