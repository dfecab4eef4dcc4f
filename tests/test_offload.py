"""Optimizer state on disk (pz.optim.NvmeAdamW, pyzero.optim.swap) and ZeRO offload.

References: pz.optim.AdamW in memory (itself tested against torch.optim in
test_cpu_optim.py); the nvme path must give bitwise the same weights.
"""
import errno
import os
import subprocess
import sys
import time

import pytest
import torch

import pyzero as pz
from pyzero.optim import functional as F
from pyzero.optim import swap


def make_params(seed, shapes=((1000, 37), (5,), (300_001,), (64, 64))):
    g = torch.Generator().manual_seed(seed)
    ps = [torch.randn(s, generator=g).requires_grad_() for s in shapes]
    return ps, [p.detach().clone().requires_grad_() for p in ps], g


@pytest.mark.parametrize("amsgrad", [False, True])
@pytest.mark.parametrize("sub_group", [50_000, 1 << 20])
def test_nvme_adamw_bitwise_equal_to_in_memory(tmp_path, amsgrad, sub_group):
    ps, qs, gen = make_params(0)
    groups = lambda xs: [{"params": xs[:2]}, {"params": xs[2:], "lr": 3e-3, "weight_decay": 0.0}]  # noqa: E731
    ours = pz.optim.NvmeAdamW(groups(ps), lr=1e-2, amsgrad=amsgrad, nvme_path=tmp_path, sub_group_elems=sub_group)
    ref = pz.optim.AdamW(groups(qs), lr=1e-2, amsgrad=amsgrad)
    sched = [torch.optim.lr_scheduler.StepLR(o, 2, 0.5) for o in (ours, ref)]
    assert len(ours._segments) == (7 if sub_group == 50_000 else 1)
    for step in range(6):
        for p, q in zip(ps, qs):
            g = torch.randn(p.shape, generator=gen)
            p.grad, q.grad = g.clone(), g.clone()
        if step == 2:  # a parameter without a gradient is skipped, as torch does
            ps[1].grad = qs[1].grad = None
        ours.step(), ref.step()
        for s in sched:
            s.step()
    for p, q in zip(ps, qs):
        assert torch.equal(p, q)
    sd, rd = ours.state_dict(), ref.state_dict()
    assert sd["param_groups"] == rd["param_groups"]
    for i in rd["state"]:
        for k in rd["state"][i]:
            assert torch.equal(sd["state"][i][k], rd["state"][i][k]), (i, k)
    assert ours.io_stats["read_bytes"] > 0 and ours.io_stats["write_bytes"] == ours.io_stats["read_bytes"]


def test_nvme_load_state_dict_from_torch_then_train(tmp_path):
    ps, qs, gen = make_params(1)
    ref = torch.optim.AdamW(qs, lr=1e-2, foreach=False)
    grads = [[torch.randint(-64, 65, p.shape, generator=gen).float() / 8 for p in ps] for _ in range(4)]
    for q, g in zip(qs, grads[0]):
        q.grad = g.clone()
    ref.step()
    with torch.no_grad():
        for p, q in zip(ps, qs):
            p.copy_(q)
    ours = pz.optim.NvmeAdamW(ps, lr=5.0, nvme_path=tmp_path, sub_group_elems=100_000)
    ours.load_state_dict(ref.state_dict())
    assert ours.param_groups[0]["lr"] == 1e-2
    for gs in grads[1:]:
        for p, q, g in zip(ps, qs, gs):
            p.grad, q.grad = g.clone(), g.clone()
        ours.step(), ref.step()
    for p, q in zip(ps, qs):  # dyadic gradients, beta2 > 0: equal within torch's sqrt rounding
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
    assert ours.state[ps[2]]["step"].item() == 4


def test_swap_files_removed_on_close(tmp_path):
    ps, _, _ = make_params(2)
    opt = pz.optim.NvmeAdamW(ps, nvme_path=tmp_path, sub_group_elems=100_000)
    (d,) = os.listdir(tmp_path)
    files = os.listdir(tmp_path / d)
    assert len(files) == len(opt._segments) and all(f.endswith(".swap") for f in files)
    opt.close()
    assert os.listdir(tmp_path) == []


