"""pyzero-bench capacity: the largest GPT-style model one device trains, with and without
offload, and the tokens/s at that size.

The model is bench/gpt.py's GPT with --n-embd / --n-head fixed and the number of layers
searched. Runs (--runs; world size 1 unless --nproc says more):
    torch          plain torch: fp32 parameters and gradients, AdamW (fused on a GPU)
                   -- 16 bytes per parameter on the device; one rank only
    zero2          pz.ZeroOptimizer stage 2, bf16 parameters, fp32 masters and AdamW state
                   on the device
    zero3          pz.ZeroOptimizer stage 3 with fp32 parameters, as plain torch's (fused
                   AdamW on a GPU): 16 bytes per parameter over the ranks, one gathered unit
    fsdp2          torch FSDP2 (fully_shard per transformer block and the root, fp32, fused
                   AdamW on a GPU), planned as zero3: the sharding users compare ZeRO-3 with
    zero2-offload  the same with offload="cpu": masters, gradient shards and AdamW state in
                   host memory, the step on the CPU (pz.optim's fused AdamW)
    zero3-offload  stage 3 with offload="cpu" and offload_params=True: the parameter shards in
                   host memory too; the device holds a unit's gathered parameters at a time
    zero2-offload-bf16m, zero2-offload-int8m, zero3-offload-int8m
                   the same with offload_moments="bf16" or "int8": AdamW's moments held in 4 or
                   2.03 host bytes per parameter instead of 8 (host bytes per parameter, bf16
                   gradients: 16 with fp32 moments, 12 bf16, 10.03 int8; docs/offload.md)
    ds-zero2-offload  DeepSpeed ZeRO-Offload (stage 2, bf16, offload_optimizer cpu, pinned, its
                   CPUAdam; bench/ds_runs.py), where deepspeed is importable
    ds-zenflow     the same with DeepSpeed's ZenFlow (ds_runs.ZENFLOW: top 10% of the gradient
                   columns stepped on the device every step, the rest on the CPU every 4th,
                   overlapped; not exact), planned as ds-zero2-offload
--nproc N trains each size on N ranks (a GPU each with --gpu-backend nccl; all on GPU 0 with
--gpu-backend ipc; CPU processes over shm with --device cpu: ranks sharing a device plan with
1/N of its memory each); torch and the DeepSpeed runs train on one rank. fsdp2 runs on torch.distributed's
NCCL, or on pyzero's "pyzero" backend with --gpu-backend ipc (NCCL refuses two ranks on one GPU).
Each size is tried in a fresh process (an out-of-memory error there cannot poison the next
try): build the model on the device, train --steps steps on random tokens, report tokens/s
(median step after the first), the device's peak allocated bytes and the process's peak
RSS. The search starts at the size pyzero.zero.estimate_memory predicts fits the device
(--device-gb, default its total memory) and the host (--host-gb, default MemAvailable), then
grows or shrinks by a quarter, then bisects, --attempts sizes at most per run. A size whose
estimated host bytes exceed the host is not tried (the kernel's OOM killer is no error to
catch). A size that does not fit is one whose try ran out of memory (a GPU's OutOfMemoryError, a
CPU model's failed allocation); a try that crashed otherwise or ran past --timeout says nothing about
the size: the run's search stops there, the try is reported (its outcome "error" or "timeout"), and
the bench exits 1. On the CPU (--device cpu) the same runs train a CPU model, for checking the bench.
"""
from __future__ import annotations

import math
import os
import resource
import statistics
import sys
import time

import torch

from .common import UsageError, mem_available, write_json
from .gpt import GPT, GPTConfig

RUNS = {
    "torch": {},
    "zero2": {"stage": 2},
    "zero3": {"stage": 3, "fp32": True},
    "fsdp2": {"stage": 3, "fp32": True, "fsdp2": True},
    "zero2-offload": {"stage": 2, "offload": "cpu"},
    "zero3-offload": {"stage": 3, "offload": "cpu", "offload_params": True},
    "zero2-offload-bf16m": {"stage": 2, "offload": "cpu", "moments": "bf16"},
    "zero2-offload-int8m": {"stage": 2, "offload": "cpu", "moments": "int8"},
    "zero3-offload-int8m": {"stage": 3, "offload": "cpu", "offload_params": True, "moments": "int8"},
    # planned with pyzero's zero2-offload estimate (the same placement of the same bytes)
    "ds-zero2-offload": {"stage": 2, "offload": "cpu", "deepspeed": "zero2-offload"},
    "ds-zenflow": {"stage": 2, "offload": "cpu", "deepspeed": "zenflow"},
}
GB = 1e9


