// xgrammar's log, routed through kvserve (xgrammar is built with XGRAMMAR_LOG_CUSTOMIZE=1, and
// xgrammar_log.cpp defines its two hooks). xgrammar reports what it accepts but does not enforce
// (a schema's multipleOf on a number, a pattern's lookahead, minLength beside a pattern) as a
// warning and compiles on without it: a compile inside an XgrammarWarnings scope collects those
// warnings instead of printing them, so the caller can refuse the constraint.
#pragma once

#include <string>
#include <vector>

namespace kv {

class XgrammarWarnings {
 public:
  XgrammarWarnings();   // this thread's warnings are collected from now on ...
  ~XgrammarWarnings();  // ... until this scope ends (scopes nest: the inner one collects)
  XgrammarWarnings(const XgrammarWarnings&) = delete;
  XgrammarWarnings& operator=(const XgrammarWarnings&) = delete;
  const std::vector<std::string>& list() const { return list_; }

 private:
  std::vector<std::string> list_;
  std::vector<std::string>* outer_;
};

}  // namespace kv
