"""torch.compile of models that use pyzero: the torch.ops.pyzero operators (pyzero/ops.py).

A model with pz.tp layers, one wrapped in pz.DataParallel, and one trained by
ZeroOptimizer (stages 1-3) are compiled (backend "aot_eager": AOTAutograd's
forward and backward graphs, run by eager kernels, which keeps the test fast on
two cores) on 2 ranks over shm. Each must trace with no graph break
(torch._dynamo.explain), put pyzero's collectives in the graph as operators,
and give exactly the eager run's outputs, gradients and updated weights; the
eager runs are in turn checked against plain single-process torch.
"""
import subprocess
import sys

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported once here, not in every forked rank)
import torch.nn.functional as F
from torch import nn
from torch._dynamo.backends.registry import lookup_backend
from torch._subclasses.fake_tensor import FakeTensorMode

import pyzero as pz
from pyzero.launch import run_ranks
from test_tp import BATCH, HIDDEN, MLP, SEQ, make_mlp

EXACT = dict(rtol=0, atol=0)
TOL = dict(rtol=1e-5, atol=2e-6)


def pyzero_ops(graphs):
    """Names of the pyzero operators in fx graphs, nested ones (autograd functions) included."""
    return {str(n.target) for gm in graphs for sub in gm.modules() if isinstance(sub, torch.fx.GraphModule)
            for n in sub.graph.nodes if str(n.target).startswith("pyzero.")}


def explain(fn, *args):
    """(graph breaks, their reasons, the pyzero operators in the traced graphs)."""
    torch._dynamo.reset()
    e = torch._dynamo.explain(fn)(*args)
    return e.graph_break_count, [str(r.reason) for r in e.break_reasons], pyzero_ops(e.graphs)


def compile_whole(model, seen: set):
    """torch.compile(fullgraph=True): any graph break raises. `seen` collects the pyzero operators."""
    aot_eager = lookup_backend("aot_eager")

    def backend(gm, example_inputs):
        seen.update(pyzero_ops([gm]))
        return aot_eager(gm, example_inputs)
    return torch.compile(model, backend=backend, fullgraph=True)


def assert_same(a, b, what, **tol):
    torch.testing.assert_close(a, b, **(tol or EXACT), msg=lambda m: f"{what}: {m}")


# ---------------------------------------------------------------------------
# The operators alone


