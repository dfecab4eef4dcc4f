// ipc_transport.h — the "ipc" backend: pyzero's own GPU collectives between the
// processes of one host, each rank's kernel reading and writing its peers'
// registered buffers directly (CUDA IPC: over NVLink/PCIe between GPUs, or
// within one GPU for several processes on it). No CUDA header is needed to
// include this file; the protocol and kernel bodies are ipc_protocol.h.
//
// Set-up: every rank allocates one buffer (IpcSignals, IpcP2PSignals, 2 areas
// of area_bytes, then n - 1 incoming point-to-point channels: ipc_p2p.h),
// exports it with cudaIpcGetMemHandle, and the Python layer passes every
// rank's handle (through the store) to connect(), which opens the peers'
// (cudaIpcOpenMemHandle, peer access enabled lazily by the driver).
//
// Streams, as the nccl backend: every call runs on the transport's own
// stream, after an event recorded on the caller's stream, so the group's
// kernels run one after another in call order (the protocol relies on it);
// a synchronous call then makes the caller's stream wait for it (no host
// block), an async call returns an IpcWork whose wait(stream) does the same.
//
// Failures: a kernel that waited past the timeout (a rank that never came),
// saw the abort word, or found a peer's call different, records it in a
// host-mapped status word and returns. A timeout or abort breaks the group:
// the next call, wait() or synchronize() raises CollectiveTimeout. A mismatch
// does not (every rank skipped that call alike): CollectiveError is raised by
// the first host wait (synchronize(), a barrier) for work issued after it, on
// every rank alike; unless the ranks ran the mismatched call as different
// numbers of launches or blocks (calls apart: a fault, see ipc_protocol.h). Once
// a rank's status holds a fault its kernels do nothing. close() sets the abort
// word, so kernels still waiting for peers end, then frees everything (after a
// normal close, when no peer reads or writes this rank's buffer any more).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "collective.h"
#include "reduce_math.h"

namespace pz {

struct IpcConfig {
  double timeout_s = 300.0;
  uint64_t area_bytes = 32ull << 20;  // per epoch parity; larger calls run in pieces
  uint64_t oneshot_bytes = 256 << 10;  // all_reduce: one-shot up to this many bytes per rank, two-shot above
  uint64_t p2p_bytes = 4ull << 20;  // point-to-point: one incoming channel (a rank holds n - 1)
  uint64_t p2p_slots = 4;           // slots per block's lane of a channel
  int sharing = 1;                  // processes of the job on each GPU (see ipc_blocks)
  // Blocks of every kernel, which every rank of the group must agree on (> 0; the Python layer passes
  // the group's smallest ipc_blocks); 0: ipc_blocks of this rank's GPU (connect() checks they agree).
  int blocks = 0;
  // The flags' ordering scope (see [Note: ipc flag scope]): false takes the GPU's scope where every rank
  // of the group is on one GPU (sharing == the group's size), true always the system's.
  bool system_scope = false;
};

// auto -> one-shot or two-shot for all_reduce (the only collective with a choice).
// Thresholds: vLLM's custom all-reduce switches at 256-512 KiB for 2-8 GPUs.
// Processes sharing one GPU (gpu_NVIDIA_H200_20261127b: 4 and 8 of them, one-shot
// still ahead at 512 KiB, two-shot at 8 MiB) share its memory and SMs, which
// GPUs joined by NVLink do not: a machine with several GPUs is to set ours.
// "ring": p2p_ring.h's schedule over the point-to-point channels (one launch per
// group of a send to the next rank and a receive from the previous), for the
// four ring collectives; at one rank there is no ring (one-shot).
inline Algo ipc_resolve_algo(Coll c, size_t bytes, Algo algo, size_t oneshot_bytes, int nranks) {
  if (algo == Algo::automatic)
    return (c == Coll::all_reduce && (bytes > oneshot_bytes && nranks > 2)) ? Algo::twoshot : Algo::oneshot;
  if (algo == Algo::oneshot || (algo == Algo::twoshot && c == Coll::all_reduce)) return algo;
  const bool ring_coll =
      c == Coll::all_reduce || c == Coll::reduce_scatter || c == Coll::all_gather || c == Coll::broadcast;
  if (algo == Algo::ring && ring_coll) return nranks > 1 ? Algo::ring : Algo::oneshot;
  throw std::invalid_argument(std::string(coll_name(c)) + ": the ipc backend takes algo " +
                              (c == Coll::all_reduce ? "'auto', 'oneshot', 'twoshot' or 'ring'"
                                                     : "'auto', 'oneshot' or 'ring'") +
                              ", got '" + algo_name(algo) + "'");
}

class IpcWork {
 public:
  struct State;
  explicit IpcWork(std::shared_ptr<State> s) : s_(std::move(s)) {}
  void wait(uintptr_t stream);  // `stream` waits for the operation; raises a recorded failure
  bool completed();  // (raises for a captured call: see captured())
  bool captured() const;  // issued into a CUDA graph capture: the host cannot wait for it
  void synchronize();  // the host waits; raises a recorded failure

