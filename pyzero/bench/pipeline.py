"""pyzero-bench pipeline: pipeline utilisation vs micro-batch count, GPipe and 1F1B.

An MLP of --layers blocks (Linear(H, H) + ReLU) is split into --nproc
stages, one per rank. For each schedule and micro-batch count m, every rank
runs --steps timed train_steps on a batch of m x --mb-size rows (so each
micro-batch costs the same, whatever m) and reports its pipe.stats: busy
time (its forward/backward compute) and idle time (the rest of the step).
utilisation = 1 - measured bubble, averaged over stages (median over steps),
next to the ideal m / (m + p - 1). max_inflight is the activation memory in
micro-batches: m for GPipe, at most p for 1F1B.

The gap to the formula is per-message cost (the shm copy and the waits) and
unequal stages: the last stage also computes the loss. On a CPU box the
stages also compete for cores (2 ranks on 2 cores leave none for the comm
threads), so ``--compute sleep`` swaps each stage for a sleep of
--sleep-ms forward and twice that backward: the schedule's own utilisation
when compute leaves the CPU free, as on a GPU.
"""
from __future__ import annotations

import itertools
import statistics
import time

import torch

from .common import UsageError, choice_list, number_list, write_json

SCHEDULES = ("gpipe", "1f1b")
COMPUTES = ("matmul", "sleep")


def add_arguments(p) -> None:
    p.add_argument("--nproc", type=int, default=2, help="pipeline stages = ranks to spawn (default 2)")
    p.add_argument("--microbatches", default="1,2,4,8,16", help="comma list of micro-batch counts m")
    p.add_argument("--schedules", default=",".join(SCHEDULES), help=f"comma list of {SCHEDULES}")
    p.add_argument("--hidden", type=int, default=512, help="MLP width H")
    p.add_argument("--layers", type=int, default=8, help="Linear+ReLU blocks in the whole model (split over stages)")
    p.add_argument("--mb-size", type=int, default=32, help="rows per micro-batch")
    p.add_argument("--compute", default="matmul",
                   help="comma list: matmul (the MLP), sleep (a stage that sleeps --sleep-ms forward, twice that "
                        "backward: the schedule alone, as when compute leaves the CPU free)")
    p.add_argument("--sleep-ms", type=float, default=4.0, help="forward time per micro-batch of a sleep stage")
    p.add_argument("--steps", type=int, default=10, help="timed train_steps per point")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)


