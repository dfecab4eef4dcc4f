"""What the stages of a pipeline agree on before they exchange activations.

Each check here runs on every rank of the pipeline group and raises the same
error everywhere: a rank that found a problem alone would otherwise leave
its peers waiting for activations that never come.

* ``check_config``: once, in Pipeline's constructor, every rank's
  num_microbatches, schedule and stage tag (from split_sequential), gathered.
* ``agree_step``: each train_step, one small all-reduce (max) of the batch
  sizes the first stage (inputs) and the last stage (targets) see, whether
  the micro-batch shape changed since the last step, and of a rank that
  runs it with gradients disabled.
* ``encode_header`` / ``decode_header``: the shape and dtype of a stage's
  output, sent to the next stage before the first activation of a step
  whose micro-batch shape changed (so the first step), never otherwise.
"""
from __future__ import annotations

import torch

from .. import comm
from ..backend import DTYPES
from .schedules import SCHEDULES
from .split import StageInfo
from ..checks import is_int

_NAMES = list(SCHEDULES)
_ABSENT = -(1 << 62)  # "not mine to say" in a max all-reduce
_BAD = -1             # the owner got something that is not a tensor with a batch dim

MAX_NDIM = 8
HEADER_LEN = 2 + MAX_NDIM  # [dtype code, ndim, dims...]; fixed, so the receive size is known
_CODE_DTYPE = {code: dtype for dtype, code in DTYPES.items()}
_NOT_TENSOR, _BAD_DTYPE, _TOO_MANY_DIMS = -1, -2, -3


def _m_error(m):
    if not is_int(m):
        return TypeError(f"num_microbatches: expected an int >= 1, got {type(m).__name__}")
    if m < 1:
        return ValueError(f"num_microbatches: expected an int >= 1, got {m}")
    if m >= 1 << 62:
        return ValueError(f"num_microbatches: expected an int below 2**62, got {m}")
    return None


def _schedule_error(schedule):
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        return ValueError(f"schedule: expected one of {_NAMES}, got {schedule!r}")
    return None


def check_config(module, num_microbatches, schedule, group: comm.Group) -> None:
    """Gather (num_microbatches, schedule, stage tag) of every rank; raise on every rank if any is wrong."""
    m_err, s_err = _m_error(num_microbatches), _schedule_error(schedule)
    info, inner, spans = None, module, 0
    for _ in range(8):  # the stage itself, or inside wrappers (pz.DataParallel, torch DDP: .module)
        info = getattr(inner, "pipeline_stage", None)
        wrapper_group = getattr(inner, "group", None)  # a pz.DataParallel's data-parallel group
        if isinstance(wrapper_group, comm.Group) and len(set(wrapper_group.ranks) & set(group.ranks)) > 1:
            spans = 1  # it would average the gradients of different stages (and wait on ranks busy with others)
        if info is not None or not isinstance(getattr(inner, "module", None), torch.nn.Module):
            break
        inner = inner.module
    index, stages = info if isinstance(info, StageInfo) else (-1, -1)  # -1: built by hand, nothing to check
    # per pipeline rank: [m or 0, m valid, schedule index or -1, stage index, stages]
    mine = [0 if m_err else num_microbatches, int(m_err is None), -1 if s_err else _NAMES.index(schedule), index,
            stages, spans]
    rows = comm.every_rank(mine, group=group).tolist()
    n = group.size

    def rank_name(r):
        return f"pipeline rank {r} (global rank {group.ranks[r]})"

    spanning = [r for r, row in enumerate(rows) if row[5]]
    if spanning:
        raise ValueError(f"stage_module: the data-parallel group of the wrapper on {rank_name(spanning[0])} shares "
                         f"ranks with the pipeline group {list(group.ranks)}: it must pair the ranks that hold the "
                         "same stage (pz.DataParallel(stage, group=dp), dp one group per stage), not span the stages")

    for own_err, bad, arg, expected in ((m_err, [row[1] == 0 for row in rows], "num_microbatches", "an int >= 1"),
                                        (s_err, [row[2] < 0 for row in rows], "schedule", f"one of {_NAMES}")):
        if own_err is not None:
            raise own_err
        if any(bad):
            raise ValueError(f"{arg}: {rank_name(bad.index(True))} passed an invalid value; expected {expected} "
                             "on every rank")
    for values, arg in (([row[0] for row in rows], "num_microbatches"),
                        ([_NAMES[row[2]] for row in rows], "schedule")):
        if len(set(values)) > 1:
            raise ValueError(f"{arg}: expected the same value on every rank of the pipeline group, got {values} "
                             "(by pipeline rank)")
    for r, (_, _, _, index, stages, _) in enumerate(rows):
        if stages >= 0 and stages != n:
            raise ValueError(f"stage_module: {rank_name(r)} holds stage {index} of a split into {stages} stages, but "
                             f"the pipeline group has {n} ranks (one stage each); split with num_stages={n}")
        if index >= 0 and index != r:
            raise ValueError(f"stage_module: {rank_name(r)} holds stage {index}; rank i of the pipeline group must "
                             "hold stages[i]")


