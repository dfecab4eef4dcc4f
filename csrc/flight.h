// flight.h — a group's flight recorder: its last N calls, kept in C++ so
// that a transport records a call inside the call itself (pyzero.flight
// reads the records and explains failures with them).
//
// [Note: flight records]
// Each record is (index, seq, call, count, dtype, op, algo, root or peer,
// start ns, end ns, state). `index` counts every record of the ring, `seq`
// only collectives (point-to-point records have seq 0). The ring has a
// power-of-two capacity; record i lives in slot i & mask.
//
// Writers: the thread that issues the group's calls writes a record at the
// start (begin) and sets its state when a synchronous call returns or fails;
// an async call's state is set by the worker thread that ran it (finish),
// and only if its slot still holds that record (a ring that wrapped past a
// long-running call keeps the newer record). Reader: any thread (pyzero's
// answering thread) copies the records under a per-slot sequence lock, so a
// record being written is read again rather than torn. Every field is a
// relaxed atomic, which on x86-64 and arm64 is a plain load or store: a
// call pays one clock read at the tick (two precise ones with `timed`) and
// a few stores, no lock: about 8 ns here.
#pragma once

#include <time.h>

#include <atomic>
#include <cstdint>
#include <vector>

namespace pz {

// Call codes recorded by C++ transports; pyzero.flight names the rest (fused ops) after these.
enum class FlightCall : int32_t { all_reduce, reduce_scatter, all_gather, broadcast, barrier, send, recv };
inline const char* flight_call_name(FlightCall c) {
  static const char* names[] = {"all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "send", "recv"};
  return names[int(c)];
}
constexpr int kFlightCalls = 7;

enum FlightState : int32_t { kQueued = 0, kStarted = 1, kDone = 2, kFailed = 3 };

// CLOCK_MONOTONIC (Python's time.monotonic), read precisely (about 23 ns
// here) for a timed ring, or at the tick (CLOCK_MONOTONIC_COARSE: about
// 5 ns, 1-4 ms resolution), which is enough to say how long a call has been
// stuck and keeps a recorded 8-byte all_reduce within 1% of an unrecorded one.
inline int64_t flight_now_ns(bool precise) {
  timespec ts;
  clock_gettime(precise ? CLOCK_MONOTONIC : CLOCK_MONOTONIC_COARSE, &ts);
  return int64_t(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

// One record's fields as read (FlightRing::records).
struct FlightRecord {
  uint64_t index, seq;
  int32_t call;
  int64_t count;
  int32_t dtype, op, algo, root;
  int64_t t0, t1;
  int32_t state;
};

class FlightRing {
 public:
  // `capacity` is rounded up to a power of two (at least 1); `timed` also records end times.
  FlightRing(size_t capacity, bool timed) : timed_(timed) {
    size_t cap = 1;
    while (cap < capacity) cap <<= 1;
    slots_ = std::vector<Slot>(cap);
    mask_ = cap - 1;
  }
  FlightRing(const FlightRing&) = delete;
  FlightRing& operator=(const FlightRing&) = delete;

  // Records the start of a call; returns its index (>= 1). A collective
  // (p2p false) takes the next sequence number.
  uint64_t begin(int32_t call, int64_t count, int32_t dtype, int32_t op, int32_t algo, int32_t root, bool p2p,
                 int32_t state = kStarted) {
    uint64_t i = n_.load(std::memory_order_relaxed) + 1;
    uint64_t s = 0;
    if (!p2p) {
      s = seq_.load(std::memory_order_relaxed) + 1;
      seq_.store(s, std::memory_order_relaxed);
    }
    Slot& r = slots_[i & mask_];
    uint64_t v = r.ver.load(std::memory_order_relaxed);
    r.ver.store(v + 1, std::memory_order_relaxed);  // odd: being written
    std::atomic_thread_fence(std::memory_order_release);
    r.index.store(i, std::memory_order_relaxed);
    r.seq.store(s, std::memory_order_relaxed);
    r.call.store(call, std::memory_order_relaxed);
    r.count.store(count, std::memory_order_relaxed);
    r.dtype.store(dtype, std::memory_order_relaxed);
    r.op.store(op, std::memory_order_relaxed);
    r.algo.store(algo, std::memory_order_relaxed);
    r.root.store(root, std::memory_order_relaxed);
    r.t0.store(flight_now_ns(timed_), std::memory_order_relaxed);
    r.t1.store(0, std::memory_order_relaxed);
    r.state.store(state, std::memory_order_relaxed);
    r.ver.store(v + 2, std::memory_order_release);
    n_.store(i, std::memory_order_release);
    return i;
  }

  // Sets record i's state (done, failed, queued); a no-op for 0 and for a
  // record the ring has since overwritten.
  void finish(uint64_t i, int32_t state) {
    if (i == 0) return;
    Slot& r = slots_[i & mask_];
    if (r.index.load(std::memory_order_relaxed) != i) return;
    if (timed_ && state != kQueued) r.t1.store(flight_now_ns(true), std::memory_order_relaxed);
    r.state.store(state, std::memory_order_release);
  }

  uint64_t size() const { return n_.load(std::memory_order_acquire); }  // records written so far
  size_t capacity() const { return mask_ + 1; }
  bool timed() const { return timed_; }

  // The records still in the ring, oldest first.
  std::vector<FlightRecord> records() const {
    std::vector<FlightRecord> out;
    uint64_t n = size();
    uint64_t first = n > mask_ ? n - mask_ : 1;
    out.reserve(n + 1 - first);
    for (uint64_t i = first; i <= n; ++i) {
      FlightRecord rec;
      if (read(i, rec)) out.push_back(rec);
    }
    return out;
  }

  // Record i as last written, or false if the ring no longer (or never) held it.
  bool read(uint64_t i, FlightRecord& rec) const {
    if (i == 0) return false;
    const Slot& r = slots_[i & mask_];
    for (int attempt = 0; attempt < 1000; ++attempt) {
      uint64_t v1 = r.ver.load(std::memory_order_acquire);
      if (v1 & 1) continue;
      rec.index = r.index.load(std::memory_order_relaxed);
      rec.seq = r.seq.load(std::memory_order_relaxed);
      rec.call = r.call.load(std::memory_order_relaxed);
      rec.count = r.count.load(std::memory_order_relaxed);
      rec.dtype = r.dtype.load(std::memory_order_relaxed);
      rec.op = r.op.load(std::memory_order_relaxed);
      rec.algo = r.algo.load(std::memory_order_relaxed);
      rec.root = r.root.load(std::memory_order_relaxed);
      rec.t0 = r.t0.load(std::memory_order_relaxed);
      rec.t1 = r.t1.load(std::memory_order_relaxed);
      rec.state = r.state.load(std::memory_order_acquire);
      std::atomic_thread_fence(std::memory_order_acquire);
      if (r.ver.load(std::memory_order_relaxed) == v1) return rec.index == i;
    }
    return false;  // a writer kept rewriting the slot: the record is gone by now
  }

 private:
  struct Slot {
    std::atomic<uint64_t> ver{0}, index{0}, seq{0};
    std::atomic<int32_t> call{0};
    std::atomic<int64_t> count{0};
    std::atomic<int32_t> dtype{0}, op{-1}, algo{0}, root{-1};
    std::atomic<int64_t> t0{0}, t1{0};
    std::atomic<int32_t> state{kQueued};
  };
  std::vector<Slot> slots_;
  uint64_t mask_ = 0;
  bool timed_;
  std::atomic<uint64_t> n_{0}, seq_{0};
};

}  // namespace pz
