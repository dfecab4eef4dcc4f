"""ZeroOptimizer(offload="cpu") options: offload_moments= (Adam's moments in bf16 / int8) and
delayed_update= (ZeRO-Offload's one-step delayed parameter update).

References: pz.optim.AdamW(moments=...) on the plain model (itself tested against torch in
test_optim_moments.py), host bytes per parameter from a hand formula, and for the delayed
update a plain-torch loop written here that applies every update one step late. The path
a CUDA model takes (host masters and gradient copies) runs here with the CPU as the device.
"""
import copy
import math
import threading
import time

import pytest
import torch

import pyzero as pz
import pyzero.zero.optimizer as zero_optimizer
from pyzero.launch import run_ranks


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = torch.nn.Linear(16, 300), torch.nn.Linear(300, 30), torch.nn.Linear(30, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def batch(step, n=12):
    g = torch.Generator().manual_seed(step)
    return torch.randn(n, 16, generator=g), torch.randn(n, 5, generator=g)


def local_loss(model, step, world, rank):
    w = next(model.parameters())
    x, y = (t.to(device=w.device, dtype=w.dtype) for t in batch(step))
    lo, hi = rank * 12 // world, (rank + 1) * 12 // world
    return torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi], reduction="sum") / 12 * world


# ---- offload_moments ------------------------------------------------------------------------

def _moments_rank(moments, stage, host, param_dtype, steps=3, ckpt=None, delayed=False):
    pz.init()
    zero_optimizer._host_copies = (lambda device: True) if host else (lambda device: device.type == "cuda")
    try:
        torch.manual_seed(0)
        model = Net()
        kw = dict(stage=stage, offload="cpu", offload_moments=moments, param_dtype=param_dtype, lr=1e-2,
                  weight_decay=0.1, delayed_update=delayed)
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, **kw)
        rank, world = pz.get_rank(), pz.get_world_size()
        for step in range(steps):
            if ckpt is not None and step == steps // 2:
                pz.checkpoint.save(ckpt, model, opt, step)
                torch.manual_seed(0)
                model = Net()
                opt = pz.ZeroOptimizer(model, torch.optim.AdamW, **kw)
                assert pz.checkpoint.load(ckpt, model, opt) == step
            local_loss(model, step, world, rank).backward()
            opt.step()
        pieces = [pc.numel for pc, _, _ in opt.pieces]
        kinds = {str(v.dtype) for st in opt.inner.state.values() for k, v in st.items() if k == "exp_avg"}
        mem = dict(opt.memory_stats(), slot_elems=max((hi - lo for _, lo, hi in opt._slots), default=0))
        return ({k: v.clone() for k, v in model.state_dict().items()}, mem, pieces,
                sum(layout.shard_size for layout, _, _ in opt.shards()), kinds)
    finally:
        zero_optimizer._host_copies = lambda device: device.type == "cuda"


def _plain_pz(moments, steps=3):
    torch.manual_seed(0)
    model = Net()
    opt = pz.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, moments=moments)
    for step in range(steps):
        opt.zero_grad()
        local_loss(model, step, 1, 0).backward()
        opt.step()
    return model.state_dict()


def moment_bytes(moments, pieces):
    """Hand formula: exp_avg + exp_avg_sq bytes of the pieces (int8: an fp32 absmax per 256)."""
    if moments == "int8":
        return sum(2 * n + 8 * math.ceil(n / 256) for n in pieces)
    return sum({"fp32": 8, "bf16": 4}[moments] * n for n in pieces)


