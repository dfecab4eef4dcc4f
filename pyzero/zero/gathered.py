"""A ZeroOptimizer's parameters whole on every rank for the length of a block, and what the block changes kept.

``with opt.gathered_parameters(params, modifier_rank=None):`` (or ``pz.zero.gathered_parameters``, which
finds the optimizer) is DeepSpeed's ``zero.GatheredParameters`` and FSDP's ``summon_full_params``: for an
EMA of the weights, a custom initialisation after the optimizer was built, logging a weight's norm, an
evaluation that reads weights outside forward. Stage 3 gathers the parameters' units (freed again at the
end); in stages 1-2 they are whole anyway. Every rank of the optimizer's group enters the block with the
same parameters (checked: a ValueError on every rank).

What the block writes into them is kept: with ``modifier_rank=r`` every rank takes rank r's values at the
end (a broadcast); without, every rank must make the same change (or none): the values are compared
across the ranks (two float64 sums), and ranks that differ get a RuntimeError on every rank (each
rank's shard then holds that rank's values). A change reaches the fp32 master weights element by
element: an element the block did not change keeps its master value (a bf16 model read in the block
loses no fp32 precision).

Nothing in the block may keep a gathered parameter for backward (stage 3 frees it at the end, and
backward would read memory that is gone): run the block under ``torch.no_grad()``; an operation that
saves one raises at once. Inside a forward, a module that reads another module's parameters needs
``leaf_modules`` instead.
"""
from __future__ import annotations

import contextlib
import zlib

import torch

from .. import comm


def _check_params(opt, params) -> tuple[list, list]:
    """(trainable, frozen): the model parameters named, each once; a ValueError for anything else."""
    if params is None:
        return list(opt.params), []
    items = [params] if isinstance(params, torch.Tensor) else list(params)
    model_params = {id(p): p for p in opt.model.parameters()}
    trainable, frozen, seen = [], [], set()
    for i, p in enumerate(items):
        if not isinstance(p, torch.Tensor) or id(p) not in model_params:
            raise ValueError(f"params: item {i} ({type(p).__name__}) is not a parameter of the model this "
                             "ZeroOptimizer manages")
        if id(p) not in seen:
            seen.add(id(p))
            (trainable if id(p) in opt._param_index else frozen).append(p)
    return trainable, frozen


def _signature(opt, trainable, frozen) -> int:
    index = {id(p): i for i, p in enumerate(opt.model.parameters())}
    return zlib.crc32(repr(sorted(index[id(p)] for p in trainable + frozen)).encode())


def _sums(tensors) -> list[float]:
    """Two float64 sums of every element (its value and its square), in chunks (no float64 copy of it all)."""
    s1 = s2 = None
    for t in tensors:
        for c in t.detach().reshape(-1).split(1 << 22):
            c = c.double()
            a, b = c.sum(), c.square().sum()
            s1, s2 = (a, b) if s1 is None else (s1 + a, s2 + b)
    return [0.0, 0.0] if s1 is None else torch.stack([s1, s2]).tolist()


def _refuse_saves(storages: set[int]):
    def pack(t):
        try:
            ptr = t.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # (a tensor without storage: not a parameter)
            return t
        if ptr in storages:
            raise RuntimeError("opt.gathered_parameters(): an operation inside the block saved a gathered parameter "
                               "for backward, which would read it after the block frees it; run the block under "
                               "torch.no_grad() (inside a forward, a module reading another module's parameters "
                               "needs leaf_modules=[its class] instead)")
        return t
    return torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t)


@contextlib.contextmanager
def gather_block(opt, params=None, modifier_rank=None):
    """See opt.gathered_parameters() and this module's docstring."""
    trainable, frozen = _check_params(opt, params)
    ranks = list(opt.group.ranks)
    if modifier_rank is not None and (isinstance(modifier_rank, bool) or not isinstance(modifier_rank, int)
                                      or modifier_rank not in ranks):
        raise ValueError(f"modifier_rank: expected None or the global rank of one of the optimizer group's ranks "
                         f"{ranks}, got {modifier_rank!r}")
    mine = [_signature(opt, trainable, frozen), -1 if modifier_rank is None else modifier_rank]
    every = comm.every_rank(mine, torch.float64, opt.group)
    if not (every == every[0]).all():
        raise ValueError("opt.gathered_parameters(): the ranks of the group entered it with different params or "
                         f"modifier_rank (every rank enters it with the same ones); this rank: {len(trainable)} "
                         f"trainable, {len(frozen)} frozen parameters, modifier_rank={modifier_rank}")
    opt.synchronize()  # (delayed_update: the model holds the last step's values)
    held = opt._hold(trainable)
    try:
        own = opt._own_slices(held)  # [(index into opt.shards(), this rank's part of the values in model dtype)]
        before = [cur.clone() for _, cur in own]
        synced = opt._synced_values(held, trainable) + [p.data for p in frozen]
        with _refuse_saves({t.untyped_storage().data_ptr() for t in synced}):
            yield
        _finish(opt, own, before, synced, modifier_rank)
    finally:
        opt._release(held)


@torch.no_grad()
def _finish(opt, own, before, synced, modifier_rank):
    if modifier_rank is not None:
        for t in synced:
            comm.broadcast(t, src=modifier_rank, group=opt.group)
    changed = [cur != old for (_, cur), old in zip(own, before)]
    any_changed = torch.stack([c.any() for c in changed]).tolist() if changed else []  # (one device sync)
    sums = _sums(synced) if modifier_rank is None and opt.world > 1 else [0.0, 0.0]
    every = comm.every_rank([float(any(any_changed))] + sums, torch.float64, opt.group)
    if every[:, 0].any():
        opt._settle()
        opt._before_host_writes()
        shards = opt.shards()
        for (k, cur), chg, some in zip(own, changed, any_changed):
            if some:
                master = shards[k][1]
                master.copy_(torch.where(chg, cur.to(torch.float32), master.to(cur.device)))
        opt._refresh_low()
        opt._publish_parameters()
    s = every[:, 1:]
    if not torch.allclose(s, s[0].expand_as(s), rtol=1e-12, atol=0.0, equal_nan=True):
        raise RuntimeError("opt.gathered_parameters(): the ranks changed the parameters differently inside the block "
                           "and no modifier_rank was given; each rank's shard now holds that rank's values. Pass "
                           "modifier_rank=r to give every rank rank r's values (e.g. an initialisation drawn "
                           "from each rank's own random state)")
