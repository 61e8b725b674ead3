"""This rank's part of a parameter (or of an AdamW moment shaped like it) as DCP sees it: one chunk, at its offsets,
of a tensor of the parameter's logical (whole, unpadded) shape.

DCP stores every tensor as chunks `(offsets, sizes)` of its logical shape, whatever wrote them, and cuts them
for whatever layout reads them; a tensor subclass joins in through DCP's checkpointable protocol
(`__create_write_items__`, `__create_chunk_list__`, `__get_tensor_shard__`, as `DTensor` does). A DTensor would
describe our parts by placements; but FSDP's row block of TP's block of a vocabulary padded for tp (the
embedding at vocabulary 258 and tp 4: TP blocks of 65 rows, the last holding 63) is a chunk that no placement
states (DTensor's `_StridedShard` assumes torch.chunk blocks of the unpadded rows, and disagrees with our
offsets whenever tp does not divide the rows). The parallelisms say where each part sits instead
(`ParallelModel.local_slices`), and this class hands that chunk to DCP as it is: the file holds the same
logical tensors as with DTensors, readable by any layout and by `graph_trainer.export`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class LogicalChunk(torch.Tensor):
    """`local` (plain, real rows only) at `offsets` in a tensor of shape `size`, for DCP's save and load.

    A wrapper without storage of its own: DCP writes `local` and, on load, reads into it (a view of the live
    shard, so the shard is filled in place). No other operation is defined on it.
    """

    _local: torch.Tensor
    _chunk: ChunkStorageMetadata

    @staticmethod
    def __new__(cls, local: torch.Tensor, offsets: Sequence[int], size: Sequence[int]) -> LogicalChunk:
        chunk = torch.Tensor._make_wrapper_subclass(cls, torch.Size(size), dtype=local.dtype, device=local.device)
        chunk._local = local
        chunk._chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=local.size())
        return chunk

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        raise TypeError(f"{func} on a LogicalChunk: it only carries a rank's chunk to DCP (read its local tensor)")

    def __repr__(self) -> str:  # the default would compute on a tensor that has no storage
        chunk = self._chunk
        return f"LogicalChunk(size={list(self.shape)}, offsets={list(chunk.offsets)}, sizes={list(chunk.sizes)})"

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, self._chunk.offsets),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk, properties=TensorProperties.create_from_tensor(self._local), size=self.shape
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self._local


def logical_chunk(local: torch.Tensor, box: Sequence[slice], size: Sequence[int]) -> LogicalChunk:
    """The chunk `box` (one slice per dimension, in the logical tensor of shape `size`) held by `local`, whose
    real entries come first along every dimension (the padding after them is left out).

    An empty chunk is placed at the end of its empty dimension, as DTensor places one, so that it overlaps no
    other rank's chunk in DCP's check of the global plan."""
    lengths = [s.stop - s.start for s in box]
    part = local.detach()[tuple(slice(0, n) for n in lengths)]
    offsets = [s.start if n else full for s, n, full in zip(box, lengths, size, strict=True)]
    return LogicalChunk(part, offsets, size)


__all__ = ["LogicalChunk", "logical_chunk"]
