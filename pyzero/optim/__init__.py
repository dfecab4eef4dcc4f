"""Fast fused CPU optimizers with the torch.optim API (``pz.optim.AdamW``, ``Adam``, ``SGD``).

One vectorised pass per element (AVX-512 / AVX2 chosen at run time, a portable
path elsewhere), multi-threaded over chunks, with an optional gradient scale
and a 16-bit copy of the updated parameters written in the same pass. Results
match torch.optim (foreach=False) within 1 ulp per step; see csrc/cpu_optim.h.
``NvmeAdam``/``NvmeAdamW`` keep the optimizer state in swap files on a local disk.
"""
from .adam import Adam, AdamW
from .functional import adam_step, cpu_isa, sgd_step
from .nvme import NvmeAdam, NvmeAdamW
from .sgd import SGD

__all__ = ["Adam", "AdamW", "SGD", "NvmeAdam", "NvmeAdamW", "adam_step", "sgd_step", "cpu_isa"]
