"""Several hosts: hierarchical all_reduce vs flat gloo, and ZeRO-3 with and without ZeRO++.

Ranks are simulated hosts (--hosts x --per-host, PYZERO_HOST set in each rank). By default
the hosts share the loopback device; with --throttle MBIT (root, iproute2) each host gets its
own network namespace, the two joined by a veth pair whose both ends are rate-limited by tc
(token bucket, MBIT Mbit/s), so traffic between hosts crosses a real, slow link while each
host's ranks still share memory. The namespaces are removed afterwards.

Part 1 (nccl-tests style): all_reduce of fp32 at sizes --min..--max, pyzero's hierarchical
path (shm inside hosts, gloo between) against one flat torch.distributed gloo all_reduce over
all ranks; the two results are compared on every rank (#wrong: elements that differ, summed over the
ranks; the bench exits 1 when any does).
Part 2: ZeRO stage 3 on a GPT (--model) for --steps steps on learnable token data, for each
configuration: plain, hpZ, qwZ, qgZ and all three (plain first, wherever --configs names it: the "vs plain"
columns' baseline; without it those columns are "-"). Reported: bytes this rank sent across
hosts per step (comm_stats "inter_host", the rank with the most), median step time, and the
loss on a held-out batch after the last step.
"""
from __future__ import annotations

import ctypes
import os
import statistics
import subprocess
import time

import torch

from .common import UsageError, init_torch_distributed, interleaved_medians, parse_size, size_steps, write_json
from .gpt import PRESETS, make_gpt
from .ps import structured_batch

CONFIGS = {
    "plain": {},
    "hpz": dict(zero_hpz_partition_size=None),  # None: ranks per host
    "qwz": dict(zero_quantized_weights=True),
    "qgz": dict(zero_quantized_gradients=True),
    "all": dict(zero_hpz_partition_size=None, zero_quantized_weights=True, zero_quantized_gradients=True),
}
NETNS = "pzbench-h"  # default name prefix of the namespaces: host h's is prefix + str(h)
SUBNET = "10.77.0."  # host h has SUBNET + str(h + 1), on its end of the veth pair "pzv<h>"
_CLONE_NEWNET = 0x40000000


def add_arguments(p) -> None:
    p.add_argument("--hosts", type=int, default=2)
    p.add_argument("--per-host", type=int, default=2)
    p.add_argument("--min", default="64K", help="smallest all_reduce, bytes (K/M suffix)")
    p.add_argument("--max", default="16M", help="largest all_reduce, bytes")
    p.add_argument("--factor", type=float, default=4.0)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--model", default="gpt-tiny", help=f"one of {list(PRESETS)}")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank and step")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"comma list of {list(CONFIGS)}")
    p.add_argument("--parts", default="collectives,zero", help="comma list of collectives, zero")
    p.add_argument("--throttle", type=float, default=None,
                   help="Mbit/s of a tc-limited veth link between two network namespaces (root, 2 hosts)")
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--json", default=None)


# ---------------------------------------------------------------------------
# The throttled link


def _sh(*cmd: str) -> None:
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode:
        raise SystemExit(f"--throttle: `{' '.join(cmd)}` failed: {r.stderr.strip()} "
                         "(needs root and iproute2; run without --throttle to use loopback)")


def setup_link(hosts: int, mbit: float, prefix: str = NETNS) -> None:
    """Two namespaces joined by a veth pair, each end limited to `mbit` Mbit/s (SystemExit saying why
    where it cannot be made)."""
    if hosts != 2:
        raise SystemExit(f"--throttle: expected --hosts 2 (one veth pair), got {hosts}")
    teardown_link(hosts, prefix)
    for h in range(2):
        _sh("ip", "netns", "add", f"{prefix}{h}")
    _sh("ip", "link", "add", "pzv0", "netns", f"{prefix}0", "type", "veth", "peer", "name", "pzv1", "netns",
        f"{prefix}1")
    burst_kb = max(32, int(mbit * 0.5))  # ~4 ms of traffic at the rate (Mbit/s x 1e6 / 8 x 0.004 B), >= 32 KB
    for h in range(2):
        ns = ("ip", "netns", "exec", f"{prefix}{h}")
        _sh(*ns, "ip", "addr", "add", f"{SUBNET}{h + 1}/24", "dev", f"pzv{h}")
        _sh(*ns, "ip", "link", "set", f"pzv{h}", "up")
        _sh(*ns, "ip", "link", "set", "lo", "up")
        _sh(*ns, "tc", "qdisc", "add", "dev", f"pzv{h}", "root", "tbf", "rate", f"{mbit}mbit", "burst",
            f"{burst_kb}kb", "latency", "100ms")


