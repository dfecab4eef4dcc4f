"""``pz.optim.Adam`` / ``pz.optim.AdamW``: torch.optim's Adam and AdamW on the fused CPU step.

Same constructor, param groups, state layout (``step``, ``exp_avg``,
``exp_avg_sq``, ``max_exp_avg_sq``) and state_dict as torch.optim.Adam/AdamW,
so checkpoints move between the two and lr schedulers work unchanged. The
parameters must be dense, contiguous float32 CPU tensors.

torch's ``foreach``/``fused`` switches are accepted and ignored (the step is always
the fused kernel); ``capturable``/``differentiable`` raise. Extras over torch: ``threads`` (default ``torch.get_num_threads()``), and in
:meth:`step` a ``grad_scale`` applied to every gradient in the same pass and
``copies``, a ``{param: tensor}`` mapping of float16/bfloat16/float32 tensors
that receive the updated parameters in the same pass.

``moments="bf16"`` or ``"int8"`` stores exp_avg and exp_avg_sq in 4 or 2.03 bytes per
element instead of 8 (see :mod:`pyzero.optim.moments` for the formats and their error
bounds); the step is the fp32 kernel's on the stored values, in the kernel's pass (bf16)
or block by block, decoded, stepped and encoded again (int8). The state then holds
bfloat16 tensors, or int8/uint8 codes with ``exp_avg_absmax``/``exp_avg_sq_absmax``;
``state_dict()`` gives them in torch's fp32 layout (:meth:`fp32_state`), so it loads into
torch's Adam as well (the codes would load there as floats, silently wrong), and fp32 moments
loaded from it, torch or a checkpoint are re-stored in the chosen format at the next step
(exactly: the stored values decode and encode back to themselves). A state dict of stored
codes (an older one) still loads into an optimizer with the same ``moments``.
"""
from __future__ import annotations

import torch

from . import functional as F
from . import moments as M


