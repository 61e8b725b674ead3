"""The budget's model of a deep step extended from its short steps (`passes/budget_depth.py`).

Claims tested:
- under any per-class choice, the extended model's peak and recompute FLOPs are those of the model built on the
  whole deep graph, to the byte (random choices, 6 and 8 blocks, from the 3- and 4-block steps);
- short models that are not one middle block apart are refused (`NotExtendable`), not extended wrongly;
- a choice applied to a graph it was not solved for (another batch) is said in one line and the graph solved whole.
"""

from __future__ import annotations

import functools
import logging
import random

import pytest

from graph_trainer.passes.activation_checkpoint import analyze
from graph_trainer.passes.budget import backward_storages, choices
from graph_trainer.passes.budget_depth import NotExtendable, candidate_keys, extend_in_depth
from graph_trainer.passes.remat_model import build_model
from graph_trainer.plan.block_plan import _keys
from graph_trainer.plan.step_plan import node_blocks
from graph_trainer.tracer.memory_estimate import estimate_peak_memory
from tests.passes.test_remat_model import _clean_step

SHAPE = ["--training.seq_len", "64"]


def _model(layers: int, *extra: str):
    gm, categories = _clean_step(layers, *SHAPE, *extra)
    candidates, free = choices(analyze(gm), set(), backward_storages(gm))
    return gm, build_model(gm, candidates, free, set(), categories)


def _extended(depth: int, three=None):
    gm3, m3 = three or _model(3)
    gm4, m4 = _model(4)
    keys3, keys4 = _keys(gm3, 3, "layers", 0), _keys(gm4, 4, "layers", 0)
    nodes3, nodes4 = list(gm3.graph.nodes), list(gm4.graph.nodes)
    return extend_in_depth(
        m4,
        m3,
        counterpart={nodes4[i]: nodes3[keys3[k]] for k, i in keys4.items() if k in keys3},
        block_of={n: b for _, n, b in node_blocks(gm4, "layers")},
        lead=0,
        depth=depth,
    )


@functools.cache
def _six_blocks():
    """The 6-block model extended from the 3- and 4-block steps, built once for the tests that only solve it (a
    solve reads the model, never changes it)."""
    return _extended(6)


# 8 blocks: the same claim as 6 at a larger depth (41 s in CI), run with -m slow.
_AT_8 = pytest.mark.slow(
    held_by="tests/passes/test_budget_depth.py::test_the_extended_model_is_the_deep_graphs_model_under_any_per_class_choice"
)


@pytest.mark.parametrize("depth", [6, pytest.param(8, marks=[pytest.mark.integration, _AT_8])])
def test_the_extended_model_is_the_deep_graphs_model_under_any_per_class_choice(depth):
    extended = _extended(depth)
    gm, whole = _model(depth)
    # Nothing recomputed is the graph as traced: the no-AC peak a fraction budget refers to.
    assert extended.peak([]) == estimate_peak_memory(gm, input_categories=_clean_step(depth, *SHAPE)[1]).peak_bytes
    deep_keys = candidate_keys(whole.candidates, depth, 0)
    short_keys = candidate_keys(extended.candidates, 4, 0)
    assert set(deep_keys.values()) == set(short_keys.values())
    assert {k[0] for k in deep_keys.values()} == {"first", "mid", "last"}
    rng = random.Random(depth)
    every = sorted(set(deep_keys.values()))
    for share in (0.0, 1.0, 0.2, 0.4, 0.6, 0.8):
        chosen = {k for k in every if rng.random() < share}
        here = [c for c, k in short_keys.items() if k in chosen]
        there = [c for c, k in deep_keys.items() if k in chosen]
        assert (extended.peak(here), extended.recompute_flops(here)) == (
            whole.peak(there),
            whole.recompute_flops(there),
        ), f"{len(chosen)} of {len(every)} keys recomputed"


def test_short_models_that_are_not_one_block_apart_are_refused():
    """A 3-block step at another batch is not the 4-block step less one block: its difference is refused."""
    with pytest.raises(NotExtendable, match="one more middle block"):
        _extended(8, three=_model(3, "--training.local_batch_size", "3"))


