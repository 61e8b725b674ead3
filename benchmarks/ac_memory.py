"""Graph activation checkpointing vs eager torch.utils.checkpoint: peak memory and step-time cost in one run.

    python benchmarks/ac_memory.py [--configs debug deep] [--steps 5] [--warmup 1] [--save]

For each AC mode (none, selective, full) it builds a traced and an eager trainer
with the same policy and prints: the exact CPU peak of each (one step with the
live-tensor tracker), their ratio traced/eager (targets: none <= 1.00, selective
and full <= 0.90), the static estimate over the measured traced peak (1.000 on
CPU), and each traced mode's median step time relative to traced none. `--save` writes the table to
benchmarks/results/ac_memory.json for docs/measurements.md (its last column is a time: on an idle machine;
`--steps 3` takes about 2 minutes on an idle 2-core CPU).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results  # noqa: E402
from benchmarks.common import CONFIGS, interleaved_step_times, make_trainer, measured_peak, median  # noqa: E402
from graph_trainer.observability.units import GIB  # noqa: E402

MODES = ("none", "selective", "full")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/ac_memory.json")
    args = parser.parse_args()
    lines, rows = [], []
    for name in args.configs:
        trainers = {
            (compile_mode, ac): make_trainer(
                "llama3_debug", *CONFIGS[name], "--compile.mode", compile_mode, "--activation_checkpoint.mode", ac
            )
            for ac in MODES
            for compile_mode in ("trace", "eager")
        }
        times = interleaved_step_times(trainers, warmup=args.warmup, steps=args.steps)
        base_time = median(times[("trace", "none")])
        lines.append(f"\n{name}: median of {args.steps} steps after {args.warmup} warm-up, all six interleaved")
        lines.append(
            f"{'ac mode':10} {'traced peak':>12} {'eager peak':>11} {'ratio':>6} {'est/meas':>9} "
            f"{'traced s':>9} {'vs none':>8} {'eager s':>8}"
        )
        for ac in MODES:
            traced_peak, record = measured_peak(trainers[("trace", ac)])
            eager_peak, _ = measured_peak(trainers[("eager", ac)])
            traced_time = median(times[("trace", ac)])
            lines.append(
                f"{ac:10} {traced_peak / GIB:10.3f}Gi {eager_peak / GIB:9.3f}Gi {traced_peak / eager_peak:6.3f} "
                f"{record['estimated_peak_bytes'] / traced_peak:9.3f} {traced_time:9.3f} "
                f"{traced_time / base_time:8.2f} {median(times[('eager', ac)]):8.3f}"
            )
            rows.append(
                [
                    name,
                    ac,
                    f"{traced_peak / GIB:.3f} GiB",
                    f"{eager_peak / GIB:.3f} GiB",
                    f"{traced_peak / eager_peak:.3f}",
                ]
                + [f"{record['estimated_peak_bytes'] / traced_peak:.3f}", f"{traced_time / base_time:.2f}"]
            )
    print("\n".join(lines))
    if args.save:
        header = ["config", "mode", "traced peak", "eager peak", "traced/eager", "estimate/measured"]
        table = results.markdown_table([*header, "traced step vs none"], rows)
        results.save("ac_memory", {"ac_memory": table}, {"steps": args.steps, "warmup": args.warmup, "rows": rows})


if __name__ == "__main__":
    main()
