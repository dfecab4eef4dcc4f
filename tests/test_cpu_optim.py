"""pz.optim (fused CPU AdamW/Adam/SGD) against torch.optim with foreach=False.

Where torch's own arithmetic is exact the two agree bitwise: SGD always, and
Adam/AdamW whenever sqrt(exp_avg_sq) is exactly representable (dyadic
gradients with beta2 = 0), which pins down every other op and its order.
With arbitrary gradients the one difference is sqrt: torch's (MKL vsSqrt) is
faithfully rounded, not correctly rounded, so a step may differ by a few ulps
of the operands; the state tensors stay bitwise equal.
"""
import copy
import gc
import os
from types import SimpleNamespace

import pytest
import torch

import pyzero as pz
from pyzero.optim import functional as F

SIZES = [1, 15, 17, 1000, 65536 + 13]
ISAS = [i for i in ("scalar", "avx2", "avx512")
        if {"scalar": 0, "avx2": 1, "avx512": 2}[i] <= {"scalar": 0, "avx2": 1, "avx512": 2}[pz.optim.cpu_isa()]]


def ulp_diff(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Distance in representable fp32 values (int view, sign-magnitude made monotonic)."""
    def key(t):
        i = t.contiguous().view(torch.int32).to(torch.int64)
        return torch.where(i < 0, -(i & 0x7FFFFFFF), i)
    return (key(a) - key(b)).abs()


def pair(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    p = torch.randn(n, generator=g)
    return p.clone().requires_grad_(), p.clone().requires_grad_(), g


def dyadic_grad(n, g):
    return torch.randint(-64, 65, (n,), generator=g).float() / 8


@pytest.mark.parametrize("cls", ["AdamW", "Adam"])
@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("n", SIZES)
def test_adam_bitwise_equal_to_torch_over_steps_with_schedule(cls, amsgrad, n):
    p, q, gen = pair(n)
    kw = dict(lr=3e-2, betas=(0.8, 0.0), eps=1e-6, weight_decay=0.05, amsgrad=amsgrad)
    ours = getattr(pz.optim, cls)([p], threads=2, **kw)
    ref = getattr(torch.optim, cls)([q], foreach=False, **kw)
    s1 = torch.optim.lr_scheduler.StepLR(ours, step_size=7, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(ref, step_size=7, gamma=0.5)
    for _ in range(25):
        g = dyadic_grad(n, gen)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step(), ref.step(), s1.step(), s2.step()
    assert ours.param_groups[0]["lr"] == ref.param_groups[0]["lr"] < 3e-2
    assert torch.equal(p, q)
    for key in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if amsgrad else ()):
        assert torch.equal(ours.state[p][key], ref.state[q][key]), key
    assert ours.state[p]["step"].item() == ref.state[q]["step"].item() == 25


@pytest.mark.parametrize("amsgrad", [False, True])
def test_adamw_random_grads_state_exact_params_within_sqrt_error(amsgrad):
    n = 200_003
    p, q, gen = pair(n, 1)
    ours = pz.optim.AdamW([p], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad)
    ref = torch.optim.AdamW([q], lr=1e-2, weight_decay=0.1, amsgrad=amsgrad, foreach=False)
    worst, frac_over_1 = 0.0, 0.0
    for _ in range(10):
        old = q.detach().clone()
        g = torch.randn(n, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step(), ref.step()
        assert torch.equal(ours.state[p]["exp_avg"], ref.state[q]["exp_avg"])
        assert torch.equal(ours.state[p]["exp_avg_sq"], ref.state[q]["exp_avg_sq"])
        mag = torch.maximum(old.abs(), q.detach().abs())
        spacing = torch.nextafter(mag, torch.tensor(float("inf"))) - mag
        worst = max(worst, ((p.detach() - q.detach()).abs() / spacing).max().item())
        frac_over_1 = max(frac_over_1, (ulp_diff(p.detach(), q.detach()) > 1).float().mean().item())
        with torch.no_grad():
            p.copy_(q)  # per-step comparison from the same state
    assert worst <= 4.0, worst
    assert frac_over_1 < 5e-3, frac_over_1


@pytest.mark.parametrize("momentum,dampening,nesterov,wd", [(0.0, 0.0, False, 0.0), (0.9, 0.0, False, 1e-2),
                                                             (0.9, 0.1, False, 0.0), (0.9, 0.0, True, 1e-2)])
@pytest.mark.parametrize("n", SIZES)
def test_sgd_bitwise_equal_to_torch(momentum, dampening, nesterov, wd, n):
    p, q, gen = pair(n, 2)
    kw = dict(lr=5e-2, momentum=momentum, dampening=dampening, nesterov=nesterov, weight_decay=wd)
    ours, ref = pz.optim.SGD([p], threads=2, **kw), torch.optim.SGD([q], foreach=False, **kw)
    s1 = torch.optim.lr_scheduler.ExponentialLR(ours, 0.9)
    s2 = torch.optim.lr_scheduler.ExponentialLR(ref, 0.9)
    for _ in range(20):
        g = torch.randn(n, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step(), ref.step(), s1.step(), s2.step()
    assert torch.equal(p, q)
    if momentum:
        assert torch.equal(ours.state[p]["momentum_buffer"], ref.state[q]["momentum_buffer"])


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("threads", [1, 3])
def test_every_isa_and_thread_count_bitwise_equal_to_scalar(isa, threads):
    n = 3 * 65536 + 7
    gen = torch.Generator().manual_seed(3)
    base = [torch.randn(n, generator=gen) for _ in range(4)]
    base[3] = base[3].abs()

    def run(isa_, threads_):
        p, g, m, v = (t.clone() for t in base)
        vmax, c16, cb16 = v.clone(), torch.empty(n, dtype=torch.float16), torch.empty(n, dtype=torch.bfloat16)
        F.adam_step([p], [g], [m], [v], [vmax], [cb16], step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.1, decoupled=True, amsgrad=True, grad_scale=0.5, threads=threads_, isa=isa_)
        s, buf = p.clone(), m.clone()
        F.sgd_step([s], [g], [buf], [c16], lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3,
                   threads=threads_, isa=isa_)
        a, acc, c32 = p.clone(), v.clone(), torch.empty(n)
        F.adagrad_step([a], [g], [acc], [c32], step=2, lr=0.1, lr_decay=0.1, weight_decay=1e-3, eps=1e-10,
                       threads=threads_, isa=isa_)
        return p, m, v, vmax, cb16, s, buf, c16, a, acc, c32

    for a, b in zip(run(isa, threads), run("scalar", 1)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("isa", ISAS)
def test_adam_bias_correction_division_is_exact_at_every_step_and_scale(isa):
    """The vector loops divide by the bias correction without the divider (a reciprocal and one
    FMA correction): bitwise the scalar loop's true division over 64 steps (every bias correction
    from 0.0447 to 0.25 and on), second moments spanning 1e-36..1e36, zeros and an infinite one;
    an odd number of vectors and a tail, so every loop (unrolled, single vector, scalar) runs."""
    n = 4096 + 16 + 5
    gen = torch.Generator().manual_seed(7)
    p0 = torch.randn(n, generator=gen)
    g = torch.randn(n, generator=gen) * torch.pow(10.0, torch.randint(-18, 18, (n,), generator=gen).float())
    g[:7] = 0.0
    g[7] = float("inf")
    g[8] = 1e30  # a finite first moment over an infinite second: the step is -0, p stays

    def run(isa_):
        p, m, v = p0.clone(), torch.zeros(n), torch.zeros(n)
        for step in range(1, 65):
            F.adam_step([p], [g], [m], [v], step=step, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8,
                        weight_decay=0.0, decoupled=True, isa=isa_)
        return p, m, v

    got, want = run(isa), run("scalar")
    assert want[2][7] == float("inf") and want[2][:7].eq(0).all()  # the cases are there
    assert want[2][8] == float("inf") and want[1][8].isfinite() and want[0][8] == p0[8]
    for a, b in zip(got, want):
        assert torch.equal(a.isnan(), b.isnan())
        assert torch.equal(torch.nan_to_num(a), torch.nan_to_num(b))


def _adamw_threads(n, threads):
    """(threading used, p after three AdamW steps with `threads` threads) on fixed data."""
    gen = torch.Generator().manual_seed(5)
    p, g = torch.randn(n, generator=gen), torch.randn(n, generator=gen)
    m, v = torch.zeros(n), torch.zeros(n)
    for step in (1, 2, 3):
        F.adam_step([p], [g], [m], [v], step=step, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8,
                    weight_decay=0.1, decoupled=True, amsgrad=False, threads=threads)
    return pz.optim.cpu_threading(), p


def test_steps_run_on_torch_openmp_team_and_fall_back_after_fork():
    """In this process (torch loaded) the pieces run on torch's OpenMP team; a child forked
    after that team ran must not use it (it would wait for threads that are not there): it
    starts its own threads, with the same result, and does not hang."""
    from pyzero.launch import run_ranks

    n = 4 * 65536 + 3
    torch.ones(1 << 20).mul_(2)  # make sure torch's team exists before the fork
    where, ref = _adamw_threads(n, 1)
    assert where == "openmp"
    assert torch.equal(_adamw_threads(n, 2)[1], ref)
    assert torch.equal(_adamw_threads(n, 3)[1], ref)  # a team larger than the cores
    (child,) = run_ranks(_adamw_threads, 1, args=(n, 2), timeout=30, threads=None)
    assert child.value[0] == "threads"
    assert torch.equal(child.value[1], ref)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_equals_param_cast(dtype):
    n = 70_001
    p, _, gen = pair(n, 4)
    p.data[:5] = torch.tensor([0.0, -0.0, 1e-30, 65504.0 * 2, 3.0e-8])  # zero, subnormal, overflow, tiny
    copy = torch.empty(n, dtype=dtype)
    opt = pz.optim.AdamW([p], lr=1e-3)
    p.grad = torch.randn(n, generator=gen)
    opt.step(copies={p: copy})
    assert torch.equal(copy, p.detach().to(dtype))


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_copy_at_every_alignment_and_thread_count(isa, dtype):
    """The vector paths stream a copy's stores where its address is aligned and store normally
    elsewhere: every offset of the copy, every optimizer, 1 and 2 threads, equal to the cast."""
    n = 3 * 65536 + 37
    for offset in (0, 1, 3, 8, 15, 16):
        for make in (lambda q: pz.optim.AdamW([q], lr=1e-3, isa=isa, threads=threads),
                     lambda q: pz.optim.SGD([q], lr=1e-2, momentum=0.9, isa=isa, threads=threads),
                     lambda q: pz.optim.Adagrad([q], lr=1e-2, isa=isa, threads=threads)):
            for threads in (1, 2):
                p, _, gen = pair(n, 6 + offset)
                copy = torch.full((n + offset,), 7.0, dtype=dtype)[offset:]  # 7: not any cast value
                opt = make(p)
                for _ in range(2):
                    p.grad = torch.randn(n, generator=gen)
                    opt.step(copies={p: copy})
                assert torch.equal(copy, p.detach().to(dtype)), (offset, type(opt).__name__, threads)


def test_grad_scale_equals_prescaled_grad():
    n = 50_001
    p, q, gen = pair(n, 5)
    scale = 1 / 1024 * 0.73
    ours, twin = pz.optim.AdamW([p], lr=1e-2), pz.optim.AdamW([q], lr=1e-2)
    for _ in range(5):
        g = torch.randn(n, generator=gen) * 1024
        p.grad, q.grad = g.clone(), g * scale
        ours.step(grad_scale=scale), twin.step()
    assert ulp_diff(p.detach(), q.detach()).max().item() <= 1
    assert torch.equal(p, q)  # g * scale is the same single rounding either way


def test_state_dict_loads_into_torch_and_back():
    p, q, gen = pair(1001, 6)
    ours = pz.optim.AdamW([p], lr=1e-2, amsgrad=True)
    ref = torch.optim.AdamW([q], lr=1e-2, amsgrad=True, foreach=False)
    g = dyadic_grad(1001, gen)
    p.grad, q.grad = g.clone(), g.clone()
    ours.step()
    ref.load_state_dict(ours.state_dict())  # ours -> torch
    back = pz.optim.AdamW([p], lr=1.0)
    back.load_state_dict(ref.state_dict())  # torch -> ours
    assert back.param_groups[0]["lr"] == 1e-2
    for key in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq"):
        assert torch.equal(ref.state[q][key], ours.state[p][key])
        assert torch.equal(back.state[p][key], ours.state[p][key])
    assert back.state[p]["step"].item() == 1.0


@pytest.mark.parametrize("cls", ["AdamW", "Adagrad"])
def test_step_counts_of_many_params_with_gaps_and_reload(cls):
    """Step counts (bumped together, as views of one tensor per list) follow torch's per parameter
    while the parameters with gradients change, survive a state_dict round trip through torch and
    an in-place reload, and every step moves the parameters as torch's (foreach=False) does, to
    the rounding of sqrt (compared per step from the same state, as above); the counts enter the
    update through Adam's bias corrections and Adagrad's lr_decay."""
    gen = torch.Generator().manual_seed(11)
    ps = [torch.randn(17 + i, generator=gen) for i in range(12)]
    ours_p = [p.clone().requires_grad_() for p in ps]
    ref_p = [p.clone().requires_grad_() for p in ps]
    kw = dict(lr=1e-2) if cls == "AdamW" else dict(lr=1e-2, lr_decay=0.5)
    ours = getattr(pz.optim, cls)(ours_p, **kw)
    ref = getattr(torch.optim, cls)(ref_p, foreach=False, **kw)
    for step in range(12):
        if step == 7:  # torch -> ours, mid-run
            ours.load_state_dict(copy.deepcopy(ref.state_dict()))  # as from a file: no tensor shared
        for i, (a, b) in enumerate(zip(ours_p, ref_p)):
            if step in (3, 4, 9) and (i + step) % 3 == 0:  # no gradient this step (all have one otherwise)
                a.grad = b.grad = None
                continue
            a.grad = dyadic_grad(a.numel(), gen)
            b.grad = a.grad.clone()
        olds = [b.detach().clone() for b in ref_p]
        ours.step(), ref.step()
        for a, b, old in zip(ours_p, ref_p, olds):
            if b in ref.state:
                assert ours.state[a]["step"].item() == ref.state[b]["step"].item()
                assert ours.state[a]["step"].dtype == torch.float32 and ours.state[a]["step"].dim() == 0
            mag = torch.maximum(old.abs(), b.detach().abs())
            spacing = torch.nextafter(mag, torch.tensor(float("inf"))) - mag
            assert ((a.detach() - b.detach()).abs() / spacing).max().item() <= 4.0, (cls, step)
            with torch.no_grad():
                a.copy_(b)
    saved = torch.optim.AdamW if cls == "AdamW" else torch.optim.Adagrad
    back = saved([p.detach().clone().requires_grad_() for p in ours_p], **kw)
    back.load_state_dict(ours.state_dict())  # ours -> torch: the counts as torch keeps them
    assert [st["step"].item() for st in back.state.values()] == [ref.state[b]["step"].item() for b in ref_p]


def test_unchanged_tensors_skip_checks_moved_and_replaced_ones_are_checked_again():
    """A step over the parameters and states the last step checked skips their checks; a
    parameter whose data moved, a state replaced by a good tensor, a wrong dtype or a wrong size
    is checked again (the bad ones raise naming the list), and nothing the optimizer no longer
    uses stays alive: not last step's gradients, not the states a load_state_dict replaced."""
    import gc
    import weakref

    gen = torch.Generator().manual_seed(12)
    ours_p = [torch.randn(40 + i, generator=gen).requires_grad_() for i in range(3)]
    ref_p = [p.detach().clone().requires_grad_() for p in ours_p]
    ours, ref = pz.optim.AdamW(ours_p, lr=1e-2), torch.optim.AdamW(ref_p, lr=1e-2, foreach=False)

    def step():
        for a, b in zip(ours_p, ref_p):
            a.grad = dyadic_grad(a.numel(), gen)
            b.grad = a.grad.clone()
        olds = [b.detach().clone() for b in ref_p]
        ours.step(), ref.step()
        for a, b, old in zip(ours_p, ref_p, olds):
            mag = torch.maximum(old.abs(), b.detach().abs())
            spacing = torch.nextafter(mag, torch.tensor(float("inf"))) - mag
            assert ((a.detach() - b.detach()).abs() / spacing).max().item() <= 4.0
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(ours.state[a][key], ref.state[b][key])
            with torch.no_grad():
                a.copy_(b)

    step(), step()
    ours_p[1].data = ours_p[1].data.clone()  # the same parameter, its data elsewhere
    step()
    kept = ours_p[1].data
    ours_p[1].data = kept.double()  # the same parameter object, no longer float32
    with pytest.raises(ValueError, match=r"params\[1\]: expected a dense float32 CPU tensor"):
        ours.step()
    ours_p[1].data = kept  # (the refused step counted nothing: see test_a_refused_step_changes_nothing...)
    step()
    a = ours_p[0]
    ours.state[a]["exp_avg"] = ours.state[a]["exp_avg"].clone()  # a new state tensor, same values
    step()
    good = ours.state[a]["exp_avg_sq"]
    ours.state[a]["exp_avg_sq"] = good.double()
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\]: expected a dense float32 CPU tensor"):
        ours.step()
    ours.state[a]["exp_avg_sq"] = good[1:].clone()
    with pytest.raises(ValueError, match=r"exp_avg_sqs\[0\]: has 39 elements, the parameter has 40"):
        ours.step()
    ours.state[a]["exp_avg_sq"] = good
    step()
    grad = weakref.ref(ours_p[2].grad)
    old_state = weakref.ref(ours.state[ours_p[2]]["exp_avg"])
    for p in ours_p:
        p.grad = None
    gc.collect()
    assert grad() is None
    ours.load_state_dict(copy.deepcopy(ref.state_dict()))
    gc.collect()
    assert old_state() is None
    step()


