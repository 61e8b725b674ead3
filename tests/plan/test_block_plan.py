"""The depth-free plan (graph_trainer/plan/block_plan.py) equals the full trace, to the byte.

Each case plans the same config twice: extended from 3 and 4 blocks (asserted: 7 blocks traced, so a
fallback to a full trace cannot pass) and traced whole. The peak, its location as (layer, module, op), the
bytes by category at the peak, the saved bytes, the FLOPs, the bytes per collective kind and the parameter
count must be equal for none, selective and full. For `budget` they must be equal to the whole trace's with the
plan's choice applied, as the trainer applies it (`StepPlan.budget_choice`); `optimum` also compares its
recompute FLOPs with the whole graph's per-op solve (see OPTIMUM_BOUND for where that runs).
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from graph_trainer.builder import build_job
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from graph_trainer.plan.block_plan import SHORT, plan_modes
from graph_trainer.plan.step_plan import AC_MODES, StepPlan, plan_step

EXACT = ("none", "selective", "full")
# The budget's recompute FLOPs (one choice per block class, `passes/budget_depth.py`) against the whole graph's
# per-op optimum: at most 1% more, the bound. Asked of the 8B dims only (a slow test), where it does not run:
# at those widths and seq 256 the default budget is infeasible, and both plans refuse it in the same words (checked).
# At 8 debug blocks the per-op solve stops at its 60 s limit unproven (gap 47%, measured 2026-11-30; it found the
# same 2.282 GFLOP as ours), so it is no optimum there. Optimality is proven against enumeration instead
# (test_remat_model.py: one block's 1,024 choices, 3 blocks, and a block at the 8B widths).
OPTIMUM_BOUND = 0.01
DEBUG = ["--config", "llama3_debug", "--training.seq_len", "128", "--training.local_batch_size", "2"]
# A shape whose activations dominate the step, so that the default budget (0.5) is feasible and recomputes.
BUDGET = ["--config", "llama3_debug", "--training.seq_len", "256", "--training.local_batch_size", "4"]
# Llama-3 8B's dimensions (dim, heads, ffn, vocab) at a short sequence: the trace's cost is per op, not per byte.
DIMS_8B = ["--config", "llama3_8b", "--training.seq_len", "256", "--training.loss_chunk_size", "0"]


def _numbers(plan: StepPlan) -> dict:
    return {
        "peak": plan.peak_bytes,
        "where": plan.peak_location,
        "by_category": plan.peak_by_category,
        "saved": plan.saved_bytes,
        "flops": plan.flops,
        "comm": plan.comm_bytes,
        "params": plan.num_params,
    }


def _both(args: list[str], layers: int, modes: tuple[str, ...], whole: tuple[str, ...]) -> tuple[dict, dict]:
    cfg, _ = load_config([*args, "--model.n_layers", str(layers)])
    out = []
    for fast, planned in ((True, modes), (False, whole)):
        with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
            out.append(plan_modes(cfg, mesh, planned, fast=fast))
    return out[0], out[1]


def _check(
    args: list[str], layers: int, traced: int = sum(SHORT), *, budget: bool = True, optimum: bool = True
) -> dict:
    """`optimum`: also solve the budget on the whole graph, per op, and compare the FLOPs (20-40 s more). Returns
    the depth-free plans, by mode."""
    fast, full = _both(args, layers, AC_MODES if budget else EXACT, AC_MODES if budget and optimum else EXACT)
    for mode in EXACT:
        assert fast[mode].blocks_traced == traced, mode  # extended, not a fallback to the full trace
        assert full[mode].blocks_traced == layers
        assert not fast[mode].approximate
        assert _numbers(fast[mode]) == _numbers(full[mode]), mode
        layer, module, op = fast[mode].peak_location
        assert isinstance(op, str) and op and (layer is None or f"layers.{layer}" in module or "AdamW" in op)
    if budget:
        _check_budget(args, layers, traced, fast, full if optimum else None)
    return fast


def _check_budget(args: list[str], layers: int, traced: int, fast: dict, full: dict | None) -> None:
    from graph_trainer.builder import build_job
    from graph_trainer.plan.step_plan import plan_step

    plan = fast["budget"]
    if isinstance(plan, UserError):  # the peak is not the activations' (8B widths at seq 256): both refuse
        assert "is infeasible" in str(plan)
        assert full is None or "is infeasible" in str(full["budget"])
        return
    assert not plan.approximate and plan.blocks_traced == traced
    choice = plan.budget_choice
    assert choice.depth == layers and choice.peak_bytes <= choice.target_bytes and choice.recompute
    cfg, _ = load_config([*args, "--model.n_layers", str(layers), "--activation_checkpoint.mode", "budget"])
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
        applied = plan_step(build_job(cfg, mesh, materialize=False).with_budget_choice(choice))
    assert applied.blocks_traced == layers
    assert _numbers(plan) == _numbers(applied)
    if full is None:
        return
    ours, best = plan.flops - fast["none"].flops, full["budget"].flops - full["none"].flops
    print(f"budget recompute FLOPs at {layers} blocks, per class vs per op: {ours / best - 1:+.2%}")
    assert ours <= (1 + OPTIMUM_BOUND) * best


@pytest.mark.usefixtures("short_solves")
def test_depth_free_plan_equals_the_full_trace_debug_8_blocks():
    _check(BUDGET, 8, optimum=False)


@pytest.mark.integration
@pytest.mark.slow(
    held_by="tests/plan/test_block_plan.py::test_depth_free_plan_equals_the_full_trace_debug_8_blocks"
)  # 49-141 s
@pytest.mark.usefixtures("short_solves")
def test_depth_free_budget_plan_equals_the_full_trace_debug_16_blocks():
    _check(BUDGET, 16, optimum=False)


@pytest.mark.integration
@pytest.mark.usefixtures("short_solves")
def test_depth_free_size_budget_beside_the_eager_update_equals_the_full_trace():
    """A whole-step size with the eager AdamW update after the graph: the deep model leaves room for the update's
    state at the model's depth (extended from the short steps, as the plan extends it), and the plan fits."""
    size = 0.2 * 2**30  # between full's 0.12 GiB and no AC's 0.26 GiB at these widths
    fast = _check([*BUDGET, "--activation_checkpoint.memory_budget", "0.2GiB"], 8, optimum=False)
    assert fast["budget"].optimizer != "in graph" and fast["budget"].peak_bytes <= size < fast["none"].peak_bytes


