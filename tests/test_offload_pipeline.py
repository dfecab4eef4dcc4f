"""ZeroOptimizer(offload="cpu", offload_pipeline=...): the host step slot by slot (a bucket's
part of the shard, a stage 3 unit) in a worker thread, during backward where exact (see
[Note: offload pipeline] in pyzero/zero/optimizer.py), and 16-bit host gradient shards.

The path a CUDA model takes (host masters and gradient copies, copies to the "device") runs
here with the CPU as the device. References: a plain-torch mixed-precision loop written here
(torch.optim.AdamW on fp32 masters, torch's clipping, dynamic loss scaling that skips
overflowing steps), and the same ZeroOptimizer with the pipeline off (bitwise).
"""
import copy
import threading

import pytest
import torch

import pyzero as pz
import pyzero.zero.optimizer as zero_optimizer
from pyzero.launch import run_ranks
from test_offload_options import Net, local_loss

STEPS = 5
# overflows fp32 and bf16 in steps 0 and 1 (skipped, the scale halved twice), fits, grows back at
# step 4 and overflows again
SCALING = {"init_scale": 2.0 ** 129, "growth_interval": 2}
RUNS = {"off": dict(pipeline=False), "step": dict(pipeline="step"), "true": dict(pipeline=True),
        "off_clip": dict(pipeline=False, clip=0.5), "step_clip": dict(pipeline="step", clip=0.5),
        "true_clip": dict(pipeline=True, clip=0.5),
        "off_scaled": dict(pipeline=False, loss_scale=SCALING), "true_scaled": dict(pipeline=True, loss_scale=SCALING),
        "off_bf16": dict(pipeline=False, param_dtype=torch.bfloat16),
        "true_bf16": dict(pipeline=True, param_dtype=torch.bfloat16)}


def _train(stage, pipeline, clip=None, loss_scale=None, param_dtype=None, steps=STEPS, device="cpu"):
    """Train; per step whether slots stepped during its backward and (stages 1-2) the model's
    parameters read right after step(); the fp32 masters at the end (rank 0), the loss scale."""
    torch.manual_seed(0)
    model = Net().to(device)
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, offload="cpu", offload_pipeline=pipeline,
                           loss_scale=loss_scale, param_dtype=param_dtype, bucket_mb=0.0001, lr=1e-2,
                           weight_decay=0.1)
    rank, world = pz.get_rank(), pz.get_world_size()
    early, seen = [], []
    for step in range(steps):
        opt.scale_loss(local_loss(model, step, world, rank).float()).backward()
        early.append(opt._steps is not None and opt._steps.any_submitted())
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        if stage < 3:
            seen.append({k: v.float().cpu() for k, v in model.state_dict().items()})
    grads = str(opt._host_grad_dtype)
    final = opt.full_state_dict()
    return early, seen, final and {k: v.cpu() for k, v in final.items()}, opt.loss_scale, grads


def _pipeline_rank(stage):
    pz.init()
    zero_optimizer._host_copies = lambda device: True
    try:
        return {name: _train(stage, **kw) for name, kw in RUNS.items()}
    finally:
        zero_optimizer._host_copies = lambda device: device.type == "cuda"


def reference(steps=STEPS, clip=None, loss_scale=None, param_dtype=None, device="cpu"):
    """Plain torch, mixed precision: the model in param_dtype, torch.optim.AdamW on an fp32
    master copy; the model's parameters after each step, the final masters, the loss scale."""
    torch.manual_seed(0)
    model = Net().to(device)
    master = copy.deepcopy(model)
    if param_dtype is not None:
        model.to(param_dtype)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    scale, growth, good = (loss_scale or {}).get("init_scale", 1.0), (loss_scale or {}).get("growth_interval"), 0
    seen = []
    for step in range(steps):
        model.zero_grad()
        (local_loss(model, step, 1, 0).float() * scale).backward()
        grads = [p.grad.float() / scale for p in model.parameters()]
        if all(torch.isfinite(g).all() for g in grads):
            if clip:  # torch.nn.utils.clip_grad_norm_'s arithmetic
                norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
                coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
                grads = [g * coef for g in grads]
            for q, g in zip(master.parameters(), grads):
                q.grad = g
            opt.step()
            with torch.no_grad():
                for p, q in zip(model.parameters(), master.parameters()):
                    p.copy_(q)
            if growth:
                good += 1
                if good == growth:
                    scale, good = scale * 2, 0
        else:
            scale, good = scale / 2, 0
        seen.append({k: v.float().cpu() for k, v in model.state_dict().items()})
    return seen, {k: v.cpu() for k, v in master.state_dict().items()}, scale


