"""The memory budget under pipeline parallelism on this CPU: each rank's peak and the step time of pp 2 at several
budgets, beside the fixed AC modes, measured side by side in one run.

    python -m benchmarks.pipeline_budget [--steps 6] [--layers 8] [--out outputs/bench_pipeline_budget] [--save]

Every run is a real torchrun run (gloo, 2 ranks) of the debug model with `--layers` blocks, pp 2 under 1F1B, a
local batch of 8 sequences of 256 tokens in 8 micro-batches of 1 (`benchmarks.pipeline`'s runs), under AC none,
selective and full, and `budget` at the fractions in `FRACTIONS`: every stage applies one process's choice at a
micro-batch (`plan.stage_plan.pipeline_budget_choice`, solved again here for its candidate and FLOP counts). Step
time is the median over the steps after the first (which traces); rank 0's peak is the largest measured over them
beside its preflight's plan (rank 0 holds 2 micro-batches in flight under 1F1B, rank 1 one: rank 0 peaks higher).
Every run's losses are compared with the none run's, which they equal bitwise (remat recomputes the same ops).
`--save` writes benchmarks/results/pipeline_budget.json for docs/pipeline.md (times: on an idle machine; about 5
minutes on an idle 2-core CPU).
"""

from __future__ import annotations

import statistics

import torch

from benchmarks import results
from benchmarks.pipeline import PP, SEQ, arguments, run
from graph_trainer.job_config.cli import load_config
from graph_trainer.plan.stage_plan import budget_choice

# From the no-AC peak down to near the smallest the debug model's micro-batch of one 256-token sequence reaches
# (0.613: a lower fraction is refused naming it).
FRACTIONS = ("0.9", "0.75", "0.65")


def main() -> None:
    a, pipeline = arguments(__doc__, "pipeline_budget")
    pipeline += ["--parallelism.pp_schedule", "1F1B"]
    modes = [(m, ["--activation_checkpoint.mode", m]) for m in ("none", "selective", "full")]
    modes += [
        (f"budget {f}", ["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", f])
        for f in FRACTIONS
    ]
    rows = []
    for name, options in modes:
        summary = run(a.out, name.replace(" ", "_"), PP, [*pipeline, *options], a.steps, a.layers)
        steps = summary["steps"][1:]
        choice = None
        if name.startswith("budget"):
            cfg, _ = load_config(["--config", "llama3_debug", "--training.seq_len", str(SEQ), "--model.n_layers",
                                  str(a.layers), *pipeline, *options])  # fmt: skip
            choice = budget_choice(cfg, torch.device("cpu"))
        rows.append(
            {
                "name": name,
                "step_s": statistics.median(s["step_time_s"] for s in steps),
                "peak_bytes": max(s["peak_active_bytes"] for s in steps),
                "planned_bytes": max(s["estimated_peak_bytes"] for s in steps),
                "losses": [s["loss"] for s in summary["steps"]],
                "recomputed": None if choice is None else f"{choice.recomputed}/{choice.candidates}",
                "recompute_gflop": None if choice is None else choice.recompute_flops / 1e9,
                "optimal": None if choice is None else choice.optimal,
            }
        )
    base = rows[0]
    header = ["AC at pp 2, 1F1B", "candidates recomputed", "recompute GFLOP a micro-batch", "step s", "vs none",
              "rank 0 peak MiB", "rank 0 planned MiB", "vs none"]  # fmt: skip
    table = []
    for r in rows:
        flops = "" if r["recompute_gflop"] is None else f"{r['recompute_gflop']:.3f}"
        cells = [r["name"], r["recomputed"] or "", flops, f"{r['step_s']:.3f}", f"{r['step_s'] / base['step_s']:.2f}"]
        cells += [f"{r['peak_bytes'] / 2**20:.3f}", f"{r['planned_bytes'] / 2**20:.3f}"]
        table.append([*cells, f"{r['peak_bytes'] / base['peak_bytes']:.3f}"])
        print(" | ".join(table[-1]))
    same = all(r["losses"] == base["losses"] for r in rows)
    planned = all(r["peak_bytes"] == r["planned_bytes"] for r in rows)
    print(
        f"every run's losses equal to the none run's: {same}; rank 0's peak equal to its plan in every run: {planned}"
    )
    if a.save:
        data = {"steps": a.steps, "layers": a.layers, "losses_equal": same, "peaks_planned": planned, "rows": rows}
        results.save("pipeline_budget", {"pipeline_budget": results.markdown_table(header, table)}, data)


if __name__ == "__main__":
    main()
