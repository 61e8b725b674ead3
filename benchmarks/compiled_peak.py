"""The compiled step's peak against the uncompiled one's: Inductor must not raise the step's memory.

    python -m benchmarks.compiled_peak [--save]

For each AC mode (none, selective, full, budget 0.8), with the AdamW update outside the graph and in it, two
traced trainers of the debug model (6 layers, batch 4 x 512, fp32): op by op and compiled by Inductor
(`compile.backend = inductor`). Each runs one step (the trace and the compile), then one step under the CPU
live-tensor tracker: its peak is the figure. Bytes only, the same on any machine; the eight compiles take about
4 minutes on an idle 2-core CPU. `--save` writes the table to benchmarks/results/compiled_peak.json for
docs/compile.md. Exits 1 if a compiled peak exceeds its uncompiled one by more than SLACK_BYTES: these are the
dims where it once did (tests/compiler/test_compiled.py checks the same at the tiny model's dims in CI).
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import results
from benchmarks.common import make_trainer, measured_peak, next_batch

SHAPE = ["--training.local_batch_size", "4", "--training.seq_len", "512"]
AC_MODES = {
    "none": ["--activation_checkpoint.mode", "none"],
    "selective": ["--activation_checkpoint.mode", "selective"],
    "full": ["--activation_checkpoint.mode", "full"],
    "budget 0.8": ["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", "0.8"],
}
SLACK_BYTES = 64  # Inductor may keep one more 0-d buffer at the peak (tests/compiler/test_compiled.py)


def second_step_peak(*overrides: str) -> int:
    """Peak live bytes of a trainer's second step (the first traces and compiles)."""
    trainer = make_trainer("llama3_debug", *SHAPE, *overrides)
    trainer.log = lambda message: None
    trainer.memory.track = False
    trainer.train_step(next_batch(trainer))
    return measured_peak(trainer)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/compiled_peak.json")
    args = parser.parse_args()
    rows, data = [], {}
    for in_graph in (False, True):
        for mode, ac in AC_MODES.items():
            opt = ["--compile.trace_optimizer", str(in_graph).lower()]
            plain = second_step_peak(*ac, *opt)
            compiled = second_step_peak(*ac, *opt, "--compile.backend", "inductor")
            label = mode + (", optimizer in the graph" if in_graph else "")
            data[label] = {"uncompiled": plain, "compiled": compiled}
            rows.append([label, f"{plain:,}", f"{compiled:,}", f"{compiled / plain:.3f}"])
            print(" | ".join(rows[-1]), flush=True)
    table = results.markdown_table(["AC mode", "uncompiled peak", "compiled peak", "ratio"], rows)
    results.show("compiled_peak", {"compiled_peak": table}, data, save_it=args.save)
    higher = [label for label, d in data.items() if d["compiled"] > d["uncompiled"] + SLACK_BYTES]
    if higher:
        print(f"compiled peak above the uncompiled one: {', '.join(higher)}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
