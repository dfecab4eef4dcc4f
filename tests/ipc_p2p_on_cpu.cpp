// ipc_p2p_on_cpu.cpp — the ipc backend's point-to-point body (csrc/ipc_p2p.h)
// run by CPU threads: one thread per (rank, block), each rank's blocks meeting
// its host thread at a barrier between launches as a kernel boundary does.
// Random schedules of rounds that every rank runs in order: batches (each
// involved rank posts all of its sends and receives of the round in one
// launch, in random order, pairs sending to each other at once, several
// messages on one channel) and single send / recv launches (one launch per
// message on both sides); every dtype, sizes spanning many pieces of small
// slots, buffers at every offset (scalar and 16-byte copy loops). Every
// received buffer is compared bytewise with what its sender sent, and the
// bytes after it must be untouched. Then replays (one launch per rank, its
// arguments byte-identical each time, as a CUDA graph replays it, fresh data
// in the same buffers), and the faults: a send with no receive and a receive
// with no send time out naming the peer and what they waited for, a
// mismatched size is reported on both ranks and the channel goes on, an abort
// ends a wait. With -DPZ_IPC_P2P_NO_SLOT_WAIT the sender does not wait for a
// slot to be consumed (its reads of `consumed` see everything consumed), a
// deliberately broken protocol: the run must find wrong results. Last, the
// ring collectives of p2p_ring.h (algo="ring" on ipc) run over this
// point-to-point, each group one launch, against the reference reduction.
// Built and run by tests/test_ipc_protocol.py.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <memory>
#include <mutex>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "ipc_cpu_threads.h"
#include "collective.h"
#include "ipc_p2p.h"
#include "p2p_ring.h"

using namespace pz;

namespace {

using pz_cpu::Barrier;
using pz_cpu::run_rank_threads;

long paths[2] = {0, 0};  // copy loops run scalar / with 16-byte vectors
// The `consumed` arrays of every rank's signals (the broken build's sender sees them as all consumed).
std::vector<std::pair<const char*, const char*>> consumed_ranges;

struct CpuX {
  int b, nb;
  std::mt19937* rng;
  int pause_us;  // at most, before a block signals (its peers run ahead meanwhile)
  IpcP2PState st[kIpcMaxP2POps];  // the block's shared state (one thread per block here)
  IpcP2PState* p2p_state() { return st; }
  int block() const { return b; }
  int nblocks() const { return nb; }
  int tid() const { return 0; }
  int nthreads() const { return 1; }
  void sync() {}
  void path(bool vectorised) { __atomic_add_fetch(&paths[vectorised], 1, __ATOMIC_RELAXED); }
  bool sync_and(bool v) { return v; }
  uint64_t now_ns() const { return pz_cpu::now_ns(); }
  void store_release(uint64_t* p, uint64_t v) {  // a flag's store: a pause before it lets the peers run ahead
    if (pause_us && (*rng)() % 4 == 0) std::this_thread::sleep_for(std::chrono::microseconds((*rng)() % pause_us));
    __atomic_store_n(p, v, __ATOMIC_RELEASE);
  }
  uint64_t load_acquire(const uint64_t* p) {
#ifdef PZ_IPC_P2P_NO_SLOT_WAIT
    for (auto& r : consumed_ranges)
      if (reinterpret_cast<const char*>(p) >= r.first && reinterpret_cast<const char*>(p) < r.second)
        return ~0ull >> 1;
#endif
    uint64_t v = __atomic_load_n(p, __ATOMIC_ACQUIRE);
    std::this_thread::yield();  // a spin loop's read: the threads outnumber the cores
    return v;
  }
  uint32_t load_relaxed(const uint32_t* p) { return __atomic_load_n(p, __ATOMIC_RELAXED); }
  bool claim(uint64_t* word, uint64_t id) { return pz_cpu::claim(word, id); }
  void fence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
};

constexpr int kDTypes[] = {int(DType::f32), int(DType::f64), int(DType::f16), int(DType::bf16), int(DType::i32),
                           int(DType::i64)};

uint64_t mix(uint64_t a, uint64_t b) {
  uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull) * 0xC2B2AE3D27D4EB4Full;
  return h ^ (h >> 29);
}

// One operation of a launch as a rank issues it. `msg`: the message's global number (the data is
// made from it); `bytes`/`dtype`: what this side posts (a mismatch job makes them differ).
struct OpSpec {
  int peer;
  bool is_send;
  int64_t bytes;
  int dtype;
  int align;  // the buffer's byte offset from a 16-byte boundary
  uint64_t msg;
};
using Launch = std::vector<OpSpec>;

