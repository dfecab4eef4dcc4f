"""Optimizer state on disk (pz.optim.NvmeAdamW, pyzero.optim.swap) and ZeRO offload.

References: pz.optim.AdamW in memory (itself tested against torch.optim in
test_cpu_optim.py); the nvme path must give bitwise the same weights.
"""
import errno
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import pytest
import torch

import pyzero as pz
import pyzero.zero.optimizer as zero_optimizer
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


def torch_stepped_once(steps, **kw):
    """(ps, qs, torch AdamW over qs after one step, the dyadic gradients of `steps` steps): ps hold the
    values qs have after that step, for an optimizer that loads torch's state and goes on."""
    ps, qs, gen = make_params(1)
    ref = torch.optim.AdamW(qs, lr=1e-2, foreach=False, **kw)
    grads = [[torch.randint(-64, 65, p.shape, generator=gen).float() / 8 for p in ps] for _ in range(steps)]
    for q, g in zip(qs, grads[0]):
        q.grad = g.clone()
    ref.step()
    with torch.no_grad():
        for p, q in zip(ps, qs):
            p.copy_(q)
    return ps, qs, ref, grads


def test_nvme_load_state_dict_from_torch_then_train(tmp_path):
    ps, qs, ref, grads = torch_stepped_once(4)
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


def test_nvme_load_of_an_amsgrad_state_with_or_without_amsgrad_at_construction(tmp_path):
    """A state dict whose group has amsgrad=True (torch's, with max_exp_avg_sq) loads into an NvmeAdamW built
    with amsgrad=True, and into one built without it, whose swap files grow by the max_exp_avg_sq (it dropped
    that state, then step() raised IndexError; then the load was refused): both train as torch does."""
    ps, qs, ref, grads = torch_stepped_once(3, amsgrad=True)
    rs = [p.detach().clone().requires_grad_() for p in ps]
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    plain = pz.optim.NvmeAdamW(rs, lr=1e-2, nvme_path=tmp_path / "a", sub_group_elems=100_000)
    files = plain.state_bytes()[1]
    plain.load_state_dict(ref.state_dict())
    assert plain.param_groups[0]["amsgrad"] is True and plain.state_bytes()[1] == files * 3 // 2
    for i, q in enumerate(qs):
        assert torch.equal(plain.state[rs[i]]["max_exp_avg_sq"], ref.state[q]["max_exp_avg_sq"])
    ours = pz.optim.NvmeAdamW(ps, lr=1e-2, amsgrad=True, nvme_path=tmp_path / "b", sub_group_elems=100_000)
    ours.load_state_dict(ref.state_dict())
    for gs in grads[1:]:
        for p, q, r, g in zip(ps, qs, rs, gs):
            p.grad, q.grad, r.grad = g.clone(), g.clone(), g.clone()
        ours.step(), plain.step(), ref.step()
    for p, q, r in zip(ps, qs, rs):
        assert torch.allclose(p, q, rtol=0, atol=1e-6)
        assert torch.equal(r, p)


def test_nvme_add_param_group_is_refused(tmp_path):
    """The swap files are laid out for the parameters given at construction: a group added later would
    never be stepped, so adding one raises (and changes nothing)."""
    ps, _, _ = make_params(5)
    opt = pz.optim.NvmeAdamW(ps[:2], nvme_path=tmp_path, sub_group_elems=100_000)
    with pytest.raises(ValueError, match="add_param_group: .*construction"):
        opt.add_param_group({"params": ps[2:]})
    assert len(opt.param_groups) == 1 and len(opt.param_groups[0]["params"]) == 2
    opt.close()


