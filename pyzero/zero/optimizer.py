"""pz.ZeroOptimizer: the part every ZeRO stage shares.

Each stage (stages.py, stage3.py) decides where full parameters and
gradients live and when they are communicated; this base class owns what is
common: argument checks, the fp32 master shard and the inner torch optimizer
that runs on it, clipping over all shards, no_sync, and the per-rank state
dict. The inner optimizer sees one tensor per *piece* (the part of one model
parameter inside this rank's shard, see partition.Piece), so per-parameter
groups (lr, weight_decay) carry over exactly and elementwise optimizers
(Adam, AdamW, SGD, Adagrad, ...) compute what they would on the full model.
"""
from __future__ import annotations

import contextlib
import inspect
import json
import sys
import warnings
import types
import weakref
from collections import OrderedDict
from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from .. import comm, memtrace, wrappers
from ..bucketing import DeviceFlags, InFlight, device_capturing
from .. import optim as pz_optim
from ..parallel import DataParallel, check_same_parameters, sparse_grad_modules
from . import offload as _offload
from . import gathered as _gathered
from .partition import FlatLayout, Piece, trainable
from .scaler import LossScaler
from ..checks import check_bool, digest, is_int, is_positive_finite, is_real

_PARAM_DTYPES = (None, torch.float32, torch.bfloat16, torch.float16)


def whole_tensor_optimizer(cls: type) -> str | None:
    """Why ZeRO cannot run optimizer class `cls` as it runs without ZeRO, or None. ZeRO gives the optimizer
    flat pieces of parameters (this rank's part of each): an elementwise optimizer (Adam, AdamW, SGD,
    Adagrad, RMSprop, ...) computes there what it would on the whole tensor; one that computes on whole
    tensors (their shape, their norm) would train differently and not say so."""
    factored = "its second moments factored by rows and columns, its steps scaled by each tensor's RMS"
    known = [(getattr(torch.optim, "Adafactor", None), factored),
             (getattr(torch.optim, "Muon", None), "its update of each matrix orthogonalised as a whole"),
             (torch.optim.LBFGS, "its step re-evaluates the loss through a closure and takes dot products and "
                                 "line searches over all parameters at once")]
    hf_optimization = sys.modules.get("transformers.optimization")  # (imported where its classes are in use)
    if hf_optimization is not None:
        known.append((getattr(hf_optimization, "Adafactor", None), factored))
    for base, how in known:
        if isinstance(base, type) and isinstance(cls, type) and issubclass(cls, base):
            return (f"{cls.__name__} computes on whole parameter tensors ({how}), and ZeRO hands it flat pieces "
                    "of them, so it would train differently from the same optimizer without ZeRO")
    return None


_USE_ELEMENTWISE = ("use an elementwise optimizer (torch.optim.AdamW, Adam, SGD, Adagrad, RMSprop, ...), or "
                    "pz.DataParallel, which keeps whole tensors")
# torch's and pz.optim's optimizers that are elementwise (exactly these classes: a subclass may step otherwise)
_ELEMENTWISE = tuple(getattr(torch.optim, n) for n in ("SGD", "Adam", "AdamW", "Adagrad", "RMSprop", "Adadelta",
                                                       "Adamax", "NAdam", "RAdam", "ASGD", "Rprop")
                     if hasattr(torch.optim, n)) + (pz_optim.Adam, pz_optim.AdamW, pz_optim.SGD, pz_optim.Adagrad,
                                                    pz_optim.NvmeAdam, pz_optim.NvmeAdamW)


# The probe's tensors: (shape, where the flat pieces are cut). A 5 x 6 matrix, one large enough for
# optimizers that treat only big matrices their own way (Adafactor-style factoring from 128 rows and
# columns, as optax's), and a vector.
_PROBES = (((5, 6), 13), ((130, 129), 7001), ((300,), 120))


def elementwise_mismatch(cls: type, kwargs: dict, groups: list | None = None) -> str | None:
    """Whether optimizer class `cls` (with `kwargs` and each of `groups`' options) steps a tensor whole
    as it steps the same tensor in flat pieces, as ZeRO hands it: None if so, or if it cannot be
    tried on small CPU tensors (it raises there); else what differed. Three steps of each tensor of
    _PROBES against its flat elements cut in two 1-D tensors, in float64 where the optimizer takes it
    (else float32): an elementwise optimizer computes the same numbers either way, one that computes
    with a tensor's norm, shape or dimensionality (LAMB's and LARS's trust ratios, factored moments,
    orthogonalised updates, weight decay only on matrices) moves them apart by a share of the update
    (a few percent for LAMB, at any learning rate). A probe, not a proof: an optimizer that treats
    some shapes specially only beyond these sizes passes it."""
    for options in [{k: v for k, v in g.items() if k != "params"} for g in (groups or [{}])]:
        for shape, cut in _PROBES:
            for dtype in (torch.float64, torch.float32):
                moved = _whole_and_pieces(cls, kwargs, options, dtype, shape, cut)
                if moved is not None:
                    break
            else:  # (it cannot run here: nothing to compare)
                continue
            apart, update = moved
            if apart > 1e-4 * update + 8 * torch.finfo(dtype).eps:
                return (f"{cls.__name__} steps a tensor whole differently from the same tensor in flat pieces (a "
                        f"{tuple(shape)} tensor after 3 steps {apart:.3g} apart, {apart / max(update, 1e-30):.2%} "
                        "of the update: it computes with whole tensors, their norm, shape or dimensionality), and "
                        "ZeRO hands it flat pieces of them, so it would train differently from the same optimizer "
                        "without ZeRO")
    return None


def _whole_and_pieces(cls, kwargs, options, dtype, shape, cut):
    """(largest difference, largest update) of elementwise_mismatch's probe of a `shape` tensor cut at
    `cut` in `dtype`, or None if the optimizer raised."""
    n = 1
    for d in shape:
        n *= d
    start = (torch.arange(n, dtype=dtype) / 7 - 2).sin()
    grads = [(((torch.arange(n) * (k + 3)) % 11 - 5) / 4).to(dtype) * (1 + k) for k in range(3)]
    try:
        with torch.random.fork_rng(devices=[]):
            whole = nn.Parameter(start.clone().view(shape))
            pieces = [nn.Parameter(start[:cut].clone()), nn.Parameter(start[cut:].clone())]
            opt_whole = cls([dict(options, params=[whole])], **kwargs)
            opt_pieces = cls([dict(options, params=pieces)], **kwargs)
            for g in grads:
                whole.grad = g.clone().view(shape)
                pieces[0].grad, pieces[1].grad = g[:cut].clone(), g[cut:].clone()
                opt_whole.step()
                opt_pieces.step()
    except Exception:  # noqa: BLE001
        return None
    got, want = torch.cat([p.detach() for p in pieces]), whole.detach().flatten()
    return (got - want).abs().max().item(), (want - start).abs().max().item()


_STAGES: dict[int, type] = {}  # stage number -> class, filled by register_stage


def register_stage(stage: int):
    """Class decorator: ``ZeroOptimizer(..., stage=n)`` builds the class registered for n.
    The stage modules (stages.py, stage3.py) register themselves; the package imports them."""
    def register(cls):
        _STAGES[stage] = cls
        return cls
    return register


class ShardedParametersWarning(UserWarning):
    """``model.state_dict()`` of a ZeRO stage-3 model on more than one rank: the sharded parameters
    are freed outside forward and backward and read as NaN there (``opt.full_state_dict()`` or
    pz.checkpoint give their values)."""


def model_state(model: nn.Module) -> dict:
    """``model.state_dict(keep_vars=True)`` without the ShardedParametersWarning: for callers that take
    the sharded parameters' values from elsewhere (the masters) and the rest from here."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ShardedParametersWarning)
        return model.state_dict(keep_vars=True)


def _no_op(*args, **kwargs):
    return None


def no_op_hook():
    return _no_op


class ModelHook:
    """A hook a ZeroOptimizer puts on its model or one of its modules. A copy of the model
    (``copy.deepcopy(model)``: an EMA or a teacher made after the optimizer was built; or
    ``torch.save(model)`` and loading it) gets ``on_copy()`` in its place, a hook that does nothing
    unless given (a module-level callable, for pickle): the copy is a plain model of its own, with no
    part in this optimizer's training. (A bound method of the optimizer would copy the optimizer with
    it, a closure would keep gathering and freeing the original's parameters for the copy.)"""

    def __init__(self, fn, on_copy=no_op_hook):
        self.fn, self.on_copy = fn, on_copy

    def __call__(self, *args, **kwargs):
        return self.fn(*args, **kwargs)

    def __deepcopy__(self, memo):
        return self.on_copy()

    def __reduce__(self):
        return self.on_copy, ()


def eager_hook(hook):
    """A gradient hook that runs eagerly: a backward called inside a compiled function (dynamo breaks the
    graph there) would have dynamo compile the hook, whose writes to the optimizer's flags it drops."""
    return torch.compiler.disable(hook, recursive=True)


def replaced_error(names: list[str]) -> RuntimeError:
    """`names`: parameters whose tensor something replaced (``p.data = t``) after the ZeroOptimizer was built."""
    return RuntimeError(f"model: parameters {names[:5]}{' ...' if len(names) > 5 else ''} were given new storage "
                        "after the ZeroOptimizer was built (`p.data = t`, or a move of the model), where the "
                        "optimizer does not reach: training would silently stop updating them. Write into them "
                        "instead, inside `with torch.no_grad(), opt.gathered_parameters():` (`p.copy_(t)`), or "
                        "set them before building the ZeroOptimizer")


def _no_owner():  # (what a model pickled by an older pyzero names for its parameters' owner attribute)
    return None


WeakOwner = wrappers.WeakOwner


class ShardState(Mapping):
    """``opt.state`` of a ZeroOptimizer: its inner optimizer's state, which is kept per shard piece (this
    rank's part of a model parameter), keyed by the tensors of ``opt.param_groups``. Read-only, and a
    lookup never adds an entry (torch's state is a defaultdict, and an entry added under another tensor
    would break state_dict()): ``opt.state[p]`` for p of param_groups is its state (a read-only empty
    mapping before its first step), any other key a KeyError saying so. Iteration, len, items() and
    ``in`` are the inner state's."""

    __slots__ = ("_opt",)

    def __init__(self, opt):
        self._opt = opt

    def __getitem__(self, key):
        state = self._opt.inner.state
        if isinstance(key, torch.Tensor):
            if key in state:  # (tensors hash by identity; `in` adds nothing)
                return state[key]
            if id(key) in self._opt._leaf_ids:
                return types.MappingProxyType({})  # (not stepped yet)
        i = self._opt._param_index.get(id(key)) if isinstance(key, torch.Tensor) else None
        what = (f"the model's parameter {self._opt.names[i]!r} is not a key"
                if i is not None and self._opt.params[i] is key else
                f"{_shown(key)} is not one of the tensors of opt.param_groups")
        raise KeyError(f"opt.state: {what}; a ZeroOptimizer keeps its optimizer state per shard piece (this "
                       "rank's part of each parameter), keyed by the tensors of opt.param_groups: read "
                       "opt.state[p] for p in opt.param_groups[i]['params'], or opt.shard_state() for each "
                       "piece's state with its parameter's name")

    def __contains__(self, key):
        return isinstance(key, torch.Tensor) and key in self._opt.inner.state

    def __iter__(self):
        return iter(self._opt.inner.state)

    def __len__(self):
        return len(self._opt.inner.state)

    def __setitem__(self, key, value):
        _read_only()

    def __delitem__(self, key):
        _read_only()

    def __repr__(self):
        return f"ShardState({len(self)} pieces with state)"


def _not_copied(how: str) -> str:
    return (f"{how} of a ZeroOptimizer: its shards, buckets and group belong to this job's training and are "
            "not copied or pickled; save and restore its state with pz.checkpoint.save / load, or "
            "opt.state_dict() / opt.load_state_dict() on every rank (each rank's shard). copy.deepcopy(model) "
            "gives a plain copy of the model (for stage 3 inside `with torch.no_grad(), "
            "opt.gathered_parameters():`)")


def _read_only():
    raise TypeError("opt.state is read-only (the inner optimizer's state, per shard piece): change a piece's "
                    "state in place (opt.state[p]['exp_avg'].zero_()), or load one with opt.load_state_dict / "
                    "opt.load_shard_state / pz.checkpoint.load")


def _shown(key) -> str:
    """A key of a failed opt.state lookup, briefly."""
    if isinstance(key, torch.Tensor):
        return f"a tensor of shape {tuple(key.shape)}"
    return f"a {type(key).__name__}"


class CollectiveCall(NamedTuple):
    """One collective of a training step (see ZeroOptimizer.comm_plan)."""

    op: str  # "reduce_scatter" or "all_gather"
    numel: int  # elements of the full (input of reduce_scatter, output of all_gather) buffer
    counts: list[int] | None  # elements per rank when uneven, None for numel / world each


_SCALING = ("scale", "growth_factor", "backoff_factor", "growth_interval", "dynamic", "min_scale")
_ZEROPP_OPTIONS = ("zero_hpz_partition_size", "zero_quantized_weights", "zero_quantized_gradients")

