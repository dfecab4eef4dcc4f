// shm_transport.cpp — the shm collectives: ring and one-shot over the
// segments of shm_segment.h. See shm_transport.h.
#include "shm_transport.h"

#include <algorithm>
#include <chrono>
#include <cstring>
#include <sstream>
#include <stdexcept>

#include "cpu_reduce.h"
#include "errors.h"
#include "ring.h"

namespace pz {

namespace {

// A copy into the shared area, streamed ([Note: streamed two-shot]) or cached.
void copy_to_area(void* dst, const void* src, size_t n, bool streamed) {
  if (streamed) copy_streamed(dst, src, n);
  else std::memcpy(dst, src, n);
}

// auto's one-shot sizes above this may run the two-shot instead ([Note: adaptive two-shot]).
// Where cores pass freshly written lines slowly, the streamed two-shot ran (2 ranks, fp32,
// in place, medians of 120-160 calls in each of 11 fresh slow pairs; us) 8 KiB in 4-6
// against the one-shot's 7-10 (DeepSpeed 10-15), 16 KiB 5-7 / 11-16, 32 KiB 7-10 / 19-26,
// 64 KiB 10-14 / 33-48, 128 KiB 16-20 / 68-71, 256 KiB 29-37 / 114-137, 512 KiB 52-69 /
// 238-259; at 4 KiB 4-6 / 5-7. In the fast mode the one-shot leads or ties (8 KiB 3-6 /
// 4-6, 16-128 KiB within 1-2 us, 256 KiB 30-35 / 38-42, 512 KiB 31-41 / 70-76).
// (benchmarks/results/allreduce_small_streamed_pairs_cpu2_20261127.txt.) From above 2 KiB,
// so that 4 KiB is measured too, and the two-shot streams from 4 KiB (twoshot_stream_bytes):
// in pairs whose 8 KiB calls took the streamed two-shot, the one-shot's 4 KiB ran slower than
// them (4.4 against 4.2 us in place, 5.5 / 5.2 out of place in collectives_pairs_leap1_cpu2_20261127,
// set 1; 4.6-4.9 against 4.2 in two pairs of a later run).
constexpr size_t kAdaptFromBytes = 2 << 10;
// auto's messages at the ring's sizes go in pieces of an eighth, 1 MiB at least
// ([Note: adaptive two-shot]): with quarters of 2 MiB, a ring piece that found the slow
// mode, or a try of it there, still cost an 8 MiB call 2-3x its median. While the ring
// holds, its pieces run long ([Note: long ring pieces]).
constexpr size_t kAdaptPieces = 8, kAdaptPieceBytes = 1 << 20;
// [Note: long ring pieces]
// A ring piece costs by the rounds it runs more than by its bytes: the ring alone runs a
// message in rounds of depth / 2 slices of every chunk (2 MiB of the message at 2 ranks from
// 2 MiB up, in slices of 256 KiB), and a piece of 1 MiB is a round of its own, so auto ran
// 2-8 MiB in twice the ring's rounds: auto's time / the ring alone's, per call at the median
// (2 ranks, in place, the 6 fast sets of collectives_pairs_fine2_cpu2_20261127), 2 MiB
// 1.09-1.26, 4 MiB 1.10-1.22, 8 MiB 1.02-1.10 (geometric means 1.13, 1.15, 1.06). So rank 0
// marks a ring piece long (kChoiceLong in its word) while the ring is in use, no try is due and
// no jump or leap is under way (AdaptTwoShot::want_long): the piece then covers as many pieces
// as one of the ring's rounds holds, and is the ring alone's round (two pieces at 2 ranks from
// 2 to 8 MiB; from 16 MiB a piece is a round or more). A try of the two-shot, the piece after a jump (the
// second piece of a possible leap) and the ring's pieces while the two-shot is in use stay short, so the
// ring is still left within a piece or two of 1 MiB where it slows (but for a try of the ring
// past its first counted piece, which measures the ring as it runs: [Note: how the ring is tried]
// in shm_adapt.h). After (8 fast sets of
// collectives_pairs_fine3_cpu2_20261128): 4 MiB 0.98-1.05, 8 MiB 0.96-1.11 (1.02, 1.03); 2 MiB
// 0.98-1.16 (1.06), in the three sets above 1.1 after rounds on the two-shot that
// [Note: tries begin with a call] (shm_adapt.h) ended.
// A steady clock's time in ns, as auto's controller takes a call's end ([Note: stale measurement]).
int64_t steady_ns(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(t.time_since_epoch()).count();
}

// Choice of ring vs one-shot, per (collective, per-rank input bytes).
// Measured with `pyzero-bench collectives --algo ring|oneshot` on 2 CPU
// processes (2-core EPYC, benchmarks/results/): one-shot wins below these
// sizes, where its single synchronisation dominates; the ring's 2(n-1)/n
// traffic wins above.
// all_reduce, fp32 in place, medians of rounds alternating the two (us):
//            2 ranks           3 ranks            4 ranks
//   128 KiB  one-shot 25 ring 30   one-shot 117 ring 272   one-shot 222 ring 495
//   256 KiB  one-shot 44 ring 54   one-shot 357 ring 524   one-shot 365 ring 655
// Since the one-shot reads a rank's own part from its input (the figures below,
// same method, 9 rounds at 2 ranks, 5 at 3 and 4; sum / avg at 2 ranks):
//            2 ranks                         3 ranks            4 ranks
//   512 KiB  one-shot 43 / 54 ring 84 / 87   one-shot 166 ring 353   one-shot 266 ring 540
//     1 MiB  one-shot 81 / 108 ring 75 / 85  one-shot 325 ring 448   one-shot 500 ring 647
// so all_reduce takes the one-shot up to the default area (512 KiB), the ring
// from 1 MiB, where it is ahead at 2 ranks.
size_t oneshot_limit(Coll c) {
  switch (c) {
    case Coll::all_reduce: return 512 << 10;
    case Coll::reduce_scatter: return 128 << 10;
    case Coll::all_gather: return 64 << 10;
    case Coll::broadcast: return 64 << 10;
    default: return 0;
  }
}

// Whether a ring call writes this rank's output with streaming stores
// ([Note: streamed output]): out-of-place all_reduce and reduce_scatter whose
// output is at least `min_bytes` (ShmConfig::stream_bytes, 8 MiB by default;
// each rank decides alone). In place the ring stores to lines it has just
// read, so there is no read to save. Measured on 2 CPU processes (2-core EPYC
// VM, 32 MiB L3), fp32, medians of 7-9 rounds alternating the forms in one job,
// three or four jobs; time with cached stores / time streamed (above 1:
// streaming is faster), by output size:
//                   1-2 MiB    4 MiB      8 MiB      16 MiB     32 MiB     64 MiB
//   all_reduce      0.67-1.08  0.80-1.44  1.08-1.36  1.09-1.27  1.17-1.34  1.17-1.28
//   reduce_scatter  0.82-0.98  1.02-1.10  0.99-1.26  1.03-1.21  1.07-1.25
//   all_gather      0.70-0.94             0.98-1.32  1.02-1.08  0.92-1.09  0.97-1.08
// Out-of-place all_reduce / in place went from 0.62-0.73 to 0.78-0.92 at
// 16-64 MiB. Smaller outputs of back-to-back calls stay in the L3, and
// streaming them out costs more than the reads it saves. all_gather is not
// streamed: its gain is within the noise, and a gathered output is usually
// read right away (ZeRO-3 parameters), from the cache where it was stored.
bool stream_output(size_t out_bytes, bool in_place, size_t min_bytes) {
  return !in_place && out_bytes >= min_bytes;
}

}  // namespace

ShmTransport::ShmTransport(std::string prefix, int rank, int size, ShmConfig cfg)
    : seg_(std::move(prefix), rank, size, cfg), rank_(rank), n_(size) {}

Algo ShmTransport::choose_algo(Coll c, size_t bytes) const {
  size_t lim = oneshot_limit(c);
  if (lim > config().oneshot_bytes) lim = config().oneshot_bytes;
  return (n_ > 1 && bytes <= lim) ? Algo::oneshot : Algo::ring;
}

Algo ShmTransport::resolve(Coll c, size_t bytes, Algo algo) const {
  if (algo == Algo::automatic) return choose_algo(c, bytes);
  if (algo == Algo::oneshot && bytes > config().oneshot_bytes)
    throw std::invalid_argument(std::string(coll_name(c)) + ": algo='oneshot' takes at most " +
                                std::to_string(config().oneshot_bytes) + " bytes of input per rank, got " +
                                std::to_string(bytes) + "; use algo='ring' or 'auto'");
  if (algo == Algo::twoshot && c != Coll::all_reduce)
    throw std::invalid_argument(std::string(coll_name(c)) + ": algo='twoshot' is an all_reduce algorithm; use "
                                "'auto', 'ring' or 'oneshot'");
  if (algo == Algo::native)
    throw std::invalid_argument(std::string(coll_name(c)) + ": algo='native' is NCCL's own collective, for the "
                                "nccl backend; the shm backend takes 'auto', 'ring', 'oneshot' or 'twoshot'");
  if (algo != Algo::ring && algo != Algo::oneshot && algo != Algo::twoshot)
    throw std::invalid_argument("algo: expected 'auto', 'ring', 'oneshot' or 'twoshot'");
  return algo;
}

// ---------------------------------------------------------------------------
// Ring primitives over the channel to the successor / from the predecessor.
// Every primitive of one call slices by the same element count (that of the
// widest wire type) so a sender and its receiver always agree on slice sizes.

namespace {

// Slices of every chunk in one ring round: at most half the slot depth per primitive (see
// Round in ring.h).
int slices_per_round(int depth) { return std::max(1, depth / 2); }

template <typename T, RedOp OP>
struct ShmRingPrims {
  using W = WireT<T>;
  ShmSegments& t;
  ShmSegments::Chan out, in;
  int64_t per_slice;
  int nranks;
  int depth;
  bool stream_out;  // the user's output written with streaming stores ([Note: streamed output])
  uint64_t sent_bytes = 0;

