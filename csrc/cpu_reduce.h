// cpu_reduce.h — the CPU element loops behind every shm primitive.
//
// Storage type T is what the user's buffer holds; wire type W is what travels
// in a slot (T, or fp32 for fp16/bf16 partial sums so a multi-step ring rounds
// once, when the fully reduced value is stored). Loops are plain indexed loops
// the compiler vectorises; the math is reduce_math.h, shared with CUDA.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define PZ_STREAMING_STORES 1
#endif

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

// finish(in (+) own) rounded once to T: one element of the last reduce step.
template <RedOp OP, typename T, typename W>
inline T final_value(W in, T own, int nranks) {
  return from_acc<T>(finish<OP>(combine<OP>(to_acc(in), to_acc(own)), nranks));
}

// dst = final_value(in, own); also written to `dst2` when set (the first
// all-gather step of an all-reduce). `own` may alias `dst`.
template <RedOp OP, typename T, typename W>
inline void cpu_reduce_final(const W* __restrict in, const T* own, T* dst, T* __restrict dst2,
                             size_t n, int nranks) {
  if (dst2) {
    for (size_t i = 0; i < n; ++i) {
      T v = final_value<OP, T, W>(in[i], own[i], nranks);
      dst[i] = v;
      dst2[i] = v;
    }
  } else {
    for (size_t i = 0; i < n; ++i) dst[i] = final_value<OP, T, W>(in[i], own[i], nranks);
  }
}

// [Note: streamed output]
// An out-of-place collective writes every line of its output buffer without
// reading it, but a normal store first reads the line from memory (read for
// ownership): 3 bytes move per 2 that an in-place call moves. The *_streamed
// forms below write the whole 64-byte lines of `dst` with non-temporal stores,
// which skip that read and leave the line out of the cache; they pay off only
// for outputs too large to stay cached (the caller decides, see
// stream_output() in shm_transport.cpp) and need stream_fence() before the
// output is handed on. Each line is computed and stored at once: computing a
// slice into a cached buffer and streaming it out afterwards moves the same
// bytes but serialises the read and write streams (1.5x slower in a model of
// the loop on two cores).
constexpr size_t kStreamLine = 64;

inline void stream_fence() {
#ifdef PZ_STREAMING_STORES
  _mm_sfence();
#endif
}

// One 64-byte line from `src` (any alignment) to the 64-byte aligned `dst`.
inline void stream_line(void* dst, const void* src) {
#ifdef PZ_STREAMING_STORES
  const __m128i* s = static_cast<const __m128i*>(src);
  __m128i* d = static_cast<__m128i*>(dst);
  __m128i a = _mm_loadu_si128(s), b = _mm_loadu_si128(s + 1), c = _mm_loadu_si128(s + 2),
          e = _mm_loadu_si128(s + 3);
  _mm_stream_si128(d, a);
  _mm_stream_si128(d + 1, b);
  _mm_stream_si128(d + 2, c);
  _mm_stream_si128(d + 3, e);
#else
  std::memcpy(dst, src, kStreamLine);
#endif
}

// Bytes before `p` reaches a line boundary.
inline size_t to_line(const void* p) {
  return (kStreamLine - (reinterpret_cast<uintptr_t>(p) & (kStreamLine - 1))) & (kStreamLine - 1);
}

// memcpy whose whole destination lines are streamed.
inline void copy_streamed(void* dst, const void* src, size_t n) {
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  size_t head = to_line(d) < n ? to_line(d) : n;
  std::memcpy(d, s, head);
  d += head, s += head, n -= head;
  for (; n >= kStreamLine; n -= kStreamLine, d += kStreamLine, s += kStreamLine) stream_line(d, s);
  std::memcpy(d, s, n);
}

// cpu_reduce_final with `dst` streamed (`own` may alias it); `dst2` stays cached.
template <RedOp OP, typename T, typename W>
inline void cpu_reduce_final_streamed(const W* __restrict in, const T* own, T* dst,
                                      T* __restrict dst2, size_t n, int nranks) {
  constexpr size_t L = kStreamLine / sizeof(T);
  size_t head = to_line(dst);
  if (head % sizeof(T)) return cpu_reduce_final<OP, T, W>(in, own, dst, dst2, n, nranks);  // misaligned elements
  head = head / sizeof(T) < n ? head / sizeof(T) : n;
  cpu_reduce_final<OP, T, W>(in, own, dst, dst2, head, nranks);
  size_t i = head;
  for (; i + L <= n; i += L) {
    alignas(kStreamLine) T v[L];
    for (size_t j = 0; j < L; ++j) v[j] = final_value<OP, T, W>(in[i + j], own[i + j], nranks);
    if (dst2) std::memcpy(dst2 + i, v, kStreamLine);
    stream_line(dst + i, v);
  }
  cpu_reduce_final<OP, T, W>(in + i, own + i, dst + i, dst2 ? dst2 + i : nullptr, n - i, nranks);
}

// cpu_reduce_many for K sources: one pass, the sum in a register.
template <RedOp OP, typename T, int K>
inline void cpu_reduce_k(const T* const* srcs, T* dst, size_t n, int nranks) {
  const T* s[K];
  for (int k = 0; k < K; ++k) s[k] = srcs[k];
  for (size_t i = 0; i < n; ++i) {
    auto acc = to_acc(s[0][i]);
    for (int k = 1; k < K; ++k) acc = combine<OP>(acc, to_acc(s[k][i]));
    dst[i] = from_acc<T>(finish<OP>(acc, nranks));
  }
}

// dst[i] = finish(src[0][i] (+) src[1][i] (+) ... ) in rank order, accumulating
// in Acc<T>; fixed order so every rank produces bitwise identical output.
// Up to 4 sources in one pass (2 sources of 256 KiB in L2: 13.7 us through
// the block of accumulators below, 8.1 us in one pass; AVX2 code is no faster,
// the loop is bound by the cache); more than 4 through the block.
// `dst` may be one of the sources.
template <RedOp OP, typename T>
inline void cpu_reduce_many(const T* const* srcs, int nsrc, T* dst, size_t n, int nranks) {
  switch (nsrc) {
    case 1: return cpu_reduce_k<OP, T, 1>(srcs, dst, n, nranks);
    case 2: return cpu_reduce_k<OP, T, 2>(srcs, dst, n, nranks);
    case 3: return cpu_reduce_k<OP, T, 3>(srcs, dst, n, nranks);
    case 4: return cpu_reduce_k<OP, T, 4>(srcs, dst, n, nranks);
    default: break;
  }
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
