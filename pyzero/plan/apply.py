"""pz.parallelize: apply a plan's layout to a GPT-style model.

    pm = pz.parallelize(model, plan, torch.optim.AdamW, lr=3e-4)   # every rank, after pz.init
    x, y = pm.local_batch(inputs), pm.local_batch(targets)          # this replica's part of the batch
    loss = pm.train_step(x, y)        # forward + backward (+ pipeline, tied and DP gradient sync)
    pm.optimizer.step(); pm.optimizer.zero_grad()

Ranks are laid out tp fastest, then dp, then pp (as the cost model assumes):
rank = (pp_i * dp + dp_i) * tp + tp_i. On its stage a rank holds:

* TP: each block's attention and MLP as Megatron pairs built with
  ``ColumnParallelLinear/RowParallelLinear.from_linear`` (qkv, fc column;
  proj, fc_proj row). The bench GPT lays qkv out as [q | k | v] over the whole
  width, so its rows are first regrouped per rank as [q_r | k_r | v_r], which
  gives each rank whole heads. Activations inside run as (seq, batch, hidden).
* SP: outside the TP regions each rank keeps seq/tp tokens; the LayerNorms
  then sum their weight gradients over the TP group (copy_to_tp), the
  embedding output is split and the final hidden states gathered before the
  replicated final LayerNorm and head.
* PP: [embedding, blocks..., final LayerNorm + head] cut with
  ``pz.pipeline.split_sequential`` into stages of equal block counts, run by
  ``pz.pipeline.Pipeline`` (1F1B). The tied embedding lives on the first and
  the last stage and their gradients are summed, as Megatron does.
* Recomputation: "full" checkpoints each block (torch.utils.checkpoint,
  non-reentrant), "selective" only its attention core.
* Micro-batches without a pipeline: gradient accumulation, one forward and
  backward per micro-batch (DataParallel under no_sync until the last).
* DP: ``pz.DataParallel`` (stage 0, no pipeline), ``pz.ZeroOptimizer`` over the
  DP group with ``tp_group`` and ``pp_group`` (stages 1-3; its clipping norm counts
  the tied embedding once, on the first stage), or for stage 0 with a pipeline one
  all-reduce of the gradients after the pipeline flush.

The embedding and head stay replicated over TP (not vocab-parallel); the
planner's ``ModelSpec.embedding_tp=False`` describes exactly that.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from .. import comm
from .. import tp as ptp
from ..parallel import DataParallel
from ..pipeline import Pipeline, split_sequential
from ..zero import ZeroOptimizer
from .cost import Layout


class _Embed(nn.Module):
    """idx (b, s) -> (s, b, h), or this TP rank's (s/tp, b, h) slice with SP."""

    def __init__(self, wte, wpe, sp_group):
        super().__init__()
        self.wte, self.wpe, self.sp_group = wte, wpe, sp_group

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))  # (b, s, h)
        x = x.transpose(0, 1).contiguous()  # (s, b, h)
        return x if self.sp_group is None else ptp.scatter_to_sp(x, self.sp_group)


class _Head(nn.Module):
    """(s, b, h) -> logits (b, s, V), with the embedding's weight (tied) or a copy of it."""

    def __init__(self, ln_f, weight, sp_group):
        super().__init__()
        self.ln_f, self.sp_group = ln_f, sp_group
        self.weight = weight

    def forward(self, x):
        if self.sp_group is not None:
            x = ptp.gather_from_sp(x, self.sp_group, reduce_grad=False)  # head is replicated: split the grad
        return F.linear(self.ln_f(x).transpose(0, 1), self.weight)  # (b, s, V)


