"""Host-side logic of the CUDA backends, tested without a GPU.

* The NCCL ring's schedule: pyzero._C.p2p_ring_plan records what each rank
  would issue (grouped send/recv, copy/pack/reduce kernels); a simulator here
  runs every rank's plan under strict rendezvous (a send completes only when
  the receiver's current group posts the matching receive), moving bytes and
  doing the kernels' math with torch. It checks the results against an
  independent reference, that no schedule deadlocks, that message sizes agree,
  that a group never reads what it writes, and the bytes on the wire.
* The nccl backend's algorithm choice, device checks, __cuda_array_interface__
  parsing, and comm.py's GPU dispatch with a fake communicator.
* The CUDA kernels' bodies (csrc/reduce_kernels.cuh), run on the CPU by
  tests/cuda_kernels_on_cpu.cpp against the CPU loops.
* Backend availability errors and build_info.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import pyzero as pz
from pyzero import _C
from pyzero import comm as pzcomm
from pyzero.backend import Buffer, check_algo
from pyzero.backends import cuda_buffers as pzcuda
from pyzero.backends.nccl import NcclBackend, nccl_device
from pyzero.launch import run_ranks
from reference_data import make_input, reference, wire

CODES = {getattr(torch, name): code for name, code in _C.DTYPES.items()}
COLL = {k: _C.COLLS[k] for k in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")}  # the ring ones
OPS = dict(_C.OPS)
ALGO = dict(_C.ALGOS)
GROUP, COPY, PACK, REDUCE, REDUCE_FINAL = range(5)
OUT, IN, SEND_STAGE, RECV_STAGE = range(4)
HAS_CUDA_BUILD = _C.build_info()["cuda"]


# ---------------------------------------------------------------------------
# Reference data and math


def combine(op, a, b):
    if op in ("sum", "avg"):
        return a + b
    if op == "prod":
        return a * b
    return torch.maximum(a, b) if op == "max" else torch.minimum(a, b)


# ---------------------------------------------------------------------------
# The simulator


class Deadlock(AssertionError):
    pass


class Sim:
    """Every rank's memory (regions of bytes) and plan; run() executes them together."""

    def __init__(self, plans, regions, dtype, op, n):
        self.plans, self.mem, self.T, self.W, self.op, self.n = plans, regions, dtype, wire(dtype), op, n
        self.sent = [0] * n

    def view(self, r, region, offset, count, dtype):
        es = torch.empty(0, dtype=dtype).element_size()
        buf = self.mem[r][region]
        assert 0 <= offset and offset + count * es <= buf.numel(), f"rank {r}: region {region} overrun"
        return buf[offset:offset + count * es].view(dtype)

    def kernel(self, r, o):
        T, W = self.T, self.W
        if o[0] in (COPY, PACK):
            src = self.view(r, o[1], o[2], o[5], T)
            dst = self.view(r, o[3], o[4], o[5], T if o[0] == COPY else W)
            dst.copy_(src.to(dst.dtype))
            return
        m = o[7]
        v = combine(self.op, self.view(r, o[1], o[2], m, W), self.view(r, o[3], o[4], m, T).to(W))
        if o[0] == REDUCE:
            self.view(r, o[5], o[6], m, W).copy_(v)
        else:
            if self.op == "avg":
                v = v / self.n
            self.view(r, o[5], o[6], m, T).copy_(v.to(T))

    def run(self):
        n, plans = self.n, self.plans
        pc, done = [0] * n, [set() for _ in range(n)]
        for p in plans:
            for o in p:
                if o[0] == GROUP:
                    assert o[1] >= 0 or o[4] >= 0, f"empty group {o}"
                    assert (o[1] < 0 or o[3] > 0) and (o[4] < 0 or o[6] > 0), f"zero-byte message {o}"
        while True:
            progress = False
            for r in range(n):
                while pc[r] < len(plans[r]) and plans[r][pc[r]][0] != GROUP:
                    self.kernel(r, plans[r][pc[r]])
                    pc[r] += 1
                    progress = True
            for r in range(n):  # rendezvous of r's send with (r+1)'s receive, both at the head
                nxt = (r + 1) % n
                if pc[r] == len(plans[r]) or pc[nxt] == len(plans[nxt]):
                    continue
                s, d = plans[r][pc[r]], plans[nxt][pc[nxt]]
                if s[1] >= 0 and "send" not in done[r] and d[4] >= 0 and "recv" not in done[nxt]:
                    assert s[3] == d[6], f"rank {r} sends {s[3]} bytes, rank {nxt} expects {d[6]}"
                    # A group may receive into what it sends from (an all-reduce's own contribution,
                    # then the final value of the same chunk) only if the send has already been
                    # consumed: then the data received is causally after it. Otherwise: a race.
                    if d[1] == d[4] and "send" not in done[nxt] and d[2] < d[5] + d[6] and d[5] < d[2] + d[3]:
                        raise AssertionError(f"rank {nxt}: group {d} receives into memory it has not sent yet")
                    self.mem[nxt][d[4]][d[5]:d[5] + d[6]] = self.mem[r][s[1]][s[2]:s[2] + s[3]]
                    self.sent[r] += s[3]
                    done[r].add("send")
                    done[nxt].add("recv")
                    progress = True
            for r in range(n):
                if pc[r] < len(plans[r]):
                    o = plans[r][pc[r]]
                    need = ({"send"} if o[1] >= 0 else set()) | ({"recv"} if o[4] >= 0 else set())
                    if need <= done[r]:
                        pc[r] += 1
                        done[r] = set()
                        progress = True
            if all(pc[r] == len(plans[r]) for r in range(n)):
                return
            if not progress:
                raise Deadlock(f"deadlock: ranks stopped at ops {pc} of {[len(p) for p in plans]}: "
                               f"{[plans[r][pc[r]] if pc[r] < len(plans[r]) else None for r in range(n)]}")


