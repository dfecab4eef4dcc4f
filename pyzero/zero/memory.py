"""Model-state memory per rank, from the ZeRO paper (Rajbhandari et al., 2020, section 5).

With Ψ parameters, N ranks and K bytes of optimizer state per parameter
(K = 12 for mixed-precision Adam: fp32 master weights, momentum, variance):

    baseline (DDP)  (2 + 2 + K) Ψ
    stage 1         2Ψ + 2Ψ + KΨ/N
    stage 2         2Ψ + (2 + K)Ψ/N
    stage 3         (2 + 2 + K)Ψ/N

Without mixed precision parameters and gradients take 4 bytes each (and K is
then usually 8 for Adam: momentum and variance only).

Activations: given a model description (``model=``: a pyzero.plan.ModelSpec,
a dict of its fields, an HF-style config or a GPT module) they are computed
per Korthikanti et al. 2022 (per transformer layer sbh(34 + 5as/h) bytes
without tensor parallelism; with TP t: sbh(10 + 24/t + 5as/(ht)), with
sequence parallelism sbh(34/t + 5as/(ht)); selective recomputation drops the
5as/h terms, full recomputation keeps 2sbh per layer) for ``micro_batch``
sequences of ``seq`` tokens, plus the fp32 logits and their gradient
(pyzero/plan/cost.py holds the formulas). A number in ``activation_bytes``
overrides them.

Offload (ZeRO-Offload / ZeRO-Infinity, ``offload="cpu" | "nvme"``, stages 1-3) splits the
same model states over device, host and disk; per rank, with S = Ψ/N the shard size and
w = 2 (mixed precision) or 4 bytes:

    device   parameters wΨ (stage 3: wS; 0 with offload_params) + gradients wΨ in stage 1
             (stage >= 2 copies each reduced bucket to the host as it is produced: none kept)
    host     optimizer state KS + fp32 gradient shard 4S + the parameter shard the step writes
             and uploads wS (mixed precision, where K holds the fp32 master; an fp32 model's
             master is that shard, 4S, held once: 16S with K = 8)
    disk     "nvme": the optimizer state but the fp32 master, (K - 4)S (fp32 runs: KS), which
             leaves the host; the host keeps two sub-groups of it as swap buffers

Without offload everything is on the device. ``total`` is the sum of the model states
wherever they are, plus activations (always on the device), plus stage 0's ``comm_copies``
(pz.DataParallel with a ``comm_dtype`` other than the parameters' keeps every gradient's copy
in it, ``comm_bytes`` x Ψ, from step to step).

``peak`` is the most a rank's device holds at once in a training step, activations included:
parameters + optimizer state + ``comm_copies`` + the largest of three moments:

    backward   activations, plus the gradients in stage 0 (data parallelism keeps its
               gradient buckets, the gradients' storage, from step to step; ZeRO stages 1-3
               and plain torch with zero_grad(set_to_none=True) hold none when backward starts
               and allocate them as activations are freed: the part ``grads_done`` of them
               backward has finished when the activations peak; stage 2 lays them end to end in
               the order backward makes them, so the first rank's shard fills first:
               min(shard, grads_done x all gradients), and then fills the staging buffer of
               its first bucket, ``comm_bytes`` x bucket), plus in stage 3 on more than one rank
               the gathered units (``gathered``: the unit computing and the ``prefetch`` ones
               gathered ahead, each sized by ``largest_layer_params``, at most Ψ)
    end of backward (stages 2 and 3; not on one rank in fp32, which writes the gradients
               straight into their shards): the gradient shard (stage 3: but the last unit's
               part, which lands after its staging buffer), ``staging``: three reductions'
               staging buffers in the reduction's dtype (the one being filled and the two
               in flight; stage 2 a bucket, bucket_mb MiB / 4 elements, each; stage 3 a unit,
               ``largest_layer_params``; at most Ψ elements in all) and, where that dtype is not
               fp32 or with offload, their reduced outputs (stage 2: at most the shard; stage
               3: a unit's shard each), the gradients of the largest layer as autograd made them
               (the hooks copy them in), and in stage 3 the unit being reduced and the
               ``prefetch`` ones gathered before it (what the model has beyond the three units)
    step       gradients + the step's temporaries (``step_impl``: "fused" none; "foreach",
               torch's multi-tensor step, one fp32 value per element it steps; "forloop",
               torch's default on the CPU, two fp32 temporaries of the largest parameter (piece)
               it steps)

``activation_bytes`` and ``grads_done`` are then best measured (pyzero.memtrace.activation_peak:
what forward and backward allocate beyond parameters and gradients at their peak, gradients
already allocated as data parallelism keeps them, and the part of the gradients finished
then; the formula's activations peak at the start of backward, grads_done 0). ``largest_layer_params``
(DeepSpeed's name: the parameters of the largest module) sizes the gathered units, stage 3's
reductions, the last gradients and the "forloop" temporaries; with ``model`` it defaults to
the larger of the embedding and the MLP's first matrix. With offload ``peak`` is what the device
holds: its parameters (none with offload_params) and the same moments, without the optimizer
state, stage 2-3's gradient shards and the step (on the host).
"""
from __future__ import annotations

