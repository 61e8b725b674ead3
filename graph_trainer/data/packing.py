"""The one packed loader, and what its batches hold: the input and label tokens of their rows, and with document
masking their document ids.

Every source reaches training through `PackedLoader`. A source gives documents; each document's ids are followed by
EOS (`document_ids_with_eos`; instruction rows are packed whole instead, by graph_trainer.data.chat) and cut into
windows of seq_len + 1 tokens by the source's `WindowOrder`, which also
says which windows make each step's global batch and where a resume continues. Two orders exist: the in-memory
sources' shuffled windows (`loader.ShuffledWindows`: embedded, text, jsonl, chat and synthetic data) and the lanes of
data read with Hugging Face datasets (`hf_datasets.DatasetLanes`, which never holds a stream whole). A new source of
documents adds only a source; a new order implements `WindowOrder`.

The orders know, while they pack, where each document starts. With `data.document_masking` they pass that knowledge
on as `document_ids` [B, S] (int64, 0 for a row's first document, then 1, 2, ...: see models/common/documents.py), so
the model keeps the documents apart; a document cut by a row's end starts again at 0 in the next row. The ids are
tensor data of a fixed shape: a traced step never retraces when the boundaries move. A new source only has to say
where its documents start.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch

from graph_trainer.data.tokenizer import Tokenizer
from graph_trainer.errors import UserError

# The batch key of the document ids; graph_trainer.loss.DOCUMENT_IDS reads it under the same name.
DOCUMENT_IDS = "document_ids"
# The label of a token that does not count in the loss: graph_trainer.loss.IGNORE_INDEX, torch's default.
IGNORE_LABEL = -100
# The key of `PackedLoader.state_dict()` that names the order which wrote the position.
ORDER_KEY = "order"


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


def document_ids_with_eos(text: str, tokenizer: Tokenizer) -> torch.Tensor:
    """A document's int32 ids followed by EOS (when the tokenizer has one); empty for a document with no token, so
    no EOS follows another."""
    ids = tokenizer.encode_to_tensor(text)
    if ids.numel() and tokenizer.eos_id is not None:
        ids = torch.cat([ids, torch.tensor([tokenizer.eos_id], dtype=torch.int32)])
    return ids


# ---------------------------------------------------------------- the one loader


class Windows(NamedTuple):
    """A data rank's rows of one global batch, before they become a batch (`packed_batch`)."""

    tokens: torch.Tensor  # [B, S + 1]
    document_ids: torch.Tensor | None  # [B, S + 1], any integers that change where a document starts; None: not asked
    counted: torch.Tensor | None  # bool [B, S + 1]: the tokens the model learns to say; None: all of them


class WindowOrder(Protocol):
    """The order in which a source's packed windows reach the global batch, and the position in it.

    The order is a function of the data, the seed and the global batch alone: a data rank's rows of step t are
    the same tokens whatever the number of data ranks, so a resume on another layout continues the same run.
    """

    name: str  # what the order reads, e.g. "in-memory windows": written with the position, checked on resume

    def next_windows(self) -> Windows:
        """This data rank's rows of the next global batch."""
        ...

    def position(self) -> dict[str, Any]:
        """Where the next global batch starts: the same on every data rank (a collective when it gathers)."""
        ...

    def seek(self, position: dict[str, Any] | None) -> None:
        """Make the next global batch the one at `position` (None: the first one).

        Raises:
            UserError: a position that does not fit this data.
        """
        ...


class PackedLoader:
    """Endless iterator of `{"input": LongTensor[B, S], "labels": LongTensor[B, S]}` on CPU (plus `DOCUMENT_IDS` when
    the order gives document ids), each one data rank's rows of a global batch, in `order`'s order; resumable.

    Every source goes through it: a source provides documents, its order packs them into windows and says which
    windows each step takes. `state_dict()` / `load_state_dict()` resume exactly, on any data-parallel degree that
    keeps the global batch; `rewind()` starts again from the first batch (validation reads the same batches).
    """

    def __init__(self, order: WindowOrder) -> None:
        self.order = order

    def __iter__(self) -> PackedLoader:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return packed_batch(*self.order.next_windows())

    def state_dict(self) -> dict[str, Any]:
        """The position of the next global batch, tagged with the order that wrote it."""
        return {ORDER_KEY: self.order.name, **self.order.position()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a `state_dict()` of the same data and global batch.

        Raises:
            UserError: a position written by another order (another kind of data.source) or that does not fit.
        """
        if not isinstance(state, dict):
            raise UserError("the checkpoint's data position is not a mapping; resume from an intact checkpoint")
        written_by = state.get(ORDER_KEY, self.order.name)  # checkpoints from before the tag: the order checks
        if written_by != self.order.name:
            raise UserError(
                f"the checkpoint's data position was written for {written_by}, but this job reads "
                f"{self.order.name}; resume with the data.source it was saved with"
            )
        self.order.seek({k: v for k, v in state.items() if k != ORDER_KEY})

    def rewind(self) -> None:
        """Back to the first global batch."""
        self.order.seek(None)
