"""Refusing a second data-parallel layer around a model that pyzero already reduces.

pz.ZeroOptimizer and pz.DataParallel reduce the gradients themselves. If torch's
DistributedDataParallel also wraps the model (transformers.Trainer, accelerate's
``Accelerator.prepare`` and Lightning's DDPStrategy do in every distributed job), each gradient is reduced twice; with ZeRO,
code that clips ``model.parameters()`` also finds none of the gradients (they were moved into the
shards), so clipping does nothing and the logged norm is 0. At world size 1 accelerate does not
wrap, but its clipping misses the shards all the same. Both are caught at the first forward,
before any gradient is touched, by two attribute reads per forward; the error names what to use
instead. pyzero's own integrations mark the models they prepared (``INTEGRATED``).
"""
from __future__ import annotations

import weakref

from torch import nn

INTEGRATED = "pyzero_integration"  # set on a module by a pyzero integration that prepared it ("hf", "lightning")

USE_INSTEAD = ("with transformers.Trainer use pyzero.integrations.hf.PyzeroTrainer, with accelerate "
               "pyzero.integrations.hf.PyzeroAccelerator, with lightning.Trainer "
               "pyzero.integrations.lightning.PyzeroStrategy")

try:
    from torch.nn.parallel import DistributedDataParallel as _DDP
    from torch.distributed import ProcessGroup as _TorchGroup
    from torch.distributed import is_initialized as _torch_distributed_started
except ImportError:  # a torch build without torch.distributed has no DDP to run inside
    _DDP = _TorchGroup = None

    def _torch_distributed_started() -> bool:
        return False


def refuse_ddp(what: str, sharded: bool = False) -> None:
    """Raise if the caller's forward runs inside torch DDP's forward (which marks itself active); `sharded`:
    the caller keeps the gradients in shards (ZeRO), which clipping model.parameters() misses."""
    if _DDP is not None and _DDP._get_active_ddp_module() is not None:
        clip = (", and clipping model.parameters() there misses the gradients ZeRO keeps in its shards"
                if sharded else "")
        raise RuntimeError(f"{what}: this model runs inside torch DistributedDataParallel, which reduces every "
                           f"gradient a second time (pyzero already reduces them){clip}; {USE_INSTEAD}; elsewhere, "
                           "do not wrap the model in DistributedDataParallel")


def refuse_accelerate(module, what: str) -> None:
    """Raise if accelerate prepared `module` without a pyzero integration (its clipping and
    checkpoints would see neither ZeRO's gradient shards nor the other ranks' state)."""
    if getattr(module, "_is_accelerate_prepared", False) and getattr(module, INTEGRATED, None) is None:
        raise RuntimeError(f"{what}: accelerate prepared this model without pyzero's integration: its gradient "
                           "clipping (accelerator.clip_grad_norm_(model.parameters()), which transformers.Trainer "
                           "calls) does not see the gradients ZeRO keeps in its shards, so it reports a norm of 0 "
                           f"and clips nothing, and its checkpoints hold one rank's shard; {USE_INSTEAD}")


# Parameters, buffers and submodules registered in this process since pyzero first asked (torch's global
# registration hooks count them): a wrapper walks its model again (parameters it does not know, its buffers,
# nn.SyncBatchNorm layers) only after one was registered somewhere, not at every training forward.
_registrations = [0]


def registrations() -> int:
    """How many parameters, buffers and submodules have been registered on any module in this process
    (counted from the first call, which installs torch's global registration hooks): a changed count says a
    model may have changed (a layer added or replaced, a buffer registered or assigned,
    nn.SyncBatchNorm.convert_sync_batchnorm)."""
    if not _registrations[0]:
        from torch.nn.modules import module as torch_module  # noqa: PLC0415

        def count(*args):
            _registrations[0] += 1
        torch_module.register_module_parameter_registration_hook(count)
        torch_module.register_module_buffer_registration_hook(count)
        torch_module.register_module_module_registration_hook(count)
        _registrations[0] = 1
    return _registrations[0]


def sync_batchnorms(module) -> list[tuple[str, nn.Module]]:
    """(name, layer) of `module`'s nn.SyncBatchNorm layers."""
    return [(name or "(the model)", m) for name, m in module.named_modules() if isinstance(m, nn.SyncBatchNorm)]


