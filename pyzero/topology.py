"""Which ranks share a host: exchanged through the job's store at ``pz.init()``.

Each rank names its host (``PYZERO_HOST`` when set, else the hostname and
torchrun's node rank) and
the number of ranks its launcher started there (``LOCAL_WORLD_SIZE``, which
torchrun sets per host); every rank reads every other's and builds the same
:class:`Topology`. Hosts are numbered by their lowest rank; a rank's local
index is its position among its host's ranks, in rank order.

``PYZERO_HOST`` lets tests simulate several hosts on one machine (set it in
each rank, e.g. ``f"host{rank // 2}"`` for two ranks per host) and lets a
cluster name hosts when hostnames are not unique. Ranks that report the same
host but disagree with the count of ranks found there fail at init, on every
rank, with the host and the ranks named.

This module imports nothing of pyzero.
"""
from __future__ import annotations

import datetime
import json
import os
import socket
import time
from dataclasses import dataclass
from typing import NamedTuple


def host_name() -> str:
    """This process's host identity: ``PYZERO_HOST``, else the hostname, followed by torchrun's node
    rank (``GROUP_RANK``) when set, so that two torchrun agents on one machine are two hosts."""
    name = os.environ.get("PYZERO_HOST", "").strip()
    if name:
        return name
    node = os.environ.get("GROUP_RANK")
    return socket.gethostname() + (f"#{node}" if node is not None else "")


def claimed_local_size() -> int | None:
    """LOCAL_WORLD_SIZE (the ranks the launcher started on this host), None when not set."""
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r}: expected an integer") from None
    if not 1 <= value <= 1 << 20:
        raise ValueError(f"LOCAL_WORLD_SIZE={raw!r}: expected a positive number of ranks (at most {1 << 20})")
    return value


@dataclass(frozen=True)
class Topology:
    """Who is where. ``hosts[h]`` is the tuple of global ranks on host h (rank order)."""

    hosts: tuple[tuple[int, ...], ...]
    names: tuple[str, ...]  # host h's name
    rank: int  # this process's global rank

    @property
    def num_hosts(self) -> int:
        return len(self.hosts)

    @property
    def world_size(self) -> int:
        return sum(len(h) for h in self.hosts)

    def host_of(self, rank: int) -> int:
        for h, ranks in enumerate(self.hosts):
            if rank in ranks:
                return h
        raise ValueError(f"rank={rank}: expected a rank in [0, {self.world_size})")

    def local_index(self, rank: int) -> int:
        return self.hosts[self.host_of(rank)].index(rank)

    @property
    def host(self) -> int:
        """This rank's host index."""
        return self.host_of(self.rank)

    @property
    def local_rank(self) -> int:
        """This rank's index among its host's ranks."""
        return self.local_index(self.rank)

    @property
    def local_ranks(self) -> tuple[int, ...]:
        """The global ranks on this rank's host."""
        return self.hosts[self.host]

    def spans_hosts(self, ranks) -> bool:
        return len({self.host_of(r) for r in ranks}) > 1

    def as_dict(self) -> dict:
        return {"hosts": [list(h) for h in self.hosts], "names": list(self.names), "rank": self.rank,
                "host": self.host, "local_rank": self.local_rank}


def group_hosts(reports: list[tuple], rank: int) -> Topology:
    """The topology from every rank's (host name, claimed ranks on its host[, its LOCAL_RANK]), None for
    what a rank does not claim; ValueError where a host's ranks disagree with what is found there (the
    count of its ranks, or two of them, or one past the count, claiming a local rank: two ranks would pick
    one GPU)."""
    by_name: dict[str, list[int]] = {}
    for r, report in enumerate(reports):
        by_name.setdefault(report[0], []).append(r)
    problems = []
    for name, ranks in by_name.items():
        found = f"{len(ranks)} rank" + ("s" if len(ranks) > 1 else "")
        claims = {reports[r][1] for r in ranks} - {None}
        if claims and claims != {len(ranks)}:
            detail = ", ".join(f"rank {r}: LOCAL_WORLD_SIZE={reports[r][1]}" for r in ranks)
            problems.append(f"host {name!r} has ranks {ranks} ({found}) but its ranks claim {detail}")
        by_local: dict[int, list[int]] = {}
        for r in ranks:
            local = reports[r][2] if len(reports[r]) > 2 else None
            if local is not None:
                by_local.setdefault(local, []).append(r)
        for local, claimants in sorted(by_local.items()):
            if len(claimants) > 1:
                problems.append(f"host {name!r}: ranks {claimants} all claim LOCAL_RANK={local}")
            elif local >= len(ranks):
                problems.append(f"host {name!r} has ranks {ranks} ({found}) but rank {claimants[0]} claims "
                                f"LOCAL_RANK={local}")
    if problems:
        raise ValueError("pz.init(): inconsistent topology: " + "; ".join(problems)
                         + " (set PYZERO_HOST to the same name on every rank of a host, or fix LOCAL_WORLD_SIZE "
                         "and LOCAL_RANK: a host's ranks take local ranks 0 to its ranks - 1, once each)")
    ordered = sorted(by_name.items(), key=lambda kv: kv[1][0])
    return Topology(tuple(tuple(r) for _, r in ordered), tuple(n for n, _ in ordered), rank)


