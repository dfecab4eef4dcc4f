"""The "shm" backend: CPU processes of one host over POSIX shared memory.

The transport (csrc/shm_transport.h) maps one segment per group; each rank
creates its part, every rank attaches to all of them, and the segments are
unlinked as soon as all ranks have mapped them, so even a killed job leaves
nothing in /dev/shm. Collectives run on one C++ worker thread per group
(send/recv on one per peer and direction) without the GIL.
"""
from __future__ import annotations

import json

import torch

from .. import _C
from ..backend import DTYPES, Backend, Buffer, GroupSetup, check_contiguous, tensor_code

_new_tuple = tuple.__new__  # Buffer without NamedTuple.__new__'s Python frame (hot path)
_CODE_SIZE = {dt: (code, torch.empty((), dtype=dt).element_size()) for dt, code in DTYPES.items()}


def _same_settings(setup: GroupSetup, mine: dict) -> None:
    """Every rank of the group resolved the same transport settings (options or PYZERO_SHM_* variables):
    ranks cutting a call differently, or picking different algorithms for it, read each other's data wrong
    or wait for each other in vain. ValueError on every rank (each compares the same values) naming them."""
    every = [mine if r == setup.rank else json.loads(setup.get(f"{setup.key}/settings/{r}"))
             for r in range(setup.size)]
    for name in mine:
        values = [s.get(name) for s in every]
        if any(v != values[0] for v in values):
            shown = ", ".join(f"rank {r}: {v}" for r, v in enumerate(values))
            raise ValueError(f"options.{name}: the ranks of the group set it differently ({shown}), by options= or "
                             "the PYZERO_SHM_* environment variables; every rank must use the same value")


