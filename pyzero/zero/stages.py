"""ZeRO stages 1 and 2: full parameters on every rank, sharded optimizer state.

Both lay the trainable parameters end to end in *reverse* registration order
(the order backward produces their gradients), so a bucket is a contiguous
range of the flat buffer and its reduce-scatter counts are just its overlap
with each rank's shard (partition.FlatLayout.counts).

Stage 1 leaves the full gradients in the parameters' own .grad (as backward
allocates them, without ZeRO too) and at step time copies them into staging
buffers and reduce-scatters them, bucket by bucket, dropping each .grad once
its bucket holds it. Stage 2 keeps only the gradient shard: a post-accumulate
hook copies each gradient into its bucket's staging buffer and drops it; a full
bucket is reduce-scattered asynchronously while backward goes on, in bucket
order on every rank (bucketing.OrderedLaunch, see [Note: bucket launch order]).
Both reduce into the shard's per-bucket segments, which hold memory only while
they hold values (see [Note: gradient segments hold storage only while they
hold values] in optimizer.py).
"""
from __future__ import annotations

import bisect

import torch

from .. import comm, memtrace
from .. import optim as pz_optim
from ..bucketing import OrderedLaunch, flat_buckets
from . import optimizer as zero_optimizer
from .optimizer import CollectiveCall, ModelHook, ZeroOptimizer, _nbytes, eager_hook, register_stage, replaced_error
from .partition import FlatLayout

_queue_callback = torch.autograd.Variable._execution_engine.queue_callback


