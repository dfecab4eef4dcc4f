"""Automatic parallelism planning: choose dp x tp x pp x ZeRO stage (and micro-batches,
sequence parallelism, recomputation, offload) for a model on a cluster.

    plan = pz.plan(model_or_spec, world=64, gpus_per_host=8, device_memory=80e9, flops=150e12)
    print(plan.table())
    pm = pz.parallelize(model, plan)         # apply it (GPT-style models)

cost.py holds the model and its first principles, search.py the search,
apply.py `parallelize`, cli.py `pyzero-plan`, validate.py the measured-vs-predicted runs.
"""
from __future__ import annotations

from .comm_model import Link, Table
from .cost import Cluster, Estimate, Layout, estimate, layer_activation_bytes
from .search import Plan, search
from .spec import ModelSpec, from_config, to_spec


def _tables(tables):
    if tables is None:
        return {}
    if isinstance(tables, dict) and "results" not in tables:
        unknown = set(tables) - {"intra", "inter"}
        if unknown:
            raise ValueError(f"tables: expected keys 'intra' and/or 'inter', got {sorted(unknown)}")
        return dict(tables)
    return {"intra": tables}


def plan(model_or_spec, world: int, gpus_per_host: int | None = None, device_memory: float = 80e9,
         tables=None, flops: float = 150e12, seq: int | None = None, batch: int | None = None,
         stages=(0, 1, 2, 3), recompute=("none", "selective", "full"), offload=("none", "cpu"),
         shape: dict | None = None, **cluster) -> Plan:
    """Search the layouts of ``model_or_spec`` on ``world`` devices; returns a Plan (``.best``, ``.table()``).

    ``model_or_spec``: a torch module (pyzero's bench GPT, HF GPT-2), an HF-style
    config, a ModelSpec or a dict of its fields. ``device_memory`` bytes per
    device; ``flops`` achieved FLOP/s per device; ``tables``: a collectives
    JSON (path or dict, intra-host links) or {"intra": ..., "inter": ...};
    a kind without a table uses ``intra=``/``inter=`` bandwidths (bytes/s) from
    ``cluster``, which also takes the other Cluster fields (mem_bw, reserved, ...).
    ``shape``: layers/hidden/heads/vocab for a module whose walk cannot find them.
    """
    spec = to_spec(model_or_spec, seq=seq, batch=batch, **(shape or {}))
    links = {**{k: v for k, v in cluster.items() if k in ("intra", "inter")}, **_tables(tables)}
    rest = {k: v for k, v in cluster.items() if k not in ("intra", "inter")}
    per_host = world if gpus_per_host is None else gpus_per_host
    c = Cluster(world=world, gpus_per_host=per_host, device_memory=device_memory, flops=flops,
                **links, **rest)
    return search(spec, c, stages=stages, recompute=recompute, offload=offload)


from .apply import ParallelGPT, parallelize  # noqa: E402

__all__ = ["Cluster", "Estimate", "Layout", "Link", "ModelSpec", "ParallelGPT", "Plan", "Table", "estimate",
           "from_config", "layer_activation_bytes", "parallelize", "plan", "search", "to_spec"]
