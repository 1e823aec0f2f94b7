// Built-in filters, tests, methods and globals of the Jinja subset (see jinja_interp.h). Each one mirrors
// jinja2's (or Python's, for methods) behaviour on the values chat templates pass it; anything else is an
// error rather than a guess.
#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstring>
#include <ctime>

#include "tokenizer/jinja_format.h"
#include "tokenizer/jinja_interp.h"

namespace kv::jinja {
namespace {

Value arg_or(const CallArgs& a, size_t i, const char* name, const Value& dflt) {
  const Value* v = a.get(i, name);
  return v ? *v : dflt;
}
std::string str_arg(const CallArgs& a, size_t i, const char* name, const std::string& dflt) {
  const Value* v = a.get(i, name);
  if (v == nullptr || v->is_undefined()) return dflt;
  return v->is_string() ? v->str() : to_str(*v);
}
bool bool_arg(const CallArgs& a, size_t i, const char* name, bool dflt) {
  const Value* v = a.get(i, name);
  return v ? v->truthy() : dflt;
}
int64_t int_arg(const CallArgs& a, size_t i, const char* name, int64_t dflt) {
  const Value* v = a.get(i, name);
  if (v == nullptr || v->is_none()) return dflt;
  if (!v->is_number()) fail("TypeError", std::string("expected an integer argument, got ") + type_name(*v));
  return v->is_float() ? float_to_int(v->as_double()) : v->as_int();
}

const std::string& need_str(const Value& v, const char* what) {
  if (!v.is_string()) {
    if (v.is_undefined()) fail("UndefinedError", v.str().empty() ? "value is undefined" : v.str());
    fail("TypeError", std::string(what) + " expects a string, got " + type_name(v));
  }
  return v.str();
}

// Python's str.split(sep, maxsplit) / str.split() on whitespace.
Array py_split(Interp& in, const std::string& s, const Value* sep, int64_t maxsplit, bool from_right) {
  std::vector<std::string> parts;
  if (sep == nullptr || sep->is_none()) {
    std::vector<std::string> words;
    std::string w;
    for (auto& c : utf8_chars(s)) {
      uint32_t cp = 0;
      if (c.size() == 1) cp = static_cast<unsigned char>(c[0]);
      else if (c == "\xc2\xa0") cp = 0xa0;
      else if (c == "\xe3\x80\x80") cp = 0x3000;
      bool space = c.size() == 1 ? is_py_space(cp) : (cp != 0 && is_py_space(cp));
      if (space) {
        if (!w.empty()) words.push_back(std::move(w));
        w.clear();
      } else {
        w += c;
      }
    }
    if (!w.empty()) words.push_back(std::move(w));
    if (maxsplit >= 0 && static_cast<int64_t>(words.size()) - 1 > maxsplit) {
      // Rare: rebuild the unsplit tail from the original text.
      std::string tail_src = py_strip(s, !from_right, from_right);
      if (!from_right) {
        std::vector<std::string> head(words.begin(), words.begin() + maxsplit);
        size_t pos = 0;
        for (const auto& h : head) pos = tail_src.find(h, pos) + h.size();
        head.push_back(py_strip(tail_src.substr(pos), true, false));
        words = head;
      }
    }
    parts = std::move(words);
  } else {
    const std::string& d = need_str(*sep, "split");
    if (d.empty()) fail("ValueError", "empty separator");
    if (!from_right) {
      size_t pos = 0;
      int64_t n = 0;
      while (true) {
        size_t f = s.find(d, pos);
        if (f == std::string::npos || (maxsplit >= 0 && n >= maxsplit)) break;
        parts.push_back(s.substr(pos, f - pos));
        pos = f + d.size();
        ++n;
        in.step();
      }
      parts.push_back(s.substr(pos));
    } else {
      size_t end = s.size();
      int64_t n = 0;
      std::vector<std::string> rev;
      while (true) {
        if (end < d.size()) break;
        size_t f = s.rfind(d, end - d.size());
        if (f == std::string::npos || (maxsplit >= 0 && n >= maxsplit)) break;
        rev.push_back(s.substr(f + d.size(), end - f - d.size()));
        end = f;
        ++n;
        in.step();
      }
      rev.push_back(s.substr(0, end));
      parts.assign(rev.rbegin(), rev.rend());
    }
  }
  Array out;
  for (auto& p : parts) out.emplace_back(std::move(p));
  return out;
}

std::string py_replace(Interp& in, const std::string& s, const std::string& from, const std::string& to,
                       int64_t count) {
  if (from.empty()) {
    // Python inserts `to` around every code point.
    std::string out;
    int64_t n = 0;
    std::vector<uint32_t> starts = utf8_starts(s);
    for (size_t i = 0; i <= starts.size(); ++i) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      if (i < starts.size()) out.append(s, starts[i], (i + 1 < starts.size() ? starts[i + 1] : s.size()) - starts[i]);
      in.check_size(out.size());
    }
    return out;
  }
  std::string out;
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    size_t f = s.find(from, pos);
    if (f == std::string::npos) break;
    out.append(s, pos, f - pos);
    out += to;
    in.check_size(out.size());
    pos = f + from.size();
    ++n;
  }
  out.append(s, pos, std::string::npos);
  return out;
}

