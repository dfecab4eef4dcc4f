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
import itertools
import json
import operator
import os
import re
import secrets
import socket
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple, Sequence

import torch

from . import backends, envvars, flight, topology as _topology
from .backend import (
    Backend,
    CollectiveError,
    CollectiveTimeout,
    DTYPES,
    MessageMismatch,
    GroupSetup,
    Options,
    Work,
    check_algo,
    check_alias,
    check_op,
    check_same_dtype,
    publish_failure,
    resolve_counts,
    SUPPORTED_DTYPES,
)
from .checks import check_bool, is_int, is_positive_finite

__all__ = ["CollectiveError", "CollectiveTimeout", "MessageMismatch", "Group", "Options", "Work"]

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
    # The group's name in this process, unique for the process's lifetime: what torch.ops.pyzero
    # operators (pyzero.ops) take instead of the group object, as torch's functional collectives do.
    name: str = field(default="", repr=False)

    def __post_init__(self):
        if self.flight is None:  # a group made by hand (pz.new_group gives it a recording ring)
            self.flight = flight.NullRing(self.gid, self.ranks, self.rank, 1)
        if not self.name:
            self.name = f"pyzero:{next(_group_names)}"
        _groups_by_name[self.name] = self

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

    @property
    def tensor_device(self) -> torch.device:
        """Where the group's collectives take their tensors: its GPU for a GPU backend, else the CPU."""
        return torch.device("cpu") if self.device is None else torch.device("cuda", self.device)

    def group_rank(self, global_rank: int, arg: str) -> int:
        if not is_int(global_rank):
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
                self.flight.done(rec)
            return None
        if rec:
            self.flight.queued(rec, raw)
        else:  # a native backend's own record of the call, if any
            self.flight.adopt(raw)
        work = self._backend.work(raw, keep, b)
        self._pending = [w for w in self._pending if not w.done()]
        self._pending.append(work)
        return work

    def close(self) -> None:
        if self._backend is not None and not self._closed:
            self.symmetric = None  # views of the segments the transport unmaps
            self._closed = True
            self._backend.close()


_group_names = itertools.count()
_groups_by_name: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def group_by_name(name: str) -> Group:
    """The live group called `name` (Group.name) in this process."""
    g = _groups_by_name.get(name) if isinstance(name, str) else None
    if g is None:
        raise ValueError(f"group: no pyzero group named {name!r} in this process; expected the name of a "
                         "live group (Group.name)")
    return g


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
    topology: _topology.Topology | None = None


_world: _World | None = None


# ---------------------------------------------------------------------------
# Initialisation


_MAX_WORLD = 1 << 20  # ranks (the join reads a store key per rank)
_MIN_TIMEOUT, _MAX_TIMEOUT = 1e-3, 1e7  # seconds (torch's store takes whole milliseconds, C ints of them)


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"pz.init(): environment variable {name} is not set (torchrun sets RANK, WORLD_SIZE, "
                         "LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
    if not re.fullmatch(r"\s*-?[0-9]+\s*", value):  # (int() also takes "0_1" as 1)
        raise ValueError(f"pz.init(): {name}={value!r} is not an integer")
    return int(value)


