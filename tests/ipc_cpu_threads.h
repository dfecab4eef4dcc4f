// ipc_cpu_threads.h — what the CPU-thread checks of the ipc protocols (ipc_protocol_on_cpu.cpp,
// ipc_p2p_on_cpu.cpp) share: the barrier that stands for a kernel boundary, the clock, and the
// threads of a job.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace pz_cpu {

struct Barrier {  // the kernel boundary between a rank's launches
  std::mutex m;
  std::condition_variable cv;
  int n, waiting = 0;
  uint64_t gen = 0;
  explicit Barrier(int n_) : n(n_) {}
  void arrive() {
    std::unique_lock<std::mutex> l(m);
    uint64_t g = gen;
    if (++waiting == n) {
      waiting = 0;
      ++gen;
      cv.notify_all();
    } else {
      cv.wait(l, [&] { return gen != g; });
    }
  }
};

// The executors' claim (ipc_protocol.h [Note: ipc failures]): an atomic max of *word and id; whether
// it was below id.
inline bool claim(uint64_t* word, uint64_t id) {
  uint64_t old = __atomic_load_n(word, __ATOMIC_ACQUIRE);
  while (old < id && !__atomic_compare_exchange_n(word, &old, id, false, __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
  }
  return old < id;
}

inline uint64_t now_ns() {
  return uint64_t(std::chrono::duration_cast<std::chrono::nanoseconds>(
                      std::chrono::steady_clock::now().time_since_epoch()).count());
}

// Runs a job: for each of n ranks its host thread host(r) and its nb block threads block(r, b)
// (a kernel's blocks), all at once; returns when every one has ended.
template <typename H, typename B>
void run_rank_threads(int n, int nb, H&& host, B&& block) {
  std::vector<std::thread> th;
  for (int r = 0; r < n; ++r) {
    th.emplace_back(host, r);
    for (int b = 0; b < nb; ++b) th.emplace_back(block, r, b);
  }
  for (auto& t : th) t.join();
}

}  // namespace pz_cpu
