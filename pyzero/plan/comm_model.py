"""Time of a collective: from measured tables or from given link bandwidths.

Measured tables are the JSON that ``pyzero-bench collectives --json`` writes:
``results`` rows with op, bytes, time_us, busbw (GB/s), world_size,
inplace and backend. For each op the table keeps (bytes, time) of the
in-place pyzero rows and answers a size between two measured ones by
log-log interpolation; past the largest size it extends at the largest
size's bus bandwidth. Another group size n' is answered through the bus
bandwidth, which the ring makes independent of n: time(n') = latency + bytes
* factor(n') / busbw, with the nccl-tests factors (all-reduce 2(n-1)/n,
reduce-scatter and all-gather (n-1)/n, send 1).

Given bandwidths use the alpha-beta model of the same ring:
time = steps(n) * alpha + bytes * factor(n) / bw, with steps 2(n-1) for
all-reduce, n-1 for reduce-scatter/all-gather, 1 for send.

There are two link kinds: "intra" (ranks of one host: NVLink, or shared
memory for CPU ranks) and "inter" (a group that spans hosts; ``bw`` is then
the network bandwidth per GPU, e.g. 8 x 200 Gb/s InfiniBand shared by 8 GPUs
= 25 GB/s per GPU).
"""
from __future__ import annotations

import bisect
import json
import math

OPS = ("all_reduce", "reduce_scatter", "all_gather", "send")


def bus_factor(op: str, n: int) -> float:
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("reduce_scatter", "all_gather"):
        return (n - 1) / n
    if op == "send":
        return 1.0
    raise ValueError(f"op: expected one of {OPS}, got {op!r}")


def _steps(op: str, n: int) -> int:
    return {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1, "send": 1}[op]


class Link:
    """Alpha-beta link: ``bw`` bytes/s of bus bandwidth, ``alpha`` seconds per ring step."""

    def __init__(self, bw: float, alpha: float = 5e-6):
        if not (isinstance(bw, (int, float)) and bw > 0 and math.isfinite(bw)):
            raise ValueError(f"bw: expected a positive bandwidth in bytes/s, got {bw!r}")
        if not (isinstance(alpha, (int, float)) and alpha >= 0):
            raise ValueError(f"alpha: expected a latency >= 0 in seconds, got {alpha!r}")
        self.bw, self.alpha = float(bw), float(alpha)

    def time(self, op: str, nbytes: float, n: int) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        return _steps(op, n) * self.alpha + nbytes * bus_factor(op, n) / self.bw

    def __repr__(self):
        return f"Link(bw={self.bw / 1e9:g} GB/s, alpha={self.alpha * 1e6:g} us)"


class Table:
    """Measured collective times, per op: sorted (bytes, seconds) at group size ``world``."""

    def __init__(self, rows: dict[str, list[tuple[float, float]]], world: int, source: str = "table"):
        if not rows:
            raise ValueError(f"{source}: no collective measurements found")
        self.rows = {op: sorted(r) for op, r in rows.items() if r}
        self.world, self.source = world, source

    @classmethod
    def from_json(cls, path_or_dict, backend: str = "pyzero") -> "Table":
        d = path_or_dict
        source = "table"
        if not isinstance(d, dict):
            source = str(path_or_dict)
            with open(path_or_dict) as f:
                d = json.load(f)
        results = d.get("results") if isinstance(d, dict) else None
        if not isinstance(results, list):
            raise ValueError(f"{source}: expected the JSON of `pyzero-bench collectives --json` (a 'results' list)")
        rows: dict[str, list] = {}
        worlds = set()
        for r in results:
            if r.get("backend", backend) != backend or not r.get("inplace", True) or r.get("wrong", 0):
                continue
            rows.setdefault(r["op"], []).append((float(r["bytes"]), float(r["time_us"]) * 1e-6))
            worlds.add(int(r["world_size"]))
        if len(worlds) > 1:
            raise ValueError(f"{source}: rows of several world sizes {sorted(worlds)}; expected one")
        return cls(rows, worlds.pop() if worlds else 2, source)

    def _lookup(self, op: str, nbytes: float) -> tuple[float, float]:
        """(seconds at self.world, the smallest measured time) for op at nbytes, interpolated log-log."""
        rows = self.rows.get(op)
        if rows is None:
            if op == "send" and "all_gather" in self.rows:
                # A ring all-gather of world x nbytes is world - 1 steps, each a send of nbytes to the next rank.
                t, lat = self._lookup("all_gather", nbytes * self.world)
                steps = max(self.world - 1, 1)
                return t / steps, lat / steps
            raise ValueError(f"{self.source}: has no rows for {op!r}; measured ops: {sorted(self.rows)}")
        sizes = [b for b, _ in rows]
        lat = rows[0][1]
        if nbytes <= sizes[0]:
            return rows[0][1], lat
        if nbytes >= sizes[-1]:
            b, t = rows[-1]
            return t * nbytes / b, lat  # the largest size's bandwidth
        i = bisect.bisect_left(sizes, nbytes)
        (b0, t0), (b1, t1) = rows[i - 1], rows[i]
        w = (math.log(nbytes) - math.log(b0)) / (math.log(b1) - math.log(b0))
        return math.exp(math.log(t0) + w * (math.log(t1) - math.log(t0))), lat

    def time(self, op: str, nbytes: float, n: int) -> float:
        if n <= 1 or nbytes <= 0:
            return 0.0
        t, lat = self._lookup(op, nbytes)
        if n == self.world or op == "send":
            return t
        # Same bus bandwidth at another group size; the latency scales with the ring steps.
        busbw = nbytes * bus_factor(op, self.world) / max(t - lat, 1e-12)
        return lat * _steps(op, n) / _steps(op, self.world) + nbytes * bus_factor(op, n) / busbw

    def __repr__(self):
        return f"Table({self.source}, world={self.world}, ops={sorted(self.rows)})"


def as_link(value, what: str):
    """A Link or Table from a Link/Table, a bandwidth in bytes/s, a JSON path or a loaded JSON dict."""
    if isinstance(value, (Link, Table)):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            return Link(value)
        except ValueError as e:
            raise ValueError(f"{what}: {e}") from None
    if isinstance(value, (str, dict)) or hasattr(value, "__fspath__"):
        return Table.from_json(value)
    raise TypeError(f"{what}: expected a bandwidth in bytes/s, a collectives JSON path or a Link, got {value!r}")
