"""pyzero.integrations.lightning against Lightning's own DDPStrategy with torch AdamW, on 2 CPU ranks.

Each test is one launch of ranks that trains a tiny MLP (random data) several ways, Lightning's
DDP run first, and returns what the parent compares: the losses and the gradient norms the module
logged (before clipping), and the final weights. Clipping is on (MAX_NORM is far below the
gradient norms, and a run without it ends measurably elsewhere), and an LR schedule runs, so a
norm that misses ZeRO's shards or a schedule left on the wrong optimizer cannot pass.
"""
import ast
import json
import os
import signal
import subprocess
import sys

import pytest
import torch

L = pytest.importorskip("lightning")

from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import pyzero as pz  # noqa: E402
from pyzero.integrations import lightning as pzl  # noqa: E402
from pyzero.launch import run_ranks  # noqa: E402

from compare_runs import TOL, assert_bf16_tracks, assert_same_run, close, max_diff  # noqa: E402,F401
from outcomes import outcome  # noqa: E402

N, DIM, BATCH, STEPS = 64, 8, 4, 4  # BATCH: per rank; N samples: 8 steps per epoch on 2 ranks
LR, WD, MAX_NORM = 1e-2, 0.1, 0.05  # the gradient norms are about 1 or more: every step is clipped
BF16_SHARE = 0.01  # bf16: pyzero's distance to DDP's bf16 run, at most this share of bf16's own error


class Net(L.LightningModule):
    """An MLP with a decaying LR; records its local losses and, before clipping, the global gradient
    norm: from the parameters' .grad under DDP, from the strategy under pyzero (ZeRO's shards)."""

    def __init__(self, zero_stage=None, **zero_options):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(DIM, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
        self.zero_stage = zero_stage  # configure_optimizers builds a pz.ZeroOptimizer itself (misuse cases)
        self.zero_options = zero_options  # (its options)
        self.losses, self.norms = [], []

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        strategy = self.trainer.strategy
        if isinstance(strategy, pzl.PyzeroStrategy):
            norm = strategy.grad_norm()
        else:
            norm = torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None])
        self.norms.append(norm.item())

    def configure_optimizers(self):
        if self.zero_stage is not None:
            return pz.ZeroOptimizer(self, torch.optim.AdamW, stage=self.zero_stage, lr=LR, weight_decay=WD,
                                    **self.zero_options)
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))}


class Unscheduled(Net):
    """Net without the LR schedule, so a pz.ZeroOptimizer built in configure_optimizers compares with DDP."""

    def configure_optimizers(self):
        if self.zero_stage is not None:
            return pz.ZeroOptimizer(self, torch.optim.AdamW, stage=self.zero_stage, lr=LR, weight_decay=WD,
                                    **self.zero_options)
        return torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)


class Sequenced(Net):
    """Net under schedulers that drive others: SequentialLR (a warm-up, then a decay) or ChainedScheduler;
    the learning rate of each step in `lrs`."""

    def __init__(self, chained=False):
        super().__init__()
        self.chained, self.lrs = chained, []

    def on_before_optimizer_step(self, optimizer):
        super().on_before_optimizer_step(optimizer)
        self.lrs.append(optimizer.param_groups[0]["lr"])

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=LR, weight_decay=WD)
        sched = torch.optim.lr_scheduler
        if self.chained:
            s = sched.ChainedScheduler([sched.ExponentialLR(opt, 0.9), sched.LambdaLR(opt, lambda k: 1 / (1 + k))])
        else:
            s = sched.SequentialLR(opt, [sched.LinearLR(opt, 0.1, total_iters=2), sched.ExponentialLR(opt, 0.5)],
                                   milestones=[2])
        return {"optimizer": opt, "lr_scheduler": {"scheduler": s, "interval": "step"}}


class Manual(Net):
    """Net in manual optimization: manual_backward, self.clip_gradients, opt.step every second batch
    (accumulation by hand, every backward synchronised as under DDP), opt.zero_grad, the scheduler by hand."""

    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt, sched = self.optimizers(), self.lr_schedulers()
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        self.manual_backward(loss / 2)
        if batch_idx % 2 == 1:
            self.clip_gradients(opt, gradient_clip_val=MAX_NORM, gradient_clip_algorithm="norm")
            opt.step()
            opt.zero_grad()
            sched.step()


