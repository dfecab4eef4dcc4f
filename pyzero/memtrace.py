"""Where the bytes of a training step go, on the CPU and on a GPU alike.

``held(*objs)`` walks known objects (a module, a torch optimizer, a pz.ZeroOptimizer or
pz.DataParallel: their ``memory_tensors()``) and returns the bytes of distinct storage they
hold right now, per category:

    params      parameters as the rank keeps them (full, flat buffer or shards)
    grads       gradients: .grad, gradient buckets that are the gradients' storage, ZeRO's
                gradient shards
    buckets     flat staging buffers of reductions (and their communication-dtype copies)
    gathered    ZeRO-3 full parameters of units gathered now
    optimizer   optimizer state (and separate fp32 master weights)

A storage counts once, in the first of these categories that lists it.

``StepTrace`` measures one training step: the peak of allocated memory and what was live at
that moment. It walks the objects at its start and at ``mark()``s (e.g. after backward), and
records every allocation and free of the step with torch.profiler (``profile_memory``: the
CPU allocator's and the CUDA caching allocator's events alike). Replaying them gives the
peak and, for each allocation live at the peak, its category: the walks' categories for the
storages they saw, else the region it was made in (``region()`` scopes the pyzero stages put
around their gathers, staging buffers and reductions; torch's AccumulateGrad for gradients;
FSDP2's all-gather and reduce-scatter scopes; ``Optimizer.step`` for the step's temporaries,
``step_temps``); everything else made during
forward and backward is ``activations`` (saved tensors, their gradients, temporaries). The
walk at the start covers what lived before the step; on a GPU ``other`` is the rest of
torch.cuda.memory_allocated() at the start (memory no walk reaches, e.g. torch DDP's
buckets while no .grad points at them), and ``other_sites`` says where it was allocated
(``sites``: by the allocating Python line, from the stacks torch.cuda.memory._record_memory_history
keeps while it runs, as ``pyzero-bench train --memory`` has it), ``max_allocated`` the allocator's own peak and
``reserve`` the caching allocator's reserved bytes beyond it at its peak (fragmentation and
cache). On the CPU ``peak`` covers the walked memory and what the step allocated.
"""
from __future__ import annotations

import contextlib
import weakref

import torch

CATEGORIES = ("params", "grads", "buckets", "gathered", "optimizer")
STEP_CATEGORIES = CATEGORIES + ("activations", "step_temps")
_MARK = "pyzero.mark:"
_FREE = "pyzero.free:"  # a storage walked at a trace's start was freed (see StepTrace)
# profiler scopes -> category; torch FSDP2's own scopes carry the module's name after " ("
_REGIONS = {"pyzero.gather": "gathered", "pyzero.bucket": "buckets", "pyzero.grad": "grads",
            "torch::autograd::AccumulateGrad": "grads", "FSDP::all_gather": "gathered",
            "FSDP::all_gather_copy_out": "gathered", "FSDP::post_backward_reduce": "buckets"}


def region(name: str):
    """A profiler scope (torch.profiler.record_function) while a profiler records, else
    nothing: the stages mark where they allocate gathered units ("pyzero.gather"), staging
    buffers ("pyzero.bucket") and gradient shards ("pyzero.grad")."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (FSDP2), else the tensor."""
    to_local = getattr(t, "to_local", None)
    return to_local() if callable(to_local) and type(t) is not torch.Tensor else t


def tensors(obj) -> dict[str, list[torch.Tensor]]:
    """The tensors `obj` holds, by category: an object with ``memory_tensors()`` (pz.ZeroOptimizer,
    pz.DataParallel) says so itself; an nn.Module gives its parameters and their .grad; a torch
    optimizer its state, and that of the optimizer it wraps as ``.optim`` (torch's
    ZeroRedundancyOptimizer)."""
    out: dict[str, list[torch.Tensor]] = {c: [] for c in CATEGORIES}
    own = getattr(obj, "memory_tensors", None)
    if callable(own):
        for c, ts in own().items():
            out[c].extend(ts)
    elif isinstance(obj, torch.nn.Module):
        for p in obj.parameters():
            out["params"].append(p)
            if p.grad is not None:
                out["grads"].append(p.grad)
    elif isinstance(obj, torch.optim.Optimizer):
        # a wrapper's own optimizer too: torch's ZeroRedundancyOptimizer keeps its shard's state in
        # .optim, its own .state stays empty
        opts = [obj]
        while isinstance(getattr(opts[-1], "optim", None), torch.optim.Optimizer) and len(opts) < 8:
            opts.append(opts[-1].optim)
        out["optimizer"] = [t for o in opts for st in o.state.values() for t in st.values() if torch.is_tensor(t)]
    else:
        raise TypeError(f"objs: expected modules, optimizers or objects with memory_tensors(), "
                        f"got {type(obj).__name__}")
    return out