def init(backend: str | None = None, timeout: float = 300.0, options=None, join_timeout: float | None = None) -> None:
    """Join the job described by the torchrun environment variables.

    Without any of them set, starts a world of one process. ``backend`` is
    "shm" (CPU processes of one host), "hier" (CPU processes on several
    hosts: shm inside each, torch's gloo between them), "nccl" or "ipc"
    (CUDA); None picks "nccl" when CUDA is available, else "shm" on one host
    and "hier" across hosts (see pyzero.topology). ``options`` (pz.Options or a
    dict of its fields) sets the transport of the world and, by default, of
    every subgroup.

    ``timeout`` bounds every collective; ``join_timeout`` bounds the wait for
    all ranks to join (their processes may start seconds apart), by default
    the larger of ``timeout`` and 60 s.
    """
    global _world
    if _world is not None:
        raise RuntimeError("pz.init(): already initialised; call pz.destroy() first")
    if not is_positive_finite(timeout) or not _MIN_TIMEOUT <= timeout <= _MAX_TIMEOUT:
        raise ValueError(f"timeout: expected a positive number of seconds, from {_MIN_TIMEOUT:g} to "
                         f"{_MAX_TIMEOUT:g}, got {timeout!r}")
    if join_timeout is None:
        join_timeout = max(float(timeout), 60.0)
    elif not is_positive_finite(join_timeout) or not _MIN_TIMEOUT <= join_timeout <= _MAX_TIMEOUT:
        raise ValueError(f"join_timeout: expected a positive number of seconds, from {_MIN_TIMEOUT:g} to "
                         f"{_MAX_TIMEOUT:g}, or None, got {join_timeout!r}")
    opts = Options.make(options)
    if backend is not None:
        backends.backend_class(backend)  # a bad name fails before any rendezvous
    envvars.warn_unknown()

    names = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    if not any(n in os.environ for n in names):
        rank, size, local_rank, addr, port = 0, 1, 0, "127.0.0.1", 0
    else:
        rank, size = _env_int("RANK"), _env_int("WORLD_SIZE")
        local_rank = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else None  # (unset: the host's order)
        addr = os.environ.get("MASTER_ADDR")
        if addr is None:
            raise ValueError("pz.init(): environment variable MASTER_ADDR is not set")
        if not addr.strip():
            raise ValueError("pz.init(): MASTER_ADDR is empty; expected the address of rank 0's host")
        port = _env_int("MASTER_PORT")
    if size > _MAX_WORLD:
        raise ValueError(f"pz.init(): WORLD_SIZE={size} is more ranks than pyzero takes (at most {_MAX_WORLD})")
    if size < 1 or not 0 <= rank < size:
        raise ValueError(f"pz.init(): RANK={rank} must be in [0, WORLD_SIZE={size})")
    if local_rank is not None and local_rank < 0:
        raise ValueError(f"pz.init(): LOCAL_RANK={local_rank} must be non-negative")
    if not 0 <= port <= 65535 or (port == 0 and size > 1):
        raise ValueError(f"pz.init(): MASTER_PORT={port} is not a TCP port the ranks can meet at (expected 1 to "
                         "65535; 0 only for a world of one)")
    local_size = _topology.claimed_local_size()  # a bad LOCAL_WORLD_SIZE fails here, before any rendezvous
    if local_rank is not None and local_size is not None and local_rank >= local_size:
        raise ValueError(f"pz.init(): LOCAL_RANK={local_rank} must be below LOCAL_WORLD_SIZE={local_size}")
    flight.wait_connecting()  # the previous job's store (on rank 0, perhaps this port) is let go first
    store = _connect(addr, port, size, rank, join_timeout)
    try:
        _join(store, rank, size, local_rank, backend, timeout, join_timeout, opts)
    except BaseException as e:
        publish_failure(store, _failed_key(0), rank, e)  # (the world group's set-up waits for every rank)
        _settle(store, rank, size, join_timeout, failed=True)
        raise
    _settle(store, rank, size, join_timeout, failed=False)
    flight.listen(store)


