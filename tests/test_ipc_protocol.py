"""The ipc backend's flag protocol and collective bodies (csrc/ipc_protocol.h), run by CPU threads.

tests/ipc_protocol_on_cpu.cpp plays 2-4 ranks of 1-3 blocks each, a thread per block, through random
sequences of every collective, dtype and op (uneven and zero counts, in place and out of place), with
pauses that let peers run ahead, through both the 16-byte vector loops and the scalar ones (pointers
that share no alignment), and compares every result bitwise with the shm one-shot's reduction
(cpu_reduce.h) in rank order; then a rank that never calls (the others time out naming it) and a
mismatched call (every rank reports it, the next call works), a rank that closed; a mismatched call the
ranks cut into different numbers of launches, and ranks with different block counts (both: calls apart, a
fault on every rank, no later call runs); every rank closing, one late (no failure, no buffer read after its
closing barrier). Then replays: one call's launches run 40
times with byte-identical parameters, as a CUDA graph replays its kernels (the epoch lives on the device),
with fresh inputs each time. Built once more with the two epoch areas made one, a broken ordering, it must
find wrong results.

tests/ipc_p2p_on_cpu.cpp does the same for point-to-point (csrc/ipc_p2p.h): random rounds of batches
(pairs sending to each other at once, ring steps, several messages on one channel) and single send/recv
launches at 2-4 ranks, 1-3 blocks, every dtype, messages of many pieces, buffers at every offset; every
received buffer bytewise equal to what its sender sent, nothing written past it. Replays with
byte-identical arguments; a send with no receive and a receive with no send time out naming the peer;
mismatched sizes and dtypes are reported on both ranks and the channel goes on; an abort ends a wait; a
timeout beside a mismatch in one batch is reported (the mismatch kept apart); a ring collective's messages
whose calls differ are a fault on both ranks.
Built with the sender's wait for a consumed slot skipped, it must find wrong results. Last, the ring
collectives of csrc/p2p_ring.h (algo="ring" on ipc) over this point-to-point: every collective, dtype and
op, uneven and zero chunks, a few elements of staging so each call runs many launches, against the
reference reduction.
"""
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="needs g++")


BUILDS = [((), "ipc_protocol_on_cpu.cpp"), (("PZ_IPC_ONE_AREA",), "ipc_protocol_on_cpu.cpp"),
          ((), "ipc_p2p_on_cpu.cpp"), (("PZ_IPC_P2P_NO_SLOT_WAIT",), "ipc_p2p_on_cpu.cpp")]