def storages(*objs, device: torch.device | str | None = None) -> dict[int, tuple[str, int]]:
    """data_ptr -> (category, bytes) of every distinct non-empty storage `objs` hold (on `device`
    when given), each in the first category that lists it (see CATEGORIES)."""
    return {ptr: (c, st.nbytes()) for ptr, (c, st) in _walk(objs, device).items()}


def _walk(objs, device) -> dict[int, tuple[str, torch.UntypedStorage]]:
    """data_ptr -> (category, storage): storages() with the storages themselves."""
    device = None if device is None else torch.device(device)
    found: dict[int, tuple[str, torch.UntypedStorage]] = {}
    per = [tensors(o) for o in objs]
    for c in CATEGORIES:
        for ts in per:
            for t in ts[c]:
                t = _local(t)
                if device is not None and t.device.type != device.type:
                    continue
                st = t.untyped_storage()
                ptr = st.data_ptr()
                if st.nbytes() and ptr not in found:
                    found[ptr] = (c, st)
    return found


def _on_free(ptr: int) -> None:
    """A walked storage's finalizer: marks its free in the profiler's record while one records."""
    if torch.autograd._profiler_enabled():
        with torch.profiler.record_function(f"{_FREE}{ptr}"):
            pass


def held(*objs, device: torch.device | str | None = None) -> dict[str, int]:
    """Bytes `objs` hold right now per category, plus "total" (see the module docstring)."""
    out = dict.fromkeys(CATEGORIES, 0)
    for c, n in storages(*objs, device=device).values():
        out[c] += n
    out["total"] = sum(out.values())
    return out


