"""ZeRO++ on stage 3 over 2 simulated hosts x 2 ranks: hpZ, qwZ, qgZ, alone and together.

- hpZ changes where backward gathers come from, not what they hold: bitwise plain stage 3.
- qgZ: the reduced gradient differs from the exact one by at most the quantisation error
  of the contributions that were quantised (worst case per element, derived below).
- qwZ and qgZ trained for a few steps: the loss stays within 1% of fp32 communication.
- Bytes across hosts per step (comm_stats "inter_host") are exactly what the layout says.
"""
import os

import pytest
import torch
import torch.nn.functional as F

import pyzero as pz
from pyzero.launch import run_ranks
from pyzero.zero.quantize import BLOCK, QMAX, all_to_all, dequantize, packed_words, quantize

import test_zero as tz
from outcomes import outcome
from test_hier import simulated

WORLD, HOSTS = 4, 2
CONFIGS = {"plain": {}, "hpz": dict(zero_hpz_partition_size=2), "qw": dict(zero_quantized_weights=True),
           "qg": dict(zero_quantized_gradients=True), "qg4": dict(zero_quantized_gradients=4),
           "all": dict(zero_hpz_partition_size=2, zero_quantized_weights=True, zero_quantized_gradients=True)}
STEPS = 8
# ZeRO++ with the other options, each against its config above without them
COMBOS = {"qg+offload": ("qg", dict(offload="cpu")),
          "qw+offload_params": ("qw", dict(offload="cpu", offload_params=True)),
          "qg+comm_dtype": ("qg", dict(comm_dtype=torch.bfloat16))}


