"""pyzero-bench's subcommands: what their results mean (the data and steps each compares, the baselines,
the timings' buffers), their exit status on wrong results or failed tries, and their results files.

Most checks run the subcommands' pure parts or their main() with run_ranks replaced (no processes);
two tiny runs spawn ranks: ps at its defaults, and fsdp2 on one rank."""
from __future__ import annotations

import argparse
import json
import os
import statistics
from types import SimpleNamespace

import pytest
import torch

from pyzero.bench.common import UsageError


def _parser(module):
    p = argparse.ArgumentParser()
    module.add_arguments(p)
    return p


def _fake_run_ranks(monkeypatch, values_for):
    """pyzero.launch.run_ranks replaced: values_for(fn, nprocs, args) -> each rank's value (no processes)."""
    import pyzero.launch as launch

    calls = []

    def run_ranks(fn, nprocs, args=(), **kw):
        calls.append((fn.__name__, args))
        return [SimpleNamespace(rank=i, value=v, output="", exitcode=0)
                for i, v in enumerate(values_for(fn, nprocs, args))]

    monkeypatch.setattr(launch, "run_ranks", run_ranks)
    return calls


# ---- ps ---------------------------------------------------------------------------------------------------


def test_ps_staleness_goes_to_the_bounded_mode_only():
    """pz.ps.serve refuses a staleness for sync and async: --staleness (default 2) is the bounded mode's."""
    from pyzero.bench import ps

    args = _parser(ps).parse_args([])
    assert args.staleness == 2
    assert ps.serve_options("sync", args) == {"mode": "sync"}
    assert ps.serve_options("async", args) == {"mode": "async"}
    assert ps.serve_options("bounded", args) == {"mode": "bounded", "staleness": 2}


def _one_process_ps_reference(args, workers: int, steps: int) -> float:
    """Plain torch: each step the mean loss over the workers' batches (worker w's batch for step s: seed
    s * 1000 + w), AdamW; the held-out loss after `steps` steps."""
    from pyzero.bench.gpt import PRESETS, make_gpt
    from pyzero.bench.ps import structured_batch

    torch.manual_seed(0)
    m = make_gpt(args.model)
    opt = torch.optim.AdamW(m.parameters(), lr=args.lr)
    for s in range(steps):
        opt.zero_grad()
        loss = sum(m(*structured_batch(PRESETS[args.model], args.batch, args.seq, seed=s * 1000 + w))
                   for w in range(workers)) / workers
        loss.backward()
        opt.step()
    x, y = structured_batch(PRESETS[args.model], 32, args.seq, seed=10**7)
    with torch.no_grad():
        return float(m(x, y))


