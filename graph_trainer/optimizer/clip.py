"""Gradient clipping by the global L2 norm, the same ops in the eager and the traced step."""

from __future__ import annotations

from collections.abc import Callable

import torch


def clip_grads_(
    grads: list[torch.Tensor], max_norm: float, norm_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
) -> torch.Tensor:
    """Scale `grads` in place so their global L2 norm is at most `max_norm`; returns the norm before clipping.

    With sharded gradients, `norm_reduce` maps this rank's squared norm to the
    global one (the sum over ranks), so every rank clips by the same factor.

    The eager step and the traced step both call this very function, so the two
    run the same ops in the same order (torch's `clip_grad_norm_` would pick a
    foreach kernel for real tensors but not for fake ones).
    """
    total_norm = torch.linalg.vector_norm(torch.stack(grad_norms(grads)), 2.0)
    if norm_reduce is not None:
        total_norm = torch.sqrt(norm_reduce(total_norm * total_norm))
    scale_to_norm_(grads, total_norm, max_norm)
    return total_norm


def grad_norms(grads: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each gradient's L2 norm (0-d tensors): the terms of the global norm, in `grads`' order."""
    return [torch.linalg.vector_norm(g, 2.0) for g in grads]


def scale_to_norm_(grads: list[torch.Tensor], total_norm: torch.Tensor, max_norm: float) -> None:
    """Scale `grads` in place so that a global norm of `total_norm` becomes at most `max_norm` (<= 0: leave them).

    Pipeline stages call it with the norm over every stage's gradients (their `grad_norms` gathered in the whole
    model's order and reduced as `clip_grads_` reduces them), so each clips as one process would."""
    if max_norm > 0:
        coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef)
