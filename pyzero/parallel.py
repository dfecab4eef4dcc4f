"""pz.DataParallel: torch DDP's behaviour over pyzero collectives.

At wrap time every rank takes the parameters and buffers of the group's
first rank. Each forward re-broadcasts the buffers (BatchNorm running stats).
During backward each gradient moves into its bucket (bucketing.Bucket) as
autograd makes it, and becomes a view of it, as with DDP's
gradient_as_bucket_view; a bucket is all-reduced (op="avg", so averaging
costs no extra pass) as soon as its last gradient is in, overlapping the
backward of earlier layers; when backward returns every gradient holds the
group average.
"""
from __future__ import annotations

import contextlib
import sys

import torch
from torch import nn

from . import comm, wrappers
from .backend import DTYPES
from .bucketing import WIDEN, BucketReducer, DeviceFlags, broadcast_coalesced, device_capturing
from .checks import digest, is_positive_finite

_COMM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


class _AllReduceBuckets(BucketReducer):
    """DataParallel's reducer: one async all-reduce (avg) per bucket.

    After the last bucket one small all-reduce (max) of an int32 "used" flag per parameter
    tells every rank which parameters got a gradient on some rank. A gradient that no rank
    produced and that was None before the step stays None (as in DDP, and as in one process,
    where optimizers then skip it); otherwise an unused parameter contributes zeros. The flags
    travel on their own, made when the last bucket launches, so a bucket holds exactly its
    gradients (as DDP's with gradient_as_bucket_view): nothing stays allocated between steps
    beyond the gradients.
    """

    # [Note: DataParallel's used flags] Which parameters to leave at grad=None is decided on the host from
    # the reduced flags, so reading them waits for the end of backward on the device. Only a parameter that
    # had no gradient before this backward and got none from it on this rank can be dropped; when there is
    # none (every parameter used here: the usual case), the flags are reduced (the other ranks may need
    # them) but not read, and the host runs on into the optimizer step while backward ends on the device.
    # In a CUDA graph capture nothing may cross between host and device: the flags are a device copy of a
    # tensor made at an eager step with the same flags (the warm-up steps torch.cuda.graph asks for), and a
    # captured backward that could have to drop a gradient is an error.

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.flags = DeviceFlags("pz.DataParallel")

    def _reduce(self, bucket):
        return comm.all_reduce(bucket.buffer, op="avg", group=self.group, async_op=True)

    def _launch(self, b: int) -> None:
        super()._launch(b)
        if b == len(self.buckets) - 1:  # every bucket launched: the flags are final
            # used: autograd made it in this backward, or it had a gradient before (set by hand, or accumulated
            # under no_sync: then every rank keeps one)
            flags = [u or not m for us, ms in zip(self.used, self.missing) for u, m in zip(us, ms)]
            missing = [list(m) for m in self.missing]  # (a bucket's own are reset once it is done)
            droppable = [self.names[self.specs[i].params[k]] for i, (ms, us) in enumerate(zip(missing, self.used))
                         for k, (m, u) in enumerate(zip(ms, us)) if m and not u]
            if droppable and _capturing(self.buckets[0].flat.device):
                raise RuntimeError(
                    f"pz.DataParallel: {', '.join(droppable[:5])}{' ...' if len(droppable) > 5 else ''} got no "
                    "gradient in this backward, which is captured into a CUDA graph: whether another rank used "
                    "them (else their grad stays None) is known on the host only after the step; zero the "
                    "gradients with zero_grad(set_to_none=False) before a captured step")
            used = self._flags(flags)
            work = comm.all_reduce(used, op="max", group=self.group, async_op=True)
            if droppable:  # see [Note: DataParallel's used flags]
                self._inflight.add(work, lambda: self._drop_unused(used, missing))
            else:
                self._inflight.add(work)

    def _flags(self, values) -> torch.Tensor:
        device = self.buckets[0].flat.device
        return self.flags.get(values, device, _capturing(device))

    def _drop_unused(self, used: torch.Tensor, missing: list[list[bool]]) -> None:
        flags = iter(used.tolist())  # (one read of the device per synced backward)
        for bucket, miss in zip(self.buckets, missing):
            for p, m in zip(bucket.params, miss):
                if next(flags) == 0 and m:
                    p.grad = None

    def run_collectives(self) -> None:
        super().run_collectives()
        if self.buckets:
            comm.all_reduce(self._flags([1] * sum(len(b.params) for b in self.buckets)), op="max", group=self.group)


