"""Tensor parallelism: TP layers, sequence parallelism, ring overlap, DP x TP meshes.

Every multi-rank result is compared with a single-process plain-torch model
built under the same seed; TP shards are compared with ``chunk`` of the
reference tensors, which is independent of the library's sharding code.
"""
import os
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks
from pyzero.tp.block import TransformerBlock
from pyzero.tp.overlap import ring_all_gather

SEQ, BATCH, HIDDEN, HEADS = 8, 2, 16, 4
TOL = dict(rtol=1e-5, atol=1e-5)
CONFIGS = [(overlap, sp) for overlap in (True, False) for sp in (True, False)]  # (overlap, sequence_parallel)

# How each parameter is split: "col" along dim 0 (output features), "row" along dim 1
# (input features); everything else (row biases, LayerNorms) is replicated.
SPLITS = {"fc1.weight": "col", "fc1.bias": "col", "qkv.weight": "col", "qkv.bias": "col",
          "fc2.weight": "row", "proj.weight": "row"}


def shard_of(name, full, rank, n):
    kind = SPLITS.get(name)
    if kind == "col":
        return full.chunk(n, dim=0)[rank]
    if kind == "row":
        return full.chunk(n, dim=1)[rank]
    return full


class MLP(nn.Module):
    """fc1 -> GELU -> fc2: with nn.Linear layers the reference, with TP layers the model under test."""

    def __init__(self, fc1, fc2):
        super().__init__()
        self.fc1, self.fc2 = fc1, fc2

    def forward(self, h):
        return self.fc2(F.gelu(self.fc1(h)))


def make_mlp():
    torch.manual_seed(0)
    return MLP(nn.Linear(HIDDEN, 4 * HIDDEN), nn.Linear(4 * HIDDEN, HIDDEN))


def make_block():
    torch.manual_seed(0)
    return TransformerBlock(HIDDEN, HEADS)


def make_plain_ln_block():
    """The block with LayerNorms without an affine weight and bias."""
    block = make_block()
    block.ln1, block.ln2 = (nn.LayerNorm(HIDDEN, elementwise_affine=False) for _ in range(2))
    return block


def make_data(batch=BATCH):
    g = torch.Generator().manual_seed(1)
    return torch.randn(SEQ, batch, HIDDEN, generator=g), torch.randn(SEQ, batch, HIDDEN, generator=g)


def forward_backward(model, x, t, sp=False):
    """Output, input gradient and parameter gradients of the loss sum(model(x) * t)."""
    x = x.clone().requires_grad_()
    h = pz.tp.scatter_to_sp(x) if sp else x
    y = model(h)
    y = pz.tp.gather_from_sp(y, reduce_grad=False) if sp else y  # the loss below is replicated
    (y * t).sum().backward()
    return y.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def check_against(results, ref, tol=TOL):
    """results: per rank, {config: forward_backward(...)}; ref: forward_backward of the reference (outputs,
    gradients and their dtypes alike)."""
    y_ref, dx_ref, grads_ref = ref
    for res in results:
        for config, (y, dx, grads) in res.value.items():
            where = f"rank {res.rank}, config {config}"
            torch.testing.assert_close(y, y_ref, **tol, msg=lambda m: f"{where} output: {m}")
            torch.testing.assert_close(dx, dx_ref, **tol, msg=lambda m: f"{where} input grad: {m}")
            assert sorted(grads) == sorted(grads_ref), where
            for name, g_ref in grads_ref.items():
                torch.testing.assert_close(grads[name], shard_of(name, g_ref, res.rank, len(results)), **tol,
                                           msg=lambda m: f"{where} grad {name}: {m}")


# ---------------------------------------------------------------------------
# Layers and blocks vs the single-process model


