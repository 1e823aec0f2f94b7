// UTF-8 helpers shared by the tokenizers and the incremental detokenizer.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace kv::utf8 {

// What sits at s[i]: a complete valid character (n bytes), a valid but truncated prefix that
// more bytes could complete (only possible when it runs to the end of s), or an ill-formed
// sequence whose maximal subpart is n bytes long (the unit that becomes one U+FFFD, as
// Unicode §3.9 / WHATWG / Python's errors="replace" count it).
enum class Kind { kValid, kIncomplete, kInvalid };
struct Step {
  Kind kind;
  size_t n;
  uint32_t cp;  // the code point when kValid
};
Step next(std::string_view s, size_t i);

// True when the whole of s is well-formed UTF-8 (no overlongs, surrogates or > U+10FFFF).
bool is_valid(std::string_view s);

// Replaces each maximal ill-formed subpart (including a truncated tail) with U+FFFD.
std::string sanitize(std::string_view s);

void append(std::string& out, uint32_t cp);

}  // namespace kv::utf8
