"""pyzero-bench collectives: an nccl-tests style table, pyzero beside torch.distributed.

Every size runs out-of-place and in-place. Inputs are small integers, so every
reduction is exact in every dtype and #wrong is a real count against an
expected value computed independently (closed form in int64). Bus bandwidth
uses the nccl-tests factors: all_reduce 2(n-1)/n, reduce_scatter and
all_gather (n-1)/n, broadcast 1. pyzero's out-of-place all_reduce is
``pz.all_reduce(inp, out=out)`` (the shm transport reads inp and writes out; a
backend without that copies first); torch has none, so its out-of-place
column is copy-then-reduce, as a user would write it. The time reported is the slowest rank's mean.
Each size runs every backend in turn, and with ``--rounds`` every round runs every size, so a slow
phase of the machine falls on all backends and sizes alike; with several backends or rounds the tables
print once the sizes are done.

``--op sendrecv`` is nccl-tests' sendrecv: every rank sends its buffer to the next rank and
receives the previous rank's in one batch (``pz.batch_isend_irecv``; torch's
``batch_isend_irecv``), bus bandwidth = algorithm bandwidth; out of place only (the in-place
columns print nan), not part of ``--op all``; two ranks or more. On the ipc backend it measures the
point-to-point channels.

With ``--device cuda`` every rank uses one GPU (cuda:LOCAL_RANK) and the
backends are: pyzero (pyzero's own algorithms on the nccl backend: --algo,
auto meaning ring), nccl (pyzero's native passthrough to NCCL's collectives)
and torch (torch.distributed with NCCL); ``torch-pyzero`` is torch.distributed's API on the "pyzero"
backend's CUDA transports (pyzero.distributed_cuda: nccl at one rank, ipc between processes of one
host, with ``--gpu-backend ipc`` too), beside torch's NCCL the one-string switch of a GPU script.
Timed loops end with a device synchronisation.

On the CPU, ``torch-pyzero`` is torch.distributed's API on pyzero's own
"pyzero" backend (pyzero.distributed): beside ``pyzero`` it measures what
going through torch's API costs on the same transport, beside the API's own floor (the same
call over torch's fake backend, which does nothing). ``deepspeed`` is
DeepSpeed's CPU shared-memory all-reduce (deepspeed.comm.inference_all_reduce
with DS_ACCELERATOR=cpu; all_reduce, sum only), where deepspeed is installed
(its shm op compiles with ninja on first use, about a minute). ``pyzero-fixed``
is pyzero's shm backend on a group with ``adaptive=False``: auto's fixed choice
by size (the one-shot, or the ring above its sizes) without the measured choice
of the two-shot, beside ``pyzero`` to show what that choice changes.
"""
from __future__ import annotations

import functools
import glob
import json
import math
import os
import statistics
import subprocess
import sys
import time

import torch

from ..checks import is_int
from .common import UsageError, comm_device, init_torch_distributed, parse_size, size_steps, write_json

OPS = ("all_reduce", "reduce_scatter", "all_gather", "broadcast")
MIN_TIMED_S = 0.05
BUS_FACTOR = {
    "all_reduce": lambda n: 2 * (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "broadcast": lambda n: 1.0,
    "sendrecv": lambda n: 1.0,
}
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
NCCL_TYPE = {"float32": "float", "float16": "half", "bfloat16": "bfloat16", "float64": "double",
             "int32": "int32", "int64": "int64"}


def add_arguments(p) -> None:
    p.add_argument("--op", default="all_reduce", choices=OPS + ("sendrecv", "all"),
                   help="a collective, sendrecv (each rank to the next: point-to-point), or all (the collectives)")
    p.add_argument("--min", default="8", help="smallest size in bytes (K/M/G suffixes)")
    p.add_argument("--max", default="128M", help="largest size in bytes")
    p.add_argument("--factor", type=float, default=2.0)
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--nproc", type=int, default=None, help="spawn this many local ranks (else: run under torchrun)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: shm backend vs gloo; cuda: one GPU per rank, nccl backend vs torch's NCCL")
    p.add_argument("--backends", default="pyzero,torch",
                   help="comma list of pyzero, torch, torch-pyzero, (cpu) deepspeed and (cuda) nccl")
    p.add_argument("--gpu-backend", default="nccl", choices=("nccl", "ipc"),
                   help="with --device cuda: the backend of the pyzero column (ipc: several ranks may share a GPU; "
                        "then only the pyzero column)")
    p.add_argument("--algo", default="auto", choices=("auto", "ring", "oneshot", "twoshot"), help="pyzero algorithm")
    p.add_argument("--iters", type=int, default=20, help="timed calls (more for small sizes: >= 50 ms of calls)")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--per-call", action="store_true",
                   help="time each call alone (median), not the mean of back-to-back calls")
    p.add_argument("--graph", type=int, default=0, metavar="N",
                   help="with --device cuda: capture N calls in a CUDA graph (torch.cuda.graph) and time its "
                        "replays, per call (0: eager calls, the default); the check counts #wrong after the replays "
                        "(out of place)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each size this many times, alternating out-of-place and in-place and the backends, "
                        "and report the median (every round's time and start in the json); each round runs every "
                        "size, so a slow phase of the machine hits every form, backend and size alike")
    p.add_argument("--block", type=int, default=0, metavar="N",
                   help="with --per-call: each round times N calls of each backend and form (fewer where N calls "
                        "would take over 50 ms, at least 5), so many short rounds interleave the backends finely "
                        "and a slow moment of the machine lands on them alike (0: each round times --iters calls, "
                        "or 50 ms of calls for small sizes)")
    p.add_argument("--min-calls", type=int, default=0, metavar="N",
                   help="with --block: time at least N calls of each backend and form at every size over its rounds "
                        "(the rounds' blocks grow to ceil(N / rounds)), so that p99 is not the slowest call alone "
                        "where 50 ms of calls are few (0: no minimum)")
    p.add_argument("--pairs", type=int, default=1,
                   help="with --nproc: run the whole comparison this many times, each in fresh rank processes (each "
                        "set of processes lands in its own exchange mode, see the exchange probe), then a summary "
                        "per set; the json's rows carry their set's index ('pair')")
    p.add_argument("--exchange-mode", choices=("any", "fast", "slow"), default="any",
                   help="with --nproc on CPU: keep only sets of ranks whose exchange probe labels them in this mode "
                        "(fast or slow; see --pairs): a set in the other mode stops right after its probe and a fresh "
                        "one starts, until --pairs sets in the mode have run the comparison or --tries sets were "
                        "started (any: every set runs it)")
    p.add_argument("--tries", type=int, default=0, metavar="N",
                   help="with --exchange-mode fast or slow: start at most N sets of ranks in all (0: 20 per set "
                        "asked for by --pairs); fewer sets in the mode than asked for is exit status 1")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds for each run")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)


# ---------------------------------------------------------------------------
# Exactly checkable data


def pattern(count: int, rank: int, dtype) -> torch.Tensor:
    """Rank r's input: small integers in [-2, 2], so sums over <= 60 ranks are exact even in fp16/bf16,
    from a hash of (element, rank): no period, so an element moved to another place (a chunk handed
    to the wrong rank, a shifted copy) reads wrong (a period of 5 made every rank's reduce_scatter
    chunk alike when its length was a multiple of 5). int32 arithmetic, wrapping."""
    h = torch.arange(count, dtype=torch.int32) * -1640531535 + rank * 1013904223
    h ^= h >> 15
    h *= 739982445
    h ^= h >> 13
    return (torch.remainder(h, 5) - 2).to(dtype)


