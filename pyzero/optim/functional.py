"""The fused CPU optimizer steps on lists of tensors: argument checks, the
per-step scalars (computed in double exactly as torch.optim computes them, then
rounded to fp32 by the C++ call) and the one crossing into ``_C`` per list.

Used by :mod:`pyzero.optim`'s ``torch.optim.Optimizer`` classes and directly by
ZeRO offload, which steps one flat fp32 shard per call.
"""
from __future__ import annotations

import functools
import math
import operator
from typing import Sequence

import torch

from .. import _C
from ..backend import DTYPES

ISAS = {"best": -1, "scalar": 0, "avx2": 1, "avx512": 2}
COPY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def cpu_isa() -> str:
    """The vector instruction set the fused steps use on this CPU: avx512, avx2 or scalar."""
    return _C.cpu_optim_isa()


def cpu_threading() -> str:
    """Where a multi-threaded step runs: "openmp" (the OpenMP thread team already in the
    process, torch's, which is awake after torch's own kernels) or "threads" (threads started
    per step: no OpenMP runtime loaded, or a child forked from this process, where an
    OpenMP team from before the fork would wait forever)."""
    return _C.cpu_optim_threading()


def default_threads() -> int:
    """torch's intra-op thread count, so ``torch.set_num_threads`` governs both."""
    return max(1, torch.get_num_threads())


