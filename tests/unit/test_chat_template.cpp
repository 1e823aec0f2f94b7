// Chat-template renderer against transformers' renderer (the golden cases of
// tests/data/chat_template/cases.json, made by tests/chat_template/make_cases.py), byte for byte; plus
// syntax-error positions, raise_exception messages, and bounds on hostile templates.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <gtest/gtest.h>

#include <chrono>
#include <fstream>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>
#include <span>
#include <string>

#include "tokenizer/chat_template.h"

namespace kv {
namespace {

using ojson = nlohmann::ordered_json;

const std::string kCases = std::string(KV_SOURCE_DIR) + "/tests/data/chat_template/cases.json";

const ojson& cases() {
  static const ojson j = [] {
    std::ifstream in(kCases);
    if (!in) return ojson();
    std::stringstream ss;
    ss << in.rdbuf();
    return ojson::parse(ss.str());
  }();
  return j;
}

std::string escape_for_log(const std::string& s) { return ojson(s).dump(); }

// Every case of templates whose key starts with `prefix`.
void run_golden(const std::string& prefix, int min_cases) {
  const ojson& j = cases();
  ASSERT_TRUE(j.is_object()) << kCases << " missing: run tests/chat_template/make_cases.py";
  std::map<std::string, Result<ChatTemplate>> parsed;
  int n = 0, n_ok = 0;
  std::string failures;
  for (const auto& c : j["cases"]) {
    const std::string tname = c["template"];
    if (tname.rfind(prefix, 0) != 0) continue;
    ++n;
    auto it = parsed.find(tname);
    if (it == parsed.end())
      it = parsed.emplace(tname, ChatTemplate::parse(j["templates"][tname].get<std::string>())).first;
    const std::string name = c["name"];
    if (!it->second) {
      failures += name + ": parse failed: " + it->second.message() + "\n";
      continue;
    }
    auto r = it->second->render_json(c["messages"], c["add_generation_prompt"].get<bool>(),
                                     c["bos_token"].get<std::string>(), c["eos_token"].get<std::string>(),
                                     c["extra"]);
    if (c.contains("expected")) {
      const std::string want = c["expected"];
      if (!r) {
        failures += name + ": error " + r.message() + "\n";
      } else if (*r != want) {
        failures += name + ":\n  want " + escape_for_log(want) + "\n  got  " + escape_for_log(*r) + "\n";
      } else {
        ++n_ok;
      }
    } else {
      const std::string want = c["error"];
      const std::string kTemplateError = "TemplateError: ";
      if (r) {
        failures += name + ": want error " + want + ", got " + escape_for_log(*r) + "\n";
      } else if (want.rfind(kTemplateError, 0) == 0 && r.message() != want.substr(kTemplateError.size())) {
        failures += name + ": want raise_exception message " + want + ", got " + r.message() + "\n";
      } else {
        ++n_ok;
      }
    }
  }
  EXPECT_GE(n, min_cases) << "too few cases for " << prefix;
  EXPECT_EQ(n_ok, n) << failures;
  std::printf("[chat_template] %s: %d/%d cases match transformers\n", prefix.c_str(), n_ok, n);
}

TEST(ChatTemplateGolden, SmolLM2) { run_golden("smollm2", 20); }
TEST(ChatTemplateGolden, Gemma3) { run_golden("gemma3", 20); }
TEST(ChatTemplateGolden, Llama3Representative) { run_golden("llama3", 20); }
TEST(ChatTemplateGolden, ChatmlQwenRepresentative) { run_golden("chatml_qwen", 20); }
TEST(ChatTemplateGolden, MistralRepresentative) { run_golden("mistral", 20); }
TEST(ChatTemplateGolden, Phi3Representative) { run_golden("phi3", 20); }
TEST(ChatTemplateGolden, Features) { run_golden("feature_", 40); }
TEST(ChatTemplateGolden, ChatmlBuiltin) { run_golden("chatml", 40); }  // and chatml_qwen

// The templates compiled into the binary (templates/*.jinja, `--chat-template NAME`) are the ones the
// golden cases render, byte for byte, so the golden tests above cover them.
TEST(ChatTemplate, BuiltinsAreTheGoldenCasesTemplates) {
  const ojson& j = cases();
  ASSERT_TRUE(j.is_object());
  const std::vector<std::string> names = builtin_chat_template_names();
  ASSERT_EQ(names, (std::vector<std::string>{"chatml", "gemma3"}));
  for (const std::string& name : names) {
    auto t = load_chat_template(name);
    ASSERT_TRUE(t) << name << ": " << t.message();
    ASSERT_TRUE(j["templates"].contains(name)) << name;
    EXPECT_EQ(t->source(), j["templates"][name].get<std::string>()) << name;
  }
}

TEST(ChatTemplate, LoadTakesANameAFileOrTheTemplate) {
  const std::string dir = ::testing::TempDir();
  const std::string path = dir + "/kv_chat_template_test.jinja";
  {
    std::ofstream(path) << "{% for m in messages %}[{{ m.content }}]{% endfor %}";
  }
  auto from_file = load_chat_template(path);
  ASSERT_TRUE(from_file) << from_file.message();
  auto r = from_file->render({{"user", "a"}, {"assistant", "b"}}, false, "", "");
  ASSERT_TRUE(r);
  EXPECT_EQ(*r, "[a][b]");

  auto inline_t = load_chat_template("{{ messages[0].content }}!");
  ASSERT_TRUE(inline_t) << inline_t.message();
  EXPECT_EQ(*inline_t->render({{"user", "hi"}}, false, "", ""), "hi!");

  auto missing = load_chat_template(dir + "/no_such_template.jinja");
  ASSERT_FALSE(missing);
  EXPECT_NE(missing.message().find("no such file, and not a built-in template (chatml, gemma3)"), std::string::npos)
      << missing.message();
  auto bad_inline = load_chat_template("{% if x %}");
  ASSERT_FALSE(bad_inline);
  EXPECT_EQ(bad_inline.message().rfind("(taken as the template itself) chat template syntax error", 0), 0u)
      << bad_inline.message();
  {
    std::ofstream(path) << "{% for m in messages %}";
  }
  auto bad_file = load_chat_template(path);
  ASSERT_FALSE(bad_file);
  EXPECT_EQ(bad_file.message().rfind(path + ": chat template syntax error", 0), 0u) << bad_file.message();
  std::remove(path.c_str());
}

const std::string& smol_template() {
  static const std::string s = cases()["templates"]["smollm2"].get<std::string>();
  return s;
}
const std::string& gemma_template() {
  static const std::string s = cases()["templates"]["gemma3"].get<std::string>();
  return s;
}

TEST(ChatTemplate, ChatMessageApiMatchesJson) {
  ASSERT_TRUE(cases().is_object());
  auto t = ChatTemplate::parse(smol_template());
  ASSERT_TRUE(t) << t.message();
  auto r = t->render({{"user", "Hi"}, {"assistant", "Hello"}, {"user", "Bye"}}, true, "", "");
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(*r,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
            "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello<|im_end|>\n"
            "<|im_start|>user\nBye<|im_end|>\n<|im_start|>assistant\n");
}

TEST(ChatTemplate, GemmaRejectsNonAlternatingRoles) {
  ASSERT_TRUE(cases().is_object());
  auto t = ChatTemplate::parse(gemma_template());
  ASSERT_TRUE(t) << t.message();
  const std::string kMsg = "Conversation roles must alternate user/assistant/user/assistant/...";
  for (const auto& msgs : std::vector<std::vector<ChatMessage>>{
           {{"user", "a"}, {"user", "b"}},
           {{"assistant", "a"}},
           {{"user", "a"}, {"assistant", "b"}, {"tool", "c"}},
           {{"system", "s"}, {"system", "t"}}}) {
    auto r = t->render(msgs, true, "<bos>", "<eos>");
    ASSERT_FALSE(r);
    EXPECT_EQ(r.message(), kMsg);
  }
  // The system turn is folded into the first user turn, and content is trimmed.
  auto ok = t->render({{"system", "S"}, {"user", "  u  "}}, true, "<bos>", "<eos>");
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(*ok, "<bos><start_of_turn>user\nS\n\nu<end_of_turn>\n<start_of_turn>model\n");
}

TEST(ChatTemplate, RaiseExceptionPropagatesMessage) {
  auto t = ChatTemplate::parse("{% if messages | length > 1 %}{{ raise_exception('too many: ' ~ messages | length) }}"
                               "{% endif %}ok");
  ASSERT_TRUE(t) << t.message();
  auto good = t->render({{"user", "x"}}, false, "", "");
  ASSERT_TRUE(good);
  EXPECT_EQ(*good, "ok");
  auto bad = t->render({{"user", "x"}, {"user", "y"}}, false, "", "");
  ASSERT_FALSE(bad);
  EXPECT_EQ(bad.message(), "too many: 2");
  // without a message (found by fuzz_text): still an error that says what happened
  for (const char* src : {"{{ raise_exception() }}", "{{ raise_exception('') }}"}) {
    auto bare = ChatTemplate::parse(src);
    ASSERT_TRUE(bare) << bare.message();
    auto r = bare->render({{"user", "x"}}, false, "", "");
    ASSERT_FALSE(r);
    EXPECT_EQ(r.message(), "raise_exception() without a message") << src;
  }
}

TEST(ChatTemplate, SyntaxErrorsNamePosition) {
  struct Bad {
    const char* src;
    const char* where;
  };
  for (const Bad& b : {Bad{"hello {{ x + }}", "line 1, column 14"},
                       Bad{"a\nb\n  {% if x %}\nno end", "line 4"},
                       Bad{"{% for x in %}{% endfor %}", "line 1, column 13"},
                       Bad{"{{ 'unterminated }}", "line 1, column 4"},
                       Bad{"line1\n{% frobnicate %}", "line 2, column 4"},
                       Bad{"{# never closed", "line 1, column 1"},
                       Bad{"{{ (1 + 2 }}", "line 1"},
                       Bad{"{% endif %}", "line 1"},
                       Bad{"{{ x | }}", "line 1"},
                       // A slice inside a tuple subscript (the fuzzer's crash: its node had no
                       // object to slice, and rendering dereferenced null).
                       Bad{"{{ x[1, 2:, 3] }}", "line 1, column 9"},
                       Bad{"{{ messages[:1, 0] }}", "line 1, column 13"}}) {
    auto t = ChatTemplate::parse(b.src);
    ASSERT_FALSE(t) << b.src;
    EXPECT_NE(t.message().find(b.where), std::string::npos) << b.src << " -> " << t.message();
  }
}

TEST(ChatTemplate, RuntimeErrorsNamePosition) {
  auto t = ChatTemplate::parse("ok\n{{ messages[0].content + 1 }}");
  ASSERT_TRUE(t);
  auto r = t->render({{"user", "x"}}, false, "", "");
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("line 2"), std::string::npos) << r.message();
  EXPECT_NE(r.message().find("TypeError"), std::string::npos) << r.message();
}

// Renders each template on one user message and expects its text.
void expect_renders(std::span<const std::pair<const char*, const char*>> cases) {
  for (const auto& [src, want] : cases) {
    auto t = ChatTemplate::parse(src);
    ASSERT_TRUE(t) << src << ": " << t.message();
    auto r = t->render({{"user", "x"}}, false, "", "");
    ASSERT_TRUE(r) << src << ": " << r.message();
    EXPECT_EQ(*r, want) << src;
  }
}

// A bound on a render that must not run away (hours if it did), not a speed check: sanitized
// builds (KV_TEST_SLOWDOWN) are several times slower.
double runaway_limit_s() {
  const char* slowdown = std::getenv("KV_TEST_SLOWDOWN");
  return 10.0 * (slowdown ? std::max(1.0, std::atof(slowdown)) : 1.0);
}

// Hostile templates: every one must fail (or finish) quickly, without crashing.
TEST(ChatTemplate, HostileTemplatesAreBounded) {
  const char* hostile[] = {
      "{% for a in range(100000) %}{% for b in range(100000) %}{% for c in range(100000) %}x{% endfor %}"
      "{% endfor %}{% endfor %}",
      "{% for i in range(9223372036854775807) %}{% endfor %}",
      "{{ 'x' * 9223372036854775807 }}",
      "{% set ns = namespace(s='ab') %}{% for i in range(100) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s }}",
      "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
      "{% macro f() %}{{ f() }}{{ f() }}{% endmacro %}{{ f() }}",
      "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}"
      "{{ ns.l | length }}",
      "{{ [1, 2, 3] * 9223372036854775807 }}",
      "{{ 2 ** 9223372036854775807 }}",
      "{{ ('x' * 10000000) | replace('', 'yyyyyyyyyy') }}",
      "{{ ('x\\n' * 1000000) | indent(1000) }}",
      // Many references to one big string: printing or joining them must hit a cap, not exhaust memory.
      "{% set s = 'x' * 30000000 %}{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
      "{% set ns.l = ns.l + [s] %}{% endfor %}{{ ns.l }}",
      "{% set s = 'x' * 30000000 %}{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
      "{% set ns.l = ns.l + [s ~ i] %}{% endfor %}{{ ns.l | length }}",
      "{% set s = 'x' * 30000000 %}{{ [s, s, s, s, s] | join }}",
      "{% set s = 'x' * 30000000 %}{{ [s, s, s, s, s] | tojson }}",
  };
  const double limit_s = runaway_limit_s();
  for (const char* src : hostile) {
    auto t = ChatTemplate::parse(src);
    ASSERT_TRUE(t) << src << ": " << t.message();
    auto start = std::chrono::steady_clock::now();
    auto r = t->render({{"user", "x"}}, false, "", "");
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_FALSE(r) << src;
    EXPECT_LT(secs, limit_s) << src;
  }
  // Deep syntactic nesting is a parse error, not a stack overflow.
  std::string deep = "{{ " + std::string(100000, '(') + "1" + std::string(100000, ')') + " }}";
  EXPECT_FALSE(ChatTemplate::parse(deep));
  std::string deep_not = "{{ ";
  for (int i = 0; i < 50000; ++i) deep_not += "not ";
  deep_not += "1 }}";
  EXPECT_FALSE(ChatTemplate::parse(deep_not));
  std::string deep_if;
  for (int i = 0; i < 5000; ++i) deep_if += "{% if true %}";
  for (int i = 0; i < 5000; ++i) deep_if += "{% endif %}";
  EXPECT_FALSE(ChatTemplate::parse(deep_if));
  std::string deep_neg = "{{ " + std::string(100000, '-') + "1 }}";
  EXPECT_FALSE(ChatTemplate::parse(deep_neg));
}

// Python's ints are unbounded, ours int64: a result or a float conversion outside it is an OverflowError
// (or the int filter's default), never a wrapped value, a trap (INT64_MIN // -1 is SIGFPE) or undefined
// behaviour; printf-style widths are bounded, not padded for seconds (found by the fuzz campaign of
// 2026-11-29 with UBSan; each of these crashed fuzz_text or ran past its timeout).
TEST(ChatTemplate, IntegerEdgesNeverWrap) {
  const std::pair<const char*, const char*> ok[] = {
      {"{{ (-9223372036854775807 - 1) % -1 }}|{{ 7 % -1 }}|{{ (-7) // 2 }}", "0|0|-4"},
      {"{{ range(1, 9223372036854775807, 9223372036854775807) | list }}", "[1]"},
      {"{{ range(-9223372036854775807 - 1, 9223372036854775807, 9223372036854775807) | length }}", "3"},
      {"{{ range(9223372036854775806, -9223372036854775807 - 1, -9223372036854775807) | list }}",
       "[9223372036854775806, -1]"},
      {"{{ (-1) ** 3 }}|{{ (-1) ** 4 }}|{{ 0 ** 0 }}|{{ 0 ** 5 }}|{{ 1 ** 99 }}|{{ (-2) ** 3 }}", "-1|1|1|0|1|-8"},
      {"{{ '%d' % 1e10 }}|{{ '%5d|%-4d|%.3f|%+i' % (42, 7, 2.5, 3.9) }}", "10000000000|   42|7   |2.500|+3"},
      {"{{ ('%200d' % 1) | length }}|{{ ('%.300f' % 1.5) | length }}", "200|302"},
      {"{{ '1e300' | int }}|{{ 1e300 | int(7) }}|{{ '2.5' | int }}|{{ -2.5 | int }}", "0|7|2|-2"},
      {"{{ 'a b  c'.split(none, 9223372036854775807) | length }}|{{ 'a b  c'.split(none, 1) | last }}", "3|b  c"},
  };
  expect_renders(ok);
  const std::pair<const char*, const char*> bad[] = {
      {"{{ (-9223372036854775807 - 1) // -1 }}", "OverflowError"},
      {"{{ -(-9223372036854775807 - 1) }}", "OverflowError"},
      {"{{ (-9223372036854775807 - 1) | abs }}", "OverflowError"},
      {"{{ [9223372036854775807, 1] | sum }}", "OverflowError"},
      {"{{ '%d' % 1e300 }}", "OverflowError"},
      {"{{ '%d' % ('nan' | float) }}", "ValueError"},
      {"{{ 'abc' | center(1e300) }}", "OverflowError"},
      {"{{ '%2147483647d' % 1 }}", "format width larger than 4096"},
      {"{{ '%.99999999999f' % 1.5 }}", "format precision larger than 4096"},
  };
  for (const auto& [src, what] : bad) {
    auto t = ChatTemplate::parse(src);
    ASSERT_TRUE(t) << src << ": " << t.message();
    auto start = std::chrono::steady_clock::now();
    auto r = t->render({{"user", "x"}}, false, "", "");
    double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    ASSERT_FALSE(r) << src << " -> " << *r;
    EXPECT_NE(r.message().find(what), std::string::npos) << src << " -> " << r.message();
    EXPECT_LT(secs, runaway_limit_s()) << src;  // '%2147483647d' took 48 s
  }
}

// jinja2's truncate filter (missing: "No filter named 'truncate'"), lengths in code points and
// jinja2's default leeway of 5. Expected values are jinja2 3.1's, from
// jinja2.Environment().from_string(SRC).render() for each SRC below.
TEST(ChatTemplate, TruncateFilterIsJinja2s) {
  const std::pair<const char*, const char*> ok[] = {
      {"{{ 'foo bar baz qux'|truncate(9) }}", "foo..."},
      {"{{ 'héllo wörld'|truncate(8, leeway=0) }}", "héllo..."},
      {"{{ 'héllo wörld'|truncate(8, True, '…', 0) }}", "héllo w…"},
      {"{{ 'ééééé'|truncate(4, end='', leeway=0) }}", "éééé"},
  };
  expect_renders(ok);
  auto t = ChatTemplate::parse("{{ 'abcdef'|truncate(2) }}");  // jinja2: AssertionError: expected length >= 3, got 2
  ASSERT_TRUE(t);
  auto r = t->render({{"user", "x"}}, false, "", "");
  ASSERT_FALSE(r);
  EXPECT_NE(r.message().find("expected length >= 3, got 2"), std::string::npos) << r.message();
}

// printf-style widths and %s precisions count code points, as Python's: '%5s' % 'é' padded by the
// bytes, and the width was not applied to %s at all. Expected: Python 3's
// '%5s|%-4s|%.2s' % ('é', '日本', 'ñandú') and '{:>5}|{:^6}|{:.2}|{:*<4}'.format('é', '日本', 'ñandú', 'ü'),
// '{:05.1f}|{:+d}|{:.3}'.format(-1.25, 3, 100.0).
TEST(ChatTemplate, FormatWidthsCountCodePointsAndStrFormatTakesSpecs) {
  const std::pair<const char*, const char*> ok[] = {
      {"{{ '%5s|%-4s|%.2s' % ('é', '日本', 'ñandú') }}", "    é|日本  |ña"},
      {"{{ '{:>5}|{:^6}|{:.2}|{:*<4}'.format('é', '日本', 'ñandú', 'ü') }}", "    é|  日本  |ña|ü***"},
      {"{{ '{:05.1f}|{:+d}|{:.3}'.format(-1.25, 3, 100.0) }}", "-01.2|+3|1e+02"},
  };
  expect_renders(ok);
  // What str.format here does not implement is an error, never a different text: Python renders
  // each of these ('1,000', '1.0', '1000', '1', 'x', "'\\xe9'").
  for (const char* src : {"{{ '{:,}'.format(1000) }}", "{{ '{:z}'.format(1.0) }}", "{{ '{:n}'.format(1000) }}",
                          "{{ '{:{}}'.format(1, 3) }}", "{{ '{0[0]}'.format('x') }}", "{{ '{!a}'.format('é') }}",
                          "{{ '{:c}'.format(65) }}", "{{ '%x' % 255 }}"}) {
    auto t = ChatTemplate::parse(src);
    ASSERT_TRUE(t) << src;
    auto r = t->render({{"user", "x"}}, false, "", "");
    EXPECT_FALSE(r) << src << " -> " << *r;
  }
}

// A namespace is the one mutable value, so the one way to build a reference cycle. The render frees every
// namespace it made, cycles included, whether it succeeds or throws (under ASan, LeakSanitizer checks;
// the fuzzer found `set ns.n = ns` leaking). How a cycle prints is in the golden features/ns_cycle_* cases.
TEST(ChatTemplate, NamespaceCyclesAreFreed) {
  const std::pair<const char*, const char*> ok[] = {
      {"{% set ns = namespace(n=0) %}{% set ns.self = ns %}{{ ns.self.self.n }}", "0"},
      {"{% set ns = namespace(n=1) %}{% set ns.l = [ns, ns] %}{{ ns.l[1].l[0].n }}", "1"},
      {"{% set a = namespace(n=2) %}{% set b = namespace(a=a) %}{% set a.b = b %}{{ a.b.a.b.a.n }}", "2"},
      {"{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns %}{% endfor %}x", "x"},
  };
  expect_renders(ok);
  // Renders that fail after building a cycle free it too.
  const char* failing[] = {
      "{% set ns = namespace(n=0) %}{% set ns.self = ns %}{{ raise_exception('stop') }}",
      "{% set ns = namespace(n=0) %}{% set ns.self = ns %}{{ ns.self.missing.x }}",
      "{% set ns = namespace(n=0) %}{% set ns.self = [ns] %}{{ ns.self | tojson }}",
  };
  for (const char* src : failing) {
    auto t = ChatTemplate::parse(src);
    ASSERT_TRUE(t) << src << ": " << t.message();
    EXPECT_FALSE(t->render({{"user", "x"}}, false, "", "")) << src;
  }
}

TEST(ChatTemplate, ExtraVariablesAndDefaults) {
  auto t = ChatTemplate::parse("{{ tools is none }}|{{ documents is none }}|{{ date_string | default('none') }}|"
                               "{{ enable_thinking }}|{{ tools | length if tools else 0 }}");
  ASSERT_TRUE(t);
  auto r = t->render({}, false, "", "");
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(*r, "True|True|none||0");
  auto r2 = t->render({}, false, "", "",
                      nlohmann::json{{"date_string", "today"}, {"enable_thinking", false}, {"tools", {1, 2}}});
  ASSERT_TRUE(r2) << r2.message();
  EXPECT_EQ(*r2, "False|True|today|False|2");
}

TEST(ChatTemplate, MessagesCarryTheirExtraMembers) {
  // An assistant turn's tool calls and a tool result's id, as templates read them; members keep
  // the client's order through tojson.
  auto t = ChatTemplate::parse(
      "{% for m in messages %}{{ m.role }}:{{ m.content }}"
      "{% if m.tool_calls %}{% for c in m.tool_calls %}[{{ c.function.name }} {{ c.function.arguments | tojson }}]{% endfor %}{% endif %}"
      "{% if m.tool_call_id is defined %}({{ m.tool_call_id }}){% endif %}|{% endfor %}");
  ASSERT_TRUE(t);
  const nlohmann::ordered_json calls = nlohmann::ordered_json::parse(
      R"({"tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"z": 1, "a": [true]}}}]})");
  auto r = t->render({{"user", "q"}, {"assistant", "", {}, calls}, {"tool", "21", {}, {{"tool_call_id", "c1"}}}}, false, "", "");
  ASSERT_TRUE(r) << r.message();
  EXPECT_EQ(*r, "user:q|assistant:[f {\"z\": 1, \"a\": [true]}]|tool:21(c1)|");
}

