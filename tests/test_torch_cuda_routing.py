"""Which pyzero GPU transport carries a "pyzero" process group's CUDA tensors, checked on the CPU.

The route is a pure function of every member's (host, GPU) and two environment variables; the
exchange that gathers them runs over a real store between real ranks (hosts simulated with
PYZERO_HOST, GPUs named by a stand-in for their UUID, the transports replaced by a recorder:
this machine has no GPU). The CUDA collectives themselves are checked in
tests/test_torch_backend_gpu.py on a GPU.
"""
import datetime
import os

import pytest
import torch
import torch.distributed as dist

import pyzero  # noqa: F401  (registers the backend)
from pyzero import comm
from pyzero import distributed_cuda as dc
from pyzero.launch import run_ranks

MB = 1 << 20


@pytest.mark.parametrize("peers, want", [
    ([("a", "g0"), ("a", "g1")], (True, True)),                  # one host, a GPU each: both, by size
    ([("a", "g0"), ("a", "g0")], (True, False)),                 # one host, one GPU: ipc only
    ([("a", "g0"), ("a", "g0"), ("a", "g1")], (True, False)),    # two ranks share a GPU: ipc only
    ([("a", "g0"), ("b", "g0")], (False, True)),                 # two hosts: nccl (same GPU name elsewhere)
    ([("a", "g0"), ("a", "g1"), ("b", "g0")], (False, True)),
    ([("a", "g0")], (False, True)),                              # one rank: nccl
])
def test_plan_auto(peers, want):
    r = dc.plan(peers, "auto", 4 * MB)
    assert (r.ipc, r.nccl) == want
    assert r.first == ("ipc" if want[0] else "nccl")


def test_plan_threshold_picks_by_message_size():
    both = dc.plan([("a", "g0"), ("a", "g1")], "auto", 4 * MB)
    assert [both.pick(n) for n in (0, 8, 4 * MB, 4 * MB + 1, 1 << 30)] == ["ipc", "ipc", "ipc", "nccl", "nccl"]
    assert dc.plan([("a", "g0"), ("a", "g1")], "auto", 0).pick(1) == "nccl"  # 0: nccl above empty messages
    shared = dc.plan([("a", "g0"), ("a", "g0")], "auto", 4 * MB)
    assert shared.pick(1 << 30) == "ipc"  # nccl cannot run there: the threshold does not apply
    assert dc.plan([("a", "g0"), ("b", "g1")], "auto", 4 * MB).pick(8) == "nccl"


def test_plan_forced_and_errors():
    assert dc.plan([("a", "g0"), ("a", "g1")], "ipc", MB).pick(1 << 30) == "ipc"
    assert dc.plan([("a", "g0"), ("a", "g1")], "nccl", MB).pick(8) == "nccl"
    with pytest.raises(ValueError, match=r"PYZERO_TORCH_CUDA=ipc: .* on 2 hosts \(\['a', 'b'\]\)"):
        dc.plan([("a", "g0"), ("b", "g0")], "ipc", MB)
    with pytest.raises(ValueError, match=r"ranks \[0, 1\] on GPU g0 of host 'a'.*NCCL needs one GPU per rank.*unset "
                                         r"PYZERO_TORCH_CUDA"):
        dc.plan([("a", "g0"), ("a", "g0")], "nccl", MB)
    with pytest.raises(ValueError, match=r"ranks \[1, 2\] on GPU g1 of host 'b'.*spans hosts.*own GPU"):
        dc.plan([("a", "g0"), ("b", "g1"), ("b", "g1")], "auto", MB)
    # pyzero's test NCCL takes ranks sharing a GPU of one host: nccl when asked for, ipc still for auto
    shared = [("a", "g0"), ("a", "g0")]
    assert dc.plan(shared, "nccl", MB, test_nccl=True) == dc.Route(False, True, MB)
    assert dc.plan(shared, "auto", MB, test_nccl=True) == dc.Route(True, False, MB)
    with pytest.raises(ValueError, match=r"spans hosts"):  # (it runs on one host only)
        dc.plan([("a", "g0"), ("b", "g1"), ("b", "g1")], "nccl", MB, test_nccl=True)


