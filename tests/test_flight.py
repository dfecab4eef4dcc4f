"""Flight recorder: pz.debug_dump() lists exactly the calls made; a rank that never calls, and mismatched
calls, are named in the error every other rank raises; PYZERO_TRACE writes a Chrome trace per rank."""
import json
import os
import time

import pytest
import torch

import pyzero as pz
from pyzero.launch import run_ranks


def _rank_calls(path):
    pz.init(timeout=20)
    rank = pz.get_rank()
    pz.all_reduce(torch.ones(5))
    pz.all_reduce(torch.ones(3, dtype=torch.int64), op="max", algo="ring")
    pz.broadcast(torch.ones(7, dtype=torch.float64), src=2)
    pz.reduce_scatter(torch.zeros([1, 2, 3][rank]), torch.ones(6), counts=[1, 2, 3])
    pz.all_gather(torch.zeros(3), torch.ones([2, 0, 1][rank]), counts=[2, 0, 1])
    pz.all_reduce(torch.ones(4, dtype=torch.bfloat16), async_op=True).wait()
    pz.barrier()
    sub = pz.new_group([0, 2])
    if rank in (0, 2):
        pz.all_reduce(torch.ones(2), group=sub)
    if rank == 0:
        pz.send(torch.ones(9), dst=1)
    elif rank == 1:
        pz.recv(torch.zeros(9), src=0)
    path = f"{path}.rank{rank}"
    got = pz.debug_dump(path)
    with open(path) as f:
        assert json.load(f) == got
    return got


def expected_calls(rank):
    """(seq, call, count, dtype, op, root/peer) of the world group, then of the subgroup, as made above."""
    world = [(1, "all_reduce", 5, "float32", "sum"), (2, "all_reduce", 3, "int64", "max"),
             (3, "broadcast", 7, "float64", None), (4, "reduce_scatter", 6, "float32", "sum"),
             (5, "all_gather", 3, "float32", None), (6, "all_reduce", 4, "bfloat16", "sum"),
             (7, "barrier", 0, "float32", None)]
    if rank == 0:
        world.append((0, "send", 9, "float32", None))
    if rank == 1:
        world.append((0, "recv", 9, "float32", None))
    sub = [(1, "all_reduce", 2, "float32", "sum")] if rank in (0, 2) else None
    return world, sub


def test_dump_lists_the_calls_made(tmp_path):
    res = run_ranks(_rank_calls, 3, args=(str(tmp_path / "dump.json"),), timeout=60)
    for r in res:
        d = r.value
        world, sub = expected_calls(r.rank)
        assert d["rank"] == r.rank
        groups = {g["gid"]: g for g in d["groups"]}
        got = [(c["seq"], c["call"], c["count"], c["dtype"], c["op"]) for c in groups[0]["records"]]
        assert got == world
        assert all(c["state"] == "done" for c in groups[0]["records"])
        assert groups[0]["records"][2]["root"] == 2 and groups[0]["records"][1]["algo"] == "ring"
        if r.rank in (0, 1):
            assert groups[0]["records"][-1]["peer"] == 1 - r.rank
        starts = [c["start"] for c in groups[0]["records"]]
        assert starts == sorted(starts) and time.time() - 60 < starts[0] <= starts[-1] <= time.time()
        if sub is None:
            assert 1 not in groups
        else:
            assert groups[1]["ranks"] == [0, 2]
            assert [(c["seq"], c["call"], c["count"], c["dtype"], c["op"]) for c in groups[1]["records"]] == sub


def _rank_never_calls(async_op):
    """Rank 1 makes 2 of the 3 calls, then sleeps past the timeout; the others fail in call 3."""
    pz.init(timeout=2)
    t = torch.ones(4)
    pz.all_reduce(t)
    pz.all_reduce(t)
    if pz.get_rank() == 1:
        time.sleep(4)
        return None
    start = time.monotonic()
    try:
        if async_op:
            pz.all_reduce(t, async_op=True).wait()
        else:
            pz.all_reduce(t)
    except pz.CollectiveError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    return "no error", "", 0.0


