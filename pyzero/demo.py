"""The main job in small: ZeRO training on CPU ranks, checked against one process.

``python -m pyzero.demo --nproc 2`` trains a small MLP for a few AdamW steps
(with gradient clipping) under each ZeRO stage on N forked ranks, each rank
on its slice of the batch, and compares the final weights with a plain
single-process torch run on the full batch.
"""
from __future__ import annotations

import argparse
import time

import torch
from torch import nn


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 128), nn.GELU(), nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 8))


def batches(steps: int, batch: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(batch, 32, generator=g), torch.randn(batch, 8, generator=g)) for _ in range(steps)]


def reference(steps: int, batch: int, dtype=torch.float32) -> dict:
    model = make_model().to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for x, y in batches(steps, batch):
        opt.zero_grad()
        nn.functional.mse_loss(model(x.to(dtype)), y.to(dtype)).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def rank_main(stage: int, steps: int, batch: int):
    import pyzero as pz  # noqa: PLC0415

    pz.init(backend="shm")  # (CPU processes, also on a machine with GPUs)
    rank, world = pz.get_rank(), pz.get_world_size()
    model = make_model()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=3e-3)
    per = batch // world
    losses, t0 = [], time.perf_counter()
    for x, y in batches(steps, batch):
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])
        loss.backward()
        opt.clip_grad_norm_(1.0)
        opt.step()
        t = loss.detach().reshape(1)
        pz.all_reduce(t, op="avg")
        losses.append(float(t))
    elapsed = time.perf_counter() - t0
    full = opt.full_state_dict()
    return {"losses": losses, "state": full, "seconds": elapsed}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyzero.demo", description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    if args.batch % args.nproc:
        raise SystemExit(f"--batch {args.batch} must divide evenly over --nproc {args.nproc}")
    from .launch import run_ranks  # noqa: PLC0415

    ref = reference(args.steps, args.batch)
    # fp32 sums in another order differ by rounding: allow a few times torch's own fp32 error (vs fp64).
    exact = reference(args.steps, args.batch, torch.float64)
    torch_err = max(float((ref[k].double() - exact[k]).abs().max()) for k in ref)
    tol = max(1e-6, 4 * torch_err)
    worst = 0.0
    for stage in (1, 2, 3):
        res = run_ranks(rank_main, args.nproc, args=(stage, args.steps, args.batch), timeout=120)[0].value
        err = max(float((res["state"][k] - ref[k]).abs().max()) for k in ref)
        worst = max(worst, err)
        print(f"ZeRO stage {stage} on {args.nproc} ranks: loss {res['losses'][0]:.4f} -> {res['losses'][-1]:.4f} "
              f"in {args.steps} steps ({res['seconds'] * 1e3:.0f} ms); max |weight - single-process torch| = {err:.2e}")
    ok = worst <= tol
    print(f"weights match the single-process run (tolerance {tol:.1e}: 4x torch's own fp32 error)" if ok
          else f"MISMATCH against the single-process run (tolerance {tol:.1e})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
