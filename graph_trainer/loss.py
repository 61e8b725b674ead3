"""The language-model loss, shared by the eager and the traced step.

`lm_loss` projects every token to the vocabulary at once. `chunked_lm_loss` does the
output projection and the cross-entropy a chunk of tokens at a time and recomputes
each chunk's logits in the backward, so no [tokens, vocab] tensor is ever whole: on
Llama-3 8B (vocab 128,256, 8,192 tokens) each fp32 logits-sized tensor is 3.9 GiB.

Under tensor parallelism the output projection is split by vocabulary and no rank ever holds whole logits:
inside `vocab_parallel(shard)` both losses hand their logits (or the chunked loss its hidden states) to the
`VocabShard` the parallelism passes in, which computes the vocabulary-parallel cross-entropy
(graph_trainer.distributed.vocab_parallel, with the same chunk loop: `each_chunk`, `chunked_backward`). So this
module stays free of any process group and of tensor parallelism.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import traceback as fx_traceback

from graph_trainer.errors import UserError

# The node-metadata key (in `node.meta["custom"]`) a traced chunked loss writes on each chunk's ops: the chunk's
# index. The chunks are identical, so a plan may trace a few and extend to any number (graph_trainer.plan).
LOSS_CHUNK = "loss_chunk"


def loss_chunk(index: int) -> contextlib.AbstractContextManager:
    """Tag the ops traced inside with their loss chunk (`LOSS_CHUNK`); outside a trace it only sets a dict entry."""
    return fx_traceback.annotate({LOSS_CHUNK: index})


IGNORE_INDEX = -100
# Batch key of the count the summed token losses are divided by, when the batch is one micro-batch of several
# (gradient accumulation): every micro-batch's loss is then its share of the step's mean over all its valid
# tokens, so the accumulated gradient is the big batch's, not a mean of micro-batch means. Absent: the mean
# over this batch's own valid tokens.
NUM_TOKENS = "num_tokens"
# Batch key of the packed rows' document ids [B, S] (data.document_masking; graph_trainer.data.loader writes it under
# the same name), handed to the model as its `document_ids` argument: each document then attends only within itself.
# Absent: the model sees one causal sequence per row.
DOCUMENT_IDS = "document_ids"


class VocabShard(Protocol):
    """This rank's part of a vocabulary-split output projection, which computes the losses of its logits
    (graph_trainer.distributed.vocab_parallel.VocabParallelLoss is the one tensor parallelism passes in)."""

    # [B, S / tp, D] sequence-sharded hidden states -> [B, S, D] (its gradient reduce-scattered back)
    gather_sequence: Callable[[torch.Tensor], torch.Tensor]
    # (this rank's [N, V / tp] logits, [N] labels, num_tokens or None) -> the mean cross-entropy
    cross_entropy: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
    # (the whole sequence's [N, D] hidden states, this rank's vocabulary rows, labels, chunk_size, dtype, num_tokens)
    # -> `ChunkedCrossEntropy` of them
    chunked_cross_entropy: Callable[..., torch.Tensor]


_VOCAB_SHARD: contextvars.ContextVar[VocabShard | None] = contextvars.ContextVar("vocab_shard", default=None)


@contextlib.contextmanager
def vocab_parallel(shard: VocabShard) -> Iterator[None]:
    """Inside: the LM losses take the model's logits as `shard`'s part of the vocabulary."""
    token = _VOCAB_SHARD.set(shard)
    try:
        yield
    finally:
        _VOCAB_SHARD.reset(token)


def valid_tokens(labels: torch.Tensor) -> torch.Tensor:
    """How many labels count (are not `IGNORE_INDEX`), as a 0-d int64 tensor."""
    return (labels != IGNORE_INDEX).sum()


def cross_entropy_loss(
    logits: torch.Tensor, labels: torch.Tensor, num_tokens: torch.Tensor | None = None
) -> torch.Tensor:
    """Mean token cross-entropy in fp32; label `IGNORE_INDEX` (-100) marks tokens that do not count.

    With `num_tokens`, the sum over the valid tokens divided by it (see `NUM_TOKENS`); without it, torch's
    own mean, unchanged. Inside `vocab_parallel`, `logits` is this rank's vocabulary shard and the loss is the
    vocabulary-parallel one.
    """
    shard = _VOCAB_SHARD.get()
    if shard is not None:
        return shard.cross_entropy(logits.flatten(0, 1), labels.flatten(0, 1), num_tokens)
    logits, labels = logits.flatten(0, 1).float(), labels.flatten(0, 1)
    if num_tokens is None:
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / num_tokens


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward a causal LM on `batch["input"]` and score it against `batch["labels"]` (see `NUM_TOKENS`)."""
    return cross_entropy_loss(model(*model_inputs(batch)), batch["labels"], batch.get(NUM_TOKENS))