@pytest.mark.parametrize("world,stage", [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3)])
def test_pipeline_matches_plain_torch_and_the_step_without_it(world, stage):
    """Stages 1-3 at 1 and 2 ranks, with and without clipping, fp16-style loss scaling with
    overflowing steps skipped, a bf16 model: the pipeline ("step" and True) gives bit for bit the
    weights of the step without it, and the plain-torch loop's (one rank: within pz.optim's
    1-ulp sqrt against torch's; two ranks: their averaged half-batch gradients round differently,
    as in test_offload_options); the parameters read right after each step() are that step's.
    With True, slots step during backward from the second step on (stages 2-3), never with
    clipping or loss scaling or in stage 1 (which reduces in step())."""
    res = run_ranks(_pipeline_rank, world, args=(stage,), timeout=180)
    tol = dict(rtol=1e-5, atol=1e-6) if world == 1 else dict(rtol=1e-4, atol=2e-5)
    refs = {}
    for name, kw in RUNS.items():
        kw = {k: v for k, v in kw.items() if k != "pipeline"}
        refs[name] = reference(**kw)
    for r in res:
        runs = r.value
        for name in RUNS:
            base = name.split("_", 1)[1] if "_" in name else ""
            off = runs["off" + ("_" + base if base else "")]
            early, seen, final, scale, _ = runs[name]
            want = [False] + [True] * (STEPS - 1) if name in ("true", "true_bf16") and stage > 1 else [False] * STEPS
            assert early == want, (name, early)
            for a, b in zip(seen, off[1]):  # bitwise the run without the pipeline
                for k in a:
                    assert torch.equal(a[k], b[k]), (name, k)
            if final is not None:
                for k in final:
                    assert torch.equal(final[k], off[2][k]), (name, k)
            if "scaled" in name and world > 1:
                continue  # (two ranks' scaled gradients overflow in their sum where the batch's do not)
            ref_seen, ref_final, ref_scale = refs[name]
            assert scale == ref_scale, name
            t = dict(rtol=2e-2, atol=2e-2) if "bf16" in name else tol  # (bf16 weights: 1 rounding apart)
            for step, (a, b) in enumerate(zip(seen, ref_seen)):
                for k in b:
                    torch.testing.assert_close(a[k], b[k], **t, msg=f"{name} step {step} {k}")
            if final is not None:
                for k in ref_final:
                    torch.testing.assert_close(final[k], ref_final[k], **t, msg=f"{name} {k}")
        if world == 1:
            assert runs["true_scaled"][3] == 2.0 ** 127  # (the reference's: overflowing steps skipped)
        # bf16 host gradients where they hold the reduced values exactly: one rank, or stage 1
        # (buckets reduce in the model dtype)
        want = "torch.bfloat16" if world == 1 or stage == 1 else "torch.float32"
        assert runs["true_bf16"][4] == want and runs["off_bf16"][4] == "torch.float32"


def _during_backward_rank():
    """The inner step of a slot must begin while backward is still running: a hook on the
    input of fc1 (reached after every other layer's gradients) waits until a step has begun
    (giving up after 20 s)."""
    pz.init()
    zero_optimizer._host_copies = lambda device: True
    try:
        torch.manual_seed(0)
        model = Net()
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, offload="cpu", offload_pipeline=True,
                               bucket_mb=0.0001, lr=1e-2)
        began, inner, log = threading.Event(), opt.inner.step, []

        def step(*a, **k):
            began.set()
            return inner(*a, **k)
        opt.inner.step = step
        for i in range(3):
            began.clear()
            x = torch.randn(12, 16, generator=torch.Generator().manual_seed(i))
            h = x * 1.0
            h.requires_grad_(True)
            h.register_hook(lambda g: log.append(began.wait(20) if i else began.is_set()))
            model(h).square().sum().backward()
            opt.step()
        return log
    finally:
        zero_optimizer._host_copies = lambda device: device.type == "cuda"


