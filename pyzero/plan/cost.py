"""The cost model: memory per device and time per step of one parallel layout.

Notation (as in the papers): L layers, h hidden, a heads, V vocabulary, s
sequence, b micro-batch (sequences), m micro-batches per step and replica,
t = tp, p = pp, d = dp, Psi parameters held by the busiest pipeline stage of
one TP rank. Ranks are laid out tp fastest, then dp, then pp
(rank = (pp_i * d + dp_i) * t + tp_i), so TP groups are adjacent ranks.

Memory per device (bytes), first principles:

* Model states, ZeRO paper (Rajbhandari et al. 2020, section 5) with K
  optimizer bytes per parameter (12: fp32 master, momentum, variance) over
  the d data-parallel ranks (``pz.zero.estimate_memory``):
  stage 0: (2 + 2 + K) Psi; 1: 2Psi + 2Psi + K Psi/d; 2: 2Psi + (2 + K) Psi/d;
  3: (2 + 2 + K) Psi / d. Offload ("cpu", ZeRO-Offload) moves the K Psi/d
  optimizer part to host memory.
* Activations per transformer layer and micro-batch, Korthikanti et al. 2022
  (section 4, 16-bit activations, 1-byte dropout masks):
  no TP sbh(34 + 5as/h); TP sbh(10 + 24/t + 5as/(ht)); TP+SP sbh(34/t + 5as/(ht));
  selective recomputation drops the 5as/h attention terms: sbh(10 + 24/t),
  sbh(34/t) with SP; full recomputation keeps only each layer's input,
  2sbh (2sbh/t with SP), plus one layer's activations while it recomputes.
  A fused attention kernel (FlashAttention, torch SDPA) stores no scores: no
  5as/h term (``ModelSpec.fused_attention``).
  With the 1F1B schedule the first stage holds min(m, p) micro-batches of its
  L/p layers, so its activation memory is L layers' worth when m >= p (the
  paper's observation that pipelining does not reduce activation memory).
  The last stage also holds the logits and their gradient, 2 * 4sbV/t bytes in
  fp32 (V/1 when the embedding is not vocab-parallel).
* Buffers: ZeRO-3 keeps two layers' gathered parameters (current and
  prefetched) plus the gathered embedding; the TP edges a gathered input of
  sbh 16-bit values; ``reserved`` is what the framework itself takes.
* The peak, what a layout must fit in (``pz.zero.estimate_memory``'s peak):
  parameters + optimizer state + the largest of three moments, the activations'
  peak (activations, buffers, and the gradients already made: none with one
  micro-batch a step, or pipelined with m <= p, whose peak comes before the
  first backward; all of them otherwise; data parallelism without ZeRO keeps
  them always), the end of backward (ZeRO-2's gradient shard and the staging
  buffers of its reductions) and the step (all gradients); plus ``reserved``.
  pz.ZeroOptimizer keeps the gradient shards of stages 2 and 3 in fp32 (4
  bytes) whatever ``grad_comm_bytes``, the wire dtype, which sizes the staging
  buffers (counted in ``buffers``). With offload the device holds neither the
  optimizer state nor, in stages 2 and 3, the gradients.

Time per step (seconds):

* Compute from FLOPs at the device's achieved throughput F: a layer's forward
  is 24bsh^2 (with MLP ratio 4: 2bs(4 + 2f)h^2, the 6 x params x tokens rule's
  third) plus 4bs^2h for the attention scores and their use; the logits are
  2bshV; backward is twice forward; full recomputation adds a forward,
  selective recomputation the attention score part (4bs^2h).
* TP: four collectives of a bsh activation per layer and micro-batch in
  forward, four in backward (Megatron f/g: all-reduce; with SP all-gather +
  reduce-scatter, the same bus volume), on intra-host links. pyzero hides
  them as its layers do: without SP the forward all-reduce is exposed and the
  backward one overlaps the weight-gradient matmul; with SP each ring
  overlaps its own matmul, so each edge costs max(0, comm - matmul).
* Overlap needs something to run the communication beside the compute: a
  GPU's copy engines and spare SMs (``Cluster.overlap`` 1, the default), not
  CPU ranks with a core each, whose copies and reductions take the core that
  computes (``overlap`` 0). An overlapped comm of C seconds beside W seconds
  of compute costs C - overlap x min(C, W).
* Pipeline: (m + p - 1) slots of one micro-batch's forward and backward on
  the slowest stage, i.e. a bubble of (p-1)/(m+p-1) of the step, plus the
  activation sends of the fill and drain, 2(p-1) sends of sbh values.
* Ranks sharing a core (``Cluster.ranks_per_core`` k > 1: CPU ranks that
  outnumber the cores; ``flops`` is then one rank alone on a core): the core
  runs its k ranks' work in turn, so a rank's m slots take k x m slots of
  time, but a stage's idle slots (the bubble) go to the other ranks on its
  core: the pipeline takes max(m + p - 1, k x m) slots.
* Data parallel (after the m micro-batches): gradients of Psi parameters,
  all-reduced (stage 0) or reduce-scattered (stages 1-3), and stages 1-2 all-gather the updated
  parameters. Stage 0 reduces during the last backward (exposed:
  max(0, comm - backward) + the last bucket), stage 2 during every micro-batch's backward (its
  gradients accumulate in the shards: m reductions), stage 1 at step time, stage 3
  gathers parameters in every micro-batch's forward and backward, overlapped
  with them. With p > 1 the gradients are reduced after the pipeline flush,
  fully exposed (ZeRO 2/3 is not combined with pipelining, as in DeepSpeed).
* Calls: besides its transfer (the tables), every collective costs the
  device's core some fixed time to issue, hand to the communication thread
  and wake for (``Cluster.op_overhead`` seconds a call; 0 by default, measured
  by ``pyzero-plan validate``). Calls per step: DataParallel one per 25 MiB
  bucket (stages 0 and 2; stage 1 also gathers each), ZeRO-3 three per module
  with parameters and micro-batch (a GPT block has six: qkv, proj, fc,
  fc_proj, two LayerNorms; plus wte, wpe, ln_f), TP four per layer and
  micro-batch in forward and four in backward with SP (two and two without),
  a pipeline stage four sends/receives per micro-batch.
* Optimizer: a memory-bound pass over this rank's shard, (2K + 4 + 2) bytes
  per parameter at the device memory bandwidth; offloaded, CPU Adam at
  ``cpu_adam`` parameters/s plus gradients down and parameters up over PCIe.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from .comm_model import Link, Table, as_link
from .activations import RECOMPUTE, Layout, activation_memory, layer_activation_bytes, stage_params  # noqa: F401
from .spec import ModelSpec
from ..checks import is_int, is_positive_finite, is_real

GB = 1e9

OFFLOAD = ("none", "cpu")


@dataclass
class Cluster:
    """Devices and links. ``flops``: achieved FLOP/s per device (dense matmuls
    in the training dtype); ``intra``/``inter``: a Link, a bandwidth in
    bytes/s, or a collectives table (JSON path or dict); ``host_memory``: bytes of host memory per
    host, which its ``gpus_per_host`` ranks' offloaded states share."""

    world: int
    gpus_per_host: int
    device_memory: float
    flops: float
    intra: object = 300e9
    inter: object = 25e9
    mem_bw: float = 2e12
    host_memory: float = 1e12
    pcie_bw: float = 25e9
    cpu_adam: float = 1e9
    param_bytes: int = 2
    grad_comm_bytes: int | None = None
    optimizer_bytes: float = 12
    reserved: float = 0.0
    bucket_bytes: float = 1 << 20  # DataParallel's first (last reduced) bucket
    # The fraction of overlappable communication the device really hides behind compute: 1 on a GPU
    # (copy engines and spare SMs move the data), 0 for CPU ranks with a core each (the copies and
    # reductions run on the core that computes; nothing is left to overlap with).
    overlap: float = 1.0
    # Ranks per core (> 1 only for CPU ranks that outnumber the cores): they share its time.
    ranks_per_core: float = 1.0
    # Seconds of the computing core's time per collective call beyond its transfer (issue, hand-off, wake-up).
    op_overhead: float = 0.0
    dp_bucket_bytes: float = 25 << 20  # DataParallel's bucket cap (bucket_mb=25)

    def __post_init__(self):
        for arg in ("world", "gpus_per_host"):
            v = getattr(self, arg)
            if not is_int(v) or v < 1:
                raise ValueError(f"{arg}: expected a positive int, got {v!r}")
        if not is_real(self.overlap) or not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"overlap: expected a number in [0, 1], got {self.overlap!r}")
        if not is_real(self.ranks_per_core) or not 1.0 <= self.ranks_per_core < math.inf:
            raise ValueError(f"ranks_per_core: expected a number >= 1, got {self.ranks_per_core!r}")
        if not is_real(self.op_overhead) or not 0.0 <= self.op_overhead < math.inf:
            raise ValueError(f"op_overhead: expected seconds >= 0, got {self.op_overhead!r}")
        for arg in ("device_memory", "flops", "mem_bw", "host_memory", "pcie_bw", "cpu_adam"):
            v = getattr(self, arg)
            if not is_positive_finite(v):
                raise ValueError(f"{arg}: expected a positive number, got {v!r}")
        for arg in ("bucket_bytes", "dp_bucket_bytes"):
            v = getattr(self, arg)
            if not is_positive_finite(v):
                raise ValueError(f"{arg}: expected a positive number, got {v!r}")
        if not is_real(self.reserved) or not 0.0 <= self.reserved < math.inf:
            raise ValueError(f"reserved: expected bytes >= 0, got {self.reserved!r}")
        if self.param_bytes not in (2, 4):
            raise ValueError(f"param_bytes: expected 2 (mixed precision) or 4 (fp32), got {self.param_bytes!r}")
        self.intra, self.inter = as_link(self.intra, "intra"), as_link(self.inter, "inter")
        if self.grad_comm_bytes is None:
            self.grad_comm_bytes = self.param_bytes
        if self.grad_comm_bytes not in (2, 4):
            raise ValueError(f"grad_comm_bytes: expected 2 (16-bit gradients on the wire) or 4 (fp32), "
                             f"got {self.grad_comm_bytes!r}")

    def link(self, stride: int, n: int):
        """The link a group of n ranks spaced ``stride`` apart uses."""
        return self.inter if stride * n > self.gpus_per_host else self.intra

    def comm(self, op: str, nbytes: float, stride: int, n: int) -> float:
        return self.link(stride, n).time(op, nbytes, n)

    def exposed(self, comm: float, window: float) -> float:
        """What is left of `comm` seconds of communication overlapped with `window` seconds of compute:
        max(0, comm - window) when the device hides it fully, all of it when it cannot (``overlap``)."""
        return comm - self.overlap * min(comm, window)


