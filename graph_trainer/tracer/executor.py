"""Running a traced step every iteration: trace once per input signature, then replay.

`GraphStep` owns the current `TracedStep` of a model. Each call checks the
batch's signature (structure, shapes, dtypes, devices: a tuple compare), traces
again when it changed (or refuses, with `on_shape_change="error"`), feeds the
graph from the live model and optimizer, and writes the gradients it returns
into `param.grad` as eager backward would.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils._pytree as pytree

from graph_trainer.errors import UserError
from graph_trainer.log import get_logger
from graph_trainer.loss import lm_loss
from graph_trainer.tracer.capture import (GradReduce, GraphOptimizer, LossFn, TracedStep,
                                          batch_signature, batch_tensors, trace_step,
                                          trainable_parameter_names)

Transform = Callable[[TracedStep], TracedStep]

logger = get_logger(__name__)


@dataclasses.dataclass
class TraceStats:
    """How often the step was traced and why; logged as `trace/count` and `compile/trace_time_s`."""

    count: int = 0
    total_time_s: float = 0.0
    last_time_s: float = 0.0
    reasons: list[str] = dataclasses.field(default_factory=list)


def describe_change(old: tuple, new: tuple) -> str:
    """A short human reason for a signature change, e.g. "['input'] shape (4, 256) -> (4, 128)"."""
    if [leaf[0] for leaf in old] != [leaf[0] for leaf in new]:
        return f"batch structure changed: {[leaf[0] for leaf in old]} -> {[leaf[0] for leaf in new]}"
    diffs = []
    for (path, *a), (_, *b) in zip(old, new):
        for what, x, y in zip(("shape", "dtype", "device"), a, b):
            if x != y:
                diffs.append(f"{path} {what} {x} -> {y}")
    return "; ".join(diffs) or "signature changed"


class GraphStep:
    """A model's training step as a traced graph, retraced only when the batch signature changes.

    Args:
        model: the live model; its parameters and buffers feed the graph each step.
        loss_fn: forward + loss (default: causal-LM cross-entropy).
        max_norm: gradient clipping inside the graph (<= 0: norm only).
        optimizer: a `GraphOptimizer` to trace the update into the graph, or None.
        on_shape_change: "retrace" (log the reason and count it) or "error".
        transform: applied to each fresh trace (the pass pipeline).
        device: device to trace for (default: the parameters').
        failure_dir: where a failing trace leaves its partial graph.
        grad_reduce: traced into the graph between the backward and clipping (see `trace_step`).
        layers: FQN of the container of the transformer blocks (see `trace_step`); None guesses it.
    """

    def __init__(self, model: nn.Module, *, loss_fn: LossFn = lm_loss, max_norm: float = 0.0,
                 optimizer: GraphOptimizer | None = None, on_shape_change: str = "retrace",
                 transform: Transform | None = None, device: torch.device | None = None,
                 failure_dir: Path | None = None, grad_reduce: GradReduce | None = None,
                 layers: str | None = None):
        if on_shape_change not in ("retrace", "error"):
            raise UserError(f"compile.on_shape_change: expected retrace|error, got {on_shape_change!r}")
        self.model = model
        self.loss_fn = loss_fn
        self.max_norm = max_norm
        self.optimizer = optimizer
        self.on_shape_change = on_shape_change
        self.transform = transform
        self.device = device
        self.failure_dir = failure_dir
        self.grad_reduce = grad_reduce
        self.layers = layers
        self.stats = TraceStats()
        self.traced: TracedStep | None = None
        self._params = [p for _, p in model.named_parameters()]
        self._params_by_name = dict(model.named_parameters())
        self._buffers = [b for _, b in model.named_buffers()]

    def ensure_traced(self, batch: Any) -> TracedStep:
        """The graph for `batch`'s signature, tracing (and transforming) it if needed."""
        signature = batch_signature(batch)
        trainable = trainable_parameter_names(self.model)
        if self.traced is not None and self.traced.signature == signature \
                and self.traced.layout.grad_names == trainable:
            return self.traced
        if self.traced is not None:
            reason = describe_change(self.traced.signature, signature) if self.traced.signature != signature \
                else "the set of parameters with requires_grad=True changed"
            if self.on_shape_change == "error":
                raise UserError(f"the batch signature changed ({reason}) and compile.on_shape_change = "
                                "'error'; keep shapes fixed or set compile.on_shape_change = 'retrace'")
            logger.info(f"retracing the step: {reason}")
            self.stats.reasons.append(reason)
        traced = trace_step(self.model, batch, loss_fn=self.loss_fn, max_norm=self.max_norm,
                            optimizer=self.optimizer, device=self.device,
                            failure_dir=self.failure_dir, grad_reduce=self.grad_reduce, layers=self.layers)
        self.stats.count += 1
        self.stats.last_time_s = traced.trace_time_s
        self.stats.total_time_s += traced.trace_time_s
        self.traced = self.transform(traced) if self.transform is not None else traced
        return self.traced

    def flat_inputs(self, batch: Any) -> list[torch.Tensor]:
        """Graph inputs for this step, gathered from the live model, batch and optimizer."""
        inputs = [*self._params, *self._buffers, *batch_tensors(batch)]
        if self.optimizer is not None:
            inputs += self.optimizer.state_tensors() + self.optimizer.host_scalars()
        return inputs

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """Run one training step; returns (loss, grad_norm) and leaves the (clipped) grads in `param.grad`."""
        traced = self.ensure_traced(batch)
        # Frozen parameters get no gradient, and their .grad is left alone, as eager backward does.
        trained = [self._params_by_name[n] for n in traced.layout.grad_names]
        for p in trained:  # as zero_grad(set_to_none=True): last step's grads must not outlive it
            p.grad = None
        loss, grad_norm, grads = traced(self.flat_inputs(batch))
        for p, g in zip(trained, grads):
            p.grad = g
        if self.optimizer is not None:
            self.optimizer.after_step()
        return loss, grad_norm
