"""The learning-rate schedule: linear warmup, then linear, cosine or no decay (`lr_scheduler.*`)."""

from __future__ import annotations

import math

import torch

from graph_trainer.errors import ConfigError


def lr_factor(step: int, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float) -> float:
    """Multiplier of the base LR for optimizer step `step` (0-based): linear warmup, then decay."""
    if step < warmup_steps:
        return (step + 1) / (warmup_steps + 1)
    if decay_type == "none":
        return 1.0
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay_type == "linear":
        shape = 1.0 - progress
    elif decay_type == "cosine":
        shape = 0.5 * (1.0 + math.cos(math.pi * progress))
    else:
        raise ConfigError(f"lr_scheduler.decay_type: expected linear|cosine|none, got {decay_type!r}")
    return min_lr_factor + (1.0 - min_lr_factor) * shape


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, *, warmup_steps: int, total_steps: int, decay_type: str, min_lr_factor: float
) -> torch.optim.lr_scheduler.LambdaLR:
    """A LambdaLR over `lr_factor`; step it once after every optimizer step."""
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda step: lr_factor(
            step, warmup_steps=warmup_steps, total_steps=total_steps, decay_type=decay_type, min_lr_factor=min_lr_factor
        ),
    )


def resync_lr(scheduler: torch.optim.lr_scheduler.LambdaLR) -> None:
    """Set each group's lr from this run's schedule at the scheduler's position.

    Needed after loading a checkpoint: the saved lr came from the saved run's
    schedule, and a resumed run may have a different `training.steps` horizon.
    """
    for group, base_lr, fn in zip(
        scheduler.optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas, strict=True
    ):
        group["lr"] = base_lr * fn(scheduler.last_epoch)
    scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