@dataclass
class Estimate:
    layout: Layout
    memory: dict = field(default_factory=dict)  # bytes per device: params, grads, optimizer, activations, buffers, total
    time: dict = field(default_factory=dict)    # seconds per step: compute, tp, pp, bubble, dp, optimizer, total
    host_memory: float = 0.0


def memory(spec: ModelSpec, c: Cluster, lay: Layout) -> tuple[dict, float]:
    """Bytes per device (busiest stage) and host bytes (offload). The parts are what the device holds
    of each kind, ``total`` their sum and ``peak`` the most it holds at once (``pz.zero.estimate_memory``'s
    peak, with the buffers counted beside the activations, plus ``reserved``)."""
    from ..zero.memory import device_states, estimate_memory  # noqa: PLC0415

    psi = stage_params(spec, lay.tp, lay.pp)
    b, t, pb = lay.micro_batch, lay.tp, c.param_bytes
    act = activation_memory(spec, lay, pb)
    buffers = 2 * spec.seq * b * spec.hidden * pb if t > 1 else 0.0
    if lay.stage == 3:
        buffers += pb * (2 * spec.layer_params / t + spec.embedding_params / (t if spec.embedding_tp else 1))
    # The gradients held when the activations peak: none when that is before the step's first backward
    # (one micro-batch; pipelined, the first stage's last warm-up forward when m <= p), all of them
    # when an earlier micro-batch's backward has made them.
    done = 0.0 if lay.micro_batches <= lay.pp else 1.0
    offload = "cpu" if lay.offload == "cpu" else None
    # pz.ZeroOptimizer keeps fp32 gradient shards (stages 2, 3) whatever the wire dtype, which sizes the
    # reductions' staging buffers (and DataParallel's copies, stage 0)
    states = estimate_memory(psi, lay.dp, lay.stage, c.optimizer_bytes, pb == 2, activation_bytes=act + buffers,
                             grads_done=done, offload=offload, grad_bytes=4 if lay.stage >= 2 else None,
                             comm_bytes=None if lay.stage == 1 else c.grad_comm_bytes)
    out = {**device_states(states, lay.stage, offload), "activations": act,
           "buffers": buffers + states["staging"] + c.reserved}
    out["total"] = sum(out.values())
    out["peak"] = states["peak"] + c.reserved
    return out, states["host"]