# ---------------------------------------------------------------------------
# Quantisation (no ranks)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("n", [0, 1, 7, BLOCK, 3 * BLOCK + 5])
def test_quantize_round_trip_error_at_most_half_a_step(bits, n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 3
    words = quantize(x, bits)
    assert words.dtype == torch.int32 and words.numel() == packed_words(n, bits)
    y = dequantize(words, n, bits)
    for b in range(0, n, BLOCK):
        blk = x[b:b + BLOCK]
        step = blk.abs().max() / QMAX[bits]
        assert (y[b:b + BLOCK] - blk).abs().max() <= step / 2 * (1 + 1e-6) + 1e-12
    if n:
        assert torch.equal(dequantize(quantize(torch.zeros(n), bits), n, bits), torch.zeros(n))


def test_non_finite_block_dequantises_to_nan():
    x = torch.ones(2 * BLOCK)
    x[3] = float("inf")
    y = dequantize(quantize(x), x.numel())
    assert y[:BLOCK].isnan().all() and torch.equal(y[BLOCK:], x[BLOCK:])


def _rank_all_to_all():
    pz.init(timeout=30)
    me = pz.get_rank()
    peers = [0, 1, 2, 3]
    sends = {g: torch.full((5,), 10 * me + g, dtype=torch.int32) for g in peers if g != me}
    recvs = {g: torch.empty(5, dtype=torch.int32) for g in peers if g != me}
    all_to_all(peers, sends, recvs, None)
    return {g: t.tolist() for g, t in recvs.items()}


def test_all_to_all_across_hosts():
    for r in run_ranks(simulated, WORLD, args=(_rank_all_to_all,), timeout=60):
        assert r.value == {g: [10 * g + r.rank] * 5 for g in range(WORLD) if g != r.rank}


# ---------------------------------------------------------------------------
# Training


def _train(kw, steps, opt_name="sgd"):
    s = tz.spec("adamw", 3)
    model = tz.build(s)
    cls, okw = (torch.optim.SGD, dict(lr=0.1, momentum=0.9)) if opt_name == "sgd" else (torch.optim.AdamW, dict(lr=1e-2))
    opt = pz.ZeroOptimizer(model, cls, stage=3, **okw, **kw)
    per, lo = tz.BATCH // WORLD, pz.get_rank() * (tz.BATCH // WORLD)
    x, y = tz.batch(s, 0, 0)  # one fixed batch: the loss must go down
    losses, inter = [], []
    for _ in range(steps):
        pz.comm_stats(reset=True)
        opt.zero_grad()
        loss = F.mse_loss(model(x[lo:lo + per]), y[lo:lo + per])
        loss.backward()
        opt.step()
        full = torch.tensor([float(loss)])
        inter.append(pz.comm_stats()["inter_host"]["sent_bytes"])
        pz.all_reduce(full, op="avg")
        losses.append(full.item())
    return opt, model, losses, inter


def _rank_configs():
    pz.init(timeout=60)
    out = {}
    for name, kw in CONFIGS.items():
        opt, model, losses, inter = _train(kw, STEPS)
        out[name] = {"state": opt.full_state_dict(), "losses": losses, "inter": inter,
                     "memory": opt.memory_stats(), "shards": [u.layout.shard_size for u in opt.units]}
    for name, (base, kw) in COMBOS.items():
        opt, model, losses, inter = _train({**CONFIGS[base], **kw}, STEPS)
        out[name] = {"state": opt.full_state_dict(), "losses": losses}
    # one backward: the reduced gradient shards, exact and with qgZ (int8 and int4)
    s = tz.spec("adamw", 3)
    x, y = tz.batch(s, 0, 0)
    per, lo = tz.BATCH // WORLD, pz.get_rank() * (tz.BATCH // WORLD)
    grads = {}
    for name in ("plain", "qg", "qg4"):
        model = tz.build(s)
        opt = pz.ZeroOptimizer(model, torch.optim.SGD, stage=3, lr=0.1, **CONFIGS[name])
        F.mse_loss(model(x[lo:lo + per]), y[lo:lo + per]).backward()
        opt._reduce_gradients()
        grads[name] = torch.cat([u.grad_shard.clone() for u in opt.units])
    # the largest local gradient element over all ranks (bounds every block's absmax)
    ref = tz.build(s)
    F.mse_loss(ref(x[lo:lo + per]), y[lo:lo + per]).backward()
    gmax = torch.tensor([max(p.grad.abs().max().item() for p in ref.parameters())])
    pz.all_reduce(gmax, op="max")
    out["grads"], out["gmax"] = grads, gmax.item()
    return out


@pytest.fixture(scope="module")
def results():
    return [r.value for r in run_ranks(simulated, WORLD, args=(_rank_configs,), timeout=300)]


def test_hpz_is_bitwise_plain_stage3(results):
    plain, hpz = results[0]["plain"], results[0]["hpz"]
    assert plain["losses"] == hpz["losses"]
    for k, v in plain["state"].items():
        assert torch.equal(v, hpz["state"][k]), k


def test_plain_stage3_matches_single_process(results):
    s = tz.spec("adamw", 3)
    model = tz.build(s)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x, y = tz.batch(s, 0, 0)
    for _ in range(STEPS):
        opt.zero_grad()
        sum(F.mse_loss(model(xs), ys) for xs, ys in zip(x.chunk(WORLD), y.chunk(WORLD))).div(WORLD).backward()
        opt.step()
    for k, v in model.state_dict().items():
        torch.testing.assert_close(results[0]["plain"]["state"][k], v, **tz.TOL)


@pytest.mark.parametrize("name,bits", [("qg", 8), ("qg4", 4)])
def test_quantized_gradients_within_the_quantisation_bound(results, name, bits):
    """Rank (h, l)'s result sums, in fp32, its own chunk, one dequantised chunk from its host peer
    (error <= half a step of that block, <= gmax / (2 qmax)) and one dequantised partial from the
    other host (a sum of two local gradients: <= 2 gmax / (2 qmax)); averaged over 4 ranks:
    |error| <= 3 gmax / (2 qmax) / 4."""
    for r in results:
        exact, got = r["grads"]["plain"], r["grads"][name]
        bound = 3 * r["gmax"] / (2 * QMAX[bits]) / WORLD
        assert (got - exact).abs().max().item() <= bound * (1 + 1e-5), ((got - exact).abs().max(), bound)
        assert not torch.equal(got, exact)  # it did quantise


@pytest.mark.parametrize("name", ["qw", "qg", "qg4", "all"])
def test_quantized_training_loss_within_one_percent(results, name):
    plain, q = results[0]["plain"]["losses"], results[0][name]["losses"]
    assert plain[-1] < 0.7 * plain[0]  # it learns
    assert abs(q[-1] - plain[-1]) <= 0.01 * plain[-1], (q, plain)
    for k, v in results[0]["plain"]["state"].items():
        torch.testing.assert_close(results[0][name]["state"][k], v, rtol=0, atol=0.02 if name != "qg4" else 0.05)


@pytest.mark.parametrize("name", list(COMBOS))
def test_quantized_with_offload_or_comm_dtype_trains_as_without(results, name):
    """qgZ with the optimizer step on the CPU, qwZ with the parameter shards there, and qgZ
    with bf16 communication train as their plain ZeRO++ runs: offload moves where the step
    runs, not what it computes (fp32 rounding only); bf16 adds its rounding to qgZ's."""
    base = COMBOS[name][0]
    got, want = results[0][name], results[0][base]
    tol = dict(rtol=1e-5, atol=1e-6) if name != "qg+comm_dtype" else dict(rtol=0, atol=0.01)
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(want["losses"]), **tol)
    for k, v in want["state"].items():
        torch.testing.assert_close(got["state"][k], v, **tol, msg=k)


