"""GPU reduce-kernel bandwidth: pyzero's out = a (+) b next to torch's device-to-device copy.

Bytes moved are counted explicitly: the reduce reads two buffers and writes
one (3 x size); the copy reads one and writes one (2 x size). The issue's bar
is reduce bandwidth >= 90% of copy bandwidth at >= 64 MiB for every dtype.
A second table covers the kernels of the nccl backend's ring and one-shot:
pyzero's copy (2 x size), reduce_wire_final (reads a wire-typed partial and
the input, writes the input type) and reduce_many of 8 sources (9 x size).
Run on a GPU machine: ``python -m pyzero.bench.kernels`` (scripts/gpu_check.sh does).
"""
from __future__ import annotations

import argparse

import torch

from .. import _C
from ..backend import DTYPES, OPS as BACKEND_OPS
from .common import UsageError, number_list, write_json

OPS = {op: BACKEND_OPS[op] for op in ("sum", "max")}


def _time_ms(fn, iters):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def ring_kernels(args, stream) -> list:
    """GB/s of the copy, wire-final reduce and 8-source reduce kernels, sum, per dtype and size."""
    results = []
    print(f"#{'dtype':>9} {'kernel':>18} {'size MiB':>9} {'GB/s':>8} {'copy GB/s':>10} {'ratio':>6}")
    for name, dt in ((str(d).replace("torch.", ""), d) for d in DTYPES):
        wire = torch.float32 if dt in (torch.float16, torch.bfloat16) else dt
        code = DTYPES[dt]
        for mb in args.sizes:
            n = (mb << 20) // torch.empty(0, dtype=dt).element_size()
            a, out = torch.ones(n, dtype=dt, device="cuda"), torch.empty(n, dtype=dt, device="cuda")
            partial = torch.ones(n, dtype=wire, device="cuda")
            srcs = [torch.ones(n, dtype=dt, device="cuda") for _ in range(8)]
            ptrs = [x.data_ptr() for x in srcs]
            wire_bytes = n * partial.element_size()
            kernels = {
                "copy": (lambda: _C.cuda_copy(a.data_ptr(), out.data_ptr(), n, code, stream), 2 * (mb << 20)),
                "reduce_wire_final": (lambda: _C.cuda_reduce_wire_final(partial.data_ptr(), a.data_ptr(),
                                                                        out.data_ptr(), n, code, 0, 2, stream),
                                      wire_bytes + 2 * (mb << 20)),
                "reduce_many(8)": (lambda: _C.cuda_reduce_many(ptrs, out.data_ptr(), n, code, 0, 8, stream),
                                   9 * (mb << 20)),
            }
            ms_cpy = _time_ms(lambda: out.copy_(a), args.iters)
            cpy = 2 * (mb << 20) / ms_cpy / 1e6
            for kname, (fn, nbytes) in kernels.items():
                gbps = nbytes / _time_ms(fn, args.iters) / 1e6
                results.append({"dtype": name, "kernel": kname, "bytes": mb << 20, "gbps": gbps, "copy_gbps": cpy,
                                "ratio": gbps / cpy})
                print(f" {name:>9} {kname:>18} {mb:>9} {gbps:>8.1f} {cpy:>10.1f} {gbps / cpy:>6.2f}")
            del srcs, ptrs
    return results


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m pyzero.bench.kernels", description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mb", default="64,256")
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:  # before the GPU check: a bad value is the same mistake on any machine
        args.sizes = number_list(args.sizes_mb, "--sizes-mb")
        if args.iters < 1:
            raise UsageError(f"--iters: expected >= 1, got {args.iters}")
    except UsageError as e:
        ap.error(str(e))
    if not torch.cuda.is_available() or not hasattr(_C, "cuda_reduce2"):
        raise SystemExit("needs a CUDA GPU and pyzero built with CUDA")
    stream = torch.cuda.current_stream().cuda_stream
    results = []
    print(f"# {torch.cuda.get_device_name(0)}: reduce (3 x size bytes) vs copy (2 x size bytes)")
    print(f"#{'dtype':>9} {'op':>4} {'size MiB':>9} {'reduce GB/s':>12} {'copy GB/s':>10} {'ratio':>6}")
    for name, dt in ((str(d).replace("torch.", ""), d) for d in DTYPES):
        for op, opc in OPS.items():
            for mb in args.sizes:
                n = (mb << 20) // torch.empty(0, dtype=dt).element_size()
                a = torch.ones(n, dtype=dt, device="cuda")
                b, out = torch.ones_like(a), torch.empty_like(a)
                ms_red = _time_ms(lambda: _C.cuda_reduce2(a.data_ptr(), b.data_ptr(), out.data_ptr(), n,
                                                          DTYPES[dt], opc, 1, stream), args.iters)
                ms_cpy = _time_ms(lambda: out.copy_(a), args.iters)
                red, cpy = 3 * (mb << 20) / ms_red / 1e6, 2 * (mb << 20) / ms_cpy / 1e6
                results.append({"dtype": name, "op": op, "bytes": mb << 20, "reduce_gbps": red, "copy_gbps": cpy,
                                "ratio": red / cpy})
                print(f" {name:>9} {op:>4} {mb:>9} {red:>12.1f} {cpy:>10.1f} {red / cpy:>6.2f}")
    results += ring_kernels(args, stream)
    if args.json:
        write_json(args.json, results, {"bench": "kernels", "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