def as_bytes(t, size=None):
    b = t.contiguous().view(torch.uint8).clone() if t.numel() else torch.empty(0, dtype=torch.uint8)
    if size is not None and b.numel() < size:
        b = torch.cat([b, torch.full((size - b.numel(),), 0xAB, dtype=torch.uint8)])
    return b


def simulate(coll, dtype, op, n, counts, stage_bytes, seed, root=0, in_place=False):
    """Run the plans of `coll` on n simulated ranks; returns (outputs, expected outputs, bytes sent per rank)."""
    es = torch.empty(0, dtype=dtype).element_size()
    L = [0]
    for c in counts:
        L.append(L[-1] + c)
    total = L[-1]
    inputs = [make_input(op, dtype, counts[r] if coll == "all_gather" else total, r, seed) for r in range(n)]
    garbage = torch.full((stage_bytes,), 0xAB, dtype=torch.uint8)
    regions, expected = [], []
    for r in range(n):
        if coll == "all_reduce":
            out, inp = as_bytes(inputs[r]), torch.empty(0, dtype=torch.uint8)
            expected.append(reference(inputs, op, dtype))
        elif coll == "reduce_scatter":
            out, inp = as_bytes(torch.full((counts[r],), -3, dtype=dtype)), as_bytes(inputs[r])
            expected.append(reference(inputs, op, dtype)[L[r]:L[r + 1]])
        elif coll == "all_gather":
            full = torch.full((total,), -3, dtype=dtype)
            if in_place:
                full[L[r]:L[r + 1]] = inputs[r]
            out, inp = as_bytes(full), (torch.empty(0, dtype=torch.uint8) if in_place else as_bytes(inputs[r]))
            expected.append(torch.cat(inputs))
        else:
            out = as_bytes(inputs[r] if r == root else torch.full((total,), -3, dtype=dtype))
            inp = torch.empty(0, dtype=torch.uint8)
            expected.append(inputs[root])
        regions.append({OUT: out, IN: inp, SEND_STAGE: garbage.clone(), RECV_STAGE: garbage.clone()})
    plan_counts = [total] if coll in ("all_reduce", "broadcast") else counts
    plans = [_C.p2p_ring_plan(COLL[coll], plan_counts, r, n, CODES[dtype], root, stage_bytes, in_place)
             for r in range(n)]
    sim = Sim(plans, regions, dtype, op, n)
    sim.run()
    outs = [regions[r][OUT].view(dtype) if regions[r][OUT].numel() else torch.empty(0, dtype=dtype)
            for r in range(n)]
    assert all(o.numel() * es == regions[r][OUT].numel() for r, o in enumerate(outs))
    return outs, expected, sim.sent


def check_equal(outs, expected, what):
    for r, (got, want) in enumerate(zip(outs, expected)):
        assert got.dtype == want.dtype and got.shape == want.shape, f"{what}, rank {r}: {got.shape} vs {want.shape}"
        if not torch.equal(got, want):
            bad = (got != want).nonzero().flatten()
            i = int(bad[0])
            raise AssertionError(f"{what}, rank {r}: {bad.numel()} of {got.numel()} differ; first [{i}]: "
                                 f"got {got[i].item()!r}, want {want[i].item()!r}")


DTYPES = list(CODES)


def ops_for(dtype):
    return ["sum", "avg", "max", "min", "prod"] if dtype.is_floating_point else ["sum", "max", "min", "prod"]


# ---------------------------------------------------------------------------
# Ring schedule tests


