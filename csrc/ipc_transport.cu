// ipc_transport.cu — the ipc backend on the GPU: registered buffers shared
// through CUDA IPC, one kernel per call (or per piece of a large call)
// running ipc_protocol.h's body. See ipc_transport.h.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstddef>
#include <cstring>
#include <mutex>
#include <sstream>
#include <stdexcept>

#include "collective.h"
#include "cuda_api.h"
#include "cuda_check.h"
#include "errors.h"
#include "ipc_p2p.h"
#include "ipc_protocol.h"
#include "ipc_transport.h"
#include "p2p_ring.h"

namespace pz {

namespace {

// [Note: ipc flag scope]
// A flag's release store and the acquire loads that wait for it order the data writes before it for
// the threads that see it. Ranks on other GPUs (peer memory over NVLink or PCIe) need system scope: on
// sm_90 each release is then a MEMBAR.ALL.SYS, which waits until the block's writes are visible to the
// whole system. Where every rank of the group runs on one GPU (several processes sharing it, under MPS
// or taking turns), all their threads are that GPU's and every flag and area is in its memory: GPU
// scope orders them (MEMBAR.ALL.GPU; the acquire loads still read at L2 and invalidate L1), and the
// call's kernel is the same otherwise. IpcConfig::system_scope (option `system_scope`,
// PYZERO_IPC_SYSTEM_SCOPE) keeps system scope there too. The closing flags (ipc_announce_closed_kernel)
// always use system scope.

// The executor of ipc_protocol.h on the GPU: a block of kThreads threads.
struct GpuX {
  bool gpu_scope = false;  // see [Note: ipc flag scope]
  __device__ int block() const { return int(blockIdx.x); }
  __device__ int nblocks() const { return int(gridDim.x); }
  __device__ int tid() const { return int(threadIdx.x); }
  __device__ int nthreads() const { return int(blockDim.x); }
  __device__ void sync() { __syncthreads(); }
  __device__ bool sync_and(bool v) { return __syncthreads_and(v) != 0; }
  __device__ void path(bool) {}
  // The point-to-point progress of the block's operations (ipc_p2p.h): one copy per block.
  __device__ IpcP2PState* p2p_state() {
    __shared__ IpcP2PState st[kIpcMaxP2POps];
    return st;
  }
  __device__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
  }
  __device__ void store_release(uint64_t* p, uint64_t v) {
    if (gpu_scope)
      asm volatile("st.release.gpu.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
    else
      asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
  }
  __device__ uint64_t load_acquire(const uint64_t* p) {
    uint64_t v;
    if (gpu_scope)
      asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    else
      asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
  }
  __device__ uint32_t load_relaxed(const uint32_t* p) { return *reinterpret_cast<const volatile uint32_t*>(p); }
  __device__ void fence() { __threadfence_system(); }
  // The block's epoch (see [Note: ipc epochs live on the device]): counted in the rank's own signals,
  // which only this block of this rank writes; the kernel boundary orders it between calls.
  __device__ uint64_t next_epoch(uint64_t* counter) {
    __shared__ uint64_t e;
    if (threadIdx.x == 0) {
      e = *counter + 1;
      *counter = e;
    }
    __syncthreads();
    return e;
  }
  // A failure's claim ([Note: ipc failures]): in this rank's own device memory, used by its blocks only
  // (the status itself is host-mapped: no system-scope atomics assumed there, x86 hosts often lack them).
  __device__ bool claim(uint64_t* word, uint64_t id) {
    return atomicMax(reinterpret_cast<unsigned long long*>(word), static_cast<unsigned long long>(id)) < id;
  }
};

template <typename T, RedOp OP>
__global__ void ipc_kernel(IpcCall c) {
  GpuX x;
  x.gpu_scope = c.gpu_scope != 0;
  ipc_run<T, OP>(x, c);
}

__global__ void ipc_p2p_kernel(IpcP2PCall c) {
  GpuX x;
  x.gpu_scope = c.gpu_scope != 0;
  ipc_p2p_run(x, c);
}

// This rank closes: closed[rank] = kIpcClosing or kIpcLeft in every peer's signals ([Note: a peer that
// closed]), after its earlier kernels on the stream (their flags first: a fence, then release stores).
struct IpcClosedFlags {
  uint64_t* flag[kIpcMaxRanks];  // a peer's IpcSignals::closed[rank], or null
  uint64_t value;
};

__global__ void ipc_announce_closed_kernel(IpcClosedFlags f) {
  GpuX x;
  x.fence();
  for (int p = 0; p < kIpcMaxRanks; ++p)
    if (f.flag[p] != nullptr) x.store_release(f.flag[p], f.value);
}

constexpr int kThreads = 512;

// Loads this file's kernels and the element-wise ones on the current device before the first call
// (kernels.cu's [Note: kernels loaded before the first call]): a lazy load at a launch would wait for
// the process's kernels already queued, an ipc kernel waiting for its peers among them.
void preload_ipc_kernels() {
  static OncePerDevice once;
  once([] {
    for (DType dt : kAllDTypes)
      for (RedOp op : kAllRedOps)
        PZ_DISPATCH_DTYPE(dt, T,
                          PZ_DISPATCH_OP(op, OP, { load_kernel(reinterpret_cast<const void*>(&ipc_kernel<T, OP>)); }));
    load_kernel(reinterpret_cast<const void*>(&ipc_p2p_kernel));
    load_kernel(reinterpret_cast<const void*>(&ipc_announce_closed_kernel));
  });
  pz::cuda::preload_kernels();  // (once per device itself)
}

// A rank's registered buffer: IpcSignals | IpcP2PSignals | area 0 | area 1 | n - 1 incoming channels.
size_t p2p_sig_offset() { return round_up(sizeof(IpcSignals), 256); }
size_t sig_bytes() { return p2p_sig_offset() + round_up(sizeof(IpcP2PSignals), 256); }

const char* p2p_dtype_name(int32_t dt) {
  return dt >= 0 && dt < kNumDTypes ? dtype_name(DType(dt)) : "?";
}


}  // namespace

struct IpcWork::State {
  std::weak_ptr<IpcTransport::Impl> impl;
  std::shared_ptr<Event> done;  // recorded after the call's kernels (from the group's EventPool)
  int device = 0;
  const char* what = "";
  uint64_t seq = 0;  // the host's number of the call's last launch
  bool captured = false;  // issued into a CUDA graph capture: no host wait can see it
};

struct IpcTransport::Impl {
  int rank, size, device, nblocks = 1;
  IpcConfig cfg;
  char* mine = nullptr;                 // this rank's registered buffer
  std::vector<char*> bases;             // every rank's, mapped here
  IpcStatus* status_host = nullptr;     // host-mapped
  IpcStatus* status_dev = nullptr;
  uint32_t* abort_host = nullptr;       // host-mapped
  uint32_t* abort_dev = nullptr;
  cudaStream_t stream = nullptr;
  std::unique_ptr<Event> queued;        // recorded on the caller's stream: the group's stream waits for it
  std::unique_ptr<Event> finished;      // after a synchronous call: the caller's stream waits for it
  std::shared_ptr<EventPool> events = EventPool::make();  // an async call's completion event
  uint64_t seq = 0;                     // launches so far (the epochs are counted on the device)
  uint64_t slot_bytes = 0, chan_bytes = 0;  // point-to-point: a slot, one incoming channel
  char* ring_stage = nullptr;           // algo="ring": send and receive staging, p2p_bytes each
  bool connected = false, closed = false;
  uint64_t announced_closed = 0;        // what this rank told its peers: kIpcClosing, kIpcLeft, or 0
  std::string broken;                   // the failure that ended the group
  std::mutex mu;
  OpCounters counters;

