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
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "errors.h"
#include "shm_transport.h"
#include "work.h"

namespace pz {

class ShmComm {
 public:
  using TaskPtr = std::shared_ptr<Task>;  // null for synchronous calls

  ShmComm(const std::string& prefix, int rank, int size, ShmConfig cfg)
      : t_(std::make_unique<ShmTransport>(prefix, rank, size, cfg)), coll_(std::make_unique<Worker>()) {}

  ShmTransport& transport() { return *t_; }

  // Collectives on the collective worker; buffers already validated by the caller.
  TaskPtr all_reduce(void* buf, int64_t n, DType dt, RedOp op, Algo algo, bool async_op, const void* in = nullptr) {
    return run(async_op, [t = t_.get(), buf, n, dt, op, algo, in] { t->all_reduce(buf, n, dt, op, algo, in); });
  }
  TaskPtr reduce_scatter(void* out, const void* in, std::vector<int64_t> counts, DType dt, RedOp op, Algo algo,
                         bool async_op) {
    return run(async_op, [t = t_.get(), out, in, counts = std::move(counts), dt, op, algo] {
      t->reduce_scatter(out, in, counts, dt, op, algo);
    });
  }
  TaskPtr all_gather(void* out, const void* in, std::vector<int64_t> counts, DType dt, Algo algo, bool async_op) {
    return run(async_op, [t = t_.get(), out, in, counts = std::move(counts), dt, algo] {
      t->all_gather(out, in, counts, dt, algo);
    });
  }
  TaskPtr broadcast(void* buf, int64_t n, DType dt, int root, Algo algo, bool async_op) {
    return run(async_op, [t = t_.get(), buf, n, dt, root, algo] { t->broadcast(buf, n, dt, root, algo); });
  }
  TaskPtr barrier(bool async_op) {
    return run(async_op, [t = t_.get()] { t->barrier(); });
  }
  // Enter a fused symmetric op, synchronously, ordered with the group's other collectives.
  void sym_arrive(int kind, int64_t count, DType dt, std::vector<int64_t> dims) {
    run(false, [t = t_.get(), kind, count, dt, dims = std::move(dims)] { t->sym_arrive(kind, count, dt, dims); });
  }

  // Point to point, on the worker of this peer and direction.
  TaskPtr send(const void* buf, int64_t n, DType dt, int peer, bool async_op) {
    return run_p2p(true, peer, async_op, [t = t_.get(), buf, n, dt, peer] { t->send(buf, n, dt, peer); });
  }
  TaskPtr recv(void* buf, int64_t n, DType dt, int peer, bool async_op) {
    return run_p2p(false, peer, async_op, [t = t_.get(), buf, n, dt, peer] { t->recv(buf, n, dt, peer); });
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
  TaskPtr run(bool async_op, std::function<void()> fn) {
    if (!coll_) throw CollectiveError("shm group: used after close()");
    return dispatch(*coll_, async_op, std::move(fn));
  }

  TaskPtr run_p2p(bool is_send, int peer, bool async_op, std::function<void()> fn) {
    Worker* w;
    {
      std::lock_guard<std::mutex> g(mu_);
      auto& slot = (is_send ? send_w_ : recv_w_)[peer];
      if (!slot) slot = std::make_unique<Worker>();
      w = slot.get();
    }
    return dispatch(*w, async_op, std::move(fn));
  }

  static TaskPtr dispatch(Worker& w, bool async_op, std::function<void()> fn) {
    if (async_op) return w.submit(std::move(fn));
    w.run_sync(std::move(fn));
    return nullptr;
  }

  std::unique_ptr<ShmTransport> t_;  // first: destroyed after the workers using it
  std::unique_ptr<Worker> coll_;
  std::mutex mu_;
  std::map<int, std::unique_ptr<Worker>> send_w_, recv_w_;
};

}  // namespace pz
