"""ZeRO-Offload and ZeRO-Infinity placement for ZeroOptimizer: ``offload="cpu" | "nvme"``.

What moves where:
  offload="cpu"   fp32 master shards and optimizer state in host memory, the step on the
                  CPU with pz.optim's fused kernel (torch.optim.Adam/AdamW/SGD/Adagrad are
                  swapped for pz.optim's; other optimizers run as given, on the host).
  offload="nvme"  as "cpu", and the optimizer state in swap files under ``nvme_path``
                  (pz.optim.NvmeAdam/NvmeAdamW; Adam and AdamW only).
  offload_params  (stage 3) parameter shards in host memory as well.
  offload_moments Adam/AdamW's exp_avg and exp_avg_sq stored as "fp32" (8 bytes per parameter,
                  the default), "bf16" (4) or "int8" (2.03: block-quantized, see
                  pyzero.optim.moments); with offload="cpu".
  delayed_update  the one-step delayed parameter update of ZeRO-Offload (DPU): the CPU step
                  of step t runs in a background thread while forward/backward of step t+1
                  run on the parameters from before it (see [Note: delayed update]); stages 1-2.
  offload_pipeline  the host step bucket by bucket (stage 3: unit by unit) in a worker thread,
                  each bucket's parameters sent to the device as the next one steps; True
                  also starts a bucket's step during backward, as soon as its gradient is on
                  the host, where that is exact (see [Note: offload pipeline] in optimizer.py).

For a CPU model host memory *is* the device: "cpu" keeps every tensor where it is and
only changes the kernel, "nvme" takes the optimizer state out of RAM. For a CUDA model
ZeroOptimizer keeps the masters, the gradient shards and the state in pinned host memory,
copying each reduced slice to the host as it is ready and the step's 16-bit copies back
(see [Note: offload of a CUDA model] in optimizer.py).

ZeroOptimizer calls :func:`resolve` in ``__init__`` (bad arguments fail before the model is
touched) and :meth:`Offload.build_optimizer` where it builds its inner optimizer.
"""
from __future__ import annotations

import ctypes
import mmap
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from .. import optim as pz_optim
from ..optim import swap

MODES = (None, "cpu", "nvme")
_EXACT_PIN_BYTES = 1 << 26  # from 64 MiB up, page-locked memory of the exact size (see pinned_empty)
# torch.optim class -> (pz.optim class for offload="cpu", class for offload="nvme" or None)
_FAST = {torch.optim.AdamW: (pz_optim.AdamW, pz_optim.NvmeAdamW), torch.optim.Adam: (pz_optim.Adam, pz_optim.NvmeAdam),
         torch.optim.SGD: (pz_optim.SGD, None), torch.optim.Adagrad: (pz_optim.Adagrad, None),
         pz_optim.Adagrad: (pz_optim.Adagrad, None), pz_optim.AdamW: (pz_optim.AdamW, pz_optim.NvmeAdamW),
         pz_optim.Adam: (pz_optim.Adam, pz_optim.NvmeAdam), pz_optim.SGD: (pz_optim.SGD, None),
         pz_optim.NvmeAdamW: (pz_optim.NvmeAdamW, pz_optim.NvmeAdamW),
         pz_optim.NvmeAdam: (pz_optim.NvmeAdam, pz_optim.NvmeAdam)}
_TORCH_ONLY = ("foreach", "fused", "capturable", "differentiable")  # torch.optim kwargs pz.optim does not take


def state_elems_per_param(optimizer_class, kwargs: dict) -> int:
    """fp32 values of optimizer state per parameter element (Adam 2, 3 with amsgrad; SGD 0-1)."""
    if issubclass(optimizer_class, (torch.optim.Adam, torch.optim.AdamW, pz_optim.Adam)):
        return 3 if kwargs.get("amsgrad") else 2
    if issubclass(optimizer_class, (torch.optim.SGD, pz_optim.SGD)):
        return 1 if kwargs.get("momentum", 0) else 0
    if issubclass(optimizer_class, (torch.optim.Adagrad, pz_optim.Adagrad)):
        return 1
    return 2


