"""Process groups and collectives on torch tensors (and CUDA arrays).

Each public function resolves the group, lets the group's backend turn the
caller's tensors into buffers (validating them, errors naming the argument),
checks the buffers against each other once here, and hands them to the
backend (:mod:`pyzero.backend` is the interface, :mod:`pyzero.backends` holds
one module per backend). The C++ core communicates on its own threads or
streams without the GIL.

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

from . import backends, flight
from .backend import (
    Backend,
    CollectiveError,
    CollectiveTimeout,
    GroupSetup,
    Options,
    Work,
    check_algo,
    check_alias,
    check_op,
    check_same_dtype,
    resolve_counts,
)

__all__ = ["CollectiveError", "CollectiveTimeout", "Group", "Options", "Work"]

Work.explain = staticmethod(flight.work_failed)  # async errors explained like synchronous ones


@dataclass(eq=False)
class Group:
    """A set of global ranks that run collectives together."""

    ranks: tuple[int, ...]
    rank: int  # this process's index in `ranks`, -1 when not a member
    gid: int
    _backend: Backend | None = field(default=None, repr=False)
    options: Options = field(default_factory=Options)
    # Async work not yet known to be complete: keeps its tensors alive even if
    # the caller drops the handle (the transport reads and writes them).
    _pending: list = field(default_factory=list, repr=False)
    _closed: bool = field(default=False, repr=False)
    symmetric: object = field(default=None, repr=False)  # pyzero.symmetric.SymmetricBuffer, made on first use
    flight: flight.Ring | None = field(default=None, repr=False)  # this group's last calls (pyzero.flight)

    def __post_init__(self):
        if self.flight is None:  # a group made by hand (pz.new_group gives it a recording ring)
            self.flight = flight.NullRing(self.gid, self.ranks, self.rank, 1)

    @property
    def size(self) -> int:
        return len(self.ranks)

    @property
    def backend(self) -> Backend:
        """This process's transport for the group; raises for non-members and destroyed groups."""
        if self.rank < 0:
            raise ValueError(f"group: this process (global rank {get_rank()}) is not a member of group {self.ranks}")
        if self._closed:
            raise CollectiveError("group was destroyed (pz.destroy() was called)")
        return self._backend

    @property
    def backend_name(self) -> str:
        return "" if self._backend is None else self._backend.name

    @property
    def device(self) -> int | None:
        """The CUDA device of a GPU backend's group, None for CPU backends."""
        return getattr(self._backend, "device", None)

    def group_rank(self, global_rank: int, arg: str) -> int:
        if not isinstance(global_rank, int) or isinstance(global_rank, bool):
            raise TypeError(f"{arg}: expected an int global rank, got {type(global_rank).__name__}")
        try:
            return self.ranks.index(global_rank)
        except ValueError:
            raise ValueError(f"{arg}={global_rank}: expected a global rank of the group {list(self.ranks)}") from None

    def track(self, raw, keep, b=None, rec: int = 0) -> Work | None:
        """Wrap an async handle (None for a synchronous call) and keep it until complete;
        `rec` is the call's flight record."""
        if raw is None:
            if rec:
                self.flight.last_done = rec  # (pyzero.flight.Ring: a synchronous call returned)
            return None
        if rec:
            self.flight.queued(rec, raw)
        work = self._backend.work(raw, keep, b)
        self._pending = [w for w in self._pending if not w.done()]
        self._pending.append(work)
        return work

    def close(self) -> None:
        if self._backend is not None and not self._closed:
            self.symmetric = None  # views of the segments the transport unmaps
            self._closed = True
            self._backend.close()


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
    device: int | None = None  # this rank's GPU (GPU backends)
    options: Options = field(default_factory=Options)


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


