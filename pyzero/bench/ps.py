"""Parameter-server training vs DataParallel: tokens/s and loss after a fixed number of samples.

Runs, side by side in one invocation, with the same model, data and sample budget:
  dp        pz.DataParallel over the workers (all-reduce each step; the baseline)
  sync      pz.ps, synchronous rounds (the same arithmetic as dp)
  bounded   pz.ps, stale synchronous parallel (--staleness k)
  async     pz.ps, fully asynchronous
Each with all workers equal, and with one straggler (--straggler 3: worker 0 takes 3x as long per
step, the extra time slept, as a slower machine would). The data is learnable (token sequences
that mostly follow a fixed successor map), so the loss after the budget means something; it is
measured on a held-out batch with the final parameters. Worker i's n-th gradient is taken on the same
batch in every run (dp's rank i at its step n), so "vs dp" compares training on the same data (sync
does dp's arithmetic: its loss is dp's to rounding).

--transport also times the push+pull of the model's gradients/parameters over pz.ps's connection
(multiprocessing.connection over TCP) against torch.distributed.rpc (TensorPipe) carrying the
same tensors between the same two processes.
"""
from __future__ import annotations

import argparse
import time

import torch

from .common import UsageError, number_list, write_json
from .gpt import PRESETS, make_gpt

RUNS = ("dp", "sync", "bounded", "async")


def structured_batch(config, batch: int, seq: int, seed: int):
    """Token sequences where each next token is (7 * token + 3) mod V with probability 0.8, else random."""
    g = torch.Generator().manual_seed(seed)
    v = config.vocab_size
    toks = torch.empty(batch, seq + 1, dtype=torch.long)
    toks[:, 0] = torch.randint(0, v, (batch,), generator=g)
    rand = torch.randint(0, v, (batch, seq), generator=g)
    keep = torch.rand(batch, seq, generator=g) < 0.8
    for t in range(seq):
        toks[:, t + 1] = torch.where(keep[:, t], (7 * toks[:, t] + 3) % v, rand[:, t])
    return toks[:, :-1].contiguous(), toks[:, 1:].contiguous()


def worker_batch(args, step: int, worker: int):
    """Worker `worker`'s batch for its `step`-th gradient (0-based), in every run: dp's rank `worker` at its
    step `step` and pz.ps worker `worker`'s `step`-th push train on the same tokens, so the losses compare."""
    return structured_batch(PRESETS[args.model], args.batch, args.seq, seed=step * 1000 + worker)


def serve_options(mode: str, args) -> dict:
    """pz.ps.serve's mode options: --staleness is the bounded mode's (sync and async take none)."""
    return {"mode": mode, "staleness": args.staleness} if mode == "bounded" else {"mode": mode}


def _eval_loss(model, args) -> float:
    x, y = structured_batch(PRESETS[args.model], 32, args.seq, seed=10**7)
    with torch.no_grad():
        return float(model(x, y))


def _slow(args, worker: int, seconds: float) -> None:
    if args.straggler > 1 and worker == 0:
        time.sleep((args.straggler - 1) * seconds)


def _dp_rank(args):
    import pyzero as pz  # noqa: PLC0415

    pz.init(backend="shm", timeout=args.timeout)
    rank, world = pz.get_rank(), pz.get_world_size()
    model = make_gpt(args.model)
    dp = pz.DataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    steps = args.samples // (args.batch * world)
    pz.barrier()
    t0 = time.perf_counter()
    for step in range(steps):
        x, y = worker_batch(args, step, rank)
        c0 = time.perf_counter()
        loss = dp(x, y)
        loss.backward()
        _slow(args, rank, time.perf_counter() - c0)
        opt.step()
        opt.zero_grad()
    elapsed = time.perf_counter() - t0
    return {"samples": steps * args.batch, "elapsed": elapsed, "t0": t0, "t1": t0 + elapsed,
            "eval": _eval_loss(model, args)}


def _ps_rank(mode, args):
    import pyzero as pz  # noqa: PLC0415

    role, index = pz.ps.role(args.servers)
    model = make_gpt(args.model)
    versions = args.samples // (args.batch * (args.workers if mode == "sync" else 1))
    if role == "server":
        return pz.ps.serve(model, torch.optim.AdamW, args.servers, **serve_options(mode, args),
                           max_versions=versions, wait_for_workers=args.workers, idle_timeout=args.timeout,
                           lr=args.lr)
    w = pz.ps.Worker(model, num_servers=args.servers, timeout=args.timeout)
    n, t0 = 0, None
    while w.pull():
        if t0 is None:
            t0 = time.perf_counter()
        x, y = worker_batch(args, n, index)
        c0 = time.perf_counter()
        model(x, y).backward()
        _slow(args, index, time.perf_counter() - c0)
        if w.push():
            n += 1
    t1 = time.perf_counter()
    w.close()
    return {"samples": n * args.batch, "elapsed": t1 - t0, "t0": t0, "t1": t1, "eval": _eval_loss(model, args),
            "max_gap": max(w.clock_gaps or [0])}


