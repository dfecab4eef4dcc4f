"""ZeRO stage 3: parameters sharded too, gathered module by module.

A *unit* is a module that owns trainable parameters directly. Each unit has
its own flat layout, padded to the world size; a rank keeps only its shard.
The unit's full buffer is allocated just in time and its storage released
after use (``untyped_storage().resize_(0)``, as FSDP does), so the model's
parameters, and whatever autograd saved of them, stay valid views.

  forward:  pre-hook  gather unit i (usually already prefetched), prefetch unit i+1
            (``prefetch``: the next n units; 0: none)
            post-hook free unit i; hook its outputs so backward re-gathers it
  backward: output-grad hook  gather unit i, prefetch the unit that ran before it
            all its gradients accumulated  -> reduce-scatter them (async), free unit i
  end of backward: units with unused parameters reduce-scatter zeros, in order

ZeRO++ (zeropp.py) changes how a unit is gathered (hpZ, qwZ: GatherPlan) and how its
gradients are reduced (qgZ: QuantizedReduceScatter); the schedule above stays the same.

[Note: leaf modules] A module's forward may read a descendant's parameters without calling
the descendant (nn.MultiheadAttention reads out_proj.weight; nn.TransformerEncoderLayer's
inference fast path reads every weight of the layer). Such a module is a *leaf*: its hooks
gather the units of its whole subtree and its descendants get none (DeepSpeed's "z3 leaf
modules"). DEFAULT_LEAF_MODULES are leaves always, ``leaf_modules=`` adds classes. A read the
hooks do not cover would compute with the NaN stubs of a freed unit: the forwards before the
first step run under _FreedReads, which raises naming the parameter.

Every rank issues the same gathers and reduce-scatters in the same order as
long as the model runs the same code path everywhere; a rank that does not
usually calls a collective of another size and gets pz.CollectiveError.

[Note: stage 3 on a GPU: streams and freeing]
A unit's full buffer is (re)allocated on the compute stream (resize_ of its
storage). Its gather is issued async_op: on a GPU backend it runs on the
group's own stream after an event of the compute stream, so prefetches
overlap the compute queued before them; gather(wait=True) makes the compute
stream wait for it (a stream wait, the host never blocks). free() first waits
for a gather still in flight the same way, then returns the storage to the
caching allocator, which hands that block only to later work on the compute
stream, ordered after every kernel that read the parameters. The
communication stream never touches the buffer after the compute stream
waited for it, so no record_stream is needed (it would keep blocks alive
until the communication stream's next sync point). The gradients' staging
buffer of a reduce-scatter is kept by its Work until the work completed.
"""
from __future__ import annotations

import dataclasses
import functools
import warnings
import weakref

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from .. import comm, memtrace
from ..bucketing import OrderedLaunch
from .optimizer import (CollectiveCall, ModelHook, ShardedParametersWarning, ZeroOptimizer, _nbytes, eager_hook,
                        register_stage, replaced_error)
from .partition import FlatLayout
from .zeropp import GatherPlan, QuantizedReduceScatter, check_options, check_values
from ..checks import is_int

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback

# Modules whose forward reads parameters of their descendants directly (see [Note: leaf modules]).
DEFAULT_LEAF_MODULES = (nn.MultiheadAttention, nn.TransformerEncoderLayer, nn.TransformerDecoderLayer)


class _Gathered:
    """Bytes of full parameters allocated right now, and the most ever at once (memory_stats)."""

    def __init__(self):
        self.now = self.peak = 0

    def add(self, n):
        self.now += n
        self.peak = max(self.peak, self.now)


class _Call:
    """One module call during a training forward: its backward's progress (see post_backward)."""

    def __init__(self, inputs_left: int):
        self.inputs_left, self.entered = inputs_left, False


