// cpu_optim.cpp — runtime ISA dispatch, threading and the three vector types
// the loops of cpu_optim.inc are instantiated with.
//
// Contraction stays off for this file: GCC implements _mm*_mul_ps/_add_ps as
// plain vector arithmetic and would otherwise fuse a*b + c into one FMA, which
// rounds differently from torch; every FMA here is written out (V::fma).
#if defined(__clang__)
#pragma STDC FP_CONTRACT OFF
#else
#pragma GCC optimize("fp-contract=off")
#endif

#include "cpu_optim.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include <dlfcn.h>
#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <exception>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>

namespace pz {

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::scalar: return "scalar";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
    case Isa::best: return "best";
  }
  return "?";
}

Isa best_isa() {
#if defined(__x86_64__)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::avx512;
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c"))
    return Isa::avx2;
#endif
  return Isa::scalar;
}

// ----------------------------------------------------------------------------
// Portable path: one float at a time; also does every vector loop's tail.
namespace isa_scalar {
struct V {
  static constexpr int W = 1;
  using T = float;
  static T load(const float* p) { return *p; }
  static void store(float* p, T x) { *p = x; }
  static T set1(float x) { return x; }
  static T add(T a, T b) { return a + b; }
  static T sub(T a, T b) { return a - b; }
  static T mul(T a, T b) { return a * b; }
  static T div(T a, T b) { return a / b; }
  static T div_by(T a, T b, T) { return a / b; }
  static T fma(T a, T b, T c) { return std::fma(a, b, c); }
  static T sqrt(T a) { return std::sqrt(a); }
  static T max(T a, T b) { return a > b ? a : b; }  // as _mm*_max_ps
  static T neg(T a) { return -a; }
  static void store_f16(half_t* p, T x) { *p = float_to_half(x); }
  static void store_bf16(bf16_t* p, T x) { *p = float_to_bf16(x); }
  static T load_bf16(const bf16_t* p) { return bf16_to_float(*p); }
  static void store_copy(float* p, T x) { *p = x; }
};
#include "cpu_optim.inc"
}  // namespace isa_scalar

#if defined(__x86_64__)
// ----------------------------------------------------------------------------
// AVX2 + FMA + F16C: 8 lanes.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx2,fma,f16c"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#endif
namespace isa_avx2 {
struct V {
  static constexpr int W = 8;
  using T = __m256;
  static T load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, T x) { _mm256_storeu_ps(p, x); }
  static T set1(float x) { return _mm256_set1_ps(x); }
  static T add(T a, T b) { return _mm256_add_ps(a, b); }
  static T sub(T a, T b) { return _mm256_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm256_mul_ps(a, b); }
  static T div(T a, T b) { return _mm256_div_ps(a, b); }
  static T div_by(T a, T b, T rb) {  // see div_by in the .inc
    const T q = _mm256_mul_ps(a, rb);
    const T q2 = _mm256_fmadd_ps(_mm256_fnmadd_ps(q, b, a), rb, q);
    const T inf = _mm256_cmp_ps(_mm256_andnot_ps(_mm256_set1_ps(-0.0f), q), _mm256_set1_ps(INFINITY), _CMP_EQ_OQ);
    return _mm256_blendv_ps(q2, q, inf);
  }
  static T fma(T a, T b, T c) { return _mm256_fmadd_ps(a, b, c); }
  static T sqrt(T a) { return _mm256_sqrt_ps(a); }
  static T max(T a, T b) { return _mm256_max_ps(b, a); }  // a > b ? a : b
  static T neg(T a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  static void store_f16(half_t* p, T x) { put128(p, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }
  static T load_bf16(const bf16_t* p) {
    const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store_copy(float* p, T x) {
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) _mm256_stream_ps(p, x);
    else _mm256_storeu_ps(p, x);
  }
  static void put128(void* p, __m128i x) {  // 8 halves: streamed where aligned (see store_copy in the .inc)
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) _mm_stream_si128(static_cast<__m128i*>(p), x);
    else _mm_storeu_si128(static_cast<__m128i*>(p), x);
  }
  // Round to nearest even as float_to_bf16; NaN keeps its sign and becomes quiet.
  static void store_bf16(bf16_t* p, T x) {
    const __m256i u = _mm256_castps_si256(x);
    const __m256i hi = _mm256_srli_epi32(u, 16);
    const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7fff))), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
    put128(p, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
};
#include "cpu_optim.inc"
}  // namespace isa_avx2
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif

// ----------------------------------------------------------------------------
// AVX-512F: 16 lanes.
#if defined(__clang__)
#pragma clang attribute push(__attribute__((target("avx512f"))), apply_to = function)
#else
#pragma GCC push_options
#pragma GCC target("avx512f")
#endif
namespace isa_avx512 {
struct V {
  static constexpr int W = 16;
  using T = __m512;
  static T load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, T x) { _mm512_storeu_ps(p, x); }
  static T set1(float x) { return _mm512_set1_ps(x); }
  static T add(T a, T b) { return _mm512_add_ps(a, b); }
  static T sub(T a, T b) { return _mm512_sub_ps(a, b); }
  static T mul(T a, T b) { return _mm512_mul_ps(a, b); }
  static T div(T a, T b) { return _mm512_div_ps(a, b); }
  static T div_by(T a, T b, T rb) {  // see div_by in the .inc
    const T q = _mm512_mul_ps(a, rb);
    const T q2 = _mm512_fmadd_ps(_mm512_fnmadd_ps(q, b, a), rb, q);
    // q where q is +-inf (q2 is NaN there), else q2: one fixup instead of abs, compare and blend.
    // Token per class of q: 4 (-inf) and 5 (+inf) answer 1 (q); the others 0 (q2).
    return _mm512_fixupimm_ps(q2, q, _mm512_set1_epi32(0x00110000), 0);
  }
  static T fma(T a, T b, T c) { return _mm512_fmadd_ps(a, b, c); }
  static T sqrt(T a) { return _mm512_sqrt_ps(a); }
  static T max(T a, T b) { return _mm512_max_ps(b, a); }  // a > b ? a : b
  static T neg(T a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(int(0x80000000u))));
  }
  static void store_f16(half_t* p, T x) { put256(p, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT)); }
  static T load_bf16(const bf16_t* p) {
    const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void store_bf16(bf16_t* p, T x) {
    const __m512i u = _mm512_castps_si512(x);
    const __m512i hi = _mm512_srli_epi32(u, 16);
    const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
    put256(p, _mm512_cvtepi32_epi16(r));
  }
  static void store_copy(float* p, T x) {
    if ((reinterpret_cast<uintptr_t>(p) & 63) == 0) _mm512_stream_ps(p, x);
    else _mm512_storeu_ps(p, x);
  }
  static void put256(void* p, __m256i x) {  // 16 halves: streamed where aligned (see store_copy in the .inc)
    if ((reinterpret_cast<uintptr_t>(p) & 31) == 0) _mm256_stream_si256(static_cast<__m256i*>(p), x);
    else _mm256_storeu_si256(static_cast<__m256i*>(p), x);
  }
};
#include "cpu_optim.inc"
}  // namespace isa_avx512
#if defined(__clang__)
#pragma clang attribute pop
#else
#pragma GCC pop_options
#endif
#endif  // __x86_64__

// ----------------------------------------------------------------------------
// Dispatch and threads