def test_environment_variables():
    assert dc.transport_choice({}) == "auto"
    assert dc.transport_choice({"PYZERO_TORCH_CUDA": " NCCL "}) == "nccl"
    with pytest.raises(ValueError, match=r"PYZERO_TORCH_CUDA='shm': expected one of \['auto', 'ipc', 'nccl'\]"):
        dc.transport_choice({"PYZERO_TORCH_CUDA": "shm"})
    assert dc.ipc_max_bytes({}) == dc.DEFAULT_IPC_MAX_BYTES == 8 * MB
    assert dc.ipc_max_bytes({"PYZERO_TORCH_IPC_MAX_KB": "512"}) == 512 * 1024
    assert dc.ipc_max_bytes({"PYZERO_TORCH_IPC_MAX_KB": "0"}) == 0
    for bad in ("1.5", "-1", "8M"):
        with pytest.raises(ValueError, match=rf"PYZERO_TORCH_IPC_MAX_KB='{bad}': expected a non-negative integer"):
            dc.ipc_max_bytes({"PYZERO_TORCH_IPC_MAX_KB": bad})


def test_group_from_store_arguments():
    store = dist.HashStore()
    with pytest.raises(ValueError, match=r"backend: a group from a store supports \['shm', 'ipc', 'nccl', 'hier', 'cpu'\], got 'gloo'"):
        comm.group_from_store(store, [0], 0, 5.0, backend="gloo")
    for device in (None, -1, True, "0"):
        with pytest.raises(ValueError, match="device: backend='ipc' needs this process's CUDA device index"):
            comm.group_from_store(store, [0], 0, 5.0, backend="ipc", device=device)


def test_registered_for_cpu_and_cuda():
    """A plain "pyzero" maps both devices to pyzero; an explicit map keeps what it names."""
    assert dist.Backend.backend_capability["pyzero"] == ["cpu", "cuda"]
    assert str(dist.distributed_c10d.BackendConfig("pyzero")) == "cpu:pyzero,cuda:pyzero"
    assert dist.Backend.default_device_backend_map["cuda"] == "nccl"  # a plain init_process_group() is unchanged


class FakeCuda:
    """What the group reads of a CUDA tensor to route it (no CUDA on this machine)."""

    is_cpu = False

    def __init__(self, index, numel):
        self.device, self.n = torch.device("cuda", index), numel

    def numel(self):
        return self.n

    def element_size(self):
        return 4


class Made(str):
    """A transport the recorder 'made': its backend's name."""

    def close(self):
        pass


def _rank_routes(hosts, gpus, env, config):
    me = dist.get_rank() if dist.is_initialized() else int(os.environ["RANK"])
    os.environ["PYZERO_HOST"] = hosts[me]
    os.environ.update(env)
    made = []

    def fake_group_from_store(store, ranks, rank, timeout, options=None, backend="shm", device=None):
        if backend in ("shm", "cpu"):  # (the group's CPU transport: real)
            return real(store, ranks, rank, timeout, options, backend, device)
        store.set(f"made/{rank}", backend)  # a collective over the store, like the real set-up
        store.wait([f"made/{r}" for r in range(len(ranks))], datetime.timedelta(seconds=10))
        made.append((backend, tuple(ranks), rank, device))
        return Made(backend)

    real = comm.group_from_store
    comm.group_from_store = fake_group_from_store
    dc.gpu_id = lambda device: gpus[me]
    dist.init_process_group(config, timeout=datetime.timedelta(seconds=10))
    pg = dist.distributed_c10d._get_default_group()
    out = {"config": str(dist.get_backend_config())}
    try:
        pg._p2p(FakeCuda(me, 4), "send", collective=False)
    except NotImplementedError as e:
        out["send first"] = str(e)
    try:
        out["small"] = pg._pz(FakeCuda(me, 256))  # 1 KiB
        out["route"] = (pg.cuda.route.ipc, pg.cuda.route.nccl, pg.cuda.route.ipc_max)
        out["large"] = pg._pz(FakeCuda(me, 1 << 20))  # 4 MiB
        out["made"] = list(made)
        out["p2p"] = pg.cuda.p2p("send")
    except ValueError as e:
        out["error"] = str(e)
    sub = dist.new_group([0, dist.get_world_size() - 1])  # a subgroup: its own transports, its global ranks
    if me in (0, dist.get_world_size() - 1):
        made.clear()
        sub_pg = sub
        try:
            out["sub"] = (sub_pg._pz(FakeCuda(me, 4)), list(made))
        except ValueError as e:
            out["sub"] = str(e)
    dist.barrier()  # rank 0 serves the store: it must not exit while rank 2 still waits on it
    dist.destroy_process_group()
    return out