class _Unit:
    """One module's parameters: its shard, its (sometimes freed) full buffer and its gradient shard."""

    def __init__(self, idx, params, names, world, rank, model_dtype, gathered: _Gathered, device, to_host=None,
                 host_params=False, grad_buffer=None, alias=False):
        self.idx, self.tracker = idx, gathered
        self.alias = alias  # the full parameters are the shard itself (see ZeroStage3._setup)
        self.layout = FlatLayout(params, names, world)
        off, n = self.layout.shard(rank)
        fp32 = torch.zeros(self.layout.padded, dtype=torch.float32, device=device)
        for v, p in zip(self.layout.views(fp32), params):
            v.copy_(p.detach())
        if to_host is None:
            self.master = fp32[off:off + n].clone()
            self.shard = self.master if model_dtype == torch.float32 else self.master.to(model_dtype)
        else:  # offload of a CUDA model: host masters (and shards), see [Note: offload of a CUDA model]
            self.master = to_host(fp32[off:off + n])
            if not host_params:
                self.shard = fp32[off:off + n].to(model_dtype, copy=True)
            elif model_dtype == torch.float32:
                self.shard = self.master
            else:
                self.shard = to_host(fp32[off:off + n].to(model_dtype))
        self.full = self.shard if alias else fp32.to(model_dtype)
        self.views = self.layout.views(self.full)  # share full's storage, also across free/gather
        # What a freed parameter holds: its shape, every element one NaN (stride 0).
        # (a 0-dim element expands to any shape, 0-dim parameters included)
        self.stubs = [] if alias else [torch.full((), float("nan"), dtype=model_dtype, device=device).expand(v.shape)
                                       for v in self.views]
        for v, p in zip(self.views, params):
            p.data = v
        self.nbytes = self.full.untyped_storage().nbytes()
        # (offload of a CUDA model: in host memory, see [Note: offload of a CUDA model])
        self.grad_shard = (grad_buffer(n) if grad_buffer is not None
                           else torch.empty(n, dtype=torch.float32, device=device))
        self.gather_work = None
        self.secondary = None  # hpZ: this rank's slice of the full parameters within its partition
        self.secondary_valid = False  # holds the current parameters (since the last primary gather)
        self.gathered = True  # full holds the initial values until the first free
        self.freed_versions: list[int] = []  # the parameters' versions when freed (see free)
        self.pending_update = None  # offload: host values the device shard takes at its next gather
        if not alias:
            gathered.add(self.nbytes)
        self.pending = len(params)
        self.hold = 0  # opt.gathered_parameters() blocks holding it gathered

    def gather_input(self) -> torch.Tensor:
        """The shard as a gather reads it: on the device (offload_params: a copy of the host shard,
        which changes only in step(), once the device is idle: see ZeroOptimizer._host_step).
        Offload without offload_params: the device shard first takes the step's values from the
        host, here rather than in step(), so the copy overlaps the forward of the units before."""
        if self.pending_update is not None:
            # (the host values change again only in the next step, after the device is done with
            # this copy: step() waits for the gradient copies queued after it)
            self.shard.copy_(self.pending_update, non_blocking=True)
            self.pending_update = None
        if self.shard.device == self.full.device:
            return self.shard
        return self.shard.to(self.full.device, non_blocking=True)

    def free(self):
        if self.alias or self.hold:
            return  # the shard: never released; held by opt.gathered_parameters(): at its end
        if self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None
        if self.gathered:
            # While freed the parameters keep their shapes but read as NaN (writes to them
            # raise): outside forward/backward nothing reads memory that is gone.
            for p, stub in zip(self.layout.params, self.stubs):
                p.data = stub
            # a write into a freed parameter (fill_, zero_, nn.init, a 1-element clamp_: the stub takes
            # what torch's overlap check lets through) bumps its version: refused at the next gather
            self.freed_versions = [p._version for p in self.layout.params]
            self.full.untyped_storage().resize_(0)
            self.gathered = False
            self.tracker.add(-self.nbytes)

    def check_unwritten(self) -> None:
        """Raise if a freed parameter was written in place (its version moved since free())."""
        if self.gathered:
            return
        written = [n for n, p, v in zip(self.layout.names, self.layout.params, self.freed_versions)
                   if p._version != v]
        if written:
            raise RuntimeError(
                f"parameters {written[:5]}{' ...' if len(written) > 5 else ''}: written in place while freed "
                "(ZeRO stage 3 frees them outside forward and backward: the write reached a placeholder and "
                "would be lost); write them inside `with torch.no_grad(), opt.gathered_parameters("
                "modifier_rank=0):`")

    def gather(self, plan: GatherPlan, wait=True, backward=False):
        if not self.gathered:
            # (a pointer compare each: the freed parameters still hold their stubs)
            replaced = [n for n, p, stub in zip(self.layout.names, self.layout.params, self.stubs)
                        if p.data_ptr() != stub.data_ptr()]
            if replaced:
                raise replaced_error(replaced)
            self.check_unwritten()
            with memtrace.region("pyzero.gather"):
                self.full.untyped_storage().resize_(self.nbytes)
            self.tracker.add(self.nbytes)
            self.gather_work = plan.start(self, backward)
            for v, p in zip(self.views, self.layout.params):
                p.data = v
            self.gathered = True
        if wait and self.gather_work is not None:
            self.gather_work.wait()
            self.gather_work = None


