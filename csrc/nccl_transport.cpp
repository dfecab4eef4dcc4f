// nccl_transport.cpp — see nccl_transport.h, [Note: ordering across streams]
// and p2p_ring.h's [Note: pairing sends with receives].
#include "nccl_transport.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <mutex>
#include <sstream>
#include <thread>

#include "cuda_api.h"
#include "cuda_check.h"
#include "errors.h"
#include "nccl_api.h"
#include "nccl_types.h"
#include "p2p_ring.h"

namespace pz {

namespace {

using Clock = std::chrono::steady_clock;

ncclDataType_t nccl_dtype(DType d) {
  ncclDataType_t t;
  if (!to_nccl(d, t))
    throw std::invalid_argument("unsupported dtype code; expected float32, float16, bfloat16, float64, int32 or int64");
  return t;
}

ncclRedOp_t nccl_op(RedOp o) {
  ncclRedOp_t t;
  if (!to_nccl(o, t)) throw std::invalid_argument("unsupported reduction op; expected sum, avg, max, min or prod");
  return t;
}

Clock::duration seconds(double s) {
  return std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(std::min(s, 1e9)));
}

// Yield at first (a GPU answers within microseconds), then sleep with a
// growing back-off up to 1 ms, so a long wait costs no CPU.
struct Backoff {
  int it = 0;
  void pause() {
    if (it < 200) {
      ++it;
      std::this_thread::yield();
      return;
    }
    int us = std::min(1000, 10 + 5 * (it++ - 200));
    std::this_thread::sleep_for(std::chrono::microseconds(us));
  }
};

}  // namespace

// ---------------------------------------------------------------------------
// State

struct NcclWork::State {
  std::shared_ptr<NcclTransport::Impl> impl;
  std::shared_ptr<Event> ev;
  std::string what;
  bool captured = false;  // issued into a CUDA graph capture: the host cannot wait for it
};

struct NcclTransport::Impl {
  int rank = 0, n = 1, device = 0;
  NcclConfig cfg;
  ncclComm_t comm = nullptr;
  cudaStream_t stream = nullptr;   // async_op work runs here
  cudaEvent_t handoff = nullptr;   // caller's stream -> `stream`, re-recorded by every async call
  char* staging = nullptr;         // [ring send | ring recv | one-shot: n x oneshot_bytes | barrier word]
  size_t oneshot_off = 0, barrier_off = 0;

  std::mutex mu;  // one thread in NCCL at a time; abort takes it too
  uint64_t seq = 0;
  std::shared_ptr<Event> last;  // see [Note: ordering across streams]
  std::shared_ptr<EventPool> events = EventPool::make();  // every call's completion event
  cudaStream_t last_stream = nullptr;
  unsigned long long last_capture = 0;  // the capture `last` was recorded in (0: none), see
                                        // [Note: nccl calls in a CUDA graph]
  bool aborted = false, closed = false;

  std::mutex fmu;            // guards `why`
  std::atomic<int> broken{0};  // 0: usable, 1: failed (error), 2: failed (timeout)
  std::string why;

  struct Watch {
    std::shared_ptr<Event> ev;
    Clock::time_point deadline;
    std::string what;
  };
  std::mutex wmu;
  std::condition_variable wcv;
  std::deque<Watch> watch;
  bool stop = false;
  std::thread watchdog;

  OpCounters counters;

  ~Impl() {
    try {
      close();
    } catch (...) {
    }
  }

  char* send_stage() const { return staging; }
  char* recv_stage() const { return staging + cfg.slice_bytes; }

  std::string where(const char* what) const {  // (built for every call: no ostringstream)
    return std::string(what) + " (rank " + std::to_string(rank) + " of " + std::to_string(n) + ", seq " +
           std::to_string(seq) + ", nccl)";
  }

  // ---- failure ----