// Python's str.title(): a cased character after an uncased one is upper-cased, the others
// lower-cased (cased: Unicode letters with case, py_is_cased).
std::string py_title(const std::string& s) {
  std::string out;
  bool prev_cased = false;
  for (auto& c : utf8_chars(s)) {
    if (py_is_cased(c)) {
      out += prev_cased ? py_lower(c) : py_upper(c);
      prev_cased = true;
    } else {
      out += c;
      prev_cased = false;
    }
  }
  return out;
}

std::string py_capitalize(const std::string& s) {
  auto chars = utf8_chars(s);
  std::string out;
  for (size_t i = 0; i < chars.size(); ++i) out += i == 0 ? py_upper(chars[i]) : py_lower(chars[i]);
  return out;
}

// jinja2's title filter: words split on whitespace and -([{< ; first letter upper, rest lower.
std::string jinja_title(const std::string& s) {
  std::string out;
  bool start = true;
  for (auto& c : utf8_chars(s)) {
    bool sep = (c.size() == 1 && (std::isspace(static_cast<unsigned char>(c[0])) || std::strchr("-([{<", c[0])));
    if (sep) {
      out += c;
      start = true;
    } else {
      out += start ? py_upper(c) : py_lower(c);
      start = false;
    }
  }
  return out;
}

Value attr_path(Interp& in, const Value& v, const std::string& path) {
  (void)in;
  Value cur = v;
  size_t pos = 0;
  while (pos <= path.size()) {
    size_t dot = path.find('.', pos);
    std::string part = path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
    if (cur.is_object() || cur.is_namespace()) {
      const Value* f = cur.find(part);
      cur = f ? *f : Value::undefined("'dict object' has no attribute '" + part + "'");
    } else if (cur.is_array() && !part.empty() && std::all_of(part.begin(), part.end(), ::isdigit)) {
      size_t i = std::stoul(part);
      cur = i < cur.arr().size() ? cur.arr()[i] : Value::undefined();
    } else {
      return Value::undefined("no attribute '" + part + "'");
    }
    if (dot == std::string::npos) break;
    pos = dot + 1;
  }
  return cur;
}

std::string html_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&': out += "&amp;"; break;
      case '<': out += "&lt;"; break;
      case '>': out += "&gt;"; break;
      case '"': out += "&#34;"; break;
      case '\'': out += "&#39;"; break;
      default: out += c;
    }
  }
  return out;
}

Value to_list(const Value& v) { return Value::array(iterate(v)); }

Value items_of(const Value& v) {
  if (v.is_undefined()) return Value::array({});
  if (!v.is_object() && !v.is_namespace()) fail("TypeError", "items filter expects a mapping");
  Array out;
  for (const auto& [k, x] : v.obj()) out.push_back(Value::array({Value(k), x}, true));
  return Value::array(std::move(out));
}

void sort_values(Interp& in, std::vector<Value>& xs, bool reverse, bool case_sensitive, const std::string& attr) {
  auto key = [&](const Value& v) {
    Value k = attr.empty() ? v : attr_path(in, v, attr);
    if (!case_sensitive && k.is_string()) return Value(py_lower(k.str()));
    return k;
  };
  in.step(static_cast<int64_t>(xs.size()));
  std::stable_sort(xs.begin(), xs.end(), [&](const Value& a, const Value& b) {
    int c = compare(key(a), key(b));
    return reverse ? c > 0 : c < 0;
  });
}

}  // namespace

