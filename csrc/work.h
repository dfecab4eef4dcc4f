// work.h — in-flight work and the thread that runs it.
//
// A Task is one collective or p2p operation; its Python Work handle keeps the
// tensors alive until waited on (the Python side owns the buffers, C++ borrows
// them). A Worker runs tasks of one queue in submission order on its own
// thread, never touching Python, so the GIL stays free while it communicates.
// A synchronous call on an idle worker runs inline on the caller's thread
// (no thread hand-off on the latency path) but still in queue order.
#pragma once

#include <condition_variable>
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
        { std::lock_guard<std::mutex> g(w->mu_); w->busy_ = false; }
        w->cv_.notify_all();
      }
    } release{this};
    fn();
  }

 private:
  void loop() {
    on_worker_thread() = true;
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
