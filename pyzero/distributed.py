"""pyzero as a torch.distributed backend: ``dist.init_process_group("pyzero")``.

``import pyzero`` registers the backend "pyzero" with
``torch.distributed.Backend.register_backend`` (cheap: no process-group work
happens until torch creates a group). Every torch process group on it, the
world and each ``dist.new_group`` / DeviceMesh subgroup, is a
:class:`ProcessGroupPyzero` over its own pyzero group on the shm transport,
set up over the store torch gives the group (:func:`pyzero.comm.group_from_store`).

The creator returns a ``ProcessGroup`` subclass, not a c10d ``Backend``:
torch's ``Backend`` has no constructor reachable from Python, and torch takes
a ``ProcessGroup`` from a creator as the whole group. torch calls the methods
below with lists of tensors and an options struct; each becomes one or more
pyzero collectives on contiguous buffers of a dtype pyzero carries (a staging
copy otherwise: see :func:`_stage`), asynchronous unless the options say the
caller waits at once, and returns a :class:`PyzeroWork`. Ranks in the
options (``rootRank``, ``dstRank``) are group ranks; the pyzero group's
``ranks`` are the torch global ranks, so they are translated once here.

CUDA tensors go to pyzero's GPU transports (ipc where the group's ranks share
a host, nccl across hosts, both by message size where both run: see
:mod:`pyzero.distributed_cuda`), with torch's NCCL work semantics, unless the
device map names another backend for them (``"cpu:pyzero,cuda:nccl"``): torch
hands the whole group to this class, so it keeps that backend beside it (see
:meth:`ProcessGroupPyzero._other`).
"""
from __future__ import annotations

import datetime
import os
import queue
import threading

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torch.futures import Future

from . import comm
from .backend import DTYPES, SUPPORTED_DTYPES
from .distributed_cuda import CudaGroups, CudaWork, Held, P2PEntry, P2PQueue, QueuedWork
from .checks import is_int

__all__ = ["NAME", "ProcessGroupPyzero", "PyzeroWork", "cuda_backend_beside", "default_torch_backend", "init_torch",
           "pz_group", "register"]

NAME = "pyzero"

_OPS = {ReduceOp.SUM: "sum", ReduceOp.AVG: "avg", ReduceOp.MIN: "min", ReduceOp.MAX: "max",
        ReduceOp.PRODUCT: "prod", ReduceOp.PREMUL_SUM: "sum", ReduceOp.BAND: "band", ReduceOp.BOR: "bor",
        ReduceOp.BXOR: "bxor"}
# Bitwise reductions pyzero's core has no code for: an all_gather, reduced here with torch's function.
_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}
# Dtypes pyzero has no code for, carried as a wider one (exact for every value of the narrow type).
_WIDEN = {torch.bool: torch.int32, torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32}
_NO_TIMEOUT = datetime.timedelta(0)
_OPTIONS = torch._C._distributed_c10d  # the option structs, for calls that pass none


def cuda_backend_beside(gpu_backend: str) -> str:
    """torch's backend for CUDA tensors in a job whose pyzero GPU backend is `gpu_backend`: "pyzero"
    beside ipc (processes that may share a GPU, which NCCL refuses; its CUDA collectives then run on
    pyzero's ipc transport), torch's "nccl" beside nccl (a GPU per process)."""
    if gpu_backend not in ("ipc", "nccl"):
        raise ValueError(f"gpu_backend={gpu_backend!r}: expected 'ipc' or 'nccl'")
    return NAME if gpu_backend == "ipc" else "nccl"


def default_torch_backend() -> str:
    """torch's backend for a job pyzero runs: CPU tensors on gloo; CUDA tensors on torch's NCCL beside
    pyzero's nccl backend (a GPU per process), on "pyzero" beside its ipc backend (processes that may
    share a GPU, which NCCL refuses)."""
    backend = comm.get_backend()
    return f"cpu:gloo,cuda:{cuda_backend_beside(backend)}" if backend in ("ipc", "nccl") else "gloo"


def init_torch(torch_backend: str | None = None) -> None:
    """Start torch.distributed beside pyzero, on the job pyzero runs (its store, so no second port;
    its ranks and timeout), for torch code that needs a default process group: ``nn.SyncBatchNorm``,
    metrics and barriers of a framework. Call it after ``pz.init()``. At world size 1 only under a
    launcher (WORLD_SIZE set: accelerate then starts torch.distributed itself, on MASTER_PORT, which
    pyzero's store holds); a plain process needs none.
    ``torch_backend``: default :func:`default_torch_backend`. If torch.distributed is already up, it
    must describe the same job."""
    if not comm.is_initialized():
        raise RuntimeError("init_torch(): pyzero is not initialised: call pz.init() first")
    world, rank = comm.get_world_size(), comm.get_rank()
    if world == 1 and "WORLD_SIZE" not in os.environ:
        return
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (world, rank):
            raise RuntimeError(f"init_torch(): torch.distributed has rank {dist.get_rank()} of "
                               f"{dist.get_world_size()}, pyzero rank {rank} of {world}; both must describe the "
                               "same job")
        return
    if torch_backend is None:
        torch_backend = default_torch_backend()
    dist.init_process_group(torch_backend, store=dist.PrefixStore("torch/", comm.get_store()), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=comm.get_timeout()))


def register() -> None:
    """Register the "pyzero" backend with torch.distributed (idempotent; ``import pyzero`` calls it)."""
    if NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(NAME, _create, extended_api=True, devices=["cpu", "cuda"])


def _create(opts, backend_options):
    ranks = list(opts.global_ranks_in_group) or list(range(opts.group_size))  # [] for the world group
    return ProcessGroupPyzero(opts.store, opts.group_rank, opts.group_size, opts.timeout, ranks,
                              options=backend_options)


def pz_group(pg) -> comm.Group:
    """The pyzero group under torch process group `pg` (None: the default group), for pz.* calls."""
    pg = pg if pg is not None else dist.group.WORLD
    if not isinstance(pg, ProcessGroupPyzero):
        raise TypeError(f"pg: expected a process group of the {NAME!r} backend, got {type(pg).__name__}")
    return pg.group


# ---------------------------------------------------------------------------
# Work