  // Records the first failure; later ones keep its cause.
  void mark_broken(int kind, const std::string& msg) {
    std::lock_guard<std::mutex> g(fmu);
    if (broken.load()) return;
    why = msg;
    broken.store(kind);
  }
  // Raises the recorded failure; `label` names the operation that hit it.
  [[noreturn]] void throw_broken(const std::string& label) {
    std::string msg;
    {
      std::lock_guard<std::mutex> g(fmu);
      msg = why;
    }
    if (!label.empty() && msg.compare(0, label.size(), label) != 0)
      msg = label + ": group unusable after an earlier failure: " + msg;
    if (broken.load() == 2) throw CollectiveTimeout(msg);
    throw CollectiveError(msg);
  }
  void abort_locked() {  // mu held
    if (comm && !aborted) {
      nccl().CommAbort(comm);
      aborted = true;
    }
  }
  [[noreturn]] void fail_locked(int kind, const std::string& msg) {
    mark_broken(kind, msg);
    abort_locked();
    throw_broken("");
  }
  // From the watchdog or a host wait (mu not held).
  void fail(int kind, const std::string& msg) {
    mark_broken(kind, msg);
    std::lock_guard<std::mutex> g(mu);
    abort_locked();
  }

  [[noreturn]] void fail_nccl(ncclResult_t r, const char* what) {
    std::string msg = where(what) + ": NCCL error: " + nccl().GetErrorString(r);
    const char* detail = nccl().GetLastError(comm);
    if (detail && *detail) msg += std::string(" (") + detail + ")";
    // A rejected argument enqueued nothing: the group stays usable.
    if (r == ncclInvalidArgument || r == ncclInvalidUsage) throw std::invalid_argument(msg);
    fail_locked(1, msg);
  }

  // mu held. An error the communicator reports asynchronously (even an
  // invalid argument or usage) leaves it in an error state: abort it, whatever
  // the kind, so every rank's next call fails instead of hanging.
  [[noreturn]] void fail_async(ncclResult_t st, const char* what) {
    std::string msg = where(what) + ": asynchronous NCCL error: " + nccl().GetErrorString(st);
    const char* detail = nccl().GetLastError(comm);
    if (detail && *detail) msg += std::string(" (") + detail + ")";
    fail_locked(1, msg);
  }

  // mu held. A non-blocking communicator answers ncclInProgress while it
  // connects or enqueues in the background: poll until it is done.
  void check(ncclResult_t r, const char* what) {
    if (r == ncclSuccess) return;
    if (r != ncclInProgress) fail_nccl(r, what);
    auto deadline = Clock::now() + seconds(cfg.timeout_s);
    Backoff b;
    for (;;) {
      ncclResult_t st = ncclInProgress;
      ncclResult_t q = nccl().CommGetAsyncError(comm, &st);
      if (q != ncclSuccess) fail_nccl(q, what);
      if (st == ncclSuccess) return;
      if (st != ncclInProgress) fail_async(st, what);
      if (broken.load()) {
        abort_locked();
        throw_broken(where(what));
      }
      if (Clock::now() > deadline) {
        std::ostringstream os;
        os << where(what) << ": timed out after " << cfg.timeout_s
           << " s waiting for NCCL to set up or enqueue: a rank of the group did not take part";
        fail_locked(2, os.str());
      }
      b.pause();
    }
  }

  // mu held. One ncclGroupStart/End around `issue`, which reports each call's
  // result through the callback; ncclGroupEnd runs even when one failed.
  template <typename F>
  void grouped(const char* what, F issue) {
    check(nccl().GroupStart(), what);
    ncclResult_t first = ncclSuccess;
    issue([&](ncclResult_t r) {
      if (first == ncclSuccess && r != ncclSuccess && r != ncclInProgress) first = r;
    });
    ncclResult_t end = nccl().GroupEnd();
    if (first != ncclSuccess) fail_nccl(first, what);
    check(end, what);
  }

  // ---- waiting ----

  // Host wait for `ev`; the watchdog enforces the deadline and aborts, which
  // ends the wait with its cause.
  void host_wait(Event& ev, const std::string& label) {
    DeviceGuard dg(device);
    RelaxedCaptureMode relaxed;  // (waits on eager work only: captured work refuses host waits)
    Backoff b;
    for (;;) {
      cudaError_t e = cudaEventQuery(ev.e);
      if (e == cudaSuccess) break;
      if (e != cudaErrorNotReady) {
        cudaGetLastError();
        fail(1, label + ": CUDA error: " + cudaGetErrorString(e));
        throw_broken(label);
      }
      if (broken.load()) throw_broken(label);
      b.pause();
    }
    if (broken.load()) throw_broken(label);
  }

