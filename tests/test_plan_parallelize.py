"""pz.parallelize on the bench GPT at 2 and 4 ranks equals one process: losses and gradients."""
import pytest
import torch

import pyzero as pz
from pyzero.bench.gpt import GPT, GPTConfig, random_batch
from pyzero.launch import run_ranks
from pyzero.plan import Layout, layer_activation_bytes, to_spec

CONFIG = GPTConfig(vocab_size=128, block_size=32, n_layer=4, n_head=4, n_embd=32)
BATCH, SEQ, LR, STEPS = 8, 16, 0.5, 3
CLIP = 0.3  # (below every step's gradient norm: each step clips)


def model():
    torch.manual_seed(0)
    return GPT(CONFIG)


def batch():
    return random_batch(CONFIG, BATCH, SEQ, seed=1)


def reference(clip=None):
    """One process, full batch: the first step's gradients and the losses of STEPS SGD steps (with
    `clip`: each clipped by torch.nn.utils.clip_grad_norm_, and its norms)."""
    m = model()
    opt = torch.optim.SGD(m.parameters(), lr=LR)
    x, y = batch()
    losses, grads, norms = [], None, []
    for _ in range(STEPS):
        loss = m(x, y)
        loss.backward()
        if grads is None:
            grads = {k: p.grad.clone() for k, p in m.named_parameters()}
        losses.append(loss.item())
        if clip is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(m.parameters(), clip)))
        opt.step()
        opt.zero_grad()
    return (losses, grads, norms) if clip is not None else (losses, grads)


def _clips(lay) -> bool:
    """Layouts whose ZeroOptimizer spans pipeline stages clip (its norm is the whole model's, the tied
    embedding counted once)."""
    return lay.pp > 1 and lay.stage > 0


def _rank(lay):
    pz.init(timeout=60)
    pm = pz.parallelize(model(), lay, torch.optim.SGD, lr=LR)
    x, y = batch()
    losses, grads, norms = [], None, []
    for _ in range(STEPS):
        losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
        if _clips(lay):
            norms.append(float(pm.optimizer.clip_grad_norm_(CLIP)))
        if grads is None and lay.stage == 0:  # ZeRO consumes or shards gradients; stage 0 keeps them whole
            grads = {}
            for name, child in pm.stage.named_children():
                for k, p in child.named_parameters():
                    grads[f"{name}.{k}"] = p.grad.clone()
        pm.optimizer.step()
        pm.optimizer.zero_grad()
    return dict(losses=losses, grads=grads, norms=norms, pp=pm.pp_index, dp=pm.dp_index, tp=pm.tp_index,
                last=pm.is_last)


def _reference_slice(ref, key, tp, r):
    """The single-process gradient that rank r of a TP group of size tp holds under `key`."""
    name, rest = key.split(".", 1)
    L = CONFIG.n_layer
    i = int(name)
    if i == 0:  # embedding stage
        return ref["wte.weight" if rest.startswith("wte") else "wpe.weight"]
    if i == L + 1:  # head: final LayerNorm and the tied weight
        return ref["wte.weight"] if rest == "weight" else ref[rest]
    g = ref[f"blocks.{i - 1}.{rest}"]
    k = g.shape[0] // tp if rest.startswith(("fc.", "qkv.")) else None
    if rest.startswith("fc."):
        return g[r * k:(r + 1) * k]
    if rest == "fc_proj.weight" or rest == "proj.weight":
        k = g.shape[1] // tp
        return g[:, r * k:(r + 1) * k]
    if rest.startswith("qkv."):  # rows regrouped per rank as [q_r | k_r | v_r]
        h = g.shape[0] // 3
        k = h // tp
        return torch.cat([g[j * h + r * k:j * h + (r + 1) * k] for j in range(3)])
    return g


LAYOUTS = [
    Layout(dp=2, micro_batch=4),
    Layout(tp=2, micro_batch=8),
    Layout(tp=2, sp=True, micro_batch=8),
    Layout(pp=2, micro_batch=4, micro_batches=2),
    Layout(dp=2, stage=1, micro_batch=4),
    Layout(dp=2, stage=2, micro_batch=4),
    Layout(dp=2, stage=3, micro_batch=4),
    Layout(tp=4, sp=True, micro_batch=8),
    Layout(dp=2, tp=2, sp=True, stage=2, micro_batch=4),
    Layout(dp=2, tp=2, stage=3, micro_batch=4),
    Layout(tp=2, pp=2, sp=True, micro_batch=2, micro_batches=4),
    Layout(dp=2, pp=2, micro_batch=2, micro_batches=2),
    Layout(dp=2, pp=2, stage=1, micro_batch=2, micro_batches=2),
    Layout(pp=4, micro_batch=2, micro_batches=4),
    Layout(dp=2, tp=2, sp=True, recompute="full", micro_batch=4),
    Layout(tp=2, sp=True, recompute="selective", micro_batch=8),
    Layout(dp=2, stage=3, recompute="full", micro_batch=4),
    Layout(tp=2, pp=2, recompute="full", micro_batch=2, micro_batches=4),
]


