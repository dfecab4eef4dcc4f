"""pyzero with Hugging Face: ``transformers.Trainer`` and ``accelerate``.

Usage (2 CPU ranks: ``python train.py`` under torchrun, or ``pyzero.launch.run_ranks``)::

    import pyzero as pz
    from pyzero.integrations import hf

    hf.init()                       # first: pyzero, then torch.distributed on pyzero's store
    args = TrainingArguments("out", use_cpu=True, max_grad_norm=1.0, bf16=True, save_steps=100)
    trainer = hf.PyzeroTrainer(model=model, args=args, train_dataset=ds, strategy="zero2")
    trainer.train()                 # resume: trainer.train(resume_from_checkpoint=True)
    trainer.save_model()            # out/pyzero (sharded) + model.safetensors (from_pretrained)

    # or your own ZeroOptimizer (stage, offload, ...):
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=1e-3)
    trainer = hf.PyzeroTrainer(model=model, args=args, train_dataset=ds, optimizers=(opt, None))

    accelerator = hf.PyzeroAccelerator(cpu=True, gradient_accumulation_steps=2)   # calls hf.init()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=1e-3)
    model, opt, loader = accelerator.prepare(model, opt, loader)
    for batch in loader:
        with accelerator.accumulate(model):          # no communication on accumulation micro-steps
            accelerator.backward(model(**batch).loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 1.0)   # ZeRO's global norm
            opt.step(); opt.zero_grad()
    accelerator.save_state("ckpt"); accelerator.load_state("ckpt")   # ckpt/pyzero: pz.checkpoint

``strategy``: "dp" (pz.DataParallel around the model, with the optimizer the Trainer builds or the
one given), "zero1" / "zero2" / "zero3" (the Trainer builds a pz.ZeroOptimizer from
TrainingArguments: the same optimizer class, hyperparameters and weight-decay groups it would
build itself; ``strategy_options`` passes ZeroOptimizer options such as offload="cpu"). Without
``strategy``: ZeRO when ``optimizers`` holds a ZeroOptimizer, else "dp". A plain model handed to
PyzeroAccelerator.prepare is wrapped in pz.DataParallel; a model whose parameters a
ZeroOptimizer manages, or a pz.DataParallel, is not wrapped (never in torch DDP).

Why these extension points: accelerate's ``Accelerator`` is where both frameworks decide data
parallelism (``prepare_model`` wraps in torch DDP), gradient accumulation (``no_sync``), clipping
(``clip_grad_norm_``, which the Trainer calls and whose result it logs as ``grad_norm``) and the
state of ``save_state``/``load_state``; the Trainer delegates all four to its accelerator. So one
Accelerator subclass (PyzeroAccelerator) changes them for plain accelerate loops and for the
Trainer alike. The Trainer subclass only adds what the Trainer does itself: it builds its
accelerator (here a PyzeroAccelerator with the same arguments), its optimizer (here a
ZeroOptimizer), and its checkpoints (``save_model``, ``_save_checkpoint``, resume), which go
through pz.checkpoint. A callback could not do these: callbacks see the optimizer only after it
is built and cannot change how the model is wrapped or how checkpoints are written.

``init()`` exists because both pyzero and torch.distributed would open a store on MASTER_PORT:
TrainingArguments (and Accelerator) call torch.distributed.init_process_group, so init() must
come before them; it starts pyzero and puts torch.distributed (gloo; for CUDA tensors NCCL, or
"pyzero" where processes share a GPU) on pyzero's store. A ZeroOptimizer or pz.DataParallel model
given to a plain Trainer or Accelerator raises at its first forward (see pyzero.wrappers).
"""
from __future__ import annotations

import contextlib
import functools
import os

import torch
import torch.distributed as dist
import transformers
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DDPCommunicationHookType, DistributedType

from .. import checkpoint, comm, distributed, wrappers
from . import _dist
from ..parallel import DataParallel
from ..zero import ZeroOptimizer, owner
from ..zero.clip import refuse_clip_by_value, zero_of_params
from ..zero.optimizer import whole_tensor_optimizer

