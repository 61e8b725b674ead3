"""Plan time against depth: the depth-free plan (3 + 4 blocks traced) vs the full trace, all four AC modes.

    python -m benchmarks.plan_time [--config llama3_8b] [--depths 8 16 32 80 126] [--full-up-to 32]
        [--dp-shard 1] [--tp 1] [--extra --training.seq_len 8192 ...]

Each (depth, method) runs in a fresh process so the max RSS is its own; plan s is wall time, CPU s the
process's CPU time (on a shared machine the wall time includes waiting for a core). The full trace is skipped above
`--full-up-to` blocks (it grows with depth: 70B as one rank of 64 took 161 s here before this plan). Both
print the none-mode peak so the rows can be compared. The machine's load is printed with the table: on a
shared machine every time is inflated.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _one(args: list[str], fast: bool) -> dict:
    """Plan all four modes of `args` in this process; time, max RSS, and the none peak."""
    import torch

    from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
    from graph_trainer.job_config.cli import load_config
    from graph_trainer.plan.block_plan import plan_modes
    from graph_trainer.plan.step_plan import AC_MODES

    cfg, _ = load_config(args)
    start, cpu = time.perf_counter(), time.process_time()
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), torch.device("cpu")) as mesh:
        plans = plan_modes(cfg, mesh, AC_MODES, fast=fast)
    elapsed = time.perf_counter() - start
    none = plans["none"]
    return {
        "seconds": elapsed,
        "cpu_seconds": time.process_time() - cpu,  # on a shared machine, wall time waits for the CPU
        "rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024**2,
        "none_peak": getattr(none, "peak_bytes", None),
        "blocks_traced": getattr(none, "blocks_traced", None),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="llama3_8b")
    parser.add_argument("--depths", type=int, nargs="+", default=[8, 16, 32, 80, 126])
    parser.add_argument("--full-up-to", type=int, default=32)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[])
    parser.add_argument("--child", nargs=argparse.REMAINDER, help=argparse.SUPPRESS)
    opts = parser.parse_args()
    if opts.child:
        fast, *args = opts.child
        print(json.dumps(_one(args, fast == "fast")))
        return
    print(f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores")
    print(f"{'depth':>5} {'method':>10} {'plan s':>8} {'CPU s':>6} {'RSS GiB':>8} {'blocks':>6} {'none peak GiB':>14}")
    for depth in opts.depths:
        args = ["--config", opts.config, "--model.n_layers", str(depth), *opts.extra]
        for dim, size in (("dp_shard", opts.dp_shard), ("tp", opts.tp)):
            if size > 1:
                args += [f"--parallelism.{dim}", str(size)]
        for method in ("fast", "full"):
            if method == "full" and depth > opts.full_up_to:
                continue
            cmd = [sys.executable, "-m", "benchmarks.plan_time", "--child", method, *args]
            proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=3600)
            if proc.returncode != 0:
                print(f"{depth:>5} {method:>10} failed: {proc.stderr.strip().splitlines()[-1:]}")
                continue
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            peak = r["none_peak"] / 1024**3 if r["none_peak"] else float("nan")
            print(
                f"{depth:>5} {method:>10} {r['seconds']:8.1f} {r['cpu_seconds']:6.1f} {r['rss_gib']:8.2f} "
                f"{r['blocks_traced']:>6} {peak:14.3f}"
            )


if __name__ == "__main__":
    main()
