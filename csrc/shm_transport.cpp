// shm_transport.cpp — see shm_transport.h and [Note: shared-memory flag protocol].
#include "shm_transport.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <linux/futex.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <chrono>
#include <cstring>
#include <iterator>
#include <sstream>
#include <thread>

#include "cpu_reduce.h"
#include "errors.h"
#include "work.h"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define PZ_CPU_RELAX() _mm_pause()
#else
#define PZ_CPU_RELAX() ((void)0)
#endif

namespace pz {

const char* sym_kind_name(SymKind k) {
  switch (k) {
    case SymKind::all_gather: return "all_gather";
    case SymKind::reduce_scatter: return "reduce_scatter";
  }
  return "?";
}

namespace {

std::string seg_name(const std::string& prefix, int r) { return prefix + "_" + std::to_string(r); }

[[noreturn]] void throw_errno(const std::string& what) {
  throw CollectiveError(what + ": " + std::strerror(errno));
}

// Creates and maps segment `name` of `bytes` (zero-filled); unlinks it again on failure.
char* create_segment(const std::string& name, size_t bytes) {
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw_errno("shm_open(" + name + ")");
  if (ftruncate(fd, off_t(bytes)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    throw_errno("ftruncate(" + name + ")");
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    throw_errno("mmap(" + name + ")");
  }
  return static_cast<char*>(p);
}

// Maps rank r's segment `name`, which must be `bytes` long (`mismatch` says why it would not be).
char* map_segment(const std::string& name, size_t bytes, int r, const char* mismatch) {
  int fd = shm_open(name.c_str(), O_RDWR, 0600);
  if (fd < 0) throw_errno("shm_open(" + name + ") of rank " + std::to_string(r));
  struct stat st;
  if (fstat(fd, &st) != 0 || size_t(st.st_size) != bytes) {
    close(fd);
    throw CollectiveError("segment " + name + " of rank " + std::to_string(r) + " has a different size: " + mismatch);
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) throw_errno("mmap(" + name + ")");
  return static_cast<char*>(p);
}

uint64_t hash_counts(const std::vector<int64_t>& c) {
  uint64_t h = 1469598103934665603ull;  // FNV-1a
  for (int64_t v : c) {
    h ^= uint64_t(v);
    h *= 1099511628211ull;
  }
  return h;
}

// Choice of ring vs one-shot, per (collective, per-rank input bytes).
// Measured with `pyzero-bench collectives --algo ring|oneshot` on 2 CPU
// processes (2-core EPYC, benchmarks/results/): one-shot wins below these
// sizes, where its single synchronisation dominates; the ring's 2(n-1)/n
// traffic wins above.
size_t oneshot_limit(Coll c) {
  switch (c) {
    case Coll::all_reduce: return 64 << 10;
    case Coll::reduce_scatter: return 128 << 10;
    case Coll::all_gather: return 64 << 10;
    case Coll::broadcast: return 64 << 10;
    default: return 0;
  }
}

}  // namespace

// ---------------------------------------------------------------------------
// Set-up

ShmTransport::ShmTransport(std::string prefix, int rank, int size, ShmConfig cfg)
    : prefix_(std::move(prefix)), rank_(rank), n_(size), cfg_(cfg), maps_(size, nullptr),
      send_local_(size + 1, 0), recv_local_(size + 1, 0) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("ShmTransport: rank must be in [0, size)");
  if (cfg_.depth < 2 || cfg_.slice_bytes < 4096 || cfg_.slice_bytes % 64)
    throw std::invalid_argument("ShmTransport: depth >= 2 and slice_bytes a multiple of 64, >= 4096");
  ctrl_bytes_ = round_up(sizeof(RankCtrl) + (n_ + 1) * sizeof(ChanCtrl), 4096);
  area_bytes_ = round_up(cfg_.oneshot_bytes, 4096);
  seg_bytes_ = ctrl_bytes_ + 2 * area_bytes_ + size_t(n_ + 1) * cfg_.depth * cfg_.slice_bytes;