@pytest.mark.integration
@pytest.mark.usefixtures("short_solves")
def test_depth_free_budget_plan_equals_the_full_trace_fsdp_one_rank_of_8():
    """FSDP's gathers are in the budget's model as `fsdp_gather` tags them (re-gathered in the backward)."""
    _check([*BUDGET, "--parallelism.dp_shard", "8"], 8, optimum=False)


@pytest.mark.integration
@pytest.mark.slow(  # 38 s; CI holds it under any per-class choice (recomputing nothing: no AC's)
    held_by="tests/plan/test_block_plan.py::test_depth_free_plan_of_any_per_class_choice_equals_the_full_trace_with_fsdp_prefetch"
)
@pytest.mark.usefixtures("short_solves")
def test_depth_free_plan_equals_the_full_trace_fsdp_prefetch_one_rank_of_8():
    """With prefetch the last block keeps its gathered parameters into its backward, unlike the middle ones:
    the first and last blocks may differ from the middle, as long as they are the same at both short depths. The
    budget's choice keeps room for the gathers the prefetch moves (tests/passes/test_budget_fsdp.py), solved on the
    short traces as without it."""
    prefetch = ["--parallelism.dp_shard", "8", "--parallelism.fsdp_prefetch", "true"]
    _check([*BUDGET, *prefetch, "--activation_checkpoint.memory_budget", "0.9"], 8, optimum=False)


@pytest.mark.integration
@pytest.mark.slow(  # 68 s in CI; the budget refuses at these widths and seq (the peak is not the activations')
    held_by="tests/plan/test_block_plan.py::test_depth_free_plan_equals_the_full_trace_debug_8_blocks"
)
def test_depth_free_plan_equals_the_full_trace_8b_dims_one_rank_of_8():
    _check([*DIMS_8B, "--parallelism.dp_shard", "8"], 8)


@pytest.mark.parametrize("layers", [2, 4])
def test_shallow_models_are_traced_whole_once_for_all_modes(layers):
    cfg, _ = load_config([*DEBUG, "--model.n_layers", str(layers)])
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
        plans = plan_modes(cfg, mesh, EXACT)
    assert {p.blocks_traced for p in plans.values()} == {layers}
    assert plans["none"].peak_bytes > plans["selective"].peak_bytes > plans["full"].peak_bytes