def model_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The model's positional arguments from a batch: the tokens, and the document ids when the batch has them."""
    return (batch["input"],) if DOCUMENT_IDS not in batch else (batch["input"], batch[DOCUMENT_IDS])


def chunk_logits(hidden: torch.Tensor, weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp32 logits of one chunk, with the projection computed in `dtype` (as autocast would)."""
    return F.linear(hidden.to(dtype), weight.to(dtype)).float()


def each_chunk(rows: int, chunk_size: int) -> Iterator[tuple[int, slice]]:
    """(index, row slice) of each chunk of `rows` rows, `chunk_size` at a time: the one chunk loop of every chunked
    loss. The caller tags its work on a chunk with `loss_chunk(index)` (inside its loop, so that an exception
    leaves no tag behind)."""
    for index, start in enumerate(range(0, rows, chunk_size)):
        yield index, slice(start, start + chunk_size)


def chunked_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    dtype: torch.dtype,
    chunk_size: int,
    grad_logits: Callable[[slice, torch.Tensor], torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d(loss)/d(hidden), d(loss)/d(weight)) of a chunked loss of `hidden @ weight.T`, one chunk at a time:
    `grad_logits(rows, hidden[rows])` gives d(loss)/d(that chunk's logits), recomputed from them (fp32)."""
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros_like(weight, dtype=torch.float32)
    w = weight.to(dtype)
    for index, rows in each_chunk(hidden.shape[0], chunk_size):
        with loss_chunk(index):
            h = hidden[rows]
            g = grad_logits(rows, h).to(dtype)  # its fp32 logits and gradient freed here: one chunk's at a time
            grad_hidden[rows] = (g @ w).to(hidden.dtype)
            grad_weight += (g.t() @ h.to(dtype)).float()
    return grad_hidden, grad_weight.to(weight.dtype)


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
        for index, rows in each_chunk(hidden.shape[0], chunk_size):
            with loss_chunk(index):
                logits = chunk_logits(hidden[rows], weight, dtype)
                total = total + F.cross_entropy(logits, labels[rows], ignore_index=IGNORE_INDEX, reduction="sum")
                del logits  # one chunk's logits alive at a time
        count = valid_tokens(labels) if num_tokens is None else num_tokens
        ctx.save_for_backward(hidden, weight, labels, count)
        ctx.chunk_size, ctx.dtype = chunk_size, dtype
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        hidden, weight, labels, count = ctx.saved_tensors
        scale = grad_loss / count

        def grad_logits(rows: slice, h: torch.Tensor) -> torch.Tensor:  # softmax minus one-hot, scaled
            y = labels[rows]
            grad = torch.softmax(chunk_logits(h, weight, ctx.dtype), dim=-1)
            valid = y != IGNORE_INDEX
            grad[torch.arange(y.shape[0], device=y.device), y.clamp(min=0)] -= 1.0
            return grad.mul_((valid.to(grad.dtype) * scale).unsqueeze(1))

        grad_hidden, grad_weight = chunked_backward(hidden, weight, ctx.dtype, ctx.chunk_size, grad_logits)
        return grad_hidden, grad_weight, None, None, None, None


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
    hidden = model.hidden_states(*model_inputs(batch))
    shard = _VOCAB_SHARD.get()
    if shard is not None:  # the hidden states are sequence-sharded; the projection needs every token
        hidden = shard.gather_sequence(hidden)
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    hidden, labels = hidden.flatten(0, 1), batch["labels"].flatten(0, 1)
    with torch.autocast(device_type, enabled=False):
        if shard is not None:
            return shard.chunked_cross_entropy(hidden, output.weight, labels, chunk_size, dtype, batch.get(NUM_TOKENS))
        return ChunkedCrossEntropy.apply(hidden, output.weight, labels, chunk_size, dtype, batch.get(NUM_TOKENS))


def build_lm_loss(chunk_size: int):
    """The LM loss for `training.loss_chunk_size`: `lm_loss` for 0, else `chunked_lm_loss` with that chunk size."""
    if chunk_size <= 0:
        return lm_loss
    return functools.partial(chunked_lm_loss, chunk_size=chunk_size)