@pytest.mark.parametrize("n", [2, 3, 4, 5])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ring_all_reduce_plan(n, dtype):
    seed = 0
    for op in ops_for(dtype):
        for count in [0, 1, n - 1, 37, 1000]:
            for stage_bytes in [64, 4096]:
                seed += 1
                outs, expected, sent = simulate("all_reduce", dtype, op, n, [count], stage_bytes, seed)
                what = f"all_reduce(n={n}, {dtype}, {op}, count={count}, stage={stage_bytes})"
                check_equal(outs, expected, what)
                # each chunk travels n-1 hops as a wire-typed partial and n-1 hops finished
                es, ws = (torch.empty(0, dtype=d).element_size() for d in (dtype, wire(dtype)))
                assert sum(sent) == (n - 1) * count * (es + ws), what


@pytest.mark.parametrize("n", [2, 3, 4])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_ring_reduce_scatter_plan(n, dtype):
    seed = 100
    layouts = [[5] * n, [0] * n, [1] + [0] * (n - 1), [0] * (n - 1) + [70], list(range(3, 3 + 17 * n, 17)),
               [0, 200] + [3] * (n - 2)]
    for op in ops_for(dtype):
        for counts in layouts:
            seed += 1
            outs, expected, sent = simulate("reduce_scatter", dtype, op, n, counts, 64, seed)
            what = f"reduce_scatter(n={n}, {dtype}, {op}, counts={counts})"
            check_equal(outs, expected, what)
            ws = torch.empty(0, dtype=wire(dtype)).element_size()
            assert sum(sent) == (n - 1) * sum(counts) * ws, what


@pytest.mark.parametrize("n", [2, 3, 5])
@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64], ids=str)
def test_ring_all_gather_plan(n, in_place, dtype):
    seed = 200
    for counts in [[4] * n, [0] * n, [0] * (n - 1) + [33], [1, 0] + [70] * (n - 2), list(range(1, n + 1))]:
        for stage_bytes in [64, 1024]:
            seed += 1
            outs, expected, sent = simulate("all_gather", dtype, "sum", n, counts, stage_bytes, seed,
                                            in_place=in_place)
            what = f"all_gather(n={n}, in_place={in_place}, {dtype}, counts={counts}, stage={stage_bytes})"
            check_equal(outs, expected, what)
            es = torch.empty(0, dtype=dtype).element_size()
            assert sum(sent) == (n - 1) * sum(counts) * es, what


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_broadcast_plan(n):
    seed = 300
    for root in range(n):
        for dtype in [torch.float16, torch.float64, torch.int32]:
            for count in [0, 1, 100, 1001]:
                seed += 1
                outs, expected, sent = simulate("broadcast", dtype, "sum", n, [count], 64, seed, root=root)
                what = f"broadcast(n={n}, root={root}, {dtype}, count={count})"
                check_equal(outs, expected, what)
                assert sum(sent) == (n - 1) * count * torch.empty(0, dtype=dtype).element_size(), what


def test_ring_plan_pairs_each_send_with_the_next_receive():
    """One message per primitive per round: every group of an all_reduce holds a send and a receive."""
    plan = _C.p2p_ring_plan(COLL["all_reduce"], [4 * 1000], 1, 4, CODES[torch.float32], 0, 256)
    groups = [o for o in plan if o[0] == GROUP]
    assert len(groups) == 16 * 2 * 3  # 16 rounds of 64 elements, 2(n-1) steps each
    assert all(g[1] >= 0 and g[4] >= 0 for g in groups), "a send or a receive was issued alone"
    assert max(g[3] for g in groups) <= 256 and max(g[6] for g in groups) <= 256  # staging bounds each message


def test_simulator_detects_unpaired_sends():
    """The deadlock check is real: every rank sending alone first (no pairing) deadlocks under rendezvous."""
    n = 3
    plans = [[[GROUP, OUT, 0, 4, -1, 0, 0], [GROUP, -1, 0, 0, IN, 0, 4]] for _ in range(n)]
    regions = [{OUT: torch.zeros(4, dtype=torch.uint8), IN: torch.zeros(4, dtype=torch.uint8)} for _ in range(n)]
    with pytest.raises(Deadlock):
        Sim(plans, regions, torch.float32, "sum", n).run()


def test_ring_plan_rejects_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        _C.p2p_ring_plan(COLL["all_reduce"], [10], 0, 1, 0, 0, 4096)
    with pytest.raises(ValueError, match="counts"):
        _C.p2p_ring_plan(COLL["reduce_scatter"], [10], 0, 2, 0, 0, 4096)
    with pytest.raises(ValueError, match="dtype"):
        _C.p2p_ring_plan(COLL["all_reduce"], [10], 0, 2, 9, 0, 4096)
    with pytest.raises(ValueError, match="ring"):
        _C.p2p_ring_plan(4, [10], 0, 2, 0, 0, 4096)  # barrier


# ---------------------------------------------------------------------------
# Algorithm choice of the nccl backend