def make_mlp(hidden: int, layers: int) -> torch.nn.Sequential:
    torch.manual_seed(0)
    blocks = []
    for _ in range(layers):
        blocks += [torch.nn.Linear(hidden, hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*blocks)


class _Sleep(torch.autograd.Function):
    """Identity that sleeps: forward fwd_s, backward 2 fwd_s. `w` only makes the output need a gradient."""

    @staticmethod
    def forward(ctx, x, w, fwd_s):
        ctx.fwd_s = fwd_s
        time.sleep(fwd_s)
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        time.sleep(2 * ctx.fwd_s)
        return g, torch.zeros(1), None


class SleepStage(torch.nn.Module):
    def __init__(self, fwd_s: float):
        super().__init__()
        self.fwd_s = fwd_s
        self.w = torch.nn.Parameter(torch.zeros(1))

    def forward(self, x):
        return _Sleep.apply(x, self.w, self.fwd_s)


def rank_main(args) -> list[dict]:
    """This stage's median stats per (compute, schedule, m)."""
    import pyzero as pz  # noqa: PLC0415

    pz.init(backend="shm", timeout=args.timeout)
    p, rank = pz.get_world_size(), pz.get_rank()
    stages = {"matmul": pz.pipeline.split_sequential(make_mlp(args.hidden, args.layers), p)[rank],
              "sleep": SleepStage(args.sleep_ms / 1e3)}
    g = torch.Generator().manual_seed(1)
    rows = []
    for compute, schedule, m in itertools.product(choice_list(args.compute, COMPUTES, "--compute"),
                                                  choice_list(args.schedules, SCHEDULES, "--schedules"),
                                                  number_list(args.microbatches, "--microbatches")):
        stage = stages[compute]
        pipe = pz.pipeline.Pipeline(stage, m, schedule)
        x = torch.randn(m * args.mb_size, args.hidden, generator=g)
        y = torch.randn(m * args.mb_size, args.hidden, generator=g)
        stats = []
        for i in range(args.warmup + args.steps):
            pipe.train_step(x, y, torch.nn.functional.mse_loss)
            stage.zero_grad(set_to_none=False)
            if i >= args.warmup:
                stats.append(pipe.stats)
        rows.append({"compute": compute, "schedule": schedule, "microbatches": m, "stage": rank,
                     "bubble": statistics.median(s.bubble for s in stats),
                     "busy_ms": statistics.median(s.busy_s for s in stats) * 1e3,
                     "step_ms": statistics.median(s.step_s for s in stats) * 1e3,
                     "max_inflight": max(s.max_inflight for s in stats),
                     "bubble_formula": stats[0].bubble_formula})
    return rows


def summarise(per_rank: list[list[dict]], args) -> list[dict]:
    """One row per (compute, schedule, m): stage-averaged utilisation next to the formula, per-stage detail kept."""
    p = len(per_rank)
    results = []
    for i, row0 in enumerate(per_rank[0]):
        stages = [rows[i] for rows in per_rank]
        m = row0["microbatches"]
        bubble = sum(s["bubble"] for s in stages) / p
        results.append({"compute": row0["compute"], "schedule": row0["schedule"], "microbatches": m, "stages": p,
                        "hidden": args.hidden, "layers": args.layers, "mb_size": args.mb_size,
                        "step_ms": max(s["step_ms"] for s in stages),
                        "compute_ms_per_microbatch": max(s["busy_ms"] for s in stages) / m,
                        "max_inflight": [s["max_inflight"] for s in stages],
                        "utilisation": 1 - bubble, "utilisation_formula": 1 - row0["bubble_formula"],
                        "per_stage": stages})
    return results


def plot(results: list, path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, (ax, mem) = plt.subplots(1, 2, figsize=(11, 4.2))
    ms = sorted({r["microbatches"] for r in results})
    p = results[0]["stages"]
    ax.plot(ms, [m / (m + p - 1) for m in ms], "k--", label="formula m / (m + p - 1)")
    for (schedule, marker, color), (compute, style) in itertools.product(zip(SCHEDULES, "os", ("C0", "C1")),
                                                                        zip(COMPUTES, ("-", ":"))):
        rows = sorted((r for r in results if r["schedule"] == schedule and r["compute"] == compute),
                      key=lambda r: r["microbatches"])
        if rows:
            xs = [r["microbatches"] for r in rows]
            ax.plot(xs, [r["utilisation"] for r in rows], marker=marker, ls=style, color=color,
                    label=f"{schedule}, {compute}")
            mem.plot(xs, [max(r["max_inflight"]) for r in rows], marker=marker, ls=style, color=color,
                     label=f"{schedule}, {compute}")
    r0 = results[0]
    ax.set(xscale="log", xlabel="micro-batches m", ylabel="utilisation = 1 - bubble (mean over stages)",
           ylim=(0, 1.02), title=f"{p} stages; matmul: MLP H={r0['hidden']}, {r0['layers']} layers, "
                                 f"{r0['mb_size']} rows/micro-batch")
    mem.set(xscale="log", yscale="log", xlabel="micro-batches m", ylabel="max micro-batches held (stage 0)",
            title="activation memory")
    for a in (ax, mem):
        a.set_xticks(ms, [str(m) for m in ms])
        a.grid(True, which="both", alpha=0.3)
        a.legend(fontsize=8)
    ax.title.set_fontsize(9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    from ..launch import run_ranks  # noqa: PLC0415

    if args.nproc < 2:
        raise UsageError(f"--nproc: expected >= 2 (a pipeline of one stage has no bubble), got {args.nproc}")
    if args.layers < args.nproc:
        raise UsageError(f"--layers: expected >= --nproc={args.nproc} (each stage needs a layer), got {args.layers}")
    number_list(args.microbatches, "--microbatches")
    choice_list(args.schedules, SCHEDULES, "--schedules")
    choice_list(args.compute, COMPUTES, "--compute")
    res = run_ranks(rank_main, args.nproc, args=(args,), timeout=args.timeout, threads=1)
    results = summarise([r.value for r in res], args)
    print(f"# {args.nproc} stages, MLP H={args.hidden} x {args.layers} layers, {args.mb_size} rows/micro-batch, "
          f"median of {args.steps} steps; utilisation averaged over stages")
    print("#{:>7} {:>8} {:>4} {:>9} {:>11} {:>14} {:>9} {:>9}".format(
        "compute", "schedule", "m", "step ms", "compute ms", "max inflight", "util", "formula"))
    for r in results:
        print(" {:>7} {:>8} {:>4} {:>9.1f} {:>11.2f} {:>14} {:>9.3f} {:>9.3f}".format(
            r["compute"], r["schedule"], r["microbatches"], r["step_ms"], r["compute_ms_per_microbatch"],
            ",".join(map(str, r["max_inflight"])), r["utilisation"], r["utilisation_formula"]))
    if args.json:
        write_json(args.json, results, {"command": "pipeline", "args": vars(args)})
    if args.plot:
        plot(results, args.plot)
    return 0
