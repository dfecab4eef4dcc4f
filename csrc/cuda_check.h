// cuda_check.h — CUDA error checks, a device guard and an event for the sources
// built with CUDA (kernels, NCCL and ipc transports). llm.c's inline-function-plus-macro, but throwing: pybind11
// turns the exception into pyzero.CollectiveError on the rank that hit it.
#pragma once

#include <cuda_runtime.h>

#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <vector>

#include "errors.h"

namespace pz::cuda {

inline void cuda_check_(cudaError_t err, const char* file, int line) {
  if (err != cudaSuccess)
    throw CollectiveError(std::string("CUDA error: ") + cudaGetErrorString(err) + " at " + file + ":" +
                          std::to_string(line));
}

}  // namespace pz::cuda

#define PZ_CUDA_CHECK(err) ::pz::cuda::cuda_check_((err), __FILE__, __LINE__)

namespace pz {

// The calling thread may make "potentially unsafe" CUDA calls (an event query) for a scope, even while
// it, or another thread, captures a CUDA graph in cudaStreamCaptureModeGlobal (torch.cuda.graph's
// default), where such a call would invalidate the capture: querying an event recorded outside the
// capture is harmless to it (torch's CUDAStreamCaptureModeGuard). Events recorded inside a capture
// are never queried (the works refuse host waits first).
struct RelaxedCaptureMode {
  cudaStreamCaptureMode prev = cudaStreamCaptureModeRelaxed;
  RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&prev); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&prev); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;
};

// Loads `kernel` (a __global__ function's address) into the current device's context now rather than at
// its first launch (kernels.cu's [Note: kernels loaded before the first call]).
inline void load_kernel(const void* kernel) {
  cudaFuncAttributes a{};
  PZ_CUDA_CHECK(cudaFuncGetAttributes(&a, kernel));
}

// Runs a function once per CUDA device: the first time it is asked for with that device current
// (one instance per job, e.g. a function's static; thread-safe).
class OncePerDevice {
 public:
  template <typename F>
  void operator()(F fn) {
    int device = 0;
    PZ_CUDA_CHECK(cudaGetDevice(&device));
    std::lock_guard<std::mutex> lock(mu_);
    if (done_.count(device)) return;
    fn();
    done_.insert(device);
  }

 private:
  std::mutex mu_;
  std::set<int> done_;
};

// Makes `device` current for a scope and restores the caller's device after:
// a Python thread that called pyzero keeps the device it had (torch's
// DeviceGuard). A transport's own threads just set it.
struct DeviceGuard {
  int prev = -1, dev;
  explicit DeviceGuard(int d) : dev(d) {
    PZ_CUDA_CHECK(cudaGetDevice(&prev));
    if (prev != dev) PZ_CUDA_CHECK(cudaSetDevice(dev));
  }
  ~DeviceGuard() {
    if (prev >= 0 && prev != dev) cudaSetDevice(prev);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;
};

// A CUDA event (no timing) on the current device, destroyed with its owner.
struct Event {
  cudaEvent_t e = nullptr;
  Event() { PZ_CUDA_CHECK(cudaEventCreateWithFlags(&e, cudaEventDisableTiming)); }
  ~Event() {
    if (e) cudaEventDestroy(e);
  }
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;
};

// Events of one device for reuse: a call's event is taken from here and comes back when its last owner
// (the call's Work, the watchdog's queue, the transport's ordering) lets go, so a call costs a record,
// not a cudaEventCreate and a cudaEventDestroy. Owners hold it through the shared_ptr as before; an
// event is never handed out while any of them still holds it. Take it with the event's device current.
class EventPool : public std::enable_shared_from_this<EventPool> {
 public:
  static std::shared_ptr<EventPool> make() { return std::shared_ptr<EventPool>(new EventPool()); }

  std::shared_ptr<Event> take() {
    std::unique_ptr<Event> e;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (!free_.empty()) {
        e = std::move(free_.back());
        free_.pop_back();
      }
    }
    if (!e) e = std::make_unique<Event>();
    std::weak_ptr<EventPool> pool = weak_from_this();
    return std::shared_ptr<Event>(e.release(), [pool](Event* ev) {
      std::unique_ptr<Event> owned(ev);
      if (auto p = pool.lock()) p->give(std::move(owned));  // else destroyed here
    });
  }

 private:
  EventPool() = default;
  void give(std::unique_ptr<Event> e) {
    std::lock_guard<std::mutex> g(mu_);
    if (free_.size() < kKeep) free_.push_back(std::move(e));  // (beyond that, destroyed on return)
  }
  static constexpr size_t kKeep = 1024;
  std::mutex mu_;
  std::vector<std::unique_ptr<Event>> free_;
};

}  // namespace pz