def joined(store, size: int, key: str = "pz/topology") -> list[int]:
    """The ranks that have published their host (exchange's first step)."""
    return [r for r in range(size) if store.check([f"{key}/{r}"])]


def missing(store, size: int, key: str = "pz/topology") -> str:
    """Which ranks have not published their host yet (for an error message); never raises."""
    try:
        present = set(joined(store, size, key))
    except Exception:  # noqa: BLE001 - the store itself may be gone
        return "the store did not answer"
    absent = [r for r in range(size) if r not in present]
    return f"never joined: {absent}" if absent else "every rank joined, one left before the others had read"


def peer_json(raw: bytes, what: str, ok, expected: str, max_bytes: int = 1 << 20):
    """A value another rank wrote to the job's store, parsed as JSON (never unpickled) and checked
    with ``ok`` before use; ValueError naming `what` otherwise."""
    if len(raw) > max_bytes:
        raise ValueError(f"{what}: {len(raw)} bytes in the store, expected at most {max_bytes}")
    try:
        value = json.loads(raw.decode())
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise ValueError(f"{what}: the store holds {raw[:40]!r}, not {expected}") from None
    if not ok(value):
        raise ValueError(f"{what}: the store holds {repr(value)[:60]}, not {expected}")
    return value


def host_report(raw: bytes, what: str) -> list:
    """[host name, ranks claimed on that host or null, LOCAL_RANK or null], as exchange() publishes it."""
    return peer_json(raw, what, lambda v: type(v) is list and len(v) == 3 and type(v[0]) is str
                     and 0 < len(v[0]) <= 255 and (v[1] is None or (type(v[1]) is int and 1 <= v[1] <= 1 << 20))
                     and (v[2] is None or (type(v[2]) is int and 0 <= v[2] < 1 << 20)),
                     "[host name, local world size, local rank]")


def exchange(store, rank: int, size: int, timeout: float, key: str = "pz/topology",
             local_rank: int | None = None) -> Topology:
    """Publish this rank's host (and `local_rank`, its LOCAL_RANK if set) through `store` and build the job's
    topology (collective over the world)."""
    store.set(f"{key}/{rank}", json.dumps([host_name(), claimed_local_size(), local_rank]))
    keys = [f"{key}/{r}" for r in range(size)]
    deadline = time.monotonic() + timeout
    for i in range(0, size, 1 << 16):  # (torch's store waits for at most 131072 keys at once)
        store.wait(keys[i:i + (1 << 16)], datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))
    reports = [tuple(host_report(store.get(k), k)) for k in keys]
    # Everyone has read before anyone may fail: rank 0 hosts the store and must outlive the reads.
    if store.add(f"{key}/read", 1) == size:
        store.set(f"{key}/read/done", "1")
    store.wait([f"{key}/read/done"], datetime.timedelta(seconds=timeout))
    return group_hosts(reports, rank)


class Totals(NamedTuple):
    """Summed per-op counters (the "intra_host" entry of comm_stats for one-host groups)."""

    calls: int
    elements: int
    sent_bytes: int

    @classmethod
    def of(cls, stats) -> "Totals":
        stats = list(stats)
        return cls(sum(s.calls for s in stats), sum(s.elements for s in stats), sum(s.sent_bytes for s in stats))


_ONE_HOST = ("shm", "ipc")  # backends whose transport stops at the host boundary


def pick_backend(requested: str | None, topo: Topology, cuda: bool) -> str:
    """The world's backend: `requested`, or by default nccl with CUDA, else shm on one host and hier across
    hosts. A one-host backend asked for on several hosts is an error (on every rank)."""
    if requested is None:
        return "nccl" if cuda else ("hier" if topo.num_hosts > 1 else "shm")
    if requested in _ONE_HOST and topo.num_hosts > 1:
        where = "; ".join(f"{n!r}: ranks {list(r)}" for n, r in zip(topo.names, topo.hosts))
        raise ValueError(f"backend={requested!r} needs every rank on one host, but the job spans "
                         f"{topo.num_hosts} hosts ({where}); use backend=None or 'hier'")
    return requested


def group_backend(world_backend: str, topo: Topology, ranks) -> str:
    """The backend of a group: a hier world's groups inside one host take the flat shm path."""
    if world_backend == "hier" and not topo.spans_hosts(ranks):
        return "shm"
    return world_backend
