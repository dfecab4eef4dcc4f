"""pyzero-bench moments: AdamW loss curves with fp32, bf16 and int8 moments against torch's AdamW.

The same GPT (seed 0) trains --steps steps from the same start on a learnable stream: token
sequences of a fixed random Markov chain where every token has --branch equally likely
successors, so the best possible loss is ln(branch) and a uniform guess's ln(vocab). Each
step draws its own batch (the same batches for every run). Runs:
  torch            torch.optim.AdamW (fp32 state), the reference
  fp32, bf16, int8 pz.optim.AdamW(moments=...)
Every step's loss is recorded; the summary gives, per run, the final loss (mean of the last
10 steps) and the largest |loss - torch's loss| over the steps after --warmup-compare, plus the
bytes of optimizer state per parameter held at the end (counted from the state tensors).

With ``--step-elems N`` it times instead the step alone of one fp32 parameter of N elements
(a ZeRO shard) for each moments format, with a bf16 copy written (the offload step): the
median of --iters steps after 2 warm-up steps, one format after another.
"""
from __future__ import annotations

import math

import torch

from .common import UsageError, write_json
from .gpt import PRESETS, make_gpt

RUNS = ("torch", "fp32", "bf16", "int8")


def add_arguments(p) -> None:
    p.add_argument("--model", default="gpt-tiny", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--branch", type=int, default=4, help="successors per token of the Markov chain")
    p.add_argument("--runs", default=",".join(RUNS))
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: as is)")
    p.add_argument("--warmup-compare", type=int, default=10, help="steps left out of the largest difference")
    p.add_argument("--json", default=None, help="write the record here")
    p.add_argument("--step-elems", type=int, default=0, help="time the step alone on this many elements")
    p.add_argument("--iters", type=int, default=10)


def markov_batches(vocab: int, branch: int, batch: int, seq: int, steps: int, seed: int = 0):
    """Per step (inputs, targets) of shape (batch, seq) from a fixed random Markov chain."""
    g = torch.Generator().manual_seed(seed)
    succ = torch.randint(0, vocab, (vocab, branch), generator=g)
    out = []
    for _ in range(steps):
        tok = torch.empty(batch, seq + 1, dtype=torch.long)
        tok[:, 0] = torch.randint(0, vocab, (batch,), generator=g)
        pick = torch.randint(0, branch, (batch, seq), generator=g)
        for t in range(seq):
            tok[:, t + 1] = succ[tok[:, t], pick[:, t]]
        out.append((tok[:, :-1].contiguous(), tok[:, 1:].contiguous()))
    return out


def _state_bytes(opt) -> int:
    seen, total = set(), 0
    for st in opt.state.values():
        for k, v in st.items():
            if torch.is_tensor(v) and k != "step" and v.data_ptr() not in seen:
                seen.add(v.data_ptr())
                total += v.numel() * v.element_size()
    return total


def train(run: str, args, batches) -> dict:
    from .. import optim as pz_optim  # noqa: PLC0415

    model = make_gpt(args.model, seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    kw = dict(lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    opt = torch.optim.AdamW(params, foreach=False, **kw) if run == "torch" else \
        pz_optim.AdamW(params, moments=run, **kw)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    n = sum(p.numel() for p in params)
    return {"run": run, "losses": losses, "final": sum(losses[-10:]) / len(losses[-10:]),
            "state_bytes_per_param": _state_bytes(opt) / n, "params": n}


def time_steps(args) -> list[dict]:
    import statistics  # noqa: PLC0415
    import time  # noqa: PLC0415

    from .. import optim as pz_optim  # noqa: PLC0415

    n, out = args.step_elems, []
    for moments in ("fp32", "bf16", "int8"):
        p = torch.nn.Parameter(torch.randn(n))
        p.grad = torch.randn(n)
        copy = torch.empty(n, dtype=torch.bfloat16)
        opt = pz_optim.AdamW([p], lr=1e-3, moments=moments)
        times = []
        for i in range(args.iters + 2):
            t0 = time.perf_counter()
            opt.step(grad_scale=0.5, copies={p: copy})
            if i >= 2:
                times.append(time.perf_counter() - t0)
        ms = statistics.median(times) * 1e3
        out.append({"moments": moments, "elems": n, "threads": torch.get_num_threads(), "ms": ms,
                    "params_per_s": n / ms * 1e3})
        print(f"{moments:>5} {n} elements, {torch.get_num_threads()} threads: {ms:8.2f} ms "
              f"({n / ms / 1e6:.3f} G params/s)")
        del p, opt, copy
    return out


def check_args(args) -> list[str]:
    """The runs to train; a UsageError naming the flag first, before anything trains (--steps 10 with the default
    --warmup-compare 10 failed after training, a negative one compared the last steps, --threads -1 was torch's
    error, and an empty --runs trained nothing)."""
    if args.threads is not None and args.threads < 1:
        raise UsageError(f"--threads: expected >= 1, got {args.threads}")
    if args.step_elems:
        return []
    runs = [r.strip() for r in args.runs.split(",") if r.strip()]
    bad = [r for r in runs if r not in RUNS]
    if bad or not runs:
        raise UsageError(f"--runs: expected names from {RUNS}, got {bad or repr(args.runs)}")
    if not 0 <= args.warmup_compare < args.steps:
        raise UsageError(f"--warmup-compare: expected 0 to {args.steps - 1} (fewer than --steps {args.steps}), "
                         f"got {args.warmup_compare}")
    return runs


def main(args) -> int:
    runs = check_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.step_elems:
        results = time_steps(args)
        if args.json:
            write_json(args.json, results, {"args": {k: v for k, v in vars(args).items() if k != "func"}})
        return 0
    cfg = PRESETS[args.model]
    batches = markov_batches(cfg.vocab_size, args.branch, args.batch, args.seq, args.steps)
    results = [train(r, args, batches) for r in runs]
    ref = next((r for r in results if r["run"] == "torch"), None)
    print(f"{args.model}, {args.steps} steps, batch {args.batch}x{args.seq}, lr {args.lr}; "
          f"uniform ln(V) = {math.log(cfg.vocab_size):.3f}, best ln(branch) = {math.log(args.branch):.3f}")
    print(f"{'run':>6} {'final loss':>10} {'max |dloss| vs torch':>21} {'state B/param':>14}")
    for r in results:
        if ref is not None:
            w = args.warmup_compare
            r["max_abs_diff_vs_torch"] = max(abs(a - b) for a, b in zip(r["losses"][w:], ref["losses"][w:]))
        d = r.get("max_abs_diff_vs_torch")
        print(f"{r['run']:>6} {r['final']:>10.4f} {'' if d is None else f'{d:.4f}':>21} "
              f"{r['state_bytes_per_param']:>14.3f}")
    every = max(1, args.steps // 10)
    print("loss every", every, "steps:")
    for r in results:
        print(f"{r['run']:>6} " + " ".join(f"{v:.3f}" for v in r["losses"][::every]))
    if args.json:
        write_json(args.json, results, {"args": {k: v for k, v in vars(args).items() if k != "func"}})
        print("wrote", args.json)
    return 0


if __name__ == "__main__":  # pragma: no cover
    import argparse

    ap = argparse.ArgumentParser()
    add_arguments(ap)
    raise SystemExit(main(ap.parse_args()))
