"""Parameter-server training (pz.ps): sync equals DataParallel, bounded staleness holds its bound,
asynchronous and bounded runs learn, workers that die or join mid-run do not stop the job, a
killed server's job resumes from its checkpoint, bad workers and bad pushes are refused."""
from __future__ import annotations

import math
import os
import random
import re
import signal
import threading
import time

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks

STEPS = 6
LR = 5e-3


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def data(step, worker, n=16):
    g = torch.Generator().manual_seed(1000 * step + worker)
    x = torch.randn(n, 8, generator=g)
    return x, (x[:, :4].sum(1, keepdim=True)).sin()


def worker_loop(w, model, index, slow=0.0, stop_after=None):
    """Train until the job ends; returns (losses, pushes applied)."""
    losses, applied = [], 0
    while w.pull():
        x, y = data(w.versions[0], index)
        loss = F.mse_loss(model(x), y)
        loss.backward()
        if slow:
            time.sleep(slow)
        applied += w.push()
        losses.append(float(loss))
        if stop_after is not None and len(losses) >= stop_after:
            break
    return losses, applied


def state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ---------------------------------------------------------------------------
# sync = DataParallel


def _sync_job(num_servers):
    role, i = pz.ps.role(num_servers)
    model = make_model()
    if role == "server":
        return pz.ps.serve(model, torch.optim.AdamW, num_servers, mode="sync", max_versions=STEPS,
                           wait_for_workers=2, idle_timeout=20, lr=LR)
    w = pz.ps.Worker(model, num_servers=num_servers)
    losses, _ = worker_loop(w, model, i)
    w.close()
    return {"state": state(model), "losses": losses, "gaps": w.clock_gaps}


def _dp_job():
    pz.init(timeout=30)
    model = make_model()
    dp = pz.DataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = data(step, pz.get_rank())
        F.mse_loss(dp(x), y).backward()
        opt.step()
        opt.zero_grad()
    return state(model)


