"""The "ipc" backend: pyzero's own GPU collectives over CUDA IPC, for the processes of one host.

Every rank registers one device buffer and maps every peer's (the handles go through the store); one
kernel per call reads and writes the peers' memory directly (csrc/ipc_transport.h, the protocol in
csrc/ipc_protocol.h). Several processes may share one GPU: with fewer visible GPUs than local ranks,
rank r uses cuda:(LOCAL_RANK % count). Streams and Work as the nccl backend (a call is ordered on the
current stream, async_op on the group's own, work.wait() makes the current stream wait).

all_reduce (one-shot up to ``oneshot_bytes`` per rank or at 2 ranks, two-shot above), reduce_scatter,
all_gather (uneven counts), broadcast and barrier; sizes above the registered area run in pieces.

Point-to-point (send, recv, isend, irecv, batch_isend_irecv; csrc/ipc_p2p.h): a channel per ordered
pair in the receiver's registered buffer (option ``p2p_bytes``, 4 MiB each; a rank holds n - 1), one
kernel per call or batch. As with NCCL, a send completes only once its receive is posted, and ranks
that send to each other at once must post those sends and receives in one batch_isend_irecv (at most
MAX_BATCH operations). A send and its receive must agree in size and dtype: otherwise both ranks raise
CollectiveError at their next host wait and the message is skipped. A send whose receive never comes
raises CollectiveTimeout naming the peer. ``algo="ring"`` runs the four ring collectives as the nccl
backend's ring schedule over this point-to-point.
"""
from __future__ import annotations

import os
from collections import Counter

import torch

from .. import _C
from ..backend import GroupSetup
from . import cuda_buffers
from .cuda_buffers import CudaCommBackend

MAX_BATCH = 32  # operations of one batch_isend_irecv (one kernel; csrc/ipc_p2p.h kIpcMaxP2POps)


def ipc_device(local_rank: int, device_count: int | None = None) -> int:
    """This rank's GPU: cuda:LOCAL_RANK with a GPU per rank, else shared, cuda:(LOCAL_RANK % count)."""
    count = _C.cuda_device_count() if device_count is None else device_count
    if count == 0:
        raise RuntimeError("backend='ipc' needs a CUDA GPU, but this process sees none (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use backend='shm' for CPU "
                           "processes")
    device = local_rank % count
    if device_count is None and torch.cuda.is_available():
        torch.cuda.set_device(device)
    return device


def gpu_sharing(gpu_ids) -> int:
    """The most ranks on one physical GPU, given each rank's GPU identity: what the ipc kernels size their
    blocks by (_C.ipc_blocks), the same on every rank."""
    return max(Counter(gpu_ids).values(), default=1)


def group_blocks(sms_per_rank, sharing: int) -> int:
    """The blocks of every ipc kernel of a group: the smallest _C.ipc_blocks over its ranks' GPUs (SM counts),
    so every rank runs the same (csrc/ipc_protocol.h [Note: ipc calls apart])."""
    return min((_C.ipc_blocks(int(sms), sharing) for sms in sms_per_rank), default=1)


def _gpu_sms(device: int) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _gpu_id(device: int) -> str:
    props = torch.cuda.get_device_properties(device)
    uuid = getattr(props, "uuid", None)
    return str(uuid) if uuid is not None else f"{props.name}/{getattr(props, 'pci_bus_id', device)}"


class IpcBackend(CudaCommBackend):
    name = "ipc"
    has_out_of_place_all_reduce = True

    @classmethod
    def setup_process(cls, local_rank: int) -> int:
        return ipc_device(local_rank)

    @classmethod
    def create(cls, setup: GroupSetup) -> "IpcBackend":
        """Each rank publishes its buffer's IPC handle; everyone maps everyone's."""
        o = setup.options
        # How many ranks share each GPU sizes every kernel (their blocks must all be resident at once), and
        # every rank's kernels run the same blocks: the group's smallest (GPUs of different SM counts).
        setup.store.set(f"{setup.key}/ipc/gpu/{setup.rank}", _gpu_id(setup.device))
        setup.store.set(f"{setup.key}/ipc/sms/{setup.rank}", str(_gpu_sms(setup.device)))
        sharing = gpu_sharing(setup.get(f"{setup.key}/ipc/gpu/{r}") for r in range(setup.size))
        blocks = group_blocks((int(setup.get(f"{setup.key}/ipc/sms/{r}")) for r in range(setup.size)), sharing)
        comm = _C.IpcComm(setup.rank, setup.size, setup.device, setup.timeout,
                          o.get("slice_bytes", 32 << 20, "PYZERO_IPC_AREA_KB", kib=True),
                          o.get("oneshot_bytes", 256 << 10, "PYZERO_IPC_ONESHOT_KB", kib=True),
                          o.get("p2p_bytes", 4 << 20, "PYZERO_IPC_P2P_KB", kib=True),
                          o.get("depth", 4, "PYZERO_IPC_DEPTH"), sharing,
                          o.get("system_scope", False, "PYZERO_IPC_SYSTEM_SCOPE"), blocks)
        setup.store.set(f"{setup.key}/ipc/{setup.rank}", comm.handle())
        handles = [setup.get(f"{setup.key}/ipc/{r}") for r in range(setup.size)]
        comm.connect(handles)
        setup.barrier("ipc/mapped")  # all mapped before use
        return cls(comm, setup.device)

    def all_reduce(self, b, op, algo, async_op, inp=None):
        return self.comm.all_reduce(b.ptr, 0 if inp is None else inp.ptr, b.numel, b.code, op, algo, b.stream,
                                    async_op)

    def send(self, b, peer, async_op):
        return self.comm.send(b.ptr, b.numel, b.code, peer, b.stream, async_op)

    def recv(self, b, peer, async_op):
        return self.comm.recv(b.ptr, b.numel, b.code, peer, b.stream, async_op)

    def batch_p2p(self, ops, async_op):
        if len(ops) > MAX_BATCH:
            raise ValueError(f"ops: the ipc backend runs at most {MAX_BATCH} operations in one batch_isend_irecv "
                             f"(one kernel), got {len(ops)}; split it into batches that each pair their sends "
                             "with the receives they wait on")
        stream = ops[0][0].stream  # the caller's current stream (one for all buffers)
        return self.comm.batch_p2p([(b.ptr, b.numel, b.code, peer, is_send) for b, peer, is_send in ops], stream,
                                   async_op)

    def close(self):
        # Peers read this rank's area and write its flags: free it only once every rank got here
        # (a barrier kernel runs after each rank's earlier ones). It is a closing barrier: a peer
        # still in another call learns that this rank left. A broken group skips it.
        try:
            self.comm.barrier(cuda_buffers.torch_stream(self.device), False, closing=True)
        except Exception:  # noqa: BLE001 - the group failed before: nothing more will run
            pass
        self.comm.close()
