"""pyzero-bench tp: all-gather+matmul and matmul+reduce-scatter, ring-overlapped vs not.

For each width, every rank times five things, interleaved (each round runs
each once, after a barrier; median over --iters, then the slowest rank): the
collective alone, the matmul alone, the two one after the other ("serial":
pz.all_gather then one matmul, or one matmul then pz.reduce_scatter), the
overlapped op as pz.tp runs it (pz.tp.all_gather_matmul /
pz.tp.matmul_reduce_scatter; on shm: ring order over symmetric buffers,
peers' blocks read in place) and the same op over the send/recv ring
(PYZERO_SYMMETRIC=0). speedup = serial / overlapped, ring x = serial /
ring; balance = comm / matmul, and overlap can only pay where balance is
near 1. Before each timed call every rank writes --flush-mib of scratch
memory (as triton's do_bench clears the cache) and then rewrites that
call's own input (x for the ops and the serial pairs; the gathered x or
the product p for the matmul or the collective alone), so every variant
starts alike: its input just produced, as by the layer before in
training, everything else out of the caches, rather than in whatever
state the variant timed before it left them. (--flush-mib 0 leaves that
state as it is.)

Shapes, n ranks, M = --rows rows per rank, H = --hidden:
    all_gather_matmul:      x_shard (M, H) gathered to (n*M, H), weight (width, H)
    matmul_reduce_scatter:  x (n*M, width), weight (H, width), output (M, H)
The communicated feature dim is H; --widths sweeps the other one, which sets
the matmul's cost per communicated byte. On CPU each rank's matmul uses one
thread (run_ranks threads=1) and the copies run on pyzero's comm threads.

The shm copies need CPU time of their own: where every core already runs a
rank's matmul (2 ranks on 2 cores) they take it from the matmul, and the
send/recv ring (three copies per block: into its shm slot, out, and the
serial path's own) cannot beat the serial pair; symmetric buffers copy each
block once. ``--compute sleep`` swaps the matmul for a sleep of its
measured time, which shows the schedule's gain when compute leaves the CPU
free (a GPU, or a machine with spare cores per rank).
"""
from __future__ import annotations

import math
import time

import torch

from .common import UsageError, choice_list, interleaved_medians, number_list, write_json

OPS = ("all_gather_matmul", "matmul_reduce_scatter")
COMPUTES = ("matmul", "sleep")


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--rows", type=int, default=1024, help="rows (tokens) per rank, M")
    p.add_argument("--hidden", type=int, default=1024, help="communicated feature dim, H")
    p.add_argument("--widths", default="4,8,16,32,64",
                   help="comma list of the non-communicated dim (weight rows for all-gather+matmul, "
                        "weight columns for matmul+reduce-scatter)")
    p.add_argument("--ops", default=",".join(OPS), help=f"comma list of {OPS}")
    p.add_argument("--compute", default="matmul,sleep",
                   help="comma list: matmul (the real op), sleep (the matmul's time as a sleep: the schedule's "
                        "gain when compute leaves the CPU free, as on a GPU)")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--flush-mib", type=float, default=64.0,
                   help="scratch written before each timed call to evict the caches (0: none)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)


