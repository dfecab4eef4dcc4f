"""DataParallel and gradient bucketing.

Multi-rank runs are compared with one plain-torch process on the full batch
(same seed, AdamW): with the loss a mean over equal shards, the average of
the shard gradients is the full-batch gradient. Bucket assignment and the
C++ pack/unpack loops are checked without ranks, against torch.cat / casts.
"""
import copy
import io
import re
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero import bucketing
from pyzero.bucketing import InFlight, assign_buckets, flat_buckets, pack, unpack
from pyzero.zero import FlatLayout
from pyzero.bench.common import UsageError
from pyzero.launch import run_ranks

from outcomes import outcome

STEPS, BATCH, DIM, VOCAB = 4, 12, 16, 24
FP32 = dict(rtol=1e-6, atol=1e-6)  # atol: AdamW entries that pass near 0 (values ~0.1)
TINY_MB = 1e-4  # ~100 bytes: about one parameter per bucket


# ---------------------------------------------------------------------------
# Bucket assignment (no ranks)


def _params(*specs):
    return [nn.Parameter(torch.zeros(n, dtype=dt)) for n, dt in specs]


def test_buckets_reverse_order_first_bucket_small_and_caps():
    f32 = torch.float32
    ps = _params((10, f32), (300, f32), (50, f32), (50, f32), (20, f32), (5, f32))  # bytes: 40,1200,200,200,80,20
    specs = assign_buckets(ps, bucket_bytes=400, first_bucket_bytes=100)
    # reverse: 5(20B) 4(80B) -> 100B >= first cap; 3+2 = 400B; 1 alone (1200B >= 400); 0 left over
    assert [s.params for s in specs] == [(5, 4), (3, 2), (1,), (0,)]
    assert [s.numel for s in specs] == [25, 100, 300, 10]
    assert specs[0].offsets == (0, 5) and specs[1].offsets == (0, 50)
    assert [s.index for s in specs] == [0, 1, 2, 3]


def test_buckets_one_dtype_each_first_cap_per_dtype():
    f32, f64 = torch.float32, torch.float64
    ps = _params((8, f64), (4, f32), (8, f64), (4, f32), (8, f64), (4, f32))  # f64: 64 B each, f32: 16 B each
    specs = assign_buckets(ps, bucket_bytes=128, first_bucket_bytes=32)
    for s in specs:
        assert {ps[i].dtype for i in s.params} == {s.dtype}
    # reverse order 5,4,3,2,1,0; f32: first bucket closes at 32 B (5,3), then (1); f64: (4) alone >= 32 B, then (2,0)
    assert [s.params for s in specs] == [(5, 3), (4,), (2, 0), (1,)]
    assert sorted(i for s in specs for i in s.params) == list(range(6))


def test_buckets_reject_non_positive_sizes():
    with pytest.raises(ValueError, match="bucket sizes must be positive"):
        assign_buckets(_params((4, torch.float32)), 0, 10)


def test_flat_buckets_contiguous_on_parameter_boundaries_padding_last():
    ps = _params((10, torch.float32), (30, torch.float32), (5, torch.float32), (6, torch.float32))
    layout = FlatLayout(ps, ["a", "b", "c", "d"], world=4)  # 51 elements, padded to 52
    # caps of 12: [a b] closes at 40 >= 12, [c d] = 11 stays open and takes the padding
    assert flat_buckets(layout, 12) == [(0, 40, [0, 1]), (40, 52, [2, 3])]
    # cap 5: every parameter closes its own bucket; the padding joins the last one
    assert flat_buckets(layout, 5) == [(0, 10, [0]), (10, 40, [1]), (40, 45, [2]), (45, 52, [3])]
    assert flat_buckets(layout, 10**9) == [(0, 52, [0, 1, 2, 3])]


class _FakeWork:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def wait(self):
        self.log.append(("wait", self.name))


def test_inflight_bounds_outstanding_and_retires_in_launch_order():
    log = []
    q = InFlight(limit=2)
    for i in range(4):
        q.add(_FakeWork(log, i), lambda i=i: log.append(("done", i)), key=i)
    # the 3rd and 4th add each retired the oldest one, waiting before folding
    assert log == [("wait", 0), ("done", 0), ("wait", 1), ("done", 1)]
    assert [k for k, _ in q.entries()] == [2, 3]
    q.retire()
    assert log[4:] == [("wait", 2), ("done", 2), ("wait", 3), ("done", 3)] and len(q) == 0
    now = InFlight(limit=0)  # no overlap: each is waited for as it is added
    now.add(_FakeWork(log, 9), lambda: log.append(("done", 9)))
    assert log[-2:] == [("wait", 9), ("done", 9)] and len(now) == 0


def test_device_flags_copied_once_per_vector_and_never_in_a_capture(monkeypatch):
    """DeviceFlags: one host copy per distinct vector, fresh clones after (writing one leaves the next
    intact); a capture reuses a made vector, cannot make a new one, and keeps the vectors it read when
    the cache is trimmed."""
    made = []
    real = torch.tensor
    monkeypatch.setattr(bucketing.torch, "tensor", lambda *a, **k: (made.append(a[0]), real(*a, **k))[1])
    flags = bucketing.DeviceFlags("owner", keep=2)
    cpu = torch.device("cpu")
    a = flags.get([True, False, True], cpu, capturing=False)
    assert a.dtype == torch.int32 and a.tolist() == [1, 0, 1]
    a.fill_(7)  # an all-reduce writes its copy
    b = flags.get([1, 0, 1], cpu, capturing=True)
    assert b.tolist() == [1, 0, 1] and b.data_ptr() != a.data_ptr()
    assert made == [(1, 0, 1)]
    with pytest.raises(RuntimeError, match=r"^owner: a backward captured into a CUDA graph used other parameters "
                                           r"than the eager steps.*run an eager step"):
        flags.get([0, 0, 1], cpu, capturing=True)
    flags.get([1, 1, 1], cpu, capturing=False)
    flags.get([0, 1, 1], cpu, capturing=False)  # over `keep`: the uncaptured vectors go, (1, 0, 1) stays
    assert len(flags) == 2 and made == [(1, 0, 1), (1, 1, 1), (0, 1, 1)]
    assert flags.get([1, 0, 1], cpu, capturing=True).tolist() == [1, 0, 1]
    assert len(made) == 3


def test_inflight_discard_waits_but_folds_nothing():
    log = []
    q = InFlight()
    for i in range(3):
        q.add(_FakeWork(log, i), lambda i=i: log.append(("done", i)))
    q.discard()
    assert log == [("wait", 0), ("wait", 1), ("wait", 2)] and len(q) == 0


# ---------------------------------------------------------------------------
# Fused pack / unpack (C++) against torch.cat and casts


def _mixed_tensors():
    g = torch.Generator().manual_seed(0)
    dts = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.float32)
    return [torch.randn(n, generator=g).to(dt) for n, dt in zip((7, 33, 5, 12, 1), dts)]


def _scaled(t, scale, dtype):
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    return (t.to(acc) * scale).to(dtype)


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.7])
def test_pack_matches_cat_and_casts(flat_dtype, scale):
    ts = _mixed_tensors()
    offsets = [0]
    for t in ts[:-1]:
        offsets.append(offsets[-1] + t.numel())
    flat = torch.full((sum(t.numel() for t in ts) + 3,), 7.0, dtype=flat_dtype)
    pack(ts, flat, offsets, scale=scale)
    expect = torch.cat([_scaled(t, scale, flat_dtype) for t in ts])
    assert torch.equal(flat[:expect.numel()], expect)
    assert torch.equal(flat[expect.numel():], torch.full((3,), 7.0, dtype=flat_dtype))  # nothing past the table


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16])
def test_unpack_matches_slices_and_casts(flat_dtype):
    g = torch.Generator().manual_seed(1)
    flat = torch.randn(60, generator=g).to(flat_dtype)
    dts = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    outs = [torch.empty(n, dtype=dt) for n, dt in zip((10, 20, 5, 8), dts)]
    offsets = [50, 3, 23, 40]  # any order, gaps allowed
    unpack(flat, outs, offsets, scale=0.5)
    for t, o in zip(outs, offsets):
        assert torch.equal(t, _scaled(flat[o:o + t.numel()], 0.5, t.dtype))


