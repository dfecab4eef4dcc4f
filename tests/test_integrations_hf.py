"""pyzero.integrations.hf against the frameworks' own runs: transformers.Trainer and accelerate
with torch DDP and torch AdamW, on 2 CPU ranks.

Each test is one launch of ranks that trains a tiny GPT-2 (random tokens) several ways, the
framework's own DDP run first, and returns what the parent compares: the losses and gradient
norms the framework logged, and the final weights. Clipping is on (MAX_NORM is far below the
gradient norms, and a run without it ends measurably elsewhere), so a norm that misses ZeRO's
shards cannot pass.
"""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

from accelerate.state import AcceleratorState, GradientState  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments  # noqa: E402
from transformers import default_data_collator  # noqa: E402

import pyzero as pz  # noqa: E402
from pyzero.integrations import hf  # noqa: E402
from pyzero.launch import run_ranks  # noqa: E402

from compare_runs import TOL, assert_bf16_tracks, assert_same_run, close, max_diff  # noqa: E402,F401
from outcomes import outcome  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 128, 16, 4, 4  # BATCH: per rank
LR, WD, MAX_NORM = 1e-2, 0.1, 0.05  # the gradient norms are about 1: every step is clipped
BF16_SHARE = 0.01  # bf16: pyzero's distance to DDP's bf16 run, at most this share of bf16's own error


def gpt():
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=SEQ,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                      eos_token_id=0))


def dataset(n=64):
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": x, "labels": x.clone()} for x in ids]


def weights(model):
    """Full fp32 weights (every rank calls it; a ZeroOptimizer gathers them on the first rank)."""
    zero = pz.zero.owner(model)
    sd = zero.full_state_dict() if zero is not None else model.state_dict()
    return None if sd is None else {k: v.detach().cpu().clone() for k, v in sd.items()}


def comm_calls() -> dict:
    """pyzero collectives since the last call: {op: calls}."""
    return {op: s["calls"] for op, s in pz.comm_stats(reset=True).items() if s["calls"]}


def reductions(calls: dict) -> int:
    """Gradient reductions among `calls` (stage 3 also gathers parameters on every micro-step)."""
    return sum(n for op, n in calls.items() if op != "all_gather")


class CommCounter(TrainerCallback):
    """pyzero collectives per accumulation micro-step (no sync) and per synchronised one."""

    def __init__(self):
        self.micro, self.synced = [], []

    def on_step_begin(self, args, state, control, **kwargs):
        comm_calls()

    def on_substep_end(self, args, state, control, **kwargs):
        self.micro.append(comm_calls())

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.synced.append(comm_calls())


def train(out, cls=transformers.Trainer, steps=STEPS, max_norm=MAX_NORM, accum=1, bf16=False, save_steps=None,
          resume=None, model=None, callbacks=(), args=None, use_cpu=True, **kwargs):
    args = TrainingArguments(output_dir=out, use_cpu=use_cpu, report_to=[], disable_tqdm=True, seed=0, max_steps=steps,
                             per_device_train_batch_size=BATCH, gradient_accumulation_steps=accum, logging_steps=1,
                             learning_rate=LR, weight_decay=WD, max_grad_norm=max_norm, bf16=bf16,
                             save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
                             **(args or {}))
    trainer = cls(model=model or gpt(), args=args, train_dataset=dataset(), callbacks=list(callbacks), **kwargs)
    trainer.train(resume_from_checkpoint=resume)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in logs], "grad_norm": [h["grad_norm"] for h in logs],
            "weights": weights(trainer.model), "best": trainer.state.best_model_checkpoint,
            "device": str(trainer.args.device)}


def decay_groups(model):
    """The Trainer's weight-decay split (none on biases and LayerNorms), for an optimizer built by hand."""
    named = list(model.named_parameters())
    decay = [p for n, p in named if n.endswith("weight") and ".ln_" not in n and "ln_f" not in n]
    return [{"params": decay, "weight_decay": WD},
            {"params": [p for _, p in named if all(p is not q for q in decay)], "weight_decay": 0.0}]


def finish(value):
    """End of a rank function: torch.distributed down before pyzero; the first rank's value."""
    torch.distributed.destroy_process_group()
    return value if pz.get_rank() == 0 else None


# ---------------------------------------------------------------------------
# transformers.Trainer


def _rank_trainer(out):
    hf.init(timeout=60)
    runs = {"ddp": train(out), "ddp_unclipped": train(out, max_norm=0.0)}
    for strategy in hf.STRATEGIES:
        runs[strategy] = train(out, hf.PyzeroTrainer, strategy=strategy)
    runs["zero2_offload"] = train(out, hf.PyzeroTrainer, strategy="zero2", strategy_options={"offload": "cpu"})
    runs["zero2_offload_unpiped"] = train(out, hf.PyzeroTrainer, strategy="zero2",
                                          strategy_options={"offload": "cpu", "offload_pipeline": False})
    runs["zero3_prefetch0"] = train(out, hf.PyzeroTrainer, strategy="zero3", strategy_options={"prefetch": 0})
    bf16_moments = train(out, hf.PyzeroTrainer, strategy="zero2",
                         strategy_options={"offload": "cpu", "offload_moments": "bf16"})
    model = gpt()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3, param_groups=decay_groups(model), lr=LR)
    runs["own_zero3"] = train(out, hf.PyzeroTrainer, model=model, optimizers=(opt, None))
    return finish({"runs": runs, "bf16_moments": bf16_moments})


