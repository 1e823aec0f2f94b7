#include "tokenizer/jinja_value.h"

#include <locale.h>

#include <algorithm>
#include <cctype>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cwctype>
#include <limits>
#include <stdexcept>

#include "tokenizer/utf8.h"

namespace kv::jinja {

const Value* CallArgs::get(size_t i, const char* name) const {
  if (i < pos.size()) return &pos[i];
  if (name != nullptr) {
    for (const auto& [k, v] : kw)
      if (k == name) return &v;
  }
  return nullptr;
}

Value Value::array(Array a, bool tuple) {
  Value v(Kind::kArray);
  v.arr_ = std::make_shared<const Array>(std::move(a));
  v.tuple_ = tuple;
  return v;
}
Value Value::object(Object o) {
  Value v(Kind::kObject);
  v.obj_ = std::make_shared<Object>(std::move(o));
  return v;
}
Value Value::make_namespace(Object o) {
  Value v(Kind::kNamespace);
  v.obj_ = std::make_shared<Object>(std::move(o));
  return v;
}
Value Value::function(Function f, std::string name) {
  Value v(Kind::kFunction);
  v.fn_ = std::make_shared<const Function>(std::move(f));
  v.str_ = std::make_shared<const std::string>(std::move(name));
  return v;
}

const std::string& Value::empty_string() {
  static const std::string kEmpty;
  return kEmpty;
}

static void check_printed(size_t n) {
  if (n > kMaxPrinted) fail("LimitError", "printed value larger than " + std::to_string(kMaxPrinted) + " bytes");
}

const Value* Value::find(const std::string& key) const {
  if (kind_ != Kind::kObject && kind_ != Kind::kNamespace) return nullptr;
  for (const auto& [k, v] : *obj_)
    if (k == key) return &v;
  return nullptr;
}

bool Value::truthy() const {
  switch (kind_) {
    case Kind::kUndefined:
    case Kind::kNone: return false;
    case Kind::kBool:
    case Kind::kInt: return i_ != 0;
    case Kind::kFloat: return f_ != 0.0;
    case Kind::kString: return !str().empty();
    case Kind::kArray: return !arr_->empty();
    case Kind::kObject: return !obj_->empty();
    default: return true;
  }
}

size_t Value::identity() const {
  switch (kind_) {
    case Kind::kArray: return reinterpret_cast<size_t>(arr_.get());
    case Kind::kObject:
    case Kind::kNamespace: return reinterpret_cast<size_t>(obj_.get());
    case Kind::kFunction: return reinterpret_cast<size_t>(fn_.get());
    default: return 0;
  }
}

template <typename J>
static Value value_from_json(const J& j) {
  switch (j.type()) {
    case J::value_t::null: return Value::none();
    case J::value_t::boolean: return Value(j.template get<bool>());
    case J::value_t::number_integer: return Value(j.template get<int64_t>());
    case J::value_t::number_unsigned: {
      // Python's ints have no bound, int64 does: one past it wrapped negative here
      // (12345678901234567890 rendered as -6101065172474983726); it keeps its digits instead.
      const uint64_t u = j.template get<uint64_t>();
      if (u > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) return Value::big_int(std::to_string(u), static_cast<double>(u));
      return Value(static_cast<int64_t>(u));
    }
    case J::value_t::number_float: return Value(j.template get<double>());
    case J::value_t::string: return Value(j.template get<std::string>());
    case J::value_t::array: {
      Array a;
      a.reserve(j.size());
      for (const auto& e : j) a.push_back(value_from_json(e));
      return Value::array(std::move(a));
    }
    case J::value_t::object: {
      Object o;
      o.reserve(j.size());
      for (auto it = j.begin(); it != j.end(); ++it) o.emplace_back(it.key(), value_from_json(it.value()));
      return Value::object(std::move(o));
    }
    default: return Value::none();
  }
}
Value Value::from_json(const nlohmann::json& j) { return value_from_json(j); }
Value Value::from_json(const nlohmann::ordered_json& j) { return value_from_json(j); }

const char* type_name(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "Undefined";
    case Value::Kind::kNone: return "NoneType";
    case Value::Kind::kBool: return "bool";
    case Value::Kind::kInt: return "int";
    case Value::Kind::kFloat: return v.big_int_digits() ? "int" : "float";
    case Value::Kind::kString: return "str";
    case Value::Kind::kArray: return v.is_tuple() ? "tuple" : "list";
    case Value::Kind::kObject: return "dict";
    case Value::Kind::kNamespace: return "Namespace";
    case Value::Kind::kFunction: return "function";
  }
  return "object";
}