@pytest.mark.parametrize("moments", ["fp32", "bf16", "int8"])
def test_offload_moments_same_weights_as_pz_optim_and_host_bytes_per_parameter(moments):
    """One rank, stage 2, host copies of a bf16 model: the weights are bit for bit those of
    pz.optim.AdamW(moments=...) on the plain model (one piece per parameter, so the same
    blocks), and memory_stats()["host"] is, per shard element, the fp32 master (4) + the bf16
    gradient shard of the offload pipeline (2) + the bf16 copy (2) + the moments (8 / 4 / 2 + 8
    per 256), plus one 4-byte step count per piece and the fp32 scratch of the largest slot."""
    res = run_ranks(_moments_rank, 1, args=(moments, 2, True, torch.bfloat16), timeout=120)[0].value
    state, mem, pieces, shard, kinds = res
    assert kinds == {{"fp32": "torch.float32", "bf16": "torch.bfloat16", "int8": "torch.int8"}[moments]}
    want = 4 * shard + 2 * shard + 2 * shard + moment_bytes(moments, pieces) + 4 * len(pieces)
    assert 0 < mem["slot_elems"] <= shard
    assert mem["host"] == want + 4 * mem["slot_elems"], (mem, want)
    # the plain-model reference in fp32 parameters: same steps with fp32 host path and model
    res32 = run_ranks(_moments_rank, 1, args=(moments, 2, False, None), timeout=120)[0].value
    ref = _plain_pz(moments)
    for k, v in ref.items():
        assert torch.equal(res32[0][k], v), k
    # delayed_update (no pipeline: fp32 gradient shards) holds one more fp32 gradient shard (the
    # CPU step's own copy); the device keeps the bf16 parameters alone
    _, mem_d, pieces_d, shard_d, _ = run_ranks(_moments_rank, 1, args=(moments, 2, True, torch.bfloat16, 3, None,
                                                                       True), timeout=120)[0].value
    assert mem_d["host"] == want + 2 * shard_d + 4 * shard_d, (mem_d, want)
    nparams = sum(p.numel() for p in Net().parameters())
    assert mem["params"] == mem_d["params"] == 2 * shard and shard >= nparams


def test_offload_moments_states_sharded_across_ranks_and_checkpoint_reloads():
    """Two ranks, stage 2, int8: each rank holds the moments of its own shard only (together
    exactly the hand formula over both ranks' pieces, about 2.03 bytes per parameter once);
    a checkpoint saved mid-run (moments written as fp32) and loaded into fresh optimizers
    continues to weights within 1e-6 of the uninterrupted run (re-encoding the decoded codes
    gives the same codes)."""
    plain = run_ranks(_moments_rank, 2, args=("int8", 2, False, None, 4), timeout=120)
    # (an fp32 CPU model without host copies: the masters are the model's shard, "optimizer" is
    # the inner state alone: the moments and one 4-byte step count per piece)
    total = sum(r.value[1]["optimizer"] - 4 * len(r.value[2]) for r in plain)
    want = sum(moment_bytes("int8", r.value[2]) for r in plain)
    assert total == want
    nparams = sum(p.numel() for p in Net().parameters())
    assert 2.0 * nparams <= total <= 2.1 * nparams


def test_offload_moments_checkpoint(tmp_path):
    straight = run_ranks(_moments_rank, 2, args=("int8", 2, False, None, 4), timeout=120)[0].value[0]
    resumed = run_ranks(_moments_rank, 2, args=("int8", 2, False, None, 4, str(tmp_path / "ck")),
                        timeout=120)[0].value[0]
    for k, v in straight.items():
        torch.testing.assert_close(resumed[k], v, rtol=0, atol=1e-6)


def _bad(kw):
    torch.manual_seed(0)
    model = Net()
    before = [p.detach().clone() for p in model.parameters()]
    try:
        pz.ZeroOptimizer(model, kw.pop("cls", torch.optim.AdamW), **kw)
    except (ValueError, TypeError) as e:
        msg = str(e)
    else:
        msg = None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return msg


def _bad_ranks():
    pz.init()
    cases = [dict(offload="cpu", offload_moments="fp16"), dict(offload=None, offload_moments="int8"),
             dict(offload="cpu", offload_moments="int8", cls=torch.optim.SGD),
             dict(offload="cpu", offload_moments="int8", amsgrad=True),
             dict(offload="cpu", offload_moments="int8", cls=pz.optim.AdamW, moments="bf16"),
             dict(offload="cpu", delayed_update=1), dict(offload=None, delayed_update=True),
             dict(offload="cpu", stage=3, delayed_update=True),
             dict(offload="cpu", offload_pipeline="bucket"), dict(offload=None, offload_pipeline=True),
             dict(offload="nvme", offload_pipeline="step"), dict(offload="cpu", offload_pipeline=True,
                                                                delayed_update=True)]
    return [_bad(dict(c)) for c in cases]


def test_bad_arguments_name_the_argument_on_every_rank():
    results = run_ranks(_bad_ranks, 2, timeout=120)
    for r in results:
        msgs = r.value
        assert all(m is not None for m in msgs), msgs
        for m in msgs[:5]:
            assert "offload_moments" in m
        for m in msgs[5:8]:
            assert "delayed_update" in m
        for m in msgs[8:]:
            assert m.startswith("offload_pipeline:"), m