  void check_usable(const char* what) {
    if (closed) throw CollectiveError(std::string(what) + ": the ipc group was closed");
    if (!connected) throw CollectiveError(std::string(what) + ": the ipc group is not connected");
    if (!broken.empty()) throw CollectiveTimeout(std::string(what) + ": the ipc group is unusable after: " + broken);
    raise_status(what, 0);
  }

  // A failure a kernel recorded ([Note: ipc failures]). A fault (a timeout, an abort, a peer that
  // closed, calls apart) breaks the group: raised from then on. A mismatch is raised once, and only where
  // every rank sees it alike: by a host wait for work whose kernels (launches up to `upto`) all finished,
  // so no rank raises it before the others. (A replayed graph's kernel reports the number its launch got
  // at capture: not later than now.)
  static IpcFailure read_failure(const volatile IpcFailure* v) {
    IpcFailure s;
    s.code = v->code;  // written last by the device
    s.peer = v->peer;
    s.epoch = v->epoch;
    s.seq = v->seq;
    s.p2p = v->p2p;
    s.bytes = v->bytes;
    s.peer_bytes = v->peer_bytes;
    s.dtype = v->dtype;
    s.peer_dtype = v->peer_dtype;
    s.launches = v->launches;
    s.peer_launches = v->peer_launches;
    s.blocks = v->blocks;
    s.peer_blocks = v->peer_blocks;
    return s;
  }

  // What differs where calls came apart (kIpcApart): the launches of a call or the blocks of a kernel.
  static std::string apart_what(const IpcFailure& s) {
    std::ostringstream os;
    if (s.blocks != s.peer_blocks)
      os << "its kernels run " << s.blocks << " blocks here and " << s.peer_blocks << " on rank " << s.peer;
    else if (s.p2p != kIpcP2PNone)
      os << "it is a message of a collective (algo=\"ring\"), whose ranks then run different numbers of messages";
    else
      os << "the ranks run it as different numbers of launches (" << s.launches << " here, " << s.peer_launches
         << " on rank " << s.peer << ")";
    return os.str();
  }

