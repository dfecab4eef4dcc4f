"""The GPU side of pyzero.comm: the "nccl" backend's buffers, streams and work handles.

comm.py imports this module only for groups that live on a GPU, so the shm path
pays one attribute check per call. A buffer is a torch CUDA tensor or any object
with ``__cuda_array_interface__`` (cupy arrays; ``pip install pyzero[cupy]``);
both become a :class:`DeviceBuffer` (pointer, size, dtype code, stream).

Streams, as torch.distributed with NCCL: a synchronous call is enqueued on the
current stream of its buffers (torch's current stream for a tensor; for an
array, the stream its interface names, else the legacy default stream) and
returns without waiting for the GPU. With ``async_op=True`` it runs on the
group's own stream after the work already queued on the current one;
``work.wait()`` makes the then-current stream wait for it (no host block) and
``work.synchronize()`` blocks the host. The handle, and the group until the work
completes, keep the buffers alive.

Timeouts: a watchdog aborts the communicator when an operation has not finished
``timeout`` seconds after it was issued; the next call, ``wait()`` or
``synchronize()`` raises CollectiveTimeout. With PYZERO_NCCL_BLOCKING_WAIT=1 a
synchronous call waits on the host, so the call itself raises.
"""
from __future__ import annotations

import math
import os
import sys
from typing import NamedTuple

import torch

from . import _C
from . import comm as _comm

# NCCL transport settings (csrc/nccl_transport.h); env variables for tuning.
NCCL_SLICE_BYTES = int(os.environ.get("PYZERO_NCCL_SLICE_KB", "4096")) << 10
NCCL_ONESHOT_BYTES = int(os.environ.get("PYZERO_NCCL_ONESHOT_KB", "256")) << 10
NCCL_BLOCKING_WAIT = os.environ.get("PYZERO_NCCL_BLOCKING_WAIT", "0").strip().lower() in ("1", "true", "yes")

DTYPE_NAMES = {0: "float32", 1: "float16", 2: "bfloat16", 3: "float64", 4: "int32", 5: "int64"}
# __cuda_array_interface__ typestr (numpy's, without the byte order) -> pyzero dtype code.
# numpy has no bfloat16, so bfloat16 travels as torch tensors only.
TYPESTR_CODES = {"f4": 0, "f2": 1, "f8": 3, "i4": 4, "i8": 5}


class DeviceBuffer(NamedTuple):
    ptr: int
    numel: int
    itemsize: int
    code: int  # pyzero dtype code (comm._DTYPES)
    stream: int  # the stream the data is ordered on (a cudaStream_t handle; 0: legacy default)
    kind: str  # "torch" or "array"

    @property
    def dtype(self) -> str:
        return DTYPE_NAMES[self.code]


# ---------------------------------------------------------------------------
# Set-up


def nccl_device(local_rank: int, device_count: int | None = None) -> int:
    """This rank's GPU for the nccl backend: cuda:LOCAL_RANK (NCCL needs one GPU per rank)."""
    count = _C.cuda_device_count() if device_count is None else device_count
    if count == 0:
        raise RuntimeError("backend='nccl' needs a CUDA GPU, but this process sees none (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); use backend='shm' for CPU "
                           "processes")
    if not 0 <= local_rank < count:
        raise RuntimeError(f"LOCAL_RANK={local_rank}, but this process sees {count} GPU(s): the nccl backend puts "
                           f"each rank on cuda:LOCAL_RANK, one GPU per rank; start at most {count} ranks per host")
    if device_count is None and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
    return local_rank


def make_comm(store, gid: int, me: int, n: int, device: int, timeout: float):
    """This rank's NCCL communicator for group `gid`: group rank 0 makes the unique id, the store hands it on."""
    key = f"pz/g{gid}/nccl_id"
    if me == 0:
        store.set(key, _C.nccl_unique_id())
    uid = store.get(key)
    return _C.NcclComm(uid, me, n, device, timeout, NCCL_SLICE_BYTES, NCCL_ONESHOT_BYTES, NCCL_BLOCKING_WAIT)


# ---------------------------------------------------------------------------
# Buffers