@pytest.mark.usefixtures("short_solves")  # the whole solve's answer is not judged here: 55 s at 60 s a solve
def test_a_choice_for_another_graph_is_said_and_the_graph_solved_whole(caplog):
    from graph_trainer.job_config.schema import ActivationCheckpointConfig
    from graph_trainer.passes import budget

    ac = ActivationCheckpointConfig(mode="budget", memory_budget=0.6)
    short = [_clean_step(k, *SHAPE) for k in (3, 4)]
    keys3, keys4 = (_keys(gm, k, "layers", 0) for (gm, _), k in zip(short, (3, 4), strict=True))
    nodes3, nodes4 = (list(gm.graph.nodes) for gm, _ in short)
    deep = budget.deep_model(
        (short[0][0], short[1][0]),
        (short[0][1], short[1][1]),
        ac,
        counterpart={nodes4[i]: nodes3[keys3[k]] for k, i in keys4.items() if k in keys3},
        block_of={n: b for _, n, b in node_blocks(short[1][0], "layers")},
        lead=0,
        depth=6,
    )
    choice = budget.solve_in_depth(deep, ac)
    assert choice.optimal and choice.peak_bytes <= choice.target_bytes and choice.recompute
    gm, categories = _clean_step(6, *SHAPE)
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        budget.tag_memory_budget(gm, ac, input_categories=categories, block_choice=choice)
    assert "one choice per block class" in caplog.text and "modelling gap" not in caplog.text
    caplog.clear()
    gm, categories = _clean_step(6, *SHAPE, "--training.local_batch_size", "3")
    with caplog.at_level(logging.INFO, logger="graph_trainer"):
        budget.tag_memory_budget(gm, ac, input_categories=categories, block_choice=choice)
    said = [r.getMessage() for r in caplog.records if "does not apply" in r.getMessage()]
    assert len(said) == 1 and "solving it whole" in said[0] and "planned as" in said[0]
    assert "target peak" in caplog.text  # solved whole


def test_the_lowest_peak_at_a_flop_limit_is_the_lowest_within_its_resolution():
    """`lowest_peak_in_depth` (benchmarks/budget_at_selective.py): within its FLOPs, and no choice that fits a
    budget one resolution below its peak recomputes at most as many FLOPs (a coarse resolution: two solves, each
    proven in seconds; at an eighth, a third solve stops at its 60 s limit since the output projections became
    candidates); the floor it reports is out of reach, proven by the budget's own solve."""
    from graph_trainer.passes.budget import DeepModel, lowest_peak_in_depth
    from graph_trainer.passes.remat_model import solve

    model = _six_blocks()
    deep = DeepModel(model, candidate_keys(model.candidates, 4, 0), 0, 6, 0)
    limit = 0.5 * model.recompute_flops(model.candidates)
    resolution = model.peak([]) // 4
    choice, floor = lowest_peak_in_depth(deep, limit, resolution=resolution)
    assert choice.recompute_flops <= limit and choice.optimal and choice.peak_bytes < model.peak([]), choice
    assert choice.peak_bytes - resolution <= floor < choice.peak_bytes
    below = solve(model, floor)
    assert below.recompute is None or below.recompute_flops > limit


def test_the_bisection_starts_from_a_known_choice_and_says_when_nothing_beats_it(monkeypatch):
    """The benchmark hands selective AC's choice in; a bisection whose solves find nothing lower keeps it."""
    import graph_trainer.passes.budget as budget
    from graph_trainer.passes.budget import DeepModel, lowest_peak_in_depth
    from graph_trainer.passes.remat_model import Solution

    model = _six_blocks()
    deep = DeepModel(model, candidate_keys(model.candidates, 4, 0), 0, 6, 0)
    budgets = []

    def stopped(_model, budget_bytes, **_):  # a solve stopped at its limit with no choice
        budgets.append(budget_bytes)
        return Solution(None, None, None, 0.1, "Time limit reached")

    monkeypatch.setattr(budget, "solve", stopped)
    # The direct solve that follows an unproven bisection: stopped too, with no choice but a dual bound.
    nothing = Solution([], model.peak([]), 0, 0.1, "Time limit reached", bound_bytes=12345)
    monkeypatch.setattr(budget, "lowest_peak", lambda *_, **__: nothing)
    every = model.candidates
    choice, floor = lowest_peak_in_depth(deep, model.recompute_flops(every), known=every, resolution=2**16)
    assert choice.peak_bytes == model.peak(every) < model.peak([]) and not choice.optimal
    assert floor == 12345 - 1  # only the bound: no bisection step settled
    assert choice.status.endswith("no choice found below it") and max(budgets) < model.peak(every)
    assert "the known choice kept by block class" in choice.status
    choice, _ = lowest_peak_in_depth(deep, model.recompute_flops(every) - 1, known=every, resolution=2**16)
    assert choice.peak_bytes == model.peak([])  # over the FLOPs: not taken
    # A direct solve that proves its peak the lowest proves the answer, though every bisection step stopped.
    proof = Solution(every, model.peak(every), model.recompute_flops(every), 0.1, "Optimal", True, 0.0,
                     model.peak(every))  # fmt: skip
    monkeypatch.setattr(budget, "lowest_peak", lambda *_, **__: proof)
    choice, floor = lowest_peak_in_depth(deep, model.recompute_flops(every), resolution=2**16)
    assert choice.optimal and choice.peak_bytes == model.peak(every) == floor + 1


