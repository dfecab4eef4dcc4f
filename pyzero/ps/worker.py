"""A parameter-server worker: pulls the parameters, computes gradients, pushes them.

    w = pz.ps.Worker(model, num_servers=2)      # finds the servers through the job's store
    while w.pull():                              # False once the servers' job is finished
        loss_fn(model(x), y).backward()
        w.push()
    w.close()

The model's trainable parameters become views of one flat fp32 buffer laid
out as the servers' (zero.partition.FlatLayout), so a pull copies each
server's shard in place. Requests go to every server before any reply is
read, so the servers work in parallel.
"""
from __future__ import annotations

import math

import torch
from torch import nn

from ..zero.partition import FlatLayout, trainable
from . import wire
from .server import MODES, check_num_servers, describe
from ..checks import is_positive_finite


class ServerLost(RuntimeError):
    """A parameter server stopped answering (died or was stopped): the job must restart."""


class JoinRefused(ValueError):
    """The servers refused this worker (another model, another number of servers)."""


class Worker:
    """One worker of a parameter-server job (see the module docstring)."""

    def __init__(self, model: nn.Module, servers=None, num_servers: int | None = None, wid: int | None = None,
                 timeout: float = 60.0, key: bytes | str | None = None):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        params, names = trainable(model)
        bad = [n for n, p in zip(names, params) if p.dtype != torch.float32 or p.device.type != "cpu"]
        if bad:
            raise ValueError(f"model: parameter-server workers train fp32 CPU parameters, got {bad[:3]} "
                             f"({params[names.index(bad[0])].dtype})")
        if not is_positive_finite(timeout):
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        if servers is not None and (isinstance(servers, (str, bytes)) or not isinstance(servers, (list, tuple))
                                    or not servers or not all(_is_address(a) for a in servers)):
            raise ValueError(f"servers: expected a non-empty list of (host, port) pairs, one per server, got "
                             f"{servers!r}")
        if num_servers is not None:
            check_num_servers(num_servers)
        if servers is not None and num_servers is not None and len(servers) != num_servers:
            raise ValueError(f"num_servers: {num_servers} servers expected, but servers lists {len(servers)}")
        key = wire.resolve_key(key)
        if servers is None:
            if num_servers is None:
                raise ValueError("servers/num_servers: give the servers' (host, port) list or their number "
                                 "(then they are looked up in the job's store, MASTER_ADDR/MASTER_PORT)")
            from .rendezvous import job_key, lookup  # noqa: PLC0415

            servers = lookup(num_servers, timeout)
            key = key or job_key(create=False, timeout=timeout)
        elif key is None:
            raise ValueError("key: servers given by address need the job's key: key=server.key, or the same "
                             "PYZERO_PS_KEY as the servers'")
        self.servers = [tuple(a) for a in servers]
        self.model, self.timeout = model, timeout
        self.params, self.names = params, names
        n = len(self.servers)
        self.layout = FlatLayout(self.params, self.names, n)
        self.flat = torch.zeros(self.layout.padded, dtype=torch.float32)
        for v, p in zip(self.layout.views(self.flat), self.params):
            v.copy_(p.detach())
            p.data = v
        self.versions = [0] * n
        self._pushed = False  # sync mode: pushed into a round since the last pull (or the join)
        self.finished = [False] * n  # per server: its job is done (max_versions reached or stopped)
        self._told = False  # a pull returned False
        self.clock_gaps: list[int] = []  # per pull: how far ahead of the slowest worker this one was
        self.conns = []
        try:
            for host, port in self.servers:
                self.conns.append(wire.connect(host, port, key, timeout))
        except wire.AuthError:
            self._close_conns()
            raise
        except OSError as e:
            self._close_conns()
            raise ServerLost(f"servers: cannot connect to {host}:{port}: {e}") from e
        signature = [[name, list(shape)] for name, shape in describe(self.params, self.names)]
        replies = []
        for s in range(n):  # server 0 names the worker, the others take that id
            join = {"op": "join", "signature": signature, "num_servers": n,
                    "wid": wid if s == 0 else replies[0][0]["wid"]}
            try:
                wire.send(self.conns[s], join)
                replies.append(wire.recv(self.conns[s], self._expect_join(s), timeout=None))
            except (wire.PeerLost, wire.BadMessage) as e:
                self._close_conns()
                raise ServerLost(f"server {s} at {self.servers[s][0]}:{self.servers[s][1]} went away during "
                                 f"join: {e}") from e
            if not replies[-1][0]["ok"]:
                self._close_conns()
                raise JoinRefused(replies[-1][0]["error"])
        self.wid = replies[0][0]["wid"]
        staleness = replies[0][0]["staleness"]
        self.mode, self.staleness = replies[0][0]["mode"], math.inf if staleness is None else staleness
        for s, (h, ts) in enumerate(replies):
            self._take(s, h, ts[0])

    # ---- plumbing ----------------------------------------------------------------------

    # What a server's replies may hold (wire.recv checks them before allocating anything).
    def _shard_spec(self, s: int):
        return [(torch.float32, self.layout.shard(s).size)]

    def _expect_join(self, s: int):
        return wire.replies({"ok": wire.TRUE, "wid": wire.WID, "version": wire.COUNT, "mode": wire.one_of(*MODES), "staleness": wire.optional(wire.COUNT),
                             "done": wire.BOOL}, lambda h: self._shard_spec(s))

    def _expect(self, op: str, s: int):
        if op == "pull":
            return wire.replies({"version": wire.COUNT, "changed": wire.BOOL, "done": wire.BOOL,
                                 "clock_gap": wire.INT}, lambda h: self._shard_spec(s) if h["changed"] else [])
        return wire.replies({"accepted": wire.BOOL, "done": wire.BOOL})  # push

    def _shard(self, s: int) -> torch.Tensor:
        off, size = self.layout.shard(s)
        return self.flat[off:off + size]

    def _broadcast(self, header, tensors_of=None) -> None:
        for s, conn in enumerate(self.conns):
            try:
                wire.send(conn, header if not callable(header) else header(s),
                          tensors_of(s) if tensors_of else ())
            except wire.PeerLost as e:
                raise ServerLost(f"server {s} at {self.servers[s][0]}:{self.servers[s][1]} is gone: {e}") from e

    def _gather(self, what: str):
        out = []
        for s, conn in enumerate(self.conns):
            try:
                h, ts = wire.recv(conn, self._expect(what, s), timeout=None)
            except (wire.PeerLost, wire.BadMessage) as e:
                raise ServerLost(f"server {s} at {self.servers[s][0]}:{self.servers[s][1]} went away during "
                                 f"{what}: {e}") from e
            if h.get("ok") is False:
                raise ServerLost(f"server {s} at {self.servers[s][0]}:{self.servers[s][1]} refused the {what}: "
                                 f"{h['error']}")
            out.append((h, ts))
        return out

    def _take(self, s: int, header, shard) -> None:
        with torch.no_grad():
            self._shard(s).copy_(shard)
        self.versions[s] = header["version"]
        self.finished[s] |= bool(header.get("done"))

    @property
    def done(self) -> bool:
        """Every server has finished. (Servers count their own versions: with workers joining a
        synchronous job, one server's rounds may be numbered one ahead of another's; each still
        applies max_versions rounds, every one from all live workers' gradients of one model.)"""
        return all(self.finished)

    # ---- the training loop ------------------------------------------------------------

    def pull(self) -> bool:
        """Bring the parameters up to date (waiting as the servers' mode says); False once the
        job is finished (max_versions reached or the servers stopped), then without asking again
        (a finished server ends once its workers have left: nothing new to learn from it)."""
        if not self.conns or self._told:
            return False
        self._broadcast(lambda s: {"op": "pull", "have": self.versions[s]})
        self._pushed = False
        gaps = []
        for s, (h, ts) in enumerate(self._gather("pull")):
            if h.get("changed"):
                self._take(s, h, ts[0])
            else:
                self.versions[s] = h["version"]
                self.finished[s] |= bool(h.get("done"))
            gaps.append(h.get("clock_gap", 0))
        if not self.done:
            self.clock_gaps.append(max(gaps))
        self._told = self.done  # (every server answered this pull: each has told this worker, with its last shard)
        return not self.done

    def push(self) -> bool:
        """Send this worker's gradients (a parameter without .grad sends zeros) and clear them.
        True if every server still running applied them; False if one rejected them (NaN or
        inf: counted by the server, not applied). In sync mode a round takes one push per worker:
        pull() before pushing again."""
        if not self.conns:
            raise RuntimeError("push: this worker is closed (close() was called, or its join failed); "
                               "make a new Worker to rejoin the job")
        if self.mode == "sync" and self._pushed:
            raise RuntimeError("push: in sync mode each round takes one push per worker, and this worker "
                               "has pushed since its last pull; call pull() (it waits for the round) "
                               "before pushing again")
        grad = torch.zeros(self.layout.padded, dtype=torch.float32)
        for v, p in zip(self.layout.views(grad), self.params):
            if p.grad is not None:
                v.copy_(p.grad)
                p.grad = None
        self._broadcast(lambda s: {"op": "push", "version": self.versions[s]},
                        lambda s: [grad[self.layout.shard(s).offset:][:self.layout.shard_size]])
        self._pushed = True
        accepted = True
        for s, (h, _) in enumerate(self._gather("push")):
            if not self.finished[s]:
                accepted &= bool(h["accepted"])
            self.finished[s] |= bool(h.get("done"))
        return accepted

    def close(self) -> None:
        """Leave the job (the servers stop waiting for this worker)."""
        for conn in self.conns:
            try:
                wire.send(conn, {"op": "leave"})
                wire.recv(conn, wire.replies({"ok": wire.TRUE}), timeout=5.0)
            except (wire.PeerLost, wire.BadMessage, TimeoutError):
                pass
        self._close_conns()

    def _close_conns(self) -> None:
        for conn in self.conns:
            conn.close()
        self.conns = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _is_address(a) -> bool:
    return (isinstance(a, (list, tuple)) and len(a) == 2 and isinstance(a[0], str)
            and isinstance(a[1], int) and not isinstance(a[1], bool))


def request(address, op: str, timeout: float = 30.0, key: bytes | str | None = None) -> dict:
    """Send a control request ("stats" or "stop") to the server at `address` without joining.
    ``key``: the job's key (default PYZERO_PS_KEY, else the one in the job's store)."""
    if op not in ("stats", "stop"):
        raise ValueError(f"op: expected 'stats' or 'stop', got {op!r}")
    key = wire.resolve_key(key)
    if key is None:
        from .rendezvous import job_key  # noqa: PLC0415

        key = job_key(create=False, timeout=timeout)
    conn = wire.connect(*address, key, timeout)
    expect = (lambda h: (wire.check_any(h, "stats reply"), [])[1]) if op == "stats" else \
        wire.replies({"stopped": wire.TRUE})
    try:
        wire.send(conn, {"op": op})
        return wire.recv(conn, expect, timeout=timeout)[0]
    finally:
        conn.close()
