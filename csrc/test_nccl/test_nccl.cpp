// test_nccl.cpp — a test NCCL library: NCCL's C API (the calls pyzero makes)
// over pyzero's ipc transport (csrc/ipc_transport.h), so that several
// processes sharing one GPU form a communicator, which real NCCL refuses.
// Built as libnccl.so.2 (CMake option PYZERO_TEST_NCCL, scripts/build_test_nccl.sh)
// against the real nccl.h, so its ABI is the one pyzero._C was compiled
// with; selected by PYZERO_NCCL_ROOT, never by default. It exports
// pyzeroTestNccl() (returns 1), by which pyzero tells it from NCCL.
//
// What it keeps of NCCL's rules:
//  * a send completes only once its receive is posted (the ipc channels'
//    handshake), and the sends and receives of one ncclGroupStart/End run as
//    one kernel at the outermost ncclGroupEnd, so two ranks that send to each
//    other in a group progress together; an unpaired send, or a receive
//    posted in a later group than its send on both sides, waits — until the
//    caller aborts the communicator (pyzero's watchdog), as on NCCL;
//  * collectives run in call order on the communicator (one stream inside);
//    a collective in a group is issued when it is called;
//  * non-blocking communicators (config.blocking = 0) answer ncclInProgress
//    while they connect and finalize; ncclCommGetAsyncError reports progress
//    and failures; ncclCommAbort ends kernels still waiting for peers.
// What it adds (NCCL would hang or corrupt instead): a collective whose
// arguments differ between ranks, or a send and receive of different sizes,
// are skipped on every rank and reported as ncclRemoteError, with the cause
// in ncclGetLastError, by ncclCommGetAsyncError and by the calls after them
// (see result_of); a kernel that waited longer than
// PYZERO_TEST_NCCL_KERNEL_TIMEOUT seconds (default a day) ends with
// ncclRemoteError. A group holds at most 32 sends and receives per
// communicator (ncclInvalidUsage beyond, with ncclGetLastError saying so).
//
// Rendezvous: rendezvous.h (a shared-memory segment named by the unique id),
// deadline PYZERO_TEST_NCCL_TIMEOUT seconds (default 300).
#include <cuda_runtime.h>
#include <nccl.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "collective.h"
#include "errors.h"
#include "ipc_transport.h"
#include "nccl_types.h"
#include "reduce_math.h"
#include "rendezvous.h"

extern "C" __attribute__((visibility("default"))) int pyzeroTestNccl(void) { return 1; }

namespace {

using pz::tnccl::P2POp;

double env_seconds(const char* name, double fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  double s = std::strtod(v, &end);
  return (end && *end == 0 && s > 0) ? s : fallback;
}

std::mutex g_error_mu;
std::string g_last_error;  // ncclGetLastError(NULL)

}  // namespace

struct ncclComm {
  int rank = 0, nranks = 1, device = 0;
  bool blocking = true;
  std::unique_ptr<pz::IpcTransport> t;

  std::mutex mu;
  std::string last_error;
  ncclResult_t async_error = ncclSuccess;  // sticky once set
  std::shared_ptr<pz::IpcWork> last;       // the latest operation issued
  // Where ncclCommGetAsyncError "waits" for `last` to read its failures without a host wait: a
  // stream of its own, never captured (the transport's stream may be part of a CUDA graph capture).
  cudaStream_t probe = nullptr;
  // set-up in the background (non-blocking communicators)
  std::thread init;
  std::atomic<bool> init_done{false}, stop{false};
  ncclResult_t init_result = ncclInProgress;
  // finalize
  std::shared_ptr<pz::IpcWork> closing;
  bool finalized = false;
};

