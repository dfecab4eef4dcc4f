"""Block quantisation for ZeRO++ (qwZ, qgZ) and the all-to-all it travels on.

A tensor of n values is cut into blocks of BLOCK; each block keeps its
absmax / qmax as an fp32 scale and its values as round(x / scale) in int8
(qmax 127) or int4 (qmax 7, two per byte). The packed form is one int32
tensor: the nb scales' bits, then the value bytes (padded to whole words),
so it travels on any pyzero collective (which move int32 as they are).
Dequantising multiplies back in fp32; a block with a non-finite value
dequantises to NaN, so overflow still shows downstream.

all_to_all exchanges one tensor with every other rank of a set with blocking
pz.send/recv on a fixed schedule of pairs (no cycle of waiting senders).
"""
from __future__ import annotations

import torch

from .. import comm

BLOCK = 256  # values per scale: 1/64 byte of scale per value
QMAX = {8: 127, 4: 7}


def packed_words(n: int, bits: int) -> int:
    """int32 words of the packed form of n values."""
    nb = -(-n // BLOCK)
    nbytes = n if bits == 8 else -(-n // 2)
    return nb + -(-nbytes // 4)


def quantize(x: torch.Tensor, bits: int = 8) -> torch.Tensor:
    """The packed int32 form of 1-D `x` (see the module docstring)."""
    n, qmax = x.numel(), QMAX[bits]
    nb = -(-n // BLOCK)
    xb = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    xb[:n].copy_(x)
    xb = xb.view(nb, BLOCK)
    scale = xb.abs().amax(1) / qmax
    q = torch.round(xb / torch.where(scale > 0, scale, torch.ones_like(scale)).unsqueeze(1))
    q = q.clamp_(-qmax, qmax).to(torch.int8).flatten()[:n]
    if bits == 4:
        u = (q + 8).to(torch.uint8)
        if n % 2:
            u = torch.cat([u, torch.full((1,), 8, dtype=torch.uint8, device=x.device)])
        data = u[0::2] | (u[1::2] << 4)
    else:
        data = q.view(torch.uint8)
    out = torch.zeros(packed_words(n, bits), dtype=torch.int32, device=x.device)
    out[:nb] = scale.view(torch.int32)
    out[nb:].view(torch.uint8)[:data.numel()] = data
    return out


def dequantize(words: torch.Tensor, n: int, bits: int = 8) -> torch.Tensor:
    """fp32 values of a packed tensor of n values."""
    nb = -(-n // BLOCK)
    scale = words[:nb].view(torch.float32)
    data = words[nb:].view(torch.uint8)
    if bits == 4:
        data = data[:-(-n // 2)]
        q = torch.stack([data & 15, data >> 4], dim=1).flatten()[:n].to(torch.int8) - 8
    else:
        q = data[:n].view(torch.int8)
    return (q.to(torch.float32).view(-1) * scale.repeat_interleave(BLOCK)[:n])


def all_to_all(peers: list[int], sends: dict[int, torch.Tensor], recvs: dict[int, torch.Tensor], group) -> None:
    """Send sends[g] to and receive recvs[g] from every other global rank g of `peers` (this rank among
    them, the same list on every member). Step k pairs members i and j with i + j = k (mod n); in a pair
    the lower index sends first, so blocking sends never wait on each other in a cycle."""
    me = peers.index(comm.get_rank())
    n = len(peers)
    for k in range(n):
        j = (k - me) % n
        if j == me:
            continue
        peer = peers[j]
        if me < j:
            comm.send(sends[peer], dst=peer, group=group)
            comm.recv(recvs[peer], src=peer, group=group)
        else:
            comm.recv(recvs[peer], src=peer, group=group)
            comm.send(sends[peer], dst=peer, group=group)
