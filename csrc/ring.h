// ring.h — the ring schedule of DESIGN.md, written once, generic over the
// transport's primitives.
//
// A buffer is cut into n chunks (chunk i holds counts[i] elements, counts may
// be 0; offsets are the prefix sums). Rank r sends to r+1 and receives from
// r-1. Every primitive works on one piece of one chunk and the transport
// slices it, so a rank's k-th send is its successor's k-th receive, sizes
// always agree, and consecutive slices pipeline across ranks. The primitive
// sequence per rank and round (see Round), NCCL-style:
//
//   reduce-scatter: send(r-1), recv_reduce_send(r-2) ... recv_reduce_send(r-n+1),
//                   recv_reduce_final(r)
//   all-gather:     send(r), recv_copy_send(r-1) ... recv_copy_send(r-n+2), recv(r-n+1)
//   all-reduce:     reduce-scatter whose final step also sends (recv_reduce_final
//                   with forward=true), then the all-gather without its first send
//   broadcast:      a pipelined chain root -> root+1 -> ... -> root-1
//
// Prims must provide (cnt elements of chunk `c`, pointers already offset):
//   send_rs(const T* own, cnt)                  own data into the reduction wire
//   recv_reduce_send(const T* own, cnt)         in (+) own -> next
//   recv_reduce_final(const T* own, T* dst, bool forward, cnt)
//   send_ag(const T* src, cnt)                  finished data -> next
//   recv_copy_send(T* dst, cnt)                 in -> dst and -> next
//   recv_ag(T* dst, cnt)                        in -> dst
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

namespace pz {

struct ChunkLayout {
  std::vector<int64_t> counts, offsets;
  explicit ChunkLayout(std::vector<int64_t> c) : counts(std::move(c)), offsets(counts.size() + 1, 0) {
    for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + counts[i];
  }
  int64_t total() const { return offsets.back(); }
  int64_t longest() const {
    int64_t m = 0;
    for (int64_t c : counts) m = c > m ? c : m;
    return m;
  }
};

inline int ring_mod(int a, int n) { return ((a % n) + n) % n; }

// The buffer is processed in rounds: round k handles elements
// [k * R, (k + 1) * R) of every chunk (fewer, or none, where a chunk is
// shorter). Keeping every primitive at most half the transport's slot depth
// is what makes the ring deadlock-free: a rank blocked on a full channel
// always has a successor that can still drain it.
struct Round {
  const ChunkLayout& L;
  int64_t begin, len;  // element range of this round within each chunk
  int64_t off(int c) const { return L.offsets[c] + begin; }
  int64_t cnt(int c) const {
    int64_t left = L.counts[c] - begin;
    return left <= 0 ? 0 : (left < len ? left : len);
  }
};

// Rounds over elements [begin, end) of every chunk: by default all of them; a part, for a
// message that goes in pieces (piece k: the k-th `per` elements of every chunk).
template <typename F>
void for_rounds(const ChunkLayout& L, int64_t round_elems, F f, int64_t begin = 0, int64_t end = INT64_MAX) {
  end = std::min(end, L.longest());
  for (int64_t b = begin; b < end; b += round_elems) f(Round{L, b, std::min(round_elems, end - b)});
}

// Reduce-scatter one round of `src` (full layout) into `dst` (this rank's
// chunk, indexed from its start). With `forward_result` the finished piece is
// also sent on, as the first all-gather step of an all-reduce.
template <typename T, typename Prims>
void ring_reduce_scatter_round(Prims& p, const T* src, T* dst, const Round& R, int r, int n,
                               bool forward_result) {
  int c = ring_mod(r - 1, n);
  p.send_rs(src + R.off(c), R.cnt(c));
  for (int k = 2; k < n; ++k) {
    c = ring_mod(r - k, n);
    p.recv_reduce_send(src + R.off(c), R.cnt(c));
  }
  p.recv_reduce_final(src + R.off(r), dst + R.begin, forward_result, R.cnt(r));
}

// All-gather one round into `buf` (full layout); this rank's piece is already
// in place, and was already sent unless `send_own`.
template <typename T, typename Prims>
void ring_all_gather_round(Prims& p, T* buf, const Round& R, int r, int n, bool send_own) {
  if (send_own) p.send_ag(buf + R.off(r), R.cnt(r));
  for (int k = 1; k < n - 1; ++k) {
    int c = ring_mod(r - k, n);
    p.recv_copy_send(buf + R.off(c), R.cnt(c));
  }
  int c = ring_mod(r - (n - 1), n);
  p.recv_ag(buf + R.off(c), R.cnt(c));
}

template <typename T, typename Prims>
void ring_reduce_scatter(Prims& p, const T* src, T* dst, const ChunkLayout& L, int r, int n, int64_t round_elems) {
  for_rounds(L, round_elems, [&](const Round& R) { ring_reduce_scatter_round<T>(p, src, dst, R, r, n, false); });
}

template <typename T, typename Prims>
void ring_all_gather(Prims& p, T* buf, const ChunkLayout& L, int r, int n, int64_t round_elems) {
  for_rounds(L, round_elems, [&](const Round& R) { ring_all_gather_round<T>(p, buf, R, r, n, true); });
}

// `src` is read, the result lands in `dst` (the same buffer for the in-place form).
template <typename T, typename Prims>
void ring_all_reduce(Prims& p, const T* src, T* dst, const ChunkLayout& L, int r, int n, int64_t round_elems,
                     int64_t begin = 0, int64_t end = INT64_MAX) {
  for_rounds(
      L, round_elems,
      [&](const Round& R) {
        ring_reduce_scatter_round<T>(p, src, dst + L.offsets[r], R, r, n, /*forward_result=*/true);
        ring_all_gather_round<T>(p, dst, R, r, n, /*send_own=*/false);
      },
      begin, end);
}

// Chain broadcast of `cnt` elements, pipelined by the transport's slicing
// (a chain has no cycle, so one primitive may span any number of slices).
template <typename T, typename Prims>
void ring_broadcast(Prims& p, T* buf, int64_t cnt, int root, int r, int n) {
  int pos = ring_mod(r - root, n);  // distance from the root along the ring
  if (pos == 0) p.send_ag(buf, cnt);
  else if (pos == n - 1) p.recv_ag(buf, cnt);
  else p.recv_copy_send(buf, cnt);
}

}  // namespace pz