  void watch_push(std::shared_ptr<Event> ev, std::string what) {
    {
      std::lock_guard<std::mutex> g(wmu);
      watch.push_back(Watch{std::move(ev), Clock::now() + seconds(cfg.timeout_s), std::move(what)});
    }
    wcv.notify_one();
  }

  // Operations complete in issue order (see [Note: ordering across streams]),
  // so only the oldest one is polled.
  void watchdog_loop() {
    cudaSetDevice(device);
    RelaxedCaptureMode relaxed;  // its event queries are harmless while another thread captures a graph
    std::unique_lock<std::mutex> g(wmu);
    while (!stop) {
      if (watch.empty() || broken.load()) {
        watch.clear();
        wcv.wait_for(g, std::chrono::milliseconds(100));
        continue;
      }
      Watch w = watch.front();
      g.unlock();
      cudaError_t e = cudaEventQuery(w.ev->e);
      bool done = e == cudaSuccess;
      if (e != cudaSuccess && e != cudaErrorNotReady) {
        cudaGetLastError();
        fail(1, w.what + ": CUDA error: " + cudaGetErrorString(e));
      } else if (!done && Clock::now() > w.deadline) {
        std::ostringstream os;
        os << w.what << ": timed out after " << cfg.timeout_s
           << " s: the operation did not finish on the GPU (a rank did not call it, called a different "
              "collective, or is stuck); the NCCL communicator was aborted";
        fail(2, os.str());
      } else if (!done) {
        poll_async_error(w.what);
      }
      g.lock();
      if (done) {
        if (!watch.empty() && watch.front().ev == w.ev) watch.pop_front();
      } else {
        wcv.wait_for(g, std::chrono::milliseconds(1));
      }
    }
  }

  void poll_async_error(const std::string& what) {
    std::unique_lock<std::mutex> lk(mu, std::try_to_lock);
    if (!lk.owns_lock() || !comm || aborted) return;  // a call is in NCCL: it checks for itself
    ncclResult_t st = ncclSuccess;
    if (nccl().CommGetAsyncError(comm, &st) != ncclSuccess || st == ncclSuccess || st == ncclInProgress) return;
    std::string msg = what + ": asynchronous NCCL error: " + nccl().GetErrorString(st);
    const char* detail = nccl().GetLastError(comm);
    if (detail && *detail) msg += std::string(" (") + detail + ")";
    mark_broken(1, msg);
    abort_locked();
  }

  // ---- issuing ----

  // Runs `body(stream)` as operation `what`: on the caller's stream, or for
  // async_op on ours after the caller's; orders it after the previous
  // operation, records its event, hands it to the watchdog.
  template <typename Body>
  WorkPtr run(const char* what, uintptr_t caller, bool async_op, bool is_collective, bool wait_host, Body body) {
    DeviceGuard dg(device);
    std::shared_ptr<Event> ev;
    std::string label;
    bool captured = false;
    {
      std::lock_guard<std::mutex> g(mu);
      if (closed) throw CollectiveError(where(what) + ": the group was destroyed (pz.destroy() was called)");
      auto cs = reinterpret_cast<cudaStream_t>(caller);
      // [Note: nccl calls in a CUDA graph]
      cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
      unsigned long long capture_id = 0;
      PZ_CUDA_CHECK(cudaStreamGetCaptureInfo(cs, &capture, &capture_id));
      if (capture == cudaStreamCaptureStatusInvalidated)
        throw CollectiveError(where(what) + ": the CUDA graph capture on the current stream was invalidated "
                                            "before this call; end it and capture again");
      captured = capture == cudaStreamCaptureStatusActive;
      if (!captured) capture_id = 0;
      if (captured && (wait_host || (!async_op && cfg.blocking_wait)))
        throw CollectiveError(where(what) + ": " + (wait_host ? "a synchronous barrier" : "blocking_wait") +
                              " waits on the host, which a CUDA graph capture cannot do; pass async_op=True and "
                              "wait() its work inside the capture" +
                              (wait_host ? "" : ", or create the group without blocking_wait"));
      if (is_collective) ++seq;
      label = where(what);
      if (broken.load()) throw_broken(label);
      cudaStream_t s = async_op ? stream : cs;
      try {
        if (async_op) {
          PZ_CUDA_CHECK(cudaEventRecord(handoff, cs));
          PZ_CUDA_CHECK(cudaStreamWaitEvent(stream, handoff, 0));
        }
        if (last && last_stream != s && last_capture == capture_id)
          PZ_CUDA_CHECK(cudaStreamWaitEvent(s, last->e, 0));
        body(s);
        ev = events->take();
        PZ_CUDA_CHECK(cudaEventRecord(ev->e, s));
      } catch (const CollectiveError& e) {
        if (broken.load()) throw;
        fail_locked(1, label + ": " + e.what());  // a CUDA failure mid-operation: peers may be stuck
      }
      last = ev;
      last_stream = s;
      last_capture = capture_id;
      // under mu: the watchdog's queue is in issue order (wmu is taken inside mu only)
      if (!captured) watch_push(ev, label);
    }
    if (wait_host || (!async_op && cfg.blocking_wait)) host_wait(*ev, label);
    if (!async_op) return nullptr;
    return std::make_shared<NcclWork>(
        std::make_shared<NcclWork::State>(NcclWork::State{shared(), ev, label, captured}));
  }

