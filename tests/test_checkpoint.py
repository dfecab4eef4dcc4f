"""Sharded checkpoints: resharding across world sizes and stages, consolidation, keep=,
crashes during a save, a rank killed mid-training and the job resumed.

Ranks report their optimizer shards as (name, start, end) pieces; the parent
reassembles full tensors from them with its own code, so "what was saved"
and "what was loaded" are compared without the library's resharding logic.
"""
import errno
import importlib.util
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time
import warnings
import zlib

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import pyzero as pz
from pyzero.launch import run_ranks

from outcomes import outcome

IN, HID, OUT, BATCH, STEPS, SAVE_AT = 10, 26, 3, 12, 6, 3  # odd sizes: shards cut parameters differently
LR, WD = 1e-2, 0.1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def build():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HID), nn.Tanh(), nn.Linear(HID, HID), nn.Tanh(), nn.Linear(HID, OUT))


def batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, IN, generator=g), torch.randn(BATCH, OUT, generator=g)


def reference(steps=STEPS):
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WD)
    for step in range(steps):
        opt.zero_grad()
        F.mse_loss(model(batch(step)[0]), batch(step)[1]).backward()
        nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def shard_state(opt):
    """This rank's pieces: (name, start, end, master values, optimizer state)."""
    return [(pc.name, pc.start, pc.end, leaf.detach().clone(),
             {k: v.clone() if torch.is_tensor(v) else v for k, v in opt.inner.state.get(leaf, {}).items()})
            for pc, leaf, _ in opt.pieces]


def assemble(per_rank):
    """Full flat tensors {name: {"master"|state key: tensor}} from every rank's pieces; checks coverage."""
    sizes = {n: p.numel() for n, p in build().named_parameters()}
    full = {n: {} for n in sizes}
    for pieces in per_rank:
        for name, a, b, master, st in pieces:
            for key, v in [("master", master)] + [(k, v) for k, v in st.items() if v.dim() == 1]:
                full[name].setdefault(key, torch.full((sizes[name],), float("nan")))[a:b] = v
            if "step" in st:
                full[name]["step"] = st["step"]
    for name, d in full.items():
        for key, v in d.items():
            assert not v.isnan().any(), f"{name}/{key}: elements missing from every shard"
    return full


def full_params(model, opt):
    sd = opt.full_state_dict() if opt.stage == 3 else model.state_dict()
    return None if sd is None else {k: v.detach().clone() for k, v in sd.items()}


def die(stamp=None):
    """SIGKILL this process, first writing the time to `stamp` (if given)."""
    if stamp:
        with open(stamp, "w") as f:
            f.write(repr(time.time()))
    os.kill(os.getpid(), signal.SIGKILL)


def die_in_save(step, stamp=None):
    """On rank 1: SIGKILL while writing this rank's shard of checkpoint `step` (between save's barriers)."""
    if step is None or os.environ["RANK"] != "1":
        return
    real = pz.checkpoint._save_file

    def dying_save(obj, path):
        if f"step_{step:08d}" in path:
            with open(path, "wb") as f:
                f.write(b"partial")
            die(stamp)
        real(obj, path)
    pz.checkpoint._save_file = dying_save


def _rank_train(ckpt, stage, begin, save_at=(), keep=3, kill_in_save=None):
    """Train steps [begin, STEPS) (loading step `begin` from ckpt first), saving after the steps in save_at.
    kill_in_save=k: rank 1 dies while writing its shard of step k."""
    pz.init(timeout=30)
    die_in_save(kill_in_save)
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=stage, lr=LR, weight_decay=WD)
    out = {"loaded": None, "saved": {}}
    if begin:
        assert pz.checkpoint.load(ckpt, model, opt) == begin
        out["loaded"] = shard_state(opt)
    per, rank = BATCH // pz.get_world_size(), pz.get_rank()
    for step in range(begin, STEPS):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.clip_grad_norm_(0.5)
        opt.step()
        if step + 1 in save_at:
            pz.checkpoint.save(ckpt, model, opt, step + 1, keep=keep)
            out["saved"][step + 1] = shard_state(opt)
    out["final"] = full_params(model, opt)
    return out


def train_job(ckpt, world, stage, begin=0, **kw):
    return [r.value for r in run_ranks(_rank_train, world, args=(ckpt, stage, begin), kwargs=kw, timeout=90)]


def assert_same(a, b, atol=0.0):
    assert sorted(a) == sorted(b)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=atol, msg=lambda m, k=k: f"{k}: {m}")


# ---------------------------------------------------------------------------


@pytest.mark.parametrize("old,new", [((4, 2), (2, 2)), ((3, 1), (2, 3)), ((2, 3), (1, 1)), ((2, 2), (3, 1))],
                         ids=["4x2-to-2x2", "3x1-to-2x3", "2x3-to-1x1", "2x2-to-3x1"])
def test_reshard_and_continue(tmp_path, old, new):
    """(world, stage) -> (world, stage): the loaded state is the saved state bit for bit, and training
    goes on within 1e-6 of the run that never stopped (and of single-process torch)."""
    ckpt = str(tmp_path)
    first = train_job(ckpt, *old, save_at=(SAVE_AT,))
    second = train_job(ckpt, *new, begin=SAVE_AT)
    saved = assemble([r["saved"][SAVE_AT] for r in first])
    loaded = assemble([r["loaded"] for r in second])
    for name in saved:
        assert_same(loaded[name], saved[name])
        assert set(saved[name]) == {"master", "exp_avg", "exp_avg_sq", "step"}
    assert_same(second[0]["final"], first[0]["final"], atol=1e-6)
    for k, v in reference().items():
        torch.testing.assert_close(second[0]["final"][k], v, rtol=1e-5, atol=2e-6)


@pytest.fixture(scope="module")
def kept(tmp_path_factory):
    """2 ranks, stage 3, a checkpoint after every step, keep=2."""
    ckpt = str(tmp_path_factory.mktemp("kept"))
    return ckpt, train_job(ckpt, 2, 3, save_at=range(1, STEPS + 1), keep=2)


def test_keep_last_k(kept):
    ckpt, _ = kept
    assert sorted(os.listdir(ckpt)) == ["latest", f"step_{STEPS - 1:08d}", f"step_{STEPS:08d}"]
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == f"step_{STEPS:08d}"


def test_consolidate_equals_single_process(kept):
    ckpt, res = kept
    sd = pz.checkpoint.consolidate(ckpt)
    assert_same(sd, res[0]["final"])  # the fp32 master weights, exactly
    for k, v in reference().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-5, atol=2e-6)
    model = build()
    model.load_state_dict(sd)  # strict
    assert_same(model.state_dict(), sd)
    older = pz.checkpoint.consolidate(os.path.join(ckpt, f"step_{STEPS - 1:08d}"))
    assert any(not torch.equal(older[k], sd[k]) for k in sd)


def test_consolidate_cli(kept, tmp_path):
    ckpt, _ = kept
    out = tmp_path / "full.pt"
    proc = subprocess.run([sys.executable, "-m", "pyzero.checkpoint", "consolidate", ckpt, str(out)],
                          capture_output=True, text=True, timeout=60, cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT))
    assert proc.returncode == 0, proc.stderr
    assert str(out) in proc.stdout
    assert_same(torch.load(out, weights_only=True), pz.checkpoint.consolidate(ckpt))


def test_consolidate_cli_bad_arguments(kept, tmp_path, capsys):
    """A dir holding no checkpoint or an out in no folder is a usage error naming the argument (exit 2,
    before anything is read); a damaged checkpoint an error message (exit 1); neither a traceback."""
    out = tmp_path / "full.pt"
    for argv, code, want in [([str(tmp_path / "none"), str(out)], 2, "dir: "),
                             ([kept[0], str(tmp_path / "no" / "full.pt")], 2, "out: "),
                             ([str(tmp_path), str(out)], 2, "dir: ")]:
        with pytest.raises(SystemExit) as info:
            pz.checkpoint.main(["consolidate", *argv])
        err = capsys.readouterr().err
        assert info.value.code == code and f"pyzero-checkpoint consolidate: error: {want}" in err, err
        assert not out.exists()
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(kept[0], ckpt)
    damage(os.path.join(ckpt, f"step_{STEPS:08d}", "rank00000.pt"), "truncate")
    with pytest.raises(SystemExit) as info:
        pz.checkpoint.main(["consolidate", ckpt, str(out)])
    assert "rank00000.pt" in info.value.code and not out.exists()  # (a message: printed, exit status 1)