def add_arguments(p) -> None:
    p.add_argument("--runs", default=",".join(r for r in RUNS if not RUNS[r].get("deepspeed")
                                              and not RUNS[r].get("moments")),
                   help=f"comma list of {list(RUNS)} (default: all but DeepSpeed's and the compact moments')")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cpu", "cuda"))
    p.add_argument("--n-embd", type=int, default=2048, help="hidden size")
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--vocab", type=int, default=50304)
    p.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--steps", type=int, default=3, help="training steps per try (the first is not timed)")
    p.add_argument("--max-layers", type=int, default=512)
    p.add_argument("--attempts", type=int, default=3, help="sizes tried per run at most")
    p.add_argument("--device-gb", type=float, default=None, help="device memory the search plans with")
    p.add_argument("--host-gb", type=float, default=None, help="host memory the search plans with")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per try")
    p.add_argument("--nproc", type=int, default=1, help="ranks per try (zero2, zero3, fsdp2 and the pz offload runs)")
    p.add_argument("--gpu-backend", default="nccl", choices=("nccl", "ipc"),
                   help="with --device cuda and --nproc > 1: a GPU per rank (nccl) or every rank on GPU 0 (ipc)")
    p.add_argument("--json", default=None)


def config(args, layers: int) -> GPTConfig:
    return GPTConfig(vocab_size=args.vocab, block_size=args.seq, n_layer=layers, n_head=args.n_head,
                     n_embd=args.n_embd)


def gpt_params(c: GPTConfig) -> int:
    """GPT's parameter count (the head is tied to the token embedding)."""
    h = c.n_embd
    per_layer = 12 * h * h + 13 * h  # qkv, proj, fc, fc_proj with biases, two LayerNorms
    return c.vocab_size * h + c.block_size * h + c.n_layer * per_layer + 2 * h


def estimate(run: str, c: GPTConfig, batch: int, world: int = 1) -> dict:
    """{"device", "host"} bytes per rank pyzero.zero.estimate_memory gives `run` at config `c` on
    `world` ranks."""
    from ..optim.moments import bytes_per_element  # noqa: PLC0415
    from ..zero import estimate_memory  # noqa: PLC0415

    spec = {"layers": c.n_layer, "hidden": c.n_embd, "heads": c.n_head, "vocab": c.vocab_size, "seq": c.block_size,
            "batch": batch, "fused_attention": True}
    n = gpt_params(c)
    opts = RUNS[run]
    if not opts or opts.get("fp32"):  # fp32 parameters and gradients, AdamW's two fp32 moments
        m = estimate_memory(n, world, opts.get("stage", 0), optimizer_state_bytes_per_param=8,
                            mixed_precision=False, model=spec, micro_batch=batch, seq=c.block_size)
    else:  # the fp32 master and the moments; pyzero's offload keeps bf16 host gradients at one rank
        m = estimate_memory(n, world, opts["stage"], optimizer_state_bytes_per_param=4 + bytes_per_element(
                                opts.get("moments", "fp32")), mixed_precision=True, model=spec, micro_batch=batch,
                            seq=c.block_size, offload=opts.get("offload"),
                            offload_params=opts.get("offload_params", False),
                            host_grad_bytes=2 if opts.get("offload") and not opts.get("deepspeed") and world == 1
                            else 4)
    return {"device": m.get("device", m["total"]), "host": m.get("host", 0.0)}


def search(fits, start: int, max_layers: int, attempts: int) -> tuple[int | None, dict]:
    """(largest n with fits(n) found, {n: fits(n)} of the sizes tried): from `start`, up by a
    quarter while sizes fit, down by a quarter while they do not, then bisecting between the
    largest fit and the smallest failure; at most `attempts` sizes, none above max_layers."""
    tried: dict[int, bool] = {}
    n = min(max(1, start), max_layers)
    while len(tried) < attempts:
        tried[n] = fits(n)
        ok = [k for k, v in tried.items() if v]
        bad = [k for k, v in tried.items() if not v]
        lo, hi = max(ok, default=0), min(bad, default=max_layers + 1)
        if hi - lo <= 1:
            break
        if not bad:
            n = min(max_layers, max(lo + 1, math.ceil(lo * 1.25)))
        elif not ok:
            n = max(1, min(hi - 1, math.floor(hi * 0.75)))
        else:
            n = (lo + hi) // 2
    ok = [k for k, v in tried.items() if v]
    return (max(ok) if ok else None), tried