def _capturing(device: torch.device) -> bool:
    """Whether work issued now for `device` is captured into a CUDA graph (see [Note: DataParallel's used
    flags]; a name of this module, so that tests can stand in for a capture)."""
    return device_capturing(device)


def _reentrant_recomputation() -> bool:
    """Whether a reentrant torch.utils.checkpoint's backward runs now (its recomputation)."""
    checkpoint = sys.modules.get("torch.utils.checkpoint")  # (not imported: no checkpoint runs)
    node = torch._C._current_autograd_node()
    return checkpoint is not None and getattr(node, "_forward_cls", None) is checkpoint.CheckpointFunction


def _agree_on_errors(group, error: BaseException | None, what: str) -> None:
    """Collective over `group`: raise on every rank if `error` is set on any (a rank that failed its own check
    raises it; the others a ValueError naming that rank and its error)."""
    failed = comm.failed_ranks(error, group)
    if error is not None:
        raise error
    if failed:
        why = "; ".join(f"group rank {r}: {msg}" for r, msg in failed)
        raise ValueError(f"{what}: refused on group rank(s) {[r for r, _ in failed]} ({why}); every rank must "
                         "pass the same arguments")


def check_same_parameters(module: nn.Module, group, what: str, buffers: bool = True,
                          settings: dict | None = None) -> None:
    """Raise on every rank unless every rank of `group` holds parameters of the same shapes, dtypes and
    trainability, in the same order (as DDP checks at wrap time), and (`buffers`: they are broadcast too)
    buffers of the same names, shapes and dtypes, in the same order: with the same element count the
    wrap-time broadcast and the flat buffers line up anyway, copying values into another layout (or under
    another buffer's name) and averaging gradients of different layouts, silently. One all_gather of
    (count, digest) rows; a second, of each parameter's or buffer's digest, only to name the first that
    differs. `settings` ({argument: value}): the arguments every rank must pass alike, the first that
    differs named."""
    named = list(module.named_parameters())
    digests = [digest(f"{tuple(p.shape)}|{p.dtype}|{p.requires_grad}".encode(), 7) for _, p in named]
    # A tensor-parallel shard's place in its TP group (pz.tp marks it: tp_ranks): a data-parallel group whose
    # ranks hold different shards of one weight (a grid built by hand, pairing TP index 0 with 1) would copy
    # one shard over another at the broadcast and average gradients of different shards.
    me = group.ranks[group.rank]
    places = [_tp_place(getattr(p, "tp_ranks", ()), me) for _, p in named]
    whole = digest(repr(digests).encode(), 7)
    bufs = list(module.named_buffers()) if buffers else []
    buf_digests = [digest(f"{name}|{tuple(b.shape)}|{b.dtype}".encode(), 7) for name, b in bufs]
    # A pipeline stage (pz.pipeline.split_sequential tags it): a group spanning the stages (group=None, the
    # world, where it is the pipeline group) would broadcast one stage's weights over another's and average
    # gradients of different layers, however alike their shapes (a stack of equal blocks split evenly).
    stage = getattr(module, "pipeline_stage", None)
    stage = (int(stage[0]), int(stage[1])) if isinstance(stage, tuple) and len(stage) == 2 else (-1, -1)
    given = [digest(f"{k}={v!r}".encode(), 7) for k, v in (settings or {}).items()]
    rows = comm.every_rank([len(named), whole, digest(repr(places).encode(), 7), len(bufs),
                            digest(repr(buf_digests).encode(), 7), *stage, digest(repr(given).encode(), 7)],
                           group=group)
    if bool((rows == rows[0]).all()):
        return
    if not bool((rows[:, 7] == rows[0, 7]).all()):
        every = comm.every_rank(given, group=group)
        i = next(i for i in range(len(given)) if not bool((every[:, i] == every[0, i]).all()))
        name, value = list(settings.items())[i]
        others = [r for r in range(every.shape[0]) if every[r, i] != every[group.rank, i]]
        raise ValueError(f"{what}: {name}={value!r} on this rank differs on group rank(s) {others}: every rank "
                         "must pass the same arguments")
    if not bool((rows[:, 5:7] == rows[0, 5:7]).all()):
        shown = ", ".join(f"group rank {r}: " + (f"stage {i} of {n}" if n >= 0 else "not a split stage")
                          for r, (i, n) in enumerate(rows[:, 5:7].tolist()))
        raise ValueError(f"{what}: the ranks of group {list(group.ranks)} hold different pipeline stages ({shown}); "
                         "a data-parallel group must pair the ranks that hold the same stage (group=dp, one per "
                         "stage, not the pipeline group or the world)")
    if bool((rows[:, :3] == rows[0, :3]).all()):
        _refuse_different("buffer", bufs, buf_digests, rows[:, 3].tolist(), group, what)
    if bool((rows[:, :2] == rows[0, :2]).all()):
        every = comm.every_rank(places, group=group)
        i = next(i for i in range(len(named)) if not bool((every[:, i] == every[0, i]).all()))
        name, p = named[i]
        shown = ", ".join(f"group rank {r}: {_tp_shown(int(v))}" for r, v in enumerate(every[:, i].tolist()))
        raise ValueError(f"{what}: parameter {name!r} is a tensor-parallel shard, and the ranks of the data-parallel "
                         f"group {list(group.ranks)} hold different shards of it ({shown}); each data-parallel "
                         "group must pair the ranks that hold the same shard (dp, tp = pz.mesh(dp=..., tp=...); "
                         "group=dp)")
    _refuse_different("parameter", named, digests, rows[:, 0].tolist(), group, what)


