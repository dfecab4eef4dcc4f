"""pyzero.launch.run_ranks: the forked-rank harness every multi-rank test relies on."""
import contextlib
import os
import time

import pytest

from pyzero.launch import RankFailure, run_ranks


def _env_and_value(offset):
    return {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT",
                                       "PZ_TEST_FLAG")} | {"value": int(os.environ["RANK"]) + offset}


def test_results_in_rank_order_with_env():
    results = run_ranks(_env_and_value, 3, args=(10,), env={"PZ_TEST_FLAG": "yes"}, timeout=30)
    assert [r.rank for r in results] == [0, 1, 2]
    ports = {r.value["MASTER_PORT"] for r in results}
    assert len(ports) == 1
    for r in results:
        assert r.exitcode == 0
        assert r.value["value"] == r.rank + 10
        assert r.value["RANK"] == r.value["LOCAL_RANK"] == str(r.rank)
        assert r.value["WORLD_SIZE"] == "3" and r.value["PZ_TEST_FLAG"] == "yes"
        assert r.value["MASTER_ADDR"] == "127.0.0.1"
    assert "PZ_TEST_FLAG" not in os.environ  # the parent's environment is untouched


# Read when this module is imported: in a spawned rank that is while its spec (which names a function of
# this module) is loaded, before the rank's body runs.
AT_IMPORT = {k: os.environ.get(k) for k in ("PZ_TEST_AT_IMPORT", "RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")}


def _seen_at_import():
    return AT_IMPORT, os.environ.get("PZ_TEST_AT_IMPORT"), os.environ["MASTER_PORT"]


def test_spawned_ranks_have_their_env_from_the_start(monkeypatch):
    """A spawned rank's `env` and its rank variables are its environment from the interpreter's start, so
    what its function's module imports sees them (pyzero picks its NCCL library at import from
    PYZERO_NCCL_ROOT; a module may pick cuda:LOCAL_RANK), also where the parent has its own RANK."""
    assert AT_IMPORT["PZ_TEST_AT_IMPORT"] is None
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("LOCAL_RANK", "5")
    results = run_ranks(_seen_at_import, 2, env={"PZ_TEST_AT_IMPORT": "set"}, start="spawn", timeout=60)
    for r in results:
        at_import, later, port = r.value
        assert at_import == {"PZ_TEST_AT_IMPORT": "set", "RANK": str(r.rank), "LOCAL_RANK": str(r.rank),
                             "WORLD_SIZE": "2", "MASTER_PORT": port}, at_import
        assert later == "set"
    assert "PZ_TEST_AT_IMPORT" not in os.environ


def _fail_on_rank_one():
    print(f"hello from rank {os.environ['RANK']}", flush=True)
    if os.environ["RANK"] == "1":
        raise ValueError("rank one is unhappy")
    return "fine"


def test_failure_reports_output_and_traceback():
    with pytest.raises(RankFailure) as info:
        run_ranks(_fail_on_rank_one, 2, timeout=30)
    text = str(info.value)
    assert "a rank failed" in text and "rank one is unhappy" in text and "hello from rank 1" in text
    by_rank = {r.rank: r for r in info.value.results}
    assert by_rank[1].exitcode == 1
    # without check the results come back instead
    results = run_ranks(_fail_on_rank_one, 2, timeout=30, check=False)
    assert [r.exitcode for r in results] == [0, 1]
    assert results[0].value == "fine" and results[1].value is None


def _hang_on_rank_zero():
    if os.environ["RANK"] == "0":
        time.sleep(60)
    return "done"


def _start_a_sleeper():
    import subprocess  # noqa: PLC0415

    child = subprocess.Popen(["sleep", "60"])
    print(child.pid, flush=True)
    time.sleep(60)


def test_the_deadline_kills_what_a_rank_started_too():
    """A rank still running at the deadline is killed with the processes it started (its session), as
    torchrun's agent kills its workers' process groups."""
    results = run_ranks(_start_a_sleeper, 2, timeout=2.0, check=False)
    for r in results:
        assert r.exitcode is None
        pid = int(r.output.split()[0])
        assert _wait_gone(pid), f"rank {r.rank}'s child {pid} still runs"


def _exit_with(code):
    if os.environ["RANK"] == "1":
        if code == "hang":
            time.sleep(60)
        raise SystemExit(code)
    if code == "hang":
        raise ValueError("rank 0 fails first")
    return "fine"


def test_sys_exit_status_and_stacks_of_ranks_hung_after_another_failed():
    """sys.exit(3) in a rank is exit status 3 (as torch.multiprocessing.spawn lets it through); without
    check, a rank still running at the deadline after another failed prints its stack too."""
    results = run_ranks(_exit_with, 2, args=(3,), timeout=30, check=False)
    assert [r.exitcode for r in results] == [0, 3] and results[1].value is None
    results = run_ranks(_exit_with, 2, args=("hang",), timeout=2.0, check=False)
    assert results[0].exitcode == 1 and results[1].exitcode is None
    assert "most recent call first" in results[1].output and "_exit_with" in results[1].output, results[1].output


