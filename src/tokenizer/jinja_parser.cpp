#include "tokenizer/jinja_parser.h"

#include <cstring>

namespace kv::jinja {
namespace {

// Bound on syntactic nesting so a hostile template ("((((((...") cannot overflow the stack.
constexpr int kMaxParseDepth = 200;

enum class Tok { kData, kVarBegin, kVarEnd, kBlockBegin, kBlockEnd, kName, kString, kInt, kFloat, kOp, kEof };

struct Token {
  Tok type;
  std::string text;  // data text, name, decoded string, number text, operator
  size_t pos;
};

bool ascii_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f'; }

// Length of the Python-whitespace code point at s[i], or 0.
size_t space_at(const std::string& s, size_t i) {
  unsigned char c = static_cast<unsigned char>(s[i]);
  if (c < 0x80) return (ascii_space(static_cast<char>(c)) || (c >= 0x1c && c <= 0x1f)) ? 1 : 0;
  size_t n = (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 1;
  if (i + n > s.size()) return 0;
  uint32_t cp = c & (0x7f >> n);
  for (size_t k = 1; k < n; ++k) cp = (cp << 6) | (static_cast<unsigned char>(s[i + k]) & 0x3f);
  return is_py_space(cp) ? n : 0;
}
size_t skip_spaces(const std::string& s, size_t i) {
  while (i < s.size()) {
    size_t n = space_at(s, i);
    if (n == 0) break;
    i += n;
  }
  return i;
}
bool all_spaces(const std::string& s, size_t from) { return skip_spaces(s, from) == s.size(); }

std::string rstrip_spaces(const std::string& s) { return py_strip(s, false, true); }

bool starts(const std::string& s, size_t i, const char* lit) { return s.compare(i, std::strlen(lit), lit) == 0; }

[[noreturn]] void syntax_error(const std::string& src, size_t pos, const std::string& msg) {
  fail("TemplateSyntaxError", msg + " at " + describe_pos(src, pos));
}

// Decodes a Python string literal body (escapes as unicode-escape does).
std::string unescape(const std::string& src, size_t pos, const std::string& body) {
  std::string out;
  auto put_cp = [&out](uint32_t cp) {
    if (cp < 0x80) {
      out += static_cast<char>(cp);
    } else if (cp < 0x800) {
      out += static_cast<char>(0xc0 | (cp >> 6));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += static_cast<char>(0xe0 | (cp >> 12));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    } else {
      out += static_cast<char>(0xf0 | (cp >> 18));
      out += static_cast<char>(0x80 | ((cp >> 12) & 0x3f));
      out += static_cast<char>(0x80 | ((cp >> 6) & 0x3f));
      out += static_cast<char>(0x80 | (cp & 0x3f));
    }
  };
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out += c;
      continue;
    }
    char e = body[++i];
    auto hex = [&](size_t n) {
      uint32_t cp = 0;
      for (size_t k = 1; k <= n; ++k) {
        if (i + k >= body.size()) syntax_error(src, pos, "truncated \\x/\\u escape in string");
        char h = body[i + k];
        int d = (h >= '0' && h <= '9') ? h - '0' : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                : (h >= 'A' && h <= 'F') ? h - 'A' + 10 : -1;
        if (d < 0) syntax_error(src, pos, "bad \\x/\\u escape in string");
        cp = cp * 16 + static_cast<uint32_t>(d);
      }
      i += n;
      if (cp > 0x10ffff) syntax_error(src, pos, "escape out of range in string");
      put_cp(cp);
    };
    switch (e) {
      case 'n': out += '\n'; break;
      case 't': out += '\t'; break;
      case 'r': out += '\r'; break;
      case '\\': out += '\\'; break;
      case '\'': out += '\''; break;
      case '"': out += '"'; break;
      case 'a': out += '\a'; break;
      case 'b': out += '\b'; break;
      case 'f': out += '\f'; break;
      case 'v': out += '\v'; break;
      case '\n': break;  // line continuation
      case 'x': hex(2); break;
      case 'u': hex(4); break;
      case 'U': hex(8); break;
      default:
        if (e >= '0' && e <= '7') {
          uint32_t cp = static_cast<uint32_t>(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7'; ++k)
            cp = cp * 8 + static_cast<uint32_t>(body[++i] - '0');
          put_cp(cp);
        } else {
          out += '\\';
          out += e;
        }
    }
  }
  return out;
}

class Lexer {
 public:
  explicit Lexer(const std::string& src) : s_(src) {}

