"""Search dp x tp x pp x ZeRO stage x micro-batches x SP x recomputation x offload.

Every layout of the world is enumerated (a few thousand for 64 GPUs, a
fraction of a second), each is checked against the rules below and the
device memory, and the rest is ranked by predicted step time (ties: less
memory, then fewer ranks outside data parallelism, then no recomputation).

Rules (why a layout is pruned):
* TP stays inside a host (it communicates in every layer; the seeds' advice
  and Megatron's practice): tp divides gpus_per_host; heads, hidden and the MLP
  width divide by tp.
* pp <= layers; dp divides the global batch; the micro-batch count m
  divides each replica's batch.
* ZeRO 2/3 are not combined with pipelining (their per-backward gradient
  reduction would run once per micro-batch; DeepSpeed refuses it too).
* Offload needs ZeRO >= 1 (it moves the optimizer shard).
* SP needs tp > 1 and seq divisible by tp; m >= pp is required only to keep the bubble below a half,
  not enforced.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from .cost import GB, OFFLOAD, RECOMPUTE, Cluster, Estimate, Layout, estimate
from .spec import ModelSpec
from ..checks import is_int


def _divisors(n: int) -> list[int]:
    return [k for k in range(1, n + 1) if n % k == 0]


@dataclass
class Plan:
    """The search's answer: ``best`` (an Estimate), the ranked feasible ones, and why the rest fell out."""

    spec: ModelSpec
    cluster: Cluster
    ranked: list[Estimate]
    pruned: Counter = field(default_factory=Counter)
    closest_misses: list[Estimate] = field(default_factory=list)  # the fastest layouts that did not fit

    @property
    def best(self) -> Estimate:
        if not self.ranked:
            raise ValueError(f"no layout of {self.spec.name} fits {self.cluster.world} devices of "
                             f"{self.cluster.device_memory / GB:g} GB; reasons: {dict(self.pruned)}")
        return self.ranked[0]

    @property
    def layout(self) -> Layout:
        return self.best.layout

    def table(self, top: int = 8) -> str:
        if not is_int(top) or top < 0:
            raise ValueError(f"top: expected an int >= 0 (rows of layouts to show), got {top!r}")
        s, c = self.spec, self.cluster
        lines = [f"# {s.name}: {s.params / 1e9:.3g}B parameters, L={s.layers} h={s.hidden} a={s.heads} V={s.vocab} "
                 f"s={s.seq}, global batch {s.batch}",
                 f"# {c.world} devices ({c.gpus_per_host} per host) of {c.device_memory / GB:g} GB, "
                 f"{c.flops / 1e12:g} TFLOP/s each; intra {c.intra}, inter {c.inter}",
                 f"# {len(self.ranked)} layouts fit, {sum(self.pruned.values())} pruned",
                 f"{'rank':>4}  {'layout':<44} {'peak GB':>7} {'states':>7} {'activ':>7} {'step s':>8} "
                 f"{'compute':>8} {'tp':>7} {'bubble':>7} {'dp':>7} {'optim':>7}"]
        for i, e in enumerate(self.ranked[:top]):
            m, t = e.memory, e.time
            states = m["params"] + m["grads"] + m["optimizer"]
            lines.append(f"{i + 1:>4}  {str(e.layout):<44} {m['peak'] / GB:>7.2f} {states / GB:>7.2f} "
                         f"{m['activations'] / GB:>7.2f} {t['total']:>8.3f} {t['compute']:>8.3f} {t['tp']:>7.3f} "
                         f"{t['bubble']:>7.3f} {t['dp']:>7.3f} {t['optimizer']:>7.3f}")
        if self.pruned:
            lines.append("# pruned:")
            for why, n in self.pruned.most_common():
                lines.append(f"#   {n:>6}  {why}")
        for e in self.closest_misses[:3]:
            lines.append(f"#   e.g. {e.layout}: {e.memory['peak'] / GB:.1f} GB at the peak (activations "
                         f"{e.memory['activations'] / GB:.1f}), would take {e.time['total']:.3f} s")
        return "\n".join(lines)