def test_nccl_auto_is_native_at_every_size():
    for coll in COLL.values():
        for nbytes in [0, 1, 4096, 1 << 20, 1 << 30]:
            assert _C.nccl_resolve_algo(coll, nbytes, ALGO["auto"], 256 << 10, 8) == ALGO["native"]
            assert _C.nccl_resolve_algo(coll, nbytes, ALGO["native"], 256 << 10, 8) == ALGO["native"]
            assert _C.nccl_resolve_algo(coll, nbytes, ALGO["ring"], 256 << 10, 8) == ALGO["ring"]


def test_nccl_oneshot_limits():
    assert _C.nccl_resolve_algo(COLL["all_reduce"], 256 << 10, ALGO["oneshot"], 256 << 10, 16) == ALGO["oneshot"]
    with pytest.raises(ValueError, match="at most 262144 bytes"):
        _C.nccl_resolve_algo(COLL["all_reduce"], (256 << 10) + 1, ALGO["oneshot"], 256 << 10, 2)
    with pytest.raises(ValueError, match="at most 16 ranks"):
        _C.nccl_resolve_algo(COLL["all_reduce"], 64, ALGO["oneshot"], 256 << 10, 17)
    for coll in ("reduce_scatter", "all_gather", "broadcast"):
        with pytest.raises(ValueError, match="only for all_reduce"):
            _C.nccl_resolve_algo(COLL[coll], 64, ALGO["oneshot"], 256 << 10, 2)
    with pytest.raises(ValueError, match="not available"):
        _C.nccl_resolve_algo(4, 0, ALGO["ring"], 256 << 10, 2)  # barrier
    with pytest.raises(ValueError, match="unknown collective"):
        _C.nccl_resolve_algo(99, 0, 0, 256 << 10, 2)


def test_shm_rejects_native_algo_by_name():
    prefix = f"/pzhost{os.getpid():x}"
    comm = _C.ShmComm(prefix, 0, 1, 256 << 10, 8, 256 << 10, 10.0)
    try:
        comm.attach()
        comm.unlink()
        t = torch.ones(4)
        with pytest.raises(ValueError, match="native.*nccl backend"):
            comm.all_reduce(t.data_ptr(), 4, 0, 0, ALGO["native"], False)
    finally:
        comm.unlink()
        comm.close()


# ---------------------------------------------------------------------------
# Backend availability, build_info, device choice


def test_code_tables_are_the_documented_ones():
    """The tables _C exports are the codes csrc uses; pyzero.backend maps torch dtypes through them."""
    assert _C.DTYPES == {"float32": 0, "float16": 1, "bfloat16": 2, "float64": 3, "int32": 4, "int64": 5}
    assert _C.OPS == {"sum": 0, "avg": 1, "max": 2, "min": 3, "prod": 4}
    assert _C.ALGOS == {"auto": 0, "ring": 1, "oneshot": 2, "native": 3, "twoshot": 4}
    assert _C.SYM_KINDS == {"all_gather": 0, "reduce_scatter": 1}
    assert {k: _C.COLLS[k] for k in ("all_reduce", "reduce_scatter", "all_gather", "broadcast")} == \
        {"all_reduce": 0, "reduce_scatter": 1, "all_gather": 2, "broadcast": 3}
    from pyzero.backend import DTYPES
    assert DTYPES == {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2, torch.float64: 3, torch.int32: 4,
                      torch.int64: 5}


def test_build_info_lists_nccl_and_ipc_exactly_when_built_with_cuda():
    info = pz.build_info()
    assert info["backends"][0] == "shm"
    assert ("nccl" in info["backends"]) == info["cuda"]
    assert ("ipc" in info["backends"]) == info["cuda"]


@pytest.mark.skipif(HAS_CUDA_BUILD and _C.cuda_device_count() > 0, reason="a GPU is visible")
@pytest.mark.parametrize("backend", ["nccl", "ipc"])
def test_init_gpu_backend_without_gpu_is_a_clear_error(backend):
    want = "needs a CUDA GPU" if HAS_CUDA_BUILD else "not available in this build"
    with pytest.raises(RuntimeError, match=want):
        pz.init(backend=backend)
    assert not pz.is_initialized()


def test_ipc_device_shares_gpus_when_ranks_outnumber_them():
    from pyzero.backends.ipc import ipc_device
    assert [ipc_device(r, device_count=1) for r in range(4)] == [0, 0, 0, 0]
    assert [ipc_device(r, device_count=2) for r in range(4)] == [0, 1, 0, 1]
    assert [ipc_device(r, device_count=8) for r in range(4)] == [0, 1, 2, 3]


