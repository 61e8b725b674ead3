"""The AdamW update alone: torch's single-tensor and foreach loops vs the traced update, op by op and
compiled by Inductor.

    python benchmarks/adamw.py [--configs debug deep] [--steps 20] [--save]

Same parameters (the benchmark model's), same gradients, same hyper-parameters. The traced update
is `GraphAdamW.update_` (what `compile.trace_optimizer` puts into the step graph), traced alone
with make_fx; "inductor" compiles it with the same entry point as `compile.backend = inductor`.
Prints the median time of one update per variant, interleaved so machine noise hits all alike. `--save` writes
the table to benchmarks/results/adamw.json for docs/compile.md (times: on an idle machine; `--configs debug` takes
under a minute on an idle 2-core CPU, most of it Inductor's compile).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
from torch.fx.experimental.proxy_tensor import make_fx  # noqa: E402

from benchmarks import results  # noqa: E402
from benchmarks.common import CONFIGS, make_trainer  # noqa: E402
from graph_trainer.compiler.inductor import compile_step_graph  # noqa: E402
from graph_trainer.optimizer.adamw import GraphAdamW  # noqa: E402


def traced_update(graph_opt: GraphAdamW, n: int, flat: list[torch.Tensor]) -> torch.fx.GraphModule:
    """make_fx of the update alone: inputs params, grads, state, host scalars; in place, no outputs."""

    def update(*inputs):
        params, grads = list(inputs[:n]), list(inputs[n : 2 * n])
        state, scalars = list(inputs[2 * n : 5 * n]), list(inputs[5 * n :])
        graph_opt.update_(params, grads, state, scalars)
        return []

    with torch.no_grad():
        return make_fx(update, tracing_mode="fake")(*flat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save", action="store_true", help="write benchmarks/results/adamw.json")
    args = parser.parse_args()
    rows = []
    for name in args.configs:
        trainer = make_trainer("llama3_debug", *CONFIGS[name], "--compile.mode", "eager")
        opt = trainer.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        torch.manual_seed(0)
        grads = [torch.randn_like(p) * 1e-2 for p in params]
        for p, g in zip(params, grads, strict=True):
            p.grad = g
        graph_opt = GraphAdamW(opt)
        flat = lambda: [*params, *grads, *graph_opt.state_tensors(), *graph_opt.host_scalars()]  # noqa: E731
        gm = traced_update(graph_opt, len(params), flat())
        start = time.perf_counter()
        compiled = compile_step_graph(gm)
        compile_s = time.perf_counter() - start

        def torch_step(foreach: bool):
            def run():
                opt.param_groups[0]["foreach"] = foreach
                opt.step()

            return run

        def graph_step(fn):
            def run():
                with torch.no_grad():
                    fn(flat())
                opt._opt_called = True

            return run

        variants = {
            "torch single-tensor": torch_step(False),
            "torch foreach": torch_step(True),
            "traced (op by op)": graph_step(lambda xs: gm(*xs)),
            "traced + inductor": graph_step(compiled),
        }
        times = {k: [] for k in variants}
        for i in range(args.steps + 2):
            for k, fn in variants.items():
                start = time.perf_counter()
                fn()
                if i >= 2:
                    times[k].append(time.perf_counter() - start)
        n_params = sum(p.numel() for p in params)
        base = statistics.median(times["torch single-tensor"])
        for k, ts in times.items():
            rows.append((name, n_params, k, statistics.median(ts), statistics.median(ts) / base))
        print(f"{name}: {len(params)} tensors, {n_params:,} parameters, inductor compile {compile_s:.1f} s", flush=True)
    print(f"\nmedian of {args.steps} updates after 2 warm-up, variants interleaved")
    print("| config | parameters | update | ms | vs single-tensor |\n|---|---|---|---|---|")
    for name, n, k, t, r in rows:
        print(f"| {name} | {n:,} | {k} | {t * 1000:.2f} | {r:.2f}x |")
    if args.save:
        table = results.markdown_table(
            ["config", "parameters", "update", "ms", "vs single-tensor"],
            [[name, f"{n:,}", k, f"{t * 1000:.2f}", f"{r:.2f}x"] for name, n, k, t, r in rows],
        )
        results.save("adamw", {"adamw": table}, {"steps": args.steps, "rows": rows})


if __name__ == "__main__":
    main()