def test_ps_runs_at_its_defaults_and_compares_on_the_same_data(tmp_path, capsys):
    """`pyzero-bench ps` with its default runs and --staleness (sync and async refused the staleness: it
    failed), dp and every pz.ps worker on the same batches: sync, dp's arithmetic, ends where dp does and
    where one process training on both workers' batches does (they trained on different data); the JSON
    records every straggler factor (it had the last one)."""
    from pyzero.bench import __main__ as bench
    from pyzero.bench import ps

    out = tmp_path / "ps.json"
    argv = ["--samples", "16", "--batch", "4", "--seq", "8", "--straggler", "1", "--json", str(out)]
    assert bench.main(["ps", *argv]) == 0
    rec = json.loads(out.read_text())
    rows = {r["run"]: r for r in rec["results"]}
    assert sorted(rows) == sorted(ps.RUNS)
    args = _parser(ps).parse_args(argv)
    want = _one_process_ps_reference(args, workers=2, steps=16 // (4 * 2))
    assert rows["dp"]["loss"] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert rows["sync"]["loss"] == pytest.approx(want, rel=1e-5, abs=1e-5)
    assert rec["bench"] == "ps" and rec["args"]["straggler"] == [1.0]
    assert "staleness 2 (bounded)" in capsys.readouterr().out


def test_ps_writes_every_straggler_factor(tmp_path, monkeypatch):
    """--straggler 1,3: each factor's runs see that factor; the JSON's args hold the list."""
    from pyzero.bench import ps

    seen = []

    def values(fn, nprocs, args):
        seen.append(args[-1].straggler)
        return [{"samples": 4, "t0": 0.0, "t1": 1.0, "eval": 5.0, "max_gap": 0}] * nprocs

    _fake_run_ranks(monkeypatch, values)
    out = tmp_path / "ps.json"
    args = _parser(ps).parse_args(["--runs", "dp,async", "--straggler", "1,3", "--json", str(out)])
    assert ps.main(args) == 0
    assert seen == [1.0, 1.0, 3.0, 3.0]
    rec = json.loads(out.read_text())
    assert rec["args"]["straggler"] == [1.0, 3.0] and [r["straggler"] for r in rec["results"]] == [1, 1, 3, 3]


# ---- usage errors -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, flag", [
    (["train", "--runs", "bogus"], "--runs: unknown ['bogus']"),
    (["train", "--threads", "0"], "--threads: expected >= 1, got 0"),
    (["train", "--memory-steps", "-3"], "--memory-steps: expected >= 1, got -3"),
    (["train", "--model", "gpt-huge"], "--model: expected one of"),
    (["capacity", "--attempts", "0"], "--attempts: expected a positive count, got 0"),
    (["capacity", "--runs", "bogus"], "--runs: unknown ['bogus']"),
    (["ps", "--runs", "bogus"], "--runs: expected a comma list of"),
    (["ps", "--straggler", "abc"], "--straggler: expected a comma list of floats, got 'abc'"),
    (["ps", "--straggler", "0.5"], "--straggler: expected floats >= 1, got '0.5'"),
    (["ps", "--workers", "0"], "--workers: expected >= 1, got 0"),
    (["ps", "--samples", "2"], "--samples: expected >= --batch x --workers = 16, got 2"),
    (["soak", "--nproc", "1"], "--nproc: expected rank counts >= 2, got [1]"),
    (["hier", "--hosts", "1"], "--hosts: expected >= 2, got 1"),
    (["hier", "--per-host", "0"], "--per-host: expected >= 1, got 0"),
    (["hier", "--configs", "bogus"], "--configs: expected a comma list of"),
    (["hier", "--throttle", "100", "--hosts", "3"], "--throttle: expected --hosts 2"),
    (["tp", "--ops", "bogus"], "--ops: expected some of ('all_gather_matmul', 'matmul_reduce_scatter')"),
    (["tp", "--compute", "bogus"], "--compute: expected some of ('matmul', 'sleep')"),
    (["tp", "--widths", "abc"], "--widths: expected a comma list of ints, got 'abc'"),
    (["tp", "--widths", "4,0"], "--widths: expected ints >= 1, got '4,0'"),
    (["pipeline", "--compute", "bogus"], "--compute: expected some of ('matmul', 'sleep')"),
])
def test_bench_usage_errors_exit_2_before_any_rank(argv, flag, capsys, monkeypatch):
    """A bad flag value is a usage error (exit 2, the flag named, as argparse's own) found before any rank
    starts: these exited 1 (SystemExit(message)), ended in a traceback (ps --straggler abc) or failed inside
    the ranks (tp --ops / --compute / --widths)."""
    import pyzero.launch as launch
    from pyzero.bench import __main__ as bench

    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: pytest.fail("a rank started"))
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"pyzero-bench {argv[0]}: error: {flag}" in err, err


