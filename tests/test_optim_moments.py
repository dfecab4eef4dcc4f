"""pz.optim.Adam/AdamW with moments="bf16" / "int8" (pyzero.optim.moments).

References: torch.optim.AdamW (foreach=False) started from the same decoded moments, and the
8-bit maps written out here in float64 from their definition (m = absmax * (c/127)^3,
v = absmax * (c/255)^4, per block of 256 elements).
"""
import copy
import math

import pytest
import torch

import pyzero as pz
from pyzero.optim import moments as M

B = 256


def block_max(x: torch.Tensor) -> torch.Tensor:
    n = x.numel()
    pad = torch.zeros(-(-n // B) * B, dtype=x.dtype)
    pad[:n] = x.reshape(-1).abs()
    return pad.view(-1, B).amax(1)


def ref_encode(x: torch.Tensor, levels: float, root: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, absmax) in float64 from the definition."""
    x = x.reshape(-1).double()
    amax = block_max(x)
    a = amax.repeat_interleave(B)[:x.numel()]
    r = torch.where(a > 0, x.abs() / a, torch.zeros_like(x))
    c = torch.round(levels * r ** (1.0 / root))
    if root == 4:
        c = torch.where((x > 0) & (c < 1), torch.ones_like(c), c)
    return c * torch.sign(x), amax


def ref_decode(codes: torch.Tensor, amax: torch.Tensor, levels: float, power: int) -> torch.Tensor:
    a = amax.double().repeat_interleave(B)[:codes.numel()]
    return (codes.reshape(-1).double() / levels) ** power * a


def spread(n, gen, signed=True, zeros=0):
    """Values spanning 10 decades, a different scale per block, some exact zeros."""
    mag = 10.0 ** (torch.rand(n, generator=gen, dtype=torch.float64) * -10)
    scale = (10.0 ** (torch.rand(-(-n // B), generator=gen, dtype=torch.float64) * 6 - 3)).repeat_interleave(B)[:n]
    x = mag * scale
    if signed:
        x = x * torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0).double()
    x[torch.randperm(n, generator=gen)[:zeros]] = 0
    return x.float()


def test_int8_codes_absmax_and_error_bounds():
    """Encoding fp32 moments: absmax is each block's largest |value|, exactly; codes are the
    float64 definition's (within one code at rounding ties, at least 99% equal); the decoded
    values are within the stated bound of the originals; a positive v stays positive, zeros
    stay zero, the block maximum is exact."""
    gen = torch.Generator().manual_seed(0)
    n = 7 * B + 100  # a partial last block
    m, v = spread(n, gen, True, 50), spread(n, gen, False, 50)
    p = torch.zeros(n)
    state = {"step": torch.tensor(1.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    M.convert(state, "int8", p)
    assert state["exp_avg"].dtype == torch.int8 and state["exp_avg_sq"].dtype == torch.uint8
    assert state["exp_avg_absmax"].shape == (8,)
    dec = M.to_fp32(state)
    for x, key, levels, k in ((m, "exp_avg", 127.0, 3), (v, "exp_avg_sq", 255.0, 4)):
        codes, amax = ref_encode(x, levels, k)
        assert torch.equal(state[key + "_absmax"].double(), amax)
        got = state[key].double()
        assert (got - codes).abs().max() <= 1
        assert (got == codes).double().mean() >= 0.99
        a = amax.repeat_interleave(B)[:n]
        r = x.double().abs() / a.clamp_min(1e-300)
        bound = a * ((r ** (1.0 / k) + 0.5 / levels) ** k - r) + 1e-6 * a
        err = (dec[key].double() - x.double()).abs()
        assert (err <= bound).all(), float((err - bound).max())
        assert (dec[key][x == 0] == 0).all()
        top = x.abs().reshape(-1)[:7 * B].view(7, B).argmax(1) + torch.arange(7) * B
        assert torch.equal(dec[key][top], x[top])
    assert (dec["exp_avg_sq"][v > 0] > 0).all()


def test_int8_blocks_of_tiny_moments_encode_as_the_definition():
    """Blocks whose absmax is so small (1e-33, 1e-36) that levels^k / absmax overflows fp32: both
    encoders (the Python one of load/convert and the step's kernel) give the float64 definition's
    codes, zeros stay zero next to a negative value, the largest value is exact."""
    n = 3 * B
    m, v = torch.zeros(n), torch.zeros(n)
    m[0], m[1], m[5] = -1e-33, 2.5e-34, 1e-34  # block 0: tiny; block 1: tinier; block 2: ordinary
    m[B], m[B + 7] = 3e-36, -1e-36
    m[2 * B:] = torch.linspace(-1, 1, B)
    v[0], v[3], v[B + 1], v[2 * B] = 1e-31, 2e-32, 1e-37, 0.5
    state = {"step": torch.tensor(1.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    M.convert(state, "int8", torch.zeros(n))
    for x, key, levels, k in ((m, "exp_avg", 127.0, 3), (v, "exp_avg_sq", 255.0, 4)):
        codes, amax = ref_encode(x, levels, k)
        assert torch.equal(state[key].double(), codes), key
        assert torch.equal(state[key + "_absmax"].double(), amax.float().double()), key
    # the kernel: a step from zero moments whose new moments are these (beta1 = beta2 = 0: m = g, v = g^2)
    p = torch.nn.Parameter(torch.zeros(n))
    opt = pz.optim.Adam([p], lr=1e-3, betas=(0.0, 0.0), moments="int8")
    p.grad = m.clone()
    opt.step()
    st = opt.state[p]
    codes, amax = ref_encode(m, 127.0, 3)
    assert torch.equal(st["exp_avg"].double(), codes)
    assert torch.equal(st["exp_avg_absmax"].double(), amax.float().double())
    dec = opt.fp32_state(p)["exp_avg"]
    assert (dec[m == 0] == 0).all() and dec[0] == m[0] and dec[B] == m[B]


def _adam_pair(n, gen, moments):
    p = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * 1e-2
    m = torch.randn(n, generator=gen) * 1e-3
    v = torch.rand(n, generator=gen) * 1e-4 + 1e-8
    ours = torch.nn.Parameter(p.clone())
    opt = pz.optim.AdamW([ours], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, moments=moments)
    st = {"step": torch.tensor(4.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    M.convert(st, moments, p)
    opt.state[ours] = st
    # torch from the decoded moments (decoded here from the definition)
    if moments == "int8":
        dm = ref_decode(st["exp_avg"], st["exp_avg_absmax"], 127.0, 3).float()
        dv = ref_decode(st["exp_avg_sq"], st["exp_avg_sq_absmax"], 255.0, 4).float()
    else:
        dm, dv = st["exp_avg"].float(), st["exp_avg_sq"].float()
    ref = torch.nn.Parameter(p.clone())
    topt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.99), weight_decay=0.1, foreach=False)
    topt.state[ref] = {"step": torch.tensor(4.0), "exp_avg": dm.clone(), "exp_avg_sq": dv.clone()}
    ours.grad, ref.grad = g.clone(), g.clone()
    opt.step()
    topt.step()
    return ours, opt.state[ours], ref, topt.state[ref]


def test_bf16_step_is_the_fp32_step_from_the_stored_moments_rounded():
    """One step with bf16 moments: the parameters are torch's fp32 step from the bf16 values
    (within the 1-ulp sqrt difference of the fused kernel), the new moments torch's new fp32
    moments rounded to bf16, bit for bit."""
    ours, st, ref, tst = _adam_pair(5000, torch.Generator().manual_seed(1), "bf16")
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-9)
    assert st["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(st["exp_avg"], tst["exp_avg"].to(torch.bfloat16))
    assert torch.equal(st["exp_avg_sq"], tst["exp_avg_sq"].to(torch.bfloat16))


def test_int8_step_is_the_fp32_step_from_the_decoded_moments_requantized():
    """One step with int8 moments: the parameters are torch's fp32 step from the decoded codes;
    the new codes and absmax encode torch's new moments (codes within one, absmax to fp32)."""
    n = 9 * B + 17
    ours, st, ref, tst = _adam_pair(n, torch.Generator().manual_seed(2), "int8")
    torch.testing.assert_close(ours.detach(), ref.detach(), rtol=1e-6, atol=1e-9)
    for key, levels, k in (("exp_avg", 127.0, 3), ("exp_avg_sq", 255.0, 4)):
        codes, amax = ref_encode(tst[key], levels, k)
        torch.testing.assert_close(st[key + "_absmax"].double(), amax, rtol=1e-6, atol=0)
        assert (st[key].double() - codes).abs().max() <= 1
        assert (st[key].double() == codes).double().mean() >= 0.99


def _trajectory(moments, steps=40, lr=1e-2, n=3 * B + 5, seed=3):
    """A noisy quadratic with curvatures over 2 decades (gradients over 2, their squares over
    4 within a block); (params per step, final loss)."""
    gen = torch.Generator().manual_seed(seed)
    curv = 10.0 ** (torch.rand(n, generator=gen) * 2 - 1)
    target = torch.randn(n, generator=gen)
    p = torch.nn.Parameter(torch.zeros(n))
    opt = torch.optim.AdamW([p], lr=lr, foreach=False) if moments is None else \
        pz.optim.AdamW([p], lr=lr, moments=moments)
    out = []
    for _ in range(steps):
        p.grad = curv * (p.detach() - target) + 0.1 * torch.randn(n, generator=gen) * curv.sqrt()
        opt.step()
        out.append(p.detach().clone())
    return out, float((curv * (out[-1] - target) ** 2).sum() / 2)


@pytest.mark.parametrize("moments,per_step", [("fp32", 1e-5), ("bf16", 0.02), ("int8", 0.2)])
def test_trajectory_stays_within_stated_bound_of_torch_fp32(moments, per_step):
    """40 AdamW steps on a noisy quadratic: after t steps every parameter is within
    per_step * lr * t of torch's fp32 AdamW (an Adam step moves a parameter by about lr at
    most: the bound is that fraction of the largest possible drift; measured here 0.007 for
    bf16, 0.12 for int8, whose largest deviations are in elements far below their block's
    maximum), and the final loss within 1% of torch's (measured 0.01% and 0.06%)."""
    ref, ref_loss = _trajectory(None)
    got, loss = _trajectory(moments)
    for t, (a, b) in enumerate(zip(got, ref), 1):
        assert (a - b).abs().max() <= per_step * 1e-2 * t, (t, float((a - b).abs().max()))
    assert abs(loss - ref_loss) <= 0.01 * ref_loss


ISAS = [i for i in ("scalar", "avx2", "avx512")
        if {"scalar": 0, "avx2": 1, "avx512": 2}[i] <= {"scalar": 0, "avx2": 1, "avx512": 2}[pz.optim.cpu_isa()]]


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_every_isa_and_thread_count_copies_and_grad_scale(moments):
    """Every ISA and 1 or 2 threads (the int8 step splits the blocks between them; here tensors
    of partial blocks and one over 32K elements a thread) give bit for bit the same step;
    copies= receives the new parameters cast; grad_scale equals a pre-scaled gradient."""
    def run(isa, threads, scale_in_step):
        gen = torch.Generator().manual_seed(4)
        ps = [torch.nn.Parameter(torch.randn(s, generator=gen)) for s in ((37, 40), (5,), (70_001,), (B,))]
        opt = pz.optim.AdamW(ps, lr=1e-2, moments=moments, isa=isa, threads=threads)
        copies = {p: torch.empty_like(p, dtype=torch.bfloat16) for p in ps}
        for _ in range(3):
            for p in ps:
                g = torch.randn(p.shape, generator=gen)
                p.grad = g if scale_in_step else g * 0.25
            opt.step(grad_scale=0.25 if scale_in_step else 1.0, copies=copies)
        for p in ps:
            assert torch.equal(copies[p], p.detach().to(torch.bfloat16))
        return [p.detach().clone() for p in ps], [{k: v.clone() for k, v in opt.state[p].items()} for p in ps]

    ref_p, ref_s = run("scalar", 1, True)
    for isa in ISAS:
        for threads in (1, 2):
            got_p, got_s = run(isa, threads, True)
            assert all(torch.equal(a, b) for a, b in zip(got_p, ref_p)), (isa, threads)
            for a, b in zip(got_s, ref_s):
                assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), (isa, threads)
    pre_p, _ = run(ISAS[-1], 2, False)
    assert all(torch.equal(a, b) for a, b in zip(pre_p, ref_p))


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_state_dict_round_trip_and_load_from_torch(moments):
    """state_dict() gives the moments in torch's fp32 layout and a fresh optimizer loading it continues bit
    for bit (the stored values re-stored exactly); torch's AdamW loading it continues as pz.optim's fp32
    moments would (the codes loaded there as floats: garbage); a torch.optim.AdamW state dict (fp32
    moments) loads and is re-stored at the next step, staying within the trajectory bound of torch
    continuing; fp32_state() loads into torch."""
    gen = torch.Generator().manual_seed(5)
    init = torch.randn(700, generator=gen)
    grads = [torch.randn(700, generator=gen) for _ in range(6)]

    def make(cls, **kw):
        p = torch.nn.Parameter(init.clone())
        return p, cls([p], lr=1e-2, **kw)

    a, oa = make(pz.optim.AdamW, moments=moments)
    for g in grads[:3]:
        a.grad = g.clone()
        oa.step()
    sd = copy.deepcopy(oa.state_dict())  # (as torch.save / torch.load: the step counts are not shared)
    want = {"bf16": torch.bfloat16, "int8": torch.int8}[moments]
    assert sd["state"][0]["exp_avg"].dtype == torch.float32 and sd["state"][0]["exp_avg"].shape == init.shape
    assert torch.equal(sd["state"][0]["exp_avg"], oa.fp32_state(a)["exp_avg"])
    b, ob = make(pz.optim.AdamW, moments=moments)
    tb, otb = make(torch.optim.AdamW, foreach=False)
    fp, ofp = make(pz.optim.AdamW)  # fp32 moments, from the same state
    for p in (b, tb, fp):
        with torch.no_grad():
            p.copy_(a)
    for o in (ob, otb, ofp):
        o.load_state_dict(copy.deepcopy(sd))
    for g in grads[3:]:
        for p, o in ((a, oa), (b, ob), (tb, otb), (fp, ofp)):
            p.grad = g.clone()
            o.step()
    assert ob.state[b]["exp_avg"].dtype == want
    assert torch.equal(a, b)
    torch.testing.assert_close(tb, fp, rtol=1e-6, atol=1e-7)  # torch continues as the fp32 moments do
    # from torch, and back
    t, ot = make(torch.optim.AdamW, foreach=False)
    for g in grads[:3]:
        t.grad = g.clone()
        ot.step()
    c, oc = make(pz.optim.AdamW, moments=moments)
    with torch.no_grad():
        c.copy_(t)
    oc.load_state_dict(copy.deepcopy(ot.state_dict()))
    for g in grads[3:]:
        for p, o in ((t, ot), (c, oc)):
            p.grad = g.clone()
            o.step()
    assert oc.state[c]["exp_avg"].dtype == want
    assert (c - t).abs().max() <= 0.2 * 1e-2 * 6
    back = oc.fp32_state(c)
    assert back["exp_avg"].dtype == torch.float32 and back["exp_avg"].shape == c.shape
    t2, ot2 = make(torch.optim.AdamW, foreach=False)
    ot2.load_state_dict({"state": {0: back}, "param_groups": ot.state_dict()["param_groups"]})
    assert torch.equal(ot2.state[t2]["exp_avg_sq"], back["exp_avg_sq"])


def test_state_bytes_per_parameter_match_the_formula():
    """Bytes of exp_avg + exp_avg_sq (+ absmax) held per parameter, counted from the state's
    tensors: 8 (fp32), 4 (bf16), 2 + 8 * ceil(n / 256) / n (int8)."""
    for n in (1, 255, 256, 1000, 65536):
        for moments in M.MOMENTS:
            p = torch.nn.Parameter(torch.zeros(n))
            opt = pz.optim.AdamW([p], moments=moments)
            p.grad = torch.ones(n)
            opt.step()
            held = sum(t.numel() * t.element_size() for k, t in opt.state[p].items() if k != "step")
            want = {"fp32": 8 * n, "bf16": 4 * n, "int8": 2 * n + 8 * math.ceil(n / 256)}[moments]
            assert held == want, (n, moments, held)
            if n % 256 == 0:  # full blocks: the per-element figure the docs give
                assert M.bytes_per_element(moments) * n == held


def test_bad_moments_arguments_name_the_argument(tmp_path):
    p = torch.nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="moments: expected one of"):
        pz.optim.AdamW([p], moments="fp16")
    with pytest.raises(ValueError, match="amsgrad"):
        pz.optim.Adam([p], amsgrad=True, moments="int8")
    with pytest.raises(ValueError, match="moments"):
        pz.optim.NvmeAdamW([p], nvme_path=str(tmp_path), moments="bf16")


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
def test_bf16_moments_in_the_kernel_equal_fp32_kernel_then_rounding(isa):
    """The fused kernel's bf16 moments (read widened, written rounded in its pass) on every ISA,
    1 and 2 threads, sizes with tails and a misaligned start, with grad_scale, L2 and decoupled
    decay and a bf16 copy: bit for bit the fp32 step from the widened moments (F.adam_step with
    fp32 states, itself torch's) with the new moments rounded to nearest even by torch."""
    if isa != "scalar" and {"avx2": 1, "avx512": 2}[isa] > {"scalar": 0, "avx2": 1, "avx512": 2}[pz.optim.cpu_isa()]:
        pytest.skip(f"this CPU has no {isa}")
    F = pz.optim.functional
    gen = torch.Generator().manual_seed(6)
    sizes = (1, 15, 16, 17, 1000, 70_001)
    for threads in (1, 2):
        for decoupled in (False, True):
            base = [torch.randn(n + 1, generator=gen)[1:] for n in sizes]  # (misaligned start)
            grads = [torch.randn(n, generator=gen) for n in sizes]
            m = [(torch.randn(n, generator=gen) * 1e-2).bfloat16() for n in sizes]
            v = [(torch.rand(n, generator=gen) * 1e-3).bfloat16() for n in sizes]
            kw = dict(step=3.0, lr=1e-2, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.05, decoupled=decoupled,
                      grad_scale=0.5, threads=threads, isa=isa)
            p1, m1, v1 = [b.clone() for b in base], [t.clone() for t in m], [t.clone() for t in v]
            c1 = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
            F.adam_step(p1, grads, m1, v1, None, c1, **kw)
            p2, m2, v2 = [b.clone() for b in base], [t.float() for t in m], [t.float() for t in v]
            c2 = [torch.empty(n, dtype=torch.bfloat16) for n in sizes]
            F.adam_step(p2, grads, m2, v2, None, c2, **kw)
            for a, b in zip(p1, p2):
                assert torch.equal(a, b)
            for a, b in zip(m1 + v1 + c1, m2 + v2 + c2):
                assert a.dtype == torch.bfloat16 and torch.equal(a, b.to(torch.bfloat16))
    with pytest.raises(ValueError, match="exp_avg_sqs"):
        F.adam_step([torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4).bfloat16()], [torch.zeros(4)], step=1.0,
                    lr=1e-3, beta1=0.9, beta2=0.99, eps=1e-8, weight_decay=0.0, decoupled=True)


