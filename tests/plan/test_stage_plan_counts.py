"""A stage plan at many micro-batches, made from three small counts (`plan.stage_plan.plan_positions`), equals the
plan at that count to the byte: past its warm-up a schedule repeats, each micro-batch adding its receive buffer
and its slice of the batch to a position's peak."""

from __future__ import annotations

import pytest
import torch

from graph_trainer.distributed.pipeline import short_counts
from graph_trainer.job_config.cli import load_config
from graph_trainer.plan.stage_plan import plan_pipeline, plan_positions

EIGHT = ["--config", "llama3_debug", "--model.n_layers", "8", "--training.seq_len", "64"]  # stages of 4 (or 2) blocks


# Interleaved1F1B (52 s) is the largest case of the same extension; CI runs the other two.
INTERLEAVED_IS_SLOW = pytest.mark.slow(
    held_by="tests/plan/test_stage_plan_counts.py::test_a_stage_plan_from_three_short_counts_equals_the_plan_at_the_jobs_count"
)


@pytest.mark.integration
@pytest.mark.parametrize(
    ("schedule", "count"),
    [("1F1B", 9), ("GPipe", 8), pytest.param("Interleaved1F1B", 12, marks=INTERLEAVED_IS_SLOW)],
)
def test_a_stage_plan_from_three_short_counts_equals_the_plan_at_the_jobs_count(schedule, count):
    args = [*EIGHT, "--parallelism.pp", "2", "--parallelism.pp_schedule", schedule]
    cfg, _ = load_config([*args, "--training.local_batch_size", str(count)])
    whole = list(plan_pipeline(cfg, torch.device("cpu")))
    said: list[str] = []
    extended = plan_positions(cfg, torch.device("cpu"), said.append)
    _, counts = short_counts(cfg)
    assert counts and counts[-1] < count and not said  # extended, not planned whole
    assert [p.peak_bytes for p in extended] == [p.peak_bytes for p in whole]
    assert [p.held_bytes for p in extended] == [p.held_bytes for p in whole]
    assert [(p.in_flight, p.stages, p.blocks) for p in extended] == [(p.in_flight, p.stages, p.blocks) for p in whole]