def _peak_rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def _fsdp2(model, cuda: bool, ipc: bool):
    """torch FSDP2 over the ranks: fully_shard per transformer block and the root, on torch.distributed's
    NCCL (pyzero's "pyzero" backend where the ranks share a GPU), gloo on CPU."""
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    from ..distributed import cuda_backend_beside  # noqa: PLC0415
    from .common import init_torch_distributed  # noqa: PLC0415

    dist = init_torch_distributed(cuda_backend_beside("ipc" if ipc else "nccl") if cuda else "gloo")
    mesh = init_device_mesh("cuda" if cuda else "cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)


def _try(run: str, c: GPTConfig, args) -> dict:
    """One rank of a try (args.nproc ranks): build, train args.steps steps; what it measured, or why it
    failed."""
    import pyzero as pz  # noqa: PLC0415

    cuda = args.device == "cuda"
    ipc = cuda and args.nproc > 1 and args.gpu_backend == "ipc"
    pz.init(backend=("ipc" if ipc else "nccl") if cuda else "shm")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    out = {"run": run, "layers": c.n_layer, "params": gpt_params(c)}
    try:
        torch.manual_seed(0)
        with dev:
            model = GPT(c)
        opts = RUNS[run]
        if opts.get("fsdp2"):
            opt = _fsdp2(model, cuda, ipc)
        elif opts.get("fp32"):
            opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=opts["stage"], lr=1e-4, bucket_mb=64,
                                   fused=True if cuda else None)
        elif opts.get("deepspeed"):
            from . import ds_runs  # noqa: PLC0415
            from .common import init_torch_distributed  # noqa: PLC0415

            init_torch_distributed("nccl" if cuda else "gloo")
            engine = ds_runs.initialize(model, batch=args.batch, bucket_bytes=64 << 20, cuda=cuda, bf16=True,
                                        variant=opts["deepspeed"])
            model, opt = engine, ds_runs.EngineStep(engine)
        elif opts:
            opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=opts["stage"], lr=1e-4, bucket_mb=64,
                                   param_dtype=torch.bfloat16, offload=opts.get("offload"),
                                   offload_params=opts.get("offload_params", False),
                                   offload_moments=opts.get("moments"))
        else:
            opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True if cuda else None)
        g = torch.Generator().manual_seed(1 + pz.get_rank())
        tokens = torch.randint(0, c.vocab_size, (args.batch, c.block_size + 1), generator=g).to(dev)
        x, y = tokens[:, :-1], tokens[:, 1:]
        times, losses = [], []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            loss = model(x, y)
            model.backward(loss) if opts.get("deepspeed") else loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss))  # (a read of the device: the step's kernels are done)
            if cuda:
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - t0)
        step_s = statistics.median(times[1:] or times)
        out.update(ok=True, step_s=step_s, tokens_per_s=args.nproc * args.batch * c.block_size / step_s,
                   losses=losses)
    except RuntimeError as e:  # (torch.OutOfMemoryError is one)
        if not out_of_memory(e):
            raise  # a crash, not a size that does not fit: the try fails (main exits 1)
        why = "device out of memory: " + str(e).splitlines()[0][:160]
        if args.nproc > 1:
            # The other ranks wait in a collective for this one, and so would its own clean-up (the
            # transport finishes queued work): leave at once, failed, and the launcher stops them.
            print(why, file=sys.stderr, flush=True)
            os._exit(3)
        out.update(ok=False, why=why)
    finally:
        out["peak_device_gb"] = torch.cuda.max_memory_allocated(dev) / GB if cuda else None
        out["peak_rss_gb"] = _peak_rss_gb()
        if torch.distributed.is_initialized():  # the DeepSpeed or FSDP2 run's group
            torch.distributed.destroy_process_group()
        pz.destroy()
    return out


def out_of_memory(e: BaseException) -> bool:
    """Whether `e` says the device ran out of memory (a GPU's torch.OutOfMemoryError, a CPU model's failed
    allocation): the size does not fit. Any other error is a crash."""
    return isinstance(e, torch.OutOfMemoryError) or (isinstance(e, RuntimeError)
                                                      and "can't allocate memory" in str(e))


class TryFailed(Exception):
    """A try crashed or ran past --timeout: whether the size fits is not known, the run's search stops."""