@pytest.mark.skipif(not HAS_CUDA_BUILD, reason="the ipc backend is built with CUDA")
def test_ipc_algorithm_choice():
    C = dict(_C.COLLS)
    auto, one, two = ALGO["auto"], ALGO["oneshot"], ALGO["twoshot"]
    # one-shot at 2 ranks (reading the one peer is all there is) and for small inputs; two-shot above at 3+
    assert _C.ipc_resolve_algo(C["all_reduce"], 64 << 20, auto, 256 << 10, 2) == one
    assert _C.ipc_resolve_algo(C["all_reduce"], 256 << 10, auto, 256 << 10, 4) == one
    assert _C.ipc_resolve_algo(C["all_reduce"], (256 << 10) + 1, auto, 256 << 10, 4) == two
    assert _C.ipc_resolve_algo(C["all_reduce"], 8, two, 256 << 10, 2) == two  # asked for: honoured
    for coll in ("reduce_scatter", "all_gather", "broadcast"):
        assert _C.ipc_resolve_algo(C[coll], 1 << 30, auto, 256 << 10, 8) == one
        with pytest.raises(ValueError, match=f"{coll}: the ipc backend takes algo 'auto', 'oneshot' or 'ring', "
                                             "got 'twoshot'"):
            _C.ipc_resolve_algo(C[coll], 8, two, 256 << 10, 2)
    # "ring": p2p_ring.h over the point-to-point channels, asked for only; no ring at one rank
    for coll in ("all_reduce", "reduce_scatter", "all_gather", "broadcast"):
        assert _C.ipc_resolve_algo(C[coll], 8, ALGO["ring"], 256 << 10, 3) == ALGO["ring"]
        assert _C.ipc_resolve_algo(C[coll], 8, ALGO["ring"], 256 << 10, 1) == one
    with pytest.raises(ValueError, match="all_reduce: the ipc backend takes algo 'auto', 'oneshot', 'twoshot' or "
                                         "'ring', got 'native'"):
        _C.ipc_resolve_algo(C["all_reduce"], 8, ALGO["native"], 256 << 10, 2)


@pytest.mark.parametrize("test_nccl", [False, True])
def test_nccl_device_is_local_rank(test_nccl):
    assert [nccl_device(r, device_count=4, test_nccl=test_nccl) for r in range(4)] == [0, 1, 2, 3]
    assert nccl_device(3, device_count=1, test_nccl=test_nccl) == 0  # per-rank CUDA_VISIBLE_DEVICES
    with pytest.raises(RuntimeError, match="needs a CUDA GPU"):
        nccl_device(0, device_count=0, test_nccl=test_nccl)
    with pytest.raises(ValueError, match="LOCAL_RANK=-1: expected a rank >= 0"):
        nccl_device(-1, device_count=2, test_nccl=test_nccl)


def test_nccl_device_one_gpu_per_rank_on_real_nccl():
    with pytest.raises(RuntimeError, match="LOCAL_RANK=2, but this process sees 2 GPU.*one GPU per rank"):
        nccl_device(2, device_count=2, test_nccl=False)


def test_nccl_device_ranks_share_gpus_on_the_test_nccl():
    assert [nccl_device(r, device_count=2, test_nccl=True) for r in range(5)] == [0, 1, 0, 1, 0]
    assert [nccl_device(r, device_count=3, test_nccl=True) for r in range(7)] == [0, 1, 2, 0, 1, 2, 0]


def test_nccl_device_asks_the_loaded_library_by_default():
    if (pz.nccl_library() or {}).get("test"):  # the suite runs on the test NCCL (PYZERO_NCCL_ROOT)
        assert nccl_device(2, device_count=2) == 0
    else:  # a real NCCL, or none (a build without CUDA)
        with pytest.raises(RuntimeError, match="one GPU per rank"):
            nccl_device(2, device_count=2)


# ---------------------------------------------------------------------------
# __cuda_array_interface__ and tensor checks


class FakeArray:
    """An object with just a __cuda_array_interface__, like a cupy array."""

    def __init__(self, shape=(4,), typestr="<f4", ptr=0x7F0000001000, readonly=False, **extra):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr, "data": (ptr, readonly), "version": 3,
                                         **extra}


def test_cai_parsing():
    b = pzcuda.parse_cuda_array_interface(FakeArray((2, 3), "<f2", stream=None), "x")
    assert b == Buffer(0x7F0000001000, 6, 2, 1, 0, "array")
    assert pzcuda.parse_cuda_array_interface(FakeArray((3,), "<i8", strides=(8,), stream=1), "x").stream == 1
    assert pzcuda.parse_cuda_array_interface(FakeArray((2, 1, 3), "<f8", strides=(24, 999, 8)), "x").numel == 6
    assert pzcuda.parse_cuda_array_interface(FakeArray((), "<i4"), "x").numel == 1
    assert pzcuda.parse_cuda_array_interface(FakeArray((0, 5), "<f4", ptr=0, strides=(4, 4)), "x").numel == 0
    assert pzcuda.parse_cuda_array_interface(FakeArray(readonly=True), "x", writable=False).code == 0
    for typestr, code in [("<f4", 0), ("<f2", 1), ("<f8", 3), ("<i4", 4), ("<i8", 5)]:
        assert pzcuda.parse_cuda_array_interface(FakeArray(typestr=typestr), "x").code == code


