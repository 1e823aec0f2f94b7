// Memory and byte sizes as the flags read them (common/units.h).
#include <gtest/gtest.h>

#include "common/units.h"

namespace kv {
namespace {

TEST(Units, MemorySizesWithUnitsAndFractionsOfRam) {
  EXPECT_EQ(*parse_memory_size("2GiB"), int64_t(2) << 30);
  EXPECT_EQ(*parse_memory_size("512m"), int64_t(512) << 20);
  EXPECT_EQ(*parse_memory_size("1073741824"), int64_t(1) << 30);
  const int64_t ram = physical_ram_bytes();
  ASSERT_GT(ram, 0);
  EXPECT_EQ(*parse_memory_size("0.25"), static_cast<int64_t>(0.25 * ram));
  // Below 1 is a fraction however it is written: 1e-3 read as 0 bytes (a black-box test).
  EXPECT_EQ(*parse_memory_size("1e-3"), static_cast<int64_t>(0.001 * ram));
  EXPECT_EQ(*parse_memory_size("1e-3"), *parse_memory_size("0.001"));
  EXPECT_FALSE(parse_memory_size("1.5"));  // a fraction past all of RAM
  EXPECT_FALSE(parse_memory_size("3XB"));
  EXPECT_FALSE(parse_memory_size("0"));
  EXPECT_FALSE(parse_memory_size("nan"));
}

TEST(Units, ByteSizesSayWhatIsWrong) {
  EXPECT_EQ(*parse_byte_size("20GiB"), int64_t(20) << 30);
  auto zero = parse_byte_size("0");  // said "cannot read size '0'", though it reads: it is too small
  ASSERT_FALSE(zero);
  EXPECT_NE(zero.message().find("must be more than 0"), std::string::npos) << zero.message();
  auto frac = parse_byte_size("1e-3");
  ASSERT_FALSE(frac);
  EXPECT_NE(frac.message().find("fraction of RAM"), std::string::npos) << frac.message();
  auto junk = parse_byte_size("lots");
  ASSERT_FALSE(junk);
  EXPECT_NE(junk.message().find("cannot read size"), std::string::npos) << junk.message();
}

}  // namespace
}  // namespace kv
