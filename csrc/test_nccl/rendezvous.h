// rendezvous.h — the host-side parts of the test NCCL library (test_nccl.cpp)
// that need neither CUDA nor torch, so that tests/test_nccl_on_cpu.cpp runs
// them with fork()ed processes:
//
//  * the unique id: a magic and the name of a POSIX shared-memory segment
//    (every rank of a test-library communicator is on one host);
//  * the rendezvous: each rank opens (or creates) that segment, publishes its
//    bytes (the ipc transport's handle) in its slot and waits, with a
//    deadline, until every rank has; the last rank to leave unlinks the name;
//  * the group bookkeeping of ncclGroupStart/End: sends and receives are held
//    per communicator until the outermost ncclGroupEnd, then issued as one
//    batch, at most kMaxGroupOps of them (one point-to-point kernel).
//
// [Note: the test NCCL library's rendezvous]
// The segment holds a header (magic, the world size the first rank wrote,
// counts of ranks that joined and that left) and a slot per rank (a ready
// flag, the length and the bytes). Every rank creates it with O_CREAT and sets
// its size to the same fixed length (a second ftruncate to the same size
// changes nothing), so no rank needs to come first. A rank writes its slot,
// then its ready flag (release); the others read the flag (acquire), then the
// bytes. Errors are found on the rank that sees them: a world size other than
// the first rank's, a rank already published (two processes given one rank),
// a deadline passed (naming the ranks that never came) or a stop request (an
// abort). The rank that brings `left` to the world size unlinks the name; a
// rank that fails unlinks it too, so a failed group leaves nothing in
// /dev/shm (a late rank then makes a fresh segment and times out alone).
#pragma once

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

