"""scripts/gpu_check.sh on a machine without a GPU, with stand-ins for python3, nvidia-smi and the MPS control
daemon that record each call instead of running it: the parts run in the order GPU_CHECK_PARTS names them, the
several-processes parts under MPS and the rest outside it, GPU_CHECK_DEADLINE skips the parts it leaves too
little time for, GPU_CHECK_TESTS_AT_ONCE runs the test groups together and the later parts do not rerun them,
bad settings are refused; and every bench call the script can make parses with that bench's own arguments
(flags, choices, run names, fault cells), so a renamed flag fails here rather than on a lent GPU."""
import argparse
import datetime
import importlib
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
ALL_PARTS = ("tests kernels collectives train torch-backend memory offload capacity ipc ipc-graph ipc-algos faults "
             "nccl-multi nccl-faults").split()

FAKE_PYTHON = """#!/bin/bash
case "$*" in
  -) cat >/dev/null; exit 0;;
  *get_device_capability*) echo 90; exit 0;;
  *get_device_name*) echo NVIDIA_H200; exit 0;;
  *device_count*) echo "${FAKE_NGPU:-1}"; exit 0;;
  *"import pytest_timeout"*) exit 0;;
  *"import deepspeed"*) exit 1;;
  *build_info*) echo "(build info)"; exit 0;;
esac
echo "CALL ${CUDA_MPS_PIPE_DIRECTORY:-none} ${PYZERO_NCCL_ROOT:-none} $*" >> "$FAKE_LOG"
# FAKE_SLEEP / FAKE_FAIL: a call whose arguments contain it hangs (and says its pid) / fails
if [ -n "${FAKE_SLEEP:-}" ] && [[ "$*" == *"$FAKE_SLEEP"* ]]; then echo "SLEEP $$" >> "$FAKE_LOG"; exec sleep 60; fi
if [ -n "${FAKE_FAIL:-}" ] && [[ "$*" == *"$FAKE_FAIL"* ]]; then exit 1; fi
"""
FAKE_MPS = """#!/bin/bash
[ "$1" = -d ] || cat >/dev/null
echo "MPSDIR ${1:-quit} ${CUDA_MPS_PIPE_DIRECTORY:-none}" >> "$FAKE_LOG"
echo "MPS ${1:-quit}" >> "$FAKE_LOG"
[ "$1" != -d ] || [ -z "${FAKE_MPS_FAIL:-}" ] || exit 1
# (the daemon's control pipe: there while it runs)
if [ "$1" = -d ]; then touch "$CUDA_MPS_PIPE_DIRECTORY/control"; else rm -f "$CUDA_MPS_PIPE_DIRECTORY/control"; fi
"""


def _fakes(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    for name, text in (("python3", FAKE_PYTHON), ("nvidia-cuda-mps-control", FAKE_MPS),
                       ("nvidia-smi", '#!/bin/bash\necho "NVIDIA H200, 580, 143771 MiB"\n')):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    lib = tmp_path / "test-nccl" / "lib"
    lib.mkdir(parents=True)
    (lib / "libnccl.so.2").write_text("")
    return bin_dir


def _env(tmp_path, env):
    bin_dir = _fakes(tmp_path)
    full = {k: v for k, v in os.environ.items()
            if not k.startswith(("GPU_CHECK_", "CUDA_MPS_", "PYZERO_", "FAKE_"))}
    full.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHON=str(bin_dir / "python3"),
                FAKE_LOG=str(tmp_path / "calls.log"), GPU_CHECK_RESULTS=str(tmp_path / "results"),
                GPU_CHECK_BUILD="0", PYZERO_TEST_NCCL_ROOT=str(tmp_path / "test-nccl"))
    full.update(env)
    return full


def _log_lines(tmp_path):
    log = tmp_path / "calls.log"
    return log.read_text().splitlines() if log.exists() else []


def run_check(tmp_path, **env):
    """Runs the script with the stand-ins; returns (exit code, printed text, [(mps on, nccl root, argv)], [lines])."""
    p = subprocess.run(["bash", str(SCRIPT)], env=_env(tmp_path, env), capture_output=True, text=True, timeout=60)
    lines = _log_lines(tmp_path)
    calls = []
    for line in lines:
        if line.startswith("CALL "):
            _, mps, nccl_root, rest = line.split(" ", 3)
            if not rest.startswith("-m pip "):  # (DeepSpeed's wheels, where a build/wheels is here)
                calls.append((mps != "none", nccl_root, shlex.split(rest)))
    return p.returncode, p.stdout + p.stderr, calls, lines