@pytest.mark.parametrize("kwargs,exc,words", [
    ({"shape": (2, 3), "strides": (4, 8)}, ValueError, ["C-contiguous", "x"]),
    ({"typestr": "|b1"}, TypeError, ["'|b1'", "not supported"]),
    ({"typestr": ">f4"}, TypeError, ["'>f4'"]),
    ({"typestr": "<c8"}, TypeError, ["'<c8'"]),
    ({"readonly": True}, ValueError, ["read-only"]),
    ({"stream": 0}, ValueError, ["stream 0"]),
    ({"mask": object()}, ValueError, ["masked"]),
])
def test_cai_rejects(kwargs, exc, words):
    with pytest.raises(exc) as e:
        pzcuda.parse_cuda_array_interface(FakeArray(**kwargs), "x")
    for w in words:
        assert w in str(e.value)


def test_cai_malformed():
    class Bad:
        __cuda_array_interface__ = {"shape": (4,), "typestr": "<f4"}

    with pytest.raises(TypeError, match="malformed"):
        pzcuda.parse_cuda_array_interface(Bad(), "out")


def test_as_buffer_rejects_cpu_and_foreign_objects(monkeypatch):
    with pytest.raises(ValueError, match=r"tensor: the nccl backend takes CUDA tensors.*cpu"):
        pzcuda.as_buffer(torch.ones(3), "tensor", 0)
    with pytest.raises(ValueError, match=r"out: the nccl backend takes CUDA tensors.*meta"):
        pzcuda.as_buffer(torch.empty(3, device="meta"), "out", 0)
    with pytest.raises(TypeError, match="inp: dtype torch.uint8 is not supported"):
        pzcuda.as_buffer(torch.ones(3, dtype=torch.uint8), "inp", 0)
    with pytest.raises(TypeError, match="tensor: expected a CUDA torch.Tensor or an array"):
        pzcuda.as_buffer([1.0, 2.0], "tensor", 0)
    monkeypatch.setattr(pzcuda, "device_of", lambda ptr: -1)
    with pytest.raises(ValueError, match="not on a CUDA device"):
        pzcuda.as_buffer(FakeArray(), "tensor", 0)
    monkeypatch.setattr(pzcuda, "device_of", lambda ptr: 1)
    with pytest.raises(ValueError, match=r"tensor: the array is on cuda:1, but this rank's GPU is cuda:0"):
        pzcuda.as_buffer(FakeArray(), "tensor", 0)
    assert pzcuda.as_buffer(FakeArray(), "tensor", 1).numel == 4


# ---------------------------------------------------------------------------
# comm.py's GPU dispatch, with a fake communicator in place of NcclComm


class FakeWork:
    def __init__(self, log):
        self.log = log

    def wait(self, stream):
        self.log.append(("wait", stream))

    def is_completed(self):
        return False

    def synchronize(self):
        self.log.append(("synchronize",))


class FakeComm:
    """Records what pyzero.comm hands to NcclComm; async calls return a FakeWork."""

    def __init__(self):
        self.log = []

    def __getattr__(self, name):
        def call(*args):
            self.log.append((name, *args))
            return FakeWork(self.log) if args and args[-1] is True else None
        return call

    def stats(self, reset=False):
        return {}


@pytest.fixture
def gpu_world(monkeypatch):
    """A world of 2 ranks on a fake GPU backend (this process is rank 1, cuda:1), no init or store needed."""
    comm = FakeComm()
    world = pzcomm.Group((0, 1), 1, 0, NcclBackend(comm, device=1))
    w = pzcomm._World(1, 2, 1, "nccl", 5.0, None, "tok", world=world, groups=[world], device=1)
    monkeypatch.setattr(pzcomm, "_world", w)
    monkeypatch.setattr(pzcuda, "device_of", lambda ptr: 1)
    return comm


def test_dispatch_passes_pointers_codes_and_stream(gpu_world):
    x = FakeArray((2, 3), "<f2", ptr=0x1000, stream=7)
    assert pz.all_reduce(x, op="max", algo="ring") is None
    assert gpu_world.log[-1] == ("all_reduce", 0x1000, 6, 1, 2, 1, 7, False)
    out, inp = FakeArray((3,), "<i4", ptr=0x2000), FakeArray((8,), "<i4", ptr=0x3000, readonly=True)
    pz.reduce_scatter(out, inp, counts=[5, 3], algo="native")
    assert gpu_world.log[-1] == ("reduce_scatter", 0x2000, 0x3000, [5, 3], 4, 0, 3, 0, False)
    pz.all_gather(inp.__class__((8,), "<i4", ptr=0x3000), out, counts=[5, 3])
    assert gpu_world.log[-1] == ("all_gather", 0x3000, 0x2000, [5, 3], 4, 0, 0, False)
    pz.broadcast(x, src=0)
    assert gpu_world.log[-1] == ("broadcast", 0x1000, 6, 1, 0, 0, 7, False)
    pz.send(FakeArray(readonly=True, ptr=0x4000), dst=0)
    assert gpu_world.log[-1] == ("send", 0x4000, 4, 0, 0, 0, False)
    pz.recv(FakeArray(ptr=0x5000), src=0)
    assert gpu_world.log[-1] == ("recv", 0x5000, 4, 0, 0, 0, False)