@functools.lru_cache(maxsize=2)  # (every backend and form of a size checks against the same; read only)
def expected(op: str, count: int, n: int, rank: int, root: int, dtype) -> torch.Tensor:
    """The result this rank must hold, from the closed form, not from any collective."""
    if op == "broadcast":
        return pattern(count, root, dtype)
    if op == "sendrecv":  # the previous rank's buffer
        return pattern(count, (rank - 1) % n, dtype)
    if op == "all_gather":
        per = count // n
        return torch.cat([pattern(per, r, torch.int64) for r in range(n)]).to(dtype)
    total = sum(pattern(count, r, torch.int64) for r in range(n))
    if op == "reduce_scatter":
        per = count // n
        return total[rank * per:(rank + 1) * per].to(dtype)
    return total.to(dtype)


# ---------------------------------------------------------------------------
# One backend's calls


class Runner:
    """Binds an op/backend to prepared buffers; call() runs one collective."""

    def __init__(self, backend: str, op: str, count: int, dtype, inplace: bool, algo: str):
        import pyzero as pz  # noqa: PLC0415

        self.n = pz.get_world_size()
        self.rank = pz.get_rank()
        per = count // self.n
        algo = None if algo == "auto" else algo
        dev = comm_device()
        if dev.type == "cuda" and backend == "pyzero" and pz.get_backend() == "nccl":
            algo = algo or "ring"  # auto on the nccl backend is NCCL's own: the "nccl" column
        if op == "all_gather":
            self.out = torch.empty(count, dtype=dtype, device=dev)
            self.inp = (self.out[self.rank * per:(self.rank + 1) * per] if inplace
                        else torch.empty(per, dtype=dtype, device=dev))
        else:
            self.inp = torch.empty(count, dtype=dtype, device=dev)
            if op == "all_reduce":
                self.out = torch.empty(count, dtype=dtype, device=dev)
            elif op == "reduce_scatter":
                self.out = (self.inp[self.rank * per:(self.rank + 1) * per] if inplace
                            else torch.empty(per, dtype=dtype, device=dev))
            else:
                self.out = self.inp if inplace else torch.empty(count, dtype=dtype, device=dev)
        self.result = self.inp if (op in ("all_reduce", "broadcast") and inplace) else self.out
        self.op, self.count, self.dtype = op, count, dtype
        self.reset()
        if op == "sendrecv":
            if inplace or backend not in ("pyzero", "torch", "torch-pyzero"):
                raise UsageError(f"--op sendrecv: out of place, on the pyzero and torch columns only (not {backend})")
            self.call = self._sendrecv(backend)
        elif backend == "pyzero":
            self.call = self._pyzero(op, inplace, algo)
        elif backend == "pyzero-fixed":
            self.call = self._pyzero(op, inplace, algo, PZ_GROUPS[backend])
        elif backend == "nccl":
            self.call = self._pyzero(op, inplace, "native")
        elif backend == "deepspeed":
            self.call = self._deepspeed(op, inplace)
        else:
            self.call = self._torch(op, inplace, TORCH_GROUPS[backend], aliasing=backend == "torch-pyzero")

    def reset(self) -> None:
        """Write the inputs (at set-up, and again for one more checked call: the in-place forms
        overwrote them with results)."""
        per = self.count // self.n if self.op == "all_gather" else self.count
        self.inp.copy_(pattern(per, self.rank, self.dtype))

    def _sendrecv(self, backend):
        """A send to the next rank and a receive from the previous one, in one batch."""
        inp, out, nxt, prv = self.inp, self.out, (self.rank + 1) % self.n, (self.rank - 1) % self.n
        if backend == "pyzero":
            import pyzero as pz  # noqa: PLC0415

            def call():
                pz.batch_isend_irecv([pz.P2POp("send", inp, nxt), pz.P2POp("recv", out, prv)])[0].wait()
            return call
        import torch.distributed as dist  # noqa: PLC0415

        group = TORCH_GROUPS[backend]

        def call():
            for w in dist.batch_isend_irecv([dist.P2POp(dist.isend, inp, nxt, group),
                                             dist.P2POp(dist.irecv, out, prv, group)]):
                w.wait()
        return call

    def _deepspeed(self, op, inplace):
        import deepspeed.comm as dc  # noqa: PLC0415

        if op != "all_reduce":
            raise UsageError(f"--backends deepspeed: only all_reduce (its CPU shm path), not {op}")
        inp, out = self.inp, self.out
        if inplace:
            return lambda: dc.inference_all_reduce(inp)
        return lambda: (out.copy_(inp), dc.inference_all_reduce(out))

    def _pyzero(self, op, inplace, algo, group=None):
        import pyzero as pz  # noqa: PLC0415

        inp, out, g = self.inp, self.out, group
        if op == "all_reduce":
            if inplace:
                return lambda: pz.all_reduce(inp, algo=algo, group=g)
            return lambda: pz.all_reduce(inp, algo=algo, out=out, group=g)
        if op == "reduce_scatter":
            return lambda: pz.reduce_scatter(out, inp, algo=algo, group=g)
        if op == "all_gather":
            return lambda: pz.all_gather(out, inp, algo=algo, group=g)
        if inplace:
            return lambda: pz.broadcast(inp, src=0, algo=algo, group=g)
        return lambda: (out.copy_(inp) if self.rank == 0 else None, pz.broadcast(out, src=0, algo=algo, group=g))

    def _torch(self, op, inplace, group, aliasing):
        """torch.distributed calls on `group`; `aliasing`: the backend takes the in-place forms as pz does."""
        import torch.distributed as dist  # noqa: PLC0415

        inp, out = self.inp, self.out
        if op == "all_reduce":
            if inplace:
                return lambda: dist.all_reduce(inp, group=group)
            return lambda: (out.copy_(inp), dist.all_reduce(out, group=group))
        if op == "reduce_scatter":
            if aliasing:
                return lambda: dist.reduce_scatter_tensor(out, inp, group=group)
            src = inp.clone() if inplace else inp  # gloo has no aliasing form
            return lambda: (src.copy_(inp) if inplace else None, dist.reduce_scatter_tensor(out, src, group=group))
        if op == "all_gather":
            src = inp.clone() if inplace and not aliasing else inp
            return lambda: dist.all_gather_into_tensor(out, src, group=group)
        if inplace:
            return lambda: dist.broadcast(inp, src=0, group=group)
        return lambda: (out.copy_(inp) if self.rank == 0 else None, dist.broadcast(out, src=0, group=group))


# torch.distributed groups of the torch columns: "torch" is the default group (gloo/nccl),
# "torch-pyzero" a group on pyzero's own torch backend beside it (or the default one when alone).
TORCH_GROUPS: dict = {}
PZ_GROUPS: dict = {}  # pyzero columns on a group of their own: "pyzero-fixed" (adaptive=False)


def deepspeed_available() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("deepspeed") is not None


