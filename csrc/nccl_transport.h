// nccl_transport.h — the "nccl" backend: one NCCL communicator per group, on
// this rank's GPU. No CUDA or NCCL header is needed to include this file.
//
// Algorithms (nccl_resolve_algo is the one place that chooses):
//   native   each call is NCCL's own collective (ncclAllReduce, ncclReduceScatter,
//            ncclAllGather, ncclBroadcast; uneven counts as grouped
//            ncclReduce/ncclBroadcast): the baseline every benchmark shows.
//   ring     ring.h over grouped ncclSend/ncclRecv between neighbours into a
//            staging buffer, plus our reduce kernels (p2p_ring.h); fp16/bf16
//            partials travel as fp32, so results are bitwise those of the shm ring.
//   oneshot  all_reduce of small inputs: ncclAllGather of every rank's input,
//            then reduce_many in rank order: bitwise identical on every rank.
//
// Streams, as torch.distributed: a synchronous call is enqueued on the
// caller's stream and returns without waiting for the GPU (with
// blocking_wait, it waits on the host, so a timeout is raised by the call
// itself). async_op=True enqueues on the transport's stream after an event
// recorded on the caller's; the returned NcclWork's wait(stream) makes
// `stream` wait on an event recorded after the operation: no host block.
// Python owns every buffer and keeps it alive until the work completed or was
// waited on; C++ borrows it.
//
// [Note: ordering across streams]
// Every operation records an event after itself. An operation issued on a
// different stream from the previous one first waits on that event, so the
// group's operations run in call order whatever streams they were issued on,
// and the staging buffers are never used by two operations at once.
//
// [Note: nccl calls in a CUDA graph]
// A call issued while the caller's stream captures (torch.cuda.graph) becomes
// nodes of the graph: NCCL's kernels, pyzero's ring and one-shot kernels, the
// staging copies. An event cannot order work across the capture's boundary
// (CUDA refuses a dependency that crosses it), so the wait on the previous
// operation is made only when both lie on the same side of it (the same
// capture, or none); across it, stream order rules, as for any captured work:
// the graph replays where it is launched, and an eager call after a replay
// must be issued on that stream (or wait for it), as with torch's NCCL. A
// captured call is not given to the watchdog (its event cannot be polled; a
// replay that hangs is seen by the next eager call's deadline). Host waits are
// refused inside a capture before anything is issued: a synchronous barrier,
// blocking_wait, and synchronize()/is_completed() of a captured call. The
// watchdog thread polls in relaxed capture mode, so its queries never
// invalidate a capture running on another thread.
//
// Failures: an NCCL error throws CollectiveError naming the operation, rank,
// sequence number, ncclGetErrorString and ncclGetLastError. The communicator
// is non-blocking (config.blocking = 0), so set-up and connection are bounded
// by the timeout too. A watchdog thread polls the event of the oldest
// operation and ncclCommGetAsyncError: an operation not finished `timeout_s`
// after it was issued, or an asynchronous NCCL error, aborts the communicator
// (ncclCommAbort, which also ends the kernels still waiting for peers); from
// then on every call, wait() and synchronize() raise CollectiveTimeout (or
// CollectiveError) with the first cause. NCCL cannot tell which peer never
// arrived: a mismatched or missing call hangs until the timeout.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "collective.h"
#include "reduce_math.h"

