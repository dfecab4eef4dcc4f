"""DeepSpeed runs for ``pyzero-bench train`` and ``capacity``, where deepspeed is importable.

``ds-zero2-offload`` is DeepSpeed ZeRO-Offload as its documentation sets it up: ZeRO stage 2,
``offload_optimizer: {device: cpu, pin_memory: true}`` (pinned on a GPU), its CPUAdam in AdamW
mode, with pyzero's zero2-offload settings (lr 1e-4, torch AdamW's betas, eps and weight decay
0.01; fp32 parameters; the same bucket cap). ``ds-zero2`` is the same without offload. The
engine replaces ``loss.backward()`` and ``optimizer.step()`` (``engine.backward`` /
``engine.step``), which the Runner's ``backward`` and :class:`EngineStep` carry.
``pyzero-bench capacity`` has the same ``ds-zero2-offload`` with bf16 parameters, as its
zero2-offload. DeepSpeed builds CPUAdam
with ninja the first time it runs (about a minute) and caches it in ~/.cache/torch_extensions.

``ds-zenflow`` is ZeRO-Offload with DeepSpeed's ZenFlow (``zero_optimization.zenflow``), set up
as DeepSpeed's ZenFlow tutorial and its fine-tuning example (DeepSpeedExamples
training/DeepSpeed-ZenFlow/finetuning/zf_config.json) set it: :data:`ZENFLOW`, i.e.
``topk_ratio`` 0.1 (the gradient columns with the largest norms, 10% of each weight's columns,
are applied on the device every step), ``update_interval`` 4 (the rest accumulate and are applied
by the CPU optimizer every 4th step), ``full_warm_up_rounds`` 0, ``overlap_step`` true (that CPU
step runs in a process of its own, overlapped with the next steps' forward and backward), and
``select_strategy`` / ``select_interval`` left at "auto": selection once per epoch, which for a
run without a DeepSpeed dataloader (as here) means once, at the first step. Everything else is
``ds-zero2-offload``'s. ZenFlow is not exact: it trains on a different trajectory than AdamW,
which is why ``pyzero-bench train --losses`` prints each step's loss beside the exact runs'.

DeepSpeed 0.19.8 (the version scripts/gpu_wheels.sh carries) points the model's 2-D weights at
its flat buffer without ZenFlow's column-major layout (``_update_model_bit16_weights`` in ZeRO
1/2, at set-up and after steps, views each transposed slice as the weight's shape): every weight
matrix then holds its values in another order and the updates land on other elements than their
gradients'. On gpt-nano with ``full_warm_up_rounds`` covering every step and ``overlap_step`` off
(ZenFlow then is plain AdamW), at lr 1e-3: loss 6.231 -> 6.136 in 10 steps where torch AdamW from
the same weights goes 6.231 -> 4.944. :func:`_fix_zenflow_views` has that method point them as
ZenFlow's own unflatten lays them out (what DeepSpeed's repository had before, at 0.19.6): the run
then gives torch's loss at every step (tests/test_ds_runs.py), and with :data:`ZENFLOW` the same
losses as that DeepSpeed 0.19.6 code. :func:`initialize` checks that the engine's weights are the
model's, a RuntimeError else.

``ds-superoffload`` is DeepSpeed's SuperOffload (``offload_optimizer.super_offload``, ZeRO stage
3 only; made for Grace Hopper "Superchips", but it needs only CUDA: on any other accelerator
DeepSpeed refuses it), set up as DeepSpeedExamples training/DeepSpeed-SuperOffload's README:
:data:`SUPEROFFLOAD`, i.e. ``pin_memory`` true, ``ratio`` 0.9 (90% of the optimizer's sub-groups
on the CPU, the last 10% stepped on the GPU), ``cpuadam_cores_perc`` 0.9 and ``overlap_comm``
false, with the bench's bucket cap as ``reduce_bucket_size`` and ``sub_group_size`` (the
example's 4e8 elements are one sub-group for GPT-2 small, which leaves nothing to overlap). Its
AdamW is the same CPUAdam in AdamW mode. It is a train run only, on a GPU.

A machine without a package index (the GPU machine) gets deepspeed from the wheels that
``scripts/gpu_wheels.sh`` makes on a machine with one.
"""
from __future__ import annotations

import importlib.util
import inspect

import torch

# DeepSpeed's ZenFlow tutorial / fine-tuning example values (select_strategy, select_interval: "auto").
ZENFLOW = {"topk_ratio": 0.1, "update_interval": 4, "full_warm_up_rounds": 0, "overlap_step": True}
# DeepSpeedExamples training/DeepSpeed-SuperOffload's offload_optimizer block, less device/pin_memory.
SUPEROFFLOAD = {"ratio": 0.9, "super_offload": True, "cpuadam_cores_perc": 0.9}
VARIANTS = ("zero2", "zero2-offload", "zenflow", "superoffload")


def available() -> bool:
    return importlib.util.find_spec("deepspeed") is not None