def test_nvme_path_checks(tmp_path, monkeypatch):
    ps, _, _ = make_params(3)
    with pytest.raises(ValueError, match="nvme_path: required"):
        pz.optim.NvmeAdamW(ps)
    with pytest.raises(ValueError, match="does not exist"):
        pz.optim.NvmeAdamW(ps, nvme_path=tmp_path / "missing")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a directory"):
        pz.optim.NvmeAdamW(ps, nvme_path=tmp_path / "file")
    with pytest.raises(ValueError, match="the swap files need 1024.00 GiB"):
        swap.check_path(tmp_path, 1 << 40)

    class Tiny:  # statvfs of a disk with 1 MiB free
        f_bavail, f_frsize = 256, 4096

    with monkeypatch.context() as m:
        m.setattr(swap.os, "statvfs", lambda _: Tiny)
        with pytest.raises(ValueError, match=r"nvme_path: .* has 0.00 GiB free, the swap files need"):
            pz.optim.NvmeAdamW(ps, nvme_path=tmp_path)
    with monkeypatch.context() as m:  # root ignores mode bits, so ask access() directly
        m.setattr(swap.os, "access", lambda *a: False)
        with pytest.raises(ValueError, match="is not writable"):
            pz.optim.NvmeAdamW(ps, nvme_path=tmp_path)
    assert sorted(os.listdir(tmp_path)) == ["file"]  # nothing was created by the failed attempts


def test_enospc_mid_run_raises_and_leaves_checkpoint_intact(tmp_path, monkeypatch):
    ps, _, gen = make_params(4)
    (tmp_path / "swap").mkdir()
    opt = pz.optim.NvmeAdamW(ps, lr=1e-2, nvme_path=tmp_path / "swap", sub_group_elems=100_000)
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    ckpt = tmp_path / "ckpt.pt"
    torch.save({"params": [p.detach().clone() for p in ps], "opt": opt.state_dict()}, ckpt)
    before = ckpt.read_bytes()

    def full(*a):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(swap.os, "pwritev", full)
    with pytest.raises(swap.SwapError, match="out of disk space writing swap file"):
        opt.step()
    monkeypatch.undo()
    with pytest.raises(swap.SwapError, match="restore from the last checkpoint"):
        opt.step()  # refuses to go on from inconsistent state
    assert ckpt.read_bytes() == before
    saved = torch.load(ckpt, weights_only=True)
    fresh, _, _ = make_params(4)
    again = pz.optim.NvmeAdamW(fresh, lr=1e-2, nvme_path=tmp_path / "swap", sub_group_elems=100_000)
    again.load_state_dict(saved["opt"])
    assert torch.equal(again.state[fresh[2]]["exp_avg"], saved["opt"]["state"][2]["exp_avg"])


def test_io_overlaps_the_step(tmp_path, monkeypatch):
    """With 50 ms per read, 50 ms per write and 100 ms per step of a sub-group, the serial
    schedule takes 200 ms a group; the double-buffered one about 100 ms."""
    p = torch.zeros(6 * 1024, requires_grad=True)
    opt = pz.optim.NvmeAdamW([p], nvme_path=tmp_path, sub_group_elems=1024)
    assert len(opt._segments) == 6
    io, step = swap.Swapper._io, F.adam_step

    def slow_io(*a):
        time.sleep(0.05)
        io(*a)

    def slow_step(*a, **k):
        time.sleep(0.1)
        step(*a, **k)

    monkeypatch.setattr(swap.Swapper, "_io", staticmethod(slow_io))
    monkeypatch.setattr(F, "adam_step", slow_step)
    p.grad = torch.ones_like(p)
    t0 = time.perf_counter()
    opt.step()
    elapsed = time.perf_counter() - t0
    serial = 6 * (0.05 + 0.05 + 0.1)
    assert elapsed < 0.75 * serial, elapsed
    assert opt.io_stats["io_wait_s"] < 0.35  # about the first read and the last write


RSS_SCRIPT = r"""
import resource, sys, tempfile, torch, pyzero as pz
n = 1 << 24
p = torch.zeros(n, requires_grad=True)
p.grad = torch.ones(n)
if sys.argv[1] == "nvme":
    opt = pz.optim.NvmeAdamW([p], nvme_path=sys.argv[2], sub_group_elems=1 << 20)
else:
    opt = pz.optim.AdamW([p])
for _ in range(2):
    opt.step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
"""


def test_peak_rss_with_nvme_is_lower_by_about_the_state(tmp_path):
    def peak(mode):
        out = subprocess.run([sys.executable, "-c", RSS_SCRIPT, mode, str(tmp_path)], capture_output=True,
                             text=True, timeout=120, env=dict(os.environ, OMP_NUM_THREADS="1"))
        assert out.returncode == 0, out.stderr
        return int(out.stdout.split()[-1])

    state = 2 * 4 * (1 << 24)  # exp_avg + exp_avg_sq: 128 MiB
    buffers = 2 * 2 * 4 * (1 << 20)  # two sub-groups of both states in RAM: 16 MiB
    saved = peak("memory") - peak("nvme")
    assert 0.7 * (state - buffers) < saved < 1.3 * state, (saved, state)
