#include "common/units.h"

#include <unistd.h>

#include <cctype>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace kv {

int64_t physical_ram_bytes() {
  long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGE_SIZE);
  return pages > 0 && page > 0 ? int64_t(pages) * page : 0;
}

int64_t available_ram_bytes() {
  std::FILE* f = std::fopen("/proc/meminfo", "r");
  if (!f) return 0;
  char line[256];
  long long kib = 0;
  while (std::fgets(line, sizeof line, f))
    if (std::sscanf(line, "MemAvailable: %lld kB", &kib) == 1) break;
  std::fclose(f);
  return int64_t(kib) * 1024;
}

Result<int64_t> parse_kv_cache_memory(const std::string& s) {
  auto bytes = parse_memory_size(s);
  if (!bytes) return bytes;
  const int64_t avail = available_ram_bytes();
  if (avail > 0 && *bytes > avail)
    return Result<int64_t>::error("KV cache budget " + s + " (" + format_bytes(double(*bytes)) + ") is more than the memory available (" +
                                  format_bytes(double(avail)) + " of " + format_bytes(double(physical_ram_bytes())) +
                                  " RAM); give less, e.g. 0.25 for a quarter of RAM");
  return bytes;
}

Result<int64_t> parse_memory_size(const std::string& s) {
  auto bad = [&] { return Result<int64_t>::error("cannot read memory size '" + s + "' (examples: 2GiB, 512MiB, 0.25 for a quarter of RAM)"); };
  if (s.empty()) return bad();
  char* end = nullptr;
  double v = std::strtod(s.c_str(), &end);
  if (end == s.c_str() || !std::isfinite(v)) return bad();
  if (v <= 0) return Result<int64_t>::error("memory size '" + s + "' must be more than 0");
  std::string unit(end);
  for (auto& ch : unit) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  double mult = 1;
  if (unit.empty()) {
    // A fraction of RAM: written with a point, or below 1 however written (1e-3 read as 0 bytes).
    if (s.find('.') != std::string::npos || v < 1.0) {
      if (v > 1.0)
        return Result<int64_t>::error("memory size '" + s + "' reads as a fraction of RAM, and is more than all of it (give a fraction up to 1, or a size such as 2GiB)");
      return static_cast<int64_t>(v * physical_ram_bytes());
    }
  } else if (unit == "k" || unit == "kb" || unit == "kib") mult = 1024.0;
  else if (unit == "m" || unit == "mb" || unit == "mib") mult = 1024.0 * 1024;
  else if (unit == "g" || unit == "gb" || unit == "gib") mult = 1024.0 * 1024 * 1024;
  else if (unit == "t" || unit == "tb" || unit == "tib") mult = 1024.0 * 1024 * 1024 * 1024;
  else if (unit == "b") mult = 1;
  else return bad();
  double bytes = v * mult;
  if (bytes > 9.0e18) return bad();
  return static_cast<int64_t>(bytes);
}

Result<int64_t> parse_byte_size(const std::string& s) {
  char* end = nullptr;
  const double v = std::strtod(s.c_str(), &end);
  const bool fraction = end != s.c_str() && *end == '\0' && v <= 1.0 && v > 0 && (s.find('.') != std::string::npos || v < 1.0);  // as parse_memory_size reads it
  if (fraction)
    return Result<int64_t>::error("'" + s + "' would be a fraction of RAM (as --kv-cache-memory takes it), which is no size here: "
                                  "give bytes with a unit (examples: 20GiB, 512MiB)");
  auto bytes = parse_memory_size(s);
  if (!bytes && end != s.c_str() && std::isfinite(v) && v <= 0) return Result<int64_t>::error("size '" + s + "' must be more than 0");
  if (!bytes) return Result<int64_t>::error("cannot read size '" + s + "' (examples: 20GiB, 512MiB, 1073741824)");
  return bytes;
}

std::string format_bytes(double v) {
  char buf[64];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"};
  int u = 0;
  while (v >= 1024 && u < 6) { v /= 1024; ++u; }
  std::snprintf(buf, sizeof buf, u == 0 ? "%g %s" : "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace kv
