#include "tokenizer/jinja_interp.h"

#include <cmath>
#include <string_view>

namespace kv::jinja {
namespace {

struct DepthGuard {
  DepthGuard(int& d, int max) : d_(d) {
    if (++d_ > max) fail("LimitError", "template nesting/recursion deeper than " + std::to_string(max));
  }
  ~DepthGuard() { --d_; }
  int& d_;
};

// Python's ints are unbounded; here they are int64, and a result outside it is an OverflowError, never a
// wrapped value or a trap (INT64_MIN // -1 raises SIGFPE on x86).
int64_t floordiv(int64_t a, int64_t b) {
  if (a == INT64_MIN && b == -1) fail("OverflowError", "integer overflow");
  int64_t q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) --q;
  return q;
}
int64_t pymod(int64_t a, int64_t b) {
  if (b == -1) return 0;  // INT64_MIN % -1 traps like the division
  int64_t r = a % b;
  if (r != 0 && ((r < 0) != (b < 0))) r += b;
  return r;
}

std::string undefined_msg(const Value& v) {
  return v.str().empty() ? "value is undefined" : v.str();
}

}  // namespace

std::vector<Value> iterate(const Value& v) {
  std::vector<Value> out;
  switch (v.kind()) {
    case Value::Kind::kUndefined: return out;
    case Value::Kind::kArray: return v.arr();
    case Value::Kind::kObject:
      for (const auto& kv : v.obj()) out.emplace_back(kv.first);
      return out;
    case Value::Kind::kString:
      for (auto& c : utf8_chars(v.str())) out.emplace_back(std::move(c));
      return out;
    default: fail("TypeError", std::string("'") + type_name(v) + "' object is not iterable");
  }
}

Interp::Interp(const Template& t, Limits limits) : t_(t), limits_(limits) {}

void Interp::step(int64_t n) {
  steps_ += n;
  if (steps_ > limits_.max_steps)
    fail("LimitError", "template exceeded its budget of " + std::to_string(limits_.max_steps) + " steps");
}

void Interp::check_size(size_t n) const {
  if (n > limits_.max_output)
    fail("LimitError", "template output or value larger than " + std::to_string(limits_.max_output) + " bytes");
}

const Value& Interp::charge(const Value& v) {
  if (v.is_string()) {
    check_size(v.str().size());
    step(static_cast<int64_t>(v.str().size() / 8));
  } else if (v.is_array()) {
    check_size(v.arr().size() * sizeof(Value));
    step(static_cast<int64_t>(v.arr().size() / 8));
  }
  return v;
}

void Interp::append(std::string& out, const std::string& s) {
  check_size(out.size() + s.size());
  step(static_cast<int64_t>(s.size() / 8));
  out += s;
}

Value Interp::make_namespace(Object o) {
  Value v = Value::make_namespace(std::move(o));
  namespaces_.push_back(v);
  return v;
}

void Interp::release_namespaces() {
  std::vector<Value> all = std::move(namespaces_);
  namespaces_.clear();
  for (const Value& ns : all) ns.ns_obj().clear();
}

std::string Interp::render(const std::vector<std::pair<std::string, Value>>& globals) {
  struct Release {
    Interp& in;
    ~Release() {
      in.scopes_.clear();
      in.release_namespaces();
    }
  } release{*this};
  scopes_.clear();
  scopes_.emplace_back();
  for (auto& [k, v] : builtin_globals(*this)) scopes_[0][k] = v;
  for (const auto& [k, v] : globals) scopes_[0][k] = v;
  scopes_.emplace_back();  // template-level `set`s land here, over the globals
  std::string out;
  exec_body(t_.body, out);
  return out;
}

Value Interp::lookup(const std::string& name) const {
  for (auto it = scopes_.rbegin(); it != scopes_.rend(); ++it) {
    auto f = it->find(name);
    if (f != it->end()) return f->second;
  }
  return Value::undefined("'" + name + "' is undefined");
}