class ManualZero(Manual):
    """Manual with a pz.ZeroOptimizer of its own (stage 2, `zero_options`) under the same LR schedule."""

    def __init__(self, **zero_options):
        super().__init__()
        self.zero_options = zero_options

    def configure_optimizers(self):
        opt = pz.ZeroOptimizer(self, torch.optim.AdamW, stage=2, lr=LR, weight_decay=WD, **self.zero_options)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))}


class SubgroupZero(Net):
    """A pz.ZeroOptimizer over the data-parallel group of a 1 x 2 mesh (tensor parallelism's layout)."""

    def configure_optimizers(self):
        dp_group, _ = pz.mesh(dp=1, tp=2)
        return pz.ZeroOptimizer(self, torch.optim.AdamW, stage=2, group=dp_group, lr=LR)


class TensorParallelZero(Net):
    """A pz.ZeroOptimizer over the whole job with a tensor-parallel group of the 2 processes."""

    def configure_optimizers(self):
        return pz.ZeroOptimizer(self, torch.optim.AdamW, stage=2, tp_group=pz.new_group([0, 1]), lr=LR)


class Stale(L.Callback):
    """At every validation and at the end of fit: the largest difference between the weights the module
    holds and its ZeroOptimizer's fp32 masters (every rank calls it; the first rank gets the number)."""

    def __init__(self):
        self.diffs = []

    def _check(self, module):
        zero = pz.zero.owner(module)
        masters = zero.full_state_dict()
        local = module.state_dict()
        self.diffs.append(None if masters is None else max((local[k] - v).abs().max().item()
                                                           for k, v in masters.items()))

    def on_validation_epoch_start(self, trainer, module):
        self._check(module)

    def on_fit_end(self, trainer, module):
        self._check(module)


def loader():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(N, DIM, generator=g)
    return DataLoader(TensorDataset(x, (x * torch.arange(DIM)).sum(1, keepdim=True)), batch_size=BATCH)


def comm_calls() -> dict:
    """pyzero collectives since the last call: {op: calls}."""
    return {op: s["calls"] for op, s in pz.comm_stats(reset=True).items() if s["calls"]}


class CommCounter(L.Callback):
    """pyzero collectives of each batch (accumulation micro-steps and synchronised ones)."""

    def __init__(self):
        self.calls = []

    def on_train_batch_start(self, trainer, module, batch, batch_idx):
        comm_calls()

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
        self.calls.append(comm_calls())


def weights(module):
    """Full fp32 weights (every rank calls it; a ZeroOptimizer gathers them on the first rank)."""
    zero = pz.zero.owner(module)
    sd = zero.full_state_dict() if zero is not None else module.state_dict()
    return None if sd is None else {k: v.detach().clone() for k, v in sd.items()}


def fit(strategy, steps=STEPS, max_norm=MAX_NORM, accum=1, module=None, callbacks=(), ckpt_path=None, epochs=None,
        save=None, weights_only=False, val=False, **kwargs):
    """One Trainer.fit: `steps` optimizer steps, or `epochs` whole epochs (`val`: validated on the training
    data after each); then trainer.save_checkpoint(save)."""
    module = module or Net()
    steps = {"max_steps": steps} if epochs is None else {"max_epochs": epochs}
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, **steps, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=max_norm,
                        accumulate_grad_batches=accum, callbacks=list(callbacks),
                        enable_checkpointing=any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint)
                                                 for c in callbacks), **kwargs)
    trainer.fit(module, loader(), loader() if val else None, ckpt_path=ckpt_path)
    if save is not None:
        trainer.save_checkpoint(save, weights_only=weights_only)
    return {"loss": module.losses, "grad_norm": module.norms, "weights": weights(module)}


def finish(value):
    """End of a rank function: torch.distributed down before pyzero; the first rank's value."""
    torch.distributed.destroy_process_group()
    return value if pz.get_rank() == 0 else None


# ---------------------------------------------------------------------------
# against Lightning's DDP: clipping, accumulation