def failed_try(e, run: str, n: int, params: int, timeout: float) -> dict:
    """A try's row from its RankFailure `e`: out of memory on a rank (outcome "out of memory", the size does not
    fit), else a deadline (outcome "timeout") or a crash (outcome "error")."""
    oom = [r.rank for r in e.results if "device out of memory" in r.output]
    row = {"run": run, "layers": n, "params": params, "ok": False}
    if oom:
        return dict(row, outcome="out of memory", why=f"device out of memory (rank {oom[0]})")
    late = [r.rank for r in e.results if r.exitcode is None]
    if late:
        return dict(row, outcome="timeout", why=f"timed out after {timeout:g} s (rank {late[0]})")
    return dict(row, outcome="error", why=str(e).splitlines()[0][:200])


def _merge(values: list[dict]) -> dict:
    """A try's row from its ranks' rows: ok where every rank trained, the largest peaks, the
    slowest rank's step time and tokens/s, the first failing rank's reason."""
    bad = [v for v in values if not v.get("ok")]
    row = dict(bad[0] if bad else values[0], outcome="out of memory" if bad else "fits")
    for key in ("peak_device_gb", "peak_rss_gb"):
        seen = [v[key] for v in values if v.get(key) is not None]
        row[key] = max(seen) if seen else None
    if not bad:
        slow = max(values, key=lambda v: v["step_s"])
        row.update(step_s=slow["step_s"], tokens_per_s=slow["tokens_per_s"])
    return row


def _gpu0() -> tuple[str, float]:
    """(name, total bytes) of GPU 0, from nvidia-smi where it runs: a CUDA context in this
    process would hold device memory the tries cannot use (torch's query, else)."""
    import subprocess  # noqa: PLC0415

    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits",
                              "-i", os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]],
                             capture_output=True, text=True, timeout=30, check=True).stdout.strip()
        name, mib = out.rsplit(",", 1)
        return name.strip(), float(mib) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError):
        return torch.cuda.get_device_name(0), float(torch.cuda.get_device_properties(0).total_memory)


def _memory(args) -> tuple[str, float, float]:
    """(device name, device bytes, host bytes) the search plans with."""
    name, device = _gpu0() if args.device == "cuda" else ("cpu", _mem_available())
    if args.device_gb is not None:
        device = args.device_gb * GB
    host = args.host_gb * GB if args.host_gb is not None else _mem_available()
    return name, device, host


def _mem_available() -> float:
    available = mem_available()
    if available is None:
        raise RuntimeError("/proc/meminfo: no MemAvailable; give --host-gb (and on the CPU --device-gb)")
    return float(available)


def predicted_layers(run: str, args, device: float, host: float) -> int:
    """The most layers (1..max_layers) whose estimate per rank fits 90% of `device` (a rank's device
    memory) and, for the args.nproc ranks of the host together, 80% of `host`."""
    best = 1
    for n in range(1, args.max_layers + 1):
        e = estimate(run, config(args, n), args.batch, args.nproc)
        if e["device"] > 0.9 * device or e["host"] * args.nproc > 0.8 * host:
            break
        best = n
    return best