def _connect(addr: str, port: int, size: int, rank: int, join_timeout: float):
    """The job's store: rank 0 hosts it, the others connect to it.

    A rank that calls pz.init again (after pz.destroy, or after a failed pz.init) may reach the previous
    world's store, still served by rank 0 until rank 0 leaves that world too. Such a store already holds
    this rank's host report (pz/topology/<rank>, which a new store cannot hold before this rank joins
    it); the rank then connects again until it reaches the new store (within join_timeout)."""
    from torch.distributed import DistError, TCPStore  # noqa: PLC0415

    deadline = time.monotonic() + join_timeout
    while True:
        try:
            store = _bounded_store(TCPStore, addr, port, size, rank, deadline)
        except DistError as e:
            if rank == 0:
                raise CollectiveError(f"pz.init(): rank 0 could not host the job's store at {addr}:{port} "
                                      f"(MASTER_ADDR, MASTER_PORT; a port in use by another job?): {e}") from None
            raise CollectiveTimeout(f"pz.init(): rank {rank} could not reach the store at {addr}:{port} within "
                                    f"join_timeout={join_timeout:g} s: {e}") from None
        except TimeoutError as e:
            if not _listening(addr, port):
                # (the connecting thread ends soon, at its connect timeout: let it, or its error at interpreter
                # exit aborts the process)
                e.args[0].join(10.0)
                raise CollectiveTimeout(f"pz.init(): rank {rank} could not reach the store at {addr}:{port} within "
                                        f"join_timeout={join_timeout:g} s: nothing accepts connections there (rank 0 "
                                        "not started yet, a wrong MASTER_ADDR or MASTER_PORT, or a firewall)") from None
            raise CollectiveTimeout(f"pz.init(): rank {rank} reached {addr}:{port} but no job's store answered "
                                    f"there within join_timeout={join_timeout:g} s (MASTER_PORT held by another "
                                    "program?)") from None
        try:
            if rank == 0 or not store.check([f"pz/topology/{rank}"]):
                return store
        except DistError:  # the previous world's store closed as this rank reached it: connect again
            pass
        del store
        if time.monotonic() >= deadline:
            raise CollectiveTimeout(f"pz.init(): rank {rank} reached only the previous world's store at "
                                    f"{addr}:{port} within join_timeout={join_timeout:g} s (rank 0 has not called "
                                    "pz.destroy() for it)")
        time.sleep(0.05)


def _listening(addr: str, port: int) -> bool:
    """Whether something accepts a TCP connection at addr:port now (within a second)."""
    try:
        with socket.create_connection((addr, port), timeout=1.0):
            return True
    except OSError:
        return False


def _bounded_store(TCPStore, addr, port, size, rank, deadline):
    """TCPStore(...) by the deadline: its constructor can block past its own timeout (a port where some
    other program listens, a host that does not answer); run on a thread, a TimeoutError at the deadline."""
    out: list = []

    def make():
        try:
            out.append(TCPStore(addr, port, size, rank == 0, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001))))
        except BaseException as e:  # noqa: BLE001  (raised in the caller)
            out.append(e)
    t = threading.Thread(target=make, name="pyzero-store-connect", daemon=True)
    t.start()
    t.join(max(deadline - time.monotonic(), 0.0) + 1.0)
    if not out:
        raise TimeoutError(t)
    if isinstance(out[0], BaseException):
        raise out[0]
    return out[0]


def _join(store, rank: int, size: int, local_rank, backend, timeout: float, join_timeout: float, opts) -> None:
    """pz.init after the store: topology, backend, the world group."""
    global _world
    from torch.distributed import DistError  # noqa: PLC0415

    try:
        topo = _topology.exchange(store, rank, size, join_timeout, local_rank=local_rank)
    except DistError as e:
        raise CollectiveTimeout(f"pz.init(): rank {rank}: not every rank joined within join_timeout="
                                f"{join_timeout:g} s ({_topology.missing(store, size)}): {e}") from None
    store.set_timeout(datetime.timedelta(seconds=timeout))  # everyone is here: from now on, the collectives' bound
    if local_rank is None:  # (no LOCAL_RANK: this rank's place among its host's ranks, as a launcher numbers it)
        local_rank = topo.local_rank
    if rank == 0:  # (first: a rank that fails below leaves none waiting here)
        store.set("pz/token", f"{os.getpid():x}{secrets.token_hex(4)}")
    token = store.get("pz/token").decode()
    backend = _topology.pick_backend(backend, topo, torch.cuda.is_available())
    device = backends.backend_class(backend).setup_process(local_rank)
    flight.start(rank, size, token)
    _world = _World(rank, size, local_rank, backend, float(timeout), store, token, device=device, options=opts,
                    topology=topo)
    try:
        _world.world = _make_group(tuple(range(size)), opts)
    except BaseException:
        _world = None
        raise


def _settle(store, rank: int, size: int, join_timeout: float, failed: bool) -> None:
    """Every rank reports the end of its init; after a failure rank 0, which hosts the store, waits (at
    most join_timeout) until every rank that joined has, so that each gets its own error rather than a
    lost store."""
    key = "pz/init/settled"
    try:
        store.add(key, 1)
        if failed and rank == 0:
            joined = len(_topology.joined(store, size))
            deadline = time.monotonic() + join_timeout
            while store.add(key, 0) < joined and time.monotonic() < deadline:
                time.sleep(0.005)
    except Exception:  # noqa: BLE001 - the store may be gone already; the caller raises its own error
        pass