@pytest.mark.parametrize("cls", ["AdamW", "SGD", "Adagrad"])
def test_step_hooks_profiler_and_lr_scheduler_as_torch(cls):
    """pz.optim's step skips torch's step wrapper when nothing listens, and only then: step
    pre/post hooks (per optimizer and global) run around it as torch runs them (a pre-hook's
    (args, kwargs) replace the call's), the profiler records "Optimizer.step#<class>.step" as for
    torch's own optimizers, and an lr scheduler sees the step (no out-of-order warning)."""
    import warnings

    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    def run(mod):
        p = torch.ones(8, requires_grad=True)
        opt = getattr(mod, cls)([p], lr=0.5)
        calls = []
        h = [opt.register_step_pre_hook(lambda o, a, k: calls.append(("pre", o is opt, a == (opt,), dict(k)))),
             opt.register_step_post_hook(lambda o, a, k: calls.append(("post", o is opt, a == (opt,), dict(k)))),
             register_optimizer_step_pre_hook(lambda o, a, k: calls.append(("global pre", o is opt))),
             register_optimizer_step_post_hook(lambda o, a, k: calls.append(("global post", o is opt)))]
        p.grad = torch.full_like(p, 0.25)
        opt.step()
        for handle in h:
            handle.remove()
        p.grad = torch.full_like(p, 0.25)
        opt.step()  # no hook now: the direct path
        double = opt.register_step_pre_hook(lambda o, a, k: (a, {"closure": lambda: 7.0}))
        p.grad = torch.full_like(p, 0.25)
        loss = opt.step()
        double.remove()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            p.grad = torch.full_like(p, 0.25)
            opt.step()
        names = {e.name for e in prof.events()}
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            p.grad = torch.full_like(p, 0.25)
            opt.step()
            sched.step()
        return calls, loss, f"Optimizer.step#{cls}.step" in names, opt.param_groups[0]["lr"], p.detach()

    ours, ref = run(pz.optim), run(torch.optim)
    assert ours[0] == ref[0] == [("global pre", True), ("pre", True, True, {}), ("post", True, True, {}),
                                 ("global post", True)]
    assert ours[1] == ref[1] == 7.0
    assert ours[2] and ref[2]
    assert ours[3] == ref[3] == 0.25
    assert torch.allclose(ours[4], ref[4], rtol=1e-6, atol=0)