def rank_models(which):
    pz.init()
    x, t = make_data()
    out = {}
    if which == "mlp-autocast":
        for overlap, sp in CONFIGS:
            ref = make_mlp()
            opts = dict(sequence_parallel=sp, overlap=overlap)
            model = MLP(pz.tp.ColumnParallelLinear.from_linear(ref.fc1, **opts),
                        pz.tp.RowParallelLinear.from_linear(ref.fc2, **opts))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out[f"overlap={overlap},sp={sp}"] = forward_backward(model, x, t, sp)
        return out
    if which == "mlp-fp64-autocast":  # autocast leaves float64 alone, as nn.Linear under it stays float64
        for overlap, sp in CONFIGS:
            ref = make_mlp().double()
            opts = dict(sequence_parallel=sp, overlap=overlap)
            model = MLP(pz.tp.ColumnParallelLinear.from_linear(ref.fc1, **opts),
                        pz.tp.RowParallelLinear.from_linear(ref.fc2, **opts))
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out[f"overlap={overlap},sp={sp}"] = forward_backward(model, x.double(), t.double(), sp)
        return out
    if which == "mlp-after-inference":  # a forward under inference_mode first: the ops' cached buffers are made
        for overlap, sp in CONFIGS:     # there, and must serve the training forward and backward after it
            ref = make_mlp()
            opts = dict(sequence_parallel=sp, overlap=overlap)
            model = MLP(pz.tp.ColumnParallelLinear.from_linear(ref.fc1, **opts),
                        pz.tp.RowParallelLinear.from_linear(ref.fc2, **opts))
            with torch.inference_mode():
                model(pz.tp.scatter_to_sp(x) if sp else x)
            out[f"overlap={overlap},sp={sp}"] = forward_backward(model, x, t, sp)
        return out
    for overlap, sp in CONFIGS:
        opts = dict(sequence_parallel=sp, overlap=overlap)
        if which == "mlp":
            ref = make_mlp()
            model = MLP(pz.tp.ColumnParallelLinear.from_linear(ref.fc1, **opts),
                        pz.tp.RowParallelLinear.from_linear(ref.fc2, **opts))
        elif which == "block-plain-ln":
            model = pz.tp.ParallelTransformerBlock.from_block(make_plain_ln_block(), **opts)
        else:
            model = pz.tp.ParallelTransformerBlock.from_block(make_block(), **opts)
        out[f"overlap={overlap},sp={sp}"] = forward_backward(model, x, t, sp)
    if which == "mlp":  # the replicated-edge variants: gathered column output into an unsplit row input
        ref = make_mlp()
        model = MLP(pz.tp.ColumnParallelLinear.from_linear(ref.fc1, gather_output=True),
                    pz.tp.RowParallelLinear.from_linear(ref.fc2, input_is_parallel=False))
        out["gather_output,input_is_parallel=False"] = forward_backward(model, x, t, False)
    return out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_mlp_matches_single_process(nprocs):
    results = run_ranks(rank_models, nprocs, args=("mlp",))
    check_against(results, forward_backward(make_mlp(), *make_data()))
    assert len(results[0].value) == len(CONFIGS) + 1


@pytest.mark.parametrize("symmetric", ["1", "0"])
def test_training_after_an_inference_mode_forward(symmetric):
    """The overlapped ops cache their scratch and symmetric buffers: made under inference_mode they were
    inference tensors, and every later training forward failed writing them."""
    results = run_ranks(rank_models, 2, args=("mlp-after-inference",), env={"PYZERO_SYMMETRIC": symmetric})
    check_against(results, forward_backward(make_mlp(), *make_data()))


