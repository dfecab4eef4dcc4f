"""The ipc backend on a GPU (scripts/gpu_check.sh; skipped without one): 2-4 processes sharing GPU 0.

Every collective, dtype and op, uneven counts, in place and out of place, sizes that run in several
pieces of the registered area; results equal the torch reference (reference_data.reference, on the
CPU) and bitwise equal across ranks. Then the faults: a rank that never calls (the others raise
CollectiveTimeout naming it, and the GPU stays usable), a mismatched call (CollectiveError on every
rank at the next host wait, the group usable after), DataParallel / ZeroOptimizer over ipc at 2
ranks against one process, and calls captured into CUDA graphs and replayed (a DataParallel step too).
"""
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


def _cases():
    for size in SIZES:
        for dtype in DTYPES:
            for op in OPS:
                if op == "avg" and not dtype.is_floating_point:
                    continue
                for algo in ("oneshot", "twoshot"):
                    yield ("all_reduce", dtype, op, size, algo, size % 2 == 0)
                yield ("reduce_scatter", dtype, op, size, None, False)
            yield ("all_gather", dtype, None, size, None, False)
            yield ("broadcast", dtype, None, size, None, False)


def _rank_collectives():
    pz.init(backend="ipc", timeout=120, options={"slice_bytes": AREA})
    n, me = pz.get_world_size(), pz.get_rank()
    dev = torch.device("cuda", torch.cuda.current_device())
    out = []
    for seed, (coll, dtype, op, size, algo, inplace) in enumerate(_cases()):
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
            pz.reduce_scatter(got, full, op=op, counts=counts)
        elif coll == "all_gather":
            counts = _counts(size, n)
            own = make_input("sum", dtype, counts[me], me, seed).to(dev)
            got = torch.empty(sum(counts), dtype=dtype, device=dev)
            pz.all_gather(got, own, counts=counts)
        else:
            got = mine
            pz.broadcast(got, src=seed % n)
        out.append(got.cpu())
    torch.cuda.synchronize()
    pz.destroy()
    return out


@pytest.mark.parametrize("nprocs", [2, 3, 4])
def test_every_collective_equals_torch_and_is_bitwise_equal_across_ranks(nprocs):
    res = run_ranks(_rank_collectives, nprocs, start="spawn", timeout=600, env=ENV)
    n = nprocs
    for k, (coll, dtype, op, size, algo, inplace) in enumerate(_cases()):
        where = f"{coll} {dtype} {op} size {size} algo {algo} in place {inplace}"
        if coll == "all_reduce":
            want = [reference([make_input(op, dtype, size, r, k) for r in range(n)], op, dtype)] * n
        elif coll == "reduce_scatter":
            counts = _counts(size, n)
            full = reference([make_input(op, dtype, sum(counts), r, k) for r in range(n)], op, dtype)
            want = list(full.split(counts))
        elif coll == "all_gather":
            counts = _counts(size, n)
            want = [torch.cat([make_input("sum", dtype, counts[r], r, k) for r in range(n)])] * n
        else:
            want = [make_input("sum", dtype, size, k % n, k)] * n
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


def _rank_layers():
    pz.init(backend="ipc", timeout=120)
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
    model = make_model().cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(3):
        x, y = (t.cuda() for t in batch(step))
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    ref = {k: v.cpu() for k, v in model.state_dict().items()}
    res = run_ranks(_rank_layers, 2, start="spawn", timeout=300, env=ENV)
    for r in res:
        for key, got in r.value.items():
            if got is None:
                continue
            for k, want in ref.items():
                torch.testing.assert_close(got[k], want, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, k=k, key=key, r=r: f"rank {r.rank} {key} {k}: {m}")


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

    losses = []
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up steps, eager, on a side stream: they train too
        for k in range(2):
            x, y = (t.cuda()[me * per:(me + 1) * per] for t in batch(k))
            x_static.copy_(x)
            y_static.copy_(y)
            losses.append(float(step()))
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        loss_static = step()
    for k in range(2, steps):
        x, y = (t.cuda()[me * per:(me + 1) * per] for t in batch(k))
        x_static.copy_(x)
        y_static.copy_(y)
        g.replay()
        losses.append(float(loss_static))
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
    torch.testing.assert_close(torch.tensor(mean), torch.tensor([float(v) for v in ref_losses]), rtol=1e-5, atol=1e-6)
    for r in res:
        for k, want in ref.items():
            torch.testing.assert_close(r.value[1][k], want, rtol=1e-5, atol=1e-6,
                                       msg=lambda m, k=k, r=r: f"rank {r.rank} {k}: {m}")
