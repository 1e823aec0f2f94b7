#include "kernels/ggml_types.h"

namespace kv {

namespace {
struct Entry {
  uint32_t id;
  TypeTraits t;
};
// Block geometry as ggml defines it. "supported" marks what kvserve computes with.
constexpr Entry kTypes[] = {
    {0, {"F32", 1, 4, true}},       {1, {"F16", 1, 2, true}},
    {2, {"Q4_0", 32, 18, true}},    {3, {"Q4_1", 32, 20, true}},
    {6, {"Q5_0", 32, 22, false}},   {7, {"Q5_1", 32, 24, false}},
    {8, {"Q8_0", 32, 34, true}},    {9, {"Q8_1", 32, 36, false}},
    {10, {"Q2_K", 256, 84, false}}, {11, {"Q3_K", 256, 110, false}},
    {12, {"Q4_K", 256, 144, true}}, {13, {"Q5_K", 256, 176, false}},
    {14, {"Q6_K", 256, 210, true}}, {15, {"Q8_K", 256, 292, false}},
    {24, {"I8", 1, 1, false}},      {25, {"I16", 1, 2, false}},
    {26, {"I32", 1, 4, false}},     {27, {"I64", 1, 8, false}},
    {28, {"F64", 1, 8, false}},     {30, {"BF16", 1, 2, true}},
};
const TypeTraits* lookup(uint32_t id) {
  for (const auto& e : kTypes)
    if (e.id == id) return &e.t;
  return nullptr;
}
}  // namespace

bool type_traits(uint32_t raw_type, TypeTraits* out) {
  const TypeTraits* t = lookup(raw_type);
  if (!t) return false;
  *out = *t;
  return true;
}

const char* type_name(GgmlType t) {
  const TypeTraits* tt = lookup(static_cast<uint32_t>(t));
  return tt ? tt->name.data() : "?";
}
int64_t type_block_elems(GgmlType t) {
  const TypeTraits* tt = lookup(static_cast<uint32_t>(t));
  return tt ? tt->block_elems : 1;
}
int64_t type_block_bytes(GgmlType t) {
  const TypeTraits* tt = lookup(static_cast<uint32_t>(t));
  return tt ? tt->block_bytes : 0;
}

}  // namespace kv
