#include "server/openai_request.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <limits>
#include <mutex>
#include <optional>
#include <random>
#include <string_view>

#include "engine/engine.h"
#include "server/request_fields.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace kv {

using nlohmann::json;

namespace {

void check_model(const Fields& f, const ApiContext& ctx) {
  auto model = f.string("model");
  if (!model) return;  // as llama.cpp and vLLM: the one served model is the default
  if (std::find(ctx.model_names.begin(), ctx.model_names.end(), *model) != ctx.model_names.end()) return;
  throw ApiError{404, "The model `" + *model + "` does not exist. This server serves `" + ctx.model_names.at(0) + "`.",
                 "invalid_request_error", "model", "model_not_found"};
}

std::vector<std::string> parse_stop(const Fields& f, const ApiContext& ctx) {
  std::vector<std::string> out;
  const json* v = f.get("stop");
  if (!v) return out;
  if (v->is_string()) {
    out.push_back(v->get<std::string>());
  } else if (v->is_array()) {
    if (static_cast<int64_t>(v->size()) > ctx.max_stop)
      value_error("stop", "at most " + std::to_string(ctx.max_stop) + " stop sequences are allowed, got " + std::to_string(v->size()) + ".");
    for (const auto& s : *v) {
      if (!s.is_string()) type_error("stop", "a string or an array of strings", s);
      out.push_back(s.get<std::string>());
    }
  } else {
    type_error("stop", "a string or an array of strings", *v);
  }
  for (const auto& s : out) {
    if (s.empty()) value_error("stop", "stop sequences must not be empty.");
    if (s.size() > 1024) value_error("stop", "a stop sequence is longer than 1024 bytes.");
  }
  return out;
}

// Structured output, in each of the shapes clients send it (one per request):
//   OpenAI: response_format {"type": "json_object"} or {"type": "json_schema", "json_schema": {"schema": …}};
//   vLLM: guided_json / guided_regex / guided_choice / guided_grammar, and structured_outputs
//         {"json" | "regex" | "choice" | "grammar" | "json_object": …};
//   llama.cpp: json_schema, grammar (GBNF).
// Read here, compiled by compile_constraint (on the HTTP thread): a bad schema, regex or grammar is a 400.
struct ReadConstraint {
  OutputConstraint c;
  std::string given;          // the field that set it; empty: none
  bool options_only = false;  // structured_outputs held options (disable_any_whitespace) and no constraint
};

ReadConstraint read_constraint(const Fields& f) {
  ReadConstraint rc;
  OutputConstraint& c = rc.c;
  std::string& given = rc.given;
  auto set = [&](const std::string& name, OutputConstraint::Kind kind) {
    if (!given.empty())
      throw bad_request("Give one structured-output constraint per request; got '" + given + "' and '" + name + "'.", name, "invalid_value");
    given = name;
    c.kind = kind;
  };
  auto take_regex = [&](const std::string& name, const json& v) {
    if (!v.is_string()) type_error(name, "a string", v);
    if (v.get<std::string>().empty()) value_error(name, "must not be empty.");
    set(name, OutputConstraint::Kind::kRegex);
    c.spec = v.get<std::string>();
  };
  auto take_grammar = [&](const std::string& name, const json& v) {
    if (!v.is_string()) type_error(name, "a string (an EBNF/GBNF grammar whose start rule is 'root')", v);
    if (v.get<std::string>().empty()) value_error(name, "must not be empty.");
    set(name, OutputConstraint::Kind::kGrammar);
    c.spec = v.get<std::string>();
  };
  auto take_choice = [&](const std::string& name, const json& v) {
    if (!v.is_array() || v.empty()) type_error(name, "a non-empty array of strings", v);
    set(name, OutputConstraint::Kind::kChoice);
    for (const json& e : v) {
      if (!e.is_string()) type_error(name, "a non-empty array of strings", e);
      if (e.get<std::string>().empty()) value_error(name, "a choice must not be empty.");
      c.choices.push_back(e.get<std::string>());
    }
  };
  auto take_schema = [&](const std::string& name, const json& v, const std::string& pointer) {
    set(name, OutputConstraint::Kind::kJsonSchema);
    c.spec = schema_text(name, v, pointer);
  };

  if (const json* rf = f.get("response_format")) {
    if (!rf->is_object()) type_error("response_format", "an object", *rf);
    Fields rff(*rf);
    if (!rff.get("type")) missing_parameter("response_format.type");  // OpenAI's 400 (it read as text here)
    const std::string type = *rff.string("type");
    if (type == "json_object") {
      // llama-server's form: a schema beside json_object constrains to it (it was ignored here).
      if (const json* schema = rff.get("schema")) take_schema("response_format", *schema, "/response_format/schema");
      else set("response_format", OutputConstraint::Kind::kJson);
    } else if (type == "json_schema") {
      const json* js = rff.get("json_schema");
      if (!js) value_error("response_format", "type 'json_schema' needs a 'json_schema' object with a 'schema'.");
      if (!js->is_object()) type_error("response_format", "a 'json_schema' object", *js);
      Fields jsf(*js);
      // OpenAI's (and vLLM's) rule for the name: required, 1-64 of a-z A-Z 0-9 _ -.
      const std::optional<std::string> name = jsf.string("name");
      if (!name) missing_parameter("response_format.json_schema.name");
      const bool name_ok = !name->empty() && name->size() <= 64 && std::all_of(name->begin(), name->end(), [](char ch) {
        return (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' || ch == '-';
      });
      if (!name_ok)
        value_error("response_format.json_schema.name", "must be 1 to 64 of a-z, A-Z, 0-9, '_' and '-', got \"" + *name + "\".");
      const json* schema = jsf.get("schema");
      if (!schema) value_error("response_format", "its 'json_schema' needs a 'schema'.");
      take_schema("response_format", *schema, "/response_format/json_schema/schema");
    } else if (type != "text") {
      value_error("response_format", "type must be 'text', 'json_object' or 'json_schema', got '" + type + "'.");
    }
  }
  if (const json* v = f.get("guided_json")) take_schema("guided_json", *v, "/guided_json");
  if (const json* v = f.get("guided_regex")) take_regex("guided_regex", *v);
  if (const json* v = f.get("guided_choice")) take_choice("guided_choice", *v);
  if (const json* v = f.get("guided_grammar")) take_grammar("guided_grammar", *v);
  if (const json* v = f.get("json_schema")) take_schema("json_schema", *v, "/json_schema");  // llama.cpp
  if (const json* v = f.get("grammar")) take_grammar("grammar", *v);          // llama.cpp (GBNF)
  if (const json* so = f.get("structured_outputs")) {
    if (!so->is_object()) type_error("structured_outputs", "an object", *so);
    Fields sf(*so);
    for (const auto& [key, v] : so->items())  // a misspelt constraint must not give free text
      if (!(key == "json" || key == "regex" || key == "choice" || key == "grammar" || key == "json_object" ||
            key == "disable_any_whitespace" || key == "structural_tag" || key == "whitespace_pattern" ||
            key == "disable_fallback" || key == "disable_additional_properties"))
        value_error("structured_outputs", "unknown field '" + key +
                                              "' (json, regex, choice, grammar, json_object, disable_any_whitespace, disable_additional_properties).");
    if (const json* v = sf.get("json")) take_schema("structured_outputs.json", *v, "/structured_outputs/json");
    if (const json* v = sf.get("regex")) take_regex("structured_outputs.regex", *v);
    if (const json* v = sf.get("choice")) take_choice("structured_outputs.choice", *v);
    if (const json* v = sf.get("grammar")) take_grammar("structured_outputs.grammar", *v);
    if (sf.boolean("json_object").value_or(false)) set("structured_outputs.json_object", OutputConstraint::Kind::kJson);
    for (const char* name : {"structural_tag", "whitespace_pattern"})
      if (sf.requested(name)) unsupported(std::string("structured_outputs.") + name, "");
    if (sf.boolean("disable_any_whitespace").value_or(false)) c.any_whitespace = false;
    // vLLM's option: objects take no property their schema does not list. xgrammar's strict mode
    // (how schemas compile here) already does so; only its type is checked.
    (void)sf.boolean("disable_additional_properties");
    rc.options_only = given.empty();
  }
  if (f.requested("guided_whitespace_pattern")) unsupported("guided_whitespace_pattern", "");
  for (const char* name : {"structural_tag", "regex"})
    if (f.requested(name)) unsupported(name, "");
  return rc;
}

// The constraint read (if any) compiled into r's parameters. A structured_outputs object that
// names no constraint is refused here: a misspelt one would otherwise give free text (a tool
// choice's constraint takes its options first: parse_chat_request).
void compile_constraint(const ReadConstraint& rc, const ApiContext& ctx, ApiRequest* r) {
  if (rc.options_only) value_error("structured_outputs", "names no constraint (json, regex, choice, grammar or json_object).");
  if (rc.c.kind == OutputConstraint::Kind::kNone) return;
  if (ctx.constraints_forwarded) return;  // the router: the backend compiles (and answers a bad one)
  if (!ctx.constraints) unsupported(rc.given, "structured output is not available here.");
  try {
    r->params.constraint = ctx.constraints->compile(rc.c);
  } catch (const std::invalid_argument& e) {
    value_error(rc.given, e.what());
  }
}

// Fields shared by both endpoints: sampling, n, stop, stream, penalties, cache_salt; the
// structured-output constraint is read into *rc, for the caller to compile.
void parse_common(const Fields& f, const ApiContext& ctx, ApiRequest* r, ReadConstraint* rc) {
  check_model(f, ctx);
  SamplingParams& sp = r->params.sampling;
  sp.temperature = static_cast<float>(f.number("temperature", 0.0, 2.0).value_or(1.0));  // OpenAI's default is 1
  sp.top_p = static_cast<float>(f.number("top_p", 0.0, 1.0, /*lo_open=*/true).value_or(1.0));
  int64_t top_k = f.integer("top_k", -1, std::numeric_limits<int32_t>::max()).value_or(0);
  sp.top_k = top_k < 0 ? 0 : static_cast<int32_t>(top_k);  // vLLM: -1 means off
  sp.min_p = static_cast<float>(f.number("min_p", 0.0, 1.0).value_or(0.0));
  sp.repetition_penalty = static_cast<float>(f.number("repetition_penalty", 0.0, 10.0, /*lo_open=*/true).value_or(1.0));
  sp.presence_penalty = static_cast<float>(f.number("presence_penalty", -2.0, 2.0).value_or(0.0));
  sp.frequency_penalty = static_cast<float>(f.number("frequency_penalty", -2.0, 2.0).value_or(0.0));
  auto seed = f.integer("seed", std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max());
  sp.seed = seed ? static_cast<uint64_t>(*seed) : random_seed();

  r->params.n = static_cast<int32_t>(f.integer("n", 1, ctx.max_n).value_or(1));
  r->params.stop = parse_stop(f, ctx);
  r->params.ignore_eos = f.boolean("ignore_eos").value_or(false);
  if (auto salt = f.string("cache_salt")) {
    if (salt->empty()) value_error("cache_salt", "must not be empty.");
    r->params.cache_namespace = *salt;
  }

  r->stream = f.boolean("stream").value_or(false);
  if (const json* so = f.get("stream_options")) {
    if (!so->is_object()) type_error("stream_options", "an object", *so);
    if (!r->stream) value_error("stream_options", "stream_options is only allowed when 'stream' is true.");
    Fields sf(*so);
    r->include_usage = sf.boolean("include_usage").value_or(false);
    // vLLM: with include_usage, every chunk also carries the usage so far.
    r->continuous_usage = r->include_usage && sf.boolean("continuous_usage_stats").value_or(false);
  }

  if (const json* lb = f.get("logit_bias")) {  // OpenAI's: {"token id": bias in [-100, 100]}, added to the logits
    if (!lb->is_object()) type_error("logit_bias", "an object mapping token ids to biases", *lb);
    if (lb->size() > 1024) value_error("logit_bias", "at most 1024 tokens.");
    for (const auto& [key, v] : lb->items()) {
      int64_t id = -1;
      const auto [end, ec] = std::from_chars(key.data(), key.data() + key.size(), id);
      if (ec != std::errc() || end != key.data() + key.size() || key.empty())
        value_error("logit_bias", "'" + key + "' is not a token id.");
      if (id < 0 || id >= ctx.tok->n_vocab())
        value_error("logit_bias", "token id " + key + " is outside the vocabulary [0, " + std::to_string(ctx.tok->n_vocab()) + ").");
      if (!v.is_number()) type_error("logit_bias", "a number for each token", v);
      const double b = v.get<double>();
      if (!(b >= -100.0 && b <= 100.0)) value_error("logit_bias", "the bias of token " + key + " is " + num_text(b) + ", outside [-100, 100].");
      r->params.logit_bias.emplace_back(static_cast<int32_t>(id), static_cast<float>(b));
    }
    std::sort(r->params.logit_bias.begin(), r->params.logit_bias.end());
  }
  // vLLM's extensions that would change the answer and that this server does not implement:
  // refused, not ignored (an ignored one answers 200 with a different answer than asked for).
  // vLLM's prompt_logprobs: each prompt token's logprob (the first has none), its rank and the top k.
  if (auto k = f.integer("prompt_logprobs", 0, ctx.max_logprobs)) {
    r->params.prompt_logprobs = static_cast<int32_t>(*k);
    r->prompt_logprobs = true;
  }
  // vLLM's min_tokens: checked against max_tokens once that is known (check_min_tokens).
  r->params.min_tokens = static_cast<int32_t>(f.integer("min_tokens", 0, std::numeric_limits<int32_t>::max()).value_or(0));
  if (const json* v = f.get("stop_token_ids"); v && !v->is_null()) {
    if (!v->is_array()) type_error("stop_token_ids", "an array of token ids", *v);
    if (v->size() > 256) value_error("stop_token_ids", "at most 256 ids.");
    for (const json& t : *v) {
      if (!t.is_number_integer()) type_error("stop_token_ids", "an array of token ids", t);
      if (t.is_number_unsigned() ? t.get<uint64_t>() >= static_cast<uint64_t>(ctx.tok->n_vocab()) : (t.get<int64_t>() < 0 || t.get<int64_t>() >= ctx.tok->n_vocab()))
        value_error("stop_token_ids", "token id " + t.dump() + " is outside the vocabulary [0, " + std::to_string(ctx.tok->n_vocab()) + ").");
      r->params.stop_token_ids.push_back(t.get<int32_t>());
    }
  }
  // vLLM's include_stop_str_in_output: the stop string that ended a choice stays in its text.
  r->params.include_stop_str = f.boolean("include_stop_str_in_output").value_or(false);
  *rc = read_constraint(f);
  // vLLM's truncate_prompt_tokens: k ≥ 1 keeps a prompt's last k tokens, -1 its last max_model_len
  // (applied once the prompts are tokens: truncate_prompts).
  if (auto k = f.integer("truncate_prompt_tokens", -1, std::numeric_limits<int32_t>::max())) {
    if (*k == 0) value_error("truncate_prompt_tokens", "0 is neither -1 (max_model_len) nor at least 1.");
    r->truncate_prompt_tokens = *k == -1 ? ctx.max_model_len : static_cast<int32_t>(*k);
  }
  if (f.requested("use_beam_search")) unsupported("use_beam_search", "");
  for (const char* name : {"bad_words", "allowed_token_ids", "logits_processors", "samplers"})  // samplers: llama.cpp's order
    if (f.requested(name)) unsupported(name, "");
  // vLLM's skip_special_tokens (default true): false writes control tokens' text into the output
  // (the end of generation itself is not text: it ends the choice).
  r->params.skip_special_tokens = f.boolean("skip_special_tokens").value_or(true);
  if (f.requested("return_tokens_as_token_ids")) unsupported("return_tokens_as_token_ids", "");
  // Samplers of llama.cpp and others that this one does not have, unless at their "off" value.
  for (auto [name, off] : {std::pair<const char*, double>{"typical_p", 1.0}, {"tfs_z", 1.0}, {"mirostat", 0.0},
                           {"dry_multiplier", 0.0}, {"xtc_probability", 0.0}, {"top_a", 0.0}, {"repeat_penalty", 1.0},
                           {"dynatemp_range", 0.0}, {"n_probs", 0.0}})
    if (const json* v = f.get(name); v && !v->is_null() && !(v->is_number() && v->get<double>() == off)) unsupported(name, "");
  if (const json* v = f.get("top_n_sigma"); v && !v->is_null() && !(v->is_number() && v->get<double>() <= 0))  // llama.cpp: -1 is off
    unsupported("top_n_sigma", "");
  // llama-server's length and time limits (-1 and 0 are its "none"): OpenAI's max_tokens is this server's.
  if (const json* v = f.get("n_predict"); v && !v->is_null() && !(v->is_number_integer() && v->get<int64_t>() < 0))
    unsupported("n_predict", "use max_tokens (max_completion_tokens in chat).");
  if (const json* v = f.get("t_max_predict_ms"); v && !v->is_null() && !(v->is_number() && v->get<double>() <= 0))
    unsupported("t_max_predict_ms", "");

  // {"policy": "snapkv", "budget": 2048, "sink_tokens": 4, "recent_tokens": 512, "obs_window": 32,
  //  "sparse": "quest", "sparse_pages": 64}: this request's long-context KV policy (kv/kv_eviction.h);
  // fields not given take their defaults, not the server's. Checked against the pool by submit().
  // An empty object is the field's absence (the server's default), as null is; a user test's {}
  // dropped the server's policy.
  if (const json* ke = f.get("kv_eviction"); ke && !(ke->is_object() && ke->empty())) {
    if (!ke->is_object()) type_error("kv_eviction", "an object", *ke);
    static const char* kKnown[] = {"policy", "budget", "sink_tokens", "recent_tokens", "obs_window", "sparse", "sparse_pages"};
    for (auto it = ke->begin(); it != ke->end(); ++it)
      if (std::find(std::begin(kKnown), std::end(kKnown), it.key()) == std::end(kKnown))
        value_error("kv_eviction", "unknown field '" + it.key() + "' (expected policy, budget, sink_tokens, recent_tokens, obs_window, sparse, sparse_pages).");
    Fields kf(*ke);
    EvictionConfig& c = r->params.kv_policy;
    try {
    if (auto pol = kf.string("policy")) {
      auto p = parse_eviction_policy(*pol);
      if (!p)  // Quest keeps every page: it is a way of reading, not an eviction policy
        value_error("kv_eviction", p.message() + (*pol == "quest" ? "; Quest is {\"sparse\": \"quest\", \"sparse_pages\": K}." : "."));
      c.policy = *p;
    }
    const int64_t kMax = std::numeric_limits<int32_t>::max();
    c.budget = kf.integer("budget", 0, kMax).value_or(0);
    c.sink_tokens = static_cast<int32_t>(kf.integer("sink_tokens", 0, kMax).value_or(c.sink_tokens));
    c.recent_tokens = static_cast<int32_t>(kf.integer("recent_tokens", 0, kMax).value_or(-1));
    c.obs_window = static_cast<int32_t>(kf.integer("obs_window", 1, kMax).value_or(c.obs_window));
    const std::string sparse = kf.string("sparse").value_or("none");
    if (sparse != "none" && sparse != "quest") value_error("kv_eviction", "sparse must be \"none\" or \"quest\", got \"" + sparse + "\".");
    c.sparse_pages = static_cast<int32_t>(kf.integer("sparse_pages", 0, kMax).value_or(0));
    if (sparse == "quest" && c.sparse_pages <= 0) value_error("kv_eviction", "sparse \"quest\" needs sparse_pages > 0.");
    if (sparse != "quest" && kf.get("sparse_pages")) value_error("sparse_pages", "needs \"sparse\": \"quest\".");
    if (kf.get("sink_tokens") && c.policy == EvictionPolicy::kWindow)
      value_error("sink_tokens", "window keeps no sink tokens; \"policy\": \"sinks\" keeps them and a recent window.");
    if (c.evicts() && c.budget <= 0)  // the engine's check names the CLI's flag
      value_error("budget", std::string("policy \"") + eviction_policy_name(c.policy) + "\" needs a budget (tokens kept per sequence).");
    if (sparse == "none") c.sparse_pages = 0;
    // Settings that would do nothing are refused, as the CLI's flags are (tools/loaded_model.cpp):
    // {"budget": 256} alone answered 200 with nothing evicted.
    if (c.policy == EvictionPolicy::kNone && sparse == "none") {
      if (c.budget > 0) value_error("budget", "a budget needs a \"policy\" (sinks, h2o, snapkv, window).");
      for (const char* name : {"sink_tokens", "recent_tokens"})
        if (kf.get(name)) value_error(name, "needs a \"policy\" (sinks, h2o, snapkv, window) or \"sparse\": \"quest\".");
    }
    if (kf.get("obs_window") && c.policy != EvictionPolicy::kSnapKV) value_error("obs_window", "SnapKV's observation window needs \"policy\": \"snapkv\".");
    } catch (ApiError& e) {  // a nested field: name it as kv_eviction.<field>
      if (!e.param.empty() && e.param != "kv_eviction") {
        const std::string q = "'" + e.param + "'";
        if (size_t at = e.message.find(q); at != std::string::npos) e.message.replace(at, q.size(), "'kv_eviction." + e.param + "'");
        e.param = "kv_eviction." + e.param;
      }
      throw;
    }
    r->params.kv_policy_set = true;
  }

  // "speculative": false (off), true (on: the server's configuration, or ngram), or an object
  // (this request's configuration, parse_spec_config).
  if (const json* sp = f.get("speculative")) {
    if (sp->is_boolean()) {
      r->params.spec_choice = sp->get<bool>() ? RequestParams::Spec::kOn : RequestParams::Spec::kOff;
    } else if (sp->is_object()) {
      r->params.spec = parse_spec_config(*sp, "speculative");
      r->params.spec_choice = RequestParams::Spec::kCustom;
    } else if (!sp->is_null()) {
      type_error("speculative", "a boolean or an object", *sp);
    }
  }
}

// max_tokens: given, or `dflt` when absent. Over max_model_len is refused here with the reason,
// unless the request's KV policy evicts (it may then go past max_model_len, re-indexing);
// prompt + max_tokens over max_model_len is refused by Engine::submit when it may not.
// zero_ok: 0 asks for the prompt alone (completions' echo, prompt_logprobs), as vLLM allows.
int32_t parse_max_tokens(const Fields& f, const char* name, const ApiContext& ctx, int64_t dflt, const RequestParams& p, bool zero_ok = false) {
  const json* v = f.get(name);
  if (!v) return static_cast<int32_t>(std::clamp<int64_t>(dflt, 1, ctx.max_model_len));
  huge_integer_check(name, *v, zero_ok ? 0 : 1, std::numeric_limits<int32_t>::max());
  if (!v->is_number_integer()) type_error(name, "an integer", *v);
  // nlohmann stores 0 and other non-negative literals as unsigned: 0 must be caught there too.
  if (zero_ok ? !v->is_number_unsigned() && v->get<int64_t>() < 0 : v->is_number_unsigned() ? v->get<uint64_t>() == 0 : v->get<int64_t>() < 1)
    value_error(name, std::to_string(v->get<int64_t>()) + " is below the minimum of " + (zero_ok ? "0." : "1.") +
                          (zero_ok || v->get<int64_t>() != 0 ? ""
                           : std::string(name) == "max_tokens" && !f.get("messages") ? " (0 only with echo or prompt_logprobs: the prompt alone)"
                                                                                      : " (0 only with prompt_logprobs: the prompt alone)"));
  const bool past_context = p.kv_policy_set ? p.kv_policy.evicts() : ctx.default_policy_evicts;
  const int64_t cap = past_context ? std::numeric_limits<int32_t>::max() : ctx.max_model_len;
  if (v->is_number_unsigned() ? v->get<uint64_t>() > static_cast<uint64_t>(cap) : v->get<int64_t>() > cap) {
    if (past_context) value_error(name, v->dump() + " is more than " + std::to_string(cap) + ".");
    ApiError e = bad_request(std::string("Invalid value for '") + name + "': " + v->dump() +
                                 " is more than this model's maximum context length of " + std::to_string(ctx.max_model_len) +
                                 " tokens (max_model_len), which the prompt and the completion share.",
                             name, "invalid_value");
    e.too_long = true;  // as Engine::submit's refusal of prompt + max_tokens past it: counted
    throw e;
  }
  return static_cast<int32_t>(v->get<int64_t>());
}

// min_tokens may not exceed max_tokens (vLLM's check), whether max_tokens was given or is the default.
void check_min_tokens(const RequestParams& p, const char* max_name) {
  if (p.min_tokens > p.max_tokens)
    value_error("min_tokens", std::to_string(p.min_tokens) + " is more than " + max_name + " (" + std::to_string(p.max_tokens) +
                                  "); min_tokens must be at most " + max_name + ".");
}

// The prompts of /v1/completions: a string or a list of token ids (one prompt), or OpenAI's batch
// form, a list of strings or a list of token-id lists (one prompt each; a list of one is one
// prompt, as before). The kinds do not mix, as in OpenAI's schema. Errors in a batch name the
// prompt (prompt[k]).
// truncate_prompt_tokens: each prompt longer than it keeps its last tokens (left truncation, as
// vLLM); an echoed prompt then shows the text of what is kept.
void truncate_prompts(const ApiContext& ctx, ApiRequest* r) {
  if (r->truncate_prompt_tokens <= 0) return;
  for (size_t k = 0; k < r->prompts.size(); ++k) {
    auto& p = r->prompts[k];
    if (static_cast<int64_t>(p.size()) <= r->truncate_prompt_tokens) continue;
    p.erase(p.begin(), p.end() - r->truncate_prompt_tokens);
    if (k < r->prompt_texts.size()) r->prompt_texts[k] = ctx.tok->decode(p, /*special=*/true);
  }
}

// texts (echo): each prompt's text, as given, or for token ids their text (special tokens rendered).
std::vector<std::vector<int32_t>> parse_prompts(const Fields& f, const ApiContext& ctx, std::vector<std::string>* texts) {
  const json* v = f.get("prompt");
  if (!v) missing_parameter("prompt");
  const char* expected = "a string, an array of token ids, an array of strings or an array of token-id arrays";
  auto from_ids = [&](const json& arr, const std::string& where) {
    std::vector<int32_t> ids;
    ids.reserve(arr.size());
    for (const auto& t : arr) {
      if (!t.is_number_integer()) type_error("prompt", expected, t);
      if (t.is_number_unsigned() ? t.get<uint64_t>() >= static_cast<uint64_t>(ctx.tok->n_vocab()) : (t.get<int64_t>() < 0 || t.get<int64_t>() >= ctx.tok->n_vocab()))
        value_error("prompt", "token id " + t.dump() + where + " is outside the vocabulary [0, " + std::to_string(ctx.tok->n_vocab()) + ").");
      ids.push_back(static_cast<int32_t>(t.get<int64_t>()));
    }
    return ids;
  };
  // vLLM's add_special_tokens (default true for completions): the tokenizer's BOS, if it adds one.
  const bool add_special = f.boolean("add_special_tokens").value_or(true);
  auto from_text = [&](const std::string& s) { return ctx.tok->encode(s, add_special, /*parse_special=*/true); };

  std::vector<std::vector<int32_t>> out;
  if (v->is_string()) {
    out.push_back(from_text(v->get<std::string>()));
  } else if (v->is_array()) {
    if (v->empty()) value_error("prompt", "the prompt is empty.");
    const json& first = (*v)[0];
    if (first.is_string() || first.is_array()) {
      const bool texts = first.is_string();
      const bool batch = v->size() > 1;
      for (size_t k = 0; k < v->size(); ++k) {
        const json& p = (*v)[k];
        const std::string where = batch ? " in prompt[" + std::to_string(k) + "]" : "";
        if (texts ? !p.is_string() : !p.is_array())
          type_error("prompt", texts ? "an array of strings (several prompts)" : "an array of token-id arrays (several prompts)", p);
        out.push_back(texts ? from_text(p.get<std::string>()) : from_ids(p, where));
        if (out.back().empty()) value_error("prompt", batch ? "prompt[" + std::to_string(k) + "] is empty." : "the prompt is empty.");
      }
    } else {
      out.push_back(from_ids(*v, ""));
    }
  } else {
    type_error("prompt", expected, *v);
  }
  if (out.size() == 1 && out[0].empty()) value_error("prompt", "the prompt is empty.");
  if (texts) {
    texts->clear();
    for (size_t k = 0; k < out.size(); ++k) {
      const json& p = v->is_string() ? *v : (*v)[k];
      texts->push_back(p.is_string() ? p.get<std::string>() : ctx.tok->decode(out[k], /*special=*/true));
    }
  }
  return out;
}

// One message's content as text: a string, or a list of {"type": "text", "text": ...} parts.
// A message's text; content given as text parts also fills *parts, and the text joins them with
// "\n", as vLLM does for templates that take content as a string.
std::string message_text(const json& content, const std::string& role, size_t i, std::vector<std::string>* parts) {
  const std::string name = "messages[" + std::to_string(i) + "].content";
  if (content.is_null()) {
    if (role == "assistant") return "";
    throw bad_request("Invalid value for '" + name + "': content is required for role '" + role + "'.", name, "invalid_value");
  }
  if (content.is_string()) return content.get<std::string>();
  if (!content.is_array()) type_error(name, "a string or an array of content parts", content);
  std::string out;
  for (size_t k = 0; k < content.size(); ++k) {
    const json& part = content[k];
    const std::string pname = name + "[" + std::to_string(k) + "]";
    if (!part.is_object()) type_error(pname, "an object", part);
    Fields pf(part);
    auto type = pf.string("type");
    if (!type) missing_parameter(pname + ".type");
    // As vLLM's parser: "text", and the Responses API's "input_text" / "output_text", are text;
    // an assistant's "refusal" part is its refusal's text.
    const bool refusal = *type == "refusal" && role == "assistant";
    if (*type != "text" && *type != "input_text" && *type != "output_text" && !refusal) {
      static const char* kMedia[] = {"image_url", "input_image", "input_audio", "audio_url", "video_url", "file", "input_file", "image"};
      const bool media = std::find_if(std::begin(kMedia), std::end(kMedia), [&](const char* m) { return *type == m; }) != std::end(kMedia);
      throw bad_request("Content part type '" + *type + "' is not supported: " +
                            (media ? std::string("this server serves a text-only model.")
                                   : std::string("expected 'text' (or 'input_text', 'output_text'; 'refusal' in an assistant message).")),
                        pname + ".type", "unsupported_parameter");
    }
    const char* field = refusal ? "refusal" : "text";
    auto text = pf.string(field);
    if (!text) missing_parameter(pname + "." + field);
    if (k > 0) out += '\n';
    out += *text;
    parts->push_back(std::move(*text));
  }
  return out;
}

std::vector<ChatMessage> parse_messages(const Fields& f) {
  const json* v = f.get("messages");
  if (!v) missing_parameter("messages");
  if (!v->is_array()) type_error("messages", "an array", *v);
  if (v->empty()) throw bad_request("'messages' must contain at least one message.", "messages", "empty_array");
  std::vector<ChatMessage> out;
  for (size_t i = 0; i < v->size(); ++i) {
    const json& m = (*v)[i];
    const std::string name = "messages[" + std::to_string(i) + "]";
    if (!m.is_object()) type_error(name, "an object", m);
    Fields mf(m);
    const json* role_v = mf.get("role");
    if (!role_v) missing_parameter(name + ".role");
    if (!role_v->is_string()) type_error(name + ".role", "a string", *role_v);
    std::string role = role_v->get<std::string>();
    if (role == "function")
      throw bad_request("Role 'function' is not supported: it is OpenAI's deprecated form of 'tool' (with 'tool_call_id').", name + ".role",
                        "unsupported_parameter");
    if (role != "system" && role != "developer" && role != "user" && role != "assistant" && role != "tool")
      throw bad_request("Invalid value for '" + name + ".role': '" + role + "'. Supported roles: system, developer, user, assistant, tool.",
                        name + ".role", "invalid_value");
    if (mf.requested("function_call"))
      throw bad_request("'" + name + ".function_call' is not supported: it is OpenAI's deprecated form of 'tool_calls'.", name + ".function_call",
                        "unsupported_parameter");
    if (const json* n = mf.get("name"); n && !n->is_string()) type_error(name + ".name", "a string", *n);
    // What the template sees beside role and content (as vLLM passes them): an assistant turn's
    // calls, the id of the call a tool message answers.
    nlohmann::ordered_json extra = nullptr;
    if (const json* calls = mf.get("tool_calls")) {
      if (role != "assistant") value_error(name + ".tool_calls", "only assistant messages carry tool calls.");
      nlohmann::ordered_json parsed = parse_tool_calls_message(*calls, name + ".tool_calls", "/messages/" + std::to_string(i) + "/tool_calls");
      if (!parsed.is_null()) extra = {{"tool_calls", std::move(parsed)}};
    }
    if (role == "tool") {
      const json* id = mf.get("tool_call_id");
      if (!id) missing_parameter(name + ".tool_call_id");
      if (!id->is_string()) type_error(name + ".tool_call_id", "a string", *id);
      extra = {{"tool_call_id", id->get<std::string>()}};
    }
    auto it = m.find("content");
    // An assistant turn may be only its tool calls (content absent or null).
    if (it == m.end() && role != "assistant")
      missing_parameter(name + ".content");
    std::vector<std::string> parts;
    std::string text = it == m.end() ? std::string() : message_text(*it, role, i, &parts);
    // Templates written before OpenAI's "developer" role know it as "system".
    out.push_back(ChatMessage{role == "developer" ? "system" : role, std::move(text), std::move(parts), std::move(extra),
                              it != m.end() && it->is_array()});
  }
  return out;
}

}  // namespace

SpecConfig parse_spec_config(const json& v, const std::string& param) {
  if (!v.is_object()) type_error(param, "an object", v);
  static const char* kKnown[] = {"method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "suffix_max_depth",
                                 "suffix_min_prob", "suffix_alpha", "suffix_cache_tokens", "max_batch_tokens", "draft_cost"};
  for (auto it = v.begin(); it != v.end(); ++it)
    if (std::find(std::begin(kKnown), std::end(kKnown), it.key()) == std::end(kKnown))
      value_error(param, "unknown field '" + it.key() +
                             "' (expected method, num_speculative_tokens, prompt_lookup_min, prompt_lookup_max, suffix_max_depth, "
                             "suffix_min_prob, suffix_alpha, suffix_cache_tokens, max_batch_tokens, draft_cost).");
  Fields f(v);
  SpecConfig c;
  c.method = SpecConfig::Method::kNgram;
  try {
    if (auto m = f.string("method"))
      if (!parse_spec_method(*m, &c.method)) value_error("method", "must be \"ngram\", \"suffix\" or \"none\", got \"" + *m + "\".");
    c.num_speculative_tokens = static_cast<int32_t>(f.integer("num_speculative_tokens", 0, 32).value_or(c.num_speculative_tokens));
    // As vLLM: a max given alone lowers a larger default min to it (a min alone raises the max).
    auto max_given = f.integer("prompt_lookup_max", 1, 64);
    c.prompt_lookup_min = static_cast<int32_t>(
        f.integer("prompt_lookup_min", 1, 64).value_or(max_given ? std::min<int64_t>(c.prompt_lookup_min, *max_given) : c.prompt_lookup_min));
    c.prompt_lookup_max = static_cast<int32_t>(f.integer("prompt_lookup_max", 1, 64).value_or(std::max(c.prompt_lookup_max, c.prompt_lookup_min)));
    c.suffix_max_depth = static_cast<int32_t>(f.integer("suffix_max_depth", 2, 64).value_or(c.suffix_max_depth));
    c.suffix_min_prob = static_cast<float>(f.number("suffix_min_prob", 0.0, 1.0).value_or(c.suffix_min_prob));
    c.suffix_alpha = static_cast<float>(f.number("suffix_alpha", 0.0, 64.0, /*lo_open=*/true).value_or(c.suffix_alpha));
    c.suffix_cache_tokens = static_cast<int32_t>(f.integer("suffix_cache_tokens", 0, int64_t(1) << 24).value_or(c.suffix_cache_tokens));
    c.max_batch_tokens = static_cast<int32_t>(f.integer("max_batch_tokens", 0, 1 << 20).value_or(c.max_batch_tokens));
    c.draft_cost = static_cast<float>(f.number("draft_cost", 0.0, 0.99).value_or(c.draft_cost));
    if (Status st = c.validate(); !st) value_error(param, st.message() + ".");
    // As vLLM ("num_speculative_tokens was provided but without speculative model"): the drafts'
    // source is named, never assumed.
    if (!v.contains("method"))
      value_error(param, "'method' is required: \"ngram\", \"suffix\" or \"none\" (kvserve drafts without a draft model).");
  } catch (ApiError& e) {  // a nested field: name it as <param>.<field>
    if (!e.param.empty() && e.param != param) {
      const std::string q = "'" + e.param + "'";
      if (size_t at = e.message.find(q); at != std::string::npos) e.message.replace(at, q.size(), "'" + param + "." + e.param + "'");
      e.param = param + "." + e.param;
    }
    throw;
  }
  return c;
}

uint64_t random_seed() {
  static std::mutex mu;
  static std::mt19937_64 gen{std::random_device{}()};
  std::lock_guard<std::mutex> l(mu);
  return gen();
}

ApiError from_rejection(const Rejection& r, bool chat) {
  ApiError e{r.http_status, r.message, error_type_for_status(r.http_status), r.param, ""};
  if (!chat && e.param == "messages") e.param = "prompt";
  if (r.http_status == 429) e.code = "rate_limit_exceeded";
  return e;
}

ApiError from_event(const StreamEvent& ev) {
  int status = ev.http_status >= 400 ? ev.http_status : 500;
  return ApiError{status, ev.error.empty() ? "generation failed" : ev.error, error_type_for_status(status), "", ""};
}

ApiContext make_api_context(const Tokenizer& tok, const ChatTemplate* chat_template, const std::string& model_path,
                            const std::vector<std::string>& served_names, int32_t max_model_len, int32_t max_n) {
  ApiContext ctx;
  ctx.tok = &tok;
  ctx.chat_template = chat_template;
  if (tok.bos_id() >= 0) ctx.bos_text = tok.token_bytes(tok.bos_id(), true);
  if (tok.eos_id() >= 0) ctx.eos_text = tok.token_bytes(tok.eos_id(), true);
  const std::filesystem::path p(model_path);
  ctx.model_names = served_names.empty() ? std::vector<std::string>{p.stem().string()} : served_names;
  ctx.n_served_names = static_cast<int32_t>(ctx.model_names.size());
  for (std::string alias : {p.stem().string(), p.filename().string()})
    if (std::find(ctx.model_names.begin(), ctx.model_names.end(), alias) == ctx.model_names.end()) ctx.model_names.push_back(alias);
  ctx.max_model_len = max_model_len;
  ctx.max_n = max_n;
  return ctx;
}

json parse_json_body(const std::string& body, const ApiContext& ctx) {
  // nlohmann's parser is iterative, but the value it builds is destroyed and walked
  // recursively: refuse absurd nesting before parsing.
  // The same pass notes the number literals whose value is an integer beyond 64 bits (request_fields.h).
  int depth = 0;
  bool in_string = false, escaped = false;
  begin_body(body);
  for (size_t i = 0; i < body.size(); ++i) {
    const char c = body[i];
    if (in_string) {
      if (escaped) escaped = false;
      else if (c == '\\') escaped = true;
      else if (c == '"') in_string = false;
    } else if (c == '"') {
      in_string = true;
    } else if (c == '-' || (c >= '0' && c <= '9')) {
      size_t end = i + 1;
      while (end < body.size() && std::string_view("+-.eE0123456789").find(body[end]) != std::string_view::npos) ++end;
      note_number_literal(std::string_view(body).substr(i, end - i));
      i = end - 1;
    } else if (c == '[' || c == '{') {
      if (++depth > ctx.max_nesting)
        throw bad_request("The request body nests JSON deeper than " + std::to_string(ctx.max_nesting) + " levels.", "", "invalid_json");
    } else if (c == ']' || c == '}') {
      --depth;
    }
  }
  json j;
  try {
    j = json::parse(body);
  } catch (const json::parse_error& e) {
    // Tell invalid UTF-8 apart from broken syntax: a client can act on either.
    std::string what = e.what();
    if (what.find("UTF-8") != std::string::npos || what.find("surrogate") != std::string::npos)
      throw bad_request("The request body is not valid UTF-8 JSON: " + what, "", "invalid_utf8");
    throw bad_request("The request body is not valid JSON: " + what +
                          (body.empty() ? " (the body is empty; send a JSON object with Content-Type: application/json)" : ""),
                      "", "invalid_json");
  } catch (const json::exception& e) {  // e.g. out_of_range: a number beyond double (1e400)
    throw bad_request(std::string("The request body is not valid JSON: ") + e.what(), "", "invalid_json");
  }
  if (!j.is_object()) throw bad_request("The request body must be a JSON object, got " + type_word(j) + ".", "", "invalid_json");
  return j;
}

namespace {

// `messages` rendered by the model's chat template (add_generation_prompt, default true), as
// transformers' apply_chat_template(tokenize=False): the template writes any BOS.
// tools: the request's (parse_tool_list), the template's `tools` variable.
std::string chat_prompt_text(const Fields& f, const ApiContext& ctx, const std::vector<ToolSpec>& tools) {
  std::vector<ChatMessage> msgs = parse_messages(f);
  // vLLM's continue_final_message: the last message is left open (no end of turn after it), so the
  // model goes on with it ("prefilling" an answer). As transformers finds where it ends: a tag
  // appended to its text, the rendering cut at the tag.
  const bool continue_final = f.boolean("continue_final_message").value_or(false);
  static const std::string kTag = "CONTINUE_FINAL_MESSAGE_TAG ";
  std::string final_text;
  if (continue_final) {
    if (f.boolean("add_generation_prompt").value_or(false))
      value_error("continue_final_message", "cannot be true with 'add_generation_prompt' true (vLLM's rule): the prompt would end with a new turn.");
    ChatMessage& last = msgs.back();
    final_text = last.parts.empty() ? last.content : last.parts.back();
    if (!last.parts.empty()) last.parts.back() += kTag;
    last.content += kTag;  // content is the parts' join: the last part ends it
  }
  // vLLM's request fields: this request's template (its text) and extra template variables.
  std::optional<ChatTemplate> own;
  if (auto src = f.string("chat_template"); src && !src->empty()) {  // "" : the default, as vLLM
    if (!ctx.trust_request_chat_template)
      throw bad_request("A request's own chat_template is refused unless the server runs with --trust-request-chat-template.",
                        "chat_template", "unsupported_parameter");
    Result<ChatTemplate> t = ChatTemplate::parse(*src);
    if (!t) throw bad_request(t.message(), "chat_template", "chat_template_error");
    own = std::move(*t);
  }
  const ChatTemplate* tmpl = own ? &*own : ctx.chat_template;
  if (!tmpl)
    throw bad_request("This model has no chat template (tokenizer.chat_template): give one (--chat-template, chat_template=) "
                      "or continue text through completions.", "messages", "no_chat_template");
  nlohmann::ordered_json extra = nlohmann::ordered_json::object();
  if (const json* kw = f.get("chat_template_kwargs"); kw && !kw->is_null()) {
    if (!kw->is_object()) type_error("chat_template_kwargs", "an object", *kw);
    for (const char* reserved : {"messages", "add_generation_prompt", "bos_token", "eos_token"})
      if (kw->contains(reserved)) value_error("chat_template_kwargs", std::string("'") + reserved + "' is set by the server.");
    extra = in_client_order(*kw, "/chat_template_kwargs");
  }
  // As transformers' apply_chat_template(tools=...): the template decides how to show them.
  if (!tools.empty()) {
    if (extra.contains("tools")) value_error("chat_template_kwargs", "'tools' is set by the request's tools.");
    extra["tools"] = nlohmann::ordered_json::array();
    for (const ToolSpec& t : tools) extra["tools"].push_back(t.for_template);
  }
  bool add_generation_prompt = !continue_final && f.boolean("add_generation_prompt").value_or(true);
  Result<std::string> text = tmpl->render(msgs, add_generation_prompt, ctx.bos_text, ctx.eos_text, extra);
  if (!text) throw bad_request(text.message(), own ? "chat_template" : "messages", "chat_template_error");
  if (continue_final) {
    auto strip = [](const std::string& t) {
      const size_t b = t.find_first_not_of(" \t\n\r\f\v"), e = t.find_last_not_of(" \t\n\r\f\v");
      return b == std::string::npos ? std::string() : t.substr(b, e - b + 1);
    };
    const std::string tag = strip(kTag);
    const size_t at = text->rfind(tag);
    if (at == std::string::npos || text->find(strip(final_text)) == std::string::npos)
      value_error("continue_final_message", "the final message does not appear in the rendered prompt (the chat template leaves it out or changes it), so it cannot be continued.");
    const bool spacing_kept = text->compare(at, kTag.size(), kTag) == 0;
    text->resize(at);
    if (!spacing_kept) text->erase(text->find_last_not_of(" \t\n\r\f\v") + 1);  // the template trimmed the message
  }
  return std::move(*text);
}

// The rendered conversation tokenized (the template's special-token texts become those tokens).
// vLLM's add_special_tokens (default false for chat: the template writes any BOS) adds the
// tokenizer's own on top.
std::vector<int32_t> chat_prompt_ids(const std::string& text, const ApiContext& ctx, const Fields& f) {
  std::vector<int32_t> ids = ctx.tok->encode(text, f.boolean("add_special_tokens").value_or(false), /*parse_special=*/true);
  if (ids.empty()) value_error("messages", "the conversation renders to an empty prompt.");
  return ids;
}

std::vector<int32_t> chat_prompt(const Fields& f, const ApiContext& ctx, const std::vector<ToolSpec>& tools) {
  return chat_prompt_ids(chat_prompt_text(f, ctx, tools), ctx, f);
}

}  // namespace

ApiRequest parse_completion_request(const json& body, const ApiContext& ctx) {
  Fields f(body);
  OrderedBodyScope ordered;  // schemas and tools read the body in the client's order
  ApiRequest r;
  r.chat = false;
  ReadConstraint rc;
  parse_common(f, ctx, &r, &rc);
  compile_constraint(rc, ctx, &r);
  // echo: each choice's text (and with logprobs, its logprobs) begins with its prompt's.
  r.echo = f.boolean("echo").value_or(false);
  if (f.requested("suffix")) unsupported("suffix", "");
  if (auto best_of = f.integer("best_of", 1, ctx.max_n); best_of && *best_of != r.params.n)
    unsupported("best_of", "best_of must equal n (or be omitted).");
  if (auto lp = f.integer("logprobs", 0, ctx.max_logprobs)) {
    r.params.logprobs = static_cast<int32_t>(*lp);
    r.logprobs = true;
  }
  // The echoed prompt's logprobs: as many alternatives as the completion's (vLLM), unless
  // prompt_logprobs says otherwise.
  if (r.echo && r.logprobs && r.params.prompt_logprobs < 0) r.params.prompt_logprobs = r.params.logprobs;
  r.prompts = parse_prompts(f, ctx, r.echo ? &r.prompt_texts : nullptr);
  truncate_prompts(ctx, &r);
  // OpenAI's default for completions; 0 with echo or prompt_logprobs: the prompt alone.
  r.params.max_tokens = parse_max_tokens(f, "max_tokens", ctx, 16, r.params, r.echo || r.prompt_logprobs);
  check_min_tokens(r.params, "max_tokens");
  return r;
}

ApiRequest parse_chat_request(const json& body, const ApiContext& ctx) {
  Fields f(body);
  OrderedBodyScope ordered;  // schemas and tools read the body in the client's order
  ApiRequest r;
  r.chat = true;
  ReadConstraint rc;
  parse_common(f, ctx, &r, &rc);
  // OpenAI's deprecated functions / function_call are tools / tool_choice now.
  if (f.requested("functions")) unsupported("functions", "it is OpenAI's deprecated form of 'tools'.");
  if (const json* fc = f.get("function_call"); fc && !(fc->is_string() && fc->get<std::string>() == "none"))
    unsupported("function_call", "it is OpenAI's deprecated form of 'tool_choice'; only \"none\" is accepted.");
  const std::vector<ToolSpec> tools = parse_tool_list(f);
  r.tool_choice = parse_tool_choice(f, tools, ctx);
  // A named or "required" choice is a JSON-schema constraint (vLLM's); it takes structured_outputs'
  // options (disable_any_whitespace), not a second constraint.
  if (OutputConstraint tc = tool_constraint(r.tool_choice, tools, rc.c.any_whitespace); tc.kind != OutputConstraint::Kind::kNone) {
    if (!rc.given.empty())
      value_error("tool_choice", "a named or \"required\" tool choice constrains the answer itself; it cannot be combined with '" + rc.given + "'.");
    if (!ctx.constraints_forwarded) {  // the router: its backends compile
      if (!ctx.constraints) unsupported("tool_choice", "structured output is not available here.");
      try {
        r.params.constraint = ctx.constraints->compile(tc);
      } catch (const std::invalid_argument& e) {
        value_error(tool_compile_error_param(r.tool_choice, tools, *ctx.constraints), e.what());
      }
    }
  } else {
    compile_constraint(rc, ctx, &r);
  }
  if (f.requested("audio")) unsupported("audio", "");
  if (const json* mod = f.get("modalities"); mod && !(mod->is_array() && mod->size() == 1 && (*mod)[0] == "text"))
    unsupported("modalities", "only [\"text\"] is accepted.");
  if (f.requested("prediction")) unsupported("prediction", "");
  if (f.requested("echo")) unsupported("echo", "");

  const bool logprobs = f.boolean("logprobs").value_or(false);
  auto top = f.integer("top_logprobs", 0, ctx.max_logprobs);
  if (top && !logprobs) value_error("top_logprobs", "'logprobs' must be true when 'top_logprobs' is set.");
  if (logprobs) {
    r.params.logprobs = static_cast<int32_t>(top.value_or(0));
    r.logprobs = true;
  }

  r.prompts = {chat_prompt(f, ctx, tools)};
  truncate_prompts(ctx, &r);

  // max_completion_tokens is OpenAI's current name; max_tokens the deprecated one.
  // max_tokens absent: the rest of the context, within what the KV cache can hold unless the
  // request's KV policy evicts (it then holds a budget, not the whole context).
  int64_t limit = ctx.max_model_len;
  const bool evicts = r.params.kv_policy_set ? r.params.kv_policy.evicts() : ctx.default_policy_evicts;
  if (!evicts && ctx.kv_capacity_tokens > 0) limit = std::min<int64_t>(limit, ctx.kv_capacity_tokens);
  const int64_t room = limit - static_cast<int64_t>(r.prompts[0].size());
  const char* name = f.get("max_completion_tokens") ? "max_completion_tokens" : "max_tokens";
  r.params.max_tokens = parse_max_tokens(f, name, ctx, room, r.params, r.prompt_logprobs);
  check_min_tokens(r.params, name);
  return r;
}

TokenizeRequest parse_tokenize_request(const json& body, const ApiContext& ctx) {
  Fields f(body);
  OrderedBodyScope ordered;  // schemas and tools read the body in the client's order
  check_model(f, ctx);
  TokenizeRequest r;
  r.token_strs = f.boolean("return_token_strs").value_or(false);
  // One text to tokenize: a request naming two would get the tokens of one of them, silently.
  const int n_texts = (f.get("messages") != nullptr) + (f.get("prompt") != nullptr) + (f.get("content") != nullptr);
  if (n_texts > 1)
    throw bad_request("Give one of 'prompt', 'content' or 'messages', not several.", f.get("messages") ? "messages" : "content",
                      "invalid_value");
  if (f.get("messages")) {
    r.text = chat_prompt_text(f, ctx, parse_tool_list(f));
    r.ids = chat_prompt_ids(r.text, ctx, f);
    return r;
  }
  const bool llama = f.get("prompt") == nullptr;  // "content": llama-server's form, with its options and defaults
  const char* name = llama ? "content" : "prompt";  // vLLM's name, llama-server's
  auto text = f.string(name);
  if (!text) throw bad_request("Missing required parameter: 'prompt' (or 'messages').", "prompt", "missing_required_parameter");
  // vLLM's add_special_tokens (default true); llama-server's add_special (default false),
  // parse_special (default true: "<|im_start|>" typed is that token) and with_pieces.
  const std::optional<bool> vllm_add = f.boolean("add_special_tokens"), llama_add = f.boolean("add_special");
  if (vllm_add && llama_add && *vllm_add != *llama_add)
    value_error("add_special", "'add_special' and 'add_special_tokens' disagree; give one.");
  const bool add_special = vllm_add.value_or(llama_add.value_or(!llama));
  const bool parse_special = f.boolean("parse_special").value_or(true);
  r.with_pieces = f.boolean("with_pieces").value_or(false);
  r.ids = ctx.tok->encode(*text, add_special, parse_special);
  return r;
}

std::vector<int32_t> parse_detokenize_request(const json& body, const ApiContext& ctx) {
  Fields f(body);
  check_model(f, ctx);
  const json* v = f.get("tokens");
  if (!v) missing_parameter("tokens");
  if (!v->is_array()) type_error("tokens", "an array of token ids", *v);
  std::vector<int32_t> ids;
  ids.reserve(v->size());
  for (const json& t : *v) {
    if (!t.is_number_integer()) type_error("tokens", "an array of token ids", t);
    const int64_t id = t.get<int64_t>();
    if (t.is_number_unsigned() ? t.get<uint64_t>() >= static_cast<uint64_t>(ctx.tok->n_vocab()) : (id < 0 || id >= ctx.tok->n_vocab()))
      value_error("tokens", "token id " + t.dump() + " is outside the vocabulary [0, " + std::to_string(ctx.tok->n_vocab()) + ").");
    ids.push_back(static_cast<int32_t>(id));
  }
  return ids;
}

}  // namespace kv
