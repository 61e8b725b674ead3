"""The memory budget's frontier, for people to look at: the whole step's peak against the recompute FLOPs it costs.

`--dry-run --activation_checkpoint.mode budget` asks the budget policy (`passes/budget.py`, an exact MILP) for its
answer at evenly spread budgets, from the lowest peak a save-or-recompute choice reaches (the lowest found within
the solve limit, on a deep graph) to the peak with nothing recomputed, prints each as it is solved, and writes them
to the dump folder: `budget_frontier.json`, and `budget_frontier.png` when matplotlib is installed (the `plots`
extra).

The points are the policy's own answers on the model the pass's choice comes from when the job runs, so a budget
from the table gives that row's plan: on a deep model, the per-class model extended from its 3- and 4-block steps
(`passes/budget_depth.py`; two short traces, whatever the depth), else the whole step. Each point is one solve of
at most `SOLVE_S` seconds, a point stopped there shown with its gap.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path

from graph_trainer import stages
from graph_trainer.builder import build_job
from graph_trainer.distributed.mesh import Mesh
from graph_trainer.job_config.batching import accumulation_steps
from graph_trainer.job_config.load import resolve_model_args
from graph_trainer.job_config.schema import JobConfig
from graph_trainer.observability.log import get_logger, quiet
from graph_trainer.observability.memory_timeline import PLOTS_HINT
from graph_trainer.observability.units import to_gib
from graph_trainer.passes import CLEAN_UP, fsdp_policy_of, fsdp_prefetch_of
from graph_trainer.passes.budget import FrontierPoint, budget_frontier, model_frontier
from graph_trainer.passes.budget_depth import NotExtendable
from graph_trainer.plan.block_plan import deep_budget_model, short_depths
from graph_trainer.plan.step_plan import meta_batch

logger = get_logger(__name__)

POINTS = 10  # budgets on the frontier, from the lowest peak to no AC
# Seconds each of its solves may take (the pass's own limit is 60 s): the frontier is a picture, so a point near
# the low end, the hardest to prove, is shown with the best choice found and its gap rather than waited for.
SOLVE_S = 10.0
JSON_NAME, PICTURE_NAME = "budget_frontier.json", "budget_frontier.png"
HEADER = (
    f"{'budget GiB':>10} {'fraction':>9} {'peak GiB':>9} {'recompute GFLOP':>16} {'recomputed':>11} "
    f"{'proof':>13} {'solve s':>8}"
)


def frontier_row(point: FrontierPoint) -> str:
    """One printed row: the budget (as a size and as `memory_budget`'s fraction), the plan's peak and its cost."""
    proof = "optimal" if point.optimal else f"gap={point.gap:.2%}" if point.gap is not None else "unproven"
    return (
        f"{to_gib(point.budget_bytes):10.4f} {point.fraction:9.3f} {to_gib(point.peak_bytes):9.4f} "
        f"{point.recompute_flops / 1e9:16.3f} {f'{point.recomputed}/{point.candidates}':>11} {proof:>13} "
        f"{point.solve_s:8.1f}"
    )


def depth_free(cfg: JobConfig) -> bool:
    """Whether `cfg`'s frontier is solved on the per-class model from short traces (a deep model, one graph a step)."""
    return resolve_model_args(cfg).n_layers > short_depths(cfg)[-1] and accumulation_steps(cfg) == 1


def plan_frontier(
    cfg: JobConfig, mesh: Mesh, *, points: int = POINTS, on_point: Callable[[FrontierPoint], None] | None = None
) -> list[FrontierPoint]:
    """The frontier of `cfg`'s step on `mesh`: `points` budgets from the lowest peak to no AC, each answered as the
    budget pass would answer it (module docstring). Short models that do not extend in depth are said in one line
    and the whole step is solved instead."""
    if depth_free(cfg):
        try:
            with quiet():
                deep = deep_budget_model(cfg, mesh)
            return model_frontier(
                deep.model, deep.input_bytes, deep.model.peak([]), points=points, on_point=on_point,
                time_limit_s=SOLVE_S, count=deep.count, outside=deep.outside,
            )  # fmt: skip
        except NotExtendable as e:
            logger.warning(f"budget frontier: solved on every block instead (the short steps do not extend: {e})")
    job = build_job(cfg, mesh, materialize=False)
    with quiet():  # the trace and clean-up log nothing the frontier's rows do not say
        traced = stages.trace(job, meta_batch(cfg))
        clean = stages.transform(job, traced, until=CLEAN_UP).traced
    found = budget_frontier(
        clean.gm,
        cfg.activation_checkpoint,
        input_categories=clean.layout.categories,
        points=points,
        on_point=on_point,
        time_limit_s=SOLVE_S,
        fsdp_policy=fsdp_policy_of(cfg),
        gathers_prefetched=fsdp_prefetch_of(cfg),
        eager_update=job.eager_update(),
    )
    return found


def write_frontier(folder: Path, found: list[FrontierPoint], *, title: str) -> list[str]:
    """Write `JSON_NAME` (and `PICTURE_NAME` when matplotlib is there) into `folder`; the lines that say what was
    written, or why the picture was not."""
    folder.mkdir(parents=True, exist_ok=True)
    data = {
        "title": title,
        "written": time.strftime("%Y-%m-%d %H:%M:%S"),
        "points": [dataclasses.asdict(p) for p in found],
    }
    (folder / JSON_NAME).write_text(json.dumps(data, indent=2) + "\n")
    lines = [f"frontier written to {folder / JSON_NAME}"]
    try:
        from matplotlib.figure import Figure  # the object API: no pyplot, no display, no global backend state
    except ImportError:
        return [*lines, f"frontier picture not drawn: matplotlib is not installed; {PLOTS_HINT}"]
    fig = Figure(figsize=(7, 4.5))
    ax = fig.add_subplot()
    peaks, gflop = [to_gib(p.peak_bytes) for p in found], [p.recompute_flops / 1e9 for p in found]
    ax.step(peaks, gflop, where="post", c="C0", label="budget policy: fewest recompute FLOPs at each peak")
    proven = [i for i, p in enumerate(found) if p.optimal]
    stopped = [i for i, p in enumerate(found) if not p.optimal]
    ax.scatter([peaks[i] for i in proven], [gflop[i] for i in proven], c="C0", label="proven optimal")
    ax.scatter([peaks[i] for i in stopped], [gflop[i] for i in stopped], facecolors="none", edgecolors="C0",
               label=f"best found in {SOLVE_S:g} s (not proven)")  # fmt: skip
    ax.set_xlabel("whole step's peak (GiB)")
    ax.set_ylabel("recompute GFLOP per step")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder / PICTURE_NAME, dpi=120)
    return [*lines, f"frontier picture drawn to {folder / PICTURE_NAME}"]


__all__ = [
    "HEADER",
    "JSON_NAME",
    "PICTURE_NAME",
    "POINTS",
    "depth_free",
    "frontier_row",
    "plan_frontier",
    "write_frontier",
]
