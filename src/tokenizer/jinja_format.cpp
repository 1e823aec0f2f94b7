// Python's string formatting for the Jinja subset (jinja_format.h).
#include "tokenizer/jinja_format.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "tokenizer/jinja_interp.h"

namespace kv::jinja {

bool fits_int64(double d) { return d >= -9223372036854775808.0 && d < 9223372036854775808.0; }  // NaN: no

int64_t float_to_int(double d) {
  if (std::isnan(d)) fail("ValueError", "cannot convert float NaN to integer");
  if (!fits_int64(d))
    fail("OverflowError", "cannot convert float " + format_float(d) + " to a 64-bit integer");
  return static_cast<int64_t>(d);
}

// The first n code points of s (Python's s[:n]).
std::string first_code_points(const std::string& s, int64_t n) {
  const std::vector<uint32_t> starts = utf8_starts(s);
  return n < static_cast<int64_t>(starts.size()) ? s.substr(0, starts[static_cast<size_t>(std::max<int64_t>(n, 0))]) : s;
}

namespace {

// A number's sign as Python writes it: '-' when negative, else '+' or ' ' when asked. (A
// std::string assigned a choice of literals set off GCC 12's -Wrestrict.)
std::string sign_text(bool negative, char sign) { return std::string(negative ? 1 : sign == '+' || sign == ' ' ? 1 : 0, negative ? '-' : sign); }

constexpr int kMaxFormatWidth = 4096;  // of a format's width and precision

// Pads `s` (its width counted in code points, as Python counts) to `width` with `fill` (one code
// point): align '<' left, '>' right, '^' centred (the extra fill on the right); '=' puts the fill
// after the first `sign_len` bytes (a number's sign and base prefix).
std::string pad_to(const std::string& s, int64_t width, const std::string& fill, char align, size_t sign_len = 0) {
  const int64_t n = static_cast<int64_t>(utf8_length(s));
  if (width <= n) return s;
  auto fills = [&](int64_t k) {
    std::string f;
    for (int64_t i = 0; i < k; ++i) f += fill;
    return f;
  };
  const int64_t k = width - n;
  switch (align) {
    case '<': return s + fills(k);
    case '^': return fills(k / 2) + s + fills(k - k / 2);
    case '=': return s.substr(0, sign_len) + fills(k) + s.substr(sign_len);
    default: return fills(k) + s;
  }
}

std::string c_format(const std::string& f, double x) {
  const int n = std::snprintf(nullptr, 0, f.c_str(), x);
  if (n < 0) fail("ValueError", "bad format '" + f + "'");
  std::string buf(static_cast<size_t>(n) + 1, '\0');
  std::snprintf(buf.data(), buf.size(), f.c_str(), x);
  buf.resize(static_cast<size_t>(n));
  return buf;
}

// The digits of a finite |x| >= 0 as Python's float.__format__ writes them for `type` ('\0': none)
// and `prec` (-1: none); no sign. Python's own types are C's (%f %e %g, '%' is f of 100x), but
// for no type: repr without a precision, and with one 'g' that keeps a ".0" on an integer and
// goes to an exponent from prec digits before the point on (CPython's Py_DTSF_ADD_DOT_0).
std::string float_digits(double ax, char type, int prec, bool alt) {
  const char lower = static_cast<char>(std::tolower(static_cast<unsigned char>(type)));
  std::string out;
  if (std::isnan(ax) || std::isinf(ax)) {
    out = std::isnan(ax) ? "nan" : "inf";
    if (type == 'F' || type == 'E' || type == 'G') for (char& c : out) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
    return type == '%' ? out + "%" : out;
  }
  const std::string hash = alt ? "#" : "";
  if (lower == 'f' || lower == 'e' || lower == 'g') {
    out = c_format("%" + hash + "." + std::to_string(prec < 0 ? 6 : prec) + type, ax);
  } else if (type == '%') {
    out = c_format("%" + hash + "." + std::to_string(prec < 0 ? 6 : prec) + "f", ax * 100) + "%";
  } else if (prec < 0) {
    out = format_float(ax);
  } else {
    const int p = std::max(prec, 1);
    const std::string e = c_format("%." + std::to_string(p - 1) + "e", ax);
    const int decpt = std::atoi(e.c_str() + e.find('e') + 1) + 1;
    auto strip = [&](std::string m) {  // trailing zeros of a fraction, and a bare point
      if (m.find('.') == std::string::npos || alt) return m;
      m.erase(m.find_last_not_of('0') + 1);
      if (m.back() == '.') m.pop_back();
      return m;
    };
    if (decpt <= -4 || decpt > p - 1) {
      out = strip(e.substr(0, e.find('e'))) + e.substr(e.find('e'));
    } else {
      out = strip(c_format("%." + std::to_string(p - decpt) + "f", ax));
      if (out.find('.') == std::string::npos) out += ".0";
    }
  }
  return out;
}

// One replacement field of str.format: Python's format(v, spec) for the format-spec mini-language
// [[fill]align][sign][#][0][width][.precision][type], types s d b o x X e E f F g G % and none;
// anything else (grouping, 'z', 'n', 'c', nested fields) is an error, never a guess.
std::string format_field(const Value& v, const std::string& spec) {
  if (spec.empty()) return to_str(v);
  if (!v.is_string() && !v.is_number())
    fail("TypeError", std::string("unsupported format string passed to ") + type_name(v) + ".__format__");
  const std::vector<std::string> cs = utf8_chars(spec);
  size_t k = 0;
  std::string fill;
  char align = 0;
  auto is_align = [](const std::string& c) { return c.size() == 1 && std::strchr("<>=^", c[0]) && c[0] != 0; };
  if (cs.size() >= 2 && is_align(cs[1])) {
    fill = cs[0];
    align = cs[1][0];
    k = 2;
  } else if (is_align(cs[0])) {
    align = cs[0][0];
    k = 1;
  }
  auto at = [&](const char* set) { return k < cs.size() && cs[k].size() == 1 && std::strchr(set, cs[k][0]) && cs[k][0] != 0; };
  char sign = 0;
  if (at("+- ")) sign = cs[k++][0];
  bool alt = false, zero = false;
  if (at("z")) fail("ValueError", "the 'z' format option is not supported here");
  if (at("#")) {
    alt = true;
    ++k;
  }
  if (at("0")) {
    zero = true;
    ++k;
  }
  auto number = [&](const char* what) -> int {
    std::string d;
    while (at("0123456789")) d += cs[k++];
    if (d.size() > 4 || (!d.empty() && std::stoi(d) > kMaxFormatWidth))
      fail("ValueError", std::string("format ") + what + " larger than " + std::to_string(kMaxFormatWidth));
    return d.empty() ? -1 : std::stoi(d);
  };
  const int width = number("width");
  if (at(",_")) fail("ValueError", "grouping ('" + cs[k] + "') in a format specifier is not supported here");
  int prec = -1;
  if (at(".")) {
    ++k;
    prec = number("precision");
    if (prec < 0) fail("ValueError", "Format specifier missing precision");
  }
  char type = 0;
  if (k < cs.size()) type = cs[k].size() == 1 ? cs[k++][0] : '?';
  if (k < cs.size() || type == '?') fail("ValueError", "Invalid format specifier '" + spec + "' for object of type '" + type_name(v) + "'");
  if (zero && fill.empty()) {
    fill.assign(1, '0');
    if (!align) align = v.is_string() ? '<' : '=';
  }
  if (fill.empty()) fill.assign(1, ' ');
  auto unknown = [&]() { fail("ValueError", std::string("Unknown format code '") + type + "' for object of type '" + type_name(v) + "'"); };
  if (v.is_string()) {
    if (type && type != 's') unknown();
    if (sign) fail("ValueError", "Sign not allowed in string format specifier");
    if (alt) fail("ValueError", "Alternate form (#) not allowed in string format specifier");
    if (align == '=') fail("ValueError", "'=' alignment not allowed in string format specifier");
    return pad_to(prec >= 0 ? first_code_points(v.str(), prec) : v.str(), width, fill, align ? align : '<');
  }
  std::string head, body;  // sign and base prefix; digits
  const bool integer_type = !type || std::strchr("dboxX", type);
  if (!v.is_float() && integer_type) {  // int or bool
    if (prec >= 0) fail("ValueError", "Precision not allowed in integer format specifier");
    const int64_t x = v.as_int();
    uint64_t mag = x < 0 ? 0 - static_cast<uint64_t>(x) : static_cast<uint64_t>(x);
    const int base = type == 'b' ? 2 : type == 'o' ? 8 : type == 'x' || type == 'X' ? 16 : 10;
    const char* digits = type == 'X' ? "0123456789ABCDEF" : "0123456789abcdef";
    do {
      body.insert(body.begin(), digits[mag % static_cast<uint64_t>(base)]);
      mag /= static_cast<uint64_t>(base);
    } while (mag > 0);
    head = sign_text(x < 0, sign);
    if (alt && base != 10) head += std::string("0") + (type == 'b' ? 'b' : type == 'o' ? 'o' : type);
  } else {
    if (!type ? false : !std::strchr("eEfFgG%", type)) unknown();
    const double x = v.as_double();
    body = float_digits(std::fabs(x), type, prec, alt);
    head = sign_text(!std::isnan(x) && std::signbit(x), sign);
  }
  return pad_to(head + body, width, fill, align ? align : '>', head.size());
}

}  // namespace

// printf-style formatting for `"%s" % x` and the format filter (%s %r %d %i %f %F %e %E %g %G %%):
// Python's, widths and %s precisions counted in code points; anything else is an error.
std::string py_format(const std::string& fmt, const std::vector<Value>& args) {
  std::string out;
  size_t ai = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    if (fmt[i] != '%') {
      out += fmt[i];
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '%') {
      out += '%';
      ++i;
      continue;
    }
    // Python's %[flags][width][.precision]conv. Width and precision are bounded (a width of
    // 2^31 - 1 once took 48 s): a clear error past it.
    size_t j = i + 1;
    bool left = false, zero = false, plus = false, space = false, alt = false;
    for (; j < fmt.size() && fmt[j] != 0 && std::strchr("-+ 0#", fmt[j]); ++j) {
      left |= fmt[j] == '-';
      zero |= fmt[j] == '0';
      plus |= fmt[j] == '+';
      space |= fmt[j] == ' ';
      alt |= fmt[j] == '#';
    }
    auto number = [&](const char* what) -> int {
      size_t start = j;
      while (j < fmt.size() && fmt[j] >= '0' && fmt[j] <= '9') ++j;
      if (j - start > 4 || (j > start && std::stoi(fmt.substr(start, j - start)) > kMaxFormatWidth))
        fail("ValueError", std::string("format ") + what + " larger than " + std::to_string(kMaxFormatWidth));
      return j > start ? std::stoi(fmt.substr(start, j - start)) : -1;
    };
    const int width = number("width");
    int prec = -1;
    if (j < fmt.size() && fmt[j] == '.') {
      ++j;
      prec = std::max(number("precision"), 0);  // "%.s": precision 0, as Python
    }
    if (j >= fmt.size()) fail("ValueError", "incomplete format");
    const char conv = fmt[j];
    if (!std::strchr("srdifFeEgG", conv) || conv == 0)
      fail("ValueError", std::string("unsupported format character '") + conv + "'");
    if (ai >= args.size()) fail("TypeError", "not enough arguments for format string");
    const Value& a = args[ai++];
    std::string sign, body;
    if (conv == 's' || conv == 'r') {
      body = conv == 's' ? to_str(a) : to_repr(a);
      if (prec >= 0) body = first_code_points(body, prec);
      out += pad_to(body, width, " ", left ? '<' : '>');
      i = j;
      continue;
    }
    if (!a.is_number()) fail("TypeError", std::string("%") + conv + " format: a real number is required, not " + type_name(a));
    if (conv == 'd' || conv == 'i') {
      const int64_t v = a.is_float() ? float_to_int(a.as_double()) : a.as_int();
      const uint64_t mag = v < 0 ? 0 - static_cast<uint64_t>(v) : static_cast<uint64_t>(v);
      body = std::to_string(mag);
      if (prec > static_cast<int>(body.size())) body.insert(0, static_cast<size_t>(prec) - body.size(), '0');
      sign = sign_text(v < 0, plus ? '+' : space ? ' ' : 0);
    } else {
      const double x = a.as_double();
      body = float_digits(std::fabs(x), conv, prec, alt);
      sign = sign_text(!std::isnan(x) && std::signbit(x), plus ? '+' : space ? ' ' : 0);
    }
    const bool finite = !a.is_float() || std::isfinite(a.as_double());
    out += left ? pad_to(sign + body, width, " ", '<') : zero && finite ? pad_to(sign + body, width, "0", '=', sign.size())
                                                                       : pad_to(sign + body, width, " ", '>');
    i = j;
  }
  if (ai < args.size()) fail("TypeError", "not all arguments converted during string formatting");
  return out;
}

