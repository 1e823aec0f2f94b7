// Tree-walking renderer for a parsed Template (jinja_parser.h). Semantics follow jinja2 as transformers
// configures it: undefined names are "default" Undefined (print as "", falsy, iterate as empty, error on
// attribute access), `set` inside a for-loop body is local to the iteration, `namespace()` objects carry
// state out of loops, raise_exception() aborts with its message.
//
// Every render is bounded (templates come from model files): a step budget caps loop iterations and
// evaluated nodes, a depth cap bounds macro recursion and nesting, and an output cap bounds the text and
// every intermediate string or list. Exceeding one throws Error("LimitError", ...), never crashes or hangs.
#pragma once
#include <cstdint>
#include <string>
#include <unordered_map>
#include <vector>

#include "tokenizer/jinja_parser.h"
#include "tokenizer/jinja_value.h"

namespace kv::jinja {

struct Limits {
  int64_t max_steps = 10'000'000;     // evaluated nodes + loop iterations + bytes/8 of strings built
  int max_depth = 64;                 // macro calls / nested loops and blocks
  size_t max_output = 32u << 20;      // bytes of output, and of any one string or list built
};

class Interp {
 public:
  Interp(const Template& t, Limits limits);
  ~Interp() { release_namespaces(); }
  Interp(const Interp&) = delete;
  Interp& operator=(const Interp&) = delete;
  // Renders with `globals` (messages, bos_token, ...) on top of the built-in globals.
  std::string render(const std::vector<std::pair<std::string, Value>>& globals);
  size_t error_pos() const { return cur_pos_; }  // node being evaluated when an Error was thrown

  // Used by builtins (filters/tests that take a filter or test name).
  Value apply_filter(const std::string& name, const Value& v, CallArgs& args);
  bool apply_test(const std::string& name, const Value& v, CallArgs& args);
  Value call_method(const Value& obj, const std::string& name, CallArgs& args);
  void check_size(size_t n) const;
  // Charges a freshly built value against the budgets: strings by bytes, lists by elements.
  const Value& charge(const Value& v);
  void step(int64_t n = 1);
  // namespace(): the only mutable value, so the only way to build a reference cycle (`set ns.x = ns`,
  // `set ns.x = [ns]`). Every namespace a render creates is registered and emptied when the render ends.
  Value make_namespace(Object o);

 private:
  enum class Flow { kNormal, kBreak, kContinue };
  Flow exec_body(const Body& body, std::string& out);
  Flow exec(const Node& n, std::string& out);
  void exec_for(const Node& n, std::string& out);
  void assign(const std::vector<std::string>& names, const Value& v);
  Value eval(const Node& n);
  Value eval_binary(const Node& n);
  Value eval_binary_raw(const Node& n);
  Value eval_compare(const Node& n);
  Value eval_call(const Node& n);
  Value eval_getattr(const Value& obj, const std::string& name);
  Value eval_getitem(const Value& obj, const Value& key);
  Value eval_slice(const Node& n);
  CallArgs eval_args(const Args& a);
  Value lookup(const std::string& name) const;
  Value make_macro(const Node& n);
  void append(std::string& out, const std::string& s);
  void release_namespaces();

  const Template& t_;
  Limits limits_;
  std::vector<std::unordered_map<std::string, Value>> scopes_;  // [0] = globals
  int64_t steps_ = 0;
  int depth_ = 0;
  size_t cur_pos_ = 0;
  std::vector<Value> namespaces_;  // created by this render; emptied at its end to break cycles
};

// Builtins (jinja_builtins.cpp).
Value builtin_filter(Interp& in, const std::string& name, const Value& v, CallArgs& args);
bool builtin_test(Interp& in, const std::string& name, const Value& v, CallArgs& args);
Value builtin_method(Interp& in, const Value& obj, const std::string& name, CallArgs& args);
bool has_method(const Value& obj, const std::string& name);
std::vector<std::pair<std::string, Value>> builtin_globals(Interp& in);
// Python iteration over v (list items, dict keys, string code points); TypeError if not iterable.
std::vector<Value> iterate(const Value& v);

}  // namespace kv::jinja
