"""Run a function on N local ranks, torchrun-style, with a hard timeout.

Used by the tests, ``pyzero-bench --nproc`` and the demo. Each rank is a
forked process (or, with ``start="spawn"``, a fresh interpreter: CUDA cannot
be used in a child forked after the parent initialised it) with
RANK/WORLD_SIZE/LOCAL_RANK/MASTER_ADDR/MASTER_PORT set (a spawned one from its
interpreter's start), its stdout/stderr captured to a file. If any rank fails, or the deadline
passes, every rank still running is killed with what it started (each rank leads a session
of its own) and RankFailure shows each rank's exit status (``sys.exit(n)``: n) and the tail
of its output (a rank still running at the deadline first prints every thread's stack).
A rank dies with its launcher, however the launcher ends (Linux: PR_SET_PDEATHSIG).
"""
from __future__ import annotations

import codecs
import faulthandler
import os
import pickle
import random
import shutil
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from .checks import is_int, is_positive_finite


@dataclass
class RankResult:
    rank: int
    exitcode: int | None  # None: killed by us at the deadline; negative: killed by that signal
    value: object
    output: str


class RankFailure(RuntimeError):
    def __init__(self, message: str, results: list[RankResult]):
        self.results = results
        parts = [message]
        for r in results:
            tail = r.output[-4000:]
            parts.append(f"--- rank {r.rank} (exit {r.exitcode}) ---\n{tail}")
        super().__init__("\n".join(parts))


def without_nproc(argv: list[str]) -> list[str]:
    """`argv` less ``--nproc N`` / ``--nproc=N``: what the ranks of a script's own ``--nproc`` launch parse."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


def free_port() -> int:
    """A TCP port nothing listens on now, for a job's store. Picked below the kernel's ephemeral port range
    where one is free: a port from bind(0) lies in that range, where any outgoing connection (a store client's
    among them) may take it as its local port before the store listens on it (EADDRINUSE at pz.init)."""
    low = 32768
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        pass
    pick = random.SystemRandom()
    for _ in range(32) if low > 2048 else ():
        port = pick.randrange(max(1024, low - 12000), low)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tie_to_parent(parent: int) -> None:
    """End this rank with its launcher: SIGKILL when the launching thread's process dies (Linux's
    PR_SET_PDEATHSIG), whatever kills it (SIGTERM, SIGKILL), as torchrun's agent takes its workers down."""
    try:
        import ctypes  # noqa: PLC0415

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # (not Linux)
        pass
    if os.getppid() != parent:  # it died before the call above
        os._exit(1)


def _redirect(out_path: str) -> None:
    """This rank's stdout and stderr (file descriptors 1 and 2) to its output file, appended to."""
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _child(fn, rank: int, nprocs: int, port: int, args, kwargs, env, threads, out_path: str,
           res_path: str) -> None:
    _redirect(out_path)  # (a spawned rank's own start, loading fn's module, wrote there already)
    # Whatever replaced sys.stdout/stderr in the parent (pytest's capture) must not swallow rank output.
    import sys  # noqa: PLC0415

    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    os.environ.update(_rank_env(rank, nprocs, port))
    os.environ.update(env or {})
    # At the deadline the parent asks for every thread's stack (SIGUSR1) before killing the
    # rank, so RankFailure shows where a hung rank was.
    faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    code = 0
    try:
        if threads:
            import torch  # noqa: PLC0415

            torch.set_num_threads(threads)
        value = fn(*args, **kwargs)
        with _private(res_path) as f:
            pickle.dump(value, f)
    except SystemExit as e:  # sys.exit(n): the rank's exit status is n (no value: a failure all the same)
        traceback.print_exc()
        code = e.code if is_int(e.code) and 0 <= e.code < 256 else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - report everything
        traceback.print_exc()
        code = 1
    finally:
        try:
            from . import comm  # noqa: PLC0415

            comm.destroy()
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = code or 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never run the parent's atexit handlers (pytest's) in a fork