class Offload:
    """A checked offload configuration (see :func:`resolve`)."""

    def __init__(self, mode, nvme_path, offload_params, sub_group_elems, moments=None, delayed_update=False,
                 pipeline=None):
        self.mode, self.nvme_path, self.offload_params = mode, nvme_path, offload_params
        self.sub_group_elems = sub_group_elems
        self.moments, self.delayed_update = moments, delayed_update
        self.pipeline = pipeline  # None (ZeroOptimizer decides: see [Note: offload pipeline]), False, True, "step"

    def build_optimizer(self, optimizer_class, groups, kwargs):
        """The inner optimizer over the master-shard pieces in `groups` (the hook in ZeroOptimizer)."""
        cls, kw = self.inner_class(optimizer_class, kwargs)
        if self.mode == "nvme":
            return _FAST[optimizer_class][1](groups, nvme_path=self.nvme_path, sub_group_elems=self.sub_group_elems,
                                             **kw)
        return cls(groups, **kw)

    def inner_class(self, optimizer_class, kwargs):
        """(class, kwargs) the inner optimizer is built with; with "nvme" the in-memory class of
        the same step, whose arguments the on-disk one takes too (ZeroOptimizer tries them on a
        dummy tensor before changing anything)."""
        fast = _FAST.get(optimizer_class, (None, None))[0]
        if self.mode is None or fast is None:  # (offload="cpu" with another optimizer: its own CPU code)
            return optimizer_class, kwargs
        kw = {k: v for k, v in kwargs.items() if k not in _TORCH_ONLY}
        if self.moments is not None:
            kw["moments"] = self.moments
        return fast, kw

    @staticmethod
    def state_bytes(inner) -> tuple[int, int] | None:
        """(state bytes in memory, on disk) for an on-disk inner optimizer, else None: its state
        is read from disk only for checkpoints, never to count it."""
        return inner.state_bytes() if isinstance(inner, pz_optim.NvmeAdam) else None

    def __repr__(self):
        return (f"Offload(mode={self.mode!r}, nvme_path={self.nvme_path!r}, offload_params={self.offload_params}, "
                f"moments={self.moments!r}, delayed_update={self.delayed_update}, pipeline={self.pipeline!r})")


