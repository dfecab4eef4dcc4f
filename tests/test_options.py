"""Per-group transport options (pz.Options): validation, inheritance, environment defaults,
and that a group really runs with its own settings."""
from __future__ import annotations

import re

import pytest
import torch

import pyzero as pz
from pyzero.launch import run_ranks


def test_options_validate_and_merge():
    assert pz.Options.make(None) == pz.Options()
    assert pz.Options.make({"depth": 4}).depth == 4
    o = pz.Options(slice_bytes=4096)
    assert pz.Options.make(o) is o
    merged = pz.Options(depth=3).merged(pz.Options(depth=8, slice_bytes=8192))
    assert (merged.depth, merged.slice_bytes, merged.oneshot_bytes) == (3, 8192, None)
    with pytest.raises(ValueError, match=r"options: unknown field\(s\) \['slice_kb'\]"):
        pz.Options.make({"slice_kb": 4})
    with pytest.raises(TypeError, match="options: expected pz.Options, a dict or None, got list"):
        pz.Options.make([1])
    with pytest.raises(ValueError, match="options.depth: expected at least 2"):
        pz.Options(depth=1)
    with pytest.raises(ValueError, match="options.slice_bytes: expected a non-negative int"):
        pz.Options(slice_bytes=-1)
    with pytest.raises(ValueError, match="options.oneshot_bytes: expected a non-negative int"):
        pz.Options(oneshot_bytes=1.5)
    with pytest.raises(ValueError, match="options.stream_bytes: expected a non-negative int"):
        pz.Options(stream_bytes=-1)
    with pytest.raises(ValueError, match="options.symmetric: expected True, False or None"):
        pz.Options(symmetric="no")
    with pytest.raises(ValueError, match="options.system_scope: expected True, False or None, got 1"):
        pz.Options(system_scope=1)


def test_options_get_reads_the_environment_as_default(monkeypatch):
    monkeypatch.setenv("PYZERO_SHM_ONESHOT_KB", "8")
    assert pz.Options().get("oneshot_bytes", 256 << 10, "PYZERO_SHM_ONESHOT_KB", kib=True) == 8 << 10
    assert pz.Options(oneshot_bytes=0).get("oneshot_bytes", 256 << 10, "PYZERO_SHM_ONESHOT_KB", kib=True) == 0
    monkeypatch.setenv("PYZERO_SYMMETRIC", "0")
    assert pz.Options().get("symmetric", True, "PYZERO_SYMMETRIC") is False
    monkeypatch.setenv("PYZERO_SHM_DEPTH", "many")
    with pytest.raises(ValueError, match="PYZERO_SHM_DEPTH='many': expected a non-negative integer"):
        pz.Options().get("depth", 8, "PYZERO_SHM_DEPTH")


def _rank_groups():
    pz.init(timeout=30, options={"oneshot_bytes": 0, "symmetric": False})
    n, r = pz.get_world_size(), pz.get_rank()
    world = pz.comm.resolve_group(None)
    inherit = pz.new_group(range(n))
    override = pz.new_group(range(n), options=pz.Options(oneshot_bytes=1 << 20, symmetric=True, slice_bytes=4096,
                                                          depth=2))
    seen = {name: (g.backend.oneshot_bytes, pz.symmetric.supported(g))
            for name, g in (("world", world), ("inherit", inherit), ("override", override))}
    # Each group computes the same sums with its own settings (ring with tiny slices vs one-shot).
    sums = {}
    for name, g in (("world", world), ("inherit", inherit), ("override", override)):
        t = torch.arange(10007, dtype=torch.float64) * (r + 1)
        pz.all_reduce(t, group=g)
        sums[name] = t
    try:
        pz.new_group(range(n), options={"depth": 0})
        bad = None
    except ValueError as e:
        bad = str(e)
    try:  # valid for Options (at least 64), not for the shm transport
        pz.new_group(range(n), options={"slice_bytes": 1000})
        bad_slice = None
    except ValueError as e:
        bad_slice = str(e)
    t = torch.full((3,), float(r + 1))
    pz.all_reduce(t)  # the world goes on
    return seen, sums, bad, (bad_slice, t.tolist())


def test_groups_take_their_own_options():
    n = 2
    for res in run_ranks(_rank_groups, n, timeout=60):
        seen, sums, bad, (bad_slice, after) = res.value
        assert seen == {"world": (0, False), "inherit": (0, False), "override": (1 << 20, True)}
        expected = torch.arange(10007, dtype=torch.float64) * sum(range(1, n + 1))
        for t in sums.values():
            torch.testing.assert_close(t, expected, rtol=0, atol=0)
        assert bad is not None and "options.depth: expected at least 2" in bad
        assert bad_slice is not None and all(w in bad_slice for w in ("slice_bytes=1000", "PYZERO_SHM_SLICE_KB",
                                                                        "multiple of 64", "4096")), bad_slice
        assert after == [3.0] * 3


