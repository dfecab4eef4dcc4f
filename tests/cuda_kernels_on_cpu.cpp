// cuda_kernels_on_cpu.cpp — runs the CUDA kernels of csrc/reduce_kernels.cuh on
// the CPU, without a GPU: compiled by g++ against the CUDA headers (where
// __device__/__global__ are plain attributes), with blockIdx/threadIdx/
// blockDim/gridDim redirected to variables, and every (block, thread) of a
// small grid run in turn. Threads of these kernels touch disjoint elements,
// so running them one after another is faithful. Results are compared
// bitwise (any NaN matches any NaN) with the CPU loops of cpu_reduce.h (or plain per-element math from
// reduce_math.h) for every dtype and op, aligned (vectorised) and unaligned
// (scalar) pointers, and sizes that leave vector tails.
// Built and run by tests/test_cuda_host.py::test_cuda_kernel_bodies_on_cpu.
#include <cuda_runtime.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

namespace emu {
uint3 threadIdx, blockIdx;
dim3 blockDim, gridDim;
}  // namespace emu
#define threadIdx emu::threadIdx
#define blockIdx emu::blockIdx
#define blockDim emu::blockDim
#define gridDim emu::gridDim

#include "cpu_reduce.h"
#include "reduce_kernels.cuh"

using namespace pz;
using namespace pz::cuda;

