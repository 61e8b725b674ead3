"""One rank's plan of a tensor- or expert-parallel job per AC mode, on torch's fake process group: peak, saved
activations, bytes per step per rank by parallelism and collective, and the time and peak RSS of planning it.

    python benchmarks/tp_dry_run.py --config llama3_70b.toml --dp-shard 8 --tp 8 [--modes none selective full]
    python benchmarks/tp_dry_run.py --config llama3_405b.toml --dp-shard 64 --tp 8 --modes full selective
        [--full-trace]
    python benchmarks/tp_dry_run.py --config deepseek_v3_16b.toml --dp-shard 8 --ep 8 --dtype float32
    python -m benchmarks.tp_dry_run --doc

`python -m graph_trainer --config ... --dry-run` prints the same plans (every mode, budget included); this
script plans only the modes asked for, in the bf16 plan a GPU run uses unless `--dtype` says otherwise. By default
it plans them together with the depth-free plan (graph_trainer/plan/block_plan.py: 3 + 4 blocks traced once for
all modes, extended exactly); `--full-trace` traces the whole depth once per mode instead and prints each mode as
soon as it is planned (a 70B mode takes minutes here). The figures come from `StepPlan` (`comm_bytes` included),
the object the planner reads.

`--doc` plans the jobs README.md, docs/tensor_parallel.md, docs/moe.md and docs/passes_and_memory.md quote
(`DOC_JOBS` in every AC mode but budget, `LOSS_JOBS` in selective) and saves their tables to
benchmarks/results/tp_dry_run.json: bytes and FLOPs only, no time, so the figures are the same on any machine
(about 2 minutes on an idle 2-core CPU).
"""

from __future__ import annotations

import argparse
import resource
import time
from dataclasses import dataclass

from benchmarks import results
from graph_trainer.builder import build_job
from graph_trainer.distributed.mesh import ParallelDims, planning_mesh
from graph_trainer.errors import UserError
from graph_trainer.job_config.cli import load_config
from graph_trainer.observability.units import to_gib, to_mib
from graph_trainer.plan.block_plan import plan_modes
from graph_trainer.plan.step_plan import StepPlan, plan_step, with_ac_mode
from graph_trainer.runtime.device import resolve_device

MODES = ("none", "selective", "full")


@dataclass(frozen=True)
class Job:
    """One rank of a parallel job, as this script's options name it."""

    config: str
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1
    dtype: str = "bfloat16"
    extra: tuple[str, ...] = ()  # more options, e.g. the loss's chunks or the AdamW implementation

    def overrides(self) -> list[str]:
        args = ["--config", self.config, "--training.dtype", self.dtype, *self.extra]
        for dim in ("dp_shard", "tp", "ep"):
            args += [f"--parallelism.{dim}", str(getattr(self, dim))]
        return args

    def name(self) -> str:
        """`llama3_70b`, `deepseek_v3_16b_dp_shard8_ep8`: the config, and the layout unless one process."""
        layout = "".join(f"_{dim}{getattr(self, dim)}" for dim in ("dp_shard", "tp", "ep") if getattr(self, dim) > 1)
        return self.config.removesuffix(".toml") + (layout if self.ep > 1 or self.tp == 1 else "")

    def label(self) -> str:
        """`70B, dp_shard 8 x tp 8 (64 ranks)`: the flavor, the layout and the world it is one rank of."""
        flavor = self.config.removesuffix(".toml").rsplit("_", 1)[1].upper()
        if self.dp_shard == 1:
            return f"{flavor}, one process"
        layout = f"dp_shard {self.dp_shard}" + (f" x tp {self.tp}" if self.tp > 1 else "")
        layout += f", ep {self.ep}" if self.ep > 1 else ""
        return f"{flavor}, {layout} ({self.dp_shard * self.tp} ranks)"