@register_stage(3)
class ZeroStage3(ZeroOptimizer):
    """Parameters, gradients and optimizer state all sharded.

    ZeRO++ options (named as DeepSpeed's; see zeropp.py): ``zero_hpz_partition_size`` (ranks
    per host, 1 = off), ``zero_quantized_weights`` (int8 gathers), ``zero_quantized_gradients``
    (True/8: int8, 4: int4 gradient reduce-scatter). Each works alone or with the others.
    ``prefetch``: units gathered ahead of the one computing, in forward (the next ones) and
    backward (the ones before); 1 by default, as FSDP2; 0 gathers each unit when it is needed.
    A unit is freed right after its forward (resharded, as FSDP2 by default) and after its
    gradients are reduced in backward."""

    def __init__(self, model, optimizer_class, stage=3, *args, zero_hpz_partition_size=1,
                 zero_quantized_weights=False, zero_quantized_gradients=False, prefetch=1, leaf_modules=(),
                 **kwargs):
        if not is_int(prefetch) or prefetch < 0:
            raise ValueError(f"prefetch: expected an int >= 0 (units gathered ahead of the one computing; "
                             f"0: none), got {prefetch!r}")
        self.prefetch = prefetch
        leaf_modules = tuple(leaf_modules) if isinstance(leaf_modules, (list, tuple, set, frozenset)) else None
        if leaf_modules is None or not all(isinstance(c, type) and issubclass(c, nn.Module) for c in leaf_modules):
            raise TypeError("leaf_modules: expected a list of nn.Module classes (modules whose forward reads their "
                            "descendants' parameters: each gathers its whole subtree at its forward)")
        self.leaf_modules = DEFAULT_LEAF_MODULES + tuple(c for c in leaf_modules if c not in DEFAULT_LEAF_MODULES)
        self._zeropp = (zero_hpz_partition_size, zero_quantized_weights, zero_quantized_gradients)
        check_values(*self._zeropp)  # (before the model is touched; what they need of the group: _check_group)
        super().__init__(model, optimizer_class, stage, *args, **kwargs)

    def _check_group(self):
        self._zeropp = check_options(*self._zeropp, self.group)

    def _setup(self):
        hpz, qw, qg_bits = self._zeropp
        self.zeropp = {"hpz_partition_size": hpz, "quantized_weights": qw, "quantized_gradient_bits": qg_bits}
        self._plan = GatherPlan(self.group, hpz, qw)
        self._qg = QuantizedReduceScatter(self.group, qg_bits) if qg_bits else None
        model_dtype = self.param_dtype or self.params[0].dtype
        owner = {}
        self.units: list[_Unit] = []
        self._gathered = _Gathered()
        names = dict(zip(map(id, self.params), self.names))
        # [Note: stage 3 at one rank] A group of one rank holds every parameter in its shard: a
        # unit's full parameters are the shard itself (gathered once, never freed; the step's
        # update of the shard is the model's), so nothing is held twice. Not with host copies
        # (the shard is in host memory, or takes the step's values at a gather) nor qwZ (a
        # gather's quantisation is part of the result).
        alias = self.world == 1 and not self._host and not qw
        for m in self.model.modules():
            own = [p for p in m.parameters(recurse=False) if id(p) in names and id(p) not in owner]
            if own:
                u = _Unit(len(self.units), own, [names[id(p)] for p in own], self.world, self.rank, model_dtype,
                          self._gathered, self.device, self._to_host if self._host else None,
                          self.offload.offload_params, self._grad_buffer, alias)
                u.secondary = self._plan.secondary(u.layout.padded, model_dtype, self.device)
                for p in own:
                    owner[id(p)] = u
                self.units.append(u)
        self._unit_of, self._name_of = owner, names
        # See [Note: stage 3 under torch.compile]: the plain configuration is traced.
        self._traceable = (not self._host and hpz == 1 and not qw and not qg_bits
                           and model_dtype == self.comm_dtype)
        if self._traceable:
            for u in self.units:
                u.leaf = u.shard.detach().requires_grad_()  # shares the shard's storage (and its updates)
                u.leaf.register_post_accumulate_grad_hook(eager_hook(self._make_on_shard_grad(u)))
        def slots_of(d):  # (module, name, parameter) of d's own trainable parameter slots
            return [(d, name, p) for name, p in d._parameters.items() if p is not None and id(p) in owner]

        inside_leaf = set()  # descendants of a leaf module: its hooks gather for them (see [Note: leaf modules])
        for m in self.model.modules():
            own = slots_of(m)
            if own:
                m.register_load_state_dict_pre_hook(ModelHook(self._make_load_hook(
                    sorted({owner[id(p)].idx for *_, p in own}), [name for _, name, _ in own])))
            if id(m) in inside_leaf:
                continue
            slots = own
            if isinstance(m, self.leaf_modules):
                below = list(m.modules())[1:]
                inside_leaf.update(map(id, below))
                slots = own + [slot for d in below for slot in slots_of(d)]
            needs = sorted({owner[id(p)].idx for *_, p in slots})
            if needs:
                swaps = []  # (module, name, unit, offset, shape, numel) of each parameter slot gathered here
                for d, name, p in slots:
                    u = owner[id(p)]
                    k = [id(q) for q in u.layout.params].index(id(p))
                    swaps.append((d, name, u.idx, u.layout.offsets[k], tuple(p.shape), p.numel()))
                leaf = len(slots) > len(own)
                m.register_forward_pre_hook(ModelHook(self._make_pre_forward(needs, swaps),
                                                      functools.partial(_CopiedWhileFreed, leaf)))
                m.register_forward_hook(ModelHook(self._make_post_forward(needs, slots)))
        # see _FreedReads: the model's forward, or its direct children's where a training step calls them
        # itself (a LightningModule's training_step), until the first step(); with freed units (world > 1)
        self._probe = self._probe_opener = None
        self._forward_versions: dict = {}  # id(module) -> [(unit, its parameters' versions)] per forward open
        self._probes_left = _FreedReads.MAX_PROBED if self.world > 1 else 0
        if self._probes_left:
            for m in [self.model, *self.model.children()]:
                _add_probe_hooks(self, m)
        state_dict_hook = self._make_state_dict_hook()
        for m in self.model.modules():  # (a state_dict() of the model or of any module in it)
            m.register_state_dict_post_hook(ModelHook(state_dict_hook, _copied_state_dict_hook))
        for p in self.params:
            p.register_post_accumulate_grad_hook(ModelHook(eager_hook(self._on_grad)))
        self._order: list[int] = []  # units in the order the last forward used them
        # Reduce-scatters launch in reverse unit order (modules are registered in roughly the order
        # forward uses them), the same on every rank whatever order the hooks fire in.
        self._launch_order = OrderedLaunch([len(u.layout.params) for u in reversed(self.units)],
                                           lambda b: self._reduce_unit(self.units[-1 - b]), self._discard)
        self._start_backward()
        for u in self.units:
            u.free()
        self._gathered.peak = 0  # set-up held every unit once; training holds a few at a time

    def shards(self):
        return [(u.layout, u.master, u.grad_shard) for u in self.units]

    def _hold(self, params):
        held = []
        for u in sorted({self._unit_of[id(p)] for p in params}, key=lambda u: u.idx):
            held.append((u, u.gathered))
            u.hold += 1
            u.gather(self._plan)
        return held

    def _release(self, held):
        for u, was_gathered in held:
            u.hold -= 1
            if not was_gathered:
                u.free()

    def _own_slices(self, held):
        out = []
        for u, _ in held:
            off, n = u.layout.shard(self.rank)
            out.append((u.idx, u.full[off:off + n]))
        return out

    def _synced_values(self, held, params):
        return [u.full for u, _ in held]

    def _check_home(self, every=False):
        """A gather points the parameters at the unit's buffer again, so a conversion after set-up
        (``model.to(torch.bfloat16)``, ``model.half()``, a move to another device) would be undone at
        the next forward, the model computing in the dtype it had: refused. One compare per forward;
        with ``every`` (step) also an in-place write into a freed parameter."""
        if every:  # (at step: a write into a freed parameter is refused before it is lost)
            self._check_unwritten()
        u = self.units[0]
        p, home = u.layout.params[0], u.full
        if p.dtype != home.dtype or p.device != home.device:
            raise RuntimeError(f"model: its parameters were converted after the ZeroOptimizer was built (now {p.dtype} "
                               f"on {p.device}; stage 3 gathers them as {home.dtype} on {home.device}, undoing it): "
                               "convert the model first, then build the ZeroOptimizer (for 16-bit parameters with "
                               "fp32 master weights, param_dtype=)")

    def _check_unwritten(self):
        for unit in self.units:
            unit.check_unwritten()

    def _reduced_dtype(self):
        return None if self._zeropp[2] else self.comm_dtype  # (quantised gradients: not the reduced values)

    def _set_grad_shard(self, k, t):
        self.units[k].grad_shard = t

    def comm_plan(self):
        """Forward gathers every unit, backward gathers it again and reduce-scatters its gradients.
        (The plain stage 3 collectives: with ZeRO++ options a step moves fewer bytes, see zeropp.py.)"""
        gather = [[CollectiveCall("all_gather", u.layout.padded, None)] for u in self.units]
        reduce = [[CollectiveCall("reduce_scatter", u.layout.padded, None)] for u in self.units]
        return gather + [phase for pair in zip(gather[::-1], reduce[::-1]) for phase in pair]

    def _held_params(self):
        if self._host:  # the device's shards only (see _host_param_shards)
            on_device = [] if self.offload.offload_params else [u.shard for u in self.units]
            return _nbytes(on_device) + self._secondary_bytes()
        shards = [u.shard for u in self.units if u.shard.data_ptr() != u.master.data_ptr()]
        return (_nbytes(shards) + _nbytes(u.master for u in self.units if u.shard.data_ptr() == u.master.data_ptr())
                + self._secondary_bytes())

    def _param_tensors(self):
        return [u.shard for u in self.units] + [u.secondary for u in self.units if u.secondary is not None]

    def _gathered_tensors(self):
        return [u.full for u in self.units if u.gathered and not u.alias]

    def _low_buffer(self, k, master, dtype):
        u = self.units[k]  # offload_params: the 16-bit host shard is the copy the step writes
        if self.offload.offload_params and u.shard.dtype == dtype and u.shard.data_ptr() != master.data_ptr():
            return u.shard
        return super()._low_buffer(k, master, dtype)

    def _host_param_shards(self):
        return [u.shard for u in self.units] if self._host and self.offload.offload_params else []

    def _secondary_bytes(self):
        return _nbytes(u.secondary for u in self.units if u.secondary is not None)

    def memory_stats(self) -> dict:
        """As ZeroOptimizer's; `params` includes hpZ's secondary shards, also reported alone as
        `hpz_secondary`."""
        out = super().memory_stats()
        out["peak_gathered_params"] = self._gathered.peak  # during the last training step
        out["hpz_secondary"] = self._secondary_bytes()
        return out

    # ---- forward --------------------------------------------------------------

    # [Note: stage 3 under torch.compile]
    # Dynamo cannot trace the eager hooks (they swap parameter storage and call the transport).
    # In a compiled region, a module's pre-forward hook instead gathers each unit it needs as
    # one graph operation (torch.ops.pyzero.all_gather_into_tensor of the unit's shard, held as
    # a leaf `u.leaf` that shares the shard's storage) and points the module's parameter slots
    # at views of the result; its forward hook puts the parameters back. The gather's backward
    # is the reduce-scatter (sum) of the unit's gradient: the leaf's gradient, divided by the
    # group size, is added to the gradient shard (_make_on_shard_grad). AOTAutograd keeps what
    # backward needs of the gathered tensors, so parameters are not freed between forward and
    # backward, and every parameter of a gathered unit gets a gradient (zeros where unused).
    # Configurations this does not cover (offload, ZeRO++, param_dtype other than the
    # communication dtype) run the eager hooks at a graph break instead.

    def _make_on_shard_grad(self, u):
        n = u.grad_shard.numel()
        marks = [self._param_index[id(p)] for p in u.layout.params]

        def on_shard_grad(leaf):
            grad, leaf.grad = leaf.grad, None
            self._grads_ready = True
            self._add_grad(u.idx, 0, n, grad.div_(self.world))
            self._has_grad[marks] = 1
        return on_shard_grad

    def _make_pre_forward(self, needs, swaps):
        # What the traced hook reads, bound here: dynamo reads no attribute of an optimizer
        # (torch.optim.Optimizer) as a constant.
        traceable, world, group_name = self._traceable, self.world, self.group.name
        leaves = {i: self.units[i].leaf for _, _, i, _, _, _ in swaps} if traceable else {}

        def pre_forward(module, args):
            if torch.compiler.is_compiling():
                if traceable:
                    return _traced_gather(module, swaps, leaves, world, group_name)
                return at_graph_break(module, args)
            return eager(module, args)

        def eager(module, args):
            if torch.is_grad_enabled() and not self._order_open:
                self._order_open, self._order = True, []
                self._gathered.peak = self._gathered.now  # memory_stats reports the last step's peak
            for i in needs:
                self.units[i].gather(self._plan)
                if self._order_open and (not self._order or self._order[-1] != i):
                    self._order.append(i)
            for nxt in self._next_units(needs[-1], +1):
                self.units[nxt].gather(self._plan, wait=False)  # prefetch
            # (see post_forward: an in-place write to a gathered copy would be lost)
            self._forward_versions.setdefault(id(module), []).append(
                [(u, [p._version for p in u.layout.params]) for u in (self.units[i] for i in needs) if not u.alias])

        at_graph_break = torch.compiler.disable(eager)
        return pre_forward

    def _make_state_dict_hook(self):
        def hook(module, state_dict, prefix, local_metadata):
            """After module.state_dict(): a warning, once per call (at the module it was called on), if it
            holds freed parameters (NaN)."""
            if prefix == "" and any(not self._unit_of[id(p)].gathered for p in module.parameters()
                                    if id(p) in self._unit_of):
                warnings.warn("model.state_dict() of a ZeRO stage-3 model on more than one rank: its sharded "
                              "parameters are freed outside forward and backward and read as NaN here; take "
                              "their values from opt.full_state_dict() (first rank) or pz.checkpoint.save, or "
                              "read them inside `with torch.no_grad(), opt.gathered_parameters():`",
                              ShardedParametersWarning, stacklevel=2)
        return hook

    def _make_load_hook(self, needs, names):
        def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs):
            if not any(not self.units[i].gathered for i in needs):
                return
            keys = [prefix + n for n in names if prefix + n in state_dict]
            if keys:
                raise RuntimeError(
                    f"model.load_state_dict: {keys[:3]}{' ...' if len(keys) > 3 else ''} are ZeRO stage-3 parameters "
                    f"sharded over {self.world} ranks (freed outside forward and backward), which loading cannot "
                    "write; load into the model before building the ZeroOptimizer, inside `with torch.no_grad(), "
                    "opt.gathered_parameters(modifier_rank=0):` (every rank takes rank 0's values), or restore a "
                    "pz.checkpoint with pz.checkpoint.load")
        return hook

    def _make_post_forward(self, needs, slots):
        traceable = self._traceable

        def post_forward(module, args, output):
            if torch.compiler.is_compiling():
                if traceable:
                    for d, name, p in slots:  # the parameters again (see _traced_gather)
                        d._parameters[name] = p
                    return None
                return at_graph_break(module, args, output)
            return eager(module, args, output)

        def eager(module, args, output):
            stack = self._forward_versions.get(id(module))
            for u, versions in (stack.pop() if stack else ()):
                changed = [n for n, p, v in zip(u.layout.names, u.layout.params, versions) if p._version != v]
                if changed:
                    raise RuntimeError(
                        f"parameters {changed}: changed in place during their module's forward (e.g. "
                        "nn.Embedding(max_norm=...) renormalising the rows it looks up); ZeRO stage 3 runs the "
                        "forward on a gathered copy, freed after it, so the change would be lost (and each rank "
                        "would change its own); change them outside forward, inside "
                        "`with torch.no_grad(), opt.gathered_parameters():`")
            keep = False
            if torch.is_grad_enabled():
                # (a leaf input, e.g. made requires_grad_() for an adversarial step or a Parameter handed to a
                # submodule, is not watched: autograd accumulates its gradient as soon as it is ready, before
                # nodes of this call that saved the parameters have run; the call keeps its units to the end
                # of backward, as one without inputs that need gradients does)
                inputs = [t for t in _tensors(args) if t.requires_grad and t.grad_fn is not None]
                call = _Call(len(inputs))
                outputs = [t for t in _tensors(output) if t.requires_grad]
                for t in outputs:
                    _on_grad_ready(t, 1, self._make_pre_backward(needs, call))
                for t in inputs:
                    _on_grad_ready(t, 0, self._make_post_backward(needs, call))
                if not outputs and any(p.requires_grad for i in needs for p in self.units[i].layout.params):
                    # [Note: outputs stage 3 cannot see] No output tensor backward could flow through was found
                    # (a result in an object that is no tensor, list, tuple, dict or dataclass, or handed out
                    # another way): no pre-backward hook gathers the units for this call's backward, so they
                    # stay gathered, and in use, until the end of backward (_start_backward resets users).
                    keep = True
                    for i in needs:
                        self.units[i].users += 1
                if self._in_backward:
                    # A forward during backward (non-reentrant checkpointing recomputes): the units a running
                    # backward node has gathered (users > 0) stay; its post-backward frees them.
                    keep = keep or any(self.units[i].users > 0 for i in needs)
            if keep:
                return
            for i in needs:
                self.units[i].free()

        at_graph_break = torch.compiler.disable(eager)
        return post_forward

    def _open_probe(self, module):
        """The model (or a direct child) starts its forward: unless a probe runs, it runs under one until
        it returns (see _FreedReads); the first MAX_PROBED such forwards before the first step()."""
        if self._probes_left and self._probe is None:
            self._probe, self._probe_opener = _FreedReads(self), module
            self._probe.__enter__()
            self._probes_left -= 1

    def _close_probe(self, module):
        if self._probe is not None and module is self._probe_opener:
            probe, self._probe, self._probe_opener = self._probe, None, None
            probe.__exit__(None, None, None)

    def _freed_read(self, p):
        """A parameter of a freed unit was an operand in forward: free every unit (each rank finds the
        same read in the same forward) and raise, naming it."""
        for u in self.units:
            u.free()
        name = self._name_of[id(p)]
        owner_name = name.rpartition(".")[0]
        parent = owner_name.rpartition(".")[0]
        parent_cls = type(self.model.get_submodule(parent)).__name__
        raise RuntimeError(
            f"ZeRO stage 3: parameter {name!r} was read while freed: an operation outside the forward of its "
            f"module {owner_name or '(the model)'!r} used it (as nn.MultiheadAttention reads out_proj.weight, or a "
            "forward that reads another module's weight, e.g. a tied embedding, without calling that module), "
            "where stage 3 has not gathered it and it reads as NaN. Gather it with the module whose forward reads "
            f"it: ZeroOptimizer(..., leaf_modules=[...]) with that module's class (here perhaps {parent_cls}, "
            f"module {parent or '(the model)'!r}) gathers the module's whole subtree at its forward; or call the "
            "module instead of reading its parameter")

    def _next_units(self, i, step):
        """The `prefetch` units used after (step=+1) or before (-1) unit i in the last recorded
        forward, nearest first."""
        try:
            k = self._order.index(i)
        except ValueError:
            return []
        out = []
        for j in range(1, self.prefetch + 1):
            if 0 <= k + j * step < len(self._order):
                out.append(self._order[k + j * step])
        return out

    # ---- backward -------------------------------------------------------------

    def _make_pre_backward(self, needs, call):
        def pre_backward(grad):
            if torch.is_grad_enabled():  # (the engine runs a create_graph backward in grad mode)
                self._discard()
                for u in self.units:
                    u.free()
                raise RuntimeError(
                    "backward with create_graph=True (torch.autograd.grad(..., create_graph=True), as a gradient "
                    "penalty or a Hessian-vector product computes) through a ZeRO stage 3 model: stage 3 frees each "
                    "module's gathered parameters once its backward is done, and the graph of those gradients "
                    "would read them later; use stage 1 or 2, which support it")
            self._enter_backward()
            late = [self.units[i] for i in needs if self.units[i].reduced]
            if late:  # its gradients are complete and sent: this backward should not need it again
                self._discard()
                raise RuntimeError(
                    f"parameters {late[0].layout.names}: needed by backward after their gradients were complete "
                    "and reduced; a module run inside a reentrant checkpoint and again outside it is not "
                    "supported by ZeRO stage 3 (use torch.utils.checkpoint with use_reentrant=False)")
            if not call.entered:
                call.entered = True
                for i in needs:
                    self.units[i].users += 1
            for i in needs:
                if self.units[i].pending > 0:
                    self.units[i].gather(self._plan, backward=True)
            for prev in self._next_units(needs[0], -1):
                if self.units[prev].pending > 0:
                    self.units[prev].gather(self._plan, wait=False, backward=True)
        return pre_backward

    def _make_post_backward(self, needs, call):
        """[Note: freeing between uses] Once every input gradient of a module call exists, that
        call's backward no longer reads the parameters, so a unit still waiting for gradients
        from another use (a tied weight) is freed until that use's pre-backward gathers it again.
        A call without inputs that need gradients (or whose only such inputs are leaves) never
        releases its units: its backward might still read them (conservative)."""
        def post_backward(grad):
            call.inputs_left -= 1
            if call.inputs_left == 0 and call.entered:
                for i in needs:
                    u = self.units[i]
                    u.users -= 1
                    if u.users == 0 and u.pending > 0:
                        u.free()
        return post_backward

    def _enter_backward(self):
        """A pre-backward hook, or a gradient's (no pre-backward runs where every call's outputs were out of
        sight: [Note: outputs stage 3 cannot see]): the forward's order is complete, and the end of this
        backward is queued once."""
        self._order_open = False
        if not self._in_backward:
            self._in_backward = True
            _queue_callback(self._end_backward)

    def _on_grad(self, p):
        self._enter_backward()
        self._grads_ready = True
        self._unreduced = not self._sync
        u = self._unit_of[id(p)]
        u.pending -= 1
        if self._sync:
            self._launch_order.ready(len(self.units) - 1 - u.idx, id(p), self._name_of[id(p)])

    def _reduce_unit(self, u):
        u.reduced = True
        direct = self._direct_grad(u.idx) if self._qg is None else None
        if direct is not None:  # one rank: see [Note: one rank writes gradients straight into their segments]
            for v, p in zip(u.layout.views(direct), u.layout.params):
                if p.grad is not None:
                    v.copy_(p.grad)
                    p.grad = None
            u.free()
            return
        with memtrace.region("pyzero.bucket"):
            staging = torch.zeros(u.layout.padded, dtype=self.comm_dtype, device=self.device)
        for v, p in zip(u.layout.views(staging), u.layout.params):
            if p.grad is not None:
                v.copy_(p.grad)
                p.grad = None
        if self._qg is not None:  # synchronous: two quantised all-to-alls (zeropp.py)
            self._add_grad(u.idx, 0, u.grad_shard.numel(), self._qg(staging, u.layout.shard_size))
            u.free()
            return
        # straight into the unit's gradient shard when it holds no values yet (see [Note: gradient
        # segments hold storage only while they hold values]), else through a buffer added on arrival
        target = self._grad_target(u.idx, self.comm_dtype)
        if target is not None:
            out = target
        else:
            with memtrace.region("pyzero.bucket"):
                out = torch.empty(u.layout.shard_size, dtype=self.comm_dtype, device=self.device)
        work = comm.reduce_scatter(out, staging, op="avg", group=self.group, async_op=True)
        del staging  # the Work keeps it alive until it is waited on

        def arrived():
            self._add_grad(u.idx, 0, u.grad_shard.numel(), out)
        self._inflight.add(work, None if target is not None else arrived)
        u.free()

    def _start_backward(self):
        self._launch_order.reset()
        self._in_backward = False
        # (a recompute that stops early, as non-reentrant checkpointing's does, leaves its pre-forward's entry)
        self._forward_versions.clear()
        self._order_open = False
        for u in self.units:
            u.pending = len(u.layout.params)
            u.users = 0  # module calls whose backward may still read the unit
            u.reduced = False  # its reduce-scatter was launched in this backward

    def _end_backward(self):
        if self._sync:
            self._launch_order.finish()  # units with unused parameters: what there is (zeros)
            self._end_of_backward()
        for u in self.units:
            u.free()
        self._start_backward()

    def _reduce_gradients(self):
        unprobed = self._probes_left == _FreedReads.MAX_PROBED  # (no eager forward before the first step)
        self._drain()  # only waits: every unit was launched during backward
        if unprobed and self.scaler is None and self._traceable:
            self._check_compiled_reads()
        self._probes_left = 0  # the first step: the forwards before it were probed

    def _check_compiled_reads(self):
        """The first step after compiled forwards only: a compiled forward cannot check for reads of freed
        parameters (_FreedReads runs eagerly), which read NaN; NaN in the gradients then raises on every
        rank, naming the likely cause, instead of training on."""
        bad = any(bool(torch.isnan(u.grad_shard).any()) for u in self.units)
        if int(comm.every_rank([int(bad)], group=self.group).max()):
            raise RuntimeError(
                "ZeRO stage 3: the first step's gradients hold NaN after compiled forwards, where stage 3 cannot "
                "check for reads of freed parameters: an operation outside the forward of a parameter's module "
                "(a forward that reads another module's weight, e.g. a tied embedding, or nn.MultiheadAttention's "
                "out_proj.weight) reads NaN there. Run the first forward eagerly to have such a read named, and "
                "gather that module with the one whose forward reads it: ZeroOptimizer(..., leaf_modules=[...]); "
                "if the NaN is the model's own, look at its loss")

    def _publish_parameters(self):
        for u in self.units:
            # A unit still gathered now (prefetched and never used, or gathered by a forward that stopped
            # early) holds the values before this step, which its next forward would use as they are:
            # freed, it is gathered afresh from the updated shards.
            if u.gathered and not u.hold:
                u.free()
            u.secondary_valid = False  # hpZ: the next forward's gathers refresh it
            src = self._publish_source(u.idx, u.master)
            if u.shard.data_ptr() == src.data_ptr():
                continue
            if self._host and not self.offload.offload_params:
                u.pending_update = src  # copied at the unit's next gather (see _Unit.gather_input)
            else:
                u.shard.copy_(src)


