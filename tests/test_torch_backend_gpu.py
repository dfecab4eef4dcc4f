"""The torch.distributed backend "pyzero" on CUDA tensors (scripts/gpu_check.sh; skipped without a GPU):
2 and 3 processes sharing GPU 0 (the ipc transport; MPS where the check starts it).

No torch backend runs this as a reference (gloo takes no CUDA tensors, NCCL refuses two ranks on one
GPU), so: every main call of tests/test_torch_conformance.py on CUDA tensors equals the same call on
CPU tensors of the same inputs on "pyzero" (checked against gloo by that test); DDP (its options) and
DTensor Colwise/Rowwise equal one process running the same steps on all ranks' batches; FSDP2 with
bf16 parameters equals one process doing its arithmetic (bf16 forward and backward, fp32 averaged
gradients) within tolerance; a DCP checkpoint of the FSDP2 model saved at n ranks loads at 5 - n.
"""
import datetime

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import pyzero  # noqa: F401  (registers the backend)
from pyzero.launch import run_ranks
from test_torch_backend import Checker, _ddp, _fsdp2, _loss, _mlp, _tensor_parallel, assert_ok
from test_torch_conformance import OPS, val

pytestmark = pytest.mark.gpu
ENV = {"CUDA_VISIBLE_DEVICES": "0"}
TIMEOUT = datetime.timedelta(seconds=60)
DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int16,
          torch.int32, torch.int64, torch.bool, torch.complex64]


def _ops_of(dtype):
    if dtype == torch.bool:
        return ["sum", "max", "band", "bor"]
    if dtype.is_complex:
        return ["sum", "avg"]
    ops = ["sum", "min", "max", "prod"]
    return ops + (["avg", "premul"] if dtype.is_floating_point else ["band", "bxor"])


