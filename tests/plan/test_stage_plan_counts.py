"""A stage plan made from smaller runs equals the plan of the job itself to the byte (`plan.stage_plan`):
- at many micro-batches, from three small counts (past its warm-up a schedule repeats, each micro-batch adding its
  receive buffer and its slice of the batch to a position's peak);
- at depth, from three shallower depths (`short_depths`: each block of a stage adds its parameters, gradients,
  AdamW state and saved activations), as the plan without pp is depth-free; both together for a deep model at many
  micro-batches."""

from __future__ import annotations

import functools

import pytest
import torch

from graph_trainer.distributed.pipeline import short_counts, stage_blocks
from graph_trainer.job_config.cli import load_config
from graph_trainer.plan.stage_plan import (
    SHORT_STAGE,
    UPDATE,
    StagePlan,
    plan_pipeline,
    plan_positions,
    short_depths,
)
from tests.tiny import tiny_model

SEQ = ["--training.seq_len", "64"]
BATCH_4 = ["--training.local_batch_size", "4"]  # 4 micro-batches at pp 2: planned at that count (`short_counts`)
EIGHT = ["--config", "llama3_debug", "--model.n_layers", "8", *SEQ]  # stages of 4 (or 2) blocks


def _fields(plan: StagePlan) -> tuple:
    """Everything a plan says but the seconds it took and how it was made."""
    return (plan.rank, plan.stages, plan.blocks, plan.peak_bytes, plan.peak_in_update, plan.at, plan.in_flight,
            plan.most_in_flight, plan.held_bytes, plan.state_bytes)  # fmt: skip


def _extended_equals_whole(args: list[str]) -> list[StagePlan]:
    cfg, _ = load_config(args)
    whole = list(plan_pipeline(cfg, torch.device("cpu")))
    said: list[str] = []
    extended = plan_positions(cfg, torch.device("cpu"), said.append)
    assert not said  # extended, not planned whole
    assert [_fields(p) for p in extended] == [_fields(p) for p in whole]
    return extended


def _slow(held_by: str) -> pytest.MarkDecorator:
    return pytest.mark.slow(held_by=f"tests/plan/test_stage_plan_counts.py::{held_by}")


COUNTS_TEST = "test_a_stage_plan_from_three_short_counts_equals_the_plan_at_the_jobs_count"
DEPTHS_TEST = "test_a_deep_stage_plan_from_three_shallow_depths_equals_the_plan_of_the_whole_depth"


@pytest.mark.integration
@pytest.mark.parametrize(
    ("schedule", "count"),
    # GPipe grows most with the count (its activations and its micro-batches in flight too); the other two are the
    # same extension (38 s and 52 s), in the slow tier.
    [
        ("GPipe", 8),
        pytest.param("1F1B", 9, marks=_slow(COUNTS_TEST)),
        pytest.param("Interleaved1F1B", 12, marks=_slow(COUNTS_TEST)),
    ],
)
def test_a_stage_plan_from_three_short_counts_equals_the_plan_at_the_jobs_count(schedule, count):
    args = [*EIGHT, "--parallelism.pp", "2", "--parallelism.pp_schedule", schedule]
    cfg, _ = load_config([*args, "--training.local_batch_size", str(count)])
    _, counts = short_counts(cfg)
    assert counts and counts[-1] < count and short_depths(cfg)[1] == []  # extended in micro-batches only
    extended = _extended_equals_whole([*args, "--training.local_batch_size", str(count)])
    assert extended[0].made.startswith(f"run at {counts[0]}, {counts[1]} and {counts[2]} micro-batches")


@pytest.mark.integration
def test_a_deep_stage_plan_from_three_shallow_depths_equals_the_plan_of_the_whole_depth():
    """29 blocks at pp 2 split unevenly (15 and 14: the embedding and the output count as a block each), planned at
    7, 9 and 11 blocks and extended nine steps, under 1F1B; every field equal, the peak's place (layer and
    micro-batch) included."""
    args = ["--config", "llama3_debug", "--model.n_layers", "29", *SEQ, "--parallelism.pp", "2"]
    extended = _extended_equals_whole([*args, *BATCH_4])
    assert extended[0].made == "run at 7, 9 and 11 blocks and extended to 29"
    assert [p.blocks for p in extended] == [tuple(range(15)), tuple(range(15, 29))]