def step_time(spec: ModelSpec, c: Cluster, lay: Layout) -> dict:
    s, h, V, b, t, p, d, m = (spec.seq, spec.hidden, spec.vocab, lay.micro_batch, lay.tp, lay.pp, lay.dp,
                              lay.micro_batches)
    f, F, pb = spec.ffn, c.flops, c.param_bytes
    layers = math.ceil(spec.layers / p)
    dense = 2 * b * s * (4 + 2 * f) * h * h / t   # qkv, proj, fc, fc_proj forward per layer on one TP rank
    scores = 4 * b * s * s * h / t
    logits = 2 * b * s * h * V / (t if spec.embedding_tp else 1)
    fwd = layers * (dense + scores) + logits
    bwd = 2 * fwd
    if lay.recompute == "full":
        bwd += layers * (dense + scores)
    elif lay.recompute == "selective":
        bwd += layers * scores
    compute = (fwd + bwd) / F  # one micro-batch on the slowest stage

    tp_time = 0.0
    if t > 1:
        act = b * s * h * pb
        mm = [2 * b * s * h * w * h / t / F for w in (3, 1, f, f)]  # the four matmuls at TP edges
        if lay.sp:
            ag = c.comm("all_gather", act, 1, t)
            rs = c.comm("reduce_scatter", act, 1, t)
            edge = [ag, rs, ag, rs]
            fwd_exp = sum(c.exposed(e, x) for e, x in zip(edge, mm))
            bwd_exp = sum(c.exposed(e, x) for e, x in zip(edge[::-1], mm))  # wgrad matmuls as long as forward's
        else:
            ar = c.comm("all_reduce", act, 1, t)
            fwd_exp = 2 * ar
            bwd_exp = c.exposed(ar, mm[0]) + c.exposed(ar, mm[2])
        rc_exp = fwd_exp if lay.recompute == "full" else 0.0
        tp_time = layers * (fwd_exp + bwd_exp + rc_exp)

    slot = compute + tp_time
    k = c.ranks_per_core
    pipe = max(m + p - 1, k * m) * slot
    bubble = pipe - k * m * slot
    send = 0.0
    if p > 1:
        send = 2 * (p - 1) * c.comm("send", b * s * h * pb / (t if lay.sp else 1), d * t, p)

    psi = stage_params(spec, t, p)
    g = psi * c.grad_comm_bytes
    last_bwd = bwd / F
    dp_time = 0.0
    if d > 1:
        stride = t
        ar = c.comm("all_reduce", g, stride, d)
        rs = c.comm("reduce_scatter", g, stride, d)
        ag = c.comm("all_gather", psi * pb, stride, d)
        tail = c.comm("all_reduce", min(g, c.bucket_bytes), stride, d)
        if p > 1:
            dp_time = ar if lay.stage == 0 else rs + ag
        elif lay.stage == 0:
            dp_time = c.exposed(ar, last_bwd) + tail
        elif lay.stage == 1:
            dp_time = rs + ag
        elif lay.stage == 2:  # (every micro-batch's backward reduce-scatters into the shards)
            dp_time = m * c.exposed(rs, last_bwd) + tail + ag
        else:
            first_layer = c.comm("all_gather", spec.layer_params / t * pb, stride, d)
            dp_time = m * (c.exposed(ag, fwd / F) + first_layer + c.exposed(ag + rs, last_bwd)) + tail

    shard = psi / (d if lay.stage >= 1 else 1)
    if lay.offload == "cpu":
        opt = shard / c.cpu_adam + shard * (4 + pb) / c.pcie_bw
    else:
        opt = shard * (2 * c.optimizer_bytes + 4 + pb) / c.mem_bw
    calls = collective_calls(spec, c, lay)
    total = pipe + send + dp_time + opt + calls * c.op_overhead
    return {"compute": k * m * compute, "tp": k * m * tp_time, "bubble": bubble, "pp": send, "dp": dp_time,
            "optimizer": opt, "calls": calls * c.op_overhead, "total": total}