__all__ = ["CHECKPOINT_DIR", "STRATEGIES", "PyzeroAccelerator", "PyzeroTrainer", "init"]

STRATEGIES = ("dp", "zero1", "zero2", "zero3")
CHECKPOINT_DIR = "pyzero"  # the pz.checkpoint folder inside a Trainer checkpoint or a save_state folder
SCHEDULER_NAME = "scheduler.pt"  # the Trainer's name for the LR scheduler's state


def init(backend: str | None = None, timeout: float = 300.0, torch_backend: str | None = None) -> None:
    """Start pyzero (``pz.init(backend, timeout)``, unless started: then a ``backend`` other than None
    must be the one it runs) and torch.distributed on its store.

    Call it before ``TrainingArguments(...)``, which initialises torch.distributed itself on
    MASTER_PORT, the port pyzero's store holds. ``torch_backend`` is torch's backend for
    accelerate's own collectives (gathering losses, metrics): default "gloo"; on GPUs
    "cpu:gloo,cuda:nccl" beside pyzero's nccl backend and "cpu:gloo,cuda:pyzero" beside its ipc
    backend (processes that share a GPU, which NCCL refuses). Does nothing more at world size 1.
    """
    if not comm.is_initialized():
        if dist.is_available() and dist.is_initialized():
            raise RuntimeError("init(): torch.distributed is already initialised (TrainingArguments(...) and "
                               "Accelerator(...) do that) and holds the port pyzero's store needs: call "
                               "pyzero.integrations.hf.init() before creating TrainingArguments or an Accelerator")
        comm.init(backend=backend, timeout=timeout)
    else:
        _dist.check_started(backend, "init()")
    distributed.init_torch(torch_backend)


def _options(options, stage: int | None) -> dict:
    """`options` checked for a strategy of ZeRO stage `stage` (None: pz.DataParallel)."""
    what = "pz.DataParallel" if stage is None else "ZeroOptimizer"
    if options is None:
        return {}
    if not isinstance(options, dict):
        raise TypeError(f"strategy_options: expected a dict of {what} options, got {type(options).__name__}")
    for k in options:
        if not isinstance(k, str):
            raise TypeError(f"strategy_options: {k!r} is not an option name; expected names of {what} options")
    for k in sorted(options):
        why = _dist.option_refused(k, stage)
        if why is not None:
            raise ValueError(f"strategy_options: {k!r} is not a {what} option the integration passes on ({why})")
    why = _dist.fp16_refused(options, stage)
    if why is not None:
        raise ValueError(f"strategy_options: {why}")
    return dict(options)


