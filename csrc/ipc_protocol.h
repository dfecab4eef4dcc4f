// ipc_protocol.h — the "ipc" backend's collectives as one body that runs on the
// GPU (ipc_transport.cu: one kernel launch per call, each rank's blocks reading
// and writing every peer's registered buffer through CUDA IPC) and on the CPU
// (tests/ipc_protocol_on_cpu.cpp: a thread per rank and block, to check the
// protocol without a GPU). Plain C++ plus PZ_HD; the memory-order primitives
// come from the executor type X (see IpcExec below).
//
// Layout. Each rank registers one buffer: IpcSignals, then two data areas of
// `area_bytes` (used by epochs of alternating parity). Every call has an
// epoch e (1, 2, ...), the same on every rank of the group.
//
// [Note: ipc epochs live on the device]
// Block b of a rank keeps its calls' count in its own signals (epoch[b], which
// no other block or rank touches) and takes e = ++epoch[b] as its first step.
// Every block of every rank runs every call of the group in the same order, so
// all of them agree on e without the host passing it: a call's kernel
// parameters hold nothing that changes from call to call but the user's
// pointers and sizes, so a kernel captured in a CUDA graph and replayed any
// number of times (interleaved with eager calls) runs each time with a fresh
// epoch, flags and area parity. The host only numbers its launches (`seq`),
// to tell which failures a host wait may report.
//
// [Note: ipc flag protocol]
// Every kernel has the same number of blocks B on every rank (a group
// constant, at most what can be co-resident), and block b of a call handles
// the same elements on every rank: the range part(b) of each chunk. So block b
// only ever synchronises with block b of each peer:
//  * start: having written its part of this rank's data into area[e % 2],
//    block b stores e into start[b][me] of every peer's signals (release,
//    system scope), then waits until start[b][p] >= e in its own signals for
//    every peer p (acquire). After that it may read part(b) of any peer's
//    area[e % 2] and the peers' descriptors of e.
//  * mid (two-shot all_reduce): after reducing part(b) of its own chunk into
//    area[e % 2], block b stores e into mid[b][me] of every peer and waits
//    for the peers' mid flags before copying their reduced chunks.
// Why two areas suffice and no end barrier is needed: rank r overwrites
// area[e % 2] at epoch e + 2. Its kernel of e + 1 ran only after each of its
// blocks saw every peer's start flag of e + 1, which a peer's kernel of e + 1
// sets; that kernel starts only when the peer's kernel of e has finished
// entirely (a group's kernels run in call order on one stream, see
// ipc_transport.h). So at e + 2 no peer reads area[e % 2] any more. The
// descriptors (desc[e % 2]) live by the same rule. Flags are monotonic and
// each has one writer: nothing is ever reset.
//
// Mismatched calls: before its start flags, block b writes this rank's
// descriptor of e into desc[e % 2][b] (covered by its own release); after the
// start barrier it compares every peer's desc[e % 2][b] with its own. If any
// two ranks differ, every rank sees a difference, so every rank's blocks skip
// the data phase (and the mid barrier) alike and report it in their status.
// A peer whose call is its closing barrier (kIpcClose) while this rank's is
// not has left the group: reported as kIpcPeerClosed, which breaks the group
// (that peer runs no further call).
//
// [Note: ipc calls apart]
// A mismatched call is skipped alike only where every rank runs it as the same number of launches,
// each taking one epoch, with the same blocks. Where the ranks cut it into different numbers of pieces
// (an all_reduce of 5M elements in f64 on one rank and f32 on another, across the 32 MiB area), the
// rank with more would run extra launches, each taking a new epoch: its later calls would pair with
// the peers' earlier ones and, where their descriptors happen to agree, reduce data of different calls
// with no error. So every piece's descriptor holds the whole call's chunks (call_hash) and launch count,
// and the kernel's block count: every piece of a mismatched call, its first one included, sees the
// difference; where the launch or block counts differ, every rank records kIpcApart, a fault (every
// rank sees a difference in a count where not all ranks agree on it): the group is unusable, and the
// launches queued after it do nothing (ipc_begin), the extra pieces of the rank with more included. A
// block that has no counterpart on a peer (more blocks on this rank) can only time out; the transport
// refuses such a group at connect (IpcTransport::connect), and the Python layer agrees on the group's
// smallest block count at set-up.
//
// Faults: every wait also watches a deadline (timeout_ns from the kernel's
// start) and the host's abort word; either ends the wait, records which peer
// never arrived in the status, and the block returns. The group is then
// broken (the host refuses further calls).
//
// [Note: a peer that closed]
// A rank that closes the group stores into closed[rank] of every peer's signals once its own
// kernels have ended (a kernel after them on the group's stream, so the host does not wait):
// kIpcClosing before its closing barrier (IpcTransport::barrier with closing), the only kernel it
// runs after that; kIpcLeft where it leaves without one (close() of a broken group). A wait that
// makes no progress looks, at the same rare check as the deadline, whether the peer it waits on
// closed, and if so goes round once more: the closing rank wrote every flag of its calls before
// `closed` (read with acquire), so a flag it did write still arrives, and an operation it completed
// before leaving (a point-to-point message already in this rank's channel) still finishes. Only a
// wait still stuck at the next check fails, with kIpcPeerClosed naming the peer, instead of running
// to the deadline: a collective waiting for a peer that left (a closing barrier met by a peer that
// failed and left), a send or receive whose peer closed or left (ipc_p2p.h: no point-to-point kernel
// of it runs again). A collective's wait on a peer that is closing (kIpcClosing) goes on: that
// peer's closing barrier still signals (it meets this rank's closing barrier, or, in another call,
// tells it that the peer left: kIpcPeerClosed from the descriptors). A peer that dies without
// closing is still found only at the deadline.
//
// [Note: a normal close]
// The closing barrier, where every rank runs it (all descriptors kIpcClose), has a second phase: each
// block signals mid and waits for every peer's, after reading their descriptors. So once a rank's
// closing barrier completed, every peer has read all it reads of this rank's buffer, and written all it
// writes there (its closing announcement came before its barrier): the buffer may be freed.
//
// Numerics: each output element is reduced once, over the ranks in rank
// order, in the accumulator type (fp32 for fp16/bf16), exactly as the shm
// one-shot (cpu_reduce_many): bitwise the same result on every rank.
#pragma once