def _traced_gather(module, swaps, leaves, world, group_name):
    """A compiled region's pre-forward hook: the parameter slots of `module` (and, a leaf module, of
    its descendants) become views of their units, gathered by one graph operation each (see
    [Note: stage 3 under torch.compile])."""
    from .. import ops  # noqa: PLC0415  (registered on first use: see pyzero.ops)
    full = {}
    for d, name, i, off, shape, numel in swaps:
        if i not in full:
            full[i] = ops.all_gather_into_tensor(leaves[i], world, group_name)
        d._parameters[name] = full[i][off:off + numel].view(shape)


def _add_probe_hooks(opt, module):
    """Forward hooks of `module` that open and close opt's probe (eager only: under torch.compile they
    return before reading anything); they hold the optimizer weakly."""
    ref = weakref.ref(opt)

    def pre(module, args):
        if not torch.compiler.is_compiling():
            opt = ref()
            if opt is not None:
                opt._open_probe(module)

    def post(module, args, output):
        if not torch.compiler.is_compiling():
            opt = ref()
            if opt is not None:
                opt._close_probe(module)

    module.register_forward_pre_hook(ModelHook(pre))
    module.register_forward_hook(ModelHook(post), always_call=True)


_COPIED_WHILE_FREED = ("a copy of a ZeRO stage-3 model made while its parameters were freed (copy.deepcopy, or "
                       "torch.save of the module, outside forward and backward) holds NaN in their place")
