"""CUDA reduce kernels against torch, for every dtype and op (run by scripts/gpu_check.sh)."""
import pytest
import torch

from pyzero import _C
from pyzero.backend import DTYPES as _DTYPES, OPS as _OPS

pytestmark = pytest.mark.gpu

DTYPES = list(_DTYPES)


def _true_div(x, d):
    """x / d as the kernels compute it: an IEEE division per element, on the CPU. (A CUDA tensor divided
    by a Python number is computed by torch as x * (1/d), which differs in the last bit.)"""
    x = x.cpu()
    return x / torch.full_like(x, d)


def _reference(a, b, op, nranks):
    """Accumulate in fp32 (fp64 for fp64, int64 for ints) and round once, as the kernels promise (on the CPU)."""
    wide = torch.float64 if a.dtype == torch.float64 else (torch.int64 if not a.is_floating_point() else torch.float32)
    x, y = a.cpu().to(wide), b.cpu().to(wide)
    r = {"sum": x + y, "avg": x + y, "max": torch.maximum(x, y), "min": torch.minimum(x, y), "prod": x * y}[op]
    return (_true_div(r, nranks) if op == "avg" else r).to(a.dtype)


def _on_gpu_at(values, offset):
    """`values` on the GPU starting `offset` elements into a fresh allocation (a misaligned pointer for
    offset > 0: the kernels' unaligned head must be exercised for every dtype)."""
    buf = torch.empty(values.numel() + offset, dtype=values.dtype, device="cuda")
    buf[offset:].copy_(values)
    return buf[offset:]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("n,offset", [(1, 0), (1000003, 0), (4099, 1), (1 << 20, 3)])
def test_reduce2_matches_torch(dtype, op, n, offset):
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg is for floating-point dtypes")
    a = _data(n, offset, dtype, 2 * (n + offset))
    b = _data(n, offset, dtype, 2 * (n + offset) + 1, scale=1.13)
    assert a.data_ptr() % 16 == (offset * a.element_size()) % 16
    out = torch.empty(n + offset, dtype=dtype, device="cuda")[offset:]
    nranks = 3  # avg divides by 3: not a power of two, so division and multiplication by 1/3 differ
    _C.cuda_reduce2(a.data_ptr(), b.data_ptr(), out.data_ptr(), n, _DTYPES[dtype], _OPS[op], nranks,
                    torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), _reference(a, b, op, nranks))


# ---------------------------------------------------------------------------
# The ring's wire kernels, copy, and the one-shot n-input reduce


def _acc(dtype):
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


def _combine(op, x, y):
    return {"sum": x + y, "avg": x + y, "max": torch.maximum(x, y), "min": torch.minimum(x, y), "prod": x * y}[op]


