// nccl_types_on_cpu.cpp — csrc/nccl_types.h's table of pyzero's dtypes and ops against NCCL's, read
// both ways, checked by name against NCCL's enum as nccl.h spells it (written out here, not taken
// from the table). Built against the real nccl.h and run by tests/test_nccl_testlib.py.
#include <cstring>
#include <string>

#include "check_cases.h"
#include "nccl_types.h"

using check_cases::check;

namespace {

struct NamedType {
  ncclDataType_t t;
  const char* name;  // pyzero's name of the same type, or nullptr: pyzero has none
};
const NamedType kTypes[] = {{ncclInt8, nullptr},       {ncclUint8, nullptr},      {ncclInt32, "int32"},
                            {ncclUint32, nullptr},     {ncclInt64, "int64"},      {ncclUint64, nullptr},
                            {ncclFloat16, "float16"},  {ncclFloat32, "float32"},  {ncclFloat64, "float64"},
                            {ncclBfloat16, "bfloat16"}};
struct NamedOp {
  ncclRedOp_t o;
  const char* name;
};
const NamedOp kOps[] = {{ncclSum, "sum"}, {ncclProd, "prod"}, {ncclMax, "max"}, {ncclMin, "min"}, {ncclAvg, "avg"}};

}  // namespace

int main() {
  using namespace pz;
  for (int i = 0; i < int(ncclNumTypes); ++i) {  // every NCCL type -> pyzero's, or none
    const ncclDataType_t t = ncclDataType_t(i);
    const char* name = nullptr;
    for (const auto& e : kTypes)
      if (e.t == t) name = e.name;
    DType d{};
    const bool has = from_nccl(t, d);
    check(has == (name != nullptr), "from_nccl(NCCL type " + std::to_string(i) + "): " + (has ? "found" : "none"));
    if (has && name) check(std::strcmp(dtype_name(d), name) == 0, std::string("NCCL's ") + name + " -> " + dtype_name(d));
  }
  for (int i = 0; i < kNumDTypes; ++i) {  // pyzero's -> NCCL's -> pyzero's
    DType d = DType(i), back{};
    ncclDataType_t t{};
    check(to_nccl(d, t), std::string("to_nccl(") + dtype_name(d) + ")");
    const char* name = nullptr;
    for (const auto& e : kTypes)
      if (e.t == t) name = e.name;
    check(name && std::strcmp(name, dtype_name(d)) == 0, std::string(dtype_name(d)) + " -> NCCL's " + (name ? name : "?"));
    check(from_nccl(t, back) && back == d, std::string(dtype_name(d)) + " round trip");
  }
  for (const auto& e : kOps) {
    RedOp o{};
    check(from_nccl(e.o, o) && std::strcmp(op_name(o), e.name) == 0, std::string("op ") + e.name + " -> " + op_name(o));
  }
  for (int i = 0; i < kNumRedOps; ++i) {
    RedOp o = RedOp(i), back{};
    ncclRedOp_t n{};
    check(to_nccl(o, n) && from_nccl(n, back) && back == o, std::string(op_name(o)) + " round trip");
    const char* name = nullptr;
    for (const auto& e : kOps)
      if (e.o == n) name = e.name;
    check(name && std::strcmp(name, op_name(o)) == 0, std::string(op_name(o)) + " -> NCCL's " + (name ? name : "?"));
  }
  RedOp o{};
  ncclDataType_t t{};
  check(!to_nccl(DType(kNumDTypes), t), "a pyzero dtype code out of range has no NCCL type");
  check(!from_nccl(ncclRedOp_t(ncclNumOps), o), "an NCCL custom op has no pyzero op");
  return check_cases::report();
}