def _private(path: str):
    """A new file only this user can read (0600), in the run's private (0700) folder: the parent
    unpickles what its own ranks wrote there, and nobody else can write or swap it."""
    return os.fdopen(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb")


def _spawned(spec_path: str, out_path: str, parent: int) -> None:
    """Entry point of a spawned rank: its output to its file first (what loading the spec, which imports
    fn's module, prints or raises is the rank's output), then load what _child needs and run it."""
    _tie_to_parent(parent)
    _redirect(out_path)
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    os.unlink(spec_path)
    _child(*spec)


def _rank_env(rank: int, nprocs: int, port: int) -> dict:
    return {"RANK": str(rank), "WORLD_SIZE": str(nprocs), "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nprocs),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}


def _spawn(spec: tuple, spec_path: str, out_path: str, rank_env: dict) -> int:
    """Start a fresh interpreter running _child(*spec) in a session of its own; `fn` travels by reference
    (module + name)."""
    with _private(spec_path) as f:
        pickle.dump(spec, f)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p or os.getcwd() for p in sys.path)  # the parent's imports resolve alike
    # The rank's own variables are there from the interpreter's start: loading the spec imports `fn`'s module,
    # and what that imports may read them (pyzero chooses its NCCL library, CUDA its devices, at import).
    env.update(rank_env)
    code = "import sys; from pyzero.launch import _spawned; _spawned(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    return os.posix_spawn(sys.executable, [sys.executable, "-c", code, spec_path, out_path, str(os.getpid())], env,
                          setsid=True)


def _signal_running(pids: dict[int, int], codes: dict[int, int | None], sig: int) -> None:
    """Send `sig` to every rank (pid -> rank) without an exit code yet, and to the processes it started
    (a rank leads a session of its own: its process group)."""
    for pid, r in pids.items():
        if r not in codes:
            try:
                os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass


def _kill_and_reap(pids: dict[int, int], codes: dict[int, int | None]) -> None:
    """SIGKILL and reap every rank without an exit code yet."""
    _signal_running(pids, codes, signal.SIGKILL)
    for pid, r in pids.items():
        if r not in codes:
            os.waitpid(pid, 0)
            codes[r] = None