@pytest.mark.parametrize("flat_dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("scale", [1.0, 0.125, 3.7])
def test_gpu_copy_path_equals_the_cpp_loops(flat_dtype, scale):
    """pack/unpack's torch path (taken for CUDA tensors), run here on CPU tensors: the same values
    as the C++ loops, bit for bit."""
    ts = _mixed_tensors()
    offsets = [0]
    for t in ts[:-1]:
        offsets.append(offsets[-1] + t.numel())
    n = sum(t.numel() for t in ts)
    cpp, torch_path = torch.full((n,), 7.0, dtype=flat_dtype), torch.full((n,), 7.0, dtype=flat_dtype)
    pack(ts, cpp, offsets, scale=scale)
    bucketing._device_copies(ts, torch_path, offsets, scale, True)
    assert torch.equal(cpp, torch_path)
    outs_cpp = [torch.empty_like(t) for t in ts]
    outs_torch = [torch.empty_like(t) for t in ts]
    unpack(cpp, outs_cpp, offsets, scale=scale)
    bucketing._device_copies(outs_torch, cpp, offsets, scale, False)
    for a, b in zip(outs_cpp, outs_torch):
        assert torch.equal(a, b)


def test_pack_merges_adjacent_views_and_copies_ints():
    base = torch.arange(20, dtype=torch.int64)
    views = [base[0:5], base[5:12], base[12:20]]  # adjacent in memory and in the flat: one row
    flat = torch.zeros(20, dtype=torch.int32)
    pack(views, flat, [0, 5, 12])
    assert torch.equal(flat, base.to(torch.int32))


def test_pack_rejects_bad_tables():
    flat = torch.zeros(10)
    with pytest.raises(ValueError, match=r"offsets\[0\]=8: tensor of 4 elements does not fit"):
        pack([torch.ones(4)], flat, [8])
    with pytest.raises(ValueError, match=r"tensors\[0\]: expected a contiguous CPU tensor"):
        pack([torch.ones(4, 4).t()], torch.zeros(16), [0])
    with pytest.raises(TypeError, match=r"tensors\[1\]: dtype torch.complex64 is not supported"):
        pack([torch.ones(2), torch.ones(2, dtype=torch.complex64)], flat, [0, 2])
    with pytest.raises(ValueError, match="offsets: expected one offset per tensor"):
        pack([torch.ones(2)], flat, [0, 2])
    with pytest.raises(ValueError, match="scale != 1 needs floating-point"):
        pack([torch.ones(2, dtype=torch.int32)], flat, [0], scale=2.0)


# ---------------------------------------------------------------------------
# Models and the single-process reference


class Features(nn.Module):
    """Tied embedding/head, a frozen layer, a layer only rank 1's shard uses,
    a layer nobody uses, and a float64 layer (its own bucket)."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.frozen = nn.Linear(DIM, DIM).requires_grad_(False)
        self.body = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM)
        self.dead = nn.Linear(DIM, DIM)
        self.side = nn.Linear(DIM, DIM).double()
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, idx, use_extra):
        h = torch.tanh(self.body(self.frozen(self.emb(idx))))
        if use_extra:
            h = h + self.extra(h)
        h = h + self.side(h.double()).float()
        return self.head(h)


def make_mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def make_features():
    torch.manual_seed(0)
    return Features()


MODELS = {"mlp": make_mlp, "features": make_features}


def batch(model_name, step):
    g = torch.Generator().manual_seed(100 + step)
    if model_name == "mlp":
        return torch.randn(BATCH, DIM, generator=g), torch.randn(BATCH, 4, generator=g)
    return torch.randint(0, VOCAB, (BATCH, 5), generator=g), torch.randint(0, VOCAB, (BATCH, 5), generator=g)


def shard_loss(model, model_name, x, y, rank):
    if model_name == "mlp":
        return F.mse_loss(model(x), y)
    return F.cross_entropy(model(x, use_extra=rank == 1).flatten(0, 1), y.flatten())


def reference(model_name, n, steps=STEPS):
    """One process, full batch: the loss is the mean of the n shard losses."""
    model = MODELS[model_name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(steps):
        x, y = batch(model_name, step)
        opt.zero_grad()
        loss = sum(shard_loss(model, model_name, xs, ys, r) for r, (xs, ys) in
                   enumerate(zip(x.chunk(n), y.chunk(n)))) / n
        loss.backward()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def train_rank(model_name, n, bucket_mb, micro=1, comm_dtype=None, zero_after_forward=False):
    pz.init()
    rank = pz.get_rank()
    model = MODELS[model_name]()
    if rank != 0:  # wrapping must replace these with rank 0's weights
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
    dp = pz.DataParallel(model, bucket_mb=bucket_mb, first_bucket_mb=bucket_mb, comm_dtype=comm_dtype)
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
    pz.comm_stats(reset=True)
    for step in range(STEPS):
        x, y = batch(model_name, step)
        xs, ys = x.chunk(n)[rank].chunk(micro), y.chunk(n)[rank].chunk(micro)
        opt.zero_grad()
        for m in range(micro):
            sync = dp.no_sync() if m < micro - 1 else torch.enable_grad()
            with sync:
                loss = shard_loss(dp, model_name, xs[m], ys[m], rank) / micro
                if zero_after_forward:  # autograd then makes fresh gradients, packed at launch
                    opt.zero_grad(set_to_none=True)
                loss.backward()
        opt.step()
    grads_none = sorted(n_ for n_, p in model.named_parameters() if p.grad is None)
    in_buckets = sum(len(b.params) for b in dp.buckets)
    calls = pz.comm_stats().get("all_reduce", {}).get("calls", 0)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, grads_none, in_buckets, \
        len(dp.buckets), calls


def check_state(got, want, tol):
    assert got.keys() == want.keys()
    for k in want:
        torch.testing.assert_close(got[k], want[k], **tol, msg=lambda m, k=k: f"{k}: {m}")


# ---------------------------------------------------------------------------
# Equivalence with one process


@pytest.mark.parametrize("n", [2, 3])
@pytest.mark.parametrize("bucket_mb", [25, TINY_MB])
def test_matches_single_process(n, bucket_mb):
    want = reference("mlp", n)
    for r in run_ranks(train_rank, n, args=("mlp", n, bucket_mb), timeout=60):
        state, none, in_buckets, nbuckets, calls = r.value
        check_state(state, want, FP32)
        # one all-reduce per bucket and one of the used flags per step
        assert nbuckets == (1 if bucket_mb == 25 else 5) and calls == (nbuckets + 1) * STEPS


def rewrap_rank(n):
    pz.init()
    rank = pz.get_rank()
    model = MODELS["mlp"]()
    first = pz.DataParallel(model, bucket_mb=TINY_MB, first_bucket_mb=TINY_MB)
    dp = pz.DataParallel(model, bucket_mb=TINY_MB, first_bucket_mb=TINY_MB)  # the same module again
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch("mlp", step)
        opt.zero_grad()
        shard_loss(dp, "mlp", x.chunk(n)[rank], y.chunk(n)[rank], rank).backward()
        opt.step()
    old = outcome(lambda: first(batch("mlp", 0)[0]))
    nested = outcome(lambda: pz.DataParallel(dp))
    pz.distributed.init_torch("gloo")
    ddp = outcome(lambda: pz.DataParallel(nn.Sequential(nn.parallel.DistributedDataParallel(MODELS["mlp"]()))))
    added = MODELS["mlp"]()
    dp2 = pz.DataParallel(added)
    added.append(nn.Linear(DIM, DIM))  # a layer added after wrapping
    late = outcome(lambda: dp2(batch("mlp", 0)[0]))
    again = outcome(lambda: dp2(batch("mlp", 0)[0]))  # (refused at every forward, not once)
    assert again == late, (again, late)
    torch.distributed.destroy_process_group()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, old, nested, ddp, late


def test_wrapping_again_nesting_and_parameters_added_after():
    """A module wrapped again: the later wrapper alone reduces (two reducers adopting one gradient corrupted
    it) and trains as one process; the earlier one refuses its forward. pz.DataParallel around a
    pz.DataParallel or a torch DDP is refused; parameters added after wrapping raise at the next forward
    (their gradients would stay each rank's own)."""
    n = 2
    want = reference("mlp", n)
    for r in run_ranks(rewrap_rank, n, args=(n,), timeout=60):
        state, old, nested, ddp, late = r.value
        check_state(state, want, FP32)
        assert old[0] == "RuntimeError" and "a later pz.DataParallel wraps the same module" in old[1], old
        assert nested[0] == "ValueError" and nested[1].startswith("module: already a pz.DataParallel"), nested
        assert ddp[0] == "ValueError" and "'0' is a torch DistributedDataParallel" in ddp[1], ddp
        assert late[0] == "RuntimeError" and "were added or replaced after pz.DataParallel wrapped" in late[1], late
        assert f"['{len(MODELS['mlp']())}.weight', '{len(MODELS['mlp']())}.bias']" in late[1], late


@pytest.mark.parametrize("n", [2, 3])
def test_tied_frozen_unused_and_mixed_dtypes(n):
    want = reference("features", n)
    for r in run_ranks(train_rank, n, args=("features", n, TINY_MB), timeout=60):
        state, none, in_buckets, _, _ = r.value
        check_state(state, want, FP32)
        # tied weight once; frozen skipped: emb, body(2), extra(2), dead(2), side(2)
        assert in_buckets == 9
        assert none == ["dead.bias", "dead.weight", "frozen.bias", "frozen.weight"]


def test_gradients_replaced_after_forward_are_packed():
    want = reference("mlp", 2)
    for r in run_ranks(train_rank, 2, args=("mlp", 2, TINY_MB), kwargs={"zero_after_forward": True}):
        check_state(r.value[0], want, FP32)


def _rank_gradients_move(comm_dtype):
    """One synced step, one no_sync step, one synced step, with the gradients looked at in between."""
    pz.init()
    rank = pz.get_rank()
    dp = pz.DataParallel(make_mlp(), bucket_mb=TINY_MB, first_bucket_mb=TINY_MB, comm_dtype=comm_dtype)
    params = list(dp.module.parameters())
    slot = {id(p): (bucket, k) for bucket in dp.buckets for k, p in enumerate(bucket.params)}

    def in_slot(p):
        bucket, k = slot[id(p)]
        return p.grad is not None and p.grad.data_ptr() == bucket.views[k].data_ptr()

    at_hook = []  # (registered after DataParallel's hooks: runs right after the gradient moved)
    for p in params:
        p.register_post_accumulate_grad_hook(lambda p: at_hook.append(in_slot(p)))
    x, y = batch("mlp", 0)
    loss = F.mse_loss(dp(x.chunk(2)[rank]), y.chunk(2)[rank])
    after_forward = [p.grad is None for p in params]
    loss.backward()
    synced = [in_slot(p) for p in params], [p.grad.clone() for p in params], list(at_hook)
    at_hook.clear()
    dp.zero_grad(set_to_none=True)
    with dp.no_sync():
        F.mse_loss(dp(x.chunk(2)[rank]), y.chunk(2)[rank]).backward()
    local = [in_slot(p) for p in params], [p.grad.clone() for p in params]
    F.mse_loss(dp(x.chunk(2)[rank]), y.chunk(2)[rank]).backward()
    again = [in_slot(p) for p in params], [p.grad.clone() for p in params]
    return after_forward, synced, local, again


@pytest.mark.parametrize("comm_dtype", [None, torch.bfloat16])
def test_gradients_move_into_buckets_as_autograd_makes_them(comm_dtype):
    """As DDP with gradient_as_bucket_view: forward leaves the gradients alone (None after zero_grad),
    each gradient is in its bucket slot as soon as autograd has made it, the ranks' average once
    backward returns; under no_sync the gradients stay where autograd made them (local sums), and the
    next synced backward moves the accumulated sums in."""
    model = make_mlp()
    x, y = batch("mlp", 0)
    full = [torch.autograd.grad(F.mse_loss(model(xs), ys), list(model.parameters()))
            for xs, ys in zip(x.chunk(2), y.chunk(2))]
    mean = [(a + b) / 2 for a, b in zip(*full)]
    tol = FP32 if comm_dtype is None else dict(rtol=1e-2, atol=1e-3)
    for r in run_ranks(_rank_gradients_move, 2, args=(comm_dtype,), timeout=60):
        after_forward, synced, local, again = r.value
        assert all(after_forward)
        assert all(synced[0]) and all(synced[2]) and len(synced[2]) == len(mean)
        for g, want in zip(synced[1], mean):
            torch.testing.assert_close(g, want, **tol)
        assert not any(local[0])
        for g, want in zip(local[1], full[r.rank]):
            torch.testing.assert_close(g, want, **FP32)
        assert all(again[0])
        for g, want in zip(again[1], mean):  # (no_sync's local gradient plus this backward's, averaged)
            torch.testing.assert_close(g, 2 * want, **tol)


class _HalfUsed(nn.Module):
    def __init__(self):
        super().__init__()
        self.used, self.unused = nn.Linear(DIM, 4), nn.Linear(DIM, 4)

    def forward(self, x):
        return self.used(x)


def _rank_capture_path(n):
    """Two eager steps, then steps as a CUDA graph capture issues them (pyzero.parallel._capturing patched):
    the flags made from host values once, their reduction not read back; then the errors of a captured
    backward."""
    import pyzero.parallel as parallel  # noqa: PLC0415

    pz.init()
    rank = pz.get_rank()
    model = make_mlp()
    dp = pz.DataParallel(model, bucket_mb=TINY_MB, first_bucket_mb=TINY_MB)
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
    made = []
    real_tensor = torch.tensor

    def counting_tensor(*a, **k):
        made.append(a)
        return real_tensor(*a, **k)

    for step in range(STEPS):
        x, y = batch("mlp", step)
        if step == 2:  # from here on, as inside torch.cuda.graph
            parallel._capturing = lambda device: True
            parallel.torch.tensor = counting_tensor
        opt.zero_grad(set_to_none=step % 2 == 0)  # (missing gradients that every rank uses are fine)
        shard_loss(dp, "mlp", x.chunk(n)[rank], y.chunk(n)[rank], rank).backward()
        opt.step()
    parallel.torch.tensor = real_tensor
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    errors = []
    try:
        dp.reducer._flags([0] * 6)  # flags no eager step made
    except RuntimeError as e:
        errors.append(str(e))
    half = pz.DataParallel(_HalfUsed())
    try:  # `unused` gets no gradient: whether to drop it is a host decision, which a capture cannot make
        half(torch.ones(2, DIM)).sum().backward()
    except RuntimeError as e:
        errors.append(str(e))
    return state, len(made), len(dp.reducer.flags), errors


def _rank_count_flag_reads(model_name, n):
    """Steps with zero_grad(set_to_none=True): how often the reduced flags were read on the host."""
    pz.init()
    rank = pz.get_rank()
    dp = pz.DataParallel(MODELS[model_name](), bucket_mb=TINY_MB, first_bucket_mb=TINY_MB)
    opt = torch.optim.AdamW(dp.parameters(), lr=1e-2)
    reads = []
    real = dp.reducer._drop_unused
    dp.reducer._drop_unused = lambda used, missing: (reads.append(1), real(used, missing))
    for step in range(STEPS):
        x, y = batch(model_name, step)
        opt.zero_grad(set_to_none=True)
        shard_loss(dp, model_name, x.chunk(n)[rank], y.chunk(n)[rank], rank).backward()
        opt.step()
    return len(reads), sorted(k for k, p in dp.module.named_parameters() if p.grad is None)


@pytest.mark.parametrize("n", [2, 3])
def test_captured_step_copies_no_flags_and_reads_none_back(n):
    """The DataParallel step a CUDA graph capture issues (see [Note: DataParallel's used flags]): the steps
    train as one process; no flags tensor is made from host values; flags no eager step made, and a
    backward that leaves a parameter without a gradient (to be dropped or not by the host), are clear errors."""
    want = reference("mlp", n)
    for r in run_ranks(_rank_capture_path, n, args=(n,), timeout=60):
        state, made, cached, errors = r.value
        check_state(state, want, FP32)
        assert made == 0 and cached == 1
        assert len(errors) == 2, errors
        assert "run an eager step of the same model" in errors[0]
        assert "unused.bias, unused.weight got no gradient in this backward, which is captured" in errors[1]
        assert "zero_grad(set_to_none=False)" in errors[1]


def test_flags_read_back_only_where_a_gradient_may_be_dropped():
    """Every parameter used on every rank (mlp): the flags are reduced but never read on the host, so the
    host does not wait for the end of backward; with parameters some rank leaves unused (features) they
    are read each step and the unused ones stay None, as in one process."""
    for r in run_ranks(_rank_count_flag_reads, 2, args=("mlp", 2), timeout=60):
        assert r.value == (0, [])
    for r in run_ranks(_rank_count_flag_reads, 2, args=("features", 2), timeout=60):
        reads, none = r.value
        assert reads == STEPS
        assert none == ["dead.bias", "dead.weight", "frozen.bias", "frozen.weight"]


@pytest.mark.parametrize("n", [2, 3])
def test_no_sync_accumulation_equals_large_batch(n):
    want = reference("mlp", n)
    for r in run_ranks(train_rank, n, args=("mlp", n, TINY_MB), kwargs={"micro": 2}, timeout=60):
        state, _, _, nbuckets, calls = r.value
        check_state(state, want, FP32)
        assert calls == (nbuckets + 1) * STEPS  # the no_sync micro-batches sent nothing


def bf16_reference(n):
    """The algorithm in plain torch: each shard's gradient rounded to bf16, summed in
    fp32, averaged and rounded once to bf16, then AdamW in fp32."""
    model = make_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(STEPS):
        x, y = batch("mlp", step)
        sums = [torch.zeros_like(p) for p in model.parameters()]
        for xs, ys in zip(x.chunk(n), y.chunk(n)):
            model.zero_grad()
            F.mse_loss(model(xs), ys).backward()
            for s, p in zip(sums, model.parameters()):
                s += p.grad.bfloat16().float()
        for s, p in zip(sums, model.parameters()):
            p.grad = (s / n).bfloat16().float()
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("n", [2, 3])
def test_bf16_communication(n):
    exact, fp32 = bf16_reference(n), reference("mlp", n)
    for r in run_ranks(train_rank, n, args=("mlp", n, TINY_MB), kwargs={"comm_dtype": torch.bfloat16}):
        check_state(r.value[0], exact, dict(rtol=1e-5, atol=1e-6))
        check_state(r.value[0], fp32, dict(rtol=0, atol=3e-2))


# ---------------------------------------------------------------------------
# Overlap: buckets go out while backward is still running


def overlap_rank():
    pz.init()
    model = make_mlp()
    dp = pz.DataParallel(model, bucket_mb=TINY_MB, first_bucket_mb=TINY_MB)
    seen = {}

    def first_layer_hook(module, grad_output):
        # The first layer's backward runs last. Bucket 0 (the last layer's weights)
        # was launched long before; its all-reduce must finish while we wait here.
        seen["launched"] = [b for b, e in dp.bucket_log if e == "launch"]
        b0, work = dp.reducer._inflight.entries()[0]
        deadline = time.monotonic() + 5.0
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.005)
        seen["bucket0_done_during_backward"] = (b0, work.is_completed())

    model[0].register_full_backward_pre_hook(first_layer_hook)
    x, y = batch("mlp", 0)
    F.mse_loss(dp(x), y).backward()
    return seen, list(dp.bucket_log)


def test_first_bucket_reduced_while_backward_runs():
    for r in run_ranks(overlap_rank, 2):
        seen, log = r.value
        assert seen["launched"][:1] == [0] and seen["bucket0_done_during_backward"] == (0, True)
        last_grad = max(i for i, (_, e) in enumerate(log) if e == "grad")
        assert log.index((0, "launch")) < last_grad
        assert [b for b, e in log if e == "launch"] == list(range(5))  # in bucket order


# ---------------------------------------------------------------------------
# Buffers: rank 0's are broadcast before every training forward


def make_bn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(DIM, 8), nn.BatchNorm1d(8))


