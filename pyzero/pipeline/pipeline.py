"""Pipeline: one stage of a pipeline-parallel model per rank of a group.

Rank i of the group runs stage i. A train_step splits the batch into m
micro-batches and runs this stage's schedule (see schedules.py): a forward
receives micro-batch j's activation from stage i - 1 and sends its output to
stage i + 1; a backward receives the gradient of that output from stage i + 1
and sends the gradient of its input to stage i - 1.

[Note: pipeline messages]
On the link i -> i+1 travel activations, on i+1 -> i their gradients, each in
micro-batch order, so plain FIFO send/recv matches them. The sends and
receives around each action are grouped (schedules.comm_steps): the outputs
of one action leave in one batch_isend_irecv with the first input of the
next. NCCL runs a rank's point-to-point calls in one order and a send waits
for its receiver, so two neighbours that both send first would wait for each
other forever; grouped, each side's send and receive run together. The order
of groups is checked for deadlocks against every schedule, stage count and
micro-batch count under exactly these rules (tests/test_pipeline.py). A
group that only sends is not waited for until the step ends (its Work keeps
the tensors alive), so a stage computes on while its output travels; a
group with a receive is waited for before the action that needs it (a
stream wait on a GPU). A received activation is the input the backward
needs, so no buffer is reused. Shapes are not sent per message: a header
(handshake.py) goes before the first activation of any step whose
micro-batch shape changed.
"""
from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass

import torch
from torch import nn

from .. import comm
from ..parallel import DataParallel
from ..zero import owner as zero_owner
from . import handshake
from .schedules import FORWARD, SCHEDULES, bubble_fraction, comm_steps


@dataclass(frozen=True)
class PipelineStats:
    """This rank's record of its last train_step.

    busy_s: time in this stage's forward, loss and backward compute; idle_s:
    the rest of the step (waiting for peers, the step's handshake). bubble is
    the measured idle share, next to the ideal (p - 1) / (m + p - 1).
    """

    stage: int
    num_stages: int
    num_microbatches: int
    schedule: str
    max_inflight: int  # micro-batches whose activations this stage held at once
    step_s: float
    busy_s: float
    idle_s: float
    bubble: float
    bubble_formula: float


def _setting(name: str, doc: str) -> property:
    """A read-only attribute: a setting every rank of the group agreed on when the Pipeline was built."""
    def get(self):
        return self._config[name]

    def refuse(self, value):
        raise AttributeError(f"{name}: fixed when the Pipeline is built (every rank of the group agreed on it "
                             "then, and the schedule's actions are laid out for it); build a new "
                             "pz.pipeline.Pipeline on every rank of the group instead")
    return property(get, refuse, doc=doc)


