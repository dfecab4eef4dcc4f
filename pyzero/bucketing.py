"""Gradient buckets: which parameters share a bucket, the bucket's flat
storage, the fused pack/unpack loops, and the hook-driven reducer that
launches one collective per bucket while backward is still running.

Roles:
    cut_runs        the bucket cutter: consecutive items into runs of at least a cap
    assign_buckets  parameters -> BucketSpec list (pure; unit-tested without ranks)
    flat_buckets    a ZeRO flat layout -> contiguous ranges of about a bucket each
    pack / unpack   one C++ call copies, scales and casts a whole table of tensors
                    into / out of a flat buffer (csrc/multi_tensor.h)
    Bucket          a bucket's flat gradient storage (gradients are views into it,
                    like DDP's gradient_as_bucket_view) and its optional buffer in
                    the communication dtype
    InFlight        launched collectives not yet waited on, each with what to do once
                    it is done; retired in launch order, at most `limit` outstanding
    DeviceFlags     per-parameter int32 "used" flags on the device, copied from the host
                    once per distinct vector (none per step, none in a graph capture)
    OrderedLaunch   counts ready gradients per bucket and launches complete buckets
                    in bucket order on every rank (shared with ZeRO stages 2 and 3)
    BucketReducer   feeds OrderedLaunch from post-accumulate-grad hooks, launches a
                    bucket's collective asynchronously, and waits for everything
                    when backward ends

BucketReducer is generic over the collective: subclasses give ``_reduce``
(all-reduce avg for DataParallel; a ZeRO stage would reduce-scatter) and
``_finalize`` (what to do with a reduced bucket).
"""
from __future__ import annotations

import contextlib
import itertools
import weakref
from typing import NamedTuple

import torch

from . import _C, comm
from .backend import check_contiguous, tensor_code
from .checks import is_real

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class BucketSpec(NamedTuple):
    """Bucket `index` holds params[i] for i in `params` at flat offsets `offsets` (elements)."""

    index: int
    dtype: torch.dtype
    device: torch.device
    params: tuple[int, ...]
    offsets: tuple[int, ...]
    numel: int


def cut_runs(sizes, cap, first_cap=None) -> list[list[int]]:
    """Cut a sequence into runs of consecutive indices: a run closes once its sizes add up to
    at least its cap (so one big item makes a run of its own); the first run's cap is
    `first_cap` when given. The one bucket cutter: DataParallel's buckets (assign_buckets, per
    dtype and device) and the ZeRO stages' flat ranges (flat_buckets) are both cut with it."""
    runs, members, size = [], [], 0
    for i, n in enumerate(sizes):
        members.append(i)
        size += n
        if size >= (first_cap if first_cap is not None and not runs else cap):
            runs.append(members)
            members, size = [], 0
    if members:
        runs.append(members)
    return runs


def assign_buckets(params, bucket_bytes: int, first_bucket_bytes: int) -> list[BucketSpec]:
    """Cut `params` (registration order) into buckets, as DDP does.

    Parameters are taken in *reverse* order, the order backward makes their
    gradients ready. Each (dtype, device) has its own buckets; a bucket is
    closed once it holds at least its cap in bytes (so one big parameter makes
    a bucket of its own). The first bucket of each (dtype, device) is capped
    at `first_bucket_bytes`, so the first collective starts early in backward;
    the rest at `bucket_bytes`. Buckets are ordered by their first parameter,
    i.e. by when they should become ready.
    """
    if bucket_bytes <= 0 or first_bucket_bytes <= 0:
        raise ValueError(f"bucket sizes must be positive, got bucket_bytes={bucket_bytes}, "
                         f"first_bucket_bytes={first_bucket_bytes}")
    by_key: dict[tuple, list[int]] = {}
    for i in reversed(range(len(params))):
        by_key.setdefault((params[i].dtype, params[i].device), []).append(i)
    done = []
    for idx in by_key.values():
        runs = cut_runs([params[i].numel() * params[i].element_size() for i in idx], bucket_bytes,
                        first_bucket_bytes)
        done.extend([idx[k] for k in run] for run in runs)
    order = {i: pos for pos, i in enumerate(reversed(range(len(params))))}
    done.sort(key=lambda m: order[m[0]])
    specs = []
    for b, members in enumerate(done):
        offsets, total = [], 0
        for i in members:
            offsets.append(total)
            total += params[i].numel()
        p0 = params[members[0]]
        specs.append(BucketSpec(b, p0.dtype, p0.device, tuple(members), tuple(offsets), total))
    return specs