namespace {

struct Group {
  pz::tnccl::GroupState<ncclComm*> g;
};
thread_local Group t_group;

ncclResult_t set_error(ncclComm* c, ncclResult_t r, const std::string& msg) {
  std::string text = "test NCCL library (pyzero): " + msg;
  if (c) c->last_error = text;
  std::lock_guard<std::mutex> lock(g_error_mu);
  g_last_error = text;
  return r;
}

// The NCCL result for a failure the ipc transport raised. A timeout, a peer that left and a call
// that differs from a peer's (a collective's arguments, a send's size against its receive's) are
// all failures of the group, not of this call's arguments: ncclRemoteError. (NCCL hangs on a
// mismatch; pyzero, as torch, reads ncclInvalidArgument / ncclInvalidUsage returned by a call as
// a rejected argument that left the communicator usable, which a mismatch does not.)
ncclResult_t result_of(const std::exception& e) {
  if (dynamic_cast<const std::invalid_argument*>(&e)) return ncclInvalidArgument;
  if (dynamic_cast<const pz::CollectiveError*>(&e))
    return std::strstr(e.what(), "CUDA error") ? ncclUnhandledCudaError : ncclRemoteError;
  return ncclInternalError;
}

// Records an asynchronous failure: the communicator reports it from then on.
ncclResult_t fail_async(ncclComm* c, const std::exception& e) {
  ncclResult_t r = result_of(e);
  if (c->async_error == ncclSuccess) c->async_error = r == ncclInvalidArgument ? ncclInternalError : r;
  set_error(c, c->async_error, e.what());
  return c->async_error;
}

int dtype_bytes(ncclDataType_t d) {
  switch (d) {
    case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
    case ncclFloat16: case ncclBfloat16: return 2;
    case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
    case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
    default: return 0;
  }
}

// A reduction's dtype and op, or ncclInvalidArgument naming what the library takes.
ncclResult_t reduction_args(ncclComm* c, const char* what, ncclDataType_t d, ncclRedOp_t o, pz::DType& dt,
                            pz::RedOp& op) {
  if (!pz::from_nccl(d, dt))
    return set_error(c, ncclInvalidArgument, std::string(what) + ": datatype " + std::to_string(int(d)) +
                                                 " is not one the test library reduces (float32, float16, "
                                                 "bfloat16, float64, int32, int64)");
  if (!pz::from_nccl(o, op))
    return set_error(c, ncclInvalidArgument, std::string(what) + ": reduction op " + std::to_string(int(o)) +
                                                 " is not one the test library takes (sum, prod, max, min, avg)");
  return ncclSuccess;
}

// A data movement's dtype and element count as the transport counts them: NCCL's own dtype where
// the transport has it, else 2-byte elements (any even byte count).
ncclResult_t movement_args(ncclComm* c, const char* what, ncclDataType_t d, size_t count, pz::DType& dt,
                           int64_t& n) {
  if (pz::from_nccl(d, dt)) {
    n = int64_t(count);
    return ncclSuccess;
  }
  const int es = dtype_bytes(d);
  if (es == 0) return set_error(c, ncclInvalidArgument, std::string(what) + ": unknown datatype " + std::to_string(int(d)));
  const uint64_t bytes = uint64_t(count) * uint64_t(es);
  if (bytes % 2)
    return set_error(c, ncclInvalidArgument, std::string(what) + ": the test library moves 1-byte datatypes in "
                                                 "even counts only, got " + std::to_string(count));
  dt = pz::DType::f16;
  n = int64_t(bytes / 2);
  return ncclSuccess;
}

// Whether `c` may take a call now; the error otherwise.
ncclResult_t usable(ncclComm* c, const char* what) {
  if (c == nullptr) return set_error(nullptr, ncclInvalidArgument, std::string(what) + ": comm is NULL");
  if (!c->init_done.load()) return set_error(c, ncclInvalidUsage, std::string(what) + ": the communicator is still "
                                                                      "connecting (poll ncclCommGetAsyncError)");
  if (c->init_result != ncclSuccess) return c->init_result;
  if (c->finalized) return set_error(c, ncclInvalidUsage, std::string(what) + ": the communicator was finalized");
  if (c->async_error != ncclSuccess) return c->async_error;
  return ncclSuccess;
}

// Runs `issue` (which returns the operation's work, async on the transport's stream) and makes
// `stream` wait for it; failures become NCCL results.
template <typename F>
ncclResult_t run(ncclComm* c, const char* what, cudaStream_t stream, F issue) {
  std::lock_guard<std::mutex> lock(c->mu);
  if (ncclResult_t r = usable(c, what)) return r;
  try {
    // A failure the previous operations met (a mismatch is known once they finished). Not while
    // `stream` captures a CUDA graph: an event query there would invalidate the capture.
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    if (cudaStreamIsCapturing(stream, &cs) == cudaSuccess && cs == cudaStreamCaptureStatusNone && c->last &&
        !c->last->captured() && c->last->completed())
      c->last->synchronize();
    std::shared_ptr<pz::IpcWork> w = issue();
    if (w) {
      c->last = w;
      w->wait(reinterpret_cast<uintptr_t>(stream));
    }
    return ncclSuccess;
  } catch (const std::invalid_argument& e) {
    return set_error(c, ncclInvalidArgument, e.what());  // nothing was issued
  } catch (const std::exception& e) {
    return fail_async(c, e);
  }
}

uintptr_t sp(cudaStream_t s) { return reinterpret_cast<uintptr_t>(s); }

// Issues one batch of held sends and receives: one kernel on the stream of the first, after the
// others' streams' work; every stream of the batch waits for it.
ncclResult_t issue_batch(ncclComm* c, const std::vector<P2POp>& ops) {
  std::vector<pz::IpcTransport::P2P> v;
  v.reserve(ops.size());
  for (const P2POp& o : ops) {
    if (o.bytes == 0) continue;
    v.push_back(pz::IpcTransport::P2P{o.buf, o.bytes / 2, pz::DType::f16, o.peer, o.is_send});
  }
  if (v.empty()) return ncclSuccess;
  cudaStream_t first = reinterpret_cast<cudaStream_t>(ops[0].stream);
  std::vector<cudaStream_t> others;
  for (const P2POp& o : ops) {
    cudaStream_t s = reinterpret_cast<cudaStream_t>(o.stream);
    bool seen = s == first;
    for (cudaStream_t x : others) seen = seen || x == s;
    if (!seen) others.push_back(s);
  }
  auto join = [](cudaStream_t from, cudaStream_t to) {  // `to` waits for `from`'s work so far
    cudaEvent_t e;
    if (cudaEventCreateWithFlags(&e, cudaEventDisableTiming) != cudaSuccess) return false;
    bool ok = cudaEventRecord(e, from) == cudaSuccess && cudaStreamWaitEvent(to, e, 0) == cudaSuccess;
    cudaEventDestroy(e);
    return ok;
  };
  for (cudaStream_t s : others)
    if (!join(s, first)) return set_error(c, ncclUnhandledCudaError, "ncclGroupEnd: cannot order the group's streams");
  ncclResult_t r = run(c, "ncclGroupEnd (send/recv)", first, [&] { return c->t->batch_p2p(v, sp(first), true); });
  if (r != ncclSuccess) return r;
  for (cudaStream_t s : others)
    if (!join(first, s)) return set_error(c, ncclUnhandledCudaError, "ncclGroupEnd: cannot order the group's streams");
  return ncclSuccess;
}

ncclResult_t p2p(const char* what, const void* buf, size_t count, ncclDataType_t d, int peer, ncclComm* c,
                 cudaStream_t stream, bool is_send) {
  if (ncclResult_t r = usable(c, what)) return r;
  const int es = dtype_bytes(d);
  if (es == 0) return set_error(c, ncclInvalidArgument, std::string(what) + ": unknown datatype " + std::to_string(int(d)));
  if (peer < 0 || peer >= c->nranks || peer == c->rank)
    return set_error(c, ncclInvalidArgument, std::string(what) + ": peer " + std::to_string(peer) +
                                                 " is not another rank of the communicator (0.." +
                                                 std::to_string(c->nranks - 1) + ", this is " +
                                                 std::to_string(c->rank) + ")");
  const int64_t bytes = int64_t(count) * es;
  if (pz::tnccl::p2p_unit(bytes) == 0)
    return set_error(c, ncclInvalidArgument, std::string(what) + ": the test library moves even byte counts only, got " +
                                                 std::to_string(bytes) + " bytes");
  if (bytes > 0 && buf == nullptr) return set_error(c, ncclInvalidArgument, std::string(what) + ": buffer is NULL");
  P2POp op{const_cast<void*>(buf), bytes, peer, is_send, sp(stream)};
  Group& gr = t_group;
  if (gr.g.depth() == 0) return issue_batch(c, {op});  // outside a group: a group of its own
  try {
    gr.g.add(c, op);
  } catch (const std::length_error& e) {
    return set_error(c, ncclInvalidUsage, std::string(what) + ": " + e.what());
  }
  return ncclSuccess;
}

// ---- set-up ----

void connect(ncclComm* c, std::string name) {
  ncclResult_t r = ncclSuccess;
  try {
    pz::IpcConfig cfg;
    cfg.timeout_s = env_seconds("PYZERO_TEST_NCCL_KERNEL_TIMEOUT", 86400.0);
    // The ranks share the GPUs this process sees (rank r on r % count, as pyzero puts them): the kernels
    // are sized for that many processes per GPU (pz::ipc_blocks), the same on every rank.
    int count = 1;
    if (cudaGetDeviceCount(&count) != cudaSuccess || count < 1) count = 1;
    cfg.sharing = (c->nranks + count - 1) / count;
    c->t = std::make_unique<pz::IpcTransport>(c->rank, c->nranks, c->device, cfg);
    int prev = 0;
    if (cudaGetDevice(&prev) != cudaSuccess || cudaSetDevice(c->device) != cudaSuccess ||
        cudaStreamCreateWithFlags(&c->probe, cudaStreamNonBlocking) != cudaSuccess || cudaSetDevice(prev) != cudaSuccess)
      throw pz::CollectiveError("CUDA error: cannot create the communicator's stream");
    std::vector<std::string> handles =
        pz::tnccl::rendezvous(name, c->rank, c->nranks, c->t->handle(), env_seconds("PYZERO_TEST_NCCL_TIMEOUT", 300.0),
                              [c] { return c->stop.load(); });
    c->t->connect(handles);
  } catch (const std::invalid_argument& e) {
    r = set_error(c, ncclInvalidArgument, std::string("ncclCommInitRank: ") + e.what());
  } catch (const std::exception& e) {
    r = set_error(c, std::strstr(e.what(), "CUDA error") ? ncclUnhandledCudaError : ncclSystemError,
                  std::string("ncclCommInitRank: ") + e.what());
  }
  c->init_result = r;
  c->init_done.store(true);
}

ncclResult_t init_rank(ncclComm_t* out, int nranks, const ncclUniqueId& id, int rank, const ncclConfig_t* config) {
  if (out == nullptr) return set_error(nullptr, ncclInvalidArgument, "ncclCommInitRank: comm is NULL");
  *out = nullptr;
  if (nranks < 1 || nranks > pz::tnccl::kMaxRanks)
    return set_error(nullptr, ncclInvalidArgument, "ncclCommInitRank: nranks must be 1.." +
                                                       std::to_string(pz::tnccl::kMaxRanks) + ", got " +
                                                       std::to_string(nranks));
  if (rank < 0 || rank >= nranks)
    return set_error(nullptr, ncclInvalidArgument, "ncclCommInitRank: rank " + std::to_string(rank) +
                                                       " is not in [0, " + std::to_string(nranks) + ")");
  std::string name;
  try {
    name = pz::tnccl::segment_name(id.internal);
  } catch (const std::invalid_argument& e) {
    return set_error(nullptr, ncclInvalidArgument, std::string("ncclCommInitRank: ") + e.what());
  }
  auto* c = new ncclComm;
  c->rank = rank;
  c->nranks = nranks;
  if (cudaGetDevice(&c->device) != cudaSuccess) {
    delete c;
    return set_error(nullptr, ncclUnhandledCudaError, "ncclCommInitRank: cudaGetDevice failed");
  }
  c->blocking = !(config && config->blocking == 0);
  *out = c;
  if (c->blocking) {
    connect(c, name);
    return c->init_result;
  }
  c->init = std::thread(connect, c, name);
  return ncclInProgress;
}

void join_init(ncclComm* c) {
  if (c->init.joinable()) c->init.join();
}

}  // namespace