def test_batch_isend_irecv_is_one_grouped_nccl_call(gpu_world):
    out, inp = FakeArray(readonly=True, ptr=0x4000, stream=5), FakeArray(ptr=0x5000, stream=5)
    works = pz.batch_isend_irecv([pz.P2POp("send", out, 0), pz.P2POp("recv", inp, 0)])
    assert gpu_world.log[-1] == ("batch_p2p", [(0x4000, 4, 0, 0, True), (0x5000, 4, 0, 0, False)], 5, True)
    assert len(works) == 2 and works[0] is works[1] and works[0]._keep == (out, inp)
    with pytest.raises(ValueError, match=r"ops\[1\].op: expected 'send' or 'recv'"):
        pz.batch_isend_irecv([pz.P2POp("send", out, 0), pz.P2POp("bcast", inp, 0)])
    with pytest.raises(ValueError, match="cannot receive from this rank itself"):
        pz.batch_isend_irecv([pz.P2POp("recv", inp, 1)])


@pytest.fixture
def ipc_world(monkeypatch):
    """The same, on the ipc backend (this process is rank 1 of 3, cuda:1)."""
    from pyzero.backends.ipc import IpcBackend
    comm = FakeComm()
    world = pzcomm.Group((0, 1, 2), 1, 0, IpcBackend(comm, device=1))
    w = pzcomm._World(1, 3, 1, "ipc", 5.0, None, "tok", world=world, groups=[world], device=1)
    monkeypatch.setattr(pzcomm, "_world", w)
    monkeypatch.setattr(pzcuda, "device_of", lambda ptr: 1)
    return comm


def test_ipc_point_to_point_dispatch_and_errors(ipc_world):
    pz.send(FakeArray(readonly=True, ptr=0x4000, stream=3), dst=2)
    assert ipc_world.log[-1] == ("send", 0x4000, 4, 0, 2, 3, False)
    work = pz.recv(FakeArray((5,), "<i8", ptr=0x5000, stream=3), src=0, async_op=True)
    assert ipc_world.log[-1] == ("recv", 0x5000, 5, 5, 0, 3, True) and isinstance(work, pz.Work)
    out, inp = FakeArray(readonly=True, ptr=0x4000, stream=5), FakeArray((2,), "<f8", ptr=0x5000, stream=5)
    works = pz.batch_isend_irecv([pz.P2POp("send", out, 2), pz.P2POp("recv", inp, 0)])
    assert ipc_world.log[-1] == ("batch_p2p", [(0x4000, 4, 0, 2, True), (0x5000, 2, 3, 0, False)], 5, True)
    assert len(works) == 2 and works[0] is works[1]
    n = len(ipc_world.log)
    with pytest.raises(ValueError, match="ops: the ipc backend runs at most 32 operations in one batch_isend_irecv"):
        pz.batch_isend_irecv([pz.P2POp("send", out, 2)] * 33)
    with pytest.raises(ValueError, match="cannot send to this rank itself"):
        pz.send(FakeArray(), dst=1)
    with pytest.raises(ValueError, match="dst=3"):
        pz.send(FakeArray(), dst=3)
    with pytest.raises(ValueError, match="tensor: the array is read-only"):
        pz.recv(FakeArray(readonly=True), src=0)
    with pytest.raises(ValueError, match="tensor: the ipc backend takes CUDA tensors"):
        pz.send(torch.ones(4), dst=0)
    assert len(ipc_world.log) == n  # nothing reached the communicator


def test_dispatch_async_work_waits_on_the_stream_and_keeps_buffers(gpu_world):
    x = FakeArray(ptr=0x1000, stream=9)
    work = pz.all_reduce(x, async_op=True)
    assert isinstance(work, pz.Work)
    assert work._keep == (x,)
    assert work in pzcomm._world.world._pending
    assert work.wait() is True
    assert gpu_world.log[-1] == ("wait", 9)  # no cupy imported: the stream the array named
    assert work._keep is None
    w2 = pz.all_reduce(x, async_op=True)
    w2.synchronize()
    assert gpu_world.log[-1] == ("synchronize",)


