"""Loss scaling: ZeroOptimizer(loss_scale=) skips a step on every rank when any rank's gradients
overflow, halves the scale, grows it after good steps, and otherwise trains exactly as unscaled
(power-of-two scales are exact); DataParallel works with torch.amp.GradScaler."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks

STEPS, BATCH = 5, 8
INF_STEP = 2  # rank 1's gradients get an inf at this step


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 3))


def data(step, rank):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(BATCH, 6, generator=g), torch.randn(BATCH, 3, generator=g)



def _zero_run(stage, loss_scale, inject):
    model = make_model()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2, loss_scale=loss_scale, bucket_mb=1e-4)
    scales, norms = [], []
    for step in range(STEPS):
        x, y = data(step, pz.get_rank())
        scales.append(opt.loss_scale)
        if inject and step == INF_STEP and pz.get_rank() == 1:
            h = model[0].weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                                    torch.tensor(float("inf"))))
        opt.scale_loss(F.mse_loss(model(x), y)).backward()
        if inject and step == INF_STEP and pz.get_rank() == 1:
            h.remove()
        norms.append(float(opt.clip_grad_norm_(10.0)))
        opt.step()
    return {"state": opt.full_state_dict(), "scales": scales + [opt.loss_scale], "norms": norms,
            "skipped": opt.scaler.skipped if opt.scaler else 0, "sd_scaler": opt.state_dict().get("scaler")}


def _rank_zero():
    pz.init(timeout=30)
    out = {}
    for stage in (1, 2, 3):
        out[stage, "none"] = _zero_run(stage, None, False)
        out[stage, "static"] = _zero_run(stage, 2.0**10, False)
        out[stage, "dynamic"] = _zero_run(stage, dict(init_scale=2.0**16, growth_interval=2), True)
    return out


@pytest.fixture(scope="module")
def zero_runs():
    return [r.value for r in run_ranks(_rank_zero, 2, timeout=90)]


def reference(skip):
    """One process, the two ranks' batches averaged; the step in `skip` does not happen."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        if step in skip:
            continue
        loss = sum(F.mse_loss(model(x), y) for x, y in (data(step, 0), data(step, 1))) / 2
        loss.backward()
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        opt.step()
        opt.zero_grad()
    return {k: v.detach() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_static_power_of_two_scale_trains_exactly_as_unscaled(zero_runs, stage):
    r0 = zero_runs[0]
    for k, v in r0[stage, "none"]["state"].items():
        assert torch.equal(r0[stage, "static"]["state"][k], v), k
    assert r0[stage, "static"]["norms"] == r0[stage, "none"]["norms"]  # clipping sees unscaled gradients
    assert r0[stage, "static"]["scales"] == [2.0**10] * (STEPS + 1)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_overflow_on_one_rank_skips_the_step_everywhere(zero_runs, stage):
    ref = reference(skip={INF_STEP})
    got = zero_runs[0][stage, "dynamic"]
    for k, v in ref.items():
        torch.testing.assert_close(got["state"][k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    assert got["norms"][INF_STEP] == float("inf") and all(n < 1e30 for i, n in enumerate(got["norms"])
                                                         if i != INF_STEP)
    # growth_interval 2: x2 after steps 0-1, /2 at the overflow, x2 after steps 3-4
    assert got["scales"] == [2.0**16, 2.0**16, 2.0**17, 2.0**16, 2.0**16, 2.0**17]
    assert got["skipped"] == 1 and got["sd_scaler"] == {"scale": 2.0**17, "good_steps": 2, "skipped": 1}
    for r in zero_runs[1:]:  # rank 1 (which overflowed) skipped too: same scale history
        assert r[stage, "dynamic"]["scales"] == got["scales"]
    # against a run that really takes the step: the skip made a difference
    taken = reference(skip=set())
    assert not torch.equal(taken["0.weight"], ref["0.weight"])


def _rank_fp16_overflow():
    pz.init(timeout=30)
    model = make_model()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3, param_dtype=torch.float16,
                           loss_scale="dynamic")
    for step in range(12):
        x, y = data(step, pz.get_rank())
        loss = F.mse_loss(model(x.half()).float(), y) * 100  # fp16 gradients overflow at 2**16
        opt.scale_loss(loss).backward()
        opt.step()
    full = opt.full_state_dict()
    return {"skipped": opt.scaler.skipped, "scale": opt.loss_scale,
            "finite": None if full is None else all(bool(torch.isfinite(v).all()) for v in full.values())}


def test_fp16_parameters_overflow_then_train():
    for r in run_ranks(_rank_fp16_overflow, 2, timeout=60):
        assert r.value["skipped"] >= 1 and r.value["scale"] < 2.0**16
        assert r.value["skipped"] < 12  # the scale came down far enough to step
    assert run_ranks(_rank_fp16_overflow, 2, timeout=60)[0].value["finite"]


def _rank_dp_gradscaler():
    pz.init(timeout=30)
    model = make_model()
    dp = pz.DataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**8, growth_interval=2)
    for step in range(STEPS):
        x, y = data(step, pz.get_rank())
        if step == INF_STEP and pz.get_rank() == 1:
            h = model[0].weight.register_hook(lambda g: g.index_put((torch.tensor([0]), torch.tensor([0])),
                                                                    torch.tensor(float("inf"))))
        scaler.scale(F.mse_loss(dp(x), y)).backward()
        if step == INF_STEP and pz.get_rank() == 1:
            h.remove()
        scaler.unscale_(opt)
        nn.utils.clip_grad_norm_(model.parameters(), 10.0)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_data_parallel_with_torch_gradscaler_skips_on_every_rank():
    ref = reference(skip={INF_STEP})
    for r in run_ranks(_rank_dp_gradscaler, 2, timeout=60):
        for k, v in ref.items():
            torch.testing.assert_close(r.value[k], v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("spec,words", [("static", ["loss_scale", "'static'"]), (-1.0, ["init_scale"]),
                                        (dict(backoff_factor=2.0), ["backoff_factor"]),
                                        (dict(growth_interval=0), ["growth_interval"])])
def test_bad_loss_scale(spec, words):
    def rank():
        pz.init(timeout=10)
        try:
            pz.ZeroOptimizer(make_model(), torch.optim.AdamW, loss_scale=spec)
        except ValueError as e:
            return str(e)
        return None
    msg = run_ranks(rank, 1, timeout=30)[0].value
    assert msg is not None and all(w in msg for w in words), msg


def _rank_host_clip_at_large_scales():
    from pyzero.zero import optimizer as zero_optimizer

    pz.init(backend="shm", timeout=30)
    zero_optimizer._host_copies = lambda device: True  # the host path a CUDA model's offload takes
    per = 4
    lo = pz.get_rank() * per
    out = {}
    for scale in (2.0**16, 2.0**70):  # (the squares of gradients scaled by 2**70 overflow fp32)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, offload="cpu", lr=1e-2,
                               loss_scale={"init_scale": scale, "dynamic": False})
        norms = []
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            opt.zero_grad()
            opt.scale_loss(F.mse_loss(model(x[lo:lo + per]), y[lo:lo + per])).backward()
            norms.append(float(opt.clip_grad_norm_(0.3)))
            opt.step()
        out[scale] = norms, {k: v.detach().clone() for k, v in model.state_dict().items()}
    return out


def test_host_clipping_at_a_scale_whose_squares_overflow_fp32():
    """The host path (a CUDA model's offload) clips its raw, scaled gradients: at a scale of 2**70 their fp32
    squares overflow, the norm came out inf and every step applied a zero gradient; it is the norm of the
    unscaled gradients there too, and the run trains as at 2**16."""
    got = run_ranks(_rank_host_clip_at_large_scales, 2, timeout=60)[0].value
    (n16, w16), (n70, w70) = got[2.0**16], got[2.0**70]
    assert all(math.isfinite(n) for n in n70), n70
    for a, b in zip(n16, n70):
        assert a == pytest.approx(b, rel=1e-6)
    for k, v in w16.items():
        torch.testing.assert_close(w70[k], v, rtol=1e-5, atol=1e-6)


def _hooked_run(opt, model, scaler=None, clip=None):
    """4 steps with the loss scaled (2**16, doubled after 2 good steps), an inf in step 1's input: a step pre-hook
    records the norm of the gradients it finds in param_groups and halves them, a post-hook records its call.
    `scaler`: a torch.amp.GradScaler stepping the torch optimizer `opt`; else a ZeroOptimizer with loss_scale.
    `clip`: clip_grad_norm_ to it before the step (torch: after scaler.unscale_)."""
    calls, scales = [], []

    def pre(o, args, kwargs):
        grads = [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]
        calls.append(("pre", math.sqrt(sum(float(g.double().pow(2).sum()) for g in grads))))
        for g in grads:
            g.mul_(0.5)
    opt.register_step_pre_hook(pre)
    opt.register_step_post_hook(lambda o, args, kwargs: calls.append(("post",)))
    for step in range(4):
        x, y = data(step, 0)
        if step == 1:
            x[0, 0] = float("inf")
        opt.zero_grad()
        scales.append(opt.loss_scale if scaler is None else scaler.get_scale())
        loss = F.mse_loss(model(x), y)
        if scaler is None:
            opt.scale_loss(loss).backward()
            if clip:
                opt.clip_grad_norm_(clip)
            opt.step()
        else:
            scaler.scale(loss).backward()
            if clip:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        calls.append(step)
    state = opt.full_state_dict() if scaler is None else model.state_dict()
    return calls, scales, {k: v.detach().clone() for k, v in state.items()}


def _rank_hooked():
    from pyzero.zero import optimizer as zero_optimizer

    pz.init(timeout=30)
    out = {}
    for host in (False, True):
        zero_optimizer._host_copies = lambda device, host=host: host  # True: the host path a CUDA model's offload takes
        for stage in (1, 2, 3):
            for clip in (None, 0.5):
                model = make_model()
                opt = pz.ZeroOptimizer(model, torch.optim.SGD, stage=stage, lr=0.1, momentum=0.9,
                                       offload="cpu" if host else None,
                                       loss_scale={"init_scale": 2.0**16, "growth_interval": 2})
                out[host, stage, clip] = _hooked_run(opt, model, clip=clip)
    return out


def test_step_hooks_see_unscaled_gradients_and_do_not_run_on_a_skipped_step():
    """With loss_scale a step pre-hook saw the gradients times the scale (as torch.amp.GradScaler unscales before
    optimizer.step(), torch's see them unscaled), and both hooks ran on a step skipped for an overflow (GradScaler
    calls no optimizer.step() there); on the host path (a CUDA model's offload) the pre-hook saw them scaled and
    unclipped. Now as torch with GradScaler: what the hooks see and do, the scale, the weights."""
    got = run_ranks(_rank_hooked, 1, timeout=90)[0].value
    for clip in (None, 0.5):
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        want_calls, want_scales, want = _hooked_run(opt, model, torch.amp.GradScaler(
            "cpu", init_scale=2.0**16, growth_interval=2), clip)
        assert [c[0] if isinstance(c, tuple) else c for c in want_calls] == ["pre", "post", 0, 1, "pre", "post", 2,
                                                                            "pre", "post", 3]
        assert want_scales == [2.0**16, 2.0**16, 2.0**15, 2.0**15]
        for host in (False, True):
            for stage in (1, 2, 3):
                calls, scales, state = got[host, stage, clip]
                assert scales == want_scales, (host, stage, clip)
                assert [c[0] if isinstance(c, tuple) else c for c in calls] == [
                    c[0] if isinstance(c, tuple) else c for c in want_calls], (host, stage, clip, calls)
                for c, w in zip(calls, want_calls):
                    if isinstance(c, tuple) and c[0] == "pre":
                        assert c[1] == pytest.approx(w[1], rel=1e-5), (host, stage, clip, calls, want_calls)
                for k, v in want.items():
                    torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6,
                                               msg=lambda m, k=k, h=host, s=stage, c=clip: f"{h} {s} {c} {k}: {m}")


