"""DeepSpeed runs for ``pyzero-bench train``, where deepspeed is importable.

``ds-zero2-offload`` is DeepSpeed ZeRO-Offload as its documentation sets it up: ZeRO stage 2,
``offload_optimizer: {device: cpu, pin_memory: true}`` (pinned on a GPU), its CPUAdam in AdamW
mode, with pyzero's zero2-offload settings (lr 1e-4, torch AdamW's betas, eps and weight decay
0.01; fp32 parameters; the same bucket cap). ``ds-zero2`` is the same without offload. The
engine replaces ``loss.backward()`` and ``optimizer.step()`` (``engine.backward`` /
``engine.step``), which the Runner's ``backward`` and :class:`EngineStep` carry.
``pyzero-bench capacity`` has the same ``ds-zero2-offload`` with bf16 parameters, as its
zero2-offload. DeepSpeed builds CPUAdam
with ninja the first time it runs (about a minute) and caches it in ~/.cache/torch_extensions.

A machine without a package index (the GPU machine) gets deepspeed from the wheels that
``scripts/gpu_wheels.sh`` makes on a machine with one.
"""
from __future__ import annotations

import importlib.util


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


def initialize(model, *, batch: int, bucket_bytes: int, offload: bool, cuda: bool, bf16: bool = False):
    """DeepSpeed's engine for `model` over the torch.distributed group already initialised: ZeRO
    stage 2, AdamW (torch's defaults, weight decay 0.01, lr 1e-4), the optimizer on the CPU with
    `offload`, bf16 parameters and gradients (fp32 masters) with `bf16`."""
    if not available():
        raise SystemExit("--runs ds-*: deepspeed is not importable here (pip install deepspeed, or on a "
                         "machine without an index the wheels of scripts/gpu_wheels.sh)")
    import deepspeed  # noqa: PLC0415

    bucket = bucket_bytes // 4  # DeepSpeed counts bucket sizes in elements
    zero = {"stage": 2, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket, "overlap_comm": cuda,
            "contiguous_gradients": True}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": cuda}
    cfg = {"train_micro_batch_size_per_gpu": batch, "gradient_accumulation_steps": 1,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                     "weight_decay": 0.01}},
           "zero_optimization": zero, "steps_per_print": 1 << 30, "wall_clock_breakdown": False,
           "bf16": {"enabled": bf16}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                           dist_init_required=False)
    return engine