def _rank_matches_ddp():
    pzl.init(timeout=60)  # before Lightning's DDPStrategy starts torch.distributed on the same port
    runs = {"ddp": fit("ddp"), "ddp_unclipped": fit("ddp", max_norm=None)}
    for strategy in pzl.STRATEGIES:
        runs[strategy] = fit(pzl.PyzeroStrategy(strategy))
    accum = {"ddp": fit("ddp", accum=2)}
    counters = {}
    for strategy in pzl.STRATEGIES:
        counters[strategy] = CommCounter()
        accum[strategy] = fit(pzl.PyzeroStrategy(strategy), accum=2, callbacks=[counters[strategy]])
    # configure_optimizers returning its own pz.ZeroOptimizer
    own = {"ddp": fit("ddp", module=Unscheduled()),
           "zero3": fit(pzl.PyzeroStrategy("zero3"), module=Unscheduled(zero_stage=3)),
           # loss scaling: backward on the scaled loss (a power of two: exact in fp32), step() unscales; were
           # the loss not scaled, the gradients would be 2**-16 of DDP's and never clipped
           "zero2_scaled": fit(pzl.PyzeroStrategy("zero2"), module=Unscheduled(zero_stage=2, loss_scale="dynamic"))}
    manual_scaled = fit(pzl.PyzeroStrategy("zero2"), module=ManualZero(loss_scale="dynamic"),
                        max_norm=None)
    manual = {"ddp": fit("ddp", module=Manual(), max_norm=None)}  # (Lightning refuses gradient_clip_val there)
    for strategy in pzl.STRATEGIES:
        manual[strategy] = fit(pzl.PyzeroStrategy(strategy), module=Manual(), max_norm=None)
    # schedulers that set the learning rate through the ones they hold (were left on the discarded optimizer)
    nested = {}
    for chained in (False, True):
        for name, strategy in (("ddp", "ddp"), ("zero2", pzl.PyzeroStrategy("zero2"))):
            module = Sequenced(chained)
            nested[(chained, name)] = {**fit(strategy, module=module), "lrs": module.lrs}
    bf16 = {"ddp": fit("ddp", precision="bf16-mixed")}
    for strategy in ("dp", "zero2", "zero3"):
        bf16[strategy] = fit(pzl.PyzeroStrategy(strategy), precision="bf16-mixed")
    return finish({"runs": runs, "accum": accum, "calls": {k: c.calls for k, c in counters.items()}, "bf16": bf16,
                   "own": own, "manual": manual, "manual_scaled": manual_scaled, "nested": nested})


def test_matches_ddp_with_clipping_accumulation_and_bf16():
    got = run_ranks(_rank_matches_ddp, 2, timeout=120)[0].value
    runs = got["runs"]
    ref, unclipped = runs.pop("ddp"), runs.pop("ddp_unclipped")
    fp32 = ref["weights"]
    assert len(ref["grad_norm"]) == STEPS and min(ref["grad_norm"]) > 5 * MAX_NORM  # every step clipped
    close(unclipped["grad_norm"][0], ref["grad_norm"][0])  # the same first step; without clipping ...
    assert max_diff(unclipped["weights"], ref["weights"]) > 100 * TOL["atol"]  # ... it ends far away
    for name, run in runs.items():
        assert_same_run(run, ref, name)
    ref = got["accum"].pop("ddp")
    assert len(ref["loss"]) == 2 * STEPS and len(ref["grad_norm"]) == STEPS
    for name, run in got["accum"].items():
        assert_same_run(run, ref, f"{name}, 2 micro-steps")
        calls = got["calls"][name]
        micro, synced = calls[0::2], calls[1::2]
        if name == "zero3":  # its parameters are gathered for every forward and backward, reduced on sync only
            assert all(set(m) == {"all_gather"} for m in micro), micro
        else:
            assert micro == [{}] * STEPS, f"{name}: pyzero collectives on accumulation micro-steps: {micro}"
        assert all(set(s) - {"all_gather"} for s in synced), f"{name}: no reduction when synchronised: {synced}"
    assert_same_run(got["own"]["zero3"], got["own"]["ddp"], "configure_optimizers' own ZeroOptimizer")
    assert_same_run(got["own"]["zero2_scaled"], got["own"]["ddp"], "its own ZeroOptimizer with loss_scale")
    ref = got["manual"].pop("ddp")
    assert len(ref["loss"]) == 2 * STEPS and len(ref["grad_norm"]) == STEPS
    for name, run in got["manual"].items():
        assert_same_run(run, ref, f"{name}, manual optimization")
    assert_same_run(got["manual_scaled"], ref, "manual optimization, its own ZeroOptimizer with loss_scale")
    nested = got["nested"]
    for chained in (False, True):
        ref, run = nested[(chained, "ddp")], nested[(chained, "zero2")]
        assert len(set(ref["lrs"])) == STEPS, ref["lrs"]  # (the schedule moves every step)
        assert run["lrs"] == ref["lrs"], (chained, run["lrs"], ref["lrs"])
        assert_same_run(run, ref, f"zero2 under {'ChainedScheduler' if chained else 'SequentialLR'}")
    bf16 = got["bf16"]
    ref = bf16.pop("ddp")
    assert_bf16_tracks(bf16, ref, fp32, BF16_SHARE)