def test_moments_bench_curves_and_step_times(tmp_path):
    """pyzero-bench moments, tiny: the torch and fp32 curves are the same losses (pz.optim's fp32
    AdamW against torch's on one model and batches, within the kernel's sqrt rounding), every run
    starts from the same loss, the state bytes per parameter are the formats'; --step-elems
    gives one row per format."""
    import argparse
    import json

    from pyzero.bench import moments as bench

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "m.json"
    assert bench.main(p.parse_args(["--model", "gpt-nano", "--steps", "4", "--batch", "2", "--seq", "16",
                                    "--warmup-compare", "0", "--json", str(out)])) == 0
    rows = {r["run"]: r for r in json.loads(out.read_text())["results"]}
    assert set(rows) == set(bench.RUNS)
    assert rows["fp32"]["losses"] == pytest.approx(rows["torch"]["losses"], rel=1e-5)
    assert len({r["losses"][0] for r in rows.values()}) == 1
    assert [round(rows[k]["state_bytes_per_param"], 2) for k in ("torch", "fp32", "bf16")] == [8.0, 8.0, 4.0]
    assert 2.0 < rows["int8"]["state_bytes_per_param"] < 2.1
    assert bench.main(p.parse_args(["--step-elems", "1000", "--iters", "1", "--json", str(out)])) == 0
    assert [r["moments"] for r in json.loads(out.read_text())["results"]] == ["fp32", "bf16", "int8"]
    with pytest.raises(ValueError, match="--runs"):
        bench.main(p.parse_args(["--runs", "fp64"]))


@pytest.mark.parametrize("moments", ["bf16", "int8"])
def test_amsgrad_in_a_group_of_its_own_is_refused_with_coded_moments(moments):
    """amsgrad=True in one param group (not the constructor's) with bf16 or int8 moments: refused when built
    (int8 ignored it, bf16 failed in the first step), and when a group gets it later, before any step."""
    p, q = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(4))
    with pytest.raises(ValueError, match=r"param_groups\[0\]: amsgrad=True needs moments='fp32'"):
        pz.optim.AdamW([{"params": [p], "amsgrad": True}, {"params": [q]}], moments=moments)
    opt = pz.optim.AdamW([{"params": [p]}, {"params": [q]}], lr=0.1, moments=moments)
    opt.param_groups[1]["amsgrad"] = True
    p.grad, q.grad = torch.ones(4), torch.ones(4)
    with pytest.raises(ValueError, match=r"param_groups\[1\]: amsgrad=True"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(4))  # (nothing stepped)
