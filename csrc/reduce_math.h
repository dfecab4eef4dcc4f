// reduce_math.h — dtypes, reduction ops and the element math shared by the CPU
// loops and the CUDA kernels.
//
// Every function here is __host__ __device__ so the shm transport (plain C++)
// and the CUDA kernels (nvcc) compute bit-identical results. fp16/bf16 are
// widened to fp32 for the arithmetic ("accumulator type") and rounded once,
// round-to-nearest-even, when stored. The conversions are written out in
// integer arithmetic so the host build needs no CUDA headers.
#pragma once

#include <cstdint>
#include <cstring>
#include <type_traits>

#if defined(__CUDACC__)
#define PZ_HD __host__ __device__ __forceinline__
#else
#define PZ_HD inline
#endif

namespace pz {

// ----------------------------------------------------------------------------
// Enums (the Python layer uses the same integer codes)

enum class DType : int32_t { f32 = 0, f16 = 1, bf16 = 2, f64 = 3, i32 = 4, i64 = 5 };
enum class RedOp : int32_t { sum = 0, avg = 1, max = 2, min = 3, prod = 4 };

constexpr int kNumDTypes = 6;
constexpr int kNumRedOps = 5;

inline const char* dtype_name(DType d) {
  switch (d) {
    case DType::f32: return "float32";
    case DType::f16: return "float16";
    case DType::bf16: return "bfloat16";
    case DType::f64: return "float64";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
  }
  return "unknown";
}

inline const char* op_name(RedOp o) {
  switch (o) {
    case RedOp::sum: return "sum";
    case RedOp::avg: return "avg";
    case RedOp::max: return "max";
    case RedOp::min: return "min";
    case RedOp::prod: return "prod";
  }
  return "unknown";
}

inline int dtype_size(DType d) {
  switch (d) {
    case DType::f32: case DType::i32: return 4;
    case DType::f16: case DType::bf16: return 2;
    case DType::f64: case DType::i64: return 8;
  }
  return 0;
}

inline bool dtype_is_float(DType d) { return d != DType::i32 && d != DType::i64; }

// ----------------------------------------------------------------------------
// 16-bit float storage types and exact conversions

struct alignas(2) half_t { uint16_t bits; };
struct alignas(2) bf16_t { uint16_t bits; };
static_assert(sizeof(half_t) == 2 && sizeof(bf16_t) == 2, "16-bit storage types");

PZ_HD float bits_to_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f; std::memcpy(&f, &u, 4); return f;
#endif
}

PZ_HD uint32_t float_to_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u; std::memcpy(&u, &f, 4); return u;
#endif
}

PZ_HD float bf16_to_float(bf16_t h) { return bits_to_float(uint32_t(h.bits) << 16); }

PZ_HD bf16_t float_to_bf16(float f) {
  uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return bf16_t{uint16_t((u >> 16) | 0x40)};  // NaN stays NaN
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
  return bf16_t{uint16_t(u >> 16)};
}

PZ_HD float half_to_float(half_t h) {
#if defined(__CUDA_ARCH__)
  // The GPU's conversion is exact for every value but NaN, whose payload the code below keeps: one
  // instruction where the code below costs a dozen, which made the fp16 kernels compute-bound. NaN is
  // chosen by a select, not a branch, so the conversions of a pack interleave.
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.bits));
  const uint32_t nan = (uint32_t(h.bits & 0x8000u) << 16) | 0x7f800000u | (uint32_t(h.bits & 0x3ffu) << 13);
  return (h.bits & 0x7fffu) > 0x7c00u ? bits_to_float(nan) : f;
#else
  uint32_t sign = uint32_t(h.bits & 0x8000u) << 16;
  uint32_t exp = (h.bits >> 10) & 0x1fu;
  uint32_t man = h.bits & 0x3ffu;
  if (exp == 0x1f) return bits_to_float(sign | 0x7f800000u | (man << 13));  // inf / nan
  if (exp == 0) {
    if (man == 0) return bits_to_float(sign);
    // subnormal: value = man * 2^-24, exact in fp32
    float v = float(man) * 5.9604644775390625e-8f;
    return sign ? -v : v;
  }
  return bits_to_float(sign | ((exp + 112u) << 23) | (man << 13));
#endif
}

PZ_HD half_t float_to_half(float f) {
  uint32_t u = float_to_bits(f);
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7fffffffu;
#if defined(__CUDA_ARCH__)
  // Not NaN: the GPU's round to nearest even, as below (subnormals, overflow to inf); NaN as below, by a
  // select (see half_to_float).
  uint16_t r;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(r) : "f"(f));
  return half_t{a > 0x7f800000u ? uint16_t(sign | 0x7e00u) : r};
#else
  if (a > 0x7f800000u) return half_t{uint16_t(sign | 0x7e00u)};          // nan
  if (a >= 0x477ff000u) return half_t{uint16_t(sign | 0x7c00u)};         // overflow -> inf
  if (a < 0x38800000u) {                                                 // subnormal or zero
    // value in units of 2^-24, rounded to nearest even by the fp32 adder
    float v = bits_to_float(a) * 16777216.0f;  // exact scaling
    uint32_t m = uint32_t(v);
    float rem = v - float(m);
    if (rem > 0.5f || (rem == 0.5f && (m & 1u))) ++m;
    return half_t{uint16_t(sign | m)};
  }
  uint32_t r = a + 0xfffu + ((a >> 13) & 1u) - 0x38000000u;  // rebias 127 -> 15, round to nearest even
  return half_t{uint16_t(sign | (r >> 13))};
#endif
}