def _calls(dev):
    """The main calls on tensors on `dev`, results on the CPU (the same inputs on every device)."""
    n, me = dist.get_world_size(), dist.get_rank()
    got = {}

    def v(dtype, shape, seed, op="sum", rank=me):
        return val(dtype, shape, seed, rank, op).to(dev)
    seed = 0
    for dtype in DTYPES:
        for op in _ops_of(dtype):
            seed += 1
            t = v(dtype, (3, 4), seed, op)
            dist.all_reduce(t, op=OPS[op])
            got[f"all_reduce {dtype} {op}"] = t
            t = v(dtype, (4, 6), seed, op).t()  # non-contiguous
            dist.all_reduce(t, op=OPS[op])
            got[f"all_reduce non-contiguous {dtype} {op}"] = t
            t = v(dtype, (5,), seed, op)
            dist.reduce(t, dst=seed % n, op=OPS[op])
            got[f"reduce {dtype} {op}"] = t if me == seed % n else None
            out = torch.zeros(3, dtype=dtype, device=dev)
            dist.reduce_scatter_tensor(out, v(dtype, (3 * n,), seed, op), op=OPS[op])
            got[f"reduce_scatter_tensor {dtype} {op}"] = out
        out = torch.zeros(2, dtype=dtype, device=dev)
        dist.reduce_scatter(out, list(v(dtype, (n, 2), seed).unbind()))
        got[f"reduce_scatter {dtype}"] = out
        ts = [v(dtype, (3,), seed), v(dtype, (2, 2), seed + 1)]
        dist.all_reduce_coalesced(ts)
        got[f"all_reduce_coalesced {dtype}"] = ts
        outs = [torch.zeros(2, 3, dtype=dtype, device=dev) for _ in range(n)]
        dist.all_gather(outs, v(dtype, (2, 3), seed))
        got[f"all_gather {dtype}"] = outs
        out = torch.zeros(3 * n, dtype=dtype, device=dev)
        dist.all_gather_into_tensor(out, v(dtype, (3,), seed))
        got[f"all_gather_into_tensor {dtype}"] = out
        ins = [v(dtype, (2,), seed), v(dtype, (3, 2), seed + 1)]
        outs = [[torch.zeros_like(t) for t in ins] for _ in range(n)]
        dist.all_gather_coalesced(outs, ins)
        got[f"all_gather_coalesced {dtype}"] = outs
        t = v(dtype, (5,), seed)
        dist.broadcast(t, src=seed % n)
        got[f"broadcast {dtype}"] = t
    # uneven, empty, stacked, large (several pieces of ipc's registered area)
    outs = [torch.zeros(r + 1, device=dev) for r in range(n)]
    dist.all_gather(outs, v(torch.float32, (me + 1,), 800))
    got["all_gather uneven"] = outs
    out = torch.zeros(me + 1, device=dev)
    dist.reduce_scatter(out, [v(torch.float32, (r + 1,), 10 + r) for r in range(n)])
    got["reduce_scatter uneven"] = out
    t = torch.zeros(0, device=dev)
    dist.all_reduce(t)
    got["all_reduce empty"] = t
    out = torch.zeros(n, 2, 3, dtype=torch.float16, device=dev)
    dist.all_gather_into_tensor(out, v(torch.float16, (2, 3), 804))
    got["all_gather_into_tensor stacked"] = out
    out = torch.zeros(2, 3, device=dev)
    dist.reduce_scatter_tensor(out, v(torch.float32, (n, 2, 3), 8))
    got["reduce_scatter_tensor stacked"] = out
    big = v(torch.float32, (9 << 20,), 900)  # 36 MiB
    dist.all_reduce(big)
    got["all_reduce 36 MiB"] = big
    # point-to-point (on CUDA: queued and issued together, see [Note: CUDA point-to-point is batched]):
    # a ring step in one batch where every rank sends first, pairs of send/recv, isend/irecv left
    # in flight across a collective, every dtype's bits, and the calls built on them
    nxt, prv = (me + 1) % n, (me - 1) % n
    ring = torch.zeros(5, device=dev)
    for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, v(torch.float32, (5,), 1700), nxt),
                                     dist.P2POp(dist.irecv, ring, prv)]):
        w.wait()
    got["batch_isend_irecv ring"] = ring
    for dtype in DTYPES:
        r = torch.zeros(7, dtype=dtype, device=dev)
        if me % 2 == 0 and me + 1 < n:
            dist.send(v(dtype, (7,), 1710), me + 1)
        elif me % 2 == 1:
            dist.recv(r, me - 1)
        got[f"send/recv {dtype}"] = r
    r = torch.zeros(4, 3, device=dev)
    ws = [dist.isend(v(torch.float32, (4, 3), 1720), nxt), dist.irecv(r, prv)]
    t = v(torch.float32, (6,), 1721)
    dist.all_reduce(t)  # (issues the queued pair first: calls keep their order)
    for w in ws:
        w.wait()
    got["isend/irecv across an all_reduce"] = [r, t]
    ins = [me + d + 1 for d in range(n)]
    outs = [s_ + me + 1 for s_ in range(n)]
    out = torch.zeros(sum(outs), device=dev)
    dist.all_to_all_single(out, v(torch.float32, (sum(ins),), 1730), outs, ins)
    got["all_to_all_single uneven splits"] = out
    outs_l = [torch.zeros(2, dtype=torch.int64, device=dev) for _ in range(n)]
    dist.all_to_all(outs_l, [v(torch.int64, (2,), 1740 + d) for d in range(n)])
    got["all_to_all"] = outs_l
    gl = [torch.zeros(3, device=dev) for _ in range(n)] if me == n - 1 else None
    dist.gather(v(torch.float32, (3,), 1750), gl, dst=n - 1)
    got["gather"] = gl
    sc = torch.zeros(3, dtype=torch.bfloat16, device=dev)
    dist.scatter(sc, [v(torch.bfloat16, (3,), 1760 + r_) for r_ in range(n)] if me == 0 else None, src=0)
    got["scatter"] = sc
    # async works, futures, coalescing, functional collectives, barrier
    t = v(torch.float32, (1000,), 1500)
    w = dist.all_reduce(t, async_op=True)
    w.wait()  # (on CUDA, as on NCCL: the current stream waits, the host does not)
    got["async all_reduce"] = t
    if dev != "cpu":
        torch.cuda.current_stream().synchronize()
    got["async all_reduce complete after wait() and the stream's work"] = w.is_completed()
    t = v(torch.int8, (1000,), 1501)  # staged: the copy-back runs where the future is completed
    fut = dist.all_reduce(t, async_op=True).get_future()
    got["get_future().then int8"] = fut.then(lambda f: f.value()[0] * 2).wait()
    outs = [torch.zeros(3, device=dev) for _ in range(n)]
    o = torch.zeros(2 * n, dtype=torch.int64, device=dev)
    ws = [dist.all_gather(outs, v(torch.float32, (3,), 1503), async_op=True),
          dist.all_gather_into_tensor(o, v(torch.int64, (2,), 1504), async_op=True)]
    for w in ws:
        w.wait()
    got["several async in flight"] = [outs, o]
    outs = [torch.zeros(2 * n, device=dev), torch.zeros(3 * n, dtype=torch.bfloat16, device=dev)]
    ts = [v(torch.float32, (3,), 1509), v(torch.float32, (2, 2), 1510)]
    with dist.distributed_c10d._coalescing_manager(async_ops=True) as cm:
        dist.all_gather_into_tensor(outs[0], v(torch.float32, (2,), 1511))
        dist.all_gather_into_tensor(outs[1], v(torch.bfloat16, (3,), 1512))
    cm.wait()
    with dist.distributed_c10d._coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    got["_coalescing_manager"] = [outs, ts]
    g = dist.group.WORLD
    got["functional"] = [funcol.wait_tensor(x) for x in (
        funcol.all_reduce(v(torch.float32, (4,), 1600), "sum", g),
        funcol.all_gather_tensor(v(torch.float32, (2, 3), 1601), 0, g),
        funcol.reduce_scatter_tensor(v(torch.float32, (2 * n,), 1602), "sum", 0, g),
        funcol.broadcast(v(torch.float32, (3,), 1604), n - 1, g),
        funcol.all_gather_tensor(v(torch.int8, (2,), 1607), 0, g))]
    dist.barrier()
    torch.cuda.synchronize() if dev != "cpu" else None
    return _cpu(got)