struct Job {
  int n, nb, slots, pause_us;
  uint64_t slot_bytes, timeout_ns;
  std::vector<std::vector<Launch>> launches;  // per rank, in order
  int replay = 0;  // > 0: every rank's single launch runs this many times, byte-identical arguments
  int abort_after_ms = -1;  // >= 0: the host sets the abort word then
  int closer = -1;  // >= 0: this rank closes the group once its own launches ended (IpcTransport::close)
  std::vector<uint64_t> call = {};  // per rank: its launches' IpcP2PCall::call (a ring collective's hash)
};

struct Outcome {
  // per rank and launch (per replay): the failure its host reports (the fault, else the mismatch, which
  // the host then clears: a fault stays), and both records
  std::vector<std::vector<IpcFailure>> status;
  std::vector<std::vector<IpcStatus>> full;
  int wrong = 0, checked = 0, replay_differs = 0;
  double seconds = 0;
};

void fill(std::vector<char>& buf, const OpSpec& o, uint64_t msg) {
  buf.assign(size_t(o.bytes) + 16 + 64, char(0x5a));  // 16: room for the offset; 64: bytes that must stay
  if (o.is_send)
    for (int64_t i = 0; i < o.bytes; ++i) buf[size_t(o.align + i)] = char(mix(msg, uint64_t(i)) & 0xff);
}

std::mutex print_mu;

// Every rank's point-to-point signals and incoming channels (zeroed, as the transport's registered
// buffers start), and the launch parameters the transport fills from them (launch_p2p_kernel): the
// caller adds the operations.
struct P2PMemory {
  int n, slots;
  uint64_t slot_bytes, chan_bytes;
  std::vector<std::unique_ptr<IpcP2PSignals>> sigs;
  std::vector<std::unique_ptr<IpcSignals>> own;  // the collective signals: closed, failure claims
  std::vector<std::vector<char>> chans;

  // `pad`: bytes past the last channel (an overrun lands there, not out of the buffer)
  P2PMemory(int n_, int nb, int slots_, uint64_t slot_bytes_, size_t pad)
      : n(n_), slots(slots_), slot_bytes(slot_bytes_), chan_bytes(uint64_t(nb) * uint64_t(slots_) * slot_bytes_),
        chans(n_) {
    for (int r = 0; r < n; ++r) {
      sigs.emplace_back(new IpcP2PSignals());
      std::memset(static_cast<void*>(sigs.back().get()), 0, sizeof(IpcP2PSignals));
      own.emplace_back(new IpcSignals());
      std::memset(static_cast<void*>(own.back().get()), 0, sizeof(IpcSignals));
      chans[r].assign(size_t(chan_bytes * uint64_t(n - 1)) + pad, 0);
    }
  }

  IpcP2PCall call(int me, IpcStatus* status, const uint32_t* abort, uint64_t seq, uint64_t timeout_ns) {
    IpcP2PCall c{};
    for (int p = 0; p < n; ++p) {
      c.sigs[p] = sigs[p].get();
      c.chans[p] = chans[p].data();
    }
    c.status = status;
    c.abort = abort;
    c.own = own[size_t(me)].get();
    c.chan_bytes = chan_bytes;
    c.slot_bytes = slot_bytes;
    c.slots = slots;
    c.seq = seq;
    c.timeout_ns = timeout_ns;
    c.rank = me;
    c.nranks = n;
    return c;
  }
};

#define DISPATCH_RING(dt, op, ...) PZ_DISPATCH_DTYPE(DType(dt), T, PZ_DISPATCH_OP(RedOp(op), OP, __VA_ARGS__))