def test_trainer_matches_ddp(tmp_path):
    got = run_ranks(_rank_trainer, 2, args=(str(tmp_path),), timeout=120)[0].value
    runs = got["runs"]
    ref = runs.pop("ddp")
    unclipped = runs.pop("ddp_unclipped")
    assert min(ref["grad_norm"]) > 5 * MAX_NORM  # every step clipped, by a factor of 5 or more
    close(unclipped["grad_norm"][0], ref["grad_norm"][0])  # the same first step; without clipping ...
    assert max_diff(unclipped["weights"], ref["weights"]) > 100 * TOL["atol"]  # ... it ends far away
    assert set(runs) == {"dp", "zero1", "zero2", "zero3", "zero2_offload", "zero2_offload_unpiped", "zero3_prefetch0",
                         "own_zero3"}
    for name, run in runs.items():
        assert_same_run(run, ref, name)
    # bf16 moments (strategy_options reach the optimizer): near AdamW's run, not equal to it
    moments = max_diff(got["bf16_moments"]["weights"], ref["weights"])
    print("bf16 moments vs fp32 AdamW: largest weight difference", moments)
    assert 0 < moments < 1e-3


def _rank_accumulation_bf16(out):
    hf.init(timeout=60)
    runs = {"ddp": train(out, accum=2)}
    counters = {}
    for strategy in ("dp", "zero1", "zero2", "zero3"):
        counters[strategy] = CommCounter()
        runs[strategy] = train(out, hf.PyzeroTrainer, accum=2, strategy=strategy, callbacks=[counters[strategy]])
    bf16 = {"ddp_fp32": train(out, steps=3), "ddp": train(out, steps=3, bf16=True),
            "zero2": train(out, hf.PyzeroTrainer, steps=3, bf16=True, strategy="zero2"),
            "zero3": train(out, hf.PyzeroTrainer, steps=3, bf16=True, strategy="zero3")}
    return finish({"accum": runs, "calls": {k: (c.micro, c.synced) for k, c in counters.items()}, "bf16": bf16})


def test_trainer_accumulation_and_bf16(tmp_path):
    got = run_ranks(_rank_accumulation_bf16, 2, args=(str(tmp_path),), timeout=120)[0].value
    ref = got["accum"].pop("ddp")
    for name, run in got["accum"].items():
        assert_same_run(run, ref, f"{name}, 2 micro-steps")
        micro, synced = got["calls"][name]
        if name == "zero3":  # its parameters are gathered for every forward and backward, reduced on sync only
            assert all(set(m) == {"all_gather"} for m in micro), micro
        else:
            assert micro == [{}] * STEPS, f"{name}: pyzero collectives on accumulation micro-steps: {micro}"
        assert min(map(reductions, synced)) > 0, f"{name}: no reduction on the synchronised micro-step: {synced}"
    bf16 = got["bf16"]
    fp32 = bf16.pop("ddp_fp32")["weights"]
    ref = bf16.pop("ddp")
    assert_bf16_tracks(bf16, ref, fp32, BF16_SHARE)


def _rank_resume(out):
    hf.init(timeout=60)
    full = train(out, hf.PyzeroTrainer, strategy="zero3", save_steps=2)
    resumed = train(out, hf.PyzeroTrainer, strategy="zero3", resume=os.path.join(out, "checkpoint-2"))
    # the same checkpoint into stage 2 (pz.checkpoint reshards)
    as_zero2 = train(out, hf.PyzeroTrainer, strategy="zero2", resume=os.path.join(out, "checkpoint-2"))
    # load_best_model_at_end: the best checkpoint's shards back into the ZeroOptimizer
    best_out = os.path.join(out, "best")
    # ("best" = the highest eval loss: an early checkpoint, so loading it changes the weights)
    best = train(best_out, hf.PyzeroTrainer, strategy="zero3", save_steps=1, eval_dataset=dataset(8),
                 args=dict(eval_strategy="steps", eval_steps=1, load_best_model_at_end=True,
                           metric_for_best_model="loss", greater_is_better=True))
    return finish({"full": full, "resumed": resumed, "as_zero2": as_zero2,
                   "files": sorted(os.listdir(os.path.join(out, "checkpoint-2"))), "best": best})


def test_trainer_checkpoint_resume(tmp_path):
    got = run_ranks(_rank_resume, 2, args=(str(tmp_path),), timeout=120)[0].value
    full, resumed = got["full"], got["resumed"]
    assert {"pyzero", "model.safetensors", "config.json", "scheduler.pt", "trainer_state.json"} <= set(got["files"])
    assert "optimizer.pt" not in got["files"]  # the optimizer state is in the shards
    assert len(resumed["loss"]) == STEPS  # the log restored with the trainer state, then steps 3 and 4
    assert_same_run(resumed, full, "resumed from checkpoint-2", bitwise=True)
    assert_same_run(got["as_zero2"], full, "checkpoint-2 resumed as stage 2")
    # save_model's weights in the usual layout: from_pretrained gives the final weights
    loaded = GPT2LMHeadModel.from_pretrained(os.path.join(tmp_path, f"checkpoint-{STEPS}"))
    sd = loaded.state_dict()
    for k, v in full["weights"].items():
        assert torch.equal(sd[k], v), k
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # still tied
    best = got["best"]
    assert best["best"] is not None and not best["best"].endswith(f"checkpoint-{STEPS}"), best["best"]
    sd = GPT2LMHeadModel.from_pretrained(best["best"]).state_dict()
    for k, v in best["weights"].items():
        assert torch.equal(sd[k], v), f"load_best_model_at_end, {k}"


