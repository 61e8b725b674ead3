"""The evaluation step as its own graph: forward and loss only.

`trace_eval` traces `loss_fn(model, batch)` with `make_fx` on fake tensors under `torch.no_grad()`, with the
model in eval mode: the graph takes the parameters, buffers and batch (no optimizer state, no host scalars)
and returns `[loss]`. Nothing in it records or computes a gradient, so no activation is kept for a backward:
each is freed after its last use in the forward. Ops are tagged with their module and layer as in the
training step's graph, so its memory estimate names where the peak is.

`GraphEvalStep` traces once per batch signature and runs the graph under `no_grad`; the static memory estimate
(`graph_trainer.tracer.memory_estimate`) gives its peak.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.fx
import torch.fx.traceback as fx_traceback
import torch.nn as nn
import torch.utils._pytree as pytree

from graph_trainer.loss import lm_loss
from graph_trainer.observability.log import get_logger
from graph_trainer.step import StepReport
from graph_trainer.tracer import node_meta
from graph_trainer.tracer.capture import (
    InputLayout,
    LossFn,
    TracedStep,
    _fake_inputs,
    _lay_out_inputs,
    _make_graph,
    _ModuleAnnotator,
    as_pytree,
    batch_signature,
    batch_tensors,
    describe_change,
    device_type,
)
from graph_trainer.tracer.guards import TraceGuard, recording_reads, tensor_meta
from graph_trainer.tracer.memory_estimate import estimate_peak_memory

logger = get_logger(__name__)


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[None]:
    """`model.eval()` for the duration (dropout off), then each module's own training flag back."""
    flags = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, training in flags:
            m.training = training


class _EvalFunction:
    """What make_fx traces: flat (params, buffers, batch) -> [loss], the model's tensors swapped in."""

    def __init__(self, model: nn.Module, layout: InputLayout, batch_leaves: list[Any], loss_fn: LossFn, layers):
        self.model, self.layout, self.batch_leaves, self.loss_fn = model, layout, batch_leaves, loss_fn
        self.annotator = _ModuleAnnotator(model, layers)
        self.failure: dict[str, Any] = {}

    def __call__(self, *flat: torch.Tensor) -> list[torch.Tensor]:
        params, buffers, batch, *_ = self.layout.split(list(flat))  # no optimizer state, scalars or accumulators
        layout = self.layout
        try:
            with fx_traceback.annotate({node_meta.PHASE: node_meta.FORWARD}):
                tensors = {
                    **dict(zip(layout.param_names, params, strict=True)),
                    **dict(zip(layout.buffer_names, buffers, strict=True)),
                }
                with torch.nn.utils.stateless._reparametrize_module(self.model, tensors, tie_weights=True):
                    leaves = iter(batch)
                    values = [next(leaves) if isinstance(v, torch.Tensor) else v for v in self.batch_leaves]
                    return [self.loss_fn(self.model, pytree.tree_unflatten(values, layout.batch_spec))]
        except Exception:
            self.failure["module"] = self.annotator.current_module()
            raise


def trace_eval(
    model: nn.Module,
    batch: Any,
    *,
    loss_fn: LossFn = lm_loss,
    device: torch.device | str | None = None,
    failure_dir: Path | None = None,
    layers: str | None = None,
) -> TracedStep:
    """Trace the evaluation of `model` on a batch shaped like `batch`: flat inputs -> [loss] (see module doc).

    Raises:
        TraceError: with the module and source line that could not be traced.
    """
    device = torch.device(device) if device is not None else None
    batch = as_pytree(batch)
    layout, leaves, inputs = _lay_out_inputs(model, batch, None)
    function = _EvalFunction(model, layout, leaves, loss_fn, layers)
    fakes = [t.detach() for t in _fake_inputs(inputs, layout, device)]  # no input asks for a gradient
    # The graph is in eval mode whatever the live flags: `training` is not what it depends on.
    with torch.no_grad(), eval_mode(model), recording_reads(model, ignore=frozenset({"training"})) as reads:
        gm, trace_time = _make_graph(function, fakes, failure_dir)
    gm.recompile()
    named = zip((*layout.param_names, *layout.buffer_names), inputs, strict=False)  # the tensors lead the inputs
    guard = TraceGuard.capture(reads, device_type(inputs, device), None, tensor_meta(named))  # no gradient returned
    return TracedStep(gm=gm, layout=layout, signature=batch_signature(batch), trace_time_s=trace_time, guard=guard)


class GraphEvalStep:
    """The evaluation loss of `model` on a batch, as a traced graph; traced again only for a new batch signature.

    `step(batch)` returns the loss (a 0-d tensor); `report()` the trace count and time and the graph's estimated
    peak bytes.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn = lm_loss,
        device: torch.device | None = None,
        failure_dir: Path | None = None,
        layers: str | None = None,
    ) -> None:
        self.model, self.loss_fn, self.device = model, loss_fn, device
        self.failure_dir, self.layers = failure_dir, layers
        self.traced: TracedStep | None = None
        self.trace_count, self.trace_time_s = 0, 0.0
        self.estimated_peak_bytes: int | None = None

    def ensure_traced(self, batch: Any) -> TracedStep:
        """The graph for `batch`'s signature and the model's current state, tracing it if needed."""
        reason = None
        if self.traced is not None:
            signature = batch_signature(batch)
            changed = self.traced.signature != signature
            live = tensor_meta((*self.model.named_parameters(), *self.model.named_buffers()))
            reason = (
                describe_change(self.traced.signature, signature) if changed else self.traced.guard.stale(None, live)
            )
            if reason is not None:
                logger.info(f"retracing the evaluation step: {reason}")
        if self.traced is None or reason is not None:
            self.traced = trace_eval(
                self.model,
                batch,
                loss_fn=self.loss_fn,
                device=self.device,
                failure_dir=self.failure_dir,
                layers=self.layers,
            )
            self.trace_count += 1
            self.trace_time_s += self.traced.trace_time_s
            estimate = estimate_peak_memory(self.traced.gm, input_categories=self.traced.layout.categories)
            self.estimated_peak_bytes = estimate.peak_bytes
        return self.traced

    def __call__(self, batch: Any) -> torch.Tensor:
        """The loss on `batch`; the model's parameters and buffers are read, nothing is written."""
        traced = self.ensure_traced(batch)
        inputs = [*(p for _, p in self.model.named_parameters()), *(b for _, b in self.model.named_buffers())]
        with torch.no_grad():
            return traced.gm(*inputs, *batch_tensors(batch))[0]

    def report(self) -> StepReport:
        """Trace count and time, and the estimated peak of the current graph (None before the first trace)."""
        return StepReport(
            updates_inside=False,
            trace_count=self.trace_count,
            trace_time_s=self.trace_time_s,
            estimated_peak_bytes=self.estimated_peak_bytes,
        )


__all__ = ["GraphEvalStep", "eval_mode", "trace_eval"]