@pytest.mark.parametrize("async_op", [False, True], ids=["sync", "async"])
def test_rank_that_never_calls_is_named(async_op):
    res = run_ranks(_rank_never_calls, 3, args=(async_op,), timeout=60, env={"PYZERO_FLIGHT_WAIT": "3"})
    for r in (res[0], res[2]):
        kind, msg, took = r.value
        assert kind in ("CollectiveTimeout", "CollectiveError"), msg
        assert ("rank 1 is behind: it has not called seq 3 (all_reduce(count=4, op=sum, dtype=float32)); "
                "it last called seq 2 all_reduce(count=4, op=sum, dtype=float32) [done]") in msg, msg
        assert f"this rank (global {r.rank}) failed in seq 3 all_reduce(count=4" in msg, msg
        assert "did not answer" not in msg, msg
        assert took < 2 + 3, f"the error took {took:.1f} s (timeout 2 s, every rank answers in well under 3 s)"
    assert "CollectiveTimeout" in (res[0].value[0], res[2].value[0])


MISMATCHES = {
    "kind": (lambda: pz.all_reduce(torch.ones(8)), lambda: pz.all_gather(torch.zeros(8), torch.ones(4)),
             "rank 0 called all_reduce(count=8, op=sum, dtype=float32), "
             "rank 1 called all_gather(count=8, dtype=float32)"),
    "dtype": (lambda: pz.all_reduce(torch.ones(8)), lambda: pz.all_reduce(torch.ones(8, dtype=torch.float64)),
              "rank 0 called all_reduce(count=8, op=sum, dtype=float32), "
              "rank 1 called all_reduce(count=8, op=sum, dtype=float64)"),
    "op": (lambda: pz.all_reduce(torch.ones(8)), lambda: pz.all_reduce(torch.ones(8), op="max"),
           "rank 0 called all_reduce(count=8, op=sum, dtype=float32), "
           "rank 1 called all_reduce(count=8, op=max, dtype=float32)"),
}


def _rank_mismatch(case):
    pz.init(timeout=5)
    pz.barrier()
    try:
        MISMATCHES[case][pz.get_rank()]()
    except pz.CollectiveError as e:
        return str(e)
    return "no error"


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_mismatched_calls_show_both(case):
    for r in run_ranks(_rank_mismatch, 2, args=(case,), timeout=60):
        assert f"mismatched calls at seq 2: {MISMATCHES[case][2]}" in r.value, r.value


def _rank_subgroup_mismatch():
    pz.init(timeout=5)
    g = pz.new_group([2, 1])
    out = None
    if pz.get_rank() != 0:
        try:
            pz.all_reduce(torch.ones(8), op="max" if pz.get_rank() == 1 else "sum", group=g)
            out = "no error"
        except pz.CollectiveError as e:
            out = str(e)
    pz.barrier()  # (rank 0 hosts the store the others use until here)
    return out


def test_a_subgroup_error_says_how_its_ranks_are_numbered():
    """In group [2, 1] the transport's message numbers the ranks 0 and 1 within the group, the flight
    summary by global rank: the summary says so (the two numberings read as one)."""
    for r in run_ranks(_rank_subgroup_mismatch, 3, timeout=60)[1:]:
        me = 1 - (r.rank - 1)  # rank 2 is the group's 0
        assert f"all_reduce (rank {me} of 2, seq 1): mismatched collective" in r.value, r.value
        assert ("(global ranks [2, 1]; the error above numbers them 0 to 1 in this order, these lines by global "
                "rank)") in r.value, r.value
        assert "rank 1 called all_reduce(count=8, op=max" in r.value, r.value


def _rank_trace(n):
    pz.init(timeout=20)
    for i in range(n):
        pz.all_reduce(torch.ones(i + 1))
    pz.all_gather(torch.zeros(2 * pz.get_world_size()), torch.ones(2), async_op=True).wait()
    return len(pz.debug_dump()["groups"][0]["records"])


@pytest.mark.parametrize("path", [True, 1, 2.5])
def test_dump_path_must_be_a_path(path):
    """open() takes an int as a file descriptor: pz.debug_dump(True) wrote the records to fd 1 and closed
    this process's stdout. A path that is not a str or os.PathLike is a TypeError naming it."""
    before = os.fstat(1)
    with pytest.raises(TypeError, match="path: expected None or a file path"):
        pz.debug_dump(path)
    assert os.fstat(1) == before  # stdout still open