def _what(argv):
    """A short name for a call: 'pytest <files>', 'bench <sub> [extra]', 'kernels'."""
    if argv[:2] == ["-m", "pytest"]:
        return "pytest " + " ".join(a for a in argv if a.startswith("tests/") and a != "tests/")
    if argv[:2] == ["-m", "pyzero.bench.kernels"]:
        return "kernels"
    assert argv[:2] == ["-m", "pyzero.bench"], argv
    return "bench " + argv[2]


def test_parts_run_in_the_named_order_with_mps_only_for_several_processes(tmp_path):
    rc, out, calls, lines = run_check(tmp_path, GPU_CHECK_PARTS="torch-backend kernels ipc-graph nccl-faults")
    assert rc == 0, out
    assert [(_what(a), mps) for mps, _, a in calls] == [
        ("bench collectives", False), ("bench train", False),  # torch-backend: world size 1, alone
        ("kernels", False),
        ("bench collectives", True), ("bench collectives", True),  # ipc-graph: 2 processes, eager and captured
        ("bench faults", True)]
    assert [a[a.index("--graph") + 1] for _, _, a in calls[3:5]] == ["0", "20"]
    assert calls[5][1] == str(tmp_path / "test-nccl")  # (the nccl fault cells load the test library)
    assert lines[-1] == "MPS quit"  # (stopped at the end)
    assert out.index("part torch-backend") < out.index("part kernels") < out.index("part ipc-graph")


def test_deadline_skips_what_it_leaves_too_little_time_for(tmp_path):
    rc, out, calls, _ = run_check(tmp_path, GPU_CHECK_PARTS="kernels offload ipc-graph", GPU_CHECK_DEADLINE="100")
    assert rc == 0, out
    # kernels (30 s) and ipc-graph (50 s) fit in 100 s; offload (330 s) does not: skipped, and said so
    assert [_what(a) for _, _, a in calls] == ["kernels", "bench collectives", "bench collectives"]
    assert "skipped the offload part" in out and "GPU_CHECK_DEADLINE=100" in out
    rc, out, calls, _ = run_check(tmp_path / "again", GPU_CHECK_PARTS="kernels offload", GPU_CHECK_DEADLINE="700")
    assert rc == 0, out
    assert [_what(a) for _, _, a in calls] == ["kernels", "bench train"]


def test_test_groups_at_once_are_not_run_again_by_later_parts(tmp_path):
    rc, out, calls, _ = run_check(tmp_path, GPU_CHECK_PARTS="tests ipc nccl-multi", GPU_CHECK_TESTS_AT_ONCE="1")
    assert rc == 0, out
    pytests = [(mps, a) for mps, _, a in calls if _what(a).startswith("pytest")]
    assert len(pytests) == 3, pytests  # three groups, once each
    by_files = {_what(a): mps for mps, a in pytests}
    several = ("pytest tests/test_ipc_gpu.py tests/test_torch_backend_gpu.py tests/test_compile.py "
               "tests/test_integrations_gpu.py")
    assert by_files[several] is True and by_files["pytest tests/test_nccl_multirank_gpu.py"] is True
    single = next(a for mps, a in pytests if not mps)
    ignored = {single[i + 1] for i, a in enumerate(single) if a == "--ignore"}
    assert ignored == {"tests/test_ipc_gpu.py", "tests/test_torch_backend_gpu.py", "tests/test_compile.py",
                       "tests/test_integrations_gpu.py", "tests/test_nccl_multirank_gpu.py"}
    assert "tests" in single  # (the rest of the GPU tests)
    for f in ignored:
        assert (ROOT / f).is_file(), f
    assert "### tests: single" in out and "### tests: ipc" in out and "### tests: nccl_multi" in out
    # the ipc part went on to its benches, and nccl-multi to its fault cells
    assert any(a[2:3] == ["faults"] for _, _, a in calls)
    assert sum(a[2:3] == ["collectives"] for _, _, a in calls) >= 4


def test_without_at_once_the_ipc_part_runs_its_tests_itself(tmp_path):
    rc, out, calls, _ = run_check(tmp_path, GPU_CHECK_PARTS="tests ipc")
    assert rc == 0, out
    pytests = [(mps, _what(a)) for mps, _, a in calls if _what(a).startswith("pytest")]
    assert [mps for mps, _ in pytests] == [False, True]
    assert "tests/test_ipc_gpu.py" in pytests[1][1]