def _decoupled_rank(tmp):
    pz.init()
    rank, world = pz.get_rank(), pz.get_world_size()
    out = {}
    for stage in (1, 2, 3):
        torch.manual_seed(0)
        model = Net()
        opt = pz.ZeroOptimizer(model, torch.optim.Adam, stage=stage, offload="cpu", lr=1e-2, weight_decay=0.1,
                               decoupled_weight_decay=True)
        for step in range(3):
            local_loss(model, step, world, rank).backward()
            opt.step()
        out[stage] = opt.full_state_dict()
    # an argument only the class offload steps with refuses: refused before the model is touched
    out["nvme_moments"] = _bad(dict(offload="nvme", nvme_path=tmp, cls=pz.optim.AdamW, moments="bf16"))
    return out


def test_adam_decoupled_weight_decay_with_offload_as_torch(tmp_path):
    """torch.optim.Adam(decoupled_weight_decay=True) with offload="cpu" (stepped by pz.optim.Adam)
    trains as torch's: its AdamW."""
    torch.manual_seed(0)
    ref = Net()
    opt = torch.optim.Adam(ref.parameters(), lr=1e-2, weight_decay=0.1, decoupled_weight_decay=True)
    for step in range(3):
        local_loss(ref, step, 1, 0).backward()
        opt.step()
        opt.zero_grad()
    res = run_ranks(_decoupled_rank, 2, args=(str(tmp_path),), timeout=120)
    for stage in (1, 2, 3):
        got = res[0].value[stage]
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"stage {stage} {k}: {m}")
    for r in res:
        assert r.value["nvme_moments"].startswith("moments: offload='nvme' keeps fp32 state"), r.value


# ---- delayed_update -------------------------------------------------------------------------

def _delayed_rank(stage, delayed, steps, clip, loss_scale, moments=None, param_dtype=None, device="cpu",
                  lr_decay=None, slow=False):
    if device == "cuda":
        pz.init(backend="nccl", timeout=60)
    else:
        pz.init()
    if slow:  # the CPU step starts late: after what the main thread does next (an LR scheduler's step)
        submit = pz.zero.offload.DelayedStep.submit

        def late(self, shards, step):
            def job():
                time.sleep(0.05)
                step()
            submit(self, shards, job)
        pz.zero.offload.DelayedStep.submit = late
    torch.manual_seed(0)
    model = Net().to(device)
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, offload="cpu", delayed_update=delayed,
                           loss_scale=loss_scale, offload_moments=moments, param_dtype=param_dtype, lr=1e-2,
                           weight_decay=0.1)
    rank, world = pz.get_rank(), pz.get_world_size()
    sched = None if lr_decay is None else torch.optim.lr_scheduler.LambdaLR(opt, lambda k: lr_decay ** k)
    seen = []  # the parameters each forward used
    for step in range(steps):
        seen.append(model.fc1.weight.detach().float().clone())
        loss = local_loss(model, step, world, rank)
        opt.scale_loss(loss.float()).backward()
        if clip:
            opt.clip_grad_norm_(clip)
        opt.step()
        if sched is not None:
            sched.step()
    opt.synchronize()
    scales = opt.loss_scale
    return {k: v.float().cpu() for k, v in model.state_dict().items()}, [t.cpu() for t in seen], scales


def reference_delayed(steps, clip, loss_scale=None, device="cpu", lr_decay=None):
    """Plain torch: the model computes with w_{t-2}; torch.optim.AdamW steps a master copy with
    g_t; w_{t-1} goes into the model after step t's gradients are in (dynamic loss scaling:
    a step with inf/NaN gradients is skipped, the scale halved; it doubles after `growth`
    good steps)."""
    torch.manual_seed(0)
    model = Net().to(device)
    master = copy.deepcopy(model)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2, weight_decay=0.1)
    scale, growth, good = (loss_scale or {}).get("init_scale", 1.0), (loss_scale or {}).get("growth_interval"), 0
    pending, seen = False, []
    for step in range(steps):
        seen.append(model.fc1.weight.detach().clone())
        model.zero_grad()
        (local_loss(model, step, 1, 0) * scale).backward()
        grads = [p.grad / scale for p in model.parameters()]
        overflow = not all(torch.isfinite(g).all() for g in grads)
        if not overflow and clip:
            norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coef = torch.clamp(clip / (norm + 1e-6), max=1.0)
            grads = [g * coef for g in grads]
        if pending:  # the update of the step before reaches the model now
            with torch.no_grad():
                for p, q in zip(model.parameters(), master.parameters()):
                    p.copy_(q)
            pending = False
        if overflow:
            scale, good = scale / 2, 0
            continue
        for q, g in zip(master.parameters(), grads):
            q.grad = g
        if lr_decay is not None:  # (LambdaLR stepped after every step: step t's update at lr * decay**t)
            opt.param_groups[0]["lr"] = 1e-2 * lr_decay ** step
        opt.step()
        pending = True
        if growth:
            good += 1
            if good == growth:
                scale, good = scale * 2, 0
    with torch.no_grad():
        for p, q in zip(model.parameters(), master.parameters()):
            p.copy_(q)
    return {k: v.cpu() for k, v in model.state_dict().items()}, [t.cpu() for t in seen], scale