class StepTrace:
    """``with StepTrace(model, opt) as tr: loss = model(x); loss.backward(); tr.mark("backward");
    opt.step()`` then ``tr.result()``: see the module docstring. The trace sees what the step
    allocates and frees, and the walk at its start what was there before; a storage from before
    that the step frees (``opt.zero_grad()`` inside the trace) counts until its free."""

    def __init__(self, *objs, device: torch.device | str = "cpu"):
        self.objs, self.device = objs, torch.device(device)
        self.marks: list[tuple[str, dict[int, tuple[str, int]]]] = []
        self._prof = None
        self._result = None

    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        self._sync()
        walked = _walk(self.objs, self.device)
        self.before = {ptr: (c, st.nbytes()) for ptr, (c, st) in walked.items()}
        # The profiler records no free of memory allocated before it started (the CPU allocator's):
        # a finalizer on each walked storage marks it (opt.zero_grad() inside the trace frees .grad)
        self._finalizers = []
        for ptr, (_, st) in walked.items():
            try:
                self._finalizers.append(weakref.finalize(st, _on_free, ptr))
            except TypeError:  # (a storage without weak references: its free is not seen)
                pass
        del walked
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.allocated0 = torch.cuda.memory_allocated(self.device)
            self.blocks0 = active_blocks(torch.cuda.memory._snapshot(), self.device.index)
        self._prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def mark(self, name: str) -> None:
        """Walk the objects now; the allocations they hold get their categories."""
        self._sync()
        with torch.profiler.record_function(_MARK + name):
            self.marks.append((name, storages(*self.objs, device=self.device)))

    def __exit__(self, *exc):
        self._sync()
        self.after = storages(*self.objs, device=self.device)
        if self.device.type == "cuda":
            self.max_allocated = torch.cuda.max_memory_allocated(self.device)
            self.max_reserved = torch.cuda.max_memory_reserved(self.device)
        self._prof.__exit__(*exc)
        for f in self._finalizers:
            f.detach()
        self._finalizers = []
        if exc[0] is None:
            self._result = self._analyse()
        return False

    def result(self) -> dict:
        """{"peak": bytes, "at_peak": {category: bytes} (STEP_CATEGORIES, plus "other" on a GPU),
        "held": {mark: {category: bytes}} for "start", each mark and "end"; on a GPU also
        "max_allocated" and "reserve"}."""
        if self._result is None:
            raise RuntimeError("StepTrace: result() after a step traced to its end")
        return self._result

    def _events(self):
        allocs, marks, _ = self._all_events()
        return allocs, marks

    def _all_events(self):
        """(allocation events in time order, {mark: time}, [(time, ptr)] of the walked storages freed)."""
        tree = self._prof.profiler.kineto_results.experimental_event_tree()
        allocs, marks, frees, stack = [], {}, [], list(tree)
        while stack:
            e = stack.pop()
            stack.extend(e.children)
            if type(e.extra_fields).__name__ == "_ExtraFields_Allocation":
                if e.extra_fields.device.type == self.device.type:
                    allocs.append(e)
            elif e.name.startswith(_MARK):
                marks[e.name[len(_MARK):]] = e.start_time_ns
            elif e.name.startswith(_FREE):
                frees.append((e.start_time_ns, int(e.name[len(_FREE):])))
        allocs.sort(key=lambda e: e.start_time_ns)
        return allocs, marks, sorted(frees)

    @staticmethod
    def _scope(e) -> str:
        p = e.parent
        while p is not None:
            name = p.name.split(" (")[0]
            if name in _REGIONS:
                return _REGIONS[name]
            if p.name.startswith("Optimizer.step"):
                return "step_temps"
            p = p.parent
        return "activations"

    def _analyse(self) -> dict:
        allocs, mark_times, frees = self._all_events()
        walks = sorted(((mark_times[name], found) for name, found in self.marks if name in mark_times),
                       key=lambda w: w[0])
        walks.append((float("inf"), self.after))
        # The allocator's events and the frees the walked storages' finalizers marked, in time order:
        # (time, allocation event or None, ptr)
        events = sorted([(e.start_time_ns, 0, i, e, e.extra_fields.ptr) for i, e in enumerate(allocs)]
                        + [(t, 1, j, None, ptr) for j, (t, ptr) in enumerate(frees)], key=lambda x: x[:3])
        # First pass: which allocations are the step's, their categories from the walks, the storages
        # from before the step (the start's walk, and what a later walk finds that the step did not
        # allocate) and the event that frees each of those the step frees.
        live: dict[int, tuple[int, object]] = {}  # ptr -> (allocation number, event) of live allocations
        cat: dict[int, str] = {}  # allocation number -> category from a walk
        before = dict(self.before)  # pre-existing storages (a later walk may find more)
        freed: dict[int, int] = {}  # ptr of a pre-existing storage -> the event that freed it
        w = 0

        def take_walk(found):
            for ptr, (c, n) in found.items():
                if ptr in live:
                    cat.setdefault(live[ptr][0], c)
                elif ptr not in before:  # held from before the step, seen only now
                    before[ptr] = (c, n)

        for k, (t, _, i, e, ptr) in enumerate(events):
            while w < len(walks) - 1 and walks[w][0] <= t:
                take_walk(walks[w][1])
                w += 1
            if e is not None and e.extra_fields.alloc_size > 0:
                live[ptr] = (i, e)
            elif e is None or live.pop(ptr, None) is None:
                freed.setdefault(ptr, k)  # (from before the step: walked, or never seen and not counted)
        for found in [wk[1] for wk in walks[w:]]:
            take_walk(found)
        # Second pass: the bytes alive after each event, the pre-existing storages until their free
        # included, and what was alive at the most.
        cur = peak = sum(n for _, n in before.values())
        peak_at, peak_live = -1, {}
        live = {}
        for k, (_, _, i, e, ptr) in enumerate(events):
            if e is not None and e.extra_fields.alloc_size > 0:
                live[ptr] = (i, e)
                cur += e.extra_fields.alloc_size
            elif e is not None and ptr in live:
                del live[ptr]
                cur += e.extra_fields.alloc_size
            elif freed.get(ptr) == k and ptr in before:
                cur -= before[ptr][1]
            if cur > peak:
                peak, peak_at, peak_live = cur, k, dict(live)
        at_peak = dict.fromkeys(STEP_CATEGORIES, 0)
        for ptr, (c, n) in before.items():
            if freed.get(ptr, len(events)) > peak_at:  # (not freed by then)
                at_peak[c] += n
        for i, e in peak_live.values():
            at_peak[cat.get(i) or self._scope(e)] += e.extra_fields.alloc_size
        held = {"start": _by_category(self.before)}
        held.update((name, _by_category(found)) for name, found in self.marks)
        held["end"] = _by_category(self.after)
        out = {"peak": sum(at_peak.values()), "at_peak": at_peak, "held": held}
        if self.device.type == "cuda":
            out["at_peak"]["other"] = max(0, self.allocated0 - sum(n for _, n in before.values()))
            out["other_sites"] = sites(self.blocks0, before)
            out["peak"] += out["at_peak"]["other"]
            out["max_allocated"] = self.max_allocated
            out["reserve"] = self.max_reserved - self.max_allocated
        return out