class EMA(TrainerCallback):
    """An average of the weights after every step, read inside pz.zero.gathered_parameters (which finds the
    Trainer's ZeroOptimizer from the parameters, and does nothing for a model no ZeroOptimizer trains)."""

    def __init__(self):
        self.average = None

    def on_step_end(self, args, state, control, model=None, **kwargs):
        with torch.no_grad(), pz.zero.gathered_parameters(model.parameters()):
            if self.average is None:
                self.average = {n: p.detach().clone() for n, p in model.named_parameters()}
            else:
                for n, p in model.named_parameters():
                    self.average[n].lerp_(p, 0.5)


def _rank_ema_callback(out):
    hf.init(timeout=60)
    runs = {}
    for strategy in ("ddp", "zero1", "zero3"):
        ema = EMA()
        if strategy == "ddp":
            train(out, callbacks=[ema])
        else:
            train(out, hf.PyzeroTrainer, strategy=strategy, callbacks=[ema])
        runs[strategy] = ema.average
    return finish(runs)


def test_trainer_callback_reads_the_weights_in_a_gathered_block(tmp_path):
    """An EMA in a TrainerCallback: with ZeRO-3 (parameters freed outside forward) as with the Trainer's DDP."""
    got = run_ranks(_rank_ema_callback, 2, args=(str(tmp_path),), timeout=120)[0].value
    ref = got.pop("ddp")
    assert max_diff(ref, dict(gpt().named_parameters())) > 1e-3  # (it moved)
    for name, average in got.items():
        assert average.keys() == ref.keys(), name
        for k, v in ref.items():
            torch.testing.assert_close(average[k], v, **TOL, msg=lambda m, k=k, name=name: f"{name} {k}: {m}")


def _rank_optimizers(out):
    hf.init(timeout=60)
    schedule = dict(lr_scheduler_type="cosine", warmup_steps=2)
    runs = {}
    for optim, strategy in (("sgd", "zero2"), ("rmsprop", "zero3")):
        runs[optim] = {"ddp": train(out, args=dict(optim=optim, **schedule)),
                       strategy: train(out, hf.PyzeroTrainer, strategy=strategy, args=dict(optim=optim, **schedule))}
    found = {"adafactor": outcome(lambda: train(out, hf.PyzeroTrainer, strategy="zero2", args={"optim": "adafactor"})),
             "torch_adafactor": outcome(lambda: train(out, hf.PyzeroTrainer, strategy="zero3",
                                                      optimizer_cls_and_kwargs=(torch.optim.Adafactor, {"lr": LR})))}
    torch.distributed.destroy_process_group()
    return {"runs": runs if pz.get_rank() == 0 else None, "found": found}


def test_trainer_optimizers_elementwise_or_refused(tmp_path):
    """The Trainer's other elementwise optimizers (and its cosine schedule with warmup) match its DDP run;
    Adafactor, which factors each weight matrix's second moments and scales by each tensor's RMS, would
    run on ZeRO's flat pieces of the tensors and train elsewhere (0.04 off in the weights after 4
    steps): refused on every rank, naming the argument that chose it."""
    ranks = [r.value for r in run_ranks(_rank_optimizers, 2, args=(str(tmp_path),), timeout=120)]
    for optim, runs in ranks[0]["runs"].items():
        ref = runs.pop("ddp")
        for strategy, run in runs.items():
            close(run["loss"], ref["loss"])
            close(run["grad_norm"], ref["grad_norm"])
            assert max_diff(run["weights"], ref["weights"]) < 1e-5, (optim, strategy)
    for got in ranks:
        for case, words in (("adafactor", "optim: 'adafactor': Adafactor computes on whole parameter tensors"),
                            ("torch_adafactor", "optimizer_cls_and_kwargs: Adafactor computes on whole")):
            kind, msg = got["found"][case]
            assert kind == "ValueError" and msg.startswith(words) and "strategy='dp'" in msg, (case, msg)


# ---------------------------------------------------------------------------
# accelerate


