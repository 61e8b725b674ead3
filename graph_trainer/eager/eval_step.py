"""The eager evaluation step: the loss under `torch.no_grad()` with the model in eval mode, the baseline of the
traced one (`graph_trainer.tracer.eval_step.GraphEvalStep`)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from graph_trainer.loss import lm_loss
from graph_trainer.step import StepReport
from graph_trainer.tracer.capture import LossFn
from graph_trainer.tracer.eval_step import eval_mode


class EagerEvalStep:
    """`loss_fn(model, batch)` without autograd and without dropout; returns the loss (a 0-d tensor)."""

    def __init__(self, model: nn.Module, *, loss_fn: LossFn = lm_loss) -> None:
        self.model, self.loss_fn = model, loss_fn

    def __call__(self, batch: Any) -> torch.Tensor:
        with torch.no_grad(), eval_mode(self.model):
            return self.loss_fn(self.model, batch)

    def report(self) -> StepReport:
        """Nothing is traced or estimated."""
        return StepReport(updates_inside=False)


__all__ = ["EagerEvalStep"]