TEST(ChatTemplate, Copyable) {
  auto t = ChatTemplate::parse("{{ bos_token }}{% for m in messages %}{{ m.role }}{% endfor %}");
  ASSERT_TRUE(t);
  ChatTemplate copy = *t;
  auto r = copy.render({{"a", ""}, {"b", ""}}, false, "<s>", "");
  ASSERT_TRUE(r);
  EXPECT_EQ(*r, "<s>ab");
}

}  // namespace
}  // namespace kv

namespace kv {
namespace {
// vLLM's content formats: a template that loops over a message's content takes parts; others a
// string, the parts joined by "\n" (the caller's join; render passes parts only to the first kind).
TEST(ChatTemplate, ContentPartsGoToTemplatesThatLoopOverContent) {
  EXPECT_TRUE(load_chat_template("gemma3")->iterates_content());
  EXPECT_TRUE(load_chat_template("chatml")->iterates_content());  // both built-ins take parts
  auto loops = ChatTemplate::parse("{% for m in messages %}{% for p in m.content %}[{{ p.text }}]{% endfor %}{% endfor %}");
  ASSERT_TRUE(loops.is_ok());
  EXPECT_TRUE(loops->iterates_content());
  ChatMessage m{"user", "a\nb", {"a", "b"}};
  EXPECT_EQ(*loops->render({m}, false, "", ""), "[a][b]");
  auto plain = ChatTemplate::parse("{% for m in messages %}<{{ m['content'] }}>{% endfor %}");
  ASSERT_TRUE(plain.is_ok());
  EXPECT_FALSE(plain->iterates_content());
  EXPECT_EQ(*plain->render({m}, false, "", ""), "<a\nb>");
}

// Content given as an empty list of parts reached the template as the empty string: Gemma 3's
// template then rendered a system prefix of "\n\n" where transformers' rendering (the oracle:
// the golden gemma3/system_empty_parts case) fails reading content[0]['text']. The list now goes
// through as given, [] included; ChatMessage renders as the same messages in JSON do.
TEST(ChatTemplate, AnEmptyListOfPartsReachesTheTemplateAsAList) {
  auto gemma = load_chat_template("gemma3");
  ASSERT_TRUE(gemma);
  ChatMessage empty_system{"system", "", {}, nullptr, /*given_as_parts=*/true};
  auto r = gemma->render({empty_system, {"user", "hi"}}, true, "<bos>", "<eos>");
  ASSERT_FALSE(r) << *r;
  EXPECT_NE(r.message().find("list object has no element 0"), std::string::npos) << r.message();
  auto json = gemma->render_json(ojson::parse(R"([{"role": "system", "content": []}, {"role": "user", "content": "hi"}])"), true,
                                 "<bos>", "<eos>", ojson::object());
  ASSERT_FALSE(json);
  EXPECT_EQ(r.message(), json.message());
  ChatMessage empty_user{"user", "", {}, nullptr, /*given_as_parts=*/true};
  auto u = gemma->render({empty_user}, true, "<bos>", "<eos>");
  ASSERT_TRUE(u) << u.message();
  EXPECT_EQ(*u, "<bos><start_of_turn>user\n<end_of_turn>\n<start_of_turn>model\n");  // transformers' (gemma3/user_empty_parts)
  // A template that takes content as a string still gets the empty text.
  auto plain = ChatTemplate::parse("{% for m in messages %}<{{ m.content }}>{% endfor %}");
  ASSERT_TRUE(plain);
  EXPECT_EQ(*plain->render({empty_user}, false, "", ""), "<>");
}

// An integer past int64 wrapped negative in the interpreter (12345678901234567890 rendered as
// -6101065172474983726, found by a black-box test; jinja2 keeps Python's exact int): it keeps its
// digits, printed and in tojson, in a message or a template variable.
TEST(ChatTemplate, IntegersPastInt64KeepTheirDigits) {
  auto t = load_chat_template("{{ n }}|{{ n | tojson }}|{{ messages[0].id }}|{{ messages[0].content }}");
  ASSERT_TRUE(t) << t.message();
  auto ok = t->render_json(ojson::array({{{"role", "user"}, {"content", "a"}, {"id", uint64_t{1} << 63}}}), false, "", "",
                           ojson{{"n", uint64_t{12345678901234567890ull}}});
  ASSERT_TRUE(ok) << ok.message();
  EXPECT_EQ(*ok, "12345678901234567890|12345678901234567890|9223372036854775808|a");
  auto max = t->render_json(ojson::array({{{"role", "user"}, {"content", "b"}, {"id", std::numeric_limits<int64_t>::max()}}}), false,
                            "", "", ojson{{"n", -1}});
  ASSERT_TRUE(max) << max.message();
  EXPECT_EQ(*max, "-1|-1|9223372036854775807|b");
}

}  // namespace
}  // namespace kv