def test_routes_from_the_members_hosts_and_gpus():
    """Three ranks: one host, a GPU each (ipc up to the threshold, nccl made on the first larger call)."""
    res = run_ranks(_rank_routes, 3, args=(["h"] * 3, ["g0", "g1", "g2"], {"PYZERO_TORCH_IPC_MAX_KB": "1024"},
                                           "pyzero"), timeout=60)
    for r in res:
        v = r.value
        assert v["config"] == "cpu:pyzero,cuda:pyzero"
        assert "first call on CUDA tensors" in v["send first"] and "must be a collective" in v["send first"]
        assert v["route"] == (True, True, 1 << 20)
        assert (v["small"], v["large"]) == ("ipc", "nccl")
        assert v["made"] == [("ipc", (0, 1, 2), r.rank, r.rank), ("nccl", (0, 1, 2), r.rank, r.rank)]
        assert v["p2p"] == "ipc"  # point-to-point on one transport for every size: ipc on one host
        if r.rank in (0, 2):
            assert v["sub"] == ("ipc", [("ipc", (0, 2), [0, 2].index(r.rank), r.rank)])


def test_routes_shared_gpu_and_hosts():
    # three ranks on one GPU of one host (MPS): ipc for every size, no nccl
    for r in run_ranks(_rank_routes, 3, args=(["h"] * 3, ["g0"] * 3, {}, "pyzero"), timeout=60):
        assert r.value["route"] == (True, False, 8 * MB)
        assert (r.value["small"], r.value["large"], r.value["p2p"]) == ("ipc", "ipc", "ipc")
        assert [m[0] for m in r.value["made"]] == ["ipc"]
    # two hosts: nccl for every size, and point-to-point on it; "cuda:pyzero" in a map does the same
    for r in run_ranks(_rank_routes, 2, args=(["a", "b"], ["g0", "g0"], {}, "cpu:pyzero,cuda:pyzero"), timeout=60):
        v = r.value
        assert v["config"] == "cpu:pyzero,cuda:pyzero"
        assert v["route"][:2] == (False, True) and (v["small"], v["large"], v["p2p"]) == ("nccl",) * 3
        assert [m[0] for m in v["made"]] == ["nccl"]
    # two hosts, two ranks of one sharing a GPU: an error on every rank, naming them
    for r in run_ranks(_rank_routes, 3, args=(["a", "a", "b"], ["g0", "g0", "g1"], {}, "pyzero"), timeout=60):
        assert "ranks [0, 1] on GPU g0 of host 'a'" in r.value["error"], r.value


def _rank_device_maps():
    dist.init_process_group("cpu:pyzero,cuda:gloo", timeout=datetime.timedelta(seconds=10))
    pg = dist.distributed_c10d._get_default_group()
    got = {"cuda:gloo": type(pg._make_other("cuda", None)).__name__}
    dist.destroy_process_group()
    dist.init_process_group("cpu:pyzero", timeout=datetime.timedelta(seconds=10))
    pg = dist.distributed_c10d._get_default_group()
    try:
        pg._make_other("cuda", FakeCuda(0, 1))
    except ValueError as e:
        got["cpu only"] = str(e)
    got["pyzero"] = dist.new_group(backend="pyzero")._make_other("cuda", None)
    dist.destroy_process_group()
    return got


