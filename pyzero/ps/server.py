"""A parameter server: one shard of the model's parameters and its optimizer.

The trainable parameters are laid end to end and cut into one equal shard per
server (zero.partition.FlatLayout, ZeRO's partitioning), so every server holds
and updates the same amount. Workers push gradient shards and pull parameter
shards (wire.py). One thread per connected worker; one lock guards the shard.

Training starts once ``wait_for_workers`` workers have joined (pulls wait for
it); later joins and departures never wait. Consistency (``mode``):
  "sync"     a version is one round: the server waits for a push from every
             live worker, averages them (in worker-id order), steps, and only
             then answers the pulls of the round's workers. Equals DataParallel.
  "bounded"  every push is applied at once; a worker's pull for its next
             iteration waits while it is more than ``staleness`` pushes ahead of
             the slowest live worker (stale synchronous parallel).
  "async"    every push is applied at once, pulls never wait.

A worker that dies (EOF on its connection, or no message for ``worker_timeout``
seconds) is dropped: in sync mode its push for the unfinished round is
forgotten and the round completes with the others. A push with NaN or inf is
rejected and counted (``stats()["rejected_nonfinite"]``); in sync mode the
round averages the finite pushes. Checkpoints (``checkpoint_dir``) are
written atomically (temporary file, fsync, rename) every ``checkpoint_every``
versions and at the end; a server started with an existing checkpoint resumes
from it.
"""
from __future__ import annotations

import logging
import math
import os
import threading
import time

import torch
from torch import nn

from .. import optim as pz_optim
from ..zero.partition import FlatLayout, trainable
from . import wire
from ..checks import is_int, is_positive_finite

MODES = ("sync", "bounded", "async")
log = logging.getLogger("pyzero.ps")
MAX_HANDSHAKES = 64  # connections authenticating at once; more are closed at once

# What a server accepts from a connection (wire.check_fields): op -> fields. A push's gradient must
# be one float32 shard of this server's size; nothing else carries tensors.
REQUESTS = {
    "join": {"op": wire.one_of("join"), "signature": wire.SIGNATURE, "num_servers": wire.COUNT,
             "wid": wire.optional(wire.WID)},
    "pull": {"op": wire.one_of("pull"), "have": wire.COUNT},
    "push": {"op": wire.one_of("push"), "version": wire.COUNT},
    "leave": {"op": wire.one_of("leave")},
    "stats": {"op": wire.one_of("stats")},
    "stop": {"op": wire.one_of("stop")},
}


def describe(params, names) -> list[tuple[str, tuple[int, ...]]]:
    return [(n, tuple(p.shape)) for n, p in zip(names, params)]


def check_idle_timeout(idle_timeout) -> None:
    if idle_timeout is not None and not is_positive_finite(idle_timeout):
        raise ValueError(f"idle_timeout: expected None or a positive number of seconds, got {idle_timeout!r}")


def check_num_servers(num_servers) -> None:
    """The job's server count, as Server, Worker and the module's functions take it."""
    if not is_int(num_servers) or num_servers < 1:
        raise ValueError(f"num_servers: expected an int >= 1, got {num_servers!r}")


class _Peer:
    def __init__(self, wid: int, clock: int):
        self.wid, self.clock, self.alive = wid, clock, True
        self.round = -1  # sync: the round (version) its last push went into