def test_slots_step_while_backward_runs():
    """offload_pipeline=True (stage 2, several buckets): from the second step on a slot's CPU
    step begins before backward has reached the first layer; in the first none does."""
    assert run_ranks(_during_backward_rank, 1, timeout=120)[0].value == [False, True, True]


def _shape_rank():
    pz.init()
    zero_optimizer._host_copies = lambda device: True
    try:
        def make(pipeline, dtype=None):
            torch.manual_seed(0)
            model = Net()
            return model, pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, offload="cpu", bucket_mb=0.0001,
                                           offload_pipeline=pipeline, param_dtype=dtype, lr=1e-2)

        msgs = []
        for change in ("clip", "backward", "zero_grad"):
            model, opt = make(True)
            local_loss(model, 0, 1, 0).backward()
            opt.step()  # one synchronised backward, no clipping: slots step early from now on
            local_loss(model, 1, 1, 0).backward()
            try:
                if change == "clip":
                    opt.clip_grad_norm_(0.5)
                elif change == "backward":
                    local_loss(model, 2, 1, 0).backward()
                else:
                    opt.zero_grad()
            except RuntimeError as e:
                msgs.append(str(e))
            else:
                msgs.append(None)
        # "step": a loop that clips and accumulates only at some steps, bitwise the run without the
        # pipeline; a bf16 model's host gradients become fp32 at the first accumulation
        out = {}
        for pipeline in (False, "step"):
            model, opt = make(pipeline, torch.bfloat16)
            dtypes = []
            for step in range(4):
                local_loss(model, step, 1, 0).float().backward()
                if step == 2:
                    local_loss(model, 10 + step, 1, 0).float().backward()
                if step == 1:
                    opt.clip_grad_norm_(0.5)
                dtypes.append(str(opt._host_grad_dtype))
                opt.step()
            out[pipeline] = {k: v.float().clone() for k, v in model.state_dict().items()}, dtypes
        return msgs, out
    finally:
        zero_optimizer._host_copies = lambda device: device.type == "cuda"


def test_loop_shape_changes_raise_with_true_and_train_with_step():
    msgs, out = run_ranks(_shape_rank, 1, timeout=120)[0].value
    assert msgs[0].startswith("clip_grad_norm_:") and msgs[1].startswith("another synchronised backward:")
    assert msgs[2].startswith("zero_grad() before step():")
    assert all("offload_pipeline='step'" in m for m in msgs)
    (off, _), (step, dtypes) = out[False], out["step"]
    for k in off:
        assert torch.equal(step[k], off[k]), k
    assert dtypes == ["torch.bfloat16"] * 2 + ["torch.float32"] * 2


def _lr_at(step, late_change):
    """The lr a loop sets after backward (the optimizers start at 1e-3): a new one every step (a warm-up
    written there), or the first change at step 3."""
    return 1e-3 * (1 + (step >= 3)) if late_change else 1e-2 * (1 + step)


def _settings_rank(late_change):
    pz.init()
    zero_optimizer._host_copies = lambda device: True
    try:
        out = {}
        for pipeline in (True, "step"):
            torch.manual_seed(0)
            model = Net()
            opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, offload="cpu", offload_pipeline=pipeline,
                                   bucket_mb=0.0001, lr=1e-3, weight_decay=0.1)
            early, error = [], None
            try:
                for step in range(STEPS):
                    local_loss(model, step, 1, 0).backward()
                    early.append(opt._steps.any_submitted())
                    for g in opt.param_groups:
                        g["lr"] = _lr_at(step, late_change)
                    opt.step()
            except RuntimeError as e:
                error = str(e)
            out[pipeline] = early, error, {k: v.clone() for k, v in opt.full_state_dict().items()}
        return out
    finally:
        zero_optimizer._host_copies = lambda device: device.type == "cuda"