def _ptr(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def _check_fp32(t, arg: str, i: int, numel: int | None = None) -> int:
    """t's element count, or the error saying what is wrong with it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{arg}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.layout != torch.strided:
        raise ValueError(f"{arg}[{i}]: expected a dense float32 CPU tensor, got {t.dtype} on {t.device}"
                         + (f" ({t.layout})" if t.layout != torch.strided else ""))
    if not t.is_contiguous():
        raise ValueError(f"{arg}[{i}]: expected a contiguous tensor")
    if numel is not None and t.numel() != numel:
        raise ValueError(f"{arg}[{i}]: has {t.numel()} elements, the parameter has {numel}")
    return t.numel()


_F32, _STRIDED = torch.float32, torch.strided


def _fp32_ok(t) -> bool:
    """The common case of _check_fp32 in a few attribute reads (about 0.3 us a tensor)."""
    return isinstance(t, torch.Tensor) and t.dtype is _F32 and t.is_cpu and t.layout is _STRIDED \
        and t.is_contiguous()


_data_ptr = torch.Tensor.data_ptr


class Checked:
    """What the last step over a list of tensors checked: per list name, the tensors and their
    addresses. A step over the same tensor objects at the same addresses (an optimizer's
    parameters and states, step after step) skips their checks; a moved or replaced tensor is
    checked again. Gradients and copies are checked every step and not kept: holding last
    step's gradients would keep their memory past ``zero_grad``. One per caller's list (an
    optimizer keeps one per param group and drops them on load_state_dict)."""
    __slots__ = ("lists",)

    def __init__(self):
        self.lists: dict[str, tuple] = {}


def _addresses(seq) -> list[int] | None:
    """data_ptr() of every tensor in seq; None when one is not a tensor (the checks then say which)."""
    try:
        return list(map(_data_ptr, seq))
    except (TypeError, AttributeError):
        return None


def _table(params, grads, states: dict[str, Sequence | None], copies, checked: Checked | None = None,
           bf16_states: tuple[str, ...] = ()):
    """Checked pointer lists for _C; returns (ptr lists by name, numels, copy dtype code).
    The state lists named in bf16_states hold bfloat16 tensors instead of float32."""
    n = len(params)
    lists = {"params": params, "grads": grads, **states}
    for name, seq in lists.items():
        if seq is not None and len(seq) != n:
            raise ValueError(f"{name}: expected {n} tensors (one per parameter), got {len(seq)}")
    ptrs: dict[str, list[int]] = {}
    numels: list[int] = []
    same_params = False
    for name, seq in lists.items():
        if seq is None:
            ptrs[name] = [0] * n
            continue
        addrs = _addresses(seq)
        keep = checked is not None and name != "grads" and addrs is not None
        prev = checked.lists.get(name) if keep else None
        # States are only taken as checked against the parameters they were checked against.
        hit = prev is not None and (name == "params" or same_params) and prev[1] == addrs \
            and all(map(operator.is_, seq, prev[0]))
        if name == "params":
            same_params = hit
            numels = prev[2] if hit else [p.numel() if _fp32_ok(p) else _check_fp32(p, "params", i)
                                          for i, p in enumerate(params)]
        elif not hit and name in bf16_states:
            for i, (t, numel) in enumerate(zip(seq, numels)):
                if not (isinstance(t, torch.Tensor) and t.dtype is torch.bfloat16 and t.is_cpu
                        and t.layout is _STRIDED and t.is_contiguous() and t.numel() == numel):
                    raise ValueError(f"{name}[{i}]: expected a contiguous bfloat16 CPU tensor of {numel} "
                                     f"elements (bf16 moments), got {getattr(t, 'dtype', type(t).__name__)}")
        elif not hit:
            for i, (t, numel) in enumerate(zip(seq, numels)):
                if not (_fp32_ok(t) and t.numel() == numel):
                    _check_fp32(t, name, i, numel)
        if keep and not hit:
            checked.lists[name] = (tuple(seq), addrs, numels)
        ptrs[name] = addrs
    copy_code = DTYPES[torch.float32]
    if copies is not None:
        if len(copies) != n:
            raise ValueError(f"copies: expected {n} entries (one per parameter, None for no copy), got {len(copies)}")
        dtypes = {c.dtype for c in copies if c is not None}
        if len(dtypes) > 1:
            raise ValueError(f"copies: expected one dtype for all copies, got {sorted(map(str, dtypes))}")
        for i, c in enumerate(copies):
            if c is None:
                continue
            if c.device.type != "cpu" or c.dtype not in COPY_DTYPES or not c.is_contiguous():
                raise ValueError(f"copies[{i}]: expected a contiguous float32, float16 or bfloat16 CPU tensor, "
                                 f"got {c.dtype} on {c.device}")
            if c.numel() != numels[i]:
                raise ValueError(f"copies[{i}]: has {c.numel()} elements, the parameter has {numels[i]}")
        if dtypes:
            copy_code = DTYPES[dtypes.pop()]
    ptrs["copies"] = [_ptr(c) for c in copies] if copies is not None else [0] * n
    return ptrs, numels, copy_code


def _isa_code(isa: str) -> int:
    if isa not in ISAS:
        raise ValueError(f"isa: expected one of {sorted(ISAS)}, got {isa!r}")
    return ISAS[isa]


def _threads(threads: int | None) -> int:
    if threads is None:
        return default_threads()
    if not isinstance(threads, int) or threads < 1:
        raise ValueError(f"threads: expected an int >= 1, got {threads!r}")
    return threads


def adam_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs, exp_avg_sqs,
              max_exp_avg_sqs=None, copies=None, *, step: float, lr: float, beta1: float, beta2: float,
              eps: float, weight_decay: float, decoupled: bool, amsgrad: bool = False, maximize: bool = False,
              grad_scale: float = 1.0, threads: int | None = None, isa: str = "best",
              checked: Checked | None = None) -> None:
    """One Adam (``decoupled=False``) or AdamW step on every tensor, in place.

    ``step`` is the step count after this step (1 for the first). ``grad_scale``
    multiplies every gradient first, in the same pass (``1/loss_scale`` times a
    clip coefficient). ``copies[i]``, when given, receives the updated
    ``params[i]`` cast to its dtype (float32, float16 or bfloat16) in the same pass.
    ``checked``, a :class:`Checked` kept by the caller from step to step, spares the
    checks of parameters and states that have not changed since the last step.
    ``exp_avgs`` and ``exp_avg_sqs`` may be bfloat16 (all of them; not with amsgrad): read
    widened, written rounded to nearest even in the same pass.
    """
    if amsgrad and max_exp_avg_sqs is None:
        raise ValueError("max_exp_avg_sqs: required with amsgrad=True")
    bf16 = bool(exp_avgs) and isinstance(exp_avgs[0], torch.Tensor) and exp_avgs[0].dtype is torch.bfloat16
    if bf16 and amsgrad:
        raise ValueError("exp_avgs: bfloat16 moments need amsgrad=False")
    states = {"exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
              "max_exp_avg_sqs": max_exp_avg_sqs if amsgrad else None}
    ptrs, numels, copy_code = _table(params, grads, states, copies, checked,
                                     ("exp_avgs", "exp_avg_sqs") if bf16 else ())
    # As torch.optim.adam._single_tensor_adam (capturable=False), in double.
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    _C.cpu_adam_step(ptrs["params"], ptrs["grads"], ptrs["exp_avgs"], ptrs["exp_avg_sqs"],
                     ptrs["max_exp_avg_sqs"], ptrs["copies"], numels, copy_code, grad_scale,
                     weight_decay, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2,
                     bias_correction2 ** 0.5, eps, -step_size, decoupled, amsgrad, maximize,
                     _threads(threads), _isa_code(isa), bf16)


def adam_step_q8(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], exp_avgs, exp_avg_absmaxes,
                 exp_avg_sqs, exp_avg_sq_absmaxes, copies=None, *, step: float, lr: float, beta1: float,
                 beta2: float, eps: float, weight_decay: float, decoupled: bool, maximize: bool = False,
                 grad_scale: float = 1.0, threads: int | None = None, isa: str = "best") -> None:
    """:func:`adam_step` with 8-bit block-quantized moments (see :mod:`pyzero.optim.moments`):
    ``exp_avgs[i]`` int8 and ``exp_avg_sqs[i]`` uint8 codes of ``params[i]``'s element count,
    their absmaxes float32 with one value per block of 256 elements. Every block is decoded,
    stepped by the fp32 kernel and encoded again in one pass over it, in place."""
    n = len(params)
    lists = {"grads": grads, "exp_avgs": exp_avgs, "exp_avg_absmaxes": exp_avg_absmaxes, "exp_avg_sqs": exp_avg_sqs,
             "exp_avg_sq_absmaxes": exp_avg_sq_absmaxes}
    for name, seq in lists.items():
        if len(seq) != n:
            raise ValueError(f"{name}: expected {n} tensors (one per parameter), got {len(seq)}")
    numels = [_check_fp32(p, "params", i) for i, p in enumerate(params)]
    want = {"grads": (torch.float32, 1), "exp_avgs": (torch.int8, 1), "exp_avg_sqs": (torch.uint8, 1),
            "exp_avg_absmaxes": (torch.float32, 256), "exp_avg_sq_absmaxes": (torch.float32, 256)}
    for name, seq in lists.items():
        dtype, per = want[name]
        for i, (t, numel) in enumerate(zip(seq, numels)):
            count = -(-numel // per)
            if not (isinstance(t, torch.Tensor) and t.dtype == dtype and t.device.type == "cpu"
                    and t.layout == torch.strided and t.is_contiguous() and t.numel() == count):
                raise ValueError(f"{name}[{i}]: expected a contiguous {dtype} CPU tensor of {count} elements, got "
                                 f"{getattr(t, 'dtype', type(t).__name__)} with "
                                 f"{getattr(t, 'numel', lambda: '?')()} elements")
    ptrs, _, copy_code = _table(params, grads, {}, copies)
    bias_correction1 = 1 - beta1 ** step
    bias_correction2 = 1 - beta2 ** step
    step_size = lr / bias_correction1
    _C.cpu_adam_step_q8(ptrs["params"], ptrs["grads"], [_ptr(t) for t in exp_avgs],
                        [_ptr(t) for t in exp_avg_absmaxes], [_ptr(t) for t in exp_avg_sqs],
                        [_ptr(t) for t in exp_avg_sq_absmaxes], ptrs["copies"], numels, copy_code, grad_scale,
                        weight_decay, 1 - lr * weight_decay, 1 - beta1, beta2, 1 - beta2, bias_correction2 ** 0.5,
                        eps, -step_size, decoupled, maximize, _threads(threads), _isa_code(isa))


def sgd_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], momentum_buffers=None,
             copies=None, *, lr: float, momentum: float = 0.0, dampening: float = 0.0, weight_decay: float = 0.0,
             nesterov: bool = False, maximize: bool = False, first_step: bool = False, grad_scale: float = 1.0,
             threads: int | None = None, isa: str = "best", checked: Checked | None = None) -> None:
    """One SGD step on every tensor, in place, as torch.optim.sgd._single_tensor_sgd.

    With ``momentum != 0`` and ``first_step=True`` the buffers are set to the
    (weight-decayed) gradient, as torch does when a buffer does not exist yet.
    """
    if momentum != 0 and momentum_buffers is None:
        raise ValueError("momentum_buffers: required with momentum != 0")
    states = {"momentum_buffers": momentum_buffers if momentum != 0 else None}
    ptrs, numels, copy_code = _table(params, grads, states, copies, checked)
    _C.cpu_sgd_step(ptrs["params"], ptrs["grads"], ptrs["momentum_buffers"], ptrs["copies"], numels, copy_code,
                    grad_scale, weight_decay, momentum, 1 - dampening, -lr, nesterov, maximize, first_step,
                    _threads(threads), _isa_code(isa))


def bump_steps(opt: torch.optim.Optimizer, group: dict, states: list[dict]) -> list[float]:
    """torch's ``state["step"] += 1`` for every state in `states` (of `opt`'s param group `group`);
    returns the new counts.

    The step counts stay what torch keeps (a float32 0-d tensor per parameter) but are views
    of one tensor per list of parameters, so that one add bumps them all: adding 1 to a
    hundred separate 0-d tensors costs about 150 us, more than the step of a hundred small
    parameters. The optimizer remembers, per group, the shared tensor and the views handed out;
    when a state's step is no longer one of them (a new parameter, load_state_dict), the list
    is linked again from the current values."""
    links = opt.__dict__.setdefault("_step_links", {})  # not in torch's pickled state: rebuilt on use
    steps = [s["step"] for s in states]
    linked = links.get(id(group))
    if linked is not None and len(linked[1]) == len(steps) and all(map(operator.is_, linked[1], steps)):
        return _C.cpu_bump_f32(linked[0].data_ptr(), len(steps))  # linked[0].add_(1).tolist(), in 1/10 the time
    shared = torch.tensor([s.item() for s in steps], dtype=torch.float32).add_(1)
    views = tuple(shared[i] for i in range(len(states)))
    for state, view in zip(states, views):
        state["step"] = view
    links[id(group)] = (shared, views)
    return shared.tolist()


def check_lists(lists, copies) -> None:
    """Check each (params, grads) list's parameters, gradients and `copies` (a dict or None) as the
    step's kernel would, before any state changes: a step that runs several kernels (param groups,
    step counts) is refused whole, not after some of them have stepped."""
    for ps, gs in lists:
        _table(ps, gs, {}, [copies.get(p) for p in ps] if copies else None)


def check_groups(opt: torch.optim.Optimizer, copies) -> None:
    """check_lists over every param group of `opt` with more than one: refused whole, not after the first
    groups stepped (one group's own kernel checks come first, and UndoStep puts back what they found)."""
    if len(opt.param_groups) > 1:
        check_lists([([p for p in g["params"] if p.grad is not None],
                      [p.grad for p in g["params"] if p.grad is not None]) for g in opt.param_groups], copies)


class UndoStep:
    """``with UndoStep(opt, states, fresh):`` around one kernel's bump and step: if the kernel refuses
    (its checks raise), the step counts the bump moved go back and the states made for this step
    (`fresh` parameters) are dropped, so that the same step, retried with mended inputs, equals
    torch's. (Raising later than the checks, a kernel has changed nothing either.)"""

    def __init__(self, opt, states: list[dict], fresh):
        self.opt, self.states, self.fresh = opt, states, fresh
        self.bumped = False

    def __enter__(self):
        return self

    def __exit__(self, kind, *exc):
        if kind is not None:
            if self.bumped:
                for s in self.states:
                    s["step"].sub_(1)
            for p in self.fresh:
                self.opt.state.pop(p, None)
        return False


def checked_for(opt: torch.optim.Optimizer, group: dict) -> Checked:
    """The :class:`Checked` of `opt`'s param group `group` (kept outside torch's pickled state;
    :func:`forget_checked` drops them all, as load_state_dict must)."""
    memos = opt.__dict__.setdefault("_checked", {})
    memo = memos.get(id(group))
    if memo is None or memo[0] is not group:
        memo = memos[id(group)] = (group, Checked())
    return memo[1]


def forget_checked(opt: torch.optim.Optimizer) -> None:
    """Drops `opt`'s :class:`Checked` lists (and the tensors they hold)."""
    opt.__dict__.pop("_checked", None)


def as_float(x, arg: str) -> float:
    """A Python float from a number or a one-element tensor (lr, betas may be tensors in torch)."""
    if isinstance(x, torch.Tensor):
        if x.numel() != 1:
            raise ValueError(f"{arg}: expected a number or a one-element tensor, got shape {tuple(x.shape)}")
        return float(x.item())
    v = float(x)
    if math.isnan(v):
        raise ValueError(f"{arg}: got NaN")
    return v


def adagrad_step(params: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], state_sums, copies=None, *,
                 step: float, lr: float, lr_decay: float = 0.0, weight_decay: float = 0.0, eps: float = 1e-10,
                 maximize: bool = False, grad_scale: float = 1.0, threads: int | None = None,
                 isa: str = "best", checked: Checked | None = None) -> None:
    """One Adagrad step on every tensor, in place, as torch.optim.adagrad._single_tensor_adagrad
    (``step`` counted after this step)."""
    ptrs, numels, copy_code = _table(params, grads, {"state_sums": state_sums}, copies, checked)
    clr = lr / (1 + (step - 1) * lr_decay)
    _C.cpu_adagrad_step(ptrs["params"], ptrs["grads"], ptrs["state_sums"], ptrs["copies"], numels, copy_code,
                        grad_scale, weight_decay, -clr, eps, maximize, _threads(threads), _isa_code(isa))


