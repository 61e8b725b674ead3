"""The language-model loss, shared by the eager and the traced step.

`lm_loss` projects every token to the vocabulary at once. `chunked_lm_loss` does the
output projection and the cross-entropy a chunk of tokens at a time and recomputes
each chunk's logits in the backward, so no [tokens, vocab] tensor is ever whole: on
Llama-3 8B (vocab 128,256, 8,192 tokens) each fp32 logits-sized tensor is 3.9 GiB.

Under tensor parallelism the output projection is split by vocabulary and no rank ever holds whole logits:
inside `vocab_parallel(shard)` both losses compute the vocabulary-parallel cross-entropy
(`VocabParallelCrossEntropy`, `VocabParallelChunkedCrossEntropy`). Their forward needs three all-reduces of
one number per token (the max logit, the sum of exponentials, the target's logit), never one over the
vocabulary; their backward needs none (softmax minus one-hot is local to each vocabulary shard). The
collectives themselves come from the `VocabShard` the parallelism passes in, so this module stays free of
any process group.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from typing import Any, Protocol

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.fx import traceback as fx_traceback

from graph_trainer.errors import UserError

# The node-metadata key (in `node.meta["custom"]`) a traced chunked loss writes on each chunk's ops: the chunk's
# index. The chunks are identical, so a plan may trace a few and extend to any number (graph_trainer.plan).
LOSS_CHUNK = "loss_chunk"


def _chunk(index: int) -> contextlib.AbstractContextManager:
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
    """This rank's part of a vocabulary-parallel output projection (see the module docstring).

    Its logits are the columns `start .. start + valid - 1` of the whole vocabulary, followed by padding
    columns (the vocabulary is padded to a multiple of the tensor-parallel degree); padded logits are masked.
    """

    start: int  # the vocabulary id of this rank's first logit
    valid: int  # how many of this rank's logits are real ids; the rest are padding

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """`t` reduced ('max' or 'sum') over the ranks that hold the other vocabulary shards."""
        ...

    def gather_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, S / tp, D] sequence-sharded hidden states -> [B, S, D] (its gradient reduce-scattered back)."""
        ...


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
        return VocabParallelCrossEntropy.apply(logits.flatten(0, 1), labels.flatten(0, 1), shard, num_tokens)
    logits, labels = logits.flatten(0, 1).float(), labels.flatten(0, 1)
    if num_tokens is None:
        return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum") / num_tokens


def _token_count(labels: torch.Tensor, num_tokens: torch.Tensor | None) -> torch.Tensor:
    """The divisor of the summed token losses: `num_tokens` when given (see `NUM_TOKENS`), else this batch's valid
    labels. The tp ranks read the same batch, so either is the same on each of them and needs no reduction."""
    return valid_tokens(labels).float() if num_tokens is None else num_tokens