namespace {

int failures = 0, cases = 0;

// The launch of kernels.cu's launch_map, emulated: grid-stride over a small grid.
template <int VEC, typename Fn>
void launch(const Fn& fn, int64_t n, bool vectorized, int blocks, int threads) {
  gridDim = dim3(blocks);
  blockDim = dim3(threads);
  for (int b = 0; b < blocks; ++b)
    for (int t = 0; t < threads; ++t) {
      blockIdx = make_uint3(b, 0, 0);
      threadIdx = make_uint3(t, 0, 0);
      map_kernel<VEC>(fn, n, vectorized);
    }
}

bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

template <typename T>
void fill(T* p, size_t n, std::mt19937_64& g, bool small) {
  for (size_t i = 0; i < n; ++i) {
    if constexpr (std::is_same_v<T, half_t> || std::is_same_v<T, bf16_t>) {
      p[i].bits = uint16_t(g());  // any bit pattern: NaN, inf, subnormals
      if (small) p[i] = from_acc<T>(float(int(g() % 7) - 3) * 0.5f);
    } else if constexpr (std::is_floating_point_v<T>) {
      p[i] = small ? T(int(g() % 7) - 3) * T(0.5) : T(int64_t(g() % 20001) - 10000) / T(64);
    } else {
      p[i] = small ? T(int(g() % 5) - 2) : T(int64_t(g() % 2001) - 1000);
    }
  }
}

// Bitwise, except that any two NaNs match: the sign and payload of a NaN made
// by inf + -inf, or by combining two NaNs, depend on the hardware and on the
// operand order the compiler picks (x86's default NaN is negative, a GPU's
// positive), and nothing promises them.
template <typename T>
bool same(const T& a, const T& b) {
  if (std::memcmp(&a, &b, sizeof(T)) == 0) return true;
  if constexpr (std::is_integral_v<T>) return false;
  else return is_nan(to_acc(a)) && is_nan(to_acc(b));
}

template <typename T>
void expect_same(const T* got, const T* want, size_t n, const std::string& what) {
  ++cases;
  size_t i = 0;
  while (i < n && same(got[i], want[i])) ++i;
  if (i == n) return;
  if (failures++ < 20) {
    uint64_t gb = 0, wb = 0;
    std::memcpy(&gb, got + i, sizeof(T));
    std::memcpy(&wb, want + i, sizeof(T));
    std::printf("MISMATCH %s at element %zu of %zu: got bits %llx, want %llx\n", what.c_str(), i, n,
                (unsigned long long)gb, (unsigned long long)wb);
  }
}

// A buffer of n elements starting `offset` elements past a 16-byte boundary.
template <typename T>
struct Buf {
  std::vector<unsigned char> mem;
  T* p;
  Buf(size_t n, size_t offset) : mem((n + offset) * sizeof(T) + 64) {
    auto base = (reinterpret_cast<uintptr_t>(mem.data()) + 15) & ~uintptr_t(15);
    p = reinterpret_cast<T*>(base) + offset;
  }
};

template <typename T, RedOp OP>
void check_op(const char* dname, size_t n, size_t offset, int blocks, int threads, std::mt19937_64& g) {
  using W = typename Acc<T>::type;
  constexpr int VEC = vec_elems<T>();
  bool small = OP == RedOp::prod;
  std::string tag = std::string(dname) + " op=" + op_name(OP) + " n=" + std::to_string(n) + " offset=" +
                    std::to_string(offset) + " grid=" + std::to_string(blocks) + "x" + std::to_string(threads);
  Buf<T> a(n, offset), b(n, offset), out(n, offset), want(n, offset);
  Buf<W> wa(n, offset), wout(n, offset), wwant(n, offset);
  fill(a.p, n, g, small);
  fill(b.p, n, g, small);
  for (size_t i = 0; i < n; ++i) wa.p[i] = W(to_acc(a.p[i])) * W(1.25);  // wire partials
  bool vec = aligned16(a.p) && aligned16(b.p) && aligned16(out.p);
  const int nranks = 3;

  // reduce2 (launch_reduce2): out = finish(a (+) b) in T
  launch<VEC>(Reduce2Fn<OP, true, T, T, T>{a.p, b.p, out.p, nranks}, int64_t(n), vec, blocks, threads);
  for (size_t i = 0; i < n; ++i)
    want.p[i] = from_acc<T>(finish<OP>(combine<OP>(to_acc(a.p[i]), to_acc(b.p[i])), nranks));
  expect_same(out.p, want.p, n, "reduce2 " + tag);

  // in place: out aliases a
  std::memcpy(out.p, a.p, n * sizeof(T));
  launch<VEC>(Reduce2Fn<OP, true, T, T, T>{out.p, b.p, out.p, nranks}, int64_t(n), vec, blocks, threads);
  expect_same(out.p, want.p, n, "reduce2 in place " + tag);

  // reduce_wire (launch_reduce_wire): W partial (+) T own -> W
  launch<VEC>(Reduce2Fn<OP, false, W, T, W>{wa.p, b.p, wout.p, 1}, int64_t(n), vec, blocks, threads);
  cpu_reduce_send<OP, T, W>(wa.p, b.p, wwant.p, n);
  expect_same(wout.p, wwant.p, n, "reduce_wire " + tag);

  // reduce_wire_final (launch_reduce_wire_final): finish(W (+) T) -> T, own aliasing dst
  std::memcpy(out.p, b.p, n * sizeof(T));
  launch<VEC>(Reduce2Fn<OP, true, W, T, T>{wa.p, out.p, out.p, nranks}, int64_t(n), vec, blocks, threads);
  cpu_reduce_final<OP, T, W>(wa.p, b.p, want.p, nullptr, n, nranks);
  expect_same(out.p, want.p, n, "reduce_wire_final " + tag);

  // reduce_many (launch_reduce_many): 1, 3 and 16 sources in order, out aliasing source 0
  for (int nsrc : {1, 3, kMaxReduceSources}) {
    std::vector<Buf<T>> srcs;
    for (int s = 0; s < nsrc; ++s) {
      srcs.emplace_back(n, offset);
      fill(srcs.back().p, n, g, true);
    }
    ReduceManyFn<OP, T> fn{};
    std::vector<const T*> ptrs(nsrc);
    for (int s = 0; s < nsrc; ++s) fn.src.p[s] = ptrs[s] = srcs[s].p;
    fn.nsrc = nsrc;
    fn.out = out.p;
    fn.nranks = nsrc;
    launch<VEC>(fn, int64_t(n), vec, blocks, threads);
    cpu_reduce_many<OP, T>(ptrs.data(), nsrc, want.p, n, nsrc);
    expect_same(out.p, want.p, n, "reduce_many nsrc=" + std::to_string(nsrc) + " " + tag);
    fn.out = srcs[0].p;
    launch<VEC>(fn, int64_t(n), vec, blocks, threads);
    expect_same(srcs[0].p, want.p, n, "reduce_many in place nsrc=" + std::to_string(nsrc) + " " + tag);
  }
}

template <typename T>
void check_dtype(const char* dname) {
  using W = typename Acc<T>::type;
  constexpr int VEC = vec_elems<T>();
  std::mt19937_64 g(12345);
  for (size_t n : {size_t(1), size_t(7), size_t(VEC), size_t(4099), size_t(20011)})
    for (size_t offset : {size_t(0), size_t(1), size_t(16 / sizeof(T))})
      for (auto [blocks, threads] : {std::pair{1, 32}, std::pair{3, 64}}) {
        std::string tag = std::string(dname) + " n=" + std::to_string(n) + " offset=" + std::to_string(offset);
        Buf<T> src(n, offset), dst(n, offset);
        Buf<W> wire(n, offset), wwant(n, offset);
        fill(src.p, n, g, false);
        bool vec = aligned16(src.p) && aligned16(dst.p);
        launch<VEC>(ConvertFn<T, T>{src.p, dst.p}, int64_t(n), vec, blocks, threads);
        expect_same(dst.p, src.p, n, "copy " + tag);
        launch<VEC>(ConvertFn<T, W>{src.p, wire.p}, int64_t(n), vec, blocks, threads);
        cpu_pack<T, W>(src.p, wwant.p, n);
        expect_same(wire.p, wwant.p, n, "pack_wire " + tag);
        check_op<T, RedOp::sum>(dname, n, offset, blocks, threads, g);
        check_op<T, RedOp::max>(dname, n, offset, blocks, threads, g);
        check_op<T, RedOp::min>(dname, n, offset, blocks, threads, g);
        check_op<T, RedOp::prod>(dname, n, offset, blocks, threads, g);
        if constexpr (!std::is_integral_v<T>) check_op<T, RedOp::avg>(dname, n, offset, blocks, threads, g);
      }
}

}  // namespace

int main() {
  check_dtype<float>("float32");
  check_dtype<half_t>("float16");
  check_dtype<bf16_t>("bfloat16");
  check_dtype<double>("float64");
  check_dtype<int32_t>("int32");
  check_dtype<int64_t>("int64");
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
