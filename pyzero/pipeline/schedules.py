"""Pipeline schedules: the order of one stage's forward and backward passes.

A schedule is a list of actions ``(FORWARD | BACKWARD, microbatch)`` for one
stage. Every stage runs backwards in micro-batch order, so the messages on
each link (activations down, gradients up) arrive in the order they are read.

GPipe (all forward, all backward), 4 stages, 4 micro-batches (F/B: forward /
backward of that micro-batch, time flows right)::

    stage 0  F0 F1 F2 F3 .  .  .  .  .  .  B0 B1 B2 B3
    stage 1  .  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3 .
    stage 2  .  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .  .
    stage 3  .  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .  .

Every stage holds all m micro-batches' activations before its first backward.

1F1B: stage i runs p - i - 1 warm-up forwards, then alternates one forward
and one backward, then drains the remaining backwards (4 stages, 8
micro-batches)::

    stage 0  F0 F1 F2 F3 .  .  .  B0 F4 B1 F5 B2 F6 B3 F7 B4 .  B5 .  B6 .  B7
    stage 1  .  F0 F1 F2 .  .  B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 .  B6 .  B7 .
    stage 2  .  .  F0 F1 .  B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 .  B7 .  .
    stage 3  .  .  .  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7 .  .  .

A backward frees its micro-batch, so stage i holds at most p - i at once (p
on stage 0): activation memory bounded by the depth, not by m. Both have the
same bubble, (p - 1) / (m + p - 1) of each stage's time when forward and
backward costs are equal on every stage.
"""
from __future__ import annotations
from ..checks import is_int

FORWARD, BACKWARD = "F", "B"


def _positive(value, arg: str) -> int:
    if not is_int(value) or value < 1:
        raise ValueError(f"{arg}: expected an int >= 1, got {value!r}")
    return value


def _check(stage, num_stages, num_microbatches) -> int:
    _positive(num_stages, "num_stages")
    if not is_int(stage) or not 0 <= stage < num_stages:
        raise ValueError(f"stage: expected 0 <= stage < num_stages = {num_stages}, got {stage!r}")
    return _positive(num_microbatches, "num_microbatches")


def gpipe(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """All forwards, then all backwards (AFAB)."""
    m = _check(stage, num_stages, num_microbatches)
    return [(FORWARD, j) for j in range(m)] + [(BACKWARD, j) for j in range(m)]


def one_f_one_b(stage: int, num_stages: int, num_microbatches: int) -> list[tuple[str, int]]:
    """Warm-up forwards, steady one-forward-one-backward, cool-down backwards."""
    m = _check(stage, num_stages, num_microbatches)
    warmup = min(num_stages - stage - 1, m)
    actions = [(FORWARD, j) for j in range(warmup)]
    for j in range(m - warmup):  # steady state: the forward of j + warmup, then the oldest backward
        actions += [(FORWARD, j + warmup), (BACKWARD, j)]
    actions += [(BACKWARD, j) for j in range(m - warmup, m)]
    return actions


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def comm_steps(num_actions: int, needs, produces):
    """The point-to-point groups around a stage's actions (see [Note: pipeline messages] in
    pipeline.py). ``needs(i)``: the messages action i receives, in order; ``produces(i)``: those it
    sends, asked once it has run. Yields ``("p2p", sends, recvs)`` and ``("run", i)``.

    The sends of action i go out in one group with the first receive of action i + 1 (or alone,
    before it runs, when it receives nothing); every further receive of an action is a group of
    its own (its buffer's shape may depend on the one before). Megatron-LM pairs the same way
    (send_forward_recv_backward): two neighbours that would both send first are in one group on
    each side, which NCCL needs. Only the order of groups matters, not whether a send is waited for."""
    pending: list = []
    for i in range(num_actions):
        for r in needs(i):
            yield "p2p", pending, [r]
            pending = []
        if pending:
            yield "p2p", pending, []
            pending = []
        yield "run", i
        pending = list(produces(i))
    if pending:
        yield "p2p", pending, []


def bubble_fraction(num_stages: int, num_microbatches: int) -> float:
    """Idle share of each stage's time in an ideal pipeline: (p - 1) / (m + p - 1)."""
    _positive(num_stages, "num_stages")
    _positive(num_microbatches, "num_microbatches")
    return (num_stages - 1) / (num_microbatches + num_stages - 1)