  void raise_status(const char* what, uint64_t upto) {
    IpcFailure s = read_failure(&status_host->fault);
    const bool fault = s.code != kIpcOk;
    if (!fault) s = read_failure(&status_host->mismatch);
    if (s.code == kIpcOk) return;
    std::ostringstream os;
    os << what << " (ipc, rank " << rank << " of " << size << "): ";
    if (s.p2p != kIpcP2PNone) {
      const bool send = s.p2p == kIpcP2PSendPost || s.p2p == kIpcP2PSendSlot;
      const char* op = send ? "a send to" : "a receive from";
      if (s.code == kIpcMismatch || s.code == kIpcApart) {
        if (s.code == kIpcMismatch && s.seq > upto) return;
        os << op << " rank " << s.peer << " of " << s.bytes << " bytes (" << p2p_dtype_name(s.dtype)
           << ") does not match rank " << s.peer << "'s " << (send ? "receive" : "send") << " of " << s.peer_bytes
           << " bytes (" << p2p_dtype_name(s.peer_dtype) << ") (message " << s.epoch << " from rank "
           << (send ? rank : s.peer) << " to rank " << (send ? s.peer : rank) << "); both ranks skipped it";
        if (s.code == kIpcApart) {
          os << ", and " << apart_what(s) << ": their later calls would no longer pair; the group is unusable";
          broken = os.str();
          throw CollectiveTimeout(broken);
        }
        os << " (sizes and dtypes of a send and its receive must agree)";
        std::memset(static_cast<void*>(&status_host->mismatch), 0, sizeof(IpcFailure));
        throw MessageMismatch(os.str());
      }
      os << op << " rank " << s.peer << " (" << s.bytes << " bytes, message " << s.epoch << " on the channel) ";
      if (s.code == kIpcAborted) os << "was aborted";
      else if (s.code == kIpcPeerClosed)
        os << "found that rank " << s.peer << " closed the group (pz.destroy() or the end of its process)";
      else os << "timed out after " << cfg.timeout_s << " s";
      if (s.p2p == kIpcP2PSendPost) os << " waiting for rank " << s.peer << " to post the matching receive";
      else if (s.p2p == kIpcP2PSendSlot) os << " waiting for rank " << s.peer << " to take the data";
      else if (s.p2p == kIpcP2PRecvSend) os << " waiting for rank " << s.peer << " to send the matching message";
      else os << " waiting for rank " << s.peer << "'s data";
      os << "; the group is unusable";
      broken = os.str();
      throw CollectiveTimeout(broken);
    }
    if (s.code == kIpcMismatch) {
      if (s.seq > upto) return;
      os << "the call at epoch " << s.epoch << " differs from rank " << s.peer
         << "'s (collective, dtype, op, root or counts); every rank skipped it";
      std::memset(static_cast<void*>(&status_host->mismatch), 0, sizeof(IpcFailure));
      throw CollectiveError(os.str());
    }
    if (s.code == kIpcApart)
      os << "the call at epoch " << s.epoch << " differs from rank " << s.peer
         << "'s (collective, dtype, op, root or counts) and " << apart_what(s)
         << ": their later calls would no longer pair; every rank skipped it; the group is unusable";
    else if (s.code == kIpcAborted) os << "aborted while waiting for rank " << s.peer << " (epoch " << s.epoch << ")";
    else if (s.code == kIpcPeerClosed)
      os << "rank " << s.peer << " closed the group (pz.destroy() or the end of its process) while this rank was "
         << "waiting for rank " << s.peer << " in this call (epoch " << s.epoch << "); the group is unusable";
    else os << "timed out after " << cfg.timeout_s << " s waiting for rank " << s.peer << " (epoch " << s.epoch
            << "): it never arrived";
    broken = os.str();
    throw CollectiveTimeout(broken);
  }

  // Tells every peer that this rank closes ([Note: a peer that closed] in ipc_protocol.h): kIpcClosing
  // before its closing barrier, kIpcLeft where it leaves without one. A kernel on the group's stream, so
  // after this rank's earlier kernels, without the host waiting for them. Once only: nothing is written
  // into a peer's buffer after the closing barrier ([Note: a normal close]). Best effort (a peer may be
  // gone).
  void announce_closed(uint64_t value) {
    if (announced_closed || !connected || !stream) return;
    announced_closed = value;
    DeviceGuard guard(device);
    IpcClosedFlags f{};
    f.value = value;
    for (int p = 0; p < size; ++p)
      if (p != rank && bases[p]) f.flag[p] = &reinterpret_cast<IpcSignals*>(bases[p])->closed[rank];
    ipc_announce_closed_kernel<<<1, 1, 0, stream>>>(f);
    (void)cudaGetLastError();  // (a failed launch is not left for a later launch's check)
  }

  // Whether `caller` is capturing into a CUDA graph (the call then becomes graph nodes; see
  // [Note: ipc epochs live on the device]). A capture the CUDA runtime invalidated is an error.
  static bool capturing(const char* what, cudaStream_t caller) {
    cudaStreamCaptureStatus cs = cudaStreamCaptureStatusNone;
    PZ_CUDA_CHECK(cudaStreamIsCapturing(caller, &cs));
    if (cs == cudaStreamCaptureStatusInvalidated)
      throw CollectiveError(std::string(what) + " (ipc): the CUDA graph capture on the current stream was "
                            "invalidated before this call; end it and capture again");
    return cs == cudaStreamCaptureStatusActive;
  }

