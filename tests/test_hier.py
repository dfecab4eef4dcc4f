"""Several hosts on one machine: topology, the hierarchical backend, and training over it.

Hosts are simulated with PYZERO_HOST, set in each rank before pz.init() (2 hosts x 2 ranks:
f"host{rank // 2}"); traffic between them really goes through torch's gloo over loopback.
Collective inputs are the exact patterns of reference_data (sums exact in fp32, prod in
{1, 2, 0.5, -1}), so results must equal the torch reference exactly; random inputs check
that every rank gets bitwise the same result.
"""
import os
import re
import time
import zlib

import pytest
import torch

import pyzero as pz
from pyzero.bench.hier import enter_host
from pyzero.launch import run_ranks
from pyzero.topology import Topology, group_hosts, pick_backend

from outcomes import outcome
from reference_data import make_input, reference

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int32, torch.int64]
OPS = ["sum", "avg", "max", "min", "prod"]
SIZES = [0, 1, 13, 1031, 65537]
# subgroups of the 2 x 2 world: one rank per host, hosts of unequal size, reordered (a group inside one host
# takes the flat shm path: test_topology_at_init checks it is chosen, test_collectives.py tests shm itself)
SUBGROUPS = [(0, 1, 2, 3), (0, 2), (1, 2, 3), (3, 2, 1, 0)]
PER_HOST = 2


def simulated(fn, *args, per_host=PER_HOST):
    """Run fn in a rank that believes it is on host rank // per_host (its local rank numbered as a
    launcher there numbers it)."""
    enter_host(per_host)
    return fn(*args)


def ops_for(dtype):
    return OPS if dtype.is_floating_point else [o for o in OPS if o != "avg"]


def first_diff(got, want):
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"{got.dtype}{tuple(got.shape)} != {want.dtype}{tuple(want.shape)}"
    if torch.equal(got, want):
        return None
    i = int((got != want).nonzero().flatten()[0])
    return f"first difference at [{i}]: got {got[i].item()!r}, want {want[i].item()!r}"


# ---------------------------------------------------------------------------
# Topology (no ranks)


def test_group_hosts_orders_hosts_by_lowest_rank():
    t = group_hosts([("b", None), ("a", None), ("b", None), ("a", 2)], rank=3)
    assert t.hosts == ((0, 2), (1, 3)) and t.names == ("b", "a")
    assert (t.host, t.local_rank, t.local_ranks, t.num_hosts) == (1, 1, (1, 3), 2)
    assert t.spans_hosts([0, 1]) and not t.spans_hosts([1, 3])


def test_group_hosts_rejects_disagreeing_host():
    with pytest.raises(ValueError, match=r"host 'a' has ranks \[0, 1\] \(2 ranks\).*LOCAL_WORLD_SIZE=3"):
        group_hosts([("a", 2), ("a", 3)], rank=0)
    with pytest.raises(ValueError, match=r"host 'b' has ranks \[1\] \(1 rank\) but its ranks claim rank 1: LOCAL_WORLD"):
        group_hosts([("a", 1), ("b", 2)], rank=0)


def test_group_hosts_rejects_local_ranks_claimed_twice_or_past_the_host():
    """Two ranks of a host with one LOCAL_RANK would pick one GPU (and one shm slot): refused naming both
    (were: taken as given); a local rank past the host's ranks likewise; unclaimed ones are free."""
    with pytest.raises(ValueError, match=r"host 'a': ranks \[0, 2\] all claim LOCAL_RANK=0"):
        group_hosts([("a", 3, 0), ("a", 3, 1), ("a", 3, 0)], rank=0)
    with pytest.raises(ValueError, match=r"host 'b' has ranks \[1, 3\] \(2 ranks\) but rank 3 claims LOCAL_RANK=2"):
        group_hosts([("a", None, 0), ("b", None, 0), ("a", None, 1), ("b", None, 2)], rank=0)
    t = group_hosts([("a", 2, 1), ("a", 2, None), ("b", None, 0)], rank=1)  # the same local rank on two hosts
    assert t.hosts == ((0, 1), (2,)) and t.local_rank == 1


def _rank_duplicate_local_rank():
    os.environ["LOCAL_RANK"] = "0"
    return outcome(lambda: pz.init(timeout=30))


