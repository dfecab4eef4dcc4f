"""pyzero as a torch.distributed backend ("pyzero"): every c10d op against a
torch reference, errors, and torch's own data-parallel stacks (DDP, FSDP2,
ZeroRedundancyOptimizer, DTensor, DCP) against the same run on gloo.

Each rank function runs many cases in one ``run_ranks`` call and returns its
failures. Op references are computed on every rank from all ranks' seeded
inputs with plain torch ops; the training references run the same script on
a gloo group of the same ranks, in the same processes.
"""
import datetime
import gc
import re
import time

import pytest
import torch
import torch.distributed as dist

import pyzero  # noqa: F401  (registers the backend)
from pyzero.launch import run_ranks

TIMEOUT = datetime.timedelta(seconds=30)
DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64,
          torch.bool, torch.uint8, torch.int8, torch.complex64]
REDUCE = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN,
          "prod": dist.ReduceOp.PRODUCT, "avg": dist.ReduceOp.AVG}


class Checker:
    def __init__(self):
        self.failures, self.cases = [], 0

    def check(self, what, got, want):
        self.cases += 1
        if got.dtype != want.dtype or got.shape != want.shape or not torch.equal(got, want):
            self.failures.append(f"rank {dist.get_rank()}: {what}: got {got.flatten()[:8].tolist()} "
                                 f"{got.dtype} {tuple(got.shape)}, want {want.flatten()[:8].tolist()} "
                                 f"{want.dtype} {tuple(want.shape)}")

    def close(self, what, got, want, tol):
        self.cases += 1
        if got.shape != want.shape or not torch.allclose(got, want, rtol=tol, atol=tol):
            err = (got - want).abs().max().item() if got.shape == want.shape else "shape"
            self.failures.append(f"rank {dist.get_rank()}: {what}: max error {err} > {tol}")

    def result(self):
        return {"failures": self.failures, "cases": self.cases}


def assert_ok(results, min_cases=1):
    failures = [f for r in results for f in r.value["failures"]]
    assert not failures, "\n".join(failures[:20])
    for r in results:
        assert r.value["cases"] >= min_cases, f"rank {r.rank} checked only {r.value['cases']} cases"


def data(dtype, shape, rank, seed, op="sum"):
    """Rank `rank`'s input: exact under every op (small ints; prod only of {1, 2, -1}; bools for bool)."""
    g = torch.Generator().manual_seed(seed * 131 + rank)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if op == "prod":
        v = torch.tensor([1, 2, -1])[torch.randint(0, 3, shape, generator=g)]
        return (v.abs() if dtype == torch.uint8 else v).to(dtype)
    if dtype == torch.complex64:
        return torch.complex(torch.randint(-8, 9, shape, generator=g).float(),
                             torch.randint(-8, 9, shape, generator=g).float())
    lo = 0 if dtype == torch.uint8 else -20
    return torch.randint(lo, 100, shape, generator=g).to(dtype)


def reduced(inputs, op, dtype):
    """The torch reference of a reduction over ranks (in float64/int64, cast back once)."""
    if dtype == torch.bool:
        s = torch.stack(inputs).int()
        r = {"sum": s.sum(0), "max": s.amax(0), "min": s.amin(0), "prod": s.prod(0)}[op]
        return r.bool()
    wide = torch.complex128 if dtype.is_complex else torch.float64 if dtype.is_floating_point else torch.int64
    s = torch.stack([i.to(wide) for i in inputs])
    r = {"sum": lambda: s.sum(0), "avg": lambda: s.sum(0) / len(inputs), "max": lambda: s.amax(0),
         "min": lambda: s.amin(0), "prod": lambda: s.prod(0)}[op]()
    return r.to(dtype)


def ops_for(dtype):
    if dtype.is_complex:
        return ["sum", "avg"]
    return ["sum", "max", "min", "prod"] + (["avg"] if dtype.is_floating_point else [])


# ---------------------------------------------------------------------------
# Every op on the world and on subgroups