def _make_group(ranks: tuple[int, ...], options: Options, agree: bool = False) -> Group:
    """`agree`: first check that the ranks agree on `ranks` (a new_group; the world group needs not)."""
    w = _world
    gid = w.next_gid
    w.next_gid += 1  # consumed even if the ranks disagree: every rank's next group takes the next id
    if agree:
        _agree_on_ranks(w, gid, ranks)
    if w.rank not in ranks:
        return Group(ranks, -1, gid, options=options)
    me = ranks.index(w.rank)
    setup = GroupSetup(w.store, f"pz/g{gid}", f"/pz{w.token}_{gid}", me, len(ranks), w.timeout, w.device, options,
                       ranks, fail_key=_failed_key(gid))
    g = Group(ranks, me, gid, _create(_topology.group_backend(w.backend, w.topology, ranks), setup), options)
    g.flight = g._backend.flight = flight.ring(gid, ranks, me)
    w.groups.append(g)
    return g


def _failed_key(gid: int) -> str:
    return f"pz/g{gid}/failed"


def _create(backend: str, setup: GroupSetup):
    """The backend's transport for one group; a failure here is published first, so that the group's other
    ranks, waiting for this one in its set-up, raise at once naming it (not the store's timeout)."""
    try:
        return backends.backend_class(backend).create(setup)
    except BaseException as e:
        setup.fail(e)
        raise


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


def topology() -> _topology.Topology:
    """Which ranks share a host (hosts, this rank's host and local index); see pyzero.topology."""
    return _require_init().topology


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
    """A subgroup of the world; every rank of the world must call this, in the same order, with the
    same ranks (their order is the group's). ``options`` (pz.Options or a dict) overrides the world's
    options for this group."""
    w = _require_init()
    try:
        if isinstance(ranks, (str, bytes)):
            raise TypeError
        given = tuple(ranks)  # an iterator is read once
        if any(isinstance(r, bool) for r in given):
            raise TypeError
        ranks = tuple(operator.index(r) for r in given)
    except TypeError:
        _refuse_group(w, ranks)
        raise TypeError(f"ranks: expected a sequence of int global ranks, got {ranks!r}") from None
    if not ranks or len(set(ranks)) != len(ranks) or any(not 0 <= r < w.size for r in ranks):
        _refuse_group(w, ranks)
        raise ValueError(f"ranks: expected distinct global ranks in [0, {w.size}), got {list(ranks)}")
    try:
        opts = Options.make(options).merged(w.options)
    except (TypeError, ValueError) as e:
        _refuse_group(w, ranks, f"{list(ranks)} with options it refused ({e})")
        raise
    return _make_group(ranks, opts, agree=True)


def _refuse_group(w: _World, ranks, why: str | None = None) -> None:
    """A new_group call this rank refuses still uses up its group id and publishes the refusal: every
    rank's call is one group, so the others fail at once, naming it, rather than pair their call with
    this rank's next one."""
    gid = w.next_gid
    w.next_gid += 1
    w.store.set(f"pz/g{gid}/ranks/{w.rank}", json.dumps("invalid: " + (why or f"{ranks!r}, which it refused")[:300]))