# ---------------------------------------------------------------------------
# checkpoints, misuse


class EpochWeights(L.Callback):
    """The full weights at the end of each epoch (every rank calls it)."""

    def __init__(self):
        self.weights = []

    def on_train_epoch_end(self, trainer, module):
        self.weights.append(weights(module))


def _rank_resume_and_misuse(out):
    pzl.init(timeout=60)
    from lightning.pytorch.callbacks import ModelCheckpoint
    # (resuming from a checkpoint written at a finished fit: Lightning's own DDP run resumed from an epoch-end
    # ModelCheckpoint repeats loop steps and does not continue like its uninterrupted run either)
    epochs, saver = EpochWeights(), ModelCheckpoint(dirpath=os.path.join(out, "every"), save_top_k=-1)
    full = fit(pzl.PyzeroStrategy("zero2"), epochs=2, callbacks=[saver, epochs])
    ddp_epochs = EpochWeights()
    ddp = fit("ddp", epochs=2, callbacks=[ddp_epochs])
    first = os.path.join(out, "first.ckpt")
    fit(pzl.PyzeroStrategy("zero2"), epochs=1, save=first)
    light = os.path.join(out, "light.ckpt")  # weights only: the shards hold no optimizer state either
    fit(pzl.PyzeroStrategy("zero2"), epochs=1, save=light, weights_only=True)
    metas = {}
    for name, path in (("first", first), ("light", light)):
        with open(os.path.join(path, pzl.CHECKPOINT_DIR, "latest")) as f:
            step = f.read().strip()
        with open(os.path.join(path, pzl.CHECKPOINT_DIR, step, "meta.json")) as f:
            metas[name] = json.load(f).get("optimizer_state", True)
    resumed = fit(pzl.PyzeroStrategy("zero2"), epochs=2, ckpt_path=first)
    # the same checkpoint into stage 3 (pz.checkpoint reshards)
    as_zero3 = fit(pzl.PyzeroStrategy("zero3"), epochs=2, ckpt_path=first)
    per_epoch = N // (2 * BATCH)
    every = os.path.join(out, "every", f"epoch=0-step={per_epoch}.ckpt")
    files = {"first": sorted(os.listdir(first)), "every": sorted(os.listdir(every))}
    loaded = {name: Net.load_from_checkpoint(os.path.join(path, pzl.LIGHTNING_FILE)).state_dict()
              for name, path in (("first", first), ("every", every))}

    found = {}
    found["ddp_zero"] = outcome(lambda: fit("ddp", module=Net(zero_stage=2)))
    dp_net = Net()
    dp_net.net = pz.DataParallel(dp_net.net)
    found["ddp_dataparallel"] = outcome(lambda: fit("ddp", module=dp_net))
    found["stage_mismatch"] = outcome(lambda: fit(pzl.PyzeroStrategy("zero2"), module=Net(zero_stage=3)))
    found["bf16_true"] = outcome(lambda: fit(pzl.PyzeroStrategy("zero2"), precision="bf16-true"))
    found["clip_value"] = outcome(lambda: fit(pzl.PyzeroStrategy("zero1"), gradient_clip_algorithm="value"))
    found["subgroup"] = outcome(lambda: fit(pzl.PyzeroStrategy("zero2"), module=SubgroupZero()))
    found["tp_group"] = outcome(lambda: fit(pzl.PyzeroStrategy("zero2"), module=TensorParallelZero()))
    return finish({"full": full, "ddp": ddp, "ddp_epochs": ddp_epochs.weights, "resumed": resumed,
                   "as_zero3": as_zero3, "epochs": epochs.weights,
                   "files": files, "loaded": loaded, "found": found, "metas": metas})