def test_dispatch_checks_arguments(gpu_world):
    with pytest.raises(ValueError, match="tensor: the nccl backend takes CUDA tensors"):
        pz.all_reduce(torch.ones(4))
    with pytest.raises(ValueError, match="op='avg' is for floating-point"):
        pz.all_reduce(FakeArray(typestr="<i8"), op="avg")
    with pytest.raises(ValueError, match="algo: expected"):
        pz.all_reduce(FakeArray(), algo="tree")
    with pytest.raises(ValueError, match="out: the array is read-only"):
        pz.reduce_scatter(FakeArray(readonly=True), FakeArray((8,)))
    with pytest.raises(TypeError, match="inp: dtype float16 does not match out's float32"):
        pz.reduce_scatter(FakeArray((4,)), FakeArray((8,), "<f2"))
    with pytest.raises(ValueError, match=r"inp: expected 2 x out.numel\(\) = 8"):
        pz.reduce_scatter(FakeArray((4,)), FakeArray((9,)))
    with pytest.raises(ValueError, match=r"out: expected counts\[1\]=3"):
        pz.reduce_scatter(FakeArray((4,)), FakeArray((8,)), counts=[5, 3])
    with pytest.raises(ValueError, match="out overlaps inp"):  # aliasing but not this rank's chunk
        pz.reduce_scatter(FakeArray((4,), ptr=0x1000), FakeArray((8,), ptr=0x1000))
    pz.reduce_scatter(FakeArray((4,), ptr=0x1010), FakeArray((8,), ptr=0x1000))  # in place: rank 1's chunk
    with pytest.raises(ValueError, match="cannot send to this rank itself"):
        pz.send(FakeArray(), dst=1)
    with pytest.raises(ValueError, match="src=5"):
        pz.broadcast(FakeArray(), src=5)
    assert pz.comm_stats() == {}


def test_shm_algo_error_mentions_native():
    with pytest.raises(ValueError, match="'native'"):
        check_algo("tree")
    assert check_algo("native") == ALGO["native"]


# ---------------------------------------------------------------------------
# Spawned ranks (what the GPU tests use: CUDA cannot be used in a forked child)


def _spawned_rank(x):
    pz.init(backend="shm", timeout=60)
    t = torch.full((3,), float(pz.get_rank() + x))
    pz.all_reduce(t)
    return t.tolist()


def test_run_ranks_spawn():
    res = run_ranks(_spawned_rank, 2, args=(1,), start="spawn", timeout=120)
    assert [r.value for r in res] == [[3.0] * 3, [3.0] * 3]
    with pytest.raises(ValueError, match="start"):
        run_ranks(_spawned_rank, 1, start="forkserver")


# ---------------------------------------------------------------------------
# The CUDA kernels' bodies, run on the CPU (tests/cuda_kernels_on_cpu.cpp)

ROOT = Path(__file__).resolve().parents[1]


def _cuda_include():
    for base in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if base and (Path(base) / "include" / "cuda_runtime.h").exists():
            return Path(base) / "include"
    return None


@pytest.mark.skipif(shutil.which("g++") is None or _cuda_include() is None, reason="needs g++ and the CUDA headers")
def test_cuda_kernel_bodies_on_cpu(tmp_path):
    exe = tmp_path / "kernels_on_cpu"
    src = ROOT / "tests" / "cuda_kernels_on_cpu.cpp"
    build = subprocess.run(["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Wno-attributes", "-Wno-unknown-pragmas",
                            f"-I{ROOT / 'csrc'}", f"-I{_cuda_include()}", str(src), "-o", str(exe)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr[-4000:]
    assert "warning" not in build.stderr, build.stderr[-4000:]
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:]
    assert ", 0 failures" in run.stdout and int(run.stdout.split()[-4]) > 8000, run.stdout[-400:]


def test_ipc_blocks_fit_the_processes_sharing_a_gpu():
    """The ipc kernels' blocks (csrc/ipc_protocol.h ipc_blocks): every block of every process on one GPU must
    be resident at once beside compute, one block per SM at the kernels' registers: at most 32 and a
    quarter of the SMs per process, and the sharing processes together within half the SMs."""
    assert [_C.ipc_blocks(132, s) for s in (1, 2, 3, 4, 8, 16)] == [32, 32, 22, 16, 8, 4]  # H100 / H200
    assert [_C.ipc_blocks(108, s) for s in (1, 2, 4, 8)] == [27, 27, 13, 6]  # A100
    assert _C.ipc_blocks(132, 0) == 32 and _C.ipc_blocks(2, 8) == 1  # (at least one process, one block)
    for sms in (2, 16, 78, 108, 132, 144):
        for sharing in range(1, 17):
            b = _C.ipc_blocks(sms, sharing)
            assert 1 <= b <= min(32, max(1, sms // 4))
            assert b * sharing <= max(sms // 2, sharing), (sms, sharing, b)


def test_gpu_sharing_is_the_most_ranks_on_one_gpu():
    from pyzero.backends.ipc import gpu_sharing
    assert gpu_sharing([b"gpu0"] * 4) == 4
    assert gpu_sharing([b"gpu0", b"gpu1", b"gpu0", b"gpu2", b"gpu0"]) == 3
    assert gpu_sharing([b"gpu0", b"gpu1"]) == 1
    assert gpu_sharing([]) == 1