def test_save_dying_while_replacing_a_step(kept, tmp_path):
    """Saving step k again sets the old step_k aside before renaming the new one in: a crash between
    the two renames leaves `latest` naming a missing directory, and the set-aside copy is used. Without
    that copy (or with the named step's meta.json gone) the checkpoint is damaged: CheckpointCorrupt,
    not a silent load of the step before."""
    ckpt, res = str(tmp_path / "ckpt"), kept[1]
    shutil.copytree(kept[0], ckpt)
    os.rename(os.path.join(ckpt, f"step_{STEPS:08d}"), os.path.join(ckpt, f".old_step_{STEPS:08d}"))
    assert_same(pz.checkpoint.consolidate(ckpt), res[0]["final"])
    shutil.rmtree(os.path.join(ckpt, f".old_step_{STEPS:08d}"))
    with pytest.raises(pz.checkpoint.CheckpointCorrupt, match=f"step_{STEPS:08d}/meta.json' is missing"):
        pz.checkpoint.consolidate(ckpt)
    ckpt = str(tmp_path / "no-meta")
    shutil.copytree(kept[0], ckpt)
    os.unlink(os.path.join(ckpt, f"step_{STEPS:08d}", "meta.json"))
    with pytest.raises(pz.checkpoint.CheckpointCorrupt, match="is missing"):
        pz.checkpoint.consolidate(ckpt)


class Tied(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.emb, self.out = nn.Embedding(7, 5), nn.Linear(5, 7, bias=False)
        self.out.weight = self.emb.weight
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, tok):
        return self.out(self.emb(tok) * self.scale)


def _rank_load_checks(ckpt, tied_dir):
    """One rank: loading what does not fit raises and changes nothing; a crashed save is ignored."""
    pz.init(timeout=30)
    out = {}
    other = nn.Sequential(nn.Linear(IN, HID + 1), nn.Tanh(), nn.Linear(HID + 1, OUT))
    opt = pz.ZeroOptimizer(other, torch.optim.AdamW, stage=2, lr=LR)
    before = ({k: v.clone() for k, v in other.state_dict().items()}, shard_state(opt))
    for case, (model, o) in {"other_model": (other, opt), "other_optimizer": (
            build(), None), "missing_dir": (other, opt)}.items():
        if o is None:
            o = pz.ZeroOptimizer(model, torch.optim.SGD, stage=1, lr=0.1, momentum=0.9)
        path = os.path.join(ckpt, "nothing-here") if case == "missing_dir" else ckpt
        try:
            pz.checkpoint.load(path, model, o)
            out[case] = ("ok", None)
        except Exception as e:  # noqa: BLE001
            out[case] = (type(e).__name__, str(e))
    after = ({k: v.clone() for k, v in other.state_dict().items()}, shard_state(opt))
    out["untouched"] = all(torch.equal(v, after[0][k]) for k, v in before[0].items()) and all(
        torch.equal(a[3], b[3]) and a[4] == b[4] == {} for a, b in zip(before[1], after[1]))
    # A save that died half-way (a .tmp_ directory with partial files) does not hide the last good one.
    partial = os.path.join(ckpt, f".tmp_step_{STEPS + 1:08d}")
    os.makedirs(partial)
    for name in ("rank00000.pt", "meta.json"):
        with open(os.path.join(partial, name), "wb") as f:
            f.write(b"partial")
    model = build()
    o = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=LR, weight_decay=WD)
    out["resumed_step"] = pz.checkpoint.load(ckpt, model, o)
    out["resumed"] = full_params(model, o)
    pz.checkpoint.save(ckpt, model, o, STEPS + 2, keep=2)  # the next good save clears the crashed one away
    out["listing"] = sorted(os.listdir(ckpt))
    # Saving an older step (a run restarted from scratch) keeps it, whatever its number.
    pz.checkpoint.save(ckpt, model, o, 1, keep=2)
    out["listing_after_older"] = sorted(os.listdir(ckpt))
    out["older_step"] = pz.checkpoint.load(ckpt, model, o)
    # Tied weights: one stored tensor, both names in the consolidated state dict.
    tied = Tied()
    pz.checkpoint.save(tied_dir, tied, pz.ZeroOptimizer(tied, torch.optim.SGD, stage=2, lr=0.1), 0)
    return out


BAD_LOADS = {"other_model": ("ValueError", ["different model", "nothing was loaded"]),
             "other_optimizer": ("ValueError", ["AdamW", "SGD"]),
             "missing_dir": ("FileNotFoundError", ["nothing-here"])}


def test_bad_loads_and_crashed_save(kept, tmp_path):
    ckpt, res = str(tmp_path / "ckpt"), kept[1]
    shutil.copytree(kept[0], ckpt)
    out = run_ranks(_rank_load_checks, 1, args=(ckpt, str(tmp_path / "tied")), timeout=60)[0].value
    for case, (etype, words) in BAD_LOADS.items():
        got, msg = out[case]
        assert got == etype, f"{case}: expected {etype}, got {got}: {msg}"
        for w in words:
            assert w in msg, f"{case}: message does not mention {w!r}: {msg}"
    assert out["untouched"]
    assert out["resumed_step"] == STEPS
    assert_same(out["resumed"], res[0]["final"])
    assert out["listing"] == ["latest", f"step_{STEPS:08d}", f"step_{STEPS + 2:08d}"]
    assert out["listing_after_older"] == ["latest", "step_00000001", f"step_{STEPS + 2:08d}"]
    assert out["older_step"] == 1
    sd = pz.checkpoint.consolidate(str(tmp_path / "tied"))
    assert sorted(sd) == ["emb.weight", "out.weight", "scale"] and torch.equal(sd["emb.weight"], sd["out.weight"])
    model = Tied()
    model.load_state_dict(sd)
    assert_same(model.state_dict(), Tied().state_dict())


def _rank_other_param_dtype(ckpt):
    """Save from fp32 parameters (stage 2), load into bf16 ones (stage 3), and back."""
    pz.init(timeout=30)
    out = []
    for i, (save_dtype, load_dtype) in enumerate([(None, torch.bfloat16), (torch.bfloat16, None)]):
        path = os.path.join(ckpt, str(i))
        model = build()
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR, param_dtype=save_dtype)
        x, y = (t.chunk(2)[pz.get_rank()] for t in batch(0))
        w = next(model.parameters())
        F.mse_loss(model(x.to(w.dtype)).float(), y).backward()
        opt.step()
        pz.checkpoint.save(path, model, opt, 1)
        saved = opt.full_state_dict()
        model2 = build()
        opt2 = pz.ZeroOptimizer(model2, torch.optim.AdamW, stage=3, lr=LR, param_dtype=load_dtype)
        step = pz.checkpoint.load(path, model2, opt2)
        out.append((step, saved, opt2.full_state_dict()))
    return out


def test_load_into_another_param_dtype(tmp_path):
    """The fp32 master weights and optimizer state load whatever the parameters' dtype (param_dtype)
    of the run that saved them and of the one that loads them."""
    res = run_ranks(_rank_other_param_dtype, 2, args=(str(tmp_path),), timeout=60)
    for step, saved, loaded in res[0].value:
        assert step == 1
        assert_same(loaded, saved)