def test_resume_bitwise_and_misuse_raises(tmp_path):
    got = run_ranks(_rank_resume_and_misuse, 2, args=(str(tmp_path),), timeout=120)[0].value
    full, resumed = got["full"], got["resumed"]
    assert_same_run(full, got["ddp"], "two epochs with checkpoints")
    half = len(full["grad_norm"]) // 2
    for name, files in got["files"].items():
        assert files == sorted([pzl.CHECKPOINT_DIR, pzl.LIGHTNING_FILE]), (name, files)
    assert len(resumed["grad_norm"]) == half  # the second epoch only, with the schedule where it was
    tail = {"loss": full["loss"][half:], "grad_norm": full["grad_norm"][half:], "weights": full["weights"]}
    assert_same_run(resumed, tail, "resumed from epoch 0", bitwise=True)
    assert_same_run(got["as_zero3"], tail, "epoch 0 resumed as stage 3")
    # the consolidated weights in Lightning's file (trainer.save_checkpoint, ModelCheckpoint): the first epoch's
    for name, loaded in got["loaded"].items():
        for k, v in got["epochs"][0].items():
            assert torch.equal(loaded[k], v), (name, k)
        for k, v in got["ddp_epochs"][0].items():
            torch.testing.assert_close(loaded[k], v, **TOL)
    assert got["metas"] == {"first": True, "light": False}, got["metas"]
    found = got["found"]
    # Lightning's DDPStrategy steps with a closure, which ZeroOptimizer refuses before anything runs
    kind, msg = found["ddp_zero"]
    assert kind == "ValueError" and "closure" in msg and "PyzeroStrategy" in msg, msg
    kind, msg = found["ddp_dataparallel"]
    assert kind == "RuntimeError" and "DistributedDataParallel" in msg and "PyzeroStrategy" in msg, msg
    assert found["stage_mismatch"][0] == "ValueError" and "stage 3" in found["stage_mismatch"][1]
    assert found["bf16_true"][0] == "ValueError" and "precision:" in found["bf16_true"][1], found["bf16_true"]
    assert found["clip_value"][0] == "ValueError" and "gradient_clip_algorithm" in found["clip_value"][1]
    kind, msg = found["tp_group"]
    assert kind == "ValueError" and msg.startswith("configure_optimizers: the pz.ZeroOptimizer's tp_group"), msg
    kind, msg = found["subgroup"]  # (a tensor-parallel layout's data-parallel group: 1 of the 2 processes)
    assert kind == "ValueError" and msg.startswith("configure_optimizers: the pz.ZeroOptimizer's group holds 1 of "
                                                   "the job's 2 processes"), msg


class Validated(Net):
    """Net with a validation loss, recorded (under a WeightAveraging callback: the averaged weights')."""

    def __init__(self):
        super().__init__()
        self.val_losses = []

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.val_losses.append(torch.nn.functional.mse_loss(self.net(x), y).item())


def fit_averaged(strategy, epochs=2, **kwargs):
    """Epochs with EMAWeightAveraging, validated after each: the run, its validation losses, the average."""
    from lightning.pytorch.callbacks import EMAWeightAveraging
    module, ema = Validated(), EMAWeightAveraging(decay=0.5)
    run = fit(strategy, epochs=epochs, module=module, callbacks=[ema], val=True, **kwargs)
    return dict(run, val=module.val_losses, average=ema._average_model.module.state_dict())