# ---------------------------------------------------------------------------
# Fused pack / unpack


def flat_buckets(layout, bucket_elems: int) -> list[tuple[int, int, list[int]]]:
    """Cut a flat layout (zero.partition.FlatLayout: parameters end to end, padded) into
    contiguous [begin, end) ranges of about `bucket_elems`, on parameter boundaries, as
    (begin, end, parameter indices); the padding joins the last range."""
    out = []
    for run in cut_runs([p.numel() for p in layout.params], bucket_elems):
        last = run[-1]
        out.append((layout.offsets[run[0]], layout.offsets[last] + layout.params[last].numel(), run))
    if out:
        out[-1] = (out[-1][0], layout.padded, out[-1][2])
    return out


def _table(tensors, offsets, flat: torch.Tensor, arg: str):
    """Validated (ptrs, numels, dtype codes, offsets), adjacent rows merged into one."""
    if len(tensors) != len(offsets):
        raise ValueError(f"offsets: expected one offset per tensor ({len(tensors)}), got {len(offsets)}")
    ptrs, numels, codes, offs = [], [], [], []
    for k, (t, o) in enumerate(zip(tensors, offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{arg}[{k}]: expected a torch.Tensor, got {type(t).__name__}")
        code = tensor_code(t, f"{arg}[{k}]")
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(f"{arg}[{k}]: expected a contiguous CPU tensor, got device {t.device}, "
                             f"contiguous={t.is_contiguous()}")
        o, n = int(o), t.numel()
        if o < 0 or o + n > flat.numel():
            raise ValueError(f"offsets[{k}]={o}: tensor of {n} elements does not fit the flat buffer "
                             f"of {flat.numel()}")
        ptr = t.data_ptr()
        if ptrs and codes[-1] == code and offs[-1] + numels[-1] == o and \
                ptrs[-1] + numels[-1] * t.element_size() == ptr:
            numels[-1] += n  # contiguous in memory and in the flat buffer: one longer row
            continue
        ptrs.append(ptr)
        numels.append(n)
        codes.append(code)
        offs.append(o)
    return ptrs, numels, codes, offs


def _flat_code(flat, scale) -> int:
    code = tensor_code(flat, "flat")
    check_contiguous(flat, "flat")
    if not is_real(scale):
        raise TypeError(f"scale: expected a float, got {type(scale).__name__}")
    return code


def _device_copies(tensors, flat, offsets, scale, into_flat: bool) -> None:
    """pack/unpack for tensors on a GPU: torch copies with the C++ loops' arithmetic (the
    source in fp32, or fp64 for fp64, times the scale in that type, rounded once; integers
    copied, never scaled); every tensor on flat's device."""
    if len(tensors) != len(offsets):
        raise ValueError(f"offsets: expected one offset per tensor ({len(tensors)}), got {len(offsets)}")
    for k, (t, o) in enumerate(zip(tensors, offsets)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensors[{k}]: expected a torch.Tensor, got {type(t).__name__}")
        if t.device != flat.device:
            raise ValueError(f"tensors[{k}]: on {t.device}, but flat is on {flat.device}")
        o, n = int(o), t.numel()
        if o < 0 or o + n > flat.numel():
            raise ValueError(f"offsets[{k}]={o}: tensor of {n} elements does not fit the flat buffer "
                             f"of {flat.numel()}")
        seg = flat[o:o + n]
        src, dst = (t.reshape(-1), seg) if into_flat else (seg, t.view(-1))
        if scale == 1.0 or not src.is_floating_point():
            dst.copy_(src)
        else:
            acc = torch.float64 if src.dtype == torch.float64 else torch.float32
            dst.copy_(src.to(acc) * torch.tensor(scale, dtype=acc, device=src.device))


def _device_fused(tensors, flat, offsets, scale, to_flat: bool) -> bool:
    """One fused kernel launch (csrc multi_tensor_kernel) on the current stream for same-dtype
    contiguous CUDA tensors; False where it does not apply (then torch copies do it)."""
    if flat.device.type != "cuda" or not hasattr(_C, "cuda_multi_tensor") or not tensors:
        return False
    dtype = tensors[0].dtype
    if any(not isinstance(t, torch.Tensor) or t.dtype != dtype or t.device != flat.device or not t.is_contiguous()
           for t in tensors) or len(offsets) != len(tensors):
        return False
    offs = [int(o) for o in offsets]
    if any(o < 0 or o + t.numel() > flat.numel() for t, o in zip(tensors, offs)):
        return False  # the torch path names the bad offset
    _C.cuda_multi_tensor([t.data_ptr() for t in tensors], [t.numel() for t in tensors], offs,
                         tensor_code(tensors[0], "tensors[0]"), flat.data_ptr(), tensor_code(flat, "flat"), to_flat,
                         float(scale), torch.cuda.current_stream(flat.device).cuda_stream)
    return True


def _device_move(tensors, flat, offsets, scale, to_flat: bool) -> None:
    """pack (to_flat) or unpack on a GPU: one fused kernel, or torch copies for mixed dtypes."""
    _flat_code(flat, scale)
    tensors, offsets = list(tensors), list(offsets)
    if not _device_fused(tensors, flat, offsets, scale, to_flat):
        _device_copies(tensors, flat, offsets, float(scale), to_flat)


def pack(tensors, flat: torch.Tensor, offsets, scale: float = 1.0) -> None:
    """flat[o:o + t.numel()] = (scale * t) cast to flat.dtype, for every (t, o), in one C++ pass
    (CPU tensors; CUDA tensors: one fused kernel, or torch copies for mixed dtypes)."""
    if flat.device.type != "cpu":
        return _device_move(tensors, flat, offsets, scale, True)
    code = _flat_code(flat, scale)
    ptrs, numels, codes, offs = _table(tensors, offsets, flat, "tensors")
    _C.multi_tensor_pack(ptrs, numels, codes, offs, flat.data_ptr(), code, flat.numel(), float(scale))


def unpack(flat: torch.Tensor, tensors, offsets, scale: float = 1.0) -> None:
    """t[:] = (scale * flat[o:o + t.numel()]) cast to t.dtype, for every (t, o), in one C++ pass
    (CPU tensors; CUDA tensors: one fused kernel, or torch copies for mixed dtypes)."""
    if flat.device.type != "cpu":
        return _device_move(tensors, flat, offsets, scale, False)
    code = _flat_code(flat, scale)
    ptrs, numels, codes, offs = _table(tensors, offsets, flat, "tensors")
    _C.multi_tensor_unpack(flat.data_ptr(), code, flat.numel(), ptrs, numels, codes, offs, float(scale))


# Dtypes the collectives do not carry travel widened (broadcast_coalesced), and are cast back.
WIDEN = {torch.bool: torch.int32, torch.uint8: torch.int32, torch.int8: torch.int32, torch.int16: torch.int32}


def broadcast_coalesced(tensors, src: int, group) -> None:
    """Copy `tensors` of global rank `src` to every rank of `group`: one broadcast
    per dtype, packed and unpacked by the fused C++ loops."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        t = torch.view_as_real(t) if t.is_complex() else t
        by_dtype.setdefault(WIDEN.get(t.dtype, t.dtype), []).append(t)
    is_src = group.ranks[group.rank] == src  # (a group from a store, pz_group's, needs no pz.init())
    for wire_dtype, ts in by_dtype.items():
        # Tensors the loops cannot read or write directly go through a contiguous wire-dtype copy.
        direct = [t.dtype == wire_dtype and t.is_contiguous() for t in ts]
        work = [t if d else t.detach().contiguous().to(wire_dtype) for t, d in zip(ts, direct)]
        offsets = [0]
        for t in work[:-1]:
            offsets.append(offsets[-1] + t.numel())
        flat = torch.empty(offsets[-1] + work[-1].numel(), dtype=wire_dtype, device=work[0].device)
        if is_src:
            pack(work, flat, offsets)
        comm.broadcast(flat, src=src, group=group)
        if not is_src:
            # As DDP's buffer broadcast, the copies keep the tensors' version counters: a buffer a forward saved
            # for backward (two forwards, one backward) is not "modified by an inplace operation" by the next.
            with contextlib.ExitStack() as versions:
                for t in ts:
                    versions.enter_context(torch.autograd._unsafe_preserve_version_counter(t))
                unpack(flat, work, offsets)
                for t, w, d in zip(ts, work, direct):
                    if not d:
                        t.copy_(w)


# ---------------------------------------------------------------------------
# Buckets


class Bucket:
    """One bucket's storage. Owns `flat` (gradient dtype; gradients are views of
    flat[:numel]) plus `extra` trailing elements a reducer may use, and, when
    the communication dtype differs, `comm` of the same length in that dtype.

    A gradient moves into its slot when autograd has made it (adopt(): one copy,
    or one cast into `comm`), as DDP's gradient_as_bucket_view does; stage()
    fills the slots no gradient was adopted into before the bucket travels."""

    def __init__(self, spec: BucketSpec, params, comm_dtype=None, extra: int = 0):
        self.spec = spec
        self.params = [params[i] for i in spec.params]
        self.numel = spec.numel
        self.flat = torch.zeros(spec.numel + extra, dtype=spec.dtype, device=spec.device)
        self.views = [self.flat[o:o + p.numel()].view(p.shape) for p, o in zip(self.params, spec.offsets)]
        use_comm = comm_dtype is not None and comm_dtype != spec.dtype
        self.comm = torch.empty(self.flat.numel(), dtype=comm_dtype, device=spec.device) if use_comm else None
        self.packed = [False] * len(self.params)  # (with `comm`) cast into it by adopt() since the last stage()

    @property
    def buffer(self) -> torch.Tensor:
        """What travels: the communication-dtype copy, or the gradient storage itself."""
        return self.flat if self.comm is None else self.comm

    def is_view(self, k: int) -> bool:
        g = self.params[k].grad
        return g is not None and g.data_ptr() == self.views[k].data_ptr()

    def adopt(self, k: int) -> None:
        """Move parameter k's gradient, just accumulated by autograd, into its slot and point the
        gradient at it; the tensor autograd made is then freed. A gradient that is already its
        slot (accumulated in place) stays. With `comm`, the gradient is cast into `comm` instead
        and `flat` takes the reduced values at unstage()."""
        p = self.params[k]
        o = self.spec.offsets[k]
        if self.comm is not None:
            self.comm[o:o + p.numel()].copy_(p.grad.reshape(-1))
            self.packed[k] = True
        elif not self.is_view(k):
            self.views[k].copy_(p.grad)
        else:
            return
        p.grad = self.views[k]

    def stage(self) -> list[bool]:
        """Make `buffer` hold every gradient: pack those not adopted (no gradient on
        this rank: zeros; set by the user or made outside a synced backward: copied)
        and point every gradient at its slot. Returns which gradients were missing
        (None: they contribute zeros)."""
        missing = [p.grad is None for p in self.params]
        if self.comm is None:
            rest = [k for k in range(len(self.params)) if not self.is_view(k)]
        else:
            rest = [k for k in range(len(self.params)) if not self.packed[k]]
            self.packed = [False] * len(self.params)
        if rest:
            self._pack_into(self.buffer, rest)
        for k, p in enumerate(self.params):
            if not self.is_view(k):
                p.grad = self.views[k]
        return missing

    def _pack_into(self, buf, ks) -> None:
        srcs, offs = [], []
        for k in ks:
            g = self.params[k].grad
            o = self.spec.offsets[k]
            if g is None:  # no gradient on this rank: contributes zeros
                buf[o:o + self.params[k].numel()].zero_()
                continue
            srcs.append(g.contiguous())
            offs.append(o)
        pack(srcs, buf, offs)

    def unstage(self) -> None:
        """Cast the reduced `comm` buffer back into the gradient storage."""
        if self.comm is not None:
            unpack(self.comm, [self.flat[:self.numel]], [0])


# ---------------------------------------------------------------------------
# The reducer


class InFlight:
    """Collectives launched and not yet waited on, in launch order, each with a `done()` to run
    once it has finished (fold a reduced bucket into its shard, unpack it, ...).

    ``add`` retires the oldest ones while more than `limit` are outstanding (None: no bound;
    0: each is waited for at once), which bounds the staging memory in-flight buckets hold.
    ``retire`` waits for all (or the k oldest) and runs their done(); ``discard`` waits for all
    and runs nothing (a backward that cannot finish: every rank launched the collectives, so
    they are waited for, but their results are dropped). Used by BucketReducer and the ZeRO
    stages that reduce during backward.
    """

    def __init__(self, limit: int | None = None):
        self.limit = limit
        self._items: list[tuple[object, object, object]] = []

    def __len__(self) -> int:
        return len(self._items)

    def entries(self) -> list[tuple[object, object]]:
        """(key, Work) of each outstanding collective, oldest first."""
        return [(key, work) for work, _, key in self._items]

    def add(self, work, done=None, key=None) -> None:
        self._items.append((work, done, key))
        if self.limit is not None and len(self._items) > self.limit:
            self.retire(len(self._items) - self.limit)

    def retire(self, k: int | None = None) -> None:
        for _ in range(len(self._items) if k is None else k):
            work, done, _ = self._items.pop(0)
            work.wait()
            if done is not None:
                done()

    def discard(self) -> None:
        items, self._items = self._items, []
        for work, _, _ in items:
            work.wait()

    def forget(self) -> None:
        """Drop everything without waiting (after one of them raised)."""
        self._items = []


def device_capturing(device: torch.device) -> bool:
    """Whether work issued now for `device` is captured into a CUDA graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


class DeviceFlags:
    """Per-parameter int32 flags (which parameters got a gradient) as device tensors to all-reduce.

    Each distinct vector is copied from the host once and cloned on the device after, so a step
    makes no host-to-device copy, and a step captured into a CUDA graph makes none at all: its
    replays read the tensor its clone came from, which is kept for them. A vector that no eager
    step made cannot be made inside a capture (a clear error naming `owner`). Up to `keep`
    vectors not read by a capture are cached (models whose used parameters vary by step).
    Used by DataParallel's reducer and ZeroOptimizer (see [Note: DataParallel's used flags]).
    """

    def __init__(self, owner: str, keep: int = 8):
        self.owner, self.keep = owner, keep
        self._made: dict[tuple, torch.Tensor] = {}
        self._captured: set[tuple] = set()

    def __len__(self) -> int:
        return len(self._made)

    def get(self, values, device: torch.device, capturing: bool) -> torch.Tensor:
        """A fresh device tensor holding `values` (the all-reduce writes it); `capturing`: whether
        the caller's stream is capturing a CUDA graph."""
        key = tuple(int(v) for v in values)
        made = self._made.get(key)
        if made is None:
            if capturing:
                raise RuntimeError(
                    f"{self.owner}: a backward captured into a CUDA graph used other parameters than the eager "
                    "steps before the capture; run an eager step of the same model (warm-up, as "
                    "torch.cuda.graph asks) before capturing it")
            if len(self._made) >= self.keep:
                for k in [k for k in self._made if k not in self._captured]:
                    del self._made[k]
            made = self._made[key] = torch.tensor(key, dtype=torch.int32).to(device)
        if capturing:
            self._captured.add(key)
        return made.clone()


class OrderedLaunch:
    """When each bucket of one backward launches; ``launch(b)`` does the launching.

    [Note: bucket launch order] Collectives of one group run in call order, so
    every rank must launch the buckets in the same order whatever order its
    hooks fire in. A bucket launches when all its gradients are ready *and*
    every bucket before it has launched (``ready``). The first hook of a
    backward (``begin()`` is True) queues an autograd engine callback; when it
    runs, at the end of backward, the buckets still waiting launch, in order,
    with zeros for the gradients that never came (``finish``), and the caller
    ``reset()``s for the next backward. Users: BucketReducer (DataParallel),
    ZeroStage2 (zero/stages.py) and ZeroStage3 (zero/stage3.py, units as buckets).

    ``abandon()`` is the caller's way to drop a backward that cannot finish
    (wait for what it launched, keep nothing, reset); ``ready`` calls it before
    raising. A caller that must hold complete buckets back (reducers sharing a
    group, see [Note: reducers sharing a group]) counts with ``ready(...,
    launch=False)`` and launches with ``advance()`` when it may.
    """

    def __init__(self, sizes, launch, abandon):
        self._sizes = list(sizes)  # gradients per bucket
        self._launch = launch
        self._abandon = abandon
        self.reset()

    def reset(self) -> None:
        self._pending = list(self._sizes)
        self._next = 0
        self.in_backward = False
        self._seen: set = set()

    def begin(self) -> bool:
        """Called by every hook: True for the first of a backward (queue the end callback then)."""
        if self.in_backward:
            return False
        self.in_backward = True
        return True

    def ready(self, b: int, key, name: str, launch: bool = True) -> None:
        """Gradient `key` (named `name`) of bucket b is ready: launch every bucket now complete
        and next in order (unless `launch` is False: advance() does then). A gradient coming twice
        in one backward raises (the count, and with it what has been reduced, would be wrong),
        after abandon()."""
        if key in self._seen:
            self._abandon()
            raise RuntimeError(f"parameter {name!r}: its gradient was accumulated twice in one backward, "
                               "after it was handed to the gradient reduction (reentrant checkpointing or a "
                               "second backward through the same graph are not supported with gradient sync on)")
        self._seen.add(key)
        self._pending[b] -= 1
        if launch:
            self.advance()

    def advance(self) -> None:
        """Launch every bucket now complete and next in order."""
        while self._next < len(self._sizes) and self._pending[self._next] == 0:
            self._fire(self._next)

    @property
    def launched(self) -> bool:
        """Every bucket of this backward has launched."""
        return self._next == len(self._sizes)

    def finish(self) -> None:
        """End of backward: launch every bucket not launched yet, in order."""
        while self._next < len(self._sizes):
            self._fire(self._next)

    def _fire(self, b: int) -> None:
        self._next = b + 1
        self._launch(b)


class GroupLaunches:
    """The BucketReducers (DataParallel wrappers) of one group in this process, and the order their
    collectives take when several reduce in one backward.

    [Note: reducers sharing a group] One reducer launches its buckets in an order every rank shares
    ([Note: bucket launch order]), but two wrappers reduced by one backward (dA(dB(x)), or two losses
    summed) launch as their hooks fire, and the hooks fire in an order that depends on the graph: a
    parameter some rank does not use holds its bucket back to the end of that rank's backward, while
    the other wrapper launches. Same-sized collectives would pair up across ranks, silently (each rank
    got the other's gradients). So when more than one reducer with buckets lives on a group, one
    backward's collectives go reducer after reducer, in the serving order: the reducer with the most
    recent synced eager forward first (backward runs the forwards in reverse; a compiled forward keeps
    the reducer's place, as reading a counter in the graph would recompile it at each step), ties in
    wrap order. A reducer launches nothing before every reducer ahead of it has launched all its
    buckets (flags included), or, at the end of backward (when the engine runs the callbacks the
    reducers queued), turned out to take no part in it: the end-of-backward callback first launches
    what those ahead still hold, in order, then its own. Which parameters a rank used then changes
    when a bucket launches, never the sequence of collectives, which is the serving order's
    concatenation of each reducer's own sequence on every rank (as with torch DDP, every rank must run
    the same forwards, and a wrapper that takes part in a backward must get at least one gradient on
    every rank). A reducer alone on its group launches as it always did.

    The serving order changes only at a synced forward that no backward runs: the recomputation of
    torch.utils.checkpoint runs the wrapper's forward during the backward, after some reducers worked out
    their order, and on each rank at another point among the launches, so it leaves the order, the reducer
    and the buffers alone (DataParallel.forward).
    A backward that raised never runs its end-of-backward callbacks: its reducers stay in it, with
    complete buckets held. The engine drops the callback unrun, so a reducer whose callback is gone while
    it is in a backward is in a dead one (``backward_died``); the first hook of the next backward on the
    group discards the state of each such reducer (waiting for what it launched), so a later backward
    neither launches the dead one's buckets nor waits behind it.
    """

    def __init__(self):
        self._members: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # reducer -> wrap order
        self._joined = itertools.count()
        self._forwards = 0

    def join(self, reducer) -> None:
        self._members[reducer] = next(self._joined)

    def leave(self, reducer) -> None:
        self._members.pop(reducer, None)

    def drop_dead(self) -> None:
        """Discard the state of every reducer of the group left in a backward that raised."""
        for r in list(self._members):
            if r.backward_died():
                r._discard()

    def forward(self, reducer) -> None:
        """A synced forward of `reducer`: it moves to the front of the serving order."""
        self._forwards += 1
        reducer.forwarded = self._forwards

    def serving(self) -> list | None:
        """The serving order of the reducers that reduce a backward now (sync), or None when the group has
        one reducer (it launches alone)."""
        if len(self._members) < 2:
            return None
        members = [(r, order) for r, order in self._members.items() if r.sync]
        return [r for r, _ in sorted(members, key=lambda m: (-m[0].forwarded, m[1]))]

    @staticmethod
    def advance(serving: list) -> None:
        """Launch what may go now: each reducer's complete buckets, in order, up to the first reducer
        that has not launched every bucket of this backward."""
        for r in serving:
            order = r._launch_order
            if not order.in_backward:  # no gradient yet: it may still take part
                return
            order.advance()
            if not order.launched:
                return

    @staticmethod
    def finish_through(serving: list, reducer) -> None:
        """End of backward for `reducer`: launch what the reducers ahead of it in this backward still hold,
        in order, then its own."""
        for r in serving:
            if r is reducer:
                break
            if r._launch_order.in_backward:
                r._launch_order.finish()
        reducer._launch_order.finish()


_group_launches: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def group_launches(group) -> GroupLaunches:
    """The GroupLaunches of `group` (made on first use)."""
    launches = _group_launches.get(group)
    if launches is None:
        launches = _group_launches[group] = GroupLaunches()
    return launches


class _EndOfBackward:
    """The end-of-backward callback a reducer queues. The engine drops it unrun when the backward raises:
    a reducer still in a backward whose callback is gone is in a dead one (BucketReducer.backward_died)."""

    __slots__ = ("reducer", "__weakref__")

    def __init__(self, reducer):
        self.reducer = reducer

    def __call__(self) -> None:
        self.reducer._end_backward()


def _gone():
    """A reducer's callback reference before its first backward (a dead reference)."""
    return None


class BucketReducer:
    """Launches each bucket's collective the moment its last gradient is accumulated,
    in the order of [Note: bucket launch order]; when backward ends it waits for
    all in-flight work, so after ``loss.backward()`` returns every gradient is
    reduced, as with DDP.

    Subclasses give ``_reduce(bucket) -> Work`` and may override
    ``_before_reduce(b)`` / ``_finalize(b)``; ``extra_elements(spec)`` reserves
    trailing elements in each bucket for them.
    """

    def __init__(self, params, names, bucket_bytes: int, first_bucket_bytes: int, group, comm_dtype=None):
        self.params, self.names, self.group = list(params), list(names), group
        self.specs = assign_buckets(self.params, bucket_bytes, first_bucket_bytes)
        self.buckets = [Bucket(s, self.params, comm_dtype, self.extra_elements(s)) for s in self.specs]
        self._where = {id(self.params[i]): (s.index, k) for s in self.specs for k, i in enumerate(s.params)}
        self.sync = True  # False inside no_sync(): hooks only record which parameters were used
        # A synced forward whose backward has not ended: a later no_sync forward joining the same
        # backward keeps it synced (as DDP's prepare_for_backward is not undone by one): see arm().
        self.armed = False
        # Set by a compiled forward, which cannot look at the gradients (no graph operation
        # does that): prepare() then runs at the first gradient hook of the backward.
        self.prepare_at_backward = False
        self.log: list[tuple[int, str]] = []  # (bucket, "grad" | "launch" | "done") of the last synced backward
        # used: got a gradient from autograd in this synced backward (one a no_sync backward left in p.grad is
        # not missing: it is reduced as one set by hand is);
        # missing: had no gradient when its bucket was staged (stage() then attached a zeroed slot).
        self.used = [[False] * len(b.params) for b in self.buckets]
        self.missing = [[False] * len(b.params) for b in self.buckets]
        self._inflight = InFlight()
        self._launch_order = OrderedLaunch([len(b.params) for b in self.buckets], self._launch, self._discard)
        # The other reducers of this group: see [Note: reducers sharing a group]. `forwarded` orders them;
        # `_serving`: their serving order in a backward shared with others (None: launching alone).
        self._launches = group_launches(group)
        self.forwarded = 0
        self._serving = None
        self._end = _gone  # (a weak reference to the queued _EndOfBackward while in a backward)
        if self.buckets:
            self._launches.join(self)
        # (eager always: a backward run from a compiled function would have dynamo compile the hook, dropping
        # its writes to this object's flags)
        on_grad = torch.compiler.disable(self._on_grad, recursive=True)
        self._handles = [p.register_post_accumulate_grad_hook(on_grad) for p in self.params]
        self._reset()

    def extra_elements(self, spec: BucketSpec) -> int:
        return 0

    def _reduce(self, bucket: Bucket):
        raise NotImplementedError

    def _before_reduce(self, b: int) -> None:
        pass

    def _finalize(self, b: int) -> None:
        pass

    def _reset(self) -> None:
        self._launch_order.reset()
        self._serving = None

    def remove(self) -> None:
        """Unregister the gradient hooks."""
        for h in self._handles:
            h.remove()
        self._handles = []
        self._launches.leave(self)

    def prepare(self) -> None:
        """Before a forward whose backward will come: forget a previous backward that raised half-way."""
        self.prepare_at_backward = False
        if self._inflight or self._launch_order.in_backward:  # a previous backward raised half-way
            self._discard()

    def backward_died(self) -> bool:
        """Left in a backward that raised: its gradient hooks began it, and the engine dropped its
        end-of-backward callback without running it."""
        return self._launch_order.in_backward and self._end() is None

    def arm(self, sync: bool) -> None:
        """At a training forward: whether its backward reduces (`sync`: not under no_sync). A synced
        forward arms the reducer until that backward ends; a no_sync forward after it (both losses in
        one backward) does not disarm it, as in DDP."""
        if sync:
            self.sync = self.armed = True
            if not torch.compiler.is_compiling():  # see [Note: reducers sharing a group]
                self._launches.forward(self)
        elif not self.armed:
            self.sync = False

    def _on_grad(self, p) -> None:
        if self.prepare_at_backward:
            self.prepare_at_backward = False
            self.prepare()
        # no_sync: the gradient accumulates where autograd keeps it and is not marked used (a parameter no rank
        # uses in the next synced backward keeps grad None unless it holds such a gradient then)
        if not self.sync:
            return
        if self.backward_died():  # (a backward of a graph forwarded before one that raised)
            self._discard()
        b, k = self._where[id(p)]
        self.used[b][k] = True
        self.buckets[b].adopt(k)
        if self._launch_order.begin():
            self.log = []
            end = _EndOfBackward(self)
            self._end = weakref.ref(end)
            _queue_callback(end)
            self._launches.drop_dead()  # see [Note: reducers sharing a group]
            self._serving = self._launches.serving()
        self.log.append((b, "grad"))
        name = self.names[self.specs[b].params[k]]
        if self._serving is None:
            self._launch_order.ready(b, id(p), name)
        else:  # see [Note: reducers sharing a group]
            self._launch_order.ready(b, id(p), name, launch=False)
            GroupLaunches.advance(self._serving)

    def _discard(self) -> None:
        """Forget a backward that did not finish: wait for its in-flight collectives (they
        still read and write the bucket buffers the next backward fills), keep nothing."""
        self._inflight.discard()
        for bucket in self.buckets:
            bucket.packed = [False] * len(bucket.params)
        # (its used flags too: a parameter no rank uses in the next backward would keep a zero gradient)
        self.used = [[False] * len(b.params) for b in self.buckets]
        self.missing = [[False] * len(b.params) for b in self.buckets]
        self.armed = False
        self._reset()

    def _launch(self, b: int) -> None:
        # called by self._launch_order, see [Note: bucket launch order]
        self.missing[b] = self.buckets[b].stage()  # (a gradient set by hand since forward is not missing)
        self._before_reduce(b)
        self._inflight.add(self._reduce(self.buckets[b]), lambda: self._done(b), key=b)
        self.log.append((b, "launch"))

    def _end_backward(self) -> None:
        try:
            self.armed = False
            if self._serving is None:
                self._launch_order.finish()
            else:
                GroupLaunches.finish_through(self._serving, self)
            self.wait()
        finally:
            self._inflight.forget()  # after a bucket raised: the rest are neither waited for nor finalised
            self._reset()

    def wait(self) -> None:
        """Wait for every launched bucket and finalise it (unpack, unused gradients)."""
        self._inflight.retire()

    def _done(self, b: int) -> None:
        self.buckets[b].unstage()
        self._finalize(b)
        self.used[b] = [False] * len(self.buckets[b].params)
        self.missing[b] = [False] * len(self.buckets[b].params)
        self.log.append((b, "done"))

    def run_collectives(self) -> None:
        """Every bucket's collective back to back on its current contents, nothing else
        (benchmarks time communication alone with it)."""
        for w in [self._reduce(bucket) for bucket in self.buckets]:
            w.wait()
