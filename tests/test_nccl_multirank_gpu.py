"""The nccl backend at 2 and 4 ranks on ONE GPU, through the test NCCL library (scripts/gpu_check.sh's
nccl-multi part; skipped without a GPU or without PYZERO_TEST_NCCL_ROOT naming a built library).

The test library (csrc/test_nccl/, scripts/build_test_nccl.sh) is NCCL's C API over the ipc transport,
loaded through PYZERO_NCCL_ROOT in the spawned ranks, every rank on cuda:0. It keeps NCCL's pairing rule
(a send completes only once its receive is posted; the sends and receives of one group progress together),
so the rank bodies are the nccl and ipc GPU tests' own: the nccl backend's collective matrix (every
collective, dtype, op and algo, in place and out of place, against the torch reference), its streams and
send/recv pairs, the ipc tests' point-to-point rounds (batches, a ring over send/recv, a step captured in
a CUDA graph), algo="ring" and "native" with uneven counts (bitwise against the reference: the library
reduces in fp32 in rank order, as the ipc kernels do), DataParallel and ZeroOptimizer 1-3, the TP
overlapped matmuls and both pipeline schedules, each against one process. Then what NCCL's rules make
of wrong programs: an unpaired send, and two ranks that both send before they receive, end in
CollectiveTimeout from pyzero's watchdog, not a hang; a mismatched collective (NCCL would hang) is a
CollectiveError on every rank. World size 1 on the test library passes what it passes on NCCL.
"""
import os
import time
from pathlib import Path

import pytest
import torch

import pyzero as pz
import test_ipc_gpu as ipc_tests
import test_nccl_gpu as nccl_tests
from pyzero.launch import run_ranks

pytestmark = pytest.mark.gpu
ROOT = os.environ.get("PYZERO_TEST_NCCL_ROOT", "")
if not (ROOT and (Path(ROOT) / "lib" / "libnccl.so.2").is_file()):
    pytestmark = [pytestmark, pytest.mark.skip(reason="set PYZERO_TEST_NCCL_ROOT to a built test NCCL library "
                                                        "(scripts/build_test_nccl.sh)")]
ENV = {"CUDA_VISIBLE_DEVICES": "0", "PYZERO_NCCL_ROOT": ROOT}
NPROCS = [2, 4]


def ranks(fn, n, args=(), timeout=600, **kw):
    return run_ranks(fn, n, args=args, start="spawn", timeout=timeout, env=ENV, **kw)


def _rank_which_library():
    pz.init(backend="nccl", timeout=60)
    maps = sorted({line.split()[-1] for line in open("/proc/self/maps") if "libnccl" in line})
    t = torch.full((8,), float(pz.get_rank() + 1), device="cuda")
    pz.all_reduce(t)
    out = {"maps": maps, "device": torch.cuda.current_device(), "sum": t.cpu()}
    pz.destroy()
    return out


