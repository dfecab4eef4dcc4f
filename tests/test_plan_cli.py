"""pyzero-plan on the command line, and a smoke run of `pyzero-plan validate`."""
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "pyzero.plan.cli", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT))


def test_cli_ranks_layouts(tmp_path):
    out = tmp_path / "plan.json"
    proc = run("--model", "gpt2-1.5b", "--world", "64", "--gpus-per-host", "8", "--gpu-gb", "80", "--top", "3",
               "--json", str(out))
    assert proc.returncode == 0, proc.stderr
    rows = [line.split() for line in proc.stdout.splitlines() if line[:4].strip().isdigit()]
    assert [r[0] for r in rows] == ["1", "2", "3"]
    assert all(r[1].startswith("dp") for r in rows)
    assert "pruned" in proc.stdout and "heads=25" in proc.stdout  # 25 heads: no TP of 2, 4 or 8
    d = json.loads(out.read_text())
    times = [r["time"]["total"] for r in d["ranked"]]
    assert times[0] == min(times) and d["ranked"][0]["layout"]["tp"] == 1
    assert all(r["memory"]["peak"] <= 80e9 for r in d["ranked"])


@pytest.mark.parametrize("args, named", [(["--world", "8"], "--model"),
                                         (["--model", "no-such.json", "--world", "8"], "--model"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--tflops", "fast"], "--tflops"),
                                         (["validate", "--nproc", "two"], "--nproc"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--ranks-per-core", "0.5"],
                                          "ranks_per_core"),
                                         (["validate", "--rounds", "0"], "--rounds"),
                                         (["validate", "--nproc", "0"], "--nproc"),
                                         (["validate", "--nproc", "2,-1"], "--nproc"),
                                         (["validate", "--batch", "0"], "--batch"),
                                         (["validate", "--seq", "0"], "--seq"),
                                         (["validate", "--timeout", "-5"], "--timeout"),
                                         (["validate", "--timeout", "nan"], "--timeout"),
                                         (["validate", "--json", "/nonexistent/v.json"], "--json"),
                                         (["validate", "--nproc", "2", "--layouts", "dp2 tp1 pp1 zero9 b4x1"],
                                          "--layouts"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--stages", "0,x"], "--stages"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--stages", ""], "--stages"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--top", "-1"], "--top"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--json", "/nonexistent/p.json"],
                                          "--json"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--gpus-per-host", "0"],
                                          "gpus_per_host"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--reserved-gb", "-1"],
                                          "--reserved-gb: expected a finite number >= 0, got -1.0"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--gpu-gb", "-1"],
                                          "--gpu-gb: expected a finite number > 0, got -1.0"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--tflops", "-5"],
                                          "--tflops: expected a finite number > 0, got -5"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--intra-gbps", "0"],
                                          "--intra-gbps: expected a finite number > 0, got 0.0"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--inter-gbps", "nan"],
                                          "--inter-gbps: expected a finite number > 0, got nan"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--op-overhead-us", "-1"],
                                          "--op-overhead-us: expected a finite number >= 0, got -1.0"),
                                         (["--model", "gpt2-1.5b", "--world", "8", "--table-intra", "/nonexistent.json"],
                                          "--table-intra: no such file '/nonexistent.json'")])
def test_cli_bad_input(args, named, capsys):
    """Usage errors exit 2 naming the argument (main() in this process; the command line's own entry
    point runs in the tests above)."""
    from pyzero.plan import cli  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        cli.main(args)
    assert e.value.code == 2 and named in capsys.readouterr().err


def test_cli_ranks_per_core_lengthens_compute(tmp_path):
    """--ranks-per-core 2: the same best layout's compute term doubles (two ranks take turns on a core)."""
    times = {}
    for k in ("1", "2"):
        out = tmp_path / f"plan{k}.json"
        from pyzero.plan import cli  # noqa: PLC0415

        assert cli.main(["--model", "gpt-nano", "--batch", "8", "--world", "2", "--gpus-per-host", "2", "--top", "1",
                         "--stages", "0", "--no-offload", "--ranks-per-core", k, "--json", str(out)]) == 0
        best = json.loads(out.read_text())["ranked"][0]
        times[k] = (best["layout"], best["time"]["compute"])
    assert times["1"][0] == times["2"][0]
    assert times["2"][1] == pytest.approx(2 * times["1"][1])


def test_measured_throughput_feeds_the_plan():
    proc = run("--model", "gpt-nano", "--batch", "8", "--world", "2", "--gpus-per-host", "2", "--tflops", "measure",
               "--top", "1")
    assert proc.returncode == 0, proc.stderr
    measured = float(proc.stdout.split("# measured ")[1].split()[0])
    used = float(proc.stdout.split(" TFLOP/s each")[0].rsplit(" ", 1)[1])
    assert 0 < measured < 1e4 and used == pytest.approx(measured, rel=1e-2)


def test_validate_smoke(tmp_path):
    """Two tiny layouts, one short step each: model states measured equal the prediction."""
    out = tmp_path / "v.json"
    proc = run("validate", "--nproc", "2", "--model", "gpt-nano", "--seq", "32", "--steps", "1", "--warmup", "1",
               "--rounds", "2", "--layouts", "dp2 tp1 pp1 zero2 b4x1;dp1 tp2 pp1 zero0 b8x1 sp", "--json", str(out),
               timeout=180)
    assert proc.returncode == 0, proc.stderr + proc.stdout
    d = json.loads(out.read_text())
    assert sorted(r["layout"] for r in d["results"]) == ["dp1 tp2 pp1 zero0 b8x1 sp", "dp2 tp1 pp1 zero2 b4x1"]
    for r in d["results"]:
        assert abs(r["states_error"]) < 0.01, r
        assert r["measured_s"] > 0 and r["predicted_s"] > 0
        assert len(r["measured_runs_s"]) == 2 and r["measured_s"] == pytest.approx(sum(r["measured_runs_s"]) / 2)
    assert d["spearman"] in (-1.0, 1.0)
    # the measured call cost feeds the model: "calls" = its calls per step (dp2 zero2: one bucket's reduce-scatter
    # and the gather after the step) x that cost
    cost = d["op_overhead_s"]["2"]
    assert 0 <= cost < 0.1
    calls = {"dp2 tp1 pp1 zero2 b4x1": 2, "dp1 tp2 pp1 zero0 b8x1 sp": 2 * 8}  # 2 layers x 8 TP calls
    for r in d["results"]:
        assert r["op_overhead"] == cost
        assert r["predicted"]["calls"] == pytest.approx(cost * calls[r["layout"]])


def test_shape_flags_change_a_named_model():
    """--layers (and --hidden, --heads, --vocab) with --model change that model's shape (they were ignored)."""
    whole = run("--model", "gpt2-1.5b", "--world", "8", "--top", "1")
    cut = run("--model", "gpt2-1.5b", "--world", "8", "--top", "1", "--layers", "4")
    assert whole.returncode == 0 and cut.returncode == 0, whole.stderr + cut.stderr
    assert "L=48" in whole.stdout.splitlines()[0] and "1.56B parameters" in whole.stdout.splitlines()[0]
    head = cut.stdout.splitlines()[0]
    assert "with layers=4" in head and "L=4 " in head and "0.205B parameters" in head, head
