"""Correctness of the shm collectives against torch references.

Every multi-rank test runs many cases inside one ``run_ranks`` call (forking
ranks costs ~0.1-0.5 s): the rank function loops over dtypes/ops/sizes/algos,
checks its own result against a reference it computes independently from all
ranks' (seeded, reproducible) inputs, and returns a list of failures, which
the parent asserts is empty.

Inputs are chosen so the expected result is exact: multiples of 1/64 for
sums (exact in fp32 accumulation, so the only rounding is the final one to
fp16/bf16), values in {1, 2, 0.5, -1} for prod. The reference accumulates
fp16/bf16 in fp32 and rounds once, which is what the implementation promises,
so results are compared for exact equality.
"""
import os
import time

import pytest
import torch

import pyzero as pz
from pyzero import comm
from pyzero.launch import run_ranks
from reference_data import make_input, reference

FLOATS = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
INTS = [torch.int32, torch.int64]
DTYPES = FLOATS + INTS
OPS = ["sum", "avg", "max", "min", "prod"]
ALGOS = ["ring", "oneshot", "auto"]
WORLDS = [1, 2, 3, 4]
BIG = 1_048_583  # a prime > 2**20: several ring rounds per chunk, uneven chunks
SIZES = [0, 1, 2, 3, 5, 13, 127, 1031, 8191, 65537]  # 0, 1 and primes (8191, 65537 are Mersenne/Fermat)
MAX_FAILURES = 20
AG_AUTO_ONESHOT_BYTES = 64 << 10  # auto's one-shot limit for all_gather (csrc/shm_transport.cpp)


# ---------------------------------------------------------------------------
# Helpers shared by the rank functions (they run in the forked ranks)


def ops_for(dtype):
    return OPS if dtype.is_floating_point else [o for o in OPS if o != "avg"]


def mismatch(got, want):
    """None when `got` equals `want` exactly (dtype, shape, values), else a short description."""
    if got.dtype != want.dtype:
        return f"dtype {got.dtype} != {want.dtype}"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
    if torch.equal(got, want):
        return None
    bad = (got != want).nonzero().flatten()
    i = int(bad[0])
    return (f"{bad.numel()} of {got.numel()} elements differ; first at [{i}]: got {got[i].item()!r}, "
            f"want {want[i].item()!r}")


class Checker:
    def __init__(self):
        self.failures = []
        self.cases = 0

    def check(self, what, got, want):
        self.cases += 1
        why = mismatch(got, want)
        if why is not None and len(self.failures) < MAX_FAILURES:
            self.failures.append(f"rank {pz.get_rank()}: {what}: {why}")

    def fail(self, what):
        if len(self.failures) < MAX_FAILURES:
            self.failures.append(f"rank {pz.get_rank()}: {what}")

    def result(self):
        return {"failures": self.failures, "cases": self.cases}


def oneshot_ok(nbytes):
    return nbytes <= pz.comm.resolve_group(None).backend.oneshot_bytes