  maps_[rank_] = create_segment(seg_name(prefix_, rank_), seg_bytes_);
  new (ctrl(rank_)) RankCtrl();  // ftruncate zero-filled; placement-new for the atomics
  ctrl(rank_)->pid = int32_t(getpid());
  for (int i = 0; i <= n_; ++i) new (chan_ctrl(rank_, i)) ChanCtrl();
}

void ShmTransport::attach() {
  for (int r = 0; r < n_; ++r) {
    if (!maps_[r])
      maps_[r] = map_segment(seg_name(prefix_, r), seg_bytes_, r, "ranks were started with different settings");
  }
}

void ShmTransport::unlink() {
  if (!unlinked_) shm_unlink(seg_name(prefix_, rank_).c_str());
  unlinked_ = true;
}

ShmTransport::~ShmTransport() {
  unlink();
  sym_release();
  for (auto& [m, bytes] : sym_old_) munmap(m, bytes);
  for (char* m : maps_)
    if (m) munmap(m, seg_bytes_);
}

ChanCtrl* ShmTransport::chan_ctrl(int owner, int idx) const {
  return reinterpret_cast<ChanCtrl*>(maps_[owner] + sizeof(RankCtrl)) + idx;
}

char* ShmTransport::chan_slots(int owner, int idx) const {
  return maps_[owner] + ctrl_bytes_ + 2 * area_bytes_ + size_t(idx) * cfg_.depth * cfg_.slice_bytes;
}

char* ShmTransport::area(int r, uint64_t seq) const {
  return maps_[r] + ctrl_bytes_ + (seq % 2) * area_bytes_;
}

// ---------------------------------------------------------------------------
// Waiting, liveness, errors

// A peer is gone when its pid no longer exists or is a zombie not yet reaped
// by its parent (a killed rank under a launcher that has not waited on it).
bool ShmTransport::peer_alive(int r) const {
  int pid = ctrl(r)->pid;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  char path[64];
  std::snprintf(path, sizeof(path), "/proc/%d/stat", pid);
  FILE* f = std::fopen(path, "r");
  if (!f) return true;
  char buf[256] = {0};
  size_t got = std::fread(buf, 1, sizeof(buf) - 1, f);
  std::fclose(f);
  const char* close_paren = std::strrchr(buf, ')');  // the state follows "(comm) "
  return !(got && close_paren && close_paren[1] == ' ' && (close_paren[2] == 'Z' || close_paren[2] == 'X'));
}

std::string ShmTransport::where(const char* what) const {
  std::ostringstream os;
  os << what << " (rank " << rank_ << " of " << n_ << ", seq " << seq_ << ")";
  return os.str();
}

void ShmTransport::check_usable(const char* what) {
  if (broken_.load()) throw CollectiveError(where(what) + ": group unusable after an earlier failure: " + broken_why_);
}

// Spin briefly (a peer on another core answers within microseconds), then
// yield, then sleep, so a waiting rank never starves computation on a 2-core
// machine. Liveness and the timeout are checked in the slow phases only.
// A caller's own thread spins longer (it has nothing else to do); async work
// on a Worker thread shares the cores with the caller's computation (backward
// during a bucketed reduce), so it yields and sleeps sooner.
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
namespace {
static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "futex word: the counter's low half");

uint32_t* low_word(const std::atomic<uint64_t>* w) {
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint64_t>*>(w));
}