  // A call's launches (`kernels`, which numbers each with ++seq) on the group's stream after the
  // caller's work; then the caller's stream waits (synchronous) or a Work is returned.
  template <typename F>
  WorkPtr issue(const char* what, uintptr_t user_stream, bool async_op, F kernels) {
    std::lock_guard<std::mutex> lock(mu);
    check_usable(what);
    DeviceGuard guard(device);
    cudaStream_t caller = reinterpret_cast<cudaStream_t>(user_stream);
    const bool captured = capturing(what, caller);
    PZ_CUDA_CHECK(cudaEventRecord(queued->e, caller));
    PZ_CUDA_CHECK(cudaStreamWaitEvent(stream, queued->e, 0));
    kernels();
    if (!async_op) {  // no handle: the caller's stream waits, as for any call on it
      PZ_CUDA_CHECK(cudaEventRecord(finished->e, stream));
      PZ_CUDA_CHECK(cudaStreamWaitEvent(caller, finished->e, 0));
      return nullptr;
    }
    auto st = std::make_shared<IpcWork::State>();
    st->impl = this_shared;
    st->done = events->take();
    PZ_CUDA_CHECK(cudaEventRecord(st->done->e, stream));
    st->device = device;
    st->what = what;
    st->seq = seq;
    st->captured = captured;
    return std::make_shared<IpcWork>(st);
  }

  WorkPtr launch(const char* what, Coll coll, int kind, DType dt, RedOp op, int root, const void* in, void* out,
                 const std::vector<int64_t>& chunks, uintptr_t user_stream, bool async_op, uint64_t sent_bytes) {
    return issue(what, user_stream, async_op, [&] {
      const int esize = dtype_size(dt);
      int64_t total = 0;
      for (int64_t c : chunks) total += c;
      const std::vector<IpcPiece> pieces = ipc_pieces(kind, chunks, esize, cfg.area_bytes, rank);
      const uint64_t call_hash = ipc_call_hash(chunks);
      for (const IpcPiece& pc : pieces) {
        IpcCall c{};
        ++seq;
        for (int p = 0; p < size; ++p) {
          c.sigs[p] = reinterpret_cast<IpcSignals*>(bases[p]);
          c.areas[p] = bases[p] + sig_bytes();
          c.counts[p] = pc.counts[p];
          c.offs[p] = pc.offs[p];
          c.io_offs[p] = pc.io_offs[p];
        }
        c.status = status_dev;
        c.abort = abort_dev;
        c.in = static_cast<const char*>(in) + pc.in_skip * esize;
        c.out = static_cast<char*>(out) + pc.out_skip * esize;
        c.area_stride = cfg.area_bytes;
        c.seq = seq;
        c.timeout_ns = uint64_t(cfg.timeout_s * 1e9);
        c.desc = IpcDesc{kind, int32_t(dt), int32_t(op), root, pc.total(), ipc_call_hash(pc.counts), call_hash,
                         int32_t(pieces.size()), 0};
        c.rank = rank;
        c.nranks = size;
        c.gpu_scope = gpu_scope();
        PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
          ipc_kernel<T, OP><<<nblocks, kThreads, 0, stream>>>(c);
        }));
        PZ_CUDA_CHECK(cudaGetLastError());
      }
      counters.add(coll, uint64_t(total), sent_bytes);
    });
  }

  // The flags' scope (see [Note: ipc flag scope]): sharing is the most ranks of the group on one GPU, so
  // sharing == size puts every rank on one.
  int32_t gpu_scope() const { return !cfg.system_scope && cfg.sharing >= size ? 1 : 0; }

  // One point-to-point kernel on the group's stream (inside issue()).
  void launch_p2p_kernel(const IpcP2POp* ops, int nops, uint64_t call = 0) {
    IpcP2PCall c{};
    for (int p = 0; p < size; ++p) {
      c.sigs[p] = reinterpret_cast<IpcP2PSignals*>(bases[p] + p2p_sig_offset());
      c.chans[p] = bases[p] + sig_bytes() + 2 * cfg.area_bytes;
    }
    c.status = status_dev;
    c.abort = abort_dev;
    c.own = reinterpret_cast<IpcSignals*>(mine);
    c.call = call;
    c.nops = nops;
    for (int i = 0; i < nops; ++i) c.ops[i] = ops[i];
    c.chan_bytes = chan_bytes;
    c.slot_bytes = slot_bytes;
    c.slots = int32_t(cfg.p2p_slots);
    c.seq = ++seq;
    c.timeout_ns = uint64_t(cfg.timeout_s * 1e9);
    c.rank = rank;
    c.nranks = size;
    c.gpu_scope = gpu_scope();
    ipc_p2p_kernel<<<nblocks, kThreads, 0, stream>>>(c);
    PZ_CUDA_CHECK(cudaGetLastError());
  }

  // algo="ring": p2p_ring.h's schedule, each group one point-to-point kernel, the element-wise
  // kernels between them, all on the group's stream in order.
  WorkPtr ring_call(const char* what, Coll coll, void* out, const void* in, const ChunkLayout& L, int root,
                    DType dt, RedOp op, uintptr_t user_stream, bool async_op);

  // Point-to-point: one kernel for the whole batch (see [Note: ipc point-to-point channels]).
  WorkPtr launch_p2p(const char* what, const std::vector<IpcTransport::P2P>& ops, uintptr_t user_stream,
                     bool async_op) {
    if (ops.empty()) throw std::invalid_argument(std::string(what) + ": no operations");
    if (ops.size() > size_t(kIpcMaxP2POps))
      throw std::invalid_argument(std::string(what) + ": the ipc backend takes at most " +
                                  std::to_string(kIpcMaxP2POps) + " operations in one batch, got " +
                                  std::to_string(ops.size()));
    for (size_t i = 0; i < ops.size(); ++i) {
      const IpcTransport::P2P& o = ops[i];
      if (o.peer < 0 || o.peer >= size || o.peer == rank)
        throw std::invalid_argument(std::string(what) + ": peer must be another rank of the group (0.." +
                                    std::to_string(size - 1) + ", not " + std::to_string(rank) + "), got " +
                                    std::to_string(o.peer));
      if (o.count < 0) throw std::invalid_argument(std::string(what) + ": negative count");
      if (o.count > 0 && o.buf == nullptr) throw std::invalid_argument(std::string(what) + ": null buffer");
    }
    return issue(what, user_stream, async_op, [&] {
      IpcP2POp v[kIpcMaxP2POps];
      for (size_t i = 0; i < ops.size(); ++i) {
        const IpcTransport::P2P& o = ops[i];
        v[i] = IpcP2POp{o.buf, o.count * int64_t(dtype_size(o.dt)), o.peer, int32_t(o.dt), o.is_send ? 1 : 0, -1};
        for (size_t j = 0; j < i; ++j)
          if (ops[j].peer == o.peer && ops[j].is_send == o.is_send) v[i].prev = int32_t(j);
      }
      launch_p2p_kernel(v, int(ops.size()));
      for (const IpcTransport::P2P& o : ops) {
        if (o.is_send) counters.add(Coll::send, uint64_t(o.count), uint64_t(o.count) * dtype_size(o.dt));
        else counters.add(Coll::recv, uint64_t(o.count), 0);
      }
    });
  }

  std::weak_ptr<Impl> this_shared;
};

