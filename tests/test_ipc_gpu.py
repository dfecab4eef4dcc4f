"""The ipc backend on a GPU (scripts/gpu_check.sh; skipped without one): 2-4 processes sharing GPU 0.

Every collective, dtype and op, uneven counts, in place and out of place, sizes that run in several
pieces of the registered area; results equal the torch reference (reference_data.reference, on the
CPU) and bitwise equal across ranks. Then the faults: a rank that never calls (the others raise
CollectiveTimeout naming it, and the GPU stays usable), a mismatched call (CollectiveError on every
rank at the next host wait, the group usable after), DataParallel / ZeroOptimizer over ipc at 2
ranks against one process (with opt.gathered_parameters() blocks too), and calls captured into CUDA
graphs and replayed (a DataParallel step too).
"""
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks
from reference_data import make_input, reference

pytestmark = pytest.mark.gpu
ENV = {"CUDA_VISIBLE_DEVICES": "0"}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64]
OPS = ["sum", "avg", "max", "min", "prod"]
SIZES = [1, 1031, 70001]  # 70001 x 8 B > the 64 KiB area below: several pieces
AREA = 64 << 10


def _counts(size, n):
    """Uneven, one rank with none."""
    base = [size // n + (3 if r == 0 else 0) for r in range(n)]
    base[-1] = 0
    return base


def _cases(all_reduce_algos=("oneshot", "twoshot"), algo=None):
    """(collective, dtype, op, size, algo, in place) of every case; `algo` for the other collectives."""
    for size in SIZES:
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                for ar in all_reduce_algos:
                    yield ("all_reduce", dtype, op, size, ar, size % 2 == 0)
                yield ("reduce_scatter", dtype, op, size, algo, False)
            yield ("all_gather", dtype, None, size, algo, False)
            yield ("broadcast", dtype, None, size, algo, False)


def _rank_collectives(cases, options, backend="ipc"):
    pz.init(backend=backend, timeout=120, options=options)
    n, me = pz.get_world_size(), pz.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for seed, (coll, dtype, op, size, algo, inplace) in enumerate(cases):
        mine = make_input(op or "sum", dtype, size, me, seed).to(dev)
        if coll == "all_reduce":
            if inplace:
                pz.all_reduce(mine, op=op, algo=algo)
                got = mine
            else:
                got = torch.empty_like(mine)
                pz.all_reduce(mine, op=op, algo=algo, out=got)
        elif coll == "reduce_scatter":
            counts = _counts(size, n)
            full = make_input(op, dtype, sum(counts), me, seed).to(dev)
            got = torch.empty(counts[me], dtype=dtype, device=dev)
            pz.reduce_scatter(got, full, op=op, counts=counts, algo=algo)
        elif coll == "all_gather":
            counts = _counts(size, n)
            own = make_input("sum", dtype, counts[me], me, seed).to(dev)
            got = torch.empty(sum(counts), dtype=dtype, device=dev)
            pz.all_gather(got, own, counts=counts, algo=algo)
        else:
            got = mine
            pz.broadcast(got, src=seed % n, algo=algo)
        out.append(got.cpu())
    torch.cuda.synchronize()
    pz.destroy()
    return out


def _expected(coll, dtype, op, size, n, k):
    """Every rank's result of case `k` (seed k), from the torch reference."""
    if coll == "all_reduce":
        return [reference([make_input(op, dtype, size, r, k) for r in range(n)], op, dtype)] * n
    if coll == "reduce_scatter":
        counts = _counts(size, n)
        full = reference([make_input(op, dtype, sum(counts), r, k) for r in range(n)], op, dtype)
        return list(full.split(counts))
    if coll == "all_gather":
        counts = _counts(size, n)
        return [torch.cat([make_input("sum", dtype, counts[r], r, k) for r in range(n)])] * n
    return [make_input("sum", dtype, size, k % n, k)] * n


@pytest.mark.parametrize("nprocs,system_scope", [(2, False), (3, False), (4, False), (2, True)])
def test_every_collective_equals_torch_and_is_bitwise_equal_across_ranks(nprocs, system_scope):
    """Every rank on GPU 0: the flags at GPU scope (the default there), and at system scope when asked."""
    cases = list(_cases())
    res = run_ranks(_rank_collectives, nprocs, args=(cases, {"slice_bytes": AREA, "system_scope": system_scope}),
                    start="spawn", timeout=600, env=ENV)
    check_collectives(res, cases)


def check_collectives(res, cases):
    """Every rank's result of every case (from _rank_collectives) equals the torch reference, and all_reduce
    results are bitwise equal across ranks."""
    n = len(res)
    for k, (coll, dtype, op, size, algo, inplace) in enumerate(cases):
        where = f"{coll} {dtype} {op} size {size} algo {algo} in place {inplace}"
        want = _expected(coll, dtype, op, size, n, k)
        for r in range(n):
            assert torch.equal(res[r].value[k], want[r]), f"rank {r}: {where}"
        if coll == "all_reduce":
            for r in range(1, n):
                assert torch.equal(res[r].value[k], res[0].value[k]), f"rank {r} differs from rank 0: {where}"


def _rank_faults():
    pz.init(backend="ipc", timeout=3)
    n, me = pz.get_world_size(), pz.get_rank()
    t = torch.ones(4096, device="cuda")
    pz.all_reduce(t)
    torch.cuda.synchronize()
    first = float(t[0])
    # a mismatched call: rank 1 sends float64; everyone learns at the next host wait
    x = torch.ones(64, device="cuda", dtype=torch.float64 if me == 1 else torch.float32)
    pz.all_reduce(x)
    mismatch = None
    try:
        pz.barrier()
    except pz.CollectiveError as e:
        mismatch = str(e)
    y = torch.full((100,), float(me + 1), device="cuda")
    pz.all_reduce(y)  # the group is still usable
    torch.cuda.synchronize()
    after = float(y[0])
    # rank n-1 never calls and closes the group (its process ends): the others learn it left
    timeout = None
    if me != n - 1:
        try:
            pz.all_reduce(t, async_op=True).synchronize()
        except pz.CollectiveTimeout as e:
            timeout = str(e)
        usable = float((torch.ones(8, device="cuda") * 2).sum())  # the GPU itself is fine
    else:
        usable = 16.0
    return {"first": first, "mismatch": mismatch, "after": after, "timeout": timeout, "usable": usable}


def test_mismatch_and_missing_rank_are_errors_not_hangs():
    res = run_ranks(_rank_faults, 3, start="spawn", timeout=180, env=ENV)
    for r in res:
        v = r.value
        assert v["first"] == 3.0 and v["after"] == 6.0 and v["usable"] == 16.0, v
        assert v["mismatch"] is not None and "differs from rank" in v["mismatch"], v
        if r.rank != 2:
            assert v["timeout"] is not None and "rank 2 closed the group" in v["timeout"], v


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)


