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
