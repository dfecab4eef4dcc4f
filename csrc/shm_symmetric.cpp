// shm_symmetric.cpp — symmetric buffers of the shm transport: one extra
// segment per rank that every peer maps, for the fused ops of
// pyzero/symmetric.py. See [Note: symmetric buffers] in shm_transport.h.
#include <sys/mman.h>

#include <algorithm>
#include <string>

#include "shm_transport.h"

namespace pz {

namespace {
std::string sym_name(const std::string& prefix, int r, int gen) {
  return shm_segment_name(prefix, r) + "_s" + std::to_string(gen);
}
}  // namespace

ShmTransport::~ShmTransport() {  // the transport's own segments go with seg_
  sym_release();
  for (auto& [m, bytes] : sym_old_) munmap(m, bytes);
}

// Current generation -> old list (still mapped), own name unlinked.
void ShmTransport::sym_release() {
  sym_unlink();
  for (char* m : sym_maps_)
    if (m) sym_old_.emplace_back(m, kSymHeaderBytes + sym_bytes_);
  sym_maps_.clear();
  sym_bytes_ = 0;
}

void ShmTransport::sym_create(size_t bytes) {
  seg_.check_usable("symmetric buffer");
  sym_release();
  bytes = round_up(std::max<size_t>(bytes, 4096), 4096);
  ++sym_gen_;
  char* p = shm_create_segment(sym_name(seg_.prefix(), rank_, sym_gen_), kSymHeaderBytes + bytes, true);
  sym_unlinked_ = false;
  sym_maps_.assign(n_, nullptr);
  sym_maps_[rank_] = p;
  sym_bytes_ = bytes;
  new (sym_header(rank_)) SymHeader();
}

void ShmTransport::sym_attach() {
  size_t total = kSymHeaderBytes + sym_bytes_;
  for (int r = 0; r < n_; ++r) {
    if (!sym_maps_.at(r))
      sym_maps_[r] =
          shm_map_segment(sym_name(seg_.prefix(), r, sym_gen_), total, r, "ranks asked for different sizes");
  }
}

void ShmTransport::sym_unlink() {
  if (!sym_unlinked_) shm_unlink(sym_name(seg_.prefix(), rank_, sym_gen_).c_str());
  sym_unlinked_ = true;
}

void ShmTransport::sym_arrive(int kind, int64_t count, DType dt, const std::vector<int64_t>& dims) {
  const char* what = "fused op";
  uint64_t seq = seg_.begin(what);
  CallDesc d{seq, int32_t(kSymCollBase + kind), 0, int32_t(dt), 0, 0, 0, count, hash_counts(dims)};
  seg_.arrive(d, what);
}

void ShmTransport::sym_signal(uint64_t value) {
  SymHeader* h = sym_header(rank_);
  h->ready.store(value, std::memory_order_release);
  notify(h->ready, h->ready_waiters);
}

void ShmTransport::sym_wait(int peer, uint64_t value, const char* what) {
  seg_.check_usable(what);
  SymHeader* h = sym_header(peer);
  seg_.wait_for([&] { return h->ready.load(std::memory_order_acquire) >= value; }, peer, what, &h->ready,
                &h->ready_waiters);
}

}  // namespace pz
