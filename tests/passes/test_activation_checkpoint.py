"""Activation checkpointing on the graph: bitwise numerics vs eager (with and without torch.utils.checkpoint),
static estimate == measured CPU peak for every mode, recompute FLOPs that never fall as the budget shrinks, bad
budgets."""

from __future__ import annotations

import re
from itertools import pairwise

import pytest

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.cli import load_config
from graph_trainer.observability.memory import LiveTensorTracker
from graph_trainer.trainer import Trainer
from tests.multiprocess import assert_peaks_match, peaks

TINY = [
    "--config",
    "llama3_debug.toml",
    "--model.n_layers",
    "2",
    "--model.dim",
    "64",
    "--model.n_heads",
    "4",
    "--training.seq_len",
    "32",
    "--training.local_batch_size",
    "2",
    "--training.deterministic",
    "true",
    "--metrics.enable_tensorboard",
    "false",
    "--model.dropout",
    "0.1",
    "--metrics.track_memory",
    "false",
]

MODES = {  # name -> CLI args
    "none": ["--activation_checkpoint.mode", "none"],
    "selective_op": ["--activation_checkpoint.mode", "selective"],
    "selective_2": ["--activation_checkpoint.mode", "selective", "--activation_checkpoint.selective_ac_option", "2"],
    "full": ["--activation_checkpoint.mode", "full"],
    "budget": ["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", "0.8"],
    "overrides": [
        "--activation_checkpoint.mode",
        "selective",
        "--activation_checkpoint.save_list",
        "aten.silu",
        "--activation_checkpoint.recompute_list",
        "aten.mm",
    ],
}


def _trainer(tmp_path, name: str, *extra: str) -> Trainer:
    cfg, _ = load_config([*TINY, "--job.dump_folder", str(tmp_path / name), *extra])
    return Trainer(cfg)


def _run(tmp_path, name: str, *extra: str, steps: int = 5):
    result = _trainer(tmp_path, name, "--training.steps", str(steps), *extra).train()
    return result.losses, result.params_sha256, result.grads_sha256


@pytest.fixture(scope="module")
def eager_none(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("eager"), "eager_none", "--compile.mode", "eager")


@pytest.mark.parametrize("mode", list(MODES))
def test_traced_ac_is_bitwise_equal_to_eager_and_eager_checkpoint(tmp_path, mode, eager_none):
    traced = _run(tmp_path, "traced", *MODES[mode])
    assert traced == eager_none  # losses (exact floats), params and last grads (sha256 of the bytes)
    if mode != "budget":  # budget is graph-only
        eager_ac = _run(tmp_path, "eager_ac", "--compile.mode", "eager", *MODES[mode])
        assert eager_ac == eager_none


def test_budget_is_graph_only_in_eager(tmp_path):
    with pytest.raises(ConfigError, match="graph-only"):
        _trainer(tmp_path, "x", "--compile.mode", "eager", *MODES["budget"])


def _measure(trainer: Trainer) -> tuple[int, int, int]:
    """(estimated peak, measured peak, saved bytes) of one traced step, from the live-tensor tracker."""
    batch = next(iter(trainer.dataloader))
    step = trainer.step_fn
    traced = step.ensure_traced(batch)
    inputs = step.flat_inputs(batch)
    tracker = LiveTensorTracker()
    tracker.track_existing(inputs)
    try:
        with tracker:
            out = traced(inputs)
        del out
        measured = tracker.peak_bytes
    finally:
        tracker.forget()
    est = step.memory_estimate
    return est.peak_bytes, measured, est.saved_bytes


@pytest.mark.parametrize("mode", list(MODES))
def test_estimated_peak_equals_measured_cpu_peak(tmp_path, mode):
    estimated, measured, _ = _measure(_trainer(tmp_path, mode, *MODES[mode]))
    assert estimated == measured


@pytest.mark.integration  # plans and measures several budgets or modes
def test_ac_modes_reduce_saved_activations(tmp_path):
    saved = {m: _measure(_trainer(tmp_path, m, *MODES[m]))[2] for m in ("none", "selective_op", "full")}
    assert saved["full"] < saved["selective_op"] < saved["none"]


