"""The vocabulary-parallel cross-entropy: the loss of logits split by vocabulary over the tensor-parallel ranks.

Under tensor parallelism the output projection is split by vocabulary and no rank ever holds whole logits
(graph_trainer.distributed.tp). Both losses, the plain one and the chunked one (graph_trainer.loss), then compute
the cross-entropy here: the forward needs three all-reduces of one number per token (the max logit, the sum of
exponentials, the target's logit), never one over the vocabulary; the backward needs none (softmax minus one-hot
is local to each vocabulary shard). The vocabulary is padded to a multiple of tp, and the padding logits never
count and get zero gradient.

`VocabParallelLoss` is what `graph_trainer.loss.vocab_parallel` takes: tensor parallelism's vocabulary split
(`tp.VocabSplit`) is one, with the tp group's collectives. The chunked loss walks the chunks with the plain one's
loop (`loss.each_chunk`, `loss.chunked_backward`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from graph_trainer.loss import IGNORE_INDEX, chunk_logits, chunked_backward, each_chunk, loss_chunk, valid_tokens


class VocabParallelLoss:
    """This rank's part of a vocabulary-parallel output projection, and the losses of its logits.

    Its logits are the columns `start .. start + valid - 1` of the whole vocabulary, followed by padding columns
    (the vocabulary is padded to a multiple of the tensor-parallel degree); padded logits are masked. A subclass
    gives `start`, `valid`, `all_reduce` and `gather_sequence`.
    """

    start: int  # the vocabulary id of this rank's first logit
    valid: int  # how many of this rank's logits are real ids; the rest are padding

    def all_reduce(self, t: torch.Tensor, op: str) -> torch.Tensor:
        """`t` reduced ('max' or 'sum') over the ranks that hold the other vocabulary shards."""
        raise NotImplementedError

    def gather_sequence(self, hidden: torch.Tensor) -> torch.Tensor:
        """[B, S / tp, D] sequence-sharded hidden states -> [B, S, D] (its gradient reduce-scattered back)."""
        raise NotImplementedError

    def cross_entropy(
        self, logits: torch.Tensor, labels: torch.Tensor, num_tokens: torch.Tensor | None
    ) -> torch.Tensor:
        """Mean cross-entropy of this rank's [N, V / tp] logits against the [N] labels (see `loss.NUM_TOKENS`)."""
        return VocabParallelCrossEntropy.apply(logits, labels, self, num_tokens)

    def chunked_cross_entropy(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        chunk_size: int,
        dtype: torch.dtype,
        num_tokens: torch.Tensor | None,
    ) -> torch.Tensor:
        """`loss.ChunkedCrossEntropy` of the whole sequence's [N, D] `hidden` against this rank's vocabulary rows."""
        return VocabParallelChunkedCrossEntropy.apply(hidden, weight, labels, chunk_size, dtype, self, num_tokens)


def _token_count(labels: torch.Tensor, num_tokens: torch.Tensor | None) -> torch.Tensor:
    """The divisor of the summed token losses: `num_tokens` when given (see `NUM_TOKENS`), else this batch's valid
    labels. The tp ranks read the same batch, so either is the same on each of them and needs no reduction."""
    return valid_tokens(labels).float() if num_tokens is None else num_tokens


def _shard_statistics(
    x: torch.Tensor, labels: torch.Tensor, shard: VocabParallelLoss
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
        ctx: Any,
        logits: torch.Tensor,
        labels: torch.Tensor,
        shard: VocabParallelLoss,
        num_tokens: torch.Tensor | None = None,
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
        shard: VocabParallelLoss,
        num_tokens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        total = hidden.new_zeros((), dtype=torch.float32)
        stats: list[list[torch.Tensor]] = [[], [], []]  # per chunk: max, log-sum-exp, target column
        for index, rows in each_chunk(hidden.shape[0], chunk_size):
            with loss_chunk(index):
                x = chunk_logits(hidden[rows], weight[: shard.valid], dtype)
                y = labels[rows]
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

        def grad_logits(rows: slice, h: torch.Tensor) -> torch.Tensor:
            x = chunk_logits(h, weight[: ctx.valid], ctx.dtype)
            return _grad_shard_logits(x, top[rows], log_sum[rows], column[rows], labels[rows], scale, weight.shape[0])

        grad_hidden, grad_weight = chunked_backward(hidden, weight, ctx.dtype, ctx.chunk_size, grad_logits)
        return grad_hidden, grad_weight, None, None, None, None, None


__all__ = ["VocabParallelChunkedCrossEntropy", "VocabParallelCrossEntropy", "VocabParallelLoss"]
