// The Responses API's request and response sides (server/responses_api.h) and its store
// (server/response_store.h), without a model: input items become the chat messages a plain
// template shows (roles, calls, call outputs, the instructions first), errors name the Responses
// field, ResponseBuilder's events build the same Response whether the text comes at once or a
// character at a time, and the store is an LRU that keeps tenants apart.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "model_fixture.h"
#include "server/request_fields.h"
#include "server/response_store.h"
#include "server/responses_api.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace {

using kv::ApiError;
using kv::ResponseBuilder;
using kv::ResponsesRequest;
using kv::StoredResponse;
using nlohmann::json;
using ordered = nlohmann::ordered_json;

// Each message on its own line: role, content, the calls' names and arguments, the call answered.
const char* kTemplate =
    "{% for m in messages %}[{{ m.role }}]{{ m.content }}"
    "{% if m.tool_calls %}{% for c in m.tool_calls %}<call {{ c.id }} {{ c.function.name }} {{ c.function.arguments | tojson }}>{% endfor %}{% endif %}"
    "{% if m.tool_call_id %}<for {{ m.tool_call_id }}>{% endif %}{{ '\\n' }}{% endfor %}";

struct Ctx {
  kv::ChatTemplate tmpl;
  kv::ApiContext ctx;
};

const Ctx* context() {
  static Ctx* c = [] {
    const kv::Tokenizer* tok = kvtest::smollm2_tokenizer();
    if (!tok) return static_cast<Ctx*>(nullptr);
    auto* out = new Ctx{*kv::ChatTemplate::parse(kTemplate), {}};
    out->ctx = kv::make_api_context(*tok, &out->tmpl, "m.gguf", "m", 4096, 4);
    out->ctx.constraints_forwarded = true;  // shapes checked, nothing compiled
    return out;
  }();
  return c;
}

std::string prompt_text(const ResponsesRequest& r) { return context()->ctx.tok->decode(r.chat.prompts.at(0), /*special=*/true); }

// A store with nothing in it (the server keeps responses).
const kv::PreviousLookup kEmptyStore = [](const std::string&) { return std::shared_ptr<const StoredResponse>(); };

ResponsesRequest parse(const std::string& body, const kv::PreviousLookup& prev = kEmptyStore) {
  return kv::parse_responses_request(kv::parse_json_body(body, context()->ctx), context()->ctx, prev);
}

ApiError parse_error(const std::string& body) {
  try {
    parse(body);
  } catch (const ApiError& e) {
    return e;
  }
  ADD_FAILURE() << "no error for " << body;
  return {};
}

TEST(ResponsesRequest, ItemsBecomeChatMessagesWithTheInstructionsFirst) {
  if (!context()) GTEST_SKIP() << "model missing";
  const ResponsesRequest r = parse(R"({"instructions": "Be brief.", "input": [
      {"role": "developer", "content": "Dev."},
      {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
      {"role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
      {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
      {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": ""},
      {"type": "function_call_output", "call_id": "c1", "output": "22 C"},
      {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "noon"}]}]})");
  EXPECT_EQ(prompt_text(r),
            "[system]Be brief.\n[system]Dev.\n[user]Weather?\n"
            "[assistant]Checking.<call c1 get_weather {\"city\": \"Paris\"}><call c2 get_time {}>\n"
            "[tool]22 C<for c1>\n[tool]noon<for c2>\n");
  ASSERT_EQ(r.conversation.size(), 7u);  // the instructions are not part of the conversation
  EXPECT_EQ(r.conversation[0]["type"], "message");
  EXPECT_EQ(r.settings["instructions"], "Be brief.");
  EXPECT_TRUE(r.store);
  EXPECT_FALSE(r.chat.stream);
}

