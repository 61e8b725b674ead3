"""What the staleness guard costs per step, against a traced step of the debug model, measured in one run.

    python -m benchmarks.guard_overhead [--steps 20] [--warmup 3] [--reps 20000]

Before each step `GraphStep` checks that its graph still fits: the batch signature, and the trace's guard
(the module attributes the traced code read, the global state, the trainable parameters, the model's tensors; see
graph_trainer/tracer/guards.py). The check runs `--reps` times in a loop (timeit, best of 5) and is divided by
the median traced step of the same trainer, timed between the same runs. Run it on an idle machine: the ratio
is the figure (the issue's "costs nothing measurable per step"). Writes benchmarks/results/guard_overhead.json.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.common import make_trainer, median, next_batch  # noqa: E402
from benchmarks.results import markdown_table, save  # noqa: E402
from graph_trainer.tracer.capture import batch_signature  # noqa: E402
from graph_trainer.tracer.executor import stale_reason  # noqa: E402


def whole_check(step, traced, batch) -> str | None:
    """What `GraphStep.ensure_traced` checks before a step: the live tensors, the batch signature, the guard."""
    trainable, tensors = step.live_tensors()
    return stale_reason(traced, batch_signature(batch), trainable, tensors=tensors)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama3_debug")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=20000)
    args = parser.parse_args()
    trainer = make_trainer(args.config, "--compile.mode", "trace")
    trainer.memory.track = False  # its dispatch overhead is not the step's
    step = trainer.step_fn
    batch = next_batch(trainer)
    times = [trainer.train_step(next_batch(trainer))["step_time_s"] for _ in range(args.warmup + args.steps)]
    step_s = median(times[args.warmup :])
    traced = step.traced
    checks = {
        # The guard alone: the attributes the trace read, the global state, the trainable names, and the model's
        # tensors (read live: which objects, their dtypes and shapes).
        "guard (attributes, global state, trainable set, tensors)": lambda: traced.guard.stale(*step.live_tensors()),
        # Everything GraphStep checks before a step: the batch signature too.
        "whole check (batch signature + guard)": lambda: whole_check(step, traced, batch),
    }
    assert all(check() is None for check in checks.values()), "the graph is stale: nothing to time"
    rows, data = [], {"step_s": step_s, "guarded_attributes": len(traced.guard.names), "checks": {}}
    for name, check in checks.items():
        per_call = min(timeit.repeat(check, number=args.reps, repeat=5)) / args.reps
        data["checks"][name] = per_call
        rows.append((name, f"{per_call * 1e6:.1f}", f"{step_s * 1e3:.1f}", f"{100 * per_call / step_s:.3f}%"))
    table = markdown_table(("check before each step", "µs per step", "traced step (ms)", "share of the step"), rows)
    print(f"{args.config}: {len(traced.guard.names)} module attributes guarded, trace count {step.stats.count}")
    print(table)
    save("guard_overhead", {"overhead": table}, data)


if __name__ == "__main__":
    main()
