"""Train a small regression MLP with lightning.Trainer on pyzero's ZeRO (pyzero.integrations.lightning).

    python examples/lightning_train.py --nproc 2                          # local ranks (run_ranks)
    python examples/lightning_train.py --nproc 2 --strategy zero3 --accum 2 --bf16
    python examples/lightning_train.py --nproc 2 --resume                 # from --out/last.ckpt
    torchrun --nproc-per-node 2 examples/lightning_train.py --strategy zero1
    python examples/lightning_train.py --devices 2                        # Lightning starts the ranks

The data is made here: y = sin(x @ w) for random x and a fixed w, so the loss falls within a few
hundred steps; nothing is downloaded. The Trainer clips at gradient_clip_val=1.0 (the norm over
every rank's shard; the module logs it as grad_norm), and writes --out/last.ckpt at the end: a
folder with the sharded state (pyzero/) and Lightning's checkpoint.pt (with "dp": Lightning's own
file), which rank 0 loads back with load_from_checkpoint to evaluate the consolidated weights.
"""
from __future__ import annotations

import argparse
import os
import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

import pyzero as pz
from pyzero.integrations.lightning import LIGHTNING_FILE, STRATEGIES, PyzeroStrategy

DIM = 16


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=0, help="spawn this many local ranks (0: run as this rank)")
    ap.add_argument("--devices", type=int, default=0, help="without --nproc or torchrun: Lightning starts "
                    "this many processes itself")
    ap.add_argument("--strategy", default="zero2", choices=STRATEGIES)
    ap.add_argument("--out", default="/tmp/pyzero_lightning")
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--batch", type=int, default=32, help="samples per rank and micro-step")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-steps")
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (precision='bf16-mixed')")
    ap.add_argument("--resume", action="store_true", help="continue from --out/last.ckpt")
    ap.add_argument("--no-print", action="store_true", help=argparse.SUPPRESS)  # (--nproc's ranks: the parent prints)
    return ap.parse_args(argv)


class Regressor(L.LightningModule):
    def __init__(self, lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                       torch.nn.GELU(), torch.nn.Linear(64, 1))

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def on_before_optimizer_step(self, optimizer):
        # the global norm (all shards), before clipping; Lightning's grad_norm() would see no ZeRO gradients
        self.log("grad_norm", self.trainer.strategy.grad_norm())

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=self.trainer.estimated_stepping_batches)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


def data(n: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(0)) / DIM ** 0.5
    x = torch.randn(n, DIM, generator=g)
    return TensorDataset(x, torch.sin(x @ w))


def main(argv=None):
    args = parse(argv)
    if args.nproc:
        from pyzero.launch import run_ranks, without_nproc

        rank_argv = without_nproc(sys.argv[1:] if argv is None else argv) + ["--no-print"]
        res = run_ranks(main, args.nproc, args=(rank_argv,), timeout=900)
        print(res[0].value)
        return res[0].value
    L.seed_everything(0, verbose=False)
    # run_ranks or torchrun started the processes, else Lightning starts --devices of them
    devices = int(os.environ["WORLD_SIZE"]) if "RANK" in os.environ else (args.devices or 1)
    trainer = L.Trainer(strategy=PyzeroStrategy(args.strategy), accelerator="cpu", devices=devices,
                        max_epochs=args.epochs, gradient_clip_val=1.0, accumulate_grad_batches=args.accum,
                        precision="bf16-mixed" if args.bf16 else "32-true", logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        log_every_n_steps=10)
    model = Regressor(args.lr)
    last = os.path.join(args.out, "last.ckpt")
    if args.resume and not os.path.exists(last):
        raise SystemExit(f"--resume: {last!r} does not exist (--out holds no checkpoint to continue from)")
    resume = last if args.resume else None
    trainer.fit(model, DataLoader(data(8192, seed=1), batch_size=args.batch), ckpt_path=resume)
    trainer.save_checkpoint(last)  # every rank: its shard in last/pyzero, rank 0 also last/checkpoint.pt
    summary = None
    if trainer.is_global_zero:
        # (ZeRO: a folder; "dp": Lightning's own file)
        reloaded = Regressor.load_from_checkpoint(os.path.join(last, LIGHTNING_FILE) if os.path.isdir(last)
                                                  else last).eval()
        x, y = data(1024, seed=2).tensors
        with torch.no_grad():
            loss = torch.nn.functional.mse_loss(reloaded.net(x), y).item()
        summary = {"strategy": args.strategy, "ranks": pz.get_world_size(), "resumed_from": resume,
                   "train_loss": round(trainer.callback_metrics["loss"].item(), 4),
                   "grad_norm": round(trainer.callback_metrics["grad_norm"].item(), 4),
                   "reloaded_eval_loss": round(loss, 4), "steps": trainer.global_step}
        if not args.no_print:
            print(summary)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