def _rank_weights_only(ckpt):
    """Two steps of ZeRO-2, saved with and without the optimizer state; each loaded into stage 3, then one step."""
    import warnings  # noqa: PLC0415

    pz.init(timeout=30)
    me = pz.get_rank()
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR, weight_decay=WD)
    for step in range(2):
        x, y = (t.chunk(2)[me] for t in batch(step))
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    full, light = os.path.join(ckpt, "full"), os.path.join(ckpt, "light")
    pz.checkpoint.save(full, model, opt, 2)
    pz.checkpoint.save(light, model, opt, 2, optimizer_state=False)
    bad = outcome(lambda: pz.checkpoint.save(light, model, opt, 3, optimizer_state="no"))
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    out = {"bad": bad, "weights": weights}
    for name in ("full", "light"):
        m = build()
        o = pz.ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=LR, weight_decay=WD)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            out[f"{name}/step"] = pz.checkpoint.load(os.path.join(ckpt, name), m, o)
        out[f"{name}/warnings"] = [str(w.message) for w in seen]
        out[f"{name}/loaded"] = o.full_state_dict()
        out[f"{name}/states"] = sum(len(st) for st in o.inner.state.values())
        x, y = (t.chunk(2)[me] for t in batch(2))
        o.zero_grad()
        F.mse_loss(m(x), y).backward()
        o.step()
        out[f"{name}/after"] = o.full_state_dict()
    # the reference for the light load: a fresh ZeroOptimizer over the saved weights takes the same step
    m = build()
    m.load_state_dict(weights)
    o = pz.ZeroOptimizer(m, torch.optim.AdamW, stage=3, lr=LR, weight_decay=WD)
    x, y = (t.chunk(2)[me] for t in batch(2))
    F.mse_loss(m(x), y).backward()
    o.step()
    out["fresh/after"] = o.full_state_dict()
    sizes = {n: os.path.getsize(os.path.join(ckpt, n, "step_00000002", f"rank{me:05d}.pt")) for n in ("full", "light")}
    out["sizes"] = sizes
    with open(os.path.join(light, "step_00000002", "meta.json")) as f:
        out["meta"] = json.load(f).get("optimizer_state")
    return out


def test_a_checkpoint_without_the_optimizer_state(tmp_path):
    """optimizer_state=False keeps the weights (and leaves Adam's moments out: about a third of the bytes);
    loading it restores the weights exactly, warns, and the optimizer starts afresh, as one built on those
    weights; a full checkpoint's load carries on with its moments."""
    for r in run_ranks(_rank_weights_only, 2, args=(str(tmp_path),), timeout=60):
        v = r.value
        assert v["bad"][0] == "TypeError" and "optimizer_state: expected True or False" in v["bad"][1], v["bad"]
        assert v["meta"] is False
        assert v["sizes"]["light"] < 0.5 * v["sizes"]["full"], v["sizes"]
        assert v["full/step"] == v["light/step"] == 2
        assert v["full/warnings"] == [] and v["full/states"] > 0
        assert len(v["light/warnings"]) == 1 and "optimizer_state=False" in v["light/warnings"][0], v["light/warnings"]
        assert v["light/states"] == 0
        if r.rank == 0:  # (full_state_dict: the first rank's)
            assert_same(v["full/loaded"], v["weights"])
            assert_same(v["light/loaded"], v["weights"])
            assert_same(v["light/after"], v["fresh/after"])  # a fresh optimizer's first step, bitwise
            assert max((v["full/after"][k] - v["fresh/after"][k]).abs().max().item() for k in v["weights"]) > 1e-4


def _rank_rolled_back(ckpt):
    pz.init(timeout=30)
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR)
    for step in (10, 15, 20):
        pz.checkpoint.save(ckpt, model, opt, step, keep=3)
    out = {}
    for step in (11, 12):  # the run went back to step 10 (a loss spike) and saves again from there
        pz.checkpoint.save(ckpt, model, opt, step, keep=3)
        out[step] = sorted(d for d in os.listdir(ckpt) if not d.startswith("."))  # (another rank's next save)
    with open(os.path.join(ckpt, "step_00000012", "rank00000.pt"), "r+b") as f:  # the newest goes bad
        f.write(b"\0" * 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out["fallback"] = pz.checkpoint.load(ckpt, model, opt, fallback=True)
    return out


def test_keep_counts_saves_in_the_order_they_were_made(tmp_path):
    """keep=3 keeps the 3 saved last: after a run goes back to step 10 and saves 11 and 12, those stay
    and the abandoned run's 15 and 20 go first (by step number the fresh 11 was deleted at the save of
    12, and a damaged 12 left nothing to fall back to)."""
    for r in run_ranks(_rank_rolled_back, 2, args=(str(tmp_path / "ck"),), timeout=60):
        assert r.value[11] == ["latest", "step_00000011", "step_00000015", "step_00000020"], r.value
        assert r.value[12] == ["latest", "step_00000011", "step_00000012", "step_00000020"], r.value
        assert r.value["fallback"] == 11


def _rank_mismatched_arguments(ckpt):
    pz.init(timeout=30)
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR)
    pz.checkpoint.save(ckpt, model, opt, 1)
    other = build()
    calls = {"save_torch_optimizer": lambda: pz.checkpoint.save(ckpt, model, torch.optim.SGD(model.parameters()), 2),
             "save_other_model": lambda: pz.checkpoint.save(ckpt, other, opt, 2),
             "save_bool_step": lambda: pz.checkpoint.save(ckpt, model, opt, True),
             "load_torch_optimizer": lambda: pz.checkpoint.load(ckpt, model, torch.optim.SGD(model.parameters())),
             "load_other_model": lambda: pz.checkpoint.load(ckpt, other, opt),
             "save_no_path": lambda: pz.checkpoint.save(None, model, opt, 2),
             "load_int_path": lambda: pz.checkpoint.load(3, model, opt),
             "consolidate_bytes_path": lambda: pz.checkpoint.consolidate(ckpt.encode())}
    out = {"pathlib": pz.checkpoint.load(pathlib.Path(ckpt), model, opt)}
    for name, call in calls.items():
        try:
            call()
            out[name] = ("ok", None)
        except Exception as e:  # noqa: BLE001
            out[name] = (type(e).__name__, str(e))
    out["listing"] = sorted(os.listdir(ckpt))
    return out


def test_save_and_load_check_what_they_are_given(tmp_path):
    """An optimizer that is not a ZeroOptimizer, a model that is not the one it trains (whose buffers
    would be saved or overwritten beside its weights), a bool step, a path that is not one: errors naming the
    argument, on every rank, and nothing saved; a pathlib.Path is a path."""
    want = {"save_torch_optimizer": ("TypeError", "opt: expected a pz.ZeroOptimizer"),
            "save_other_model": ("ValueError", "model: it does not hold the parameters"),
            "save_bool_step": ("ValueError", "step: expected a non-negative int, got True"),
            "load_torch_optimizer": ("TypeError", "opt: expected a pz.ZeroOptimizer"),
            "load_other_model": ("ValueError", "model: it does not hold the parameters"),
            "save_no_path": ("TypeError", "save: path: expected a directory path (str or os.PathLike), got NoneType"),
            "load_int_path": ("TypeError", "load: path: expected a directory path (str or os.PathLike), got int"),
            "consolidate_bytes_path": ("TypeError", "consolidate: path: expected a directory path (str or "
                                                    "os.PathLike), got bytes")}
    for r in run_ranks(_rank_mismatched_arguments, 2, args=(str(tmp_path / "ck"),), timeout=60):
        for name, (kind, words) in want.items():
            assert r.value[name][0] == kind and words in r.value[name][1], (name, r.value[name])
        assert r.value["listing"] == ["latest", "step_00000001"]
        assert r.value["pathlib"] == 1


