"""ZeRO over the DP groups of a DP x TP mesh: training and gradient clipping equal one process.

4 ranks = 2 DP x 2 TP. The model is LayerNorm (replicated) -> column-parallel
Linear -> GELU -> row-parallel Linear (replicated bias). The clipping norm must
add the TP ranks' parts of sharded parameters and count replicated ones once,
so it equals torch.nn.utils.clip_grad_norm_ on the full single-process model.
"""
import pytest
import torch
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks

IN, HID, OUT, BATCH, STEPS, CLIP = 8, 16, 8, 8, 3, 0.05


def _data():
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)) for _ in range(STEPS)]


def _reference(norm_type):
    torch.manual_seed(0)
    model = nn.Sequential(nn.LayerNorm(IN), nn.Linear(IN, HID), nn.GELU(), nn.Linear(HID, OUT))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    norms = []
    for x, y in _data():
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        norms.append(float(nn.utils.clip_grad_norm_(model.parameters(), CLIP, norm_type)))
        opt.step()
    return norms, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _rank(stage, norm_type):
    pz.init(timeout=30)
    dp, tp = pz.mesh(dp=2, tp=2)
    torch.manual_seed(0)  # the same draws as the reference's LayerNorm and two nn.Linear
    model = nn.Sequential(nn.LayerNorm(IN), pz.tp.ColumnParallelLinear(IN, HID, group=tp), nn.GELU(),
                          pz.tp.RowParallelLinear(HID, OUT, group=tp))
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, group=dp, tp_group=tp, lr=1e-2)
    per = BATCH // dp.size
    norms = []
    for x, y in _data():
        opt.zero_grad()
        xs, ys = x[dp.rank * per:(dp.rank + 1) * per], y[dp.rank * per:(dp.rank + 1) * per]
        nn.functional.mse_loss(model(xs), ys).backward()
        norms.append(float(opt.clip_grad_norm_(CLIP, norm_type)))
        opt.step()
    state = opt.full_state_dict() if stage == 3 else {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"tp_rank": tp.rank, "dp_rank": dp.rank, "norms": norms, "state": state}


@pytest.mark.parametrize("norm_type", [2.0, float("inf")], ids=["l2", "inf"])
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_over_dp_with_tp_matches_one_process(stage, norm_type):
    ref_norms, ref = _reference(norm_type)
    results = [r.value for r in run_ranks(_rank, 4, args=(stage, norm_type), timeout=90)]
    for r in results:
        assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), f"rank (dp {r['dp_rank']}, tp {r['tp_rank']})"
    # Reassemble the TP shards of DP rank 0 (stage 3 returns state on the DP group's first rank only).
    by_tp = {r["tp_rank"]: r["state"] for r in results if r["dp_rank"] == 0}
    full = {
        "0.weight": by_tp[0]["0.weight"], "0.bias": by_tp[0]["0.bias"],
        "1.weight": torch.cat([by_tp[0]["1.weight"], by_tp[1]["1.weight"]], 0),
        "1.bias": torch.cat([by_tp[0]["1.bias"], by_tp[1]["1.bias"]], 0),
        "3.weight": torch.cat([by_tp[0]["3.weight"], by_tp[1]["3.weight"]], 1),
        "3.bias": by_tp[0]["3.bias"],
    }
    for k, v in ref.items():
        torch.testing.assert_close(full[k], v, rtol=1e-5, atol=1e-6, msg=k)
    for tp_rank in (0, 1):  # replicated parameters stay identical across TP ranks
        torch.testing.assert_close(by_tp[tp_rank]["3.bias"], ref["3.bias"], rtol=1e-5, atol=1e-6)


def _rank_wrong_groups():
    pz.init(timeout=30)
    dp, tp = pz.mesh(dp=2, tp=2)
    out = {}

    def model():
        return nn.Sequential(pz.tp.ColumnParallelLinear(IN, HID, group=tp), nn.GELU(),
                             pz.tp.RowParallelLinear(HID, OUT, group=tp))
    cases = {"dp over the world": lambda: pz.DataParallel(model()),
             "zero over the world": lambda: pz.ZeroOptimizer(model(), torch.optim.SGD, stage=1, tp_group=tp, lr=0.1),
             "zero without tp_group": lambda: pz.ZeroOptimizer(model(), torch.optim.SGD, stage=2, group=dp, lr=0.1),
             "zero with dp as tp_group": lambda: pz.ZeroOptimizer(model(), torch.optim.SGD, stage=3, group=dp,
                                                                  tp_group=dp, lr=0.1)}
    for name, make in cases.items():
        try:
            make()
            out[name] = "nothing raised"
        except ValueError as e:
            out[name] = str(e)
    t = torch.ones(1)
    pz.all_reduce(t)  # nothing communicated before the refusals: the world still works
    out["dp over dp"] = type(pz.DataParallel(model(), group=dp)).__name__  # the right groups still wrap
    return out, t.item()


