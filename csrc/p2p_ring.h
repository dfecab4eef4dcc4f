// p2p_ring.h — the ring of ring.h over message passing: every primitive
// becomes grouped send/receive calls between ring neighbours plus element-wise
// kernels, issued in order on one stream. The NCCL transport runs it with an
// Exec that calls ncclSend/ncclRecv and the CUDA launchers, the ipc transport
// (algo="ring") with one that launches a point-to-point kernel per group
// (ipc_p2p.h; tests/ipc_p2p_on_cpu.cpp runs it on CPU threads); PlanExec records
// the same sequence as data, so the schedule is tested without a GPU
// (pyzero._C.p2p_ring_plan, tests/test_cuda_host.py).
//
// An Exec provides, in the order a rank issues them:
//   group(const void* send, size_t send_bytes, void* recv, size_t recv_bytes)
//        one group: the send to the successor and/or the receive from the
//        predecessor (a null pointer: none)
//   copy(const void* src, void* dst, int64_t n)                 T -> T
//   pack(const void* src, void* dst, int64_t n)                 T -> W
//   reduce(const void* in, const void* own, void* out, int64_t n)        W (+) T -> W
//   reduce_final(const void* in, const void* own, void* dst, int64_t n)  finish(W (+) T) -> T
// with W the wire type of the reduce-scatter phase (fp32 for fp16/bf16, so a
// value is rounded once, when it is final, exactly like the shm ring).
// Staging: one send and one receive buffer of `per_slice` W elements, owned by
// the transport. Kernels and groups run in stream order, so one of each is
// enough: a buffer is rewritten only after the group that used it finished.
//
// [Note: pairing sends with receives]
// A send may complete only once its receiver has posted the matching receive,
// and every rank of a ring starts with a send: issuing each message alone
// deadlocks the ring. So a send is held back and issued in one group with the
// rank's next receive: group k = {send k to r+1, receive k from r-1}, and
// every group's partners sit at the same place in the neighbours' sequences.
// That needs the message sequence S (R S)* R, which ring.h produces when each
// primitive carries at most one message per round: round_elems = per_slice.
// A primitive of zero elements drops its messages on both ends of every link
// (both sides know the counts), which keeps the alternation. Only the
// broadcast chain sends twice in a row; a chain has no cycle, so the held send
// is then issued alone.
#pragma once

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "collective.h"
#include "reduce_math.h"
#include "ring.h"

namespace pz {

template <typename T, typename W, typename Exec>
struct P2PRingPrims {
  Exec& x;
  W* send_stage;
  W* recv_stage;
  int64_t per_slice;  // elements per message (W elements fit the staging)
  const void* held = nullptr;
  size_t held_bytes = 0;
  uint64_t sent_bytes = 0;

  int64_t round_elems() const { return per_slice; }

  // see [Note: pairing sends with receives]
  void issue(void* recv, size_t recv_bytes) {
    x.group(held, held_bytes, recv, recv_bytes);
    sent_bytes += held_bytes;
    held = nullptr;
    held_bytes = 0;
  }
  void send(const void* p, size_t bytes) {
    if (held) issue(nullptr, 0);
    held = p;
    held_bytes = bytes;
  }
  void recv(void* p, size_t bytes) { issue(p, bytes); }
  void flush() {
    if (held) issue(nullptr, 0);
  }
  // The send stage is about to be rewritten: a held send from it goes first.
  W* claim_send_stage() {
    if (held == send_stage) issue(nullptr, 0);
    return send_stage;
  }

  template <typename F> void slices(int64_t cnt, F f) {
    for (int64_t o = 0; o < cnt; o += per_slice) f(o, std::min(per_slice, cnt - o));
  }