def test_rounds_go_to_the_training_runs_of_train_and_torch_backend(tmp_path):
    rc, out, calls, _ = run_check(tmp_path, GPU_CHECK_PARTS="train torch-backend", GPU_CHECK_ROUNDS="3")
    assert rc == 0, out
    trains = [a for _, _, a in calls if _what(a) == "bench train"]
    assert len(trains) == 2 and all(a[a.index("--rounds") + 1] == "3" for a in trains)
    runs = trains[1][trains[1].index("--runs") + 1].split(",")
    assert "dp" in runs and "torch-ddp" in runs  # (DataParallel beside DDP on NCCL, paired by round)
    assert all("--profile" not in a for a in trains)
    rc, out, calls, _ = run_check(tmp_path / "one", GPU_CHECK_PARTS="train", GPU_CHECK_PROFILE="1")
    assert rc == 0, out
    assert [a[a.index("--rounds") + 1] for _, _, a in calls] == ["1"]
    assert calls[0][2][calls[0][2].index("--profile") + 1].endswith("_profile")  # (beside the record)


@pytest.mark.parametrize("env, expected", [
    ({"GPU_CHECK_PARTS": "tests kernal"}, "GPU_CHECK_PARTS: unknown part 'kernal'"),
    ({"GPU_CHECK_DEADLINE": "10m"}, "GPU_CHECK_DEADLINE: expected whole seconds, got '10m'"),
    ({"GPU_CHECK_ROUNDS": "0"}, "GPU_CHECK_ROUNDS: expected a count >= 1, got '0'"),
    ({"GPU_CHECK_SCALE": "abc"}, "GPU_CHECK_SCALE: expected a positive number such as 2 or 1.5, got 'abc'"),
    ({"GPU_CHECK_SCALE": "0"}, "GPU_CHECK_SCALE: expected a positive number"),
    ({"GPU_CHECK_SCALE": "-1"}, "GPU_CHECK_SCALE: expected a positive number"),
    ({"GPU_CHECK_SCALE": "1.2345"}, "GPU_CHECK_SCALE: expected a positive number"),
])
def test_bad_settings_are_refused_before_anything_runs(tmp_path, env, expected):
    rc, out, calls, lines = run_check(tmp_path, **env)
    assert rc == 2 and expected in out, out  # (a usage error)
    assert calls == [] and lines == []
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("scale, limit", [("1.5", 45), ("0.5", 15), ("2", 60), ("0.25", 8)])
def test_scale_takes_decimals(tmp_path, scale, limit):
    """The kernels part's limit (30 s) times GPU_CHECK_SCALE, as the deadline's skip line gives it."""
    rc, out, calls, _ = run_check(tmp_path, GPU_CHECK_PARTS="kernels", GPU_CHECK_SCALE=scale,
                                  GPU_CHECK_DEADLINE=str((limit - 1) // 2))
    assert rc == 0, out
    assert f"its limit is {limit} s" in out and calls == [], out
    rc, out, calls, _ = run_check(tmp_path / "runs", GPU_CHECK_PARTS="kernels", GPU_CHECK_SCALE=scale)
    assert rc == 0 and [_what(a) for _, _, a in calls] == ["kernels"], out


def _record_names(tmp_path):
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    return [f"gpu_NVIDIA_H200_{stamp}{s}.txt" for s in [""] + list("bcdefghijklmnopqrstuvwxyz")]


def test_a_record_is_never_overwritten(tmp_path):
    names = _record_names(tmp_path)
    results = tmp_path / "results"
    results.mkdir()
    for n in names[:10]:  # the day's first record and b-j
        (results / n).write_text("earlier\n")
    rc, out, _, _ = run_check(tmp_path, GPU_CHECK_PARTS="kernels")
    assert rc == 0, out
    assert all((results / n).read_text() == "earlier\n" for n in names[:10])
    assert "# pyzero GPU check" in (results / names[10]).read_text()  # (k)
    for n in names[11:]:
        (results / n).write_text("earlier\n")
    rc, out, calls, _ = run_check(tmp_path / "full", GPU_CHECK_PARTS="kernels", GPU_CHECK_RESULTS=str(results))
    assert rc == 1 and "all taken" in out and calls == [], out
    assert all((results / n).read_text() == "earlier\n" for n in names if n != names[10])


def _check_bench_call(argv):
    sub = argv[2]
    mod = importlib.import_module(f"pyzero.bench.{sub}")
    parser = argparse.ArgumentParser(prog=f"pyzero-bench {sub}", exit_on_error=False)
    mod.add_arguments(parser)
    args = parser.parse_args(argv[3:])
    if sub in ("train", "capacity"):
        unknown = [r for r in args.runs.split(",") if r not in mod.RUNS]
        assert not unknown, f"{sub} --runs: {unknown} not in {sorted(mod.RUNS)}"
    if sub == "faults":
        unknown = [c for c in args.cells.split(",") if c not in mod.CELLS]
        assert not unknown, f"faults --cells: {unknown}"


def test_every_bench_call_parses_with_the_bench_arguments(tmp_path):
    """Every part (and the options that add calls) on a 2-GPU stand-in, so each bench call the script has is made."""
    env = {"GPU_CHECK_PARTS": " ".join(ALL_PARTS), "FAKE_NGPU": "2", "GPU_CHECK_OFFLOAD_THREADS": "8",
           "GPU_CHECK_CAPACITY_NPROC": "2", "GPU_CHECK_ROUNDS": "2", "GPU_CHECK_PROFILE": "1"}
    rc, out, calls, _ = run_check(tmp_path, **env)
    assert rc == 0, out
    benches = [a for _, _, a in calls if a[1] == "pyzero.bench"]
    assert {a[2] for a in benches} == {"collectives", "train", "capacity", "faults"}
    assert len(benches) >= 30
    for argv in benches:
        try:
            _check_bench_call(argv)
        except (argparse.ArgumentError, SystemExit, AssertionError) as e:
            pytest.fail(f"{' '.join(argv)}: {e}")
    kernels = [a for _, _, a in calls if a[1] == "pyzero.bench.kernels"]
    assert len(kernels) == 1
    # (its own parser: parsed, it then stops for want of a GPU; a flag it does not take stops it before, exit 2)
    from pyzero.bench import kernels as kernels_bench  # noqa: PLC0415

    with pytest.raises(SystemExit) as stopped:
        kernels_bench.main(kernels[0][2:])
    assert "needs a CUDA GPU" in str(stopped.value.code), stopped.value.code


def test_a_failed_step_fails_the_run_after_the_rest_ran(tmp_path):
    rc, out, calls, _ = run_check(tmp_path, GPU_CHECK_PARTS="kernels ipc-graph train", FAKE_FAIL="--graph 20")
    assert rc == 1, out
    # the parts after the failed step still ran, and the record says which failed
    assert [_what(a) for _, _, a in calls] == ["kernels", "bench collectives", "bench collectives", "bench train"]
    assert "IPC GRAPH BENCH (graph 20) FAILED (exit 1)" in out
    assert "## FAILED: 1 step(s), in the part(s): ipc-graph" in out
    assert "## FAILED" in (tmp_path / "results").glob("gpu_*.txt").__next__().read_text()
    rc, out, _, _ = run_check(tmp_path / "ok", GPU_CHECK_PARTS="kernels ipc-graph")
    assert rc == 0 and "## passed: no step failed" in out, out


def test_a_step_past_its_limit_is_stopped_and_fails_the_run(tmp_path, reap):
    # (the kernels part's 30 s limit scaled to 2 s; the stand-in hangs for 60 s)
    rc, out, calls, lines = run_check(tmp_path, GPU_CHECK_PARTS="kernels train tests", GPU_CHECK_SCALE="0.05",
                                      FAKE_SLEEP="pyzero.bench.kernels", FAKE_FAIL="-m pytest")
    assert rc == 1, out
    assert "KERNEL BENCH FAILED (past its 2 s limit)" in out and "GPU TESTS FAILED (exit 1)" in out
    assert "## FAILED: 2 step(s), in the part(s): kernels tests" in out
    assert [_what(a) for _, _, a in calls][:2] == ["kernels", "bench train"]
    pid = int(next(line.split()[1] for line in lines if line.startswith("SLEEP ")))
    assert not Path(f"/proc/{pid}").exists()  # (the hung step was stopped, not left behind)


def _mps_dirs(lines):
    return [line.split()[2] for line in lines if line.startswith("MPSDIR ")]


def test_mps_runs_in_a_folder_of_its_own_and_is_stopped(tmp_path):
    rc, out, calls, lines = run_check(tmp_path, GPU_CHECK_PARTS="ipc-graph kernels faults")
    assert rc == 0, out
    dirs = _mps_dirs(lines)
    assert len(dirs) == 4 and len(set(dirs)) == 1, lines  # started, stopped, started again, stopped
    pipe = dirs[0]
    assert pipe != "/tmp/pyzero-mps" and not Path(pipe).exists()  # (this run's own folder, removed after)
    assert [(mps, _what(a)) for mps, _, a in calls] == [
        (True, "bench collectives"), (True, "bench collectives"), (False, "kernels"), (True, "bench faults")]
    assert all(line.split()[1] in (pipe, "none") for line in lines if line.startswith("CALL "))
    assert lines[-1] == "MPS quit"


def test_when_mps_does_not_start_nothing_runs_with_its_variables(tmp_path):
    rc, out, calls, lines = run_check(tmp_path, GPU_CHECK_PARTS="ipc-graph kernels faults", FAKE_MPS_FAIL="1")
    assert rc == 0, out
    assert "MPS did not start" in out
    assert [line for line in lines if line.startswith("MPS ")] == ["MPS -d"]  # (tried once; nothing to stop)
    assert len(calls) == 4 and not any(mps for mps, _, _ in calls), lines


def test_the_tests_part_runs_outside_mps_after_an_mps_part(tmp_path):
    rc, out, calls, lines = run_check(tmp_path, GPU_CHECK_PARTS="ipc tests")
    assert rc == 0, out
    pytests = [(mps, a) for mps, _, a in calls if _what(a).startswith("pytest")]
    assert len(pytests) == 2, calls
    assert pytests[0][0] is True and "tests/test_ipc_gpu.py" in pytests[0][1]  # (the ipc part's, under MPS)
    assert pytests[1][0] is False and "--ignore" in pytests[1][1]  # (the tests part's: the rest, alone)


@pytest.fixture
def reap(tmp_path):
    """Afterwards (the test has checked that none is left): kills hung stand-ins a failed run left behind."""
    yield
    for line in _log_lines(tmp_path):
        if line.startswith("SLEEP ") and Path(f"/proc/{line.split()[1]}").exists():
            os.kill(int(line.split()[1]), signal.SIGKILL)


def _interrupt(tmp_path, env):
    """Starts the script in a session of its own (as a terminal would), waits until the stand-in named by
    FAKE_SLEEP hangs, then sends SIGINT to the whole process group, as Ctrl-C does."""
    log = tmp_path / "calls.log"
    p = subprocess.Popen(["bash", str(SCRIPT)], env=_env(tmp_path, env), stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while not (log.exists() and "SLEEP " in log.read_text()):
            assert time.monotonic() < deadline and p.poll() is None, "the step never started"
            time.sleep(0.1)
        time.sleep(0.3)
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        out, _ = p.communicate(timeout=20)  # (before: the step ran on for its 60 s, Ctrl-C or not)
        return p.returncode, out, time.monotonic() - t0, _log_lines(tmp_path)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def test_ctrl_c_stops_the_running_step_and_the_mps_daemon(tmp_path, reap):
    rc, out, took, lines = _interrupt(tmp_path, {"GPU_CHECK_PARTS": "ipc-graph train",
                                                 "FAKE_SLEEP": "--graph 0"})
    assert rc == 130, out
    assert took < 10 and "interrupted" in out and "## FAILED" in out, out
    assert not any("bench train" in line or "train" in line.split() for line in lines if line.startswith("CALL "))
    assert lines[-1] == "MPS quit"
    pids = [int(line.split()[1]) for line in lines if line.startswith("SLEEP ")]
    assert pids and not any(Path(f"/proc/{pid}").exists() for pid in pids)


def test_ctrl_c_stops_the_test_groups_run_at_once(tmp_path, reap):
    rc, out, took, lines = _interrupt(tmp_path, {"GPU_CHECK_PARTS": "tests ipc", "GPU_CHECK_TESTS_AT_ONCE": "1",
                                                 "FAKE_SLEEP": "-m pytest"})
    assert rc == 130 and took < 10, out
    time.sleep(0.5)
    pids = [int(line.split()[1]) for line in _log_lines(tmp_path) if line.startswith("SLEEP ")]
    assert len(pids) == 2 and not any(Path(f"/proc/{pid}").exists() for pid in pids), lines
    assert lines[-1] == "MPS quit"