def _cpu(x):
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return [_cpu(y) for y in x]
    if isinstance(x, dict):
        return {k: _cpu(y) for k, y in x.items()}
    return x


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _rank_calls():
    dist.init_process_group("pyzero", timeout=TIMEOUT)
    me = dist.get_rank()
    cpu, cuda = _calls("cpu"), _calls("cuda")
    failures = [f"rank {me}: {k}: cuda {str(cuda[k])[:200]}; cpu {str(cpu[k])[:200]}" for k in cpu
                if not _same(cuda[k], cpu[k])]
    dist.barrier()
    dist.destroy_process_group()
    return {"failures": failures, "cases": len(cpu)}


@pytest.mark.parametrize("nprocs", [2, 3])
def test_cuda_calls_equal_cpu_calls(nprocs):
    assert_ok(run_ranks(_rank_calls, nprocs, start="spawn", timeout=300, env=ENV), min_cases=200)


# ---------------------------------------------------------------------------
# torch's stacks on CUDA against one process


def _one_process(steps=3, **kw):
    """What DDP computes, in one process: the mean of every rank's loss."""
    n = dist.get_world_size()
    model = _mlp(unused=kw.get("find_unused_parameters", False)).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01) if kw.get("zero") else torch.optim.SGD(model.parameters(),
                                                                                              lr=0.1)
    for step in range(steps):
        loss = sum(_loss(model, step, r) for r in range(n)) / n
        if kw.get("no_sync"):
            loss = loss + sum(_loss(model, 100 + step, r) for r in range(n)) / n
        loss.backward()
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _fsdp2_one_process(steps=2):
    """FSDP2's arithmetic in one process: bf16 forward and backward per rank, fp32 gradients averaged."""
    n = dist.get_world_size()
    model = _mlp().cuda()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for step in range(steps):
        grads = [torch.zeros_like(p) for p in model.parameters()]
        for r in range(n):
            low = _mlp().cuda().to(torch.bfloat16)
            low.load_state_dict({k: v.to(torch.bfloat16) for k, v in model.state_dict().items()})
            _loss(low, step, r, torch.bfloat16).backward()
            for g, p in zip(grads, low.parameters()):
                g.add_(p.grad.float())
        for p, g in zip(model.parameters(), grads):
            p.grad = g / n
        opt.step()
        opt.zero_grad()
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _rank_train(ckpt_dir):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    torch.cuda.set_device(0)
    dist.init_process_group("pyzero", timeout=TIMEOUT)
    ck = Checker()
    for what, kw, tol in [("DDP", {}, 1e-5), ("DDP find_unused_parameters", {"find_unused_parameters": True}, 1e-5),
                          ("DDP static_graph", {"static_graph": True}, 1e-5),
                          ("DDP a bucket per parameter, gradients as bucket views",
                           {"bucket_cap_mb": 1e-4, "gradient_as_bucket_view": True}, 1e-5),
                          ("DDP no_sync", {"no_sync": True}, 1e-5), ("DDP fp16_compress_hook", {"hook": True}, 1e-3),
                          ("DDP ZeroRedundancyOptimizer", {"zero": True}, 1e-5)]:
        ck.close(what, _ddp(None, device="cuda", **dict(kw)).cpu(), _one_process(**kw).cpu(), tol)
    mesh = init_device_mesh("cuda", (dist.get_world_size(),))
    model, got = _fsdp2(mesh, device="cuda")
    ck.close("FSDP2 MixedPrecisionPolicy(bf16 params, fp32 reduce)", got.cpu(), _fsdp2_one_process().cpu(), 1e-3)
    ck.close("DTensor Colwise/Rowwise", _tensor_parallel(mesh, "cuda").cpu(), _tensor_parallel(None, "cuda").cpu(),
             1e-5)
    dcp.save({"model": model.state_dict()}, checkpoint_id=f"{ckpt_dir}/cuda")
    if dist.get_rank() == 0:
        torch.save(got.cpu(), f"{ckpt_dir}/full.pt")
    torch.cuda.synchronize()
    dist.destroy_process_group()
    return ck.result()


