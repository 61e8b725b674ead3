"""The language-model loss, shared by the eager and the traced step."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_INDEX = -100


def cross_entropy_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean token cross-entropy in fp32; label `IGNORE_INDEX` (-100) marks tokens that do not count."""
    return F.cross_entropy(
        logits.flatten(0, 1).float(), labels.flatten(0, 1), ignore_index=IGNORE_INDEX
    )


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward a causal LM on `batch["input"]` and score it against `batch["labels"]`."""
    return cross_entropy_loss(model(batch["input"]), batch["labels"])
