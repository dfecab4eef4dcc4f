"""opt.gathered_parameters(): a ZeroOptimizer's parameters whole on every rank inside a block, what the block
writes kept (every stage, against plain torch doing the same on the full batch)."""
import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks

from outcomes import outcome

STAGES = (1, 2, 3)
LR = 0.05


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def data(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def train_step(model, opt, step, world=1, rank=0):
    x, y = data(step)
    x, y = x.chunk(world)[rank], y.chunk(world)[rank]
    opt.zero_grad()
    F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
    opt.step()


def halve(model):
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)


def torch_ema_run():
    """Plain torch: two steps, the weights' norms, every weight halved, two more steps."""
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(2):
        train_step(model, opt, step)
    norms = [float(p.detach().norm()) for p in model.parameters()]
    halve(model)
    for step in range(2, 4):
        train_step(model, opt, step)
    return norms, {k: v.clone() for k, v in model.state_dict().items()}


def zero(model, stage, **kw):
    return pz.ZeroOptimizer(model, torch.optim.Adam, stage=stage, lr=LR, **kw)


def ema_run(stage, world, rank, **kw):
    model = build()
    opt = zero(model, stage, **kw)
    for step in range(2):
        train_step(model, opt, step, world, rank)
    with torch.no_grad(), opt.gathered_parameters():
        norms = [float(p.norm()) for p in model.parameters()]
        halve(model)
    for step in range(2, 4):
        train_step(model, opt, step, world, rank)
    return norms, opt.full_state_dict()


def bf16_runs(stage, world, rank, **kw):
    """param_dtype=bf16 (fp32 masters): a read-only block changes nothing; a halving takes the bf16 values of
    the changed elements only."""
    out = {}
    for block in ("none", "read", "qw_none", "qw_read"):
        if block.startswith("qw") and stage != 3:
            continue
        model = build()
        extra = dict(zero_quantized_weights=True) if block.startswith("qw") else {}
        opt = zero(model, stage, param_dtype=torch.bfloat16, **extra, **kw)
        for step in range(2):
            train_step(model, opt, step, world, rank)
        if block.endswith("read"):
            with torch.no_grad(), opt.gathered_parameters():
                sum(float(p.float().sum()) for p in model.parameters())
        for step in range(2, 4):
            train_step(model, opt, step, world, rank)
        out[block] = opt.full_state_dict()
    return out