  std::vector<Token> run() {
    size_t pos = 0;
    bool line_starting = true;
    while (pos < s_.size()) {
      size_t t = find_tag(pos);
      if (t == std::string::npos) {
        emit(Tok::kData, s_.substr(pos), pos);
        break;
      }
      char kind = s_[t + 1];
      char sign = (t + 2 < s_.size() && (s_[t + 2] == '-' || s_[t + 2] == '+')) ? s_[t + 2] : 0;
      std::string text = s_.substr(pos, t - pos);
      size_t raw_end = kind == '%' ? match_raw_begin(t) : 0;
      lstrip(text, sign, kind != '{', line_starting);
      if (!text.empty()) emit(Tok::kData, text, pos);
      size_t p = t + 2 + (sign ? 1 : 0);
      if (raw_end) {
        pos = lex_raw(raw_end);
      } else if (kind == '#') {
        pos = lex_comment(t, p);
      } else {
        pos = lex_tag(t, p, kind == '%');
      }
      line_starting = pos > 0 && s_[pos - 1] == '\n';
    }
    toks_.push_back({Tok::kEof, "", s_.size()});
    return std::move(toks_);
  }

 private:
  void emit(Tok t, std::string text, size_t pos) { toks_.push_back({t, std::move(text), pos}); }

  size_t find_tag(size_t from) const {
    for (size_t i = s_.find('{', from); i != std::string::npos; i = s_.find('{', i + 1)) {
      if (i + 1 < s_.size() && (s_[i + 1] == '{' || s_[i + 1] == '%' || s_[i + 1] == '#')) return i;
    }
    return std::string::npos;
  }

  // `text` precedes a tag whose whitespace sign is `sign`: apply `-` and lstrip_blocks.
  static void lstrip(std::string& text, char sign, bool block_or_comment, bool line_starting) {
    if (sign == '-') {
      text = rstrip_spaces(text);
    } else if (sign != '+' && block_or_comment) {
      size_t nl = text.rfind('\n');
      size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() && all_spaces(text, l_pos)) text.resize(l_pos);
    }
  }

  // If a `{% raw %}` tag starts at t, the offset just past it; else 0.
  size_t match_raw_begin(size_t t) const {
    size_t i = t + 2;
    if (i < s_.size() && (s_[i] == '-' || s_[i] == '+')) ++i;
    i = skip_spaces(s_, i);
    if (!starts(s_, i, "raw")) return 0;
    i = skip_spaces(s_, i + 3);
    if (starts(s_, i, "-%}")) return skip_spaces(s_, i + 3);
    if (starts(s_, i, "%}")) return i + 2;
    return 0;
  }

  // Block-end forms: `+%}`, `-%}` + whitespace, `%}` + one optional newline (trim_blocks). 0 if none at i.
  size_t match_block_end(size_t i) const {
    if (starts(s_, i, "+%}")) return i + 3;
    if (starts(s_, i, "-%}")) return skip_spaces(s_, i + 3);
    if (starts(s_, i, "%}")) return i + 2 + ((i + 2 < s_.size() && s_[i + 2] == '\n') ? 1 : 0);
    return 0;
  }

  size_t lex_raw(size_t from) {
    for (size_t i = s_.find("{%", from); i != std::string::npos; i = s_.find("{%", i + 1)) {
      size_t j = i + 2;
      char sign = (j < s_.size() && (s_[j] == '-' || s_[j] == '+')) ? s_[j] : 0;
      if (sign) ++j;
      j = skip_spaces(s_, j);
      if (!starts(s_, j, "endraw")) continue;
      size_t end = match_block_end(skip_spaces(s_, j + 6));
      if (!end) continue;
      std::string text = s_.substr(from, i - from);
      lstrip(text, sign, true, from > 0 && s_[from - 1] == '\n');
      if (!text.empty()) emit(Tok::kData, text, from);
      return end;
    }
    syntax_error(s_, from, "Missing end of raw directive");
  }

  size_t lex_comment(size_t t, size_t p) {
    for (size_t i = p; i < s_.size(); ++i) {
      if (starts(s_, i, "+#}")) return i + 3;
      if (starts(s_, i, "-#}")) return skip_spaces(s_, i + 3);
      if (starts(s_, i, "#}")) return i + 2 + ((i + 2 < s_.size() && s_[i + 2] == '\n') ? 1 : 0);
    }
    syntax_error(s_, t, "Missing end of comment tag");
  }