def bn_rank(n, broadcast_buffers):
    pz.init()
    rank = pz.get_rank()
    model = make_bn()
    if rank != 0:
        model[1].running_mean.fill_(5.0)  # wrapping replaces it with rank 0's (broadcast_buffers=False: keeps it)
    dp = pz.DataParallel(model, broadcast_buffers=broadcast_buffers)
    for step in range(3):
        dp(batch("mlp", step)[0].chunk(n)[rank])
    return {k: v.clone() for k, v in model[1].state_dict().items()}


@pytest.mark.parametrize("broadcast_buffers", [True, False])
def test_buffers_follow_rank0_each_forward(broadcast_buffers):
    n = 2
    for r in run_ranks(bn_rank, n, args=(n, broadcast_buffers)):
        ref = make_bn()
        if not broadcast_buffers and r.rank != 0:  # as DDP: the buffers are not sent at wrap time either
            ref[1].running_mean.fill_(5.0)
        for step in range(3):
            # With broadcasting every forward starts from rank 0's stats, so only the
            # last forward sees this rank's own shard.
            src = r.rank if (not broadcast_buffers or step == 2) else 0
            ref(batch("mlp", step)[0].chunk(n)[src])
        check_state(r.value, ref[1].state_dict(), FP32)


def bn_sends_rank(n):
    pz.init()
    model = make_bn()
    dp = pz.DataParallel(model)
    pz.comm_stats(reset=True)
    for step in range(3):
        dp(batch("mlp", step)[0].chunk(n)[pz.get_rank()])
    dp.eval()
    dp(batch("mlp", 3)[0])
    calls = pz.comm_stats().get("broadcast", {}).get("calls", 0)
    return calls, {k: v.clone() for k, v in model[1].state_dict().items()}