def test_swap_files_removed_on_close(tmp_path):
    ps, _, _ = make_params(2)
    opt = pz.optim.NvmeAdamW(ps, nvme_path=tmp_path, sub_group_elems=100_000)
    (d,) = os.listdir(tmp_path)
    files = os.listdir(tmp_path / d)
    assert len(files) == len(opt._segments) and all(f.endswith(".swap") for f in files)
    opt.close()
    assert os.listdir(tmp_path) == []
    opt.close()  # (again: nothing to do)
    opt = pz.optim.NvmeAdamW(ps, nvme_path=tmp_path, sub_group_elems=100_000)
    for p in ps:
        p.grad = torch.ones_like(p)
    opt.step()
    opt.close()  # then the state on disk is gone: a clear error, not an IndexError
    with pytest.raises(swap.SwapError, match="removed by close"):
        opt.step()
    with pytest.raises(swap.SwapError, match="removed by close"):
        opt.state_dict()


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
        # one sub-group: the 4 parameters' 341102 elements padded to 16 each (341136), then to 4 KiB per state
        need = 2 * 4 * -(-(37000 + 16 + 300_016 + 4096) // 1024) * 1024
        with pytest.raises(ValueError, match=rf"nvme_path: .* has 1\.00 MiB free, the swap files need "
                                             rf"{need / 2**20:.2f} MiB$"):
            pz.optim.NvmeAdamW(ps, nvme_path=tmp_path)  # (was: has 0.00 GiB free, the swap files need 0.00 GiB)
        for free, need, text in ((512, 1536, "has 512 bytes free, the swap files need 1.50 KiB"),
                                 (1 << 20, (1 << 20) + 1, "has 1048576 bytes free, the swap files need 1048577 bytes"),
                                 (3 << 30, 5 << 30, "has 3.00 GiB free, the swap files need 5.00 GiB")):
            m.setattr(swap.os, "statvfs", lambda _, free=free: SimpleNamespace(f_bavail=free, f_frsize=1))
            with pytest.raises(ValueError) as info:
                swap.check_path(tmp_path, need)
            assert str(info.value) == f"nvme_path: {str(tmp_path)!r} {text}"
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


# The child's own high-water RSS (VmHWM: its memory after exec). Not ru_maxrss: Linux carries the
# parent's high-water mark across fork and exec into it, and the test process may be larger than either run.
RSS_SCRIPT = r"""
import sys, tempfile, torch, pyzero as pz
n = 1 << 24
p = torch.zeros(n, requires_grad=True)
p.grad = torch.ones(n)
if sys.argv[1] == "nvme":
    opt = pz.optim.NvmeAdamW([p], nvme_path=sys.argv[2], sub_group_elems=1 << 20)
else:
    opt = pz.optim.AdamW([p])
for _ in range(2):
    opt.step()
print(next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:")))
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


# ---- ZeroOptimizer(offload=...) on CPU models -------------------------------------------

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.head = torch.nn.Linear(16, 30), torch.nn.Linear(30, 30), torch.nn.Linear(30, 5)

    def forward(self, x):
        return self.head(torch.tanh(self.fc2(torch.tanh(self.fc1(x)))))


def _zero_run(stage, optimizer, offload, nvme_dir, steps=4, ckpt=None, offload_params=False, loss_scale=None,
              param_dtype=None):
    """Train `steps` steps; with `ckpt`, the first half runs without offload, is saved, and a
    fresh model and ZeroOptimizer(offload=...) load it and finish. Returns the weights, the inner
    optimizer's class name and memory_stats() with the shards' element count."""
    torch.manual_seed(0)
    model = Net()
    kw = dict(lr=1e-2, weight_decay=0.1, loss_scale=loss_scale, param_dtype=param_dtype)
    extra = {}
    if offload:
        extra["offload"] = offload
    if offload == "nvme":
        extra.update(nvme_path=nvme_dir, offload_params=stage == 3)
    if offload_params:
        extra["offload_params"] = True
    opt = pz.ZeroOptimizer(model, optimizer, stage=stage, **({} if ckpt else extra), **kw)
    rank, world = pz.get_rank(), pz.get_world_size()
    for step in range(steps):
        if ckpt is not None and step == steps // 2:
            pz.checkpoint.save(ckpt, model, opt, step)
            torch.manual_seed(0)
            model = Net()
            opt = pz.ZeroOptimizer(model, optimizer, stage=stage, **extra, **kw)
            assert pz.checkpoint.load(ckpt, model, opt) == step
        g = torch.Generator().manual_seed(step)
        x, y = (t.to(param_dtype or torch.float32) for t in (torch.randn(12, 16, generator=g),
                                                              torch.randn(12, 5, generator=g)))
        lo, hi = rank * 12 // world, (rank + 1) * 12 // world
        loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi], reduction="sum") / 12 * world
        opt.scale_loss(loss).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
    state = opt.full_state_dict() if stage == 3 else model.state_dict()
    storage = {t.untyped_storage().data_ptr() for t in model.parameters()}
    leaves = [p for g in opt.inner.param_groups for p in g["params"]]
    mem = dict(opt.memory_stats(), shard_elems=sum(layout.shard_size for layout, _, _ in opt.shards()),
               chunks=len(opt._step_chunks()), slot_elems=max((hi - lo for _, lo, hi in opt._slots), default=0),
               grad_bytes=opt._host_grad_dtype.itemsize,
               shares=any(p.untyped_storage().data_ptr() in storage for p in leaves + [p.grad for p in leaves]
                          if p is not None and p.numel()))
    return state and {k: v.clone() for k, v in state.items()}, type(opt.inner).__name__, mem


def _zero_ranks(stage, nvme_dir):
    pz.init()
    runs = {"torch": _zero_run(stage, torch.optim.AdamW, None, None),
            "pz": _zero_run(stage, pz.optim.AdamW, None, None),
            "cpu": _zero_run(stage, torch.optim.AdamW, "cpu", None),
            "nvme": _zero_run(stage, torch.optim.AdamW, "nvme", os.path.join(nvme_dir, f"r{pz.get_rank()}")),
            "nvme_ckpt": _zero_run(stage, pz.optim.AdamW, "nvme", os.path.join(nvme_dir, f"r{pz.get_rank()}"),
                                   ckpt=os.path.join(nvme_dir, "ckpt"))}
    # The path a CUDA model takes (host masters and gradient copies beside the device shards),
    # here with the CPU as the "device".
    zero_optimizer._host_copies = lambda device: True
    runs["host_cpu"] = _zero_run(stage, torch.optim.AdamW, "cpu", None, offload_params=stage == 3)
    runs["host_nvme_ckpt"] = _zero_run(stage, pz.optim.AdamW, "nvme", os.path.join(nvme_dir, f"r{pz.get_rank()}"),
                                       ckpt=os.path.join(nvme_dir, "ckpt_host"))
    # the clip and unscale factor applied on the host: in pz.optim's pass, or (RMSprop, run as
    # given) by a separate multiply; loss scale 2^4 growing every 2 steps
    scaling = {"init_scale": 16.0, "growth_interval": 2}
    runs["host_scaled"] = _zero_run(stage, pz.optim.AdamW, "cpu", None, loss_scale=scaling)
    runs["host_rmsprop"] = _zero_run(stage, torch.optim.RMSprop, "cpu", None)
    # a bf16 model: the step writes the bf16 copies the device gets (stage 3: the host shards)
    runs["host_bf16"] = _zero_run(stage, torch.optim.AdamW, "cpu", None, param_dtype=torch.bfloat16,
                                  offload_params=stage == 3)
    if stage == 3:  # bf16 shards on the device, bf16 host copies beside the masters
        runs["host_bf16_device_shards"] = _zero_run(stage, torch.optim.AdamW, "cpu", None, param_dtype=torch.bfloat16)
    runs["host_bf16_ckpt"] = _zero_run(stage, pz.optim.AdamW, "cpu", None, param_dtype=torch.bfloat16,
                                       ckpt=os.path.join(nvme_dir, "ckpt_bf16"))
    # the host step in chunks of whole pieces, each sent to the device as the next one steps
    # (stages 1-2; see [Note: chunked host step])
    chunk = zero_optimizer._STEP_CHUNK_ELEMS
    zero_optimizer._STEP_CHUNK_ELEMS = 100
    try:
        runs["host_chunked"] = _zero_run(stage, torch.optim.AdamW, "cpu", None)
        runs["host_chunked_bf16"] = _zero_run(stage, pz.optim.AdamW, "cpu", None, param_dtype=torch.bfloat16,
                                              loss_scale=scaling)
    finally:
        zero_optimizer._STEP_CHUNK_ELEMS = chunk
    zero_optimizer._host_copies = lambda device: device.type == "cuda"
    runs["scaled"] = _zero_run(stage, pz.optim.AdamW, None, None, loss_scale=scaling)
    runs["bf16_scaled"] = _zero_run(stage, pz.optim.AdamW, None, None, param_dtype=torch.bfloat16,
                                    loss_scale=scaling)
    runs["rmsprop"] = _zero_run(stage, torch.optim.RMSprop, None, None)
    runs["bf16"] = _zero_run(stage, pz.optim.AdamW, None, None, param_dtype=torch.bfloat16)
    return runs


@pytest.mark.parametrize("world,stage", [(1, 1), (2, 2), (3, 3), (3, 1), (2, 3)])
def test_zero_offload_same_weights_as_no_offload(tmp_path, world, stage):
    """offload="cpu" and "nvme" give bitwise the weights of no offload with pz.optim.AdamW (also
    when a run without offload is checkpointed and finished with nvme), and torch.optim.AdamW's
    within fp32 tolerance."""
    from pyzero.launch import run_ranks

    for r in range(world):
        (tmp_path / f"r{r}").mkdir()
    results = run_ranks(_zero_ranks, world, args=(stage, str(tmp_path)), timeout=120)
    for res in results[:1] if stage == 3 else results:  # stage 3: the full state is on rank 0
        runs = res.value
        assert runs["cpu"][1] == runs["nvme"][1] == runs["nvme_ckpt"][1] == runs["host_cpu"][1] == "AdamW"
        for name, ref in runs["pz"][0].items():
            for run in ("cpu", "nvme", "nvme_ckpt", "host_cpu", "host_nvme_ckpt", "scaled", "host_chunked"):
                assert torch.equal(runs[run][0][name], ref), (run, name)
            assert torch.allclose(runs["torch"][0][name], ref, rtol=1e-5, atol=2e-6), name
        # (a power-of-two scale unscales exactly: "scaled" equals "pz"; unscaled twice or not at all it would not)
        assert not torch.equal(runs["rmsprop"][0]["fc1.weight"], runs["pz"][0]["fc1.weight"])
        for run in ("scaled", "rmsprop", "bf16"):
            for name, ref in runs[run][0].items():
                assert torch.equal(runs["host_" + run][0][name], ref), (run, name)
        for name, ref in runs["bf16"][0].items():
            for run in ("host_bf16_ckpt", "host_bf16_device_shards") if stage == 3 else ("host_bf16_ckpt",):
                assert torch.equal(runs[run][0][name], ref), (run, name)
        for name, ref in runs["bf16_scaled"][0].items():
            assert torch.equal(runs["host_chunked_bf16"][0][name], ref), name
    if stage < 3:  # (a rank whose shard holds one piece steps it in one chunk)
        assert max(r.value["host_chunked"][2]["chunks"] for r in results) > 1
        assert all(r.value["host_cpu"][2]["chunks"] == 1 for r in results)
    for res in results:
        # host copies: no optimizer bytes on the device, nor gradient shards; in host memory the
        # masters and the gradient shards (fp32) beside the optimizer state. After step() no
        # gradient stays on the device either way (step ends with zero_grad, which releases them)
        plain, host = res.value["cpu"][2], res.value["host_cpu"][2]
        assert host["optimizer"] == 0 and host["total"] == host["params"] + host["grads"], host
        assert not host["shares"], "the inner optimizer's tensors share memory with the model's"
        assert plain["grads"] == 0, plain
        assert host["grads"] == 0, host
        assert plain["shard_elems"] == host["shard_elems"], (plain, host)
        assert host["host"] == plain["optimizer"] + 8 * plain["shard_elems"], (plain, host)
        # bf16: the masters are separate either way; host adds the gradient shards and the bf16 copies;
        # with the offload pipeline (the default) the gradients are bf16 where that is exact (one rank)
        # and each slot widens its own into an fp32 scratch (see [Note: offload pipeline])
        plain, host = res.value["bf16"][2], res.value["host_bf16"][2]
        assert host["grad_bytes"] == (2 if len(results) == 1 or stage == 1 else 4), host  # (stage 1 reduces in bf16)
        scratch = 4 * host["slot_elems"] if host["grad_bytes"] == 2 else 0
        assert host["host"] == plain["optimizer"] + (host["grad_bytes"] + 2) * plain["shard_elems"] + scratch, (plain,
                                                                                                              host)


class NetWithUnused(Net):
    def __init__(self):
        super().__init__()
        self.unused = torch.nn.Linear(7, 3)  # never in forward: its gradients stay zero


def _accumulate_run(stage, host, comm_dtype):
    """Three steps, each of three backwards: one under no_sync, then two synchronised (stage 2-3
    reduce during each, so the second adds to what the first reduced); the weights."""
    zero_optimizer._host_copies = (lambda device: True) if host else (lambda device: device.type == "cuda")
    try:
        torch.manual_seed(0)
        model = NetWithUnused()
        opt = pz.ZeroOptimizer(model, pz.optim.AdamW, stage=stage, lr=1e-2, weight_decay=0.1,
                               comm_dtype=comm_dtype, loss_scale={"init_scale": 8.0, "growth_interval": 2},
                               **({"offload": "cpu"} if host else {}))
        rank, world = pz.get_rank(), pz.get_world_size()
        for step in range(3):
            for micro in range(3):
                g = torch.Generator().manual_seed(10 * step + micro)
                x, y = torch.randn(8, 16, generator=g), torch.randn(8, 5, generator=g)
                lo, hi = rank * 8 // world, (rank + 1) * 8 // world
                loss = torch.nn.functional.mse_loss(model(x[lo:hi]), y[lo:hi], reduction="sum")
                if micro == 0:
                    with opt.no_sync():
                        opt.scale_loss(loss).backward()
                else:
                    opt.scale_loss(loss).backward()
            opt.clip_grad_norm_(0.3)
            opt.step()
        state = opt.full_state_dict() if stage == 3 else model.state_dict()
        return state and {k: v.clone() for k, v in state.items()}
    finally:
        zero_optimizer._host_copies = lambda device: device.type == "cuda"


def _accumulate_ranks(stage):
    pz.init()
    return {(host, str(cd)): _accumulate_run(stage, host, cd)
            for host in (False, True) for cd in ((None,) if stage == 1 else (None, torch.bfloat16))}


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_offload_host_gradients_accumulate_like_the_device(stage):
    """The host gradient shards of a CUDA model's offload (here with the CPU as the device):
    gradients of several synchronised backwards (and a no_sync one) accumulated on the host,
    bf16 reductions widened there, a parameter without gradients zero, clipping and loss scaling:
    bitwise the weights of the run that keeps the shards on the device."""
    from pyzero.launch import run_ranks

    results = run_ranks(_accumulate_ranks, 2, args=(stage,), timeout=120)
    runs = results[0].value
    for cd in ("None",) if stage == 1 else ("None", "torch.bfloat16"):  # (stage 1 reduces in the model dtype)
        ref, got = runs[(False, cd)], runs[(True, cd)]
        assert set(ref) == set(got)
        for name, want in ref.items():
            assert torch.equal(got[name], want), (cd, name)
    # bf16 reductions round (stages 2-3; stage 1 reduces in the model's dtype); the unused layer
    # is skipped as torch skips a parameter without .grad
    if stage > 1:
        assert not torch.equal(runs[(False, "None")]["fc1.weight"], runs[(False, "torch.bfloat16")]["fc1.weight"])
    torch.manual_seed(0)
    init = NetWithUnused()
    for run in runs.values():
        assert torch.equal(run["unused.weight"], init.unused.weight.detach())
        assert not torch.equal(run["fc1.weight"], init.fc1.weight.detach())


def _bad_offload_args(tmp):
    pz.init()
    torch.manual_seed(0)
    model = Net()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    errors = {}
    cases = {"mode": dict(offload="gpu"), "params_stage2": dict(stage=2, offload="cpu", offload_params=True),
             "path_without_nvme": dict(offload="cpu", nvme_path=tmp), "missing": dict(offload="nvme"),
             "not_there": dict(offload="nvme", nvme_path=os.path.join(tmp, "nope")),
             "sgd": dict(offload="nvme", nvme_path=tmp, optimizer=torch.optim.SGD)}
    for name, kw in cases.items():
        kw = dict(kw)
        optimizer = kw.pop("optimizer", torch.optim.AdamW)
        try:
            pz.ZeroOptimizer(model, optimizer, **{"stage": 1, **kw}, lr=1e-2)
        except (ValueError, TypeError) as e:
            errors[name] = str(e)
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=1, offload="cpu", lr=1e-2)  # the model is still free
    untouched = all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    return errors, untouched, type(opt.inner).__module__


def test_zero_offload_bad_arguments_fail_before_the_model_is_touched(tmp_path):
    from pyzero.launch import run_ranks

    for res in run_ranks(_bad_offload_args, 2, args=(str(tmp_path),), timeout=60):
        errors, untouched, inner_module = res.value
        assert "offload: expected None, 'cpu' or 'nvme'" in errors["mode"]
        assert "offload_params: needs stage=3" in errors["params_stage2"]
        assert "nvme_path: only used with offload='nvme'" in errors["path_without_nvme"]
        assert "nvme_path: required" in errors["missing"]
        assert "does not exist" in errors["not_there"]
        assert "supports torch.optim.Adam/AdamW" in errors["sgd"]
        assert untouched and inner_module == "pyzero.optim.adam"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_host_grads_take_device_slices_in_order(device):
    """_HostGrads, the host gradient shards of offload: fp32 slices into new ranges land in the
    shard, 16-bit ones are widened, later ones add in the order they came, what nothing wrote
    reads zero; a slice's device buffer freed and its memory rewritten at once changes nothing
    (the copy is still queued on the side stream)."""
    from pyzero.zero.optimizer import _HostGrads

    n, half = 100_003, 50_001
    pin = device == "cuda"
    shards = [torch.full((n,), 7.0).pin_memory() if pin else torch.full((n,), 7.0), torch.full((9,), 7.0)]
    hg = _HostGrads(torch.device(device, 0) if pin else torch.device("cpu"), shards)
    hg.restart()  # (the shards' old values are not gradients)
    gen = torch.Generator().manual_seed(0)
    parts = [torch.randn(n, generator=gen) for _ in range(3)]
    ref = torch.zeros(n)
    puts = [(0, half, parts[0][:half]), (half, n - 3, parts[0][half:n - 3].bfloat16()),  # backward 1
            (0, half, parts[1][:half].bfloat16()), (half, n - 3, parts[1][half:n - 3]),  # backward 2: adds
            (0, half, parts[2][:half])]
    for lo, hi, t in puts:
        d = t.to(device)
        hg.put(0, lo, hi, d)
        del d
        torch.full((hi - lo,), float("nan"), dtype=t.dtype, device=device)  # the freed memory, rewritten
        ref[lo:hi] += t.float()
    hg.finish()
    assert torch.equal(shards[0], ref)  # (the last 3 elements: nothing wrote them, zero)
    assert torch.equal(shards[1], torch.zeros(9))
    hg.put(1, 0, 9, torch.ones(9, device=device))  # after finish(): every range holds values, this adds
    hg.finish()
    assert torch.equal(shards[1], torch.ones(9))
    hg.restart()
    hg.put(1, 2, 4, torch.full((2,), 5.0, device=device))
    hg.finish()
    assert shards[1].tolist() == [0, 0, 5, 5, 0, 0, 0, 0, 0]


def test_pinned_pages_unregister_once_after_the_last_view(monkeypatch):
    """pinned_empty's exact-size page-locked memory: CUDA's registration is undone once, when
    the last tensor using the pages is gone (here with the CUDA call recorded, not made)."""
    import gc

    from pyzero.zero import offload

    calls = []

    class Cudart:
        def cudaHostUnregister(self, ptr):
            calls.append(ptr)
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Cudart())
    pages = offload._PinnedPages(-1, 1 << 16)
    pages.ptr = 4096
    t = torch.frombuffer(pages, dtype=torch.float32, count=1 << 14)
    del pages
    t.fill_(2.0)
    view = t[100:200]
    del t
    gc.collect()
    assert calls == [] and float(view.sum()) == 200.0
    del view
    gc.collect()
    assert calls == [4096]


@pytest.mark.gpu
def test_pinned_empty_is_page_locked_at_its_exact_size():
    """From 64 MiB up pinned_empty locks exactly the tensor's bytes (torch's pin_memory=True would
    take the next power of two); DMA copies both ways; freeing it leaves CUDA usable."""
    import gc

    from pyzero.zero.offload import pinned_empty

    n = (96 << 20) // 4  # 96 MiB: pin_memory=True would lock 128 MiB
    t = pinned_empty(n, torch.float32)
    assert t.is_pinned() and t.numel() == n and t.untyped_storage().nbytes() == 96 << 20
    src = torch.arange(n, dtype=torch.float32, device="cuda")
    t.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(t[-5:], torch.arange(n - 5, n, dtype=torch.float32))
    back = torch.empty(n, device="cuda")
    back.copy_(t, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, src)
    small = pinned_empty(1000, torch.bfloat16)
    assert small.is_pinned() and small.dtype == torch.bfloat16
    del t, small
    gc.collect()
    assert float(pinned_empty(n, torch.float32).zero_().sum()) == 0.0


# ---- estimate_memory with offload (hand-computed) -------------------------------------

def test_estimate_memory_offload_hand_computed():
    from pyzero.zero import estimate_memory

    # Ψ = 1e9, N = 4, K = 12, mixed precision: S = 2.5e8
    m = estimate_memory(1e9, 4, 2, offload="cpu")
    assert m["device"] == 2e9  # fp16 parameters; gradients leave bucket by bucket
    assert m["host"] == 12 * 2.5e8 + 4 * 2.5e8 + 2 * 2.5e8 == 4.5e9
    assert m["disk"] == 0 and m["total"] == 2e9 + 5e8 + 3e9
    m = estimate_memory(1e9, 4, 3, offload="nvme", offload_params=True, nvme_sub_group=10**6)
    assert m["device"] == 0 and m["disk"] == 8 * 2.5e8
    assert m["host"] == 4 * 2.5e8 + 4 * 2.5e8 + 2 * 2.5e8 + 2 * 10**6 * 8  # master, grad, w-byte shard, buffers
    m = estimate_memory(1e9, 2, 1, 8, False, offload="cpu")  # fp32: K = 8 has no master, S = 5e8
    assert m["device"] == 4e9 + 4e9
    # moments, gradient shard, and the fp32 parameter shard the step writes, which is the master (once)
    assert m["host"] == 8 * 5e8 + 4 * 5e8 + 4 * 5e8
    m = estimate_memory(1e9, 2, 2, 8, False, offload="nvme", nvme_sub_group=10**6)
    assert m["disk"] == 8 * 5e8  # the moments
    assert m["host"] == 4 * 5e8 + 4 * 5e8 + 2 * 10**6 * 8  # gradient shard, master, two sub-groups' buffers
    m = estimate_memory(1e9, 4, 2)
    assert m["device"] == m["total"] and m["host"] == m["disk"] == 0
    m = estimate_memory(1e9, 1, 2, 4 + 2.03125, offload="cpu", host_grad_bytes=2)  # int8 moments, bf16 grads
    assert m["host"] == pytest.approx((4 + 2.03125 + 2 + 2) * 1e9, rel=1e-12)
    with pytest.raises(ValueError, match="host_grad_bytes: 2 .* needs mixed_precision=True"):
        estimate_memory(1e9, 1, 2, 8, False, offload="cpu", host_grad_bytes=2)
    with pytest.raises(ValueError, match="host_grad_bytes: expected 2 or 4"):
        estimate_memory(1e9, 1, 2, offload="cpu", host_grad_bytes=3)
    with pytest.raises(ValueError, match="offload: needs a ZeRO stage"):
        estimate_memory(1e9, 4, 0, offload="cpu")
    with pytest.raises(ValueError, match="offload_params: needs stage=3"):
        estimate_memory(1e9, 4, 2, offload="cpu", offload_params=True)
    with pytest.raises(ValueError, match="offload: expected None"):
        estimate_memory(1e9, 4, 2, offload="disk")


def test_estimate_memory_offload_peak_holds_the_gathered_units():
    """Stage 3 with offload, Ψ = 1e9 on 8 ranks, mixed precision, units of 2e8, 1 GB of activations, by
    hand: the device holds its 16-bit parameter shard (2 x 1.25e8) and the largest of: the activations'
    moment, 1e9 + the unit computing and the one prefetched (2 x 2 x 2e8); the end of backward, three
    units' fp32 staging buffers (3 x 4 x 2e8) and their reduced outputs, a unit's shard each
    (3 x 4 x 2.5e7), the last unit's 16-bit gradients (2 x 2e8), it and the unit prefetched (2 x 2 x 2e8)."""
    from pyzero.zero import estimate_memory

    m = estimate_memory(1e9, 8, 3, largest_layer_params=2e8, activation_bytes=1e9, offload="cpu")
    end = 3 * 4 * 2e8 + 3 * 4 * 2.5e7 + 2 * 2e8 + 2 * 2 * 2e8
    assert end > 1e9 + 2 * 2 * 2e8
    assert m["peak"] == pytest.approx(2 * 1.25e8 + end, rel=1e-12)
    assert m["gathered"] == 2 * 2 * 2e8
    m = estimate_memory(1e9, 8, 3, largest_layer_params=2e8, activation_bytes=1e9, offload="cpu",
                        offload_params=True)
    assert m["peak"] == pytest.approx(end, rel=1e-12)  # no parameter shard on the device
    m = estimate_memory(1e9, 8, 3, largest_layer_params=2e8, activation_bytes=10e9, offload="cpu")
    assert m["peak"] == pytest.approx(2 * 1.25e8 + 10e9 + 2 * 2 * 2e8, rel=1e-12)  # the activations' moment
    m = estimate_memory(1e9, 8, 1, activation_bytes=1e9, grads_done=0.5, offload="cpu")
    # stage 1: the 16-bit parameters (2e9) and the larger of half the 16-bit gradients + activations and
    # all of them (the step runs on the host: no temporaries on the device)
    assert m["peak"] == pytest.approx(2e9 + max(0.5 * 2e9 + 1e9, 2e9), rel=1e-12)