def teardown_link(hosts: int, prefix: str = NETNS) -> None:
    for h in range(hosts):
        subprocess.run(["ip", "netns", "del", f"{prefix}{h}"], capture_output=True)


def enter_host(per_host: int, netns_prefix: str | None = None) -> int:
    """Make this rank (before pz.init) a process of host RANK // per_host: PYZERO_HOST and, given
    the prefix of setup_link's namespaces, that host's network namespace. Returns the host."""
    h = int(os.environ["RANK"]) // per_host
    os.environ["PYZERO_HOST"] = f"host{h}"
    os.environ["LOCAL_WORLD_SIZE"] = str(per_host)
    os.environ["LOCAL_RANK"] = str(int(os.environ["RANK"]) % per_host)
    if netns_prefix is not None:
        fd = os.open(f"/var/run/netns/{netns_prefix}{h}", os.O_RDONLY)
        try:
            if ctypes.CDLL(None, use_errno=True).setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {netns_prefix}{h} failed")
        finally:
            os.close(fd)
        os.environ["GLOO_SOCKET_IFNAME"] = f"pzv{h}"
    return h


def _enter_host(args) -> int:
    return enter_host(args.per_host, NETNS if args.throttle else None)


# ---------------------------------------------------------------------------
# Part 1: all_reduce


def _collectives_rank(args) -> list[dict]:
    import pyzero as pz  # noqa: PLC0415

    _enter_host(args)
    pz.init(backend="hier", timeout=args.timeout)
    dist = init_torch_distributed("gloo", args.timeout)
    n, out = pz.get_world_size(), []
    for nbytes in size_steps(parse_size(args.min), parse_size(args.max), args.factor):
        count = nbytes // 4
        base = torch.randn(count, generator=torch.Generator().manual_seed(pz.get_rank()))
        a, b = base.clone(), base.clone()
        pz.all_reduce(a)
        dist.all_reduce(b)
        wrong = int((~torch.isclose(a, b, rtol=1e-5, atol=1e-5)).sum())
        bufs = [base.clone(), base.clone()]
        t_hier, t_gloo = interleaved_medians([lambda: pz.all_reduce(bufs[0]), lambda: dist.all_reduce(bufs[1])],
                                             args.iters, args.warmup)
        bus = 2 * (n - 1) / n * nbytes / 1e9
        out.append({"bytes": count * 4, "count": count, "hier_s": t_hier, "gloo_s": t_gloo, "hier_busbw": bus / t_hier,
                    "gloo_busbw": bus / t_gloo, "wrong": wrong})
    dist.destroy_process_group()
    return out


# ---------------------------------------------------------------------------
# Part 2: ZeRO-3 with ZeRO++ options


def _zero_rank(name, args) -> dict:
    import pyzero as pz  # noqa: PLC0415

    _enter_host(args)
    pz.init(backend="hier", timeout=args.timeout)
    rank = pz.get_rank()
    kw = {k: (args.per_host if v is None else v) for k, v in CONFIGS[name].items()}
    model = make_gpt(args.model)
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=args.lr, **kw)
    times = []
    pz.comm_stats(reset=True)
    for step in range(args.steps):
        x, y = structured_batch(PRESETS[args.model], args.batch, args.seq, seed=step * 1000 + rank)
        pz.barrier()
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x, y).backward()
        opt.step()
        times.append(time.perf_counter() - t0)
    stats = pz.comm_stats()
    inter = stats.get("inter_host", {}).get("sent_bytes", 0)  # the per-step barriers add none
    x, y = structured_batch(PRESETS[args.model], 16, args.seq, seed=10**7)
    with torch.no_grad():
        loss = float(model(x, y))
    return {"inter_bytes_per_step": inter / args.steps, "step_s": statistics.median(times), "loss": loss}


def merge_collective_rows(per_rank: list[list[dict]]) -> list[dict]:
    """Part 1's rows from every rank's: the times as rank 0 has them (already the slowest rank's), #wrong
    the sum of every rank's count (each rank compares its own result)."""
    return [dict(rows[0], wrong=sum(r["wrong"] for r in rows)) for rows in zip(*per_rank)]


def zero_order(configs: list[str]) -> list[str]:
    """Part 2's configs in the order they run: "plain" (the baseline of the "vs plain" columns) first,
    wherever --configs names it, then the others as given."""
    return sorted(configs, key=lambda c: c != "plain")


