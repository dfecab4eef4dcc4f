// cuda_api.h — the CUDA part seen from plain C++ (bindings.cpp, the NCCL
// transport): launchers taking raw device pointers, counts, dtype/op enums
// and an explicit stream handle (a cudaStream_t; 0 is the legacy default
// stream). No CUDA header is needed to include this file. Every launcher
// returns once the kernel is enqueued and throws on a CUDA error. The caller
// owns every buffer; pointers 16-byte aligned get the vectorised path.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#include "collective.h"
#include "reduce_math.h"

namespace pz::cuda {

// out[i] = finish(a[i] (+) b[i]) for n elements. Pointers may alias.
void launch_reduce2(const void* a, const void* b, void* out, int64_t n, DType dt, RedOp op,
                    int nranks, uintptr_t stream);

// dst[i] = src[i] (bit-exact copy of n elements of dt).
void launch_copy(const void* src, void* dst, int64_t n, DType dt, uintptr_t stream);

// Ring partials travel in the accumulator ("wire") type W: fp32 for fp16/bf16,
// dt itself otherwise (see cpu_reduce.h's WireT).
// dst[i] = W(src[i]): n elements of dt widened to W.
void launch_pack_wire(const void* src, void* dst, int64_t n, DType dt, uintptr_t stream);
// out[i] = in[i] (+) own[i], kept in W: in/out are W, own is dt. in/out may alias.
void launch_reduce_wire(const void* in, const void* own, void* out, int64_t n, DType dt, RedOp op,
                        uintptr_t stream);
// dst[i] = finish(in[i] (+) own[i]) rounded once to dt: in is W, own/dst are dt (may alias).
void launch_reduce_wire_final(const void* in, const void* own, void* dst, int64_t n, DType dt, RedOp op,
                              int nranks, uintptr_t stream);

// dst[i] = finish(srcs[0][i] (+) ... (+) srcs[nsrc-1][i]) in source order,
// accumulated in fp32 for fp16/bf16 (cpu_reduce_many's twin). dst may be a source.
// nsrc: 1 .. kMaxReduceSources (collective.h).
void launch_reduce_many(const void* const* srcs, int nsrc, void* dst, int64_t n, DType dt, RedOp op,
                        int nranks, uintptr_t stream);

// Fused pack (to_flat) / unpack of many tensors of one dtype `dt` and a flat
// buffer of `flat_dt`: flat[offsets[k] + i] = cast(scale * ptrs[k][i]) or the
// way back, as multi_tensor.h computes it, in ceil(count / 64) launches.
void launch_multi_tensor(const std::vector<void*>& ptrs, const std::vector<int64_t>& numels,
                         const std::vector<int64_t>& offsets, DType dt, void* flat, DType flat_dt, bool to_flat,
                         double scale, uintptr_t stream);

// Loads every kernel of these launchers on the current device (once per device; see
// kernels.cu's [Note: kernels loaded before the first call]). The transports call it when created.
void preload_kernels();

// Number of visible CUDA devices (0 where there is no driver or GPU).
int device_count();
// CUDA device holding `ptr`, or -1 for host or unknown memory.
int pointer_device(uintptr_t ptr);
// CUDA runtime version the extension was built with (e.g. 13000).
int runtime_version();
// The NCCL library _C calls (nccl_api.h's [Note: the NCCL library is chosen at run time]).
struct NcclLibrary {
  std::string path;  // empty: none opened yet
  int version = 0;   // ncclGetVersion, e.g. 23203
  bool test = false; // it exports pyzeroTestNccl
};
// nccl_open could not open the library, or it lacks a function _C calls.
struct NcclLoadError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
// Opens `path` (a file, or a soname for the loader's search) and fills the
// table; once per process (again with a path of the library already open: its description).
NcclLibrary nccl_open(const std::string& path);
NcclLibrary nccl_library();
// NCCL library version (e.g. 23203), from ncclGetVersion at run time; 0 before nccl_open.
int nccl_version();

}  // namespace pz::cuda