def test_environment_settings_share_one_parser(monkeypatch):
    """Every PYZERO_* integer or flag: blank means the default, a bad value names the variable."""
    from pyzero.envvars import env_bool, env_int
    assert env_int("X", 7, environ={}) == 7 and env_int("X", 7, environ={"X": "  "}) == 7
    assert env_int("X", 7, environ={"X": "12"}) == 12 and env_int("X", 7, kib=True, environ={"X": "3"}) == 3072
    for bad in ("-1", "1.5", "4M", "1_000", "+5"):  # (int() reads the last two)
        with pytest.raises(ValueError, match=rf"X='{re.escape(bad)}': expected a non-negative integer \(KiB\)"):
            env_int("X", 7, kib=True, environ={"X": bad})
    assert [env_bool("F", None, environ={"F": v}) for v in ("1", "On", "YES", "true", "0", "off", "No")] == \
        [True] * 4 + [False] * 3
    assert env_bool("F", True, environ={}) is True
    with pytest.raises(ValueError, match=r"F='maybe': expected one of \['1', 'true'"):
        env_bool("F", False, environ={"F": "maybe"})
    monkeypatch.setenv("PYZERO_SHM_DEPTH", "-2")  # the backends' options read the same way
    with pytest.raises(ValueError, match="PYZERO_SHM_DEPTH='-2': expected a non-negative integer"):
        pz.Options().get("depth", 8, "PYZERO_SHM_DEPTH")
    monkeypatch.setenv("PYZERO_SYMMETRIC", "perhaps")
    with pytest.raises(ValueError, match="PYZERO_SYMMETRIC='perhaps'"):
        pz.Options().get("symmetric", True, "PYZERO_SYMMETRIC")
    monkeypatch.setenv("PYZERO_FLIGHT", "lots")
    import pyzero.flight as flight
    with pytest.raises(ValueError, match="PYZERO_FLIGHT='lots': expected a non-negative integer"):
        flight.start(0, 1, "t")
    monkeypatch.setenv("PYZERO_FLIGHT", str(flight.MAX_RECORDS + 1))  # a ring that size would not fit in memory
    with pytest.raises(ValueError, match=f"PYZERO_FLIGHT={flight.MAX_RECORDS + 1}: expected at most 1048576"):
        flight.start(0, 1, "t")


def test_a_bad_recorder_setting_fails_pz_init_not_the_import():
    """PYZERO_FLIGHT is pz.init's setting: a script that only imports pyzero (a tool, a single-process run)
    still imports; pz.init names the value."""
    import os  # noqa: PLC0415
    import subprocess  # noqa: PLC0415
    import sys  # noqa: PLC0415

    code = ("import pyzero as pz\nprint('imported')\ntry:\n    pz.init()\n"
            "except ValueError as e:\n    print(e)\n")
    env = {**os.environ, "PYZERO_FLIGHT": "lots"}
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(k, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines()[0] == "imported", out.stdout
    assert "PYZERO_FLIGHT='lots': expected a non-negative integer" in out.stdout, out.stdout


def _rank_shm_env(var, value):
    import os  # noqa: PLC0415
    os.environ[var] = value
    from outcomes import outcome  # noqa: PLC0415
    return outcome(lambda: pz.init(backend="shm", timeout=10))


@pytest.mark.parametrize("var,value,words", [
    ("PYZERO_SHM_DEPTH", "1", ["depth=1", "PYZERO_SHM_DEPTH", "2 to 65536"]),  # (was the C++ constructor's text)
    ("PYZERO_SHM_DEPTH", "100000000000", ["PYZERO_SHM_DEPTH", "2 to 65536"]),  # (was a pybind TypeError)
    ("PYZERO_SHM_SLICE_KB", "99999999999", ["PYZERO_SHM_SLICE_KB", "at most 1 TiB"])])  # (was mmap's ENOMEM)
def test_shm_settings_from_the_environment_are_checked_by_name(var, value, words):
    """The shm backend's settings read from the environment meet the checks options fields meet, named."""
    etype, msg = run_ranks(_rank_shm_env, 1, args=(var, value), timeout=30)[0].value
    assert etype == "ValueError" and all(w in msg for w in words), (etype, msg)


def test_every_pyzero_variable_the_sources_name_is_known():
    """envvars.KNOWN lists every PYZERO_* name the package, its build, scripts, docs and tests use (pz.init
    warns about any other one set): a name read somewhere but missing from the list would warn wrongly."""
    import pathlib  # noqa: PLC0415

    from pyzero.envvars import KNOWN  # noqa: PLC0415

    root = pathlib.Path(__file__).resolve().parent.parent
    files = [f for d in ("pyzero", "scripts", "docs", "tests", "csrc", ".ci") for f in (root / d).rglob("*")
             if f.is_file() and f.suffix in (".py", ".sh", ".md", ".cpp", ".h", ".cu", ".txt", "")]
    files += [root / n for n in ("setup.py", "CMakeLists.txt", "README.md") if (root / n).exists()]
    named = set()
    for f in files:
        try:
            named |= set(re.findall(r"PYZERO_[A-Z0-9_]+", f.read_text(errors="ignore")))
        except OSError:
            continue
    named = {n for n in named if not n.endswith("_")}  # (not the families: PYZERO_SHM_*)
    assert named - KNOWN == set(), sorted(named - KNOWN)


def _rank_typo():
    import warnings  # noqa: PLC0415
    with warnings.catch_warnings(record=True) as ws:
        warnings.simplefilter("always")
        pz.init(timeout=10)
    return [str(w.message) for w in ws if issubclass(w.category, RuntimeWarning)]


def test_a_misspelt_setting_warns_naming_the_known_one():
    """A misspelt PYZERO_FLIGHT=0 left the recorder on without a word."""
    typo = "PYZERO" + "_FLIHGT"  # (spelt apart: the test above reads this file for the names it uses)
    got = run_ranks(_rank_typo, 1, env={typo: "0"}, timeout=30)[0].value
    assert got == [f"{typo}: not a pyzero setting, ignored (did you mean PYZERO_FLIGHT?)"], got
    assert run_ranks(_rank_typo, 1, env={"PYZERO_FLIGHT": "0"}, timeout=30)[0].value == []