def _rank_weight_averaging(out):
    pzl.init(timeout=60)
    from lightning.pytorch.callbacks import StochasticWeightAveraging
    runs = {"ddp": fit_averaged("ddp")}
    for strategy in pzl.STRATEGIES:
        runs[strategy] = fit_averaged(pzl.PyzeroStrategy(strategy))
    # saved after one epoch (its end copied the average into the model), resumed for the second: stage 3 as DDP
    resumed = {}
    for name, strategy in (("ddp", lambda: "ddp"), ("zero3", lambda: pzl.PyzeroStrategy("zero3"))):
        first = os.path.join(out, f"{name}.ckpt")
        fit_averaged(strategy(), epochs=1, save=first)  # (a strategy object per Trainer)
        resumed[name] = fit_averaged(strategy(), ckpt_path=first)
    swa = outcome(lambda: fit(pzl.PyzeroStrategy("zero3"), callbacks=[StochasticWeightAveraging(swa_lrs=1e-3)]))
    return finish({"runs": runs, "resumed": resumed, "swa": swa})


def test_weight_averaging_callback_matches_ddp_at_every_stage(tmp_path):
    """Lightning's EMAWeightAveraging reads the weights after each step, swaps in the average for validation and
    copies it into the model at the end: under ZeRO (stage 3 frees its parameters outside forward) each of
    these sees and writes the whole weights, as under DDP."""
    got = run_ranks(_rank_weight_averaging, 2, args=(str(tmp_path),), timeout=120)[0].value
    runs = got["runs"]
    ref = runs.pop("ddp")
    assert len(ref["val"]) == 2 + 2 * N // (2 * BATCH)  # the sanity check's 2 batches, then 2 epochs
    assert max_diff(ref["weights"], dict(zip(ref["weights"], Net().state_dict().values()))) > 1e-3
    for name, run in runs.items():
        assert_same_run(run, ref, name)  # (the weights: the average, copied into the model at the end)
        close(run["val"], ref["val"])
        for k, v in ref["average"].items():
            torch.testing.assert_close(run["average"][k], v, **TOL, msg=lambda m, k=k, name=name: f"{name} {k}: {m}")
    resumed = got["resumed"]
    assert len(resumed["ddp"]["grad_norm"]) == len(ref["grad_norm"]) // 2  # the second epoch
    assert_same_run(resumed["zero3"], resumed["ddp"], "resumed after epoch 0")
    close(resumed["zero3"]["val"], resumed["ddp"]["val"])
    for k, v in resumed["ddp"]["average"].items():
        torch.testing.assert_close(resumed["zero3"]["average"][k], v, **TOL)
    kind, msg = got["swa"]
    assert kind == "ValueError" and "StochasticWeightAveraging" in msg and "EMAWeightAveraging" in msg, msg


class Factored(Net):
    """Net with torch's Adafactor, which computes on whole tensors (factored moments of each matrix)."""

    def configure_optimizers(self):
        return torch.optim.Adafactor(self.parameters(), lr=LR)


def _rank_whole_tensor_optimizer():
    pzl.init(timeout=60)
    ddp, dp = fit("ddp", module=Factored()), fit(pzl.PyzeroStrategy("dp"), module=Factored())
    found = {s: outcome(lambda s=s: fit(pzl.PyzeroStrategy(s), module=Factored())) for s in ("zero1", "zero3")}
    torch.distributed.destroy_process_group()
    return {"found": found, "ddp": ddp, "dp": dp}


def test_whole_tensor_optimizer_refused_with_zero():
    """Adafactor on ZeRO's flat pieces of each tensor trains elsewhere than on the tensors (5e-3 off in the
    weights after two epochs): refused on every rank, naming configure_optimizers; "dp" runs it as DDP does."""
    ranks = [r.value for r in run_ranks(_rank_whole_tensor_optimizer, 2, timeout=120)]
    assert_same_run(ranks[0]["dp"], ranks[0]["ddp"], "Adafactor with 'dp'")
    for got in ranks:
        for stage, (kind, msg) in got["found"].items():
            assert kind == "ValueError" and msg.startswith("configure_optimizers: Adafactor computes on whole"), msg
            assert "PyzeroStrategy('dp')" in msg, msg