def rank_cases():
    pz.init(timeout=20)
    world, rank = pz.get_world_size(), pz.get_rank()
    out = {}
    for stage in STAGES:
        o = out[stage] = {}
        o["ema"] = ema_run(stage, world, rank)
        o["bf16"] = bf16_runs(stage, world, rank)
        # the module-level function finds the optimizer from the parameters
        model = build()
        opt = zero(model, stage)
        with torch.no_grad(), pz.zero.gathered_parameters(model[0].weight):
            o["one"] = model[0].weight.clone()
        # modifier_rank: every rank draws its own values; rank 1's are the ones kept
        with torch.no_grad(), opt.gathered_parameters([model[2].weight], modifier_rank=1):
            model[2].weight.copy_(torch.randn(3, 7, generator=torch.Generator().manual_seed(rank)))
        with torch.no_grad(), opt.gathered_parameters():
            o["modified"] = [p.clone() for p in model.parameters()]
            o["forward"] = model(torch.ones(2, 5))  # a forward inside the block frees nothing of it
            o["after_forward"] = [p.clone() for p in model.parameters()]
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # (no ShardedParametersWarning: the values are whole here)
                o["state_dict"] = {k: v.clone() for k, v in model.state_dict().items()}
        o["modified_full"] = opt.full_state_dict()
        # without modifier_rank, ranks that change it differently: an error on every rank
        o["diverged"] = outcome(lambda: _draw_own(opt, model, rank))
        # a NaN held alike on every rank is no difference between them
        with torch.no_grad(), opt.gathered_parameters(modifier_rank=0):
            model[0].bias[0] = float("nan")
        o["nan_read"] = outcome(lambda: _read(opt, model))
        # nothing may keep a gathered parameter for backward
        o["saved"] = outcome(lambda: _forward_in_block(opt, model))
        o["bad_param"] = outcome(lambda: opt.gathered_parameters([torch.zeros(3)]).__enter__())
        o["bad_modifier"] = outcome(lambda: opt.gathered_parameters(modifier_rank=world).__enter__())
        o["unlike"] = outcome(lambda: opt.gathered_parameters([model[2 * rank].weight]).__enter__())
        # an exception inside the block leaves it (stage 3: its units freed again); training goes on
        model = build()
        opt = zero(model, stage)
        train_step(model, opt, 0, world, rank)
        o["raised"] = outcome(lambda: _raise_in_block(opt, model))
        train_step(model, opt, 1, world, rank)
        o["after_raise"] = opt.full_state_dict()
        o["freed"] = stage < 3 or all(bool(torch.isnan(p.detach().clone()).all()) for p in model.parameters())
    # a model loaded after the optimizer was built: rank 0's state dict, kept by every rank
    model = build()
    opt = zero(model, 3)
    sd = {k: torch.full_like(v, float(rank + 2)) for k, v in model.state_dict().items()}
    with torch.no_grad(), opt.gathered_parameters(modifier_rank=0):
        model.load_state_dict(sd)
    out["loaded"] = opt.full_state_dict()
    # offload with delayed_update (its step runs on a thread): the block sees the last step's values
    model = build()
    opt = zero(model, 2, offload="cpu", delayed_update=True)
    for step in range(3):
        train_step(model, opt, step, world, rank)
    with torch.no_grad(), opt.gathered_parameters():
        in_block = [p.clone() for p in model.parameters()]
    out["delayed"] = in_block, opt.full_state_dict()
    pz.destroy()
    return out


def ema_copy_run(stage, world, rank):
    """timm's and YOLO's order: the optimizer, then the EMA as a deep copy of the model (stage 3: in a block),
    updated in a block after every step, evaluated on its own."""
    model = build()
    opt = zero(model, stage)
    with torch.no_grad(), opt.gathered_parameters():
        ema = copy.deepcopy(model)
        buf = io.BytesIO()
        torch.save(model, buf)  # the whole module pickled: a plain model too once loaded
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    pz.comm_stats(reset=True)
    with torch.no_grad():
        first = ema(torch.ones(2, 5))  # a plain model: no gathers for it
        first_loaded = loaded(torch.ones(2, 5))
    calls = {op: c["calls"] for op, c in pz.comm_stats(reset=True).items() if c["calls"]}
    for step in range(3):
        train_step(model, opt, step, world, rank)
        with torch.no_grad(), opt.gathered_parameters():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 0.5)
    with torch.no_grad():
        out = ema(torch.ones(2, 5))
    return {"first": first, "first_loaded": first_loaded, "calls": calls, "ema": ema.state_dict(), "eval": out,
            "model": opt.full_state_dict(),
            "copy_opt": outcome(lambda: copy.deepcopy(opt))}


def torch_ema_copy_run():
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    ema = copy.deepcopy(model)
    first = ema(torch.ones(2, 5)).detach()
    for step in range(3):
        train_step(model, opt, step)
        with torch.no_grad():
            for e, p in zip(ema.parameters(), model.parameters()):
                e.lerp_(p, 0.5)
    return {"first": first, "ema": ema.state_dict(), "eval": ema(torch.ones(2, 5)).detach(),
            "model": model.state_dict()}


