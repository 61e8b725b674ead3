"""Our `budget` policy against torch.compile's `activation_memory_budget`, at matched measured peaks, in one run.

    python -m benchmarks.torch_budget [--layers 6] [--batch 4] [--seq 256] [--budgets 0.1 0.3 0.5 0.7 1.0]
        [--solvers dp ilp] [--steps 5] [--save]

The same model, weights and batch on both sides (the debug Llama at `--layers`, fp32 on CPU, the loss over the
whole vocabulary), one step = forward, loss and every gradient, no optimizer and no clipping.

- **torch.compile**: the loss function compiled whole (`torch.compile(fullgraph=True)`) with AOTAutograd and
  its min-cut partitioner (`min_cut_rematerialization_partition`, what Inductor uses) under
  `torch._functorch.config.activation_memory_budget = b` and `activation_memory_budget_solver` (its default "dp",
  and "ilp"). The forward and backward graphs it partitions are kept and run as they are, without Inductor's
  kernels, so that the exact live-tensor tracker (`observability.memory.LiveTensorTracker`) sees every tensor:
  Inductor's generated code allocates past the dispatcher, so its CPU peak cannot be measured this way; its
  fusions would not change which tensors the partition saves.
- **ours**: the traced step with `activation_checkpoint.mode budget`, its budget set so that the step's peak
  target is torch's measured peak at b (`memory_budget` as the fraction of the no-AC activations that puts the
  target there: the whole step's size form needs the update traced, which torch's side does not run), run as the
  trainer runs it (no Inductor).

For each b: torch's measured peak, its saved bytes against its promise (b x the saved bytes at b = 1, the
default runtime-optimized partition), the activations at its peak against b x those at b = 1, and, at that peak,
both sides' recomputed FLOPs (torch's FLOP counter over the step's graphs, minus the same step with nothing
recomputed: b = 1 for torch, AC none for ours) and median step times on this CPU (both run FX graphs of aten ops
as Python code, torch's backward called plainly for the timing). Writes benchmarks/results/torch_budget.json
with `--save` (docs/passes_and_memory.md quotes it).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.fx  # noqa: E402

from benchmarks.results import markdown_table, save  # noqa: E402
from graph_trainer import stages  # noqa: E402
from graph_trainer.builder import Job, build_job  # noqa: E402
from graph_trainer.distributed.mesh import Mesh, ParallelDims  # noqa: E402
from graph_trainer.job_config.cli import load_config  # noqa: E402
from graph_trainer.loss import model_inputs  # noqa: E402
from graph_trainer.observability.memory import LiveTensorTracker  # noqa: E402
from graph_trainer.observability.units import GIB  # noqa: E402
from graph_trainer.tracer.graph_utils import node_flops  # noqa: E402
from graph_trainer.tracer.memory_estimate import estimate_peak_memory  # noqa: E402


def graph_flops(*graphs: torch.fx.GraphModule) -> int:
    """torch's FLOP count of every op of `graphs`, from their fake values."""
    return sum(node_flops(n) for gm in graphs for n in gm.graph.nodes)


def make_job(args: argparse.Namespace, *extra: str) -> Job:
    cfg, _ = load_config([
        "--config", "llama3_debug", "--model.n_layers", str(args.layers), "--training.local_batch_size",
        str(args.batch), "--training.seq_len", str(args.seq), "--training.max_norm", "0",
        "--training.loss_chunk_size", "0", "--compile.trace_optimizer", "false", "--training.deterministic", "true",
        *extra,
    ])  # fmt: skip
    return build_job(cfg, Mesh(ParallelDims(), 0, torch.device("cpu")))