def test_deadline_kills_hung_ranks():
    t0 = time.monotonic()
    with pytest.raises(RankFailure, match="did not finish within"):
        run_ranks(_hang_on_rank_zero, 2, timeout=1.0)
    assert time.monotonic() - t0 < 10
    results = run_ranks(_hang_on_rank_zero, 2, timeout=1.0, check=False)
    assert results[0].exitcode is None and results[1].exitcode == 0 and results[1].value == "done"


def test_bad_nprocs():
    with pytest.raises(ValueError, match="nprocs"):
        run_ranks(_hang_on_rank_zero, 0)


@pytest.mark.parametrize("kwargs, name", [({"nprocs": "2"}, "nprocs"), ({"nprocs": 2.0}, "nprocs"),
                                          ({"nprocs": True}, "nprocs"), ({"timeout": None}, "timeout"),
                                          ({"timeout": "5"}, "timeout"), ({"timeout": -1}, "timeout"),
                                          ({"timeout": float("nan")}, "timeout"), ({"threads": 0}, "threads"),
                                          ({"threads": 1.5}, "threads"), ({"env": {"X": 1}}, "env"),
                                          ({"env": ["X"]}, "env"), ({"echo": True}, "echo")])
def test_bad_arguments_raise_before_any_rank_starts(kwargs, name, tmp_path):
    """Checked before anything forks (a bad timeout failed after the ranks had started; a NaN one never
    expired)."""
    marker = tmp_path / "started"
    args = {"nprocs": 2, "timeout": 10} | kwargs
    with pytest.raises(ValueError, match=f"^{name}: expected"):
        run_ranks(_touch, args.pop("nprocs"), args=(str(marker),), **args)
    assert not marker.exists()


def _touch(path):
    open(path, "w").close()


def _exit_early():
    if os.environ["RANK"] == "1":
        print("leaving", flush=True)
        os._exit(0)  # exit status 0, but fn never returned
    return "fine"


def test_a_rank_that_exits_without_returning_is_a_failure():
    """A rank whose process ends with status 0 before fn returns (os._exit(0) in a library) has no value:
    that is its failure, not a value of None indistinguishable from fn returning None."""
    with pytest.raises(RankFailure, match="a rank failed") as info:
        run_ranks(_exit_early, 2, timeout=30)
    assert "rank 1 exited without returning from _exit_early" in str(info.value)
    results = run_ranks(_exit_early, 2, timeout=30, check=False)
    assert [(r.exitcode, r.value) for r in results] == [(0, "fine"), (0, None)]
    assert "leaving" in results[1].output and "exited without returning" in results[1].output


class _Unloadable:
    def __reduce__(self):
        return int, ("not an int",)  # pickles in the rank; fails to unpickle in the parent


def _unpicklable_value():
    if os.environ["RANK"] == "1":
        return [bytes(300_000), lambda: 0]  # the bytes reach the file before the lambda fails to pickle
    return "fine"


def _unloadable_value():
    return _Unloadable() if os.environ["RANK"] == "1" else "fine"


@pytest.mark.parametrize("fn, why", [(_unpicklable_value, "Can't pickle"),
                                     (_unloadable_value, "could not be unpickled")])
def test_a_rank_whose_value_does_not_come_back_is_a_failure(fn, why):
    """A value a rank cannot pickle (part of it written) or the parent cannot unpickle is that rank's
    failure, not an EOFError or the unpickler's error in the parent with every rank's output lost."""
    with pytest.raises(RankFailure, match="a rank failed") as info:
        run_ranks(fn, 2, timeout=30)
    assert why in str(info.value) and "--- rank 1 (exit" in str(info.value)
    results = run_ranks(fn, 2, timeout=30, check=False)
    assert [r.value for r in results] == ["fine", None]
    assert why in results[1].output



def _print_slowly():
    for k in range(3):
        print(f"row {k} of rank {os.environ['RANK']}", flush=True)
        time.sleep(0.05)
    return 7


def test_echo_copies_one_ranks_output_once_and_whole(capfd):
    results = run_ranks(_print_slowly, 2, timeout=30, echo=1)
    out = capfd.readouterr().out
    assert out == "row 0 of rank 1\nrow 1 of rank 1\nrow 2 of rank 1\n", out
    assert [r.value for r in results] == [7, 7] and "row 2 of rank 0" in results[0].output
    with pytest.raises(ValueError, match="echo: expected None or a rank in"):
        run_ranks(_print_slowly, 2, timeout=30, echo=2)


ECHO_PARENT = """
import time
from pyzero.launch import run_ranks

def rank():
    print("measured row", flush=True)
    time.sleep(60)

run_ranks(rank, 1, timeout=60, echo=0)
"""


