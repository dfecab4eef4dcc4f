"""Pipeline parallelism: balanced stage splits, GPipe and 1F1B schedules.

    stages = pz.pipeline.split_sequential(model, num_stages=pp_group.size)
    pipe = pz.pipeline.Pipeline(stages[pp_group.rank], num_microbatches=8, schedule="1f1b", group=pp_group)
    loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.cross_entropy)
    pipe.stats  # max_inflight, busy/idle time, measured bubble vs (p - 1) / (m + p - 1)
"""
from .pipeline import Pipeline, PipelineStats
from .schedules import SCHEDULES, bubble_fraction, gpipe, one_f_one_b
from .split import StageInfo, balanced_cuts, layer_costs, split_sequential

__all__ = [
    "SCHEDULES",
    "Pipeline",
    "PipelineStats",
    "StageInfo",
    "balanced_cuts",
    "bubble_fraction",
    "gpipe",
    "layer_costs",
    "one_f_one_b",
    "split_sequential",
]