@pytest.mark.integration
@_slow(DEPTHS_TEST)
def test_a_deep_stage_plan_under_a_memory_budget_extends_exactly():
    """The budget's choice is solved once at the job's depth (`pipeline_budget_choice`) and every shorter plan applies
    it by block class, so the stage plans at 7, 9 and 11 blocks extend to 29 as under the other modes: every field
    equal to the whole depth's plan, which recomputes (84 s here). At seq 256 (at 64 a fraction below 1 is
    infeasible: the boundaries and the loss, which no choice recomputes, hold most of a sequence's activations)."""
    args = ["--config", "llama3_debug", "--model.n_layers", "29", "--training.seq_len", "256", "--parallelism.pp", "2"]
    budget = ["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", "0.7"]
    extended = _extended_equals_whole([*args, *BATCH_4, *budget])
    assert extended[0].made == "run at 7, 9 and 11 blocks and extended to 29"
    choice = extended[0].budget_choice
    assert choice.depth == 29 and choice.recompute and choice.optimal


DEEPER = [
    # A model with a leading dense block, its experts split over dp_shard x ep inside each stage.
    "--config deepseek_v3_debug --model.n_layers 32 --parallelism.dp_shard 2 --parallelism.ep 2"
    " --training.local_batch_size 4",
    # Deep and many micro-batches: three counts at each of three depths.
    "--config llama3_debug --model.n_layers 28 --parallelism.pp_schedule GPipe --training.local_batch_size 8",
    # Two stages a rank, V-shaped (at 40 blocks, stage 0's weight pass overtook stage 3's, which held the peak at
    # 8, 12 and 16 blocks: the extension of the peak alone was 306,684 B short).
    "--config llama3_debug --model.n_layers 56 --parallelism.pp_schedule ZBVZeroBubble --training.local_batch_size 4",
]


@pytest.mark.integration
@_slow(DEPTHS_TEST)
@pytest.mark.parametrize("args", DEEPER, ids=["deepseek-ep", "gpipe-depth-and-count", "zbv"])
def test_deeper_stage_plans_extend_exactly(args):
    _extended_equals_whole([*args.split(), *SEQ, "--parallelism.pp", "2"])


