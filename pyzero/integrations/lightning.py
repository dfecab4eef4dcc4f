"""pyzero with Lightning: ``lightning.Trainer(strategy=PyzeroStrategy("zero2"))``.

Usage (2 CPU ranks: under torchrun or ``pyzero.launch.run_ranks``, or started by Lightning itself
with ``devices=2``)::

    import lightning as L
    from pyzero.integrations.lightning import PyzeroStrategy

    class Model(L.LightningModule):
        ...
        def configure_optimizers(self):          # a plain torch optimizer (and schedulers)
            return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.1)

        def on_before_optimizer_step(self, optimizer):     # optional: the global gradient norm
            self.log("grad_norm", self.trainer.strategy.grad_norm())

    trainer = L.Trainer(strategy=PyzeroStrategy("zero2"), accelerator="cpu", devices=2, max_steps=100,
                        gradient_clip_val=1.0, accumulate_grad_batches=2, precision="bf16-mixed")
    trainer.fit(Model(), loader)                  # resume: trainer.fit(model, loader, ckpt_path=path)
    trainer.save_checkpoint("final.ckpt")         # every rank: a folder, see below
    weights = trainer.strategy.lightning_module_state_dict()   # full fp32 weights on rank 0, {} elsewhere

``strategy``: "dp" (pz.DataParallel around the LightningModule, the optimizer as returned) or
"zero1" / "zero2" / "zero3" (a pz.ZeroOptimizer of that stage built from the one optimizer
``configure_optimizers`` returns: its class, its parameter groups and their hyperparameters; its
LR schedulers are moved onto it). ``configure_optimizers`` may also return a pz.ZeroOptimizer of
the LightningModule itself. Other keyword arguments are pz.DataParallel options ("dp") or
ZeroOptimizer options (offload="cpu", bucket_mb, ...); ``backend`` and ``timeout`` go to pz.init.

What changes against Lightning's DDPStrategy: no torch DDP (pyzero reduces the gradients);
``gradient_clip_val`` clips by the global norm over every rank's shard (ZeroOptimizer.clip_grad_norm_);
accumulation micro-steps (``accumulate_grad_batches``) run under no_sync, without communication;
with ZeRO a checkpoint path is a folder: ``pyzero/`` (pz.checkpoint, every rank writes its shard;
resharded on load, any world size or stage) and ``checkpoint.pt``, Lightning's own checkpoint
(loops, callbacks, LR schedulers, hyperparameters) with the consolidated fp32 ``state_dict``, so
``Model.load_from_checkpoint(path + "/checkpoint.pt")`` gives the trained model. With "dp" the
checkpoints are Lightning's own files. Lightning's WeightAveraging callbacks (EMAWeightAveraging, SWA)
read and write the weights inside ZeroOptimizer.gathered_parameters() blocks (stage 3 frees them outside
forward); StochasticWeightAveraging, which refuses sharded models, is refused with "zero3". Lightning's
own collectives (logging with sync_dist, barriers) run on torch.distributed over pyzero's store (gloo;
CUDA tensors on NCCL, or on "pyzero" where processes share a GPU).

Why these extension points: the Strategy decides how the model is wrapped (``setup``), which
optimizers are used (``setup_optimizers``), how accumulation avoids communication
(``block_backward_sync``, which Lightning's loop enters on micro-steps) and how checkpoints are
written and read (``save_checkpoint``, ``load_checkpoint``, ``load_model_state_dict``,
``lightning_module_state_dict``, ``optimizer_state``). Clipping and the optimizer step belong to
the precision plugin, which Lightning chooses from ``Trainer(precision=...)`` and hands to the
strategy: the strategy takes it with pyzero's clipping and step added (a subclass of the same
plugin), and refuses the plugins it cannot honour. A ZeroOptimizer or pz.DataParallel under
Lightning's own DDPStrategy raises at its first forward (see pyzero.wrappers).
"""
from __future__ import annotations

import contextlib
import copy
import functools
import os
from datetime import timedelta

import torch
import torch.distributed as dist
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import StochasticWeightAveraging, WeightAveraging
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.plugins.precision import DoublePrecision, HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.trainer.states import TrainerFn

from .. import checkpoint as pz_checkpoint
from .. import comm, distributed, wrappers
from ..parallel import DataParallel, broadcast_coalesced
from ..zero import ZeroOptimizer, owner
from ..zero.optimizer import whole_tensor_optimizer
from . import _dist
from ..checks import is_real

