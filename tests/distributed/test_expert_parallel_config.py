"""Expert parallelism's configuration and dispatch layout, without running ranks (fast)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from graph_trainer.distributed.expert_parallel import ExpertParallel, capacity, plan_slots
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import JobConfig, ParallelismConfig
from models.common.spec import ParallelPlan


def test_ep_must_divide_dp_shard():
    with pytest.raises(UserError, match="ep = 3 does not divide parallelism.dp_shard = 4"):
        ParallelDims.from_config(ParallelismConfig(dp_shard=4, ep=3))
    dims = ParallelDims.from_config(ParallelismConfig(dp_shard=4, ep=2))
    assert dims.world_size == 4 and dims.describe() == "dp_shard 4 (ep 2)"  # ep is carved out, not multiplied


def test_mesh_carves_ep_out_of_dp_shard():
    with planning_mesh(ParallelDims(dp_shard=8, ep=4), torch.device("cpu")) as mesh:
        assert (mesh.size("dp_shard"), mesh.size("ep"), mesh.size("dp_shard_mod_ep")) == (8, 4, 2)
        assert mesh.group("dp_shard").size() == 8 and mesh.group("ep").size() == 4


def test_ep_on_a_model_without_routed_experts_is_refused():
    with planning_mesh(ParallelDims(dp_shard=2, ep=2), torch.device("cpu")) as mesh:
        with pytest.raises(UserError, match="no routed experts; use --parallelism.ep 1"):
            ExpertParallel.apply(nn.Linear(4, 4), mesh, JobConfig(), ParallelPlan())


def test_dispatch_slots_keep_each_destinations_first_rows_up_to_capacity():
    # 4 experts on 2 ranks (2 each); 8 rows sorted by expert: expert 0 x3, expert 1 x2, expert 2 x0, expert 3 x3
    offsets = torch.tensor([3, 5, 5, 8], dtype=torch.int32)
    cap = capacity(8, 2, 0.75)  # ceil(0.75 * 8 / 2) = 3 rows per destination
    slots = plan_slots(offsets, 8, 2, cap)
    assert cap == 3
    # rank 0 is sent rows 0-4 (5 rows): 3 fit, rows 3 and 4 are dropped; rank 1 is sent rows 5-7: all fit
    assert slots.kept.tolist() == [True, True, True, False, False, True, True, True]
    assert slots.row_of_slot.tolist() == [0, 1, 2, 5, 6, 7]
    assert slots.slot_valid.all() and slots.local_expert.tolist() == [0, 0, 0, 1, 1, 1]
    assert slots.slot_of_row[slots.kept].tolist() == [0, 1, 2, 3, 4, 5]
    assert capacity(8, 2, 2.0) == 8  # a factor of ep fits every row


def test_dispatch_slots_deal_blocks_of_experts_to_the_ranks_in_turn():
    # ep 2 inside dp_shard 4, 8 experts: each dp_shard rank holds a block of 2, so ep rank 0 runs experts 0, 1, 4, 5
    # (local 0-3) and ep rank 1 runs 2, 3, 6, 7. Rows per expert: 1, 0, 2, 1, 1, 1, 0, 2 (8 rows, sorted by expert).
    offsets = torch.tensor([1, 1, 3, 4, 5, 6, 6, 8], dtype=torch.int32)
    slots = plan_slots(offsets, 8, 2, capacity(8, 2, 2.0), block=2)
    assert slots.kept.all()
    valid = slots.slot_valid.view(2, 8)
    assert valid.sum(1).tolist() == [3, 5]
    rows, local = slots.row_of_slot.view(2, 8), slots.local_expert.view(2, 8)
    assert rows[0, :3].tolist() == [0, 4, 5] and local[0, :3].tolist() == [0, 2, 3]  # experts 0, 4, 5
    assert rows[1, :5].tolist() == [1, 2, 3, 6, 7] and local[1, :5].tolist() == [0, 0, 1, 3, 3]  # experts 2, 3, 7
    assert slots.slot_of_row.tolist() == [0, 8, 9, 10, 1, 2, 11, 12]
    # one block per rank (ep = dp_shard) is the contiguous layout
    contiguous = plan_slots(offsets, 8, 2, 8)
    assert plan_slots(offsets, 8, 2, 8, block=4).row_of_slot.tolist() == contiguous.row_of_slot.tolist()


def test_ep_below_dp_shard_needs_dp_shard_to_divide_the_experts():
    class Experts(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1 = nn.Parameter(torch.zeros(6, 8, 8))

    model = nn.Module()
    model.experts = Experts()
    with planning_mesh(ParallelDims(dp_shard=4, ep=2), torch.device("cpu")) as mesh:
        with pytest.raises(UserError, match="dp_shard = 4 does not divide the 6 routed experts"):
            ExpertParallel.apply(model, mesh, JobConfig(), ParallelPlan(routed_experts="experts"))