def activation_peak(model: torch.nn.Module, fn, device: torch.device | str = "cpu") -> dict:
    """What one forward and backward allocate at their peak beyond `model`'s parameters and
    gradients, and how far backward was then: ``fn()`` runs the forward and backward of
    `model`, whose missing gradients are allocated first (zeros; backward adds into them, as
    data parallelism's buckets hold them). Returns {"bytes": the peak (activations, their
    gradients, the temporaries of forward and backward), "grads_done": the fraction of the
    gradient bytes whose accumulation had finished at that moment (0: the peak is at the start
    of backward)}: what pz.zero.estimate_memory takes as ``activation_bytes`` and
    ``grads_done`` (see pyzero/zero/memory.py). The gradients stay allocated."""
    params = [p for p in {id(p): p for p in model.parameters()}.values() if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)

    def done(i):
        def hook(_):
            with torch.profiler.record_function(f"{_MARK}grad{i}"):
                pass
        return hook
    hooks = [p.register_post_accumulate_grad_hook(done(i)) for i, p in enumerate(params)]
    try:
        with StepTrace(model, device=device) as tr:
            fn()
    finally:
        for h in hooks:
            h.remove()
    r = tr.result()
    allocs, marks = tr._events()
    cur = peak = 0
    at = None
    for e in allocs:
        cur += e.extra_fields.alloc_size
        if cur > peak:
            peak, at = cur, e.start_time_ns
    total = sum(p.numel() * p.element_size() for p in params)
    finished = sum(p.numel() * p.element_size() for i, p in enumerate(params)
                   if at is not None and marks.get(f"grad{i}", float("inf")) <= at)
    return {"bytes": r["peak"] - r["held"]["start"]["total"] - r["at_peak"].get("other", 0),
            "grads_done": finished / total if total else 0.0}


def active_blocks(snapshot: dict, device: int | None = None) -> dict[int, tuple[int, list]]:
    """address -> (bytes, frames) of the allocated blocks in a torch.cuda.memory._snapshot() (of
    `device`'s segments when the snapshot says which): the allocations torch.cuda.memory_allocated
    counts, with the stack of each (empty unless torch.cuda.memory._record_memory_history runs)."""
    out = {}
    for seg in snapshot.get("segments", ()):
        if device is not None and seg.get("device", device) != device:
            continue
        for b in seg.get("blocks", ()):
            if b.get("state") == "active_allocated":
                out[b["address"]] = (b["size"], b.get("frames") or [])
    return out


_TORCH_DIR = torch.__file__.rsplit("/", 1)[0] + "/"


def site(frames: list) -> str:
    """Where an allocation was made: its innermost Python frame outside torch's own files
    ("file:line function"; torch's frame when all are torch's), "?" without a recorded stack."""
    py = [f for f in frames if str(f.get("filename", "")).endswith(".py")]
    if not py:
        return "?"
    f = next((f for f in py if not str(f["filename"]).startswith(_TORCH_DIR)), py[0])
    return f"{f['filename']}:{f.get('line', 0)} {f.get('name', '?')}"


def sites(blocks: dict[int, tuple[int, list]], walked, limit: int = 8) -> list[tuple[str, int, int]]:
    """(site, bytes, count) of the `blocks` (active_blocks) no walk reached (their addresses not in
    `walked`: what "other" counts), by where they were allocated, largest first; at most `limit`
    sites, the rest summed as "(N more sites)"."""
    by: dict[str, list[int]] = {}
    for addr, (n, frames) in blocks.items():
        if addr not in walked:
            e = by.setdefault(site(frames), [0, 0])
            e[0] += n
            e[1] += 1
    rows = sorted(((s, n, c) for s, (n, c) in by.items()), key=lambda r: (-r[1], r[0]))
    if len(rows) > limit:
        rest = rows[limit - 1:]
        rows = rows[:limit - 1] + [(f"({len(rest)} more sites)", sum(r[1] for r in rest), sum(r[2] for r in rest))]
    return rows


def _by_category(found: dict[int, tuple[str, int]]) -> dict[str, int]:
    out = dict.fromkeys(CATEGORIES, 0)
    for c, n in found.values():
        out[c] += n
    out["total"] = sum(out.values())
    return out


def format_table(rows: list[tuple[str, dict]], unit: float = 2**20) -> str:
    """The breakdown at the peak of each (run name, StepTrace result) as a text table (MiB)."""
    cols = list(STEP_CATEGORIES)
    if any("other" in r["at_peak"] for _, r in rows):
        cols.append("other")
    extra = any("max_allocated" in r for _, r in rows)
    head = f"{'run':>16} {'peak':>9} " + " ".join(f"{c:>11}" for c in cols)
    if extra:
        head += f" {'max_alloc':>10} {'reserve':>9}"
    lines = [head]
    for name, r in rows:
        line = f"{name:>16} {r['peak'] / unit:9.2f} " + " ".join(f"{r['at_peak'].get(c, 0) / unit:11.2f}" for c in cols)
        if extra:
            line += f" {r.get('max_allocated', 0) / unit:10.2f} {r.get('reserve', 0) / unit:9.2f}"
        lines.append(line)
    return "\n".join(lines)