def test_param_groups_and_params_without_grad():
    a, b, c = (torch.randn(33, requires_grad=True) for _ in range(3))
    ta, tb, tc = (t.detach().clone().requires_grad_() for t in (a, b, c))
    ours = pz.optim.SGD([{"params": [a, b]}, {"params": [c], "lr": 0.5}], lr=0.1, momentum=0.9)
    ref = torch.optim.SGD([{"params": [ta, tb]}, {"params": [tc], "lr": 0.5}], lr=0.1, momentum=0.9,
                          foreach=False)
    for step in range(3):
        for x, y in ((a, ta), (b, tb), (c, tc)):
            if x is b and step == 0:
                continue  # b has no gradient on the first step: it starts its buffer later
            x.grad = torch.full_like(x, 0.25 * (step + 1))
            y.grad = x.grad.clone()
        ours.step(), ref.step()
        for x in (a, b, c):
            x.grad = None
        for y in (ta, tb, tc):
            y.grad = None
    for x, y in ((a, ta), (b, tb), (c, tc)):
        assert torch.equal(x, y)


def test_bad_input_names_argument():
    p = torch.randn(10, dtype=torch.float64, requires_grad=True)
    p.grad = torch.randn(10, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"params\[0\]: expected a dense float32 CPU tensor"):
        pz.optim.AdamW([p]).step()
    with pytest.raises(ValueError, match="betas"):
        pz.optim.Adam([torch.randn(2, requires_grad=True)], betas=(1.0, 0.9))
    with pytest.raises(ValueError, match="threads"):
        pz.optim.SGD([torch.randn(2, requires_grad=True)], threads=0)
    with pytest.raises(ValueError, match="isa"):
        pz.optim.SGD([torch.randn(2, requires_grad=True)], isa="sse9")
    q = torch.randn(10, requires_grad=True)
    q.grad = torch.randn(10)
    with pytest.raises(ValueError, match=r"copies\[0\]: has 5 elements"):
        pz.optim.AdamW([q]).step(copies={q: torch.empty(5, dtype=torch.bfloat16)})