@pytest.mark.parametrize("n", [1, 2])
def test_buffers_are_sent_only_where_there_is_another_rank(n):
    """A broadcast per buffer dtype (float32 stats, int64 count) before each training forward at
    2 ranks; at one rank there is nobody to send to, and the stats are those of plain torch."""
    for r in run_ranks(bn_sends_rank, n, args=(n,)):
        calls, state = r.value
        assert calls == (3 * 2 if n > 1 else 0)
        if n == 1:
            ref = make_bn()
            for step in range(3):
                ref(batch("mlp", step)[0])
            check_state(state, ref[1].state_dict(), FP32)


# ---------------------------------------------------------------------------
# Bad input: the same clear error on every rank, and the group stays usable


def frozen_uint16():
    """A model with a frozen parameter of a dtype the collectives do not carry."""
    m = make_mlp()
    m.codes = nn.Parameter(torch.zeros(4, dtype=torch.uint16), requires_grad=False)
    return m


def bad_input_rank():
    pz.init()

    def meta_model():
        m = make_mlp()
        m[2].weight = nn.Parameter(torch.empty(32, 32, device="meta"))
        return m

    cases = [
        lambda: pz.DataParallel("not a module"),
        lambda: pz.DataParallel(make_mlp(), bucket_mb=0),
        lambda: pz.DataParallel(make_mlp(), bucket_mb=-2.5),
        lambda: pz.DataParallel(make_mlp(), first_bucket_mb=0),
        lambda: pz.DataParallel(meta_model()),
        lambda: pz.DataParallel(make_mlp(), comm_dtype=torch.int32),
        lambda: pz.DataParallel(make_mlp(), group="world"),
        lambda: pz.DataParallel(nn.Sequential(nn.Linear(2, 2), nn.EmbeddingBag(5, 3, sparse=True))),
        lambda: pz.DataParallel(frozen_uint16()),
    ]
    out = []
    for case in cases:
        try:
            case()
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append((type(e).__name__, str(e)))
    solo = pz.new_group([0])  # rank 1 is not a member
    try:
        pz.DataParallel(make_mlp(), group=solo)
        out.append(None)
    except ValueError as e:
        out.append(("ValueError", str(e)))
    t = torch.full((3,), float(pz.get_rank() + 1))
    pz.all_reduce(t)
    out.append(t.tolist())
    r = pz.get_rank()
    for case in (lambda: pz.DataParallel(make_mlp(), bucket_mb=[25, 0][r]),  # refused on rank 1 alone
                 lambda: pz.DataParallel(make_mlp(), comm_dtype=[None, torch.bfloat16][r]),  # each valid, unlike
                 lambda: pz.DataParallel(make_mlp(), bucket_mb=[25, 25.0][r])):  # alike
        try:
            case()
            out.append(None)
        except (TypeError, ValueError) as e:
            out.append((type(e).__name__, str(e)))
    return out


def test_bad_input_raises_clear_errors_on_every_rank():
    expected = [
        ("TypeError", "module: expected a torch.nn.Module, got str"),
        ("ValueError", "bucket_mb: expected a positive number of MiB, got 0"),
        ("ValueError", "bucket_mb: expected a positive number of MiB, got -2.5"),
        ("ValueError", "first_bucket_mb: expected a positive number of MiB, got 0"),
        ("ValueError", "module: parameters and buffers must all be on one device, found '0.weight' on cpu, "
                       "'2.weight' on meta"),
        ("ValueError", "comm_dtype: expected None, torch.float32, torch.bfloat16 or torch.float16, got torch.int32"),
        ("TypeError", "group: expected a pz group (from pz.new_group) or None, got str"),
        ("ValueError", "module: '1' (EmbeddingBag) makes sparse gradients, which pz.DataParallel does not reduce; "
                       "use sparse=False"),
        ("TypeError", "module: parameter 'codes' has dtype torch.uint16, which DataParallel cannot broadcast; "
                      "expected a float, int, bool or complex dtype"),
    ]
    for r in run_ranks(bad_input_rank, 2):
        assert r.value[:len(expected)] == expected
        solo, summed, one_refused, unlike, alike = r.value[len(expected):]
        assert one_refused == ("ValueError", "bucket_mb: expected a positive number of MiB, got 0") if r.rank else (
            "ValueError", "pz.DataParallel: refused on group rank(s) [1] (group rank 1: ValueError: bucket_mb: "
                          "expected a positive number of MiB, got 0); every rank must pass the same arguments"), r
        assert unlike == ("ValueError", f"module: comm_dtype={[None, torch.bfloat16][r.rank]!r} on this rank differs "
                                        f"on group rank(s) [{1 - r.rank}]: every rank must pass the same arguments")
        assert alike is None
        if r.rank == 0:
            assert solo is None
        else:
            assert solo[0] == "ValueError" and "not a member of group (0,)" in solo[1]
        assert summed == [3.0, 3.0, 3.0]


def _rank_unfrozen_after_wrap():
    pz.init()
    model = make_mlp()
    model[0].requires_grad_(False)
    dp = pz.DataParallel(model)
    model[0].requires_grad_(True)  # would train without its gradients averaged
    x, _ = batch("mlp", 0)
    try:
        dp(x)
        out = None
    except RuntimeError as e:
        out = str(e)
    model[0].requires_grad_(False)  # as it was wrapped: trains again
    dp(x).sum().backward()
    with torch.no_grad():  # a no-grad forward (evaluation) does not look
        model[0].requires_grad_(True)
        dp(x)
    return out, model[2].weight.grad is not None


def _rank_converted_after_wrap():
    pz.init()
    model = make_mlp()
    dp = pz.DataParallel(model)
    model.to(torch.bfloat16)
    try:
        dp(batch("mlp", 0)[0].bfloat16())
        return None
    except RuntimeError as e:
        return str(e)


def test_module_converted_after_wrap_is_refused_at_forward():
    """The buckets are laid out for the parameters' dtype and device at wrap time: a module converted
    afterwards (model.to(torch.bfloat16)) is refused at the next training forward, on every rank,
    saying so (its backward failed inside autograd, naming no parameter)."""
    for r in run_ranks(_rank_converted_after_wrap, 2, timeout=60):
        assert r.value is not None and "'0.weight' is torch.bfloat16 on cpu now, torch.float32" in r.value, r.value


def test_parameter_made_trainable_after_wrap_is_refused_at_forward():
    """A parameter frozen when DataParallel wrapped the module has no bucket: set trainable later,
    its gradient would stay this rank's own. The next training forward says so on every rank."""
    for r in run_ranks(_rank_unfrozen_after_wrap, 2, timeout=60):
        msg, trained = r.value
        assert msg is not None and "['0.weight', '0.bias']" in msg and "after pz.DataParallel wrapped" in msg, msg
        assert trained


def test_bench_train_runs_end_to_end(tmp_path):
    """pyzero-bench train, torch DDP beside pz.DataParallel: both train the same model on the
    same data, so their losses agree; the overlap columns are filled and consistent. torch-local trains on
    the same global batch as they do (it trained on rank 0's batch alone, 6.6e-2 off at 2 ranks): its curve
    and theirs, up to their first no_sync step, are one process's on both ranks' batches. torch DDP's comm
    ms reduces DDP's own buckets (it took --first-bucket-mb, which reaches dp only)."""
    import argparse
    import json

    from pyzero.bench import train as bench
    from pyzero.bench.gpt import make_gpt, random_batch

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "train.json"
    args = parser.parse_args(["--model", "gpt-nano", "--runs", "torch-local,torch-ddp,dp", "--iters", "2",
                              "--warmup", "1", "--seq", "16", "--bucket-mb", "0.05", "--first-bucket-mb", "0.02",
                              "--timeout", "60", "--json", str(out)])
    assert bench.main(args) == 0
    rec = json.loads(out.read_text())
    local, ddp, dp = rec["results"]
    assert (local["run"], ddp["run"], dp["run"]) == ("torch-local", "torch-ddp", "dp")
    assert rec["args"]["threads"] == 1  # on CPU the ranks compute on the cores: one torch thread each
    with pytest.raises(UsageError, match="--threads: expected >= 1, got 0"):
        bench.main(parser.parse_args(["--model", "gpt-nano", "--threads", "0"]))
    assert abs(ddp["loss"] - dp["loss"]) < 1e-5 * abs(ddp["loss"])
    for r in (ddp, dp):
        assert r["comm_ms"] > 0 and r["exposed_ms"] >= 0 and r["step_ms"] > 0
        assert r["hidden"] == pytest.approx(max(0.0, 1 - r["exposed_ms"] / r["comm_ms"]))
    torch.set_num_threads(1)
    m = make_gpt("gpt-nano")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    batches = [random_batch(m.config, 4, 16, seed=1000 + r) for r in range(2)]
    want = []
    for _ in range(len(local["losses"])):
        opt.zero_grad(set_to_none=True)
        losses = [m(x, y) for x, y in batches]
        (sum(losses) / 2).backward()
        opt.step()
        want.append(losses[0].item())
    synced = 2 * 1 + 3  # 2 x --warmup + --memory-steps: before the first no_sync step
    assert local["losses"] == pytest.approx(want, rel=1e-5) and local["loss"] == pytest.approx(want[synced - 1])
    for r in (ddp, dp):
        assert r["losses"][:synced] == pytest.approx(want[:synced], rel=1e-5), r["run"]
    n = sum(p.numel() for p in m.parameters())
    assert sum(ddp["bucket_bytes"]) == 4 * n and len(ddp["bucket_bytes"]) > 1
    assert max(ddp["bucket_bytes"]) < 4 * n


