"""One training step under torch.profiler, for ``pyzero-bench train --profile DIR``: a Chrome trace to
read in Perfetto or chrome://tracing, and a summary of where the time went.

On a GPU the summary says how long the device computed during the step (the union of its kernels,
copies and memsets), how long it waited (the rest of the step: for the host to launch, for a
synchronisation), and the longest of those waits with the device work on either side of each; on
both, the host operators that took the most time of their own. Two runs that differ by a millisecond
per step (DataParallel against DDP) differ there: in the device's waits, or in the host work before
them.
"""
from __future__ import annotations

import torch


def merge(intervals) -> list[tuple[float, float]]:
    """Overlapping or touching [start, end) intervals joined, in order."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def device_timeline(work, start: float, end: float, top: int = 5, min_gap: float = 20.0) -> dict:
    """``work``: (start, end, name) of the device's work during a step that ran from `start` to `end`
    (one clock, microseconds; work outside the step is cut off). Returns busy_us (their union),
    idle_us (the rest of the step), gaps (the number of idle stretches of at least `min_gap` us)
    and longest: the `top` longest idle stretches, longest first, as (us, name of the work before
    it or "(step start)", name of the work after it or "(step end)")."""
    if end < start:
        raise ValueError(f"end: expected >= start ({start}), got {end}")
    items = sorted((max(float(s), start), min(float(e), end), name) for s, e, name in work
                   if float(e) > start and float(s) < end)
    busy = merge((s, e) for s, e, _ in items)
    busy_us = sum(e - s for s, e in busy)
    stretches, t, before, k = [], start, "(step start)", 0
    for s, e in busy:  # (items[k] is the first piece of work of this busy stretch: one pass over them)
        if s > t:
            stretches.append((s - t, before, items[k][2]))
        last = items[k]
        while k < len(items) and items[k][0] <= e:
            if items[k][1] > last[1]:
                last = items[k]
            k += 1
        before, t = last[2], e
    if end > t:
        stretches.append((end - t, before, "(step end)"))
    stretches.sort(key=lambda g: -g[0])
    return {"step_us": end - start, "busy_us": busy_us, "idle_us": end - start - busy_us,
            "gaps": sum(g[0] >= min_gap for g in stretches), "longest": stretches[:top]}


_SCOPE = "pyzero.bench.step"


def profile_step(step, cuda: bool, path: str | None, top: int = 8) -> dict:
    """Run ``step()`` once under torch.profiler (host operators; device work too when `cuda`) and
    summarise it: wall_ms, the host operators with the most self time (name, calls, self ms) and,
    on a GPU, device_timeline() of its kernels. Writes the Chrome trace to `path` when given."""
    from torch.profiler import ProfilerActivity, profile, record_function  # noqa: PLC0415

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        with record_function(_SCOPE):
            step()
    if path is not None:
        prof.export_chrome_trace(path)
    events = prof.events()
    scope = next(e for e in events if e.name == _SCOPE and e.device_type == torch.autograd.DeviceType.CPU)
    start, end = scope.time_range.start, scope.time_range.end
    ops = sorted((a for a in prof.key_averages() if a.key != _SCOPE and a.self_cpu_time_total > 0),
                 key=lambda a: -a.self_cpu_time_total)[:top]
    out = {"wall_ms": (end - start) / 1e3,
           "host_ops": [(a.key, a.count, a.self_cpu_time_total / 1e3) for a in ops]}
    if cuda:
        out["device"] = device_timeline(device_work(events), start, end)
    return out


_WORK = ("kernel", "gpu_memcpy", "gpu_memset")


def device_work(events) -> list[tuple[float, float, str]]:
    """(start, end, name) of the device's kernels, copies and memsets among profiler events. A
    record_function scope also shows on the device's timeline, spanning the work inside it: left out
    (by its activity type where torch's events have one; else as a user annotation, or by the name of
    one of the host's scopes)."""
    cuda = torch.autograd.DeviceType.CUDA
    scopes = {e.name for e in events if e.device_type != cuda and getattr(e, "is_user_annotation", False)}
    out = []
    for e in events:
        if e.device_type != cuda:
            continue
        kind = getattr(e, "activity_type", None)
        if kind is not None:
            if kind not in _WORK:
                continue
        elif getattr(e, "is_user_annotation", False) or e.name in scopes:
            continue
        out.append((e.time_range.start, e.time_range.end, e.name))
    return out


def format_profiles(results: list[dict]) -> str:
    """The runs' profile summaries (rank 0's), one block per run."""
    lines = ["\n# profile: one synced step per run on rank 0 under torch.profiler (its own cost included)"]
    for res in results:
        p = res.get("profile")
        if p is None:
            continue
        head = f"{res['run']:>16} {p['wall_ms']:9.2f} ms"
        d = p.get("device")
        if d is not None:
            head += (f", device busy {d['busy_us'] / 1e3:.2f} ms, waiting {d['idle_us'] / 1e3:.2f} ms "
                     f"({d['gaps']} waits >= 20 us); longest: "
                     + "; ".join(f"{us:.0f} us {a[:40]} -> {b[:40]}" for us, a, b in d["longest"][:3]))
        lines.append(head)
        lines.append(" " * 17 + "host self ms: " + ", ".join(f"{name[:48]} {ms:.2f} ({n})"
                                                           for name, n, ms in p["host_ops"]))
    return "\n".join(lines)
