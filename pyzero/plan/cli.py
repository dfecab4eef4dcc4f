"""pyzero-plan: choose a parallel layout for a model on a cluster, or validate the model.

    pyzero-plan --model gpt2-1.5b --world 8 --gpu-gb 80 --tflops 156
    pyzero-plan --layers 48 --hidden 1600 --heads 25 --vocab 50257 --seq 1024 --batch 512 --world 64
    pyzero-plan --model config.json ...           # an HF-style config
    pyzero-plan validate --nproc 2,4 --json out.json
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

from .spec import PRESETS, ModelSpec, from_config

GB = 1e9


def _spec(args, ap) -> ModelSpec:
    shape = {k: getattr(args, k) for k in ("layers", "hidden", "heads", "vocab")}
    try:
        if args.model in PRESETS:
            spec = ModelSpec(**PRESETS[args.model])
        elif args.model is not None:
            from ..bench.gpt import PRESETS as BENCH  # noqa: PLC0415

            if args.model in BENCH:
                # as to_spec describes the module: what pz.parallelize runs (replicated embedding, SDPA)
                spec = from_config(BENCH[args.model], name=args.model).with_(embedding_tp=False, fused_attention=True)
            else:
                with open(args.model) as f:
                    spec = from_config(json.load(f), name=args.model)
        elif all(v is not None for v in shape.values()):
            spec = ModelSpec(seq=args.seq or 1024, batch=args.batch or 1, **shape)
        else:
            ap.error("--model (a preset, a bench GPT preset or an HF config.json) or all of --layers --hidden "
                     f"--heads --vocab are required; presets: {', '.join(PRESETS)}")
        # (with --model, --layers/--hidden/--heads/--vocab override the model's, as --seq and --batch do)
        changes = {k: v for k, v in (*shape.items(), ("seq", args.seq), ("batch", args.batch)) if v is not None}
        if args.model is not None and any(v is not None for v in shape.values()):
            changes["name"] = spec.name + " with " + ", ".join(f"{k}={v}" for k, v in shape.items() if v is not None)
        return spec.with_(**changes) if changes else spec
    except (OSError, ValueError, TypeError) as e:
        ap.error(f"--model: {e}")


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["validate"]:
        from .validate import main as validate  # noqa: PLC0415

        return validate(argv[1:])
    ap = argparse.ArgumentParser(prog="pyzero-plan", description="Choose dp x tp x pp x ZeRO (micro-batches, "
                                 "sequence parallelism, recomputation, offload) by predicted step time. "
                                 "`pyzero-plan validate --help`: measured vs predicted on local ranks.")
    ap.add_argument("--model", help=f"a preset ({', '.join(PRESETS)}), a pyzero bench GPT preset, or an HF "
                                    "config.json")
    for k in ("layers", "hidden", "heads", "vocab", "seq", "batch"):
        ap.add_argument(f"--{k}", type=int, help="global batch in sequences" if k == "batch" else None)
    ap.add_argument("--world", type=int, required=True, help="devices")
    ap.add_argument("--gpus-per-host", type=int, default=8)
    ap.add_argument("--gpu-gb", type=float, default=80.0, help="memory per device (GB)")
    ap.add_argument("--reserved-gb", type=float, default=0.0, help="device memory the framework takes (GB)")
    ap.add_argument("--tflops", default="156", help="achieved TFLOP/s per device (default 156: half of an A100's "
                                                    "312 bf16), or 'measure': a matmul on this machine's device")
    ap.add_argument("--intra-gbps", type=float, default=230.0, help="intra-host bus bandwidth per device (GB/s)")
    ap.add_argument("--inter-gbps", type=float, default=25.0, help="inter-host bandwidth per device (GB/s)")
    ap.add_argument("--table-intra", help="collectives JSON measured inside a host (overrides --intra-gbps)")
    ap.add_argument("--table-inter", help="collectives JSON measured across hosts (overrides --inter-gbps)")
    ap.add_argument("--overlap", type=float, default=1.0,
                    help="fraction of overlappable communication hidden behind compute: 1 for GPUs (default), "
                         "0 for CPU ranks with a core each")
    ap.add_argument("--ranks-per-core", type=float, default=1.0,
                    help="CPU ranks sharing each core (>= 1; default 1): they take turns, and a pipeline's idle "
                         "stages give their core to the others")
    ap.add_argument("--op-overhead-us", type=float, default=0.0,
                    help="fixed cost of a collective call beyond its transfer, microseconds (default 0; "
                         "`pyzero-plan validate` measures it for CPU ranks)")
    ap.add_argument("--stages", default="0,1,2,3", help="ZeRO stages to consider")
    ap.add_argument("--no-offload", action="store_true")
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--json", help="write the ranked layouts here")
    args = ap.parse_args(argv)
    spec = _spec(args, ap)
    from . import plan  # noqa: PLC0415

    if args.tflops == "measure":
        from .validate import measure_flops  # noqa: PLC0415

        flops = measure_flops()
        print(f"# measured {flops / 1e12:.3g} TFLOP/s on this machine's device")
    else:
        try:
            flops = float(args.tflops) * 1e12
        except ValueError:
            ap.error(f"--tflops: expected a number or 'measure', got {args.tflops!r}")

    for flag, v, low in (("--gpu-gb", args.gpu_gb, ">"), ("--reserved-gb", args.reserved_gb, ">="),
                         ("--tflops", flops, ">"), ("--intra-gbps", args.intra_gbps, ">"),
                         ("--inter-gbps", args.inter_gbps, ">"), ("--op-overhead-us", args.op_overhead_us, ">=")):
        if not math.isfinite(v) or v < 0 or (low == ">" and v == 0):
            shown = args.tflops if flag == "--tflops" else v
            ap.error(f"{flag}: expected a finite number {low} 0, got {shown}")
    for flag, path in (("--table-intra", args.table_intra), ("--table-inter", args.table_inter)):
        if path is not None and not os.path.isfile(path):
            ap.error(f"{flag}: no such file {path!r} (a `pyzero-bench collectives --json` result)")
    try:
        stages = tuple(int(s) for s in args.stages.split(","))
    except ValueError:
        ap.error(f"--stages: expected comma-separated ZeRO stages (0-3), e.g. 0,1,2,3; got {args.stages!r}")
    if args.top < 0:
        ap.error(f"--top: expected an int >= 0 (layouts to show), got {args.top}")
    try:
        p = plan(spec, world=args.world, gpus_per_host=args.gpus_per_host, device_memory=args.gpu_gb * GB,
                 flops=flops, stages=stages, offload=("none",) if args.no_offload else ("none", "cpu"),
                 intra=args.table_intra or args.intra_gbps * GB, inter=args.table_inter or args.inter_gbps * GB,
                 reserved=args.reserved_gb * GB, overlap=args.overlap,
                 ranks_per_core=args.ranks_per_core, op_overhead=args.op_overhead_us * 1e-6)
    except (TypeError, ValueError, OSError) as e:
        ap.error(str(e))
    print(p.table(args.top))
    if args.json:
        rows = [{"layout": e.layout.__dict__, "memory": e.memory, "time": e.time} for e in p.ranked]
        try:
            with open(args.json, "w") as f:
                json.dump({"spec": spec.__dict__, "pruned": dict(p.pruned), "ranked": rows}, f, indent=1)
        except OSError as e:
            ap.error(f"--json: cannot write {args.json!r}: {e.strerror or e}")
    return 0 if p.ranked else 1


if __name__ == "__main__":
    raise SystemExit(main())
