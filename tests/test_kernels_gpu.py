"""CUDA reduce kernels against torch, for every dtype and op (run by scripts/gpu_check.sh)."""
import pytest
import torch

from pyzero import _C
from pyzero.comm import _DTYPES, _OPS

pytestmark = pytest.mark.gpu

DTYPES = list(_DTYPES)


def _reference(a, b, op):
    """Accumulate in fp32 (fp64 for fp64, int64 for ints) and round once, as the kernels promise."""
    wide = torch.float64 if a.dtype == torch.float64 else (torch.int64 if not a.is_floating_point() else torch.float32)
    x, y = a.to(wide), b.to(wide)
    r = {"sum": x + y, "avg": (x + y) / 2, "max": torch.maximum(x, y), "min": torch.minimum(x, y), "prod": x * y}[op]
    return r.to(a.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("n,offset", [(1, 0), (1000003, 0), (4099, 1), (1 << 20, 3)])
def test_reduce2_matches_torch(dtype, op, n, offset):
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg is for floating-point dtypes")
    g = torch.Generator(device="cpu").manual_seed(n + offset)
    a = torch.randint(-8, 9, (n + offset,), generator=g).to(dtype).cuda()[offset:]
    b = torch.randint(-8, 9, (n + offset,), generator=g).to(dtype).cuda()[offset:]
    if dtype.is_floating_point:
        a, b = a * 0.37, b * 1.13  # non-trivial rounding for the 16-bit types
    out = torch.empty(n + offset, dtype=dtype, device="cuda")[offset:]
    nranks = 2
    _C.cuda_reduce2(a.data_ptr(), b.data_ptr(), out.data_ptr(), n, _DTYPES[dtype], _OPS[op], nranks,
                    torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), _reference(a, b, op).cpu())