 private:
  std::shared_ptr<State> s_;
};

class IpcTransport {
 public:
  using WorkPtr = std::shared_ptr<IpcWork>;

  IpcTransport(int rank, int size, int device, IpcConfig cfg);
  ~IpcTransport();
  IpcTransport(const IpcTransport&) = delete;
  IpcTransport& operator=(const IpcTransport&) = delete;

  // This rank's cudaIpcMemHandle_t (bytes), for the peers.
  std::string handle() const;
  // Every rank's handle, in rank order (this rank's own is skipped).
  void connect(const std::vector<std::string>& handles);

  int rank() const;
  int size() const;
  int device() const;
  uintptr_t stream() const;
  void set_timeout(double s);

  WorkPtr all_reduce(void* buf, const void* in, int64_t count, DType dt, RedOp op, Algo algo, uintptr_t stream,
                     bool async_op);
  WorkPtr reduce_scatter(void* out, const void* in, const std::vector<int64_t>& counts, DType dt, RedOp op,
                         Algo algo, uintptr_t stream, bool async_op);
  WorkPtr all_gather(void* out, const void* in, const std::vector<int64_t>& counts, DType dt, Algo algo,
                     uintptr_t stream, bool async_op);
  WorkPtr broadcast(void* buf, int64_t count, DType dt, int root, Algo algo, uintptr_t stream, bool async_op);
  // A synchronous barrier returns once every rank reached it (the host waits). `closing`: the
  // barrier a rank runs as it closes the group; a peer meeting it in another call learns that
  // this rank left (an error naming it) instead of mistaking it for a mismatched call.
  WorkPtr barrier(uintptr_t stream, bool async_op, bool closing = false);

  // Point-to-point (csrc/ipc_p2p.h): a send completes only once its receive is posted (NCCL's
  // rule); a batch is one kernel that progresses all its operations at once, so ranks that send
  // to each other in one batch never wait in a cycle. Sizes and dtypes of a send and its receive
  // must agree (else CollectiveError on both ranks at the next host wait, the message skipped).
  WorkPtr send(const void* buf, int64_t count, DType dt, int peer, uintptr_t stream, bool async_op);
  WorkPtr recv(void* buf, int64_t count, DType dt, int peer, uintptr_t stream, bool async_op);
  struct P2P {
    void* buf;
    int64_t count;
    DType dt;
    int peer;
    bool is_send;
  };
  WorkPtr batch_p2p(const std::vector<P2P>& ops, uintptr_t stream, bool async_op);

  std::map<std::string, OpStats> stats(bool reset);
  void close();

  struct Impl;

 private:
  std::shared_ptr<Impl> impl_;
};

}  // namespace pz
