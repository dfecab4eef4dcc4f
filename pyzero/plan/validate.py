"""Measured vs predicted: run every layout of a bench GPT that fits 2-4 local ranks, time its
training steps and read its model-state memory, and compare with the cost model.

    pyzero-plan validate --nproc 2,4 --model gpt-tiny --steps 10 --json out.json

Prediction inputs, measured once here: the device throughput (one rank's fp32
matmul FLOP/s at the shape each layout runs: micro-batch tokens x hidden x
4 hidden/tp; ranks that outnumber the cores share them, ``Cluster.ranks_per_core``), the memory bandwidth (a
large copy, scaled by cores/ranks) and the
collectives (``--table``, the JSON of ``pyzero-bench collectives``, one per
group size where measured, comma-separated: each rank count takes the table
of its own size, else the first; by default the newest
benchmarks/results/collectives_all_cpu2_*.json and
collectives_all_4ranks_cpu2_*.json). CPU ranks with at most a core each
cannot overlap communication with compute (``Cluster.overlap`` 0). The
fixed cost of a collective call beside compute (``Cluster.op_overhead``),
measured per rank count: an async all_gather of a block weight's shard while
a layer's matmul runs, minus the matmul alone and the all_gather alone.
Measured: the median step of each run (the slowest rank's time per step);
with ``--rounds R`` every layout runs once per round, rounds one after the
other, and the layout's time is the median of its R runs, so that a slow
spell of the machine does not fall on a few layouts only.
Reported: per layout the predicted and measured step time and model states,
Spearman's rank correlation of the step times, and the largest model-state
error.
"""
from __future__ import annotations

import argparse
import datetime
import glob
import json
import math
import os
import platform
import statistics
import time

import torch

from .comm_model import Table
from .cost import Cluster, Layout, estimate
from .spec import to_spec


