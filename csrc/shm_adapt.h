// shm_adapt.h — which all_reduce algorithm `auto` takes above the one-shot's
// sizes, the ring or the two-shot, chosen from measured times ([Note: adaptive two-shot]).
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>

namespace pz {

// [Note: adaptive two-shot]
// On a 2-vCPU VM the same pair of processes moves data between its cores in
// one of two modes, and the mode can change while the pair runs. Measured
// there (2 ranks, fp32, in place, medians of 40 calls, 40 fresh process
// pairs, 3 of them in the slow mode; allreduce_ring_twoshot_auto_pairs_*
// in benchmarks/results), in us:
//                  1 MiB            4 MiB
//   fast: ring     52-135           172-389
//         twoshot  53-112           354-777
//   slow: ring     311-1313         3078
//         twoshot  231-596          1606
// (Since then the two-shot streams what its peers read (now from 4 KiB on),
// which takes it to 86-285 and 375-878 us there, and covers every size, in
// pieces of its area: at 32 MiB the ring ran 24454-29867 us in slow rounds, the
// streamed two-shot 4401-6515; [Note: streamed two-shot] in shm_transport.cpp.
// Ring slices of 64 KiB - 1 MiB and depths 2 - 8 are no faster in the fast
// mode, and in an earlier run of the same comparison collapsed alike in its 2
// slow pairs: 821-907 us at 1 MiB.) Neither wins in
// both modes, and the mode cannot be read off beforehand (an exchange probe at
// group creation did not tell the slow pairs from the others), so rank 0
// measures, per size class (a power of two of bytes) and form (in place or not:
// [Note: a class is a size and a form]), what the algorithm in use takes, and
// tries the other one now and then: after 2 calls, then at intervals
// doubling from 16 to 256 calls while it loses (or sooner once that measure is
// old: [Note: stale measurement]), and at once when the one in use
// runs over 3x or under 0.5x its average 3 calls in a row (a change of mode),
// or twice in a row over 4x its average with the other last measured below 0.9x
// these calls (a leap: the ring in the slow mode ran 5-17x its fast time; after
// a leap's switch the one left is tried again 2 calls later, and wins back if the
// leap was a stall after all, unless the slow mode is the latest news: [Note: the mode
// is the machine's]). One call over 4x is a stall, not a leap: in a fast
// pair a ring piece stalled (4-47x its average) about once in 230 pieces of 1 MiB,
// and leaping at each cost 8 MiB calls 10-20% at the median against the ring alone
// (each stall ran the two-shot, 2.3x the ring there, for 5 pieces; 78 switches in
// 8709 pieces); a stall lasts one piece, a mode a run of them. Or, at least 2 calls
// after the last try, when the median
// of its recent calls runs over 1/0.9 of the other's last measured time (behind:
// a slowdown of under 3x, or one that its average has followed, which neither of
// the others shows; without it, 16 MiB calls ran 11-13 ms for whole rounds of a
// record, 6 of 80, collectives_pairs_smallauto_cpu2_20261127; a diagnostic run
// caught one: the ring had slowed from 4 to 11-13 ms, the two-shot last measured
// at 6 ms; with it, none in the record after). A try is 3 calls (one more the
// first time: an algorithm's first call in a class warms its buffers and is not
// counted; a try of the ring begins with such a call each time: [Note: how the ring
// is tried]), or ends after a counted call over 2x the median of the one in use;
// it switches when their median is under 0.9x the median of the last 16 calls
// of the one in use, or of the calls since the change (medians, since in the
// slow mode a part of the ring's calls still run fast).
// At the ring's sizes a "call" here is a piece: the message goes in pieces of
// an eighth, 1 MiB at least and the two-shot's area at most (kAdaptPieces in
// shm_transport.cpp), and rank 0 chooses each piece's algorithm after the piece
// before, so a call that finds the ring slowed down leaves it for its remaining
// pieces and a try costs a piece, not a call (while the ring holds, its pieces run
// long, a round of the ring alone: [Note: long ring pieces] in shm_transport.cpp;
// a long piece is one "call" here) (2 ranks, in place, per-call p99
// against DeepSpeed's in two fresh pairs: 8 MiB 0.44-0.85x with whole calls,
// 1.63-2.22x in pieces; 32 MiB 1.70-2.04x; collectives_pairs_* in
// benchmarks/results has the record). Rank 0 puts its choice for a call's first
// piece in its descriptor (CallDesc::pad), which every rank reads after the
// arrival, and each later piece's in its plan word (RankCtrl::plan), so all
// ranks run the same algorithm (the two-shot stages its input after the
// arrival, with one more step); and the two-shot reduces each chunk in the
// ring's order, so the results are bitwise the same whichever runs, piece by
// piece. The same holds between the one-shot and the two-shot at the one-shot's
// sizes above 2 KiB (kAdaptFromBytes in shm_transport.cpp), whole calls there:
// the one-shot's copy of the input into the area, made before the arrival, is
// the two-shot's staging, and the two-shot then sums in the one-shot's order of
// ranks.
//
// [Note: tries begin with a call]
// A try due by count or by time (not one at a jump, a leap or behind) waits for the
// call's last piece and begins with the next call. The first call after a pause
// runs its pieces cold, either algorithm: in a full benchmark sweep (2 ranks, the
// other sizes in between), the first out-of-place call of a block ran its 1 MiB
// pieces at 200-600 us where the block's others took 50-60 on the ring and
// 130-170 on the two-shot (its output's pages faulted in). A try due by time is due
// at the first piece after a pause, so it ran on that call's next pieces, its ring
// piece over kGiveUp x the two-shot's median, and lost: in 3 of 8 fast sets of
// collectives_pairs_fine3_cpu2_20261128, after a slow phase of a few rounds, 2 MiB
// stayed on the two-shot for 5-12 rounds (177-340 us a block) where the ring alone
// ran 88-90, which left its median 1.11-1.16x the ring's.
//
// [Note: a try that meets a stall]
// A try of the two-shot judges it by what its calls took, and a lost one sets its level, which decides
// when the ring is next left: behind or at a leap, only once the ring runs slower than that level. In the
// first call of a block (its output's pages faulted in) both run slow: traced per piece (2 ranks, a sweep
// of 16-64 MiB, a fresh set of ranks), 31 of 146 lost tries of the two-shot ran it at 533-913 us per MiB
// against its level of 235-353, all 31 in the first call after a pause, whose ring pieces had leapt (over
// 4x their level) and started the try. After one (64 MiB out of place) the slow mode came: the ring's
// pieces ran 460-1100 us per MiB (its level before, 174) for 9 calls, the two-shot's level stood at 893,
// above most of them, and the block ran the collapsed ring throughout. The same showed in
// collectives_pairs_fine10_cpu2_20261128: a block of 32 MiB out of place at 26.3 ms a call, one of 64 MiB
// at 48.2 ms, the ring's collapsed times, which set those cells' p99 at 1.5x DeepSpeed's. So a lost try of
// the two-shot whose median ran over kGiveUp x its own level met a stall, not the two-shot: both levels
// and the schedule stay, and the rest of its call is not measured (its pieces run as slow); the next try
// is judged as usual (`doubted`), so a two-shot that has truly slowed costs one such try more, and a pause
// of the class clears that (its first call runs cold again). After (collectives_pairs_fine11 and
// fine12_cpu2_20261128, 6 fresh sets each): 287 and 273 tries met a stall; p99 at or below DeepSpeed's in
// 288 and 286 of the 288 cells, the two below at 1 MiB (whole calls there), none from 2 MiB up.
//
// [Note: how the ring is tried]
// A try of the ring (the two-shot in use) measures the ring as it would run: its first piece warms it
// and is neither counted nor given up on, its first counted piece is short (1 MiB, so that the ring
// still collapsed costs one short piece before the try gives up), and its later pieces are long, as
// the ring's pieces run while it holds ([Note: long ring pieces] in shm_transport.cpp). Traced per
// piece (2 ranks, 2-8 MiB calls in pieces of 1 MiB, 4 fresh sets of a full benchmark sweep, us per
// MiB at the median): a try's first ring piece after the two-shot's ran 131-150 in place and 206-228
// out of place in either mode, its second 55-156 where the ring had come
// back and 851-1076 where it was still collapsed; in use, the ring's long pieces ran 46-63 in place
// and 52-105 out of place, its short ones 69-91 and 92-143, the two-shot's 101-133 and 140-141.
// Judged on its first short pieces, the ring came back under 0.9x the two-shot's median in few
// tries: in 3 of 6 sets of collectives_pairs_fine4_cpu2_20261128, 4 MiB stayed on the two-shot for up
// to 3 rounds after the ring had come back (510-660 us a call where the ring alone ran 170-280).
// At the one-shot's sizes (whole calls) a try of the one-shot begins the same way, with a call it
// does not count (not traced there; in the same record 512 KiB - 1 MiB stayed on the two-shot for a
// round after slow phases, 95-146 us a call where the one-shot and the ring alone ran 31-56).
// After (6 fresh sets with slow phases in all, collectives_pairs_fine5_cpu2_20261128): rounds where
// auto ran over 1.5x the ring alone while that ran fast, 1-16 MiB in place, 17 against 41; at 4 MiB
// auto / the ring alone 0.99-1.11 (geometric mean 1.03, against 1.22). A try in a slow phase now costs
// a collapsed piece (at 1 MiB a call: 789 us, DeepSpeed's calls there 544-589).
// Where a call is a piece (1 MiB), the warm-up is a whole call and often runs collapsed itself: traced
// per piece (2 ranks, 128 KiB - 4 MiB, 6 fresh sets of 150 rounds of the benchmark's blocks; a try's
// first ring piece against the two-shot's level), of 117 tries at 1 MiB whose counted piece ran over 2x
// the two-shot, the warm-up ran over 4x (kLeap) in 77; of the 467 whose counted piece ran under, in 10
// (2 MiB, pieces of 1 MiB: 121 of 215 and 1 of 1051; 4 MiB 77 of 349 and 15 of 1115; the one-shot's sizes
// 2 of 278 and 5 of 1475). So a warm-up over kLeap x the two-shot's latest calls ends the try there, given
// up on, and the try costs one collapsed call instead of two (test_auto_controller_keeps_the_faster_and_
// follows_a_mode_change).
//
// [Note: the mode is the machine's]
// The classes of one group share what their tries of the ring or the one-shot (the two-shot in use)
// find. A class whose own try comes due puts it off (as if it had tried and lost) when a smaller
// class has given up such a try since its own last one (a call over kGiveUp x the two-shot: the slow
// mode, not a close loss), up to kPutOff times in a row; and it tries at its next call once any class
// has won such a try since its own (at least 2 calls after it). The slow mode is a phase of the
// machine: rounds where the ring alone ran over 2.5x its median at 1 MiB were rounds where the one-shot
// alone did at 64 or 128 KiB in 82 of 88 (collectives_pairs_fine4_cpu2_20261128) and 62 of 77
// (collectives_pairs_fine5_cpu2_20261128); the one-shot slow with the ring fast in 0 and 4. So the
// smaller classes pay for what all learn: a try of the one-shot at 64 KiB that meets the slow mode
// costs a call of 35-52 us (the one-shot alone's slow rounds in the second record), one of the ring at
// 1 MiB a collapsed call (789 us out of place, above DeepSpeed's p99 there, 749-788, in 2 sets of that
// record, whose p99 at 1 MiB was such a call); and once one class finds the mode gone, the others
// leave the two-shot at once instead of at their own next due try (a round of a benchmark later).
// Smaller, so that the cheapest class called keeps its own schedule and finds the mode for the
// others (deferring to any class's loss, the last to lose was the one left trying: in a simulated
// sweep, the 1 MiB class); kPutOff, so that a class whose two-shot wins by over 2x for its own reasons
// cannot hold a larger one on the two-shot. Simulated (a sweep of 16-128 KiB and 1 MiB, 10 slow rounds
// in 30; test_auto_controller_classes_share_the_machines_mode), 1 MiB ran the collapsed ring in 4 calls
// of the last 9 slow rounds against 12 alone, and was back in the round the mode ended, 2 rounds sooner.
// Recorded (collectives_pairs_fine6_cpu2_20261128, 6 fresh sets, 1090 slow rounds from 16 KiB up): p99
// at or below DeepSpeed's in all 288 cells, 1 MiB out of place 1.11x at the lowest; 1-7 tries put off
// per class and set.
// A leap is news too. In the trace of [Note: how the ring is tried], the timed 1 MiB calls (each block's
// 20, after 6 untimed) that ran the collapsed ring, 167 in all (138 slow rounds of the ring alone at 1 MiB),
// were tries of the ring but for 13, and of the 83 tries whose first piece ran collapsed, 58 came 2 calls
// after a leap to the two-shot: the retry of a leap (which, the ring's level held at its fast one through
// the leap, the two-shot's calls also started as "behind"). Such a retry is for a stall that looked like
// a leap; in a slow phase the first class to leap pays it, then every other one again. So a class's leap
// whose try of the two-shot wins is the slow mode (slow_ns_), as is a given-up try of the ring or the
// one-shot; the ring's level becomes that of its leaping calls; and where the slow mode was the latest any
// class found (no try of the ring or the one-shot won since), the ring is next tried on the schedule (16
// calls, 25 ms), not 2 calls later (test_auto_controller_keeps_a_leap_to_the_two_shot_in_the_slow_mode).
// With this and a warm-up given up on where it ran collapsed, the same trace after: 115 such calls in 177
// slow rounds (0.65 a slow round against 1.21), 6 of the 18 tries that met the collapse a leap's retry.
//
// [Note: a class is a size and a form]
// In place and out of place the algorithms run at different speeds, and the two-shot runs faster in the
// slow mode than after it. Traced per piece (2 ranks, 3 fresh sets of a full benchmark sweep; us per MiB
// at the median, 1 / 2 / 4 / 8 MiB): the two-shot in use (in and after slow phases) 88 / 92 / 90 / 100 in
// place, 96 / 103 / 105 / 121 out of place; its tries while the ring held 149 / - / 148 / 154 and
// 162 / 171 / 239 / 223; the ring's long pieces in use 51 / 47 / 51 / 61 and 54 / 54 / 74 / 102, its
// first pieces after the two-shot's out of place at 4 MiB 92-160. Of 183 tries of the ring (the two-shot
// in use) that did not find it collapsed, 15 lost, all out of place, each judged against the median of
// its class's last 16 calls, most of them in place or of the slow mode (4 MiB: the ring's counted pieces
// 143 / 143 / 92 against 103, where the out-of-place two-shot ran 145-186 in the calls after the try),
// and each left its size on the two-shot for a round of the benchmark or less (4 MiB out of place:
// 1.07x the ring alone over its fast rounds, collectives_pairs_fine7_cpu2_20261128). So a class is a
// size class and a form (AdaptTwoShot::class_of), each with its own measures; a try is judged against
// the one in use as it ran just before it (the median of its last kTry calls, as many as the try's own;
// AdaptTwoShot::latest), not of its last 16; and a try by time or at another class's win waits until
// more than kTry calls have run since the class's last pause (a gap over kEveryNs; the first of them
// runs cold: [Note: tries begin with a call]), so that the calls it is judged against ran in the mode
// it meets. A class called once after each pause (a bucket's size, once a step) tries as before.
// Simulated (test_auto_controller_judges_a_try_by_its_own_form_and_time): out of place, the ring in 13
// of the 26 calls of the first round after the slow mode, and in none with one class for both forms.
//
// [Note: stale measurement]
// The other algorithm is also tried once it was last measured over 25 ms ago and
// a quarter of the calls' interval has passed since (2 to 64 calls), an interval
// in time that doubles while its tries lose, up to 100 times its last measured call
// (the largest of the class): a lost try, which ends after one call over 2x the
// one in use, then costs about 1% of the time at most (the ring collapsed at 1 MiB:
// 0.8 ms a call, a try every 80 ms). Simulated (tests/test_collectives.py), a class
// called once every 100 ms is back on the ring 30-45 calls after a collapse ends,
// where counting calls alone left it on the two-shot for over 200.
// The exchange mode is a phase of the machine, not of the calls, and comes and
// goes in time: a fixed ring's blocks of 100 calls ran 2.5x their median or more
// in 894 rounds of 24 fresh sets of ranks, from 16 KiB up, between calm rounds of
// the same set (collectives_pairs_* in benchmarks/results). Counting calls alone,
// a class called once per step (a gradient bucket's size) notices that the ring is
// back only after up to 256 steps, and a class whose calls come between other
// sizes' (the rounds of a benchmark, the buckets of a step) keeps the verdict of a
// phase gone since: in one recorded set, 2 MiB ran the two-shot in pieces (178-313
// us a call) for three rounds where the ring alone took 88-114 us, after 1 MiB
// calls (the class of its pieces) had found the ring collapsed.
// A class called in bursts after pauses (a benchmark's blocks of one size) may also try by time once in a
// burst, once its first calls have run (after kTry, as above), however few calls it has run since its last
// try: counting them alone (a quarter of the count's interval, up to 64 calls), after a slow mode of 4-6
// bursts the ring came back 1-3 bursts late in 9 of 12 cases of bursts of 22-30 calls, by where the bursts'
// tries fell (test_auto_controller_tries_once_in_a_burst_after_a_pause); now within the first calm burst
// in all. A class called once a step (one call a pause) tries by the count as before.
class AdaptTwoShot {
 public:
  // a class: a size class (floor(log2(bytes - 1)) - kClassFrom) and a form, in place or out of place
  // ([Note: a class is a size and a form])
  static constexpr int kSizes = 32, kClasses = 2 * kSizes;
  static constexpr int kClassFrom = 11;  // size class 0: up to 4 KiB
  static constexpr uint32_t kFirst = 2, kEvery = 16, kMaxEvery = 256;
  static constexpr double kSpike = 3.0, kDrop = 0.5, kBetter = 0.9, kAlpha = 0.25, kGiveUp = 2.0, kLeap = 4.0;
  static constexpr int kSpikeCalls = 3, kLeapCalls = 2, kTry = 3, kRecent = 16;
  static constexpr int64_t kEveryNs = 25'000'000;  // [Note: stale measurement]
  static constexpr double kTryShare = 0.01;
  static constexpr int kPutOff = 4;  // [Note: the mode is the machine's]

