"""The training-step protocol: what the trainer drives, whether the step runs eagerly or as a traced graph.

    out = step(batch)          # forward, loss, backward, clipping and the optimizer update
    out.loss, out.grad_norm    # (also unpacks as `loss, grad_norm = step(batch)`)
    step.report()              # what the trainer logs besides: trace stats, estimated peak, ...
    step.graph_nodes()         # the graph's nodes with the estimated live bytes at each (None: eager)

`graph_trainer.eager.EagerStep` and `graph_trainer.tracer.GraphStep` implement
it. The trainer knows only this module's names, nothing of graphs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple, Protocol

import torch
import torch.utils._pytree as pytree

from graph_trainer.errors import UserError
from graph_trainer.loss import NUM_TOKENS, valid_tokens

# Maps this rank's count of valid tokens to the count its summed loss is divided by (see `micro_batches`).
CountReduce = Callable[[torch.Tensor], torch.Tensor]


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


def micro_batches(batch: dict[str, Any], steps: int, count_reduce: CountReduce | None = None) -> list[dict[str, Any]]:
    """`batch` cut into `steps` micro-batches along dim 0 (views, in order), each told the step's token count.

    Every micro-batch carries `NUM_TOKENS`: the valid labels of the whole batch, mapped by `count_reduce` (with
    data parallelism: the count over every rank divided by their number, since the gradient reduction averages
    over the ranks). Each micro-batch's loss is then its share of the mean over all the step's tokens, and the
    accumulated gradient is the whole batch's, however unevenly the valid tokens fall.

    Raises:
        UserError: a tensor of the batch whose first dimension does not divide into `steps`.
    """
    leaves, spec = pytree.tree_flatten(batch)
    for t in leaves:
        if isinstance(t, torch.Tensor) and (t.dim() == 0 or t.shape[0] % steps):
            raise UserError(
                f"a batch tensor of shape {list(t.shape)} cannot be cut into {steps} equal micro-batches; "
                "give every batch tensor a first dimension divisible by the accumulation steps"
            )
    count = valid_tokens(batch["labels"])
    count = (count_reduce(count) if count_reduce is not None else count).to(torch.float32)
    parts = [t.chunk(steps) if isinstance(t, torch.Tensor) else [t] * steps for t in leaves]
    return [{**pytree.tree_unflatten([p[i] for p in parts], spec), NUM_TOKENS: count} for i in range(steps)]


def with_token_count(batch: dict[str, Any], count_reduce: CountReduce | None) -> dict[str, Any]:
    """`batch` with `NUM_TOKENS`, the step's count of counted labels over every data-parallel rank (mapped by
    `count_reduce`, as for `micro_batches`): a step without accumulation whose labels are masked (instruction data)
    then divides its summed loss by the global batch's count, not by its own (a mean of means is wrong when the
    ranks count different numbers of tokens)."""
    return micro_batches(batch, 1, count_reduce)[0]


def sum_losses(losses: list[torch.Tensor]) -> torch.Tensor:
    """The step's loss from its micro-batches' (each already a share of the step's mean), added in order."""
    total = losses[0]
    for loss in losses[1:]:
        total = total + loss
    return total


@dataclasses.dataclass(frozen=True)
class GraphNode:
    """One node of the graph a traced step runs, for the memory timeline (`observability.memory_timeline`)."""

    name: str
    op: str  # the op's name ("mm", "placeholder", ...)
    module_fqn: str  # the module that made it ("" at the top level)
    phase: str | None  # "forward", "backward", "optimizer", or None for inputs and outputs
    estimated_bytes: int | None  # live bytes while it runs, by the static estimate (None: none was made)
    dispatches: Any = None  # the OpOverload it dispatches when the graph runs op by op, else None


class TrainStep(Protocol):
    """One training step on a batch, and a report of what it cost."""

    def __call__(self, batch: Any) -> StepOutput:
        """Run one step: the (clipped) gradients land in `param.grad`; with an optimizer, the update runs too."""
        ...

    def report(self) -> StepReport:
        """What the trainer logs about the steps run so far."""
        ...

    def graph_nodes(self) -> list[GraphNode] | None:
        """The nodes of the graph that runs, in order, with the estimate at each; None for a step that is not
        one graph (eager)."""
        ...

    def held_tensors(self) -> list[torch.Tensor]:
        """Tensors the step itself keeps from one step to the next (not the model's nor the optimizer's): memory
        the CPU figure counts as alive when a step starts, as the CUDA allocator does."""
        ...


class EvalStep(Protocol):
    """The loss on a batch without gradients (forward and loss only), and a report of what it cost."""

    def __call__(self, batch: Any) -> torch.Tensor:
        """The loss on `batch` (a 0-d tensor); nothing of the model or optimizer is written."""
        ...

    def report(self) -> StepReport:
        """What the trainer logs about the evaluations run so far (trace count, estimated peak)."""
        ...
