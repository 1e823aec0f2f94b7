// Values of the Jinja subset that chat templates use (see chat_template.h). A Value mirrors the Python
// object jinja2 would hold: undefined, None, bool, int, float, str, list/tuple, dict, namespace, callable.
// Lists and dicts are immutable once built (HF renders in an ImmutableSandboxedEnvironment) and shared by
// pointer, so copying a Value is cheap; only a namespace is mutable, through `set ns.x = ...`.
// Strings are UTF-8; everything Python does per code point (len, slicing, iteration) is done per code point.
#pragma once
#include <cstdint>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace kv::jinja {

// Internal error type: thrown while parsing/rendering, caught at the ChatTemplate boundary and turned into
// a Result. `kind` is the Python exception name jinja2 would raise (TemplateError, TypeError, ...).
struct Error : std::runtime_error {
  Error(std::string k, const std::string& msg) : std::runtime_error(msg), kind(std::move(k)) {}
  std::string kind;
};
[[noreturn]] inline void fail(const std::string& kind, const std::string& msg) { throw Error(kind, msg); }

class Value;
using Array = std::vector<Value>;
using Object = std::vector<std::pair<std::string, Value>>;  // insertion-ordered, like a Python dict

struct CallArgs {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* get(size_t i, const char* name) const;  // positional i, else keyword `name`, else null
};
using Function = std::function<Value(CallArgs&)>;

class Value {
 public:
  enum class Kind { kUndefined, kNone, kBool, kInt, kFloat, kString, kArray, kObject, kNamespace, kFunction };

  Value() = default;  // undefined
  static Value undefined(std::string hint = {}) {
    Value v;
    v.str_ = std::make_shared<const std::string>(std::move(hint));
    return v;
  }
  static Value none() { return Value(Kind::kNone); }
  Value(bool b) : kind_(Kind::kBool), i_(b) {}                      // NOLINT
  Value(int64_t i) : kind_(Kind::kInt), i_(i) {}                    // NOLINT
  Value(int i) : kind_(Kind::kInt), i_(i) {}                        // NOLINT
  Value(double f) : kind_(Kind::kFloat), f_(f) {}                   // NOLINT
  // An integer past int64 (Python's ints have no bound): computed with as a double, printed
  // (str, tojson) as its exact digits.
  static Value big_int(std::string digits, double approx) {
    Value v(approx);
    v.str_ = std::make_shared<const std::string>(std::move(digits));
    return v;
  }
  const std::string* big_int_digits() const { return kind_ == Kind::kFloat && str_ ? str_.get() : nullptr; }
  Value(std::string s) : kind_(Kind::kString), str_(std::make_shared<const std::string>(std::move(s))) {}  // NOLINT
  Value(const char* s) : kind_(Kind::kString), str_(std::make_shared<const std::string>(s)) {}  // NOLINT
  static Value array(Array a, bool tuple = false);
  static Value object(Object o);
  static Value make_namespace(Object o);
  static Value function(Function f, std::string name);

  Kind kind() const { return kind_; }
  bool is_undefined() const { return kind_ == Kind::kUndefined; }
  bool is_none() const { return kind_ == Kind::kNone; }
  bool is_bool() const { return kind_ == Kind::kBool; }
  bool is_int() const { return kind_ == Kind::kInt; }  // not bool
  bool is_float() const { return kind_ == Kind::kFloat; }
  bool is_number() const { return kind_ == Kind::kInt || kind_ == Kind::kFloat || kind_ == Kind::kBool; }
  bool is_string() const { return kind_ == Kind::kString; }
  bool is_array() const { return kind_ == Kind::kArray; }
  bool is_tuple() const { return kind_ == Kind::kArray && tuple_; }
  bool is_object() const { return kind_ == Kind::kObject; }
  bool is_namespace() const { return kind_ == Kind::kNamespace; }
  bool is_function() const { return kind_ == Kind::kFunction; }

  bool as_bool() const { return i_ != 0; }
  int64_t as_int() const { return i_; }  // int or bool
  double as_double() const { return kind_ == Kind::kFloat ? f_ : static_cast<double>(i_); }
  // String text, or an undefined's name hint.
  const std::string& str() const { return str_ ? *str_ : empty_string(); }
  const Array& arr() const { return *arr_; }
  const Object& obj() const { return *obj_; }
  Object& ns_obj() const { return *obj_; }  // namespace attributes (mutable)
  const Function& fn() const { return *fn_; }
  const std::string& fn_name() const { return str(); }

  const Value* find(const std::string& key) const;  // object/namespace member, or null
  bool truthy() const;
  size_t identity() const;  // pointer identity for `is sameas`

  static Value from_json(const nlohmann::json& j);
  static Value from_json(const nlohmann::ordered_json& j);

 private:
  explicit Value(Kind k) : kind_(k) {}
  Kind kind_ = Kind::kUndefined;
  bool tuple_ = false;
  int64_t i_ = 0;
  double f_ = 0;
  static const std::string& empty_string();
  std::shared_ptr<const std::string> str_;  // shared: copies of big strings cost nothing
  std::shared_ptr<const Array> arr_;
  std::shared_ptr<Object> obj_;
  std::shared_ptr<const Function> fn_;
};

const char* type_name(const Value& v);  // Python's type name, for error messages

// Hard cap on any one printed/serialised text (to_str, to_repr, to_json): LimitError beyond it, so printing
// a list that shares one big string many times cannot exhaust memory.
constexpr size_t kMaxPrinted = 64u << 20;

// Python's str(v) (what `{{ v }}` prints) and repr(v).
std::string to_str(const Value& v);
std::string to_repr(const Value& v);
// json.dumps(v, ensure_ascii=False, indent=indent, sort_keys=sort_keys) as HF's tojson filter does.
// indent < 0 means None (single line with ", " and ": ").
std::string to_json(const Value& v, int indent, bool sort_keys);
std::string format_float(double d);  // Python repr(float)

bool equals(const Value& a, const Value& b);
int compare(const Value& a, const Value& b);  // <0, 0, >0; throws TypeError when unorderable

// UTF-8 helpers (code-point semantics as Python str).
// Splitting into characters (iteration, reverse, ...) is refused beyond kMaxIterated bytes (LimitError).
constexpr size_t kMaxIterated = 1u << 20;
std::vector<std::string> utf8_chars(const std::string& s);
std::vector<uint32_t> utf8_starts(const std::string& s);  // byte offset of each code point
size_t utf8_length(const std::string& s);
bool is_py_space(uint32_t cp);
std::string py_strip(const std::string& s, bool left, bool right, const std::string* chars = nullptr);
std::string py_lower(std::string s);  // Python's str.lower / str.upper (Unicode)
std::string py_upper(std::string s);
bool py_is_cased(const std::string& ch);  // one UTF-8 character: a letter with case (Python's "cased")

}  // namespace kv::jinja
