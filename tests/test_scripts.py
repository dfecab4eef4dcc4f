"""scripts/record_cpu.sh, build_times.sh, setup_env.sh and gpu_prebuild.sh on stand-ins (a python that records
its calls instead of running them, in a folder whose name has a space), each in a copy of the repository's
layout under tmp_path: exit status, records that are never overwritten or left truncated, CUDA rows built with
CUDA, a sourced setup_env.sh that leaves the caller's shell as it was, gpu_prebuild.sh's own output setting.
(scripts/gpu_check.sh has its own: tests/test_gpu_check_script.py.)"""
import datetime
import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Records each call (with PYZERO_CUDA), writes the --json path it is given, fails when its arguments contain
# FAKE_FAIL (or, FAKE_FAIL_AT=N, at its Nth setup.py call).
FAKE_PYTHON = r"""#!/bin/bash
echo "CALL ${PYZERO_CUDA:-unset} $*" >> "$FAKE_LOG"
case "$*" in *"import "*) exit 0;; esac
n=$(grep -c "setup.py" "$FAKE_LOG")
[ -z "${FAKE_FAIL_AT:-}" ] || [[ "$*" != *setup.py* ]] || [ "$n" != "$FAKE_FAIL_AT" ] || { echo "build broke"; exit 1; }
prev=""
for a in "$@"; do [ "$prev" != --json ] || echo '{}' > "$a"; prev=$a; done
echo "output of $*"
[ -n "${FAKE_FAIL:-}" ] && [[ "$*" == *"$FAKE_FAIL"* ]] && exit 3
exit 0
"""


def _repo(tmp_path, *scripts):
    """A copy of the repository's layout with the named scripts, and a python stand-in in 'my bin'."""
    repo = tmp_path / "repo"
    (repo / "scripts").mkdir(parents=True)
    for name in scripts:
        shutil.copy(ROOT / "scripts" / name, repo / "scripts" / name)
    bin_dir = tmp_path / "my bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(FAKE_PYTHON)
    (bin_dir / "python3").chmod(0o755)
    return repo, bin_dir / "python3"


def _env(tmp_path, python, **env):
    full = {k: v for k, v in os.environ.items() if not k.startswith(("FAKE_", "PYZERO_", "RECORD", "CUDA"))}
    full.update(PYTHON=str(python), FAKE_LOG=str(tmp_path / "calls.log"), **env)
    return full


def _calls(tmp_path):
    log = tmp_path / "calls.log"
    return [line.split(" ", 2)[1:] for line in log.read_text().splitlines()] if log.exists() else []


def _today():
    return datetime.datetime.now().strftime("%Y%m%d")


def _record(repo, *args, **env):
    return subprocess.run(["bash", str(repo / "scripts" / "record_cpu.sh"), *args], env=env, capture_output=True,
                          text=True, timeout=60)


def test_record_cpu_runs_every_bench_and_fails_when_one_failed(tmp_path):
    repo, py = _repo(tmp_path, "record_cpu.sh")
    p = _record(repo, "ps", "optim", **_env(tmp_path, py, FAKE_FAIL="bench ps"))
    assert p.returncode == 1, p.stdout + p.stderr  # (was 0)
    calls = [c[1] for c in _calls(tmp_path)]
    assert [c.split()[2] for c in calls] == ["ps", "optim"]  # (the interpreter's path has a space)
    assert "exit 3" in p.stdout and "FAILED: ps (exit 3)" in p.stdout
    results = repo / "benchmarks" / "results"
    cores = int(subprocess.check_output(["nproc"]))
    stamp = f"cpu{cores}_{_today()}"
    assert (results / f"ps_{stamp}.txt").read_text().startswith("output of -m pyzero.bench ps")
    assert (results / f"optim_{stamp}.json").exists()
    p = _record(repo, "optim", **_env(tmp_path, py))
    assert p.returncode == 0, p.stdout + p.stderr
    # a second run the same day: the next suffix, for the .txt and the .json alike; the first is kept
    assert (results / f"optim_{stamp}b.txt").exists() and (results / f"optim_{stamp}b.json").exists()
    assert (results / f"optim_{stamp}.txt").read_text().startswith("output of")
    assert f"optim_{stamp}b.json" in (results / f"optim_{stamp}b.txt").read_text()


def test_record_cpu_refuses_an_unknown_bench_before_running_any(tmp_path):
    repo, py = _repo(tmp_path, "record_cpu.sh")
    p = _record(repo, "ps", "optimm", **_env(tmp_path, py))
    assert p.returncode == 2 and "unknown bench 'optimm'" in p.stderr, p.stdout + p.stderr
    assert _calls(tmp_path) == []