def _rank_regrouped(ckpt):
    """Save with [matrices, vectors] groups, load into [vectors, matrices] ones: as many groups,
    other parameters in each."""
    pz.init(timeout=30)

    def groups(model, flip):
        mats = [p for p in model.parameters() if p.dim() > 1]
        vecs = [p for p in model.parameters() if p.dim() == 1]
        g = [{"params": mats, "weight_decay": 0.1}, {"params": vecs, "weight_decay": 0.0, "lr": 0.03}]
        return g[::-1] if flip else g

    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR, param_groups=groups(model, False))
    pz.checkpoint.save(ckpt, model, opt, 1)
    model2 = build()
    opt2 = pz.ZeroOptimizer(model2, torch.optim.AdamW, stage=2, lr=LR, param_groups=groups(model2, True))
    before = [dict((k, v) for k, v in g.items() if k != "params") for g in opt2.param_groups]
    try:
        pz.checkpoint.load(ckpt, model2, opt2)
        msg = None
    except ValueError as e:
        msg = str(e)
    same = before == [dict((k, v) for k, v in g.items() if k != "params") for g in opt2.param_groups]
    model3 = build()  # the same grouping loads
    opt3 = pz.ZeroOptimizer(model3, torch.optim.AdamW, stage=2, lr=LR, param_groups=groups(model3, False))
    return msg, same, pz.checkpoint.load(ckpt, model3, opt3)


def test_load_into_other_param_groups_is_refused(tmp_path):
    """The saved hyperparameters (lr, weight decay) are restored group by group: into groups that hold
    other parameters they would land on the wrong ones, so that is an error naming a parameter."""
    for r in run_ranks(_rank_regrouped, 2, args=(str(tmp_path / "ck"),), timeout=60):
        msg, same, step = r.value
        assert msg is not None and "param group" in msg and "'0.weight'" in msg and "nothing was loaded" in msg, msg
        assert same and step == 1


def _rank_tensor_lr(ckpt):
    """A tensor lr (torch optimizers take one): saved, loaded and stepped with as a number."""
    pz.init(timeout=30)
    out = []
    for lr in (torch.tensor(0.01), 0.01):
        model = build()
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=lr, betas=(0.8, 0.9))
        F.mse_loss(model(batch(0)[0]), batch(0)[1]).backward()
        opt.step()
        pz.checkpoint.save(ckpt + str(type(lr).__name__), model, opt, 1)
        model2 = build()
        opt2 = pz.ZeroOptimizer(model2, torch.optim.AdamW, stage=2, lr=lr * 50, betas=(0.5, 0.5))
        pz.checkpoint.load(ckpt + str(type(lr).__name__), model2, opt2)
        group = opt2.param_groups[0]
        kinds = (type(group["lr"]).__name__, type(group["betas"]).__name__)
        F.mse_loss(model2(batch(1)[0]), batch(1)[1]).backward()
        opt2.step()
        out.append((kinds, float(group["lr"]), opt2.full_state_dict()))
    return out


def test_tensor_lr_saved_and_restored_as_a_number(tmp_path):
    (kinds, lr, got), (_, _, want) = run_ranks(_rank_tensor_lr, 1, args=(str(tmp_path / "ck"),), timeout=60)[0].value
    assert kinds == ("Tensor", "tuple") and lr == pytest.approx(0.01)
    assert_same(got, want, atol=1e-7)


def _group_keys_run(lr, save_load):
    """AdamW at `lr` under a LambdaLR for 2 steps, its group given a name and a tuple; saved and loaded into a fresh
    optimizer by `save_load(model, opt, model2) -> opt2`, which then resumes a StepLR (it needs the scheduler's
    initial_lr) and takes a new LambdaLR (which starts from initial_lr), for 2 more steps. Returns the loaded
    group's settings (as (type, value)), the lrs it stepped with and the weights."""
    model = build()
    sched = torch.optim.lr_scheduler.LambdaLR(opt := save_load(model, None, None), lambda k: 0.5 ** k)
    opt.param_groups[0].update(name="decay", pair=(1, 2.5))
    for step in range(2):
        opt.zero_grad()
        F.mse_loss(model(batch(step)[0]), batch(step)[1]).backward()
        opt.step()
        sched.step()
    model2 = build()
    opt2 = save_load(model, opt, model2)
    group = {k: (type(v).__name__, v.tolist() if torch.is_tensor(v) else v)
             for k, v in opt2.param_groups[0].items() if k != "params"}
    torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5, last_epoch=1)  # (a KeyError without initial_lr)
    torch.optim.lr_scheduler.LambdaLR(opt2, lambda k: 0.9 ** k)
    lrs = []
    for step in range(2, 4):
        opt2.zero_grad()
        F.mse_loss(model2(batch(step)[0]), batch(step)[1]).backward()
        lrs.append(float(opt2.param_groups[0]["lr"]))
        opt2.step()
    state = opt2.full_state_dict() if isinstance(opt2, pz.ZeroOptimizer) else model2.state_dict()
    return group, lrs, {k: v.detach().clone() for k, v in state.items()}


def _rank_group_keys(ckpt):
    """_group_keys_run through pz.checkpoint, with a float and a tensor lr (whose initial_lr is a tensor too); then a
    checkpoint saved before param_group_forms, and a group holding a value meta.json cannot keep."""
    pz.init(timeout=30)

    def through_checkpoint(model, opt, model2):
        if opt is None:
            return pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=lr, weight_decay=WD)
        pz.checkpoint.save(ckpt, model, opt, 2)
        opt2 = pz.ZeroOptimizer(model2, torch.optim.AdamW, stage=2, lr=lr, weight_decay=WD)
        pz.checkpoint.load(ckpt, model2, opt2)
        return opt2
    out = {}
    for lr in (0.1, torch.tensor(0.1)):
        out[torch.is_tensor(lr)] = _group_keys_run(lr, through_checkpoint)
    meta_path = os.path.join(ckpt, "step_00000002", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    del meta["param_group_forms"]
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=0.1, weight_decay=WD)
    pz.checkpoint.load(ckpt, model, opt)
    out["older"] = {k: v for k, v in opt.param_groups[0].items() if k in ("pair", "initial_lr")}
    opt.param_groups[0]["info"] = {"a": 1}
    out["unkept"] = outcome(lambda: pz.checkpoint.save(ckpt, model, opt, 3))
    out["listing"] = sorted(os.listdir(ckpt))
    return out


def test_param_group_keys_the_optimizer_lacks_are_restored_as_torch_restores_them(tmp_path):
    """A group's keys a fresh optimizer does not hold (an LR scheduler's initial_lr, a name, a tuple) were dropped
    by load: StepLR(..., last_epoch=1) then raised a KeyError and a new LambdaLR started from the decayed lr. Now
    restored as torch's load_state_dict restores them (a tuple as a tuple, a tensor as a tensor), and a setting
    meta.json cannot keep is refused at save instead of being stringified or written unloadable."""
    got = run_ranks(_rank_group_keys, 1, args=(str(tmp_path / "ck"),), timeout=60)[0].value

    def through_state_dict(model, opt, model2):
        if opt is None:
            return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=WD)
        opt2 = torch.optim.AdamW(model2.parameters(), lr=lr, weight_decay=WD)
        model2.load_state_dict(model.state_dict())
        opt2.load_state_dict(opt.state_dict())
        return opt2
    for lr in (0.1, torch.tensor(0.1)):
        group, lrs, state = got[torch.is_tensor(lr)]
        want_group, want_lrs, want = _group_keys_run(lr, through_state_dict)
        assert group == want_group, (group, want_group)
        assert group["name"] == ("str", "decay") and group["pair"] == ("tuple", (1, 2.5))
        assert group["initial_lr"][0] == type(lr).__name__
        assert lrs == pytest.approx(want_lrs, rel=1e-6) and lrs[0] == pytest.approx(0.1)
        assert_same(state, want, atol=1e-7)
    older = got["older"]  # (the tensor lr's run, saved last: its values as JSON holds them)
    assert older["pair"] == [1, 2.5] and type(older["initial_lr"]) is float
    assert older["initial_lr"] == pytest.approx(0.1)
    kind, msg = got["unkept"]
    assert kind == "CheckpointError" and "checking the param groups" in msg and "param_groups[0]['info']" in msg \
        and "dict" in msg and "nothing was saved" in msg, got["unkept"]
    assert got["listing"] == ["latest", "step_00000002"]


# ---------------------------------------------------------------------------
# examples/zero_train.py: a rank dies, the job is restarted and resumes


