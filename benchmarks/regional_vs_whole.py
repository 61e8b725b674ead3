"""Step time of the traced step uncompiled, compiled as one graph, and compiled region by region, interleaved.

    python benchmarks/regional_vs_whole.py [--layers 6] [--ac none selective] [--rounds 8] [--overrides ...]

Separate processes per mode (benchmarks/peers.py) are at the mercy of a shared machine: on
these 2 cores the same mode measured 0.83x and 1.04x eager in two runs. Here one process builds
three debug-config trainers (optimizer in the graph; `compile.backend` none, inductor whole,
inductor regional) and runs their steps in turn for `--rounds` rounds after one warm-up round
(which traces and compiles); it prints the median step time of each and the ratios, so load
that comes and goes hits all three alike.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def measure(ac: str, layers: int, rounds: int, overrides: list[str]) -> dict[str, float]:
    from benchmarks.common import interleaved_step_times, make_trainer, median

    common = [
        "--model.n_layers",
        str(layers),
        "--activation_checkpoint.mode",
        ac,
        "--compile.trace_optimizer",
        "true",
        *overrides,
    ]
    trainers = {
        "uncompiled": make_trainer("llama3_debug", *common),
        "whole": make_trainer("llama3_debug", *common, "--compile.backend", "inductor", "--compile.regional", "false"),
        "regional": make_trainer("llama3_debug", *common, "--compile.backend", "inductor"),
    }
    for t in trainers.values():
        t.log = lambda message: None
    times = interleaved_step_times(trainers, warmup=1, steps=rounds)
    return {name: median(t) for name, t in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--ac", nargs="+", default=["none", "selective"])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument(
        "--overrides",
        nargs=argparse.REMAINDER,
        default=[],
        help="trainer options, e.g. --overrides --training.local_batch_size 4 (must be last)",
    )
    args = parser.parse_args()
    rows = [(ac, measure(ac, args.layers, args.rounds, args.overrides)) for ac in args.ac]
    print(
        "| ac | uncompiled s | whole s | regional s | whole / uncompiled | regional / uncompiled | regional / whole |"
    )
    print("|---|---|---|---|---|---|---|")
    for ac, t in rows:
        print(
            f"| {ac} | {t['uncompiled']:.3f} | {t['whole']:.3f} | {t['regional']:.3f} | "
            f"{t['whole'] / t['uncompiled']:.2f}x | {t['regional'] / t['uncompiled']:.2f}x | "
            f"{t['regional'] / t['whole']:.2f}x |"
        )


if __name__ == "__main__":
    main()
