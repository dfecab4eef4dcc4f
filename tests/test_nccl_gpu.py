"""The nccl backend on real GPUs (run by scripts/gpu_check.sh; skipped without a GPU).

World size 1 runs in the pytest process (init, test, destroy). World size
torch.cuda.device_count() (> 1) runs through run_ranks(start="spawn"): each
rank is a fresh interpreter, because the pytest process has initialised CUDA
(conftest, the kernel tests) and CUDA cannot be used in a child forked after
that. The watchdog tests also run in spawned processes: aborting a
communicator with kernels still queued may poison that process's CUDA context.

Inputs are exact (see reference_data.make_input): pyzero's ring and one-shot
accumulate fp16/bf16 in fp32 and round once, so they must match the reference
bitwise. NCCL's native collectives accumulate in the storage type and compute
avg by pre-multiplying, so they get integer-valued inputs (exact in every
dtype) and a tolerance for avg.
"""
import contextlib
import os
import time

import pytest
import torch

import pyzero as pz
from pyzero import comm as pzcomm
from pyzero.launch import run_ranks
from reference_data import make_input, reference

pytestmark = pytest.mark.gpu

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
DTYPES = FLOATS + [torch.int32, torch.int64]
OPS = ["sum", "avg", "max", "min", "prod"]
NGPU = torch.cuda.device_count()
ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
MAX_FAILURES = 20


def rank_device():
    """This rank's GPU, as the nccl backend chose it (cuda:LOCAL_RANK; cuda:0 for every rank of the test
    NCCL library, tests/test_nccl_multirank_gpu.py)."""
    return torch.device("cuda", torch.cuda.current_device())


def ops_for(dtype):
    return OPS if dtype.is_floating_point else [o for o in OPS if o != "avg"]


def native_input(op, dtype, size, rank, seed):
    """Integer-valued inputs, exact in every dtype under NCCL's storage-type accumulation."""
    g = torch.Generator().manual_seed(seed * 7919 + rank * 104729 + 23)
    vals = torch.tensor([1, 2, -1], dtype=torch.int64) if op == "prod" else torch.arange(-8, 9)
    return vals[torch.randint(0, len(vals), (size,), generator=g)].to(dtype)


def inputs_for(algo, op, dtype, size, n, seed):
    make = native_input if algo in ("native", "auto") else make_input
    return [make(op, dtype, size, r, seed) for r in range(n)]


class Checker:
    def __init__(self):
        self.failures, self.cases = [], 0

    def check(self, what, got, want, tol=None):
        self.cases += 1
        got = got.cpu()
        ok = torch.allclose(got.double(), want.double(), **tol) if tol else torch.equal(got, want)
        if not ok and len(self.failures) < MAX_FAILURES:
            bad = (got != want).nonzero().flatten()
            i = int(bad[0]) if bad.numel() else 0
            self.failures.append(f"rank {pz.get_rank()}: {what}: {bad.numel()} of {got.numel()} differ; first [{i}]: "
                                 f"got {got[i].item()!r}, want {want[i].item()!r}")

    def result(self):
        return {"failures": self.failures, "cases": self.cases}


def tolerance(algo, op, dtype):
    if algo in ("native", "auto") and op == "avg":
        return {"rtol": {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-6}.get(dtype, 1e-12),
                "atol": 0}
    return None


def algos_for(coll, nbytes):
    algos = ["auto", "native", "ring"]
    if coll == "all_reduce" and nbytes <= 256 << 10:
        algos.append("oneshot")
    return algos


# ---------------------------------------------------------------------------
# The collective matrix, run by every rank (world 1 in-process, world N spawned)