_X, _Y = torch.full((4, 4), 300.0), torch.zeros(4, 1)  # gradients ~2e5: beyond fp16 even unscaled


def _big_grads_model():
    m = nn.Linear(4, 1, bias=False)
    with torch.no_grad():
        m.weight.fill_(0.3)
    return m


def _rank_below_one(spec, steps):
    import warnings

    pz.init(backend="shm")
    r = pz.get_rank()
    model = _big_grads_model()
    opt = pz.ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=1e-9, param_dtype=torch.float16, loss_scale=spec)
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        for _ in range(steps):
            opt.zero_grad()
            x, y = _X[2 * r:2 * r + 2].half(), _Y[2 * r:2 * r + 2]
            opt.scale_loss(F.mse_loss(model(x).float(), y)).backward()
            opt.step()
    full = opt.full_state_dict()
    return (opt.loss_scale, opt.scaler.skipped, None if full is None else full["weight"],
            [str(w.message) for w in ws if issubclass(w.category, RuntimeWarning)])


def test_dynamic_scale_goes_below_one_as_gradscaler_and_a_stuck_scale_warns():
    """fp16 gradients that overflow even unscaled: torch.amp.GradScaler keeps halving (no floor) and
    trains at 0.25 after 18 skipped steps; the scaler stopped at a floor of 1 and skipped every step
    without a word. Now the same scale, skips and weights as GradScaler; a static scale that cannot
    go down, or a floor set by min_scale, warns."""
    master, low = _big_grads_model(), _big_grads_model().half()
    opt = torch.optim.SGD(master.parameters(), lr=1e-9)
    sc = torch.amp.GradScaler("cpu")
    skipped = 0
    for _ in range(30):
        with torch.no_grad():
            low.weight.copy_(master.weight)
        low.weight.grad = None
        sc.scale(F.mse_loss(low(_X.half()).float(), _Y)).backward()
        master.weight.grad = low.weight.grad.float()
        before = master.weight.detach().clone()
        sc.step(opt)
        sc.update()
        skipped += int(torch.equal(before, master.weight))
    scale, skips, weight, warned = run_ranks(_rank_below_one, 2, args=("dynamic", 30), timeout=90)[0].value
    assert (scale, skips) == (sc.get_scale(), skipped) == (0.25, 18)
    torch.testing.assert_close(weight, master.weight.detach(), rtol=1e-6, atol=0)
    assert not warned
    for spec in (1.0, {"init_scale": 1.0, "min_scale": 1.0}):
        scale, skips, _, warned = run_ranks(_rank_below_one, 2, args=(spec, 3), timeout=90)[0].value
        assert (scale, skips) == (1.0, 3) and len(warned) == 3, (spec, warned)
        assert "cannot go down" in warned[0] and ("static" in warned[0]) == (spec == 1.0)