def _rank_offload_threads():
    from types import SimpleNamespace

    from pyzero.bench import train as bench

    pz.init()
    got = {}
    for threads in (None, 1, 2):
        model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
        args = SimpleNamespace(bucket_mb=1.0, offload_threads=threads, comm_dtype=None)
        runner = bench._setup_zero(2, "cpu")(model, args)
        inner = runner.optimizer.inner
        got[threads] = (type(inner).__module__ + "." + type(inner).__name__, inner.threads)
    args = SimpleNamespace(bucket_mb=1.0, offload_threads=1, comm_dtype=None)
    plain = bench._setup_zero(2)(nn.Linear(4, 2), args).optimizer.inner
    got["no offload"] = (type(plain).__module__ + "." + type(plain).__name__, getattr(plain, "threads", None))
    return got


def test_bench_train_offload_threads_set_the_cpu_steps_threads():
    """--offload-threads N: the offload runs' CPU step (pz.optim.AdamW) runs on N threads; without it on
    torch's intra-op threads (threads=None); runs without offload keep torch's AdamW; 0 is refused."""
    import argparse

    from pyzero.bench import train as bench

    got = run_ranks(_rank_offload_threads, 1, timeout=60)[0].value
    assert got[None] == ("pyzero.optim.adam.AdamW", None)
    assert got[1] == ("pyzero.optim.adam.AdamW", 1) and got[2] == ("pyzero.optim.adam.AdamW", 2)
    assert got["no offload"] == ("torch.optim.adamw.AdamW", None)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(UsageError, match="--offload-threads: expected >= 1, got 0"):
        bench.main(parser.parse_args(["--model", "gpt-nano", "--offload-threads", "0"]))


def test_bench_train_torch_local_is_the_one_rank_baseline(tmp_path):
    """At world size 1 plain torch (no communication) and the wrappers train alike: equal losses."""
    import argparse
    import json

    from pyzero.bench import train as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "train.json"
    args = parser.parse_args(["--model", "gpt-nano", "--runs", "torch-local,dp,zero2", "--nproc", "1", "--iters", "2",
                              "--warmup", "1", "--seq", "16", "--timeout", "60", "--json", str(out)])
    assert bench.main(args) == 0
    local, dp, zero2 = json.loads(out.read_text())["results"]
    assert (local["run"], dp["run"], zero2["run"]) == ("torch-local", "dp", "zero2")
    assert "comm_ms" not in local and local["step_ms"] > 0
    for r in (dp, zero2):
        assert r["loss"] == pytest.approx(local["loss"], rel=1e-5), (r["run"], r["loss"], local["loss"])


def test_bench_train_rounds_alternate_the_runs_and_take_medians(tmp_path, capsys):
    """--rounds 3: the runs go A B, B A, A B, each in fresh ranks; the JSON keeps each round's step and
    gives their median; the summary's ratio is the median of the per-round ratios to the first run;
    the loss is the same in every round (same model, batch and steps); 0 rounds are refused."""
    import argparse
    import json
    import statistics

    from pyzero.bench import train as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "train.json"
    args = parser.parse_args(["--model", "gpt-nano", "--runs", "torch-local,dp", "--nproc", "1", "--iters", "2",
                              "--warmup", "1", "--seq", "16", "--timeout", "60", "--rounds", "3",
                              "--json", str(out)])
    assert bench.main(args) == 0
    text = capsys.readouterr().out.splitlines()
    order = [line.split()[0] for line in text if line.split()[:1] in (["torch-local"], ["dp"])
             or line.startswith("# round")]
    assert order == ["#", "torch-local", "dp", "#", "dp", "torch-local", "#", "torch-local", "dp",
                     "torch-local", "dp"]  # the rounds, then the summary's rows
    local, dp = json.loads(out.read_text())["results"]
    for r in (local, dp):
        assert len(r["step_ms_rounds"]) == 3 and r["step_ms"] == statistics.median(r["step_ms_rounds"])
        assert r["tokens_per_s"] == pytest.approx(1 * 4 * 16 / (r["step_ms"] / 1e3))
    assert dp["loss"] == pytest.approx(local["loss"], rel=1e-5)
    ratios = [a / b for a, b in zip(dp["step_ms_rounds"], local["step_ms_rounds"])]
    row = next(line.split() for line in text[-3:] if line.split()[:1] == ["dp"])
    assert float(row[4]) == pytest.approx(statistics.median(ratios), abs=1e-4)
    assert float(next(line.split() for line in text[-3:] if line.split()[:1] == ["torch-local"])[4]) == 1.0
    with pytest.raises(UsageError, match="--rounds: expected >= 1, got 0"):
        bench.main(parser.parse_args(["--model", "gpt-nano", "--rounds", "0"]))


def test_bench_train_over_rounds_merges_a_runs_rounds():
    """A run's rounds merged: median times, each round's kept, the largest peak per rank, the rest
    from the first round; one round stays as it was."""
    from types import SimpleNamespace

    from pyzero.bench import train as bench

    args = SimpleNamespace(nproc=2, batch=4, seq=8)
    rounds = [{"run": "dp", "step_ms": 10.0, "nocomm_ms": 9.0, "peak_mib": [5.0, 7.0], "loss": 1.5},
              {"run": "dp", "step_ms": 14.0, "nocomm_ms": 8.0, "peak_mib": [6.0, 6.0], "loss": 1.5},
              {"run": "dp", "step_ms": 11.0, "nocomm_ms": 12.0, "peak_mib": [4.0, 8.0], "loss": 1.5}]
    got = bench._over_rounds(rounds, args)
    assert got["step_ms"] == 11.0 and got["step_ms_rounds"] == [10.0, 14.0, 11.0]
    assert got["nocomm_ms"] == 9.0 and got["peak_mib"] == [6.0, 8.0] and got["loss"] == 1.5
    assert got["tokens_per_s"] == pytest.approx(2 * 4 * 8 / 0.011)
    assert "comm_ms_rounds" not in got
    assert bench._over_rounds(rounds[:1], args) == rounds[0]


@pytest.mark.parametrize("bench_name", ["train", "capacity"])
def test_bench_deepspeed_runs_need_deepspeed(monkeypatch, bench_name):
    """--runs ds-zero2-offload (train and capacity): where deepspeed is not importable, a clear
    error before any rank starts."""
    import argparse
    import importlib

    from pyzero.bench import ds_runs

    bench = importlib.import_module(f"pyzero.bench.{bench_name}")
    monkeypatch.setattr(ds_runs, "available", lambda: False)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    args = parser.parse_args(["--runs", "zero2-offload,ds-zero2-offload", "--device", "cpu"])
    with pytest.raises(UsageError, match="--runs ds-zero2-offload: deepspeed is not importable"):
        bench.main(args)


def test_bench_train_gpu_backend_needs_cuda():
    import argparse

    from pyzero.bench import train as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(UsageError, match="--gpu-backend ipc: needs --device cuda"):
        bench.main(parser.parse_args(["--gpu-backend", "ipc", "--nproc", "1"]))


def test_bench_train_torch_runs_pick_their_backend():
    """A CPU model keeps the named backend; a CUDA model gets NCCL, or the "pyzero" torch backend on
    CUDA tensors for the -pyzero runs and for every torch run when pyzero runs on ipc."""
    from types import SimpleNamespace

    from pyzero.bench import train as bench

    class FakeCuda(torch.nn.Module):  # a parameter that says it is on a GPU
        def parameters(self, recurse=True):
            yield SimpleNamespace(device=torch.device("cuda", 0))

    cpu, cuda = torch.nn.Linear(2, 2), FakeCuda()
    nccl, ipc = SimpleNamespace(gpu_backend="nccl"), SimpleNamespace(gpu_backend="ipc")
    assert bench._torch_backend(cpu, "gloo", ipc) == "gloo" and bench._torch_backend(cpu, "pyzero", nccl) == "pyzero"
    assert bench._torch_backend(cuda, "gloo", nccl) == "nccl"
    assert bench._torch_backend(cuda, "pyzero", nccl) == "pyzero"
    assert bench._torch_backend(cuda, "gloo", ipc) == "pyzero"


def test_bench_train_deepspeed_offload_trains_as_plain_torch(tmp_path):
    """Where deepspeed is installed: its ZeRO-Offload row trains the model as plain torch does
    (world size 1, the same AdamW settings: equal losses). Its CPUAdam builds on first use."""
    pytest.importorskip("deepspeed")
    import argparse
    import json

    from pyzero.bench import train as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "train.json"
    args = parser.parse_args(["--model", "gpt-nano", "--runs", "torch-local,ds-zero2-offload", "--nproc", "1",
                              "--iters", "2", "--warmup", "1", "--seq", "16", "--timeout", "600", "--json", str(out)])
    assert bench.main(args) == 0
    local, ds = json.loads(out.read_text())["results"]
    assert ds["run"] == "ds-zero2-offload"
    assert ds["loss"] == pytest.approx(local["loss"], rel=1e-5), (ds["loss"], local["loss"])