void Interp::assign(const std::vector<std::string>& names, const Value& v) {
  auto& scope = scopes_.back();
  if (names.size() == 1) {
    scope[names[0]] = v;
    return;
  }
  std::vector<Value> items = iterate(v);
  if (items.size() != names.size())
    fail("ValueError", "cannot unpack " + std::to_string(items.size()) + " values into " +
                           std::to_string(names.size()) + " names");
  for (size_t i = 0; i < names.size(); ++i) scope[names[i]] = items[i];
}

Interp::Flow Interp::exec_body(const Body& body, std::string& out) {
  for (const auto& n : body) {
    Flow f = exec(*n, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Interp::Flow Interp::exec(const Node& n, std::string& out) {
  step();
  cur_pos_ = n.pos;
  switch (n.kind) {
    case NodeKind::kText: append(out, n.name); return Flow::kNormal;
    case NodeKind::kOutput: append(out, to_str(eval(*n.a))); return Flow::kNormal;
    case NodeKind::kIf:
      for (const auto& [cond, body] : n.branches)
        if (eval(*cond).truthy()) return exec_body(body, out);
      return exec_body(n.else_body, out);
    case NodeKind::kFor: exec_for(n, out); return Flow::kNormal;
    case NodeKind::kSet: {
      Value v = eval(*n.a);
      if (n.flag) {
        Value ns = lookup(n.ops[0]);
        if (!ns.is_namespace()) fail("TemplateRuntimeError", "cannot assign attribute on non-namespace object");
        Object& o = ns.ns_obj();
        for (auto& kv : o)
          if (kv.first == n.name) {
            kv.second = v;
            return Flow::kNormal;
          }
        o.emplace_back(n.name, v);
      } else {
        assign(n.ops, v);
      }
      return Flow::kNormal;
    }
    case NodeKind::kSetBlock: {
      std::string captured;
      {
        DepthGuard g(depth_, limits_.max_depth);
        exec_body(n.body, captured);
      }
      Value v(std::move(captured));
      if (n.a) {  // filter chain with a null innermost input: apply outermost-last
        std::vector<const Node*> chain;
        for (const Node* f = n.a.get(); f != nullptr; f = f->a.get()) chain.push_back(f);
        for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
          CallArgs args = eval_args((*it)->args);
          v = apply_filter((*it)->name, v, args);
        }
      }
      assign(n.ops, v);
      return Flow::kNormal;
    }
    case NodeKind::kFilterBlock: {
      std::string captured;
      {
        DepthGuard g(depth_, limits_.max_depth);
        exec_body(n.body, captured);
      }
      Value v(std::move(captured));
      std::vector<const Node*> chain;
      for (const Node* f = n.a.get(); f != nullptr; f = f->a.get()) chain.push_back(f);
      for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
        CallArgs args = eval_args((*it)->args);
        v = apply_filter((*it)->name, v, args);
      }
      append(out, to_str(v));
      return Flow::kNormal;
    }
    case NodeKind::kMacro: scopes_.back()[n.name] = make_macro(n); return Flow::kNormal;
    case NodeKind::kBreak: return Flow::kBreak;
    case NodeKind::kContinue: return Flow::kContinue;
    case NodeKind::kWith: {
      DepthGuard g(depth_, limits_.max_depth);
      std::unordered_map<std::string, Value> scope;
      for (size_t i = 0; i < n.ops.size(); ++i) scope[n.ops[i]] = eval(*n.items[i]);
      scopes_.push_back(std::move(scope));
      Flow f = exec_body(n.body, out);
      scopes_.pop_back();
      return f;
    }
    case NodeKind::kScope: return exec_body(n.body, out);
    default: fail("TemplateRuntimeError", "not a statement");
  }
}

void Interp::exec_for(const Node& n, std::string& out) {
  DepthGuard g(depth_, limits_.max_depth);
  Value seq = eval(*n.a);
  std::vector<Value> items = iterate(seq);
  if (n.flag) {  // `for x in xs if cond`: filter first, so loop.length counts what survives
    std::vector<Value> kept;
    for (auto& it : items) {
      step();
      scopes_.emplace_back();
      assign(n.ops, it);
      bool keep = eval(*n.c).truthy();
      scopes_.pop_back();
      if (keep) kept.push_back(std::move(it));
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    exec_body(n.else_body, out);
    return;
  }
  const int64_t len = static_cast<int64_t>(items.size());
  Value cycle_fn;
  for (int64_t i = 0; i < len; ++i) {
    step();
    Object loop;
    loop.reserve(12);
    loop.emplace_back("index", Value(i + 1));
    loop.emplace_back("index0", Value(i));
    loop.emplace_back("revindex", Value(len - i));
    loop.emplace_back("revindex0", Value(len - i - 1));
    loop.emplace_back("first", Value(i == 0));
    loop.emplace_back("last", Value(i == len - 1));
    loop.emplace_back("length", Value(len));
    loop.emplace_back("depth", Value(1));
    loop.emplace_back("depth0", Value(0));
    loop.emplace_back("previtem", i > 0 ? items[i - 1] : Value::undefined("'loop.previtem' is undefined"));
    loop.emplace_back("nextitem", i + 1 < len ? items[i + 1] : Value::undefined("'loop.nextitem' is undefined"));
    loop.emplace_back("cycle", Value::function(
                                   [i](CallArgs& a) -> Value {
                                     if (a.pos.empty()) fail("TypeError", "no items for cycling given");
                                     return a.pos[static_cast<size_t>(i) % a.pos.size()];
                                   },
                                   "loop.cycle"));
    scopes_.emplace_back();
    scopes_.back()["loop"] = Value::object(std::move(loop));
    assign(n.ops, items[i]);
    Flow f = exec_body(n.body, out);
    scopes_.pop_back();
    if (f == Flow::kBreak) break;
  }
}

Value Interp::make_macro(const Node& n) {
  const Node* def = &n;
  return Value::function(
      [this, def](CallArgs& args) -> Value {
        DepthGuard g(depth_, limits_.max_depth);
        std::unordered_map<std::string, Value> scope;
        for (size_t i = 0; i < def->ops.size(); ++i) {
          const std::string& p = def->ops[i];
          if (const Value* v = args.get(i, p.c_str())) {
            scope[p] = *v;
            continue;
          }
          scope[p] = Value::undefined("'" + p + "' is undefined");
          for (const auto& [k, d] : def->args.kw)
            if (k == p) scope[p] = eval(*d);
        }
        if (args.pos.size() > def->ops.size())
          fail("TypeError", "macro '" + def->name + "' takes not more than " + std::to_string(def->ops.size()) +
                                " argument(s)");
        scopes_.push_back(std::move(scope));
        std::string out;
        try {
          exec_body(def->body, out);
        } catch (...) {
          scopes_.pop_back();
          throw;
        }
        scopes_.pop_back();
        Value result(std::move(out));
        charge(result);
        return result;
      },
      n.name);
}

CallArgs Interp::eval_args(const Args& a) {
  CallArgs out;
  for (const auto& p : a.pos) out.pos.push_back(eval(*p));
  for (const auto& [k, v] : a.kw) out.kw.emplace_back(k, eval(*v));
  return out;
}

Value Interp::apply_filter(const std::string& name, const Value& v, CallArgs& args) {
  Value r = builtin_filter(*this, name, v, args);
  if (r.is_string() && v.is_string() && r.str().data() == v.str().data()) return r;  // passed through
  charge(r);
  return r;
}
bool Interp::apply_test(const std::string& name, const Value& v, CallArgs& args) {
  return builtin_test(*this, name, v, args);
}
Value Interp::call_method(const Value& obj, const std::string& name, CallArgs& args) {
  Value r = builtin_method(*this, obj, name, args);
  charge(r);
  return r;
}

Value Interp::eval(const Node& n) {
  step();
  cur_pos_ = n.pos;
  switch (n.kind) {
    case NodeKind::kConst: return n.value;
    case NodeKind::kName: return lookup(n.name);
    case NodeKind::kGetAttr: {
      Value obj = eval(*n.a);
      cur_pos_ = n.pos;
      return eval_getattr(obj, n.name);
    }
    case NodeKind::kGetItem: {
      Value obj = eval(*n.a);
      Value key = eval(*n.b);
      cur_pos_ = n.pos;
      return eval_getitem(obj, key);
    }
    case NodeKind::kSlice: return eval_slice(n);
    case NodeKind::kCall: return eval_call(n);
    case NodeKind::kFilter: {
      Value v = n.a ? eval(*n.a) : Value();
      CallArgs args = eval_args(n.args);
      cur_pos_ = n.pos;
      return apply_filter(n.name, v, args);
    }
    case NodeKind::kTest: {
      Value v = eval(*n.a);
      CallArgs args = eval_args(n.args);
      cur_pos_ = n.pos;
      bool r = apply_test(n.name, v, args);
      return Value(n.flag ? !r : r);
    }
    case NodeKind::kNot: return Value(!eval(*n.a).truthy());
    case NodeKind::kNeg:
    case NodeKind::kPos: {
      Value v = eval(*n.a);
      if (!v.is_number()) {
        if (v.is_undefined()) fail("UndefinedError", undefined_msg(v));
        fail("TypeError", std::string("bad operand type for unary ") + (n.kind == NodeKind::kNeg ? "-" : "+") +
                              ": '" + type_name(v) + "'");
      }
      if (n.kind == NodeKind::kPos) return v.is_float() ? v : Value(v.as_int());
      if (v.is_float()) return Value(-v.as_double());
      if (v.as_int() == INT64_MIN) fail("OverflowError", "integer overflow");
      return Value(-v.as_int());
    }
    case NodeKind::kAnd: {
      Value l = eval(*n.a);
      return l.truthy() ? eval(*n.b) : l;
    }
    case NodeKind::kOr: {
      Value l = eval(*n.a);
      return l.truthy() ? l : eval(*n.b);
    }
    case NodeKind::kBinary: return eval_binary(n);
    case NodeKind::kCompare: return eval_compare(n);
    case NodeKind::kCond:
      if (eval(*n.a).truthy()) return eval(*n.b);
      return n.c ? eval(*n.c) : Value::undefined("the inline if-expression evaluated to false and no else section "
                                                  "was defined.");
    case NodeKind::kList:
    case NodeKind::kTuple: {
      Array a;
      for (const auto& it : n.items) a.push_back(eval(*it));
      return Value::array(std::move(a), n.kind == NodeKind::kTuple);
    }
    case NodeKind::kDict: {
      Object o;
      for (size_t i = 0; i + 1 < n.items.size(); i += 2) {
        Value k = eval(*n.items[i]);
        Value v = eval(*n.items[i + 1]);
        std::string key = k.is_string() ? k.str() : to_str(k);
        bool found = false;
        for (auto& kv : o)
          if (kv.first == key) {
            kv.second = v;
            found = true;
          }
        if (!found) o.emplace_back(std::move(key), std::move(v));
      }
      return Value::object(std::move(o));
    }
    default: fail("TemplateRuntimeError", "not an expression");
  }
}

Value Interp::eval_getattr(const Value& obj, const std::string& name) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined: fail("UndefinedError", undefined_msg(obj));
    case Value::Kind::kObject: {
      if (has_method(obj, name)) break;  // Python attribute (a dict method) wins over the key
      if (const Value* v = obj.find(name)) return *v;
      return Value::undefined("'dict object' has no attribute '" + name + "'");
    }
    case Value::Kind::kNamespace:
      if (const Value* v = obj.find(name)) return *v;
      return Value::undefined("'Namespace' has no attribute '" + name + "'");
    default: break;
  }
  if (has_method(obj, name)) {
    Value self = obj;
    std::string m = name;
    return Value::function([this, self, m](CallArgs& a) { return call_method(self, m, a); }, m);
  }
  return Value::undefined(std::string("'") + type_name(obj) + " object' has no attribute '" + name + "'");
}