def _rank_layers(backend="ipc"):
    pz.init(backend=backend, timeout=120)
    n, me = pz.get_world_size(), pz.get_rank()
    per = 8 // n
    out = {}
    model = make_model().cuda()
    dp = pz.DataParallel(model, bucket_mb=0.001)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = (t.cuda()[me * per:(me + 1) * per] for t in batch(step))
        F.mse_loss(dp(x), y).backward()
        opt.step()
        opt.zero_grad()
    out["dp"] = {k: v.cpu() for k, v in model.state_dict().items()}
    for stage in (1, 2, 3):
        model = make_model().cuda()
        zo = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=1e-2, bucket_mb=0.0005)
        for step in range(3):
            x, y = (t.cuda()[me * per:(me + 1) * per] for t in batch(step))
            F.mse_loss(model(x), y).backward()
            zo.step()
        sd = zo.full_state_dict() if stage == 3 else model.state_dict()
        out[stage] = None if sd is None else {k: v.cpu() for k, v in sd.items()}
    pz.destroy()
    return out


def test_data_parallel_and_zero_over_ipc_equal_one_process():
    check_layers(run_ranks(_rank_layers, 2, start="spawn", timeout=300, env=ENV))


def check_layers(res):
    """DataParallel and ZeroOptimizer 1-3 (from _rank_layers) equal 3 steps of one process."""
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = (t.cuda() for t in batch(step))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.cpu() for k, v in model.state_dict().items()}
    for r in res:
        for key, got in r.value.items():
            if got is None:
                continue
            for k, want in ref.items():
                torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, key=key, r=r: f"rank {r.rank} {key} {k}: {m}")


def sync_bn_model(norm=nn.SyncBatchNorm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), norm(32), nn.GELU(), nn.Linear(32, 4))


def _rank_sync_batchnorm():
    pz.init(backend="ipc", timeout=120)
    pz.distributed.init_torch()  # nn.SyncBatchNorm syncs over torch.distributed ("pyzero" on CUDA tensors)
    n, me = pz.get_world_size(), pz.get_rank()
    per = 8 // n
    model = sync_bn_model().cuda()
    dp = pz.DataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = (t.cuda()[me * per:(me + 1) * per] for t in batch(step))
        x = x * (1 + 4 * me)  # the ranks' halves differ: their own statistics would differ from the batch's
        F.mse_loss(dp(x), y).backward()
        opt.step()
        opt.zero_grad()
    out = {k: v.cpu() for k, v in model.state_dict().items()}
    torch.distributed.destroy_process_group()
    pz.destroy()
    return out


def test_sync_batchnorm_under_data_parallel_equals_batchnorm_of_the_whole_batch():
    """nn.SyncBatchNorm in a pz.DataParallel model with torch.distributed started beside pyzero
    (pyzero.distributed.init_torch): one process's nn.BatchNorm1d on the whole batch."""
    model = sync_bn_model(nn.BatchNorm1d).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        x, y = (t.cuda() for t in batch(step))
        x = torch.cat([x[:4], x[4:] * 5])
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.cpu() for k, v in model.state_dict().items()}
    for r in run_ranks(_rank_sync_batchnorm, 2, start="spawn", timeout=300, env=ENV):
        for k, want in ref.items():
            torch.testing.assert_close(r.value[k], want, rtol=1e-5, atol=1e-5,
                                       msg=lambda m, k=k, r=r: f"rank {r.rank} {k}: {m}")