namespace pz::tnccl {

constexpr int kIdBytes = 128;                 // NCCL_UNIQUE_ID_BYTES
constexpr char kIdMagic[8] = {'P', 'Z', 'T', 'N', 'C', 'C', 'L', '1'};
constexpr int kMaxRanks = 16;                 // the ipc transport's largest group (kIpcMaxRanks)
constexpr int kMaxPayload = 256;              // a cudaIpcMemHandle_t is 64 bytes
constexpr int kMaxGroupOps = 32;              // one point-to-point kernel (kIpcMaxP2POps)
constexpr uint64_t kSegMagic = 0x315a50544e43434cull;

// ---- the unique id ----

// A fresh id: the magic, then "/pz-tnccl-<pid>-<16 random hex digits>" (NUL-terminated).
inline void make_unique_id(char (&id)[kIdBytes]) {
  std::memset(id, 0, kIdBytes);
  std::memcpy(id, kIdMagic, sizeof(kIdMagic));
  std::random_device rd;
  uint64_t r = (uint64_t(rd()) << 32) ^ rd() ^ uint64_t(std::chrono::steady_clock::now().time_since_epoch().count());
  std::snprintf(id + sizeof(kIdMagic), kIdBytes - sizeof(kIdMagic), "/pz-tnccl-%d-%016llx", int(getpid()),
                static_cast<unsigned long long>(r));
}

// The segment name in `id`; std::invalid_argument if it is not one of make_unique_id's.
inline std::string segment_name(const char* id) {
  if (std::memcmp(id, kIdMagic, sizeof(kIdMagic)) != 0)
    throw std::invalid_argument("the unique id was not made by this library's ncclGetUniqueId (its magic differs): "
                                "every rank must use the test NCCL library (PYZERO_NCCL_ROOT) and rank 0's id");
  const char* name = id + sizeof(kIdMagic);
  size_t len = strnlen(name, kIdBytes - sizeof(kIdMagic));
  if (len == 0 || len == size_t(kIdBytes) - sizeof(kIdMagic) || name[0] != '/')
    throw std::invalid_argument("the unique id holds no segment name");
  return std::string(name, len);
}

// ---- the rendezvous ----

struct Slot {
  uint32_t ready;  // 1 once `len` and `data` are written
  uint32_t len;
  char data[kMaxPayload];
};

struct Segment {
  uint64_t magic;
  int32_t nranks;  // the world size of the first rank to join (0: none yet)
  uint32_t joined, left;
  uint32_t pad;
  Slot slots[kMaxRanks];
};

inline std::string errno_text(const char* call) { return std::string(call) + ": " + std::strerror(errno); }

// Every rank's bytes, in rank order (this rank's `mine` included). `stop` is polled while waiting:
// true ends the wait with an error (an abort). Throws std::runtime_error (a deadline, a stop, a
// system call) or std::invalid_argument (a world size or rank that contradicts the others').
inline std::vector<std::string> rendezvous(const std::string& name, int rank, int nranks, const std::string& mine,
                                           double timeout_s, const std::function<bool()>& stop = nullptr) {
  if (nranks < 1 || nranks > kMaxRanks)
    throw std::invalid_argument("nranks must be 1.." + std::to_string(kMaxRanks) + " for the test NCCL library, got " +
                                std::to_string(nranks));
  if (rank < 0 || rank >= nranks)
    throw std::invalid_argument("rank must be in [0, " + std::to_string(nranks) + "), got " + std::to_string(rank));
  if (mine.size() > size_t(kMaxPayload)) throw std::invalid_argument("handle too large");
  int fd = shm_open(name.c_str(), O_CREAT | O_RDWR, 0600);
  if (fd < 0) throw std::runtime_error(errno_text(("shm_open(" + name + ")").c_str()));
  if (ftruncate(fd, sizeof(Segment)) != 0) {
    std::string e = errno_text("ftruncate");
    close(fd);
    shm_unlink(name.c_str());
    throw std::runtime_error(e);
  }
  void* p = mmap(nullptr, sizeof(Segment), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (p == MAP_FAILED) {
    shm_unlink(name.c_str());
    throw std::runtime_error(errno_text("mmap"));
  }
  Segment* s = static_cast<Segment*>(p);
  auto fail = [&](auto err) {
    munmap(p, sizeof(Segment));
    shm_unlink(name.c_str());
    throw err;
  };
  int32_t expected = 0;
  if (!__atomic_compare_exchange_n(&s->nranks, &expected, int32_t(nranks), false, __ATOMIC_ACQ_REL,
                                   __ATOMIC_ACQUIRE) &&
      expected != nranks)
    fail(std::invalid_argument("rank " + std::to_string(rank) + " was given nranks " + std::to_string(nranks) +
                               ", another rank of this unique id " + std::to_string(expected) +
                               ": every rank must pass the same nranks"));
  __atomic_store_n(&s->magic, kSegMagic, __ATOMIC_RELAXED);
  Slot& me = s->slots[rank];
  if (__atomic_load_n(&me.ready, __ATOMIC_ACQUIRE) != 0)
    fail(std::invalid_argument("rank " + std::to_string(rank) + " joined this unique id twice (two processes were "
                               "given the same rank)"));
  std::memcpy(me.data, mine.data(), mine.size());
  me.len = uint32_t(mine.size());
  __atomic_store_n(&me.ready, 1u, __ATOMIC_RELEASE);
  __atomic_fetch_add(&s->joined, 1u, __ATOMIC_ACQ_REL);

  const auto deadline = std::chrono::steady_clock::now() +
                        std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                            std::chrono::duration<double>(std::min(timeout_s, 1e9)));
  int us = 10;
  for (;;) {
    int missing = 0;
    for (int r = 0; r < nranks; ++r) missing += __atomic_load_n(&s->slots[r].ready, __ATOMIC_ACQUIRE) == 0;
    if (missing == 0) break;
    if (stop && stop()) fail(std::runtime_error("the communicator was aborted while waiting for its ranks"));
    if (std::chrono::steady_clock::now() > deadline) {
      std::string who;
      for (int r = 0; r < nranks; ++r)
        if (__atomic_load_n(&s->slots[r].ready, __ATOMIC_ACQUIRE) == 0) who += (who.empty() ? "" : ", ") + std::to_string(r);
      char secs[32];
      std::snprintf(secs, sizeof(secs), "%g", timeout_s);
      fail(std::runtime_error("rank " + std::to_string(rank) + " of " + std::to_string(nranks) +
                              ": timed out after " + secs + " s waiting for rank(s) " + who +
                              " to join the communicator (PYZERO_TEST_NCCL_TIMEOUT)"));
    }
    std::this_thread::sleep_for(std::chrono::microseconds(us));
    us = std::min(us * 2, 2000);
  }
  std::vector<std::string> all(nranks);
  for (int r = 0; r < nranks; ++r) all[r].assign(s->slots[r].data, s->slots[r].len);
  if (__atomic_add_fetch(&s->left, 1u, __ATOMIC_ACQ_REL) == uint32_t(nranks)) shm_unlink(name.c_str());
  munmap(p, sizeof(Segment));
  return all;
}

// ---- ncclGroupStart / ncclGroupEnd ----

// A send or receive held until its group ends. `bytes`: what NCCL compares between a send and
// its receive (counts times the datatype's size; the datatypes themselves need not agree).
struct P2POp {
  void* buf;
  int64_t bytes;
  int peer;
  bool is_send;
  uintptr_t stream;
};

// The calling thread's groups (NCCL's groups are per thread). `Comm` is any key.
template <typename Comm>
class GroupState {
 public:
  struct Batch {
    Comm comm;
    std::vector<P2POp> ops;
  };
  int depth() const { return depth_; }
  void start() { ++depth_; }
  // The batches to issue, in the order their communicators first appeared, when this ends the
  // outermost group; else none. std::logic_error without a group.
  std::vector<Batch> end() {
    if (depth_ == 0) throw std::logic_error("ncclGroupEnd without ncclGroupStart");
    if (--depth_ > 0) return {};
    std::vector<Batch> out;
    out.swap(pending_);
    return out;
  }
  // Holds `op` (inside a group); std::length_error (the group is left as it was) past kMaxGroupOps.
  void add(Comm comm, const P2POp& op) {
    for (Batch& b : pending_)
      if (b.comm == comm) {
        if (b.ops.size() >= size_t(kMaxGroupOps))
          throw std::length_error("the test NCCL library runs at most " + std::to_string(kMaxGroupOps) +
                                  " sends and receives per communicator in one group (one kernel); this group has "
                                  "more: split it into groups of at most " + std::to_string(kMaxGroupOps));
        b.ops.push_back(op);
        return;
      }
    pending_.push_back(Batch{comm, {op}});
  }
  // Drops what is held for `comm` (its communicator was aborted or destroyed).
  void forget(Comm comm) {
    for (size_t i = 0; i < pending_.size(); ++i)
      if (pending_[i].comm == comm) {
        pending_.erase(pending_.begin() + long(i));
        return;
      }
  }

 private:
  int depth_ = 0;
  std::vector<Batch> pending_;
};

// NCCL moves a point-to-point message as bytes; the ipc transport counts elements of a dtype.
// The element size every message is cut into (2 bytes: any even byte count), or 0 if `bytes` is odd.
inline int p2p_unit(int64_t bytes) { return bytes % 2 == 0 ? 2 : 0; }

}  // namespace pz::tnccl