namespace pz {

struct NcclConfig {
  double timeout_s = 300.0;
  size_t slice_bytes = 4 << 20;      // ring: the largest message, and each of its two staging buffers
  size_t oneshot_bytes = 256 << 10;  // one-shot all_reduce: the largest per-rank input
  bool blocking_wait = false;        // synchronous calls wait on the host for their completion
};

// `algo` as the nccl transport runs it, for a call with `bytes` of input per
// rank. auto is native for every size: NCCL's tuner already picks its own
// ring/tree algorithm and protocol by size and topology, and neither of ours
// is meant to beat it (the ring is the schedule shared with shm, checkable
// bitwise; one-shot is the deterministic small all_reduce).
inline Algo nccl_resolve_algo(Coll c, size_t bytes, Algo algo, size_t oneshot_bytes, int nranks) {
  bool ring_coll = c == Coll::all_reduce || c == Coll::reduce_scatter || c == Coll::all_gather ||
                   c == Coll::broadcast;
  switch (algo) {
    case Algo::automatic:
    case Algo::native:
      return Algo::native;
    case Algo::ring:
      if (!ring_coll) throw std::invalid_argument(std::string(coll_name(c)) + ": algo='ring' is not available");
      return Algo::ring;
    case Algo::oneshot:
      if (c != Coll::all_reduce)
        throw std::invalid_argument(std::string(coll_name(c)) +
                                    ": algo='oneshot' is only for all_reduce on the nccl backend; use "
                                    "'auto', 'native' or 'ring'");
      if (bytes > oneshot_bytes)
        throw std::invalid_argument("all_reduce: algo='oneshot' takes at most " + std::to_string(oneshot_bytes) +
                                    " bytes per rank on the nccl backend, got " + std::to_string(bytes) +
                                    "; use algo='auto', 'native' or 'ring'");
      if (nranks > kMaxReduceSources)  // reduce_many's source limit
        throw std::invalid_argument("all_reduce: algo='oneshot' takes at most " +
                                    std::to_string(kMaxReduceSources) + " ranks, the group has " +
                                    std::to_string(nranks));
      return Algo::oneshot;
    case Algo::twoshot:
      break;
  }
  throw std::invalid_argument("algo: expected 'auto', 'native', 'ring' or 'oneshot'");
}

class NcclTransport;

// Completion of one asynchronous operation: an event recorded after it.
class NcclWork {
 public:
  struct State;
  explicit NcclWork(std::shared_ptr<State> s) : s_(std::move(s)) {}
  // `stream` waits for the operation (no host block); raises the group's failure, if any.
  void wait(uintptr_t stream);
  // True once the operation finished on the GPU (or the group failed: wait() raises).
  bool completed();
  // Issued into a CUDA graph capture: synchronize() and completed() raise (no host can wait for it).
  bool captured() const;
  // Blocks the host until the operation finished; raises the group's failure.
  void synchronize();

 private:
  std::shared_ptr<State> s_;
};

class NcclTransport {
 public:
  using WorkPtr = std::shared_ptr<NcclWork>;  // null for synchronous calls

  // An ncclUniqueId (NCCL_UNIQUE_ID_BYTES bytes), made on one rank and handed to the others.
  static std::string unique_id();

  // Joins the communicator: blocks until every rank of the group joined (or the timeout).
  NcclTransport(const std::string& unique_id, int rank, int size, int device, NcclConfig cfg);
  ~NcclTransport();
  NcclTransport(const NcclTransport&) = delete;
  NcclTransport& operator=(const NcclTransport&) = delete;

  int rank() const;
  int size() const;
  int device() const;
  uintptr_t stream() const;  // the stream async_op work runs on
  void set_timeout(double s);

  // Collectives on device buffers already validated by the caller. `stream`
  // is the caller's current stream (a cudaStream_t).
  WorkPtr all_reduce(void* buf, int64_t count, DType dt, RedOp op, Algo algo, uintptr_t stream, bool async_op);
  WorkPtr reduce_scatter(void* out, const void* in, const std::vector<int64_t>& counts, DType dt, RedOp op,
                         Algo algo, uintptr_t stream, bool async_op);
  WorkPtr all_gather(void* out, const void* in, const std::vector<int64_t>& counts, DType dt, Algo algo,
                     uintptr_t stream, bool async_op);
  WorkPtr broadcast(void* buf, int64_t count, DType dt, int root, Algo algo, uintptr_t stream, bool async_op);
  // A synchronous barrier returns once every rank reached it (the host waits).
  WorkPtr barrier(uintptr_t stream, bool async_op);
  WorkPtr send(const void* buf, int64_t count, DType dt, int peer, uintptr_t stream, bool async_op);
  WorkPtr recv(void* buf, int64_t count, DType dt, int peer, uintptr_t stream, bool async_op);
  // Sends and receives posted together in one ncclGroupStart/End (NCCL needs
  // concurrent point-to-point calls grouped, or two ranks that both send first
  // wait on each other): e.g. a ring step's send to the next rank and receive
  // from the previous one. One operation, one Work.
  struct P2P {
    void* buf;
    int64_t count;
    DType dt;
    int peer;
    bool is_send;
  };
  WorkPtr batch_p2p(const std::vector<P2P>& ops, uintptr_t stream, bool async_op);

  std::map<std::string, OpStats> stats(bool reset);
  // Lets issued work finish, then frees the communicator (aborts it if that
  // fails or the group already failed). Later calls raise.
  void close();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;  // shared with in-flight NcclWork
};

}  // namespace pz