namespace {

// The ring's Exec (see p2p_ring.h) on the ipc backend.
struct IpcRingExec {
  IpcTransport::Impl& t;
  DType dt;
  RedOp op;
  uint64_t call;  // the call's hash, in every message's descriptor (IpcP2PCall::call)

  uintptr_t st() const { return reinterpret_cast<uintptr_t>(t.stream); }
  void group(const void* send, size_t send_bytes, void* recv, size_t recv_bytes) {
    if (!send && !recv) return;
    IpcP2POp ops[2];
    int k = 0;
    if (send) ops[k++] = IpcP2POp{const_cast<void*>(send), int64_t(send_bytes), (t.rank + 1) % t.size, int32_t(dt), 1, -1};
    if (recv) ops[k++] = IpcP2POp{recv, int64_t(recv_bytes), (t.rank + t.size - 1) % t.size, int32_t(dt), 0, -1};
    t.launch_p2p_kernel(ops, k, call);
  }
  void copy(const void* src, void* dst, int64_t n) { cuda::launch_copy(src, dst, n, dt, st()); }
  void pack(const void* src, void* dst, int64_t n) { cuda::launch_pack_wire(src, dst, n, dt, st()); }
  void reduce(const void* in, const void* own, void* out, int64_t n) {
    cuda::launch_reduce_wire(in, own, out, n, dt, op, st());
  }
  void reduce_final(const void* in, const void* own, void* dst, int64_t n) {
    cuda::launch_reduce_wire_final(in, own, dst, n, dt, op, t.size, st());
  }
};

}  // namespace

IpcTransport::WorkPtr IpcTransport::Impl::ring_call(const char* what, Coll coll, void* out, const void* in,
                                                    const ChunkLayout& L, int root, DType dt, RedOp op,
                                                    uintptr_t user_stream, bool async_op) {
  return issue(what, user_stream, async_op, [&] {
    // what the ranks must agree on: every message of the call carries it ([Note: ipc calls apart])
    std::vector<int64_t> desc{int64_t(coll), int64_t(dt), int64_t(op), int64_t(root)};
    desc.insert(desc.end(), L.counts.begin(), L.counts.end());
    IpcRingExec x{*this, dt, op, ipc_call_hash(desc) | 1u};
    uint64_t sent = 0;
    const uint64_t stage = cfg.p2p_bytes;
    PZ_DISPATCH_DTYPE(dt, T, {
      sent = p2p_ring_collective<T>(x, coll, out, in, L, root, rank, size, ring_stage, ring_stage + stage, stage);
    });
    counters.add(coll, uint64_t(L.total()), sent);
  });
}

