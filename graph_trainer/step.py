"""The training-step protocol: what the trainer drives, whether the step runs eagerly or as a traced graph.

    out = step(batch)          # forward, loss, backward, clipping and the optimizer update
    out.loss, out.grad_norm    # (also unpacks as `loss, grad_norm = step(batch)`)
    step.report()              # what the trainer logs besides: trace stats, estimated peak, ...

`graph_trainer.eager.EagerStep` and `graph_trainer.tracer.GraphStep` implement
it. The trainer knows only this module's names, nothing of graphs.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Protocol

import torch


class StepOutput(NamedTuple):
    """What one step returns: the loss and the (pre-clipping) gradient norm, both 0-d tensors."""

    loss: torch.Tensor
    grad_norm: torch.Tensor


@dataclasses.dataclass
class StepReport:
    """What the trainer logs about a step besides its loss and gradient norm (None: not applicable)."""

    updates_inside: bool  # the optimizer update ran inside the step's graph (False: eager, after it)
    trace_count: int | None = None  # traces so far (None: the step is not traced)
    trace_time_s: float | None = None  # total trace time so far
    retrace_reasons: list[str] = dataclasses.field(default_factory=list)
    compile_time_s: float | None = None  # total compile time so far (None: not compiled)
    estimated_peak_bytes: int | None = None  # the whole step's, eager update included
    saved_activation_bytes: int | None = None
    cuda_graphs: bool = False  # replayed as a CUDA graph (its pool is outside the allocator's active count)

    def as_record(self) -> dict[str, Any]:
        """The metrics-record fields this report fills (the names `graph_trainer.observability.metrics` logs)."""
        fields = {
            "trace_count": self.trace_count,
            "trace_time_s": self.trace_time_s,
            "inductor_time_s": self.compile_time_s,
            "estimated_peak_bytes": self.estimated_peak_bytes,
            "saved_activation_bytes": self.saved_activation_bytes,
        }
        return {k: v for k, v in fields.items() if v is not None}


class TrainStep(Protocol):
    """One training step on a batch, and a report of what it cost."""

    def __call__(self, batch: Any) -> StepOutput:
        """Run one step: the (clipped) gradients land in `param.grad`; with an optimizer, the update runs too."""
        ...

    def report(self) -> StepReport:
        """What the trainer logs about the steps run so far."""
        ...


class EvalStep(Protocol):
    """The loss on a batch without gradients (forward and loss only), and a report of what it cost."""

    def __call__(self, batch: Any) -> torch.Tensor:
        """The loss on `batch` (a 0-d tensor); nothing of the model or optimizer is written."""
        ...

    def report(self) -> StepReport:
        """What the trainer logs about the evaluations run so far (trace count, estimated peak)."""
        ...
