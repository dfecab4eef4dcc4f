"""Bytes pyzero reads but did not write itself (beyond pz.ps's wire, tests/test_ps_wire.py): store
values other ranks publish are JSON checked before use, never unpickled; the launcher's files are
private to the user."""
from __future__ import annotations

import os
import pickle
import stat

import pytest

from pyzero import flight, launch
from pyzero.topology import host_report, peer_json


class Boom:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.parametrize("raw,words", [
    (b'["host-a", 2, 1]', None),
    (b'["host-a", null, null]', None),
    (b'["host-a", 2]', "local world size"),
    (b'["host-a", "2", 0]', "local world size"),
    (b'["", 2, 0]', "local world size"),
    (b'["host-a", 2, 3, 4]', "local world size"),
    (b'["host-a", 2, -1]', "local world size"),
    (b'["host-a", 2, "0"]', "local world size"),
    (b'{"host": "a"}', "local world size"),
    (b'["host-a", 0, 0]', "local world size"),
    (b"[" * 100000, "not \\[host name"),
    (b"\xff\xfe", "not \\[host name"),
    (b"x" * (2 << 20), "at most"),
])
def test_host_reports_are_checked(raw, words):
    if words is None:
        assert host_report(raw, "pz/topology/0") == [raw.split(b'"')[1].decode(),
                                                     *([None, None] if b"null" in raw else [2, 1])]
    else:
        with pytest.raises(ValueError, match=words):
            host_report(raw, "pz/topology/0")


def test_a_pickle_in_the_store_is_data_not_code(tmp_path):
    raw = pickle.dumps(Boom(str(tmp_path / "executed")))
    with pytest.raises(ValueError, match="pz/topology/1"):
        host_report(raw, "pz/topology/1")
    with pytest.raises(ValueError, match="flight records"):
        peer_json(raw, "pz/flight/1/dump1", lambda v: type(v) is dict, "a rank's flight records")
    assert not os.path.exists(tmp_path / "executed")
    assert flight.peer_json is peer_json  # the flight recorder's exchange uses the same check


def _where_am_i():
    out = os.readlink("/proc/self/fd/1")  # this rank's output file, in the run's folder
    return out, stat.S_IMODE(os.stat(os.path.dirname(out)).st_mode), stat.S_IMODE(os.stat(out).st_mode)


def test_launcher_files_are_private(tmp_path):
    res = launch.run_ranks(_where_am_i, 2, timeout=30)
    for r in res:
        path, dir_mode, file_mode = r.value
        assert dir_mode == 0o700 and file_mode == 0o600, (path, oct(dir_mode), oct(file_mode))
        assert not os.path.exists(os.path.dirname(path))  # removed after the run
    p = tmp_path / "result.pkl"
    with launch._private(str(p)) as f:
        f.write(b"x")
    assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    with pytest.raises(FileExistsError):  # never writes through a file (or link) someone put there
        launch._private(str(p))