def test_mlp_under_autocast_matches_single_process():
    """Under torch.autocast (bf16) the layers compute in bf16 and return bf16 as nn.Linear does, the fp32
    parameters get fp32 gradients (the overlapped ops mixed bf16 and fp32 in their backward)."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = forward_backward(make_mlp(), *make_data())
    assert ref[0].dtype == torch.bfloat16 and ref[2]["fc1.weight"].dtype == torch.float32
    check_against(run_ranks(rank_models, 2, args=("mlp-autocast",)), ref, tol=dict(rtol=2e-2, atol=2e-2))


def test_float64_mlp_under_autocast_stays_float64():
    """torch.autocast casts no float64: a float64 nn.Linear under it computes in float64. The overlapped
    layers cast everything to the autocast dtype (a bf16 result 2e-3 off, or a dtype error in the row
    layer); now every configuration matches the float64 reference to float64 rounding."""
    x, t = make_data()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref = forward_backward(make_mlp().double(), x.double(), t.double())
    assert ref[0].dtype == torch.float64
    results = run_ranks(rank_models, 2, args=("mlp-fp64-autocast",))
    for r in results:
        for name, (y, _, _) in r.value.items():
            assert y.dtype == torch.float64, name
    check_against(results, ref, tol=dict(rtol=1e-12, atol=1e-12))


@pytest.mark.parametrize("nprocs", [2, 4])
def test_block_matches_single_process(nprocs):
    check_against(run_ranks(rank_models, nprocs, args=("block",)), forward_backward(make_block(), *make_data()))


def test_block_with_plain_layer_norms_matches_single_process():
    """LayerNorms without weight and bias (elementwise_affine=False), sequence parallel too."""
    check_against(run_ranks(rank_models, 2, args=("block-plain-ln",)), forward_backward(make_plain_ln_block(),
                                                                                        *make_data()))


def rank_init():
    pz.init()
    torch.manual_seed(0)
    col = pz.tp.ColumnParallelLinear(6, 8)
    torch.manual_seed(0)
    row = pz.tp.RowParallelLinear(6, 8, bias=False)
    return {n: p.detach() for n, p in [*col.named_parameters("col"), *row.named_parameters("row")]}


def test_init_matches_one_nn_linear():
    results = run_ranks(rank_init, 2)
    torch.manual_seed(0)
    ref = nn.Linear(6, 8)
    for res in results:
        r = res.rank
        assert set(res.value) == {"col.weight", "col.bias", "row.weight"}
        torch.testing.assert_close(res.value["col.weight"], ref.weight.detach()[4 * r:4 * r + 4], rtol=0, atol=0)
        torch.testing.assert_close(res.value["col.bias"], ref.bias.detach()[4 * r:4 * r + 4], rtol=0, atol=0)
        torch.testing.assert_close(res.value["row.weight"], ref.weight.detach()[:, 3 * r:3 * r + 3], rtol=0, atol=0)


def rank_frozen():
    """from_linear of frozen layers (weight, or bias only): the shards stay frozen, and the input
    gradient still flows through them."""
    pz.init()
    out = {}
    for overlap, sp in CONFIGS:
        ref = make_mlp()
        ref.fc1.weight.requires_grad_(False)
        ref.fc2.bias.requires_grad_(False)
        opts = dict(sequence_parallel=sp, overlap=overlap)
        model = MLP(pz.tp.ColumnParallelLinear.from_linear(ref.fc1, **opts),
                    pz.tp.RowParallelLinear.from_linear(ref.fc2, **opts))
        flags = {n: p.requires_grad for n, p in model.named_parameters()}
        y, dx, grads = forward_backward(model, *make_data(), sp)
        out[f"overlap={overlap},sp={sp}"] = (flags, y, dx, grads)
    return out


def test_from_linear_keeps_frozen_parameters_frozen():
    ref = make_mlp()
    ref.fc1.weight.requires_grad_(False)
    ref.fc2.bias.requires_grad_(False)
    y_ref, dx_ref, grads_ref = forward_backward(ref, *make_data())
    for res in run_ranks(rank_frozen, 2):
        for config, (flags, y, dx, grads) in res.value.items():
            where = f"rank {res.rank}, {config}"
            assert flags == {"fc1.weight": False, "fc1.bias": True, "fc2.weight": True, "fc2.bias": False}, where
            torch.testing.assert_close(y, y_ref, **TOL)
            torch.testing.assert_close(dx, dx_ref, **TOL)
            assert grads["fc1.weight"] is None and grads["fc2.bias"] is None, where
            for name in ("fc1.bias", "fc2.weight"):
                torch.testing.assert_close(grads[name], shard_of(name, grads_ref[name], res.rank, 2), **TOL)


# ---------------------------------------------------------------------------
# Overlapped ops vs their unoverlapped versions and closed-form references


def seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def rank_overlap_ops(use_symmetric):
    pz.init(options={"symmetric": use_symmetric})
    n, r = pz.get_world_size(), pz.get_rank()
    m, b, k, o = 3, 2, 5, 4
    out = {}
    # all_gather_matmul: rank q holds rows block q of x; weights and output grads differ per rank.
    x_full = seeded(100, n * m, b, k)
    ws, ts = [seeded(200 + q, o, k) for q in range(n)], [seeded(300 + q, n * m, b, o) for q in range(n)]
    x = x_full[r * m:(r + 1) * m].clone().requires_grad_()
    w = ws[r].clone().requires_grad_()
    pz.comm_stats(reset=True)
    y = pz.tp.all_gather_matmul(x, w)
    stats = pz.comm_stats()
    (y * ts[r]).sum().backward()
    dx_ref = sum(ts[q] @ ws[q] for q in range(n))[r * m:(r + 1) * m]  # every rank's output depends on x
    out["ag"] = (y.detach(), x_full @ ws[r].t(), x.grad, dx_ref, w.grad,
                 torch.einsum("sbo,sbk->ok", ts[r], x_full))
    # The ring sends n-1 blocks; symmetric buffers send none (peers read them in place).
    out["ag_sent"] = (stats["send"]["elements"], stats["all_gather"]["calls"],
                      0 if use_symmetric else (n - 1) * x.numel())
    plain = torch.empty(n * m, b, k)
    pz.all_gather(plain, x.detach().contiguous())
    out["ag_vs_unoverlapped"] = (y.detach(), plain @ w.detach().t())

    # matmul_reduce_scatter: rank q holds the whole sequence with its own features.
    xs, ws = [seeded(400 + q, n * m, b, k) for q in range(n)], [seeded(500 + q, o, k) for q in range(n)]
    t_full = seeded(600, n * m, b, o)
    x = xs[r].clone().requires_grad_()
    w = ws[r].clone().requires_grad_()
    y = pz.tp.matmul_reduce_scatter(x, w)
    (y * t_full[r * m:(r + 1) * m]).sum().backward()
    y_ref = sum(xs[q] @ ws[q].t() for q in range(n))[r * m:(r + 1) * m]
    out["rs"] = (y.detach(), y_ref, x.grad, t_full @ ws[r], w.grad, torch.einsum("sbo,sbk->ok", t_full, xs[r]))
    plain = torch.empty(m, b, o)
    pz.reduce_scatter(plain, (x.detach() @ w.detach().t()).contiguous())
    out["rs_vs_unoverlapped"] = (y.detach(), plain)
    return out


@pytest.mark.parametrize("nprocs", [2, 4])
@pytest.mark.parametrize("use_symmetric", [True, False], ids=["symmetric", "ring"])
def test_overlapped_ops_match_unoverlapped(nprocs, use_symmetric):
    for res in run_ranks(rank_overlap_ops, nprocs, args=(use_symmetric,)):
        v = res.value
        for op in ("ag", "rs"):
            y, y_ref, dx, dx_ref, dw, dw_ref = v[op]
            torch.testing.assert_close(y, y_ref, **TOL)
            torch.testing.assert_close(dx, dx_ref, **TOL)
            torch.testing.assert_close(dw, dw_ref, **TOL)
            torch.testing.assert_close(*v[f"{op}_vs_unoverlapped"], **TOL)
        sent, all_gathers, expected = v["ag_sent"]
        assert (sent, all_gathers) == (expected, 0), "forward: n-1 blocks over the ring (none with symmetric " \
            "buffers) and no all_gather"


def rank_empty_shard(use_symmetric):
    """A sequence shard of 0 tokens through the SP layers, overlapped or not: an empty output and zero
    weight gradients, as nn.Linear gives, on the symmetric path as on the ring."""
    pz.init(options={"symmetric": use_symmetric})
    out = {}
    for overlap in (True, False):
        ref = make_mlp()
        model = MLP(pz.tp.ColumnParallelLinear.from_linear(ref.fc1, sequence_parallel=True, overlap=overlap),
                    pz.tp.RowParallelLinear.from_linear(ref.fc2, sequence_parallel=True, overlap=overlap))
        x = torch.randn(0, BATCH, HIDDEN, requires_grad=True)
        y = model(x)
        y.sum().backward()
        out[overlap] = (tuple(y.shape), tuple(x.grad.shape), {n: p.grad for n, p in model.named_parameters()})
    return out


@pytest.mark.parametrize("use_symmetric", [True, False], ids=["symmetric", "ring"])
def test_empty_sequence_shard(use_symmetric):
    ref = make_mlp()
    ref(torch.randn(0, BATCH, HIDDEN)).sum().backward()
    for res in run_ranks(rank_empty_shard, 2, args=(use_symmetric,)):
        for overlap, (y_shape, dx_shape, grads) in res.value.items():
            assert y_shape == (0, BATCH, HIDDEN) and dx_shape == (0, BATCH, HIDDEN), (res.rank, overlap)
            for name, g_ref in ref.named_parameters():
                torch.testing.assert_close(grads[name], shard_of(name, g_ref.grad, res.rank, 2), rtol=0, atol=0)


def rank_ring_in_flight():
    """While rank r computes on its own block (step 0), block r-1 must arrive."""
    pz.init()
    n, r = pz.get_world_size(), pz.get_rank()
    x = torch.full((4, 3), float(r))
    out = torch.zeros(n * 4, 3)
    seen = []

    def compute(c, block):
        if c == r:
            deadline = time.monotonic() + 10.0
            while time.monotonic() < deadline and not bool((out[((r - 1) % n) * 4] == (r - 1) % n).all()):
                time.sleep(0.001)
            seen.append(bool((out[((r - 1) % n) * 4] == (r - 1) % n).all()))
        seen.append(c)

    ring_all_gather(x, pz.comm.resolve_group(None), compute, out=out)
    return seen, out


def test_ring_transfer_runs_during_compute():
    n = 2
    for res in run_ranks(rank_ring_in_flight, n):
        seen, out = res.value
        assert seen == [True, res.rank, (res.rank - 1) % n]
        torch.testing.assert_close(out, torch.arange(n).float().repeat_interleave(4)[:, None].expand(-1, 3))


def rank_symmetric_in_place():
    """all_gather_apply: while rank r computes on its own block, the peers' blocks land in
    their buffers; peers' blocks come as views of those buffers (no copy), in ring order."""
    pz.init()
    n, r = pz.get_world_size(), pz.get_rank()
    g = pz.comm.resolve_group(None)
    x = torch.full((4, 3), float(r))
    seen, blocks = [], {}

    def compute(c, block):
        if c == r:
            buf = g.symmetric
            deadline = time.monotonic() + 10.0
            peers_here = lambda: all(bool((buf.view(p, x.dtype, (4, 3)) == p).all()) for p in range(n))  # noqa: E731
            while time.monotonic() < deadline and not peers_here():
                time.sleep(0.001)
            seen.append(peers_here())
        else:  # a view of the peer's buffer, not a copy
            seen.append(block.data_ptr() == g.symmetric.view(c, x.dtype, (4, 3)).data_ptr())
        blocks[c] = block.clone()
        seen.append(c)

    pz.symmetric.all_gather_apply(x, g, compute)
    return seen, blocks