  int64_t round_elems() const { return per_slice * slices_per_round(depth); }

  template <typename F> void slices(int64_t cnt, F f) {
    for (int64_t o = 0; o < cnt; o += per_slice) f(o, size_t(std::min(per_slice, cnt - o)));
  }
  void post(size_t bytes) {
    t.send_post(out);
    sent_bytes += bytes;
  }

  void send_rs(const T* own, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      cpu_pack<T, W>(own + o, static_cast<W*>(t.send_acquire(out)), m);
      post(m * sizeof(W));
    });
  }
  void recv_reduce_send(const T* own, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      const W* src = static_cast<const W*>(t.recv_acquire(in));
      cpu_reduce_send<OP, T, W>(src, own + o, static_cast<W*>(t.send_acquire(out)), m);
      t.recv_release(in);
      post(m * sizeof(W));
    });
  }
  void recv_reduce_final(const T* own, T* dst, bool forward, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      const W* src = static_cast<const W*>(t.recv_acquire(in));
      T* fwd = forward ? static_cast<T*>(t.send_acquire(out)) : nullptr;
      if (stream_out) cpu_reduce_final_streamed<OP, T, W>(src, own + o, dst + o, fwd, m, nranks);
      else cpu_reduce_final<OP, T, W>(src, own + o, dst + o, fwd, m, nranks);
      t.recv_release(in);
      if (forward) post(m * sizeof(T));
    });
  }
  void send_ag(const T* src, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      std::memcpy(t.send_acquire(out), src + o, m * sizeof(T));
      post(m * sizeof(T));
    });
  }
  void recv_copy_send(T* dst, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      const void* src = t.recv_acquire(in);
      void* fwd = t.send_acquire(out);
      std::memcpy(fwd, src, m * sizeof(T));
      out_copy(dst + o, src, m * sizeof(T));
      t.recv_release(in);
      post(m * sizeof(T));
    });
  }
  void recv_ag(T* dst, int64_t cnt) {
    slices(cnt, [&](int64_t o, size_t m) {
      out_copy(dst + o, t.recv_acquire(in), m * sizeof(T));
      t.recv_release(in);
    });
  }
  void out_copy(void* dst, const void* src, size_t bytes) {
    if (stream_out) copy_streamed(dst, src, bytes);
    else std::memcpy(dst, src, bytes);
  }
};

