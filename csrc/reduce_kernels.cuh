// reduce_kernels.cuh — the element-wise CUDA kernels behind every GPU path:
// copy/convert, two-input reduce (to the storage type, or to the accumulator
// type for the partial sums a ring carries), and the n-input reduce of a
// one-shot all-reduce.
//
// One grid-stride kernel (map_kernel) runs an element functor over [0, n):
// VEC elements per thread and step while the pointers are 16-byte aligned,
// VEC = 16 / sizeof(narrowest type of the call) so the narrowest operand is
// one 16-byte load (vLLM packed_t, llm.c Packed128) and a wider one (the fp32
// partials of an fp16 call) a 32-byte load; then a scalar tail. The math is
// reduce_math.h, shared with the CPU loops: fp16/bf16 accumulate in fp32 and
// are rounded once when stored. The n-input reduce adds its sources in index
// order (rank order), so every rank gets bitwise identical results.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "collective.h"
#include "reduce_math.h"

namespace pz::cuda {

// ----------------------------------------------------------------------------
// Packs: K elements loaded or stored at once (one or two 16-byte accesses)

template <typename T, int K>
struct alignas(K * sizeof(T) >= 16 ? 16 : K * sizeof(T)) Pack {
  T v[K];
};

template <int K, typename T>
__device__ __forceinline__ Pack<T, K> load_pack(const T* p) {
  return *reinterpret_cast<const Pack<T, K>*>(p);
}

template <int K, typename T>
__device__ __forceinline__ void store_pack(T* p, const Pack<T, K>& x) {
  *reinterpret_cast<Pack<T, K>*>(p) = x;
}

// Storage -> storage conversion through the accumulator type; a plain copy
// (bit-exact, NaN payloads included) when the types agree.
template <typename TO, typename TI>
__device__ __forceinline__ TO convert(TI x) {
  if constexpr (std::is_same_v<TI, TO>) return x;
  else return from_acc<TO>(to_acc(x));
}

// ----------------------------------------------------------------------------
// Element functors: run<K>(i) handles elements [i, i + K)

// out = in, converted (copy; pack fp16/bf16 into fp32 wire; unpack)
template <typename TI, typename TO>
struct ConvertFn {
  const TI* in;
  TO* out;
  template <int K> __device__ __forceinline__ void run(int64_t i) const {
    Pack<TI, K> x = load_pack<K>(in + i);
    Pack<TO, K> y;
#pragma unroll
    for (int k = 0; k < K; ++k) y.v[k] = convert<TO>(x.v[k]);
    store_pack<K>(out + i, y);
  }
};

// fp16 max / min: the result is one of the two inputs, so its bits are taken as they are (a NaN as
// float_to_half gives it: its sign | 0x7e00) instead of the round trip through float and back, which
// gives the same bits for every pair (each fp16 value is exact in float) at twice the instructions:
// the kernel ran at 0.87x a device copy.
template <RedOp OP>
__device__ __forceinline__ half_t pick_half(half_t a, half_t b) {
#if defined(__CUDA_ARCH__)
  float fa, fb;
  asm("cvt.f32.f16 %0, %1;" : "=f"(fa) : "h"(a.bits));  // exact but for NaN payloads (not compared)
  asm("cvt.f32.f16 %0, %1;" : "=f"(fb) : "h"(b.bits));
#else  // (tests/cuda_kernels_on_cpu.cpp runs this body on the CPU)
  const float fa = half_to_float(a), fb = half_to_float(b);
#endif
  const bool a_nan = (a.bits & 0x7fffu) > 0x7c00u;
  const bool take_a = a_nan || (OP == RedOp::max ? fa > fb : fa < fb);  // combine<OP>'s rule
  const uint16_t r = take_a ? a.bits : b.bits;
  return half_t{(r & 0x7fffu) > 0x7c00u ? uint16_t((r & 0x8000u) | 0x7e00u) : r};
}

// out = a (+) b. FINAL: finish() (avg's division) and round to TO, the last
// step of a reduction; otherwise TO is the accumulator type and the partial
// is kept unrounded. Pointers may alias elementwise (in-place).
template <RedOp OP, bool FINAL, typename TA, typename TB, typename TO>
struct Reduce2Fn {
  const TA* a;
  const TB* b;
  TO* out;
  int nranks;
  template <int K> __device__ __forceinline__ void run(int64_t i) const {
    Pack<TA, K> x = load_pack<K>(a + i);
    Pack<TB, K> y = load_pack<K>(b + i);
    Pack<TO, K> z;
#pragma unroll
    for (int k = 0; k < K; ++k) {
      if constexpr (FINAL && (OP == RedOp::max || OP == RedOp::min) && std::is_same_v<TA, half_t> &&
                    std::is_same_v<TB, half_t> && std::is_same_v<TO, half_t>) {
        z.v[k] = pick_half<OP>(x.v[k], y.v[k]);
      } else {
        auto v = combine<OP>(to_acc_operand<OP>(x.v[k]), to_acc_operand<OP>(y.v[k]));
        if constexpr (FINAL) z.v[k] = from_acc<TO>(finish<OP>(v, nranks));
        else z.v[k] = TO(v);
      }
    }
    store_pack<K>(out + i, z);
  }
};

template <typename T>
struct Sources {
  const T* p[kMaxReduceSources];
};

// out = finish(src[0] (+) src[1] (+) ... (+) src[nsrc - 1]), in that order,
// accumulated in Acc<T> and rounded once (the CUDA twin of cpu_reduce_many).
// `out` may be one of the sources.
template <RedOp OP, typename T>
struct ReduceManyFn {
  Sources<T> src;
  int nsrc;
  T* out;
  int nranks;
  template <int K> __device__ __forceinline__ void run(int64_t i) const {
    using A = typename Acc<T>::type;
    A acc[K];
    Pack<T, K> x = load_pack<K>(src.p[0] + i);
#pragma unroll
    for (int k = 0; k < K; ++k) acc[k] = to_acc_first<OP>(x.v[k], nsrc);
    for (int s = 1; s < nsrc; ++s) {
      Pack<T, K> y = load_pack<K>(src.p[s] + i);
#pragma unroll
      for (int k = 0; k < K; ++k) acc[k] = combine<OP>(acc[k], to_acc_operand<OP>(y.v[k]));
    }
    Pack<T, K> z;
#pragma unroll
    for (int k = 0; k < K; ++k) z.v[k] = from_acc<T>(finish<OP>(acc[k], nranks));
    store_pack<K>(out + i, z);
  }
};

// ----------------------------------------------------------------------------
// Kernel

// Vector steps over [0, n / VEC * VEC) when `vectorized` (every pointer
// 16-byte aligned), then the scalar tail, both grid-stride.
template <int VEC, typename Fn>
__global__ void map_kernel(Fn fn, int64_t n, bool vectorized) {
  int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t stride = int64_t(gridDim.x) * blockDim.x;
  int64_t nvec = vectorized ? n / VEC : 0;
  for (int64_t v = tid; v < nvec; v += stride) fn.template run<VEC>(v * VEC);
  for (int64_t i = nvec * VEC + tid; i < n; i += stride) fn.template run<1>(i);
}

// ----------------------------------------------------------------------------
// Multi-tensor pack / unpack: many tensors of one dtype S into (or out of) one
// flat buffer of dtype D in a single launch (multi_tensor.h's twin: the value
// taken in S's accumulator type, times `scale` there, rounded once into D).
// blockIdx.y is the slot; blocks of a slot grid-stride over its elements.

constexpr int kMaxSlotsPerLaunch = 64;  // 64 x 24 bytes of slots: well inside the 4 KiB of kernel arguments

struct SlotTable {
  const void* src[kMaxSlotsPerLaunch];
  void* dst[kMaxSlotsPerLaunch];
  int64_t n[kMaxSlotsPerLaunch];
};

template <typename S, typename D>
__global__ void multi_tensor_kernel(SlotTable t, double scale) {
  using A = typename Acc<S>::type;
  const S* src = static_cast<const S*>(t.src[blockIdx.y]);
  D* dst = static_cast<D*>(t.dst[blockIdx.y]);
  int64_t n = t.n[blockIdx.y];
  int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    if constexpr (std::is_floating_point_v<A>) {
      if (scale != 1.0) {
        dst[i] = from_acc<D>(typename Acc<D>::type(to_acc(src[i]) * A(scale)));
        continue;
      }
    }
    dst[i] = convert<D>(src[i]);
  }
}

// Elements per vector step for a call whose narrowest operand type is T.
template <typename T>
constexpr int vec_elems() {
  return int(16 / sizeof(T));
}

}  // namespace pz::cuda
