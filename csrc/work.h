// work.h — in-flight work and the thread that runs it.
//
// A Task is one collective or p2p operation; its Python Work handle keeps the
// tensors alive until waited on (the Python side owns the buffers, C++ borrows
// them). A Worker runs tasks of one queue in submission order on its own
// thread, never touching Python, so the GIL stays free while it communicates.
// A synchronous call on an idle worker runs inline on the caller's thread
// (no thread hand-off on the latency path) but still in queue order.
#pragma once

#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <thread>

namespace pz {

class Task {
 public:
  explicit Task(std::function<void()> fn) : fn_(std::move(fn)) {}
  uint64_t flight_index = 0;  // the call's record in its group's flight ring (flight.h); 0: none
  void run() {
    std::exception_ptr err;
    try { fn_(); } catch (...) { err = std::current_exception(); }
    fn_ = nullptr;  // drop captured state as soon as the work is finished
    std::lock_guard<std::mutex> g(mu_);
    err_ = err;
    done_ = true;
    cv_.notify_all();
  }
  // Blocks until the task ran; rethrows its exception (every waiter sees it).
  void wait() {
    std::unique_lock<std::mutex> g(mu_);
    cv_.wait(g, [&] { return done_; });
    if (err_) std::rethrow_exception(err_);
  }
  bool completed() {
    std::lock_guard<std::mutex> g(mu_);
    return done_;
  }

 private:
  std::function<void()> fn_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool done_ = false;
  std::exception_ptr err_;
};

// [Note: short time slices for workers]
// A worker sleeps on its peers most of the time and has a few microseconds
// of copying to do when woken, on cores busy with the caller's computation.
// Under EEVDF (Linux >= 6.6) a task's requested time slice sets its
// deadline, and a woken task with a shorter slice preempts the running one
// (PREEMPT_SHORT, Linux >= 6.12); with the default slice it may wait for the
// computing thread's slice to run out, once per hand-off, and a bucket's
// ring falls behind backward. So each worker asks for the shortest slice
// (0.1 ms) for itself: no privilege needed, same policy and nice value, and
// on older kernels the request is refused or ignored, which changes nothing.
inline void request_short_slice() {
#if defined(__linux__) && defined(SYS_sched_setattr)
  struct {
    uint32_t size, sched_policy;
    uint64_t sched_flags;
    int32_t sched_nice;
    uint32_t sched_priority;
    uint64_t sched_runtime, sched_deadline, sched_period;
  } attr{};
  attr.size = sizeof(attr);
  attr.sched_policy = 0;  // SCHED_OTHER
  errno = 0;
  int nice = getpriority(PRIO_PROCESS, 0);  // this thread's (0: the caller's tid)
  attr.sched_nice = errno ? 0 : nice;
  attr.sched_runtime = 100000;  // ns: the slice asked for
  syscall(SYS_sched_setattr, 0, &attr, 0);
#endif
}

// True on a Worker's own thread: work there runs beside the caller's
// computation, so waiting should give the CPU away quickly (see wait_for).
inline bool& on_worker_thread() {
  static thread_local bool flag = false;
  return flag;
}

class Worker {
 public:
  Worker() : thread_([this] { loop(); }) {}
  ~Worker() {
    {
      std::lock_guard<std::mutex> g(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  std::shared_ptr<Task> submit(std::function<void()> fn) {
    auto t = std::make_shared<Task>(std::move(fn));
    {
      std::lock_guard<std::mutex> g(mu_);
      queue_.push_back(t);
    }
    cv_.notify_all();
    return t;
  }

  // Runs fn now on this thread if nothing is queued or running, else queues
  // it behind the earlier work and waits. Exceptions propagate either way.
  void run_sync(std::function<void()> fn) {
    {
      std::unique_lock<std::mutex> g(mu_);
      if (!queue_.empty() || busy_) {
        g.unlock();
        submit(std::move(fn))->wait();
        return;
      }
      busy_ = true;
    }
    struct Release {
      Worker* w;
      ~Release() {
        bool queued;
        {
          std::lock_guard<std::mutex> g(w->mu_);
          w->busy_ = false;
          queued = !w->queue_.empty();
        }
        // Only the worker waits on cv_, and only for queued work: waking it
        // after every synchronous call would cost a context switch per call
        // (and, with a rank per core, take the CPU from the peer ranks).
        if (queued) w->cv_.notify_all();
      }
    } release{this};
    fn();
  }

 private:
  void loop() {
    on_worker_thread() = true;
    request_short_slice();
    std::unique_lock<std::mutex> g(mu_);
    for (;;) {
      cv_.wait(g, [&] { return stop_ || (!queue_.empty() && !busy_); });
      if (queue_.empty() && stop_) return;
      auto t = queue_.front();
      queue_.pop_front();
      busy_ = true;
      g.unlock();
      t->run();
      g.lock();
      busy_ = false;
      cv_.notify_all();
    }
  }

  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Task>> queue_;
  bool busy_ = false;
  bool stop_ = false;
  std::thread thread_;  // last: starts after the members it uses exist
};

}  // namespace pz