GATHERED_RUNS = {"stage3": dict(stage=3), "stage3_offload": dict(stage=3, offload="cpu"),
                 "stage3_offload_params": dict(stage=3, offload="cpu", offload_params=True),
                 "stage2_bf16": dict(stage=2, param_dtype=torch.bfloat16)}


def train_with_blocks(model, opt, gathered, device, me=0, n=1):
    """Two steps, every weight halved inside a block (rank 0's values of the last layer's bias: zeros), two more."""
    per = 8 // n
    for step in range(4):
        if step == 2:
            with torch.no_grad(), gathered():
                for p in model.parameters():
                    p.mul_(0.5)
            with torch.no_grad(), gathered([model[2].bias], modifier_rank=0):
                model[2].bias.fill_(float(me))
        x, y = (t.to(device)[me * per:(me + 1) * per] for t in batch(step))
        F.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()


def _rank_gathered_blocks(device="cuda", backend="ipc"):
    pz.init(backend=backend, timeout=120)
    n, me = pz.get_world_size(), pz.get_rank()
    out = {}
    for name, kw in GATHERED_RUNS.items():
        model = make_model().to(device)
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, lr=1e-2, **kw)
        train_with_blocks(model, opt, opt.gathered_parameters, device, me, n)
        sd = opt.full_state_dict()
        out[name] = None if sd is None else {k: v.cpu() for k, v in sd.items()}
    pz.destroy()
    return out


def check_gathered_blocks(res, device="cuda"):
    model = make_model().to(device)
    train_with_blocks(model, torch.optim.AdamW(model.parameters(), lr=1e-2), lambda *a, **kw: torch.no_grad(),
                      device)
    ref = {k: v.cpu() for k, v in model.state_dict().items()}
    for name, kw in GATHERED_RUNS.items():
        # (bf16: a lost halving or bias would be off by tenths; bf16 rounding moves Adam's small updates)
        tol = dict(rtol=5e-2, atol=5e-2) if "param_dtype" in kw else dict(rtol=1e-5, atol=1e-6)
        for k, want in ref.items():
            torch.testing.assert_close(res[0].value[name][k], want, **tol,
                                       msg=lambda m, k=k, name=name: f"{name} {k}: {m}")


def test_gathered_parameter_blocks_over_ipc_equal_one_process():
    """opt.gathered_parameters() on the GPU (stage 3, with host masters under offload, also with host shards, a
    bf16 stage-2 model): a halving of every weight and rank 0's bias kept, as one process doing it on the whole
    batch."""
    check_gathered_blocks(run_ranks(_rank_gathered_blocks, 2, start="spawn", timeout=300, env=ENV))


# ---------------------------------------------------------------------------
# CUDA graphs: ipc calls captured into a graph and replayed (the epochs advance on the device)


def _rank_graph():
    pz.init(backend="ipc", timeout=120, options={"slice_bytes": AREA})
    n, me = pz.get_world_size(), pz.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    size = 70001  # several pieces of the 64 KiB area: several kernel nodes
    inp = torch.zeros(size, device=dev)
    res = torch.zeros(size, device=dev)
    small = torch.zeros(1031, dtype=torch.bfloat16, device=dev)
    gathered = torch.zeros(1031 * n, dtype=torch.float64, device=dev)
    own = torch.zeros(1031, dtype=torch.float64, device=dev)
    side = torch.zeros(257, device=dev)
    # warm up on a side stream, as torch.cuda.graph asks
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        pz.all_reduce(inp, out=res)
        # an eager async call: its work is polled inside the capture (the flight recorder's summary of the
        # refused barrier below), which must not invalidate the capture
        pz.all_reduce(side, async_op=True).wait()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    errors = {}
    with torch.cuda.graph(g):
        pz.all_reduce(inp, out=res)                      # out of place, two-shot pieces
        pz.all_reduce(small, op="max")                   # in place, one-shot
        w = pz.all_gather(gathered, own, async_op=True)  # async: waited inside the capture
        w.wait()
        try:  # a host wait cannot be captured: a clear error, and the capture goes on unharmed
            pz.barrier()
        except pz.CollectiveError as e:
            errors["barrier"] = str(e)
        try:
            w.synchronize()
        except pz.CollectiveError as e:
            errors["synchronize"] = str(e)
    out = []
    for i in range(4):  # replays with fresh inputs, eager calls between them
        inp.copy_(make_input("sum", torch.float32, size, me, 100 + i).to(dev))
        small.copy_(make_input("max", torch.bfloat16, 1031, me, 200 + i).to(dev))
        own.copy_(make_input("sum", torch.float64, 1031, me, 300 + i).to(dev))
        g.replay()
        side.copy_(make_input("sum", torch.float32, 257, me, 400 + i).to(dev))
        pz.all_reduce(side)
        torch.cuda.synchronize()
        out.append((res.cpu(), small.cpu(), gathered.cpu(), side.cpu()))
    pz.barrier()  # eager again after the replays: the group is in step
    pz.destroy()
    return out, errors


