"""``module.zero_grad()`` on the model a ZeroOptimizer trains.

torch's ``nn.Module.zero_grad`` clears each parameter's ``.grad``. A ZeroOptimizer keeps the
reduced gradients in its own shards (stages 2 and 3 leave ``.grad`` None), so torch's method would
leave them in place: a backward, then ``model.zero_grad()`` (to drop a gradient not meant to be
stepped), then another backward would step the sum of both. ``import pyzero`` puts a version of
the method in ``nn.Module``'s place that, on a module holding all of a ZeroOptimizer's trainable
parameters (its model, or a module around it), also calls that optimizer's ``zero_grad`` with the
same ``set_to_none``; a module holding only some of them raises (the shards are cut across
parameters: a part of them cannot be cleared alone). Modules without a ZeroOptimizer's parameters,
and every call while no ZeroOptimizer exists, are torch's method alone. Inside torch.compile, while a
ZeroOptimizer exists, the method runs at a graph break (a graph cannot reach the shards).
"""
from __future__ import annotations

import torch
from torch import nn

from .optimizer import live_optimizers, owner

# torch's own (a second import of this module, as importlib.reload makes, finds this wrapper in its place)
_torch_zero_grad = getattr(nn.Module.zero_grad, "_pz_torch", nn.Module.zero_grad)


def zero_grad(self: nn.Module, set_to_none: bool = True) -> None:
    if live_optimizers and torch.compiler.is_compiling():  # (the shards are out of a graph's reach)
        return _zero_grad_at_graph_break(self, set_to_none)
    if live_optimizers:
        params = [p for p in self.parameters() if p.requires_grad]
        zeros = {}
        for p in params:
            opt = owner(p)
            if opt is not None:
                zeros.setdefault(id(opt), (opt, set()))[1].add(id(p))
        for opt, held in zeros.values():
            if held != {id(p) for p in opt.params}:
                raise ValueError(f"zero_grad: this {type(self).__name__} holds {len(held)} of the {len(opt.params)} "
                                 "parameters a ZeroOptimizer trains, whose gradients it keeps in shards cut across "
                                 "parameters; call zero_grad() on the model the ZeroOptimizer manages, or "
                                 "opt.zero_grad()")
        for opt, _ in zeros.values():
            opt.zero_grad(set_to_none)
    return _torch_zero_grad(self, set_to_none)


_zero_grad_at_graph_break = torch.compiler.disable(zero_grad, recursive=True)
zero_grad.__doc__ = _torch_zero_grad.__doc__
zero_grad._pz_torch = _torch_zero_grad


def install() -> None:
    """Put this in nn.Module's place (import pyzero does)."""
    nn.Module.zero_grad = zero_grad
