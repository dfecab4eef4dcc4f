"""pyzero-bench optim: CPU AdamW step throughput, pz.optim vs torch (foreach, fused) vs DeepSpeed CPUAdam.

One flat fp32 parameter of n elements (as a ZeRO shard), the step timed as
the median of --iters after --warmup, each optimizer on its own tensors. The
runs of one size are interleaved (one step of each in turn, the order rotated
every round) so that all see the same machine; where their tensors together
would take more than half the available memory they run one after another,
in three rounds of rotated order, each on new tensors (the median is kept).
Every optimizer runs the same AdamW (weight_decay 0.01, torch's default).
params/s = n / t; GB/s counts the bytes the step must move: AdamW reads p, g,
m, v and writes p, m, v (28 bytes per parameter). "frac" is that
GB/s over the machine's memory bandwidth measured in the same run by a
STREAM-like probe at the same thread count: the best of copy (a = b, 8 bytes
per element), triad (a = b + s*c, 12) and in-place add (b += s*c, 12; the
optimizer's pattern: every written line was read, no write-allocate
traffic), torch ops on --stream-mib MiB arrays, bytes counted as STREAM does.

Two steps are timed:
  plain    opt.step()
  offload  the step ZeRO-Offload runs: gradient scale (1/loss_scale x clip
           coefficient) applied and a bf16 copy of the new parameters written.
           pz.optim does both in the step's one pass (step(grad_scale=,
           copies=)); torch and DeepSpeed do g.mul_(s), step, copy.copy_(p)
           (each as one foreach call over the tensors).
           Bytes counted: 30 per parameter (the 28 plus the bf16 write).
Threads: pz.optim's threads=; torch.set_num_threads for torch's optimizers,
the probe and DeepSpeed (its OpenMP loop follows torch's thread count).

DeepSpeed's CPUAdam is JIT-built with ninja the first time; where it does not
build or import, the run says why and goes on without it.

With ``--nvme-path DIR`` a third table times pz.optim.NvmeAdamW (state in swap
files under DIR, --sub-group elements per file) against pz.optim.AdamW in RAM
for the same parameters: io ms is the state's read + write alone (every
sub-group read then written, nothing else), and hidden = 1 - (nvme - ram) / io
(clamped to [0, 1]), the fraction of that I/O the double-buffered step hides behind compute.
"""
from __future__ import annotations

import statistics
import time

import torch

from .common import UsageError, choice_list, mem_available, parse_size, size_steps, write_json

RUNS = ("pz", "torch-foreach", "torch-fused", "deepspeed")
BYTES = {"plain": 28, "offload": 30}
LR, WD, SCALE = 1e-3, 1e-2, 0.5
RUN_BYTES = 4 * 4 + 2 + 3 * 4  # p, g, m, v, the bf16 copy and foreach's temporaries, per parameter
ALONE_ROUNDS = 3  # rounds of the runs timed one at a time (sizes too large to interleave)


def add_arguments(p) -> None:
    p.add_argument("--min", default="1M", help="smallest parameter count (K/M/G suffix: 2^10, 2^20, 2^30)")
    p.add_argument("--max", default="256M", help="largest parameter count")
    p.add_argument("--factor", type=float, default=4)
    p.add_argument("--threads", default="1,2", help="comma list of thread counts")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {RUNS}")
    p.add_argument("--steps", default="plain,offload", help="comma list of plain, offload")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--stream-mib", type=int, default=256, help="array size of the bandwidth probe")
    p.add_argument("--tensors", type=int, default=1,
                   help="split the parameters into this many tensors (a model's many small ones: per-tensor costs)")
    p.add_argument("--nvme-path", default=None, help="directory on the disk to bench NvmeAdamW on (optional)")
    p.add_argument("--sub-group", default="8M", help="NvmeAdamW sub-group size in elements")
    p.add_argument("--json", default=None)


def _median_s(fn, iters, warmup) -> float:
    for _ in range(warmup):
        fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def stream_probe(mib: int, iters: int) -> dict:
    """GB/s of three torch-op kernels on arrays of `mib` MiB (bytes counted as STREAM does)."""
    n = (mib << 20) // 4
    a, b, c = (torch.rand(n) for _ in range(3))
    kernels = {
        "copy": (lambda: a.copy_(b), 8),
        "triad": (lambda: torch.add(b, c, alpha=1e-9, out=a), 12),
        "add_inplace": (lambda: b.add_(c, alpha=1e-9), 12),
    }
    return {name: per_elem * n / _median_s(fn, iters, 1) / 1e9 for name, (fn, per_elem) in kernels.items()}