namespace {

// Elements per chunk boundary: a multiple of every vector width and of a cache line.
constexpr int64_t kAlign = 64;

template <typename Scalars>
using LoopFn = int64_t (*)(const OptimSlot&, int64_t, int64_t, const Scalars&, DType);

// Runs elements [begin, end) of one slot: the vector loop, then the scalar tail.
template <typename Scalars>
void run_range(LoopFn<Scalars> vec, LoopFn<Scalars> scalar, const OptimSlot& t, int64_t begin, int64_t end,
               const Scalars& s, DType copy_dtype) {
  const int64_t done = vec(t, begin, end, s, copy_dtype);
#if defined(__x86_64__)
  _mm_sfence();  // the streaming stores (copies, bf16 moments), ordered before the step returns
#endif
  if (begin + done < end) scalar(t, begin + done, end, s, copy_dtype);
}

void check(const std::vector<OptimSlot>& slots, DType copy_dtype, int threads, bool needs0, bool needs1,
           bool needs2, const char* what) {
  if (copy_dtype != DType::f32 && copy_dtype != DType::f16 && copy_dtype != DType::bf16)
    throw std::invalid_argument(std::string(what) + ": copy dtype must be float32, float16 or bfloat16, got " +
                                dtype_name(copy_dtype));
  if (threads < 1) throw std::invalid_argument(std::string(what) + ": threads must be >= 1");
  for (size_t k = 0; k < slots.size(); ++k) {
    const OptimSlot& t = slots[k];
    if (t.n < 0) throw std::invalid_argument(std::string(what) + ": slot " + std::to_string(k) + " has n < 0");
    if (t.n == 0) continue;
    if (!t.p || !t.g || (needs0 && !t.state0) || (needs1 && !t.state1) || (needs2 && !t.state2))
      throw std::invalid_argument(std::string(what) + ": slot " + std::to_string(k) + " has a null pointer");
  }
}

// The OpenMP runtime already in the process (torch's libgomp; an LLVM or
// Intel runtime exports the same GOMP entry points), found at run time so
// that _C links against none. A step's pieces run on that runtime's thread
// team, the threads torch's own CPU kernels use: after a torch op they are
// awake (OpenMP workers spin a while before sleeping) and take a piece at
// once, where a thread of our own would first be created, then compete with
// them for the cores. Without a runtime, or in a child forked from this
// process (an OpenMP team does not survive fork: the child's runtime would
// wait for threads that are not there), the pieces run on std::threads.
struct OmpRuntime {
  void (*parallel)(void (*)(void*), void*, unsigned, unsigned) = nullptr;  // GOMP_parallel
  int (*thread_num)() = nullptr;                                           // omp_get_thread_num
  int (*num_threads)() = nullptr;                                          // omp_get_num_threads
};

// Set in every child forked after _C was loaded, whoever started an OpenMP team before the fork.
std::atomic<bool> g_forked{false};
[[maybe_unused]] const int g_atfork =
    pthread_atfork(nullptr, nullptr, [] { g_forked.store(true, std::memory_order_relaxed); });

const OmpRuntime* omp_runtime() {
  static const OmpRuntime rt = [] {
    OmpRuntime r;
    for (const char* name : {"libgomp.so.1", "libiomp5.so", "libomp.so", "libomp.so.5"}) {
      void* h = dlopen(name, RTLD_NOW | RTLD_NOLOAD);  // only one already loaded; never loads one
      if (!h) continue;
      r.parallel = reinterpret_cast<decltype(r.parallel)>(dlsym(h, "GOMP_parallel"));
      r.thread_num = reinterpret_cast<decltype(r.thread_num)>(dlsym(h, "omp_get_thread_num"));
      r.num_threads = reinterpret_cast<decltype(r.num_threads)>(dlsym(h, "omp_get_num_threads"));
      if (r.parallel && r.thread_num && r.num_threads) return r;
      r = OmpRuntime{};
    }
    return r;
  }();
  if (!rt.parallel || g_forked.load(std::memory_order_relaxed)) return nullptr;
  return &rt;
}

}  // namespace

const char* threading_name() { return omp_runtime() ? "openmp" : "threads"; }