@pytest.mark.parametrize("arg", ["lr_decay", "weight_decay", "initial_accumulator_value", "eps"])
def test_adagrad_refuses_nan_as_torch_does(arg):
    """A NaN setting would turn every parameter into NaN at the first step; torch refuses it."""
    p = torch.randn(4, requires_grad=True)
    with pytest.raises(ValueError):
        torch.optim.Adagrad([p], **{arg: float("nan")})
    with pytest.raises(ValueError, match=f"{arg}: expected >= 0, got nan"):
        pz.optim.Adagrad([p], **{arg: float("nan")})


def pythagorean_grads(n, gen):
    """Per element a power-of-two scale and sign times 3, 4, 12, 84, 3612: the running sum of
    squares is 9, 25, 169, 7225, 3613^2 (times the scale squared), a perfect square every step."""
    scale = 2.0 ** torch.randint(-6, 0, (n,), generator=gen).float()
    sign = torch.randint(0, 2, (n,), generator=gen).float() * 2 - 1
    return [sign * scale * k for k in (3, 4, 12, 84, 3612)]


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("maximize", [False, True])
def test_adagrad_bitwise_equal_to_torch_when_sqrt_exact(n, maximize):
    p, q, gen = pair(n, 7)
    kw = dict(lr=0.1, lr_decay=0.01, eps=0.0, maximize=maximize)
    ours, ref = pz.optim.Adagrad([p], threads=2, **kw), torch.optim.Adagrad([q], foreach=False, **kw)
    for g in pythagorean_grads(n, gen):
        p.grad, q.grad = g.clone(), g.clone()
        ours.step(), ref.step()
    assert torch.equal(ours.state[p]["sum"], ref.state[q]["sum"])
    assert torch.equal(p, q)


