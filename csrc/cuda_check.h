// cuda_check.h — CUDA error checks for the sources built with CUDA (kernels,
// NCCL transport). llm.c's inline-function-plus-macro, but throwing: pybind11
// turns the exception into pyzero.CollectiveError on the rank that hit it.
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "errors.h"

namespace pz::cuda {

inline void cuda_check_(cudaError_t err, const char* file, int line) {
  if (err != cudaSuccess)
    throw CollectiveError(std::string("CUDA error: ") + cudaGetErrorString(err) + " at " + file + ":" +
                          std::to_string(line));
}

}  // namespace pz::cuda

#define PZ_CUDA_CHECK(err) ::pz::cuda::cuda_check_((err), __FILE__, __LINE__)
