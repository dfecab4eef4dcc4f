// nccl_types.h — pyzero's dtypes and reduction ops and NCCL's, one table each, read both ways:
// the nccl backend (nccl_transport.cpp) passes pyzero's to NCCL, the test NCCL library
// (csrc/test_nccl) takes NCCL's back.
#pragma once

#include <nccl.h>

#include "reduce_math.h"

namespace pz {

struct NcclDType {
  DType pz;
  ncclDataType_t nccl;
};
inline constexpr NcclDType kNcclDTypes[] = {{DType::f32, ncclFloat32}, {DType::f16, ncclFloat16},
                                            {DType::bf16, ncclBfloat16}, {DType::f64, ncclFloat64},
                                            {DType::i32, ncclInt32},   {DType::i64, ncclInt64}};

struct NcclOp {
  RedOp pz;
  ncclRedOp_t nccl;
};
inline constexpr NcclOp kNcclOps[] = {{RedOp::sum, ncclSum}, {RedOp::avg, ncclAvg}, {RedOp::max, ncclMax},
                                      {RedOp::min, ncclMin}, {RedOp::prod, ncclProd}};

// NCCL's counterpart of pyzero's `d` (or `o`), or pyzero's of NCCL's; false where there is none
// (NCCL's 8-bit and unsigned types, its custom ops; a pyzero code out of range).
inline bool to_nccl(DType d, ncclDataType_t& out) {
  for (const auto& e : kNcclDTypes)
    if (e.pz == d) return out = e.nccl, true;
  return false;
}
inline bool to_nccl(RedOp o, ncclRedOp_t& out) {
  for (const auto& e : kNcclOps)
    if (e.pz == o) return out = e.nccl, true;
  return false;
}
inline bool from_nccl(ncclDataType_t d, DType& out) {
  for (const auto& e : kNcclDTypes)
    if (e.nccl == d) return out = e.pz, true;
  return false;
}
inline bool from_nccl(ncclRedOp_t o, RedOp& out) {
  for (const auto& e : kNcclOps)
    if (e.nccl == o) return out = e.pz, true;
  return false;
}

}  // namespace pz