@pytest.mark.parametrize("nprocs", [2, 3])
def test_captured_calls_replay_like_eager_calls(nprocs):
    """all_reduce (pieces, out of place; one-shot in place) and an async all_gather captured in one
    graph, replayed 4 times with fresh inputs and eager calls between replays: every replay equals
    the torch reference; host waits inside the capture raise a clear error instead of breaking it."""
    res = run_ranks(_rank_graph, nprocs, start="spawn", timeout=300, env=ENV)
    n = nprocs
    for r in res:
        out, errors = r.value
        assert "CUDA graph capture" in errors["barrier"] and "async_op=True" in errors["barrier"], errors
        assert "captured into a CUDA graph" in errors["synchronize"], errors
        for i, (got, small, gathered, side) in enumerate(out):
            want = reference([make_input("sum", torch.float32, 70001, p, 100 + i) for p in range(n)], "sum",
                             torch.float32)
            assert torch.equal(got, want), f"rank {r.rank} replay {i}: all_reduce"
            want = reference([make_input("max", torch.bfloat16, 1031, p, 200 + i) for p in range(n)], "max",
                             torch.bfloat16)
            assert torch.equal(small, want), f"rank {r.rank} replay {i}: in-place max"
            want = torch.cat([make_input("sum", torch.float64, 1031, p, 300 + i) for p in range(n)])
            assert torch.equal(gathered, want), f"rank {r.rank} replay {i}: all_gather"
            want = reference([make_input("sum", torch.float32, 257, p, 400 + i) for p in range(n)], "sum",
                             torch.float32)
            assert torch.equal(side, want), f"rank {r.rank} replay {i}: the eager call between replays"


def _train_captured(step, load, steps):
    """Two eager steps on a side stream (the warm-up torch.cuda.graph asks for; they train too), then
    `step` captured once and replayed; `load(k)` puts step k's batch into the step's static inputs.
    Each step's loss."""
    losses = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for k in range(2):
            load(k)
            losses.append(step().item())
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        loss_static = step()
    for k in range(2, steps):
        load(k)
        g.replay()
        losses.append(loss_static.item())
    return losses


def _rank_dp_graph(steps):
    """A DataParallel step (forward, backward with the bucket hooks, a capturable AdamW step)
    captured once and replayed; the loss of each replay, and the parameters after."""
    pz.init(backend="ipc", timeout=120)
    n, me = pz.get_world_size(), pz.get_rank()
    per = 8 // n
    model = make_model().cuda()
    dp = pz.DataParallel(model, bucket_mb=0.001)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, capturable=True)
    x_static = torch.zeros(per, 16, device="cuda")
    y_static = torch.zeros(per, 4, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        loss = F.mse_loss(dp(x_static), y_static)
        loss.backward()
        opt.step()
        return loss

    def load(k):
        x, y = (t.cuda()[me * per:(me + 1) * per] for t in batch(k))
        x_static.copy_(x)
        y_static.copy_(y)

    losses = _train_captured(step, load, steps)
    state = {k: v.cpu() for k, v in model.state_dict().items()}
    pz.destroy()
    return losses, state


def test_captured_data_parallel_step_equals_eager_training():
    """The whole DataParallel step in a CUDA graph (its bucket all_reduces inside the graph) trains
    as one process does eagerly: the same losses and parameters."""
    steps = 6
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_losses = []
    for k in range(steps):
        x, y = (t.cuda() for t in batch(k))
        loss = F.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss)
    ref = {k: v.cpu() for k, v in model.state_dict().items()}
    res = run_ranks(_rank_dp_graph, 2, args=(steps,), start="spawn", timeout=300, env=ENV)
    for r in res:
        losses, state = r.value
        # each rank's loss is of its half of the batch; their mean is the full batch's loss
        assert len(losses) == steps
    mean = [(a + b) / 2 for a, b in zip(res[0].value[0], res[1].value[0])]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor([v.item() for v in ref_losses]), rtol=1e-5, atol=1e-6)
    for r in res:
        for k, want in ref.items():
            torch.testing.assert_close(r.value[1][k], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, r=r: f"rank {r.rank} {k}: {m}")


