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


def _build_times_repo(tmp_path):
    """A committed tree with the files build_times.sh touches (git archive HEAD is what it builds)."""
    repo, py = _repo(tmp_path, "build_times.sh")
    (repo / "csrc").mkdir()
    for f in ("csrc/cpu_optim.cpp", "csrc/kernels.cu", "setup.py"):
        (repo / f).write_text("")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "commit.gpgsign=false"]
    subprocess.run(git[:3] + ["init", "-q"], check=True, timeout=30)
    subprocess.run(git[:3] + ["add", "-A"], check=True, timeout=30)
    subprocess.run(git + ["commit", "-q", "-m", "t"], check=True, timeout=30)
    (repo / "benchmarks" / "results").mkdir(parents=True)
    nvcc = tmp_path / "cuda" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/bash\necho 'Cuda compilation tools, release 13.0, V13.0.1'\n")
    nvcc.chmod(0o755)
    return repo, py, nvcc


def _build_times(repo, **env):
    return subprocess.run(["bash", str(repo / "scripts" / "build_times.sh")], env=env, capture_output=True,
                          text=True, timeout=60)


def _setup_calls(tmp_path):
    return [(cuda, args) for cuda, args in _calls(tmp_path) if "setup.py" in args]


def test_build_times_builds_the_cuda_rows_with_cuda_and_records_once_all_built(tmp_path):
    repo, py, nvcc = _build_times_repo(tmp_path)
    p = _build_times(repo, **_env(tmp_path, py, CUDACXX=str(nvcc), RECORD="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    assert [cuda for cuda, _ in _setup_calls(tmp_path)] == ["1"] * 5 + ["0"]  # (the CUDA rows were unset: auto)
    records = list((repo / "benchmarks" / "results").glob("build_times_cpu*.txt"))
    assert len(records) == 1 and "| clean, without CUDA |" in records[0].read_text(), records
    assert "nvcc: 13.0" in records[0].read_text()
    p = _build_times(repo, **_env(tmp_path, py, CUDACXX=str(nvcc), RECORD="1"))
    assert p.returncode == 0, p.stdout + p.stderr
    # a second record the same day: the next suffix, the first kept
    assert sorted(f.name for f in records[0].parent.iterdir()) == [records[0].name, records[0].stem + "b.txt"]


def test_build_times_a_failed_build_leaves_no_record(tmp_path):
    repo, py, nvcc = _build_times_repo(tmp_path)
    p = _build_times(repo, **_env(tmp_path, py, CUDACXX=str(nvcc), RECORD="1", FAKE_FAIL_AT="3"))
    assert p.returncode == 1 and "build failed: one .cpp changed" in p.stderr, p.stdout + p.stderr
    assert len(_setup_calls(tmp_path)) == 3
    assert list((repo / "benchmarks" / "results").glob("*")) == []  # (was a truncated table)


def test_build_times_without_nvcc_stops_before_building(tmp_path):
    repo, py, _ = _build_times_repo(tmp_path)
    p = _build_times(repo, **_env(tmp_path, py, CUDACXX=str(tmp_path / "no-nvcc"), RECORD="1"))
    assert p.returncode == 1 and "no nvcc" in p.stderr, p.stdout + p.stderr
    assert _setup_calls(tmp_path) == []


def _fake_venv(tmp_path, py):
    """A venv stand-in: bin/python is the recording stand-in, bin/activate puts bin/ first on PATH. The
    stand-in is also first on PATH before that, so that nothing here can reach a real pip."""
    venv = tmp_path / "fake venv"
    (venv / "bin").mkdir(parents=True)
    for name in ("python", "python3"):
        shutil.copy(py, venv / "bin" / name)
    (venv / "bin" / "activate").write_text(f'VIRTUAL_ENV="{venv}"\nexport VIRTUAL_ENV\nPATH="{venv}/bin:$PATH"\n'
                                           'export PATH\n')
    return venv


SOURCING = """set +e +u
cd "$ELSEWHERE"
source "$REPO/scripts/setup_env.sh"
echo "rc=$? pwd=$PWD flags=$- $(set -o | grep -E '^pipefail' | tr -s ' \\t' =) venv=$VIRTUAL_ENV"
"""


def _setup_env(tmp_path, how, **env):
    repo, py = _repo(tmp_path, "setup_env.sh")
    venv = _fake_venv(tmp_path, py)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    full = _env(tmp_path, py, PYZERO_VENV=str(venv), PYZERO_CUDA="0", REPO=str(repo), ELSEWHERE=str(elsewhere),
                PATH=f"{venv}/bin:{os.environ['PATH']}", **env)
    full.pop("VIRTUAL_ENV", None)
    argv = ["bash", "-c", SOURCING] if how == "source" else ["bash", str(repo / "scripts" / "setup_env.sh")]
    p = subprocess.run(argv, env=full, capture_output=True, text=True, timeout=60)
    return p, venv, elsewhere


def test_setup_env_sourced_leaves_the_shell_as_it_was_and_activates_the_venv(tmp_path):
    p, venv, elsewhere = _setup_env(tmp_path, "source")
    assert p.returncode == 0, p.stdout + p.stderr
    line = p.stdout.strip().splitlines()[-1]
    assert line.startswith(f"rc=0 pwd={elsewhere} "), line  # (was: the checkout)
    flags = line.split(" flags=")[1].split()[0]
    assert "e" not in flags and "u" not in flags and "pipefail=off" in line, line  # (was: set -euo pipefail)
    assert line.endswith(f"venv={venv}"), line
    assert any("-m pip install -q --no-build-isolation -e ." in args for _, args in _calls(tmp_path))


def test_setup_env_sourced_returns_a_failure_without_ending_the_shell(tmp_path):
    p, _, _ = _setup_env(tmp_path, "source", FAKE_FAIL="--no-build-isolation")
    assert p.returncode == 0, p.stdout + p.stderr  # (was: set -e in the caller's shell ended it there)
    assert p.stdout.strip().splitlines()[-1].startswith("rc=3 "), p.stdout


def test_setup_env_run(tmp_path):
    p, _, _ = _setup_env(tmp_path, "run")
    assert p.returncode == 0, p.stdout + p.stderr
    p, _, _ = _setup_env(tmp_path / "failing", "run", FAKE_FAIL="--no-build-isolation")
    assert p.returncode == 3, p.stdout + p.stderr


@pytest.mark.parametrize("own", [None, "elsewhere/prebuilt"])
def test_gpu_prebuild_takes_its_folder_from_its_own_variable_not_out(tmp_path, own):
    """(the stand-in for GPU_PYTHON fails at `-m venv DIR/venv`: where the build would have gone)"""
    repo, py = _repo(tmp_path, "gpu_prebuild.sh")
    env = _env(tmp_path, py, GPU_PYTHON=str(py), OUT=str(tmp_path / "runner-out"), FAKE_FAIL="-m venv")
    if own:
        env["GPU_PREBUILD_OUT"] = str(tmp_path / own)
    p = subprocess.run(["bash", str(repo / "scripts" / "gpu_prebuild.sh")], env=env, capture_output=True,
                       text=True, timeout=60)
    assert p.returncode == 3, p.stdout + p.stderr
    venv = _calls(tmp_path)[0][1].split("-m venv ")[1]
    assert venv == str(tmp_path / own / "venv" if own else repo / "build" / "gpu312" / "venv")
    assert not (tmp_path / "runner-out").exists()