def resolve(offload, nvme_path, offload_params, stage, optimizer_class, kwargs, params, world,
            sub_group_elems=pz_optim.nvme.DEFAULT_SUB_GROUP, moments=None, delayed_update=False,
            pipeline=None) -> Offload:
    """Check the offload arguments of ZeroOptimizer; errors name the argument. For "nvme" the
    path must exist, be writable and hold this rank's optimizer state (os.statvfs)."""
    if offload not in MODES:
        raise ValueError(f"offload: expected None, 'cpu' or 'nvme', got {offload!r}")
    if moments is not None:
        if moments not in pz_optim.moments.MOMENTS:
            raise ValueError(f"offload_moments: expected None or one of {list(pz_optim.moments.MOMENTS)}, "
                             f"got {moments!r}")
        if offload != "cpu":
            raise ValueError(f"offload_moments: needs offload='cpu' (offload='nvme' keeps fp32 state on disk), "
                             f"got offload={offload!r}")
        if _FAST.get(optimizer_class, (None,))[0] not in (pz_optim.Adam, pz_optim.AdamW):
            raise ValueError(f"offload_moments: for torch.optim.Adam/AdamW (or pz.optim's), got "
                             f"{optimizer_class.__name__}")
        if moments != "fp32" and kwargs.get("amsgrad"):
            raise ValueError(f"offload_moments={moments!r}: amsgrad needs fp32 moments")
        if "moments" in kwargs:
            raise ValueError("offload_moments: given together with the optimizer's own moments=; give one")
    if not isinstance(delayed_update, bool):
        raise TypeError(f"delayed_update: expected a bool, got {type(delayed_update).__name__}")
    if delayed_update and (offload != "cpu" or stage not in (1, 2)):
        raise ValueError(f"delayed_update: needs offload='cpu' and stage 1 or 2, got offload={offload!r}, "
                         f"stage={stage!r}")
    if not (pipeline is None or isinstance(pipeline, bool) or pipeline == "step"):
        raise ValueError(f"offload_pipeline: expected None, False, True or 'step', got {pipeline!r}")
    if pipeline not in (None, False):
        if offload != "cpu":
            raise ValueError(f"offload_pipeline: needs offload='cpu' (offload='nvme' pipelines the step with the "
                             f"disk in sub-groups of its own), got offload={offload!r}")
        if delayed_update:
            raise ValueError("offload_pipeline: not with delayed_update=True, whose CPU step already runs behind the "
                             "next forward/backward; give one of them")
    if not isinstance(offload_params, bool):
        raise TypeError(f"offload_params: expected a bool, got {type(offload_params).__name__}")
    if offload_params and (offload is None or stage != 3):
        raise ValueError("offload_params: needs stage=3 and offload='cpu' or 'nvme' (stages 1-2 keep full "
                         "parameters on the device)")
    if nvme_path is not None and offload != "nvme":
        raise ValueError(f"nvme_path: only used with offload='nvme', got offload={offload!r}")
    if offload is not None:
        bad = [k for k in ("capturable", "differentiable") if kwargs.get(k)]
        if bad and optimizer_class in _FAST:
            raise ValueError(f"optimizer_kwargs: {bad} are not supported with offload (the step runs on the CPU)")
    if offload == "nvme":
        fast, nvme = _FAST.get(optimizer_class, (None, None))
        if nvme is None:
            raise ValueError(f"offload='nvme': supports torch.optim.Adam/AdamW (or pz.optim's), got "
                             f"{optimizer_class.__name__}")
        if kwargs.get("moments", "fp32") != "fp32":
            raise ValueError(f"moments: offload='nvme' keeps fp32 state on disk (moments='fp32'), "
                             f"got {kwargs['moments']!r}")
        numel = sum(p.numel() for p in params)
        shard = -(-numel // world)
        swap.check_path(nvme_path, shard * 4 * state_elems_per_param(optimizer_class, kwargs))
    return Offload(offload, nvme_path, offload_params, sub_group_elems, moments, delayed_update, pipeline)


class DelayedStep:
    """The background CPU step of delayed_update (see [Note: delayed update] in optimizer.py).

    One worker thread runs one job at a time. A job first copies the gradient shards into
    its own buffers (``grads``), then opens ``gate`` (closed by :meth:`submit`), then steps
    from those copies: the next backward may write the shards once the gate is open
    (_HostGrads waits on it). :meth:`wait` returns once the job has finished and raises what
    it raised."""

    def __init__(self, shards: list[torch.Tensor]):
        self.grads = [torch.empty_like(s) for s in shards]
        self.gate = threading.Event()
        self.gate.set()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pz-delayed-step")
        self._job = None
        self.unpublished = False  # a job finished whose parameters the model does not have yet

    def submit(self, shards: list[torch.Tensor], step) -> None:
        """Run step() in the background after copying `shards` into self.grads."""
        self.gate.clear()

        def job():
            try:
                for dst, src in zip(self.grads, shards):
                    dst.copy_(src)
            finally:
                self.gate.set()
            step()
        self._job = self._pool.submit(job)

    def wait(self) -> None:
        """Wait for the job in flight (then ``unpublished``); raises what it raised."""
        job, self._job = self._job, None
        if job is not None:
            self.unpublished = True
            job.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class SlotSteps:
    """The worker thread of offload_pipeline (see [Note: offload pipeline] in optimizer.py): jobs
    run one at a time in the order submitted; wait(s) returns once slot s's job has finished
    and raises what it raised."""

    def __init__(self, nslots: int):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="pz-offload-step")
        self.jobs: list = [None] * nslots

    def submit(self, s: int, job) -> None:
        self.jobs[s] = self._pool.submit(job)

    def submitted(self, s: int) -> bool:
        return self.jobs[s] is not None

    def any_submitted(self) -> bool:
        return any(j is not None for j in self.jobs)

    def wait(self, s: int) -> None:
        job = self.jobs[s]
        if job is not None:
            job.result()

    def wait_all(self) -> None:
        """Wait for every job (all of them, also after one raised); then raise the first error."""
        err = None
        for job in self.jobs:
            if job is not None:
                try:
                    job.result()
                except BaseException as e:  # noqa: BLE001 -- re-raised below, after the others finished
                    err = err or e
        if err is not None:
            raise err

    def reset(self) -> None:
        self.jobs = [None] * len(self.jobs)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _PinnedPages(mmap.mmap):
    """Anonymous pages registered with CUDA (page-locked); unregistered before they are unmapped,
    when the last tensor using them is gone."""

    ptr = 0

    def __del__(self):
        if self.ptr:
            ptr, self.ptr = self.ptr, 0
            try:
                torch.cuda.cudart().cudaHostUnregister(ptr)
            except Exception:  # noqa: BLE001 -- at interpreter exit CUDA may be gone; the pages go anyway
                pass


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D host tensor for copies to and from a GPU: page-locked where CUDA is, else plain.
    torch's pin_memory=True takes a block of the next power of two bytes (a 20 GiB master shard
    would lock 32 GiB), so from 64 MiB up the tensor gets exactly its own pages instead:
    anonymous memory registered with cudaHostRegister (plain torch pinning where that fails).
    Its memory lives while any tensor or view of it does; the caller keeps it alive until the
    copies it queued have finished (ZeroOptimizer waits for them in step() and zero_grad())."""
    if not torch.cuda.is_available():
        return torch.empty(numel, dtype=dtype)
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if nbytes < _EXACT_PIN_BYTES:
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    pages = _PinnedPages(-1, nbytes)
    view = (ctypes.c_char * nbytes).from_buffer(pages)
    ptr = ctypes.addressof(view)
    del view  # (an export of the buffer would keep it from being released)
    if int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 1)) != 0:  # 1: cudaHostRegisterPortable
        return torch.empty(numel, dtype=dtype, pin_memory=True)
    pages.ptr = ptr
    return torch.frombuffer(pages, dtype=dtype, count=numel)
