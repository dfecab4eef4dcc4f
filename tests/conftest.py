"""Shared test set-up. Multi-rank tests use pyzero.launch.run_ranks (forked
ranks, hard timeout, every rank's output on failure)."""
import glob
import os

import pytest
import torch

# The parent only forks ranks and compares results: one thread, so forking
# never copies a live OpenMP pool.
torch.set_num_threads(1)

# torch's TCPStore looks up the peer's host name on every connection (the job's store in pz.init, the
# flight recorder's, torch.distributed's). Where the name server drops a query, glibc waits 5 s before it
# asks again; each rank that forks from here asks after 1 s instead (see docs/troubleshooting.md).
os.environ.setdefault("RES_OPTIONS", "timeout:1")


def _shm_segments():
    return set(glob.glob("/dev/shm/pz*"))


@pytest.fixture(scope="session", autouse=True)
def no_leftover_segments():
    before = _shm_segments()
    yield
    left = _shm_segments() - before
    assert not left, f"shared-memory segments left behind: {sorted(left)}"


def pytest_collection_modifyitems(config, items):
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU (run scripts/gpu_check.sh on one)"))
