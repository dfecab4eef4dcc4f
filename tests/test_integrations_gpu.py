"""pyzero.integrations.hf on CUDA (scripts/gpu_check.sh; skipped without a GPU): transformers.Trainer
at 2 processes sharing GPU 0 over pyzero's ipc backend (MPS where the check starts it).

As tests/test_integrations_hf.py does on CPU ranks: the Trainer's own run (torch DDP and torch
AdamW) is the reference for PyzeroTrainer with "dp", "zero1"-"zero3" and "zero2" with CPU offload
(the logged losses, the clipped steps' logged gradient norms, the final weights), and for bf16 with
ZeRO-2/3. Torch DDP here reduces over the torch backend "pyzero" (NCCL refuses two ranks on one
GPU), whose CUDA calls tests/test_torch_backend_gpu.py checks against CPU ones. hf.init puts the
Trainer's own CUDA collectives (the gathered loss it logs) on "pyzero" beside the ipc backend.
"""
import functools
import os

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from pyzero.integrations import hf  # noqa: E402
from pyzero.launch import run_ranks  # noqa: E402

from compare_runs import assert_bf16_tracks, assert_same_run  # noqa: E402
from test_integrations_hf import BF16_SHARE, MAX_NORM, finish, train as train_any  # noqa: E402

pytestmark = pytest.mark.gpu
ENV = {"CUDA_VISIBLE_DEVICES": "0"}
train = functools.partial(train_any, use_cpu=False)  # every run on the GPU


def _rank_trainer(out):
    # accelerate hands torch DDP device_ids=[LOCAL_RANK] (the reference run): GPU 1 for the second process,
    # which shares GPU 0 here; without device_ids DDP computes on the model's device, GPU 0
    os.environ["ACCELERATE_BYPASS_DEVICE_MAP"] = "true"
    hf.init(backend="ipc", timeout=60)
    backend = str(dist.get_backend())
    runs = {"ddp": train(out)}
    for strategy in hf.STRATEGIES:
        runs[strategy] = train(out, hf.PyzeroTrainer, strategy=strategy)
    runs["zero2_offload"] = train(out, hf.PyzeroTrainer, strategy="zero2", strategy_options={"offload": "cpu"})
    bf16 = {"ddp_fp32": train(out, steps=3), "ddp": train(out, steps=3, bf16=True)}
    for strategy in ("zero2", "zero3"):
        bf16[strategy] = train(out, hf.PyzeroTrainer, steps=3, bf16=True, strategy=strategy)
    torch.cuda.synchronize()
    return finish({"backend": backend, "runs": runs, "bf16": bf16})


@pytest.mark.timeout(280)  # eleven Trainer runs at 2 processes: more than gpu_check.sh's 90 s per test
def test_trainer_on_one_gpu_matches_ddp(tmp_path):
    got = run_ranks(_rank_trainer, 2, args=(str(tmp_path),), start="spawn", timeout=300, env=ENV)[0].value
    assert "cuda:pyzero" in got["backend"], got["backend"]
    runs = got["runs"]
    ref = runs.pop("ddp")
    assert min(ref["grad_norm"]) > 5 * MAX_NORM  # every step clipped
    assert set(runs) == {"dp", "zero1", "zero2", "zero3", "zero2_offload"}
    for name, run in {"ddp": ref, **runs}.items():
        assert run["device"] == "cuda:0", (name, run["device"])
    for name, run in runs.items():
        assert_same_run(run, ref, name)
    bf16 = got["bf16"]
    fp32, bf16_ref = bf16.pop("ddp_fp32")["weights"], bf16.pop("ddp")
    assert_bf16_tracks(bf16, bf16_ref, fp32, BF16_SHARE)