Value Interp::eval_getitem(const Value& obj, const Value& key) {
  switch (obj.kind()) {
    case Value::Kind::kUndefined: fail("UndefinedError", undefined_msg(obj));
    case Value::Kind::kObject:
    case Value::Kind::kNamespace: {
      if (key.is_string()) {
        if (const Value* v = obj.find(key.str())) return *v;
        if (obj.is_object() && has_method(obj, key.str())) return eval_getattr(obj, key.str());
        return Value::undefined("'dict object' has no attribute '" + key.str() + "'");
      }
      return Value::undefined("'dict object' has no attribute '" + to_str(key) + "'");
    }
    case Value::Kind::kArray:
    case Value::Kind::kString: {
      if (key.is_string()) return eval_getattr(obj, key.str());
      if (!key.is_int() && !key.is_bool())
        fail("TypeError", std::string(obj.is_array() ? "list" : "string") + " indices must be integers or slices, not " +
                              type_name(key));
      int64_t n = obj.is_array() ? static_cast<int64_t>(obj.arr().size())
                                 : static_cast<int64_t>(utf8_length(obj.str()));
      int64_t i = key.as_int();
      if (i < 0) i += n;
      if (i < 0 || i >= n)
        return Value::undefined(std::string(type_name(obj)) + " object has no element " + std::to_string(key.as_int()));
      if (obj.is_array()) return obj.arr()[static_cast<size_t>(i)];
      std::vector<uint32_t> starts = utf8_starts(obj.str());
      size_t from = starts[static_cast<size_t>(i)];
      size_t to = static_cast<size_t>(i) + 1 < starts.size() ? starts[static_cast<size_t>(i) + 1] : obj.str().size();
      return Value(obj.str().substr(from, to - from));
    }
    default:
      if (key.is_string()) return eval_getattr(obj, key.str());
      return Value::undefined(std::string("'") + type_name(obj) + " object' has no attribute '" + to_str(key) + "'");
  }
}