  std::weak_ptr<Impl> self;
  std::shared_ptr<Impl> shared() { return self.lock(); }

  uint64_t ring(Coll c, void* out, const void* in, const ChunkLayout& L, int root, DType dt, RedOp op,
                cudaStream_t s, const char* what);

  void close();
};

// ---------------------------------------------------------------------------
// The ring's Exec (see p2p_ring.h): NCCL p2p between neighbours + our kernels

namespace {

struct NcclExec {
  NcclTransport::Impl& t;
  cudaStream_t s;
  DType dt;
  RedOp op;
  const char* what;

  uintptr_t st() const { return reinterpret_cast<uintptr_t>(s); }
  void group(const void* send, size_t send_bytes, void* recv, size_t recv_bytes) {
    if (!send && !recv) return;
    int next = (t.rank + 1) % t.n, prev = (t.rank + t.n - 1) % t.n;
    t.grouped(what, [&](auto report) {
      if (send) report(nccl().Send(send, send_bytes, ncclUint8, next, t.comm, s));
      if (recv) report(nccl().Recv(recv, recv_bytes, ncclUint8, prev, t.comm, s));
    });
  }
  void copy(const void* src, void* dst, int64_t n) { cuda::launch_copy(src, dst, n, dt, st()); }
  void pack(const void* src, void* dst, int64_t n) { cuda::launch_pack_wire(src, dst, n, dt, st()); }
  void reduce(const void* in, const void* own, void* out, int64_t n) {
    cuda::launch_reduce_wire(in, own, out, n, dt, op, st());
  }
  void reduce_final(const void* in, const void* own, void* dst, int64_t n) {
    cuda::launch_reduce_wire_final(in, own, dst, n, dt, op, t.n, st());
  }
};

}  // namespace

uint64_t NcclTransport::Impl::ring(Coll c, void* out, const void* in, const ChunkLayout& L, int root, DType dt,
                                   RedOp op, cudaStream_t s, const char* what) {
  NcclExec x{*this, s, dt, op, what};
  uint64_t sent = 0;
  PZ_DISPATCH_DTYPE(dt, T, {
    sent = p2p_ring_collective<T>(x, c, out, in, L, root, rank, n, send_stage(), recv_stage(), cfg.slice_bytes);
  });
  return sent;
}

void NcclTransport::Impl::close() {
  {
    std::lock_guard<std::mutex> g(mu);
    if (closed) return;
    closed = true;
  }
  std::shared_ptr<Event> l = last;  // no call can change it any more
  if (l && !broken.load() && last_capture == 0) {  // (a captured event cannot be polled)
    try {
      host_wait(*l, "destroy");  // issued work finishes first (the watchdog still times it out)
    } catch (...) {
    }
  }
  {
    std::lock_guard<std::mutex> g(wmu);
    stop = true;
  }
  wcv.notify_all();
  if (watchdog.joinable()) watchdog.join();
  DeviceGuard dg(device);
  {
    std::lock_guard<std::mutex> g(mu);
    if (comm && !aborted) {
      if (broken.load()) {
        abort_locked();
      } else {
        try {
          check(nccl().CommFinalize(comm), "destroy");
        } catch (...) {
        }
        if (!aborted) nccl().CommDestroy(comm);
      }
    }
    comm = nullptr;
    last.reset();
  }
  if (stream) cudaStreamDestroy(stream);
  if (handoff) cudaEventDestroy(handoff);
  if (staging) cudaFree(staging);
  stream = nullptr;
  handoff = nullptr;
  staging = nullptr;
}