class _Reentrant(nn.Module):
    """`a` runs inside a reentrant checkpoint and again outside it: its gradients are
    accumulated twice in one backward (with ckpt on)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.ckpt = True

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        h = checkpoint(self.a, x, use_reentrant=True) if self.ckpt else self.a(x)
        return self.b(self.a(h)).square().mean()


def rank_gradient_twice(kind):
    pz.init()
    torch.manual_seed(0)
    model = _Reentrant()
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1), requires_grad=True)  # same on every rank
    if kind == "dp":
        wrapped = pz.DataParallel(model, bucket_mb=1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    else:
        wrapped = model
        opt = pz.ZeroOptimizer(model, torch.optim.SGD, stage=int(kind[-1]), lr=0.1)
    try:
        wrapped(x).backward()
        error = None
    except RuntimeError as e:
        error = str(e)
    # the error leaves nothing behind: a normal step then equals one process's
    model.ckpt = False
    opt.zero_grad()
    wrapped(x).backward()
    opt.step()
    if kind == "zero3":  # parameters are sharded: the full state comes gathered, on the first rank
        return error, opt.full_state_dict()
    return error, {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("kind", ["dp", "zero2", "zero3"])
def test_gradient_accumulated_twice_raises_on_every_rank(kind):
    torch.manual_seed(0)
    ref = _Reentrant()
    ref.ckpt = False
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(1))
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    ref(x).backward()
    opt.step()
    for res in run_ranks(rank_gradient_twice, 2, args=(kind,)):
        error, params = res.value
        if kind == "zero3":  # a's unit is needed again after its first gradients were sent
            assert error is not None and "needed by backward after their gradients were complete" in error, error
            assert "['a.weight', 'a.bias']" in error and "use_reentrant=False" in error, error
        else:
            assert error is not None and "accumulated twice in one backward" in error, (res.rank, error)
            assert re.search(r"parameter 'a\.(weight|bias)'", error), error
        assert params is not None or (kind == "zero3" and res.rank > 0)
        for n, p in ref.named_parameters() if params is not None else ():
            torch.testing.assert_close(params[n], p.detach(), rtol=1e-6, atol=1e-7)


def _rank_sync_batchnorm():
    """nn.SyncBatchNorm without torch.distributed: training forwards refused on every rank (it would
    normalise by each rank's batch alone), also converted after wrapping, and with a pyzero group as
    process_group, eval forwards (running statistics) run; then started beside pyzero
    (pyzero.distributed.init_torch) nothing is refused (torch's layer itself takes CUDA tensors only:
    its error) but a pyzero group as process_group."""
    pz.init(timeout=30)
    x = torch.randn(2, 4)

    def model():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.SyncBatchNorm(8))

    def plain():
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8))
    found = {"dp": outcome(lambda: pz.DataParallel(model())(x)),
             "zero": outcome(lambda: pz.ZeroOptimizer(model(), torch.optim.SGD, lr=0.1).model(x))}
    converted = pz.DataParallel(plain())
    converted(x)  # (a first forward, with nn.BatchNorm1d)
    converted = nn.SyncBatchNorm.convert_sync_batchnorm(converted)
    found["dp converted after"] = outcome(lambda: converted(x))
    later = plain()
    pz.ZeroOptimizer(later, torch.optim.SGD, lr=0.1)
    later(x)
    nn.SyncBatchNorm.convert_sync_batchnorm(later)
    found["zero converted after"] = outcome(lambda: later(x))
    group = pz.new_group([0, 1])
    on_pz_group = pz.DataParallel(nn.SyncBatchNorm.convert_sync_batchnorm(plain(), process_group=group), group=group)
    found["pz group"] = outcome(lambda: on_pz_group(x))
    evaluated = model().eval()
    zero = pz.ZeroOptimizer(evaluated, torch.optim.SGD, stage=3, lr=0.1)
    with torch.no_grad():
        found["eval"] = outcome(lambda: zero.model(x))
    before = torch.distributed.is_initialized()
    pz.distributed.init_torch()
    found["started"] = before, torch.distributed.is_initialized(), str(torch.distributed.get_backend())
    found["dp_started"] = outcome(lambda: pz.DataParallel(model())(x))
    found["pz group, started"] = outcome(lambda: on_pz_group(x))
    torch.distributed.destroy_process_group()
    return found


def test_sync_batchnorm_needs_torch_distributed():
    for r in run_ranks(_rank_sync_batchnorm, 2, timeout=60):
        found = r.value
        for key, who in (("dp", "pz.DataParallel"), ("zero", "pz.ZeroOptimizer"),
                         ("dp converted after", "pz.DataParallel"), ("zero converted after", "pz.ZeroOptimizer")):
            kind, msg = found[key]
            assert kind == "RuntimeError" and msg.startswith(f"{who}: '1' is an nn.SyncBatchNorm, which"), msg
            assert "pyzero.distributed.init_torch()" in msg, msg
        for key in ("pz group", "pz group, started"):
            kind, msg = found[key]
            assert kind == "RuntimeError" and msg.startswith("pz.DataParallel: '1' is an nn.SyncBatchNorm whose "
                                                             "process_group is a pyzero.comm.Group, not a torch"), msg
        assert found["eval"][0] == "ok", found["eval"]
        assert found["started"] == (False, True, "gloo")
        kind, msg = found["dp_started"]
        assert kind == "ValueError" and "SyncBatchNorm" in msg and "pz." not in msg, msg


def test_init_torch_needs_pyzero_initialised():
    assert not pz.is_initialized()
    with pytest.raises(RuntimeError, match=r"init_torch\(\): pyzero is not initialised: call pz.init\(\) first"):
        pz.distributed.init_torch()


# ---------------------------------------------------------------------------
# Gradients set by hand, a backward that raised, forwards of one backward, ranks' models


class _Extra(nn.Module):
    """A layer every rank uses and a parameter no forward uses."""

    def __init__(self):
        super().__init__()
        self.used = nn.Linear(2, 2)
        self.extra = nn.Parameter(torch.zeros(3))

    def forward(self, x):
        return self.used(x)


class _Boom(torch.autograd.Function):
    armed = True

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        if _Boom.armed:
            raise RuntimeError("boom")
        return g


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.head = nn.Linear(2, 2), nn.Linear(2, 2)

    def forward(self, x, use_head):
        h = _Boom.apply(self.a(x))
        return self.head(h) if use_head else h


def _rank_edges():
    pz.init(backend="shm")
    r = pz.get_rank()
    out = {}
    torch.manual_seed(0)
    m = _Extra()
    dp = pz.DataParallel(m)
    # a gradient set by hand after forward, on a parameter no rank uses: kept (averaged), as torch keeps it
    y = dp(torch.ones(1, 2))
    m.extra.grad = torch.full((3,), 7.0 + 2 * r)
    y.sum().backward()
    out["set after forward"] = m.extra.grad.clone()
    # the same before a forward that follows a grad-enabled forward without backward (validation forward)
    m.extra.grad = None
    dp(torch.ones(1, 2))
    m.extra.grad = torch.full((3,), 7.0 + 2 * r)
    dp(torch.ones(1, 2)).sum().backward()
    out["set before forward"] = m.extra.grad.clone()
    # set on rank 0 only: both ranks keep the average (rank 1's missing one contributes zeros)
    m.extra.grad = None
    y = dp(torch.ones(1, 2))
    if r == 0:
        m.extra.grad = torch.full((3,), 4.0)
    y.sum().backward()
    out["set on rank 0"] = None if m.extra.grad is None else m.extra.grad.clone()
    # a backward that raised half-way, then one that uses no head: the head's gradient stays None
    torch.manual_seed(0)
    h = _Head()
    hp = pz.DataParallel(h)
    _Boom.armed = True
    try:
        hp(torch.ones(1, 2), use_head=True).sum().backward()
        out["raised"] = False
    except RuntimeError:
        out["raised"] = True
    _Boom.armed = False
    for p in h.parameters():
        p.grad = None
    hp(torch.ones(1, 2), use_head=False).sum().backward()
    out["head after a raised backward"] = h.head.weight.grad
    # a synced forward, then one under no_sync, one backward of both: reduced (as DDP)
    torch.manual_seed(0)
    lin = nn.Linear(3, 1)
    lp = pz.DataParallel(lin)
    x = torch.full((2, 3), float(r + 1))
    la = lp(x).sum()
    with lp.no_sync():
        lb = lp(x).sum()
    (la + lb).backward()
    out["synced then no_sync"] = lin.weight.grad.clone()
    # and after that backward, a no_sync forward and backward alone stays local
    lin.weight.grad = None
    with lp.no_sync():
        lp(x).sum().backward()
    out["no_sync after"] = lin.weight.grad.clone()
    return out


def test_hand_set_gradients_raised_backwards_and_mixed_forwards():
    """What a step's backward reduces, against plain torch and DDP: a gradient set by hand on a parameter
    no rank uses is kept and averaged (it was set to None), also when set on one rank only (the other's
    contributes zeros); after a backward that raised half-way, a parameter no rank uses in the next one
    keeps grad None (its stale used flag gave it zeros, which weight decay then stepped); a synced
    forward and a no_sync forward in one backward reduce (the no_sync forward's decision won: replicas
    drifted apart), and the no_sync step after stays local."""
    for res in run_ranks(_rank_edges, 2, timeout=60):
        out, r = res.value, res.rank
        assert torch.equal(out["set after forward"], torch.full((3,), 8.0))  # (7 + 9) / 2
        assert torch.equal(out["set before forward"], torch.full((3,), 8.0))
        assert torch.equal(out["set on rank 0"], torch.full((3,), 2.0))
        assert out["raised"] and out["head after a raised backward"] is None
        # d(sum(w.x + b))/dw per forward = column sums of x: rank q's x is q + 1 everywhere, 2 rows;
        # two forwards: 4 (q + 1), averaged over ranks 0 and 1: 6
        assert torch.equal(out["synced then no_sync"], torch.full((1, 3), 6.0))
        assert torch.equal(out["no_sync after"], torch.full((1, 3), 2.0 * (r + 1)))


def _rank_shapes(kind):
    pz.init(backend="shm")
    r = pz.get_rank()
    m = nn.Linear(4, 6) if r == 0 or kind == "same" else (nn.Linear(6, 4) if kind == "transposed" else nn.Linear(4, 6))
    if kind == "frozen" and r == 1:
        m.bias.requires_grad_(False)
    try:
        if kind == "zero":
            m = nn.Linear(4, 6) if r == 0 else nn.Linear(6, 4)
            pz.ZeroOptimizer(m, torch.optim.SGD, stage=2, lr=0.1)
        else:
            pz.DataParallel(m)
        return "ok"
    except ValueError as e:
        return str(e)


@pytest.mark.parametrize("kind", ["same", "transposed", "frozen", "zero"])
def test_ranks_wrapping_different_parameter_shapes_are_refused(kind):
    """A weight (6, 4) on one rank and (4, 6) on the other has as many elements: the wrap-time broadcast
    copied values into the other layout and the gradients of different layouts were averaged, no error
    (DDP refuses). Now refused on every rank, naming the parameter; also a bias frozen on one rank only,
    and under ZeroOptimizer."""
    got = [res.value for res in run_ranks(_rank_shapes, 2, args=(kind,), timeout=60)]
    if kind == "same":
        assert got == ["ok", "ok"]
        return
    name = "bias" if kind == "frozen" else "weight"
    for r, msg in enumerate(got):
        assert f"parameter {name!r} is" in msg and f"group rank(s) [{1 - r}]" in msg, msg


# ---------------------------------------------------------------------------
# A wrapped module changed, ranks that differ, several wrappers: one 2-rank run, several tests


class _Scaled(nn.Module):
    """A layer whose output a buffer scales; `mask` (bool) and `cols` (a non-contiguous float) are saved
    for backward by the products that use them."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.ones(4))
        self.register_buffer("mask", torch.tensor([True, False, True, True]))
        self.register_buffer("cols", torch.arange(8.0).view(2, 4).t())

    def forward(self, x):
        return self.lin(x) * self.scale * self.mask * self.cols[:, 1]


class _Two(nn.Module):
    """Two layers; the second used only where `second` is set."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False)

    def forward(self, x, second=True):
        h = self.a(x)
        return self.b(h) if second else h


def _x(rank, rows=3, seed=0):
    return torch.randn(rows, 4, generator=torch.Generator().manual_seed(10 * seed + rank))


def _grads(*modules):
    return [None if p.grad is None else p.grad.clone() for m in modules for p in m.parameters()]


def _two_wrappers(r, **bucket):
    """Gradients of two wrappers on one group reduced by one backward, A's second layer used on rank 0 only."""
    out = {}
    torch.manual_seed(0)
    A, B = _Two(), _Two()
    dA, dB = pz.DataParallel(A, **bucket), pz.DataParallel(B, **bucket)
    dA(dB(_x(r)), second=r == 0).sum().backward()
    out["nested"] = _grads(A, B)
    # two losses, the one forwarded first backwarded first
    for p in list(A.parameters()) + list(B.parameters()):
        p.grad = None
    lb = dB(_x(r, seed=1)).sum()
    la = dA(_x(r, seed=2), second=r == 0).sum()
    lb.backward()
    la.backward()
    out["apart"] = _grads(A, B)
    return out


class _ScaledTwo(_Two):
    """_Two with a buffer (broadcast at each training forward)."""

    def __init__(self):
        super().__init__()
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x, second=True):
        return super().forward(x * self.scale, second)


