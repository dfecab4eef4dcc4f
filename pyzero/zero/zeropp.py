"""ZeRO++ for stage 3 (Wang et al., 2023): fewer bytes across the slow link between hosts.

- hpZ (``zero_hpz_partition_size=P``): after a forward gather each rank keeps a secondary
  shard, its 1/P of the full parameters, and backward gathers from those within its
  partition of P consecutive ranks (one host), so they never leave the host. Costs
  padded/P parameters per unit of memory; results are bitwise those of plain stage 3.
- qwZ (``zero_quantized_weights=True``): gathers move int8 blocks (quantize.py) instead of
  the parameters, dequantised on arrival; every rank computes with the same dequantised
  weights. The fp32 master weights stay exact.
- qgZ (``zero_quantized_gradients=True`` for int8, or 4 for int4): the gradient
  reduce-scatter becomes two quantised all-to-alls, first among the ranks of a host, then
  among the ranks with the same local index on every host; each hop dequantises and sums in
  fp32 (a rank's own contribution is never quantised).

Schedule of one unit's gradients under qgZ, rank (host h, local index l), H hosts of L ranks:

    staging: world chunks, chunk (h', l') for rank (h', l')
    intra:   to each local peer l' send q(chunks (0, l'), ..., (H-1, l'))   -> sum: lane l's H chunks
    inter:   to rank (h', l) send q(partial chunk (h', l))                  -> sum: chunk (h, l)
"""
from __future__ import annotations

import torch

from .. import comm
from .quantize import all_to_all, dequantize, packed_words, quantize
from ..checks import is_int


def hosts_of(group) -> list[list[int]]:
    """The group's global ranks per host (hosts in topology order), from pz.topology()."""
    topo = comm.topology()
    members = set(group.ranks)
    return [[r for r in h if r in members] for h in topo.hosts if any(r in members for r in h)]


def check_values(hpz, qw, qg) -> tuple[int, bool, int]:
    """The options' types and values, before anything is set up: (hpz partition size, quantised
    weights, gradient bits or 0); errors name the option."""
    if not is_int(hpz) or hpz < 1:
        raise ValueError(f"zero_hpz_partition_size: expected a positive int (ranks per host; 1 = off), got {hpz!r}")
    if not isinstance(qw, bool):
        raise ValueError(f"zero_quantized_weights: expected True or False, got {qw!r}")
    if isinstance(qg, bool):
        bits = 8 if qg else 0
    elif isinstance(qg, int) and qg in (4, 8):
        bits = qg
    else:
        raise ValueError(f"zero_quantized_gradients: expected False, True (int8), 8 or 4 (int4), got {qg!r}")
    return hpz, qw, bits


