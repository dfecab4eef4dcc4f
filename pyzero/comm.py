"""Process groups and collectives on torch tensors.

Python validates every argument (naming it in the error), turns tensors into
``(data_ptr, numel, dtype code)`` and hands them to ``pyzero._C``; the C++
core does the communication on its own threads without the GIL.

Ranks given to ``broadcast``/``send``/``recv`` (``src``/``dst``) are global
ranks, as in ``torch.distributed``; ``group.rank`` is this process's index in
the group.
"""
from __future__ import annotations

import datetime
import os
import secrets
from dataclasses import dataclass, field
from typing import Sequence

import torch

from . import _C

CollectiveError = _C.CollectiveError
CollectiveTimeout = _C.CollectiveTimeout

_DTYPES = {
    torch.float32: 0,
    torch.float16: 1,
    torch.bfloat16: 2,
    torch.float64: 3,
    torch.int32: 4,
    torch.int64: 5,
}
_OPS = {"sum": 0, "avg": 1, "max": 2, "min": 3, "prod": 4}
_ALGOS = {None: 0, "auto": 0, "ring": 1, "oneshot": 2, "native": 3}  # native: NCCL's own (nccl backend)
_BACKENDS = ("shm", "nccl", "ipc")

# Shared-memory transport settings (see csrc/shm_transport.h); the env
# variables exist for tuning benchmarks.
SHM_SLICE_BYTES = int(os.environ.get("PYZERO_SHM_SLICE_KB", "256")) << 10
SHM_DEPTH = int(os.environ.get("PYZERO_SHM_DEPTH", "8"))
SHM_ONESHOT_BYTES = int(os.environ.get("PYZERO_SHM_ONESHOT_KB", "256")) << 10


@dataclass(eq=False)
class Group:
    """A set of global ranks that run collectives together."""

    ranks: tuple[int, ...]
    rank: int  # this process's index in `ranks`, -1 when not a member
    gid: int
    _comm: object = field(default=None, repr=False)
    # Async work not yet known to be complete: keeps its tensors alive even if
    # the caller drops the handle (the C++ thread reads and writes them).
    _pending: list = field(default_factory=list, repr=False)
    device: int | None = None  # the CUDA device of a GPU backend's group (see pyzero/cuda.py); None: shm
    _symmetric: object = field(default=None, repr=False)  # pyzero.symmetric.SymmetricBuffer, made on first use

    @property
    def size(self) -> int:
        return len(self.ranks)

    def comm(self):
        if self.rank < 0:
            raise ValueError(f"group: this process (global rank {get_rank()}) is not a member of group {self.ranks}")
        if self._comm is None:
            raise CollectiveError("group was destroyed (pz.destroy() was called)")
        return self._comm

    def group_rank(self, global_rank: int, arg: str) -> int:
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{arg}: expected an int global rank, got {type(global_rank).__name__}")
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"{arg}={global_rank}: expected a global rank of the group {list(self.ranks)}") from None


class Work:
    """In-flight collective: keeps its tensors alive until waited on."""

    __slots__ = ("_work", "_keep")

    def __init__(self, work, keep):
        self._work = work
        self._keep = keep

    def wait(self) -> bool:
        self._work.wait()
        self._keep = None
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()


@dataclass
class _World:
    rank: int
    size: int
    local_rank: int
    backend: str
    timeout: float
    store: object
    token: str
    world: Group | None = None
    groups: list = field(default_factory=list)
    next_gid: int = 0
    device: int | None = None  # this rank's GPU (nccl backend)


_world: _World | None = None


# ---------------------------------------------------------------------------
# Initialisation


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"pz.init(): environment variable {name} is not set (torchrun sets RANK, WORLD_SIZE, "
                         "LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"pz.init(): {name}={value!r} is not an integer") from None