def test_pyzero_estimate_offload_columns(capsys):
    from pyzero.zero.memory import main

    main(["--params", "13e9", "--world", "1", "--offload", "cpu", "--gpu-gb", "32"])
    rows = {line.split()[0]: line.split()[1:] for line in capsys.readouterr().out.splitlines()
            if line.strip().startswith("ZeRO")}
    # 13B on one 32 GB GPU (the ZeRO-Offload paper's case): 26 GB of fp16 parameters on the device
    assert rows["ZeRO-2"] == ["26.00", "234.00", "0.00", "yes"]
    assert rows["ZeRO-1"][0] == "52.00" and rows["ZeRO-1"][-1] == "no"
    # 16-bit host gradients: 2 bytes less per parameter on the host (13e9 x 16 B)
    main(["--params", "13e9", "--world", "1", "--offload", "cpu", "--gpu-gb", "32", "--host-grad-bytes", "2"])
    out = capsys.readouterr().out
    rows = {line.split()[0]: line.split()[1:] for line in out.splitlines() if line.strip().startswith("ZeRO")}
    assert rows["ZeRO-2"] == ["26.00", "208.00", "0.00", "yes"] and "host gradients 2 B" in out
    with pytest.raises(SystemExit):
        main(["--params", "13e9", "--world", "1", "--offload", "cpu", "--fp32", "--host-grad-bytes", "2"])
    assert "host_grad_bytes: 2" in capsys.readouterr().err