def _rank_gpt2_graph(steps, per, seq):
    """GPT-2 small (124M, tied embedding) under DataParallel's default buckets: two eager steps, then
    the step captured once and replayed; each step's loss of this rank's half of the batch."""
    from pyzero.bench.gpt import PRESETS, make_gpt, random_batch
    pz.init(backend="ipc", timeout=120)
    me = pz.get_rank()
    model = make_gpt("gpt2").cuda()
    dp = pz.DataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, capturable=True)
    idx = torch.zeros(per, seq, dtype=torch.long, device="cuda")
    tgt = torch.zeros(per, seq, dtype=torch.long, device="cuda")

    def step():
        opt.zero_grad(set_to_none=False)
        loss = dp(idx, tgt)
        loss.backward()
        opt.step()
        return loss

    def load(k):
        x, y = random_batch(PRESETS["gpt2"], 2 * per, seq, seed=k)
        idx.copy_(x[me * per:(me + 1) * per])
        tgt.copy_(y[me * per:(me + 1) * per])

    losses = _train_captured(step, load, steps)
    pz.destroy()
    return losses


def test_captured_gpt2_data_parallel_step_equals_eager_training():
    """GPT-2 small's whole DataParallel step (forward, backward with its 25 MB bucket all_reduces, the
    AdamW step) in one CUDA graph at 2 processes: each replay's loss (the mean of the ranks' halves)
    is the loss of one process training eagerly on the whole batch."""
    from pyzero.bench.gpt import PRESETS, make_gpt, random_batch
    steps, per, seq = 6, 4, 256
    model = make_gpt("gpt2").cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ref = []
    for k in range(steps):
        x, y = (t.cuda() for t in random_batch(PRESETS["gpt2"], 2 * per, seq, seed=k))
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref.append(float(loss))
    del model, opt
    torch.cuda.empty_cache()
    res = run_ranks(_rank_gpt2_graph, 2, args=(steps, per, seq), start="spawn", timeout=300, env=ENV)
    mean = [(a + b) / 2 for a, b in zip(res[0].value, res[1].value)]
    torch.testing.assert_close(torch.tensor(mean), torch.tensor(ref), rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------
# Point-to-point (csrc/ipc_p2p.h): send/recv, async, batches, a ring, CUDA graphs, pipeline, TP overlap

P2P_SIZES = [0, 1, 1031, 70001]  # 70001 x 8 B: many pieces of the 64 KiB channels below
P2P_OPTIONS = {"p2p_bytes": 64 << 10, "slice_bytes": AREA}


def _msg(src, dst, dtype, size, seed):
    """What rank src sends to rank dst (a pattern of both, so a message to the wrong rank is caught)."""
    return make_input("sum", dtype, size, src * 31 + dst, seed)


def _rank_p2p(backend="ipc", options=P2P_OPTIONS):
    pz.init(backend=backend, timeout=120, options=options)
    n, me = pz.get_world_size(), pz.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    nxt, prv = (me + 1) % n, (me - 1) % n
    got = {}
    # 1. blocking send/recv in pairs (0, 1) and (2, 3): the lower rank sends first, then the other
    partner = me ^ 1
    for k, (dtype, size) in enumerate((d, s) for d in DTYPES for s in P2P_SIZES):
        if partner >= n:
            continue
        for sender in sorted((me, partner)):
            if me == sender:
                pz.send(_msg(me, partner, dtype, size, k).to(dev), dst=partner)
            else:
                t = torch.full((size,), 7, dtype=dtype, device=dev)
                pz.recv(t, src=partner)
                got[("pair", sender, me, str(dtype), size, k)] = t.cpu()
    # 2. async: rank 0 sends to every other rank, each receives with async_op
    if me == 0:
        works = [pz.send(_msg(0, p, torch.float32, 5000 + p, 50).to(dev), dst=p, async_op=True) for p in range(1, n)]
    else:
        t = torch.zeros(5000 + me, device=dev)
        works = [pz.recv(t, src=0, async_op=True)]
    for w in works:
        w.wait()
    if me:
        got[("async", 0, me)] = t.cpu()
    # 3. one batch: a ring step of every dtype (six messages on each channel), sends and receives at once
    for size in (1031, 70001):
        ops, recvs = [], {}
        for dtype in DTYPES:
            ops.append(pz.P2POp("send", _msg(me, nxt, dtype, size, 60).to(dev), nxt))
            recvs[str(dtype)] = torch.zeros(size, dtype=dtype, device=dev)
            ops.append(pz.P2POp("recv", recvs[str(dtype)], prv))
        pz.batch_isend_irecv(ops)[0].wait()
        for name, r in recvs.items():
            got[("batch", prv, me, name, size)] = r.cpu()
    # 4. a ring all-gather over send/recv: n - 1 steps, each one batch
    blocks = [None] * n
    blocks[me] = _msg(me, me, torch.float32, 3001, 70).to(dev)
    for s in range(n - 1):
        c_send, c_recv = (me - s) % n, (me - s - 1) % n
        blocks[c_recv] = torch.empty(3001, device=dev)
        pz.batch_isend_irecv([pz.P2POp("send", blocks[c_send], nxt), pz.P2POp("recv", blocks[c_recv], prv)])[0].wait()
    got["ring"] = torch.cat([b.cpu() for b in blocks])
    # 5. a ring step captured in a CUDA graph, replayed with fresh data (message numbers live on the device)
    send_buf, recv_buf = torch.zeros(20000, device=dev), torch.zeros(20000, device=dev)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up on a side stream, as torch.cuda.graph asks
        pz.batch_isend_irecv([pz.P2POp("send", send_buf, nxt), pz.P2POp("recv", recv_buf, prv)])[0].wait()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        pz.batch_isend_irecv([pz.P2POp("send", send_buf, nxt), pz.P2POp("recv", recv_buf, prv)])[0].wait()
    for i in range(3):
        send_buf.copy_(_msg(me, nxt, torch.float32, 20000, 80 + i).to(dev))
        graph.replay()
        if me == 0:  # an eager message between replays
            pz.send(_msg(0, 1, torch.int64, 999, 90 + i).to(dev), dst=1)
        elif me == 1:
            t = torch.zeros(999, dtype=torch.int64, device=dev)
            pz.recv(t, src=0)
        torch.cuda.synchronize()
        got[("graph", prv, me, i)] = recv_buf.cpu()
        if me == 1:
            got[("eager", 0, 1, i)] = t.cpu()
    pz.barrier()  # no mismatch was recorded (a host wait would raise it)
    stats = pz.comm_stats()
    pz.destroy()
    return got, stats


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_point_to_point_delivers_the_sent_data(nprocs):
    check_p2p(run_ranks(_rank_p2p, nprocs, start="spawn", timeout=600, env=ENV))


def check_p2p(res):
    """Every message of _rank_p2p arrived intact where it was sent."""
    n = len(res)
    for r in res:
        me = r.rank
        got, stats = r.value
        prv = (me - 1) % n
        partner = me ^ 1
        expected = 0
        if partner < n:
            for k, (dtype, size) in enumerate((d, s) for d in DTYPES for s in P2P_SIZES):
                key = ("pair", partner, me, str(dtype), size, k)
                assert torch.equal(got[key], _msg(partner, me, dtype, size, k)), f"rank {me}: {key}"
                expected += 1
        if me:
            assert torch.equal(got[("async", 0, me)], _msg(0, me, torch.float32, 5000 + me, 50)), f"rank {me}"
        for size in (1031, 70001):
            for dtype in DTYPES:
                key = ("batch", prv, me, str(dtype), size)
                assert torch.equal(got[key], _msg(prv, me, dtype, size, 60)), f"rank {me}: {key}"
        want = torch.cat([_msg(q, q, torch.float32, 3001, 70) for q in range(n)])
        assert torch.equal(got["ring"], want), f"rank {me}: ring all-gather over send/recv"
        for i in range(3):
            assert torch.equal(got[("graph", prv, me, i)], _msg(prv, me, torch.float32, 20000, 80 + i)), \
                f"rank {me}: graph replay {i}"
            if me == 1:
                assert torch.equal(got[("eager", 0, 1, i)], _msg(0, 1, torch.int64, 999, 90 + i)), f"eager {i}"
        assert stats["recv"]["calls"] >= expected and stats["send"]["calls"] >= expected, stats


def _rank_p2p_faults():
    pz.init(backend="ipc", timeout=3)
    me = pz.get_rank()
    out = {}
    # sizes that differ: both ranks raise at their next host wait, the message skipped, the group goes on
    if me == 0:
        pz.send(torch.ones(100, device="cuda"), dst=1)
    else:
        pz.recv(torch.zeros(120, device="cuda"), src=0)
    try:
        pz.barrier()
    except pz.CollectiveError as e:
        out["mismatch"], out["mismatch_type"] = str(e), type(e).__name__
    t = torch.full((64,), float(me + 1), device="cuda")
    if me == 0:
        pz.send(t, dst=1)
    else:
        pz.recv(t, src=0)
    torch.cuda.synchronize()
    out["after"] = t.cpu()
    # a send whose receive never comes: a timeout naming the peer, not a hang
    if me == 0:
        try:
            pz.send(torch.ones(1000, device="cuda"), dst=1, async_op=True).synchronize()
        except pz.CollectiveTimeout as e:
            out["timeout"] = str(e)
        out["usable"] = float((torch.ones(8, device="cuda") * 2).sum())  # the GPU itself is fine
    return out


def test_point_to_point_mismatch_and_missing_receive_are_errors_not_hangs():
    res = run_ranks(_rank_p2p_faults, 2, start="spawn", timeout=180, env=ENV)
    v0, v1 = res[0].value, res[1].value
    assert "a send to rank 1 of 400 bytes (float32) does not match rank 1's receive of 480 bytes" in v0["mismatch"]
    assert "a receive from rank 0 of 480 bytes (float32) does not match rank 0's send of 400 bytes" in v1["mismatch"]
    assert v0["mismatch_type"] == v1["mismatch_type"] == "MessageMismatch"  # (a CollectiveError)
    assert torch.equal(v0["after"], torch.ones(64)) and torch.equal(v1["after"], torch.ones(64))
    assert "a send to rank 1" in v0["timeout"] and "waiting for rank 1 to post the matching receive" in v0["timeout"]
    assert v0["usable"] == 16.0


def _rank_p2p_peer_left():
    import time  # noqa: PLC0415
    pz.init(backend="ipc", timeout=60)
    me = pz.get_rank()
    t0 = time.monotonic()
    if me == 0:  # sends one message, then leaves while rank 1 still waits for a second one
        pz.send(torch.full((4096,), 7.0, device="cuda"), dst=1)
        torch.cuda.synchronize()
        pz.destroy()
        return {"destroy_s": time.monotonic() - t0}
    got = torch.zeros(4096, device="cuda")
    pz.recv(got, src=0)
    err = None
    try:
        pz.recv(torch.zeros(16, device="cuda"), src=0, async_op=True).synchronize()
    except pz.CollectiveTimeout as e:
        err = str(e)
    return {"got": got.cpu(), "err": err, "wait_s": time.monotonic() - t0}


def test_point_to_point_peer_that_left_is_an_error_at_once():
    """A rank that closes the group ends the waits on it (not the 60 s timeout): [Note: a peer that closed]."""
    res = run_ranks(_rank_p2p_peer_left, 2, start="spawn", timeout=150, env=ENV)
    v0, v1 = res[0].value, res[1].value
    assert torch.equal(v1["got"], torch.full((4096,), 7.0)), v1["got"][:4]
    assert v1["err"] is not None and "a receive from rank 0" in v1["err"], v1
    assert "found that rank 0 closed the group" in v1["err"], v1
    assert v1["wait_s"] < 45 and v0["destroy_s"] < 45, (v0, v1)  # both well before the 60 s timeout


IN, HIDDEN, OUT = 6, 16, 5


def make_pipeline_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh(),
                         nn.Linear(HIDDEN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, OUT))


