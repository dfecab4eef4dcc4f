"""Comparing two training runs (losses, logged gradient norms, final weights) for the integration tests."""
from __future__ import annotations

import torch

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32: the order of the gradient reduction differs (Adam amplifies it
# where a gradient element is near 0: up to 1e-6 seen, against updates of LR = 1e-2 a step)


def close(a, b, **tol):
    torch.testing.assert_close(torch.tensor(a), torch.tensor(b), **(tol or TOL))


def assert_same_run(got, ref, what, bitwise=False):
    """got/ref: {"loss": [...], "grad_norm": [...], "weights": {name: tensor}}."""
    tol = dict(rtol=0, atol=0) if bitwise else TOL
    close(got["loss"], ref["loss"], **tol)
    close(got["grad_norm"], ref["grad_norm"], **tol)
    assert got["weights"].keys() == ref["weights"].keys(), what
    for k, v in ref["weights"].items():
        torch.testing.assert_close(got["weights"][k], v, **tol, msg=lambda m, k=k: f"{what}, {k}: {m}")


def max_diff(a, b):
    return max((a[k] - b[k]).abs().max().item() for k in a)


def assert_bf16_tracks(runs, ref, fp32_weights, share):
    """Each bf16 run of `runs` ({name: run}) computed in bf16 (it moved from the fp32 weights by more than
    half of what bf16 autocast changes in the reference's own run) and ended within `share` of that
    change from the reference bf16 run; losses and norms close."""
    own_error = max_diff(ref["weights"], fp32_weights)
    assert own_error > 1e-4
    for name, run in runs.items():
        assert max_diff(run["weights"], fp32_weights) > 0.5 * own_error, f"{name}: did not compute in bf16"
        assert max_diff(run["weights"], ref["weights"]) <= share * own_error, name
        close(run["loss"], ref["loss"], rtol=1e-3, atol=0)
        close(run["grad_norm"], ref["grad_norm"], rtol=1e-2, atol=0)