  size_t lex_tag(size_t t, size_t p, bool block) {
    emit(block ? Tok::kBlockBegin : Tok::kVarBegin, "", t);
    std::vector<char> balance;
    size_t i = p;
    while (true) {
      i = skip_spaces(s_, i);
      if (i >= s_.size()) syntax_error(s_, t, block ? "unexpected end of template, expected '%}'"
                                                    : "unexpected end of template, expected '}}'");
      if (balance.empty()) {
        if (block) {
          if (size_t e = match_block_end(i)) {
            emit(Tok::kBlockEnd, "", i);
            return e;
          }
        } else {
          if (starts(s_, i, "-}}")) {
            emit(Tok::kVarEnd, "", i);
            return skip_spaces(s_, i + 3);
          }
          if (starts(s_, i, "}}")) {
            emit(Tok::kVarEnd, "", i);
            return i + 2;
          }
        }
      }
      i = lex_one(i, balance);
    }
  }

  size_t lex_one(size_t i, std::vector<char>& balance) {
    char c = s_[i];
    if (std::isdigit(static_cast<unsigned char>(c))) return lex_number(i);
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      size_t j = i;
      while (j < s_.size() && (std::isalnum(static_cast<unsigned char>(s_[j])) || s_[j] == '_')) ++j;
      emit(Tok::kName, s_.substr(i, j - i), i);
      return j;
    }
    if (c == '\'' || c == '"') {
      size_t j = i + 1;
      while (j < s_.size() && s_[j] != c) j += (s_[j] == '\\') ? 2 : 1;
      if (j >= s_.size()) syntax_error(s_, i, "unterminated string");
      emit(Tok::kString, unescape(s_, i, s_.substr(i + 1, j - i - 1)), i);
      return j + 1;
    }
    static const char* kOps2[] = {"//", "**", "==", "!=", "<=", ">="};
    for (const char* op : kOps2)
      if (starts(s_, i, op)) {
        emit(Tok::kOp, op, i);
        return i + 2;
      }
    if (std::strchr("+-/*%~[](){}<>=.:|,;", c) == nullptr || c == 0)
      syntax_error(s_, i, std::string("unexpected char '") + c + "'");
    if (c == '(' || c == '[' || c == '{') {
      balance.push_back(c == '(' ? ')' : c == '[' ? ']' : '}');
      if (balance.size() > kMaxParseDepth) syntax_error(s_, i, "brackets nested too deeply");
    } else if (c == ')' || c == ']' || c == '}') {
      if (balance.empty()) syntax_error(s_, i, std::string("unexpected '") + c + "'");
      if (balance.back() != c)
        syntax_error(s_, i, std::string("unexpected '") + c + "', expected '" + balance.back() + "'");
      balance.pop_back();
    }
    emit(Tok::kOp, std::string(1, c), i);
    return i + 1;
  }

  size_t lex_number(size_t i) {
    auto digits = [&](size_t j) {
      while (j < s_.size() && (std::isdigit(static_cast<unsigned char>(s_[j])) || s_[j] == '_')) ++j;
      return j;
    };
    if (s_[i] == '0' && i + 1 < s_.size() && std::strchr("xXoObB", s_[i + 1]) && s_[i + 1] != 0) {
      int base = (s_[i + 1] == 'x' || s_[i + 1] == 'X') ? 16 : (s_[i + 1] == 'o' || s_[i + 1] == 'O') ? 8 : 2;
      size_t j = i + 2;
      while (j < s_.size() && (std::isxdigit(static_cast<unsigned char>(s_[j])) || s_[j] == '_')) ++j;
      std::string d;
      for (size_t k = i + 2; k < j; ++k)
        if (s_[k] != '_') d += s_[k];
      if (d.empty()) syntax_error(s_, i, "bad number");
      try {
        emit(Tok::kInt, std::to_string(std::stoll(d, nullptr, base)), i);
      } catch (...) {
        syntax_error(s_, i, "integer literal out of range");
      }
      return j;
    }
    size_t j = digits(i);
    bool is_float = false;
    if (j + 1 < s_.size() && s_[j] == '.' && std::isdigit(static_cast<unsigned char>(s_[j + 1]))) {
      j = digits(j + 1);
      is_float = true;
    }
    if (j < s_.size() && (s_[j] == 'e' || s_[j] == 'E')) {
      size_t k = j + 1;
      if (k < s_.size() && (s_[k] == '+' || s_[k] == '-')) ++k;
      if (k < s_.size() && std::isdigit(static_cast<unsigned char>(s_[k]))) {
        j = digits(k);
        is_float = true;
      }
    }
    std::string text;
    for (size_t k = i; k < j; ++k)
      if (s_[k] != '_') text += s_[k];
    emit(is_float ? Tok::kFloat : Tok::kInt, text, i);
    return j;
  }

