"""pz.ps's wire as an outsider and as a hostile peer see it: a wrong or old default key is refused,
nothing that arrives is unpickled or executed, a bad or oversized message closes only its own
connection before anything is allocated for it while a regular worker keeps training, the
worker's reply path checks the same, and a bounded fuzz run of the format finds no other outcome."""
from __future__ import annotations

import json
import logging
import os
import pickle
import random
import socket
import threading
import time
from multiprocessing.connection import Client

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import free_port
from pyzero.ps import rendezvous, wire

LR = 0.1


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def batch(step):
    g = torch.Generator().manual_seed(step)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :4].sum(1, keepdim=True).sin()


class Boom:
    """Unpickling this creates a file: the proof that a message was executed."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.fixture
def allocs(monkeypatch):
    """Every tensor wire.recv allocates, as (dtype, count)."""
    seen = []
    real = wire._alloc

    def spy(dtype, n):
        seen.append((dtype, n))
        return real(dtype, n)

    monkeypatch.setattr(wire, "_alloc", spy)
    return seen


@pytest.fixture
def server():
    srv = pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, mode="async", worker_timeout=20, lr=LR)
    srv.bind()
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    yield srv
    srv.stop()
    t.join(10)
    assert not t.is_alive()


def wait_for(pred, timeout=10.0):
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def closed_by_peer(sock, timeout=10.0) -> bytes:
    """Read until EOF (the server closed the connection); returns what came before it."""
    sock.settimeout(timeout)
    got = b""
    while True:
        try:
            chunk = sock.recv(65536)
        except ConnectionResetError:
            return got
        if not chunk:
            return got
        got += chunk


def frame(header: dict | bytes) -> bytes:
    body = header if isinstance(header, bytes) else json.dumps(header).encode()
    return wire.MAGIC + len(body).to_bytes(4, "little") + body


# ---------------------------------------------------------------------------
# keys


def test_wrong_or_default_key_and_old_protocol_are_refused(server, tmp_path):
    addr = server.address
    assert addr[0] == "127.0.0.1"  # loopback unless told otherwise, never every interface
    with pytest.raises(pz.ps.AuthError, match="refused"):
        wire.connect(*addr, b"x" * 32)
    with pytest.raises(pz.ps.AuthError):
        pz.ps.Worker(make_model(), servers=[addr], key=b"pyzero-ps" * 2)
    # the old transport's client, with the old default key, cannot get a pickle through
    with pytest.raises(OSError):  # its challenge reader sees a message length it does not accept
        c = Client(addr, authkey=b"pyzero-ps")
        c.send(Boom(str(tmp_path / "old")))
    # a raw client that skips the handshake and sends a pickle
    with socket.create_connection(addr) as s:
        s.sendall(pickle.dumps(Boom(str(tmp_path / "raw"))).ljust(72, b"\0"))
        closed_by_peer(s)
    wait_for(lambda: server.stats()["refused_auth"] == 4)
    assert not os.path.exists(tmp_path / "old") and not os.path.exists(tmp_path / "raw")
    assert server.stats()["joined"] == 0
    # the right key is let in
    conn = wire.connect(*addr, server.key)
    wire.send(conn, {"op": "stats"})
    h, _ = wire.recv(conn, lambda h: (wire.check_any(h, "stats"), [])[1], timeout=10)
    assert h["refused_auth"] == 4 and h["address"] == "%s:%d" % addr
    conn.close()


def test_a_server_without_the_key_is_refused_by_the_client():
    key = wire.new_key()
    lst = wire.Listener("127.0.0.1")
    errors = []

    def fake():
        while (got := lst.accept()) is None:
            pass
        try:
            wire.accept(*got, wire.new_key())  # another job's key
        except pz.ps.AuthError as e:
            errors.append(str(e))

    t = threading.Thread(target=fake, daemon=True)
    t.start()
    with pytest.raises(pz.ps.AuthError):
        wire.connect(*lst.address, key)
    t.join(10)
    lst.close()
    assert errors and "wrong key" in errors[0]


def test_keys_are_random_per_job_never_a_constant(monkeypatch):
    monkeypatch.delenv("PYZERO_PS_KEY", raising=False)
    a = pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, lr=LR)
    b = pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, lr=LR)
    assert len(a.key) == 32 and a.key != b.key
    monkeypatch.setenv("PYZERO_PS_KEY", "k" * 20)
    assert pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, lr=LR).key == b"k" * 20
    monkeypatch.setenv("PYZERO_PS_KEY", "short")
    with pytest.raises(ValueError, match="PYZERO_PS_KEY.*at least 16"):
        pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, lr=LR)
    monkeypatch.delenv("PYZERO_PS_KEY")
    with pytest.raises(ValueError, match="key: servers given by address"):
        pz.ps.Worker(make_model(), servers=[("127.0.0.1", 1)])
    with pytest.raises(TypeError, match="key: expected bytes or str"):
        pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, key=123, lr=LR)
    # through the job's store: server 0 makes it, everyone else reads the same; another job differs
    keys = []
    for _ in range(2):
        monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
        monkeypatch.setenv("MASTER_PORT", str(free_port()))
        k0 = rendezvous.job_key(create=True)
        assert rendezvous.job_key(create=False) == k0 and rendezvous.job_key(create=True) == k0
        keys.append(k0)
    assert keys[0] != keys[1] and all(len(k) == 32 for k in keys)
    st = rendezvous.store(host_it=False)
    st.set(rendezvous.KEY, "not-hex")  # (compare_set keeps a key once set; this store is a fresh client)
    st.set("pyzero_ps/server0", "no-port")
    with pytest.raises(ValueError, match="pz.ps job key"):
        rendezvous.job_key(create=False)
    with pytest.raises(ValueError, match="host:port"):
        rendezvous.lookup(1)


# ---------------------------------------------------------------------------
# hostile messages from a peer holding the key; a regular worker keeps training


def bad_messages(n, boom, signature):
    """(name, bytes after the handshake, a word the server's logged reason contains)."""
    push = {"op": "push", "version": 0}
    join = frame({"op": "join", "signature": signature, "num_servers": 1, "wid": None, "tensors": []})
    return [
        ("pickle in a frame", frame(pickle.dumps(Boom(boom))), "JSON"),
        ("bare pickle", pickle.dumps(Boom(boom)), "not a pz.ps message"),
        ("unknown field", frame({"op": "pull", "have": 0, "exec": "rm -rf /", "tensors": []}), "unknown fields"),
        ("unknown op", frame({"op": "eval", "tensors": []}), "op: expected one of"),
        ("op a list", frame({"op": ["pull"], "tensors": []}), "op: expected one of"),
        ("op an object", frame({"op": {"a": 1}, "tensors": []}), "op: expected one of"),
        ("negative count", frame(dict(push, tensors=[["float32", -5]])), "tensors: expected"),
        ("huge count", frame(dict(push, tensors=[["float32", 1 << 40]])), "tensors: expected"),
        ("wrong dtype", frame(dict(push, tensors=[["float64", n]])), "tensors: expected"),
        ("two tensors", frame(dict(push, tensors=[["float32", n], ["float32", n]])), "tensors: expected"),
        ("wrong type", frame({"op": "pull", "have": "0", "tensors": []}), "field 'have'"),
        ("bool for int", frame({"op": "pull", "have": True, "tensors": []}), "field 'have'"),
        ("huge header", wire.MAGIC + (0xFFFFFFFF).to_bytes(4, "little"), "a header of"),
        ("not an object", frame(b"[1, 2, 3]"), "not a JSON object"),
        ("deep nesting", frame(b"[" * 100000 + b"]" * 100000), "not a JSON object"),
        ("random bytes", random.Random(0).randbytes(4096), "not a pz.ps message"),
        ("join twice", join + join, "joined already"),
    ]


def test_hostile_messages_close_their_connection_nothing_runs_worker_trains(server, tmp_path, allocs, caplog):
    caplog.set_level(logging.WARNING, logger="pyzero.ps")
    model = make_model()
    ref = make_model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=LR)
    w = pz.ps.Worker(model, servers=[server.address], key=server.key)
    n = server.master.numel()
    boom = str(tmp_path / "executed")
    cases = bad_messages(n, boom, [[k, list(v)] for k, v in server.signature])
    for step, (name, payload, word) in enumerate(cases):
        # the regular worker: one step, the same as the one-process reference
        assert w.pull()
        x, y = batch(step)
        F.mse_loss(model(x), y).backward()
        assert w.push()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        # the hostile peer holds the key
        conn = wire.connect(*server.address, server.key)
        conn.sock.sendall(payload)
        reply = closed_by_peer(conn.sock)
        conn.close()
        assert b"server 0" in reply, name  # an honest peer with a bug learns why
        assert any(word in r.getMessage() for r in caplog.records), (name, [r.getMessage() for r in caplog.records])
        caplog.clear()
    assert not os.path.exists(boom)
    assert w.pull()
    for p, q in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-6, atol=1e-7)
    assert not torch.equal(ref[0].weight, make_model()[0].weight)
    w.close()
    st = server.stats()
    assert st["bad_messages"] == len(cases) and st["applied"] == len(cases)
    assert st["joined"] == 2 and st["left"] == 1 and st["died"] == 1  # the worker, and the peer that joined twice
    # what was allocated: the worker's pushes and pulls (one shard each), nothing else
    assert {c for _, c in allocs} == {n} and all(d == torch.float32 for d, _ in allocs)