#include <cstdint>
#include <vector>

#include "collective.h"
#include "reduce_math.h"

namespace pz {

constexpr int kIpcMaxRanks = 16;
constexpr int kIpcMaxBlocks = 32;

// Blocks of every ipc kernel of a rank, on a GPU of `sms` SMs shared by `sharing` processes of the job.
// Spin barriers and point-to-point lanes need all blocks of the call's kernels resident at once, on every
// rank; the kernels take up to 72 registers per thread at 512 threads, one block per SM, so the kernels
// of all processes on one GPU together must fit well within its SMs, beside the compute kernels they
// wait on: at most a quarter of the SMs per process, half of them for all (eight processes on a 132-SM
// GPU had asked for 256 resident blocks). Every rank of a group must get the same count: `sharing` is the
// most ranks of the group on one GPU, from every rank's GPU (pyzero.backends.ipc.gpu_sharing).
inline int ipc_blocks(int sms, int sharing) {
  const int share = sharing < 1 ? 1 : sharing;
  int b = sms / 4;
  if (sms / (2 * share) < b) b = sms / (2 * share);
  if (b > kIpcMaxBlocks) b = kIpcMaxBlocks;
  return b < 1 ? 1 : b;
}

// What every rank must agree on for one launch (compared after the start barrier). The whole call's
// chunks and launch count are in every piece's descriptor, so every piece of a mismatched call sees it
// (see [Note: ipc calls apart]).
struct IpcDesc {
  int32_t kind, dtype, op, root;
  int64_t total;        // elements of this launch's buffer (all chunks)
  uint64_t counts_hash;  // of this launch's chunks
  uint64_t call_hash;   // of the whole call's chunks (ipc_call_hash)
  int32_t launches;     // the call's launches (ipc_pieces)
  int32_t blocks;       // the kernel's blocks (set by the kernel itself)
};

// A hash of a call's chunks (the element counts per rank), as IpcDesc::call_hash / counts_hash hold.
inline uint64_t ipc_call_hash(const std::vector<int64_t>& counts) {
  uint64_t h = 1469598103934665603ull;
  for (int64_t c : counts) h = (h ^ uint64_t(c)) * 1099511628211ull;
  return h;
}

struct IpcSignals {
  uint64_t start[kIpcMaxBlocks][kIpcMaxRanks];  // start[b][p]: written by peer p's block b
  uint64_t mid[kIpcMaxBlocks][kIpcMaxRanks];
  IpcDesc desc[2][kIpcMaxBlocks];               // this rank's descriptor of epoch e at [e % 2][block]
  uint64_t epoch[kIpcMaxBlocks];                // epoch[b]: the last epoch this rank's block b ran
  uint64_t closed[kIpcMaxRanks];                // closed[p]: peer p closing (kIpcClosing) or left (kIpcLeft)
  // Written by this rank's own blocks only (see [Note: ipc failures]):
  uint64_t launches[kIpcMaxBlocks];             // launches[b]: this rank's ipc kernels (any) block b began
  uint64_t claimed[2];                          // the launch whose failure IpcStatus::fault / mismatch holds
  uint64_t blocks;                              // this rank's blocks per kernel (set-up: the peers check it)
  uint32_t faulted;                             // != 0 once IpcStatus::fault holds a record: a copy in device
                                                // memory, which ipc_begin reads (the status is host-mapped:
                                                // a read there would cost every launch a bus round trip)
};
// IpcSignals::closed[p]: p announced that its closing barrier (a collective, kIpcClose) is the only
// kernel it still runs; p left (no kernel of it runs any more, its flags are final).
enum : uint64_t { kIpcClosing = 2, kIpcLeft = 1 };

// One failure (host-mapped memory on a GPU: written by the device, read by the host after the call).
struct IpcFailure {
  uint32_t code;    // kIpcOk, or the failure
  int32_t peer;     // timeout: a peer whose flag never came; mismatch: a peer whose call differs;
                    // peer closed: the peer that closed the group
  uint64_t epoch;   // the failed call's epoch (device)
  uint64_t seq;     // and the host's number of its launch (see IpcCall::seq)
  // point-to-point (ipc_p2p.h): what the failed operation waited for (kIpcP2P*, 0 for a
  // collective; epoch is then the message's number on its channel), its bytes and dtype, and
  // for a mismatch the peer's
  int32_t p2p, dtype, peer_dtype;
  int64_t bytes, peer_bytes;
  // kIpcApart: this rank's and the peer's launches of the call (a collective) and blocks per kernel
  int32_t launches, peer_launches, blocks, peer_blocks;
};

// [Note: ipc failures]
// A rank's status holds two records, each the first failure of its class: `fault`, a failure that
// breaks the group (a timeout, an abort, a peer that closed, calls apart), kept for good; `mismatch`,
// a call or message that every rank involved skipped alike (the group goes on), cleared by the host
// once it raised it. So a fault is never hidden behind a mismatch, nor cleared with it. A kernel
// whose rank's status holds a fault does nothing (ipc_begin): the group is unusable, and a launch
// already queued behind the failed one neither waits for peers nor pairs with their later calls.
// First wins: between launches by the kernel boundary (a record already set stays), within one
// launch by a claim in the rank's own device memory (IpcSignals::claimed, the launch's number
// IpcSignals::launches: an atomic max, no system-scope atomic on host memory), so two blocks failing
// at once never mix their records.
struct IpcStatus {
  IpcFailure fault;
  IpcFailure mismatch;
};
// The failure a host reports: the fault, else the mismatch.
PZ_HD const IpcFailure& ipc_reported(const IpcStatus& s) { return s.fault.code != 0u ? s.fault : s.mismatch; }

// kIpcPeerClosed: the peer's call was its closing barrier (kIpcClose) while this rank's was not.
// kIpcApart: [Note: ipc calls apart].
enum : uint32_t { kIpcOk = 0, kIpcTimeout = 1, kIpcMismatch = 2, kIpcAborted = 3, kIpcPeerClosed = 4, kIpcApart = 5 };

enum IpcKind : int32_t {
  kIpcAllReduceOneShot = 0,
  kIpcAllReduceTwoShot = 1,
  kIpcReduceScatter = 2,
  kIpcAllGather = 3,
  kIpcBroadcast = 4,
  kIpcBarrier = 5,
  kIpcClose = 6,  // the barrier a rank runs as it closes the group: peers still in a call learn it left
};

// One call, by value (a kernel parameter). Chunk c of the buffer has counts[c]
// elements, at element offset offs[c] in the areas and io_offs[c] in the user
// buffers `in` / `out` (different where a large call runs in pieces, see
// ipc_pieces); `areas[p]` is peer p's first area (epoch e uses the one at
// areas[p] + (e % 2) * area_stride) and `sigs[p]` its signals (this rank's own
// at [rank]). Nothing in it depends on the epoch: see [Note: ipc epochs live on
// the device].
struct IpcCall {
  char* areas[kIpcMaxRanks];
  IpcSignals* sigs[kIpcMaxRanks];
  IpcStatus* status;
  const uint32_t* abort;  // nonzero: give up waiting
  const void* in;         // all_reduce/broadcast: the whole buffer; reduce_scatter: whole; all_gather: own chunk
  void* out;              // all_reduce/broadcast/all_gather: the whole buffer; reduce_scatter: own chunk
  int64_t counts[kIpcMaxRanks];
  int64_t offs[kIpcMaxRanks];
  int64_t io_offs[kIpcMaxRanks];
  uint64_t area_stride;   // bytes from a rank's first area to its second
  uint64_t seq;           // the host's number of this launch (reported with a failure)
  uint64_t timeout_ns;
  IpcDesc desc;
  int32_t rank, nranks;
  int32_t gpu_scope;      // the flags' scope: nonzero, the GPU's (every rank on this GPU); else the system's
};

// The elements [lo, hi) of a chunk of n that block b of nb handles.
PZ_HD void ipc_part(int64_t n, int b, int nb, int64_t& lo, int64_t& hi) {
  lo = n * b / nb;
  hi = n * (b + 1) / nb;
}

PZ_HD bool ipc_same_desc(const IpcDesc& a, const IpcDesc& b) {
  return a.kind == b.kind && a.dtype == b.dtype && a.op == b.op && a.root == b.root && a.total == b.total &&
         a.counts_hash == b.counts_hash && a.call_hash == b.call_hash && a.launches == b.launches &&
         a.blocks == b.blocks;
}

// Executor X provides (GPU: ipc_transport.cu, CPU: the test):
//   int block(), nblocks(), tid(), nthreads();  void sync();   (a block's threads)
//   uint64_t now_ns();
//   void store_release(uint64_t* p, uint64_t v);  uint64_t load_acquire(const uint64_t* p);
//   uint32_t load_relaxed(const uint32_t* p);
//   bool sync_and(bool v);  (a block barrier that returns whether v held on every thread)
//   void path(bool vectorised);  (which loop a copy or reduce ran: counted by the CPU check)
//   uint64_t next_epoch(uint64_t* counter);  (++*counter by one thread, the new value to every thread)
//   bool claim(uint64_t* word, uint64_t id);  (atomic max of *word and id, by any thread: whether it was
//     below id; the word is in this rank's device memory, only its blocks use it)
//   void fence();  (orders this thread's writes to host-mapped memory, system-wide)

// Records failure f of the current launch of block x.block() in the rank's status: first wins, per
// record (see [Note: ipc failures]). Any thread may call it.
template <typename X>
PZ_HD void ipc_fail(X& x, IpcStatus* s, IpcSignals* own, const IpcFailure& f) {
  const bool fault = f.code != kIpcMismatch;
  volatile IpcFailure* r = fault ? &s->fault : &s->mismatch;
  if (r->code != 0u) return;  // an earlier launch's, or one of this launch's already written
  if (!x.claim(&own->claimed[fault ? 0 : 1], own->launches[x.block()])) return;  // this launch's, being written
  r->peer = f.peer;
  r->epoch = f.epoch;
  r->seq = f.seq;
  r->p2p = f.p2p;
  r->dtype = f.dtype;
  r->peer_dtype = f.peer_dtype;
  r->bytes = f.bytes;
  r->peer_bytes = f.peer_bytes;
  r->launches = f.launches;
  r->peer_launches = f.peer_launches;
  r->blocks = f.blocks;
  r->peer_blocks = f.peer_blocks;
  x.fence();
  r->code = f.code;  // last: the host reads the code first
  x.fence();
  if (fault) *reinterpret_cast<volatile uint32_t*>(&own->faulted) = 1u;  // (the next launches read it)
}

// A collective's failure record.
PZ_HD IpcFailure ipc_failure(uint32_t code, int peer, uint64_t epoch, uint64_t seq) {
  IpcFailure f{};
  f.code = code;
  f.peer = peer;
  f.epoch = epoch;
  f.seq = seq;
  return f;
}

// The start of every launch (collective or point-to-point) of block x.block(): counts the launch (the
// number its failures claim with; the block barrier publishes it to the block's threads) and tells
// whether to run it: false once the rank's status holds a fault (see [Note: ipc failures]), as
// IpcSignals::faulted, its copy in device memory, says.
template <typename X>
PZ_HD bool ipc_begin(X& x, IpcSignals* own) {
  bool run = true;
  if (x.tid() == 0) {
    ++own->launches[x.block()];
    run = x.load_relaxed(&own->faulted) == 0u;
  }
  return x.sync_and(run);
}

// Waits until flags[p] >= e for every peer p != me (threads 0..n-1 each watch one);
// false when the deadline passed or the host aborted (the status says which peer).
template <typename X>
PZ_HD bool ipc_wait_all(X& x, const IpcCall& c, uint64_t (*flags)[kIpcMaxRanks], uint64_t e, uint64_t deadline) {
  bool ok = true;
  int b = x.block();
  for (int p = x.tid(); p < c.nranks; p += x.nthreads()) {
    if (p == c.rank) continue;
    const uint64_t* f = &flags[b][p];
    uint32_t spins = 0;
    bool left_seen = false;  // p left at an earlier check: its flags are final (see [Note: a peer that closed])
    while (x.load_acquire(f) < e) {
      if ((++spins & 1023u) == 0) {
        if (x.load_relaxed(c.abort) != 0) {
          ipc_fail(x, c.status, c.sigs[c.rank], ipc_failure(kIpcAborted, p, e, c.seq));
          ok = false;
          break;
        }
        if (x.load_acquire(&c.sigs[c.rank]->closed[p]) == kIpcLeft) {  // (kIpcClosing: its closing barrier
          if (left_seen) {                                              // still signals)
            ipc_fail(x, c.status, c.sigs[c.rank], ipc_failure(kIpcPeerClosed, p, e, c.seq));
            ok = false;
            break;
          }
          left_seen = true;
        }
        if (x.now_ns() > deadline) {
          ipc_fail(x, c.status, c.sigs[c.rank], ipc_failure(kIpcTimeout, p, e, c.seq));
          ok = false;
          break;
        }
      }
    }
  }
  return x.sync_and(ok);
}

// Tells every peer that this rank's block reached `which` of epoch e. The block barrier orders every
// thread's data writes before the signalling threads' release stores, and a release is cumulative: a
// peer that acquires the flag sees those writes. (No fence before the store: on sm_90 the release store
// is a system-scope membar and the store; a __threadfence_system() before it added a second membar,
// sequentially consistent, and an L1 invalidation to every signal, two per call.)
template <typename X>
PZ_HD void ipc_signal(X& x, const IpcCall& c, uint64_t e, bool mid) {
  x.sync();  // every thread's data writes of this block are done
  int b = x.block();
  for (int p = x.tid(); p < c.nranks; p += x.nthreads()) {
    if (p == c.rank) continue;
    uint64_t* f = mid ? &c.sigs[p]->mid[b][c.rank] : &c.sigs[p]->start[b][c.rank];
    x.store_release(f, e);
  }
}

// 16 bytes of T: what a thread moves at once where every pointer of a loop allows it.
template <typename T>
struct alignas(16) IpcVec {
  T v[16 / sizeof(T)];
};

// Elements before the pointers reach a 16-byte boundary together; -1 if they never do (their
// addresses differ mod 16: the loop stays scalar).
template <typename T>
PZ_HD int64_t ipc_head(const void* const* ptrs, int np) {
  uintptr_t a = uintptr_t(ptrs[0]) & 15u;
  for (int k = 1; k < np; ++k)
    if ((uintptr_t(ptrs[k]) & 15u) != a) return -1;
  return a % sizeof(T) ? -1 : int64_t(((16u - a) & 15u) / sizeof(T));
}

// dst[i] = src[i], i < n, by the block's threads: a scalar head, 16-byte vectors, a scalar tail.
template <typename T, typename X>
PZ_HD void ipc_copy(X& x, T* dst, const T* src, int64_t n) {
  constexpr int V = 16 / sizeof(T);
  const int t0 = x.tid(), nt = x.nthreads();
  const void* ptrs[2] = {dst, src};
  int64_t head = ipc_head<T>(ptrs, 2);
  x.path(head >= 0);
  if (head < 0 || head > n) head = n;
  for (int64_t i = t0; i < head; i += nt) dst[i] = src[i];
  const int64_t nv = (n - head) / V;
  IpcVec<T>* d = reinterpret_cast<IpcVec<T>*>(dst + head);
  const IpcVec<T>* s = reinterpret_cast<const IpcVec<T>*>(src + head);
  for (int64_t j = t0; j < nv; j += nt) d[j] = s[j];
  for (int64_t i = head + nv * V + t0; i < n; i += nt) dst[i] = src[i];
}

// dst[i] (and dst2[i], if set) = finish(srcs[0][i] (+) ... (+) srcs[n-1][i]), i < cnt, in source
// order in the accumulator type: per element exactly what cpu_reduce_many computes.
template <typename T, RedOp OP, typename X>
PZ_HD void ipc_reduce(X& x, T* dst, T* dst2, const T* const* srcs, int n, int64_t cnt) {
  using A = typename Acc<T>::type;
  constexpr int V = 16 / sizeof(T);
  const int t0 = x.tid(), nt = x.nthreads();
  const void* ptrs[kIpcMaxRanks + 2];
  int np = 0;
  for (int p = 0; p < n; ++p) ptrs[np++] = srcs[p];
  ptrs[np++] = dst;
  if (dst2) ptrs[np++] = dst2;
  int64_t head = ipc_head<T>(ptrs, np);
  x.path(head >= 0);
  if (head < 0 || head > cnt) head = cnt;
  // the sources' fp16 operands: see [Note: fp16 operands of an arithmetic op] (reduce_math.h)
  auto one = [&](int64_t i) {
    A acc = to_acc_first<OP>(srcs[0][i], n);
    for (int p = 1; p < n; ++p) acc = combine<OP>(acc, to_acc_operand<OP>(srcs[p][i]));
    T v = from_acc<T>(finish<OP>(acc, n));
    dst[i] = v;
    if (dst2) dst2[i] = v;
  };
  for (int64_t i = t0; i < head; i += nt) one(i);
  const int64_t nv = (cnt - head) / V;
  for (int64_t j = t0; j < nv; j += nt) {
    const int64_t i = head + j * V;
    IpcVec<T> in = *reinterpret_cast<const IpcVec<T>*>(srcs[0] + i);
    A acc[V];
    for (int l = 0; l < V; ++l) acc[l] = to_acc_first<OP>(in.v[l], n);
    for (int p = 1; p < n; ++p) {
      in = *reinterpret_cast<const IpcVec<T>*>(srcs[p] + i);
      for (int l = 0; l < V; ++l) acc[l] = combine<OP>(acc[l], to_acc_operand<OP>(in.v[l]));
    }
    IpcVec<T> o;
    for (int l = 0; l < V; ++l) o.v[l] = from_acc<T>(finish<OP>(acc[l], n));
    *reinterpret_cast<IpcVec<T>*>(dst + i) = o;
    if (dst2) *reinterpret_cast<IpcVec<T>*>(dst2 + i) = o;
  }
  for (int64_t i = head + nv * V + t0; i < cnt; i += nt) one(i);
}

// The whole call as block x.block() of rank c.rank runs it; false if it failed (see c.status).
template <typename T, RedOp OP, typename X>
PZ_HD bool ipc_run(X& x, const IpcCall& c) {
  const int b = x.block(), nb = x.nblocks(), me = c.rank, n = c.nranks, t0 = x.tid();
  if (!ipc_begin(x, c.sigs[me])) return false;
  const uint64_t deadline = x.now_ns() + c.timeout_ns;
  const uint64_t e = x.next_epoch(&c.sigs[me]->epoch[b]);
  const uint64_t parity = (e % 2) * c.area_stride;
  const int kind = c.desc.kind;
  const T* in = static_cast<const T*>(c.in);
  T* out = static_cast<T*>(c.out);
  T* mine = reinterpret_cast<T*>(c.areas[me] + parity);
  auto area = [&](int p) { return reinterpret_cast<const T*>(c.areas[p] + parity); };
  int64_t lo, hi;

  // 1. this rank's part of the data into its area, its descriptor
  IpcDesc desc = c.desc;
  desc.blocks = nb;
  if (t0 == 0) c.sigs[me]->desc[e % 2][b] = desc;
  if (kind == kIpcAllReduceOneShot || (kind == kIpcBroadcast && me == c.desc.root)) {
    ipc_part(c.desc.total, b, nb, lo, hi);
    ipc_copy(x, mine + lo, in + lo, hi - lo);
  } else if (kind == kIpcAllReduceTwoShot || kind == kIpcReduceScatter) {
    for (int k = 0; k < n; ++k) {  // the chunks the peers reduce (this rank's own is read from `in`)
      if (k == me) continue;
      ipc_part(c.counts[k], b, nb, lo, hi);
      ipc_copy(x, mine + c.offs[k] + lo, in + c.io_offs[k] + lo, hi - lo);
    }
  } else if (kind == kIpcAllGather) {
    ipc_part(c.counts[me], b, nb, lo, hi);
    ipc_copy(x, mine + c.offs[me] + lo, in + lo, hi - lo);
  }

  // 2. start barrier, then the descriptors
  ipc_signal(x, c, e, false);
  if (!ipc_wait_all(x, c, c.sigs[me]->start, e, deadline)) return false;
  int differs = -1, closed = -1, apart = -1;
  IpcDesc theirs{};
  for (int p = 0; p < n; ++p) {
    if (p == me) continue;
    const IpcDesc d = c.sigs[p]->desc[e % 2][b];
    if (!ipc_same_desc(d, desc)) differs = p;
    if (d.kind == kIpcClose && kind != kIpcClose) closed = p;
    if (d.launches != desc.launches || d.blocks != desc.blocks) {
      apart = p;
      theirs = d;
    }
  }
  if (differs >= 0) {
    if (t0 == 0) {
      IpcFailure f = ipc_failure(kIpcMismatch, differs, e, c.seq);
      if (closed >= 0) {
        f.code = kIpcPeerClosed;
        f.peer = closed;
      } else if (apart >= 0) {  // see [Note: ipc calls apart]
        f.code = kIpcApart;
        f.peer = apart;
        f.launches = desc.launches;
        f.peer_launches = theirs.launches;
        f.blocks = desc.blocks;
        f.peer_blocks = theirs.blocks;
      }
      ipc_fail(x, c.status, c.sigs[me], f);
    }
    return false;
  }
  if (kind == kIpcClose) {  // see [Note: a normal close]
    ipc_signal(x, c, e, true);
    return ipc_wait_all(x, c, c.sigs[me]->mid, e, deadline);
  }

  // 3. the data phase
  const T* srcs[kIpcMaxRanks];
  if (kind == kIpcAllReduceOneShot) {
    ipc_part(c.desc.total, b, nb, lo, hi);
    for (int p = 0; p < n; ++p) srcs[p] = area(p) + lo;
    ipc_reduce<T, OP>(x, out + lo, static_cast<T*>(nullptr), srcs, n, hi - lo);
  } else if (kind == kIpcAllReduceTwoShot || kind == kIpcReduceScatter) {
    const bool two = kind == kIpcAllReduceTwoShot;
    const int64_t off = c.offs[me], io = c.io_offs[me];
    ipc_part(c.counts[me], b, nb, lo, hi);
    for (int p = 0; p < n; ++p) srcs[p] = (p == me ? in + io : area(p) + off) + lo;  // own input read in place
    if (two) {
      ipc_reduce<T, OP>(x, mine + off + lo, out + io + lo, srcs, n, hi - lo);  // mine: for the peers' phase 2
      ipc_signal(x, c, e, true);
      if (!ipc_wait_all(x, c, c.sigs[me]->mid, e, deadline)) return false;
      for (int k = 0; k < n; ++k) {
        if (k == me) continue;
        ipc_part(c.counts[k], b, nb, lo, hi);
        ipc_copy(x, out + c.io_offs[k] + lo, area(k) + c.offs[k] + lo, hi - lo);
      }
    } else {
      ipc_reduce<T, OP>(x, out + lo, static_cast<T*>(nullptr), srcs, n, hi - lo);  // `out` is this rank's chunk
    }
  } else if (kind == kIpcAllGather) {
    for (int k = 0; k < n; ++k) {
      ipc_part(c.counts[k], b, nb, lo, hi);
      ipc_copy(x, out + c.io_offs[k] + lo, k == me ? in + lo : area(k) + c.offs[k] + lo, hi - lo);
    }
  } else if (kind == kIpcBroadcast) {
    ipc_part(c.desc.total, b, nb, lo, hi);
    if (me != c.desc.root) ipc_copy(x, out + lo, area(c.desc.root) + lo, hi - lo);
    else if (out != in) ipc_copy(x, out + lo, in + lo, hi - lo);
  }
  return true;
}

// One kernel launch of a call: its chunks, their offsets in the area and in
// the user buffers, and how far `in` / `out` are advanced (elements).
struct IpcPiece {
  std::vector<int64_t> counts, offs, io_offs;
  int64_t in_skip = 0, out_skip = 0;
  int64_t total() const {
    int64_t t = 0;
    for (int64_t c : counts) t += c;
    return t;
  }
};

// A call cut into pieces whose data fits one area of `area_bytes` (each piece
// is a launch of its own epoch). `chunks`: per rank, the elements of its chunk
// (all_reduce and broadcast: the whole buffer as one chunk per piece, split
// evenly over the ranks for the two-shot). Each rank's chunk is cut into the
// same number of pieces, so a piece stays a collective of the same kind.
inline std::vector<IpcPiece> ipc_pieces(int kind, const std::vector<int64_t>& chunks, int esize, uint64_t area_bytes,
                                        int me) {
  const int n = int(chunks.size());
  int64_t total = 0;
  for (int64_t c : chunks) total += c;
  const bool whole = kind == kIpcAllReduceOneShot || kind == kIpcAllReduceTwoShot || kind == kIpcBroadcast ||
                     kind == kIpcBarrier || kind == kIpcClose;
  const int64_t cap = int64_t(area_bytes / uint64_t(esize));
  int64_t np = total == 0 ? 1 : (total + cap - 1) / cap;
  for (;; ++np) {  // per-chunk rounding can add up to n elements to a piece
    std::vector<IpcPiece> out;
    bool fits = true;
    for (int64_t k = 0; k < np; ++k) {
      IpcPiece p;
      if (whole) {
        int64_t lo = total * k / np, hi = total * (k + 1) / np;
        p.counts = kind == kIpcAllReduceTwoShot ? split_even(hi - lo, n) : std::vector<int64_t>(n, 0);
        if (kind != kIpcAllReduceTwoShot) p.counts[0] = hi - lo;  // one chunk: the kernel uses desc.total
        p.offs.assign(n, 0);
        for (int c = 1; c < n; ++c) p.offs[c] = p.offs[c - 1] + p.counts[c - 1];
        p.io_offs = p.offs;
        p.in_skip = p.out_skip = lo;
      } else {
        p.counts.assign(n, 0);
        p.offs.assign(n, 0);
        p.io_offs.assign(n, 0);
        int64_t base = 0, area_off = 0;
        for (int c = 0; c < n; ++c) {
          int64_t lo = chunks[c] * k / np, hi = chunks[c] * (k + 1) / np;
          p.counts[c] = hi - lo;
          p.offs[c] = area_off;
          p.io_offs[c] = base + lo;
          area_off += hi - lo;
          base += chunks[c];
          if (c == me) {
            if (kind == kIpcAllGather) p.in_skip = lo;    // `in` is this rank's chunk
            if (kind == kIpcReduceScatter) p.out_skip = lo;  // `out` is this rank's chunk
          }
        }
        if (kind == kIpcAllGather) p.out_skip = 0;
      }
      fits = fits && uint64_t(p.total()) * uint64_t(esize) <= area_bytes;
      out.push_back(std::move(p));
    }
    if (fits) return out;
  }
}

}  // namespace pz
