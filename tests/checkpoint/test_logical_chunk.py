"""Where each rank's part of a parameter sits in its logical tensor under tp x dp_shard, as checkpoints save it.

No process group: for every mesh coordinate the weight is cut as TP cuts it (`tp._split_weight`) and its block
sharded as FSDP shards it (`fully_shard_model`), and `ParallelModel.local_slices` composes the two answers.
Claims: the ranks' chunks tile the logical tensor exactly once and hold its values (vocabulary padding and
FSDP's padding left out), for the split along rows (column-parallel, vocabulary) and columns (row-parallel);
DTensor's `_StridedShard` (FSDP2 on top of TP) gives other offsets when tp pads the rows, the same otherwise.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Shard, _StridedShard

from graph_trainer.checkpoint.logical_chunk import logical_chunk
from graph_trainer.distributed.fsdp import ShardGroup, fully_shard_model
from graph_trainer.distributed.parallelism import ParallelModel
from graph_trainer.distributed.tp import SplitParam, TensorParallel, _split_weight

WIDTH = 6


def _rank_part(full: torch.Tensor, dim: int, tp: int, dp: int, i: int, j: int) -> tuple[torch.Tensor, tuple]:
    """Rank (dp_shard i, tp j)'s part of `full` (split along `dim` by TP, its block's rows by FSDP), and the
    chunk of `full` that `ParallelModel.local_slices` says it holds."""
    weight = nn.Module()
    weight.weight = nn.Parameter(full.clone())
    parts = [TensorParallel(None, ShardGroup(j, tp, "tp"), [SplitParam("weight", full.shape, dim)], None, None)]
    holder = nn.Module()
    holder.weight = _split_weight(weight, dim, ShardGroup(j, tp, "tp"))
    parts.append(fully_shard_model(holder, ShardGroup(i, dp, "dp_shard")))
    return holder.weight, ParallelModel(holder, None, parts).local_slices("weight", holder.weight)


@pytest.mark.parametrize("rows", [256, 258, 259])
@pytest.mark.parametrize(("tp", "dp"), [(2, 2), (4, 2), (2, 4), (4, 4)])
@pytest.mark.parametrize("dim", [0, 1])
def test_the_ranks_chunks_tile_the_logical_tensor_and_hold_its_values(rows, tp, dp, dim):
    full = torch.arange(rows * WIDTH, dtype=torch.float32).view(rows, WIDTH)
    full = full if dim == 0 else full.T.contiguous()  # split along the columns: row-parallel
    covered = torch.zeros(full.shape, dtype=torch.int64)
    for i in range(dp):
        for j in range(tp):
            local, box = _rank_part(full, dim, tp, dp, i, j)
            chunk = logical_chunk(local, box, full.shape)
            part = chunk.__get_tensor_shard__(None)
            assert torch.equal(part, full[box]), (i, j, box)
            (offsets,) = [c.offsets for c in chunk.__create_chunk_list__()]
            assert all(
                o == s.start or (s.start == s.stop and o == n) for o, s, n in zip(offsets, box, full.shape, strict=True)
            )
            covered[box] += 1
    assert bool((covered == 1).all())


def test_strided_shard_disagrees_where_tp_pads_the_rows():
    """Vocabulary 258 at tp 4 x dp_shard 2: TP blocks of 65 rows, the last holding 63; FSDP's halves of it hold
    33 and 30 real rows at offsets 195 and 228, where FSDP2's placements say 32 and 31 at 195 and 227. At 256
    rows (tp divides them) every rank agrees."""
    placements = [_StridedShard(0, split_factor=4), Shard(0)]
    for rows, agree in ((258, False), (256, True)):
        full = torch.zeros(rows, WIDTH)
        same = []
        for i in range(2):
            for j in range(4):
                _, box = _rank_part(full, 0, 4, 2, i, j)
                size, offset = _compute_local_shape_and_global_offset((rows, WIDTH), (2, 4), [i, j], placements)
                same.append((size[0], offset[0]) == (box[0].stop - box[0].start, box[0].start))
        assert all(same) == agree, rows
    _, box = _rank_part(torch.zeros(258, WIDTH), 0, 4, 2, 1, 3)
    assert (box[0].start, box[0].stop) == (228, 258) and math.ceil(258 / 4) == 65