def test_trace_and_off_switch(tmp_path):
    run_ranks(_rank_trace, 2, args=(3,), timeout=60, env={"PYZERO_TRACE": str(tmp_path)})
    for rank in range(2):
        with open(tmp_path / f"pyzero_trace_rank{rank}.json") as f:
            events = json.load(f)["traceEvents"]
        assert [(e["name"], e["args"]["count"]) for e in events] == [
            ("all_reduce", 1), ("all_reduce", 2), ("all_reduce", 3), ("all_gather", 4)]
        assert all(e["ph"] == "X" and e["dur"] >= 0 and e["pid"] == rank and e["tid"] == 0 for e in events)
        assert [e["ts"] for e in events] == sorted(e["ts"] for e in events)
    res = run_ranks(_rank_trace, 2, args=(3,), timeout=60, env={"PYZERO_FLIGHT": "0"})
    assert [r.value for r in res] == [0, 0]
    assert not os.path.exists("pyzero_trace_rank0.json")


def _rank_trace_dir(path, remove):
    import shutil
    import warnings

    from pyzero import flight

    try:
        pz.init(timeout=20)
    except ValueError as e:
        return str(e)
    pz.all_reduce(torch.ones(1))
    pz.barrier()
    if remove and pz.get_rank() == 0:
        shutil.rmtree(path)
    pz.barrier()
    groups = pz.comm._world.groups
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pz.destroy()
    # (a complete destroy: the answering thread stopped, every group's transport closed)
    return [str(w.message) for w in caught], flight._proc.thread, [g._closed for g in groups]


def test_trace_directory_missing_or_gone(tmp_path):
    """PYZERO_TRACE naming no directory is an error naming it at pz.init, before the run; a trace that
    cannot be written at pz.destroy() (the directory removed since) is a warning, and destroy still frees
    the groups and stops the answering thread (it raised, leaving both behind)."""
    missing = str(tmp_path / "missing")
    res = run_ranks(_rank_trace_dir, 2, args=(missing, False), timeout=60, env={"PYZERO_TRACE": missing})
    for r in res:
        assert r.value.startswith(f"PYZERO_TRACE={missing!r}: expected 1 or an existing directory"), r.value
    gone = tmp_path / "gone"
    gone.mkdir()
    res = run_ranks(_rank_trace_dir, 2, args=(str(gone), True), timeout=60, env={"PYZERO_TRACE": str(gone)})
    for r in res:
        warned, thread, closed = r.value
        assert len(warned) == 1 and warned[0].startswith("PYZERO_TRACE: could not write the trace"), warned
        assert thread is None and closed and all(closed), closed


@pytest.mark.parametrize("value", ["abc", "-1", "nan", "inf", "1s"])
def test_bad_flight_wait_names_the_variable(value, monkeypatch):
    """PYZERO_FLIGHT_WAIT is read as the other settings are: a bad value is a ValueError naming it (it was
    float()'s own error at import, and inf or NaN let a failing rank wait for its peers' records forever
    or broke the answering thread)."""
    from pyzero import flight

    monkeypatch.setenv("PYZERO_FLIGHT_WAIT", value)
    with pytest.raises(ValueError, match=rf"PYZERO_FLIGHT_WAIT='{value}': expected a non-negative number of seconds"):
        flight._Process()
    for good, want in (("0", 0.0), ("2.5", 2.5), (" ", 1.0)):
        monkeypatch.setenv("PYZERO_FLIGHT_WAIT", good)
        assert flight._Process().wait_s == want


def test_ring_keeps_the_newest_records():
    """The C++ ring: capacity rounded up to a power of two, the oldest records overwritten, a finish for
    an overwritten record ignored, p2p records without a sequence number."""
    ring = pz._C.FlightRing(3, False)
    assert ring.capacity == 4
    idx = [ring.begin(0, k, 0, 0, 0, -1, k % 3 == 0) for k in range(1, 11)]
    assert idx == list(range(1, 11)) and ring.n == 10
    ring.finish(2, 3)  # overwritten by record 6: ignored
    ring.finish(9, 2)
    recs = ring.records()
    assert [r[0] for r in recs] == [7, 8, 9, 10]
    # seq counts collectives only (k = 3, 6, 9 are point-to-point)
    assert [(r[1], r[3]) for r in recs] == [(5, 7), (6, 8), (0, 9), (7, 10)]
    assert [r[10] for r in recs] == [1, 1, 2, 1]
    assert ring.record(2) is None and ring.record(9)[10] == 2