def check_options(hpz, qw, qg, group) -> tuple[int, bool, int]:
    """check_values, then what the options need of the group; errors name the option."""
    hpz, qw, bits = check_values(hpz, qw, qg)
    if hpz > 1:
        if group.size % hpz:
            raise ValueError(f"zero_hpz_partition_size={hpz}: expected a divisor of the group's {group.size} ranks")
        if group.size != comm.get_world_size():
            raise ValueError(f"zero_hpz_partition_size={hpz}: needs the ZeRO group to be the whole world (hpZ "
                             "builds its partitions with pz.new_group, which every rank must call)")
        host = {r: i for i, h in enumerate(comm.topology().hosts) for r in h}
        for k in range(group.size // hpz):
            part = group.ranks[k * hpz:(k + 1) * hpz]
            if len({host[r] for r in part}) > 1:
                raise ValueError(f"zero_hpz_partition_size={hpz}: partition {list(part)} spans hosts; expected "
                                 "a divisor of the ranks per host, so backward gathers stay inside a host")
    if bits:
        sizes = {len(h) for h in hosts_of(group)}
        if len(sizes) > 1:
            raise ValueError(f"zero_quantized_gradients: needs the same number of the group's ranks on every "
                             f"host, got {[len(h) for h in hosts_of(group)]}")
    return hpz, qw, bits


class _Then:
    """A gather's Work plus what to do once it has arrived (dequantise, keep hpZ's shard)."""

    __slots__ = ("work", "then")

    def __init__(self, work, then):
        self.work, self.then = work, then

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
            if self.then is not None:
                self.then()
        return True


class GatherPlan:
    """How a unit's full parameters are gathered: plain, quantised (qwZ) or, in backward, from the
    hpZ secondary shards within the partition."""

    def __init__(self, group, hpz: int, qw: bool):
        self.group, self.hpz, self.qw = group, hpz, qw
        self.partition = None
        if hpz > 1:
            # Every rank creates every partition, in the same order (pz.new_group is collective).
            parts = [comm.new_group(group.ranks[k * hpz:(k + 1) * hpz]) for k in range(group.size // hpz)]
            self.partition = parts[group.rank // hpz]
        self.index = group.rank % hpz  # this rank's place in its partition

    def secondary(self, padded: int, dtype, device) -> torch.Tensor | None:
        return torch.empty(padded // self.hpz, dtype=dtype, device=device) if self.partition is not None else None

    def start(self, unit, backward: bool) -> _Then:
        if backward and unit.secondary_valid:
            return _Then(comm.all_gather(unit.full, unit.secondary, group=self.partition, async_op=True), None)
        keep = self._keep_secondary(unit) if unit.secondary is not None else None
        if not self.qw:
            return _Then(comm.all_gather(unit.full, unit.gather_input(), group=self.group, async_op=True), keep)
        n, words = unit.shard.numel(), packed_words(unit.shard.numel(), 8)
        payload = quantize(unit.gather_input())
        out = torch.empty(self.group.size * words, dtype=torch.int32, device=unit.full.device)
        work = comm.all_gather(out, payload, group=self.group, async_op=True)

        def arrive():
            for r in range(self.group.size):
                unit.full[r * n:(r + 1) * n].copy_(dequantize(out[r * words:(r + 1) * words], n))
            if keep is not None:
                keep()
        return _Then(work, arrive)

    def _keep_secondary(self, unit):
        def keep():
            m = unit.secondary.numel()
            unit.secondary.copy_(unit.full[self.index * m:(self.index + 1) * m])
            unit.secondary_valid = True
        return keep


class QuantizedReduceScatter:
    """qgZ: the averaged reduce-scatter of a unit's gradients as two quantised all-to-alls (see the
    module docstring); returns this rank's fp32 shard."""

    def __init__(self, group, bits: int):
        self.group, self.bits = group, bits
        self.hosts = hosts_of(group)
        me = comm.get_rank()
        self.h = next(i for i, h in enumerate(self.hosts) if me in h)
        self.l = self.hosts[self.h].index(me)
        self.index = {g: i for i, g in enumerate(group.ranks)}  # global rank -> chunk index

    def __call__(self, staging: torch.Tensor, shard: int) -> torch.Tensor:
        H, local, bits = len(self.hosts), self.hosts[self.h], self.bits
        x = staging.float()

        def chunk(g):
            i = self.index[g]
            return x[i * shard:(i + 1) * shard]

        def lane(l):  # the chunks of local index l on every host, host order
            return torch.cat([chunk(h[l]) for h in self.hosts])

        n = H * shard
        # intra: gather lane l's chunks from the host's ranks
        peers = [g for g in local if g != local[self.l]]
        sends = {g: quantize(lane(local.index(g)), bits) for g in peers}
        recvs = {g: torch.empty(packed_words(n, bits), dtype=torch.int32, device=x.device) for g in peers}
        all_to_all(local, sends, recvs, self.group)
        partial = lane(self.l).clone()
        for g in local:  # fixed order: local index
            if g != local[self.l]:
                partial.add_(dequantize(recvs[g], n, bits))
        # inter: each host's partial of this rank's chunk
        lane_ranks = [h[self.l] for h in self.hosts]
        me = lane_ranks[self.h]
        peers = [g for g in lane_ranks if g != me]
        sends = {g: quantize(partial[i * shard:(i + 1) * shard], bits) for i, g in enumerate(lane_ranks) if g != me}
        recvs = {g: torch.empty(packed_words(shard, bits), dtype=torch.int32, device=x.device) for g in peers}
        all_to_all(lane_ranks, sends, recvs, self.group)
        out = torch.zeros(shard, dtype=torch.float32, device=x.device)
        for i, g in enumerate(lane_ranks):  # fixed order: host
            out.add_(partial[i * shard:(i + 1) * shard] if g == me else dequantize(recvs[g], shard, bits))
        return out.div_(self.group.size)
