"""Shared bench helpers: machine/version record, size parsing, JSON output."""
from __future__ import annotations

import datetime
import json
import math
import os
import platform
import re
import sys


class UsageError(ValueError):
    """A flag's value a subcommand cannot run with, found before anything runs: ``pyzero-bench`` exits 2
    with the message, as argparse does for the values it checks itself."""


def choice_list(text: str, allowed, flag: str) -> list[str]:
    """A comma list of names from `allowed` (at least one); a UsageError naming `flag` otherwise."""
    out = [o.strip() for o in str(text).split(",") if o.strip()]
    bad = [o for o in out if o not in allowed]
    if bad or not out:
        raise UsageError(f"{flag}: expected some of {tuple(allowed)}, got {text!r}"
                         + (f" (unknown {bad})" if bad else ""))
    return out


def number_list(text: str, flag: str, kind=int, least: float = 1) -> list:
    """A comma list of `kind` (int or float; finite) numbers, each >= `least` (at least one); a UsageError
    naming `flag` otherwise."""
    try:
        out = [kind(v) for v in str(text).split(",") if v.strip()]
    except ValueError:
        raise UsageError(f"{flag}: expected a comma list of {kind.__name__}s, got {text!r}") from None
    if not out or any(not (least <= v < math.inf) for v in out):
        raise UsageError(f"{flag}: expected {kind.__name__}s >= {least:g}, got {text!r}")
    return out


def init_torch_distributed(backend: str, timeout: float = 300.0):
    """torch.distributed beside pyzero in this (already pz.init'ed) rank, for side-by-side runs.
    It rendezvouses through pyzero's own store (under a prefix), so it needs no second port
    that another process could hold."""
    import torch.distributed as dist  # noqa: PLC0415

    from .. import comm  # noqa: PLC0415

    store = dist.PrefixStore("torch.distributed/", comm.get_store())
    dist.init_process_group(backend, store=store, rank=comm.get_rank(), world_size=comm.get_world_size(),
                            timeout=datetime.timedelta(seconds=timeout))
    return dist


def interleaved_medians(fns, iters: int, warmup: int, before=None) -> list[float]:
    """Median seconds of each fn() over `iters` rounds, the slowest rank's. Each call starts
    after a barrier (and after ``before(i)`` for fns[i], when given); the fns alternate within
    a round, so drift (allocator, caches, other load) hits all of them alike."""
    import statistics  # noqa: PLC0415
    import time  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from .. import comm  # noqa: PLC0415

    for _ in range(warmup):
        for fn in fns:
            fn()
    times = [[] for _ in fns]
    for _ in range(iters):
        for i, (fn, ts) in enumerate(zip(fns, times)):
            if before is not None:
                before(i)
            comm.barrier()  # every rank starts each timed call together
            t0 = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t0)
    t = torch.tensor([statistics.median(ts) for ts in times], dtype=torch.float64, device=comm_device())
    comm.all_reduce(t, op="max")
    return t.tolist()


def comm_device():
    """Where the default group's collectives take their tensors: its GPU (nccl, ipc: the one
    pz.init chose, GPUs may be shared) or the CPU."""
    from .. import comm  # noqa: PLC0415

    return comm.resolve_group(None).tensor_device


def machine_info() -> dict:
    cpu = platform.processor()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"model name\s*:\s*(.*)", f.read())
            cpu = m.group(1).strip() if m else cpu
    except OSError:
        pass
    info = {"node": platform.node(), "system": platform.platform(), "cpu": cpu, "cpus": os.cpu_count()}
    try:
        import torch  # noqa: PLC0415

        if torch.cuda.is_available():
            info["gpu"] = torch.cuda.get_device_name(0)
            info["gpus"] = torch.cuda.device_count()
    except ImportError:
        pass
    return info


def versions() -> dict:
    import torch  # noqa: PLC0415

    from .. import _C, __version__, nccl_library  # noqa: PLC0415

    v = {"python": sys.version.split()[0], "torch": torch.__version__, "pyzero": __version__}
    v.update({f"pyzero_{k}": val for k, val in _C.build_info().items()})
    v["pyzero_nccl_library"] = nccl_library()  # which libnccl.so.2 (path, version; test: pyzero's test NCCL)
    return v


def record(results: list, extra: dict | None = None) -> dict:
    out = {"machine": machine_info(), "versions": versions(),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    out.update(extra or {})
    out["results"] = results
    return out


def mem_available() -> int | None:
    """The kernel's MemAvailable in bytes (/proc/meminfo), None where it cannot be read."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def write_json(path: str, results: list, extra: dict | None = None) -> None:
    with open(path, "w") as f:
        json.dump(record(results, extra), f, indent=1, default=str)


_SUFFIX = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str, flag: str = "size") -> int:
    """'8', '64K', '128M', '1G' -> bytes; a UsageError naming `flag` otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*([KMG]?)B?\s*", str(text), re.IGNORECASE)
    if not m:
        raise UsageError(f"{flag} {text!r}: expected a number with an optional K, M or G suffix")
    return int(m.group(1)) * _SUFFIX[m.group(2).upper()]


def size_steps(lo: int, hi: int, factor: float) -> list[int]:
    if lo < 1 or hi < lo:
        raise UsageError(f"--min/--max: expected 1 <= min <= max, got {lo}, {hi}")
    if not 1 < factor < math.inf:
        raise UsageError(f"--factor: expected a number > 1, got {factor}")
    out, s = [], lo
    while s <= hi:
        out.append(int(s))
        s = s * factor
    return out
