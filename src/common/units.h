// Parsing and printing of sizes the user gives on the command line.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"

namespace kv {

// "1073741824", "512MiB", "2GiB", "1.5GB", "256M" (binary for both spellings of M/G: memory
// budgets are about RAM), or a fraction of physical RAM in (0, 1] such as "0.25".
Result<int64_t> parse_memory_size(const std::string& s);
// A size that is not a RAM budget (--kv-disk-bytes, --max-body-size): parse_memory_size without
// the fraction of RAM, which means nothing there ("0.5" is refused with a hint, not read as half
// the RAM).
Result<int64_t> parse_byte_size(const std::string& s);
int64_t physical_ram_bytes();
int64_t available_ram_bytes();  // /proc/meminfo MemAvailable; 0 if unknown
// A KV cache budget: parse_memory_size, refused when more than the memory available now (the
// pool is allocated whole at start: a larger one threw bad_alloc or was OOM-killed).
Result<int64_t> parse_kv_cache_memory(const std::string& s);
std::string format_bytes(double bytes);  // "512 B", "0.5 B", "22.50 KiB", "10.00 GiB" (1024-based)

}  // namespace kv
