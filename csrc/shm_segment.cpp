// shm_segment.cpp — see shm_segment.h and [Note: shared-memory flag protocol].
#include "shm_segment.h"

#include <algorithm>
#include <fcntl.h>
#include <linux/futex.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "collective.h"
#include "errors.h"
#include "reduce_math.h"

namespace pz {

namespace {

[[noreturn]] void throw_errno(const std::string& what) {
  throw CollectiveError(what + ": " + std::strerror(errno));
}

}  // namespace

std::string shm_segment_name(const std::string& prefix, int r) { return prefix + "_" + std::to_string(r); }

// [Note: room in /dev/shm] A segment is a file in /dev/shm (tmpfs), sized by ftruncate, whose pages are
// allocated when first touched: where /dev/shm has no room left then (a container's default is 64 MiB),
// the touch kills the process with SIGBUS, no error. So a segment whose size /dev/shm cannot hold now is
// refused at creation, naming the sizes; one that will be used whole (`commit`: the symmetric buffers,
// which grow with the activations) has its pages allocated at once (posix_fallocate), so that a full
// /dev/shm is an error here rather than a SIGBUS at its first use.
char* shm_create_segment(const std::string& name, size_t bytes, bool commit) {
  struct statvfs fs {};
  if (statvfs("/dev/shm", &fs) == 0) {
    const unsigned long long room = (unsigned long long)fs.f_bavail * fs.f_frsize;
    if (room < bytes) {
      std::ostringstream os;
      os << "shm segment " << name << ": needs " << (bytes >> 20) << " MiB, /dev/shm has " << (room >> 20)
         << " MiB free (a container's default is 64 MiB: docker run --shm-size, or smaller areas: "
            "pz.Options slice_bytes / twoshot_bytes / stream_bytes, PYZERO_SHM_*)";
      throw CollectiveError(os.str());
    }
  }
  int fd = shm_open(name.c_str(), O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) throw_errno("shm_open(" + name + ")");
  if (ftruncate(fd, off_t(bytes)) != 0) {
    close(fd);
    shm_unlink(name.c_str());
    throw_errno("ftruncate(" + name + ")");
  }
  if (commit) {
    int rc = posix_fallocate(fd, 0, off_t(bytes));
    if (rc != 0) {
      close(fd);
      shm_unlink(name.c_str());
      throw CollectiveError("shm segment " + name + ": allocating its " + std::to_string(bytes >> 20) +
                            " MiB in /dev/shm failed: " + std::strerror(rc) +
                            " (a container's default /dev/shm is 64 MiB: docker run --shm-size)");
    }
  }
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    throw_errno("mmap(" + name + ")");
  }
  return static_cast<char*>(p);
}