// ---------------------------------------------------------------------------
// NcclWork

void NcclWork::wait(uintptr_t stream) {
  auto& t = *s_->impl;
  if (t.broken.load()) t.throw_broken(s_->what);
  DeviceGuard dg(t.device);
  PZ_CUDA_CHECK(cudaStreamWaitEvent(reinterpret_cast<cudaStream_t>(stream), s_->ev->e, 0));
}

// Complete only once the operation's event has completed, also on a broken
// group: the buffers it reads and writes must outlive the kernels (an aborted
// communicator's kernels exit, and then the event completes).
namespace {
void refuse_captured(const NcclWork::State& s, const char* how) {
  if (s.captured)
    throw CollectiveError(s.what + ": " + how + " on the host is not possible for a call captured into a CUDA "
                          "graph; work.wait() inside the capture makes the stream wait for it, and the graph's "
                          "replays are waited for as any stream work (e.g. torch.cuda.synchronize())");
}
}  // namespace

bool NcclWork::captured() const { return s_->captured; }

bool NcclWork::completed() {
  refuse_captured(*s_, "is_completed()");
  auto& t = *s_->impl;
  DeviceGuard dg(t.device);
  RelaxedCaptureMode relaxed;  // (an eager call's work polled while this thread captures a graph)
  cudaError_t e = cudaEventQuery(s_->ev->e);
  if (e == cudaErrorNotReady) return false;
  if (e != cudaSuccess) {
    cudaGetLastError();
    t.fail(1, s_->what + ": CUDA error: " + cudaGetErrorString(e));
  }
  return true;
}

void NcclWork::synchronize() {
  refuse_captured(*s_, "synchronize()");
  s_->impl->host_wait(*s_->ev, s_->what);
}

// ---------------------------------------------------------------------------
// Set-up

std::string NcclTransport::unique_id() {
  ncclUniqueId id;
  ncclResult_t r = nccl().GetUniqueId(&id);
  if (r != ncclSuccess)
    throw CollectiveError(std::string("ncclGetUniqueId: ") + nccl().GetErrorString(r) + " (" +
                          nccl().GetLastError(nullptr) + ")");
  return std::string(id.internal, sizeof(id.internal));
}

NcclTransport::NcclTransport(const std::string& uid, int rank, int size, int device, NcclConfig cfg)
    : impl_(std::make_shared<Impl>()) {
  if (size < 1 || rank < 0 || rank >= size) throw std::invalid_argument("NcclTransport: rank must be in [0, size)");
  if (uid.size() != sizeof(ncclUniqueId))
    throw std::invalid_argument("NcclTransport: unique_id must be " + std::to_string(sizeof(ncclUniqueId)) +
                                " bytes (from nccl_unique_id()), got " + std::to_string(uid.size()));
  if (cfg.slice_bytes < 4096 || cfg.slice_bytes % 256)
    throw std::invalid_argument("NcclTransport: slice_bytes must be a multiple of 256, >= 4096");
  if (!(cfg.timeout_s > 0)) throw std::invalid_argument("NcclTransport: timeout_s must be positive");
  Impl& t = *impl_;
  t.self = impl_;
  t.rank = rank;
  t.n = size;
  t.device = device;
  t.cfg = cfg;
  t.cfg.oneshot_bytes = round_up(cfg.oneshot_bytes, 256);

  DeviceGuard dg(device);
  pz::cuda::preload_kernels();  // (kernels.cu's [Note: kernels loaded before the first call])
  t.oneshot_off = 2 * t.cfg.slice_bytes;
  size_t oneshot_total = size_t(std::min(size, kMaxReduceSources)) * t.cfg.oneshot_bytes;
  t.barrier_off = t.oneshot_off + oneshot_total;
  PZ_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&t.staging), t.barrier_off + 256));
  PZ_CUDA_CHECK(cudaMemset(t.staging + t.barrier_off, 0, 256));
  PZ_CUDA_CHECK(cudaStreamCreateWithFlags(&t.stream, cudaStreamNonBlocking));
  PZ_CUDA_CHECK(cudaEventCreateWithFlags(&t.handoff, cudaEventDisableTiming));

  ncclUniqueId id;
  std::memcpy(id.internal, uid.data(), sizeof(id.internal));
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;
  {
    std::lock_guard<std::mutex> g(t.mu);
    try {
      t.check(nccl().CommInitRankConfig(&t.comm, size, id, rank, &config), "init");
    } catch (...) {
      t.abort_locked();  // a half-made communicator is never finalized
      throw;
    }
  }
  t.watchdog = std::thread([&t] { t.watchdog_loop(); });
}

