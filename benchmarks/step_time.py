"""Traced vs eager: step time, trace time and peak live memory, measured side by side in one run.

    python benchmarks/step_time.py [--configs debug deep] [--steps 10] [--warmup 2] [--save]

`--save` writes the table to benchmarks/results/step_time.json for docs/measurements.md (times: on an idle
machine; `--steps 5 --warmup 1` takes about 2 minutes on an idle 2-core CPU).

Prints per config: median step time of each mode (steps interleaved eager/traced),
the ratio traced/eager (target <= 1.00), the trace time (target <= 2 s on the debug
model), the exact peak live bytes of one step of each (ratio target <= 1.00), and
the cost of CPU memory tracking (a third, traced trainer with the tracker on).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results  # noqa: E402
from benchmarks.common import (  # noqa: E402
    CONFIG_LABELS,
    CONFIGS,
    interleaved_step_times,
    make_trainer,
    measured_peak,
    median,
)
from graph_trainer.observability.units import GIB  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/step_time.json")
    args = parser.parse_args()
    rows = []
    for name in args.configs:
        overrides = CONFIGS[name]
        trainers = {
            mode: make_trainer("llama3_debug", *overrides, "--compile.mode", mode.split("+")[0])
            for mode in ("eager", "trace", "trace+tracked")
        }
        times = interleaved_step_times(trainers, warmup=args.warmup, steps=args.steps, tracked=("trace+tracked",))
        peaks = {mode: measured_peak(trainers[mode])[0] for mode in ("eager", "trace")}
        eager_t, trace_t = median(times["eager"]), median(times["trace"])
        rows.append(
            (
                name,
                eager_t,
                trace_t,
                trace_t / eager_t,
                trainers["trace"].step_fn.stats.last_time_s,
                trainers["trace"].step_fn.stats.count,
                peaks["eager"],
                peaks["trace"],
                peaks["trace"] / peaks["eager"],
                median(times["trace+tracked"]) / trace_t,
            )
        )
    print(f"\nmedian of {args.steps} steps after {args.warmup} warm-up, eager and traced interleaved")
    print(
        f"{'config':8} {'eager s':>8} {'traced s':>9} {'ratio':>6} {'trace s':>8} {'traces':>6} "
        f"{'eager peak':>11} {'traced peak':>12} {'ratio':>6} {'tracking':>9}"
    )
    for name, e, t, r, tt, n, pe, pt, pr, tr in rows:
        print(
            f"{name:8} {e:8.3f} {t:9.3f} {r:6.3f} {tt:8.2f} {n:6d} {pe / GIB:9.3f}Gi {pt / GIB:10.3f}Gi {pr:6.3f} "
            f"{tr:8.3f}x"
        )
    if args.save:
        header = ["config", "eager s/step", "traced s/step", "traced/eager", "trace time", "traces"]
        header += ["peak traced/eager", "CPU tracking cost"]
        table = results.markdown_table(
            header,
            [
                [CONFIG_LABELS[name], f"{e:.3f}", f"{t:.3f}", f"{r:.3f}", f"{tt:.2f} s", n, f"{pr:.3f}", f"{tr:.3f}x"]
                for name, e, t, r, tt, n, pe, pt, pr, tr in rows
            ],
        )
        data = {"steps": args.steps, "warmup": args.warmup, "rows": rows}
        results.save("step_time", {"step_time": table}, data)


if __name__ == "__main__":
    main()