def main(args) -> int:
    from ..launch import RankFailure, run_ranks  # noqa: PLC0415

    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        raise UsageError(f"--runs: unknown {unknown}; expected a comma list of {list(RUNS)}")
    from . import ds_runs  # noqa: PLC0415

    if any(RUNS[r].get("deepspeed") for r in runs) and not ds_runs.available():
        raise UsageError(f"--runs {','.join(r for r in runs if RUNS[r].get('deepspeed'))}: deepspeed is not "
                         "importable here (pip install deepspeed; for a machine without a package index, see "
                         "scripts/gpu_wheels.sh)")
    for name in ("n_embd", "n_head", "vocab", "seq", "batch", "steps", "max_layers", "attempts", "nproc"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name.replace('_', '-')}: expected a positive count, got {getattr(args, name)}")
    if args.n_embd % args.n_head:
        raise UsageError(f"--n-head: {args.n_head} does not divide --n-embd {args.n_embd}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA GPU visible")
    one_rank = [r for r in runs if not RUNS[r] or RUNS[r].get("deepspeed")]
    if args.nproc > 1 and one_rank:
        raise UsageError(f"--runs {','.join(one_rank)}: trains on one rank; with --nproc {args.nproc} name "
                         "zero2, zero3, fsdp2 or the pz offload runs")
    # ranks that share one device: CPU processes, or every rank on GPU 0 (ipc)
    shared = args.nproc > 1 and (args.device == "cpu" or args.gpu_backend == "ipc")
    if args.device == "cuda" and args.nproc > 1 and not shared and torch.cuda.device_count() < args.nproc:
        raise UsageError(f"--nproc {args.nproc} with --gpu-backend nccl needs a GPU per rank, found "
                         f"{torch.cuda.device_count()}; --gpu-backend ipc puts the ranks on GPU 0")
    where, device, host = _memory(args)
    if shared:
        where, device = f"{where} shared by {args.nproc} ranks", device / args.nproc
    print(f"# capacity: GPT n_embd {args.n_embd}, {args.n_head} heads, vocab {args.vocab}, {args.batch} x {args.seq} "
          f"tokens per step and rank, {args.nproc} rank(s), AdamW; {where} ({device / GB:.1f} GB planned per rank), "
          f"host {host / GB:.1f} GB planned")
    print(f"{'run':>16} {'layers':>6} {'params':>10} {'tokens/s':>9} {'dev GB':>7} {'est dev':>7} "
          f"{'rss GB':>7} {'est host':>8}  tried (layers: fits)")
    results, failed = [], []
    for run in runs:
        tries = {}

        def fits(n, run=run, tries=tries):
            c = config(args, n)
            est = estimate(run, c, args.batch, args.nproc)
            if est["host"] * args.nproc > 0.85 * host:
                tries[n] = {"run": run, "layers": n, "params": gpt_params(c), "ok": False, "outcome": "host",
                            "why": f"host: the estimate {est['host'] * args.nproc / GB:.1f} GB exceeds 85% of "
                                   "the host"}
            else:
                try:
                    # A GPU rank (spawned) gets its share of the cores for the CPU optimizer; CPU ranks
                    # compute on the cores themselves, one thread each (a forked rank must not start
                    # OpenMP threads once the parent has used its pool: libgomp hangs in the child).
                    cuda = args.device == "cuda"
                    ranks = run_ranks(_try, args.nproc, args=(run, c, args), timeout=args.timeout,
                                      start="spawn" if cuda else "fork",
                                      threads=max(1, (os.cpu_count() or 1) // args.nproc) if cuda else 1)
                    tries[n] = _merge([r.value for r in ranks])
                except RankFailure as e:  # out of memory on a rank (does not fit), or a crash or a deadline
                    tries[n] = failed_try(e, run, n, gpt_params(c), args.timeout)
            tries[n].update(estimate_device_gb=est["device"] / GB, estimate_host_gb=est["host"] / GB)
            if tries[n]["outcome"] in ("error", "timeout"):
                raise TryFailed
            return tries[n]["ok"]

        try:
            search(fits, predicted_layers(run, args, device, host), args.max_layers, args.attempts)
        except TryFailed:  # whether that size fits is not known: the search stops there, the bench exits 1
            pass
        tried = {n: t["ok"] for n, t in tries.items()}
        best = max((n for n, ok in tried.items() if ok), default=None)
        row = dict(tries[best]) if best is not None else {"run": run, "layers": None, "params": None, "ok": False}
        row["tried"] = list(tries.values())
        bad = [t for t in tries.values() if t["outcome"] in ("error", "timeout")]
        if bad:
            row["failed"] = bad
            failed += bad
        results.append(row)
        trail = ", ".join(f"{n}: {'yes' if t['ok'] else t['outcome'] if t in bad else 'no'}" for n, t in tries.items())
        if best is None:
            print(f"{run:>16} {'-':>6} {'-':>10} {'-':>9} {'-':>7} {'-':>7} {'-':>7} {'-':>8}  {trail}"
                  f"  ({tries[min(tried)].get('why', '')})", flush=True)
            continue
        dev_gb = row["peak_device_gb"]
        print(f"{run:>16} {best:6d} {row['params']:10.3e} {row['tokens_per_s']:9.0f} "
              f"{dev_gb if dev_gb is not None else float('nan'):7.1f} {row['estimate_device_gb']:7.1f} "
              f"{row['peak_rss_gb']:7.1f} {row['estimate_host_gb']:8.1f}  {trail}", flush=True)
    if args.json:
        write_json(args.json, results, {"bench": "capacity", "args": vars(args),
                                        "device_bytes": device, "host_bytes": host})
    for t in failed:
        print(f"# {t['run']} at {t['layers']} layers failed ({t['outcome']}, not out of memory): {t['why']}")
    if failed:
        print(f"# {len(failed)} tr{'y' if len(failed) == 1 else 'ies'} failed for another reason than memory: "
              "those runs' capacity is not known")
    return 1 if failed else 0


if __name__ == "__main__":  # python -m pyzero.bench.capacity
    import argparse

    ap = argparse.ArgumentParser(prog="pyzero-bench capacity", description=__doc__.splitlines()[0])
    add_arguments(ap)
    try:
        raise SystemExit(main(ap.parse_args()))
    except UsageError as e:
        ap.error(str(e))