def test_held_candidates_keep_their_decision_in_both_solves():
    """`fixed` (what `budget.descend` holds while it solves one class): the lowest-peak solve and the budget's solve
    answer only among choices that keep every held candidate's decision."""
    from graph_trainer.passes.remat_model import lowest_peak, solve

    model = _six_blocks()
    keys = candidate_keys(model.candidates, 4, 0)
    rng = random.Random(0)
    held = {c: rng.random() < 0.5 for c in model.candidates if keys[c][0] != "first"}
    for c in model.candidates:  # tied candidates (the two middle blocks of the short model) held alike
        if c in held and keys[c][0] == "mid":
            held[c] = keys[c][1] % 2 == 0
    lowest = lowest_peak(model, fixed=held, time_limit_s=30.0)
    assert lowest.optimal and {c: c in lowest.recompute for c in held} == held
    fitted = solve(model, lowest.peak_bytes, fixed=held, time_limit_s=30.0)
    assert fitted.recompute is not None and {c: c in fitted.recompute for c in held} == held
    assert fitted.peak_bytes <= lowest.peak_bytes


def test_the_descent_solves_each_class_with_the_others_held_until_a_round_improves_nothing():
    """`budget.descend`, which the 8B and 16B answers at selective AC's FLOPs come from (each class's solve there is
    HiGHS's, tested above; this is the loop): the class of the most blocks first, every other class held at the best
    choice so far, an improvement taken, and one more round after the last improvement, which proves each class's
    choice the best given the others'; with no time left it stops and says so."""
    from graph_trainer.passes.budget import DeepModel, descend
    from graph_trainer.passes.remat_model import Solution

    model = _six_blocks()
    deep = DeepModel(model, candidate_keys(model.candidates, 4, 0), 0, 6, 0)
    classes = {deep.keys[c][0] for c in model.candidates}
    calls = []
    target = {c for c in model.candidates if deep.keys[c][0] == "mid" and deep.keys[c][1] < 3}

    def resolve(fixed, seconds):
        free = classes - {deep.keys[c][0] for c in fixed}
        calls.append((free.pop(), {c for c, r in fixed.items() if r}))
        chosen = [c for c, r in fixed.items() if r] + (sorted(target, key=str) if calls[-1][0] == "mid" else [])
        return Solution(chosen, model.peak(chosen), model.recompute_flops(chosen), 0.1, "Optimal", True)

    def better(found, best):
        return found.peak_bytes < best.peak_bytes

    start = Solution([], model.peak([]), 0, 0.0, "nothing recomputed", True)
    best, note = descend(deep, start, resolve, better, 60.0)
    assert model.peak(target) < model.peak([])  # so the middle class's answer is an improvement
    assert set(best.recompute) == target and best.peak_bytes == model.peak(target)
    assert [cls for cls, _ in calls] == ["mid", "first", "last"] * 2
    # Every other class held at the best choice so far: the middle class's answer, once found.
    assert all(held == (set() if cls == "mid" else target) for cls, held in calls[1:]) and calls[0][1] == set()
    assert note == "by block class: 2 rounds, each class's choice proven the best given the others'"
    calls.clear()
    kept, note = descend(deep, start, resolve, better, 0.0)
    assert kept is not None and set(kept.recompute) == set() and calls == [] and note.endswith("time spent")


def test_an_unproven_deep_solve_is_lowered_class_by_class(monkeypatch):
    """`solve_in_depth`: where the whole solve stops unproven (the 8B at 0.80 of eager selective fell back to
    recomputing every candidate), its choice is lowered class by class, and the status says both."""
    import graph_trainer.passes.budget as budget
    from graph_trainer.job_config.schema import ActivationCheckpointConfig
    from graph_trainer.passes.budget import DeepModel
    from graph_trainer.passes.remat_model import Solution, solve

    model = _six_blocks()
    deep = DeepModel(model, candidate_keys(model.candidates, 4, 0), 0, 6, 0)
    every = list(model.candidates)

    def stopped_whole(m, budget_bytes, *, time_limit_s, fixed=None):
        if fixed is None:  # the whole solve: stopped with the fallback choice
            status = "Time limit reached; every candidate recomputed, the solver having found no choice"
            return Solution(every, m.peak(every), m.recompute_flops(every), 0.1, status)
        return solve(m, budget_bytes, time_limit_s=time_limit_s, fixed=fixed)

    monkeypatch.setattr(budget, "solve", stopped_whole)
    ac = ActivationCheckpointConfig(mode="budget", memory_budget=0.9)
    choice = budget.solve_in_depth(deep, ac)
    assert not choice.optimal and choice.peak_bytes <= choice.target_bytes
    assert choice.recompute_flops < model.recompute_flops(every), choice
    assert "every candidate recomputed" in choice.status and "by block class" in choice.status