// ----------------------------------------------------------------------------
// Storage type -> accumulator type

template <typename T> struct Acc { using type = T; };
template <> struct Acc<half_t> { using type = float; };
template <> struct Acc<bf16_t> { using type = float; };

template <typename T> PZ_HD typename Acc<T>::type to_acc(T v) { return v; }
template <> PZ_HD float to_acc<half_t>(half_t v) { return half_to_float(v); }
template <> PZ_HD float to_acc<bf16_t>(bf16_t v) { return bf16_to_float(v); }

template <typename T> PZ_HD T from_acc(typename Acc<T>::type v) { return v; }
template <> PZ_HD half_t from_acc<half_t>(float v) { return float_to_half(v); }
template <> PZ_HD bf16_t from_acc<bf16_t>(float v) { return float_to_bf16(v); }

// ----------------------------------------------------------------------------
// Binary reduction on accumulator values. max/min propagate NaN like torch.

template <typename A> PZ_HD bool is_nan(A v) { return v != v; }

template <RedOp OP, typename A> PZ_HD A combine(A a, A b) {
  if constexpr (OP == RedOp::sum || OP == RedOp::avg) {
    return a + b;
  } else if constexpr (OP == RedOp::prod) {
    return a * b;
  } else if constexpr (OP == RedOp::max) {
    return (is_nan(a) || a > b) ? a : b;
  } else {
    return (is_nan(a) || a < b) ? a : b;
  }
}

// [Note: fp16 operands of an arithmetic op] An operand that reaches combine<OP>'s add or multiply
// (sum, avg, prod) is widened with the GPU's one conversion instruction, without half_to_float's NaN
// select: the GPU's fp32 add and multiply return the canonical NaN (0x7fffffff) whatever NaN they are
// given, so the payload that select keeps never reaches the result, and float_to_half writes every NaN
// result as 0x7e00 either way. The select cost five instructions per element, which kept the fp16 sum
// below a device copy's speed. The first operand of a reduction over one source reaches no add: it
// keeps to_acc. tests/test_kernels_gpu.py checks the NaN bits against the fp32 kernel's.
template <RedOp OP, typename T> PZ_HD typename Acc<T>::type to_acc_operand(T v) {
#if defined(__CUDA_ARCH__)
  if constexpr (std::is_same_v<T, half_t> && OP != RedOp::max && OP != RedOp::min) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v.bits));
    return f;
  }
#endif
  return to_acc(v);
}

// The first of `nsrc` operands of a reduction: an operand of the op where another follows, else stored as
// it is (see the note above).
template <RedOp OP, typename T> PZ_HD typename Acc<T>::type to_acc_first(T v, int nsrc) {
  if constexpr (std::is_same_v<T, half_t> && OP != RedOp::max && OP != RedOp::min)
    return nsrc > 1 ? to_acc_operand<OP>(v) : to_acc(v);
  else
    return to_acc(v);  // (to_acc_operand is to_acc here)
}

// Final step applied once when a fully reduced value is stored: avg divides by
// the number of contributions (floats only; the Python layer rejects avg on ints).
template <RedOp OP, typename A> PZ_HD A finish(A v, int nranks) {
  if constexpr (OP == RedOp::avg) return v / A(nranks);
  else return v;
}

}  // namespace pz

// ----------------------------------------------------------------------------
// Dtype / op dispatch: the one place that maps runtime enums to templates.

#define PZ_DISPATCH_DTYPE(dtype, T, ...)                                          \
  switch (dtype) {                                                                \
    case ::pz::DType::f32: { using T = float; __VA_ARGS__; break; }               \
    case ::pz::DType::f16: { using T = ::pz::half_t; __VA_ARGS__; break; }        \
    case ::pz::DType::bf16: { using T = ::pz::bf16_t; __VA_ARGS__; break; }       \
    case ::pz::DType::f64: { using T = double; __VA_ARGS__; break; }              \
    case ::pz::DType::i32: { using T = int32_t; __VA_ARGS__; break; }             \
    case ::pz::DType::i64: { using T = int64_t; __VA_ARGS__; break; }             \
    default: throw std::invalid_argument(                                         \
        "unsupported dtype code; expected float32, float16, bfloat16, float64, "  \
        "int32 or int64");                                                        \
  }

#define PZ_DISPATCH_OP(op, OP, ...)                                               \
  switch (op) {                                                                   \
    case ::pz::RedOp::sum: { constexpr auto OP = ::pz::RedOp::sum; __VA_ARGS__; break; }   \
    case ::pz::RedOp::avg: { constexpr auto OP = ::pz::RedOp::avg; __VA_ARGS__; break; }   \
    case ::pz::RedOp::max: { constexpr auto OP = ::pz::RedOp::max; __VA_ARGS__; break; }   \
    case ::pz::RedOp::min: { constexpr auto OP = ::pz::RedOp::min; __VA_ARGS__; break; }   \
    case ::pz::RedOp::prod: { constexpr auto OP = ::pz::RedOp::prod; __VA_ARGS__; break; } \
    default: throw std::invalid_argument(                                         \
        "unsupported reduction op; expected sum, avg, max, min or prod");         \
  }

namespace pz {
// Every dtype and op the dispatch above takes (to walk all instantiations: the kernel preloads).
inline constexpr DType kAllDTypes[] = {DType::f32, DType::f16, DType::bf16, DType::f64, DType::i32, DType::i64};
inline constexpr RedOp kAllRedOps[] = {RedOp::sum, RedOp::avg, RedOp::max, RedOp::min, RedOp::prod};
}  // namespace pz