void futex_sleep(const std::atomic<uint64_t>* w, uint32_t seen, long ns) {
  struct timespec ts{0, ns};
  syscall(SYS_futex, low_word(w), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void notify(std::atomic<uint64_t>& word, std::atomic<uint32_t>& waiters) {
  std::atomic_thread_fence(std::memory_order_seq_cst);
  if (waiters.load(std::memory_order_relaxed))
    syscall(SYS_futex, low_word(&word), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}
}  // namespace

template <typename Pred>
void ShmTransport::wait_for(Pred ready, int peer, const char* what, const std::atomic<uint64_t>* word,
                            std::atomic<uint32_t>* waiters) {
  const bool background = on_worker_thread();
  const int spins = background ? 200 : 2000;
  const uint64_t yields = background ? 10 : 200;
  for (int i = 0; i < spins; ++i) {
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

void ShmTransport::fail_timeout(int peer, const char* what) {
  std::vector<int> missing, dead;
  bool p2p = std::strcmp(what, "send") == 0 || std::strcmp(what, "recv") == 0;
  for (int r = 0; r < n_; ++r) {
    if (r == rank_ || (p2p && r != peer)) continue;
    bool alive = peer_alive(r);
    if (!alive) dead.push_back(r);
    if (!alive || ctrl(r)->arrived.load(std::memory_order_acquire) < seq_) missing.push_back(r);
  }
  if (missing.empty()) missing.push_back(peer);
  std::ostringstream os;
  os << where(what) << ": ";
  if (!dead.empty()) os << "waiting for rank " << peer << ", which has exited";
  else os << "timed out after " << cfg_.timeout_s << " s waiting for rank " << peer;
  os << "; ranks that never arrived: [";
  for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
  os << "]";
  if (!dead.empty()) {
    os << " (exited: [";
    for (size_t i = 0; i < dead.size(); ++i) os << (i ? ", " : "") << dead[i];
    os << "])";
  }
  mark_broken(os.str(), true);
  throw CollectiveTimeout(broken_why_);
}

// Record why this rank gives up, then tell the peers (see the flag protocol).
void ShmTransport::mark_broken(const std::string& why, bool timeout) {
  broken_why_ = why;
  broken_.store(true);
  RankCtrl* me = ctrl(rank_);
  std::snprintf(me->abort_reason, sizeof(me->abort_reason), "%s", why.c_str());
  me->aborted.store(timeout ? 2 : 1, std::memory_order_release);
}

// A peer gave up: fail with its cause (and its exception type), not a generic message.
void ShmTransport::fail_aborted(int peer, const char* what) {
  RankCtrl* c = ctrl(peer);
  uint32_t kind = c->aborted.load(std::memory_order_acquire);
  char reason[sizeof(c->abort_reason)];
  std::memcpy(reason, c->abort_reason, sizeof(reason));
  reason[sizeof(reason) - 1] = 0;
  std::string why = where(what) + ": rank " + std::to_string(peer) + " gave up on the group: " + reason;
  mark_broken(why, kind == 2);
  if (kind == 2) throw CollectiveTimeout(why);
  throw CollectiveError(why);
}

std::string ShmTransport::describe(const CallDesc& d) const {
  std::ostringstream os;
  if (d.coll >= kSymCollBase) {
    int k = d.coll - kSymCollBase;
    os << "fused ";
    if (k < kNumSymKinds) os << "symmetric " << sym_kind_name(SymKind(k));
    else os << "op";
    os << "(count=" << d.count << ", dtype=" << dtype_name(DType(d.dtype))
       << ")";
    return os.str();
  }
  os << coll_name(Coll(d.coll)) << "(count=" << d.count;
  if (d.coll <= int(Coll::all_gather)) {
    if (d.coll != int(Coll::all_gather)) os << ", op=" << op_name(RedOp(d.op));
  }
  if (d.coll == int(Coll::broadcast)) os << ", src=" << d.root;
  os << ", dtype=" << dtype_name(DType(d.dtype)) << ", algo=" << algo_name(Algo(d.algo)) << ")";
  return os.str();
}

uint64_t ShmTransport::begin(const char* what) {
  check_usable(what);
  return ++seq_;
}

void ShmTransport::arrive(const CallDesc& d, const char* what) {
  RankCtrl* me = ctrl(rank_);
  me->desc[d.seq % 2] = d;
  me->arrived.store(d.seq, std::memory_order_release);
  notify(me->arrived, me->arrived_waiters);
  for (int p = 0; p < n_; ++p) {
    if (p == rank_) continue;
    RankCtrl* c = ctrl(p);
    wait_for([&] { return c->arrived.load(std::memory_order_acquire) >= d.seq; }, p, what, &c->arrived,
             &c->arrived_waiters);
  }
  for (int p = 0; p < n_; ++p)
    if (p != rank_ && ctrl(p)->aborted.load(std::memory_order_acquire)) fail_aborted(p, what);
  for (int p = 0; p < n_; ++p) {
    if (p == rank_) continue;
    const CallDesc& o = ctrl(p)->desc[d.seq % 2];
    if (o.coll != d.coll || o.op != d.op || o.dtype != d.dtype || o.root != d.root ||
        o.algo != d.algo || o.count != d.count || o.counts_hash != d.counts_hash) {
      std::string note = describe(d) == describe(o) ? " (their per-rank counts differ)" : "";
      throw CollectiveError(where(what) + ": mismatched collective: this rank called " + describe(d) +
                            ", rank " + std::to_string(p) + " called " + describe(o) + note);
    }
  }
}

Algo ShmTransport::choose_algo(Coll c, size_t bytes) const {
  size_t lim = oneshot_limit(c);
  if (lim > cfg_.oneshot_bytes) lim = cfg_.oneshot_bytes;
  return (n_ > 1 && bytes <= lim) ? Algo::oneshot : Algo::ring;
}

Algo ShmTransport::resolve(Coll c, size_t bytes, Algo algo) const {
  if (algo == Algo::automatic) return choose_algo(c, bytes);
  if (algo == Algo::oneshot && bytes > cfg_.oneshot_bytes)
    throw std::invalid_argument(std::string(coll_name(c)) + ": algo='oneshot' takes at most " +
                                std::to_string(cfg_.oneshot_bytes) + " bytes of input per rank, got " +
                                std::to_string(bytes) + "; use algo='ring' or 'auto'");
  if (algo == Algo::native)
    throw std::invalid_argument(std::string(coll_name(c)) + ": algo='native' is NCCL's own collective, for the "
                                "nccl backend; the shm backend takes 'auto', 'ring' or 'oneshot'");
  if (algo != Algo::ring && algo != Algo::oneshot)
    throw std::invalid_argument("algo: expected 'auto', 'ring' or 'oneshot'");
  return algo;
}

// ---------------------------------------------------------------------------
// Channels

void* ShmTransport::send_acquire(Chan& c) {
  ChanCtrl* cc = c.ctrl;
  uint64_t depth = uint64_t(cfg_.depth);
  if (c.local - cc->consumed.load(std::memory_order_acquire) >= depth)
    wait_for([&] { return c.local - cc->consumed.load(std::memory_order_acquire) < depth; }, c.peer, c.what,
             &cc->consumed, &cc->consumed_waiters);
  return c.slots + (c.local % depth) * cfg_.slice_bytes;
}

void ShmTransport::send_post(Chan& c, size_t) {
  c.local += 1;
  c.ctrl->sent.store(c.local, std::memory_order_release);
  notify(c.ctrl->sent, c.ctrl->sent_waiters);
}

const void* ShmTransport::recv_acquire(Chan& c) {
  ChanCtrl* cc = c.ctrl;
  if (cc->sent.load(std::memory_order_acquire) <= c.local)
    wait_for([&] { return cc->sent.load(std::memory_order_acquire) > c.local; }, c.peer, c.what, &cc->sent,
             &cc->sent_waiters);
  return c.slots + (c.local % uint64_t(cfg_.depth)) * cfg_.slice_bytes;
}

void ShmTransport::recv_release(Chan& c) {
  c.local += 1;
  c.ctrl->consumed.store(c.local, std::memory_order_release);
  notify(c.ctrl->consumed, c.ctrl->consumed_waiters);
}

// ---------------------------------------------------------------------------
// Ring primitives over the channel to the successor / from the predecessor.
// Every primitive of one call slices by the same element count (that of the
// widest wire type) so a sender and its receiver always agree on slice sizes.

template <typename T, RedOp OP>
struct ShmRingPrims {
  using W = WireT<T>;
  ShmTransport& t;
  ShmTransport::Chan out, in;
  int64_t per_slice;
  int nranks;
  int depth;
  uint64_t sent_bytes = 0;

  // At most half the slot depth per primitive (see Round in ring.h).
  int64_t round_elems() const { return per_slice * std::max(1, depth / 2); }

  template <typename F> void slices(int64_t cnt, F f) {
    for (int64_t o = 0; o < cnt; o += per_slice) f(o, size_t(std::min(per_slice, cnt - o)));
  }
  void post(size_t bytes) { t.send_post(out, bytes); sent_bytes += bytes; }

  void send_rs(const T* own, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      cpu_pack<T, W>(own + o, static_cast<W*>(t.send_acquire(out)), m);
      post(m * sizeof(W));
    });
  }
  void recv_reduce_send(const T* own, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      const W* src = static_cast<const W*>(t.recv_acquire(in));
      cpu_reduce_send<OP, T, W>(src, own + o, static_cast<W*>(t.send_acquire(out)), m);
      t.recv_release(in);
      post(m * sizeof(W));
    });
  }
  void recv_reduce_final(const T* own, T* dst, bool forward, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      const W* src = static_cast<const W*>(t.recv_acquire(in));
      T* fwd = forward ? static_cast<T*>(t.send_acquire(out)) : nullptr;
      cpu_reduce_final<OP, T, W>(src, own + o, dst + o, fwd, m, nranks);
      t.recv_release(in);
      if (forward) post(m * sizeof(T));
    });
  }
  void send_ag(const T* src, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      std::memcpy(t.send_acquire(out), src + o, m * sizeof(T));
      post(m * sizeof(T));
    });
  }
  void recv_copy_send(T* dst, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      const void* src = t.recv_acquire(in);
      void* fwd = t.send_acquire(out);
      std::memcpy(fwd, src, m * sizeof(T));
      std::memcpy(dst + o, src, m * sizeof(T));
      t.recv_release(in);
      post(m * sizeof(T));
    });
  }
  void recv_ag(T* dst, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      std::memcpy(dst + o, t.recv_acquire(in), m * sizeof(T));
      t.recv_release(in);
    });
  }
};