@pytest.mark.parametrize("argv, flag", [
    (["optim", "--runs", "bogus"], "--runs: expected some of ('pz', 'torch-foreach', 'torch-fused', 'deepspeed'), "
                                   "got 'bogus' (unknown ['bogus'])"),
    (["optim", "--runs", ","], "--runs: expected some of ('pz', 'torch-foreach', 'torch-fused', 'deepspeed'), "
                               "got ','"),
    (["optim", "--runs", "deepspeed"], "--runs deepspeed: the only run, and DeepSpeed's CPUAdam is unavailable "
                                       "(DeepSpeed is not installed)"),
    (["optim", "--steps", "bogus"], "--steps: expected some of ('plain', 'offload'), got 'bogus'"),
    (["optim", "--tensors", "0"], "--tensors: expected 1 to 1048576 (the smallest size), got 0"),
    (["optim", "--min", "4K", "--tensors", "5000000"],
     "--tensors: expected 1 to 4096 (the smallest size), got 5000000"),
    (["optim", "--nvme-path", "/nonexistent"], "--nvme-path: '/nonexistent' does not exist"),
    # the largest size's swap files: 1M elements in one sub-group (8M), 2 fp32 states
    (["optim", "--max", "1M", "--nvme-path", "TMP"],
     "--nvme-path: 'TMP' has 1.00 MiB free, the swap files need 8.00 MiB"),
    # 1M + 5 elements in sub-groups of 512K: 512K, 512K and 5 (one 4 KiB page a state)
    (["optim", "--min", "1048581", "--max", "1048581", "--sub-group", "512K", "--nvme-path", "TMP"],
     "--nvme-path: 'TMP' has 1.00 MiB free, the swap files need 8.01 MiB"),
    (["moments", "--steps", "10"], "--warmup-compare: expected 0 to 9 (fewer than --steps 10), got 10"),
    (["moments", "--warmup-compare", "-2"], "--warmup-compare: expected 0 to 99 (fewer than --steps 100), got -2"),
    (["moments", "--threads", "-1"], "--threads: expected >= 1, got -1"),
    (["moments", "--threads", "0", "--step-elems", "1000"], "--threads: expected >= 1, got 0"),
    (["moments", "--runs", ","], "--runs: expected names from ('torch', 'fp32', 'bf16', 'int8'), got ','"),
])
def test_optim_and_moments_usage_errors_exit_2_before_anything_runs(argv, flag, capsys, monkeypatch, tmp_path):
    """pyzero-bench optim and moments: a bad flag value exits 2 naming the flag, before any timing or training
    (--runs/--steps/--tensors exited 1; an empty --runs, or deepspeed alone without DeepSpeed, ran nothing and
    exited 0; a bad --nvme-path failed after every other run; moments' --steps below --warmup-compare failed
    after training, a negative --warmup-compare compared the last steps, --threads -1 was torch's error)."""
    import sys

    from pyzero.bench import __main__ as bench
    from pyzero.bench import moments, optim

    for module, names in ((optim, ("stream_probe", "time_runs", "nvme_rows")),
                          (moments, ("markov_batches", "train", "time_steps"))):
        for name in names:
            monkeypatch.setattr(module, name, lambda *a, name=name, **k: pytest.fail(f"{name} ran"))
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # (not installed, wherever the test runs)
    monkeypatch.setattr(os, "statvfs", lambda _: SimpleNamespace(f_bavail=256, f_frsize=4096))  # 1 MiB free
    argv = [str(tmp_path) if a == "TMP" else a for a in argv]
    with pytest.raises(SystemExit) as info:
        bench.main(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"pyzero-bench {argv[0]}: error: {flag.replace('TMP', str(tmp_path))}" in err, err


def test_optim_nvme_hidden_fraction_is_the_documented_one(tmp_path, monkeypatch):
    """The NVMe table's hidden = 1 - (nvme - ram) / io, clamped to [0, 1] (it was (ram + io - nvme) /
    min(ram, io), 0.98 for these timings: the share of the compute, not of the I/O, hidden), from the times of
    the RAM step, the NVMe step and the I/O alone (here the stored optim_nvme_cpu2_20261125 record's at 16M)."""
    from pyzero.bench import optim

    times = iter([8.27854100134573e-3, 150.46840849754517e-3, 150.2964739993331e-3])
    monkeypatch.setattr(optim, "_median_s", lambda fn, iters, warmup: next(times))
    args = SimpleNamespace(sub_group="4K", nvme_path=str(tmp_path), iters=1, warmup=0)
    (row,) = optim.nvme_rows(args, [4096], 1)
    assert row["hidden"] == pytest.approx(1 - (150.46840849754517 - 8.27854100134573) / 150.2964739993331)
    assert row["hidden"] == pytest.approx(0.0539374, abs=1e-6)
    assert optim.hidden_fraction(0.05, 0.10, 0.10) == pytest.approx(0.5)  # half the I/O behind the compute
    assert optim.hidden_fraction(0.05, 0.05, 0.10) == 1.0  # all of it
    assert optim.hidden_fraction(0.05, 0.04, 0.10) == 1.0  # faster than RAM (noise): clamped
    assert optim.hidden_fraction(0.05, 0.20, 0.10) == 0.0  # slower than the two in series: clamped
    assert os.listdir(tmp_path) == []  # (the optimizer closed its swap files)


@pytest.mark.parametrize("argv, flag", [
    (["--iters", "0"], "--iters: expected >= 1, got 0"),
    (["--iters", "-3"], "--iters: expected >= 1, got -3"),
    (["--sizes-mb", "0"], "--sizes-mb: expected ints >= 1, got '0'"),
    (["--sizes-mb", "abc"], "--sizes-mb: expected a comma list of ints, got 'abc'"),
    (["--sizes-mb", ","], "--sizes-mb: expected ints >= 1, got ','"),
])
def test_kernels_bad_flags_exit_2_before_the_gpu_check(argv, flag, capsys):
    """python -m pyzero.bench.kernels: bad --iters / --sizes-mb exit 2 naming the flag, on any machine (they were
    checked only after the GPU check, then a ZeroDivisionError, negative GB/s or a ValueError traceback)."""
    from pyzero.bench import kernels

    with pytest.raises(SystemExit) as info:
        kernels.main(argv)
    assert info.value.code == 2
    assert f"error: {flag}" in capsys.readouterr().err


# ---- train ------------------------------------------------------------------------------------------------


def test_train_warmup_0_runs_and_fsdp2_nocomm_steps_the_shards_without_leaking(tmp_path):
    """--warmup 0 runs (a StatisticsError); fsdp2's nocomm step is a real AdamW step on the shards (zero
    gradients: it skipped the step, losses repeated) and its local gradients never reach the next synced step
    (they were added into it): at one rank its curve is one process's, synced steps with the batch's
    gradient, nocomm steps with zero ones, in the bench's order (memory step, then synced/nocomm pairs)."""
    from pyzero.bench import train
    from pyzero.bench.gpt import make_gpt, random_batch

    out = tmp_path / "t.json"
    args = _parser(train).parse_args(["--model", "gpt-nano", "--runs", "torch-local,fsdp2", "--nproc", "1",
                                      "--batch", "2", "--seq", "8", "--iters", "2", "--warmup", "0",
                                      "--memory-steps", "1", "--timeout", "120", "--json", str(out)])
    assert train.main(args) == 0
    local, fsdp2 = json.loads(out.read_text())["results"]
    torch.set_num_threads(1)
    m = make_gpt("gpt-nano")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-4)
    x, y = random_batch(m.config, 2, 8, seed=1000)
    want = []
    for nocomm in (False, False, True, False, True):
        opt.zero_grad(set_to_none=True)
        loss = m(x, y)
        loss.backward()
        if nocomm:
            for p in m.parameters():
                p.grad = torch.zeros_like(p)
        opt.step()
        want.append(loss.item())
    assert fsdp2["losses"] == pytest.approx(want, rel=1e-5), (fsdp2["losses"], want)
    assert len(set(fsdp2["losses"])) == 5
    assert fsdp2["nocomm_ms"] > 0 and local["losses"][:2] == pytest.approx(want[:2], rel=1e-5)