class _FlatParams(ZeroOptimizer):
    """Stages 1-2: one flat buffer holds every full parameter (model dtype)."""

    def _take_grads(self, into: torch.Tensor, begin: int, members) -> None:
        """Each member parameter's .grad into its place in `into` (a bucket's range, from flat offset
        `begin`), then released."""
        for i in members:
            p = self.layout.params[i]
            if p.grad is not None:
                off = self.layout.offsets[i] - begin
                into[off:off + p.numel()].copy_(p.grad.reshape(-1))
                p.grad = None

    def _setup_flat(self):
        self.layout = FlatLayout(self.params[::-1], self.names[::-1], self.world)
        L, (shard_off, shard_n) = self.layout, self.layout.shard(self.rank)
        self._shard = slice(shard_off, shard_off + shard_n)
        model_dtype = self.param_dtype or self.params[0].dtype
        # The fp32 values of every parameter, once: with offload of a CUDA model built in host
        # memory, so the device never holds 4 bytes per parameter (the 16-bit model's buffer only)
        fp32 = torch.zeros(L.padded, dtype=torch.float32, device="cpu" if self._host else self.device)
        for v, p in zip(L.views(fp32), L.params):
            v.copy_(p.detach())
        self.flat_param = fp32.to(device=self.device, dtype=model_dtype)  # (itself: fp32 where it was built)
        # The master shard aliases the model's own shard when both are fp32 (with offload of a CUDA
        # model it is a host copy: see [Note: offload of a CUDA model]).
        if self._host:
            self.master = self._to_host(fp32[self._shard])
        else:
            self.master = fp32[self._shard] if model_dtype == torch.float32 else fp32[self._shard].clone()
        for v, p in zip(L.views(self.flat_param), L.params):
            p.data = v
        # (name, parameter, where its values live) of each non-empty parameter: see _check_home
        self._homes = [(name, p, p.data_ptr()) for name, p in zip(L.names, L.params) if p.numel()]
        self.buckets = flat_buckets(L, self.bucket_elems)
        # Device path: the gradient shard as one segment per bucket, its part of the shard (see
        # [Note: gradient segments hold storage only while they hold values]); with host copies
        # one host shard (_grad_buffer), its ranges fed by _HostGrads.
        self._parts = [self._my_part(b, e) for b, e, _ in self.buckets]
        self._part_starts = [a for a, _ in self._parts]
        self.grad_shard = self._grad_buffer(self.layout.shard_size) if self._host else None
        self._sent_pieces = 0  # pieces the chunked host step sent to the device (see _stepped)
        for p in self.params:
            p.register_post_accumulate_grad_hook(ModelHook(eager_hook(self._on_grad)))

    def _check_home(self, every=False):
        """The model computes with its parameters, the step writes the flat buffer: once something
        replaced a parameter's storage (``model.to("cpu:0")`` copies even CPU tensors, ``p.data = t``
        replaces one) the two part ways and training silently stops updating the model. One pointer
        compare per forward; every parameter's at step() (``every``)."""
        if self._homes and self._homes[0][1].data_ptr() != self._homes[0][2]:
            raise RuntimeError("model: its parameters no longer live in the ZeroOptimizer's flat buffer (something "
                               "replaced their storage after the optimizer was built, e.g. model.to(device) with a "
                               "device index, which copies even CPU tensors); move the model first, then build the "
                               "ZeroOptimizer")
        if every:
            moved = [name for name, p, ptr in self._homes if p.data_ptr() != ptr]
            if moved:
                raise replaced_error(moved)

    def _my_part(self, begin, end):
        """This rank's part of the flat range [begin, end), relative to its shard start."""
        lo, hi = max(begin, self._shard.start), min(end, self._shard.stop)
        return lo - self._shard.start, max(lo, hi) - self._shard.start

    def _step_chunks(self):
        """With host copies, chunks of at least _STEP_CHUNK_ELEMS elements (whole pieces): each
        goes to the device as the next one steps (see [Note: chunked host step]). Not with NVMe
        state, whose own sub-groups pipeline the step with the disk."""
        if not self._host or isinstance(self.inner, pz_optim.NvmeAdam):
            return super()._step_chunks()
        limit = zero_optimizer._STEP_CHUNK_ELEMS
        chunks, a, n = [], 0, 0
        for i, (pc, _, _) in enumerate(self.pieces):
            n += pc.numel
            if n >= limit:
                chunks.append((a, i + 1))
                a, n = i + 1, 0
        if a < len(self.pieces) or not chunks:
            chunks.append((a, len(self.pieces)))
        return chunks

    def _stepped(self, a, b):
        if a == b:
            return
        shard_off = self._shard.start
        lo = self.pieces[a][0].offset - shard_off
        hi = self.pieces[b - 1][0].offset + self.pieces[b - 1][0].numel - shard_off
        self._to_device.copy(self.flat_param[self._shard][lo:hi], self._publish_source(0, self.master)[lo:hi])
        self._sent_pieces += b - a

    def _publish_parameters(self):
        sent, self._sent_pieces = self._sent_pieces, 0
        self._to_device.join()
        # (when the chunked host step sent every piece there is nothing left: the padding stays zero)
        if sent != len(self.pieces) and self.master.data_ptr() != self.flat_param[self._shard].data_ptr():
            self.flat_param[self._shard].copy_(self._publish_source(0, self.master))
        comm.all_gather(self.flat_param, self.flat_param[self._shard], group=self.group)

    def shards(self):
        return [(self.layout, self.master, self.grad_shard)]

    def _own_slices(self, held):
        return [(0, self.flat_param[self._shard])]

    def _synced_values(self, held, params):
        return [self.flat_param] if len(params) == len(self.params) else [p.data for p in params]

    def _pipeline_slots(self):
        return [(0, lo, hi) for lo, hi in self._parts]  # a bucket's part of the shard each

    def _set_grad_shard(self, k, t):
        self.grad_shard = t

    def _grad_segments(self):
        if self._host:
            return [self.grad_shard]
        return [torch.empty(hi - lo, dtype=torch.float32, device=self.device) for lo, hi in self._parts]

    def _grad_view(self, k, lo, n):
        if self._host:
            return super()._grad_view(k, lo, n)
        # a piece lies in one parameter, and buckets end on parameter boundaries: in one bucket,
        # the last whose part starts at or before lo and is not empty
        b = bisect.bisect_right(self._part_starts, lo) - 1
        while self._parts[b][1] <= lo:
            b -= 1
        a = self._parts[b][0]
        return self._shard_grads[b][lo - a:lo - a + n]

    def _launch_reduce(self, b: int, staging: torch.Tensor) -> None:
        """Reduce-scatter bucket b from `staging` (async) into this rank's part of the gradient
        shard: straight into its segment when that holds no values yet, else through a buffer
        added once it arrived."""
        begin, end, _ = self.buckets[b]
        counts = self.layout.counts(begin, end)
        lo, hi = self._parts[b]
        target = self._grad_target(b, staging.dtype)
        if target is not None:
            out = target
        else:
            with memtrace.region("pyzero.bucket"):
                out = torch.empty(counts[self.rank], dtype=staging.dtype, device=self.device)
        work = comm.reduce_scatter(out, staging, op="avg", counts=counts, group=self.group, async_op=True)
        if target is not None:
            self._inflight.add(work)
        elif self._host:
            self._inflight.add(work, lambda: self._add_grad(0, lo, hi, out))
        else:
            self._inflight.add(work, lambda: self._add_grad(b, 0, hi - lo, out))

    def comm_plan(self):
        L = self.layout
        return [[CollectiveCall("reduce_scatter", e - b, L.counts(b, e)) for b, e, _ in self.buckets],
                [CollectiveCall("all_gather", L.padded, None)]]

    def _held_params(self):
        return _nbytes([self.flat_param])

    def _param_tensors(self):
        return [self.flat_param]


