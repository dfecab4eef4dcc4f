// shm_segment.h — the shared memory under the "shm" transport: one segment per
// rank, mapped by every peer, its layout, and the flag protocol ranks use to
// arrive at a collective, wait for each other and pass slices over channels.
// The collectives on top are in shm_transport.h.
//
// Each rank creates one segment and maps every peer's. A segment holds:
//
//   RankCtrl          arrival sequence, call descriptors, abort flag, pid
//   ChanCtrl[n + 1]   one channel per peer for send/recv, and one (index n)
//                     to the ring successor, all *outgoing* from this rank
//   one-shot areas    two (indexed by seq % 2) of `oneshot_bytes` each
//   slots             (n + 1) channels x depth x slice_bytes
//
// Segments are unlinked as soon as every rank has mapped them, so a killed
// rank leaves nothing behind in /dev/shm.
//
// [Note: shared-memory flag protocol]
// Every counter is monotonic over the life of the group and written by one
// side only, so nothing is ever reset:
//  * arrived (writer: owner) — the sequence number of the collective the owner
//    entered. Before the store-release of `arrived = s` the owner has written
//    desc[s % 2] and, for one-shot, its data into area[s % 2]. A rank proceeds
//    with collective s once every peer's arrived >= s. Peers can then be at
//    most one collective ahead (s + 1 needs everyone's arrival), so two
//    descriptor/area copies suffice.
//    A peer that has arrived at s - 1 has finished collective s - 2 and with
//    it every read of area[s % 2]; so once arrival at s - 1 has passed, a rank
//    may overwrite area[s % 2]: one sync per small collective, no read counters.
//  * chan.sent (writer: sender) / chan.consumed (writer: receiver) — a ring
//    buffer of `depth` slots; the sender waits for sent - consumed < depth,
//    writes slot sent % depth and store-releases sent + 1; the receiver waits
//    for sent > consumed, reads, and store-releases consumed + 1.
//  * waiters (one next to each counter) — see [Note: futex wake-ups].
//  * aborted (writer: owner) — set, after abort_reason, when the owner failed
//    mid-collective, so peers waiting on it fail fast with the same cause
//    instead of waiting for the timeout, and a late rank never completes a
//    collective its peers gave up on (checked after arrival).
//
// [Note: futex wake-ups]
// A sleeping waiter must wake the moment its peer writes, not at the end of
// a back-off sleep: where every core computes, a worker that misses the
// moment waits for its next time slice, and a bucket's ring (a dozen
// hand-offs) falls behind backward. So the sleep is a futex wait on the
// watched counter's low 32 bits (shared, not FUTEX_PRIVATE: the word lives
// in a MAP_SHARED segment), and each counter has a waiter count beside it:
//   waiter: seen = word; waiters++; fence; if (!ready()) futex_wait(word, seen, 1 ms); waiters--
//   writer: word = v (release); fence; if (waiters) futex_wake(word)
// (Dekker: either the waiter sees the new value or the writer sees the
// waiter; futex_wait itself returns at once if the word is no longer `seen`.)
// Writers pay one fence and one load; a syscall only when someone sleeps.
#pragma once

#include <sched.h>

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <string>
#include <thread>
#include <vector>

#include "work.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PZ_CPU_RELAX() _mm_pause()
#else
#define PZ_CPU_RELAX() ((void)0)
#endif