class PyzeroAccelerator(Accelerator):
    """accelerate's Accelerator with pyzero doing the data parallelism (see the module docstring).

    Takes Accelerator's arguments, plus ``dp_options`` for the pz.DataParallel that wraps plain
    models. Starts pyzero and torch.distributed first (``init()``). Differences from Accelerator:
    ``prepare`` never wraps in torch DDP; ``clip_grad_norm_`` of a ZeroOptimizer's parameters is
    its global norm over all shards; ``no_sync``/``accumulate`` use ZeroOptimizer.no_sync;
    ``save_state``/``load_state`` keep ZeroOptimizers and their models in pz.checkpoint folders
    (CHECKPOINT_DIR, then CHECKPOINT_DIR_1, ...); ``get_state_dict`` of a ZeroOptimizer's model is
    its full fp32 state on the main process (None elsewhere; every process calls it).
    """

    def __init__(self, *args, dp_options=None, **kwargs):
        self._dp_options = _options(dp_options, None)
        init()
        super().__init__(*args, **kwargs)
        world = comm.get_world_size()
        if self.num_processes != world:
            raise ValueError(f"accelerate runs {self.num_processes} process(es) but pyzero's job has {world} ranks: "
                             "accelerate did not see the distributed job (on CPU ranks pass cpu=True to the "
                             "Accelerator, use_cpu=True to TrainingArguments)")
        if self.distributed_type not in (DistributedType.NO, DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            raise ValueError(f"distributed_type: pyzero does the data parallelism; {self.distributed_type} cannot "
                             "be combined with it (drop the DeepSpeed/FSDP/... configuration)")
        if self.parallelism_config is not None:
            raise ValueError("parallelism_config: pyzero does the data parallelism; drop the ParallelismConfig")
        self._check_ddp_handler()

    def _check_ddp_handler(self) -> None:
        """Refuse the torch DDP settings that would change the training (there is no torch DDP here): its
        buckets, buffer broadcasts and communication hook. (find_unused_parameters, which the Trainer sets
        for its models, and DDP's other switches change nothing pyzero does.)"""
        handler = self.ddp_handler
        if handler is None:
            return
        use = {"bucket_cap_mb": "bucket_mb", "broadcast_buffers": "broadcast_buffers"}
        given = {k: v for k, v in handler.to_kwargs().items() if k in use}
        if handler.comm_hook != DDPCommunicationHookType.NO:
            given["comm_hook"] = handler.comm_hook
            use["comm_hook"] = "comm_dtype"
        if given:
            name = sorted(given)[0]
            raise ValueError(f"kwargs_handlers: DistributedDataParallelKwargs({name}={given[name]!r}) configures torch "
                             f"DDP, which pyzero replaces; pass the pz.DataParallel option {use[name]!r} in "
                             "dp_options= (PyzeroTrainer: strategy_options=, instead of TrainingArguments' ddp_*)")

    # ---- preparing -----------------------------------------------------------

    def prepare_model(self, model, device_placement=None, evaluation_mode=False):
        if getattr(model, "_is_accelerate_prepared", False):
            return super().prepare_model(model, device_placement, evaluation_mode)
        zero = owner(model)
        if zero is not None:
            self._check_zero(zero)
        wrap = (zero is None and not isinstance(model, DataParallel) and not evaluation_mode
                and self.distributed_type != DistributedType.NO and any(p.requires_grad for p in model.parameters()))
        if zero is not None or isinstance(model, DataParallel):
            # already where its group works; moving it (even .to("cpu:0")) would copy the parameters out of
            # the buffers pyzero keeps them in
            device_placement = False
        # Accelerate's own preparation (mixed precision autocast, device placement) without its DDP
        model = super().prepare_model(model, device_placement, evaluation_mode=True)
        setattr(model, wrappers.INTEGRATED, "hf")
        if wrap:  # pyzero's DataParallel where accelerate would have used DDP
            model = DataParallel(model, **self._dp_options)
            self._models[-1] = model
            model._is_accelerate_prepared = True
            setattr(model, wrappers.INTEGRATED, "hf")
        return model

    def prepare_optimizer(self, optimizer, device_placement=None):
        zero = _unwrap_optimizer(optimizer)
        stage = getattr(self, "_pz_trainer_stage", None)  # (set by PyzeroTrainer under a ZeRO strategy)
        if stage is not None and not isinstance(zero, ZeroOptimizer):
            raise ValueError(f"create_optimizer: strategy='zero{stage}' trains through the pz.ZeroOptimizer "
                             f"PyzeroTrainer.create_optimizer builds, but the Trainer holds a {type(zero).__name__} "
                             "(an override?), which would train without ZeRO; build a pz.ZeroOptimizer there, or "
                             "pass one as optimizers=(opt, scheduler)")
        if isinstance(zero, ZeroOptimizer):
            self._check_zero(zero)
            device_placement = False  # its shards live where its group works; a state_dict round trip only copies
        return super().prepare_optimizer(optimizer, device_placement)

    def _check_zero(self, opt: ZeroOptimizer) -> None:
        if opt.group.size != self.num_processes:
            raise ValueError(f"optimizer: its group has {opt.group.size} ranks, but accelerate splits the data over "
                             f"{self.num_processes} processes; build the ZeroOptimizer over the whole job (group=None)")
        if self.mixed_precision == "fp16":
            raise ValueError("mixed_precision: 'fp16' needs accelerate's GradScaler, which checks for overflow on "
                             "this rank's shard only (ranks could disagree on skipping a step); use 'bf16'")
        if opt.scaler is not None:
            raise ValueError("optimizer: loss_scale= needs backward on opt.scale_loss(loss), which accelerate's "
                             "backward does not call; use bf16 mixed precision")
        if opt.tp_group is not None and opt.tp_group.size > 1:
            raise ValueError("optimizer: its tp_group makes it a tensor-parallel layout, whose ranks of a "
                             "tensor-parallel group must see the same batch; accelerate gives every process its "
                             "own, so tensor parallelism is not supported here")

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, DataParallel):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    # ---- training --------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self, model):
        zero = owner(self.unwrap_model(model))
        with (zero.no_sync() if zero is not None else super().no_sync(model)):
            yield

    def clip_grad_norm_(self, parameters, max_norm, norm_type=2):
        params = list(parameters)
        zero = zero_of_params(params, "clip_grad_norm_")
        if zero is None:
            return super().clip_grad_norm_(params, max_norm, norm_type)
        return zero.clip_grad_norm_(max_norm, norm_type)

    def clip_grad_value_(self, parameters, clip_value):
        params = list(parameters)
        refuse_clip_by_value(params, "clip_grad_value_")
        return super().clip_grad_value_(params, clip_value)

    # ---- state -----------------------------------------------------------------

    def get_state_dict(self, model, unwrap=True):
        zero = owner(self.unwrap_model(model))
        if zero is None:
            return super().get_state_dict(model, unwrap)
        return zero.full_state_dict()

    def _zero_optimizers(self) -> list[ZeroOptimizer]:
        return [o for o in map(_unwrap_optimizer, self._optimizers) if isinstance(o, ZeroOptimizer)]

    @contextlib.contextmanager
    def _without(self, zeros):
        """accelerate's save_state/load_state without the ZeroOptimizers and their models (saved apart)."""
        models, optimizers = self._models, self._optimizers
        self._models = [m for m in models if owner(self.unwrap_model(m)) not in zeros]
        self._optimizers = [o for o in optimizers if _unwrap_optimizer(o) not in zeros]
        try:
            yield
        finally:
            self._models, self._optimizers = models, optimizers

    def save_state(self, output_dir=None, safe_serialization=True, **save_model_func_kwargs):
        """accelerate's save_state; each ZeroOptimizer and its model in a pz.checkpoint folder inside
        (every rank writes its own shard; pz.checkpoint.consolidate gives the full weights)."""
        zeros = self._zero_optimizers()
        with self._without(zeros):
            location = super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)
        for i, opt in enumerate(zeros):
            checkpoint.save(os.path.join(location, _zero_dir(i)), opt.model, opt, step=0)
        return location

    def load_state(self, input_dir=None, load_kwargs=None, **load_model_func_kwargs):
        if input_dir is None and self.project_configuration.automatic_checkpoint_naming:
            folder = os.path.join(self.project_dir, "checkpoints")  # the newest, as accelerate picks it
            input_dir = max((os.path.join(folder, f) for f in os.listdir(folder)),
                            key=lambda f: int(f.rsplit("_", 1)[-1]))
        zeros = self._zero_optimizers()
        with self._without(zeros):
            super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)
        for i, opt in enumerate(zeros):
            checkpoint.load(os.path.join(input_dir, _zero_dir(i)), opt.model, opt)


