// The request side of tool calling (tool_calls.h): the tools, the tool choice, the constraint a
// choice puts on the answer, and the calls of earlier assistant turns.
#include <algorithm>
#include <stdexcept>

#include "server/openai_request.h"
#include "server/request_fields.h"
#include "server/tool_calls.h"

namespace kv {

using nlohmann::json;
using ordered = nlohmann::ordered_json;

namespace {

// What a call takes when its tool gives no parameters (vLLM's schema for one).
const char* kNoParameters = R"({"type": "object", "properties": {}})";

ordered parameters_or_empty(const ToolSpec& t) { return t.parameters.is_null() ? ordered::parse(kNoParameters) : t.parameters; }

// Every local "$ref" ("#" and "#/...") in a schema, rebased under `prefix` (a JSON pointer): the
// schema is embedded there. Keys that name properties are walked too; a "$ref" string among them
// would only be a property named "$ref" whose schema is a string, which no schema is.
void rebase_refs(ordered* node, const std::string& prefix) {
  if (node->is_array()) {
    for (auto& x : *node) rebase_refs(&x, prefix);
  } else if (node->is_object()) {
    for (auto& [key, val] : node->items()) {
      if (key == "$ref" && val.is_string()) {
        const std::string r = val.get<std::string>();
        if (!r.empty() && r[0] == '#') val = "#" + prefix + r.substr(1);
      } else {
        rebase_refs(&val, prefix);
      }
    }
  }
}

std::string parameters_param(size_t i) { return "tools[" + std::to_string(i) + "].function.parameters"; }

size_t tool_index(const std::vector<ToolSpec>& tools, const std::string& name) {
  for (size_t i = 0; i < tools.size(); ++i)
    if (tools[i].name == name) return i;
  return tools.size();
}

}  // namespace

std::vector<ToolSpec> parse_tool_list(const Fields& f) {
  std::vector<ToolSpec> out;
  const json* v = f.get("tools");
  if (!v) return out;
  if (!v->is_array()) type_error("tools", "an array of tools", *v);
  if (v->empty()) value_error("tools", "must not be an empty array; give at least one tool or leave 'tools' out.");
  for (size_t i = 0; i < v->size(); ++i) {
    const std::string name = "tools[" + std::to_string(i) + "]";
    const std::string pointer = "/tools/" + std::to_string(i);
    const json& t = (*v)[i];
    if (!t.is_object()) type_error(name, "an object", t);
    Fields tf(t);
    if (auto type = tf.string("type"); type && *type != "function")
      value_error(name + ".type", "only \"function\" tools are supported, got \"" + *type + "\".");
    const json* fn = tf.get("function");
    if (!fn) missing_parameter(name + ".function");
    if (!fn->is_object()) type_error(name + ".function", "an object", *fn);
    Fields ff(*fn);
    const json* fname = ff.get("name");
    if (!fname) missing_parameter(name + ".function.name");
    if (!fname->is_string()) type_error(name + ".function.name", "a string", *fname);
    ToolSpec spec;
    spec.name = fname->get<std::string>();
    if (spec.name.empty()) value_error(name + ".function.name", "must not be empty.");
    if (size_t j = tool_index(out, spec.name); j < out.size())
      value_error(name + ".function.name", "'" + spec.name + "' is already the name of tools[" + std::to_string(j) + "]; tool names must be unique.");
    if (const json* d = ff.get("description"); d && !d->is_string()) type_error(name + ".function.description", "a string", *d);
    if (const json* params = ff.get("parameters")) {
      if (!params->is_object()) type_error(parameters_param(i), "a JSON schema object", *params);
      // The arguments are a JSON object (OpenAI's "a JSON Schema object" for a function's parameters).
      if (auto it = params->find("type"); it != params->end() && it->is_string() && *it != "object")
        value_error(parameters_param(i), "must describe an object (the call's arguments), got type \"" + it->get<std::string>() + "\".");
      spec.parameters = in_client_order(*params, pointer + "/function/parameters");
      // Without a type, a schema of an object's keywords (or none) is an object's: {} and
      // {"properties": ...} let numbers and strings through as arguments. Anything else (a $ref,
      // anyOf, enum at the top) must say "type": "object".
      if (!params->contains("type")) {
        static const char* kObjectWords[] = {"properties", "required", "additionalProperties", "patternProperties", "$defs",
                                             "definitions", "description", "title", "$schema", "minProperties", "maxProperties"};
        for (auto it = params->begin(); it != params->end(); ++it) {
          const std::string& key = it.key();  // (clang 14 captures no structured binding in a lambda)
          if (std::find_if(std::begin(kObjectWords), std::end(kObjectWords), [&](const char* w) { return key == w; }) == std::end(kObjectWords))
            value_error(parameters_param(i), "must describe an object (the call's arguments): give it \"type\": \"object\" (it has '" + key + "' and no type).");
        }
        ordered typed = {{"type", "object"}};
        for (auto& [key, val] : spec.parameters.items()) typed[key] = val;
        spec.parameters = std::move(typed);
      }
    }
    // vLLM hands the template its parsed tool, dumped: the declared members first (absent ones
    // null), then the client's others as given.
    const ordered tool = in_client_order(t, pointer);
    const ordered& fo = tool.at("function");
    ordered fn_dump = {{"name", spec.name},
                       {"description", fo.contains("description") ? fo.at("description") : ordered(nullptr)},
                       {"parameters", spec.parameters}};
    for (const auto& [key, val] : fo.items())
      if (!fn_dump.contains(key)) fn_dump[key] = val;
    spec.for_template = {{"type", "function"}, {"function", std::move(fn_dump)}};
    for (const auto& [key, val] : tool.items())
      if (!spec.for_template.contains(key)) spec.for_template[key] = val;
    out.push_back(std::move(spec));
  }
  return out;
}

ToolChoice parse_tool_choice(const Fields& f, const std::vector<ToolSpec>& tools, const ApiContext& ctx) {
  ToolChoice c;
  c.parallel = f.boolean("parallel_tool_calls").value_or(true);
  const char* usage = "Correct usage: {\"type\": \"function\", \"function\": {\"name\": \"my_function\"}}.";
  const json* v = f.get("tool_choice");
  if (!v) {
    c.kind = tools.empty() ? ToolChoice::Kind::kNone : ToolChoice::Kind::kAuto;  // vLLM's default with tools
  } else if (v->is_string()) {
    const std::string s = v->get<std::string>();
    if (s == "none") c.kind = ToolChoice::Kind::kNone;
    else if (s == "auto") c.kind = ToolChoice::Kind::kAuto;
    else if (s == "required") c.kind = ToolChoice::Kind::kRequired;
    else value_error("tool_choice", "\"" + s + "\"; only \"none\", \"auto\", \"required\" or a named function are supported. " + usage);
  } else if (v->is_object()) {
    Fields cf(*v);
    if (auto type = cf.string("type"); type && *type != "function")
      value_error("tool_choice", "type must be \"function\", got \"" + *type + "\". " + usage);
    const json* fn = cf.get("function");
    if (!fn || !fn->is_object()) value_error("tool_choice", std::string("a named choice needs a 'function' object. ") + usage);
    const json* name = Fields(*fn).get("name");
    if (!name || !name->is_string() || name->get<std::string>().empty())
      value_error("tool_choice", std::string("a named choice needs the function's 'name'. ") + usage);
    c.kind = ToolChoice::Kind::kNamed;
    c.name = name->get<std::string>();
  } else {
    type_error("tool_choice", "a string or an object", *v);
  }
  if (c.kind == ToolChoice::Kind::kNone) return c;
  if (tools.empty()) value_error("tool_choice", "needs 'tools': a tool choice other than \"none\" chooses among them.");
  if (c.kind == ToolChoice::Kind::kNamed && tool_index(tools, c.name) == tools.size()) {
    std::string names;
    for (const auto& t : tools) names += (names.empty() ? "" : ", ") + t.name;
    value_error("tool_choice", "the function '" + c.name + "' is not one of the request's tools (" + names + ").");
  }
  if (c.kind == ToolChoice::Kind::kAuto && !ctx.constraints_forwarded) {  // the router leaves it to its backends
    if (ctx.tool_call_parser.empty())
      throw bad_request("\"auto\" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set", "tool_choice",
                        "unsupported_parameter");
  }
  return c;
}

OutputConstraint tool_constraint(const ToolChoice& choice, const std::vector<ToolSpec>& tools, bool any_whitespace) {
  OutputConstraint c;
  c.any_whitespace = any_whitespace;
  if (choice.kind == ToolChoice::Kind::kNamed) {
    c.kind = OutputConstraint::Kind::kJsonSchema;
    c.spec = parameters_or_empty(tools.at(tool_index(tools, choice.name))).dump();
  } else if (choice.kind == ToolChoice::Kind::kRequired) {
    // vLLM's schema: an array of {"name", "parameters"} items, one per call, each of one tool. A
    // tool's references are to its own schema's root ("#/$defs/..", "#/definitions/..",
    // "#/properties/..", "#"): rebased to where it now sits (vLLM moves only "$defs" up, and
    // draft-07 "definitions", which zod and pydantic v1 write, failed to compile).
    ordered any_of = ordered::array();
    for (size_t i = 0; i < tools.size(); ++i) {
      ordered params = parameters_or_empty(tools[i]);
      rebase_refs(&params, "/items/anyOf/" + std::to_string(i) + "/properties/parameters");
      any_of.push_back({{"properties", {{"name", {{"type", "string"}, {"enum", {tools[i].name}}}}, {"parameters", std::move(params)}}},
                        {"required", {"name", "parameters"}}});
    }
    ordered schema = {{"type", "array"}, {"minItems", 1}};
    if (!choice.parallel) schema["maxItems"] = 1;
    schema["items"] = {{"type", "object"}, {"anyOf", std::move(any_of)}};
    c.kind = OutputConstraint::Kind::kJsonSchema;
    c.spec = schema.dump();
  }
  return c;
}

std::string tool_compile_error_param(const ToolChoice& choice, const std::vector<ToolSpec>& tools, ConstraintCompiler& compiler) {
  if (choice.kind == ToolChoice::Kind::kNamed) return parameters_param(tool_index(tools, choice.name));
  for (size_t i = 0; i < tools.size(); ++i) {
    OutputConstraint one;
    one.kind = OutputConstraint::Kind::kJsonSchema;
    one.spec = parameters_or_empty(tools[i]).dump();
    try {
      compiler.compile(one);
    } catch (const std::invalid_argument&) {
      return parameters_param(i);
    }
  }
  return "tools";
}

ordered parse_tool_calls_message(const json& v, const std::string& name, const std::string& pointer) {
  if (!v.is_array()) type_error(name, "an array of tool calls", v);
  if (v.empty()) return nullptr;  // vLLM drops an empty list: the template's plain assistant turn
  ordered out = in_client_order(v, pointer);
  for (size_t k = 0; k < v.size(); ++k) {
    const std::string cname = name + "[" + std::to_string(k) + "]";
    const json& call = v[k];
    if (!call.is_object()) type_error(cname, "an object", call);
    Fields cf(call);
    cf.string("id");  // a string when given
    if (auto type = cf.string("type"); type && *type != "function")
      value_error(cname + ".type", "only \"function\" calls are supported, got \"" + *type + "\".");
    const json* fn = cf.get("function");
    if (!fn) missing_parameter(cname + ".function");
    if (!fn->is_object()) type_error(cname + ".function", "an object", *fn);
    Fields ff(*fn);
    if (!ff.get("name")) missing_parameter(cname + ".function.name");
    ff.string("name");
    // OpenAI sends the arguments as JSON text; templates read them as a mapping (vLLM parses
    // them, as transformers' documentation asks). An object is taken as it is.
    ordered args = ordered::object();
    if (const json* a = ff.get("arguments")) {
      if (a->is_string()) {
        if (!a->get<std::string>().empty()) {
          args = ordered::parse(a->get<std::string>(), nullptr, /*allow_exceptions=*/false);
          if (args.is_discarded()) value_error(cname + ".function.arguments", "is not JSON text.");
        }
      } else if (a->is_object()) {
        args = in_client_order(*a, pointer + "/" + std::to_string(k) + "/function/arguments");
      } else {
        type_error(cname + ".function.arguments", "a string of JSON (or an object)", *a);
      }
    }
    out[k]["function"]["arguments"] = std::move(args);
  }
  return out;
}

}  // namespace kv