namespace {

// Slice length for a call whose longest chunk has `longest` elements: one
// round of depth/2 slices covers the chunk, so even mid-sized messages are
// pipelined across ranks; at least 8 KiB to amortise the flag handshake, at
// most a slot.
template <typename W>
int64_t slice_elems(const ShmConfig& cfg, int64_t longest) {
  int64_t per_round = std::max(1, cfg.depth / 2);
  int64_t want = (longest + per_round - 1) / per_round;
  want = (want + 15) / 16 * 16;
  int64_t lo = int64_t(8192 / sizeof(W)), hi = int64_t(cfg.slice_bytes / sizeof(W));
  return std::min(hi, std::max(lo, want));
}

template <typename T, RedOp OP, typename F>
uint64_t with_ring_prims(ShmTransport& t, const char* what, const ShmConfig& cfg, int rank, int n,
                         int64_t longest, std::vector<uint64_t>& send_local, std::vector<uint64_t>& recv_local,
                         ChanCtrl* out_ctrl, char* out_slots, ChanCtrl* in_ctrl, char* in_slots, F body) {
  using W = WireT<T>;
  int next = (rank + 1) % n, prev = (rank + n - 1) % n;
  ShmRingPrims<T, OP> p{t,
                        {out_ctrl, out_slots, next, send_local[n], what},
                        {in_ctrl, in_slots, prev, recv_local[n], what},
                        slice_elems<W>(cfg, longest),
                        n,
                        cfg.depth};
  struct Save {  // keep the channel counters even when the body throws
    ShmRingPrims<T, OP>& p;
    std::vector<uint64_t>& s;
    std::vector<uint64_t>& r;
    int n;
    ~Save() { s[n] = p.out.local; r[n] = p.in.local; }
  } save{p, send_local, recv_local, n};
  body(p);
  return p.sent_bytes;
}

}  // namespace

