"""Parameter-server training: sharded servers, workers that come and go.

Servers hold the parameters sharded (ZeRO's flat partition) with the optimizer
state and step as pushes arrive; workers pull parameters, compute gradients
on their own data and push them. Modes: "sync" (equals DataParallel),
"bounded" (stale synchronous parallel, at most ``staleness`` pushes ahead of
the slowest live worker) and "async". Workers may join at any time and leave
or die at any time; servers checkpoint atomically and resume.

    role, index = pz.ps.role(num_servers=2)      # torchrun: ranks 0..1 serve, the rest work
    if role == "server":
        pz.ps.serve(model, torch.optim.AdamW, num_servers=2, mode="bounded", staleness=2,
                    max_versions=1000, checkpoint_dir="ps_ckpt", lr=1e-3)
    else:
        w = pz.ps.Worker(model, num_servers=2)
        while w.pull():
            loss_fn(model(x), y).backward()
            w.push()
        w.close()
"""
from __future__ import annotations

import os

from .server import MODES, Server, check_num_servers
from .wire import AuthError, BadMessage, PeerLost, resolve_key
from .worker import JoinRefused, ServerLost, Worker, request

__all__ = ["MODES", "Server", "Worker", "ServerLost", "JoinRefused", "PeerLost", "AuthError", "BadMessage", "serve",
           "role", "stats", "stop"]


def role(num_servers: int) -> tuple[str, int]:
    """("server", i) for RANK < num_servers, else ("worker", RANK - num_servers)."""
    check_num_servers(num_servers)
    rank = int(os.environ.get("RANK", "0"))
    return ("server", rank) if rank < num_servers else ("worker", rank - num_servers)


def serve(model, optimizer_class, num_servers: int, index: int | None = None, port: int = 0,
          idle_timeout: float | None = None, host: str | None = None, key: bytes | str | None = None,
          **kwargs) -> dict:
    """Run server `index` (default: RANK) of the job until it finishes; returns its stats().

    It listens on `host` (default: the address the job advertises, rendezvous.advertised_host():
    PYZERO_PS_HOST, else loopback when MASTER_ADDR is a loopback address or unset, else this machine's
    name; never every interface unless asked with host="0.0.0.0") and publishes its address in the job's store.
    Workers authenticate with `key` (default PYZERO_PS_KEY, else a random key server 0 puts in
    the job's store). kwargs: Server's."""
    from .rendezvous import advertised_host, job_key, publish  # noqa: PLC0415
    from .server import check_idle_timeout  # noqa: PLC0415

    check_idle_timeout(idle_timeout)  # before the server listens and publishes its address
    index = int(os.environ.get("RANK", "0")) if index is None else index
    key = resolve_key(key) or job_key(create=index == 0)
    server = Server(model, optimizer_class, index, num_servers, key=key, **kwargs)
    _, bound = server.bind(advertised_host() if host is None else host, port)
    publish(index, bound, host=host)  # (the address it listens on, where workers can reach it)
    return server.serve(idle_timeout=idle_timeout)


def stats(num_servers: int) -> list[dict]:
    """Every server's counters (version, live workers, staleness seen, rejected pushes, ...)."""
    from .rendezvous import lookup  # noqa: PLC0415

    check_num_servers(num_servers)
    return [request(a, "stats") for a in lookup(num_servers)]


def stop(num_servers: int) -> None:
    """Ask every server to finish: each worker's next pull returns False, and a server's serve()
    returns once its workers have left (close()), died, or been silent for worker_timeout."""
    from .rendezvous import lookup  # noqa: PLC0415

    check_num_servers(num_servers)
    for a in lookup(num_servers):
        request(a, "stop")