__all__ = ["CHECKPOINT_DIR", "LIGHTNING_FILE", "STRATEGIES", "PyzeroStrategy", "init"]

STRATEGIES = ("dp", "zero1", "zero2", "zero3")
CHECKPOINT_DIR = "pyzero"  # the pz.checkpoint folder inside a ZeRO checkpoint folder
LIGHTNING_FILE = "checkpoint.pt"  # Lightning's checkpoint dict inside it
_MAX_TIMEOUT = 999_999_999 * 86_400.0  # seconds, at most what a timedelta holds (NaN and infinity refused)


def init(backend: str | None = None, timeout: float = 300.0) -> None:
    """Start pyzero (unless started) and torch.distributed on its store. PyzeroStrategy does this
    itself; call it first where the same processes also run Lightning's own DDPStrategy, which
    would otherwise start torch.distributed on MASTER_PORT, the port pyzero's store needs."""
    if not comm.is_initialized():
        if dist.is_initialized():
            raise RuntimeError("init(): torch.distributed is already initialised and holds the port pyzero's "
                               "store needs; call pyzero.integrations.lightning.init() before the first "
                               "Trainer.fit")
        comm.init(backend=backend, timeout=timeout)
    else:
        _dist.check_started(backend, "init()")
    distributed.init_torch()


def _raw(optimizer):
    return optimizer._optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class _PyzeroPrecision:
    """Mixed into the precision plugin Lightning picked (see PyzeroStrategy.precision_plugin):
    a ZeroOptimizer clips by its global norm and steps without a closure, and one with loss_scale=
    gets the scaled loss's backward."""

    def pre_backward(self, tensor, module):
        zero = owner(module)
        if zero is not None and zero.scaler is not None:  # loss_scale=: backward on the scaled loss, as
            tensor = zero.scale_loss(tensor)  # opt.scale_loss(loss).backward() (step() unscales)
        return super().pre_backward(tensor, module)

    def clip_grad_by_norm(self, optimizer, clip_val):
        zero = _raw(optimizer)
        if not isinstance(zero, ZeroOptimizer):
            return super().clip_grad_by_norm(optimizer, clip_val)
        zero.clip_grad_norm_(float(clip_val))

    def clip_grad_by_value(self, optimizer, clip_val):
        if isinstance(_raw(optimizer), ZeroOptimizer):
            raise ValueError("gradient_clip_algorithm: 'value' is not supported with ZeRO (its gradients are in "
                             "shards Lightning's clipping does not see); use 'norm'")
        return super().clip_grad_by_value(optimizer, clip_val)

    def optimizer_step(self, optimizer, model, closure, **kwargs):
        zero = _raw(optimizer)
        if not isinstance(zero, ZeroOptimizer):
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        # Lightning's order: forward and backward, on_before_optimizer_step, clipping; then the step
        result = self._wrap_closure(model, optimizer, closure)
        if zero._grads_ready:  # (training_step returned None: no backward, nothing to step, as in torch)
            zero.step(**kwargs)
        return result


@functools.lru_cache(maxsize=None)
def _with_pyzero(cls: type) -> type:
    return type(f"Pyzero{cls.__name__}", (_PyzeroPrecision, cls), {})


