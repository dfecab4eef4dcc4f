"""``pz.optim.Adagrad``: torch.optim.Adagrad (lr_decay, weight decay, initial accumulator,
maximize) on the fused CPU step; same param groups and state layout (``step``, ``sum``,
created at construction as torch does). Extras as in :mod:`pyzero.optim.adam`."""
from __future__ import annotations

import torch

from . import functional as F


class Adagrad(torch.optim.Optimizer):
    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 foreach=None, *, maximize=False, differentiable=False, fused=None, threads: int | None = None,
                 isa: str = "best"):
        for arg, v in (("lr", F.as_float(lr, "lr")), ("lr_decay", lr_decay), ("weight_decay", weight_decay),
                       ("initial_accumulator_value", initial_accumulator_value), ("eps", eps)):
            if not v >= 0.0:  # (NaN too)
                raise ValueError(f"{arg}: expected >= 0, got {v}")
        F.check_torch_only_kwargs("pz.optim.Adagrad", foreach, fused, differentiable=differentiable)
        F._threads(threads)
        F._isa_code(isa)
        self.threads, self.isa = threads, isa
        defaults = dict(lr=lr, lr_decay=lr_decay, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value, foreach=foreach, maximize=maximize,
                        differentiable=False, fused=fused)
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                self._init_state(p)

    def _init_state(self, p) -> None:
        """A parameter's fresh state, as torch's Adagrad makes it: the sum starts at the constructor's
        initial_accumulator_value (torch takes no group's own), in __init__ and for a parameter whose
        state a loaded state dict left out."""
        state = self.state[p]
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["sum"] = torch.full_like(p, self.defaults["initial_accumulator_value"],
                                       memory_format=torch.preserve_format)

    def __setstate__(self, state):  # also load_state_dict's way in: the states are new tensors
        super().__setstate__(state)
        F.forget_checked(self)

    @F.hooked_step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, copies: dict | None = None):
        """One step of every parameter with a gradient; returns ``closure()``'s loss if given."""
        loss = F.run_closure(closure)
        F.check_groups(self, copies)
        for group in self.param_groups:
            by_step: dict[float, list] = {}
            ps = [p for p in group["params"] if p.grad is not None]
            if any(p.grad.is_sparse for p in ps):
                raise RuntimeError("pz.optim.Adagrad does not support sparse gradients")
            if not ps:
                continue
            fresh = [p for p in ps if "sum" not in self.state[p]]
            states = [self.state[p] for p in ps]
            with F.UndoStep(self, states, fresh) as undo:
                for p in fresh:  # (a state dict without this parameter's state was loaded)
                    self._init_state(p)
                for p, step in zip(ps, F.bump_steps(self, group, states)):
                    by_step.setdefault(step, []).append(p)
                undo.bumped = True
                if len(by_step) == 1:  # the usual case: its kernel's own checks come first
                    self._kernel(group, ps, next(iter(by_step)), grad_scale, copies, F.checked_for(self, group))
                    continue
                F.check_lists([(sub, [p.grad for p in sub]) for sub in by_step.values()], copies)
            for step, sub in by_step.items():
                self._kernel(group, sub, step, grad_scale, copies, None)
        return loss

    def _kernel(self, group, ps, step, grad_scale, copies, checked):
        F.adagrad_step(ps, [p.grad for p in ps], [self.state[p]["sum"] for p in ps],
                       [copies.get(p) for p in ps] if copies else None, step=step,
                       lr=F.as_float(group["lr"], "lr"), lr_decay=group["lr_decay"],
                       weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"],
                       grad_scale=float(grad_scale), threads=self.threads, isa=self.isa, checked=checked)