class PyzeroWork(dist.Work):
    """One torch call's pyzero works, then `finish` (copies out of staging buffers).

    The works keep their tensors alive until complete. ``get_future()`` on
    an unfinished work hands it to the group's completion thread, so that a
    caller waiting only on the future (DDP's reducer) sees it complete.
    """

    def __init__(self, works, result, finish=None, completer=None):
        super().__init__()
        self._works = [w for w in works if w is not None]  # None: a synchronous call, already done
        # (a call whose works are all synchronous gets a _DoneWork instead: see ProcessGroupPyzero._work)
        self._result = result  # the future's value: the output tensors
        self._finish = finish
        self._completer = completer
        self._fut: Future | None = None
        self._lock = threading.Lock()
        self._done = False
        self._error: Exception | None = None

    def _complete(self) -> None:
        with self._lock:
            if not self._done:
                try:
                    for w in self._works:
                        w.wait()
                    if self._finish is not None:
                        self._finish()
                except Exception as e:  # noqa: BLE001  (handed to the waiter and the future)
                    self._error = e
                self._done = True
                self._works = self._finish = None
                if self._fut is not None:
                    self._settle()
        if self._error is not None:
            raise self._error

    def _settle(self) -> None:
        if self._error is not None:
            self._fut.set_exception(self._error)
        else:
            self._fut.set_result(self._result)

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        self._complete()
        return True

    def synchronize(self) -> None:
        self._complete()

    def is_completed(self) -> bool:
        if not self._done and all(w.is_completed() for w in self._works or ()):
            try:
                self._complete()
            except Exception:  # noqa: BLE001  (reported by wait() and the future)
                pass
        return self._done

    def is_success(self) -> bool:
        return self.is_completed() and self._error is None

    def exception(self):
        return self._error

    def result(self):
        self._complete()
        return self._result

    def get_future(self) -> Future:
        inline = False
        with self._lock:
            if self._fut is None:
                self._fut = Future()
                if self._done:
                    self._settle()
                elif self._completer.on_its_thread():
                    # A then() callback that the completer runs, asking for another work's future (DDP's
                    # PowerSGD hook waits on one there): queued behind the callback, it would never run.
                    inline = True
                else:
                    self._completer.put(self)
        if inline:
            try:
                self._complete()
            except Exception:  # noqa: BLE001  (set on the future by _complete)
                pass
        return self._fut


class _DoneWork(dist.Work):
    """The work of a synchronous call, complete when returned (most torch callers wait at once):
    none of PyzeroWork's state, so returning it costs a third as much."""

    def __init__(self, result):
        super().__init__()
        self._result = result

    def wait(self, timeout: datetime.timedelta = _NO_TIMEOUT) -> bool:
        return True

    def synchronize(self) -> None:
        pass

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def exception(self):
        return None

    def result(self):
        return self._result

    def get_future(self) -> Future:
        fut = Future()
        fut.set_result(self._result)
        return fut


class _DoneCudaWork(_DoneWork):
    """The work of a synchronous call on CUDA tensors: already ordered on the current stream."""

    def __init__(self, result, device: torch.device):
        super().__init__(result)
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.current_stream(self.device).synchronize()

    def is_completed(self) -> bool:
        return torch.cuda.current_stream(self.device).query()

    def get_future(self) -> Future:
        fut = Future(devices=[self.device])
        fut.set_result(self._result)
        return fut


class _Completer:
    """A daemon thread that completes the works whose futures someone waits on, in issue order."""

    def __init__(self):
        self._q: queue.SimpleQueue | None = None
        self._thread: threading.Thread | None = None

    def on_its_thread(self) -> bool:
        """Whether the caller is this completer's thread (a future's callback it runs)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def put(self, work: PyzeroWork) -> None:
        if self._q is None:
            self._q = queue.SimpleQueue()
            self._thread = threading.Thread(target=self._run, args=(self._q,), name="pyzero-completer", daemon=True)
            self._thread.start()
        self._q.put(work)

    @staticmethod
    def _run(q) -> None:
        while (work := q.get()) is not None:
            try:
                work._complete()
            except Exception:  # noqa: BLE001  (set on the work's future by _complete)
                pass

    def close(self) -> None:
        if self._q is not None:
            self._q.put(None)
            self._q = None


# ---------------------------------------------------------------------------
# Argument handling


def _one(tensors, op: str, arg: str) -> torch.Tensor:
    if len(tensors) != 1:
        raise ValueError(f"{op}: {arg} must hold exactly one tensor (one device per process), got {len(tensors)}")
    return tensors[0]


def _stage(t: torch.Tensor, op: str, arg: str, copy_in: bool = True):
    """(`t` as a buffer pyzero can carry, a function copying the buffer back into `t` or None).

    Complex tensors travel as their real view; bool/int8/uint8/int16 widened to int32 (exact, and
    sum/min/max/prod of the widened values narrow back as torch's own would for bool/uint8's
    wrap-around); non-contiguous tensors through a contiguous copy."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {arg}: expected a torch.Tensor, got {type(t).__name__}")
    try:
        if t.is_cpu and t.dtype in DTYPES and t.is_contiguous():  # the common case, checked first
            return t, None
    except RuntimeError:  # (sparse compressed layouts have no is_contiguous: refused below)
        pass
    if t.layout != torch.strided:
        raise TypeError(f"{op}: {arg} is a {t.layout} tensor, which the {NAME!r} backend cannot carry; expected "
                        "a dense (torch.strided) tensor (.to_dense())")
    if t.device.type not in ("cpu", "cuda"):
        raise ValueError(f"{op}: {arg}: the {NAME!r} backend carries CPU and CUDA tensors, got one on {t.device} "
                         f"(map that device to another backend, e.g. 'cpu:{NAME},{t.device.type}:<backend>')")
    base = torch.view_as_real(t) if t.is_complex() else t
    if base.dtype in DTYPES and base.is_contiguous():
        return base, None
    dtype = base.dtype if base.dtype in DTYPES else _WIDEN.get(base.dtype)
    if dtype is None:
        raise TypeError(f"{op}: {arg} has dtype {t.dtype}, which the {NAME!r} backend cannot carry; expected "
                        f"one of {SUPPORTED_DTYPES}, bool, int8, uint8, int16 or a complex dtype")
    buf = torch.empty(base.shape, dtype=dtype, device=base.device)
    if copy_in:
        buf.copy_(base)
    return buf, (lambda: base.copy_(buf))


