"""pyzero-bench faults: a fault-injection matrix, each cell run many times with the fault at a random moment.

Per cell it prints: tries; expected errors (every surviving rank raised the pyzero error the cell is about:
any for a dead or stopped rank, one naming the mismatch for the mismatch cells, a timeout for a rank that
never calls; on nccl any, as NCCL tells neither); hangs (a surviving rank still running at the collective
timeout + margin after the fault); the median and max time from the fault to the error on the surviving
ranks; /dev/shm segments left behind; and data lost or silently wrong (a result that differs from the
reference every rank computes locally, a checkpoint that does not load or is not the state of its step).

Cells with a victim: rank 1 (the pipeline's: rank 0, the first stage, so that the last stage, which checks
each loss, survives) is SIGKILLed or SIGSTOPped by this process at a random moment while every rank
loops over the workload (a large all_reduce, DataParallel forward/backward, ZeRO-3 forward/backward/step,
checkpoint.save, a pipeline step, a fused TP all_gather+matmul). The other cells misbehave in code:
mismatched calls (size, op, dtype, collective kind, algo), a rank that never calls, a write failing
during a save (ENOSPC), a damaged shard on load, NaN/inf gradients under clip_grad_norm_.

    pyzero-bench faults --tries 20                # the whole matrix
    pyzero-bench faults --cells allreduce-kill,never-calls --tries 2
    pyzero-bench faults --overhead                # flight recorder cost on an 8 B all_reduce

The ranks' side (the workloads and their checks) is pyzero.bench.fault_workloads.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import statistics
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass

import torch

import pyzero as pz
from pyzero import _loader
from pyzero.launch import run_ranks

from .common import UsageError
from .fault_workloads import VICTIM, rank_main, reference_params


@dataclass(frozen=True)
class Cell:
    name: str
    work: str  # key of pyzero.bench.fault_workloads.WORKLOADS
    fault: str  # "kill" / "stop": a rank is signalled; "fill" / "readonly": the checkpoint's file system
    # (a small tmpfs) fills up / turns read-only; "code": the ranks misbehave in code
    nproc: int = 2
    note: str = ""
    victim: int = VICTIM  # the rank signalled (rank 0 also hosts the job's store)


CELLS = {c.name: c for c in [
    Cell("allreduce-kill", "allreduce", "kill", note="16 MB all_reduce"),
    Cell("allreduce-stop", "allreduce", "stop"),
    Cell("allreduce-kill-rank0", "allreduce", "kill", note="the store's host dies", victim=0),
    Cell("allreduce-stop-rank0", "allreduce", "stop", victim=0),
    Cell("allreduce-kill-4ranks", "allreduce", "kill", nproc=4),
    Cell("dp-backward-kill", "dp", "kill", note="DataParallel forward/backward, bucketed async all_reduce"),
    Cell("dp-backward-stop", "dp", "stop"),
    Cell("zero3-kill", "zero3", "kill", note="ZeRO-3 forward/backward/step"),
    Cell("zero3-stop", "zero3", "stop"),
    Cell("save-kill", "save", "kill", note="checkpoint.save every step; the checkpoint is checked after"),
    Cell("save-stop", "save", "stop"),
    Cell("save-disk-full", "save", "fill", note="the checkpoint's tmpfs filled up at a random moment (root)"),
    Cell("save-read-only", "save", "readonly", note="the checkpoint's tmpfs remounted read-only (root)"),
    # (the first stage is the victim: the last one, which checks each step's loss, survives to count wrong ones)
    Cell("pipeline-kill", "pipeline", "kill", note="2-stage 1F1B train_step", victim=0),
    Cell("pipeline-stop", "pipeline", "stop", victim=0),
    Cell("tp-fused-kill", "tp", "kill", note="all_gather_matmul (fused, symmetric buffers)"),
    Cell("tp-fused-stop", "tp", "stop"),
    Cell("mismatch-size", "mismatch-size", "code"),
    Cell("mismatch-op", "mismatch-op", "code"),
    Cell("mismatch-dtype", "mismatch-dtype", "code"),
    Cell("mismatch-kind", "mismatch-kind", "code"),
    Cell("mismatch-algo", "mismatch-algo", "code"),
    Cell("never-calls", "never-calls", "code", note="rank 1 sleeps instead of calling"),
    Cell("save-enospc", "save-enospc", "code", note="rank 1's write fails (ENOSPC) at a random save"),
    Cell("load-corrupt", "load-corrupt", "code", note="a random byte of a random shard flipped"),
    Cell("load-truncated", "load-truncated", "code", note="a random shard cut short"),
    Cell("clip-nan", "clip-nan", "code", note="NaN in one rank's gradient"),
    Cell("clip-inf", "clip-inf", "code", note="inf in one rank's gradient"),
]}
FAST = ["allreduce-kill", "dp-backward-stop", "mismatch-kind", "never-calls", "save-enospc", "load-corrupt",
        "clip-inf"]
# The cells each backend runs (--backend): every cell on shm; on the others the collective cells, whose
# workloads put their tensors on the backend's device (ipc: processes sharing GPU 0; nccl: a GPU per rank,
# so 2 GPUs at least, and 4 for the 4-rank cell; hier: simulated hosts of two ranks, one each at 2 ranks,
# gloo between them).
_COLLECTIVE = ["allreduce-kill", "allreduce-stop", "allreduce-kill-4ranks", "mismatch-size", "mismatch-op",
               "mismatch-dtype", "mismatch-kind", "mismatch-algo", "never-calls"]
BACKEND_CELLS = {"shm": list(CELLS), "hier": _COLLECTIVE + ["dp-backward-kill", "dp-backward-stop"],
                 "ipc": _COLLECTIVE, "nccl": _COLLECTIVE}


# ---------------------------------------------------------------------------
# The harness


def _shm_leftovers(rank0_pid: int | None) -> list[str]:
    if rank0_pid is None or not os.path.isdir("/dev/shm"):
        return []
    # Segment names start with the job's token: rank 0's pid in hex, then 8 random hex digits.
    mine = re.compile(f"^pz{rank0_pid:x}[0-9a-f]{{8}}_")
    return [n for n in os.listdir("/dev/shm") if mine.match(n)]


def _read_pid(tmp, r):
    try:
        with open(os.path.join(tmp, f"pid{r}")) as f:
            return int(f.read())
    except (OSError, ValueError):
        return None


def _kill(pid, sig=signal.SIGKILL):
    if pid is None:
        return
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


class Skip(Exception):
    """The cell cannot run here (e.g. mounting a tmpfs needs root)."""


def _mount_tmpfs(path: str, mb: int) -> None:
    os.makedirs(path, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "tmpfs", path], capture_output=True,
                          text=True)
    if proc.returncode != 0:
        raise Skip(f"cannot mount a tmpfs ({proc.stderr.strip() or proc.returncode}; needs root)")


def _umount(path: str) -> None:
    if subprocess.run(["umount", path], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", path], capture_output=True)


def _fill(path: str, stop: threading.Event) -> None:
    """Keep the file system of `path` full until `stop` (space a save frees, deleting old steps, is taken
    back at once)."""
    chunk = b"\0" * (4 << 10)
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        while not stop.is_set():
            try:
                f.write(chunk)
            except OSError:
                time.sleep(0.0005)


def _read_only(path: str) -> None:
    """Remount `path` read-only; refused while a file is open for writing, so retried until it takes."""
    deadline = time.monotonic() + 10
    while subprocess.run(["mount", "-o", "remount,ro", path], capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"could not remount {path} read-only")
        time.sleep(0.001)


def run_try(cell: Cell, seed: int, timeout: float, margin: float, window: float, backend: str = "shm") -> dict:
    """One try of `cell`: returns {"outcome", "fault_to_error": [s per surviving rank], "leftovers", "wrong",
    "messages"}."""
    tmp = tempfile.mkdtemp(prefix="pyzero-faults-")
    fs = cell.fault in ("fill", "readonly")
    if fs:
        try:
            _mount_tmpfs(os.path.join(tmp, "ckpt"), 8)
        except Skip:
            _rmtree(tmp)
            raise
    rng = random.Random(seed)
    n = cell.nproc
    duration = window + timeout + margin + 5
    results: list = []
    # GPU ranks start as fresh interpreters: this process has asked CUDA for its devices, and a fork
    # of it sees none.
    start = "spawn" if backend in ("ipc", "nccl") else "fork"
    holder = threading.Thread(target=lambda: results.extend(run_ranks(
        rank_main, n, args=(cell.work, tmp, seed, timeout, duration, backend), check=False,
        timeout=duration + 60, start=start)), daemon=True)
    holder.start()
    has_victim = cell.fault in ("kill", "stop") or cell.work == "never-calls"
    victim = cell.victim if cell.fault in ("kill", "stop") else VICTIM
    survivors = [r for r in range(n) if not (has_victim and r == victim)]
    t_fault = None
    ready_deadline = time.monotonic() + 60
    while not all(os.path.exists(os.path.join(tmp, f"ready{r}")) for r in range(n)):
        if time.monotonic() > ready_deadline or not holder.is_alive():
            break
        time.sleep(0.01)
    pids = {r: _read_pid(tmp, r) for r in range(n)}
    if not all(os.path.exists(os.path.join(tmp, f"ready{r}")) for r in range(n)):
        # The job never started (e.g. another process took the store's port): not a try of the cell.
        for r in range(n):
            _kill(pids[r])
        holder.join(timeout=120)
        if fs:
            _umount(os.path.join(tmp, "ckpt"))
        _rmtree(tmp)
        tails = [f"rank {x.rank} (exit {x.exitcode}): {x.output.strip().splitlines()[-1][:200]}"
                 for x in results if x.output.strip()]
        return {"setup_failed": True, "messages": tails}
    if cell.fault in ("kill", "stop"):
        time.sleep(rng.uniform(0.0, window))
        t_fault = time.time()
        _kill(pids[victim], signal.SIGKILL if cell.fault == "kill" else signal.SIGSTOP)
    elif fs:
        stop_fill = threading.Event()
        time.sleep(rng.uniform(0.0, window))
        t_fault = time.time()
        if cell.fault == "fill":
            threading.Thread(target=_fill, args=(os.path.join(tmp, "ckpt"), stop_fill), daemon=True).start()
        else:
            _read_only(os.path.join(tmp, "ckpt"))
    # Wait for the surviving ranks: each writes done<r> when it returns or fails.
    hang = False
    start = time.monotonic()
    limit = (window + timeout + margin + 5) if cell.fault == "code" else (timeout + margin)
    while not all(os.path.exists(os.path.join(tmp, f"done{r}")) for r in survivors):
        if not holder.is_alive():
            break
        if time.monotonic() - start > limit:
            hang = True
            break
        time.sleep(0.01)
    if cell.fault == "fill":
        stop_fill.set()
    if hang:
        for r in survivors:
            if not os.path.exists(os.path.join(tmp, f"done{r}")):
                _kill(pids[r], signal.SIGUSR1)
        time.sleep(0.5)
    for r in range(n):  # the victim (stopped or not) and, after a hang, everything else
        if (has_victim and r == victim) or hang:
            _kill(pids[r])
    holder.join(timeout=120)
    rank_out = {}
    for r in range(n):
        p = os.path.join(tmp, f"done{r}")
        if os.path.exists(p):
            with open(p) as f:
                rank_out[r] = json.load(f)
    time.sleep(0.05)
    leftovers = _shm_leftovers(pids.get(0))
    res = {"setup_failed": False, "hang": hang, "leftovers": len(leftovers), "wrong": 0, "fault_to_error": [],
           "messages": [], "expected": False}
    for r in survivors:
        o = rank_out.get(r)
        if o is None:
            if hang:  # what the hung rank last printed (a stack dump: faulthandler, see _rank_main)
                out = next((x.output for x in results if x.rank == r), "")
                res["messages"].append(f"rank {r} hung: {out.strip()[-1500:]}")
            continue
        res["wrong"] += int(o.get("wrong", 0))
        err = o.get("error")
        t0 = t_fault if t_fault is not None else o.get("t_fault")
        if err is not None and t0 is not None and "t_error" in o:
            res["fault_to_error"].append(max(0.0, float(o["t_error"]) - float(t0)))
        if err is not None:
            res["messages"].append(f"rank {r}: {err[0]}: {err[1].splitlines()[0][:300]}")
    errs = [rank_out.get(r, {}).get("error") for r in survivors]
    res["expected"] = not hang and all(_error_expected(cell, backend, e) for e in errs)
    res["wrong"] += _check_after(cell, tmp, rank_out, res)
    if fs:
        _umount(os.path.join(tmp, "ckpt"))
    _rmtree(tmp)
    return res


def _error_expected(cell: Cell, backend: str, err) -> bool:
    """Whether a surviving rank's error (type name, message) is the one the cell is about: a pyzero error
    for a dead or stopped rank; one naming the mismatch for the mismatch cells and a timeout for a rank
    that never calls (a timeout or a dead rank's error would pass a mismatch cell that detects nothing),
    except on the nccl backend, where NCCL tells neither: its watchdog aborts after the timeout."""
    if err is None or err[0].startswith("unexpected"):
        return False
    if backend == "nccl":
        return True
    if cell.work.startswith("mismatch-"):
        return "mismatch" in err[1].lower()
    if cell.work == "never-calls":
        return "Timeout" in err[0] or "timed out" in err[1]
    return True


def _check_after(cell: Cell, tmp: str, rank_out: dict, res: dict) -> int:
    """Checkpoint cells: the checkpoint left behind loads (checksums verified) and holds its step's state,
    and a save a rank saw complete has left one."""
    if cell.work not in ("save", "save-enospc"):
        return 0
    ckpt = os.path.join(tmp, "ckpt")
    if not os.path.exists(os.path.join(ckpt, "latest")):
        saved = max([int(o.get("saved", 0)) for o in rank_out.values()]
                    + [int(o["fail_at"]) - 1 for o in rank_out.values() if "fail_at" in o] + [0])
        if saved >= 1:  # (else the fault came before the first save completed: nothing to lose)
            res["messages"].append(f"no checkpoint left, though step {saved}'s save completed")
            return 1
        return 0
    try:
        with open(os.path.join(ckpt, "latest")) as f:
            step = int(f.read().strip().rsplit("_", 1)[1])
        sd = pz.checkpoint.consolidate(ckpt)
    except Exception as e:  # noqa: BLE001
        res["messages"].append(f"checkpoint does not load: {type(e).__name__}: {e}")
        return 1
    want = reference_params(step)
    bad = [n for n in want if not torch.allclose(sd[n], want[n], rtol=1e-4, atol=1e-5)]
    if bad:
        res["messages"].append(f"checkpoint step {step} differs from its reference in {bad[:3]}")
    if cell.work == "save-enospc":
        fail_at = next((o["fail_at"] for o in rank_out.values() if "fail_at" in o), None)
        if fail_at is not None and step != fail_at - 1:
            res["messages"].append(f"latest is step {step}, expected {fail_at - 1} (the save of {fail_at} failed)")
            return 1
    return int(bool(bad))


def _rmtree(path):
    import shutil  # noqa: PLC0415

    shutil.rmtree(path, ignore_errors=True)


def run_cell(cell: Cell, tries: int, seed: int = 0, timeout: float = 3.0, margin: float = 10.0,
             window: float = 1.0, backend: str = "shm") -> dict:
    """`tries` tries of `cell`; the row of the table."""
    reference_params(1)  # the first optimizer step imports much of torch: once here, not in every rank
    rows, setup_failures, i = [], [], 0
    while len(rows) < tries and len(setup_failures) < 3 + tries:
        try:
            r = run_try(cell, seed * 100003 + i, timeout, margin, window, backend)
        except Skip as e:
            return {"cell": cell.name, "tries": 0, "expected": 0, "hangs": 0, "median_s": None, "max_s": None,
                    "leftovers": 0, "wrong": 0, "messages": [], "restarts": 0, "unexpected": [],
                    "skipped": str(e)}
        i += 1
        (setup_failures if r["setup_failed"] else rows).append(r)
    if len(rows) < tries:
        raise RuntimeError(f"{cell.name}: the ranks could not be started ({setup_failures[-1]['messages']})")
    times = [t for r in rows for t in r["fault_to_error"]]
    return {"cell": cell.name, "tries": tries, "expected": sum(r["expected"] for r in rows),
            "hangs": sum(r["hang"] for r in rows),
            "median_s": statistics.median(times) if times else None, "max_s": max(times) if times else None,
            "leftovers": sum(r["leftovers"] for r in rows), "wrong": sum(r["wrong"] for r in rows),
            "messages": sorted({m for r in rows for m in r["messages"]})[:6], "restarts": len(setup_failures),
            "restart_reasons": [m for f in setup_failures for m in f["messages"]][:4],
            "unexpected": [m for r in rows if not r["expected"] for m in r["messages"]][:4]}


HEADER = ("cell", "tries", "expected errors", "hangs", "fault->error median s", "max s", "shm leftovers",
          "lost/wrong")


def format_row(row: dict) -> str:
    if row.get("skipped"):
        return f"| {row['cell']} | skipped: {row['skipped']} | | | | | | |"

    def s(v):
        return "-" if v is None else f"{v:.2f}"
    return (f"| {row['cell']} | {row['tries']} | {row['expected']} | {row['hangs']} | {s(row['median_s'])} | "
            f"{s(row['max_s'])} | {row['leftovers']} | {row['wrong']} |")


# ---------------------------------------------------------------------------
# Flight recorder overhead


def _rank_overhead(iters: int, rounds: int) -> dict:
    from pyzero import flight  # noqa: PLC0415

    pz.init(backend="shm", timeout=60)
    g = pz.comm.resolve_group(None)
    t = torch.zeros(2)  # 8 bytes
    on, off = g.flight, flight.NullRing(g.gid, g.ranks, g.rank, 1)
    times = {"on": [], "off": []}
    for _ in range(iters):
        pz.all_reduce(t)
    recorded = 0
    for r in range(rounds):
        for mode in (("on", "off") if r % 2 else ("off", "on")):
            g.flight = g.backend.flight = on if mode == "on" else off
            pz.barrier()
            n0 = on.n
            t0 = time.perf_counter()
            for _ in range(iters):
                pz.all_reduce(t)
            times[mode].append((time.perf_counter() - t0) / iters)
            recorded += on.n - n0
    g.flight = g.backend.flight = on
    if recorded != rounds * iters:  # every timed call of the "on" rounds, none of the "off" ones
        raise RuntimeError(f"the flight ring recorded {recorded} calls, expected {rounds * iters}")
    return {"on": statistics.median(times["on"]), "off": statistics.median(times["off"]),
            "on_all": times["on"], "off_all": times["off"], "recorded": recorded}


def overhead(nproc: int = 2, iters: int = 5000, rounds: int = 40) -> dict:
    """Rounds of `iters` 8 B all_reduces alternate recorder on and off; the overhead is the median over
    rounds of on/off in each adjacent pair (a 2-core machine drifts more than the effect between
    rounds far apart), and the spread is its interquartile range."""
    res = run_ranks(_rank_overhead, nproc, args=(iters, rounds), timeout=600)[0].value
    ratios = sorted(a / b for a, b in zip(res["on_all"], res["off_all"]))
    q = statistics.quantiles(ratios, n=4)
    res["overhead_pct"] = 100.0 * (statistics.median(ratios) - 1)
    res["overhead_iqr_pct"] = (100.0 * (q[0] - 1), 100.0 * (q[2] - 1))
    return res


# ---------------------------------------------------------------------------


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tries", type=int, default=20, help="tries per cell (default 20)")
    p.add_argument("--cells", default="all", help="comma-separated cell names, 'all' or 'fast' (default all: "
                   "the backend's cells)")
    p.add_argument("--backend", default="shm", choices=sorted(BACKEND_CELLS),
                   help="the backend every cell runs on (default shm; ipc needs a GPU)")
    p.add_argument("--timeout", type=float, default=3.0, help="pz.init collective timeout in s (default 3)")
    p.add_argument("--margin", type=float, default=10.0, help="a run outliving timeout + margin is a hang")
    p.add_argument("--window", type=float, default=1.0, help="the fault lands at uniform(0, window) s")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="also write the rows to this JSON file")
    p.add_argument("--overhead", action="store_true", help="measure the flight recorder on an 8 B all_reduce")
    p.add_argument("--iters", type=int, default=5000, help="--overhead: all_reduces per round")
    p.add_argument("--rounds", type=int, default=40, help="--overhead: rounds per mode, interleaved")


def main(args) -> int:
    if args.overhead:
        res = overhead(iters=args.iters, rounds=args.rounds)
        lo, hi = res["overhead_iqr_pct"]
        print(f"8 B all_reduce, 2 ranks, {args.iters} calls x {len(res['on_all'])} interleaved rounds per mode: "
              f"recorder off {res['off'] * 1e6:.3f} us, on {res['on'] * 1e6:.3f} us (medians); on/off per pair of "
              f"rounds: median {res['overhead_pct']:+.2f} % (quartiles {lo:+.2f} % .. {hi:+.2f} %); "
              f"{res['recorded']} calls recorded")
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
        return 0
    mine = BACKEND_CELLS[args.backend]
    names = mine if args.cells == "all" else [n for n in FAST if n in mine] if args.cells == "fast" else \
        args.cells.split(",")
    unknown = [n for n in names if n not in mine]
    if unknown:
        raise UsageError(f"--cells: {unknown} not run on backend {args.backend}; expected some of {mine}")
    if args.backend in ("ipc", "nccl"):
        need = max(CELLS[n].nproc for n in names) if args.backend == "nccl" and not _loader.test_nccl_loaded() else 1
        if torch.cuda.device_count() < need:
            raise SystemExit(f"--backend {args.backend}: {need} CUDA device(s) needed for these cells, "
                             f"found {torch.cuda.device_count()}")
        if args.backend not in pz.backends.available():
            raise SystemExit(f"--backend {args.backend}: this build of pyzero has no CUDA backends "
                             "(build with PYZERO_CUDA=1)")
    if args.tries < 1:
        raise UsageError(f"--tries: expected >= 1, got {args.tries}")
    print(f"pyzero fault matrix, backend {args.backend}: {args.tries} tries per cell, collective timeout {args.timeout} s, "
          f"hang = no error within timeout + {args.margin} s, fault at uniform(0, {args.window}) s")
    print("| " + " | ".join(HEADER) + " |")
    print("|" + "---|" * len(HEADER))
    rows = []
    for name in names:
        row = run_cell(CELLS[name], args.tries, args.seed, args.timeout, args.margin, args.window, args.backend)
        rows.append(row)
        print(format_row(row), flush=True)
    notes = [(r["cell"], m) for r in rows for m in (r["unexpected"] or r["messages"]) if r["wrong"] or r["hangs"]
             or r["expected"] < r["tries"]]
    notes += [(r["cell"], f"{r['restarts']} tries restarted, the ranks did not start: {r['restart_reasons']}")
              for r in rows if r["restarts"]]
    for cell, m in notes:
        print(f"  {cell}: {m}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    bad = sum(r["hangs"] + r["wrong"] + r["leftovers"] + (r["tries"] - r["expected"]) for r in rows)
    return 1 if bad else 0