def _batch(t) -> int:
    return t.shape[0] if isinstance(t, torch.Tensor) and t.dim() >= 1 else _BAD


def agree_step(inputs, targets, loss_fn, m: int, first: bool, last: bool, signature, group: comm.Group) -> bool:
    """Check one step's arguments with every stage; return whether the micro-batch shape changed.

    ``signature`` is the first stage's (micro-batch shape, dtype) of the last
    step (None before the first); other stages pass anything.
    """
    b_in = _batch(inputs) if first else _ABSENT
    changed = 0
    if first and b_in > 0 and b_in % m == 0:
        changed = int(signature_of(inputs, m) != signature)
    no_grad = 0 if torch.is_grad_enabled() else group.rank + 1  # (the last such rank, named on every rank)
    vec = torch.tensor([no_grad, b_in, _batch(targets) if last else _ABSENT, int(last and not callable(loss_fn)),
                        changed], dtype=torch.int64, device=group.tensor_device)
    comm.all_reduce(vec, op="max", group=group)
    no_grad, b_in, b_tgt, bad_loss, changed = vec.tolist()
    if no_grad:
        r = no_grad - 1
        raise RuntimeError(f"train_step: called under torch.no_grad() (or inference_mode) on pipeline rank {r} "
                           f"(global rank {group.ranks[r]}); it runs forward and backward and adds to the "
                           "parameters' .grad, so an evaluation pass through it would change the gradients being "
                           "accumulated: run evaluation outside train_step, and train_step with gradients enabled "
                           "on every rank")
    where_first, where_last = f"global rank {group.ranks[0]}", f"global rank {group.ranks[-1]}"
    if b_in == _BAD:
        got = f", got {type(inputs).__name__}" if first else ""
        raise TypeError(f"inputs: expected a tensor with a batch dim 0 on the first stage ({where_first}){got}")
    if b_in < m or b_in % m:
        raise ValueError(f"inputs: batch size {b_in} (dim 0) does not split into num_microbatches={m} equal "
                         "micro-batches; use a batch size divisible by num_microbatches")
    if b_tgt == _BAD:
        got = f", got {type(targets).__name__}" if last else ""
        raise TypeError(f"targets: expected a tensor with a batch dim 0 on the last stage ({where_last}){got}")
    if b_tgt != b_in:
        raise ValueError(f"targets: batch size {b_tgt} (dim 0, last stage) does not match the inputs' batch size "
                         f"{b_in} (first stage)")
    if bad_loss:
        got = f", got {type(loss_fn).__name__}" if last else ""
        raise TypeError(f"loss_fn: expected a callable loss_fn(output, target) on the last stage ({where_last}){got}")
    return bool(changed)


def signature_of(inputs, m: int):
    """The first stage's value of agree_step's ``signature`` for these inputs."""
    return tuple(inputs.shape[1:]), inputs.shape[0] // m, inputs.dtype


def encode_header(out, device) -> torch.Tensor:
    """[dtype code, ndim, shape...], or a negative code the receiver turns into the sender's error."""
    h = torch.zeros(HEADER_LEN, dtype=torch.int64)
    if not isinstance(out, torch.Tensor):
        h[0] = _NOT_TENSOR
    elif out.dtype not in DTYPES:
        h[0] = _BAD_DTYPE
    elif out.dim() > MAX_NDIM:
        h[0] = _TOO_MANY_DIMS
    else:
        h[0], h[1] = DTYPES[out.dtype], out.dim()
        h[2:2 + out.dim()] = torch.tensor(out.shape, dtype=torch.int64)
    return h.to(device)


def output_error(out, stage: int):
    """The error of a stage output that cannot be sent (None if it can), named as the sender sees it."""
    code = int(encode_header(out, "cpu")[0])
    what = f"the output of pipeline stage {stage}"
    if code == _NOT_TENSOR:
        return TypeError(f"{what}: expected a tensor (the next stage's input), got {type(out).__name__}")
    if code == _BAD_DTYPE:
        return TypeError(f"{what}: dtype {out.dtype} cannot be sent; expected one of "
                         f"{[str(d) for d in DTYPES]}")
    if code == _TOO_MANY_DIMS:
        return ValueError(f"{what}: expected at most {MAX_NDIM} dims, got {out.dim()}")
    return None


def decode_header(h: torch.Tensor, sender_stage: int) -> tuple[torch.Size, torch.dtype]:
    """(shape, dtype) of the activations to receive; raises the sender's error if it sent one."""
    h = h.tolist()
    code, ndim = h[0], h[1]
    if code < 0:
        kind = {_NOT_TENSOR: "not a tensor", _BAD_DTYPE: "an unsupported dtype",
                _TOO_MANY_DIMS: f"more than {MAX_NDIM} dims"}.get(code, f"error code {code}")
        raise TypeError(f"the output of pipeline stage {sender_stage} (this stage's input) could not be sent: {kind}")
    return torch.Size(h[2:2 + ndim]), _CODE_DTYPE[code]