def _bf16_ranks(nvme_dir):
    pz.init()
    out = []
    for offload in (None, "nvme"):
        torch.manual_seed(0)
        model = Net()
        extra = dict(offload="nvme", nvme_path=nvme_dir) if offload else {}
        opt = pz.ZeroOptimizer(model, pz.optim.AdamW, stage=2, param_dtype=torch.bfloat16, lr=1e-2, **extra)
        for step in range(3):
            g = torch.Generator().manual_seed(step)
            x, y = torch.randn(12, 16, generator=g), torch.randn(12, 5, generator=g)
            r, w = pz.get_rank(), pz.get_world_size()
            out_ = model(x[r * 6:(r + 1) * 6].to(torch.bfloat16)).float()
            torch.nn.functional.mse_loss(out_, y[r * 6:(r + 1) * 6]).backward()
            opt.step()
        out.append(([leaf.detach().clone() for _, leaf, _ in opt.pieces], model.state_dict()))
    return out


def test_zero_nvme_with_bf16_params_matches_in_memory(tmp_path):
    """Separate fp32 masters (param_dtype=bf16): the masters and the bf16 model agree bitwise."""
    from pyzero.launch import run_ranks

    for res in run_ranks(_bf16_ranks, 2, args=(str(tmp_path),), timeout=60):
        (m0, sd0), (m1, sd1) = res.value
        assert all(torch.equal(a, b) for a, b in zip(m0, m1))
        assert all(torch.equal(sd0[k], sd1[k]) for k in sd0)
        assert next(iter(sd1.values())).dtype == torch.bfloat16