// Slice length for a call whose longest chunk has `longest` elements: one
// round of depth/2 slices covers the chunk, so even mid-sized messages are
// pipelined across ranks; at least 8 KiB to amortise the flag handshake, at
// most a slot.
template <typename W>
int64_t slice_elems(const ShmConfig& cfg, int64_t longest) {
  int64_t per_round = slices_per_round(cfg.depth);
  int64_t want = (longest + per_round - 1) / per_round;
  want = (want + 15) / 16 * 16;
  int64_t lo = int64_t(8192 / sizeof(W)), hi = int64_t(cfg.slice_bytes / sizeof(W));
  return std::min(hi, std::max(lo, want));
}

// The elements of every chunk that one round of the ring takes for a message whose longest
// chunk has `longest` elements.
int64_t ring_round_elems(const ShmConfig& cfg, DType dt, int64_t longest) {
  int64_t r = 0;
  PZ_DISPATCH_DTYPE(dt, T, { r = slice_elems<WireT<T>>(cfg, longest) * slices_per_round(cfg.depth); });
  return r;
}

template <typename T, RedOp OP, typename F>
uint64_t with_ring_prims(ShmSegments& s, const char* what, int64_t longest, bool stream_out, F body) {
  using W = WireT<T>;
  int r = s.rank(), n = s.size();
  ShmRingPrims<T, OP> p{s,
                        s.sender((r + 1) % n, /*ring=*/true, what),
                        s.receiver((r + n - 1) % n, /*ring=*/true, what),
                        slice_elems<W>(s.config(), longest),
                        n,
                        s.config().depth,
                        stream_out};
  ShmSegments::Keep keep_out{p.out}, keep_in{p.in};  // even when the body throws
  struct Fence {
    bool on;
    ~Fence() {
      if (on) stream_fence();
    }
  } fence{stream_out};
  body(p);
  return p.sent_bytes;
}

}  // namespace

// ---------------------------------------------------------------------------
// Collectives

