"""The training layers on a GPU over the nccl backend (scripts/gpu_check.sh; skipped without a GPU).

World size 1, each case in a spawned process (the pytest process has initialised CUDA), against the
same training in plain torch on the same GPU. A one-rank average is the gradient itself, so the
results must be equal.
"""
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks

pytestmark = pytest.mark.gpu
ENV = {"CUDA_VISIBLE_DEVICES": "0"}
STEPS = 4


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 4))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def torch_reference(clip=None, skip=()):
    """Plain torch on the GPU: AdamW, optionally clipping, without the steps in `skip`."""
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = (t.cuda() for t in batch(step))
        F.mse_loss(model(x), y).backward()
        if step not in skip:
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        opt.zero_grad()
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def _rank_data_parallel(comm_dtype):
    pz.init(backend="nccl", timeout=60)
    ref = torch_reference()
    model = make_model().cuda()
    dp = pz.DataParallel(model, bucket_mb=0.001, first_bucket_mb=0.001, comm_dtype=comm_dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = (t.cuda() for t in batch(step))
        F.mse_loss(dp(x), y).backward()
        opt.step()
        opt.zero_grad()
    got = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    pz.destroy()
    return ref, got, len(dp.buckets)


@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16])
def test_data_parallel_cuda_model_equals_torch(comm_dtype):
    res = run_ranks(_rank_data_parallel, 1, args=(comm_dtype,), start="spawn", timeout=180, env=ENV)
    ref, got, nbuckets = res[0].value
    assert nbuckets > 1  # several buckets, each reduced asynchronously during backward
    tol = dict(rtol=0, atol=0) if comm_dtype is None else dict(rtol=2e-2, atol=2e-3)  # bf16 wire: rounded grads
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


def _rank_refuses_cpu_module():
    pz.init(backend="nccl", timeout=60)
    try:
        pz.DataParallel(make_model())
    except ValueError as e:
        return str(e)
    finally:
        pz.destroy()
    return None


def test_data_parallel_on_nccl_refuses_a_cpu_module():
    msg = run_ranks(_rank_refuses_cpu_module, 1, start="spawn", timeout=120, env=ENV)[0].value
    assert msg is not None and "cuda:0" in msg and "cpu" in msg


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.7])
def test_fused_pack_unpack_kernel_equals_torch_copies(flat_dtype, scale):
    """The one-launch CUDA pack/unpack against the torch-copy path (itself checked equal to the CPU
    C++ loops in test_data_parallel.py), with more tensors than one launch takes."""
    from pyzero import bucketing

    g = torch.Generator().manual_seed(0)
    ts = [torch.randn(n, generator=g).to(torch.bfloat16).cuda() for n in [1, 7, 1000, 33, 4097] * 30]
    offsets, o = [], 3
    for t in ts:
        offsets.append(o)
        o += t.numel() + 1  # gaps between slots stay untouched
    fused = torch.full((o + 2,), 9.0, dtype=flat_dtype, device="cuda")
    ref = fused.clone()
    bucketing.pack(ts, fused, offsets, scale=scale)  # same dtype, contiguous: the kernel
    bucketing._device_copies(ts, ref, offsets, scale, True)
    assert torch.equal(fused, ref)
    outs_k = [torch.empty_like(t) for t in ts]
    outs_t = [torch.empty_like(t) for t in ts]
    bucketing.unpack(fused, outs_k, offsets, scale=scale)
    bucketing._device_copies(outs_t, fused, offsets, scale, False)
    for a, b in zip(outs_k, outs_t):
        assert torch.equal(a, b)


# ---- ZeroOptimizer -----------------------------------------------------------------------------

INF_STEP = 2


def _rank_zero(clip, param_dtype, loss_scale, offload=None):
    """Stages 1-3 in one process (each GPU process start costs seconds): the reference and each stage's run.
    offload="cpu": ZeroOptimizer(offload="cpu"), and stage 3 once more with offload_params (key "3p")."""
    pz.init(backend="nccl", timeout=60)
    ref = (mixed_reference(param_dtype) if param_dtype is not None
           else torch_reference(clip, skip={INF_STEP} if loss_scale else ()))
    out = {stage: _train_zero(stage, clip, param_dtype, loss_scale, offload) for stage in (1, 2, 3)}
    if offload:
        out["3p"] = _train_zero(3, clip, param_dtype, loss_scale, offload, offload_params=True)
    pz.destroy()
    return ref, out