  const std::string& s_;
  std::vector<Token> toks_;
};

class Parser {
 public:
  Parser(const std::string& src, std::vector<Token> toks) : s_(src), t_(std::move(toks)) {}

  Body parse_all() {
    Body body = subparse({});
    if (cur().type != Tok::kEof) error("unexpected token");
    return body;
  }

 private:
  struct DepthGuard {
    explicit DepthGuard(Parser& p) : p_(p) {
      if (++p_.depth_ > kMaxParseDepth) p_.error("template nested too deeply");
    }
    ~DepthGuard() { --p_.depth_; }
    Parser& p_;
  };

  const Token& cur() const { return t_[i_]; }
  const Token& peek(size_t k = 1) const { return t_[std::min(i_ + k, t_.size() - 1)]; }
  void advance() {
    if (i_ + 1 < t_.size()) ++i_;
  }
  bool is_op(const char* op) const { return cur().type == Tok::kOp && cur().text == op; }
  bool is_name(const char* n) const { return cur().type == Tok::kName && cur().text == n; }
  [[noreturn]] void error(const std::string& msg) const {
    std::string what = msg;
    const Token& tk = cur();
    switch (tk.type) {
      case Tok::kEof: what += " (end of template)"; break;
      case Tok::kBlockEnd: what += " ('%}')"; break;
      case Tok::kVarEnd: what += " ('}}')"; break;
      case Tok::kName:
      case Tok::kOp:
      case Tok::kInt:
      case Tok::kFloat: what += " ('" + tk.text + "')"; break;
      case Tok::kString: what += " (string)"; break;
      default: break;
    }
    syntax_error(s_, tk.pos, what);
  }
  void expect_op(const char* op) {
    if (!is_op(op)) error(std::string("expected '") + op + "'");
    advance();
  }
  std::string expect_name() {
    if (cur().type != Tok::kName) error("expected a name");
    std::string n = cur().text;
    advance();
    return n;
  }
  void expect_block_end() {
    if (cur().type != Tok::kBlockEnd) error("expected end of statement block");
    advance();
  }
  NodePtr node(NodeKind k, size_t pos) {
    auto n = std::make_unique<Node>();
    n->kind = k;
    n->pos = pos;
    return n;
  }

  // Parses until a `{% name %}` block whose name is in `ends` (left unconsumed, pointing at the name).
  Body subparse(const std::vector<std::string>& ends) {
    DepthGuard g(*this);
    Body body;
    while (cur().type != Tok::kEof) {
      if (cur().type == Tok::kData) {
        auto n = node(NodeKind::kText, cur().pos);
        n->name = cur().text;
        body.push_back(std::move(n));
        advance();
      } else if (cur().type == Tok::kVarBegin) {
        advance();
        auto n = node(NodeKind::kOutput, cur().pos);
        n->a = parse_tuple(true);
        if (cur().type != Tok::kVarEnd) error("expected end of print statement '}}'");
        advance();
        body.push_back(std::move(n));
      } else if (cur().type == Tok::kBlockBegin) {
        advance();
        if (cur().type == Tok::kName)
          for (const auto& e : ends)
            if (cur().text == e) return body;
        body.push_back(parse_statement());
      } else {
        error("unexpected token");
      }
    }
    if (!ends.empty()) {
      std::string want;
      for (const auto& e : ends) want += (want.empty() ? "'" : " or '") + e + "'";
      error("unexpected end of template, expected " + want);
    }
    return body;
  }

  NodePtr parse_statement() {
    if (cur().type != Tok::kName) error("tag name expected");
    const std::string tag = cur().text;
    size_t pos = cur().pos;
    if (tag == "for") return parse_for();
    if (tag == "if") return parse_if();
    if (tag == "set") return parse_set();
    if (tag == "macro") return parse_macro();
    if (tag == "filter") return parse_filter_block();
    if (tag == "with") return parse_with();
    if (tag == "break" || tag == "continue") {
      advance();
      expect_block_end();
      return node(tag == "break" ? NodeKind::kBreak : NodeKind::kContinue, pos);
    }
    if (tag == "generation") {  // HF's assistant-mask extension: renders its body unchanged
      advance();
      expect_block_end();
      auto n = node(NodeKind::kScope, pos);
      n->body = subparse({"endgeneration"});
      advance();
      expect_block_end();
      return n;
    }
    error("unknown or unsupported tag '" + tag + "'");
  }