import argparse
import math
from ..checks import is_int, is_real

GB = 1e9


def _check_number(arg, value, what, ok):
    if not is_real(value):
        raise TypeError(f"{arg}: expected {what}, got {value!r}")
    if not math.isfinite(value) or not ok(value):
        raise ValueError(f"{arg}: expected {what}, got {value!r}")


def estimate_memory(num_params: float | None, world_size: int, stage: int,
                    optimizer_state_bytes_per_param: float = 12, mixed_precision: bool = True,
                    activation_bytes: float | None = None, *, model=None, micro_batch: int = 1,
                    seq: int | None = None, tp: int = 1, sequence_parallel: bool = False,
                    recompute: str = "none", offload: str | None = None, offload_params: bool = False,
                    nvme_sub_group: int = 1 << 23, hpz_partition_size: int = 1,
                    largest_layer_params: float | None = None, step_impl: str = "fused",
                    grads_done: float = 0.0, host_grad_bytes: float = 4.0,
                    grad_bytes: float | None = None, comm_bytes: float | None = None,
                    bucket_mb: float = 25, prefetch: int = 1) -> dict:
    """Bytes per rank of parameters, gradients, optimizer state and activations.

    stage 0 means plain data parallel (nothing sharded). ``world_size`` is the
    number of data-parallel ranks. With ``model`` (see the module docstring),
    ``num_params`` must be None when ``tp`` > 1 (the parameters one of the ``tp``
    tensor-parallel ranks holds are computed; a count given would be taken as one rank's)
    and activations are computed for ``micro_batch`` x ``seq`` tokens with ``tp``,
    ``sequence_parallel`` and ``recompute``, unless ``activation_bytes`` is given; without
    ``model`` those five shape nothing (giving them is a ValueError) and activations are
    ``activation_bytes``, else 0.
    ``offload`` / ``offload_params`` (see the module docstring) add where the bytes live:
    ``device``, ``host`` and ``disk``; ``nvme_sub_group`` is the swap sub-group in elements;
    ``host_grad_bytes`` the bytes per element of the host gradient shard (4: fp32; 2 where the
    offload pipeline keeps it in the model's 16-bit dtype, see docs/offload.md).
    ``grad_bytes`` the bytes per element of the gradient shards stages 2 and 3 keep on the
    device: None (the default) takes the parameters' width, as the ZeRO paper; a
    ``pz.ZeroOptimizer`` keeps them in fp32 (4) whatever its ``comm_dtype`` and parameter dtype
    (``comm_dtype`` is only the reduction's wire dtype: ``comm_bytes``). Stages 0 and 1 keep full
    gradients in the parameters' dtype, and refuse it.
    ``comm_bytes`` the bytes per element of the gradient reduction's dtype (``comm_dtype``):
    stages 2 and 3 stage their reductions in it (None: 4, ZeroOptimizer's fp32 default);
    stage 0 (pz.DataParallel) with a ``comm_dtype`` other than the parameters' keeps a copy of
    every gradient in it from step to step (``comm_copies``); stage 1 reduces in the
    parameters' dtype and refuses another. ``bucket_mb`` (stage 2, ZeroOptimizer's bucket_mb, 25
    by default) sizes its reduction buckets; ``prefetch`` (stage 3, 1 by default) the units
    gathered ahead of the one computing.
    ``hpz_partition_size`` P > 1 (stage 3, ZeRO++ hpZ) adds the secondary parameter shards,
    width x Ψ/P, under "hpz_secondary" (also counted in "params").
    ``largest_layer_params``, ``step_impl`` ("fused", "foreach" or "forloop") and
    ``grads_done`` (0 to 1) shape ``peak`` (see the module docstring), whose parts are also
    given: ``gathered`` (stage 3's gathered units at the activations' peak), ``staging`` (stages
    2 and 3: the reductions' staging buffers at the end of backward) and ``step_temps``.
    """
    _check_layout(micro_batch, seq, tp, sequence_parallel, recompute)  # (checked with or without model=)
    if model is not None:
        if num_params is not None and tp > 1:
            raise ValueError(f"num_params: with model= and tp={tp} leave it None (the parameters one tensor-parallel "
                             f"rank holds are computed from the model), got {num_params!r}")
        num_params, activation_bytes, largest = _from_model(model, num_params, activation_bytes, micro_batch, seq,
                                                            tp, sequence_parallel, recompute, mixed_precision)
        if largest_layer_params is None:
            largest_layer_params = largest
    else:
        given = [arg for arg, v, default in (("micro_batch", micro_batch, 1), ("seq", seq, None), ("tp", tp, 1),
                                             ("sequence_parallel", sequence_parallel, False),
                                             ("recompute", recompute, "none")) if v != default]
        if given:
            raise ValueError(f"{', '.join(given)}: shape the activations computed from model=; without model= "
                             "they change nothing (give activation_bytes=, and num_params per tensor-parallel rank)")
        if activation_bytes is None:
            activation_bytes = 0
    _check_number("num_params", num_params, "a positive, finite count", lambda v: v > 0)
    if not is_int(world_size):
        raise TypeError(f"world_size: expected an int >= 1, got {world_size!r}")
    if world_size < 1:
        raise ValueError(f"world_size: expected an int >= 1, got {world_size!r}")
    if not is_int(stage) or stage not in (0, 1, 2, 3):
        raise ValueError(f"stage: expected 0 (no sharding), 1, 2 or 3, got {stage!r}")
    _check_number("optimizer_state_bytes_per_param", optimizer_state_bytes_per_param, "a finite number >= 0",
                  lambda v: v >= 0)
    _check_number("activation_bytes", activation_bytes, "a finite number >= 0", lambda v: v >= 0)
    if not isinstance(mixed_precision, bool):
        raise TypeError(f"mixed_precision: expected True or False, got {mixed_precision!r}")
    if not is_int(hpz_partition_size) or hpz_partition_size < 1:
        raise ValueError(f"hpz_partition_size: expected a positive int (1: no hpZ), got {hpz_partition_size!r}")
    if hpz_partition_size > 1 and stage != 3:
        raise ValueError(f"hpz_partition_size: hpZ is for stage 3, got stage={stage}")
    if hpz_partition_size > 1 and world_size % hpz_partition_size:
        raise ValueError(f"hpz_partition_size: expected a divisor of world_size={world_size} (ranks per host), "
                         f"got {hpz_partition_size}")
    if largest_layer_params is not None:
        _check_number("largest_layer_params", largest_layer_params, "a finite count >= 0", lambda v: v >= 0)
    _check_number("grads_done", grads_done, "a fraction from 0 to 1", lambda v: 0 <= v <= 1)
    _check_number("host_grad_bytes", host_grad_bytes, "2 or 4 (bytes of a host gradient element)",
                  lambda v: v in (2, 4))
    if host_grad_bytes == 2 and not mixed_precision:
        raise ValueError("host_grad_bytes: 2 (16-bit host gradients) needs mixed_precision=True; an fp32 model's "
                         "host gradients are fp32 (4)")
    width = 2 if mixed_precision else 4
    if grad_bytes is not None:
        _check_number("grad_bytes", grad_bytes, "2 or 4 (bytes of a gradient shard element)", lambda v: v in (2, 4))
        if stage < 2:
            raise ValueError(f"grad_bytes: sets the gradient shards of stages 2 and 3; stage {stage} keeps full "
                             "gradients in the parameters' dtype")
    if comm_bytes is not None:
        _check_number("comm_bytes", comm_bytes, "2 or 4 (bytes of an element of the reduction's dtype)",
                      lambda v: v in (2, 4))
        if stage == 1 and comm_bytes != width:
            raise ValueError(f"comm_bytes: stage 1 reduces the gradients in the parameters' dtype ({width} bytes), "
                             f"got {comm_bytes}")
    _check_number("bucket_mb", bucket_mb, "a positive number of MiB", lambda v: v > 0)
    if not is_int(prefetch) or prefetch < 0:
        raise ValueError(f"prefetch: expected an int >= 0 (stage 3's units gathered ahead), got {prefetch!r}")
    if step_impl not in ("fused", "foreach", "forloop"):
        raise ValueError(f"step_impl: expected 'fused', 'foreach' or 'forloop', got {step_impl!r}")
    psi, n, k = float(num_params), world_size, float(optimizer_state_bytes_per_param)
    params = width * psi / (n if stage >= 3 else 1)
    gb = width if grad_bytes is None else grad_bytes  # bytes of a gradient (shard) element
    cb = comm_bytes if comm_bytes is not None else (4 if stage >= 2 else width)  # the reduction's dtype
    grads = gb * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    out = {"params": params, "grads": grads, "optimizer": optimizer}
    if hpz_partition_size > 1:
        out["hpz_secondary"] = width * psi / hpz_partition_size
        out["params"] = params = params + out["hpz_secondary"]
    out["activations"] = float(activation_bytes)
    out["comm_copies"] = cb * psi if stage == 0 and cb != width else 0.0
    out["total"] = params + grads + optimizer + out["activations"] + out["comm_copies"]
    if stage == 0:
        held_grads = grads
    elif stage == 2:
        held_grads = min(grads, grads_done * gb * psi)  # (elements of the shard, in its dtype)
    else:
        held_grads = grads_done * grads
    largest = min(float(largest_layer_params or 0.0), psi)
    stepped = psi / (n if stage >= 1 else 1)  # elements the optimizer steps on this rank
    out["step_temps"] = {"fused": 0.0, "foreach": 4 * stepped, "forloop": 2 * 4 * min(largest, stepped)}[step_impl]
    moments = _moments(out, psi, n, stage, width, gb, cb, largest, held_grads, float(grads_done), bucket_mb,
                       prefetch, offload, offload_params)
    out["peak"] = params + optimizer + out["comm_copies"] + max(moments)
    out.update(_placement(out, psi, n, stage, k, width, mixed_precision, offload, offload_params, nvme_sub_group,
                          float(host_grad_bytes), moments))
    return out


