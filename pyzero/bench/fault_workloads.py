"""The workloads of the fault matrix (pyzero-bench faults), run by every rank of a try.

Each workload sets itself up on a rank and returns a step function the rank loops over; a step returns the
number of wrong results it saw (every result is compared with a reference the rank computes locally).
:func:`rank_main` is one rank of one try: it writes pid, ready and done files into the try's directory so
the harness (pyzero.bench.faults) can inject the fault and tell errors from hangs.
"""
from __future__ import annotations

import faulthandler
import json
import os
import random
import signal
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz

from .common import comm_device
from .hier import enter_host

VICTIM = 1


class Detected(Exception):
    """A workload found the fault it was given and reacted as it should (the cell's expected outcome)."""


# ---------------------------------------------------------------------------
# Workloads: setup(ctx) -> step() run in a loop; step returns the number of wrong results it saw.


@dataclass
class Ctx:
    rank: int
    world: int
    tmp: str
    rng: random.Random
    timeout: float
    device: torch.device = torch.device("cpu")  # where the collective workloads' tensors live
    out: dict = field(default_factory=dict)


def mlp(seed=0, width=64, depth=4):
    torch.manual_seed(seed)
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(width, 4))


def batch(step, n=16, width=64):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(n, width, generator=g), torch.randn(n, 4, generator=g)


def _settled(ctx, verdict: torch.Tensor) -> bool:
    """`verdict` (a bool tensor computed from a collective's result) read on the host. On a GPU backend
    a call returns before the GPU ran it, and the output of a call the watchdog aborted is undefined
    (as NCCL's after ncclCommAbort): the error comes from the next call, wait(), synchronize() or
    barrier. So a GPU rank reads its verdict after a barrier, the point from which pyzero promises a
    result is right or an error was raised: a wrong value there is a wrong result no error covered."""
    if ctx.device.type != "cpu":
        pz.barrier()
    return bool(verdict)


def _w_allreduce(ctx):
    t = torch.empty(4 << 20, device=ctx.device)
    k = [0]

    def step():
        k[0] += 1
        t.fill_(ctx.rank + k[0])
        pz.all_reduce(t)
        want = sum(r + k[0] for r in range(ctx.world))
        return int(not _settled(ctx, (t == want).all()))
    return step


def shard(x, ctx):
    per = x.shape[0] // ctx.world
    return x[ctx.rank * per:(ctx.rank + 1) * per]


def _w_dp(ctx):
    model = mlp(width=256)
    ref = mlp(width=256)
    dp = pz.DataParallel(model, bucket_mb=0.1, first_bucket_mb=0.05)
    k = [0]

    def step():
        k[0] += 1
        x, y = batch(k[0], width=256)
        model.zero_grad()
        F.mse_loss(dp(shard(x, ctx)), shard(y, ctx)).backward()
        ref.zero_grad()
        F.mse_loss(ref(x), y).backward()
        return sum(not torch.allclose(a.grad, b.grad, rtol=1e-4, atol=1e-6)
                   for a, b in zip(model.parameters(), ref.parameters()))
    return step


def _w_zero3(ctx):
    model, ref = mlp(width=128), mlp(width=128)
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-3)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    k = [0]

    def step():
        k[0] += 1
        x, y = batch(k[0], width=128)
        opt.zero_grad()
        loss = F.mse_loss(model(shard(x, ctx)), shard(y, ctx))
        loss.backward()
        opt.step()
        ref_opt.zero_grad()
        ref_loss = F.mse_loss(ref(shard(x, ctx)), shard(y, ctx))  # this rank's half, full-batch weights
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        return int(not torch.allclose(loss.detach(), ref_loss.detach(), rtol=1e-3, atol=1e-5))
    return step


def _train_save(ctx, stage=2):
    model = mlp()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-3)
    ckpt = os.path.join(ctx.tmp, "ckpt")
    k = [0]

    def step():
        k[0] += 1
        x, y = batch(k[0])
        opt.zero_grad()
        F.mse_loss(model(shard(x, ctx)), shard(y, ctx)).backward()
        opt.step()
        pz.checkpoint.save(ckpt, model, opt, k[0], keep=2)
        ctx.out["saved"] = k[0]
        return 0
    return step, model, opt


def reference_params(steps: int) -> dict:
    """Single-process torch: the state checkpoint step `steps` of the save workloads must hold."""
    model = mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in range(1, steps + 1):
        x, y = batch(k)
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _w_save(ctx):
    return _train_save(ctx)[0]


