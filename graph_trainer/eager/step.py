"""The eager training step: plain PyTorch autograd, the baseline every claim is measured against.

It runs the same loss function, the same gradient reduction (the data-parallel
average, when given) and the same gradient clipping as the traced step
(`graph_trainer.loss`, `graph_trainer.optimizer.adamw.clip_grads_`), so the two differ
only in how the step is executed. It implements the step protocol
(`graph_trainer.step.TrainStep`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from graph_trainer.loss import lm_loss
from graph_trainer.optimizer.clip import clip_grads_
from graph_trainer.step import CountReduce, StepOutput, StepReport, micro_batches, sum_losses, with_token_count
from graph_trainer.tracer.capture import GradReduce, LossFn, NormReduce, StepUpdate


class EagerStep:
    """forward + loss + backward [+ grad_reduce] + clipping [+ `optimizer.step()`].

    Without `optimizer` the update stays with the caller. With `accumulation_steps` > 1 the batch is cut into
    that many micro-batches (`graph_trainer.step.micro_batches`) whose backwards accumulate into `param.grad` as
    autograd does (the first assigns, the next add); `grad_reduce` and clipping then run once, on the sums.
    `step_update` (the model's once-per-step buffer update) runs after the gradients, before clipping, as the
    traced step runs it.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        loss_fn: LossFn = lm_loss,
        max_norm: float = 0.0,
        grad_reduce: GradReduce | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        norm_reduce: NormReduce | None = None,
        accumulation_steps: int = 1,
        count_reduce: CountReduce | None = None,
        step_update: StepUpdate | None = None,
        count_tokens: bool = False,
    ):
        self.model = model
        self.count_tokens = count_tokens  # as GraphStep's: the global count divides the loss without accumulation
        self.step_update = step_update
        self.accumulation_steps, self.count_reduce = accumulation_steps, count_reduce
        self.loss_fn = loss_fn
        self.max_norm = max_norm
        self.grad_reduce = grad_reduce
        self.optimizer = optimizer
        self.norm_reduce = norm_reduce

    def pipelined(self, mesh: Any, model: nn.Module, whole: nn.Module, layers: str, **options: Any) -> Any:
        """This step run as `mesh`'s rank of a pipeline (`distributed.eager_pipeline.EagerPipelinedStep`): the
        model's own modules as stages, under torch's schedule (`PipelineParallel.wrap_step` asks for it)."""
        from graph_trainer.distributed.eager_pipeline import EagerPipelinedStep

        return EagerPipelinedStep(self, mesh, model, whole, layers, **options)

    def report(self) -> StepReport:
        """Nothing is traced or estimated; the update (if any) runs eagerly after the backward."""
        return StepReport(updates_inside=False)

    def graph_nodes(self) -> None:
        """No graph: the memory timeline of an eager step has measured bytes per op only."""
        return None

    def held_tensors(self) -> list[torch.Tensor]:
        """None: what a step makes is freed or left in `param.grad`."""
        return []

    def __call__(self, batch: Any) -> StepOutput:
        """Run one step; returns (loss, grad_norm) with the clipped grads in `param.grad`."""
        # The model's trainable parameters now, not when the step was built: a state dict loaded with assign=True
        # replaces them, and requires_grad may have changed.
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            p.grad = None
        if self.accumulation_steps == 1:
            loss = self.loss_fn(self.model, with_token_count(batch, self.count_reduce) if self.count_tokens else batch)
            loss.backward()
        else:
            losses = []
            for micro in micro_batches(batch, self.accumulation_steps, self.count_reduce):
                losses.append(self.loss_fn(self.model, micro))
                losses[-1].backward()
                losses[-1] = losses[-1].detach()  # its graph is freed by the backward; keep only the value
            loss = sum_losses(losses)
        with torch.no_grad():
            if self.grad_reduce is not None:
                # Before clipping, as in the traced step: the norm is of the averaged gradients.
                for p, g in zip(params, self.grad_reduce([p.grad for p in params]), strict=True):
                    p.grad = g
            if self.step_update is not None:
                self.step_update(self.model)
            grad_norm = clip_grads_([p.grad for p in params], self.max_norm, self.norm_reduce)
        if self.optimizer is not None:
            self.optimizer.step()
        return StepOutput(loss.detach(), grad_norm)
