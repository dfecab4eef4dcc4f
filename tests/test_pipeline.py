"""Pipeline parallelism: balanced splits, GPipe / 1F1B schedules, DP x PP.

Every pipelined loss and gradient is compared with a single-process
plain-torch run of the same seeded nn.Sequential on the full batch; splits
with a brute-force search; schedules with a dependency simulation written
here, independent of the library's execution.
"""
import contextlib
import itertools
import random
import re
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks
from pyzero.pipeline.schedules import SCHEDULES

TOL = dict(rtol=1e-5, atol=1e-6)
IN, HIDDEN, OUT = 6, 16, 5
LR = 0.1


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def make_batch(seed, batch, loss):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, IN, generator=g)
    y = torch.randint(0, OUT, (batch,), generator=g) if loss == "ce" else torch.randn(batch, OUT, generator=g)
    return x, y


LOSSES = {"mse": F.mse_loss, "ce": F.cross_entropy}


def steps_for(m):
    """(seed, batch size) per step; the third changes the micro-batch shape, so headers go again."""
    return [(1, 2 * m), (2, 2 * m), (3, 3 * m)]


def sgd_(params):
    with torch.no_grad():
        for p in params:
            p -= LR * p.grad
            p.grad = None


def reference(m, loss):
    """Loss and gradients of each step of plain full-batch training."""
    model, out = make_model(), []
    for seed, batch in steps_for(m):
        x, y = make_batch(seed, batch, loss)
        value = LOSSES[loss](model(x), y)
        value.backward()
        out.append((value.item(), {n: p.grad.clone() for n, p in model.named_parameters()}))
        sgd_(model.parameters())
    return out


# ---------------------------------------------------------------------------
# split_sequential


def brute_force_max(costs, k):
    n = len(costs)
    return min(max(sum(costs[a:b]) for a, b in zip((0, *cuts), (*cuts, n)))
               for cuts in itertools.combinations(range(1, n), k - 1))


def test_split_is_optimal_against_brute_force():
    rng = random.Random(0)
    for _ in range(150):
        n = rng.randint(1, 8)
        costs = [rng.choice([0, rng.randint(0, 20), rng.random() * 10]) for _ in range(n)]
        for k in range(1, n + 1):
            cuts = pz.pipeline.balanced_cuts(costs, k)
            assert cuts[0] == 0 and cuts[-1] == n and len(cuts) == k + 1
            assert all(a < b for a, b in zip(cuts, cuts[1:])), (costs, k, cuts)  # contiguous, non-empty
            got = max(sum(costs[a:b]) for a, b in zip(cuts, cuts[1:]))
            assert got == pytest.approx(brute_force_max(costs, k), rel=1e-12), (costs, k, cuts)


def test_split_sequential_by_params_and_costs():
    seq = make_model()  # parameters per layer: 112, 0, 272, 0, 272, 0, 85
    params = [sum(p.numel() for p in layer.parameters()) for layer in seq]
    for k in range(1, len(seq) + 1):
        stages = pz.pipeline.split_sequential(seq, k)
        assert [s.pipeline_stage for s in stages] == [(i, k) for i in range(k)]
        layers = [layer for s in stages for layer in s]
        assert len(layers) == len(seq) and all(a is b for a, b in zip(layers, seq))  # the same layers, in order
        assert all(len(s) > 0 for s in stages)
        sizes = [sum(p.numel() for p in s.parameters()) for s in stages]
        assert max(sizes) == brute_force_max(params, k)
    # zero-cost activations stay with the layer before them; names are kept
    stages = pz.pipeline.split_sequential(seq, 2)
    assert [list(dict(s.named_children())) for s in stages] == [["0", "1", "2", "3"], ["4", "5", "6"]]
    assert set(stages[1].state_dict()) == {"4.weight", "4.bias", "6.weight", "6.bias"}
    # user costs override parameter counts
    costs = [1, 1, 1, 1, 1, 1, 10]
    stages = pz.pipeline.split_sequential(seq, 2, costs=costs)
    assert [len(s) for s in stages] == [6, 1]


def test_split_keeps_a_layer_that_comes_twice_and_refuses_state_shared_across_stages():
    """A stateless layer used twice (one ReLU object) stays at both places (it was dropped from the second:
    named_children() skips a module it has seen); a layer with parameters used in two stages is refused."""
    torch.manual_seed(0)
    act = nn.ReLU()
    seq = nn.Sequential(nn.Linear(4, 8), act, nn.Linear(8, 8), act, nn.Linear(8, 2))
    x = torch.randn(3, 4)
    for k in (1, 2, 3):
        stages = pz.pipeline.split_sequential(seq, k)
        assert sum(len(st) for st in stages) == 5, [list(st._modules) for st in stages]
        y = x
        for st in stages:
            y = st(y)
        torch.testing.assert_close(y, seq(x), rtol=0, atol=0)
    lin = nn.Linear(8, 8)
    tied = nn.Sequential(nn.Linear(4, 8), lin, nn.Tanh(), lin, nn.Linear(8, 2))
    assert sum(len(st) for st in pz.pipeline.split_sequential(tied, 1)) == 5
    with pytest.raises(ValueError, match=r"seq: layers '1' \(stage 0\) and '3' \(stage 1\) share a parameter"):
        pz.pipeline.split_sequential(tied, 2, costs=[1, 1, 1, 1, 1])