Outcome run(const Job& job) {
  const int n = job.n, nb = job.nb;
  P2PMemory mem(n, nb, job.slots, job.slot_bytes, 16);
  consumed_ranges.clear();
  for (auto& sg : mem.sigs) {
    const char* c = reinterpret_cast<const char*>(&sg->consumed);
    consumed_ranges.push_back({c, c + sizeof(sg->consumed)});
  }
  std::vector<IpcStatus> status(n);
  uint32_t abort_word = 0;
  Outcome out;
  out.status.assign(n, {});
  out.full.assign(n, {});
  std::vector<Barrier*> ready;
  for (int r = 0; r < n; ++r) ready.push_back(new Barrier(nb + 1));
  std::vector<std::vector<IpcP2PCall>> calls(n);  // the launch each rank's blocks run next
  std::atomic<int> wrong{0}, checked{0}, differs{0};

  auto host = [&](int me) {
    const int reps = job.replay ? job.replay : 1;
    uint64_t seq = 0;
    std::vector<std::vector<char>> bufs;
    IpcP2PCall first{};
    for (size_t li = 0; li < job.launches[me].size(); ++li) {
      const Launch& L = job.launches[me][li];
      for (int rep = 0; rep < reps; ++rep) {
        if (rep == 0) bufs.assign(L.size(), {});
        for (size_t i = 0; i < L.size(); ++i) fill(bufs[i], L[i], L[i].msg + uint64_t(rep) * 1000003u);
        // (a replay: the number given at capture)
        IpcP2PCall c = mem.call(me, &status[me], &abort_word, job.replay ? 1 : ++seq, job.timeout_ns);
        c.nops = int(L.size());
        if (!job.call.empty()) c.call = job.call[size_t(me)];
        for (size_t i = 0; i < L.size(); ++i) {
          c.ops[i] = IpcP2POp{bufs[i].data() + L[i].align, L[i].bytes, L[i].peer, L[i].dtype, L[i].is_send, -1};
          for (size_t j = 0; j < i; ++j)
            if (L[j].peer == L[i].peer && L[j].is_send == L[i].is_send) c.ops[i].prev = int(j);
        }
        if (job.replay) {
          if (rep == 0) first = c;
          else if (std::memcmp(&c, &first, sizeof c) != 0) differs++;
        }
        calls[me].assign(1, c);
        ready[me]->arrive();  // blocks start
        ready[me]->arrive();  // blocks done (the kernel finished)
        out.status[me].push_back(ipc_reported(status[me]));
        out.full[me].push_back(status[me]);
        status[me].mismatch = IpcFailure{};  // raised once
        if (out.status[me].back().code != kIpcOk) continue;
        for (size_t i = 0; i < L.size(); ++i) {
          if (L[i].is_send) continue;
          checked++;
          const uint64_t msg = L[i].msg + uint64_t(rep) * 1000003u;
          const char* got = bufs[i].data() + L[i].align;
          std::string why;
          for (int64_t k = 0; k < L[i].bytes && why.empty(); ++k)
            if (got[k] != char(mix(msg, uint64_t(k)) & 0xff)) why = "byte " + std::to_string(k);
          for (int64_t k = L[i].bytes; k < L[i].bytes + 64 && why.empty(); ++k)
            if (got[k] != char(0x5a)) why = "byte " + std::to_string(k) + " past the end written";
          if (!why.empty()) {
            std::lock_guard<std::mutex> l(print_mu);
            if (wrong++ < 5)
              std::printf("WRONG rank %d launch %zu op %zu (from %d, %lld bytes): %s\n", me, li, i, L[i].peer,
                          (long long)L[i].bytes, why.c_str());
          }
        }
      }
    }
    calls[me].clear();
    ready[me]->arrive();  // no more launches
    if (me == job.closer)  // its kernels ended ("blocks done"): tell every peer, as close() does
      for (int p = 0; p < n; ++p)
        if (p != me) __atomic_store_n(&mem.own[size_t(p)]->closed[me], uint64_t(kIpcLeft), __ATOMIC_RELEASE);
  };
  auto block = [&](int me, int b) {
    std::mt19937 rng(unsigned(me * 131 + b * 7 + 1));
    CpuX x{b, nb, &rng, job.pause_us, {}};
    for (;;) {
      ready[me]->arrive();
      if (calls[me].empty()) return;
      IpcP2PCall c = calls[me][0];
      ipc_p2p_run(x, c);
      ready[me]->arrive();
    }
  };
  auto t0 = std::chrono::steady_clock::now();
  std::thread aborter;
  if (job.abort_after_ms >= 0)
    aborter = std::thread([&] {
      std::this_thread::sleep_for(std::chrono::milliseconds(job.abort_after_ms));
      __atomic_store_n(&abort_word, 1u, __ATOMIC_RELAXED);
    });
  run_rank_threads(n, nb, host, block);
  if (aborter.joinable()) aborter.join();
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (auto* p : ready) delete p;
  out.wrong = wrong;
  out.checked = checked;
  out.replay_differs = differs;
  return out;
}