def test_adagrad_random_grads_with_weight_decay():
    n = 100_003
    p, q, gen = pair(n, 8)
    kw = dict(lr=0.05, weight_decay=0.01, initial_accumulator_value=0.1)
    ours, ref = pz.optim.Adagrad([p], **kw), torch.optim.Adagrad([q], foreach=False, **kw)
    for _ in range(5):
        old = q.detach().clone()
        g = torch.randn(n, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step(), ref.step()
        assert torch.equal(ours.state[p]["sum"], ref.state[q]["sum"])
        mag = torch.maximum(old.abs(), q.detach().abs())
        spacing = torch.nextafter(mag, torch.tensor(float("inf"))) - mag
        assert ((p.detach() - q.detach()).abs() / spacing).max().item() <= 4.0
        with torch.no_grad():
            p.copy_(q)
    sd = ours.state_dict()
    assert set(sd["state"][0]) == {"step", "sum"} and sd["state"][0]["step"].item() == 5


def test_adam_decoupled_weight_decay_as_torch():
    """torch.optim.Adam(decoupled_weight_decay=True) is AdamW: so is pz.optim.Adam's, and a torch
    state dict that says so keeps saying so when loaded (pz.optim.AdamW takes no such switch, as torch's)."""
    n = 1001
    p, q, gen = pair(n, 11)
    r = q.detach().clone().requires_grad_()
    kw = dict(lr=1e-2, betas=(0.8, 0.0), weight_decay=0.1)
    ours = pz.optim.Adam([p], decoupled_weight_decay=True, **kw)
    ref = torch.optim.Adam([q], foreach=False, decoupled_weight_decay=True, **kw)
    plain = torch.optim.Adam([r], foreach=False, **kw)  # (coupled: another result)
    for _ in range(4):
        g = dyadic_grad(n, gen)
        p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
        ours.step(), ref.step(), plain.step()
    assert torch.equal(p, q) and not torch.equal(q, r)
    back = pz.optim.Adam([p], lr=1.0)
    back.load_state_dict(copy.deepcopy(ref.state_dict()))  # (torch's load keeps the tensors it is given)
    assert back.param_groups[0]["decoupled_weight_decay"] is True
    g = dyadic_grad(n, gen)
    p.grad, q.grad = g.clone(), g.clone()
    back.step(), ref.step()
    assert torch.equal(p, q)
    with pytest.raises(TypeError, match="decoupled_weight_decay"):
        pz.optim.AdamW([p], decoupled_weight_decay=True)


@pytest.mark.parametrize("cls", ["Adam", "SGD"])
def test_maximize_and_torch_switches(cls):
    n = 4099
    p, q, gen = pair(n, 9)
    kw = dict(lr=1e-2, maximize=True, weight_decay=0.01)
    kw.update(dict(betas=(0.8, 0.0)) if cls == "Adam" else dict(momentum=0.9))
    ours = getattr(pz.optim, cls)([p], foreach=True, fused=True, **kw)  # torch's switches are accepted
    ref = getattr(torch.optim, cls)([q], foreach=False, **kw)
    for _ in range(5):
        g = dyadic_grad(n, gen)
        p.grad, q.grad = g.clone(), g.clone()
        ours.step(), ref.step()
    assert torch.equal(p, q)
    with pytest.raises(ValueError, match="differentiable: not supported"):
        getattr(pz.optim, cls)([p], differentiable=True)


def test_optim_bench_runs_with_many_tensors(tmp_path, capsys):
    """pyzero-bench optim at a tiny size, the parameters in several tensors, both steps: a row per
    run and step, the ratios against torch's fused AdamW from the times printed beside them."""
    import argparse
    import json

    from pyzero.bench import optim as bench
    from pyzero.bench.common import UsageError

    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    out = tmp_path / "optim.json"
    args = p.parse_args(["--min", "4K", "--max", "4K", "--tensors", "5", "--runs", "pz,torch-fused", "--threads", "1",
                         "--iters", "2", "--warmup", "1", "--stream-mib", "1", "--json", str(out)])
    assert bench.main(args) == 0
    rows = json.loads(out.read_text())["results"]
    assert sorted((r["step"], r["run"]) for r in rows) == [("offload", "pz"), ("offload", "torch-fused"),
                                                           ("plain", "pz"), ("plain", "torch-fused")]
    for step in ("plain", "offload"):
        pz_row, ref = (next(r for r in rows if r["step"] == step and r["run"] == run) for run in ("pz", "torch-fused"))
        assert pz_row["tensors"] == 5 and pz_row["params"] == 4096
        assert pz_row["speedup_vs_torch_fused"] == pytest.approx(ref["ms"] / pz_row["ms"])
    assert "parameters in 5 tensor(s)" in capsys.readouterr().out
    with pytest.raises(UsageError, match="--tensors"):
        bench.main(p.parse_args(["--min", "4K", "--max", "4K", "--tensors", "5000"]))


def test_adagrad_starts_its_sums_as_torch_does():
    """A group's own initial_accumulator_value: torch's Adagrad starts every sum at the constructor's (it
    takes no group's own), and so does pz.optim's; a state dict without a parameter's state (a checkpoint
    saved without the optimizer state) makes it afresh at the next step, as torch's does."""
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(64, generator=gen), torch.randn(8, generator=gen)
    grads = [(torch.randn(64, generator=gen), torch.randn(8, generator=gen)) for _ in range(4)]
    runs = []
    for cls, kw in ((pz.optim.Adagrad, {}), (torch.optim.Adagrad, {"foreach": False})):
        p, q = torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone())

        def make():
            return cls([{"params": [p], "initial_accumulator_value": 1.0}, {"params": [q]}], lr=0.1, **kw)
        opt = make()
        for k, (gp, gq) in enumerate(grads):
            if k == 2:  # the state left out: started afresh (torch: a new optimizer; 2.11's cannot load it)
                if cls is pz.optim.Adagrad:
                    opt.load_state_dict({"state": {}, "param_groups": opt.state_dict()["param_groups"]})
                else:
                    opt = make()
            p.grad, q.grad = gp.clone(), gq.clone()
            opt.step()
        runs.append((p.detach(), q.detach()))
    (p1, q1), (p2, q2) = runs
    torch.testing.assert_close(p1, p2, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(q1, q2, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("cls,kw", [("Adam", dict(lr=0.1)), ("AdamW", dict(lr=0.1, amsgrad=True)),
                                    ("Adagrad", dict(lr=0.1, lr_decay=0.5)),
                                    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.5))])