class _BoomTwo(_Two):
    """_Two whose backward raises between its layers while _Boom is armed."""

    def forward(self, x, second=True):
        return self.b(_Boom.apply(self.a(x)))


def _tried(fn):
    """("ok", what fn returned), or (exception type name, message)."""
    try:
        return "ok", fn()
    except Exception as e:  # noqa: BLE001
        return type(e).__name__, str(e)


def _checkpointed(r, reentrant):
    """dB(checkpoint(dA, x)), A with a buffer and its second layer used on rank 1 only, B's on rank 0 only."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    A, B = _ScaledTwo(), _Two()
    dA, dB = pz.DataParallel(A), pz.DataParallel(B)
    x = _x(r).requires_grad_(reentrant)  # (a reentrant checkpoint needs an input that requires grad)
    dB(checkpoint(lambda t: dA(t, second=r == 1), x, use_reentrant=reentrant), second=r == 0).sum().backward()
    return _grads(A, B)


def _reentrant_after_no_sync(r):
    """A reentrant checkpoint of a wrapper whose last forward with gradients ran under no_sync()."""
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    t = _Two()
    dt = pz.DataParallel(t)
    with dt.no_sync():
        dt(_x(r)).sum().backward()
    return outcome(lambda: checkpoint(dt, _x(r, seed=1).requires_grad_(), use_reentrant=True).sum().backward())


def _raised_backward(r):
    """Gradients and B's collectives in flight after a backward of dB(dA(x)) raised in B (A forwarded again
    after it, so ahead of B: B held its second layer's bucket), then steps that train A alone, both, and B
    alone on the second of two losses forwarded before a backward of the first raised."""
    torch.manual_seed(0)
    A, B = _Two(), _BoomTwo()
    one = dict(bucket_mb=1e-6, first_bucket_mb=1e-6)  # a bucket per parameter
    dA, dB = pz.DataParallel(A, **one), pz.DataParallel(B, **one)
    params = list(A.parameters()) + list(B.parameters())

    def raising(loss):
        _Boom.armed = True
        try:
            loss.backward()
        except RuntimeError:
            pass
        finally:
            _Boom.armed = False
        for p in params:
            p.grad = None

    out = {}
    loss = dB(dA(_x(r))).sum()
    dA(_x(r, seed=3))
    raising(loss)
    dA(_x(r, seed=2)).sum().backward()
    out["A alone"] = _grads(A, B), len(dB.reducer._inflight)
    for p in params:
        p.grad = None
    dB(dA(_x(r, seed=4), second=r == 0)).sum().backward()
    out["both"] = _grads(A, B)
    for p in params:
        p.grad = None
    first, second = dB(_x(r, seed=5)).sum(), dB(_x(r, seed=6)).sum()
    raising(first)
    out["second loss"] = outcome(lambda: second.backward()), _grads(A, B)
    return out


def _rank_after_wrap():
    pz.init(backend="shm", timeout=20)
    r = pz.get_rank()
    out = {}
    torch.manual_seed(0)
    m = _Scaled()
    dp = pz.DataParallel(m)
    # buffers replaced or added after wrapping are broadcast from rank 0 at the next training forward
    m.scale = torch.full((4,), 2.0 + r)
    out["replaced"] = dp(_x(r)).detach(), m.scale.clone()
    m.register_buffer("extra", torch.full((2,), 5.0 + r))
    dp(_x(r))
    out["registered"] = m.extra.clone()
    m.load_state_dict({"scale": torch.full((4,), 3.0 + r)}, strict=False, assign=True)
    out["assigned"] = dp(_x(r)).detach(), m.scale.clone()
    m.scale.fill_(4.0 + r)
    with torch.no_grad():  # (converted parameters are refused at a grad-enabled forward only)
        m.double()  # new buffers, in the same slots
        dp(_x(r).double())
        out["converted"] = m.scale.clone()
        m.float()
    m.extra = torch.zeros(4, dtype=torch.uint16)
    out["uint16 later"] = outcome(lambda: dp(_x(r)))
    del m.extra
    # a buffer whose elements share memory (rank 1 failed in torch's copy, rank 0 waited): refused, naming it
    m.register_buffer("extra", torch.zeros(1).expand(3))
    out["expanded later"] = outcome(lambda: dp(_x(r)))
    del m.extra
    b = nn.Linear(2, 2)
    b.register_buffer("s", torch.ones(1).expand(3))
    out["expanded at wrap"] = outcome(lambda: pz.DataParallel(b))
    # two forwards, one backward: the second broadcast leaves the first forward's saved buffers usable
    m.scale.fill_(1.0)
    a, b = dp(_x(r, seed=1)), dp(_x(r, seed=2))
    m.zero_grad()
    out["siamese"] = outcome(lambda: (a * b).sum().backward()), _grads(m)
    # a parameter reshaped after wrapping: refused naming it (its bucket slot has the old shape)
    old = m.lin.weight.data
    m.lin.weight.data = torch.zeros(2, 8)
    out["reshaped"] = outcome(lambda: dp(_x(r)))
    m.lin.weight.data = old
    out["deepcopy"] = outcome(lambda: copy.deepcopy(dp))
    out["save"] = outcome(lambda: torch.save(dp, io.BytesIO()))
    # no_sync marks nothing used: a parameter no rank uses in the synced step keeps grad None
    torch.manual_seed(0)
    t = _Two()
    dt = pz.DataParallel(t)
    with dt.no_sync():
        dt(_x(r)).sum().backward()
    t.zero_grad()
    dt(_x(r, seed=1), second=False).sum().backward()
    out["no_sync then unused"] = _grads(t)
    # ranks whose buffers differ (same element count, or not): refused at wrap
    for kind in ("transposed", "renamed", "dtype", "count"):
        b = nn.Linear(2, 2)
        if kind == "transposed":
            b.register_buffer("s", torch.ones(2, 3) if r == 0 else torch.ones(3, 2))
        elif kind == "renamed":
            b.register_buffer("s" if r == 0 else "t", torch.ones(3))
        elif kind == "dtype":
            b.register_buffer("s", torch.ones(3, dtype=torch.float32 if r == 0 else torch.float64))
        else:
            for i in range(1 + r):
                b.register_buffer(f"s{i}", torch.ones(3))
        out[f"buffers {kind}"] = outcome(lambda: pz.DataParallel(b))
    out["buffers not broadcast"] = outcome(lambda: pz.DataParallel(b, broadcast_buffers=False))
    # two wrappers on one group, one backward: every rank launches their buckets in one order
    out["two wrappers"] = _two_wrappers(r)
    out["two wrappers, tiny buckets"] = _two_wrappers(r, bucket_mb=TINY_MB, first_bucket_mb=TINY_MB)
    out["checkpointed"] = _tried(lambda: _checkpointed(r, False))
    out["checkpointed, reentrant"] = _tried(lambda: _checkpointed(r, True))
    out["reentrant after no_sync"] = _reentrant_after_no_sync(r)
    out["raised backward"] = _tried(lambda: _raised_backward(r))
    t = torch.full((2,), float(r + 1))
    pz.all_reduce(t)
    out["group usable"] = t.tolist()
    return out


@pytest.fixture(scope="module")
def after_wrap():
    return [res.value for res in run_ranks(_rank_after_wrap, 2, timeout=90)]


def _mean(per_rank):
    """The average of each rank's gradients, None where no rank has one (what DataParallel reduces)."""
    out = []
    for gs in zip(*per_rank):
        have = [g for g in gs if g is not None]
        out.append(None if not have else sum(g if g is not None else torch.zeros_like(have[0]) for g in gs) / 2)
    return out