class ZeroOptimizer(torch.optim.Optimizer):
    """Drop-in sharded optimizer: ``pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)``.

    stage 1 shards optimizer state, 2 also gradients, 3 also parameters.
    ``param_groups`` (optional) is a list of dicts like torch's, with the
    model's parameters under "params"; ``optimizer_kwargs`` are the defaults.
    One ZeroOptimizer per model (it re-homes the parameters and hooks them).
    step() consumes the gradients: the next backward starts from zero, as
    after zero_grad(); parameters that no rank's backward reached are skipped
    like torch skips a None gradient.
    ``loss_scale`` (None, "dynamic", a number or a dict of zero.scaler.LossScaler arguments)
    turns on fp16 loss scaling: backward on ``opt.scale_loss(loss)``; a step whose gradients
    overflow on any rank is skipped everywhere (see zero/scaler.py).
    ``tp_group`` / ``pp_group``: with tensor / pipeline parallelism, the group of the ranks holding
    the other parts / stages of this rank's model, over which clip_grad_norm_'s norm and the
    overflow check are combined too (so they are those of the whole model).
    """

    def __new__(cls, model=None, optimizer_class=None, stage=2, *args, **kwargs):
        if cls is ZeroOptimizer:
            if type(stage) is not int or stage not in _STAGES:  # (2.0 == 2, True == 1: not stage numbers)
                raise ValueError(f"stage: expected one of {sorted(_STAGES)}, got {stage!r}")
            cls = _STAGES[stage]
        return object.__new__(cls)

    def __init__(self, model, optimizer_class, stage=2, bucket_mb=25, overlap=True, param_dtype=None,
                 comm_dtype=None, group=None, param_groups=None, tp_group=None, loss_scale=None, offload=None,
                 nvme_path=None, offload_params=False, offload_moments=None, delayed_update=False,
                 offload_pipeline=None, pp_group=None, **optimizer_kwargs):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if any(isinstance(m, DataParallel) for m in model.modules()):
            raise ValueError("model: it is (or holds) a pz.DataParallel, which reduces the gradients itself; give "
                             "ZeroOptimizer the module without DataParallel (ZeRO does the data parallelism)")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            got = (f"an optimizer built already ({type(optimizer_class).__name__}); pass the class and its arguments, "
                   "e.g. pz.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-3): each rank builds one on its shard"
                   if isinstance(optimizer_class, torch.optim.Optimizer) else repr(optimizer_class))
            raise TypeError(f"optimizer_class: expected a torch.optim.Optimizer subclass (e.g. torch.optim.AdamW), "
                            f"got {got}")
        why = whole_tensor_optimizer(optimizer_class)
        if why is not None:
            raise ValueError(f"optimizer_class: {why}; {_USE_ELEMENTWISE}")
        if "prefetch" in optimizer_kwargs:  # (stage 3's own option reaches here only for stages 1-2)
            raise ValueError(f"prefetch: gathering units ahead is for stage=3, got stage={stage!r}")
        if "leaf_modules" in optimizer_kwargs:
            raise ValueError(f"leaf_modules: gathering a module's subtree at its forward is for stage=3 (stages 1-2 "
                             f"keep whole parameters), got stage={stage!r}")
        zeropp = sorted(k for k in optimizer_kwargs if k.startswith("zero_"))
        if zeropp:  # the ZeRO++ options (stage3.py) reach here only for stages 1-2, or misspelt
            if zeropp[0] not in _ZEROPP_OPTIONS:
                raise TypeError(f"{zeropp[0]}: not a ZeroOptimizer option; the ZeRO++ ones (stage=3) are "
                                f"{list(_ZEROPP_OPTIONS)}")
            raise ValueError(f"{zeropp[0]}: the ZeRO++ options are for stage=3, got stage={stage!r}")
        if not is_positive_finite(bucket_mb):
            raise ValueError(f"bucket_mb: expected a positive number of MiB, got {bucket_mb!r}")
        if not isinstance(overlap, bool):
            raise TypeError(f"overlap: expected True or False, got {overlap!r}")
        if param_dtype not in _PARAM_DTYPES:
            raise ValueError(f"param_dtype: expected None, torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {param_dtype!r}")
        if comm_dtype not in _PARAM_DTYPES:
            raise ValueError(f"comm_dtype: expected None, torch.float32, torch.bfloat16 or torch.float16, "
                             f"got {comm_dtype!r}")
        self.scaler = LossScaler.make(loss_scale)  # fp16: see zero/scaler.py
        self._overflow = None  # this step's overflow verdict, once gradients are reduced
        self.model, self.stage, self.overlap = model, stage, bool(overlap)
        self.group = comm.resolve_group(group)
        # With tensor parallelism (pz.mesh): the TP group whose ranks hold other parts of the
        # parameters marked tp_sharded; clip_grad_norm_ adds those up and counts the rest once.
        try:
            self.tp_group = None if tp_group is None else comm.resolve_group(tp_group)
        except TypeError as e:
            raise TypeError(f"tp_group: {str(e).removeprefix('group: ')}") from None
        # With pipeline parallelism (pz.pipeline): the ranks holding the other stages of this rank's part of the
        # model; clipping adds their norms and the overflow check their flags (see _check_pp).
        try:
            self.pp_group = None if pp_group is None else comm.resolve_group(pp_group)
        except TypeError as e:
            raise TypeError(f"pp_group: {str(e).removeprefix('group: ')}") from None
        self.group.backend  # raises unless this rank is a member
        self.world, self.rank = self.group.size, self.group.rank
        self._check_group()
        self.bucket_elems = max(1, int(bucket_mb * (1 << 20) / 4))
        self.param_dtype, self.comm_dtype = param_dtype, comm_dtype or torch.float32
        self.params, self.names = trainable(model)
        if stage == 1 and comm_dtype is not None and self.params:
            model_dtype = param_dtype or self.params[0].dtype
            if comm_dtype != model_dtype:
                raise ValueError(f"comm_dtype: stage 1 reduces the gradients in the model's dtype ({model_dtype}), "
                                 f"got {comm_dtype}; comm_dtype sets the reduction of stages 2 and 3")
        self._check_tp(model)
        self._check_pp()
        check_same_parameters(model, self.group, "model")
        if any(_owner_of(p) is not None for p in self.params):
            raise ValueError("model: its parameters already belong to another ZeroOptimizer (its hooks and "
                             "flat buffers stay attached); build one ZeroOptimizer per model")
        self._check_devices()
        sparse = sparse_grad_modules(model)
        if sparse:
            name, kind = sparse[0]
            raise ValueError(f"model: {name!r} ({kind}) makes sparse gradients, which ZeroOptimizer does not shard; "
                             f"use sparse=False")
        # [Note: offload of a CUDA model]
        # The fp32 master shards (and with offload_params the stage 3 parameter shards) live in
        # pinned host memory, the inner optimizer (pz.optim's fused CPU step) steps them there.
        # So do the fp32 gradient shards: the device keeps only what backward and the collectives
        # need, the model-dtype parameters (stage 1 also its full gradients). As a stage finishes
        # a reduced slice of a gradient shard (a bucket's or unit's reduce-scatter, during
        # backward in stages 2-3) it hands it to _add_grad, which queues its copy to the host on
        # a side stream (_HostGrads), overlapping the rest of backward; the first slice into a
        # range lands in the host shard itself, a later one (several synchronised backwards
        # before a step) or a 16-bit one is added on the host once it is there. The host shards
        # stay raw: the overflow check and the clipping norm read them on the host (the norm
        # unscaled by 1/scale), and the step applies the factor (1/scale times the clip
        # coefficient) in its own pass (pz.optim's grad_scale; a separate multiply for other
        # optimizers), the same product the device path applies in two exact steps. A 16-bit
        # model gets its new parameters from 16-bit host copies of the masters (_host_low):
        # pz.optim's step writes them in the same pass (copies=), other optimizers convert
        # after; they go to the device (half the bytes of the fp32 masters, and no fp32
        # temporary there) at the end of step() in stages 1-2, at each unit's next gather in
        # stage 3. For a CPU model host memory is the device: nothing is copied.
        # [Note: delayed update]
        # delayed_update=True (offload="cpu", stages 1-2) is ZeRO-Offload's one-step delayed
        # parameter update. step() of step t finishes the gradients g_t, decides overflow and
        # the clip coefficient from them, waits for the CPU step of step t-1 and puts its
        # parameters w_{t-1} into the model, then starts the CPU step w_t = U(w_{t-1}, g_t) in a
        # background thread (offload.DelayedStep) and returns. Forward/backward of step t+1 run
        # meanwhile on w_{t-1}: g_t is the gradient at w_{t-2} (w_{-1} = w_0), one update
        # late. The job first copies g_t into buffers of its own and only then lets the next
        # backward write the gradient shards (_HostGrads waits on its gate). The masters must
        # be apart from the model's parameters, so this always runs the host-copy path (on a
        # CPU model too). synchronize() waits for the job and publishes w_t; checkpoints and
        # memory_stats wait for it and read the masters with every update applied.
        self._host = offload is not None and (_host_copies(self.device) or delayed_update is True)
        self._delayed = None  # offload.DelayedStep with delayed_update
        self._front, self._front_of = None, None  # delayed_update: param_groups and the inner list they mirror
        self._clip_coef = None  # with host copies: this step's clip coefficient (a host scalar tensor)
        self._host_unscaled = False  # host copies: the shards took 1/scale (and _clip_coef) before the pre-hooks
        self._group_of = self._assign_groups(param_groups)
        # bad kwargs raise before any change, and so do ranks given different optimizers or settings
        probe = _probe_optimizer(optimizer_class, optimizer_kwargs, param_groups)
        self._check_same_optimizer(optimizer_class, probe)
        self._optimizer_class = optimizer_class  # (settings restored from a checkpoint are tried on it first)
        if optimizer_class not in _ELEMENTWISE:
            why = elementwise_mismatch(optimizer_class, optimizer_kwargs, param_groups)
            if why is not None:
                raise ValueError(f"optimizer_class: {why}; {_USE_ELEMENTWISE}")
        self.offload = _offload.resolve(offload, nvme_path, offload_params, stage, optimizer_class,
                                        optimizer_kwargs, self.params, self.world, moments=offload_moments,
                                        delayed_update=delayed_update, pipeline=offload_pipeline)
        # The class and arguments offload steps with, where they are not those just tried, must take them too.
        inner_class, inner_kwargs = self.offload.inner_class(optimizer_class, optimizer_kwargs)
        if inner_class is not optimizer_class or inner_kwargs is not optimizer_kwargs:
            _probe_optimizer(inner_class, inner_kwargs, param_groups)
        # [Note: offload pipeline]
        # offload_pipeline (offload="cpu" with host copies; None: "step" there, off elsewhere, as
        # with delayed_update) runs the host step in *slots*: a bucket's part of the shard in
        # stages 1-2, a unit's shard in stage 3. A worker thread (offload.SlotSteps) steps one
        # slot at a time (pz.optim's fused step over that slot's pieces only: every other
        # piece's .grad is None for the call, and each piece keeps its own step count, so the
        # slots together are the one step, bit for bit). The main thread waits for slot after
        # slot and sends each one's new values (the 16-bit host copy the step wrote, or the
        # fp32 masters) to the device on the side stream (_SideCopies) while the next slot
        # steps; stage 3 hands them to the unit's next gather as before. step() returns once
        # every slot has stepped and its copy is queued: the host masters, state and
        # checkpoints are final, and the current stream waits for the copies (on the GPU; the
        # host does not wait), so anything after step() reads the new parameters, a direct
        # p.cpu() included; the wait costs the GPU at most the last slot's copy (a bucket's).
        # With True, a slot also starts stepping during backward, as soon as its reduced
        # gradient has landed in the host shard (stages 2-3; stage 1 reduces in step()), when
        # that is exact: no loss scaling, and the step() before had one synchronised backward
        # (no_sync ones before it are fine), no clip_grad_norm_, the param_groups' settings (lr,
        # betas, ...) at step() as they were when backward ended, and no step pre-hook (those
        # read the gradients), which the optimizer takes as the shape of the loop from then on;
        # a slot whose parameters did not all get a
        # gradient on this rank waits for step() (it may be skipped, see [Note: parameters
        # without gradients]). If the loop then changes shape after a slot stepped early
        # (clip_grad_norm_, another synchronised backward, zero_grad() before step(), settings
        # changed after backward, a step pre-hook registered), the update cannot be taken back:
        # RuntimeError, naming offload_pipeline="step".
        # With the pipeline, a 16-bit model's host gradient shards are in the model dtype (2
        # bytes a parameter instead of 4) where that holds the reduced gradient exactly: one
        # rank, or a reduction in the model dtype (stage 1; stages 2-3 with comm_dtype equal to
        # it); a slot widens its gradient into an fp32 scratch of one slot before its step. The
        # first synchronised backward that adds to gradients already on the host (gradient
        # accumulation without no_sync) widens the shards to fp32 for the rest of training, and so
        # does a step() with step pre-hooks (they read and change fp32 gradients in param_groups).
        if self.offload.pipeline is None:
            self._pipe_mode = "step" if self._host and offload == "cpu" and not delayed_update else False
        else:
            self._pipe_mode = self.offload.pipeline if self._host else False  # (a CPU model: nothing to pipeline)
        low = self.param_dtype or self.params[0].dtype
        reduced = self._reduced_dtype()
        self._host_grad_dtype = low if (self._pipe_mode and low != torch.float32 and reduced is not None
                                        and (self.world == 1 or reduced == low)) else torch.float32
        self._synced_backwards = 0  # synchronised backwards since the last step (see [Note: offload pipeline])
        self._clipped = False  # clip_grad_norm_ since the last step
        # offload_pipeline=True: the param_groups' settings when this step's backward ended, and whether
        # step() found them changed (then the steps' slots wait for step(): see _learn_loop_shape)
        self._hparams_at_backward: list | None = None
        self._hparams_moved = False
        self._early_ok = False  # the loop's shape allows slot steps during backward
        self._sync = True
        self._grads_ready = False
        # stages 2-3: a backward inside no_sync() left gradients in .grad after the last synced one (the
        # hooks reduce .grad, accumulated, only in a synced backward): step() refuses to drop them
        self._unreduced = False
        # Reductions launched during backward (stages 2, 3) and not yet folded into the shards;
        # at most two stay in flight, bounding the staging memory they hold.
        self._inflight = InFlight(limit=2 if self.overlap else 0)
        # Which parameters received a gradient since zero_grad: see [Note: parameters without gradients].
        self._param_index = {id(p): i for i, p in enumerate(self.params)}
        self._has_grad = torch.zeros(len(self.params), dtype=torch.int32)
        # Which parameters hold a gradient tensor in torch's terms (got one since the last
        # zero_grad(set_to_none=True)): zero_grad(set_to_none=False) zeroes those, the rest keep None.
        self._grad_exists = set()  # (indices into self.params)
        self._used_flags = DeviceFlags("ZeroOptimizer")  # _has_grad's values on a GPU backend's device
        for p in self.params:
            p.register_post_accumulate_grad_hook(ModelHook(self._mark_grad))
        # Every rank starts from the group's first rank's weights (frozen ones too) and buffers, as DDP does.
        for t in [p.data for p in model.parameters()] + list(model.buffers()):
            if t.is_contiguous():
                comm.broadcast(t, src=self.group.ranks[0], group=self.group)
            else:  # (channels_last and other strided tensors: through a contiguous copy)
                c = t.contiguous()
                comm.broadcast(c, src=self.group.ranks[0], group=self.group)
                t.copy_(c)
        self._setup()
        self._build_inner(optimizer_class, param_groups, optimizer_kwargs)
        for p in self.params:
            p._pz_zero_owner = WeakOwner(self)
        self._leaf_ids = {id(leaf) for _, leaf, _ in self.pieces}  # the inner optimizer's (opt.param_groups')
        for _, leaf, _ in self.pieces:
            leaf._pz_zero_leaf_of = WeakOwner(self)
        live_optimizers.add(self)
        # the model's parameters not trainable now: each forward checks that they stay so (a linear scan
        # of these few, not of every parameter)
        self._frozen = [(n, p) for n, p in model.named_parameters() if id(p) not in self._param_index]
        self._sync_bn = wrappers.SyncBatchNorms()
        model.register_forward_pre_hook(ModelHook(self._before_forward))

    # ---- set-up -------------------------------------------------------------

    def _check_same_optimizer(self, optimizer_class, probe) -> None:
        """Raise on every rank unless every rank of the group builds the same optimizer class with the same
        settings in each param group (lr, betas, weight_decay, ...: each rank steps its own shard with them) and
        the same parameters in each group. One all_gather of a digest; a second, of every rank's settings as
        text, only to name what differs."""
        def shown(v):
            if torch.is_tensor(v):
                v = v.detach().cpu().tolist()
            if isinstance(v, (tuple, list)):
                return "(" + ", ".join(shown(x) for x in v) + ("," if len(v) == 1 else "") + ")"
            return repr(v) if v is None or isinstance(v, (bool, int, float, str)) else type(v).__qualname__
        about = {"optimizer_class": f"{optimizer_class.__module__}.{optimizer_class.__qualname__}",
                 "param_groups": [{k: shown(v) for k, v in sorted(g.items()) if k != "params"}
                                  for g in probe.param_groups],
                 "group_of": [self._group_of[id(p)] for p in self.params]}
        text = json.dumps(about, sort_keys=True).encode()
        rows = comm.every_rank([digest(text, 7), len(text)], group=self.group)
        if bool((rows[:, 0] == rows[0, 0]).all()):
            return
        mine = torch.zeros(int(rows[:, 1].max()), dtype=torch.int32)
        mine[:len(text)] = torch.tensor(list(text), dtype=torch.int32)
        every = comm.every_rank(mine, torch.int32, self.group)
        ranks = [json.loads(bytes(c for c in row.tolist() if c).decode()) for row in every]

        def differ(what, values):
            shown_ = ", ".join(f"{v} on group rank {r}" for r, v in enumerate(values))
            return ValueError(f"{what} differs between the ranks of the group {list(self.group.ranks)} ({shown_}); "
                              "every rank must build its ZeroOptimizer with the same optimizer and settings (each "
                              "steps its shard of the parameters with its own)")
        if len({a["optimizer_class"] for a in ranks}) > 1:
            raise differ("optimizer_class", [a["optimizer_class"] for a in ranks])
        counts = [len(a["param_groups"]) for a in ranks]
        if len(set(counts)) > 1:
            raise differ("the number of param groups", counts)
        for i, n in enumerate(ranks[0]["group_of"]):
            if any(a["group_of"][i] != n for a in ranks):
                raise differ(f"the param group of parameter {self.names[i]!r}",
                             [f"param group {a['group_of'][i]}" for a in ranks])
        for i in range(counts[0]):
            for k in sorted(set().union(*(a["param_groups"][i] for a in ranks))):
                values = [a["param_groups"][i].get(k, "(not set)") for a in ranks]
                if len(set(values)) > 1:
                    raise differ(f"{k!r}" + (f" of param group {i}" if counts[0] > 1 else ""), values)
        raise differ("the optimizer's settings", ["(not shown)"] * len(ranks))  # (a value's text is cut short)

    def _settings_problem(self, i: int, settings: dict) -> str | None:
        """Why the optimizer class refuses `settings` (a checkpoint's) for param group i, or None: it is built
        once on a dummy tensor with the group's settings so changed, those it takes as arguments passed as
        arguments (torch checks lr, betas, weight_decay, ... there, not in a param group)."""
        cls = self._optimizer_class
        try:
            names = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
        except (TypeError, ValueError):
            names = set()
        group = {k: v for k, v in dict(self.param_groups[i], **settings).items() if k != "params"}
        kwargs = {k: v for k, v in group.items() if k in names}
        try:
            cls([dict({k: v for k, v in group.items() if k not in names}, params=[nn.Parameter(torch.zeros(1))])],
                **kwargs)
        except (TypeError, ValueError) as e:
            return f"{cls.__name__} rejects it: {e}"
        return None

    def _check_devices(self):
        """All trainable parameters on one device, the one the group's backend works on: the CPU
        (shm, hier) or this rank's GPU (nccl); every buffer of the stages is made there."""
        devices = {p.device for p in self.params}
        if len(devices) > 1:
            raise ValueError(f"model: parameters are on different devices {sorted(map(str, devices))}; "
                             "expected all on one device")
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise ValueError(f"model: trainable parameters have mixed dtypes {sorted(map(str, dtypes))}; "
                             "keep the model in fp32 and use param_dtype= for mixed precision")
        wide = sorted(str(d) for d in dtypes if d not in _PARAM_DTYPES)
        if wide:
            raise ValueError(f"model: trainable parameters are {wide[0]}; ZeroOptimizer keeps fp32 master weights and "
                             "reduces gradients in fp32 at most, so expected torch.float32, bfloat16 or float16")
        gpu = self.group.device
        want = torch.device("cpu") if gpu is None else torch.device("cuda", gpu)
        got = next(iter(devices))
        if got != want:
            hint = (" (use backend='nccl' for CUDA models)" if gpu is None
                    else f" (move the model to this rank's GPU, the current one since pz.init: model.to('{want}'))")
            raise ValueError(f"model: the group's backend works on {want}, but the parameters are on {got}{hint}")
        self.device = want

    def _assign_groups(self, param_groups):
        if param_groups is None:
            return {id(p): 0 for p in self.params}
        if not isinstance(param_groups, (list, tuple)) or not all(isinstance(g, dict) and "params" in g
                                                                  for g in param_groups):
            raise TypeError("param_groups: expected a list of dicts with a 'params' entry, like torch optimizers")
        trainable_ids = {id(p) for p in self.params}
        in_model = {id(p) for p in self.model.parameters()}
        out = {}
        for i, g in enumerate(param_groups):
            ps = g["params"]
            for p in [ps] if isinstance(ps, torch.Tensor) else ps:
                if isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], str):
                    p = p[1]  # (torch's named form: (name, parameter))
                if not isinstance(p, torch.Tensor) or id(p) not in in_model:
                    what = f"a {type(p).__name__}" if not isinstance(p, torch.Tensor) else f"a tensor of shape " \
                        f"{tuple(p.shape)}"
                    raise ValueError(f"param_groups[{i}]: holds {what} that is not a parameter of the model; "
                                     f"expected the model's parameters")
                if id(p) not in trainable_ids:
                    continue  # frozen: never stepped, as by torch
                if id(p) in out:
                    where = f"twice in param_groups[{i}]" if out[id(p)] == i else "in more than one group"
                    raise ValueError(f"param_groups: a parameter appears {where}")
                out[id(p)] = i
        missing = [n for n, p in zip(self.names, self.params) if id(p) not in out]
        if missing:
            raise ValueError(f"param_groups: trainable parameters missing from every group: {missing[:5]}")
        return out

    def add_param_group(self, param_group: dict) -> None:
        """Not supported: the groups are laid out in the shards at construction."""
        raise ValueError("add_param_group: ZeroOptimizer shards the parameters it was built with and cannot take "
                         "more; pass every group to the constructor (param_groups=[...]), or build a new "
                         "ZeroOptimizer on a fresh model")

    def _to_host(self, t: torch.Tensor) -> torch.Tensor:
        """A host copy of `t`, page-locked where CUDA is (offload of a CUDA model: DMA copies; see
        offload.pinned_empty)."""
        out = _offload.pinned_empty(t.numel(), t.dtype).view(t.shape)
        out.copy_(t)
        return out

    def _grad_buffer(self, n: int) -> torch.Tensor:
        """A zeroed fp32 gradient shard of n elements: in host memory with host copies (see
        [Note: offload of a CUDA model]; in the model dtype where [Note: offload pipeline]
        says), else on the device."""
        if self._host:
            return _offload.pinned_empty(n, self._host_grad_dtype).zero_()
        return torch.zeros(n, dtype=torch.float32, device=self.device)

    def _low_buffer(self, k: int, master: torch.Tensor, dtype) -> torch.Tensor:
        """The 16-bit host copy of master shard `k` (see [Note: offload of a CUDA model])."""
        return self._to_host(master.to(dtype))

    def _refresh_low(self):
        """The 16-bit host copies from the masters (after a load, or an optimizer without copies=)."""
        for (_, master, _), low in zip(self.shards(), self._host_low):
            if low.data_ptr() != master.data_ptr():
                low.copy_(master)

    def _before_host_writes(self):
        """Before a load writes the host masters (and 16-bit copies): no copy to the device still
        reads them (stage 3 copies them at its gathers, see _Unit.gather_input)."""
        if self._host and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _publish_source(self, k: int, master: torch.Tensor) -> torch.Tensor:
        """What a stage copies into its device parameters for master shard `k`: the 16-bit host
        copy where there is one, else the master."""
        return self._host_low[k] if self._host_low else master

    def _build_inner(self, optimizer_class, param_groups, kwargs):
        """One leaf tensor per piece, sharing memory with the fp32 master shard."""
        ngroups = 1 if param_groups is None else len(param_groups)
        groups = [dict(g, params=[]) for g in (param_groups or [{"params": []}])]
        self.pieces: list[tuple[Piece, torch.Tensor, torch.Tensor]] = []  # (piece, master view, grad view)
        self._owner = []  # per piece: its parameter's index in self.params (model order)
        self._shard_grads = self._grad_segments()
        self._hgrads = _HostGrads(self.device, self._shard_grads) if self._host else None
        if self.offload.delayed_update:
            self._delayed = _offload.DelayedStep(self._shard_grads)
            self._hgrads.gate = self._delayed.gate
        self._to_device = _SideCopies(self.device)  # the chunked host step's new values (stages 1-2)
        low = self.param_dtype or self.params[0].dtype
        self._host_low = [self._low_buffer(k, master, low) for k, (_, master, _) in enumerate(self.shards())] \
            if self._host and low != torch.float32 else []
        self._low_of = {}  # per piece: its view of the 16-bit copy, for the step's copies=
        self._piece_at = []  # per piece: (shard, offset in it)
        for k, (layout, master, grad) in enumerate(self.shards()):
            shard_off = layout.shard(self.rank).offset
            for pc in layout.pieces(self.rank):
                lo = pc.offset - shard_off
                leaf = nn.Parameter(master[lo:lo + pc.numel], requires_grad=True)
                g = self._grad_view(k, lo, pc.numel)
                leaf.grad = g if g.dtype == torch.float32 else None  # (16-bit: see [Note: offload pipeline])
                if self._host_low:
                    self._low_of[pc] = self._host_low[k][lo:lo + pc.numel]
                self.pieces.append((pc, leaf, g))
                self._piece_at.append((k, lo))
                self._owner.append(self._param_index[id(layout.params[pc.index])])
                groups[self._group_of[id(layout.params[pc.index])]]["params"].append(leaf)
        # Pieces in model order: with one rank, whole parameters in torch's order (see clip_grad_norm_).
        self._model_order = sorted(range(len(self.pieces)), key=lambda k: (self._owner[k], self.pieces[k][0].start))
        # Ranks whose shard holds only padding still need a tensor per group for torch's checks.
        for g in groups[:ngroups]:
            if not g["params"]:
                g["params"].append(nn.Parameter(torch.zeros(0, device="cpu" if self._host else self.device),
                                                requires_grad=True))
        self.inner = self.offload.build_optimizer(optimizer_class, groups, kwargs)
        self._setup_pipeline()
        # [Note: gradient segments hold storage only while they hold values]
        # On the device path each gradient segment (stage 1-2: one per bucket's part of the
        # shard, stage 3: one per unit) is released by zero_grad(set_to_none=True), as torch
        # frees .grad, and grows back when its first reduced gradient arrives: a reduction
        # that writes the whole segment writes straight into it (_grad_target), others are
        # added (_add_grad). So between steps, through forward and while backward has not yet
        # reached a bucket, no gradient memory is held, and backward allocates it bucket by
        # bucket, as plain torch allocates .grad. Views of a segment stay valid across release and
        # regrowth (the storage is resized in place), but one read while released reads memory that is
        # not there: the inner optimizer's leaves (opt.param_groups, which code such as
        # torch.amp.GradScaler walks) hold their views as .grad only while the segment is live.
        segment_of = {id(g): k for k, g in enumerate(self._shard_grads)}
        self._leaves_of: list[list] = [[] for _ in self._shard_grads]  # per segment: (leaf, its view)
        for _, leaf, g in [] if self._host else self.pieces:  # (host segments are never released)
            k = segment_of.get(id(g._base)) if g is not None and g.dtype == torch.float32 else None
            if k is not None:
                self._leaves_of[k].append((leaf, g))
        self._grad_live = [True] * len(self._shard_grads)
        self._direct: set[int] = set()  # segments a reduction of this backward writes straight into
        if not self._host:
            for k in range(len(self._shard_grads)):
                self._release_grad(k)
        self._optimizer_step_pre_hooks, self._optimizer_step_post_hooks = OrderedDict(), OrderedDict()
        self._optimizer_state_dict_pre_hooks, self._optimizer_state_dict_post_hooks = OrderedDict(), OrderedDict()
        self._optimizer_load_state_dict_pre_hooks = OrderedDict()
        self._optimizer_load_state_dict_post_hooks = OrderedDict()

    # The inner optimizer's param groups, state and defaults, as they are now: its load_state_dict
    # replaces them (as torch's does), and LR schedulers change the ones that step.
    # With delayed_update the inner optimizer steps in the background, after step() returned, while
    # the caller (an LR scheduler) already sets the next step's lr: it steps its own groups, which
    # take the values of these (param_groups) when step() starts the job (_sync_groups).
    @property
    def param_groups(self) -> list[dict]:
        if _called_by_grad_scaler():
            raise RuntimeError("torch.amp.GradScaler does not work with a ZeroOptimizer (it would unscale and check "
                               "for overflow only what this rank holds of the gradients: ranks could step and skip "
                               "apart); give the ZeroOptimizer loss_scale='dynamic' (GradScaler's rules, every "
                               "rank's gradients checked) and use opt.scale_loss(loss).backward() and opt.step() "
                               "instead of the scaler")
        inner = self.inner.param_groups
        if self._delayed is None:
            return inner
        if self._front_of is not inner:  # (new inner groups: load_state_dict)
            self._front, self._front_of = [dict(g) for g in inner], inner
        return self._front

    @param_groups.setter
    def param_groups(self, groups):
        self.inner.param_groups = groups

    def _sync_groups(self):
        """delayed_update, no CPU step running: the inner groups take the hyperparameters set on
        param_groups since the last step (see the note at param_groups)."""
        if self._delayed is not None:
            for front, g in zip(self.param_groups, self.inner.param_groups):
                g.update((k, v) for k, v in front.items() if k != "params")

    @property
    def state(self) -> ShardState:
        """The inner optimizer's state, read-only: keyed by the tensors of param_groups (see ShardState)."""
        return ShardState(self)

    @state.setter
    def state(self, state):
        if isinstance(state, ShardState):
            state = state._opt.inner.state
        self.inner.state = state

    @property
    def defaults(self) -> dict:
        return self.inner.defaults

    @defaults.setter
    def defaults(self, defaults):
        self.inner.defaults = defaults

    def _before_forward(self, module, args):
        """Forward pre-hook on the model: refuse a second data-parallel layer (see pyzero.wrappers) and
        parameters that no longer live where this optimizer keeps them."""
        wrappers.refuse_ddp("pz.ZeroOptimizer", sharded=True)
        wrappers.refuse_accelerate(module, "pz.ZeroOptimizer")
        if not torch.compiler.is_compiling():  # no data pointers in a graph: step() checks a compiled model
            if module.training:
                self._sync_bn.refuse_unsynced(module, "pz.ZeroOptimizer", self.world)
            self._check_home()
            late = [n for n, p in self._frozen if p.requires_grad]
            if late:
                raise RuntimeError(f"model: parameters {late[:5]}{' ...' if len(late) > 5 else ''} became trainable "
                                   f"after the ZeroOptimizer was built; its shards hold the parameters trainable "
                                   f"then, so nothing would step these. Set requires_grad before building it")

    # ---- what a stage provides ----------------------------------------------

    def _check_home(self, every=False):
        """Raise if the model's parameters were replaced since set-up (stages whose parameters stay put):
        a cheap check per forward, all of them at step() (``every``)."""

    def _check_unwritten(self) -> None:
        """Before the shards are exported (state dicts, checkpoints): raise if a write into the model's
        parameters would be lost by it (stage 3: a parameter written while freed)."""

    def _check_tp(self, model) -> None:
        """Tensor-parallel shards (pz.tp's layers): the ZeRO group holds one rank of their TP group, and
        tp_group names that group (clipping adds the TP ranks' parts of their norm; without it each TP
        rank clipped by its own part, and the replicated parameters drifted apart)."""
        named = list(model.named_parameters())
        wrappers.refuse_group_across_tp_shards(named, self.group, "group")
        for name, p in named:
            tp = getattr(p, "tp_ranks", ())
            if len(tp) < 2:
                continue
            if self.tp_group is None or sorted(self.tp_group.ranks) != sorted(tp):
                got = "none" if self.tp_group is None else f"the group of ranks {list(self.tp_group.ranks)}"
                raise ValueError(f"tp_group: parameter {name!r} is a tensor-parallel shard of the group of ranks "
                                 f"{list(tp)}, got {got}; pass that group (dp, tp = pz.mesh(...); "
                                 "ZeroOptimizer(..., group=dp, tp_group=tp))")

    def _check_pp(self) -> None:
        """pp_group: the ranks holding the other pipeline stages of this rank's part of the model, one per
        stage (a Pipeline's group), none of them in `group` or `tp_group`; each stage's norm and overflow
        flag count once. Every rank of it builds its ZeroOptimizer with it (one all_gather over it) and the
        same loss scaling: the last stage scales the loss, and every stage unscales by its own scale. Bad
        values raise on every rank of pp_group."""
        pp = self.pp_group
        if pp is None:
            return
        me = comm.get_rank()
        if pp.rank < 0:
            raise ValueError(f"pp_group: this process (global rank {me}) is not a member of the group "
                             f"{list(pp.ranks)}; expected the pipeline group holding this rank's stage")
        error = None
        for name, g in (("group", self.group), ("tp_group", self.tp_group)):
            shared = sorted(set(pp.ranks) & set(g.ranks) - {me}) if g is not None else []
            if shared and error is None:
                error = ValueError(f"pp_group: global ranks {shared} are in both pp_group {list(pp.ranks)} and "
                                   f"{name} {list(g.ranks)}; expected the pipeline group of this rank's stage "
                                   "(one rank per stage, this rank's peers in no other group of the optimizer), "
                                   "whose norms and overflow flags add to this group's")
        scaling = None if self.scaler is None else [self.scaler.scale, self.scaler.growth_factor,
                                                    self.scaler.backoff_factor, self.scaler.growth_interval,
                                                    self.scaler.dynamic, self.scaler.min_scale]
        rows = comm.every_rank([int(error is None), digest(json.dumps(scaling).encode(), 7)], group=pp).tolist()
        if error is not None:
            raise error
        bad = [r for r, row in enumerate(rows) if not row[0]]
        if bad:
            raise ValueError(f"pp_group: pipeline rank {bad[0]} (global rank {pp.ranks[bad[0]]}) of "
                             f"{list(pp.ranks)} got a pp_group that shares ranks with its group or tp_group")
        if len({row[1] for row in rows}) > 1:
            raise ValueError(f"loss_scale: differs between the ranks of pp_group {list(pp.ranks)} (this rank's: "
                             f"{'None' if scaling is None else dict(zip(_SCALING, scaling))}); the last stage "
                             "scales the loss with its scale and every stage unscales its gradients by its own, so "
                             "every stage's ZeroOptimizer needs the same loss_scale (and scaler state)")

    def _check_group(self):
        """Refuse options the group cannot take, before anything touches the model (a stage's own checks)."""

    def _setup(self):
        raise NotImplementedError

    def shards(self) -> list[tuple[FlatLayout, torch.Tensor, torch.Tensor]]:
        """(layout, fp32 master shard, fp32 gradient shard) per flat buffer of this rank."""
        raise NotImplementedError

    def _reduce_gradients(self):
        """Make the gradient shards hold the group-averaged gradients."""
        raise NotImplementedError

    def _publish_parameters(self):
        """After the shard update: make the model's parameters hold the new values."""
        raise NotImplementedError

    def _start_backward(self):
        """Get ready for the next backward (stages that reduce during backward)."""

    def _grad_segments(self) -> list[torch.Tensor]:
        """The fp32 gradient segments (see [Note: gradient segments hold storage only while they
        hold values]); by default one per self.shards() entry, its gradient shard."""
        return [grad for _, _, grad in self.shards()]

    def _grad_view(self, k: int, lo: int, n: int) -> torch.Tensor:
        """Elements [lo, lo + n) of shard `k`'s gradient (offsets relative to the shard start)."""
        return self._shard_grads[k][lo:lo + n]

    def _release_grad(self, k: int) -> None:
        g = self._shard_grads[k]
        if g.numel():
            g.untyped_storage().resize_(0)
        for leaf, _ in self._leaves_of[k]:
            leaf.grad = None
        self._grad_live[k] = False

    def _grow_grad(self, k: int, zero: bool) -> torch.Tensor:
        g = self._shard_grads[k]
        if not self._grad_live[k]:
            if g.numel():
                with memtrace.region("pyzero.grad"):
                    g.untyped_storage().resize_(g.numel() * g.element_size())
                if zero:
                    g.zero_()
            for leaf, view in self._leaves_of[k]:
                leaf.grad = view
            self._grad_live[k] = True
        return g

    def _grad_target(self, k: int, dtype: torch.dtype) -> torch.Tensor | None:
        """Segment `k` itself as the output of a reduction that writes all of it, when it holds
        no values yet (and the reduction's dtype is fp32, on the device path); else None: the
        caller reduces into a buffer of its own and hands it to _add_grad."""
        if self._host or self._grad_live[k] or dtype != torch.float32:
            return None
        self._direct.add(k)
        return self._grow_grad(k, zero=False)

    def _direct_grad(self, k: int) -> torch.Tensor | None:
        """[Note: one rank writes gradients straight into their segments] In a group of one rank
        the average of a gradient is the gradient: a stage copies each parameter's gradient
        straight into gradient segment `k` (no staging buffer, no collective; a second copy of
        the gradients is what it saves) when the segment held no values before this backward.
        Returns the segment (grown, zeroed: what no gradient reaches stays zero), or None where
        the general path runs: several ranks, host copies, a communication dtype other than
        fp32 (whose rounding the general path applies), or values from an earlier backward."""
        if not self._can_direct(k):
            return None
        if k not in self._direct:
            self._direct.add(k)
            self._grow_grad(k, zero=True)
        return self._shard_grads[k]

    def _can_direct(self, k: int) -> bool:
        """Whether _direct_grad(k) gives the segment (and changes nothing)."""
        if self.world != 1 or self._host or self.comm_dtype != torch.float32:
            return False
        return k in self._direct or not self._grad_live[k]

    def _add_grad(self, shard: int, lo: int, hi: int, reduced: torch.Tensor) -> None:
        """Stages call this once `reduced` (on the device, as queued on the current stream) holds
        the reduced gradients of [lo, hi) of gradient segment `shard` (self._shard_grads order):
        added into the segment, with host copies on the host (see [Note: offload of a CUDA model])."""
        if self._host:
            if self._pipe_mode is True:
                self._check_loop_shape("another synchronised backward", self._synced_backwards > 0)
            direct = self._hgrads.put(shard, lo, hi, reduced)
            if self._pipe_mode is True:
                self._early_step(shard, lo, hi, direct)
        else:
            self._grow_grad(shard, zero=True)[lo:hi].add_(reduced)

    def _finish_gradients(self):
        """The gradient shards reduced; with host copies, those landed and were added too; a
        segment no reduction reached holds zeros."""
        self._reduce_gradients()
        if self._host:
            self._hgrads.finish()
        else:
            for k in range(len(self._shard_grads)):
                self._grow_grad(k, zero=True)

    def comm_plan(self) -> list[list[CollectiveCall]]:
        """The collectives one synchronised training step issues on this group, in order, as
        phases: the calls of one phase may be in flight together, a phase starts when the one
        before has finished. Benchmarks replay it on scratch buffers to time communication alone."""
        raise NotImplementedError

    # ---- the optimizer API ----------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (no communication) for the backward passes inside."""
        prev, self._sync = self._sync, False
        try:
            yield
        finally:
            self._sync = prev

    def _require_grads(self, what):
        if not self._grads_ready:
            raise RuntimeError(f"{what}: no gradients since the last step; run loss.backward() first "
                               "(the weights were not touched)")

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
                        ) -> torch.Tensor:
        """Clip the gradients of the whole model (all shards); returns the total norm, like torch's.

        The arithmetic is torch.nn.utils.clip_grad_norm_'s (fp32 norm of the per-tensor norms, one
        fp32 coefficient), so a group of one rank clips bit for bit like torch. Across ranks the
        per-rank norms are combined in fp64. ``error_if_nonfinite``: as torch's, a RuntimeError (on every
        rank, nothing clipped) when the norm is NaN or infinite (not for an fp16 overflow, which step()
        skips).
        """
        if not is_real(max_norm) or not max_norm >= 0:
            raise ValueError(f"max_norm: expected a non-negative number, got {max_norm!r}")
        try:
            if isinstance(norm_type, bool):
                raise TypeError
            norm_type = float(norm_type)
        except (TypeError, ValueError):
            raise ValueError(f"norm_type: expected a number or float('inf'), got {norm_type!r}") from None
        if not norm_type > 0:
            raise ValueError(f"norm_type: expected a positive p (or inf), got {norm_type!r}")
        if not isinstance(error_if_nonfinite, bool):
            raise TypeError(f"error_if_nonfinite: expected True or False, got {error_if_nonfinite!r}")
        self._require_grads("clip_grad_norm_")
        self._check_loop_shape("clip_grad_norm_")
        self._clipped = True
        self._finish_gradients()
        if self._check_overflow():
            return torch.tensor(float("inf"), device=self.device)  # nothing clipped: step() will skip
        # Pieces in model order: with one rank these are whole parameters, in torch's order.
        grads = [self.pieces[k][2] for k in self._model_order]
        where = self._grads_device()
        split = any(g is not None and g.size > 1 for g in (self.tp_group, self.pp_group))
        if split:  # (in fp64, of every piece's elements: see _split_norm)
            total = self._split_norm(norm_type, where)
        else:
            if grads:
                # (16-bit host shards, see [Note: offload pipeline]: each norm computed in fp32, as of the
                # widened values)
                local = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(
                    g, norm_type, dtype=None if g.dtype == torch.float32 else torch.float32) for g in grads]),
                    norm_type)
            else:
                local = torch.zeros((), device=where)
            total = self._combine_norms(local, norm_type)
        if self._host and self.scaler is not None and not self._host_unscaled:
            # the host shards are raw (see [Note: offload of a CUDA model]); with the power-of-two
            # scales of dynamic scaling this equals the norm of the unscaled gradients bit for bit
            total = total * (1.0 / self.scaler.scale)
            if not split and not torch.isfinite(total):  # (the same total on every rank)
                # The gradients are finite (_check_overflow), but the fp32 squares of scaled ones overflow once
                # the norm times the scale passes about 1.8e19 (a scale of 2**64, which dynamic scaling reaches
                # in bf16 and fp32, with a norm of 1): again in fp64, unscaled before the ranks combine them.
                local = (torch.linalg.vector_norm(torch.stack(
                    [torch.linalg.vector_norm(g, norm_type, dtype=torch.float64) for g in grads]), norm_type)
                    * (1.0 / self.scaler.scale)) if grads else torch.zeros((), dtype=torch.float64, device=where)
                total = self._combine_norms(local, norm_type).to(torch.float32)
        if self._host and self._clip_coef is not None:
            # (clipped before in this step: the step applies that coefficient, the norm is of the clipped gradients)
            total = total * self._clip_coef
        if error_if_nonfinite and not torch.isfinite(total):  # (the same total on every rank)
            raise RuntimeError(f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, "
                               "so it cannot be clipped. To disable this error and scale the gradients by the "
                               "non-finite norm anyway, set `error_if_nonfinite=False`")
        coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0)
        if self._host:  # the step applies it (see _host_step)
            self._clip_coef = coef if self._clip_coef is None else self._clip_coef * coef
            return total.to(self.device)
        for g in grads:
            g.mul_(coef)
        return total

    def _combine_norms(self, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The group's norm from every rank's `local` norm (fp32 for an fp32 `local`)."""
        if self.world == 1:
            return local
        if norm_type == float("inf"):
            return self._all_reduce_small(local.reshape(1).clone(), "max", self.group)[0]
        acc = self._all_reduce_small(local.to(torch.float64).pow(norm_type).reshape(1), "sum", self.group)
        return acc[0].pow(1.0 / norm_type).to(local.dtype if local.dtype == torch.float64 else torch.float32)

    def _grads_device(self) -> torch.device:
        """Where the gradient shards are: the host with host copies (see [Note: offload of a CUDA
        model]), else the group's device."""
        return torch.device("cpu") if self._host else self.device

    def _all_reduce_small(self, t: torch.Tensor, op: str, group) -> torch.Tensor:
        """all_reduce of a few values held where the gradient shards are: through the group's
        device when that is not where they are (host copies of a CUDA model)."""
        if t.device == self.device:
            comm.all_reduce(t, op=op, group=group)
            return t
        dev = t.to(self.device)
        comm.all_reduce(dev, op=op, group=group)
        return dev.to(t.device)

    def _split_norm(self, norm_type, where):
        """Norm over the DP shards, the TP parts and the pipeline stages, in fp64: TP-sharded parameters
        summed over the TP group, replicated ones (identical on every TP rank) counted once, each stage's
        part added over pp_group, where a parameter marked ``pp_shared`` (a copy of one an earlier stage
        holds and counts, e.g. a tied embedding) is left out."""
        pp = self.pp_group is not None and self.pp_group.size > 1
        order = [k for k in self._model_order
                 if not (pp and getattr(self.params[self._owner[k]], "pp_shared", False))]
        grads = [self.pieces[k][2] for k in order]
        sharded = [getattr(self.params[self._owner[k]], "tp_sharded", False) for k in order]
        tp = self.tp_group if self.tp_group is not None and self.tp_group.size > 1 else None
        if norm_type == float("inf"):  # a max counts replicated values any number of times
            acc = torch.zeros(1, dtype=torch.float64, device=where)
            for g in grads:
                if g.numel():
                    torch.maximum(acc, g.abs().max().to(torch.float64), out=acc)
            for g in (self.group, tp, self.pp_group):
                if g is not None and g.size > 1:
                    acc = self._all_reduce_small(acc, "max", g)
            return acc[0].to(torch.float32)
        acc = torch.zeros(2, dtype=torch.float64, device=where)
        for g, is_tp in zip(grads, sharded):
            acc[0 if is_tp else 1] += g.to(torch.float64).abs().pow(norm_type).sum()
        if self.world > 1:
            acc = self._all_reduce_small(acc, "sum", self.group)
        part = acc[:1] if tp is None else self._all_reduce_small(acc[:1].clone(), "sum", tp)
        total = (part[0] + acc[1]).reshape(1)
        if pp:
            total = self._all_reduce_small(total, "sum", self.pp_group)
        return total[0].pow(1.0 / norm_type).to(torch.float32)

    def step(self, closure=None):
        """One optimizer step on the reduced gradients, between the hooks of register_step_pre_hook and
        register_step_post_hook, as torch runs them (torch's global step hooks run with the inner
        optimizer's step). With loss_scale the pre-hooks see the unscaled gradients, and a step skipped
        for an overflow runs no hook: as torch.amp.GradScaler unscales before optimizer.step() and
        does not call it on an overflow."""
        args, kwargs = (self,), ({} if closure is None else {"closure": closure})
        pre = self._optimizer_step_pre_hooks
        if pre:
            # slots stepped during backward have no gradients left to show (a hook registered after the
            # loop's shape was learnt: see _learn_loop_shape)
            self._check_loop_shape("a step pre-hook (it reads the gradients, some already stepped)")
        if (pre or (self._optimizer_step_post_hooks and self.scaler is not None)) and self._grads_ready \
                and not self._unreduced:
            # the pre-hooks see the reduced gradients in the param_groups' tensors, as under torch (stage 1
            # reduces them in step(): before the hooks, not after), unscaled; an overflow is decided first
            self._finish_gradients()
            if self._check_overflow():
                return self._step(*args[1:], **kwargs)  # (skipped, no hook runs)
            if pre and self._host:
                if self._host_grad_dtype != torch.float32:
                    self._widen_host_grads()  # 16-bit host shards have no .grad to show: fp32 from now on
                self._apply_host_factor()
        for hook in list(pre.values()):
            result = hook(self, args, kwargs)
            if result is not None:
                if not (isinstance(result, tuple) and len(result) == 2):
                    raise RuntimeError(f"step pre-hook {hook!r} must return None or a tuple of (new_args, new_kwargs), "
                                       f"but got {result!r}")
                args, kwargs = result
        out = self._step(*args[1:], **kwargs)
        for hook in list(self._optimizer_step_post_hooks.values()):
            hook(self, args, kwargs)
        return out

    @torch.no_grad()
    def _step(self, closure=None):
        if closure is not None:
            raise ValueError("closure: not supported by ZeroOptimizer (call the model, backward, then step()); "
                             "lightning.Trainer steps with a closure unless its strategy is "
                             "pyzero.integrations.lightning.PyzeroStrategy")
        self._require_grads("step")
        if self._unreduced:
            raise RuntimeError("step: the last backward ran inside no_sync(), so its gradients (and those it "
                               "accumulated) are in .grad, not reduced into this rank's shard (stages 2-3 "
                               "reduce during a synced backward); run the last micro-batch's backward outside "
                               "no_sync() (the weights were not touched)")
        self._check_home(every=True)
        self._finish_gradients()
        if self._delayed is not None:
            self._delayed_step()
            return
        if self._pipe_mode:
            self._pipeline_step()
            return
        if self._check_overflow():
            self.scaler.update(overflow=True)
            self._clear_grads()
            return
        # [Note: parameters without gradients]
        # torch's optimizers skip a parameter whose .grad is None (no update, no weight decay, no
        # state). A parameter that no rank's backward reached has only zeros in its gradient shard,
        # so its pieces are hidden from the inner optimizer for this step, as torch would skip it.
        used = self._used()
        skipped = [(leaf, g) for (_, leaf, g), i in zip(self.pieces, self._owner) if not used[i]]
        for leaf, _ in skipped:
            leaf.grad = None
        try:
            if self._host:
                self._host_step()
            else:
                self.inner.step()
        finally:
            for leaf, g in skipped:
                leaf.grad = g
        self._publish_parameters()
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        # The gradients are consumed: a stage's shards mix reduced and local values, and
        # model.zero_grad() cannot reach them, so start the next step from zero either way.
        self._clear_grads()

    def _used(self) -> torch.Tensor:
        """Per parameter, 1 if any rank's backward reached it since zero_grad (see [Note:
        parameters without gradients])."""
        used = self._has_grad.clone()
        if self.world > 1:
            if self.device.type == "cpu":
                comm.all_reduce(used, op="max", group=self.group)
            else:  # through the device; read back only where this rank lacks a gradient: when every
                # parameter got one here the maximum is all ones, and the host does not wait for the GPU
                dev = self._used_flags.get(used.tolist(), self.device, device_capturing(self.device))
                comm.all_reduce(dev, op="max", group=self.group, async_op=True).wait()
                if not bool(used.all()):
                    used = dev.cpu()
        self._grad_exists.update(used.nonzero().flatten().tolist())
        return used

    def _delayed_step(self):
        """step() with delayed_update (see [Note: delayed update])."""
        overflow = self._check_overflow()  # (both verdicts from g_t, before any CPU step starts)
        factor = self._host_factor()
        used = None if overflow else self._used()
        self._publish_delayed()  # the step of step t-1: its parameters go to the model now
        if overflow:
            self.scaler.update(overflow=True)
            self._clear_grads()
            return
        spare = self._delayed.grads
        views = []  # per piece: its view of the job's gradient copy, None where skipped
        for k, (layout, _, _) in enumerate(self.shards()):
            shard_off = layout.shard(self.rank).offset
            for pc in layout.pieces(self.rank):
                lo = pc.offset - shard_off
                views.append(spare[k][lo:lo + pc.numel])
        views = [v if used[i] else None for v, i in zip(views, self._owner)]

        def job():
            grads = [leaf.grad for _, leaf, _ in self.pieces]
            for (_, leaf, _), v in zip(self.pieces, views):
                leaf.grad = v
            try:
                self._to_device.wait()  # the last publish's copies have read what this step changes
                if not self._inner_step(factor, spare, self._low_copies):
                    self._refresh_low()
            finally:
                for (_, leaf, _), g in zip(self.pieces, grads):
                    leaf.grad = g
        self._sync_groups()  # (this step's hyperparameters; the job steps with them, however late it starts)
        self._delayed.submit(self._shard_grads, job)
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        self._clear_grads()

    def __deepcopy__(self, memo):
        raise TypeError(_not_copied("copy.deepcopy"))

    def __reduce_ex__(self, protocol):
        raise TypeError(_not_copied("copy.copy, pickle or torch.save"))

    def gathered_parameters(self, params=None, modifier_rank: int | None = None):
        """A context manager: `params` (model parameters; all it trains by default) whole on every rank
        inside the block, what the block writes into them kept, as DeepSpeed's zero.GatheredParameters.
        Every rank of the group enters it with the same params. With ``modifier_rank`` (a global rank)
        every rank takes that rank's values at the end; without, the ranks must change them alike
        (compared: a RuntimeError on every rank if not). Run the block under torch.no_grad(). See
        pyzero.zero.gathered."""
        return _gathered.gather_block(self, params, modifier_rank)

    def _hold(self, params: list) -> list:
        """gathered_parameters(): make `params` whole until _release(what this returns)."""
        return []

    def _release(self, held: list) -> None:
        """gathered_parameters(): what _hold gathered may be freed again."""

    def _own_slices(self, held: list) -> list[tuple[int, torch.Tensor]]:
        """gathered_parameters(): (index into shards(), the model-dtype values of this rank's part of it)."""
        raise NotImplementedError

    def _synced_values(self, held: list, params: list) -> list[torch.Tensor]:
        """gathered_parameters(): contiguous tensors holding `params`' values, the same on every rank."""
        raise NotImplementedError

    def synchronize(self) -> None:
        """With delayed_update: wait for the CPU step in flight and put its parameters into the
        model (e.g. before evaluating or at the end of training). Otherwise nothing to do."""
        if self._delayed is not None:
            self._publish_delayed()

    def _publish_delayed(self):
        self._delayed.wait()
        if self._delayed.unpublished:
            self._delayed.unpublished = False
            self._publish_parameters()

    def _settle(self):
        """Wait for a delayed CPU step in flight (its masters and state are then final)."""
        if self._delayed is not None:
            self._delayed.wait()
            self._sync_groups()

    def _host_factor(self) -> float:
        """What the host step multiplies the host gradient shards by: 1/scale (they are raw, see [Note:
        offload of a CUDA model]) times the clip coefficient, or what of it _apply_host_factor left."""
        factor = 1.0 if self.scaler is None or self._host_unscaled else 1.0 / self.scaler.scale
        if self._clip_coef is not None:
            factor *= float(self._clip_coef)
        return factor

    def _apply_host_factor(self) -> None:
        """Host copies, before the step pre-hooks: the host gradient shards take the factor the step would
        apply (1/scale, the clip coefficient), so the hooks see (and edit) the gradients the step applies, as
        under torch; the step applies none (the same product, so the same values)."""
        factor = self._host_factor()
        if factor != 1.0:
            for g in self._shard_grads:
                g.mul_(factor)
        self._clip_coef = None
        self._host_unscaled = True

    def _host_step(self):
        """The inner step on the host copies, applying 1/scale times the clip coefficient to the
        raw host gradients. With offload_params the device is idle first: gathers read host shards
        this step changes."""
        if self.offload.offload_params and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._to_device.wait()  # the last step's copies to the device have read what this step changes
        factor = self._host_factor()
        chunks = self._step_chunks() if isinstance(self.inner, _SCALED_STEP) else [(0, len(self.pieces))]
        if len(chunks) > 1:
            copies = self._low_copies() if self._host_low else None
            # [Note: chunked host step] Pieces in chunks, each chunk's new values on their way to the
            # device while the next chunk steps (the other pieces' gradients hidden from the inner
            # optimizer, which steps only parameters with a gradient; each piece keeps its own step
            # count, so the chunks together are the one step, bit for bit).
            try:
                for a, b in chunks:
                    hidden = [(leaf, g) for i, (_, leaf, g) in enumerate(self.pieces)
                              if not a <= i < b and leaf.grad is not None]
                    for leaf, _ in hidden:
                        leaf.grad = None
                    try:
                        self.inner.step(grad_scale=factor, copies=copies)
                    finally:
                        for leaf, g in hidden:
                            leaf.grad = g
                    self._stepped(a, b)
            except BaseException:
                self._to_device.join()  # (the copies started stay ordered before later device work)
                raise
            return
        # (the gradients in host memory: see [Note: offload of a CUDA model])
        if not self._inner_step(factor, self._shard_grads, self._low_copies):
            self._refresh_low()

    def _inner_step(self, factor: float, grads, copies) -> bool:
        """The inner optimizer's step on its gradients `grads` times `factor`: in the kernel's one pass
        where it takes grad_scale= (writing the 16-bit host copies, `copies()`, as it goes), else with
        the gradients scaled first. Returns whether the 16-bit copies were written (else the caller
        refreshes them)."""
        if isinstance(self.inner, _SCALED_STEP):  # applied in the kernel's one pass
            self.inner.step(grad_scale=factor, copies=copies() if self._host_low else None)
            return True
        if factor != 1.0:
            for g in grads:
                g.mul_(factor)
        self.inner.step()
        return False

    def _low_copies(self) -> dict:
        """{parameter piece: its 16-bit host copy}, for the inner step's copies=."""
        return {leaf: self._low_of[pc] for pc, leaf, _ in self.pieces}

    def _step_chunks(self) -> list[tuple[int, int]]:
        """Ranges of self.pieces the host step runs one after the other (see [Note: chunked host
        step]): one range unless a stage sends each chunk's values to the device as it is done."""
        return [(0, len(self.pieces))]

    def _stepped(self, a: int, b: int) -> None:
        """The host step finished pieces [a, b) (see [Note: chunked host step])."""

    # ---- offload pipeline (see [Note: offload pipeline]) -----------------------

    def _reduced_dtype(self) -> torch.dtype | None:
        """The dtype a stage's reduced gradient slices arrive in; None where they are not the
        reduced values themselves (quantised reductions)."""
        return self.comm_dtype

    def _pipeline_slots(self) -> list[tuple[int, int, int]]:
        """(gradient segment, lo, hi) of each slot, in the order they step: by default one per
        segment, all of it (stage 3: a unit)."""
        return [(k, 0, g.numel()) for k, g in enumerate(self._shard_grads)]

    def _set_grad_shard(self, k: int, t: torch.Tensor) -> None:
        """Make `t` the gradient shard `k` of self.shards() (the host shards widened to fp32)."""
        raise NotImplementedError

    def _setup_pipeline(self):
        self._slots = self._pipeline_slots() if self._pipe_mode else []
        self._slot_at = {slot: s for s, slot in enumerate(self._slots)}
        self._slot_pieces: list[list[int]] = [[] for _ in self._slots]
        self._steps = _offload.SlotSteps(len(self._slots)) if self._pipe_mode else None
        self._scratch = None
        if not self._pipe_mode:
            return
        for i, (k, lo) in enumerate(self._piece_at):  # (a piece lies in one slot: slots end on parameters)
            hi = lo + self.pieces[i][0].numel
            s = next(s for s, (kk, a, b) in enumerate(self._slots) if kk == k and a <= lo and hi <= b and
                     (a < b or lo == hi))
            self._slot_pieces[s].append(i)
        if self._host_grad_dtype != torch.float32:
            self._scratch = torch.empty(max((hi - lo for _, lo, hi in self._slots), default=0), dtype=torch.float32)
        self._hgrads.widen = self._widen_host_grads

    def _hide_leaf_grads(self):
        for _, leaf, _ in self.pieces:
            leaf.grad = None

    def _show_leaf_grads(self):
        for _, leaf, g in self.pieces:
            leaf.grad = g if g.dtype == torch.float32 else None

    def _check_loop_shape(self, what: str, changed: bool = True) -> None:
        """Raise if slots already stepped during this backward (see [Note: offload pipeline])."""
        steps = getattr(self, "_steps", None)
        if changed and steps is not None and steps.any_submitted():
            raise RuntimeError(f"{what}: with offload_pipeline=True the CPU step of this backward's gradients already "
                               f"started during backward (the steps before had one synchronised backward and no "
                               f"clipping), and cannot be taken back; for a loop that clips, accumulates or zeroes "
                               f"gradients only at some steps pass offload_pipeline='step'")

    def _early_step(self, k: int, lo: int, hi: int, direct: bool) -> None:
        """A slot's gradient has been queued to its host shard during backward: step it now when
        that is exact (see [Note: offload pipeline])."""
        if not self._early_ok or self._synced_backwards > 0 or not direct:
            return
        s = self._slot_at.get((k, lo, hi))
        if s is None or self._steps.submitted(s) or not self._slot_pieces[s]:
            return
        if not all(self._has_grad[self._owner[i]] for i in self._slot_pieces[s]):
            return  # (used on this rank: then on every rank; else step() decides)
        if not self._steps.any_submitted():
            self._hide_leaf_grads()
        self._steps.submit(s, self._slot_job(s, 1.0, None, self._hgrads.landed()))

    def _slot_job(self, s: int, factor: float, used, landed=None):
        """The inner step of slot s's pieces (those whose parameter is used), applying `factor`
        (1/scale times the clip coefficient) to the raw host gradients."""
        def job():
            if landed is not None:
                landed.synchronize()  # the slot's gradient is in the host shard
            self._to_device.wait()  # the last copies to the device have read what this step changes
            idx = [i for i in self._slot_pieces[s] if used is None or used[self._owner[i]]]
            if not idx:
                return
            k, lo, hi = self._slots[s]
            g = self._shard_grads[k]
            if g.dtype != torch.float32:  # 16-bit host gradients: widened into the scratch first
                wide = self._scratch[:hi - lo]
                wide.copy_(g[lo:hi])
                grads = [wide[self._piece_at[i][1] - lo:self._piece_at[i][1] - lo + self.pieces[i][0].numel]
                         for i in idx]
            else:
                grads = [self.pieces[i][2] for i in idx]
            leaves = [self.pieces[i][1] for i in idx]
            for leaf, gr in zip(leaves, grads):
                leaf.grad = gr
            try:
                def slot_copies():
                    return {leaf: self._low_of[self.pieces[i][0]] for i, leaf in zip(idx, leaves)}

                if not self._inner_step(factor, grads, slot_copies) and self._host_low:
                    master, low = self.shards()[k][1], self._host_low[k]
                    if low.data_ptr() != master.data_ptr():
                        low[lo:hi].copy_(master[lo:hi])
            finally:
                for leaf in leaves:
                    leaf.grad = None
        return job

    def _hyperparameters(self) -> list:
        """The param_groups' settings (all but the parameters), comparable with ==."""
        def plain(v):
            if torch.is_tensor(v):
                return tuple(v.detach().flatten().tolist())
            return tuple(plain(x) for x in v) if isinstance(v, (tuple, list)) else v
        return [sorted((k, plain(v)) for k, v in g.items() if k != "params") for g in self.param_groups]

    def _pipeline_step(self):
        """step() with offload_pipeline (see [Note: offload pipeline])."""
        early = self._steps.any_submitted()
        moved = self._hparams_at_backward is not None and self._hyperparameters() != self._hparams_at_backward
        self._hparams_at_backward = None
        self._hparams_moved = moved
        self._check_loop_shape("a change of the param_groups' settings (lr, betas, ...) after backward", moved)
        if self._check_overflow():  # (never with early slots: they need no loss scaling)
            self._learn_loop_shape()
            self.scaler.update(overflow=True)
            self._clear_grads()
            return
        used = self._used()
        factor = self._host_factor()
        if self.offload.offload_params and self.device.type == "cuda" and not early:
            torch.cuda.synchronize(self.device)  # (gathers read the host shards this step changes)
        if not early:
            self._hide_leaf_grads()
        try:
            for s in range(len(self._slots)):
                if not self._steps.submitted(s):
                    self._steps.submit(s, self._slot_job(s, factor, used))
            for s, idx in enumerate(self._slot_pieces):
                self._steps.wait(s)
                if idx:
                    self._stepped(idx[0], idx[-1] + 1)
        except BaseException:
            with contextlib.suppress(BaseException):
                self._steps.wait_all()
            self._to_device.join()  # (the copies started stay ordered before later device work)
            raise
        finally:
            self._steps.reset()
            self._show_leaf_grads()
        self._publish_parameters()
        self._learn_loop_shape()
        if self.scaler is not None:
            self.scaler.update(overflow=False)
        self._clear_grads()

    def _learn_loop_shape(self):
        """After a step: slots may step during the next backward if this step's loop allows it."""
        self._early_ok = (self._pipe_mode is True and self.stage != 1 and self.scaler is None
                          and self._synced_backwards == 1 and not self._clipped and not self._hparams_moved
                          and not self._optimizer_step_pre_hooks)
        self._clipped = False

    def _widen_host_grads(self):
        """16-bit host gradient shards to fp32, for good (a synchronised backward adds to the
        gradients on the host: see [Note: offload pipeline]). No copy is still landing."""
        for k, g in enumerate(self._shard_grads):
            wide = _offload.pinned_empty(g.numel(), torch.float32)
            wide.copy_(g)
            self._shard_grads[k] = wide  # (the list _HostGrads holds)
            self._set_grad_shard(k, wide)
        self._host_grad_dtype = torch.float32
        self._scratch = None
        for i, (pc, leaf, _) in enumerate(self.pieces):
            k, lo = self._piece_at[i]
            g = self._grad_view(k, lo, pc.numel)
            self.pieces[i] = (pc, leaf, g)
            leaf.grad = g

    # ---- loss scaling (fp16) ---------------------------------------------------

    @property
    def loss_scale(self) -> float:
        """The current loss scale (1.0 without loss_scale=)."""
        return 1.0 if self.scaler is None else self.scaler.scale

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """``opt.scale_loss(loss).backward()``: the loss times the current scale."""
        return loss if self.scaler is None else loss * self.scaler.scale

    def _check_overflow(self) -> bool:
        """Once per step, on the reduced shards: inf/NaN on any rank (of the DP, TP and pipeline groups)?
        If none, unscale the gradients in place (exact: the scale is a power of two); the host
        shards of host copies stay raw, the step unscales them (see _host_step)."""
        if self.scaler is None:
            return False
        if self._overflow is None:
            bad = torch.zeros(1, device=self._grads_device())  # 1 where a shard holds inf/NaN; one read at the end
            for g in self._shard_grads:
                if g.numel():
                    torch.maximum(bad, (~torch.isfinite(g)).any().to(bad.dtype), out=bad)
            for g in (self.group, self.tp_group, self.pp_group):
                if g is not None and g.size > 1:
                    bad = self._all_reduce_small(bad, "max", g)
            self._overflow = bool(bad[0])
            if not self._overflow and not self._host:  # (host copies stay raw: see _host_step)
                inv = 1.0 / self.scaler.scale
                for g in self._shard_grads:
                    g.mul_(inv)
        return self._overflow

    def _mark_grad(self, p):
        self._has_grad[self._param_index[id(p)]] = 1

    def _drain(self):
        """Wait for in-flight gradient reductions and fold them into the shards (nothing is started)."""
        self._inflight.retire()

    def _discard(self):
        """Forget a backward that cannot finish: wait for its in-flight reductions (every rank
        launched them) without adding them, and start over. A segment such a reduction wrote
        straight into held no values before it: it is released again."""
        self._inflight.discard()
        for k in self._direct:
            self._release_grad(k)
        self._direct.clear()
        self._start_backward()

    def _end_of_backward(self):
        """Stages call this when a backward has launched all its reductions: they are waited for
        and folded into the shards (so when backward returns no staging buffer is held, only the
        gradient shards: on a GPU the wait is the compute stream's, the host goes on), and what
        they wrote straight into a segment is this backward's to keep."""
        self._drain()
        self._direct.clear()
        if self._pipe_mode is True and self._synced_backwards == 0:
            self._hparams_at_backward = self._hyperparameters()
        self._synced_backwards += 1

    def zero_grad(self, set_to_none: bool = True):
        """Zeroes the gradient shards; set_to_none (the default, as torch's) releases their
        memory instead (see [Note: gradient segments hold storage only while they hold values]).
        As with torch, set_to_none=False gives a zero gradient (stepped: momentum, weight decay)
        only to the parameters that got one since the last zero_grad(set_to_none=True); the others
        stay without one, skipped by step()."""
        check_bool(set_to_none, "set_to_none")
        self._grad_exists.update(self._has_grad.nonzero().flatten().tolist())
        if set_to_none:
            self._grad_exists.clear()
        self._clear_grads(set_to_none)

    def _clear_grads(self, set_to_none: bool = True):
        """zero_grad() without forgetting which parameters hold a gradient in torch's terms: the
        end of step(), which consumes the gradients."""
        self._check_loop_shape("zero_grad() before step()")
        self._synced_backwards = 0
        self._drain()  # a reduce-scatter still in flight must not land in the zeroed shards
        self._forget_host_copies()
        self._direct.clear()
        if not self._host:  # (host copies: _HostGrads zeroes what no reduction writes)
            for k in range(len(self._shard_grads)):
                if set_to_none:
                    self._release_grad(k)
                else:
                    self._grow_grad(k, zero=False).zero_()
        self._zero_model_grads(set_to_none)
        self._grads_ready = self._unreduced = False
        self._overflow = None
        self._has_grad.zero_()
        if not set_to_none:  # torch steps zero (not None) gradients
            self._has_grad[sorted(self._grad_exists)] = 1

    def _forget_host_copies(self):
        """Before the gradients start afresh: no copy to the host may still be landing, the host
        shards take the next backward's values as new, and so does the clip coefficient."""
        if self._host:
            self._hgrads.restart()
            self._clip_coef = None
            self._host_unscaled = False

    def _zero_model_grads(self, set_to_none):
        for p in self.params:
            p.grad = None

    def state_dict(self) -> dict:
        """This rank's shard of the optimizer: inner state plus what each piece is. The hooks of
        register_state_dict_pre_hook / register_state_dict_post_hook run around it, as torch runs them."""
        for hook in list(self._optimizer_state_dict_pre_hooks.values()):
            hook(self)
        self._check_unwritten()
        self._settle()
        out = {"stage": self.stage, "world": self.world, "rank": self.rank,
               "pieces": [(pc.name, pc.start, pc.end) for pc, _, _ in self.pieces],
               "master": [leaf.detach().clone() for _, leaf, _ in self.pieces],
               "inner": self.inner.state_dict()}
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        for hook in list(self._optimizer_state_dict_post_hooks.values()):
            changed = hook(self, out)
            if changed is not None:
                out = changed
        return out

    def shard_state(self) -> dict:
        """This rank's shard as copies, per piece (this rank's part of one parameter, in
        ``self.pieces`` order): "pieces" (name, start, end) of the flattened parameter, "master"
        its fp32 values, "state" its inner-optimizer state (e.g. exp_avg, step) and "index" its
        position among the inner optimizer's parameters. Gradient reductions still in flight are
        waited for first, so nothing changes the shards while they are read. Checkpoints use it."""
        self._check_unwritten()
        self._drain()
        self._settle()
        index = {id(p): i for i, p in enumerate(p for g in self.inner.param_groups for p in g["params"])}
        state = self.inner.state
        # (moments stored in bf16 or int8, pz.optim's moments=: as fp32, elementwise like the pieces)
        fp32_state = getattr(self.inner, "fp32_state", None)
        return {"pieces": [(pc.name, pc.start, pc.end) for pc, _, _ in self.pieces],
                "master": [leaf.detach().clone() for _, leaf, _ in self.pieces],
                "state": [fp32_state(leaf) if fp32_state is not None else
                          {k: (v.clone() if torch.is_tensor(v) else v) for k, v in state.get(leaf, {}).items()}
                          for _, leaf, _ in self.pieces],
                "index": [index[id(leaf)] for _, leaf, _ in self.pieces]}

    @torch.no_grad()
    def load_shard_state(self, master: list[torch.Tensor], state: list[dict]) -> None:
        """Set every piece's fp32 values and inner state (lists in ``self.pieces`` order; an empty
        dict: no state, as for a parameter never stepped), then make the model's parameters hold
        the new values. Every rank of the group calls it (stage 1-2 gather the parameters)."""
        if len(master) != len(self.pieces) or len(state) != len(self.pieces):
            raise ValueError(f"master/state: expected {len(self.pieces)} entries each (one per piece), "
                             f"got {len(master)} and {len(state)}")
        for (pc, leaf, _), v in zip(self.pieces, master):
            if v.numel() != pc.numel:
                raise ValueError(f"master: {pc.name}[{pc.start}:{pc.end}] needs {pc.numel} values, got {v.numel()}")
        self._drain()
        self._settle()
        self._before_host_writes()
        group_of = {id(p): g for g in self.inner.param_groups for p in g["params"]}
        for (_, leaf, _), v, st in zip(self.pieces, master, state):
            leaf.copy_(v)
            if st:
                self.inner.state[leaf] = {k: _state_on(leaf, k, t, group_of[id(leaf)]) for k, t in st.items()}
            else:
                self.inner.state.pop(leaf, None)
        self._refresh_low()
        self._publish_parameters()

    def load_state_dict(self, sd: dict) -> None:
        """Restore what state_dict() gave on this rank (the same shard); nothing changes if it fails.
        The hooks of register_load_state_dict_pre_hook / _post_hook run around it, as torch runs them."""
        for hook in list(self._optimizer_load_state_dict_pre_hooks.values()):
            changed = hook(self, sd)
            if changed is not None:
                sd = changed
        self._load_state_dict(sd)
        for hook in list(self._optimizer_load_state_dict_post_hooks.values()):
            hook(self)

    def _load_state_dict(self, sd: dict) -> None:
        # Every rank calls it (the parameters are gathered at the end): each checks its dict against its shard,
        # then the ranks agree before anything changes; a rank whose dict is bad names what is wrong, the
        # others name that rank, and nothing is loaded on any rank.
        error = None
        try:
            self._check_state_dict(sd)
        except (TypeError, ValueError) as e:
            error = e
        loaded = False
        if error is None:
            self._settle()
            self._before_host_writes()
            old = (self.inner.state, self.inner.param_groups)  # (torch's load replaces both, changing neither)
            try:
                self.inner.load_state_dict(sd["inner"])
                loaded = True
            except Exception as e:  # noqa: BLE001 - every rank must learn of it
                self.inner.state, self.inner.param_groups = old
                error = e
        failed = comm.failed_ranks(error, self.group)
        if failed:
            if loaded:
                self.inner.state, self.inner.param_groups = old
            said = None if error is None else comm.error_text(error)
            others = "; ".join(f"group rank {r}: {msg}" for r, msg in failed if r != self.rank and msg != said)
            if error is not None:
                try:
                    said = type(error)(f"{error}{f' (and {others})' if others else ''}; nothing was loaded on any rank")
                except Exception:  # noqa: BLE001 - an exception type that takes other arguments: as it is
                    raise error from None
                raise said from error
            raise ValueError(f"state_dict: rank(s) {[r for r, _ in failed]} of the group got a state_dict that does "
                             f"not fit their shard ({others}); nothing was loaded on any rank")
        with torch.no_grad():
            for (_, leaf, _), t in zip(self.pieces, sd["master"]):
                leaf.copy_(t)
        if self.scaler is not None and "scaler" in sd:
            self.scaler.load_state_dict(sd["scaler"])
        self._refresh_low()
        self._publish_parameters()

    def _check_state_dict(self, sd) -> None:
        """A TypeError or ValueError naming what of `sd` does not fit this rank's shard (state_dict()'s layout)."""
        if not isinstance(sd, dict):
            raise TypeError(f"state_dict: expected the dict of ZeroOptimizer.state_dict(), got {type(sd).__name__}")
        if sd.get("pieces") != [(pc.name, pc.start, pc.end) for pc, _, _ in self.pieces]:
            raise ValueError("state_dict: it was saved for a different shard (rank, world size, stage or model; "
                             "ZeroOptimizer.state_dict() holds one rank's shard, each rank loads its own); use "
                             "pz.checkpoint.load to reshard")
        for key in ("master", "inner"):
            if key not in sd:
                raise ValueError(f"state_dict: it has no {key!r} (expected the dict of ZeroOptimizer.state_dict())")
        master = sd["master"]
        if not isinstance(master, (list, tuple)) or len(master) != len(self.pieces):
            got = f"{len(master)} entries" if isinstance(master, (list, tuple)) else f"a {type(master).__name__}"
            raise ValueError(f"state_dict: 'master' must hold one tensor per piece of this rank's shard "
                             f"({len(self.pieces)}), got {got}")
        for i, ((pc, leaf, _), t) in enumerate(zip(self.pieces, master)):
            if not torch.is_tensor(t) or t.shape != leaf.shape or t.dtype != leaf.dtype:
                got = f"{tuple(t.shape)} {t.dtype}" if torch.is_tensor(t) else type(t).__name__
                raise ValueError(f"state_dict: 'master'[{i}] ({pc.name}[{pc.start}:{pc.end}]) must be a "
                                 f"{tuple(leaf.shape)} {leaf.dtype} tensor, got {got}")
        inner = sd["inner"]
        groups = inner.get("param_groups") if isinstance(inner, dict) else None
        if not (isinstance(groups, list) and isinstance(inner.get("state"), dict)
                and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
            raise ValueError("state_dict: 'inner' must be the inner optimizer's state_dict() ({'state': {...}, "
                             "'param_groups': [{'params': [...], ...}]})")
        mine = self.inner.param_groups
        if len(groups) != len(mine):
            raise ValueError(f"state_dict: 'inner' has {len(groups)} parameter groups, the optimizer has {len(mine)}")
        leaf_of = {}
        for i, (g, m) in enumerate(zip(groups, mine)):
            if len(g["params"]) != len(m["params"]):
                raise ValueError(f"state_dict: 'inner' parameter group {i} holds {len(g['params'])} parameters, "
                                 f"the optimizer's holds {len(m['params'])}")
            leaf_of.update(zip(g["params"], m["params"]))
        for k, st in inner["state"].items():
            if k not in leaf_of or not isinstance(st, dict):
                raise ValueError(f"state_dict: 'inner' state {k!r} is not {{name: value}} of one of its "
                                 "parameter groups' parameters")
            leaf = leaf_of[k]
            for name, v in st.items():  # elementwise state (exp_avg, ...) is laid out like its piece
                if torch.is_tensor(v) and v.dim() >= 1 and v.is_floating_point() and not name.endswith("_absmax") \
                        and v.numel() != leaf.numel():
                    raise ValueError(f"state_dict: 'inner' state {k!r}[{name!r}] has {v.numel()} values, its "
                                     f"piece of the shard {leaf.numel()}")
        scaler = sd.get("scaler")
        if self.scaler is not None and scaler is not None and not (
                isinstance(scaler, dict) and is_positive_finite(scaler.get("scale"))
                and all(is_int(scaler.get(k)) and scaler[k] >= 0 for k in ("good_steps", "skipped"))):
            raise ValueError("state_dict: 'scaler' must be {'scale': a positive number, 'good_steps', 'skipped': "
                             "integers >= 0}")

    @torch.no_grad()
    def full_state_dict(self) -> dict | None:
        """The full model state with fp32 trainable values (the master weights) on the group's
        first rank, None elsewhere; every rank calls it. Gathered one flat buffer at a time."""
        self._check_unwritten()
        self._settle()
        gathered = {}
        first = self.group.rank == 0
        for layout, master, _ in self.shards():
            full = torch.empty(layout.padded, dtype=torch.float32, device=self.device)
            comm.all_gather(full, master.to(self.device), group=self.group)  # (host masters: offload)
            if first:
                for p, v in zip(layout.params, layout.views(full)):
                    gathered[id(p)] = v.clone()
        if not first:
            return None
        # model.state_dict()'s keys and order: tied parameters under every name, frozen ones, buffers.
        return {name: gathered[id(t)] if id(t) in gathered else t.detach().clone()
                for name, t in model_state(self.model).items()}

    def memory_stats(self) -> dict:
        """Bytes of model state this rank holds, in the ZeRO paper's terms: parameters (full or
        shard, model dtype), gradients, optimizer state (inner state plus separate fp32 master
        weights); `total` is their sum. Stage 3 adds `peak_gathered_params`, the most full
        parameters allocated at once during forward/backward. With offload="nvme" the
        optimizer state counted is what is in memory (the swap buffers) and `disk` gives
        the bytes of the swap files. A CUDA model with offload counts device bytes in
        params/grads/optimizer/total and adds `host`: the pinned masters, gradient shards,
        optimizer state in memory, the 16-bit copies of a 16-bit model (and with offload_params
        the parameter shards)."""
        self._settle()
        params = self._held_params()
        grads = self._held_grads()
        on_disk = self.offload.state_bytes(self.inner)  # offload="nvme": (swap buffers, swap files)
        if on_disk is None:
            optim = _nbytes(t for st in self.inner.state.values() for t in st.values() if torch.is_tensor(t))
        else:
            optim = on_disk[0]
        if self._master_is_separate():
            optim += _nbytes(m for _, m, _ in self.shards())
        if self._host:  # the optimizer's side is in host memory (see [Note: offload of a CUDA model])
            counted, extra = {m.data_ptr() for _, m, _ in self.shards()}, []
            delayed = self._delayed.grads if self._delayed is not None else []  # (the job's gradient copies)
            scratch = [self._scratch] if self._scratch is not None else []  # (see [Note: offload pipeline])
            for t in self._shard_grads + delayed + scratch + self._host_low + self._host_param_shards():
                if t.data_ptr() not in counted:  # (offload_params: a 16-bit copy is the shard itself)
                    counted.add(t.data_ptr())
                    extra.append(t)
            host = optim + _nbytes(extra)
            out = {"params": params, "grads": grads, "optimizer": 0, "total": params + grads, "host": host}
        else:
            out = {"params": params, "grads": grads, "optimizer": optim, "total": params + grads + optim}
        if on_disk is not None:
            out["disk"] = on_disk[1]
        return out

    def memory_tensors(self) -> dict[str, list[torch.Tensor]]:
        """The tensors this optimizer holds right now, by what they are (pyzero.memtrace walks
        them): "params" the parameters as this rank keeps them (stages 1-2 the full flat buffer,
        stage 3 the shards), "grads" the gradient segments holding values (stage 1 also the
        parameters' own .grad before they are reduced), "buckets" staging buffers being filled,
        "gathered" stage 3's full units allocated now, "optimizer" the inner optimizer's state
        and the fp32 masters where they are separate (16-bit models, offload). A tensor may
        share storage with one listed before it (an fp32 master in the flat buffer): count
        storages once, in this order."""
        optim = [t for st in self.inner.state.values() for t in st.values() if torch.is_tensor(t)]
        optim += [m for _, m, _ in self.shards()] + list(self._host_low)
        optim += [self._scratch] if self._scratch is not None else []
        grads = [g for k, g in enumerate(self._shard_grads) if self._grad_live[k]]
        grads += [p.grad for p in self.params if p.grad is not None]
        return {"params": self._param_tensors(), "grads": grads, "buckets": self._bucket_tensors(),
                "gathered": self._gathered_tensors(), "optimizer": optim}

    def _param_tensors(self) -> list[torch.Tensor]:
        return [p for p in self.params]

    def _bucket_tensors(self) -> list[torch.Tensor]:
        return []

    def _gathered_tensors(self) -> list[torch.Tensor]:
        return []

    def _master_is_separate(self) -> bool:
        return self._host or (self.param_dtype or self.params[0].dtype) != torch.float32

    def _host_param_shards(self) -> list[torch.Tensor]:
        """Parameter shards kept in host memory (stage 3 with offload_params)."""
        return []

    def _held_params(self) -> int:
        raise NotImplementedError

    def _held_grads(self) -> int:
        """Bytes of gradients on the device (host copies: the shards are in host memory)."""
        return 0 if self._host else _nbytes(self._shard_grads)

    def __repr__(self):
        return (f"ZeroOptimizer(stage={self.stage}, world={self.world}, inner={type(self.inner).__name__}, "
                f"params={sum(p.numel() for p in self.params)})")


class _SideCopies:
    """Copies between host and device on a side stream of their own, each after the work queued
    so far on the current stream (which made the source, or may still read the destination). On
    the CPU (the tests' host-copy path) plain copies. wait(): the host waits until all have
    landed; join(): the current stream does."""

    def __init__(self, device: torch.device):
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        if self.stream is None:
            dst.copy_(src)
            return
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(ready)
            dst.copy_(src, non_blocking=True)  # pinned host side: a DMA the host does not wait for
        for t in (dst, src):
            if t.is_cuda:  # (a stage frees its reduced buffer after the call: not reused before the copy)
                t.record_stream(self.stream)

    def wait(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()

    def join(self) -> None:
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)


class _HostGrads:
    """The fp32 gradient shards of host copies (see [Note: offload of a CUDA model]), fed with
    reduced device slices as they are ready. put() copies a slice to the host (_SideCopies). An
    fp32 slice into a range nothing has written since restart() lands in the shard itself; any
    other goes to a staging buffer, added (or, into a new range, copied) into the shard by
    finish(), in the order the slices came, once the copies have landed. finish() also zeroes
    what nothing wrote (the device path zeroes whole shards at zero_grad; here each backward's
    slices overwrite the shards, so most steps zero nothing)."""

    def __init__(self, device: torch.device, shards: list[torch.Tensor]):
        self.shards = shards
        self._copies = _SideCopies(device)
        self._staged: list[tuple[int, int, int, torch.Tensor, bool]] = []  # (shard, lo, hi, host, add?)
        self._written: list[list[tuple[int, int]]] = [[] for _ in shards]  # ranges with values since restart()

    gate = None  # delayed_update: a threading.Event, open once the shards may be written (offload.DelayedStep)
    widen = None  # 16-bit shards: makes them fp32 (ZeroOptimizer._widen_host_grads, see [Note: offload pipeline])

    def put(self, k: int, lo: int, hi: int, dev: torch.Tensor) -> bool:
        """Queue the slice; True when it lands in the shard itself (else finish() puts it there)."""
        if hi <= lo:
            return False
        if self.gate is not None:
            self.gate.wait()
        new = not any(a < hi and lo < b for a, b in self._written[k])
        if not new and self.shards[k].dtype != torch.float32:  # gradients add up on the host: in fp32
            self._copies.wait()
            self.widen()
        self._written[k].append((lo, hi))
        dtype = self.shards[k].dtype
        if new and dev.dtype != dtype and dtype != torch.float32:
            # (16-bit shards hold the reduced values exactly, see [Note: offload pipeline]): narrowed
            # on the device, half the bytes to copy
            dev = dev.to(dtype)
        if new and dev.dtype == dtype:
            self._copies.copy(self.shards[k][lo:hi], dev)
            return True
        host = torch.empty(hi - lo, dtype=dev.dtype, pin_memory=self._copies.stream is not None)
        self._copies.copy(host, dev)
        self._staged.append((k, lo, hi, host, not new))
        return False

    def landed(self):
        """A CUDA event after the copies queued so far (None on the CPU, where they are done)."""
        if self._copies.stream is None:
            return None
        ev = torch.cuda.Event()
        ev.record(self._copies.stream)
        return ev

    def finish(self) -> None:
        """Every slice put so far is in the shards; ranges nothing wrote are zero."""
        if self.gate is not None:
            self.gate.wait()
        self._copies.wait()
        for k, lo, hi, host, add in self._staged:
            if add:
                self.shards[k][lo:hi].add_(host)
            else:
                self.shards[k][lo:hi].copy_(host)
        self._staged.clear()
        for k, shard in enumerate(self.shards):
            at = 0
            for lo, hi in sorted(self._written[k]):
                if lo > at:
                    shard[at:lo].zero_()
                at = max(at, hi)
            if at < shard.numel():
                shard[at:].zero_()
            self._written[k] = [(0, shard.numel())]  # all defined: later slices add

    def restart(self) -> None:
        """Forget the slices so far (the next ones are new values); no copy is still landing."""
        self._copies.wait()
        self._staged.clear()
        self._written = [[] for _ in self.shards]


_SCALED_STEP = (pz_optim.Adam, pz_optim.SGD, pz_optim.Adagrad)  # step(grad_scale=) in the kernel's pass
_STEP_CHUNK_ELEMS = 1 << 26  # a chunk of the host step that sends its values on (see [Note: chunked host step])


def _called_by_grad_scaler() -> bool:
    """Whether param_groups is read by an enabled torch.amp.GradScaler to unscale the gradients and check them
    (its _unscale_grads_, from unscale_ or step), a few frames up. A disabled one (enabled=False) reads none:
    its step(opt) is opt.step(), whose hooks or LR scheduler may read param_groups."""
    f = sys._getframe(2)
    for _ in range(4):
        if f is None:
            return False
        if f.f_code.co_name == "_unscale_grads_" and f.f_globals.get("__name__") == "torch.amp.grad_scaler":
            return True
        f = f.f_back
    return False


def _host_copies(device: torch.device) -> bool:
    """Whether offload keeps the optimizer's side in separate host buffers: for a CUDA model
    (see [Note: offload of a CUDA model]). The tests also turn it on for CPU models, to run
    that path where there is no GPU."""
    return device.type == "cuda"


live_optimizers: weakref.WeakSet = weakref.WeakSet()  # every ZeroOptimizer built and not yet collected


def _owner_of(p):
    """The live ZeroOptimizer that manages parameter `p` itself (not a copy of it), or None."""
    ref = getattr(p, "_pz_zero_owner", None)
    opt = ref() if ref is not None else None
    return opt if opt is not None and id(p) in opt._param_index else None


def leaf_owner(t) -> ZeroOptimizer | None:
    """The live ZeroOptimizer whose inner optimizer steps tensor `t` (one of ``opt.param_groups``'
    parameters: a piece of a model parameter in this rank's shard), else None."""
    ref = getattr(t, "_pz_zero_leaf_of", None)
    opt = ref() if ref is not None else None
    return opt if opt is not None and id(t) in opt._leaf_ids else None


def owner(obj) -> ZeroOptimizer | None:
    """The live ZeroOptimizer managing `obj`: a parameter, or a module whose trainable parameters
    it manages (judged by the first one), else None. Integrations use it to tell whose gradients
    a model's are."""
    if isinstance(obj, nn.Module):
        obj = next((p for p in obj.parameters() if p.requires_grad), None)
    return None if obj is None else _owner_of(obj)


def gathered_parameters(params, modifier_rank=None):
    """``opt.gathered_parameters(params, modifier_rank)`` of the ZeroOptimizer that trains `params` (a
    parameter or several), found from them; parameters no ZeroOptimizer trains are whole already: then
    nothing is done (as DeepSpeed's zero.GatheredParameters). Parameters of two optimizers: a ValueError."""
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    owners = {id(o): o for o in map(_owner_of, items) if o is not None}
    if len(owners) > 1:
        raise ValueError("params: parameters of more than one ZeroOptimizer; gather each optimizer's in its own block")
    if not owners:
        return contextlib.nullcontext()
    return next(iter(owners.values())).gathered_parameters(items, modifier_rank)


def _probe_optimizer(optimizer_class, kwargs, param_groups):
    """Build the inner optimizer once on a dummy tensor, so bad kwargs fail before the model is touched; returns it
    (its param_groups: the settings each group steps with, defaults filled in)."""
    groups = [dict(g, params=[nn.Parameter(torch.zeros(1))]) for g in (param_groups or [{}])]
    try:
        return optimizer_class(groups, **kwargs)
    except (TypeError, ValueError) as e:
        raise type(e)(f"optimizer_kwargs/param_groups: {optimizer_class.__name__} rejected them: {e}") from e


def _state_on(leaf, key, value, group):
    """An optimizer state value for `leaf` (a checkpoint's may come from another device), placed as
    torch's Optimizer.load_state_dict places it: on the leaf's device in its dtype, except a CPU
    `step`, which stays where it is unless the group is fused or capturable."""
    if not torch.is_tensor(value):
        return value
    if key == "step":
        if group.get("fused") or group.get("capturable"):
            return value.to(dtype=torch.float32, device=leaf.device)
        return value
    if value.is_floating_point():
        return value.to(dtype=leaf.dtype, device=leaf.device)
    return value.to(device=leaf.device)


def _nbytes(tensors) -> int:
    """Bytes of distinct storage behind `tensors` (views of one buffer count once)."""
    seen, total = set(), 0
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen:
            seen.add(st.data_ptr())
            total += st.nbytes()
    return total