def run_ranks(fn, nprocs: int, args=(), kwargs=None, timeout: float = 60.0, env=None,
              check: bool = True, threads: int | None = 1, start: str = "fork",
              echo: int | None = None) -> list[RankResult]:
    """Run ``fn(*args, **kwargs)`` on ``nprocs`` forked ranks; return their results in rank order.

    ``fn`` returns a picklable value. ``threads`` sets torch's intra-op threads
    in each rank (None leaves torch's default), so N ranks do not oversubscribe
    the cores.
    With ``check`` (default) raise RankFailure unless every rank exits 0 in
    time with a value this process can unpickle; without, return whatever
    happened (exit codes, outputs; the value None where it did not come back,
    the output saying why).
    ``start="spawn"`` runs each rank in a fresh interpreter (``fn`` must be
    importable by module and name, its arguments picklable): what GPU ranks
    need once the parent has initialised CUDA. ``echo``: a rank whose output this process
    copies to its own stdout as the rank writes it (a bench's table, shown even if this process
    is stopped before the ranks end); the rank's RankResult.output still holds all of it.
    """
    if not is_int(nprocs) or nprocs < 1:
        raise ValueError(f"nprocs: expected an int >= 1, got {nprocs!r}")
    if not is_positive_finite(timeout):
        raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
    if threads is not None and (not is_int(threads) or threads < 1):
        raise ValueError(f"threads: expected None or an int >= 1, got {threads!r}")
    if start not in ("fork", "spawn"):
        raise ValueError(f"start: expected 'fork' or 'spawn', got {start!r}")
    if env is not None and not (isinstance(env, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                              for k, v in env.items())):
        raise ValueError(f"env: expected None or a dict of str names to str values, got {env!r}")
    if echo is not None and not (is_int(echo) and 0 <= echo < nprocs):
        raise ValueError(f"echo: expected None or a rank in [0, {nprocs}), got {echo!r}")
    port = free_port()
    tmp = tempfile.mkdtemp(prefix="pyzero-ranks-")  # 0700: the ranks' outputs and results are private
    pids = {}
    codes: dict[int, int | None] = {}
    try:
        for r in range(nprocs):
            out_path = os.path.join(tmp, f"rank{r}.out")
            spec = (fn, r, nprocs, port, args, kwargs or {}, env, threads, out_path, os.path.join(tmp, f"rank{r}.pkl"))
            if start == "spawn":
                pid = _spawn(spec, os.path.join(tmp, f"rank{r}.spec"), out_path,
                             _rank_env(r, nprocs, port) | (env or {}))
            else:
                parent = os.getpid()
                pid = os.fork()
                if pid == 0:
                    os.setsid()  # (a session of its own: the deadline's kill reaches what the rank starts)
                    _tie_to_parent(parent)
                    _child(*spec)
            pids[pid] = r
        deadline = time.monotonic() + timeout
        failed = False
        echoed, decoder = 0, codecs.getincrementaldecoder("utf-8")(errors="replace")  # rank `echo`'s output so far

        def copy_echo():
            nonlocal echoed
            try:
                with open(os.path.join(tmp, f"rank{echo}.out"), "rb") as f:
                    f.seek(echoed)
                    new = f.read()
            except FileNotFoundError:
                return
            echoed += len(new)
            if new:
                sys.stdout.write(decoder.decode(new))
                sys.stdout.flush()

        while len(codes) < nprocs:
            if echo is not None:
                copy_echo()
            for pid, r in pids.items():
                if r in codes:
                    continue
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    codes[r] = os.waitstatus_to_exitcode(status)
                    failed = failed or codes[r] != 0
            if len(codes) == nprocs or time.monotonic() > deadline or (failed and check):
                break
            time.sleep(0.005)
        if echo is not None:
            copy_echo()
        timed_out = len(codes) < nprocs and not (failed and check)
        if timed_out:  # stacks of the ranks still running (see _child), then kill them
            _signal_running(pids, codes, signal.SIGUSR1)
            time.sleep(0.5)
    except BaseException:  # interrupted (KeyboardInterrupt, a signal turned exception): leave no rank behind
        _kill_and_reap(pids, codes)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _kill_and_reap(pids, codes)  # whatever is left
    results, unloadable = [], set()
    for r in range(nprocs):
        out_path, res_path = os.path.join(tmp, f"rank{r}.out"), os.path.join(tmp, f"rank{r}.pkl")
        spec_path = os.path.join(tmp, f"rank{r}.spec")
        if os.path.exists(spec_path):  # a spawned rank that died before reading it
            os.unlink(spec_path)
        output = ""
        if os.path.exists(out_path):
            with open(out_path, errors="replace") as f:
                output = f.read()
        value = None
        if os.path.exists(res_path):
            if codes[r] == 0:  # (a failed rank's file may hold part of a value that did not pickle)
                try:
                    with open(res_path, "rb") as f:
                        value = pickle.load(f)
                except Exception as e:  # noqa: BLE001 - that rank's failure, reported with its output
                    unloadable.add(r)
                    output += f"\nrun_ranks: rank {r}'s return value could not be unpickled: {type(e).__name__}: {e}\n"
            os.unlink(res_path)
        elif codes[r] == 0:  # (its process ended, status 0, before fn returned: os._exit(0) somewhere)
            unloadable.add(r)
            output += f"\nrun_ranks: rank {r} exited without returning from {getattr(fn, '__name__', fn)}\n"
        if os.path.exists(out_path):
            os.unlink(out_path)
        results.append(RankResult(r, codes[r], value, output))
    os.rmdir(tmp)
    if check and (unloadable or any(res.exitcode != 0 for res in results)):
        why = f"ranks did not finish within {timeout} s" if timed_out else "a rank failed"
        raise RankFailure(f"run_ranks({getattr(fn, '__name__', fn)}, nprocs={nprocs}): {why}", results)
    return results
