"""The depth-free plan extended in the local batch too (`block_plan.plan_batches`): every number equal to a full
trace at each batch, with the chunked loss's chunks extended as the blocks are."""

from __future__ import annotations

import pytest
import torch

from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.job_config.cli import load_config
from graph_trainer.plan.block_plan import SHORT, plan_batches, plan_modes, with_local_batch
from graph_trainer.plan.step_plan import StepPlan

EXACT = ("none", "selective", "full")
# Debug dimensions at 8 blocks with a chunked loss: 128 tokens a sequence in chunks of 32, so 8 chunks at batch 2,
# 12 at batch 3 (the grid) and 20 at batch 5.
CHUNKED = ["--config", "llama3_debug", "--training.seq_len", "128", "--model.n_layers", "8",
           "--training.loss_chunk_size", "32"]  # fmt: skip
GRID_BLOCKS = 2 * sum(SHORT)  # 3 + 4 blocks at each of the grid's two batches


def _numbers(plan: StepPlan) -> tuple:
    return (plan.peak_bytes, plan.peak_location, plan.peak_by_category, plan.saved_bytes, plan.flops,
            plan.comm_bytes, plan.num_params)  # fmt: skip


def _check(args: list[str], batches: list[int]) -> dict[int, dict[str, StepPlan]]:
    cfg, _ = load_config(args)
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
        fast = plan_batches(cfg, mesh, EXACT, batches)
        for batch in batches:
            full = plan_modes(with_local_batch(cfg, batch), mesh, EXACT, fast=False)
            for mode in EXACT:
                assert fast[batch][mode].blocks_traced == GRID_BLOCKS, (batch, mode)  # extended, not a fallback
                assert not fast[batch][mode].approximate
                assert _numbers(fast[batch][mode]) == _numbers(full[mode]), (batch, mode)
    return fast


def test_the_batch_extension_equals_full_traces_with_a_chunked_loss():
    fast = _check([*CHUNKED, "--model.n_layers", "5", "--compile.trace_optimizer", "true"], [2, 5])
    # Not a check that cannot fail: the peak moves with the batch, and with the mode.
    assert fast[5]["none"].peak_bytes > fast[2]["none"].peak_bytes > fast[2]["full"].peak_bytes


@pytest.mark.integration
def test_the_batch_extension_equals_full_traces_tp_2_dp_shard_2():
    """The vocabulary-parallel chunked loss (three all-reduces a chunk) and sequence parallelism, one rank of 4."""
    _check([*CHUNKED, "--parallelism.tp", "2", "--parallelism.dp_shard", "2"], [2, 5])


@pytest.mark.integration
def test_the_batch_extension_equals_full_traces_fsdp_prefetch_one_rank_of_8():
    _check([*CHUNKED, "--parallelism.dp_shard", "8", "--parallelism.fsdp_prefetch", "true"], [3, 4])


def test_batch_1_is_traced_on_its_own_or_extrapolated_and_marked_approximate():
    """Under tensor parallelism a [1, s, d] activation is contiguous where a [2, s, d] one needs a copy: batch 1's
    graphs have other ops, so it is not extended from the grid unless asked (the search's screen)."""
    cfg, _ = load_config(CHUNKED)
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
        exact = plan_batches(cfg, mesh, ["none"], [1, 4, 5])
        screen = plan_batches(cfg, mesh, ["none"], [1, 4, 5], extrapolate=True)
    assert exact[1]["none"].blocks_traced == sum(SHORT) and not exact[1]["none"].approximate
    assert exact[4]["none"].blocks_traced == GRID_BLOCKS and not exact[4]["none"].approximate
    assert screen[1]["none"].blocks_traced == GRID_BLOCKS and screen[1]["none"].approximate
    assert _numbers(screen[4]["none"]) == _numbers(exact[4]["none"])