// ---------------------------------------------------------------------------
// The API

extern "C" {

ncclResult_t ncclGetVersion(int* version) {
  if (!version) return ncclInvalidArgument;
  *version = NCCL_VERSION_CODE;
  return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId* uniqueId) {
  if (!uniqueId) return set_error(nullptr, ncclInvalidArgument, "ncclGetUniqueId: uniqueId is NULL");
  pz::tnccl::make_unique_id(uniqueId->internal);
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
    case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
    case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
    case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
    case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
    case ncclRemoteError: return "remote process exited or there was a network error";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclTimeout: return "timeout";
    default: return "unknown result code";
  }
}

const char* ncclGetLastError(ncclComm_t comm) {
  if (comm) return comm->last_error.c_str();
  std::lock_guard<std::mutex> lock(g_error_mu);
  return g_last_error.c_str();
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank,
                                    ncclConfig_t* config) {
  return init_rank(comm, nranks, commId, rank, config);
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId commId, int rank) {
  return init_rank(comm, nranks, commId, rank, nullptr);
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
  if (!comm || !asyncError) return set_error(comm, ncclInvalidArgument, "ncclCommGetAsyncError: NULL argument");
  if (!comm->init_done.load()) {
    *asyncError = ncclInProgress;
    return ncclSuccess;
  }
  join_init(comm);
  std::lock_guard<std::mutex> lock(comm->mu);
  if (comm->init_result != ncclSuccess) {
    *asyncError = comm->init_result;
    return ncclSuccess;
  }
  if (comm->async_error != ncclSuccess) {
    *asyncError = comm->async_error;
    return ncclSuccess;
  }
  *asyncError = ncclSuccess;
  try {
    if (comm->closing) {  // a non-blocking finalize
      if (!comm->closing->completed()) {
        *asyncError = ncclInProgress;
        return ncclSuccess;
      }
      comm->closing->synchronize();  // (done: raises what it met)
      comm->closing.reset();
      return ncclSuccess;
    }
    std::shared_ptr<pz::IpcWork> w = comm->last;
    if (w && !w->captured()) {
      // A finished operation: every failure up to it, mismatches included (a host wait for
      // finished work); else the timeouts and aborts recorded so far.
      if (w->completed()) w->synchronize();
      else w->wait(reinterpret_cast<uintptr_t>(comm->probe));
    }
  } catch (const std::exception& e) {
    *asyncError = fail_async(comm, e);
  }
  return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int* count) {
  if (!comm || !count) return ncclInvalidArgument;
  *count = comm->nranks;
  return ncclSuccess;
}