def test_train_zero_comm_alone_reduces_in_the_runs_dtype(monkeypatch):
    """The ZeRO runs' comm ms times the collectives in the run's dtypes: gradients reduce-scattered in
    --comm-dtype (stages 2-3; they were fp32 scratch buffers), parameters gathered in the model's; stage 1
    reduces in the model's dtype."""
    import pyzero as pz
    from pyzero.bench import train
    from pyzero.zero.optimizer import CollectiveCall

    seen = []

    def record(op):
        def call(o, i, **kw):
            seen.append((op, o.dtype, i.dtype))
            return SimpleNamespace(wait=lambda: None)
        return call

    monkeypatch.setattr(pz, "reduce_scatter", record("reduce_scatter"))
    monkeypatch.setattr(pz, "all_gather", record("all_gather"))
    plan = [[CollectiveCall("reduce_scatter", 8, None), CollectiveCall("reduce_scatter", 6, [4, 2])],
            [CollectiveCall("all_gather", 8, None)]]
    for stage, comm, want in ((2, torch.bfloat16, torch.bfloat16), (3, torch.float16, torch.float16),
                              (1, torch.float32, torch.float32)):
        seen.clear()
        opt = SimpleNamespace(group=SimpleNamespace(rank=1, size=2), device=torch.device("cpu"), stage=stage,
                              comm_plan=lambda: plan, comm_dtype=comm, param_dtype=None, params=[torch.zeros(2)])
        train._zero_comm_alone(opt)()
        assert seen == [("reduce_scatter", want, want)] * 2 + [("all_gather", torch.float32, torch.float32)]