def _rank_ops():
    dist.init_process_group("pyzero", timeout=TIMEOUT)
    n, me = dist.get_world_size(), dist.get_rank()
    ck = Checker()
    assert dist.get_backend() == "pyzero"
    groups = [(None, list(range(n)))]
    for ranks in ([0, n - 1], [1, 2] if n > 2 else [1]):  # (torch orders a group's ranks)
        groups.append((dist.new_group(ranks), ranks))
    for gi, (group, ranks) in enumerate(groups):
        if me not in ranks:
            continue
        seed = 1000 * gi  # the same on every member, whichever groups this rank skipped
        k, gr = len(ranks), ranks.index(me)
        tag = f"group {ranks}"
        for dtype in DTYPES:
            for op in ops_for(dtype):
                seed += 1
                ins = [data(dtype, (3, 5), r, seed, op) for r in ranks]
                t = ins[gr].clone()
                dist.all_reduce(t, op=REDUCE[op], group=group)
                ck.check(f"{tag} all_reduce {dtype} {op}", t, reduced(ins, op, dtype))
                t = ins[gr].clone().t()  # non-contiguous: staged
                dist.all_reduce(t, op=REDUCE[op], group=group)
                ck.check(f"{tag} all_reduce non-contiguous {dtype} {op}", t, reduced(ins, op, dtype).t())
                root = ranks[seed % k]
                t = ins[gr].clone()
                dist.reduce(t, root, op=REDUCE[op], group=group)
                ck.check(f"{tag} reduce {dtype} {op} dst={root}", t,
                         reduced(ins, op, dtype) if me == root else ins[gr])
                if op in ("sum", "max"):
                    shards = [data(dtype, (k * 6,), r, seed, op) for r in ranks]
                    out = torch.empty(6, dtype=dtype)
                    dist.reduce_scatter_tensor(out, shards[gr], op=REDUCE[op], group=group)
                    ck.check(f"{tag} reduce_scatter_tensor {dtype} {op}", out,
                             reduced(shards, op, dtype)[gr * 6:(gr + 1) * 6])
            seed += 1
            ins = [data(dtype, (4,), r, seed) for r in ranks]
            out = torch.empty(4 * k, dtype=dtype)
            dist.all_gather_into_tensor(out, ins[gr], group=group)
            ck.check(f"{tag} all_gather_into_tensor {dtype}", out, torch.cat(ins))
            outs = [torch.empty(4, dtype=dtype) for _ in ranks]
            dist.all_gather(outs, ins[gr], group=group)
            ck.check(f"{tag} all_gather {dtype}", torch.stack(outs), torch.stack(ins))
            root = ranks[seed % k]
            t = ins[gr].clone()
            dist.broadcast(t, root, group=group)
            ck.check(f"{tag} broadcast {dtype} src={root}", t, ins[ranks.index(root)])

        # uneven tensors: all_gather of per-rank sizes, reduce_scatter of per-rank chunks, all_to_all splits
        sizes = [2 * r + 1 for r in range(k)]
        ins = [torch.arange(sizes[i], dtype=torch.float32) + 100 * r for i, r in enumerate(ranks)]
        outs = [torch.empty(s) for s in sizes]
        dist.all_gather(outs, ins[gr], group=group)
        ck.check(f"{tag} uneven all_gather", torch.cat(outs), torch.cat(ins))
        chunks = [[torch.full((sizes[j],), float(10 * i + j)) for j in range(k)] for i in range(k)]
        out = torch.empty(sizes[gr])
        dist.reduce_scatter(out, chunks[gr], group=group)
        ck.check(f"{tag} uneven reduce_scatter", out, sum(chunks[i][gr] for i in range(k)))
        # all_to_all_single: rank i sends (i + j + 1) rows to rank j
        split = lambda i, j: i + j + 1  # noqa: E731
        send = torch.cat([torch.full((split(gr, j), 2), float(100 * gr + j)) for j in range(k)])
        recv = torch.empty(sum(split(i, gr) for i in range(k)), 2)
        dist.all_to_all_single(recv, send, [split(i, gr) for i in range(k)], [split(gr, j) for j in range(k)],
                               group=group)
        ck.check(f"{tag} uneven all_to_all_single", recv,
                 torch.cat([torch.full((split(i, gr), 2), float(100 * i + gr)) for i in range(k)]))
        outs = [torch.empty(3, dtype=torch.int64) for _ in ranks]
        dist.all_to_all(outs, [torch.full((3,), 10 * gr + j, dtype=torch.int64) for j in range(k)], group=group)
        ck.check(f"{tag} all_to_all", torch.stack(outs),
                 torch.stack([torch.full((3,), 10 * i + gr, dtype=torch.int64) for i in range(k)]))
        # gather / scatter at every root
        for root in ranks:
            ri = ranks.index(root)
            glist = [torch.empty(2, 3) for _ in ranks] if me == root else None
            dist.gather(torch.full((2, 3), float(gr)), glist, dst=root, group=group)
            if me == root:
                ck.check(f"{tag} gather dst={root}", torch.stack(glist),
                         torch.stack([torch.full((2, 3), float(i)) for i in range(k)]))
            out = torch.empty(5, dtype=torch.int32)
            slist = [torch.full((5,), 7 * ri + j, dtype=torch.int32) for j in range(k)] if me == root else None
            dist.scatter(out, slist, src=root, group=group)
            ck.check(f"{tag} scatter src={root}", out, torch.full((5,), 7 * ri + gr, dtype=torch.int32))
        # send/recv around the ring, and batch_isend_irecv both ways at once
        nxt, prv = ranks[(gr + 1) % k], ranks[(gr - 1) % k]
        if k > 1:
            s, r = torch.full((4,), float(me)), torch.empty(4)
            reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, s, nxt, group),
                                           dist.P2POp(dist.irecv, r, prv, group)])
            for w in reqs:
                w.wait()
            ck.check(f"{tag} batch_isend_irecv", r, torch.full((4,), float(prv)))
            if gr % 2 == 0:
                dist.send(torch.arange(3.0) + me, nxt, group=group)
                r = torch.empty(3)
                dist.recv(r, prv, group=group)
            else:
                r = torch.empty(3)
                dist.recv(r, prv, group=group)
                dist.send(torch.arange(3.0) + me, nxt, group=group)
            ck.check(f"{tag} send/recv", r, torch.arange(3.0) + prv)
        dist.barrier(group=group)

    # coalesced forms (what FSDP2 and DDP use), async handles and futures
    with dist.distributed_c10d._coalescing_manager(async_ops=True) as cm:
        outs = [torch.empty(2 * n), torch.empty(3 * n, dtype=torch.bfloat16)]
        dist.all_gather_into_tensor(outs[0], torch.full((2,), float(me)))
        dist.all_gather_into_tensor(outs[1], torch.full((3,), float(me), dtype=torch.bfloat16))
    cm.wait()
    ck.check("coalesced all_gather_into_tensor", outs[0], torch.arange(n).float().repeat_interleave(2))
    ck.check("coalesced all_gather_into_tensor bf16", outs[1], torch.arange(n).bfloat16().repeat_interleave(3))
    with dist.distributed_c10d._coalescing_manager(async_ops=True) as cm:
        out = torch.empty(2)
        dist.reduce_scatter_tensor(out, torch.arange(2.0 * n) * (me + 1))
    cm.wait()
    tri = n * (n + 1) / 2
    ck.check("coalesced reduce_scatter_tensor", out, torch.arange(2.0 * me, 2.0 * me + 2) * tri)
    ts = [torch.full((3,), float(me)), torch.full((2, 2), float(me + 1))]
    with dist.distributed_c10d._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    ck.check("coalesced all_reduce", ts[0], torch.full((3,), tri - n))
    ck.check("coalesced all_reduce (2, 2)", ts[1], torch.full((2, 2), tri))
    t = torch.full((1000,), float(me))
    work = dist.all_reduce(t, async_op=True)
    fut = work.get_future().then(lambda f: f.value()[0] * 2)
    ck.check("get_future().then", fut.wait(), torch.full((1000,), 2 * (tri - n)))
    ck.check("work.wait after the future", torch.tensor(work.wait()), torch.tensor(True))
    # a synchronous call's work (complete when returned) still carries the result to its future
    sync = dist.AllreduceOptions()
    sync.asyncOp = False
    t = torch.full((5,), float(me + 1))
    work = dist.distributed_c10d._get_default_group().allreduce([t], sync)
    ck.check("synchronous work is complete", torch.tensor([work.is_completed(), work.is_success()]),
             torch.tensor([True, True]))
    ck.check("synchronous work's future", work.get_future().then(lambda f: f.value()[0] + 1).wait(),
             torch.full((5,), tri + 1))
    x = torch.ones(3)
    dist.all_reduce(x, op=dist._make_nccl_premul_sum(0.5))
    ck.check("all_reduce PREMUL_SUM(0.5)", x, torch.full((3,), 0.5 * n))
    out = torch.empty(2)
    dist.reduce_scatter_tensor(out, torch.ones(2 * n), op=dist._make_nccl_premul_sum(0.25))
    ck.check("reduce_scatter_tensor PREMUL_SUM(0.25)", out, torch.full((2,), 0.25 * n))
    # the ProcessGroup API as C++ callers use it: list forms of complex tensors, default options
    pg = dist.distributed_c10d._get_default_group()
    zs = [torch.complex(torch.arange(3.0) + r, -torch.arange(3.0)) for r in range(n)]
    outs = [torch.empty(3, dtype=torch.complex64) for _ in range(n)]
    pg.allgather([outs], [zs[me]]).wait()
    ck.check("ProcessGroup.allgather complex", torch.stack(outs), torch.stack(zs))
    out = torch.empty(3, dtype=torch.complex64)
    pg.reduce_scatter([out], [[z * (me + 1) for z in zs]]).wait()
    ck.check("ProcessGroup.reduce_scatter complex", out, zs[me] * tri)
    # point-to-point inside a coalescing block, as batch_isend_irecv issues it for torch's own groups
    s, r = torch.full((2,), float(me)), torch.empty(2)
    with dist.distributed_c10d._coalescing_manager(pg, torch.device("cpu"), async_ops=True) as cm:
        dist.isend(s, (me + 1) % n)
        dist.irecv(r, (me - 1) % n)
    cm.wait()
    ck.check("isend/irecv coalesced", r, torch.full((2,), float((me - 1) % n)))
    # functional collectives (DTensor, torch.compile): torch keeps the work in C++ until wait_tensor;
    # a staged dtype (int8) needs the work's copy-back to run then
    for dtype in (torch.float32, torch.int8):
        y = torch.ops._c10d_functional.all_reduce(torch.full((1 << 16,), me + 1, dtype=dtype), "sum", pg.group_name)
        gc.collect()
        y = torch.ops._c10d_functional.wait_tensor(y)
        ck.check(f"_c10d_functional.all_reduce {dtype}", y, torch.full((1 << 16,), tri, dtype=dtype))
    # the pyzero group under a torch group, for pz.* calls
    x = torch.full((4,), float(me))
    pyzero.all_reduce(x, op="max", group=pyzero.distributed.pz_group(None))
    ck.check("pz.all_reduce on pz_group(default group)", x, torch.full((4,), float(n - 1)))
    dist.destroy_process_group()
    return ck.result()


def _rank_reinit():
    """Process groups made, destroyed and made again over one store (as a job that re-initialises)."""
    import os

    me, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.TCPStore("127.0.0.1", int(os.environ["MASTER_PORT"]), n, me == 0)
    got = []
    for config in ("cpu:pyzero,cuda:nccl", "pyzero", "pyzero"):
        dist.init_process_group(config, store=store, rank=me, world_size=n, timeout=TIMEOUT)
        x = torch.full((3,), float(me + 1))
        dist.all_reduce(x)
        dist.all_reduce(x, group=dist.new_group([0, 1]))
        got.append((dist.get_backend(), type(dist.distributed_c10d._get_default_group()).__name__, x.tolist()))
        dist.barrier()
        dist.destroy_process_group()
    return got


def test_device_map_and_reinit_on_one_store():
    """'cpu:pyzero,cuda:nccl' gives CPU tensors to pyzero (CUDA ones would go to NCCL, made on first use);
    groups made again over the same store get fresh shared memory."""
    for r in run_ranks(_rank_reinit, 2, timeout=60):
        assert r.value == [("cpu:pyzero,cuda:nccl", "ProcessGroupPyzero", [6.0] * 3),
                           ("pyzero", "ProcessGroupPyzero", [6.0] * 3), ("pyzero", "ProcessGroupPyzero", [6.0] * 3)]


def _rank_mesh_2d():
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415

    dist.init_process_group("pyzero", timeout=TIMEOUT)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    got = []
    for axis in ("dp", "tp"):
        g = mesh.get_group(axis)
        x = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(x, group=g)
        got.append((axis, dist.get_process_group_ranks(g), list(pyzero.distributed.pz_group(g).ranks), x.item()))
    dist.destroy_process_group()
    return got


