// cuda_api.h — the CUDA part seen from plain C++ (bindings.cpp): launchers
// taking raw device pointers, counts, dtype/op enums and an explicit stream
// handle. No CUDA header is needed to include this file.
#pragma once

#include <cstdint>
#include <string>

#include "reduce_math.h"

namespace pz::cuda {

// out[i] = finish(a[i] (+) b[i]) for n elements on `stream` (a cudaStream_t;
// 0 is the legacy default stream). Pointers may alias. Throws on a CUDA error.
void launch_reduce2(const void* a, const void* b, void* out, int64_t n, DType dt, RedOp op,
                    int nranks, uintptr_t stream);

// Number of visible CUDA devices (0 where there is no driver or GPU).
int device_count();
// CUDA runtime version the extension was built with (e.g. 13000).
int runtime_version();
// NCCL library version (e.g. 23203), from ncclGetVersion at run time.
int nccl_version();

}  // namespace pz::cuda