class TiedOutput(torch.nn.Module):
    """An output projection that reads the input layer's weight itself (not by calling the layer)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp, self.mid = torch.nn.Linear(DIM, 16), torch.nn.Linear(16, 16)

    def forward(self, x):
        h = torch.tanh(self.mid(torch.tanh(self.inp(x))))
        return torch.nn.functional.linear(h, self.inp.weight.t())[:, :1]


class TiedNet(Net):
    def __init__(self):
        super().__init__()
        self.net = TiedOutput()


def _rank_stage3_freed_read():
    pzl.init(timeout=60)
    found = {"zero3": outcome(lambda: fit(pzl.PyzeroStrategy("zero3"), module=TiedNet()))}
    ddp = fit("ddp", module=TiedNet())
    leaf = fit(pzl.PyzeroStrategy("zero3", leaf_modules=[TiedOutput]), module=TiedNet())
    torch.distributed.destroy_process_group()
    return {"found": found, "ddp": ddp, "leaf": leaf}


def test_stage3_parameter_read_outside_its_module_is_named():
    """A LightningModule whose training_step calls a child that reads another module's weight itself:
    ZeRO-3 refuses it on every rank in the first forward, naming the weight (it would read a freed
    parameter's NaN), and trains it as DDP does with the reading module a leaf module."""
    ranks = [r.value for r in run_ranks(_rank_stage3_freed_read, 2, timeout=120)]
    assert_same_run(ranks[0]["leaf"], ranks[0]["ddp"], "zero3 with leaf_modules")
    for got in ranks:
        kind, msg = got["found"]["zero3"]
        assert kind == "RuntimeError" and "'net.inp.weight' was read while freed" in msg, msg


def test_bad_arguments_name_the_argument():
    for kwargs, words in [(dict(strategy="zero4"), "strategy: expected one of"),
                          (dict(strategy="zero2", stage=3), "stage: not a pz.ZeroOptimizer option"),
                          (dict(strategy="dp", offload="cpu"), "offload: not a pz.DataParallel option"),
                          (dict(strategy="zero2", zero_hpz_partition_size=2), "zero_hpz_partition_size: not a"),
                          (dict(strategy="zero2", prefetch=0), "prefetch: .*a ZeRO stage-3 option, and the strategy"),
                          (dict(strategy="zero3", prefetch0=0),
                           r"expected some of \[.*'prefetch', 'leaf_modules', 'zero_\*'\]"),
                          (dict(strategy="zero2", timeout=0), "timeout: expected a positive"),
                          (dict(strategy="zero2", param_dtype=torch.float16),
                           "param_dtype: torch.float16 needs loss scaling.*loss_scale= from configure_optimizers"),
                          # (a timedelta's own errors before: NaN, infinity and beyond its range)
                          (dict(strategy="zero2", timeout=float("nan")), "timeout: expected a positive"),
                          (dict(strategy="zero2", timeout=float("inf")), "timeout: expected a positive"),
                          (dict(strategy="zero2", timeout=1e30), "timeout: expected a positive")]:
        with pytest.raises(ValueError, match=words):
            pzl.PyzeroStrategy(**kwargs)
    pzl.PyzeroStrategy("zero3", prefetch=0, zero_hpz_partition_size=1, offload_moments="bf16",
                       leaf_modules=[torch.nn.Linear])  # accepted
    # (on CPU Lightning turns precision="16-mixed" into bf16; a GradScaler given to ZeRO must be refused)
    from lightning.pytorch.plugins.precision import MixedPrecision
    with pytest.raises(ValueError, match="precision: '16-mixed'"):
        pzl.PyzeroStrategy("zero2").precision_plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
    pzl.PyzeroStrategy("dp").precision_plugin = MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu"))


class ValidatedOwn(Unscheduled):
    """Unscheduled (its own ZeroOptimizer) with a validation step."""

    validation_step = Validated.validation_step

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.val_losses = []


def _rank_delayed_update():
    pzl.init(timeout=60)
    stale = Stale()
    fit(pzl.PyzeroStrategy("zero2"), module=ValidatedOwn(zero_stage=2, offload="cpu", delayed_update=True),
        epochs=2, val=True, callbacks=[stale], num_sanity_val_steps=0)
    return finish(stale.diffs)


def test_delayed_update_is_published_before_validation_and_at_the_end():
    """A ZeroOptimizer of one's own with delayed_update holds the last step's parameters back: the strategy
    publishes them before validation and when fit ends, so both see the weights the checkpoints hold."""
    diffs = run_ranks(_rank_delayed_update, 2, timeout=120)[0].value
    assert len(diffs) == 3 and all(d == 0.0 for d in diffs), diffs  # 2 validations (after each epoch), the end


class Predicting(Net):
    def predict_step(self, batch, batch_idx):
        return self.net(batch[0])


def _rank_predict_zero3():
    pzl.init(timeout=20)
    module = Predicting()
    trainer = L.Trainer(strategy=pzl.PyzeroStrategy("zero3"), accelerator="cpu", devices=2, max_steps=2,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(module, loader())
    full = weights(module)
    x = torch.randn(5, DIM, generator=torch.Generator().manual_seed(2))
    even = trainer.predict(module, DataLoader(TensorDataset(x[:4]), batch_size=1))
    try:  # 5 samples: 3 batches on the first rank, 2 on the second
        trainer.predict(module, DataLoader(TensorDataset(x), batch_size=1))
        uneven = "nothing raised"
    except ValueError as e:
        uneven = str(e)
    out = {"even": torch.cat(even), "uneven": uneven, "x": x, "weights": full}
    torch.distributed.destroy_process_group()
    return out


def test_zero3_predict_runs_even_batches_and_refuses_uneven_ones():
    """Lightning deals prediction data out unpadded; ZeRO-3's forward gathers from every rank, so ranks with
    3 and 2 batches waited for each other's gathers until the timeout (the first rank's CollectiveTimeout
    after the second had left). A ValueError on every rank naming the counts; even counts predict what the
    trained weights give."""
    res = run_ranks(_rank_predict_zero3, 2, timeout=120)
    ref = Predicting()
    ref.load_state_dict(res[0].value["weights"])
    x = res[0].value["x"]
    for r in res:
        with torch.no_grad():
            want = ref.net(x[r.rank:4:2])  # (each rank's samples: rank, rank + 2, ...)
        torch.testing.assert_close(r.value["even"], want, rtol=1e-6, atol=1e-6)
        assert "dataloader 0 gives the ranks [3, 2] batches" in r.value["uneven"], r.value["uneven"]


def _rank_cpu_accelerator_where_torch_sees_a_gpu():
    torch.cuda.is_available = lambda: True  # (pz.init's default backend is then "nccl")
    out = fit(pzl.PyzeroStrategy("zero2"))
    return finish({"backend": pz.get_backend(), "run": out})


def test_cpu_accelerator_runs_on_shm_where_torch_sees_a_gpu():
    """PyzeroStrategy with accelerator="cpu" starts pyzero on "shm" even where torch sees a GPU (pz.init's
    default there is "nccl", whose groups work on CUDA tensors), and trains as Lightning's DDP does."""
    got = run_ranks(_rank_cpu_accelerator_where_torch_sees_a_gpu, 2, timeout=120)[0].value
    assert got["backend"] == "shm"
    ref = run_ranks(_rank_ddp_only, 2, timeout=120)[0].value
    assert_same_run(got["run"], ref, "zero2 on shm")


def _rank_ddp_only():
    pzl.init(timeout=60)
    return finish(fit("ddp"))


# ---------------------------------------------------------------------------
# Lightning's own launcher


def test_example_started_by_lightning(tmp_path):
    """examples/lightning_train.py with devices=2 and no launcher of ours: Lightning starts the second
    process (its subprocess launcher), PyzeroStrategy starts pyzero in both from Lightning's ranks."""
    example = os.path.join(os.path.dirname(__file__), "..", "examples", "lightning_train.py")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.Popen([sys.executable, example, "--devices", "2", "--epochs", "1", "--out", str(tmp_path)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # (its own process group: a hang kills Lightning's child too)
    try:
        out, _ = proc.communicate(timeout=90)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"examples/lightning_train.py --devices 2 did not finish in 90 s:\n{out[-4000:]}")
    assert proc.returncode == 0, out[-4000:]
    summary = ast.literal_eval(out.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and summary["steps"] == 8192 // (2 * 32), summary
    # the data's variance is about 0.4: the weights reloaded from the checkpoint fit it
    assert summary["reloaded_eval_loss"] < 0.02, summary
    sharded = os.path.join(tmp_path, "last.ckpt", pzl.CHECKPOINT_DIR)
    with open(os.path.join(sharded, "latest")) as f:
        step_dir = os.path.join(sharded, f.read().strip())
    assert {"rank00000.pt", "rank00001.pt"} <= set(os.listdir(step_dir))  # both processes wrote their shard