class Server:
    """Shard ``index`` of ``num_servers`` of `model`'s parameters, updated by ``optimizer_class``."""

    def __init__(self, model: nn.Module, optimizer_class, index: int, num_servers: int, mode: str = "sync",
                 staleness: int = 0, max_versions: int | None = None, checkpoint_dir: str | None = None,
                 checkpoint_every: int = 100, worker_timeout: float = 300.0, wait_for_workers: int = 1,
                 fast_optimizer: bool = True, key: bytes | str | None = None, **optimizer_kwargs):
        if not isinstance(model, nn.Module):
            raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
        if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, torch.optim.Optimizer)):
            got = (f"an optimizer built already ({type(optimizer_class).__name__}; pass the class and its arguments)"
                   if isinstance(optimizer_class, torch.optim.Optimizer) else repr(optimizer_class))
            raise TypeError(f"optimizer_class: expected a torch.optim.Optimizer subclass, got {got}")
        check_num_servers(num_servers)
        if not is_int(index) or not 0 <= index < num_servers:
            raise ValueError(f"index: expected 0 <= index < num_servers={num_servers}, got {index!r}")
        if mode not in MODES:
            raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
        if mode == "bounded" and (not is_int(staleness) or staleness < 0):
            raise ValueError(f"staleness: expected an int >= 0 for mode='bounded', got {staleness!r}")
        if mode != "bounded" and staleness != 0:
            raise ValueError(f"staleness: applies to mode='bounded' only (mode={mode!r} "
                             f"{'waits for every worker' if mode == 'sync' else 'never waits'}), got {staleness!r}")
        if max_versions is not None and (not is_int(max_versions) or max_versions < 1):
            raise ValueError(f"max_versions: expected None or an int >= 1, got {max_versions!r}")
        if not is_int(wait_for_workers) or wait_for_workers < 1:
            raise ValueError(f"wait_for_workers: expected an int >= 1, got {wait_for_workers!r}")
        if not is_int(checkpoint_every) or checkpoint_every < 1:
            raise ValueError(f"checkpoint_every: expected an int >= 1, got {checkpoint_every!r}")
        if not is_positive_finite(worker_timeout):
            raise ValueError(f"worker_timeout: expected a positive number of seconds, got {worker_timeout!r}")
        # The job's key: given, else PYZERO_PS_KEY, else a fresh random one (serve() hands a job's
        # servers the one key server 0 put in the job's store; a Server made by hand passes
        # server.key to its workers).
        self.key = wire.resolve_key(key) or wire.new_key()
        params, names = trainable(model)
        self.signature = describe(params, names)
        self.layout = FlatLayout(params, names, num_servers)
        off, n = self.layout.shard(index)
        flat = torch.zeros(self.layout.padded, dtype=torch.float32)
        for v, p in zip(self.layout.views(flat), params):
            v.copy_(p.detach())
        self.index, self.num_servers, self.mode = index, num_servers, mode
        self.staleness = staleness if mode == "bounded" else (0 if mode == "sync" else math.inf)
        self.max_versions, self.worker_timeout = max_versions, worker_timeout
        self.wait_for_workers = wait_for_workers
        self.master = nn.Parameter(flat[off:off + n].clone())
        if fast_optimizer:  # torch's AdamW/Adam/SGD/Adagrad -> pyzero's fused CPU step (same results)
            optimizer_class = pz_optim.fast_equivalent(optimizer_class)
        self.optimizer = optimizer_class([self.master], **optimizer_kwargs)
        self.version = 0
        self.checkpoint_dir, self.checkpoint_every = checkpoint_dir, checkpoint_every
        self.resumed_from = self._resume() if checkpoint_dir else None
        self._cond = threading.Condition()
        self._peers: dict[int, _Peer] = {}
        self._pending: dict[int, torch.Tensor | None] = {}  # sync: this round's pushes by worker id
        self._next_wid = 0
        self._stopped = False
        self._conns: set = set()  # the open connections (closed when serve() ends)
        self.counters = {"pushes": 0, "applied": 0, "rejected_nonfinite": 0, "dropped_dead": 0, "joined": 0,
                         "left": 0, "died": 0, "max_staleness": 0, "max_clock_gap": 0, "pulls": 0,
                         "bad_messages": 0, "refused_auth": 0, "rejected_repeat": 0}
        self._listener, self._bound = None, None

    # ---- state ------------------------------------------------------------------

    def _path(self) -> str:
        return os.path.join(self.checkpoint_dir, f"server{self.index:03d}.pt")

    def _resume(self) -> int | None:
        os.makedirs(self.checkpoint_dir, exist_ok=True)
        if not os.path.exists(self._path()):
            return None
        ck = torch.load(self._path(), map_location="cpu", weights_only=True)
        ok = (type(ck) is dict and type(ck.get("version")) is int and ck["version"] >= 0
              and type(ck.get("num_servers")) is int and torch.is_tensor(ck.get("master"))
              and type(ck.get("optimizer")) is dict and type(ck.get("signature")) is list
              and all(type(e) in (list, tuple) and len(e) == 2 for e in ck["signature"]))
        if not ok:
            raise ValueError(f"checkpoint_dir: {self._path()} is not a pz.ps server checkpoint (fields "
                             "version, num_servers, master, optimizer, signature); use an empty directory")
        if ck["num_servers"] != self.num_servers or [(n, tuple(s)) for n, s in ck["signature"]] != self.signature:
            raise ValueError(f"checkpoint_dir: {self._path()} was written for another model or number of servers "
                             f"({ck['num_servers']} servers); use an empty directory")
        if ck["master"].shape != self.master.shape or ck["master"].dtype != torch.float32:
            raise ValueError(f"checkpoint_dir: {self._path()} holds a shard of {tuple(ck['master'].shape)} "
                             f"{ck['master'].dtype}, this server's is ({self.master.numel()},) float32")
        with torch.no_grad():
            self.master.copy_(ck["master"])
        self.optimizer.load_state_dict(ck["optimizer"])
        self.version = int(ck["version"])
        return self.version

    def save(self) -> str:
        """Write this shard (values, optimizer state, version) atomically; returns the path."""
        path, tmp = self._path(), self._path() + ".tmp"
        obj = {"version": self.version, "master": self.master.detach().clone(),
               "optimizer": self.optimizer.state_dict(), "num_servers": self.num_servers,
               "signature": [(n, list(s)) for n, s in self.signature]}
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.checkpoint_dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return path

    def stats(self) -> dict:
        with self._cond:
            live = [p.wid for p in self._peers.values() if p.alive]
            addr = None if self._bound is None else "%s:%d" % self._bound
            return dict(self.counters, version=self.version, live_workers=live, mode=self.mode, address=addr,
                        staleness=self.staleness, resumed_from=self.resumed_from,
                        optimizer=f"{type(self.optimizer).__module__}.{type(self.optimizer).__name__}")

    # ---- updates (called with the lock held) --------------------------------------

    def _live(self) -> list[_Peer]:
        return [p for p in self._peers.values() if p.alive]

    def _finished(self) -> bool:
        return self._stopped or (self.max_versions is not None and self.version >= self.max_versions)

    def _apply(self, grad: torch.Tensor | None) -> None:
        if grad is not None:
            self.master.grad = grad
            self.optimizer.step()
            self.master.grad = None
            self.counters["applied"] += 1
        self.version += 1
        if self.checkpoint_dir and (self.version % self.checkpoint_every == 0 or self._finished()):
            self.save()
        self._cond.notify_all()

    def _maybe_close_round(self) -> None:
        """sync: the round completes once every live worker has pushed into it."""
        live = self._live()
        if not self._started() or not self._pending or any(p.wid not in self._pending for p in live):
            return
        grads = [self._pending[w] for w in sorted(self._pending) if self._pending[w] is not None]
        mean = None
        if grads:
            mean = grads[0].clone()
            for g in grads[1:]:
                mean.add_(g)
            mean.div_(len(grads))
        self._pending.clear()
        self._apply(mean)

    def _started(self) -> bool:
        """Training starts once wait_for_workers workers have joined (then never waits for it again)."""
        return self.counters["joined"] >= self.wait_for_workers

    def _min_clock(self) -> int:
        return min((p.clock for p in self._live()), default=0)

    # ---- one connection ---------------------------------------------------------------

    def _join(self, conn, header) -> _Peer | None:
        theirs = [(n, tuple(s)) for n, s in header["signature"]]
        if theirs != self.signature:
            mine = dict(self.signature)
            diff = [f"{n}: worker {tuple(s)}, server {mine.get(n)}" for n, s in theirs if mine.get(n) != tuple(s)]
            diff += [f"{n}: missing on the worker" for n in mine if n not in dict(theirs)]
            wire.send(conn, {"ok": False, "error": f"model: the worker's parameters do not match server "
                                                    f"{self.index}'s ({'; '.join(diff[:4])})"})
            return None
        if header["num_servers"] != self.num_servers:
            wire.send(conn, {"ok": False, "error": f"num_servers: the worker expects {header['num_servers']} "
                                                    f"servers, the job has {self.num_servers}"})
            return None
        with self._cond:
            wid = header.get("wid")
            if wid is None or wid in self._peers and self._peers[wid].alive:
                wid = max([self._next_wid] + [w + 1 for w in self._peers])
            self._next_wid = max(self._next_wid, wid + 1)
            peer = _Peer(wid, self._min_clock() if self._live() else 0)
            self._peers[wid] = peer
            self.counters["joined"] += 1
            self._cond.notify_all()
            shard, version = self.master.detach().clone(), self.version
        wire.send(conn, {"ok": True, "wid": wid, "version": version, "mode": self.mode,
                         "staleness": wire.finite_or_none(self.staleness), "done": self._finished()}, [shard])
        return peer

    def _pull(self, conn, peer, header) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._finished() or self._started())
            if self.mode == "sync":
                # the round this worker pushed into must be applied first
                self._cond.wait_for(lambda: self._finished() or self.version > peer.round)
            else:
                self._cond.wait_for(lambda: self._finished() or peer.clock - self._min_clock() <= self.staleness)
            gap = peer.clock - self._min_clock()
            if not self._finished():  # a finished job releases every pull, whatever the gap
                self.counters["max_clock_gap"] = max(self.counters["max_clock_gap"], gap)
            self.counters["pulls"] += 1
            changed = self.version != header["have"]
            shard = self.master.detach().clone() if changed else None
            reply = {"version": self.version, "changed": changed, "done": self._finished(), "clock_gap": gap}
        wire.send(conn, reply, [shard] if changed else [])

    def _push(self, conn, peer, header, grad) -> None:
        finite = bool(torch.isfinite(grad).all())
        with self._cond:
            self.counters["pushes"] += 1
            if not finite:
                self.counters["rejected_nonfinite"] += 1
            if self._finished():
                accepted = False
            elif self.mode == "sync" and peer.wid in self._pending:  # a second push into the open round:
                self.counters["rejected_repeat"] += 1                  # the first stands (one per worker)
                accepted = False
            elif self.mode == "sync":
                peer.round = self.version
                self._pending[peer.wid] = grad if finite else None
                peer.clock += 1
                self._maybe_close_round()
                accepted = finite
            else:
                self.counters["max_staleness"] = max(self.counters["max_staleness"],
                                                     self.version - header["version"])
                peer.clock += 1
                if finite:
                    self._apply(grad)
                else:
                    self._cond.notify_all()  # the clock moved
                accepted = finite
        wire.send(conn, {"accepted": accepted, "done": self._finished()})

    def _drop(self, peer: _Peer, died: bool) -> None:
        with self._cond:
            if not peer.alive:
                return
            peer.alive = False
            self.counters["died" if died else "left"] += 1
            if died and peer.wid in self._pending:
                del self._pending[peer.wid]
                self.counters["dropped_dead"] += 1
            if self.mode == "sync":
                self._maybe_close_round()
            self._cond.notify_all()

    def _expect(self, header) -> list:
        """wire.recv's check of a request: a known op with exactly its fields; a push carries one
        float32 shard of this server's size."""
        op = header.get("op")
        if type(op) is not str or op not in REQUESTS:  # (a list or dict is no key: not a TypeError here)
            raise wire.BadMessage(f"op: expected one of {sorted(REQUESTS)}, got {wire._short(op)}")
        wire.check_fields(header, REQUESTS[op], op)
        return [(torch.float32, self.master.numel())] if op == "push" else []

    def _serve_connection(self, sock, addr, gate) -> None:
        peer, conn = None, None
        try:
            try:
                conn = wire.accept(sock, addr, self.key)
                with self._cond:
                    self._conns.add(conn)
            except wire.AuthError as e:
                with self._cond:
                    self.counters["refused_auth"] += 1
                log.warning("pz.ps server %d: refused a connection: %s", self.index, e)
                return
            finally:
                gate.release()
            while True:
                header, tensors = wire.recv(conn, self._expect,
                                            timeout=self.worker_timeout if peer is not None else 30.0)
                op = header["op"]
                if op == "join":
                    if peer is not None:
                        raise wire.BadMessage("join: this connection has joined already")
                    peer = self._join(conn, header)
                    if peer is None:
                        log.warning("pz.ps server %d: refused a worker from %s (another model or number of "
                                    "servers)", self.index, conn.peer)
                        return
                elif op == "stats":
                    st = {k: wire.finite_or_none(v) for k, v in self.stats().items()}
                    wire.send(conn, st)
                elif op == "stop":
                    self.stop()
                    wire.send(conn, {"stopped": True})
                elif peer is None:
                    wire.send(conn, {"ok": False, "error": f"{op!r} before join"})
                    return
                elif op == "pull":
                    self._pull(conn, peer, header)
                elif op == "push":
                    self._push(conn, peer, header, tensors[0])
                else:  # leave
                    self._drop(peer, died=False)
                    peer = None
                    wire.send(conn, {"ok": True})
                    return
        except wire.BadMessage as e:
            with self._cond:
                self.counters["bad_messages"] += 1
            log.warning("pz.ps server %d: closed the connection from %s: %s", self.index, conn.peer, e)
            try:  # tell an honest peer with a bug why (it may still be sending: best effort)
                wire.send(conn, {"ok": False, "error": f"server {self.index}: {e}"})
            except (wire.PeerLost, OSError):
                pass
        except (wire.PeerLost, TimeoutError):
            pass  # the worker died, hung, or closed without leaving: drop it
        finally:
            if peer is not None:
                self._drop(peer, died=True)
            if conn is not None:
                with self._cond:
                    self._conns.discard(conn)
                conn.close()

    # ---- the server loop --------------------------------------------------------------

    def bind(self, host: str = "127.0.0.1", port: int = 0) -> tuple[str, int]:
        """Listen on (host, port); the default is loopback only. serve() binds the address the job
        advertises (rendezvous.advertised_host()), or the one it is given."""
        self._listener = wire.Listener(host, port)
        self._bound = self._listener.address
        return self._bound

    @property
    def address(self) -> tuple[str, int] | None:
        """(host, port) this server listens on (None before bind)."""
        return self._bound

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify_all()

    def serve(self, idle_timeout: float | None = None) -> dict:
        """Accept workers until the job is finished (``stop()``, a stop request, or max_versions
        reached) and every worker has gone (each is told by its next pull, then leaves); returns
        stats(). ``idle_timeout``: also stop after that many seconds without any live worker."""
        check_idle_timeout(idle_timeout)
        if self._listener is None:
            self.bind()
        threads = []
        stop_accepting = threading.Event()
        gate = threading.BoundedSemaphore(MAX_HANDSHAKES)

        def accept_loop():
            while not stop_accepting.is_set():
                try:
                    got = self._listener.accept()
                except OSError:
                    if stop_accepting.is_set():
                        return
                    continue
                if got is None:
                    continue
                sock, addr = got
                if stop_accepting.is_set() or not gate.acquire(blocking=False):
                    sock.close()  # stopping, or too many connections still authenticating
                    continue
                t = threading.Thread(target=self._serve_connection, args=(sock, addr, gate), daemon=True)
                t.start()
                threads[:] = [x for x in threads if x.is_alive()] + [t]

        acceptor = threading.Thread(target=accept_loop, daemon=True)
        acceptor.start()
        idle_since = time.monotonic()
        with self._cond:
            while True:
                live = self._live()
                if live:
                    idle_since = time.monotonic()
                # Finished (stopped, or max_versions reached after a worker joined): once every worker
                # has gone (left after its pull said so, died, or silent for worker_timeout), so that
                # each is told by its next pull, whenever that comes; another server may be a version
                # behind and still want the worker's pushes.
                if self._finished() and not live and (self._stopped or self.counters["joined"] > 0):
                    break
                if idle_timeout is not None and not live and time.monotonic() - idle_since > idle_timeout:
                    break
                self._cond.wait(0.1)
            self._stopped = True
            self._cond.notify_all()
        if self.checkpoint_dir:
            with self._cond:
                self.save()
        stop_accepting.set()
        acceptor.join(5)
        self._listener.close()
        with self._cond:
            conns = list(self._conns)
        for conn in conns:  # (what is still open: peers that never joined, a stats or stop request in flight)
            conn.close()
        deadline = time.monotonic() + 5
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
        return self.stats()
