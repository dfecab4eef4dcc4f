"""What the integrations share: the options a strategy passes on, and the check that pyzero runs the
backend asked for. (torch.distributed beside pyzero, for the frameworks' own collectives: losses,
metrics, barriers, is pyzero.distributed.init_torch.)"""
from __future__ import annotations

import torch

from .. import comm

# What a strategy's options may set (the integration sets the model, optimizer, stage, groups and group).
ZERO_OPTIONS = ("bucket_mb", "overlap", "param_dtype", "comm_dtype", "offload", "nvme_path", "offload_params",
                "offload_moments", "offload_pipeline")
DP_OPTIONS = ("bucket_mb", "first_bucket_mb", "comm_dtype", "broadcast_buffers")


def option_refused(name: str, stage: int | None) -> str | None:
    """Why a strategy with ZeRO stage `stage` (None: DataParallel) does not pass option `name` on, or None.
    Stage 3 also takes prefetch, leaf_modules and ZeroOptimizer's zero_* (ZeRO++) options."""
    allowed = DP_OPTIONS if stage is None else ZERO_OPTIONS
    stage3_only = name in ("prefetch", "leaf_modules") or name.startswith("zero_")
    if name in allowed or (stage == 3 and stage3_only):
        return None
    if stage is not None and stage3_only:
        return f"a ZeRO stage-3 option, and the strategy is stage {stage}"
    return f"expected some of {list(allowed) + (['prefetch', 'leaf_modules', 'zero_*'] if stage == 3 else [])}"


def fp16_refused(options: dict, stage: int | None) -> str | None:
    """Why ZeRO options with fp16 parameters are refused (None when they are not): a strategy's options
    give no loss scaling, and fp16 gradients without it overflow and underflow (the frameworks' fp16
    training always scales)."""
    if stage is not None and options.get("param_dtype") is torch.float16:
        return ("param_dtype: torch.float16 needs loss scaling, which a strategy's options do not give (fp16 "
                "gradients overflow and underflow without it); use torch.bfloat16")
    return None


def check_started(backend: str | None, who: str) -> None:
    """pyzero is already started (an earlier pz.init): a `backend` asked for must be the one it runs."""
    if backend is not None and backend != comm.get_backend():
        raise ValueError(f"backend: {who} asks for {backend!r}, but pyzero is already started with backend "
                         f"{comm.get_backend()!r}; pass backend=None, or start it with {backend!r}")