  NodePtr parse_for() {
    auto n = node(NodeKind::kFor, cur().pos);
    advance();
    do {
      n->ops.push_back(expect_name());
      if (!is_op(",")) break;
      advance();
    } while (cur().type == Tok::kName && !is_name("in"));
    if (!is_name("in")) error("expected 'in'");
    advance();
    n->a = parse_tuple(false);
    if (is_name("if")) {
      advance();
      n->c = parse_expression(true);
      n->flag = true;
    }
    if (is_name("recursive")) error("recursive loops are not supported");
    expect_block_end();
    n->body = subparse({"endfor", "else"});
    if (cur().text == "else") {
      advance();
      expect_block_end();
      n->else_body = subparse({"endfor"});
    }
    advance();
    expect_block_end();
    return n;
  }

  NodePtr parse_if() {
    auto n = node(NodeKind::kIf, cur().pos);
    advance();
    while (true) {
      NodePtr cond = parse_tuple(false);
      expect_block_end();
      Body body = subparse({"elif", "else", "endif"});
      n->branches.emplace_back(std::move(cond), std::move(body));
      if (cur().text == "elif") {
        advance();
        continue;
      }
      if (cur().text == "else") {
        advance();
        expect_block_end();
        n->else_body = subparse({"endif"});
      }
      advance();
      expect_block_end();
      return n;
    }
  }

  NodePtr parse_set() {
    size_t pos = cur().pos;
    advance();
    std::vector<std::string> names;
    std::string attr;
    names.push_back(expect_name());
    if (is_op(".")) {
      advance();
      attr = expect_name();
    } else {
      while (is_op(",")) {
        advance();
        names.push_back(expect_name());
      }
    }
    if (is_op("=")) {
      advance();
      auto n = node(NodeKind::kSet, pos);
      n->ops = std::move(names);
      n->name = attr;
      n->flag = !attr.empty();
      n->a = parse_tuple(true);
      expect_block_end();
      return n;
    }
    if (!attr.empty() || names.size() != 1) error("expected '='");
    auto n = node(NodeKind::kSetBlock, pos);
    n->ops = std::move(names);
    if (is_op("|")) n->a = parse_filter_chain(nullptr);
    expect_block_end();
    n->body = subparse({"endset"});
    advance();
    expect_block_end();
    return n;
  }

  NodePtr parse_macro() {
    auto n = node(NodeKind::kMacro, cur().pos);
    advance();
    n->name = expect_name();
    expect_op("(");
    while (!is_op(")")) {
      if (!n->ops.empty()) expect_op(",");
      if (is_op(")")) break;
      std::string p = expect_name();
      n->ops.push_back(p);
      if (is_op("=")) {
        advance();
        n->args.kw.emplace_back(p, parse_expression(true));
      }
    }
    advance();
    expect_block_end();
    n->body = subparse({"endmacro"});
    advance();
    expect_block_end();
    return n;
  }

  NodePtr parse_filter_block() {
    auto n = node(NodeKind::kFilterBlock, cur().pos);
    advance();
    n->a = parse_filter_chain(nullptr, /*leading_pipe=*/false);
    expect_block_end();
    n->body = subparse({"endfilter"});
    advance();
    expect_block_end();
    return n;
  }

  NodePtr parse_with() {
    auto n = node(NodeKind::kWith, cur().pos);
    advance();
    while (cur().type != Tok::kBlockEnd) {
      if (!n->ops.empty()) expect_op(",");
      n->ops.push_back(expect_name());
      expect_op("=");
      n->items.push_back(parse_expression(true));
    }
    expect_block_end();
    n->body = subparse({"endwith"});
    advance();
    expect_block_end();
    return n;
  }

  // ---- expressions (jinja2's grammar) ----

  NodePtr parse_tuple(bool with_condexpr) {
    size_t pos = cur().pos;
    NodePtr first = parse_expression(with_condexpr);
    if (!is_op(",")) return first;
    auto t = node(NodeKind::kTuple, pos);
    t->items.push_back(std::move(first));
    while (is_op(",")) {
      advance();
      if (cur().type == Tok::kBlockEnd || cur().type == Tok::kVarEnd || is_op(")") || is_op("=") ||
          is_name("if") || is_name("in"))
        break;
      t->items.push_back(parse_expression(with_condexpr));
    }
    return t;
  }