  static int size_class(size_t bytes) {
    int c = (bytes > 1 ? 63 - __builtin_clzll(uint64_t(bytes - 1)) : 0) - kClassFrom;
    return c < 0 ? 0 : (c >= kSizes ? kSizes - 1 : c);
  }
  // The class of a message of `bytes`, in place or not; and a class's size class and form.
  static int class_of(size_t bytes, bool out_of_place) { return size_class(bytes) + (out_of_place ? kSizes : 0); }
  static int size_of(int c) { return c % kSizes; }
  static bool out_of_place(int c) { return c >= kSizes; }
  // The largest message of class c.
  static size_t largest_bytes(int c) { return size_t(1) << (size_of(c) + kClassFrom + 1); }

  // Whether rank 0 wants the two-shot for the next call (or piece) of class c.
  bool want_twoshot(int c) const {
    const State& s = st_[c];
    return s.trying > 0 ? !s.twoshot : s.twoshot;
  }

  // Whether rank 0 runs the next ring piece of class c long (a whole round of the ring alone):
  // on the ring, with no try due and no jump or leap under way ([Note: long ring pieces] in
  // shm_transport.cpp), or in a try of the ring past its first counted piece.
  bool want_long(int c) const {
    const State& s = st_[c];
    // [Note: how the ring is tried]
    if (s.twoshot) return s.trying > 0 && !s.warmup && s.ntried > 0;
    return s.trying == 0 && s.spikes == 0 && s.leaps == 0;
  }