namespace {

// Runs piece(0..pieces-1) on pieces threads, the calling thread among them;
// the first exception of any piece is rethrown.
template <typename F>
void run_pieces(int pieces, const F& piece) {
  std::vector<std::exception_ptr> errors(pieces);
  auto guarded = [&](int j) {
    try {
      piece(j);
    } catch (...) {
      errors[j] = std::current_exception();
    }
  };
  if (const OmpRuntime* omp = omp_runtime()) {
    struct Ctx {
      const OmpRuntime* omp;
      decltype(guarded)* run;
      int pieces;
    } ctx{omp, &guarded, pieces};
    // The team may be smaller than asked (nested regions, OMP_THREAD_LIMIT):
    // its members then take the pieces round-robin.
    omp->parallel(
        [](void* data) {
          const Ctx& c = *static_cast<const Ctx*>(data);
          const int team = std::max(1, c.omp->num_threads());
          for (int j = c.omp->thread_num(); j < c.pieces; j += team) (*c.run)(j);
        },
        &ctx, unsigned(pieces), 0);
  } else {
    std::vector<std::thread> pool;
    pool.reserve(pieces - 1);
    for (int j = 0; j < pieces - 1; ++j) pool.emplace_back(guarded, j);
    guarded(pieces - 1);
    for (auto& th : pool) th.join();
  }
  for (auto& e : errors)
    if (e) std::rethrow_exception(e);
}

// Splits the elements of all slots into `threads` contiguous pieces of about
// equal size (cut at kAlign boundaries) and runs them (run_pieces).
template <typename Scalars>
void run_all(const std::vector<OptimSlot>& slots, const Scalars& s, DType copy_dtype, int threads, Isa isa,
             LoopFn<Scalars> scalar, LoopFn<Scalars> avx2, LoopFn<Scalars> avx512) {
  if (isa == Isa::best) isa = best_isa();
  if (isa != Isa::scalar && isa != Isa::avx2 && isa != Isa::avx512)
    throw std::invalid_argument("cpu optimizer: unknown isa code");
  if (isa > best_isa())
    throw std::invalid_argument(std::string("cpu optimizer: isa ") + isa_name(isa) + " is not supported by this CPU");
  LoopFn<Scalars> vec = isa == Isa::avx512 ? avx512 : isa == Isa::avx2 ? avx2 : scalar;

  int64_t total = 0;
  for (const OptimSlot& t : slots) total += t.n;
  const int64_t min_per_thread = 1 << 15;  // below this a thread costs more than it saves
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, total / min_per_thread)));
  const int64_t per = (total + threads - 1) / threads;

  // Piece j covers global elements [j*per, (j+1)*per), rounded down to kAlign.
  auto piece = [&](int j) {
    int64_t lo = std::min(total, int64_t(j) * per), hi = std::min(total, int64_t(j + 1) * per);
    lo = j == 0 ? 0 : lo / kAlign * kAlign;
    hi = j == threads - 1 ? total : hi / kAlign * kAlign;
    int64_t base = 0;
    for (const OptimSlot& t : slots) {
      const int64_t b = std::max(lo, base), e = std::min(hi, base + t.n);
      if (b < e) run_range<Scalars>(vec, scalar, t, b - base, e - base, s, copy_dtype);
      base += t.n;
      if (base >= hi) break;
    }
  };
  if (threads == 1) {
    piece(0);
    return;
  }
  run_pieces(threads, piece);
}

}  // namespace

void adam_step(const std::vector<OptimSlot>& slots, const AdamScalars& s, DType copy_dtype, int threads, Isa isa) {
  check(slots, copy_dtype, threads, true, true, s.amsgrad, "adam_step");
  if (s.amsgrad && s.bf16_moments) throw std::invalid_argument("adam_step: amsgrad needs fp32 moments");
#if defined(__x86_64__)
  run_all<AdamScalars>(slots, s, copy_dtype, threads, isa, isa_scalar::adam_loop, isa_avx2::adam_loop,
                       isa_avx512::adam_loop);
#else
  run_all<AdamScalars>(slots, s, copy_dtype, threads, isa, isa_scalar::adam_loop, isa_scalar::adam_loop,
                       isa_scalar::adam_loop);
#endif
}