void IpcWork::wait(uintptr_t stream) {
  DeviceGuard guard(s_->device);
  PZ_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), s_->done->e, 0));
  if (auto impl = s_->impl.lock()) {
    std::lock_guard<std::mutex> lock(impl->mu);
    impl->raise_status(s_->what, 0);  // (a mismatch: at a host wait, see raise_status)
  }
}

namespace {
void refuse_host_wait(const IpcWork::State& s, const char* how) {
  if (s.captured)
    throw CollectiveError(std::string(s.what) + " (ipc): " + how + " on the host is not possible for a call captured "
                          "into a CUDA graph; work.wait() inside the capture makes the stream wait for it, and "
                          "the graph's replays are waited for as any stream work (e.g. torch.cuda.synchronize())");
}
}  // namespace

bool IpcWork::captured() const { return s_->captured; }

bool IpcWork::completed() {
  refuse_host_wait(*s_, "is_completed()");
  DeviceGuard guard(s_->device);
  RelaxedCaptureMode relaxed;  // (an eager call's work polled while this thread captures a graph)
  cudaError_t e = cudaEventQuery(s_->done->e);
  if (e == cudaErrorNotReady) return false;
  PZ_CUDA_CHECK(e);
  return true;
}

void IpcWork::synchronize() {
  refuse_host_wait(*s_, "synchronize()");
  DeviceGuard guard(s_->device);
  PZ_CUDA_CHECK(cudaEventSynchronize(s_->done->e));
  if (auto impl = s_->impl.lock()) {
    std::lock_guard<std::mutex> lock(impl->mu);
    impl->raise_status(s_->what, s_->seq);
  }
}

IpcTransport::IpcTransport(int rank, int size, int device, IpcConfig cfg) : impl_(std::make_shared<Impl>()) {
  if (size < 1 || size > kIpcMaxRanks)
    throw std::invalid_argument("the ipc backend takes groups of 1 to " + std::to_string(kIpcMaxRanks) +
                                " ranks, got " + std::to_string(size));
  Impl& m = *impl_;
  m.this_shared = impl_;
  m.rank = rank;
  m.size = size;
  m.device = device;
  m.cfg = cfg;
  m.cfg.area_bytes = round_up(std::max<uint64_t>(cfg.area_bytes, 4096), 256);
  DeviceGuard guard(device);
  preload_ipc_kernels();
  int sms = 0;
  PZ_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  m.nblocks = ipc_blocks(sms, cfg.sharing);  // (every block resident at once, several processes per GPU)
  if (cfg.blocks > 0) m.nblocks = std::min(cfg.blocks, kIpcMaxBlocks);  // the group's (see IpcConfig::blocks)
  // Point-to-point channels (see [Note: ipc point-to-point channels]): a lane per block, slots of at
  // least 256 bytes (16-byte multiples).
  m.cfg.p2p_slots = std::max<uint64_t>(2, cfg.p2p_slots);
  const uint64_t lanes = uint64_t(m.nblocks) * m.cfg.p2p_slots;
  m.slot_bytes = std::max<uint64_t>(256, cfg.p2p_bytes / lanes / 16 * 16);
  m.chan_bytes = lanes * m.slot_bytes;
  PZ_CUDA_CHECK(cudaMalloc(&m.mine, sig_bytes() + 2 * m.cfg.area_bytes + uint64_t(size - 1) * m.chan_bytes));
  m.cfg.p2p_bytes = round_up(std::max<uint64_t>(cfg.p2p_bytes, 256), 16);
  if (size > 1) PZ_CUDA_CHECK(cudaMalloc(&m.ring_stage, 2 * m.cfg.p2p_bytes));
  PZ_CUDA_CHECK(cudaMemset(m.mine, 0, sig_bytes()));
  const uint64_t blocks = uint64_t(m.nblocks);  // for the peers' check at connect
  PZ_CUDA_CHECK(cudaMemcpy(m.mine + offsetof(IpcSignals, blocks), &blocks, sizeof(blocks), cudaMemcpyHostToDevice));
  PZ_CUDA_CHECK(cudaHostAlloc(&m.status_host, sizeof(IpcStatus), cudaHostAllocMapped));
  std::memset(static_cast<void*>(m.status_host), 0, sizeof(IpcStatus));
  PZ_CUDA_CHECK(cudaHostGetDevicePointer(&m.status_dev, m.status_host, 0));
  PZ_CUDA_CHECK(cudaHostAlloc(&m.abort_host, sizeof(uint32_t), cudaHostAllocMapped));
  *m.abort_host = 0;
  PZ_CUDA_CHECK(cudaHostGetDevicePointer(&m.abort_dev, m.abort_host, 0));
  PZ_CUDA_CHECK(cudaStreamCreateWithFlags(&m.stream, cudaStreamNonBlocking));
  m.queued = std::make_unique<Event>();
  m.finished = std::make_unique<Event>();
  PZ_CUDA_CHECK(cudaDeviceSynchronize());  // the zeroed signals are visible before any peer maps them
  m.bases.assign(size, nullptr);
  m.bases[rank] = m.mine;
}

IpcTransport::~IpcTransport() {
  try {
    close();
  } catch (...) {
  }
}