void ShmTransport::all_reduce(void* buf, int64_t count, DType dt, RedOp op, Algo algo, const void* in) {
  const char* what = "all_reduce";
  if (in == nullptr) in = buf;
  size_t bytes = size_t(count) * dtype_size(dt);
  const bool automatic = algo == Algo::automatic;
  algo = resolve(Coll::all_reduce, bytes, algo);
  // [Note: adaptive two-shot]: auto above kAdaptFromBytes takes the one-shot or the ring
  // (whichever its size takes) or the two-shot, as rank 0 says in its descriptor, read
  // after the arrival.
  const bool adaptive = automatic && n_ > 1 && config().adaptive &&
                        (algo == Algo::ring || (algo == Algo::oneshot && bytes > kAdaptFromBytes));
  const int cls = adaptive ? AdaptTwoShot::class_of(bytes, in != buf) : -1;
  const bool whole_calls = adaptive && algo == Algo::oneshot;  // (the ring's sizes: measured per piece)
  using clock = std::chrono::steady_clock;
  const bool timed = adaptive && rank_ == 0;
  const clock::time_point t0 = timed ? clock::now() : clock::time_point();
  uint64_t seq = seg_.begin(what);
  // rank 0's word: at the one-shot's sizes whether the two-shot runs, at the ring's its first piece's choice
  const int32_t word = rank_ != 0 || !adaptive ? 0
                       : whole_calls         ? int32_t(adapt_.want_twoshot(cls))
                                             : int32_t(leader_choice(cls));
  CallDesc d{seq, int32_t(Coll::all_reduce), int32_t(op), int32_t(dt), 0, int32_t(adaptive ? Algo::automatic : algo),
             word, count, 0};
  uint64_t sent = 0;
  if (n_ == 1) {
    seg_.arrive(d, what);  // the reduction of one contribution is itself (avg divides by 1)
    if (in != buf && bytes) std::memcpy(buf, in, bytes);
  } else if (algo == Algo::oneshot && adaptive) {
    // The one-shot's copy of the whole input is also the one-piece two-shot's staging, so
    // rank 0's word can pick either after the arrival. The copy is streamed where the
    // two-shot would stream and rank 0 chose it last time in this class (the word is only
    // read after the copy; either way is correct, the mode only sets the speed).
    const bool stream = leader_seen_[cls] && bytes >= config().twoshot_stream_bytes;
    copy_to_area(seg_.area(rank_, seq), in, bytes, stream);
    if (stream) stream_fence();
    seg_.arrive(d, what);
    leader_seen_[cls] = seg_.leader_word(seq) != 0;
    if (leader_seen_[cls]) {
      ChunkLayout L(split_even(count, n_));  // (only here: the one-shot builds no layout)
      algo = Algo::twoshot;
      // in the one-shot's order of sources: bitwise the one-shot whichever runs
      sent = finish_twoshot(buf, in, TwoShotPieces{L, L.longest(), 1, true, stream, true}, dt, op, seq);
    } else {
      sent = oneshot_reduce(buf, in, count, dt, op, seq);
    }
  } else if (algo == Algo::oneshot) {
    std::memcpy(seg_.area(rank_, seq), in, bytes);
    seg_.arrive(d, what);
    sent = oneshot_reduce(buf, in, count, dt, op, seq);
  } else {
    ChunkLayout L(split_even(count, n_));
    if (algo == Algo::twoshot) {
      const TwoShotPieces P = twoshot_pieces(L, dt);
      stage_twoshot(in, P, 0, dt, seq);  // before the arrival, which announces it
      seg_.arrive(d, what);
      sent = finish_twoshot(buf, in, P, dt, op, seq);
    } else if (adaptive) {
      seg_.arrive(d, what);
      sent = adaptive_all_reduce(buf, in, L, dt, op, seq, cls, t0);  // (rank 0 measures each piece)
    } else {
      seg_.arrive(d, what);
      sent = ring_all_reduce_part(buf, in, L, dt, op, 0, INT64_MAX);
    }
  }
  if (timed && whole_calls) {  // whole calls: excluding the arrival would favour the one-shot,
                               // whose waits for a peer still finishing the previous call fall into it
    const clock::time_point now = clock::now();
    adapt_.observe(cls, algo == Algo::twoshot,
                   std::chrono::duration<double, std::nano>(now - t0).count() / double(bytes),
                   steady_ns(now));
  }
  counters_.add(Coll::all_reduce, uint64_t(count), sent);
}

// The one-shot all_reduce after the arrival: every peer's copy in its area, reduced.
uint64_t ShmTransport::oneshot_reduce(void* buf, const void* in, int64_t count, DType dt, RedOp op, uint64_t seq) {
  PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
    // This rank's own contribution is read from `in`, not from its copy in the area:
    // one buffer less in the cache (2 ranks, avg, medians of 9 alternating rounds:
    // 256 KiB 53-61 -> 43-47 us, 512 KiB 98 -> 55 us; the same below 128 KiB).
    std::vector<const T*> srcs(n_);
    for (int r = 0; r < n_; ++r) srcs[r] = reinterpret_cast<const T*>(seg_.area(r, seq));
    srcs[rank_] = static_cast<const T*>(in);
    cpu_reduce_many<OP, T>(srcs.data(), n_, static_cast<T*>(buf), size_t(count), n_);
  }));
  return uint64_t(count) * dtype_size(dt) * uint64_t(n_ - 1);
}

