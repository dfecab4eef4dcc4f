"""CUDA tensors on the torch.distributed backend "pyzero": which pyzero GPU transport carries them,
and torch's NCCL work semantics on top of it.

A :class:`pyzero.distributed.ProcessGroupPyzero` hands its CUDA tensors to a :class:`CudaGroups`,
made on the group's first collective on a CUDA tensor (every member makes that call, as with
any collective; nothing touches CUDA before it, so a CPU-only job on a GPU machine allocates
nothing on the GPU). It exchanges each member's host and GPU over the group's store and picks:

- ``ipc`` (CUDA IPC, several processes per GPU allowed) when every member is on one host;
- ``nccl`` (pyzero's ring or NCCL passthrough, one GPU per rank) when the members span hosts,
  and for one-rank groups;
- both when every member is on one host with a GPU of its own: calls of at most
  ``PYZERO_TORCH_IPC_MAX_KB`` (bytes of the whole message: the all-reduced tensor, the gathered
  output, the reduce-scattered input) on ipc, larger ones on nccl (made on the first such call).

``PYZERO_TORCH_CUDA=ipc`` or ``nccl`` takes one transport for every call (an error where it
cannot run), ``auto`` (the default) as above.

Works follow torch's ProcessGroupNCCL: ``wait()`` makes the current stream wait for the call (no
host block), ``synchronize()`` blocks the host, and ``get_future()`` is a CUDA-aware future,
completed at once, whose value is ready on any stream that waits on it (``Future.wait()`` and
``then`` callbacks do that). The buffers a call uses stay referenced until the GPU has passed the
point where it was waited for, whichever stream waited.
"""
from __future__ import annotations

import datetime
import json
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.futures import Future

from . import _loader, comm
from .backends.ipc import MAX_BATCH
from .envvars import env_int
from .topology import host_name, peer_json

__all__ = ["CudaGroups", "CudaWork", "IPC_MAX_ENV", "P2PEntry", "P2PQueue", "QueuedWork", "Route", "TRANSPORT_ENV",
           "DEFAULT_IPC_MAX_BYTES", "ipc_max_bytes", "plan", "transport_choice"]

TRANSPORT_ENV = "PYZERO_TORCH_CUDA"
IPC_MAX_ENV = "PYZERO_TORCH_IPC_MAX_KB"
# The size where nccl takes over from ipc when both can run: a placeholder until measured on a GPU
# (benchmarks/results/), the size up to which one-shot/two-shot all-reduces usually lead.
DEFAULT_IPC_MAX_BYTES = 8 << 20
_CHOICES = ("auto", "ipc", "nccl")
_NO_TIMEOUT = datetime.timedelta(0)


def transport_choice(environ=None) -> str:
    """PYZERO_TORCH_CUDA: "auto" (unset), "ipc" or "nccl"; ValueError naming the variable otherwise."""
    raw = (os.environ if environ is None else environ).get(TRANSPORT_ENV, "auto").strip().lower() or "auto"
    if raw not in _CHOICES:
        raise ValueError(f"{TRANSPORT_ENV}={raw!r}: expected one of {list(_CHOICES)}")
    return raw


def ipc_max_bytes(environ=None) -> int:
    """PYZERO_TORCH_IPC_MAX_KB in bytes (default DEFAULT_IPC_MAX_BYTES); ValueError naming the variable."""
    return env_int(IPC_MAX_ENV, DEFAULT_IPC_MAX_BYTES, kib=True, environ=environ)


@dataclass(frozen=True)
class Route:
    """Which transports a group's CUDA calls take: ipc for calls of at most `ipc_max` bytes where
    both run (ipc and nccl), else the one that runs."""

    ipc: bool
    nccl: bool
    ipc_max: int

    def pick(self, nbytes: int) -> str:
        if self.ipc and (not self.nccl or nbytes <= self.ipc_max):
            return "ipc"
        return "nccl"

    @property
    def first(self) -> str:
        """The transport made with the group (the other, if any, on its first call)."""
        return "ipc" if self.ipc else "nccl"


def plan(peers, requested: str = "auto", ipc_max: int = DEFAULT_IPC_MAX_BYTES, test_nccl: bool = False) -> Route:
    """The route for a group whose member i runs on peers[i] = (host name, GPU id); the same on every
    member. ValueError (every member raises it) where no pyzero transport can carry the group.
    `test_nccl`: the NCCL loaded is pyzero's test library (``pz.nccl_library()["test"]``), which
    takes ranks sharing a GPU of one host: then PYZERO_TORCH_CUDA=nccl runs such a group on it
    (auto still takes ipc there)."""
    peers = [tuple(p) for p in peers]
    hosts = {h for h, _ in peers}
    one_host = len(hosts) == 1
    shared = len(set(peers)) < len(peers)  # two members on one GPU
    if len(peers) == 1 and requested == "auto":
        return Route(False, True, ipc_max)
    if requested == "ipc":
        if not one_host:
            raise ValueError(f"{TRANSPORT_ENV}=ipc: the ipc transport needs every rank of the group on one host, "
                             f"but they are on {len(hosts)} hosts ({sorted(hosts)}); use auto or nccl")
        return Route(True, False, ipc_max)
    if shared and requested == "nccl" and one_host and test_nccl:
        return Route(False, True, ipc_max)
    if shared and (requested == "nccl" or not one_host):
        where = ("NCCL needs one GPU per rank" if one_host else
                 "the group spans hosts, where only NCCL runs, and NCCL needs one GPU per rank")
        fix = f"unset {TRANSPORT_ENV} (ipc takes ranks sharing a GPU)" if one_host else "give each rank its own GPU"
        raise ValueError(f"several ranks of the group share a GPU ({_sharing(peers)}): {where}; {fix}")
    if requested == "nccl" or not one_host:
        return Route(False, True, ipc_max)
    return Route(True, not shared, ipc_max)


