// kernels.cu — launchers for the element-wise kernels of reduce_kernels.cuh,
// and the few CUDA runtime facts the Python layer asks for.
//
// Launchers take raw pointers, counts, dtype/op enums and an explicit stream,
// dispatch the dtype/op once (PZ_DISPATCH_DTYPE / PZ_DISPATCH_OP), and end with
// a last-error check.
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "cuda_api.h"
#include "cuda_check.h"
#include "errors.h"
#include "reduce_kernels.cuh"
#include "reduce_math.h"

namespace pz::cuda {

namespace {

// 4 waves of 256-thread blocks over 132 SMs covers an H100; grid-stride
// handles the rest. Small inputs get just enough blocks.
constexpr int kThreads = 256;
constexpr int kMaxBlocks = 132 * 4;

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Set while preload_kernels() walks the launchers: they load their kernel instead of launching it.
thread_local bool t_preload = false;

// Runs `fn` over n elements; VEC elements per vector step (vec_elems of the
// call's narrowest type), vectorised only when every pointer is 16-byte aligned.
template <int VEC, typename Fn>
void launch_map(const Fn& fn, int64_t n, bool vectorized, uintptr_t stream) {
  if (t_preload) return load_kernel(reinterpret_cast<const void*>(&map_kernel<VEC, Fn>));
  if (n <= 0) return;
  int64_t work = vectorized ? (n + VEC - 1) / VEC : n;
  int blocks = int(std::min<int64_t>(kMaxBlocks, (work + kThreads - 1) / kThreads));
  map_kernel<VEC><<<blocks, kThreads, 0, reinterpret_cast<cudaStream_t>(stream)>>>(fn, n, vectorized);
  PZ_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

// ----------------------------------------------------------------------------
// Launchers

void launch_reduce2(const void* a, const void* b, void* out, int64_t n, DType dt, RedOp op, int nranks,
                    uintptr_t stream) {
  bool vec = aligned16(a) && aligned16(b) && aligned16(out);
  PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
    Reduce2Fn<OP, true, T, T, T> fn{static_cast<const T*>(a), static_cast<const T*>(b), static_cast<T*>(out),
                                    nranks};
    launch_map<vec_elems<T>()>(fn, n, vec, stream);
  }));
}

void launch_copy(const void* src, void* dst, int64_t n, DType dt, uintptr_t stream) {
  bool vec = aligned16(src) && aligned16(dst);
  PZ_DISPATCH_DTYPE(dt, T, {
    ConvertFn<T, T> fn{static_cast<const T*>(src), static_cast<T*>(dst)};
    launch_map<vec_elems<T>()>(fn, n, vec, stream);
  });
}

void launch_pack_wire(const void* src, void* dst, int64_t n, DType dt, uintptr_t stream) {
  bool vec = aligned16(src) && aligned16(dst);
  PZ_DISPATCH_DTYPE(dt, T, {
    using W = typename Acc<T>::type;
    ConvertFn<T, W> fn{static_cast<const T*>(src), static_cast<W*>(dst)};
    launch_map<vec_elems<T>()>(fn, n, vec, stream);
  });
}

void launch_reduce_wire(const void* in, const void* own, void* out, int64_t n, DType dt, RedOp op,
                        uintptr_t stream) {
  bool vec = aligned16(in) && aligned16(own) && aligned16(out);
  PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
    using W = typename Acc<T>::type;
    Reduce2Fn<OP, false, W, T, W> fn{static_cast<const W*>(in), static_cast<const T*>(own), static_cast<W*>(out),
                                     1};
    launch_map<vec_elems<T>()>(fn, n, vec, stream);
  }));
}

void launch_reduce_wire_final(const void* in, const void* own, void* dst, int64_t n, DType dt, RedOp op,
                              int nranks, uintptr_t stream) {
  bool vec = aligned16(in) && aligned16(own) && aligned16(dst);
  PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
    using W = typename Acc<T>::type;
    Reduce2Fn<OP, true, W, T, T> fn{static_cast<const W*>(in), static_cast<const T*>(own), static_cast<T*>(dst),
                                    nranks};
    launch_map<vec_elems<T>()>(fn, n, vec, stream);
  }));
}

void launch_reduce_many(const void* const* srcs, int nsrc, void* dst, int64_t n, DType dt, RedOp op, int nranks,
                        uintptr_t stream) {
  if (nsrc < 1 || nsrc > kMaxReduceSources)
    throw std::invalid_argument("reduce_many: expected 1 to " + std::to_string(kMaxReduceSources) + " sources, got " +
                                std::to_string(nsrc));
  bool vec = aligned16(dst);
  for (int s = 0; s < nsrc; ++s) vec = vec && aligned16(srcs[s]);
  PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
    ReduceManyFn<OP, T> fn{};
    for (int s = 0; s < nsrc; ++s) fn.src.p[s] = static_cast<const T*>(srcs[s]);
    fn.nsrc = nsrc;
    fn.out = static_cast<T*>(dst);
    fn.nranks = nranks;
    launch_map<vec_elems<T>()>(fn, n, vec, stream);
  }));
}