class PyzeroStrategy(DDPStrategy):
    """Lightning strategy with pyzero doing the data parallelism (see the module docstring).

    ``PyzeroStrategy(strategy="zero2", backend=None, timeout=300.0, **options)``: ``strategy`` one
    of STRATEGIES; ``options`` pz.DataParallel ("dp") or pz.ZeroOptimizer options; ``backend`` and
    ``timeout`` start pyzero (``pz.init``; backend None: "shm" for accelerator="cpu", else pz.init's
    default) unless it is started already (then a ``backend`` other than None must be the one it
    runs). Lightning's own arguments (accelerator, parallel_devices, cluster_environment,
    checkpoint_io, precision_plugin) as for DDPStrategy.
    """

    strategy_name = "pyzero"

    def __init__(self, strategy: str = "zero2", accelerator=None, parallel_devices=None, cluster_environment=None,
                 checkpoint_io=None, precision_plugin=None, backend: str | None = None, timeout: float = 300.0,
                 **options):
        if strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {list(STRATEGIES)}, got {strategy!r}")
        self._stage = None if strategy == "dp" else int(strategy[-1])
        what = "pz.DataParallel" if self._stage is None else "pz.ZeroOptimizer"
        for k in sorted(options):
            why = _dist.option_refused(k, self._stage)
            if why is not None:
                raise ValueError(f"{k}: not a {what} option PyzeroStrategy(strategy={strategy!r}) passes on ({why})")
        why = _dist.fp16_refused(options, self._stage)
        if why is not None:
            raise ValueError(f"{why} (or return a pz.ZeroOptimizer with loss_scale= from configure_optimizers)")
        if not is_real(timeout) or not 0 < timeout <= _MAX_TIMEOUT:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout!r}")
        self.pyzero_strategy, self._options, self._backend, self._pz_timeout = strategy, dict(options), backend, timeout
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin, timeout=timedelta(seconds=timeout))
        self._forward_redirection = _ForwardRedirection()
        self._loading = None  # the ZeRO checkpoint folder load_checkpoint read, for load_model_state_dict

    # ---- precision plugin ------------------------------------------------------

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = _with_pyzero(Precision)()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin) -> None:
        if plugin is None or isinstance(plugin, _PyzeroPrecision):
            self._precision_plugin = plugin
            return
        cls = type(plugin)
        honoured = (Precision, MixedPrecision) if self._stage else (Precision, MixedPrecision, HalfPrecision,
                                                                    DoublePrecision)
        if cls not in honoured:
            raise ValueError(f"precision: PyzeroStrategy(strategy={self.pyzero_strategy!r}) supports "
                             f"{', '.join(c.__name__ for c in honoured)}, got {cls.__name__} "
                             "(Trainer(precision='32-true' or 'bf16-mixed'))")
        if self._stage and getattr(plugin, "scaler", None) is not None:
            raise ValueError("precision: '16-mixed' needs torch's GradScaler, which checks for overflow on this "
                             "rank's shard only (ranks could disagree on skipping a step); use 'bf16-mixed'")
        wrapped = copy.copy(plugin)  # the same plugin and settings, with pyzero's clipping and step
        wrapped.__class__ = _with_pyzero(cls)
        self._precision_plugin = wrapped

    # ---- processes -------------------------------------------------------------

    def setup_distributed(self) -> None:
        """pyzero first (on MASTER_PORT), then torch.distributed on pyzero's store (Lightning's own
        collectives); Lightning's ranks and pyzero's must agree."""
        reset_seed()  # (as DDPStrategy does: seed_everything's seed again in every process)
        self.set_world_ranks()
        rank, world = self.global_rank, self.world_size
        if not comm.is_initialized():
            if dist.is_initialized():
                raise RuntimeError("PyzeroStrategy: torch.distributed is already initialised (by another strategy?) "
                                   "and holds the port pyzero's store needs; call "
                                   "pyzero.integrations.lightning.init() before the first Trainer.fit")
            env = {"RANK": rank, "WORLD_SIZE": world, "LOCAL_RANK": self.local_rank,
                   "MASTER_ADDR": self.cluster_environment.main_address,
                   "MASTER_PORT": self.cluster_environment.main_port}
            os.environ.update({k: str(v) for k, v in env.items()})
            backend = self._backend
            if backend is None and self.root_device.type == "cpu":  # (accelerator="cpu" on a machine with GPUs)
                backend = "shm"
            comm.init(backend=backend, timeout=self._pz_timeout)
        else:
            _dist.check_started(self._backend, "PyzeroStrategy")
        if (comm.get_rank(), comm.get_world_size()) != (rank, world):
            raise RuntimeError(f"PyzeroStrategy: Lightning runs rank {rank} of {world}, pyzero rank "
                               f"{comm.get_rank()} of {comm.get_world_size()}; set devices= and num_nodes= to the "
                               "job's processes")
        self._process_group_backend = distributed.default_torch_backend()
        distributed.init_torch(self._process_group_backend)

    # ---- model and optimizer ---------------------------------------------------

    def setup(self, trainer) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        setattr(self.lightning_module, wrappers.INTEGRATED, "lightning")
        if fitting:
            if self._stage is None and not isinstance(self.model, DataParallel):
                self.model = DataParallel(self.model, **self._options)
            self.setup_optimizers(trainer)
            if self._stage is not None:
                self._adapt_callbacks(trainer)
        elif owner(self.lightning_module) is None:  # (a ZeroOptimizer's model is kept in step by it)
            self._sync_weights()
        self.setup_precision_plugin()

    def _adapt_callbacks(self, trainer) -> None:
        """Callbacks that read or write the weights outside forward run with the ZeroOptimizer's
        parameters whole (see _gather_weight_averaging); StochasticWeightAveraging refuses sharded
        models itself (FSDP, DeepSpeed), and so stage 3."""
        for cb in trainer.callbacks:
            if isinstance(cb, WeightAveraging):
                _gather_weight_averaging(cb, lambda: self._zero)
            elif self._stage == 3 and isinstance(cb, StochasticWeightAveraging):
                raise ValueError("callbacks: StochasticWeightAveraging does not support sharded models (it refuses "
                                 "FSDP and DeepSpeed); with PyzeroStrategy('zero3') use lightning's "
                                 "WeightAveraging (SWA, or EMAWeightAveraging), which reads the sharded weights "
                                 "through ZeroOptimizer.gathered_parameters()")

    def _sync_weights(self) -> None:
        """Rank 0's weights everywhere, as DDPStrategy does when not fitting."""
        module = self.lightning_module
        broadcast_coalesced([t.detach() for t in list(module.parameters()) + list(module.buffers())], 0,
                            comm.resolve_group(None))

    def model_to_device(self) -> None:
        if owner(self.lightning_module) is None:  # moving it would copy the parameters out of ZeRO's buffers
            super().model_to_device()

    def setup_optimizers(self, trainer) -> None:
        super().setup_optimizers(trainer)
        if self._stage is None:
            if any(isinstance(_raw(o), ZeroOptimizer) for o in self.optimizers):
                raise ValueError("strategy: 'dp' wraps the model in pz.DataParallel, but configure_optimizers "
                                 "returned a pz.ZeroOptimizer; use strategy='zero1'..'zero3'")
            return
        if len(self.optimizers) != 1:
            raise ValueError(f"configure_optimizers: ZeRO shards one optimizer over the whole model, got "
                             f"{len(self.optimizers)} optimizers")
        given = _raw(self.optimizers[0])
        zero = self._zero_from(given)
        for config in self.lr_scheduler_configs:  # the schedulers drive the ZeroOptimizer's groups
            if zero is not given and _repoint(config.scheduler, given, zero):
                _track_steps(zero)
        self.optimizers = [zero]

    def _zero_from(self, opt) -> ZeroOptimizer:
        module = self.lightning_module
        if isinstance(opt, ZeroOptimizer):
            if opt.model is not module:
                raise ValueError("configure_optimizers: the pz.ZeroOptimizer must manage the LightningModule "
                                 "itself (pz.ZeroOptimizer(self, ...))")
            if opt.stage != self._stage:
                raise ValueError(f"strategy: {self.pyzero_strategy!r}, but configure_optimizers returned a "
                                 f"ZeroOptimizer of stage {opt.stage}")
            if self._options:
                raise ValueError(f"{sorted(self._options)[0]}: configure_optimizers built the ZeroOptimizer "
                                 "itself; give it the options")
            if opt.group.size != comm.get_world_size():
                raise ValueError(f"configure_optimizers: the pz.ZeroOptimizer's group holds {opt.group.size} of the "
                                 f"job's {comm.get_world_size()} processes, but Lightning splits the data over all of "
                                 "them; build it over the whole job (group=None; tensor parallelism is not supported "
                                 "here)")
            if opt.tp_group is not None and opt.tp_group.size > 1:
                raise ValueError("configure_optimizers: the pz.ZeroOptimizer's tp_group makes it a tensor-parallel "
                                 "layout, whose ranks of a tensor-parallel group must see the same batch; Lightning "
                                 "gives every process its own, so tensor parallelism is not supported here")
            return opt
        if owner(module) is not None:
            raise ValueError("configure_optimizers: a ZeroOptimizer already manages this model; return it")
        if not isinstance(opt, torch.optim.Optimizer) or opt.state:
            raise ValueError(f"configure_optimizers: ZeRO builds its optimizer from a fresh torch.optim.Optimizer, "
                             f"got {type(opt).__name__}")
        why = whole_tensor_optimizer(type(opt))
        if why is not None:
            raise ValueError(f"configure_optimizers: {why}; return an elementwise optimizer (AdamW, Adam, SGD, "
                             "...), or use PyzeroStrategy('dp')")
        # The same class, groups and hyperparameters (lr, betas, weight_decay, ... as set in each group).
        groups = [dict(g) for g in opt.param_groups]
        return ZeroOptimizer(module, type(opt), stage=self._stage, param_groups=groups, **self._options)

    @property
    def _zero(self) -> ZeroOptimizer | None:
        return owner(self.lightning_module) if self.lightning_module is not None else None

    def optimizer_state(self, optimizer) -> dict:
        if isinstance(_raw(optimizer), ZeroOptimizer):
            return {}  # in the shards (save_checkpoint)
        return super().optimizer_state(optimizer)

    # ---- training --------------------------------------------------------------

    def _synchronize(self) -> None:
        """A ZeroOptimizer with delayed_update holds the last step's parameters back until synchronize():
        validation, test, prediction and the model after fit see the current ones, as checkpoints do."""
        zero = self._zero
        if zero is not None:
            zero.synchronize()

    def on_validation_start(self) -> None:
        self._synchronize()
        super().on_validation_start()

    def on_test_start(self) -> None:
        self._synchronize()
        super().on_test_start()

    def on_predict_start(self) -> None:
        self._synchronize()
        self._check_predict_batches()
        super().on_predict_start()

    def _check_predict_batches(self) -> None:
        """ZeRO-3's forward gathers each unit from every rank, but Lightning deals prediction data out
        unpadded: ranks given different numbers of batches would wait for each other's gathers until the
        timeout. A ValueError on every rank instead, naming the counts (unknown counts, from data without
        a length, are not checked)."""
        zero = self._zero
        if zero is None or zero.stage != 3 or zero.group.size == 1:
            return
        counts = [c if isinstance(c, int) else -1 for c in self.lightning_module.trainer.num_predict_batches]
        rows = comm.every_rank([len(counts), *counts], group=zero.group).tolist()
        if any(row[0] != rows[0][0] for row in rows):
            shown = [row[0] for row in rows]
            raise ValueError(f"predict: the ranks have different numbers of prediction dataloaders ({shown})")
        for i in range(rows[0][0]):
            got = [row[1 + i] for row in rows]
            if -1 not in got and len(set(got)) > 1:
                raise ValueError(f"predict: with PyzeroStrategy('zero3') every rank must run the same number of "
                                 f"prediction batches (each forward gathers parameters from all ranks), but "
                                 f"dataloader {i} gives the ranks {got} batches (Lightning does not pad "
                                 "prediction data); make its length a multiple of processes x batch size, or "
                                 "predict with 'zero1', 'zero2' or 'dp'")

    def on_train_end(self) -> None:
        self._synchronize()
        super().on_train_end()

    @contextlib.contextmanager
    def block_backward_sync(self):
        """Accumulation micro-steps: gradients stay local, no pyzero collective."""
        zero = self._zero
        if zero is not None:
            with zero.no_sync():
                yield
        elif isinstance(self.model, DataParallel):
            with self.model.no_sync():
                yield
        else:
            yield

    @torch.no_grad()
    def grad_norm(self, norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the current (reduced) gradients of the whole model, over every rank's shard;
        every rank calls it (e.g. in ``on_before_optimizer_step``, to log; it clips nothing)."""
        zero = self._zero
        if zero is not None:
            return zero.clip_grad_norm_(float("inf"), norm_type)  # a coefficient of 1: the gradients stay
        grads = [p.grad for p in self.lightning_module.parameters() if p.grad is not None]
        return torch.nn.utils.get_total_norm(grads, norm_type)

    def teardown(self) -> None:
        if isinstance(self.model, DataParallel):
            self.model = self.lightning_module
        super().teardown()

    # ---- checkpoints -----------------------------------------------------------

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return self._stage is not None  # the ZeroOptimizer must exist to take its shards

    @property
    def lightning_restore_optimizer(self) -> bool:
        return self._stage is None  # ZeRO: the optimizer comes back with the model (load_model_state_dict)

    def lightning_module_state_dict(self) -> dict:
        """The full fp32 weights: with ZeRO gathered on rank 0 ({} elsewhere; every rank calls it)."""
        zero = self._zero
        if zero is None:
            return super().lightning_module_state_dict()
        sd = zero.full_state_dict()
        return {} if sd is None else sd

    def save_checkpoint(self, checkpoint: dict, filepath, storage_options=None) -> None:
        zero = self._zero
        if zero is None:
            return super().save_checkpoint(checkpoint, filepath, storage_options)
        if storage_options is not None:
            raise ValueError("storage_options: not supported for ZeRO checkpoints (pz.checkpoint writes them)")
        folder = str(filepath)
        # every rank its shard; keep=1: the folder is one checkpoint, its checkpoint.pt goes with the newest step;
        # a weights-only checkpoint (ModelCheckpoint(save_weights_only=True)) has no optimizer_states: nor its shards
        pz_checkpoint.save(os.path.join(folder, CHECKPOINT_DIR), self.lightning_module, zero,
                           step=int(checkpoint.get("global_step", 0)), keep=1,
                           optimizer_state="optimizer_states" in checkpoint)
        if self.is_global_zero:
            rest = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
            self.checkpoint_io.save_checkpoint(rest, os.path.join(folder, LIGHTNING_FILE))

    def load_checkpoint(self, checkpoint_path, weights_only=None) -> dict:
        folder = str(checkpoint_path)
        if not os.path.isdir(os.path.join(folder, CHECKPOINT_DIR)):
            if self._stage is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
                raise ValueError(f"ckpt_path: {folder!r} holds no pyzero checkpoint ({CHECKPOINT_DIR}/); resuming "
                                 "with ZeRO needs a checkpoint PyzeroStrategy saved with ZeRO")
            self._loading = None
            return super().load_checkpoint(checkpoint_path, weights_only)
        self._loading = folder
        return self.checkpoint_io.load_checkpoint(os.path.join(folder, LIGHTNING_FILE), weights_only=weights_only)

    def load_model_state_dict(self, checkpoint, strict: bool = True) -> None:
        zero = self._zero
        if self._loading is None or zero is None:  # (no ZeroOptimizer: the consolidated weights)
            return super().load_model_state_dict(checkpoint, strict)
        pz_checkpoint.load(os.path.join(self._loading, CHECKPOINT_DIR), self.lightning_module, zero)


def _gather_weight_averaging(cb, zero_of) -> None:
    """Lightning's WeightAveraging (EMA, SWA) under ZeRO: its AveragedModel reads the model's weights after
    a step, swaps them with the average around validation, copies the average in at the end and loads the
    current weights of a checkpoint it saved. Each of these runs inside ZeroOptimizer.gathered_parameters()
    (stage 3's parameters are freed outside forward; what is written reaches the fp32 masters); every rank
    runs them alike. Validation runs inside one block from the swap to the swap back, so the masters come
    back exactly as they were."""
    def in_block(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            zero = zero_of()
            if zero is None:
                return fn(*args, **kwargs)
            with torch.no_grad(), zero.gathered_parameters():
                return fn(*args, **kwargs)
        run._pz_gathered = True
        return run

    avg = cb._average_model
    if avg is not None and not hasattr(avg.update_parameters, "_pz_gathered"):  # (a new one each fit)
        avg.update_parameters = in_block(avg.update_parameters)
    if hasattr(cb, "_pz_gathered"):
        return
    cb._pz_gathered = True
    for name in ("on_train_end", "on_load_checkpoint"):
        setattr(cb, name, in_block(getattr(cb, name)))
    start, end = cb.on_validation_epoch_start, cb.on_validation_epoch_end

    @functools.wraps(start)
    def on_validation_epoch_start(*args, **kwargs):
        zero = zero_of()
        if zero is not None and cb._average_model is not None:
            cb._pz_block = zero.gathered_parameters()
            cb._pz_block.__enter__()
        with torch.no_grad():
            start(*args, **kwargs)

    @functools.wraps(end)
    def on_validation_epoch_end(*args, **kwargs):
        block = cb.__dict__.pop("_pz_block", None)
        with torch.no_grad():
            end(*args, **kwargs)
        if block is not None:
            block.__exit__(None, None, None)
    cb.on_validation_epoch_start, cb.on_validation_epoch_end = on_validation_epoch_start, on_validation_epoch_end


def _repoint(scheduler, given, zero) -> bool:
    """Point `scheduler` from optimizer `given` to `zero`, and the schedulers it drives (SequentialLR's and
    ChainedScheduler's, which set the learning rate themselves: left on `given`, the ZeroOptimizer's never
    moved); whether any was `given`'s."""
    moved = False
    if getattr(scheduler, "optimizer", None) is given:
        scheduler.optimizer = zero
        moved = True
    for inner in getattr(scheduler, "_schedulers", ()) or ():
        moved = _repoint(inner, given, zero) or moved
    return moved


def _track_steps(opt) -> None:
    """What torch's LR schedulers do to the optimizer they are built with (they warn otherwise): mark
    ``opt.step`` so they can tell a step happened; here for a scheduler moved onto a ZeroOptimizer."""
    if hasattr(opt.step, "_wrapped_by_lr_sched"):
        return
    step = opt.step

    @functools.wraps(step)
    def tracked(*args, **kwargs):
        opt._opt_called = True
        return step(*args, **kwargs)

    tracked._wrapped_by_lr_sched = True
    opt.step = tracked