def _rank_read_while_written(n):
    """The main thread makes `n` synchronous all_reduces of seq % 97 + 1 elements (the transport writes
    each record without the GIL) while a second thread reads the records over and over: every record
    read must be whole (its count matching its seq)."""
    import threading  # noqa: PLC0415

    pz.init(timeout=20)
    ring = pz.comm.resolve_group(None).flight
    assert ring.native
    stop, bad, reads = threading.Event(), [], [0]

    def reader():
        while not stop.is_set():
            for d in ring.records():
                reads[0] += 1
                if d["count"] != d["seq"] % 97 + 1 or d["call"] != "all_reduce":
                    bad.append(d)
    th = threading.Thread(target=reader)
    th.start()
    for seq in range(1, n + 1):
        pz.all_reduce(torch.ones(seq % 97 + 1))
    stop.set()
    th.join()
    recs = ring.records()
    assert [d["seq"] for d in recs] == list(range(n - 255, n + 1))
    assert all(d["state"] == "done" for d in recs)
    return len(bad), reads[0]


def test_records_read_while_written():
    for r in run_ranks(_rank_read_while_written, 2, args=(400,), timeout=60):
        bad, reads = r.value
        assert bad == 0 and reads > 256, r.value


def _rank_async_native():
    pz.init(timeout=20)
    works = [pz.all_reduce(torch.ones(1000 * (k + 1)), async_op=True) for k in range(3)]
    for w in works:
        w.wait()
    recs = pz.debug_dump()["groups"][0]["records"]
    return [(d["seq"], d["count"], d["state"]) for d in recs]


def test_async_records_marked_done_by_the_transport():
    for r in run_ranks(_rank_async_native, 2, timeout=60):
        assert r.value == [(1, 1000, "done"), (2, 2000, "done"), (3, 3000, "done")]


class _FakeWork:
    """An async handle as a GPU backend returns it (no flight_index: pyzero.comm records the call)."""

    def __init__(self):
        self.done = False

    def is_completed(self):
        return self.done


def test_python_recorded_ring_states():
    """The path of the backends that do not record natively (nccl, ipc, hier): begin / done / queued /
    failed through pyzero.flight.Ring, states derived as the calls go, roots and peers as global ranks."""
    from pyzero import flight

    ring = flight.Ring(7, (4, 5, 6), 1, 8)
    assert not ring.native
    a = ring.begin("all_reduce", 10, 0, 0)
    ring.done(a)
    b = ring.begin("broadcast", 3, 0, -1, root=2)
    w = _FakeWork()
    ring.queued(b, w)
    c = ring.begin_p2p("send", 4, 0, peer=0)
    recs = ring.records()
    assert [(d["seq"], d["call"], d["state"]) for d in recs] == [
        (1, "all_reduce", "done"), (2, "broadcast", "queued"), (0, "send", "started")]
    assert recs[1]["root"] == 6 and recs[2]["peer"] == 4  # group ranks 2 and 0 of (4, 5, 6)
    w.done = True
    assert ring.records()[1]["state"] == "done"
    assert ring.find_work(w) == b
    err = ring.failed(c, ValueError("not a collective error"))
    assert isinstance(err, ValueError) and ring.records()[2]["state"] == "failed"
    for _ in range(10):  # wraps the 8-record ring
        ring.done(ring.begin("barrier", 0, 0))
    assert len(ring.records()) == 8 and ring.records()[-1]["seq"] == 12