def pipeline_batch(seed, m):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2 * m, IN, generator=g), torch.randn(2 * m, OUT, generator=g)


def _rank_pipeline(m, backend="ipc"):
    pz.init(backend=backend, timeout=120)
    n, r = pz.get_world_size(), pz.get_rank()
    out = {}
    for schedule in ("gpipe", "1f1b"):
        stage = pz.pipeline.split_sequential(make_pipeline_model(), n)[r].cuda()
        pipe = pz.pipeline.Pipeline(stage, m, schedule)
        losses, grads = [], []
        for seed in (1, 2):
            x, y = (t.cuda() for t in pipeline_batch(seed, m))
            losses.append(pipe.train_step(x if pipe.is_first else None, y if pipe.is_last else None, F.mse_loss))
            grads.append({name: p.grad.cpu() for name, p in stage.named_parameters()})
            with torch.no_grad():
                for p in stage.parameters():
                    p -= 0.1 * p.grad
                    p.grad = None
        out[schedule] = (losses, grads)
    pz.destroy()
    return out


@pytest.mark.parametrize("nprocs", [2, 4])
def test_pipeline_over_ipc_equals_one_process(nprocs):
    check_pipeline(run_ranks(_rank_pipeline, nprocs, args=(2 * nprocs,), start="spawn", timeout=300, env=ENV))


