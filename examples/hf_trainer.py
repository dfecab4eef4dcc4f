"""Train a tiny GPT-2 with transformers.Trainer on pyzero's ZeRO (pyzero.integrations.hf).

    python examples/hf_trainer.py --nproc 2                               # local ranks (run_ranks)
    python examples/hf_trainer.py --nproc 2 --strategy zero3 --accum 2 --bf16
    python examples/hf_trainer.py --nproc 2 --resume                      # from the newest checkpoint
    torchrun --nproc-per-node 2 examples/hf_trainer.py --strategy zero1

The model is GPT-2 from a small config, the data made here: token sequences that count up
from a random start by a random stride (mod the vocabulary), so the loss falls within a few
dozen steps; nothing is downloaded. The Trainer clips at max_grad_norm=1.0 (the norm over every
rank's shard, which it logs as grad_norm), writes sharded checkpoints every --save-steps, and
save_model() leaves the consolidated weights in --out, which rank 0 loads back with
from_pretrained at the end.
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainingArguments
from transformers.trainer_utils import get_last_checkpoint

import pyzero as pz
from pyzero.integrations import hf

VOCAB, SEQ = 256, 32


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nproc", type=int, default=0, help="spawn this many local ranks (0: run as this rank)")
    ap.add_argument("--strategy", default="zero2", choices=hf.STRATEGIES)
    ap.add_argument("--out", default="/tmp/pyzero_hf_trainer")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch", type=int, default=8, help="sequences per rank and micro-step")
    ap.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-steps")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--save-steps", type=int, default=20)
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast")
    ap.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    return ap.parse_args(argv)


def make_model() -> GPT2LMHeadModel:
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                      bos_token_id=0, eos_token_id=0))


def counting(n: int, seed: int = 0) -> list[dict]:
    """n sequences start + stride * t (mod VOCAB); the labels are the inputs (the model shifts them)."""
    g = torch.Generator().manual_seed(seed)
    start = torch.randint(0, VOCAB, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    ids = (start + stride * torch.arange(SEQ)) % VOCAB
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def main(argv=None):
    args = parse(argv)
    if args.nproc:
        from pyzero.launch import run_ranks, without_nproc

        res = run_ranks(main, args.nproc, args=(without_nproc(sys.argv[1:] if argv is None else argv),),
                        timeout=900)
        print(res[0].value)
        return res[0].value
    hf.init()  # before TrainingArguments: pyzero and torch.distributed share pyzero's store
    targs = TrainingArguments(output_dir=args.out, use_cpu=not torch.cuda.is_available(), max_steps=args.steps,
                              per_device_train_batch_size=args.batch, gradient_accumulation_steps=args.accum,
                              learning_rate=args.lr, warmup_steps=5, max_grad_norm=1.0, bf16=args.bf16,
                              logging_steps=10, save_steps=args.save_steps, report_to=[], disable_tqdm=True)
    trainer = hf.PyzeroTrainer(model=make_model(), args=targs, train_dataset=counting(4096),
                               strategy=args.strategy)
    resume = None
    if args.resume:
        resume = get_last_checkpoint(args.out) if os.path.isdir(args.out) else None
        if resume is None:
            raise SystemExit(f"--resume: no checkpoint-* directory in --out {args.out!r} to continue from")
    result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()  # args.out/pyzero (sharded) and model.safetensors + config.json
    summary = None
    if pz.get_rank() == 0:
        model = GPT2LMHeadModel.from_pretrained(args.out).eval()
        batch = counting(64, seed=1)
        with torch.no_grad():
            loss = model(input_ids=torch.stack([b["input_ids"] for b in batch]),
                         labels=torch.stack([b["labels"] for b in batch])).loss
        summary = {"strategy": args.strategy, "ranks": pz.get_world_size(), "resumed_from": resume,
                   "train_loss": round(result.training_loss, 4), "reloaded_eval_loss": round(loss.item(), 4),
                   "grad_norms": [round(h["grad_norm"], 3) for h in trainer.state.log_history if "grad_norm" in h]}
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return summary


if __name__ == "__main__":
    main()