def _refuse_different(kind: str, named, digests, counts, group, what: str) -> None:
    """Raise on every rank, naming the first of `named` (parameters or buffers, `kind`) that differs between the
    ranks (check_same_parameters): `counts` each rank's number of them, `digests` this rank's digest of each."""
    if len(set(counts)) > 1:
        broadcast = "" if kind == "parameter" else ": the group's first rank's buffers are broadcast"
        raise ValueError(f"{what}: the ranks' models differ: {counts} {kind}s on group ranks 0..{len(counts) - 1} "
                         f"(every rank must wrap the same model{broadcast})")
    every = comm.every_rank(digests, group=group)
    i = next(i for i in range(len(named)) if not bool((every[:, i] == every[0, i]).all()))
    name, t = named[i]
    others = [r for r in range(every.shape[0]) if every[r, i] != every[group.rank, i]]
    if kind == "parameter":
        raise ValueError(f"{what}: parameter {name!r} is {tuple(t.shape)} {t.dtype}"
                         f"{'' if t.requires_grad else ' (frozen)'} on this rank and differs in shape, dtype or "
                         f"requires_grad on group rank(s) {others}: every rank must wrap the same model")
    raise ValueError(f"{what}: buffer {name!r} is {tuple(t.shape)} {t.dtype} on this rank and differs "
                     f"in name, shape or dtype on group rank(s) {others}: every rank must wrap the same model (the "
                     "group's first rank's buffers are broadcast, in order)")