def test_device_maps():
    """'cuda:<other>' beside 'cpu:pyzero' keeps the other backend; a map without cuda names the fix."""
    for r in run_ranks(_rank_device_maps, 2, timeout=60):
        assert r.value["cuda:gloo"] == "ProcessGroupGloo"
        assert "carries CPU and CUDA tensors, got one on cuda:0" in r.value["cpu only"]
        assert "'cpu:pyzero,cuda:<backend>'" in r.value["cpu only"]
        assert r.value["pyzero"] is None  # a plain "pyzero" subgroup carries CUDA tensors itself


def test_cuda_backend_beside_each_gpu_backend():
    """torch's CUDA backend beside pyzero's: NCCL beside nccl, "pyzero" beside ipc (NCCL refuses
    processes that share a GPU); anything else named in the error."""
    from pyzero.distributed import cuda_backend_beside
    assert cuda_backend_beside("nccl") == "nccl"
    assert cuda_backend_beside("ipc") == "pyzero"
    with pytest.raises(ValueError, match=r"gpu_backend='shm': expected 'ipc' or 'nccl'"):
        cuda_backend_beside("shm")


# ---------------------------------------------------------------------------
# Queued sends and receives of CUDA tensors ([Note: CUDA point-to-point is batched]), with a
# recording issue function and CPU tensors standing for the CUDA buffers


class _Batch(dist.Work):
    def __init__(self, log, entries):
        super().__init__()
        self.entries, self.waits = entries, 0
        log.append(self)

    def wait(self, timeout=None):
        self.waits += 1
        return True

    def is_completed(self):
        return True


def _entry(peer, is_send, tag):
    return dc.P2PEntry("group", torch.full((2,), float(tag)), peer, is_send, None, [tag])


def test_queued_sends_and_receives_go_out_together_at_the_first_wait():
    log = []
    q = dc.P2PQueue(lambda entries: _Batch(log, entries), limit=4)
    a, b, c = q.add(_entry(1, True, 10)), q.add(_entry(2, False, 11)), q.add(_entry(1, True, 12))
    assert log == []  # nothing issued yet: a ring step's send and receive must meet in one batch
    assert b.wait() is True
    assert len(log) == 1 and [(e.peer, e.is_send, e.result) for e in log[0].entries] == \
        [(1, True, [10]), (2, False, [11]), (1, True, [12])]
    assert a.real is c.real is log[0] and log[0].waits == 1
    assert a.result() == [10] and c.is_completed() and a.is_success() and log[0].waits == 2
    # the limit issues a full batch at once; an explicit flush (another call of the group) the rest
    ws = [q.add(_entry(3, k % 2 == 0, k)) for k in range(6)]
    assert len(log) == 2 and [e.result for e in log[1].entries] == [[0], [1], [2], [3]]
    assert ws[3].real is log[1] and ws[4].real is None
    q.flush()
    assert len(log) == 3 and [e.result for e in log[2].entries] == [[4], [5]] and ws[5].real is log[2]
    q.flush()  # nothing queued: nothing issued
    assert len(log) == 3


def test_a_batch_that_fails_to_issue_fails_every_one_of_its_works():
    def issue(entries):
        raise ValueError("ops: boom")
    q = dc.P2PQueue(issue)
    a, b = q.add(_entry(1, True, 1)), q.add(_entry(1, False, 2))
    with pytest.raises(ValueError, match="boom"):
        a.wait()
    for w in (a, b):
        with pytest.raises(ValueError, match="boom"):
            w.wait()
        assert w.is_completed() and not w.is_success() and "boom" in str(w.exception())
    assert q.pending == []  # the next call starts a new batch