def accelerate_run(cls, make_opt, out, steps=STEPS, accum=2, bf16=False, save_at=None, load=None):
    """A plain accelerate loop: accumulate, backward, clip, step. Returns the local micro-step losses,
    the clipping norms, the final weights and the pyzero calls of each accumulation micro-step."""
    AcceleratorState._reset_state(reset_partial_state=False)  # each run its own mixed precision
    GradientState._reset_state()
    acc = cls(cpu=True, gradient_accumulation_steps=accum, mixed_precision="bf16" if bf16 else "no")
    model = gpt()
    opt = make_opt(model)
    loader = DataLoader(dataset(), batch_size=BATCH, collate_fn=default_data_collator)
    model, opt, loader = acc.prepare(model, opt, loader)
    done = 0
    if load is not None:
        acc.load_state(load)
        done = steps // 2
        loader = acc.skip_first_batches(loader, done * accum)
    losses, norms, micro = [], [], []
    batches = iter(loader)
    for step in range(done, steps):
        for _ in range(accum):
            comm_calls()
            with acc.accumulate(model):
                loss = model(**next(batches)).loss
                acc.backward(loss)
                losses.append(loss.item())
                if not acc.sync_gradients:
                    micro.append(comm_calls())
                    continue
                norms.append(acc.clip_grad_norm_(model.parameters(), MAX_NORM).item())
                opt.step()
                opt.zero_grad()
        if save_at == step + 1:
            acc.save_state(os.path.join(out, "state"))
    return {"loss": losses, "grad_norm": norms, "weights": weights(acc.unwrap_model(model)), "micro": micro}


def adamw(model):
    return torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)


def zero(stage):
    return lambda model: pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=LR, weight_decay=WD)