NcclTransport::~NcclTransport() {
  try {
    impl_->close();
  } catch (...) {
  }
}

int NcclTransport::rank() const { return impl_->rank; }
int NcclTransport::size() const { return impl_->n; }
int NcclTransport::device() const { return impl_->device; }
uintptr_t NcclTransport::stream() const { return reinterpret_cast<uintptr_t>(impl_->stream); }

void NcclTransport::set_timeout(double s) {
  if (!(s > 0)) throw std::invalid_argument("timeout: expected a positive number of seconds");
  std::lock_guard<std::mutex> g(impl_->mu);
  impl_->cfg.timeout_s = s;
}

void NcclTransport::close() { impl_->close(); }

std::map<std::string, OpStats> NcclTransport::stats(bool reset) { return impl_->counters.read(reset); }

// ---------------------------------------------------------------------------
// Collectives. sent_bytes: exact for ring and one-shot; for native, what a
// ring would send (NCCL does not report its traffic).

namespace {

bool all_equal(const std::vector<int64_t>& c) {
  return std::all_of(c.begin(), c.end(), [&](int64_t v) { return v == c[0]; });
}

}  // namespace

NcclTransport::WorkPtr NcclTransport::all_reduce(void* buf, int64_t count, DType dt, RedOp op, Algo algo,
                                                 uintptr_t stream, bool async_op) {
  const char* what = "all_reduce";
  Impl& t = *impl_;
  size_t bytes = size_t(count) * dtype_size(dt);
  algo = nccl_resolve_algo(Coll::all_reduce, bytes, algo, t.cfg.oneshot_bytes, t.n);
  uint64_t sent = 0;
  auto w = t.run(what, stream, async_op, true, false, [&](cudaStream_t s) {
    if (count == 0 || t.n == 1) return;  // one contribution: already the result (avg divides by 1), as NCCL
    if (algo == Algo::native) {
      t.check(nccl().AllReduce(buf, buf, size_t(count), nccl_dtype(dt), nccl_op(op), t.comm, s), what);
      sent = 2 * (bytes - bytes / t.n);
    } else if (algo == Algo::oneshot) {
      char* gathered = t.staging + t.oneshot_off;
      t.check(nccl().AllGather(buf, gathered, size_t(count), nccl_dtype(dt), t.comm, s), what);
      std::vector<const void*> srcs(t.n);
      for (int r = 0; r < t.n; ++r) srcs[r] = gathered + size_t(r) * bytes;
      cuda::launch_reduce_many(srcs.data(), t.n, buf, count, dt, op, t.n, reinterpret_cast<uintptr_t>(s));
      sent = bytes * (t.n - 1);
    } else {
      ChunkLayout L(split_even(count, t.n));
      sent = t.ring(Coll::all_reduce, buf, buf, L, 0, dt, op, s, what);
    }
  });
  t.counters.add(Coll::all_reduce, uint64_t(count), sent);
  return w;
}

