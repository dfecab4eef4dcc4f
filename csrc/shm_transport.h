// shm_transport.h — the "shm" transport: CPU processes of one host talking
// through POSIX shared memory.
//
// Each rank creates one segment and maps every peer's. Python owns the user
// buffers; C++ borrows them for the duration of a call. A segment holds:
//
//   RankCtrl          arrival sequence, one-shot read progress, call
//                     descriptors, abort flag, pid
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
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "collective.h"
#include "reduce_math.h"
#include "ring.h"

namespace pz {

// What every rank must agree on for one call; compared across ranks.
struct alignas(64) CallDesc {
  uint64_t seq;
  int32_t coll, op, dtype, root, algo, pad;
  int64_t count;        // total elements (full buffer for reduce_scatter/all_gather)
  uint64_t counts_hash; // hash of the per-rank counts
};
static_assert(sizeof(CallDesc) == 64, "CallDesc lives in shared memory");

struct alignas(64) RankCtrl {
  alignas(64) std::atomic<uint64_t> arrived;
  std::atomic<uint32_t> arrived_waiters;  // see [Note: futex wake-ups]
  alignas(64) std::atomic<uint32_t> aborted;  // 1: failed (error), 2: failed (timeout / dead peer)
  int32_t pid;
  CallDesc desc[2];
  char abort_reason[384];  // written before `aborted`, so peers can pass the cause on
};
static_assert(sizeof(RankCtrl) == 2 * 64 + 2 * sizeof(CallDesc) + 384, "RankCtrl lives in shared memory");

struct alignas(64) ChanCtrl {
  alignas(64) std::atomic<uint64_t> sent;
  std::atomic<uint32_t> sent_waiters;
  alignas(64) std::atomic<uint64_t> consumed;
  std::atomic<uint32_t> consumed_waiters;
};
static_assert(sizeof(ChanCtrl) == 128, "ChanCtrl: one cache line per writer");

// Header of a send/recv message, carried in the message's first slot.
struct alignas(16) P2PHeader {
  int64_t count;
  int32_t dtype;
  int32_t pad;
};

// [Note: symmetric buffers]
// Besides the transport segment, a group can hold a "symmetric" segment per
// rank that every peer maps: fused ops (pyzero/symmetric.py) read their
// peers' data in place, like NVLink peer access, with no copy into or out of
// channel slots. Each fused call starts with sym_arrive, an ordinary
// collective arrival (descriptors compared, so a mismatched fused call or a
// plain collective on one rank fails on every rank): once it returns, every
// peer has finished the previous call and its reads, so the buffer can be
// rewritten. Within a call the owner store-releases `ready` (monotonic over
// the group's life) after writing the data it announces; readers wait for
// it. A larger request maps a new generation (collectively); older ones
// stay mapped until the group is destroyed, as tensors may still view them.
struct alignas(64) SymHeader {
  alignas(64) std::atomic<uint64_t> ready;
  std::atomic<uint32_t> ready_waiters;
};
constexpr size_t kSymHeaderBytes = 4096;
constexpr int kSymCollBase = 64;  // CallDesc.coll of fused op `kind`: kSymCollBase + kind

// The fused symmetric ops (pyzero/symmetric.py), by the `kind` code of sym_arrive.
enum class SymKind : int32_t { all_gather = 0, reduce_scatter = 1 };
constexpr int kNumSymKinds = 2;
const char* sym_kind_name(SymKind k);

struct ShmConfig {
  size_t slice_bytes = 256 << 10;
  int depth = 8;
  size_t oneshot_bytes = 256 << 10;  // largest per-rank input the one-shot path takes
  double timeout_s = 300.0;
};

class ShmTransport {
 public:
  ShmTransport(std::string prefix, int rank, int size, ShmConfig cfg);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Set-up in three steps separated by store barriers in Python:
  // construct (creates own segment) -> attach() (maps peers) -> unlink().
  void attach();
  void unlink();

  int rank() const { return rank_; }
  int size() const { return n_; }
  const ShmConfig& config() const { return cfg_; }
  void set_timeout(double s) { cfg_.timeout_s = s; }

  // Collectives; buffers already validated by the caller.
  void all_reduce(void* buf, int64_t count, DType dt, RedOp op, Algo algo);
  void reduce_scatter(void* out, const void* in, const std::vector<int64_t>& counts, DType dt,
                      RedOp op, Algo algo);
  void all_gather(void* out, const void* in, const std::vector<int64_t>& counts, DType dt, Algo algo);
  void broadcast(void* buf, int64_t count, DType dt, int root, Algo algo);
  void barrier();
  void send(const void* buf, int64_t count, DType dt, int dst);
  void recv(void* buf, int64_t count, DType dt, int src);