@pytest.fixture(scope="module")
def binaries(tmp_path_factory):
    """The four test programs, compiled side by side (g++ runs one core each): {(defines, source): path}."""
    out = tmp_path_factory.mktemp("ipc_cpu")
    procs = {}
    for defines, source in BUILDS:
        exe = out / (source.split(".")[0] + "".join(d.lower() for d in defines))
        procs[defines, source] = (exe, subprocess.Popen(
            ["g++", "-std=c++17", "-O1", "-Wall", "-Wextra", "-Wno-attributes", *[f"-D{d}" for d in defines],
             f"-I{ROOT / 'csrc'}", str(ROOT / "tests" / source), "-o", str(exe), "-lpthread"],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    built = {}
    for key, (exe, proc) in procs.items():
        try:
            _, err = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        built[key] = (exe, proc.returncode, err)
    return built


def _build_and_run(binaries, *defines, source="ipc_protocol_on_cpu.cpp"):
    exe, rc, err = binaries[tuple(defines), source]
    assert rc == 0, err[-4000:]
    assert "warning" not in err, err[-4000:]
    return subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)


def test_ipc_protocol_on_cpu_threads(binaries):
    run = _build_and_run(binaries)
    out = run.stdout
    assert run.returncode == 0, out[-4000:]
    m = re.search(r"(\d+) cases, (\d+) failures", out)
    assert m and int(m.group(2)) == 0 and int(m.group(1)) >= 2800, out[-2000:]
    runs = re.findall(r"ranks \d blocks \d: 160 calls, 0 wrong, 0 failed \((\d+) launches\)", out)
    assert len(runs) == 6 and all(int(n) > 200 for n in runs), out  # many calls ran in several pieces
    replays = re.findall(r"replay ranks \d kind \d: 40 calls, 0 wrong, 0 failed", out)
    assert len(replays) == 6 and "replayed launches whose parameters differ: 0" in out, out
    assert "never calls: rank 0 code 1 peer 1, rank 2 code 1 peer 1" in out and "mismatch: codes 2 2 2" in out, out
    assert "close: codes 4 4 2, peers 2 2" in out, out  # peers learn that rank 2 left; it sees a mismatch
    assert re.search(r"left: codes 4 4, peers 2 2, [\d.]+ s: ok", out), out  # a rank that closed, no barrier
    # a mismatch cut into different launch counts (f32 / f64 across the area): a fault on both ranks at
    # once, and no later call runs (were: later calls paired with the peer's other calls, OK, wrong data)
    assert re.search(r"apart: codes 5 5 then 5 5, launches 1/2, 0 wrong, [\d.]+ s: ok", out), out
    assert "blocks 2 and 3: codes 5 5 then 5 5, blocks 2/3, 0 wrong: ok" in out, out  # block counts differ
    # every rank closes, one late to its closing barrier: no failure, no buffer read once "freed"
    assert "normal close: codes 0 0 0, 0 failed in 4 runs: ok" in out, out
    m = re.search(r"loops: (\d+) scalar, (\d+) vectorised", out)  # misaligned peers stay scalar, the rest 16-byte
    assert m and int(m.group(1)) > 1000 and int(m.group(2)) > 1000, out


def test_ipc_protocol_check_finds_a_broken_ordering(binaries):
    """One area for both epoch parities: a rank's next copy-in overwrites data a slower peer still reads."""
    run = _build_and_run(binaries, "PZ_IPC_ONE_AREA")
    m = re.search(r"one area: (\d+) wrong results", run.stdout)
    assert m and int(m.group(1)) > 0, run.stdout[-2000:]


def test_ipc_p2p_on_cpu_threads(binaries):
    run = _build_and_run(binaries, source="ipc_p2p_on_cpu.cpp")
    out = run.stdout
    assert run.returncode == 0, out[-4000:]
    m = re.search(r"(\d+) cases, (\d+) failures", out)
    assert m and int(m.group(2)) == 0 and int(m.group(1)) >= 3000, out[-2000:]
    runs = re.findall(r"ranks \d blocks \d: (\d+) launches, (\d+) messages checked, 0 wrong, no failure", out)
    assert len(runs) == 6 and all(int(n) > 300 for _, n in runs), out
    replays = re.findall(r"replay ranks \d: (\d+) messages checked, 0 wrong, 0 launches with other arguments: ok", out)
    assert [int(n) for n in replays] == [60, 90], out
    assert "send without receive: code 1 peer 1 waiting 1 bytes 4000: ok" in out, out  # timeout, naming rank 1
    assert "receive without send: code 1 peer 0 waiting 3: ok" in out, out
    assert "mismatch: codes 2 2, bytes 400/480 and 480/400, then 6 messages intact: ok" in out, out
    assert re.search(r"abort: code 3 peer 0, [\d.]+ s: ok", out), out
    # a peer that closed: its finished send arrives, a receive and a send waiting on it fail naming it
    assert re.search(r"peer closed: codes 0 4 4 peer 0 waiting 3 and 1, 1 received, [\d.]+ s: ok", out), out
    # a timeout in a batch with a mismatched message: reported (a fault), the mismatch kept apart
    assert "mismatch and timeout: rank 0 fault 1 waiting 3 and mismatch 2, then 1; rank 1 2: ok" in out, out
    assert "ring calls apart: codes 5 5 then 5 5: ok" in out, out  # a ring collective's messages differ
    m = re.search(r"loops: (\d+) scalar, (\d+) vectorised", out)  # buffers at every offset: both copy loops
    assert m and int(m.group(1)) > 1000 and int(m.group(2)) > 1000, out
    rings = re.findall(r"ring ranks \d: 24 collectives, (\d+) launches, 0 wrong", out)  # algo="ring" over p2p
    assert len(rings) == 3 and all(int(n) > 200 for n in rings), out


def test_ipc_p2p_check_finds_a_sender_that_does_not_wait_for_free_slots(binaries):
    """The sender overwrites slots its receiver has not read yet: received data must come out wrong."""
    run = _build_and_run(binaries, "PZ_IPC_P2P_NO_SLOT_WAIT", source="ipc_p2p_on_cpu.cpp")
    m = re.search(r"no slot wait: (\d+) wrong results", run.stdout)
    assert m and int(m.group(1)) > 0, run.stdout[-2000:]