// Python's str.format: {} / {0} / {name} fields, each with an optional !s or !r conversion and a
// format spec (format_field). Attribute and index fields ({0.x}, {0[1]}) are an error here.
std::string py_str_format(Interp& in, const std::string& s, const CallArgs& a) {
  std::string out;
  size_t auto_i = 0;
  bool manual = false, automatic = false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (s[i] == '{' && i + 1 < s.size() && s[i + 1] == '{') {
      out += '{';
      ++i;
    } else if (s[i] == '}') {
      if (i + 1 >= s.size() || s[i + 1] != '}') fail("ValueError", "Single '}' encountered in format string");
      out += '}';
      ++i;
    } else if (s[i] == '{') {
      const size_t e = s.find('}', i);
      if (e == std::string::npos) fail("ValueError", "Single '{' encountered in format string");
      const std::string field = s.substr(i + 1, e - i - 1);
      if (field.find('{') != std::string::npos) fail("ValueError", "nested replacement fields in a format spec are not supported here");
      const size_t colon = field.find(':');
      std::string name = field.substr(0, colon), spec = colon == std::string::npos ? "" : field.substr(colon + 1);
      char conversion = 0;
      if (const size_t bang = name.find('!'); bang != std::string::npos) {
        if (bang + 2 != name.size()) fail("ValueError", "expected ':' after conversion specifier");
        conversion = name[bang + 1];
        if (conversion != 's' && conversion != 'r') fail("ValueError", std::string("Unknown conversion specifier ") + conversion);
        name.resize(bang);
      }
      if (name.find_first_of(".[") != std::string::npos)
        fail("ValueError", "attribute and index fields ('{" + name + "}') are not supported here");
      const Value* v = nullptr;
      if (name.empty() || std::all_of(name.begin(), name.end(), ::isdigit)) {
        (name.empty() ? automatic : manual) = true;
        if (manual && automatic)
          fail("ValueError", name.empty() ? "cannot switch from manual field specification to automatic field numbering"
                                          : "cannot switch from automatic field numbering to manual field specification");
        const size_t idx = name.empty() ? auto_i++ : (name.size() > 9 ? SIZE_MAX - 1 : std::stoul(name));
        v = idx < a.pos.size() ? &a.pos[idx] : nullptr;
        if (v == nullptr) fail("IndexError", "Replacement index " + std::to_string(idx) + " out of range for positional args tuple");
      } else {
        v = a.get(SIZE_MAX, name.c_str());
        if (v == nullptr) fail("KeyError", "'" + name + "'");
      }
      out += conversion ? format_field(Value(conversion == 'r' ? to_repr(*v) : to_str(*v)), spec) : format_field(*v, spec);
      in.check_size(out.size());
      i = e;
    } else {
      out += s[i];
    }
  }
  return out;
}

}  // namespace kv::jinja