@pytest.fixture(scope="module")
def ref():
    return reference()


@pytest.mark.parametrize("lay", LAYOUTS, ids=str)
def test_parallelized_gpt_matches_one_process(lay, ref):
    ref_losses, ref_grads = ref
    n = lay.dp * lay.tp * lay.pp
    results = [r.value for r in run_ranks(_rank, n, args=(lay,), timeout=120)]
    if _clips(lay):  # ZeroOptimizer(pp_group=): every stage clips by the whole model's norm (was its own)
        ref_losses, _, ref_norms = reference(CLIP)
        for r in results:
            assert r["norms"] == pytest.approx(ref_norms, rel=1e-5), (r["pp"], r["dp"], r["norms"], ref_norms)
    # Each DP replica's loss is the mean over its half of the batch: their average is the full batch's.
    for step in range(STEPS):
        replicas = [r["losses"][step] for r in results if r["last"] and r["tp"] == 0]
        assert len(replicas) == lay.dp
        assert sum(replicas) / lay.dp == pytest.approx(ref_losses[step], rel=1e-5, abs=1e-6)
    if lay.stage == 0:
        checked = 0
        for r in results:
            for key, g in r["grads"].items():
                want = _reference_slice(ref_grads, key, lay.tp, r["tp"])
                torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"{key}: {m}")
                checked += 1
        assert checked >= 4 * 12


def _accumulating_rank(lay):
    """Two train_steps without zero_grad between them: the gradients of both batches, summed."""
    pz.init(timeout=60)
    pm = pz.parallelize(model(), lay, torch.optim.SGD, lr=LR)
    x, y = batch()
    for _ in range(2):
        pm.train_step(pm.local_batch(x), pm.local_batch(y))
    return {f"{name}.{k}": p.grad.clone() for name, child in pm.stage.named_children()
            for k, p in child.named_parameters()}, pm.tp_index


@pytest.mark.parametrize("lay", [Layout(pp=2, micro_batch=4, micro_batches=2), Layout(dp=2, micro_batch=4),
                                 Layout(tp=2, micro_batch=8)], ids=str)
def test_gradients_accumulate_over_train_steps(lay, ref):
    """Gradient accumulation: each train_step adds its batch's gradients, the tied embedding's
    included (summed over the first and last stage once per step, not again with the earlier steps')."""
    _, ref_grads = ref
    for r in run_ranks(_accumulating_rank, 2, args=(lay,), timeout=120):
        grads, tp = r.value
        for key, g in grads.items():
            want = 2 * _reference_slice(ref_grads, key, lay.tp, tp)
            torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-6, msg=lambda m: f"rank {r.rank} {key}: {m}")


def _microbatch_rank(lay):
    """One train_step; the batch sizes the model's forward saw, the loss and the gradients."""
    pz.init(timeout=60)
    pm = pz.parallelize(model(), lay, torch.optim.SGD, lr=LR)
    seen = []
    pm.stage[0].register_forward_pre_hook(lambda mod, args: seen.append(args[0].shape[0]))
    x, y = batch()
    losses = [pm.train_step(pm.local_batch(x), pm.local_batch(y))]
    grads = {f"{name}.{k}": p.grad.clone() for name, child in pm.stage.named_children()
             for k, p in child.named_parameters()} if lay.stage == 0 else None
    pm.optimizer.step()  # the second loss checks the step the accumulated gradients made (ZeRO's too)
    pm.optimizer.zero_grad()
    losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
    return seen[:lay.micro_batches], losses, grads, pm.tp_index


def _stage2_calls_rank(lay):
    pz.init(timeout=60)
    pm = pz.parallelize(model(), lay, torch.optim.SGD, lr=LR)
    x, y = batch()
    pz.comm_stats(reset=True)
    pm.train_step(pm.local_batch(x), pm.local_batch(y))
    pm.optimizer.step()
    stats = pz.comm_stats()
    return {op: stats.get(op, {}).get("calls", 0) for op in ("reduce_scatter", "all_gather")}