def _train_zero(stage, clip, param_dtype, loss_scale, offload=None, offload_params=False):
    """ZeroOptimizer on a CUDA model (small buckets: several reductions in flight during backward).
    With loss_scale, step INF_STEP's gradients get an inf and that step must be skipped."""
    model = make_model().cuda()
    extra = {"offload": offload} if offload else {}
    if offload_params:
        extra["offload_params"] = True
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2, bucket_mb=0.0005,
                           param_dtype=param_dtype, loss_scale=loss_scale, **extra)
    devices = {str(t.device) for _, t, g in opt.pieces} | {str(g.device) for _, t, g in opt.pieces}
    norms, scales = [], []
    for step in range(STEPS):
        x, y = (t.cuda().to(param_dtype or torch.float32) for t in batch(step))
        h = None
        if loss_scale and step == INF_STEP:
            h = model[0].weight.register_hook(lambda g: g.index_fill(0, torch.tensor([0], device=g.device),
                                                                     float("inf")))
        opt.scale_loss(F.mse_loss(model(x), y)).backward()
        if h is not None:
            h.remove()
        if clip is not None:
            norms.append(float(opt.clip_grad_norm_(clip)))
        opt.step()
        scales.append(opt.loss_scale)
    sd = opt.full_state_dict() if stage == 3 else model.state_dict()
    got = {k: v.detach().cpu() for k, v in sd.items()}
    stats = opt.memory_stats()
    inner = type(opt.inner).__module__
    return {"got": got, "devices": devices, "norms": norms, "scales": scales, "stats": stats, "inner": inner}


@pytest.mark.parametrize("clip", [None, 0.05])
def test_zero_optimizer_cuda_model_equals_torch(clip):
    ref, runs = run_ranks(_rank_zero, 1, args=(clip, None, None), start="spawn", timeout=180, env=ENV)[0].value
    for stage, v in runs.items():
        assert v["devices"] == {"cuda:0"}, (stage, v["devices"])  # master and gradient shards on the GPU
        for k, want in ref.items():
            torch.testing.assert_close(v["got"][k], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, stage=stage: f"stage {stage}, {k}: {m}")
        if clip is not None:
            assert all(n > clip for n in v["norms"]), (stage, v["norms"])  # the clipping really happened
        assert v["stats"]["total"] > 0


def mixed_reference(dtype):
    """By hand in plain torch: fp32 master weights and AdamW, forward/backward in `dtype` on the GPU."""
    master, model = make_model().cuda(), make_model().cuda().to(dtype)
    opt = torch.optim.AdamW(master.parameters(), lr=1e-2)
    for step in range(STEPS):
        with torch.no_grad():
            for p, m in zip(model.parameters(), master.parameters()):
                p.copy_(m)
                p.grad = None
        x, y = (t.cuda().to(dtype) for t in batch(step))
        F.mse_loss(model(x), y).backward()
        for p, m in zip(model.parameters(), master.parameters()):
            m.grad = p.grad.float()
        opt.step()
    return {k: v.detach().cpu() for k, v in master.state_dict().items()}


def test_zero_optimizer_cuda_bf16_params_equal_a_mixed_precision_reference():
    """bf16 compute, fp32 master shards on the GPU, against the same recipe by hand. Stages 1-2 return
    the model's bf16 weights (the reference rounded to bf16), stage 3 the fp32 master weights."""
    ref, runs = run_ranks(_rank_zero, 1, args=(None, torch.bfloat16, None), start="spawn", timeout=180,
                          env=ENV)[0].value
    init = {k: t.detach() for k, t in make_model().state_dict().items()}
    for stage, v in runs.items():
        for k, want in ref.items():
            got = v["got"][k]
            assert not torch.equal(got.float(), init[k]), (stage, k)  # trained
            if stage < 3:
                assert got.dtype == torch.bfloat16, (stage, k, got.dtype)
                torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=8e-3, atol=1e-4,
                                           msg=lambda m, k=k, stage=stage: f"stage {stage}, {k}: {m}")
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"stage 3, {k}: {m}")


def test_zero_optimizer_cuda_loss_scaling_skips_the_overflowing_step():
    ref, runs = run_ranks(_rank_zero, 1, args=(10.0, None, {"growth_interval": 2}), start="spawn", timeout=180,
                          env=ENV)[0].value
    for stage, v in runs.items():
        for k, want in ref.items():
            torch.testing.assert_close(v["got"][k], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, stage=stage: f"stage {stage}, {k}: {m}")
        assert v["norms"][INF_STEP] == float("inf"), stage
        # x2 after steps 0-1, /2 at the overflow (step 2), then one good step
        assert v["scales"] == [2.0**16, 2.0**17, 2.0**16, 2.0**16], (stage, v["scales"])