def test_buffered_io_path_gives_the_same_result(tmp_path):
    """direct=False (what filesystems without O_DIRECT get) moves the same bytes."""
    ps, qs, gen = make_params(10)
    a = pz.optim.NvmeAdamW(ps, lr=1e-2, nvme_path=tmp_path, sub_group_elems=70_000, direct=False)
    b = pz.optim.NvmeAdamW(qs, lr=1e-2, nvme_path=tmp_path, sub_group_elems=70_000)
    assert not a.direct  # b uses O_DIRECT where the filesystem takes it (ext4 here)
    for _ in range(3):
        for p, q in zip(ps, qs):
            p.grad = torch.randn(p.shape, generator=gen)
            q.grad = p.grad.clone()
        a.step(), b.step()
    assert all(torch.equal(p, q) for p, q in zip(ps, qs))
    assert torch.equal(a.state[ps[2]]["exp_avg_sq"], b.state[qs[2]]["exp_avg_sq"])


def _memory_stats_ranks(nvme_dir):
    pz.init()
    torch.manual_seed(0)
    model = Net()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, offload="nvme", nvme_path=nvme_dir,
                           lr=1e-2)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    return opt.memory_stats(), opt.layout.shard_size, opt.inner.state_bytes()


def test_zero_nvme_memory_stats_counts_disk_not_ram(tmp_path):
    from pyzero.launch import run_ranks

    (res,) = run_ranks(_memory_stats_ranks, 1, args=(str(tmp_path),), timeout=60)
    stats, shard, (ram, disk) = res.value
    # one sub-group holds the whole shard (1595 elements, each piece 16-aligned): exp_avg and
    # exp_avg_sq, each padded to a multiple of 1024 elements: 2048
    padded = 2048
    assert shard == 1595
    assert stats["disk"] == disk == 2 * 4 * padded
    assert stats["optimizer"] == ram == 2 * 2 * 4 * padded  # two buffers of both states