try:  # torch's registries of global step hooks (torch.optim.optimizer, 2.0 on)
    from torch.optim.optimizer import _global_optimizer_post_hooks, _global_optimizer_pre_hooks
except ImportError:  # pragma: no cover -- another torch: every step goes through torch's wrapper
    _global_optimizer_pre_hooks = _global_optimizer_post_hooks = None


def hooked_step(func):
    """An optimizer's ``step`` as torch.optim.Optimizer wraps it (``profile_hook_step``: step
    pre/post hooks, global and per optimizer, inside a profiler ``record_function`` named
    ``Optimizer.step#<class>.step``), minus the wrapper's cost when nothing listens: with no
    hook registered and no profiler running the step is called directly. The record_function
    alone is about 9 us a step here, more than the rest of a small step's Python side. Marked
    ``hooked`` so that torch's ``_patch_step_function`` leaves it as it is."""
    torch_step = torch.optim.Optimizer.profile_hook_step(func)

    @functools.wraps(func)
    def step(self, *args, **kwargs):
        if _global_optimizer_pre_hooks is None or _global_optimizer_pre_hooks or _global_optimizer_post_hooks \
                or self._optimizer_step_pre_hooks or self._optimizer_step_post_hooks \
                or torch.autograd._profiler_enabled():
            return torch_step(self, *args, **kwargs)
        return func(self, *args, **kwargs)

    step.hooked = True
    return step


def check_torch_only_kwargs(name: str, foreach, fused, capturable=False, differentiable=False) -> None:
    """torch.optim's implementation switches: foreach/fused are accepted and ignored (the step is
    always the fused CPU kernel); capturable/differentiable cannot be honoured and raise."""
    for arg, v in (("foreach", foreach), ("fused", fused)):
        if v not in (None, True, False):
            raise ValueError(f"{arg}: expected None, True or False, got {v!r}")
    for arg, v in (("capturable", capturable), ("differentiable", differentiable)):
        if v:
            raise ValueError(f"{arg}: not supported by {name} (a fused CPU step outside autograd)")


def run_closure(closure):
    """torch.optim's step(closure): the loss closure() returns, computed with gradients on (None without one)."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()