@register_stage(1)
class ZeroStage1(_FlatParams):
    """Optimizer state sharded; full gradients (torch's own .grad, allocated by backward as
    without ZeRO) reduce-scattered bucket by bucket at step time, each parameter's .grad freed
    once its bucket holds it: full gradients and the shard are never held whole at once."""

    def _setup(self):
        self._setup_flat()
        self._reduced = False

    def _reduced_dtype(self):
        return self.param_dtype or self.params[0].dtype  # (the buckets reduce in the model's dtype)

    def _held_grads(self):
        return super()._held_grads() + _nbytes(p.grad for p in self.params if p.grad is not None)

    def _on_grad(self, p):
        self._grads_ready, self._reduced = True, False

    def _reduce_gradients(self):
        if self._reduced:
            return
        for b, (begin, end, members) in enumerate(self.buckets):
            direct = self._direct_grad(b)  # one rank: see [Note: one rank writes gradients straight ...]
            if direct is not None:
                self._take_grads(direct, begin, members)
                continue
            with memtrace.region("pyzero.bucket"):
                staging = torch.zeros(end - begin, dtype=self.flat_param.dtype, device=self.device)
            self._take_grads(staging, begin, members)
            self._launch_reduce(b, staging)  # (the Work keeps staging alive until it is waited on)
        self._drain()
        self._end_of_backward()
        self._reduced = True


@register_stage(2)
class ZeroStage2(_FlatParams):
    """Gradients sharded too: bucketed reduce-scatter during backward."""

    def _setup(self):
        self._setup_flat()
        self._bucket_of = {}
        for b, (_, _, members) in enumerate(self.buckets):
            for i in members:
                self._bucket_of[id(self.layout.params[i])] = b
        self._index = {id(p): i for i, p in enumerate(self.layout.params)}
        self._launch_order = OrderedLaunch([len(m) for _, _, m in self.buckets], self._launch, self._discard)
        self._start_backward()

    def _start_backward(self):
        self._staging = [None] * len(self.buckets)
        self._launch_order.reset()

    def _bucket_tensors(self):
        return [t for t in self._staging if t is not None]

    def _stage(self, b):
        if self._staging[b] is None:
            begin, end, _ = self.buckets[b]
            with memtrace.region("pyzero.bucket"):
                self._staging[b] = torch.zeros(end - begin, dtype=self.comm_dtype, device=self.device)
        return self._staging[b]

    def _on_grad(self, p):
        self._grads_ready = True
        self._unreduced = not self._sync
        if not self._sync:
            return  # no_sync: p.grad keeps accumulating locally
        if self._launch_order.begin():
            _queue_callback(self._end_backward)
        b, i = self._bucket_of[id(p)], self._index[id(p)]
        if self._can_direct(b):
            # one rank: p.grad stays until its bucket is complete, then goes straight into the
            # bucket's gradient segment (see [Note: one rank writes gradients straight into their
            # segments]): the segment is not allocated while backward still allocates for the bucket
            self._launch_order.ready(b, i, self.layout.names[i])
            return
        begin = self.buckets[b][0]
        off = self.layout.offsets[i] - begin
        self._stage(b)[off:off + p.numel()].copy_(p.grad.reshape(-1))
        p.grad = None
        self._launch_order.ready(b, i, self.layout.names[i])

    def _launch(self, b):
        # called by self._launch_order, see [Note: bucket launch order]
        begin, _, members = self.buckets[b]
        direct = self._direct_grad(b)
        if direct is not None:
            self._take_grads(direct, begin, members)
            return
        staging = self._stage(b)
        # (the hooks took this backward's gradients into their slots already: what is left in .grad is what
        # no_sync backwards accumulated for a parameter this backward did not reach, whose slot is zeros)
        self._take_grads(staging, begin, members)
        self._launch_reduce(b, staging)
        self._staging[b] = None  # the Work keeps it alive until it is waited on

    def _end_backward(self):
        """Buckets holding unused parameters launch now, with zeros for the missing gradients."""
        self._launch_order.finish()
        self._end_of_backward()
        self._start_backward()

    def _reduce_gradients(self):
        self._drain()  # only waits: every bucket was launched during backward