def test_echo_shows_a_ranks_output_while_it_runs():
    """The parent prints what rank 0 wrote while the rank still runs: a bench stopped by a time
    limit still shows its rows (the parent here is killed before its ranks end)."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", ECHO_PARENT], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    import threading

    guard = threading.Timer(20, lambda: os.killpg(proc.pid, 9))  # no echo: readline ends at the kill
    guard.start()
    try:
        line = proc.stdout.readline()  # the rank sleeps 60 s after printing: only an echo arrives sooner
        assert line == "measured row\n", line
    finally:
        guard.cancel()
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


INTERRUPTED_PARENT = """
import sys
sys.path.insert(0, sys.argv[2])
from pyzero.launch import run_ranks
from test_launch import _print_pid_and_sleep

try:
    run_ranks(_print_pid_and_sleep, 2, timeout=60, echo=0, start=sys.argv[1])
except KeyboardInterrupt:
    print("interrupted", flush=True)
"""


def _print_pid_and_sleep():
    print(os.getpid(), flush=True)
    time.sleep(60)


def _wait_gone(pid, seconds=5.0):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


@contextlib.contextmanager
def _parent_job(script, start):
    """A parent process running `script` (run_ranks of _print_pid_and_sleep, rank 0 echoed) in a session of
    its own: (the process, rank 0's pid); everything of it killed after."""
    import subprocess
    import sys

    proc = subprocess.Popen([sys.executable, "-c", script, start, os.path.dirname(__file__)], stdout=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        yield proc, int(proc.stdout.readline())
    finally:
        try:
            os.killpg(proc.pid, 9)
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


TERMINATED_PARENT = """
import sys
sys.path.insert(0, sys.argv[2])
from pyzero.launch import run_ranks
from test_launch import _print_pid_and_sleep

run_ranks(_print_pid_and_sleep, 2, timeout=60, echo=0, start=sys.argv[1])
"""


@pytest.mark.parametrize("start,sig", [("fork", 15), ("spawn", 9)])
def test_ranks_end_with_a_parent_killed_by_a_signal(start, sig):
    """SIGTERM (a scheduler, CI) or SIGKILL ends the parent without any clean-up of its own: its ranks
    die with it (PR_SET_PDEATHSIG), as torchrun's workers do with their agent. (The ranks see their parent
    die whatever killed it: one signal per start method.)"""
    with _parent_job(TERMINATED_PARENT, start) as (proc, rank0):
        proc.send_signal(sig)
        proc.wait(timeout=20)
        assert _wait_gone(rank0), f"rank 0 (pid {rank0}) still runs after its parent got signal {sig}"


def test_a_spawned_rank_that_fails_loading_its_function_shows_why(tmp_path, monkeypatch):
    """A spawned rank whose function's module fails at import (there, not in the parent): the traceback
    is in that rank's output, not lost to the parent's terminal."""
    import importlib
    import sys

    (tmp_path / "pz_refusing_module.py").write_text(
        "import os\n"
        "if os.environ.get('PZ_TEST_REFUSE') == '1':\n"
        "    raise ImportError('pz_refusing_module refuses to load in a rank')\n"
        "def fn():\n"
        "    return 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("pz_refusing_module")
    try:
        with pytest.raises(RankFailure) as info:
            run_ranks(mod.fn, 1, start="spawn", env={"PZ_TEST_REFUSE": "1"}, timeout=60)
        assert "pz_refusing_module refuses to load in a rank" in info.value.results[0].output, str(info.value)
    finally:
        sys.modules.pop("pz_refusing_module", None)


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_an_interrupted_parent_leaves_no_rank_running(start):
    """SIGINT to the parent alone (pytest stopped by a time limit) ends run_ranks with its ranks killed
    and reaped: none keeps running (on a GPU, spinning in a kernel) after the parent gives up."""
    with _parent_job(INTERRUPTED_PARENT, start) as (proc, rank0):
        time.sleep(0.5)  # (both ranks have started by then)
        proc.send_signal(2)
        out, _ = proc.communicate(timeout=20)
        assert "interrupted" in out, out
        assert _wait_gone(rank0), f"rank 0 (pid {rank0}) still runs"


def test_without_nproc_drops_only_the_launch_count():
    from pyzero.launch import without_nproc

    assert without_nproc(["--a", "1", "--nproc", "2", "--b", "--nproc=3", "--nprocs", "4"]) == \
        ["--a", "1", "--b", "--nprocs", "4"]
    assert without_nproc([]) == []


def test_free_port_lies_below_the_ephemeral_range():
    """A port from bind(0) can be taken as the local port of any outgoing connection before the store
    listens on it; free_port picks one outside that range, that binds."""
    import socket  # noqa: PLC0415

    from pyzero.launch import free_port  # noqa: PLC0415
    with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        low = int(f.read().split()[0])
    ports = [free_port() for _ in range(8)]
    for port in ports:
        assert 1024 <= port < low, (port, low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind(("", port))
    assert len(set(ports)) > 1  # (drawn at random: two jobs started together rarely meet)