namespace pz {

// ----------------------------------------------------------------------------
// Structs in shared memory (every rank maps them: fixed size and alignment)

// What every rank must agree on for one call; compared across ranks.
struct alignas(64) CallDesc {
  uint64_t seq;
  int32_t coll, op, dtype, root, algo, pad;
  int64_t count;        // total elements (full buffer for reduce_scatter/all_gather)
  uint64_t counts_hash; // hash of the per-rank counts
};
static_assert(sizeof(CallDesc) == 64 && alignof(CallDesc) == 64, "CallDesc lives in shared memory");

struct alignas(64) RankCtrl {
  alignas(64) std::atomic<uint64_t> arrived;
  std::atomic<uint32_t> arrived_waiters;  // see [Note: futex wake-ups]
  alignas(64) std::atomic<uint32_t> aborted;  // 1: failed (error), 2: failed (timeout / dead peer)
  int32_t pid;
  std::atomic<int32_t> cpu;  // the core this rank last began a wait on (see ShmSegments::wait_for)
  CallDesc desc[2];
  char abort_reason[384];  // written before `aborted`, so peers can pass the cause on
  // The two-shot all_reduce's steps after the arrival (shm_transport.cpp): how many pieces
  // this rank has staged in its area after an arrival (`staged`: auto chose the two-shot
  // after it, or a later piece) and how many reduced chunks it has put there (`reduced`).
  alignas(64) std::atomic<uint64_t> staged;
  std::atomic<uint32_t> staged_waiters;
  alignas(64) std::atomic<uint64_t> reduced;
  std::atomic<uint32_t> reduced_waiters;
  // Rank 0 only: auto's choice for the next piece of an all_reduce in pieces ([Note: adaptive
  // two-shot]): (count of choices published) << 1 | two-shot.
  alignas(64) std::atomic<uint64_t> plan;
  std::atomic<uint32_t> plan_waiters;
};
static_assert(sizeof(RankCtrl) == 5 * 64 + 2 * sizeof(CallDesc) + 384, "RankCtrl lives in shared memory");
static_assert(alignof(RankCtrl) == 64 && offsetof(RankCtrl, aborted) == 64 && offsetof(RankCtrl, desc) == 128 &&
              offsetof(RankCtrl, staged) % 64 == 0 && offsetof(RankCtrl, reduced) == offsetof(RankCtrl, staged) + 64 &&
              offsetof(RankCtrl, plan) == offsetof(RankCtrl, reduced) + 64,
              "RankCtrl: `arrived`, `aborted`, `staged`, `reduced` and `plan` on cache lines of their own");

struct alignas(64) ChanCtrl {
  alignas(64) std::atomic<uint64_t> sent;
  std::atomic<uint32_t> sent_waiters;
  alignas(64) std::atomic<uint64_t> consumed;
  std::atomic<uint32_t> consumed_waiters;
};
static_assert(sizeof(ChanCtrl) == 128 && alignof(ChanCtrl) == 64 && offsetof(ChanCtrl, consumed) == 64,
              "ChanCtrl: one cache line per writer");
static_assert(sizeof(RankCtrl) % alignof(ChanCtrl) == 0, "the ChanCtrl array follows RankCtrl, aligned");

// Header of a send/recv message, carried in the message's first slot.
struct alignas(16) P2PHeader {
  int64_t count;
  int32_t dtype;
  int32_t pad;
};
static_assert(sizeof(P2PHeader) == 16 && alignof(P2PHeader) == 16, "P2PHeader lives in shared memory");

// Header of a symmetric buffer (see [Note: symmetric buffers] in
// shm_transport.h), in the first kSymHeaderBytes of the buffer's segment.
struct alignas(64) SymHeader {
  alignas(64) std::atomic<uint64_t> ready;
  std::atomic<uint32_t> ready_waiters;
};
constexpr size_t kSymHeaderBytes = 4096;  // the data follows, page-aligned
static_assert(sizeof(SymHeader) == 64 && alignof(SymHeader) == 64 && sizeof(SymHeader) <= kSymHeaderBytes,
              "SymHeader lives in shared memory");

static_assert(std::atomic<uint64_t>::is_always_lock_free && std::atomic<uint32_t>::is_always_lock_free &&
                  sizeof(std::atomic<uint64_t>) == 8 && sizeof(std::atomic<uint32_t>) == 4,
              "counters shared between processes: lock-free, plain integers in memory");
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "futex word: the counter's low half");

// The fused symmetric ops (pyzero/symmetric.py), by the `kind` code of
// sym_arrive; their CallDesc.coll is kSymCollBase + kind.
enum class SymKind : int32_t { all_gather = 0, reduce_scatter = 1 };
constexpr int kNumSymKinds = 2;
constexpr int kSymCollBase = 64;

inline const char* sym_kind_name(SymKind k) {
  switch (k) {
    case SymKind::all_gather: return "all_gather";
    case SymKind::reduce_scatter: return "reduce_scatter";
  }
  return "?";
}