// [Note: two-shot all_reduce] Every rank puts the chunks the others reduce into its
// area (stage_twoshot) and announces it (the arrival, or for auto's choice made after
// the arrival a step of its own); reduces its own chunk from the peers' areas and its
// input into its output and its area; then, once every peer's reduced chunk is in,
// copies them into its output. Each rank reads (n-1)/n of the message from its peers
// twice, as the ring does, without the ring's handoff per slice. A chunk is reduced in
// the ring's order (from the rank after its owner round to the owner), so the results
// are bitwise the ring's. The areas alternate by call: a rank rewrites one only after
// every peer has arrived at the next call, i.e. finished this one.
// A message larger than the area (twoshot_bytes) goes in pieces: piece k holds the
// k-th `per` elements of every chunk (chunk p in slot p of the area), so every element
// keeps the owner, and the order of its sum, that it has in the ring. Each piece after
// the first is staged, and announced, once the previous one is copied out; the pieces
// share the call's area: a rank stages piece k + 1 into its peers' slots after every
// peer has announced its reduced chunk of piece k (so has read those slots), and puts
// its own reduced chunk into its slot after every peer has announced piece k + 1 (so
// has copied piece k out of it).
//
// [Note: streamed two-shot] What a rank writes into its area for its peers (the staged
// chunks, its reduced chunk) goes out with streaming stores from twoshot_stream_bytes
// (4 KiB) on. Where the two cores pass freshly written lines slowly (the slow mode of
// [Note: adaptive two-shot]), reading lines a peer streamed out to memory is far
// cheaper than taking them from its cache; where they pass them fast, streaming costs
// 1.1-2.5x, but there the one-shot or the ring wins and auto takes it. Measured (2
// ranks, fp32, in place, medians of 20 calls, 4 rounds in each of 14-16 fresh pairs; a
// round is slow where the ring took over 300 us per MiB), in us:
//                         512 KiB  1 MiB     2 MiB      4 MiB      32 MiB
//   fast: ring            64-87    51-74     89-116     182-248    3114-7503
//         one-shot        31-41
//         two-shot        31-43    53-71     105-350    288-691    5366-8205
//         streamed        70-85    126-282   260-471    522-710    6116-8406
//         DeepSpeed       79-107   87-156    147-265    386-714    7671-11411
//   slow: ring            414-721  788-1343  1541-2367  3036-3162  24454-29867
//         one-shot        248-323
//         two-shot        246-321  232-592   381-988    863-1682   9248-10588
//         streamed        54-74    86-285    178-198    375-878    4401-6515
//         DeepSpeed       280-369  527-684   967-1274   1544-1915  6643-8500
// (benchmarks/results/allreduce_twoshot_streamed_pairs_cpu2_20261127.txt.)
ShmTransport::TwoShotPieces ShmTransport::pieces_of(const ChunkLayout& L, DType dt, size_t piece_bytes) const {
  const int64_t longest = L.longest();
  const size_t es = dtype_size(dt);
  const size_t bytes = size_t(L.total()) * es;
  const bool streamed = bytes >= config().twoshot_stream_bytes;
  if (bytes <= piece_bytes || longest == 0) return TwoShotPieces{L, longest, 1, true, streamed};
  const int64_t per = std::max<int64_t>(1, int64_t(piece_bytes / (size_t(n_) * es)));
  return TwoShotPieces{L, per, (longest + per - 1) / per, false, streamed};
}

ShmTransport::TwoShotPieces ShmTransport::twoshot_pieces(const ChunkLayout& L, DType dt) const {
  return pieces_of(L, dt, config().twoshot_bytes);
}

// auto's pieces at the ring's sizes: an eighth of the message each, at least kAdaptPieceBytes
// and at most the two-shot's area, so that rank 0 can leave an algorithm that slowed down
// within a call ([Note: adaptive two-shot]).
ShmTransport::TwoShotPieces ShmTransport::adaptive_pieces(const ChunkLayout& L, DType dt) const {
  const size_t bytes = size_t(L.total()) * dtype_size(dt);
  return pieces_of(L, dt, std::min(config().twoshot_bytes, std::max(kAdaptPieceBytes, bytes / kAdaptPieces)));
}

void ShmTransport::stage_twoshot(const void* in, const TwoShotPieces& P, int64_t k, DType dt, uint64_t seq) {
  const size_t es = dtype_size(dt);
  char* mine = seg_.area(rank_, seq);
  for (int p = 0; p < n_; ++p)
    if (p != rank_ && P.count(p, k))
      copy_to_area(mine + size_t(P.slot(p)) * es, static_cast<const char*>(in) + size_t(P.begin(p, k)) * es,
                   size_t(P.count(p, k)) * es, P.streamed);
  if (P.streamed) stream_fence();  // before the step (or arrival) that announces them
}