@pytest.mark.usefixtures("short_solves")
def test_the_preflight_and_dry_run_of_a_deep_model_use_the_depth_free_plan():
    from graph_trainer.distributed.mesh import Mesh
    from graph_trainer.plan.dry_run import dry_run
    from graph_trainer.plan.preflight import preflight

    cfg, _ = load_config([*DEBUG, "--model.n_layers", "8", "--activation_checkpoint.mode", "selective"])
    plan = preflight(cfg, Mesh(ParallelDims(), 0, torch.device("cpu")))
    assert plan.blocks_traced == sum(SHORT) and plan.ac_mode == "selective"
    cfg.model.n_layers = 5
    lines: list[str] = []
    dry_run(cfg, device=torch.device("cpu"), print_fn=lines.append)
    assert "blocks traced: 3 + 4 for a model of 5, once for all modes; extended exactly (docs/planner.md)" in lines
    budget_row = next(line for line in lines if line.startswith("budget "))
    assert "approximate" not in budget_row


def test_one_trace_shared_by_the_modes_plans_as_one_trace_per_mode():
    """The full-trace side of the comparisons traces once and runs each mode's passes on a copy: it must plan
    exactly what `plan_step` (a fresh trace per mode, the path the golden digests cover) plans."""
    from graph_trainer.builder import build_job
    from graph_trainer.distributed.mesh import Mesh
    from graph_trainer.plan.step_plan import plan_step, with_ac_mode

    cfg, _ = load_config([*DEBUG, "--model.n_layers", "2"])
    mesh = Mesh(ParallelDims(), 0, torch.device("cpu"))
    shared = plan_modes(cfg, mesh, AC_MODES)
    job = build_job(cfg, mesh, materialize=False)
    for mode in AC_MODES:
        try:
            alone = plan_step(job.with_config(with_ac_mode(cfg, mode)))
        except UserError as e:  # the default budget is infeasible at this shape: both say so, in the same words
            assert str(shared[mode]) == str(e), mode
            continue
        assert _numbers(shared[mode]) == _numbers(alone), mode
        assert shared[mode].peak_where == alone.peak_where


@pytest.mark.integration
@pytest.mark.usefixtures("short_solves")
def test_depth_free_plan_equals_the_full_trace_tp2_dp_shard2_one_rank_of_4():
    """Tensor parallelism (sequence parallel between the blocks) with FSDP, one rank of 4 on the fake process
    group: the TP collectives and the vocabulary-parallel loss extend exactly too."""
    _check([*BUDGET, "--parallelism.tp", "2", "--parallelism.dp_shard", "2"], 8, optimum=False)


MOE = ["--config", "deepseek_v3_debug", "--training.seq_len", "64", "--training.local_batch_size", "2"]


@pytest.mark.integration
def test_depth_free_plan_equals_the_full_trace_moe_expert_parallel_one_rank_of_4():
    """DeepSeek-V3: block 0 is dense, the others route to experts (all-to-alls at ep 4), and each router's balancing
    bias moves in the step's update (tagged with its layer): the first block differs from the middle ones, as
    prefetch's last does, and is proved the same at 3 and 4 blocks."""
    _check([*MOE, "--parallelism.dp_shard", "4", "--parallelism.ep", "4"], 6, budget=False)


@pytest.mark.integration
def test_depth_free_plan_equals_the_full_trace_moe_with_two_dense_blocks(monkeypatch):
    """DeepSeek-V3 671B has 3 dense blocks: the leading ones are keyed one by one (`ModelSpec.leading_blocks`), the
    last dense one is the `first` class, so 4 + 5 blocks are traced here (2 dense)."""
    from models.deepseek_v3 import SPEC

    flavor = SPEC.flavors["debugmodel"]
    monkeypatch.setitem(SPEC.flavors, "debugmodel", dataclasses.replace(flavor, n_dense_layers=2))
    _check(MOE, 8, traced=4 + 5, budget=False)


def test_a_budget_whose_short_models_do_not_extend_is_approximate_and_said(monkeypatch, caplog):
    """Where the short steps' models do not extend in depth (`NotExtendable`), the budget row falls back to the
    approximation from none and full, marked approximate and said in one line; the other modes stay exact."""
    from graph_trainer.passes.budget_depth import NotExtendable
    from graph_trainer.plan import block_plan

    def refuse(*args, **kwargs):
        raise NotExtendable("at some place, one more middle block adds [1, 2] bytes")

    monkeypatch.setattr(block_plan, "deep_model", refuse)
    cfg, _ = load_config([*BUDGET, "--model.n_layers", "6"])
    from graph_trainer.distributed.mesh import Mesh

    with caplog.at_level(logging.WARNING, logger="graph_trainer"):
        plans = plan_modes(cfg, Mesh(ParallelDims(), 0, torch.device("cpu")), ["selective", "budget"])
    assert plans["budget"].approximate and plans["budget"].budget_choice is None
    assert not plans["selective"].approximate and plans["selective"].blocks_traced == sum(SHORT)
    said = [r.getMessage() for r in caplog.records if "the budget plan is approximate" in r.getMessage()]
    assert len(said) == 1 and "one more middle block adds" in said[0]


