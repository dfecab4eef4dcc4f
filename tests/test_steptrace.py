"""pyzero-bench train --profile (pyzero/bench/steptrace.py): the device timeline of a step (busy, waiting,
the longest waits and what surrounds them) from hand-made intervals, a profiled CPU step, and the bench
writing each run's trace and summary."""
import argparse
import json

import pytest
import torch

from pyzero.bench import steptrace


def test_merge_joins_overlapping_and_touching_intervals():
    assert steptrace.merge([(5, 7), (0, 2), (1, 3), (3, 4), (9, 9)]) == [(0, 4), (5, 7), (9, 9)]
    assert steptrace.merge([]) == []


def test_device_timeline_counts_busy_and_waiting_time_and_names_the_waits():
    # step 0..100 us; kernels a 10-30, b 25-40 (overlaps a), c 70-75, d 95-130 (cut at the step's end),
    # e -20..-5 (before the step: left out)
    work = [(10, 30, "a"), (25, 40, "b"), (70, 75, "c"), (95, 130, "d"), (-20, -5, "e")]
    t = steptrace.device_timeline(work, 0, 100, top=3, min_gap=15)
    assert t["step_us"] == 100 and t["busy_us"] == 30 + 5 + 5 and t["idle_us"] == 60
    # idle: 0-10 (start -> a), 40-70 (b -> c), 75-95 (c -> d); b ends last in the first busy stretch
    assert t["longest"] == [(30, "b", "c"), (20, "c", "d"), (10, "(step start)", "a")]
    assert t["gaps"] == 2  # (the 10 us one is under min_gap)
    t = steptrace.device_timeline([(0, 50, "x")], 0, 80)
    assert t["longest"] == [(30, "x", "(step end)")] and t["busy_us"] == 50
    t = steptrace.device_timeline([], 0, 10)
    assert t["idle_us"] == 10 and t["longest"] == [(10, "(step start)", "(step end)")]
    with pytest.raises(ValueError, match="end: expected >= start"):
        steptrace.device_timeline([], 10, 5)


def _event(name, kind, start, end, device="cuda", annotation=False):
    from types import SimpleNamespace

    e = SimpleNamespace(name=name, time_range=SimpleNamespace(start=start, end=end), is_user_annotation=annotation,
                        device_type=getattr(torch.autograd.DeviceType, device.upper()))
    if kind is not None:
        e.activity_type = kind
    return e


@pytest.mark.parametrize("kinds", [True, False])
def test_device_work_keeps_kernels_copies_and_memsets_not_the_scopes_on_the_device(kinds):
    """With torch's activity types (newer torch) and without them (2.11: the host scopes' names)."""
    def k(kind):
        return kind if kinds else None

    events = [_event("pyzero.bench.step", "user_annotation", 0, 100, "cpu", True),
              _event("FSDP::all_gather", "user_annotation", 5, 50, "cpu", True),
              _event("aten::mm", "cpu_op", 1, 2, "cpu"),
              _event("cudaLaunchKernel", "cuda_runtime", 1, 2, "cpu"),
              _event("pyzero.bench.step", k("gpu_user_annotation"), 3, 99),
              _event("FSDP::all_gather", k("gpu_user_annotation"), 6, 40),
              _event("sgemm", k("kernel"), 3, 20),
              _event("Memcpy DtoD", k("gpu_memcpy"), 21, 25),
              _event("Memset", k("gpu_memset"), 26, 27)]
    assert steptrace.device_work(events) == [(3, 20, "sgemm"), (21, 25, "Memcpy DtoD"), (26, 27, "Memset")]


def test_profile_step_on_cpu_writes_the_trace_and_names_the_host_work(tmp_path):
    a = torch.randn(64, 64)
    path = tmp_path / "trace.json"

    def step():
        for _ in range(3):
            a.mm(a)

    p = steptrace.profile_step(step, False, str(path))
    assert p["wall_ms"] > 0 and "device" not in p
    ops = {name: n for name, n, _ in p["host_ops"]}
    assert ops.get("aten::mm") == 3
    trace = json.loads(path.read_text())
    names = {e.get("name") for e in trace["traceEvents"]}
    assert "pyzero.bench.step" in names and "aten::mm" in names