#define PZ_RING_PRIMS(T, OP, longest, body)                                                         \
  with_ring_prims<T, OP>(*this, what, cfg_, rank_, n_, longest, send_local_, recv_local_,               \
                         chan_ctrl(rank_, n_),                                                             \
                         chan_slots(rank_, n_), chan_ctrl((rank_ + n_ - 1) % n_, n_),               \
                         chan_slots((rank_ + n_ - 1) % n_, n_), body)

// ---------------------------------------------------------------------------
// Collectives

void ShmTransport::all_reduce(void* buf, int64_t count, DType dt, RedOp op, Algo algo) {
  const char* what = "all_reduce";
  size_t bytes = size_t(count) * dtype_size(dt);
  algo = resolve(Coll::all_reduce, bytes, algo);
  uint64_t seq = begin(what);
  CallDesc d{seq, int32_t(Coll::all_reduce), int32_t(op), int32_t(dt), 0, int32_t(algo), 0, count, 0};
  uint64_t sent = 0;
  if (n_ == 1) {
    arrive(d, what);  // the reduction of one contribution is itself (avg divides by 1)
  } else if (algo == Algo::oneshot) {
    std::memcpy(area(rank_, seq), buf, bytes);
    arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
      std::vector<const T*> srcs(n_);
      for (int r = 0; r < n_; ++r) srcs[r] = reinterpret_cast<const T*>(area(r, seq));
      cpu_reduce_many<OP, T>(srcs.data(), n_, static_cast<T*>(buf), size_t(count), n_);
    }));
    sent = uint64_t(bytes) * (n_ - 1);
  } else {
    arrive(d, what);
    ChunkLayout L(split_even(count, n_));
    PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
      sent = PZ_RING_PRIMS(T, OP, L.longest(), [&](ShmRingPrims<T, OP>& p) {
        ring_all_reduce<T>(p, static_cast<T*>(buf), L, rank_, n_, p.round_elems());
      });
    }));
  }
  counters_.add(Coll::all_reduce, uint64_t(count), sent);
}

