"""Train with ZeRO, save sharded checkpoints as you go, and resume after a crash.

    python examples/zero_train.py --nproc 2 --ckpt /tmp/zero_ckpt          # spawns local ranks
    torchrun --nproc-per-node 2 examples/zero_train.py --ckpt /tmp/zero_ckpt

Every `--save-every` steps all ranks write their shards with
pz.checkpoint.save (atomic: a crash mid-save leaves the previous checkpoint).
On start, if `--ckpt` holds a checkpoint, training resumes from it, on any
number of ranks and any stage. The data of step k is a function of k alone,
and the learning-rate schedule (a torch LambdaLR) is saved in the same
checkpoint through `app_state`, so a resumed run takes the same steps as one
that never stopped.

`main(argv, on_step=None)` is importable: `on_step(step)` runs after each
completed step (tests use it to kill a rank), and main returns the final full
fp32 state dict on rank 0 (None on the other ranks).
"""
from __future__ import annotations

import argparse
import math
import os

import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz

IN, HIDDEN, OUT = 24, 48, 6


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint directory (resumes from it when it holds one)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--save-every", type=int, default=5)
    ap.add_argument("--keep", type=int, default=3, help="checkpoints to keep")
    ap.add_argument("--stage", type=int, default=2, choices=(1, 2, 3))
    ap.add_argument("--batch", type=int, default=24, help="global batch, split evenly over the ranks")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds before a collective gives up")
    ap.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not started by torchrun")
    args = ap.parse_args(argv)
    for flag in ("steps", "save_every", "keep", "batch", "nproc"):
        if getattr(args, flag) < 1:
            ap.error(f"--{flag.replace('_', '-')}: expected a positive int, got {getattr(args, flag)}")
    return args


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.GELU(), nn.Linear(HIDDEN, HIDDEN), nn.GELU(),
                         nn.Linear(HIDDEN, OUT))


def batch(step: int, size: int):
    """The global batch of step `step` (the same on every rank and after a restart)."""
    g = torch.Generator().manual_seed(step)
    return torch.randn(size, IN, generator=g), torch.randn(size, OUT, generator=g)


def lr_factor(step: int, steps: int) -> float:
    """The learning rate of step `step` over the peak: linear warm-up over 3 steps, then cosine decay to 10%."""
    if step < 3:
        return (step + 1) / 3
    t = (step - 3) / max(1, steps - 3)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * t))


def main(argv=None, on_step=None):
    args = parse(argv)
    pz.init(backend="shm", timeout=args.timeout)  # CPU ranks (on GPUs: pz.init() and the model .cuda())
    rank, world = pz.get_rank(), pz.get_world_size()
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} must divide evenly over {world} ranks")
    model = make_model()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=args.stage, lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, args.steps))
    start = 0
    if os.path.exists(os.path.join(args.ckpt, "latest")):  # (load raises FileNotFoundError on an empty directory)
        start = pz.checkpoint.load(args.ckpt, model, opt, app_state={"scheduler": sched})
        if rank == 0:
            print(f"resumed from step {start} of {args.ckpt} on {world} ranks", flush=True)
    per = args.batch // world
    for step in range(start, args.steps):  # `step` steps are done; this one makes step + 1
        x, y = batch(step, args.batch)
        loss = F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        opt.zero_grad()
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        done = step + 1
        if done % args.save_every == 0 or done == args.steps:
            pz.checkpoint.save(args.ckpt, model, opt, done, keep=args.keep, app_state={"scheduler": sched})
        if rank == 0:
            print(f"step {done}: loss of rank 0 {loss.item():.5f}", flush=True)
        if on_step is not None:
            on_step(done)
    if args.stage == 3:
        return opt.full_state_dict()
    return {k: v.detach().clone() for k, v in model.state_dict().items()} if rank == 0 else None


if __name__ == "__main__":
    if "RANK" in os.environ:
        main()
        pz.destroy()
    else:
        from pyzero.launch import run_ranks

        nproc = parse().nproc
        results = run_ranks(main, nproc, timeout=600)
        print(results[0].output, end="")