def rank_copies():
    pz.init(timeout=20)
    world, rank = pz.get_world_size(), pz.get_rank()
    out = {stage: ema_copy_run(stage, world, rank) for stage in STAGES}
    # stage 3 copied outside a block: its parameters are the freed units' NaN, refused at its forward
    model = build()
    zero(model, 3)
    freed = copy.deepcopy(model)
    out["freed_forward"] = outcome(lambda: freed(torch.ones(2, 5)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        freed.state_dict()
    out["freed_state_dict"] = [(w.category.__name__, str(w.message)) for w in caught]
    # a freed parameter given a tensor of its own: the next gather would drop it, the step never reach it
    model = build()
    zero(model, 3)
    model[2].bias.data = torch.zeros(3)
    out["replaced"] = outcome(lambda: model(torch.ones(2, 5)))
    pz.destroy()
    return out


@pytest.fixture(scope="module")
def copies():
    return run_ranks(rank_copies, 2, timeout=60)[0].value


@pytest.mark.parametrize("stage", STAGES)
def test_a_deep_copy_of_the_model_is_a_plain_model(copies, stage):
    """copy.deepcopy(model) after the optimizer was built (an EMA), or torch.save(model) loaded again: a plain
    model with the weights, no part in the optimizer's training (no gathers for its forward); the optimizer
    itself refuses to be copied."""
    got, want = copies[stage], torch_ema_copy_run()
    torch.testing.assert_close(got["first"], want["first"], rtol=0, atol=0)
    torch.testing.assert_close(got["first_loaded"], want["first"], rtol=0, atol=0)
    assert got["calls"] == {}, got["calls"]
    for key in ("ema", "model"):
        close(got[key], want[key], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got["eval"], want["eval"], rtol=1e-5, atol=1e-6)
    kind, msg = got["copy_opt"]
    assert kind == "TypeError" and "copy.deepcopy of a ZeroOptimizer" in msg and "pz.checkpoint" in msg, msg


def test_a_stage3_parameter_given_new_storage_is_refused(copies):
    kind, msg = copies["replaced"]
    assert kind == "RuntimeError" and msg.startswith("model: parameters ['2.bias'] were given new storage"), msg
    assert "gathered_parameters()" in msg


def test_a_copy_of_freed_stage3_parameters_is_refused(copies):
    kind, msg = copies["freed_forward"]
    assert kind == "RuntimeError" and msg.startswith("Linear parameter 'weight': a copy of a ZeRO stage-3 model"), msg
    assert "opt.gathered_parameters()" in msg
    [(kind, msg)] = copies["freed_state_dict"]
    assert kind == "ShardedParametersWarning" and "'0.weight'" in msg and "NaN" in msg, msg


def _draw_own(opt, model, rank):
    with torch.no_grad(), opt.gathered_parameters(model[0].bias):
        model[0].bias.copy_(torch.randn(7, generator=torch.Generator().manual_seed(rank)))


def _read(opt, model):
    with torch.no_grad(), opt.gathered_parameters():
        assert torch.isnan(model[0].bias[0]) and not torch.isnan(model[0].bias[1:]).any()


def _forward_in_block(opt, model):
    with opt.gathered_parameters():
        model(torch.ones(2, 5)).sum().backward()


def _raise_in_block(opt, model):
    with opt.gathered_parameters():
        raise KeyError("inside")


@pytest.fixture(scope="module")
def cases():
    return [r.value for r in run_ranks(rank_cases, 2, timeout=120)]


def close(got: dict, want: dict, **tol):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("stage", STAGES)
def test_weights_read_and_changed_in_a_block_as_plain_torch(cases, stage):
    norms, state = torch_ema_run()
    got_norms, got_state = cases[0][stage]["ema"]
    torch.testing.assert_close(torch.tensor(cases[1][stage]["ema"][0]), torch.tensor(norms), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(norms), rtol=1e-6, atol=0)
    close(got_state, state, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("stage", STAGES)
def test_a_read_only_block_leaves_the_fp32_masters_exact(cases, stage):
    runs = cases[0][stage]["bf16"]
    close(runs["read"], runs["none"], rtol=0, atol=0)
    if stage == 3:  # quantised gathers (qwZ): the dequantised values read are not written back either
        close(runs["qw_read"], runs["qw_none"], rtol=0, atol=0)
        assert any(not torch.equal(runs["qw_none"][k], v) for k, v in runs["none"].items())  # (they differ)


@pytest.mark.parametrize("stage", STAGES)
def test_modifier_rank_s_values_are_every_rank_s(cases, stage):
    want_w = torch.randn(3, 7, generator=torch.Generator().manual_seed(1))
    base = build()
    for rank, c in enumerate(cases):
        o = c[stage]
        torch.testing.assert_close(o["one"], base[0].weight.detach(), rtol=0, atol=0)
        want = [p.detach() for p in base.parameters()]
        want[2] = want_w
        for got, w in zip(o["modified"], want):
            torch.testing.assert_close(got, w, rtol=0, atol=0)
        for got, w in zip(o["after_forward"], want):
            torch.testing.assert_close(got, w, rtol=0, atol=0)
        for got, w in zip(o["state_dict"].values(), want):
            torch.testing.assert_close(got, w, rtol=0, atol=0)
        base_mod = build()
        with torch.no_grad():
            base_mod[2].weight.copy_(want_w)
            torch.testing.assert_close(o["forward"], base_mod(torch.ones(2, 5)), rtol=1e-6, atol=1e-6)
        if rank == 0:
            torch.testing.assert_close(o["modified_full"]["2.weight"], want_w, rtol=0, atol=0)


@pytest.mark.parametrize("stage", STAGES)
def test_misuse_is_an_error_on_every_rank(cases, stage):
    for c in cases:
        o = c[stage]
        kind, msg = o["diverged"]
        assert kind == "RuntimeError" and "changed the parameters differently" in msg and "modifier_rank" in msg
        assert o["nan_read"] == ("ok", None), o["nan_read"]
        kind, msg = o["saved"]
        assert kind == "RuntimeError" and "saved a gathered parameter for backward" in msg and "no_grad" in msg
        kind, msg = o["bad_param"]
        assert kind == "ValueError" and msg.startswith("params: item 0 (Tensor) is not a parameter"), msg
        kind, msg = o["bad_modifier"]
        assert kind == "ValueError" and msg.startswith("modifier_rank: expected") and "got 2" in msg, msg
        kind, msg = o["unlike"]
        assert kind == "ValueError" and "entered it with different params" in msg, msg


@pytest.mark.parametrize("stage", STAGES)
def test_an_exception_in_the_block_frees_what_it_gathered_and_training_goes_on(cases, stage):
    model = build()
    opt = torch.optim.Adam(model.parameters(), lr=LR)
    for step in range(2):
        train_step(model, opt, step)
    o = cases[0][stage]
    assert o["raised"] == ("KeyError", "'inside'")
    assert all(c[stage]["freed"] for c in cases)
    close(o["after_raise"], model.state_dict(), rtol=1e-5, atol=1e-6)


def rank_one():
    pz.init()
    return {stage: (ema_run(stage, 1, 0), bf16_runs(stage, 1, 0)) for stage in STAGES}


@pytest.fixture(scope="module")
def one():
    return run_ranks(rank_one, 1, timeout=60)[0].value


@pytest.mark.parametrize("stage", STAGES)
def test_one_rank(one, stage):
    """At one rank stage 3's parameters are its shard (never freed); a bf16 model's masters stay apart."""
    (got_norms, got_state), bf16 = one[stage]
    norms, state = torch_ema_run()
    torch.testing.assert_close(torch.tensor(got_norms), torch.tensor(norms), rtol=1e-6, atol=0)
    close(got_state, state, rtol=1e-5, atol=1e-6)
    close(bf16["read"], bf16["none"], rtol=0, atol=0)


def test_load_state_dict_in_a_block_after_the_optimizer_was_built(cases):
    model = build()
    for k, v in cases[0]["loaded"].items():
        torch.testing.assert_close(v, torch.full_like(model.state_dict()[k], 2.0), rtol=0, atol=0)


def test_delayed_update_block_sees_the_last_step(cases):
    # delayed_update: a step's parameters land during the next one (DeepSpeed's DPU); the block waits for the last
    in_block, full = cases[0]["delayed"]
    for got, (k, want) in zip(in_block, full.items()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=k)
    assert not torch.equal(full["0.weight"], build()[0].weight.detach())