def test_import_pyzero_registers_no_operator():
    code = ("import sys, torch, pyzero\n"
            "assert 'pyzero.ops' not in sys.modules\n"
            "assert not hasattr(torch.ops.pyzero, 'all_reduce')\n"
            "import pyzero.ops\n"
            "assert torch.ops.pyzero.all_reduce.default is not None\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_fake_implementations_give_shapes_without_communicating():
    import pyzero.ops as ops
    g = pz.Group((0, 1, 2), 1, 99)  # no transport: a fake implementation must not need one
    assert pz.comm.group_by_name(g.name) is g
    with FakeTensorMode():
        x, w = torch.empty(6, 2, 5), torch.empty(4, 5)
        cases = [(ops.all_reduce(x, "sum", g.name), (6, 2, 5)),
                 (ops.all_gather_into_tensor(x, 3, g.name), (18, 2, 5)),
                 (ops.reduce_scatter_tensor(x, "avg", 3, g.name), (2, 2, 5)),
                 (ops.broadcast(x.double(), 1, g.name), (6, 2, 5)),
                 (ops.all_gather_matmul(x, w, g.name), (18, 2, 4)),
                 (ops.matmul_reduce_scatter(x, w, g.name), (2, 2, 4)),
                 (ops.linear_all_reduce(x, w, g.name), (6, 2, 4))]
        for out, shape in cases:
            assert tuple(out.shape) == shape and out.is_contiguous()
        assert cases[3][0].dtype == torch.float64
        dx, dw = torch.ops.pyzero.all_gather_matmul_backward(torch.empty(18, 2, 4), x, w, g.name)
        assert (tuple(dx.shape), tuple(dw.shape)) == ((6, 2, 5), (4, 5))
        with pytest.raises(ValueError, match="x: dim 0 \\(7\\) is not divisible by the group size 3"):
            ops.reduce_scatter_tensor(torch.empty(7, 2), "sum", 3, g.name)


def test_unknown_group_name_is_a_clear_error():
    with pytest.raises(ValueError, match="group: no pyzero group named 'nope'"):
        pz.comm.group_by_name("nope")


def rank_opcheck():
    pz.init()
    import pyzero.ops as ops
    name, r = pz.comm.resolve_group(None).name, pz.get_rank()
    x = torch.arange(12.0).view(4, 3) + 10 * r
    w = torch.randn(5, 3, generator=torch.Generator().manual_seed(r)).requires_grad_()
    xg = x.clone().requires_grad_()  # the tensor-parallel matmuls are differentiable
    # schema, fake vs real, autograd registration, AOT dispatch (the same calls in the same order on
    # both ranks); one of each kind: mutating, mutating a list, differentiable, fused differentiable
    checks = [(ops.all_reduce_, (x.clone(), "max", name)),
              (ops.broadcast_coalesced_, ([x.clone(), x[:2].double()], 0, name)),
              (ops.reduce_scatter_tensor, (xg, "sum", 2, name)), (ops.all_gather_matmul, (xg, w, name))]
    for op, args in checks:
        torch.library.opcheck(op, args)
    # The matmuls' backward ops return contiguous gradients whatever the strides of x and the weight
    # (batch-first data transposed to (seq, batch, hidden)): their fake kernels must say so, or a
    # compiled backward (inductor) fails its stride checks.
    xt = torch.randn(3, 4, 3, generator=torch.Generator().manual_seed(5 + r)).transpose(0, 1)  # (4, 3, 3)
    wt = torch.randn(3, 5, generator=torch.Generator().manual_seed(7)).t()  # (5, 3), not contiguous
    back = [(ops.linear_all_reduce_backward, (torch.ones(4, 3, 5), xt, wt, name)),
            (ops.all_gather_matmul_backward, (torch.ones(8, 3, 5), xt, wt, name)),
            (ops.matmul_reduce_scatter_backward, (torch.ones(2, 3, 5), xt, wt, name))]
    for op, args in back:
        torch.library.opcheck(op, args, test_utils=("test_faketensor",))
    # The values, against plain torch on both ranks' inputs (rank q's x is arange + 10 q).
    xs = [torch.arange(12.0).view(4, 3) + 10 * q for q in range(2)]
    y = ops.all_reduce(x, "sum", name)
    assert_same(y, xs[0] + xs[1], "all_reduce")
    assert_same(ops.all_gather_into_tensor(x.detach(), 2, name), torch.cat(xs), "all_gather_into_tensor")
    assert_same(ops.reduce_scatter_tensor(x.detach(), "sum", 2, name), (xs[0] + xs[1])[2 * r:2 * r + 2],
                "reduce_scatter_tensor")
    assert_same(ops.broadcast(x.detach(), 1, name), xs[1], "broadcast")
    t = [x.detach().clone(), torch.tensor([r == 0, r == 1])]
    ops.broadcast_coalesced_(t, 0, name)
    assert_same(t[0], xs[0], "broadcast_coalesced_")
    assert t[1].tolist() == [True, False]
    return True


def test_operators_pass_opcheck_and_match_plain_torch():
    assert all(res.value for res in run_ranks(rank_opcheck, 2, timeout=120))


# ---------------------------------------------------------------------------
# Tensor parallelism


def tp_data():
    g = torch.Generator().manual_seed(1)
    return torch.randn(SEQ, BATCH, HIDDEN, generator=g), torch.randn(SEQ, BATCH, HIDDEN, generator=g)


def tp_run(model, x, t, sp, params=None):
    """Output (whole sequence), input gradient and parameter gradients of sum(model(x) * t)
    (the parameters of `params`, by default the model)."""
    x = x.clone().requires_grad_()
    h = pz.tp.scatter_to_sp(x) if sp else x
    y = model(h)
    y = pz.tp.gather_from_sp(y, reduce_grad=False) if sp else y
    (y * t).sum().backward()
    return y.detach(), x.grad, {n: p.grad.clone() for n, p in (params or model).named_parameters()}


TP_CONFIGS = {"overlap,sp": dict(overlap=True, sequence_parallel=True),
              "overlap": dict(overlap=True, sequence_parallel=False),
              "sp": dict(overlap=False, sequence_parallel=True),
              "plain": dict(overlap=False, sequence_parallel=False),
              "gather_output": ({"gather_output": True, "overlap": False}, {"input_is_parallel": False})}


def rank_tp():
    pz.init()
    x, t = tp_data()
    out = {}
    for config, opts in TP_CONFIGS.items():
        col_opts, row_opts = opts if isinstance(opts, tuple) else (opts, opts)
        ref = make_mlp()
        model = MLP(pz.tp.ColumnParallelLinear.from_linear(ref.fc1, **col_opts),
                    pz.tp.RowParallelLinear.from_linear(ref.fc2, **row_opts))
        sp = col_opts.get("sequence_parallel", False)
        eager = tp_run(model, x, t, sp)
        model.zero_grad()
        seen = set()
        compiled = tp_run(compile_whole(model, seen), x, t, sp, model)
        out[config] = seen, eager, compiled
    return out


def in_child(fn, *args):
    """fn(*args) in a forked process: a backward here would start autograd's device threads (a CUDA torch),
    after which torch refuses autograd in the ranks this process forks next."""
    return run_ranks(fn, 1, args=args, timeout=60)[0].value


def tp_run_reference():
    return tp_run(make_mlp(), *tp_data(), False)


def test_tp_layers_compile_without_graph_breaks():
    results = run_ranks(rank_tp, 2, timeout=180)
    y_ref, dx_ref, grads_ref = in_child(tp_run_reference)
    for res in results:
        for config, (seen, eager, compiled) in res.value.items():
            where = f"rank {res.rank}, {config}"
            assert seen, f"{where}: no pyzero operator in the graph"
            (ye, dxe, ge), (yc, dxc, gc) = eager, compiled
            assert_same(yc, ye, f"{where} output")
            assert_same(dxc, dxe, f"{where} input grad")
            for n in ge:
                assert_same(gc[n], ge[n], f"{where} grad {n}")
            # the eager run itself against one process: shards are chunks of the full gradients
            assert_same(ye, y_ref, f"{where} output vs one process", **TOL)
            assert_same(dxe, dx_ref, f"{where} input grad vs one process", **TOL)
            assert_same(ge["fc1.weight"], grads_ref["fc1.weight"].chunk(2, 0)[res.rank], where, **TOL)
            assert_same(ge["fc2.weight"], grads_ref["fc2.weight"].chunk(2, 1)[res.rank], where, **TOL)
    seen = set().union(*(v[0] for v in results[0].value.values()))
    assert {"pyzero.all_gather_matmul.default", "pyzero.matmul_reduce_scatter.default",
            "pyzero.linear_all_reduce.default", "pyzero.all_reduce.default",
            "pyzero.all_gather_into_tensor.default", "pyzero.reduce_scatter_tensor.default"} <= seen, seen


# ---------------------------------------------------------------------------
# DataParallel and ZeroOptimizer: three training steps, each rank on its own batch


def make_net(bn=False):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16) if bn else nn.Tanh(), nn.ReLU(), nn.Linear(16, 4))