def test_two_ranks_of_a_host_with_one_local_rank_fail_init_on_every_rank():
    for r in run_ranks(_rank_duplicate_local_rank, 2, timeout=60):
        etype, msg = r.value
        assert etype == "ValueError" and "ranks [0, 1] all claim LOCAL_RANK=0" in msg, r.value


def test_host_name_override_and_torchrun_node_rank(monkeypatch):
    import socket  # noqa: PLC0415

    from pyzero.topology import host_name  # noqa: PLC0415

    monkeypatch.delenv("PYZERO_HOST", raising=False)
    monkeypatch.delenv("GROUP_RANK", raising=False)
    assert host_name() == socket.gethostname()
    monkeypatch.setenv("GROUP_RANK", "1")  # two torchrun agents on one machine are two hosts
    assert host_name() == socket.gethostname() + "#1"
    monkeypatch.setenv("PYZERO_HOST", "rack3-node7")
    assert host_name() == "rack3-node7"


def test_backend_choice():
    one, two = Topology(((0, 1),), ("a",), 0), Topology(((0,), (1,)), ("a", "b"), 0)
    assert pick_backend(None, one, cuda=False) == "shm"
    assert pick_backend(None, two, cuda=False) == "hier"
    assert pick_backend(None, two, cuda=True) == "nccl"
    with pytest.raises(ValueError, match="backend='shm' needs every rank on one host.*2 hosts"):
        pick_backend("shm", two, cuda=False)


def _rank_topology():
    pz.init(timeout=30)
    subs = [pz.new_group(ranks) for ranks in ([0, 1], [2, 3], [1, 2])]
    return pz.topology().as_dict(), pz.get_backend(), [g.backend_name for g in subs if g.rank >= 0]