@pytest.mark.parametrize("where", ["first step", "one group", "second group", "second step count"])
def test_a_refused_step_changes_nothing_and_its_retry_equals_torch(cls, kw, where):
    """A step refused by its checks (a non-contiguous gradient: at the first step, in the only group,
    in a later group, or among parameters at another step count) leaves every parameter, step count and state as it
    was, so the same step retried with the gradient mended, and the steps after it, equal torch's
    (its step counts moved Adam's bias correction and Adagrad's lr_decay by one; SGD kept the
    uninitialised momentum buffer it had made)."""
    gen = torch.Generator().manual_seed(5)
    ps = [torch.randn(4, 4, generator=gen) for _ in range(3)]
    ours_p = [p.clone().requires_grad_() for p in ps]
    ref_p = [p.clone().requires_grad_() for p in ps]
    groups = (lambda q: [{"params": q[:2]}, {"params": q[2:]}]) if where == "second group" else (lambda q: q)
    ours = getattr(pz.optim, cls)(groups(ours_p), **kw)
    ref = getattr(torch.optim, cls)(groups(ref_p), foreach=False, **kw)
    grads = [[torch.randn(4, 4, generator=gen) for _ in ps] for _ in range(4)]
    for step, gs in enumerate(grads):
        if step == 1 and where == "second step count":  # parameter 2 sits out a step: its count falls behind
            gs = gs[:2] + [None]
        for a, b, g in zip(ours_p, ref_p, gs):
            a.grad, b.grad = (None, None) if g is None else (g.clone(), g.clone())
        if step == (0 if where == "first step" else 2):
            before = copy.deepcopy(ours.state_dict()), [p.detach().clone() for p in ours_p]
            ours_p[2].grad = gs[2].t().contiguous().t()  # the same values, not contiguous
            with pytest.raises(ValueError, match=r"expected a contiguous tensor"):
                ours.step()
            after = ours.state_dict()
            assert [torch.equal(a, b) for a, b in zip(before[1], ours_p)] == [True] * 3
            for i, st in before[0]["state"].items():
                assert st.keys() == after["state"][i].keys()
                for k, v in st.items():
                    assert torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][i][k])), (i, k)
            assert set(before[0]["state"]) == set(after["state"])
            ours_p[2].grad = gs[2].clone()
        ours.step(), ref.step()
        for a, b in zip(ours_p, ref_p):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