def _agree_on_ranks(w: _World, gid: int, ranks: tuple[int, ...]) -> None:
    """Every rank publishes the ranks it gave new_group; a member then checks that every rank of the world
    gave the same (ranks that disagree, or disjoint subsets each calling new_group for their own group, would
    otherwise set up transports under one group id, which fail obscurely or wait for the timeout)."""
    key = f"pz/g{gid}/ranks"
    w.store.set(f"{key}/{w.rank}", json.dumps(ranks))
    from torch.distributed import DistError  # noqa: PLC0415

    # (ranks outside the group check too: told that the members disagree, they do not carry on alone)
    everyone = range(w.size)
    try:
        w.store.wait([f"{key}/{r}" for r in everyone], datetime.timedelta(seconds=w.timeout))
    except DistError as e:
        try:
            absent = [r for r in everyone if not w.store.check([f"{key}/{r}"])]
        except DistError:
            raise CollectiveError(f"new_group({list(ranks)}): the job's store (hosted by rank 0) is gone: "
                                  f"{e}") from None
        raise CollectiveTimeout(f"new_group({list(ranks)}): ranks {absent} did not call new_group within "
                                f"timeout={w.timeout:g} s (every rank of the world calls it, in the same "
                                "order)") from None
    bad = []
    try:
        raws = [w.store.get(f"{key}/{r}") for r in everyone]
    except DistError as e:
        raise CollectiveError(f"new_group({list(ranks)}): the job's store (hosted by rank 0) is gone: {e}") from None
    for r, raw in zip(everyone, raws):
        theirs = _topology.peer_json(raw, f"{key}/{r}", lambda v: type(v) is str or type(v) is list
                                     and all(type(x) is int for x in v), "a list of ranks")
        if isinstance(theirs, str):
            bad.append(f"rank {r} gave {theirs.removeprefix('invalid: ')}")
        elif theirs != list(ranks):
            bad.append(f"rank {r} gave {theirs}")
    if bad:
        raise CollectiveError(f"new_group: the ranks disagree on the group's ranks (every rank of the world calls "
                              f"new_group with the same ranks, in the same order): this rank ({w.rank}) gave "
                              f"{list(ranks)}, " + ", ".join(bad))


_STORE_BACKENDS = ("shm", "ipc", "nccl", "hier", "cpu")


def group_from_store(store, ranks: Sequence[int], rank: int, timeout: float, options=None,
                     backend: str = "shm", device: int | None = None) -> Group:
    """A group outside pz.init()'s world, set up over `store` (a torch.distributed Store that only
    this group's members use, e.g. the one torch hands a process-group backend). `ranks` are the
    members' global ranks, `rank` this process's index in them; every member calls this once.
    ``backend`` "shm" (CPU, one host), "hier" (CPU, several hosts: shm inside each, gloo between),
    "cpu" (shm where every member is on this host, else hier: the members exchange their host
    names), or "ipc" / "nccl" on CUDA device index `device` (this process's GPU); the caller
    closes the group."""
    if backend not in _STORE_BACKENDS:
        raise ValueError(f"backend: a group from a store supports {list(_STORE_BACKENDS)}, got {backend!r}")
    if backend in ("shm", "hier", "cpu"):
        device = None
    elif not is_int(device) or device < 0:
        raise ValueError(f"device: backend={backend!r} needs this process's CUDA device index, got {device!r}")
    ranks = tuple(int(r) for r in ranks)
    if not 0 <= rank < len(ranks):
        raise ValueError(f"rank: expected an index in [0, {len(ranks)}), got {rank}")
    opts = Options.make(options)
    # A store may see the same group again (a job that re-creates its process groups): each
    # creation is its own generation of keys. Every member counts itself in; a creation ends only
    # once all members have joined it (the set-up barriers), so members of one agree on its number.
    key = f"pz/{(store.add('pz/joins', 1) - 1) // len(ranks)}"
    if rank == 0:
        store.set(f"{key}/token", f"{os.getpid():x}{secrets.token_hex(4)}")
    token = store.get(f"{key}/token").decode()
    if backend == "cpu":  # one host: shm; several: hier
        store.set(f"{key}/host/{rank}", _topology.host_name())
        keys = [f"{key}/host/{r}" for r in range(len(ranks))]
        store.wait(keys, datetime.timedelta(seconds=float(timeout)))
        backend = "shm" if len({store.get(k) for k in keys}) == 1 else "hier"
    setup = GroupSetup(store, f"{key}/g", f"/pz{token}_s", rank, len(ranks), float(timeout), device, opts, ranks)
    return Group(ranks, rank, -1, _create(backend, setup), opts)


def resolve_group(group) -> Group:
    """`group`, or the world group for None; TypeError for anything else."""
    if isinstance(group, Group):  # also a group from group_from_store, which needs no pz.init()
        return group
    w = _require_init()
    if group is None:
        return w.world
    raise TypeError(f"group: expected a pz group (from pz.new_group) or None, got {type(group).__name__}")


def groups() -> list[Group]:
    """This process's live groups (the world first)."""
    return [g for g in _require_init().groups if not g._closed]