uint64_t ShmTransport::twoshot_piece(void* buf, const void* in, const TwoShotPieces& P, int64_t k, DType dt,
                                     RedOp op, uint64_t seq) {
  const size_t es = dtype_size(dt);
  char* out = static_cast<char*>(buf);
  const size_t slot = size_t(P.slot(rank_)) * es, off = size_t(P.begin(rank_, k)) * es;
  const int64_t cnt = P.count(rank_, k);
  PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
    std::vector<const T*> srcs(n_);
    for (int i = 0; i < n_; ++i) {  // the ring's order: rank + 1, ..., rank (or 0, ..., n - 1)
      int r = P.one_shot_order ? i : (rank_ + 1 + i) % n_;
      srcs[i] = reinterpret_cast<const T*>(r == rank_ ? static_cast<const char*>(in) + off : seg_.area(r, seq) + slot);
    }
    cpu_reduce_many<OP, T>(srcs.data(), n_, reinterpret_cast<T*>(out + off), size_t(cnt), n_);
  }));
  copy_to_area(seg_.area(rank_, seq) + slot, out + off, size_t(cnt) * es, P.streamed);
  if (P.streamed) stream_fence();
  seg_.exchange_step(ShmSegments::Step::reduced, "all_reduce");
  uint64_t sent = uint64_t(cnt) * es * uint64_t(n_ - 1);  // this rank's reduced chunk, to every peer
  for (int p = 0; p < n_; ++p)
    if (p != rank_ && P.count(p, k)) {
      std::memcpy(out + size_t(P.begin(p, k)) * es, seg_.area(p, seq) + size_t(P.slot(p)) * es,
                  size_t(P.count(p, k)) * es);
      sent += uint64_t(P.count(p, k)) * es;  // (as much as this rank staged for peer p)
    }
  return sent;
}

uint64_t ShmTransport::finish_twoshot(void* buf, const void* in, const TwoShotPieces& P, DType dt, RedOp op,
                                      uint64_t seq) {
  uint64_t sent = 0;
  for (int64_t k = 0; k < P.pieces; ++k) {
    if (k > 0) {
      stage_twoshot(in, P, k, dt, seq);
      seg_.exchange_step(ShmSegments::Step::staged, "all_reduce");
    }
    sent += twoshot_piece(buf, in, P, k, dt, op, seq);
  }
  return sent;
}

uint64_t ShmTransport::ring_all_reduce_part(void* buf, const void* in, const ChunkLayout& L, DType dt, RedOp op,
                                            int64_t begin, int64_t end) {
  uint64_t sent = 0;
  const int64_t longest = std::min(end - begin, L.longest());  // (the part's slices: as for a chunk this long)
  PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
    bool stream = stream_output(size_t(L.total()) * dtype_size(dt), in == buf, config().stream_bytes);
    sent = with_ring_prims<T, OP>(seg_, "all_reduce", longest, stream, [&](ShmRingPrims<T, OP>& p) {
      ring_all_reduce<T>(p, static_cast<const T*>(in), static_cast<T*>(buf), L, rank_, n_, p.round_elems(), begin,
                         end);
    });
  }));
  return sent;
}

// auto at the ring's sizes, after the arrival ([Note: adaptive two-shot]): the message in
// pieces, each run by the ring or the two-shot as rank 0 says (piece 0 in its descriptor, the
// others in its plan word once it has finished the piece before), each piece timed by rank 0.
// Either algorithm reduces every element in the ring's order, and a piece's elements are the
// same for both, so any mix of them is bitwise the ring. The two-shot's pieces stage and
// announce after the arrival; a ring piece in between leaves the area alone, so the rule of
// [Note: two-shot all_reduce] for reusing it holds across it.
uint64_t ShmTransport::adaptive_all_reduce(void* buf, const void* in, const ChunkLayout& L, DType dt, RedOp op,
                                           uint64_t seq, int cls, std::chrono::steady_clock::time_point t0) {
  using clock = std::chrono::steady_clock;
  const TwoShotPieces P = adaptive_pieces(L, dt);
  const size_t es = dtype_size(dt);
  // a long ring piece: as many pieces as one round of the ring alone holds ([Note: long ring pieces])
  const int64_t long_pieces = std::max<int64_t>(1, ring_round_elems(config(), dt, L.longest()) / P.per);
  uint32_t choice = uint32_t(seg_.leader_word(seq));
  bool ran[2] = {false, false}, ran_long = false;
  uint64_t sent = 0;
  clock::time_point t = t0;  // (the first piece's time includes the arrival, as a whole call's did)
  for (int64_t k = 0, next = 0; k < P.pieces; k = next) {
    if (k > 0) choice = seg_.piece_plan(rank_ == 0 ? leader_choice(cls) : 0, "all_reduce");
    const bool twoshot = (choice & kChoiceTwoshot) != 0;
    const bool is_long = !twoshot && (choice & kChoiceLong) != 0;
    next = is_long ? std::min(P.pieces, k + long_pieces) : k + 1;
    ran[twoshot] = true;
    ran_long = ran_long || is_long;
    if (twoshot) {
      stage_twoshot(in, P, k, dt, seq);
      seg_.exchange_step(ShmSegments::Step::staged, "all_reduce");
      sent += twoshot_piece(buf, in, P, k, dt, op, seq);
    } else {
      sent += ring_all_reduce_part(buf, in, L, dt, op, k * P.per, next * P.per);
    }
    if (rank_ == 0) {
      int64_t elems = 0;
      for (int p = 0; p < n_; ++p)
        for (int64_t j = k; j < next; ++j) elems += P.count(p, j);
      const clock::time_point now = clock::now();
      adapt_.observe(cls, twoshot, std::chrono::duration<double, std::nano>(now - t).count() / double(elems * es),
                     steady_ns(now), next >= P.pieces);
      t = now;
      if (is_long) adapt_.ran_long(cls);
    }
  }
  if (rank_ == 0 && ran[0] && ran[1]) adapt_.mixed(cls, ran_long);
  return sent;
}

