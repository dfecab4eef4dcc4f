"""Train one GPT block on 4 CPU ranks = 2 data-parallel x 2 tensor-parallel replicas.

    python examples/tp_block.py                     # spawns 4 local ranks
    torchrun --nproc-per-node 4 examples/tp_block.py

Attention heads and MLP units are split over each TP pair (ranks 0-1 and 2-3),
activations outside the TP regions are split along the sequence (sequence
parallelism), and pz.ZeroOptimizer (ZeRO stage 2) runs over each DP pair
(ranks 0-2, 1-3): it averages the gradients over the pair, each rank keeps
half the AdamW state of its TP shard, and gradient clipping counts the TP
shards once (tp_group=). At the end the TP shards are checked against the
same block trained in one process on the whole batch, with the same clipping.
"""
import os
import sys

import torch
import torch.nn.functional as F

import pyzero as pz

SEQ, BATCH, HIDDEN, HEADS, STEPS, CLIP = 16, 4, 32, 4, 5, 0.2


def data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(SEQ, BATCH, HIDDEN, generator=g)


def make_block():
    torch.manual_seed(0)  # every rank builds the same full block, then keeps its shard
    return pz.tp.TransformerBlock(HIDDEN, HEADS)


def train_tp():
    pz.init(backend="shm")  # CPU ranks (on GPUs: pz.init(), model and data .cuda())
    dp_group, tp_group = pz.mesh(dp=2, tp=2)
    model = pz.tp.ParallelTransformerBlock.from_block(make_block(), group=tp_group, sequence_parallel=True)
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, group=dp_group, tp_group=tp_group, lr=1e-2, eps=1e-4)
    x, t = data()
    per_replica = BATCH // dp_group.size
    cols = slice(dp_group.rank * per_replica, (dp_group.rank + 1) * per_replica)  # this replica's batch
    x, t = x[:, cols], t[:, cols]
    for step in range(STEPS):
        opt.zero_grad()
        y = model(pz.tp.scatter_to_sp(x, group=tp_group))  # (SEQ/2, b, HIDDEN) per TP rank
        y = pz.tp.gather_from_sp(y, group=tp_group, reduce_grad=False)  # the loss is replicated
        loss = F.mse_loss(y, t)
        loss.backward()
        norm = opt.clip_grad_norm_(CLIP)  # the norm of the whole block's gradient, as in one process
        opt.step()
        if pz.get_rank() == 0:
            print(f"step {step}: loss of replica 0 = {loss.item():.5f}, gradient norm {float(norm):.4f}", flush=True)
    return {n: p.detach() for n, p in model.named_parameters()}


def train_single():
    block = make_block()
    opt = torch.optim.AdamW(block.parameters(), lr=1e-2, eps=1e-4)
    x, t = data()
    for _ in range(STEPS):
        opt.zero_grad()
        F.mse_loss(block(x), t).backward()
        torch.nn.utils.clip_grad_norm_(block.parameters(), CLIP)
        opt.step()
    return block


def max_error(params: dict, tp_rank: int, block) -> float:
    """The largest difference between one rank's TP shard (`params`) and the same part of `block`."""
    err = 0.0
    for name, p in block.named_parameters():
        layer = name.split(".")[0]
        dim = 0 if layer in ("qkv", "fc1") else 1 if name in ("proj.weight", "fc2.weight") else None
        expected = p.detach() if dim is None else p.detach().chunk(2, dim=dim)[tp_rank]
        err = max(err, float((params[name] - expected).abs().max()))
    return err


TOLERANCE = 1e-5  # fp32: the same arithmetic in another order


if __name__ == "__main__":
    import argparse

    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()  # (--help; no options)
    if "RANK" in os.environ:  # torchrun: every rank checks its own shard
        shard = train_tp()
        rank = pz.get_rank()
        err = max_error(shard, rank % 2, train_single())
        pz.destroy()
        print(f"rank {rank}: max |TP - single process| over its parameters: {err:.2e}")
    else:
        from pyzero.launch import run_ranks

        results = run_ranks(train_tp, 4, timeout=120)
        print(results[0].output, end="")
        single = train_single()  # (mesh dp=2 x tp=2: TP index rank % 2, every replica checked)
        err = max(max_error(r.value, r.rank % 2, single) for r in results)
        print(f"max |TP - single process| over all parameters: {err:.2e}")
    if not err <= TOLERANCE:
        print(f"FAILED: more than {TOLERANCE:g} apart", file=sys.stderr)
        sys.exit(1)