// A random schedule of rounds: every rank runs its launches of round r before those of round r + 1.
std::vector<std::vector<Launch>> random_rounds(int n, int rounds, int64_t max_bytes, std::mt19937_64& g,
                                               uint64_t& msg) {
  std::vector<std::vector<Launch>> out(n);
  auto spec = [&](int peer, bool is_send, int64_t bytes, int dt, uint64_t m) {
    return OpSpec{peer, is_send, bytes, dt, int(g() % 16) / dtype_size(DType(dt)) * dtype_size(DType(dt)), m};
  };
  for (int r = 0; r < rounds; ++r) {
    if (g() % 3 == 0) {  // one pair, 1-3 messages, each its own launch on both sides
      int a = int(g() % n), b = int((a + 1 + g() % (n - 1)) % n);
      int k = 1 + int(g() % 3);
      for (int i = 0; i < k; ++i) {
        int dt = kDTypes[g() % 6];
        int64_t bytes = int64_t(g() % uint64_t(max_bytes / dtype_size(DType(dt)) + 1)) * dtype_size(DType(dt));
        ++msg;
        out[a].push_back({spec(b, true, bytes, dt, msg)});
        out[b].push_back({spec(a, false, bytes, dt, msg)});
      }
    } else {  // a batch: random messages, both ways at once, some on one channel twice
      std::vector<Launch> batch(n);
      int k = 1 + int(g() % (2 * n));
      if (g() % 2)  // a ring step: everyone sends to the next and receives from the previous
        for (int s = 0; s < n; ++s) {
          int dt = kDTypes[g() % 6];
          int64_t bytes = int64_t(g() % uint64_t(max_bytes / dtype_size(DType(dt)) + 1)) * dtype_size(DType(dt));
          ++msg;
          batch[s].push_back(spec((s + 1) % n, true, bytes, dt, msg));
          batch[(s + 1) % n].push_back(spec(s, false, bytes, dt, msg));
        }
      for (int i = 0; i < k; ++i) {
        int a = int(g() % n), b = int((a + 1 + g() % (n - 1)) % n);
        int dt = kDTypes[g() % 6];
        int64_t bytes = int64_t(g() % uint64_t(max_bytes / dtype_size(DType(dt)) + 1)) * dtype_size(DType(dt));
        ++msg;
        batch[a].push_back(spec(b, true, bytes, dt, msg));
        batch[b].push_back(spec(a, false, bytes, dt, msg));
      }
      for (int s = 0; s < n; ++s) {
        if (batch[s].empty()) continue;
        // shuffle, keeping each channel's messages in their order (the receiver's order is the sender's)
        std::vector<int> keys(batch[s].size());
        for (auto& kk : keys) kk = int(g() % 1000);
        std::vector<size_t> idx(batch[s].size());
        for (size_t i = 0; i < idx.size(); ++i) idx[i] = i;
        std::stable_sort(idx.begin(), idx.end(), [&](size_t x, size_t y) { return keys[x] < keys[y]; });
        // stable order per channel: reassign the channel's messages in order to its positions
        Launch shuffled(batch[s].size());
        std::vector<bool> used(batch[s].size(), false);
        for (size_t pos = 0; pos < idx.size(); ++pos) shuffled[pos] = batch[s][idx[pos]];
        for (size_t pos = 0; pos < idx.size(); ++pos) {
          // the earliest unused original op of this position's channel
          for (size_t j = 0; j < batch[s].size(); ++j)
            if (!used[j] && batch[s][j].peer == shuffled[pos].peer && batch[s][j].is_send == shuffled[pos].is_send) {
              used[j] = true;
              shuffled[pos] = batch[s][j];
              break;
            }
        }
        out[s].push_back(shuffled);
      }
    }
  }
  return out;
}

// ---------------------------------------------------------------------------
// The ring collectives of p2p_ring.h over this point-to-point (algo="ring" on ipc): each rank's host
// thread runs p2p_ring_collective; every group becomes one launch of the rank's blocks, the
// element-wise kernels run on the host thread between launches (stream order).

template <typename T>
T value_of(uint64_t h) {  // small exact values: sums and products of a few stay exact in any order
  int v = int(h % 7) - 3;
  if (v == 0) v = 1;
  if constexpr (std::is_integral_v<T>) return T(v);
  else return from_acc<T>(typename Acc<T>::type(v) * typename Acc<T>::type(0.5));
}

struct RingSpec {
  Coll coll;
  int dt, op, root;
  std::vector<int64_t> counts;  // chunks (all_reduce, broadcast: one entry, the total)
};

template <typename T, RedOp OP>
struct CpuRingExec {
  using W = typename Acc<T>::type;
  int me, n;
  std::function<bool(IpcP2POp*, int)> launch;  // one launch of the rank's blocks; false if it failed
  bool ok = true;
  void group(const void* s, size_t sb, void* r, size_t rb) {
    if (!s && !r) return;
    IpcP2POp ops[2];
    int k = 0;
    if (s) ops[k++] = IpcP2POp{const_cast<void*>(s), int64_t(sb), (me + 1) % n, 0, 1, -1};
    if (r) ops[k++] = IpcP2POp{r, int64_t(rb), (me + n - 1) % n, 0, 0, -1};
    ok = launch(ops, k) && ok;
  }
  void copy(const void* src, void* dst, int64_t c) { std::memmove(dst, src, size_t(c) * sizeof(T)); }
  void pack(const void* src, void* dst, int64_t c) {
    for (int64_t i = 0; i < c; ++i) static_cast<W*>(dst)[i] = to_acc(static_cast<const T*>(src)[i]);
  }
  void reduce(const void* in, const void* own, void* out, int64_t c) {
    for (int64_t i = 0; i < c; ++i)
      static_cast<W*>(out)[i] = combine<OP>(static_cast<const W*>(in)[i], to_acc(static_cast<const T*>(own)[i]));
  }
  void reduce_final(const void* in, const void* own, void* dst, int64_t c) {
    for (int64_t i = 0; i < c; ++i)
      static_cast<T*>(dst)[i] =
          from_acc<T>(finish<OP>(combine<OP>(static_cast<const W*>(in)[i], to_acc(static_cast<const T*>(own)[i])), n));
  }
};