struct ShmConfig {
  size_t slice_bytes = 256 << 10;
  int depth = 8;
  size_t oneshot_bytes = 512 << 10;  // largest per-rank input the one-shot path takes
  double timeout_s = 300.0;
  size_t stream_bytes = 8 << 20;  // ring outputs of at least this many bytes are streamed (shm_transport.cpp)
  size_t twoshot_bytes = 8 << 20;  // the two-shot's area: larger all_reduces go through it in pieces
  bool adaptive = true;            // auto picks ring or two-shot by measurement (shm_adapt.h)
  size_t twoshot_stream_bytes = 4 << 10;  // two-shot messages of at least this many bytes stream their area
};

// ----------------------------------------------------------------------------
// Segments and futexes

// Name of rank r's segment.
std::string shm_segment_name(const std::string& prefix, int r);
// Creates and maps segment `name` of `bytes` (zero-filled); unlinks it again on failure.
char* shm_create_segment(const std::string& name, size_t bytes, bool commit = false);  // [Note: room in /dev/shm]
// Maps rank r's segment `name`, which must be `bytes` long (`mismatch` says why it would not be).
char* shm_map_segment(const std::string& name, size_t bytes, int r, const char* mismatch);

// FNV-1a of per-rank counts (CallDesc.counts_hash).
inline uint64_t hash_counts(const std::vector<int64_t>& c) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t v : c) {
    h ^= uint64_t(v);
    h *= 1099511628211ull;
  }
  return h;
}

// Sleeps until `*w`'s low word is no longer `seen`, a wake-up, or `ns`.
void futex_sleep(const std::atomic<uint64_t>* w, uint32_t seen, long ns);
void futex_wake(const std::atomic<uint64_t>* w);

// After a store to `word`: wake its sleepers, if any (see [Note: futex wake-ups]).
inline void notify(std::atomic<uint64_t>& word, std::atomic<uint32_t>& waiters) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (waiters.load(std::memory_order_relaxed)) futex_wake(&word);
}

// ----------------------------------------------------------------------------
// The group's segments as this rank sees them: arrival, waits, failures, channels.

class ShmSegments {
 public:
  ShmSegments(std::string prefix, int rank, int size, ShmConfig cfg);
  ~ShmSegments();
  ShmSegments(const ShmSegments&) = delete;
  ShmSegments& operator=(const ShmSegments&) = delete;

  // Set-up in three steps separated by store barriers in Python:
  // construct (creates own segment) -> attach() (maps peers) -> unlink().
  void attach();
  void unlink();

  int rank() const { return rank_; }
  int size() const { return n_; }
  const ShmConfig& config() const { return cfg_; }
  const std::string& prefix() const { return prefix_; }

  // Start a collective: checks the group is usable, returns its sequence number.
  uint64_t begin(const char* what);
  // Enter collective `d`: publish the descriptor (and one-shot data already
  // written), wait for every peer, compare descriptors.
  void arrive(const CallDesc& d, const char* what);
  // A two-shot all_reduce step: publish that this rank's staged input chunks
  // (or its reduced chunk) of the current piece are in its area, then wait
  // until every peer's are. Each kind of step is counted (every rank takes
  // the same steps in the same order); the count is what the word holds.
  enum class Step { staged, reduced };
  void exchange_step(Step step, const char* what);
  // Auto's choice for the next piece of an all_reduce in pieces: rank 0 publishes it
  // (and returns it), every other rank waits for it. Every rank makes the same calls in
  // the same order; rank 0 publishes the next choice only after finishing the piece before,
  // which needs every peer to have read this one, so the word never runs ahead. The choice
  // is a few bits (ShmTransport::kChoiceTwoshot, kChoiceLong).
  uint32_t piece_plan(uint32_t choice, const char* what);
  // Rank 0's CallDesc::pad of call `seq`; read right after arriving at `seq`.
  int32_t leader_word(uint64_t seq) const { return ctrl(0)->desc[seq % 2].pad; }
  // Throws if an earlier failure left the group unusable.
  void check_usable(const char* what, bool entering = false);
  // Rank r's one-shot (and two-shot) area for collective `seq`: max(oneshot_bytes, twoshot_bytes).
  char* area(int r, uint64_t seq) const { return maps_[r] + ctrl_bytes_ + (seq % 2) * area_bytes_; }

