"""pyzero-bench train: training step time, tokens/s, hidden communication and
memory of data-parallel runs on a small GPT (bench/gpt.py).

Each run spawns --nproc ranks (pyzero.launch.run_ranks). Every rank builds
the same model (seed 0), trains on its own random batch, and times, as
medians over --iters steps (each started together after a barrier; the
slowest rank counts):
    step     zero_grad + forward + backward + optimizer step
    nocomm   the same step inside no_sync(): no gradient communication (DDP-style
             runs; a ZeRO step communicates in any case: no nocomm). FSDP2's: backward with
             gradient sync off, its local gradients then dropped and each shard given a zero
             gradient, so the AdamW step on the shards is real and nothing leaks into the next
             synced step
    comm     the run's bucketed collectives alone, without backward, on buffers of the
             sizes and dtypes the run reduces (DDP: its own buckets, whose first is not
             --first-bucket-mb; ZeRO: --comm-dtype's reductions)
    exposed  (runs whose gradients are all reduced when backward returns:
             torch-ddp, dp) per step, from the moment the last rank
             accumulated its last gradient (a post-accumulate-grad hook on
             every parameter, set by this bench) until the last rank's
             loss.backward() returned: the communication backward did not
             hide, on the step's critical path. (A rank that finished its
             backward early also waits for the slow one; that is imbalance,
             not communication, and is not counted. The ranks share one
             host, so their monotonic clocks agree.)
Then hidden = 1 - exposed / comm (with --rounds: from the median exposed and comm), and
+step = step - nocomm is the step's
whole cost of communicating, which also counts the CPU the copies take from
backward where every core computes (2 ranks on 2 cores). peak_mib is the
rank's ru_maxrss, delta_mib its growth over the RSS before the model was built.

Runs are a dict name -> set-up function (RUNS); a set-up returns a Runner
and any run can be added there (ZeRO runs, FSDP2) without touching the loop.
torch runs use gloo (the -pyzero runs: the "pyzero" torch.distributed backend),
set up through pyzero's store. "torch-local" is plain torch without any
communication: the baseline the wrappers' cost is measured against. "ds-zero2"
and "ds-zero2-offload" are DeepSpeed's stage 2 and ZeRO-Offload, "ds-zenflow" ZeRO-Offload
with ZenFlow and "ds-superoffload" DeepSpeed's SuperOffload (stage 3, CUDA only)
(bench/ds_runs.py), where deepspeed is importable.

Every run trains the same model (seed 0) on the same batches (rank r's: seed 1000 + r) from the same
start, so the runs' losses, step by step, are loss curves to compare (ZenFlow is not exact: its curve
shows by how much). torch-local has no ranks to average with: at --nproc >= 2 its timed steps train each
rank's own batch (the per-rank compute the wrappers' cost is measured against), and its loss curve comes
from rank 0 retraining a fresh model, after the timed phase and untimed, on every rank's batch (the mean
of their losses: the gradient the DP runs average), as many steps. Runs without a no_sync step
(torch-local, the DeepSpeed runs) take the same steps
throughout; a run with one alternates synced and no_sync steps from the timed phase on, so its
curve compares for the first 2 x --warmup + --memory-steps steps. The JSON holds each
run's "losses" (rank 0's, in order; with --memory the traced step's is NaN), and ``--losses``
prints them side by side with each run's largest difference from the first run's.

With ``--device cuda`` each rank trains on its GPU (pyzero on the nccl backend,
torch runs on torch's NCCL, FSDP2 on a CUDA mesh, AdamW fused everywhere),
every timed call ends with a device synchronisation, and peak_gpu_mib is
torch.cuda.max_memory_allocated over the memory phase: --memory-steps synced
training steps after the warm-up and before the timed phase (so neither the
no_sync steps nor the scratch buffers of the communication-alone timing count).

``--rounds R`` runs the list R times, forward and backward in turn, each run in fresh processes:
a run's step and nocomm are the medians over its rounds (each round's in "step_ms_rounds"), and
a summary gives each run's ratio to the first run as the median of the per-round ratios.

``--profile DIR`` runs one more synced step per run under torch.profiler (bench/steptrace.py): rank 0's
Chrome trace in DIR, and a summary of the host's busiest operators and, on a GPU, the device's waits.

``--memory`` traces one more synced step per rank with pyzero.memtrace.StepTrace
and prints, per run, its peak and what was live at that moment (parameters,
gradients, buckets, optimizer state, gathered units, activations, the step's
temporaries; on a GPU also memory no walk reaches and the allocator's reserve),
the bytes held after backward, and pz.estimate_memory's peak next to it (fed the activations
measured on a fresh plain model, pyzero.memtrace.activation_peak).
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import os
import resource
import time
from typing import Callable, NamedTuple

import torch

from ..distributed import cuda_backend_beside
from . import ds_runs, steptrace
from .common import UsageError, comm_device, init_torch_distributed, interleaved_medians, write_json
from .gpt import PRESETS, make_gpt, random_batch


class Runner(NamedTuple):
    """What the timing loop needs from a run."""

    model: torch.nn.Module  # called as model(inputs, targets) -> loss
    optimizer: torch.optim.Optimizer
    no_sync: Callable | None  # context manager factory: a step without communication
    comm_alone: Callable | None  # runs this run's collectives once, nothing else
    close: Callable = lambda: None
    memory: Callable | None = None  # -> dict of model-state bytes (ZeRO's memory_stats)
    reduces_in_backward: bool = False  # gradient communication ends inside loss.backward()
    backward: Callable | None = None  # loss -> None in place of loss.backward() (DeepSpeed's engine)
    buckets: Callable | None = None  # -> bytes of each buffer comm_alone reduces (where they can differ from caps)


def _on_cuda(model) -> bool:
    return next(model.parameters()).device.type == "cuda"


def _adamw_kwargs(model) -> dict:
    """AdamW's settings in every run: fused on a GPU (the fastest torch has)."""
    return dict(lr=1e-4, fused=True) if _on_cuda(model) else dict(lr=1e-4)


