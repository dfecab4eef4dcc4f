// ipc_p2p.h — point-to-point (send, recv, batch_isend_irecv) of the "ipc"
// backend: one body that runs on the GPU (ipc_transport.cu, one kernel launch
// per call or batch) and on CPU threads (tests/ipc_p2p_on_cpu.cpp). Same
// executor X as ipc_protocol.h, plus p2p_state() (an array of kIpcMaxP2POps
// IpcP2PState shared by the block's threads).
//
// [Note: ipc point-to-point channels]
// A channel per ordered pair (src -> dst) lives in the receiver's registered
// buffer, after the two collective areas: dst holds n - 1 incoming channels of
// `p2p_bytes` each (pz.init option p2p_bytes, 4 MiB by default), so a rank's
// memory grows linearly with the world size, (n - 1) * p2p_bytes. A channel is
// cut into one lane per block (every rank's kernels have the same B blocks, and
// block b only ever talks to block b of its peers, as in the collectives), and
// a lane into `slots` slots (pz.init option depth, 4 by default) of
// slot_bytes = p2p_bytes / (B * slots) rounded down to 16 bytes. A message of
// `bytes` is split over the blocks in 16-byte units (ipc_p2p_part), and a
// block's part runs through its lane in pieces of at most slot_bytes.
//
// Counters, all monotonic, each with one writer, kept on the device:
//  * the channel ends' own counts, in each rank's own signals, written only by
//    that rank's block b: messages and pieces sent to dst (smsg, spiece) and
//    received from src (rmsg, rpiece). A message's number m = ++smsg (sender)
//    or ++rmsg (receiver): both sides number the channel's messages alike, so
//    a kernel's arguments carry no per-call counter and a launch captured in a
//    CUDA graph replays with fresh numbers ([Note: ipc epochs live on the
//    device]).
//  * the handshake: the sender writes its descriptor of message m into
//    sdesc[m % 2] and then `announced` = m in the receiver's signals; the
//    receiver writes its descriptor into rdesc[m % 2] and then `posted` = m in
//    the sender's signals (release stores at system scope, read with acquire).
//  * the pieces: the sender, for its piece f of the lane (counted over the
//    channel's messages), waits until consumed >= f + 1 - slots (slot f % slots
//    is free), copies the piece into the slot (peer memory), then stores
//    filled = f + 1 in the receiver's signals; the receiver waits for
//    filled >= f + 1, copies the slot out into the user's buffer and stores
//    consumed = f + 1 in the sender's signals.
// NCCL's rule: a send does not complete before its receive is posted: the
// sender waits for `posted` >= m before its first piece (a send with no
// receive times out naming the peer instead of completing into a buffer).
// Both sides compare the two descriptors (bytes, dtype, blocks, slot size)
// before any data moves: a mismatch is recorded on both ranks (naming the peer
// and both sizes), both skip the message's data alike (their piece counts stay
// equal) and the channel goes on with the next message. Except where the two
// ends' kernels run different block counts, or the message is one of a ring
// collective's (algo="ring", p2p_ring.h: its descriptor holds a hash of the whole
// call, IpcP2PCall::call): then the ranks would run different numbers of messages
// and launches, their later ones pairing with each other's other calls, so both
// record kIpcApart, a fault that breaks the group ([Note: ipc calls apart]).
// Why two descriptor slots suffice: the sender writes sdesc[(m + 2) % 2] only
// after its message m + 1 saw posted >= m + 1, which the receiver stores after
// it finished message m (reading sdesc[m % 2] included); symmetrically the
// receiver writes rdesc for m + 2 only after it saw announced >= m + 1, stored
// by the sender after it finished message m.
//
// A batch is one kernel whose blocks each run a progress loop over all the
// batch's operations, never blocking on one: a block posts and announces what
// it can, copies whichever piece is ready, and goes round again. So two ranks
// that send to each other at once (a ring step), or messages larger than a
// lane in both directions, cannot wait in a cycle. Operations on the same
// channel within a batch run in their order (each waits for the previous one
// on that channel). Waits watch the deadline (timeout_ns from the kernel's
// start) and the host's abort word, as the collectives do; a failure names the
// peer and what was awaited.
// A peer that closed the group is found without waiting for the deadline: [Note: a peer that
// closed] in ipc_protocol.h.
#pragma once

#include <cstdint>

#include "ipc_protocol.h"