def test_data_parallel_over_tensor_parallel_shards_is_refused():
    """2 DP x 2 TP: DataParallel or ZeroOptimizer over a group holding both TP ranks of a shard (the world,
    group=None) broadcast one rank's shard over the other's and averaged different shards' gradients: a
    wrong model from the first forward, no error. ZeroOptimizer without tp_group (or another group) clipped
    by each TP rank's part of the norm, the replicated parameters drifting apart. All refused, naming
    the groups."""
    for r in run_ranks(_rank_wrong_groups, 4, timeout=60):
        out, total = r.value
        assert total == 4.0
        for name in ("dp over the world", "zero over the world"):
            assert "data-parallel group [0, 1, 2, 3] holds ranks" in out[name] and "group=dp" in out[name], name
        assert out["zero without tp_group"].startswith("tp_group: parameter '0.weight' is a tensor-parallel shard")
        assert "got none" in out["zero without tp_group"]
        assert "got the group of ranks" in out["zero with dp as tp_group"]
        assert out["dp over dp"] == "DataParallel"


def _rank_crossed_grid():
    pz.init(timeout=30)
    r = pz.get_rank()
    tp = [pz.new_group([0, 1]), pz.new_group([3, 2])]  # rank 3 holds TP shard 0, rank 2 shard 1
    dp = [pz.new_group([0, 2]), pz.new_group([1, 3])]  # pairs shard 0 with shard 1
    tp, dp = (next(g for g in gs if r in g.ranks) for gs in (tp, dp))
    torch.manual_seed(0)
    col = pz.tp.ColumnParallelLinear(IN, HID, group=tp)
    before = col.weight.detach().clone()
    out = {}
    for name, make in {"dp": lambda: pz.DataParallel(col, group=dp),
                       "zero": lambda: pz.ZeroOptimizer(col, torch.optim.SGD, stage=2, group=dp, tp_group=tp,
                                                        lr=0.1)}.items():
        try:
            make()
            out[name] = "nothing raised"
        except ValueError as e:
            out[name] = str(e)
    return out, torch.equal(before, col.weight.detach())


def test_a_data_parallel_group_pairing_different_shards_is_refused():
    """A hand-built grid whose data-parallel groups pair TP shard 0 of one TP group with shard 1 of another
    ([0, 1] and [3, 2] by TP, [0, 2] and [1, 3] by DP): DataParallel and ZeroOptimizer accepted it, the
    broadcast copied shard 0 over shard 1 and the gradients of different shards were averaged (0.63 off a
    single process). Refused on every rank naming the parameter and the shards, nothing copied."""
    for r in run_ranks(_rank_crossed_grid, 4, timeout=60):
        out, kept = r.value
        assert kept, r.rank
        for name in ("dp", "zero"):
            assert "parameter 'weight' is a tensor-parallel shard" in out[name], (name, out[name])
            assert "group rank 0: shard 0 of 2, group rank 1: shard 1 of 2" in out[name] or \
                "group rank 0: shard 1 of 2, group rank 1: shard 0 of 2" in out[name], (name, out[name])


def _rank_sp_block(stage):
    from pyzero.tp.block import TransformerBlock
    pz.init(timeout=30)
    dp, tp = pz.mesh(dp=2, tp=2)
    torch.manual_seed(0)
    block = pz.tp.ParallelTransformerBlock.from_block(TransformerBlock(16, 4), group=tp, sequence_parallel=True)
    opt = pz.ZeroOptimizer(block, torch.optim.SGD, stage=stage, group=dp, tp_group=tp, lr=0.1)
    x = torch.randn(2, 8, 4, 16, generator=torch.Generator().manual_seed(3))[dp.rank]  # (seq 8, batch 4, 16)
    losses = []
    for _ in range(2):
        opt.zero_grad()
        y = pz.tp.gather_from_sp(block(pz.tp.scatter_to_sp(x, group=tp)), group=tp, reduce_grad=False)
        loss = y.square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def test_sequence_parallel_block_under_zero3_trains_as_stage_1():
    """A sequence-parallel ParallelTransformerBlock under stage 3 (no leaf_modules): its LayerNorms read
    their parameters in their own forward, which stage 3 gathers (the block read them directly and the
    first forward raised 'read while freed'); its losses equal stage 1's."""
    want = [r.value for r in run_ranks(_rank_sp_block, 4, args=(1,), timeout=90)]
    got = [r.value for r in run_ranks(_rank_sp_block, 4, args=(3,), timeout=90)]
    for w, g in zip(want, got):
        assert g == pytest.approx(w, rel=1e-5)
    assert want[0][1] < want[0][0]