def even_split(total, n):
    return [total // n + (1 if r < total % n else 0) for r in range(n)]


def assert_ranks_ok(results, min_cases=1):
    failures = [f for r in results for f in r.value["failures"]]
    assert not failures, "\n".join(failures)
    for r in results:
        assert r.value["cases"] >= min_cases, f"rank {r.rank} checked only {r.value['cases']} cases"


# ---------------------------------------------------------------------------
# all_reduce: every op x dtype x size x algo


def _rank_all_reduce_matrix():
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    ck = Checker()
    seed = 0
    for algo in ALGOS:
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for size in SIZES:
                    seed += 1
                    esize = torch.tensor([], dtype=dtype).element_size()
                    if algo == "oneshot" and not oneshot_ok(size * esize):
                        continue
                    inputs = [make_input(op, dtype, size, r, seed) for r in range(n)]
                    t = inputs[me].clone()
                    pz.all_reduce(t, op=op, algo=algo)
                    want = reference(inputs, op, dtype)
                    ck.check(f"all_reduce(n={n}, {dtype}, op={op}, size={size}, algo={algo})", t, want)
                    if op in ("sum", "avg"):  # out of place: the input is only read
                        src, out = inputs[me].clone(), torch.full((size,), 7, dtype=dtype)
                        pz.all_reduce(src, op=op, algo=algo, out=out)
                        ck.check(f"all_reduce(out=, n={n}, {dtype}, op={op}, size={size}, algo={algo})", out, want)
                        ck.check(f"all_reduce(out=) input untouched, {dtype}, size={size}", src, inputs[me])

    # A second full-world group with tiny slices and a shallow ring buffer:
    # many ring rounds and slot wrap-arounds at small sizes.
    small = pz.new_group(range(n), options=pz.Options(slice_bytes=4096, depth=2))
    for dtype in DTYPES:
        for op in ["sum", "max", "prod"]:
            for size in [3, 4099, 40009]:
                seed += 1
                inputs = [make_input(op, dtype, size, r, seed) for r in range(n)]
                t = inputs[me].clone()
                pz.all_reduce(t, op=op, group=small, algo="ring")
                ck.check(f"all_reduce(n={n}, small slices, {dtype}, op={op}, size={size})", t,
                         reference(inputs, op, dtype))

    # Streamed outputs ([Note: streamed output], csrc/cpu_reduce.h): a group that streams every
    # out-of-place ring output, with small slices so slices start mid-line; outputs at a line
    # boundary and one element past it, sizes around a 64-byte line.
    streamed = pz.new_group(range(n), options=pz.Options(stream_bytes=0, slice_bytes=4096, depth=2))
    for dtype in DTYPES:
        esize = torch.tensor([], dtype=dtype).element_size()
        line = 64 // esize
        for op in ["sum", "avg", "max"] if dtype.is_floating_point else ["sum", "max"]:
            for size in [1, line - 1, line, line + 1, 3 * line + 5, 40009]:
                for shift in [0, 1]:
                    seed += 1
                    inputs = [make_input(op, dtype, size, r, seed) for r in range(n)]
                    want = reference(inputs, op, dtype)
                    base = torch.full((size + line,), 7, dtype=dtype)
                    start = (-base.data_ptr() // esize) % line + shift  # 64-byte aligned, then `shift` past it
                    out = base[start:start + size]
                    pz.all_reduce(inputs[me], op=op, algo="ring", out=out, group=streamed)
                    what = f"streamed all_reduce(out=, n={n}, {dtype}, op={op}, size={size}, shift={shift})"
                    ck.check(what, out, want)
                    rest = torch.cat([base[:start], base[start + size:]])
                    ck.check(what + " left the rest of out's buffer alone", rest, torch.full((line,), 7, dtype=dtype))
                    if n > 1:
                        k = size // n
                        rs_out = base[start:start + k]
                        pz.reduce_scatter(rs_out, inputs[me][:n * k], op=op, algo="ring", group=streamed)
                        ck.check(what.replace("all_reduce", "reduce_scatter"), rs_out,
                                 reference([x[:n * k] for x in inputs], op, dtype)[me * k:(me + 1) * k])

    # > 1M elements: several ring rounds per chunk at the default slice size.
    for dtype, op, algo in [(torch.float32, "sum", "ring"), (torch.bfloat16, "avg", "auto")]:
        seed += 1
        inputs = [make_input(op, dtype, BIG, r, seed) for r in range(n)]
        t = inputs[me].clone()
        pz.all_reduce(t, op=op, algo=algo)
        ck.check(f"all_reduce(n={n}, {dtype}, op={op}, size={BIG}, algo={algo})", t, reference(inputs, op, dtype))
        out = torch.empty(BIG, dtype=dtype)
        pz.all_reduce(inputs[me], op=op, algo=algo, out=out, async_op=True).wait()
        ck.check(f"async all_reduce(out=, n={n}, {dtype}, op={op}, size={BIG})", out, reference(inputs, op, dtype))

    # out= misuse: every rank raises the same error before any communication
    x = torch.ones(8)
    for what, call, words in [("numel", lambda: pz.all_reduce(x, out=torch.empty(9)), "out: expected 8"),
                              ("dtype", lambda: pz.all_reduce(x, out=torch.empty(8, dtype=torch.float64)),
                               "does not match"),
                              ("overlap", lambda: pz.all_reduce(x[:6], out=x[2:]), "out overlaps tensor"),
                              ("overlap below", lambda: pz.all_reduce(x[2:], out=x[:6]), "out overlaps tensor"),
                              ("overlap by one", lambda: pz.all_reduce(x[:4], out=x[3:7]), "out overlaps tensor")]:
        try:
            call()
            ck.fail(f"all_reduce(out=) with bad {what} did not raise")
        except (ValueError, TypeError) as e:
            if words not in str(e):
                ck.fail(f"all_reduce(out=) bad {what}: {e}")
    pz.all_reduce(x)  # the group is still usable
    ck.check("all_reduce after out= errors", x, torch.full((8,), float(n)))
    y = torch.ones(8)  # memory right next to the input is separate memory
    pz.all_reduce(y[:4], out=y[4:])
    ck.check("all_reduce(out=) adjacent to tensor", y, torch.cat([torch.ones(4), torch.full((4,), float(n))]))
    y = torch.ones(8)  # and right before it
    pz.all_reduce(y[4:], out=y[:4])
    ck.check("all_reduce(out=) adjacent below tensor", y, torch.cat([torch.full((4,), float(n)), torch.ones(4)]))
    return ck.result()


@pytest.mark.parametrize("world", WORLDS)
def test_all_reduce_matrix(world):
    results = run_ranks(_rank_all_reduce_matrix, world, timeout=120)
    assert_ranks_ok(results, min_cases=3 * 28 * 5)


def _rank_one_shot_many_sources():
    """The one-shot reduce sums up to 4 sources in one pass and more through a block of
    accumulators (csrc/cpu_reduce.h): 5 ranks take the second path."""
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    ck = Checker()
    seed = 50_000
    for dtype in [torch.float32, torch.bfloat16, torch.int64]:
        for op in ops_for(dtype):
            for size in [1, 513, 1031]:
                seed += 1
                inputs = [make_input(op, dtype, size, r, seed) for r in range(n)]
                t = inputs[me].clone()
                pz.all_reduce(t, op=op, algo="oneshot")
                ck.check(f"all_reduce(n={n}, {dtype}, op={op}, size={size}, oneshot)", t, reference(inputs, op, dtype))
        seed += 1
        inputs = [make_input("sum", dtype, n * 700, r, seed) for r in range(n)]
        out = torch.empty(700, dtype=dtype)
        pz.reduce_scatter(out, inputs[me], algo="oneshot")
        want = reference(inputs, "sum", dtype)[me * 700:(me + 1) * 700]
        ck.check(f"reduce_scatter(n={n}, {dtype}, oneshot)", out, want)
    return ck.result()


def test_one_shot_of_five_ranks():
    assert_ranks_ok(run_ranks(_rank_one_shot_many_sources, 5, timeout=60), min_cases=3 * 4 * 3)


def _rank_two_shot():
    """The two-shot all_reduce (csrc [Note: two-shot all_reduce]): every dtype and op, uneven chunks
    (sizes below and around n), in and out of place, back to back (the areas alternate by call:
    a rank that ran ahead must never overwrite what a peer still reads), a bf16 message of 2 MiB,
    and its limits raise the same error on every rank."""
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    ck = Checker()
    seed = 70_000
    for dtype in DTYPES:
        for op in ops_for(dtype):
            for size in [0, 1, n - 1, n + 1, 1031, 65537]:
                seed += 1
                inputs = [make_input(op, dtype, size, r, seed) for r in range(n)]
                want = reference(inputs, op, dtype)
                t = inputs[me].clone()
                pz.all_reduce(t, op=op, algo="twoshot")
                ck.check(f"all_reduce(n={n}, {dtype}, op={op}, size={size}, twoshot)", t, want)
                src, out = inputs[me].clone(), torch.full((size,), 7, dtype=dtype)
                pz.all_reduce(src, op=op, algo="twoshot", out=out)
                ck.check(f"all_reduce(out=, n={n}, {dtype}, op={op}, size={size}, twoshot)", out, want)
                ck.check(f"all_reduce(out=) input untouched, {dtype}, size={size}, twoshot", src, inputs[me])
    seed += 1
    inputs = [make_input("avg", torch.bfloat16, BIG, r, seed) for r in range(n)]  # 2 MiB
    t = inputs[me].clone()
    pz.all_reduce(t, op="avg", algo="twoshot", async_op=True).wait()
    ck.check(f"all_reduce(n={n}, bfloat16, avg, size={BIG}, twoshot)", t, reference(inputs, "avg", torch.bfloat16))
    # rank r works slowly on odd calls: the others run ahead into the next calls
    for i in range(12):
        seed += 1
        inputs = [make_input("sum", torch.float32, 40009, r, seed) for r in range(n)]
        if i % 2 and me == i % n:
            time.sleep(0.01)
        t = inputs[me].clone()
        pz.all_reduce(t, algo="twoshot")
        ck.check(f"back-to-back twoshot call {i}", t, reference(inputs, "sum", torch.float32))
    # random floats, where the order of a sum shows: the two-shot reduces in the ring's order, so
    # auto may take either (see test_auto_between_ring_and_two_shot) without changing a bit
    for dtype in FLOATS:
        for op in ("sum", "avg", "prod"):
            g = torch.Generator().manual_seed(1000 * n + me)
            x = torch.randn(50021, generator=g).to(dtype)
            a, b = x.clone(), x.clone()
            pz.all_reduce(a, op=op, algo="ring")
            pz.all_reduce(b, op=op, algo="twoshot")
            ck.check(f"twoshot == ring bitwise, random {dtype}, {op}, n={n}", b, a)
    for what, call, words in [
        ("reduce_scatter", lambda: pz.reduce_scatter(torch.empty(2), torch.ones(2 * n), algo="twoshot"),
         "all_reduce algorithm")]:
        try:
            call()
            ck.fail(f"twoshot {what} did not raise")
        except ValueError as e:
            if words not in str(e):
                ck.fail(f"twoshot {what}: {e}")
    x = torch.ones(8)
    pz.all_reduce(x, algo="twoshot")  # the group is still usable
    ck.check("twoshot after errors", x, torch.full((8,), float(n)))
    return ck.result()


@pytest.mark.parametrize("world", [2, 3, 5])
def test_two_shot_all_reduce(world):
    assert_ranks_ok(run_ranks(_rank_two_shot, world, timeout=90), min_cases=28 * 6 * 3)


def _pieces_matrix(ck, area: int, algo, sizes, seed: int):
    """all_reduce with `algo` (None: auto) in pieces of a `area`-byte two-shot area, cached and streamed,
    every dtype and op, in and out of place, at sizes(per, itemsize) elements (per: each chunk's part of a
    piece), against the closed-form reference; returns the two groups (cached, streamed)."""
    n, me = pz.get_world_size(), pz.get_rank()
    g = pz.new_group(range(n), options=pz.Options(twoshot_bytes=area, oneshot_bytes=1024))
    gs = pz.new_group(range(n), options=pz.Options(twoshot_bytes=area, oneshot_bytes=1024, twoshot_stream_bytes=0))
    what = "pieces" if algo else "auto in pieces"
    for group, how in ((g, "cached"), (gs, "streamed")):
        for dtype in DTYPES:
            for op in ops_for(dtype):
                for size in sizes(area // (n * dtype.itemsize), dtype.itemsize):
                    seed += 1
                    inputs = [make_input(op, dtype, size, r, seed) for r in range(n)]
                    want = reference(inputs, op, dtype)
                    t = inputs[me].clone()
                    pz.all_reduce(t, op=op, algo=algo, group=group)
                    ck.check(f"{what} all_reduce(n={n}, {dtype}, op={op}, size={size}, {how})", t, want)
                    src, out = inputs[me].clone(), torch.full((size,), 7, dtype=dtype)
                    pz.all_reduce(src, op=op, algo=algo, out=out, group=group)
                    ck.check(f"{what} all_reduce(out=, n={n}, {dtype}, op={op}, size={size}, {how})", out, want)
                    ck.check(f"{what} all_reduce(out=) input untouched, {dtype}, size={size}, {how}", src,
                             inputs[me])
    return g, gs


def _rank_two_shot_pieces():
    """The two-shot of a message larger than its area (twoshot_bytes), in pieces: every dtype and op,
    chunks whose last pieces differ in length, in and out of place, bitwise the ring where the order of
    a sum shows, and back to back with one-shot and one-piece calls while one rank runs behind (the
    pieces alternate the areas the other calls use); auto there takes either without changing a bit."""
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    ck = Checker()
    # the two-shot in pieces of its area, cached and with the area written by streaming stores
    # ([Note: streamed two-shot])
    g, gs = _pieces_matrix(ck, 4096, "twoshot", lambda per, es: [4096 // es + 1, 3 * n * per + n - 1, 20011],
                           90_000)
    seed = 91_000
    for dtype in FLOATS:
        for op in ("sum", "avg", "prod"):
            gen = torch.Generator().manual_seed(2000 * n + me)
            x = torch.randn(30011, generator=gen).to(dtype)
            a, b, c = x.clone(), x.clone(), x.clone()
            pz.all_reduce(a, op=op, algo="ring", group=g)
            pz.all_reduce(b, op=op, algo="twoshot", group=g)
            ck.check(f"pieces == ring bitwise, random {dtype}, {op}, n={n}", b, a)
            b.copy_(x)
            pz.all_reduce(b, op=op, algo="twoshot", group=gs)
            ck.check(f"streamed pieces == ring bitwise, random {dtype}, {op}, n={n}", b, a)
            for _ in range(4):  # auto: rank 0 tries the two-shot after 2 calls
                c.copy_(x)
                pz.all_reduce(c, op=op, group=g)
                ck.check(f"auto above twoshot_bytes == ring bitwise, random {dtype}, {op}, n={n}", c, a)
    # rank r works slowly on some calls: the others run ahead into the next calls, whose areas
    # the pieces of this one used
    for i in range(18):
        seed += 1
        size, algo = [(9001, "twoshot"), (100, "oneshot"), (300, "twoshot"), (5003, "twoshot")][i % 4]
        inputs = [make_input("sum", torch.float32, size, r, seed) for r in range(n)]
        if i % 3 == 0 and me == i % n:
            time.sleep(0.01)
        t = inputs[me].clone()
        pz.all_reduce(t, algo=algo, group=g)
        ck.check(f"back-to-back call {i} ({algo}, {size})", t, reference(inputs, "sum", torch.float32))
    # every rank on one core: a rank runs while the others wait, so it reads a peer's area right after
    # that peer went on to its next piece (or call), which must have gone to the other area
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        for i in range(6):
            seed += 1
            size = [20011, 9001, 50][i % 3]
            inputs = [make_input("sum", torch.float32, size, r, seed) for r in range(n)]
            t = inputs[me].clone()
            pz.all_reduce(t, algo="twoshot" if size > 50 else "oneshot", group=gs if i % 2 else g)
            ck.check(f"one core, call {i} ({size})", t, reference(inputs, "sum", torch.float32))
    finally:
        os.sched_setaffinity(0, cpus)
    return ck.result()


@pytest.mark.parametrize("world", [2, 3, 5])
def test_two_shot_in_pieces(world):
    assert_ranks_ok(run_ranks(_rank_two_shot_pieces, world, timeout=90), min_cases=2 * 28 * 3 * 3)


def _rank_auto_adaptive():
    """auto above 2 KiB: rank 0 tries the two-shot and tells the others in its descriptor; every rank
    runs the same algorithm (a mismatch would fail the call), the results equal the ring's (the
    one-shot's at its sizes) bitwise, and only rank 0 keeps the measurements."""
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    ck = Checker()
    def auto_equals(sizes, algo, calls, seed, out_op):
        """auto's results (in place: sum; out of place: out_op) against `algo`'s, bitwise."""
        for i in range(calls):
            count = sizes[i % len(sizes)]
            x = torch.randn(count, generator=torch.Generator().manual_seed(seed * i + me))
            want = x.clone()
            pz.all_reduce(want, algo=algo)
            got = x.clone()
            pz.all_reduce(got)  # auto
            ck.check(f"auto call {i} ({count * 4} B) == {algo} bitwise", got, want)
            out = torch.empty_like(x)
            pz.all_reduce(x, out=out, op=out_op)
            pz.all_reduce(want.copy_(x), op=out_op, algo=algo)
            ck.check(f"auto out= {out_op} call {i} ({count * 4} B) == {algo} bitwise", out, want)

    # classes of 1, 4 and 1 MiB
    auto_equals([(600 << 10) // 4 + 7, (3 << 20) // 4 + 1, (1 << 20) // 4], "ring", 40, 7, "sum")
    # the one-shot's sizes above 2 KiB: the one-shot or the two-shot (its copy made before the arrival
    # serves both; summed in the one-shot's order of ranks), bitwise the one-shot whichever runs, the
    # area streamed after rank 0 chose the two-shot (twoshot_stream_bytes: 4 KiB) or not
    auto_equals([(400 << 10) // 4 + 3], "oneshot", 16, 9, "avg")
    auto_equals([(20 << 10) // 4 + 1], "oneshot", 16, 11, "max")
    auto_equals([(4 << 10) // 4], "oneshot", 16, 13, "sum")  # 4 KiB: measured, in its own class
    auto_equals([(2 << 10) // 4], "oneshot", 4, 15, "sum")  # 2 KiB: the one-shot, not measured
    state = pz.comm.resolve_group(None).backend.comm.adapt_state()
    if me == 0:
        # a class per size and form (in place or out of place), each measured
        sizes = [4 << 10, 32 << 10, 512 << 10, 1 << 20, 4 << 20]
        if sorted(state) != [(b, f) for b in sizes for f in (False, True)] \
                or any(s["explored"] < 1 for s in state.values()) \
                or [state[k]["other"] for k in sorted(state)] != [o for o in ["oneshot"] * 3 + ["ring"] * 2
                                                                  for _ in range(2)]:
            ck.fail(f"rank 0's adaptive state: {state}")
        ck.cases += 1
    elif state:
        ck.fail(f"rank {me} keeps adaptive state: {state}")
    # adaptive=False: auto is the ring, nothing measured
    fixed = pz.new_group(range(n), options=pz.Options(adaptive=False))
    x = torch.ones((1 << 20) // 4)
    for _ in range(6):
        pz.all_reduce(x, group=fixed)
    ck.check("adaptive=False all_reduce", x, torch.full_like(x, float(n) ** 6))
    if fixed.backend.comm.adapt_state():
        ck.fail("adaptive=False measured")
    return ck.result()


@pytest.mark.parametrize("world", [2, 3])
def test_auto_between_ring_and_two_shot(world):
    assert_ranks_ok(run_ranks(_rank_auto_adaptive, world, timeout=90), min_cases=80)


def _rank_auto_in_pieces():
    """auto at the ring's sizes goes in pieces, each run by the ring or the two-shot as rank 0 says after
    the piece before (its plan word): any mix of the two, and of short and long ring pieces, is bitwise the
    ring, in every dtype and op, with uneven chunks, in and out of place, with a rank running late, and with
    every rank on one core."""
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    ck = Checker()
    # pieces of twoshot_bytes (the area; auto's pieces are an eighth of the message, at most the area)
    g, gs = _pieces_matrix(ck, 8192, None, lambda per, es: [5 * n * per + n - 1, 3 * n * per + 1], 95_000)
    # random floats, where the order of a sum shows: bitwise the ring, call after call (rank 0's
    # tries mix the algorithms within calls); a rank sleeping in some calls makes pieces leap
    for i in range(24):
        dtype, op = FLOATS[i % len(FLOATS)], ("sum", "avg", "prod")[i % 3]
        x = torch.randn(40_009 + i, generator=torch.Generator().manual_seed(3000 * i + me)).to(dtype)
        a, b = x.clone(), x.clone()
        pz.all_reduce(a, op=op, algo="ring", group=g)
        if i % 4 == 1 and me == i % n:
            time.sleep(0.005)
        pz.all_reduce(b, op=op, group=g)
        ck.check(f"auto in pieces == ring bitwise, call {i}, {dtype}, {op}", b, a)
    state = g.backend.comm.adapt_state()
    if me == 0:
        if not state or sum(s["mixed"] for s in state.values()) < 1:
            ck.fail(f"no call mixed the algorithms: {state}")
        if sum(s["mixed_long"] for s in state.values()) < 1:  # the two-shot's pieces and a long ring piece
            ck.fail(f"no call mixed the two-shot with a long ring piece: {state}")
        ck.cases += 1
    elif state:
        ck.fail(f"rank {me} keeps adaptive state: {state}")
    # every rank on one core: a rank reads the plan word (and the areas) only when it runs
    cpus = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {min(cpus)})
    try:
        for i in range(6):
            x = torch.randn(20_011, generator=torch.Generator().manual_seed(7000 * i + me))
            a, b = x.clone(), x.clone()
            pz.all_reduce(a, algo="ring", group=gs)
            pz.all_reduce(b, group=gs)
            ck.check(f"one core, auto in pieces == ring bitwise, call {i}", b, a)
    finally:
        os.sched_setaffinity(0, cpus)
    return ck.result()


@pytest.mark.parametrize("world", [2, 3, 5])
def test_auto_in_pieces_mixes_ring_and_two_shot_bitwise(world):
    assert_ranks_ok(run_ranks(_rank_auto_in_pieces, world, timeout=90), min_cases=360)


CLS, UNIT_NS = 8, 50_000  # the 1 MiB class; a call of cost 1.0 takes 50 us (the calm ring's 1 MiB piece)


def _simulate(cost, calls, gap_ns=lambda i: 0, after_twoshot=None):
    """Drive auto's controller (csrc/shm_adapt.h) for the 1 MiB class with per-call costs cost(i, twoshot)
    (a call of cost c takes c * UNIT_NS), call i coming gap_ns(i) after the one before ended; a ring call
    right after a two-shot call costs after_twoshot(i) if given; returns the algorithm it picked at each
    call (True: two-shot) and the controller."""
    from pyzero import _C

    a, picks, now = _C.AdaptTwoShot(), [], 10**9
    for i in range(calls):
        two = a.want_twoshot(CLS)
        c = after_twoshot(i) if after_twoshot and not two and picks and picks[-1] else cost(i, two)
        picks.append(two)
        now += gap_ns(i) + int(c * UNIT_NS)
        a.observe(CLS, two, c * UNIT_NS / (1 << 20), now)
    return picks, a


def test_auto_controller_keeps_the_faster_and_follows_a_mode_change():
    from pyzero import _C

    for b in (600 << 10, 1 << 20, (1 << 20) + 1, 3 << 20, 4 << 20, (4 << 20) + 1, (4 << 10) + 1, 8 << 10,
              (8 << 10) + 1, 20 << 10):
        assert _C.AdaptTwoShot.size_class(b) == (b - 1).bit_length() - 1 - 11, b
    assert _C.AdaptTwoShot.size_class(1) == _C.AdaptTwoShot.size_class(2 << 10) == 0
    assert _C.AdaptTwoShot.size_class(4 << 10) == 0 and _C.AdaptTwoShot.size_class((4 << 10) + 1) == 1
    # fast mode throughout (the ring twice as fast): tries only, ever rarer
    picks, a = _simulate(lambda i, two: 2.0 if two else 1.0, 3000)
    assert a.switches(CLS) == 0 and 7 <= a.explored(CLS) <= 20 and sum(picks) <= 70, (a.explored(CLS), sum(picks))
    assert sum(picks[1000:]) <= 3 * (2000 // 256 + 1)  # a try of 3 calls every 256 calls at most
    # slow mode from the start, where a fifth of the ring's calls still run fast: the two-shot
    # within the first tries, and kept
    picks, a = _simulate(lambda i, two: 5.0 if two else (1.0 if i % 5 == 0 else 10.0), 2000)
    first = picks.index(True)
    assert first <= 3 and all(picks[first + 1:first + 8]) and sum(picks[100:]) >= 0.97 * 1900, sum(picks[100:])
    # fast, then slow from call 400, then fast again from call 1000
    def cost(i, two):
        slow = 400 <= i < 1000
        return (5.0 if slow else 2.0) if two else (10.0 if slow else 1.0)

    picks, a = _simulate(cost, 1600)
    assert sum(picks[300:400]) <= 4  # fast: the ring
    to_two = picks.index(True, 400)  # the ring's calls got 10x slower, two in a row: a leap, the two-shot tried
    assert to_two == 402 and all(picks[402:407]) and sum(picks[to_two:1000]) >= 0.95 * (1000 - to_two), to_two
    back = picks.index(False, 1000)
    assert back <= 1000 + 10 and sum(picks[1100:]) <= 10, back  # the two-shot's calls got 2.5x faster: the ring
    assert a.switches(CLS) == 2
    # one call of the ring stalls (10x, and 40x) in the fast mode: a stall, not a leap; the ring goes on
    # and the two-shot is tried only when its turn comes
    calm = _simulate(lambda i, two: 2.0 if two else 1.0, 1000)[0]
    for stall in (10.0, 40.0):
        picks, a = _simulate(lambda i, two: stall if (i == 500 and not two) else (2.0 if two else 1.0), 1000)
        assert picks == calm and a.switches(CLS) == 0, [i for i in range(1000) if picks[i] != calm[i]]
    # two calls in a row stall: taken for a leap, so the two-shot is tried at once and wins against the
    # stalled calls; the ring is tried again two calls later and is back
    picks, a = _simulate(lambda i, two: 10.0 if (i in (500, 501) and not two) else (2.0 if two else 1.0), 1000)
    assert picks[500:513] == [False] * 2 + [True] * 5 + [False] * 6 and a.switches(CLS) == 2, picks[500:513]
    assert sum(picks[513:]) <= 3 * (487 // 16 + 1)  # then tries only, as before the stall
    # the two-shot in use and the ring 5x slower: each later try of the ring ends at its warm-up call, over 4x
    # the two-shot ([Note: how the ring is tried])
    picks, a = _simulate(lambda i, two: 1.0 if two else 5.0, 2000)
    first = picks.index(True)
    assert first <= 4 and a.switches(CLS) == 1 and picks[first:].count(False) == a.explored(CLS) - 1 >= 8, \
        (first, picks[first:].count(False), a.explored(CLS))
    # ... and where the ring runs 3x slower, its warm-up call is no measure: a try ends after it and its first
    # counted call, over 2x the two-shot
    picks, a = _simulate(lambda i, two: 1.0 if two else 3.0, 2000)
    first = picks.index(True)
    assert first <= 4 and a.switches(CLS) == 1 and picks[first:].count(False) == 2 * (a.explored(CLS) - 1) >= 16, \
        (first, picks[first:].count(False), a.explored(CLS))
    # the ring slows 2.5x from call 600 (under a jump, so its average follows): once its recent calls
    # run slower than the two-shot was last measured, the two-shot is tried and kept
    picks, a = _simulate(lambda i, two: 2.0 if two else (2.5 if i >= 600 else 1.0), 1000)
    assert sum(picks[400:600]) <= 2 * 3, sum(picks[400:600])  # tries only (at most one every 256 calls, 3 calls)
    to_two = picks.index(True, 600)
    assert to_two <= 610 and sum(picks[to_two:]) >= 0.95 * (1000 - to_two), (to_two, sum(picks[to_two:]))
    # ... and where it slows 3.5x in two of three calls (a fast call between resets the jumps, and 3.5x
    # is no leap): the two-shot too
    picks, a = _simulate(lambda i, two: 2.0 if two else (3.5 if i >= 600 and i % 3 else 1.0), 1000)
    to_two = picks.index(True, 600)
    assert to_two <= 620 and sum(picks[to_two:]) >= 0.9 * (1000 - to_two), (to_two, sum(picks[to_two:]))


def test_auto_controller_retries_a_measure_gone_stale_in_time():
    """[Note: stale measurement]: the other algorithm's last measure expires in time, not only in calls."""

    def collapsed_until(end):  # the ring 10x (collapsed) before call `end`, then calm; the two-shot 2x
        return lambda i, two: 2.0 if two else (10.0 if i < end else 1.0)

    # dense calls, the two-shot in use through the collapse; at `end`, after 150 ms of other sizes' calls
    # (a gap in this class), the ring is calm again. By the count of calls it would be tried again up to
    # 256 calls later; its last measure is older than 100 of its collapsed calls (50 ms), so it is tried
    # once a quarter of that count has passed since the last try (at once, or within 64 calls), wins, and
    # stays. A try's first ring call, after the two-shot's, costs 2.5 in either mode (traced: 131-228 us
    # per MiB, a collapsed ring piece 851-1076; [Note: how the ring is tried])
    def warm(i):
        return 2.5

    for end in (1500, 1563, 1641, 1700):
        picks, a = _simulate(collapsed_until(end), end + 300, lambda i: 150_000_000 if i == end else 0, warm)
        assert sum(picks[200:end]) >= 0.97 * (end - 200), sum(picks[200:end])
        back = picks.index(False, end)
        assert back <= end + 65 and sum(picks[back:]) <= 6 * 3, (end, back, sum(picks[back:]))
        # the lost tries of the collapse (a warm-up and one counted ring call each, 12.5 against the two-shot's
        # 512 in the count's interval of 256 calls) cost at most 3% of its time
        lost = picks[200:end].count(False) // 2
        assert lost * 12.5 <= 0.03 * ((end - 200 - 2 * lost) * 2.0 + lost * 12.5), lost
    # a class called once every 100 ms (a bucket's size, once a step): the ring is back within a quarter
    # of the count's interval (64 calls), where up to 256 calls (25 s) could pass otherwise, and the lost
    # tries of the collapse are few
    for end in (300, 350, 420, 480, 560):
        picks, a = _simulate(collapsed_until(end), end + 200, lambda i: 100_000_000, warm)
        assert sum(picks[20:end]) >= 0.95 * (end - 20), sum(picks[20:end])
        back = picks.index(False, end)
        # (then the two-shot's tries, 3 calls each, at intervals doubling from 4 calls to 64)
        assert back <= end + 65 and sum(picks[back:]) <= 3 * 5, (end, back, sum(picks[back:]))
    # and where the ring is the faster throughout, the two-shot's tries stay rare
    picks, a = _simulate(lambda i, two: 2.0 if two else 1.0, 600, lambda i: 100_000_000)
    assert sum(picks[100:]) <= 0.06 * 500, sum(picks[100:])


def _piece_calls(a, now, calls, pieces, cost):
    """`calls` calls of `pieces` pieces of the 1 MiB class through auto's controller `a`, back to back from
    `now`: `cost(call, two)` a piece's cost (a piece of cost c takes c * UNIT_NS). Returns the time after
    them and, per call, how many of its pieces ran the two-shot."""
    per_call = []
    for call in range(calls):
        n = 0
        for k in range(pieces):
            two = a.want_twoshot(CLS)
            c = cost(call, two)
            n += two
            now += int(c * UNIT_NS)
            a.observe(CLS, two, c * UNIT_NS / (1 << 20), now, k == pieces - 1)
        per_call.append(n)
    return now, per_call


def test_auto_controller_begins_a_due_try_with_a_call():
    """[Note: tries begin with a call]: calls of 2 pieces in bursts of 42 (a benchmark's blocks of one size),
    300 ms apart, the first call of each burst cold (its pieces 250 us slower, either algorithm); the ring
    collapsed (10x) for 5 bursts, then calm (1.0 against the two-shot's 2.6). A try due by time is due at
    the first piece after the pause; begun there it ran on the cold call, lost, and reset the count, burst
    after burst. Begun with the next call, the ring is back within the first calm burst, and stays."""
    from pyzero import _C

    a, now, twoshot_pieces = _C.AdaptTwoShot(), 10**9, []
    for burst in range(30):
        now, per_call = _piece_calls(a, now + 300_000_000, 42, 2, lambda call, two, burst=burst: (
            (2.6 if two else (10.0 if burst < 5 else 1.0)) + (5.0 if call == 0 else 0.0)))
        twoshot_pieces.append(sum(per_call[1:]))
    assert min(twoshot_pieces[1:5]) >= 78, twoshot_pieces  # collapsed: the two-shot (of 82 pieces after the first call)
    assert twoshot_pieces[5] <= 8 and max(twoshot_pieces[6:]) <= 10, twoshot_pieces


def test_auto_controller_keeps_the_two_shots_level_past_a_stalled_try():
    """[Note: a try that meets a stall]: calls of 8 pieces in bursts of 12, 300 ms apart, the first call of
    each burst cold (every piece 5.0, either algorithm: its ring pieces leap and start a try of the two-shot
    there); the ring 1.0, the two-shot 1.6; from burst 10 the ring collapsed (5.0), the two-shot 1.5. The
    cold call's try lost at over 2x the two-shot's level; taken as its level, the collapsed ring stayed in
    use for all of burst 10. Kept as a stall, the two-shot runs from burst 10's second call."""
    from pyzero import _C

    def cost(call, two, collapsed):
        if call == 0:
            return 5.0
        return (1.5 if collapsed else 1.6) if two else (5.0 if collapsed else 1.0)

    a, now, twoshot_pieces = _C.AdaptTwoShot(), 10**9, []
    for burst in range(16):
        if burst == 10:
            switches = a.switches(CLS)
        now, per_call = _piece_calls(a, now + 300_000_000, 12, 8,
                                     lambda call, two, c=burst >= 10: cost(call, two, c))
        twoshot_pieces.append(per_call)
    # fast bursts: the ring, but for the two-shot's tries (3 pieces each), none of them a switch
    assert all(sum(b[1:]) <= 6 for b in twoshot_pieces[2:10]), twoshot_pieces[2:10]
    # collapsed: from each burst's second call the two-shot, but for the ring's tries (a warm-up piece and
    # a counted one, given up on), after one switch
    assert all(min(b[1:]) >= 6 for b in twoshot_pieces[10:]), twoshot_pieces[10:]
    assert a.switches(CLS) == switches + 1, (switches, a.switches(CLS))


def test_auto_controller_takes_a_second_slow_try_of_the_two_shot_as_its_measure():
    """[Note: a try that meets a stall]: one try of the two-shot over 2x its level counts as a stall, not the
    next: calls of 8 pieces, back to back; the ring 1.0 and the two-shot 1.6, then from call 40 the ring
    5.0 and the two-shot 6.0, slower still. The first try there is a stall, the second sets the two-shot's
    measure, and then its tries come at the schedule's doubling intervals; kept at its old measure each
    time, the ring falling behind it would start a try every few pieces."""
    from pyzero import _C

    a = _C.AdaptTwoShot()
    now, twoshot_pieces = _piece_calls(a, 10**9, 40, 8, lambda call, two: 1.6 if two else 1.0)
    stalled, switches = a.stalled(CLS), a.switches(CLS)
    now, slower = _piece_calls(a, now, 100, 8, lambda call, two: 6.0 if two else 5.0)
    twoshot_pieces += slower
    assert a.stalled(CLS) == stalled + 1 and a.switches(CLS) == switches, (a.stalled(CLS), stalled)
    # then tries 3 pieces each, by count and by time (25 ms, doubling while they lose): 8 at most in 98 calls
    assert sum(twoshot_pieces[40:42]) == 6 and sum(twoshot_pieces[42:]) <= 8 * 3, twoshot_pieces[40:]


def test_auto_controller_runs_long_ring_pieces_only_while_the_ring_holds():
    """[Note: long ring pieces]: a ring piece runs long (a whole round of the ring alone) only while the
    ring is in use with no try due and no jump or leap under way, or in a try of the ring past its first
    counted piece (test_auto_controller_tries_the_ring_as_it_runs); never with the two-shot chosen."""
    from pyzero import _C

    def run(cost, calls):
        a, out, now = _C.AdaptTwoShot(), [], 10**9
        for i in range(calls):
            two, long_ = a.want_twoshot(CLS), a.want_long(CLS)
            assert not (two and long_), i
            out.append("t" if two else "L" if long_ else "r")
            c = cost(i, two)
            now += int(c * UNIT_NS)
            a.observe(CLS, two, c * UNIT_NS / (1 << 20), now)
        return "".join(out)

    # the ring twice as fast throughout: long pieces but for the two-shot's tries, after each of which the
    # ring's next piece is long again
    calm = run(lambda i, two: 2.0 if two else 1.0, 1000)
    assert "r" not in calm and calm.count("L") >= 950 and "tL" in calm, calm[:80]
    # one ring piece stalls (10x): the next one runs short, then long again
    stalled = run(lambda i, two: 10.0 if (i == 500 and not two) else (2.0 if two else 1.0), 1000)
    assert calm[500:503] == "LLL" and stalled[:501] == calm[:501] and stalled[501:503] == "rL", stalled[495:510]
    # the ring 12x slower from piece 400 (a leap: the two-shot tried at once): the second slow piece short,
    # then the two-shot; the ring's later tries, given up on at their first counted piece (over 2x the
    # two-shot), short, and none long while the two-shot holds
    slow = run(lambda i, two: (5.0 if two else 12.0) if i >= 400 else (2.0 if two else 1.0), 1000)
    assert slow[400:403] == "Lrt" and "L" not in slow[403:], slow[398:420]
    assert slow[403:].count("r") >= 5, slow[403:].count("r")



def test_auto_controller_tries_the_ring_as_it_runs():
    """[Note: how the ring is tried]: a try of the ring (the two-shot in use) warms it with a piece it does
    not count, counts one short piece, then runs long ones. Costs as traced out of place (per piece, in
    units of 50 us): the ring collapsed 20; come back, its long pieces 1.5, its short ones 2.8, its first
    piece after the two-shot's 4.2; the two-shot 2.8. Judged on short pieces the ring ties the two-shot and
    stays tried; judged as it runs it is back at the first try after the collapse, and stays."""
    from pyzero import _C

    a, now, out, prev = _C.AdaptTwoShot(), 10**9, [], None
    for i in range(1500):
        two, long_ = a.want_twoshot(CLS), a.want_long(CLS)
        assert not (two and long_), i
        if two:
            cost = 2.8
        elif i < 600:
            cost = 1.5 if long_ else 2.8
        elif i < 900:
            cost = 20.0
        else:
            cost = 4.2 if prev == "t" else 1.5 if long_ else 2.8
        out.append("t" if two else "L" if long_ else "r")
        prev = out[-1]
        now += int(cost * UNIT_NS)
        a.observe(CLS, two, cost * UNIT_NS / (1 << 20), now)
    seq = "".join(out)
    assert seq[600:900].count("t") >= 0.95 * 300 and "L" not in seq[605:900], seq[600:700]
    # collapsed: each try of the ring is its warm-up piece alone, given up on (over 4x the two-shot)
    tries = seq[605:900].split("t")
    assert all(len(run) in (0, 1) for run in tries) and seq[605:900].count("r") >= 3, seq[605:900]
    # the first try after the collapse wins (no try of the ring lost after it): within the count's interval
    # (256 pieces, dense calls), then tries of the two-shot only
    back = seq.index("rrLL", 900)
    assert "r" not in seq[900:back] and back <= 900 + 256 + 2, (back, seq[900:back + 10])
    assert seq[back:].count("t") <= 3 * 5, seq[back:]  # (tries of the two-shot 16, 32, 64, 128, 256 pieces apart)
    assert seq[back + 4:].count("L") >= 0.95 * (1500 - back - 4), seq[back:]


# 16, 32, 64 and 128 KiB: bytes, the one-shot's and the two-shot's us a call (fast mode, slow mode)
SWEEP_SMALL = [(16 << 10, (5, 15), (7, 6)), (32 << 10, (7, 25), (10, 9)), (64 << 10, (11, 40), (15, 14)),
               (128 << 10, (20, 70), (30, 22))]


def _big_us(slow, two, after_two):
    """_sweep's 1 MiB call in us (fast / slow mode): the ring 53 / 800, the two-shot 100 / 95, a ring call
    right after a two-shot call 200 in either (`after_two`: ring calls since the two-shot's, 1 the first)."""
    return (95 if slow else 100) if two else (200 if after_two == 1 else (800 if slow else 53))


def _burst(a, now, cls, nbytes, us_of, calls=26):
    """A burst of `calls` calls of `nbytes` in class `cls` through auto's controller `a`, 1 s after `now`:
    `us_of(two, since_two)` a call's us (`since_two`: the ring's calls since the two-shot's, 1 the first).
    Returns the time after it and how many of its calls ran the ring."""
    now += 10**9
    since_two = ring = 0
    for _ in range(calls):
        two = a.want_twoshot(cls)
        since_two = 0 if two else since_two + 1
        ring += not two
        us = us_of(two, since_two)
        now += int(us * 1000)
        a.observe(cls, two, us * 1000 / nbytes, now)
    return now, ring


def _sweep(small, rounds=30, slow=range(5, 15), burst=26, big_us=_big_us):
    """A benchmark's sweep through auto's controller: each round a burst of calls of each of the one-shot's
    sizes in `small` (SWEEP_SMALL's form), then one of 1 MiB (the ring's; its us a call `big_us`), bursts 1 s
    apart; the machine in the slow mode in rounds `slow`. Returns, per round, the 1 MiB calls that ran the
    ring, and the controller."""
    from pyzero import _C

    a, now, ring_calls = _C.AdaptTwoShot(), 10**9, []
    for r in range(rounds):
        s = r in slow
        for nbytes, one, two_us in small:
            now, _ = _burst(a, now, _C.AdaptTwoShot.size_class(nbytes), nbytes,
                            lambda two, _k, one=one, two_us=two_us: two_us[s] if two else one[s], burst)
        now, n = _burst(a, now, _C.AdaptTwoShot.size_class(1 << 20), 1 << 20,
                        lambda two, k: big_us(s, two, k), burst)
        ring_calls.append(n)
    return ring_calls, a


def test_auto_controller_classes_share_the_machines_mode():
    """[Note: the mode is the machine's]: where smaller classes' tries find the slow mode, the 1 MiB class
    puts its own off (fewer calls of the collapsed ring), up to 4 in a row, and leaves the two-shot in the
    round the mode ends, as it does alone (its first burst after a pause tries once by time)."""
    from pyzero import _C

    big = _C.AdaptTwoShot.size_class(1 << 20)
    alone, a1 = _sweep([])
    shared, a2 = _sweep(SWEEP_SMALL)
    # the fast mode: the ring (but for the two-shot's tries), alike; in the slow mode's first round both
    # leave the ring
    assert alone[:6] == shared[:6] and min(alone[:5]) >= 19 and alone[5] <= 6, (alone, shared)
    # later slow rounds: alone, its tries run the ring (a warm-up call and a collapsed one each); with the
    # smaller classes, it puts them off
    assert sum(alone[6:15]) >= 8 and sum(shared[6:15]) <= sum(alone[6:15]) // 2, (alone, shared)
    assert a2.tries_put_off(big) >= 4 and a1.tries_put_off(big) == 0, (a1.tries_put_off(big), a2.tries_put_off(big))
    # the mode gone (round 15): the ring is back in that round, with the smaller classes and alone
    assert shared[15] >= 20 and min(shared[16:]) >= 23, (alone, shared)
    assert alone[15] >= 20 and min(alone[16:]) >= 23, (alone, shared)
    # a smaller class whose two-shot wins by over 2x for its own reasons (its tries all give up) holds the
    # 1 MiB class on the two-shot after the slow mode for 4 of its due tries at most, not for good
    ring_calls, a = _sweep([(64 << 10, (30, 30), (10, 10))], rounds=40)
    sm = _C.AdaptTwoShot.size_class(64 << 10)
    assert a.switches(sm) == 1 and 1 <= a.tries_put_off(big) <= 8, (a.switches(sm), a.tries_put_off(big))
    back = next(r for r in range(15, 40) if ring_calls[r] >= 20)
    assert back <= 15 + 8 and min(ring_calls[back + 1:]) >= 23, ring_calls
    # [Note: a class is a size and a form]: after the slow mode the two-shot runs at 190 (95 in it), and the
    # ring's first 3 calls after it at 140. In the round the mode ends, a smaller class wins a try of the
    # one-shot; the 1 MiB class's try then, judged against its last 16 calls (most of them the slow mode's),
    # lost (the ring in 16 calls of that round); judged against its last 3, run after the pause, it wins
    def slower_after(slow, two, after_two):
        return (95 if slow else 190) if two else (800 if slow else (140 if after_two <= 3 else 53))

    ring_calls, _ = _sweep(SWEEP_SMALL, big_us=slower_after)
    assert ring_calls[15] >= 20 and min(ring_calls[16:]) >= 23, ring_calls


def _sweep_forms(rounds=12, slow=range(3, 7), burst=26, cls_of=None):
    """A benchmark's rounds at 1 MiB through auto's controller: each round a burst of out-of-place calls, then
    one of in-place calls, bursts 1 s apart; the machine in the slow mode in rounds `slow`. Per call, in us
    (as traced in a full sweep, rounded): slow mode, the ring 800 either form, the two-shot 90
    in place, 100 out of place; fast mode, the two-shot 150 / 190, the ring 50 / 60, but 70 / 140 in its
    first 3 calls after the two-shot's. `cls_of(out_of_place)`: the class a call is measured in. Returns,
    per round, the calls that ran the ring in each form (out of place, in place), and the controller."""
    from pyzero import _C

    a, now, ring_calls = _C.AdaptTwoShot(), 10**9, []
    cls_of = cls_of or (lambda oop: _C.AdaptTwoShot.class_of(1 << 20, oop))
    for r in range(rounds):
        s, n = r in slow, []
        for oop in (True, False):
            def us(two, since_two, oop=oop):
                if two:
                    return (100 if oop else 90) if s else (190 if oop else 150)
                return 800 if s else ((140 if oop else 70) if since_two <= 3 else (60 if oop else 50))

            now, ring = _burst(a, now, cls_of(oop), 1 << 20, us, burst)
            n.append(ring)
        ring_calls.append(tuple(n))
    return ring_calls, a


def test_auto_controller_judges_a_try_by_its_own_form_and_time():
    """[Note: a class is a size and a form]: in place and out of place, the two algorithms cost differently,
    and after the slow mode the two-shot runs slower than in it. Each form in its own class, measured and
    tried on its own calls, is back on the ring in the first burst after the mode ends. (A try judged
    against the slow mode's calls: test_auto_controller_classes_share_the_machines_mode.)"""
    from pyzero import _C

    ring, a = _sweep_forms()
    # fast: the ring (but for the first calls and the two-shot's tries); slow: the two-shot (but for the
    # ring's tries, a warm-up call and a counted one each, or the warm-up alone where it ran collapsed)
    assert min(ring[0]) >= 20 and all(min(r) >= 23 for r in ring[1:3]) and all(max(r) <= 6 for r in ring[3:7]), ring
    # back in half the calls of the first fast round or more, both forms, then in all but the two-shot's tries
    assert min(ring[7]) >= 13 and all(min(r) >= 23 for r in ring[8:]), ring
    for oop in (True, False):  # each form in its own class: to the two-shot and back
        assert a.switches(_C.AdaptTwoShot.class_of(1 << 20, oop)) == 2, (oop, ring)
    assert _C.AdaptTwoShot.class_of(1 << 20, True) != _C.AdaptTwoShot.class_of(1 << 20, False)
    assert _C.AdaptTwoShot.class_of(1 << 20, False) == _C.AdaptTwoShot.size_class(1 << 20)
    # one class for both forms: each burst after a pause tries by time once its first calls have run, and the
    # try is judged against them (of the burst's own form), so here it is back too
    shared, _ = _sweep_forms(cls_of=lambda oop: _C.AdaptTwoShot.size_class(1 << 20))
    assert min(shared[7]) >= 20 and min(shared[8]) >= 23, shared


def test_auto_controller_tries_once_in_a_burst_after_a_pause():
    """[Note: stale measurement]: a class called in bursts (a benchmark's blocks, 1 s apart) tries the other
    algorithm by time once in a burst after a pause, once its first calls have run, however many calls the
    schedule's count has reached while its tries lost. Counting calls alone (a quarter of up to 256 since the
    last try), the ring came back 1-3 bursts after a slow mode of 4-6 bursts, by how the bursts fell."""
    for burst in (22, 25, 27, 30):
        for slow in (range(3, 7), range(3, 8), range(3, 9)):
            ring, _ = _sweep_forms(rounds=slow.stop + 2, slow=slow, burst=burst)
            # the first fast burst: the ring from its 5th call or so (the try begins after 4 calls)
            assert min(ring[slow.stop]) >= burst - 6 and min(ring[slow.stop + 1]) >= burst - 4, (burst, slow, ring)


def test_auto_controller_keeps_a_leap_to_the_two_shot_in_the_slow_mode():
    """[Note: the mode is the machine's]: after a leap to the two-shot the ring is tried again 2 calls later
    (two stalled calls look like a leap), but not where the slow mode is the latest any class found: there
    it is tried on the schedule (16 calls later), where it costs a collapsed call. Whole calls, the ring 1.0
    and the two-shot 2.0, then the ring collapsed (10.0) in both classes from call 100."""
    from pyzero import _C

    two_mib = _C.AdaptTwoShot.size_class(2 << 20)

    def run(with_other):
        a, now, picks = _C.AdaptTwoShot(), 10**9, []
        for i in range(140):
            for c in ([two_mib] if with_other else []) + [CLS]:
                two = a.want_twoshot(c)
                cost = 2.0 if two else (10.0 if i >= 100 else 1.0)
                now += int(cost * UNIT_NS)
                a.observe(c, two, cost * UNIT_NS / (1 << 20), now)
                if c == CLS:
                    picks.append(two)
        return picks, a

    alone, a1 = run(False)
    other, a2 = run(True)
    # both leap at the collapse's second call and switch; alone, the ring's try 2 calls later is its
    # warm-up call alone (collapsed: over 4x the two-shot)
    for picks, a in ((alone, a1), (other, a2)):
        assert picks[100:102] == [False, False] and all(picks[102:105]) and a.switches(CLS) == 1, picks[98:130]
    assert alone[105:108] == [True, True, False] and all(alone[108:122]), alone[100:125]
    # after the 2 MiB class's leap and its given-up try of the ring, the 1 MiB class's leap is the slow mode:
    # no try of the ring in the next 15 calls
    assert all(other[102:120]), other[100:125]


# ---------------------------------------------------------------------------
# fp32 accumulation of fp16/bf16 sums


def _rank_low_precision_accumulation():
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    ck = Checker()
    # bf16: 256 + 3 x 0.75 = 258.25 -> 258 (ulp 2); adding in bf16 would stay at 256.
    # fp16: 2048 + 3 x 0.75 = 2050.25 -> 2050 (ulp 2); adding in fp16 would stay at 2048.
    cases = [(torch.bfloat16, 256.0, 258.0), (torch.float16, 2048.0, 2050.0)]
    for dtype, big, want in cases:
        for algo in ALGOS:
            for size in [1, 5, 70001]:
                if algo == "oneshot" and not oneshot_ok(size * 2):
                    continue
                # the big value sits on a different rank per element, so every
                # ring position sees it first, last and in between
                idx = torch.arange(size)
                t = torch.where(idx % n == me, torch.tensor(big), torch.tensor(0.75)).to(dtype)
                pz.all_reduce(t, op="sum", algo=algo)
                ck.check(f"{dtype} sum of {big} + {n - 1} x 0.75, size={size}, algo={algo}", t,
                         torch.full((size,), want, dtype=dtype))
            # the same through reduce_scatter
            t = torch.where(torch.arange(4 * n) % n == me, torch.tensor(big), torch.tensor(0.75)).to(dtype)
            out = torch.empty(4, dtype=dtype)
            pz.reduce_scatter(out, t, op="sum", algo=algo)
            ck.check(f"{dtype} reduce_scatter sum, algo={algo}", out, torch.full((4,), want, dtype=dtype))
    return ck.result()


def test_low_precision_sums_accumulate_in_fp32():
    # sanity of the premise: pairwise bf16 adds lose the 0.75s
    x = torch.tensor(256.0, dtype=torch.bfloat16)
    for _ in range(3):
        x = x + torch.tensor(0.75, dtype=torch.bfloat16)
    assert x.item() == 256.0
    results = run_ranks(_rank_low_precision_accumulation, 4, timeout=60)
    assert_ranks_ok(results)


# ---------------------------------------------------------------------------
# reduce_scatter, all_gather, broadcast, barrier, send/recv


def uneven_counts(n):
    """Per-rank counts with zeros, for a group of n."""
    if n == 1:
        return [[0], [7]]
    if n == 2:
        return [[0, 5], [3, 0], [0, 0], [7, 1031], [70001, 3]]
    if n == 3:
        return [[0, 4, 1], [5, 0, 0], [0, 0, 0], [2, 3, 1031], [0, 70001, 17]]
    return [[0, 3, 0, 5], [1, 0, 2, 0], [0, 0, 0, 0], [1031, 0, 7, 4099], [70001, 0, 3, 140003]]


def _rank_other_collectives():
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    ck = Checker()
    seed = 10_000

    # reduce_scatter, even counts (out-of-place and the in-place chunk form)
    for algo in ALGOS:
        for dtype in DTYPES:
            esize = torch.tensor([], dtype=dtype).element_size()
            for op in ops_for(dtype):
                for k in [0, 1, 3, 17, 1031]:
                    if algo == "oneshot" and not oneshot_ok(n * k * esize):
                        continue
                    seed += 1
                    inputs = [make_input(op, dtype, n * k, r, seed) for r in range(n)]
                    want = reference(inputs, op, dtype)[me * k:(me + 1) * k]
                    out = torch.full((k,), 99, dtype=dtype)
                    inp = inputs[me].clone()
                    pz.reduce_scatter(out, inp, op=op, algo=algo)
                    what = f"reduce_scatter(n={n}, {dtype}, op={op}, k={k}, algo={algo})"
                    ck.check(what, out, want)
                    ck.check(what + " left inp alone", inp, inputs[me])
                    if k == 17:  # in place: out is this rank's chunk of inp
                        buf = inputs[me].clone()
                        pz.reduce_scatter(buf[me * k:(me + 1) * k], buf, op=op, algo=algo)
                        ck.check(what + " in place", buf[me * k:(me + 1) * k], want)

    # reduce_scatter and all_gather with uneven counts (zeros included)
    for ci, counts in enumerate(uneven_counts(n)):
        total, off = sum(counts), sum(counts[:me])
        for algo in ALGOS:
            for dtype in [torch.float32, torch.bfloat16, torch.int64]:
                esize = torch.tensor([], dtype=dtype).element_size()
                seed += 1
                if not (algo == "oneshot" and not oneshot_ok(total * esize)):
                    inputs = [make_input("sum", dtype, total, r, seed) for r in range(n)]
                    out = torch.full((counts[me],), 99, dtype=dtype)
                    pz.reduce_scatter(out, inputs[me].clone(), op="sum", counts=counts, algo=algo)
                    ck.check(f"reduce_scatter(n={n}, {dtype}, counts={counts}, algo={algo})", out,
                             reference(inputs, "sum", dtype)[off:off + counts[me]])
                # auto with chunks on both sides of the one-shot threshold: see
                # test_all_gather_uneven_counts_ranks_agree_on_algo
                straddles = max(counts) * esize > AG_AUTO_ONESHOT_BYTES >= min(counts) * esize
                if not (algo == "oneshot" and not oneshot_ok(max(counts) * esize)) and not (
                        algo == "auto" and straddles):
                    chunks = [make_input("max", dtype, counts[r], r, seed) for r in range(n)]
                    want = torch.cat(chunks)
                    out = torch.full((total,), 99, dtype=dtype)
                    pz.all_gather(out, chunks[me].clone(), counts=counts, algo=algo)
                    ck.check(f"all_gather(n={n}, {dtype}, counts={counts}, algo={algo})", out, want)
                    out = torch.full((total,), 99, dtype=dtype)
                    out[off:off + counts[me]] = chunks[me]
                    pz.all_gather(out, out[off:off + counts[me]], counts=counts, algo=algo)
                    ck.check(f"all_gather in place(n={n}, {dtype}, counts={counts}, algo={algo})", out, want)

    # all_gather, even counts, out-of-place and in place
    for algo in ALGOS:
        for dtype in DTYPES:
            esize = torch.tensor([], dtype=dtype).element_size()
            for k in [0, 1, 13, 1031, 70001]:
                if algo == "oneshot" and not oneshot_ok(k * esize):
                    continue
                seed += 1
                chunks = [make_input("max", dtype, k, r, seed) for r in range(n)]
                want = torch.cat(chunks)
                out = torch.full((n * k,), 99, dtype=dtype)
                inp = chunks[me].clone()
                pz.all_gather(out, inp, algo=algo)
                ck.check(f"all_gather(n={n}, {dtype}, k={k}, algo={algo})", out, want)
                out = torch.full((n * k,), 99, dtype=dtype)
                out[me * k:(me + 1) * k] = chunks[me]
                pz.all_gather(out, out[me * k:(me + 1) * k], algo=algo)
                ck.check(f"all_gather in place(n={n}, {dtype}, k={k}, algo={algo})", out, want)

    # broadcast from every source
    for algo in ALGOS:
        for dtype in DTYPES:
            esize = torch.tensor([], dtype=dtype).element_size()
            for size in [0, 1, 1031, 70001]:
                if algo == "oneshot" and not oneshot_ok(size * esize):
                    continue
                for src in range(n):
                    seed += 1
                    data = make_input("max", dtype, size, src, seed)
                    t = data.clone() if me == src else torch.full((size,), 99, dtype=dtype)
                    pz.broadcast(t, src=src, algo=algo)
                    ck.check(f"broadcast(n={n}, {dtype}, size={size}, src={src}, algo={algo})", t, data)
    # a large ring broadcast (pipelined chain, many slices)
    data = make_input("max", torch.float32, BIG, n - 1, 1)
    t = data.clone() if me == n - 1 else torch.zeros(BIG)
    pz.broadcast(t, src=n - 1)
    ck.check(f"broadcast(n={n}, float32, size={BIG}, src={n - 1})", t, data)

    # barrier: nobody leaves before everybody entered
    times = []
    for i in range(3):
        time.sleep(0.02 * ((me + i) % n))
        entered = time.monotonic()
        pz.barrier()
        times.append((entered, time.monotonic()))
    w = pz.barrier(async_op=True)
    w.wait()
    ck.cases += 1

    # send/recv around the ring (async sends: a large sync send waits for its receiver)
    if n > 1:
        nxt, prv = (me + 1) % n, (me - 1) % n
        for dtype in DTYPES:
            for size in [0, 1, 1031, 300007]:
                seed += 1
                data = make_input("max", dtype, size, me, seed)
                w = pz.send(data, dst=nxt, async_op=True)
                got = torch.full((size,), 99, dtype=dtype)
                pz.recv(got, src=prv)
                w.wait()
                ck.check(f"recv(n={n}, {dtype}, size={size}) from {prv}", got, make_input("max", dtype, size, prv, seed))
        # several messages to one peer arrive in order; sync sends of small messages
        if me == 0:
            for i in range(5):
                pz.send(torch.full((i + 1,), float(i)), dst=n - 1)
        elif me == n - 1:
            for i in range(5):
                got = torch.empty(i + 1)
                pz.recv(got, src=0)
                ck.check(f"message {i} from rank 0", got, torch.full((i + 1,), float(i)))
        # every rank exchanges with every other rank at once
        works, recvd = [], {}
        for p in range(n):
            if p != me:
                works.append(pz.send(torch.full((257,), float(me * 10 + p)), dst=p, async_op=True))
                recvd[p] = torch.empty(257)
                works.append(pz.recv(recvd[p], src=p, async_op=True))
        for w in works:
            assert w.wait() is True
        for p, got in recvd.items():
            ck.check(f"all-to-all message from {p}", got, torch.full((257,), float(p * 10 + me)))
        # batch_isend_irecv: a ring step (send to next, receive from previous) posted together, twice
        for size in (5, 300007):
            out = torch.full((size,), float(me))
            got = torch.full((size,), -1.0)
            works = pz.batch_isend_irecv([pz.P2POp("send", out, nxt), pz.P2POp("recv", got, prv)])
            assert len(works) == 2
            for w in works:
                w.wait()
            ck.check(f"batch_isend_irecv ring, {size} elements", got, torch.full((size,), float(prv)))

    # several async collectives in flight, then a sync one queued behind them
    ts = [make_input("sum", torch.float32, 100_003, me, 500 + i) for i in range(3)]
    wants = [reference([make_input("sum", torch.float32, 100_003, r, 500 + i) for r in range(n)], "sum",
                       torch.float32) for i in range(3)]
    works = [pz.all_reduce(t, async_op=True) for t in ts]
    small = torch.full((3,), float(me))
    pz.all_reduce(small, op="max")
    for w in works:
        w.wait()
    for i, (t, want) in enumerate(zip(ts, wants)):
        ck.check(f"async all_reduce #{i}", t, want)
    ck.check("sync all_reduce behind async ones", small, torch.full((3,), float(n - 1)))
    res = ck.result()
    res["barrier_times"] = times
    return res


@pytest.mark.parametrize("world", WORLDS)
def test_other_collectives(world):
    results = run_ranks(_rank_other_collectives, world, timeout=120)
    assert_ranks_ok(results, min_cases=100)
    for i in range(3):
        last_entry = max(r.value["barrier_times"][i][0] for r in results)
        first_exit = min(r.value["barrier_times"][i][1] for r in results)
        assert first_exit >= last_entry, f"barrier {i}: a rank left before every rank entered"


# ---------------------------------------------------------------------------
# Subgroups


def _rank_subgroups():
    pz.init(timeout=60)
    me = pz.get_rank()
    ck = Checker()
    g13 = pz.new_group([1, 3])
    g02 = pz.new_group([0, 2])
    g20 = pz.new_group([2, 0])
    g012 = pz.new_group([0, 1, 2])
    for g, ranks in [(g13, (1, 3)), (g02, (0, 2)), (g20, (2, 0)), (g012, (0, 1, 2))]:
        if g.ranks != ranks or g.size != len(ranks) or g.rank != (ranks.index(me) if me in ranks else -1):
            ck.fail(f"group {ranks}: ranks={g.ranks} size={g.size} rank={g.rank}")

    def data(r, size=1031, seed=0):
        return make_input("sum", torch.float32, size, r, seed)

    # the pairs work concurrently on disjoint ranks
    for g, ranks in [(g13, [1, 3]), (g02, [0, 2])]:
        if me not in ranks:
            continue
        for algo in ALGOS:
            for op in ["sum", "max", "avg"]:
                t = data(me)
                pz.all_reduce(t, op=op, group=g, algo=algo)
                ck.check(f"all_reduce in {ranks}, op={op}, algo={algo}", t,
                         reference([data(r) for r in ranks], op, torch.float32))
            t = torch.zeros(100_000) if me != ranks[-1] else data(me, 100_000)
            pz.broadcast(t, src=ranks[-1], group=g, algo=algo if algo != "oneshot" else "auto")
            ck.check(f"broadcast in {ranks} from global rank {ranks[-1]}", t, data(ranks[-1], 100_000))
        if me == ranks[0]:
            pz.send(data(me, 77, 5), dst=ranks[1], group=g)
        else:
            got = torch.empty(77)
            pz.recv(got, src=ranks[0], group=g)
            ck.check(f"recv in {ranks} from global rank {ranks[0]}", got, data(ranks[0], 77, 5))

    # group order [2, 0]: group rank 0 is global rank 2, so its chunk comes first
    if me in (2, 0):
        for algo in ALGOS:
            out = torch.empty(2 * 13)
            pz.all_gather(out, data(me, 13), group=g20, algo=algo)
            ck.check(f"all_gather in [2, 0], algo={algo}", out, torch.cat([data(2, 13), data(0, 13)]))
            counts = [3, 10]  # group rank 0 (global 2) gets 3
            mine = counts[g20.rank]
            out = torch.empty(mine)
            pz.reduce_scatter(out, data(me, 13, 1), counts=counts, group=g20, algo=algo)
            full = reference([data(2, 13, 1), data(0, 13, 1)], "sum", torch.float32)
            ck.check(f"reduce_scatter in [2, 0], algo={algo}", out, full[:3] if me == 2 else full[3:])
        t = data(0, 50) if me == 0 else torch.zeros(50)
        pz.broadcast(t, src=0, group=g20)
        ck.check("broadcast in [2, 0] from global rank 0", t, data(0, 50))

    # three of four ranks; rank 3 does nothing meanwhile
    if me in (0, 1, 2):
        for algo in ALGOS:
            for size in [1, 1031, 200_003]:
                if algo == "oneshot" and not oneshot_ok(size * 4):
                    continue
                t = data(me, size, 2)
                pz.all_reduce(t, group=g012, algo=algo)
                ck.check(f"all_reduce in [0, 1, 2], size={size}, algo={algo}", t,
                         reference([data(r, size, 2) for r in (0, 1, 2)], "sum", torch.float32))
        pz.barrier(group=g012)
        # every rank's few numbers (the agreement helper): row r is group rank r's, in the group's order
        ck.check("every_rank in [0, 1, 2]", comm.every_rank(torch.tensor([me, 7 - me]), torch.int32, group=g012),
                 torch.tensor([[r, 7 - r] for r in (0, 1, 2)], dtype=torch.int32))
    if me in (2, 0):
        ck.check("every_rank in [2, 0]", comm.every_rank([me * 0.5, 1e300], torch.float64, group=g20),
                 torch.tensor([[r * 0.5, 1e300] for r in (2, 0)], dtype=torch.float64))

    # the world is unaffected
    t = data(me, 1031, 3)
    pz.all_reduce(t)
    ck.check("world all_reduce after the subgroups", t, reference([data(r, 1031, 3) for r in range(4)], "sum",
                                                                   torch.float32))
    return ck.result()


def test_subgroups():
    results = run_ranks(_rank_subgroups, 4, timeout=90)
    assert_ranks_ok(results)


# ---------------------------------------------------------------------------
# Async overlap


OVERLAP_N = 32 << 20  # 32M floats


def _rank_async_overlap():
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    x = torch.full((OVERLAP_N,), float(me + 1))
    pz.barrier()
    t0 = time.perf_counter()
    work = pz.all_reduce(x, async_op=True)
    launch_s = time.perf_counter() - t0
    # pure-Python work (holding the GIL) and a torch op, interleaved with polls
    chunks_done_while_pending = 0
    chunks = 0
    y = torch.arange(1000, dtype=torch.float64)
    while True:
        s = 0
        for i in range(2000):
            s += i * i
        y = (y * 1.0001).sqrt()
        chunks += 1
        if work.is_completed():
            break
        chunks_done_while_pending += 1
        if time.perf_counter() - t0 > 30:
            break
    assert s == sum(i * i for i in range(2000))
    assert work.wait() is True
    total_s = time.perf_counter() - t0
    assert work.is_completed()
    want = float(n * (n + 1) // 2)
    ok = bool((x == want).all())
    return {"launch_s": launch_s, "total_s": total_s, "pending_chunks": chunks_done_while_pending,
            "chunks": chunks, "ok": ok}


def test_async_overlap():
    results = run_ranks(_rank_async_overlap, 2, timeout=90)
    for r in results:
        v = r.value
        assert v["ok"], f"rank {r.rank}: wrong all_reduce result"
        # Python work finished (several times) while the collective was still running
        assert v["pending_chunks"] >= 1, f"rank {r.rank}: no Python work completed before the all_reduce: {v}"
        # the call itself returns at once; loose bound (the all_reduce of 128 MB takes far longer)
        assert v["launch_s"] < 0.5 * v["total_s"] + 0.05, f"rank {r.rank}: async launch blocked: {v}"


# ---------------------------------------------------------------------------
# comm_stats


def _rank_comm_stats():
    pz.init(timeout=60)
    n, me = pz.get_world_size(), pz.get_rank()
    pz.comm_stats(reset=True)
    out = {}
    N = 1200 * 7  # divisible by 1..4
    pz.all_reduce(torch.ones(N), algo="ring")
    out["ring_even"] = pz.comm_stats(reset=True)
    M = 1000 * 7 + 1  # not divisible by 2, 3, 4
    pz.all_reduce(torch.ones(M), algo="ring")
    out["ring_uneven"] = pz.comm_stats(reset=True)
    k = 1500
    pz.all_gather(torch.empty(n * k), torch.ones(k), algo="ring")
    out["ag_ring"] = pz.comm_stats(reset=True)
    pz.all_reduce(torch.ones(100), algo="oneshot")
    pz.all_reduce(torch.ones(100), algo="oneshot")
    pz.barrier()
    out["oneshot"] = pz.comm_stats(reset=False)
    out["again"] = pz.comm_stats(reset=True)
    out["after_reset"] = pz.comm_stats()
    pz.reduce_scatter(torch.empty(k), torch.ones(n * k), algo="ring")
    pz.broadcast(torch.ones(k), src=0, algo="ring")
    out["rs_bc"] = pz.comm_stats(reset=True)
    if n > 1:
        if me == 0:
            pz.send(torch.ones(10), dst=1)
        elif me == 1:
            pz.recv(torch.empty(10), src=0)
        out["p2p"] = pz.comm_stats(reset=True)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_comm_stats(world):
    n = world
    results = run_ranks(_rank_comm_stats, n, timeout=60)
    for res in results:
        r, s = res.rank, res.value
        N = 1200 * 7
        ar = s["ring_even"]["all_reduce"]
        assert ar["calls"] == 1 and ar["elements"] == N
        assert ar["sent_bytes"] == 2 * (n - 1) * N // n * 4, (r, ar)
        # uneven chunks: exactly 2N - c[r] - c[r+1] elements (the chunks this rank does not send twice)
        M = 1000 * 7 + 1
        c = even_split(M, n)
        ar = s["ring_uneven"]["all_reduce"]
        want = 0 if n == 1 else (2 * M - c[r] - c[(r + 1) % n]) * 4
        assert ar["sent_bytes"] == want, (r, ar, want)
        assert abs(ar["sent_bytes"] - 2 * (n - 1) / n * M * 4) <= 2 * 4, (r, ar)
        k = 1500
        ag = s["ag_ring"]["all_gather"]
        assert ag == {"calls": 1, "elements": n * k, "sent_bytes": (n - 1) * k * 4}, (r, ag)
        assert s["ag_ring"]["all_reduce"] == {"calls": 0, "elements": 0, "sent_bytes": 0}
        one = s["oneshot"]
        assert one["all_reduce"] == {"calls": 2, "elements": 200, "sent_bytes": 2 * 100 * 4 * (n - 1)}, (r, one)
        assert one["barrier"]["calls"] == 1
        assert s["again"] == one  # reset=False left the counters alone
        assert all(v == {"calls": 0, "elements": 0, "sent_bytes": 0} for v in s["after_reset"].values())
        rs, bc = s["rs_bc"]["reduce_scatter"], s["rs_bc"]["broadcast"]
        assert rs == {"calls": 1, "elements": n * k, "sent_bytes": (n - 1) * k * 4}, (r, rs)
        # chain broadcast: every rank but the last in the chain sends the buffer once
        assert bc["calls"] == 1 and bc["elements"] == k
        assert bc["sent_bytes"] == (k * 4 if r != n - 1 else 0), (r, bc)
        if n > 1:
            p2p = s["p2p"]
            if r == 0:
                assert p2p["send"] == {"calls": 1, "elements": 10, "sent_bytes": 40}
            if r == 1:
                assert p2p["recv"]["calls"] == 1 and p2p["recv"]["elements"] == 10


# ---------------------------------------------------------------------------
# all_gather with uneven counts: every rank must pick the same algorithm


def _rank_all_gather_uneven_algo():
    pz.init(timeout=30)
    n, me = pz.get_world_size(), pz.get_rank()
    # rank 0's chunk (560 KB) is above auto's one-shot limit and above the
    # one-shot cap (512 KiB); the other ranks' chunks are tiny
    assert pz.comm.resolve_group(None).backend.oneshot_bytes == 512 << 10
    counts = [140001] + [3] * (n - 1)
    chunks = [make_input("max", torch.float32, c, r, 3) for r, c in enumerate(counts)]
    out = {}
    for algo in [None, "auto"]:
        buf = torch.zeros(sum(counts))
        try:
            pz.all_gather(buf, chunks[me].clone(), counts=counts, algo=algo)
            out[algo] = "ok" if torch.equal(buf, torch.cat(chunks)) else "wrong result"
        except Exception as e:  # noqa: BLE001
            out[algo] = f"{type(e).__name__}: {e}"
    # forced one-shot is too large for rank 0: every rank must refuse it (none may wait for the others)
    t0 = time.monotonic()
    try:
        pz.all_gather(torch.zeros(sum(counts)), chunks[me].clone(), counts=counts, algo="oneshot")
        out["oneshot"] = "no error"
    except Exception as e:  # noqa: BLE001
        out["oneshot"] = f"{type(e).__name__}: {e}"
    out["oneshot_s"] = time.monotonic() - t0
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_all_gather_uneven_counts_ranks_agree_on_algo(world):
    """all_gather(counts=...) where only some ranks' chunks exceed the one-shot limits.

    auto must choose one algorithm for the whole group (from all counts, which
    every rank knows), not from this rank's own chunk; algo='oneshot' must be
    rejected with ValueError on every rank, not just on the rank with the big chunk.
    """
    results = run_ranks(_rank_all_gather_uneven_algo, world, timeout=60)
    problems = []
    for r in results:
        v = r.value
        for algo in [None, "auto"]:
            if v[algo] != "ok":
                problems.append(f"rank {r.rank}, algo={algo!r}: {v[algo]}")
        if not (v["oneshot"].startswith("ValueError") and "oneshot" in v["oneshot"]):
            problems.append(f"rank {r.rank}, algo='oneshot': expected ValueError, got {v['oneshot']} "
                            f"after {v['oneshot_s']:.2f} s")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------
# An async handle that is dropped must not free the tensors in flight


def _rank_dropped_handle():
    import gc  # noqa: PLC0415

    pz.init(timeout=30)
    n, me = pz.get_world_size(), pz.get_rank()
    k = 8 << 20
    out = torch.zeros(n * k)
    # the input is a temporary and the Work handle is dropped at once: only the
    # library can keep the input alive until the all_gather has finished
    pz.all_gather(out, torch.full((k,), float(me + 1)), async_op=True)
    gc.collect()
    junk = [torch.full((k,), -1.0) for _ in range(4)]  # reuse the freed memory
    pz.barrier()  # queued behind the all_gather: it has finished
    want = torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(k)
    return {"ok": bool(torch.equal(out, want)), "junk": len(junk)}


def test_dropped_async_handle_keeps_tensors_alive():
    results = run_ranks(_rank_dropped_handle, 2, timeout=60, check=False)
    for r in results:
        assert r.exitcode == 0, f"rank {r.rank} exited with {r.exitcode}:\n{r.output[-2000:]}"
        assert r.value["ok"], f"rank {r.rank}: wrong all_gather result"


def _rank_settings(case):
    pz.init(timeout=10)
    r = pz.get_rank()
    if case == "differ":  # rank 0 alone moves the two-shot's area and the one-shot's limit: same segment size
        opts = pz.Options(twoshot_bytes=4 << 20, oneshot_bytes=8 << 20) if r == 0 else pz.Options()
    elif case == "symmetric":  # (the TP ops' fused path on one rank, the ring on the other: both timed out)
        opts = pz.Options(symmetric=False) if r == 0 else pz.Options()
    else:
        opts = pz.Options(oneshot_bytes=0, twoshot_bytes=0)
    try:
        pz.new_group(range(pz.get_world_size()), options=opts)
        made = ("ok", "")
    except ValueError as e:
        made = ("ValueError", str(e))
    t = torch.full((4,), float(r))
    pz.all_reduce(t)  # the world goes on
    return made, t.tolist()


@pytest.mark.parametrize("case", ["differ", "symmetric", "zero_area"])
def test_group_settings_the_ranks_disagree_on_or_that_leave_no_area_are_refused(case):
    """Ranks giving a group different transport settings (a two-shot cut into different pieces read
    partly wrong results on one rank and timed out on the other) raise on every rank, naming the
    setting and each rank's value; oneshot_bytes=twoshot_bytes=0 left no staging area (the two-shot
    then wrote over the point-to-point slots)."""
    for r in run_ranks(_rank_settings, 2, args=(case,), timeout=60):
        (kind, msg), after = r.value
        assert kind == "ValueError", r.value
        if case == "differ":
            assert msg.startswith("options.oneshot_bytes: the ranks of the group set it differently (rank 0: "
                                  "8388608, rank 1: 524288)"), msg
        elif case == "symmetric":
            assert msg.startswith("options.symmetric: the ranks of the group set it differently (rank 0: False, "
                                  "rank 1: True)"), msg
        else:
            assert "oneshot_bytes and twoshot_bytes" in msg and "both 0" in msg, msg
        assert after == [1.0] * 4
