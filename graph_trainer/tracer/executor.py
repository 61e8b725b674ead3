"""Running a traced step every iteration: trace once per input signature, then replay.

`GraphStep` owns the current `TracedStep` of a model. Each call checks the
batch's signature (structure, shapes, dtypes, devices: a tuple compare), traces
again when it changed (or refuses, with `on_shape_change="error"`), feeds the
graph from the live model and optimizer, and writes the gradients it returns
into `param.grad` as eager backward would.

A transform (the pass pipeline, then optionally a compile stage) takes each
fresh trace and returns a `Transformed`: the step to run and what the transform
computed about it (the memory estimate of the final graph).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from graph_trainer.errors import UserError
from graph_trainer.loss import NUM_TOKENS, lm_loss
from graph_trainer.observability.log import get_logger
from graph_trainer.optimizer.adamw import adamw_implementation
from graph_trainer.optimizer.update_memory import Accumulation, EagerUpdate, accumulated_estimate, whole_step_peak
from graph_trainer.step import (
    CountReduce,
    GraphNode,
    StepOutput,
    StepReport,
    micro_batches,
    sum_losses,
    with_token_count,
)
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import (
    GradReduce,
    GraphOptimizer,
    LossFn,
    NormReduce,
    StepUpdate,
    TracedStep,
    batch_signature,
    batch_tensors,
    describe_change,
    trace_step,
)
from graph_trainer.tracer.guards import TensorMeta, tensor_meta
from graph_trainer.tracer.memory_estimate import MemoryEstimate


@dataclasses.dataclass
class Transformed:
    """What a transform returns for a fresh trace: the step to run and, if it computed one, its memory estimate."""

    traced: TracedStep
    memory_estimate: MemoryEstimate | None = None
    compile_time_s: float | None = None  # set by a compile stage


# A transform may also return the TracedStep alone (a user's own rewrite that estimates nothing).
Transform = Callable[[TracedStep], "Transformed | TracedStep"]

logger = get_logger(__name__)


@dataclasses.dataclass
class TraceStats:
    """How often the step was traced and why; logged as `trace/count` and `compile/trace_time_s`."""

    count: int = 0
    total_time_s: float = 0.0
    last_time_s: float = 0.0
    reasons: list[str] = dataclasses.field(default_factory=list)
    compile_time_s: float | None = None  # total, when a compile stage ran


# How the log names each part of the step (see capture.PARTS).
_PART_NAMES = {"step": "step", "micro": "micro-batch graph", "update": "update graph"}


def stale_reason(
    traced: TracedStep,
    signature: tuple,
    trainable: tuple[str, ...],
    batch: bool = True,
    tensors: TensorMeta | None = None,
) -> str | None:
    """Why `traced` does not compute this step as eager would (a new batch signature, when `batch`, or a value
    its guard recorded: `tensors` are the live parameters' and buffers' `tensor_meta`), or None when it does."""
    if batch and traced.signature != signature:
        return describe_change(traced.signature, signature)
    if traced.guard is not None:
        return traced.guard.stale(trainable, tensors)
    if traced.layout.grad_names != trainable:  # a trace made without a guard still returns one grad per name
        return "the set of parameters with requires_grad=True changed"
    return None


class GraphStep:
    """A model's training step as a traced graph, retraced only when the batch signature changes.

    Implements the step protocol (`graph_trainer.step.TrainStep`).

    Args:
        model: the live model; its parameters and buffers feed the graph each step.
        loss_fn: forward + loss (default: causal-LM cross-entropy).
        max_norm: gradient clipping inside the graph (<= 0: norm only).
        optimizer: a `GraphOptimizer` to trace the update into the graph, or None.
        eager_optimizer: a `torch.optim.AdamW` stepped eagerly after the graph instead (its state
            and scratch count in `report().estimated_peak_bytes`), or None.
        on_shape_change: "retrace" (log the reason and count it) or "error".
        transform: applied to each fresh trace (the pass pipeline).
        device: device to trace for (default: the parameters').
        failure_dir: where a failing trace leaves its partial graph.
        grad_reduce: traced into the graph between the backward and clipping (see `trace_step`).
        layers: FQN of the container of the transformer blocks (see `trace_step`); None guesses it.
        norm_reduce: makes the clipping norm global for sharded gradients (see `trace_step`).
        accumulation_steps: micro-batches per step (1: the whole step is one graph). Above 1 the step runs two
            graphs (`trace_step`'s parts): "micro", run once per micro-batch, adds each gradient in place into an
            accumulator (zeros at the start of the step), then "update" reduces (`grad_reduce`, once), clips and
            updates on the sums. Neither depends on the number of micro-batches.
        count_reduce: maps this rank's count of valid tokens to its loss divisor (see `step.micro_batches`).
        count_tokens: without accumulation too, divide the summed loss by the global batch's count of counted
            tokens (`step.with_token_count`): for data whose labels are masked.
        step_update: the model's once-per-step buffer update, traced after the gradients (see `trace_step`): into
            the step graph, or with accumulation into the update graph (once per step, after every micro-batch).
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn = lm_loss,
        max_norm: float = 0.0,
        optimizer: GraphOptimizer | None = None,
        on_shape_change: str = "retrace",
        transform: Transform | None = None,
        device: torch.device | None = None,
        failure_dir: Path | None = None,
        grad_reduce: GradReduce | None = None,
        eager_optimizer: torch.optim.AdamW | None = None,
        layers: str | None = None,
        norm_reduce: NormReduce | None = None,
        accumulation_steps: int = 1,
        count_reduce: CountReduce | None = None,
        step_update: StepUpdate | None = None,
        count_tokens: bool = False,
    ):
        if on_shape_change not in ("retrace", "error"):
            raise UserError(f"compile.on_shape_change: expected retrace|error, got {on_shape_change!r}")
        if optimizer is not None and eager_optimizer is not None:
            raise ValueError("give the update to the graph (optimizer) or run it after it (eager_optimizer), not both")
        self.model = model
        self.loss_fn = loss_fn
        self.max_norm = max_norm
        self.optimizer = optimizer
        self.on_shape_change = on_shape_change
        self.transform = transform
        self.device = device
        self.failure_dir = failure_dir
        self.grad_reduce = grad_reduce
        self.norm_reduce = norm_reduce
        self.eager_optimizer = eager_optimizer
        self._eager_update: EagerUpdate | None = None  # its memory, measured on first report
        self._reusable: tuple[Transformed, str] | None = None  # (a trace made elsewhere, by whom): see reuse_trace
        self.layers = layers
        self.accumulation_steps, self.count_reduce = accumulation_steps, count_reduce
        self.count_tokens = count_tokens
        self.step_update = step_update
        self.update: Transformed | None = None  # the "update" part of an accumulated step, traced on first use
        self._batch_bytes = 0  # the trainer's whole batch (every micro-batch), alive throughout the step
        self.stats = TraceStats()
        self._warned_self_changing = False
        self.traced: TracedStep | None = None
        self.memory_estimate: MemoryEstimate | None = None  # of the current graph, when the transform made one
        self._bind(dict(model.named_parameters()), dict(model.named_buffers()))

    def _bind(self, params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor]) -> None:
        """Take `params` and `buffers` (the model's, by name) as the graph inputs each step reads and writes."""
        self._params, self._params_by_name, self._buffers = list(params.values()), params, list(buffers.values())
        self._bound = (*self._params, *self._buffers)

    def live_tensors(self) -> tuple[tuple[str, ...], TensorMeta]:
        """The model's trainable parameter names and its tensors' `tensor_meta` now, after rebinding the tensors
        the model holds now when some were replaced since the last step (a state dict loaded with `assign=True`,
        a new `nn.Parameter`): the graph reads and writes the model's tensors, never stale ones.

        Raises:
            UserError: a replaced parameter that an optimizer of this step still holds (it would update the old
                tensor while the model reads the new one).
        """
        params, buffers = dict(self.model.named_parameters()), dict(self.model.named_buffers())
        live = (*params.values(), *buffers.values())
        if len(live) != len(self._bound) or any(a is not b for a, b in zip(live, self._bound, strict=False)):
            kept = {id(t) for t in live}
            held = {id(p) for opt in self._optimizers() for g in opt.param_groups for p in g["params"]}
            names = {id(p): n for n, p in self._params_by_name.items()}
            orphaned = [names[id(t)] for t in self._params if id(t) not in kept and id(t) in held]
            if orphaned:
                raise UserError(
                    f"parameter {orphaned[0]} was replaced after the step and its optimizer were built (a state dict "
                    "loaded with assign=True, or a new nn.Parameter): the optimizer would update the old tensor "
                    "while the model reads the new one; load the weights first, then build the optimizer and the step"
                )
            logger.info("the model's tensors were replaced since the last step: the step reads the new ones")
            self._bind(params, buffers)
        trainable = tuple(name for name, p in params.items() if p.requires_grad)
        return trainable, tensor_meta((*params.items(), *buffers.items()))

    def _optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers this step updates parameters with (traced or run after the graph)."""
        traced = getattr(self.optimizer, "optimizer", None)  # GraphAdamW wraps the torch optimizer it traces
        return [opt for opt in (traced, self.eager_optimizer) if opt is not None]

    def reuse_trace(self, result: Transformed, source: str) -> None:
        """Run the first batch on `result` instead of tracing, if its signature matches.

        `result` must be this step transformed as this step's own transform would
        (same model structure, loss, clipping, optimizer placement, gradient reduction
        and passes): the preflight traces it on the meta model for the same device.
        It counts as this step's first trace (`stats.count`), so a run traces once.
        """
        self._reusable = (result, source)

    @property
    def part(self) -> str:
        """The part of the step the main graph covers: the whole step, or a micro-batch of an accumulated one."""
        return "step" if self.accumulation_steps == 1 else "micro"

    def ensure_traced(self, batch: Any) -> TracedStep:
        """The graph for `batch`'s signature and the model's current state, tracing (and transforming) it if
        needed: when the batch signature or anything the trace baked in changed (`TracedStep.guard`).

        With accumulation, `batch` is a micro-batch (`step.micro_batches`); the update part is traced too."""
        signature = batch_signature(batch)
        trainable, tensors = self.live_tensors()
        if self.accumulation_steps > 1:
            reason = stale_reason(self.update.traced, signature, trainable, False, tensors) if self.update else None
            if self.update is None or reason is not None:
                self._before_retrace(reason, "update")
                self.update = self._transform(self._trace(batch, "update"))
        reason = stale_reason(self.traced, signature, trainable, tensors=tensors) if self.traced is not None else None
        if self.traced is not None and reason is None:
            return self.traced
        if self._reusable is not None:
            (result, source), self._reusable = self._reusable, None
            guard = result.traced.guard.rebound(self.model) if result.traced.guard is not None else None
            result.traced = dataclasses.replace(result.traced, guard=guard)
            misfit = stale_reason(result.traced, signature, trainable, tensors=tensors)
            if misfit is None:
                logger.info(f"the step reuses the trace made by {source} (same batch signature): no new trace")
                self._count_trace(result.traced)
                self._install(result)
                return self.traced
            logger.info(f"tracing the step: the trace made by {source} does not fit ({misfit})")
        self._before_retrace(reason, self.part)
        self._install(self._transform(self._trace(batch, self.part)))
        return self.traced

    def _before_retrace(self, reason: str | None, part: str) -> None:
        """Log and count the reason for a retrace, or stop with it under `on_shape_change="error"`; None: a
        first trace."""
        if reason is None:
            return
        what = _PART_NAMES[part]
        if self.on_shape_change == "error":
            raise UserError(
                f"the traced {what} no longer fits ({reason}) and compile.on_shape_change = 'error'; keep the "
                "batch shapes and the model's traced state fixed, or set compile.on_shape_change = 'retrace'"
            )
        logger.info(f"retracing the {what}: {reason}")
        self.stats.reasons.append(reason)

    def _trace(self, batch: Any, part: str) -> TracedStep:
        traced = trace_step(
            self.model,
            batch,
            loss_fn=self.loss_fn,
            max_norm=self.max_norm,
            optimizer=self.optimizer,
            device=self.device,
            failure_dir=self.failure_dir,
            grad_reduce=self.grad_reduce,
            layers=self.layers,
            norm_reduce=self.norm_reduce,
            part=part,
            step_update=self.step_update,
        )
        self._count_trace(traced)
        self._warn_if_self_changing(traced)
        return traced

    def _warn_if_self_changing(self, traced: TracedStep) -> None:
        """Say once when the traced code changed what it read (a counter it increments): each step will retrace."""
        changed = traced.guard.stale(traced.layout.grad_names) if traced.guard is not None else None
        if changed is not None and not self._warned_self_changing:
            self._warned_self_changing = True
            logger.warning(
                f"the traced step changes state it reads ({changed}): the graph holds the value it read, so each "
                "step retraces to follow it; keep such state in a buffer (a tensor) to trace it once"
            )

    def _transform(self, traced: TracedStep) -> Transformed:
        result = self.transform(traced) if self.transform is not None else traced
        return result if isinstance(result, Transformed) else Transformed(result)

    def _count_trace(self, traced: TracedStep) -> None:
        self.stats.count += 1
        self.stats.last_time_s = traced.trace_time_s
        self.stats.total_time_s += traced.trace_time_s

    def _install(self, result: Transformed) -> None:
        """Make `result` the graph that runs."""
        self.traced, self.memory_estimate = result.traced, result.memory_estimate
        if result.compile_time_s is not None:
            self.stats.compile_time_s = (self.stats.compile_time_s or 0.0) + result.compile_time_s

    def flat_inputs(self, batch: Any, accums: list[torch.Tensor] = (), part: str = "step") -> list[torch.Tensor]:
        """Graph inputs of `part` of this step, gathered from the live model, batch, optimizer and accumulators."""
        inputs = [*self._params, *self._buffers, *(batch_tensors(batch) if part != "update" else [])]
        if self.optimizer is not None and part != "micro":
            inputs += self.optimizer.state_tensors() + self.optimizer.host_scalars()
        return inputs + list(accums)

    def prepare(self, batch: Any) -> TracedStep:
        """Trace (and transform) the graphs a step on `batch` runs, without running them (the planner's entry).

        With accumulation the graph is traced on the first micro-batch's shapes, the token count a stand-in."""
        self._batch_bytes = _nbytes(batch_tensors(batch))
        count = {NUM_TOKENS: torch.empty((), device=batch["labels"].device)}  # the token count's stand-in
        if self.part == "step":
            return self.ensure_traced({**batch, **count} if self.count_tokens else batch)
        micro = {k: v.chunk(self.accumulation_steps)[0] for k, v in batch.items()}
        return self.ensure_traced({**micro, **count})

    def step_estimate(self) -> MemoryEstimate | None:
        """The estimate of the whole step's graphs: the main graph's, or with accumulation the larger of the micro
        graph's and the update graph's, each widened to what is alive around it (`accumulated_estimate`)."""
        est = self.memory_estimate
        if self.update is None or est is None or self.update.memory_estimate is None:
            return est
        # Alive outside the micro graph: the traced update's optimizer state, the other micro-batches' tokens, and
        # during the last micro-step the earlier micro-steps' losses: what the memory budget leaves room for too.
        state = _nbytes(self.optimizer.state_tensors()) if self.optimizer is not None else 0
        beside = Accumulation(self.accumulation_steps, state).held(self.traced.gm, self.traced.layout.categories)
        update = self.update.memory_estimate
        return accumulated_estimate(est, update, micro_extra=beside, update_extra=self._batch_bytes)

    def __call__(self, batch: Any) -> StepOutput:
        """Run one training step; returns (loss, grad_norm) and leaves the (clipped) grads in `param.grad`."""
        self._batch_bytes = _nbytes(batch_tensors(batch))
        micro = micro_batches(batch, self.accumulation_steps, self.count_reduce) if self.part == "micro" else None
        if micro is None and self.count_tokens:
            batch = with_token_count(batch, self.count_reduce)
        traced = self.ensure_traced(micro[0] if micro else batch)
        # Frozen parameters get no gradient, and their .grad is left alone, as eager backward does.
        trained = [self._params_by_name[n] for n in traced.layout.grad_names]
        for p in trained:  # as zero_grad(set_to_none=True): last step's grads must not outlive it
            p.grad = None
        if micro is None:
            loss, grad_norm, grads = traced(self.flat_inputs(batch))
        else:
            loss, grad_norm, grads = self._accumulated(traced, micro, trained)
        for p, g in zip(trained, grads, strict=True):
            p.grad = g
        if self.optimizer is not None:
            self.optimizer.after_step()
        if self.eager_optimizer is not None:
            self.eager_optimizer.step()
        return StepOutput(loss, grad_norm)

    def _accumulated(
        self, traced: TracedStep, micro: list[Any], trained: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
        """The micro graph on each micro-batch, accumulating into zeros, then the update graph on the sums."""
        accums = [torch.zeros_like(p) for p in trained]  # 0 + g is g exactly: autograd's first assignment
        losses = [traced.run(self.flat_inputs(m, accums, "micro"))[0] for m in micro]
        out = self.update.traced.run(self.flat_inputs(None, accums, "update"))
        return sum_losses(losses), out[0], out[1:]

    def report(self) -> StepReport:
        """Trace stats, and the current graph's estimated peak widened to the eager update when there is one."""
        s = self.stats
        out = StepReport(
            updates_inside=self.optimizer is not None,
            trace_count=s.count,
            trace_time_s=s.total_time_s,
            retrace_reasons=list(s.reasons),
            compile_time_s=s.compile_time_s,
            cuda_graphs=bool(getattr(self.traced and self.traced.compiled, "cudagraphs", False)),
        )
        est = self.step_estimate()
        if est is not None:
            out.estimated_peak_bytes = whole_step_peak(est, self._update_cost())[0]
            out.saved_activation_bytes = est.saved_bytes
        return out

    def held_tensors(self) -> list[torch.Tensor]:
        """None: the graph's outputs are the loss, the norm and the gradients (left in `param.grad`)."""
        return []

    def graph_nodes(self) -> list[GraphNode] | None:
        """The current graph's nodes with the estimate's live bytes at each (see `graph_trainer.step.GraphNode`).

        `dispatches` is set only when the graph runs op by op (not compiled): then each call_function node
        of an OpOverload reaches the dispatcher once, in graph order, which is how a measurement lines up.
        """
        if self.traced is None:
            return None
        timeline = self.memory_estimate.timeline if self.memory_estimate is not None else None
        op_by_op = self.traced.compiled is None
        return [
            GraphNode(
                name=n.name,
                op=getattr(n.target, "__name__", str(n.target)) if n.op == "call_function" else n.op,
                module_fqn=node_meta.module_fqn(n),
                phase=node_meta.phase(n),
                estimated_bytes=timeline[i] if timeline is not None else None,
                dispatches=n.target if op_by_op and isinstance(n.target, torch._ops.OpOverload) else None,
            )
            for i, n in enumerate(self.traced.gm.graph.nodes)
        ]

    def _update_cost(self) -> EagerUpdate | None:
        if self.eager_optimizer is not None and self._eager_update is None:
            device = self.device or self._params[0].device
            self._eager_update = EagerUpdate.of(
                self.eager_optimizer, adamw_implementation(self.eager_optimizer.param_groups[0]), device
            )
        return self._eager_update


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