def _transport_rank(args):
    """Rank 0 serves, rank 1 sends the model's gradients and receives its parameters back."""
    import os  # noqa: PLC0415

    import pyzero as pz  # noqa: PLC0415
    import torch.distributed.rpc as rpc  # noqa: PLC0415

    model = make_gpt(args.model)
    n = sum(p.numel() for p in model.parameters())
    rank = int(os.environ["RANK"])
    iters = args.transport_iters
    out = {}
    role = "server" if rank == 0 else "worker"
    if role == "server":
        pz.ps.serve(model, torch.optim.SGD, 1, mode="async", idle_timeout=5, lr=0.0)
    else:
        w = pz.ps.Worker(model, num_servers=1)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        ts = []
        for _ in range(iters + 2):
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
            t = time.perf_counter()
            w.push()
            w.pull()
            ts.append(time.perf_counter() - t)
        w.close()
        out["ps_ms"] = 1e3 * sorted(ts[2:])[len(ts[2:]) // 2]
    opts = rpc.TensorPipeRpcBackendOptions(init_method=f"tcp://127.0.0.1:{int(os.environ['MASTER_PORT']) + 1}",
                                           num_worker_threads=4)
    rpc.init_rpc(f"r{rank}", rank=rank, world_size=2, rpc_backend_options=opts)
    if role == "worker":
        g = torch.zeros(n)
        ts = []
        for _ in range(iters + 2):
            t = time.perf_counter()
            rpc.rpc_sync("r0", _echo, args=(g,))
            ts.append(time.perf_counter() - t)
        out["rpc_ms"] = 1e3 * sorted(ts[2:])[len(ts[2:]) // 2]
        out["mib"] = n * 4 / 2**20
    rpc.shutdown()
    return out


def _echo(t):
    return t.clone()  # the pulled parameters: as many bytes back as the pushed gradients


def add_arguments(p) -> None:
    p.add_argument("--model", default="gpt-nano", help=f"one of {list(PRESETS)}")
    p.add_argument("--runs", default=",".join(RUNS), help=f"comma list of {list(RUNS)}")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--servers", type=int, default=1)
    p.add_argument("--samples", type=int, default=4096, help="samples processed in total by all workers")
    p.add_argument("--batch", type=int, default=8, help="samples per worker step")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--staleness", type=int, default=2)
    p.add_argument("--straggler", default="1,3", help="comma list of slowdown factors of worker 0 (1: none)")
    p.add_argument("--transport", action="store_true", help="also time pz.ps's connection vs torch rpc")
    p.add_argument("--transport-iters", type=int, default=20)
    p.add_argument("--timeout", type=float, default=300.0)
    p.add_argument("--json", default=None)


def main(args) -> int:
    from ..launch import run_ranks  # noqa: PLC0415

    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    if not runs or any(r not in RUNS for r in runs):
        raise UsageError(f"--runs: expected a comma list of {list(RUNS)}, got {args.runs!r}")
    if args.model not in PRESETS:
        raise UsageError(f"--model: expected one of {list(PRESETS)}, got {args.model!r}")
    for name in ("workers", "servers", "batch"):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name}: expected >= 1, got {getattr(args, name)}")
    if args.samples < args.batch * args.workers:
        raise UsageError(f"--samples: expected >= --batch x --workers = {args.batch * args.workers}, "
                         f"got {args.samples}")
    stragglers = number_list(args.straggler, "--straggler", kind=float, least=1)
    print(f"# {args.model}: {args.workers} workers x {args.batch} x {args.seq} tokens, {args.samples} samples, "
          f"{args.servers} server(s), AdamW lr {args.lr}, staleness {args.staleness} (bounded)")
    print(f"{'straggler':>9} {'run':>8} {'tokens/s':>10} {'vs dp':>6} {'loss':>8} {'vs dp':>7} {'max gap':>7}")
    results = []
    for slow in stragglers:
        run_args = argparse.Namespace(**{**vars(args), "straggler": slow})  # (the ranks read one factor)
        base = None
        for run in runs:
            if run == "dp":
                ranks = [r.value for r in run_ranks(_dp_rank, args.workers, args=(run_args,),
                                                    timeout=args.timeout)]
            else:
                ranks = [r.value for r in run_ranks(_ps_rank, args.servers + args.workers, args=(run, run_args),
                                                    timeout=args.timeout)][args.servers:]
            wall = max(r["t1"] for r in ranks) - min(r["t0"] for r in ranks)
            samples = sum(r["samples"] for r in ranks)
            res = {"run": run, "straggler": slow, "tokens_per_s": samples * args.seq / wall, "samples": samples,
                   "wall_s": wall, "loss": sum(r["eval"] for r in ranks) / len(ranks),
                   "max_gap": max(r.get("max_gap", 0) for r in ranks)}
            if run == "dp":
                base = res
            ratio = f"{res['tokens_per_s'] / base['tokens_per_s']:6.2f}" if base else f"{'-':>6}"
            dloss = f"{100 * (res['loss'] / base['loss'] - 1):+6.1f}%" if base else f"{'-':>7}"
            print(f"{slow:9.1f} {run:>8} {res['tokens_per_s']:10.0f} {ratio} {res['loss']:8.4f} {dloss} "
                  f"{res['max_gap']:7d}", flush=True)
            results.append(res)
    if args.transport:
        r = run_ranks(_transport_rank, 2, args=(args,), timeout=args.timeout)[1].value
        print(f"# push+pull of {r['mib']:.1f} MiB each way: pz.ps connection {r['ps_ms']:.2f} ms, "
              f"torch rpc (TensorPipe) {r['rpc_ms']:.2f} ms (median of {args.transport_iters})")
        results.append({"run": "transport", **r})
    if args.json:
        write_json(args.json, results, {"bench": "ps", "args": {**vars(args), "straggler": stragglers}})
    return 0