def _rank_accelerate(out):
    hf.init(timeout=60)
    Plain, Ours = accelerate.Accelerator, hf.PyzeroAccelerator
    runs = {"ddp": accelerate_run(Plain, adamw, out), "dp": accelerate_run(Ours, adamw, out),
            "zero1": accelerate_run(Ours, zero(1), out), "zero3": accelerate_run(Ours, zero(3), out),
            "zero2": accelerate_run(Ours, zero(2), out, save_at=STEPS // 2)}
    resumed = accelerate_run(Ours, zero(2), out, load=os.path.join(out, "state"))
    bf16 = {"ddp_fp32": accelerate_run(Plain, adamw, out, steps=3),
            "ddp": accelerate_run(Plain, adamw, out, steps=3, bf16=True),
            "zero2": accelerate_run(Ours, zero(2), out, steps=3, bf16=True)}
    local = {"runs": runs, "resumed": resumed, "bf16": bf16}
    return torch.distributed.destroy_process_group() or local  # losses are local: every rank's


def test_accelerate_matches_ddp(tmp_path):
    ranks = [r.value for r in run_ranks(_rank_accelerate, 2, args=(str(tmp_path),), timeout=120)]
    for rank, got in enumerate(ranks):
        runs = got["runs"]
        ref = runs.pop("ddp")
        if rank == 0:
            assert min(ref["grad_norm"]) > 5 * MAX_NORM
        for name, run in runs.items():
            if rank == 0:
                assert_same_run(run, ref, f"accelerate {name}")
            close(run["loss"], ref["loss"])
            assert [reductions(m) for m in run["micro"]] == [0] * STEPS, f"{name}: reductions on micro-steps"
            if name != "zero3":
                assert run["micro"] == [{}] * STEPS, f"{name}: pyzero collectives on accumulation micro-steps"
        resumed, full = got["resumed"], runs["zero2"]
        assert resumed["loss"] == full["loss"][len(full["loss"]) // 2:]  # bitwise, every rank
        assert resumed["grad_norm"] == full["grad_norm"][STEPS // 2:]
        if rank == 0:
            for k, v in full["weights"].items():
                assert torch.equal(resumed["weights"][k], v), k
            bf16 = got["bf16"]
            fp32, ref = bf16["ddp_fp32"]["weights"], bf16["ddp"]["weights"]
            own_error = max_diff(ref, fp32)
            assert own_error > 1e-4
            assert max_diff(bf16["zero2"]["weights"], fp32) > 0.5 * own_error
            assert max_diff(bf16["zero2"]["weights"], ref) <= BF16_SHARE * own_error


def clip_by_value_run(cls, make_opt, steps=2):
    """Plain accelerate steps with accelerator.clip_grad_value_ (each rank its own batches)."""
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    acc = cls(cpu=True)
    model = gpt()
    model, opt = acc.prepare(model, make_opt(model))
    data = dataset(2 * BATCH * steps)
    for step in range(steps):
        acc.backward(model(**default_data_collator(data[(2 * step + pz.get_rank()) * BATCH:][:BATCH])).loss)
        acc.clip_grad_value_(model.parameters(), 1e-3)  # (the gradient elements reach 0.1: many are clipped)
        opt.step()
        opt.zero_grad()
    return weights(acc.unwrap_model(model))


def _rank_clip_by_value():
    hf.init(timeout=60)
    ddp = clip_by_value_run(accelerate.Accelerator, adamw)
    unclipped = torch.nn.utils.clip_grad_value_  # (the same run without value clipping, for scale)
    torch.nn.utils.clip_grad_value_ = lambda params, value, foreach=None: None
    try:
        ddp_unclipped = clip_by_value_run(accelerate.Accelerator, adamw)
    finally:
        torch.nn.utils.clip_grad_value_ = unclipped
    dp = clip_by_value_run(hf.PyzeroAccelerator, adamw)
    found = {stage: outcome(lambda stage=stage: clip_by_value_run(hf.PyzeroAccelerator, zero(stage)))
             for stage in (1, 2, 3)}
    torch.distributed.destroy_process_group()
    return {"ddp": ddp, "ddp_unclipped": ddp_unclipped, "dp": dp, "found": found}


def test_accelerate_clip_by_value(tmp_path):
    """accelerator.clip_grad_value_ on a pz.DataParallel model clips its averaged gradients as under DDP; on a
    ZeroOptimizer's parameters it would clip the local gradients before averaging (stage 1: 0.03 off in
    the weights after 2 steps) or fail inside torch (stages 2-3): a ValueError naming it, every rank."""
    ranks = [r.value for r in run_ranks(_rank_clip_by_value, 2, timeout=120)]
    got = ranks[0]
    assert max_diff(got["ddp_unclipped"], got["ddp"]) > 100 * TOL["atol"]  # the clipping matters
    assert_same_run({"loss": [], "grad_norm": [], "weights": got["dp"]},
                    {"loss": [], "grad_norm": [], "weights": got["ddp"]}, "dp, clip_grad_value_")
    for got in ranks:
        for stage, (kind, msg) in got["found"].items():
            assert kind == "ValueError" and msg.startswith("clip_grad_value_: a ZeroOptimizer") and \
                "clip_grad_norm_" in msg, (stage, msg)


# ---------------------------------------------------------------------------
# misuse and bad arguments


def _rank_misuse(out):
    hf.init(timeout=60)
    found = {}
    model = gpt()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR)
    found["trainer_zero"] = outcome(lambda: train(out, model=model, optimizers=(opt, None)))
    # (the Trainer reads the input names off DataParallel.forward(*args, **kwargs): keep every column)
    found["trainer_dp"] = outcome(lambda: train(out, model=pz.DataParallel(gpt()),
                                                args=dict(remove_unused_columns=False)))

    def plain_accelerate():
        m = gpt()
        o = pz.ZeroOptimizer(m, torch.optim.AdamW, stage=2, lr=LR)
        m, o = accelerate.Accelerator(cpu=True).prepare(m, o)
        m(**default_data_collator(dataset(BATCH))).loss.backward()
    found["accelerate_zero"] = outcome(plain_accelerate)
    m = gpt()
    o = pz.ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=LR)
    found["stage_mismatch"] = outcome(lambda: train(out, hf.PyzeroTrainer, model=m, optimizers=(o, None),
                                                   strategy="zero2"))
    found["plain_with_zero"] = outcome(lambda: train(out, hf.PyzeroTrainer, strategy="zero1",
                                                    optimizers=(adamw(gpt()), None)))
    # a scheduler of another optimizer beside the one the Trainer builds: its lr would never move
    other = torch.optim.lr_scheduler.LambdaLR(adamw(gpt()), lambda step: 0.5 ** step)
    found["foreign_scheduler"] = outcome(lambda: train(out, hf.PyzeroTrainer, strategy="zero2",
                                                      optimizers=(None, other)))

    def zero_fp16():
        AcceleratorState._reset_state(reset_partial_state=False)
        GradientState._reset_state()
        hf.PyzeroAccelerator(cpu=True, mixed_precision="fp16").prepare(zero(2)(gpt()))
    found["fp16"] = outcome(zero_fp16)
    return finish(found)


class StaleCheck(TrainerCallback):
    """At every evaluation: the largest difference between the weights the model holds and the
    ZeroOptimizer's fp32 masters (every rank calls it; the first rank gets the number)."""

    def __init__(self, opt):
        self.opt, self.diffs = opt, []

    def on_evaluate(self, args, state, control, model=None, **kwargs):
        self.diffs.append(stale(model, self.opt))


def stale(model, opt):
    masters = opt.full_state_dict()
    if masters is None:
        return None
    local = model.state_dict()
    return max((local[k].float() - v.float()).abs().max().item() for k, v in masters.items() if k in local)


class OwnAdamW(hf.PyzeroTrainer):
    """An override of create_optimizer that builds a plain optimizer under a ZeRO strategy."""

    def create_optimizer(self, model=None):
        self.optimizer = adamw(self.model)
        return self.optimizer


def _rank_settings_refused(out):
    """Trainer settings under which a ZeRO run would silently differ from the Trainer's DDP: refused, or
    (delayed_update) made right."""
    hf.init(timeout=60)
    found = {}
    model = gpt()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, param_groups=decay_groups(model), lr=LR,
                           offload="cpu", delayed_update=True)
    check = StaleCheck(opt)
    trainer = hf.PyzeroTrainer(model=model, optimizers=(opt, None), callbacks=[check], train_dataset=dataset(),
                               eval_dataset=dataset(8),
                               args=TrainingArguments(output_dir=out, use_cpu=True, report_to=[], disable_tqdm=True,
                                                      max_steps=STEPS, per_device_train_batch_size=BATCH,
                                                      learning_rate=LR, eval_strategy="steps", eval_steps=2,
                                                      save_strategy="no"))
    trainer.train()
    found["delayed"] = check.diffs + [stale(model, opt)]  # the evaluations during training, then after it
    zero_out = os.path.join(out, "zero")
    train(zero_out, hf.PyzeroTrainer, strategy="zero2", steps=2, save_steps=2)
    found["dp_resumes_zero"] = outcome(lambda: train(zero_out, hf.PyzeroTrainer, strategy="dp",
                                                     resume=os.path.join(zero_out, "checkpoint-2")))
    found["own_create_optimizer"] = outcome(lambda: train(out, OwnAdamW, strategy="zero2"))
    found["fp16_params"] = outcome(lambda: train(out, hf.PyzeroTrainer, strategy="zero2",
                                                 strategy_options={"param_dtype": torch.float16}))
    found["bf16_full_eval"] = outcome(lambda: train(out, hf.PyzeroTrainer, strategy="zero3",
                                                    args=dict(bf16_full_eval=True)))
    tp_model = gpt()
    tp_opt = pz.ZeroOptimizer(tp_model, torch.optim.AdamW, stage=2, lr=LR, tp_group=pz.new_group([0, 1]))
    found["tp_group"] = outcome(lambda: train(out, hf.PyzeroTrainer, model=tp_model, optimizers=(tp_opt, None)))
    return finish(found)


def test_trainer_settings_that_would_train_differently_are_refused_or_mended(tmp_path):
    found = run_ranks(_rank_settings_refused, 2, args=(str(tmp_path),), timeout=120)[0].value
    # delayed_update: evaluation and the model after train() see the current weights, not the step before's
    assert len(found["delayed"]) == STEPS // 2 + 1 and all(d == 0.0 for d in found["delayed"]), found["delayed"]
    expected = {"dp_resumes_zero": "resume_from_checkpoint: ", "own_create_optimizer": "create_optimizer: ",
                "fp16_params": "strategy_options: param_dtype: torch.float16 needs loss scaling",
                "bf16_full_eval": "bf16_full_eval: ", "tp_group": "optimizer: its tp_group"}
    for case, start in expected.items():
        kind, msg = found[case]
        assert kind == "ValueError" and msg.startswith(start), (case, kind, msg)
    assert "saved with ZeRO" in found["dp_resumes_zero"][1] and "OwnAdamW" not in found["own_create_optimizer"][1]


def _rank_misuse_one_process(out):
    """A plain single-process script: no DDP anywhere, so the accelerate mark is what gives it away."""
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)
    hf.init()
    model = gpt()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, param_groups=decay_groups(model), lr=LR, fused=True)
    found = {"trainer_zero": outcome(lambda: train(out, model=model, optimizers=(opt, None)))}
    found["ours"] = train(out, hf.PyzeroTrainer, strategy="zero2", steps=2)
    found["plain"] = train(out, steps=2)
    only = os.path.join(out, "only_model")  # save_only_model: the checkpoint's shards hold no optimizer state
    found["only_model"] = train(only, hf.PyzeroTrainer, strategy="zero2", steps=2, save_steps=2,
                                args=dict(save_only_model=True))
    step = os.path.join(only, "checkpoint-2", hf.CHECKPOINT_DIR, "step_00000002")
    with open(os.path.join(step, "meta.json")) as f:
        found["only_model/meta"] = json.load(f).get("optimizer_state")
    found["only_model/state"] = torch.load(os.path.join(step, "rank00000.pt"), weights_only=True)["state"]
    found["only_model/files"] = sorted(os.listdir(os.path.join(only, "checkpoint-2")))
    return found


