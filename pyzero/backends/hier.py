"""The "hier" backend: CPU processes on several hosts.

Inside a host the ranks talk over pyzero's shm transport (one shm group per
host); between hosts pyzero runs over torch.distributed's gloo engine (TCP),
never a network stack of its own. Ranks with the same local index on every
host form a "lane", one gloo group each; a gloo group over the whole group
carries send/recv between hosts.

    all_reduce      intra reduce-scatter (shm, one chunk per lane)
                    -> inter all_reduce of the chunk (gloo, the lane)
                    -> intra all-gather (shm)
                    above PIPELINE_BYTES in pieces, pipelined: while piece k crosses
                    hosts, piece k+1 is reduced and piece k-1 gathered inside the host
    reduce_scatter  intra reduce-scatter of the input regrouped by lane
                    -> inter all-to-all of the lane's chunks (gloo) and a local reduction in host order
    all_gather      inter all-gather in the lane (gloo) -> intra all-gather (shm) -> regroup
    broadcast       intra broadcast on the root's host -> inter broadcast in one lane -> intra broadcast
    barrier         intra barrier -> lane barrier -> intra barrier

Every rank gets bitwise the same result: each chunk is reduced in one fixed
order by one owner and copied to the others. fp16/bf16 are reduced in fp32
(the shm phase as well as the gloo one) and rounded once, as on one host.
Hosts may hold different numbers of ranks; lanes are then the local indices
that every host has, and reduce_scatter/all_gather fall back to simpler
(correct, less economical) paths.

Every collective first checks that the group's ranks made the same call (collective, element count,
the counts per rank, dtype, op or root, algo) with a MAX all_reduce of the descriptor and its negation
(inside the host over shm, then across hosts in the lane over gloo): gloo itself checks nothing, and a mismatch would otherwise read past a
buffer, mix reductions or hang. A mismatch raises CollectiveError on every rank at once, naming the
fields that differ, and the group stays usable (options check_calls / PYZERO_HIER_CHECK=0 skip the
check: one small inter-host message less per call).

Collectives run in order on one worker thread per group (an async call
returns at once; the shm and gloo calls inside release the GIL); send/recv
bypass it (see HierBackend.send; a receive from another host runs on a thread
per peer, which checks the message's size and dtype first: [Note: hier send
header]). A failure (a dead or stuck peer) is raised as CollectiveTimeout
naming the ranks that did not answer a store probe afterwards (see
[Note: hier failure probe]); the group is then unusable.

``stats()`` counts, per collective, what this rank sent in total, and under
the extra keys "intra_host" and "inter_host" the bytes it sent inside and
across hosts (the gloo bytes are the standard algorithm's: ring all_reduce
2(H-1)/H x size, and so on; a breakdown, not extra traffic).
"""
from __future__ import annotations

import concurrent.futures
import queue
import threading
import ctypes
import datetime
import json
import os
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from ..backend import (
    ALGOS,
    DTYPE_NAMES,
    DTYPES,
    OPS,
    TORCH_DTYPES,
    Backend,
    Buffer,
    CollectiveError,
    CollectiveTimeout,
    GroupSetup,
    MessageMismatch,
    RawGroup,
    check_contiguous,
    tensor_code,
)
from ..checks import digest
from ..topology import host_name, peer_json
from .shm import ShmBackend

_AUTO = 0  # algo "auto" of the shm transport
# all_reduce pieces: above twice this many bytes an all_reduce runs in pieces of about this size,
# so that the shm phases of one piece overlap the inter-host transfer of the one before.
# Measured (pyzero-bench hier, 2 hosts x 2 ranks, 16 MiB, veth at 2 Gbit/s): 1 MiB pieces
# 70.8-72.0 ms, 2 MiB 70.7-71.9, 4 MiB 71.6-73.0, one piece 75.8-76.3; at 200 Mbit/s 1 MiB
# pieces 710-711 ms, one piece 718-720 (the link's bound: 702).
PIPELINE_BYTES = 1 << 20


def _algo(algo: int, kind: str) -> int:
    """`algo` as the call's descriptor carries it ("auto" matches anything). Whatever it names, hier runs
    its own two-level algorithm; the names the shm backend refuses for `kind` are refused here too."""
    if algo == ALGOS["native"]:
        raise ValueError(f"{kind}: algo='native' is NCCL's own collective, for the nccl backend; the hier "
                         "backend takes 'auto', 'ring', 'oneshot' or 'twoshot'")
    if algo == ALGOS["twoshot"] and kind != "all_reduce":
        raise ValueError(f"{kind}: algo='twoshot' is an all_reduce algorithm; use 'auto', 'ring' or 'oneshot'")
    return _UNSET if algo == _AUTO else algo