def batch(rank, step):
    g = torch.Generator().manual_seed(100 * rank + step)
    return torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)


def train(model, opt, steps, rank, accumulate=False, device="cpu"):
    """Outputs of each step's forward; with `accumulate`, step 1 accumulates two batches (no_sync first)."""
    outs = []
    for s in range(steps):
        if accumulate and s == 1:
            with model.no_sync():
                x, t = (v.to(device) for v in batch(rank, 10))
                F.mse_loss(model(x), t).backward()
        x, t = (v.to(device) for v in batch(rank, s))
        y = model(x)
        F.mse_loss(y, t).backward()
        opt.step()
        opt.zero_grad()
        outs.append(y.detach().cpu().clone())
    return outs


def reference_outputs(steps, ranks, accumulate=False):
    """Plain torch, one process: the average of the ranks' gradients, AdamW."""
    model = make_net()
    opt = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.1)
    outs = {r: [] for r in range(ranks)}
    for s in range(steps):
        for r in range(ranks):
            extra = [batch(r, 10)] if accumulate and s == 1 else []
            for x, t in extra + [batch(r, s)]:
                y = model(x)
                (F.mse_loss(y, t) / ranks).backward()
            outs[r].append(y.detach())
        opt.step()
        opt.zero_grad()
    return outs