def _rank_example(argv, kill_after=None, kill_in_save=None, stamp=None):
    spec = importlib.util.spec_from_file_location("zero_train", os.path.join(ROOT, "examples", "zero_train.py"))
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    die_in_save(kill_in_save, stamp)

    def on_step(step):
        if step == kill_after and pz.get_rank() == 1:
            die(stamp)
    return example.main(argv, on_step=on_step)


def example_args(ckpt, stage):
    return ["--ckpt", ckpt, "--stage", str(stage), "--steps", "9", "--save-every", "3", "--timeout", "3"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    ckpt = str(tmp_path_factory.mktemp("whole"))
    return run_ranks(_rank_example, 2, args=(example_args(ckpt, 2),), timeout=90)[0].value


@pytest.mark.parametrize("stage,kill,resumes_at", [(2, dict(kill_after=7), 6), (3, dict(kill_in_save=6), 3)],
                         ids=["killed-after-step-7", "killed-while-saving-step-6"])
def test_killed_rank_resume(tmp_path, uninterrupted, stage, kill, resumes_at):
    ckpt, stamp = str(tmp_path / "ckpt"), str(tmp_path / "killed_at")
    crashed = run_ranks(_rank_example, 2, args=(example_args(ckpt, stage),), kwargs=dict(kill, stamp=stamp),
                        timeout=60, check=False)
    with open(stamp) as f:
        elapsed = time.time() - float(f.read())  # from the kill until every rank had exited
    assert crashed[1].exitcode == -signal.SIGKILL
    assert crashed[0].exitcode == 1 and crashed[0].value is None
    assert "CollectiveTimeout" in crashed[0].output or "CollectiveError" in crashed[0].output, crashed[0].output
    assert elapsed < 10, f"the surviving rank took {elapsed:.1f} s to fail (pz.init timeout 3 s)"
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == f"step_{resumes_at:08d}"
    restarted = run_ranks(_rank_example, 2, args=(example_args(ckpt, stage),), timeout=90)
    assert f"resumed from step {resumes_at}" in restarted[0].output
    assert not [d for d in os.listdir(ckpt) if d.startswith(".tmp")]
    assert_same(restarted[0].value, uninterrupted, atol=1e-6)


# ---------------------------------------------------------------------------
# Checksums: damaged files are named on every rank; fallback=True loads the previous step;
# a save that fails on one rank raises on every rank and leaves `latest` alone.


def damage(path, how):
    if how == "flip":  # one byte in the middle: torch.load would still succeed, with wrong values
        with open(path, "r+b") as f:
            f.seek(os.path.getsize(path) // 2)
            b = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([b[0] ^ 0x40]))
    elif how == "truncate":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 100)
    else:
        os.unlink(path)


def _rank_load_damaged(ckpt):
    """Two attempts: a plain load (must raise, changing nothing), then fallback=True."""
    import warnings  # noqa: PLC0415

    pz.init(timeout=20)
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=LR, weight_decay=WD)
    before = full_params(model, opt)
    out = {}
    try:
        pz.checkpoint.load(ckpt, model, opt)
        out["plain"] = ("ok", "")
    except Exception as e:  # noqa: BLE001
        out["plain"] = (type(e).__name__, str(e))
    after = full_params(model, opt)  # collective at stage 3 (the first rank gets the values)
    out["untouched"] = before is None or all(torch.equal(v, after[k]) for k, v in before.items())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out["step"] = pz.checkpoint.load(ckpt, model, opt, fallback=True)
    out["warnings"] = [str(w.message) for w in caught]
    out["loaded"] = shard_state(opt)
    return out


@pytest.mark.parametrize("how,file", [("flip", "rank00001.pt"), ("truncate", "rank00000.pt"),
                                      ("flip", "extra.pt"), ("delete", "rank00001.pt"),
                                      ("delete", "meta.json")])
def test_damaged_checkpoint(kept, tmp_path, how, file):
    ckpt, res = str(tmp_path / "ckpt"), kept[1]
    shutil.copytree(kept[0], ckpt)
    newest, previous = f"step_{STEPS:08d}", f"step_{STEPS - 1:08d}"
    if file == "extra.pt":  # the test model has no buffers: give extra.pt bytes worth damaging
        meta_path = os.path.join(ckpt, newest, "meta.json")
        torch.save({"pad": torch.zeros(64)}, os.path.join(ckpt, newest, "extra.pt"))
        with open(meta_path) as f:
            meta = json.load(f)
        meta["files"]["extra.pt"] = pz.checkpoint._file_sum(os.path.join(ckpt, newest, "extra.pt"))
        with open(meta_path, "w") as f:
            json.dump(meta, f)
    damage(os.path.join(ckpt, newest, file), how)
    out = [r.value for r in run_ranks(_rank_load_damaged, 2, args=(ckpt,), timeout=60)]
    for rank, o in enumerate(out):
        kind, msg = o["plain"]
        assert kind == "CheckpointCorrupt", (rank, kind, msg)
        assert os.path.join(ckpt, newest, file) in msg and "nothing was loaded" in msg, msg
        assert o["untouched"]
        assert o["step"] == STEPS - 1
        assert len(o["warnings"]) == 1 and previous in o["warnings"][0] and file in o["warnings"][0]
    loaded = assemble([o["loaded"] for o in out])
    saved = assemble([r["saved"][STEPS - 1] for r in res])
    for name in saved:
        assert_same(loaded[name], saved[name])


def _rank_load_split(ckpts):
    pz.init(timeout=20)
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=3, lr=LR, weight_decay=WD)
    before = full_params(model, opt)
    out = []
    for fallback in (False, True):
        try:
            out.append(("ok", pz.checkpoint.load(ckpts[pz.get_rank()], model, opt, fallback=fallback)))
        except Exception as e:  # noqa: BLE001
            out.append((type(e).__name__, str(e)))
    after = full_params(model, opt)
    return out, before is None or all(torch.equal(v, after[k]) for k, v in before.items())


def test_ranks_that_see_different_checkpoints_load_nothing(kept, tmp_path):
    """A node-local directory per rank: rank 1's lacks the newest step (each rank alone would load its newest)."""
    ckpts = [str(tmp_path / "a"), str(tmp_path / "b")]
    for c in ckpts:
        shutil.copytree(kept[0], c)
    shutil.rmtree(os.path.join(ckpts[1], f"step_{STEPS:08d}"))
    with open(os.path.join(ckpts[1], "latest"), "w") as f:
        f.write(f"step_{STEPS - 1:08d}")
    for rank, r in enumerate(run_ranks(_rank_load_split, 2, args=(ckpts,), timeout=60)):
        results, untouched = r.value
        assert untouched, rank
        for kind, msg in results:
            assert kind == "CheckpointError", (rank, kind, msg)
            assert f"newest step {STEPS};" in msg, msg
            assert f"group rank 1: 1 step(s), newest step {STEPS - 1})" in msg, msg
            assert msg.endswith("nothing was loaded on any rank"), msg


