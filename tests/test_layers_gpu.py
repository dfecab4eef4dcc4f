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


def torch_reference():
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = (t.cuda() for t in batch(step))
        F.mse_loss(model(x), y).backward()
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
