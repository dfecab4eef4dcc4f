"""Adam's moments stored in fewer bytes: ``pz.optim.AdamW(..., moments="bf16" | "int8")``.

What is kept per parameter element (fp32: 8 bytes):
  "bf16"  exp_avg and exp_avg_sq as bfloat16, rounded to nearest even: 4 bytes.
  "int8"  exp_avg as int8 codes, exp_avg_sq as uint8 codes, each with one fp32 absmax per
          block of BLOCK (256) consecutive elements of the flattened tensor (the last block
          may be shorter): 2 + 8/256 = 2.03 bytes.

The 8-bit maps (not bitsandbytes' dynamic tree map; power maps, which need no code book):
  exp_avg     m = absmax * (c/127)^3,   c in [-127, 127]  (the cube keeps the sign)
  exp_avg_sq  v = absmax * (c/255)^4,   c in [0, 255]
where absmax is the block's largest |m| (or v), so the block's largest value is exact.
Encoding rounds to nearest in the root domain: c = round(127 * cbrt(m/absmax)) and
c = round(255 * (v/absmax)^(1/4)); a positive v never gets code 0 (c >= 1), so the
denominator sqrt(v) of an element with a gradient never collapses to eps. Within a block
the smallest nonzero magnitudes are about 4.9e-7 (m) and 2.4e-10 (v) of the block's
largest; the relative spacing of neighbouring codes is 3/c (m) and 4/c (v), 2.4% and 1.6%
at the top of the range. Bounds per value (tests/test_cpu_optim.py checks them):
|dec(enc(m)) - m| <= absmax * ((cbrt(|m|/absmax) + 1/254)^3 - |m|/absmax), the same form
with the fourth root and 1/510 for v.

The step (csrc/cpu_optim): with "bf16" the fused kernel reads the moments widened and writes
them rounded in its one pass (22 bytes of memory traffic per parameter instead of 30). With
"int8" it takes one block of 256 elements at a time: decodes its moments into fp32 (in
cache), runs the fp32 step on them, encodes the new moments (the same maps; the roots by
cbrt and sqrt, rounded to nearest even). Either way the parameters after a step are the fp32
step's from the stored moments, exactly. The functions below encode and decode with torch
ops, for loading, checkpoints and fp32_state.
"""
from __future__ import annotations

import torch

MOMENTS = ("fp32", "bf16", "int8")
BLOCK = 256  # elements per absmax (int8)
_M_LEVELS, _V_LEVELS = 127.0, 255.0


def check(moments, amsgrad: bool) -> str:
    if moments not in MOMENTS:
        raise ValueError(f"moments: expected one of {list(MOMENTS)}, got {moments!r}")
    if moments != "fp32" and amsgrad:
        raise ValueError(f"moments={moments!r}: amsgrad needs moments='fp32' (its running max stays fp32)")
    return moments


def nblocks(n: int) -> int:
    return -(-n // BLOCK)


def bytes_per_element(moments: str) -> float:
    """Bytes of exp_avg + exp_avg_sq per parameter element (absmax included, full blocks)."""
    return {"fp32": 8.0, "bf16": 4.0, "int8": 2.0 + 2 * 4.0 / BLOCK}[moments]


def zeros_state(p: torch.Tensor, moments: str) -> dict:
    """exp_avg / exp_avg_sq (and for int8 their absmax) of zeros for parameter p."""
    if moments == "fp32":
        return {"exp_avg": torch.zeros_like(p, memory_format=torch.preserve_format),
                "exp_avg_sq": torch.zeros_like(p, memory_format=torch.preserve_format)}
    if moments == "bf16":
        return {"exp_avg": torch.zeros_like(p, dtype=torch.bfloat16),
                "exp_avg_sq": torch.zeros_like(p, dtype=torch.bfloat16)}
    nb = nblocks(p.numel())
    return {"exp_avg": torch.zeros_like(p, dtype=torch.int8), "exp_avg_absmax": torch.zeros(nb),
            "exp_avg_sq": torch.zeros_like(p, dtype=torch.uint8), "exp_avg_sq_absmax": torch.zeros(nb)}


def stored_as(state: dict) -> str | None:
    """How `state` holds its moments now ("fp32", "bf16", "int8"), None before the first step."""
    m = state.get("exp_avg")
    if m is None:
        return None
    return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int8: "int8"}.get(m.dtype, "other")


