// Lexer and parser for the Jinja subset of chat templates. The lexer follows jinja2's own rules for the
// environment HF uses (trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=False): newlines are
// normalised to "\n", one trailing newline is dropped, `{%-`/`-%}` strip whitespace, `{%+`/`+%}` keep it,
// a block or comment tag alone on its line takes its indentation and its newline with it.
// The parser follows jinja2's grammar and operator precedence (including left-associative `**`).
#pragma once
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "tokenizer/jinja_value.h"

namespace kv::jinja {

enum class NodeKind {
  // expressions
  kConst, kName, kGetAttr, kGetItem, kSlice, kCall, kFilter, kTest, kNot, kNeg, kPos, kBinary, kAnd, kOr,
  kCompare, kCond, kList, kTuple, kDict,
  // statements
  kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue, kFilterBlock, kWith, kScope
};

struct Node;
using NodePtr = std::unique_ptr<Node>;
using Body = std::vector<NodePtr>;

struct Args {
  std::vector<NodePtr> pos;
  std::vector<std::pair<std::string, NodePtr>> kw;
};

struct Node {
  NodeKind kind;
  size_t pos = 0;  // byte offset in the normalised source, for error messages
  Value value;     // kConst; kText holds its text in `name`
  std::string name;  // name / attribute / filter / test / operator / macro / text
  NodePtr a, b, c, d;                // operands (see parser for each kind)
  std::vector<NodePtr> items;        // list/tuple items, dict keys and values interleaved, compare operands
  std::vector<std::string> ops;      // compare operators; for/set target names; macro parameter names
  Args args;                         // call/filter/test arguments; macro parameter defaults (kw)
  std::vector<std::pair<NodePtr, Body>> branches;  // if/elif
  Body body, else_body;
  bool flag = false;                 // kTest: negated; kSet: namespace attribute; kFor: has filter (in c)
};

struct Template {
  std::string source;  // normalised source, for line/column of errors
  Body body;
};

// Parses `source`; throws Error("TemplateSyntaxError", "... at line L, column C") on a syntax error.
std::unique_ptr<Template> parse_template(const std::string& source);

// "line L, column C" for a byte offset of `source` (column counts code points, from 1).
std::string describe_pos(const std::string& source, size_t pos);

}  // namespace kv::jinja