def _init_deepspeed(timeout: float) -> None:
    """DeepSpeed's CPU accelerator over the default torch group (gloo); its shm all-reduce."""
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("LOCAL_SIZE", os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))
    import deepspeed.comm as dc  # noqa: PLC0415

    import torch.distributed as dist  # noqa: PLC0415
    if not dist.is_initialized():
        init_torch_distributed("gloo", timeout)
    dc.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)
    TORCH_GROUPS["deepspeed"] = None


def _remove_deepspeed_buffers(rank: int) -> None:
    """DeepSpeed's shm all-reduce never unlinks its buffers (/dev/shm/deepspeed_allreduce_buffer_*
    named by MASTER_ADDR and MASTER_PORT): once every rank is done with them, unlink this job's, which
    would otherwise keep their memory until the machine restarts."""
    import pyzero as pz  # noqa: PLC0415

    pz.barrier()
    if rank == 0:
        addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
        for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_*_{addr}_{port}_*"):
            try:
                os.unlink(path)
            except OSError:
                pass


def _init_torch_groups(backends, torch_backend: str, timeout: float) -> None:
    if "torch" in backends:
        dist = init_torch_distributed(torch_backend, timeout)
        TORCH_GROUPS["torch"] = None
        if "torch-pyzero" in backends:
            TORCH_GROUPS["torch-pyzero"] = dist.new_group(backend="pyzero")
    elif "torch-pyzero" in backends:
        init_torch_distributed("pyzero", timeout)
        TORCH_GROUPS["torch-pyzero"] = None


def _barrier(backend):
    import pyzero as pz  # noqa: PLC0415

    if backend in TORCH_GROUPS:
        import torch.distributed as dist  # noqa: PLC0415

        dist.barrier(group=TORCH_GROUPS[backend])
    else:
        pz.barrier(group=PZ_GROUPS.get(backend))


def _syncer():
    """What waits for the device's work: torch.cuda.synchronize on a GPU, nothing on the CPU. Looked
    up once per measurement (finding the group's device took 2.2 us, which a per-call time would
    otherwise include)."""
    return torch.cuda.synchronize if comm_device().type == "cuda" else _no_sync


def _no_sync() -> None:
    pass


def _max_over_ranks(x: float) -> float:
    import pyzero as pz  # noqa: PLC0415

    t = torch.tensor([x], dtype=torch.float64, device=comm_device())
    pz.all_reduce(t, op="max")
    return float(t)


def _sum_over_ranks(x: int) -> int:
    import pyzero as pz  # noqa: PLC0415

    t = torch.tensor([x], dtype=torch.int64, device=comm_device())
    pz.all_reduce(t, op="sum")
    return int(t)


def _captured(call, calls: int):
    """A function replaying a CUDA graph of `calls` calls of `call` (warmed up on a side stream first,
    as torch.cuda.graph asks)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            call()
    return graph.replay


def measure(backend, op, count, dtype, inplace, algo, iters, warmup, per_call=False, graph=0, block=0, least=0):
    """(time_us, wrong, calls) for one configuration; every rank returns the same time_us and wrong. The
    time is the mean over back-to-back calls, or with `per_call` the median of the calls timed one by
    one (the slowest rank's); `calls` then holds this rank's per-call times in seconds (else empty).
    With `graph` (CUDA) N calls are captured in a graph and its replays timed, per call. `block`: time
    that many calls (fewer where they would take over MIN_TIMED_S, at least 5, and at least `least`) instead
    of `iters`."""
    import pyzero as pz  # noqa: PLC0415

    n, rank = pz.get_world_size(), pz.get_rank()
    r = Runner(backend, op, count, dtype, inplace, algo)
    r.call()
    want = expected(op, count, n, rank, 0, dtype)
    wrong = int((r.result.cpu() != want).sum())
    per = max(graph, 1)  # calls per timed step
    step = _captured(r.call, graph) if graph else r.call
    sync = _syncer()
    _barrier(backend)
    t0 = time.perf_counter()
    for _ in range(max(warmup, 1)):
        step()
    sync()
    per_call_s = _max_over_ranks((time.perf_counter() - t0) / max(warmup, 1) / per)
    # Small messages: at least MIN_TIMED_S of timed calls, so one scheduler hiccup
    # cannot dominate a 10 us measurement (every rank derives the same count).
    timed = max(1, int(min(max(iters, MIN_TIMED_S / max(per_call_s, 1e-9)), 100 * iters)) // per)
    if block:
        timed = max(5, least, min(block, int(MIN_TIMED_S / max(per_call_s * per, 1e-9))))
    _barrier(backend)
    times = []
    if per_call:
        for _ in range(timed):
            t0 = time.perf_counter()
            step()
            sync()
            times.append((time.perf_counter() - t0) / per)
        elapsed = statistics.median(times)
    else:
        t0 = time.perf_counter()
        for _ in range(timed):
            step()
        sync()
        elapsed = (time.perf_counter() - t0) / timed / per
    if graph and not inplace:  # the replays computed the result too (in place, calls compound)
        wrong += int((r.result.cpu() != want).sum())
    # One more checked call after the timed ones (as nccl-tests checks after its timed loop): what
    # warm-up and timing changed (an algorithm the auto choice switched to, a reused buffer) shows here.
    _barrier(backend)
    r.reset()
    r.call()
    sync()
    wrong += int((r.result.cpu() != want).sum())
    return _max_over_ranks(elapsed) * 1e6, _sum_over_ranks(wrong), times


PERCENTILES = (("p50", 0.5), ("p90", 0.9), ("p99", 0.99), ("max", 1.0))


def nearest_rank(values, q: float):
    """The q-quantile of `values` by the nearest-rank rule: the smallest value with at least q of them at or
    below it (q=1: the maximum)."""
    s = sorted(values)
    return s[max(0, math.ceil(q * len(s)) - 1)]


def percentiles(calls) -> dict:
    """{p50, p90, p99, max} in us of this rank's per-call times, the slowest rank's each."""
    return {f"{name}_us": _max_over_ranks(nearest_rank(calls, q)) * 1e6 for name, q in PERCENTILES}


# [Note: exchange probe] in csrc/shm_transport.cpp: what one rank pays per cache line to read lines its
# ring predecessor has just written (ns_per_line, recorded), and the mode label, which comes from the
# one-shot all_reduce of 64 KiB (fp32, in place, on a group with adaptive=False: a copy into the area,
# the arrival, the peers' areas read and summed), the median of PROBE_CALLS calls, the slowest rank's.
# On this 2-vCPU VM, in fresh pairs of ranks (collectives_pairs_{12sets,nslabel,leap2}_cpu2_20261127):
# pairs that ran as fast ones, 25 of them, one-shot 11.4-16.0 us, ns_per_line 0.64-4.10; the one that
# ran slow (its 1 MiB ring 101 us at the median and 937 at p90, DeepSpeed's 1 MiB 514 us against 85-138
# elsewhere), one-shot 35.3 us, ns_per_line 2.59; in a quick sample of 20 fresh pairs 6 took 36-47 us.
# ns_per_line labelled 6 fast-running pairs slow (2.52-4.10), so the label is the one-shot's. It is the
# mode of the moment: here the mode turned out to be a phase of the machine (every set met slow rounds,
# and the 6 sets this label put in the slow mode in collectives_pairs_slow2_cpu2_20261127, 25.7-48.8 us,
# ran as fast ones), so --exchange-mode picks sets by their start, not by how they will run.
SLOW_ONESHOT_US = 24.0
PROBE_CALLS = 200


def _fixed_group():
    """The "pyzero-fixed" column's group (adaptive=False), made on first use by every rank of this run."""
    import pyzero as pz  # noqa: PLC0415

    if "pyzero-fixed" not in PZ_GROUPS:
        PZ_GROUPS["pyzero-fixed"] = pz.new_group(range(pz.get_world_size()), options=pz.Options(adaptive=False))
    return PZ_GROUPS["pyzero-fixed"]


def exchange_probe() -> dict | None:
    """The shm transport's exchange probe of the world group and the fixed one-shot's time at 64 KiB,
    with the mode that time puts the set of ranks in (CPU only; None elsewhere)."""
    import pyzero as pz  # noqa: PLC0415
    from .. import comm  # noqa: PLC0415

    if comm_device().type != "cpu" or pz.get_backend() != "shm" or pz.get_world_size() < 2:
        return None
    ns = _max_over_ranks(comm.resolve_group(None).backend.comm.probe_exchange(256 << 10, 15))
    _fixed_group()  # (the column's own timing: 20 calls of warm-up, then PROBE_CALLS timed one by one)
    us, _, _ = measure("pyzero-fixed", "all_reduce", 16 << 10, torch.float32, True, "auto", PROBE_CALLS, 20,
                       per_call=True, block=PROBE_CALLS, least=PROBE_CALLS)
    return {"backend": "exchange-probe", "op": "exchange", "ns_per_line": ns, "oneshot_64k_us": us,
            "mode": "slow" if us > SLOW_ONESHOT_US else "fast"}


def memcpy_gbps(nbytes: int, iters: int) -> float:
    """Copy bandwidth of one buffer on this rank's device (host memcpy, or device to device)."""
    a = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=comm_device())
    b = torch.empty_like(a)
    sync = _syncer()
    b.copy_(a)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        b.copy_(a)
    sync()
    return nbytes / ((time.perf_counter() - t0) / iters) / 1e9


