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