# ---------------------------------------------------------------------------
# Collectives


def all_reduce(t, op: str = "sum", group=None, async_op: bool = False, algo=None, out=None):
    """Reduce `t` across the group in place; with `out` (same numel and dtype, separate memory),
    `t` is only read and the result lands in `out`."""
    if type(async_op) is not bool:  # (bool("False") is True)
        check_bool(async_op, "async_op")
    g = resolve_group(group)
    be = g.backend
    if out is None or out is t:
        b = be.buffer(t, "tensor")
        opc, al = check_op(op, b), check_algo(algo)
        fr = g.flight
        i = 0 if fr.native else fr.begin("all_reduce", b.numel, b.code, opc, al)
        try:
            raw = be.all_reduce(b, opc, al, async_op)
        except Exception as e:
            raise fr.failed(i, e) from None
        return g.track(raw, (t,), b, i)
    bo, bi = be.buffer(out, "out"), be.buffer(t, "tensor", writable=False)
    check_same_dtype(bi, bo, "tensor", "out")
    if bo.numel != bi.numel:
        raise ValueError(f"out: expected {bi.numel} elements like tensor, got {bo.numel}")
    check_alias(bi, bo, 0, "tensor", "out")  # disjoint, or the same memory (the in-place form)
    opc, al = check_op(op, bo), check_algo(algo)
    fr = g.flight
    i = 0 if fr.native else fr.begin("all_reduce", bo.numel, bo.code, opc, al)
    try:
        if be.has_out_of_place_all_reduce:
            raw = be.all_reduce(bo, opc, al, async_op, inp=bi)
        else:
            if hasattr(out, "copy_"):
                out.copy_(t)
            else:
                out[...] = t
            raw = be.all_reduce(bo, opc, al, async_op)
    except Exception as e:
        raise fr.failed(i, e) from None
    return g.track(raw, (t, out), bo, i)


def reduce_scatter(out, inp, op: str = "sum", counts=None, group=None, async_op: bool = False, algo=None):
    """Reduce `inp` across the group; this rank's chunk of the result lands in `out`."""
    if type(async_op) is not bool:  # (bool("False") is True)
        check_bool(async_op, "async_op")
    g = resolve_group(group)
    be = g.backend
    bo, bi = be.buffer(out, "out"), be.buffer(inp, "inp", writable=False)
    check_same_dtype(bi, bo, "inp", "out")
    opc = check_op(op, bo)
    counts = resolve_counts(counts, g.size, g.rank, bi, bo, "inp", "out")
    check_alias(bi, bo, sum(counts[:g.rank]), "inp", "out")
    al = check_algo(algo)
    fr = g.flight
    i = 0 if fr.native else fr.begin("reduce_scatter", bi.numel, bi.code, opc, al)
    try:
        raw = be.reduce_scatter(bo, bi, counts, opc, al, async_op)
    except Exception as e:
        raise fr.failed(i, e) from None
    return g.track(raw, (out, inp), bo, i)


def all_gather(out, inp, counts=None, group=None, async_op: bool = False, algo=None):
    """Concatenate every rank's `inp` into `out` (rank order). `inp` may be this rank's chunk of `out`."""
    if type(async_op) is not bool:  # (bool("False") is True)
        check_bool(async_op, "async_op")
    g = resolve_group(group)
    be = g.backend
    bo, bi = be.buffer(out, "out"), be.buffer(inp, "inp", writable=False)
    check_same_dtype(bi, bo, "inp", "out")
    counts = resolve_counts(counts, g.size, g.rank, bo, bi, "out", "inp")
    check_alias(bo, bi, sum(counts[:g.rank]), "out", "inp")
    al = check_algo(algo)
    fr = g.flight
    i = 0 if fr.native else fr.begin("all_gather", bo.numel, bo.code, -1, al)
    try:
        raw = be.all_gather(bo, bi, counts, al, async_op)
    except Exception as e:
        raise fr.failed(i, e) from None
    return g.track(raw, (out, inp), bo, i)