// ---- UTF-8 -------------------------------------------------------------------------------------------

static size_t utf8_len_at(const std::string& s, size_t i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  return std::min(n, s.size() - i);
}
static uint32_t utf8_decode_at(const std::string& s, size_t i, size_t n) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  if (n == 1) return c;
  uint32_t cp = c & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return cp;
}

std::vector<std::string> utf8_chars(const std::string& s) {
  if (s.size() > kMaxIterated)
    fail("LimitError", "string of " + std::to_string(s.size()) + " bytes is too long to split into characters");
  std::vector<std::string> out;
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_len_at(s, i);
    out.push_back(s.substr(i, n));
    i += n;
  }
  return out;
}
size_t utf8_length(const std::string& s) {
  size_t n = 0;
  for (size_t i = 0; i < s.size(); i += utf8_len_at(s, i)) ++n;
  return n;
}

bool is_py_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0d) || (cp >= 0x1c && cp <= 0x20) || cp == 0x85 || cp == 0xa0 ||
         cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200a) || cp == 0x2028 || cp == 0x2029 || cp == 0x202f ||
         cp == 0x205f || cp == 0x3000;
}

std::string py_strip(const std::string& s, bool left, bool right, const std::string* chars) {
  std::vector<std::string> strip_set;
  if (chars != nullptr) strip_set = utf8_chars(*chars);
  auto strippable = [&](size_t i, size_t n) {
    if (chars == nullptr) return is_py_space(utf8_decode_at(s, i, n));
    std::string c = s.substr(i, n);
    return std::find(strip_set.begin(), strip_set.end(), c) != strip_set.end();
  };
  size_t b = 0, e = s.size();  // byte range [b, e), walked without materialising code points
  if (left) {
    while (b < e) {
      size_t n = utf8_len_at(s, b);
      if (!strippable(b, n)) break;
      b += n;
    }
  }
  if (right) {
    while (e > b) {
      size_t start = e - 1;
      while (start > b && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
      size_t n = utf8_len_at(s, start);
      if (start + n != e || !strippable(start, n)) break;
      e = start;
    }
  }
  return s.substr(b, e - b);
}

std::vector<uint32_t> utf8_starts(const std::string& s) {
  std::vector<uint32_t> out;
  for (size_t i = 0; i < s.size(); i += utf8_len_at(s, i)) out.push_back(static_cast<uint32_t>(i));
  return out;
}

// Python's str.lower / str.upper: Unicode's case mapping (glibc's C.UTF-8 tables, simple mappings,
// plus the one full mapping templates meet, "ß" → "SS"); ASCII text takes the short way.
namespace {
locale_t utf8_ctype() {
  static const locale_t loc = newlocale(LC_CTYPE_MASK, "C.UTF-8", static_cast<locale_t>(nullptr));
  return loc;
}
template <bool kUpper>
std::string py_case(std::string s) {
  bool ascii = true;
  for (char& c : s) {
    if (static_cast<unsigned char>(c) >= 0x80) ascii = false;
    else if (kUpper ? (c >= 'a' && c <= 'z') : (c >= 'A' && c <= 'Z')) c = static_cast<char>(c ^ 0x20);
  }
  const locale_t loc = utf8_ctype();
  if (ascii || !loc) return s;
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const utf8::Step st = utf8::next(s, i);
    if (st.kind != utf8::Kind::kValid) {  // not text: kept as it is
      out.append(s, i, st.n);
      i += st.n;
      continue;
    }
    if (kUpper && st.cp == 0xDF) out += "SS";
    else utf8::append(out, static_cast<uint32_t>(kUpper ? towupper_l(static_cast<wint_t>(st.cp), loc) : towlower_l(static_cast<wint_t>(st.cp), loc)));
    i += st.n;
  }
  return out;
}
}  // namespace

std::string py_lower(std::string s) { return py_case<false>(std::move(s)); }
bool py_is_cased(const std::string& ch) {
  if (ch.size() == 1) return std::isalpha(static_cast<unsigned char>(ch[0])) != 0;
  const utf8::Step st = utf8::next(ch, 0);
  const locale_t loc = utf8_ctype();
  if (st.kind != utf8::Kind::kValid || !loc) return false;
  const wint_t c = static_cast<wint_t>(st.cp);
  return iswupper_l(c, loc) || iswlower_l(c, loc) || towupper_l(c, loc) != c || towlower_l(c, loc) != c;
}
std::string py_upper(std::string s) { return py_case<true>(std::move(s)); }