def zero_row(res: dict, base: dict | None) -> str:
    """A line of part 2's table; the "vs plain" columns against `base` (the plain run; "-" without one)."""
    if base is None:
        vs_bytes, vs_loss = f"{'-':>8}", f"{'-':>8}"
    else:
        vs_bytes = f"{base['inter_bytes_per_step'] / max(res['inter_bytes_per_step'], 1):>7.2f}x"
        vs_loss = f"{res['loss'] / base['loss'] - 1:>+8.2%}"
    return (f"{res['config']:>8} {res['inter_bytes_per_step']:>18.0f} {vs_bytes} {res['step_s'] * 1e3:>8.1f} "
            f"{res['loss']:>8.4f} {vs_loss}")


def main(args) -> int:
    from ..launch import run_ranks  # noqa: PLC0415

    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    if not parts or any(p not in ("collectives", "zero") for p in parts):
        raise UsageError(f"--parts: expected a comma list of collectives, zero; got {args.parts!r}")
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in CONFIGS for c in configs):
        raise UsageError(f"--configs: expected a comma list of {list(CONFIGS)}, got {args.configs!r}")
    if args.hosts < 2:
        raise UsageError(f"--hosts: expected >= 2, got {args.hosts}")
    if args.per_host < 1:
        raise UsageError(f"--per-host: expected >= 1, got {args.per_host}")
    if args.throttle and args.hosts != 2:
        raise UsageError(f"--throttle: expected --hosts 2 (one veth pair), got {args.hosts}")
    if args.model not in PRESETS:
        raise UsageError(f"--model: expected one of {list(PRESETS)}, got {args.model!r}")
    size_steps(parse_size(args.min, "--min"), parse_size(args.max, "--max"), args.factor)  # (read by the ranks)
    world = args.hosts * args.per_host
    env = None
    link = f"veth limited to {args.throttle:g} Mbit/s" if args.throttle else "loopback"
    if args.throttle:
        setup_link(args.hosts, args.throttle)
        env = {"MASTER_ADDR": f"{SUBNET}1"}
    results, wrong = [], 0
    try:
        print(f"# {args.hosts} hosts x {args.per_host} ranks, link between hosts: {link}")
        if "collectives" in parts:
            rows = merge_collective_rows([r.value for r in run_ranks(_collectives_rank, world, args=(args,),
                                                                     env=env, timeout=args.timeout)])
            print(f"{'size':>10} {'count':>10} {'hier us':>10} {'busbw':>7} {'gloo us':>10} {'busbw':>7} "
                  f"{'speedup':>7} {'#wrong':>6}")
            for r in rows:
                print(f"{r['bytes']:>10} {r['count']:>10} {r['hier_s'] * 1e6:>10.1f} {r['hier_busbw']:>7.3f} "
                      f"{r['gloo_s'] * 1e6:>10.1f} {r['gloo_busbw']:>7.3f} {r['gloo_s'] / r['hier_s']:>7.2f} "
                      f"{r['wrong']:>6}")
                results.append(dict(r, part="all_reduce"))
            wrong = sum(r["wrong"] for r in rows)
            print(f"# total #wrong (elements, summed over the ranks): {wrong}")
        if "zero" in parts:
            print(f"# ZeRO-3 {args.model}, {args.steps} steps, {args.batch} x {args.seq} tokens per rank, "
                  f"AdamW lr {args.lr}" + ("" if "plain" in configs else
                                           "; no plain config in --configs: no 'vs plain' columns"))
            print(f"{'config':>8} {'cross-host B/step':>18} {'vs plain':>8} {'step ms':>8} {'loss':>8} {'vs plain':>8}")
            base = None
            for name in zero_order(configs):
                ranks = [r.value for r in run_ranks(_zero_rank, world, args=(name, args), env=env,
                                                    timeout=args.timeout)]
                res = {"part": "zero3", "config": name,
                       "inter_bytes_per_step": max(r["inter_bytes_per_step"] for r in ranks),
                       "step_s": max(r["step_s"] for r in ranks), "loss": ranks[0]["loss"]}
                if name == "plain":
                    base = res
                print(zero_row(res, base), flush=True)
                results.append(res)
    finally:
        if args.throttle:
            teardown_link(args.hosts)
    if args.json:
        write_json(args.json, results, {"bench": "hier", "args": vars(args)})
    if wrong:
        print(f"# {wrong} wrong result elements: the hierarchical all_reduce differs from gloo's")
    return 1 if wrong else 0