def rank_train(kind, steps, device="cpu"):
    """Eager, then compiled: each step's outputs and the weights after them. On "cuda" the ranks
    share GPU 0 over the ipc backend."""
    pz.init(backend="ipc" if device == "cuda" else None)
    r = pz.get_rank()
    res = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        net = make_net(bn=kind == "dp_bn").to(device)
        if kind.startswith("dp"):
            model = pz.DataParallel(net, bucket_mb=0.0002, first_bucket_mb=0.0001)
            opt = torch.optim.AdamW(net.parameters(), lr=0.05, weight_decay=0.1)
        else:
            stage, extra = int(kind[4]), {}
            if kind.endswith("qw"):
                extra = dict(zero_quantized_weights=True)
            model = net
            opt = pz.ZeroOptimizer(net, torch.optim.AdamW, stage=stage, lr=0.05, weight_decay=0.1, **extra)
        run = model
        if compiled and kind.endswith("qw"):  # graph breaks expected: see the test
            res["explain"] = explain(model, batch(r, 0)[0].to(device))
            run = torch.compile(model, backend="aot_eager")
        elif compiled:
            res["ops"] = set()
            run = compile_whole(model, res["ops"])
        torch._dynamo.utils.counters.clear()
        res[compiled] = train(run, opt, steps, r, accumulate=kind == "dp", device=device)
        # the weights after the steps (ZeRO: this rank's fp32 master shards)
        weights = net.parameters() if kind.startswith("dp") else [m for _, m, _ in opt.shards()]
        res[compiled, "weights"] = [w.detach().cpu().clone() for w in weights]
        if compiled:
            res["graphs"] = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    return res


@pytest.mark.parametrize("kind", ["dp", "dp_bn", "zero1", "zero2", "zero3"])
def test_data_parallel_and_zero_compile_without_graph_breaks(kind):
    steps = 3
    results = run_ranks(rank_train, 2, args=(kind, steps), timeout=180)
    ref = in_child(reference_outputs, steps, 2, kind == "dp") if kind != "dp_bn" else None
    check_trained(results, kind, steps, ref, "vs one process", **TOL)


def check_trained(results, kind, steps, ref, versus, **tol):
    """rank_train's results: the operators in the graph, how many graphs, compiled equal to eager
    exactly, and (where `ref` is given) eager equal to one process within `tol`."""
    for res in results:
        if kind in ("dp_bn", "zero3"):  # the buffers' broadcast, the units' gathers
            want = "broadcast_coalesced_" if kind == "dp_bn" else "all_gather_into_tensor"
            assert f"pyzero.{want}.default" in res.value["ops"], f"rank {res.rank}: {res.value['ops']}"
        # forwards of the training steps (with no_sync: one more graph, for sync off)
        assert res.value["graphs"] <= (2 if kind == "dp" else 1), res.value["graphs"]
        for k, (we, wc) in enumerate(zip(res.value[False, "weights"], res.value[True, "weights"])):
            assert_same(wc, we, f"rank {res.rank} weights {k} after {steps} steps, compiled vs eager")
        for s, (ye, yc) in enumerate(zip(res.value[False], res.value[True])):
            assert_same(yc, ye, f"rank {res.rank} step {s} compiled vs eager")
            if ref is not None:
                assert_same(ye, ref[res.rank][s], f"rank {res.rank} step {s} {versus}", **tol)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", ["dp", "zero2", "zero3"])
def test_data_parallel_and_zero_compile_on_the_gpu(kind):
    """The same on CUDA tensors: 2 processes on GPU 0 over the ipc backend (scripts/gpu_check.sh runs
    them under MPS). Compiled against eager on the GPU, exactly (aot_eager runs the eager kernels), and
    the eager run against one CPU process within float tolerance."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    steps = 3
    results = run_ranks(rank_train, 2, args=(kind, steps, "cuda"), start="spawn", timeout=300,
                        env={"CUDA_VISIBLE_DEVICES": "0"})
    ref = reference_outputs(steps, 2, accumulate=kind == "dp")  # (here: its ranks were spawned, not forked)
    check_trained(results, kind, steps, ref, "on the GPU vs one CPU process", rtol=1e-4, atol=1e-5)


def test_zero3_outside_the_traced_configuration_runs_its_hooks_at_graph_breaks():
    """ZeRO++ int8 weight gathers: the eager hooks, between compiled regions."""
    for res in run_ranks(rank_train, 2, args=("zero3_qw", 2), timeout=180):
        breaks, reasons, ops = res.value["explain"]
        assert not ops  # the int8 gathers stay out of the graphs, in the eager hooks
        # (torch >= 2.13 breaks the graph around them; 2.11 leaves those modules out of the traced frame)
        assert breaks > 0 or torch.__version__ < "2.13", res.value["explain"]
        for s, (ye, yc) in enumerate(zip(res.value[False], res.value[True])):
            assert_same(yc, ye, f"rank {res.rank} step {s} compiled vs eager")


# ---------------------------------------------------------------------------
# ZeRO's own code reached from a compiled region


class TiedHead(nn.Module):
    """An output head that reads the embedding's weight outside the embedding's forward (a tied head)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.fc = nn.Embedding(10, 8), nn.Linear(8, 8)

    def forward(self, idx):
        return F.linear(torch.tanh(self.fc(self.emb(idx))), self.emb.weight)


