// shm_transport.h — the "shm" transport: CPU processes of one host talking
// through POSIX shared memory (shm_segment.h: the segments, arrival, waits
// and channels). Collectives are in shm_transport.cpp, symmetric buffers in
// shm_symmetric.cpp. Python owns the user buffers; C++ borrows them for the
// duration of a call.
//
// Algorithms: ring (ring.h over the channel to the ring successor, pipelined
// in slices) and one-shot (every rank's input in its one-shot area, read by
// every peer after one arrival); `auto` picks by size (choose_algo).
//
// [Note: symmetric buffers]
// Besides the transport segment, a group can hold a "symmetric" segment per
// rank that every peer maps: fused ops (pyzero/symmetric.py) read their
// peers' data in place, like NVLink peer access, with no copy into or out of
// channel slots. Each fused call starts with sym_arrive, an ordinary
// collective arrival (descriptors compared, so a mismatched fused call or a
// plain collective on one rank fails on every rank): once it returns, every
// peer has finished the previous call and its reads, so the buffer can be
// rewritten. Within a call the owner store-releases `ready` (SymHeader,
// monotonic over the group's life) after writing the data it announces;
// readers wait for it. A larger request maps a new generation (collectively);
// older ones stay mapped until the group is destroyed, as tensors may still
// view them.
#pragma once

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include "collective.h"
#include "reduce_math.h"
#include "ring.h"
#include "shm_adapt.h"
#include "shm_segment.h"

namespace pz {

class ShmTransport {
 public:
  ShmTransport(std::string prefix, int rank, int size, ShmConfig cfg);
  ~ShmTransport();
  ShmTransport(const ShmTransport&) = delete;
  ShmTransport& operator=(const ShmTransport&) = delete;

  // Set-up in three steps separated by store barriers in Python:
  // construct (creates own segment) -> attach() (maps peers) -> unlink().
  void attach() { seg_.attach(); }
  void unlink() { seg_.unlink(); }

  int rank() const { return rank_; }
  int size() const { return n_; }
  const ShmConfig& config() const { return seg_.config(); }

  // Collectives; buffers already validated by the caller.
  // `in` (nullptr: `buf`, in place) is read and the result lands in `buf`.
  void all_reduce(void* buf, int64_t count, DType dt, RedOp op, Algo algo, const void* in = nullptr);
  void reduce_scatter(void* out, const void* in, const std::vector<int64_t>& counts, DType dt,
                      RedOp op, Algo algo);
  void all_gather(void* out, const void* in, const std::vector<int64_t>& counts, DType dt, Algo algo);
  void broadcast(void* buf, int64_t count, DType dt, int root, Algo algo);
  void barrier();
  // [Note: exchange probe] The time, in ns per 64-byte line, a rank takes to read lines its ring
  // predecessor has just written (median of `reps` rounds of `bytes`; a collective; 0 for one rank).
  double probe_exchange(size_t bytes, int reps);
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
  // Rank 0's view of auto's choice per size class ([Note: adaptive two-shot]; empty elsewhere).
  const AdaptTwoShot& adapt() const { return adapt_; }


 private:
  ShmSegments seg_;
  const int rank_, n_;
  OpCounters counters_;
  AdaptTwoShot adapt_;  // rank 0 measures and decides ([Note: adaptive two-shot])
  // The two-shot all_reduce ([Note: two-shot all_reduce]): a message in pieces that fit the area.
  struct TwoShotPieces {
    const ChunkLayout& L;
    int64_t per;     // elements of every chunk in one piece (the longest chunk: one piece)
    int64_t pieces;  // >= 1
    bool natural;    // one piece: chunks at their offsets in the message; else chunk p at p * per
    bool streamed;   // the area's lines are written with streaming stores (twoshot_stream_bytes and up)
    bool one_shot_order = false;  // sum in rank order, as the one-shot does (else the ring's order)
    // Piece k's part of chunk p: elements [begin(p, k), begin(p, k) + count(p, k)) of the message.
    int64_t begin(int p, int64_t k) const { return L.offsets[p] + k * per; }
    int64_t count(int p, int64_t k) const {
      int64_t left = L.counts[p] - k * per;
      return left <= 0 ? 0 : (left < per ? left : per);
    }
    int64_t slot(int p) const { return natural ? L.offsets[p] : int64_t(p) * per; }
  };
  // The message in pieces of at most `piece_bytes` (one piece where it fits).
  TwoShotPieces pieces_of(const ChunkLayout& L, DType dt, size_t piece_bytes) const;
  TwoShotPieces twoshot_pieces(const ChunkLayout& L, DType dt) const;
  // auto's pieces, where it chooses between the ring and the two-shot per piece ([Note: adaptive two-shot]).
  TwoShotPieces adaptive_pieces(const ChunkLayout& L, DType dt) const;
  uint64_t adaptive_all_reduce(void* buf, const void* in, const ChunkLayout& L, DType dt, RedOp op, uint64_t seq,
                               int cls, std::chrono::steady_clock::time_point t0);
  // Piece k of the two-shot, staged already: this rank's chunk reduced, then every peer's copied out.
  uint64_t twoshot_piece(void* buf, const void* in, const TwoShotPieces& P, int64_t k, DType dt, RedOp op,
                         uint64_t seq);
  // The ring all_reduce over elements [begin, end) of every chunk.
  uint64_t ring_all_reduce_part(void* buf, const void* in, const ChunkLayout& L, DType dt, RedOp op, int64_t begin,
                                int64_t end);
  uint64_t oneshot_reduce(void* buf, const void* in, int64_t count, DType dt, RedOp op, uint64_t seq);
  // Rank 0's choice for a piece of auto's all_reduce at the ring's sizes (its descriptor's word
  // for the first, its plan word for the others): the two-shot, or a long ring piece.
  static constexpr uint32_t kChoiceTwoshot = 1, kChoiceLong = 2;
  uint32_t leader_choice(int cls) const {
    return adapt_.want_twoshot(cls) ? kChoiceTwoshot : adapt_.want_long(cls) ? kChoiceLong : 0;
  }
  // Rank 0's last word per size class as this rank read it (adaptive one-shot sizes: whether
  // the next copy into the area is streamed, [Note: adaptive two-shot]).
  std::array<bool, AdaptTwoShot::kClasses> leader_seen_{};
  void stage_twoshot(const void* in, const TwoShotPieces& P, int64_t k, DType dt, uint64_t seq);
  uint64_t finish_twoshot(void* buf, const void* in, const TwoShotPieces& P, DType dt, RedOp op, uint64_t seq);
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