@pytest.mark.parametrize("late_change", [False, True])
def test_settings_changed_between_backward_and_step(late_change):
    """A loop that sets lr after backward: offload_pipeline=True learns it at the first step and steps
    no slot during backward, equal to plain torch; a loop whose lr first changes there after slots
    have stepped early raises, naming offload_pipeline='step', with which it trains as torch."""
    out = run_ranks(_settings_rank, 1, args=(late_change,), timeout=120)[0].value
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, weight_decay=0.1)
    for step in range(STEPS):
        opt.zero_grad()
        local_loss(ref, step, 1, 0).backward()
        for g in opt.param_groups:
            g["lr"] = _lr_at(step, late_change)
        opt.step()
    early, error, final = out[True]
    if late_change:
        assert early[:4] == [False, True, True, True] and error is not None, (early, error)
        assert error.startswith("a change of the param_groups' settings") and "offload_pipeline='step'" in error
    else:
        assert early == [False] * STEPS and error is None, (early, error)
    for pipeline in ([True, "step"] if not late_change else ["step"]):
        early, error, final = out[pipeline]
        assert error is None
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(final[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{pipeline} {k}: {m}")


def _pre_hook_rank(case):
    pz.init()
    zero_optimizer._host_copies = lambda device: True
    try:
        torch.manual_seed(0)
        model = Net()
        kw = {"true": dict(offload_pipeline=True), "bf16": dict(param_dtype=torch.bfloat16)}[case]
        opt = pz.ZeroOptimizer(model, torch.optim.SGD, stage=2, offload="cpu", bucket_mb=0.0001, lr=0.1, **kw)
        start = {k: v.clone() for k, v in opt.full_state_dict().items()}
        seen = []

        def drop(o, args, kwargs):  # a gradient transform in a pre-hook: here it drops every gradient
            grads = [p.grad for g in o.param_groups for p in g["params"] if p.grad is not None]
            seen.append((len(grads), sum(int(gr.count_nonzero()) for gr in grads), str(grads[0].dtype)))
            for gr in grads:
                gr.zero_()
        opt.register_step_pre_hook(drop)
        n = sum(1 for g in opt.param_groups for _ in g["params"])
        for step in range(4):
            local_loss(model, step, 1, 0).float().backward()
            opt.step()
        final = opt.full_state_dict()
        return n, seen, max(float((final[k].float() - start[k].float()).abs().max()) for k in start)
    finally:
        zero_optimizer._host_copies = lambda device: device.type == "cuda"


@pytest.mark.parametrize("case", ["true", "bf16"])
def test_step_pre_hooks_see_and_change_the_gradients(case):
    """As under torch, a step pre-hook sees every parameter's reduced gradient in param_groups and what
    it does to them is what step() uses: with offload_pipeline=True (no slot steps during backward
    while such a hook is registered) and with a bf16 model's 16-bit host gradients (widened to fp32
    for the hook). SGD without momentum and zeroed gradients: the parameters do not move."""
    n, seen, moved = run_ranks(_pre_hook_rank, 1, args=(case,), timeout=120)[0].value
    assert len(seen) == 4, seen
    assert all(k == n and nonzero > 0 and dtype == "torch.float32" for k, nonzero, dtype in seen), seen
    assert moved == 0.0


def _cuda_rank(stage):
    pz.init(backend="nccl", timeout=60)
    return {name: _train(stage, device="cuda", **RUNS[name]) for name in ("off", "true", "off_bf16", "true_bf16")}


@pytest.mark.gpu
def test_pipeline_cuda_model_matches_plain_torch_and_the_step_without_it():
    """A CUDA model (nccl, one rank): pinned host shards, the side stream's copies and their
    events; slots step during backward from the second step; bitwise the step without the
    pipeline, and the plain-torch loop on the same GPU within the one-rank tolerance (bf16:
    one bf16 rounding)."""
    for stage in (2, 3):
        runs = run_ranks(_cuda_rank, 1, args=(stage,), start="spawn", timeout=240,
                         env={"CUDA_VISIBLE_DEVICES": "0"})[0].value
        for name in ("true", "true_bf16"):
            off = runs["off" + name[4:]]
            early, seen, final, _, grads = runs[name]
            assert early == [False] + [True] * (STEPS - 1), (name, early)
            assert grads == ("torch.bfloat16" if "bf16" in name else "torch.float32")
            for a, b in zip(seen, off[1]):
                for k in a:
                    assert torch.equal(a[k], b[k]), (name, k)
            for k in final:
                assert torch.equal(final[k], off[2][k]), (name, k)
            ref_seen, ref_final, _ = reference(param_dtype=RUNS[name].get("param_dtype"), device="cuda")
            t = dict(rtol=2e-2, atol=2e-2) if "bf16" in name else dict(rtol=1e-5, atol=1e-6)
            for a, b in zip(seen, ref_seen):
                for k in b:
                    torch.testing.assert_close(a[k], b[k], **t)
            for k in ref_final:
                torch.testing.assert_close(final[k], ref_final[k], **t)