// Runs the ring collectives `specs` on n ranks of nb blocks; returns wrong results (failed launches count too).
int run_ring(int n, int nb, const std::vector<RingSpec>& specs, size_t stage_bytes, long& groups) {
  P2PMemory mem(n, nb, 2, 64, 0);
  consumed_ranges.clear();
  std::vector<IpcStatus> status(n);
  uint32_t abort_word = 0;
  std::vector<Barrier*> ready;
  for (int r = 0; r < n; ++r) ready.push_back(new Barrier(nb + 1));
  std::vector<std::vector<IpcP2PCall>> calls(n);
  std::atomic<int> wrong{0};
  std::atomic<long> launched{0};
  auto host = [&](int me) {
    uint64_t seq = 0;
    auto launch = [&](IpcP2POp* ops, int k) {
      IpcP2PCall c = mem.call(me, &status[me], &abort_word, ++seq, 5000000000ull);
      c.nops = k;
      for (int i = 0; i < k; ++i) c.ops[i] = ops[i];
      c.call = 1;  // (a ring collective's message: the ranks' calls agree here)
      calls[me].assign(1, c);
      ready[me]->arrive();
      ready[me]->arrive();
      launched++;
      return ipc_reported(status[me]).code == kIpcOk;
    };
    for (size_t k = 0; k < specs.size(); ++k) {
      const RingSpec& sp = specs[k];
      ChunkLayout L(sp.coll == Coll::all_reduce ? split_even(sp.counts[0], n) : sp.counts);
      const int64_t total = L.total();
      std::string why;
      DISPATCH_RING(sp.dt, sp.op, {
        using W = typename Acc<T>::type;
        const int64_t in_n = sp.coll == Coll::all_gather ? L.counts[me] : total;
        const int64_t in_base = sp.coll == Coll::all_gather ? L.offsets[me] : 0;
        std::vector<T> in(size_t(std::max<int64_t>(in_n, 1))), out(size_t(std::max<int64_t>(total, 1)));
        for (int64_t i = 0; i < in_n; ++i) in[size_t(i)] = value_of<T>(mix(k * 131 + me, uint64_t(in_base + i)));
        if (sp.coll == Coll::broadcast) out = in;
        std::vector<W> stages(2 * (stage_bytes / sizeof(W)) + 2);
        CpuRingExec<T, OP> x{me, n, launch};
        // reduce_scatter: `out` is this rank's chunk (its first counts[me] elements)
        p2p_ring_collective<T>(x, sp.coll, out.data(), sp.coll == Coll::broadcast ? nullptr : in.data(), L, sp.root, me, n,
                               stages.data(), stages.data() + stage_bytes / sizeof(W), stage_bytes);
        if (!x.ok) why = "a launch failed";
        auto input = [&](int r, int64_t i) { return value_of<T>(mix(k * 131 + r, uint64_t(i))); };
        auto reduced = [&](int64_t i) {
          W acc = to_acc(input(0, i));
          for (int p = 1; p < n; ++p) acc = combine<OP>(acc, to_acc(input(p, i)));
          return from_acc<T>(finish<OP>(acc, n));
        };
        std::vector<T> want;
        if (sp.coll == Coll::all_reduce)
          for (int64_t i = 0; i < total; ++i) want.push_back(reduced(i));
        else if (sp.coll == Coll::reduce_scatter)
          for (int64_t i = L.offsets[me]; i < L.offsets[me + 1]; ++i) want.push_back(reduced(i));
        else if (sp.coll == Coll::all_gather)
          for (int r = 0; r < n; ++r)
            for (int64_t i = L.offsets[r]; i < L.offsets[r + 1]; ++i) want.push_back(input(r, i));
        else
          for (int64_t i = 0; i < total; ++i) want.push_back(input(sp.root, i));
        if (why.empty() && !want.empty() && std::memcmp(out.data(), want.data(), want.size() * sizeof(T)) != 0)
          why = "differs from the reference";
      });
      if (!why.empty()) {
        std::lock_guard<std::mutex> l(print_mu);
        if (wrong++ < 5)
          std::printf("WRONG ring rank %d call %zu coll %s dtype %d op %d: %s\n", me, k, coll_name(sp.coll), sp.dt,
                      sp.op, why.c_str());
      }
    }
    calls[me].clear();
    ready[me]->arrive();
  };
  auto block = [&](int me, int b) {
    std::mt19937 rng(unsigned(me * 131 + b * 7 + 1));
    CpuX x{b, nb, &rng, 20, {}};
    for (;;) {
      ready[me]->arrive();
      if (calls[me].empty()) return;
      IpcP2PCall c = calls[me][0];
      ipc_p2p_run(x, c);
      ready[me]->arrive();
    }
  };
  run_rank_threads(n, nb, host, block);
  for (auto* p : ready) delete p;
  groups += launched;
  return wrong;
}