// ---- printing ----------------------------------------------------------------------------------------

std::string format_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);  // shortest round trip: [-]d[.ddd]e[+-]XX
  std::string sign;
  if (sci[0] == '-') {
    sign = "-";
    sci.erase(0, 1);
  }
  size_t epos = sci.find('e');
  std::string digits = sci.substr(0, epos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  int exp = std::stoi(sci.substr(epos + 1));
  int decpt = exp + 1;
  std::string out;
  if (decpt <= -4 || decpt > 16) {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  } else if (decpt <= 0) {
    out = "0." + std::string(static_cast<size_t>(-decpt), '0') + digits;
  } else if (static_cast<size_t>(decpt) >= digits.size()) {
    out = digits + std::string(static_cast<size_t>(decpt) - digits.size(), '0') + ".0";
  } else {
    out = digits.substr(0, static_cast<size_t>(decpt)) + "." + digits.substr(static_cast<size_t>(decpt));
  }
  return sign + out;
}

static bool py_printable(uint32_t cp) {
  if (cp < 0x20 || (cp >= 0x7f && cp <= 0xa0) || cp == 0xad) return false;
  if (cp == 0x1680 || (cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) ||
      (cp >= 0x205f && cp <= 0x2064) || cp == 0x3000 || cp == 0xfeff || (cp >= 0xd800 && cp <= 0xdfff))
    return false;
  return true;
}

static std::string repr_string(const std::string& s) {
  bool has_single = s.find('\'') != std::string::npos, has_double = s.find('"') != std::string::npos;
  char q = (has_single && !has_double) ? '"' : '\'';
  std::string out(1, q);
  for (size_t i = 0; i < s.size();) {
    size_t n = utf8_len_at(s, i);
    uint32_t cp = utf8_decode_at(s, i, n);
    char buf[16];
    if (cp == static_cast<uint32_t>(q) || cp == '\\') {
      out += '\\';
      out += static_cast<char>(cp);
    } else if (cp == '\t') {
      out += "\\t";
    } else if (cp == '\n') {
      out += "\\n";
    } else if (cp == '\r') {
      out += "\\r";
    } else if (!py_printable(cp)) {
      if (cp < 0x100)
        std::snprintf(buf, sizeof(buf), "\\x%02x", cp);
      else
        std::snprintf(buf, sizeof(buf), "\\u%04x", cp);
      out += buf;
    } else {
      out.append(s, i, n);
    }
    i += n;
  }
  out += q;
  return out;
}

std::string to_repr(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kString: return repr_string(v.str());
    case Value::Kind::kUndefined: return "Undefined";
    default: return to_str(v);
  }
}

namespace {
// The containers being printed, innermost last: Python's Py_ReprEnter. A container met again inside
// itself (only possible through a namespace, the one mutable value) prints as "[...]" / "{...}" /
// "<Namespace {...}>" as jinja2 prints it, instead of recursing forever.
thread_local std::vector<size_t> tl_printing;
struct Printing {
  bool cycle;
  explicit Printing(size_t id) : cycle(std::find(tl_printing.begin(), tl_printing.end(), id) != tl_printing.end()) {
    if (!cycle) tl_printing.push_back(id);
  }
  ~Printing() {
    if (!cycle) tl_printing.pop_back();
  }
  Printing(const Printing&) = delete;
  Printing& operator=(const Printing&) = delete;
};
}  // namespace

std::string to_str(const Value& v) {
  switch (v.kind()) {
    case Value::Kind::kUndefined: return "";
    case Value::Kind::kNone: return "None";
    case Value::Kind::kBool: return v.as_bool() ? "True" : "False";
    case Value::Kind::kInt: return std::to_string(v.as_int());
    case Value::Kind::kFloat: return v.big_int_digits() ? *v.big_int_digits() : format_float(v.as_double());
    case Value::Kind::kString: return v.str();
    case Value::Kind::kArray: {
      Printing guard(v.identity());
      if (guard.cycle) return v.is_tuple() ? "(...)" : "[...]";
      std::string out = v.is_tuple() ? "(" : "[";
      const Array& a = v.arr();
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += ", ";
        out += to_repr(a[i]);
        check_printed(out.size());
      }
      if (v.is_tuple() && a.size() == 1) out += ",";
      return out + (v.is_tuple() ? ")" : "]");
    }
    case Value::Kind::kObject:
    case Value::Kind::kNamespace: {
      Printing guard(v.identity());
      if (guard.cycle) return v.is_namespace() ? "<Namespace {...}>" : "{...}";
      std::string out = v.is_namespace() ? "<Namespace {" : "{";
      bool first = true;
      for (const auto& [k, x] : v.obj()) {
        if (!first) out += ", ";
        first = false;
        out += repr_string(k) + ": " + to_repr(x);
        check_printed(out.size());
      }
      return out + (v.is_namespace() ? "}>" : "}");
    }
    case Value::Kind::kFunction: return "<function " + v.fn_name() + ">";
  }
  return "";
}

