"""pyzero-bench: collectives | train | capacity | tp | pipeline | ps | optim | moments | hier | faults | soak.

Each subcommand lives in pyzero/bench/<name>.py and provides
``add_arguments(parser)`` and ``main(args) -> int``.
"""
from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

from ..checks import is_int
from .common import UsageError

SUBCOMMANDS = {
    "collectives": "nccl-tests style table for all_reduce / reduce_scatter / all_gather / broadcast",
    "train": "training step time, tokens/s and memory: torch DDP vs pyzero",
    "capacity": "the largest GPT one device trains, with and without offload, and its tokens/s",
    "tp": "tensor-parallel all-gather+matmul and matmul+reduce-scatter, overlapped vs not",
    "pipeline": "pipeline utilisation vs micro-batch count for GPipe and 1F1B",
    "ps": "parameter-server training (sync, bounded, async) vs DataParallel, with and without a straggler",
    "optim": "CPU AdamW step throughput: pz.optim vs torch foreach/fused vs DeepSpeed CPUAdam",
    "hier": "several hosts: hierarchical vs flat gloo all_reduce; ZeRO-3 plain vs hpZ / qwZ / qgZ cross-host bytes",
    "faults": "fault-injection matrix: kills, stops, mismatches, damaged checkpoints; hangs and wrong results",
    "moments": "AdamW loss curves with fp32, bf16 and int8 moments against torch.optim.AdamW",
    "soak": "random collectives and fused ops for a bounded time, every result checked; wrong results",
}


# Flags with one meaning in every subcommand that takes them, checked before any runs: counts (their least
# value), and amounts (finite; positive, or also 0).
COUNTS = {"nproc": 1, "iters": 1, "warmup": 0, "steps": 1, "batch": 1, "seq": 1, "rows": 1, "hidden": 1,
          "layers": 1, "mb_size": 1, "branch": 1, "stream_mib": 1, "staleness": 0, "step_elems": 0,
          "transport_iters": 1, "rounds": 1}
POSITIVE = ("timeout", "seconds", "bucket_mb", "first_bucket_mb", "device_gb", "host_gb", "throttle")
NON_NEGATIVE = ("lr", "flush_mib", "sleep_ms", "window", "margin")


def check_shared(args) -> None:
    """A UsageError naming the first shared flag out of its range: COUNTS, POSITIVE, NON_NEGATIVE."""
    for name, least in COUNTS.items():
        values = getattr(args, name, None)
        for v in values if isinstance(values, list) else [values]:
            if is_int(v) and v < least:
                raise UsageError(f"--{name.replace('_', '-')}: expected >= {least}, got {v}")
    for name in POSITIVE + NON_NEGATIVE:
        v = getattr(args, name, None)
        if isinstance(v, float) and not (0 < v < math.inf or (v == 0 and name in NON_NEGATIVE)):
            what = "a positive" if name in POSITIVE else "a non-negative"
            raise UsageError(f"--{name.replace('_', '-')}: expected {what} finite number, got {v}")
    model, seq = getattr(args, "model", None), getattr(args, "seq", None)
    if isinstance(model, str) and isinstance(seq, int):  # (the GPT benches: a longer sequence than the model's
        from .gpt import PRESETS, check_seq  # noqa: PLC0415  position table failed inside the ranks, an IndexError)

        if model in PRESETS:
            check_seq(PRESETS[model], seq, model)
    if getattr(args, "device", None) == "cuda":
        import torch  # noqa: PLC0415

        if not torch.cuda.is_available():  # (the ranks failed one by one, each with its traceback)
            raise UsageError("--device cuda: no CUDA GPU visible to this process")
    for name in ("json", "plot"):  # written at the end: a folder that is not there fails now, not after the run
        path = getattr(args, name, None)
        if isinstance(path, str) and not os.path.isdir(os.path.dirname(os.path.abspath(path))):
            raise UsageError(f"--{name} {path}: no folder {os.path.dirname(os.path.abspath(path))!r} to write it in")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="pyzero-bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    modules, parsers = {}, {}
    for name, help_text in SUBCOMMANDS.items():
        try:
            modules[name] = importlib.import_module(f"pyzero.bench.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"pyzero.bench.{name}":
                raise
            continue
        p = parsers[name] = sub.add_parser(name, help=help_text, description=help_text)
        modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    try:
        check_shared(args)
        return int(modules[args.command].main(args) or 0)
    except UsageError as e:  # a flag's value: exit 2 with the subcommand's usage, as for argparse's own checks
        parsers[args.command].error(str(e))


if __name__ == "__main__":
    sys.exit(main())