def existing(job: Job, batch: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    return [*job.model.parameters(), *job.model.buffers(), *batch.values()]


def timed(run: Any, steps: int) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


class TorchSide:
    """The loss function compiled by torch.compile at one budget and solver; its partitioned graphs, kept."""

    def __init__(self, job: Job, batch: dict[str, torch.Tensor], budget: float, solver: str) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        kept: dict[str, Any] = {}

        def fw_compiler(gm: torch.fx.GraphModule, example: Any) -> Any:
            kept["fw"] = gm

            def run(args: list[Any]) -> Any:
                kept["fw_args"] = list(args)  # the real inputs (parameters, batch), for the replay
                return gm(*args)

            run._boxed_call = True
            return run

        def bw_compiler(gm: torch.fx.GraphModule, example: Any) -> Any:
            kept["bw"] = gm
            return make_boxed_func(gm)

        backend = aot_autograd(
            fw_compiler=fw_compiler, bw_compiler=bw_compiler, partition_fn=min_cut_rematerialization_partition
        )
        torch._dynamo.reset()
        model = job.model

        def loss_fn(b: dict[str, torch.Tensor]) -> torch.Tensor:
            # The trainer's loss (graph_trainer.loss) reads a context variable, which dynamo cannot trace: the same
            # mean cross-entropy over every token (the batch has no ignored labels), written plainly.
            logits = model(*model_inputs(b))
            return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), b["labels"].flatten())

        compiled = torch.compile(loss_fn, backend=backend, fullgraph=True, dynamic=False)
        params = [p for p in model.parameters() if p.requires_grad]
        with torch._functorch.config.patch(activation_memory_budget=budget, activation_memory_budget_solver=solver):
            torch.autograd.grad(compiled(batch), params)  # compiles the forward, then the backward
        self.fw, self.bw, self.args = kept["fw"], kept["bw"], kept["fw_args"]
        outputs = next(n for n in self.fw.graph.nodes if n.op == "output").args[0]
        self.out_names = [o.name if isinstance(o, torch.fx.Node) else None for o in outputs]
        self.bw_inputs = [n.name for n in self.bw.graph.nodes if n.op == "placeholder"]
        # What the forward saves for the backward besides its inputs (the parameters it passes on cost nothing).
        saved = [o for o in outputs[1:] if isinstance(o, torch.fx.Node) and o.op != "placeholder"]
        self.saved_bytes = sum(_nbytes(o) for o in saved)
        self.flops = graph_flops(self.fw, self.bw)

    def step(self, *, free_early: bool = True) -> list[torch.Tensor]:
        """The forward and backward graphs as AOTAutograd runs them, without autograd recording: the saved values
        passed on by name. `free_early`: in a list the backward clears (`Interpreter.boxed_run`), so that each is
        freed after its last use, as Inductor's compiled backward frees its inputs (a plain call holds them all to
        the end: the timed runs, where the interpreter's per-op cost would count against torch)."""
        with torch.no_grad():
            outs = self.fw(*self.args)
            values = {name: v for name, v in zip(self.out_names, outs, strict=True) if name is not None}
            tangent = torch.ones_like(outs[0])
            del outs
            args = [tangent if name.startswith("tangents") else values[name] for name in self.bw_inputs]
            del values, tangent
            return torch.fx.Interpreter(self.bw).boxed_run(args) if free_early else self.bw(*args)

    def peak(self, job: Job, batch: dict[str, torch.Tensor]) -> int:
        tracker = LiveTensorTracker()
        tracker.track_existing([existing(job, batch), self.args])
        with tracker:
            grads = self.step()
        del grads
        return tracker.peak_bytes


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.untyped_storage().nbytes() if isinstance(val, torch.Tensor) else 0


class OurSide:
    """The traced step under an AC mode: its final graph's FLOPs, its measured peak and step time."""

    def __init__(self, args: argparse.Namespace, batch: dict[str, torch.Tensor], *mode: str) -> None:
        self.job = make_job(args, "--activation_checkpoint.mode", *mode)
        traced = stages.trace(self.job, batch)
        transformed = stages.transform(self.job, traced).traced
        self.gm, self.categories = transformed.gm, traced.layout.categories
        self.flops = graph_flops(self.gm)
        self.step = self.job.build_step(optimizer_update=False)
        self.batch = batch
        self.step(batch)  # the first call traces

    def run(self) -> None:
        for p in self.job.model.parameters():
            p.grad = None
        self.step(self.batch)

    def peak(self) -> int:
        for p in self.job.model.parameters():
            p.grad = None
        tracker = LiveTensorTracker()
        tracker.track_existing(existing(self.job, self.batch))
        with tracker:
            self.step(self.batch)
        return tracker.peak_bytes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.1, 0.3, 0.5, 0.7, 1.0])
    parser.add_argument("--solvers", nargs="+", default=["dp", "ilp"])
    parser.add_argument("--steps", type=int, default=5, help="timed steps per side (median)")
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/torch_budget.json")
    return parser.parse_args(argv)


