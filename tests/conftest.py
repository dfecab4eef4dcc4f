"""Shared test set-up. Multi-rank tests use pyzero.launch.run_ranks (forked
ranks, hard timeout, every rank's output on failure)."""
import glob
import os

import pytest
import torch

# The parent only forks ranks and compares results: one thread, so forking
# never copies a live OpenMP pool.
torch.set_num_threads(1)


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
