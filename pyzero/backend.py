"""The one interface under pyzero's collectives, and what every backend shares.

A backend is one object per (group, process): it owns the transport (a
``_C`` communicator), turns the caller's tensors into :class:`Buffer` values
(pointer, size, dtype code, stream; validating device and layout, errors
naming the argument) and runs the collectives on buffers that
:mod:`pyzero.comm` has already checked against each other. Everything that
is the same for every backend lives here, once: the code tables (exported
by ``_C``), the argument checks, :class:`Work` and the store barrier.

This module imports no backend and nothing of pyzero but ``_C``; the
backends (``pyzero/backends/*.py``) import it, and ``pyzero.comm`` sits on
top of both.
"""
from __future__ import annotations

import abc
import datetime
import json
import operator
from dataclasses import dataclass, fields
from typing import Callable, NamedTuple, Sequence

import torch

from . import _C
from .checks import is_int
from .envvars import env_bool, env_int

CollectiveError = _C.CollectiveError
CollectiveTimeout = _C.CollectiveTimeout
MessageMismatch = _C.MessageMismatch  # a CollectiveError: a send and its recv disagree in size or dtype

# Codes shared with csrc (reduce_math.h / collective.h), exported by _C.
DTYPE_CODES: dict[str, int] = dict(_C.DTYPES)
DTYPE_NAMES: dict[int, str] = {code: name for name, code in DTYPE_CODES.items()}
DTYPES: dict[torch.dtype, int] = {getattr(torch, name): code for name, code in DTYPE_CODES.items()}
TORCH_DTYPES: dict[int, torch.dtype] = {code: dtype for dtype, code in DTYPES.items()}
OPS: dict[str, int] = dict(_C.OPS)
ALGOS: dict[str | None, int] = {None: _C.ALGOS["auto"], **_C.ALGOS}
INTEGER_CODES = frozenset(DTYPE_CODES[n] for n in ("int32", "int64"))
_EVERY_DTYPE_OPS = {name: code for name, code in OPS.items() if name != "avg"}  # 'avg': floating point only
_AUTO_ALGO = ALGOS[None]
SUPPORTED_DTYPES = ", ".join(DTYPE_CODES)


class Buffer(NamedTuple):
    """What a backend hands to C++: memory, size, dtype and (GPU) the stream it is ordered on."""

    ptr: int
    numel: int
    itemsize: int
    code: int  # dtype code (DTYPE_CODES)
    stream: int = 0  # cudaStream_t handle; 0 for host memory or the legacy default stream
    kind: str = "torch"  # "torch" (a tensor) or "array" (__cuda_array_interface__)

    @property
    def dtype(self) -> str:
        return DTYPE_NAMES[self.code]

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