void ShmTransport::reduce_scatter(void* out, const void* in, const std::vector<int64_t>& counts,
                                  DType dt, RedOp op, Algo algo) {
  const char* what = "reduce_scatter";
  ChunkLayout L(counts);
  size_t bytes = size_t(L.total()) * dtype_size(dt);
  algo = resolve(Coll::reduce_scatter, bytes, algo);
  uint64_t seq = seg_.begin(what);
  CallDesc d{seq, int32_t(Coll::reduce_scatter), int32_t(op), int32_t(dt), 0, int32_t(algo), 0,
             L.total(), hash_counts(counts)};
  uint64_t sent = 0;
  if (n_ == 1 || algo == Algo::oneshot) {
    if (n_ > 1) std::memcpy(seg_.area(rank_, seq), in, bytes);
    seg_.arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
      std::vector<const T*> srcs(n_);
      for (int r = 0; r < n_; ++r)  // this rank's own part from `in`, as in all_reduce
        srcs[r] = (r == rank_ ? static_cast<const T*>(in) : reinterpret_cast<const T*>(seg_.area(r, seq))) +
                  L.offsets[rank_];
      cpu_reduce_many<OP, T>(srcs.data(), n_, static_cast<T*>(out), size_t(counts[rank_]), n_);
    }));
    sent = uint64_t(L.total() - counts[rank_]) * dtype_size(dt);
  } else {
    seg_.arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, PZ_DISPATCH_OP(op, OP, {
      bool stream = stream_output(size_t(counts[rank_]) * dtype_size(dt),
                                  static_cast<const char*>(in) + size_t(L.offsets[rank_]) * dtype_size(dt) == out,
                                  config().stream_bytes);
      sent = with_ring_prims<T, OP>(seg_, what, L.longest(), stream, [&](ShmRingPrims<T, OP>& p) {
        ring_reduce_scatter<T>(p, static_cast<const T*>(in), static_cast<T*>(out), L, rank_, n_,
                               p.round_elems());
      });
    }));
  }
  counters_.add(Coll::reduce_scatter, uint64_t(L.total()), sent);
}

void ShmTransport::all_gather(void* out, const void* in, const std::vector<int64_t>& counts, DType dt,
                              Algo algo) {
  const char* what = "all_gather";
  ChunkLayout L(counts);
  size_t es = dtype_size(dt);
  size_t my_bytes = size_t(counts[rank_]) * es;
  char* own_out = static_cast<char*>(out) + size_t(L.offsets[rank_]) * es;
  // Every rank must choose alike: decide on the largest chunk, which all know.
  algo = resolve(Coll::all_gather, size_t(L.longest()) * es, algo);
  uint64_t seq = seg_.begin(what);
  CallDesc d{seq, int32_t(Coll::all_gather), 0, int32_t(dt), 0, int32_t(algo), 0, L.total(),
             hash_counts(counts)};
  uint64_t sent = 0;
  if (own_out != in && my_bytes) std::memmove(own_out, in, my_bytes);
  if (n_ == 1) {
    seg_.arrive(d, what);
  } else if (algo == Algo::oneshot) {
    std::memcpy(seg_.area(rank_, seq), own_out, my_bytes);
    seg_.arrive(d, what);
    for (int r = 0; r < n_; ++r)
      if (r != rank_ && counts[r])
        std::memcpy(static_cast<char*>(out) + size_t(L.offsets[r]) * es, seg_.area(r, seq), size_t(counts[r]) * es);
    sent = uint64_t(my_bytes) * (n_ - 1);
  } else {
    seg_.arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, {
      sent = with_ring_prims<T, RedOp::sum>(seg_, what, L.longest(), /*stream_out=*/false,
                                            [&](ShmRingPrims<T, RedOp::sum>& p) {
        ring_all_gather<T>(p, static_cast<T*>(out), L, rank_, n_, p.round_elems());
      });
    });
  }
  counters_.add(Coll::all_gather, uint64_t(L.total()), sent);
}

void ShmTransport::broadcast(void* buf, int64_t count, DType dt, int root, Algo algo) {
  const char* what = "broadcast";
  size_t bytes = size_t(count) * dtype_size(dt);
  algo = resolve(Coll::broadcast, bytes, algo);
  uint64_t seq = seg_.begin(what);
  CallDesc d{seq, int32_t(Coll::broadcast), 0, int32_t(dt), root, int32_t(algo), 0, count, 0};
  uint64_t sent = 0;
  if (n_ == 1) {
    seg_.arrive(d, what);
  } else if (algo == Algo::oneshot) {
    if (rank_ == root) std::memcpy(seg_.area(rank_, seq), buf, bytes);
    seg_.arrive(d, what);
    if (rank_ != root) std::memcpy(buf, seg_.area(root, seq), bytes);
    else sent = uint64_t(bytes) * (n_ - 1);
  } else {
    seg_.arrive(d, what);
    PZ_DISPATCH_DTYPE(dt, T, {
      sent = with_ring_prims<T, RedOp::sum>(seg_, what, count, /*stream_out=*/false,
                                            [&](ShmRingPrims<T, RedOp::sum>& p) {
        ring_broadcast<T>(p, static_cast<T*>(buf), count, root, rank_, n_);
      });
    });
  }
  counters_.add(Coll::broadcast, uint64_t(count), sent);
}