def test_device_mesh_2d_groups():
    """Each mesh axis is its own pyzero group over the right global ranks."""
    for r in run_ranks(_rank_mesh_2d, 4, timeout=60):
        dp = [r.rank % 2, r.rank % 2 + 2]
        tp = [r.rank // 2 * 2, r.rank // 2 * 2 + 1]
        assert r.value == [("dp", dp, dp, float(sum(dp))), ("tp", tp, tp, float(sum(tp)))]


def _rank_pz_wrappers_on_a_torch_group():
    """pz.DataParallel and a pz.tp layer over pz_group(a torch subgroup), no pz.init(): the wrap-time
    broadcast named its source by pz.get_rank(), which needs pz.init()."""
    from torch import nn  # noqa: PLC0415

    dist.init_process_group("pyzero", timeout=TIMEOUT)
    me = dist.get_rank()
    sub = dist.new_group([1, 2])
    out = {}
    if me in (1, 2):
        g = pyzero.distributed.pz_group(sub)
        torch.manual_seed(me)  # different weights per rank: the group's first rank's (global 1) win
        model = pyzero.DataParallel(nn.Linear(3, 2), group=g)
        x = torch.arange(6.0).view(2, 3) + me
        model(x).square().sum().backward()
        out["weight"] = model.module.weight.detach().clone()
        out["grad"] = model.module.weight.grad.clone()
        torch.manual_seed(me)
        row = pyzero.tp.RowParallelLinear(4, 2, group=g)
        out["row_bias"] = row.bias.detach().clone()  # (replicated: group rank 0's)
    dist.barrier()
    dist.destroy_process_group()
    return out


def test_pz_wrappers_on_a_torch_group_without_pz_init():
    res = run_ranks(_rank_pz_wrappers_on_a_torch_group, 3, timeout=60)
    torch.manual_seed(1)  # (torch's new_group sorts the ranks: global rank 1 is the group's first)
    ref = torch.nn.Linear(3, 2)
    grads = []
    for me in (1, 2):
        m = torch.nn.Linear(3, 2)
        m.load_state_dict(ref.state_dict())
        (m(torch.arange(6.0).view(2, 3) + me)).square().sum().backward()
        grads.append(m.weight.grad)
    for r in res[1:]:
        torch.testing.assert_close(r.value["weight"], ref.weight.detach(), rtol=0, atol=0)
        torch.testing.assert_close(r.value["grad"], (grads[0] + grads[1]) / 2, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(res[1].value["row_bias"], res[2].value["row_bias"], rtol=0, atol=0)


@pytest.mark.parametrize("n", [2, 3])
def test_ops_match_torch_reference(n):
    assert_ok(run_ranks(_rank_ops, n, timeout=90), min_cases=100)


# ---------------------------------------------------------------------------
# Errors reach the caller, on every rank


def _rank_errors():
    dist.init_process_group("pyzero", timeout=datetime.timedelta(seconds=3))
    me = dist.get_rank()
    seen = []

    def expect(exc, words, fn):
        try:
            fn()
        except exc as e:
            missing = [w for w in words if w not in str(e)]
            seen.append(f"{type(e).__name__} missing {missing}: {e}" if missing else "ok")
        else:
            seen.append(f"no {exc.__name__} for {words}")

    spare = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=1))  # its own timeout
    t = torch.ones(4)
    expect(ValueError, ["allreduce", "BAND"], lambda: dist.all_reduce(t, op=dist.ReduceOp.BAND))
    expect(ValueError, ["AVG", "torch.int32"],
           lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG))
    expect(TypeError, ["float8", "dtype"], lambda: dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn)))
    expect(ValueError, ["meta", "cpu:pyzero,meta:"], lambda: dist.all_reduce(torch.ones(2, device="meta")))
    # (torch's own copy_() and is_contiguous() errors before; gloo sums sparse COO tensors, pyzero carries none)
    expect(TypeError, ["allreduce", "tensors[0]", "torch.sparse_coo", "dense"],
           lambda: dist.all_reduce(torch.sparse_coo_tensor([[me]], [1.0], (3,))))
    expect(TypeError, ["broadcast", "tensors[0]", "torch.sparse_csr", "dense"],
           lambda: dist.broadcast(torch.ones(2, 2).to_sparse_csr(), 0))
    expect(TypeError, ["send", "tensor", "torch.sparse_coo"],
           lambda: dist.send(torch.ones(2).to_sparse(), 1 - me))
    expect(ValueError, ["tag=5"], lambda: dist.send(t, 1 - me, tag=5))
    expect(ValueError, ["src=None"], lambda: dist.recv(t))
    expect(ValueError, ["all_to_all_single", "input_split_sizes"],
           lambda: dist.all_to_all_single(torch.empty(4), torch.empty(4), [2, 2], [1, 1]))
    # (torch's own IndexError and split errors before; gloo keeps each rank's own 0-dim value, and crashes on
    # a negative size)
    expect(ValueError, ["all_to_all_single", "output", "0-dimensional"],
           lambda: dist.all_to_all_single(torch.empty(()), torch.empty(())))
    expect(ValueError, ["all_to_all_single", "input_split_sizes=[3, -1]", "non-negative"],
           lambda: dist.all_to_all_single(torch.empty(2), torch.empty(2), [1, 1], [3, -1]))
    expect(ValueError, ["all_to_all_single", "output_split_sizes=[1.0, 1.0]", "non-negative"],
           lambda: dist.distributed_c10d._get_default_group().alltoall_base(torch.empty(2), torch.empty(2),
                                                                            [1.0, 1.0], [1, 1]))
    # ranks calling different collectives: both fail, naming what each called
    expect(pyzero.CollectiveError, ["mismatched", "all_reduce", "broadcast"],
           lambda: dist.all_reduce(t) if me == 1 else dist.broadcast(t, 0))
    # a collective one rank never joins: the other times out naming it (no hang)
    if me == 1:
        expect(pyzero.CollectiveTimeout, ["after 1 s", "rank 0", "never arrived"],
               lambda: dist.all_reduce(t, group=spare))
    else:
        time.sleep(1.5)
    return {"failures": [s for s in seen if s != "ok"], "cases": len(seen)}


def _rank_alone():
    """One rank: a synchronous all_reduce issues nothing (the result is the input), and everything
    else (other layouts and dtypes, async, PREMUL_SUM, refused arguments) is as at two ranks."""
    dist.init_process_group("pyzero", timeout=TIMEOUT)
    c = Checker()
    g = torch.Generator().manual_seed(7)
    for dtype in (torch.float32, torch.float16, torch.float64, torch.int64, torch.int32):
        for name, op in REDUCE.items():
            if name == "avg" and not dtype.is_floating_point:
                continue
            x = (torch.randn(5, 6, generator=g) * 4).to(dtype)
            whole = torch.stack([x])  # every rank's input: this one
            want = {"sum": whole.sum(0), "max": whole.amax(0), "min": whole.amin(0), "prod": whole.prod(0),
                    "avg": whole.mean(0) if dtype.is_floating_point else None}[name].to(dtype)
            t = x.clone()
            dist.all_reduce(t, op=op)
            c.check(f"all_reduce {name} {dtype}", t, want)
            cols = x.clone()
            dist.all_reduce(cols[:, ::2], op=op)  # a strided view: only its elements are the call's
            c.check(f"all_reduce {name} {dtype} of a strided view", cols, x)
    x = torch.randn(7, generator=g)
    t = x.clone()
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(2.5))
    c.check("all_reduce PREMUL_SUM(2.5)", t, x * 2.5)
    t = x.clone()
    work = dist.all_reduce(t, async_op=True)
    work.wait()
    c.check("async all_reduce", t, x)
    b = torch.tensor([True, False, True])
    dist.all_reduce(b)
    c.check("all_reduce of bools (carried as int32)", b, torch.tensor([True, False, True]))
    a, d = x.clone(), torch.arange(4)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(d)
    cm.wait()
    c.check("coalesced all_reduce (float)", a, x)
    c.check("coalesced all_reduce (int64)", d, torch.arange(4))
    for exc, words, fn in [
            (ValueError, ["AVG", "torch.int32"],
             lambda: dist.all_reduce(torch.ones(2, dtype=torch.int32), op=dist.ReduceOp.AVG)),
            (TypeError, ["float8", "dtype"], lambda: dist.all_reduce(torch.ones(2).to(torch.float8_e4m3fn))),
            (TypeError, ["allreduce", "tensors[0]", "torch.sparse_coo", "dense"],
             lambda: dist.all_reduce(torch.sparse_coo_tensor([[0]], [1.0], (3,)))),
            (ValueError, ["allreduce", "exactly one tensor"],
             lambda: dist.distributed_c10d._get_default_group().allreduce([torch.ones(2), torch.ones(2)]))]:
        c.cases += 1
        try:
            fn()
        except exc as e:
            missing = [w for w in words if w not in str(e)]
            if missing:
                c.failures.append(f"{exc.__name__} missing {missing}: {e}")
        else:
            c.failures.append(f"no {exc.__name__} for {words}")
    dist.destroy_process_group()
    return c.result()