namespace {

// Round to nearest even for 0 <= x < 2^22 (adding and subtracting 1.5 * 2^23 rounds once).
inline float round_small(float x) { return (x + 12582912.0f) - 12582912.0f; }

// Blocks [b0, b1) of one 8-bit slot (see adam_step_q8 in the header). The step is the vector
// loop's; decoding and encoding are scalar loops (cbrt), most of an 8-bit step's time.
void q8_blocks(const Q8Slot& t, int64_t b0, int64_t b1, const AdamScalars& s, DType copy_dtype,
               LoopFn<AdamScalars> vec, LoopFn<AdamScalars> scalar) {
  alignas(64) float mb[kQ8Block], vb[kQ8Block];
  const int64_t csz = copy_dtype == DType::f32 ? 4 : 2;
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t lo = b * kQ8Block, len = std::min(kQ8Block, t.n - lo);
    const float am = t.m_absmax[b], av = t.v_absmax[b];
    for (int64_t j = 0; j < len; ++j) {  // (c / levels: exactly 1 at the block's largest value)
      const float x = float(t.m[lo + j]) / 127.0f, y = float(t.v[lo + j]) / 255.0f;
      const float y2 = y * y;
      mb[j] = x * (x * x) * am;
      vb[j] = y2 * y2 * av;
    }
    OptimSlot o{t.p + lo, t.g + lo, mb, vb, nullptr,
                t.copy ? static_cast<void*>(static_cast<char*>(t.copy) + lo * csz) : nullptr, len};
    run_range<AdamScalars>(vec, scalar, o, 0, len, s, copy_dtype);
    float mmax = 0.0f, vmax = 0.0f;
    for (int64_t j = 0; j < len; ++j) {
      mmax = std::max(mmax, std::fabs(mb[j]));
      vmax = std::max(vmax, vb[j]);
    }
    t.m_absmax[b] = mmax;
    t.v_absmax[b] = vmax;
    // levels^k / absmax: the root of x times it is levels * (x / absmax)^(1/k). Below an absmax of
    // about 1e-32 that scale overflows (0 * inf is NaN): such a block divides by its absmax first.
    const float ms = mmax > 0.0f ? 2048383.0f / mmax : 0.0f;       // 127^3
    const float vs = vmax > 0.0f ? 4228250625.0f / vmax : 0.0f;    // 255^4
    const bool mtiny = !std::isfinite(ms), vtiny = !std::isfinite(vs);
    for (int64_t j = 0; j < len; ++j) {
      const float xm = mtiny ? std::fabs(mb[j]) / mmax * 2048383.0f : std::fabs(mb[j]) * ms;
      const float xv = vtiny ? vb[j] / vmax * 4228250625.0f : vb[j] * vs;
      const float cm = std::min(127.0f, round_small(std::cbrt(xm)));
      t.m[lo + j] = int8_t(mb[j] < 0.0f ? -cm : cm);
      float cv = std::min(255.0f, round_small(__builtin_sqrtf(__builtin_sqrtf(xv))));
      cv = vb[j] > 0.0f && cv < 1.0f ? 1.0f : cv;  // a positive v keeps a positive code
      t.v[lo + j] = uint8_t(cv);
    }
  }
}

}  // namespace