namespace pz {

constexpr int kIpcMaxP2POps = 32;  // operations of one batch (one kernel)

// What both ends of a message must agree on.
struct IpcP2PDesc {
  int64_t bytes;
  int32_t dtype;
  int32_t blocks;
  int64_t slot_bytes;
  int64_t slots;
  uint64_t call;  // IpcP2PCall::call
};

PZ_HD bool ipc_same_p2p_desc(const IpcP2PDesc& a, const IpcP2PDesc& b) {
  return a.bytes == b.bytes && a.dtype == b.dtype && a.blocks == b.blocks && a.slot_bytes == b.slot_bytes &&
         a.slots == b.slots && a.call == b.call;
}

// Each rank's point-to-point signals ([b][p]: block b, peer p). See [Note: ipc point-to-point channels].
struct IpcP2PSignals {
  // this rank as the receiver of p's channel (written by p)
  uint64_t announced[kIpcMaxBlocks][kIpcMaxRanks];
  uint64_t filled[kIpcMaxBlocks][kIpcMaxRanks];
  IpcP2PDesc sdesc[2][kIpcMaxBlocks][kIpcMaxRanks];
  // this rank as the sender to p (written by p)
  uint64_t posted[kIpcMaxBlocks][kIpcMaxRanks];
  uint64_t consumed[kIpcMaxBlocks][kIpcMaxRanks];
  IpcP2PDesc rdesc[2][kIpcMaxBlocks][kIpcMaxRanks];
  // this rank's own channel ends (written by its block b only)
  uint64_t smsg[kIpcMaxBlocks][kIpcMaxRanks], spiece[kIpcMaxBlocks][kIpcMaxRanks];
  uint64_t rmsg[kIpcMaxBlocks][kIpcMaxRanks], rpiece[kIpcMaxBlocks][kIpcMaxRanks];
};

// What a failed point-to-point wait was waiting for (IpcStatus::p2p).
enum : int32_t {
  kIpcP2PNone = 0,       // a collective
  kIpcP2PSendPost = 1,   // a send, for its receive to be posted (or: the receive's descriptor differs)
  kIpcP2PSendSlot = 2,   // a send, for the receiver to consume a piece
  kIpcP2PRecvSend = 3,   // a receive, for its send (or: the send's descriptor differs)
  kIpcP2PRecvData = 4,   // a receive, for a piece
};

struct IpcP2POp {
  void* buf;  // a send's source (read only), a receive's destination
  int64_t bytes;
  int32_t peer, dtype;
  int32_t is_send;
  int32_t prev;  // the batch's previous operation on the same channel (same peer and direction), or -1
};

// One launch, by value (a kernel parameter): nothing in it changes from call to call but the
// operations' buffers and sizes.
struct IpcP2PCall {
  IpcP2PSignals* sigs[kIpcMaxRanks];  // every rank's point-to-point signals
  char* chans[kIpcMaxRanks];          // every rank's incoming channels
  IpcStatus* status;
  const uint32_t* abort;
  IpcSignals* own;  // this rank's: closed (see [Note: a peer that closed]), the failure claims
  IpcP2POp ops[kIpcMaxP2POps];
  uint64_t call;  // a ring collective's launch: a hash of the whole call (nonzero; else 0)
  uint64_t chan_bytes;  // one channel: blocks * slots * slot_bytes
  uint64_t slot_bytes;
  uint64_t seq;
  uint64_t timeout_ns;
  int32_t nops, slots, rank, nranks;
  int32_t gpu_scope;  // as IpcCall::gpu_scope
};

// Channel src -> dst's lane of block b, in dst's buffer (dst keeps n - 1 channels, src order).
PZ_HD char* ipc_p2p_lane(const IpcP2PCall& c, int src, int dst, int b) {
  const int idx = src < dst ? src : src - 1;
  return c.chans[dst] + uint64_t(idx) * c.chan_bytes + uint64_t(b) * uint64_t(c.slots) * c.slot_bytes;
}

// The bytes [lo, hi) of a message of n bytes that block b of nb moves: 16-byte units, the tail last.
PZ_HD void ipc_p2p_part(int64_t n, int b, int nb, int64_t& lo, int64_t& hi) {
  const int64_t units = n / 16;
  lo = units * b / nb * 16;
  hi = b == nb - 1 ? n : units * (b + 1) / nb * 16;
}

// The progress of one operation in one block. It lives in the block's shared memory
// (x.p2p_state(): one copy per block, not per thread): every thread works on a copy in registers
// and derives the same transitions; thread 0 stores them, between two block barriers.
struct IpcP2PState {
  uint64_t m;     // the message's number on its channel
  uint64_t base;  // the channel's lane pieces before this message
  int64_t lo, hi, npieces, k;  // this block's bytes, its pieces, pieces done
  int32_t phase;  // 0 not started, 1 handshake, 2 pieces, 3 done
};

// The whole launch as block x.block() of rank c.rank runs it; false if a wait failed (see c.status).
template <typename X>
PZ_HD bool ipc_p2p_run(X& x, const IpcP2PCall& c) {
  const int b = x.block(), nb = x.nblocks(), me = c.rank, t0 = x.tid();
  if (!ipc_begin(x, c.own)) return false;
  const uint64_t deadline = x.now_ns() + c.timeout_ns;
  const uint64_t slots = uint64_t(c.slots);
  IpcP2PSignals* own = c.sigs[me];
  IpcP2PState* st = x.p2p_state();
  if (t0 == 0)
    for (int i = 0; i < c.nops; ++i) st[i] = IpcP2PState{0, 0, 0, 0, 0, 0, 0};
  x.sync();
  // One thread reads a flag; the block decides on its value (see ipc_wait_all).
  auto ready = [&](const uint64_t* f, uint64_t want) { return x.sync_and(t0 != 0 || x.load_acquire(f) >= want); };
  auto signal = [&](uint64_t* f, uint64_t v) {
    x.sync();  // the block's data writes are done; the release store publishes them (see ipc_signal)
    if (t0 == 0) x.store_release(f, v);
  };
  auto desc_of = [&](const IpcP2POp& o) {
    return IpcP2PDesc{o.bytes, o.dtype, nb, int64_t(c.slot_bytes), int64_t(c.slots), c.call};
  };
  auto finish = [&](const IpcP2POp& o, IpcP2PState& s) {  // the channel end's counts, for the next message
    s.phase = 3;
    if (t0 == 0) {
      const int p = o.peer;
      if (o.is_send) {
        own->smsg[b][p] = s.m;
        own->spiece[b][p] = s.base + uint64_t(s.npieces);
      } else {
        own->rmsg[b][p] = s.m;
        own->rpiece[b][p] = s.base + uint64_t(s.npieces);
      }
    }
  };
  // One step of operation i on s (a copy of its state); true if it moved on.
  auto step = [&](int i, IpcP2PState& s) -> bool {
    const IpcP2POp& o = c.ops[i];
    const int p = o.peer;
    IpcP2PSignals* peer = c.sigs[p];
    bool moved = false;
    if (s.phase == 0) {  // number the message, hand over the descriptor
      if (o.prev >= 0) {
        s.m = st[o.prev].m + 1;
        s.base = st[o.prev].base + uint64_t(st[o.prev].npieces);
      } else {
        s.m = (o.is_send ? own->smsg[b][p] : own->rmsg[b][p]) + 1;
        s.base = o.is_send ? own->spiece[b][p] : own->rpiece[b][p];
      }
      if (t0 == 0) {
        if (o.is_send) peer->sdesc[s.m % 2][b][me] = desc_of(o);
        else peer->rdesc[s.m % 2][b][me] = desc_of(o);
      }
      signal(o.is_send ? &peer->announced[b][me] : &peer->posted[b][me], s.m);
      s.phase = 1;
      moved = true;
    }
    if (s.phase == 1) {  // the other end's descriptor
      const uint64_t* f = o.is_send ? &own->posted[b][p] : &own->announced[b][p];
      if (!ready(f, s.m)) return moved;
      const IpcP2PDesc theirs = o.is_send ? own->rdesc[s.m % 2][b][p] : own->sdesc[s.m % 2][b][p];
      const IpcP2PDesc mine = desc_of(o);
      if (!ipc_same_p2p_desc(theirs, mine)) {
        if (t0 == 0) {
          // (both ends compare the same two descriptors: they classify it alike)
          const bool apart = theirs.blocks != mine.blocks || theirs.call != 0 || mine.call != 0;
          IpcFailure f = ipc_failure(apart ? kIpcApart : kIpcMismatch, p, s.m, c.seq);
          f.p2p = o.is_send ? kIpcP2PSendPost : kIpcP2PRecvSend;
          f.bytes = o.bytes;
          f.peer_bytes = theirs.bytes;
          f.dtype = o.dtype;
          f.peer_dtype = theirs.dtype;
          f.blocks = mine.blocks;
          f.peer_blocks = theirs.blocks;
          ipc_fail(x, c.status, c.own, f);
        }
        s.npieces = 0;
        finish(o, s);
        return true;
      }
      ipc_p2p_part(o.bytes, b, nb, s.lo, s.hi);
      s.npieces = (s.hi - s.lo + int64_t(c.slot_bytes) - 1) / int64_t(c.slot_bytes);
      s.phase = 2;
      if (s.npieces == 0) {
        finish(o, s);
        return true;
      }
      moved = true;
    }
    // s.phase == 2: the next piece
    const uint64_t f = s.base + uint64_t(s.k);
    const int64_t off = s.lo + s.k * int64_t(c.slot_bytes);
    const int64_t len = (s.hi - off) < int64_t(c.slot_bytes) ? (s.hi - off) : int64_t(c.slot_bytes);
    if (o.is_send) {
      if (f + 1 > slots && !ready(&own->consumed[b][p], f + 1 - slots)) return moved;
      unsigned char* slot = reinterpret_cast<unsigned char*>(ipc_p2p_lane(c, me, p, b) + (f % slots) * c.slot_bytes);
      ipc_copy(x, slot, static_cast<const unsigned char*>(o.buf) + off, len);
      signal(&peer->filled[b][me], f + 1);
    } else {
      if (!ready(&own->filled[b][p], f + 1)) return moved;
      const unsigned char* slot =
          reinterpret_cast<const unsigned char*>(ipc_p2p_lane(c, p, me, b) + (f % slots) * c.slot_bytes);
      ipc_copy(x, static_cast<unsigned char*>(o.buf) + off, slot, len);
      signal(&peer->consumed[b][me], f + 1);
    }
    if (++s.k == s.npieces) finish(o, s);
    return true;
  };
  uint32_t spins = 0;
  uint32_t closed_seen = 0;  // (thread 0) peers seen closed at an earlier check (bit p), so their flags are final
  int closed_peer = -1;
  for (;;) {
    bool all_done = true, progress = false;
    for (int i = 0; i < c.nops; ++i) {
      IpcP2PState s = st[i];
      if (s.phase == 3) continue;
      all_done = false;
      if (c.ops[i].prev >= 0 && st[c.ops[i].prev].phase != 3) continue;  // the channel's earlier message first
      if (!step(i, s)) continue;
      progress = true;
      x.sync();  // every thread has read st[i]
      if (t0 == 0) st[i] = s;
      x.sync();  // and sees the new state
    }
    if (all_done) return true;
    if (progress) {
      spins = 0;
      continue;
    }
    if ((++spins & 1023u) != 0) continue;
    uint32_t code = kIpcOk;
    if (t0 == 0) {
      code = x.load_relaxed(c.abort) != 0 ? kIpcAborted : kIpcOk;
      uint32_t closed_now = 0;
      for (int i = 0; i < c.nops && code == kIpcOk; ++i) {
        const IpcP2POp& o = c.ops[i];
        if (st[i].phase == 3 || (o.prev >= 0 && st[o.prev].phase != 3)) continue;
        if (x.load_acquire(&c.own->closed[o.peer]) == 0) continue;  // (closing or left: no p2p kernel follows)
        if (closed_seen & (1u << o.peer)) {  // closed before the round that just moved nothing
          code = kIpcPeerClosed;
          closed_peer = o.peer;
        }
        closed_now |= 1u << o.peer;  // first sight: go round once more (see [Note: a peer that closed])
      }
      closed_seen |= closed_now;
      if (code == kIpcOk && x.now_ns() > deadline) code = kIpcTimeout;
    }
    if (x.sync_and(code == kIpcOk)) continue;
    if (t0 == 0) {  // name the first operation still waiting (on the closed peer), and what for
      for (int i = 0; i < c.nops; ++i) {
        const IpcP2POp& o = c.ops[i];
        const IpcP2PState& s = st[i];
        if (s.phase == 3 || (o.prev >= 0 && st[o.prev].phase != 3)) continue;
        if (code == kIpcPeerClosed && o.peer != closed_peer) continue;
        const int32_t what = o.is_send ? (s.phase == 1 ? kIpcP2PSendPost : kIpcP2PSendSlot)
                                       : (s.phase == 1 ? kIpcP2PRecvSend : kIpcP2PRecvData);
        IpcFailure f = ipc_failure(code, o.peer, s.m, c.seq);
        f.p2p = what;
        f.bytes = o.bytes;
        f.dtype = o.dtype;
        ipc_fail(x, c.status, c.own, f);
        break;
      }
    }
    return false;
  }
}

}  // namespace pz