def test_one_rank_all_reduce_is_the_input_and_refuses_what_two_ranks_refuse():
    assert_ok(run_ranks(_rank_alone, 1, timeout=60), min_cases=50)


def test_errors_name_the_op_and_argument():
    assert_ok(run_ranks(_rank_errors, 2, timeout=60), min_cases=8)


# ---------------------------------------------------------------------------
# torch's data-parallel stacks on "pyzero" equal the same on gloo


def _mlp(seed=0, unused=False):
    torch.manual_seed(seed)
    m = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 4))  # 24: TP at 2 and 3
    if unused:
        m.add_module("unused", torch.nn.Linear(4, 4))  # never called in forward: find_unused_parameters
    return m


def _batch(step, rank, rows=6):
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(rows, 8, generator=g), torch.randn(rows, 4, generator=g)


def _loss(model, step, rank, dtype=None):
    """The loss of rank `rank`'s batch of `step`, on the model's device (inputs cast to `dtype`)."""
    dev = next(model.parameters()).device
    x, y = (t.to(dev) for t in _batch(step, rank))
    return torch.nn.functional.mse_loss(model(x if dtype is None else x.to(dtype)).float(), y)


def _ddp(pg, steps=3, device="cpu", **kw):
    """Parameters after DDP training; kw: find_unused_parameters, static_graph, no_sync, hook, zero."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks  # noqa: PLC0415
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    no_sync, hook, zero = kw.pop("no_sync", False), kw.pop("hook", False), kw.pop("zero", False)
    model = DDP(_mlp(unused=kw.get("find_unused_parameters", False)).to(device), process_group=pg, **kw)
    if hook:
        model.register_comm_hook(pg, default_hooks.fp16_compress_hook)
    if zero:
        opt = ZeroRedundancyOptimizer(model.parameters(), torch.optim.Adam, process_group=pg, lr=0.01)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
    me = dist.get_rank()
    for step in range(steps):
        if no_sync:
            with model.no_sync():
                _loss(model, 100 + step, me).backward()
        _loss(model, step, me).backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _fsdp2(mesh, steps=2, device="cpu"):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: PLC0415

    model = _mlp().to(device)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=mp)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        _loss(model, step, dist.get_rank()).backward()
        opt.step()
        opt.zero_grad()
    return model, torch.cat([p.full_tensor().flatten() for p in model.parameters()])


def _tensor_parallel(mesh, device="cpu"):
    """Output and gradients of the MLP with Colwise/Rowwise parallel layers on `mesh` (None: the
    plain model, the reference)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module  # noqa: PLC0415

    model = _mlp().to(device)
    if mesh is not None:
        model = parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    x, y = (t.to(device) for t in _batch(0, 0))  # the same batch on every rank
    out = model(x)
    torch.nn.functional.mse_loss(out, y).backward()
    grads = [p.grad.full_tensor() if mesh is not None else p.grad for p in model.parameters()]
    return torch.cat([out.detach().flatten()] + [g.flatten() for g in grads])


def _rank_train(ckpt_dir):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    dist.init_process_group("pyzero", timeout=TIMEOUT)
    gloo = dist.new_group(backend="gloo")
    me = dist.get_rank()
    ck = Checker()
    for what, kw, tol in [("DDP", {}, 1e-6), ("DDP find_unused_parameters", {"find_unused_parameters": True}, 1e-6),
                          ("DDP static_graph", {"static_graph": True}, 1e-6),
                          ("DDP a bucket per parameter, gradients as bucket views",
                           {"bucket_cap_mb": 1e-4, "gradient_as_bucket_view": True}, 1e-6),
                          ("DDP no_sync", {"no_sync": True}, 1e-6), ("DDP fp16_compress_hook", {"hook": True}, 1e-3),
                          ("DDP ZeroRedundancyOptimizer", {"zero": True}, 1e-5)]:
        ck.close(what, _ddp(None, **kw), _ddp(gloo, **kw), tol)
    meshes = {"pyzero": init_device_mesh("cpu", (dist.get_world_size(),)),
              "gloo": DeviceMesh.from_group(gloo, "cpu")}
    fsdp = {b: _fsdp2(m) for b, m in meshes.items()}
    ck.close("FSDP2 MixedPrecisionPolicy(bf16 params, fp32 reduce)", fsdp["pyzero"][1], fsdp["gloo"][1], 1e-5)
    tp = _tensor_parallel(meshes["pyzero"])
    ck.close("DTensor Colwise/Rowwise", tp, _tensor_parallel(meshes["gloo"]), 1e-6)
    ck.close("DTensor Colwise/Rowwise against the plain model", tp, _tensor_parallel(None), 1e-5)
    for b, (model, _) in fsdp.items():  # sharded checkpoint, loaded at another world size by _rank_load
        dcp.save({"model": model.state_dict()}, checkpoint_id=f"{ckpt_dir}/{b}",
                 process_group=None if b == "pyzero" else gloo)
    if me == 0:
        torch.save(fsdp["pyzero"][1], f"{ckpt_dir}/full.pt")
    dist.destroy_process_group()
    return ck.result()


def _rank_load(ckpt_dir):
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    dist.init_process_group("pyzero", timeout=TIMEOUT)
    gloo = dist.new_group(backend="gloo")
    ck = Checker()
    want = torch.load(f"{ckpt_dir}/full.pt")
    meshes = {"pyzero": init_device_mesh("cpu", (dist.get_world_size(),)), "gloo": DeviceMesh.from_group(gloo, "cpu")}
    for b, mesh in meshes.items():
        model = _mlp(seed=1)  # other values: the load must replace them
        fully_shard(model, mesh=mesh)
        sd = {"model": model.state_dict()}
        dcp.load(sd, checkpoint_id=f"{ckpt_dir}/{b}", process_group=None if b == "pyzero" else gloo)
        model.load_state_dict(sd["model"])
        got = torch.cat([p.full_tensor().flatten() for p in model.parameters()])
        ck.close(f"DCP saved on {b}, loaded at {dist.get_world_size()} ranks", got, want, 1e-5)
    dist.destroy_process_group()
    return ck.result()


@pytest.mark.parametrize("n", [2, 3])
def test_torch_stacks_match_gloo(n, tmp_path):
    assert_ok(run_ranks(_rank_train, n, args=(str(tmp_path),), timeout=120), min_cases=8)
    assert_ok(run_ranks(_rank_load, 5 - n, args=(str(tmp_path),), timeout=120), min_cases=2)


# ---------------------------------------------------------------------------
# Benches: the torch-API runs work end to end (timings are recorded elsewhere)


