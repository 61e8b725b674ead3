"""Divergence: when a run has blown up, and which states are sane enough to checkpoint.

A checkpoint is only useful if training can continue from it. A step's loss is
computed *before* its update, so a finite loss says nothing about the weights the
update just wrote: with `optimizer.lr 1e10` step 1 logs a normal loss and leaves
weights of ~4e9, and a checkpoint of them gives NaN at once, whatever lr a resume
uses. So:

- every step (free: the loss and grad norm are read anyway): a non-finite loss or
  gradient norm means the run diverged;
- before every save (one pass over the parameters, only then): the parameters must
  be finite, their norm must not have grown more than 10x since the last check (the
  previous save, or the start of this run), and the loss must not have exploded
  to more than 10x this run's first loss. Healthy training moves the weight norm by
  a few percent between checkpoints (a few-fold over a whole run, from a small
  init); an update that blows up moves it by orders of magnitude (92.9 -> 6.4e11
  with lr 1e10). The bound is wide on purpose: a false alarm stops a healthy run.

A failed check stops the run (`TrainingDiverged`, exit code 3) without saving, so
every checkpoint on disk passed it. With FSDP each rank holds other shards: the
norm is summed over the ranks (`sum_over_ranks`), so every rank decides alike and
none is left waiting in a save the others skipped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

from graph_trainer.errors import TrainingDiverged  # defined there so that the command line catches it without torch

MAX_NORM_GROWTH = 10.0  # parameter norm at a save / norm at the previous check
MAX_LOSS_GROWTH = 10.0  # loss at a save / this run's first loss


def parameter_norm(params: Iterable[torch.Tensor]) -> float:
    """The L2 norm over all parameters (inf or nan when any element is); no copy of any parameter is made."""
    norms = [torch.linalg.vector_norm(p.detach()).to(torch.float64) for p in params]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


class DivergenceGuard:
    """Checks a run's steps and the state before each save (see the module doc).

    `start(params, step)` measures the reference norm (once, at the start of the run);
    `check_step` runs after every step, `check_before_save` before every save. Both
    raise TrainingDiverged with the reason; the caller adds what was kept.
    `sum_over_ranks` (sharded parameters) sums a value over the ranks; every rank must
    then call `start` and `check_before_save` together.
    """

    def __init__(self, sum_over_ranks: Callable[[float], float] | None = None) -> None:
        self.ref_norm: float | None = None
        self.ref_step = 0
        self.first_loss: float | None = None
        self.sum_over_ranks = sum_over_ranks

    def _norm(self, params: Iterable[torch.Tensor]) -> float:
        norm = parameter_norm(params)
        return math.sqrt(self.sum_over_ranks(norm * norm)) if self.sum_over_ranks is not None else norm

    def start(self, params: Iterable[torch.Tensor], step: int) -> None:
        self.ref_norm, self.ref_step = self._norm(params), step

    def check_step(self, step: int, loss: float, grad_norm: float) -> None:
        if not math.isfinite(loss):
            raise TrainingDiverged(f"the loss became {loss} at step {step}")
        if not math.isfinite(grad_norm):
            raise TrainingDiverged(f"the gradient norm became {grad_norm} at step {step}")
        if self.first_loss is None:
            self.first_loss = loss

    def check_before_save(self, step: int, loss: float, params: Iterable[torch.Tensor]) -> None:
        if self.first_loss is not None and loss > MAX_LOSS_GROWTH * max(self.first_loss, 1.0):
            raise TrainingDiverged(
                f"the loss exploded to {loss:.4g} at step {step} (this run started at {self.first_loss:.4g})"
            )
        norm = self._norm(params)
        if not math.isfinite(norm):
            raise TrainingDiverged(f"the parameters after step {step} are not finite (norm {norm})")
        if self.ref_norm is not None and norm > MAX_NORM_GROWTH * self.ref_norm:
            raise TrainingDiverged(
                f"the parameter norm exploded to {norm:.4g} after step {step} "
                f"(it was {self.ref_norm:.4g} at step {self.ref_step}; "
                f"more than {MAX_NORM_GROWTH:g}x is not a sane update)"
            )
        self.ref_norm, self.ref_step = norm, step