def test_misuse_raises_and_names_the_integration(tmp_path):
    found = run_ranks(_rank_misuse, 2, args=(str(tmp_path),), timeout=120)[0].value
    for case in ("trainer_zero", "trainer_dp"):
        kind, msg = found[case]
        assert kind == "RuntimeError" and "DistributedDataParallel" in msg and "PyzeroTrainer" in msg, (case, msg)
        assert ("gradients ZeRO keeps in its shards" in msg) == (case == "trainer_zero"), (case, msg)
    kind, msg = found["accelerate_zero"]
    assert kind == "RuntimeError" and "PyzeroAccelerator" in msg, msg
    assert found["stage_mismatch"][0] == "ValueError" and "stage 3" in found["stage_mismatch"][1]
    assert found["plain_with_zero"][0] == "ValueError" and "optimizers" in found["plain_with_zero"][1]
    assert "optimizers=(None, scheduler)" not in found["plain_with_zero"][1]  # (that advice fails: see the next)
    kind, msg = found["foreign_scheduler"]
    assert kind == "ValueError" and "optimizers" in msg and "steps another optimizer" in msg, found["foreign_scheduler"]
    assert found["fp16"][0] == "ValueError" and "mixed_precision: 'fp16'" in found["fp16"][1]

    one = run_ranks(_rank_misuse_one_process, 1, args=(str(tmp_path),), timeout=60)[0].value
    kind, msg = one["trainer_zero"]
    assert kind == "RuntimeError" and "clips nothing" in msg and "PyzeroTrainer" in msg, msg
    assert_same_run(one["ours"], one["plain"], "one process")
    # save_only_model: the weights in pyzero/ (and the consolidated model), not the optimizer, scheduler or RNG
    assert one["only_model/meta"] is False and all(st == {} for st in one["only_model/state"]), one["only_model/meta"]
    files = one["only_model/files"]
    assert hf.CHECKPOINT_DIR in files and "model.safetensors" in files, files
    assert not {hf.SCHEDULER_NAME, "rng_state.pth", "optimizer.pt"} & set(files), files