def _moments(m, psi, n, stage, width, gb, cb, largest, held_grads, done, bucket_mb, prefetch, offload,
             offload_params) -> tuple:
    """What a rank's device holds beyond its parameters, optimizer state and DataParallel's
    communication copies at the activations' peak, at the end of backward (stages 2 and 3) and at
    the step (see the module docstring); sets m["gathered"] and m["staging"]. With offload the
    device holds no optimizer state, and in stages 2 and 3 no gradient shard (see device_states)."""
    shards_on_device = offload is None
    if not shards_on_device and stage >= 2:
        held_grads = 0.0  # (reduced buckets go to the host shard)
    # Stages 2-3 reduce through staging buffers in the reduction's dtype, except on one rank in fp32,
    # where the gradients go straight into their shards ([Note: one rank writes gradients straight ...]).
    staged = stage >= 2 and (n > 1 or cb != 4 or offload is not None)
    unit = min(bucket_mb * (1 << 20) / 4, psi) if stage == 2 else largest  # elements of one reduction
    reduced = min(3 * unit, psi)  # the one being staged and the two in flight
    out_bufs = (min(reduced, psi / n) if stage == 2 else reduced / n) if cb != 4 or offload is not None else 0.0
    m["staging"] = cb * (reduced + out_bufs) if staged else 0.0
    gathered = stage == 3 and n > 1
    m["gathered"] = width * min((1 + prefetch) * largest, psi) if gathered else 0.0
    first_bucket = cb * unit if stage == 2 and staged and done > 0 else 0.0  # the bucket backward fills
    backward = held_grads + m["activations"] + m["gathered"] + first_bucket
    if stage < 2:  # (with offload the step runs on the host: no temporaries on the device)
        return backward, m["grads"] + (m["step_temps"] if shards_on_device else 0.0)
    # end of backward: the last reduction's staging buffer with two in flight, the gradients autograd
    # just made (the hooks copy them), stage 3's unit and the ones prefetched before it
    shard = m["grads"] if shards_on_device else 0.0
    if stage == 3:
        shard = max(0.0, shard - gb * largest / n)  # (the last unit's part lands after its staging)
        end_gathered = width * (largest + min(prefetch * largest, psi - reduced)) if gathered else 0.0
    else:
        end_gathered = 0.0
    end = shard + m["staging"] + width * largest + end_gathered
    step = m["grads"] + m["step_temps"] if shards_on_device else 0.0
    return backward, end, step