Value Interp::eval_slice(const Node& n) {
  Value obj = eval(*n.a);
  auto opt = [&](const NodePtr& p, bool& has) -> int64_t {
    has = false;
    if (!p) return 0;
    Value v = eval(*p);
    if (v.is_none()) return 0;
    if (!v.is_int() && !v.is_bool()) fail("TypeError", "slice indices must be integers or None");
    has = true;
    return v.as_int();
  };
  bool hs, he, hp;
  int64_t start = opt(n.b, hs), stop = opt(n.c, he), stepv = opt(n.d, hp);
  cur_pos_ = n.pos;
  if (!hp) stepv = 1;
  if (stepv == 0) fail("ValueError", "slice step cannot be zero");
  if (obj.is_undefined()) fail("UndefinedError", undefined_msg(obj));
  std::vector<uint32_t> starts;  // code point offsets of a string
  int64_t len;
  if (obj.is_array()) {
    len = static_cast<int64_t>(obj.arr().size());
  } else if (obj.is_string()) {
    step(static_cast<int64_t>(obj.str().size() / 8));
    starts = utf8_starts(obj.str());
    len = static_cast<int64_t>(starts.size());
  } else {
    fail("TypeError", std::string("'") + type_name(obj) + "' object is not subscriptable");
  }
  // Python's slice.indices().
  auto clamp = [&](int64_t v, bool has, int64_t dflt) -> int64_t {
    if (!has) return dflt;
    if (v < 0) {
      v += len;
      if (v < 0) v = stepv < 0 ? -1 : 0;
    } else if (v >= len) {
      v = stepv < 0 ? len - 1 : len;
    }
    return v;
  };
  int64_t b = clamp(start, hs, stepv < 0 ? len - 1 : 0);
  int64_t e = clamp(stop, he, stepv < 0 ? -1 : len);
  step(len / 16);
  if (obj.is_array()) {
    Array out;
    for (int64_t i = b; stepv > 0 ? i < e : i > e; i += stepv) out.push_back(obj.arr()[static_cast<size_t>(i)]);
    return Value::array(std::move(out));
  }
  const std::string& str = obj.str();
  auto char_at = [&](int64_t i) {
    size_t from = starts[static_cast<size_t>(i)];
    size_t to = i + 1 < len ? starts[static_cast<size_t>(i) + 1] : str.size();
    return std::string_view(str).substr(from, to - from);
  };
  if (stepv == 1) {
    if (b >= e) return Value(std::string());
    size_t from = starts[static_cast<size_t>(b)];
    size_t to = e < len ? starts[static_cast<size_t>(e)] : str.size();
    return Value(str.substr(from, to - from));
  }
  std::string out;
  for (int64_t i = b; stepv > 0 ? i < e : i > e; i += stepv) out += char_at(i);
  return Value(std::move(out));
}

