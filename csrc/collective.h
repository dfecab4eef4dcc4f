// collective.h — the vocabulary every transport shares: which collective
// (Coll), which algorithm (Algo), per-op traffic counters, and the small
// helpers for cutting a buffer into per-rank chunks. Plain C++ (no CUDA,
// NCCL or POSIX header), so the shm and nccl transports, the ring schedules
// and the CUDA kernels include it without depending on each other.
// The integer codes are the ones Python passes (exported as _C.COLLS, _C.ALGOS).
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace pz {

enum class Coll : int32_t { all_reduce = 0, reduce_scatter, all_gather, broadcast, barrier, send, recv };
constexpr int kNumColls = 7;

inline const char* coll_name(Coll c) {
  switch (c) {
    case Coll::all_reduce: return "all_reduce";
    case Coll::reduce_scatter: return "reduce_scatter";
    case Coll::all_gather: return "all_gather";
    case Coll::broadcast: return "broadcast";
    case Coll::barrier: return "barrier";
    case Coll::send: return "send";
    case Coll::recv: return "recv";
  }
  return "?";
}

// native: NCCL's own collective (nccl backend only); twoshot: the ipc backend's
// reduce-scatter-then-all-gather all_reduce.
enum class Algo : int32_t { automatic = 0, ring = 1, oneshot = 2, native = 3, twoshot = 4 };
constexpr int kNumAlgos = 5;

inline const char* algo_name(Algo a) {
  switch (a) {
    case Algo::automatic: return "auto";
    case Algo::ring: return "ring";
    case Algo::oneshot: return "oneshot";
    case Algo::native: return "native";
    case Algo::twoshot: return "twoshot";
  }
  return "?";
}

// At most this many sources per reduce_many (the CUDA kernel's parameter
// holds them): so also the largest group a GPU one-shot all_reduce takes.
constexpr int kMaxReduceSources = 16;

// Per-op traffic counters of this rank (what left this rank on the transport).
struct OpStats {
  uint64_t calls = 0, elements = 0, sent_bytes = 0;
};

// The counters behind stats(): one set per collective, updated by any thread.
class OpCounters {
 public:
  OpCounters() {
    for (auto& s : v_)
      for (auto& x : s) x.store(0);
  }
  void add(Coll c, uint64_t elements, uint64_t bytes) {
    auto& s = v_[int(c)];
    s[0].fetch_add(1, std::memory_order_relaxed);
    s[1].fetch_add(elements, std::memory_order_relaxed);
    s[2].fetch_add(bytes, std::memory_order_relaxed);
  }
  // {collective name: counters}; `reset` zeroes them as it reads.
  std::map<std::string, OpStats> read(bool reset) {
    std::map<std::string, OpStats> out;
    for (int c = 0; c < kNumColls; ++c) {
      auto& s = v_[c];
      OpStats o;
      o.calls = reset ? s[0].exchange(0) : s[0].load();
      o.elements = reset ? s[1].exchange(0) : s[1].load();
      o.sent_bytes = reset ? s[2].exchange(0) : s[2].load();
      out[coll_name(Coll(c))] = o;
    }
    return out;
  }

 private:
  std::atomic<uint64_t> v_[kNumColls][3];
};

inline size_t round_up(size_t x, size_t a) { return (x + a - 1) / a * a; }

// Element counts of an all-reduce's n chunks: as even as possible, the
// remainder on the first ranks (every transport's ring splits alike).
inline std::vector<int64_t> split_even(int64_t count, int n) {
  std::vector<int64_t> c(n);
  for (int r = 0; r < n; ++r) c[r] = count / n + (r < count % n ? 1 : 0);
  return c;
}

}  // namespace pz