# send/recv only move bytes: a dtype pyzero has no code for (uint16/32/64, float8) travels as one of its size
_BITS = {2: torch.float16, 4: torch.int32, 8: torch.int64}


def _stage_bytes(t: torch.Tensor, op: str, arg: str, copy_in: bool = True):
    """_stage for send/recv, which also carry every other dtype bit for bit (as gloo does)."""
    if not isinstance(t, torch.Tensor) or t.device.type not in ("cpu", "cuda") or t.is_complex() or t.dtype in DTYPES \
            or t.dtype in _WIDEN:
        return _stage(t, op, arg, copy_in)
    carrier = _BITS.get(t.element_size(), torch.uint8)  # 1-byte dtypes as uint8 (widened by _stage)
    if t.is_contiguous():
        return _stage(t.view(carrier), op, arg, copy_in)
    dense = t.contiguous() if copy_in else torch.empty(t.shape, dtype=t.dtype, device=t.device)
    buf, back = _stage(dense.view(carrier), op, arg, copy_in)
    return buf, _chain(back, lambda: t.copy_(dense))


def _reduction_error(kind, op: str, dtype: torch.dtype) -> str | None:
    """Why reduce op `kind` (a ReduceOp.RedOpType) cannot reduce `dtype` here, or None."""
    name = _OPS.get(kind)
    if name is None:
        return f"{op}: reduce op {kind} is not supported by the {NAME!r} backend; expected SUM, AVG, MIN, MAX, " \
               "PRODUCT, PREMUL_SUM, BAND, BOR or BXOR"
    if dtype.is_complex and name not in ("sum", "avg"):
        return f"{op}: reduce op {kind} is not defined for complex tensors ({dtype})"
    if name == "avg" and not (dtype.is_floating_point or dtype.is_complex):
        return f"{op}: ReduceOp.AVG needs a floating-point tensor, got {dtype} (use SUM and divide)"
    if kind == ReduceOp.PREMUL_SUM and not (dtype.is_floating_point or dtype.is_complex):
        return f"{op}: ReduceOp.PREMUL_SUM needs a floating-point tensor, got {dtype}"
    if name in _BITWISE and (dtype.is_floating_point or dtype.is_complex):
        return f"{op}: reduce op {kind} needs an integer or bool tensor, got {dtype}"
    return None


# (int(op), dtype) -> (pyzero's op name, whether it is PREMUL_SUM) for every valid pair: the common case
# is one lookup keyed by ints (hashing and comparing torch's op enums costs about a microsecond).
_REDUCTIONS = {(int(kind), dtype): (_OPS[kind], kind == ReduceOp.PREMUL_SUM)
               for kind in _OPS for dtype in [*DTYPES, *_WIDEN, torch.complex64, torch.complex128]
               if _reduction_error(kind, "", dtype) is None}


_SUM = ReduceOp.SUM


def _reduction(reduce_op, op: str, t: torch.Tensor):
    """(pyzero's op name, None) of torch's `reduce_op` on `t`; for the ops pyzero's core lacks, the second
    item is PREMUL_SUM's factor (applied before a sum) or BAND/BOR/BXOR's torch function."""
    if reduce_op == _SUM and t.dtype in DTYPES:  # the common case: one comparison of torch's enums
        return "sum", None
    kind = reduce_op.op if isinstance(reduce_op, ReduceOp) else reduce_op
    found = _REDUCTIONS.get((int(kind), t.dtype))
    if found is None:
        error = _reduction_error(kind, op, t.dtype)
        if error is not None:
            raise ValueError(error)
        found = (_OPS[kind], kind == ReduceOp.PREMUL_SUM)  # a dtype pyzero cannot carry: _stage says so
    name, premul = found
    return name, (_premul_factor(reduce_op) if premul else _BITWISE.get(name))


def _premul_factor(reduce_op) -> float:
    """PREMUL_SUM's factor: `.factor` on torch >= 2.13, the second item of the op's state before."""
    factor = getattr(reduce_op, "factor", None)
    return reduce_op.__getstate__()[1] if factor is None else factor


def _chain(*fns):
    fns = [f for f in fns if f is not None]
    if not fns:
        return None
    if len(fns) == 1:
        return fns[0]

    def run():
        for f in fns:
            f()
    return run


# ---------------------------------------------------------------------------
# The process group


