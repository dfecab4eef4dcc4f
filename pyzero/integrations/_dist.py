"""torch.distributed beside pyzero: the frameworks' own collectives (losses, metrics, barriers) on
torch's gloo (and NCCL on GPUs) over pyzero's store, so both share the job's one MASTER_PORT."""
from __future__ import annotations

import datetime

import torch.distributed as dist

from .. import comm


def init_torch(torch_backend: str | None = None) -> None:
    """Start torch.distributed on pyzero's store (pyzero started; nothing to do at world size 1).

    ``torch_backend``: default "gloo", or "cpu:gloo,cuda:nccl" when pyzero runs on GPUs. If
    torch.distributed is already up, it must describe the same job.
    """
    world, rank = comm.get_world_size(), comm.get_rank()
    if world == 1:
        return
    if dist.is_initialized():
        if (dist.get_world_size(), dist.get_rank()) != (world, rank):
            raise RuntimeError(f"init(): torch.distributed has rank {dist.get_rank()} of {dist.get_world_size()}, "
                               f"pyzero rank {rank} of {world}; both must describe the same job")
        return
    if torch_backend is None:
        torch_backend = "cpu:gloo,cuda:nccl" if comm.get_backend() in ("nccl", "ipc") else "gloo"
    dist.init_process_group(torch_backend, store=dist.PrefixStore("torch/", comm.get_store()), rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=comm.get_timeout()))