def test_bench_train_profile_writes_each_runs_trace_and_summary(tmp_path, capsys):
    from pyzero.bench import train as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "train.json"
    prof = tmp_path / "prof"
    args = parser.parse_args(["--model", "gpt-nano", "--runs", "torch-local,dp", "--nproc", "2", "--iters", "2",
                              "--warmup", "1", "--seq", "16", "--timeout", "60", "--profile", str(prof),
                              "--json", str(out)])
    assert bench.main(args) == 0
    text = capsys.readouterr().out
    assert "# profile: one synced step per run" in text
    local, dp = json.loads(out.read_text())["results"]
    for r in (local, dp):
        assert r["profile"]["wall_ms"] > 0
        names = [name for name, _, _ in r["profile"]["host_ops"]]
        assert any(n.startswith("aten::") for n in names), names
        trace = json.loads((prof / f"{r['run']}_rank0.json").read_text())
        assert any(e.get("name") == "pyzero.bench.step" for e in trace["traceEvents"])
    assert not (prof / "dp_rank1.json").exists()  # (rank 0's only)


def _train_args(*argv):
    from pyzero.bench import train as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    return parser.parse_args(["--model", "gpt-nano", *argv])


def _nano():
    from pyzero.bench.gpt import make_gpt

    model = make_gpt("gpt-nano")
    params = {id(p): p for p in model.parameters()}.values()
    return sum(p.numel() for p in params), max(sum(p.numel() for p in m.parameters(recurse=False))
                                             for m in model.modules())


def test_bench_train_estimate_is_each_runs_own():
    """pyzero-bench train --memory's estimate, by hand for gpt-nano (n parameters, fp32 AdamW: 4n + 4n +
    8n, 2 ranks, 1 MiB buckets = 262,144 elements, more than n): DataParallel's bf16 copies of the
    gradients (2n); torch's ZeroRedundancyOptimizer under DDP, whose buckets hold all gradients through
    backward beside the sharded state; zero2's bf16 reductions staged in 2 bytes (three buckets: all n
    elements, and their bf16 outputs, the rank's n/2); a -offload run of a CUDA model with its host bytes
    (moments 8, gradient shard 4, master 4 per shard element), of a CPU model none (one memory)."""
    from pyzero.bench import train as bench

    n, largest = _nano()
    act = {"bytes": 1e6, "grads_done": 0.0}
    dp = bench._estimate("dp", _train_args("--comm-dtype", "bfloat16"), 2, act)
    assert dp["comm_copies"] == 2 * n and dp["total"] == pytest.approx(16 * n + 2 * n + 1e6)
    assert bench._estimate("dp", _train_args(), 2, act)["comm_copies"] == 0
    tz = bench._estimate("torch-zero", _train_args(), 2, act)
    step = 4 * n + 2 * 4 * min(largest, n / 2)  # gradients + the for-loop step's two temporaries
    assert tz["peak"] == pytest.approx(4 * n + 8 * n / 2 + max(4 * n + 1e6, step))
    z2 = bench._estimate("zero2", _train_args("--comm-dtype", "bfloat16"), 2, act)
    assert n < 262144 and z2["staging"] == pytest.approx(2 * n + 2 * n / 2)
    assert bench._estimate("zero1", _train_args("--comm-dtype", "bfloat16"), 2, act)["staging"] == 0
    gpu = bench._estimate("zero3-offload", _train_args("--device", "cuda"), 2, act)
    assert gpu["host"] == pytest.approx((8 + 4 + 4) * n / 2)
    assert bench._estimate("zero3-offload", _train_args(), 2, act)["host"] == 0


def _zero_setup_rank(argv):
    import pyzero as pz
    from pyzero.bench import train as bench
    from pyzero.bench.gpt import make_gpt

    pz.init()
    args = _train_args(*argv)
    return {run: str(bench.RUNS[run](make_gpt("gpt-nano"), args).optimizer.comm_dtype)
            for run in ("zero1", "zero2", "zero3")}


def test_bench_train_comm_dtype_reaches_zero2_and_zero3():
    """--comm-dtype sets the reductions of the zero2/zero3 runs (it was dropped); zero1 reduces in the
    model's dtype, fp32 here, whatever it says."""
    from pyzero.launch import run_ranks

    (r,) = run_ranks(_zero_setup_rank, 1, args=(["--comm-dtype", "bfloat16"],), timeout=60)
    assert r.value == {"zero1": "torch.float32", "zero2": "torch.bfloat16", "zero3": "torch.bfloat16"}
