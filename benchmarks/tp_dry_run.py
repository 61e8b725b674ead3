"""One rank's plan of a tensor-parallel job per AC mode, on torch's fake process group: peak, saved activations,
bytes per step per rank by parallelism and collective, and the time and peak RSS of planning it.

    python benchmarks/tp_dry_run.py --config llama3_70b.toml --dp-shard 8 --tp 8 [--modes none selective full]
    python benchmarks/tp_dry_run.py --config llama3_405b.toml --dp-shard 64 --tp 8 --modes full selective
        [--full-trace]

`python -m graph_trainer --config ... --dry-run` prints the same plans (every mode, budget included); this
script plans only the modes asked for, in the bf16 plan a GPU run uses. By default it plans them together with
the depth-free plan (graph_trainer/plan/block_plan.py: 3 + 4 blocks traced once for all modes, extended
exactly); `--full-trace` traces the whole depth once per mode instead and prints each mode as soon as it is
planned (a 70B mode takes minutes here). The figures come from `StepPlan` (`comm_bytes` included), the object
the planner reads.
"""

from __future__ import annotations

import argparse
import resource
import time

from graph_trainer.builder import build_job
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from graph_trainer.observability.units import to_gib
from graph_trainer.plan.block_plan import plan_modes
from graph_trainer.plan.step_plan import StepPlan, plan_step, with_ac_mode
from graph_trainer.runtime.device import resolve_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--modes", nargs="+", default=["none", "selective", "full"])
    parser.add_argument("--full-trace", action="store_true", help="trace the whole depth once per mode")
    args = parser.parse_args()
    cfg, _ = load_config(
        ["--config", args.config, "--training.dtype", "bfloat16"]
        + ["--parallelism.dp_shard", str(args.dp_shard), "--parallelism.tp", str(args.tp)]
    )
    device = resolve_device(cfg.training.device)
    start = time.perf_counter()
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), device) as mesh:
        print(f"{args.config}: one rank of {mesh.world_size} (dp_shard {args.dp_shard} x tp {args.tp}), bf16 plan")
        if args.full_trace:
            job = build_job(cfg, mesh, materialize=False)
            for mode in args.modes:
                _report(mode, plan_step(job.with_config(with_ac_mode(cfg, mode))), start)
        else:
            for mode, plan in plan_modes(cfg, mesh, args.modes).items():
                _report(mode, plan, start)


def _report(mode: str, plan: StepPlan | UserError, start: float) -> None:
    if isinstance(plan, UserError):
        print(f"{mode:10} not planned: {plan}")
        return
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    traffic = ", ".join(f"{kind} {to_gib(n):.3g}" for kind, n in plan.comm_bytes.items())
    print(
        f"{mode:10} peak {to_gib(plan.peak_bytes):8.2f} GiB  saved {to_gib(plan.saved_bytes):8.2f} GiB  "
        f"at {plan.peak_location}  blocks traced {plan.blocks_traced}  traced in {plan.trace_time_s:6.1f} s  "
        f"(elapsed {time.perf_counter() - start:6.1f} s, peak RSS {rss:.2f} GiB)\n"
        f"{'':10} GiB per step per rank: {traffic}",
        flush=True,
    )


if __name__ == "__main__":
    main()
