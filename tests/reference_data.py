"""Inputs shared by the collective tests (shm and the CUDA host-side simulator)."""
import torch


def make_input(op, dtype, size, rank, seed):
    """A reproducible pattern of (seed, rank, index), exact under the reduction `op`."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 17)
    if op == "prod":
        vals = (torch.tensor([1.0, 2.0, 0.5, -1.0], dtype=torch.float64) if dtype.is_floating_point
                else torch.tensor([1, 2, -1, 3], dtype=torch.int64))
        return vals[torch.randint(0, 4, (size,), generator=g)].to(dtype)
    if dtype.is_floating_point:
        # multiples of 1/64 up to 4 in magnitude: exact in every float dtype and
        # in fp32 sums; bf16 sums (8-bit significand) do need the final rounding
        return (torch.randint(-256, 257, (size,), generator=g, dtype=torch.int64).to(torch.float64) / 64).to(dtype)
    return torch.randint(-1000, 1001, (size,), generator=g, dtype=torch.int64).to(dtype)


def wire(dtype):
    """Accumulator (and ring wire) dtype: fp32 for the 16-bit floats, else the dtype itself."""
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def reference(inputs, op, dtype):
    """torch reduction over the stacked per-rank inputs, accumulated in wire(dtype), rounded once."""
    acc = wire(dtype)
    x = torch.stack([t.to(acc) for t in inputs])
    r = {"sum": lambda: x.sum(0, dtype=acc), "avg": lambda: x.sum(0, dtype=acc) / len(inputs),
         "max": lambda: x.amax(0), "min": lambda: x.amin(0), "prod": lambda: x.prod(0, dtype=acc)}[op]()
    return r.to(dtype)
