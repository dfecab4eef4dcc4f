"""torch.nn.utils.clip_grad_norm_ and clip_grad_value_ on the parameters a ZeroOptimizer trains.

After backward a ZeroOptimizer's gradients are in its buckets and shards, not in ``p.grad`` (None in
stages 2 and 3; in stage 1 this rank's own, unreduced): torch's functions would clip nothing there,
or clip each rank's part by its own norm before the average. FSDP2's sharded gradients make torch's
``clip_grad_norm_`` clip the whole model; so does pyzero's version of it, which ``import pyzero``
puts in torch's place: parameters a ZeroOptimizer trains go to its ``clip_grad_norm_`` (the global
norm over every rank's shard, torch's arithmetic), every other call to torch's unchanged. Inside
torch.compile these run at a graph break while a ZeroOptimizer exists (its shards are out of a graph's
reach), else torch's are traced. ``clip_grad_value_`` on them raises: an average
of clipped parts is not the clipped average. torch's ``clip_grads_with_norm_``, which torch's own
``clip_grad_norm_`` calls last, refuses them too: a script that bound torch's ``clip_grad_norm_``
before ``import pyzero`` (``from torch.nn.utils import clip_grad_norm_``) gets an error, not a
clipping of nothing.
"""
from __future__ import annotations

import functools

import torch

from .optimizer import ZeroOptimizer, leaf_owner, live_optimizers, owner


def _any_owner(t) -> ZeroOptimizer | None:
    return owner(t) or leaf_owner(t)


def _any_zero(params: list) -> bool:
    """Whether a ZeroOptimizer trains any of `params` (or they are pieces of its shard)."""
    return any(_any_owner(p) is not None for p in params)


def zero_of_params(params: list, what: str) -> ZeroOptimizer | None:
    """The ZeroOptimizer managing `params` (all of its trainable parameters, or all of its inner
    optimizer's, the tensors of ``opt.param_groups``: this rank's pieces), or None if it manages none;
    a ValueError naming `what` for a part of them or tensors of two."""
    owners = {id(o): o for o in map(_any_owner, params) if o is not None}
    if not owners:
        return None
    opt = next(iter(owners.values()))
    model_params = {id(p) for p in params if p.requires_grad}
    if len(owners) > 1 or (model_params != {id(p) for p in opt.params} and {id(p) for p in params} != opt._leaf_ids):
        raise ValueError(f"{what}: parameters: a ZeroOptimizer clips all of its model's gradients at once (their "
                         "norm spans every rank's shard); pass model.parameters() of the model it manages")
    return opt


def refuse_clip_by_value(params: list, what: str) -> None:
    """A ValueError naming `what` if a ZeroOptimizer trains any of `params` (or they are its pieces)."""
    if _any_zero(params):
        raise ValueError(f"{what}: a ZeroOptimizer averages the gradients over the ranks into its shards (stage 1 at "
                         "its step, from the local .grad this would clip; stages 2 and 3 in backward, leaving no "
                         ".grad), out of reach of clipping each .grad by value; clip by norm with clip_grad_norm_, "
                         "which spans every rank's shard")


def _as_list(parameters) -> list:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


# torch's own (a second import of this module, as importlib.reload makes, finds these wrappers in their place)
_torch_clip_grad_norm_ = getattr(torch.nn.utils.clip_grad.clip_grad_norm_, "_pz_torch",
                                 torch.nn.utils.clip_grad.clip_grad_norm_)
_torch_clip_grad_value_ = getattr(torch.nn.utils.clip_grad.clip_grad_value_, "_pz_torch",
                                  torch.nn.utils.clip_grad.clip_grad_value_)


@functools.wraps(_torch_clip_grad_norm_, assigned=("__name__", "__qualname__", "__doc__"))
def clip_grad_norm_(parameters, max_norm, norm_type=2.0, error_if_nonfinite=False, foreach=None, **kwargs):
    if torch.compiler.is_compiling():
        if live_optimizers:  # (torch's in a graph would clip p.grad: stage 1's local part, stages 2-3's None)
            return _clip_grad_norm_at_graph_break(parameters, max_norm, norm_type, error_if_nonfinite, foreach,
                                                  **kwargs)
        return _torch_clip_grad_norm_(parameters, max_norm, norm_type, error_if_nonfinite, foreach, **kwargs)
    params = _as_list(parameters)
    zero = zero_of_params(params, "torch.nn.utils.clip_grad_norm_")
    if zero is None:
        return _torch_clip_grad_norm_(params, max_norm, norm_type, error_if_nonfinite, foreach, **kwargs)
    if kwargs:  # (arguments a later torch may add: not guessed at)
        raise TypeError(f"torch.nn.utils.clip_grad_norm_: {sorted(kwargs)} are not taken for a ZeroOptimizer's "
                        "parameters (it clips them with opt.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite))")
    return zero.clip_grad_norm_(max_norm, norm_type, error_if_nonfinite=error_if_nonfinite)