_MAKE_THE_COPY = ("make the copy inside `with torch.no_grad(), opt.gathered_parameters():` (or before building the "
                  "ZeroOptimizer)")


def _freed_copy(tensors) -> str | None:
    """The name of the first of (name, tensor) pairs that is all NaN, as a parameter copied from a freed
    unit's stub is."""
    return next((n for n, t in tensors if t.is_floating_point() and t.numel() and bool(torch.isnan(t).all())), None)


class _CopiedWhileFreed:
    """The pre-forward hook of a module of a deep copy of the model: at its first forward, its parameters
    (a leaf module's whole subtree's) must not be the NaN of freed units."""

    def __init__(self, leaf: bool):
        self.leaf, self.checked = leaf, False

    def __call__(self, module, args):
        if self.checked:
            return
        name = _freed_copy(module.named_parameters(recurse=self.leaf))
        if name is not None:
            raise RuntimeError(f"{type(module).__name__} parameter {name!r}: {_COPIED_WHILE_FREED}; "
                               f"{_MAKE_THE_COPY}")
        self.checked = True


def _copied_state_dict_hook():
    return _copied_state_dict


def _copied_state_dict(module, state_dict, prefix, local_metadata):
    """The state_dict post-hook of a module of a deep copy of the model: a warning if it holds the NaN of
    freed units."""
    if prefix == "":
        name = _freed_copy(state_dict.items())
        if name is not None:
            warnings.warn(f"state_dict() of {type(module).__name__}: {name!r} and maybe more are NaN: "
                          f"{_COPIED_WHILE_FREED}; {_MAKE_THE_COPY}", ShardedParametersWarning, stacklevel=2)