def _shard_statistics(
    x: torch.Tensor, labels: torch.Tensor, shard: VocabShard
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per token of `x` (fp32 [N, shard.valid], this rank's real logits): the max logit and the log of the sum
    of exponentials over the whole vocabulary, the target's log-probability, and the target's column here
    (-1 where another rank holds it).

    Three all-reduces of N numbers: max (for a stable exp), sum of exponentials, target log-probability (0 on
    the ranks that do not hold the target). The arithmetic is log-softmax's, (x - max) - log(sum), in the
    order torch's `loss_parallel` and `F.cross_entropy` use, so the three agree to the last bits."""
    top = shard.all_reduce(x.amax(dim=-1), "max")
    shifted = x - top.unsqueeze(1)
    log_sum = torch.log(shard.all_reduce(torch.exp(shifted).sum(dim=-1), "sum"))
    local = labels - shard.start
    here = (local >= 0) & (local < x.shape[1])
    column = torch.where(here, local, -1)
    picked = shifted.gather(1, column.clamp(min=0).unsqueeze(1)).squeeze(1) - log_sum
    target = shard.all_reduce(torch.where(here, picked, 0.0), "sum")
    return top, log_sum, target, column


def _token_sum(target: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the counted tokens' cross-entropies (minus their targets' log-probabilities)."""
    return torch.where(labels != IGNORE_INDEX, -target, 0.0).sum()


def _grad_shard_logits(
    x: torch.Tensor,
    top: torch.Tensor,
    log_sum: torch.Tensor,
    column: torch.Tensor,
    labels: torch.Tensor,
    scale: torch.Tensor,
    width: int,
) -> torch.Tensor:
    """d(loss)/d(this rank's logits), [N, width] fp32: softmax minus one-hot, times `scale` on counted tokens;
    zero on the padding columns past `x`'s."""
    grad = torch.exp((x - top.unsqueeze(1)) - log_sum.unsqueeze(1))
    rows = torch.arange(x.shape[0], device=x.device)
    grad[rows, column.clamp(min=0)] -= (column >= 0).to(grad.dtype)
    grad.mul_(torch.where(labels != IGNORE_INDEX, scale, 0.0).unsqueeze(1))
    return F.pad(grad, (0, width - x.shape[1])) if width > x.shape[1] else grad


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy of logits split by vocabulary over the tensor-parallel ranks (this rank's [N, V / tp]).

    The counterpart of torch's `loss_parallel`: forward reduces three per-token numbers over the ranks
    (`_shard_statistics`); backward is local. The padding columns never count and get zero gradient. With
    `num_tokens` the sum over the valid tokens is divided by it instead of their number (see `NUM_TOKENS`).
    """

    @staticmethod
    def forward(
        ctx: Any, logits: torch.Tensor, labels: torch.Tensor, shard: VocabShard, num_tokens: torch.Tensor | None = None
    ) -> torch.Tensor:
        x = logits[:, : shard.valid].float()
        top, log_sum, target, column = _shard_statistics(x, labels, shard)
        count = _token_count(labels, num_tokens)
        ctx.save_for_backward(logits, labels, top, log_sum, column, count)
        ctx.valid = shard.valid
        return _token_sum(target, labels) / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        logits, labels, top, log_sum, column, count = ctx.saved_tensors
        x = logits[:, : ctx.valid].float()
        grad = _grad_shard_logits(x, top, log_sum, column, labels, grad_loss / count, logits.shape[1])
        return grad.to(logits.dtype), None, None, None


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward a causal LM on `batch["input"]` and score it against `batch["labels"]` (see `NUM_TOKENS`)."""
    return cross_entropy_loss(model(*model_inputs(batch)), batch["labels"], batch.get(NUM_TOKENS))


def model_inputs(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The model's positional arguments from a batch: the tokens, and the document ids when the batch has them."""
    return (batch["input"],) if DOCUMENT_IDS not in batch else (batch["input"], batch[DOCUMENT_IDS])


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
        for index, start in enumerate(range(0, hidden.shape[0], chunk_size)):
            with _chunk(index):
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
        for index, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            with _chunk(index):
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


class VocabParallelChunkedCrossEntropy(torch.autograd.Function):
    """`ChunkedCrossEntropy` with the output projection split by vocabulary (`weight` is this rank's rows).

    `hidden` is the whole sequence's; each chunk's logits are this rank's vocabulary shard, reduced as
    `VocabParallelCrossEntropy` reduces them (three all-reduces per chunk). The per-token log-sum-exp is kept
    for the backward, which is local: it recomputes each chunk's logits and returns this rank's partial
    d(loss)/d(hidden) (the sequence gather's backward sums the partials over the ranks) and its rows' gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        dtype: torch.dtype,
        shard: VocabShard,
        num_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total = hidden.new_zeros((), dtype=torch.float32)
        stats: list[list[torch.Tensor]] = [[], [], []]  # per chunk: max, log-sum-exp, target column
        for index, start in enumerate(range(0, hidden.shape[0], chunk_size)):
            with _chunk(index):
                x = _chunk_logits(hidden[start : start + chunk_size], weight[: shard.valid], dtype)
                y = labels[start : start + chunk_size]
                top, log_sum, target, column = _shard_statistics(x, y, shard)
                total = total + _token_sum(target, y)
                for kept, t in zip(stats, (top, log_sum, column), strict=True):
                    kept.append(t)
                del x  # one chunk's logits alive at a time
        count = _token_count(labels, num_tokens)
        ctx.save_for_backward(hidden, weight, labels, count, *(torch.cat(kept) for kept in stats))
        ctx.chunk_size, ctx.dtype, ctx.valid = chunk_size, dtype, shard.valid
        return total / count

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor):
        hidden, weight, labels, count, top, log_sum, column = ctx.saved_tensors
        scale = grad_loss / count
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=torch.float32)
        w = weight.to(ctx.dtype)
        for index, start in enumerate(range(0, hidden.shape[0], ctx.chunk_size)):
            with _chunk(index):
                rows = slice(start, start + ctx.chunk_size)
                h = hidden[rows]
                x = _chunk_logits(h, weight[: ctx.valid], ctx.dtype)
                g = _grad_shard_logits(x, top[rows], log_sum[rows], column[rows], labels[rows], scale, weight.shape[0])
                g = g.to(ctx.dtype)
                del x
                grad_hidden[rows] = (g @ w).to(hidden.dtype)
                grad_weight += (g.t() @ h.to(ctx.dtype)).float()
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


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
            return VocabParallelChunkedCrossEntropy.apply(
                hidden, output.weight, labels, chunk_size, dtype, shard, batch.get(NUM_TOKENS)
            )
        return ChunkedCrossEntropy.apply(hidden, output.weight, labels, chunk_size, dtype, batch.get(NUM_TOKENS))


def build_lm_loss(chunk_size: int):
    """The LM loss for `training.loss_chunk_size`: `lm_loss` for 0, else `chunked_lm_loss` with that chunk size."""
    if chunk_size <= 0:
        return lm_loss
    return functools.partial(chunked_lm_loss, chunk_size=chunk_size)