def test_train_rounds_hidden_from_the_median_times():
    """--rounds: hidden is 1 - median exposed / median comm, as the medians it is printed beside (it was
    round 1's); each round's kept."""
    from pyzero.bench import train

    exposed, comm = [1.0, 3.0, 2.0], [4.0, 4.0, 10.0]
    rounds = [{"run": "dp", "step_ms": 10.0 + i, "comm_ms": c, "exposed_ms": e, "hidden": 1 - e / c,
               "peak_mib": [1.0], "loss": 1.0} for i, (e, c) in enumerate(zip(exposed, comm))]
    got = train._over_rounds(rounds, SimpleNamespace(nproc=1, batch=1, seq=1))
    assert got["hidden"] == pytest.approx(1 - statistics.median(exposed) / statistics.median(comm))  # 0.5
    assert got["hidden"] == pytest.approx(0.5) and got["hidden_rounds"] == [0.75, 0.25, 0.8]
    text = train.rounds_table([got])
    assert "hidden: 1 - median exposed / median comm" in text and text.splitlines()[-1].endswith(" 50.0%")


def test_train_bucket_caps_per_run():
    """--first-bucket-mb reaches dp only: each run says the caps it reduces with."""
    from pyzero.bench import train

    args = SimpleNamespace(first_bucket_mb=0.25, bucket_mb=2.0)
    assert train.bucket_caps("dp", args) == "first 0.25 MiB, then 2 MiB"
    assert train.bucket_caps("torch-ddp", args).startswith("2 MiB caps (DDP's bucket_cap_mb; its first bucket is")
    assert train.bucket_caps("zero2", args).startswith("2 MiB (ZeroOptimizer's bucket_mb")
    assert train.bucket_caps("torch-local", args) is None and train.bucket_caps("fsdp2", args) is None


# ---- hier, tp ---------------------------------------------------------------------------------------------


def _hier_values(wrong_on_rank1=0):
    def values(fn, nprocs, args):
        if fn.__name__ == "_collectives_rank":
            row = {"bytes": 64, "count": 16, "hier_s": 1e-5, "gloo_s": 2e-5, "hier_busbw": 1.0, "gloo_busbw": 0.5}
            return [[dict(row, wrong=wrong_on_rank1 if r == 1 else 0)] for r in range(nprocs)]
        name = args[0]
        b, loss = {"plain": (1000.0, 2.0), "qwz": (500.0, 2.2), "hpz": (250.0, 1.9)}[name]
        return [{"inter_bytes_per_step": b, "step_s": 0.01, "loss": loss}] * nprocs
    return values