@pytest.mark.parametrize(
    ("args", "depth", "depths"),
    [
        ("--config llama3_debug --model.n_layers 29 --parallelism.pp 2", 29, [7, 9, 11]),  # stages 15 and 14
        ("--config llama3_debug --model.n_layers 23 --parallelism.pp 2", 23, []),  # 7 + 9 + 11 > 23: planned whole
        ("--config deepseek_v3_debug --model.n_layers 32 --parallelism.pp 2", 32, [8, 10, 12]),  # 1 dense block kept
        # Llama-3 405B's 126 blocks at pp 8: 15, 16 x 6, 15; at pp 16 (7, 8 x 14, 7) planned whole (62 + 78 + 94).
        ("--config llama3_405b --parallelism.pp 8", 126, [30, 38, 46]),
        ("--config llama3_405b --parallelism.pp 16", 126, []),
        # Two stages a rank: 4 stages of 20 blocks (Llama-3 70B's 80 blocks).
        ("--config llama3_70b --parallelism.pp 2 --parallelism.pp_schedule Interleaved1F1B", 80, [12, 16, 20]),
    ],
)
def test_the_shallow_depths_take_the_same_blocks_from_every_stage(args, depth, depths):
    cfg, _ = load_config(args.split())
    assert short_depths(cfg) == (depth, depths)
    p = cfg.parallelism
    n_stages = p.pp * (2 if p.pp_schedule == "Interleaved1F1B" else 1)
    deep = [len(r) for r in stage_blocks(depth, n_stages)]
    lead = 1 if cfg.model.name == "deepseek_v3" else 0  # debug DeepSeek-V3's dense block
    for d in depths:
        sizes = [len(r) for r in stage_blocks(d, n_stages)]
        assert sizes == [s - (depth - d) // n_stages for s in deep]
    if depths:
        assert sum(depths) < depth
        shallowest = [len(r) for r in stage_blocks(depths[0], n_stages)]
        assert min(shallowest[0] - lead, *shallowest[1:]) == SHORT_STAGE


def _stand_in(cfg, device, choice=None, *, bend: int = 10**6, update: int = 0, unaccounted: int = 0):
    """A stage plan of two passes at depth n: a forward of 1000 n + 8000 bytes, which holds the peak up to 16 blocks,
    and a backward of 1500 n (bent past `bend` blocks), which overtakes it past 16 blocks; the update holds
    `update` bytes, and the step's peak is `unaccounted` bytes above every pass's."""
    n = cfg.model.n_layers
    for position in range(cfg.parallelism.pp):
        passes = {
            f"stage {position} forward of micro-batch 1": (1000 * n + 8000, f"forward: mm in layers.{n}.w", 2),
            f"stage {position} backward of micro-batch 0": (1500 * n + max(0, n - bend) ** 2, f"bw (layer {n + 1})", 1),
            UPDATE: (update, "update", 0),
        }
        top = max(passes, key=lambda k: passes[k][0])
        peak, at, flight = passes[top]
        yield StagePlan(position, (position,), (), peak + unaccounted, top == UPDATE, at, flight, 2, 0, 10 * n, 0.0,
                        pass_peaks=passes)  # fmt: skip


@pytest.mark.parametrize("bent", [False, True])
def test_plans_are_extended_pass_by_pass_or_planned_whole_and_said(monkeypatch, bent):
    """Stand-in plans of 29 blocks at pp 2, made at 7, 9 and 11 blocks, where the forward holds the peak: extended
    pass by pass, the backward, which grows faster, holds it at 29 (its place's layer number grows as its bytes do);
    bent past 5 blocks, the backward's peaks are not evenly spaced, and the job's depth is planned instead, said in
    one line."""
    import graph_trainer.plan.stage_plan as stage_plan

    stand_in = functools.partial(_stand_in, bend=5 if bent else 10**6)
    monkeypatch.setattr(stage_plan, "plan_pipeline", stand_in)
    cfg, _ = load_config(["--config", "llama3_debug", "--model.n_layers", "29", "--parallelism.pp", "2", *BATCH_4])
    said: list[str] = []
    plans = plan_positions(cfg, torch.device("cpu"), said.append)
    if bent:
        assert [_fields(p) for p in plans] == [_fields(p) for p in stand_in(cfg, None)]
        assert said == [
            "stage plan: position 0's plans at 7, 9 and 11 blocks are not evenly spaced; planned at the job's 29 blocks"
        ]
        assert plans[0].made == StagePlan.made
    else:
        assert not said and plans[0].made == "run at 7, 9 and 11 blocks and extended to 29"
        assert [_fields(p) for p in plans] == [
            (0, (0,), tuple(range(15)), 43_500, False, "bw (layer 30)", 1, 2, 0, 290),
            (1, (1,), tuple(range(15, 29)), 43_500, False, "bw (layer 30)", 1, 2, 0, 290),
        ]


def test_a_peak_in_the_update_is_extended_and_passes_that_miss_the_peak_plan_whole(monkeypatch):
    """The update's own peak is a pass like the others (constant here: it wins at every depth); stand-in plans whose
    passes do not account for the step's peak (a pass's peak lost) are not extended but planned whole, said."""
    import graph_trainer.plan.stage_plan as stage_plan

    cfg, _ = load_config(["--config", "llama3_debug", "--model.n_layers", "29", "--parallelism.pp", "2", *BATCH_4])
    monkeypatch.setattr(stage_plan, "plan_pipeline", functools.partial(_stand_in, update=10**6))
    plans = plan_positions(cfg, torch.device("cpu"))
    assert [(p.peak_bytes, p.peak_in_update, p.at, p.in_flight) for p in plans] == [(10**6, True, "update", 0)] * 2
    monkeypatch.setattr(stage_plan, "plan_pipeline", functools.partial(_stand_in, unaccounted=1))
    said: list[str] = []
    plans = plan_positions(cfg, torch.device("cpu"), said.append)
    assert said == [
        "stage plan: position 0's plans at 7, 9 and 11 blocks are not evenly spaced; planned at the job's 29 blocks"
    ]
    assert plans[0].made == StagePlan.made


@pytest.mark.integration
def test_the_plan_made_after_torchs_set_up_is_the_plan_made_after_a_first_step(monkeypatch, caplog):
    """The plan is of the step after the first, whose torch buffers are made by torch's own stage set-up
    (`make_buffers`) rather than by running the first step: every field, each pass's peak included, is the plan a
    first step's run gives (the path a torch without that set-up takes, said in the log). Under ZBVZeroBubble: two
    stages a rank, deferred weights (torch's multi-stage set-up; the trainer's pp tests measure both set-ups' plans).
    Without the set-up's buffers, `held_bytes` is 0 and the plans differ."""
    from graph_trainer.plan import stage_plan

    six = ["--config", "llama3_debug", *tiny_model(6), *SEQ, *BATCH_4]
    cfg, _ = load_config([*six, "--parallelism.pp", "2", "--parallelism.pp_schedule", "ZBVZeroBubble"])
    set_up = list(plan_pipeline(cfg, torch.device("cpu")))
    assert all(p.held_bytes > 0 for p in set_up)  # torch's receive buffers, made and counted

    def no_set_up(*args: object) -> bool:
        return False

    monkeypatch.setattr(stage_plan, "make_buffers", no_set_up)
    with caplog.at_level("INFO", logger=stage_plan.__name__):
        stepped = list(plan_pipeline(cfg, torch.device("cpu")))
    assert [(_fields(p), p.pass_peaks) for p in set_up] == [(_fields(p), p.pass_peaks) for p in stepped]
    said = [r.getMessage() for r in caplog.records if "a first step is run" in r.getMessage()]
    assert len(said) == len(stepped), said  # once a position