def _forward_backward_clip(net, x, t):
    loss = F.mse_loss(net(x), t)
    loss.backward()  # (dynamo breaks the graph here; ZeRO's gradient hooks run in this backward)
    return loss.detach(), torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)


def rank_zero_from_compiled_code(stage):
    """Eager then compiled: forward, backward and torch's clip_grad_norm_ in one compiled function, then
    step(); then a backward, a compiled model.zero_grad(), another backward and step(). Stage 3: a tied
    head compiled."""
    pz.init()
    r = pz.get_rank()
    out = {}
    for compiled in (False, True):
        torch._dynamo.reset()
        net = make_net()
        opt = pz.ZeroOptimizer(net, torch.optim.SGD, stage=stage, lr=0.1)
        fbc = torch.compile(_forward_backward_clip, backend="aot_eager") if compiled else _forward_backward_clip
        zero_grad = torch.compile(net.zero_grad, backend="aot_eager") if compiled else net.zero_grad
        norms = []
        for s in range(2):
            _, norm = fbc(net, *batch(r, s))
            norms.append(float(norm))
            opt.step()
            opt.zero_grad()
        F.mse_loss(net(batch(r, 5)[0]), batch(r, 5)[1]).backward()  # dropped by the zero_grad below
        zero_grad()
        F.mse_loss(net(batch(r, 6)[0]), batch(r, 6)[1]).backward()
        opt.step()
        with torch.no_grad(), opt.gathered_parameters():
            out[compiled] = norms, [p.detach().clone() for p in net.parameters()]
    if stage == 3:
        torch._dynamo.reset()
        net = TiedHead()
        opt = pz.ZeroOptimizer(net, torch.optim.SGD, stage=3, lr=0.1)
        idx = torch.randint(0, 10, (4, 3), generator=torch.Generator().manual_seed(r))
        torch.compile(net, backend="aot_eager")(idx).square().mean().backward()
        try:
            opt.step()
            out["tied"] = "stepped"
        except RuntimeError as e:
            out["tied"] = str(e)
    return out


def reference_zero_from_compiled_code():
    net = make_net()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    norms = []
    for s in range(2):
        for r in range(2):
            (F.mse_loss(net(batch(r, s)[0]), batch(r, s)[1]) / 2).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), 0.05)))
        opt.step()
        opt.zero_grad()
    for r in range(2):
        (F.mse_loss(net(batch(r, 6)[0]), batch(r, 6)[1]) / 2).backward()
    opt.step()
    return norms, [p.detach().clone() for p in net.parameters()]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_zero_clip_zero_grad_and_backward_from_compiled_code(stage):
    """torch's clip_grad_norm_ and model.zero_grad() inside a compiled region went to torch's own on .grad:
    stage 1 clipped each rank's local gradients by their own norm, stages 2-3 clipped nothing (norm 0.0)
    and kept the gradients zero_grad should drop; a backward called in a compiled function had dynamo
    compile ZeRO's gradient hooks, losing their flags (stages 2-3: step() then said no backward ran).
    Now: the global norm, the gradients dropped, the plain-torch weights. A compiled stage-3 forward that
    reads another module's weight (NaN there, where eager names the read) stops at the first step."""
    norms_ref, weights_ref = in_child(reference_zero_from_compiled_code)
    for res in run_ranks(rank_zero_from_compiled_code, 2, args=(stage,), timeout=240):
        for compiled in (False, True):
            norms, weights = res.value[compiled]
            torch.testing.assert_close(norms, norms_ref, **TOL)
            for w, ref in zip(weights, weights_ref):
                assert_same(w, ref, f"rank {res.rank} compiled={compiled}", **TOL)
        if stage == 3:
            assert "first step's gradients hold NaN after compiled forwards" in res.value["tied"], res.value["tied"]
            assert "leaf_modules" in res.value["tied"]
