// shm_comm.h — one group on the shm transport as Python drives it: the
// transport plus the threads its operations run on.
//
// Threading: each group has one Worker for collectives (in call order) and
// one per peer and direction for send/recv, so a pipeline stage can post a
// send and a receive at once. Every operation takes `async_op`: true queues
// it on its worker and returns the Task (Python's Work handle keeps the
// buffers alive until waited on); false runs it in queue order on the
// caller's thread and returns null. The caller releases the GIL around
// synchronous calls (bindings.cpp); nothing here touches Python.
//
// With a flight ring set (set_flight), every call is recorded in it as it
// starts and marked done or failed as it ends, on the thread that ends it
// (see flight.h [Note: flight records]).
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "flight.h"
#include "shm_transport.h"
#include "work.h"

namespace pz {

class ShmComm {
 public:
  using TaskPtr = std::shared_ptr<Task>;  // null for synchronous calls

  ShmComm(const std::string& prefix, int rank, int size, ShmConfig cfg)
      : t_(std::make_unique<ShmTransport>(prefix, rank, size, cfg)), coll_(std::make_unique<Worker>()) {}

  ShmTransport& transport() { return *t_; }

  // The ring this group's calls are recorded in (null: none).
  void set_flight(std::shared_ptr<FlightRing> ring) { flight_ = std::move(ring); }

  // Collectives on the collective worker; buffers already validated by the caller.
  TaskPtr all_reduce(void* buf, int64_t n, DType dt, RedOp op, Algo algo, bool async_op, const void* in = nullptr) {
    Rec rec{FlightCall::all_reduce, n, dt, int(op), int(algo), -1};
    return run(rec, async_op, [t = t_.get(), buf, n, dt, op, algo, in] { t->all_reduce(buf, n, dt, op, algo, in); });
  }
  TaskPtr reduce_scatter(void* out, const void* in, std::vector<int64_t> counts, DType dt, RedOp op, Algo algo,
                         bool async_op) {
    Rec rec{FlightCall::reduce_scatter, sum(counts), dt, int(op), int(algo), -1};
    return run(rec, async_op, [t = t_.get(), out, in, counts = std::move(counts), dt, op, algo] {
      t->reduce_scatter(out, in, counts, dt, op, algo);
    });
  }
  TaskPtr all_gather(void* out, const void* in, std::vector<int64_t> counts, DType dt, Algo algo, bool async_op) {
    Rec rec{FlightCall::all_gather, sum(counts), dt, -1, int(algo), -1};
    return run(rec, async_op, [t = t_.get(), out, in, counts = std::move(counts), dt, algo] {
      t->all_gather(out, in, counts, dt, algo);
    });
  }
  TaskPtr broadcast(void* buf, int64_t n, DType dt, int root, Algo algo, bool async_op) {
    Rec rec{FlightCall::broadcast, n, dt, -1, int(algo), root};
    return run(rec, async_op, [t = t_.get(), buf, n, dt, root, algo] { t->broadcast(buf, n, dt, root, algo); });
  }
  TaskPtr barrier(bool async_op) {
    return run(Rec{FlightCall::barrier, 0, DType(0), -1, 0, -1}, async_op, [t = t_.get()] { t->barrier(); });
  }
  // The exchange probe (shm_transport.cpp), synchronously, ordered with the group's other collectives.
  double probe_exchange(size_t bytes, int reps) {
    double ns = 0;
    run(Rec{FlightCall(-1)}, false, [t = t_.get(), bytes, reps, &ns] { ns = t->probe_exchange(bytes, reps); });
    return ns;
  }
  // Enter a fused symmetric op, synchronously, ordered with the group's other collectives.
  void sym_arrive(int kind, int64_t count, DType dt, std::vector<int64_t> dims) {
    run(Rec{FlightCall(-1)}, false,  // recorded by pyzero.symmetric as a fused op
        [t = t_.get(), kind, count, dt, dims = std::move(dims)] { t->sym_arrive(kind, count, dt, dims); });
  }

  // Point to point, on the worker of this peer and direction.
  TaskPtr send(const void* buf, int64_t n, DType dt, int peer, bool async_op) {
    Rec rec{FlightCall::send, n, dt, -1, 0, peer};
    return run_p2p(rec, true, peer, async_op, [t = t_.get(), buf, n, dt, peer] { t->send(buf, n, dt, peer); });
  }
  TaskPtr recv(void* buf, int64_t n, DType dt, int peer, bool async_op) {
    Rec rec{FlightCall::recv, n, dt, -1, 0, peer};
    return run_p2p(rec, false, peer, async_op, [t = t_.get(), buf, n, dt, peer] { t->recv(buf, n, dt, peer); });
  }

  // Joins the worker threads (after their queued work); the segments are
  // freed with the ShmComm. Later collectives raise.
  void close() {
    coll_.reset();
    std::lock_guard<std::mutex> g(mu_);
    send_w_.clear();
    recv_w_.clear();
  }

 private:
  // What the flight ring records of a call (call -1: nothing).
  struct Rec {
    FlightCall call;
    int64_t count = 0;
    DType dt = DType(0);
    int op = -1, algo = 0, root = -1;
  };
  static int64_t sum(const std::vector<int64_t>& counts) {
    int64_t s = 0;
    for (int64_t c : counts) s += c;
    return s;
  }

  TaskPtr run(const Rec& rec, bool async_op, std::function<void()> fn) {
    if (!coll_) throw CollectiveError("shm group: used after close()");
    return dispatch(rec, false, *coll_, async_op, std::move(fn));
  }

  TaskPtr run_p2p(const Rec& rec, bool is_send, int peer, bool async_op, std::function<void()> fn) {
    Worker* w;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& slot = (is_send ? send_w_ : recv_w_)[peer];
      if (!slot) slot = std::make_unique<Worker>();
      w = slot.get();
    }
    return dispatch(rec, true, *w, async_op, std::move(fn));
  }

  TaskPtr dispatch(const Rec& rec, bool p2p, Worker& w, bool async_op, std::function<void()> fn) {
    FlightRing* fr = int(rec.call) >= 0 ? flight_.get() : nullptr;
    if (!fr) {
      if (async_op) return w.submit(std::move(fn));
      w.run_sync(std::move(fn));
      return nullptr;
    }
    uint64_t i = fr->begin(int32_t(rec.call), rec.count, int32_t(rec.dt), rec.op, rec.algo, rec.root, p2p,
                           async_op ? kQueued : kStarted);
    if (async_op) {
      // The task marks its own record: the ring lives as long as the task (shared).
      TaskPtr t = w.submit([fn = std::move(fn), ring = flight_, i] {
        try {
          fn();
        } catch (...) {
          ring->finish(i, kFailed);
          throw;
        }
        ring->finish(i, kDone);
      });
      t->flight_index = i;
      return t;
    }
    try {
      w.run_sync(std::move(fn));
    } catch (...) {
      fr->finish(i, kFailed);
      throw;
    }
    fr->finish(i, kDone);
    return nullptr;
  }

  std::unique_ptr<ShmTransport> t_;  // first: destroyed after the workers using it
  std::unique_ptr<Worker> coll_;
  std::mutex mu_;
  std::map<int, std::unique_ptr<Worker>> send_w_, recv_w_;
  std::shared_ptr<FlightRing> flight_;
};

}  // namespace pz
