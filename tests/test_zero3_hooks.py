"""ZeRO stage 3's gather and free hooks on models that stretch them, against one plain-torch process.

Each model trains 3 AdamW steps on 2 ranks (each its half of the batch, the loss a mean: the
average of the ranks' gradients is the full batch's) and must end where one process ends:
- a module whose output is wrapped in a dataclass, and one that hands its output out through a
  list and returns None (no output tensor the hooks can see: the parameters were read freed in
  backward, NaN or a prefetch's half-written values);
- non-reentrant activation checkpointing whose recompute reaches a module's end (an output the
  loss does not use, early stop off): the recompute freed what the running backward had gathered.
Also: an in-place write into a freed parameter (fill_, zero_, nn.init, a 0-dim clamp_) is refused
at the next forward, step or state export instead of being lost, and recomputes that stop early
leave nothing behind.
"""
import dataclasses

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint, set_checkpoint_early_stop

import pyzero as pz
from pyzero.launch import run_ranks

STEPS, WORLD = 3, 2


@dataclasses.dataclass
class Out:
    h: torch.Tensor


class DataclassProj(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, h):
        return Out(h @ self.weight)


class SideProj(nn.Module):
    """Returns None; its result goes out through a list it is given."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(8, 8) * 0.3)

    def forward(self, h, sink):
        sink.append(h @ self.weight)


class Net(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.inp = nn.Linear(6, 8)
        self.proj = DataclassProj() if kind == "dataclass" else SideProj() if kind == "side" else nn.Linear(8, 8)
        self.aux = nn.Linear(8, 8)
        self.blk = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
        self.out = nn.Linear(8, 3)

    def _region(self, h):
        return self.proj(h), self.aux(h)  # the loss uses the first only

    def forward(self, x):
        h = torch.tanh(self.inp(x))
        if self.kind == "dataclass":
            h = self.proj(h).h
        elif self.kind == "side":
            sink = []
            self.proj(h, sink)
            h = sink[0]
        elif self.kind == "ckpt-unused-output":
            h = checkpoint(self._region, h, use_reentrant=False)[0]
        else:  # "ckpt-no-early-stop"
            with set_checkpoint_early_stop(False):
                h = h + checkpoint(self.blk, h, use_reentrant=False)
        return self.out(torch.tanh(h))


def build(kind):
    torch.manual_seed(0)
    return Net(kind)


def batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(12, 6, generator=g), torch.randn(12, 3, generator=g)


def reference(kind):
    model = build(kind)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank_train(kind, prefetch):
    pz.init(backend="shm", timeout=30)
    r = pz.get_rank()
    model = build(kind)
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-2, prefetch=prefetch)
    for s in range(STEPS):
        x, y = batch(s)
        opt.zero_grad()
        F.mse_loss(model(x.chunk(WORLD)[r]), y.chunk(WORLD)[r]).backward()
        opt.step()
    return opt.full_state_dict(), sum(len(v) for v in opt._forward_versions.values())


@pytest.mark.parametrize("kind,prefetch", [("dataclass", 0), ("dataclass", 1), ("side", 1),
                                           ("ckpt-unused-output", 1), ("ckpt-no-early-stop", 0)])
def test_stage3_trains_as_one_process(kind, prefetch):
    want = reference(kind)
    res = run_ranks(_rank_train, WORLD, args=(kind, prefetch), timeout=90)
    got, left = res[0].value
    for k, v in want.items():
        torch.testing.assert_close(got[k], v, rtol=1e-5, atol=1e-6, msg=k)
    assert all(r.value[1] == 0 for r in res)  # no forward left open (early-stopped recomputes included)


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(4, 4)
        self.scale = nn.Parameter(torch.tensor(2.0))  # 0-dim, as CLIP's logit_scale
        self.one = nn.Parameter(torch.tensor([3.0]))

    def forward(self, x):
        return self.lin(x) * self.scale + self.one


WRITES = {"fill_": lambda m: m.lin.weight.fill_(0.0), "zero_": lambda m: m.lin.bias.zero_(),
          "nn.init.constant_": lambda m: nn.init.constant_(m.lin.weight, 0.5),
          "0-dim clamp_": lambda m: m.scale.clamp_(0.0, 1.0), "1-element fill_": lambda m: m.one.fill_(5.0)}


def _rank_writes(then):
    pz.init(backend="shm", timeout=30)
    out = {}
    for name, write in WRITES.items():
        model = Tiny()
        opt = pz.ZeroOptimizer(model, torch.optim.SGD, stage=3, lr=0.1)
        if then == "step":  # (a step needs gradients: the write comes between backward and step)
            model(torch.ones(1, 4)).sum().backward()
        with torch.no_grad():
            write(model)
        try:
            if then == "forward":
                model(torch.ones(1, 4))
            elif then == "step":
                opt.step()
            else:
                opt.full_state_dict()
            out[name] = "nothing raised"
        except RuntimeError as e:
            out[name] = str(e)
    # the way to write them: inside gathered_parameters, kept by every rank
    model = Tiny()
    opt = pz.ZeroOptimizer(model, torch.optim.SGD, stage=3, lr=0.1)
    with torch.no_grad(), opt.gathered_parameters(modifier_rank=0):
        model.scale.clamp_(0.0, 1.0)
    full = opt.full_state_dict()
    out["gathered"] = None if full is None else full["scale"].item()
    return out


@pytest.mark.parametrize("then", ["forward", "step", "full_state_dict"])
def test_a_write_into_a_freed_parameter_is_refused_not_lost(then):
    """A freed parameter's placeholder takes fill_/zero_/nn.init and any write to a 0-dim or 1-element
    one (torch's overlap check lets them through); the value read back was the written one while the
    shards kept the old: refused at the next forward, step or state export, naming the parameter."""
    for r in run_ranks(_rank_writes, WORLD, args=(then,), timeout=60):
        out = r.value
        for name in WRITES:
            assert "written in place while freed" in out[name] and "gathered_parameters" in out[name], (name, out)
        assert "'lin.weight'" in out["fill_"] and "'scale'" in out["0-dim clamp_"]
        if r.rank == 0:
            assert out["gathered"] == 1.0
