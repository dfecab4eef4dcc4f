"""Activation memory and per-stage parameter counts of a GPT-style model under a layout.

The formulas (Korthikanti et al. 2022) and their derivation are written down at
the top of pyzero/plan/cost.py. This module imports nothing of pyzero but the
model description, so pyzero.zero.memory.estimate_memory can use it without an
import cycle (the planner's cost model uses estimate_memory in turn).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .spec import ModelSpec
from ..checks import is_int

RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Layout:
    """One point of the search space."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    stage: int = 0
    micro_batch: int = 1
    micro_batches: int = 1
    sp: bool = False
    recompute: str = "none"
    offload: str = "none"

    def __post_init__(self):
        for arg in ("dp", "tp", "pp", "micro_batch", "micro_batches"):
            v = getattr(self, arg)
            if not is_int(v) or v < 1:
                raise ValueError(f"{arg}: expected a positive int, got {v!r}")
        if isinstance(self.stage, bool) or self.stage not in (0, 1, 2, 3):
            raise ValueError(f"stage: expected one of (0, 1, 2, 3) (the ZeRO stage), got {self.stage!r}")
        if not isinstance(self.sp, bool):
            raise ValueError(f"sp: expected a bool (sequence parallelism), got {self.sp!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute: expected one of {RECOMPUTE}, got {self.recompute!r}")
        if self.offload not in ("none", "cpu"):
            raise ValueError(f"offload: expected one of ('none', 'cpu'), got {self.offload!r}")

    def __str__(self):
        extra = "".join([" sp" if self.sp else "", f" rc={self.recompute}" if self.recompute != "none" else "",
                         " offload" if self.offload != "none" else ""])
        return (f"dp{self.dp} tp{self.tp} pp{self.pp} zero{self.stage} b{self.micro_batch}x{self.micro_batches}"
                + extra)


def layer_activation_bytes(spec: ModelSpec, b: int, tp: int = 1, sp: bool = False, recompute: str = "none") -> float:
    """Activation bytes one transformer layer keeps for backward (Korthikanti et al. 2022, Table 2)."""
    s, h, a, t = spec.seq, spec.hidden, spec.heads, tp
    sbh = s * b * h
    if recompute == "full":
        return 2 * sbh / (t if sp else 1)
    attn = 0.0 if recompute == "selective" or spec.fused_attention else 5 * a * s / (h * t)
    if recompute not in ("none", "selective"):
        raise ValueError(f"recompute: expected one of {RECOMPUTE}, got {recompute!r}")
    if t == 1:
        return sbh * (34 + attn)
    return sbh * ((34 / t) if sp else (10 + 24 / t)) + sbh * attn


def stage_params(spec: ModelSpec, tp: int, pp: int) -> float:
    """Parameters one TP rank of the first (busiest) pipeline stage holds."""
    layers = math.ceil(spec.layers / pp)
    embed = spec.embedding_params / (tp if spec.embedding_tp else 1)
    psi = layers * spec.layer_params / tp + embed + spec.position_params
    if pp == 1:
        psi += 2 * spec.hidden + (0 if spec.tied_embedding else embed)
    return psi


def activation_memory(spec: ModelSpec, lay: Layout, value_bytes: int = 2) -> float:
    """Activation bytes of the busiest pipeline stage (first: min(m, p) micro-batches in flight under
    1F1B; last: one, plus the fp32 logits and their gradient). ``value_bytes`` 4 (fp32 training)
    doubles the formula's 16-bit values (its 1-byte dropout masks too, a slight overestimate)."""
    b, t = lay.micro_batch, lay.tp
    layers = math.ceil(spec.layers / lay.pp)
    per_layer = layer_activation_bytes(spec, b, t, lay.sp, lay.recompute)
    recomputing = layer_activation_bytes(spec, b, t, lay.sp, "none") if lay.recompute == "full" else 0.0
    first = min(lay.micro_batches, lay.pp) * layers * per_layer + recomputing
    logits = 2 * 4 * spec.seq * b * spec.vocab / (t if spec.embedding_tp else 1)
    last = layers * per_layer + recomputing
    scale = value_bytes / 2
    return max(first * scale, last * scale + logits) if lay.pp > 1 else first * scale + logits
