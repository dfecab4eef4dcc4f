"""Loss scaling for fp16 training, on the optimizer (as DeepSpeed's fp16 config does).

``ZeroOptimizer(..., loss_scale="dynamic")``: backward runs on ``opt.scale_loss(loss)``; before
clipping or stepping, the optimizer looks for inf/NaN in the reduced gradient shards of *every*
rank (one all-reduce of a flag), and either unscales them (scales are powers of two, so scaling
and unscaling are exact) or skips the step, zeroes the gradients and halves the scale. After
``growth_interval`` steps without overflow the scale doubles. The rules and defaults are
torch.amp.GradScaler's (init 2**16, growth 2, backoff 0.5, interval 2000, no floor: ``min_scale``
sets one). A number instead of "dynamic" is a static scale (an overflow still skips the step). A
step skipped where the scale cannot go down (static, or at ``min_scale``) warns: such steps repeat
until the gradients change, and training would stop without a word.
"""
from __future__ import annotations

import warnings

from ..checks import is_positive_finite, is_real


class LossScaler:
    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, dynamic: bool = True, min_scale: float = 0.0):
        for name, v in (("init_scale", init_scale), ("growth_factor", growth_factor)):
            if not is_positive_finite(v):
                raise ValueError(f"loss_scale: {name} must be a positive finite number, got {v!r}")
        if not (is_real(min_scale) and 0 <= min_scale < float("inf")):
            raise ValueError(f"loss_scale: min_scale must be a finite number >= 0, got {min_scale!r}")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"loss_scale: backoff_factor must be in (0, 1), got {backoff_factor!r}")
        if not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"loss_scale: growth_interval must be an int >= 1, got {growth_interval!r}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.dynamic, self.min_scale = growth_interval, dynamic, float(min_scale)
        self.good_steps = 0
        self.skipped = 0  # steps skipped for overflow, in total

    @classmethod
    def make(cls, spec):
        """None -> no scaling; "dynamic" -> defaults; a number -> static; a dict -> keyword arguments."""
        if spec is None:
            return None
        if spec == "dynamic":
            return cls()
        if isinstance(spec, dict):
            try:
                return cls(**spec)
            except TypeError as e:  # (an unknown key: the constructor's own words, without the argument's name)
                raise TypeError(f"loss_scale: {e}; the dict's keys are LossScaler arguments (init_scale, "
                                "growth_factor, backoff_factor, growth_interval, dynamic, min_scale)") from None
        if isinstance(spec, (int, float)) and not isinstance(spec, bool):
            return cls(init_scale=spec, dynamic=False)
        raise ValueError(f"loss_scale: expected None, 'dynamic', a positive number or a dict of LossScaler "
                         f"arguments, got {spec!r}")

    def update(self, overflow: bool) -> None:
        if overflow:
            self.skipped += 1
            self.good_steps = 0
            if self.dynamic and self.scale > self.min_scale:
                self.scale = max(self.min_scale, self.scale * self.backoff_factor)
            else:
                kind, fix = (("minimum", "lower min_scale") if self.dynamic
                             else ("static", "use loss_scale='dynamic' or a smaller scale"))
                warnings.warn(f"loss scaling: a step was skipped for inf/NaN gradients at the {kind} loss scale "
                              f"{self.scale:g}, which cannot go down; the next steps are skipped too until the "
                              f"gradients are finite ({fix}; opt.scaler.skipped counts them)", RuntimeWarning,
                              stacklevel=3)
            return
        self.good_steps += 1
        if self.dynamic and self.good_steps % self.growth_interval == 0:
            self.scale *= self.growth_factor

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "skipped": self.skipped}

    def load_state_dict(self, sd: dict) -> None:
        self.scale, self.good_steps, self.skipped = float(sd["scale"]), int(sd["good_steps"]), int(sd["skipped"])
