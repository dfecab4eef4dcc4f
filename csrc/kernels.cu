// kernels.cu — CUDA reduce kernels over the shared math of reduce_math.h.
//
// Kernels: 16-byte packed loads/stores (Packed16<T> holds 16 / sizeof(T)
// elements), grid-stride, a scalar tail; fp16/bf16 accumulate in fp32 and are
// rounded once when stored. Launchers take raw pointers, counts and an
// explicit stream, and end with a last-error check.
#include <cuda_runtime.h>

#include <stdexcept>
#include <string>

#include "cuda_api.h"
#include "errors.h"
#include "reduce_math.h"

namespace pz::cuda {

inline void cuda_check_(cudaError_t err, const char* file, int line) {
  if (err != cudaSuccess)
    throw CollectiveError(std::string("CUDA error: ") + cudaGetErrorString(err) + " at " + file + ":" +
                          std::to_string(line));
}
#define PZ_CUDA_CHECK(err) ::pz::cuda::cuda_check_((err), __FILE__, __LINE__)

template <typename T>
struct alignas(16) Packed16 {
  static constexpr int N = 16 / sizeof(T);
  T v[N];
};

// ----------------------------------------------------------------------------
// Kernels

template <RedOp OP, typename T>
__global__ void reduce2_kernel(const T* __restrict__ a, const T* __restrict__ b, T* out, int64_t n,
                               int nranks, bool vectorized) {
  using P = Packed16<T>;
  int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t nvec = vectorized ? n / P::N : 0;
  const P* pa = reinterpret_cast<const P*>(a);
  const P* pb = reinterpret_cast<const P*>(b);
  P* po = reinterpret_cast<P*>(out);
  for (int64_t i = tid; i < nvec; i += stride) {
    P x = pa[i], y = pb[i], z;
#pragma unroll
    for (int k = 0; k < P::N; ++k)
      z.v[k] = from_acc<T>(finish<OP>(combine<OP>(to_acc(x.v[k]), to_acc(y.v[k])), nranks));
    po[i] = z;
  }
  for (int64_t i = nvec * P::N + tid; i < n; i += stride)
    out[i] = from_acc<T>(finish<OP>(combine<OP>(to_acc(a[i]), to_acc(b[i])), nranks));
}

// ----------------------------------------------------------------------------
// Launchers

namespace {
// 4 waves of 256-thread blocks over 132 SMs covers an H100; grid-stride
// handles the rest. Small inputs get just enough blocks.
constexpr int kThreads = 256;
constexpr int kMaxBlocks = 132 * 4;
bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }
}  // namespace

void launch_reduce2(const void* a, const void* b, void* out, int64_t n, DType dt, RedOp op, int nranks,
                    uintptr_t stream) {
  if (n <= 0) return;
  bool vec = aligned16(a) && aligned16(b) && aligned16(out);
  auto s = reinterpret_cast<cudaStream_t>(stream);
  PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
    int64_t work = vec ? (n + Packed16<T>::N - 1) / Packed16<T>::N : n;
    int blocks = int(std::min<int64_t>(kMaxBlocks, (work + kThreads - 1) / kThreads));
    reduce2_kernel<OP, T><<<blocks, kThreads, 0, s>>>(static_cast<const T*>(a), static_cast<const T*>(b),
                                                      static_cast<T*>(out), n, nranks, vec);
  }));
  PZ_CUDA_CHECK(cudaGetLastError());
}

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

}  // namespace pz::cuda