@pytest.mark.integration  # plans and measures several budgets or modes
@pytest.mark.slow(
    held_by="tests/passes/test_remat_model.py::test_the_frontier_spans_the_lowest_peak_to_no_ac_and_each_point_fits_at_the_fewest_flops"
)  # 105 s; the same claim on the model
def test_a_smaller_budget_never_costs_fewer_flops_and_every_peak_fits(tmp_path):
    """The policy is optimal (tests/passes/test_remat_model.py), so a smaller budget, whose choices are a subset of
    a larger one's, can never be met with fewer recompute FLOPs; each measured peak fits its target."""
    from graph_trainer.job_config.memory_budget import parse_memory_budget
    from graph_trainer.tracer.graph_utils import node_flops
    from graph_trainer.tracer.node_meta import is_rematerialized

    no_ac, _, _ = _measure(_trainer(tmp_path, "none"))
    flops, peaks = [], []
    for budget in ("1.0", "0.8", "0.7", "0.67", "0.64"):  # 0.634 is the smallest feasible one; >= 0.75: 0 FLOPs
        trainer = _trainer(tmp_path, f"b{budget}", "--activation_checkpoint.mode", "budget",
                           "--activation_checkpoint.memory_budget", budget)  # fmt: skip
        estimated, measured, _ = _measure(trainer)
        assert estimated == measured
        inputs = trainer.step_fn.memory_estimate.input_bytes
        assert measured <= parse_memory_budget(budget).target(input_bytes=inputs, no_ac_peak=no_ac)
        gm = trainer.step_fn.ensure_traced(next(iter(trainer.dataloader))).gm
        flops.append(sum(node_flops(n) for n in gm.graph.nodes if is_rematerialized(n)))
        peaks.append(measured)
    assert all(a <= b for a, b in pairwise(flops)), flops
    assert peaks[-1] < peaks[0] and flops[-1] > 0


@pytest.mark.integration  # plans and measures several budgets or modes
def test_infeasible_budget_names_the_smallest_feasible_one(tmp_path):
    """The refusal's figure is in the fraction's terms (the graph's peak); beside it, the whole step's peak at that
    choice, with the eager update's state (what the dry run's rows show), so the two are not read as one."""
    with pytest.raises(ConfigError, match="infeasible") as info:
        _measure(
            _trainer(
                tmp_path,
                "tiny",
                "--activation_checkpoint.mode",
                "budget",
                "--activation_checkpoint.memory_budget",
                "0.01",
            )
        )
    said = str(info.value)
    graph = float(re.search(r"is (\d+\.\d+) GiB \(", said).group(1))
    step = re.search(r"the whole step \(eager AdamW state beside the graph\) then peaks at (\d+\.\d+) GiB", said)
    assert "\n" not in said and step and float(step.group(1)) > graph, said
    smallest = re.search(r"memory_budget (\d+\.\d+) or more", said).group(1)
    est, meas, _ = _measure(
        _trainer(
            tmp_path, "ok", "--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", smallest
        )
    )
    assert est == meas


@pytest.mark.integration  # plans and measures several budgets or modes
def test_a_size_budget_bounds_the_whole_steps_measured_peak(tmp_path):
    """A size with its unit is the whole step's peak (update traced in: the graph is the whole step): the measured
    peak stays under it, and an infeasible one names, in GiB, a smallest budget that is then met."""
    whole_step = ["--compile.trace_optimizer", "true"]

    def measured_with(name: str, *ac: str) -> tuple[int, int]:
        estimated, measured, _ = _measure(_trainer(tmp_path, name, *whole_step, *ac))
        assert estimated == measured
        return estimated, measured

    none = measured_with("none")[1]
    full = measured_with("full", "--activation_checkpoint.mode", "full")[1]
    budget = (none + full) // 2
    _, peak = measured_with(
        "mid", "--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", f"{budget}B"
    )
    assert full <= peak <= budget < none

    with pytest.raises(ConfigError, match="infeasible") as info:
        measured_with(
            "low", "--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", f"{full // 2}B"
        )
    smallest = re.search(r"memory_budget (\d+\.\d+GiB) or more", str(info.value)).group(1)
    _, peak = measured_with(
        "smallest", "--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", smallest
    )
    assert peak <= float(smallest.removesuffix("GiB")) * 2**30


@pytest.mark.integration  # trains three budgets or modes for two steps each
def test_a_size_budget_beside_the_eager_update_bounds_the_whole_steps_measured_peak(tmp_path):
    """The default eager AdamW update runs after the graph: its state is alive beside the graph (not one of its
    inputs), and its own peak (parameters, gradients, state and scratch) no choice in the graph lowers. A size budget
    leaves room for the state, so the whole step's measured peak stays under it; a size below the update's own peak
    is refused in one line with the smallest one. (Before, a size budget needed `--compile.trace_optimizer true`.)"""

    def measured(name: str, *ac: str) -> int:
        result = _trainer(tmp_path, name, "--metrics.track_memory", "true", "--training.steps", "2", *ac).train()
        step_peaks = peaks(result.records)
        assert_peaks_match(step_peaks, name)
        return max(m for _, m, _ in step_peaks)

    none = measured("none")
    full = measured("full", "--activation_checkpoint.mode", "full")
    budget = (none + full) // 2
    peak = measured(
        "mid", "--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", f"{budget}B"
    )
    print(f"whole step, eager update: no AC {none:,} B, full {full:,}, budget {budget:,}, its plan {peak:,}")
    assert full <= peak <= budget < none

    with pytest.raises(ConfigError, match="the eager AdamW update after the graph peaks at") as info:
        measured("low", "--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", "1KiB")
    assert "\n" not in str(info.value) and re.search(r"memory_budget \d+\.\d+GiB or more", str(info.value))