def _w_pipeline(ctx):
    full = mlp(width=128, depth=6)
    stages = pz.pipeline.split_sequential(full, num_stages=ctx.world)
    pipe = pz.pipeline.Pipeline(stages[ctx.rank], num_microbatches=4, schedule="1f1b")
    ref = mlp(width=128, depth=6)
    k = [0]

    def step():
        k[0] += 1
        x, y = batch(k[0], width=128)
        full.zero_grad()
        loss = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss)
        if not pipe.is_last:
            return 0
        with torch.no_grad():
            want = F.mse_loss(ref(x), y).item()
        return int(abs(loss - want) > 1e-5 * max(1.0, abs(want)))
    return step


def _w_tp(ctx):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(64 * ctx.world, 256, generator=g)
    w = torch.randn(512, 256, generator=g)
    want = x @ w.T

    def step():
        y = pz.tp.all_gather_matmul(shard(x, ctx), w)
        return int(not torch.allclose(y, want, rtol=1e-4, atol=1e-3))
    return step


def _ones(n, d, dtype=torch.float32):
    return torch.ones(n, device=d, dtype=dtype)


MISMATCH = {  # (rank 0's call, rank 1's call), given the device
    "mismatch-size": (lambda d: pz.all_reduce(_ones(1000, d)), lambda d: pz.all_reduce(_ones(1001, d))),
    "mismatch-op": (lambda d: pz.all_reduce(_ones(1000, d)), lambda d: pz.all_reduce(_ones(1000, d), op="max")),
    "mismatch-dtype": (lambda d: pz.all_reduce(_ones(1000, d)),
                       lambda d: pz.all_reduce(_ones(1000, d, torch.float64))),
    "mismatch-kind": (lambda d: pz.all_reduce(_ones(1000, d)), lambda d: pz.broadcast(_ones(1000, d), src=0)),
    "mismatch-algo": (lambda d: pz.all_reduce(_ones(1000, d), algo="ring"),
                      lambda d: pz.all_reduce(_ones(1000, d), algo="oneshot")),
}


def _w_mismatch(ctx, name):
    calls = [0]

    def step():
        calls[0] += 1
        t = torch.full((64,), float(ctx.rank), device=ctx.device)
        pz.all_reduce(t)  # a few good calls first: the mismatch is not the first call of the group
        if not _settled(ctx, (t == sum(range(ctx.world))).all()):
            return 1
        if calls[0] >= 1 + ctx.rng.randrange(3):
            ctx.out["t_fault"] = time.time()
            MISMATCH[name][min(ctx.rank, 1)](ctx.device)
            if ctx.device.type == "cuda":  # a GPU backend may report the mismatch at the next host wait
                torch.cuda.synchronize(ctx.device)
                pz.barrier()
            return 0
        return 0
    return step


def _w_never_calls(ctx):
    t = torch.ones(8, device=ctx.device)

    def step():
        pz.all_reduce(t)
        if ctx.rank == VICTIM:
            time.sleep(ctx.timeout + 3)
            raise SystemExit(0)
        ctx.out["t_fault"] = time.time()
        t.fill_(1)
        pz.all_reduce(t)
        return int(not _settled(ctx, (t == ctx.world).all()))
    return step


def _w_save_enospc(ctx):
    import errno  # noqa: PLC0415

    step, _, _ = _train_save(ctx)
    fail_at = 2 + ctx.rng.randrange(3)
    real = pz.checkpoint._save_file  # the writer every save goes through
    if ctx.rank == VICTIM:
        def failing(obj, path):
            if f"step_{fail_at:08d}" in path:
                with open(path, "wb") as f:
                    f.write(b"x" * 1000)
                ctx.out["t_fault"] = time.time()
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
            real(obj, path)
        pz.checkpoint._save_file = failing
    ctx.out["fail_at"] = fail_at
    return step