std::string IpcTransport::handle() const {
  DeviceGuard guard(impl_->device);
  cudaIpcMemHandle_t h;
  PZ_CUDA_CHECK(cudaIpcGetMemHandle(&h, impl_->mine));
  return std::string(reinterpret_cast<const char*>(&h), sizeof(h));
}

void IpcTransport::connect(const std::vector<std::string>& handles) {
  Impl& m = *impl_;
  if (int(handles.size()) != m.size)
    throw std::invalid_argument("connect: expected " + std::to_string(m.size) + " handles, got " +
                                std::to_string(handles.size()));
  DeviceGuard guard(m.device);
  for (int p = 0; p < m.size; ++p) {
    if (p == m.rank) continue;
    if (handles[p].size() != sizeof(cudaIpcMemHandle_t))
      throw std::invalid_argument("connect: handle of rank " + std::to_string(p) + " has the wrong size");
    cudaIpcMemHandle_t h;
    std::memcpy(&h, handles[p].data(), sizeof(h));
    void* ptr = nullptr;
    cudaError_t e = cudaIpcOpenMemHandle(&ptr, h, cudaIpcMemLazyEnablePeerAccess);
    if (e != cudaSuccess)
      throw CollectiveError("ipc backend: rank " + std::to_string(m.rank) + " cannot map rank " + std::to_string(p) +
                            "'s buffer (cudaIpcOpenMemHandle: " + cudaGetErrorString(e) +
                            "); CUDA IPC needs both processes on one host with the GPUs visible to each other");
    m.bases[p] = static_cast<char*>(ptr);
  }
  // Every rank's kernels must run the same blocks (block b only meets block b of its peers): a rank
  // with more would wait for blocks that never come ([Note: ipc calls apart]).
  for (int p = 0; p < m.size; ++p) {
    if (p == m.rank) continue;
    uint64_t theirs = 0;
    PZ_CUDA_CHECK(cudaMemcpy(&theirs, m.bases[p] + offsetof(IpcSignals, blocks), sizeof(theirs),
                             cudaMemcpyDeviceToHost));
    if (theirs != uint64_t(m.nblocks))
      throw CollectiveError("ipc backend: rank " + std::to_string(p) + "'s kernels run " + std::to_string(theirs) +
                            " blocks, rank " + std::to_string(m.rank) + "'s " + std::to_string(m.nblocks) +
                            " (each from its GPU's SM count); every rank of a group must run the same: pass the "
                            "group's smallest as IpcConfig::blocks (pyzero's ipc backend does)");
  }
  m.connected = true;
}

int IpcTransport::rank() const { return impl_->rank; }
int IpcTransport::size() const { return impl_->size; }
int IpcTransport::device() const { return impl_->device; }
uintptr_t IpcTransport::stream() const { return reinterpret_cast<uintptr_t>(impl_->stream); }
void IpcTransport::set_timeout(double s) { impl_->cfg.timeout_s = s; }

IpcTransport::WorkPtr IpcTransport::all_reduce(void* buf, const void* in, int64_t count, DType dt, RedOp op,
                                               Algo algo, uintptr_t stream, bool async_op) {
  Impl& m = *impl_;
  size_t bytes = size_t(count) * dtype_size(dt);
  Algo a = ipc_resolve_algo(Coll::all_reduce, bytes, algo, m.cfg.oneshot_bytes, m.size);
  if (a == Algo::ring)
    return m.ring_call("all_reduce", Coll::all_reduce, buf, in ? in : buf, ChunkLayout(split_even(count, m.size)), 0,
                       dt, op, stream, async_op);
  int kind = a == Algo::twoshot ? kIpcAllReduceTwoShot : kIpcAllReduceOneShot;
  uint64_t sent = uint64_t(bytes) * uint64_t(m.size - 1);
  return m.launch("all_reduce", Coll::all_reduce, kind, dt, op, 0, in ? in : buf, buf, split_even(count, m.size),
                  stream, async_op, sent);
}

IpcTransport::WorkPtr IpcTransport::reduce_scatter(void* out, const void* in, const std::vector<int64_t>& counts,
                                                   DType dt, RedOp op, Algo algo, uintptr_t stream, bool async_op) {
  Impl& m = *impl_;
  int64_t total = 0;
  for (int64_t c : counts) total += c;
  if (ipc_resolve_algo(Coll::reduce_scatter, size_t(total) * dtype_size(dt), algo, m.cfg.oneshot_bytes, m.size) ==
      Algo::ring)
    return m.ring_call("reduce_scatter", Coll::reduce_scatter, out, in, ChunkLayout(counts), 0, dt, op, stream,
                       async_op);
  return m.launch("reduce_scatter", Coll::reduce_scatter, kIpcReduceScatter, dt, op, 0, in, out, counts, stream,
                  async_op, uint64_t(total - counts[m.rank]) * dtype_size(dt));
}