class _Block(nn.Module):
    """A bench GPT block on (s, b, h) activations; with a TP group, this rank's heads and MLP units.
    ``recompute``: "full" keeps only the block's input for backward, "selective" recomputes the
    attention core (scores, softmax, their product with v), the part Korthikanti et al. drop."""

    def __init__(self, block, group, sp: bool, recompute: str = "none"):
        super().__init__()
        self.ln1, self.ln2 = block.ln1, block.ln2
        self.group, self.sp, self.recompute = group, sp, recompute
        n = 1 if group is None else group.size
        h = block.qkv.in_features
        if block.n_head % n:
            raise ValueError(f"plan: heads={block.n_head} is not divisible by tp={n}")
        self.heads, self.width = block.n_head // n, h // n
        if group is None:
            self.qkv, self.proj, self.fc, self.fc_proj = block.qkv, block.proj, block.fc, block.fc_proj
            return
        qkv = nn.Linear(h, 3 * h, bias=block.qkv.bias is not None)
        k = h // n  # regroup rows [q | k | v] -> per rank [q_r | k_r | v_r]
        order = torch.cat([torch.arange(j * h + r * k, j * h + (r + 1) * k) for r in range(n) for j in range(3)])
        with torch.no_grad():
            qkv.weight.copy_(block.qkv.weight[order])
            if qkv.bias is not None:
                qkv.bias.copy_(block.qkv.bias[order])
                qkv.bias.requires_grad_(block.qkv.bias.requires_grad)
            qkv.weight.requires_grad_(block.qkv.weight.requires_grad)  # frozen stays frozen
        opts = dict(group=group, sequence_parallel=sp)
        self.qkv = ptp.ColumnParallelLinear.from_linear(qkv, **opts)
        self.proj = ptp.RowParallelLinear.from_linear(block.proj, **opts)
        self.fc = ptp.ColumnParallelLinear.from_linear(block.fc, **opts)
        self.fc_proj = ptp.RowParallelLinear.from_linear(block.fc_proj, **opts)

    def _norm(self, ln, x):
        if not self.sp:
            return ln(x)
        # Each rank normalises only its tokens: copy_to_tp sums the weight gradients over the group.
        return F.layer_norm(x, ln.normalized_shape, ptp.copy_to_tp(ln.weight, self.group),
                            ptp.copy_to_tp(ln.bias, self.group), ln.eps)

    @staticmethod
    def _attention(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def _forward(self, x):
        q, k, v = self.qkv(self._norm(self.ln1, x)).split(self.width, dim=-1)  # each (s, b, h/tp)
        s, b = q.shape[0], q.shape[1]
        q, k, v = (t.view(s, b, self.heads, -1).permute(1, 2, 0, 3) for t in (q, k, v))  # (b, heads, s, d)
        if self.recompute == "selective" and torch.is_grad_enabled():
            y = checkpoint(self._attention, q, k, v, use_reentrant=False)
        else:
            y = self._attention(q, k, v)
        x = x + self.proj(y.permute(2, 0, 1, 3).reshape(s, b, self.width))
        return x + self.fc_proj(F.gelu(self.fc(self._norm(self.ln2, x))))

    def forward(self, x):
        if self.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


def _layout(plan) -> Layout:
    lay = getattr(plan, "layout", plan)
    if not isinstance(lay, Layout):
        raise TypeError(f"plan: expected a pz.plan(...) result, an Estimate or a Layout, got {type(plan).__name__}")
    return lay


def _groups(lay: Layout):
    """Every group of the grid, created in the same order on every rank; returns this rank's."""
    d, t, p = lay.dp, lay.tp, lay.pp
    rank = comm.get_rank()
    mine = {}

    def make(kind, ranks):
        if len(ranks) > 1:
            g = comm.new_group(ranks)
            if rank in ranks:
                mine[kind] = g

    def at(pi, di, ti):
        return (pi * d + di) * t + ti

    for pi in range(p):
        for di in range(d):
            make("tp", [at(pi, di, ti) for ti in range(t)])
    for pi in range(p):
        for ti in range(t):
            make("dp", [at(pi, di, ti) for di in range(d)])
    for di in range(d):
        for ti in range(t):
            make("pp", [at(pi, di, ti) for pi in range(p)])
            if p > 1:
                make("tie", [at(0, di, ti), at(p - 1, di, ti)])
    pi, di, ti = rank // (d * t), rank // t % d, rank % t
    return mine, (pi, di, ti)


class ParallelGPT(nn.Module):
    """This rank's part of a GPT under a layout; see the module docstring."""

    def __init__(self, model, lay: Layout, optimizer_class, optimizer_kwargs, schedule: str = "1f1b"):
        super().__init__()
        world = comm.get_world_size()
        if lay.dp * lay.tp * lay.pp != world:
            raise ValueError(f"plan: dp*tp*pp = {lay.dp * lay.tp * lay.pp} ({lay}) must equal the world size {world}")
        if lay.pp > 1 and lay.stage >= 2:
            raise ValueError(f"plan: ZeRO stage {lay.stage} with pp={lay.pp}; expected stage 0 or 1 with pipelining")
        if lay.stage > 0 and lay.dp == 1:
            raise ValueError(f"plan: ZeRO stage {lay.stage} needs dp > 1, got dp=1")
        if lay.offload != "none":
            raise ValueError(f"plan: offload={lay.offload!r} is planned but not applied by parallelize (ZeroOptimizer "
                             "has no offload yet); expected 'none'")
        if lay.recompute not in ("none", "selective", "full"):
            raise ValueError(f"plan: recompute={lay.recompute!r}; expected 'none', 'selective' or 'full'")
        self.layout = lay
        groups, (self.pp_index, self.dp_index, self.tp_index) = _groups(lay)
        self.tp_group, self.dp_group = groups.get("tp"), groups.get("dp")
        self.pp_group, self._tie_group = groups.get("pp"), groups.get("tie")
        sp_group = self.tp_group if lay.sp else None
        L = len(model.blocks)
        if lay.pp > L:
            raise ValueError(f"plan: pp={lay.pp} > the model's {L} blocks")
        wte = model.wte
        head_w = wte.weight if lay.pp == 1 else nn.Parameter(wte.weight.detach().clone())
        if lay.pp > 1:
            head_w.pp_shared = True  # ZeroOptimizer's clipping norm counts the first stage's embedding, not this copy
        seq = nn.Sequential(_Embed(wte, model.wpe, sp_group), *model.blocks, _Head(model.ln_f, head_w, sp_group))
        stage = split_sequential(seq, lay.pp, costs=[0] + [1] * L + [0])[self.pp_index] if lay.pp > 1 else seq
        for name, child in list(stage.named_children()):
            if not isinstance(child, (_Embed, _Head)):
                setattr(stage, name, _Block(child, self.tp_group, lay.sp, lay.recompute))
        self.stage = stage
        self._tied = [m.weight for m in stage if isinstance(m, _Head)] + \
                     [m.wte.weight for m in stage if isinstance(m, _Embed)] if lay.pp > 1 else []
        self.pipe = Pipeline(stage, lay.micro_batches, schedule, group=self.pp_group) if lay.pp > 1 else None
        self.ddp = None
        if lay.stage == 0:
            if lay.pp == 1 and self.dp_group is not None:
                self.ddp = DataParallel(stage, group=self.dp_group)
            self.optimizer = optimizer_class(stage.parameters(), **optimizer_kwargs)
        else:
            self.optimizer = ZeroOptimizer(stage, optimizer_class, stage=lay.stage, group=self.dp_group,
                                           tp_group=self.tp_group, pp_group=self.pp_group, **optimizer_kwargs)

    @property
    def is_last(self) -> bool:
        return self.pipe is None or self.pipe.is_last

    def local_batch(self, t: torch.Tensor) -> torch.Tensor:
        """This replica's rows of a global batch (dim 0 split over dp)."""
        n = t.shape[0]
        if n % self.layout.dp:
            raise ValueError(f"batch: {n} rows do not divide by dp={self.layout.dp}")
        k = n // self.layout.dp
        return t[self.dp_index * k:(self.dp_index + 1) * k]

    def forward(self, idx):
        if self.pipe is not None:
            raise RuntimeError("forward: with pipelining, use train_step(idx, targets)")
        return (self.ddp or self.stage)(idx)

    def train_step(self, idx, targets):
        """Forward and backward of this replica's batch; gradients synced as the layout says.
        Returns the loss (on the last pipeline stage; None on the others)."""
        def loss_fn(logits, y):
            return F.cross_entropy(logits.flatten(0, 1), y.flatten())

        # The tied embedding's copies are summed over the first and last stage: only this step's
        # gradients, so that gradients accumulated by earlier steps (already summed) count once.
        held = [w.grad for w in self._tied] if self._tie_group is not None else []
        for w in self._tied[:len(held)]:
            w.grad = None
        try:
            if self.pipe is None:
                loss = self._accumulate(idx, targets, loss_fn)
            else:
                loss = self.pipe.train_step(idx if self.pipe.is_first else None,
                                            targets if self.pipe.is_last else None, loss_fn)
            self._sync_grads()
        finally:
            for w, g in zip(self._tied, held):
                if g is not None:
                    w.grad = g if w.grad is None else w.grad.add_(g)
        return loss

    def _accumulate(self, idx, targets, loss_fn) -> float:
        """Without pipelining: the layout's m micro-batches, one forward and backward each (gradient
        accumulation, each loss scaled by 1/m), so activations are held for one micro-batch at a time
        as planned. DataParallel reduces once, after the last; ZeRO reduces as each backward ends."""
        m = self.layout.micro_batches
        if m == 1:
            loss = loss_fn(self(idx), targets)
            loss.backward()
            return loss.item()
        for arg, t in (("idx", idx), ("targets", targets)):
            if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] % m:
                shape = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"{arg}: this replica's batch (dim 0) must split into the layout's "
                                 f"micro_batches={m} equal parts, got {shape}")
        total = 0.0
        for j, (x, y) in enumerate(zip(idx.chunk(m), targets.chunk(m))):
            last = j == m - 1
            with self.ddp.no_sync() if self.ddp is not None and not last else contextlib.nullcontext():
                loss = loss_fn(self(x), y) / m
                loss.backward()
            total += loss.item()
        return total

    def _sync_grads(self):
        if self._tie_group is not None:  # first and last stage hold the tied embedding: sum their gradients
            for w in self._tied:
                if w.grad is None:  # a stage whose tied copy got no gradient this step still takes part
                    w.grad = torch.zeros_like(w)
                comm.all_reduce(w.grad, op="sum", group=self._tie_group)
        if self.pipe is not None and self.layout.stage == 0 and self.dp_group is not None:
            grads = [p.grad for p in self.stage.parameters() if p.grad is not None]
            flat = torch.cat([g.flatten() for g in grads])
            comm.all_reduce(flat, op="avg", group=self.dp_group)
            off = 0
            for g in grads:
                g.copy_(flat[off:off + g.numel()].view_as(g))
                off += g.numel()


def parallelize(model, plan, optimizer_class=torch.optim.AdamW, schedule: str = "1f1b", **optimizer_kwargs):
    """Apply ``plan`` (a pz.plan result, its ``.best`` or a Layout) to ``model``, pyzero's bench GPT.

    Every rank calls it after pz.init, with the same model (same seed). Returns a
    ParallelGPT whose ``train_step(idx, targets)`` runs forward and backward and
    whose ``optimizer`` steps this rank's parameters.
    """
    lay = _layout(plan)
    for attr in ("wte", "wpe", "blocks", "ln_f", "head"):
        if not hasattr(model, attr):
            raise TypeError(f"model: expected a GPT like pyzero.bench.gpt.GPT (with .{attr}), "
                            f"got {type(model).__name__}")
    if model.head.weight is not model.wte.weight:
        raise ValueError("model: expected the output head tied to the token embedding (as GPT-2)")
    return ParallelGPT(model, lay, optimizer_class, optimizer_kwargs, schedule)