def test_bench_runs_on_the_pyzero_backend(tmp_path, capsys):
    """pyzero-bench train's torch runs on "pyzero" train like gloo's DDP; collectives' torch-pyzero
    column is exact (#wrong 0) and gets the overhead table."""
    import argparse
    import json

    from pyzero.bench import collectives, train

    p = argparse.ArgumentParser()
    train.add_arguments(p)
    out = tmp_path / "train.json"
    args = p.parse_args(["--model", "gpt-nano", "--runs", "torch-ddp,torch-ddp-pyzero,fsdp2-pyzero", "--iters", "1",
                         "--warmup", "1", "--seq", "16", "--timeout", "120", "--json", str(out)])
    assert train.main(args) == 0
    res = {r["run"]: r for r in json.loads(out.read_text())["results"]}
    for run in ("torch-ddp-pyzero", "fsdp2-pyzero"):
        assert res[run]["loss"] == pytest.approx(res["torch-ddp"]["loss"], rel=1e-4), run
    p = argparse.ArgumentParser()
    collectives.add_arguments(p)
    args = p.parse_args(["--op", "all", "--nproc", "2", "--backends", "pyzero,torch-pyzero", "--min", "8",
                         "--max", "4K", "--factor", "512", "--iters", "2", "--warmup", "1", "--timeout", "120"])
    assert collectives.main(args) == 0
    text = capsys.readouterr().out
    assert "torch.distributed API on the 'pyzero' backend vs pz direct" in text
    assert text.count("Out of bounds values : 0 OK") == 8
    # the floor column: torch's API over its fake backend, measured in a fresh interpreter
    row = next(line.split() for line in text.splitlines() if line.split()[:2] == ["all_reduce", "8"])
    assert 0 < float(row[5]) < 1000 and float(row[6]) == pytest.approx(float(row[2]) + float(row[5]), abs=0.11)
    out = tmp_path / "sendrecv.json"  # point-to-point: each rank to the next, out of place
    args = p.parse_args(["--op", "sendrecv", "--nproc", "3", "--backends", "pyzero,torch-pyzero", "--min", "8",
                         "--max", "64K", "--factor", "8192", "--iters", "2", "--warmup", "1", "--timeout", "120",
                         "--json", str(out)])
    assert collectives.main(args) == 0
    text = capsys.readouterr().out
    assert text.count("# sendrecv, backend") == 2 and text.count("Out of bounds values : 0 OK") == 2, text
    rows = [r for r in json.loads(out.read_text())["results"] if r.get("op") == "sendrecv"]
    assert sorted((r["backend"], r["bytes"]) for r in rows) == [(b, s) for b in ("pyzero", "torch-pyzero")
                                                               for s in (8, 65536)]
    assert all(not r["inplace"] and r["wrong"] == 0 and r["busbw"] == r["algbw"] for r in rows), rows
    with pytest.raises(ValueError, match="--op sendrecv: needs --nproc 2 or more"):
        collectives.main(p.parse_args(["--op", "sendrecv", "--nproc", "1"]))
    out = tmp_path / "per_call.json"  # each call timed alone: the same exact results, labelled
    args = p.parse_args(["--op", "all_reduce", "--nproc", "2", "--backends", "pyzero", "--min", "8", "--max", "4K",
                         "--factor", "512", "--iters", "3", "--warmup", "1", "--timeout", "120", "--per-call",
                         "--json", str(out)])
    assert collectives.main(args) == 0
    assert "each call timed alone, median" in capsys.readouterr().out
    rows = [r for r in json.loads(out.read_text())["results"] if r.get("backend") == "pyzero"]
    assert len(rows) == 4 and all(r["timing"] == "per-call median" and r["wrong"] == 0 and r["time_us"] > 0
                                  for r in rows), rows
    out = tmp_path / "rounds.json"  # rounds alternating the forms and the backends: each one's median
    args = p.parse_args(["--op", "all_reduce", "--nproc", "2", "--backends", "pyzero,torch-pyzero", "--min", "8K",
                         "--max", "16K", "--iters", "2", "--warmup", "1", "--timeout", "120", "--rounds", "3",
                         "--json", str(out)])
    assert collectives.main(args) == 0
    text = capsys.readouterr().out
    assert text.count("median of 3 rounds alternating out-of-place and in-place, the backends in turn") == 2
    assert text.count("Out of bounds values : 0 OK") == 2
    rows = [r for r in json.loads(out.read_text())["results"] if r.get("backend") in ("pyzero", "torch-pyzero")]
    assert len(rows) == 8
    for r in rows:
        assert len(r["rounds_time_us"]) == 3 and r["wrong"] == 0
        assert r["time_us"] == sorted(r["rounds_time_us"])[1], r
    for size in (8192, 16384):  # round k: one backend's two forms, then the other's (the first one
        # alternating by round), then round k + 1
        start = {(r["backend"], r["inplace"]): r["rounds_start_s"] for r in rows if r["bytes"] == size}
        order = sorted((t, k, b, ip) for (b, ip), ts in start.items() for k, t in enumerate(ts))
        assert [(k, b, ip) for _, k, b, ip in order] == [
            (k, b, ip) for k in range(3) for b in ("pyzero", "torch-pyzero")[::1 if k % 2 == 0 else -1]
            for ip in (False, True)], order
    # the tables print once every size is measured, each backend's rows under its own heading
    lines = text.splitlines()
    head = [i for i, line in enumerate(lines) if line.startswith("# all_reduce, backend ")]
    assert [lines[i].split()[3] for i in head] == ["pyzero", "torch-pyzero"]
    assert [lines[i + 5].split()[0] for i in head] == ["8192", "8192"]
    assert [lines[i + 6].split()[0] for i in head] == ["16384", "16384"]
    with pytest.raises(ValueError, match="--rounds: expected a positive int, got 0"):
        collectives.main(p.parse_args(["--rounds", "0", "--nproc", "2"]))
    with pytest.raises(ValueError, match="--graph: CUDA graphs need --device cuda"):
        collectives.main(p.parse_args(["--graph", "10", "--nproc", "2"]))
    with pytest.raises(ValueError, match="--graph: expected a count of calls >= 0, got -1"):
        collectives.main(p.parse_args(["--graph", "-1", "--nproc", "2", "--device", "cuda"]))
    out = tmp_path / "pairs.json"  # fresh sets of ranks, each with its exchange probe and per-call percentiles,
    # auto beside its fixed choice (pyzero-fixed: a group with adaptive=False)
    args = p.parse_args(["--op", "all_reduce", "--nproc", "2", "--backends", "pyzero,pyzero-fixed", "--min", "8",
                         "--max", "64K",
                         "--factor", "8192", "--iters", "20", "--warmup", "1", "--timeout", "120", "--per-call",
                         "--rounds", "2", "--pairs", "2", "--json", str(out)])
    assert collectives.main(args) == 0
    text = capsys.readouterr().out
    assert text.count("# exchange probe: ") == 2 and text.count("per call (us; each the slowest rank's)") == 2
    rows = json.loads(out.read_text())["results"]
    probes = [r for r in rows if r["backend"] == "exchange-probe"]
    assert [r["pair"] for r in probes] == [0, 1]
    for r in probes:
        assert 0 < r["ns_per_line"] < 1000 and 0 < r["oneshot_64k_us"] < 1e5, r
        assert r["mode"] == ("slow" if r["oneshot_64k_us"] > 24.0 else "fast"), r
    timed = [r for r in rows if r["backend"] in ("pyzero", "pyzero-fixed")]
    assert sorted((r["backend"], r["pair"], r["bytes"], r["inplace"]) for r in timed) == [
        (be, k, b, ip) for be in ("pyzero", "pyzero-fixed") for k in (0, 1) for b in (8, 65536) for ip in (False, True)]
    for r in timed:  # the calls of both rounds pooled: at least 40 per form and rank
        assert r["wrong"] == 0 and 0 < r["p50_us"] <= r["p90_us"] <= r["p99_us"] <= r["max_us"], r
    assert "# all_reduce, backend pyzero-fixed (pyzero shm backend, algo auto, adaptive=False)" in text
    assert re.search(r"^# size order, per set of ranks and form: .*\n#   pyzero: \d+ / \d+", text, re.M), text
    summary = text[text.index("# every set of ranks"):].splitlines()[2:6]
    assert [line.split()[:6] for line in summary] == [
        [str(k), probes[k - 1]["mode"], f"{probes[k - 1]['ns_per_line']:.2f}", f"{probes[k - 1]['oneshot_64k_us']:.1f}",
         "all_reduce", str(b)] for k in (1, 2) for b in (8, 65536)]
    p50 = {(r["backend"], r["pair"], r["bytes"]): r["p50_us"] for r in timed if r["inplace"]}
    for line, (k, b) in zip(summary, [(k, b) for k in (0, 1) for b in (8, 65536)]):  # fx p50, fx x
        assert line.split()[8:] == [f"{p50[('pyzero-fixed', k, b)]:.1f}",
                                    f"{p50[('pyzero-fixed', k, b)] / p50[('pyzero', k, b)]:.2f}"], line
    out = tmp_path / "block.json"  # short rounds of a fixed number of calls, the backends interleaved
    args = p.parse_args(["--op", "all_reduce", "--nproc", "2", "--backends", "pyzero,torch-pyzero", "--min", "8",
                         "--max", "64K", "--factor", "8192", "--warmup", "1", "--timeout", "120", "--per-call",
                         "--rounds", "3", "--block", "7", "--json", str(out)])
    assert collectives.main(args) == 0
    assert capsys.readouterr().out.count("median of 3 rounds alternating out-of-place and in-place, 7 calls a round") == 2
    rows = [r for r in json.loads(out.read_text())["results"] if r.get("backend") in ("pyzero", "torch-pyzero")]
    assert len(rows) == 8 and all(r["calls"] == 3 * 7 and r["wrong"] == 0 for r in rows), rows
    start = {(r["bytes"], r["backend"], r["inplace"]): r["rounds_start_s"] for r in rows}
    order = sorted((t, k, size, b, ip) for (size, b, ip), ts in start.items() for k, t in enumerate(ts))
    assert [o[1:] for o in order] == [  # round k runs every size, each with the backends and forms in turn,
        # the sizes up on even rounds and down on odd ones
        (k, size, b, ip) for k in range(3) for size in (8, 65536)[::1 if k % 2 == 0 else -1]
        for b in ("pyzero", "torch-pyzero")[::1 if k % 2 == 0 else -1] for ip in (False, True)], order
    out = tmp_path / "least.json"  # --min-calls: the rounds' blocks grow to reach it
    args = p.parse_args(["--op", "all_reduce", "--nproc", "2", "--backends", "pyzero", "--min", "4M", "--max", "4M",
                         "--warmup", "1", "--timeout", "120", "--per-call", "--rounds", "2", "--block", "5",
                         "--min-calls", "13", "--json", str(out)])
    assert collectives.main(args) == 0
    rows = [r for r in json.loads(out.read_text())["results"] if r.get("backend") == "pyzero"]
    assert sorted((r["inplace"], r["calls"], r["wrong"]) for r in rows) == [(False, 14, 0), (True, 14, 0)], rows
    with pytest.raises(ValueError, match="--min-calls: expected a non-negative int, with --block; got 10"):
        collectives.main(p.parse_args(["--min-calls", "10", "--per-call", "--nproc", "2"]))
    with pytest.raises(ValueError, match="--block: expected a non-negative int, with --per-call; got 5"):
        collectives.main(p.parse_args(["--block", "5", "--nproc", "2"]))
    with pytest.raises(ValueError, match="--pairs: expected a positive int, got 0"):
        collectives.main(p.parse_args(["--pairs", "0", "--nproc", "2"]))
    with pytest.raises(ValueError, match=r"--backends: unknown backend 'pyzero-fixed'; expected .*\(cpu\) pyzero-fixed"):
        collectives.main(p.parse_args(["--backends", "pyzero-fixed", "--device", "cuda", "--nproc", "1"]))
    # torch.distributed on "pyzero" beside torch's NCCL on GPUs, and beside pyzero's ipc column
    assert collectives._backends(p.parse_args(["--backends", "torch,torch-pyzero", "--device", "cuda"])) == \
        ["torch", "torch-pyzero"]
    assert collectives._backends(p.parse_args(["--backends", "pyzero,torch-pyzero", "--device", "cuda",
                                               "--gpu-backend", "ipc"])) == ["pyzero", "torch-pyzero"]
    assert collectives._label("torch-pyzero", p.parse_args(["--device", "cuda"])) == \
        "torch.distributed on the 'pyzero' backend, its CUDA transport (nccl at one rank, ipc on one host)"
    with pytest.raises(ValueError, match=r"--gpu-backend ipc: only --backends pyzero and torch-pyzero \(the ranks may "):
        collectives.main(p.parse_args(["--backends", "pyzero,torch", "--device", "cuda", "--gpu-backend", "ipc",
                                       "--nproc", "2"]))
    with pytest.raises(ValueError, match="--pairs: needs --nproc"):
        collectives.main(p.parse_args(["--pairs", "2"]))