def _refuse_unbroadcastable(named, kind: str, overlap: bool = True, at_forward: bool = False) -> None:
    """Raise naming the first of `named` ((name, tensor) pairs of `kind`: "parameter", "buffer") that
    broadcast_coalesced cannot write: a dtype the collectives do not carry (TypeError), or (`overlap`) elements
    that share memory (an expand()ed tensor: ValueError), which torch's copy refused on the receiving ranks
    only; a RuntimeError for both `at_forward` (a buffer set after wrapping)."""
    for name, t in named:
        if t.dtype not in DTYPES and t.dtype not in WIDEN and not t.is_complex():
            raise (RuntimeError if at_forward else TypeError)(
                f"module: {kind} {name!r} has dtype {t.dtype}, which DataParallel cannot broadcast; expected a "
                "float, int, bool or complex dtype")
        if overlap and torch._debug_has_internal_overlap(t) == 1:
            raise (RuntimeError if at_forward else ValueError)(
                f"module: {kind} {name!r} has elements that share memory (shape {tuple(t.shape)}, stride "
                f"{t.stride()}: an expand()ed tensor), which the broadcast from the group's first rank cannot "
                "write; give it memory of its own (.clone())")


def _buffer_slots(module: nn.Module) -> list[tuple[str, nn.Module, str]]:
    """(name, submodule, key) of each of `module`'s buffers, in named_buffers() order (a tensor registered
    twice counted once)."""
    slots, seen = [], set()
    for prefix, m in module.named_modules():
        for key, b in m._buffers.items():
            if b is not None and id(b) not in seen:
                seen.add(id(b))
                slots.append((f"{prefix}.{key}" if prefix else key, m, key))
    return slots


def _tp_place(tp_ranks, me: int) -> int:
    """(TP group size, this rank's index in it) in one int; 0 for a parameter that is not a TP shard."""
    if not tp_ranks:
        return 0
    return (len(tp_ranks) << 21) | (tp_ranks.index(me) + 1 if me in tp_ranks else 0)


def _tp_shown(place: int) -> str:
    if place == 0:
        return "not a shard"
    size, index = place >> 21, (place & ((1 << 21) - 1)) - 1
    return f"shard {index} of {size}" if index >= 0 else f"a shard of {size} from another TP group"


def sparse_grad_modules(module: nn.Module) -> list[tuple[str, str]]:
    """(name, class) of the submodules whose trainable weight gets sparse gradients (nn.Embedding /
    nn.EmbeddingBag with sparse=True): neither DataParallel nor ZeRO reduces those."""
    return [(name, type(m).__name__) for name, m in module.named_modules()
            if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse and m.weight.requires_grad]


def _positive(value, arg: str) -> float:
    if not is_positive_finite(value):
        raise ValueError(f"{arg}: expected a positive number of MiB, got {value!r}")
    return float(value)


