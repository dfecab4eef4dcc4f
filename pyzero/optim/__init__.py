"""Fast fused CPU optimizers with the torch.optim API (``pz.optim.AdamW``, ``Adam``, ``SGD``, ``Adagrad``).

One vectorised pass per element (AVX-512 / AVX2 chosen at run time, a portable
path elsewhere), multi-threaded over chunks (on torch's OpenMP threads where
loaded), with an optional gradient scale and a 16-bit copy of the updated
parameters written in the same pass. Results
are torch.optim's (foreach=False) op for op; they differ only where torch's
MKL sqrt is not correctly rounded (see csrc/cpu_optim.h and docs/offload.md).
Step hooks and the profiler see a step as torch's own optimizers' (functional.hooked_step);
with neither present torch's step wrapper is skipped, and a step rechecks only the tensors
that changed since the last one (functional.Checked).
``Adam``/``AdamW`` store their moments in fp32, bf16 or block-quantized int8 (``moments=``,
see :mod:`pyzero.optim.moments`). ``NvmeAdam``/``NvmeAdamW`` keep the optimizer state in swap files on a local disk.
"""
from . import moments
from .adagrad import Adagrad
from .adam import Adam, AdamW
from .functional import adagrad_step, adam_step, cpu_isa, cpu_threading, sgd_step
from .nvme import NvmeAdam, NvmeAdamW
from .sgd import SGD

__all__ = ["Adagrad", "Adam", "AdamW", "SGD", "NvmeAdam", "NvmeAdamW", "adagrad_step", "adam_step", "sgd_step",
           "cpu_isa", "cpu_threading", "fast_equivalent"]


def fast_equivalent(optimizer_class):
    """pyzero's fused CPU class for a torch.optim class it covers (AdamW, Adam, SGD, Adagrad),
    else the class itself."""
    import torch  # noqa: PLC0415

    return {torch.optim.AdamW: AdamW, torch.optim.Adam: Adam, torch.optim.SGD: SGD,
            torch.optim.Adagrad: Adagrad}.get(optimizer_class, optimizer_class)
