// cpu_reduce.h — the CPU element loops behind every shm primitive.
//
// Storage type T is what the user's buffer holds; wire type W is what travels
// in a slot (T, or fp32 for fp16/bf16 partial sums so a multi-step ring rounds
// once, when the fully reduced value is stored). Loops are plain indexed loops
// the compiler vectorises; the math is reduce_math.h, shared with CUDA.
#pragma once

#include <cstddef>

#include "reduce_math.h"

namespace pz {

// Wire type of the reduce-scatter phase: the accumulator type.
template <typename T> using WireT = typename Acc<T>::type;

template <typename T, typename W>
inline void cpu_pack(const T* __restrict src, W* __restrict dst, size_t n) {
  if constexpr (std::is_same_v<T, W>) {
    std::memcpy(dst, src, n * sizeof(T));
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = W(to_acc(src[i]));
  }
}

// out = in (+) own, kept in wire precision for the next ring step.
template <RedOp OP, typename T, typename W>
inline void cpu_reduce_send(const W* __restrict in, const T* own, W* __restrict out, size_t n) {
  for (size_t i = 0; i < n; ++i) out[i] = W(combine<OP>(to_acc(in[i]), to_acc(own[i])));
}

// dst = finish(in (+) own) rounded once to T; also written to `dst2` when set
// (the first all-gather step of an all-reduce). `own` may alias `dst`.
template <RedOp OP, typename T, typename W>
inline void cpu_reduce_final(const W* __restrict in, const T* own, T* dst, T* __restrict dst2,
                             size_t n, int nranks) {
  if (dst2) {
    for (size_t i = 0; i < n; ++i) {
      T v = from_acc<T>(finish<OP>(combine<OP>(to_acc(in[i]), to_acc(own[i])), nranks));
      dst[i] = v;
      dst2[i] = v;
    }
  } else {
    for (size_t i = 0; i < n; ++i)
      dst[i] = from_acc<T>(finish<OP>(combine<OP>(to_acc(in[i]), to_acc(own[i])), nranks));
  }
}

// dst[i] = finish(src[0][i] (+) src[1][i] (+) ... ) in rank order, accumulating
// in Acc<T>; fixed order so every rank produces bitwise identical output.
template <RedOp OP, typename T>
inline void cpu_reduce_many(const T* const* srcs, int nsrc, T* dst, size_t n, int nranks) {
  using A = typename Acc<T>::type;
  constexpr size_t kBlock = 512;
  A acc[kBlock];
  for (size_t base = 0; base < n; base += kBlock) {
    size_t m = n - base < kBlock ? n - base : kBlock;
    const T* s0 = srcs[0] + base;
    for (size_t i = 0; i < m; ++i) acc[i] = to_acc(s0[i]);
    for (int k = 1; k < nsrc; ++k) {
      const T* sk = srcs[k] + base;
      for (size_t i = 0; i < m; ++i) acc[i] = combine<OP>(acc[i], to_acc(sk[i]));
    }
    T* d = dst + base;
    for (size_t i = 0; i < m; ++i) d[i] = from_acc<T>(finish<OP>(acc[i], nranks));
  }
}

}  // namespace pz