# ---- NvmeAdamW: a refused step, amsgrad turned on later, the swap files on del ---------------------------


def _nvme_and_torch(tmp_path, groups, **kw):
    """NvmeAdamW over three parameters of 40 elements in sub-groups of 48 (three swap files: parameter 2
    is stepped and written last) and torch's AdamW over copies, both built from `groups(params)`."""
    gen = torch.Generator().manual_seed(7)
    init = [torch.randn(40, generator=gen) for _ in range(3)]
    ps = [t.clone().requires_grad_() for t in init]
    qs = [t.clone().requires_grad_() for t in init]
    ours = pz.optim.NvmeAdamW(groups(ps), lr=0.1, nvme_path=tmp_path, sub_group_elems=48, **kw)
    ref = torch.optim.AdamW(groups(qs), lr=0.1, foreach=False, **kw)
    assert len(ours._segments) == 3
    return ps, qs, ours, ref, gen


def _set_grads(ps, qs, gen):
    for p, q in zip(ps, qs):
        g = torch.randn(40, generator=gen)
        p.grad, q.grad = g.clone(), g.clone()


@pytest.mark.parametrize("refusal", ["copies", "lr", "betas"])
def test_nvme_refused_step_changes_nothing_and_its_retry_equals_torch(tmp_path, refusal):
    """A step refused for a bad copy of the last parameter, or a NaN lr or beta in the last param group,
    raises before any step count moves or any sub-group is stepped and written (every count was bumped
    and the first sub-groups were on disk): the state and the parameters are as before, and the step
    retried, and the one after it, equal torch's AdamW."""
    two = lambda xs: [{"params": xs[:2]}, {"params": xs[2:]}]  # noqa: E731
    ps, qs, ours, ref, gen = _nvme_and_torch(tmp_path, two)
    _set_grads(ps, qs, gen)
    ours.step(), ref.step()
    _set_grads(ps, qs, gen)
    before = copy.deepcopy(ours.state_dict()), [p.detach().clone() for p in ps]
    kw = {}
    if refusal == "copies":
        kw["copies"] = {ps[0]: torch.empty(40, dtype=torch.bfloat16), ps[2]: torch.empty(3, dtype=torch.bfloat16)}
        match = r"copies\[0\]: has 3 elements, the parameter has 40"
    elif refusal == "lr":
        ours.param_groups[1]["lr"] = float("nan")
        match = "lr: got NaN"
    else:
        ours.param_groups[1]["betas"] = (0.9, float("nan"))
        match = r"betas\[1\]: got NaN"
    with pytest.raises(ValueError, match=match):
        ours.step(**kw)
    after = ours.state_dict()
    assert [after["state"][i]["step"].item() for i in range(3)] == [1.0, 1.0, 1.0]
    for i, st in before[0]["state"].items():
        for k, v in st.items():
            assert torch.equal(v, after["state"][i][k]), (i, k)
    assert all(torch.equal(p, b) for p, b in zip(ps, before[1]))
    ours.param_groups[1].update(lr=0.1, betas=(0.9, 0.999))
    copies = {p: torch.empty(40, dtype=torch.bfloat16) for p in ps}
    for _ in range(2):
        ours.step(copies=copies), ref.step()
        _set_grads(ps, qs, gen)
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
        assert torch.equal(copies[p], p.detach().to(torch.bfloat16))
    assert [ours.state[p]["step"].item() for p in ps] == [3.0, 3.0, 3.0]
    for p, q in zip(ps, qs):
        for k in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[p][k], ref.state[q][k], rtol=1e-6, atol=0)