@pytest.mark.usefixtures("short_solves")
def test_depth_free_budget_plan_equals_the_full_trace_with_a_loss_of_eight_chunks():
    """The chunked loss's middle chunks have no block-plan key; outside the blocks the short steps' ops are paired in
    order instead (`block_plan._short_budget_args`), so the budget's model still extends (it was refused: approximate).
    """
    from graph_trainer.distributed.mesh import Mesh

    args = [*BUDGET, "--training.loss_chunk_size", "128"]  # 4 x 256 tokens: 8 chunks
    cfg, _ = load_config([*args, "--model.n_layers", "6"])
    fast = plan_modes(cfg, Mesh(ParallelDims(), 0, torch.device("cpu")), ["budget"])
    _check_budget(args, 6, sum(SHORT), fast, None)


_PREFETCH_CHOICE_TEST = "test_depth_free_plan_of_any_per_class_choice_equals_the_full_trace_with_fsdp_prefetch"


@pytest.mark.parametrize(
    "recomputed",
    [
        "middle",
        # The mirror of "middle" (the first block recomputes, the others save): 29 s, run with -m slow.
        pytest.param(
            "first",
            marks=[
                pytest.mark.integration,
                pytest.mark.slow(held_by=f"tests/plan/test_block_plan.py::{_PREFETCH_CHOICE_TEST}"),
            ],
        ),
        "nothing",
    ],
)
def test_depth_free_plan_of_any_per_class_choice_equals_the_full_trace_with_fsdp_prefetch(
    monkeypatch, caplog, recomputed
):
    """A prefetched gather of block i runs in block i-1's forward (in the backward, block i+1's), where the blocks
    before it hold what their class's choice saved. In the 3-block step that is the first block's, in the 4-block step
    a middle one's: keyed by its own block, one more block then looked like one more first block, exact only while
    every class saves alike (the fixed modes). A budget that saved far more in the first block than in the middle
    ones (Llama-3 70B, dp_shard 32 x tp 2, 75GiB) was planned at 149.9 GiB where its model put the step at 71.8 (at 12
    blocks a whole trace agreed with the model, 17.85 GiB, and the plan said 20.58). Here the choice is forced both
    ways (the first block saves everything and the others recompute everything, or the reverse, or nothing),
    whatever the solver would pick, and the plan must still equal the full trace. A plan above the target its choice
    was solved for is said in one line (`block_plan._check_target`: the solver's own choices fit, so in a run it
    means the plan and the model disagree)."""
    from graph_trainer.passes import budget
    from graph_trainer.passes.budget_depth import candidate_keys
    from graph_trainer.passes.remat_model import Solution

    args = [*BUDGET, "--parallelism.dp_shard", "8", "--parallelism.fsdp_prefetch", "true"]
    args += ["--activation_checkpoint.mode", "budget"]
    first = recomputed == "first"

    def forced(model, _budget, **_):  # the deep model's solve, answered with the forced choice
        keys = candidate_keys(model.candidates, SHORT[1], 0)  # the 4-block model's keys (no leading blocks)
        chosen = [c for c in model.candidates if recomputed != "nothing" and (keys[c][0] == "first") == first]
        return Solution(chosen, model.peak(chosen), model.recompute_flops(chosen), 0.0, "forced", True)

    monkeypatch.setattr(budget, "solve", forced)
    cfg, _ = load_config([*args, "--model.n_layers", "8"])
    with caplog.at_level(logging.WARNING, logger="graph_trainer"):
        with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
            fast = plan_modes(cfg, mesh, ["budget"], fast=True)
    plan = fast["budget"]
    said = [r.getMessage() for r in caplog.records if "the depth-free plan puts the budget's choice" in r.getMessage()]
    # Recomputing the middle blocks fits the 0.5 budget's target; recomputing only the first, or nothing, does not.
    assert len(said) == (0 if recomputed == "middle" else 1), said
    assert plan.blocks_traced == sum(SHORT) and not plan.approximate
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
        applied = plan_step(build_job(cfg, mesh, materialize=False).with_budget_choice(plan.budget_choice))
    assert applied.blocks_traced == 8
    assert _numbers(plan) == _numbers(applied)