def init(backend: str | None = None, timeout: float = 300.0) -> None:
    """Join the job described by the torchrun environment variables.

    Without any of them set, starts a world of one process. ``backend`` is
    "shm" (CPU processes of one host), "nccl" or "ipc" (CUDA); None picks
    "nccl" when CUDA is available, else "shm".
    """
    global _world
    if _world is not None:
        raise RuntimeError("pz.init(): already initialised; call pz.destroy() first")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "shm"
    if backend not in _BACKENDS:
        raise ValueError(f"backend: expected one of {_BACKENDS} or None, got {backend!r}")
    if backend not in _C.build_info()["backends"]:
        raise RuntimeError(f"backend={backend!r} is not available in this build of pyzero "
                           f"(available: {list(_C.build_info()['backends'])})")

    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not any(n in os.environ for n in names):
        rank, size, local_rank, addr, port = 0, 1, 0, "127.0.0.1", 0
    else:
        rank, size = _env_int("RANK"), _env_int("WORLD_SIZE")
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        addr = os.environ.get("MASTER_ADDR")
        if addr is None:
            raise ValueError("pz.init(): environment variable MASTER_ADDR is not set")
        port = _env_int("MASTER_PORT")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"pz.init(): RANK={rank} must be in [0, WORLD_SIZE={size})")
    device = _gpu().nccl_device(local_rank) if backend == "nccl" else None

    from torch.distributed import TCPStore  # noqa: PLC0415

    store = TCPStore(addr, port, size, rank == 0, timeout=datetime.timedelta(seconds=timeout))
    if rank == 0:
        store.set("pz/token", f"{os.getpid():x}{secrets.token_hex(4)}")
    token = store.get("pz/token").decode()
    _world = _World(rank, size, local_rank, backend, float(timeout), store, token, device=device)
    try:
        _world.world = _make_group(tuple(range(size)))
    except BaseException:
        _world = None
        raise


def _store_barrier(store, key: str, n: int, timeout: float) -> None:
    if store.add(key, 1) == n:
        store.set(key + "/done", "1")
    store.wait([key + "/done"], datetime.timedelta(seconds=timeout))


def _make_group(ranks: tuple[int, ...]) -> Group:
    w = _world
    gid = w.next_gid
    w.next_gid += 1
    if w.rank not in ranks:
        return Group(ranks, -1, gid, device=w.device)
    me = ranks.index(w.rank)
    if w.backend == "nccl":
        comm = _gpu().make_comm(w.store, gid, me, len(ranks), w.device, w.timeout)
        g = Group(ranks, me, gid, comm, device=w.device)
        w.groups.append(g)
        return g
    prefix = f"/pz{w.token}_{gid}"
    comm = _C.ShmComm(prefix, me, len(ranks), SHM_SLICE_BYTES, SHM_DEPTH, SHM_ONESHOT_BYTES, w.timeout)
    key = f"pz/g{gid}"
    try:
        _store_barrier(w.store, key + "/created", len(ranks), w.timeout)
        comm.attach()
        _store_barrier(w.store, key + "/attached", len(ranks), w.timeout)
    finally:
        comm.unlink()  # every rank has mapped it now (or set-up failed): nothing left in /dev/shm
    g = Group(ranks, me, gid, comm)
    w.groups.append(g)
    return g


def _gpu():
    """pyzero.cuda, imported on first use: only GPU groups need it."""
    from . import cuda  # noqa: PLC0415

    return cuda


def _require_init() -> _World:
    if _world is None:
        raise RuntimeError("pyzero is not initialised: call pz.init() first")
    return _world


def is_initialized() -> bool:
    return _world is not None


def get_rank() -> int:
    return _require_init().rank


def get_world_size() -> int:
    return _require_init().size


def get_local_rank() -> int:
    return _require_init().local_rank


def get_backend() -> str:
    return _require_init().backend


def destroy() -> None:
    """Finish queued work, free every group's shared memory, leave the job."""
    global _world
    if _world is None:
        return
    w, _world = _world, None
    for g in w.groups:
        if g._comm is not None:
            g._symmetric = None  # views of the segments the comm unmaps
            g._comm.close()
            g._comm = None


def new_group(ranks: Sequence[int]) -> Group:
    """A subgroup of the world; every rank of the world must call this, in the same order."""
    w = _require_init()
    try:
        ranks = tuple(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise TypeError(f"ranks: expected a sequence of ints, got {ranks!r}") from None
    if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < w.size for r in ranks):
        raise ValueError(f"ranks: expected distinct global ranks in [0, {w.size}), got {list(ranks)}")
    return _make_group(ranks)


def _group(group) -> Group:
    w = _require_init()
    if group is None:
        return w.world
    if not isinstance(group, Group):
        raise TypeError(f"group: expected a pz group (from pz.new_group) or None, got {type(group).__name__}")
    return group


