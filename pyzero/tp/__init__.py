"""Tensor parallelism: Megatron column/row-parallel linear layers, sequence
parallelism, and ring-overlapped all-gather+matmul / matmul+reduce-scatter.

    col = pz.tp.ColumnParallelLinear(1024, 4096, sequence_parallel=True, group=tp_group)
    row = pz.tp.RowParallelLinear(4096, 1024, sequence_parallel=True, group=tp_group)
    y = row(F.gelu(col(x)))           # x, y: this rank's (seq/n, batch, 1024)
"""
from .block import ParallelTransformerBlock, TransformerBlock, causal_attention
from .communications import (
    copy_to_tp,
    gather_from_sp,
    gather_from_tp,
    reduce_from_tp,
    reduce_scatter_to_sp,
    scatter_to_sp,
    scatter_to_tp,
)
from .layers import ColumnParallelLinear, RowParallelLinear
from .overlap import all_gather_matmul, linear_async_all_reduce, matmul_reduce_scatter

__all__ = [
    "ColumnParallelLinear",
    "ParallelTransformerBlock",
    "RowParallelLinear",
    "TransformerBlock",
    "all_gather_matmul",
    "causal_attention",
    "copy_to_tp",
    "gather_from_sp",
    "gather_from_tp",
    "linear_async_all_reduce",
    "matmul_reduce_scatter",
    "reduce_from_tp",
    "reduce_scatter_to_sp",
    "scatter_to_sp",
    "scatter_to_tp",
]