def reference():
    """One process: each step averages the two workers' gradients, then AdamW."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for step in range(STEPS):
        grads = []
        for j in range(2):
            x, y = data(step, j)
            grads.append(torch.autograd.grad(F.mse_loss(model(x), y), list(model.parameters())))
        for p, g0, g1 in zip(model.parameters(), *grads):
            p.grad = (g0 + g1) / 2
        opt.step()
    return state(model)


def test_sync_equals_data_parallel_2_servers_2_workers():
    res = run_ranks(_sync_job, 4, args=(2,), timeout=60)
    dp = run_ranks(_dp_job, 2, timeout=60)[0].value
    ref = reference()
    for r in res[:2]:
        assert r.value["version"] == STEPS and r.value["applied"] == STEPS and r.value["died"] == 0
        assert r.value["optimizer"].startswith("pyzero.optim") and r.value["optimizer"].endswith("AdamW")
    for r in res[2:]:
        assert len(r.value["losses"]) == STEPS  # one push per version: lock step
        for k in ref:
            torch.testing.assert_close(r.value["state"][k], dp[k], rtol=1e-6, atol=1e-7)
            torch.testing.assert_close(r.value["state"][k], ref[k], rtol=1e-6, atol=1e-7)
    assert not torch.equal(ref["0.weight"], make_model().state_dict()["0.weight"])  # it trained


# ---------------------------------------------------------------------------
# bounded staleness and asynchronous runs


def _mode_job(mode, staleness, versions, slow_worker):
    role, i = pz.ps.role(1)
    model = make_model()
    if role == "server":
        return pz.ps.serve(model, torch.optim.AdamW, 1, mode=mode, staleness=staleness, max_versions=versions,
                           wait_for_workers=3, idle_timeout=20, lr=LR)
    w = pz.ps.Worker(model, num_servers=1)
    losses, applied = worker_loop(w, model, i, slow=0.02 if i == slow_worker else 0.0)
    w.close()
    x, y = data(10**6, 0, n=256)  # held-out
    with torch.no_grad():
        final = float(F.mse_loss(model(x), y))
    return {"gaps": w.clock_gaps, "pushes": len(losses), "applied": applied, "final": final}


def initial_loss():
    model = make_model()
    x, y = data(10**6, 0, n=256)
    with torch.no_grad():
        return float(F.mse_loss(model(x), y))


@pytest.mark.parametrize("mode,staleness", [("bounded", 2), ("async", 0)])
def test_bounded_and_async_learn_and_bounded_keeps_its_bound(mode, staleness):
    versions = 150  # pushes applied in total: 50 per worker when all are equal
    res = run_ranks(_mode_job, 4, args=(mode, staleness, versions, 0), timeout=90)
    server, workers = res[0].value, [r.value for r in res[1:]]
    assert server["version"] == versions and server["died"] == 0
    assert sum(w["applied"] for w in workers) == versions
    # every worker contributed, the slow one (worker 0, 20 ms per step) least
    assert all(w["applied"] > 0 for w in workers)
    if mode == "bounded":
        assert server["max_clock_gap"] <= staleness
        assert max(max(w["gaps"]) for w in workers) <= staleness
        assert min(w["applied"] for w in workers[1:]) - workers[0]["applied"] <= staleness + 1
    else:  # no bound: the fast workers ran ahead of the slow one
        assert server["max_clock_gap"] > 2
    # 150 pushes of 16 samples (2400 samples): held-out loss from 0.59 to below 0.25 (about 0.15
    # measured; the same samples in sync rounds of 3 reach 0.19, one worker alone 0.07)
    assert initial_loss() > 0.55
    assert all(w["final"] < 0.25 for w in workers), [w["final"] for w in workers]


# ---------------------------------------------------------------------------
# elasticity: workers die (SIGKILL at random moments) and join mid-run


def _elastic_job(seed):
    role, i = pz.ps.role(2)
    model = make_model()
    if role == "server":
        return pz.ps.serve(model, torch.optim.AdamW, 2, mode="sync", max_versions=80, wait_for_workers=2,
                           idle_timeout=20, worker_timeout=10, lr=LR)
    rng = random.Random(seed * 10 + i)
    if i == 1:  # three workers in turn, each SIGKILLed at a random moment (in pull, backward, push, between)
        kills = 0
        pz.ps.stats(2)  # the servers are up: the children's lifetimes are spent in the job
        for _ in range(3):
            pid = os.fork()
            if pid == 0:
                w = pz.ps.Worker(model, num_servers=2)
                worker_loop(w, model, i, slow=0.005)
                os._exit(0)
            time.sleep(rng.uniform(0.05, 0.4))
            os.kill(pid, signal.SIGKILL)
            _, status = os.waitpid(pid, 0)
            kills += os.waitstatus_to_exitcode(status) == -signal.SIGKILL
        return {"kills": kills}
    if i == 2:
        time.sleep(0.5)  # joins mid-run
    w = pz.ps.Worker(model, num_servers=2)
    losses, applied = worker_loop(w, model, i, slow=0.005)
    w.close()
    return {"applied": applied, "state": state(model)}


@pytest.mark.parametrize("seed", [1])
def test_workers_die_and_join_the_job_finishes(seed):
    t0 = time.monotonic()
    res = run_ranks(_elastic_job, 5, args=(seed,), timeout=60)
    servers, workers = [r.value for r in res[:2]], [r.value for r in res[2:]]
    kills = workers[1]["kills"]
    assert kills >= 2  # killed before finishing (the job takes longer than the three lifetimes)
    for s in servers:
        assert s["version"] == 80  # the job finished: no hang, no lost version
        # the three children vanish without leaving (killed, or exited at the job's end without close())
        assert s["joined"] == 5 and s["died"] == 3 and s["left"] == 2
    assert workers[2]["applied"] > 0  # the worker that joined mid-run contributed
    # the surviving workers end with the same (final) parameters
    for k, v in workers[0]["state"].items():
        assert torch.equal(v, workers[2]["state"][k]), k
    assert time.monotonic() - t0 < 50


# ---------------------------------------------------------------------------
# a killed server: the workers get a clear error; the restarted job resumes from the checkpoint


def _server_crash_job(ckpt, kill_at, versions):
    role, i = pz.ps.role(2)
    model = make_model()
    if role == "server":
        from pyzero.ps.rendezvous import job_key, publish
        server = pz.ps.Server(model, torch.optim.AdamW, i, 2, mode="sync", max_versions=versions,
                              checkpoint_dir=ckpt, checkpoint_every=1, wait_for_workers=2, lr=LR,
                              key=job_key(create=i == 0))
        _, port = server.bind("127.0.0.1", 0)
        publish(i, port)
        if i == 1 and kill_at is not None:
            def watch():
                while server.version < kill_at:
                    time.sleep(0.001)
                os.kill(os.getpid(), signal.SIGKILL)
            threading.Thread(target=watch, daemon=True).start()
        return server.serve(idle_timeout=3)
    w = pz.ps.Worker(model, num_servers=2)
    first = [v.clone() for v in model.parameters()]
    try:
        losses, _ = worker_loop(w, model, i)
    except pz.ps.ServerLost as e:
        return {"error": str(e), "first": first, "versions": list(w.versions)}
    w.close()
    return {"state": state(model), "first": first, "versions": list(w.versions)}


def test_killed_server_then_job_resumes_from_checkpoint(tmp_path):
    ckpt = str(tmp_path / "ps")
    res = run_ranks(_server_crash_job, 4, args=(ckpt, 4, 20), timeout=60, check=False)
    assert res[1].exitcode == -signal.SIGKILL
    for r in res[2:]:
        assert r.exitcode == 0, r.output[-2000:]
        assert "server 1" in r.value["error"] and "went away" in r.value["error"]
    assert res[0].exitcode == 0 and res[0].value["version"] >= 4
    saved = {i: torch.load(os.path.join(ckpt, f"server{i:03d}.pt"), weights_only=True) for i in (0, 1)}
    assert saved[1]["version"] >= 3  # the version being saved when it was killed may be missing
    # restart: each server resumes its own shard; a joining worker pulls exactly the saved values
    res2 = run_ranks(_server_crash_job, 4, args=(ckpt, None, 8), timeout=60)
    for i in (0, 1):
        assert res2[i].value["resumed_from"] == saved[i]["version"]
        assert res2[i].value["version"] == 8
    flat = torch.cat([saved[0]["master"], saved[1]["master"]])
    got = torch.cat([p.reshape(-1) for p in res2[2].value["first"]])
    torch.testing.assert_close(got, flat[:got.numel()], rtol=0, atol=0)


# ---------------------------------------------------------------------------
# bad input


class Other(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 2)


def _bad_job():
    role, i = pz.ps.role(1)
    model = make_model()
    if role == "server":
        return pz.ps.serve(model, torch.optim.SGD, 1, mode="async", idle_timeout=3, lr=0.1)
    out = {}
    try:
        pz.ps.Worker(Other(), num_servers=1)
    except pz.ps.JoinRefused as e:
        out["refused"] = str(e)
    w = pz.ps.Worker(model, num_servers=1)
    before = state(model)
    for p in model.parameters():
        p.grad = torch.full_like(p, float("nan"))
    out["nan_accepted"] = w.push()
    w.pull()
    out["unchanged"] = all(torch.equal(v, before[k]) for k, v in state(model).items())
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    out["ok_accepted"] = w.push()
    w.pull()
    out["moved"] = not torch.equal(state(model)["0.weight"], before["0.weight"])
    w.close()
    return out


def test_mismatched_model_refused_and_nonfinite_push_rejected():
    res = run_ranks(_bad_job, 2, timeout=30)
    server, out = res[0].value, res[1].value
    assert "model" in out["refused"] and "a.weight" in out["refused"] or "0.weight" in out["refused"]
    assert out["nan_accepted"] is False and out["unchanged"]
    assert out["ok_accepted"] is True and out["moved"]
    assert server["rejected_nonfinite"] == 1 and server["applied"] == 1
    assert server["address"].startswith("127.0.0.1:")  # serve() binds the advertised (loopback) address


@pytest.mark.parametrize("kwargs,words", [
    (dict(mode="eventual"), ["mode", "eventual"]),
    (dict(mode="bounded", staleness=-1), ["staleness"]),
    (dict(index=2), ["index"]),
    (dict(max_versions=0), ["max_versions"]),
    (dict(wait_for_workers=0), ["wait_for_workers"]),
    (dict(worker_timeout=-1), ["worker_timeout", "-1"]),
    (dict(worker_timeout="5"), ["worker_timeout", "'5'"]),
    (dict(worker_timeout=math.nan), ["worker_timeout", "nan"]),
    (dict(num_servers=True), ["num_servers", "True"]),
    (dict(mode="bounded", staleness=True), ["staleness", "True"]),
    (dict(mode="async", staleness="x"), ["staleness", "mode='bounded' only", "'x'"]),
    (dict(mode="sync", staleness=2), ["staleness", "mode='bounded' only", "waits for every worker"]),
    (dict(max_versions=True), ["max_versions", "True"]),
    (dict(checkpoint_every=False), ["checkpoint_every", "False"]),
])
def test_server_argument_errors(kwargs, words):
    args = dict(index=0, num_servers=2)
    args.update(kwargs)
    with pytest.raises(ValueError) as e:
        pz.ps.Server(make_model(), torch.optim.SGD, lr=0.1, **args)
    assert all(w in str(e.value) for w in words)


def test_worker_call_order_and_argument_errors():
    """Sync mode takes one push per worker and round: a second push before the worker has pulled
    raises (it used to replace the first one in the round, silently) and keeps the gradients; a
    closed worker's push raises instead of reporting a push that was never sent; bad servers,
    timeout and num_servers name the argument."""
    server = pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, mode="sync", wait_for_workers=2, lr=1.0)
    addr = server.bind()
    thread = threading.Thread(target=server.serve, kwargs=dict(idle_timeout=5), daemon=True)
    thread.start()
    a, b = make_model(), make_model()
    wa = pz.ps.Worker(a, servers=[addr], key=server.key)
    wb = pz.ps.Worker(b, servers=[addr], key=server.key)
    for p in a.parameters():
        p.grad = torch.ones_like(p)
    assert wa.push() is True
    for p in a.parameters():
        p.grad = torch.full_like(p, 10.0)
    with pytest.raises(RuntimeError, match=r"push: .*sync.*pull\(\)"):
        wa.push()
    assert all(torch.equal(p.grad, torch.full_like(p, 10.0)) for p in a.parameters())
    for p in b.parameters():
        p.grad = torch.zeros_like(p)
    assert wb.push() is True
    assert wa.pull() and wb.pull()
    for k, v in state(make_model()).items():  # SGD, lr 1: minus the mean of the round's pushes (1 and 0)
        torch.testing.assert_close(state(a)[k], v - 0.5, rtol=0, atol=1e-6)
        torch.testing.assert_close(state(b)[k], v - 0.5, rtol=0, atol=1e-6)
    for p in a.parameters():  # the next round takes a's next push
        p.grad = torch.zeros_like(p)
    assert wa.push() is True
    wa.close()
    with pytest.raises(RuntimeError, match="push: this worker is closed"):
        wa.push()
    assert wa.pull() is False
    wb.close()
    server.stop()
    thread.join(10)
    assert not thread.is_alive() and server.stats()["pushes"] == 3
    for kwargs, words in ((dict(servers=[]), "servers: expected a non-empty list of (host, port)"),
                          (dict(servers=["localhost"]), "servers: expected a non-empty list of (host, port)"),
                          (dict(servers=[addr], timeout=-1), "timeout: expected a positive number of seconds"),
                          (dict(num_servers=0), "num_servers: expected an int >= 1, got 0"),
                          (dict(servers=[addr], num_servers=2),
                           "num_servers: 2 servers expected, but servers lists 1")):
        with pytest.raises(ValueError, match=re.escape(words)):
            pz.ps.Worker(make_model(), key=server.key, **kwargs)
    for fn in (pz.ps.role, pz.ps.stats, pz.ps.stop):  # stats(0) and stop(0) asked no server, without a word
        with pytest.raises(ValueError, match="num_servers: expected an int >= 1, got 0"):
            fn(0)
    # serve(idle_timeout=-1) stopped at once, before any worker could join; a string failed inside its loop
    for bad in (-1, 0, "5", math.inf):
        idle = pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, lr=1.0)
        with pytest.raises(ValueError, match=re.escape(f"idle_timeout: expected None or a positive number of "
                                                       f"seconds, got {bad!r}")):
            idle.serve(idle_timeout=bad)
        assert idle.address is None  # refused before it listened
    model = make_model()
    with pytest.raises(TypeError, match=re.escape("optimizer_class: expected a torch.optim.Optimizer subclass, got an "
                                                  "optimizer built already (SGD; pass the class and its arguments)")):
        pz.ps.Server(model, torch.optim.SGD(model.parameters(), lr=1.0), 0, 1)


def test_worker_refuses_non_fp32_models():
    with pytest.raises(ValueError, match="fp32"):
        pz.ps.Worker(make_model().to(torch.float64), servers=[("127.0.0.1", 1)])


@pytest.mark.parametrize("mode", ["async", "sync"])  # (bounded: test_bounded_and_async_learn_and_bounded_keeps...)
def test_example_trains_and_checkpoints(tmp_path, mode):
    """examples/ps_train.py as docs/parameter-server.md runs it (async) and in its other modes: 1 server,
    2 workers (sync and async failed: the example gave them bounded's default staleness)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("ps_train", os.path.join(os.path.dirname(__file__), "..",
                                                                          "examples", "ps_train.py"))
    ex = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ex)
    ckpt = str(tmp_path / "ck")
    res = run_ranks(ex.main, 3, args=(["--servers", "1", "--mode", mode, "--versions", "40", "--ckpt", ckpt],),
                    timeout=60)
    server, workers = res[0].value, [r.value for r in res[1:]]
    assert server["version"] == 40 and (mode != "bounded" or server["max_clock_gap"] <= 2), server
    assert sum(w["steps"] for w in workers) >= 40
    assert torch.load(os.path.join(ckpt, "server000.pt"), weights_only=True)["version"] == 40