def _rank_ddp_settings(out):
    """torch DDP settings given to the frameworks, which PyzeroAccelerator (no torch DDP) cannot honour."""
    from accelerate import DistributedDataParallelKwargs  # noqa: PLC0415
    from accelerate.utils import DDPCommunicationHookType  # noqa: PLC0415

    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)  # (one plain process, as _rank_misuse_one_process)
    found = {}
    for name, kw in [("bucket_cap_mb", {"bucket_cap_mb": 50}), ("broadcast_buffers", {"broadcast_buffers": False}),
                     ("comm_hook", {"comm_hook": DDPCommunicationHookType.FP16}),
                     ("find_unused_parameters", {"find_unused_parameters": True})]:  # (pz.DataParallel finds them)
        found[name] = outcome(lambda kw=kw: hf.PyzeroAccelerator(cpu=True,
                                                                 kwargs_handlers=[DistributedDataParallelKwargs(**kw)]))
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    for arg in ("ddp_bucket_cap_mb", "ddp_broadcast_buffers"):
        found[arg] = outcome(lambda arg=arg: train(out, hf.PyzeroTrainer, strategy="dp", steps=1,
                                                   args={arg: 50 if arg == "ddp_bucket_cap_mb" else False}))
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    # ddp_timeout: torch.distributed is already up (hf.init, the accelerators above: 300 s, pyzero's too)
    for timeout in (7200, 300):
        found[f"ddp_timeout={timeout}"] = outcome(lambda t=timeout: train(out, hf.PyzeroTrainer, strategy="zero2",
                                                                          steps=1, args={"ddp_timeout": t}))
    found["waits"] = pz.comm.get_timeout()
    return found


def test_torch_ddp_settings_are_refused_not_ignored(tmp_path):
    """A DistributedDataParallelKwargs setting that changes what torch DDP would do (its buckets, buffers or
    communication hook) is a ValueError naming it and pyzero's own option, not silently dropped; the
    Trainer's ddp_bucket_cap_mb and ddp_broadcast_buffers reach it the same way. Its ddp_timeout, which
    would start torch.distributed (hf.init started it already), is refused unless it is pyzero's timeout."""
    found = run_ranks(_rank_ddp_settings, 1, args=(str(tmp_path),), timeout=60)[0].value
    for name, option in [("bucket_cap_mb", "bucket_mb"), ("broadcast_buffers", "broadcast_buffers"),
                         ("comm_hook", "comm_dtype"), ("ddp_bucket_cap_mb", "bucket_mb"),
                         ("ddp_broadcast_buffers", "broadcast_buffers")]:
        kind, msg = found[name]
        assert kind == "ValueError" and "DistributedDataParallelKwargs" in msg and option in msg, (name, msg)
    assert found["find_unused_parameters"] == ("ok", None)
    # a ddp_timeout that would go unused: named, with where the timeout goes instead; pyzero's own is fine
    kind, msg = found["ddp_timeout=7200"]
    assert kind == "ValueError" and msg.startswith("ddp_timeout: 7200 s") and "init(timeout=7200)" in msg, msg
    assert found["waits"] == 300 and found["ddp_timeout=300"] == ("ok", None)


def _rank_launched_alone(out):
    """One process under a launcher (RANK, WORLD_SIZE=1, MASTER_PORT set, as torchrun --nproc-per-node 1
    sets them): TrainingArguments started torch.distributed on MASTER_PORT, which pyzero's store held."""
    hf.init()
    ours = train(out, hf.PyzeroTrainer, strategy="zero2", steps=2)
    return ours, train(out, steps=2), torch.distributed.is_initialized()


def test_one_launched_process_trains_as_the_plain_trainer(tmp_path):
    # (spawned: accelerate gives one process of a launched job 2 OpenMP threads, which hangs in a child forked
    # from a test process whose OpenMP pool has run)
    ours, plain, started = run_ranks(_rank_launched_alone, 1, args=(str(tmp_path),), timeout=120,
                                     start="spawn")[0].value
    assert started
    assert_same_run(ours, plain, "zero2 at world size 1 under a launcher")


def _rank_init_twice():
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(name)  # (one plain process)
    from pyzero.integrations import lightning as pzl  # noqa: PLC0415

    hf.init(backend="shm")
    return {"again": outcome(lambda: hf.init(backend="shm")), "other": outcome(lambda: hf.init(backend="nccl")),
            "default": outcome(hf.init), "lightning": outcome(lambda: pzl.init(backend="ipc"))}


def test_init_again_with_another_backend_names_it():
    """init() once pyzero runs: the same backend or none is fine; another was silently not used."""
    found = run_ranks(_rank_init_twice, 1, timeout=60)[0].value
    assert found["again"] == found["default"] == ("ok", None)
    for case, asked in (("other", "nccl"), ("lightning", "ipc")):
        kind, msg = found[case]
        assert kind == "ValueError" and f"asks for {asked!r}" in msg and "already started with backend 'shm'" in msg


def test_bad_arguments_name_the_argument():
    for kwargs, words in [(dict(strategy="zero4"), "strategy: expected one of"),
                          (dict(strategy="zero2", strategy_options={"stage": 3}), "strategy_options: 'stage'"),
                          (dict(strategy="dp", strategy_options={"offload": "cpu"}), "strategy_options: 'offload'"),
                          (dict(strategy="zero2", strategy_options={"prefetch": 0}),
                           "'prefetch' .*a ZeRO stage-3 option, and the strategy is stage 2"),
                          (dict(strategy="zero1", strategy_options={"zero_quantized_weights": True}),
                           "'zero_quantized_weights' .*stage-3 option"),
                          (dict(strategy_options={"bucket_mb": 1}), "strategy_options: they configure"),
                          (dict(strategy="zero2", strategy_options=[1]), "strategy_options: expected a dict"),
                          # (an AttributeError and a TypeError from sorting the names before)
                          (dict(strategy="zero2", strategy_options={1: 2}),
                           "strategy_options: 1 is not an option name"),
                          (dict(strategy="dp", strategy_options={"bucket_mb": 1, None: 2}),
                           "strategy_options: None is not an option name")]:
        with pytest.raises((ValueError, TypeError), match=words):
            hf.PyzeroTrainer(**kwargs)


