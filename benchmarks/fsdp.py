"""FSDP (fp32 and bf16 parameters) vs replication vs one process here: per-rank peak (measured, estimated), step time.

    python benchmarks/fsdp.py [--ranks 2 4] [--steps 6] [--out outputs/bench_fsdp] [--save]

Each configuration is a real CLI run (torchrun for several ranks, gloo on CPU) on the debug model at a
small batch; the figures are rank 0's from its summary.json (the tests check every rank's estimate).
Step time is the median over the steps after the first (which traces). `--save` writes the table to
benchmarks/results/fsdp.json for docs/distributed.md (times: on an idle machine; `--ranks 2 4 --steps 5` takes
about 2 minutes on an idle 2-core CPU).
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
MODEL = [
    "--config",
    "llama3_debug",
    "--training.seq_len",
    "256",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
    "--training.deterministic",
    "true",
]


BF16_PARAMS = ["--training.mixed_precision_param", "bfloat16"]


def run(out: Path, ranks: int, option: str | None, steps: int, extra: tuple[str, ...] = ()) -> dict:
    """One CLI run (`extra`: more options); returns rank 0's summary.json."""
    folder = out / ((f"{option}_{ranks}" if option else "one_process") + ("_bf16" if extra else ""))
    args = [*MODEL, "--training.steps", str(steps), "--job.dump_folder", str(folder), "--job.overwrite", "true", *extra]
    if option:
        cmd = [
            *trainer_command(ranks),
            *args,
            f"--parallelism.{option}",
            str(ranks),
        ]
    else:
        cmd = [sys.executable, "-m", "graph_trainer", *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True, text=True)
    return json.loads((folder / "summary.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "bench_fsdp")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/fsdp.json")
    a = parser.parse_args()
    rows = [("one process", run(a.out, 1, None, a.steps))]
    for n in a.ranks:
        rows += [
            (f"dp_shard {n} (FSDP)", run(a.out, n, "dp_shard", a.steps)),
            (f"dp_shard {n}, bf16 params", run(a.out, n, "dp_shard", a.steps, tuple(BF16_PARAMS))),
            (f"dp_replicate {n}", run(a.out, n, "dp_replicate", a.steps)),
        ]
    base = statistics.median(s["step_time_s"] for s in rows[0][1]["steps"][1:])
    print(f"{'run':26} {'measured MiB':>13} {'estimate MiB':>13} {'equal':>6} {'step s':>7} {'vs 1 proc':>9}")
    table = []
    for name, summary in rows:
        steps = summary["steps"]
        measured = max(s["peak_active_bytes"] for s in steps)
        estimated = max(s["estimated_peak_bytes"] for s in steps)
        equal = all(s["peak_active_bytes"] == s["estimated_peak_bytes"] for s in steps)
        step = statistics.median(s["step_time_s"] for s in steps[1:])
        print(
            f"{name:26} {measured / 2**20:13.2f} {estimated / 2**20:13.2f} {str(equal):>6} {step:7.3f} "
            f"{step / base:9.2f}"
        )
        table.append([name, f"{measured / 2**20:.2f}", f"{estimated / 2**20:.2f}", f"{step:.3f}", f"{step / base:.2f}"])
    if a.save:
        header = ["run", "measured peak MiB", "estimated MiB", "step s", "vs one process"]
        data = {"steps": a.steps, "rows": {name: summary["steps"] for name, summary in rows}}
        results.save("fsdp", {"fsdp": results.markdown_table(header, table)}, data)


if __name__ == "__main__":
    main()