Value Interp::eval_call(const Node& n) {
  if (n.a->kind == NodeKind::kGetAttr) {
    Value obj = eval(*n.a->a);
    const std::string& m = n.a->name;
    if (!obj.is_undefined() && has_method(obj, m)) {
      CallArgs args = eval_args(n.args);
      cur_pos_ = n.pos;
      return call_method(obj, m, args);
    }
    Value f = eval_getattr(obj, m);
    CallArgs args = eval_args(n.args);
    cur_pos_ = n.pos;
    if (f.is_undefined()) fail("UndefinedError", undefined_msg(f));
    if (!f.is_function()) fail("TypeError", std::string("'") + type_name(f) + "' object is not callable");
    return f.fn()(args);
  }
  Value f = eval(*n.a);
  CallArgs args = eval_args(n.args);
  cur_pos_ = n.pos;
  if (f.is_undefined()) fail("UndefinedError", undefined_msg(f));
  if (!f.is_function()) fail("TypeError", std::string("'") + type_name(f) + "' object is not callable");
  return f.fn()(args);
}

Value Interp::eval_compare(const Node& n) {
  Value l = eval(*n.items[0]);
  for (size_t i = 0; i < n.ops.size(); ++i) {
    Value r = eval(*n.items[i + 1]);
    const std::string& op = n.ops[i];
    bool ok;
    if (op == "==") {
      ok = equals(l, r);
    } else if (op == "!=") {
      ok = !equals(l, r);
    } else if (op == "in" || op == "notin") {
      bool found = false;
      if (r.is_string()) {
        if (!l.is_string())
          fail("TypeError", std::string("'in <string>' requires string as left operand, not ") + type_name(l));
        found = r.str().find(l.str()) != std::string::npos;
      } else if (r.is_object() || r.is_namespace()) {
        found = l.is_string() && r.find(l.str()) != nullptr;
      } else if (r.is_array()) {
        for (const auto& x : r.arr())
          if (equals(l, x)) {
            found = true;
            break;
          }
      } else if (!r.is_undefined()) {
        fail("TypeError", std::string("argument of type '") + type_name(r) + "' is not iterable");
      }
      ok = op == "in" ? found : !found;
    } else {
      if (l.is_undefined() || r.is_undefined())
        fail("UndefinedError", undefined_msg(l.is_undefined() ? l : r));
      int c = compare(l, r);
      ok = op == "<" ? c < 0 : op == ">" ? c > 0 : op == "<=" ? c <= 0 : c >= 0;
    }
    if (!ok) return Value(false);
    l = std::move(r);
  }
  return Value(true);
}