def _setup_torch_local(model, args) -> Runner:
    """Plain torch, no communication at all: what the wrappers cost is measured against it."""
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(model))
    return Runner(model, opt, None, None)


def _setup_dp(model, args) -> Runner:
    import pyzero as pz  # noqa: PLC0415

    comm_dtype = getattr(torch, args.comm_dtype) if args.comm_dtype else None
    dp = pz.DataParallel(model, bucket_mb=args.bucket_mb, first_bucket_mb=args.first_bucket_mb,
                         comm_dtype=comm_dtype)
    opt = torch.optim.AdamW(dp.parameters(), **_adamw_kwargs(model))
    return Runner(dp, opt, dp.no_sync, dp.reducer.run_collectives, reduces_in_backward=True)


def _setup_torch_ddp(backend: str) -> Callable:
    """torch DDP on torch.distributed's `backend` ("gloo", or pyzero's own "pyzero")."""
    return lambda model, args: _torch_ddp(model, args, backend)


def _torch_ddp(model, args, backend: str) -> Runner:
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    from ..bucketing import assign_buckets  # noqa: PLC0415

    dist = _init_torch(_torch_backend(model, backend, args))
    # DDP's own best CPU set-up: gradients as bucket views, the same bucket caps
    # (its first bucket is 1 MiB, like pz's default).
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    opt = torch.optim.AdamW(ddp.parameters(), **_adamw_kwargs(model))
    params = [p for p in model.parameters() if p.requires_grad]
    dev = params[0].device
    flats = []

    def comm_alone():
        if not flats:  # at the first call (after the warm-up: DDP has rebuilt its buckets; not there while
            # memory is measured): buffers of DDP's own bucket sizes (--first-bucket-mb is pz's, not DDP's)
            sizes = ddp_bucket_bytes(ddp)
            if sizes is None:  # (a torch that does not say: DDP's caps, whose first bucket is the cap given)
                cap = int(args.bucket_mb * 2**20)
                sizes = [b.numel * params[0].element_size() for b in assign_buckets(params, cap, cap)]
            flats.extend(torch.zeros(n // params[0].element_size(), dtype=params[0].dtype, device=dev)
                         for n in sizes)
        for w in [dist.all_reduce(f, async_op=True) for f in flats]:
            w.wait()

    def buckets():
        return [f.numel() * f.element_size() for f in flats]

    return Runner(ddp, opt, ddp.no_sync, comm_alone, lambda: _close_torch(dist), reduces_in_backward=True,
                  buckets=buckets)


def ddp_bucket_bytes(ddp) -> list[int] | None:
    """The bytes of each bucket torch DDP reduces now (its logging data: after the first step, the buckets it
    rebuilt in the gradients' order); None where this torch does not say."""
    try:
        data = ddp._get_ddp_logging_data()
        sizes = data.get("rebuilt_bucket_sizes") or data.get("bucket_sizes")  # (not rebuilt at one rank)
        out = [int(n) for n in str(sizes).split(",") if n.strip()]
    except (AttributeError, RuntimeError, ValueError):
        return None
    return out or None


def bucket_caps(run: str, args) -> str | None:
    """The bucket caps a run reduces with, as the header prints them; None for a run without buckets."""
    if run == "dp":
        return f"first {args.first_bucket_mb:g} MiB, then {args.bucket_mb:g} MiB"
    if run in ("torch-ddp", "torch-ddp-pyzero", "torch-zero"):
        return f"{args.bucket_mb:g} MiB caps (DDP's bucket_cap_mb; its first bucket is its own, not --first-bucket-mb)"
    if run.startswith("zero"):
        return f"{args.bucket_mb:g} MiB (ZeroOptimizer's bucket_mb; no first bucket)"
    if run.startswith("ds-"):
        return f"{args.bucket_mb:g} MiB (DeepSpeed's bucket sizes)"
    return None


def _zero_comm_alone(opt) -> Callable:
    """The collectives one ZeRO step issues (opt.comm_plan()), on scratch buffers of the same
    sizes, nothing else; the calls of one phase in flight together."""
    import pyzero as pz  # noqa: PLC0415

    g, rank, world, dev = opt.group, opt.group.rank, opt.group.size, opt.device
    model_dtype = opt.param_dtype or opt.params[0].dtype
    # the run's dtypes: gradients reduced in comm_dtype (stages 2-3; stage 1 in the model's), parameters
    # gathered in the model's
    reduce_dtype = opt.comm_dtype if opt.stage >= 2 else model_dtype
    phases = []

    def build():  # at the first call: the scratch buffers are not there while memory is measured
        for phase in opt.comm_plan():
            calls = []
            for c in phase:
                dtype = reduce_dtype if c.op == "reduce_scatter" else model_dtype
                full = torch.zeros(c.numel, dtype=dtype, device=dev)
                if c.op == "reduce_scatter":
                    n = c.numel // world if c.counts is None else c.counts[rank]
                    calls.append(lambda o=torch.empty(n, dtype=dtype, device=dev), i=full, c=c: pz.reduce_scatter(
                        o, i, op="avg", counts=c.counts, group=g, async_op=True))
                else:
                    shard = full[rank * (c.numel // world):][:c.numel // world]
                    calls.append(lambda o=full, i=shard: pz.all_gather(o, i, group=g, async_op=True))
            phases.append(calls)

    def run():
        if not phases:
            build()
        for calls in phases:
            for w in [call() for call in calls]:
                w.wait()
    return run


def _setup_zero(stage: int, offload: str | None = None, pipeline=None, delayed=False) -> Callable:
    """ZeroOptimizer at `stage`; offload="cpu": masters and AdamW state in host memory, the step on
    the CPU (stage 3: the parameter shards too), slot by slot at step() (the default
    offload_pipeline, the -offload runs), with offload_pipeline=True (the -offload-pipe runs:
    during backward from the second step on) or with delayed_update=True (the -offload-dpu run:
    the CPU step behind the next forward and backward, its update one step late); see
    docs/offload.md."""
    def setup(model, args) -> Runner:
        import pyzero as pz  # noqa: PLC0415

        extra = {} if offload is None else {"offload": offload, "offload_params": stage == 3,
                                             "offload_pipeline": pipeline, "delayed_update": delayed}
        if stage >= 2 and getattr(args, "comm_dtype", None):  # (stage 1 reduces in the model's dtype, refuses another)
            extra["comm_dtype"] = getattr(torch, args.comm_dtype)
        cls = torch.optim.AdamW  # (offload swaps in pz.optim.AdamW, on torch's intra-op threads)
        if offload is not None and getattr(args, "offload_threads", None) is not None:
            cls, extra["threads"] = pz.optim.AdamW, args.offload_threads
        opt = pz.ZeroOptimizer(model, cls, stage=stage, bucket_mb=args.bucket_mb, **_adamw_kwargs(model), **extra)
        # Not timed as exposed: stage 1 reduces at step time, stage 2 waits for its buckets in the
        # hooks and at step time, stage 3 also gathers in forward. No nocomm step: a ZeRO step
        # communicates whatever no_sync does (stage 1 reduces at step(), stages 2-3 refuse a step
        # after a no_sync backward, whose gradients they have not reduced).
        return Runner(model, opt, None, _zero_comm_alone(opt), memory=opt.memory_stats)
    return setup


def _init_torch(backend: str = "gloo"):
    return init_torch_distributed(backend)


def _torch_backend(model, backend: str, args=None) -> str:
    """The torch.distributed backend of a torch run: as named for a CPU model (gloo, or pyzero's own
    "pyzero"); for a CUDA model NCCL, or pyzero's "pyzero" backend on CUDA tensors for the -pyzero
    runs and for every torch run with --gpu-backend ipc (several processes may share a GPU there,
    which NCCL refuses)."""
    if not _on_cuda(model):
        return backend
    if backend == "pyzero":
        return backend
    return cuda_backend_beside(getattr(args, "gpu_backend", "nccl"))


def _close_torch(dist):
    dist.barrier()  # leave together: the rank hosting gloo's store must not go first
    dist.destroy_process_group()


def _setup_torch_zero(model, args) -> Runner:
    """torch's ZeroRedundancyOptimizer (sharded AdamW state) under DDP, as its docs pair them."""
    from torch.distributed.optim import ZeroRedundancyOptimizer  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel  # noqa: PLC0415

    dist = _init_torch(_torch_backend(model, "gloo", args))
    ddp = DistributedDataParallel(model, bucket_cap_mb=args.bucket_mb, gradient_as_bucket_view=True)
    opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **_adamw_kwargs(model))
    return Runner(ddp, opt, ddp.no_sync, None, lambda: _close_torch(dist))


def _setup_fsdp2(backend: str) -> Callable:
    """torch FSDP2 (fully_shard per transformer block and the root) on a CPU mesh of `backend`."""
    return lambda model, args: _fsdp2(model, args, backend)


def _fsdp2(model, args, backend: str) -> Runner:
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    dist = _init_torch(_torch_backend(model, backend, args))
    mesh = init_device_mesh("cuda" if _on_cuda(model) else "cpu", (int(os.environ["WORLD_SIZE"]),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(model))

    return Runner(model, opt, fsdp2_no_sync(model), None, lambda: _close_torch(dist))


def fsdp2_no_sync(model) -> Callable:
    """FSDP2's step without gradient communication, for the nocomm timing: backward with gradient sync off and
    the parameters left unsharded, their local gradients then dropped (FSDP2 would add them into the next
    synced step's) and the parameters resharded; each shard then gets a zero gradient, so the optimizer step
    after it is a real AdamW step on the shard (with sync off FSDP2 leaves the shards' gradients None and
    AdamW.step() skips every parameter)."""
    from torch.distributed.fsdp import FSDPModule  # noqa: PLC0415

    @contextlib.contextmanager
    def no_sync():
        model.set_requires_gradient_sync(False)
        model.set_reshard_after_backward(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
            model.set_reshard_after_backward(True)
            for p in model.parameters():  # (still unsharded: the local gradients)
                p.grad = None
            for m in model.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()
            for p in model.parameters():  # the shards
                p.grad = torch.zeros_like(p)
    return no_sync


def _setup_ds(variant: str) -> Callable:
    """DeepSpeed's ZeRO stage 2 (with its optimizer offloaded to the CPU: zero2-offload, zenflow) or
    SuperOffload (bench/ds_runs.py)."""
    def setup(model, args) -> Runner:
        dist = _init_torch(_torch_backend(model, "gloo", args))
        engine = ds_runs.initialize(model, batch=args.batch, bucket_bytes=int(args.bucket_mb * 2**20),
                                    cuda=_on_cuda(model), variant=variant)

        def close():
            engine.destroy()
            _close_torch(dist)
        return Runner(engine, ds_runs.EngineStep(engine), None, None, close, backward=engine.backward)
    return setup


# torch-ddp / fsdp2 run on gloo; their -pyzero twins are the same torch code on the "pyzero"
# torch.distributed backend (pyzero.distributed): the one-string switch.
RUNS: dict[str, Callable] = {"torch-local": _setup_torch_local, "torch-ddp": _setup_torch_ddp("gloo"), "torch-ddp-pyzero": _setup_torch_ddp("pyzero"),
                             "dp": _setup_dp, "zero1": _setup_zero(1), "zero2": _setup_zero(2),
                             "zero3": _setup_zero(3), "zero2-offload": _setup_zero(2, "cpu"),
                             "zero3-offload": _setup_zero(3, "cpu"),
                             "zero2-offload-pipe": _setup_zero(2, "cpu", True),
                             "zero3-offload-pipe": _setup_zero(3, "cpu", True),
                             "zero2-offload-dpu": _setup_zero(2, "cpu", delayed=True), "torch-zero": _setup_torch_zero,
                             "fsdp2": _setup_fsdp2("gloo"), "fsdp2-pyzero": _setup_fsdp2("pyzero"),
                             "ds-zero2": _setup_ds("zero2"), "ds-zero2-offload": _setup_ds("zero2-offload"),
                         "ds-zenflow": _setup_ds("zenflow"), "ds-superoffload": _setup_ds("superoffload")}


def add_arguments(p) -> None:
    p.add_argument("--model", default="gpt-tiny", help=f"one of {list(PRESETS)}")
    p.add_argument("--runs", default="torch-ddp,dp", help=f"comma list of {list(RUNS)}")
    p.add_argument("--nproc", type=int, default=2, help="ranks to spawn (default 2)")
    p.add_argument("--batch", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=64, help="tokens per sequence")
    p.add_argument("--iters", type=int, default=20, help="timed steps per measurement")
    p.add_argument("--warmup", type=int, default=3)
    # gpt-tiny's gradients are 14 MiB: DDP's 25 MiB default would make one bucket that
    # can only start when backward ends. Both runs get the same caps.
    p.add_argument("--bucket-mb", type=float, default=1.0, help="bucket cap, MiB (pz and torch DDP)")
    p.add_argument("--first-bucket-mb", type=float, default=1.0, help="first bucket cap, MiB")
    p.add_argument("--comm-dtype", default=None, choices=["bfloat16", "float16"],
                   help="the gradient reductions' dtype of the dp and zero2/zero3 runs (their -offload ones too); "
                        "zero1 reduces in the model's dtype whatever this says, the torch runs in theirs")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per rank (the CPU optimizer of offload runs uses them too); "
                        "default 1 with --device cpu (the ranks compute on the cores), the cores divided "
                        "among the ranks with --device cuda")
    p.add_argument("--offload-threads", type=int, default=None,
                   help="threads of the CPU step in the pyzero offload runs (default: --threads); fewer than "
                        "the cores leave cores to the threads that launch GPU work while the step runs "
                        "(-offload-pipe during backward, -offload-dpu during forward and backward)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="cpu: shm backend and gloo; cuda: a GPU per rank, the nccl backend and torch's NCCL")
    p.add_argument("--gpu-backend", default="nccl", choices=("nccl", "ipc"),
                   help="with --device cuda: pyzero's backend; ipc lets several ranks share a GPU "
                        "(CUDA_VISIBLE_DEVICES=0, MPS), and the torch runs then use torch.distributed's "
                        "'pyzero' backend on CUDA tensors instead of NCCL")
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--memory", action="store_true",
                   help="per run, the peak of a training step and its breakdown (parameters, gradients, "
                        "buckets, optimizer state, gathered units, activations, ...; pyzero.memtrace), "
                        "against pz.estimate_memory")
    p.add_argument("--memory-steps", type=int, default=3, help="synced steps the memory phase measures")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed steps, one synced step per run under torch.profiler: its Chrome trace "
                        "(rank 0's) in DIR/<run>_rank0.json, and a summary: the host operators with the most self "
                        "time and, on a GPU, how long the device waited for the host during the step (first round)")
    p.add_argument("--rounds", type=int, default=1,
                   help="run the list this many times, forward and backward in turn (A B, B A, ...), each run "
                        "in fresh processes; step and nocomm are the median over the rounds, and a summary gives "
                        "each run's ratio to the first run, paired within rounds (memory and loss curves: the "
                        "first round's)")
    p.add_argument("--losses", action="store_true",
                   help="print every run's loss at each step (the same batch and start for all: loss curves), "
                        "and each run's largest difference from the first run's")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def _rank_main(run: str, args) -> dict:
    import pyzero as pz  # noqa: PLC0415

    cuda = getattr(args, "device", "cpu") == "cuda"
    stacks = cuda and getattr(args, "memory", False)
    if stacks:  # where what no walk reaches was allocated ("other": memtrace.sites); off before the timed phase
        torch.cuda.memory._record_memory_history(enabled="state", context="state", stacks="python")
    pz.init(backend=getattr(args, "gpu_backend", "nccl") if cuda else "shm")
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rss0 = _rss_mib()
    model = make_gpt(args.model).to(dev)
    runner = RUNS[run](model, args)
    try:
        x, y = (t.to(dev) for t in random_batch(model.config, args.batch, args.seq, seed=1000 + pz.get_rank()))
        losses, marks, last_grad = [], [], [0.0]

        def mark(_):
            last_grad[0] = time.perf_counter()

        # Registered after the run's own hooks, so they fire after them.
        hooks = [p.register_post_accumulate_grad_hook(mark) for p in model.parameters() if p.requires_grad] \
            if runner.reduces_in_backward else []

        backward = runner.backward or torch.Tensor.backward

        def step(ctx=contextlib.nullcontext):
            runner.optimizer.zero_grad(set_to_none=True)
            with ctx():
                loss = runner.model(x, y)
                backward(loss)
                if hooks and ctx is contextlib.nullcontext:
                    marks.append((last_grad[0], time.perf_counter()))
            runner.optimizer.step()
            losses.append(loss.item())
            if cuda:
                torch.cuda.synchronize(dev)  # the step's kernels, the optimizer's included, are timed

        # Same seed, data and steps in every run: equal losses say the runs train alike.
        if args.warmup:  # the warm-up: 2 x --warmup synced steps (those of the loss curves every run takes)
            interleaved_medians([step], args.warmup, args.warmup)
        out = {"run": run}
        # The memory phase: synced training steps alone (no no_sync step, no scratch buffers of
        # the communication-alone timing), before the timed phase.
        if cuda:
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        for _ in range(getattr(args, "memory_steps", 3)):
            step()
        last_loss, synced_steps = losses[-1], len(losses)
        if cuda:
            out["peak_gpu_mib"] = torch.cuda.max_memory_allocated(dev) / 2**20
        if getattr(args, "memory", False):
            out["memory"] = _trace_step(runner, x, y, dev)
            if stacks:
                torch.cuda.memory._record_memory_history(enabled=None)
            out["activations"] = _activations(args, x, y, dev)  # (a fresh model of its own)
            losses.append(float("nan"))  # (a step the curve does not see)
        comm_alone = runner.comm_alone
        if cuda and comm_alone is not None:
            def comm_alone(f=runner.comm_alone):
                f()
                torch.cuda.synchronize(dev)
        fns = [step] + ([lambda: step(runner.no_sync)] if runner.no_sync else []) \
            + ([comm_alone] if comm_alone else [])
        timed = interleaved_medians(fns, args.iters, args.warmup)
        out["step_s"] = timed.pop(0)
        out["nocomm_s"] = timed.pop(0) if runner.no_sync else None
        out["comm_s"] = timed.pop(0) if runner.comm_alone else None
        if runner.buckets is not None:
            out["bucket_bytes"] = runner.buckets()
        if hooks:  # per timed synced step: last rank's backward end - last rank's last gradient; median
            # (iters, 2): last gradient, end
            t = torch.tensor(marks[-args.iters:], dtype=torch.float64, device=comm_device())
            pz.all_reduce(t, op="max")
            out["exposed_s"] = float((t[:, 1] - t[:, 0]).median())
            for h in hooks:
                h.remove()
        if getattr(args, "profile", None):  # (every rank runs the step: its collectives need them all)
            path = os.path.join(args.profile, f"{run}_rank0.json") if pz.get_rank() == 0 else None
            out["profile"] = steptrace.profile_step(step, cuda, path)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        out.update(loss=last_loss, losses=list(losses), peak_mib=peak, delta_mib=peak - rss0)
        if run == "torch-local" and pz.get_world_size() > 1 and pz.get_rank() == 0:
            # its timed steps train each rank's own batch (the per-rank compute the wrappers are measured
            # against); its loss curve is the DP runs': every rank's batch, retrained here, untimed
            batches = [tuple(t.to(dev) for t in random_batch(model.config, args.batch, args.seq, seed=1000 + r))
                       for r in range(pz.get_world_size())]
            curve = global_batch_losses(args.model, batches, [v != v for v in losses], dev)
            out.update(loss=curve[synced_steps - 1], losses=curve, losses_from="global batch, untimed")
        if runner.memory is not None:
            # a synced step last, its model states read between backward and step (step() releases
            # the gradients)
            runner.optimizer.zero_grad(set_to_none=True)
            runner.model(x, y).backward()
            model_state = runner.memory()
            runner.optimizer.step()
            stage = runner.optimizer.stage
            n = sum(p.numel() for p in runner.optimizer.params)
            offload = _offload(run, cuda)
            est = pz.zero.estimate_memory(n, pz.get_world_size(), stage, optimizer_state_bytes_per_param=8,
                                          mixed_precision=False, offload=offload,
                                          offload_params=offload is not None and stage == 3)  # fp32 AdamW: K = 8
            # (with offload memory_stats' total is the device's part: the host's is its "host")
            states = pz.zero.memory.device_states(est, stage, offload, offload is not None and stage == 3)
            out.update(model_state=model_state, model_state_estimate=sum(states.values()))
        return out
    finally:
        # Free the run's model (a torch DDP / FSDP module and its reducer) before its process
        # group is destroyed, as torch asks: a DDP reducer outliving its group can block on exit.
        close = runner.close
        del runner, model
        gc.collect()
        close()


def global_batch_losses(model_name: str, batches: list, nan: list[bool], dev) -> list[float]:
    """The loss curve of plain torch on the DP runs' global batch: a fresh model (seed 0), AdamW, each step's
    gradient that of the mean of its losses on `batches` (every rank's: the gradient the DP runs average),
    one step per entry of `nan`; each step's loss on batches[0] (rank 0's, as the runs record), NaN where
    `nan` says (the step --memory traces)."""
    model = make_gpt(model_name).to(dev)
    opt = torch.optim.AdamW(model.parameters(), **_adamw_kwargs(model))
    out = []
    for blank in nan:
        opt.zero_grad(set_to_none=True)
        losses = [model(x, y) for x, y in batches]
        (sum(losses) / len(losses)).backward()
        opt.step()
        out.append(float("nan") if blank else losses[0].item())
    return out


_STAGE = {"torch-local": 0, "torch-ddp": 0, "torch-ddp-pyzero": 0, "dp": 0, "zero1": 1, "zero2": 2, "zero3": 3,
          "zero2-offload": 2, "zero3-offload": 3, "zero2-offload-pipe": 2, "zero3-offload-pipe": 3,
          "zero2-offload-dpu": 2, "torch-zero": 1,
          "fsdp2": 3, "fsdp2-pyzero": 3}


def _offload(run: str, cuda: bool) -> str | None:
    """The -offload runs' offload as estimate_memory takes it: "cpu" for a CUDA model; a CPU model's
    ZeroOptimizer makes no host copies (its states are in the one memory either way): None."""
    return "cpu" if cuda and run.startswith("zero") and "-offload" in run else None


def _trace_step(runner, x, y, dev) -> dict:
    """One synced training step under pyzero.memtrace.StepTrace: its peak and what was live then
    (walked: the run's module, optimizer and wrapper), and the bytes held after backward."""
    from .. import memtrace  # noqa: PLC0415

    objs = [runner.model, runner.optimizer]
    runner.optimizer.zero_grad(set_to_none=True)
    with memtrace.StepTrace(*objs, device=dev) as tr:
        loss = runner.model(x, y)
        loss.backward()
        tr.mark("backward")
        runner.optimizer.step()
        del loss
    return tr.result()


def _activations(args, x, y, dev) -> dict:
    """The GPT's activations at --batch x --seq, measured on a fresh plain model
    (pyzero.memtrace.activation_peak): what estimate_memory takes as activation_bytes and
    grads_done."""
    from .. import memtrace  # noqa: PLC0415

    model = make_gpt(args.model).to(dev)
    try:
        return memtrace.activation_peak(model, lambda: model(x, y).backward(), device=dev)
    finally:
        del model


def _largest_layer_params(model) -> int:
    """Parameters of the module that owns the most (a tied one counted with its first module)."""
    seen, best = set(), 0
    for m in model.modules():
        own = [p for p in m.parameters(recurse=False) if id(p) not in seen]
        seen.update(map(id, own))
        best = max(best, sum(p.numel() for p in own))
    return best


def _estimate(run: str, args, world: int, activations: dict) -> dict:
    """pz.estimate_memory for the run: fp32 AdamW (K = 8; torch's for-loop step on the CPU, fused on
    a GPU), the measured activations, the GPT's largest module, the run's bucket size, reduction dtype
    and offload."""
    import pyzero as pz  # noqa: PLC0415

    model = make_gpt(args.model)
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    cuda = getattr(args, "device", "cpu") == "cuda"
    done = activations["grads_done"]
    # plain torch (zero_grad(set_to_none=True), no buckets) holds what ZeRO holds at one rank
    stage, world = (1, 1) if run == "torch-local" else (_STAGE.get(run, 0), world)
    if run == "torch-zero":  # ZeroRedundancyOptimizer under DDP with gradient_as_bucket_view: stage 1's sharded
        done = 1.0  # optimizer state, and DDP's buckets, the gradients' storage, held from step to step
    comm_dtype = getattr(args, "comm_dtype", None)
    comm_bytes = None
    if comm_dtype and (run == "dp" or (run.startswith("zero") and stage >= 2)):
        comm_bytes = torch.tensor([], dtype=getattr(torch, comm_dtype)).element_size()  # (dp: its copies)
    offload = _offload(run, cuda)
    out = pz.zero.estimate_memory(n, world, stage, optimizer_state_bytes_per_param=8, mixed_precision=False,
                                   activation_bytes=activations["bytes"], grads_done=done,
                                   largest_layer_params=_largest_layer_params(model),
                                   step_impl="fused" if cuda else "forloop", comm_bytes=comm_bytes,
                                   bucket_mb=args.bucket_mb, offload=offload,
                                   offload_params=offload is not None and stage == 3)
    out["grads_done"] = done
    return out


def _summarise(run: str, ranks: list[dict], args) -> dict:
    r0 = ranks[0]
    res = {"run": run, "model": args.model, "nproc": args.nproc, "batch": args.batch, "seq": args.seq,
           "params": sum(p.numel() for p in make_gpt(args.model).parameters()),
           "step_ms": r0["step_s"] * 1e3,
           "tokens_per_s": args.nproc * args.batch * args.seq / r0["step_s"],
           "loss": r0["loss"], "losses": r0["losses"],
           "peak_mib": [r["peak_mib"] for r in ranks], "delta_mib": [r["delta_mib"] for r in ranks]}
    if "peak_gpu_mib" in r0:
        res["peak_gpu_mib"] = [r["peak_gpu_mib"] for r in ranks]
    if "memory" in r0:
        res["memory"] = [r["memory"] for r in ranks]
        est = _estimate(run, args, args.nproc, max((r["activations"] for r in ranks), key=lambda a: a["bytes"]))
        res["estimate"] = {k: est[k] for k in ("params", "grads", "optimizer", "activations", "grads_done",
                                               "gathered", "staging", "comm_copies", "step_temps", "total", "peak")}
    if "profile" in r0:
        res["profile"] = r0["profile"]
    for key in ("bucket_bytes", "losses_from"):
        if key in r0:
            res[key] = r0[key]
    if "model_state" in r0:
        ms = r0["model_state"]
        res.update(model_state_mib=ms["total"] / 2**20, estimate_mib=r0["model_state_estimate"] / 2**20,
                   peak_gathered_mib=ms.get("peak_gathered_params", 0) / 2**20)
    if r0["nocomm_s"] is not None:
        res.update(nocomm_ms=r0["nocomm_s"] * 1e3, extra_step_ms=(r0["step_s"] - r0["nocomm_s"]) * 1e3)
    if r0["comm_s"] is not None:
        res.update(comm_ms=r0["comm_s"] * 1e3)
    if r0.get("exposed_s") is not None and r0["comm_s"]:
        res.update(exposed_ms=r0["exposed_s"] * 1e3, hidden=max(0.0, 1.0 - r0["exposed_s"] / r0["comm_s"]))
    return res


def _plot(path: str, results: list[dict]) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    names = [r["run"] for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.bar(names, [r["tokens_per_s"] for r in results], color="tab:blue")
    a.set_ylabel("tokens/s (all ranks)")
    a.set_title(f"{results[0]['model']}, {results[0]['nproc']} ranks")
    results = [r for r in results if "hidden" in r]
    names = [r["run"] for r in results]
    comm = [r["comm_ms"] for r in results]
    exposed = [min(r["exposed_ms"], c) for r, c in zip(results, comm)]
    b.bar(names, [c - e for c, e in zip(comm, exposed)], label="hidden behind backward", color="tab:green")
    b.bar(names, exposed, bottom=[c - e for c, e in zip(comm, exposed)], label="exposed", color="tab:red")
    b.scatter(names, [r.get("extra_step_ms", float("nan")) for r in results], marker="D", color="k", zorder=3,
              label="step - nocomm (incl. CPU contention)")
    b.set_ylabel("communication per step (ms)")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _print_memory(results: list[dict]) -> None:
    """Per run, the traced step's peak on the rank where it was highest and what was live then
    (MiB), the bytes held after backward, and pz.estimate_memory's peak against it."""
    from .. import memtrace  # noqa: PLC0415

    rows, held, est = [], [], []
    for res in results:
        rank = max(range(len(res["memory"])), key=lambda i: res["memory"][i]["peak"])
        r = res["memory"][rank]
        rows.append((f"{res['run']}[{rank}]", r))
        held.append((res["run"], r["held"]["backward"]))
        est.append((res["run"], r["peak"], res["estimate"]))
    print("\n# memory: peak of one synced step per run (MiB), what was live at the peak")
    print(memtrace.format_table(rows))
    if any(r.get("other_sites") for _, r in rows):
        print("\n# other: what was allocated before the step and no walk reaches, by where (MiB, allocations)")
        for name, r in rows:
            for where, n, count in r.get("other_sites", ()):
                print(f"{name:>16} {n / 2**20:9.2f} {count:5d}  {where}")
    print("\n# held after backward, before step (MiB): " + "  ".join(f"{c}" for c in memtrace.CATEGORIES))
    for name, h in held:
        print(f"{name:>16} " + " ".join(f"{h[c] / 2**20:11.2f}" for c in memtrace.CATEGORIES)
              + f" {h['total'] / 2**20:11.2f} total")
    print("\n# pz.estimate_memory (fp32 AdamW, activations measured at --batch x --seq): its peak against the "
          "traced one")
    print(f"{'run':>16} {'est.peak':>9} {'peak':>9} {'est/peak':>8} {'activations':>11} {'grads_done':>10} "
          f"{'gathered':>9} {'staging':>9} {'comm_copies':>11} {'step_temps':>10} {'est.total':>10}")
    for name, peak, e in est:
        print(f"{name:>16} {e['peak'] / 2**20:9.2f} {peak / 2**20:9.2f} {e['peak'] / peak:8.3f} "
              f"{e['activations'] / 2**20:11.2f} {e['grads_done']:10.3f} {e['gathered'] / 2**20:9.2f} "
              f"{e.get('staging', 0) / 2**20:9.2f} {e.get('comm_copies', 0) / 2**20:11.2f} "
              f"{e['step_temps'] / 2**20:10.2f} {e['total'] / 2**20:10.2f}")


def loss_curves(results: list[dict]) -> str:
    """The runs' per-step losses side by side (rank 0's; a run with fewer steps leaves blanks), then
    per run its largest |loss - the first run's loss| over the steps both took (NaN steps left out)
    and its loss at the last step the first run took too."""
    import math  # noqa: PLC0415

    names = [r["run"] for r in results]
    curves = [r["losses"] for r in results]
    width = max(10, *(len(n) for n in names))
    lines = [f"{'step':>5} " + " ".join(f"{n:>{width}}" for n in names)]
    for k in range(max(len(c) for c in curves)):
        lines.append(f"{k + 1:5d} " + " ".join(f"{c[k]:{width}.5f}" if k < len(c) else " " * width for c in curves))
    ref = curves[0]
    lines.append(f"{'run':>{width}} {'steps':>5} {'max |d| vs ' + names[0]:>{width + 11}} {'at step':>7} "
                 f"{'loss':>9} {names[0]:>{width}}")
    for name, c in zip(names, curves):
        n = min(len(c), len(ref))
        diffs = [(abs(a - b), k) for k, (a, b) in enumerate(zip(c[:n], ref[:n])) if not (math.isnan(a) or math.isnan(b))]
        d, at = max(diffs) if diffs else (float("nan"), -1)
        lines.append(f"{name:>{width}} {len(c):5d} {d:{width + 11}.3e} {at + 1:7d} {c[n - 1]:9.5f} {ref[n - 1]:{width}.5f}")
    return "\n".join(lines)


def _row(run: str, res: dict) -> str:
    """One run's line of the main table."""
    hid = f"{100 * res['hidden']:6.1f}%" if "hidden" in res else f"{'-':>7}"
    nan = float("nan")
    return (f"{run:>16} {res['step_ms']:9.2f} {res['tokens_per_s']:10.0f} {res.get('nocomm_ms', nan):10.2f} "
            f"{res.get('extra_step_ms', nan):9.2f} {res.get('comm_ms', nan):8.2f} {res.get('exposed_ms', nan):10.2f} "
            f"{hid} {res['loss']:8.4f} {max(res.get('peak_gpu_mib', res['peak_mib'])):9.0f}"
            + (f" {res['model_state_mib']:10.2f} {res['estimate_mib']:8.2f} {res['peak_gathered_mib']:9.2f}"
               if "model_state_mib" in res else ""))


def _over_rounds(rounds: list[dict], args) -> dict:
    """One run's result over its rounds: the first round's, with step and nocomm (and the rest of the
    times) the median over the rounds, each round's kept in "<key>_rounds", hidden from the median
    exposed and comm times (each round's in "hidden_rounds"), and the peaks the largest any round saw,
    per rank."""
    import statistics  # noqa: PLC0415

    res = dict(rounds[0])
    if len(rounds) == 1:
        return res
    for key in ("step_ms", "nocomm_ms", "extra_step_ms", "comm_ms", "exposed_ms"):
        if all(r.get(key) is not None for r in rounds):
            res[f"{key}_rounds"] = [r[key] for r in rounds]
            res[key] = statistics.median(res[f"{key}_rounds"])
    res["tokens_per_s"] = args.nproc * args.batch * args.seq / (res["step_ms"] / 1e3)
    if "hidden" in res and "exposed_ms_rounds" in res and "comm_ms_rounds" in res:
        res["hidden_rounds"] = [r["hidden"] for r in rounds]
        res["hidden"] = max(0.0, 1.0 - res["exposed_ms"] / res["comm_ms"])
    for key in ("peak_mib", "peak_gpu_mib"):
        if key in res:
            res[key] = [max(r[key][i] for r in rounds) for i in range(len(res[key]))]
    return res


def rounds_table(results: list[dict]) -> str:
    """Per run, the median step (and nocomm step) over the rounds, the rounds' range, and its ratio to
    the first run's: the median of the per-round ratios (a round runs every run, so drift of the machine
    between rounds cancels), with their range."""
    import statistics  # noqa: PLC0415

    first = results[0]
    lines = [f"\n# over {len(first['step_ms_rounds'])} rounds (runs in turn, forward then backward): median step "
             f"ms, the rounds' range, and the ratio to {first['run']} (median of the per-round ratios, range)",
             f"{'run':>16} {'step ms':>9} {'min':>9} {'max':>9} {'x ' + first['run']:>14} {'range':>13} "
             f"{'nocomm ms':>10} {'x nocomm':>9} {'hidden':>7}  (hidden: 1 - median exposed / median comm)"]
    for res in results:
        steps = res["step_ms_rounds"]
        ratios = [a / b for a, b in zip(steps, first["step_ms_rounds"])]
        line = (f"{res['run']:>16} {res['step_ms']:9.2f} {min(steps):9.2f} {max(steps):9.2f} "
                f"{statistics.median(ratios):14.4f} {min(ratios):6.4f}-{max(ratios):6.4f}")
        if "nocomm_ms_rounds" in res and "nocomm_ms_rounds" in first:
            nr = [a / b for a, b in zip(res["nocomm_ms_rounds"], first["nocomm_ms_rounds"])]
            line += f" {res['nocomm_ms']:10.2f} {statistics.median(nr):9.4f}"
        else:
            line += f" {'-':>10} {'-':>9}"
        if "hidden" in res:
            line += f" {100 * res['hidden']:6.1f}%"
        lines.append(line)
    return "\n".join(lines)


def main(args) -> int:
    from ..launch import run_ranks  # noqa: PLC0415

    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in runs if r not in RUNS]
    if unknown or not runs:
        raise UsageError(f"--runs: unknown {unknown}; expected a comma list of {list(RUNS)}")
    if any(r.startswith("ds-") for r in runs) and not ds_runs.available():
        raise UsageError(f"--runs {','.join(r for r in runs if r.startswith('ds-'))}: deepspeed is not importable "
                         "here (pip install deepspeed; for a machine without a package index, see "
                         "scripts/gpu_wheels.sh)")
    if args.model not in PRESETS:
        raise UsageError(f"--model: expected one of {list(PRESETS)}, got {args.model!r}")
    for name, least in (("nproc", 1), ("iters", 1), ("batch", 1), ("warmup", 0), ("memory_steps", 1)):
        value = getattr(args, name, least)
        if value < least:
            raise UsageError(f"--{name.replace('_', '-')}: expected >= {least}, got {value}")
    if "ds-superoffload" in runs and getattr(args, "device", "cpu") != "cuda":
        raise UsageError("--runs ds-superoffload: DeepSpeed's SuperOffload runs on CUDA only (--device cuda)")
    if getattr(args, "gpu_backend", "nccl") != "nccl" and getattr(args, "device", "cpu") != "cuda":
        raise UsageError(f"--gpu-backend {args.gpu_backend}: needs --device cuda")
    if args.threads is None:
        args.threads = max(1, (os.cpu_count() or 1) // args.nproc) if getattr(args, "device", "cpu") == "cuda" else 1
    if args.threads < 1:
        raise UsageError(f"--threads: expected >= 1, got {args.threads}")
    if getattr(args, "profile", None):
        os.makedirs(args.profile, exist_ok=True)
    offload_threads = getattr(args, "offload_threads", None)
    if offload_threads is not None and offload_threads < 1:
        raise UsageError(f"--offload-threads: expected >= 1, got {offload_threads}")
    rounds = getattr(args, "rounds", 1)
    if rounds < 1:
        raise UsageError(f"--rounds: expected >= 1, got {rounds}")
    print(f"# {args.model}: {args.nproc} ranks x {args.batch} x {args.seq} tokens, AdamW, "
          f"buckets {args.first_bucket_mb}/{args.bucket_mb} MiB, {args.threads} thread(s) per rank"
          + ("" if offload_threads is None else f", {offload_threads} in the offload runs' CPU step"))
    caps = {run: bucket_caps(run, args) for run in runs}
    if args.first_bucket_mb != args.bucket_mb and len({c for c in caps.values() if c}) > 1:
        # (--first-bucket-mb reaches dp only: each run's comm ms times the buckets it really reduces)
        for run, c in caps.items():
            if c:
                print(f"# buckets of {run}: {c}")
    cuda = getattr(args, "device", "cpu") == "cuda"
    peak = "GPU MiB" if cuda else "peak MiB"  # max allocated / max RSS
    print(f"{'run':>16} {'step ms':>9} {'tokens/s':>10} {'nocomm ms':>10} {'+step ms':>9} {'comm ms':>8} "
          f"{'exposed ms':>10} {'hidden':>7} {'loss':>8} {peak:>9} {'states MiB':>10} {'estimate':>8} "
          f"{'+gathered':>9}")
    done: dict[str, list[dict]] = {run: [] for run in runs}
    for r in range(rounds):
        order = runs if r % 2 == 0 else runs[::-1]
        if rounds > 1:
            print(f"# round {r + 1} of {rounds}", flush=True)
        # later rounds time only: the memory phase's trace and estimate are the first round's
        round_args = args if r == 0 else argparse.Namespace(**{**vars(args), "memory": False, "profile": None})
        for run in order:
            ranks = [x.value for x in run_ranks(_rank_main, args.nproc, args=(run, round_args),
                                                timeout=args.timeout, threads=args.threads,
                                                start="spawn" if cuda else "fork")]
            res = _summarise(run, ranks, round_args)
            done[run].append(res)
            print(_row(run, res), flush=True)
    results = [_over_rounds(done[run], args) for run in runs]
    if rounds > 1:
        print(rounds_table(results))
    if getattr(args, "profile", None):
        print(steptrace.format_profiles(results), flush=True)
    if getattr(args, "memory", False):
        _print_memory(results)
    if getattr(args, "losses", False):
        print(f"\n# loss curves: every step's loss on rank 0's batch (every run from the same start on every rank's "
              f"batch; torch-local at --nproc >= 2: retrained untimed on them all), the largest difference from "
              f"{results[0]['run']}'s and the loss at the last step both took")
        print(loss_curves(results), flush=True)
    if args.json:
        write_json(args.json, results, {"bench": "train", "args": vars(args)})
    if args.plot:
        _plot(args.plot, results)
    return 0
