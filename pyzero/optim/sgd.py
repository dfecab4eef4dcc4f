"""``pz.optim.SGD``: torch.optim.SGD (momentum, dampening, nesterov, weight decay)
on the fused CPU step; same param groups and state layout (``momentum_buffer``).
Extras as in :mod:`pyzero.optim.adam`: ``threads``, ``isa``, and ``grad_scale`` /
``copies`` in :meth:`step`.
"""
from __future__ import annotations

import torch

from . import functional as F


class SGD(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-3, momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, *,
                 maximize=False, foreach=None, differentiable=False, fused=None, threads: int | None = None,
                 isa: str = "best"):
        F.check_torch_only_kwargs("pz.optim.SGD", foreach, fused, differentiable=differentiable)
        if F.as_float(lr, "lr") < 0.0:
            raise ValueError(f"lr: expected >= 0, got {lr}")
        if momentum < 0.0:
            raise ValueError(f"momentum: expected >= 0, got {momentum}")
        if weight_decay < 0.0:
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov: needs momentum > 0 and dampening = 0")
        F._threads(threads)
        F._isa_code(isa)
        self.threads, self.isa = threads, isa
        defaults = dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                        nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=False, fused=fused)
        super().__init__(params, defaults)

    def __setstate__(self, state):  # also load_state_dict's way in: the states are new tensors
        super().__setstate__(state)
        F.forget_checked(self)
        for group in self.param_groups:
            group.setdefault("nesterov", False)
            group.setdefault("maximize", False)

    @F.hooked_step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, copies: dict | None = None):
        """One step of every parameter with a gradient; returns ``closure()``'s loss if given."""
        loss = F.run_closure(closure)
        F.check_groups(self, copies)
        for group in self.param_groups:
            ps = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in ps):
                raise RuntimeError("SGD: sparse gradients are not supported by the fused CPU step")
            momentum = group["momentum"]
            # Parameters whose buffer does not exist yet start it from the gradient (torch's rule).
            is_fresh = [momentum != 0 and self.state[p].get("momentum_buffer") is None for p in ps]
            fresh = [p for p, f in zip(ps, is_fresh) if f]
            lists = [(first, sub) for first, sub in ((True, fresh), (False, [p for p, f in zip(ps, is_fresh) if not f]))
                     if sub]
            if len(lists) > 1:  # two kernels: both checked before the first runs
                F.check_lists([(sub, [p.grad for p in sub]) for _, sub in lists], copies)
            for first, sub in lists:
                # (a refused first step drops the buffers it made: a retry starts them from the gradient again)
                with F.UndoStep(self, [], sub if first else []):
                    bufs = None
                    if momentum != 0:
                        if first:
                            for p in sub:
                                self.state[p]["momentum_buffer"] = torch.empty_like(p)
                        bufs = [self.state[p]["momentum_buffer"] for p in sub]
                    F.sgd_step(sub, [p.grad for p in sub], bufs, [copies.get(p) for p in sub] if copies else None,
                               lr=F.as_float(group["lr"], "lr"), momentum=momentum, dampening=group["dampening"],
                               weight_decay=group["weight_decay"], nesterov=group["nesterov"],
                               maximize=group["maximize"], first_step=first, grad_scale=float(grad_scale),
                               threads=self.threads, isa=self.isa,
                               checked=None if first else F.checked_for(self, group))
        return loss