def test_a_hostile_server_cannot_run_code_in_a_worker(tmp_path, allocs):
    key = wire.new_key()
    boom = str(tmp_path / "executed")
    n = sum(p.numel() for p in make_model().parameters())
    replies = [frame(pickle.dumps(Boom(boom))),
               frame({"ok": True, "wid": 0, "version": 0, "mode": "async", "staleness": None, "done": False,
                      "tensors": [["float32", 1 << 40]]}),
               frame({"ok": True, "wid": 0, "version": 0, "mode": "async", "staleness": None, "done": False,
                      "extra": 1, "tensors": [["float32", n]]}),
               frame({"ok": True, "wid": -1, "version": 0, "mode": "async", "staleness": None, "done": False,
                      "tensors": [["float32", n]]})]
    words = ["JSON", "tensors: expected", "unknown fields", "field 'wid'"]
    for reply, word in zip(replies, words):
        lst = wire.Listener("127.0.0.1")

        def fake(reply=reply):
            while (got := lst.accept()) is None:
                pass
            conn = wire.accept(*got, key)
            conn.sock.settimeout(10)
            conn.sock.recv(1 << 16)  # the join
            conn.sock.sendall(reply)
            time.sleep(0.2)
            conn.close()

        t = threading.Thread(target=fake, daemon=True)
        t.start()
        with pytest.raises(pz.ps.ServerLost, match=word):
            pz.ps.Worker(make_model(), servers=[lst.address], key=key)
        t.join(10)
        lst.close()
    assert not os.path.exists(boom)
    assert allocs == []  # nothing of a bad reply was allocated


