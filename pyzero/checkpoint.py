"""Sharded checkpoints of a model and its ZeroOptimizer: atomic, reshardable.

Layout of a checkpoint directory::

    DIR/latest                  name of the newest complete step directory
    DIR/step_00000042/meta.json world size, stage, parameters (names, shapes), aliases, step
    DIR/step_00000042/rank00003.pt  that rank's pieces: (name, start, end), fp32 master values,
                                    optimizer state sliced the same way
    DIR/step_00000042/extra.pt  buffers and frozen parameters (from the first rank)
    DIR/step_00000042/app.pt    the caller's ``app_state`` (LR scheduler, data position, ...; first rank)

meta.json also holds the param groups' hyperparameters and the fp16 loss scaler's state.

Each rank writes only what it owns, so a save moves no data between ranks.
The size and CRC-32 of every file, taken from the bytes as they are written,
are recorded in meta.json; `load` checks them (each rank a share of the
files) before it changes anything, so a truncated or corrupted file is a
:class:`CheckpointCorrupt` error naming it on every rank, never silently wrong
weights. ``load(..., fallback=True)`` then uses the newest older complete
checkpoint instead, and says which. A save that fails on any rank (a full
disk, a read-only directory) raises on every rank and leaves `latest` as it
was.
Everything is written into a hidden temporary directory, fsynced, and renamed
into place by the first rank once every rank has finished; `latest` is
replaced the same way. A crash at any point leaves the previous checkpoint
complete and `latest` pointing at it.

Pieces name elements of parameters, not positions in a flat buffer, so
`load` can restore onto any world size (and any stage): a rank reads the
pieces of every old rank that overlap its new ones.
"""
from __future__ import annotations

import argparse
import io
import json
import math
import os
import pickle
import re
import shutil
import time
import warnings
import zlib

import torch

from . import comm
from .zero import ZeroOptimizer, model_state
from .checks import digest, is_int