def _rank_zero_refusals():
    pz.init(backend="nccl", timeout=60)
    out = {}
    for case, make in {"cpu_model": lambda: pz.ZeroOptimizer(make_model(), torch.optim.AdamW, stage=2, lr=1e-2),
                       "offload": lambda: pz.ZeroOptimizer(make_model().cuda(), torch.optim.AdamW, stage=2,
                                                           lr=1e-2, offload="cpu", offload_params=True)}.items():
        try:
            make()
            out[case] = None
        except ValueError as e:
            out[case] = str(e)
    pz.destroy()
    return out


def test_zero_optimizer_on_nccl_refuses_a_cpu_model_and_offload_params_below_stage_3():
    msgs = run_ranks(_rank_zero_refusals, 1, start="spawn", timeout=120, env=ENV)[0].value
    msg = msgs["cpu_model"]
    assert msg is not None and "model" in msg and "cuda:0" in msg and "cpu" in msg, msg
    assert msgs["offload"] is not None and "offload_params: needs stage=3" in msgs["offload"], msgs


@pytest.mark.parametrize("case", ["clip", "loss_scale", "bf16"])
def test_zero_offload_cuda_model_equals_torch(case):
    """offload="cpu" (and stage 3 with offload_params) on a CUDA model: the masters, gradient shards
    and AdamW state in host memory, stepped by pz.optim's CPU kernel, clipping and the overflow
    check on the host;
    the same weights as plain torch on the GPU (bf16: the mixed-precision recipe by hand)."""
    args = {"clip": (0.05, None, None), "loss_scale": (10.0, None, {"growth_interval": 2}),
            "bf16": (None, torch.bfloat16, None)}[case]
    ref, runs = run_ranks(_rank_zero, 1, args=(*args, "cpu"), start="spawn", timeout=240, env=ENV)[0].value
    assert set(runs) == {1, 2, 3, "3p"}
    for stage, v in runs.items():
        assert v["devices"] == {"cpu"} and v["inner"] == "pyzero.optim.adam", (stage, v["devices"], v["inner"])
        st = v["stats"]
        assert st["optimizer"] == 0 and st["host"] > 0 and st["total"] == st["params"] + st["grads"], (stage, st)
        if stage != 1:  # the reduced gradient shards go to host memory: none on the device
            assert st["grads"] == 0, (stage, st)
        if stage == "3p":
            assert st["params"] == 0, st  # the parameter shards live in host memory
        for k, want in ref.items():
            got = v["got"][k]
            if case == "bf16" and stage in (1, 2):  # the model's bf16 weights: the reference rounded
                torch.testing.assert_close(got.float(), want.bfloat16().float(), rtol=8e-3, atol=1e-4,
                                           msg=lambda m, k=k, stage=stage: f"stage {stage}, {k}: {m}")
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, stage=stage: f"stage {stage}, {k}: {m}")
        if case == "clip":
            assert all(n > 0.05 for n in v["norms"]), (stage, v["norms"])
        if case == "loss_scale":
            assert v["norms"][INF_STEP] == float("inf") and v["scales"] == [2.0**16, 2.0**17, 2.0**16, 2.0**16], v


CKPT_STAGES = (2, 3)


def _rank_save_on(device, ckpt):
    """Per stage: two training steps on `device` (nccl on cuda, shm on cpu), saved; the shard states."""
    pz.init(backend="nccl" if device == "cuda" else "shm", timeout=60)
    out = {}
    for stage in CKPT_STAGES:
        model = make_model().to(device)
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2)
        for step in range(2):
            x, y = (t.to(device) for t in batch(step))
            F.mse_loss(model(x), y).backward()
            opt.step()
        pz.checkpoint.save(f"{ckpt}/stage{stage}", model, opt, 2)
        out[stage] = _state_on_cpu(opt)
    pz.destroy()
    return out


def _rank_load_on(device, ckpt):
    """Per stage: load the checkpoint on `device`, then one more step; the state after the load and
    the parameters after the step."""
    pz.init(backend="nccl" if device == "cuda" else "shm", timeout=60)
    out = {}
    for stage in CKPT_STAGES:
        model = make_model().to(device)
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2)
        assert pz.checkpoint.load(f"{ckpt}/stage{stage}", model, opt) == 2
        loaded = _state_on_cpu(opt)
        x, y = (t.to(device) for t in batch(2))
        F.mse_loss(model(x), y).backward()
        opt.step()
        sd = opt.full_state_dict() if stage == 3 else model.state_dict()
        out[stage] = loaded, {k: v.detach().cpu() for k, v in sd.items()}
    pz.destroy()
    return out