class EngineStep:
    """The optimizer the timing loop drives: engine.step() steps and zeroes the gradients."""

    def __init__(self, engine):
        self.engine = engine

    def zero_grad(self, set_to_none: bool = True) -> None:
        pass  # engine.step() has zeroed them

    def step(self) -> None:
        self.engine.step()


def config(variant: str, *, batch: int, bucket_bytes: int, cuda: bool, bf16: bool = False) -> dict:
    """DeepSpeed's config for `variant` (one of VARIANTS): ZeRO stage 2 (stage 3 for superoffload),
    AdamW (torch's defaults, weight decay 0.01, lr 1e-4), the optimizer on the CPU but for "zero2",
    bf16 parameters and gradients (fp32 masters) with `bf16`."""
    if variant not in VARIANTS:
        raise ValueError(f"variant: expected one of {VARIANTS}, got {variant!r}")
    bucket = bucket_bytes // 4  # DeepSpeed counts bucket sizes in elements
    if variant == "superoffload":
        zero = {"stage": 3, "overlap_comm": False, "reduce_bucket_size": bucket, "sub_group_size": bucket,
                "offload_optimizer": {"device": "cpu", "pin_memory": cuda, **SUPEROFFLOAD}}
    else:
        zero = {"stage": 2, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket, "overlap_comm": cuda,
                "contiguous_gradients": True}
        if variant != "zero2":
            zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
        if variant == "zenflow":
            zero["zenflow"] = dict(ZENFLOW)
    return {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.01}},
            "zero_optimization": zero, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
            "bf16": {"enabled": bf16}}


def _probe(params) -> list:
    """A few values of every parameter (its first row), to tell whether initialize kept them."""
    return [p.detach()[0].clone() if p.dim() == 2 else p.detach().flatten()[:64].clone() for p in params]


def _kept(params, probe) -> bool:
    """Whether `params` still hold the values `probe` took (cast to their dtype now: bf16 runs)."""
    return all(torch.equal(now, then.to(now.dtype)) for now, then in zip(_probe(params), probe))


def _repair_zenflow_views(opt, groups=None) -> None:
    """Point each weight of a ZenFlow ZeRO-1/2 optimizer at its slice of the flat buffer as ZenFlow
    lays it out (a 2-D weight stored transposed, column after column), as its unflatten does."""
    for i in range(len(opt.bit16_groups_flat)) if groups is None else groups:
        flat = opt.bit16_groups_flat[i]
        for p, meta, offset in zip(opt.round_robin_bit16_groups[i], opt.round_robin_bit16_meta[i],
                                   opt.round_robin_bit16_offsets[i]):
            view = flat.narrow(0, offset, meta.numel())
            p.data = view.view(meta.shape[1], meta.shape[0]).t() if len(meta.shape) == 2 else view.view(meta.shape)


def _fix_zenflow_views() -> None:
    """Where DeepSpeed's ZeRO-1/2 optimizer points the model's weights at its flat buffer without
    ZenFlow's layout (0.19.8's _update_model_bit16_weights: a row-major view of each slice; it runs
    at set-up and again after steps), have it point them as ZenFlow lays them out. For the rest of
    this process (a bench rank); engines without ZenFlow are left as they are."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer  # noqa: PLC0415

    original = DeepSpeedZeroOptimizer._update_model_bit16_weights
    try:
        src = inspect.getsource(original)
    except (OSError, TypeError):  # already replaced, or no source to read
        return
    if "round_robin_bit16_offsets" not in src or "unflatten" in src:
        return

    def update(self, group_index):
        original(self, group_index)
        if getattr(self, "zenflow", False):
            _repair_zenflow_views(self, [group_index])

    DeepSpeedZeroOptimizer._update_model_bit16_weights = update


def initialize(model, *, batch: int, bucket_bytes: int, offload: bool = True, cuda: bool, bf16: bool = False,
               variant: str | None = None):
    """DeepSpeed's engine for `model` over the torch.distributed group already initialised, with
    config(variant) (default: "zero2-offload" with `offload`, else "zero2"). The engine's weights
    must be the model's (a RuntimeError else)."""
    if not available():
        raise SystemExit("--runs ds-*: deepspeed is not importable here (pip install deepspeed, or on a "
                         "machine without an index the wheels of scripts/gpu_wheels.sh)")
    import deepspeed  # noqa: PLC0415

    variant = variant or ("zero2-offload" if offload else "zero2")
    cfg = config(variant, batch=batch, bucket_bytes=bucket_bytes, cuda=cuda, bf16=bf16)
    params = list(model.parameters())
    probe = _probe(params) if variant != "superoffload" else None  # (stage 3 partitions them)
    if variant == "zenflow":
        _fix_zenflow_views()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           dist_init_required=False)
    if probe is not None and not _kept(params, probe):
        engine.destroy()
        raise RuntimeError(f"ds-{variant}: deepspeed {deepspeed.__version__}'s initialize changed the model's "
                           "weights; its rows would train another model than the other runs")
    return engine