def test_symmetric_gather_reads_peers_in_place():
    n = 3
    for res in run_ranks(rank_symmetric_in_place, n):
        seen, blocks = res.value
        r = res.rank
        assert seen == [True, r, True, (r - 1) % n, True, (r - 2) % n]
        for c in range(n):
            torch.testing.assert_close(blocks[c], torch.full((4, 3), float(c)), rtol=0, atol=0)


def rank_empty_first_fused_call():
    """A group's first fused calls have no rows (an empty batch), then a real one."""
    pz.init()
    r = pz.get_rank()
    w = torch.arange(12.0).view(3, 4)
    out = {}
    for sym in (True, False):
        g = pz.new_group(range(pz.get_world_size()), options={"symmetric": sym})
        out[sym] = [pz.tp.all_gather_matmul(torch.zeros(0, 4), w, group=g),
                    pz.tp.matmul_reduce_scatter(torch.zeros(0, 4), w, group=g),
                    pz.tp.all_gather_matmul(torch.full((2, 4), float(r + 1)), w, group=g)]
    return out


def test_fused_ops_take_an_empty_first_call():
    """Before, an empty first call on symmetric buffers (none made yet) raised IndexError."""
    n, w = 2, torch.arange(12.0).view(3, 4)
    want = torch.cat([torch.full((2, 4), float(c + 1)) for c in range(n)]) @ w.t()
    for res in run_ranks(rank_empty_first_fused_call, n):
        for sym, (ag0, rs0, ag) in res.value.items():
            assert ag0.shape == (0, 3) and rs0.shape == (0, 3), (sym, ag0.shape, rs0.shape)
            torch.testing.assert_close(ag, want, rtol=0, atol=0)