IpcTransport::WorkPtr IpcTransport::all_gather(void* out, const void* in, const std::vector<int64_t>& counts,
                                               DType dt, Algo algo, uintptr_t stream, bool async_op) {
  Impl& m = *impl_;
  if (ipc_resolve_algo(Coll::all_gather, size_t(counts[m.rank]) * dtype_size(dt), algo, m.cfg.oneshot_bytes,
                       m.size) == Algo::ring)
    return m.ring_call("all_gather", Coll::all_gather, out, in, ChunkLayout(counts), 0, dt, RedOp::sum, stream,
                       async_op);
  return m.launch("all_gather", Coll::all_gather, kIpcAllGather, dt, RedOp::sum, 0, in, out, counts, stream,
                  async_op, uint64_t(counts[m.rank]) * dtype_size(dt) * uint64_t(m.size - 1));
}

IpcTransport::WorkPtr IpcTransport::broadcast(void* buf, int64_t count, DType dt, int root, Algo algo,
                                              uintptr_t stream, bool async_op) {
  Impl& m = *impl_;
  if (ipc_resolve_algo(Coll::broadcast, size_t(count) * dtype_size(dt), algo, m.cfg.oneshot_bytes, m.size) ==
      Algo::ring)
    return m.ring_call("broadcast", Coll::broadcast, buf, buf, ChunkLayout(std::vector<int64_t>{count}), root, dt,
                       RedOp::sum, stream, async_op);
  std::vector<int64_t> chunks(m.size, 0);
  chunks[0] = count;
  return m.launch("broadcast", Coll::broadcast, kIpcBroadcast, dt, RedOp::sum, root, buf, buf, chunks, stream,
                  async_op, m.rank == root ? uint64_t(count) * dtype_size(dt) : 0);
}

IpcTransport::WorkPtr IpcTransport::barrier(uintptr_t stream, bool async_op, bool closing) {
  Impl& m = *impl_;
  if (!async_op && Impl::capturing("barrier", reinterpret_cast<cudaStream_t>(stream))) {
    DeviceGuard guard(m.device);
    throw CollectiveError("barrier (ipc): a synchronous barrier waits on the host, which a CUDA graph capture "
                          "cannot do; pass async_op=True and wait() its work inside the capture");
  }
  if (closing) {
    std::lock_guard<std::mutex> lock(m.mu);
    m.check_usable("barrier");  // (a broken group skips its closing barrier; close() announces it)
    m.announce_closed(kIpcClosing);
  }
  WorkPtr w;
  try {
    w = m.launch("barrier", Coll::barrier, closing ? kIpcClose : kIpcBarrier, DType::f32, RedOp::sum, 0, nullptr,
                 nullptr, std::vector<int64_t>(m.size, 0), stream, true, 0);
  } catch (...) {
    if (closing) {  // no closing barrier follows the announcement: the peers are not to wait for it
      std::lock_guard<std::mutex> lock(m.mu);
      m.announced_closed = 0;
      m.announce_closed(kIpcLeft);
    }
    throw;
  }
  if (async_op) return w;
  w->synchronize();
  return nullptr;
}

IpcTransport::WorkPtr IpcTransport::send(const void* buf, int64_t count, DType dt, int peer, uintptr_t stream,
                                         bool async_op) {
  return impl_->launch_p2p("send", {P2P{const_cast<void*>(buf), count, dt, peer, true}}, stream, async_op);
}

IpcTransport::WorkPtr IpcTransport::recv(void* buf, int64_t count, DType dt, int peer, uintptr_t stream,
                                         bool async_op) {
  return impl_->launch_p2p("recv", {P2P{buf, count, dt, peer, false}}, stream, async_op);
}

IpcTransport::WorkPtr IpcTransport::batch_p2p(const std::vector<P2P>& ops, uintptr_t stream, bool async_op) {
  return impl_->launch_p2p("batch_isend_irecv", ops, stream, async_op);
}

std::map<std::string, OpStats> IpcTransport::stats(bool reset) { return impl_->counters.read(reset); }

void IpcTransport::close() {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> lock(m.mu);
  if (m.closed) return;
  m.closed = true;
  DeviceGuard guard(m.device);
  if (m.abort_host) *reinterpret_cast<volatile uint32_t*>(m.abort_host) = 1;  // kernels waiting for peers end
  if (m.stream) cudaStreamSynchronize(m.stream);
  m.announce_closed(kIpcLeft);  // (where no closing barrier announced kIpcClosing)
  if (m.stream) cudaStreamSynchronize(m.stream);  // (the announcement ran before the peers are unmapped)
  for (int p = 0; p < m.size; ++p)
    if (p != m.rank && m.bases[p]) cudaIpcCloseMemHandle(m.bases[p]);
  m.queued.reset();
  m.finished.reset();
  if (m.stream) cudaStreamDestroy(m.stream);
  if (m.mine) cudaFree(m.mine);
  if (m.ring_stage) cudaFree(m.ring_stage);
  m.ring_stage = nullptr;
  if (m.status_host) cudaFreeHost(m.status_host);
  if (m.abort_host) cudaFreeHost(m.abort_host);
  m.mine = nullptr;
  m.status_host = nullptr;
  m.abort_host = nullptr;
}

}  // namespace pz