def parse_cuda_array_interface(obj, arg: str, writable: bool = True) -> DeviceBuffer:
    """A DeviceBuffer from ``obj.__cuda_array_interface__`` (version 0-3); raises naming `arg`."""
    cai = getattr(obj, "__cuda_array_interface__", None)
    if not isinstance(cai, dict):
        raise TypeError(f"{arg}: expected a CUDA torch.Tensor or an array with __cuda_array_interface__, got "
                        f"{type(obj).__name__}")
    shape, typestr, data = cai.get("shape"), cai.get("typestr"), cai.get("data")
    if (not isinstance(shape, tuple) or any(not isinstance(s, int) or s < 0 for s in shape)
            or not isinstance(typestr, str) or not isinstance(data, tuple) or len(data) != 2
            or not isinstance(data[0], int)):
        raise TypeError(f"{arg}: malformed __cuda_array_interface__ (needs shape, typestr and data=(ptr, readonly)): "
                        f"{cai!r}")
    code = TYPESTR_CODES.get(typestr[1:]) if typestr[:1] in "<=|" else None
    if code is None:
        raise TypeError(f"{arg}: array dtype {typestr!r} is not supported; expected float32, float16, float64, int32 "
                        "or int64 ('<f4', '<f2', '<f8', '<i4', '<i8'); pass bfloat16 as a torch tensor")
    if cai.get("mask") is not None:
        raise ValueError(f"{arg}: masked arrays are not supported")
    itemsize = int(typestr[2:])
    numel = math.prod(shape)
    strides = cai.get("strides")
    if strides is not None and numel > 0:
        expected = itemsize
        for size, stride in zip(reversed(shape), reversed(tuple(strides))):
            if size != 1 and stride != expected:
                raise ValueError(f"{arg}: expected a C-contiguous array, got strides {tuple(strides)} for shape "
                                 f"{shape} (copy it first, e.g. cupy.ascontiguousarray)")
            expected *= size
    ptr, readonly = data
    if writable and readonly:
        raise ValueError(f"{arg}: the array is read-only, but this call writes it")
    stream = cai.get("stream")
    if stream == 0:
        raise ValueError(f"{arg}: __cuda_array_interface__ stream 0 is ambiguous (the interface disallows it); "
                         "use 1 for the legacy default stream")
    if stream is not None and not isinstance(stream, int):
        raise TypeError(f"{arg}: __cuda_array_interface__ stream must be an int or None, got {stream!r}")
    return DeviceBuffer(ptr, numel, itemsize, code, stream or 0, "array")


def _device_of(ptr: int) -> int:
    """CUDA device of a pointer, -1 for host memory (replaced in tests that run without a GPU)."""
    return _C.cuda_pointer_device(ptr)


def as_buffer(x, arg: str, device: int, writable: bool = True) -> DeviceBuffer:
    """Validate `x` for a group on cuda:`device`; errors name the argument."""
    if isinstance(x, torch.Tensor):
        code = _comm._DTYPES.get(x.dtype)
        if code is None:
            raise TypeError(f"{arg}: dtype {x.dtype} is not supported; expected one of "
                            "float32, float16, bfloat16, float64, int32, int64")
        if x.device.type != "cuda":
            raise ValueError(f"{arg}: the nccl backend takes CUDA tensors (or arrays with __cuda_array_interface__), "
                             f"got a tensor on {x.device}; move it with .to('cuda:{device}')")
        if x.device.index != device:
            raise ValueError(f"{arg}: the tensor is on {x.device}, but this rank's GPU is cuda:{device} "
                             f"(LOCAL_RANK={device}; NCCL uses one GPU per rank): move it with .to('cuda:{device}')")
        if not x.is_contiguous():
            raise ValueError(f"{arg}: expected a contiguous tensor (call .contiguous() first)")
        stream = torch.cuda.current_stream(device).cuda_stream
        return DeviceBuffer(x.data_ptr(), x.numel(), x.element_size(), code, stream, "torch")
    if hasattr(x, "__cuda_array_interface__"):
        b = parse_cuda_array_interface(x, arg, writable)
        if b.numel:
            dev = _device_of(b.ptr)
            if dev < 0:
                raise ValueError(f"{arg}: the array's memory is not on a CUDA device")
            if dev != device:
                raise ValueError(f"{arg}: the array is on cuda:{dev}, but this rank's GPU is cuda:{device} "
                                 f"(LOCAL_RANK={device}; NCCL uses one GPU per rank)")
        return b
    raise TypeError(f"{arg}: expected a CUDA torch.Tensor or an array with __cuda_array_interface__ (cupy), got "
                    f"{type(x).__name__}")


def _current_stream_fn(b: DeviceBuffer, device: int):
    """What wait() orders: the current stream at wait time, of the library the buffer came from."""
    if b.kind == "torch":
        return lambda: torch.cuda.current_stream(device).cuda_stream
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return lambda: cupy.cuda.get_current_stream().ptr
    return lambda: b.stream


def _torch_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream if torch.cuda.is_available() else 0


def _check_alias(big: DeviceBuffer, small: DeviceBuffer, offset: int, big_arg: str, small_arg: str) -> None:
    """`small` must be disjoint from `big`, or exactly its chunk at `offset` (the in-place form)."""
    b0, b1 = big.ptr, big.ptr + big.numel * big.itemsize
    s0, s1 = small.ptr, small.ptr + small.numel * small.itemsize
    if s1 <= b0 or b1 <= s0 or small.numel == 0:
        return
    if s0 != b0 + offset * big.itemsize:
        raise ValueError(f"{small_arg} overlaps {big_arg}: expected either separate memory or, for the in-place "
                         f"form, {small_arg} to be exactly this rank's chunk of {big_arg}")


# ---------------------------------------------------------------------------
# Work