def test_frameworks_collectives_go_where_the_gpus_allow(monkeypatch):
    """The torch backend hf.init (and PyzeroStrategy) start beside each pyzero backend: CUDA tensors on
    NCCL with a GPU per process, on "pyzero" where processes share a GPU (NCCL refuses two ranks on
    one device); a group of that kind carries CPU collectives (here at 2 CPU ranks)."""
    expected = {"shm": "gloo", "nccl": "cpu:gloo,cuda:nccl", "ipc": "cpu:gloo,cuda:pyzero"}
    for backend, torch_backend in expected.items():
        monkeypatch.setattr(pz.comm, "get_backend", lambda b=backend: b)
        assert pz.distributed.default_torch_backend() == torch_backend, backend
    monkeypatch.undo()
    got = run_ranks(_rank_mixed_group, 2, timeout=60)
    assert [r.value for r in got] == [("cpu:gloo,cuda:pyzero", [3.0, 3.0])] * 2


def _rank_mixed_group():
    hf.init(timeout=30, torch_backend="cpu:gloo,cuda:pyzero")
    t = torch.full((2,), pz.get_rank() + 1.0)
    torch.distributed.all_reduce(t)
    backend = str(torch.distributed.get_backend())
    torch.distributed.destroy_process_group()
    return backend, t.tolist()


def _rank_generate_stage3():
    """Greedy generation from a ZeRO stage-3 model whose ranks stop at different lengths, with
    synced_gpus=True; then a training step (the gathers still match across the ranks)."""
    hf.init(timeout=30)
    model, plain = gpt(), gpt()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3)
    prompt = torch.tensor([[5 + pz.get_rank(), 7, 9]])
    new = 8 if pz.get_rank() == 0 else 3  # rank 1 is done first and keeps running forwards for rank 0
    got = model.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0, synced_gpus=True)
    want = plain.generate(prompt, max_new_tokens=new, do_sample=False, pad_token_id=0)
    ids = dataset(2)[pz.get_rank()]["input_ids"][None]
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    torch.distributed.destroy_process_group()
    return got.tolist(), want.tolist()


def test_generate_from_a_stage3_model_with_synced_gpus():
    for r in run_ranks(_rank_generate_stage3, 2, timeout=60):
        got, want = r.value
        assert got == want and len(got[0]) == 3 + (8 if r.rank == 0 else 3), (r.rank, got, want)


class Seq2Seq(hf.PyzeroTrainer, transformers.Seq2SeqTrainer):
    """PyzeroTrainer mixed with Seq2SeqTrainer (predict_with_generate): records generate's synced_gpus."""

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        seen, generate = self.synced, model.generate

        def recorded(*args, **kwargs):
            seen.append(kwargs.get("synced_gpus"))
            return generate(*args, **kwargs)
        model.generate = recorded
        try:
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)
        finally:
            del model.generate


def _rank_seq2seq(out):
    hf.init(timeout=60)
    args = transformers.Seq2SeqTrainingArguments(
        output_dir=out, use_cpu=True, report_to=[], disable_tqdm=True, seed=0, max_steps=2,
        per_device_train_batch_size=BATCH, per_device_eval_batch_size=2, learning_rate=LR, predict_with_generate=True,
        generation_max_length=SEQ)  # prompts of SEQ / 2 tokens: as many new ones, within GPT-2's positions
    got = {}
    for strategy in ("ddp", "zero2", "zero3"):
        kind = transformers.Seq2SeqTrainer if strategy == "ddp" else Seq2Seq
        model = gpt()
        model.config.pad_token_id = model.generation_config.pad_token_id = 0  # (Seq2SeqTrainer pads with it)
        trainer = kind(model=model, args=args, train_dataset=dataset(), **({} if strategy == "ddp" else
                                                                           {"strategy": strategy}))
        trainer.synced = []
        trainer.train()
        prompts = [{k: v[:SEQ // 2] for k, v in row.items()} for row in dataset(8)]
        predicted = trainer.predict(prompts).predictions
        got[strategy] = predicted.tolist(), trainer.synced
    return finish(got)


def test_seq2seq_trainer_generates_from_stage3_with_synced_gpus(tmp_path):
    """Seq2SeqTrainer's predict_with_generate: ZeRO-3 generates with synced_gpus=True (its ranks must
    run the same forwards), ZeRO-2 as transformers decides (False); the predictions are DDP's."""
    got = run_ranks(_rank_seq2seq, 2, args=(str(tmp_path),), timeout=120)[0].value
    ref, _ = got.pop("ddp")
    for strategy, (predicted, synced) in got.items():
        assert predicted == ref, strategy
        assert synced and set(synced) == {strategy == "zero3"}, (strategy, synced)