@functools.wraps(_torch_clip_grad_value_, assigned=("__name__", "__qualname__", "__doc__"))
def clip_grad_value_(parameters, clip_value, foreach=None, **kwargs):
    if torch.compiler.is_compiling():
        if live_optimizers:
            return _clip_grad_value_at_graph_break(parameters, clip_value, foreach, **kwargs)
        return _torch_clip_grad_value_(parameters, clip_value, foreach, **kwargs)
    params = _as_list(parameters)
    refuse_clip_by_value(params, "torch.nn.utils.clip_grad_value_")
    return _torch_clip_grad_value_(params, clip_value, foreach, **kwargs)


# (torch.nn.utils.clip_grads_with_norm_, since torch 2.6; torch's clip_grad_norm_ looks it up in its module)
_torch_clip_grads_with_norm_ = getattr(torch.nn.utils.clip_grad, "_clip_grads_with_norm_", None)
_torch_clip_grads_with_norm_ = getattr(_torch_clip_grads_with_norm_, "_pz_torch", _torch_clip_grads_with_norm_)


def clip_grads_with_norm_(parameters, max_norm, total_norm, foreach=None, **kwargs):
    if torch.compiler.is_compiling():
        if live_optimizers:
            return _clip_grads_with_norm_at_graph_break(parameters, max_norm, total_norm, foreach, **kwargs)
        return _torch_clip_grads_with_norm_(parameters, max_norm, total_norm, foreach, **kwargs)
    params = _as_list(parameters)
    if _any_zero(params):
        raise RuntimeError("torch.nn.utils.clip_grads_with_norm_ (which torch's clip_grad_norm_ calls) got the "
                           "parameters a ZeroOptimizer trains: their gradients are in its shards, where torch's "
                           "clipping computes no norm and clips nothing (stages 2-3) or clips each rank's part alone "
                           "(stage 1); call opt.clip_grad_norm_(max_norm), or torch.nn.utils.clip_grad_norm_ looked up "
                           "after `import pyzero` (a `from torch.nn.utils import clip_grad_norm_` that runs before it "
                           "keeps torch's own)")
    return _torch_clip_grads_with_norm_(params, max_norm, total_norm, foreach, **kwargs)


if _torch_clip_grads_with_norm_ is not None:
    functools.update_wrapper(clip_grads_with_norm_, _torch_clip_grads_with_norm_,
                             assigned=("__name__", "__qualname__", "__doc__"))
    clip_grads_with_norm_._pz_torch = _torch_clip_grads_with_norm_
clip_grad_norm_._pz_torch = _torch_clip_grad_norm_
# Each run eagerly from a compiled region (a graph break), where is_compiling() is False (as module_grads.zero_grad).
_clip_grad_norm_at_graph_break = torch.compiler.disable(clip_grad_norm_, recursive=True)
_clip_grad_value_at_graph_break = torch.compiler.disable(clip_grad_value_, recursive=True)
_clip_grads_with_norm_at_graph_break = torch.compiler.disable(clip_grads_with_norm_, recursive=True)
clip_grad_value_._pz_torch = _torch_clip_grad_value_


def install() -> None:
    """Put these in torch.nn.utils' place (import pyzero does)."""
    for mod in (torch.nn.utils, torch.nn.utils.clip_grad):
        mod.clip_grad_norm_ = clip_grad_norm_
        mod.clip_grad_value_ = clip_grad_value_
    if _torch_clip_grads_with_norm_ is not None:
        torch.nn.utils.clip_grads_with_norm_ = clip_grads_with_norm_
        torch.nn.utils.clip_grad._clip_grads_with_norm_ = clip_grads_with_norm_
