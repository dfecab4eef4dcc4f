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

import torch
from torch import nn

from ..zero.partition import FlatLayout, trainable
from . import wire
from .server import describe


class ServerLost(RuntimeError):
    """A parameter server stopped answering (died or was stopped): the job must restart."""


class JoinRefused(ValueError):
    """The servers refused this worker (another model, another number of servers)."""


class Worker:
    """One worker of a parameter-server job (see the module docstring)."""

    def __init__(self, model: nn.Module, servers=None, num_servers: int | None = None, wid: int | None = None,
                 timeout: float = 60.0):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if servers is None:
            if num_servers is None:
                raise ValueError("servers/num_servers: give the servers' (host, port) list or their number "
                                 "(then they are looked up in the job's store, MASTER_ADDR/MASTER_PORT)")
            from .rendezvous import lookup  # noqa: PLC0415

            servers = lookup(num_servers, timeout)
        self.servers = [tuple(a) for a in servers]
        self.model, self.timeout = model, timeout
        self.params, self.names = trainable(model)
        bad = [n for n, p in zip(self.names, self.params) if p.dtype != torch.float32 or p.device.type != "cpu"]
        if bad:
            raise ValueError(f"model: parameter-server workers train fp32 CPU parameters, got {bad[:3]} "
                             f"({self.params[self.names.index(bad[0])].dtype})")
        n = len(self.servers)
        self.layout = FlatLayout(self.params, self.names, n)
        self.flat = torch.zeros(self.layout.padded, dtype=torch.float32)
        for v, p in zip(self.layout.views(self.flat), self.params):
            v.copy_(p.detach())
            p.data = v
        self.versions = [0] * n
        self.finished = [False] * n  # per server: its job is done (max_versions reached or stopped)
        self.clock_gaps: list[int] = []  # per pull: how far ahead of the slowest worker this one was
        self.conns = []
        try:
            for host, port in self.servers:
                self.conns.append(wire.connect(host, port))
        except OSError as e:
            self._close_conns()
            raise ServerLost(f"servers: cannot connect to {host}:{port}: {e}") from e
        signature = [(name, list(shape)) for name, shape in describe(self.params, self.names)]
        replies = []
        for s in range(n):  # server 0 names the worker, the others take that id
            join = {"op": "join", "signature": signature, "num_servers": n,
                    "wid": wid if s == 0 else replies[0][0]["wid"]}
            try:
                wire.send(self.conns[s], join)
                replies.append(wire.recv(self.conns[s], timeout=None))
            except wire.PeerLost as e:
                self._close_conns()
                raise ServerLost(f"server {s} at {self.servers[s][0]}:{self.servers[s][1]} went away during "
                                 f"join: {e}") from e
            if not replies[-1][0].get("ok"):
                self._close_conns()
                raise JoinRefused(replies[-1][0]["error"])
        self.wid = replies[0][0]["wid"]
        self.mode, self.staleness = replies[0][0]["mode"], replies[0][0]["staleness"]
        for s, (h, ts) in enumerate(replies):
            self._take(s, h, ts[0])

    # ---- plumbing ----------------------------------------------------------------------

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
                out.append(wire.recv(conn, timeout=None))
            except wire.PeerLost as e:
                raise ServerLost(f"server {s} at {self.servers[s][0]}:{self.servers[s][1]} went away during "
                                 f"{what}: {e}") from e
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
        job is finished (max_versions reached or the servers stopped)."""
        if not self.conns:
            return False
        self._broadcast(lambda s: {"op": "pull", "have": self.versions[s]})
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
        return not self.done

    def push(self) -> bool:
        """Send this worker's gradients (a parameter without .grad sends zeros) and clear them.
        True if every server still running applied them; False if one rejected them (NaN or
        inf: counted by the server, not applied)."""
        grad = torch.zeros(self.layout.padded, dtype=torch.float32)
        for v, p in zip(self.layout.views(grad), self.params):
            if p.grad is not None:
                v.copy_(p.grad)
                p.grad = None
        self._broadcast(lambda s: {"op": "push", "version": self.versions[s]},
                        lambda s: [grad[self.layout.shard(s).offset:][:self.layout.shard_size]])
        accepted = True
        for s, (h, _) in enumerate(self._gather("push")):
            if "error" in h:
                raise ValueError(h["error"])
            if not self.finished[s]:
                accepted &= bool(h["accepted"])
            self.finished[s] |= bool(h.get("done"))
        return accepted

    def close(self) -> None:
        """Leave the job (the servers stop waiting for this worker)."""
        for conn in self.conns:
            try:
                wire.send(conn, {"op": "leave"})
                wire.recv(conn, timeout=5.0)
            except (wire.PeerLost, TimeoutError):
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


def request(address, op: str, timeout: float = 30.0) -> dict:
    """Send a control request ("stats" or "stop") to the server at `address` without joining."""
    conn = wire.connect(*address)
    try:
        wire.send(conn, {"op": op})
        return wire.recv(conn, timeout=timeout)[0]
    finally:
        conn.close()
