"""CUDA buffers for the GPU backends: torch CUDA tensors and __cuda_array_interface__ arrays.

A buffer is a torch CUDA tensor or any object with ``__cuda_array_interface__``
(cupy arrays; ``pip install pyzero[cupy]``); both become a
:class:`pyzero.backend.Buffer` whose stream is the one its data is ordered on:
torch's current stream for a tensor; for an array, the stream its interface
names, else the legacy default stream.
"""
from __future__ import annotations

import math
import sys

import torch

from .. import _C
from ..backend import Backend, Buffer, DTYPE_CODES, Work, check_contiguous, tensor_code

# torch's query of a device's current stream as a cudaStream_t, without the Stream object that
# torch.cuda.current_stream builds (about 1-2 us of every call's host time; the generated code of
# torch.compile calls it the same way). Not in CPU builds of torch.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def current_raw_stream(device: int) -> int:
    """The current stream of cuda:`device` (CUDA initialised: a tensor there exists) as an int."""
    if _RAW_STREAM is not None:
        return _RAW_STREAM(device)
    return torch.cuda.current_stream(device).cuda_stream


# __cuda_array_interface__ typestr (numpy's, without the byte order) -> pyzero dtype code.
# numpy has no bfloat16, so bfloat16 travels as torch tensors only.
TYPESTR_CODES = {"f4": DTYPE_CODES["float32"], "f2": DTYPE_CODES["float16"], "f8": DTYPE_CODES["float64"],
                 "i4": DTYPE_CODES["int32"], "i8": DTYPE_CODES["int64"]}


def parse_cuda_array_interface(obj, arg: str, writable: bool = True) -> Buffer:
    """A Buffer from ``obj.__cuda_array_interface__`` (version 0-3); raises naming `arg`."""
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
    return Buffer(ptr, numel, itemsize, code, stream or 0, "array")


def device_of(ptr: int) -> int:
    """CUDA device of a pointer, -1 for host memory (replaced in tests that run without a GPU)."""
    return _C.cuda_pointer_device(ptr)


def as_buffer(x, arg: str, device: int, writable: bool = True, backend: str = "nccl") -> Buffer:
    """Validate `x` for a group of `backend` on cuda:`device`; errors name the argument."""
    if isinstance(x, torch.Tensor):
        code = tensor_code(x, arg)
        if x.device.type != "cuda":
            raise ValueError(f"{arg}: the {backend} backend takes CUDA tensors (or arrays with "
                             f"__cuda_array_interface__), got a tensor on {x.device}; move it with .to('cuda:{device}')")
        if x.device.index != device:
            raise ValueError(f"{arg}: the tensor is on {x.device}, but this rank's GPU is cuda:{device} "
                             f"(LOCAL_RANK={device}; NCCL uses one GPU per rank): move it with .to('cuda:{device}')")
        check_contiguous(x, arg)
        return Buffer(x.data_ptr(), x.numel(), x.element_size(), code, current_raw_stream(device), "torch")
    if hasattr(x, "__cuda_array_interface__"):
        b = parse_cuda_array_interface(x, arg, writable)
        if b.numel:
            dev = device_of(b.ptr)
            if dev < 0:
                raise ValueError(f"{arg}: the array's memory is not on a CUDA device")
            if dev != device:
                raise ValueError(f"{arg}: the array is on cuda:{dev}, but this rank's GPU is cuda:{device} "
                                 f"(LOCAL_RANK={device}; NCCL uses one GPU per rank)")
        return b
    raise TypeError(f"{arg}: expected a CUDA torch.Tensor or an array with __cuda_array_interface__ (cupy), got "
                    f"{type(x).__name__}")


def current_stream_fn(b: Buffer, device: int):
    """What wait() orders: the current stream at wait time, of the library the buffer came from."""
    if b.kind == "torch":
        return lambda: current_raw_stream(device)
    cupy = sys.modules.get("cupy")
    if cupy is not None:
        return lambda: cupy.cuda.get_current_stream().ptr
    return lambda: b.stream


def torch_stream(device: int) -> int:
    return torch.cuda.current_stream(device).cuda_stream if torch.cuda.is_available() else 0


class CudaCommBackend(Backend):
    """What the GPU backends (nccl, ipc) share: a C++ communicator `comm` on cuda:`device` whose calls
    take device pointers and the caller's stream, and the buffers and Work handles around it."""

    def __init__(self, comm, device: int):
        self.comm = comm
        self.device = device

    def buffer(self, x, arg, writable=True) -> Buffer:
        return as_buffer(x, arg, self.device, writable, self.name)

    def work(self, raw, keep, b):
        if b is None:  # a barrier: ordered on torch's current stream
            kind = "torch" if torch.cuda.is_available() else "array"
            b = Buffer(0, 0, 1, 0, torch_stream(self.device), kind)
        return Work(raw, keep, current_stream_fn(b, self.device))

    def reduce_scatter(self, out, inp, counts, op, algo, async_op):
        return self.comm.reduce_scatter(out.ptr, inp.ptr, counts, out.code, op, algo, out.stream, async_op)

    def all_gather(self, out, inp, counts, algo, async_op):
        return self.comm.all_gather(out.ptr, inp.ptr, counts, out.code, algo, out.stream, async_op)

    def broadcast(self, b, root, algo, async_op):
        return self.comm.broadcast(b.ptr, b.numel, b.code, root, algo, b.stream, async_op)

    def barrier(self, async_op):
        return self.comm.barrier(torch_stream(self.device), async_op)

    def stats(self, reset):
        return self.comm.stats(reset)

    def close(self):
        self.comm.close()
