"""The fast subset of the fault-injection matrix (pyzero-bench faults) and a short soak (pyzero-bench soak).

Each matrix cell runs real ranks with a real fault (SIGKILL/SIGSTOP of rank 1 at a random moment, or a
rank misbehaving in code); the harness compares every surviving rank's results with references computed
locally, and the checkpoint left behind with single-process torch.
"""
import os
import random

import pytest
import torch

from pyzero.bench import fault_workloads as workloads
from pyzero.bench import faults, soak

TIMEOUT = 2.0  # the collective timeout of the ranks (s)


@pytest.mark.parametrize("name", faults.FAST)
def test_fault_cell(name):
    cell = faults.CELLS[name]
    row = faults.run_cell(cell, tries=1, seed=1, timeout=TIMEOUT, margin=8.0, window=0.5)
    assert row["hangs"] == 0, row
    assert row["expected"] == 1, row
    assert row["wrong"] == 0, row
    assert row["leftovers"] == 0, row
    if cell.fault == "kill":  # a dead peer is noticed at once, not at the timeout
        assert row["max_s"] < 1.0, row
    elif cell.fault == "stop" or name == "never-calls":  # at the timeout, plus at most the record exchange
        assert TIMEOUT - 0.1 < row["max_s"] < TIMEOUT + 3.0, row
    if name == "never-calls":
        assert any("rank 1 is behind" in m or "never arrived: [1]" in m for m in row["messages"]), row


@pytest.mark.parametrize("name", ["mismatch-op", "allreduce-kill"])
def test_fault_cell_on_hier(name):
    """Cells on the hier backend (two simulated hosts, gloo between them): a mismatched op is an error on
    both ranks (gloo alone would mix a sum and a max silently); a killed rank is named, without a hang."""
    row = faults.run_cell(faults.CELLS[name], tries=1, seed=3, timeout=TIMEOUT, margin=8.0, window=0.5,
                          backend="hier")
    assert (row["expected"], row["hangs"], row["wrong"], row["leftovers"]) == (1, 0, 0, 0), row
    if name == "mismatch-op":
        assert all("the ranks differ in op or root" in m for m in row["messages"]), row
    else:
        assert any("rank 1 (host 'host1') did not respond" in m for m in row["messages"]), row


@pytest.mark.parametrize("name", ["save-disk-full", "save-read-only"])
def test_fault_cell_tmpfs(name):
    """A real full / read-only file system under the checkpoint (mounting a tmpfs needs root)."""
    row = faults.run_cell(faults.CELLS[name], tries=1, seed=2, timeout=TIMEOUT, margin=8.0, window=0.5)
    if row.get("skipped"):
        pytest.skip(row["skipped"])
    assert (row["expected"], row["hangs"], row["wrong"], row["leftovers"]) == (1, 0, 0, 0), row
    assert any("No space left" in m or "Read-only file system" in m for m in row["messages"]), row["messages"]


def test_checkpoint_check_finds_wrong_state(tmp_path):
    """The harness's own check: a consolidated checkpoint that is not its step's state counts as wrong."""
    import pyzero as pz  # noqa: PLC0415
    from pyzero.launch import run_ranks  # noqa: PLC0415

    def save_two(tmp):
        pz.init(timeout=20)
        ctx = workloads.Ctx(pz.get_rank(), pz.get_world_size(), tmp, random.Random(0), 20)
        step = workloads.WORKLOADS["save"](ctx)
        step()
        step()
        return ctx.out["saved"]
    assert [r.value for r in run_ranks(save_two, 2, args=(str(tmp_path),), timeout=60)] == [2, 2]
    res = {"messages": []}
    assert faults._check_after(faults.CELLS["save-kill"], str(tmp_path), {}, res) == 0, res
    with open(os.path.join(tmp_path, "ckpt", "latest"), "w") as f:
        f.write("step_00000001")  # the step-2 state presented as step 1
    os.rename(os.path.join(tmp_path, "ckpt", "step_00000002"), os.path.join(tmp_path, "ckpt", "step_00000001x"))
    os.rename(os.path.join(tmp_path, "ckpt", "step_00000001"), os.path.join(tmp_path, "ckpt", "step_00000002"))
    os.rename(os.path.join(tmp_path, "ckpt", "step_00000001x"), os.path.join(tmp_path, "ckpt", "step_00000001"))
    assert faults._check_after(faults.CELLS["save-kill"], str(tmp_path), {}, res) == 1
    assert "differs from its reference" in res["messages"][-1]