# ---------------------------------------------------------------------------
# Bad input: a clear error on every rank, and the group still works afterwards


def rank_errors():
    pz.init()
    r = pz.get_rank()
    col_sp = pz.tp.ColumnParallelLinear(8, 8, sequence_parallel=True)
    row_sp = pz.tp.RowParallelLinear(8, 8, sequence_parallel=True)
    V, T = ValueError, TypeError
    cases = [
        (lambda: pz.tp.ColumnParallelLinear(8, 7), V, "out_features=7 is not divisible by the tensor-parallel"),
        (lambda: pz.tp.ColumnParallelLinear(8, 8, bias="no"), T, "bias: expected True or False, got 'no'"),
        (lambda: pz.tp.RowParallelLinear(2 ** 63, 8), V, "in_features: expected a positive int (below 2**62)"),
        (lambda: pz.tp.all_gather_matmul(torch.randn(2, 0), torch.randn(3, 0)), V, "weight: expected 2 dims"),
        (lambda: pz.tp.RowParallelLinear(7, 8), V, "in_features=7 is not divisible"),
        (lambda: pz.tp.ParallelTransformerBlock.from_block(TransformerBlock(6, 3)), V, "heads=3 is not divisible"),
        (lambda: row_sp(torch.randn(3, 1, 4)), V, "dim 0 (sequence length) 3 is not divisible"),
        (lambda: pz.tp.scatter_to_sp(torch.randn(5, 2)), V, "input.shape[0] (sequence length)=5 is not divisible"),
        (lambda: pz.tp.matmul_reduce_scatter(torch.randn(3, 4), torch.randn(2, 4)), V, "dim 0 (sequence length) 3"),
        (lambda: pz.tp.all_gather_matmul(torch.randn(2, 5), torch.randn(2, 4)), V, "x_shard: expected shape"),
        (lambda: col_sp(torch.randn(2, 1, 5)), V, "input: expected shape (..., 8)"),
        (lambda: pz.tp.ColumnParallelLinear(8, 8, gather_output=True, sequence_parallel=True), V,
         "gather_output=True with sequence_parallel=True"),
        (lambda: pz.tp.RowParallelLinear(8, 8, input_is_parallel=False, sequence_parallel=True), V,
         "input_is_parallel=False with sequence_parallel=True"),
        (lambda: pz.mesh(dp=3, tp=1), V, "dp * tp = 3 must equal the world size 2"),
        (lambda: pz.mesh(dp=2.0, tp=1), T, "dp: expected an int"),
        (lambda: pz.tp.ColumnParallelLinear(8, 8, group="tp"), T, "group: expected a pz group"),
        (lambda: pz.tp.RowParallelLinear.from_linear(nn.Conv1d(2, 2, 1)), T, "linear: expected a torch.nn.Linear"),
        (lambda: pz.tp.copy_to_tp([1.0]), T, "input: expected a torch.Tensor, got list"),
        (lambda: pz.tp.reduce_from_tp(3.0), T, "input: expected a torch.Tensor, got float"),
        (lambda: pz.tp.scatter_to_tp(torch.tensor(1.0)), V, "input: expected a tensor with a feature dim (the last) "
                                                            "to split, got shape ()"),
        (lambda: pz.tp.gather_from_tp(torch.tensor(1.0)), V, "input: expected a tensor with a feature dim"),
        (lambda: pz.tp.gather_from_tp(None), T, "input: expected a torch.Tensor, got NoneType"),
        (lambda: pz.tp.gather_from_sp(torch.randn(2, 4)), T, "gather_from_sp: pass reduce_grad=False where every"),
        (lambda: pz.tp.gather_from_sp(torch.randn(2, 4), reduce_grad=1), T, "reduce_grad: expected True or False"),
        (lambda: TransformerBlock(16, 0), V, "heads: expected a positive int, got 0"),
        (lambda: TransformerBlock(0, 4), V, "hidden: expected a positive int, got 0"),
        (lambda: TransformerBlock(16, 4, mlp_ratio=0), V, "mlp_ratio: expected a positive int, got 0"),
        (lambda: TransformerBlock(16, "4"), T, "heads: expected an int, got str"),
        (lambda: pz.tp.causal_attention(torch.randn(4, 2, 10), 3), V,
         "qkv: expected shape (seq, batch, heads * 3 * head_dim) with heads=3, got (4, 2, 10)"),
        (lambda: pz.tp.causal_attention(torch.randn(4, 12), 1), V, "qkv: expected shape (seq, batch, "),
        (lambda: pz.tp.causal_attention(torch.randn(4, 2, 12), 0), V, "heads: expected a positive int, got 0"),
        # flags are bools: sequence_parallel="False" was read as True (weight gradients tp times too large)
        (lambda: pz.tp.ColumnParallelLinear(8, 8, sequence_parallel="False"), T,
         "sequence_parallel: expected True or False, got 'False'"),
        (lambda: pz.tp.RowParallelLinear(8, 8, overlap=0), T, "overlap: expected True or False, got 0"),
        (lambda: pz.tp.ColumnParallelLinear(8, 8, gather_output="yes"), T, "gather_output: expected True or False"),
        (lambda: pz.tp.RowParallelLinear(8, 8, input_is_parallel=1), T, "input_is_parallel: expected True or False"),
        (lambda: pz.tp.ParallelTransformerBlock.from_block(TransformerBlock(8, 2), sequence_parallel=1), T,
         "sequence_parallel: expected True or False, got 1"),
        (lambda: pz.tp.ParallelTransformerBlock.from_block(TransformerBlock(8, 2), overlap="no"), T,
         "overlap: expected True or False, got 'no'"),
        # from_linear takes the layer's options, not nn.Linear's
        (lambda: pz.tp.ColumnParallelLinear.from_linear(nn.Linear(8, 8), bias=False), T,
         "ColumnParallelLinear.from_linear: unknown option(s) ['bias']"),
        (lambda: pz.tp.RowParallelLinear.from_linear(nn.Linear(8, 8), gather_output=True), T,
         "RowParallelLinear.from_linear: unknown option(s) ['gather_output']"),
    ]
    problems = []
    for i, (fn, kind, text) in enumerate(cases):
        try:
            fn()
            problems.append(f"case {i}: nothing raised")
        except (TypeError, ValueError) as e:
            if type(e) is not kind or text not in str(e):
                problems.append(f"case {i}: {type(e).__name__}: {e}")
    t = torch.ones(3)
    pz.all_reduce(t)  # the group still works: no rank communicated before raising
    # Layers the ranks build differently (each valid alone) trained apart without a word: refused on every rank.
    for make, text in ((lambda: pz.tp.ColumnParallelLinear(4, 6 if r == 0 else 8),
                        "ColumnParallelLinear: the ranks of the tensor-parallel group [0, 1] built it with different "
                        "out_features (rank 0: 6, rank 1: 8)"),
                       (lambda: pz.tp.RowParallelLinear(8, 4, bias=r == 0),
                        "built it with different bias (rank 0: True, rank 1: False)"),
                       (lambda: pz.tp.RowParallelLinear.from_linear(nn.Linear(8, 4), overlap=r == 0),
                        "built it with different overlap")):
        try:
            make()
            problems.append(f"{text}: nothing raised")
        except ValueError as e:
            if text not in str(e):
                problems.append(f"{text}: {e}")
    # Sequence shards that differ between ranks cannot be checked locally; the transport reports them.
    n = pz.get_world_size()
    groups = {sym: pz.new_group(range(n), options={"symmetric": sym}) for sym in (True, False)}
    for overlap, sym, text in ((False, True, "mismatched collective"),
                               (True, True, "mismatched collective: this rank called fused symmetric all_gather"),
                               (True, False, "mismatched send/recv")):
        try:
            pz.tp.ColumnParallelLinear(4, 4, sequence_parallel=True, overlap=overlap,
                                       group=groups[sym])(torch.randn(2 + r, 1, 4))
            problems.append(f"uneven shards, overlap={overlap}, symmetric={sym}: nothing raised")
        except pz.CollectiveError as e:
            if text not in str(e):
                problems.append(f"uneven shards, overlap={overlap}, symmetric={sym}: {e}")
    return problems, t