def test_a_second_push_into_one_sync_round_is_rejected():
    """Sync mode takes one push per worker and round: a client that pushes twice before the round
    closes gets the second rejected (counted), and the round applies the mean of the first pushes."""
    srv = pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, mode="sync", wait_for_workers=2, lr=LR)
    srv.bind()
    t = threading.Thread(target=srv.serve, daemon=True)
    t.start()
    try:
        n, start = srv.master.numel(), srv.master.detach().clone()
        join = {"op": "join", "signature": [[k, list(v)] for k, v in srv.signature], "num_servers": 1}
        conns = []
        for wid in range(2):
            c = wire.connect(*srv.address, srv.key)
            wire.send(c, {**join, "wid": wid})
            h, _ = wire.recv(c, lambda h: [(torch.float32, n)] if h.get("ok") else [], timeout=10)
            assert h["ok"], h
            conns.append(c)

        def push(c, value):
            wire.send(c, {"op": "push", "version": 0}, [torch.full((n,), value)])
            return wire.recv(c, lambda h: [], timeout=10)[0]["accepted"]

        assert push(conns[0], 1.0) is True
        assert push(conns[0], 100.0) is False  # before: it replaced the first
        assert srv.stats()["rejected_repeat"] == 1 and srv.version == 0
        assert push(conns[1], 3.0) is True  # the round closes: the mean of 1 and 3
        wait_for(lambda: srv.version == 1)
        torch.testing.assert_close(srv.master.detach(), start - LR * 2.0, rtol=0, atol=1e-6)
        for c in conns:
            c.close()
    finally:
        srv.stop()
        t.join(10)


# ---------------------------------------------------------------------------
# a bounded fuzz run of the format