def device_states(m: dict, stage: int, offload: str | None, offload_params: bool = False) -> dict:
    """The model states of estimate_memory's result `m` that the device holds: params, grads and
    optimizer, all of them without offload (see the module docstring)."""
    if offload is None:
        return {"params": m["params"], "grads": m["grads"], "optimizer": m["optimizer"]}
    # stage >= 2 sends each reduced bucket to the host as backward produces it: no gradient
    # shard stays on the device (the buckets in flight are transient, like activations)
    return {"params": 0.0 if offload_params else m["params"], "grads": m["grads"] if stage == 1 else 0.0,
            "optimizer": 0.0}


def _placement(m, psi, n, stage, k, width, mixed, offload, offload_params, sub_group, grad_bytes, moments) -> dict:
    """device/host/disk bytes per rank (see the module docstring)."""
    if offload not in (None, "cpu", "nvme"):
        raise ValueError(f"offload: expected None, 'cpu' or 'nvme', got {offload!r}")
    if not isinstance(offload_params, bool):
        raise TypeError(f"offload_params: expected True or False, got {offload_params!r}")
    if offload is not None and stage == 0:
        raise ValueError("offload: needs a ZeRO stage (1, 2 or 3), got stage=0")
    if offload_params and (offload is None or stage != 3):
        raise ValueError("offload_params: needs stage=3 and offload='cpu' or 'nvme'")
    nvme_sub_group = sub_group
    _check_number("nvme_sub_group", nvme_sub_group, "a positive count", lambda v: v >= 1)
    if offload is None:
        return {"device": m["total"], "host": 0.0, "disk": 0.0, "peak": m["peak"]}
    shard = psi / n
    device = sum(device_states(m, stage, offload, offload_params).values()) + m["activations"]
    # mixed precision: K holds the fp32 master, and the host keeps the w-byte shard the step writes;
    # an fp32 model's master is that shard (4 bytes), held once
    host = k * shard + grad_bytes * shard + width * shard
    disk = 0.0
    if offload == "nvme":
        disk = (k - 4 if mixed else k) * shard
        buffers = 2 * min(nvme_sub_group, shard) * (disk / shard if shard else 0)
        host = host - disk + buffers
    peak = (0.0 if offload_params else m["params"]) + max(moments)
    return {"device": device, "host": host, "disk": disk, "peak": peak}