def check_pipeline(results):
    """Both schedules' losses and gradients (from _rank_pipeline, m = 2 x stages) equal one process's."""
    nprocs = len(results)
    m = 2 * nprocs
    model, ref = make_pipeline_model(), []
    for seed in (1, 2):
        x, y = pipeline_batch(seed, m)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        ref.append((loss.item(), {name: p.grad.clone() for name, p in model.named_parameters()}))
        with torch.no_grad():
            for p in model.parameters():
                p -= 0.1 * p.grad
                p.grad = None
    for res in results:
        for schedule, (losses, grads) in res.value.items():
            for step, (ref_loss, ref_grads) in enumerate(ref):
                where = f"stage {res.rank} {schedule} step {step}"
                if res.rank == nprocs - 1:
                    assert losses[step] == pytest.approx(ref_loss, rel=1e-4), where
                assert grads[step] and set(grads[step]) <= set(ref_grads), where
                for name, g in grads[step].items():
                    torch.testing.assert_close(g, ref_grads[name], rtol=1e-4, atol=1e-5,
                                               msg=lambda s, name=name, where=where: f"{where} {name}: {s}")


def _seeded(seed, *shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _rank_tp_overlap(backend="ipc"):
    pz.init(backend=backend, timeout=120)
    n, r = pz.get_world_size(), pz.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    m, b, k, o = 3, 2, 5, 4
    x_full = _seeded(100, n * m, b, k)
    ws, ts = [_seeded(200 + q, o, k) for q in range(n)], [_seeded(300 + q, n * m, b, o) for q in range(n)]
    x = x_full[r * m:(r + 1) * m].to(dev).requires_grad_()
    w = ws[r].to(dev).requires_grad_()
    pz.comm_stats(reset=True)
    y = pz.tp.all_gather_matmul(x, w)
    sent = pz.comm_stats().get("send", {}).get("elements", 0)
    (y * ts[r].to(dev)).sum().backward()
    out = {"ag": (y.detach().cpu(), x.grad.cpu(), w.grad.cpu(), sent)}
    xs, ws2 = [_seeded(400 + q, n * m, b, k) for q in range(n)], [_seeded(500 + q, o, k) for q in range(n)]
    t_full = _seeded(600, n * m, b, o)
    x = xs[r].to(dev).requires_grad_()
    w = ws2[r].to(dev).requires_grad_()
    y = pz.tp.matmul_reduce_scatter(x, w)
    (y * t_full[r * m:(r + 1) * m].to(dev)).sum().backward()
    out["rs"] = (y.detach().cpu(), x.grad.cpu(), w.grad.cpu())
    pz.destroy()
    return out


@pytest.mark.parametrize("nprocs", [2, 3])
def test_tp_overlapped_ops_over_ipc_equal_one_process(nprocs):
    check_tp(run_ranks(_rank_tp_overlap, nprocs, start="spawn", timeout=300, env=ENV))


def check_tp(results):
    """all_gather_matmul and matmul_reduce_scatter (from _rank_tp_overlap), forward and backward, equal the
    whole matmuls of one process."""
    n, m, b, k, o = len(results), 3, 2, 5, 4
    tol = dict(rtol=1e-4, atol=1e-5)
    x_full = _seeded(100, n * m, b, k)
    ws, ts = [_seeded(200 + q, o, k) for q in range(n)], [_seeded(300 + q, n * m, b, o) for q in range(n)]
    xs, ws2 = [_seeded(400 + q, n * m, b, k) for q in range(n)], [_seeded(500 + q, o, k) for q in range(n)]
    t_full = _seeded(600, n * m, b, o)
    for res in results:
        r = res.rank
        y, dx, dw, sent = res.value["ag"]
        torch.testing.assert_close(y, x_full @ ws[r].t(), **tol)
        torch.testing.assert_close(dx, sum(ts[q] @ ws[q] for q in range(n))[r * m:(r + 1) * m], **tol)
        torch.testing.assert_close(dw, torch.einsum("sbo,sbk->ok", ts[r], x_full), **tol)
        assert sent == (n - 1) * m * b * k  # the blocks went over the send/recv ring
        y, dx, dw = res.value["rs"]
        torch.testing.assert_close(y, sum(xs[q] @ ws2[q].t() for q in range(n))[r * m:(r + 1) * m], **tol)
        torch.testing.assert_close(dx, t_full @ ws2[r], **tol)
        torch.testing.assert_close(dw, torch.einsum("sbo,sbk->ok", t_full, xs[r]), **tol)


# ---------------------------------------------------------------------------
# algo="ring": csrc/p2p_ring.h's schedule over the point-to-point channels


@pytest.mark.parametrize("nprocs", [2, 3])
def test_ring_over_point_to_point_equals_torch(nprocs):
    """Values exact in every dtype's sums: the ring's order of reduction gives torch's result bitwise."""
    cases = list(_cases(all_reduce_algos=("ring",), algo="ring"))
    # 64 KiB of staging: large calls in many groups
    res = run_ranks(_rank_collectives, nprocs, args=(cases, P2P_OPTIONS), start="spawn", timeout=600, env=ENV)
    check_collectives(res, cases)


# ---------------------------------------------------------------------------
# A fresh group's first calls: every kernel was loaded when the group was made


def _rank_first_calls():
    """The group's first calls (a one-shot fp32, then a ring in bf16 with its element-wise kernels),
    each queued behind ~50 ms of work on the current stream. CUDA loads a kernel at its first launch
    unless it was loaded before, and such a load waits for every kernel queued in the process: the
    host would then wait for the queued work, and the work would be complete when the call returns."""
    pz.init(backend="ipc")
    n, me = pz.get_world_size(), pz.get_rank()
    out = []
    for algo, dtype in (("oneshot", torch.float32), ("ring", torch.bfloat16)):
        t = torch.full((4099,), float(me + 1), dtype=dtype, device="cuda")
        torch.cuda.synchronize()
        torch.cuda._sleep(100_000_000)  # ~50 ms on the current stream
        start = time.perf_counter()
        w = pz.all_reduce(t, async_op=True, algo=algo)
        issued_s = time.perf_counter() - start
        done_at_once = w.is_completed()
        w.wait()
        ok = torch.equal(t.cpu(), torch.full((4099,), float(n * (n + 1) // 2), dtype=dtype))
        out.append((algo, issued_s, done_at_once, ok))
    pz.destroy()
    return out


def test_first_calls_of_a_group_do_not_wait_for_queued_work():
    for r in run_ranks(_rank_first_calls, 2, start="spawn", timeout=120, env=ENV):
        for algo, issued_s, done_at_once, ok in r.value:
            where = f"rank {r.rank}, {algo}"
            assert ok, f"{where}: wrong sum"
            assert not done_at_once and issued_s < 0.025, (
                f"{where}: the call took {issued_s * 1e3:.1f} ms on the host and its work was "
                f"{'complete' if done_at_once else 'pending'} when it returned (~50 ms of work was queued before it)")
