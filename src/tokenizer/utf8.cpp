#include "tokenizer/utf8.h"

namespace kv::utf8 {

Step next(std::string_view s, size_t i) {
  const auto b = [&](size_t k) { return static_cast<uint8_t>(s[k]); };
  const uint8_t c = b(i);
  if (c < 0x80) return {Kind::kValid, 1, c};
  size_t len;
  uint32_t cp;
  uint8_t lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    len = 2, cp = c & 0x1F;
  } else if (c >= 0xE0 && c <= 0xEF) {
    len = 3, cp = c & 0x0F;
    if (c == 0xE0) lo = 0xA0;        // no overlongs
    if (c == 0xED) hi = 0x9F;        // no surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    len = 4, cp = c & 0x07;
    if (c == 0xF0) lo = 0x90;        // no overlongs
    if (c == 0xF4) hi = 0x8F;        // <= U+10FFFF
  } else {
    return {Kind::kInvalid, 1, 0};
  }
  for (size_t k = 1; k < len; ++k) {
    if (i + k >= s.size()) return {Kind::kIncomplete, k, 0};
    const uint8_t t = b(i + k);
    const uint8_t tlo = k == 1 ? lo : 0x80, thi = k == 1 ? hi : 0xBF;
    if (t < tlo || t > thi) return {Kind::kInvalid, k, 0};
    cp = (cp << 6) | (t & 0x3F);
  }
  return {Kind::kValid, len, cp};
}

bool is_valid(std::string_view s) {
  for (size_t i = 0; i < s.size();) {
    if (static_cast<uint8_t>(s[i]) < 0x80) { ++i; continue; }
    const Step st = next(s, i);
    if (st.kind != Kind::kValid) return false;
    i += st.n;
  }
  return true;
}

void append(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += static_cast<char>(cp);
  } else if (cp < 0x800) {
    out += static_cast<char>(0xC0 | (cp >> 6));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += static_cast<char>(0xE0 | (cp >> 12));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (cp >> 18));
    out += static_cast<char>(0x80 | ((cp >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (cp & 0x3F));
  }
}

std::string sanitize(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size();) {
    const Step st = next(s, i);
    if (st.kind == Kind::kValid) {
      out.append(s.substr(i, st.n));
    } else {
      out += "\xEF\xBF\xBD";
    }
    i += st.n;
  }
  return out;
}

}  // namespace kv::utf8
