"""What a packed batch holds: the input and label tokens of its rows, and with document masking their document ids.

Both loaders (`loader.PackedBatchLoader`, `hf_datasets.SequentialPackedLoader`) cut windows of seq_len + 1 tokens
and know, while they pack, where each document starts. With `data.document_masking` they pass that knowledge on as
`document_ids` [B, S] (int64, 0 for a row's first document, then 1, 2, ...: see models/common/documents.py), so the
model keeps the documents apart; a document cut by a row's end starts again at 0 in the next row. The ids are
tensor data of a fixed shape: a traced step never retraces when the boundaries move. A new source only has to say
where its documents start.
"""

from __future__ import annotations

import torch

# The batch key of the document ids; graph_trainer.loss.DOCUMENT_IDS reads it under the same name.
DOCUMENT_IDS = "document_ids"
# The label of a token that does not count in the loss: graph_trainer.loss.IGNORE_INDEX, torch's default.
IGNORE_LABEL = -100


def packed_batch(
    windows: torch.Tensor, window_document_ids: torch.Tensor | None = None, counted: torch.Tensor | None = None
) -> dict[str, torch.Tensor]:
    """`{"input", "labels"}` (LongTensor [B, S]) of windows [B, S + 1], plus `DOCUMENT_IDS` of the input tokens
    when `window_document_ids` ([B, S + 1], any integers that change exactly where a document starts) is given.
    With `counted` (bool [B, S + 1]: the token is one the model learns to say) the others' labels are
    `IGNORE_LABEL`."""
    tokens = windows.long()
    labels = tokens[:, 1:] if counted is None else torch.where(counted[:, 1:], tokens[:, 1:], IGNORE_LABEL)
    batch = {"input": tokens[:, :-1].contiguous(), "labels": labels.contiguous()}
    if window_document_ids is not None:
        ids = window_document_ids[:, :-1].long()
        batch[DOCUMENT_IDS] = (ids - ids[:, :1]).contiguous()  # each row's first document is 0
    return batch


def stream_document_ids(starts: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """The index of the document each stream offset lies in, given the sorted offsets where documents `starts`."""
    return torch.searchsorted(starts, offsets, right=True) - 1