TEST(ResponsesRequest, APreviousResponseGoesBeforeTheInputAndItsInstructionsDoNot) {
  if (!context()) GTEST_SKIP() << "model missing";
  auto stored = std::make_shared<StoredResponse>();
  stored->conversation = {{{"type", "message"}, {"role", "user"}, {"content", "Hi"}},
                          {{"type", "message"}, {"role", "assistant"}, {"content", {{{"type", "output_text"}, {"text", "Hello."}}}}}};
  stored->cache_salt = "s1";
  std::string asked;
  kv::PreviousLookup prev = [&](const std::string& id) -> std::shared_ptr<const StoredResponse> {
    asked = id;
    return id == "resp_1" ? stored : nullptr;
  };
  const ResponsesRequest r = parse(R"({"input": "Again", "previous_response_id": "resp_1"})", prev);
  EXPECT_EQ(asked, "resp_1");
  EXPECT_EQ(prompt_text(r), "[user]Hi\n[assistant]Hello.\n[user]Again\n");
  EXPECT_EQ(r.conversation.size(), 3u);
  EXPECT_EQ(r.chat.params.cache_namespace, "s1");  // the pages of that conversation are under its salt
  EXPECT_EQ(r.settings["previous_response_id"], "resp_1");
  try {
    parse(R"({"input": "x", "previous_response_id": "resp_2"})", prev);
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 404);
    EXPECT_EQ(e.param, "previous_response_id");
  }
  // A server that stores nothing: previous_response_id is a 400 and store is answered false.
  try {
    parse(R"({"input": "x", "previous_response_id": "resp_1"})", {});
    FAIL();
  } catch (const ApiError& e) {
    EXPECT_EQ(e.status, 400);
  }
  EXPECT_FALSE(parse(R"({"input": "x"})", {}).store);
}

TEST(ResponsesRequest, ErrorsNameTheResponsesField) {
  if (!context()) GTEST_SKIP() << "model missing";
  EXPECT_EQ(parse_error(R"({"input": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"},
                                      {"role": "user", "content": [{"type": "input_file"}]}]})").param,
            "input[2].content[0].type");
  const ApiError e = parse_error(R"({"input": "x", "tool_choice": "none", "tools": [{"type": "function", "name": "f", "parameters": {"type": "array"}}]})");
  EXPECT_EQ(e.param, "tools[0].parameters");  // chat's tools[0].function.parameters
  EXPECT_NE(e.message.find("'tools[0].parameters'"), std::string::npos) << e.message;
  EXPECT_EQ(parse_error(R"({"input": "x", "max_output_tokens": 0})").param, "max_output_tokens");
  EXPECT_EQ(parse_error(R"({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": 3}}})").param, "text.format.schema");
  EXPECT_EQ(parse_error(R"({"input": "x", "tools": [{"type": "file_search"}]})").param, "tools[0].type");
}

TEST(ResponsesRequest, SettingsAreEchoedAndMapped) {
  if (!context()) GTEST_SKIP() << "model missing";
  const ResponsesRequest r = parse(R"({"input": "x", "max_output_tokens": 7, "temperature": 0.5, "top_p": 0.9, "store": false,
      "include": ["message.output_text.logprobs"], "top_logprobs": 2, "metadata": {"b": "1", "a": "2"},
      "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}], "tool_choice": {"type": "function", "name": "f"}})");
  EXPECT_EQ(r.chat.params.max_tokens, 7);
  EXPECT_FLOAT_EQ(r.chat.params.sampling.temperature, 0.5f);
  EXPECT_TRUE(r.logprobs);
  EXPECT_EQ(r.chat.params.logprobs, 2);
  EXPECT_EQ(r.chat.tool_choice.kind, kv::ToolChoice::Kind::kNamed);
  EXPECT_FALSE(r.store);
  EXPECT_EQ(r.settings["metadata"].dump(), R"({"b":"1","a":"2"})");  // the client's order
  EXPECT_EQ(r.settings["tools"][0]["name"], "f");
  EXPECT_EQ(r.settings["tool_choice"]["name"], "f");
  EXPECT_EQ(r.settings["max_output_tokens"], 7);
  const ResponsesRequest t = parse(R"({"input": "x", "text": {"format": {"type": "json_schema", "name": "n", "schema": {"type": "object"}}}})");
  EXPECT_EQ(t.settings["text"]["format"]["type"], "json_schema");
  EXPECT_EQ(t.settings["text"]["format"]["name"], "n");
  // a named tool choice and a text format both constrain the answer: one per request
  EXPECT_EQ(parse_error(R"({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "f"},
                            "text": {"format": {"type": "json_object"}}})").param, "tool_choice");
}