ncclResult_t ncclCommCuDevice(const ncclComm_t comm, int* device) {
  if (!comm || !device) return ncclInvalidArgument;
  *device = comm->device;
  return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int* rank) {
  if (!comm || !rank) return ncclInvalidArgument;
  *rank = comm->rank;
  return ncclSuccess;
}

// Every rank meets in a closing barrier (a peer still waiting for this rank in another call learns
// that it left), bounded by PYZERO_TEST_NCCL_TIMEOUT; then no call is taken.
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
  const char* what = "ncclCommFinalize";
  if (ncclResult_t r = usable(comm, what)) return r;
  std::unique_lock<std::mutex> lock(comm->mu);
  try {
    comm->t->set_timeout(std::min(env_seconds("PYZERO_TEST_NCCL_KERNEL_TIMEOUT", 86400.0),
                                  env_seconds("PYZERO_TEST_NCCL_TIMEOUT", 300.0)));
    comm->closing = comm->t->barrier(comm->t->stream(), true, /*closing=*/true);
    comm->finalized = true;
    if (!comm->blocking) return ncclInProgress;
    comm->closing->synchronize();
    comm->closing.reset();
    return ncclSuccess;
  } catch (const std::exception& e) {
    comm->finalized = true;
    comm->closing.reset();
    return fail_async(comm, e);
  }
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  comm->stop.store(true);  // a rendezvous in progress ends
  join_init(comm);
  t_group.g.forget(comm);
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    comm->last.reset();
    comm->closing.reset();
    if (comm->t) comm->t->close();  // sets the abort word: this rank's waiting kernels end
    comm->t.reset();
    if (comm->probe) cudaStreamDestroy(comm->probe);
    comm->probe = nullptr;
  }
  delete comm;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  if (!comm) return ncclSuccess;
  join_init(comm);
  bool finalize = false;
  {
    std::lock_guard<std::mutex> lock(comm->mu);
    finalize = comm->init_result == ncclSuccess && !comm->finalized && comm->async_error == ncclSuccess;
  }
  if (finalize) {  // as NCCL: destroy finalizes a communicator that was not
    comm->blocking = true;
    ncclCommFinalize(comm);
  } else {
    std::lock_guard<std::mutex> lock(comm->mu);
    try {
      if (comm->closing) comm->closing->synchronize();  // a non-blocking finalize not polled to its end
    } catch (const std::exception&) {
    }
  }
  return ncclCommAbort(comm);  // frees: every kernel of this rank has finished
}