def _check_layout(micro_batch, seq, tp, sp, recompute) -> None:
    for arg, v in (("micro_batch", micro_batch), ("tp", tp)) + ((("seq", seq),) if seq is not None else ()):
        if not is_int(v) or v < 1:
            raise ValueError(f"{arg}: expected a positive int, got {v!r}")
    if sp and tp == 1:
        raise ValueError("sequence_parallel: needs tp > 1 (it splits the sequence over the tensor-parallel ranks)")
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"recompute: expected 'none', 'selective' or 'full', got {recompute!r}")


def _from_model(model, num_params, activation_bytes, micro_batch, seq, tp, sp, recompute, mixed_precision):
    from ..plan.activations import Layout, activation_memory, stage_params  # noqa: PLC0415
    from ..plan.spec import to_spec  # noqa: PLC0415

    spec = to_spec(model, seq=seq)
    if spec.heads % tp:
        raise ValueError(f"tp: heads={spec.heads} is not divisible by tp={tp}")
    if num_params is None:
        num_params = stage_params(spec, tp, 1)
    if activation_bytes is None:
        lay = Layout(tp=tp, micro_batch=micro_batch, sp=bool(sp), recompute=recompute)
        activation_bytes = activation_memory(spec, lay, 2 if mixed_precision is True else 4)
    embedding = spec.embedding_params / (tp if spec.embedding_tp else 1)
    largest = max(embedding, spec.ffn * spec.hidden * spec.hidden / tp)
    return num_params, activation_bytes, largest


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pyzero-estimate",
                                 description="Model-state memory per rank for DDP and ZeRO stages 1-3")
    ap.add_argument("--params", type=float, required=True, help="number of parameters, e.g. 1.5e9")
    ap.add_argument("--world", type=int, required=True, help="data-parallel ranks")
    ap.add_argument("--k", type=float, default=12, help="optimizer state bytes per parameter (12: mixed-precision Adam)")
    ap.add_argument("--fp32", action="store_true", help="parameters and gradients in fp32 (4 bytes each)")
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="memory per GPU, to say which stage fits")
    ap.add_argument("--offload", choices=("none", "cpu", "nvme"), default="none",
                    help="optimizer state (and fp32 master) on the host, or on disk: adds host and disk columns")
    ap.add_argument("--offload-params", action="store_true", help="ZeRO-3 parameter shards on the host too")
    ap.add_argument("--host-grad-bytes", type=int, choices=(2, 4), default=4,
                    help="bytes per element of the host gradient shard with --offload: 4 (fp32), or 2 where the "
                         "offload pipeline keeps 16-bit gradients (one rank, stage 1, or comm_dtype equal to "
                         "the model dtype)")
    ap.add_argument("--grad-bytes", type=int, choices=(2, 4), default=None,
                    help="bytes per element of ZeRO-2/3's gradient shards (default: the parameters' width, as the "
                         "ZeRO paper); a pz.ZeroOptimizer keeps them in fp32 (4) whatever its comm_dtype (the "
                         "reduction's wire dtype)")
    args = ap.parse_args(argv)
    if not (math.isfinite(args.gpu_gb) and args.gpu_gb > 0):
        ap.error(f"--gpu-gb: expected a positive number of GB, got {args.gpu_gb!r}")
    if args.offload != "none" and args.grad_bytes is not None:
        ap.error("--grad-bytes: sets ZeRO-2/3's gradient shards on the device; with --offload they are on the host "
                 "(--host-grad-bytes)")
    if args.offload == "none":
        for flag, given in (("--offload-params", args.offload_params),
                            ("--host-grad-bytes", args.host_grad_bytes != 4)):
            if given:
                ap.error(f"{flag}: needs --offload cpu or nvme")
    try:
        estimate_memory(args.params, args.world, 0, args.k, not args.fp32)
        if args.offload != "none":
            estimate_memory(args.params, args.world, 3, args.k, not args.fp32, offload=args.offload,
                            offload_params=args.offload_params, host_grad_bytes=args.host_grad_bytes)
    except (TypeError, ValueError) as e:
        ap.error(str(e))
    if args.offload != "none":
        return _print_offload(args)
    print(f"# model states per rank: {args.params:.4g} parameters, {args.world} ranks, K={args.k:g}, "
          f"{'fp32' if args.fp32 else 'mixed precision'}")
    print(f"{'stage':>10} {'params GB':>11} {'grads GB':>10} {'optim GB':>10} {'total GB':>10}  fits {args.gpu_gb:g} GB")
    for stage, label in ((0, "DDP"), (1, "ZeRO-1"), (2, "ZeRO-2"), (3, "ZeRO-3")):
        m = estimate_memory(args.params, args.world, stage, args.k, not args.fp32,
                            grad_bytes=args.grad_bytes if stage >= 2 else None)
        fits = "yes" if m["total"] <= args.gpu_gb * GB else "no"
        print(f"{label:>10} {m['params'] / GB:>11.2f} {m['grads'] / GB:>10.2f} {m['optimizer'] / GB:>10.2f} "
              f"{m['total'] / GB:>10.2f}  {fits}")
    return 0


def _print_offload(args) -> int:
    print(f"# model states per rank: {args.params:.4g} parameters, {args.world} ranks, K={args.k:g}, "
          f"{'fp32' if args.fp32 else 'mixed precision'}, offload={args.offload}"
          f"{' + params' if args.offload_params else ''}, host gradients {args.host_grad_bytes} B")
    print(f"{'stage':>10} {'device GB':>10} {'host GB':>9} {'disk GB':>9}  fits {args.gpu_gb:g} GB")
    for stage in (1, 2, 3):
        m = estimate_memory(args.params, args.world, stage, args.k, not args.fp32, offload=args.offload,
                            offload_params=args.offload_params and stage == 3, host_grad_bytes=args.host_grad_bytes)
        fits = "yes" if m["device"] <= args.gpu_gb * GB else "no"
        print(f"{'ZeRO-' + str(stage):>10} {m['device'] / GB:>10.2f} {m['host'] / GB:>9.2f} {m['disk'] / GB:>9.2f}"
              f"  {fits}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