Value Interp::eval_binary(const Node& n) {
  Value r = eval_binary_raw(n);
  charge(r);
  return r;
}

Value Interp::eval_binary_raw(const Node& n) {
  Value l = eval(*n.a);
  Value r = eval(*n.b);
  cur_pos_ = n.pos;
  const std::string& op = n.name;
  if (op == "~") {
    std::string s = to_str(l) + to_str(r);
    check_size(s.size());
    return Value(std::move(s));
  }
  if (l.is_undefined() || r.is_undefined()) fail("UndefinedError", undefined_msg(l.is_undefined() ? l : r));
  auto type_error = [&]() {
    fail("TypeError", "unsupported operand type(s) for " + op + ": '" + type_name(l) + "' and '" + type_name(r) + "'");
  };
  if (l.is_number() && r.is_number()) {
    bool fl = l.is_float() || r.is_float();
    if (op == "/") {
      if (r.as_double() == 0) fail("ZeroDivisionError", "division by zero");
      return Value(l.as_double() / r.as_double());
    }
    if (op == "**") {
      if (!fl && r.as_int() >= 0) {
        int64_t base = l.as_int(), e = r.as_int(), res = 1;
        if (e == 0) return Value(int64_t{1});
        if (base == 0 || base == 1) return Value(base);
        if (base == -1) return Value(int64_t{e % 2 == 0 ? 1 : -1});
        for (int64_t k = 0; k < e; ++k)  // |base| >= 2: overflows within 64 factors
          if (__builtin_mul_overflow(res, base, &res)) fail("OverflowError", "integer power too large");
        return Value(res);
      }
      return Value(std::pow(l.as_double(), r.as_double()));
    }
    if (fl) {
      double a = l.as_double(), b = r.as_double();
      if (op == "+") return Value(a + b);
      if (op == "-") return Value(a - b);
      if (op == "*") return Value(a * b);
      if (b == 0) fail("ZeroDivisionError", "float modulo");
      if (op == "//") return Value(std::floor(a / b));
      if (op == "%") {
        double m = std::fmod(a, b);
        if (m != 0 && ((m < 0) != (b < 0))) m += b;
        return Value(m);
      }
    } else {
      int64_t a = l.as_int(), b = r.as_int(), res;
      if (op == "+") {
        if (__builtin_add_overflow(a, b, &res)) fail("OverflowError", "integer overflow");
        return Value(res);
      }
      if (op == "-") {
        if (__builtin_sub_overflow(a, b, &res)) fail("OverflowError", "integer overflow");
        return Value(res);
      }
      if (op == "*") {
        if (__builtin_mul_overflow(a, b, &res)) fail("OverflowError", "integer overflow");
        return Value(res);
      }
      if (b == 0) fail("ZeroDivisionError", "integer division or modulo by zero");
      if (op == "//") return Value(floordiv(a, b));
      if (op == "%") return Value(pymod(a, b));
    }
    type_error();
  }
  if (op == "+") {
    if (l.is_string() && r.is_string()) {
      check_size(l.str().size() + r.str().size());
      return Value(l.str() + r.str());
    }
    if (l.is_array() && r.is_array()) {
      check_size((l.arr().size() + r.arr().size()) * sizeof(Value));
      Array a = l.arr();
      a.insert(a.end(), r.arr().begin(), r.arr().end());
      return Value::array(std::move(a), l.is_tuple() && r.is_tuple());
    }
    if (l.is_string())
      fail("TypeError", std::string("can only concatenate str (not \"") + type_name(r) + "\") to str");
    if (l.is_array())
      fail("TypeError", std::string("can only concatenate list (not \"") + type_name(r) + "\") to list");
    type_error();
  }
  if (op == "*") {
    const Value& seq = l.is_number() ? r : l;
    const Value& cnt = l.is_number() ? l : r;
    if ((seq.is_string() || seq.is_array()) && (cnt.is_int() || cnt.is_bool())) {
      int64_t k = std::max<int64_t>(0, cnt.as_int());
      size_t unit = seq.is_string() ? seq.str().size() : seq.arr().size() * sizeof(Value);
      if (unit != 0 && static_cast<uint64_t>(k) > limits_.max_output / unit + 1) check_size(limits_.max_output + 1);
      check_size(unit * static_cast<size_t>(k));
      step(k / 64);
      if (seq.is_string()) {
        std::string s;
        s.reserve(seq.str().size() * static_cast<size_t>(k));
        for (int64_t i = 0; i < k; ++i) s += seq.str();
        return Value(std::move(s));
      }
      Array a;
      for (int64_t i = 0; i < k; ++i) a.insert(a.end(), seq.arr().begin(), seq.arr().end());
      return Value::array(std::move(a));
    }
  }
  if (op == "%" && l.is_string()) {
    CallArgs args;
    if (r.is_tuple())
      args.pos = r.arr();
    else
      args.pos.push_back(r);
    return apply_filter("format", l, args);
  }
  type_error();
  return Value();
}

}  // namespace kv::jinja
