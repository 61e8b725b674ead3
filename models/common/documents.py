"""Packed documents that do not see each other: positions that restart at each document, and the attention mask.

A packed row holds several documents back to back. `document_ids` [B, S] (any integers) is equal on the tokens of
one document, and a document's tokens are contiguous in its row; a new document starts wherever the id changes.
Both helpers compute from that tensor with static shapes, so a traced step takes the boundaries as data and never
retraces when they move.
"""

from __future__ import annotations

import torch


def document_positions(document_ids: torch.Tensor) -> torch.Tensor:
    """Each token's position within its own document, [B, S] int64: 0 at every document's first token.

    The index of the latest document start at or before each token is a running maximum (`cummax`) over the
    indices where the id changes; the position is the distance to it.
    """
    index = torch.arange(document_ids.shape[1], device=document_ids.device).expand_as(document_ids)
    first = torch.ones_like(document_ids[:, :1], dtype=torch.bool)
    starts = torch.cat([first, document_ids[:, 1:] != document_ids[:, :-1]], dim=1)
    latest_start = torch.where(starts, index, 0).cummax(dim=1).values
    return index - latest_start


def document_mask(document_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The additive causal block-diagonal mask, [B, 1, S, S] of `dtype`: 0 where a query may attend, -inf elsewhere.

    One mask for every layer and head (broadcast over heads). Additive in the attention's dtype, not boolean,
    because SDPA turns a boolean mask into an additive one inside each call, a copy per layer that each layer's
    backward would keep. Every row keeps its diagonal, so no softmax row is empty.
    """
    seq_len = document_ids.shape[1]
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=document_ids.device).tril()
    allowed = (document_ids[:, :, None] == document_ids[:, None, :]) & causal
    blocked = torch.full((), float("-inf"), dtype=dtype, device=document_ids.device)
    return torch.where(allowed, torch.zeros((), dtype=dtype, device=document_ids.device), blocked).unsqueeze(1)


def attention_dtype(hidden: torch.Tensor) -> torch.dtype:
    """The dtype the attention's queries will have for `hidden`: autocast's when it is on, else `hidden`'s own.

    A mask of that dtype reaches SDPA uncast (autocast would otherwise copy it in every layer).
    """
    device = hidden.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else hidden.dtype
