"""The "nccl" backend: one NCCL communicator per group, one GPU per rank (cuda:LOCAL_RANK; ranks share
GPUs on pyzero's test NCCL, see nccl_device).

Streams, as torch.distributed with NCCL: a synchronous call is enqueued on the
current stream of its buffers and returns without waiting for the GPU. With
``async_op=True`` it runs on the group's own stream after the work already
queued on the current one; ``work.wait()`` makes the then-current stream wait
for it (no host block) and ``work.synchronize()`` blocks the host. The handle,
and the group until the work completes, keep the buffers alive.

Timeouts: a watchdog aborts the communicator when an operation has not finished
``timeout`` seconds after it was issued; the next call, ``wait()`` or
``synchronize()`` raises CollectiveTimeout. With ``blocking_wait`` (option or
PYZERO_NCCL_BLOCKING_WAIT=1) a synchronous call waits on the host, so the call
itself raises.
"""
from __future__ import annotations

import os

import torch

from .. import _C, _loader
from ..backend import GroupSetup
from .cuda_buffers import CudaCommBackend


def nccl_device(local_rank: int, device_count: int | None = None, test_nccl: bool | None = None) -> int:
    """This rank's GPU for the nccl backend: cuda:LOCAL_RANK (NCCL needs one GPU per rank), or
    cuda:0 when the process sees one GPU (per-rank CUDA_VISIBLE_DEVICES).

    With pyzero's test NCCL (``pz.nccl_library()["test"]``: PYZERO_NCCL_ROOT names a library that
    exports ``pyzeroTestNccl``), ranks may share GPUs: rank LOCAL_RANK runs on
    cuda:(LOCAL_RANK % count), so more ranks than GPUs can be started on one host. `device_count` and
    `test_nccl` default to what this process sees and loaded."""
    count = _C.cuda_device_count() if device_count is None else device_count
    if test_nccl is None:
        test_nccl = _loader.test_nccl_loaded()
    if count == 0:
        raise RuntimeError("backend='nccl' needs a CUDA GPU, but this process sees none (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use backend='shm' for CPU "
                           "processes")
    if local_rank < 0:
        raise ValueError(f"LOCAL_RANK={local_rank}: expected a rank >= 0")
    if count == 1:
        device = 0  # one visible GPU: also a launcher that gives each rank its own CUDA_VISIBLE_DEVICES
    elif local_rank < count:
        device = local_rank
    elif test_nccl:
        device = local_rank % count  # the test NCCL lets ranks share a GPU
    else:
        raise RuntimeError(f"LOCAL_RANK={local_rank}, but this process sees {count} GPU(s): the nccl backend puts "
                           f"each rank on cuda:LOCAL_RANK, one GPU per rank; start at most {count} ranks per host "
                           "(or give each rank one GPU with CUDA_VISIBLE_DEVICES)")
    if device_count is None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    return device


class NcclBackend(CudaCommBackend):
    name = "nccl"

    @classmethod
    def setup_process(cls, local_rank: int) -> int:
        return nccl_device(local_rank)

    @classmethod
    def create(cls, setup: GroupSetup) -> "NcclBackend":
        """Group rank 0 makes the NCCL unique id; the store hands it on."""
        o = setup.options
        settings = (o.get("slice_bytes", 4 << 20, "PYZERO_NCCL_SLICE_KB", kib=True),
                    o.get("oneshot_bytes", 256 << 10, "PYZERO_NCCL_ONESHOT_KB", kib=True),
                    o.get("blocking_wait", False, "PYZERO_NCCL_BLOCKING_WAIT"))
        key = setup.key + "/nccl_id"
        if setup.rank == 0:
            setup.store.set(key, _C.nccl_unique_id())
        uid = setup.get(key)
        # Every rank has read its settings before any enters ncclCommInitRank, which waits for all of them
        # with no deadline: a rank that failed before it would leave the others there.
        setup.barrier("nccl/ready")
        comm = _C.NcclComm(uid, setup.rank, setup.size, setup.device, setup.timeout, *settings)
        return cls(comm, setup.device)

    def all_reduce(self, b, op, algo, async_op):
        return self.comm.all_reduce(b.ptr, b.numel, b.code, op, algo, b.stream, async_op)

    def send(self, b, peer, async_op):
        return self.comm.send(b.ptr, b.numel, b.code, peer, b.stream, async_op)

    def recv(self, b, peer, async_op):
        return self.comm.recv(b.ptr, b.numel, b.code, peer, b.stream, async_op)

    def batch_p2p(self, ops, async_op):
        stream = ops[0][0].stream  # the caller's current stream (one for all buffers)
        return self.comm.batch_p2p([(b.ptr, b.numel, b.code, peer, is_send) for b, peer, is_send in ops], stream,
                                   async_op)