  void send_rs(const T* own, int64_t cnt) {
    slices(cnt, [&](int64_t o, int64_t m) {
      if constexpr (std::is_same_v<T, W>) {
        send(own + o, size_t(m) * sizeof(W));
      } else {
        W* s = claim_send_stage();
        x.pack(own + o, s, m);
        send(s, size_t(m) * sizeof(W));
      }
    });
  }
  void recv_reduce_send(const T* own, int64_t cnt) {
    slices(cnt, [&](int64_t o, int64_t m) {
      recv(recv_stage, size_t(m) * sizeof(W));
      W* s = claim_send_stage();
      x.reduce(recv_stage, own + o, s, m);
      send(s, size_t(m) * sizeof(W));
    });
  }
  void recv_reduce_final(const T* own, T* dst, bool forward, int64_t cnt) {
    slices(cnt, [&](int64_t o, int64_t m) {
      recv(recv_stage, size_t(m) * sizeof(W));
      x.reduce_final(recv_stage, own + o, dst + o, m);
      if (forward) send(dst + o, size_t(m) * sizeof(T));
    });
  }
  void send_ag(const T* src, int64_t cnt) {
    slices(cnt, [&](int64_t o, int64_t m) { send(src + o, size_t(m) * sizeof(T)); });
  }
  void recv_copy_send(T* dst, int64_t cnt) {
    slices(cnt, [&](int64_t o, int64_t m) {
      recv(dst + o, size_t(m) * sizeof(T));
      send(dst + o, size_t(m) * sizeof(T));
    });
  }
  void recv_ag(T* dst, int64_t cnt) {
    slices(cnt, [&](int64_t o, int64_t m) { recv(dst + o, size_t(m) * sizeof(T)); });
  }
};

// One collective's ring schedule on `x` (n >= 2); returns the bytes this rank
// sent. all_reduce: `in` is read and the result lands in `out` (the same
// buffer in place), L their chunks. reduce_scatter: `in` is
// the full input, `out` this rank's chunk. all_gather: `in` this rank's input
// (may be its chunk of `out`), `out` the full output. broadcast: `out` is the
// buffer of L.total() elements.
template <typename T, typename Exec>
uint64_t p2p_ring_collective(Exec& x, Coll c, void* out, const void* in, const ChunkLayout& L, int root, int r,
                             int n, void* send_stage, void* recv_stage, size_t stage_bytes) {
  using W = typename Acc<T>::type;
  P2PRingPrims<T, W, Exec> p{x, static_cast<W*>(send_stage), static_cast<W*>(recv_stage),
                             int64_t(stage_bytes / sizeof(W))};
  T* o = static_cast<T*>(out);
  switch (c) {
    case Coll::all_reduce:  // `in` may be `out` (in place)
      ring_all_reduce<T>(p, in ? static_cast<const T*>(in) : o, o, L, r, n, p.round_elems());
      break;
    case Coll::reduce_scatter:
      ring_reduce_scatter<T>(p, static_cast<const T*>(in), o, L, r, n, p.round_elems());
      break;
    case Coll::all_gather:
      if (in != o + L.offsets[r] && L.counts[r]) x.copy(in, o + L.offsets[r], L.counts[r]);
      ring_all_gather<T>(p, o, L, r, n, p.round_elems());
      break;
    case Coll::broadcast:
      ring_broadcast<T>(p, o, L.total(), root, r, n);
      break;
    default:
      throw std::invalid_argument("p2p ring: not a ring collective");
  }
  p.flush();
  return p.sent_bytes;
}

// ----------------------------------------------------------------------------
// The schedule as data. Pointers are fake addresses region << 44 | offset;
// PlanExec turns them back into (region, byte offset). Regions: 0 out (the
// buffer), 1 in, 2 send stage, 3 receive stage; -1: none.

enum PlanKind : int64_t { kPlanGroup = 0, kPlanCopy, kPlanPack, kPlanReduce, kPlanReduceFinal };
constexpr int kPlanRegionShift = 44;

struct PlanExec {
  std::vector<std::vector<int64_t>> ops;

  static void* at(int region, int64_t offset = 0) {
    return reinterpret_cast<void*>((uintptr_t(region + 1) << kPlanRegionShift) + uintptr_t(offset));
  }
  static void ref(std::vector<int64_t>& v, const void* p) {
    auto a = reinterpret_cast<uintptr_t>(p);
    v.push_back(p ? int64_t(a >> kPlanRegionShift) - 1 : -1);
    v.push_back(p ? int64_t(a & ((uintptr_t(1) << kPlanRegionShift) - 1)) : 0);
  }
  // [kind, send region, send offset, send bytes, recv region, recv offset, recv bytes]
  void group(const void* s, size_t sb, void* r, size_t rb) {
    std::vector<int64_t> v{kPlanGroup};
    ref(v, s);
    v.push_back(int64_t(sb));
    ref(v, r);
    v.push_back(int64_t(rb));
    ops.push_back(std::move(v));
  }
  // [kind, src region, src offset, dst region, dst offset, elements]
  void unary(int64_t kind, const void* src, void* dst, int64_t n) {
    std::vector<int64_t> v{kind};
    ref(v, src);
    ref(v, dst);
    v.push_back(n);
    ops.push_back(std::move(v));
  }
  void copy(const void* src, void* dst, int64_t n) { unary(kPlanCopy, src, dst, n); }
  void pack(const void* src, void* dst, int64_t n) { unary(kPlanPack, src, dst, n); }
  // [kind, in region, in offset, own region, own offset, out region, out offset, elements]
  void binary(int64_t kind, const void* in, const void* own, void* out, int64_t n) {
    std::vector<int64_t> v{kind};
    ref(v, in);
    ref(v, own);
    ref(v, out);
    v.push_back(n);
    ops.push_back(std::move(v));
  }
  void reduce(const void* in, const void* own, void* out, int64_t n) { binary(kPlanReduce, in, own, out, n); }
  void reduce_final(const void* in, const void* own, void* dst, int64_t n) {
    binary(kPlanReduceFinal, in, own, dst, n);
  }
};

// What rank `r` of `n` issues for one ring collective. counts: the chunk
// counts (all_reduce and broadcast: one entry, the element count). For
// all_gather, `in_is_chunk` places the input inside the output (in-place form).
inline std::vector<std::vector<int64_t>> p2p_ring_plan(Coll c, const std::vector<int64_t>& counts, int r, int n,
                                                       DType dt, int root, size_t stage_bytes, bool in_is_chunk) {
  if (n < 2 || r < 0 || r >= n) throw std::invalid_argument("p2p_ring_plan: needs 0 <= rank < n, n >= 2");
  bool whole = c == Coll::all_reduce || c == Coll::broadcast;
  if (whole ? counts.size() != 1 : counts.size() != size_t(n))
    throw std::invalid_argument("p2p_ring_plan: counts: one total (all_reduce, broadcast) or one per rank");
  ChunkLayout L(c == Coll::all_reduce ? split_even(counts[0], n)
                                      : c == Coll::broadcast ? std::vector<int64_t>{counts[0]} : counts);
  PlanExec x;
  void* out = PlanExec::at(0);
  const void* in = PlanExec::at(1);
  PZ_DISPATCH_DTYPE(dt, T, {
    if (c == Coll::all_gather && in_is_chunk) in = static_cast<T*>(out) + L.offsets[r];
    if (c == Coll::all_reduce) in = out;  // in place, as the nccl backend runs it
    p2p_ring_collective<T>(x, c, out, in, L, root, r, n, PlanExec::at(2), PlanExec::at(3), stage_bytes);
  });
  return std::move(x.ops);
}

}  // namespace pz