char* shm_map_segment(const std::string& name, size_t bytes, int r, const char* mismatch) {
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

// ---------------------------------------------------------------------------
// Futexes — see [Note: futex wake-ups]

namespace {
uint32_t* low_word(const std::atomic<uint64_t>* w) {
  return reinterpret_cast<uint32_t*>(const_cast<std::atomic<uint64_t>*>(w));
}
}  // namespace

void futex_sleep(const std::atomic<uint64_t>* w, uint32_t seen, long ns) {
  struct timespec ts{0, ns};
  syscall(SYS_futex, low_word(w), FUTEX_WAIT, seen, &ts, nullptr, 0);
}

void futex_wake(const std::atomic<uint64_t>* w) {
  syscall(SYS_futex, low_word(w), FUTEX_WAKE, INT32_MAX, nullptr, nullptr, 0);
}

// ---------------------------------------------------------------------------
// Set-up

ShmSegments::ShmSegments(std::string prefix, int rank, int size, ShmConfig cfg)
    : prefix_(std::move(prefix)), rank_(rank), n_(size), cfg_(cfg), maps_(size, nullptr),
      send_local_(size + 1, 0), recv_local_(size + 1, 0) {
  if (size < 1 || rank < 0 || rank >= size)
    throw std::invalid_argument("ShmTransport: rank must be in [0, size)");
  if (cfg_.depth < 2 || cfg_.slice_bytes < 4096 || cfg_.slice_bytes % 64)
    throw std::invalid_argument("ShmTransport: depth >= 2 and slice_bytes a multiple of 64, >= 4096");
  ctrl_bytes_ = round_up(sizeof(RankCtrl) + (n_ + 1) * sizeof(ChanCtrl), 4096);
  area_bytes_ = round_up(std::max(cfg_.oneshot_bytes, cfg_.twoshot_bytes), 4096);
  seg_bytes_ = ctrl_bytes_ + 2 * area_bytes_ + size_t(n_ + 1) * cfg_.depth * cfg_.slice_bytes;

  maps_[rank_] = shm_create_segment(shm_segment_name(prefix_, rank_), seg_bytes_);
  new (ctrl(rank_)) RankCtrl();  // ftruncate zero-filled; placement-new for the atomics
  ctrl(rank_)->pid = int32_t(getpid());
  ctrl(rank_)->cpu.store(-1, std::memory_order_relaxed);  // (no wait begun yet)
  for (int i = 0; i <= n_; ++i) new (chan_ctrl(rank_, i)) ChanCtrl();
}

void ShmSegments::attach() {
  for (int r = 0; r < n_; ++r) {
    if (!maps_[r])
      maps_[r] = shm_map_segment(shm_segment_name(prefix_, r), seg_bytes_, r,
                                 "ranks were started with different settings");
  }
}

void ShmSegments::unlink() {
  if (!unlinked_) shm_unlink(shm_segment_name(prefix_, rank_).c_str());
  unlinked_ = true;
}

ShmSegments::~ShmSegments() {
  unlink();
  for (char* m : maps_)
    if (m) munmap(m, seg_bytes_);
}

// ---------------------------------------------------------------------------
// Liveness, errors, arrival

// A peer is gone when its pid no longer exists or is a zombie not yet reaped
// by its parent (a killed rank under a launcher that has not waited on it).
bool ShmSegments::peer_alive(int r) const {
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

namespace {
bool point_to_point(const char* what) { return std::strcmp(what, "send") == 0 || std::strcmp(what, "recv") == 0; }
}  // namespace

std::string ShmSegments::where(const char* what, bool entering) const {
  std::ostringstream os;
  os << what << " (rank " << rank_ << " of " << n_;
  if (!point_to_point(what)) os << ", seq " << (entering ? seq_ + 1 : seq_);  // (a send/recv has none)
  os << ")";
  return os.str();
}

void ShmSegments::check_usable(const char* what, bool entering) {
  if (broken_.load())
    throw CollectiveError(where(what, entering) + ": group unusable after an earlier failure: " + broken_why_);
}

void ShmSegments::fail_timeout(int peer, const char* what) {
  std::vector<int> missing, dead;
  bool p2p = point_to_point(what);
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
  // A send or recv waits for its one peer's matching call, not for an arrival at a collective.
  if (p2p && dead.empty() && std::strcmp(what, "send") == 0) {
    os << " to receive (a send waits until its recv takes the data; two ranks that each send to the other "
          "first wait for each other: post the pair in one batch_isend_irecv, send with async_op=True, or "
          "order the calls)";
  } else if (p2p && dead.empty()) {
    os << " to send";
  } else if (!p2p) {
    os << "; ranks that never arrived: [";
    for (size_t i = 0; i < missing.size(); ++i) os << (i ? ", " : "") << missing[i];
    os << "]";
  }
  if (!dead.empty()) {  // (the flight recorder reads this list: it does not wait for these ranks' records)
    os << " (exited: [";
    for (size_t i = 0; i < dead.size(); ++i) os << (i ? ", " : "") << dead[i];
    os << "])";
  }
  mark_broken(os.str(), true);
  throw CollectiveTimeout(broken_why_);
}

// Record why this rank gives up, then tell the peers (see the flag protocol).
void ShmSegments::mark_broken(const std::string& why, bool timeout) {
  broken_why_ = why;
  broken_.store(true);
  RankCtrl* me = ctrl(rank_);
  std::snprintf(me->abort_reason, sizeof(me->abort_reason), "%s", why.c_str());
  me->aborted.store(timeout ? 2 : 1, std::memory_order_release);
}

// A peer gave up: fail with its cause (and its exception type), not a generic message.
void ShmSegments::fail_aborted(int peer, const char* what) {
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

std::string ShmSegments::describe(const CallDesc& d) const {
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

uint64_t ShmSegments::begin(const char* what) {
  check_usable(what, /*entering=*/true);
  return ++seq_;
}

void ShmSegments::arrive(const CallDesc& d, const char* what) {
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

void ShmSegments::exchange_step(Step step, const char* what) {
  const uint64_t count = ++steps_[step == Step::staged ? 0 : 1];
  auto word = [step](RankCtrl* c) -> std::atomic<uint64_t>& { return step == Step::staged ? c->staged : c->reduced; };
  auto waiters = [step](RankCtrl* c) -> std::atomic<uint32_t>& {
    return step == Step::staged ? c->staged_waiters : c->reduced_waiters;
  };
  RankCtrl* me = ctrl(rank_);
  word(me).store(count, std::memory_order_release);
  notify(word(me), waiters(me));
  for (int p = 0; p < n_; ++p) {
    if (p == rank_) continue;
    RankCtrl* c = ctrl(p);
    wait_for([&] { return word(c).load(std::memory_order_acquire) >= count; }, p, what, &word(c), &waiters(c));
  }
}

uint32_t ShmSegments::piece_plan(uint32_t choice, const char* what) {
  constexpr int kBits = 8;  // the choice's bits, below the count
  constexpr uint64_t kMask = (uint64_t(1) << kBits) - 1;
  const uint64_t count = ++plans_;
  RankCtrl* leader = ctrl(0);
  if (rank_ == 0) {
    leader->plan.store(count << kBits | (choice & kMask), std::memory_order_release);
    notify(leader->plan, leader->plan_waiters);
    return uint32_t(choice & kMask);
  }
  wait_for([&] { return (leader->plan.load(std::memory_order_acquire) >> kBits) >= count; }, 0, what, &leader->plan,
           &leader->plan_waiters);
  const uint64_t w = leader->plan.load(std::memory_order_acquire);
  if ((w >> kBits) != count)
    throw CollectiveError(where(what) + ": rank 0's choice for a piece ran ahead (" + std::to_string(w >> kBits) +
                          ", expected " + std::to_string(count) + ")");
  return uint32_t(w & kMask);
}

// ---------------------------------------------------------------------------
// Channels

ShmSegments::Chan ShmSegments::sender(int peer, bool ring, const char* what) {
  int idx = ring ? n_ : peer;
  return Chan{chan_ctrl(rank_, idx), chan_slots(rank_, idx), peer, send_local_[idx], what, &send_local_[idx]};
}

ShmSegments::Chan ShmSegments::receiver(int peer, bool ring, const char* what) {
  int idx = ring ? n_ : rank_, counter = ring ? n_ : peer;
  return Chan{chan_ctrl(peer, idx), chan_slots(peer, idx), peer, recv_local_[counter], what,
              &recv_local_[counter]};
}

}  // namespace pz