void ShmTransport::reduce_scatter(void* out, const void* in, const std::vector<int64_t>& counts,
                                  DType dt, RedOp op, Algo algo) {
  const char* what = "reduce_scatter";
  ChunkLayout L(counts);
  size_t bytes = size_t(L.total()) * dtype_size(dt);
  algo = resolve(Coll::reduce_scatter, bytes, algo);
  uint64_t seq = begin(what);
  CallDesc d{seq, int32_t(Coll::reduce_scatter), int32_t(op), int32_t(dt), 0, int32_t(algo), 0,
             L.total(), hash_counts(counts)};
  uint64_t sent = 0;
  if (n_ == 1 || algo == Algo::oneshot) {
    if (n_ > 1) std::memcpy(area(rank_, seq), in, bytes);
    arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
      std::vector<const T*> srcs(n_);
      for (int r = 0; r < n_; ++r)
        srcs[r] = (n_ == 1 ? static_cast<const T*>(in) : reinterpret_cast<const T*>(area(r, seq))) +
                  L.offsets[rank_];
      cpu_reduce_many<OP, T>(srcs.data(), n_, static_cast<T*>(out), size_t(counts[rank_]), n_);
    }));
    sent = uint64_t(L.total() - counts[rank_]) * dtype_size(dt);
  } else {
    arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
      sent = PZ_RING_PRIMS(T, OP, L.longest(), [&](ShmRingPrims<T, OP>& p) {
        ring_reduce_scatter<T>(p, static_cast<const T*>(in), static_cast<T*>(out), L, rank_, n_,
                               p.round_elems());
      });
    }));
  }
  counters_.add(Coll::reduce_scatter, uint64_t(L.total()), sent);
}