def init(backend: str | None = None, timeout: float = 300.0, options=None) -> None:
    """Join the job described by the torchrun environment variables.

    Without any of them set, starts a world of one process. ``backend`` is
    "shm" (CPU processes of one host), "nccl" or "ipc" (CUDA); None picks
    "nccl" when CUDA is available, else "shm". ``options`` (pz.Options or a
    dict of its fields) sets the transport of the world and, by default, of
    every subgroup.
    """
    global _world
    if _world is not None:
        raise RuntimeError("pz.init(): already initialised; call pz.destroy() first")
    if not isinstance(timeout, (int, float)) or isinstance(timeout, bool) or timeout <= 0:
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    opts = Options.make(options)
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() else "shm"
    cls = backends.backend_class(backend)

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
    device = cls.setup_process(local_rank)

    from torch.distributed import TCPStore  # noqa: PLC0415

    store = TCPStore(addr, port, size, rank == 0, timeout=datetime.timedelta(seconds=timeout))
    if rank == 0:
        store.set("pz/token", f"{os.getpid():x}{secrets.token_hex(4)}")
    token = store.get("pz/token").decode()
    flight.start(rank, size, token)
    _world = _World(rank, size, local_rank, backend, float(timeout), store, token, device=device, options=opts)
    try:
        _world.world = _make_group(tuple(range(size)), opts)
    except BaseException:
        _world = None
        raise
    flight.listen(store)


def _make_group(ranks: tuple[int, ...], options: Options) -> Group:
    w = _world
    gid = w.next_gid
    w.next_gid += 1
    if w.rank not in ranks:
        return Group(ranks, -1, gid, options=options)
    me = ranks.index(w.rank)
    setup = GroupSetup(w.store, f"pz/g{gid}", f"/pz{w.token}_{gid}", me, len(ranks), w.timeout, w.device, options)
    g = Group(ranks, me, gid, backends.backend_class(w.backend).create(setup), options)
    g.flight = g._backend.flight = flight.ring(gid, ranks, me)
    w.groups.append(g)
    return g


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


def get_store():
    """The job's key-value store (a torch.distributed TCPStore), for layers that rendezvous beside pyzero."""
    return _require_init().store


def get_timeout() -> float:
    """The collective timeout in seconds given to pz.init()."""
    return _require_init().timeout


def destroy() -> None:
    """Finish queued work, free every group's transport, leave the job."""
    global _world
    if _world is None:
        return
    w, _world = _world, None
    flight.stop()
    for g in w.groups:
        g.close()


def new_group(ranks: Sequence[int], options=None) -> Group:
    """A subgroup of the world; every rank of the world must call this, in the same order.
    ``options`` (pz.Options or a dict) overrides the world's options for this group."""
    w = _require_init()
    try:
        ranks = tuple(int(r) for r in ranks)
    except (TypeError, ValueError):
        raise TypeError(f"ranks: expected a sequence of ints, got {ranks!r}") from None
    if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < w.size for r in ranks):
        raise ValueError(f"ranks: expected distinct global ranks in [0, {w.size}), got {list(ranks)}")
    return _make_group(ranks, Options.make(options).merged(w.options))


def resolve_group(group) -> Group:
    """`group`, or the world group for None; TypeError for anything else."""
    w = _require_init()
    if group is None:
        return w.world
    if not isinstance(group, Group):
        raise TypeError(f"group: expected a pz group (from pz.new_group) or None, got {type(group).__name__}")
    return group


def groups() -> list[Group]:
    """This process's live groups (the world first)."""
    return [g for g in _require_init().groups if not g._closed]


# ---------------------------------------------------------------------------
# Collectives


def all_reduce(t, op: str = "sum", group=None, async_op: bool = False, algo=None):
    """Reduce `t` across the group in place."""
    g = resolve_group(group)
    be = g.backend
    b = be.buffer(t, "tensor")
    opc, al = check_op(op, b), check_algo(algo)
    i = g.flight.begin("all_reduce", b.numel, b.code, opc, al)
    try:
        raw = be.all_reduce(b, opc, al, bool(async_op))
    except Exception as e:
        raise g.flight.failed(i, e) from None
    return g.track(raw, (t,), b, i)


def reduce_scatter(out, inp, op: str = "sum", counts=None, group=None, async_op: bool = False, algo=None):
    """Reduce `inp` across the group; this rank's chunk of the result lands in `out`."""
    g = resolve_group(group)
    be = g.backend
    bo, bi = be.buffer(out, "out"), be.buffer(inp, "inp", writable=False)
    check_same_dtype(bi, bo, "inp", "out")
    opc = check_op(op, bo)
    counts = resolve_counts(counts, g.size, g.rank, bi, bo, "inp", "out")
    check_alias(bi, bo, sum(counts[:g.rank]), "inp", "out")
    al = check_algo(algo)
    i = g.flight.begin("reduce_scatter", bi.numel, bi.code, opc, al)
    try:
        raw = be.reduce_scatter(bo, bi, counts, opc, al, bool(async_op))
    except Exception as e:
        raise g.flight.failed(i, e) from None
    return g.track(raw, (out, inp), bo, i)