def test_fuzz_the_wire_format_bounded():
    """Mutated, truncated and random frames against the server's checks, for 3 s: every outcome is a
    checked message, BadMessage or PeerLost, and nothing is allocated beyond one shard."""
    srv = pz.ps.Server(make_model(), torch.optim.SGD, 0, 1, lr=LR)
    n = srv.master.numel()
    good = [frame({"op": "pull", "have": 3, "tensors": []}),
            frame({"op": "push", "version": 1, "tensors": [["float32", n]]}) + bytes(4 * n),
            frame({"op": "join", "signature": [["0.weight", [16, 8]], ["0.bias", [16]]], "num_servers": 1,
                   "wid": 2, "tensors": []}),
            frame({"op": "stats", "tensors": []})]
    rng = random.Random(1234)
    biggest, outcomes = [0], {"ok": 0, "bad": 0, "lost": 0}
    real = wire._alloc

    def alloc(dtype, count):
        biggest[0] = max(biggest[0], count)
        return real(dtype, count)

    wire._alloc = alloc
    try:
        deadline = time.monotonic() + 3.0
        runs = 0
        while time.monotonic() < deadline or runs < 200:
            data = bytearray(rng.choice(good))
            how = rng.randrange(5)
            if how == 0:  # flip bits
                for _ in range(rng.randint(1, 8)):
                    i = rng.randrange(len(data))
                    data[i] ^= 1 << rng.randrange(8)
            elif how == 1:  # truncate
                data = data[:rng.randrange(len(data))]
            elif how == 2:  # a random length field
                data[4:8] = rng.randrange(1 << 32).to_bytes(4, "little")
            elif how == 3:  # splice random bytes into the header
                i = rng.randrange(8, max(9, len(data)))
                data[i:i] = rng.randbytes(rng.randint(1, 16))
            else:  # random bytes behind the magic
                data = bytearray(wire.MAGIC + rng.randbytes(rng.randint(0, 64)))
            a, b = socket.socketpair()
            try:
                a.sendall(bytes(data))
                a.close()
                conn = wire.Connection(b, "fuzz")
                try:
                    h, ts = wire.recv(conn, srv._expect, timeout=5)
                    outcomes["ok"] += 1
                    assert h["op"] in ("pull", "push", "join", "stats")
                    assert [t.numel() for t in ts] == ([n] if h["op"] == "push" else [])
                except wire.BadMessage:
                    outcomes["bad"] += 1
                except wire.PeerLost:
                    outcomes["lost"] += 1
            finally:
                b.close()
            runs += 1
    finally:
        wire._alloc = real
    assert biggest[0] <= n
    assert outcomes["bad"] > 50 and outcomes["lost"] > 20 and outcomes["ok"] > 0, outcomes


def test_a_client_silent_mid_handshake_is_cut_off_at_the_handshake_deadline(monkeypatch):
    """A client that sends part of its hello and then nothing: the read waits out the time left of
    HANDSHAKE_TIMEOUT and the error names that deadline (whether a byte came just before it or not)."""
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT", 0.5)
    server_side, client = socket.socketpair()
    client.send(b"x")
    t0 = time.monotonic()
    with pytest.raises(wire.AuthError, match="did not finish the handshake in 0.5 s"):
        wire.accept(server_side, ("silent", 1), os.urandom(32))
    took = time.monotonic() - t0
    client.close()
    assert 0.4 < took < 2.0, took


def test_a_client_trickling_the_handshake_is_cut_off_at_its_deadline(monkeypatch):
    """HANDSHAKE_TIMEOUT bounds the whole handshake: a client sending one byte just inside each read's
    timeout held a handshake slot (of MAX_HANDSHAKES) for as long as it liked."""
    monkeypatch.setattr(wire, "HANDSHAKE_TIMEOUT", 0.5)
    server_side, client = socket.socketpair()
    stop = threading.Event()

    def trickle():
        while not stop.is_set():
            try:
                client.send(b"x")
            except OSError:
                return
            time.sleep(0.1)

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(wire.AuthError, match="did not finish the handshake in 0.5 s"):
        wire.accept(server_side, ("trickler", 1), os.urandom(32))
    took = time.monotonic() - t0
    stop.set()
    client.close()
    assert 0.4 < took < 2.0, took