def test_topology_at_init():
    for r in run_ranks(simulated, 4, args=(_rank_topology,), timeout=60):
        topo, backend, sub = r.value
        assert topo == {"hosts": [[0, 1], [2, 3]], "names": ["host0", "host1"], "rank": r.rank,
                        "host": r.rank // 2, "local_rank": r.rank % 2}
        # a group inside one host keeps the flat path; one across hosts is hierarchical
        assert backend == "hier" and sub == (["shm"] if r.rank in (0, 3) else ["shm", "hier"]), sub


def _rank_bad_topology():
    os.environ["PYZERO_HOST"] = "h"
    os.environ["LOCAL_WORLD_SIZE"] = str(1 + int(os.environ["RANK"]))
    return outcome(lambda: pz.init(timeout=30))


def test_disagreeing_host_fails_init_on_every_rank():
    for r in run_ranks(_rank_bad_topology, 2, timeout=60):
        etype, msg = r.value
        assert etype == "ValueError" and "inconsistent topology" in msg and "host 'h'" in msg, r.value


def _rank_engine_cannot_start():
    os.environ["GLOO_SOCKET_IFNAME"] = "pz-no-such-if"
    return outcome(lambda: pz.init(timeout=30))  # rank 0, the store's host, waits for the others' errors


def test_inter_host_engine_that_cannot_start_fails_init():
    for r in run_ranks(simulated, 4, args=(_rank_engine_cannot_start,), timeout=60):
        etype, msg = r.value
        assert etype == "CollectiveError" and "inter-host engine (torch.distributed gloo) could not start" in msg
        assert "GLOO_SOCKET_IFNAME" in msg, msg


# ---------------------------------------------------------------------------
# Collectives against the torch reference


def _rank_collectives():
    pz.init(timeout=60)
    me, fails = pz.get_rank(), []
    groups = {ranks: pz.new_group(ranks) for ranks in SUBGROUPS}
    for ranks, g in groups.items():
        if me not in ranks:
            continue
        gr, n = ranks.index(me), len(ranks)
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for size in SIZES:
                    seed = zlib.crc32(repr((ranks, dtype, op, size)).encode()) % 10007
                    inputs = [make_input(op, dtype, size, ranks[r], seed) for r in range(n)]
                    want = reference(inputs, op, dtype)
                    x = inputs[gr].clone()
                    pz.all_reduce(x, op=op, group=g)
                    if (d := first_diff(x, want)) is not None:
                        fails.append(("all_reduce", ranks, dtype, op, size, d))
                    # reduce_scatter / all_gather, even and uneven (a rank with 0 elements)
                    for counts in ([size] * n, [(size * (r + 1)) % 7 for r in range(n)]):
                        total = sum(counts)
                        ins = [make_input(op, dtype, total, ranks[r], seed + 1) for r in range(n)]
                        full = reference(ins, op, dtype)
                        lo = sum(counts[:gr])
                        out = torch.empty(counts[gr], dtype=dtype)
                        pz.reduce_scatter(out, ins[gr], op=op, counts=counts, group=g)
                        if (d := first_diff(out, full[lo:lo + counts[gr]])) is not None:
                            fails.append(("reduce_scatter", ranks, dtype, op, counts, d))
                        if op == "sum":
                            parts = [ins[r][:counts[r]] for r in range(n)]
                            got = torch.empty(total, dtype=dtype)
                            pz.all_gather(got, parts[gr].clone(), counts=counts, group=g)
                            if (d := first_diff(got, torch.cat(parts))) is not None:
                                fails.append(("all_gather", ranks, dtype, counts, d))
                if op == "sum":
                    for src in ranks:
                        x = make_input("sum", dtype, 1031, me, 5)
                        pz.broadcast(x, src=src, group=g)
                        if (d := first_diff(x, make_input("sum", dtype, 1031, src, 5))) is not None:
                            fails.append(("broadcast", ranks, dtype, src, d))
        pz.barrier(group=g)
    return fails


def test_collectives_equal_reference():
    for r in run_ranks(simulated, 4, args=(_rank_collectives,), timeout=240):
        assert r.value == [], r.value[:10]


def _rank_bitwise_async_p2p():
    pz.init(timeout=60)
    me, out = pz.get_rank(), {}
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(100_003, generator=torch.Generator().manual_seed(me)).to(dtype)
        pz.all_reduce(x, op="avg")
        out[str(dtype)] = x
    # the same all_reduces in pipelined pieces (8 KiB each: about 49 for fp32, 25 for bf16 widened)
    from pyzero.backends import hier  # noqa: PLC0415
    saved, hier.PIPELINE_BYTES = hier.PIPELINE_BYTES, 8 << 10
    try:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(100_003, generator=torch.Generator().manual_seed(me)).to(dtype)
            pz.all_reduce(x, op="avg")
            out["piped " + str(dtype)] = x
        pz.comm_stats(reset=True)
        pz.all_reduce(torch.ones(1 << 18))
        out["piped stats"] = pz.comm_stats()
    finally:
        hier.PIPELINE_BYTES = saved
    # async calls complete in order, results as if synchronous
    xs = [torch.full((4099,), float(me + k)) for k in range(5)]
    works = [pz.all_reduce(x, async_op=True) for x in xs]
    for w in works:
        w.wait()
    out["async"] = [x[0].item() for x in xs]
    # send/recv inside a host (0 <-> 1) and across hosts (0 <-> 3, 2 -> 1)
    got = {}
    for a, b in ((0, 1), (0, 3), (2, 1)):
        if me == a:
            pz.send(torch.arange(77, dtype=torch.int64) * (a + 1), dst=b)
        elif me == b:
            t = torch.empty(77, dtype=torch.int64)
            pz.recv(t, src=a)
            got[a] = t
    out["p2p"] = got
    pz.comm_stats(reset=True)
    pz.all_reduce(torch.ones(1 << 18))
    out["stats"] = pz.comm_stats()
    return out


def _rank_pieces_uneven_hosts():
    """Hosts of 2 and 1 ranks: rank 1 has no lane (no rank of host 1 shares its local index)."""
    r = int(os.environ["RANK"])
    os.environ["PYZERO_HOST"] = f"host{int(r == 2)}"
    os.environ["LOCAL_WORLD_SIZE"] = str(1 if r == 2 else 2)
    os.environ["LOCAL_RANK"] = str(0 if r == 2 else r)
    pz.init(timeout=20)
    from pyzero.backends import hier  # noqa: PLC0415
    hier.PIPELINE_BYTES = 8 << 10  # all_reduces above 16 KiB run in pieces
    out = {}
    for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "avg"), (torch.int64, "max")):
        x = make_input(op, dtype, 20011, r, 3)
        out[(str(dtype), op)] = outcome(lambda: pz.all_reduce(x, op=op)), x
    counts = [7000, 0, 13011]
    rs = torch.empty(counts[r])
    out["reduce_scatter"] = outcome(lambda: pz.reduce_scatter(rs, make_input("sum", torch.float32, 20011, r, 4),
                                                              counts=counts)), rs
    return out