def decode_into(state: dict, a: int, b: int, out_m: torch.Tensor, out_v: torch.Tensor) -> None:
    """fp32 values of elements [a, b) of the moments into out_m/out_v (1-D, at least b - a long;
    for int8 a is a multiple of BLOCK and the outputs reach the end of the last block)."""
    n = b - a
    kind = stored_as(state)
    m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    if kind in ("fp32", "bf16", "other"):
        out_m[:n].copy_(m[a:b])
        out_v[:n].copy_(v[a:b])
        return
    nb = nblocks(n)
    blocks = slice(a // BLOCK, a // BLOCK + nb)
    for codes, absmax, out, levels, power in ((m, state["exp_avg_absmax"], out_m, _M_LEVELS, 3),
                                              (v, state["exp_avg_sq_absmax"], out_v, _V_LEVELS, 4)):
        o = out[:nb * BLOCK]
        o[:n].copy_(codes[a:b])
        o[n:].zero_()
        o.div_(levels)  # (c = levels: exactly 1, so the block's largest value is exact)
        if power == 3:
            o.mul_(o * o)
        else:
            o.mul_(o).mul_(o)
        o.view(nb, BLOCK).mul_(absmax[blocks].unsqueeze(1))


def encode_from(state: dict, a: int, b: int, src_m: torch.Tensor, src_v: torch.Tensor) -> None:
    """Store the fp32 values src_m/src_v as elements [a, b) of the moments (as decode_into;
    the sources are overwritten)."""
    n = b - a
    kind = stored_as(state)
    m, v = state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1)
    if kind != "int8":
        m[a:b].copy_(src_m[:n])
        v[a:b].copy_(src_v[:n])
        return
    nb = nblocks(n)
    blocks = slice(a // BLOCK, a // BLOCK + nb)
    for codes, absmax, src, levels, root in ((m, state["exp_avg_absmax"], src_m, _M_LEVELS, 3),
                                             (v, state["exp_avg_sq_absmax"], src_v, _V_LEVELS, 4)):
        x = src[:nb * BLOCK]
        x[n:].zero_()
        xb = x.view(nb, BLOCK)
        amax = xb.abs().amax(1)
        absmax[blocks] = amax
        # levels^k / absmax per block (0 for an all-zero block): the root of x times it is
        # levels * (x / absmax)^(1/k) in one multiply and the root. Below an absmax of about 1e-32
        # the scale overflows (0 * inf is NaN): such blocks divide by their absmax first (as the kernel).
        scale = torch.where(amax > 0, levels ** root / amax, torch.zeros_like(amax)).unsqueeze(1)
        tiny = ~scale.isfinite().squeeze(1)
        if root == 3:
            y = x.abs()
            y.view(nb, BLOCK).mul_(scale.nan_to_num(posinf=0.0))
            if tiny.any():
                y.view(nb, BLOCK)[tiny] = xb[tiny].abs() / amax[tiny].unsqueeze(1) * float(levels ** root)
            y.pow_(1.0 / 3).round_().copysign_(x)
            x = y
        else:
            if tiny.any():
                xb[tiny] = xb[tiny] / amax[tiny].unsqueeze(1) * float(levels ** root)
                scale = scale.masked_fill(tiny.unsqueeze(1), 1.0)
            xb.mul_(scale)
            x.sqrt_().sqrt_()
            x = torch.maximum(x.round(), x.ceil().clamp_(max=1.0))  # a positive v keeps a positive code
        codes[a:b].copy_(x[:n])


def to_fp32(state: dict) -> dict:
    """The state with fp32 moments of the parameter's shape (checkpoints, torch.optim)."""
    kind = stored_as(state)
    out = {k: v for k, v in state.items() if k not in ("exp_avg", "exp_avg_sq", "exp_avg_absmax",
                                                        "exp_avg_sq_absmax")}
    if kind is None:
        return out
    m = state["exp_avg"]
    n = m.numel()
    if kind == "int8":
        pad = nblocks(n) * BLOCK
        om, ov = torch.empty(pad), torch.empty(pad)
        decode_into(state, 0, n, om, ov)
        out["exp_avg"], out["exp_avg_sq"] = om[:n].view(m.shape).clone(), ov[:n].view(m.shape).clone()
    else:
        out["exp_avg"] = state["exp_avg"].float()
        out["exp_avg_sq"] = state["exp_avg_sq"].float()
    return out


def convert(state: dict, moments: str, like: torch.Tensor) -> None:
    """Re-store `state`'s moments as `moments` (after a load of another kind, e.g. fp32 from torch)."""
    if stored_as(state) == moments:
        return
    full = to_fp32(state)
    for k in ("exp_avg", "exp_avg_sq", "exp_avg_absmax", "exp_avg_sq_absmax"):
        state.pop(k, None)
    state.update(zeros_state(like, moments))
    n = like.numel()
    if moments == "int8":
        pad = nblocks(n) * BLOCK
        sm, sv = torch.zeros(pad), torch.zeros(pad)
        sm[:n].copy_(full["exp_avg"].reshape(-1))
        sv[:n].copy_(full["exp_avg_sq"].reshape(-1))
        encode_from(state, 0, n, sm, sv)
    else:
        encode_from(state, 0, n, full["exp_avg"].reshape(-1).float(), full["exp_avg_sq"].reshape(-1).float())