  // Wait until ready(); `word`/`waiters`: the counter ready() watches and its
  // waiter count, for futex wake-ups (see [Note: futex wake-ups]). Fails when
  // `peer` gave up or exited, or after the timeout.
  template <typename Pred>
  void wait_for(Pred ready, int peer, const char* what, const std::atomic<uint64_t>* word = nullptr,
                std::atomic<uint32_t>* waiters = nullptr);

  // One side of a channel. `local` is this side's own counter (sent or
  // consumed); Keep stores it back when the operation ends, even by an exception.
  struct Chan {
    ChanCtrl* ctrl;
    char* slots;
    int peer;          // the rank on the other end
    uint64_t local;
    const char* what;  // the operation using it, for errors
    uint64_t* home;    // where `local` is kept between operations
  };
  struct Keep {
    Chan& c;
    ~Keep() { *c.home = c.local; }
  };
  // The channel this rank sends on to `peer` (ring: to its ring successor).
  Chan sender(int peer, bool ring, const char* what);
  // The channel this rank receives on from `peer` (ring: from its ring predecessor).
  Chan receiver(int peer, bool ring, const char* what);
  // see [Note: shared-memory flag protocol]
  void* send_acquire(Chan& c);
  void send_post(Chan& c) {
    c.local += 1;
    c.ctrl->sent.store(c.local, std::memory_order_release);
    notify(c.ctrl->sent, c.ctrl->sent_waiters);
  }
  const void* recv_acquire(Chan& c);
  void recv_release(Chan& c) {
    c.local += 1;
    c.ctrl->consumed.store(c.local, std::memory_order_release);
    notify(c.ctrl->consumed, c.ctrl->consumed_waiters);
  }

 private:
  // "what (rank r of n, seq s)", for errors: s is the call's (entering: the one about to begin); a send or
  // recv has no sequence number.
  std::string where(const char* what, bool entering = false) const;
  RankCtrl* ctrl(int r) const { return reinterpret_cast<RankCtrl*>(maps_[r]); }
  ChanCtrl* chan_ctrl(int owner, int idx) const {
    return reinterpret_cast<ChanCtrl*>(maps_[owner] + sizeof(RankCtrl)) + idx;
  }
  char* chan_slots(int owner, int idx) const {
    return maps_[owner] + ctrl_bytes_ + 2 * area_bytes_ + size_t(idx) * cfg_.depth * cfg_.slice_bytes;
  }
  [[noreturn]] void fail_timeout(int peer, const char* what);
  [[noreturn]] void fail_aborted(int peer, const char* what);
  void mark_broken(const std::string& why, bool timeout);
  std::string describe(const CallDesc& d) const;
  bool peer_alive(int r) const;

  std::string prefix_;
  int rank_, n_;
  ShmConfig cfg_;
  size_t seg_bytes_ = 0, ctrl_bytes_ = 0, area_bytes_ = 0;
  std::vector<char*> maps_;
  bool unlinked_ = false;
  std::atomic<bool> broken_{false};
  std::string broken_why_;
  uint64_t seq_ = 0;                               // collectives entered by this rank
  uint64_t steps_[2] = {0, 0};                     // two-shot steps taken, staged and reduced
  uint64_t plans_ = 0;                             // piece choices published (rank 0) or read
  std::vector<uint64_t> send_local_, recv_local_;  // channel counters: p2p (by peer) + ring (index n)
};

// Spin briefly (a peer on another core answers within microseconds), then
// yield, then sleep, so a waiting rank never starves computation on a 2-core
// machine. Liveness and the timeout are checked in the slow phases only.
// A caller's own thread spins longer (it has nothing else to do); async work
// on a Worker thread shares the cores with the caller's computation (backward
// during a bucketed reduce), so it yields and sleeps sooner.
//
// [Note: a peer on the same core] Where the scheduler has put the peer on this
// rank's core (both ranks of a pair, in bursts on a 2-vCPU VM; any rank pair when
// ranks outnumber cores), the peer cannot run while this rank spins: every wait
// ran its whole spin (2000 pauses, 50 us on the AMD EPYC VM) before a yield let
// the peer on, and a call took about 110 us; in bursts that made pyzero's p99 at
// small sizes 110-127 us against DeepSpeed's 40. So after a short spin (100
// pauses, 2.5 us; the usual wait ends sooner) a rank publishes the core it waits
// on (RankCtrl::cpu) and, where the peer last waited on the same core, yields at
// once and for longer before sleeping. Measured in one process, two groups with
// and without it, the same calls in turn (benchmarks/results/
// allreduce_shared_core_cpu2_20261127.txt): both ranks on one core, medians
// 0.14-0.47x (8 B 15 us against 58), p99 0.15-0.57x; on two cores the medians
// 0.97-1.05x in 8 pairs (0.94-1.21x in 6 pairs of a noisier run), and where a
// pair had bursts the 8 B p99 6-23 us against 109-125. (A peer's core can be
// stale after a migration; then the wait yields where it could have spun: the
// latency of a yield, 0.6 us, not a stall.)
constexpr int kSpinsBeforeCoreCheck = 100;

