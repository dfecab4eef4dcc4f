"""ZeRO: sharded optimizer state (stage 1), gradients (2) and parameters (3)."""
from .memory import estimate_memory
from . import stage3, stages  # noqa: F401  (register stages 1-3 with ZeroOptimizer)
from .optimizer import (CollectiveCall, ShardedParametersWarning, ZeroOptimizer, gathered_parameters, model_state,
                        owner, register_stage)
from .partition import FlatLayout, Piece, ShardInfo
from . import clip, module_grads

clip.install()  # torch.nn.utils.clip_grad_norm_ of a ZeroOptimizer's parameters clips all its shards
module_grads.install()  # model.zero_grad() of a ZeroOptimizer's model clears its gradient shards

__all__ = ["ZeroOptimizer", "CollectiveCall", "owner", "gathered_parameters", "register_stage", "estimate_memory",
           "FlatLayout", "Piece", "ShardInfo", "ShardedParametersWarning", "model_state"]