# ---------------------------------------------------------------------------
# Argument checks


def _check_tensor(t, arg: str) -> int:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    code = _DTYPES.get(t.dtype)
    if code is None:
        raise TypeError(f"{arg}: dtype {t.dtype} is not supported; expected one of "
                        "float32, float16, bfloat16, float64, int32, int64")
    if not t.is_contiguous():
        raise ValueError(f"{arg}: expected a contiguous tensor (call .contiguous() first)")
    if t.device.type != "cpu":
        raise ValueError(f"{arg}: the shm backend takes CPU tensors, got a tensor on {t.device}")
    return code


def _check_op(op, code: int, arg_dtype) -> int:
    if not isinstance(op, str) or op not in _OPS:
        raise ValueError(f"op: expected one of {list(_OPS)}, got {op!r}")
    if op == "avg" and code in (4, 5):
        raise ValueError(f"op='avg' is for floating-point tensors; got {arg_dtype} (use op='sum' and divide)")
    return _OPS[op]


def _check_algo(algo) -> int:
    if algo not in _ALGOS:
        raise ValueError(f"algo: expected 'auto', 'ring', 'oneshot' or (nccl backend) 'native', got {algo!r}")
    return _ALGOS[algo]


def _check_counts(counts, n: int, total: int, arg_total: str):
    try:
        counts = [int(c) for c in counts]
    except (TypeError, ValueError):
        raise TypeError(f"counts: expected a sequence of {n} ints, got {counts!r}") from None
    if len(counts) != n or any(c < 0 for c in counts):
        raise ValueError(f"counts: expected {n} non-negative ints (one per rank of the group), got {counts}")
    if sum(counts) != total:
        raise ValueError(f"counts: sum(counts)={sum(counts)} must equal {arg_total}.numel()={total}")
    return counts


def _span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def _check_alias(big: torch.Tensor, small: torch.Tensor, offset: int, big_arg: str, small_arg: str) -> None:
    """`small` must be disjoint from `big`, or exactly its chunk at `offset` (the in-place form)."""
    b0, b1 = _span(big)
    s0, s1 = _span(small)
    if s1 <= b0 or b1 <= s0 or small.numel() == 0:
        return
    if s0 != b0 + offset * big.element_size():
        raise ValueError(f"{small_arg} overlaps {big_arg}: expected either separate memory or, for the in-place "
                         f"form, {small_arg} to be exactly this rank's chunk of {big_arg}")


def _finish(g: Group, result, keep):
    if result is None:
        return None
    work = Work(result, keep)
    g._pending = [w for w in g._pending if w._keep is not None and not w._work.is_completed()]
    g._pending.append(work)
    return work


# ---------------------------------------------------------------------------
# Collectives


def all_reduce(t: torch.Tensor, op: str = "sum", group=None, async_op: bool = False, algo=None):
    """Reduce `t` across the group in place."""
    g = _group(group)
    if g.device is not None:
        return _gpu().all_reduce(g, t, op, async_op, algo)
    code = _check_tensor(t, "tensor")
    opc = _check_op(op, code, t.dtype)
    res = g.comm().all_reduce(t.data_ptr(), t.numel(), code, opc, _check_algo(algo), bool(async_op))
    return _finish(g, res, (t,))


def reduce_scatter(out: torch.Tensor, inp: torch.Tensor, op: str = "sum", counts=None, group=None,
                   async_op: bool = False, algo=None):
    """Reduce `inp` across the group; this rank's chunk of the result lands in `out`."""
    g = _group(group)
    if g.device is not None:
        return _gpu().reduce_scatter(g, out, inp, op, counts, async_op, algo)
    code = _check_tensor(out, "out")
    if _check_tensor(inp, "inp") != code:
        raise TypeError(f"inp: dtype {inp.dtype} does not match out's {out.dtype}")
    opc = _check_op(op, code, out.dtype)
    comm, n, me = g.comm(), g.size, g.rank
    if counts is None:
        if inp.numel() != n * out.numel():
            raise ValueError(f"inp: expected {n} x out.numel() = {n * out.numel()} elements, got {inp.numel()} "
                             "(pass counts= for uneven chunks)")
        counts = [out.numel()] * n
    else:
        counts = _check_counts(counts, n, inp.numel(), "inp")
        if counts[me] != out.numel():
            raise ValueError(f"out: expected counts[{me}]={counts[me]} elements for this rank, got {out.numel()}")
    _check_alias(inp, out, sum(counts[:me]), "inp", "out")
    res = comm.reduce_scatter(out.data_ptr(), inp.data_ptr(), counts, code, opc, _check_algo(algo),
                                  bool(async_op))
    return _finish(g, res, (out, inp))