def all_gather(out, inp, counts=None, group=None, async_op: bool = False, algo=None):
    """Concatenate every rank's `inp` into `out` (rank order). `inp` may be this rank's chunk of `out`."""
    g = resolve_group(group)
    be = g.backend
    bo, bi = be.buffer(out, "out"), be.buffer(inp, "inp", writable=False)
    check_same_dtype(bi, bo, "inp", "out")
    counts = resolve_counts(counts, g.size, g.rank, bo, bi, "out", "inp")
    check_alias(bo, bi, sum(counts[:g.rank]), "out", "inp")
    al = check_algo(algo)
    i = g.flight.begin("all_gather", bo.numel, bo.code, -1, al)
    try:
        raw = be.all_gather(bo, bi, counts, al, bool(async_op))
    except Exception as e:
        raise g.flight.failed(i, e) from None
    return g.track(raw, (out, inp), bo, i)


def broadcast(t, src: int = 0, group=None, async_op: bool = False, algo=None):
    """Copy `t` of global rank `src` into `t` on every rank of the group."""
    g = resolve_group(group)
    root = g.group_rank(src, "src")
    be = g.backend
    b = be.buffer(t, "tensor")
    al = check_algo(algo)
    i = g.flight.begin("broadcast", b.numel, b.code, -1, al, root)
    try:
        raw = be.broadcast(b, root, al, bool(async_op))
    except Exception as e:
        raise g.flight.failed(i, e) from None
    return g.track(raw, (t,), b, i)


def barrier(group=None, async_op: bool = False):
    """Return once every rank of the group has called barrier."""
    g = resolve_group(group)
    be = g.backend
    i = g.flight.begin("barrier", 0, 0)
    try:
        raw = be.barrier(bool(async_op))
    except Exception as e:
        raise g.flight.failed(i, e) from None
    return g.track(raw, (), None, i)


def _peer(g: Group, global_rank: int, arg: str) -> int:
    peer = g.group_rank(global_rank, arg)
    if peer == g.rank:
        raise ValueError(f"{arg}={global_rank}: cannot {'send to' if arg == 'dst' else 'receive from'} "
                         "this rank itself")
    return peer


def send(t, dst: int, group=None, async_op: bool = False):
    """Send `t` to global rank `dst` (matched by one recv there, in order)."""
    g = resolve_group(group)
    peer = _peer(g, dst, "dst")
    be = g.backend
    b = be.buffer(t, "tensor", writable=False)
    i = g.flight.begin_p2p("send", b.numel, b.code, dst)
    try:
        raw = be.send(b, peer, bool(async_op))
    except Exception as e:
        raise g.flight.failed(i, e) from None
    return g.track(raw, (t,), b, i)


def recv(t, src: int, group=None, async_op: bool = False):
    """Receive into `t` the next message that global rank `src` sends to this rank."""
    g = resolve_group(group)
    peer = _peer(g, src, "src")
    be = g.backend
    b = be.buffer(t, "tensor")
    i = g.flight.begin_p2p("recv", b.numel, b.code, src)
    try:
        raw = be.recv(b, peer, bool(async_op))
    except Exception as e:
        raise g.flight.failed(i, e) from None
    return g.track(raw, (t,), b, i)


def comm_stats(reset: bool = False, group=None) -> dict:
    """Per-op {calls, elements, sent_bytes} of this rank, over all its groups (or one)."""
    selected = [resolve_group(group)] if group is not None else groups()
    out: dict = {}
    for g in selected:
        for op, s in g.backend.stats(reset).items():
            acc = out.setdefault(op, {"calls": 0, "elements": 0, "sent_bytes": 0})
            acc["calls"] += s.calls
            acc["elements"] += s.elements
            acc["sent_bytes"] += s.sent_bytes
    return out