def tensor_code(t, arg: str) -> int:
    """The dtype code of torch tensor `t`; TypeError naming `arg` for anything else."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}: expected a torch.Tensor, got {type(t).__name__}")
    code = DTYPES.get(t.dtype)
    if code is None:
        raise TypeError(f"{arg}: dtype {t.dtype} is not supported; expected one of {SUPPORTED_DTYPES}")
    if t.is_neg():  # (its memory holds the values' negation: a collective would read and write that)
        raise ValueError(f"{arg}: a lazily negated view (as x.conj().imag makes) is not supported; call "
                         ".resolve_neg() first")
    return code


def check_contiguous(t: torch.Tensor, arg: str) -> None:
    try:
        if t.is_contiguous() and t.layout is torch.strided:
            return
    except RuntimeError:  # (sparse compressed layouts have no is_contiguous)
        pass
    if t.layout is not torch.strided:
        raise TypeError(f"{arg}: expected a dense (torch.strided) tensor, got a {t.layout} tensor (call .to_dense() "
                        "first)")
    raise ValueError(f"{arg}: expected a contiguous tensor (call .contiguous() first)")


# ---------------------------------------------------------------------------
# Argument checks shared by every backend


def check_op(op, b: Buffer) -> int:
    code = _EVERY_DTYPE_OPS.get(op) if type(op) is str else None
    if code is not None:  # the common case: one lookup (collectives call this on every call)
        return code
    if not isinstance(op, str) or op not in OPS:
        raise ValueError(f"op: expected one of {list(OPS)}, got {op!r}")
    if op == "avg" and b.code in INTEGER_CODES:
        raise ValueError(f"op='avg' is for floating-point tensors; got {b.dtype} (use op='sum' and divide)")
    return OPS[op]


def check_algo(algo) -> int:
    if algo is None:
        return _AUTO_ALGO
    if not (algo is None or isinstance(algo, str)) or algo not in ALGOS:
        raise ValueError(f"algo: expected 'auto', 'ring', 'oneshot', 'twoshot' or (nccl backend) 'native', "
                         f"got {algo!r}")
    return ALGOS[algo]


def check_same_dtype(b: Buffer, ref: Buffer, arg: str, ref_arg: str) -> None:
    if b.code != ref.code:
        raise TypeError(f"{arg}: dtype {b.dtype} does not match {ref_arg}'s {ref.dtype}")


def check_counts(counts, n: int, total: int, arg_total: str) -> list[int]:
    try:
        given = list(counts)
        if any(isinstance(c, bool) for c in given):
            raise TypeError
        counts = [operator.index(c) for c in given]  # ints (or integer scalars), never a float cut down
    except TypeError:
        raise TypeError(f"counts: expected a sequence of {n} ints, got {counts!r}") from None
    if len(counts) != n or any(c < 0 for c in counts):
        raise ValueError(f"counts: expected {n} non-negative ints (one per rank of the group), got {counts}")
    if sum(counts) != total:
        raise ValueError(f"counts: sum(counts)={sum(counts)} must equal {arg_total}.numel()={total}")
    return counts


def resolve_counts(counts, n: int, me: int, whole: Buffer, part: Buffer, whole_arg: str, part_arg: str) -> list[int]:
    """Per-rank chunk sizes of a reduce_scatter (whole=inp, part=out) or all_gather (whole=out, part=inp)."""
    if counts is None:
        if whole.numel != n * part.numel:
            raise ValueError(f"{whole_arg}: expected {n} x {part_arg}.numel() = {n * part.numel} elements, got "
                             f"{whole.numel} (pass counts= for uneven chunks)")
        return [part.numel] * n
    counts = check_counts(counts, n, whole.numel, whole_arg)
    if counts[me] != part.numel:
        raise ValueError(f"{part_arg}: expected counts[{me}]={counts[me]} elements for this rank, got {part.numel}")
    return counts


def check_alias(big: Buffer, small: Buffer, offset: int, big_arg: str, small_arg: str) -> None:
    """`small` must be disjoint from `big`, or exactly its chunk at `offset` (the in-place form)."""
    b0, s0 = big.ptr, small.ptr  # on every call: no property frames (0.39 -> 0.22 us)
    if s0 - b0 >= big.numel * big.itemsize or b0 - s0 >= small.numel * small.itemsize or small.numel == 0:
        return  # small starts past big's end, or ends before big starts, or is empty
    if s0 != b0 + offset * big.itemsize:
        raise ValueError(f"{small_arg} overlaps {big_arg}: expected either separate memory or, for the in-place "
                         f"form, {small_arg} to be exactly this rank's chunk of {big_arg}")


# ---------------------------------------------------------------------------
# Work


class Work:
    """In-flight operation: keeps its buffers alive until waited on.

    ``wait()`` returns once the result may be used: on the host (shm), or,
    for a GPU backend, once the then-current stream is ordered after the
    operation (no host block). ``synchronize()`` always blocks the host.
    """

    __slots__ = ("_work", "_keep", "_stream")

    # (raw handle, error) -> the error to raise; pyzero.comm sets the flight recorder's explanation.
    explain: Callable = staticmethod(lambda raw, error: error)

    def __init__(self, work, keep, stream_fn: Callable[[], int] | None = None):
        self._work = work
        self._keep = keep
        self._stream = stream_fn

    def wait(self, release: bool = True) -> bool:
        """`release=False` keeps the buffers referenced (a caller that waits on a stream other than
        the one they were allocated on holds the work until that stream has passed the wait)."""
        try:
            if self._stream is None:
                self._work.wait()
            else:
                self._work.wait(self._stream())
        except CollectiveError as e:
            raise Work.explain(self._work, e) from None
        if release:
            self._keep = None
        return True

    def synchronize(self) -> bool:
        """Block the host until the operation has finished."""
        try:
            if self._stream is None:
                self._work.wait()
            else:
                self._work.synchronize()
        except CollectiveError as e:
            raise Work.explain(self._work, e) from None
        self._keep = None
        return True

    def is_completed(self) -> bool:
        return self._work.is_completed()

    def done(self) -> bool:
        """Waited on, or known to be complete: its buffers may be released. (A call captured into
        a CUDA graph is done once waited on: the host cannot see its replays.)"""
        return self._keep is None or (not getattr(self._work, "captured", False) and self._work.is_completed())


class RawGroup:
    """Several raw handles waited for as one (Backend.batch_p2p's default)."""

    __slots__ = ("raws",)

    def __init__(self, raws):
        self.raws = raws

    def wait(self, *stream) -> bool:
        for r in self.raws:
            r.wait(*stream)
        return True

    def synchronize(self) -> bool:
        for r in self.raws:
            (r.synchronize if hasattr(r, "synchronize") else r.wait)()
        return True

    def is_completed(self) -> bool:
        return all(r.is_completed() for r in self.raws)


# ---------------------------------------------------------------------------
# Per-group options


@dataclass(frozen=True)
class Options:
    """Transport settings of a group (``pz.init(options=...)``, ``pz.new_group(ranks, options=...)``).

    None means the backend's default, which an environment variable may set
    (in brackets); a subgroup without options inherits the world's. Every rank of a group must
    resolve the same values (the shm backend checks when it makes the group).

    - slice_bytes: ring pipelining slice (shm 256 KiB [PYZERO_SHM_SLICE_KB], a multiple of 64 bytes from 4096;
      nccl 4 MiB [PYZERO_NCCL_SLICE_KB]);
      ipc: each rank's registered area, the largest piece of one call (32 MiB [PYZERO_IPC_AREA_KB])
    - depth: shm slots per peer (8 [PYZERO_SHM_DEPTH]); ipc, slots per block of a point-to-point channel
      (4 [PYZERO_IPC_DEPTH])
    - oneshot_bytes: largest message of the one-shot path (shm 512 KiB [PYZERO_SHM_ONESHOT_KB]; nccl, ipc 256 KiB
      [PYZERO_NCCL_ONESHOT_KB / PYZERO_IPC_ONESHOT_KB])
    - stream_bytes: shm, out-of-place all_reduce and reduce_scatter outputs of at least this many bytes are
      written with streaming stores, which skip reading the output's lines first (8 MiB [PYZERO_SHM_STREAM_KB])
    - twoshot_bytes: shm, the two-shot all_reduce's area (8 MiB [PYZERO_SHM_TWOSHOT_KB]): larger messages go
      through it in pieces; with oneshot_bytes it sizes each rank's two areas
    - twoshot_stream_bytes: shm, two-shot all_reduces of at least this many bytes write what their peers read
      with streaming stores (4 KiB [PYZERO_SHM_TWOSHOT_STREAM_KB])
    - adaptive: shm, auto all_reduce above 2 KiB takes the one-shot (up to oneshot_bytes) or the ring, or
      the two-shot, by measured times (True [PYZERO_SHM_ADAPTIVE]; False: the one-shot or the ring by size)
    - symmetric: fused TP ops over symmetric buffers where the backend has them (True [PYZERO_SYMMETRIC])
    - blocking_wait: nccl, synchronous calls wait on the host (False [PYZERO_NCCL_BLOCKING_WAIT])
    - p2p_bytes: ipc, each ordered pair's point-to-point channel in the receiver's registered buffer; a rank
      holds n - 1 of them (4 MiB [PYZERO_IPC_P2P_KB])
    - check_calls: hier, compare every collective's arguments across the group before it runs, so a
      mismatch is an error on every rank (True [PYZERO_HIER_CHECK])
    - system_scope: ipc, order the kernels' flags at system scope even where every rank of the group is on
      one GPU, where GPU scope suffices and is taken by default (False [PYZERO_IPC_SYSTEM_SCOPE])
    """

    slice_bytes: int | None = None
    depth: int | None = None
    oneshot_bytes: int | None = None
    stream_bytes: int | None = None
    twoshot_bytes: int | None = None
    twoshot_stream_bytes: int | None = None
    adaptive: bool | None = None
    symmetric: bool | None = None
    blocking_wait: bool | None = None
    check_calls: bool | None = None
    p2p_bytes: int | None = None
    system_scope: bool | None = None

    def __post_init__(self):
        for name in ("slice_bytes", "depth", "oneshot_bytes", "stream_bytes", "twoshot_bytes", "twoshot_stream_bytes",
                     "p2p_bytes"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 0):
                raise ValueError(f"options.{name}: expected a non-negative int or None, got {v!r}")
        if self.depth is not None and self.depth < 2:
            raise ValueError(f"options.depth: expected at least 2 slots, got {self.depth}")
        if self.slice_bytes is not None and self.slice_bytes < 64:
            raise ValueError(f"options.slice_bytes: expected at least 64 bytes, got {self.slice_bytes}")
        for name in ("adaptive", "symmetric", "blocking_wait", "check_calls", "system_scope"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, bool):
                raise ValueError(f"options.{name}: expected True, False or None, got {v!r}")

    @classmethod
    def make(cls, options) -> "Options":
        """Options from None, an Options or a dict of its fields; errors name the argument."""
        if options is None:
            return cls()
        if isinstance(options, cls):
            return options
        if isinstance(options, dict):
            names = {f.name for f in fields(cls)}
            unknown = sorted(set(options) - names)
            if unknown:
                raise ValueError(f"options: unknown field(s) {unknown}; expected some of {sorted(names)}")
            return cls(**options)
        raise TypeError(f"options: expected pz.Options, a dict or None, got {type(options).__name__}")

    def merged(self, base: "Options") -> "Options":
        """These options, with the unset fields taken from `base`."""
        return Options(**{f.name: (getattr(self, f.name) if getattr(self, f.name) is not None
                                   else getattr(base, f.name)) for f in fields(self)})

    def get(self, name: str, default, env: str | None = None, kib: bool = False):
        """Field `name`, else the environment variable `env` (KiB when `kib`), else `default`."""
        v = getattr(self, name)
        if v is not None:
            return v
        if not env:
            return default
        if isinstance(default, bool):
            return env_bool(env, default)
        return env_int(env, default, kib=kib)


# ---------------------------------------------------------------------------
# Set-up context and the interface


@dataclass
class GroupSetup:
    """What a backend needs to make its communicator for one group of one process."""

    store: object  # a torch.distributed Store shared by the job
    key: str  # store key prefix unique to the group (e.g. "pz/g3")
    name: str  # a name unique to the group and the job (shared-memory segment prefix)
    rank: int  # this process's index in the group
    size: int
    timeout: float  # seconds
    device: int | None  # this process's GPU (GPU backends), else None
    options: Options
    global_ranks: tuple[int, ...] = ()  # the group's members as global ranks (for messages naming them)
    fail_key: str = ""  # where a rank whose set-up failed says so (default: key + "/failed"; kept by replace())

    @property
    def failed_key(self) -> str:
        return self.fail_key or self.key + "/failed"

    @property
    def global_rank(self) -> int:
        """This process's global rank (its group index where the members' global ranks are not given)."""
        return self.global_ranks[self.rank] if self.global_ranks else self.rank

    def fail(self, error: BaseException) -> None:
        """Tell the group's other ranks, waiting in wait() or barrier(), that this rank's set-up failed."""
        publish_failure(self.store, self.failed_key, self.global_rank, error)

    def wait(self, keys: Sequence[str]) -> list[bytes] | None:
        """Wait until every key is set and return their values; a CollectiveError naming the rank as soon as
        one reports (fail()) that its set-up failed, a CollectiveTimeout after `timeout` seconds.

        The wait is the store's own (it returns the moment the keys are set, even if the rank hosting the
        store leaves right after). A waiter first lists its keys under the failure key; a rank that fails
        sets the failure, then every listed key to a marker, which ends the waits: a key read as the marker
        means the set-up failed (a key set by its rank means this wait succeeded, whatever fails later). The
        store serialises the calls: a waiter that listed its keys after the failing rank read the list finds
        the failure in its check before waiting. None where the keys were set but the store is gone before
        they could be read (the rank hosting it finished and left)."""
        from torch.distributed import DistError  # noqa: PLC0415

        keys, s = list(keys), self.store
        if not s.check(keys):
            i = s.add(self.failed_key + "/waiters", 1)
            s.set(f"{self.failed_key}/waiting/{i}", json.dumps(keys))
            if s.check([self.failed_key]):
                self._raise_failed()
            try:
                s.wait(keys, datetime.timedelta(seconds=self.timeout))
            except DistError:
                if _failed(s, self.failed_key):
                    self._raise_failed()
                raise CollectiveTimeout(f"the group's set-up waited timeout={self.timeout:g} s for "
                                        f"{_shown_keys(s, keys)} (a rank of the group that never called, or "
                                        "stopped)") from None
        try:
            values = [s.get(k) for k in keys]
        except DistError:
            return None
        if any(v == _SET_UP_FAILED for v in values):
            self._raise_failed()
        return values

    def _raise_failed(self) -> None:
        try:
            why = self.store.get(self.failed_key).decode(errors="replace")
        except Exception:  # noqa: BLE001 - the store is gone
            why = "another rank (the job's store is gone)"
        which = f"group {list(self.global_ranks)}" if self.global_ranks else "the group"
        raise CollectiveError(f"{which}: set-up failed on {why}")

    def get(self, key: str) -> bytes:
        values = self.wait([key])
        if values is None:
            raise CollectiveError(f"the group's set-up: the job's store (hosted by global rank 0) is gone before "
                                  f"{key} could be read")
        return values[0]

    def barrier(self, name: str) -> None:
        """Return once every rank of the group has called this with `name` (or raise as wait())."""
        key = f"{self.key}/{name}"
        if self.store.add(key, 1) == self.size:
            self.store.set(key + "/done", "1")
        self.wait([key + "/done"])


_SET_UP_FAILED = b"pz-set-up-failed"  # what a failing rank sets the keys its group's ranks wait for to


def _failed(store, key: str) -> bool:
    try:
        return store.check([key])
    except Exception:  # noqa: BLE001 - the store is gone
        return False


def publish_failure(store, key: str, rank: int, error: BaseException) -> None:
    """Set `key` to "rank R: error" unless a rank set it first, then every key a rank waits for in
    GroupSetup.wait (listed under `key`), so that those waits end and find the failure."""
    try:
        if not store.check([key]):
            store.set(key, f"rank {rank}: {type(error).__name__}: {error}"[:2000])
        for i in range(1, store.add(key + "/waiters", 0) + 1):
            listed = f"{key}/waiting/{i}"
            if store.check([listed]):
                waited = json.loads(store.get(listed))
                for k in waited if isinstance(waited, list) else ():
                    if isinstance(k, str) and not store.check([k]):
                        store.set(k, _SET_UP_FAILED)
    except Exception:  # noqa: BLE001 - the store may be gone already; the caller raises its own error
        pass


def _shown_keys(store, keys: Sequence[str]) -> str:
    try:
        missing = [k for k in keys if not store.check([k])]
    except Exception:  # noqa: BLE001 - the store is gone (the rank hosting it left)
        return f"{len(keys)} key(s) in a store that is gone (the rank hosting it, global rank 0, left)"
    return ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")


class Backend(abc.ABC):
    """One group's transport in one process. Methods take buffers already checked by pyzero.comm
    (dtype codes equal, counts summing right, no bad aliasing) and return None for a synchronous
    call or the transport's raw work handle for an asynchronous one (wrapped by :meth:`work`)."""

    name: str = ""
    has_symmetric = False  # fused ops on symmetric buffers (pyzero.symmetric)
    # all_reduce(..., inp=Buffer) reads inp and writes b (else comm copies, then reduces in place)
    has_out_of_place_all_reduce = False
    flight = None  # the group's flight recorder, a pyzero.flight.Ring (set by pyzero.comm)

    @classmethod
    def setup_process(cls, local_rank: int) -> int | None:
        """Once per process at pz.init(), before any group: returns this process's device (or None)."""
        return None

    @classmethod
    @abc.abstractmethod
    def create(cls, setup: GroupSetup) -> "Backend":
        """Make this process's communicator for a group (a collective call over the store)."""

    @abc.abstractmethod
    def buffer(self, x, arg: str, writable: bool = True) -> Buffer:
        """Validate `x` for this backend (type, dtype, device, layout); errors name `arg`."""

    @abc.abstractmethod
    def all_reduce(self, b: Buffer, op: int, algo: int, async_op: bool): ...

    @abc.abstractmethod
    def reduce_scatter(self, out: Buffer, inp: Buffer, counts: Sequence[int], op: int, algo: int, async_op: bool): ...

    @abc.abstractmethod
    def all_gather(self, out: Buffer, inp: Buffer, counts: Sequence[int], algo: int, async_op: bool): ...

    @abc.abstractmethod
    def broadcast(self, b: Buffer, root: int, algo: int, async_op: bool): ...

    @abc.abstractmethod
    def barrier(self, async_op: bool): ...

    @abc.abstractmethod
    def send(self, b: Buffer, peer: int, async_op: bool): ...

    @abc.abstractmethod
    def recv(self, b: Buffer, peer: int, async_op: bool): ...

    @abc.abstractmethod
    def stats(self, reset: bool) -> dict:
        """Per-op objects with calls, elements and sent_bytes."""

    @abc.abstractmethod
    def close(self) -> None:
        """Finish queued work and release the transport."""

    def batch_p2p(self, ops: Sequence[tuple[Buffer, int, bool]], async_op: bool):
        """Sends and receives (buffer, peer, is_send) posted together. This default posts each
        asynchronously (a transport whose sends never wait for the receiver needs nothing more);
        the nccl backend groups them in one ncclGroupStart/End."""
        raws = [self.send(b, peer, True) if is_send else self.recv(b, peer, True) for b, peer, is_send in ops]
        raw = RawGroup([r for r in raws if r is not None])
        if async_op:
            return raw
        raw.wait()
        return None

    def work(self, raw, keep, b: Buffer | None) -> Work:
        """Wrap a raw async handle; `keep` stays alive until it is waited on."""
        return Work(raw, keep)