std::string output_text(const ordered& response) {
  std::string s;
  for (const auto& item : response["output"])
    if (item["type"] == "message")
      for (const auto& p : item["content"]) s += p["text"].get<std::string>();
  return s;
}

TEST(ResponseBuilder, StreamedAndWholeGiveTheSameResponse) {
  if (!context()) GTEST_SKIP() << "model missing";
  const ResponsesRequest r = parse(R"({"input": "x"})");
  const std::string text = "Hello, world: caf\xC3\xA9.";
  kv::Usage u;
  u.prompt_tokens = 5;
  u.completion_tokens = 4;
  u.cached_tokens = 2;
  ResponseBuilder whole(r, "resp_1", 1, "m", *context()->ctx.tok);
  whole.begin();
  whole.push(text, {});
  whole.finish("stop", u);
  ResponseBuilder streamed(r, "resp_1", 1, "m", *context()->ctx.tok);
  std::vector<ordered> events = streamed.begin();
  for (char ch : text)
    for (auto& e : streamed.push(std::string(1, ch), {})) events.push_back(std::move(e));
  for (auto& e : streamed.finish("stop", u)) events.push_back(std::move(e));
  ordered a = whole.response(), b = streamed.response();
  a["output"][0].erase("id"), b["output"][0].erase("id");
  EXPECT_EQ(a, b);
  EXPECT_EQ(output_text(a), text);
  EXPECT_EQ(a["status"], "completed");
  EXPECT_EQ(a["usage"]["input_tokens_details"]["cached_tokens"], 2);
  EXPECT_EQ(a["usage"]["total_tokens"], 9);
  std::string deltas;
  for (size_t k = 0; k < events.size(); ++k) {
    EXPECT_EQ(events[k]["sequence_number"], k);
    if (events[k]["type"] == "response.output_text.delta") deltas += events[k]["delta"].get<std::string>();
  }
  EXPECT_EQ(deltas, text);
  EXPECT_EQ(events.front()["type"], "response.created");
  EXPECT_EQ(events.back()["type"], "response.completed");
  EXPECT_EQ(events.back()["response"], streamed.response());
}

TEST(ResponseBuilder, LengthIsIncompleteAndAnEmptyAnswerIsAnEmptyMessage) {
  if (!context()) GTEST_SKIP() << "model missing";
  const ResponsesRequest r = parse(R"({"input": "x"})");
  ResponseBuilder b(r, "resp_1", 1, "m", *context()->ctx.tok);
  b.begin();
  const auto events = b.finish("length", {});
  EXPECT_EQ(b.response()["status"], "incomplete");
  EXPECT_EQ(b.response()["incomplete_details"]["reason"], "max_output_tokens");
  ASSERT_EQ(b.output().size(), 1u);
  EXPECT_EQ(b.output()[0]["status"], "incomplete");
  EXPECT_EQ(output_text(b.response()), "");
  EXPECT_EQ(events.back()["type"], "response.incomplete");
}