# The jobs the docs quote: Llama-3 in the bf16 plan a GPU run uses, DeepSeek-V3 as `--dry-run` plans it (fp32).
DOC_JOBS = (
    Job("llama3_70b.toml", dp_shard=8, tp=8),
    Job("llama3_405b.toml", dp_shard=64, tp=8),
    Job("deepseek_v3_16b.toml", dp_shard=8, ep=8, dtype="float32"),
    Job("deepseek_v3_671b.toml", dp_shard=256, ep=256, dtype="float32"),
    Job("deepseek_v3_16b.toml", dtype="float32"),
    Job("deepseek_v3_16b.toml", dp_shard=8, dtype="float32"),
)
# The chunked loss against the whole one on 8B, selective AC (docs/passes_and_memory.md): the loss and the eager
# AdamW update each can set the peak. fp32 compute, as the 8B dry run plans it.
LOSS_JOBS = tuple(
    Job("llama3_8b.toml", dtype="float32", extra=(*loss, "--optimizer.implementation", update))
    for loss, update in (
        (("--training.loss_chunk_size", "0"), "single_tensor"),
        ((), "single_tensor"),
        ((), "fused"),
    )
)


def plan_job(job: Job, modes: tuple[str, ...] = MODES, *, full_trace: bool = False, report: bool = True) -> dict:
    """{mode: StepPlan or the UserError that refused it} for one rank of `job`; printed as each mode is planned."""
    cfg, _ = load_config(job.overrides())
    start = time.perf_counter()
    plans = {}
    with planning_mesh(ParallelDims.from_config(cfg.parallelism), resolve_device(cfg.training.device)) as mesh:
        print(f"{job.config}: one rank of {mesh.world_size} ({job.label()}), {job.dtype} plan")
        if full_trace:
            built = build_job(cfg, mesh, materialize=False)
            for mode in modes:
                plans[mode] = plan_step(built.with_config(with_ac_mode(cfg, mode)))
                _report(mode, plans[mode], start)
        else:
            plans = plan_modes(cfg, mesh, list(modes))
            for mode, plan in plans.items():
                _report(mode, plan, start)
    return plans


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


def _traffic(plan: StepPlan, collective: str, parallelism: str | None = None) -> int:
    """Bytes per step of one collective, of one parallelism or of all ('<parallelism> <collective>' keys)."""
    return sum(
        n for key, n in plan.comm_bytes.items() if key.endswith(collective) and key.startswith(parallelism or "")
    )


def _gib(nbytes: int) -> str:
    return f"{to_gib(nbytes):.3g} GiB"