def test_cross_host_bytes_per_step(results):
    """Per unit with shard s (fp32), per rank and step, across hosts (H = 2): the forward gather,
    the backward gather and the reduce-scatter each send (H - 1) s x 4 bytes; hpZ drops the backward
    gather; qwZ sends the gathers' packed int8 words, qgZ the reduce-scatter's. step() adds one
    all_reduce of the 6 parameters' int32 "has a gradient" flags: 3 per lane, ring over 2 hosts."""
    r = results[0]
    shards = r["plain"]["shards"]
    flags = 3 * 4
    full = sum((HOSTS - 1) * s * 4 for s in shards)
    packed = sum((HOSTS - 1) * packed_words(s, 8) * 4 for s in shards)
    packed4 = sum((HOSTS - 1) * packed_words(s, 4) * 4 for s in shards)
    want = {"plain": 3 * full, "hpz": 2 * full, "qw": 2 * packed + full, "qg": 2 * full + packed,
            "qg4": 2 * full + packed4, "all": 2 * packed}
    for name, w in want.items():
        assert r[name]["inter"] == [w + flags] * STEPS, (name, r[name]["inter"], w)
    assert want["plain"] >= 4 * want["all"]


def test_hpz_memory_reported(results):
    shards = results[0]["plain"]["shards"]
    sec = sum(s * WORLD // 2 * 4 for s in shards)  # padded / partition size, fp32
    assert results[0]["hpz"]["memory"]["hpz_secondary"] == sec
    assert results[0]["hpz"]["memory"]["params"] == results[0]["plain"]["memory"]["params"] + sec
    assert results[0]["plain"]["memory"]["hpz_secondary"] == 0
    m = pz.zero.estimate_memory(1e6, 4, 3, hpz_partition_size=2)
    assert m["hpz_secondary"] == 2 * 1e6 / 2
    assert m["total"] == pytest.approx(pz.zero.estimate_memory(1e6, 4, 3)["total"] + 1e6)


# ---------------------------------------------------------------------------
# Bad options


def _rank_bad_options():
    pz.init(timeout=30)
    s = tz.spec("adamw", 3)
    cases = {"not_divisor": dict(stage=3, zero_hpz_partition_size=3),
             "spans_hosts": dict(stage=3, zero_hpz_partition_size=4),
             "bits": dict(stage=3, zero_quantized_gradients=5),
             "weights": dict(stage=3, zero_quantized_weights="yes"),
             "stage2": dict(stage=2, zero_quantized_weights=True)}
    return {k: outcome(lambda kw=kw: pz.ZeroOptimizer(tz.build(s), torch.optim.SGD, lr=0.1, **kw))
            for k, kw in cases.items()}


def test_bad_options_fail_clearly_on_every_rank():
    want = {"not_divisor": "zero_hpz_partition_size=3: expected a divisor of the group's 4 ranks",
            "spans_hosts": "zero_hpz_partition_size=4: partition [0, 1, 2, 3] spans hosts",
            "bits": "zero_quantized_gradients: expected False, True (int8), 8 or 4 (int4), got 5",
            "weights": "zero_quantized_weights: expected True or False, got 'yes'",
            "stage2": "zero_quantized_weights: the ZeRO++ options are for stage=3, got stage=2"}
    for r in run_ranks(simulated, WORLD, args=(_rank_bad_options,), timeout=60):
        for k, msg in want.items():
            assert r.value[k][0] == "ValueError" and msg in r.value[k][1], (k, r.value[k])