class CudaWork(_comm.Work):
    """In-flight GPU operation: wait() orders the current stream after it; buffers stay alive until then."""

    __slots__ = ("_stream",)

    def __init__(self, work, keep, stream_fn):
        super().__init__(work, keep)
        self._stream = stream_fn

    def wait(self) -> bool:
        self._work.wait(self._stream())
        self._keep = None
        return True

    def synchronize(self) -> bool:
        """Block the host until the operation finished on the GPU."""
        self._work.synchronize()
        self._keep = None
        return True


def _finish(g, result, keep, b: DeviceBuffer):
    if result is None:
        return None
    work = CudaWork(result, keep, _current_stream_fn(b, g.device))
    g._pending = [w for w in g._pending if w._keep is not None and not w._work.is_completed()]
    g._pending.append(work)
    return work


# ---------------------------------------------------------------------------
# Collectives (called by comm.py for GPU groups, after it resolved the group)


def all_reduce(g, t, op, async_op, algo):
    b = as_buffer(t, "tensor", g.device)
    opc = _comm._check_op(op, b.code, b.dtype)
    res = g.comm().all_reduce(b.ptr, b.numel, b.code, opc, _comm._check_algo(algo), b.stream, bool(async_op))
    return _finish(g, res, (t,), b)


def _counts(counts, n, me, whole: DeviceBuffer, part: DeviceBuffer, whole_arg: str, part_arg: str):
    """Per-rank counts of a reduce_scatter/all_gather, checked like comm.py does for CPU tensors."""
    if counts is None:
        if whole.numel != n * part.numel:
            raise ValueError(f"{whole_arg}: expected {n} x {part_arg}.numel() = {n * part.numel} elements, got "
                             f"{whole.numel} (pass counts= for uneven chunks)")
        return [part.numel] * n
    counts = _comm._check_counts(counts, n, whole.numel, whole_arg)
    if counts[me] != part.numel:
        raise ValueError(f"{part_arg}: expected counts[{me}]={counts[me]} elements for this rank, got {part.numel}")
    return counts


def reduce_scatter(g, out, inp, op, counts, async_op, algo):
    bo = as_buffer(out, "out", g.device)
    bi = as_buffer(inp, "inp", g.device, writable=False)
    if bi.code != bo.code:
        raise TypeError(f"inp: dtype {bi.dtype} does not match out's {bo.dtype}")
    opc = _comm._check_op(op, bo.code, bo.dtype)
    comm, n, me = g.comm(), g.size, g.rank
    counts = _counts(counts, n, me, bi, bo, "inp", "out")
    _check_alias(bi, bo, sum(counts[:me]), "inp", "out")
    res = comm.reduce_scatter(bo.ptr, bi.ptr, counts, bo.code, opc, _comm._check_algo(algo), bo.stream,
                              bool(async_op))
    return _finish(g, res, (out, inp), bo)


def all_gather(g, out, inp, counts, async_op, algo):
    bo = as_buffer(out, "out", g.device)
    bi = as_buffer(inp, "inp", g.device, writable=False)
    if bi.code != bo.code:
        raise TypeError(f"inp: dtype {bi.dtype} does not match out's {bo.dtype}")
    comm, n, me = g.comm(), g.size, g.rank
    counts = _counts(counts, n, me, bo, bi, "out", "inp")
    _check_alias(bo, bi, sum(counts[:me]), "out", "inp")
    res = comm.all_gather(bo.ptr, bi.ptr, counts, bo.code, _comm._check_algo(algo), bo.stream, bool(async_op))
    return _finish(g, res, (out, inp), bo)


def broadcast(g, t, src, async_op, algo):
    b = as_buffer(t, "tensor", g.device)
    root = g.group_rank(src, "src")
    res = g.comm().broadcast(b.ptr, b.numel, b.code, root, _comm._check_algo(algo), b.stream, bool(async_op))
    return _finish(g, res, (t,), b)


def barrier(g, async_op):
    stream = _torch_stream(g.device)
    res = g.comm().barrier(stream, bool(async_op))
    return _finish(g, res, (), DeviceBuffer(0, 0, 1, 0, stream, "torch" if torch.cuda.is_available() else "array"))


def send(g, t, dst, async_op):
    b = as_buffer(t, "tensor", g.device, writable=False)
    peer = g.group_rank(dst, "dst")
    if peer == g.rank:
        raise ValueError(f"dst={dst}: cannot send to this rank itself")
    return _finish(g, g.comm().send(b.ptr, b.numel, b.code, peer, b.stream, bool(async_op)), (t,), b)


def recv(g, t, src, async_op):
    b = as_buffer(t, "tensor", g.device)
    peer = g.group_rank(src, "src")
    if peer == g.rank:
        raise ValueError(f"src={src}: cannot receive from this rank itself")
    return _finish(g, g.comm().recv(b.ptr, b.numel, b.code, peer, b.stream, bool(async_op)), (t,), b)