def test_nvme_bad_grad_raises_before_any_change(tmp_path):
    ps, _, gen = make_params(11)
    opt = pz.optim.NvmeAdamW(ps, nvme_path=tmp_path, sub_group_elems=100_000)
    before = [p.detach().clone() for p in ps]
    for p in ps:
        p.grad = torch.randn(p.shape, generator=gen)
    ps[3].grad = ps[3].grad.t()  # same shape (64, 64), not contiguous
    with pytest.raises(ValueError, match=r"params\[3\].grad: expected a dense contiguous float32 CPU tensor"):
        opt.step()
    assert len(opt.state) == 0 and all(torch.equal(p, b) for p, b in zip(ps, before))


# ---- pyzero-bench capacity ------------------------------------------------------------

@pytest.mark.parametrize("limit,start,attempts,want", [
    (37, 30, 10, 37),    # up by a quarter (30, 38 fails), then bisecting
    (37, 60, 10, 37),    # down by a quarter first
    (37, 30, 2, 30),     # out of attempts: the largest that fit so far
    (0, 5, 10, None),    # nothing fits
    (500, 90, 10, 100),  # everything fits: stops at max_layers
])
def test_capacity_search_finds_the_largest_size_that_fits(limit, start, attempts, want):
    from pyzero.bench.capacity import search

    calls = []

    def fits(n):
        calls.append(n)
        return n <= limit

    best, tried = search(fits, start, 100, attempts)
    assert best == want
    assert len(calls) == len(set(calls)) <= attempts and calls[0] == start
    assert tried == {n: n <= limit for n in calls} and all(1 <= n <= 100 for n in calls)