NcclTransport::WorkPtr NcclTransport::reduce_scatter(void* out, const void* in, const std::vector<int64_t>& counts,
                                                     DType dt, RedOp op, Algo algo, uintptr_t stream,
                                                     bool async_op) {
  const char* what = "reduce_scatter";
  Impl& t = *impl_;
  if (int(counts.size()) != t.n) throw std::invalid_argument("reduce_scatter: counts must have one entry per rank");
  ChunkLayout L(counts);
  size_t es = size_t(dtype_size(dt));
  algo = nccl_resolve_algo(Coll::reduce_scatter, size_t(L.total()) * es, algo, t.cfg.oneshot_bytes, t.n);
  uint64_t sent = 0;
  auto w = t.run(what, stream, async_op, true, false, [&](cudaStream_t s) {
    if (L.total() == 0) return;
    if (t.n == 1 && op == RedOp::avg) {
      // The average of one contribution is the input: copied. NCCL 2.28.9 at one rank wrote a wrong
      // last element for out-of-place float64 avg of odd counts (seen on an H200, 4099 and 65537).
      if (out != in) PZ_CUDA_CHECK(cudaMemcpyAsync(out, in, size_t(L.total()) * es, cudaMemcpyDeviceToDevice, s));
    } else if (algo == Algo::native) {
      if (all_equal(counts)) {
        t.check(nccl().ReduceScatter(in, out, size_t(counts[0]), nccl_dtype(dt), nccl_op(op), t.comm, s), what);
      } else {
        t.grouped(what, [&](auto report) {
          for (int r = 0; r < t.n; ++r)
            if (counts[r])
              report(nccl().Reduce(static_cast<const char*>(in) + size_t(L.offsets[r]) * es, out, size_t(counts[r]),
                                nccl_dtype(dt), nccl_op(op), r, t.comm, s));
        });
      }
      sent = size_t(L.total() - counts[t.rank]) * es;
    } else if (t.n == 1) {
      if (out != in) PZ_CUDA_CHECK(cudaMemcpyAsync(out, in, size_t(L.total()) * es, cudaMemcpyDeviceToDevice, s));
    } else {
      sent = t.ring(Coll::reduce_scatter, out, in, L, 0, dt, op, s, what);
    }
  });
  t.counters.add(Coll::reduce_scatter, uint64_t(L.total()), sent);
  return w;
}

NcclTransport::WorkPtr NcclTransport::all_gather(void* out, const void* in, const std::vector<int64_t>& counts,
                                                 DType dt, Algo algo, uintptr_t stream, bool async_op) {
  const char* what = "all_gather";
  Impl& t = *impl_;
  if (int(counts.size()) != t.n) throw std::invalid_argument("all_gather: counts must have one entry per rank");
  ChunkLayout L(counts);
  size_t es = size_t(dtype_size(dt));
  algo = nccl_resolve_algo(Coll::all_gather, size_t(L.longest()) * es, algo, t.cfg.oneshot_bytes, t.n);
  char* o = static_cast<char*>(out);
  uint64_t sent = 0;
  auto w = t.run(what, stream, async_op, true, false, [&](cudaStream_t s) {
    if (L.total() == 0) return;
    if (algo == Algo::native) {
      if (all_equal(counts)) {
        t.check(nccl().AllGather(in, out, size_t(counts[0]), nccl_dtype(dt), t.comm, s), what);
      } else {
        t.grouped(what, [&](auto report) {
          for (int r = 0; r < t.n; ++r)
            if (counts[r]) {
              char* dst = o + size_t(L.offsets[r]) * es;
              report(nccl().Broadcast(r == t.rank ? in : dst, dst, size_t(counts[r]), nccl_dtype(dt), r, t.comm, s));
            }
        });
      }
      sent = size_t(counts[t.rank]) * es * (t.n - 1);
    } else if (t.n == 1) {
      if (out != in) PZ_CUDA_CHECK(cudaMemcpyAsync(out, in, size_t(L.total()) * es, cudaMemcpyDeviceToDevice, s));
    } else {
      sent = t.ring(Coll::all_gather, out, in, L, 0, dt, RedOp::sum, s, what);
    }
  });
  t.counters.add(Coll::all_gather, uint64_t(L.total()), sent);
  return w;
}