def test_bench_exchange_mode_keeps_only_sets_in_the_mode_asked_for(tmp_path, capsys, monkeypatch):
    """--exchange-mode fast|slow: a fresh set of ranks whose probe labels it in the other mode stops right
    after its probe and the next one starts, until --pairs sets in the mode ran the comparison or --tries
    sets started (then exit status 1). The label's bound is switched between the starts (forked ranks
    see the parent's module): odd starts slow, even ones fast."""
    import argparse
    import json

    from pyzero import launch
    from pyzero.bench import collectives

    starts, real = [], launch.run_ranks

    def counting(*a, **k):
        starts.append(1)
        monkeypatch.setattr(collectives, "SLOW_ONESHOT_US", 1e9 if len(starts) % 2 == 0 else 0.0)
        return real(*a, **k)

    monkeypatch.setattr(launch, "run_ranks", counting)
    p = argparse.ArgumentParser()
    collectives.add_arguments(p)
    base = ["--op", "all_reduce", "--nproc", "2", "--backends", "pyzero", "--min", "8", "--max", "8", "--iters", "5",
            "--warmup", "1", "--timeout", "60", "--per-call", "--pairs", "2", "--exchange-mode", "fast"]
    out = tmp_path / "fast.json"
    assert collectives.main(p.parse_args(base + ["--tries", "5", "--json", str(out)])) == 0
    text = capsys.readouterr().out
    assert len(starts) == 4, text  # slow, fast, slow, fast: two in the mode after four starts
    rows = json.loads(out.read_text())["results"]
    probes = [r for r in rows if r["backend"] == "exchange-probe"]
    assert [(r["pair"], r["mode"], r.get("skipped", False)) for r in probes] == [
        (0, "slow", True), (1, "fast", False), (2, "slow", True), (3, "fast", False)]
    timed = [r for r in rows if r["backend"] == "pyzero"]
    assert sorted((r["pair"], r["inplace"]) for r in timed) == [(k, ip) for k in (1, 3) for ip in (False, True)]
    assert all(r["wrong"] == 0 and r["calls"] >= 5 for r in timed), timed
    assert text.count("not the fast one asked for (--exchange-mode): it stops here") == 2, text
    assert "# ---- set of ranks 3 (fresh processes; 1 of 2 in the fast mode so far, at most 5 sets) ----" in text
    assert "# --exchange-mode fast: 2 of 2 sets of ranks in that mode ran the comparison, 2 others stopped after " \
           "their probe\n" in text
    summary = text[text.index("# every set of ranks"):].splitlines()[2:4]
    assert [line.split()[:2] for line in summary] == [["2", "fast"], ["4", "fast"]], summary
    starts.clear()  # too few starts for the sets asked for: what ran is kept, and the exit status says so
    out = tmp_path / "short.json"
    assert collectives.main(p.parse_args(base + ["--tries", "3", "--json", str(out)])) == 1
    assert len(starts) == 3
    assert "1 of 2 sets of ranks in that mode ran the comparison, 2 others stopped after their probe; 3 sets " \
           "tried, FEWER THAN ASKED FOR" in capsys.readouterr().out
    rows = json.loads(out.read_text())["results"]
    assert sorted({r["pair"] for r in rows if r["backend"] == "pyzero"}) == [1]
    with pytest.raises(ValueError, match="--tries: only with --exchange-mode fast or slow"):
        collectives.main(p.parse_args(["--tries", "3", "--nproc", "2"]))
    with pytest.raises(ValueError, match="--tries: expected at least --pairs \\(2\\) sets, got 1"):
        collectives.main(p.parse_args(["--exchange-mode", "slow", "--pairs", "2", "--tries", "1", "--nproc", "2"]))
    with pytest.raises(ValueError, match="--tries: expected a count of sets of ranks >= 0, got -1"):
        collectives.main(p.parse_args(["--exchange-mode", "slow", "--tries", "-1", "--nproc", "2"]))
    with pytest.raises(ValueError, match="--exchange-mode slow: needs --nproc"):
        collectives.main(p.parse_args(["--exchange-mode", "slow"]))
    with pytest.raises(ValueError, match="--exchange-mode fast: the exchange probe measures the CPU shm backend; "
                                         "needs --device cpu"):
        collectives.main(p.parse_args(["--exchange-mode", "fast", "--device", "cuda", "--nproc", "1"]))