class _FreedReads(TorchFunctionMode):
    """Raises (ZeroStage3._freed_read) when a torch operation takes a parameter whose unit is freed.
    Attribute access (``.data``, which gather and free set, ``.shape``, ``.grad``, ...) and questions
    about the tensor rather than its values (size, storage, ...) are not operations. It runs during
    the forwards before the first step (at most MAX_PROBED of them: a model only evaluated), each
    torch call of the forward passing through it, then never again."""

    MAX_PROBED = 16

    _ACCESS = frozenset(("__get__", "__set__", "__delete__", "size", "dim", "stride", "numel", "nelement",
                         "storage_offset", "element_size", "is_contiguous", "is_floating_point", "is_complex",
                         "data_ptr", "untyped_storage", "storage", "get_device", "__len__", "__repr__",
                         "__format__", "__hash__", "__reduce_ex__", "__deepcopy__"))

    def __init__(self, opt):
        super().__init__()
        self.unit_of, self.opt = opt._unit_of, opt
        # a view of a freed parameter (``w.T``, ``w.mT``, ``w.data``: attribute reads, not operations) shares
        # its stub's storage: the operation taking the view is caught by that storage
        self.stub_of = {stub.untyped_storage().data_ptr(): p for u in opt.units
                        for p, stub in zip(u.layout.params, u.stubs)}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) not in self._ACCESS:
            for a in (*args, *kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else (a,)):
                    if isinstance(t, nn.Parameter):
                        u = self.unit_of.get(id(t))
                        if u is not None and not u.gathered:
                            self.opt._freed_read(t)
                    elif isinstance(t, torch.Tensor) and t.layout is torch.strided and self.stub_of:
                        p = self.stub_of.get(t.untyped_storage().data_ptr())
                        if p is not None and not self.unit_of[id(p)].gathered:
                            self.opt._freed_read(p)
        return func(*args, **kwargs)


def _on_grad_ready(t, order, fn):
    """Run fn(grad) when t's gradient is ready. One hook per tensor runs the order-0 callbacks
    (releases: a consumer's backward is done) before the order-1 ones (gathers and prefetches for
    the producer's backward), so memory is freed before more is allocated."""
    lists = getattr(t, "_pz_grad_callbacks", None)
    if lists is None:
        lists = t._pz_grad_callbacks = ([], [])

        def run(grad):
            for fns in lists:
                for f in fns:
                    f(grad)
        t.register_hook(run)
    lists[order].append(fn)


def _tensors(x):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name, None))