def compare(args: argparse.Namespace) -> tuple[dict[str, int], list[dict[str, Any]]]:
    """(the no-recompute baselines, one row per solver and budget): the figures of the module docstring."""
    torch.manual_seed(0)
    base = make_job(args, "--activation_checkpoint.mode", "none")
    vocab = base.cfg.model.vocab_size
    batch = {k: torch.randint(0, vocab, (args.batch, args.seq)) for k in ("input", "labels")}
    none = OurSide(args, batch, "none")
    no_ac = estimate_peak_memory(none.gm, input_categories=none.categories)
    saved_all = TorchSide(base, batch, 1.0, args.solvers[0])
    inputs = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in existing(base, batch)}.values())
    baseline = {"our_no_ac_peak": none.peak(), "torch_b1_peak": saved_all.peak(base, batch), "input_bytes": inputs,
                "our_no_ac_flops": none.flops, "torch_b1_flops": saved_all.flops}  # fmt: skip
    print(
        f"no AC: ours {baseline['our_no_ac_peak'] / GIB:.4f} GiB (est {no_ac.peak_bytes / GIB:.4f}), torch.compile "
        f"b=1 {baseline['torch_b1_peak'] / GIB:.4f} GiB; FLOPs ours {none.flops / 1e9:.2f} G, torch "
        f"{saved_all.flops / 1e9:.2f} G",
        flush=True,
    )
    rows = []
    for solver in args.solvers:
        for b in args.budgets:
            side = TorchSide(base, batch, b, solver)
            peak = side.peak(base, batch)
            # Our target is torch's measured peak (at most our no-AC peak: a fraction above 1 is refused).
            fraction = min(1.0, (peak - no_ac.input_bytes) / (no_ac.peak_bytes - no_ac.input_bytes))
            ours = OurSide(args, batch, "budget", "--activation_checkpoint.memory_budget", f"{fraction:.6f}")
            rows.append({
                "solver": solver, "budget": b, "torch_peak": peak,
                "torch_saved_share": side.saved_bytes / saved_all.saved_bytes,
                "torch_peak_act_share": (peak - inputs) / (baseline["torch_b1_peak"] - inputs),
                "torch_recompute_flops": side.flops - saved_all.flops, "our_fraction": fraction,
                "our_peak": ours.peak(), "our_recompute_flops": ours.flops - none.flops,
                "torch_step_s": timed(lambda side=side: side.step(free_early=False), args.steps),
                "our_step_s": timed(ours.run, args.steps),
            })  # fmt: skip
            print(rows[-1], flush=True)
    return baseline, rows


def main() -> None:
    args = parse_args()
    baseline, data = compare(args)
    rows = [
        (r["solver"], f"{r['budget']:.2f}", f"{r['torch_peak'] / GIB:.4f}", f"{r['torch_saved_share']:.3f}",
         f"{r['torch_peak_act_share']:.3f}", f"{r['our_peak'] / GIB:.4f}", f"{r['torch_recompute_flops'] / 1e9:.3f}",
         f"{r['our_recompute_flops'] / 1e9:.3f}", f"{r['torch_step_s'] * 1e3:.0f}", f"{r['our_step_s'] * 1e3:.0f}")
        for r in data
    ]  # fmt: skip
    header = ("solver", "budget b", "torch peak GiB", "torch saved / saved at b=1", "torch peak act / at b=1",
              "our peak GiB", "torch recompute GFLOP", "our recompute GFLOP", "torch ms", "our ms")  # fmt: skip
    table = markdown_table(header, rows)
    print(table)
    if args.save:
        save("torch_budget", {"torch_budget": table}, {"args": vars(args), "baseline": baseline, "rows": data})


if __name__ == "__main__":
    main()