_OP_NAMES = {code: name for name, code in OPS.items()}
_GLOO_OPS = {"sum": dist.ReduceOp.SUM, "avg": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX,
             "min": dist.ReduceOp.MIN, "prod": dist.ReduceOp.PRODUCT}
_COMBINE = {"sum": torch.add, "avg": torch.add, "max": torch.maximum, "min": torch.minimum, "prod": torch.mul}
_STAT_KEYS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "send", "recv",
              "intra_host", "inter_host")
_WIDE = (torch.float16, torch.bfloat16)  # reduced in fp32, rounded once
_KINDS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier")
_FIELDS = ("collective", "element count", "counts per rank", "dtype", "op or root", "algo")
_UNSET = -(1 << 60)  # a descriptor field that matches anything (algo "auto")
_PROBE_S = 3.0  # at most this long a failed rank waits for its peers to report in (see [Note: hier failure probe])


class _Mismatch(Exception):
    """The ranks of a group made different calls (found by HierBackend._check_call on every rank), or a
    send and its receive across hosts disagree (found by the receiver, HierBackend._recv_inter)."""


def _show(field: int, v: int, kind: int | None = None) -> str:
    """Field `field` of a call descriptor; `kind`, the collective every rank called (if they agree), tells
    an op (by name) from a root (a number)."""
    if field == 0 and 0 <= v < len(_KINDS):
        return _KINDS[v]
    if field == 3 and v in TORCH_DTYPES:
        return str(TORCH_DTYPES[v]).replace("torch.", "")
    if field == 4 and kind in (_KINDS.index("all_reduce"), _KINDS.index("reduce_scatter")) and v in _OP_NAMES:
        return _OP_NAMES[v]
    return str(v)


def _counts_hash(counts) -> int:
    """Counts per rank as one 40-bit number (a cryptographic digest: two different lists that sum alike
    cannot be made to agree, as they could under a linear hash)."""
    return digest(b"".join(int(c).to_bytes(8, "little", signed=True) for c in counts), 5)


# [Note: NaN through gloo's max/min] gloo's MAX/MIN are std::max/std::min, which keep or drop a NaN by
# operand order, where torch and pyzero's own kernels propagate it. So floats cross hosts for max/min as
# order keys: an integer whose integer order is the floats' order (the bits, magnitude bits flipped for
# negative values), every NaN made the key that wins (above +inf for max, below -inf for min).
# (the key of -x is -1 - the key of x: a negative quiet NaN's key, -1 - the positive one's, is below -inf's)
_KEY_INT = {torch.float32: (torch.int32, 0x7FFFFFFF, 0x7FC00000, -1 - 0x7FC00000),
            torch.float64: (torch.int64, 0x7FFFFFFFFFFFFFFF, 0x7FF8000000000000, -1 - 0x7FF8000000000000)}


def _order_keys(x: torch.Tensor, op: str) -> torch.Tensor:
    """`x` (float32 or float64) as order keys for gloo's integer `op` ("max" or "min"), NaN winning."""
    itype, flip, nan_max, nan_min = _KEY_INT[x.dtype]
    bits = x.view(itype)
    keys = torch.where(bits < 0, bits ^ flip, bits)
    return keys.masked_fill_(torch.isnan(x), nan_max if op == "max" else nan_min)


def _from_keys(keys: torch.Tensor, out: torch.Tensor) -> None:
    """The floats of _order_keys' `keys`, into `out`."""
    flip = _KEY_INT[out.dtype][1]
    out.copy_(torch.where(keys < 0, keys ^ flip, keys).view(out.dtype))


@dataclass
class _Stat:
    calls: int = 0
    elements: int = 0
    sent_bytes: int = 0


class _P2P:
    """Raw handle of a send/recv: the transport's own, failures translated as for collectives."""

    __slots__ = ("backend", "kind", "raw")

    def __init__(self, backend, kind, raw):
        self.backend, self.kind, self.raw = backend, kind, raw

    def wait(self, *_):
        try:
            self.raw.wait()
        except _Mismatch as e:  # a send and its recv that disagree: the message was discarded, the pair goes on
            raise MessageMismatch(str(e)) from None
        except MessageMismatch as e:  # the same inside the host (shm)
            raise MessageMismatch(f"{self.backend._where(self.kind)}: {e}") from None
        except (CollectiveError, RuntimeError) as e:
            self.backend.broken = f"{self.kind}: {e}"
            raise self.backend._failed(self.kind, e) from e

    synchronize = wait

    def is_completed(self) -> bool:
        return self.raw.is_completed()


