"""The DeepSpeed rows of pyzero-bench train / capacity (pyzero/bench/ds_runs.py): the configs they
give DeepSpeed, as DeepSpeed's own config parser reads them; ZenFlow's weights kept through
deepspeed.initialize; the loss-curve table. DeepSpeed's tests skip where it is not installed."""
import argparse
import json

import pytest
import torch

from pyzero.bench import ds_runs
from pyzero.bench.common import UsageError
from pyzero.bench import train as bench


def _parse(variant, **kw):
    pytest.importorskip("deepspeed")
    from deepspeed.runtime.config import DeepSpeedConfig

    return DeepSpeedConfig(ds_runs.config(variant, batch=8, bucket_bytes=25 << 20, cuda=True, **kw))


def test_zenflow_config_is_deepspeeds_tutorial_setup():
    """ds-zenflow: stage 2, the optimizer on the CPU pinned, and the zenflow block's values as
    DeepSpeed's parser reads them (the tutorial's; select_* left at "auto")."""
    c = _parse("zenflow")
    z = c.zero_config
    assert z.stage == 2 and z.offload_optimizer.device == "cpu" and z.offload_optimizer.pin_memory
    assert not z.offload_optimizer.super_offload
    zf = z.zenflow
    assert (zf.topk_ratio, zf.update_interval, zf.full_warm_up_rounds, zf.overlap_step) == (0.1, 4, 0, True)
    assert (zf.select_strategy, zf.select_interval) == ("auto", "auto")
    assert z.reduce_bucket_size == (25 << 20) // 4 and c.train_micro_batch_size_per_gpu == 8
    assert c.optimizer_name == "adamw" and c.optimizer_params["weight_decay"] == 0.01
    assert c.optimizer_params["lr"] == 1e-4 and not c.bfloat16_config.enabled


def test_superoffload_config_is_deepspeeds_example_setup():
    """ds-superoffload: stage 3 with offload_optimizer.super_offload, the example's ratio and cores."""
    z = _parse("superoffload").zero_config
    assert z.stage == 3 and z.zenflow is None and not z.overlap_comm
    o = z.offload_optimizer
    assert (o.device, o.pin_memory, o.super_offload, o.ratio, o.cpuadam_cores_perc) == ("cpu", True, True, 0.9, 0.9)
    assert z.sub_group_size == (25 << 20) // 4


def test_zero2_offload_config_has_no_zenflow():
    z = _parse("zero2-offload", bf16=True)
    assert z.zero_config.zenflow is None and z.zero_config.offload_optimizer.device == "cpu"
    assert z.bfloat16_config.enabled
    assert _parse("zero2").zero_config.offload_optimizer is None


def test_config_rejects_an_unknown_variant():
    with pytest.raises(ValueError, match="variant: expected one of"):
        ds_runs.config("zero3", batch=1, bucket_bytes=1 << 20, cuda=False)


class _FlatOpt:
    """What _repair_zenflow_views reads of DeepSpeed's ZeRO-1/2 optimizer: a flat buffer holding a
    2-D weight column after column (ZenFlow's flatten) and a bias, each weight viewing it wrongly."""

    def __init__(self, w, b):
        self.bit16_groups_flat = [torch.cat([w.t().reshape(-1), torch.zeros(2), b])]  # 2 elements of padding
        flat = self.bit16_groups_flat[0]
        self.pw = torch.nn.Parameter(flat[:w.numel()].view(w.shape))  # DeepSpeed 0.19.8's row-major view
        self.pb = torch.nn.Parameter(flat[w.numel() + 2:].view(b.shape))
        self.round_robin_bit16_groups = [[self.pw, self.pb]]
        self.round_robin_bit16_meta = [[torch.empty(w.shape, device="meta"), torch.empty(b.shape, device="meta")]]
        self.round_robin_bit16_offsets = [[0, w.numel() + 2]]


def test_repair_zenflow_views_points_weights_at_their_columns():
    w, b = torch.arange(12.0).reshape(3, 4), torch.tensor([-1.0, -2.0])
    opt = _FlatOpt(w, b)
    assert not torch.equal(opt.pw, w)  # the fault being repaired
    ds_runs._repair_zenflow_views(opt)
    assert torch.equal(opt.pw, w) and torch.equal(opt.pb, b)
    opt.bit16_groups_flat[0].mul_(2)  # the weights still view the flat buffer the optimizer writes
    assert torch.equal(opt.pw, 2 * w) and torch.equal(opt.pb, 2 * b)
    probe = ds_runs._probe([opt.pw, opt.pb])
    assert ds_runs._kept([opt.pw, opt.pb], probe)
    opt.pw.data = opt.pw.data.t().contiguous().view(3, 4)
    assert not ds_runs._kept([opt.pw, opt.pb], probe)


def test_loss_curves_table():
    """Side by side, blanks past a run's last step, the largest difference from the first run's
    over the steps both took (NaN left out) and where it is."""
    nan = float("nan")
    out = bench.loss_curves([{"run": "torch-local", "losses": [5.0, 4.0, 3.0]},
                             {"run": "ds-zenflow", "losses": [5.0, 4.5, nan, 2.0]}]).splitlines()
    assert out[0].split() == ["step", "torch-local", "ds-zenflow"]
    assert out[1].split() == ["1", "5.00000", "5.00000"] and out[3].split() == ["3", "3.00000", "nan"]
    assert out[4].split() == ["4", "2.00000"]
    ref, zen = out[-2].split(), out[-1].split()
    assert ref[:4] == ["torch-local", "3", "0.000e+00", "3"]
    # max |d| 0.5 at step 2; the last step both took (3) is NaN for ds-zenflow
    assert zen[:4] == ["ds-zenflow", "4", "5.000e-01", "2"] and zen[4] == "nan" and float(zen[5]) == 3.0


def test_superoffload_needs_cuda(monkeypatch):
    monkeypatch.setattr(ds_runs, "available", lambda: True)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    with pytest.raises(UsageError, match="ds-superoffload: DeepSpeed's SuperOffload runs on CUDA only"):
        bench.main(parser.parse_args(["--runs", "torch-local,ds-superoffload", "--nproc", "1"]))


def test_bench_zenflow_with_full_warm_up_trains_as_plain_torch(tmp_path, monkeypatch):
    """With full_warm_up_rounds covering every step and overlap_step off (on, the CPU's update lands
    a step late) ZenFlow steps every gradient at once: plain AdamW. The ds-zenflow row (its weights
    pointed at ZenFlow's layout, see ds_runs) then gives torch's loss at every step."""
    pytest.importorskip("deepspeed")
    monkeypatch.setattr(ds_runs, "ZENFLOW", dict(ds_runs.ZENFLOW, full_warm_up_rounds=1000, overlap_step=False))  # (forked ranks)
    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "train.json"
    args = parser.parse_args(["--model", "gpt-nano", "--runs", "torch-local,ds-zenflow", "--nproc", "1", "--iters", "2",
                              "--warmup", "2", "--seq", "16", "--timeout", "600", "--json", str(out), "--losses"])
    assert bench.main(args) == 0
    local, zen = json.loads(out.read_text())["results"]
    assert zen["run"] == "ds-zenflow" and len(zen["losses"]) == len(local["losses"]) >= 9
    assert zen["losses"][-1] < zen["losses"][0] - 0.05  # it trains
    assert zen["losses"] == pytest.approx(local["losses"], rel=2e-5)