TEST(ResponseBuilder, ANamedToolChoiceIsOneFunctionCallItem) {
  if (!context()) GTEST_SKIP() << "model missing";
  const ResponsesRequest r = parse(R"({"input": "x", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
                                       "tool_choice": {"type": "function", "name": "f"}})");
  ResponseBuilder b(r, "resp_1", 1, "m", *context()->ctx.tok);
  std::vector<ordered> events = b.begin();
  for (const char* piece : {"{\"a\"", ": 1}"})
    for (auto& e : b.push(piece, {})) events.push_back(std::move(e));
  for (auto& e : b.finish("stop", {})) events.push_back(std::move(e));
  ASSERT_EQ(b.output().size(), 1u);
  const ordered& fc = b.output()[0];
  EXPECT_EQ(fc["type"], "function_call");
  EXPECT_EQ(fc["name"], "f");
  EXPECT_EQ(fc["arguments"], "{\"a\": 1}");
  EXPECT_EQ(fc["status"], "completed");
  EXPECT_EQ(fc["call_id"].get<std::string>().rfind("call_", 0), 0u);
  std::vector<std::string> types;
  for (const auto& e : events) types.push_back(e["type"]);
  EXPECT_EQ(types, (std::vector<std::string>{"response.created", "response.in_progress", "response.output_item.added",
                                             "response.function_call_arguments.delta", "response.function_call_arguments.delta",
                                             "response.function_call_arguments.done", "response.output_item.done", "response.completed"}));
}

std::shared_ptr<StoredResponse> stored(const std::string& tenant) {
  auto s = std::make_shared<StoredResponse>();
  s->tenant = tenant;
  return s;
}

TEST(ResponseStore, KeepsTheMostRecentlyUsedAndTenantsApart) {
  kv::ResponseStore store(2, size_t(1) << 20);
  store.put("a", stored(""));
  store.put("b", stored(""));
  ASSERT_TRUE(store.get("a", ""));  // a used: b is the oldest
  store.put("c", stored(""));
  EXPECT_FALSE(store.get("b", ""));
  EXPECT_TRUE(store.get("a", ""));
  EXPECT_TRUE(store.get("c", ""));
  EXPECT_EQ(store.size(), 2u);
  store.put("k", stored("key:1/"));
  EXPECT_FALSE(store.get("k", "key:2/"));
  EXPECT_FALSE(store.erase("k", "key:2/"));
  EXPECT_TRUE(store.get("k", "key:1/"));
  EXPECT_TRUE(store.erase("k", "key:1/"));
  EXPECT_FALSE(store.get("k", "key:1/"));
  kv::ResponseStore none(0, size_t(1) << 20);
  none.put("a", stored(""));
  EXPECT_FALSE(none.enabled());
  EXPECT_FALSE(none.get("a", ""));
}

// Each response keeps its whole conversation: the bytes are bounded too, oldest first.
TEST(ResponseStore, KeepsItsBytesWithinTheBound) {
  auto big = [](const std::string& text) {
    auto s = stored("");
    s->conversation.push_back({{"type", "message"}, {"role", "user"}, {"content", text}});
    return s;
  };
  kv::ResponseStore probe(1, size_t(1) << 20);
  probe.put("p", big(std::string(1000, 'x')));
  const size_t one = probe.bytes();
  ASSERT_GT(one, 1000u);
  kv::ResponseStore store(100, 3 * one + 10);
  for (const char* id : {"a", "b", "c"}) store.put(id, big(std::string(1000, 'x')));
  EXPECT_EQ(store.size(), 3u);
  EXPECT_EQ(store.bytes(), 3 * one);
  store.put("d", big(std::string(1000, 'x')));  // a goes
  EXPECT_FALSE(store.get("a", ""));
  EXPECT_TRUE(store.get("d", ""));
  EXPECT_EQ(store.bytes(), 3 * one);
  store.put("huge", big(std::string(4000, 'x')));  // larger than the bound alone: not kept, nothing evicted
  EXPECT_FALSE(store.get("huge", ""));
  EXPECT_EQ(store.size(), 3u);
  store.put("b", big("short"));  // replacing an entry frees its bytes
  EXPECT_LT(store.bytes(), 3 * one);
  EXPECT_TRUE(store.erase("b", ""));
  EXPECT_EQ(store.bytes(), 2 * one);
}

}  // namespace