def test_split_errors():
    seq = make_model()
    with pytest.raises(ValueError, match="num_stages"):
        pz.pipeline.split_sequential(seq, 0)
    with pytest.raises(ValueError, match=r"num_stages.*len\(seq\) = 7"):
        pz.pipeline.split_sequential(seq, 8)
    with pytest.raises(TypeError, match="num_stages"):
        pz.pipeline.split_sequential(seq, 2.0)
    with pytest.raises(TypeError, match="seq: expected an nn.Sequential"):
        pz.pipeline.split_sequential(nn.Linear(2, 2), 1)
    with pytest.raises(ValueError, match="costs: expected 7 numbers"):
        pz.pipeline.split_sequential(seq, 2, costs=[1, 2, 3])
    with pytest.raises(ValueError, match=r"costs\[2\]: expected a finite cost >= 0, got -1"):
        pz.pipeline.split_sequential(seq, 2, costs=[1, 1, -1, 1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"costs\[0\]"):
        pz.pipeline.split_sequential(seq, 2, costs=[float("nan")] * 7)
    with pytest.raises(TypeError, match=r"costs\[1\]"):
        pz.pipeline.split_sequential(seq, 2, costs=[1, "2", 3, 4, 5, 6, 7])


def test_public_helpers_refuse_what_they_cannot_mean():
    """balanced_cuts, the schedules and bubble_fraction are public: out of range they returned an
    empty stage ([0, 1, 2, 2] for 3 stages of 2 layers), negative micro-batch indices or a negative
    bubble without a word."""
    P = pz.pipeline
    assert P.balanced_cuts([1, 2, 3], 2) == [0, 2, 3]
    too_many = r"num_stages: expected 1 <= num_stages <= len\(costs\) = 2"
    cases = [(lambda: P.balanced_cuts([1, 2], 3), ValueError, too_many),
             (lambda: P.balanced_cuts([1, 2], 0), ValueError, too_many),
             (lambda: P.balanced_cuts([1, 2], 2.0), TypeError, "num_stages: expected an int"),
             (lambda: P.balanced_cuts([1, "a"], 1), TypeError, r"costs\[1\]: expected a number"),
             (lambda: P.one_f_one_b(5, 4, 2), ValueError, r"stage: expected 0 <= stage < num_stages = 4, got 5"),
             (lambda: P.gpipe(-1, 4, 2), ValueError, r"stage: expected 0 <= stage < num_stages = 4, got -1"),
             (lambda: P.gpipe(0, 4, 0), ValueError, "num_microbatches: expected an int >= 1, got 0"),
             (lambda: P.one_f_one_b(0, 0, 2), ValueError, "num_stages: expected an int >= 1, got 0"),
             (lambda: P.bubble_fraction(0, 4), ValueError, "num_stages: expected an int >= 1, got 0"),
             (lambda: P.bubble_fraction(2, 0), ValueError, "num_microbatches: expected an int >= 1, got 0")]
    for fn, kind, pattern in cases:
        with pytest.raises(kind, match=pattern):
            fn()
    assert P.bubble_fraction(4, 4) == pytest.approx(3 / 7)


# ---------------------------------------------------------------------------
# Schedules, simulated: unit-time forwards and backwards with their dependencies


def simulate(name, p, m):
    """Run every stage's action list against the data dependencies; (finish time, peak held per stage)."""
    actions = [SCHEDULES[name](i, p, m) for i in range(p)]
    done, pos, free = {}, [0] * p, [0] * p
    held, peak = [0] * p, [0] * p
    while any(pos[i] < len(actions[i]) for i in range(p)):
        moved = False
        for i in range(p):
            if pos[i] == len(actions[i]):
                continue
            op, j = actions[i][pos[i]]
            if op == "F":
                dep = (i - 1, "F", j) if i > 0 else None
            else:
                dep = (i + 1, "B", j) if i < p - 1 else (i, "F", j)
            if dep is not None and dep not in done:
                continue
            free[i] = done[(i, op, j)] = max(free[i], done.get(dep, 0)) + 1
            held[i] += 1 if op == "F" else -1
            peak[i] = max(peak[i], held[i])
            pos[i], moved = pos[i] + 1, True
        assert moved, f"{name} deadlocks at p={p}, m={m}"
    assert all(sorted(a) == sorted([("F", j) for j in range(m)] + [("B", j) for j in range(m)]) for a in actions)
    return max(free), peak


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_schedules_bubble_and_memory(name):
    for p in range(1, 6):
        for m in range(1, 10):
            finish, peak = simulate(name, p, m)
            # each stage is busy 2m of the makespan: the bubble is the closed form
            assert finish == 2 * (m + p - 1)
            assert 1 - 2 * m / finish == pytest.approx(pz.pipeline.bubble_fraction(p, m))
            assert peak == ([m] * p if name == "gpipe" else [min(p - i, m) for i in range(p)])


# ---------------------------------------------------------------------------
# Point-to-point groups: deadlock-free where a send waits for its receiver (NCCL)


def p2p_groups(policy, name, p, m, header):
    """Each stage's groups of (send|recv, peer stage, message) under `policy`, with the messages
    Pipeline exchanges: activations (and, at micro-batch 0, a header) down, gradients up."""
    per_stage = []
    for s in range(p):
        acts = SCHEDULES[name](s, p, m)

        def needs(i, s=s, acts=acts):
            op, j = acts[i]
            if op == "F":
                return [] if s == 0 else ([("header", j)] if header and j == 0 else []) + [("act", j)]
            return [] if s == p - 1 else [("grad", j)]

        def produces(i, s=s, acts=acts):
            op, j = acts[i]
            if op == "F":
                return [] if s == p - 1 else ([("header", j)] if header and j == 0 else []) + [("act", j)]
            return [] if s == 0 else [("grad", j)]

        groups = []
        for step in policy(len(acts), needs, produces):
            if step[0] == "p2p":
                sends, recvs = step[1], step[2]
                groups.append([("send", s - 1 if k[0] == "grad" else s + 1, k) for k in sends]
                              + [("recv", s + 1 if k[0] == "grad" else s - 1, k) for k in recvs])
        per_stage.append(groups)
    return per_stage


def stuck_stages(per_stage):
    """Rendezvous semantics: a send and its receive complete together, and only while the groups
    holding them are both active; each stage runs its groups one after another. Returns the
    stages that can never finish (empty: no deadlock)."""
    pos, matched = [0] * len(per_stage), [set() for _ in per_stage]
    while True:
        moved = False
        for s, groups in enumerate(per_stage):
            if pos[s] == len(groups):
                continue
            for k, (kind, peer, key) in enumerate(groups[pos[s]]):
                if k in matched[s] or pos[peer] == len(per_stage[peer]):
                    continue
                other = per_stage[peer][pos[peer]]
                want = ("recv" if kind == "send" else "send", s, key)
                if want in other:
                    matched[s].add(k)
                    matched[peer].add(other.index(want))
                    moved = True
        for s, groups in enumerate(per_stage):
            if pos[s] < len(groups) and len(matched[s]) == len(groups[pos[s]]):
                pos[s], matched[s], moved = pos[s] + 1, set(), True
        if not moved:
            return [s for s in range(len(per_stage)) if pos[s] < len(per_stage[s])]


def one_op_per_call(num_actions, needs, produces):
    """Each receive just before its action, each send right after it, one call each (no groups)."""
    for i in range(num_actions):
        for r in needs(i):
            yield "p2p", [], [r]
        yield "run", i
        for snd in produces(i):
            yield "p2p", [snd], []


def test_grouped_p2p_never_deadlocks_where_sends_wait_for_receivers():
    from pyzero.pipeline.schedules import comm_steps
    for name in SCHEDULES:
        for p in range(2, 7):
            for m in range(1, 9):
                for header in (False, True):
                    groups = p2p_groups(comm_steps, name, p, m, header)
                    assert stuck_stages(groups) == [], (name, p, m, header)
                    sent = sum(op[0] == "send" for g in groups for grp in g for op in grp)
                    assert sent == (p - 1) * (2 * m + header)  # every message exactly once
    # the check can fail: one call per message deadlocks 1F1B (two neighbours both send first)
    assert stuck_stages(p2p_groups(one_op_per_call, "1f1b", 2, 2, False)) == [0, 1]


# ---------------------------------------------------------------------------
# Multi-rank: pipelined training vs the single-process reference


def rank_train(loss, m):
    """Three steps (with an SGD update between) per schedule; per schedule: losses, grads, stats, sends."""
    pz.init()
    n, r = pz.get_world_size(), pz.get_rank()
    out = {}
    for schedule in ("gpipe", "1f1b"):
        model = make_model()
        stage = pz.pipeline.split_sequential(model, n)[r]
        pipe = pz.pipeline.Pipeline(stage, m, schedule)
        rec = {"losses": [], "grads": [], "sends": [], "inflight": [], "stats": None}
        for seed, batch in steps_for(m):
            x, y = make_batch(seed, batch, loss)
            pz.comm_stats(reset=True)
            value = pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, LOSSES[loss])
            rec["sends"].append(pz.comm_stats().get("send", {}).get("calls", 0))
            rec["losses"].append(value)
            rec["grads"].append({name: p.grad.clone() for name, p in stage.named_parameters()})
            rec["inflight"].append(pipe.stats.max_inflight)
            sgd_(stage.parameters())
        rec["stats"] = pipe.stats
        out[schedule] = rec
    return out