@pytest.mark.parametrize("world,stage", [(1, 1), (2, 2)])
def test_delayed_update_matches_one_step_late_reference(world, stage):
    """delayed_update=True with clipping: each forward sees the reference's parameters (the
    updates of all steps but the last one), and after synchronize() the weights match the
    reference (one rank: within the 1-ulp sqrt difference of pz.optim's kernel against torch's;
    two ranks: their averaged half-batch gradients round differently from the full batch's,
    which Adam's normalised step carries to at most a few 1e-6 in 6 steps); the same run
    without the delay differs by about 5e-2."""
    steps = 6
    tol = dict(rtol=1e-5, atol=1e-6) if world == 1 else dict(rtol=1e-4, atol=2e-5)
    ref, ref_seen, _ = reference_delayed(steps, clip=0.5)
    res = run_ranks(_delayed_rank, world, args=(stage, True, steps, 0.5, None), timeout=120)
    for r in res:
        state, seen, _ = r.value
        for t, (a, b) in enumerate(zip(seen, ref_seen)):
            torch.testing.assert_close(a, b, **tol, msg=f"forward {t}")
        for k, v in ref.items():
            torch.testing.assert_close(state[k], v, **tol, msg=k)
    assert torch.equal(res[0].value[1][1], res[0].value[1][0])  # step 1's forward: still w_0
    plain = run_ranks(_delayed_rank, 1, args=(stage, False, steps, 0.5, None), timeout=120)[0].value[0]
    assert not torch.allclose(plain["fc1.weight"], ref["fc1.weight"], atol=1e-2)


def _delayed_ckpt_rank(ckpt):
    pz.init()
    torch.manual_seed(0)
    model = Net()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, offload="cpu", delayed_update=True, lr=1e-2)
    local_loss(model, 0, 1, 0).backward()
    opt.step()
    opt.param_groups[0]["lr"] = 5e-3  # (as a scheduler sets the next step's)
    pz.checkpoint.save(ckpt, model, opt, 1)
    sd_lr = opt.state_dict()["inner"]["param_groups"][0]["lr"]
    model2 = Net()
    opt2 = pz.ZeroOptimizer(model2, torch.optim.AdamW, stage=2, offload="cpu", delayed_update=True, lr=1.0)
    torch.optim.lr_scheduler.LambdaLR(opt2, lambda k: 1.0)  # (made before the load, as a resumed run does)
    pz.checkpoint.load(ckpt, model2, opt2)
    local_loss(model2, 1, 1, 0).backward()
    opt2.step()
    lrs = [opt2.param_groups[0]["lr"], opt2.inner.param_groups[0]["lr"]]  # (the second: what the step used)
    opt2.synchronize()
    return sd_lr, lrs


def test_delayed_update_checkpoint_keeps_the_lr_set_after_the_step(tmp_path):
    """The lr set on param_groups after a delayed step is the one saved (state_dict and checkpoint)
    and the one a resumed run steps with."""
    sd_lr, lrs = run_ranks(_delayed_ckpt_rank, 1, args=(str(tmp_path / "ck"),), timeout=120)[0].value
    assert sd_lr == 5e-3 and lrs == [5e-3, 5e-3]


@pytest.mark.parametrize("slow", [False, True])
def test_delayed_update_steps_with_the_lr_of_its_step(slow):
    """An LR scheduler stepped right after opt.step() sets the next step's lr while the CPU step of
    this one may not have started: that step still uses its own lr (the reference's), however late
    it runs."""
    steps = 4
    ref, _, _ = reference_delayed(steps, clip=None, lr_decay=0.3)
    state, _, _ = run_ranks(_delayed_rank, 1, args=(2, True, steps, None, None), timeout=120,
                            kwargs=dict(lr_decay=0.3, slow=slow))[0].value
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_delayed_update_with_loss_scaling_skips_overflow_steps():
    """fp16-style dynamic loss scaling: a start scale of 2^135 overflows fp32 (the verdict taken
    from step t's gradients before any CPU step), the steps are skipped and the scale halves
    until they fit, then grows every 3 good steps; the weights and the final scale match the
    reference's."""
    scaling = {"init_scale": 2.0 ** 135, "growth_interval": 3}
    ref, _, ref_scale = reference_delayed(16, clip=None, loss_scale=scaling)
    state, _, scale = run_ranks(_delayed_rank, 1, args=(2, True, 16, None, scaling), timeout=120)[0].value
    assert scale == ref_scale and ref_scale <= 2.0 ** 128
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)