class ProcessGroupPyzero(dist.ProcessGroup):
    """A torch ProcessGroup whose CPU collectives run on a pyzero group (shm transport), and its CUDA
    collectives on pyzero's GPU transports (made on the first one: :class:`pyzero.distributed_cuda.CudaGroups`)."""

    def __init__(self, store, rank: int, size: int, timeout: datetime.timedelta, ranks, options=None):
        super().__init__(rank, size)
        self._store = store
        self._timeout = timeout
        self._options = options
        # (CPU tensors: shm where the group's ranks share a host, hier across hosts)
        self.group = comm.group_from_store(store, ranks, rank, timeout.total_seconds(), options, backend="cpu")
        self._completer = _Completer()
        # device type -> the torch backend the device map names for it, or None where pyzero carries it
        self._others: dict = {}
        self.cuda: CudaGroups | None = None  # the pyzero GPU groups, made on the first CUDA collective
        self._held = Held()  # what waited CUDA works reference until the GPU has passed the wait
        self._group_name = self._group_desc = ""
        self._coalesced: list | None = None  # works issued between _start_coalescing and _end_coalescing
        # CUDA sends and receives, issued together (see [Note: CUDA point-to-point is batched])
        self._queue = P2PQueue(self._issue_p2p)

    # ---- identity ----

    def getBackendName(self) -> str:  # noqa: N802  (torch's name)
        return NAME

    def name(self) -> str:
        return NAME

    # torch keeps a group's name and description on its backends; this group has none of torch's
    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._group_name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._group_name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._group_desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._group_desc

    def __repr__(self) -> str:
        return f"ProcessGroupPyzero(rank={self.rank()}, size={self.size()}, ranks={list(self.group.ranks)})"

    def shutdown(self) -> None:
        """dist.destroy_process_group(): finish queued work, free the shared memory and any other backend."""
        self._completer.close()
        self.group.close()
        if self.cuda is not None:
            self._held.clear()
            self.cuda.close()
            self.cuda = None
        for be in self._others.values():
            if be is not None:
                be.shutdown()
        self._others.clear()

    # ---- helpers ----

    def _work(self, works, result, finish=None, like=None) -> dist.Work:
        """The work of a call whose pyzero works are `works`; `like`: a tensor of the call (CUDA works
        for a CUDA tensor)."""
        if like is not None and like.is_cuda:
            return self._cuda_work(works, result, finish, like.device)
        if all(w is None for w in works):  # every call synchronous: done
            if finish is not None:
                finish()
            work = _DoneWork(result)
        else:
            work = PyzeroWork(works, result, finish, self._completer)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _start_coalescing(self, device) -> None:
        """Ops until _end_coalescing run as issued; _end_coalescing's work waits for all of them."""
        self._coalesced = []

    def _cuda_work(self, works, result, finish, device) -> dist.Work:
        if all(w is None for w in works):  # synchronous: ordered on the current stream
            if finish is not None:
                finish()
            work = _DoneCudaWork(result, device)
        else:
            work = CudaWork(works, result, finish, device, self.cuda, self._held)
        if self._coalesced is not None:
            self._coalesced.append(work)
        return work

    def _end_coalescing(self, device) -> dist.Work:
        works, self._coalesced = self._coalesced or [], None
        self._queue.flush()  # (sends and receives of the block: one batch)
        pending = [w for w in works if isinstance(w, (CudaWork, QueuedWork))]
        if pending:  # the current stream waits for all of them
            return CudaWork(works, [], None, pending[0].device, self.cuda, self._held)
        return self._work(works, [])

    def _global(self, group_rank: int, op: str, arg: str) -> int:
        if not 0 <= group_rank < self.group.size:
            raise ValueError(f"{op}: {arg}={group_rank}: expected a rank of the group in [0, {self.group.size})")
        return self.group.ranks[group_rank]

    def _other(self, t, method: str, *args):
        """Run `method` on the backend the device map names for `t`'s device, or None where pyzero
        carries `t` (CPU tensors; CUDA tensors mapped to "pyzero")."""
        if not isinstance(t, torch.Tensor) or t.is_cpu:
            return None
        kind = t.device.type
        be = self._others.get(kind, False)
        if be is False:
            be = self._others[kind] = self._make_other(kind, t)
        if be is None:
            return None
        return getattr(be, method)(*args)

    def _make_other(self, kind: str, t):
        config = str(dist.get_backend_config(self))
        mapping = dict(part.split(":", 1) for part in config.split(",") if ":" in part)
        name = mapping.get(kind)
        if kind == "cuda" and name == NAME:
            return None
        if name in (None, NAME):
            raise ValueError(f"the {NAME!r} backend carries CPU and CUDA tensors, got one on {t.device}; map "
                             f"that device to another backend, e.g. init_process_group('cpu:{NAME},{kind}:<backend>')")
        store = dist.PrefixStore(f"{kind}-{name}/", self._store)
        if name == "nccl":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self._timeout
            return dist.ProcessGroupNCCL(store, self.rank(), self.size(), opts)
        if name == "gloo":
            return dist.ProcessGroupGloo(store, self.rank(), self.size(), self._timeout)
        raise ValueError(f"device map {config!r}: backend {name!r} for {kind} tensors beside {NAME!r} is not "
                         "supported; expected nccl or gloo")

    def _pz(self, buf, nbytes: int | None = None) -> comm.Group:
        """The pyzero group for buffer `buf`: the shm group for CPU tensors, else the GPU group for a
        call of `nbytes` (default: buf's), made on the first CUDA collective; queued CUDA sends and
        receives are issued first (calls keep their order)."""
        if buf.is_cpu:
            return self.group
        self._queue.flush()
        if self.cuda is None:
            self.cuda = CudaGroups(dist.PrefixStore("cuda-pyzero/", self._store), self.group.ranks, self.group.rank,
                                   self._timeout.total_seconds(), self._options, buf.device.index)
        return self.cuda.group(buf.numel() * buf.element_size() if nbytes is None else nbytes)

    def _p2p(self, buf, op: str, collective: bool) -> comm.Group:
        """The pyzero group for point-to-point messages of `buf` (send, recv, and what gather, scatter
        and all_to_all send): the shm group for CPU tensors; for CUDA ones the GPU transport's
        (ipc on one host, else nccl), which a `collective` call may make (a send or recv cannot, as
        only two ranks call it)."""
        if buf.is_cpu:
            return self.group
        if self.cuda is None:
            if not collective:
                raise NotImplementedError(
                    f"{op}: the first call on CUDA tensors of a {NAME!r} group must be a collective (every rank "
                    "of the group makes its GPU transport then, e.g. a barrier or an all_reduce); point-to-point "
                    "calls on CUDA tensors run after one")
            self._pz(buf)
        return self.cuda.p2p(op)

    def _queued(self, entries, flush: bool):
        """Queue CUDA sends and receives (see [Note: CUDA point-to-point is batched]); `flush`: issue
        them now (a call whose messages form one batch). The work of the last entry."""
        works = [self._queue.add(e) for e in entries]
        if flush:
            self._queue.flush()
        if self._coalesced is not None:
            self._coalesced.extend(works)
        return works[-1]

    def _issue_p2p(self, entries) -> dist.Work:
        """One pyzero batch_isend_irecv of queued entries; its CUDA work runs their copy-backs."""
        ops = [comm.P2POp("send" if e.is_send else "recv", e.buf, e.peer, e.group) for e in entries]
        works = comm.batch_isend_irecv(ops)
        return CudaWork(works[:1], [], _chain(*(e.finish for e in entries)), entries[0].buf.device, self.cuda,
                        self._held)

    def _alone(self, t) -> bool:
        """A synchronous reduction of `t` in place is done already: the group has one rank, and `t` is a
        tensor pyzero carries as it is, on the CPU or on the GPU this group's CUDA calls use (the first
        CUDA call makes and checks those). Nothing is issued then; the call is ordered on the current
        stream like any synchronous call (NCCL's one-rank in-place call launches nothing either)."""
        if self.group.size != 1 or not isinstance(t, torch.Tensor) or t.dtype not in DTYPES:
            return False
        on_ours = t.is_cpu or (self.cuda is not None and t.device.index == self.cuda.device)
        return t.layout == torch.strided and on_ours

    def _allreduce_one(self, t, reduce_op, op: str, arg: str, async_op: bool):
        """(pyzero work or None when done, copy-back) reducing `t` in place."""
        name, extra = _reduction(reduce_op, op, t)
        if extra is not None:
            return self._allreduce_special(t, name, extra, op, arg, async_op)
        buf, back = _stage(t, op, arg)
        return comm.all_reduce(buf, name, self._pz(buf), async_op=async_op), back

    def _allreduce_special(self, t, name: str, extra, op: str, arg: str, async_op: bool):
        """_allreduce_one for PREMUL_SUM (`extra` the factor) and the bitwise ops (`extra` torch's function)."""
        if name in _BITWISE:
            result = self._bitwise(t, extra, op, arg)
            return None, (lambda: t.copy_(result))
        buf, back = _stage(t, op, arg)
        buf.mul_(extra)
        return comm.all_reduce(buf, name, self._pz(buf), async_op=async_op), back

    def _bitwise(self, t, fn, op: str, arg: str) -> torch.Tensor:
        """fn (torch.bitwise_and/or/xor) over every rank's `t`, elementwise, as a new tensor of t's shape:
        one all_gather, reduced here (synchronous)."""
        rows = torch.empty((self.group.size, t.numel()), dtype=t.dtype, device=t.device)
        issue, back = self._all_gather_flat(rows, t.reshape(-1), op, False)
        issue()
        if back is not None:
            back()
        out = rows[0].clone()
        for row in rows[1:]:
            fn(out, row, out=out)
        return out.view(t.shape)

    # ---- all_reduce ----

    def allreduce(self, tensors, opts=None):
        opts = _OPTIONS.AllreduceOptions() if opts is None else opts
        t = _one(tensors, "allreduce", "tensors")
        if (w := self._other(t, "allreduce", tensors, opts)) is not None:
            return w
        name, extra = _reduction(opts.reduceOp, "allreduce", t)
        if extra is None and not opts.asyncOp and self._alone(t):
            return self._work([None], tensors, None, t)
        if extra is not None:  # PREMUL_SUM, BAND, BOR, BXOR
            work, back = self._allreduce_special(t, name, extra, "allreduce", "tensors[0]", opts.asyncOp)
            return self._work([work], tensors, back, t)
        buf, back = _stage(t, "allreduce", "tensors[0]")
        if buf.is_cpu:
            return self._work([comm.all_reduce(buf, name, self.group, async_op=opts.asyncOp)], tensors, back)
        return self._work([comm.all_reduce(buf, name, self._pz(buf), async_op=opts.asyncOp)], tensors, back, t)

    def allreduce_coalesced(self, tensors, opts=None):
        opts = _OPTIONS.AllreduceCoalescedOptions() if opts is None else opts
        if not tensors:
            return self._work([], [])
        if (w := self._other(tensors[0], "allreduce_coalesced", tensors, opts)) is not None:
            return w
        dtypes = {t.dtype for t in tensors}
        name, factor = _reduction(opts.reduceOp, "allreduce_coalesced", tensors[0])
        if len(dtypes) == 1 and factor is None:  # one flat message for all of them
            flat = torch.cat([t.reshape(-1) for t in tensors])
            buf, back = _stage(flat, "allreduce_coalesced", "tensors")

            def finish():
                if back is not None:
                    back()
                for t, part in zip(tensors, flat.split([t.numel() for t in tensors])):
                    t.copy_(part.view(t.shape))
            return self._work([comm.all_reduce(buf, name, self._pz(buf), async_op=opts.asyncOp)], tensors, finish,
                              flat)
        works, backs = [], []
        for i, t in enumerate(tensors):
            work, back = self._allreduce_one(t, opts.reduceOp, "allreduce_coalesced", f"tensors[{i}]", opts.asyncOp)
            works.append(work)
            backs.append(back)
        return self._work(works, tensors, _chain(*backs), tensors[0])

    # ---- all_gather ----

    def _all_gather_flat(self, out, inp, op: str, async_op: bool, counts=None):
        """(a function issuing pz.all_gather of `inp` into `out`, any layout, returning its work; the
        copy-back). Every argument is checked before anything is issued."""
        if out.dtype != inp.dtype:
            raise TypeError(f"{op}: output dtype {out.dtype} does not match input dtype {inp.dtype}")
        bo, back = _stage(out, op, "output", copy_in=False)
        bi, _ = _stage(inp, op, "input")
        g = self._pz(bo)  # the whole output's size: the same on every rank
        return lambda: comm.all_gather(bo, bi, counts=counts, group=g, async_op=async_op), back

    def all_gather_single(self, output, input, opts=None):
        opts = _OPTIONS.AllgatherOptions() if opts is None else opts
        if (w := self._other(input, "_allgather_base", output, input, opts)) is not None:
            return w
        issue, back = self._all_gather_flat(output, input, "all_gather_single", opts.asyncOp)
        return self._work([issue()], [output], back, output)

    _allgather_base = all_gather_single

    def allgather(self, output_tensors, input_tensors, opts=None):
        opts = _OPTIONS.AllgatherOptions() if opts is None else opts
        inp = _one(input_tensors, "allgather", "input_tensors")
        if (w := self._other(inp, "allgather", output_tensors, input_tensors, opts)) is not None:
            return w
        outs = _one(output_tensors, "allgather", "output_tensors")
        if inp.is_complex():  # counts below are of real elements
            inp, outs = torch.view_as_real(inp), [torch.view_as_real(o) for o in outs]
        if len(outs) != self.group.size:
            raise ValueError(f"allgather: output_tensors[0] must hold {self.group.size} tensors (one per rank), "
                             f"got {len(outs)}")
        counts = [o.numel() for o in outs]
        flat = torch.empty(sum(counts), dtype=inp.dtype, device=inp.device)  # uneven sizes allowed: counts per rank

        def finish():
            for o, part in zip(outs, flat.split(counts)):
                o.copy_(part.view(o.shape))
        issue, back = self._all_gather_flat(flat, inp.reshape(-1), "allgather", opts.asyncOp, counts)
        return self._work([issue()], output_tensors, _chain(back, finish), inp)

    def all_gather_single_coalesced(self, outputs, inputs, opts=None):
        opts = _OPTIONS.AllgatherOptions() if opts is None else opts
        if inputs and (w := self._other(inputs[0], "allgather_into_tensor_coalesced", outputs, inputs, opts)) \
                is not None:
            return w
        calls = [self._all_gather_flat(o, i, "allgather_into_tensor_coalesced", opts.asyncOp)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._work([issue() for issue, _ in calls], outputs, _chain(*(back for _, back in calls)),
                          outputs[0] if outputs else None)

    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, output_lists, input_list, opts=None):
        """output_lists[r][i] receives rank r's input_list[i]: one all_gather of every rank's inputs
        end to end (each rank's total may differ)."""
        opts = _OPTIONS.AllgatherOptions() if opts is None else opts
        if input_list and (w := self._other(input_list[0], "allgather_coalesced", output_lists, input_list,
                                            opts)) is not None:
            return w
        op, n = "allgather_coalesced", self.group.size
        if len(output_lists) != n:
            raise ValueError(f"{op}: output_tensor_lists must hold {n} lists (one per rank), got {len(output_lists)}")
        for r, outs in enumerate(output_lists):
            if len(outs) != len(input_list):
                raise ValueError(f"{op}: output_tensor_lists[{r}] must hold {len(input_list)} tensors (one per "
                                 f"input tensor), got {len(outs)}")
            for i, (o, t) in enumerate(zip(outs, input_list)):
                if o.dtype != t.dtype:
                    raise TypeError(f"{op}: output_tensor_lists[{r}][{i}] has dtype {o.dtype}, input_tensor_list[{i}] "
                                    f"{t.dtype}")
                if r == self.group.rank and o.numel() != t.numel():
                    raise ValueError(f"{op}: output_tensor_lists[{r}][{i}] holds {o.numel()} elements, this rank's "
                                     f"input_tensor_list[{i}] {t.numel()}")
        if not input_list:
            return self._work([], output_lists)
        real = [torch.view_as_real(t) if t.is_complex() else t for t in input_list]  # counts of real elements
        outs = [[torch.view_as_real(o) if o.is_complex() else o for o in row] for row in output_lists]
        sizes = [[o.numel() for o in row] for row in outs]
        counts = [sum(row) for row in sizes]
        if len({t.dtype for t in real}) != 1:
            raise TypeError(f"{op}: input_tensor_list must hold tensors of one dtype, got {[t.dtype for t in real]}")
        flat = torch.empty(sum(counts), dtype=real[0].dtype, device=real[0].device)

        def finish():
            for row, row_sizes, part in zip(outs, sizes, flat.split(counts)):
                for o, piece in zip(row, part.split(row_sizes)):
                    o.copy_(piece.view(o.shape))
        issue, back = self._all_gather_flat(flat, torch.cat([t.reshape(-1) for t in real]), op, opts.asyncOp, counts)
        return self._work([issue()], output_lists, _chain(back, finish), flat)

    # ---- reduce_scatter ----

    def _reduce_scatter_flat(self, out, inp, reduce_op, op: str, async_op: bool, counts=None):
        """As _all_gather_flat, for pz.reduce_scatter of `inp` into `out`."""
        if out.dtype != inp.dtype:
            raise TypeError(f"{op}: output dtype {out.dtype} does not match input dtype {inp.dtype}")
        name, factor = _reduction(reduce_op, op, inp)
        if name in _BITWISE:
            return self._bitwise_scatter(out, inp, factor, op, counts), None
        bo, back = _stage(out, op, "output", copy_in=False)
        if factor is not None:
            bi = _stage(inp.mul(factor), op, "input")[0]  # the caller's input stays as it was
        else:
            bi = _stage(inp, op, "input")[0]
        g = self._pz(bi)  # the whole input's size: the same on every rank
        return lambda: comm.reduce_scatter(bo, bi, name, counts=counts, group=g, async_op=async_op), back

    def _bitwise_scatter(self, out, inp, fn, op: str, counts):
        """The issue function of a bitwise reduce_scatter: this rank's chunk of _bitwise over `inp`."""
        n, me = self.group.size, self.group.rank
        counts = [out.numel()] * n if counts is None else counts
        if sum(counts) != inp.numel() or counts[me] != out.numel():
            raise ValueError(f"{op}: input holds {inp.numel()} elements and output {out.numel()}; expected "
                             f"{sum(counts)} and {counts[me]} (chunks of {counts} elements, one per rank)")
        _stage(out, op, "output", copy_in=False)  # checks the output's dtype and device before anything is issued

        def issue():
            whole = self._bitwise(inp, fn, op, "input").reshape(-1)
            start = sum(counts[:me])
            out.copy_(whole[start:start + out.numel()].view(out.shape))
        return issue

    def reduce_scatter_single(self, output, input, opts=None):
        opts = _OPTIONS.ReduceScatterOptions() if opts is None else opts
        if (w := self._other(input, "_reduce_scatter_base", output, input, opts)) is not None:
            return w
        issue, back = self._reduce_scatter_flat(output, input, opts.reduceOp, "reduce_scatter_single", opts.asyncOp)
        return self._work([issue()], [output], back, output)

    _reduce_scatter_base = reduce_scatter_single

    def reduce_scatter(self, output_tensors, input_tensors, opts=None):
        opts = _OPTIONS.ReduceScatterOptions() if opts is None else opts
        out = _one(output_tensors, "reduce_scatter", "output_tensors")
        if (w := self._other(out, "reduce_scatter", output_tensors, input_tensors, opts)) is not None:
            return w
        ins = _one(input_tensors, "reduce_scatter", "input_tensors")
        if out.is_complex():  # counts below are of real elements
            _reduction(opts.reduceOp, "reduce_scatter", out)
            out, ins = torch.view_as_real(out), [torch.view_as_real(i) for i in ins]
        if len(ins) != self.group.size:
            raise ValueError(f"reduce_scatter: input_tensors[0] must hold {self.group.size} tensors (one per rank), "
                             f"got {len(ins)}")
        counts = [i.numel() for i in ins]
        flat = torch.cat([i.reshape(-1) for i in ins])
        issue, back = self._reduce_scatter_flat(out, flat, opts.reduceOp, "reduce_scatter", opts.asyncOp, counts)
        return self._work([issue()], output_tensors, back, out)

    def reduce_scatter_single_coalesced(self, outputs, inputs, opts=None):
        opts = _OPTIONS.ReduceScatterOptions() if opts is None else opts
        if inputs and (w := self._other(inputs[0], "reduce_scatter_tensor_coalesced", outputs, inputs, opts)) \
                is not None:
            return w
        calls = [self._reduce_scatter_flat(o, i, opts.reduceOp, "reduce_scatter_tensor_coalesced", opts.asyncOp)
                 for o, i in zip(outputs, inputs, strict=True)]
        return self._work([issue() for issue, _ in calls], outputs, _chain(*(back for _, back in calls)),
                          outputs[0] if outputs else None)

    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    # ---- rooted collectives ----

    def broadcast(self, tensors, opts=None):
        opts = _OPTIONS.BroadcastOptions() if opts is None else opts
        t = _one(tensors, "broadcast", "tensors")
        if (w := self._other(t, "broadcast", tensors, opts)) is not None:
            return w
        src = self._global(opts.rootRank, "broadcast", "src")
        buf, back = _stage(t, "broadcast", "tensors[0]")
        return self._work([comm.broadcast(buf, src, self._pz(buf), async_op=opts.asyncOp)], tensors, back, t)

    def reduce(self, tensors, opts=None):
        """An all_reduce; ranks other than the root reduce a copy, so their tensor stays unchanged."""
        opts = _OPTIONS.ReduceOptions() if opts is None else opts
        t = _one(tensors, "reduce", "tensors")
        if (w := self._other(t, "reduce", tensors, opts)) is not None:
            return w
        self._global(opts.rootRank, "reduce", "dst")
        target = t if opts.rootRank == self.group.rank else t.clone()
        work, back = self._allreduce_one(target, opts.reduceOp, "reduce", "tensors[0]", opts.asyncOp)
        return self._work([work], tensors, back if target is t else None, t)

    def gather(self, output_tensors, input_tensors, opts=None):
        """Every other rank sends its tensor to the root (pyzero's point-to-point channels)."""
        opts = _OPTIONS.GatherOptions() if opts is None else opts
        inp = _one(input_tensors, "gather", "input_tensors")
        if (w := self._other(inp, "gather", output_tensors, input_tensors, opts)) is not None:
            return w
        root = opts.rootRank
        self._global(root, "gather", "dst")
        if self.group.rank != root:
            if output_tensors and any(output_tensors):
                raise ValueError(f"gather: gather_list must be empty on ranks other than dst={root}")
            buf, _ = _stage(inp, "gather", "tensor")
            g = self._p2p(buf, "gather", collective=True)
            if buf.is_cuda:
                return self._queued([P2PEntry(g, buf, self.group.ranks[root], True, None, [])], flush=True)
            return self._work([comm.send(buf, self.group.ranks[root], g, async_op=True)], [], None, inp)
        outs = _one(output_tensors, "gather", "gather_list")
        if len(outs) != self.group.size:
            raise ValueError(f"gather: gather_list must hold {self.group.size} tensors (one per rank), got {len(outs)}")
        _own_chunk(outs[root], inp, "gather", f"gather_list[{root}]", "tensor")
        staged = {r: _stage(o, "gather", f"gather_list[{r}]", copy_in=False) for r, o in enumerate(outs) if r != root}
        g = self._p2p(inp, "gather", collective=True)
        outs[root].copy_(inp)
        if inp.is_cuda:
            if not staged:
                return self._work([], output_tensors, None, inp)
            return self._queued([P2PEntry(g, buf, self.group.ranks[r], False, back,
                                               output_tensors) for r, (buf, back) in staged.items()], flush=True)
        works = [comm.recv(buf, self.group.ranks[r], g, async_op=True) for r, (buf, _) in staged.items()]
        return self._work(works, output_tensors, _chain(*(back for _, back in staged.values())), inp)

    def scatter(self, output_tensors, input_tensors, opts=None):
        """The root sends every other rank its tensor (pyzero's point-to-point channels)."""
        opts = _OPTIONS.ScatterOptions() if opts is None else opts
        out = _one(output_tensors, "scatter", "output_tensors")
        if (w := self._other(out, "scatter", output_tensors, input_tensors, opts)) is not None:
            return w
        root = opts.rootRank
        self._global(root, "scatter", "src")
        if self.group.rank != root:
            if input_tensors and any(input_tensors):
                raise ValueError(f"scatter: scatter_list must be empty on ranks other than src={root}")
            buf, back = _stage(out, "scatter", "tensor", copy_in=False)
            g = self._p2p(buf, "scatter", collective=True)
            if buf.is_cuda:
                return self._queued([P2PEntry(g, buf, self.group.ranks[root], False, back, output_tensors)],
                                    flush=True)
            return self._work([comm.recv(buf, self.group.ranks[root], g, async_op=True)], output_tensors, back, out)
        ins = _one(input_tensors, "scatter", "scatter_list")
        if len(ins) != self.group.size:
            raise ValueError(f"scatter: scatter_list must hold {self.group.size} tensors (one per rank), got {len(ins)}")
        _own_chunk(out, ins[root], "scatter", "tensor", f"scatter_list[{root}]")
        staged = {r: _stage(i, "scatter", f"scatter_list[{r}]")[0] for r, i in enumerate(ins) if r != root}
        g = self._p2p(out, "scatter", collective=True)
        out.copy_(ins[root])
        if out.is_cuda:
            if not staged:
                return self._work([], output_tensors, None, out)
            return self._queued([P2PEntry(g, buf, self.group.ranks[r], True, None, output_tensors)
                                      for r, buf in staged.items()], flush=True)
        works = [comm.send(buf, self.group.ranks[r], g, async_op=True) for r, buf in staged.items()]
        return self._work(works, output_tensors, None, out)

    # ---- all_to_all ----

    def alltoall(self, output_tensors, input_tensors, opts=None):
        """A send and a receive per peer, all in flight at once (one channel per peer and direction)."""
        if input_tensors and (w := self._other(input_tensors[0], "alltoall", output_tensors, input_tensors,
                                               opts)) is not None:
            return w
        n, me = self.group.size, self.group.rank
        for arg, ts in (("output_tensor_list", output_tensors), ("input_tensor_list", input_tensors)):
            if len(ts) != n:
                raise ValueError(f"alltoall: {arg} must hold {n} tensors (one per rank), got {len(ts)}")
        _own_chunk(output_tensors[me], input_tensors[me], "alltoall", f"output_tensor_list[{me}]",
                   f"input_tensor_list[{me}]")
        pairs = []
        for k in range(1, n):  # peers in the order me+1, me+2, ...: every pair starts at once
            dst, src = (me + k) % n, (me - k) % n
            bi, _ = _stage(input_tensors[dst], "alltoall", f"input_tensor_list[{dst}]")
            bo, back = _stage(output_tensors[src], "alltoall", f"output_tensor_list[{src}]", copy_in=False)
            pairs.append((dst, bi, src, bo, back))
        works = []
        g = self._p2p(output_tensors[me], "alltoall", collective=True)
        if output_tensors[me].is_cuda:  # (a send and a receive per peer: pairs stay in one batch)
            output_tensors[me].copy_(input_tensors[me])
            if not pairs:
                return self._work([], output_tensors, None, output_tensors[me])
            entries = []
            for dst, bi, src, bo, back in pairs:
                entries += [P2PEntry(g, bi, self.group.ranks[dst], True, None, output_tensors),
                            P2PEntry(g, bo, self.group.ranks[src], False, back, output_tensors)]
            return self._queued(entries, flush=True)
        for dst, bi, src, bo, _ in pairs:
            works.append(comm.send(bi, self.group.ranks[dst], g, async_op=True))
            works.append(comm.recv(bo, self.group.ranks[src], g, async_op=True))
        output_tensors[me].copy_(input_tensors[me])
        return self._work(works, output_tensors, _chain(*(p[4] for p in pairs)), output_tensors[me])

    def all_to_all_single(self, output, input, output_split_sizes, input_split_sizes, opts=None):
        if (w := self._other(input, "alltoall_base", output, input, output_split_sizes, input_split_sizes,
                             opts)) is not None:
            return w
        n, me = self.group.size, self.group.rank
        outs = _split_dim0(output, output_split_sizes, n, "output")
        ins = _split_dim0(input, input_split_sizes, n, "input")
        if outs[me].shape[0] != ins[me].shape[0]:
            raise ValueError(f"alltoall_base: this rank's own split differs: {outs[me].shape[0]} rows in output "
                             f"(output_split_sizes[{me}]) against {ins[me].shape[0]} in input (input_split_sizes"
                             f"[{me}]); the rows it keeps must match")
        return self.alltoall(outs, ins, opts)

    alltoall_base = all_to_all_single

    # ---- barrier and point-to-point ----

    def barrier(self, opts=None):
        opts = _OPTIONS.BarrierOptions() if opts is None else opts
        self._queue.flush()  # (queued CUDA sends and receives come first)
        return self._work([comm.barrier(self.group, async_op=opts.asyncOp)], [])

    def monitored_barrier(self, timeout=None, wait_all_ranks: bool = False):
        """A barrier (ProcessGroup.monitored_barrier; torch's dist.monitored_barrier takes only gloo groups).
        A rank that does not arrive within the group's timeout is named by pyzero's CollectiveTimeout on
        every rank, so `timeout` and `wait_all_ranks` change nothing."""
        comm.barrier(self.group)

    def send(self, tensors, dst: int, tag: int = 0):
        t = _one(tensors, "send", "tensors")
        if (w := self._other(t, "send", tensors, dst, tag)) is not None:
            return w
        _check_tag(tag, "send")
        buf, _ = _stage_bytes(t, "send", "tensor")
        g = self._p2p(buf, "send", collective=False)
        peer = self._global(dst, "send", "dst")
        if buf.is_cuda:
            return self._queued([P2PEntry(g, buf, peer, True, None, tensors)], flush=False)
        return self._work([comm.send(buf, peer, g, async_op=True)], tensors, None, t)

    def recv(self, tensors, src: int, tag: int = 0):
        t = _one(tensors, "recv", "tensors")
        if (w := self._other(t, "recv", tensors, src, tag)) is not None:
            return w
        _check_tag(tag, "recv")
        buf, back = _stage_bytes(t, "recv", "tensor", copy_in=False)
        g = self._p2p(buf, "recv", collective=False)
        peer = self._global(src, "recv", "src")
        if buf.is_cuda:
            return self._queued([P2PEntry(g, buf, peer, False, back, tensors)], flush=False)
        return self._work([comm.recv(buf, peer, g, async_op=True)], tensors, back, t)

    def recv_anysource(self, tensors, tag: int = 0):
        raise ValueError(f"recv: src=None (receive from any rank) is not supported by the {NAME!r} backend; "
                         "pass the sender's rank")