def every_rank(values, dtype: torch.dtype = torch.int64, group=None) -> torch.Tensor:
    """Every rank's `values`: each rank of the group calls it with as many numbers (a list or a tensor); the
    result is a (group size, len(values)) CPU tensor of `dtype` whose row r holds group rank r's values. One
    all_gather, on the group's GPU for a CUDA backend (ranks agreeing on arguments, or learning who failed)."""
    g = resolve_group(group)
    if not isinstance(dtype, torch.dtype) or dtype not in DTYPES:
        raise TypeError(f"dtype: expected one of {SUPPORTED_DTYPES}, got {dtype!r}")
    try:
        mine = torch.as_tensor(values, dtype=dtype).reshape(-1).to(g.tensor_device)
    except (TypeError, ValueError, RuntimeError, OverflowError) as e:
        raise ValueError(f"values: expected numbers that fit {dtype}, got {str(values)[:80]} ({e})") from None
    out = torch.empty(g.size * mine.numel(), dtype=dtype, device=mine.device)
    all_gather(out, mine, group=g)
    return out.view(g.size, mine.numel()).cpu()


_MESSAGE_BYTES = 512


def error_text(error: BaseException) -> str:
    """`error` as failed_ranks tells the other ranks of it: "ExceptionType: message", cut to 512 bytes."""
    return f"{type(error).__name__}: {error}".encode()[:_MESSAGE_BYTES].decode(errors="ignore")


def failed_ranks(error: BaseException | None, group=None) -> list[tuple[int, str]]:
    """Collective over the group: every rank learns which ranks failed a step (`error` is this rank's
    exception, or None) and why, as (group rank, "ExceptionType: message") pairs, [] when none failed.
    One all_gather of a flag; the messages (up to 512 bytes each) travel in a second only when one failed,
    so ranks that check something on their own agree before any of them changes anything."""
    g = resolve_group(group)
    flags = every_rank([int(error is not None)], group=g)[:, 0].tolist()
    bad = [r for r, f in enumerate(flags) if f]
    if not bad:
        return []
    text = b"" if error is None else error_text(error).encode()
    mine = torch.zeros(_MESSAGE_BYTES, dtype=torch.int32)
    mine[:len(text)] = torch.tensor(list(text), dtype=torch.int32)
    every = every_rank(mine, torch.int32, g)
    return [(r, bytes(c for c in every[r].tolist() if c).decode(errors="replace")) for r in bad]


def broadcast(t, src: int = 0, group=None, async_op: bool = False, algo=None):
    """Copy `t` of global rank `src` into `t` on every rank of the group."""
    if type(async_op) is not bool:  # (bool("False") is True)
        check_bool(async_op, "async_op")
    g = resolve_group(group)
    root = g.group_rank(src, "src")
    be = g.backend
    b = be.buffer(t, "tensor")
    al = check_algo(algo)
    fr = g.flight
    i = 0 if fr.native else fr.begin("broadcast", b.numel, b.code, -1, al, root)
    try:
        raw = be.broadcast(b, root, al, async_op)
    except Exception as e:
        raise fr.failed(i, e) from None
    return g.track(raw, (t,), b, i)


def barrier(group=None, async_op: bool = False):
    """Return once every rank of the group has called barrier."""
    if type(async_op) is not bool:  # (bool("False") is True)
        check_bool(async_op, "async_op")
    g = resolve_group(group)
    be = g.backend
    fr = g.flight
    i = 0 if fr.native else fr.begin("barrier", 0, 0)
    try:
        raw = be.barrier(async_op)
    except Exception as e:
        raise fr.failed(i, e) from None
    return g.track(raw, (), None, i)


def _peer(g: Group, global_rank: int, arg: str, sending: bool) -> int:
    peer = g.group_rank(global_rank, arg)
    if peer == g.rank:
        raise ValueError(f"{arg}={global_rank}: cannot {'send to' if sending else 'receive from'} "
                         "this rank itself")
    return peer


def send(t, dst: int, group=None, async_op: bool = False):
    """Send `t` to global rank `dst` (matched by one recv there, in order)."""
    if type(async_op) is not bool:  # (bool("False") is True)
        check_bool(async_op, "async_op")
    g = resolve_group(group)
    peer = _peer(g, dst, "dst", True)
    be = g.backend
    b = be.buffer(t, "tensor", writable=False)
    fr = g.flight
    i = 0 if fr.native else fr.begin_p2p("send", b.numel, b.code, peer)
    try:
        raw = be.send(b, peer, async_op)
    except Exception as e:
        raise fr.failed(i, e) from None
    return g.track(raw, (t,), b, i)


