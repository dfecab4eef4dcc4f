// nccl_info.cpp — NCCL facts for build_info().
#include <nccl.h>

#include "cuda_api.h"

namespace pz::cuda {

int nccl_version() {
  int v = 0;
  if (ncclGetVersion(&v) != ncclSuccess) return 0;
  return v;
}

}  // namespace pz::cuda