def collective_matrix(sizes):
    n, me = pz.get_world_size(), pz.get_rank()
    dev = rank_device()
    ck = Checker()
    seed = 0
    for dtype in DTYPES:
        es = torch.empty(0, dtype=dtype).element_size()
        for size in sizes:
            for op in ops_for(dtype):
                for algo in algos_for("all_reduce", size * es):
                    seed += 1
                    ins = inputs_for(algo, op, dtype, size, n, seed)
                    want = reference(ins, op, dtype)
                    t = ins[me].clone().to(dev)
                    pz.all_reduce(t, op=op, algo=algo)
                    ck.check(f"all_reduce({dtype}, {op}, size={size}, algo={algo})", t, want,
                             tolerance(algo, op, dtype))
            for op in ["sum", "max"] + (["avg"] if dtype.is_floating_point else []):
                for algo in algos_for("reduce_scatter", size * es):
                    for in_place in (False, True):
                        seed += 1
                        counts = [size // n + (r < size % n) for r in range(n)]
                        off = sum(counts[:me])
                        ins = inputs_for(algo, op, dtype, size, n, seed)
                        inp = ins[me].clone().to(dev)
                        out = (inp[off:off + counts[me]] if in_place
                               else torch.empty(counts[me], dtype=dtype, device=dev))
                        want = reference(ins, op, dtype)[off:off + counts[me]]
                        pz.reduce_scatter(out, inp, op=op, counts=counts, algo=algo)
                        ck.check(f"reduce_scatter({dtype}, {op}, counts={counts}, in_place={in_place}, algo={algo})",
                                 out, want, tolerance(algo, op, dtype))
            for algo in algos_for("all_gather", size * es):
                for in_place in (False, True):
                    seed += 1
                    counts = [size // n + (r < size % n) for r in range(n)]
                    off = sum(counts[:me])
                    ins = [make_input("sum", dtype, counts[r], r, seed) for r in range(n)]
                    out = torch.full((size,), -7, dtype=dtype, device=dev)
                    if in_place:
                        out[off:off + counts[me]] = ins[me].to(dev)
                        inp = out[off:off + counts[me]]
                    else:
                        inp = ins[me].clone().to(dev)
                    pz.all_gather(out, inp, counts=counts, algo=algo)
                    ck.check(f"all_gather({dtype}, counts={counts}, in_place={in_place}, algo={algo})", out,
                             torch.cat(ins))
            for algo in algos_for("broadcast", size * es):
                for root in range(n):
                    seed += 1
                    src = make_input("sum", dtype, size, root, seed)
                    t = (src.clone() if me == root else torch.full((size,), -7, dtype=dtype)).to(dev)
                    pz.broadcast(t, src=root, algo=algo)
                    ck.check(f"broadcast({dtype}, size={size}, root={root}, algo={algo})", t, src)
    # uneven counts with empty chunks, and a ring of several rounds (4 MiB slices)
    for algo in [a for a in algos_for("reduce_scatter", 0) if a != "auto"]:
        counts = [0] * n
        counts[-1] = 1000
        seed += 1
        ins = inputs_for(algo, "sum", torch.float32, 1000, n, seed)
        want = reference(ins, "sum", torch.float32)[sum(counts[:me]):sum(counts[:me + 1])]
        out = torch.empty(counts[me], device=dev)
        pz.reduce_scatter(out, ins[me].to(dev), counts=counts, algo=algo)
        ck.check(f"reduce_scatter(counts={counts}, algo={algo})", out, want)
        big = (3 << 20) + 5
        for dtype in (torch.float32, torch.bfloat16):
            seed += 1
            ins = inputs_for(algo, "sum", dtype, big, n, seed)
            want = reference(ins, "sum", dtype)
            t = ins[me].clone().to(dev)
            pz.all_reduce(t, algo=algo)
            ck.check(f"all_reduce({dtype}, size={big}, algo={algo})", t, want)
    # every rank holds bitwise the same one-shot and ring result
    for algo in ["ring", "oneshot"]:
        t = make_input("sum", torch.bfloat16, 4099, me, 999).to(dev)
        pz.all_reduce(t, algo=algo)
        gathered = torch.empty(n * 4099, dtype=torch.bfloat16, device=dev)
        pz.all_gather(gathered, t)
        for r in range(n):
            ck.check(f"{algo} result of rank {r} equals this rank's", gathered[r * 4099:(r + 1) * 4099], t.cpu())
    stats = pz.comm_stats()
    if stats["all_reduce"]["calls"] == 0:
        ck.failures.append("comm_stats counted no all_reduce")
    return ck.result()


@contextlib.contextmanager
def nccl_world(monkeypatch, timeout=60.0):
    for k in ENV:
        monkeypatch.delenv(k, raising=False)
    pz.init(backend="nccl", timeout=timeout)
    try:
        yield
    finally:
        pz.destroy()


def assert_ok(result, min_cases):
    assert not result["failures"], "\n".join(result["failures"])
    assert result["cases"] >= min_cases, result["cases"]


def test_world1_collective_matrix(monkeypatch):
    with nccl_world(monkeypatch):
        assert pz.get_backend() == "nccl"
        assert "nccl" in pz.build_info()["backends"]
        assert_ok(collective_matrix([0, 1, 5, 4099, 65537]), min_cases=500)


def test_world1_errors(monkeypatch):
    with nccl_world(monkeypatch):
        with pytest.raises(ValueError, match="tensor: the nccl backend takes CUDA tensors"):
            pz.all_reduce(torch.ones(3))
        if NGPU > 1:
            with pytest.raises(ValueError, match="cuda:1, but this rank's GPU is cuda:0"):
                pz.all_reduce(torch.ones(3, device="cuda:1"))
        with pytest.raises(ValueError, match="oneshot"):
            pz.reduce_scatter(torch.empty(4, device="cuda"), torch.empty(4, device="cuda"), algo="oneshot")
        with pytest.raises(ValueError, match="at most"):
            pz.all_reduce(torch.empty(1 << 20, device="cuda"), algo="oneshot")
        x = torch.ones(8, device="cuda")
        pz.all_reduce(x)  # the group is still usable after rejected arguments
        assert torch.equal(x.cpu(), torch.ones(8))


# ---------------------------------------------------------------------------
# Streams: async_op runs after the current stream's work; wait() orders the
# current stream after it, with no host synchronisation in between


def _stream_ordering(n_elems=1 << 20):
    dev = rank_device()
    n = pz.get_world_size()
    comm_stream = torch.cuda.ExternalStream(pzcomm.resolve_group(None).backend.comm.stream, device=dev)
    failures = []
    for algo in ["native", "ring"]:
        inp = torch.zeros(n_elems, device=dev)
        out = torch.zeros(n * n_elems, device=dev)
        torch.cuda._sleep(100_000_000)  # the fill below runs ~50 ms from now
        inp.fill_(3.0)
        with torch.cuda.stream(comm_stream):
            torch.cuda._sleep(100_000_000)  # and the collective, after this, later still
        t0 = time.perf_counter()
        work = pz.all_gather(out, inp, async_op=True, algo=algo)
        issued_s = time.perf_counter() - t0
        if work.is_completed():  # the call must not wait for the ~50 ms of work queued before it
            failures.append(f"{algo}: the async all_gather was complete right after the call, which took "
                            f"{issued_s * 1e3:.1f} ms on the host (the queued sleeps take ~50 ms or more)")
        work.wait()
        y = out * 2  # on the current stream: must see the gathered values
        got = y.cpu()  # synchronises the current stream only
        if not torch.equal(got, torch.full((n * n_elems,), 6.0)):
            failures.append(f"{algo}: the current stream saw {got[:4].tolist()}... after wait()")
        assert work.is_completed()
        # a synchronous call is ordered on the current stream, after work queued there
        t = torch.zeros(n_elems, device=dev)
        torch.cuda._sleep(50_000_000)
        t.fill_(1.0)
        pz.all_reduce(t, algo=algo)
        if not torch.equal(t.cpu(), torch.full((n_elems,), float(n))):
            failures.append(f"{algo}: synchronous all_reduce did not follow the current stream")
        # work.synchronize() blocks the host
        t2 = torch.ones(n_elems, device=dev)
        w2 = pz.all_reduce(t2, async_op=True, algo=algo)
        w2.synchronize()
        if not w2.is_completed():
            failures.append(f"{algo}: synchronize() returned before the work completed")
    return failures


def test_world1_stream_ordering(monkeypatch):
    with nccl_world(monkeypatch):
        assert _stream_ordering() == []


def test_buffers_take_the_current_stream_from_torchs_raw_query():
    """A CUDA build of torch has the raw current-stream query the buffers use, and it names the stream
    torch.cuda.current_stream does: the default one, and a side stream made current."""
    from pyzero.backends import cuda_buffers

    assert cuda_buffers._RAW_STREAM is not None
    dev = torch.cuda.current_device()
    assert cuda_buffers.current_raw_stream(dev) == torch.cuda.current_stream(dev).cuda_stream
    side = torch.cuda.Stream(dev)
    with torch.cuda.stream(side):
        assert cuda_buffers.current_raw_stream(dev) == side.cuda_stream != 0
        b = cuda_buffers.as_buffer(torch.ones(4, device=f"cuda:{dev}"), "t", dev)
        assert b.stream == side.cuda_stream


# ---------------------------------------------------------------------------
# CUDA graphs: calls captured with torch.cuda.graph and replayed


def test_world1_calls_captured_in_a_cuda_graph(monkeypatch):
    """all_gather (native and ring) and an async all_reduce captured in one graph, replayed with
    fresh inputs and eager calls between replays, equal the eager results; host waits inside the
    capture raise a clear error and leave the capture usable."""
    with nccl_world(monkeypatch):
        dev = rank_device()
        own = torch.zeros(4099, device=dev)
        gathered = {algo: torch.zeros(4099, device=dev) for algo in ("native", "ring")}
        acc = torch.zeros(65537, dtype=torch.bfloat16, device=dev)
        side = torch.zeros(5, device=dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # warm-up, as torch.cuda.graph asks
            for algo, out in gathered.items():
                pz.all_gather(out, own, algo=algo)
            # an eager async call: its work is polled inside the capture (the flight recorder's summary of
            # the refused barrier below), which must not invalidate the capture
            pz.all_reduce(acc, op="avg", async_op=True).wait()
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        errors = []
        with torch.cuda.graph(g):
            for algo, out in gathered.items():
                pz.all_gather(out, own, algo=algo)
            w = pz.all_reduce(acc, op="avg", async_op=True)
            w.wait()
            for call in (pz.barrier, w.synchronize, w.is_completed):
                try:
                    call()
                except pz.CollectiveError as e:
                    errors.append(str(e))
        assert len(errors) == 3, errors
        assert "a synchronous barrier waits on the host" in errors[0], errors
        assert all("captured into a CUDA graph" in e for e in errors[1:]), errors
        for i in range(3):
            want = make_input("sum", torch.float32, 4099, 0, 10 + i)
            own.copy_(want.to(dev))
            acc_in = make_input("avg", torch.bfloat16, 65537, 0, 20 + i)
            acc.copy_(acc_in.to(dev))
            g.replay()
            side.fill_(float(i))
            pz.all_reduce(side)  # eager, between replays
            for algo, out in gathered.items():
                assert torch.equal(out.cpu(), want), f"replay {i} {algo}"
            assert torch.equal(acc.cpu(), acc_in), f"replay {i}: avg of one rank"
            assert torch.equal(side.cpu(), torch.full((5,), float(i)))
        pz.barrier()  # eager host waits work again after the capture


# ---------------------------------------------------------------------------
# cupy arrays through __cuda_array_interface__


def test_world1_cupy_interop(monkeypatch):
    cupy = pytest.importorskip("cupy")
    with nccl_world(monkeypatch):
        s = cupy.cuda.Stream(non_blocking=True)
        with s:
            a = cupy.arange(1000, dtype=cupy.float32)
            pz.all_reduce(a, op="sum")  # ordered on the array's stream (the interface names it)
            out = cupy.zeros(1000, dtype=cupy.float32)
            work = pz.all_gather(out, a, async_op=True, algo="ring")
            work.wait()  # cupy's current stream (s) waits
            b = out * 2
        s.synchronize()
        assert cupy.array_equal(b, cupy.arange(1000, dtype=cupy.float32) * 2)
        # mixed with torch, and the dtypes cupy has
        for dt in (cupy.float16, cupy.float64, cupy.int32, cupy.int64):
            x = cupy.ones(7, dtype=dt)
            pz.broadcast(x, src=0)
            assert cupy.array_equal(x, cupy.ones(7, dtype=dt))
        t = torch.zeros(1000, device="cuda")
        pz.all_gather(t, cupy.ones(1000, dtype=cupy.float32))
        assert torch.equal(t.cpu(), torch.ones(1000))
        with pytest.raises(ValueError, match="C-contiguous"):
            pz.all_reduce(cupy.ones((4, 4), dtype=cupy.float32)[:, ::2])


# ---------------------------------------------------------------------------
# Watchdog: an operation that cannot finish in time aborts the communicator


def _rank_timeout(blocking):
    """A collective stuck behind a 5 s kernel with timeout=1 s: the watchdog aborts; the caller hears of it.
    The 1 s applies after a first collective: NCCL's cold set-up may take longer than that."""
    pz.init(backend="nccl", timeout=60.0)
    t = torch.ones(16, device="cuda")
    pz.all_reduce(t)
    torch.cuda.synchronize()
    pz.comm.resolve_group(None).backend.comm.set_timeout(1.0)
    torch.cuda._sleep(10_000_000_000)  # several seconds on the current stream
    start = time.monotonic()
    try:
        if blocking:
            pz.all_reduce(t)  # PYZERO_NCCL_BLOCKING_WAIT=1: the call itself raises
        else:
            work = pz.all_reduce(t, async_op=True)
            time.sleep(2.0)
            work.wait()
        first = ("ok", None)
    except pz.CollectiveError as e:
        first = (type(e).__name__, str(e))
    seconds = time.monotonic() - start
    try:
        pz.all_reduce(t)
        again = ("ok", None)
    except pz.CollectiveError as e:
        again = (type(e).__name__, str(e))
    return {"first": first, "again": again, "seconds": seconds}


@pytest.mark.parametrize("blocking", [False, True])
def test_watchdog_times_out_and_aborts(blocking):
    env = {"PYZERO_NCCL_BLOCKING_WAIT": "1" if blocking else "0", "CUDA_VISIBLE_DEVICES": "0"}
    res = run_ranks(_rank_timeout, 1, args=(blocking,), start="spawn", timeout=120, env=env, check=False)
    v = res[0].value
    assert v is not None, res[0].output
    etype, msg = v["first"]
    assert etype == "CollectiveTimeout", v
    assert "timed out after 1" in msg and "all_reduce" in msg and "rank 0 of 1" in msg and "seq" in msg, msg
    assert v["seconds"] < 4.5, v
    assert v["again"][0] == "CollectiveTimeout" and "earlier failure" in v["again"][1], v


# ---------------------------------------------------------------------------
# World size = every GPU of the machine, ranks spawned


def _rank_matrix():
    pz.init(backend="nccl", timeout=120)
    return collective_matrix([0, 1, 5, 4099, 65537])


def _rank_streams_and_p2p():
    pz.init(backend="nccl", timeout=120)
    n, me = pz.get_world_size(), pz.get_rank()
    dev = rank_device()
    failures = _stream_ordering()
    # point to point between pairs (even ranks send first: a send waits for its receive)
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        peer = me + 1 if me % 2 == 0 else me - 1
        if peer >= n:
            continue
        mine = torch.arange(1000, dtype=torch.int64).to(dtype) + me
        got = torch.empty(1000, dtype=dtype, device=dev)
        if me % 2 == 0:
            pz.send(mine.to(dev), dst=peer)
            pz.recv(got, src=peer)
        else:
            pz.recv(got, src=peer)
            pz.send(mine.to(dev), dst=peer)
        if not torch.equal(got.cpu(), torch.arange(1000, dtype=torch.int64).to(dtype) + peer):
            failures.append(f"rank {me}: recv from {peer} ({dtype}) got the wrong data")
    # async collectives overlapping each other, waited out of order
    ts = [torch.full((4099,), float(me + k), device=dev) for k in range(4)]
    works = [pz.all_reduce(t, async_op=True, algo=("ring" if k % 2 else "native")) for k, t in enumerate(ts)]
    for w in reversed(works):
        w.wait()
    for k, t in enumerate(ts):
        want = float(sum(r + k for r in range(n)))
        if not torch.equal(t.cpu(), torch.full((4099,), want)):
            failures.append(f"rank {me}: async all_reduce {k} wrong")
    pz.barrier()
    return {"failures": failures, "cases": 1}


def _rank_missing():
    """Rank 1 never calls the all_reduce: rank 0 times out (blocking wait), rank 1 leaves."""
    pz.init(backend="nccl", timeout=3.0)
    t = torch.ones(16, device=rank_device())
    pz.all_reduce(t)  # everyone: connects the ring
    if pz.get_rank() == 1:
        return {"skipped": True}
    start = time.monotonic()
    try:
        pz.all_reduce(t)
        first = ("ok", None)
    except pz.CollectiveError as e:
        first = (type(e).__name__, str(e))
    return {"first": first, "seconds": time.monotonic() - start}


needs_gpus = pytest.mark.skipif(NGPU < 2, reason="needs 2 or more GPUs")


@needs_gpus
def test_world_n_collective_matrix():
    results = run_ranks(_rank_matrix, NGPU, start="spawn", timeout=600)
    for r in results:
        assert_ok(r.value, min_cases=500)


@needs_gpus
def test_world_n_streams_and_p2p():
    results = run_ranks(_rank_streams_and_p2p, NGPU, start="spawn", timeout=300)
    failures = [f for r in results for f in r.value["failures"]]
    assert not failures, "\n".join(failures)


@needs_gpus
def test_world_n_missing_rank_times_out():
    res = run_ranks(_rank_missing, 2, start="spawn", timeout=120, env={"PYZERO_NCCL_BLOCKING_WAIT": "1"},
                    check=False)
    v = res[0].value
    assert v is not None, res[0].output
    assert v["first"][0] == "CollectiveTimeout", v
    assert "timed out after 3" in v["first"][1] and "rank 0 of 2" in v["first"][1], v
    assert v["seconds"] < 10, v
    assert os.environ.get("PYZERO_NCCL_BLOCKING_WAIT") is None  # env= only reached the ranks