class DataParallel(nn.Module):
    """``pz.DataParallel(module)``: data parallelism like torch DDP.

    ``module`` is replicated (rank ``group.ranks[0]``'s weights win at wrap
    time); ``bucket_mb`` / ``first_bucket_mb`` cap the gradient buckets (the
    small first one starts communication early in backward); ``comm_dtype``
    (e.g. torch.bfloat16) sends gradients in a lower precision, summed in
    fp32; ``broadcast_buffers`` re-sends the group's first rank's buffers at every training
    forward (where the group has another rank). Frozen parameters are skipped, shared ones reduced once.
    """

    def __init__(self, module, bucket_mb=25, first_bucket_mb=1, comm_dtype=None, group=None,
                 broadcast_buffers=True):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module: expected a torch.nn.Module, got {type(module).__name__}")
        if isinstance(module, DataParallel):
            raise ValueError("module: already a pz.DataParallel (its gradients would be reduced twice); wrap its "
                             ".module, or use it as it is")
        ddp = wrappers.holds_ddp(module)
        if ddp is not None:
            raise ValueError(f"module: {ddp or 'the module'!r} is a torch DistributedDataParallel, which reduces the "
                             "gradients itself; wrap its .module with pz.DataParallel, or use DDP alone")
        g = comm.resolve_group(group)
        g.backend  # raises unless this rank is a member
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        error = None
        try:  # (a value one rank alone refuses: every rank raises, the others naming it, none waits)
            bucket_bytes = int(_positive(bucket_mb, "bucket_mb") * (1 << 20))
            first_bytes = int(_positive(first_bucket_mb, "first_bucket_mb") * (1 << 20))
            if comm_dtype not in _COMM_DTYPES:
                raise ValueError(f"comm_dtype: expected None, torch.float32, torch.bfloat16 or torch.float16, "
                                 f"got {comm_dtype!r}")
            if not isinstance(broadcast_buffers, bool):
                raise TypeError(f"broadcast_buffers: expected a bool, got {type(broadcast_buffers).__name__}")
            self._check(module, named, g.device, broadcast_buffers)
            wrappers.refuse_group_across_tp_shards(module.named_parameters(), g, "group")
        except Exception as e:  # noqa: BLE001 - every rank must learn of it
            error = e
        _agree_on_errors(g, error, "pz.DataParallel")
        check_same_parameters(module, g, "module", buffers=broadcast_buffers,
                              settings={"bucket_mb": float(bucket_mb), "first_bucket_mb": float(first_bucket_mb),
                                        "comm_dtype": comm_dtype, "broadcast_buffers": broadcast_buffers})
        self.module = module
        # Checked at each training forward, in time linear in the parameters but cheap (about 20 us for
        # GPT-2's 148): those with buckets keep the shape, dtype and device their buckets are laid out for,
        # and the frozen ones stay frozen.
        self._bucketed = [(n, p, p.shape, p.dtype, p.device) for n, p in named]
        self._frozen = [(n, p) for n, p in module.named_parameters() if not p.requires_grad]
        self.group = g
        self.broadcast_buffers = broadcast_buffers
        # the module's buffers (each where it is registered: module and key), re-read when they change
        slots = _buffer_slots(module)
        self._buffer_slots = [(m, key) for _, m, key in slots]
        self._buffer_list = [m._buffers[key] for _, m, key in slots]
        self._buffers_seen = wrappers.registrations()
        self._sync_bn = wrappers.SyncBatchNorms()  # (checked at each training forward)
        self._require_sync = True
        # (as DDP: the buffers too unless broadcast_buffers=False)
        broadcast_coalesced([p.detach() for p in module.parameters()] + (self._buffer_list if broadcast_buffers
                                                                        else []), g.ranks[0], g)
        for _, p in named:  # a wrapper of this module made before: this one reduces its gradients now (two
            old = getattr(p, "_pz_dp_reducer", None)  # reducers adopting one gradient corrupted it)
            old = old() if old is not None else None
            if old is not None:
                old.remove()
                old.replaced = True
        self.reducer = _AllReduceBuckets([p for _, p in named], [n for n, _ in named], max(1, bucket_bytes),
                                         max(1, first_bytes), g, comm_dtype)
        for _, p in named:
            p._pz_dp_reducer = wrappers.WeakOwner(self.reducer)
        # every parameter at wrap time (held by _bucketed and _frozen, so no id is reused); a wrapper walks its
        # module for parameters it does not know only after one was registered somewhere (wrappers.registrations)
        self._known_ids = frozenset(id(p) for p in module.parameters())
        self._registrations_seen = wrappers.registrations()

    @staticmethod
    def _check(module, named, gpu: int | None, broadcast_buffers: bool) -> None:
        tensors = list(module.named_parameters()) + list(module.named_buffers())
        devices = {}
        for name, t in tensors:
            devices.setdefault(t.device, name)
        if len(devices) > 1:
            where = ", ".join(f"{name!r} on {dev}" for dev, name in devices.items())
            raise ValueError(f"module: parameters and buffers must all be on one device, found {where}")
        want = torch.device("cpu") if gpu is None else torch.device("cuda", gpu)
        if devices and next(iter(devices)) != want:
            raise ValueError(f"module: the group's backend works on {want}, but the module's tensors are on "
                             f"{next(iter(devices))}" + (" (use backend='nccl' for CUDA modules)" if gpu is None
                                                           else " (this rank's GPU)"))
        sparse = sparse_grad_modules(module)
        if sparse:
            name, kind = sparse[0]
            raise ValueError(f"module: {name!r} ({kind}) makes sparse gradients, which pz.DataParallel does not "
                             f"reduce; use sparse=False")
        for name, p in named:
            if p.dtype not in DTYPES or not p.is_floating_point():
                raise TypeError(f"module: parameter {name!r} has dtype {p.dtype}; trainable parameters must be "
                                "float32, float16, bfloat16 or float64")
        # (frozen parameters are broadcast at wrap time as buffers are)
        _refuse_unbroadcastable(module.named_parameters(), "parameter")
        _refuse_unbroadcastable(module.named_buffers(), "buffer", overlap=broadcast_buffers)

    def _current_buffers(self) -> list[torch.Tensor]:
        """The module's buffers now, as DDP reads them before each broadcast: one replaced or registered after
        wrapping (m.bn.running_mean = t, register_buffer, load_state_dict(assign=True), module.to()) is sent
        too. Found again only where one was registered somewhere (wrappers.registrations) or a slot holds
        another tensor (module.to() replaces them there): looking at the slots takes a tenth of the time a
        walk of the module tree does (13 against 150 us for ResNet-50's 53 BatchNorms). A set that changed
        is checked as at wrap time."""
        count = wrappers.registrations()
        if count == self._buffers_seen and all(m._buffers.get(name) is b for (m, name), b in
                                               zip(self._buffer_slots, self._buffer_list)):
            return self._buffer_list
        slots = _buffer_slots(self.module)
        named = [(name, m._buffers[key]) for name, m, key in slots]
        for name, b in named:
            if b.device != self.group.tensor_device:
                raise RuntimeError(f"module: buffer {name!r} is on {b.device} now, where the group's backend works "
                                   f"on {self.group.tensor_device}; move it before the forward")
        _refuse_unbroadcastable(named, "buffer", at_forward=True)
        self._buffer_slots = [(m, key) for _, m, key in slots]
        self._buffer_list = [b for _, b in named]
        self._buffers_seen = count
        return self._buffer_list

    def forward(self, *args, **kwargs):
        wrappers.refuse_ddp("pz.DataParallel")
        if getattr(self.reducer, "replaced", False):
            raise RuntimeError("pz.DataParallel: a later pz.DataParallel wraps the same module and reduces its "
                               "gradients now; use that one")
        compiling = torch.compiler.is_compiling()
        if not compiling and torch._C._current_graph_task_id() != -1:
            # Run by a backward (torch.utils.checkpoint's recomputation): a broadcast here would fall among the
            # backward's all-reduces at another point on each rank, and arming would reorder reducers some
            # ranks have already ordered (see [Note: reducers sharing a group]): nothing is sent, nothing
            # changes. With use_reentrant=False the gradients come through the graph of the forward it
            # recomputes, which decided the reduction; a reentrant checkpoint's forward ran without gradients,
            # so the reducer keeps the decision of the wrapper's last forward with gradients.
            if self._require_sync and not self.reducer.sync and _reentrant_recomputation():
                raise RuntimeError(
                    "pz.DataParallel: a reentrant torch.utils.checkpoint (use_reentrant=True) runs this wrapper's "
                    "forward without gradients, and again during backward, which cannot decide that the backward "
                    "reduces: the wrapper's last forward with gradients ran under no_sync(), so the gradients would "
                    "stay each rank's own; use use_reentrant=False")
            return self.module(*args, **kwargs)
        if self.broadcast_buffers and self.module.training and self.group.size > 1:
            if compiling:  # one operator in the graph (see pyzero.ops)
                buffers = list(self.module.buffers())
                if buffers:
                    from . import ops  # noqa: PLC0415  (registered on first use)
                    ops.broadcast_coalesced_(buffers, self.group.ranks[0], self.group.name)
            else:
                buffers = self._current_buffers()
                if buffers:
                    broadcast_coalesced(buffers, self.group.ranks[0], self.group)
        if self.module.training and not compiling:
            self._sync_bn.refuse_unsynced(self.module, "pz.DataParallel", self.group.size)
        if torch.is_grad_enabled():
            if not compiling:
                self._check_trainable()
            if compiling:  # looking at the gradients is no graph operation: see BucketReducer
                self.reducer.prepare_at_backward = True
            else:
                self.reducer.prepare()
            # Like DDP, whether this step's backward communicates is decided at forward.
            self.reducer.arm(self._require_sync)
        return self.module(*args, **kwargs)

    def _check_trainable(self) -> None:
        """Refuse parameters made trainable after wrapping: they have no bucket, their gradients
        would stay each rank's own."""
        moved = [(n, (dtype, device), p) for n, p, _, dtype, device in self._bucketed
                 if p.dtype is not dtype or p.device != device]
        reshaped = [(n, shape, p) for n, p, shape, _, _ in self._bucketed if p.shape != shape]
        late = [n for n, p in self._frozen if p.requires_grad]
        if self._registrations_seen != wrappers.registrations() and self._unknown_trainable():
            new = [n for n, p in self.module.named_parameters() if p.requires_grad and id(p) not in self._known_ids]
            raise RuntimeError(f"module: parameters {new[:5]}{' ...' if len(new) > 5 else ''} were added or replaced "
                               "after pz.DataParallel wrapped the module (a new layer, p = nn.Parameter(...), "
                               "load_state_dict(assign=True)); no bucket reduces their gradients, which would stay "
                               "each rank's own. Change the module before wrapping it")
        if moved:
            n, (dtype, device), p = moved[0]
            raise RuntimeError(f"module: parameter {n!r} is {p.dtype} on {p.device} now, {dtype} on {device} when "
                               f"pz.DataParallel wrapped the module (its gradient bucket is laid out for that); "
                               f"convert the module before wrapping it")
        if reshaped:
            n, shape, p = reshaped[0]
            raise RuntimeError(f"module: parameter {n!r} has shape {tuple(p.shape)} now, {tuple(shape)} when "
                               "pz.DataParallel wrapped the module (its gradient bucket is laid out for that); "
                               "change the module before wrapping it")
        if late:
            raise RuntimeError(f"module: parameters {late[:5]}{' ...' if len(late) > 5 else ''} became trainable "
                               f"after pz.DataParallel wrapped the module; their gradients would not be averaged "
                               f"across ranks. Set requires_grad before wrapping")

    def _unknown_trainable(self) -> bool:
        """Whether a trainable parameter unknown at wrap time is in the module now (walked only after a
        parameter or module was registered somewhere: see wrappers.registrations)."""
        count = wrappers.registrations()
        if any(p.requires_grad and id(p) not in self._known_ids for p in self.module.parameters()):
            return True  # (and again at the next forward)
        self._registrations_seen = count
        return False

    def __reduce_ex__(self, protocol):
        raise TypeError("pz.DataParallel cannot be pickled or copied (torch.save(model), copy.deepcopy(model)): it "
                        "holds this job's group and gradient buckets; save model.module (or model.state_dict()) "
                        "instead, and wrap the module again after loading it")

    @property
    def require_backward_grad_sync(self) -> bool:
        """False inside no_sync() (as torch DDP's attribute): backwards of forwards run now accumulate."""
        return self._require_sync

    @contextlib.contextmanager
    def no_sync(self):
        """Forwards (and their backwards) inside accumulate gradients locally; the first
        synced backward after them reduces the sum."""
        old, self._require_sync = self._require_sync, False
        try:
            yield
        finally:
            self._require_sync = old

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this wrapper's training holds, by what they are (pyzero.memtrace walks
        them): "params" the module's parameters, "grads" the buckets' gradient storage (the
        gradients are views of it) and any gradient that is not such a view, "buckets" the
        communication-dtype copies (comm_dtype=)."""
        grads = [b.flat for b in self.buckets] + [p.grad for p in self.module.parameters() if p.grad is not None]
        return {"params": list(self.module.parameters()), "grads": grads,
                "buckets": [b.comm for b in self.buckets if b.comm is not None]}

    @property
    def bucket_log(self) -> list[tuple[int, str]]:
        """(bucket, event) of the last synced backward, in order: "grad" (a gradient of
        that bucket was accumulated), "launch" (its collective started), "done"."""
        return self.reducer.log

    @property
    def buckets(self):
        """The gradient buckets, in launch order (bucketing.Bucket)."""
        return self.reducer.buckets