def test_damaged_consolidate_and_old_format(kept, tmp_path):
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(kept[0], ckpt)
    newest = os.path.join(ckpt, f"step_{STEPS:08d}")
    good = pz.checkpoint.consolidate(ckpt)
    # A checkpoint without checksums (format 1) still loads, with a warning saying it was not verified.
    with open(os.path.join(newest, "meta.json")) as f:
        meta = json.load(f)
    assert sorted(meta["files"]) == ["extra.pt", "rank00000.pt", "rank00001.pt"]
    for name, want in meta["files"].items():
        assert want == {"bytes": os.path.getsize(os.path.join(newest, name)),
                        "crc32": zlib.crc32(open(os.path.join(newest, name), "rb").read())}
    del meta["files"]
    meta["format"] = 1
    with open(os.path.join(newest, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.warns(UserWarning, match="no checksums"):
        assert_same(pz.checkpoint.consolidate(ckpt), good)
    damage(os.path.join(newest, "rank00000.pt"), "truncate")  # unverifiable, but unreadable: still an error
    with pytest.raises(pz.checkpoint.CheckpointCorrupt, match="rank00000.pt"), pytest.warns(UserWarning):
        pz.checkpoint.consolidate(ckpt)
    with open(os.path.join(newest, "meta.json"), "w") as f:
        f.write('{"format": 2, "wor')  # a torn meta.json
    with pytest.raises(pz.checkpoint.CheckpointCorrupt, match="meta.json"):
        pz.checkpoint.consolidate(newest)


@pytest.mark.parametrize("field,value", [
    ("world", 10**9), ("world", "2"), ("step", -1), ("format", 99), ("params", [{"name": "w", "shape": [-1],
                                                                            "dtype": "float32"}]),
    ("param_groups", [{"lr": {"__class__": "os.system"}}]), ("aliases", {"x": "not-a-parameter"}),
    ("files", {"rank00000.pt": {"bytes": "12", "crc32": 0}}), ("optimizer", None),
    ("scaler", {"scale": float("inf"), "good_steps": 0, "skipped": 0}), ("app_state", ["x", 3]),
    ("optimizer_state", "no"),
])
def test_meta_json_fields_are_checked_before_use(kept, tmp_path, field, value):
    """meta.json is read from disk another process wrote: every field it is used for is checked first."""
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(kept[0], ckpt)
    newest = os.path.join(ckpt, f"step_{STEPS:08d}")
    with open(os.path.join(newest, "meta.json")) as f:
        meta = json.load(f)
    meta[field] = value
    with open(os.path.join(newest, "meta.json"), "w") as f:
        json.dump(meta, f)
    with pytest.raises(pz.checkpoint.CheckpointCorrupt, match=f"meta.json.*'{field}'"):
        pz.checkpoint.consolidate(ckpt)


def _rank_app_state(ckpt):
    """Train 2 steps with an LR scheduler and fp16-style loss scaling (the scale doubling at every good step),
    save with app_state, and load into fresh objects; then the ways app_state can be wrong."""
    pz.init(timeout=20)

    def make():
        model = build()
        opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR, weight_decay=WD,
                               loss_scale={"init_scale": 2.0**10, "growth_interval": 1})
        return model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    model, opt, sched = make()
    per, rank = BATCH // pz.get_world_size(), pz.get_rank()
    for step in range(2):
        x, y = batch(step)
        opt.zero_grad()
        opt.scale_loss(F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per])).backward()
        opt.step()
        sched.step()
    rng = torch.Generator().manual_seed(5).get_state()
    pz.checkpoint.save(ckpt, model, opt, 2, app_state={"scheduler": sched, "seen": 24, "rng": rng})
    out = {"saved_lr": [g["lr"] for g in opt.param_groups]}
    model2, opt2, sched2 = make()
    state = {"scheduler": sched2, "seen": None, "rng": None}
    assert pz.checkpoint.load(ckpt, model2, opt2, app_state=state) == 2
    out.update(scale=opt2.loss_scale, epoch=sched2.last_epoch, lr=[g["lr"] for g in opt2.param_groups],
               seen=state["seen"], rng_equal=torch.equal(state["rng"], rng), same_object=state["scheduler"] is sched2)
    out["no_app_state"] = pz.checkpoint.load(ckpt, model2, opt2)  # the app state is optional on load
    out["missing"] = outcome(lambda: pz.checkpoint.load(ckpt, model2, opt2,
                                                        app_state={"scheduler": sched2, "epoch": 0}))
    out["not_a_dict"] = outcome(lambda: pz.checkpoint.save(ckpt, model, opt, 3, app_state=[sched]))
    out["unloadable"] = outcome(lambda: pz.checkpoint.save(ckpt, model, opt, 3, app_state={"fn": print}))
    with open(os.path.join(ckpt, "latest")) as f:
        out["latest"] = f.read().strip()
    return out


def test_app_state_and_loss_scale_resume_with_the_step(tmp_path):
    """A scheduler, a count and an RNG state saved beside the shards come back (the scheduler in place, the
    rest into the dict), as does the loss scale; a name the checkpoint lacks, a list, or a value that
    torch.load(weights_only=True) cannot read are errors on every rank that save or load nothing."""
    ckpt = str(tmp_path / "ckpt")
    out = [r.value for r in run_ranks(_rank_app_state, 2, args=(ckpt,), timeout=60)]
    for r in out:
        assert r["scale"] == 2.0**12  # 2**10, doubled after each of the 2 good steps (growth_interval 1)
        assert r["epoch"] == 2 and r["lr"] == r["saved_lr"] == [LR * 0.25]
        assert r["seen"] == 24 and r["rng_equal"] and r["same_object"]
        assert r["no_app_state"] == 2
        kind, msg = r["missing"]
        assert kind == "ValueError" and "holds no ['epoch']" in msg and "['rng', 'scheduler', 'seen']" in msg
        assert r["not_a_dict"][0] == "TypeError" and "app_state: expected None or a dict" in r["not_a_dict"][1]
        kind, msg = r["unloadable"]
        assert kind == "CheckpointError" and "rank 0" in msg and "app_state['fn']" in msg and "weights_only" in msg
        assert r["latest"] == "step_00000002"
    with open(os.path.join(ckpt, "step_00000002", "meta.json")) as f:
        meta = json.load(f)
    assert meta["app_state"] == ["rng", "scheduler", "seen"] and meta["scaler"]["scale"] == 2.0**12
    assert "app.pt" in meta["files"]