@pytest.mark.integration  # trains three budgets or modes for two steps each, twice
@pytest.mark.parametrize("optimizer", ["eager", "traced"])
def test_a_size_budget_with_accumulation_bounds_the_whole_steps_measured_peak(tmp_path, caplog, optimizer):
    """Four micro-batches a step: the micro-step graph runs beside the step's other micro-batches, the losses kept
    for the step's sum and the optimizer state (eager, or read by the traced update graph after the micro-steps),
    none of them its inputs. A size budget leaves room for them, so the whole step's measured peak stays under it,
    and the estimate is the measured peak. (Before, a size budget needed one micro-batch a step.)"""
    import logging

    accumulating = [
        "--training.global_batch_size",
        "8",
        "--compile.trace_optimizer",
        str(optimizer == "traced").lower(),
    ]

    def measured(name: str, *ac: str) -> int:
        args = ["--metrics.track_memory", "true", "--training.steps", "2", *accumulating, *ac]
        step_peaks = peaks(_trainer(tmp_path, name, *args).train().records)
        assert_peaks_match(step_peaks, name)
        return max(m for _, m, _ in step_peaks)

    none = measured("none")
    full = measured("full", "--activation_checkpoint.mode", "full")
    budget = (none + full) // 2
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        size = ["--activation_checkpoint.memory_budget", f"{budget}B"]
        peak = measured("mid", "--activation_checkpoint.mode", "budget", *size)
    print(f"4 micro-batches, {optimizer} update: no AC {none:,} B, full {full:,}, budget {budget:,}, its plan {peak:,}")
    assert "the step's other micro-batches beside the graph" in caplog.text
    assert full <= peak <= budget < none


def test_the_preflight_refuses_a_size_budget_its_plan_exceeds(tmp_path):
    """What runs outside the graph the policy plans (with accumulation: the update graph, then the eager update)
    is held by the preflight on the whole step's plan: a size one byte below the plan's peak is refused in one
    line with the smallest that fits; the plan's own peak passes."""
    from graph_trainer.plan.preflight import check_budget_held

    trainer = _trainer(tmp_path, "plan", "--training.global_batch_size", "8", *MODES["budget"])
    plan = trainer.preflight
    cfg = trainer.cfg
    cfg.activation_checkpoint.memory_budget = f"{plan.peak_bytes}B"
    check_budget_held(cfg, plan)
    cfg.activation_checkpoint.memory_budget = f"{plan.peak_bytes - 1}B"
    with pytest.raises(ConfigError, match=r"the step's plan peaks at .* or more") as info:
        check_budget_held(cfg, plan)
    assert "\n" not in str(info.value)


def test_recompute_override_of_a_random_op_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="never recomputed"):
        _measure(
            _trainer(
                tmp_path,
                "x",
                "--activation_checkpoint.mode",
                "full",
                "--activation_checkpoint.recompute_list",
                "aten.bernoulli_",
            )
        )


@pytest.mark.integration  # a deep model: the preflight's short traces, then the whole step, then eager
@pytest.mark.usefixtures("short_solves")  # the step applies whichever choice the plan solved
def test_a_deep_model_runs_the_budget_choice_its_plan_solved(tmp_path, caplog):
    """At 6 blocks the preflight solves the budget per block class on the 3- and 4-block traces, and the step
    applies that choice (passes/budget_depth.py): its estimate is the plan's, equal to the measured peak, and its
    numerics are eager's, bit for bit."""
    import logging

    deep = ["--model.n_layers", "6", *MODES["budget"]]
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        estimated, measured, _ = _measure(_trainer(tmp_path, "deep", *deep))
    applied = re.search(
        r"recompute (\d+)/(\d+) candidates, one choice per block class solved on the 3 \+ 4", caplog.text
    )
    assert applied and int(applied.group(1)) > 0 and int(applied.group(2)) % 6 == 0, caplog.text
    assert "modelling gap" not in caplog.text and "does not apply" not in caplog.text
    assert estimated == measured
    eager = _run(tmp_path, "eager", "--model.n_layers", "6", "--compile.mode", "eager")
    assert _run(tmp_path, "traced", *deep) == eager