def _data(n, offset, dtype, seed, lo=-8, hi=9, scale=0.37):
    """n seeded values of dtype (floats scaled for non-trivial rounding in the 16-bit types), on the GPU
    `offset` elements into their allocation."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    x = torch.randint(lo, hi, (n,), generator=g).to(dtype)
    if dtype.is_floating_point:
        x = x * scale
    return _on_gpu_at(x, offset)


SIZES = [(1, 0), (4099, 1), (1 << 20, 0), ((1 << 20) + 5, 3)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("n,offset", SIZES)
def test_copy_and_pack_wire(dtype, n, offset):
    src = _data(n, offset, dtype, n)
    dst = torch.empty(n + offset, dtype=dtype, device="cuda")[offset:]
    stream = torch.cuda.current_stream().cuda_stream
    _C.cuda_copy(src.data_ptr(), dst.data_ptr(), n, _DTYPES[dtype], stream)
    wire = torch.empty(n + offset, dtype=_acc(dtype), device="cuda")[offset:]
    _C.cuda_pack_wire(src.data_ptr(), wire.data_ptr(), n, _DTYPES[dtype], stream)
    torch.cuda.synchronize()
    assert torch.equal(dst.cpu(), src.cpu())
    assert torch.equal(wire.cpu(), src.cpu().to(_acc(dtype)))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("n,offset", SIZES)
def test_reduce_wire_and_final(dtype, op, n, offset):
    """A partial stays in the wire type (no rounding); the final step divides (avg) and rounds once."""
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg is for floating-point dtypes")
    acc = _acc(dtype)
    partial = _data(n, offset, acc, 2 * n + 1, scale=0.37 * 1.001)  # fp32 partials with bits fp16/bf16 lack
    own = _data(n, offset, dtype, 2 * n + 2)
    out = torch.empty(n + offset, dtype=acc, device="cuda")[offset:]
    final = torch.empty(n + offset, dtype=dtype, device="cuda")[offset:]
    stream = torch.cuda.current_stream().cuda_stream
    _C.cuda_reduce_wire(partial.data_ptr(), own.data_ptr(), out.data_ptr(), n, _DTYPES[dtype], _OPS[op], stream)
    nranks = 3
    _C.cuda_reduce_wire_final(partial.data_ptr(), own.data_ptr(), final.data_ptr(), n, _DTYPES[dtype], _OPS[op],
                              nranks, stream)
    torch.cuda.synchronize()
    want = _combine(op, partial.cpu(), own.cpu().to(acc))
    assert torch.equal(out.cpu(), want)
    assert torch.equal(final.cpu(), (_true_div(want, nranks) if op == "avg" else want).to(dtype))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("op", list(_OPS))
@pytest.mark.parametrize("nsrc", [1, 2, 5, 16])
@pytest.mark.parametrize("n,offset", [(3, 0), (65537, 1), ((1 << 18) + 3, 0)])
def test_reduce_many_in_rank_order(dtype, op, nsrc, n, offset):
    if op == "avg" and not dtype.is_floating_point:
        pytest.skip("avg is for floating-point dtypes")
    lo, hi = (-1, 3) if op == "prod" else (-8, 9)  # products of 16 factors stay exact in int32
    srcs = [_data(n, offset, dtype, 1000 * nsrc + s, lo, hi) for s in range(nsrc)]
    out = torch.empty(n + offset, dtype=dtype, device="cuda")[offset:]
    _C.cuda_reduce_many([s.data_ptr() for s in srcs], out.data_ptr(), n, _DTYPES[dtype], _OPS[op], nsrc,
                        torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    acc = srcs[0].cpu().to(_acc(dtype))
    for s in srcs[1:]:
        acc = _combine(op, acc, s.cpu().to(_acc(dtype)))
    want = (_true_div(acc, nsrc) if op == "avg" else acc).to(dtype)
    assert torch.equal(out.cpu(), want)
    # in place: the output may be the first source (one-shot reduces into the user's buffer)
    _C.cuda_reduce_many([s.data_ptr() for s in srcs], srcs[0].data_ptr(), n, _DTYPES[dtype], _OPS[op], nsrc,
                        torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    assert torch.equal(srcs[0].cpu(), want)


def _fp16_as_before(r32):
    """What the fp16 kernels stored before [Note: fp16 operands of an arithmetic op]: the fp32 result
    (operands widened with their NaN payloads, which torch's CPU conversion keeps too), rounded to nearest
    even, a NaN as float_to_half writes it: its sign | 0x7e00."""
    r32 = r32.cpu()
    rule = torch.where(r32.view(torch.int32) < 0, torch.tensor(-512, dtype=torch.int16),  # 0xfe00
                       torch.tensor(0x7e00, dtype=torch.int16))
    return torch.where(r32.isnan(), rule, r32.half().view(torch.int16))


@pytest.mark.parametrize("op", ["sum", "avg", "prod"])
def test_fp16_arithmetic_bits_equal_the_fp32_kernels(op):
    """fp16 sum, avg and prod (two-input and n-input kernels) store the very bits, NaNs included, that the
    fp32 kernel's result gives once rounded: every fp16 bit pattern (NaNs of every payload and sign) meets
    values, infinities and NaNs. The fp32 kernel runs on the fp16 inputs widened on the CPU."""
    a = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    stream = torch.cuda.current_stream().cuda_stream
    for b in (a.roll(1), a.roll(31744), -a.roll(333), torch.full_like(a, float("nan")), torch.full_like(a, 1.0)):
        srcs = [a, b, a.roll(5)]
        dev = [s.cuda() for s in srcs]  # (held: a temporary's block would go to the next copy before the kernel)
        wide = [s.float().cuda() for s in srcs]
        out, out32 = torch.empty(a.numel(), dtype=torch.float16, device="cuda"), torch.empty_like(wide[0])
        _C.cuda_reduce2(dev[0].data_ptr(), dev[1].data_ptr(), out.data_ptr(), a.numel(),
                        _DTYPES[torch.float16], _OPS[op], 2, stream)
        _C.cuda_reduce2(wide[0].data_ptr(), wide[1].data_ptr(), out32.data_ptr(), a.numel(),
                        _DTYPES[torch.float32], _OPS[op], 2, stream)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu().view(torch.int16), _fp16_as_before(out32)), op
        for nsrc in (1, 2, 3):
            _C.cuda_reduce_many([s.data_ptr() for s in dev[:nsrc]], out.data_ptr(), a.numel(), _DTYPES[torch.float16],
                                _OPS[op], nsrc, stream)
            _C.cuda_reduce_many([s.data_ptr() for s in wide[:nsrc]], out32.data_ptr(), a.numel(),
                                _DTYPES[torch.float32], _OPS[op], nsrc, stream)
            torch.cuda.synchronize()
            assert torch.equal(out.cpu().view(torch.int16), _fp16_as_before(out32)), (op, nsrc)


def test_reduce_many_rejects_too_many_sources():
    x = torch.zeros(4, device="cuda")
    with pytest.raises(ValueError, match="1 to 16 sources"):
        _C.cuda_reduce_many([x.data_ptr()] * 17, x.data_ptr(), 4, 0, 0, 17, 0)
    with pytest.raises(ValueError, match="1 to 16 sources"):
        _C.cuda_reduce_many([], x.data_ptr(), 4, 0, 0, 1, 0)


def test_fp16_every_value_converts_as_torch():
    """Every fp16 bit pattern through the reduce kernel (a + b, a * 1 and a + (-a) style pairs), against
    torch's IEEE conversions on the CPU: subnormals, the overflow to inf at 65520, signed zeros. NaN
    stays NaN; max and min give the bits of the NaN they propagate (a's if a is NaN, else b's) as
    float_to_half writes a NaN: its sign | 0x7e00."""
    a = torch.arange(1 << 16, dtype=torch.int32).to(torch.int16).view(torch.float16)
    for b in (torch.zeros_like(a), a.roll(1), a.roll(12345), -a.roll(7), torch.full_like(a, 2.0**-14)):
        for op in ("sum", "prod", "max", "min"):
            out = torch.empty(a.numel(), dtype=torch.float16, device="cuda")
            ga, gb = a.cuda(), b.cuda()
            _C.cuda_reduce2(ga.data_ptr(), gb.data_ptr(), out.data_ptr(), a.numel(), _DTYPES[torch.float16],
                            _OPS[op], 2, torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            got, want = out.cpu(), _reference(a, b, op, 2)
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan), op
            if op != "min":  # (torch.minimum's choice between -0 and +0 is its own; min's rule below)
                assert torch.equal(got[~nan].view(torch.int16), want[~nan].view(torch.int16)), op
            if op in ("max", "min"):  # combine's rule, bit for bit: a if a is NaN or beats b, else b
                beats = a.float() > b.float() if op == "max" else a.float() < b.float()
                chosen = torch.where(a.isnan() | beats, a.view(torch.int16), b.view(torch.int16))
                rule = torch.where(chosen < 0, torch.tensor(-512, dtype=torch.int16),  # 0xfe00
                                   torch.tensor(0x7e00, dtype=torch.int16))  # a NaN: its sign | 0x7e00
                rule = torch.where(chosen.view(torch.float16).isnan(), rule, chosen)
                assert torch.equal(got.view(torch.int16), rule), op