  // A call (or piece) of class c ran the two-shot (or the ring) at `ns_per_byte`, ending at
  // `now_ns` (a steady clock's nanoseconds); `call_end`: the call's last piece (or the call).
  void observe(int c, bool twoshot, double ns_per_byte, int64_t now_ns, bool call_end = true) {
    State& s = st_[c];
    // calls since this class's last pause (a gap over kEveryNs), and whether the calls before it were one
    // at most (a class called once a step): [Note: a class is a size and a form]
    if (s.last_ns > 0 && now_ns - s.last_ns > kEveryNs) {
      s.sparse = s.run <= 1;
      s.run = 0;
      s.paused = true;
      s.doubted = false;  // ([Note: a try that meets a stall])
    }
    s.last_ns = now_ns;
    s.run += call_end;
    bool warm = s.seen[twoshot];
    s.seen[twoshot] = true;
    if (twoshot != s.twoshot) {
      if (s.trying == 0) return;
      // a try whose call runs over kGiveUp x the one in use ends there: its other calls would cost as much
      // (the ring tried in the slow mode: 5x the two-shot). A try of the ring's first piece warms it and is
      // not counted, but for a piece over kLeap x, the ring still collapsed ([Note: how the ring is tried])
      const bool warming = s.warmup;
      s.warmup = false;
      const bool give_up = warm && s.nrecent > 0 && ns_per_byte > (warming ? kLeap : kGiveUp) * latest(s);
      if (warming && !give_up) {
        s.warmed = ns_per_byte;
        return;
      }
      if (warm && s.ntried < kTry) s.tried[s.ntried++] = ns_per_byte;
      if (give_up) {
        s.trying = 1;
        s.gave_up = true;
      }
      if (--s.trying > 0) return;
      ++s.explored;
      s.tried_ns = now_ns;
      s.since = 0;
      s.spikes = 0;
      const bool leapt = s.leapt;
      s.leapt = false;
      double t = median(s.tried, s.ntried);
      s.ntried = 0;
      const bool won = t < kBetter * latest(s);  // ([Note: a class is a size and a form])
      if (!twoshot && won) back_ns_ = now_ns;  // [Note: the mode is the machine's]
      if (!twoshot && s.gave_up) s.lost_ns = slow_ns_ = now_ns;
      // a lost try of the two-shot that ran over kGiveUp x its own level met a stall of the machine, not
      // the two-shot: both levels and the schedule stay, once ([Note: a try that meets a stall])
      const bool stalled = twoshot && !won && !s.doubted && s.level[1] > 0.0 && t > kGiveUp * s.level[1];
      if (twoshot) s.doubted = stalled;
      if (stalled) {
        ++s.stalled_tries;
        s.skip = !call_end;  // (and the rest of its call)
      } else if (won) {
        s.twoshot = twoshot;
        s.level[twoshot] = t;
        // after a leap, the one left is tried again soon: a stall of two calls in a row
        // looks like a leap too, and then the one left wins that try back; but not after a leap of the ring
        // while the slow mode is the latest any class found ([Note: the mode is the machine's])
        const bool known_slow = twoshot && slow_ns_ > back_ns_;
        if (twoshot && leapt) {
          s.level[0] = median(s.recent, s.nrecent);  // the ring as it leapt (the try's measure)
          slow_ns_ = now_ns;
        }
        s.nrecent = 0;
        s.every = leapt && !known_slow ? kFirst : kEvery;
        s.every_ns = kEveryNs;
        ++s.switches;
      } else {
        if (t > 0.0) s.level[twoshot] = t;
        s.level[s.twoshot] = median(s.recent, s.nrecent);  // the one in use, as it runs now
        s.every = s.every < kEvery ? kEvery : (s.every * 2 > kMaxEvery ? kMaxEvery : s.every * 2);
        // while the tries lose, twice as long, up to where a lost try (about one of its calls, and
        // a try of the ring its warm-up piece too) costs kTryShare of the time
        const double loss_ns = (s.level[twoshot] + s.warmed) * double(largest_bytes(c));
        s.every_ns = std::min(2 * s.every_ns, std::max(kEveryNs, int64_t(loss_ns / kTryShare)));
      }
      return;
    }
    if (!warm) return;
    if (s.skip) {  // the rest of a call whose try met a stall ([Note: a try that meets a stall])
      s.skip = !call_end;
      return;
    }
    double& lvl = s.level[twoshot];
    bool jump = lvl > 0.0 && (ns_per_byte > kSpike * lvl || ns_per_byte < kDrop * lvl);
    s.spikes = jump ? s.spikes + 1 : 0;
    // a leap: kLeapCalls in a row over kLeap x its average, with the other one last measured well
    // below them (a change of mode; one such call is a stall): try the other at once, judged
    // against these calls alone
    const double other = s.level[!twoshot];
    s.leaps = lvl > 0.0 && ns_per_byte > kLeap * lvl && other > 0.0 && other < kBetter * ns_per_byte ? s.leaps + 1 : 0;
    const bool leap = s.leaps >= kLeapCalls;
    if (!jump) lvl = lvl > 0.0 ? lvl + kAlpha * (ns_per_byte - lvl) : ns_per_byte;  // (held during a jump)
    if (s.nrecent == kRecent) std::copy(s.recent + 1, s.recent + kRecent, s.recent);
    s.recent[s.nrecent < kRecent ? s.nrecent++ : kRecent - 1] = ns_per_byte;
    // behind: the one in use now runs slower than the other was last measured (a slowdown of
    // under kSpike x, or one its average has followed, which neither a jump nor a leap shows)
    const bool behind = other > 0.0 && ns_per_byte * kBetter > other && s.nrecent >= kTry &&
                        median(s.recent, s.nrecent) * kBetter > other;
    // stale: the other was last measured over every_ns ago, and a quarter of the calls' interval
    // has passed ([Note: stale measurement])
    const bool stale = s.tried_ns > 0 && now_ns - s.tried_ns >= s.every_ns;
    if (s.trying > 0) return;
    ++s.since;
    // a try that is due by count or by time begins with a call ([Note: tries begin with a call])
    // a try by time or at another class's win waits until the calls it is judged against (the last kTry)
    // ran after the class's last pause ([Note: a class is a size and a form])
    const bool settled = s.run > kTry || s.sparse;
    // (and a burst of calls after a pause may try once by time, however few calls its bursts hold)
    const bool quarter = s.since >= std::max(kFirst, s.every / 4) || (s.paused && !s.sparse && s.since >= kFirst);
    bool due = s.since >= s.every || (stale && settled && quarter);
    // what the other classes' tries found since this one's ([Note: the mode is the machine's])
    if (twoshot && call_end && (due || back_ns_ > s.tried_ns)) {  // (else neither case below can hold)
      const int64_t lost = smaller_lost_ns(c);
      if (back_ns_ > s.tried_ns && back_ns_ > lost && s.since >= kFirst && settled) {
        due = true;
      } else if (due && lost > s.tried_ns && lost > back_ns_ && s.put_off < kPutOff) {
        due = false;  // put off as if tried and lost
        s.since = 0;
        s.tried_ns = now_ns;
        ++s.put_off;
        ++s.tries_put_off;
      }
    }
    if ((due && call_end) || s.spikes >= kSpikeCalls || leap || (behind && s.since >= kFirst)) {
      if (s.spikes >= kSpikeCalls || leap) {  // judged against the calls since the change only (a leap is a jump)
        std::copy(s.recent + s.nrecent - s.spikes, s.recent + s.nrecent, s.recent);
        s.nrecent = s.spikes;
      }
      s.trying = kTry + (s.seen[!twoshot] ? 0 : 1);
      s.paused = false;
      s.warmup = twoshot;  // the ring tried ([Note: how the ring is tried])
      s.warmed = 0.0;
      s.gave_up = false;
      s.put_off = 0;
      s.leapt = leap;
      s.leaps = 0;
    }
  }