def test_a_server_publishes_the_address_it_listens_on(monkeypatch):
    """serve(host=X) bound X but published the advertised address, where no server listened; a wildcard
    (every interface) still publishes the advertised one."""
    import torch.distributed as dist

    from pyzero.ps import rendezvous

    st = dist.HashStore()
    monkeypatch.setattr(rendezvous, "store", lambda host_it=False, timeout=60.0: st)
    monkeypatch.setenv("PYZERO_PS_HOST", "advertised.example")
    rendezvous.publish(0, 4567, host="127.0.0.2")
    rendezvous.publish(1, 4568, host="0.0.0.0")
    rendezvous.publish(2, 4569)
    assert rendezvous.lookup(3) == [("127.0.0.2", 4567), ("advertised.example", 4568), ("advertised.example", 4569)]


def _serve_then_exit(key, q):
    srv = pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, mode="async", key=key, lr=0.1)
    q.put(srv.bind())
    st = srv.serve()
    q.put((st["applied"], st["joined"], st["left"]))
    q.close()
    q.join_thread()
    os._exit(0)  # as a server process ends once serve() returns


def test_stop_tells_a_busy_worker_before_the_server_ends():
    """pz.ps.stop while a worker computes for longer than the 5 s the server gave each connection to
    end: the server process keeps answering until the worker has been told (its next pull returns
    False, not ServerLost) and has left, then ends at once; a told worker's later pulls return False
    without asking."""
    import multiprocessing

    key = b"k" * 32
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    proc = ctx.Process(target=_serve_then_exit, args=(key, q), daemon=True)
    proc.start()
    try:
        addr = q.get(timeout=30)
        models = [make_model()]
        workers = [pz.ps.Worker(m, servers=[addr], key=key) for m in models]
        for i, (w, m) in enumerate(zip(workers, models)):
            assert w.pull()
            x, y = data(0, i)
            F.mse_loss(m(x), y).backward()
            assert w.push()
        pz.ps.request(addr, "stop", key=key)
        time.sleep(6.0)  # the workers "compute"
        assert proc.is_alive()
        for w in workers:
            assert w.pull() is False
            assert w.pull() is False
        t0 = time.monotonic()
        for w in workers:
            w.close()
        proc.join(10)
        assert proc.exitcode == 0 and time.monotonic() - t0 < 3.0
        assert q.get(timeout=5) == (1, 1, 1)
    finally:
        if proc.is_alive():
            proc.kill()
