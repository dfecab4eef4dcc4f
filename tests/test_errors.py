"""Errors: bad arguments, mismatched collectives, dead and missing ranks.

Everything that needs pz.init runs inside run_ranks (pz.init in the pytest
process would leave state behind). Rank functions catch what each case
raises and return (exception type, message) pairs; the parent asserts.
"""
import glob
import os
import re
import signal
import time

import pytest
import torch

import pyzero as pz
from pyzero.launch import run_ranks

from outcomes import outcome


def _check_outcomes(results, expected):
    """expected: {case: (exception type name, [substrings of the message])}."""
    problems = []
    for r in results:
        got = r.value["outcomes"]
        for case, (etype, words) in expected.items():
            if case not in got:
                continue  # not run on this rank
            gtype, msg = got[case]
            if gtype != etype:
                problems.append(f"rank {r.rank}, {case}: expected {etype}, got {gtype}: {msg}")
                continue
            for w in words:
                if w not in (msg or ""):
                    problems.append(f"rank {r.rank}, {case}: message does not mention {w!r}: {msg}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------
# Bad arguments: each raises on the calling rank, naming the argument, and
# leaves the group usable (nothing was sent, the sequence did not advance)

BAD_ARGS = {
    # case: (exception, words the message must contain)
    "before_init_all_reduce": ("RuntimeError", ["pz.init"]),
    "before_init_barrier": ("RuntimeError", ["pz.init"]),
    "before_init_new_group": ("RuntimeError", ["pz.init"]),
    "before_init_comm_stats": ("RuntimeError", ["pz.init"]),
    "init_bad_timeout": ("ValueError", ["timeout"]),
    "init_bad_join_timeout": ("ValueError", ["join_timeout", "positive"]),
    "init_nan_timeout": ("ValueError", ["timeout", "nan"]),
    "init_inf_timeout": ("ValueError", ["timeout", "inf"]),
    "init_nan_join_timeout": ("ValueError", ["join_timeout", "nan"]),
    "init_bad_backend": ("ValueError", ["backend"]),
    "init_twice": ("RuntimeError", ["already"]),
    "non_tensor": ("TypeError", ["tensor"]),
    "non_tensor_out": ("TypeError", ["out"]),
    "non_tensor_inp": ("TypeError", ["inp"]),
    "non_contiguous": ("ValueError", ["tensor", "contiguous"]),
    "non_contiguous_inp": ("ValueError", ["inp", "contiguous"]),
    "non_contiguous_out": ("ValueError", ["out", "contiguous"]),
    "sparse": ("TypeError", ["tensor", "dense", "sparse_coo", "to_dense()"]),
    "sparse_csr_out": ("TypeError", ["out", "dense", "sparse_csr", "to_dense()"]),
    "dtype_uint8": ("TypeError", ["tensor", "uint8"]),
    "dtype_complex": ("TypeError", ["tensor", "complex64"]),
    "dtype_bool_broadcast": ("TypeError", ["tensor", "bool"]),
    "dtype_int8_out": ("TypeError", ["out", "int8"]),
    "meta_device": ("ValueError", ["tensor", "CPU"]),
    "rs_dtype_mismatch": ("TypeError", ["inp", "float64", "float32"]),
    "ag_dtype_mismatch": ("TypeError", ["inp", "int32", "float32"]),
    "rs_size_mismatch": ("ValueError", ["inp"]),
    "ag_size_mismatch": ("ValueError", ["out"]),
    "bad_op": ("ValueError", ["op", "mean"]),
    "bad_op_type": ("ValueError", ["op"]),
    "bad_op_reduce_scatter": ("ValueError", ["op", "MAX"]),
    "avg_int32": ("ValueError", ["avg", "int32"]),
    "avg_int64_reduce_scatter": ("ValueError", ["avg", "int64"]),
    "src_out_of_range": ("ValueError", ["src"]),
    "src_negative": ("ValueError", ["src"]),
    "src_not_int": ("TypeError", ["src"]),
    "counts_wrong_length": ("ValueError", ["counts"]),
    "counts_negative": ("ValueError", ["counts"]),
    "counts_wrong_sum": ("ValueError", ["counts", "sum"]),
    "counts_not_ints": ("TypeError", ["counts"]),
    "counts_floats": ("TypeError", ["counts"]),
    "counts_bools": ("TypeError", ["counts", "True"]),
    "ag_counts_floats": ("TypeError", ["counts"]),
    "ag_counts_wrong_sum": ("ValueError", ["counts"]),
    "ag_counts_wrong_length": ("ValueError", ["counts"]),
    "rs_counts_mine_wrong": ("ValueError", ["out", "counts"]),
    "ag_counts_mine_wrong": ("ValueError", ["inp", "counts"]),
    "ag_overlap": ("ValueError", ["inp", "overlaps", "out"]),
    "rs_overlap": ("ValueError", ["out", "overlaps", "inp"]),
    "ag_overlap_other_chunk": ("ValueError", ["inp", "overlaps"]),
    "oneshot_too_big_all_reduce": ("ValueError", ["oneshot"]),
    "oneshot_too_big_reduce_scatter": ("ValueError", ["oneshot"]),
    "oneshot_too_big_broadcast": ("ValueError", ["oneshot"]),
    "oneshot_too_big_async": ("ValueError", ["oneshot"]),
    "algo_bogus": ("ValueError", ["algo", "bogus"]),
    "algo_bogus_all_gather": ("ValueError", ["algo", "bogus"]),
    "algo_bogus_broadcast": ("ValueError", ["algo", "bogus"]),
    "group_not_a_group": ("TypeError", ["group"]),
    "new_group_bad_ranks": ("ValueError", ["ranks"]),
    "new_group_duplicates": ("ValueError", ["ranks"]),
    "new_group_empty": ("ValueError", ["ranks"]),
    "new_group_string": ("TypeError", ["ranks", "'01'"]),
    "new_group_float": ("TypeError", ["ranks", "1.5"]),
    "new_group_bool": ("TypeError", ["ranks", "True"]),
    "send_to_self": ("ValueError", ["dst"]),
    "recv_from_self": ("ValueError", ["src"]),
    "send_dst_out_of_range": ("ValueError", ["dst"]),
    "batch_not_p2pop": ("TypeError", ["ops[0]", "P2POp", "tuple"]),
    "batch_peer_out_of_range": ("ValueError", ["ops[0].peer", "expected a global rank"]),
    "batch_peer_self": ("ValueError", ["ops[0].peer", "send to"]),
    # world >= 2 only
    "non_member_all_reduce": ("ValueError", ["group", "not a member"]),
    "non_member_barrier": ("ValueError", ["group", "not a member"]),
    "src_not_in_group": ("ValueError", ["src"]),
    # the exact in-place forms are accepted
    "ag_in_place_ok": ("ok", []),
    "rs_in_place_ok": ("ok", []),
    "after_errors_all_reduce": ("ok", []),
    "after_destroy": ("RuntimeError", ["pz.init"]),
    "destroyed_group_handle": ("CollectiveError", ["destroyed"]),
    "op_unhashable": ("ValueError", ["op"]),
    # a lazily negated view's memory holds the negation (all_reduce max gave 2.0 for -1 and -2)
    "negated_view": ("ValueError", ["tensor", "negated view", "resolve_neg"]),
    "negated_view_out": ("ValueError", ["out", "negated view"]),
    "mkldnn": ("TypeError", ["tensor", "dense", "_mkldnn"]),
    "async_op_string": ("TypeError", ["async_op", "'False'"]),  # (ran asynchronously: bool("False"))
    "barrier_async_op_string": ("TypeError", ["async_op", "'no'"]),
    "comm_stats_reset_string": ("TypeError", ["reset", "'yes'"]),
    "every_rank_overflow": ("ValueError", ["values", "int64"]),
    "every_rank_bool": ("TypeError", ["dtype", "torch.bool"]),
    "algo_unhashable": ("ValueError", ["algo"]),
}


MULTI_RANK_ONLY = {"non_member_all_reduce", "non_member_barrier", "src_not_in_group", "rs_counts_mine_wrong",
                   "ag_counts_mine_wrong", "ag_overlap_other_chunk"}


def _rank_bad_args():
    o = {}
    t = torch.ones(4)
    o["before_init_all_reduce"] = outcome(lambda: pz.all_reduce(t))
    o["before_init_barrier"] = outcome(lambda: pz.barrier())
    o["before_init_new_group"] = outcome(lambda: pz.new_group([0]))
    o["before_init_comm_stats"] = outcome(lambda: pz.comm_stats())
    o["init_bad_timeout"] = outcome(lambda: pz.init(timeout=-1))
    o["init_bad_join_timeout"] = outcome(lambda: pz.init(timeout=30, join_timeout=0))
    o["init_nan_timeout"] = outcome(lambda: pz.init(timeout=float("nan")))
    o["init_inf_timeout"] = outcome(lambda: pz.init(timeout=float("inf")))
    o["init_nan_join_timeout"] = outcome(lambda: pz.init(timeout=30, join_timeout=float("nan")))
    o["init_bad_backend"] = outcome(lambda: pz.init(backend="gloo"))
    assert not pz.is_initialized()
    pz.init(timeout=30)
    o["init_twice"] = outcome(lambda: pz.init(timeout=30))
    n, me = pz.get_world_size(), pz.get_rank()
    g0 = pz.new_group([0])  # every rank calls new_group; only rank 0 is a member

    k = 4
    out, inp = torch.zeros(k), torch.ones(n * k)
    o["non_tensor"] = outcome(lambda: pz.all_reduce([1.0, 2.0]))
    o["non_tensor_out"] = outcome(lambda: pz.all_gather(None, torch.ones(k)))
    o["non_tensor_inp"] = outcome(lambda: pz.reduce_scatter(out, inp.tolist()))
    o["non_contiguous"] = outcome(lambda: pz.all_reduce(torch.ones(4, 4).t()))
    o["non_contiguous_inp"] = outcome(lambda: pz.reduce_scatter(out, torch.ones(2 * n * k)[::2]))
    o["non_contiguous_out"] = outcome(lambda: pz.all_gather(torch.ones(2 * n * k)[::2], torch.ones(k)))
    o["sparse"] = outcome(lambda: pz.all_reduce(torch.ones(4).to_sparse()))
    o["sparse_csr_out"] = outcome(lambda: pz.all_gather(torch.zeros(n, k).to_sparse_csr(), torch.ones(k)))
    o["dtype_uint8"] = outcome(lambda: pz.all_reduce(torch.ones(4, dtype=torch.uint8)))
    o["dtype_complex"] = outcome(lambda: pz.all_reduce(torch.ones(4, dtype=torch.complex64)))
    o["dtype_bool_broadcast"] = outcome(lambda: pz.broadcast(torch.ones(4, dtype=torch.bool), src=0))
    o["dtype_int8_out"] = outcome(lambda: pz.all_gather(torch.ones(n * k, dtype=torch.int8), torch.ones(k)))
    o["meta_device"] = outcome(lambda: pz.all_reduce(torch.empty(4, device="meta")))
    o["rs_dtype_mismatch"] = outcome(lambda: pz.reduce_scatter(out, inp.double()))
    o["ag_dtype_mismatch"] = outcome(lambda: pz.all_gather(torch.zeros(n * k), torch.ones(k, dtype=torch.int32)))
    o["rs_size_mismatch"] = outcome(lambda: pz.reduce_scatter(out, torch.ones(n * k + 1)))
    o["ag_size_mismatch"] = outcome(lambda: pz.all_gather(torch.zeros(n * k + 1), torch.ones(k)))
    o["bad_op"] = outcome(lambda: pz.all_reduce(t, op="mean"))
    o["bad_op_type"] = outcome(lambda: pz.all_reduce(t, op=0))
    o["bad_op_reduce_scatter"] = outcome(lambda: pz.reduce_scatter(out, inp, op="MAX"))
    o["avg_int32"] = outcome(lambda: pz.all_reduce(torch.ones(4, dtype=torch.int32), op="avg"))
    o["avg_int64_reduce_scatter"] = outcome(
        lambda: pz.reduce_scatter(torch.zeros(k, dtype=torch.int64), torch.ones(n * k, dtype=torch.int64), op="avg"))
    o["src_out_of_range"] = outcome(lambda: pz.broadcast(t, src=n))
    o["src_negative"] = outcome(lambda: pz.broadcast(t, src=-1))
    o["src_not_int"] = outcome(lambda: pz.broadcast(t, src="0"))
    o["counts_wrong_length"] = outcome(lambda: pz.reduce_scatter(out, inp, counts=[k] * (n + 1)))
    o["counts_negative"] = outcome(lambda: pz.reduce_scatter(out, inp, counts=[2 * k] + [k] * (n - 2) + [-k]
                                                              if n > 1 else [-k]))
    o["counts_wrong_sum"] = outcome(lambda: pz.reduce_scatter(out, inp, counts=[k] * (n - 1) + [k + 1]))
    o["counts_not_ints"] = outcome(lambda: pz.reduce_scatter(out, inp, counts=["a"] * n))
    o["counts_floats"] = outcome(lambda: pz.reduce_scatter(out, inp, counts=[k + 0.5] * n))
    o["counts_bools"] = outcome(lambda: pz.reduce_scatter(torch.zeros(1), torch.ones(n), counts=[True] * n))
    o["ag_counts_floats"] = outcome(lambda: pz.all_gather(torch.zeros(n * k), torch.ones(k), counts=[float(k)] * n))
    o["ag_counts_wrong_sum"] = outcome(lambda: pz.all_gather(torch.zeros(n * k), torch.ones(k),
                                                             counts=[k] * (n - 1) + [k - 1]))
    o["ag_counts_wrong_length"] = outcome(lambda: pz.all_gather(torch.zeros(n * k), torch.ones(k), counts=[n * k]
                                                                if n > 1 else [k, 0]))
    uneven = [0] * n
    uneven[(me + 1) % n] = n * k  # this rank's count is 0 (when n > 1), but out/inp has k elements
    if n > 1:
        o["rs_counts_mine_wrong"] = outcome(lambda: pz.reduce_scatter(out, inp, counts=uneven))
        o["ag_counts_mine_wrong"] = outcome(lambda: pz.all_gather(torch.zeros(n * k), torch.ones(k), counts=uneven))
    # overlapping out/inp that are not this rank's exact chunk
    big = torch.zeros(n * k + 1)
    o["ag_overlap"] = outcome(lambda: pz.all_gather(big[:n * k], big[me * k + 1:me * k + 1 + k]))
    o["rs_overlap"] = outcome(lambda: pz.reduce_scatter(big[me * k + 1:me * k + 1 + k], big[:n * k]))
    if n > 1 and me != 0:  # inp is rank 0's chunk of out, not this rank's
        whole = torch.zeros(n * k)
        o["ag_overlap_other_chunk"] = outcome(lambda: pz.all_gather(whole, whole[:k]))
    # the exact in-place chunk is fine (every rank calls these: they are real collectives)
    buf = torch.zeros(n * k)
    buf[me * k:(me + 1) * k] = me + 1
    o["ag_in_place_ok"] = outcome(lambda: pz.all_gather(buf, buf[me * k:(me + 1) * k]))
    assert torch.equal(buf, torch.arange(1, n + 1, dtype=torch.float32).repeat_interleave(k)), buf
    rbuf = torch.ones(n * k)
    o["rs_in_place_ok"] = outcome(lambda: pz.reduce_scatter(rbuf[me * k:(me + 1) * k], rbuf))
    assert torch.equal(rbuf[me * k:(me + 1) * k], torch.full((k,), float(n)))
    # one-shot takes at most oneshot_bytes (512 KiB) of input per rank
    assert pz.comm.resolve_group(None).backend.oneshot_bytes == 512 << 10
    too_big = (512 << 10) // 4 + 1
    o["oneshot_too_big_all_reduce"] = outcome(lambda: pz.all_reduce(torch.ones(too_big), algo="oneshot"))
    o["oneshot_too_big_reduce_scatter"] = outcome(
        lambda: pz.reduce_scatter(torch.zeros(too_big), torch.ones(n * too_big), algo="oneshot"))
    o["oneshot_too_big_broadcast"] = outcome(lambda: pz.broadcast(torch.ones(too_big), src=0, algo="oneshot"))
    o["oneshot_too_big_async"] = outcome(lambda: pz.all_reduce(torch.ones(too_big), algo="oneshot",
                                                                async_op=True).wait())  # at the call or at wait()
    o["algo_bogus"] = outcome(lambda: pz.all_reduce(t, algo="bogus"))
    o["algo_bogus_all_gather"] = outcome(lambda: pz.all_gather(torch.zeros(n * k), torch.ones(k), algo="bogus"))
    o["algo_bogus_broadcast"] = outcome(lambda: pz.broadcast(t, src=0, algo="bogus"))
    o["group_not_a_group"] = outcome(lambda: pz.all_reduce(t, group=[0, 1]))
    o["new_group_bad_ranks"] = outcome(lambda: pz.new_group([0, n]))
    o["new_group_duplicates"] = outcome(lambda: pz.new_group([0, 0]))
    o["new_group_empty"] = outcome(lambda: pz.new_group([]))
    o["new_group_string"] = outcome(lambda: pz.new_group("01"))
    o["new_group_float"] = outcome(lambda: pz.new_group([0, 1.5]))
    o["new_group_bool"] = outcome(lambda: pz.new_group([True]))
    o["send_to_self"] = outcome(lambda: pz.send(t, dst=me))
    o["recv_from_self"] = outcome(lambda: pz.recv(t, src=me))
    o["send_dst_out_of_range"] = outcome(lambda: pz.send(t, dst=n + 3))
    o["batch_not_p2pop"] = outcome(lambda: pz.batch_isend_irecv([("send", t, 0)]))
    o["batch_peer_out_of_range"] = outcome(lambda: pz.batch_isend_irecv([pz.P2POp("recv", t, n + 3)]))
    o["batch_peer_self"] = outcome(lambda: pz.batch_isend_irecv([pz.P2POp("send", t, me)]))
    if n > 1:
        if me != 0:
            o["non_member_all_reduce"] = outcome(lambda: pz.all_reduce(t, group=g0))
            o["non_member_barrier"] = outcome(lambda: pz.barrier(group=g0))
        else:
            pz.all_reduce(t, group=g0)  # a group of one: fine
        o["src_not_in_group"] = outcome(lambda: pz.broadcast(t, src=1, group=g0))
    # nothing above desynchronised the ranks: a correct collective still works
    x = torch.full((1031,), float(me + 1))
    o["after_errors_all_reduce"] = outcome(lambda: pz.all_reduce(x))
    assert torch.equal(x, torch.full((1031,), float(n * (n + 1) // 2)))
    o["negated_view"] = outcome(lambda: pz.all_reduce(torch.tensor([complex(0, 1 + me)]).conj().imag, op="max"))
    o["negated_view_out"] = outcome(lambda: pz.all_reduce(t[:1], out=torch.tensor([1j]).conj().imag))
    o["mkldnn"] = outcome(lambda: pz.all_reduce(torch.ones(4).to_mkldnn()))
    o["async_op_string"] = outcome(lambda: pz.all_reduce(t, async_op="False"))
    o["barrier_async_op_string"] = outcome(lambda: pz.barrier(async_op="no"))
    o["comm_stats_reset_string"] = outcome(lambda: pz.comm_stats(reset="yes"))
    o["every_rank_overflow"] = outcome(lambda: pz.comm.every_rank([2 ** 63]))
    o["every_rank_bool"] = outcome(lambda: pz.comm.every_rank([1], dtype=torch.bool))
    o["op_unhashable"] = outcome(lambda: pz.all_reduce(t, op=["sum"]))
    o["algo_unhashable"] = outcome(lambda: pz.all_reduce(t, algo=["ring"]))
    world = pz.comm.resolve_group(None)
    pz.destroy()
    o["after_destroy"] = outcome(lambda: pz.all_reduce(t))
    o["destroyed_group_handle"] = outcome(lambda: pz.all_reduce(t, group=world))
    return {"outcomes": o}


@pytest.mark.parametrize("world", [1, 2])
def test_bad_arguments(world):
    results = run_ranks(_rank_bad_args, world, timeout=60)
    _check_outcomes(results, BAD_ARGS)
    # the last rank runs every case of its world size
    ran = set(results[-1].value["outcomes"])
    want = set(BAD_ARGS) if world > 1 else set(BAD_ARGS) - MULTI_RANK_ONLY
    assert ran == want, (sorted(want - ran), sorted(ran - want))


# ---------------------------------------------------------------------------
# Mismatched collectives: CollectiveError on every rank, group still usable


def _mismatch_cases(n):
    """case -> (call for the ranks that agree, call for the odd rank (the last one), words)."""
    k = 8
    return {
        "op": (lambda: pz.all_reduce(torch.ones(k), op="sum"), lambda: pz.all_reduce(torch.ones(k), op="max"),
               ["all_reduce", "op=sum", "op=max"]),
        "dtype": (lambda: pz.all_reduce(torch.ones(k)), lambda: pz.all_reduce(torch.ones(k, dtype=torch.float64)),
                  ["float32", "float64"]),
        "count": (lambda: pz.all_reduce(torch.ones(k)), lambda: pz.all_reduce(torch.ones(k + 1)),
                  [f"count={k}", f"count={k + 1}"]),
        "coll_broadcast": (lambda: pz.all_reduce(torch.ones(k)), lambda: pz.broadcast(torch.ones(k), src=0),
                           ["all_reduce", "broadcast"]),
        "coll_barrier": (lambda: pz.barrier(), lambda: pz.all_reduce(torch.ones(k)), ["barrier", "all_reduce"]),
        "coll_rs_ag": (lambda: pz.reduce_scatter(torch.zeros(k), torch.ones(n * k)),
                       lambda: pz.all_gather(torch.zeros(n * k), torch.ones(k)), ["reduce_scatter", "all_gather"]),
        "algo": (lambda: pz.all_reduce(torch.ones(k), algo="ring"),
                 lambda: pz.all_reduce(torch.ones(k), algo="oneshot"),
                 ["algo=ring", "algo=oneshot"]),
        "algo_large": (lambda: pz.all_reduce(torch.ones(20000), algo="ring"),
                       lambda: pz.all_reduce(torch.ones(20000), algo="oneshot"), ["algo=ring", "algo=oneshot"]),
        "src": (lambda: pz.broadcast(torch.ones(k), src=0), lambda: pz.broadcast(torch.ones(k), src=n - 1),
                ["src=0", f"src={n - 1}"]),
        # same total, different split (the odd rank's own chunk is empty)
        "counts": (lambda: pz.reduce_scatter(torch.zeros(k), torch.ones(n * k), counts=[k] * n),
                   lambda: pz.reduce_scatter(torch.zeros(0), torch.ones(n * k), counts=[2 * k] + [k] * (n - 2) + [0]),
                   ["reduce_scatter"]),
        "async_op": (lambda: pz.all_reduce(torch.ones(k), op="min", async_op=True).wait(),
                     lambda: pz.all_reduce(torch.ones(k), op="prod", async_op=True).wait(), ["op=min", "op=prod"]),
    }


def _rank_mismatch():
    pz.init(timeout=30)
    n, me = pz.get_world_size(), pz.get_rank()
    odd = n - 1
    o = {}
    for case, (same, other, _) in _mismatch_cases(n).items():
        t0 = time.monotonic()
        o[case] = outcome(other if me == odd else same)
        o[case + "/seconds"] = ("ok", time.monotonic() - t0)
        # the group is still usable: a correct all_reduce (both algorithms)
        for algo in ["ring", "oneshot"]:
            x = torch.full((1031,), float(me + 1))
            o[case + "/after/" + algo] = outcome(lambda: pz.all_reduce(x, algo=algo))
            if not torch.equal(x, torch.full((1031,), float(n * (n + 1) // 2))):
                o[case + "/after/" + algo] = ("wrong result", str(x[:4]))
    # send/recv size mismatch: the receiver raises, the channel stays usable
    if me in (0, 1):
        if me == 0:
            pz.send(torch.ones(5), dst=1)
            pz.send(torch.full((6,), 2.0), dst=1)
        else:
            o["p2p"] = outcome(lambda: pz.recv(torch.empty(6), src=0))
            got = torch.empty(6)
            o["p2p/after"] = outcome(lambda: pz.recv(got, src=0))
            if not torch.equal(got, torch.full((6,), 2.0)):
                o["p2p/after"] = ("wrong result", str(got))
    return {"outcomes": o}


@pytest.mark.parametrize("world", [2, 3])
def test_mismatched_collectives(world):
    results = run_ranks(_rank_mismatch, world, timeout=60)
    expected = {}
    for case, (_, _, words) in _mismatch_cases(world).items():
        expected[case] = ("CollectiveError", ["mismatched", "seq", "rank"] + words)
        expected[case + "/after/ring"] = ("ok", [])
        expected[case + "/after/oneshot"] = ("ok", [])
    expected["p2p"] = ("MessageMismatch", ["mismatched send/recv", "rank 0", "5", "6"])  # (a CollectiveError)
    expected["p2p/after"] = ("ok", [])
    _check_outcomes(results, expected)
    for r in results:
        for case in _mismatch_cases(world):
            assert case in r.value["outcomes"], (r.rank, case)
            assert r.value["outcomes"][case + "/seconds"][1] < 10, (r.rank, case, "mismatch detection was slow")
        # every rank names a peer that called something else
        _, msg = r.value["outcomes"]["op"]
        odd = world - 1
        assert f"rank {odd}" in msg if r.rank != odd else "rank 0" in msg, msg
    assert "p2p" in results[1].value["outcomes"]


def _rank_init_outcome():
    return outcome(lambda: pz.init(timeout=5, join_timeout=5))


@pytest.mark.parametrize("var,value,words", [("MASTER_PORT", "70000", ["MASTER_PORT=70000", "65535"]),
                                             ("MASTER_PORT", "-1", ["MASTER_PORT=-1", "65535"]),
                                             ("LOCAL_RANK", "x", ["LOCAL_RANK='x'", "integer"]),
                                             ("LOCAL_RANK", "-3", ["LOCAL_RANK=-3", "non-negative"]),
                                             ("LOCAL_WORLD_SIZE", "0", ["LOCAL_WORLD_SIZE='0'", "positive"]),
                                             # int() reads "0_1" as 1; a local rank past the host's ranks picked
                                             # a GPU that is not there; an empty address
                                             ("RANK", "0_0", ["RANK='0_0'", "integer"]),
                                             ("LOCAL_RANK", "5", ["LOCAL_RANK=5", "LOCAL_WORLD_SIZE=1"]),
                                             ("MASTER_ADDR", " ", ["MASTER_ADDR is empty"]),
                                             # (a billion ranks hung building the join's keys)
                                             ("WORLD_SIZE", "1000000000", ["WORLD_SIZE=1000000000", "at most"])])
def test_bad_environment_variable_is_named(var, value, words):
    """torchrun's variables out of range: a ValueError naming the variable, not torch's constructor
    signature (a port out of range), a bare int() error, a negative local rank taken as given, or a
    store entry."""
    etype, msg = run_ranks(_rank_init_outcome, 1, env={var: value}, timeout=30)[0].value
    assert etype == "ValueError" and all(w in msg for w in words), (etype, msg)


def _rank_one_bad_setting(var, value, bad_rank):
    if int(os.environ["RANK"]) == bad_rank:
        os.environ[var] = value
    t0 = time.monotonic()
    return outcome(lambda: pz.init(timeout=30)), time.monotonic() - t0


@pytest.mark.parametrize("var,value,bad_rank", [("PYZERO_SHM_DEPTH", "1", 0), ("PYZERO_FLIGHT", "maybe", 1),
                                                ("PYZERO_SHM_ADAPTIVE", "2", 2)])
def test_a_bad_setting_on_one_rank_fails_every_rank_at_once_naming_it(var, value, bad_rank):
    """A PYZERO_* setting one rank alone refuses: that rank raises its ValueError, and the others, waiting
    for it in the world group's set-up, raise at once naming the rank and its error (were: the store's raw
    wait timeout, after the whole collective timeout)."""
    for r in run_ranks(_rank_one_bad_setting, 3, args=(var, value, bad_rank), timeout=60):
        (etype, msg), seconds = r.value
        assert seconds < 15, (r.rank, r.value)
        if r.rank == bad_rank:
            assert etype == "ValueError" and var in msg, (r.rank, r.value)
        else:
            assert etype == "CollectiveError" and f"failed on rank {bad_rank}: ValueError" in msg and var in msg, \
                (r.rank, r.value)


def _rank_init_timeouts():
    return {t: outcome(lambda t=t: pz.init(timeout=t)) for t in (1e-9, 1e300)} | \
        {"join": outcome(lambda: pz.init(timeout=5, join_timeout=1e300))}


def test_timeouts_out_of_range_are_named():
    """A timeout of 1e-9 s (torch's store: a wait of 0 ms) or 1e300 s (an OverflowError from a C int) is
    refused naming the argument."""
    out = run_ranks(_rank_init_timeouts, 1, timeout=30)[0].value
    for key, arg in ((1e-9, "timeout"), (1e300, "timeout"), ("join", "join_timeout")):
        etype, msg = out[key]
        assert etype == "ValueError" and msg.startswith(f"{arg}: expected a positive number of seconds"), (key, msg)


def _rank_port_held(join_timeout):
    t0 = time.monotonic()
    return outcome(lambda: pz.init(timeout=5, join_timeout=join_timeout)), time.monotonic() - t0


def test_a_master_port_held_by_another_program_ends_within_join_timeout():
    """MASTER_PORT where another program listens (not a store): rank 0 cannot host the store, the other rank
    connected to that program and blocked in torch's store constructor with no end; now rank 0 names the
    port in use at once and the other rank's wait ends at join_timeout."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen(16)
        port = held.getsockname()[1]
        res = run_ranks(_rank_port_held, 2, args=(3.0,), env={"MASTER_PORT": str(port)}, timeout=60, check=False)
    (k0, m0), t0 = res[0].value
    (k1, m1), t1 = res[1].value
    assert k0 == "CollectiveError" and "could not host the job's store" in m0 and t0 < 3.0, (k0, m0, t0)
    assert k1 == "CollectiveTimeout" and "join_timeout=3 s" in m1 and t1 < 6.0, (k1, m1, t1)


def test_a_master_addr_where_nothing_listens_is_named_as_unreachable(monkeypatch):
    """Nothing accepts connections at MASTER_ADDR:MASTER_PORT (rank 0 not up yet, a wrong address) while
    torch's store constructor, retrying, outlives join_timeout: the error says the store could not be reached
    (it said the address was reached, blaming another program), as it does where something listens."""
    import socket
    import threading

    def still_connecting(*args):
        t = threading.Thread(target=lambda: None)
        t.start()
        raise TimeoutError(t)
    monkeypatch.setattr(pz.comm, "_bounded_store", still_connecting)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # (closed again: nothing listens there)
    with pytest.raises(pz.CollectiveTimeout, match=f"rank 1 could not reach the store at 127.0.0.1:{port} within "
                                                   "join_timeout=1 s: nothing accepts connections there"):
        pz.comm._connect("127.0.0.1", port, 2, 1, 1.0)
    with socket.socket() as held:  # something listens, no store answers: as before
        held.bind(("127.0.0.1", 0))
        held.listen(1)
        port = held.getsockname()[1]
        with pytest.raises(pz.CollectiveTimeout, match=f"rank 1 reached 127.0.0.1:{port} but no job's store"):
            pz.comm._connect("127.0.0.1", port, 2, 1, 1.0)


def _rank_init_again():
    pz.init(timeout=10, join_timeout=10)
    me = pz.get_rank()
    pz.barrier()
    if me == 0:
        time.sleep(1.0)  # rank 0, which hosts the store, leaves the first world a little later
    pz.destroy()
    t0 = time.monotonic()
    again = outcome(lambda: pz.init(timeout=10, join_timeout=10))
    x = torch.full((3,), float(me + 1))
    if again[0] == "ok":
        pz.all_reduce(x)
    return again, x.tolist(), time.monotonic() - t0


def test_init_again_after_destroy_waits_for_the_new_store():
    """A rank that calls pz.init again while rank 0 is still in the previous world used to reach that
    world's store and take its stale keys (a failed shm_open there, a join timeout on rank 0)."""
    for r in run_ranks(_rank_init_again, 2, timeout=60):
        again, x, seconds = r.value
        assert again == ("ok", None) and x == [3.0] * 3, (r.rank, r.value)
        assert seconds < 8, (r.rank, seconds)


def _rank_init_after_failed_init():
    try:
        pz.init(timeout=10, join_timeout=10, options={"slice_bytes": 1000})
        first = ("ok", None)
    except ValueError as e:
        first = (type(e).__name__, str(e))
        if int(os.environ["RANK"]) == 0:
            time.sleep(1.0)  # the error's traceback keeps the failed init's store (served by rank 0) open
    again = outcome(lambda: pz.init(timeout=10, join_timeout=10))
    x = torch.full((3,), float(pz.get_rank() + 1)) if again[0] == "ok" else torch.zeros(3)
    if again[0] == "ok":
        pz.all_reduce(x)
    return first, again, x.tolist()


def test_init_again_after_a_failed_init():
    """Every rank's init fails (options the transport refuses) and is called again: rank 0 may still
    host the failed attempt's store when the others come back; they wait for the new one."""
    for r in run_ranks(_rank_init_after_failed_init, 2, timeout=60):
        first, again, x = r.value
        assert first[0] == "ValueError" and "slice_bytes=1000" in first[1], first
        assert again == ("ok", None) and x == [3.0] * 3, (r.rank, r.value)


def _rank_new_group_disagree():
    pz.init(timeout=20)
    me, o = pz.get_rank(), {}
    t0 = time.monotonic()
    o["order"] = outcome(lambda: pz.new_group([0, 1] if me == 0 else [1, 0]))
    o["members"] = outcome(lambda: pz.new_group((0, 1) if me == 0 else (0,)))  # a tuple is a sequence too
    o["disjoint"] = outcome(lambda: pz.new_group([me]))  # each rank makes its own group: not every rank calls it
    # rank 1's call is refused there (duplicate ranks): rank 0's fails at once, naming it, instead of pairing
    # with rank 1's next call
    o["refused"] = outcome(lambda: pz.new_group([0, 1] if me == 0 else [0, 0]))
    # options one rank refuses: its call is refused there, the other's fails at once naming them
    o["options"] = outcome(lambda: pz.new_group([0, 1], options={"depth": 1} if me == 1 else None))
    o["seconds"] = time.monotonic() - t0
    g = pz.new_group(r for r in (1, 0))  # agreeing calls still make a group (ranks from an iterator too)
    x = torch.full((3,), float(me + 1))
    pz.all_reduce(x, group=g)
    o["after"] = (g.rank, x.tolist())
    return o


def test_new_group_ranks_that_disagree_raise_on_the_members():
    """Ranks that give new_group different member lists (or orders), or each a group of their own, fail
    with an error naming both lists, at once, not an obscure transport error on one and a store timeout on
    the other; a rank outside the group is told too (it carried on alone); a call one rank refuses (its
    ranks are invalid) fails the others' at once, naming it."""
    res = [r.value for r in run_ranks(_rank_new_group_disagree, 2, timeout=60)]
    for me, v in enumerate(res):
        etype, msg = v["order"]
        assert etype == "CollectiveError", v["order"]
        for words in ("new_group", "ranks", "[0, 1]", "[1, 0]", f"rank {1 - me} gave"):
            assert words in msg, (words, msg)
        assert v["seconds"] < 10, v
        assert v["after"] == (1 - me, [3.0] * 3), v
    etype, msg = res[0]["members"]
    assert etype == "CollectiveError" and "rank 1 gave [0]" in msg, res[0]["members"]
    etype, msg = res[1]["members"]  # (not a member of the group it asked for)
    assert etype == "CollectiveError" and "rank 0 gave [0, 1]" in msg, res[1]["members"]
    assert res[0]["refused"][0] == "CollectiveError" and "rank 1 gave (0, 0), which it refused" in \
        res[0]["refused"][1], res[0]["refused"]
    assert res[1]["refused"][0] == "ValueError", res[1]["refused"]
    assert res[0]["options"][0] == "CollectiveError" and "rank 1 gave [0, 1] with options it refused (options.depth" \
        in res[0]["options"][1], res[0]["options"]
    assert res[1]["options"][0] == "ValueError" and "options.depth" in res[1]["options"][1], res[1]["options"]
    for me, v in enumerate(res):
        etype, msg = v["disjoint"]
        assert etype == "CollectiveError" and f"gave [{me}], rank {1 - me} gave [{1 - me}]" in msg, v["disjoint"]


# ---------------------------------------------------------------------------
# Dead and missing ranks


def _segments():
    return set(glob.glob("/dev/shm/pz*"))


def _rank_dies(how, long_timeout):
    pz.init(timeout=60 if long_timeout else 3)
    n, me = pz.get_world_size(), pz.get_rank()
    victim = n - 1
    x = torch.ones(1031)
    pz.all_reduce(x)  # everybody is up
    if me == victim:
        if how == "exit":
            os._exit(3)
        if how in ("sigkill", "sigkill_recv"):
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "sigkill_mid":  # die while a large all_reduce is in flight
            w = pz.all_reduce(torch.ones(16 << 20), async_op=True)
            time.sleep(0.03)  # the ring is running (a 64 MB all_reduce takes far longer)
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "sigkill_fused":  # die inside a fused op: arrived, but its block never comes
            def die(c, out):
                os.kill(os.getpid(), signal.SIGKILL)
            pz.symmetric.reduce_scatter_apply(die, 4, 4, x, pz.comm.resolve_group(None))
        if how == "sleep":  # arrive long after the others gave up
            time.sleep(4.5)
            t0 = time.monotonic()
            late = outcome(lambda: pz.all_reduce(torch.ones(10)))
            return {"late": late, "late_s": time.monotonic() - t0}
        raise AssertionError(how)
    t0 = time.monotonic()
    if how == "sigkill_mid":
        def both():
            pz.all_reduce(torch.ones(16 << 20))
            pz.all_reduce(torch.ones(10))
        first = outcome(both)
    elif how == "sigkill_fused":  # the survivors wait for the dead rank's partial sums
        first = outcome(lambda: pz.symmetric.reduce_scatter_apply(lambda c, out: out.fill_(1.0), 4, 4, x,
                                                                   pz.comm.resolve_group(None)))
    elif how == "sigkill_recv":  # the survivor waits in a recv from the dead rank
        first = outcome(lambda: pz.recv(torch.empty(10), src=victim))
    else:
        first = outcome(lambda: pz.all_reduce(torch.ones(1031)))
    seconds = time.monotonic() - t0
    again = outcome(lambda: pz.all_reduce(torch.ones(10)))  # the group stays broken, fails at once
    return {"first": first, "seconds": seconds, "again": again}


@pytest.mark.parametrize("how,world", [("exit", 2), ("sigkill", 2), ("exit", 3), ("sigkill", 4),
                                       ("sigkill_recv", 2), ("sigkill_mid", 2), ("sigkill_mid", 4),
                                       ("sigkill_fused", 2), ("sigkill_fused", 3)])
def test_dead_rank_detected_fast(how, world):
    """The last rank exits or is SIGKILLed; every survivor raises CollectiveTimeout naming it, within
    seconds although pz.init(timeout=60), and the group then refuses further collectives.

    sigkill_mid: the rank dies while a ring all_reduce is running, so in a world of 4 one survivor
    (rank 1) waits on a live peer (rank 0) rather than on the dead rank: it too must name rank 3.
    sigkill_fused: it dies inside a fused op on symmetric buffers, after arriving.
    """
    before = _segments()
    t0 = time.monotonic()
    results = run_ranks(_rank_dies, world, args=(how, True), timeout=60, check=False)
    elapsed = time.monotonic() - t0
    victim = world - 1
    want_exit = 3 if how == "exit" else -int(signal.SIGKILL)
    assert results[victim].exitcode == want_exit, results[victim]
    for r in results[:victim]:
        assert r.exitcode == 0, r.output
        v = r.value
        etype, msg = v["first"]
        assert etype == "CollectiveTimeout", (r.rank, v)
        assert f"rank {victim}" in msg and "exited" in msg, msg
        if how == "sigkill_recv":  # a recv waits for its sender, not for arrivals at a collective (no seq)
            assert msg.startswith(f"recv (rank {r.rank} of {world}): waiting for rank {victim}, which has exited"), msg
            assert "never arrived" not in msg, msg
        else:  # listed among the ranks that never arrived (survivors that already failed and exited may be too)
            m = re.search(r"never arrived: \[([0-9, ]*)\]", msg)
            assert m and victim in [int(x) for x in m.group(1).split(",")], msg
        # a 60 s timeout, yet the dead rank is noticed within seconds
        assert v["seconds"] < 5, (r.rank, v)
        assert v["again"][0] == "CollectiveError" and "unusable" in v["again"][1], (r.rank, v)
        if how in ("exit", "sigkill", "sigkill_recv"):  # the refused call's own number: after 1 or 2 all_reduces
            seq = 2 if how == "sigkill_recv" else 3
            assert v["again"][1].startswith(f"all_reduce (rank {r.rank} of {world}, seq {seq}): group unusable"), v
    assert elapsed < 30
    assert isinstance(pz.CollectiveTimeout("x"), pz.CollectiveError)
    left = _segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def _rank_late(delay, join_timeout):
    """Rank 1 starts `delay` s after rank 0; the collective timeout (1 s) is shorter than that."""
    if int(os.environ["RANK"]) == 1:
        time.sleep(delay)
    start = time.monotonic()
    try:
        pz.init(timeout=1, join_timeout=join_timeout)
    except pz.CollectiveError as e:
        return type(e).__name__, str(e), time.monotonic() - start
    x = torch.full((5,), float(pz.get_rank() + 1))
    pz.all_reduce(x)
    return "ok", x.tolist(), None


def test_late_rank_joins_within_join_timeout_not_the_collective_timeout():
    res = run_ranks(_rank_late, 2, args=(2.5, None), timeout=60)
    assert [r.value for r in res] == [("ok", [3.0] * 5, None)] * 2, [r.value for r in res]


def test_rank_that_never_joins_is_named():
    res = run_ranks(_rank_late, 2, args=(4.5, 1.5), timeout=60, check=False)
    kind, msg, took = res[0].value
    assert kind == "CollectiveTimeout" and "join_timeout=1.5 s" in msg and "never joined: [1]" in msg, msg
    assert 1.4 < took < 6, took
    kind, msg, took = res[1].value  # by then rank 0 and its store are gone
    assert kind == "CollectiveTimeout" and "rank 1" in msg and "join_timeout=1.5 s" in msg, msg


def _rank_p2p_waits():
    pz.init(timeout=1)
    me, other, o = pz.get_rank(), 1 - pz.get_rank(), {}
    small = pz.Options(slice_bytes=4096, depth=2)  # a send holds 8 KiB in the channel, then waits for its recv
    both_send, lone_recv = pz.new_group([0, 1], options=small), pz.new_group([0, 1], options=small)
    # each rank sends 64 KiB to the other first, then would receive: the sends wait for each other
    o["both_send"] = outcome(lambda: pz.send(torch.ones(16384), dst=other, group=both_send))
    if me == 0:  # a receive whose send never comes (rank 1 is in no call)
        o["lone_recv"] = outcome(lambda: pz.recv(torch.zeros(4), src=1, group=lone_recv))
    else:
        time.sleep(1.5)
    return o


def test_send_and_recv_timeouts_say_what_they_waited_for():
    """A send or recv that times out names its peer and what it waited for, not a peer that "never arrived" (an
    arrival at a collective); two ranks that each send to the other first are told how to order the calls."""
    res = [r.value for r in run_ranks(_rank_p2p_waits, 2, timeout=60)]
    for me, v in enumerate(res):
        etype, msg = v["both_send"]
        assert etype == "CollectiveTimeout", v
        # (the rank that times out second may instead report the first one's giving up, which says the same)
        for words in ("send (rank", "to receive", "batch_isend_irecv", "async_op=True", "order the calls"):
            assert words in msg, (words, msg)
        # the flight recorder shows what the peer is doing: its own send to this rank (no "seq", no "behind")
        assert f"failed in send(count=16384, peer={1 - me}, dtype=float32)" in msg, msg
        assert re.search(rf"rank {1 - me}(: last call| is in) send\(count=16384, peer={me}, dtype=float32\)", msg), msg
        assert "never arrived" not in msg and "behind" not in msg, msg
        assert msg.startswith(f"send (rank {me} of 2): "), msg  # (a send or recv has no sequence number)
    etype, msg = res[0]["lone_recv"]
    assert etype == "CollectiveTimeout" and msg.startswith("recv (rank 0 of 2): timed out after 1 s waiting for rank 1 "
                                                           "to send"), msg
    assert "rank 1 has made no call on this group" in msg, msg
    assert "never arrived" not in msg and "behind" not in msg, msg


def test_missing_rank_times_out():
    before = _segments()
    results = run_ranks(_rank_dies, 2, args=("sleep", False), timeout=60, check=False)
    assert [r.exitcode for r in results] == [0, 0], [r.output for r in results]
    v = results[0].value
    etype, msg = v["first"]
    assert etype == "CollectiveTimeout", v
    assert "timed out" in msg and "rank 1" in msg and "never arrived: [1]" in msg, msg
    assert "all_reduce" in msg and "seq" in msg, msg
    assert 2.5 < v["seconds"] < 10, v  # pz.init(timeout=3)
    # the late rank finds the group aborted (or its peer gone) at once, not after another timeout
    late = results[1].value
    assert late["late"][0] in ("CollectiveError", "CollectiveTimeout"), late
    assert late["late_s"] < 2.5, late
    assert not _segments() - before