  struct State {
    bool twoshot = false;
    bool seen[2] = {false, false};
    double level[2] = {0.0, 0.0};  // average ns per byte: ring, two-shot (0: not measured)
    double recent[kRecent] = {};   // the last calls of the one in use (ns per byte), oldest first
    int nrecent = 0;
    double tried[kTry] = {};       // the calls of the one being tried
    int ntried = 0, trying = 0;    // and how many of them are still to run
    uint32_t since = 0, every = kFirst;
    int64_t tried_ns = 0;          // when the last try ended (0: none yet)
    int64_t every_ns = kEveryNs;   // and how long after it the next one is due at the latest
    int64_t lost_ns = 0;           // when a try of the ring or the one-shot last gave up here
    bool gave_up = false;          // the try under way gave up (a call over kGiveUp x the one in use)
    int put_off = 0;               // tries put off in a row ([Note: the mode is the machine's])
    int spikes = 0;
    int leaps = 0;       // calls in a row over kLeap x the level (see observe)
    bool leapt = false;  // the try under way began at a leap
    int64_t last_ns = 0;  // when this class's last call (or piece) ended
    uint32_t run = 0;     // calls since its last pause
    bool sparse = false;  // and the calls before that pause were one at most
    bool paused = false;  // a pause since the last try began
    bool doubted = false;         // the last try of the two-shot met a stall ([Note: a try that meets a stall])
    bool skip = false;            // and the rest of its call is not measured
    uint64_t stalled_tries = 0;   // such tries, in all
    bool warmup = false;  // the try of the ring under way has yet to run its first piece
    double warmed = 0.0;  // and that piece's ns per byte (0: none)
    uint64_t switches = 0, explored = 0;
    uint64_t tries_put_off = 0;  // for a smaller class's given-up try, in all
    uint64_t mixed = 0;        // calls whose pieces ran both algorithms
    uint64_t mixed_long = 0;   // and of them, those with a long ring piece
    uint64_t long_pieces = 0;  // long ring pieces run (shm_transport.cpp)
  };
  const State& state(int c) const { return st_[c]; }
  // A call of class c ran both algorithms in its pieces (`with_long`: a long ring piece among them).
  void mixed(int c, bool with_long) {
    ++st_[c].mixed;
    st_[c].mixed_long += with_long;
  }
  void ran_long(int c) { ++st_[c].long_pieces; }

 private:
  static double median(const double* v, int n) {  // of the first n; 0 for none
    if (n == 0) return 0.0;
    std::array<double, kRecent> w{};
    std::copy(v, v + n, w.begin());
    std::sort(w.begin(), w.begin() + n);
    return n % 2 ? w[n / 2] : 0.5 * (w[n / 2 - 1] + w[n / 2]);
  }
  // the one in use as it ran just before the try under way: the median of its last kTry calls
  static double latest(const State& s) {
    const int n = std::min(s.nrecent, kTry);
    return median(s.recent + s.nrecent - n, n);
  }
  std::array<State, kClasses> st_{};
  // when a try of the ring or the one-shot (the two-shot in use) last won, in any class
  int64_t back_ns_ = 0;
  // and when a class last found the slow mode: such a try given up, or the two-shot's won at a leap of the ring
  int64_t slow_ns_ = 0;
  int64_t smaller_lost_ns(int c) const {  // and the last lost in a class of a smaller size than c's
    int64_t t = 0;
    for (int k = 0; k < kClasses; ++k)
      if (size_of(k) < size_of(c)) t = std::max(t, st_[k].lost_ns);
    return t;
  }
};

}  // namespace pz