def _check_tag(tag: int, op: str) -> None:
    if tag != 0:
        raise ValueError(f"{op}: tag={tag} is not supported by the {NAME!r} backend (messages between two ranks "
                         "are matched in order); expected tag=0")


def _own_chunk(out: torch.Tensor, inp: torch.Tensor, op: str, out_arg: str, in_arg: str) -> None:
    """The chunk a rank keeps (gather's root, scatter's root, all_to_all's own) is a copy: the two must
    have one shape (copy_ broadcast a smaller one silently, as gloo refuses); checked before anything
    is issued."""
    if out.shape != inp.shape:
        raise ValueError(f"{op}: {out_arg} has shape {tuple(out.shape)} and {in_arg} {tuple(inp.shape)}: this rank's "
                         "own chunk is copied between them, so they must have the same shape")


def _split_dim0(t: torch.Tensor, sizes, n: int, arg: str) -> list[torch.Tensor]:
    if t.dim() == 0:
        raise ValueError(f"all_to_all_single: {arg} is 0-dimensional; expected a tensor split along dim 0 into "
                         f"{n} chunks (one per rank)")
    sizes = list(sizes)
    if any(not is_int(s) or s < 0 for s in sizes):
        raise ValueError(f"all_to_all_single: {arg}_split_sizes={sizes} must hold {n} non-negative ints summing to "
                         f"{arg}.shape[0]={t.shape[0]}")
    if not sizes:
        if t.shape[0] % n:
            raise ValueError(f"all_to_all_single: {arg}.shape[0]={t.shape[0]} is not divisible by the group size "
                             f"{n} (pass {arg}_split_sizes)")
        sizes = [t.shape[0] // n] * n
    if len(sizes) != n or sum(sizes) != t.shape[0]:
        raise ValueError(f"all_to_all_single: {arg}_split_sizes={sizes} must hold {n} sizes summing to "
                         f"{arg}.shape[0]={t.shape[0]}")
    return list(t.split(sizes))
