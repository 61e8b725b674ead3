"""What the exact `budget` policy costs to solve, against depth and the number of ops, measured in one run.

    python -m benchmarks.budget_policy [--config llama3_debug] [--blocks 1 2 4 6]

For each depth, the debug model's step is traced on the meta device and cleaned up; the save-or-recompute model
(graph_trainer/passes/remat_model.py) is built once and solved by HiGHS at four budgets, 0%, 5%, 10% and 25% of the
way from the peak with every candidate recomputed to the no-AC peak. Each solution's peak is re-evaluated
exactly (it fits its budget by construction; the run asserts it) and the solver's status says whether it proved
optimality (`remat_model.NODE_LIMIT` nodes, 60 s at most). Times are wall seconds on this machine, idle.
Writes benchmarks/results/budget_policy.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks.results import markdown_table, save  # noqa: E402
from graph_trainer import stages  # noqa: E402
from graph_trainer.builder import build_job  # noqa: E402
from graph_trainer.distributed.mesh import Mesh, ParallelDims  # noqa: E402
from graph_trainer.job_config.cli import load_config  # noqa: E402
from graph_trainer.passes import CLEAN_UP  # noqa: E402
from graph_trainer.passes.activation_checkpoint import analyze  # noqa: E402
from graph_trainer.passes.budget import backward_storages, choices  # noqa: E402
from graph_trainer.passes.remat_model import build_model, solve  # noqa: E402
from graph_trainer.plan.step_plan import meta_batch  # noqa: E402

# Where each budget sits between the peak with every candidate recomputed (0) and the no-AC peak (1): above about
# a third of the way, recomputing elementwise ops alone (no FLOPs by torch's count) fits the debug model.
SHARES = (0.0, 0.05, 0.1, 0.25)


def measure(config: str, blocks: int) -> dict:
    """One depth's figures: graph and model sizes, build time, and per budget the solve time and result."""
    cfg, _ = load_config(["--config", config, "--model.n_layers", str(blocks)])
    job = build_job(cfg, Mesh(ParallelDims(), 0, torch.device("cpu")), materialize=False)
    traced = stages.trace(job, meta_batch(job.cfg))
    gm = stages.transform(job, traced, until=CLEAN_UP).traced.gm
    structure = analyze(gm)
    candidates, free = choices(structure, set(), backward_storages(gm))
    start = time.perf_counter()
    model = build_model(gm, candidates, free, set(), traced.layout.categories)
    build_s = time.perf_counter() - start
    lowest, highest = model.peak(candidates), model.peak([])
    solves = []
    for share in SHARES:
        budget = lowest + share * (highest - lowest)
        solution = solve(model, budget)
        assert solution.recompute is not None and solution.peak_bytes <= budget, (blocks, share)
        solves.append({"share": share, "budget_bytes": budget, "peak_bytes": solution.peak_bytes,
                       "recompute_flops": solution.recompute_flops, "solve_s": solution.solve_s,
                       "optimal": solution.optimal, "gap": solution.gap, "status": solution.status})  # fmt: skip
    return {
        "blocks": blocks,
        "ops": len(gm.graph.nodes),
        "candidates": len(candidates),
        "variables": model.n_vars,
        "rows": len(model.lower) + len(model.upper) + len(model.memory),
        "build_s": build_s,
        "solves": solves,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama3_debug")
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 2, 4, 6])
    args = parser.parse_args()
    results = [measure(args.config, blocks) for blocks in args.blocks]
    rows = []
    for r in results:
        times = [s["solve_s"] for s in r["solves"]]
        proven = sum(s["optimal"] for s in r["solves"])
        gflop = " / ".join(f"{s['recompute_flops'] / 1e9:.1f}" for s in r["solves"])
        gaps = [s["gap"] for s in r["solves"]]
        gap = "no bound" if None in gaps else f"{max(gaps):.2%}"  # none: stopped before any choice was found
        rows.append((r["blocks"], r["ops"], r["candidates"], r["variables"], r["rows"], f"{r['build_s']:.2f}",
                     f"{statistics.median(times):.1f}", f"{max(times):.1f}", f"{proven}/{len(times)}",
                     gap, gflop))  # fmt: skip
    shares = " / ".join(f"{s:.0%}" for s in SHARES)
    header = ("blocks", "ops", "choices", "variables", "rows", "build s", "solve s (median)", "solve s (max)",
              "proven optimal", "largest gap", f"recompute GFLOP at {shares}")  # fmt: skip
    table = markdown_table(header, rows)
    print(f"{args.config}: the budget policy's model and solve, budgets at {SHARES} of the way to the no-AC peak")
    print(table)
    save("budget_policy", {"solve_time": table}, {"config": args.config, "results": results})


if __name__ == "__main__":
    main()