def rank_mesh_disagrees():
    """Ranks that pass different mesh shapes (each valid alone) or an invalid one on one rank only."""
    pz.init(timeout=20)
    r = pz.get_rank()
    out = []
    for dp, tp in (((2, 1), (1, 2)), ((2, 1), (3, 1)), ((2, 1), (2.0, 1))):
        start = time.monotonic()
        try:
            pz.mesh(*(dp if r == 0 else tp))
            out.append(("nothing raised", 0.0))
        except (TypeError, ValueError) as e:
            out.append((f"{type(e).__name__}: {e}", time.monotonic() - start))
    dp_group, tp_group = pz.mesh(dp=1, tp=2)  # the world still works, and so does an agreed mesh
    t = torch.ones(1)
    pz.all_reduce(t, group=tp_group)
    return out, t.item(), dp_group.ranks, tp_group.ranks


def test_mesh_shapes_that_differ_between_ranks_raise_on_every_rank():
    for res in run_ranks(rank_mesh_disagrees, 2, timeout=60):
        out, total, dp_ranks, tp_ranks = res.value
        (differ, t0), (one_bad, t1), (one_float, t2) = out
        assert differ.startswith("ValueError: mesh: expected the same dp and tp on every rank, got "
                                 "[(2, 1), (1, 2)] (by global rank)"), differ
        own = "ValueError: mesh(dp=3, tp=1): dp * tp = 3 must equal the world size 2"
        assert one_bad == (own if res.rank == 1 else "ValueError: mesh: global rank 1 passed an invalid dp or tp; "
                           "expected positive ints with dp * tp = 2 on every rank"), one_bad
        own = "TypeError: dp: expected an int mesh axis size, got float"
        assert one_float == (own if res.rank == 1 else "ValueError: mesh: global rank 1 passed an invalid dp or tp; "
                             "expected positive ints with dp * tp = 2 on every rank"), one_float
        assert max(t0, t1, t2) < 10, "raised at once, not at the group's timeout"
        assert (total, dp_ranks, tp_ranks) == (2.0, (res.rank,), (0, 1))


