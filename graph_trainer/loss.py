"""The language-model loss, shared by the eager and the traced step.

`lm_loss` projects every token to the vocabulary at once. `chunked_lm_loss` does the
output projection and the cross-entropy a chunk of tokens at a time and recomputes
each chunk's logits in the backward, so no [tokens, vocab] tensor is ever whole: on
Llama-3 8B (vocab 128,256, 8,192 tokens) each fp32 logits-sized tensor is 3.9 GiB.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from graph_trainer.errors import UserError

IGNORE_INDEX = -100
# Batch key of the count the summed token losses are divided by, when the batch is one micro-batch of several
# (gradient accumulation): every micro-batch's loss is then its share of the step's mean over all its valid
# tokens, so the accumulated gradient is the big batch's, not a mean of micro-batch means. Absent: the mean
# over this batch's own valid tokens.
NUM_TOKENS = "num_tokens"


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many labels count (are not `IGNORE_INDEX`), as a 0-d int64 tensor."""
    return (labels != IGNORE_INDEX).sum()


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean token cross-entropy in fp32; label `IGNORE_INDEX` (-100) marks tokens that do not count.

    With `num_tokens`, the sum over the valid tokens divided by it (see `NUM_TOKENS`); without it, torch's
    own mean, unchanged.
    """
    logits, labels = logits.flatten(0, 1).float(), labels.flatten(0, 1)
    if num_tokens is None:
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / num_tokens


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward a causal LM on `batch["input"]` and score it against `batch["labels"]` (see `NUM_TOKENS`)."""
    return cross_entropy_loss(model(batch["input"]), batch["labels"], batch.get(NUM_TOKENS))


def _chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits of one chunk, with the projection computed in `dtype` (as autocast would)."""
    return F.linear(hidden.to(dtype), weight.to(dtype)).float()


class ChunkedCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of `hidden @ weight.T` against `labels`, `chunk_size` rows at a time.

    Forward keeps only the loss; backward recomputes each chunk's logits and
    writes d(loss)/d(hidden) and d(loss)/d(weight) directly (softmax minus the
    one-hot label, scaled by 1/number of counted tokens, or 1/`num_tokens` when given: see `NUM_TOKENS`).
    Traced by make_fx, the recompute lands in the backward phase of the graph; in eager mode it runs as
    is, so the traced and eager steps stay bitwise equal to each other.
    Numerics against `lm_loss`: the per-chunk sums and the per-chunk weight
    gradients are added in a different order, so results agree to float
    rounding (tests/test_loss.py says how close), not bitwise.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        dtype: torch.dtype,
        num_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total = hidden.new_zeros((), dtype=torch.float32)
        for start in range(0, hidden.shape[0], chunk_size):
            logits = _chunk_logits(hidden[start : start + chunk_size], weight, dtype)
            total = total + F.cross_entropy(
                logits, labels[start : start + chunk_size], ignore_index=IGNORE_INDEX, reduction="sum"
            )
            del logits  # one chunk's logits alive at a time
        count = valid_tokens(labels) if num_tokens is None else num_tokens
        ctx.save_for_backward(hidden, weight, labels, count)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        hidden, weight, labels, count = ctx.saved_tensors
        scale = grad_loss / count
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        w = weight.to(ctx.dtype)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            h = hidden[start : start + ctx.chunk_size]
            y = labels[start : start + ctx.chunk_size]
            grad_logits = torch.softmax(_chunk_logits(h, weight, ctx.dtype), dim=-1)
            valid = y != IGNORE_INDEX
            rows = torch.arange(y.shape[0], device=y.device)
            grad_logits[rows, y.clamp(min=0)] -= 1.0
            grad_logits.mul_((valid.to(grad_logits.dtype) * scale).unsqueeze(1))
            g = grad_logits.to(ctx.dtype)
            del grad_logits
            grad_hidden[start : start + ctx.chunk_size] = (g @ w).to(hidden.dtype)
            grad_weight += (g.t() @ h.to(ctx.dtype)).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None


def chunked_lm_loss(model: nn.Module, batch: dict[str, torch.Tensor], *, chunk_size: int) -> torch.Tensor:
    """`lm_loss` with the output projection and cross-entropy done `chunk_size` tokens at a time.

    Needs `model.hidden_states(tokens)` (the states `model.output` projects) and a
    bias-free `model.output` linear layer. Under autocast the projection runs in
    the autocast dtype, as in `lm_loss`.
    """
    output = getattr(model, "output", None)
    if not hasattr(model, "hidden_states") or not isinstance(output, nn.Linear) or output.bias is not None:
        raise UserError(
            f"a chunked loss needs model.hidden_states(tokens) and a bias-free nn.Linear model.output; "
            f"{type(model).__name__} lacks them: set training.loss_chunk_size = 0"
        )
    hidden = model.hidden_states(batch["input"])
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    with torch.autocast(device_type, enabled=False):
        return ChunkedCrossEntropy.apply(
            hidden.flatten(0, 1), output.weight, batch["labels"].flatten(0, 1), chunk_size, dtype, batch.get(NUM_TOKENS)
        )


def build_lm_loss(chunk_size: int):
    """The LM loss for `training.loss_chunk_size`: `lm_loss` for 0, else `chunked_lm_loss` with that chunk size."""
    if chunk_size <= 0:
        return lm_loss
    return functools.partial(chunked_lm_loss, chunk_size=chunk_size)