def doc_tables(plans: dict[Job, dict[str, StepPlan]]) -> dict[str, str]:
    """The tables the docs quote, rendered from each doc job's plans (full AC's peak in bold: the one that fits)."""
    tables = {}
    llama = [job for job in plans if job.tp > 1]
    moe = [job for job in plans if job.ep > 1]
    for job in llama:
        rows = []
        for mode in ("full", "selective", "none"):
            p = plans[job][mode]
            peak = f"{to_gib(p.peak_bytes):.2f}"
            rows.append(
                [mode, f"**{peak}**" if mode == "full" else peak, f"{to_gib(p.saved_bytes):.2f}"]
                + [_gib(_traffic(p, c, "tp")) for c in ("all_gather", "reduce_scatter")]
                + [_gib(_traffic(p, c, "fsdp")) for c in ("all_gather", "reduce_scatter")]
                + [f"{to_mib(_traffic(p, 'all_reduce')):.2g} MiB"]
            )
        header = ["AC mode", "peak GiB / rank", "saved GiB", "TP all-gather", "TP reduce-scatter"]
        header += ["FSDP all-gather", "FSDP reduce-scatter", "all-reduce"]
        tables[job.name()] = results.markdown_table(header, rows)
    tables["llama3_tp"] = results.markdown_table(
        ["per rank, GiB", *MODES],
        [[job.label(), *(_peak_cell(plans[job][m], bold=m == "full") for m in MODES)] for job in llama],
    )
    tables["deepseek_v3_ep"] = results.markdown_table(
        ["per rank (`--dry-run`, fp32, 1 x 4096 tokens)", *MODES, "all-to-all / step"],
        [
            [job.label(), *(f"{to_gib(plans[job][m].peak_bytes):.2f} GiB" for m in MODES), _a2a(plans[job])]
            for job in moe
        ],
    )
    tables["deepseek_v3_ep_traffic"] = results.markdown_table(
        [
            "dry run",
            "AC mode",
            "peak GiB",
            "saved GiB",
            "all-to-all / step",
            "all-gather / step",
            "reduce-scatter / step",
        ],
        [
            [
                job.label(),
                " / ".join(MODES),
                " / ".join(f"{to_gib(plans[job][m].peak_bytes):.2f}" for m in MODES),
                " / ".join(f"{to_gib(plans[job][m].saved_bytes):.2f}" for m in MODES),
                _a2a(plans[job]),
                _gib(_traffic(plans[job]["none"], "all_gather")),
                _gib(_traffic(plans[job]["none"], "reduce_scatter")),
            ]
            for job in moe
        ],
    )
    loss_rows = []
    for job in (job for job in plans if job in LOSS_JOBS):
        cfg, _ = load_config(job.overrides())
        chunks = cfg.training.loss_chunk_size
        p = plans[job]["selective"]
        activations = to_gib(p.peak_by_category.get("activation", 0))
        loss_rows.append(
            ["unchunked" if not chunks else f"chunks of {chunks}", p.optimizer, f"{to_gib(p.peak_bytes):.2f} GiB"]
            + [p.peak_where, f"{activations:.2f} GiB"]
        )
    header = ["loss", "AdamW update", "planned peak", "peak at", "activations at the peak"]
    tables["llama3_8b_loss"] = results.markdown_table(header, loss_rows)
    for job in (job for job in plans if job.ep == 1 and job.tp == 1 and job not in LOSS_JOBS):
        rows = [
            [m, f"{to_gib(p.peak_bytes):.2f}", f"{to_gib(p.saved_bytes):.2f}", f"{p.flops / 1e12:.2f}", p.peak_where]
            for m, p in plans[job].items()
        ]
        tables[job.name()] = results.markdown_table(["AC mode", "peak GiB", "saved GiB", "TFLOP/step", "peak at"], rows)
    return tables


def _peak_cell(plan: StepPlan, *, bold: bool) -> str:
    peak = f"{to_gib(plan.peak_bytes):.2f}"
    return f"**{peak}**" if bold else peak


def _a2a(plans: dict[str, StepPlan]) -> str:
    """The all-to-all bytes per step, the same in every AC mode (a remat never recomputes an all-to-all)."""
    sizes = {_traffic(p, "all_to_all") for p in plans.values()}
    assert len(sizes) == 1, f"all-to-all bytes differ between AC modes: {sizes}"
    return _gib(sizes.pop())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config")
    parser.add_argument("--dp-shard", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--modes", nargs="+", default=list(MODES))
    parser.add_argument("--full-trace", action="store_true", help="trace the whole depth once per mode")
    parser.add_argument("--doc", action="store_true", help="plan the docs' jobs and save their tables")
    args = parser.parse_args()
    if args.doc:
        plans = {job: plan_job(job) for job in DOC_JOBS}
        plans |= {job: plan_job(job, ("selective",)) for job in LOSS_JOBS}
        data = {
            job.name() + "".join(job.extra): {
                m: {
                    "peak_bytes": p.peak_bytes,
                    "saved_bytes": p.saved_bytes,
                    "flops": p.flops,
                    "comm_bytes": p.comm_bytes,
                }
                for m, p in job_plans.items()
            }
            for job, job_plans in plans.items()
        }
        results.save("tp_dry_run", doc_tables(plans), data)
        return
    if not args.config:
        parser.error("--config is required (or --doc)")
    plan_job(
        Job(args.config, args.dp_shard, args.tp, args.ep, args.dtype), tuple(args.modes), full_trace=args.full_trace
    )


if __name__ == "__main__":
    main()