int failures = 0, cases = 0;

bool all_ok(const Outcome& o) {
  for (auto& r : o.status)
    for (auto& s : r)
      if (s.code != kIpcOk) return false;
  return true;
}

}  // namespace

int main() {
  std::mt19937_64 g(2024);
  uint64_t msg = 0;
  int total_wrong = 0;
  // 1. random rounds at 2, 3 and 4 ranks, 1 and 3 blocks: 64-byte slots, 3 per lane
  for (int n : {2, 3, 4}) {
    for (int nb : {1, 3}) {
      Job job{n, nb, 3, 60, 64, 5000000000ull, random_rounds(n, 150, 1500, g, msg)};
      Outcome o = run(job);
      size_t launches = 0;
      for (auto& r : job.launches) launches += r.size();
      bool ok = all_ok(o) && o.wrong == 0;
      failures += !ok;
      cases += o.checked;
      total_wrong += o.wrong;
      std::printf("ranks %d blocks %d: %zu launches, %d messages checked, %d wrong, %s (%.2f s)\n", n, nb, launches,
                  o.checked, o.wrong, all_ok(o) ? "no failure" : "FAILED", o.seconds);
    }
  }
  // 2. replays: a ring step and a message both ways, byte-identical arguments 30 times
  for (int n : {2, 3}) {
    Job job{n, 2, 2, 30, 48, 5000000000ull, std::vector<std::vector<Launch>>(n)};
    for (int s = 0; s < n; ++s) {
      const int nx = (s + 1) % n, pv = (s + n - 1) % n;
      job.launches[s].push_back({OpSpec{nx, true, 1000 + 8 * s, int(DType::f32), 8 * (s % 2), 100 + uint64_t(s)},
                                 OpSpec{pv, false, 1000 + 8 * pv, int(DType::f32), 0, 100 + uint64_t(pv)}});
    }
    job.replay = 30;
    Outcome o = run(job);
    bool ok = all_ok(o) && o.wrong == 0 && o.replay_differs == 0 && o.checked == 30 * n;
    failures += !ok;
    cases += o.checked;
    total_wrong += o.wrong;
    std::printf("replay ranks %d: %d messages checked, %d wrong, %d launches with other arguments: %s\n", n,
                o.checked, o.wrong, o.replay_differs, ok ? "ok" : "FAILED");
  }
  // 3. the ring collectives (algo="ring") over this point-to-point: every collective, dtype and op,
  //    uneven and zero chunks, staging of a few elements so calls run in many groups
  {
    std::mt19937_64 rg(77);
    for (int n : {2, 3, 4}) {
      std::vector<RingSpec> specs;
      for (int k = 0; k < 24; ++k) {
        RingSpec sp{Coll(rg() % 4), kDTypes[rg() % 6], int(rg() % 5), int(rg() % n), {}};
        int64_t total = int64_t(rg() % 300);
        if (sp.coll == Coll::all_reduce || sp.coll == Coll::broadcast) {
          sp.counts = {total};
        } else {
          sp.counts.assign(n, 0);
          for (int64_t i = 0; i < total; ++i) sp.counts[rg() % n] += (rg() % 4 == 0) ? 0 : 1;
        }
        specs.push_back(sp);
      }
      long groups = 0;
      int wrong = run_ring(n, 2, specs, 96, groups);
      failures += wrong != 0;
      cases += int(specs.size()) * n;
      total_wrong += wrong;
      std::printf("ring ranks %d: %zu collectives, %ld launches, %d wrong\n", n, specs.size(), groups, wrong);
    }
  }
#ifdef PZ_IPC_P2P_NO_SLOT_WAIT
  std::printf("no slot wait: %d wrong results\n", total_wrong);
  return 0;
#endif
  // 3. a send with no receive: it times out naming the receiver (waiting for its receive to be posted)
  {
    Job job{2, 2, 2, 0, 64, 200000000ull, std::vector<std::vector<Launch>>(2)};
    job.launches[0].push_back({OpSpec{1, true, 4000, int(DType::f32), 0, 1}});
    Outcome o = run(job);
    const IpcFailure& s = o.status[0][0];
    bool ok = s.code == kIpcTimeout && s.peer == 1 && s.p2p == kIpcP2PSendPost && s.bytes == 4000 && s.epoch == 1 &&
              o.seconds < 3.0;
    std::printf("send without receive: code %u peer %d waiting %d bytes %lld: %s\n", s.code, s.peer, s.p2p,
                (long long)s.bytes, ok ? "ok" : "FAILED");
    failures += !ok;
    ++cases;
  }
  // 4. a receive with no send, at 3 ranks: it times out naming the sender
  {
    Job job{3, 1, 2, 0, 64, 200000000ull, std::vector<std::vector<Launch>>(3)};
    job.launches[2].push_back({OpSpec{0, false, 96, int(DType::i64), 0, 1}});
    Outcome o = run(job);
    const IpcFailure& s = o.status[2][0];
    bool ok = s.code == kIpcTimeout && s.peer == 0 && s.p2p == kIpcP2PRecvSend && o.seconds < 3.0;
    std::printf("receive without send: code %u peer %d waiting %d: %s\n", s.code, s.peer, s.p2p, ok ? "ok" : "FAILED");
    failures += !ok;
    ++cases;
  }
  // 5. mismatched sizes (rank 0 sends 400 bytes, rank 1 receives 480) and dtypes: both report it,
  //    naming each other and both sizes; the next messages on the channel arrive intact
  {
    Job job{2, 3, 2, 20, 64, 5000000000ull, std::vector<std::vector<Launch>>(2)};
    job.launches[0].push_back({OpSpec{1, true, 400, int(DType::f32), 0, 1}});
    job.launches[1].push_back({OpSpec{0, false, 480, int(DType::f32), 0, 1}});
    job.launches[0].push_back({OpSpec{1, true, 64, int(DType::f32), 0, 2}});
    job.launches[1].push_back({OpSpec{0, false, 64, int(DType::i32), 0, 2}});
    for (uint64_t m = 3; m < 6; ++m) {  // then fine: a batch both ways, several pieces
      job.launches[0].push_back({OpSpec{1, true, 2000, int(DType::f16), 2, m}, OpSpec{1, false, 1000, int(DType::f64), 0, m + 10}});
      job.launches[1].push_back({OpSpec{0, true, 1000, int(DType::f64), 8, m + 10}, OpSpec{0, false, 2000, int(DType::f16), 4, m}});
    }
    Outcome o = run(job);
    const IpcFailure &a = o.status[0][0], &b = o.status[1][0], &c = o.status[0][1], &d = o.status[1][1];
    bool ok = a.code == kIpcMismatch && a.peer == 1 && a.p2p == kIpcP2PSendPost && a.bytes == 400 &&
              a.peer_bytes == 480 && b.code == kIpcMismatch && b.peer == 0 && b.p2p == kIpcP2PRecvSend &&
              b.bytes == 480 && b.peer_bytes == 400 && c.code == kIpcMismatch && c.peer_dtype == int(DType::i32) &&
              d.code == kIpcMismatch && d.dtype == int(DType::i32) && o.wrong == 0 && o.checked == 6;
    for (int r = 0; r < 2; ++r)
      for (size_t k = 2; k < o.status[r].size(); ++k) ok = ok && o.status[r][k].code == kIpcOk;
    std::printf("mismatch: codes %u %u, bytes %lld/%lld and %lld/%lld, then %d messages intact: %s\n", a.code, b.code,
                (long long)a.bytes, (long long)a.peer_bytes, (long long)b.bytes, (long long)b.peer_bytes, o.checked,
                ok ? "ok" : "FAILED");
    failures += !ok;
    ++cases;
  }
  // 6. an abort ends a send's wait long before its deadline
  {
    Job job{2, 2, 2, 0, 64, 60000000000ull, std::vector<std::vector<Launch>>(2)};
    job.launches[1].push_back({OpSpec{0, true, 100, int(DType::f32), 0, 1}});
    job.abort_after_ms = 50;
    Outcome o = run(job);
    const IpcFailure& s = o.status[1][0];
    bool ok = s.code == kIpcAborted && s.peer == 0 && o.seconds < 3.0;
    std::printf("abort: code %u peer %d, %.2f s: %s\n", s.code, s.peer, o.seconds, ok ? "ok" : "FAILED");
    failures += !ok;
    ++cases;
  }
  // 7. a peer that closed the group: what it completed before leaving still arrives, what waits
  // on it then fails at once naming it (not at the 60 s deadline), a receive and a send alike (each
  // in a job of its own: after the first failure, a fault, the group runs nothing more)
  {
    Outcome o[2];
    for (int v = 0; v < 2; ++v) {
      Job job{2, 2, 2, 0, 64, 60000000000ull, std::vector<std::vector<Launch>>(2)};
      job.launches[0].push_back({OpSpec{1, true, 1000, int(DType::f32), 0, 1}});  // 1000 bytes: past the slots
      job.launches[1].push_back({OpSpec{0, false, 1000, int(DType::f32), 4, 1}});
      if (v == 0) job.launches[1].push_back({OpSpec{0, false, 100, int(DType::f32), 0, 2}});  // never sent
      else job.launches[1].push_back({OpSpec{0, true, 100, int(DType::f32), 0, 3}});  // never received
      job.closer = 0;
      o[v] = run(job);
    }
    const IpcFailure &a = o[0].status[1][0], &b = o[0].status[1][1], &c = o[1].status[1][1];
    bool ok = a.code == kIpcOk && o[0].checked == 1 && o[0].wrong == 0 && b.code == kIpcPeerClosed && b.peer == 0 &&
              b.p2p == kIpcP2PRecvSend && b.epoch == 2 && c.code == kIpcPeerClosed && c.peer == 0 &&
              c.p2p == kIpcP2PSendPost && o[1].status[1][0].code == kIpcOk && o[1].wrong == 0 &&
              o[0].seconds + o[1].seconds < 10.0;
    std::printf("peer closed: codes %u %u %u peer %d waiting %d and %d, %d received, %.2f s: %s\n", a.code, b.code,
                c.code, b.peer, b.p2p, c.p2p, o[0].checked, o[0].seconds + o[1].seconds, ok ? "ok" : "FAILED");
    failures += !ok;
    ++cases;
  }
  // 8. a batch whose send mismatches its receive and whose receive never comes: the receive's timeout
  //    is reported (a fault: the group is unusable, the next launch does nothing), not hidden behind the
  //    mismatch, which is kept apart (were: only the mismatch, then the group went on)
  {
    Job job{2, 2, 2, 0, 64, 200000000ull, std::vector<std::vector<Launch>>(2)};
    job.launches[0].push_back(
        {OpSpec{1, true, 400, int(DType::f32), 0, 1}, OpSpec{1, false, 100, int(DType::f32), 0, 2}});
    job.launches[1].push_back({OpSpec{0, false, 480, int(DType::f32), 0, 1}});
    job.launches[0].push_back({OpSpec{1, true, 64, int(DType::f32), 0, 3}});
    job.launches[1].push_back({OpSpec{0, false, 64, int(DType::f32), 0, 3}});
    Outcome o = run(job);
    const IpcStatus& a = o.full[0][0];
    const IpcFailure &b = o.status[1][0], &a2 = o.status[0][1];
    bool ok = a.fault.code == kIpcTimeout && a.fault.peer == 1 && a.fault.p2p == kIpcP2PRecvSend &&
              a.mismatch.code == kIpcMismatch && a.mismatch.bytes == 400 && a.mismatch.peer_bytes == 480 &&
              b.code == kIpcMismatch && a2.code == kIpcTimeout && o.seconds < 3.0;
    std::printf("mismatch and timeout: rank 0 fault %u waiting %d and mismatch %u, then %u; rank 1 %u: %s\n",
                a.fault.code, a.fault.p2p, a.mismatch.code, a2.code, b.code, ok ? "ok" : "FAILED");
    failures += !ok;
    ++cases;
  }
  // 9. a ring collective's messages (IpcP2PCall::call) whose ranks' calls differ: both report the calls
  //    apart (a fault: their message counts may differ), and the next launch does nothing (were: a
  //    mismatch, then the channel went on pairing the calls' later messages with others)
  {
    Job job{2, 2, 2, 0, 64, 2000000000ull, std::vector<std::vector<Launch>>(2)};
    for (uint64_t m = 1; m <= 2; ++m)
      for (int r = 0; r < 2; ++r)
        job.launches[r].push_back({OpSpec{1 - r, true, 96, int(DType::f32), 0, 10 * m + r},
                                   OpSpec{1 - r, false, 96, int(DType::f32), 0, 10 * m + 1 - r}});
    job.call = {0x1235, 0x4567};
    Outcome o = run(job);
    bool ok = o.checked == 0 && o.seconds < 3.0;
    for (int r = 0; r < 2; ++r)
      for (auto& f : o.status[r]) ok = ok && f.code == kIpcApart && f.peer == 1 - r;
    std::printf("ring calls apart: codes %u %u then %u %u: %s\n", o.status[0][0].code, o.status[1][0].code,
                o.status[0][1].code, o.status[1][1].code, ok ? "ok" : "FAILED");
    failures += !ok;
    ++cases;
  }
  std::printf("loops: %ld scalar, %ld vectorised\n", paths[0], paths[1]);
  std::printf("%d cases, %d failures\n", cases, failures);
  return failures ? 1 : 0;
}