class ShmBackend(Backend):
    name = "shm"
    has_symmetric = True
    has_out_of_place_all_reduce = True

    def __init__(self, comm, oneshot_bytes: int):
        self.comm = comm
        self.oneshot_bytes = oneshot_bytes  # the largest message of the one-shot path (algo "auto")
        self._flight = None

    @property
    def flight(self):
        """The group's flight ring (pyzero.flight.Ring); the transport records every call in it itself,
        inside the call (csrc/shm_comm.h), so pyzero.comm does not."""
        return self._flight

    @flight.setter
    def flight(self, ring) -> None:
        self._flight = ring
        c = getattr(ring, "c", None)
        self.comm.set_flight(c)
        if c is not None:
            ring.native = True

    @classmethod
    def create(cls, setup: GroupSetup) -> "ShmBackend":
        o = setup.options
        oneshot = o.get("oneshot_bytes", 512 << 10, "PYZERO_SHM_ONESHOT_KB", kib=True)
        slice_bytes = o.get("slice_bytes", 256 << 10, "PYZERO_SHM_SLICE_KB", kib=True)
        if slice_bytes < 4096 or slice_bytes % 64:
            raise ValueError(f"slice_bytes={slice_bytes} (options.slice_bytes or PYZERO_SHM_SLICE_KB): the shm "
                             "backend takes a multiple of 64 bytes, at least 4096")
        depth = o.get("depth", 8, "PYZERO_SHM_DEPTH")
        stream = o.get("stream_bytes", 8 << 20, "PYZERO_SHM_STREAM_KB", kib=True)
        twoshot = o.get("twoshot_bytes", 8 << 20, "PYZERO_SHM_TWOSHOT_KB", kib=True)
        adaptive = o.get("adaptive", True, "PYZERO_SHM_ADAPTIVE")
        twoshot_stream = o.get("twoshot_stream_bytes", 4 << 10, "PYZERO_SHM_TWOSHOT_STREAM_KB", kib=True)
        if not 2 <= depth <= 1 << 16:
            raise ValueError(f"depth={depth} (options.depth or PYZERO_SHM_DEPTH): the shm backend takes 2 to "
                             f"{1 << 16} slots")
        for what, env, v in (("slice_bytes", "SLICE", slice_bytes), ("oneshot_bytes", "ONESHOT", oneshot),
                             ("stream_bytes", "STREAM", stream), ("twoshot_bytes", "TWOSHOT", twoshot),
                             ("twoshot_stream_bytes", "TWOSHOT_STREAM", twoshot_stream)):
            if v > 1 << 40:
                raise ValueError(f"{what}={v} (options.{what} or PYZERO_SHM_{env}_KB): expected at most 1 TiB")
        if oneshot == 0 and twoshot == 0:
            raise ValueError("oneshot_bytes and twoshot_bytes (options, or PYZERO_SHM_ONESHOT_KB and "
                             "PYZERO_SHM_TWOSHOT_KB) are both 0: they size the area the one-shot and two-shot "
                             "all_reduce stage through; give one of them more than 0")
        # (symmetric: the TP ops' fused path; ranks that differ take the fused path and the ring, and wait for
        # each other until the timeout)
        settings = {"slice_bytes": slice_bytes, "depth": depth, "oneshot_bytes": oneshot, "stream_bytes": stream,
                    "twoshot_bytes": twoshot, "adaptive": adaptive, "twoshot_stream_bytes": twoshot_stream,
                    "symmetric": o.get("symmetric", True, "PYZERO_SYMMETRIC")}
        comm = _C.ShmComm(setup.name, setup.rank, setup.size, slice_bytes, depth, oneshot, setup.timeout, stream,
                          twoshot, adaptive, twoshot_stream)
        try:
            setup.store.set(f"{setup.key}/settings/{setup.rank}", json.dumps(settings))
            setup.barrier("created")
            _same_settings(setup, settings)
            comm.attach()
            setup.barrier("attached")
        finally:
            comm.unlink()  # every rank has mapped it now (or set-up failed): nothing left in /dev/shm
        return cls(comm, oneshot)

    def buffer(self, x, arg: str, writable: bool = True) -> Buffer:
        if isinstance(x, torch.Tensor) and x.is_cpu:  # the common case, checked cheaply
            try:
                contiguous = x.is_contiguous()
            except RuntimeError:  # (sparse compressed layouts have no is_contiguous: refused below)
                contiguous = False
            cs = _CODE_SIZE.get(x.dtype) if contiguous else None
            # (a lazily negated view, x.conj().imag, holds the values' negation in memory)
            if cs is not None and x.layout is torch.strided and not x.is_neg():
                return _new_tuple(Buffer, (x.data_ptr(), x.numel(), cs[1], cs[0], 0, "torch"))
        code = tensor_code(x, arg)
        check_contiguous(x, arg)
        if not x.is_cpu:
            raise ValueError(f"{arg}: the shm backend takes CPU tensors, got a tensor on {x.device}")
        raise AssertionError("unreachable: the checks above cover every rejected tensor")

    def all_reduce(self, b, op, algo, async_op, inp=None):
        return self.comm.all_reduce(b.ptr, b.numel, b.code, op, algo, async_op, 0 if inp is None else inp.ptr)

    def reduce_scatter(self, out, inp, counts, op, algo, async_op):
        return self.comm.reduce_scatter(out.ptr, inp.ptr, counts, out.code, op, algo, async_op)

    def all_gather(self, out, inp, counts, algo, async_op):
        return self.comm.all_gather(out.ptr, inp.ptr, counts, out.code, algo, async_op)

    def broadcast(self, b, root, algo, async_op):
        return self.comm.broadcast(b.ptr, b.numel, b.code, root, algo, async_op)

    def barrier(self, async_op):
        return self.comm.barrier(async_op)

    def send(self, b, peer, async_op):
        return self.comm.send(b.ptr, b.numel, b.code, peer, async_op)

    def recv(self, b, peer, async_op):
        return self.comm.recv(b.ptr, b.numel, b.code, peer, async_op)

    def stats(self, reset):
        return self.comm.stats(reset)

    def close(self):
        self.comm.close()

    # ---- symmetric buffers (pyzero.symmetric; csrc [Note: symmetric buffers]) ----

    def sym_arrive(self, kind: str, like: torch.Tensor, dims: tuple[int, ...], count: int) -> None:
        """Enter a fused call like a collective: ranks that disagree on kind, dtype or dims fail together."""
        code, fr = self.buffer(like, "x").code, self.flight
        i = fr.begin("fused_" + kind, count, code) if fr is not None else 0
        try:
            self.comm.sym_arrive(_C.SYM_KINDS[kind], count, code, list(dims))
        except Exception as e:
            raise (e if fr is None else fr.failed(i, e)) from None
        if fr is not None:
            fr.done(i)

    def sym_grow(self, nbytes: int, barrier) -> list[torch.Tensor]:
        """Replace the symmetric buffers by ones of `nbytes` per rank (collective; `barrier()` syncs the
        group); returns a uint8 view of every rank's buffer."""
        c = self.comm
        c.sym_create(nbytes)
        barrier()
        c.sym_attach()
        barrier()
        c.sym_unlink()  # every rank has mapped it: nothing left in /dev/shm
        return [torch.frombuffer(c.sym_buffer(r), dtype=torch.uint8) for r in range(c.size)]

    def sym_bytes(self) -> int:
        return self.comm.sym_bytes()

    def sym_signal(self, value: int) -> None:
        self.comm.sym_signal(value)

    def sym_wait(self, peer: int, value: int, what: str) -> None:
        try:
            self.comm.sym_wait(peer, value, what)
        except Exception as e:  # a peer died or stalled inside the fused call recorded last
            fr = self.flight
            raise (e if fr is None or not fr.n else fr.failed(fr.n, e)) from None