def _rank_save_fails(ckpt, mode):
    """Save step 1; then step 2 with a fault; every rank reports its error, then loads what `latest` names."""
    pz.init(timeout=20)
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR, weight_decay=WD)
    per, rank = BATCH // pz.get_world_size(), pz.get_rank()
    out = {}

    def train(step):
        x, y = batch(step)
        opt.zero_grad()
        F.mse_loss(model(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
        opt.step()
    train(0)
    pz.checkpoint.save(ckpt, model, opt, 1)
    out["saved"] = shard_state(opt)
    train(1)
    real = pz.checkpoint._save_file
    target = ckpt
    if mode == "enospc" and rank == 1:
        def full_disk(obj, path):
            with open(path, "wb") as f:
                f.write(b"x" * 100)
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
        pz.checkpoint._save_file = full_disk
    elif mode == "not_a_dir":
        target = os.path.join(ckpt, "latest", "sub")  # `latest` is a file: no directory can be made under it
    elif mode == "read_only":
        os.chmod(ckpt, 0o555)
    try:
        pz.checkpoint.save(target, model, opt, 2)
        out["error"] = ("ok", "")
    except Exception as e:  # noqa: BLE001
        out["error"] = (type(e).__name__, str(e))
    finally:
        pz.checkpoint._save_file = real
        if mode == "read_only":
            pz.comm.barrier()
            os.chmod(ckpt, 0o755)
    pz.comm.barrier()
    model2 = build()
    opt2 = pz.ZeroOptimizer(model2, torch.optim.AdamW, stage=2, lr=LR, weight_decay=WD)
    out["step"] = pz.checkpoint.load(ckpt, model2, opt2)
    out["loaded"] = shard_state(opt2)
    return out


SAVE_FAULTS = {"enospc": ["rank 1", "No space left on device", "rank00001.pt"],
               "not_a_dir": ["rank 0", "latest"], "read_only": ["rank 0", "Permission denied"]}


@pytest.mark.parametrize("mode", list(SAVE_FAULTS))
def test_save_fails_on_every_rank(tmp_path, mode):
    if mode == "read_only" and os.getuid() == 0:
        pytest.skip("root ignores directory permissions (the enospc case covers a failing write)")
    ckpt = str(tmp_path / "ckpt")
    out = [r.value for r in run_ranks(_rank_save_fails, 2, args=(ckpt, mode), timeout=60)]
    for o in out:
        kind, msg = o["error"]
        assert kind == "CheckpointError", (kind, msg)
        for w in SAVE_FAULTS[mode] + ["step=2", "'latest' is unchanged"]:
            assert w in msg, (w, msg)
        assert o["step"] == 1
    with open(os.path.join(ckpt, "latest")) as f:
        assert f.read().strip() == "step_00000001"
    assert sorted(os.listdir(ckpt)) == ["latest", "step_00000001"]
    loaded = assemble([o["loaded"] for o in out])
    saved = assemble([o["saved"] for o in out])
    for name in saved:
        assert_same(loaded[name], saved[name])


class _OneFullWrite:
    """A file whose `fail_at`-th write fails with ENOSPC and whose other writes succeed (a full disk
    that frees space again, as when older steps are deleted)."""

    def __init__(self, path, mode, fail_at):
        self.f, self.n, self.fail_at = open(path, mode), 0, fail_at

    def write(self, b):
        self.n += 1
        if self.n == self.fail_at:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return self.f.write(b)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


@pytest.mark.parametrize("fail_at", [1, 2, 3, 5])
def test_failed_write_reports_its_cause(tmp_path, monkeypatch, fail_at):
    """torch.save turns a failed write into "unexpected pos ..."; the shard writer raises the write's own
    OSError, so the CheckpointError every rank sees names the full disk."""
    monkeypatch.setattr(pz.checkpoint, "open", lambda path, mode: _OneFullWrite(path, mode, fail_at), raising=False)
    with pytest.raises(OSError) as info:
        pz.checkpoint._save_file({"w": torch.ones(1 << 10), "b": torch.zeros(3)}, str(tmp_path / "shard.pt"))
    assert info.value.errno == errno.ENOSPC, info.value
    assert "No space left on device" in str(info.value)


# ---------------------------------------------------------------------------
# Tensor parallelism: each data-parallel group saves one tensor-parallel rank's slices


def _tp_model(tp):
    torch.manual_seed(0)  # every rank the same full layer, then its slice
    return nn.Sequential(pz.tp.ColumnParallelLinear(IN, HID, group=tp), nn.Tanh(),
                         pz.tp.RowParallelLinear(HID, OUT, group=tp))


def _rank_tp_checkpoints(ckpt):
    pz.init(timeout=30)
    dp, tp = pz.mesh(dp=2, tp=2)
    model = _tp_model(tp)
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, group=dp, tp_group=tp, lr=LR)
    x = torch.randn(BATCH, IN, generator=torch.Generator().manual_seed(dp.rank))
    for _ in range(2):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
    out = {"tp_rank": tp.rank}
    # both data-parallel groups into one path: the second to claim the step is refused, the first saves
    out["same_path"] = outcome(lambda: pz.checkpoint.save(os.path.join(ckpt, "shared"), model, opt, 2))
    pz.barrier()
    mine, other = (os.path.join(ckpt, f"tp{r}") for r in (tp.rank, 1 - tp.rank))
    pz.checkpoint.save(mine, model, opt, 2)
    pz.barrier()
    fresh = _tp_model(tp)  # (its own slice of the initial layers)
    fresh_opt = pz.ZeroOptimizer(fresh, torch.optim.AdamW, stage=2, group=dp, tp_group=tp, lr=LR)
    out["other_rank"] = outcome(lambda: pz.checkpoint.load(other, fresh, fresh_opt))
    out["changed_by_refusal"] = any(not torch.equal(v, saved[k]) and not torch.equal(v, _tp_model(tp).state_dict()[k])
                                    for k, v in fresh.state_dict().items())
    out["step"] = pz.checkpoint.load(mine, fresh, fresh_opt)
    out["restored"] = all(torch.equal(v, saved[k]) for k, v in fresh.state_dict().items())
    plain = build()  # a model without tensor parallelism on the world group
    out["no_tp"] = outcome(lambda: pz.checkpoint.load(mine, plain, pz.ZeroOptimizer(plain, torch.optim.AdamW, lr=LR)))
    return out


def test_tensor_parallel_groups_save_apart_and_load_their_own(tmp_path):
    """A dp=2 x tp=2 mesh: the two data-parallel groups (one per tensor-parallel rank) saving into one path
    would overwrite each other's rank files: the group that comes second is refused, naming the path (the
    first saves); each into its own path they save, and each tensor-parallel rank loads its own back
    exactly; another rank's checkpoint, or one loaded without tensor parallelism, is refused."""
    out = [r.value for r in run_ranks(_rank_tp_checkpoints, 4, args=(str(tmp_path),), timeout=90)]
    refused = {o["tp_rank"] for o in out if o["same_path"][0] != "ok"}
    assert len(refused) == 1, [o["same_path"] for o in out]  # one whole group, the same on its ranks
    for o in out:
        kind, msg = o["same_path"]
        if o["tp_rank"] in refused:
            assert kind == "CheckpointError" and "give each group its own path" in msg, msg
        assert o["other_rank"][0] == "ValueError", o["other_rank"]
        assert f"saved by tensor-parallel rank {1 - o['tp_rank']} of 2" in o["other_rank"][1], o["other_rank"]
        assert not o["changed_by_refusal"]
        assert o["step"] == 2 and o["restored"]
        kind, msg = o["no_tp"]
        assert kind == "ValueError" and ("tensor-parallel" in msg or "different model" in msg), msg


class _BnNet(nn.Module):
    """Trainable layers, BatchNorm running statistics and a frozen parameter."""

    def __init__(self, track=True, frozen="emb", features=8):
        super().__init__()
        torch.manual_seed(0)
        self.l1 = nn.Linear(6, features)
        self.bn = nn.BatchNorm1d(features, track_running_stats=track)
        self.l2 = nn.Linear(features, 2)
        setattr(self, frozen, nn.Parameter(torch.randn(features), requires_grad=False))
        self.frozen = frozen

    def forward(self, x):
        return self.l2(self.bn(self.l1(x)) + getattr(self, self.frozen))


class _Holder(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.net = inner

    def forward(self, x):
        return self.net(x)


def _rank_buffers(ckpt):
    pz.init(timeout=30)
    g = torch.Generator().manual_seed(pz.get_rank())
    net = _BnNet()
    opt = pz.ZeroOptimizer(net, torch.optim.AdamW, stage=2, lr=1e-2)
    with torch.no_grad():
        net.emb.add_(1.0)  # a frozen parameter that differs from a fresh model's
    for _ in range(3):
        opt.zero_grad()
        net(torch.randn(4, 6, generator=g)).square().mean().backward()
        opt.step()
    pz.checkpoint.save(ckpt, _Holder(net), opt, 3)  # saved through a wrapper
    saved = {k: v.clone() for k, v in net.state_dict().items()}
    out = {}
    fresh = _BnNet()
    pz.checkpoint.load(ckpt, fresh, pz.ZeroOptimizer(fresh, torch.optim.AdamW, stage=2, lr=5e-3))
    out["saved"], out["bare"] = saved, {k: v.clone() for k, v in fresh.state_dict().items()}
    for name, kw in (("no running stats", dict(track=False)), ("frozen renamed", dict(frozen="bias0")),
                     ("other size", dict(features=9))):
        other = _BnNet(**kw)
        before = {k: v.clone() for k, v in other.state_dict().items()}
        opt2 = pz.ZeroOptimizer(other, torch.optim.AdamW, stage=2, lr=5e-3)
        try:
            pz.checkpoint.load(ckpt, other, opt2)
            out[name] = "nothing raised"
        except ValueError as e:
            out[name] = str(e)
        out[name + " unchanged"] = (all(torch.equal(v, before[k]) for k, v in other.state_dict().items())
                                    and opt2.param_groups[0]["lr"] == 5e-3)
    return out


def test_buffers_and_frozen_parameters_load_whole_or_not_at_all(tmp_path):
    """extra.pt was keyed by the module given to save and loaded with strict=False: saved through a wrapper
    and loaded into the bare model, BatchNorm's statistics and the frozen parameter kept their fresh
    values without a word; a model without running statistics or with a frozen parameter renamed loaded
    the rest silently; a buffer of another size raised only after the lr and some buffers had changed.
    Now keyed by the optimizer's model and checked before anything is loaded."""
    results = [r.value for r in run_ranks(_rank_buffers, 2, args=(str(tmp_path / "ck"),), timeout=90)]
    first = results[0]["saved"]  # (the first rank's buffers are the checkpoint's)
    assert not torch.equal(first["bn.running_mean"], torch.zeros(8)) and not torch.equal(first["emb"], _BnNet().emb)
    for out in results:
        assert out["bare"].keys() == first.keys()
        for k, v in first.items():
            torch.testing.assert_close(out["bare"][k], v, rtol=0, atol=0, msg=k)
        assert "buffers and frozen parameters differ" in out["no running stats"] and "bn.running_mean" in \
            out["no running stats"]
        assert "saved only ['emb'], here only ['bias0']" in out["frozen renamed"]
        assert "nothing was loaded" in out["other size"]
        for name in ("no running stats", "frozen renamed", "other size"):
            assert out[name + " unchanged"], name


def _rank_refused_loads(ckpt):
    """2 ranks. Loads that one rank refuses (its app_state names what the checkpoint lacks, its files unreadable)
    or every rank refuses (meta.json's hyperparameters not the optimizer's kind or refused by it, `latest` naming
    no step directory): an error on every rank, naming the rank, and nothing changed anywhere; a step save
    cannot write back; then the checkpoint loads and the load restores the saved values."""
    pz.init(timeout=20)
    me = pz.get_rank()
    model = build()
    opt = pz.ZeroOptimizer(model, torch.optim.AdamW, stage=2, lr=LR, weight_decay=WD)
    x, y = (t.chunk(2)[me] for t in batch(0))
    F.mse_loss(model(x), y).backward()
    opt.step()
    out = {"big_step": outcome(lambda: pz.checkpoint.save(ckpt, model, opt, 2**62 + 1))}
    pz.checkpoint.save(ckpt, model, opt, 1, app_state={"pos": 3})
    saved = ({k: v.clone() for k, v in model.state_dict().items()}, shard_state(opt))
    pz.checkpoint.save(os.path.join(ckpt, "max"), model, opt, 2**62)  # the largest step: it loads back
    out["max_step"] = pz.checkpoint.load(os.path.join(ckpt, "max"), model, opt)
    x, y = (t.chunk(2)[me] for t in batch(1))  # a step on from the checkpoint: a load would change it all
    F.mse_loss(model(x), y).backward()
    opt.step()
    for grp in opt.param_groups:
        grp["lr"] = 0.5 * LR
    before = ({k: v.clone() for k, v in model.state_dict().items()}, shard_state(opt), [LR * 0.5])

    def same_shard(a, b):
        return all(x[:3] == y[:3] and torch.equal(x[3], y[3]) and sorted(x[4]) == sorted(y[4])
                   and all(torch.equal(x[4][k], y[4][k]) for k in x[4]) for x, y in zip(a, b))

    def unchanged():
        return all(torch.equal(v, before[0][k]) for k, v in model.state_dict().items()) and same_shard(
            shard_state(opt), before[1]) and [g["lr"] for g in opt.param_groups] == before[2]

    def refused(case, call):
        out[case] = outcome(call)
        out[case + "/unchanged"] = unchanged()

    refused("app_state_rank1", lambda: pz.checkpoint.load(ckpt, model, opt, app_state={"pos": 0} if me == 0 else
                                                          {"zz": 0}))
    real = pz.checkpoint._read
    if me == 1:
        def unreadable(step_dir, meta):
            raise pz.checkpoint.CheckpointCorrupt(f"checkpoint file {step_dir}/rank00000.pt is unreadable (test)")
        pz.checkpoint._read = unreadable
    refused("unreadable_rank1", lambda: pz.checkpoint.load(ckpt, model, opt))
    pz.checkpoint._read = real
    meta_path = os.path.join(ckpt, "step_00000001", "meta.json")
    with open(meta_path) as f:
        meta = json.load(f)
    for case, key, value in [("negative_lr", "lr", -5.0), ("three_betas", "betas", [0.9, 0.99, 0.5]),
                             ("text_lr", "lr", "fast"), ("negative_wd", "weight_decay", -1.0)]:
        pz.barrier()
        if me == 0:
            with open(meta_path, "w") as f:
                json.dump(dict(meta, param_groups=[dict(meta["param_groups"][0], **{key: value})]), f)
        pz.barrier()
        refused(case, lambda: pz.checkpoint.load(ckpt, model, opt))
    pz.barrier()
    if me == 0:
        with open(meta_path, "w") as f:
            json.dump(meta, f)
    for name in ("foo", "", "../max"):
        pz.barrier()
        if me == 0:
            with open(os.path.join(ckpt, "latest"), "w") as f:
                f.write(name)
        pz.barrier()
        refused(f"latest_{name}", lambda: pz.checkpoint.load(ckpt, model, opt))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        out["fallback_step"] = pz.checkpoint.load(ckpt, model, opt, fallback=True)
    out["fallback_warnings"] = [str(w.message) for w in seen]
    out["loaded"] = ({k: v.clone() for k, v in model.state_dict().items()}, shard_state(opt))
    out["loaded_lr"] = [g["lr"] for g in opt.param_groups]
    out["saved"] = saved
    return out


def test_refused_loads_change_nothing_on_any_rank(tmp_path):
    ckpt = str(tmp_path / "ck")
    got = [r.value for r in run_ranks(_rank_refused_loads, 2, args=(ckpt,), timeout=90)]
    corrupt_meta = "step_00000001/meta.json': param_groups[0]"

    def both(kind, words):
        return kind, words, words
    want = {  # case: (exception, words on rank 0, words on rank 1)
        "app_state_rank1": ("ValueError", ["group rank(s) [1]", "holds no ['zz']", "nothing was loaded on any rank"],
                            ["holds no ['zz']", "nothing was loaded"]),
        "unreadable_rank1": ("CheckpointCorrupt", ["group rank(s) [1]", "unreadable (test)"], ["unreadable (test)"]),
        "negative_lr": both("CheckpointCorrupt", [corrupt_meta, "lr=-5.0", "AdamW rejects it", "learning rate"]),
        "three_betas": both("CheckpointCorrupt", [corrupt_meta + "['betas'] is [0.9, 0.99, 0.5]", "(0.9, 0.999)"]),
        "text_lr": both("CheckpointCorrupt", [corrupt_meta + "['lr'] is 'fast'"]),
        "negative_wd": both("CheckpointCorrupt", [corrupt_meta, "weight_decay=-1.0", "AdamW rejects it"]),
        "latest_foo": both("CheckpointCorrupt", ["latest' is damaged: it names 'foo'", "nothing was loaded"]),
        "latest_": both("CheckpointCorrupt", ["latest' is damaged: it names ''"]),
        "latest_../max": both("CheckpointCorrupt", ["latest' is damaged: it names '../max'"]),
    }
    for rank, out in enumerate(got):
        kind, msg = out["big_step"]
        assert kind == "ValueError" and "step: expected at most 2**62" in msg, msg
        assert out["max_step"] == 2**62
        for case, (etype, *words) in want.items():
            kind, msg = out[case]
            assert kind == etype and all(w in msg for w in words[rank]), (rank, case, kind, msg)
            assert out[case + "/unchanged"], (rank, case)
        assert out["fallback_step"] == 1
        assert len(out["fallback_warnings"]) == 1 and "'../max'" in out["fallback_warnings"][0]
        assert_same(out["loaded"][0], out["saved"][0])  # the weights saved, on every rank
        for a, b in zip(out["loaded"][1], out["saved"][1]):  # and this rank's shard: masters and moments
            assert a[:3] == b[:3] and torch.equal(a[3], b[3]) and sorted(a[4]) == sorted(b[4])
            assert all(torch.equal(a[4][k], b[4][k]) for k in a[4])
        assert out["loaded_lr"] == [LR]
    # consolidate and the command line refuse the damaged `latest` as clearly
    with pytest.raises(pz.checkpoint.CheckpointCorrupt, match="latest' is damaged: it names '../max'"):
        pz.checkpoint.consolidate(ckpt)
    with pytest.raises(SystemExit) as info:
        pz.checkpoint.main(["consolidate", ckpt, str(tmp_path / "full.pt")])
    assert "latest' is damaged: it names '../max'" in str(info.value.code) and not (tmp_path / "full.pt").exists()