def check_train(results, m, loss):
    ref = reference(m, loss)
    p = len(results)
    for res in results:
        i = res.rank
        for schedule, rec in res.value.items():
            where = f"stage {i}, {schedule}"
            for step, (ref_loss, ref_grads) in enumerate(ref):
                if i == p - 1:
                    assert rec["losses"][step] == pytest.approx(ref_loss, rel=1e-5), where
                else:
                    assert rec["losses"][step] is None, where
                grads = rec["grads"][step]
                assert grads and set(grads) <= set(ref_grads), where
                for name, g in grads.items():
                    torch.testing.assert_close(g, ref_grads[name], **TOL,
                                               msg=lambda s: f"{where} step {step} {name}: {s}")
            # activations out (m per step) and gradients in (m per step), a header only when the shape changed
            acts = [m + header for header in (1, 0, 1)] if i < p - 1 else [0, 0, 0]
            assert rec["sends"] == [a + (m if i > 0 else 0) for a in acts], where
            assert rec["inflight"] == [m if schedule == "gpipe" else min(p - i, m)] * 3, where
            stats = rec["stats"]
            assert stats.max_inflight <= (m if schedule == "gpipe" else p)
            assert stats.bubble_formula == pytest.approx((p - 1) / (m + p - 1))
            assert 0 < stats.busy_s <= stats.step_s and stats.idle_s == pytest.approx(stats.step_s - stats.busy_s)
            assert stats.bubble == pytest.approx(stats.idle_s / stats.step_s)


@pytest.mark.parametrize("nprocs,loss", [(2, "mse"), (4, "ce")])
def test_matches_single_process(nprocs, loss):
    m = 2 * nprocs  # more micro-batches than stages, so 1F1B holds fewer than GPipe
    check_train(run_ranks(rank_train, nprocs, args=(loss, m)), m, loss)


