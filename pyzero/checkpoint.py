"""Sharded checkpoints of a model and its ZeroOptimizer: atomic, reshardable.

Layout of a checkpoint directory::

    DIR/latest                  name of the newest complete step directory
    DIR/step_00000042/meta.json world size, stage, parameters (names, shapes), aliases, step
    DIR/step_00000042/rank00003.pt  that rank's pieces: (name, start, end), fp32 master values,
                                    optimizer state sliced the same way
    DIR/step_00000042/extra.pt  buffers and frozen parameters (from the first rank)

Each rank writes only what it owns, so a save moves no data between ranks.
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
import json
import os
import shutil

import torch

from . import comm

FORMAT = 1


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _save_file(obj, path):
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _model_meta(model, opt):
    names = dict(zip(map(id, opt.params), opt.names))
    aliases = {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False) if id(p) in names}
    return {"params": [{"name": n, "shape": list(p.shape), "dtype": str(p.dtype).replace("torch.", "")}
                       for n, p in zip(opt.names, opt.params)],
            "aliases": aliases}


def save(path: str, model, opt, step: int, keep: int = 3) -> str:
    """Write this rank's shard of `model`/`opt` at `step`; every rank of opt's group calls it."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")
    if not isinstance(keep, int) or keep < 1:
        raise ValueError(f"keep: expected an int >= 1, got {keep!r}")
    g, first = opt.group, opt.group.rank == 0
    name = f"step_{step:08d}"
    final, tmp = os.path.join(path, name), os.path.join(path, f".tmp_{name}")
    if first:
        os.makedirs(path, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)  # a save that crashed earlier
        os.makedirs(tmp)
    comm.barrier(group=g)
    shard = opt.shard_state()  # waits for reductions in flight: the shards hold still while read
    _save_file(shard, os.path.join(tmp, f"rank{opt.rank:05d}.pt"))
    if first:
        trainable = {id(p) for p in opt.params}
        extra = {k: v.detach().clone() for k, v in model.state_dict(keep_vars=True).items()
                 if id(v) not in trainable}
        _save_file(extra, os.path.join(tmp, "extra.pt"))
    comm.barrier(group=g)
    if first:
        meta = {"format": FORMAT, "step": step, "world": opt.world, "stage": opt.stage,
                "optimizer": type(opt.inner).__name__,
                "param_groups": [{k: v for k, v in grp.items() if k != "params"} for grp in opt.inner.param_groups]}
        meta.update(_model_meta(model, opt))
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
        others = sorted(d for d in entries if d.startswith("step_") and d != name)  # this one always stays
        stale = [d for d in entries if d.startswith((".tmp_step_", ".old_step_"))]  # crashed or replaced saves
        for d in others[:max(0, len(others) - (keep - 1))] + stale:
            shutil.rmtree(os.path.join(path, d), ignore_errors=True)
    comm.barrier(group=g)
    return final


def _resolve(path: str) -> str:
    """DIR (its latest step) or a step directory -> the step directory.

    If `latest` names no complete step (a save died between setting a step aside and
    renaming its replacement in), the newest complete step directory is used.
    """
    if os.path.exists(os.path.join(path, "meta.json")):
        return path
    latest = os.path.join(path, "latest")
    if os.path.exists(latest):
        with open(latest) as f:
            step_dir = os.path.join(path, f.read().strip())
        if os.path.exists(os.path.join(step_dir, "meta.json")):
            return step_dir
    complete = [d for d in os.listdir(path) if d.startswith(("step_", ".old_step_"))
                and os.path.exists(os.path.join(path, d, "meta.json"))] if os.path.isdir(path) else []
    if not complete:
        raise FileNotFoundError(f"path: {path!r} holds no checkpoint (no 'latest' file or meta.json)")
    return os.path.join(path, max(complete, key=lambda d: d.rsplit("_", 1)[1]))


def _read(step_dir):
    with open(os.path.join(step_dir, "meta.json")) as f:
        meta = json.load(f)
    shards = [torch.load(os.path.join(step_dir, f"rank{r:05d}.pt"), map_location="cpu", weights_only=True,
                         mmap=True) for r in range(meta["world"])]
    return meta, shards


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


def load(path: str, model, opt) -> int:
    """Restore `model`/`opt` from the newest checkpoint in `path` (any world size, any stage); returns its step."""
    step_dir = _resolve(path)
    meta, shards = _read(step_dir)
    mine = _model_meta(model, opt)
    if meta["params"] != mine["params"]:
        theirs = {p["name"]: tuple(p["shape"]) for p in meta["params"]}
        ours = {p["name"]: tuple(p["shape"]) for p in mine["params"]}
        diff = sorted(set(theirs.items()) ^ set(ours.items()), key=str)[:4]
        raise ValueError(f"checkpoint {step_dir!r} is for a different model (parameter names/shapes differ, "
                         f"e.g. {diff}); nothing was loaded")
    if meta.get("optimizer") != type(opt.inner).__name__:
        raise ValueError(f"checkpoint {step_dir!r} holds {meta.get('optimizer')} state, the optimizer is "
                         f"{type(opt.inner).__name__}; nothing was loaded")
    if len(meta["param_groups"]) != len(opt.inner.param_groups):
        raise ValueError(f"checkpoint has {len(meta['param_groups'])} param groups, the optimizer has "
                         f"{len(opt.inner.param_groups)}; nothing was loaded")
    new_state = []
    with torch.no_grad():
        values = [_gather(shards, pc.name, pc.start, pc.end, lambda sh, i: sh["master"][i])
                  for pc, _, _ in opt.pieces]
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
        for grp, saved in zip(opt.inner.param_groups, meta["param_groups"]):
            grp.update({k: v for k, v in saved.items() if k in grp})
        extra = torch.load(os.path.join(step_dir, "extra.pt"), map_location="cpu", weights_only=True)
        model.load_state_dict(extra, strict=False)
        # An empty state: never stepped when saved (e.g. an unused parameter), as in torch.
        opt.load_shard_state(values, new_state)
    comm.barrier(group=opt.group)
    return int(meta["step"])


def consolidate(path: str) -> dict:
    """The full fp32 state dict of the checkpoint in `path`, loadable with model.load_state_dict (no GPU, no ranks)."""
    step_dir = _resolve(path)
    meta, shards = _read(step_dir)
    out = {}
    for p in meta["params"]:
        numel = 1
        for s in p["shape"]:
            numel *= s
        out[p["name"]] = _gather(shards, p["name"], 0, numel, lambda sh, i: sh["master"][i]).reshape(p["shape"]).clone()
    for alias, canonical in meta["aliases"].items():
        out.setdefault(alias, out[canonical])
    extra = torch.load(os.path.join(step_dir, "extra.pt"), map_location="cpu", weights_only=True)
    out.update(extra)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="pyzero-checkpoint", description="Work with pyzero sharded checkpoints")
    sub = ap.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="write the full fp32 state dict of a checkpoint to one .pt file")
    c.add_argument("dir", help="checkpoint directory (its latest step) or one step directory")
    c.add_argument("out", help="output .pt file (torch.save of the state dict)")
    args = ap.parse_args(argv)
    sd = consolidate(args.dir)
    torch.save(sd, args.out)
    print(f"wrote {len(sd)} tensors ({sum(t.numel() for t in sd.values() if torch.is_tensor(t))} elements) "
          f"to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