void launch_multi_tensor(const std::vector<void*>& ptrs, const std::vector<int64_t>& numels,
                         const std::vector<int64_t>& offsets, DType dt, void* flat, DType flat_dt, bool to_flat,
                         double scale, uintptr_t stream) {
  if (ptrs.size() != numels.size() || ptrs.size() != offsets.size())
    throw std::invalid_argument("multi_tensor: ptrs, numels and offsets must have one entry per tensor");
  auto s = reinterpret_cast<cudaStream_t>(stream);
  char* base = static_cast<char*>(flat);
  for (size_t first = 0; first < ptrs.size(); first += kMaxSlotsPerLaunch) {
    size_t count = std::min<size_t>(kMaxSlotsPerLaunch, ptrs.size() - first);
    SlotTable t{};
    int64_t longest = 0;
    for (size_t k = 0; k < count; ++k) {
      void* slot = ptrs[first + k];
      void* in_flat = base + offsets[first + k] * int64_t(dtype_size(flat_dt));
      t.src[k] = to_flat ? slot : in_flat;
      t.dst[k] = to_flat ? in_flat : slot;
      t.n[k] = numels[first + k];
      longest = std::max(longest, numels[first + k]);
    }
    if (longest == 0) continue;
    dim3 grid(unsigned(std::min<int64_t>(kMaxBlocks, (longest + kThreads - 1) / kThreads)), unsigned(count));
    DType from = to_flat ? dt : flat_dt, into = to_flat ? flat_dt : dt;
    PZ_DISPATCH_DTYPE(from, S, PZ_DISPATCH_DTYPE(into, D, {
      if (t_preload) return load_kernel(reinterpret_cast<const void*>(&multi_tensor_kernel<S, D>));
      multi_tensor_kernel<S, D><<<grid, kThreads, 0, s>>>(t, scale);
    }));
    PZ_CUDA_CHECK(cudaGetLastError());
  }
}

// [Note: kernels loaded before the first call]
// CUDA loads a kernel lazily, at its first launch (CUDA_MODULE_LOADING=LAZY, the default since
// CUDA 12.2), and loading may synchronize the whole context: it waits for every kernel already
// queued in the process. A collective's first call would then wait on the host for unrelated work
// queued before it (an async call that blocks), and a launch made while one of pyzero's kernels
// waits for a peer waits for that peer. So the transports load every kernel they may launch when
// they are created (NCCL loads its own kernels at communicator creation): once per device.
void preload_kernels() {
  static OncePerDevice once;
  once([] {
    struct Flag {
      Flag() { t_preload = true; }
      ~Flag() { t_preload = false; }
    } flag;
    // (no launch happens: these pointers are never read)
    alignas(16) static char dummy[16];
    void* p = dummy;
    const void* srcs[1] = {dummy};
    for (DType dt : kAllDTypes) {
      launch_copy(p, p, 1, dt, 0);
      launch_pack_wire(p, p, 1, dt, 0);
      for (RedOp op : kAllRedOps) {
        launch_reduce2(p, p, p, 1, dt, op, 1, 0);
        launch_reduce_wire(p, p, p, 1, dt, op, 0);
        launch_reduce_wire_final(p, p, p, 1, dt, op, 1, 0);
        launch_reduce_many(srcs, 1, p, 1, dt, op, 1, 0);
      }
      for (DType flat : kAllDTypes) launch_multi_tensor({p}, {1}, {0}, dt, p, flat, true, 1.0, 0);
    }
  });
}

// ----------------------------------------------------------------------------
// Runtime facts

int device_count() {
  int n = 0;
  if (cudaGetDeviceCount(&n) != cudaSuccess) {
    cudaGetLastError();  // clear the sticky "no driver/device" error
    return 0;
  }
  return n;
}

int runtime_version() {
  int v = 0;
  cudaRuntimeGetVersion(&v);
  return v;
}

int pointer_device(uintptr_t ptr) {
  cudaPointerAttributes attr{};
  if (cudaPointerGetAttributes(&attr, reinterpret_cast<const void*>(ptr)) != cudaSuccess) {
    cudaGetLastError();
    return -1;
  }
  bool on_device = attr.type == cudaMemoryTypeDevice || attr.type == cudaMemoryTypeManaged;
  return on_device ? attr.device : -1;
}

}  // namespace pz::cuda
