"""ZeRO: sharded optimizer state (stage 1), gradients (2) and parameters (3)."""
from .memory import estimate_memory
from .optimizer import ZeroOptimizer
from .partition import FlatLayout, Piece, ShardInfo

__all__ = ["ZeroOptimizer", "estimate_memory", "FlatLayout", "Piece", "ShardInfo"]