def _overlap_rank():
    """step() returns while the CPU step still runs: the inner step waits for the next
    forward to begin (a forward pre-hook sets the event); a synchronous step would wait forever
    (the wait gives up after 60 s and the test fails)."""
    pz.init()
    torch.manual_seed(0)
    model = Net()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, offload="cpu", delayed_update=True, lr=1e-2)
    forward_began, inner = threading.Event(), opt.inner.step
    log = []

    def slow_step(*a, **k):
        log.append(("step starts", threading.current_thread() is threading.main_thread()))
        ok = forward_began.wait(60)
        log.append(("next forward began first", ok))
        return inner(*a, **k)
    opt.inner.step = slow_step
    model.register_forward_pre_hook(lambda *a: forward_began.set())
    for step in range(2):
        forward_began.clear()
        local_loss(model, step, 1, 0).backward()
        opt.step()
    opt.synchronize()
    return log


def test_delayed_update_runs_the_cpu_step_behind_the_next_forward():
    log = run_ranks(_overlap_rank, 1, timeout=120)[0].value
    assert log == [("step starts", False), ("next forward began first", True)] * 2


def test_delayed_update_with_int8_moments_and_bf16_model_trains():
    """The two options together on a bf16 model: the weights stay within 2e-2 of the fp32-moment
    delayed run after 6 steps (bf16 weights, int8 moments) and differ from the start."""
    a = run_ranks(_delayed_rank, 1, args=(2, True, 6, 0.5, None, "int8", torch.bfloat16), timeout=120)[0].value[0]
    b = run_ranks(_delayed_rank, 1, args=(2, True, 6, 0.5, None, None, torch.bfloat16), timeout=120)[0].value[0]
    torch.manual_seed(0)
    init = Net().state_dict()
    for k in b:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=2e-2, msg=k)
    assert not torch.allclose(a["fc1.weight"], init["fc1.weight"].to(torch.bfloat16).float(), atol=1e-3)


@pytest.mark.gpu
def test_delayed_update_cuda_model_matches_one_step_late_reference():
    """A CUDA model (nccl, one rank): the host-copy path with the background CPU step and the
    copies to the device; every forward's parameters and the final weights against the
    one-step-late reference computed on the same GPU (tolerance as for one CPU rank, plus the
    GPU kernels' own rounding of the gradients: the reference runs the same kernels)."""
    ref, ref_seen, _ = reference_delayed(6, clip=0.5, device="cuda")
    state, seen, _ = run_ranks(_delayed_rank, 1, args=(2, True, 6, 0.5, None, None, None, "cuda"), start="spawn",
                               timeout=240, env={"CUDA_VISIBLE_DEVICES": "0"})[0].value
    for t, (a, b) in enumerate(zip(seen, ref_seen)):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"forward {t}")
    for k, v in ref.items():
        torch.testing.assert_close(state[k], v, rtol=1e-5, atol=1e-6, msg=k)


def test_bench_train_delayed_update_run_is_one_step_late(tmp_path):
    """`pyzero-bench train --runs zero2-offload-dpu` (one rank, the same batch every step): its forwards
    run on the parameters one update late, so its first two losses are plain torch's first and its
    third is plain torch's second (w1 is the same update in both); its fourth, on w2 made from the
    gradient at w0, is not plain torch's third."""
    import json

    from pyzero.bench import __main__ as bench

    out = tmp_path / "train.json"
    assert bench.main(["train", "--model", "gpt-nano", "--runs", "torch-local,zero2-offload-dpu", "--nproc", "1",
                       "--iters", "2", "--warmup", "2", "--seq", "16", "--json", str(out)]) == 0
    local, dpu = json.loads(out.read_text())["results"]
    assert dpu["run"] == "zero2-offload-dpu" and dpu["step_ms"] > 0
    a, b = local["losses"], dpu["losses"]
    assert b[0] == pytest.approx(a[0], rel=1e-6) and b[1] == pytest.approx(a[0], rel=1e-6), (a[:3], b[:3])
    assert b[2] == pytest.approx(a[1], rel=1e-5), (a[:3], b[:3])
    assert abs(b[3] - a[2]) > 1e-4, (a[:4], b[:4])