class Pipeline:
    """Runs ``stage_module`` as stage ``group.rank`` of a pipeline over ``group``.

    ``stage_module``: this rank's stage, e.g. ``split_sequential(seq, group.size)[group.rank]``.
    ``num_microbatches``: m, the number of equal parts each batch is split into (dim 0).
    ``schedule``: "1f1b" (activations of at most p micro-batches held) or "gpipe" (all m).
    ``group``: the pipeline group (None: the world); with data parallelism, one
    pipeline group per replica, and gradients averaged over the DP group after
    train_step, or once per train_step by a pz.DataParallel stage module or a
    ZeroOptimizer training the stage (see [Note: one gradient reduction per step]).
    Every rank of the group constructs its Pipeline together (a collective check
    that the ranks agree); the settings are read-only after.
    """

    def __init__(self, stage_module: nn.Module, num_microbatches: int, schedule: str = "1f1b", group=None):
        if not isinstance(stage_module, nn.Module):
            raise TypeError(f"stage_module: expected an nn.Module (one pipeline stage), got "
                            f"{type(stage_module).__name__}")
        g = comm.resolve_group(group)
        if g.rank < 0:
            raise ValueError(f"group: this process (global rank {comm.get_rank()}) is not a member of the pipeline "
                             f"group {list(g.ranks)}")
        handshake.check_config(stage_module, num_microbatches, schedule, g)
        # (read-only: the ranks agreed on them here, and the schedule's actions are built from them)
        self._config = {"module": stage_module, "group": g, "num_microbatches": num_microbatches,
                        "schedule": schedule, "stage": g.rank, "num_stages": g.size}
        self._actions = SCHEDULES[schedule](self.stage, self.num_stages, num_microbatches)
        first, last = self.stage == 0, self.stage == self.num_stages - 1
        self._prev = None if first else g.ranks[self.stage - 1]
        self._next = None if last else g.ranks[self.stage + 1]
        self._device = g.tensor_device
        self._signature = None  # first stage: the micro-batch (shape, dtype) last announced downstream
        self._in_meta = None    # other stages: (shape, dtype) of the activations received
        self._out_meta = None   # stages but the last: (shape, dtype) announced to the next stage
        self.stats: PipelineStats | None = None

    module = _setting("module", "This rank's stage.")
    group = _setting("group", "The pipeline group.")
    num_microbatches = _setting("num_microbatches", "m: the number of equal parts each batch is split into.")
    schedule = _setting("schedule", '"1f1b" or "gpipe".')
    stage = _setting("stage", "This rank's stage: its rank in the group.")
    num_stages = _setting("num_stages", "The number of stages: the group's size.")

    @property
    def is_first(self) -> bool:
        return self.stage == 0

    @property
    def is_last(self) -> bool:
        return self.stage == self.num_stages - 1

    def train_step(self, inputs, targets, loss_fn):
        """Forward and backward of one batch through the whole pipeline.

        ``inputs``: the batch, needed on the first stage only (others may pass
        None); ``targets``: on the last stage only; ``loss_fn(output, target)``
        -> scalar loss of a micro-batch, on the last stage. Each micro-batch's
        loss is scaled by 1/m, so with a mean loss the gradients accumulated
        into ``.grad`` (as by ``loss.backward()``; zero them between steps)
        equal those of one full-batch backward. Returns the mean micro-batch
        loss as a float on the last stage, None elsewhere. (With a sum loss,
        ``reduction="sum"``, the gradients and the returned loss are the full
        batch's divided by m.) A parameter no gradient reaches (a stage after it
        detaches its input, say) keeps ``.grad`` None, as under one backward.
        Under ``torch.no_grad()`` (on any rank) it raises on every rank: it would
        still run the backward and add to ``.grad`` (there is no forward-only pass
        through the pipeline).

        Bad arguments raise the same error on every rank before anything is
        sent, and leave the pipeline usable. An error inside a stage's own
        forward or backward ends the pipeline: its peers fail once it exits
        (or at the group's timeout).
        """
        t_start = time.perf_counter()
        m = self.num_microbatches
        changed = handshake.agree_step(inputs, targets, loss_fn, m, self.is_first, self.is_last, self._signature,
                                       self.group)
        if self.is_first:
            self._signature = handshake.signature_of(inputs, m)
            xs = inputs.split(inputs.shape[0] // m)
        if self.is_last:
            ys = targets.split(targets.shape[0] // m)
        header_in = not self.is_first and (changed or self._in_meta is None)
        header_out = not self.is_last and (changed or self._out_meta is None)
        actions = self._actions
        held: dict[int, tuple] = {}  # micro-batch -> (input activation, output or scaled loss) until its backward
        inbox: dict[tuple, torch.Tensor] = {}  # received messages not yet used
        outbox: dict[tuple, torch.Tensor] = {}  # messages to send, until their group goes out
        sends_in_flight: list = []  # Works of send-only groups, waited at the end
        busy, max_inflight, loss_sum = 0.0, 0, 0.0  # loss_sum becomes a tensor: no host sync per micro-batch
        reduction = _OneReduction(self.module, m)
        trainable = self.is_last and any(p.requires_grad for p in self.module.parameters())

        def needs(i):
            op, j = actions[i]
            if op == FORWARD:
                if self.is_first:
                    return []
                return [("header", j), ("act", j)] if j == 0 and header_in else [("act", j)]
            return [("grad", j)] if not self.is_last and self._out_meta[1].is_floating_point else []

        def produces(i):
            return list(outbox)  # what action i left there, in order

        for kind, *rest in comm_steps(len(actions), needs, produces):
            if kind == "p2p":
                sends, recvs = rest
                self._exchange(sends, recvs, outbox, inbox, sends_in_flight)
                continue
            op, j = actions[rest[0]]
            if op == FORWARD:
                x = xs[j] if self.is_first else inbox.pop(("act", j))
                if not self.is_first and x.is_floating_point():
                    x.requires_grad_()
                t0 = time.perf_counter()
                with torch.enable_grad(), reduction.forward():
                    try:
                        out = self.module(x)
                    except RuntimeError as e:
                        if "leaf Variable that requires grad is being used in an in-place" not in str(e):
                            raise
                        raise RuntimeError(f"stage {self.stage}: a layer changed the stage's received input in "
                                           "place (the input of a stage after the first is a leaf autograd "
                                           "differentiates, to send its gradient back); give that layer "
                                           f"inplace=False ({e})") from e
                    if self.is_last:
                        loss = _check_loss(loss_fn(out, ys[j]))
                        if not loss.requires_grad and (x.requires_grad or trainable):
                            raise TypeError(f"loss_fn: the loss of micro-batch {j} does not require grad (detached, "
                                            "or computed under no_grad) while the stage's input or parameters do: "
                                            "every gradient would be zero; expected the loss tensor itself")
                        loss_sum = loss_sum + loss.detach()
                        out = loss / m
                busy += time.perf_counter() - t0
                if not self.is_last:
                    self._post_activation(out, j, j == 0 and header_out, outbox, sends_in_flight)
                held[j] = (x, out)
                max_inflight = max(max_inflight, len(held))
            else:
                x, out = held.pop(j)
                grad = inbox.pop(("grad", j), None)
                flows = True
                # [Note: a gradient message says whether one flowed] A stage sends its input's gradient with
                # one more element, 1, or zeros and 0 where its backward reached no input (a detach, an
                # integer path): the stage before then runs no backward for that micro-batch, so parameters
                # no gradient reaches keep .grad None as under one backward (zeros would be stepped: weight
                # decay, momentum).
                if grad is not None:
                    flows = bool(grad[-1] != 0)
                    grad = grad[:-1].view(out.shape)
                t0 = time.perf_counter()
                runs = flows and out.requires_grad  # (False for a stage without parameters fed by inputs)
                zeros = not runs and out.requires_grad and reduction.waiting(j)
                with reduction.backward(j, runs or zeros):
                    if runs:
                        torch.autograd.backward(out, grad)
                    elif zeros:  # the reduction of the earlier micro-batches' gradients
                        torch.autograd.backward(out, torch.zeros_like(out))
                busy += time.perf_counter() - t0
                if not self.is_first and x.is_floating_point():
                    if x.grad is not None:
                        outbox[("grad", j)] = torch.cat([x.grad.reshape(-1), x.grad.new_ones(1)])
                    else:
                        outbox[("grad", j)] = x.new_zeros(x.numel() + 1)
        for work in sends_in_flight:
            work.wait()
        step = time.perf_counter() - t_start
        self.stats = PipelineStats(self.stage, self.num_stages, m, self.schedule, max_inflight, step, busy,
                                   step - busy, (step - busy) / step, bubble_fraction(self.num_stages, m))
        return float(loss_sum) / m if self.is_last else None

    def _exchange(self, sends, recvs, outbox, inbox, sends_in_flight) -> None:
        """One group: the messages `sends` (taken from outbox) and `recvs` (into inbox, fresh buffers).
        Activations and headers go down the pipeline, gradients up."""
        ops = []
        for key in sends:
            peer = self._prev if key[0] == "grad" else self._next
            ops.append(comm.P2POp("send", outbox.pop(key), peer, self.group))
        bufs = []
        for key in recvs:
            if key[0] == "header":
                buf = torch.empty(handshake.HEADER_LEN, dtype=torch.int64, device=self._device)
            elif key[0] == "act":
                buf = torch.empty(self._in_meta[0], dtype=self._in_meta[1], device=self._device)
            else:  # a gradient and its flag (see [Note: a gradient message says whether one flowed])
                buf = torch.empty(math.prod(self._out_meta[0]) + 1, dtype=self._out_meta[1], device=self._device)
            peer = self._next if key[0] == "grad" else self._prev
            ops.append(comm.P2POp("recv", buf, peer, self.group))
            bufs.append((key, buf))
        works = comm.batch_isend_irecv(ops)
        if not bufs:
            sends_in_flight.append(works[0])
            return
        works[0].wait()  # the whole group
        for key, buf in bufs:
            if key[0] == "header":
                self._in_meta = handshake.decode_header(buf, self.stage - 1)
            else:
                inbox[key] = buf

    def _post_activation(self, out, j: int, with_header: bool, outbox, sends_in_flight) -> None:
        """Queue the header (first micro-batch of a changed step) and the activation for the next stage."""
        if with_header:
            outbox[("header", j)] = handshake.encode_header(out, self._device)
            err = handshake.output_error(out, self.stage)
            if err is not None:  # the header alone carries the error to the next stage
                self._exchange(list(outbox), [], outbox, {}, sends_in_flight)
                raise err
            self._out_meta = (out.shape, out.dtype)
        elif (out.shape, out.dtype) != self._out_meta:
            raise ValueError(f"the output of pipeline stage {self.stage} for micro-batch {j} has shape "
                             f"{tuple(out.shape)} and dtype {out.dtype}, but the next stage expects "
                             f"{tuple(self._out_meta[0])} and {self._out_meta[1]} (the shape of the first "
                             "micro-batch with this input shape): a stage must map equal input shapes to equal "
                             "output shapes")
        outbox[("act", j)] = out.detach().contiguous()


class _OneReduction:
    """[Note: one gradient reduction per step] A data-parallel stage reduces its gradients once per
    train_step, in the backward of the last micro-batch (the last action of every schedule), as gradient
    accumulation under no_sync does; reduced in every micro-batch's backward, it sent m times the bytes.

    * A pz.DataParallel stage module decides at forward whether the backward reduces (as torch DDP), and
      the schedules run later forwards before earlier backwards: every forward runs under its no_sync()
      and its reducer is armed just before the last backward (unless train_step runs inside the
      wrapper's own no_sync(): then nothing reduces, as asked).
    * A ZeroOptimizer training the stage (stages 2 and 3 reduce during backward) decides at backward:
      the backwards of micro-batches 0..m-2 run under its no_sync().

    Where the last micro-batch's backward would not reach the stage (a later stage detached it for that
    micro-batch only) while an earlier one did, a backward of zeros makes the reduction.
    """

    def __init__(self, module: nn.Module, m: int):
        arm = getattr(getattr(module, "reducer", None), "arm", None)
        self.dp = module if m > 1 and isinstance(module, DataParallel) and callable(arm) else None
        self.zero = zero_owner(module) if m > 1 and self.dp is None else None
        self.sync = self.dp is not None and module.require_backward_grad_sync  # (not inside its no_sync)
        self.last, self.ran = m - 1, False

    def forward(self):
        return self.dp.no_sync() if self.dp is not None else contextlib.nullcontext()

    def waiting(self, j: int) -> bool:
        """Whether backward j is the last and an earlier one's gradients wait for its reduction."""
        return j == self.last and self.ran and (self.dp is not None or self.zero is not None)

    def backward(self, j: int, runs: bool):
        """The context of backward j (`runs`: whether one runs)."""
        self.ran = self.ran or runs
        if j == self.last:
            if self.dp is not None and runs:
                self.dp.reducer.arm(self.sync)
            return contextlib.nullcontext()
        return self.zero.no_sync() if self.zero is not None else contextlib.nullcontext()


def _check_loss(loss):
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TypeError(f"loss_fn: expected a scalar tensor loss per micro-batch, got {shape}")
    return loss.reshape(())
