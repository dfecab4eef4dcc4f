"""pyzero-bench soak: random collectives for a bounded time, every result checked against a local reference.

Every rank draws the same sequence of calls from a shared seed (collective, reduce op, dtype, size
including uneven and zero counts, sync or async with several in flight, the world or a subgroup, send/recv
rings, and fused TP ops: all_gather_matmul / matmul_reduce_scatter); each rank's input is a function of
(seed, call, rank), so every rank computes the expected result of every call locally. Values are small integers, exact in
every dtype, so results must match exactly (avg and the fused matmuls within rounding).

    pyzero-bench soak --seconds 60 --nproc 4
"""
from __future__ import annotations

import argparse
import random
import time
from collections import Counter

import torch

import pyzero as pz
from pyzero.launch import run_ranks

from .common import UsageError, write_json

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int32, torch.int64]
SIZES = [0, 1, 3, 64, 1000, 4097, 65537, 300_000]
OPS = ["sum", "max", "min", "prod", "avg"]


def _data(seed: int, call: int, rank: int, n: int, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed((seed * 1_000_003 + call) * 64 + rank)
    return torch.randint(-4, 5, (n,), generator=g).to(dtype)


def _reduce(xs, op):
    st = torch.stack([x.to(torch.float64) for x in xs])
    if op == "sum":
        return st.sum(0)
    if op == "max":
        return st.max(0).values
    if op == "min":
        return st.min(0).values
    if op == "prod":
        return st.prod(0)
    return st.sum(0) / len(xs)


def _split(total: int, k: int, rng: random.Random, uneven: bool) -> list[int]:
    if not uneven:
        return [total // k] * k
    cuts = sorted(rng.randrange(total + 1) for _ in range(k - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


class Checker:
    def __init__(self):
        self.calls = Counter()
        self.wrong = 0
        self.notes: list[str] = []

    def check(self, what: str, got: torch.Tensor, want: torch.Tensor, exact: bool = True):
        got64 = got.to(torch.float64)
        want64 = want.to(torch.float64)
        if got.shape != want.shape:
            ok = False
        elif exact:
            ok = torch.equal(got64, want64)
        else:
            ok = torch.allclose(got64, want64, rtol=2e-2 if got.dtype in (torch.bfloat16, torch.float16) else 1e-5,
                                atol=1e-2 if got.dtype in (torch.bfloat16, torch.float16) else 1e-6)
        if not ok:
            self.wrong += 1
            if len(self.notes) < 5:
                self.notes.append(f"{what}: got {got.flatten()[:6].tolist()}, want {want.flatten()[:6].tolist()}")


def _rank_soak(seconds: float, seed: int, inject_wrong: int = 0) -> dict:
    pz.init(backend="shm", timeout=60)
    rank, n = pz.get_rank(), pz.get_world_size()
    rng = random.Random(seed)  # the same sequence of calls on every rank
    groups = [pz.comm.resolve_group(None)]
    for ranks in ([r for r in range(n) if r % 2 == 0], list(range(1, n)), list(range(n - 1))):
        if len(ranks) >= 1:
            groups.append(pz.new_group(ranks))
    chk = Checker()
    pending = []  # (group, check function) of async calls not yet waited on
    stop = torch.zeros(1)
    deadline = time.monotonic() + seconds
    call = 0

    def settle():
        for work, fn in pending:
            work.wait()
            fn()
        pending.clear()

    while True:
        call += 1
        if call % 16 == 0:  # agree on stopping: rank 0's clock decides
            settle()
            stop.fill_(float(rank == 0 and time.monotonic() > deadline))
            pz.all_reduce(stop, op="max")
            chk.calls["all_reduce(stop)"] += 1
            if stop.item():
                break
        g = rng.choice(groups)
        kind = rng.choice(["all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "fused", "sendrecv"])
        dtype = rng.choice(DTYPES)
        op = rng.choice(OPS[:4] if not dtype.is_floating_point else OPS)
        size = rng.choice(SIZES)
        uneven = rng.random() < 0.5
        async_op = rng.random() < 0.4
        algo = rng.choice([None, None, "ring", "oneshot"])
        src = rng.choice(g.ranks)
        cs = _split(size, g.size, rng, uneven)
        m, kk, o, fused_ag = rng.choice([1, 4, 16]), rng.choice([8, 64]), rng.choice([8, 96]), rng.random() < 0.5
        if g.rank < 0:
            continue  # not a member: the members make this call
        k, me = g.size, g.rank
        if algo == "oneshot" and size * 8 * max(k, 1) > (256 << 10):
            algo = None
        inputs = [_data(seed, call, r, size, dtype) for r in g.ranks]
        mine = inputs[me].clone()
        name = f"call {call} {kind}(size={size}, {dtype}, op={op}, group={list(g.ranks)}, async={async_op})"
        exact = op != "avg"
        if kind == "all_reduce":
            res, want = mine, _reduce(inputs, op)
            w = pz.all_reduce(mine, op=op, group=g, async_op=async_op, algo=algo)
        elif kind == "reduce_scatter":
            lo = sum(cs[:me])
            res, want = torch.zeros(cs[me], dtype=dtype), _reduce([x[:sum(cs)] for x in inputs], op)[lo:lo + cs[me]]
            w = pz.reduce_scatter(res, mine[:sum(cs)], op=op, counts=cs if uneven else None, group=g,
                                  async_op=async_op, algo=algo)
        elif kind == "all_gather":
            res, want = torch.zeros(sum(cs), dtype=dtype), torch.cat([inputs[r][:cs[r]] for r in range(k)])
            w = pz.all_gather(res, mine[:cs[me]], counts=cs if uneven else None, group=g, async_op=async_op,
                              algo=algo)
            exact = True
        elif kind == "broadcast":
            res, want = mine, inputs[g.ranks.index(src)]
            w = pz.broadcast(mine, src=src, group=g, async_op=async_op, algo=algo)
            exact = True
        elif kind == "sendrecv":  # a ring: each rank sends to the next and receives from the previous
            settle()
            if k == 1:
                continue
            nxt, prv = g.ranks[(me + 1) % k], g.ranks[(me - 1) % k]
            res, want = torch.zeros(size, dtype=dtype), inputs[(me - 1) % k]
            sent = pz.send(mine, dst=nxt, group=g, async_op=True)
            pz.recv(res, src=prv, group=g)
            sent.wait()
            w, exact = None, True
        elif kind == "barrier":
            res, want = None, None
            w = pz.barrier(group=g, async_op=async_op)
        else:  # fused TP ops (settle first: they make their own calls on the group)
            settle()
            gen = torch.Generator().manual_seed(seed * 7919 + call)
            wt = torch.randint(-3, 4, (o, kk), generator=gen).float()
            xs = [torch.randint(-3, 4, (m * k, kk), generator=gen).float() for _ in range(k)]
            if fused_ag:
                kind = "all_gather_matmul"
                got = pz.tp.all_gather_matmul(xs[0][me * m:(me + 1) * m], wt, group=g)
                want = xs[0] @ wt.T
            else:
                kind = "matmul_reduce_scatter"
                got = pz.tp.matmul_reduce_scatter(xs[me], wt, group=g)
                want = sum(xi @ wt.T for xi in xs)[me * m:(me + 1) * m]
            chk.calls[kind] += 1
            chk.check(f"call {call} {kind}(m={m}, k={kk}, o={o}, group={list(g.ranks)})", got, want)
            continue
        chk.calls[kind] += 1
        if res is None:
            fn = (lambda: None)
        else:
            fn = (lambda res=res, want=want, name=name, exact=exact:
                  chk.check(name, res, want.to(res.dtype), exact=exact))
        if w is None:
            if inject_wrong and res is not None and res.numel() and chk.wrong < inject_wrong and call % 5 == 0:
                res.view(-1)[0] += 1  # a deliberately wrong result: the check must count it
            fn()
        else:
            pending.append((w, fn))
            if len(pending) > 4:
                settle()
    settle()
    return {"calls": dict(chk.calls), "wrong": chk.wrong, "notes": chk.notes, "iterations": call}


def soak(seconds: float, nproc: int, seed: int = 0, inject_wrong: int = 0, timeout: float | None = None) -> dict:
    res = run_ranks(_rank_soak, nproc, args=(seconds, seed, inject_wrong),
                    timeout=timeout or seconds * 3 + 120)
    calls = Counter()
    for r in res:
        calls.update(r.value["calls"])
    return {"nproc": nproc, "seconds": seconds, "calls": dict(calls), "total_calls": sum(calls.values()),
            "wrong": sum(r.value["wrong"] for r in res), "notes": [n for r in res for n in r.value["notes"]]}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--seconds", type=float, default=60.0, help="how long to run (default 60)")
    p.add_argument("--nproc", type=int, nargs="+", default=[2, 3, 4], help="rank counts to run (default 2 3 4)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results (per rank count: calls, wrong results, notes), "
                                                "with the machine, versions and date, to this file")


def main(args) -> int:
    if args.seconds <= 0:
        raise UsageError(f"--seconds: expected a positive number, got {args.seconds}")
    if any(n < 2 for n in args.nproc):
        raise UsageError(f"--nproc: expected rank counts >= 2, got {args.nproc}")
    bad, results = 0, []
    print("| ranks | seconds | calls (per rank, summed) | wrong results |")
    print("|---|---|---|---|")
    for n in args.nproc:
        r = soak(args.seconds, n, args.seed)
        print(f"| {n} | {args.seconds:g} | {r['total_calls']} | {r['wrong']} |", flush=True)
        print("  " + ", ".join(f"{k} {v}" for k, v in sorted(r["calls"].items())))
        for note in r["notes"]:
            print(f"  wrong: {note}")
        bad += r["wrong"]
        results.append(r)
    if args.json:
        write_json(args.json, results, {"bench": "soak", "args": vars(args)})
    return 1 if bad else 0
