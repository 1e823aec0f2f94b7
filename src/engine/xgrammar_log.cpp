#include "engine/xgrammar_log.h"

#include <cstdio>

// xgrammar's own header (its source tree's cpp/, added for this file alone by CMakeLists.txt),
// with the customization its sources are built with.
#define XGRAMMAR_LOG_CUSTOMIZE 1
#include "support/logging.h"

namespace kv {
namespace {
thread_local std::vector<std::string>* t_warnings = nullptr;
}  // namespace

XgrammarWarnings::XgrammarWarnings() : outer_(t_warnings) { t_warnings = &list_; }
XgrammarWarnings::~XgrammarWarnings() { t_warnings = outer_; }

}  // namespace kv

namespace xgrammar {

// As xgrammar's default: the error it throws (its JSON parser catches this type).
[[noreturn]] void LogFatalImpl(const std::string& file, int lineno, const std::string& message) {
  throw LogFatalError(file, lineno, message);
}

void LogMessageImpl(const std::string& file, int lineno, int level, const std::string& message) {
  if (level == XGRAMMAR_LOG_LEVEL_WARNING && kv::t_warnings) {
    kv::t_warnings->push_back(message);
    return;
  }
  if (level < XGRAMMAR_LOG_LEVEL_WARNING) return;  // info and debug: xgrammar's default prints them; nobody reads them here
  std::fprintf(stderr, "xgrammar: %s (%s:%d)\n", message.c_str(), file.c_str(), lineno);
}

}  // namespace xgrammar