def _w_load_damaged(ctx, how):
    train, model, opt = _train_save(ctx)
    for _ in range(2):
        train()
    saved = {n: p.detach().clone() for n, p in model.named_parameters()} if opt.stage < 3 else None
    pz.barrier()
    if ctx.rank == 0:
        step_dir = os.path.join(ctx.tmp, "ckpt", "step_00000002")
        victim = os.path.join(step_dir, f"rank{ctx.rng.randrange(ctx.world):05d}.pt")
        size = os.path.getsize(victim)
        with open(victim, "r+b") as f:
            if how == "corrupt":
                f.seek(ctx.rng.randrange(size))
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ (1 << ctx.rng.randrange(8))]))
            else:
                f.truncate(ctx.rng.randrange(size))
    pz.barrier()

    def step():
        fresh = mlp(seed=1)
        o = pz.ZeroOptimizer(fresh, torch.optim.AdamW, stage=2, lr=1e-3)
        ctx.out["t_fault"] = time.time()
        pz.checkpoint.load(os.path.join(ctx.tmp, "ckpt"), fresh, o)
        # Loaded without an error: it must be exactly what was saved.
        return sum(not torch.equal(p, saved[n]) for n, p in fresh.named_parameters())
    return step


def _w_clip(ctx, value):
    model = mlp()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)
    if ctx.rank == VICTIM:  # before accumulation, so whatever the optimizer's hooks do sees it
        at = ctx.rng.randrange(10)
        next(model.parameters()).register_hook(lambda g: g.flatten().index_fill(0, torch.tensor([at]), value)
                                               .view_as(g))

    def step():
        x, y = batch(ctx.rank)
        opt.zero_grad()
        F.mse_loss(model(shard(x, ctx)), shard(y, ctx)).backward()
        norm = opt.clip_grad_norm_(1.0)
        ctx.out["norm"] = float(norm)
        if bool(torch.isfinite(norm)):  # every rank must see the non-finite norm, or they disagree on skipping
            return 1
        opt.zero_grad()  # pyzero's policy (torch's): clip_grad_norm_ reports it, the caller skips the step
        raise Detected(f"non-finite gradient norm {float(norm)} on every rank; step skipped")
    return step


WORKLOADS = {
    "allreduce": _w_allreduce, "dp": _w_dp, "zero3": _w_zero3, "save": _w_save, "pipeline": _w_pipeline,
    "tp": _w_tp, "never-calls": _w_never_calls, "save-enospc": _w_save_enospc,
    "load-corrupt": lambda ctx: _w_load_damaged(ctx, "corrupt"),
    "load-truncated": lambda ctx: _w_load_damaged(ctx, "truncate"),
    "clip-nan": lambda ctx: _w_clip(ctx, float("nan")), "clip-inf": lambda ctx: _w_clip(ctx, float("inf")),
    **{name: (lambda ctx, name=name: _w_mismatch(ctx, name)) for name in MISMATCH},
}


def touch(path, text=""):
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.replace(path + ".tmp", path)


def rank_main(work: str, tmp: str, seed: int, timeout: float, duration: float, backend: str = "shm") -> dict:
    """One rank of one try: set up, say ready, loop workload `work` until an error or `duration` s.
    With backend "hier" the ranks are split into simulated hosts of two ranks (one rank each at 2
    ranks), so every world collective crosses hosts."""
    if backend == "hier":
        enter_host(2 if int(os.environ["WORLD_SIZE"]) >= 4 else 1)
    pz.init(backend=backend, timeout=timeout)
    rank = pz.get_rank()
    touch(os.path.join(tmp, f"pid{rank}"), str(os.getpid()))
    ctx = Ctx(rank, pz.get_world_size(), tmp, random.Random(seed * 1000 + 1), timeout, comm_device())
    step = WORKLOADS[work](ctx)
    out = ctx.out
    out.update(rank=rank, steps=0, wrong=0, error=None)
    pz.barrier()
    touch(os.path.join(tmp, f"ready{rank}"))
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the harness asks a hung rank where it is
    end = time.monotonic() + duration
    try:
        while time.monotonic() < end:
            out["wrong"] += step()
            out["steps"] += 1
            if work.startswith("load-"):
                break
    except (pz.CollectiveError, pz.checkpoint.CheckpointError, Detected) as e:
        out["t_error"] = time.time()
        out["error"] = (type(e).__name__, str(e)[:3000])
    except Exception as e:  # noqa: BLE001 - an error pyzero should not have raised
        out["t_error"] = time.time()
        out["error"] = ("unexpected " + type(e).__name__, str(e)[:3000])
    touch(os.path.join(tmp, f"done{rank}"), json.dumps({k: v for k, v in out.items()}, default=str))
    if out["error"] is not None:
        os._exit(3)  # the group is broken: leave at once, like a job would
    return out