static void json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

static void json_dump(std::string& out, const Value& v, int indent, bool sort_keys, int depth) {
  if (depth > 512) fail("ValueError", "Circular reference detected");
  std::string nl, nl_close;
  if (indent >= 0) {
    nl = "\n" + std::string(static_cast<size_t>(indent * (depth + 1)), ' ');
    nl_close = "\n" + std::string(static_cast<size_t>(indent * depth), ' ');
  }
  const char* item_sep = indent >= 0 ? "," : ", ";
  switch (v.kind()) {
    case Value::Kind::kNone: out += "null"; return;
    case Value::Kind::kBool: out += v.as_bool() ? "true" : "false"; return;
    case Value::Kind::kInt: out += std::to_string(v.as_int()); return;
    case Value::Kind::kFloat: {
      if (const std::string* digits = v.big_int_digits()) {
        out += *digits;
        return;
      }
      double d = v.as_double();
      if (std::isnan(d))
        out += "NaN";
      else if (std::isinf(d))
        out += d < 0 ? "-Infinity" : "Infinity";
      else
        out += format_float(d);
      return;
    }
    case Value::Kind::kString: json_string(out, v.str()); return;
    case Value::Kind::kArray: {
      const Array& a = v.arr();
      if (a.empty()) {
        out += "[]";
        return;
      }
      out += "[";
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += item_sep;
        out += nl;
        json_dump(out, a[i], indent, sort_keys, depth + 1);
        check_printed(out.size());
      }
      out += nl_close + "]";
      return;
    }
    case Value::Kind::kObject: {
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : v.obj()) items.push_back(&kv);
      if (items.empty()) {
        out += "{}";
        return;
      }
      if (sort_keys)
        std::stable_sort(items.begin(), items.end(), [](auto* a, auto* b) { return a->first < b->first; });
      out += "{";
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += item_sep;
        out += nl;
        json_string(out, items[i]->first);
        out += ": ";
        json_dump(out, items[i]->second, indent, sort_keys, depth + 1);
        check_printed(out.size());
      }
      out += nl_close + "}";
      return;
    }
    default:
      fail("TypeError", std::string("Object of type ") + type_name(v) + " is not JSON serializable");
  }
}

std::string to_json(const Value& v, int indent, bool sort_keys) {
  std::string out;
  json_dump(out, v, indent, sort_keys, 0);
  return out;
}

// ---- comparison --------------------------------------------------------------------------------------

bool equals(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind() != b.kind()) return false;
  switch (a.kind()) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone: return true;
    case Value::Kind::kString: return a.str() == b.str();
    case Value::Kind::kArray: {
      if (a.is_tuple() != b.is_tuple() || a.arr().size() != b.arr().size()) return false;
      for (size_t i = 0; i < a.arr().size(); ++i)
        if (!equals(a.arr()[i], b.arr()[i])) return false;
      return true;
    }
    case Value::Kind::kObject: {
      if (a.obj().size() != b.obj().size()) return false;
      for (const auto& [k, v] : a.obj()) {
        const Value* o = b.find(k);
        if (o == nullptr || !equals(v, *o)) return false;
      }
      return true;
    }
    default: return a.identity() == b.identity();
  }
}

int compare(const Value& a, const Value& b) {
  if (a.is_number() && b.is_number()) {
    if (a.is_float() || b.is_float()) {
      double x = a.as_double(), y = b.as_double();
      return x < y ? -1 : x > y ? 1 : 0;
    }
    return a.as_int() < b.as_int() ? -1 : a.as_int() > b.as_int() ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.str() < b.str() ? -1 : a.str() > b.str() ? 1 : 0;
  if (a.is_array() && b.is_array() && a.is_tuple() == b.is_tuple()) {
    const Array &x = a.arr(), &y = b.arr();
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (equals(x[i], y[i])) continue;
      return compare(x[i], y[i]);
    }
    return x.size() < y.size() ? -1 : x.size() > y.size() ? 1 : 0;
  }
  fail("TypeError", std::string("'<' not supported between instances of '") + type_name(a) + "' and '" +
                        type_name(b) + "'");
}

}  // namespace kv::jinja