def all_gather(out: torch.Tensor, inp: torch.Tensor, counts=None, group=None, async_op: bool = False,
               algo=None):
    """Concatenate every rank's `inp` into `out` (rank order). `inp` may be this rank's chunk of `out`."""
    g = _group(group)
    if g.device is not None:
        return _gpu().all_gather(g, out, inp, counts, async_op, algo)
    code = _check_tensor(out, "out")
    if _check_tensor(inp, "inp") != code:
        raise TypeError(f"inp: dtype {inp.dtype} does not match out's {out.dtype}")
    comm, n, me = g.comm(), g.size, g.rank
    if counts is None:
        if out.numel() != n * inp.numel():
            raise ValueError(f"out: expected {n} x inp.numel() = {n * inp.numel()} elements, got {out.numel()} "
                             "(pass counts= for uneven chunks)")
        counts = [inp.numel()] * n
    else:
        counts = _check_counts(counts, n, out.numel(), "out")
        if counts[me] != inp.numel():
            raise ValueError(f"inp: expected counts[{me}]={counts[me]} elements for this rank, got {inp.numel()}")
    _check_alias(out, inp, sum(counts[:me]), "out", "inp")
    res = comm.all_gather(out.data_ptr(), inp.data_ptr(), counts, code, _check_algo(algo), bool(async_op))
    return _finish(g, res, (out, inp))


def broadcast(t: torch.Tensor, src: int = 0, group=None, async_op: bool = False, algo=None):
    """Copy `t` of global rank `src` into `t` on every rank of the group."""
    g = _group(group)
    if g.device is not None:
        return _gpu().broadcast(g, t, src, async_op, algo)
    code = _check_tensor(t, "tensor")
    root = g.group_rank(src, "src")
    res = g.comm().broadcast(t.data_ptr(), t.numel(), code, root, _check_algo(algo), bool(async_op))
    return _finish(g, res, (t,))


def barrier(group=None, async_op: bool = False):
    """Return once every rank of the group has called barrier."""
    g = _group(group)
    if g.device is not None:
        return _gpu().barrier(g, async_op)
    return _finish(g, g.comm().barrier(bool(async_op)), ())


def send(t: torch.Tensor, dst: int, group=None, async_op: bool = False):
    """Send `t` to global rank `dst` (matched by one recv there, in order)."""
    g = _group(group)
    if g.device is not None:
        return _gpu().send(g, t, dst, async_op)
    code = _check_tensor(t, "tensor")
    peer = g.group_rank(dst, "dst")
    if peer == g.rank:
        raise ValueError(f"dst={dst}: cannot send to this rank itself")
    return _finish(g, g.comm().send(t.data_ptr(), t.numel(), code, peer, bool(async_op)), (t,))


def recv(t: torch.Tensor, src: int, group=None, async_op: bool = False):
    """Receive into `t` the next message that global rank `src` sends to this rank."""
    g = _group(group)
    if g.device is not None:
        return _gpu().recv(g, t, src, async_op)
    code = _check_tensor(t, "tensor")
    peer = g.group_rank(src, "src")
    if peer == g.rank:
        raise ValueError(f"src={src}: cannot receive from this rank itself")
    return _finish(g, g.comm().recv(t.data_ptr(), t.numel(), code, peer, bool(async_op)), (t,))


def comm_stats(reset: bool = False, group=None) -> dict:
    """Per-op {calls, elements, sent_bytes} of this rank, over all its groups (or one)."""
    w = _require_init()
    groups = [_group(group)] if group is not None else [g for g in w.groups if g._comm is not None]
    out: dict = {}
    for g in groups:
        for op, s in g.comm().stats(reset).items():
            acc = out.setdefault(op, {"calls": 0, "elements": 0, "sent_bytes": 0})
            acc["calls"] += s.calls
            acc["elements"] += s.elements
            acc["sent_bytes"] += s.sent_bytes
    return out