FORMAT = 2  # 2: meta.json["files"] holds {file: {"bytes", "crc32"}}; format 1 (no checksums) still loads
MAX_STEP = 1 << 62  # the largest step number save writes and load reads


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved or loaded; the message says which file or rank and why."""


class CheckpointCorrupt(CheckpointError):
    """A checkpoint file is missing, truncated or does not match its recorded checksum."""


class _Summing:
    """A write-only file that keeps the size and CRC-32 of what passes through it, and the OSError a
    write raised (torch.save reports a failed write as "unexpected pos ...", without its cause)."""

    def __init__(self, f):
        self.f, self.nbytes, self.crc, self.error = f, 0, 0, None

    def write(self, b):
        self.crc = zlib.crc32(b, self.crc)
        self.nbytes += memoryview(b).nbytes
        try:
            return self.f.write(b)
        except OSError as e:
            self.error = e
            raise

    def flush(self):
        self.f.flush()


def _file_sum(path: str) -> dict:
    crc, n = 0, 0
    with open(path, "rb") as f:
        while chunk := f.read(16 << 20):
            crc = zlib.crc32(chunk, crc)
            n += len(chunk)
    return {"bytes": n, "crc32": crc}


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj, path):
    """torch.save `obj` (or write `obj`'s bytes, already serialised) to `path` (fsynced) and its size
    and CRC-32 to `path`.sum."""
    with open(path, "wb") as f:
        w = _Summing(f)
        try:
            if isinstance(obj, bytes):
                w.write(obj)
            else:
                torch.save(obj, w)
        except Exception as e:
            if w.error is not None:  # the cause (a full disk, ...) rather than torch's "unexpected pos"
                raise w.error from e
            raise
        f.flush()
        os.fsync(f.fileno())
    with open(path + ".sum", "w") as f:
        json.dump({"bytes": w.nbytes, "crc32": w.crc}, f)
        f.flush()
        os.fsync(f.fileno())


def _model_meta(model, opt):
    names = dict(zip(map(id, opt.params), opt.names))
    aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in names}
    return {"params": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", ""),
                        "group": opt._group_of[id(p)]} for n, p in zip(opt.names, opt.params)],
            "aliases": aliases}


def _extra_state(module, opt) -> dict:
    """What a checkpoint holds of `module` beside the optimizer's shards: its state dict's buffers and frozen
    parameters, by their names in it (saved from the module the ZeroOptimizer trains, so that a wrapper
    around it at save or at load names them alike)."""
    trainable = {id(p) for p in opt.params}
    return {k: v for k, v in model_state(module).items() if id(v) not in trainable}


def _check_extra(extra: dict, model, opt, step_dir) -> torch.nn.Module:
    """The module the saved buffers and frozen parameters load into (the optimizer's model; a checkpoint
    from before they were saved by its names: the module given to load), checked to take every one of
    them at its shape before anything is loaded; a ValueError naming the difference otherwise."""
    target, want = opt.model, _extra_state(opt.model, opt)
    if set(extra) != set(want):
        alt = _extra_state(model, opt)
        if set(extra) == set(alt):
            target, want = model, alt
    if set(extra) != set(want):
        only_saved, only_here = sorted(set(extra) - set(want))[:4], sorted(set(want) - set(extra))[:4]
        raise ValueError(f"checkpoint {step_dir!r} is for a different model (its buffers and frozen parameters "
                         f"differ: saved only {only_saved}, here only {only_here}); nothing was loaded")
    shapes = [(k, tuple(extra[k].shape), tuple(want[k].shape)) for k in want
              if torch.is_tensor(extra[k]) and tuple(extra[k].shape) != tuple(want[k].shape)]
    if shapes:
        k, saved, here = shapes[0]
        raise ValueError(f"checkpoint {step_dir!r} is for a different model ({k!r} is {saved} there, {here} here); "
                         "nothing was loaded")
    return target


def _check_pair(model, opt) -> None:
    """`opt` a ZeroOptimizer and `model` the module it trains (or one holding it): its buffers and
    frozen parameters are saved and loaded beside the optimizer's shards."""
    if not isinstance(opt, ZeroOptimizer):
        raise TypeError(f"opt: expected a pz.ZeroOptimizer (checkpoints hold its shards), got {type(opt).__name__}")
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    held = {id(p) for p in model.parameters()}
    if not all(id(p) in held for p in opt.params):
        raise ValueError("model: it does not hold the parameters the optimizer trains; expected the model given to "
                         "the ZeroOptimizer (or a module holding it)")


def save(path: str | os.PathLike, model, opt, step: int, keep: int = 3, app_state: dict | None = None,
         optimizer_state: bool = True) -> str:
    """Write this rank's shard of `model`/`opt` at `step`; every rank of opt's group calls it. ``keep``:
    how many checkpoints stay, this one and those saved last before it (in the order of saving, not
    of step numbers: a run that went back to an earlier step keeps what it saves since).

    ``optimizer_state=False`` leaves the inner optimizer's state (Adam's moments: two thirds of an
    AdamW checkpoint) out: the fp32 weights, hyperparameters and app_state are saved; ``load`` then
    restores the weights and starts the optimizer afresh, with a warning (a Trainer's save_only_model).

    ``app_state``: more of the training state to keep in the same atomic step, as
    ``{name: value}``; a value with ``state_dict()`` (an LR scheduler, torch.amp.GradScaler, a
    stateful data loader) is saved as its state dict, any other value as it is (a data position,
    an RNG state tensor). Saved from the first rank (values every rank shares), in what
    ``torch.load(weights_only=True)`` reads back: tensors, numbers, strings, lists, tuples, dicts.
    If writing fails on any rank (a full disk, a read-only directory, an app_state value that
    cannot be saved, a param-group setting meta.json cannot keep: anything but numbers, strings,
    booleans, None, small tensors, lists or tuples of numbers), every rank raises CheckpointError
    naming the rank and its error, and `latest` still names the previous step.
    """
    path = _path(path, "save")
    if not is_int(step) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    if step > MAX_STEP:
        raise ValueError(f"step: expected at most 2**62 (the largest step load reads back), got {step!r}")
    if not is_int(keep) or keep < 1:
        raise ValueError(f"keep: expected an int >= 1, got {keep!r}")
    if not isinstance(optimizer_state, bool):
        raise TypeError(f"optimizer_state: expected True or False, got {optimizer_state!r}")
    _check_app_state(app_state, "save")
    _check_pair(model, opt)
    g, first = opt.group, opt.group.rank == 0
    name = f"step_{step:08d}"
    final, tmp = os.path.join(path, name), os.path.join(path, f".tmp_{name}")

    claimed = False  # (refused by _claim: the temporary directory is another group's, left alone)

    def agree(stage: str, error):
        failed = comm.failed_ranks(error, g)
        if failed:
            if first and claimed:
                shutil.rmtree(tmp, ignore_errors=True)
            why = "; ".join(f"rank {r}: {msg}" for r, msg in failed)
            raise CheckpointError(f"checkpoint.save({path!r}, step={step}) failed while {stage} ({why}); "
                                  f"nothing was saved, 'latest' is unchanged") from error

    agree("checking the param groups", _groups_problem(opt))
    error = None
    if first:
        try:
            _claim(path, name, g)
            claimed = True
            os.makedirs(path, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
            os.makedirs(tmp)
        except (OSError, ValueError) as e:  # (ValueError: _claim's refusal)
            error = e
    agree("creating the directory", error)
    shard = opt.shard_state()  # waits for reductions in flight: the shards hold still while read
    if not optimizer_state:
        shard["state"] = [{} for _ in shard["state"]]  # (as a piece never stepped: load leaves it fresh)
    error = None
    try:
        _save_file(shard, os.path.join(tmp, f"rank{opt.rank:05d}.pt"))
        if first:
            extra = {k: v.detach().clone() for k, v in _extra_state(opt.model, opt).items()}
            _save_file(extra, os.path.join(tmp, "extra.pt"))
            if app_state:
                _save_file(_app_state_bytes(app_state), os.path.join(tmp, "app.pt"))
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = e
    agree("writing the shards", error)
    error = None
    if first:
        try:
            _publish(path, tmp, final, name, step, keep, model, opt, sorted(app_state or ()), optimizer_state)
        except Exception as e:  # noqa: BLE001
            error = e
    agree("publishing", error)
    return final


def _claim(path: str, name: str, g) -> None:
    """The first rank of a group smaller than the job, before it writes step `name` into `path`: a
    ValueError if another group of the job saves that step there too (tensor parallelism's data-parallel
    groups, pipeline stages). Each group names its files by rank within it (rank00000.pt, ...), so the
    groups' files would overwrite each other and one group's parameters be lost."""
    if not comm.is_initialized() or g.size >= comm.get_world_size():
        return
    mine = ",".join(str(r) for r in g.ranks)
    got = comm.get_store().compare_set(f"pyzero/checkpoint/{os.path.abspath(path)}/{name}", "", mine)
    got = got.decode() if isinstance(got, bytes) else str(got)
    if got != mine:
        raise ValueError(f"path: the group of global ranks [{got}] saves {name} into {path!r} too, and each group's "
                         "files are named by rank within it, so one group's shards would replace the other's; "
                         "give each group its own path (e.g. one per tensor-parallel rank or pipeline stage: "
                         "f'{path}/tp{tp_rank}')")


def _tp_of(opt) -> list[int] | None:
    """[rank, size] in the ZeroOptimizer's tensor-parallel group (None without one): a checkpoint holds one
    tensor-parallel rank's slices of the TP layers."""
    tp = opt.tp_group
    return None if tp is None or tp.size == 1 else [tp.rank, tp.size]


def _path(path, op: str) -> str:
    """`path` as a str (an os.PathLike, e.g. pathlib.Path, is taken); a TypeError naming it for anything else."""
    if not isinstance(path, (str, os.PathLike)):
        raise TypeError(f"{op}: path: expected a directory path (str or os.PathLike), got {type(path).__name__}")
    path = os.fspath(path)
    if not isinstance(path, str):
        raise TypeError(f"{op}: path: expected a str path, got {type(path).__name__}")
    return path


def _check_app_state(app_state, op: str) -> None:
    if app_state is not None and not (isinstance(app_state, dict) and all(type(k) is str for k in app_state)):
        raise TypeError(f"{op}: app_state: expected None or a dict with str keys, got {type(app_state).__name__}")


def _app_state_bytes(app_state: dict) -> bytes:
    """{name: what is saved} serialised once, checked to load back with torch.load(weights_only=True);
    a value that does not is named (found, on that path only, by trying each)."""
    values = {k: v.state_dict() if callable(getattr(v, "state_dict", None)) else v for k, v in app_state.items()}
    buf = io.BytesIO()
    torch.save(values, buf)
    try:
        torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    except Exception:  # noqa: BLE001 - the unpickler's refusal: name the value
        for k, v in values.items():
            one = io.BytesIO()
            torch.save(v, one)
            one.seek(0)
            try:
                torch.load(one, weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"app_state[{k!r}]: {type(v).__name__} does not load back with torch.load("
                                 f"weights_only=True) ({type(e).__name__}: {str(e).splitlines()[0][:200]}); keep "
                                 "it to tensors, numbers, strings, lists, tuples and dicts") from e
        raise
    return buf.getvalue()


def _publish(path, tmp, final, name, step, keep, model, opt, app_keys, optimizer_state=True):
    """First rank: meta.json (with every file's checksum), then the renames that make the step `latest`."""
    files = {}
    for f in sorted(os.listdir(tmp)):
        if f.endswith(".pt.sum"):
            with open(os.path.join(tmp, f)) as fh:
                files[f[:-4]] = json.load(fh)
            os.unlink(os.path.join(tmp, f))
    missing = [f"rank{r:05d}.pt" for r in range(opt.world) if f"rank{r:05d}.pt" not in files]
    if missing:
        raise OSError(f"shard files {missing} are missing from {tmp!r}")
    meta = {"format": FORMAT, "step": step, "world": opt.world, "stage": opt.stage,
            "optimizer": type(opt.inner).__name__,
            "param_groups": [{k: _setting(v) for k, v in grp.items() if k != "params"} for grp in opt.param_groups],
            "param_group_forms": [{k: f for k, v in grp.items() if k != "params" and (f := _form(v)) is not None}
                                  for grp in opt.param_groups]}
    meta.update(_model_meta(model, opt))
    if opt.scaler is not None:
        meta["scaler"] = opt.scaler.state_dict()
    tp = _tp_of(opt)
    if tp is not None:
        meta["tp"] = tp
    if app_keys:
        meta["app_state"] = app_keys
    if not optimizer_state:  # (absent: saved with it, as every checkpoint before this field)
        meta["optimizer_state"] = False
    meta["files"] = files
    meta["saved_ns"] = time.time_ns()  # (the order of saves, for keep=)
    with open(os.path.join(tmp, "meta.json"), "w") as f:
        json.dump(meta, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    old = os.path.join(path, f".old_{name}")
    if os.path.exists(final):  # saving a step again: set the old copy aside until `latest` is updated
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(tmp, final)
    with open(os.path.join(path, "latest.tmp"), "w") as f:
        f.write(name)
        f.flush()
        os.fsync(f.fileno())
    os.replace(os.path.join(path, "latest.tmp"), os.path.join(path, "latest"))
    _fsync_dir(path)
    entries = os.listdir(path)
    # keep: this one and the keep - 1 saved last before it, in the order they were saved (after a run went
    # back to an earlier step, the steps it saves since stay, and the abandoned run's later numbers go first)
    others = sorted((d for d in entries if d.startswith("step_") and d != name), key=lambda d: _saved_at(path, d))
    stale = [d for d in entries if d.startswith((".tmp_step_", ".old_step_"))]  # crashed or replaced saves
    for d in others[:max(0, len(others) - (keep - 1))] + stale:
        shutil.rmtree(os.path.join(path, d), ignore_errors=True)


def _saved_at(path: str, d: str) -> tuple:
    """When checkpoint `d` was saved (meta.json's saved_ns; before that field, the file's time; a damaged
    one first), then its step number."""
    meta = os.path.join(path, d, "meta.json")
    try:
        with open(meta) as f:
            t = int(json.load(f)["saved_ns"])
    except (OSError, ValueError, KeyError, TypeError):
        try:
            t = os.stat(meta).st_mtime_ns
        except OSError:
            t = -1
    digits = d[len("step_"):]
    return t, int(digits) if digits.isdigit() else -1


def _setting(v):
    """A param group's hyperparameter as JSON holds it: tensors (a tensor lr, betas) as numbers."""
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else v.tolist()
    if isinstance(v, (tuple, list)):
        return [_setting(x) for x in v]
    return v


def _groups_problem(opt) -> ValueError | None:
    """A ValueError naming the first param-group setting meta.json cannot keep (it holds numbers, strings,
    booleans, None, and lists of numbers: _is_setting), else None."""
    for i, grp in enumerate(opt.param_groups):
        for k, v in grp.items():
            if k == "params":
                continue
            try:
                kept = _is_setting(json.loads(json.dumps(_setting(v))))
            except (TypeError, ValueError, RuntimeError):
                kept = False
            if not kept:
                return ValueError(f"opt.param_groups[{i}][{k!r}]: a checkpoint keeps a param group's settings as "
                                  "numbers, strings, booleans, None, tensors of one number or 1-D ones of up to "
                                  "64, and lists or tuples of up to 64 numbers, got "
                                  f"{type(v).__name__} {repr(v)[:60]}; keep such a value out of the param groups "
                                  "(app_state= saves more state)")
    return None


def _form(v):
    """How a param group's setting `v` differs from what meta.json holds of it (_setting), for a load that
    restores it into a group without it: None where it is that value, else {"tensor": dtype, "shape": [...]} or
    {"tuple" or "list": [each element's form]}."""
    if torch.is_tensor(v):
        return {"tensor": str(v.dtype).removeprefix("torch."), "shape": list(v.shape)}
    if isinstance(v, (tuple, list)):
        forms = [_form(x) for x in v]
        if isinstance(v, tuple) or any(f is not None for f in forms):
            return {"tuple" if isinstance(v, tuple) else "list": forms}
    return None


def _form_ok(form, depth=0) -> bool:
    """Whether `form` (meta.json's) is one _form writes."""
    if form is None:
        return True
    if type(form) is not dict or depth > 1:
        return False
    if set(form) == {"tensor", "shape"}:
        return type(form["tensor"]) is str and type(form["shape"]) is list and len(form["shape"]) <= 64 and all(
            _is_count(d) for d in form["shape"])
    kind, forms = next(iter(form.items())) if len(form) == 1 else (None, None)
    return kind in ("tuple", "list") and type(forms) is list and len(forms) <= 64 and all(
        _form_ok(f, depth + 1) for f in forms)


def _rebuilt(saved, form):
    """A saved setting (meta.json's) in its `form` (_form's): a tensor on the CPU, a tuple, or as saved; a
    ValueError where they do not fit."""
    if form is None:
        return saved
    if "tensor" in form:
        dtype = getattr(torch, form["tensor"], None)
        if not isinstance(dtype, torch.dtype) or not (type(saved) in (bool, int, float) or type(saved) is list):
            raise ValueError(f"{saved!r} is not a {form['tensor']} tensor's values")
        t = torch.tensor(saved, dtype=dtype)
        if t.numel() != math.prod(form["shape"]):
            raise ValueError(f"{saved!r} does not fill a tensor of shape {form['shape']}")
        return t.reshape(form["shape"])
    kind, forms = next(iter(form.items()))
    if type(saved) is not list or len(saved) != len(forms):
        raise ValueError(f"{saved!r} is not a {kind} of {len(forms)}")
    items = [_rebuilt(x, f) for x, f in zip(saved, forms)]
    return tuple(items) if kind == "tuple" else items


def _restored(current, saved):
    """A saved hyperparameter in the form the optimizer holds it now (a tensor, a tuple)."""
    if torch.is_tensor(current) and type(saved) in (int, float):
        return torch.as_tensor(saved, dtype=current.dtype, device=current.device)
    if isinstance(current, tuple) and type(saved) is list and len(saved) == len(current):
        return tuple(_restored(c, x) for c, x in zip(current, saved))
    return saved


_STEP_NAME = re.compile(r"step_[0-9]+")


def _step_of(d: str) -> int:
    """The step number of step directory `d` (step_00000042, .old_step_00000042); a ValueError for another name."""
    tail = d.rsplit("_", 1)[-1]
    if "_" not in d or not tail.isdigit():
        raise ValueError(f"{d!r} is not a step directory")
    return int(tail)


def _complete(path: str) -> list[str]:
    """Step directories of `path` (and set-aside copies) that hold a meta.json."""
    if not os.path.isdir(path):
        return []
    return [d for d in os.listdir(path) if d.startswith(("step_", ".old_step_")) and d.rsplit("_", 1)[1].isdigit()
            and os.path.exists(os.path.join(path, d, "meta.json"))]


def _resolve(path: str) -> str:
    """DIR (its latest step) or a step directory -> the step directory.

    If the step `latest` names is missing but its set-aside copy is complete (a save of the same
    step again died between its two renames), that copy. A named step without its meta.json is
    returned as it is: reading it is a CheckpointCorrupt (load's fallback=True goes on to older
    ones), never a silent load of an older step. Without `latest`, the newest complete step.
    """
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.exists(latest):
        try:
            with open(latest) as f:
                name = f.read().strip()
        except (OSError, ValueError) as e:
            raise CheckpointCorrupt(f"checkpoint file {latest!r} is unreadable ({type(e).__name__}: {e}); "
                                    "nothing was loaded") from e
        if not _STEP_NAME.fullmatch(name):
            raise CheckpointCorrupt(f"checkpoint file {latest!r} is damaged: it names {name[:60]!r}, not a step "
                                    f"directory of {path!r} (step_<number>); nothing was loaded")
        step_dir, aside = os.path.join(path, name), os.path.join(path, f".old_{name}")
        if not os.path.exists(os.path.join(step_dir, "meta.json")) and os.path.exists(os.path.join(aside, "meta.json")):
            return aside
        return step_dir
    complete = _complete(path)
    if not complete:
        raise FileNotFoundError(f"path: {path!r} holds no checkpoint (no 'latest' file or meta.json)")
    return os.path.join(path, max(complete, key=_step_of))


def _candidates(path: str, fallback: bool = False) -> tuple[list[str], list[str]]:
    """The step directory `load` picks, then the older complete ones beside it, newest first; and what was
    found damaged on the way (with fallback=True: a `latest` naming no step directory, then every complete
    step is a candidate)."""
    try:
        first = _resolve(path)
    except CheckpointCorrupt as e:
        complete = _complete(path)
        if not fallback or not complete:
            raise
        return _newest_first(path, complete, None), [str(e)]
    parent = os.path.dirname(os.path.normpath(first))
    try:
        step = _step_of(os.path.basename(os.path.normpath(first)))
    except ValueError:
        return [first], []
    return [first] + _newest_first(parent, _complete(parent), step), []


def _newest_first(parent: str, complete: list[str], below: int | None) -> list[str]:
    """The complete step directories of `parent` (below step `below`), newest first, one per step (step_k before
    a set-aside .old_step_k)."""
    older = sorted((d for d in complete if below is None or _step_of(d) < below), key=_step_of, reverse=True)
    seen, out = set(), []
    for d in older:
        if _step_of(d) not in seen:
            seen.add(_step_of(d))
            out.append(os.path.join(parent, d))
    return out


def _read_meta(step_dir: str) -> dict:
    meta_path = os.path.join(step_dir, "meta.json")
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except FileNotFoundError as e:
        raise CheckpointCorrupt(f"checkpoint file {meta_path!r} is missing (the step directory 'latest' names "
                                "is incomplete or was removed); nothing was loaded") from e
    except (OSError, ValueError, RecursionError) as e:
        raise CheckpointCorrupt(f"checkpoint file {meta_path!r} is unreadable ({type(e).__name__}: {e}); "
                                "nothing was loaded") from e
    bad = _meta_problem(meta)
    if bad:
        raise CheckpointCorrupt(f"checkpoint file {meta_path!r} is not a pyzero checkpoint's meta.json ({bad}); "
                                "nothing was loaded")
    return meta


def _is_count(v, hi=MAX_STEP) -> bool:
    return type(v) is int and 0 <= v <= hi


def _is_setting(v) -> bool:
    """A param group's saved hyperparameter: a JSON scalar or a list of numbers (betas)."""
    return v is None or type(v) in (bool, int, float, str) or (
        type(v) is list and len(v) <= 64 and all(type(x) in (int, float) for x in v))


def _meta_problem(meta) -> str | None:
    """What is wrong with a meta.json's fields (every field used is checked before use), or None."""
    if type(meta) is not dict:
        return f"expected a JSON object, got a {type(meta).__name__}"
    checks = [
        ("format", lambda v: type(v) is int and 1 <= v <= FORMAT, f"an integer in [1, {FORMAT}]"),
        ("step", _is_count, "an integer >= 0"),
        ("world", lambda v: _is_count(v, 1 << 20) and v >= 1, "an integer in [1, 2**20]"),
        ("optimizer", lambda v: type(v) is str, "the optimizer's class name"),
        ("param_groups", lambda v: type(v) is list and all(
            type(g) is dict and all(type(k) is str and _is_setting(x) for k, x in g.items()) for g in v),
         "a list of {name: number, string, boolean, null or list of numbers}"),
        ("params", lambda v: type(v) is list and all(
            type(p) is dict and type(p.get("name")) is str and type(p.get("dtype")) is str
            and type(p.get("shape")) is list and len(p["shape"]) <= 64 and all(_is_count(d) for d in p["shape"])
            for p in v), "a list of {name, shape, dtype}"),
    ]
    for key, ok, what in checks:
        if key not in meta:
            return f"no {key!r}"
        if not ok(meta[key]):
            return f"{key!r}: expected {what}, got {repr(meta[key])[:60]}"
    names = {p["name"] for p in meta["params"]}
    aliases = meta.get("aliases", {})
    if type(aliases) is not dict or not all(type(k) is str and v in names for k, v in aliases.items()):
        return "'aliases': expected {alias: the name of a saved parameter}"
    scaler = meta.get("scaler")
    if scaler is not None and not (type(scaler) is dict and type(scaler.get("scale")) in (int, float)
                                   and math.isfinite(scaler["scale"]) and scaler["scale"] > 0
                                   and _is_count(scaler.get("good_steps")) and _is_count(scaler.get("skipped"))):
        return "'scaler': expected {scale: a positive number, good_steps, skipped: integers >= 0}"
    forms = meta.get("param_group_forms")
    if forms is not None and not (type(forms) is list and len(forms) == len(meta["param_groups"]) and all(
            type(f) is dict and all(type(k) is str and _form_ok(x) for k, x in f.items()) for f in forms)):
        return "'param_group_forms': expected one {name: form} per param group"
    app = meta.get("app_state")
    if app is not None and not (type(app) is list and all(type(k) is str for k in app)):
        return "'app_state': expected a list of names"
    if type(meta.get("optimizer_state", True)) is not bool:
        return "'optimizer_state': expected true or false"
    tp = meta.get("tp")
    if tp is not None and not (type(tp) is list and len(tp) == 2 and all(_is_count(x, 1 << 20) for x in tp)
                               and tp[0] < tp[1]):
        return "'tp': expected [tensor-parallel rank, size]"
    files = meta.get("files")
    if files is not None and (type(files) is not dict or not all(
            type(k) is str and type(v) is dict and _is_count(v.get("bytes")) and _is_count(v.get("crc32"), 1 << 32)
            for k, v in files.items())):
        return "'files': expected {file name: {bytes, crc32}}"
    return None


def _data_files(meta: dict) -> list[str]:
    return [f"rank{r:05d}.pt" for r in range(meta["world"])] + ["extra.pt"] + (
        ["app.pt"] if meta.get("app_state") else [])


PROBLEMS = {1: "is missing", 2: "has the wrong size (truncated?)", 3: "does not match its CRC-32 (corrupted)",
            4: "has no recorded checksum"}


def _check_file(step_dir: str, name: str, want: dict | None) -> int:
    """0 if file `name` matches its recorded size and CRC-32, else a PROBLEMS code."""
    if want is None:
        return 4
    full = os.path.join(step_dir, name)
    if not os.path.isfile(full):
        return 1
    if os.path.getsize(full) != want["bytes"]:
        return 2
    return 0 if _file_sum(full)["crc32"] == want["crc32"] else 3


def _verify(step_dir: str, meta: dict, group=None) -> None:
    """Check every data file against meta.json (each rank of `group` a share); CheckpointCorrupt naming
    the bad files on every rank. Checkpoints of format 1 have no checksums: a warning says so."""
    names = _data_files(meta)
    if "files" not in meta:
        warnings.warn(f"checkpoint {step_dir!r} has no checksums (saved by an older pyzero): loaded without "
                      "verification", stacklevel=3)
        return
    n, me = (1, 0) if group is None else (group.size, group.rank)
    codes = torch.zeros(len(names), device="cpu" if group is None else group.tensor_device)
    for i in range(me, len(names), n):
        codes[i] = _check_file(step_dir, names[i], meta["files"].get(names[i]))
    if n > 1:
        comm.all_reduce(codes, group=group)
    bad = [(names[i], int(c)) for i, c in enumerate(codes.tolist()) if c]
    if bad:
        what = "; ".join(f"{os.path.join(step_dir, f)!r} {PROBLEMS[c]}" for f, c in bad)
        raise CheckpointCorrupt(f"checkpoint {step_dir!r} is damaged: {what}; nothing was loaded")


def _torch_load(path: str, **kw):
    try:
        return torch.load(path, map_location="cpu", weights_only=True, **kw)
    except FileNotFoundError as e:
        raise CheckpointCorrupt(f"checkpoint file {path!r} is missing; nothing was loaded") from e
    except (RuntimeError, OSError, EOFError, ValueError, pickle.UnpicklingError) as e:
        raise CheckpointCorrupt(f"checkpoint file {path!r} is unreadable ({type(e).__name__}: {e}); "
                                "nothing was loaded") from e


def _read(step_dir, meta):
    shards = [_torch_load(os.path.join(step_dir, f"rank{r:05d}.pt"), mmap=True) for r in range(meta["world"])]
    return shards


def _gather(shards, name, start, end, take):
    """Concatenate elements [start, end) of parameter `name` from the old pieces (take(shard, i) -> tensor)."""
    parts = []
    for sh in shards:
        for i, (n, a, b) in enumerate(sh["pieces"]):
            if n == name and a < end and start < b:
                lo, hi = max(a, start), min(b, end)
                parts.append((lo, take(sh, i)[lo - a:hi - a]))
    parts.sort(key=lambda t: t[0])
    out = torch.cat([t for _, t in parts]) if parts else torch.zeros(0)
    if out.numel() != end - start:
        raise ValueError(f"checkpoint: elements {start}:{end} of {name!r} are missing (incomplete checkpoint)")
    return out


def load(path: str | os.PathLike, model, opt, fallback: bool = False, app_state: dict | None = None) -> int:
    """Restore `model`/`opt` from the newest checkpoint in `path` (any world size, any stage); returns its step.

    Every file is checked against its recorded size and CRC-32 first: a damaged checkpoint raises
    CheckpointCorrupt naming the file, on every rank, and changes nothing. With ``fallback=True`` the
    newest older complete checkpoint in `path` is loaded instead, with a warning naming both.
    The param groups' hyperparameters (lr, weight decay, ...) and the fp16 loss scaler's state are
    restored over the optimizer's, each checked first to be of the form the optimizer holds (a tuple of as
    many betas) and taken by its optimizer class. ``app_state``: the names given to ``save``, each restored in
    place as torch.distributed.checkpoint does: ``value.load_state_dict(saved)`` where the value has
    one, else ``app_state[name] = saved``; a name the checkpoint lacks is a ValueError (nothing loaded).
    Every check runs before anything changes, and the ranks agree on them: one that fails on any rank
    (its own app_state, a file it cannot read) raises on every rank, naming the rank, and nothing is loaded.
    """
    if not isinstance(opt, ZeroOptimizer):  # (before anything: the ranks agree over its group)
        raise TypeError(f"opt: expected a pz.ZeroOptimizer (checkpoints hold its shards), got {type(opt).__name__}")
    g = opt.group
    error = None
    try:
        path = _path(path, "load")
        if not isinstance(fallback, bool):
            raise TypeError(f"fallback: expected True or False, got {fallback!r}")
        _check_app_state(app_state, "load")
        _check_pair(model, opt)
        candidates, damaged = _candidates(path, fallback)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = e
    _agree(g, error)
    if not fallback:
        candidates = candidates[:1]
    _same_candidates(g, candidates, path)
    for step_dir in candidates:
        try:
            meta, error = None, None
            try:
                meta = _read_meta(step_dir)
            except CheckpointCorrupt as e:
                error = e
            _agree(g, error)
            _verify(step_dir, meta, g)
            try:
                shards = _read(step_dir, meta)
                extra = _torch_load(os.path.join(step_dir, "extra.pt"))
                app = _torch_load(os.path.join(step_dir, "app.pt")) if app_state and meta.get("app_state") else {}
            except CheckpointCorrupt as e:
                error = e
            _agree(g, error)
            break
        except CheckpointCorrupt as e:
            if not fallback:
                raise
            damaged.append(str(e))
    else:
        raise CheckpointCorrupt(f"path: no undamaged checkpoint in {path!r} ({' | '.join(damaged)})")
    if damaged:
        warnings.warn(f"checkpoint: fell back to {step_dir!r} (step {meta['step']}) because newer ones are "
                      f"damaged: {' | '.join(damaged)}", stacklevel=2)
    error = None
    try:
        target, settings, values, new_state = _prepare(step_dir, meta, shards, extra, app, model, opt, app_state)
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = e
    _agree(g, error)
    with torch.no_grad():
        for grp, restored in zip(opt.param_groups, settings):
            grp.update(restored)
        target.load_state_dict(extra, strict=False)  # (every key checked above: the trainable ones are not in it)
        # An empty state: never stepped when saved (e.g. an unused parameter), as in torch.
        opt.load_shard_state(values, new_state)
    if opt.scaler is not None and "scaler" in meta:
        opt.scaler.load_state_dict(meta["scaler"])
    error = None
    try:
        for k in app_state or ():
            v = app_state[k]
            if callable(getattr(v, "load_state_dict", None)):
                v.load_state_dict(app[k])
            else:
                app_state[k] = app[k]
    except Exception as e:  # noqa: BLE001 - every rank must learn of it
        error = e
    if meta.get("optimizer_state") is False:
        warnings.warn(f"checkpoint: {step_dir!r} was saved with optimizer_state=False: the weights are restored, "
                      f"the {meta['optimizer']} state starts afresh", stacklevel=2)
    # (also: no rank leaves before every rank has read the files)
    _agree(g, error, "the model and optimizer were loaded on every rank, app_state was not restored")
    return int(meta["step"])


def _same_candidates(g, candidates: list[str], path: str) -> None:
    """Collective over `g`: the ranks found the same step directories to try, in the same order. A directory
    not shared by every rank (a node-local disk), or one rank listing it while a save is being published,
    would otherwise have the ranks load different steps, each without a word."""
    names = [os.path.basename(os.path.normpath(d)) for d in candidates]
    rows = comm.every_rank([digest("\n".join(names).encode(), 7), len(names), _step_of(names[0]) if names and
                            _STEP_NAME.fullmatch(names[0].removeprefix(".old_")) else -1], group=g)
    if bool((rows == rows[0]).all()):
        return
    seen = "; ".join(f"group rank {r}: {n} step(s), newest {'step ' + str(s) if s >= 0 else 'not a step directory'}"
                     for r, (_, n, s) in enumerate(rows.tolist()))
    raise CheckpointError(f"path: the ranks see different checkpoints in {path!r} ({seen}); every rank must read "
                          "the same directory (a filesystem shared by all hosts); nothing was loaded on any rank")


def _prepare(step_dir, meta, shards, extra, app, model, opt, app_state):
    """Everything load checks and computes before it changes anything: (the module the buffers and frozen
    parameters load into, each param group's restored settings, each piece's values and state)."""
    mine = _model_meta(model, opt)
    # (names and shapes: the fp32 masters and the state load whatever the parameters' dtype)
    theirs = [(p["name"], tuple(p["shape"])) for p in meta["params"]]
    ours = [(p["name"], tuple(p["shape"])) for p in mine["params"]]
    if theirs != ours:
        diff = sorted(set(theirs) ^ set(ours), key=str)[:4] or ["the same parameters in another order"]
        raise ValueError(f"checkpoint {step_dir!r} is for a different model (parameter names/shapes differ, "
                         f"e.g. {diff}); nothing was loaded")
    tp = _tp_of(opt)
    if meta.get("tp") != tp:
        def said(v):
            return "without tensor parallelism" if v is None else f"by tensor-parallel rank {v[0]} of {v[1]}"
        raise ValueError(f"checkpoint {step_dir!r} was saved {said(meta.get('tp'))}, this optimizer is "
                         f"{said(tp).removeprefix('by ')}: its slices of the tensor-parallel layers are "
                         "another rank's (each tensor-parallel rank loads the checkpoint it saved, at the same "
                         "tensor-parallel size); nothing was loaded")
    if meta.get("optimizer") != type(opt.inner).__name__:
        raise ValueError(f"checkpoint {step_dir!r} holds {meta.get('optimizer')} state, the optimizer is "
                         f"{type(opt.inner).__name__}; nothing was loaded")
    if len(meta["param_groups"]) != len(opt.param_groups):
        raise ValueError(f"checkpoint has {len(meta['param_groups'])} param groups, the optimizer has "
                         f"{len(opt.param_groups)}; nothing was loaded")
    # (the hyperparameters are restored group by group: the groups must hold the same parameters)
    moved = [(p["name"], p["group"], q["group"]) for p, q in zip(meta["params"], mine["params"])
             if type(p.get("group")) is int and p["group"] != q["group"]]  # (older checkpoints do not say)
    if moved:
        name, theirs, ours = moved[0]
        raise ValueError(f"checkpoint {step_dir!r}: {name!r} was in param group {theirs} when saved, it is in "
                         f"param group {ours} now (the groups' lr, weight decay, ... are restored group by group); "
                         f"nothing was loaded")
    missing = sorted(set(app_state or ()) - set(app))
    if missing:
        raise ValueError(f"app_state: checkpoint {step_dir!r} holds no {missing} (it holds "
                         f"{sorted(meta.get('app_state', []))}); nothing was loaded")
    target = _check_extra(extra, model, opt, step_dir)
    settings = _restored_settings(step_dir, meta, opt)
    values = [_gather(shards, pc.name, pc.start, pc.end, lambda sh, i: sh["master"][i]) for pc, _, _ in opt.pieces]
    new_state = []
    for pc, _, _ in opt.pieces:
        src = next(sh["state"][i] for sh in shards for i, (n, a, b) in enumerate(sh["pieces"])
                   if n == pc.name and a < pc.end and pc.start < b)
        st = {}
        for k, v in src.items():
            if torch.is_tensor(v) and v.dim() == 1:  # elementwise state, laid out like the piece
                st[k] = _gather(shards, pc.name, pc.start, pc.end, lambda sh, i, k=k: sh["state"][i][k]).clone()
            else:
                st[k] = v.clone() if torch.is_tensor(v) else v
        new_state.append(st)
    return target, settings, values, new_state


def _restored_settings(step_dir: str, meta: dict, opt) -> list[dict]:
    """Each param group's saved settings in the form the optimizer holds them, checked (CheckpointCorrupt naming
    the setting): of the kind the optimizer holds now (a number for a number, a tuple of as many for a tuple),
    and, where they differ from the optimizer's, taken by its optimizer class (AdamW refuses lr=-5.0). Those
    its groups do not hold (an LR scheduler's initial_lr, a group's name) are added as saved (a tuple, a tensor
    in the form param_group_forms records), as torch's load_state_dict restores a group."""
    meta_path = os.path.join(step_dir, "meta.json")
    forms = meta.get("param_group_forms") or [{} for _ in meta["param_groups"]]  # (older checkpoints: none)
    out = []
    for i, (grp, saved) in enumerate(zip(opt.param_groups, meta["param_groups"])):
        restored = {}
        for k, v in saved.items():
            if k == "params":
                continue
            if k not in grp:  # (a scheduler's initial_lr, a name: as saved, as torch's load_state_dict)
                try:
                    restored[k] = _rebuilt(v, forms[i].get(k))
                except (TypeError, ValueError, RuntimeError) as e:
                    raise CheckpointCorrupt(f"checkpoint file {meta_path!r}: param_groups[{i}][{k!r}]: {e} (its "
                                            "param_group_forms entry); nothing was loaded") from None
                continue
            if not _same_kind(grp[k], v):
                held = tuple(_setting(grp[k])) if isinstance(grp[k], tuple) else _setting(grp[k])
                raise CheckpointCorrupt(f"checkpoint file {meta_path!r}: param_groups[{i}][{k!r}] is {v!r}, not of "
                                        f"the form the optimizer holds ({held!r}); nothing was loaded")
            restored[k] = _restored(grp[k], v)
        changed = {k: v for k, v in restored.items() if k in grp and _setting(grp[k]) != saved[k]}
        why = opt._settings_problem(i, changed) if changed else None
        if why is not None:
            shown = ", ".join(f"{k}={saved[k]!r}" for k in changed)
            raise CheckpointCorrupt(f"checkpoint file {meta_path!r}: param_groups[{i}] ({shown}): {why}; nothing "
                                    "was loaded")
        out.append(restored)
    return out


def _same_kind(current, saved) -> bool:
    """Whether a saved setting (JSON) can stand for the optimizer's `current` value."""
    if current is None or saved is None:
        return current is None or isinstance(current, bool)
    if isinstance(current, bool):
        return type(saved) is bool
    if torch.is_tensor(current):
        return type(saved) in (int, float) if current.numel() == 1 else (
            type(saved) is list and len(saved) == current.numel())
    if isinstance(current, (int, float)):
        return type(saved) in (int, float)
    if isinstance(current, (tuple, list)):
        return type(saved) is list and len(saved) == len(current) and all(map(_same_kind, current, saved))
    if isinstance(current, str):
        return type(saved) is str
    return True  # (another kind: restored as saved, as before these checks)


_KINDS = {"CheckpointCorrupt": CheckpointCorrupt, "CheckpointError": CheckpointError, "ValueError": ValueError,
          "TypeError": TypeError, "FileNotFoundError": FileNotFoundError}


def _agree(g, error: BaseException | None, done: str = "nothing was loaded on any rank") -> None:
    """Collective over `g`: raise on every rank if `error` is set on any. A rank that failed raises its own
    error (naming the other ranks that failed otherwise); the others raise one of the same kind naming the
    rank(s) and their errors."""
    failed = comm.failed_ranks(error, g)
    if not failed:
        return
    said = None if error is None else comm.error_text(error)
    others = [(r, msg) for r, msg in failed if r != g.rank and msg != said]
    why = "; ".join(f"group rank {r}: {msg}" for r, msg in others)
    if error is not None:
        if not others:
            raise error
        try:
            mine = type(error)(f"{error} (also {why})")
        except Exception:  # noqa: BLE001 - an exception type that takes other arguments: as it is
            raise error from None
        raise mine from error
    kind = _KINDS.get(failed[0][1].partition(":")[0], CheckpointError)
    raise kind(f"checkpoint.load failed on group rank(s) {[r for r, _ in failed]} ({why}); {done}")


def consolidate(path: str | os.PathLike) -> dict:
    """The full fp32 state dict of the checkpoint in `path`, loadable with model.load_state_dict (no GPU, no ranks)."""
    step_dir = _resolve(_path(path, "consolidate"))
    meta = _read_meta(step_dir)
    _verify(step_dir, meta)
    shards = _read(step_dir, meta)
    out = {}
    for p in meta["params"]:
        numel = 1
        for s in p["shape"]:
            numel *= s
        out[p["name"]] = _gather(shards, p["name"], 0, numel, lambda sh, i: sh["master"][i]).reshape(p["shape"]).clone()
    for alias, canonical in meta.get("aliases", {}).items():
        out.setdefault(alias, out[canonical])
    out.update(_torch_load(os.path.join(step_dir, "extra.pt")))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pyzero-checkpoint", description="Work with pyzero sharded checkpoints")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write the full fp32 state dict of a checkpoint to one .pt file")
    c.add_argument("dir", help="checkpoint directory (its latest step) or one step directory")
    c.add_argument("out", help="output .pt file (torch.save of the state dict)")
    args = ap.parse_args(argv)
    folder = os.path.dirname(os.path.abspath(args.out))
    if not os.path.isdir(folder):
        c.error(f"out: {args.out!r}: no folder {folder!r} to write it in")
    try:
        sd = consolidate(args.dir)
    except FileNotFoundError as e:  # (no checkpoint there at all: the argument; a missing file of one is damage)
        c.error(f"dir: {e}")
    except CheckpointError as e:
        raise SystemExit(f"pyzero-checkpoint consolidate: {e}") from None
    torch.save(sd, args.out)
    print(f"wrote {len(sd)} tensors ({sum(t.numel() for t in sd.values() if torch.is_tensor(t))} elements) "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
