"""``pz.optim.NvmeAdamW`` / ``NvmeAdam``: Adam(W) whose state lives in swap files on disk.

The parameters (the fp32 masters) and gradients stay in RAM; exp_avg,
exp_avg_sq (and max_exp_avg_sq) live in :class:`pyzero.optim.swap.Swapper`
files, one per *sub-group* of about ``sub_group_elems`` elements (parameters
are packed in order and split where one is larger). A step walks the
sub-groups with two buffers:

    read 0 -> A, read 1 -> B
    n = 0:  wait read 0 | step 0 on A | write 0 from A, then (I/O threads) read 2 -> A
    n = 1:  wait read 1 | step 1 on B | write 1 from B, then read 3 -> B
    ...

so writing the previous sub-group and reading the next one overlap the
current one's fused step (pz.optim's C++ kernel; the numbers are pz.optim.AdamW's
exactly). RAM for state is two sub-groups of buffers instead of the whole state.

``state`` is a mapping that reads a parameter's state from disk on access and
writes it on assignment, so ``state_dict()`` / ``load_state_dict()`` have
torch.optim.AdamW's layout and pyzero checkpoints see ordinary tensors.
``io_stats`` counts bytes moved and the seconds the step waited for I/O (the
part of the I/O not hidden behind compute).
"""
from __future__ import annotations

import time
import weakref
from collections.abc import MutableMapping
from concurrent.futures import Future

import torch

from . import functional as F
from .adam import Adam
from .swap import ALIGN, Swapper, aligned_empty

DEFAULT_SUB_GROUP = 1 << 23  # elements; RAM held: 2 buffers x (2 or 3 states) x 4 bytes x this
_ELEMS_ALIGN = ALIGN // 4


class _DiskState(MutableMapping):
    """{param: {"step", "exp_avg", "exp_avg_sq"[, "max_exp_avg_sq"]}} backed by the swap files.

    It holds its optimizer by a weak reference: the optimizer holds it as ``state``, and a cycle
    would keep the swap files on disk after ``del opt`` until a garbage-collection pass."""

    def __init__(self, opt: "NvmeAdam"):
        self._opt = weakref.ref(opt)

    @property
    def opt(self) -> "NvmeAdam":
        opt = self._opt()
        if opt is None:
            raise ReferenceError("the optimizer of this state was deleted (its swap files with it)")
        return opt

    def _index(self, p) -> int:
        i = self.opt._index.get(id(p))
        if i is None:
            raise KeyError("not a parameter of this optimizer")
        return i

    def __getitem__(self, p):
        i = self._index(p)
        if i not in self.opt._steps:
            raise KeyError(p)
        out = {"step": self.opt._steps[i].clone()}
        for j, name in enumerate(self.opt._names):
            t = torch.empty(self.opt._params[i].shape, dtype=torch.float32)
            flat = t.view(-1)
            for k, start, end, local in self.opt._segments_of[i]:
                self.opt._swap.read_range(k, self.opt._offset(k, j, local), flat[start:end])
            out[name] = t
        return out

    def __setitem__(self, p, st):
        i = self._index(p)
        for j, name in enumerate(self.opt._names):
            src = st.get(name)
            src = torch.zeros(self.opt._params[i].shape) if src is None else src.detach().to(torch.float32)
            flat = src.reshape(-1)
            for k, start, end, local in self.opt._segments_of[i]:
                self.opt._swap.write_range(k, self.opt._offset(k, j, local), flat[start:end])
        self.opt._steps[i] = torch.as_tensor(st.get("step", 0.0), dtype=torch.float32).clone()

    def __delitem__(self, p):
        i = self._index(p)
        if self.opt._steps.pop(i, None) is None:
            raise KeyError(p)

    def __iter__(self):
        return iter([self.opt._params[i] for i in sorted(self.opt._steps)])

    def __len__(self):
        return len(self.opt._steps)


