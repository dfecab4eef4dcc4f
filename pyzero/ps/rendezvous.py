"""Where the servers are: each server publishes its address in a key-value store
(torch.distributed.TCPStore at MASTER_ADDR:MASTER_PORT, hosted by server 0);
workers, including ones that join later, read it from there."""
from __future__ import annotations

import ipaddress
import os
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


def publish(index: int, port: int, timeout: float = 60.0) -> None:
    store(host_it=index == 0, timeout=timeout).set(f"pyzero_ps/server{index}", f"{advertised_host()}:{port}")


def lookup(num_servers: int, timeout: float = 60.0) -> list[tuple[str, int]]:
    st = store(host_it=False, timeout=timeout)
    keys = [f"pyzero_ps/server{s}" for s in range(num_servers)]
    st.wait(keys, timedelta(seconds=timeout))
    out = []
    for k in keys:
        host, port = st.get(k).decode().rsplit(":", 1)
        out.append((host, int(port)))
    return out