Value builtin_filter(Interp& in, const std::string& name, const Value& v, CallArgs& a) {
  static const Value kNone = Value::none();
  static const Value kUndef;
  if (name == "trim") {
    const Value* chars = a.get(0, "chars");
    std::string cs = chars && !chars->is_none() ? to_str(*chars) : "";
    return Value(py_strip(need_str(v.is_string() ? v : Value(to_str(v)), "trim"), true, true,
                          chars && !chars->is_none() ? &cs : nullptr));
  }
  if (name == "length" || name == "count") {
    switch (v.kind()) {
      case Value::Kind::kString: return Value(static_cast<int64_t>(utf8_length(v.str())));
      case Value::Kind::kArray: return Value(static_cast<int64_t>(v.arr().size()));
      case Value::Kind::kObject:
      case Value::Kind::kNamespace: return Value(static_cast<int64_t>(v.obj().size()));
      case Value::Kind::kUndefined: return Value(0);
      default: fail("TypeError", std::string("object of type '") + type_name(v) + "' has no len()");
    }
  }
  if (name == "upper") return Value(py_upper(to_str(v)));
  if (name == "lower") return Value(py_lower(to_str(v)));
  if (name == "capitalize") return Value(py_capitalize(to_str(v)));
  if (name == "title") return Value(jinja_title(to_str(v)));
  if (name == "string") return v.is_string() ? v : Value(to_str(v));
  if (name == "safe") return v;
  if (name == "e" || name == "escape" || name == "forceescape") return Value(html_escape(to_str(v)));
  if (name == "tojson") {
    int indent = -1;
    if (const Value* iv = a.get(0, "indent"); iv && !iv->is_none()) {
      if (!iv->is_int()) fail("TypeError", "tojson indent must be an integer");
      indent = static_cast<int>(std::clamp<int64_t>(iv->as_int(), 0, 64));
    }
    std::string s = to_json(v, indent, bool_arg(a, 99, "sort_keys", false));
    in.check_size(s.size());
    return Value(std::move(s));
  }
  if (name == "default" || name == "d") {
    Value dflt = arg_or(a, 0, "default_value", Value(""));
    bool boolean = bool_arg(a, 1, "boolean", false);
    if (v.is_undefined() || (boolean && !v.truthy())) return dflt;
    return v;
  }
  if (name == "first") {
    if (v.is_undefined()) return Value::undefined("No first item, sequence was empty.");
    auto xs = iterate(v);
    return xs.empty() ? Value::undefined("No first item, sequence was empty.") : xs.front();
  }
  if (name == "last") {
    auto xs = iterate(v);
    return xs.empty() ? Value::undefined("No last item, sequence was empty.") : xs.back();
  }
  if (name == "join") {
    std::string d = str_arg(a, 0, "d", "");
    std::string attr = str_arg(a, 1, "attribute", "");
    std::string out;
    bool first = true;
    for (const auto& x : iterate(v)) {
      if (!first) out += d;
      first = false;
      out += to_str(attr.empty() ? x : attr_path(in, x, attr));
      in.check_size(out.size());
    }
    return Value(std::move(out));
  }
  if (name == "replace") {
    std::string s = v.is_string() ? v.str() : to_str(v);
    return Value(py_replace(in, s, str_arg(a, 0, "old", ""), str_arg(a, 1, "new", ""), int_arg(a, 2, "count", -1)));
  }
  if (name == "int") {
    Value dflt = arg_or(a, 0, "default", Value(0));
    if (v.is_int()) return v;
    if (v.is_bool()) return Value(v.as_int());
    // What int64 cannot hold (inf, NaN, 1e300, "99999999999999999999") is a conversion that does not work:
    // the default, as jinja2 documents for the int filter.
    if (v.is_float()) return fits_int64(v.as_double()) ? Value(static_cast<int64_t>(v.as_double())) : dflt;
    if (v.is_string()) {
      std::string s = py_strip(v.str(), true, true);
      try {
        size_t used = 0;
        long long x = std::stoll(s, &used, 10);
        if (used == s.size()) return Value(static_cast<int64_t>(x));
        double d = std::stod(s, &used);
        if (used == s.size()) return fits_int64(d) ? Value(static_cast<int64_t>(d)) : dflt;
      } catch (...) {
      }
    }
    return dflt;
  }
  if (name == "float") {
    Value dflt = arg_or(a, 0, "default", Value(0.0));
    if (v.is_number()) return Value(v.as_double());
    if (v.is_string()) {
      std::string s = py_strip(v.str(), true, true);
      try {
        size_t used = 0;
        double d = std::stod(s, &used);
        if (used == s.size()) return Value(d);
      } catch (...) {
      }
    }
    return dflt;
  }
  if (name == "abs") {
    if (!v.is_number()) fail("TypeError", std::string("bad operand type for abs(): '") + type_name(v) + "'");
    if (v.is_float()) return Value(std::fabs(v.as_double()));
    if (v.as_int() == INT64_MIN) fail("OverflowError", "integer overflow");
    return Value(v.as_int() < 0 ? -v.as_int() : v.as_int());
  }
  if (name == "round") {
    int64_t prec = int_arg(a, 0, "precision", 0);
    std::string method = str_arg(a, 1, "method", "common");
    if (!v.is_number()) fail("TypeError", "round filter expects a number");
    double x = v.as_double(), m = std::pow(10.0, static_cast<double>(prec));
    double r = method == "ceil" ? std::ceil(x * m) / m : method == "floor" ? std::floor(x * m) / m
                                                                          : std::nearbyint(x * m) / m;
    return Value(r);
  }
  if (name == "list") return to_list(v);
  if (name == "reverse") {
    if (v.is_string()) {
      auto cs = utf8_chars(v.str());
      std::string out;
      for (auto it = cs.rbegin(); it != cs.rend(); ++it) out += *it;
      return Value(std::move(out));
    }
    auto xs = iterate(v);
    std::reverse(xs.begin(), xs.end());
    return Value::array(std::move(xs));
  }
  if (name == "sort") {
    auto xs = iterate(v);
    sort_values(in, xs, bool_arg(a, 0, "reverse", false), bool_arg(a, 1, "case_sensitive", false),
                str_arg(a, 2, "attribute", ""));
    return Value::array(std::move(xs));
  }
  if (name == "dictsort") {
    Value it = items_of(v);
    std::vector<Value> xs = it.arr();
    bool cs = bool_arg(a, 0, "case_sensitive", false);
    std::string by = str_arg(a, 1, "by", "key");
    bool rev = bool_arg(a, 2, "reverse", false);
    sort_values(in, xs, rev, cs, by == "value" ? "1" : "0");
    return Value::array(std::move(xs));
  }
  if (name == "items") return items_of(v);
  if (name == "unique") {
    std::vector<Value> out;
    for (const auto& x : iterate(v)) {
      in.step();
      bool seen = false;
      for (const auto& y : out)
        if (equals(x, y) || (x.is_string() && y.is_string() && py_lower(x.str()) == py_lower(y.str())))
          seen = true;
      if (!seen) out.push_back(x);
    }
    return Value::array(std::move(out));
  }
  if (name == "sum") {
    std::string attr = str_arg(a, 0, "attribute", "");
    Value total = arg_or(a, 1, "start", Value(0));
    for (const auto& x : iterate(v)) {
      Value y = attr.empty() ? x : attr_path(in, x, attr);
      if (!y.is_number() || !total.is_number()) fail("TypeError", "sum filter expects numbers");
      int64_t t;
      if (total.is_float() || y.is_float()) total = Value(total.as_double() + y.as_double());
      else if (__builtin_add_overflow(total.as_int(), y.as_int(), &t)) fail("OverflowError", "integer overflow");
      else total = Value(t);
    }
    return total;
  }
  if (name == "min" || name == "max") {
    auto xs = iterate(v);
    if (xs.empty()) return Value::undefined("No aggregated item, sequence was empty.");
    bool cs = bool_arg(a, 0, "case_sensitive", false);
    std::string attr = str_arg(a, 1, "attribute", "");
    sort_values(in, xs, false, cs, attr);
    return name == "min" ? xs.front() : xs.back();
  }
  if (name == "map") {
    std::vector<Value> out;
    std::string attr = str_arg(a, 99, "attribute", "");
    if (!attr.empty()) {
      const Value* dflt = a.get(99, "default");
      for (const auto& x : iterate(v)) {
        Value y = attr_path(in, x, attr);
        out.push_back(y.is_undefined() && dflt ? *dflt : y);
      }
    } else {
      if (a.pos.empty()) fail("FilterArgumentError", "map requires a filter name or attribute=");
      std::string f = need_str(a.pos[0], "map");
      CallArgs rest;
      rest.pos.assign(a.pos.begin() + 1, a.pos.end());
      rest.kw = a.kw;
      for (const auto& x : iterate(v)) {
        CallArgs r = rest;
        out.push_back(in.apply_filter(f, x, r));
      }
    }
    return Value::array(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    bool attr_mode = name == "selectattr" || name == "rejectattr";
    bool want = name == "select" || name == "selectattr";
    size_t k = 0;
    std::string attr;
    if (attr_mode) {
      if (a.pos.empty()) fail("FilterArgumentError", name + " requires an attribute name");
      attr = need_str(a.pos[k++], name.c_str());
    }
    std::string test;
    if (k < a.pos.size()) test = need_str(a.pos[k++], name.c_str());
    CallArgs rest;
    rest.pos.assign(a.pos.begin() + static_cast<long>(std::min(k, a.pos.size())), a.pos.end());
    std::vector<Value> out;
    for (const auto& x : iterate(v)) {
      in.step();
      Value y = attr_mode ? attr_path(in, x, attr) : x;
      bool r;
      if (test.empty()) {
        r = y.truthy();
      } else {
        CallArgs rr = rest;
        r = in.apply_test(test, y, rr);
      }
      if (r == want) out.push_back(x);
    }
    return Value::array(std::move(out));
  }
  if (name == "indent") {
    std::string s = to_str(v);
    const Value* w = a.get(0, "width");
    std::string pad = w == nullptr ? "    " : w->is_string() ? w->str() : std::string(static_cast<size_t>(
                                                                                std::clamp<int64_t>(int_arg(a, 0, "width", 4), 0, 256)), ' ');
    bool first = bool_arg(a, 1, "first", false), blank = bool_arg(a, 2, "blank", false);
    std::string out;
    size_t pos = 0;
    bool is_first = true;
    while (true) {
      size_t nl = s.find('\n', pos);
      std::string line = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
      bool do_pad = is_first ? first : (blank || !line.empty());
      if (is_first && first && line.empty() && !blank) do_pad = true;
      if (do_pad) out += pad;
      out += line;
      in.check_size(out.size());
      if (nl == std::string::npos) break;
      out += '\n';
      pos = nl + 1;
      is_first = false;
    }
    return Value(std::move(out));
  }
  if (name == "wordcount") {
    Array words = py_split(in, to_str(v), nullptr, -1, false);
    return Value(static_cast<int64_t>(words.size()));
  }
  if (name == "center") {
    std::string s = to_str(v);
    int64_t width = std::clamp<int64_t>(int_arg(a, 0, "width", 80), 0, 1 << 20);
    int64_t len = static_cast<int64_t>(utf8_length(s));
    if (width <= len) return Value(s);
    int64_t total = width - len, left = total / 2 + (total & width & 1);
    return Value(std::string(static_cast<size_t>(left), ' ') + s + std::string(static_cast<size_t>(total - left), ' '));
  }
  if (name == "truncate") {  // jinja2's do_truncate; leeway None: the environment's policy, 5
    if (v.is_undefined()) return v;  // len(Undefined) is 0: returned as it is
    const std::string& s = need_str(v, "truncate");
    auto int_or = [&](size_t i, const char* n, int64_t dflt) {
      const Value* x = a.get(i, n);
      if (x == nullptr || (x->is_none() && std::strcmp(n, "leeway") == 0)) return dflt;
      if (!x->is_int()) fail("TypeError", std::string("truncate: ") + n + " must be an integer, got " + type_name(*x));
      return x->as_int();
    };
    const int64_t length = int_or(0, "length", 255), leeway = int_or(3, "leeway", 5);
    const bool killwords = bool_arg(a, 1, "killwords", false);
    const Value* end_arg = a.get(2, "end");
    const std::string end = end_arg ? need_str(*end_arg, "truncate's end") : "...";
    const int64_t n_end = static_cast<int64_t>(utf8_length(end));
    if (length < n_end) fail("AssertionError", "expected length >= " + std::to_string(n_end) + ", got " + std::to_string(length));
    if (leeway < 0) fail("AssertionError", "expected leeway >= 0, got " + std::to_string(leeway));
    if (static_cast<int64_t>(utf8_length(s)) - leeway <= length) return v;
    std::string head = first_code_points(s, length - n_end);
    if (!killwords) {  // s[:length - len(end)].rsplit(" ", 1)[0]
      const size_t sp = head.rfind(' ');
      if (sp != std::string::npos) head.resize(sp);
    }
    return Value(head + end);
  }
  if (name == "format") {
    std::string s = py_format(need_str(v, "format"), a.pos);
    in.check_size(s.size());
    return Value(std::move(s));
  }
  if (name == "attr") return attr_path(in, v, str_arg(a, 0, "name", ""));
  (void)kNone;
  (void)kUndef;
  fail("TemplateAssertionError", "No filter named '" + name + "'.");
}

bool builtin_test(Interp& in, const std::string& name, const Value& v, CallArgs& a) {
  (void)in;
  auto arg0 = [&]() -> const Value& {
    if (a.pos.empty()) fail("TypeError", "test '" + name + "' needs an argument");
    return a.pos[0];
  };
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.is_object();
  if (name == "iterable") return v.is_string() || v.is_array() || v.is_object() || v.is_undefined();
  if (name == "sequence") return v.is_string() || v.is_array() || v.is_object() || v.is_undefined();
  if (name == "number") return v.is_number();
  if (name == "integer") return v.is_int();
  if (name == "float") return v.is_float();
  if (name == "boolean") return v.is_bool();
  if (name == "true") return v.is_bool() && v.as_bool();
  if (name == "false") return v.is_bool() && !v.as_bool();
  if (name == "callable") return v.is_function();
  if (name == "odd" || name == "even") {
    if (!v.is_int() && !v.is_bool()) fail("TypeError", "odd/even test expects an integer");
    bool odd = (v.as_int() % 2) != 0;
    return name == "odd" ? odd : !odd;
  }
  if (name == "divisibleby") {
    const Value& d = arg0();
    if (!d.is_number() || !v.is_number()) fail("TypeError", "divisibleby expects numbers");
    if (d.as_double() == 0) fail("ZeroDivisionError", "integer division or modulo by zero");
    return std::fmod(v.as_double(), d.as_double()) == 0;
  }
  if (name == "eq" || name == "equalto" || name == "==") return equals(v, arg0());
  if (name == "ne" || name == "!=") return !equals(v, arg0());
  if (name == "lt" || name == "lessthan" || name == "<") return compare(v, arg0()) < 0;
  if (name == "le" || name == "<=") return compare(v, arg0()) <= 0;
  if (name == "gt" || name == "greaterthan" || name == ">") return compare(v, arg0()) > 0;
  if (name == "ge" || name == ">=") return compare(v, arg0()) >= 0;
  if (name == "sameas") {
    const Value& o = arg0();
    if (v.is_none() || o.is_none()) return v.is_none() && o.is_none();
    if (v.is_bool() && o.is_bool()) return v.as_bool() == o.as_bool();
    return v.identity() != 0 && v.identity() == o.identity();
  }
  if (name == "in") {
    const Value& c = arg0();
    if (c.is_string()) return v.is_string() && c.str().find(v.str()) != std::string::npos;
    if (c.is_object()) return v.is_string() && c.find(v.str()) != nullptr;
    for (const auto& x : iterate(c))
      if (equals(v, x)) return true;
    return false;
  }
  if (name == "lower") return v.is_string() && py_lower(v.str()) == v.str();
  if (name == "upper") return v.is_string() && py_upper(v.str()) == v.str();
  if (name == "escaped") return false;
  fail("TemplateAssertionError", "No test named '" + name + "'.");
}

bool has_method(const Value& obj, const std::string& name) {
  static const char* kStr[] = {"strip", "lstrip", "rstrip", "startswith", "endswith", "split", "rsplit",
                               "title", "lower", "upper", "capitalize", "replace", "find", "rfind", "count",
                               "join", "splitlines", "isdigit", "isalpha", "isalnum", "isspace", "islower",
                               "isupper", "index", "format"};
  static const char* kDict[] = {"get", "items", "keys", "values"};
  static const char* kList[] = {"index", "count"};
  auto in_list = [&](auto& list) {
    for (const char* m : list)
      if (name == m) return true;
    return false;
  };
  if (obj.is_string()) return in_list(kStr);
  if (obj.is_object()) return in_list(kDict);
  if (obj.is_array()) return in_list(kList);
  return false;
}

Value builtin_method(Interp& in, const Value& obj, const std::string& name, CallArgs& a) {
  if (obj.is_string()) {
    const std::string& s = obj.str();
    if (name == "strip" || name == "lstrip" || name == "rstrip") {
      const Value* c = a.get(0, "chars");
      std::string cs = c && !c->is_none() ? need_str(*c, name.c_str()) : "";
      return Value(py_strip(s, name != "rstrip", name != "lstrip", c && !c->is_none() ? &cs : nullptr));
    }
    if (name == "startswith" || name == "endswith") {
      const Value* p = a.get(0, "prefix");
      if (p == nullptr) fail("TypeError", name + " takes at least 1 argument");
      std::vector<Value> cands = p->is_tuple() || p->is_array() ? p->arr() : std::vector<Value>{*p};
      for (const auto& c : cands) {
        const std::string& x = need_str(c, name.c_str());
        if (name == "startswith" ? s.compare(0, x.size(), x) == 0
                                 : (s.size() >= x.size() && s.compare(s.size() - x.size(), x.size(), x) == 0))
          return Value(true);
      }
      return Value(false);
    }
    if (name == "split" || name == "rsplit")
      return Value::array(py_split(in, s, a.get(0, "sep"), int_arg(a, 1, "maxsplit", -1), name == "rsplit"));
    if (name == "title") return Value(py_title(s));
    if (name == "lower") return Value(py_lower(s));
    if (name == "upper") return Value(py_upper(s));
    if (name == "capitalize") return Value(py_capitalize(s));
    if (name == "replace") {
      if (a.pos.size() < 2) fail("TypeError", "replace expected at least 2 arguments");
      return Value(py_replace(in, s, need_str(a.pos[0], "replace"), need_str(a.pos[1], "replace"),
                              int_arg(a, 2, "count", -1)));
    }
    if (name == "find" || name == "rfind" || name == "index") {
      if (a.pos.empty()) fail("TypeError", name + " takes at least 1 argument");
      const std::string& x = need_str(a.pos[0], name.c_str());
      size_t f = name == "rfind" ? s.rfind(x) : s.find(x);
      if (f == std::string::npos) {
        if (name == "index") fail("ValueError", "substring not found");
        return Value(-1);
      }
      return Value(static_cast<int64_t>(utf8_length(s.substr(0, f))));
    }
    if (name == "count") {
      if (a.pos.empty()) fail("TypeError", "count takes at least 1 argument");
      const std::string& x = need_str(a.pos[0], "count");
      if (x.empty()) return Value(static_cast<int64_t>(utf8_length(s) + 1));
      int64_t n = 0;
      for (size_t p = s.find(x); p != std::string::npos; p = s.find(x, p + x.size())) ++n;
      return Value(n);
    }
    if (name == "join") {
      if (a.pos.empty()) fail("TypeError", "join takes exactly one argument");
      std::string out;
      bool first = true;
      for (const auto& x : iterate(a.pos[0])) {
        if (!first) out += s;
        first = false;
        out += need_str(x, "join");
        in.check_size(out.size());
      }
      return Value(std::move(out));
    }
    if (name == "splitlines") {
      Array out;
      std::string cur;
      bool keep = bool_arg(a, 0, "keepends", false);
      for (size_t i = 0; i < s.size(); ++i) {
        if (s[i] == '\n' || s[i] == '\r') {
          std::string end(1, s[i]);
          if (s[i] == '\r' && i + 1 < s.size() && s[i + 1] == '\n') end += s[++i];
          out.emplace_back(keep ? cur + end : cur);
          cur.clear();
        } else {
          cur += s[i];
        }
      }
      if (!cur.empty()) out.emplace_back(cur);
      return Value::array(std::move(out));
    }
    if (name.rfind("is", 0) == 0) {
      if (s.empty()) return Value(false);
      for (char c : s) {
        unsigned char u = static_cast<unsigned char>(c);
        bool ok = name == "isdigit" ? std::isdigit(u) : name == "isalpha" ? std::isalpha(u)
                  : name == "isalnum" ? std::isalnum(u) : name == "isspace" ? std::isspace(u)
                  : name == "islower" ? !std::isupper(u) : !std::islower(u);
        if (!ok) return Value(false);
      }
      return Value(true);
    }
    if (name == "format") return Value(py_str_format(in, s, a));
  }
  if (obj.is_object()) {
    if (name == "get") {
      if (a.pos.empty()) fail("TypeError", "get expected at least 1 argument");
      static const Value kNone = Value::none();
      const Value& dflt = a.pos.size() > 1 ? a.pos[1] : kNone;
      if (!a.pos[0].is_string()) return dflt;
      const Value* v = obj.find(a.pos[0].str());
      return v ? *v : dflt;
    }
    if (name == "items") return items_of(obj);
    if (name == "keys" || name == "values") {
      Array out;
      for (const auto& [k, v] : obj.obj()) out.push_back(name == "keys" ? Value(k) : v);
      return Value::array(std::move(out));
    }
  }
  if (obj.is_array()) {
    if (a.pos.empty()) fail("TypeError", name + " takes exactly one argument");
    int64_t n = 0;
    for (size_t i = 0; i < obj.arr().size(); ++i) {
      if (!equals(obj.arr()[i], a.pos[0])) continue;
      if (name == "index") return Value(static_cast<int64_t>(i));
      ++n;
    }
    if (name == "index") fail("ValueError", "value is not in list");
    return Value(n);
  }
  fail("AttributeError", std::string("'") + type_name(obj) + "' object has no attribute '" + name + "'");
}

std::vector<std::pair<std::string, Value>> builtin_globals(Interp& in) {
  std::vector<std::pair<std::string, Value>> g;
  g.emplace_back("raise_exception", Value::function(
                                        [](CallArgs& a) -> Value {
                                          std::string msg = a.pos.empty() ? std::string() : to_str(a.pos[0]);
                                          // never an empty message: the template's author gave none
                                          fail("TemplateError", msg.empty() ? "raise_exception() without a message" : msg);
                                        },
                                        "raise_exception"));
  g.emplace_back("namespace", Value::function(
                                  [&in](CallArgs& a) -> Value {
                                    Object o;
                                    if (!a.pos.empty()) {
                                      if (!a.pos[0].is_object()) fail("TypeError", "namespace() expects a mapping");
                                      o = a.pos[0].obj();
                                    }
                                    for (const auto& [k, v] : a.kw) {
                                      if (!k.empty() && k[0] == '_')
                                        fail("SecurityError", "Chat templates cannot store underscore-prefixed "
                                                              "attributes on a namespace, but got '" + k + "'.");
                                      o.emplace_back(k, v);
                                    }
                                    return in.make_namespace(std::move(o));
                                  },
                                  "namespace"));
  g.emplace_back("dict", Value::function(
                             [](CallArgs& a) -> Value {
                               Object o;
                               if (!a.pos.empty() && a.pos[0].is_object()) o = a.pos[0].obj();
                               for (const auto& [k, v] : a.kw) o.emplace_back(k, v);
                               return Value::object(std::move(o));
                             },
                             "dict"));
  Interp* ip = &in;
  g.emplace_back("range", Value::function(
                              [ip](CallArgs& a) -> Value {
                                int64_t start = 0, stop, st = 1;
                                for (const auto& v : a.pos)
                                  if (!v.is_int() && !v.is_bool()) fail("TypeError", "range() expects integers");
                                if (a.pos.size() == 1) {
                                  stop = a.pos[0].as_int();
                                } else if (a.pos.size() >= 2) {
                                  start = a.pos[0].as_int();
                                  stop = a.pos[1].as_int();
                                  if (a.pos.size() > 2) st = a.pos[2].as_int();
                                } else {
                                  fail("TypeError", "range expected at least 1 argument");
                                }
                                if (st == 0) fail("ValueError", "range() arg 3 must not be zero");
                                // Bound the list before building it: a range is materialised.
                                long double n = (static_cast<long double>(stop) - start) / st;
                                if (n > 0) ip->check_size(static_cast<size_t>(std::min<long double>(n, 1e15)) * sizeof(Value));
                                Array out;
                                // The next value past int64 is past `stop` too: the range ends there.
                                for (int64_t i = start; st > 0 ? i < stop : i > stop;) {
                                  ip->step();
                                  out.emplace_back(i);
                                  if (__builtin_add_overflow(i, st, &i)) break;
                                }
                                return Value::array(std::move(out));
                              },
                              "range"));
  g.emplace_back("strftime_now", Value::function(
                                     [](CallArgs& a) -> Value {
                                       std::string fmt = a.pos.empty() ? "" : to_str(a.pos[0]);
                                       std::time_t t = std::time(nullptr);
                                       std::tm tm{};
                                       localtime_r(&t, &tm);
                                       char buf[256];
                                       size_t n = std::strftime(buf, sizeof(buf), fmt.c_str(), &tm);
                                       return Value(std::string(buf, n));
                                     },
                                     "strftime_now"));
  return g;
}

}  // namespace kv::jinja