def test_bad_input_raises_clear_errors_on_every_rank():
    for res in run_ranks(rank_errors, 2):
        problems, t = res.value
        assert problems == [], f"rank {res.rank}"
        torch.testing.assert_close(t, torch.full((3,), 2.0))


# ---------------------------------------------------------------------------
# DP x TP mesh and training


# (name, optimizer, kwargs, sequence_parallel, overlap). The key bias has an exactly-zero gradient
# (softmax ignores a per-query constant), so its computed gradient is rounding noise; Adam's default
# eps=1e-8 would turn that noise into full-size steps.
RUNS = [("sgd", torch.optim.SGD, dict(lr=0.1, momentum=0.9), False, False),
        ("adamw", torch.optim.AdamW, dict(lr=1e-2, eps=1e-4), True, True)]


def rank_mesh_training(steps):
    pz.init()
    dp_group, tp_group = pz.mesh(dp=2, tp=2)
    checks = {"dp": dp_group.ranks, "tp": tp_group.ranks}
    for axis, g in (("dp", dp_group), ("tp", tp_group)):
        t = torch.tensor([float(pz.get_rank())])
        pz.all_reduce(t, group=g)
        checks[axis + "_sum"] = t.item()
    x_all, t_all = make_data(batch=4)
    i = dp_group.rank  # this replica's half of the batch (dim 1)
    x, t = x_all[:, 2 * i:2 * i + 2], t_all[:, 2 * i:2 * i + 2]
    runs = {}
    for name, opt_cls, kwargs, sp, overlap in RUNS:
        model = pz.tp.ParallelTransformerBlock.from_block(make_block(), group=tp_group, sequence_parallel=sp,
                                                          overlap=overlap)
        opt = opt_cls(model.parameters(), **kwargs)
        for _ in range(steps):
            opt.zero_grad()
            h = pz.tp.scatter_to_sp(x, group=tp_group) if sp else x
            y = model(h)
            y = pz.tp.gather_from_sp(y, group=tp_group, reduce_grad=False) if sp else y
            F.mse_loss(y, t).backward()
            for p in model.parameters():
                pz.all_reduce(p.grad, op="avg", group=dp_group)
            opt.step()
        runs[name] = {n: p.detach() for n, p in model.named_parameters()}
    return checks, runs