class NvmeAdam(Adam):
    """Adam with state on disk under ``nvme_path`` (see the module docstring).

    Its class name is "Adam" (``pyzero.optim.nvme.Adam``, exported as ``pz.optim.NvmeAdam``),
    and NvmeAdamW's "AdamW": the state is the same, so pyzero checkpoints, which record the
    optimizer's class name, load across in-memory and on-disk state.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False, *,
                 nvme_path=None, sub_group_elems: int = DEFAULT_SUB_GROUP, io_threads: int = 4,
                 direct: bool | None = None, **kw):
        if not isinstance(sub_group_elems, int) or sub_group_elems < 1:
            raise ValueError(f"sub_group_elems: expected an int >= 1, got {sub_group_elems!r}")
        if kw.get("moments", "fp32") != "fp32":
            raise ValueError(f"moments: the on-disk state is fp32 (moments='fp32'), got {kw['moments']!r}")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kw)
        self._params = [p for g in self.param_groups for p in g["params"]]
        for i, p in enumerate(self._params):
            if p.device.type != "cpu" or p.dtype != torch.float32 or not p.is_contiguous():
                raise ValueError(f"params[{i}]: expected a contiguous float32 CPU tensor, got {p.dtype} on "
                                 f"{p.device}")
        self._index = {id(p): i for i, p in enumerate(self._params)}
        self._group_of = [gi for gi, g in enumerate(self.param_groups) for _ in g["params"]]
        self._names = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if any(g["amsgrad"] for g in
                                                                              self.param_groups) else [])
        self._plan(sub_group_elems)
        self._swap = Swapper(nvme_path, [self._cap[k] * 4 * len(self._names) for k in range(len(self._cap))],
                             threads=io_threads, direct=direct)
        nbuf = max(self._cap, default=0) * 4 * len(self._names)
        self._bufs = [aligned_empty(nbuf), aligned_empty(nbuf)] if self._cap else []
        self._steps: dict[int, torch.Tensor] = {}
        self._disk = self.state = _DiskState(self)  # one object: holders of .state stay valid
        self.io_stats = {"read_bytes": 0, "write_bytes": 0, "io_wait_s": 0.0, "step_s": 0.0}

    def add_param_group(self, param_group: dict) -> None:
        if "_swap" in self.__dict__:  # (torch's __init__ adds the groups given at construction)
            raise ValueError("add_param_group: the swap files are laid out for the parameters given at construction; "
                             "build a new optimizer with every group")
        super().add_param_group(param_group)

    def _plan(self, sub_group_elems):
        """Cut the parameters, in order, into sub-groups of <= sub_group_elems elements."""
        self._segments: list[list[tuple[int, int, int, int]]] = []  # per group: (param, start, end, local)
        self._segments_of: list[list[tuple[int, int, int, int]]] = [[] for _ in self._params]  # (k, s, e, local)
        cur, used = [], 0
        for i, p in enumerate(self._params):
            start, n = 0, p.numel()
            while start < n:
                take = min(n - start, sub_group_elems - used)
                cur.append((i, start, start + take, used))
                used += -(-take // 16) * 16  # keep every segment 64-byte aligned in the buffer
                start += take
                if used >= sub_group_elems:
                    self._segments.append(cur)
                    cur, used = [], 0
        if cur:
            self._segments.append(cur)
        self._cap = []
        for k, segs in enumerate(self._segments):
            end = max(local + (e - s) for _, s, e, local in segs)
            self._cap.append(-(-end // _ELEMS_ALIGN) * _ELEMS_ALIGN)
            for i, s, e, local in segs:
                self._segments_of[i].append((k, s, e, local))

    def _offset(self, k: int, j: int, local: int) -> int:
        """Byte offset of state j, element `local`, in sub-group k's file (and buffer)."""
        return (j * self._cap[k] + local) * 4

    def state_bytes(self) -> tuple[int, int]:
        """(bytes of optimizer state held in RAM: the two swap buffers; bytes in the swap files)."""
        return sum(b.numel() for b in self._bufs), sum(self._swap.sizes)

    @property
    def direct(self) -> bool:
        """Whether the swap files use O_DIRECT (else the page cache)."""
        return self._swap.direct

    def close(self) -> None:
        """Delete the swap files (also done when the optimizer is garbage collected)."""
        self._swap.close()

    def load_state_dict(self, state_dict) -> None:
        if "max_exp_avg_sq" not in self._names and any(g.get("amsgrad") for g in state_dict.get("param_groups", [])):
            self._add_max_exp_avg_sq()
        super().load_state_dict(state_dict)  # leaves full tensors in a plain dict self.state
        loaded, self.state = self.state, self._disk
        self._steps.clear()
        for p, st in loaded.items():
            self.state[p] = st

    @F.hooked_step
    @torch.no_grad()
    def step(self, closure=None, *, grad_scale: float = 1.0, copies: dict | None = None):
        loss = F.run_closure(closure)
        self._swap._check()
        t_start = time.perf_counter()
        fresh, active = set(), set()
        for i, p in enumerate(self._params):  # every check before any step count moves or any state is written
            if p.grad is None:
                continue
            g = p.grad
            if g.is_sparse or not g.is_contiguous() or g.dtype != torch.float32 or g.device.type != "cpu" \
                    or g.numel() != p.numel():
                raise ValueError(f"params[{i}].grad: expected a dense contiguous float32 CPU tensor of "
                                 f"{p.numel()} elements, got {g.dtype} on {g.device}")
            active.add(i)
        hyper = self._check_step(active, copies)
        grad_scale = float(grad_scale)
        if "max_exp_avg_sq" not in self._names and any(self.param_groups[gi]["amsgrad"] for gi in hyper):
            self._add_max_exp_avg_sq()
        for i in sorted(active):
            if i not in self._steps:
                self._steps[i] = torch.tensor(0.0, dtype=torch.float32)
                fresh.add(i)
            self._steps[i] += 1
        groups = [k for k, segs in enumerate(self._segments) if any(i in active for i, *_ in segs)]
        # see the schedule in the module docstring: group n lives in buffer n % 2; the read of
        # group n + 2 into that buffer is chained behind the write of group n, on the I/O threads.
        wait = 0.0
        reads = {n: self._swap.read(groups[n], self._bufs[n]) for n in range(min(2, len(groups)))}
        writes = []
        try:
            for n, k in enumerate(groups):
                buf = self._bufs[n % 2]
                t0 = time.perf_counter()
                reads.pop(n).result()
                wait += time.perf_counter() - t0
                self._step_group(k, buf, active, fresh, grad_scale, copies, hyper)
                writes.append(self._swap.write(k, buf))
                if n + 2 < len(groups):
                    reads[n + 2] = self._read_after(writes[-1], groups[n + 2], buf)
        finally:
            t0 = time.perf_counter()
            errors = []
            for f in writes + list(reads.values()):
                try:
                    f.result()
                except Exception as e:  # noqa: BLE001 -- the first failure is raised below
                    errors.append(e)
            wait += time.perf_counter() - t0
        if errors:
            raise errors[0]
        st = self.io_stats
        st["read_bytes"], st["write_bytes"] = self._swap.bytes_read, self._swap.bytes_written
        st["io_wait_s"] += wait
        st["step_s"] += time.perf_counter() - t_start
        return loss

    def _check_step(self, active: set, copies) -> dict:
        """What pz.optim.AdamW's step checks, for the parameters in `active`, before the step changes anything
        (the sub-groups are stepped and written one after another, so a kernel refusing the last one would
        come after the others were on disk): the gradients and `copies` of each param group as its kernel
        sees them, and the hyperparameters as floats. Returns {group index: (lr, beta1, beta2)}."""
        by_group: dict[int, list[int]] = {}
        for i in sorted(active):
            by_group.setdefault(self._group_of[i], []).append(i)
        F.check_lists([([self._params[i] for i in idx], [self._params[i].grad for i in idx])
                       for idx in by_group.values()], copies)
        hyper = {}
        for gi in by_group:
            group = self.param_groups[gi]
            betas = group["betas"]
            hyper[gi] = (F.as_float(group["lr"], "lr"), F.as_float(betas[0], "betas[0]"),
                         F.as_float(betas[1], "betas[1]"))
        return hyper

    def _add_max_exp_avg_sq(self) -> None:
        """Room for amsgrad's max_exp_avg_sq in every swap file, for a param group that asks for amsgrad after
        construction (or a loaded state that has it): each file grows by one state, zeros, as pz.optim.AdamW
        starts the state then. Checked for space first; the buffers grow to three states."""
        self._swap.grow([c * 4 * (len(self._names) + 1) for c in self._cap])
        self._names.append("max_exp_avg_sq")
        nbuf = max(self._cap, default=0) * 4 * len(self._names)
        self._bufs = [aligned_empty(nbuf), aligned_empty(nbuf)] if self._cap else []

    def _read_after(self, write: Future, k: int, buf) -> Future:
        """A Future for reading group k into `buf`, started once `write` (from `buf`) is done."""
        out: Future = Future()

        def relay(f):
            e = f.exception()
            if e is not None:
                out.set_exception(e)
            else:
                out.set_result(f.result())

        def start(w):
            if w.exception() is not None:
                out.set_exception(w.exception())
                return
            try:
                self._swap.read(k, buf).add_done_callback(relay)
            except Exception as e:  # noqa: BLE001 -- delivered through the Future
                out.set_exception(e)

        write.add_done_callback(start)
        return out

    def _step_group(self, k, buf, active, fresh, grad_scale, copies, hyper):
        cap = self._cap[k]
        states = [buf[j * cap * 4:(j + 1) * cap * 4].view(torch.float32) for j in range(len(self._names))]
        batches: dict[tuple[int, float], list] = {}
        for i, s, e, local in self._segments[k]:
            if i not in active:
                continue
            views = [st[local:local + e - s] for st in states]
            if i in fresh:  # state starts at zero, whatever the file held
                for v in views:
                    v.zero_()
            p = self._params[i]
            copy = copies.get(p) if copies else None
            key = (self._group_of[i], self._steps[i].item())
            batches.setdefault(key, []).append((p.view(-1)[s:e], p.grad.view(-1)[s:e], views,
                                                None if copy is None else copy.view(-1)[s:e]))
        for (gi, step), rows in batches.items():
            group = self.param_groups[gi]
            lr, beta1, beta2 = hyper[gi]
            ams = group["amsgrad"]
            has_copy = any(r[3] is not None for r in rows)
            F.adam_step([r[0] for r in rows], [r[1] for r in rows], [r[2][0] for r in rows],
                        [r[2][1] for r in rows], [r[2][2] for r in rows] if ams else None,
                        [r[3] for r in rows] if has_copy else None, step=step,
                        lr=lr, beta1=beta1, beta2=beta2, eps=group["eps"],
                        weight_decay=group["weight_decay"], decoupled=group["decoupled_weight_decay"], amsgrad=ams,
                        maximize=group["maximize"], grad_scale=grad_scale, threads=self.threads,
                        isa=self.isa)


class NvmeAdamW(NvmeAdam):
    _decoupled = True

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, **kw):
        if "decoupled_weight_decay" in kw:  # (as torch.optim.AdamW, which always is)
            raise TypeError("AdamW.__init__() got an unexpected keyword argument 'decoupled_weight_decay'")
        super().__init__(params, lr, betas, eps, weight_decay, amsgrad, **kw)


NvmeAdam.__name__ = NvmeAdam.__qualname__ = "Adam"
NvmeAdamW.__name__ = NvmeAdamW.__qualname__ = "AdamW"
Adam, AdamW = NvmeAdam, NvmeAdamW  # pyzero.optim.nvme.Adam / .AdamW, the names they report
