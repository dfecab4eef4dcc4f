"""Where the servers are, and the job's key: each server publishes its address in a key-value
store (torch.distributed.TCPStore at MASTER_ADDR:MASTER_PORT, hosted by server 0), and server 0
puts a random key for the job there; workers, including ones that join later, read both from it.
(The store is trusted as torch.distributed trusts it: whoever reaches it is part of the job.)"""
from __future__ import annotations

import ipaddress
import os
import re
import socket
from datetime import timedelta

import torch.distributed as dist

_STORES: dict = {}


def store(host_it: bool, timeout: float = 60.0):
    """The job's store (server 0 hosts it); torchrun's MASTER_ADDR / MASTER_PORT."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port:
        raise RuntimeError("MASTER_ADDR/MASTER_PORT: not set; start the job with torchrun or pyzero.launch, "
                           "or give the servers' addresses explicitly")
    key = (addr, int(port), host_it, os.getpid())  # a forked child opens its own connection
    if key not in _STORES:
        _STORES[key] = dist.TCPStore(addr, int(port), is_master=host_it, timeout=timedelta(seconds=timeout),
                                     wait_for_workers=False)
    return _STORES[key]


def advertised_host() -> str:
    """The host name workers use to reach this server: PYZERO_PS_HOST, else loopback when the
    job's master is local, else this machine's name."""
    if os.environ.get("PYZERO_PS_HOST"):
        return os.environ["PYZERO_PS_HOST"]
    master = os.environ.get("MASTER_ADDR", "127.0.0.1")
    try:
        if master == "localhost" or ipaddress.ip_address(master).is_loopback:
            return "127.0.0.1"
    except ValueError:
        pass
    return socket.getfqdn()


KEY = "pyzero_ps/key"


def job_key(create: bool, timeout: float = 60.0) -> bytes:
    """The job's random key from the store; server 0 (`create`) makes it if the store has none yet."""
    from .wire import new_key  # noqa: PLC0415

    st = store(host_it=create, timeout=timeout)
    if create:
        value = st.compare_set(KEY, "", new_key().hex())  # a key already there (a restarted server) stays
    else:
        st.wait([KEY], timedelta(seconds=timeout))
        value = st.get(KEY)
    value = value.decode(errors="replace") if isinstance(value, bytes) else str(value)
    if not re.fullmatch(r"[0-9a-f]{64}", value):
        raise ValueError(f"store: {KEY!r} holds {value[:20]!r}..., not a pz.ps job key (64 hex digits)")
    return bytes.fromhex(value)


def _address(key: str, raw: bytes) -> tuple[str, int]:
    """A published "host:port", checked."""
    text = raw.decode(errors="replace")
    host, _, port = text.rpartition(":")
    if not host or len(host) > 255 or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"store: {key!r} holds {text[:60]!r}, not a server's host:port")
    return host, int(port)


def publish(index: int, port: int, timeout: float = 60.0, host: str | None = None) -> None:
    """Server `index`'s address in the job's store: `host` (the address it bound, unless a wildcard, which no
    worker can connect to) or the advertised one, and `port`."""
    where = host if host not in (None, "", "0.0.0.0", "::") else advertised_host()
    store(host_it=index == 0, timeout=timeout).set(f"pyzero_ps/server{index}", f"{where}:{port}")


def lookup(num_servers: int, timeout: float = 60.0) -> list[tuple[str, int]]:
    st = store(host_it=False, timeout=timeout)
    keys = [f"pyzero_ps/server{s}" for s in range(num_servers)]
    st.wait(keys, timedelta(seconds=timeout))
    return [_address(k, st.get(k)) for k in keys]