def _unwrap_optimizer(optimizer):
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _zero_dir(i: int) -> str:
    return CHECKPOINT_DIR if i == 0 else f"{CHECKPOINT_DIR}_{i}"


class PyzeroTrainer(transformers.Trainer):
    """transformers.Trainer with pyzero's data parallelism: ``PyzeroTrainer(..., strategy="zero2")``.

    Takes the Trainer's arguments plus ``strategy`` (STRATEGIES; see the module docstring) and
    ``strategy_options`` (pz.ZeroOptimizer or pz.DataParallel options). Its accelerator is a
    PyzeroAccelerator. With ZeRO, ``save_model(dir)`` writes the sharded checkpoint to
    dir/CHECKPOINT_DIR (every rank its shard) and, from the main process, the consolidated fp32
    weights as ``save_pretrained`` does; a Trainer checkpoint holds that, the LR scheduler, RNG
    states and trainer state, and resuming loads it with pz.checkpoint.load (any world size or
    stage). With "dp" checkpoints are the Trainer's own (every rank holds the same state).
    With ZeRO every rank calls save_model (as the Trainer's own checkpoints do): it is collective,
    and called on one rank only it fails with a pyzero collective error instead of saving.
    """

    def __init__(self, *args, strategy: str | None = None, strategy_options: dict | None = None, **kwargs):
        if strategy is not None and strategy not in STRATEGIES:
            raise ValueError(f"strategy: expected one of {list(STRATEGIES)} or None, got {strategy!r}")
        if strategy is None and strategy_options is not None:
            raise ValueError("strategy_options: they configure the strategy; name it too (strategy='zero2', ...)")
        self._pz_strategy = strategy
        self._pz_strategy_stage = None if strategy in (None, "dp") else int(strategy[-1])  # (what strategy names)
        self._pz_options = _options(strategy_options, self._pz_strategy_stage)
        super().__init__(*args, **kwargs)
        self._check_timeout()
        self._pz_stage = self._settle_strategy()

    def _check_timeout(self) -> None:
        """TrainingArguments' ddp_timeout would start torch.distributed, which init() started before them with
        pyzero's timeout: one set to something else would go unused."""
        default = transformers.TrainingArguments.__dataclass_fields__["ddp_timeout"].default
        timeout = self.args.ddp_timeout
        if timeout != default and timeout != comm.get_timeout():
            raise ValueError(f"ddp_timeout: {timeout!r} s, but pyzero and torch.distributed (started by "
                             f"pyzero.integrations.hf.init) wait {comm.get_timeout():g} s; pass the timeout to "
                             f"init(timeout={timeout!r}) before creating TrainingArguments")

    def _settle_strategy(self) -> int | None:
        """The ZeRO stage in use (None: "dp"), checked against the model and optimizer given."""
        strategy, opt = self._pz_strategy, self.optimizer
        if self.args.fp16 and (isinstance(opt, ZeroOptimizer) or strategy not in (None, "dp")):
            raise ValueError("fp16: ZeRO with the Trainer supports bf16 mixed precision (bf16=True), not fp16 (its "
                             "GradScaler checks for overflow on one rank's shard only)")
        if isinstance(self.model, DataParallel):
            raise ValueError("model: pass the module itself; PyzeroTrainer wraps it in pz.DataParallel (strategy="
                             "'dp') and saves it without the wrapper")
        zero = isinstance(opt, ZeroOptimizer) or strategy not in (None, "dp")
        for flag in ("bf16_full_eval", "fp16_full_eval"):
            if zero and getattr(self.args, flag, False):
                raise ValueError(f"{flag}: the Trainer casts the model for evaluation (model.to(dtype)), which takes "
                                 "the parameters out of the ZeroOptimizer's buffers; leave it off (bf16=True "
                                 "evaluates under autocast)")
        if isinstance(opt, ZeroOptimizer):
            if opt.model is not self.model:
                raise ValueError("optimizers: the ZeroOptimizer manages another model than model=")
            if strategy not in (None, f"zero{opt.stage}"):
                raise ValueError(f"strategy: {strategy!r}, but optimizers holds a ZeroOptimizer of stage {opt.stage}")
            if self._pz_options:
                raise ValueError("strategy_options: they configure the ZeroOptimizer the Trainer builds; optimizers= "
                                 "already holds one (give it the options)")
            return opt.stage
        if owner(self.model) is not None:
            raise ValueError("model: a ZeroOptimizer manages its parameters; pass it as optimizers=(opt, None)")
        if strategy in (None, "dp"):
            return None
        if opt is not None:
            raise ValueError(f"optimizers: strategy={strategy!r} builds a pz.ZeroOptimizer from TrainingArguments; "
                             "pass no optimizer (optimizer_cls_and_kwargs= picks its class), or a pz.ZeroOptimizer "
                             "built on the model (optimizers=(opt, scheduler))")
        return self._pz_strategy_stage

    def _zero(self) -> ZeroOptimizer | None:
        return owner(self.model)

    def _synchronize(self) -> None:
        """A ZeroOptimizer with delayed_update holds the last step's parameters back until synchronize():
        evaluation, prediction and the model after train() see the current ones, as the checkpoints do."""
        zero = self._zero()
        if zero is not None:
            zero.synchronize()

    def train(self, *args, **kwargs):
        out = super().train(*args, **kwargs)
        self._synchronize()
        return out

    def evaluation_loop(self, *args, **kwargs):
        self._synchronize()
        return super().evaluation_loop(*args, **kwargs)

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None, **gen_kwargs):
        """Mixed with Seq2SeqTrainer (``class T(PyzeroTrainer, Seq2SeqTrainer)``, predict_with_generate):
        a ZeRO stage-3 model generates with synced_gpus=True unless told otherwise (ranks that stop early
        keep running forwards, whose gathers the others need), as transformers does under DeepSpeed
        ZeRO-3 and FSDP, which it recognises and pyzero it does not."""
        zero = self._zero()
        if (isinstance(self, transformers.Seq2SeqTrainer) and zero is not None and zero.stage == 3
                and zero.world > 1):
            if not gen_kwargs:  # (what Seq2SeqTrainer.prediction_step takes then: evaluate's/predict's)
                gen_kwargs = dict(getattr(self, "_gen_kwargs", None) or {})
            gen_kwargs.setdefault("synced_gpus", True)
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys, **gen_kwargs)

    def _move_model_to_device(self, model, device) -> None:
        if owner(model) is None:  # (a ZeroOptimizer's model is in place: see PyzeroAccelerator.prepare_model)
            super()._move_model_to_device(model, device)

    # ---- accelerator and optimizer ---------------------------------------------

    def _build_accelerator_args(self, **kwargs):
        self._pz_accelerator_args = super()._build_accelerator_args(**kwargs)
        return self._pz_accelerator_args

    def create_accelerator_and_postprocess(self) -> None:
        super().create_accelerator_and_postprocess()
        if self.is_deepspeed_enabled or self.is_fsdp_enabled:
            raise ValueError("deepspeed/fsdp: pyzero does the data parallelism and sharding; unset them in "
                             "TrainingArguments")
        # The same accelerator with pyzero's data parallelism (see PyzeroAccelerator).
        dp_options = self._pz_options if self._pz_strategy == "dp" else None
        self.accelerator = PyzeroAccelerator(**self._pz_accelerator_args, dp_options=dp_options)
        self.accelerator._pz_trainer_stage = self._pz_strategy_stage
        gather = self.gather_function  # (the Trainer's gather_for_metrics, maybe with arguments bound)
        self.gather_function = (functools.partial(self.accelerator.gather_for_metrics, *gather.args, **gather.keywords)
                                if isinstance(gather, functools.partial) else self.accelerator.gather_for_metrics)

    def create_optimizer(self, model=None):
        if self._pz_stage is None or self.optimizer is not None:
            return super().create_optimizer(model)
        opt_model = self.model if model is None else model
        # What the Trainer would build: its optimizer class and settings, weight decay but on biases and norms.
        decay = set(self.get_decay_parameter_names(opt_model))
        named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in named if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in named if n not in decay], "weight_decay": 0.0}]
        given = self.optimizer_cls_and_kwargs is not None
        what = "optimizer_cls_and_kwargs" if given else f"optim: {getattr(self.args.optim, 'value', self.args.optim)!r}"
        cls, kwargs = self.optimizer_cls_and_kwargs if given else self.get_optimizer_cls_and_kwargs(self.args,
                                                                                                     opt_model)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or \
                {"params", "model", "optimizer_dict"} & set(kwargs):
            raise ValueError(f"{what} does not build a plain torch.optim.Optimizer, which ZeroOptimizer needs "
                             "(e.g. optim='adamw_torch')")
        why = whole_tensor_optimizer(cls)
        if why is not None:
            raise ValueError(f"{what}: {why}; use an elementwise optimizer (optim='adamw_torch', 'sgd', "
                             "'adagrad', 'rmsprop', ...) or strategy='dp'")
        if self.lr_scheduler is not None and not getattr(self, "_created_lr_scheduler", False):
            raise ValueError("optimizers: the scheduler given in optimizers=(None, scheduler) steps another optimizer "
                             "than the pz.ZeroOptimizer the Trainer builds, so the learning rate would never move; "
                             "build the ZeroOptimizer on the model and pass optimizers=(opt, scheduler), or let the "
                             "Trainer build both (lr_scheduler_type=...)")
        self.optimizer = ZeroOptimizer(opt_model, cls, stage=self._pz_stage,
                                       param_groups=[g for g in groups if g["params"]],
                                       **self._pz_options, **kwargs)
        return self.optimizer

    # ---- checkpoints -----------------------------------------------------------

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        zero = self._zero()
        if zero is None:
            return super().save_model(output_dir, _internal_call)
        output_dir = self.args.output_dir if output_dir is None else output_dir
        sharded = os.path.join(output_dir, CHECKPOINT_DIR)
        # every rank, its shard (a checkpoint under save_only_model: the weights, not the optimizer's moments)
        checkpoint.save(sharded, self.model, zero, self.state.global_step,
                        optimizer_state=not (_internal_call and self.args.save_only_model))
        if self.args.should_save:  # read back from disk: no gathering, fp32 masters, any stage
            self._save(output_dir, state_dict=checkpoint.consolidate(sharded))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if self._zero() is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        # The optimizer state is in the sharded checkpoint save_model wrote just before.
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _sharded(self, folder: str, what: str) -> str:
        path = os.path.join(folder, CHECKPOINT_DIR)
        if not os.path.isdir(path):
            raise ValueError(f"{what}: {folder!r} holds no pyzero checkpoint ({CHECKPOINT_DIR}/); it was not saved "
                             "by PyzeroTrainer with ZeRO")
        return path

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        if self._pz_stage is None:
            if os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
                # (the Trainer would load model.safetensors and, finding no optimizer.pt, skip the optimizer
                # state and the LR scheduler: a resume that silently restarts both)
                raise ValueError(f"resume_from_checkpoint: {resume_from_checkpoint!r} was saved with ZeRO (its "
                                 f"optimizer state is in {CHECKPOINT_DIR}/); resume it with strategy='zero1', "
                                 "'zero2' or 'zero3' (any stage loads it)")
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        # The weights come with the optimizer state, once the optimizer exists (_load_optimizer_and_scheduler).
        self._sharded(resume_from_checkpoint, "resume_from_checkpoint")

    def _load_optimizer_and_scheduler(self, checkpoint_dir: str | None) -> None:
        zero = self._zero()
        if checkpoint_dir is None or zero is None:
            return super()._load_optimizer_and_scheduler(checkpoint_dir)
        checkpoint.load(self._sharded(checkpoint_dir, "resume_from_checkpoint"), self.model, zero)
        scheduler = os.path.join(checkpoint_dir, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        zero = self._zero()
        if zero is None:
            return super()._load_best_model()
        checkpoint.load(self._sharded(self.state.best_model_checkpoint, "best_model_checkpoint"), self.model, zero)