@pytest.mark.parametrize("nprocs", NPROCS)
def test_ranks_share_gpu0_through_the_test_library(nprocs):
    want = Path(ROOT, "lib", "libnccl.so.2").resolve()
    for r in ranks(_rank_which_library, nprocs, timeout=180):
        v = r.value
        assert any(Path(m).resolve() == want for m in v["maps"]), v["maps"]
        assert v["device"] == 0, v
        assert torch.equal(v["sum"], torch.full((8,), float(nprocs * (nprocs + 1) // 2))), v


@pytest.mark.parametrize("nprocs", NPROCS)
def test_collective_matrix(nprocs):
    for r in ranks(nccl_tests._rank_matrix, nprocs):
        nccl_tests.assert_ok(r.value, min_cases=500)


@pytest.mark.parametrize("nprocs", NPROCS)
def test_streams_and_send_recv_pairs(nprocs):
    res = ranks(nccl_tests._rank_streams_and_p2p, nprocs, timeout=300)
    failures = [f for r in res for f in r.value["failures"]]
    assert not failures, "\n".join(failures)


@pytest.mark.parametrize("nprocs", NPROCS)
def test_point_to_point_rounds(nprocs):
    ipc_tests.check_p2p(ranks(ipc_tests._rank_p2p, nprocs, args=("nccl", {"slice_bytes": ipc_tests.AREA})))


@pytest.mark.parametrize("nprocs", NPROCS)
def test_ring_and_native_with_uneven_counts(nprocs):
    cases = list(ipc_tests._cases(all_reduce_algos=("ring",), algo="ring")) + \
        list(ipc_tests._cases(all_reduce_algos=("native",), algo="native"))
    res = ranks(ipc_tests._rank_collectives, nprocs, args=(cases, {"slice_bytes": ipc_tests.AREA}, "nccl"))
    ipc_tests.check_collectives(res, cases)


@pytest.mark.parametrize("nprocs", NPROCS)
def test_data_parallel_and_zero_equal_one_process(nprocs):
    ipc_tests.check_layers(ranks(ipc_tests._rank_layers, nprocs, args=("nccl",), timeout=300))


@pytest.mark.parametrize("nprocs", NPROCS)
def test_tp_overlapped_ops_equal_one_process(nprocs):
    ipc_tests.check_tp(ranks(ipc_tests._rank_tp_overlap, nprocs, args=("nccl",), timeout=300))


@pytest.mark.parametrize("nprocs", NPROCS)
def test_pipeline_equals_one_process(nprocs):
    ipc_tests.check_pipeline(ranks(ipc_tests._rank_pipeline, nprocs, args=(2 * nprocs, "nccl"), timeout=300))


def _rank_subgroups():
    """Several communicators in one process: the world, and halves [0, 1] / [2, 3], interleaved."""
    pz.init(backend="nccl", timeout=60)
    me = pz.get_rank()
    halves = [pz.new_group([0, 1]), pz.new_group([2, 3])]
    mine = halves[me // 2]
    out = []
    for k in range(3):
        t = torch.full((1031,), float(me + k), device="cuda")
        pz.all_reduce(t, group=mine)
        w = torch.full((7,), float(me * k), device="cuda")
        pz.all_reduce(w)
        out.append((t[0].item(), w[0].item()))
    pz.destroy()
    return out


def test_several_communicators_per_process():
    for r in ranks(_rank_subgroups, 4, timeout=180):
        lo = 2 * (r.rank // 2)
        want = [(float(lo + k + lo + 1 + k), float(sum(q * k for q in range(4)))) for k in range(3)]
        assert r.value == want, (r.rank, r.value)


def _rank_unpaired(kind):
    """`unpaired`: rank 0 sends, rank 1 never receives. `both-send`: each rank sends to the other before it
    receives (outside a group), so each send waits for a receive queued behind the other's send."""
    pz.init(backend="nccl", timeout=3.0)
    me = pz.get_rank()
    t = torch.ones(1 << 16, device="cuda")
    pz.all_reduce(t)  # connected, warm
    torch.cuda.synchronize()
    start = time.monotonic()
    err = None
    try:
        if kind == "unpaired":
            if me == 0:
                pz.send(t, dst=1, async_op=True).synchronize()
            else:
                time.sleep(8)
                return {"skipped": True}
        else:
            other = 1 - me
            pz.send(t, dst=other)
            pz.recv(torch.empty_like(t), src=other)
            torch.cuda.synchronize()
            pz.barrier()
    except pz.CollectiveError as e:
        err = (type(e).__name__, str(e))
    return {"err": err, "seconds": time.monotonic() - start}


@pytest.mark.parametrize("kind", ["unpaired", "both-send"])
def test_ordering_rules_deadlock_into_a_timeout(kind):
    res = ranks(_rank_unpaired, 2, args=(kind,), timeout=120, check=False)
    for r in res[: 1 if kind == "unpaired" else 2]:
        v = r.value
        assert v is not None, r.output
        assert v["err"] is not None and v["err"][0] == "CollectiveTimeout", v
        assert "timed out after 3" in v["err"][1], v
        assert v["seconds"] < 30, v


def _rank_mismatch():
    """Rank 1 reduces float64 where rank 0 reduces float32: NCCL would hang; the library skips the call on
    both ranks and fails the communicator, which pyzero raises as CollectiveError at a following call."""
    pz.init(backend="nccl", timeout=30)
    me = pz.get_rank()
    pz.all_reduce(torch.ones(64, device="cuda"))
    x = torch.ones(64, device="cuda", dtype=torch.float64 if me == 1 else torch.float32)
    pz.all_reduce(x)
    errors = []
    for call in (pz.barrier, lambda: pz.all_reduce(torch.ones(4, device="cuda"), async_op=True).synchronize()):
        try:
            call()
        except pz.CollectiveError as e:
            errors.append(str(e))
    return errors


def test_mismatched_collective_is_an_error_on_every_rank():
    for r in ranks(_rank_mismatch, 2, timeout=120, check=False):
        assert r.value and any("differs from rank" in e for e in r.value), (r.rank, r.value, r.output)


# ---------------------------------------------------------------------------
# World size 1: the test library passes what NCCL passes


def test_world1_matrix_on_the_test_library_and_on_nccl():
    for env in (ENV, {"CUDA_VISIBLE_DEVICES": "0"}):  # the test library, then NCCL itself
        res = run_ranks(nccl_tests._rank_matrix, 1, start="spawn", timeout=600, env=env)
        nccl_tests.assert_ok(res[0].value, min_cases=500)


@pytest.mark.parametrize("blocking", [False, True])
def test_world1_watchdog_on_the_test_library(blocking):
    env = {**ENV, "PYZERO_NCCL_BLOCKING_WAIT": "1" if blocking else "0"}
    res = run_ranks(nccl_tests._rank_timeout, 1, args=(blocking,), start="spawn", timeout=120, env=env, check=False)
    v = res[0].value
    assert v is not None, res[0].output
    assert v["first"][0] == "CollectiveTimeout" and "timed out after 1" in v["first"][1], v
    assert v["seconds"] < 4.5, v
    assert v["again"][0] == "CollectiveTimeout" and "earlier failure" in v["again"][1], v


def test_torch_backend_on_nccl_through_the_test_library():
    """torch.distributed's "pyzero" backend with its CUDA calls on nccl (PYZERO_TORCH_CUDA=nccl): the
    test library takes two ranks on GPU 0, so every main call (point-to-point included) runs on the
    nccl transport and equals the same call on CPU tensors."""
    import test_torch_backend_gpu as torch_tests  # noqa: PLC0415

    res = run_ranks(torch_tests._rank_calls, 2, start="spawn", timeout=300, env={**ENV, "PYZERO_TORCH_CUDA": "nccl"})
    torch_tests.assert_ok(res, min_cases=200)