def test_dp_x_tp_training_matches_single_process():
    steps = 3
    results = run_ranks(rank_mesh_training, 4, args=(steps,))
    x, t = make_data(batch=4)
    for name, opt_cls, kwargs, _, _ in RUNS:
        ref = make_block()
        opt = opt_cls(ref.parameters(), **kwargs)
        for _ in range(steps):
            opt.zero_grad()
            F.mse_loss(ref(x), t).backward()
            opt.step()
        assert any((p - q).abs().max() > 1e-3 for p, q in zip(ref.parameters(), make_block().parameters()))
        for res in results:
            tp_rank = res.rank % 2
            params = res.value[1][name]
            for n, p in ref.named_parameters():
                torch.testing.assert_close(params[n], shard_of(n, p.detach(), tp_rank, 2), **TOL,
                                           msg=lambda m: f"rank {res.rank} {name} {n}: {m}")
    for res in results:
        r = res.rank
        checks = res.value[0]
        assert checks["tp"] == (r // 2 * 2, r // 2 * 2 + 1) and checks["dp"] == (r % 2, r % 2 + 2)
        assert checks["tp_sum"] == sum(checks["tp"]) and checks["dp_sum"] == sum(checks["dp"])


def test_bench_tp_runs_end_to_end(tmp_path):
    import argparse
    import json

    from pyzero.bench import tp as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "tp.json"
    args = parser.parse_args(["--nproc", "2", "--rows", "16", "--hidden", "8", "--widths", "4,8", "--iters", "2",
                              "--warmup", "1", "--flush-mib", "1", "--json", str(out)])
    assert bench.main(args) == 0  # non-zero when an overlapped result differs from the serial one
    rec = json.loads(out.read_text())
    assert {"machine", "versions", "date", "results"} <= set(rec)
    rows = rec["results"]
    assert {(r["op"], r["compute"], r["width"]) for r in rows} == {
        (op, c, w) for op in bench.OPS for c in bench.COMPUTES for w in (4, 8)}
    assert all(r["rel_err"] < 1e-5 and r["overlap_us"] > 0 and r["serial_us"] > 0 and r["ring_us"] > 0
               for r in rows)


def test_tp_block_example_matches_one_process():
    """examples/tp_block.py: 2 DP x 2 TP with ZeroOptimizer and clipping ends where one process does."""
    import re
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, str(root / "examples" / "tp_block.py")], capture_output=True, text=True,
                         timeout=120, cwd=root, env=env)
    assert out.returncode == 0, out.stdout + out.stderr
    norms = [float(m) for m in re.findall(r"gradient norm ([0-9.]+)", out.stdout)]
    assert len(norms) == 5 and min(norms) > 0.2, out.stdout  # clipping (at 0.2) acts at every step
    err = float(re.search(r"single process\| over all parameters: ([0-9.e+-]+)", out.stdout).group(1))
    assert err < 1e-5, out.stdout


def rank_seeded_apart():
    pz.init()
    torch.manual_seed(100 + pz.get_rank())  # a per-rank seed
    row = pz.tp.RowParallelLinear(32, 4)
    block = TransformerBlock(HIDDEN, HEADS)
    with torch.no_grad():
        block.ln1.weight.uniform_()  # (different on every rank)
    par = pz.tp.ParallelTransformerBlock.from_block(block)
    return row.bias.detach().clone(), {k: v.detach().clone() for k, v in par.ln1.state_dict().items()}


def test_replicated_parameters_take_the_first_ranks_values():
    """A row layer's bias and a block's LayerNorms are whole on every rank with equal gradients: ranks seeded
    apart would keep different values (and outputs) for good; they take the group's first rank's."""
    (b0, ln0), (b1, ln1) = (r.value for r in run_ranks(rank_seeded_apart, 2))
    assert torch.equal(b0, b1)
    for k in ln0:
        assert torch.equal(ln0[k], ln1[k]), k