def refuse_unsynced_batchnorm(layers, what: str, world: int) -> None:
    """Raise if a training forward would run an nn.SyncBatchNorm of `layers` ((name, layer) pairs) at world
    size > 1 that cannot sync: torch's layer syncs over torch.distributed only, so with a process_group that is
    no torch.distributed ProcessGroup (a pyzero group), or without torch.distributed started (whatever its
    process_group), it silently normalises by this rank's batch alone."""
    if not layers or world <= 1:
        return
    for name, m in layers:
        group = m.process_group
        if group is not None and (_TorchGroup is None or not isinstance(group, _TorchGroup)):
            raise RuntimeError(f"{what}: {name!r} is an nn.SyncBatchNorm whose process_group is a "
                               f"{type(group).__module__}.{type(group).__name__}, not a torch.distributed "
                               "ProcessGroup: torch's layer syncs its batch statistics over torch.distributed "
                               "only, so it would normalise by this rank's batch alone, as nn.BatchNorm does. "
                               "Convert it with process_group=None (torch.distributed's default group, started "
                               "beside pyzero with pyzero.distributed.init_torch()) or a torch.distributed group, "
                               "or use nn.BatchNorm for each rank's own statistics")
    if not _torch_distributed_started():
        raise RuntimeError(f"{what}: {layers[0][0]!r} is an nn.SyncBatchNorm, which syncs its batch statistics "
                           "over torch.distributed, not started in this job: it would normalise by this rank's "
                           "batch alone, as nn.BatchNorm does. Start torch.distributed beside pyzero with "
                           "pyzero.distributed.init_torch() after pz.init() (torch's SyncBatchNorm takes CUDA "
                           "tensors only), or use nn.BatchNorm for each rank's own statistics")


class SyncBatchNorms:
    """A model's nn.SyncBatchNorm layers, for refuse_unsynced_batchnorm at each training forward: found again
    only when the model is another one or a module or parameter was registered since (converting to
    nn.SyncBatchNorm after wrapping registers the layers it makes), so a forward walks no module tree."""

    def __init__(self):
        self._key = None
        self._layers: list[tuple[str, nn.Module]] = []

    def refuse_unsynced(self, module, what: str, world: int) -> None:
        if world <= 1:
            return
        key = (id(module), registrations())
        if key != self._key:
            self._layers, self._key = sync_batchnorms(module), key
        refuse_unsynced_batchnorm(self._layers, what, world)


def holds_ddp(module: nn.Module) -> str | None:
    """The name of a torch DistributedDataParallel in `module` ("" for the module itself), or None."""
    if _DDP is None:
        return None
    return next((n for n, m in module.named_modules() if isinstance(m, _DDP)), None)


def _no_owner():
    return None


class WeakOwner:
    """An attribute pyzero sets on a tensor: the object managing it, held weakly; a pickled or deep copy of
    the tensor (torch.save of the model) keeps none."""

    def __init__(self, obj):
        self.ref = weakref.ref(obj)

    def __call__(self):
        return self.ref()

    def __reduce__(self):
        return _no_owner, ()


def refuse_group_across_tp_shards(named, group, what: str) -> None:
    """Raise if data parallelism over `group` would mix tensor-parallel shards: a parameter of `named`
    ((name, parameter) pairs) that is one TP rank's part of a weight (pz.tp's layers mark it with its
    TP group's global ranks, ``tp_ranks``) while `group` holds two ranks of that TP group, whose parts
    differ (the wrap-time broadcast would copy one rank's part over the others', the gradients of
    different parts averaged)."""
    for name, p in named:
        tp = getattr(p, "tp_ranks", ())
        both = sorted(set(tp) & set(group.ranks))
        if len(both) > 1:
            raise ValueError(f"{what}: parameter {name!r} is a tensor-parallel shard of the group of ranks "
                             f"{list(tp)}, and the data-parallel group {list(group.ranks)} holds ranks {both} "
                             "of it, whose shards differ; pass the data-parallel group of the mesh "
                             "(dp, tp = pz.mesh(dp=..., tp=...); group=dp)")
