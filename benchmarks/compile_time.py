"""Inductor compile time of the traced step against depth, cold (empty cache) and warm (restarted run).

    python benchmarks/compile_time.py [--layers 2 8 32] [--optimizer true] [--regional true false] [--save]

Each measurement is a fresh process (a restarted run) that builds the debug-dims model with the
given depth (batch 2 x 128), traces the step and compiles it with `compile.backend = inductor`;
`compile/inductor_time_s` of the first step is reported. "cold" uses an empty Inductor cache
directory (`TORCHINDUCTOR_CACHE_DIR`), "warm" the same directory again: the FX graph cache then
serves the compiled step. Each depth is measured with `compile.regional = true` (each distinct
layer region compiled once) and `false` (the whole step as one graph). `--save` writes the table to
benchmarks/results/compile_time.json for docs/compile.md (times: on an idle machine; `--layers 2 8` takes about
3 minutes on an idle 2-core CPU, 32 layers about 5 more).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import results  # noqa: E402

SHAPE = ["--training.local_batch_size", "2", "--training.seq_len", "128"]


def worker(layers: int, optimizer: str, regional: str) -> None:
    from benchmarks.common import make_trainer, next_batch

    trainer = make_trainer(
        "llama3_debug",
        *SHAPE,
        "--model.n_layers",
        str(layers),
        "--compile.backend",
        "inductor",
        "--compile.trace_optimizer",
        optimizer,
        "--compile.regional",
        regional,
    )
    trainer.log = lambda message: None
    record = trainer.train_step(next_batch(trainer))
    print(
        "COMPILE_TIME "
        + json.dumps(
            {
                "inductor_time_s": record["inductor_time_s"],
                "trace_time_s": record["trace_time_s"],
                "nodes": len(trainer.step_fn.traced.gm.graph.nodes),
            }
        ),
        flush=True,
    )


def measure(layers: int, optimizer: str, regional: str, cache_dir: str) -> dict:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", str(layers), "--optimizer", optimizer, "--regional", regional],
        capture_output=True,
        text=True,
        env=env,
        timeout=3600,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("COMPILE_TIME ")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"worker failed ({layers} layers): {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(lines[-1].removeprefix("COMPILE_TIME "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 8, 32])
    parser.add_argument("--optimizer", default="true", choices=("true", "false"))
    parser.add_argument("--regional", nargs="+", default=["true", "false"], choices=("true", "false"))
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/compile_time.json")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        worker(args.worker, args.optimizer, args.regional[0])
        return
    header = ["compile", "layers", "graph nodes", "trace s", "inductor cold s", "inductor warm s", "cold s / layer"]
    rows, data = [], []
    for regional in args.regional:
        for layers in args.layers:
            with tempfile.TemporaryDirectory(prefix="gt_inductor_cache_") as cache:
                cold = measure(layers, args.optimizer, regional, cache)
                warm = measure(layers, args.optimizer, regional, cache)
            data.append({"regional": regional, "layers": layers, "cold": cold, "warm": warm})
            rows.append(
                ["regional" if regional == "true" else "whole step (`regional = false`)", layers, f"{cold['nodes']:,}"]
                + [f"{cold['trace_time_s']:.1f}", f"{cold['inductor_time_s']:.1f}", f"{warm['inductor_time_s']:.1f}"]
                + [f"{cold['inductor_time_s'] / layers:.1f}"]
            )
            print("| " + " | ".join(map(str, rows[-1])) + " |", flush=True)
    table = results.markdown_table(header, rows)
    results.show(
        "compile_time", {"compile_time": table}, {"optimizer": args.optimizer, "runs": data}, save_it=args.save
    )


if __name__ == "__main__":
    main()