def runnable_layouts(nproc: int, layers: int, heads: int, batch: int) -> list[Layout]:
    """Every dp x tp x pp of nproc ranks with ZeRO stages 0-3 (0-1 with a pipeline); TP always with SP;
    a pipeline runs 2 micro-batches per stage."""
    out = []
    for tp in (t for t in range(1, nproc + 1) if nproc % t == 0 and heads % t == 0):
        for pp in (p for p in range(1, nproc // tp + 1) if (nproc // tp) % p == 0 and p <= layers):
            dp = nproc // (tp * pp)
            if batch % dp:
                continue
            m = 2 * pp if pp > 1 else 1
            if (batch // dp) % m:
                continue
            for stage in ((0, 1) if pp > 1 else (0, 1, 2, 3)):
                if stage and dp == 1:
                    continue
                out.append(Layout(dp, tp, pp, stage, batch // dp // m, m, sp=tp > 1))
    return out


def _measure_flops(hidden: int, tokens: int, tp: int = 1, threads: int = 1) -> float:
    """One rank's FLOP/s on an MLP matmul of the shape a layout runs: (tokens, h) x (h, 4h/tp).
    Small matmuls run well below the peak on CPUs (and GPUs), so each (micro-batch, tp) gets its own."""
    torch.set_num_threads(threads)
    a, w = torch.randn(tokens, hidden), torch.randn(4 * hidden // tp, hidden)
    for _ in range(3):
        a @ w.t()
    best = float("inf")
    for _ in range(3):  # the best of three: a throughput, not a mean over whatever else runs
        reps, t0 = 10, time.perf_counter()
        for _ in range(reps):
            a @ w.t()
        best = min(best, (time.perf_counter() - t0) / reps)
    return 2 * tokens * hidden * 4 * hidden // tp / best


def measure_flops(hidden: int | None = None, tokens: int | None = None, device=None, dtype=None) -> float:
    """This device's achieved matmul FLOP/s at an MLP shape: (tokens, h) x (h, 4h), bf16 on a GPU
    (h 4096, 8192 tokens) or fp32 on a CPU (h 512, 1024 tokens, all of torch's threads).
    What `pyzero-plan --tflops measure` uses."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    hidden, tokens = hidden or (4096 if gpu else 512), tokens or (8192 if gpu else 1024)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    a = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w = torch.randn(4 * hidden, hidden, device=device, dtype=dtype)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(3):
        a @ w.t()
    sync()
    reps, t0 = 10, time.perf_counter()
    for _ in range(reps):
        a @ w.t()
    sync()
    return reps * 2 * tokens * hidden * 4 * hidden / (time.perf_counter() - t0)


def _measure_mem_bw() -> float:
    x = torch.empty(1 << 25)  # 128 MiB
    y = torch.empty_like(x)
    y.copy_(x)
    t0 = time.perf_counter()
    for _ in range(5):
        y.copy_(x)
    return 5 * 2 * x.numel() * 4 / (time.perf_counter() - t0)


def _states(pm) -> dict:
    """Bytes of the model states now: {"params", "grads", "optimizer"}."""
    opt = pm.optimizer
    if hasattr(opt, "memory_stats"):
        m = opt.memory_stats()
        return {k: m[k] for k in ("params", "grads", "optimizer")}
    params = {id(p): p for p in pm.stage.parameters()}.values()
    return {"params": sum(p.numel() * p.element_size() for p in params),
            "grads": sum(p.grad.numel() * p.grad.element_size() for p in params if p.grad is not None),
            "optimizer": sum(t.numel() * t.element_size() for st in opt.state.values() for t in st.values()
                             if torch.is_tensor(t))}


def _rank(model_name: str, lay: Layout, batch: int, seq: int, steps: int, warmup: int):
    import pyzero as pz  # noqa: PLC0415
    from pyzero.bench.gpt import make_gpt, random_batch  # noqa: PLC0415

    pz.init(timeout=120)
    model = make_gpt(model_name, seed=0)
    pm = pz.parallelize(model, lay, torch.optim.AdamW, lr=1e-4)
    x, y = random_batch(model.config, batch, seq, seed=1)
    x, y = pm.local_batch(x), pm.local_batch(y)
    times, states = [], 0
    for i in range(warmup + steps):
        pz.barrier()
        t0 = time.perf_counter()  # the state measurement of step 0 is in a warm-up step, never timed
        pm.train_step(x, y)
        if i == 0:  # the gradients as backward left them (ZeRO frees its shards by step's end)
            before = _states(pm)
        pm.optimizer.step()
        if i == 0:  # each part at its largest over the step: the optimizer state exists only after it
            after = _states(pm)
            states = sum(max(before[k], after[k]) for k in before)
        pm.optimizer.zero_grad()
        pz.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return {"times": times, "states": states}


def _op_overhead_rank(hidden: int, tokens: int, rounds: int, reps: int) -> float:
    import pyzero as pz  # noqa: PLC0415

    pz.init(timeout=120)
    n = pz.get_world_size()
    a, w = torch.randn(tokens, hidden), torch.randn(4 * hidden, hidden)
    x = torch.randn(4 * hidden * hidden // n)
    out = torch.empty(x.numel() * n)

    def loop(kind):
        pz.barrier()
        t0 = time.perf_counter()
        for _ in range(reps):
            if kind == "both":
                work = pz.all_gather(out, x, async_op=True)
                a @ w.t()
                work.wait()
            elif kind == "comm":
                pz.all_gather(out, x)
            else:
                a @ w.t()
        pz.barrier()
        return (time.perf_counter() - t0) / reps

    times = {"compute": [], "comm": [], "both": []}
    for _ in range(rounds):
        for kind in times:
            times[kind].append(loop(kind))
    med = {k: statistics.median(v) for k, v in times.items()}
    return med["both"] - med["compute"] - med["comm"]


def measure_op_overhead(nproc: int, hidden: int, tokens: int, rounds: int = 5, reps: int = 40,
                        timeout: float = 300) -> float:
    """Seconds a collective call costs beyond its transfer when it runs beside compute, on `nproc` local
    ranks (>= 0): an async all_gather of a (4h x h)/n weight shard during a (tokens x h) x (h x 4h)
    matmul, minus the matmul alone and the all_gather alone, medians of `rounds` interleaved loops."""
    from pyzero.launch import run_ranks  # noqa: PLC0415

    res = run_ranks(_op_overhead_rank, nproc, args=(hidden, tokens, rounds, reps), timeout=timeout)
    return max(0.0, max(r.value for r in res))


def spearman(a: list[float], b: list[float]) -> float:
    def ranks(v):
        order = sorted(range(len(v)), key=lambda i: v[i])
        r = [0.0] * len(v)
        i = 0
        while i < len(order):
            j = i
            while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
                j += 1
            for k in range(i, j + 1):
                r[order[k]] = (i + j) / 2
            i = j + 1
        return r

    ra, rb = ranks(a), ranks(b)
    ma, mb = statistics.fmean(ra), statistics.fmean(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    var = (sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb)) ** 0.5
    return cov / var if var else float("nan")


def _report(rows: list, n: int, lay, c, e, runs: list) -> None:
    step = statistics.median(t for t, _ in runs)
    states = max(m for _, m in runs)
    pred_states = e.memory["params"] + e.memory["grads"] + e.memory["optimizer"]
    row = {"nproc": n, "layout": str(lay), "predicted_s": e.time["total"], "measured_s": step,
           "measured_runs_s": [t for t, _ in runs], "predicted_states_bytes": pred_states,
           "measured_states_bytes": states, "states_error": states / pred_states - 1, "predicted": e.time,
           "table": c.intra.source, "overlap": c.overlap, "ranks_per_core": c.ranks_per_core,
           "op_overhead": c.op_overhead}
    rows.append(row)
    spread = f" ({min(t for t, _ in runs) * 1e3:.0f}-{max(t for t, _ in runs) * 1e3:.0f})" if len(runs) > 1 else ""
    print(f"{n:>3}  {str(lay):<36} predicted {e.time['total'] * 1e3:8.1f} ms  measured {step * 1e3:8.1f} ms{spread}"
          f"   states {pred_states / 2**20:7.2f} / {states / 2**20:7.2f} MiB ({row['states_error']:+.1%})", flush=True)


def _default_table():
    here = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    res = os.path.join(here, "benchmarks", "results")
    found = [sorted(glob.glob(os.path.join(res, pat)))
             for pat in ("collectives_all_cpu2_*.json", "collectives_all_4ranks_cpu2_*.json")]
    return ",".join(f[-1] for f in found if f) or None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pyzero-plan validate", description=__doc__.split("\n\n")[0])
    ap.add_argument("--nproc", default="2,4", help="rank counts, comma separated (e.g. 2,4)")
    ap.add_argument("--model", default="gpt-tiny", help="a pyzero.bench.gpt preset")
    ap.add_argument("--batch", type=int, default=8, help="global batch (sequences)")
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3, help="runs of every layout, interleaved (median taken)")
    ap.add_argument("--table", default=None, help="collectives JSON (pyzero-bench collectives --json), one per "
                    "group size, comma-separated: a rank count takes the table of its size, else the first")
    ap.add_argument("--layouts", default=None, help="only these layouts, ';'-separated as printed (smoke tests)")
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--json", default=None, help="write the comparison here")
    args = ap.parse_args(argv)
    from pyzero.bench.gpt import PRESETS, make_gpt  # noqa: PLC0415
    from pyzero.launch import run_ranks  # noqa: PLC0415

    if args.rounds < 1:
        ap.error(f"--rounds: expected >= 1, got {args.rounds}")
    if args.warmup < 1 or args.steps < 1:
        ap.error(f"--warmup/--steps: expected >= 1 each (model states are read in the first, untimed step), "
                 f"got {args.warmup}/{args.steps}")
    for flag, v in (("--batch", args.batch), ("--seq", args.seq)):
        if v < 1:
            ap.error(f"{flag}: expected >= 1, got {v}")
    if not 0 < args.timeout < math.inf:
        ap.error(f"--timeout: expected a positive number of seconds, got {args.timeout}")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):
        ap.error(f"--json: the directory of {args.json!r} does not exist (checked before the runs, which it "
                 "would be written after)")
    if args.model not in PRESETS:
        ap.error(f"--model: expected one of {list(PRESETS)}, got {args.model!r}")
    try:
        nprocs = [int(n) for n in args.nproc.split(",")]
    except ValueError:
        ap.error(f"--nproc: expected comma-separated ints, got {args.nproc!r}")
    if any(n < 1 for n in nprocs):
        ap.error(f"--nproc: expected rank counts >= 1, got {args.nproc!r}")
    table = args.table or _default_table()
    if table is None:
        ap.error("--table: no collectives JSON given and none recorded in benchmarks/results/")
    try:
        tables = [Table.from_json(path) for path in table.split(",")]
    except (OSError, ValueError) as e:
        ap.error(f"--table: {e}")
    by_size = {t.world: t for t in reversed(tables)}
    config = PRESETS[args.model]
    if args.layouts:
        runnable = [str(lay) for n in nprocs for lay in runnable_layouts(n, config.n_layer, config.n_head, args.batch)]
        unknown = [name for name in args.layouts.split(";") if name not in runnable]
        if unknown:
            ap.error(f"--layouts: {unknown} not among the runnable layouts of --nproc {args.nproc}: {runnable}")
    spec = to_spec(make_gpt(args.model), seq=args.seq, batch=args.batch).with_(embedding_tp=False, fused_attention=True)
    cores = os.cpu_count() or 1
    flops1 = _measure_flops(config.n_embd, args.batch * args.seq)
    shapes: dict = {}
    mem_bw = _measure_mem_bw()
    print(f"# {args.model}: {spec.params / 1e6:.2f}M parameters, batch {args.batch} x seq {args.seq}; "
          f"{cores} cores, one rank {flops1 / 1e9:.1f} GFLOP/s, copy {mem_bw / 1e9:.1f} GB/s; table {table}")
    rows = []
    plan = []  # (n, layout, cluster, estimate)
    overheads = {}
    for n in nprocs:
        overheads[n] = measure_op_overhead(n, config.n_embd, args.batch * args.seq // n, timeout=args.timeout)
        print(f"# {n} ranks: a collective call beside compute costs {overheads[n] * 1e6:.0f} us", flush=True)
    for n in nprocs:
        tab = by_size.get(n, tables[0])
        lays = runnable_layouts(n, config.n_layer, config.n_head, args.batch)
        if args.layouts:
            lays = [lay for lay in lays if str(lay) in args.layouts.split(";")]
        for lay in lays:  # each shape measured before any ranks start
            key = (lay.micro_batch * args.seq, lay.tp)
            if key not in shapes:
                shapes[key] = _measure_flops(config.n_embd, *key)
            # CPU ranks with at most a core each: communication runs on the core that computes (overlap 0)
            c = Cluster(world=n, gpus_per_host=n, device_memory=1e12, flops=shapes[key], intra=tab, inter=tab,
                        mem_bw=mem_bw * min(1.0, cores / n), param_bytes=4, grad_comm_bytes=4, optimizer_bytes=8,
                        overlap=0.0 if n >= cores else 1.0, ranks_per_core=max(1.0, n / cores),
                        op_overhead=overheads[n])
            plan.append((n, lay, c, estimate(spec, c, lay)))
    runs = [[] for _ in plan]
    for rnd in range(args.rounds):
        for j, (n, lay, c, e) in enumerate(plan):
            res = [r.value for r in run_ranks(_rank, n, args=(args.model, lay, args.batch, args.seq, args.steps,
                                                              args.warmup), timeout=args.timeout)]
            step = statistics.median(max(r["times"][i] for r in res) for i in range(args.steps))
            runs[j].append((step, max(r["states"] for r in res)))
            if rnd == args.rounds - 1:
                _report(rows, n, lay, c, e, runs[j])
    rho = spearman([r["predicted_s"] for r in rows], [r["measured_s"] for r in rows]) if len(rows) > 1 else None
    worst = max((abs(r["states_error"]) for r in rows), default=0.0)
    print(f"# Spearman rank correlation (step time) {rho if rho is None else round(rho, 3)} over {len(rows)} "
          f"layouts; largest model-state error {worst:.1%}")
    if args.json:
        out = {"machine": {"node": platform.node(), "system": platform.platform(), "cpus": cores},
               "versions": {"python": platform.python_version(), "torch": torch.__version__},
               "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
               "command": "plan validate", "args": vars(args), "flops_per_rank": flops1,
               "flops_by_shape": {f"tokens={k[0]} tp={k[1]}": v for k, v in shapes.items()}, "mem_bw": mem_bw,
               "op_overhead_s": overheads,
               "table": table, "spearman": rho, "max_states_error": worst, "results": rows}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0