  NodePtr parse_expression(bool with_condexpr) {
    DepthGuard g(*this);
    return with_condexpr ? parse_condexpr() : parse_or();
  }

  NodePtr parse_condexpr() {
    size_t pos = cur().pos;
    NodePtr e1 = parse_or();
    while (is_name("if")) {
      advance();
      auto c = node(NodeKind::kCond, pos);
      c->a = parse_or();  // test
      c->b = std::move(e1);
      if (is_name("else")) {
        advance();
        c->c = parse_condexpr();
      }
      e1 = std::move(c);
    }
    return e1;
  }

  NodePtr binary(NodeKind k, std::string op, NodePtr l, NodePtr r, size_t pos) {
    auto n = node(k, pos);
    n->name = std::move(op);
    n->a = std::move(l);
    n->b = std::move(r);
    return n;
  }

  NodePtr parse_or() {
    size_t pos = cur().pos;
    NodePtr l = parse_and();
    while (is_name("or")) {
      advance();
      l = binary(NodeKind::kOr, "or", std::move(l), parse_and(), pos);
    }
    return l;
  }
  NodePtr parse_and() {
    size_t pos = cur().pos;
    NodePtr l = parse_not();
    while (is_name("and")) {
      advance();
      l = binary(NodeKind::kAnd, "and", std::move(l), parse_not(), pos);
    }
    return l;
  }
  NodePtr parse_not() {
    DepthGuard g(*this);
    if (is_name("not")) {
      auto n = node(NodeKind::kNot, cur().pos);
      advance();
      n->a = parse_not();
      return n;
    }
    return parse_compare();
  }
  NodePtr parse_compare() {
    size_t pos = cur().pos;
    NodePtr first = parse_math1();
    NodePtr cmp;
    while (true) {
      std::string op;
      if (cur().type == Tok::kOp && (cur().text == "==" || cur().text == "!=" || cur().text == "<" ||
                                     cur().text == ">" || cur().text == "<=" || cur().text == ">=")) {
        op = cur().text;
        advance();
      } else if (is_name("in")) {
        op = "in";
        advance();
      } else if (is_name("not") && peek().type == Tok::kName && peek().text == "in") {
        op = "notin";
        advance();
        advance();
      } else {
        break;
      }
      if (!cmp) {
        cmp = node(NodeKind::kCompare, pos);
        cmp->items.push_back(std::move(first));
      }
      cmp->ops.push_back(op);
      cmp->items.push_back(parse_math1());
    }
    return cmp ? std::move(cmp) : std::move(first);
  }
  NodePtr parse_math1() {
    size_t pos = cur().pos;
    NodePtr l = parse_concat();
    while (is_op("+") || is_op("-")) {
      std::string op = cur().text;
      advance();
      l = binary(NodeKind::kBinary, op, std::move(l), parse_concat(), pos);
    }
    return l;
  }
  NodePtr parse_concat() {
    size_t pos = cur().pos;
    NodePtr l = parse_math2();
    while (is_op("~")) {
      advance();
      l = binary(NodeKind::kBinary, "~", std::move(l), parse_math2(), pos);
    }
    return l;
  }
  NodePtr parse_math2() {
    size_t pos = cur().pos;
    NodePtr l = parse_pow();
    while (is_op("*") || is_op("/") || is_op("//") || is_op("%")) {
      std::string op = cur().text;
      advance();
      l = binary(NodeKind::kBinary, op, std::move(l), parse_pow(), pos);
    }
    return l;
  }
  NodePtr parse_pow() {
    size_t pos = cur().pos;
    NodePtr l = parse_unary(true);
    while (is_op("**")) {
      advance();
      l = binary(NodeKind::kBinary, "**", std::move(l), parse_unary(true), pos);
    }
    return l;
  }
  NodePtr parse_unary(bool with_filter) {
    DepthGuard g(*this);
    size_t pos = cur().pos;
    NodePtr n;
    if (is_op("-") || is_op("+")) {
      n = node(is_op("-") ? NodeKind::kNeg : NodeKind::kPos, pos);
      advance();
      n->a = parse_unary(false);
    } else {
      n = parse_primary();
    }
    n = parse_postfix(std::move(n));
    if (with_filter) n = parse_filter_expr(std::move(n));
    return n;
  }