class _Pending:
    """Raw handle of an async hier call (wrapped by pyzero.backend.Work)."""

    __slots__ = ("fut",)

    def __init__(self, fut):
        self.fut = fut

    def wait(self, *_):
        self.fut.result()

    synchronize = wait

    def is_completed(self) -> bool:
        return self.fut.done()


def _serve(q: queue.SimpleQueue) -> None:
    """Run the (function, future) items of `q` in order, until None."""
    while (item := q.get()) is not None:
        fn, fut = item
        try:
            fut.set_result(fn())
        except BaseException as e:  # noqa: BLE001 - handed to the caller through the future
            fut.set_exception(e)


def tensor_of(b: Buffer) -> torch.Tensor:
    """A CPU tensor over the buffer's memory (no copy)."""
    dtype = TORCH_DTYPES[b.code]
    if b.numel == 0:
        return torch.empty(0, dtype=dtype)
    raw = (ctypes.c_char * b.nbytes).from_address(b.ptr)
    return torch.frombuffer(raw, dtype=dtype, count=b.numel)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view, for the copy-only gloo calls (gloo has no bf16 arithmetic, but copies bytes)."""
    return t.view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8)


def _split(n: int, parts: int) -> list[int]:
    q, r = divmod(n, parts)
    return [q + (i < r) for i in range(parts)]


def _gloo(store, prefix: str, rank: int, size: int, timeout: float):
    """A gloo process group of its own (not torch.distributed's default group), rendezvous under `prefix`."""
    opts = dist.ProcessGroupGloo._Options()
    opts._timeout = datetime.timedelta(seconds=timeout)
    iface = os.environ.get("GLOO_SOCKET_IFNAME")
    try:
        opts._devices = [dist.ProcessGroupGloo.create_device(interface=iface) if iface
                         else dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, opts)
    except RuntimeError as e:
        raise CollectiveError(f"the inter-host engine (torch.distributed gloo) could not start for rank {rank} "
                              f"of {size} ({e}); check that hosts reach each other over TCP and "
                              "GLOO_SOCKET_IFNAME names the right interface") from e


class HierBackend(Backend):
    name = "hier"

    def __init__(self, setup: GroupSetup, hosts, names, global_ranks):
        self.setup = setup
        self.rank, self.size = setup.rank, setup.size
        self.hosts = hosts  # group ranks per host, hosts ordered by their lowest rank
        self.host_names = names
        self.global_ranks = global_ranks
        self.H = len(hosts)
        self.h = next(i for i, hr in enumerate(hosts) if self.rank in hr)
        self.local = hosts[self.h]
        self.l = self.local.index(self.rank)
        self.L = len(self.local)
        self.lanes = min(len(hr) for hr in hosts)  # local indices present on every host
        self.even = all(len(hr) == self.L for hr in hosts)
        self.intra = self.lane = self.full = None
        self.stat: dict[str, _Stat] = {}
        self.stat_lock = threading.Lock()
        self.broken: str | None = None
        self.closed = False
        self.check_calls = setup.options.get("check_calls", True, "PYZERO_HIER_CHECK")
        self.current = ""  # the collective running on the worker thread (its bytes are counted under it)
        # One daemon worker runs the calls in order (a ThreadPoolExecutor's worker would be joined at
        # interpreter exit, holding it up for the timeout behind a call stuck on a dead peer).
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.worker = threading.Thread(target=_serve, args=(self.queue,), name="pz-hier", daemon=True)
        self.worker.start()
        self.receivers: dict[int, queue.SimpleQueue] = {}  # peer on another host -> its receiving thread's queue
        self.send_lock = threading.Lock()

    @classmethod
    def create(cls, setup: GroupSetup) -> "HierBackend":
        s, key, t = setup.store, setup.key + "/hier", setup.timeout
        me = setup.global_rank
        s.set(f"{key}/host/{setup.rank}", json.dumps([host_name(), me]))
        keys = [f"{key}/host/{r}" for r in range(setup.size)]
        setup.wait(keys)
        reports = [peer_json(s.get(k), k, lambda v: type(v) is list and len(v) == 2 and type(v[0]) is str
                             and 0 < len(v[0]) <= 255 and type(v[1]) is int and 0 <= v[1] < 1 << 31,
                             "[host name, global rank]") for k in keys]
        by_name: dict[str, list[int]] = {}
        for r, (name, _) in enumerate(reports):
            by_name.setdefault(name, []).append(r)
        ordered = sorted(by_name.items(), key=lambda kv: kv[1][0])
        self = cls(setup, [tuple(r) for _, r in ordered], [n for n, _ in ordered], [g for _, g in reports])
        try:
            if self.L > 1:  # see the module docstring: shm inside the host
                self.intra = ShmBackend.create(replace(setup, key=f"{setup.key}/h{self.h}",
                                                       name=f"{setup.name}h{self.h}", rank=self.l, size=self.L))
            setup.barrier("hier/ready")  # (gloo's set-up below waits for every rank with no word of failures)
            if self.l < self.lanes and self.H > 1:
                self.lane = _gloo(s, f"{key}/lane{self.l}/", self.h, self.H, t)
            self.full = _gloo(s, f"{key}/all/", setup.rank, setup.size, t)
        except BaseException:
            self.close()
            raise
        return self

    # ---- plumbing ----

    def _submit(self, fn, q: queue.SimpleQueue | None = None) -> concurrent.futures.Future:
        """Run `fn` on the worker (or on the thread serving `q`) after what was queued before it."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        (self.queue if q is None else q).put((fn, fut))
        return fut

    def buffer(self, x, arg: str, writable: bool = True) -> Buffer:
        code = tensor_code(x, arg)
        check_contiguous(x, arg)
        if not x.is_cpu:
            raise ValueError(f"{arg}: the hier backend takes CPU tensors, got a tensor on {x.device}")
        return Buffer(x.data_ptr(), x.numel(), x.element_size(), code)

    def _run(self, what: str, elements: int, fn, async_op: bool, desc=()):
        """Run collective `what` on the worker; `desc` (dtype, counts hash, op or root, algo) is
        compared across the group first."""
        if self.broken is not None:
            raise CollectiveError(f"{what}: the group is unusable after an earlier failure: {self.broken}")
        self._count(what, elements, 0)
        fut = self._submit(lambda: self._guarded(what, fn, (_KINDS.index(what), elements, *desc)))
        if async_op:
            return _Pending(fut)
        fut.result()
        return None

    def _guarded(self, what: str, fn, desc: tuple) -> None:
        self.current = what
        if self.broken is not None:  # a send/recv failed after this call was queued
            raise CollectiveError(f"{what}: the group is unusable after an earlier failure: {self.broken}")
        try:
            self._check_call(what, desc)
        except _Mismatch as e:
            raise CollectiveError(str(e)) from None  # every rank raises it: the group stays usable
        except RuntimeError as e:
            self.broken = f"{what}: {e}"
            raise self._failed(what, e) from e
        try:
            fn()
        except (CollectiveError, RuntimeError) as e:  # shm errors are CollectiveErrors; gloo's RuntimeErrors
            self.broken = f"{what}: {e}"
            raise self._failed(what, e) from e
        finally:
            self._fold_intra(what)

    def _fold_intra(self, what: str, collectives: bool = True) -> None:
        """Count the shm group's bytes since the last fold: its send/recv under their own names, the
        rest under the collective `what` that used them (worker thread); `collectives` False drops the
        rest (the call checks' bytes)."""
        if self.intra is None or self.closed:
            return
        for op, st in self.intra.stats(True).items():
            if st.calls and (collectives or op in ("send", "recv")):
                self._count("intra_host", st.elements, st.sent_bytes, calls=st.calls)
                self._count(op if op in ("send", "recv") or not what else what, 0, st.sent_bytes, calls=0)

    def _failed(self, what: str, err: Exception) -> Exception:
        """The error to raise after a failure, naming the ranks that did not report a failure of their own
        (through the store) within a short probe: dead, or stuck elsewhere.

        [Note: hier failure probe] A failing rank first marks itself in the store, then shuts its gloo
        groups down (see _shutdown_gloo) so that peers blocked on it fail at once instead of after the timeout, then waits
        for the others' marks. The live ranks all fail soon after and mark themselves; the dead never do."""
        s, key = self.setup.store, f"{self.setup.key}/hier/failed"
        try:
            s.set(f"{key}/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store itself is gone with the rank that hosts it
            return CollectiveTimeout(f"{what}: failed and the job's store is unreachable (global rank 0, "
                                     f"which hosts it, may be dead): {err}")
        self._shutdown_gloo()
        missing = [r for r in range(self.size) if r != self.rank]
        deadline = time.monotonic() + min(self.setup.timeout + 1.0, _PROBE_S)
        try:
            while missing and time.monotonic() < deadline:
                missing = [r for r in missing if not s.check([f"{key}/{r}"])]
                time.sleep(0.02)
        except Exception:  # noqa: BLE001
            missing = [0] if self.rank != 0 else missing
        who = ", ".join(f"rank {self.global_ranks[r]} (host {self.host_names[self._host_of(r)]!r})"
                        for r in missing)
        where = self._where(what)
        if isinstance(err, CollectiveError):  # from the shm group of this host
            tail = f"; did not respond: {who}" if missing else ""
            return type(err)(f"{where}: {err}{tail}")
        if not missing:
            return CollectiveError(f"{where}: an inter-host transfer failed on every rank: {err}")
        return CollectiveTimeout(f"{where}: an inter-host transfer failed; {who} did not respond "
                                 f"(dead or stuck): {err}")

    def _where(self, what: str) -> str:
        """`what` on this host, with its local ranks (those the shm transport's messages name) as global ones."""
        local = ", ".join(f"local rank {i} = rank {self.global_ranks[r]}" for i, r in enumerate(self.local))
        return f"{what} on host {self.host_names[self.h]!r} ({local})"

    def _check_call(self, what: str, desc: tuple) -> None:
        """Raise _Mismatch on every rank if the ranks' descriptors of this call differ (field by field:
        the MAX of d and of -d over the group agree only if every rank gave the same d). Two levels, so
        that one small message crosses hosts: MAX inside the host (shm), then across hosts in each lane
        (gloo; every lane combines the same host values, so every lane gets the group's), and with
        uneven hosts a broadcast from the host's lane 0 to its ranks outside the lanes."""
        if not self.check_calls or self.size == 1:
            return
        d = list(desc) + [_UNSET] * (len(_FIELDS) - len(desc))
        v = torch.tensor(d + [_UNSET if x == _UNSET else -x for x in d], dtype=torch.int64)
        if self.intra is not None:
            self.intra.all_reduce(self.intra.buffer(v, "v"), OPS["max"], _AUTO, False)
        if self.lane is not None:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.lane.allreduce([v], opts).wait()
        if not self.even and self.intra is not None:
            self.intra.broadcast(self.intra.buffer(v, "v"), 0, _AUTO, False)
        self._fold_intra(self.current, collectives=False)  # comm_stats() counts data, not these checks
        n = len(_FIELDS)
        hi, lo = v[:n].tolist(), [-x for x in v[n:].tolist()]
        kind = hi[0] if hi[0] == lo[0] else None
        bad = [f"{_FIELDS[i]} ({_show(i, lo[i], kind)} .. {_show(i, hi[i], kind)})" for i in range(n)
               if hi[i] != _UNSET and hi[i] != lo[i]]
        if bad:
            mine = _show(0, desc[0])
            raise _Mismatch(f"{what}: mismatched calls across the group: the ranks differ in {', '.join(bad)}; "
                            f"this rank (group rank {self.rank}) called {mine} with element count {desc[1]}")

    def _shutdown_gloo(self) -> None:
        # Dropping the last reference closes the sockets at once (abort() and shutdown() leave them
        # open until the process exits, and the peers would wait for the timeout).
        self.lane = self.full = None

    def _host_of(self, r: int) -> int:
        return next(i for i, hr in enumerate(self.hosts) if r in hr)

    def _count(self, key: str, elements: int, sent: int, calls: int = 1) -> None:
        with self.stat_lock:  # the caller's thread (calls, send/recv) and the worker (bytes) both count
            st = self.stat.setdefault(key, _Stat())
            st.calls += calls
            st.elements += elements
            st.sent_bytes += sent

    def _inter(self, nbytes: int) -> None:
        self._count("inter_host", 0, int(nbytes))
        self._count(self.current, 0, int(nbytes), calls=0)

    # ---- the two transports ----

    def _intra_rs(self, out: torch.Tensor, inp: torch.Tensor, counts, op: int) -> None:
        if self.intra is None:
            if out.data_ptr() != inp.data_ptr():
                out.copy_(inp[:out.numel()])
            return
        self.intra.reduce_scatter(self.buffer(out, "out"), self.buffer(inp, "inp"), counts, op, _AUTO, False)

    def _intra_ag(self, out: torch.Tensor, inp: torch.Tensor, counts) -> None:
        if self.intra is None:
            if out.data_ptr() != inp.data_ptr():
                out[:inp.numel()].copy_(inp)
            return
        self.intra.all_gather(self.buffer(out, "out"), self.buffer(inp, "inp"), counts, _AUTO, False)

    def _intra_bcast(self, t: torch.Tensor, root: int) -> None:
        if self.intra is not None:
            self.intra.broadcast(self.buffer(t, "tensor"), root, _AUTO, False)

    # ---- collectives ----

    def all_reduce(self, b, op, algo, async_op):
        x = tensor_of(b)
        return self._run("all_reduce", x.numel(), lambda: self._all_reduce(x, _OP_NAMES[op]), async_op,
                         (_UNSET, b.code, op, _algo(algo, "all_reduce")))

    def _all_reduce(self, x: torch.Tensor, op: str) -> None:
        w = x.float() if x.dtype in _WIDE else x
        nbytes = w.numel() * w.element_size()
        if self.H == 1 or nbytes <= 2 * PIPELINE_BYTES:  # the same choice on every rank of the host: a rank
            self._ar_finish(*self._ar_start(x, w, op))   # without a lane (uneven hosts) takes the pieces too
            return
        pieces = -(-nbytes // PIPELINE_BYTES)
        pending = None
        off = 0
        for n in _split(w.numel(), pieces):  # the same pieces on every rank: the split depends on numel only
            started = self._ar_start(x[off:off + n], w[off:off + n], op)
            if pending is not None:
                self._ar_finish(*pending)
            pending, off = started, off + n
        self._ar_finish(*pending)

    def _ar_start(self, x: torch.Tensor, w: torch.Tensor, op: str):
        """Reduce-scatter `w` (x, or its fp32 copy) inside the host; start the lane's all_reduce of this
        rank's chunk."""
        parts = _split(w.numel(), self.lanes)
        counts = [parts[i] if i < self.lanes else 0 for i in range(self.L)]
        off = sum(counts[:self.l])
        chunk = w[off:off + counts[self.l]]
        self._intra_rs(chunk, w, counts, OPS["sum"] if op == "avg" else OPS[op])
        work = keys = None
        if self.lane is not None and chunk.numel():
            opts = dist.AllreduceOptions()
            opts.reduceOp = _GLOO_OPS[op]
            if op in ("max", "min") and chunk.dtype in _KEY_INT:  # see [Note: NaN through gloo's max/min]
                keys = _order_keys(chunk, op)
            work = self.lane.allreduce([chunk if keys is None else keys], opts)
            self._inter(2 * (self.H - 1) * chunk.numel() * chunk.element_size() // self.H)
        return x, w, counts, off, chunk, (work, keys), op

    def _ar_finish(self, x, w, counts, off, chunk, lane, op) -> None:
        """Wait for the chunk's lane all_reduce, then all-gather the chunks inside the host into x."""
        work, keys = lane
        if work is not None:
            work.wait()
        if keys is not None:
            _from_keys(keys, chunk)
        if op == "avg":
            chunk.div_(self.size)
        if w is not x:
            x[off:off + counts[self.l]].copy_(chunk)
        self._intra_ag(x, x[off:off + counts[self.l]], counts)

    def reduce_scatter(self, out, inp, counts, op, algo, async_op):
        o, i = tensor_of(out), tensor_of(inp)
        counts = list(counts)
        return self._run("reduce_scatter", i.numel(), lambda: self._reduce_scatter(o, i, counts, _OP_NAMES[op]),
                         async_op, (_counts_hash(counts), out.code, op, _algo(algo, "reduce_scatter")))

    def _reduce_scatter(self, out: torch.Tensor, inp: torch.Tensor, counts: list[int], op: str) -> None:
        wide = torch.float32 if inp.dtype in _WIDE else inp.dtype
        starts = [sum(counts[:r]) for r in range(self.size)]
        if not self.even or self.H == 1:  # uneven hosts: reduce everything, keep this rank's chunk
            w = inp.to(wide, copy=True)
            self._all_reduce(w, op)
            out.copy_(w[starts[self.rank]:starts[self.rank] + counts[self.rank]])
            return
        # Regroup by lane: lane l's segment holds the chunks of ranks (0, l), (1, l), ... (H-1, l).
        order = [self.hosts[h][l] for l in range(self.L) for h in range(self.H)]
        w = torch.cat([inp[starts[r]:starts[r] + counts[r]] for r in order]).to(wide)
        seg = [sum(counts[self.hosts[h][l]] for h in range(self.H)) for l in range(self.L)]
        off = sum(seg[:self.l])
        mine = w[off:off + seg[self.l]]
        inner = OPS["sum"] if op == "avg" else OPS[op]
        self._intra_rs(mine, w, seg, inner)
        # Inter: all-to-all within the lane, then reduce in host order (fixed, so deterministic).
        splits = [counts[self.hosts[h][self.l]] for h in range(self.H)]
        recv = torch.empty(self.H * counts[self.rank], dtype=wide)
        if self.H > 1 and (mine.numel() or recv.numel()):
            self.lane.alltoall_base(recv, mine.contiguous(), [counts[self.rank]] * self.H, splits,
                                    dist.AllToAllOptions()).wait()
            self._inter((mine.numel() - splits[self.h]) * mine.element_size())
        parts = recv.view(self.H, counts[self.rank]) if self.H > 1 else mine.view(1, -1)
        acc = parts[0].clone()
        for p in parts[1:]:
            acc = _COMBINE[op](acc, p)
        if op == "avg":
            acc.div_(self.size)
        out.copy_(acc)

    def all_gather(self, out, inp, counts, algo, async_op):
        o, i = tensor_of(out), tensor_of(inp)
        counts = list(counts)
        return self._run("all_gather", o.numel(), lambda: self._all_gather(o, i, counts), async_op,
                         (_counts_hash(counts), out.code, _UNSET, _algo(algo, "all_gather")))

    def _all_gather(self, out: torch.Tensor, inp: torch.Tensor, counts: list[int]) -> None:
        starts = [sum(counts[:r]) for r in range(self.size)]
        if not self.even or self.H == 1:  # uneven hosts: one padded gloo all-gather over the whole group
            m = max(counts)
            pad = torch.zeros(m, dtype=inp.dtype)
            pad[:inp.numel()].copy_(inp)
            bufs = [torch.empty(m, dtype=inp.dtype) for _ in range(self.size)]
            if m:
                self.full.allgather([[_bytes(b) for b in bufs]], [_bytes(pad)]).wait()
                self._inter(sum(m * inp.element_size() for r in range(self.size)
                                if self._host_of(r) != self.h))
            for r in range(self.size):
                out[starts[r]:starts[r] + counts[r]].copy_(bufs[r][:counts[r]])
            return
        lane_counts = [counts[self.hosts[h][self.l]] for h in range(self.H)]
        m = max(lane_counts)
        seg = [sum(counts[self.hosts[h][l]] for h in range(self.H)) for l in range(self.L)]
        w = torch.empty(sum(seg), dtype=inp.dtype)
        off = sum(seg[:self.l])
        mine = w[off:off + seg[self.l]]
        if m:
            pad = torch.zeros(m, dtype=inp.dtype)
            pad[:inp.numel()].copy_(inp)
            bufs = [torch.empty(m, dtype=inp.dtype) for _ in range(self.H)]
            self.lane.allgather([[_bytes(b) for b in bufs]], [_bytes(pad)]).wait()
            self._inter((self.H - 1) * m * inp.element_size())
            mine.copy_(torch.cat([bufs[h][:lane_counts[h]] for h in range(self.H)]))
        self._intra_ag(w, mine, seg)
        pos = 0
        for l in range(self.L):
            for h in range(self.H):
                r = self.hosts[h][l]
                out[starts[r]:starts[r] + counts[r]].copy_(w[pos:pos + counts[r]])
                pos += counts[r]

    def broadcast(self, b, root, algo, async_op):
        x = tensor_of(b)
        return self._run("broadcast", x.numel(), lambda: self._broadcast(x, root), async_op,
                         (_UNSET, b.code, root, _algo(algo, "broadcast")))

    def _broadcast(self, x: torch.Tensor, root: int) -> None:
        hr = self._host_of(root)
        lr = self.hosts[hr].index(root)
        lane = lr if lr < self.lanes else 0
        if self.h == hr:
            self._intra_bcast(x, lr)
        if self.H > 1 and self.l == lane and x.numel():
            opts = dist.BroadcastOptions()
            opts.rootRank = hr
            self.lane.broadcast([_bytes(x)], opts).wait()
            if self.h == hr:
                self._inter(x.numel() * x.element_size())
        if self.h != hr:
            self._intra_bcast(x, lane)

    def barrier(self, async_op):
        return self._run("barrier", 0, self._barrier, async_op)

    def _barrier(self) -> None:
        if self.intra is not None:
            self.intra.barrier(False)
        if self.lane is not None:
            self.lane.barrier().wait()
        if self.intra is not None:
            self.intra.barrier(False)

    # send/recv do not queue behind the collectives (a pipeline posts a recv from one peer before a
    # send to another): inside the host they go to the shm transport's per-peer threads, across hosts
    # to gloo's own asynchronous send/recv, each matched in order per pair, as on one host.

    def send(self, b, peer, async_op):
        return self._p2p("send", tensor_of(b), peer, async_op)

    def recv(self, b, peer, async_op):
        return self._p2p("recv", tensor_of(b), peer, async_op)

    def _p2p(self, kind: str, x: torch.Tensor, peer: int, async_op: bool):
        if self.broken is not None:
            raise CollectiveError(f"{kind}: the group is unusable after an earlier failure: {self.broken}")
        self._count(kind, x.numel(), 0)
        if peer in self.local and self.intra is not None:
            fn = self.intra.send if kind == "send" else self.intra.recv
            raw = fn(self.buffer(x, "tensor"), self.local.index(peer), True)
        elif kind == "send":
            raw = self._send_inter(x, peer)
        else:  # in order per peer, on a thread of its own: the data's size is known once the header is in
            q = self.receivers.get(peer)
            if q is None:
                q = self.receivers[peer] = queue.SimpleQueue()
                threading.Thread(target=_serve, args=(q,), name=f"pz-hier-recv{peer}", daemon=True).start()
            raw = _Pending(self._submit(lambda: self._recv_inter(x, peer), q))
        handle = _P2P(self, kind, raw)
        if async_op:
            return handle
        handle.wait()
        return None

    # [Note: hier send header] Across hosts every message is its element count and dtype code (two int64)
    # followed by the data (if any), both over gloo, which matches them in order per pair. The receiver
    # takes the data only when both agree with its buffer; otherwise it reads the data into scratch
    # memory and raises, naming both, as the shm transport does (gloo itself would deliver a shorter
    # message as a partial one, a different dtype reinterpreted, and abort the process on a longer one).

    def _send_inter(self, x: torch.Tensor, peer: int):
        head = torch.tensor([x.numel(), DTYPES[x.dtype]], dtype=torch.int64)
        with self.send_lock:  # a header and its data are adjacent, whichever threads send
            raws = [self.full.send([head], peer, 0)]
            if x.numel():
                raws.append(self.full.send([_bytes(x)], peer, 0))
        if x.numel():
            self._count("inter_host", 0, x.numel() * x.element_size())
            self._count("send", 0, x.numel() * x.element_size(), calls=0)
        return RawGroup(raws)

    def _recv_inter(self, x: torch.Tensor, peer: int) -> None:
        """Receive one message from `peer` on another host into `x` (the peer's receiving thread)."""
        full = self.full
        if full is None:
            raise CollectiveError(f"recv: the group is unusable after an earlier failure: {self.broken}")
        head = torch.empty(2, dtype=torch.int64)
        full.recv([head], peer, 0).wait()
        count, code = head.tolist()
        mine = DTYPES[x.dtype]
        if count == x.numel() and code == mine:
            if count:
                full.recv([_bytes(x)], peer, 0).wait()
            return
        who = f"rank {self.global_ranks[peer]}"
        if code not in TORCH_DTYPES or count < 0:
            raise CollectiveError(f"recv: {who} sent a malformed header (count {count}, dtype code {code})")
        if count:
            full.recv([torch.empty(count * TORCH_DTYPES[code].itemsize, dtype=torch.uint8)], peer, 0).wait()
        raise _Mismatch(f"recv (rank {self.rank} of {self.size}): mismatched send/recv: {who} sent {count} "
                        f"elements of {DTYPE_NAMES[code]}, this rank expected {x.numel()} elements of "
                        f"{DTYPE_NAMES[mine]} (the message was discarded)")

    # ---- stats and teardown ----

    def stats(self, reset):
        if not self.closed:
            self._submit(lambda: self._fold_intra("")).result()  # every call queued so far has counted its bytes
        with self.stat_lock:
            out = {k: _Stat(v.calls, v.elements, v.sent_bytes) for k, v in self.stat.items()}
        for k in _STAT_KEYS:  # every op, as the shm transport reports them, used or not
            out.setdefault(k, _Stat())
        if reset:
            with self.stat_lock:
                self.stat = {}
        return out

    def close(self):
        self.closed = True
        for q in self.receivers.values():
            q.put(None)
        if self.worker.is_alive():
            self.queue.put(None)
            if self.broken is None:
                self.worker.join()
        if self.intra is not None:
            self.intra.close()
        self._shutdown_gloo()