def test_stage2_micro_batches_reduce_as_the_cost_model_counts():
    """ZeRO-2 over m micro-batches reduce-scatters in each one's backward (its gradients accumulate in the
    shards) and gathers after the step: what pyzero.plan's collective_calls counts (it counted one)."""
    from pyzero.plan import Cluster, to_spec
    from pyzero.plan.cost import collective_calls

    lay = Layout(dp=2, stage=2, micro_batch=1, micro_batches=4)
    got = run_ranks(_stage2_calls_rank, 2, args=(lay,), timeout=120)[0].value
    assert got == {"reduce_scatter": 4, "all_gather": 1}, got  # (one bucket: the model is small)
    c = Cluster(world=2, gpus_per_host=2, device_memory=80e9, flops=1e12)
    assert collective_calls(to_spec(model()), c, lay) == sum(got.values())


@pytest.mark.parametrize("lay", [Layout(dp=2, micro_batch=2, micro_batches=2),
                                 Layout(tp=2, sp=True, micro_batch=2, micro_batches=4),
                                 Layout(dp=2, stage=2, micro_batch=1, micro_batches=4),
                                 Layout(dp=2, stage=3, micro_batch=2, micro_batches=2)], ids=str)
def test_micro_batches_without_pipelining_accumulate(lay, ref):
    """A layout of m micro-batches without pipelining (the planner's gradient accumulation, whose
    activation memory it predicts for one micro-batch) runs m forwards of micro_batch rows each;
    the step's loss and gradients equal one process's full batch."""
    ref_losses, ref_grads = ref
    results = [r.value for r in run_ranks(_microbatch_rank, 2, args=(lay,), timeout=120)]
    for seen, losses, grads, tp in results:
        assert seen == [lay.micro_batch] * lay.micro_batches
        for key, g in (grads or {}).items():
            torch.testing.assert_close(g, _reference_slice(ref_grads, key, lay.tp, tp), rtol=1e-4, atol=1e-6,
                                       msg=lambda m: f"{key}: {m}")
    for step in range(2):  # each DP replica's loss is the mean over its half of the batch
        replicas = [r[1][step] for r in results if r[3] == 0]
        assert sum(replicas) / len(replicas) == pytest.approx(ref_losses[step], rel=1e-5)


def _bad_rank(lay):
    pz.init(timeout=60)
    try:
        pz.parallelize(model(), lay)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize("lay,word", [
    (Layout(dp=4), "world size"),
    (Layout(pp=2, stage=2, micro_batches=2), "stage 2 with pp=2"),
    (Layout(dp=2, stage=1, offload="cpu"), "offload"),
])
def test_bad_plan_fails_on_every_rank(lay, word):
    for r in run_ranks(_bad_rank, 2, args=(lay,), timeout=60):
        assert r.value is not None and word in r.value


def _saved_bytes(recompute):
    """Bytes autograd keeps for backward during one forward of the parallelized model (one rank)."""
    pz.init(timeout=60)
    pm = pz.parallelize(model(), Layout(micro_batch=BATCH, recompute=recompute), torch.optim.SGD, lr=LR)
    x, _ = batch()
    seen = {}

    def pack(t):
        seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        pm(x)
    return sum(seen.values())


def test_recomputation_keeps_less_for_backward():
    none, selective, full = (run_ranks(_saved_bytes, 1, args=(rc,), timeout=60)[0].value
                             for rc in ("none", "selective", "full"))
    assert full < selective <= none
    # Per layer, a block keeps Korthikanti et al.'s 34sbh bytes of 16-bit activations: 16 values of sbh
    # and two 1-byte dropout masks. The bench GPT has no dropout, runs in fp32 (4 bytes a value) and uses
    # fused SDPA (no 5as/h score term); its SDPA also keeps its output and the head merge a copy, which
    # the paper's count lacks: measured within 25% of the formula's 16 values.
    spec = to_spec(model(), seq=SEQ, batch=BATCH).with_(fused_attention=True)
    s, b, h = SEQ, BATCH, CONFIG.n_embd
    kept = (none - full) / CONFIG.n_layer + 4 * s * b * h  # full recomputation still keeps the input
    want = 2 * (layer_activation_bytes(spec, BATCH) - 2 * s * b * h)  # 16-bit values without masks, in fp32
    assert want == 16 * 4 * s * b * h
    assert want <= kept <= 1.25 * want