# ---------------------------------------------------------------------------
# Per-rank driver and table


HEADER = ("#\n#{:>61}{:>32}\n".format("out-of-place", "in-place") +
          "#{:>11} {:>12} {:>8} {:>6} {:>6} {:>8} {:>7} {:>7} {:>6} {:>8} {:>7} {:>7} {:>6}\n".format(
              "size", "count", "type", "redop", "root", "time", "algbw", "busbw", "#wrong", "time", "algbw",
              "busbw", "#wrong") +
          "#{:>11} {:>12} {:>8} {:>6} {:>6} {:>8} {:>7} {:>7} {:>6} {:>8} {:>7} {:>7} {:>6}".format(
              "(B)", "(elements)", "", "", "", "(us)", "(GB/s)", "(GB/s)", "", "(us)", "(GB/s)", "(GB/s)", ""))


def _exchange_mode(args, pairs: int) -> tuple[str, int]:
    """(--exchange-mode, how many sets of ranks may start), checked."""
    want = getattr(args, "exchange_mode", "any")
    if want not in ("any", "fast", "slow"):
        raise UsageError(f"--exchange-mode: expected any, fast or slow, got {want!r}")
    tries = getattr(args, "tries", 0)
    if not is_int(tries) or tries < 0:
        raise UsageError(f"--tries: expected a count of sets of ranks >= 0, got {tries!r}")
    if want == "any":
        if tries:
            raise UsageError("--tries: only with --exchange-mode fast or slow (every set runs the comparison)")
        return want, pairs
    if not args.nproc:
        raise UsageError(f"--exchange-mode {want}: needs --nproc (sets of ranks are started afresh until one is "
                         "in that mode)")
    if getattr(args, "device", "cpu") != "cpu":
        raise UsageError(f"--exchange-mode {want}: the exchange probe measures the CPU shm backend; needs --device cpu")
    if tries and tries < pairs:
        raise UsageError(f"--tries: expected at least --pairs ({pairs}) sets, got {tries}")
    return want, tries or 20 * pairs