def _assert_grads(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert (g is None) == (w is None), (g, w)
        if w is not None:
            torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6)


def test_buffers_replaced_after_wrap_are_broadcast(after_wrap):
    """A buffer replaced (attribute, load_state_dict(assign=True), module.double()) or registered after
    wrapping was never sent again (the wrapper kept the list it made at wrap time): the ranks' buffers
    drifted apart, silently. Now every training forward takes rank 0's, as DDP re-reads the buffers
    before each sync; a new one the broadcast cannot carry is refused, naming it, on every rank."""
    for r, out in enumerate(after_wrap):
        torch.manual_seed(0)
        ref = _Scaled()
        y, scale = out["replaced"]
        assert torch.equal(scale, torch.full((4,), 2.0))
        ref.scale = torch.full((4,), 2.0)
        torch.testing.assert_close(y, ref(_x(r)).detach())
        assert torch.equal(out["registered"], torch.full((2,), 5.0))
        y, scale = out["assigned"]
        assert torch.equal(scale, torch.full((4,), 3.0))
        ref.scale = torch.full((4,), 3.0)
        torch.testing.assert_close(y, ref(_x(r)).detach())
        assert torch.equal(out["converted"], torch.full((4,), 4.0, dtype=torch.float64))
        kind, msg = out["uint16 later"]
        assert kind == "RuntimeError" and "buffer 'extra' has dtype torch.uint16" in msg, msg


def test_buffers_sharing_memory_are_refused_naming_them(after_wrap):
    """An expand()ed buffer: the broadcast's copy into it raised on rank 1 only (torch refuses to write
    elements that share memory) while rank 0 waited. Refused on every rank, at wrap or at the forward
    after it was set."""
    for out in after_wrap:
        kind, msg = out["expanded later"]
        assert kind == "RuntimeError" and "buffer 'extra' has elements that share memory" in msg, msg
        kind, msg = out["expanded at wrap"]
        assert kind == "ValueError" and "buffer 's' has elements that share memory" in msg, msg


def test_two_forwards_one_backward_with_buffers_sent_through_a_copy(after_wrap):
    """Buffers the collectives cannot write directly (bool, non-contiguous) were copied back in place,
    bumping their version counters: two forwards then one backward (siamese) failed on rank 1 ("modified by
    an inplace operation") while rank 0 waited. The copy keeps the counters, as DDP's broadcast does."""
    torch.manual_seed(0)
    ref = _Scaled()
    per_rank = []
    for r in range(2):
        ref.zero_grad()
        (ref(_x(r, seed=1)) * ref(_x(r, seed=2))).sum().backward()
        per_rank.append(_grads(ref))
    for out in after_wrap:
        done, grads = out["siamese"]
        assert done == ("ok", None), done
        _assert_grads(grads, _mean(per_rank))


def test_parameter_reshaped_after_wrap_is_refused_naming_it(after_wrap):
    for out in after_wrap:
        kind, msg = out["reshaped"]
        assert kind == "RuntimeError" and "parameter 'lin.weight' has shape (2, 8) now, (4, 4) when" in msg, msg


def test_a_wrapper_cannot_be_pickled_or_copied(after_wrap):
    for out in after_wrap:
        for key in ("deepcopy", "save"):
            kind, msg = out[key]
            assert kind == "TypeError" and msg.startswith("pz.DataParallel cannot be pickled or copied"), msg
            assert "save model.module" in msg, msg


def test_no_sync_backward_marks_no_parameter_used(after_wrap):
    """A backward under no_sync marked its parameters used for the next synced backward: one no rank used
    there got a zero gradient (stepped by weight decay and momentum) instead of None, as in one process."""
    torch.manual_seed(0)
    ref = _Two()
    per_rank = []
    for r in range(2):
        ref.zero_grad()
        ref(_x(r, seed=1), second=False).sum().backward()
        per_rank.append(_grads(ref))
    for out in after_wrap:
        _assert_grads(out["no_sync then unused"], _mean(per_rank))
        assert out["no_sync then unused"][1] is None


def test_ranks_whose_buffers_differ_are_refused_naming_the_buffer(after_wrap):
    """Buffers of the same element count but other shapes, names or order were broadcast into each other,
    silently; other counts or dtypes failed in the broadcast naming no buffer. Refused at wrap, on every
    rank (unless the buffers are not broadcast)."""
    for r, out in enumerate(after_wrap):
        for kind, name, shape in (("transposed", "s", (2, 3) if r == 0 else (3, 2)),
                                  ("renamed", "s" if r == 0 else "t", (3,)), ("dtype", "s", (3,))):
            err, msg = out[f"buffers {kind}"]
            assert err == "ValueError" and f"buffer {name!r} is {shape}" in msg, msg
            assert f"on group rank(s) [{1 - r}]" in msg, msg
        assert out["buffers count"] == ("ValueError", "module: the ranks' models differ: [1, 2] buffers on group "
                                        "ranks 0..1 (every rank must wrap the same model: the group's first rank's "
                                        "buffers are broadcast)")
        assert out["buffers not broadcast"] == ("ok", None)
        assert out["group usable"] == [3.0, 3.0]


@pytest.mark.parametrize("key", ["two wrappers", "two wrappers, tiny buckets"])
def test_two_wrappers_on_one_group_reduce_in_one_order(after_wrap, key):
    """Two wrappers reduced by one backward (dA(dB(x))), A's second layer used on rank 0 only: rank 1 held
    A's bucket to the end of backward while B launched, so the ranks' all-reduces paired up crosswise and
    each rank got the other wrapper's gradients, silently. Now they go wrapper after wrapper, in one order
    on every rank; also for two losses backwarded apart."""
    per_rank = {"nested": [], "apart": []}
    for r in range(2):
        torch.manual_seed(0)
        A, B = _Two(), _Two()
        A(B(_x(r)), second=r == 0).sum().backward()
        per_rank["nested"].append(_grads(A, B))
        A.zero_grad()
        B.zero_grad()
        B(_x(r, seed=1)).sum().backward()
        A(_x(r, seed=2), second=r == 0).sum().backward()
        per_rank["apart"].append(_grads(A, B))
    for out in after_wrap:
        for case in ("nested", "apart"):
            _assert_grads(out[key][case], _mean(per_rank[case]))


def test_a_forward_run_by_backward_changes_no_order_and_sends_nothing(after_wrap):
    """dB(checkpoint(dA, x)), A's second layer used on rank 1 only, B's on rank 0 only: the recomputation ran
    dA's forward during the backward, which sent A's buffers among the backward's all-reduces and moved A to
    the front of the order after B had worked out its own; the ranks launched A's and B's all-reduces in other
    orders and took each other's gradients, silently (use_reentrant=False or True). A forward run by a
    backward now leaves the order, the reducer and the buffers alone; a reentrant checkpoint's, which cannot
    decide that its backward reduces, raises on every rank where the wrapper's last forward with gradients
    ran under no_sync()."""
    per_rank = []
    for r in range(2):
        torch.manual_seed(0)
        A, B = _ScaledTwo(), _Two()
        B(A(_x(r), second=r == 1), second=r == 0).sum().backward()
        per_rank.append(_grads(A, B))
    for out in after_wrap:
        for key in ("checkpointed", "checkpointed, reentrant"):
            kind, grads = out[key]
            assert kind == "ok", (key, grads)
            _assert_grads(grads, _mean(per_rank))
        kind, msg = out["reentrant after no_sync"]
        assert kind == "RuntimeError" and "ran under no_sync()" in msg and "use use_reentrant=False" in msg, msg


def test_a_backward_that_raised_leaves_nothing_to_the_next(after_wrap):
    """A backward that raised in B never ran B's end-of-backward callback: B stayed in it with a complete bucket
    held, and the next backward, of A alone, reached B in the order and launched B's stale bucket: an all-reduce
    never waited for, and B's parameters got zero gradients (views of its buckets), which momentum and weight
    decay then step, where one process leaves them None. The next backward on the group now discards what a dead
    one left (waiting for what it launched); later steps of both, and the second of two losses forwarded before
    the raise, reduce as one process computes."""
    torch.manual_seed(0)
    A, B = _Two(), _Two()  # (_BoomTwo's parameters; _Boom passes the gradient on when not armed)
    per_rank = {"A alone": [], "both": [], "second loss": []}
    for r in range(2):
        A.zero_grad(set_to_none=True)
        A(_x(r, seed=2)).sum().backward()
        per_rank["A alone"].append(_grads(A, B))
        A.zero_grad(set_to_none=True)
        B(A(_x(r, seed=4), second=r == 0)).sum().backward()
        per_rank["both"].append(_grads(A, B))
        A.zero_grad(set_to_none=True)
        B.zero_grad(set_to_none=True)
        B(_x(r, seed=6)).sum().backward()
        per_rank["second loss"].append(_grads(A, B))
        B.zero_grad(set_to_none=True)
    for out in after_wrap:
        kind, got = out["raised backward"]
        assert kind == "ok", got
        grads, inflight = got["A alone"]
        assert grads[2:] == [None, None] and inflight == 0, (grads, inflight)
        _assert_grads(grads, _mean(per_rank["A alone"]))
        _assert_grads(got["both"], _mean(per_rank["both"]))
        done, grads = got["second loss"]
        assert done == ("ok", None), done
        _assert_grads(grads, _mean(per_rank["second loss"]))
