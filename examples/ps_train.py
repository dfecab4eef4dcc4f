"""Parameter-server training: 2 servers hold the model sharded, workers come and go.

    python examples/ps_train.py --nproc 5 --mode bounded --staleness 2 --ckpt /tmp/ps_ckpt   # local ranks
    torchrun --nproc-per-node 5 examples/ps_train.py --mode async --ckpt /tmp/ps_ckpt

Ranks 0..S-1 are servers (--servers), the others workers. The servers stop after --versions
updates (sync: rounds); each worker trains until then. Kill a worker (kill -9) at any time: the
job goes on without it. Start another worker later against the same MASTER_ADDR/MASTER_PORT
(RANK >= S): it pulls the current parameters and contributes. Kill a server: the workers stop
with pz.ps.ServerLost; run the same command again and the servers resume from --ckpt.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 1))


def batch(step, worker, n=32):
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(n, 16, generator=g)
    return x, x[:, :8].sum(1, keepdim=True).sin()


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=0, help="spawn this many local ranks (0: run as this rank)")
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--mode", default="sync", choices=pz.ps.MODES)
    ap.add_argument("--staleness", type=int, default=None,
                    help="how many pushes a worker may run ahead (--mode bounded only; default 2 there)")
    ap.add_argument("--versions", type=int, default=300)
    ap.add_argument("--ckpt", default=None)
    args = ap.parse_args(argv)
    if args.nproc:
        from pyzero.launch import run_ranks, without_nproc

        res = run_ranks(main, args.nproc, args=(without_nproc(sys.argv[1:] if argv is None else argv),),
                        timeout=600)
        for r in res:
            print(f"rank {r.rank}: {r.value}")
        return None
    if args.staleness is None:
        args.staleness = 2 if args.mode == "bounded" else 0
    role, index = pz.ps.role(args.servers)
    model = make_model()
    if role == "server":
        return pz.ps.serve(model, torch.optim.AdamW, args.servers, mode=args.mode, staleness=args.staleness,
                           max_versions=args.versions, checkpoint_dir=args.ckpt, checkpoint_every=50,
                           wait_for_workers=int(os.environ.get("WORLD_SIZE", args.servers + 1)) - args.servers,
                           idle_timeout=60, lr=1e-3)
    w = pz.ps.Worker(model, num_servers=args.servers)
    step, loss = 0, None
    while w.pull():
        x, y = batch(w.versions[0] + step, index)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        w.push()
        step += 1
    w.close()
    return {"worker": w.wid, "steps": step, "last_loss": None if loss is None else round(float(loss), 4)}


if __name__ == "__main__":
    main()