def rank_main(args) -> list[dict]:
    import pyzero as pz  # noqa: PLC0415
    from .. import comm  # noqa: PLC0415

    cuda = getattr(args, "device", "cpu") == "cuda"
    rounds = _rounds(args)
    backends = _backends(args)
    gpu_backend = getattr(args, "gpu_backend", "nccl")
    if "deepspeed" in backends and not deepspeed_available():
        if int(os.environ.get("RANK", "0")) == 0:
            print("# backend deepspeed: not installed here (pip install deepspeed), column left out", flush=True)
        backends = [b for b in backends if b != "deepspeed"]
    pz.init(backend=gpu_backend if cuda else "shm", timeout=args.timeout)
    n, rank = pz.get_world_size(), pz.get_rank()
    PZ_GROUPS.clear()  # (groups of an earlier run in this process are gone with its world)
    results = []
    probe = exchange_probe()  # (first: a set in a mode other than --exchange-mode's starts nothing more)
    if probe is not None:
        results.append(probe)
        if rank == 0:
            print(f"# exchange probe: {probe['ns_per_line']:.2f} ns per 64-byte line read from the ring predecessor "
                  f"just after it wrote it; the one-shot all_reduce of 64 KiB {probe['oneshot_64k_us']:.1f} us "
                  f"({probe['mode']}; slow above {SLOW_ONESHOT_US} us)", flush=True)
        want = getattr(args, "exchange_mode", "any")
        if want != "any" and probe["mode"] != want:  # (the probe is the slowest rank's: every rank stops here)
            if rank == 0:
                print(f"# this set of ranks is in the {probe['mode']} mode, not the {want} one asked for "
                      "(--exchange-mode): it stops here", flush=True)
            return [dict(probe, skipped=True)]
    _init_torch_groups(backends, "nccl" if cuda else "gloo", args.timeout)
    if "pyzero-fixed" in backends:
        _fixed_group()
    if "deepspeed" in backends:
        _init_deepspeed(args.timeout)
    dtype = DTYPES[args.dtype]
    esize = torch.empty(0, dtype=dtype).element_size()
    ops = OPS if args.op == "all" else (args.op,)
    if "sendrecv" in ops and n < 2:
        raise UsageError("--op sendrecv: needs two ranks or more (each sends to the next)")
    t_start = time.perf_counter()
    per_call = getattr(args, "per_call", False)
    block = _block(args)
    for op in ops:
        cols = [b for b in backends if (b != "deepspeed" or op == "all_reduce")
                and not (op == "sendrecv" and b == "nccl")]  # (point-to-point: no native column)
        live = len(cols) == 1  # one column prints its rows as they come; several, once the sizes are done
        tables = {b: [] for b in cols}
        forms = (False,) if op == "sendrecv" else (False, True)  # (sendrecv: out of place only)
        if per_call:  # the first size of fresh processes ran 1.2-1.7x slower on both backends: a round untimed
            for backend in cols:
                measure(backend, op, _count(op, parse_size(args.min), esize, n), dtype, forms[-1], args.algo,
                        args.iters, args.warmup, per_call, getattr(args, "graph", 0), block)
        if live and rank == 0:
            print(_heading(op, cols[0], n, args, rounds, per_call, False), flush=True)
        sizes = list(dict.fromkeys(_count(op, size, esize, n) for size in size_steps(
            parse_size(args.min), parse_size(args.max), args.factor)))
        runs = {(count, b, inplace): [] for count in sizes for b in cols for inplace in forms}
        starts = {key: [] for key in runs}
        calls = {key: [] for key in runs}
        least = -(-_min_calls(args) // rounds)  # calls of a round's block where --min-calls asks for more
        # every round runs every size (and, at each size, every backend and form): a slow phase of the
        # machine falls on all sizes alike, not on whichever size ran at that moment
        def rows(count):
            _size_rows(results, tables, runs, starts, calls, count, cols, op, esize, n, args, per_call, cuda,
                       live and rank == 0)

        for k in range(rounds):
            # sizes up on even rounds and down on odd ones, so that each size follows its neighbours (the
            # smallest did not come right after the largest, which left them slower in the first rounds
            # of a record: 8 B above 16 B in 15 of 16 pyzero columns); the backends' order alternates by
            # round too: neither always goes first
            for count in (sizes if k % 2 == 0 else sizes[::-1]):
                _measure_size(runs, starts, calls, count, cols if k % 2 == 0 else cols[::-1], forms, op, dtype,
                              args, per_call, block, least, t_start)
                if rounds == 1:  # (one round: each size's row prints as it is done)
                    rows(count)
        if rounds > 1:
            for count in sizes:
                rows(count)
        if rank == 0:
            for backend in cols:
                if not live:
                    print(_heading(op, backend, n, args, rounds, per_call, True), flush=True)
                    print("\n".join(line for line, _ in tables[backend]), flush=True)
                column = _column(backend, args)
                busbws = [b for _, bs in tables[backend] for b in bs]
                wrong_total = sum(r["wrong"] for r in results if r["backend"] == column and r["op"] == op)
                print(f"# Out of bounds values : {wrong_total} {'OK' if wrong_total == 0 else 'FAILED'}\n"
                      f"# Avg bus bandwidth    : {sum(busbws) / max(len(busbws), 1):.4g}\n#", flush=True)
            if per_call:
                print_percentiles([r for r in results if r.get("op") == op and "p99_us" in r], cols, args)
    if "deepspeed" in backends:
        _remove_deepspeed_buffers(rank)
    if rank == 0 and probe is not None:  # where auto's choice (two-shot or one-shot / ring) ended, per size class
        for (nbytes, inplace), st in sorted(comm.resolve_group(None).backend.comm.adapt_state().items()):
            results.append({"backend": "pyzero-auto", "op": "all_reduce", "class_bytes": nbytes, "inplace": inplace,
                            **st})
            print(f"# auto up to {nbytes} B {'in place' if inplace else 'out of place'}: {st['algo']} "
                  f"(tries {st['explored']}, put off {st['put_off']}, met a stall {st['stalled']}, "
                  f"switches {st['switches']})", flush=True)
    if rank == 0:
        for size in sorted({r["bytes"] for r in results if "bytes" in r}):
            results.append({"backend": "memcpy", "op": "memcpy", "bytes": size, "world_size": 1,
                            "busbw": memcpy_gbps(size, max(args.iters, 5)), "inplace": True})
    return results


def _measure_size(runs, starts, calls, count, cols, forms, op, dtype, args, per_call, block, least, t_start) -> None:
    """One round at one size: every backend in turn, each in both forms; appended to runs/starts/calls."""
    for backend in cols:
        for inplace in forms:
            key = (count, backend, inplace)
            starts[key].append(time.perf_counter() - t_start)
            t_us, wrong, times = measure(backend, op, count, dtype, inplace, args.algo, args.iters, args.warmup,
                                         per_call, getattr(args, "graph", 0), block, least)
            runs[key].append((t_us, wrong))
            calls[key] += times


def _size_rows(results, tables, runs, starts, calls, count, cols, op, esize, n, args, per_call, cuda, echo) -> None:
    """One size's rounds as results (json rows) and table lines, per backend; printed with `echo`."""
    nbytes = count * esize
    # nccl-tests' count column is the per-rank count (its paramcount): all_gather's input and
    # reduce_scatter's output are one rank's share of the size, the total buffer
    shown = count // n if op in ("all_gather", "reduce_scatter") else count
    for backend in cols:
        row = []
        for inplace in (False, True):
            key = (count, backend, inplace)
            if key not in runs:
                row += [float("nan"), float("nan"), float("nan"), 0]
                continue
            times = [t for t, _ in runs[key]]
            t_us, wrong = statistics.median(times), sum(w for _, w in runs[key])
            algbw = nbytes / t_us / 1e3
            busbw = algbw * BUS_FACTOR[op](n)
            row += [t_us, algbw, busbw, wrong]
            results.append({"backend": _column(backend, args), "op": op, "dtype": args.dtype,
                            "bytes": nbytes, "count": shown, "world_size": n, "inplace": inplace,
                            "time_us": t_us, "algbw": algbw, "busbw": busbw, "wrong": wrong,
                            "algo": _algo(backend, args), "device": "cuda" if cuda else "cpu",
                            "timing": "per-call median" if per_call else "loop mean",
                            "rounds_time_us": times, "rounds_start_s": starts[key],
                            **({"calls": len(calls[key]), **percentiles(calls[key])} if per_call else {})})
        redop = "sum" if op in ("all_reduce", "reduce_scatter") else "none"
        root = 0 if op == "broadcast" else -1
        line = (" {:>11} {:>12} {:>8} {:>6} {:>6} {:>8.1f} {:>7.2f} {:>7.2f} {:>6} {:>8.1f} {:>7.2f} "
                "{:>7.2f} {:>6}".format(nbytes, shown, NCCL_TYPE[args.dtype], redop, root, *row))
        # (nccl-tests' average bus bandwidth counts both forms' measurements)
        tables[backend].append((line, [b for b in (row[2], row[6]) if not math.isnan(b)]))
        if echo:
            print(line, flush=True)


def print_percentiles(rows: list, cols: list, args) -> None:
    """Each call timed alone: median, p90, p99 and max (us, the slowest rank's each) per size and backend."""
    names = [_column(b, args) for b in cols]
    print("# per call (us; each the slowest rank's), in-place / out-of-place: p50 p90 p99 max")
    print("#{:>11} ".format("size (B)") + " ".join("{:>41}".format(n) for n in names))
    for nbytes in sorted({r["bytes"] for r in rows}):
        cells = []
        for n in names:
            got = {r["inplace"]: r for r in rows if r["bytes"] == nbytes and r["backend"] == n}
            cells.append(" / ".join(" ".join(f"{got[ip][k]:.0f}" for k in ("p50_us", "p90_us", "p99_us", "max_us"))
                                    if ip in got else "-" for ip in (True, False)))
        print(" {:>11} ".format(nbytes) + " ".join("{:>41}".format(c) for c in cells))
    print("#", flush=True)


def _column(backend: str, args) -> str:
    """The results' name for a backend column."""
    cuda = getattr(args, "device", "cpu") == "cuda"
    return "ipc" if cuda and getattr(args, "gpu_backend", "nccl") == "ipc" else backend


def _heading(op: str, backend: str, n: int, args, rounds: int, per_call: bool, several: bool) -> str:
    """A backend's table heading: what runs, how it is timed, then the column names."""
    timing = "each call timed alone, median" if per_call else "mean of back-to-back calls"
    if getattr(args, "graph", 0):
        timing = f"{args.graph} calls captured in a CUDA graph, replays timed per call ({timing.split(',')[0]})"
    if rounds > 1:
        timing += f"; median of {rounds} rounds alternating out-of-place and in-place"
    if getattr(args, "block", 0):
        timing += f", {args.block} calls a round"
    if several:
        timing += ", the backends in turn at each size"
    return f"# {op}, backend {backend} ({_label(backend, args)}), {n} ranks, dtype {args.dtype}, {timing}\n{HEADER}"


def _algo(backend: str, args) -> str:
    """The algorithm a backend column runs (the JSON's "algo")."""
    cuda = getattr(args, "device", "cpu") == "cuda"
    if backend == "torch":
        return "nccl" if cuda else "gloo"
    if backend == "torch-pyzero":
        return "auto"
    if backend == "deepspeed":
        return "deepspeed-shm"
    if backend == "nccl":
        return "native"
    if cuda and getattr(args, "gpu_backend", "nccl") == "ipc":
        return args.algo
    return ("ring" if args.algo == "auto" else args.algo) if cuda else args.algo


def _label(backend: str, args) -> str:
    """What a backend column runs, for the table's heading."""
    cuda = getattr(args, "device", "cpu") == "cuda"
    if backend == "torch":
        return f"torch.distributed, {_algo(backend, args)}"
    if backend == "torch-pyzero":
        return "torch.distributed on the 'pyzero' backend, " + (
            "its CUDA transport (nccl at one rank, ipc on one host)" if cuda else "shm, algo auto")
    if backend == "deepspeed":
        return "DeepSpeed CPU shm all-reduce, deepspeed.comm.inference_all_reduce"
    if backend == "pyzero-fixed":
        return f"pyzero shm backend, algo {_algo(backend, args)}, adaptive=False"
    return f"pyzero {getattr(args, 'gpu_backend', 'nccl') if cuda else 'shm'} backend, algo {_algo(backend, args)}"


# torch.distributed's API over torch's fake backend (a C++ ProcessGroup whose all_reduce and broadcast do
# nothing; its gathers and scatters copy data, so they are left out): what the API itself costs per call,
# the least any backend reached through it can take. In a fresh interpreter, whose default group it becomes.
# torch.testing._internal is not a stable API: None where it is missing.
_FLOOR_SCRIPT = r"""
import json, statistics, sys, time
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
n, dtype, ops = int(sys.argv[1]), getattr(torch, sys.argv[2]), sys.argv[3].split(",")
dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=n)
one = torch.ones(2, dtype=dtype)
calls = {"all_reduce": lambda: dist.all_reduce(one), "broadcast": lambda: dist.broadcast(one, 0)}
out = {}
for op in [op for op in ops if op in calls]:
    f = calls[op]
    for _ in range(500):
        f()
    rounds = []
    for _ in range(9):
        t0 = time.perf_counter()
        for _ in range(2000):
            f()
        rounds.append((time.perf_counter() - t0) / 2000 * 1e6)
    out[op] = statistics.median(rounds)
print(json.dumps(out))
"""


def torch_api_floor(ops, nranks: int, dtype: str) -> dict | None:
    """{op: us per call} of torch.distributed's API over a backend that does nothing (see _FLOOR_SCRIPT)."""
    try:
        done = subprocess.run([sys.executable, "-c", _FLOOR_SCRIPT, str(nranks), dtype, ",".join(ops)],
                              capture_output=True, text=True, timeout=120)
        return json.loads(done.stdout) if done.returncode == 0 else None
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None


def print_ratios(results: list) -> None:
    """In-place, per op and size: pyzero's speed-up over torch (gloo), time(torch) / time(pyzero) (= busbw
    ratio), and what torch.distributed's API on the "pyzero" backend adds over calling pz directly."""
    key = {(r["backend"], r["op"], r["bytes"]): r for r in results if r.get("inplace") and "time_us" in r}
    ordered = sorted(key, key=lambda k: (k[1], k[2]))
    rows = [(op, b, key[("torch", op, b)]["time_us"] / key[("pyzero", op, b)]["time_us"])
            for (be, op, b) in ordered if be == "pyzero" and ("torch", op, b) in key]
    if rows:
        print("# pyzero vs torch (gloo), in-place: time(torch) / time(pyzero) = busbw ratio")
        print("#{:>15} {:>12} {:>10}".format("op", "size (B)", "ratio"))
        for op, b, ratio in rows:
            print(" {:>15} {:>12} {:>10.2f}".format(op, b, ratio))
    rows = [(op, b, key[("pyzero", op, b)]["time_us"], key[("torch-pyzero", op, b)]["time_us"])
            for (be, op, b) in ordered if be == "pyzero" and ("torch-pyzero", op, b) in key]
    if rows:
        floor = {r["op"]: r["time_us"] for r in results if r["backend"] == "torch-api-floor"}
        print("# torch.distributed API on the 'pyzero' backend vs pz direct, in-place; floor: the same torch "
              "call over torch's fake backend (C++, does nothing), the API's own cost with any backend")
        print("#{:>15} {:>12} {:>10} {:>12} {:>10} {:>11} {:>14}".format(
            "op", "size (B)", "pz (us)", "torch (us)", "overhead", "floor (us)", "pz+floor (us)"))
        for op, b, t_pz, t_torch in rows:
            f = floor.get(op, float("nan"))
            print(" {:>15} {:>12} {:>10.1f} {:>12.1f} {:>9.1f}% {:>11.1f} {:>14.1f}".format(
                op, b, t_pz, t_torch, 100 * (t_torch / t_pz - 1), f, t_pz + f))
    rows = [(op, b, key[("pyzero", op, b)]["time_us"], key[("deepspeed", op, b)]["time_us"])
            for (be, op, b) in ordered if be == "pyzero" and ("deepspeed", op, b) in key]
    if rows:
        print("# pyzero vs DeepSpeed's CPU shm all-reduce, in-place: time(deepspeed) / time(pyzero)")
        print("#{:>15} {:>12} {:>10} {:>10} {:>10}".format("op", "size (B)", "pz (us)", "ds (us)", "ratio"))
        for op, b, t_pz, t_ds in rows:
            print(" {:>15} {:>12} {:>10.1f} {:>10.1f} {:>10.2f}".format(op, b, t_pz, t_ds, t_ds / t_pz))


def print_pairs(results: list) -> None:
    """One line per set of ranks and size: its exchange probe (mode, ns per line, the fixed one-shot's time
    at 64 KiB in us), pyzero's in-place per-call median and p99,
    and where measured per call DeepSpeed's (with the ratios time(deepspeed) / time(pyzero)) and
    pyzero-fixed's median (with time(pyzero-fixed) / time(pyzero))."""
    probes = {r["pair"]: r for r in results if r["backend"] == "exchange-probe"}
    rows = {(r["pair"], r["op"], r["bytes"], r["backend"]): r for r in results
            if r.get("inplace") and "p99_us" in r and r["backend"] in ("pyzero", "deepspeed", "pyzero-fixed")}
    if not rows:
        return
    ds = any(k[3] == "deepspeed" for k in rows)
    fx = any(k[3] == "pyzero-fixed" for k in rows)
    print("# every set of ranks, in place, each call timed alone (us): pyzero p50 p99" +
          (", deepspeed p50 p99, time(deepspeed) / time(pyzero) at p50 and p99" if ds else "") +
          (", pyzero-fixed p50, time(pyzero-fixed) / time(pyzero) at p50" if fx else ""))
    print("#{:>4} {:>5} {:>8} {:>8} {:>11} {:>12} {:>8} {:>8}".format("set", "mode", "ns/line", "1s 64K", "op",
                                                                        "size (B)", "pz p50", "pz p99") +
          (" {:>8} {:>8} {:>7} {:>7}".format("ds p50", "ds p99", "p50 x", "p99 x") if ds else "") +
          (" {:>8} {:>7}".format("fx p50", "fx x") if fx else ""))
    for pair, op, nbytes, backend in sorted(k for k in rows if k[3] == "pyzero"):
        pz, pr = rows[(pair, op, nbytes, "pyzero")], probes.get(pair, {})
        line = " {:>4} {:>5} {:>8} {:>8} {:>11} {:>12} {:>8.1f} {:>8.1f}".format(
            pair + 1, pr.get("mode", "-"), f"{pr['ns_per_line']:.2f}" if pr else "-",
            f"{pr['oneshot_64k_us']:.1f}" if pr else "-", op, nbytes, pz["p50_us"], pz["p99_us"])
        d = rows.get((pair, op, nbytes, "deepspeed"))
        if ds:
            line += (" {:>8.1f} {:>8.1f} {:>7.2f} {:>7.2f}".format(d["p50_us"], d["p99_us"], d["p50_us"] / pz["p50_us"],
                                                                 d["p99_us"] / pz["p99_us"]) if d
                     else " {:>8} {:>8} {:>7} {:>7}".format("-", "-", "-", "-"))
        f = rows.get((pair, op, nbytes, "pyzero-fixed"))
        if f:
            line += " {:>8.1f} {:>7.2f}".format(f["p50_us"], f["p50_us"] / pz["p50_us"])
        print(line)
    print("#", flush=True)


def size_inversions(results: list) -> list:
    """Where a per-call median is above that of a larger size (same set of ranks, op, backend and form):
    (pair, op, backend, inplace, size, larger size, median, larger's median, apart), for each size the
    fastest of the larger sizes; `apart`: the inversion is over 2% (the tables' 0.1 us at the smallest
    sizes) and the two sizes' round medians do not overlap in their interquartile ranges (it is larger
    than the rounds' spread; one round has none: not apart); else it lies within the measurement's noise."""
    by = {}
    for r in results:
        if "rounds_time_us" in r and r.get("timing") == "per-call median":
            by.setdefault((r.get("pair", 0), r["op"], r["backend"], r["inplace"]), {})[r["bytes"]] = r
    out = []
    for key, rows in sorted(by.items()):
        sizes = sorted(rows)
        for i, size in enumerate(sizes[:-1]):
            larger = min(sizes[i + 1:], key=lambda z: (rows[z]["time_us"], z))
            t, tl = rows[size]["time_us"], rows[larger]["time_us"]
            if t > tl:
                a, b = rows[size]["rounds_time_us"], rows[larger]["rounds_time_us"]
                apart = t > 1.02 * tl and min(len(a), len(b)) >= 2 and \
                    statistics.quantiles(a, n=4, method="inclusive")[0] > statistics.quantiles(b, n=4, method="inclusive")[2]
                out.append((*key, size, larger, t, tl, apart))
    return out


def fast_rounds(results: list, of: str = "pyzero", against: str = "pyzero-fixed", slow: float = 1.5) -> list:
    """`of`'s round against `against`'s round (the same round of the same set of ranks, size, op and form,
    each a per-call median), over the rounds where both ran fast: under `slow` x their own lower quartile
    of that set's rounds (the inclusive method, as in size_inversions). A slow phase of the machine that
    falls on one backend's block and not on the other's, at a phase's start or end, is left out either
    way, so rounds the fixed ring alone ran fast do not count the phase's end against `of` only. Per op,
    size and form: (op, size, inplace, rounds, median ratio, geometric mean, the set with the highest
    median (its index, median), rounds `of` alone ran slow, rounds `against` alone did, rounds both did);
    a ratio above 1: `of` slower."""
    by = {}
    for r in results:
        if r.get("backend") in (of, against) and len(r.get("rounds_time_us") or ()) >= 2 and \
                r.get("timing") == "per-call median":
            by.setdefault((r["op"], r["bytes"], r["inplace"]), {}).setdefault(r.get("pair", 0), {})[r["backend"]] = \
                r["rounds_time_us"]
    out = []
    for (op, size, inplace), sets in sorted(by.items()):
        ratios, worst, alone = [], None, [0, 0, 0]
        for pair, rows in sorted(sets.items()):
            if of not in rows or against not in rows:
                continue
            a, b = rows[of], rows[against]
            qa = statistics.quantiles(a, n=4, method="inclusive")[0]
            qb = statistics.quantiles(b, n=4, method="inclusive")[0]
            mine = []
            for x, y in zip(a, b):
                sa, sb = x > slow * qa, y > slow * qb
                alone[0 if sa and not sb else 1 if sb and not sa else 2] += sa or sb
                if not (sa or sb):
                    mine.append(x / y)
            if mine:
                ratios += mine
                m = statistics.median(mine)
                worst = (pair, m) if worst is None or m > worst[1] else worst
        if ratios:
            geo = math.exp(sum(map(math.log, ratios)) / len(ratios))
            out.append((op, size, inplace, len(ratios), statistics.median(ratios), geo, worst, *alone))
    return out


def print_fast_rounds(results: list) -> None:
    """The fast rounds of pyzero (auto) against pyzero-fixed, where both ran (fast_rounds)."""
    rows = fast_rounds(results)
    if not rows:
        return
    print("# pyzero / pyzero-fixed per round, over the rounds where both ran fast (under 1.5x their set's lower "
          "quartile): median and geometric mean of the ratios, the set with the highest median; and the rounds "
          "where pyzero alone, pyzero-fixed alone or both ran slow")
    print("#{:>11} {:>12} {:>8} {:>7} {:>7} {:>7} {:>12} {:>7} {:>7} {:>5}".format(
        "op", "size (B)", "form", "rounds", "median", "geo", "worst set", "pz slow", "fx slow", "both"))
    for op, size, inplace, n, med, geo, (pair, wm), sa, sb, both in rows:
        print(" {:>11} {:>12} {:>8} {:>7} {:>7.3f} {:>7.3f} {:>12} {:>7} {:>7} {:>5}".format(
            op, size, "in place" if inplace else "out", n, med, geo, f"{pair + 1}: {wm:.3f}", sa, sb, both))
    print("#", flush=True)


def print_size_order(results: list) -> None:
    """A line per backend: how many per-call medians lie above a larger size's, and how many of them by
    more than the rounds' spread (listed)."""
    inv = size_inversions(results)
    timed = {r["backend"] for r in results if "rounds_time_us" in r and r.get("timing") == "per-call median"}
    if not timed:
        return
    print("# size order, per set of ranks and form: medians above a larger size's median (in all / by over 2% "
          "with the rounds' interquartile ranges apart)")
    for backend in sorted(timed):
        mine = [v for v in inv if v[2] == backend]
        apart = [v for v in mine if v[8]]
        print(f"#   {backend}: {len(mine)} / {len(apart)}" + ("" if not apart else ": " + ", ".join(
            f"set {v[0] + 1} {'in' if v[3] else 'out-of'}-place {v[4]} B {v[6]:.1f} us > {v[5]} B {v[7]:.1f} us"
            for v in apart)))
    print("#", flush=True)


def plot(results: list, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ops = sorted({r["op"] for r in results if r["op"] != "memcpy" and "busbw" in r})
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.2), squeeze=False)
    mem = sorted((r["bytes"], r["busbw"]) for r in results if r["backend"] == "memcpy")
    for ax, op in zip(axes[0], ops):
        for backend in sorted({r["backend"] for r in results if r["op"] == op and "busbw" in r}):
            pts = sorted((r["bytes"], r["busbw"]) for r in results
                         if r["op"] == op and r["backend"] == backend and r["inplace"])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3,
                    label=f"{backend}" + (" (gloo)" if backend == "torch" else ""))
        if mem:
            ax.plot([m[0] for m in mem], [m[1] for m in mem], "k--", lw=1, label="host memcpy (1 core)")
        n = next(r["world_size"] for r in results if r["op"] == op)
        ax.set(xscale="log", xlabel="size (bytes)", ylabel="bus bandwidth (GB/s)", title=f"{op}, {n} ranks, in-place")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _count(op: str, size: int, esize: int, n: int) -> int:
    """Elements of a call of about `size` bytes: whole chunks of n for reduce_scatter and all_gather
    (at least one element each), at least one element otherwise."""
    if op in ("reduce_scatter", "all_gather"):
        return max(size // esize // n * n, n)
    return max(size // esize, 1)


def _backends(args) -> list[str]:
    """--backends as a list; a ValueError naming what is wrong."""
    cuda = getattr(args, "device", "cpu") == "cuda"
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b not in ("pyzero", "torch", "nccl", "torch-pyzero", "deepspeed", "pyzero-fixed") \
                or (b == "nccl" and not cuda) or (b in ("deepspeed", "pyzero-fixed") and cuda):
            raise UsageError(f"--backends: unknown backend {b!r}; expected pyzero, torch, torch-pyzero, "
                             "(cpu) deepspeed, (cpu) pyzero-fixed or (with --device cuda) nccl")
    if not backends or (set(backends) == {"deepspeed"} and not deepspeed_available()):
        raise UsageError(f"--backends: nothing to run in {args.backends!r} (deepspeed is left out where it is not "
                         "installed); expected at least one of pyzero, torch, torch-pyzero, deepspeed, pyzero-fixed"
                         + (", nccl" if cuda else ""))
    if cuda and getattr(args, "gpu_backend", "nccl") == "ipc" and not set(backends) <= {"pyzero", "torch-pyzero"}:
        raise UsageError("--gpu-backend ipc: only --backends pyzero and torch-pyzero (the ranks may share one GPU, "
                         "which NCCL refuses)")
    return backends


def _min_calls(args) -> int:
    least = getattr(args, "min_calls", 0)
    if not is_int(least) or least < 0 or (least and not _block(args)):
        raise UsageError(f"--min-calls: expected a non-negative int, with --block; got {least!r}")
    return least


def _block(args) -> int:
    block = getattr(args, "block", 0)
    if not is_int(block) or block < 0 or (block and not getattr(args, "per_call",
                                                                                                     False)):
        raise UsageError(f"--block: expected a non-negative int, with --per-call; got {block!r}")
    return block


def _rounds(args) -> int:
    rounds = getattr(args, "rounds", 1)
    if not is_int(rounds) or rounds < 1:
        raise UsageError(f"--rounds: expected a positive int, got {rounds!r}")
    return rounds


def main(args) -> int:
    from ..launch import run_ranks  # noqa: PLC0415

    _rounds(args)  # bad input fails here, before any rank starts
    size_steps(parse_size(args.min, "--min"), parse_size(args.max, "--max"), args.factor)
    _backends(args)
    _block(args)
    _min_calls(args)
    graph = getattr(args, "graph", 0)
    if not is_int(graph) or graph < 0:
        raise UsageError(f"--graph: expected a count of calls >= 0, got {graph!r}")
    if graph and getattr(args, "device", "cpu") != "cuda":
        raise UsageError("--graph: CUDA graphs need --device cuda")
    pairs = getattr(args, "pairs", 1)
    if not is_int(pairs) or pairs < 1:
        raise UsageError(f"--pairs: expected a positive int, got {pairs!r}")
    if getattr(args, "op", None) == "sendrecv" and args.nproc is not None and args.nproc < 2:
        raise UsageError(f"--op sendrecv: needs --nproc 2 or more (each rank sends to the next), got {args.nproc}")
    if pairs > 1 and not args.nproc:
        raise UsageError("--pairs: needs --nproc (each set of ranks is started afresh by this process)")
    want, tries = _exchange_mode(args, pairs)
    short = False
    if args.nproc:
        # GPU ranks start as fresh interpreters (CUDA does not survive fork)
        start = "spawn" if getattr(args, "device", "cpu") == "cuda" else "fork"
        results, done = [], 0
        for i in range(tries):
            if done == pairs:
                break
            if want != "any":
                print(f"# ---- set of ranks {i + 1} (fresh processes; {done} of {pairs} in the {want} mode so far, "
                      f"at most {tries} sets) ----", flush=True)
            elif pairs > 1:
                print(f"# ---- set of ranks {i + 1} of {pairs} (fresh processes) ----", flush=True)
            # rank 0's table as it prints it: a run stopped part-way still shows the rows it measured
            res = run_ranks(rank_main, args.nproc, args=(args,), timeout=args.timeout, threads=1, start=start, echo=0)
            skipped = any(r.get("skipped") for r in res[0].value)
            done += not skipped
            if (pairs > 1 or want != "any") and not skipped:
                print_ratios(res[0].value)
            results += [dict(r, pair=i) for r in res[0].value]
        if want != "any":
            short = done < pairs
            print(f"# --exchange-mode {want}: {done} of {pairs} sets of ranks in that mode ran the comparison, "
                  f"{sum(bool(r.get('skipped')) for r in results)} others stopped after their probe"
                  + (f"; {tries} sets tried, FEWER THAN ASKED FOR" if short else ""), flush=True)
        if pairs > 1 or want != "any":
            print_pairs(results)
        print_size_order(results)
        print_fast_rounds(results)
    else:
        import pyzero as pz  # noqa: PLC0415

        results = rank_main(args)
        pz.destroy()
        if int(os.environ.get("RANK", "0")) != 0:
            return 0
    via_torch = [r for r in results if r["backend"] == "torch-pyzero" and getattr(args, "device", "cpu") == "cpu"]
    if via_torch:
        n = via_torch[0]["world_size"]
        floor = torch_api_floor(sorted({r["op"] for r in via_torch}), n, args.dtype)
        if floor is None:
            print("# torch API floor: torch's fake backend (torch.testing._internal) is not available here")
        for op, us in (floor or {}).items():
            results.append({"backend": "torch-api-floor", "op": op, "dtype": args.dtype, "world_size": n,
                            "time_us": us, "algo": "fake", "device": "cpu"})
    if pairs == 1 and want == "any":
        print_ratios(results)
    if args.json:
        write_json(args.json, results, {"command": "collectives", "args": vars(args)})
    if args.plot:
        plot(results, args.plot)
    wrong = sum(r.get("wrong", 0) for r in results)
    return 1 if wrong or short else 0