NcclTransport::WorkPtr NcclTransport::broadcast(void* buf, int64_t count, DType dt, int root, Algo algo,
                                                uintptr_t stream, bool async_op) {
  const char* what = "broadcast";
  Impl& t = *impl_;
  if (root < 0 || root >= t.n) throw std::invalid_argument("broadcast: root must be a rank of the group");
  size_t bytes = size_t(count) * dtype_size(dt);
  algo = nccl_resolve_algo(Coll::broadcast, bytes, algo, t.cfg.oneshot_bytes, t.n);
  uint64_t sent = 0;
  auto w = t.run(what, stream, async_op, true, false, [&](cudaStream_t s) {
    if (count == 0 || t.n == 1) return;
    bool last_in_chain = ring_mod(t.rank - root, t.n) == t.n - 1;
    if (algo == Algo::native) {
      t.check(nccl().Broadcast(buf, buf, size_t(count), nccl_dtype(dt), root, t.comm, s), what);
      sent = last_in_chain ? 0 : bytes;
    } else {
      ChunkLayout L(std::vector<int64_t>{count});
      sent = t.ring(Coll::broadcast, buf, buf, L, root, dt, RedOp::sum, s, what);
    }
  });
  t.counters.add(Coll::broadcast, uint64_t(count), sent);
  return w;
}

NcclTransport::WorkPtr NcclTransport::barrier(uintptr_t stream, bool async_op) {
  const char* what = "barrier";
  Impl& t = *impl_;
  auto w = t.run(what, stream, async_op, true, /*wait_host=*/!async_op, [&](cudaStream_t s) {
    void* word = t.staging + t.barrier_off;
    t.check(nccl().AllReduce(word, word, 1, ncclInt32, ncclSum, t.comm, s), what);
  });
  t.counters.add(Coll::barrier, 0, 0);
  return w;
}

NcclTransport::WorkPtr NcclTransport::send(const void* buf, int64_t count, DType dt, int peer, uintptr_t stream,
                                           bool async_op) {
  const char* what = "send";
  Impl& t = *impl_;
  if (peer < 0 || peer >= t.n || peer == t.rank) throw std::invalid_argument("send: peer must be another rank");
  auto w = t.run(what, stream, async_op, false, false, [&](cudaStream_t s) {
    if (count) t.check(nccl().Send(buf, size_t(count), nccl_dtype(dt), peer, t.comm, s), what);
  });
  t.counters.add(Coll::send, uint64_t(count), uint64_t(count) * dtype_size(dt));
  return w;
}

NcclTransport::WorkPtr NcclTransport::recv(void* buf, int64_t count, DType dt, int peer, uintptr_t stream,
                                           bool async_op) {
  const char* what = "recv";
  Impl& t = *impl_;
  if (peer < 0 || peer >= t.n || peer == t.rank) throw std::invalid_argument("recv: peer must be another rank");
  auto w = t.run(what, stream, async_op, false, false, [&](cudaStream_t s) {
    if (count) t.check(nccl().Recv(buf, size_t(count), nccl_dtype(dt), peer, t.comm, s), what);
  });
  t.counters.add(Coll::recv, uint64_t(count), 0);
  return w;
}

NcclTransport::WorkPtr NcclTransport::batch_p2p(const std::vector<P2P>& ops, uintptr_t stream, bool async_op) {
  const char* what = "batch_isend_irecv";
  Impl& t = *impl_;
  for (const P2P& op : ops) {
    if (op.peer < 0 || op.peer >= t.n || op.peer == t.rank)
      throw std::invalid_argument("batch_isend_irecv: peer must be another rank");
    if (op.count < 0) throw std::invalid_argument("batch_isend_irecv: negative count");
  }
  auto w = t.run(what, stream, async_op, false, false, [&](cudaStream_t s) {
    t.grouped(what, [&](auto report) {
      for (const P2P& op : ops) {
        if (!op.count) continue;
        report(op.is_send ? nccl().Send(op.buf, size_t(op.count), nccl_dtype(op.dt), op.peer, t.comm, s)
                          : nccl().Recv(op.buf, size_t(op.count), nccl_dtype(op.dt), op.peer, t.comm, s));
      }
    });
  });
  for (const P2P& op : ops) {
    if (op.is_send)
      t.counters.add(Coll::send, uint64_t(op.count), uint64_t(op.count) * dtype_size(op.dt));
    else
      t.counters.add(Coll::recv, uint64_t(op.count), 0);
  }
  return w;
}

}  // namespace pz