def test_a_lost_checkpoint_counts_as_lost(tmp_path):
    """No checkpoint left although a rank saw a save complete (or the failing save was not the first):
    lost, not 'nothing to lose'; with no save completed, nothing is lost."""
    os.makedirs(tmp_path / "ckpt")
    res = {"messages": []}
    assert faults._check_after(faults.CELLS["save-kill"], str(tmp_path), {0: {"saved": 3}}, res) == 1
    assert "step 3's save completed" in res["messages"][-1]
    assert faults._check_after(faults.CELLS["save-enospc"], str(tmp_path), {0: {"fail_at": 2}}, res) == 1
    assert faults._check_after(faults.CELLS["save-kill"], str(tmp_path), {0: {"saved": 0}}, res) == 0
    assert faults._check_after(faults.CELLS["save-enospc"], str(tmp_path), {0: {"fail_at": 1}}, res) == 0


def test_a_cell_expects_the_error_it_is_about():
    """A mismatch cell passes only on an error naming the mismatch (a plain timeout passed it: with the
    check off, hier reported gloo's recv timeout and the cell counted it expected); never-calls only on a
    timeout; a kill cell on any pyzero error; on nccl, where NCCL tells neither, on any pyzero error."""
    timeout = ("CollectiveError", "an inter-host transfer failed on every rank: Timed out waiting 3000ms for recv")
    mismatch = ("CollectiveError", "all_reduce (rank 0 of 2, seq 3): mismatched collective: rank 1 called broadcast")
    late = ("CollectiveTimeout", "all_reduce (rank 0 of 2, seq 2): timed out after 2 s waiting for rank 1")
    cells = faults.CELLS
    assert not faults._error_expected(cells["mismatch-kind"], "hier", timeout)
    assert faults._error_expected(cells["mismatch-kind"], "hier", mismatch)
    assert faults._error_expected(cells["mismatch-kind"], "nccl", timeout)
    assert faults._error_expected(cells["never-calls"], "shm", late)
    assert not faults._error_expected(cells["never-calls"], "shm", mismatch)
    assert faults._error_expected(cells["allreduce-kill"], "shm", timeout)
    assert not faults._error_expected(cells["allreduce-kill"], "shm", ("unexpected ValueError", "x"))
    assert not faults._error_expected(cells["allreduce-kill"], "shm", None)
    # the pipeline cells stop the first stage: the last, which checks each loss, survives to count
    assert cells["pipeline-kill"].victim == cells["pipeline-stop"].victim == 0


@pytest.mark.parametrize("argv,flag", [(["--cells", "bogus"], "--cells"), (["--tries", "0"], "--tries")])
def test_bad_cells_and_tries_are_usage_errors(argv, flag, capsys):
    from pyzero.bench.__main__ import main  # noqa: PLC0415

    with pytest.raises(SystemExit) as e:
        main(["faults", *argv])
    assert e.value.code == 2 and flag in capsys.readouterr().err


def test_soak_short():
    r = soak.soak(seconds=2.0, nproc=3, seed=5)
    assert r["wrong"] == 0, r["notes"]
    for kind in ("all_reduce", "reduce_scatter", "all_gather", "broadcast", "barrier", "all_gather_matmul",
                 "matmul_reduce_scatter", "sendrecv"):
        assert r["calls"].get(kind, 0) > 0, (kind, r["calls"])


def test_soak_counts_wrong_results():
    """A soak told to falsify 2 results per rank reports exactly those."""
    r = soak.soak(seconds=0.5, nproc=2, seed=3, inject_wrong=2)
    assert r["wrong"] == 4, r


def test_reference_params_is_torch():
    a = workloads.reference_params(2)
    model = workloads.mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for k in (1, 2):
        x, y = workloads.batch(k)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    for n, p in model.named_parameters():
        assert torch.equal(a[n], p.detach())