@pytest.mark.parametrize("argv, flag", [
    (["collectives", "--nproc", "0"], "--nproc: expected >= 1, got 0"),  # (ran the whole sweep in-process)
    (["collectives", "--pairs", "0"], "--pairs: expected a positive int"),
    (["collectives", "--backends", "foo"], "--backends: unknown backend 'foo'"),
    (["collectives", "--min", "-5"], "--min '-5': expected a number"),
    (["collectives", "--max", "1x"], "--max '1x': expected a number"),
    (["collectives", "--factor", "nan"], "--factor: expected a number > 1, got nan"),
    (["collectives", "--iters", "0"], "--iters: expected >= 1, got 0"),
    (["collectives", "--timeout", "nan"], "--timeout: expected a positive finite number, got nan"),
    (["train", "--timeout", "-1"], "--timeout: expected a positive finite number, got -1.0"),
    (["train", "--bucket-mb", "-1"], "--bucket-mb: expected a positive finite number, got -1.0"),
    (["tp", "--nproc", "1"], "--nproc: expected >= 2"),
    (["tp", "--rows", "0"], "--rows: expected >= 1, got 0"),
    (["tp", "--iters", "0"], "--iters: expected >= 1, got 0"),
    (["tp", "--flush-mib", "-1"], "--flush-mib: expected a non-negative finite number, got -1.0"),
    (["pipeline", "--steps", "0"], "--steps: expected >= 1, got 0"),
    (["pipeline", "--layers", "1"], "--layers: expected >= --nproc=2"),
    (["pipeline", "--microbatches", "0,x"], "--microbatches: expected a comma list of ints"),
    (["pipeline", "--schedules", "bogus"], "--schedules: expected some of"),
    (["pipeline", "--mb-size", "0"], "--mb-size: expected >= 1, got 0"),
    (["ps", "--staleness", "-1"], "--staleness: expected >= 0, got -1"),
    (["ps", "--lr", "-1"], "--lr: expected a non-negative finite number, got -1.0"),
    (["moments", "--runs", "bogus"], "--runs: expected names from"),
    (["moments", "--steps", "0"], "--steps: expected >= 1, got 0"),
    (["moments", "--lr", "nan"], "--lr: expected a non-negative finite number, got nan"),
    (["moments", "--branch", "-1"], "--branch: expected >= 1, got -1"),
    (["optim", "--factor", "0.5"], "--factor: expected a number > 1, got 0.5"),
    (["optim", "--warmup", "-1"], "--warmup: expected >= 0, got -1"),
    (["optim", "--stream-mib", "0"], "--stream-mib: expected >= 1, got 0"),
    (["optim", "--threads", "x"], "--threads: expected a comma list of thread counts >= 1"),
    (["optim", "--sub-group", "x"], "--sub-group 'x': expected a number"),
    (["hier", "--iters", "0"], "--iters: expected >= 1, got 0"),
    (["hier", "--min", "0"], "--min/--max: expected 1 <= min <= max"),
    (["faults", "--window", "-1"], "--window: expected a non-negative finite number, got -1.0"),
    (["faults", "--rounds", "0"], "--rounds: expected >= 1, got 0"),
    (["faults", "--margin", "-1"], "--margin: expected a non-negative finite number, got -1.0"),
    (["capacity", "--device-gb", "-1"], "--device-gb: expected a positive finite number, got -1.0"),
    pytest.param(["collectives", "--device", "cuda", "--nproc", "2"], "--device cuda: no CUDA GPU visible",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA GPU is visible")),
    (["collectives", "--json", "/nonexistent/c.json"], "--json /nonexistent/c.json: no folder '/nonexistent'"),
    (["train", "--seq", "100000"], "--seq: expected 1..128 for --model gpt-tiny, got 100000"),
    (["ps", "--seq", "100000"], "--seq: expected 1..64 for --model gpt-nano, got 100000"),
    (["hier", "--seq", "100000"], "--seq: expected 1..128 for --model gpt-tiny, got 100000"),
    (["train", "--plot", "/nonexistent/t.png"], "--plot /nonexistent/t.png: no folder '/nonexistent'"),
    (["soak", "--seconds", "nan"], "--seconds: expected a positive finite number, got nan"),
    (["soak", "--nproc", "2", "0"], "--nproc: expected >= 1, got 0"),
])
def test_bench_bad_flag_values_are_usage_errors(argv, flag, capsys):
    """pyzero-bench exits 2 with its usage and the flag's error before anything runs, as argparse does for
    the values it checks itself (these were tracebacks: a ValueError, StatisticsError, ZeroDivisionError or a
    torch error from inside the ranks)."""
    from pyzero.bench import __main__ as bench

    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"pyzero-bench {argv[0]}: error: {flag}" in err, err


def test_bench_size_inversions_against_the_rounds_spread():
    """pyzero-bench's size-order check: a size whose per-call median is above the fastest larger size's
    (per set, backend and form) is an inversion, listed as beyond the rounds' spread only where it is over
    2% and the two sizes' round medians lie apart (quartiles by the inclusive method, as numpy's linear)."""
    import numpy as np

    from pyzero.bench.collectives import size_inversions

    def row(size, rounds, pair=0, inplace=True, backend="pyzero"):
        return {"op": "all_reduce", "backend": backend, "pair": pair, "inplace": inplace, "bytes": size,
                "timing": "per-call median", "rounds_time_us": rounds, "time_us": float(np.median(rounds))}

    rows = [row(8, [3.0, 3.1, 3.2, 3.3]), row(16, [2.0, 2.1, 2.2, 2.3]), row(32, [3.4, 3.5, 3.6, 3.7]),
            row(64, [2.15, 3.3, 3.5, 3.6]), row(128, [4.0] * 4),  # 64 B: the fastest above 32 B, spread wide
            row(8, [5.0] * 4, pair=1), row(16, [4.0] * 4, pair=1),  # another set: its own sizes
            row(8, [3.0] * 4, inplace=False), row(16, [2.95] * 4, inplace=False),  # 1.7% apart: within
            row(8, [9.0] * 4, backend="deepspeed"), row(16, [1.0] * 4, backend="torch", inplace=False),
            row(8, [4.0], pair=3), row(16, [2.0], pair=3),  # one round: no spread to be beyond
            {"op": "all_reduce", "backend": "pyzero", "bytes": 8, "inplace": True, "pair": 2, "time_us": 1.0,
             "timing": "loop mean"}]
    got = [v[:6] + (round(v[6], 9), round(v[7], 9), v[8]) for v in size_inversions(rows)]
    q = lambda v, k: float(np.percentile(v, 25 * k))  # noqa: E731
    apart_32_64 = q([3.4, 3.5, 3.6, 3.7], 1) > q([2.15, 3.3, 3.5, 3.6], 3)
    assert not apart_32_64
    assert got == [
        (0, "all_reduce", "pyzero", False, 8, 16, 3.0, 2.95, False),
        (0, "all_reduce", "pyzero", True, 8, 16, 3.15, 2.15, True),
        (0, "all_reduce", "pyzero", True, 32, 64, 3.55, 3.4, False),
        (1, "all_reduce", "pyzero", True, 8, 16, 5.0, 4.0, True),
        (3, "all_reduce", "pyzero", True, 8, 16, 4.0, 2.0, False)], got


def test_bench_fast_rounds_leave_out_a_round_either_ran_slow(capsys):
    """pyzero-bench's fast rounds: pyzero's round / pyzero-fixed's, over the rounds where neither ran over
    1.5x its own lower quartile in that set (numpy's linear percentile), pooled over the sets; the rounds
    one alone ran slow are counted for it, not in the ratios."""
    import numpy as np

    from pyzero.bench.collectives import fast_rounds, print_fast_rounds

    def row(backend, rounds, pair=0, inplace=True, timing="per-call median", size=1 << 20):
        return {"op": "all_reduce", "backend": backend, "pair": pair, "inplace": inplace, "bytes": size,
                "timing": timing, "rounds_time_us": rounds}

    a0, f0 = [10.0, 10.5, 11.0, 30.0, 10.0], [10.0, 10.0, 20.0, 10.0, 40.0]
    a1, f1 = [20.0, 22.0, 60.0, 21.0], [20.0, 20.0, 80.0, 20.0]
    for v in (a0, f0, a1, f1):  # the thresholds the rounds are judged by
        assert 1.5 * np.percentile(v, 25) in (15.0, 30.0, 31.125)
    rows = [row("pyzero", a0), row("pyzero-fixed", f0), row("pyzero", a1, pair=1), row("pyzero-fixed", f1, pair=1),
            row("deepspeed", [1.0, 1.0, 1.0, 1.0]),
            row("pyzero", [5.0, 5.0], inplace=False),  # no pyzero-fixed beside it: no line
            row("pyzero", [1.0, 1.0], size=8, timing="loop mean"), row("pyzero-fixed", [2.0, 2.0], size=8,
                                                                        timing="loop mean"),
            row("pyzero", [1.0], size=16), row("pyzero-fixed", [2.0], size=16)]  # one round: no quartile
    ratios = [10.0 / 10.0, 10.5 / 10.0, 20.0 / 20.0, 22.0 / 20.0, 21.0 / 20.0]
    got = fast_rounds(rows)
    assert len(got) == 1, got
    op, size, inplace, n, med, geo, worst, sa, sb, both = got[0]
    assert (op, size, inplace, n, sa, sb, both) == ("all_reduce", 1 << 20, True, 5, 1, 2, 1)
    assert med == pytest.approx(np.median(ratios)) and geo == pytest.approx(np.exp(np.mean(np.log(ratios))))
    assert worst[0] == 1 and worst[1] == pytest.approx(np.median(ratios[2:]))
    print_fast_rounds(rows)
    line = capsys.readouterr().out.splitlines()[2].split()
    assert line == ["all_reduce", str(1 << 20), "in", "place", "5", "1.050", f"{geo:.3f}", "2:", "1.050", "1", "2",
                    "1"], line


@pytest.mark.parametrize("q", [0.01, 0.5, 0.9, 0.99, 1.0])
def test_bench_percentiles_are_nearest_rank(q):
    """pyzero-bench's per-call percentiles against numpy's nearest-rank definition ('inverted_cdf')."""
    import numpy as np

    from pyzero.bench.collectives import nearest_rank

    for n in (1, 2, 7, 100, 101):
        values = list(np.random.default_rng(n).permutation(np.arange(n) * 1.5 + 3))
        assert nearest_rank(values, q) == np.percentile(values, 100 * q, method="inverted_cdf")


def test_bench_expected_results_from_the_closed_form():
    """The result pyzero-bench checks each call against (cached per size: every backend and form of a size
    checks against the same) is the sum over ranks of their inputs (a hash of element and rank, mod 5,
    minus 2), written out here with plain Python integers, and a later size does not get an earlier
    size's result."""
    from pyzero.bench.collectives import expected, pattern

    def inputs(count, r):
        out = []
        for i in range(count):
            h = (i * -1640531535 + r * 1013904223) & 0xFFFFFFFF  # int32 arithmetic, wrapping
            h = h - (1 << 32) if h >= 1 << 31 else h
            h ^= h >> 15
            h = (h * 739982445) & 0xFFFFFFFF
            h = h - (1 << 32) if h >= 1 << 31 else h
            h ^= h >> 13
            out.append(h % 5 - 2)
        return torch.tensor(out, dtype=torch.int64)

    # no period: a chunk of any length differs from the next (a period of 5 made all of a reduce_scatter's
    # chunks alike when their length was a multiple of 5, and a rank given another's passed the check)
    total = sum(pattern(3000, r, torch.int64) for r in range(3))
    for per in (5, 10, 15, 340, 1000):
        assert not torch.equal(total[:per], total[per:2 * per]), per
    assert set(pattern(1000, 0, torch.int64).tolist()) == {-2, -1, 0, 1, 2}

    for _ in range(2):  # the second pass from the cache where it holds the size
        for count, n, dtype in ((12, 2, torch.float32), (1000, 3, torch.bfloat16), (12, 2, torch.float16),
                                (7, 5, torch.float32)):
            want = torch.stack([inputs(count, r) for r in range(n)]).sum(0)
            assert torch.equal(expected("all_reduce", count, n, 1, 0, dtype), want.to(dtype))
            per = count // n
            assert torch.equal(expected("reduce_scatter", count, n, 1, 0, dtype), want[per:2 * per].to(dtype))
            assert torch.equal(expected("broadcast", count, n, 1, n - 1, dtype), inputs(count, n - 1).to(dtype))
            gathered = torch.cat([inputs(per, r) for r in range(n)])
            assert torch.equal(expected("all_gather", count, n, 1, 0, dtype), gathered.to(dtype))


def test_bench_checks_a_call_after_the_timed_ones_and_counts_as_nccl_tests(tmp_path, capsys, monkeypatch):
    """A collective right at its first call and wrong after it (an algorithm the auto choice switches to)
    counted 0 wrong: only the first call was checked; one more call after the timed ones is. The count
    column of all_gather and reduce_scatter is the per-rank count (nccl-tests' paramcount), and the
    average bus bandwidth averages both forms' rows, as nccl-tests'."""
    import argparse
    import json

    from pyzero import comm
    from pyzero.bench import collectives

    p = argparse.ArgumentParser()
    collectives.add_arguments(p)
    args = p.parse_args(["--op", "all", "--nproc", "3", "--backends", "pyzero", "--min", "1536", "--max", "1536",
                         "--iters", "2", "--warmup", "1", "--timeout", "120", "--json", str(tmp_path / "c.json")])
    assert collectives.main(args) == 0
    text = capsys.readouterr().out
    results = json.loads((tmp_path / "c.json").read_text())["results"]
    for op, count in (("all_reduce", 384), ("all_gather", 128), ("reduce_scatter", 128), ("broadcast", 384)):
        row = next(r for r in results if r.get("op") == op and r["backend"] == "pyzero" and not r["inplace"])
        assert row["count"] == count, op
        line = next(line.split() for line in text.splitlines() if line.split()[:1] == ["1536"]
                    and line.split()[1] == str(count))
        both = [r["busbw"] for r in results if r.get("op") == op and r["backend"] == "pyzero"]
        avg = float(text.split(f"# {op}, backend")[1].split("Avg bus bandwidth    :")[1].split()[0])
        assert avg == pytest.approx(sum(both) / 2, rel=1e-3), (op, line)
    orig_init = collectives.Runner.__init__

    def init(self, *a, **k):  # rank 1's result goes wrong from the second call on
        orig_init(self, *a, **k)
        call, made = self.call, [0]

        def wrapped():
            r = call()
            made[0] += 1
            if made[0] > 1 and comm.get_rank() == 1:
                self.result.view(-1)[0] += 1
            return r
        self.call = wrapped

    monkeypatch.setattr(collectives.Runner, "__init__", init)  # (the forked ranks take it)
    args = p.parse_args(["--op", "all_reduce", "--nproc", "2", "--backends", "pyzero", "--min", "64", "--max", "64",
                         "--iters", "2", "--warmup", "1", "--timeout", "120"])
    assert collectives.main(args) == 1
    assert "Out of bounds values : 2 FAILED" in capsys.readouterr().out  # one element, in each form


def test_bench_nothing_to_run_is_a_usage_error():
    import argparse

    from pyzero.bench import collectives

    p = argparse.ArgumentParser()
    collectives.add_arguments(p)
    for backends in (",", " "):
        with pytest.raises(ValueError, match="--backends: nothing to run"):
            collectives.main(p.parse_args(["--backends", backends, "--nproc", "2"]))


def test_premul_factor_without_the_factor_attribute():
    """PREMUL_SUM ops of torch before 2.13 have no `.factor`; their state's second item is the factor."""
    from pyzero.distributed import _premul_factor  # noqa: PLC0415

    class StateOnly:  # what pyzero reads of such an op
        def __getstate__(self):
            return (dist.ReduceOp.PREMUL_SUM, 0.25)

    assert _premul_factor(StateOnly()) == 0.25
    assert _premul_factor(dist._make_nccl_premul_sum(0.5)) == 0.5


def _rank_nested_futures_and_own_chunks():
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

    dist.init_process_group("pyzero", timeout=datetime.timedelta(seconds=20))
    r, out = dist.get_rank(), {}
    gloo = dist.new_group(backend="gloo")
    # a then() callback waiting on another collective's future (completed on the thread that runs the callback)
    t, u = torch.ones(4) * (r + 1), torch.ones(4)
    fut = dist.all_reduce(t, async_op=True).get_future()
    out["nested"] = fut.then(lambda f: dist.all_reduce(u, async_op=True).get_future().wait()[0] + f.value()[0]).wait()
    # DDP with PowerSGD (its hook waits on futures inside callbacks): as on gloo
    grads = {}
    for name, group in (("pyzero", None), ("gloo", gloo)):
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=group)
        state = powersgd.PowerSGDState(process_group=group, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                       use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, powersgd.powerSGD_hook)
        for step in range(4):
            x = torch.randn(8, 16, generator=torch.Generator().manual_seed(10 * step + r))
            ddp.zero_grad()
            ddp(x).square().mean().backward()
        grads[name] = [p.grad.clone() for p in model.parameters()]
    out["powersgd"] = grads
    # this rank's own chunk of gather/scatter/all_to_all: a different shape was broadcast into place
    errors = {}
    for name, call in (
            ("gather", lambda: dist.gather(torch.ones(3), [torch.empty(1 if q == r else 3) for q in range(2)], dst=r)),
            ("scatter", lambda: dist.scatter(torch.empty(1), [torch.ones(3), torch.ones(3)], src=r)),
            ("all_to_all", lambda: dist.all_to_all([torch.empty(3), torch.empty(3)], [torch.ones(1), torch.ones(1)])),
            ("all_to_all_single", lambda: dist.all_to_all_single(torch.empty(3), torch.ones(3), [2, 1], [1, 2]))):
        try:
            call()
            errors[name] = "nothing raised"
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    check = torch.ones(2)
    dist.all_reduce(check)  # nothing was issued before the refusals: the group still works
    out["after"] = check.tolist()
    return out


def test_nested_futures_powersgd_and_own_chunks():
    """A future's then() callback that waits on another collective's future hung forever (the completer
    thread that runs the callback was the only one to complete the inner work): DDP's PowerSGD hook does
    it, and now trains as on gloo. A rank's own chunk of gather (root), scatter (root), all_to_all and
    all_to_all_single of another shape was broadcast into place silently; refused before anything is
    issued, as gloo refuses it."""
    for res in run_ranks(_rank_nested_futures_and_own_chunks, 2, timeout=60):
        out = res.value
        assert out["nested"].tolist() == [5.0] * 4  # t summed over ranks (1 + 2) plus u summed (1 + 1)
        for a, b in zip(out["powersgd"]["pyzero"], out["powersgd"]["gloo"]):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        for name, msg in out["errors"].items():
            assert "own" in msg and ("shape" in msg or "split" in msg), (name, msg)
        assert out["after"] == [2.0, 2.0]