def test_pieces_on_uneven_hosts_equal_reference():
    """An all_reduce above the pipelining size on hosts of different sizes: every rank of a host must
    cut it into the same pieces (before, a rank without a lane took it whole while its host peer
    took pieces, and the call failed on every rank)."""
    res = [r.value for r in run_ranks(_rank_pieces_uneven_hosts, 3, timeout=60)]
    for dtype, op in ((torch.float32, "sum"), (torch.bfloat16, "avg"), (torch.int64, "max")):
        want = reference([make_input(op, dtype, 20011, r, 3) for r in range(3)], op, dtype)
        for r, v in enumerate(res):
            done, got = v[(str(dtype), op)]
            assert done == ("ok", None), (r, dtype, op, done)
            assert (d := first_diff(got, want)) is None, (r, dtype, op, d)
    full = reference([make_input("sum", torch.float32, 20011, r, 4) for r in range(3)], "sum", torch.float32)
    for r, (lo, hi) in enumerate(((0, 7000), (7000, 7000), (7000, 20011))):
        done, got = res[r]["reduce_scatter"]
        assert done == ("ok", None) and first_diff(got, full[lo:hi]) is None, (r, done)


def test_bitwise_same_on_every_rank_async_p2p_and_stats():
    res = [r.value for r in run_ranks(simulated, 4, args=(_rank_bitwise_async_p2p,), timeout=120)]
    for dtype in (torch.float32, torch.bfloat16):
        inputs = [torch.randn(100_003, generator=torch.Generator().manual_seed(r)).to(dtype) for r in range(4)]
        want = torch.stack([t.float() for t in inputs]).mean(0).to(dtype)
        for v in res:
            assert torch.equal(v[str(dtype)], res[0][str(dtype)])  # bitwise, every rank
            # in pieces: the same sums of two within the host and across it, so bitwise the same
            assert torch.equal(v["piped " + str(dtype)], res[0][str(dtype)])
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=8e-3, atol=8e-3)
        torch.testing.assert_close(res[0][str(dtype)], want, **tol)
    for v in res:
        assert v["async"] == [float(sum(range(4)) + 4 * k) for k in range(5)]
    assert torch.equal(res[1]["p2p"][0], torch.arange(77) * 1) and torch.equal(res[3]["p2p"][0], torch.arange(77))
    assert torch.equal(res[1]["p2p"][2], torch.arange(77) * 3)
    # all_reduce of N fp32 over 2 x 2: the intra reduce-scatter and all-gather each send half the
    # tensor to the host peer; across hosts each lane's ring all_reduce of its half sends 2(H-1)/H of it
    n = (1 << 18) * 4
    for v in res:
        st = v["stats"]
        assert st["intra_host"]["sent_bytes"] == n // 2 + n // 2, st
        assert st["inter_host"]["sent_bytes"] == n // 2, st
        assert st["all_reduce"] == {"calls": 1, "elements": 1 << 18, "sent_bytes": n + n // 2}, st
        assert v["piped stats"]["inter_host"]["sent_bytes"] == n // 2, v["piped stats"]
        assert v["piped stats"]["intra_host"]["sent_bytes"] == n, v["piped stats"]


# ---------------------------------------------------------------------------
# A dead rank on another host


def _rank_dies():
    pz.init(timeout=30)
    pz.all_reduce(torch.ones(1031))
    if pz.get_rank() == 3:
        os._exit(3)
    t0 = time.monotonic()
    first = outcome(lambda: pz.all_reduce(torch.ones(1031)))
    return {"first": first, "seconds": time.monotonic() - t0, "again": outcome(lambda: pz.barrier())}


def test_dead_rank_on_another_host_is_named():
    """Rank 3 exits. Its host peer (rank 2) sees it in the shm group; the ranks of the other host
    see gloo fail (its connections closed, or rank 2's: see [Note: hier failure probe]). All name
    rank 3, and only rank 3, as not responding."""
    results = run_ranks(simulated, 4, args=(_rank_dies,), timeout=90, check=False)
    assert results[3].exitcode == 3
    for r in results[:3]:
        assert r.exitcode == 0, r.output
        etype, msg = r.value["first"]
        assert etype == "CollectiveTimeout", (r.rank, msg)
        assert re.search(r"rank 3\b", msg) and not re.search(r"rank [012] \(host", msg), (r.rank, msg)
        assert r.value["seconds"] < 10, r.value  # within seconds, although pz.init(timeout=30)
        assert r.value["again"][0] == "CollectiveError" and "unusable" in r.value["again"][1], r.value


HIER_MISMATCH = {  # case: (what ranks 0-1 call, what ranks 2-3 call, the field the error names)
    "count": (lambda: pz.all_reduce(torch.ones(8)), lambda: pz.all_reduce(torch.ones(9)), "element count"),
    "op": (lambda: pz.all_reduce(torch.ones(8)), lambda: pz.all_reduce(torch.ones(8), op="max"), "op or root"),
    "dtype": (lambda: pz.all_reduce(torch.ones(8)), lambda: pz.all_reduce(torch.ones(8, dtype=torch.bfloat16)),
              "dtype (float32 .. bfloat16)"),
    "kind": (lambda: pz.all_reduce(torch.ones(8)), lambda: pz.broadcast(torch.ones(8), src=0), "collective"),
    "root": (lambda: pz.broadcast(torch.ones(8), src=0), lambda: pz.broadcast(torch.ones(8), src=1), "op or root"),
    "counts": (lambda: pz.all_gather(torch.zeros(8), torch.ones([2, 2, 2, 2][pz.get_rank()]), counts=[2, 2, 2, 2]),
               lambda: pz.all_gather(torch.zeros(8), torch.ones([1, 3, 2, 2][pz.get_rank()]), counts=[1, 3, 2, 2]),
               "counts per rank"),
    "algo": (lambda: pz.all_reduce(torch.ones(8), algo="ring"), lambda: pz.all_reduce(torch.ones(8), algo="oneshot"),
             "algo"),
    # counts that differ yet sum alike, chosen so a linear hash of them agreed
    "counts/same-sum": (lambda: pz.reduce_scatter(torch.zeros(5000), torch.ones(20000), counts=[5000] * 4),
                        lambda: pz.reduce_scatter(torch.zeros([7558, 896, 9026, 2520][pz.get_rank()]),
                                                  torch.ones(20000), counts=[7558, 896, 9026, 2520]),
                        "counts per rank"),
}


def _rank_mismatch():
    pz.init(timeout=20)
    out = {}
    for case, (a, b, _) in HIER_MISMATCH.items():
        out[case] = outcome(a if pz.get_rank() < 2 else b)
        t = torch.full((5,), float(pz.get_rank()))
        pz.all_reduce(t)  # the group goes on after a mismatch
        out[case + "/after"] = t.tolist()
    # "auto" matches an explicit algo (it may pick it), as on one host
    out["auto"] = outcome(lambda: pz.all_reduce(torch.ones(8), algo="ring" if pz.get_rank() else None))
    # algo names the shm backend refuses for a collective are refused here too, on every rank
    out["native"] = outcome(lambda: pz.broadcast(torch.ones(8), src=0, algo="native"))
    out["twoshot"] = outcome(lambda: pz.reduce_scatter(torch.zeros(2), torch.ones(8), algo="twoshot"))
    t = torch.full((5,), float(pz.get_rank()))
    pz.all_reduce(t, algo="twoshot")  # an all_reduce algorithm: taken (hier runs its own)
    out["twoshot/all_reduce"] = t.tolist()
    return out


def test_mismatched_calls_raise_on_every_rank():
    """Ranks of the two hosts make different calls: every rank raises CollectiveError naming the field
    (gloo alone would read past a buffer, mix reductions or hang), and the next call works."""
    for r in run_ranks(simulated, 4, args=(_rank_mismatch,), timeout=90):
        for case, (_, _, field) in HIER_MISMATCH.items():
            etype, msg = r.value[case]
            assert etype == "CollectiveError" and f"the ranks differ in {field}" in msg, (r.rank, case, msg)
            assert r.value[case + "/after"] == [6.0] * 5, (r.rank, case)
        assert "op or root (sum .. max)" in r.value["op"][1], r.value["op"]  # ops by name, roots by number
        assert "op or root (0 .. 1)" in r.value["root"][1], r.value["root"]
        assert r.value["auto"][0] == "ok", r.value["auto"]
        assert r.value["native"][0] == "ValueError" and "algo='native'" in r.value["native"][1], r.value["native"]
        assert r.value["twoshot"][0] == "ValueError" and "all_reduce algorithm" in r.value["twoshot"][1], r.value
        assert r.value["twoshot/all_reduce"] == [6.0] * 5, r.value


def _rank_nan_max_min():
    """max/min with NaN at one rank's elements: every rank's result against torch's over the stacked
    inputs, on the world (2 x 2: the lanes' gloo all_reduce) and on subgroup (1, 2, 3) (uneven hosts:
    reduce_scatter through the all_reduce)."""
    pz.init(timeout=20)
    me, bad = pz.get_rank(), []
    sub = pz.new_group([1, 2, 3])
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        for nan_rank in range(4):
            ins = []
            for r in range(4):
                x = torch.arange(12, dtype=torch.float32).mul(r + 1).sub(20).to(dtype)
                if r == nan_rank:
                    x[::3] = float("nan")
                ins.append(x)
            for op, fold in (("max", torch.amax), ("min", torch.amin)):
                x = ins[me].clone()
                pz.all_reduce(x, op=op)
                want = fold(torch.stack(ins), 0)
                if not torch.equal(x.isnan(), want.isnan()) or not torch.equal(x.nan_to_num(), want.nan_to_num()):
                    bad.append(f"all_reduce {op} {dtype} nan at rank {nan_rank}: {x.tolist()} != {want.tolist()}")
                if me in (1, 2, 3):
                    out = torch.empty(4, dtype=dtype)
                    pz.reduce_scatter(out, ins[me].clone(), op=op, group=sub)
                    want = fold(torch.stack(ins[1:]), 0)[4 * (me - 1):4 * me]
                    if not torch.equal(out.isnan(), want.isnan()) or not torch.equal(out.nan_to_num(),
                                                                                       want.nan_to_num()):
                        bad.append(f"reduce_scatter {op} {dtype} nan at rank {nan_rank}: {out.tolist()} != "
                                   f"{want.tolist()}")
    return bad


def test_max_and_min_across_hosts_keep_nan():
    """NaN wins max and min as in torch (gloo's own max/min keep or drop it by operand order)."""
    for r in run_ranks(simulated, 4, args=(_rank_nan_max_min,), timeout=90):
        assert r.value == [], (r.rank, r.value[:4])


P2P_MISMATCH = {  # case: (what rank 0 sends, what rank 1 receives into)
    "fewer": (torch.arange(5.0), torch.full((6,), -1.0)),
    "more": (torch.arange(6.0), torch.full((5,), -1.0)),
    "dtype": (torch.arange(4.0), torch.full((4,), -1, dtype=torch.int32)),
    "empty_sent": (torch.zeros(0), torch.full((3,), -1.0)),
    "empty_expected": (torch.arange(3.0), torch.zeros(0)),
}


def _rank_p2p_across_hosts():
    pz.init(timeout=10)
    me, out = pz.get_rank(), {}
    for case, (sent, expected) in P2P_MISMATCH.items():
        if me == 0:
            out[case] = outcome(lambda: pz.send(sent, dst=1))
        else:
            buf = expected.clone()
            out[case] = outcome(lambda: pz.recv(buf, src=0))
            out[case + "/untouched"] = torch.equal(buf, expected)
        # the pair stays in step: the next message arrives whole
        if me == 0:
            pz.send(torch.arange(3.0) + 100, dst=1)
        else:
            got = torch.zeros(3)
            pz.recv(got, src=0)
            out[case + "/after"] = got.tolist()
    # empty messages asynchronously: a Work to wait on, like any other
    works = [pz.send(torch.zeros(0), dst=1, async_op=True) if me == 0 else
             pz.recv(torch.zeros(0), src=0, async_op=True)]
    works.append(pz.send(torch.arange(2.0), dst=1, async_op=True) if me == 0 else
                 pz.recv(got := torch.zeros(2), src=0, async_op=True))
    out["async"] = [outcome(w.wait) for w in works]
    if me == 1:
        out["async/got"] = got.tolist()
    t = torch.full((3,), float(me + 1))
    pz.all_reduce(t)
    out["all_reduce"] = t.tolist()
    return out


def test_send_recv_across_hosts_that_disagree_raise_on_the_receiver():
    """A send and its receive across hosts that differ in size or dtype: the receiver raises naming both (as
    on one host), its buffer untouched, never a partial message, a reinterpreted one or an aborted process;
    the pair and the group go on."""
    res = run_ranks(simulated, 2, args=(_rank_p2p_across_hosts,), kwargs={"per_host": 1}, timeout=60)
    sender, receiver = res[0].value, res[1].value
    for case, (sent, expected) in P2P_MISMATCH.items():
        assert sender[case] == ("ok", None), (case, sender[case])
        etype, msg = receiver[case]
        assert etype == "MessageMismatch", (case, receiver[case])
        for words in ("mismatched send/recv", "rank 0", f"sent {sent.numel()} elements of "
                      f"{str(sent.dtype)[6:]}", f"expected {expected.numel()} elements of {str(expected.dtype)[6:]}"):
            assert words in msg, (case, words, msg)
        assert receiver[case + "/untouched"], case
        assert receiver[case + "/after"] == [100.0, 101.0, 102.0], case
    for v in (sender, receiver):
        assert v["async"] == [("ok", None)] * 2, v["async"]
        assert v["all_reduce"] == [3.0] * 3
    assert receiver["async/got"] == [0.0, 1.0]


def _rank_p2p_inside_host():
    pz.init(timeout=10)
    me, out = pz.get_rank(), {}
    if me == 0:  # rank 1 shares its host
        pz.send(torch.arange(5.0), dst=1)
        pz.send(torch.arange(3.0) + 100, dst=1)
    elif me == 1:
        out["mismatch"] = outcome(lambda: pz.recv(torch.zeros(6), src=0))
        got = torch.zeros(3)
        out["next"] = outcome(lambda: pz.recv(got, src=0))
        out["next/got"] = got.tolist()
    t = torch.full((3,), float(me + 1))
    out["all_reduce"] = outcome(lambda: pz.all_reduce(t))
    out["all_reduce/got"] = t.tolist()
    return out


def test_send_recv_inside_a_host_that_disagree_leave_the_group_usable():
    """A mismatched send/recv between two ranks of one host raises on the receiver (the shm transport
    discards the message, as on one host); before, the hier group took it for a failure, broke itself and
    every rank's next collective failed, naming live ranks as dead."""
    res = run_ranks(simulated, 4, args=(_rank_p2p_inside_host,), timeout=60)
    etype, msg = res[1].value["mismatch"]
    assert etype == "MessageMismatch" and "mismatched send/recv" in msg and "did not respond" not in msg, msg
    assert res[1].value["next"] == ("ok", None) and res[1].value["next/got"] == [100.0, 101.0, 102.0]
    for r in res:
        assert r.value["all_reduce"] == ("ok", None), (r.rank, r.value["all_reduce"])
        assert r.value["all_reduce/got"] == [10.0] * 3


# ---------------------------------------------------------------------------
# Training over 2 x 2 equals one process (the single-host suites' models and references)

import test_data_parallel as dp_suite  # noqa: E402
import test_zero as zero_suite  # noqa: E402

ZERO_VARIANTS = ["adamw", "sgd", "tied", "accum", "unused"]


def test_data_parallel_matches_single_process():
    want = dp_suite.reference("features", 4)
    for r in run_ranks(simulated, 4, args=(dp_suite.train_rank, "features", 4, dp_suite.TINY_MB), timeout=120):
        state, _, in_buckets, _, _ = r.value
        dp_suite.check_state(state, want, dp_suite.FP32)
        assert in_buckets == 9


def _rank_zero():
    pz.init(timeout=60)
    assert pz.get_backend() == "hier"
    return {(name, stage): zero_suite.train(zero_suite.spec(name, stage), pz.get_world_size())
            for stage in (1, 2, 3) for name in ZERO_VARIANTS}


def test_zero_stages_match_single_process():
    res = [r.value for r in run_ranks(simulated, 4, args=(_rank_zero,), timeout=240)]
    for (name, stage), got in res[0].items():
        ref = zero_suite.reference(name)
        zero_suite.assert_state_close(got["state"], ref["state"], **zero_suite.TOL)
        torch.testing.assert_close(torch.tensor(got["norms"]), torch.tensor(ref["norms"]), rtol=1e-5, atol=0)
        if stage < 3:
            for other in res[1:]:
                for k, v in other[name, stage]["state"].items():
                    assert torch.equal(v, got["state"][k]), (name, stage, k)


# ---------------------------------------------------------------------------
# Hosts in separate network namespaces, joined by a rate-limited veth link


def _rank_over_link(prefix):
    from pyzero.bench.hier import enter_host  # noqa: PLC0415

    enter_host(PER_HOST, prefix)
    pz.init(timeout=60)
    me = pz.get_rank()
    x = make_input("sum", torch.float32, 100_003, me, 3)
    pz.all_reduce(x)
    out = torch.empty(4 * 1031, dtype=torch.int64)
    pz.all_gather(out, torch.full((1031,), me, dtype=torch.int64))
    return x, out, pz.comm_stats()["inter_host"]["sent_bytes"]


def test_collectives_across_network_namespaces():
    """Two hosts in their own network namespaces (root and iproute2 needed, else skipped), the link
    between them a veth pair limited by tc to 200 Mbit/s: gloo's traffic really crosses it."""
    import shutil  # noqa: PLC0415

    from pyzero.bench.hier import SUBNET, setup_link, teardown_link  # noqa: PLC0415

    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        pytest.skip("network namespaces need root and iproute2 (ip, tc)")
    prefix = f"pztest{os.getpid()}-h"
    try:
        setup_link(2, 200, prefix)
    except SystemExit as e:
        teardown_link(2, prefix)
        pytest.skip(f"cannot make network namespaces here: {e}")
    try:
        res = run_ranks(_rank_over_link, 4, args=(prefix,), env={"MASTER_ADDR": f"{SUBNET}1"}, timeout=120)
    finally:
        teardown_link(2, prefix)
    want = reference([make_input("sum", torch.float32, 100_003, r, 3) for r in range(4)], "sum", torch.float32)
    for r in res:
        x, out, inter = r.value
        assert torch.equal(x, want)
        assert torch.equal(out, torch.arange(4).repeat_interleave(1031))
        assert inter > 0


def test_pipeline_across_hosts_matches_single_process():
    """Four pipeline stages, two per host: activations and gradients cross hosts by send/recv over gloo."""
    import test_pipeline as pp_suite  # noqa: PLC0415

    m = 8
    pp_suite.check_train(run_ranks(simulated, 4, args=(pp_suite.rank_train, "ce", m), timeout=120), m, "ce")


def test_tensor_parallel_across_hosts_matches_single_process():
    """A TP transformer block over 4 ranks on 2 hosts, and the overlapped TP ops (send/recv ring) against
    their unoverlapped forms."""
    import test_tp as tp_suite  # noqa: PLC0415

    tp_suite.check_against(run_ranks(simulated, 4, args=(tp_suite.rank_models, "block"), timeout=120),
                           tp_suite.forward_backward(tp_suite.make_block(), *tp_suite.make_data()))
    for res in run_ranks(simulated, 4, args=(tp_suite.rank_overlap_ops, False), timeout=120):
        v = res.value
        for op in ("ag", "rs"):
            y, y_ref, dx, dx_ref, dw, dw_ref = v[op]
            for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref), v[f"{op}_vs_unoverlapped"]):
                torch.testing.assert_close(got, want, **tp_suite.TOL)
        sent, all_gathers, expected = v["ag_sent"]
        assert (sent, all_gathers) == (expected, 0)