  // Symmetric buffers (see [Note: symmetric buffers]). Set-up is collective,
  // in three steps separated by barriers: sym_create -> sym_attach -> sym_unlink.
  void sym_create(size_t bytes);
  void sym_attach();
  void sym_unlink();
  size_t sym_bytes() const { return sym_bytes_; }
  char* sym_data(int r) const { return sym_maps_.at(r) + kSymHeaderBytes; }
  // Enter fused op `kind` (a collective call, checked against the peers' like
  // any other): afterwards every peer is in this call, so every read of the
  // previous fused call is over and the buffers may be rewritten.
  void sym_arrive(int kind, int64_t count, DType dt, const std::vector<int64_t>& dims);
  void sym_signal(uint64_t value);                            // store-release own `ready`
  void sym_wait(int peer, uint64_t value, const char* what);  // until peer's ready >= value

  // The algorithm `auto` picks for a call of `bytes` (per-rank input bytes).
  Algo choose_algo(Coll c, size_t bytes) const;
  // `algo` as given, or auto's choice; rejects one-shot for too large inputs.
  Algo resolve(Coll c, size_t bytes, Algo algo) const;
  std::map<std::string, OpStats> stats(bool reset) { return counters_.read(reset); }

  // ---- used by the ring primitives ----
  struct Chan {
    ChanCtrl* ctrl;
    char* slots;
    int peer;          // the rank on the other end
    uint64_t local;    // this side's own counter (sent or consumed)
    const char* what;  // the operation using it, for errors
  };
  void* send_acquire(Chan& c);
  void send_post(Chan& c, size_t bytes);
  const void* recv_acquire(Chan& c);
  void recv_release(Chan& c);

 private:
  char* seg(int r) const { return maps_[r]; }
  RankCtrl* ctrl(int r) const { return reinterpret_cast<RankCtrl*>(maps_[r]); }
  ChanCtrl* chan_ctrl(int owner, int idx) const;
  char* chan_slots(int owner, int idx) const;
  char* area(int r, uint64_t seq) const;

  // Enter collective `d`: publish the descriptor (and one-shot data already
  // written), wait for every peer, compare descriptors.
  void arrive(const CallDesc& d, const char* what);
  // Wait until ready(); `word`/`waiters`: the counter ready() watches and its
  // waiter count, for futex wake-ups (see [Note: futex wake-ups]).
  template <typename Pred>
  void wait_for(Pred ready, int peer, const char* what, const std::atomic<uint64_t>* word = nullptr,
                std::atomic<uint32_t>* waiters = nullptr);
  [[noreturn]] void fail_timeout(int peer, const char* what);
  [[noreturn]] void fail_aborted(int peer, const char* what);
  void mark_broken(const std::string& why, bool timeout);
  void check_usable(const char* what);
  std::string where(const char* what) const;
  std::string describe(const CallDesc& d) const;
  bool peer_alive(int r) const;
  uint64_t begin(const char* what);  // checks the group, returns the new seq

  template <typename T> void ring_all_reduce_t(T* buf, int64_t count, RedOp op);
  template <typename T> void ring_reduce_scatter_t(T* out, const T* in, const ChunkLayout& L, RedOp op);
  template <typename T> void ring_all_gather_t(T* out, const ChunkLayout& L);
  template <typename T> void ring_broadcast_t(T* buf, int64_t count, int root);

  std::string prefix_;
  int rank_, n_;
  ShmConfig cfg_;
  size_t seg_bytes_ = 0, ctrl_bytes_ = 0, area_bytes_ = 0;
  std::vector<char*> maps_;
  bool unlinked_ = false;
  std::atomic<bool> broken_{false};
  std::string broken_why_;
  uint64_t seq_ = 0;                  // collectives entered by this rank
  std::vector<uint64_t> send_local_, recv_local_;  // p2p counters (n) + ring (index n)
  OpCounters counters_;
  // symmetric buffers: current generation's maps, older generations (kept mapped)
  std::vector<char*> sym_maps_;
  std::vector<std::pair<char*, size_t>> sym_old_;
  size_t sym_bytes_ = 0;
  int sym_gen_ = 0;
  bool sym_unlinked_ = true;
  SymHeader* sym_header(int r) const { return reinterpret_cast<SymHeader*>(sym_maps_.at(r)); }
  void sym_release();
};

}  // namespace pz
