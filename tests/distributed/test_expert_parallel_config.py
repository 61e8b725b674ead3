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