  NodePtr parse_primary() {
    const Token& tk = cur();
    size_t pos = tk.pos;
    auto konst = [&](Value v) {
      auto n = node(NodeKind::kConst, pos);
      n->value = std::move(v);
      return n;
    };
    switch (tk.type) {
      case Tok::kName: {
        std::string name = tk.text;
        advance();
        if (name == "true" || name == "True") return konst(Value(true));
        if (name == "false" || name == "False") return konst(Value(false));
        if (name == "none" || name == "None") return konst(Value::none());
        auto n = node(NodeKind::kName, pos);
        n->name = name;
        return n;
      }
      case Tok::kString: {
        std::string s;
        while (cur().type == Tok::kString) {
          s += cur().text;
          advance();
        }
        return konst(Value(std::move(s)));
      }
      case Tok::kInt: {
        std::string text = tk.text;
        advance();
        try {
          return konst(Value(static_cast<int64_t>(std::stoll(text))));
        } catch (...) {
          syntax_error(s_, pos, "integer literal out of range");
        }
      }
      case Tok::kFloat: {
        std::string text = tk.text;
        advance();
        return konst(Value(std::strtod(text.c_str(), nullptr)));
      }
      case Tok::kOp:
        if (tk.text == "(") {
          advance();
          if (is_op(")")) {
            advance();
            auto t = node(NodeKind::kTuple, pos);
            return t;
          }
          NodePtr e = parse_tuple(true);
          if (e->kind == NodeKind::kTuple && is_op(")")) {
            advance();
            return e;
          }
          expect_op(")");
          return e;
        }
        if (tk.text == "[") {
          advance();
          auto n = node(NodeKind::kList, pos);
          while (!is_op("]")) {
            if (!n->items.empty()) expect_op(",");
            if (is_op("]")) break;
            n->items.push_back(parse_expression(true));
          }
          advance();
          return n;
        }
        if (tk.text == "{") {
          advance();
          auto n = node(NodeKind::kDict, pos);
          while (!is_op("}")) {
            if (!n->items.empty()) expect_op(",");
            if (is_op("}")) break;
            n->items.push_back(parse_expression(true));
            expect_op(":");
            n->items.push_back(parse_expression(true));
          }
          advance();
          return n;
        }
        break;
      default: break;
    }
    error("unexpected token");
  }