void ShmTransport::barrier() {
  uint64_t seq = seg_.begin("barrier");
  CallDesc d{seq, int32_t(Coll::barrier), 0, 0, 0, 0, 0, 0, 0};
  seg_.arrive(d, "barrier");
  counters_.add(Coll::barrier, 0, 0);
}

// [Note: exchange probe]
// Ranks of one host pass freshly written cache lines between cores at very
// different costs: neighbours on one core complex fast, cores across complexes
// or sockets (or a VM's vCPUs placed there) several times slower, and the
// mode a process pair lands in can differ from one pair to the next. Each
// round, every rank writes one word into each line of its one-shot area (the
// lines are then modified in its cache, as a slot is after a ring step),
// arrives, and times reading one word of each line of its predecessor's area.
// The areas alternate by call, so a rank rewrites an area only after every
// peer has arrived at the next call, i.e. finished reading it.
double ShmTransport::probe_exchange(size_t bytes, int reps) {
  bytes = std::min(bytes, config().oneshot_bytes) / 64 * 64;
  if (n_ == 1 || bytes == 0 || reps < 1) return 0.0;
  std::vector<double> per_line;
  for (int i = 0; i < reps; ++i) {
    uint64_t seq = seg_.begin("probe_exchange");
    char* mine = seg_.area(rank_, seq);
    for (size_t o = 0; o < bytes; o += 64) *reinterpret_cast<volatile uint64_t*>(mine + o) = seq + o;
    CallDesc d{seq, int32_t(Coll::barrier), 0, 0, 0, 0, 0, 0, 0};
    seg_.arrive(d, "probe_exchange");
    const char* theirs = seg_.area((rank_ + n_ - 1) % n_, seq);
    auto t0 = std::chrono::steady_clock::now();
    for (size_t o = 0; o < bytes; o += 64) (void)*reinterpret_cast<const volatile uint64_t*>(theirs + o);
    auto t1 = std::chrono::steady_clock::now();
    per_line.push_back(std::chrono::duration<double, std::nano>(t1 - t0).count() / double(bytes / 64));
  }
  std::sort(per_line.begin(), per_line.end());
  return per_line[per_line.size() / 2];
}

// ---------------------------------------------------------------------------
// Point to point: a header slot, then the data in slices, on the channel
// dedicated to this (sender, receiver) pair.

void ShmTransport::send(const void* buf, int64_t cnt, DType dt, int dst) {
  seg_.check_usable("send");
  ShmSegments::Chan c = seg_.sender(dst, /*ring=*/false, "send");
  ShmSegments::Keep keep{c};
  P2PHeader h{cnt, int32_t(dt), 0};
  std::memcpy(seg_.send_acquire(c), &h, sizeof(h));
  seg_.send_post(c);
  const size_t slice = seg_.config().slice_bytes, bytes = size_t(cnt) * dtype_size(dt);
  for (size_t o = 0; o < bytes; o += slice) {
    size_t m = std::min(slice, bytes - o);
    std::memcpy(seg_.send_acquire(c), static_cast<const char*>(buf) + o, m);
    seg_.send_post(c);
  }
  counters_.add(Coll::send, uint64_t(cnt), bytes);
}

void ShmTransport::recv(void* buf, int64_t cnt, DType dt, int src) {
  seg_.check_usable("recv");
  ShmSegments::Chan c = seg_.receiver(src, /*ring=*/false, "recv");
  ShmSegments::Keep keep{c};
  P2PHeader h;
  std::memcpy(&h, seg_.recv_acquire(c), sizeof(h));
  seg_.recv_release(c);
  const size_t slice = seg_.config().slice_bytes, their_bytes = size_t(h.count) * dtype_size(DType(h.dtype));
  bool match = h.count == cnt && h.dtype == int32_t(dt);
  for (size_t o = 0; o < their_bytes; o += slice) {
    size_t m = std::min(slice, their_bytes - o);
    const void* p = seg_.recv_acquire(c);
    if (match) std::memcpy(static_cast<char*>(buf) + o, p, m);
    seg_.recv_release(c);
  }
  if (!match) {
    std::ostringstream os;
    os << "recv (rank " << rank_ << " of " << n_ << "): mismatched send/recv: rank " << src << " sent "
       << h.count << " elements of " << dtype_name(DType(h.dtype)) << ", this rank expected " << cnt
       << " elements of " << dtype_name(dt) << " (the message was discarded)";
    throw MessageMismatch(os.str());
  }
  counters_.add(Coll::recv, uint64_t(cnt), 0);
}

}  // namespace pz
