// Parsing and printing of sizes the user gives on the command line.
#pragma once
#include <cstdint>
#include <string>

#include "common/status.h"

namespace kv {

// "1073741824", "512MiB", "2GiB", "1.5GB", "256M" (binary for both spellings of M/G: memory
// budgets are about RAM), or a fraction of physical RAM in (0, 1] such as "0.25".
Result<int64_t> parse_memory_size(const std::string& s);
int64_t physical_ram_bytes();
std::string format_bytes(double bytes);  // "512 B", "0.5 B", "22.50 KiB", "10.00 GiB" (1024-based)

}  // namespace kv