def test_capacity_bench_trains_each_run_on_cpu(tmp_path):
    """The bench end to end on CPU processes (a tiny GPT): the default runs, and each of the one-rank ones
    trains the largest size allowed, with finite falling losses, and its parameter count is the model's."""
    import argparse
    import json

    from pyzero.bench import __main__ as bench
    from pyzero.bench import capacity
    from pyzero.bench.capacity import GPT, config, gpt_params

    parser = argparse.ArgumentParser()
    capacity.add_arguments(parser)
    default = parser.parse_args([]).runs.split(",")
    assert default == ["torch", "zero2", "zero3", "fsdp2", "zero2-offload", "zero3-offload"]
    out = tmp_path / "cap.json"  # (zero3 and fsdp2 train in the two-rank test below)
    assert bench.main(["capacity", "--device", "cpu", "--n-embd", "32", "--n-head", "2", "--vocab", "64",
                       "--seq", "16", "--steps", "4", "--max-layers", "2", "--attempts", "2",
                       "--runs", "torch,zero2,zero2-offload,zero3-offload", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["run"] for r in rows] == ["torch", "zero2", "zero2-offload", "zero3-offload"]

    class Args:
        vocab, seq, n_head, n_embd = 64, 16, 2, 32

    n = sum(p.numel() for p in GPT(config(Args, 2)).parameters())
    for r in rows:
        assert r["ok"] and r["layers"] == 2 and r["params"] == gpt_params(config(Args, 2)) == n, r
        assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0], r
        assert r["tokens_per_s"] > 0 and [t["layers"] for t in r["tried"]] == [2], r


def test_capacity_zero3_and_fsdp2_on_two_ranks(tmp_path):
    """--nproc 2 (CPU processes): zero3 and fsdp2 train the largest size allowed with finite falling
    losses, counting both ranks' tokens; zero3 and fsdp2 are planned with plain torch's fp32 model states,
    16 bytes a parameter over the ranks (a rank holds 8 fewer per parameter at 2 ranks than at 1)."""
    import json

    from pyzero.bench import __main__ as bench
    from pyzero.bench.capacity import GPTConfig, estimate, gpt_params

    out = tmp_path / "cap.json"
    assert bench.main(["capacity", "--device", "cpu", "--n-embd", "32", "--n-head", "2", "--vocab", "64",
                       "--seq", "16", "--steps", "3", "--max-layers", "2", "--attempts", "1", "--nproc", "2",
                       "--runs", "zero3,fsdp2", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["run"] for r in rows] == ["zero3", "fsdp2"]
    for r in rows:
        assert r["ok"] and r["layers"] == 2, r
        assert all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0], r
        assert r["tokens_per_s"] == pytest.approx(2 * 16 / r["step_s"], rel=1e-9), r
    c = GPTConfig(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=2048)
    n = gpt_params(c)
    for run in ("zero3", "fsdp2"):
        one, two = estimate(run, c, 1)["device"], estimate(run, c, 1, 2)["device"]
        assert one == pytest.approx(estimate("torch", c, 1)["device"], rel=1e-12), run
        assert one - two == pytest.approx(8 * n, rel=1e-12), run


def test_capacity_two_ranks_one_out_of_memory_fails_the_size_without_a_hang(tmp_path, monkeypatch):
    """A rank out of device memory at 2 ranks (raised in its forward at 3 layers, while the other rank
    waits for it in a collective) fails that size at once, named; the search keeps the size below."""
    import json
    import time

    from pyzero.bench import __main__ as bench
    from pyzero.bench import capacity

    real = capacity.GPT.forward

    def forward(self, idx, targets=None):
        import pyzero as pz

        if len(self.blocks) == 3 and pz.get_rank() == 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(self, idx, targets)

    monkeypatch.setattr(capacity.GPT, "forward", forward)  # (the ranks are forked: they see it)
    out = tmp_path / "cap.json"
    t0 = time.monotonic()
    assert bench.main(["capacity", "--device", "cpu", "--n-embd", "32", "--n-head", "2", "--vocab", "64",
                       "--seq", "16", "--steps", "2", "--max-layers", "3", "--attempts", "2", "--nproc", "2",
                       "--runs", "zero3", "--timeout", "120", "--json", str(out)]) == 0
    assert time.monotonic() - t0 < 60
    (row,) = json.loads(out.read_text())["results"]
    assert row["ok"] and row["layers"] == 2, row
    failed = [t for t in row["tried"] if t["layers"] == 3]
    assert failed and not failed[0]["ok"] and failed[0]["why"] == "device out of memory (rank 1)", row["tried"]


def test_capacity_one_rank_runs_refuse_nproc(capsys):
    from pyzero.bench import __main__ as bench

    with pytest.raises(SystemExit) as info:
        bench.main(["capacity", "--device", "cpu", "--runs", "torch,zero3", "--nproc", "2"])
    assert info.value.code == 2  # a usage error, before any try
    assert "--runs torch: trains on one rank; with --nproc 2" in capsys.readouterr().err