void adam_step_q8(const std::vector<Q8Slot>& slots, const AdamScalars& s, DType copy_dtype, int threads, Isa isa) {
  if (copy_dtype != DType::f32 && copy_dtype != DType::f16 && copy_dtype != DType::bf16)
    throw std::invalid_argument("adam_step_q8: copy dtype must be float32, float16 or bfloat16");
  if (threads < 1) throw std::invalid_argument("adam_step_q8: threads must be >= 1");
  if (s.amsgrad || s.bf16_moments) throw std::invalid_argument("adam_step_q8: amsgrad and bf16_moments must be off");
  for (size_t k = 0; k < slots.size(); ++k) {
    const Q8Slot& t = slots[k];
    if (t.n < 0) throw std::invalid_argument("adam_step_q8: slot " + std::to_string(k) + " has n < 0");
    if (t.n && (!t.p || !t.g || !t.m || !t.m_absmax || !t.v || !t.v_absmax))
      throw std::invalid_argument("adam_step_q8: slot " + std::to_string(k) + " has a null pointer");
  }
  if (isa == Isa::best) isa = best_isa();
  if (isa != Isa::scalar && isa != Isa::avx2 && isa != Isa::avx512)
    throw std::invalid_argument("cpu optimizer: unknown isa code");
  if (isa > best_isa())
    throw std::invalid_argument(std::string("cpu optimizer: isa ") + isa_name(isa) + " is not supported by this CPU");
#if defined(__x86_64__)
  LoopFn<AdamScalars> vec = isa == Isa::avx512 ? isa_avx512::adam_loop
                            : isa == Isa::avx2 ? isa_avx2::adam_loop : isa_scalar::adam_loop;
#else
  LoopFn<AdamScalars> vec = isa_scalar::adam_loop;
#endif
  std::vector<int64_t> first(slots.size() + 1, 0);  // global index of each slot's first block
  for (size_t k = 0; k < slots.size(); ++k) first[k + 1] = first[k] + (slots[k].n + kQ8Block - 1) / kQ8Block;
  const int64_t total = first.back();
  const int64_t min_blocks = (int64_t(1) << 15) / kQ8Block;  // as run_all: 32K elements a thread at least
  threads = int(std::max<int64_t>(1, std::min<int64_t>(threads, total / min_blocks)));
  const int64_t per = (total + threads - 1) / threads;
  auto piece = [&](int j) {
    const int64_t lo = std::min(total, int64_t(j) * per), hi = std::min(total, int64_t(j + 1) * per);
    for (size_t k = 0; k < slots.size(); ++k) {
      const int64_t b0 = std::max(lo, first[k]), b1 = std::min(hi, first[k + 1]);
      if (b0 < b1) q8_blocks(slots[k], b0 - first[k], b1 - first[k], s, copy_dtype, vec, isa_scalar::adam_loop);
    }
  };
  if (threads == 1) {
    piece(0);
    return;
  }
  run_pieces(threads, piece);
}

void sgd_step(const std::vector<OptimSlot>& slots, const SgdScalars& s, DType copy_dtype, int threads, Isa isa) {
  check(slots, copy_dtype, threads, s.momentum != 0.0f, false, false, "sgd_step");
#if defined(__x86_64__)
  run_all<SgdScalars>(slots, s, copy_dtype, threads, isa, isa_scalar::sgd_loop, isa_avx2::sgd_loop,
                      isa_avx512::sgd_loop);
#else
  run_all<SgdScalars>(slots, s, copy_dtype, threads, isa, isa_scalar::sgd_loop, isa_scalar::sgd_loop,
                      isa_scalar::sgd_loop);
#endif
}

void adagrad_step(const std::vector<OptimSlot>& slots, const AdagradScalars& s, DType copy_dtype, int threads,
                  Isa isa) {
  check(slots, copy_dtype, threads, true, false, false, "adagrad_step");
#if defined(__x86_64__)
  run_all<AdagradScalars>(slots, s, copy_dtype, threads, isa, isa_scalar::adagrad_loop, isa_avx2::adagrad_loop,
                          isa_avx512::adagrad_loop);
#else
  run_all<AdagradScalars>(slots, s, copy_dtype, threads, isa, isa_scalar::adagrad_loop, isa_scalar::adagrad_loop,
                          isa_scalar::adagrad_loop);
#endif
}

}  // namespace pz