def _medians_us(fns, iters: int, warmup: int, flush_mib: float = 0.0, inputs=None) -> list[float]:
    """interleaved_medians in microseconds. With `flush_mib`, each call starts after that
    many MiB of writes evicted the caches and its inputs (inputs[i], a tuple of tensors,
    for fns[i]) were rewritten."""
    inputs = inputs or [()] * len(fns)
    scratch = torch.empty(int(flush_mib * 2**20) // 4)

    def before(i):
        if flush_mib:
            scratch.fill_(1.0)
            for t in inputs[i]:
                t.mul_(1.0)

    return [t * 1e6 for t in interleaved_medians(fns, iters, warmup, before)]


def _cases(op: str, n: int, rows: int, hidden: int, width: int, sleep_s: float | None, ring_grp):
    """(comm, compute, serial, overlapped, ring, check) closures over preallocated buffers,
    and the input tensors the timing loop rewrites before each call.

    With `sleep_s`, compute is a sleep of that long (split over the n blocks in
    the ring), standing in for compute that does not need the CPU (a GPU)."""
    import pyzero as pz  # noqa: PLC0415
    from ..tp.overlap import gather_blocks, reduce_scatter_blocks  # noqa: PLC0415

    grp = pz.comm.resolve_group(None)
    g = torch.Generator().manual_seed(pz.get_rank())
    ag = op == "all_gather_matmul"
    # Both sides allocate what they return and reuse their intermediates (the ring
    # keeps scratch buffers per group), so page faults weigh the same on both.
    if ag:
        x = torch.randn(rows, hidden, generator=g)
        w = torch.randn(width, hidden, generator=g)
        x_all = torch.empty(n * rows, hidden)

        def comm():
            pz.all_gather(x_all, x)

        def mm():
            return torch.matmul(x_all, w.t())  # (n*M, H) @ (H, width) -> (n*M, width)

        def overlapped(grp=grp):
            if sleep_s is None:
                return pz.tp.all_gather_matmul(x, w, group=grp)
            return gather_blocks(x, grp, lambda c, block: time.sleep(sleep_s / n))
    else:
        x = torch.randn(n * rows, width, generator=g)
        w = torch.randn(hidden, width, generator=g)
        p = torch.empty(n * rows, hidden)

        def comm():
            y = torch.empty(rows, hidden)
            pz.reduce_scatter(y, p)
            return y

        def mm():
            torch.matmul(x, w.t(), out=p)  # (n*M, width) @ (width, H) -> (n*M, H)

        def overlapped(grp=grp):
            if sleep_s is None:
                return pz.tp.matmul_reduce_scatter(x, w, group=grp)
            return reduce_scatter_blocks(lambda c, out: time.sleep(sleep_s / n), rows, hidden, x, grp)

    compute = mm if sleep_s is None else (lambda: time.sleep(sleep_s))

    def serial():
        if ag:
            comm()
            return compute()
        compute()
        return comm()

    def ring():  # the same op over the send/recv ring (a group with symmetric buffers off)
        return overlapped(ring_grp)

    def check() -> float:
        if sleep_s is not None:
            return 0.0  # nothing computed
        y = serial()
        return max(float((f() - y).abs().max() / y.abs().max().clamp_min(1e-30)) for f in (overlapped, ring))

    # Each variant's own input (see the module docstring): comm, compute, serial, overlapped, ring.
    inputs = [(x,), (x_all,), (x,), (x,), (x,)] if ag else [(p,), (x,), (x,), (x,), (x,)]
    return (comm, compute, serial, overlapped, ring, check), inputs


def rank_main(args) -> list[dict]:
    import pyzero as pz  # noqa: PLC0415

    pz.init(backend="shm", timeout=args.timeout)
    n, rank = pz.get_world_size(), pz.get_rank()
    ops = choice_list(args.ops, OPS, "--ops")
    computes = choice_list(args.compute, COMPUTES, "--compute")
    widths = number_list(args.widths, "--widths")
    ring_grp = pz.new_group(range(n), options={"symmetric": False})  # the send/recv ring variant
    results = []
    if rank == 0:
        print(f"# {n} ranks, M={args.rows} rows/rank, H={args.hidden}, fp32, median of {args.iters}, slowest rank, "
              + (f"caches flushed with {args.flush_mib:g} MiB before each call" if args.flush_mib else
                 "caches not flushed"))
        print("#{:>22} {:>7} {:>6} {:>10} {:>10} {:>10} {:>10} {:>8} {:>8} {:>8} {:>7} {:>9}".format(
            "op", "compute", "width", "comm us", "compute us", "serial us", "overlap us", "ring us", "balance",
            "speedup", "ring x", "rel err"))
    with torch.no_grad():
        for op in ops:
            for width in widths:
                for compute_kind in computes:
                    sleep_s = None if compute_kind == "matmul" else _matmul_us(op, n, args, width, ring_grp) / 1e6
                    fns, inputs = _cases(op, n, args.rows, args.hidden, width, sleep_s, ring_grp)
                    comm, compute, serial, overlapped, ring, check = fns
                    err = worst_over_ranks(check())
                    names = ("comm", "compute", "serial", "overlap", "ring")
                    t = dict(zip(names, _medians_us([comm, compute, serial, overlapped, ring], args.iters,
                                                    args.warmup, args.flush_mib, inputs)))
                    row = {"op": op, "compute": compute_kind, "world_size": n, "rows": args.rows,
                           "hidden": args.hidden, "width": width, "comm_us": t["comm"], "compute_us": t["compute"],
                           "serial_us": t["serial"], "overlap_us": t["overlap"], "ring_us": t["ring"],
                           "balance": t["comm"] / t["compute"], "speedup": t["serial"] / t["overlap"],
                           "ring_speedup": t["serial"] / t["ring"], "rel_err": err}
                    results.append(row)
                    if rank == 0:
                        print(" {:>22} {:>7} {:>6} {:>10.0f} {:>10.0f} {:>10.0f} {:>10.0f} {:>8.0f} {:>8.2f} {:>8.2f} "
                              "{:>7.2f} {:>9.1e}".format(op, compute_kind, width, row["comm_us"], row["compute_us"],
                                                         row["serial_us"], row["overlap_us"], row["ring_us"],
                                                         row["balance"], row["speedup"], row["ring_speedup"], err),
                              flush=True)
    return results


def worst_over_ranks(err: float) -> float:
    """The largest of every rank's `err` (each rank checks its own output; NaN counts as inf), on every rank."""
    import pyzero as pz  # noqa: PLC0415

    from .common import comm_device  # noqa: PLC0415

    t = torch.tensor([err if err == err else math.inf], dtype=torch.float64, device=comm_device())
    pz.all_reduce(t, op="max")
    return float(t[0])


def wrong_rows(per_rank: list[list[dict]], tol: float = 1e-4) -> list[dict]:
    """The rows of any rank whose overlapped or ring result is off the serial one by rel_err >= tol (or NaN)."""
    return [r for rows in per_rank for r in rows if not r["rel_err"] < tol]


def _matmul_us(op: str, n: int, args, width: int, ring_grp) -> float:
    """The measured matmul time of this shape, which the sleep stand-in reproduces."""
    fns, inputs = _cases(op, n, args.rows, args.hidden, width, None, ring_grp)
    return _medians_us([fns[1]], args.iters, args.warmup, args.flush_mib, [inputs[1]])[0]


def plot(results: list, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    ops = [o for o in OPS if any(r["op"] == o for r in results)]
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4.2), squeeze=False)
    for ax, op in zip(axes[0], ops):
        for kind in COMPUTES:
            rows = sorted((r for r in results if r["op"] == op and r["compute"] == kind), key=lambda r: r["width"])
            if not rows:
                continue
            line, = ax.plot([r["width"] for r in rows], [r["speedup"] for r in rows], marker="o", ms=3,
                            label=f"compute = {kind}, symmetric buffers")
            ax.plot([r["width"] for r in rows], [r["ring_speedup"] for r in rows], marker="x", ms=3, ls="--",
                    color=line.get_color(), label=f"compute = {kind}, send/recv ring")
            for r in rows:
                ax.annotate(f"comm/compute {r['balance']:.2f}", (r["width"], r["speedup"]), textcoords="offset points",
                            xytext=(0, 6), ha="center", fontsize=7)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.2, color="k", lw=0.8, ls=":")
        r0 = next(r for r in results if r["op"] == op)
        ax.set_xscale("log", base=2)
        ax.set(xlabel="width (non-communicated dim)", ylabel="speedup: serial / overlapped",
               title=f"{op}, {r0['world_size']} ranks, M={r0['rows']}, H={r0['hidden']}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    from ..launch import run_ranks  # noqa: PLC0415

    if args.nproc < 2:
        raise UsageError(f"--nproc: expected >= 2 (the ops communicate), got {args.nproc}")
    choice_list(args.ops, OPS, "--ops")  # (read again by the ranks)
    choice_list(args.compute, COMPUTES, "--compute")
    number_list(args.widths, "--widths")
    res = run_ranks(rank_main, args.nproc, args=(args,), timeout=args.timeout, threads=1)
    print(res[0].output, end="")
    results = res[0].value
    for op in OPS:
        for kind in COMPUTES:
            rows = [r for r in results if r["op"] == op and r["compute"] == kind]
            if rows:  # the width where comm and compute are closest is where overlap can pay most
                r = min(rows, key=lambda r: abs(math.log(r["balance"])))
                print(f"# {op}, compute={kind}: speedup {r['speedup']:.2f}x at width {r['width']} "
                      f"(comm/compute {r['balance']:.2f}; send/recv ring {r['ring_speedup']:.2f}x); "
                      f"best {max(x['speedup'] for x in rows):.2f}x")
    if args.json:
        write_json(args.json, results, {"command": "tp", "args": vars(args)})
    if args.plot:
        plot(results, args.plot)
    bad = wrong_rows([r.value for r in res])  # (every rank's: each checked its own output)
    for r in bad:
        print(f"# wrong: {r['op']}, compute={r['compute']}, width {r['width']}: rel_err {r['rel_err']:.3e} "
              "(largest over the ranks)")
    return 1 if bad else 0