def _sharing(peers) -> str:
    seen: dict = {}
    for r, p in enumerate(peers):
        seen.setdefault(p, []).append(r)
    return "; ".join(f"ranks {rs} on GPU {g} of host {h!r}" for (h, g), rs in seen.items() if len(rs) > 1)


def gpu_id(device: int) -> str:
    """A name of cuda:`device` that is the same in every process using that GPU (its UUID)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def _peer(raw: bytes, what: str) -> list:
    return peer_json(raw, what, lambda v: type(v) is list and len(v) == 2
                     and all(type(x) is str and 0 < len(x) <= 255 for x in v), "[host name, GPU id]")


class CudaGroups:
    """The pyzero GPU groups under one torch process group: made with the group's first CUDA
    collective (a collective over `store`: every member calls it with its own `device`)."""

    def __init__(self, store, ranks, rank: int, timeout: float, options, device: int):
        self.ranks, self.rank, self.size = tuple(ranks), rank, len(ranks)
        self.timeout, self.options, self.device = timeout, options, device
        # A store may see the group made again (a job that re-creates its groups): one generation of
        # keys per creation, as pyzero.comm.group_from_store does.
        gen = (store.add("pz-cuda/joins", 1) - 1) // self.size
        self.store = dist.PrefixStore(f"pz-cuda/{gen}/", store)
        self.store.set(f"peer/{rank}", json.dumps([host_name(), gpu_id(device)]))
        keys = [f"peer/{r}" for r in range(self.size)]
        self.store.wait(keys, datetime.timedelta(seconds=timeout))
        peers = [tuple(_peer(self.store.get(k), k)) for k in keys]
        self.route = plan(peers, transport_choice(), ipc_max_bytes(),
                          test_nccl=_loader.test_nccl_loaded())
        self.groups: dict[str, comm.Group] = {}
        self._make(self.route.first)
        self.side: torch.cuda.Stream | None = None  # where get_future() completes works (made on first use)

    def _make(self, name: str) -> comm.Group:
        g = comm.group_from_store(dist.PrefixStore(f"{name}/", self.store), self.ranks, self.rank, self.timeout,
                                  self.options, backend=name, device=self.device)
        self.groups[name] = g
        return g

    def group(self, nbytes: int) -> comm.Group:
        """The group for a call of `nbytes` (the same on every member)."""
        name = self.route.pick(nbytes)
        g = self.groups.get(name)
        return g if g is not None else self._make(name)

    def p2p(self, op: str) -> comm.Group:
        """The group for point-to-point calls (one transport for every size, so that a send and
        its receive always meet): ipc where the ranks share a host, else nccl."""
        return self.groups["ipc"] if self.route.ipc else self.groups["nccl"]

    def side_stream(self) -> torch.cuda.Stream:
        if self.side is None:
            self.side = torch.cuda.Stream(self.device)
        return self.side

    def close(self) -> None:
        for g in self.groups.values():
            g.close()
        self.groups.clear()


# ---------------------------------------------------------------------------
# Works


class Held:
    """What in-flight CUDA works reference until the GPU has passed the point where they were waited
    for: (event, objects) pairs, released once the event has completed."""

    def __init__(self):
        self.items: list = []

    def add(self, event, objs) -> None:
        self.items = [(e, o) for e, o in self.items if not e.query()]
        self.items.append((event, objs))

    def clear(self) -> None:
        for e, _ in self.items:
            e.synchronize()
        self.items = []


class CudaWork(dist.Work):
    """The work of an asynchronous call on CUDA tensors: pyzero works (or other CudaWorks), then
    `finish` (the copy-back from staging buffers) on the stream that first waits for them."""

    def __init__(self, works, result, finish, device: torch.device, groups: CudaGroups, held: Held):
        super().__init__()
        self._works = [w for w in works if w is not None]
        self._result, self._finish = result, finish
        self.device = device
        self._groups, self._held = groups, held
        self._event: torch.cuda.Event | None = None  # recorded after the works and finish, once
        self._fut: Future | None = None
        self._error: Exception | None = None

    def _order(self) -> None:
        """Make the current stream wait for the call (its first caller also runs the copy-back)."""
        if self._error is not None:
            raise self._error
        stream = torch.cuda.current_stream(self.device)
        if self._event is not None:
            stream.wait_event(self._event)
            return
        try:
            for w in self._works:
                if isinstance(w, dist.Work):
                    w.wait()
                else:
                    w.wait(release=False)
            if self._finish is not None:
                self._finish()
        except Exception as e:  # noqa: BLE001  (raised here and by every later wait)
            self._error = e
            raise
        self._event = torch.cuda.Event()
        self._event.record(stream)
        self._held.add(self._event, (self._works, self._finish))
        self._works = self._finish = None

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        self._order()
        return True

    def synchronize(self) -> None:
        self._order()
        self._event.synchronize()

    def is_completed(self) -> bool:
        if self._error is not None:
            return True
        if self._event is None:
            if not all(w.is_completed() for w in self._works):
                return False
            with torch.cuda.stream(self._groups.side_stream()):
                self._order()
        return self._event.query()

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self._order()
        return self._result

    def get_future(self) -> Future:
        """A CUDA-aware future, complete at once: its value is ready on a stream that waits on it.
        The call is waited for on a side stream, so the current one is not held up (DDP's
        reducer overlaps its backward with the all-reduces this way)."""
        if self._fut is None:
            fut = Future(devices=[self.device])
            with torch.cuda.stream(self._groups.side_stream()):
                self._order()
                fut.set_result(self._result)
            self._fut = fut
        return self._fut


# ---------------------------------------------------------------------------
# Point-to-point calls on CUDA tensors
#
# [Note: CUDA point-to-point is batched]
# On the GPU a group's calls run one after another on its stream, and a send completes only once
# its receive runs (NCCL's rule, which the ipc transport keeps). torch's batch_isend_irecv hands a
# backend that is not NCCL its sends and receives one by one, so issued as they come, a ring step
# (every rank sends to the next, then receives from the previous) would wait in a cycle. So the
# sends and receives of CUDA tensors queue up (P2PQueue) and are issued together, as one
# batch_isend_irecv of pyzero (one kernel that progresses all of them), when one of their works is
# waited for (wait, synchronize, is_completed, get_future, result), when the group makes any other
# call on CUDA tensors (so calls keep their order), or when MAX_BATCH of them are queued. A send
# whose work is never waited for and after which the group makes no CUDA call is never issued:
# wait for every isend and irecv, as torch's NCCL backend also asks before their tensors are used
# again. all_to_all, gather and scatter queue their messages and issue them at once.


class P2PEntry:
    """One queued send or receive: the buffer pyzero carries, the peer's global rank, the copy-back
    into the caller's tensor (receives of staged dtypes), and what the call's work returns."""

    def __init__(self, group: comm.Group, buf: torch.Tensor, peer: int, is_send: bool, finish, result):
        self.group, self.buf, self.peer, self.is_send = group, buf, peer, is_send
        self.finish, self.result = finish, result


class P2PQueue:
    """The queued CUDA sends and receives of one torch group (see [Note: CUDA point-to-point is
    batched]). `issue(entries)` issues them as one batch and returns its dist.Work."""

    def __init__(self, issue, limit: int = MAX_BATCH):
        self.issue, self.limit = issue, limit
        self.pending: list[P2PEntry] = []
        self.works: list[QueuedWork] = []

    def add(self, entry: P2PEntry) -> "QueuedWork":
        w = QueuedWork(self, entry.result, entry.buf.device)
        self.pending.append(entry)
        self.works.append(w)
        if len(self.pending) >= self.limit:
            self.flush()
        return w

    def flush(self) -> None:
        """Issue what is queued (a failure is raised here and by every one of its works)."""
        if not self.pending:
            return
        entries, works = self.pending, self.works
        self.pending, self.works = [], []
        try:
            real = self.issue(entries)
        except Exception as e:  # noqa: BLE001
            for w in works:
                w.error = e
            raise
        for w in works:
            w.real = real


class QueuedWork(dist.Work):
    """The work of a queued send or receive: the first use issues the queue, then it is the batch's."""

    def __init__(self, queue: P2PQueue, result, device):
        super().__init__()
        self.queue, self._result, self.device = queue, result, device
        self.real: dist.Work | None = None
        self.error: Exception | None = None

    def _issued(self) -> dist.Work:
        if self.real is None and self.error is None:
            self.queue.flush()
        if self.error is not None:
            raise self.error
        return self.real

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        return self._issued().wait(timeout)

    def synchronize(self) -> None:
        self._issued().synchronize()

    def is_completed(self) -> bool:
        if self.error is not None:
            return True
        return self._issued().is_completed()

    def is_success(self) -> bool:
        return self.is_completed() and self.error is None and self.real.is_success()

    def exception(self):
        return self.error if self.error is not None else self._issued().exception()

    def result(self):
        self._issued().wait()
        return self._result

    def get_future(self) -> Future:
        real = self._issued()
        return real.get_future().then(lambda _: self._result)
