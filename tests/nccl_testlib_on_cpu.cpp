// nccl_testlib_on_cpu.cpp — the host-side parts of the test NCCL library
// (csrc/test_nccl/rendezvous.h), run by fork()ed processes: unique ids; the
// shared-memory rendezvous at 1-16 ranks arriving in random order (every rank
// gets every rank's bytes, the segment is gone afterwards); a rank that never
// comes (the others time out naming it), ranks given different world sizes,
// two processes given one rank, an abort while waiting; and the group
// bookkeeping of ncclGroupStart/End (nesting, one batch per communicator in
// order, the 32-operation limit). Built and run by tests/test_nccl_testlib.py.
#include <sys/wait.h>

#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "check_cases.h"
#include "test_nccl/rendezvous.h"

using namespace pz::tnccl;
using check_cases::check;

namespace {

std::string payload(int rank, int salt) {  // a different length and content per rank
  std::string s = "rank " + std::to_string(rank) + " salt " + std::to_string(salt) + ":";
  for (int i = 0; i < (rank * 37 + salt) % 200; ++i) s.push_back(char(i * 7 + rank));
  return s;
}

bool segment_exists(const std::string& name) {
  int fd = shm_open(name.c_str(), O_RDONLY, 0);
  if (fd >= 0) {
    close(fd);
    return true;
  }
  return false;
}

// Runs `body(i)` in `n` forked processes; their exit codes (0 ok, 1 wrong, 2 error with the
// message's code written to `codes`).
template <typename F>
std::vector<int> fork_each(int n, F body) {
  std::vector<pid_t> pids;
  std::fflush(stdout);  // (a child must not print the parent's buffer again)
  for (int i = 0; i < n; ++i) {
    pid_t p = fork();
    if (p == 0) {
      int rc = body(i);
      std::fflush(stdout);
      _exit(rc);
    }
    pids.push_back(p);
  }
  std::vector<int> rc;
  for (pid_t p : pids) {
    int st = 0;
    waitpid(p, &st, 0);
    rc.push_back(WIFEXITED(st) ? WEXITSTATUS(st) : 100 + (WIFSIGNALED(st) ? WTERMSIG(st) : 0));
  }
  return rc;
}

// Codes a child returns for the error it saw.
enum { kOk = 0, kWrong = 1, kTimeout = 10, kNranks = 11, kTwice = 12, kAborted = 13, kOther = 14 };

int classify(const std::exception& e) {
  std::string m = e.what();
  std::printf("  %s\n", m.c_str());
  std::fflush(stdout);
  if (m.find("timed out after") != std::string::npos) return kTimeout;
  if (m.find("every rank must pass the same nranks") != std::string::npos) return kNranks;
  if (m.find("joined this unique id twice") != std::string::npos) return kTwice;
  if (m.find("aborted while waiting") != std::string::npos) return kAborted;
  return kOther;
}

std::string fresh_name() {
  char id[kIdBytes];
  make_unique_id(id);
  return segment_name(id);
}

void ids() {
  char a[kIdBytes], b[kIdBytes];
  make_unique_id(a);
  make_unique_id(b);
  std::string na = segment_name(a), nb = segment_name(b);
  check(na != nb && na.rfind("/pz-tnccl-", 0) == 0, "two ids name two segments: " + na + " " + nb);
  char bad[kIdBytes] = {0};
  bool threw = false;
  try {
    segment_name(bad);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("magic differs") != std::string::npos;
  }
  check(threw, "an id without the magic is refused");
  char empty[kIdBytes] = {0};
  std::memcpy(empty, kIdMagic, sizeof(kIdMagic));
  threw = false;
  try {
    segment_name(empty);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("no segment name") != std::string::npos;
  }
  check(threw, "an id without a name is refused");
  std::printf("ids: ok\n");
}

void rendezvous_ok(int n, int salt) {
  const std::string name = fresh_name();
  std::vector<int> rc = fork_each(n, [&](int r) {
    std::mt19937 rng(unsigned(r * 7919 + salt));
    usleep(rng() % 20000);  // arrive in a random order
    try {
      std::vector<std::string> all = rendezvous(name, r, n, payload(r, salt), 20.0);
      if (int(all.size()) != n) return int(kWrong);
      for (int k = 0; k < n; ++k)
        if (all[k] != payload(k, salt)) return int(kWrong);
      return int(kOk);
    } catch (const std::exception& e) {
      return classify(e);
    }
  });
  int ok = 0;
  for (int c : rc) ok += c == kOk;
  check(ok == n, "rendezvous of " + std::to_string(n) + ": every rank got every rank's bytes");
  check(!segment_exists(name), "the segment of " + std::to_string(n) + " ranks was unlinked");
  std::printf("rendezvous %d ranks: %d of %d got every handle, segment %s\n", n, ok, n,
              segment_exists(name) ? "left" : "gone");
}

void faults() {
  // rank 2 of 3 never comes: ranks 0 and 1 time out naming it
  std::string name = fresh_name();
  std::vector<int> rc = fork_each(2, [&](int r) {
    try {
      rendezvous(name, r, 3, payload(r, 1), 0.3);
      return int(kOk);
    } catch (const std::exception& e) {
      return classify(e);
    }
  });
  check(rc[0] == kTimeout && rc[1] == kTimeout, "a missing rank: both others time out");
  check(!segment_exists(name), "a timed-out rendezvous leaves no segment");
  std::printf("missing rank: codes %d %d, segment %s\n", rc[0], rc[1], segment_exists(name) ? "left" : "gone");

  // ranks given different world sizes: the second to arrive is told; the first times out
  name = fresh_name();
  rc = fork_each(2, [&](int r) {
    if (r == 1) usleep(50000);
    try {
      rendezvous(name, r, r == 0 ? 2 : 3, payload(r, 2), 0.5);
      return int(kOk);
    } catch (const std::exception& e) {
      return classify(e);
    }
  });
  check(rc[0] == kTimeout && rc[1] == kNranks, "different nranks: the later rank is told");
  std::printf("nranks differ: codes %d %d\n", rc[0], rc[1]);

  // two processes given rank 0
  name = fresh_name();
  rc = fork_each(2, [&](int r) {
    if (r == 1) usleep(50000);
    try {
      rendezvous(name, 0, 2, payload(0, 3), 0.5);
      return int(kOk);
    } catch (const std::exception& e) {
      return classify(e);
    }
  });
  check(rc[0] == kTimeout && rc[1] == kTwice, "one rank twice: the second is told");
  std::printf("rank twice: codes %d %d\n", rc[0], rc[1]);

  // an abort (stop) ends the wait
  name = fresh_name();
  auto t0 = std::chrono::steady_clock::now();
  int code = kOk;
  try {
    rendezvous(name, 0, 2, payload(0, 4), 30.0,
               [&] { return std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(100); });
  } catch (const std::exception& e) {
    code = classify(e);
  }
  double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  check(code == kAborted && s < 5.0, "stop ends a rendezvous");
  check(!segment_exists(name), "an aborted rendezvous leaves no segment");
  std::printf("abort: code %d\n", code);

  bool threw = false;
  try {
    rendezvous(fresh_name(), 2, 2, "x", 1.0);
  } catch (const std::invalid_argument& e) {
    threw = true;
  }
  check(threw, "rank >= nranks is refused");
  threw = false;
  try {
    rendezvous(fresh_name(), 0, kMaxRanks + 1, "x", 1.0);
  } catch (const std::invalid_argument& e) {
    threw = true;
  }
  check(threw, "nranks above the ipc transport's limit is refused");
}

void groups() {
  GroupState<int> g;
  auto op = [](int peer, bool send, int64_t bytes) { return P2POp{nullptr, bytes, peer, send, 0}; };
  g.start();
  g.add(7, op(1, true, 8));
  g.start();  // nested: nothing is issued at its end
  g.add(3, op(0, false, 4));
  g.add(7, op(1, false, 8));
  check(g.end().empty() && g.depth() == 1, "an inner ncclGroupEnd issues nothing");
  g.add(3, op(2, true, 6));
  auto b = g.end();
  check(b.size() == 2 && b[0].comm == 7 && b[1].comm == 3, "one batch per communicator, in first-use order");
  check(b.size() == 2 && b[0].ops.size() == 2 && b[0].ops[0].is_send && !b[0].ops[1].is_send &&
            b[1].ops.size() == 2 && b[1].ops[1].peer == 2,
        "each batch holds its operations in call order");
  check(g.depth() == 0, "the outermost ncclGroupEnd closes the group");
}

void group_limits() {
  GroupState<int> g;
  bool threw = false;
  try {
    g.end();
  } catch (const std::logic_error& e) {
    threw = std::string(e.what()).find("without ncclGroupStart") != std::string::npos;
  }
  check(threw, "ncclGroupEnd without a group is refused");
  g.start();
  for (int i = 0; i < kMaxGroupOps; ++i) g.add(1, P2POp{nullptr, 2, i % 2, i % 2 == 0, 0});
  g.add(2, P2POp{nullptr, 2, 0, true, 0});  // another communicator has its own limit
  std::string msg;
  try {
    g.add(1, P2POp{nullptr, 2, 0, true, 0});
  } catch (const std::length_error& e) {
    msg = e.what();
  }
  check(msg.find("at most 32 sends and receives") != std::string::npos, "the 33rd operation is refused: " + msg);
  g.forget(2);
  auto b = g.end();
  check(b.size() == 1 && b[0].ops.size() == size_t(kMaxGroupOps), "the refused operation is not held");
  check(p2p_unit(0) == 2 && p2p_unit(4098) == 2 && p2p_unit(7) == 0, "messages move in 2-byte units");
  std::printf("groups: %s\n", msg.c_str());
}

}  // namespace

int main() {
  ids();
  for (int n : {1, 2, 3, 4, 8, 16}) rendezvous_ok(n, n * 11);
  for (int rep = 0; rep < 5; ++rep) rendezvous_ok(4, 100 + rep);
  faults();
  groups();
  group_limits();
  return check_cases::report();
}