ncclResult_t ncclGroupStart() {
  t_group.g.start();
  return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
  std::vector<pz::tnccl::GroupState<ncclComm*>::Batch> batches;
  try {
    batches = t_group.g.end();
  } catch (const std::logic_error& e) {
    return set_error(nullptr, ncclInvalidUsage, e.what());
  }
  ncclResult_t first = ncclSuccess;
  for (auto& b : batches) {
    ncclResult_t r = issue_batch(b.comm, b.ops);
    if (first == ncclSuccess) first = r;
  }
  return first;
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p("ncclSend", sendbuff, count, datatype, peer, comm, stream, true);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return p2p("ncclRecv", recvbuff, count, datatype, peer, comm, stream, false);
}

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const char* what = "ncclAllReduce";
  if (ncclResult_t r = usable(comm, what)) return r;
  pz::DType dt;
  pz::RedOp o;
  if (ncclResult_t r = reduction_args(comm, what, datatype, op, dt, o)) return r;
  return run(comm, what, stream, [&] {
    return comm->t->all_reduce(recvbuff, sendbuff, int64_t(count), dt, o, pz::Algo::automatic, sp(stream), true);
  });
}

// Reduce to `root`: a reduce_scatter whose only chunk is the root's.
ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
  const char* what = "ncclReduce";
  if (ncclResult_t r = usable(comm, what)) return r;
  pz::DType dt;
  pz::RedOp o;
  if (ncclResult_t r = reduction_args(comm, what, datatype, op, dt, o)) return r;
  if (root < 0 || root >= comm->nranks)
    return set_error(comm, ncclInvalidArgument, std::string(what) + ": root " + std::to_string(root) + " is not a rank");
  std::vector<int64_t> counts(comm->nranks, 0);
  counts[root] = int64_t(count);
  return run(comm, what, stream, [&] {
    return comm->t->reduce_scatter(recvbuff, sendbuff, counts, dt, o, pz::Algo::oneshot, sp(stream), true);
  });
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
  const char* what = "ncclReduceScatter";
  if (ncclResult_t r = usable(comm, what)) return r;
  pz::DType dt;
  pz::RedOp o;
  if (ncclResult_t r = reduction_args(comm, what, datatype, op, dt, o)) return r;
  std::vector<int64_t> counts(comm->nranks, int64_t(recvcount));
  return run(comm, what, stream, [&] {
    return comm->t->reduce_scatter(recvbuff, sendbuff, counts, dt, o, pz::Algo::oneshot, sp(stream), true);
  });
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
  const char* what = "ncclAllGather";
  if (ncclResult_t r = usable(comm, what)) return r;
  pz::DType dt;
  int64_t n = 0;
  if (ncclResult_t r = movement_args(comm, what, datatype, sendcount, dt, n)) return r;
  std::vector<int64_t> counts(comm->nranks, n);
  return run(comm, what, stream, [&] {
    return comm->t->all_gather(recvbuff, sendbuff, counts, dt, pz::Algo::oneshot, sp(stream), true);
  });
}

// Out of place, the root first copies its input into its output (on `stream`, before the call).
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  const char* what = "ncclBroadcast";
  if (ncclResult_t r = usable(comm, what)) return r;
  pz::DType dt;
  int64_t n = 0;
  if (ncclResult_t r = movement_args(comm, what, datatype, count, dt, n)) return r;
  if (root < 0 || root >= comm->nranks)
    return set_error(comm, ncclInvalidArgument, std::string(what) + ": root " + std::to_string(root) + " is not a rank");
  if (comm->rank == root && sendbuff != recvbuff && n > 0 &&
      cudaMemcpyAsync(recvbuff, sendbuff, size_t(n) * size_t(pz::dtype_size(dt)), cudaMemcpyDeviceToDevice, stream) !=
          cudaSuccess)
    return set_error(comm, ncclUnhandledCudaError, std::string(what) + ": cudaMemcpyAsync failed");
  return run(comm, what, stream, [&] {
    return comm->t->broadcast(recvbuff, n, dt, root, pz::Algo::oneshot, sp(stream), true);
  });
}

}  // extern "C"