  NodePtr parse_postfix(NodePtr n) {
    while (true) {
      if (is_op(".") || is_op("[")) {
        n = parse_subscript(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  NodePtr parse_filter_expr(NodePtr n) {
    while (true) {
      if (is_op("|")) {
        n = parse_filter_chain(std::move(n));
      } else if (is_name("is")) {
        n = parse_test(std::move(n));
      } else if (is_op("(")) {
        n = parse_call(std::move(n));
      } else {
        return n;
      }
    }
  }

  NodePtr parse_subscript(NodePtr obj) {
    size_t pos = cur().pos;
    if (is_op(".")) {
      advance();
      if (cur().type == Tok::kName) {
        auto n = node(NodeKind::kGetAttr, pos);
        n->a = std::move(obj);
        n->name = cur().text;
        advance();
        return n;
      }
      if (cur().type == Tok::kInt) {
        auto n = node(NodeKind::kGetItem, pos);
        n->a = std::move(obj);
        n->b = node(NodeKind::kConst, cur().pos);
        n->b->value = Value(static_cast<int64_t>(std::stoll(cur().text)));
        advance();
        return n;
      }
      error("expected name or number after '.'");
    }
    advance();  // [
    std::vector<NodePtr> parts;
    NodePtr result;
    auto parse_one = [&]() -> NodePtr {
      size_t p = cur().pos;
      NodePtr start, stop, step;
      if (!is_op(":")) {
        start = parse_expression(true);
        if (!is_op(":")) return start;
      }
      auto sl = node(NodeKind::kSlice, p);
      advance();  // first ':'
      if (!is_op("]") && !is_op(",") && !is_op(":")) stop = parse_expression(true);
      if (is_op(":")) {
        advance();
        if (!is_op("]") && !is_op(",")) step = parse_expression(true);
      }
      sl->b = std::move(start);
      sl->c = std::move(stop);
      sl->d = std::move(step);
      return sl;
    };
    parts.push_back(parse_one());
    while (is_op(",")) {
      advance();
      if (is_op("]")) break;
      parts.push_back(parse_one());
    }
    expect_op("]");
    if (parts.size() == 1 && parts[0]->kind == NodeKind::kSlice) {
      parts[0]->a = std::move(obj);
      return std::move(parts[0]);
    }
    // A slice only stands alone (x[1:2]): inside a tuple (x[1, 2:]) it would be a Python slice
    // object, which no value here takes as a key, and its node has no object to slice.
    if (parts.size() > 1)
      for (const NodePtr& p : parts)
        if (p->kind == NodeKind::kSlice) syntax_error(s_, p->pos, "a slice inside a tuple subscript is not supported");
    auto n = node(NodeKind::kGetItem, pos);
    n->a = std::move(obj);
    if (parts.size() == 1) {
      n->b = std::move(parts[0]);
    } else {
      n->b = node(NodeKind::kTuple, pos);
      n->b->items = std::move(parts);
    }
    return n;
  }

  void parse_args(Args& args) {
    expect_op("(");
    bool first = true;
    while (!is_op(")")) {
      if (!first) expect_op(",");
      first = false;
      if (is_op(")")) break;
      if (is_op("*") || is_op("**")) error("*args and **kwargs are not supported");
      if (cur().type == Tok::kName && peek().type == Tok::kOp && peek().text == "=") {
        std::string k = cur().text;
        advance();
        advance();
        args.kw.emplace_back(k, parse_expression(true));
      } else {
        if (!args.kw.empty()) error("positional argument after keyword argument");
        args.pos.push_back(parse_expression(true));
      }
    }
    advance();
  }

  NodePtr parse_call(NodePtr callee) {
    auto n = node(NodeKind::kCall, cur().pos);
    n->a = std::move(callee);
    parse_args(n->args);
    return n;
  }

  std::string dotted_name() {
    std::string name = expect_name();
    while (is_op(".")) {
      advance();
      name += "." + expect_name();
    }
    return name;
  }

  // `| f(args) | g ...` applied to `n` (n null: a filter block / set block, input supplied at run time).
  NodePtr parse_filter_chain(NodePtr n, bool leading_pipe = true) {
    bool first = true;
    while (is_op("|") || (first && !leading_pipe)) {
      if (is_op("|")) advance();
      first = false;
      auto f = node(NodeKind::kFilter, cur().pos);
      f->name = dotted_name();
      if (is_op("(")) parse_args(f->args);
      f->a = std::move(n);
      n = std::move(f);
    }
    return n;
  }

  NodePtr parse_test(NodePtr n) {
    auto t = node(NodeKind::kTest, cur().pos);
    advance();  // is
    if (is_name("not")) {
      advance();
      t->flag = true;
    }
    t->name = dotted_name();
    t->a = std::move(n);
    const Token& tk = cur();
    if (is_op("(")) {
      parse_args(t->args);
    } else if ((tk.type == Tok::kName || tk.type == Tok::kString || tk.type == Tok::kInt ||
                tk.type == Tok::kFloat || is_op("(") || is_op("[") || is_op("{")) &&
               !is_name("else") && !is_name("or") && !is_name("and")) {
      if (is_name("is")) error("You cannot chain multiple tests with is");
      t->args.pos.push_back(parse_postfix(parse_primary()));
    }
    return t;
  }

  const std::string& s_;
  std::vector<Token> t_;
  size_t i_ = 0;
  int depth_ = 0;
};

}  // namespace

std::string describe_pos(const std::string& source, size_t pos) {
  size_t line = 1, col = 1;
  for (size_t i = 0; i < pos && i < source.size(); ++i) {
    if (source[i] == '\n') {
      ++line;
      col = 1;
    } else if ((static_cast<unsigned char>(source[i]) & 0xc0) != 0x80) {
      ++col;
    }
  }
  return "line " + std::to_string(line) + ", column " + std::to_string(col);
}

std::unique_ptr<Template> parse_template(const std::string& source) {
  auto t = std::make_unique<Template>();
  // Normalise newlines and drop one trailing newline, as jinja2's lexer does.
  std::string& s = t->source;
  s.reserve(source.size());
  for (size_t i = 0; i < source.size(); ++i) {
    if (source[i] == '\r') {
      s += '\n';
      if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
    } else {
      s += source[i];
    }
  }
  if (!s.empty() && s.back() == '\n') s.pop_back();
  Parser p(s, Lexer(s).run());
  t->body = p.parse_all();
  return t;
}

}  // namespace kv::jinja