template <typename Pred>
void ShmSegments::wait_for(Pred ready, int peer, const char* what, const std::atomic<uint64_t>* word,
                           std::atomic<uint32_t>* waiters) {
  const bool background = on_worker_thread();
  int i = 0;
  for (; i < kSpinsBeforeCoreCheck; ++i) {
    if (ready()) return;
    PZ_CPU_RELAX();
  }
  // [Note: a peer on the same core]
  const int cpu = sched_getcpu();
  std::atomic<int32_t>& mine = ctrl(rank_)->cpu;
  if (mine.load(std::memory_order_relaxed) != cpu) mine.store(cpu, std::memory_order_relaxed);
  const bool shared_core = peer >= 0 && peer < n_ && peer != rank_ && cpu >= 0 &&
                           ctrl(peer)->cpu.load(std::memory_order_relaxed) == cpu;
  const int spins = shared_core ? 0 : background ? 200 : 2000;
  const uint64_t yields = shared_core ? 2000 : background ? 10 : 200;
  for (; i < spins; ++i) {
    if (ready()) return;
    PZ_CPU_RELAX();
  }
  auto t0 = std::chrono::steady_clock::now();
  auto last_check = t0;
  for (uint64_t it = 0;; ++it) {
    if (ready()) return;
    bool slept = false;
    if (it < yields) {
      sched_yield();
    } else if (word) {
      uint32_t seen = uint32_t(word->load(std::memory_order_acquire));
      waiters->fetch_add(1, std::memory_order_seq_cst);
      std::atomic_thread_fence(std::memory_order_seq_cst);
      if (!ready()) futex_sleep(word, seen, 1000000);  // 1 ms at most: liveness checks go on
      waiters->fetch_sub(1, std::memory_order_relaxed);
      slept = true;
    } else {
      uint64_t k = it - yields;
      uint64_t us = k < 1000 ? 5 + k / 10 : 100;  // 5 us .. 100 us
      std::this_thread::sleep_for(std::chrono::microseconds(us));
    }
    if (slept || (it & 15) == 0) {
      auto now = std::chrono::steady_clock::now();
      if (now - last_check > std::chrono::milliseconds(2)) {
        last_check = now;
        if (ready()) return;
        if (ctrl(peer)->aborted.load(std::memory_order_acquire)) fail_aborted(peer, what);
        if (!peer_alive(peer)) fail_timeout(peer, what);
      }
      if (std::chrono::duration<double>(now - t0).count() > cfg_.timeout_s) fail_timeout(peer, what);
    }
  }
}

inline void* ShmSegments::send_acquire(Chan& c) {
  ChanCtrl* cc = c.ctrl;
  uint64_t depth = uint64_t(cfg_.depth);
  if (c.local - cc->consumed.load(std::memory_order_acquire) >= depth)
    wait_for([&] { return c.local - cc->consumed.load(std::memory_order_acquire) < depth; }, c.peer, c.what,
             &cc->consumed, &cc->consumed_waiters);
  return c.slots + (c.local % depth) * cfg_.slice_bytes;
}

inline const void* ShmSegments::recv_acquire(Chan& c) {
  ChanCtrl* cc = c.ctrl;
  if (cc->sent.load(std::memory_order_acquire) <= c.local)
    wait_for([&] { return cc->sent.load(std::memory_order_acquire) > c.local; }, c.peer, c.what, &cc->sent,
             &cc->sent_waiters);
  return c.slots + (c.local % uint64_t(cfg_.depth)) * cfg_.slice_bytes;
}

}  // namespace pz