def _state_on_cpu(opt):
    """Copies (on the CPU .cpu() would return the live tensors themselves)."""
    return [(pc.name, pc.start, pc.end, leaf.detach().to("cpu", copy=True),
             {k: (t.detach().to("cpu", copy=True) if torch.is_tensor(t) else t)
              for k, t in opt.inner.state.get(leaf, {}).items()})
            for pc, leaf, _ in opt.pieces]


@pytest.mark.parametrize("save_on,load_on", [("cuda", "cpu"), ("cpu", "cuda")])
def test_checkpoint_moves_between_gpu_and_cpu(tmp_path, save_on, load_on):
    """Saved on one device, loaded on the other (stages 2 and 3): the same pieces and state, and the
    next step on the loading device equals a run that never stopped (there, in plain torch)."""
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_rank_save_on, 1, args=(save_on, ckpt), start="spawn", timeout=180, env=ENV)[0].value
    res = run_ranks(_rank_load_on, 1, args=(load_on, ckpt), start="spawn", timeout=180, env=ENV)[0].value
    for stage in CKPT_STAGES:
        _check_moved(saved[stage], *res[stage], load_on)


def _check_moved(saved, loaded, after, load_on):
    assert [p[:3] for p in loaded] == [p[:3] for p in saved]
    for (name, _, _, m_load, st_load), (_, _, _, m_save, st_save) in zip(loaded, saved):
        assert torch.equal(m_load, m_save), name
        assert sorted(st_load) == sorted(st_save), name
        for k in st_save:
            assert torch.equal(torch.as_tensor(st_load[k]).float(), torch.as_tensor(st_save[k]).float()), (name, k)
    model = make_model().to(load_on)  # plain torch, three steps on the loading device
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = (t.to(load_on) for t in batch(step))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for k, want in model.state_dict().items():
        torch.testing.assert_close(after[k], want.detach().cpu(), rtol=1e-4, atol=1e-5,
                                   msg=lambda m, k=k: f"{k}: {m}")


# ---- tensor parallelism and pipeline at world size 1 ----------------------------------------

def _rank_tp_and_pipeline():
    """A TP block (each overlap x sequence-parallel setting) and a one-stage pipeline on CUDA, each
    against plain torch on the same GPU: outputs and gradients."""
    pz.init(backend="nccl", timeout=60)
    out = {}
    torch.manual_seed(0)
    block = pz.tp.TransformerBlock(32, 4).cuda()
    x = torch.randn(8, 2, 32, device="cuda")
    want = block(x)
    want.square().mean().backward()
    ref_grads = {n: p.grad.detach().cpu() for n, p in block.named_parameters()}
    for overlap in (True, False):
        for sp in (True, False):
            par = pz.tp.ParallelTransformerBlock.from_block(block, sequence_parallel=sp, overlap=overlap)
            got = par(x)
            got.square().mean().backward()
            out["tp", overlap, sp] = (got.detach().cpu(), want.detach().cpu(),
                                      {n: p.grad.detach().cpu() for n, p in par.named_parameters()}, ref_grads,
                                      {str(p.device) for p in par.parameters()})
    model = make_model().cuda()
    xs, ys = (t.cuda() for t in batch(0))
    F.mse_loss(model(xs), ys).backward()
    ref = {n: p.grad.detach().cpu() for n, p in model.named_parameters()}
    model.zero_grad()
    for schedule in ("gpipe", "1f1b"):
        pipe = pz.pipeline.Pipeline(model, 4, schedule)
        loss = pipe.train_step(xs, ys, F.mse_loss)
        out["pipe", schedule] = (loss, float(F.mse_loss(model(xs), ys)), {n: p.grad.detach().cpu() for n, p in
                                                                          model.named_parameters()}, ref)
        model.zero_grad()
    pz.destroy()
    return out


def test_tp_block_and_pipeline_on_cuda_equal_torch():
    out = run_ranks(_rank_tp_and_pipeline, 1, start="spawn", timeout=180, env=ENV)[0].value
    tol = dict(rtol=1e-5, atol=1e-6)
    for key, v in out.items():
        if key[0] == "tp":
            got, want, grads, ref, devices = v
            assert devices == {"cuda:0"}, (key, devices)
            torch.testing.assert_close(got, want, **tol, msg=lambda m, key=key: f"{key}: {m}")
            for n, g in grads.items():
                torch.testing.assert_close(g, ref[n], **tol, msg=lambda m, key=key, n=n: f"{key} {n}: {m}")
        else:
            loss, full_loss, grads, ref = v
            assert loss == pytest.approx(full_loss, rel=1e-5), key  # mean of the 4 micro-batch losses
            for n, g in grads.items():
                torch.testing.assert_close(g, ref[n], **tol, msg=lambda m, key=key, n=n: f"{key} {n}: {m}")
