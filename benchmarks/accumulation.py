"""Gradient accumulation: memory and trace time against the number of micro-batches.

    python benchmarks/accumulation.py [--micro 1 2 4 8] [--local-batch 4] [--seq-len 256] [--save]

For each number of micro-batches k it builds a traced trainer of the debug model with micro-batches of
`--local-batch` sequences (`training.global_batch_size` = local x k) and prints: the planner's time (trace and
passes of every graph of the step, on fake tensors), the traces the run made and their time, the step's
estimated peak against the exact CPU peak of one step (live-tensor tracker), the eager accumulated step's peak,
and the peak of ONE step on the whole batch (local x k sequences, no accumulation) for comparison.

The last columns are the other shape considered: every micro-batch in ONE graph (forward and loss of each, one
backward of their sum, traced on fake tensors with the same passes): its trace time, op count and estimated peak.
`--save` writes the table to benchmarks/results/accumulation.json for docs/gradient_accumulation.md (its plan and
trace seconds are times: on an idle machine; `--micro 1 2 4 8` takes about 5 minutes on an idle 2-core CPU).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results  # noqa: E402
from benchmarks.common import make_trainer, measured_peak  # noqa: E402
from graph_trainer.builder import adamw_implementation_for, build_job  # noqa: E402
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh  # noqa: E402
from graph_trainer.job_config.cli import load_config  # noqa: E402
from graph_trainer.observability.log import quiet  # noqa: E402
from graph_trainer.observability.units import MIB  # noqa: E402
from graph_trainer.optimizer.update_memory import EagerUpdate, whole_step_peak  # noqa: E402
from graph_trainer.passes import build_pipeline  # noqa: E402
from graph_trainer.plan.step_plan import plan_config  # noqa: E402
from graph_trainer.runtime.device import resolve_device  # noqa: E402
from graph_trainer.step import micro_batches, sum_losses  # noqa: E402
from graph_trainer.tracer.executor import GraphStep  # noqa: E402


def _overrides(local: int, seq_len: int, micro: int) -> list[str]:
    return ["--training.local_batch_size", str(local), "--training.seq_len", str(seq_len)] + [
        "--training.global_batch_size",
        str(local * micro),
    ]


def unrolled(cfg, micro: int) -> tuple[float, int, int]:
    """(trace s, ops, estimated peak bytes) of every micro-batch in one graph: the losses summed, one backward."""
    device = resolve_device(cfg.training.device)
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), device) as mesh, quiet():
        job = build_job(cfg, mesh, materialize=False)

        def loss_fn(model, batch):
            return sum_losses([job.loss_fn(model, m) for m in micro_batches(batch, micro)])

        step = GraphStep(job.model, loss_fn=loss_fn, transform=build_pipeline(cfg, dump_dir=None), device=device)
        rows = cfg.training.local_batch_size * micro
        batch = {
            k: torch.zeros(rows, cfg.training.seq_len, dtype=torch.long, device="meta") for k in ("input", "labels")
        }
        step.ensure_traced(batch)
        # As the trainer's report: the eager AdamW update's state and scratch on top of the graph's peak.
        update = EagerUpdate.of(job.optimizer, adamw_implementation_for(cfg, device), device)
        peak = whole_step_peak(step.memory_estimate, update)[0]
        return step.stats.last_time_s, len(step.traced.gm.graph.nodes), peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--local-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/accumulation.json")
    args = parser.parse_args()
    rows = []
    print(
        f"{'k':>3} {'plan s':>7} {'traces':>6} {'trace s':>8} {'est MiB':>8} {'meas MiB':>9} {'est/meas':>8} "
        f"{'eager MiB':>10} {'big batch MiB':>14} {'1-graph trace s':>16} {'1-graph ops':>12} {'1-graph est MiB':>16}"
    )
    for k in args.micro:
        accumulated = _overrides(args.local_batch, args.seq_len, k)
        cfg, _ = load_config(["--config", "llama3_debug", *accumulated])
        start = time.perf_counter()
        plan_config(cfg)
        plan_s = time.perf_counter() - start
        traced = make_trainer("llama3_debug", *accumulated)
        peak, record = measured_peak(traced)
        eager_peak, _ = measured_peak(make_trainer("llama3_debug", *accumulated, "--compile.mode", "eager"))
        big_peak, _ = measured_peak(make_trainer("llama3_debug", *_overrides(args.local_batch * k, args.seq_len, 1)))
        one_s, one_ops, one_peak = unrolled(
            load_config(["--config", "llama3_debug", *_overrides(args.local_batch, args.seq_len, 1)])[0], k
        )
        est = record["estimated_peak_bytes"]
        print(
            f"{k:3d} {plan_s:7.2f} {record['trace_count']:6d} {record['trace_time_s']:8.2f} "
            f"{est / MIB:8.2f} {peak / MIB:9.2f} {est / peak:8.3f} "
            f"{eager_peak / MIB:10.2f} {big_peak / MIB:14.2f} {one_s:16.2f} {one_ops:12d} {one_peak / MIB:16.2f}"
        )
        rows.append(
            [
                k,
                f"{plan_s:.1f}",
                record["trace_count"],
                f"{est / MIB:.2f}",
                f"{peak / MIB:.2f}",
                f"{eager_peak / MIB:.2f}",
            ]
            + [f"{big_peak / MIB:.2f}", f"{one_s:.1f}", one_ops, f"{one_peak / MIB:.2f}"]
        )
    if args.save:
        header = ["micro-batches k", "plan s", "traces", "estimated peak MiB", "measured peak MiB"]
        header += ["eager accumulation MiB", f"one batch of {args.local_batch}k x {args.seq_len}, MiB"]
        header += ["all k in one graph: trace s", "ops", "est. peak MiB"]
        results.save("accumulation", {"accumulation": results.markdown_table(header, rows)}, {"rows": rows})


if __name__ == "__main__":
    main()