def _rank_peer_exits():
    """Rank 1 exits after a barrier; rank 0's all_reduce fails. Rank 0's answering thread is made to look
    unconnected (as while a slow store connection is still being opened): with no live peer to ask, the error
    must not wait PYZERO_FLIGHT_WAIT (3 s) for it."""
    import threading  # noqa: PLC0415

    from pyzero import flight  # noqa: PLC0415
    pz.init(timeout=10)
    pz.barrier()
    if pz.get_rank() == 1:
        os._exit(0)
    assert flight._proc.connected.wait(10)
    flight._proc.connected = threading.Event()  # (the thread has connected: nothing sets this one)
    start = time.monotonic()
    try:
        pz.all_reduce(torch.ones(4))
    except pz.CollectiveError as e:
        return str(e), time.monotonic() - start
    return "no error", 0.0


def test_error_with_no_live_peer_does_not_wait_for_the_store():
    res = run_ranks(_rank_peer_exits, 2, timeout=60, check=False, env={"PYZERO_FLIGHT_WAIT": "3"})
    msg, took = res[0].value
    assert "waiting for rank 1, which has exited" in msg, msg
    assert "ranks [1] did not answer" in msg, msg
    assert took < 2.0, f"the error took {took:.1f} s"


def _rank_destroy_while_connecting():
    """Each store connection of the answering thread takes 1.5 s (as behind a slow reverse DNS lookup)."""
    import torch.distributed as dist  # noqa: PLC0415

    from pyzero import flight  # noqa: PLC0415
    clone = dist.TCPStore.clone

    def slow_clone(self):
        time.sleep(1.5)
        return clone(self)
    dist.TCPStore.clone = slow_clone
    pz.init(timeout=10)
    t = torch.full((2,), float(pz.get_rank() + 1))
    pz.all_reduce(t)  # (the collectives do not wait for the answering thread)
    thread = flight._proc.thread
    start = time.monotonic()
    pz.destroy()
    took = time.monotonic() - start
    alive = thread.is_alive()
    pz.init(timeout=10)  # a second job on the same port: its store waits for the first's thread to let go
    pz.all_reduce(t)
    flight._proc.connected.wait(10)
    second = flight._proc.store is not None
    pz.destroy()
    return t.tolist(), took, alive, thread.is_alive(), second


def _rank_leave_outlasts_its_bound():
    """Rank 1's first "leaving" store call takes 2 s (a loaded machine): more than pz.destroy() gives its leave."""
    import torch.distributed as dist  # noqa: PLC0415

    from pyzero import flight  # noqa: PLC0415
    add, rank = dist.TCPStore.add, []

    def slow_add(self, key, value):
        if key.endswith("/leaving") and value == 1 and rank == [1]:
            time.sleep(2.0)
        return add(self, key, value)
    dist.TCPStore.add = slow_add
    pz.init(timeout=10)
    rank.append(pz.get_rank())
    t = torch.full((2,), float(pz.get_rank() + 1))
    pz.all_reduce(t)
    flight._proc.connected.wait(10)  # (a thread still connecting is the test above)
    thread = flight._proc.thread
    start = time.monotonic()
    pz.destroy()
    took = time.monotonic() - start
    alive = thread.is_alive()
    flight.wait_connecting()  # what the exit (and the next pz.init) does
    ended = not thread.is_alive()
    if rank == [0]:
        time.sleep(2.5)  # (the store, in this process, outlives rank 1's leave)
    return t.tolist(), took, alive, ended


def test_exit_waits_for_an_answering_thread_destroy_left_in_a_store_call():
    # pz.destroy() returns while rank 1's thread still waits in a store call; exiting then would unwind that
    # C++ call through finalisation and abort the process: the exit waits until the thread has ended
    r = run_ranks(_rank_leave_outlasts_its_bound, 2, timeout=60)[1]
    got, took, alive_after_destroy, ended = r.value
    assert got == [3.0, 3.0]
    assert took < 1.5, f"pz.destroy() took {took:.1f} s"
    assert alive_after_destroy and ended


def test_destroy_does_not_wait_for_a_connecting_thread():
    for r in run_ranks(_rank_destroy_while_connecting, 2, timeout=60):
        got, took, alive_after_destroy, alive_after_init, second = r.value
        assert got == [6.0, 6.0]
        assert took < 1.0, f"pz.destroy() took {took:.1f} s"
        assert alive_after_destroy and not alive_after_init
        assert second  # the second job's thread connected: the first one's did not take its place