void ShmTransport::all_gather(void* out, const void* in, const std::vector<int64_t>& counts, DType dt,
                              Algo algo) {
  const char* what = "all_gather";
  ChunkLayout L(counts);
  size_t es = dtype_size(dt);
  size_t my_bytes = size_t(counts[rank_]) * es;
  char* own_out = static_cast<char*>(out) + size_t(L.offsets[rank_]) * es;
  // Every rank must choose alike: decide on the largest chunk, which all know.
  algo = resolve(Coll::all_gather, size_t(L.longest()) * es, algo);
  uint64_t seq = begin(what);
  CallDesc d{seq, int32_t(Coll::all_gather), 0, int32_t(dt), 0, int32_t(algo), 0, L.total(),
             hash_counts(counts)};
  uint64_t sent = 0;
  if (own_out != in && my_bytes) std::memmove(own_out, in, my_bytes);
  if (n_ == 1) {
    arrive(d, what);
  } else if (algo == Algo::oneshot) {
    std::memcpy(area(rank_, seq), own_out, my_bytes);
    arrive(d, what);
    for (int r = 0; r < n_; ++r)
      if (r != rank_ && counts[r])
        std::memcpy(static_cast<char*>(out) + size_t(L.offsets[r]) * es, area(r, seq), size_t(counts[r]) * es);
    sent = uint64_t(my_bytes) * (n_ - 1);
  } else {
    arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, {
      sent = PZ_RING_PRIMS(T, RedOp::sum, L.longest(), [&](ShmRingPrims<T, RedOp::sum>& p) {
        ring_all_gather<T>(p, static_cast<T*>(out), L, rank_, n_, p.round_elems());
      });
    });
  }
  counters_.add(Coll::all_gather, uint64_t(L.total()), sent);
}

void ShmTransport::broadcast(void* buf, int64_t count, DType dt, int root, Algo algo) {
  const char* what = "broadcast";
  size_t bytes = size_t(count) * dtype_size(dt);
  algo = resolve(Coll::broadcast, bytes, algo);
  uint64_t seq = begin(what);
  CallDesc d{seq, int32_t(Coll::broadcast), 0, int32_t(dt), root, int32_t(algo), 0, count, 0};
  uint64_t sent = 0;
  if (n_ == 1) {
    arrive(d, what);
  } else if (algo == Algo::oneshot) {
    if (rank_ == root) std::memcpy(area(rank_, seq), buf, bytes);
    arrive(d, what);
    if (rank_ != root) std::memcpy(buf, area(root, seq), bytes);
    else sent = uint64_t(bytes) * (n_ - 1);
  } else {
    arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, {
      sent = PZ_RING_PRIMS(T, RedOp::sum, count, [&](ShmRingPrims<T, RedOp::sum>& p) {
        ring_broadcast<T>(p, static_cast<T*>(buf), count, root, rank_, n_);
      });
    });
  }
  counters_.add(Coll::broadcast, uint64_t(count), sent);
}

void ShmTransport::barrier() {
  uint64_t seq = begin("barrier");
  CallDesc d{seq, int32_t(Coll::barrier), 0, 0, 0, 0, 0, 0, 0};
  arrive(d, "barrier");
  counters_.add(Coll::barrier, 0, 0);
}

// ---------------------------------------------------------------------------
// Point to point: a header slot, then the data in slices, on the channel
// dedicated to this (sender, receiver) pair.

void ShmTransport::send(const void* buf, int64_t cnt, DType dt, int dst) {
  check_usable("send");
  Chan c{chan_ctrl(rank_, dst), chan_slots(rank_, dst), dst, send_local_[dst], "send"};
  struct Save { Chan& c; uint64_t& s; ~Save() { s = c.local; } } save{c, send_local_[dst]};
  P2PHeader h{cnt, int32_t(dt), 0};
  std::memcpy(send_acquire(c), &h, sizeof(h));
  send_post(c, sizeof(h));
  size_t bytes = size_t(cnt) * dtype_size(dt);
  for (size_t o = 0; o < bytes; o += cfg_.slice_bytes) {
    size_t m = std::min(cfg_.slice_bytes, bytes - o);
    std::memcpy(send_acquire(c), static_cast<const char*>(buf) + o, m);
    send_post(c, m);
  }
  counters_.add(Coll::send, uint64_t(cnt), bytes);
}