def test_capacity_runs_with_compact_moments(tmp_path):
    """zero2-offload-int8m and zero3-offload-int8m train (CPU processes, a tiny GPT) with int8 moments,
    and the search plans each run with the host bytes docs/offload.md gives per parameter at one rank
    and bf16 gradients: master 4 + moments (8 / 4 / 2.03) + gradient 2 + bf16 copy 2."""
    import json

    from pyzero.bench import __main__ as bench
    from pyzero.bench.capacity import GPTConfig, estimate, gpt_params

    out = tmp_path / "cap.json"
    assert bench.main(["capacity", "--device", "cpu", "--n-embd", "32", "--n-head", "2", "--vocab", "64",
                       "--seq", "16", "--steps", "3", "--max-layers", "1", "--attempts", "1",
                       "--runs", "zero2-offload-int8m,zero3-offload-int8m", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["run"] for r in rows] == ["zero2-offload-int8m", "zero3-offload-int8m"]
    for r in rows:
        assert r["ok"] and all(math.isfinite(v) for v in r["losses"]) and r["losses"][-1] < r["losses"][0], r
    c = GPTConfig(vocab_size=50304, block_size=1024, n_layer=96, n_head=16, n_embd=2048)
    n = gpt_params(c)
    for run, per_param in (("zero2-offload", 16), ("zero2-offload-bf16m", 12), ("zero2-offload-int8m", 10.03125),
                           ("zero3-offload-int8m", 10.03125)):
        assert estimate(run, c, 1)["host"] == pytest.approx(per_param * n, rel=1e-12), run


def test_capacity_reads_the_gpu_from_nvidia_smi(tmp_path, monkeypatch):
    """The bench plans with nvidia-smi's GPU 0 (no CUDA context in the parent process)."""
    from pyzero.bench.capacity import _gpu0

    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho \"$@\" > \"$(dirname \"$0\")/args\"\necho 'NVIDIA H100 80GB HBM3, 81559'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,1")
    assert _gpu0() == ("NVIDIA H100 80GB HBM3", 81559 * 2**20)
    assert (tmp_path / "args").read_text().split()[-2:] == ["-i", "3"]


def _chunk_order_rank():
    pz.init()
    zero_optimizer._host_copies = lambda device: True
    chunk = zero_optimizer._STEP_CHUNK_ELEMS
    zero_optimizer._STEP_CHUNK_ELEMS = 100
    try:
        torch.manual_seed(0)
        model = Net()
        opt = pz.ZeroOptimizer(model, pz.optim.AdamW, stage=2, lr=1e-2, offload="cpu", param_dtype=torch.bfloat16,
                               offload_pipeline=False)
        log = []
        inner_step, copy = opt.inner.step, opt._to_device.copy

        def step(*a, **k):
            log.append(("step", sorted(i for i, (_, leaf, _) in enumerate(opt.pieces) if leaf.grad is not None)))
            return inner_step(*a, **k)

        def copy_(dst, src):
            log.append(("copy", dst.numel()))
            return copy(dst, src)

        opt.inner.step, opt._to_device.copy = step, copy_
        model(torch.randn(4, 16, dtype=torch.bfloat16)).float().square().sum().backward()
        opt.step()
        return log, [pc.numel for pc, _, _ in opt.pieces], opt.layout.shard_size
    finally:
        zero_optimizer._STEP_CHUNK_ELEMS = chunk
        zero_optimizer._host_copies = lambda device: device.type == "cuda"


def test_chunked_host_step_sends_each_chunk_before_the_next_steps():
    """Offload stages 1-2 (see [Note: chunked host step]): the inner step runs chunk by chunk,
    each seeing only its own pieces' gradients, and each chunk's copy to the device is started
    before the next chunk steps; the copies cover every piece once."""
    from pyzero.launch import run_ranks

    log, numels, shard = run_ranks(_chunk_order_rank, 1, timeout=60)[0].value
    kinds = [k for k, _ in log]
    assert len(kinds) >= 4 and kinds == ["step", "copy"] * (len(kinds) // 2), kinds
    steps = [v for k, v in log if k == "step"]
    assert sorted(i for s in steps for i in s) == list(range(len(numels)))  # each piece in one chunk
    assert all(s == list(range(s[0], s[-1] + 1)) for s in steps)  # consecutive pieces
    assert [n for k, n in log if k == "copy"] == [sum(numels[i] for i in s) for s in steps]
    assert sum(numels) <= shard


def _clip_twice_rank(host, pipeline):
    pz.init()
    zero_optimizer._host_copies = (lambda device: True) if host else (lambda device: device.type == "cuda")
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    kw = dict(offload="cpu", offload_pipeline=pipeline) if host else {}
    opt = pz.ZeroOptimizer(model, torch.optim.SGD, stage=2, lr=0.1, momentum=0.9, **kw)
    norms = []
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 8, generator=g), torch.randn(8, 3, generator=g)
        lo = pz.get_rank() * 4
        torch.nn.functional.mse_loss(model(x[lo:lo + 4]), y[lo:lo + 4]).mul(10).backward()
        norms.append([float(opt.clip_grad_norm_(0.1)), float(opt.clip_grad_norm_(0.1))])
        opt.step()
    return norms, opt.full_state_dict()


@pytest.mark.parametrize("pipeline", [False, "step"])
def test_zero_offload_clipping_twice_clips_once_as_torch(pipeline):
    """A second clip_grad_norm_ before step() sees the clipped gradients, as torch's does: it returns
    their norm (max_norm) and changes nothing more. The host path of offload applies the clip in the
    step; it must not apply the first coefficient twice."""
    from pyzero.launch import run_ranks
    want_norms, want = run_ranks(_clip_twice_rank, 2, args=(False, None), timeout=60)[0].value
    got_norms, got = run_ranks(_clip_twice_rank, 2, args=(True, pipeline), timeout=60)[0].value
    assert all(a > 0.1 and b == pytest.approx(0.1, rel=1e-4) for a, b in want_norms), want_norms
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(want_norms), rtol=1e-5, atol=0)
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