def test_nvme_amsgrad_turned_on_after_construction_starts_its_max_at_zero(tmp_path, monkeypatch):
    """A param group that turns amsgrad on after construction: the swap files grow by max_exp_avg_sq, zeros,
    as pz.optim.AdamW starts it then (an IndexError before). Reference: torch's AdamW with that state set to
    zeros by hand when amsgrad is turned on (torch's own raises KeyError: it makes the state at the first step
    only). A disk too small for the growth refuses the step, naming nvme_path, before anything changes."""
    two = lambda xs: [{"params": xs[:2]}, {"params": xs[2:]}]  # noqa: E731
    ps, qs, ours, ref, gen = _nvme_and_torch(tmp_path, two, betas=(0.9, 0.99))
    for step in range(4):
        _set_grads(ps, qs, gen)
        if step == 2:
            ours.param_groups[1]["amsgrad"] = ref.param_groups[1]["amsgrad"] = True
            ref.state[qs[2]]["max_exp_avg_sq"] = torch.zeros(40)
            with monkeypatch.context() as m:
                m.setattr(pz.optim.swap.os, "statvfs", lambda _: SimpleNamespace(f_bavail=0, f_frsize=4096))
                with pytest.raises(ValueError, match="nvme_path: .* has 0 bytes free, the swap files need 12.00 KiB"):
                    ours.step()
            assert [ours.state[p]["step"].item() for p in ps] == [2.0, 2.0, 2.0]
            assert "max_exp_avg_sq" not in ours.state[ps[2]]
        ours.step(), ref.step()
    for p, q in zip(ps, qs):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ours.state[ps[2]]["max_exp_avg_sq"], ref.state[qs[2]]["max_exp_avg_sq"],
                               rtol=1e-6, atol=0)
    assert not torch.equal(ours.state[ps[2]]["max_exp_avg_sq"], ours.state[ps[2]]["exp_avg_sq"])


def test_nvme_swap_files_go_with_the_optimizer_without_a_gc_pass(tmp_path):
    """`del opt` removes the swap directory at once, with the cyclic garbage collector off: the state mapping
    held its optimizer (a reference cycle), and so did a step's chained transfers, so the directory stayed
    until a collection pass (repeated build, step, del filled a small disk)."""
    gc.collect()
    gc.disable()
    try:
        for _ in range(2):
            ps = [torch.randn(40).requires_grad_() for _ in range(3)]
            opt = pz.optim.NvmeAdamW(ps, lr=0.1, nvme_path=tmp_path, sub_group_elems=48)
            for p in ps:
                p.grad = torch.ones(40)
            opt.step(copies={p: torch.empty(40, dtype=torch.bfloat16) for p in ps})
            state = opt.state
            assert len(opt.state_dict()["state"]) == 3 and len(os.listdir(tmp_path)) == 1
            del opt
            assert os.listdir(tmp_path) == []
            with pytest.raises(ReferenceError, match="optimizer of this state was deleted"):
                state[ps[0]]
    finally:
        gc.enable()