void ShmTransport::recv(void* buf, int64_t cnt, DType dt, int src) {
  check_usable("recv");
  Chan c{chan_ctrl(src, rank_), chan_slots(src, rank_), src, recv_local_[src], "recv"};
  struct Save { Chan& c; uint64_t& s; ~Save() { s = c.local; } } save{c, recv_local_[src]};
  P2PHeader h;
  std::memcpy(&h, recv_acquire(c), sizeof(h));
  recv_release(c);
  size_t their_bytes = size_t(h.count) * dtype_size(DType(h.dtype));
  bool match = h.count == cnt && h.dtype == int32_t(dt);
  for (size_t o = 0; o < their_bytes; o += cfg_.slice_bytes) {
    size_t m = std::min(cfg_.slice_bytes, their_bytes - o);
    const void* p = recv_acquire(c);
    if (match) std::memcpy(static_cast<char*>(buf) + o, p, m);
    recv_release(c);
  }
  if (!match) {
    std::ostringstream os;
    os << "recv (rank " << rank_ << " of " << n_ << "): mismatched send/recv: rank " << src << " sent "
       << h.count << " elements of " << dtype_name(DType(h.dtype)) << ", this rank expected " << cnt
       << " elements of " << dtype_name(dt) << " (the message was discarded)";
    throw CollectiveError(os.str());
  }
  counters_.add(Coll::recv, uint64_t(cnt), 0);
}

// ---------------------------------------------------------------------------
// Symmetric buffers — see [Note: symmetric buffers]

namespace {
std::string sym_name(const std::string& prefix, int r, int gen) {
  return seg_name(prefix, r) + "_s" + std::to_string(gen);
}
}  // namespace

// Current generation -> old list (still mapped), own name unlinked.
void ShmTransport::sym_release() {
  sym_unlink();
  for (char* m : sym_maps_)
    if (m) sym_old_.emplace_back(m, kSymHeaderBytes + sym_bytes_);
  sym_maps_.clear();
  sym_bytes_ = 0;
}

void ShmTransport::sym_create(size_t bytes) {
  check_usable("symmetric buffer");
  sym_release();
  bytes = round_up(std::max<size_t>(bytes, 4096), 4096);
  ++sym_gen_;
  char* p = create_segment(sym_name(prefix_, rank_, sym_gen_), kSymHeaderBytes + bytes);
  sym_unlinked_ = false;
  sym_maps_.assign(n_, nullptr);
  sym_maps_[rank_] = p;
  sym_bytes_ = bytes;
  new (sym_header(rank_)) SymHeader();
}

void ShmTransport::sym_attach() {
  size_t total = kSymHeaderBytes + sym_bytes_;
  for (int r = 0; r < n_; ++r) {
    if (!sym_maps_.at(r))
      sym_maps_[r] = map_segment(sym_name(prefix_, r, sym_gen_), total, r, "ranks asked for different sizes");
  }
}

void ShmTransport::sym_unlink() {
  if (!sym_unlinked_) shm_unlink(sym_name(prefix_, rank_, sym_gen_).c_str());
  sym_unlinked_ = true;
}

void ShmTransport::sym_arrive(int kind, int64_t count, DType dt, const std::vector<int64_t>& dims) {
  const char* what = "fused op";
  uint64_t seq = begin(what);
  CallDesc d{seq, int32_t(kSymCollBase + kind), 0, int32_t(dt), 0, 0, 0, count, hash_counts(dims)};
  arrive(d, what);
}

void ShmTransport::sym_signal(uint64_t value) {
  SymHeader* h = sym_header(rank_);
  h->ready.store(value, std::memory_order_release);
  notify(h->ready, h->ready_waiters);
}

void ShmTransport::sym_wait(int peer, uint64_t value, const char* what) {
  check_usable(what);
  SymHeader* h = sym_header(peer);
  wait_for([&] { return h->ready.load(std::memory_order_acquire) >= value; }, peer, what, &h->ready,
           &h->ready_waiters);
}

}  // namespace pz
