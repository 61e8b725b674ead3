"""`--dry-run --activation_checkpoint.mode budget` prints the budget policy's frontier (peak against recompute FLOPs,
10 budgets from the lowest reachable peak to no AC) and writes it to the dump folder, as numbers and as a picture."""

from __future__ import annotations

import itertools
import json

import pytest

from graph_trainer.job_config.cli import load_config
from graph_trainer.plan.budget_frontier import HEADER, JSON_NAME, PICTURE_NAME
from graph_trainer.plan.dry_run import dry_run

# 6 blocks of the debug model's widths, a short sequence: the frontier is solved per block class, on the per-class
# model extended from the 3- and 4-block steps to the real depth (passes/budget_depth.py).
SIX_BUDGET = ["--config", "llama3_debug", "--model.n_layers", "6", "--training.seq_len", "64",
              "--training.local_batch_size", "4", "--activation_checkpoint.mode", "budget"]  # fmt: skip


# The frontier's solves stopped at 2 s instead of the dry run's 10: this test holds what the dry run prints, writes
# and draws, and the frontier's shape, which hold for whichever choices the solver returns in its time (a point
# stopped early keeps a smaller budget's choice, so the FLOPs never rise). 116 s alone at 10 s a solve, mostly spent
# proving the fewest re-run elements among 0-FLOP choices. The points' optimality is held on one block, with the
# solver's own limit, by tests/passes/test_remat_model.py's frontier test.
FRONTIER_SOLVE_S = 2.0


@pytest.mark.integration
@pytest.mark.usefixtures("short_solves")  # the budget row's own solve
def test_the_dry_run_prints_and_writes_the_frontier_of_a_deep_model(tmp_path, monkeypatch):
    from graph_trainer.plan import budget_frontier

    monkeypatch.setattr(budget_frontier, "SOLVE_S", FRONTIER_SOLVE_S)
    cfg, _ = load_config([*SIX_BUDGET, "--job.dump_folder", str(tmp_path)])
    lines: list[str] = []
    dry_run(cfg, print_fn=lines.append)
    text = "\n".join(lines)
    assert "solved on the 3 + 4-block traces extended to 6 blocks" in text
    assert f"one solve of at most {FRONTIER_SOLVE_S:g} s a point" in text
    rows = lines[lines.index(HEADER) + 1 : lines.index(HEADER) + 11]
    assert len(rows) == 10 and all(len(r.split()) == 7 for r in rows), text
    saved = json.loads((tmp_path / JSON_NAME).read_text())
    points = saved["points"]
    assert [round(p["recompute_flops"] / 1e9, 3) for p in points] == [float(r.split()[3]) for r in rows]
    assert points[-1]["recompute_flops"] == 0 and points[0]["peak_bytes"] < points[-1]["peak_bytes"]
    assert all(p["peak_bytes"] <= p["budget_bytes"] for p in points)
    assert all(a["recompute_flops"] >= b["recompute_flops"] for a, b in itertools.pairwise(points))
    # Counted at the real depth: 6 blocks' candidates, not the 4-block model's.
    per_block = points[0]["candidates"] / 6
    assert per_block == int(per_block) and per_block > 0
    assert (tmp_path / PICTURE_NAME).stat().st_size > 10_000  # a drawn picture, not an empty file
    assert f"frontier picture drawn to {tmp_path / PICTURE_NAME}" in text