def _choices(values, arg: str, allowed) -> tuple:
    """The search space's ``arg`` (a non-empty sequence of values from ``allowed``), checked."""
    if isinstance(values, (str, bytes)) or not isinstance(values, (list, tuple, set, frozenset, range)) \
            or not values:
        raise ValueError(f"{arg}: expected a non-empty sequence of values from {allowed}, got {values!r}")
    for v in values:
        if isinstance(v, bool) or v not in allowed:
            raise ValueError(f"{arg}: expected values from {allowed}, got {v!r}")
    return tuple(dict.fromkeys(values))  # a value given twice is searched once


def layouts(spec: ModelSpec, c: Cluster, stages=(0, 1, 2, 3), recompute=RECOMPUTE, offload=OFFLOAD,
            max_micro_batch: int | None = None):
    """Yield (layout, reason or None) over the whole space."""
    stages = _choices(stages, "stages", (0, 1, 2, 3))
    recompute = _choices(recompute, "recompute", RECOMPUTE)
    offload = _choices(offload, "offload", OFFLOAD)
    w = c.world
    for tp in _divisors(w):
        for pp in _divisors(w // tp):
            dp = w // (tp * pp)
            base = Layout(dp, tp, pp)
            if tp > c.gpus_per_host or c.gpus_per_host % tp:
                yield base, f"tp crosses hosts ({c.gpus_per_host} devices per host)"
                continue
            if spec.heads % tp or (spec.ffn * spec.hidden) % tp:
                yield base, f"heads={spec.heads} (or the MLP width) not divisible by tp"
                continue
            if pp > spec.layers:
                yield base, f"pp > layers={spec.layers}"
                continue
            if spec.batch % dp:
                yield base, f"global batch {spec.batch} not divisible by dp"
                continue
            for m in _divisors(spec.batch // dp):
                b = spec.batch // dp // m
                if max_micro_batch is not None and b > max_micro_batch:
                    continue
                for stage in stages:
                    for sp in ((False, True) if tp > 1 else (False,)):
                        for rc in recompute:
                            for off in offload:
                                lay = Layout(dp, tp, pp, stage, b, m, sp, rc, off)
                                if pp > 1 and stage >= 2:
                                    yield lay, "ZeRO 2/3 with pipelining"
                                elif off != "none" and stage == 0:
                                    yield lay, "offload without ZeRO"
                                elif dp == 1 and stage > 0:
                                    yield lay, "ZeRO with dp=1 (same as stage 0)"
                                elif sp and spec.seq % tp:
                                    yield lay, f"sequence parallelism with seq={spec.seq} not divisible by tp"
                                else:
                                    yield lay, None


def _key(e: Estimate):
    lay = e.layout
    return (round(e.time["total"], 9), round(e.memory["peak"] / GB, 3), lay.tp * lay.pp,
            RECOMPUTE.index(lay.recompute), lay.offload != "none", lay.stage, not lay.sp)


def search(spec: ModelSpec, c: Cluster, **space) -> Plan:
    ranked, misses, pruned = [], [], Counter()
    for lay, why in layouts(spec, c, **space):
        if why is not None:
            pruned[why] += 1
            continue
        e = estimate(spec, c, lay)
        if e.memory["peak"] > c.device_memory:
            pruned[f"over {c.device_memory / GB:g} GB of device memory"] += 1
            misses.append(e)
        elif e.host_memory * c.gpus_per_host > c.host_memory and lay.offload != "none":  # (a host's ranks)
            pruned["over host memory (offload)"] += 1
        else:
            ranked.append(e)
    ranked.sort(key=_key)
    misses.sort(key=_key)
    return Plan(spec, c, ranked, pruned, misses[:3])