def _deepspeed_factory():
    """DeepSpeedCPUAdam's constructor, or the reason it is unavailable."""
    try:
        from deepspeed.ops.adam import DeepSpeedCPUAdam  # noqa: PLC0415

        DeepSpeedCPUAdam([torch.nn.Parameter(torch.zeros(16))], lr=LR)  # triggers the JIT build
        return DeepSpeedCPUAdam, None
    except ModuleNotFoundError as e:
        if e.name == "deepspeed" or str(e.name).startswith("deepspeed."):
            return None, "DeepSpeed is not installed"
        return None, f"{type(e).__name__}: {e}"
    except Exception as e:  # noqa: BLE001 -- any import/build failure means "skip, say why"
        return None, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"


def make_step(run: str, step: str, n: int, threads: int, ds_cls, tensors: int = 1):
    """A callable doing one step of one optimizer run over n parameters in `tensors` tensors."""
    from .. import optim as pz_optim  # noqa: PLC0415

    sizes = [n // tensors + (i < n % tensors) for i in range(tensors)]
    ps = [torch.nn.Parameter(torch.randn(k)) for k in sizes]
    for p in ps:
        p.grad = torch.randn(p.numel())
    copies = {p: torch.empty(p.numel(), dtype=torch.bfloat16) for p in ps}
    if run == "pz":
        opt = pz_optim.AdamW(ps, lr=LR, weight_decay=WD, threads=threads)
        if step == "plain":
            return opt.step
        return lambda: opt.step(grad_scale=SCALE, copies=copies)
    if run == "deepspeed":
        opt = ds_cls(ps, lr=LR, weight_decay=WD, adamw_mode=True)
    else:
        opt = torch.optim.AdamW(ps, lr=LR, weight_decay=WD, foreach=run == "torch-foreach",
                                fused=run == "torch-fused" or None)
    if step == "plain":
        return opt.step
    grads, params, outs = [p.grad for p in ps], [p.detach() for p in ps], list(copies.values())

    def offload_step():
        torch._foreach_mul_(grads, SCALE)
        opt.step()
        torch._foreach_copy_(outs, params)

    return offload_step


def time_runs(runs, step, n, threads, ds_cls, iters, warmup, tensors: int = 1) -> tuple[dict, bool]:
    """({run: median seconds}, interleaved?) for one size."""
    available = mem_available()
    if available is not None and len(runs) * RUN_BYTES * n > available // 2:
        # One at a time, each on freshly allocated tensors: the machine's state (which pages the
        # kernel hands out, other load) varies between allocations by tens of percent at this size,
        # so every run is timed in ALONE_ROUNDS rounds, the order rotated, and the median taken.
        ts = {run: [] for run in runs}
        for i in range(ALONE_ROUNDS):
            for k in range(len(runs)):
                run = runs[(i + k) % len(runs)]
                fn = make_step(run, step, n, threads, ds_cls, tensors)
                ts[run].append(_median_s(fn, iters, warmup))
                del fn
        return {run: statistics.median(ts[run]) for run in runs}, False
    fns = {run: make_step(run, step, n, threads, ds_cls, tensors) for run in runs}
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    ts = {run: [] for run in runs}
    for i in range(iters):
        for k in range(len(runs)):
            run = runs[(i + k) % len(runs)]
            t0 = time.perf_counter()
            fns[run]()
            ts[run].append(time.perf_counter() - t0)
    return {run: statistics.median(ts[run]) for run in runs}, True


def hidden_fraction(t_ram: float, t_nvme: float, t_io: float) -> float:
    """The fraction of the swap I/O (t_io, alone) that the NVMe step (t_nvme) hides behind the in-RAM step's
    compute (t_ram): 1 - (t_nvme - t_ram) / t_io, clamped to [0, 1] (timing noise can put it outside)."""
    return max(0.0, min(1.0, 1.0 - (t_nvme - t_ram) / t_io))


def nvme_rows(args, sizes, threads) -> list:
    """NvmeAdamW vs AdamW in RAM, and the swap I/O alone, per size."""
    from .. import optim as pz_optim  # noqa: PLC0415

    rows = []
    sub_group = parse_size(args.sub_group)
    print(f"# nvme: {args.nvme_path}, sub-group {sub_group} elements, threads={threads}")
    print(f"#{'params':>10} {'ram ms':>9} {'nvme ms':>9} {'io ms':>9} {'slowdown':>8} {'hidden':>7} {'direct':>6}")
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        ram = pz_optim.AdamW([p], lr=LR, threads=threads)
        t_ram = _median_s(ram.step, args.iters, args.warmup)
        del ram
        opt = pz_optim.NvmeAdamW([p], lr=LR, threads=threads, nvme_path=args.nvme_path, sub_group_elems=sub_group)
        t_nvme = _median_s(opt.step, args.iters, args.warmup)
        opt._step_group = lambda *a: None  # the same I/O schedule without the compute
        t_io = _median_s(opt.step, args.iters, 1)
        hidden = hidden_fraction(t_ram, t_nvme, t_io)
        rows.append({"params": n, "threads": threads, "ram_ms": t_ram * 1e3, "nvme_ms": t_nvme * 1e3,
                     "io_ms": t_io * 1e3, "slowdown": t_nvme / t_ram, "hidden": hidden, "direct": opt.direct,
                     "sub_group": sub_group, "state_bytes": 8 * n})
        print(f" {n:>10} {t_ram * 1e3:>9.2f} {t_nvme * 1e3:>9.2f} {t_io * 1e3:>9.2f} {t_nvme / t_ram:>8.2f} "
              f"{hidden:>7.2f} {str(opt.direct):>6}")
        opt.close()
    return rows


def main(args) -> int:
    runs = list(dict.fromkeys(choice_list(args.runs, RUNS, "--runs")))
    steps = choice_list(args.steps, tuple(BYTES), "--steps")
    try:
        thread_counts = [int(t) for t in args.threads.split(",")]
    except ValueError:
        thread_counts = []
    if not thread_counts or min(thread_counts) < 1:
        raise UsageError(f"--threads: expected a comma list of thread counts >= 1, got {args.threads!r}")
    sizes = size_steps(parse_size(args.min, "--min"), parse_size(args.max, "--max"), args.factor)
    if parse_size(args.sub_group, "--sub-group") < 1:
        raise UsageError(f"--sub-group: expected at least one element, got {args.sub_group!r}")
    if args.tensors < 1 or args.tensors > min(sizes):
        raise UsageError(f"--tensors: expected 1 to {min(sizes)} (the smallest size), got {args.tensors}")
    from .. import optim as pz_optim  # noqa: PLC0415
    from ..optim import swap  # noqa: PLC0415

    if args.nvme_path is not None:  # (the NVMe table runs last: a bad path failed after every other run)
        sub, n = parse_size(args.sub_group), max(sizes)  # one size at a time: the largest's swap files, two
        chunks = [sub] * (n // sub) + [n % sub] * (n % sub > 0)  # fp32 states per sub-group, in 4 KiB pages
        try:
            swap.check_path(args.nvme_path, sum(2 * swap.round_up(4 * c) for c in chunks), "--nvme-path")
        except ValueError as e:
            raise UsageError(str(e)) from None
    skipped = {}
    ds_cls = None
    if "deepspeed" in runs:
        ds_cls, why = _deepspeed_factory()
        if ds_cls is None:
            if runs == ["deepspeed"]:
                raise UsageError(f"--runs deepspeed: the only run, and DeepSpeed's CPUAdam is unavailable ({why})")
            skipped["deepspeed"] = why
            runs.remove("deepspeed")
            print(f"# deepspeed CPUAdam skipped: {why}")
    saved_threads = torch.get_num_threads()
    results, probes = [], {}
    print(f"# pz.optim isa: {pz_optim.cpu_isa()}, threads: {pz_optim.cpu_threading()}; "
          f"bytes/param: plain 28, offload 30; AdamW lr {LR}, weight_decay {WD}; "
          f"parameters in {args.tensors} tensor(s)")
    print(f"#{'threads':>7} {'step':>8} {'params':>10} {'run':>14} {'ms':>9} {'Mparams/s':>10} {'GB/s':>7} "
          f"{'frac':>5} {'vs fused':>8}")
    try:
        for threads in thread_counts:
            torch.set_num_threads(threads)
            probes[threads] = stream_probe(args.stream_mib, max(3, args.iters // 2))
            bw = max(probes[threads].values())
            print(f"# threads={threads} bandwidth probe GB/s: "
                  + ", ".join(f"{k} {v:.1f}" for k, v in probes[threads].items()) + f" -> {bw:.1f}")
            for step in steps:
                for n in sizes:
                    row, interleaved = time_runs(runs, step, n, threads, ds_cls, args.iters, args.warmup,
                                                 args.tensors)
                    for run, t in row.items():
                        gbps = BYTES[step] * n / t / 1e9
                        rel = row["torch-fused"] / t if "torch-fused" in row else float("nan")
                        results.append({"threads": threads, "step": step, "params": n, "tensors": args.tensors,
                                        "run": run, "ms": t * 1e3,
                                        "params_per_s": n / t, "gbps": gbps, "bandwidth_gbps": bw,
                                        "fraction": gbps / bw, "speedup_vs_torch_fused": rel,
                                        "interleaved": interleaved})
                        print(f" {threads:>7} {step:>8} {n:>10} {run:>14} {t * 1e3:>9.2f} {n / t / 1e6:>10.1f} "
                              f"{gbps:>7.1f} {gbps / bw:>5.2f} {rel:>8.2f}" + ("" if interleaved else "  (alone)"))
        nvme = nvme_rows(args, sizes, thread_counts[-1]) if args.nvme_path else []
    finally:
        torch.set_num_threads(saved_threads)
    if args.json:
        write_json(args.json, results, {"bandwidth_probe_gbps": probes, "skipped": skipped, "nvme": nvme,
                                        "isa": pz_optim.cpu_isa(), "threading": pz_optim.cpu_threading(),
                                        "iters": args.iters})
    return 0