class _Spike(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, factor):
        ctx.factor = factor
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * ctx.factor, None


class Spike(nn.Module):
    """Identity whose backward multiplies the gradient by ``factor``: inf makes the gradients before it
    overflow (a loss-scaled step that overflows in the pipeline's first stage only)."""

    factor = 1.0

    def forward(self, x):
        return _Spike.apply(x, self.factor)


def spiked_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), Spike(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


ZERO_STEPS, SPIKES, CLIP = 5, (0, 3), 0.05
SCALING = {"init_scale": 2.0 ** 16, "growth_interval": 2}


class DetachFourth(nn.Module):
    """Detaches its input at every fourth call: a stage that cuts the gradient of some micro-batches only."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x.detach() if self.calls % 4 == 0 else x


def zero_reference():
    """The unsplit model on the full batch: torch's GradScaler (skips, halving, growth), clipping and SGD."""
    model = spiked_model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", **SCALING)
    norms, scales = [], []
    for step in range(ZERO_STEPS):
        model[2].factor = float("inf") if step in SPIKES else 1.0
        x, y = make_batch(step, 16, "mse")
        opt.zero_grad()
        scaler.scale(F.mse_loss(model(x), y)).backward()
        scaler.unscale_(opt)
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
    return norms, scales, model


def rank_dp_pp(m):
    """2 DP x 2 PP: pipelines [0, 1] and [2, 3], DP groups [0, 2] and [1, 3], each replica half the batch.
    Gradients averaged over the DP groups by hand after train_step; by a pz.DataParallel stage (m and one
    micro-batch); by a ZeroOptimizer (stage 2, pp_group, loss scaling, clipping) over a few steps."""
    pz.init()
    r = pz.get_rank()
    pp_groups = [pz.new_group([0, 1]), pz.new_group([2, 3])]
    dp_groups = [pz.new_group([0, 2]), pz.new_group([1, 3])]
    pp, dp, replica = pp_groups[r // 2], dp_groups[r % 2], r // 2
    out = {}
    seed, batch = steps_for(m)[0]
    x, y = make_batch(seed, 2 * batch, "mse")
    half = slice(replica * batch, (replica + 1) * batch)  # this replica's share of the global batch
    for schedule in ("gpipe", "1f1b"):
        stage = pz.pipeline.split_sequential(make_model(), 2)[pp.rank]
        pipe = pz.pipeline.Pipeline(stage, m, schedule, group=pp)
        value = pipe.train_step(x[half], y[half], F.mse_loss)
        for p in stage.parameters():
            pz.all_reduce(p.grad, op="avg", group=dp)
        out[schedule] = (value, {name: p.grad for name, p in stage.named_parameters()})
        # the same stage in a pz.DataParallel: its all-reduces in a step of m micro-batches and of one
        stage = pz.pipeline.split_sequential(make_model(), 2)[pp.rank]
        wrapped = pz.DataParallel(stage, group=dp)
        calls, pipes = {}, {}
        for k in (m, 1):
            pipe = pipes[k] = pz.pipeline.Pipeline(wrapped, k, schedule, group=pp)
            pipe.train_step(x[half], y[half], F.mse_loss)  # (the first step sends headers)
            for p in stage.parameters():
                p.grad = None
            pz.comm_stats(reset=True)
            value = pipe.train_step(x[half], y[half], F.mse_loss)
            calls[k] = pz.comm_stats().get("all_reduce")
            if k == m:
                out[f"dp {schedule}"] = (value, {name: p.grad.clone() for name, p in stage.named_parameters()})
        # accumulation over two steps, the first inside the wrapper's no_sync(): it reduces nothing
        for p in stage.parameters():
            p.grad = None
        pz.comm_stats(reset=True)
        with wrapped.no_sync():
            pipes[m].train_step(x[half], y[half], F.mse_loss)
        calls["no_sync"] = pz.comm_stats().get("all_reduce")
        pipes[m].train_step(x[half], y[half], F.mse_loss)
        out[f"dp {schedule} all_reduce"] = calls
        out[f"dp {schedule} accumulated"] = {name: p.grad.clone() for name, p in stage.named_parameters()}
    # the second stage cuts the gradient of the last micro-batch only: the first reduces in a backward of zeros
    stage = pz.pipeline.split_sequential(make_model(), 2)[pp.rank]
    stage = nn.Sequential(DetachFourth(), *stage) if pp.rank == 1 else stage
    pz.pipeline.Pipeline(pz.DataParallel(stage, group=dp), m, "1f1b", group=pp).train_step(x[half], y[half],
                                                                                          F.mse_loss)
    out["dp detached"] = {name: p.grad for name, p in stage.named_parameters()}
    refusals = out["zero refusals"] = {}
    for case, kwargs in (("pp_group=dp", dict(pp_group=dp)),
                         ("loss_scale differs", dict(pp_group=pp, loss_scale=SCALING if pp.rank == 0 else None))):
        try:
            pz.ZeroOptimizer(pz.pipeline.split_sequential(make_model(), 2)[pp.rank], torch.optim.SGD, group=dp,
                             lr=LR, **kwargs)
            refusals[case] = None
        except ValueError as e:
            refusals[case] = str(e)
    model = spiked_model()
    stage = [model[:3], model[3:]][pp.rank]
    opt = pz.ZeroOptimizer(stage, torch.optim.SGD, stage=2, group=dp, pp_group=pp, loss_scale=SCALING, lr=LR)
    pipe = pz.pipeline.Pipeline(stage, m, "1f1b", group=pp)
    zero = out["zero"] = {"norms": [], "scales": [], "reduce_scatter": []}
    for step in range(ZERO_STEPS):
        model[2].factor = float("inf") if step in SPIKES else 1.0
        x, y = make_batch(step, 16, "mse")
        pz.comm_stats(reset=True)
        pipe.train_step(x[replica * 8:replica * 8 + 8], y[replica * 8:replica * 8 + 8],
                        lambda o, t: opt.scale_loss(F.mse_loss(o, t)))
        zero["reduce_scatter"].append(pz.comm_stats().get("reduce_scatter", {}).get("calls"))
        zero["norms"].append(float(opt.clip_grad_norm_(CLIP)))
        opt.step()
        opt.zero_grad()
        zero["scales"].append(opt.loss_scale)
    zero["buckets"] = sum(call.op == "reduce_scatter" for phase in opt.comm_plan() for call in phase)
    zero["params"] = {name: p.detach().clone() for name, p in stage.named_parameters()}
    return out


@pytest.fixture(scope="module")
def dp_pp_runs():
    m = 4
    return m, [res.value for res in run_ranks(rank_dp_pp, 4, args=(m,))]


def test_dp_x_pp_matches_single_process(dp_pp_runs):
    m, results = dp_pp_runs
    model = make_model()
    seed, batch = steps_for(m)[0]
    x, y = make_batch(seed, 2 * batch, "mse")
    loss = F.mse_loss(model(x), y)
    loss.backward()
    for schedule in ("gpipe", "1f1b", "dp gpipe", "dp 1f1b"):
        losses = [res[schedule][0] for res in results]
        assert losses[0] is None and losses[2] is None
        assert (losses[1] + losses[3]) / 2 == pytest.approx(loss.item(), rel=1e-5)  # equal halves: mean of means
        for res in results:
            for name, g in res[schedule][1].items():
                torch.testing.assert_close(g, dict(model.named_parameters())[name].grad, **TOL)


def test_data_parallel_stage_reduces_once_per_step(dp_pp_runs):
    """A pz.DataParallel stage all-reduced its gradients in every micro-batch's backward (m times the bytes:
    9 calls at m=4 where one micro-batch makes 3); it reduces in the last one only, as gradient
    accumulation under no_sync does, and its gradients equal one process's (test above)."""
    m, results = dp_pp_runs
    for rank, res in enumerate(results):
        for schedule in ("gpipe", "1f1b"):
            calls = res[f"dp {schedule} all_reduce"]
            assert calls[m] == calls[1], (rank, schedule, calls)
            assert calls[1]["calls"] <= 3, (rank, schedule, calls)  # agree_step's, the bucket's, the used flags'
            assert calls["no_sync"]["calls"] == 1, (rank, schedule, calls)  # agree_step's only
            for name, g in res[f"dp {schedule} accumulated"].items():  # two steps' gradients, reduced once
                torch.testing.assert_close(g, 2 * res[f"dp {schedule}"][1][name], **TOL)
    # the last micro-batch's gradient cut after the first stage: its earlier gradients are still reduced
    model = make_model()
    seed, batch = steps_for(m)[0]
    x, y = make_batch(seed, 2 * batch, "mse")
    for j, (xj, yj) in enumerate(zip(x.split(batch // m), y.split(batch // m))):  # both replicas' micro-batches
        h = model[:4](xj)
        F.mse_loss(model[4:](h.detach() if j % m == m - 1 else h), yj).div(2 * m).backward()
    ref = dict(model.named_parameters())
    for rank, res in enumerate(results):
        for name, g in res["dp detached"].items():
            want = ref[name if rank % 2 == 0 else f"{int(name.split('.')[0]) + 3}.{name.split('.')[1]}"].grad
            torch.testing.assert_close(g, want, **TOL, msg=lambda s: f"rank {rank} {name}: {s}")


def test_zero_pp_group_refuses_what_cannot_combine(dp_pp_runs):
    """pp_group= that shares ranks with the optimizer's group (norms counted twice), and loss scaling on one
    stage only (the last stage's scale reaches every stage's gradients): a ValueError on every rank."""
    _, results = dp_pp_runs
    for rank, res in enumerate(results):
        got = res["zero refusals"]
        assert got["pp_group=dp"] is not None and re.search(
            r"pp_group: global ranks \[\d\] are in both pp_group \[\d, \d\] and group", got["pp_group=dp"]), got
        assert got["loss_scale differs"] is not None and got["loss_scale differs"].startswith(
            f"loss_scale: differs between the ranks of pp_group {[2 * (rank // 2), 2 * (rank // 2) + 1]}"), got


def test_zero_over_pipeline_stages_clips_and_skips_as_one_model(dp_pp_runs):
    """ZeroOptimizer(pp_group=) on each stage: clip_grad_norm_ returns the whole model's norm (each stage
    clipped by its own before: 0.8 and 1.1 where the model's was 1.3), a step that overflows in the first
    stage only is skipped by both, whose scales stay equal (the second stage stepped and kept its scale),
    and the weights follow torch's GradScaler, clipping and SGD on the unsplit model; stage 2 reduce-scatters
    once per bucket per step, not once per micro-batch."""
    _, results = dp_pp_runs
    norms, scales, model = zero_reference()
    params = [dict(model[:3].named_parameters()), dict(model[3:].named_parameters())]
    for rank, res in enumerate(results):
        zero = res["zero"]
        assert zero["scales"] == scales, (rank, zero["scales"], scales)
        for step in range(ZERO_STEPS):
            if step in SPIKES:
                assert zero["norms"][step] == float("inf"), (rank, step)
            else:
                assert zero["norms"][step] == pytest.approx(norms[step], rel=1e-5), (rank, step)
        assert zero["reduce_scatter"] == [zero["buckets"]] * ZERO_STEPS, (rank, zero)
        for name, p in zero["params"].items():
            torch.testing.assert_close(p, params[rank % 2][name].detach(), **TOL, msg=lambda s: f"{rank} {name}: {s}")


# ---------------------------------------------------------------------------
# Bad input: the same clear error on every rank, and the group still works after


def rank_bad_input():
    pz.init()
    r = pz.get_rank()
    stages = pz.pipeline.split_sequential(make_model(), 2)
    alone = [pz.new_group([0]), pz.new_group([1])][r]  # (a data-parallel group of one, for a wrapped stage)
    alike = pz.pipeline.split_sequential(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh()), 2)
    x, y = make_batch(1, 8, "mse")
    cases = {
        "m0": lambda: pz.pipeline.Pipeline(stages[r], 0),
        "m0_on_rank_1": lambda: pz.pipeline.Pipeline(stages[r], [4, 0][r]),
        "m_differs": lambda: pz.pipeline.Pipeline(stages[r], [2, 4][r]),
        "m_str": lambda: pz.pipeline.Pipeline(stages[r], "4"),
        "m_huge": lambda: pz.pipeline.Pipeline(stages[r], 2 ** 63),  # (was torch's int64 overflow, unnamed)
        "schedule": lambda: pz.pipeline.Pipeline(stages[r], 4, schedule="zigzag"),
        "three_stages": lambda: pz.pipeline.Pipeline(pz.pipeline.split_sequential(make_model(), 3)[r], 4),
        "swapped_stages": lambda: pz.pipeline.Pipeline(stages[1 - r], 4),
        "swapped_wrapped": lambda: pz.pipeline.Pipeline(pz.DataParallel(stages[1 - r], group=alone), 4),
        "not_a_module": lambda: pz.pipeline.Pipeline("stage", 4),
        # data parallelism over the pipeline group (group=None: the world): one stage's weights broadcast over
        # the other's and gradients of different layers averaged; refused at wrap (split stages are tagged) ...
        "dp_over_stages": lambda: pz.DataParallel(alike[r]),
        "zero_over_stages": lambda: pz.ZeroOptimizer(alike[r], torch.optim.SGD, stage=1, lr=0.1),
        # ... and by the Pipeline for stages built by hand, alike in shape
        "dp_spans_pipeline": lambda: pz.pipeline.Pipeline(pz.DataParallel(nn.Sequential(nn.Linear(4, 4))), 4),
    }
    pipe = pz.pipeline.Pipeline(stages[r], 4)
    cases.update({
        "indivisible": lambda: pipe.train_step(x[:6], y[:6], F.mse_loss),
        "fewer_than_m": lambda: pipe.train_step(x[:2], y[:2], F.mse_loss),
        "no_inputs": lambda: pipe.train_step(None, y, F.mse_loss),
        "targets_batch": lambda: pipe.train_step(x, y[:4], F.mse_loss),
        "loss_fn": lambda: pipe.train_step(x, y, "mse"),
        # a setting changed after the ranks agreed on it (the steps then split into 8 and ran the schedule of 4,
        # half the batch dropped)
        "set_m": lambda: setattr(pipe, "num_microbatches", 8),
        "set_schedule": lambda: setattr(pipe, "schedule", "gpipe"),
    })
    out = {}
    for name, fn in cases.items():
        try:
            fn()
            out[name] = None
        except (TypeError, ValueError, AttributeError) as e:
            out[name] = (type(e).__name__, str(e))
    out["after"] = pipe.train_step(x, y, F.mse_loss)  # the errors left the group usable
    out["after_m"] = (pipe.num_microbatches, pipe.schedule, pipe.stats.num_microbatches)
    return out


ERRORS = {
    "m0": ("ValueError", "num_microbatches: expected an int >= 1, got 0"),
    "m_differs": ("ValueError", r"num_microbatches: expected the same value on every rank.*\[2, 4\]"),
    "m_str": ("TypeError", "num_microbatches: expected an int >= 1, got str"),
    "m_huge": ("ValueError", "num_microbatches: expected an int below 2\\*\\*62, got 9223372036854775808"),
    "schedule": ("ValueError", r"schedule: expected one of \['gpipe', '1f1b'\], got 'zigzag'"),
    "three_stages": ("ValueError", r"split into 3 stages, but the pipeline group has 2 ranks.*num_stages=2"),
    "swapped_stages": ("ValueError", r"pipeline rank 0 \(global rank 0\) holds stage 1; rank i of the pipeline "
                                     r"group must hold stages\[i\]"),
    "swapped_wrapped": ("ValueError", r"pipeline rank 0 \(global rank 0\) holds stage 1"),
    "not_a_module": ("TypeError", "stage_module: expected an nn.Module"),
    "dp_over_stages": ("ValueError", r"module: the ranks of group \[0, 1\] hold different pipeline stages \(group rank "
                                     r"0: stage 0 of 2, group rank 1: stage 1 of 2\)"),
    "zero_over_stages": ("ValueError", r"model: the ranks of group \[0, 1\] hold different pipeline stages"),
    "dp_spans_pipeline": ("ValueError", r"stage_module: the data-parallel group of the wrapper on pipeline rank 0 "
                                        r"\(global rank 0\) shares ranks with the pipeline group \[0, 1\]"),
    "indivisible": ("ValueError", "inputs: batch size 6 .* does not split into num_microbatches=4"),
    "fewer_than_m": ("ValueError", "inputs: batch size 2 .* does not split into num_microbatches=4"),
    "no_inputs": ("TypeError", r"inputs: expected a tensor with a batch dim 0 on the first stage"),
    "targets_batch": ("ValueError", "targets: batch size 4 .* does not match the inputs' batch size 8"),
    "loss_fn": ("TypeError", "loss_fn: expected a callable"),
    "set_m": ("AttributeError", "num_microbatches: fixed when the Pipeline is built .* build a new "
                                "pz.pipeline.Pipeline on every rank"),
    "set_schedule": ("AttributeError", "schedule: fixed when the Pipeline is built"),
}


def test_bad_input_raises_on_every_rank():
    results = run_ranks(rank_bad_input, 2)
    for res in results:
        got = res.value
        for name, (kind, pattern) in ERRORS.items():
            assert got[name] is not None and got[name][0] == kind, (res.rank, name, got[name])
            assert re.search(pattern, got[name][1]), (res.rank, name, got[name][1])
        # the rank that passed 0 names its own value; the other names it
        assert got["m0_on_rank_1"][0] == "ValueError"
        expected = ("got 0" if res.rank == 1 else r"pipeline rank 1 \(global rank 1\) passed an invalid value")
        assert re.search(expected, got["m0_on_rank_1"][1]), got["m0_on_rank_1"]
    x, y = make_batch(1, 8, "mse")
    assert results[1].value["after"] == pytest.approx(F.mse_loss(make_model()(x), y).item(), rel=1e-5)
    assert results[0].value["after"] is None
    assert all(res.value["after_m"] == (4, "1f1b", 4) for res in results)


def two_stages():
    """This rank's stage of make_model() split in two, its 2-micro-batch pipeline, a batch of 4."""
    pz.init(timeout=20)
    stage = pz.pipeline.split_sequential(make_model(), 2)[pz.get_rank()]
    return stage, pz.pipeline.Pipeline(stage, 2), *make_batch(1, 4, "mse")


def rank_detached_loss():
    stage, pipe, x, y = two_stages()
    try:
        pipe.train_step(x, y, lambda out, t: F.mse_loss(out, t).detach())
        return None, {n: p.grad for n, p in stage.named_parameters()}
    except Exception as e:  # noqa: BLE001  (the first stage fails as its peer exits: any error)
        return f"{type(e).__name__}: {e}", None


def test_loss_cut_from_the_graph_raises():
    """A loss_fn whose loss does not require grad (detached, or computed under no_grad) left every
    gradient None or zero and reported the loss as usual; plain loss.backward() raises. The last
    stage raises naming loss_fn; its peers fail as it leaves the pipeline."""
    first, last = (res.value for res in run_ranks(rank_detached_loss, 2, timeout=60))
    assert last[0] is not None and last[0].startswith("TypeError: loss_fn: the loss of micro-batch 0 does not "
                                                      "require grad"), last
    assert first[0] is not None, first


class Detach(nn.Module):
    def forward(self, x):
        return x.detach()


def detached_model():
    """Stage 0 (Linear, Tanh) feeds stage 1 through a detach: no gradient reaches stage 0 (stage 2's input
    gradient flows to stage 1), as when a head is trained on frozen features."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), Detach(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, OUT))


def rank_detached_stage(schedule):
    pz.init(timeout=20)
    r = pz.get_rank()
    m = detached_model()
    stage = [m[0:2], m[2:5], m[5:]][r]
    opt = torch.optim.AdamW(stage.parameters(), lr=0.1, weight_decay=0.5)
    pipe = pz.pipeline.Pipeline(stage, 4, schedule)
    grads = []
    for seed in range(3):
        x, y = make_batch(seed, 8, "mse")
        opt.zero_grad()
        pipe.train_step(x, y, F.mse_loss)
        grads.append([p.grad is None for p in stage.parameters()])
        opt.step()
    return grads, {n: p.detach().clone() for n, p in stage.named_parameters()}


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_parameters_no_gradient_reaches_keep_none_as_torch(schedule):
    """Stage 0's parameters get no gradient (the model detaches its output): .grad stays None, so AdamW
    skips them (weight decay 0.5 would move them), as in one full-batch backward; the later stages
    train as torch does."""
    ref = detached_model()
    opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.5)
    for seed in range(3):
        x, y = make_batch(seed, 8, "mse")
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        opt.step()
    parts = [ref[0:2], ref[2:5], ref[5:]]
    for res in run_ranks(rank_detached_stage, 3, args=(schedule,), timeout=60):
        grads, params = res.value
        assert all(g == [res.rank == 0] * len(g) for g in grads), (res.rank, grads)
        for n, p in parts[res.rank].named_parameters():
            torch.testing.assert_close(params[n], p.detach(), **TOL, msg=lambda msg, n=n: f"rank {res.rank} {n}: {msg}")


def rank_under_no_grad():
    stage, pipe, x, y = two_stages()
    pipe.train_step(x, y, F.mse_loss)
    first = [p.grad.clone() for p in stage.parameters()]
    errors = []
    for ranks in ([0, 1], [1]):  # every rank under no_grad, then one
        try:
            with torch.no_grad() if pz.get_rank() in ranks else contextlib.nullcontext():
                pipe.train_step(x, y, F.mse_loss)
            errors.append(None)
        except RuntimeError as e:
            errors.append(str(e))
    loss = pipe.train_step(x, y, F.mse_loss)  # the pipeline goes on
    return errors, loss, first, [p.grad.clone() for p in stage.parameters()]


def test_train_step_under_no_grad_raises_and_leaves_the_gradients():
    """An evaluation pass written as train_step under torch.no_grad() added to .grad (its backward ran
    anyway); it raises on every rank, the gradients stay those of the steps around it. One rank alone under
    no_grad raised before any communication while the other ran its step, which then paired with the
    first rank's next one (the wrong batch, later a timeout): every rank raises, naming that rank."""
    model = make_model()
    x, y = make_batch(1, 4, "mse")
    loss = F.mse_loss(model(x), y)
    loss.backward()
    ref = dict(model.named_parameters())
    for res in run_ranks(rank_under_no_grad, 2, timeout=60):
        errors, last_loss, first, final = res.value
        for ranks, error in zip(("0, 1", "1"), errors):
            assert error is not None and error.startswith("train_step: called under torch.no_grad() (or "
                                                          "inference_mode) on pipeline rank 1 (global rank 1)"), \
                (res.rank, ranks, error)
        assert (last_loss is None) == (res.rank == 0)
        if res.rank == 1:
            assert last_loss == pytest.approx(loss.item(), rel=1e-5)
        names = [n for n, _ in pz.pipeline.split_sequential(make_model(), 2)[res.rank].named_parameters()]
        for n, g1, g2 in zip(names, first, final):
            torch.testing.assert_close(g1, ref[n].grad, **TOL)
            torch.testing.assert_close(g2, 2 * ref[n].grad, **TOL)  # the two steps that ran


def rank_in_place_first_layer():
    pz.init(timeout=20)
    r = pz.get_rank()
    torch.manual_seed(0)
    stages = [nn.Sequential(nn.Linear(4, 8)), nn.Sequential(nn.ReLU(inplace=True), nn.Linear(8, 2))]
    pipe = pz.pipeline.Pipeline(stages[r], 2)
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    try:
        pipe.train_step(x, y, F.mse_loss)
        return None
    except Exception as e:  # noqa: BLE001  (the first stage fails as its peer exits: any error)
        return f"{type(e).__name__}: {e}"


def test_a_stage_changing_its_received_input_in_place_is_named():
    """A stage after the first whose first layer works in place (ReLU(inplace=True)) on its received input,
    a leaf autograd differentiates: torch's leaf error, named with the stage and the way out."""
    first, last = (res.value for res in run_ranks(rank_in_place_first_layer, 2, timeout=60))
    assert last is not None and last.startswith("RuntimeError: stage 1: a layer changed the stage's received "
                                                "input in place"), last
    assert "inplace=False" in last and first is not None


# ---------------------------------------------------------------------------
# The measured bubble follows (p - 1) / (m + p - 1) when stages take known time


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take SLEEP_S: a stage of known, equal cost."""

    @staticmethod
    def forward(ctx, x):
        time.sleep(SLEEP_S)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(SLEEP_S)
        return g


SLEEP_S = 0.02


class SleepLayer(nn.Module):
    def forward(self, x):
        return _Sleep.apply(x)


def rank_bubble():
    pz.init()
    torch.manual_seed(0)
    stage = nn.Sequential(nn.Linear(4, 4), SleepLayer())
    out = {}
    for schedule in ("gpipe", "1f1b"):
        for m in (1, 8):
            pipe = pz.pipeline.Pipeline(stage, m, schedule)
            x, y = torch.randn(m, 4), torch.randn(m, 4)
            # The third step: a step's time starts where it waits for the others to finish the one before
            # (steady state), and the first step's lazy set-up must not be in it.
            for _ in range(3):
                pipe.train_step(x, y, F.mse_loss)
            out[(schedule, m)] = pipe.stats
    return out


def test_measured_bubble_follows_formula():
    for res in run_ranks(rank_bubble, 2):
        for (schedule, m), stats in res.value.items():
            where = (res.rank, schedule, m, stats)
            assert stats.bubble_formula == pytest.approx(1 / (m + 1))
            # idle time cannot beat the ideal schedule; above it, each message's latency adds (loose on a
            # shared machine)
            assert stats.bubble_formula - 0.05 < stats.bubble < stats.bubble_formula + 0.15, where
            assert stats.busy_s >= 2 * m * SLEEP_S, where
        assert res.value[("gpipe", 1)].bubble > res.value[("gpipe", 8)].bubble + 0.2
        assert res.value[("1f1b", 1)].bubble > res.value[("1f1b", 8)].bubble + 0.2


def test_bench_pipeline_runs_end_to_end(tmp_path):
    import argparse
    import json

    from pyzero.bench import pipeline as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out, png = tmp_path / "pipeline.json", tmp_path / "pipeline.png"
    args = parser.parse_args(["--nproc", "2", "--microbatches", "1,4", "--hidden", "16", "--layers", "2",
                              "--mb-size", "2", "--compute", "matmul,sleep", "--sleep-ms", "1", "--steps", "1",
                              "--warmup", "0", "--json", str(out), "--plot", str(png)])
    assert bench.main(args) == 0
    rec = json.loads(out.read_text())
    assert {"machine", "versions", "date", "results"} <= set(rec)
    rows = {(r["compute"], r["schedule"], r["microbatches"]): r for r in rec["results"]}
    assert set(rows) == {(c, s, m) for c in bench.COMPUTES for s in bench.SCHEDULES for m in (1, 4)}
    for (_, schedule, m), r in rows.items():
        assert r["max_inflight"] == ([m, m] if schedule == "gpipe" else [min(2, m), 1])
        assert r["utilisation_formula"] == pytest.approx(m / (m + 1))
        assert 0 < r["utilisation"] <= 1
    assert png.stat().st_size > 0