class Adam(torch.optim.Optimizer):
    _decoupled = False

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 decoupled_weight_decay: bool = False, threads: int | None = None, isa: str = "best",
                 moments: str = "fp32"):
        F.check_torch_only_kwargs(f"pz.optim.{type(self).__name__}", foreach, fused, capturable, differentiable)
        if not isinstance(decoupled_weight_decay, bool):
            raise TypeError(f"decoupled_weight_decay: expected True or False, got {decoupled_weight_decay!r}")
        if not 0.0 <= F.as_float(lr, "lr"):
            raise ValueError(f"lr: expected >= 0, got {lr}")
        if not 0.0 <= eps:
            raise ValueError(f"eps: expected >= 0, got {eps}")
        for i, b in enumerate(betas):
            if not 0.0 <= F.as_float(b, f"betas[{i}]") < 1.0:
                raise ValueError(f"betas[{i}]: expected a value in [0, 1), got {b}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"weight_decay: expected >= 0, got {weight_decay}")
        F._threads(threads)
        F._isa_code(isa)
        self.threads, self.isa = threads, isa
        self.moments = M.check(moments, bool(amsgrad))
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                        maximize=maximize, foreach=foreach, capturable=False, differentiable=False, fused=fused,
                        decoupled_weight_decay=self._decoupled or decoupled_weight_decay)
        super().__init__(params, defaults)
        self._check_amsgrad()

    def _check_amsgrad(self) -> None:
        """amsgrad's running max is fp32 only: with bf16 or int8 moments a group of its own asking for it (its
        option in param_groups, or restored by load_state_dict) is refused before anything steps."""
        if self.moments == "fp32":
            return
        for i, group in enumerate(self.param_groups):
            if group.get("amsgrad"):
                raise ValueError(f"param_groups[{i}]: amsgrad=True needs moments='fp32' (its running max stays "
                                 f"fp32), got moments={self.moments!r}")

    def __setstate__(self, state):  # also load_state_dict's way in: the states are new tensors
        super().__setstate__(state)
        self.__dict__.setdefault("moments", "fp32")
        F.forget_checked(self)
        for group in self.param_groups:
            group.setdefault("amsgrad", False)
            group.setdefault("maximize", False)
            if self._decoupled:  # (AdamW; Adam's groups say, as torch.optim.Adam's)
                group["decoupled_weight_decay"] = True
            group.setdefault("decoupled_weight_decay", False)
            for p in group["params"]:
                s = self.state.get(p, {})
                if s and not torch.is_tensor(s["step"]):
                    s["step"] = torch.tensor(float(s["step"]), dtype=torch.float32)

    @F.hooked_step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, copies: dict | None = None):
        """One step of every parameter with a gradient; returns ``closure()``'s loss if given."""
        loss = F.run_closure(closure)
        self._check_amsgrad()
        F.check_groups(self, copies)
        for group in self.param_groups:
            self._step_group(group, float(grad_scale), copies)
        return loss

    def load_state_dict(self, state_dict):
        """As torch's, which casts every floating state to the parameter's dtype and would turn
        bf16 moments into fp32 ones and int8 codes into floats: those keep their saved dtype."""
        super().load_state_dict(state_dict)
        saved = state_dict["state"]
        ids = [i for g in state_dict["param_groups"] for i in g["params"]]
        for p, i in zip((p for g in self.param_groups for p in g["params"]), ids):
            for k, v in saved.get(i, {}).items():
                if torch.is_tensor(v) and k != "step" and v.dtype in (torch.bfloat16, torch.int8, torch.uint8) \
                        or k.endswith("_absmax"):
                    self.state[p][k] = v.to(p.device).clone()

    def state_dict(self):
        """torch's, with bf16 or int8 moments in torch's fp32 layout (see the module docstring)."""
        sd = super().state_dict()
        if self.moments != "fp32":
            params = [p for g in self.param_groups for p in g["params"]]
            for i in list(sd["state"]):
                sd["state"][i] = self.fp32_state(params[i])
        return sd

    def fp32_state(self, p) -> dict:
        """Parameter p's state in torch.optim.Adam's layout (fp32 moments), a copy."""
        return {k: (v.clone() if torch.is_tensor(v) else v) for k, v in M.to_fp32(self.state.get(p, {})).items()}

    def _init_state(self, p, state, amsgrad):
        if not state:
            state["step"] = torch.tensor(0.0, dtype=torch.float32)
            state.update(M.zeros_state(p, self.moments))
        if amsgrad and "max_exp_avg_sq" not in state:
            state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def _step_group(self, group, grad_scale, copies):
        amsgrad, all_state = group["amsgrad"], self.state
        ps, gs, states, fresh = [], [], [], []
        for p in group["params"]:
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError(f"{type(self).__name__} does not support sparse gradients")
            ps.append(p)
            gs.append(g)
        if not ps:
            return
        with F.UndoStep(self, states, fresh) as undo:
            for p in ps:
                state = all_state[p]
                if not state:
                    fresh.append(p)
                if not state or amsgrad and "max_exp_avg_sq" not in state:
                    self._init_state(p, state, amsgrad)
                states.append(state)
            steps = F.bump_steps(self, group, states)
            undo.bumped = True
            if steps.count(steps[0]) == len(steps):  # the usual case: one step count for the group
                self._step_list(group, ps, gs, states, steps[0], grad_scale, copies, F.checked_for(self, group))
                return
            by_step: dict[float, list] = {}
            for i, step in enumerate(steps):
                by_step.setdefault(step, []).append(i)
            F.check_lists([([ps[i] for i in idx], [gs[i] for i in idx]) for idx in by_step.values()], copies)
        for step, idx in by_step.items():
            self._step_list(group, [ps[i] for i in idx], [gs[i] for i in idx], [states[i] for i in idx], step,
                            grad_scale, copies, None)

    def _step_list(self, group, ps, gs, states, step, grad_scale, copies, checked):
        cs = [copies.get(p) for p in ps] if copies else None
        if self.moments == "bf16":  # the kernel reads and writes bf16 moments itself
            for p, s in zip(ps, states):
                M.convert(s, "bf16", p)
            self._kernel(group, ps, gs, states, step, grad_scale, cs, checked)
            return
        if self.moments == "int8":  # the kernel decodes, steps and encodes block by block
            for p, s in zip(ps, states):
                M.convert(s, "int8", p)
            beta1, beta2 = group["betas"]
            F.adam_step_q8(ps, gs, [s["exp_avg"] for s in states], [s["exp_avg_absmax"] for s in states],
                           [s["exp_avg_sq"] for s in states], [s["exp_avg_sq_absmax"] for s in states], cs,
                           step=step, lr=F.as_float(group["lr"], "lr"), beta1=F.as_float(beta1, "betas[0]"),
                           beta2=F.as_float(beta2, "betas[1]"), eps=group["eps"], weight_decay=group["weight_decay"],
                           decoupled=group["decoupled_weight_decay"], maximize=group["maximize"],
                           grad_scale=grad_scale, threads=self.threads, isa=self.isa)
            return
        if any(M.stored_as(s) != "fp32" for s in states):  # (loaded in another format)
            for p, s in zip(ps, states):
                M.convert(s, "fp32", p)
        self._kernel(group, ps, gs, states, step, grad_scale, cs, checked)

    def _kernel(self, group, ps, gs, states, step, grad_scale, copies, checked):
        beta1, beta2 = group["betas"]
        amsgrad = group["amsgrad"]
        F.adam_step(ps, gs, [s["exp_avg"] for s in states], [s["exp_avg_sq"] for s in states],
                    [s["max_exp_avg_sq"] for s in states] if amsgrad else None,
                    copies, step=step, lr=F.as_float(group["lr"], "lr"), beta1=F.as_float(beta1, "betas[0]"),
                    beta2=F.as_float(beta2, "betas[1]"), eps=group["eps"], weight_decay=group["weight_decay"],
                    decoupled=group["decoupled_weight_decay"], amsgrad=amsgrad, maximize=group["maximize"],
                    grad_scale=grad_scale,
                    threads=self.threads, isa=self.isa, checked=checked)


class AdamW(Adam):
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kw):
        if "decoupled_weight_decay" in kw:  # (as torch.optim.AdamW, which always is)
            raise TypeError("AdamW.__init__() got an unexpected keyword argument 'decoupled_weight_decay'")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kw)