GPT_BLOCK_MODULES = 6  # modules with parameters in a GPT block: qkv, proj, fc, fc_proj and two LayerNorms
GPT_OUTER_MODULES = 3  # the token and position embeddings and the final LayerNorm (the head is tied)


def collective_calls(spec: ModelSpec, c: Cluster, lay: Layout) -> int:
    """Collective calls one rank of the slowest stage makes per step (see the module docstring)."""
    t, p, d, m = lay.tp, lay.pp, lay.dp, lay.micro_batches
    layers = math.ceil(spec.layers / p)
    n = 0
    if t > 1:
        n += m * layers * (8 if lay.sp else 4)
    if p > 1:
        n += 4 * m
    if d > 1:
        if lay.stage == 3:
            n += 3 * m * (GPT_BLOCK_MODULES * layers + GPT_OUTER_MODULES)
        else:
            buckets = math.ceil(stage_params(spec, t, p) * c.grad_comm_bytes / c.dp_bucket_bytes)
            if lay.stage == 0:
                n += buckets
            elif lay.stage == 2 and p == 1:  # a reduce-scatter in every micro-batch's backward (the gradients
                n += buckets * (m + 1)       # accumulate in the shards), and the gather after the step
            else:  # a reduce-scatter and a gather (stage 1; stage 2 after a pipeline's flush)
                n += 2 * buckets
    return n


def estimate(spec: ModelSpec, c: Cluster, lay: Layout) -> Estimate:
    mem, host = memory(spec, c, lay)
    return Estimate(lay, mem, step_time(spec, c, lay), host)


def model_flops(spec: ModelSpec) -> float:
    """FLOPs of one training step without recomputation: 3 x forward of every layer and the logits."""
    b, s, h = spec.batch, spec.seq, spec.hidden
    return 3 * (spec.layers * (2 * b * s * (4 + 2 * spec.ffn) * h * h + 4 * b * s * s * h) + 2 * b * s * h * spec.vocab)


__all__ = ["Cluster", "Estimate", "Layout", "Link", "Table", "activation_memory", "collective_calls", "estimate",
           "layer_activation_bytes", "memory", "model_flops", "stage_params", "step_time"]