def test_hier_vs_plain_is_against_plain_wherever_it_is_listed(tmp_path, monkeypatch, capsys):
    """"vs plain" is against the plain config though --configs names it last (it was the first config);
    the JSON names the bench."""
    from pyzero.bench import hier

    calls = _fake_run_ranks(monkeypatch, _hier_values())
    out = tmp_path / "h.json"
    args = _parser(hier).parse_args(["--parts", "zero", "--configs", "qwz,hpz,plain", "--json", str(out)])
    assert hier.main(args) == 0
    assert [a[0] for _, a in calls] == ["plain", "qwz", "hpz"]  # the baseline runs first
    rows = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()
            if line.split()[:1] in (["plain"], ["qwz"], ["hpz"])}
    assert rows["qwz"][2] == "2.00x" and rows["hpz"][2] == "4.00x" and rows["plain"][2] == "1.00x"
    assert rows["qwz"][5] == "+10.00%" and rows["hpz"][5] == "-5.00%"
    assert json.loads(out.read_text())["bench"] == "hier"
    args = _parser(hier).parse_args(["--parts", "zero", "--configs", "qwz,hpz"])
    assert hier.main(args) == 0
    text = capsys.readouterr().out
    assert "no plain config in --configs" in text
    assert [line.split()[2] for line in text.splitlines() if line.startswith("     qwz")] == ["-"]


def test_hier_counts_every_ranks_wrong_results_and_exits_1(monkeypatch, capsys):
    """A wrong all_reduce result on rank 1 (rank 0's right) is counted and the bench exits 1 (it counted
    rank 0's only, and exited 0 on wrong results)."""
    from pyzero.bench import hier

    _fake_run_ranks(monkeypatch, _hier_values(wrong_on_rank1=3))
    assert hier.main(_parser(hier).parse_args(["--parts", "collectives", "--per-host", "1"])) == 1
    assert "# total #wrong (elements, summed over the ranks): 3" in capsys.readouterr().out
    _fake_run_ranks(monkeypatch, _hier_values(wrong_on_rank1=0))
    assert hier.main(_parser(hier).parse_args(["--parts", "collectives", "--per-host", "1"])) == 0


def test_tp_exit_status_counts_every_rank(monkeypatch):
    """tp exits 1 when any rank's overlapped result is off (rank 0's alone decided), NaN included."""
    from pyzero.bench import tp

    def values(bad):
        def fn(f, nprocs, args):
            row = {"op": "all_gather_matmul", "compute": "matmul", "width": 4, "balance": 1.0, "speedup": 1.0,
                   "ring_speedup": 1.0}
            return [[dict(row, rel_err=bad if r == 1 else 1e-7)] for r in range(nprocs)]
        return fn

    args = _parser(tp).parse_args(["--ops", "all_gather_matmul", "--compute", "matmul", "--widths", "4"])
    for bad, code in ((1e-7, 0), (0.5, 1), (float("nan"), 1)):
        _fake_run_ranks(monkeypatch, values(bad))
        assert tp.main(args) == code, bad
    assert tp.wrong_rows([[{"rel_err": 1e-7}], [{"rel_err": 2e-4}]]) == [{"rel_err": 2e-4}]


# ---- capacity ---------------------------------------------------------------------------------------------


def _capacity_args(*extra):
    from pyzero.bench import capacity

    return _parser(capacity).parse_args(["--device", "cpu", "--device-gb", "1", "--host-gb", "8", "--n-embd", "32",
                                         "--n-head", "2", "--vocab", "64", "--seq", "16", "--max-layers", "4",
                                         "--attempts", "3", "--runs", "torch", *extra])