def recv(t, src: int, group=None, async_op: bool = False):
    """Receive into `t` the next message that global rank `src` sends to this rank."""
    if type(async_op) is not bool:  # (bool("False") is True)
        check_bool(async_op, "async_op")
    g = resolve_group(group)
    peer = _peer(g, src, "src", False)
    be = g.backend
    b = be.buffer(t, "tensor")
    fr = g.flight
    i = 0 if fr.native else fr.begin_p2p("recv", b.numel, b.code, peer)
    try:
        raw = be.recv(b, peer, async_op)
    except Exception as e:
        raise fr.failed(i, e) from None
    return g.track(raw, (t,), b, i)


class P2POp(NamedTuple):
    """One point-to-point operation of batch_isend_irecv (torch.distributed.P2POp's shape)."""

    op: str  # "send" or "recv" (torch's dist.isend / dist.irecv are accepted too)
    tensor: object
    peer: int  # global rank
    group: object = None


def batch_isend_irecv(ops: Sequence[P2POp]) -> list:
    """Post sends and receives together and return their Works (one per op; waiting any waits
    for all). Use it where ranks exchange in both directions at once, e.g. a ring step's send
    to the next rank and receive from the previous: NCCL needs such calls grouped, or two ranks
    that both send first wait for each other forever. All ops in one group."""
    if not isinstance(ops, (list, tuple)) or not ops:
        raise ValueError("ops: expected a non-empty list of pz.P2POp")
    for i, o in enumerate(ops):
        if not isinstance(o, P2POp):
            raise TypeError(f"ops[{i}]: expected a pz.P2POp, got {type(o).__name__}")
    groups_ = {id(resolve_group(o.group)) for o in ops}
    if len(groups_) != 1:
        raise ValueError("ops: every P2POp must use the same group")
    g = resolve_group(ops[0].group)
    be = g.backend
    batch, keep = [], []
    for i, o in enumerate(ops):
        kind = getattr(o.op, "__name__", o.op)
        if kind in ("isend", "send"):
            batch.append((be.buffer(o.tensor, f"ops[{i}].tensor", writable=False),
                          _peer(g, o.peer, f"ops[{i}].peer", True), True))
        elif kind in ("irecv", "recv"):
            batch.append((be.buffer(o.tensor, f"ops[{i}].tensor"), _peer(g, o.peer, f"ops[{i}].peer", False), False))
        else:
            raise ValueError(f"ops[{i}].op: expected 'send' or 'recv', got {o.op!r}")
        keep.append(o.tensor)
    fr = g.flight  # recorded here even by a native backend (its transport records each send and recv)
    i = fr.begin_p2p("batch_isend_irecv", sum(b.numel for b, _, _ in batch), batch[0][0].code, batch[0][1])
    try:
        raw = be.batch_p2p(batch, True)
    except Exception as e:
        raise fr.failed(i, e) from None
    work = g.track(raw, tuple(keep), batch[0][0], i)
    return [work] * len(ops)


def comm_stats(reset: bool = False, group=None) -> dict:
    """Per-op {calls, elements, sent_bytes} of this rank, over all its groups (or one). In a job
    spanning hosts, "intra_host" and "inter_host" break the bytes down by where they went."""
    check_bool(reset, "reset")
    selected = [resolve_group(group)] if group is not None else groups()
    topo = _require_init().topology
    several_hosts = topo is not None and topo.num_hosts > 1
    out: dict = {}
    for g in selected:
        stats = g.backend.stats(reset)
        if several_hosts and "inter_host" not in stats:  # a one-host group of a multi-host job (shm)
            stats["intra_host"] = _topology.Totals.of(stats.values())
        for op, s in stats.items():
            acc = out.setdefault(op, {"calls": 0, "elements": 0, "sent_bytes": 0})
            acc["calls"] += s.calls
            acc["elements"] += s.elements
            acc["sent_bytes"] += s.sent_bytes
    return out