def _rank_load(ckpt_dir):
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415
    import torch.distributed.checkpoint as dcp  # noqa: PLC0415

    torch.cuda.set_device(0)
    dist.init_process_group("pyzero", timeout=TIMEOUT)
    ck = Checker()
    model = _mlp(seed=1).cuda()  # other values: the load must replace them
    fully_shard(model, mesh=init_device_mesh("cuda", (dist.get_world_size(),)))
    sd = {"model": model.state_dict()}
    dcp.load(sd, checkpoint_id=f"{ckpt_dir}/cuda")
    model.load_state_dict(sd["model"])
    got = torch.cat([p.full_tensor().flatten() for p in model.parameters()]).cpu()
    ck.close(f"DCP saved on CUDA, loaded at {dist.get_world_size()} ranks", got, torch.load(f"{ckpt_dir}/full.pt"),
             1e-6)
    dist.destroy_process_group()
    return ck.result()


@pytest.mark.parametrize("nprocs", [2, 3])
def test_torch_stacks_on_cuda_equal_one_process(nprocs, tmp_path):
    assert_ok(run_ranks(_rank_train, nprocs, args=(str(tmp_path),), start="spawn", timeout=300, env=ENV),
              min_cases=9)
    assert_ok(run_ranks(_rank_load, 5 - nprocs, args=(str(tmp_path),), start="spawn", timeout=300, env=ENV),
              min_cases=1)