@pytest.mark.parametrize("how, outcome", [("crash", "error"), ("deadline", "timeout")])
def test_capacity_a_crash_or_deadline_is_no_fit_and_exits_1(how, outcome, monkeypatch, tmp_path, capsys):
    """A try that crashed (not out of memory) or ran past --timeout says nothing about the size: reported,
    the run's search stops, the bench exits 1 (both read as "does not fit", exit 0)."""
    import pyzero.launch as launch
    from pyzero.bench import capacity

    tried = []

    def run_ranks(fn, nprocs, args=(), **kw):
        n = args[1].n_layer
        tried.append(n)
        if n >= 3:
            code, output = (1, "Traceback ...\nKeyError: 'x'") if how == "crash" else (None, "")
            raise launch.RankFailure("rank 0 failed", [launch.RankResult(0, code, None, output)])
        return [SimpleNamespace(value={"run": "torch", "layers": n, "params": 1, "ok": True, "step_s": 1.0,
                                       "tokens_per_s": 16.0, "peak_device_gb": None, "peak_rss_gb": 0.1})]

    monkeypatch.setattr(launch, "run_ranks", run_ranks)
    monkeypatch.setattr(capacity, "predicted_layers", lambda *a: 2)
    out = tmp_path / "c.json"
    assert capacity.main(_capacity_args("--json", str(out))) == 1
    assert tried == [2, 3]  # the search stopped at the failed try
    (row,) = json.loads(out.read_text())["results"]
    assert row["layers"] == 2 and [t["outcome"] for t in row["tried"]] == ["fits", outcome]
    assert [t["layers"] for t in row["failed"]] == [3]
    text = capsys.readouterr().out
    assert f"# torch at 3 layers failed ({outcome}, not out of memory)" in text
    assert "1 try failed for another reason than memory" in text


def test_capacity_out_of_memory_is_does_not_fit(monkeypatch):
    """Out of memory (on a rank of several, or a CPU allocation) is the size not fitting: exit 0."""
    import pyzero.launch as launch
    from pyzero.bench import capacity

    def run_ranks(fn, nprocs, args=(), **kw):
        n = args[1].n_layer
        if n >= 3:
            raise launch.RankFailure("x", [launch.RankResult(1, 3, None, "device out of memory: CUDA out of")])
        return [SimpleNamespace(value={"run": "torch", "layers": n, "params": 1, "ok": True, "step_s": 1.0,
                                       "tokens_per_s": 16.0, "peak_device_gb": None, "peak_rss_gb": 0.1})]

    monkeypatch.setattr(launch, "run_ranks", run_ranks)
    monkeypatch.setattr(capacity, "predicted_layers", lambda *a: 2)
    assert capacity.main(_capacity_args()) == 0
    assert capacity.out_of_memory(RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to ..."))
    assert capacity.out_of_memory(torch.OutOfMemoryError("CUDA out of memory"))
    assert not capacity.out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied"))


# ---- soak -------------------------------------------------------------------------------------------------


def test_soak_writes_json_with_machine_versions_and_date(tmp_path, monkeypatch):
    from pyzero.bench import soak

    got = {"nproc": 2, "seconds": 1.0, "calls": {"all_reduce": 7}, "total_calls": 7, "wrong": 0, "notes": []}
    monkeypatch.setattr(soak, "soak", lambda seconds, n, seed: dict(got, nproc=n))
    out = tmp_path / "s.json"
    args = _parser(soak).parse_args(["--seconds", "1", "--nproc", "2", "3", "--json", str(out)])
    assert soak.main(args) == 0
    rec = json.loads(out.read_text())
    assert {"machine", "versions", "date"} <= set(rec) and rec["bench"] == "soak"
    assert rec["args"]["nproc"] == [2, 3] and [r["nproc"] for r in rec["results"]] == [2, 3]
    with pytest.raises(UsageError, match="--nproc: expected rank counts >= 2"):
        soak.main(_parser(soak).parse_args(["--nproc", "1"]))
