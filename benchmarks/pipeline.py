"""Pipeline parallelism on this CPU: step time of pp 2 under each schedule against one process, and the bubble.

    python -m benchmarks.pipeline [--steps 6] [--layers 8] [--out outputs/bench_pipeline] [--save]

Every run is a real CLI run (torchrun for pp 2, gloo on CPU) of the debug model with `--layers` blocks, the same
global batch of 8 sequences of 256 tokens: one process on the whole batch, one process accumulating 8
micro-batches of 1 (what every pp run equals bitwise), and pp 2 cutting the local batch into 8 micro-batches of
1 under GPipe, 1F1B, Interleaved1F1B, InterleavedZeroBubble (2 stages a rank) and ZBVZeroBubble, and 1F1B with
eager stages (`--compile.mode eager`: the model's own modules under the same schedule). Step time is
the median over the steps after the first (which traces), rank 0's peak the largest over them beside its plan
(the graph's estimate in one process, the stage's preflight plan under pp). The bubble is the trainer's
`pp_bubble_pct`: the share of the schedule's time the more idle rank spent outside its stages' graphs, median over
the same steps; the model beside it is the classic one, (pp - 1) / (v x m + pp - 1) for m micro-batches and v
stages a rank, stages of equal time and free communication (for the zero-bubble schedules an upper bound: their
deferred weight gradients fill part of it).
`--save` writes benchmarks/results/pipeline.json for docs/pipeline.md (times: on an idle machine; about 3
minutes on an idle 2-core CPU).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks import results
from graph_trainer.distributed.launch import trainer_command

REPO = Path(__file__).resolve().parents[1]
GLOBAL, SEQ, PP = 8, 256, 2
COMMON = ["--config", "llama3_debug", "--training.seq_len", str(SEQ), "--metrics.enable_tensorboard", "false"]


def run(out: Path, name: str, ranks: int, options: list[str], steps: int, layers: int) -> dict:
    """One CLI run; rank 0's summary.json."""
    folder = out / name
    args = [*COMMON, "--model.n_layers", str(layers), "--training.steps", str(steps), *options]
    args += ["--job.dump_folder", str(folder), "--job.overwrite", "true"]
    cmd = [*trainer_command(ranks), *args] if ranks > 1 else [sys.executable, "-m", "graph_trainer", *args]
    env = dict(os.environ, OMP_NUM_THREADS=str(2 // ranks), PYTHONPATH=str(REPO))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    return json.loads((folder / "summary.json").read_text())


def arguments(doc: str, name: str) -> tuple[argparse.Namespace, list[str]]:
    """(the command line of a pipeline benchmark whose docstring is `doc` and results file `name`, the pp 2 options
    every run of it shares: the local batch in micro-batches of one sequence)."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / f"bench_{name}")
    parser.add_argument("--save", action="store_true", help=f"write benchmarks/results/{name}.json")
    pipeline = ["--training.local_batch_size", str(GLOBAL), "--parallelism.pp", str(PP)]
    return parser.parse_args(), [*pipeline, "--parallelism.pp_microbatch_size", "1"]


def main() -> None:
    a, pipeline = arguments(__doc__, "pipeline")
    runs = [
        ("one process, whole batch", 1, ["--training.local_batch_size", str(GLOBAL)], 1),
        (
            "one process, 8 x 1 accumulated",
            1,
            ["--training.local_batch_size", "1", "--training.global_batch_size", str(GLOBAL)],
            1,
        ),  # fmt: skip
        ("pp 2, GPipe", PP, [*pipeline, "--parallelism.pp_schedule", "GPipe"], 1),
        ("pp 2, 1F1B", PP, [*pipeline, "--parallelism.pp_schedule", "1F1B"], 1),
        ("pp 2, Interleaved1F1B (2 a rank)", PP, [*pipeline, "--parallelism.pp_schedule", "Interleaved1F1B"], 2),
        ("pp 2, InterleavedZeroBubble (2 a rank)", PP, [*pipeline, "--parallelism.pp_schedule",
                                                       "InterleavedZeroBubble"], 2),
        ("pp 2, ZBVZeroBubble (a V)", PP, [*pipeline, "--parallelism.pp_schedule", "ZBVZeroBubble"], 2),
        ("pp 2, 1F1B, eager stages", PP, [*pipeline, "--parallelism.pp_schedule", "1F1B", "--compile.mode", "eager"],
         1),
    ]  # fmt: skip
    rows = []
    for name, ranks, options, per_rank in runs:
        summary = run(a.out, name.split(",")[0].replace(" ", "_") + f"_{len(rows)}", ranks, options, a.steps, a.layers)
        steps = summary["steps"][1:]
        step_s = statistics.median(s["step_time_s"] for s in steps)
        # Eager stages measure no bubble (autograd gives an eager stage's backward no end to time).
        bubble = statistics.median(s["pp_bubble_pct"] for s in steps) if "pp_bubble_pct" in steps[0] else None
        model = 100 * (PP - 1) / (per_rank * GLOBAL + PP - 1) if bubble is not None else None
        # After the first step, which traces and (under pp) makes torch's buffers and prunes the others' state.
        peak = max(s["peak_active_bytes"] for s in steps)
        planned = max(s["estimated_peak_bytes"] for s in steps)  # the step's own estimate, or the stage's plan
        losses = [s["loss"] for s in summary["steps"]]
        rows.append((name, step_s, bubble, model, peak, planned, losses))
    base = rows[1][1]
    header = ["run", "step s", "vs one process accumulating", "bubble % measured", "bubble % model",
              "rank 0 peak MiB", "rank 0 planned MiB"]  # fmt: skip
    table = []
    for name, step_s, bubble, model, peak, planned, _ in rows:
        cells = [name, f"{step_s:.3f}", f"{step_s / base:.2f}"]
        cells += [f"{bubble:.1f}" if bubble is not None else "", f"{model:.1f}" if model is not None else ""]
        table.append([*cells, f"{peak / 2**20:.3f}", f"{planned / 2**20:.3f}"])
        print(" | ".join(table[-1]))
    same = all(r[6] == rows[1][6] for r in rows[2:])
    print(f"every pp run's losses equal to one process accumulating: {same}")
    if a.save:
        data = {"steps": a.steps, "layers": a.layers, "losses_equal_to_accumulation": same}
        data["rows"] = {
            name: {"step_s": s, "bubble_pct": b, "model_pct": m, "peak_bytes": p, "planned_bytes": e, "losses": losses}
            for name, s, b, m, p, e, losses in rows
        }
        results.save("pipeline", {"pipeline": results.markdown_table(header, table)}, data)


if __name__ == "__main__":
    main()
