"""Activation memory of graph SAC vs eager torch.utils.checkpoint, planned for the big configs without a GPU.

    python benchmarks/activation_memory.py [--configs 1b 8b] [--modes selective full] [--save NAME]

For each config and AC mode, both steps (forward, loss, backward, clipping; the
AdamW update is the same in both and left out of both) are run on fake tensors on
this machine's CPU device, in fp32 unless the config says otherwise. A config with
parallelisms (`ds_16b_ep8`) is rank 0's step of its job, both sides on the planning
mesh (torch's fake process group, `graph_trainer.distributed.mesh.planning_mesh`):
- graph: the traced step after the pass pipeline, its static estimate (equal to
  the measured CPU peak to the byte, tests/passes/test_memory.py);
- eager: `compile.mode eager` with the same policy through torch.utils.checkpoint,
  run on fake tensors under the live-tensor tracker (equal to a real eager step's
  peak to the byte: tests/plan/test_planner.py for one process, tests/plan/test_eager_baseline_ranks.py
  for 2 gloo ranks with FSDP and expert parallelism).
Activation memory is what each step holds at its own peak besides parameters,
buffers, the batch and the gradients made by then (so: activations, their
gradients, the loss's temporaries). Ratios graph/eager, of the whole peak and of the
activations: the goal is <= 0.85. `--save NAME` writes the table (bytes only, no time: the same on any machine)
to benchmarks/results/NAME.json for the docs.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from benchmarks import results  # noqa: E402
from graph_trainer.job_config.cli import load_config  # noqa: E402
from graph_trainer.observability.units import to_gib  # noqa: E402
from graph_trainer.plan.eager_baseline import eager_step_peak  # noqa: E402
from graph_trainer.plan.step_plan import plan_config  # noqa: E402

# The shapes the GPU measurements used: 1B at batch 4 x 2048, 8B as shipped (1 x 8192); losses chunked as shipped.
CONFIGS = {
    "1b": ["--config", "llama3_1b", "--training.local_batch_size", "4"],
    "8b": ["--config", "llama3_8b"],
    # DeepSeek-V3 (docs/moe.md): the debug model as shipped, and 16B as one process would run it.
    "ds_debug": ["--config", "deepseek_v3_debug"],
    "ds_16b": ["--config", "deepseek_v3_16b"],
    # 16B per rank as 8 GPUs would run it (torchtitan's 16B setting): FSDP over 8 ranks with expert parallelism 8,
    # fp32 shards with FSDP2-style mixed precision (bf16 gather and compute, gradients reduced in fp32).
    "ds_16b_ep8": [
        "--config",
        "deepseek_v3_16b",
        "--parallelism.dp_shard",
        "8",
        "--parallelism.ep",
        "8",
        "--training.dtype",
        "float32",
        "--training.mixed_precision_param",
        "bfloat16",
    ],
}

# How a table row names each config.
LABELS = {
    "1b": "1B, 4 x 2048",
    "8b": "8B, 1 x 8192",
    "ds_debug": "DeepSeek-V3 debug, 8 x 128",
    "ds_16b": "16B, one process, 1 x 4096",
    "ds_16b_ep8": "16B, rank 0 of dp_shard 8, ep 8",
}

# The estimate's categories of what a step holds whatever it saves (graph_trainer.tracer.memory_estimate).
NOT_ACTIVATIONS = {"parameter", "buffer", "batch", "gradient", "optimizer_state"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=["1b", "8b"], choices=list(CONFIGS))
    parser.add_argument("--modes", nargs="+", default=["selective", "full"], choices=["none", "selective", "full"])
    parser.add_argument("--save", metavar="NAME", help="write the table to benchmarks/results/NAME.json")
    args = parser.parse_args()
    rows, data = [], []
    cpu = torch.device("cpu")
    print(
        f"{'config':10} {'ac mode':10} {'graph peak':>11} {'eager peak':>11} {'peak ratio':>10} {'graph act':>10} "
        f"{'eager act':>10} {'act ratio':>9} {'time s':>7}   (GiB; CPU device, fake tensors, no AdamW update)"
    )
    for name in args.configs:
        for mode in args.modes:
            cfg, _ = load_config(
                [*CONFIGS[name], "--activation_checkpoint.mode", mode, "--compile.trace_optimizer", "false"]
            )
            start = time.perf_counter()
            estimate = plan_config(cfg, cpu).step_graph.memory_estimate
            held = sum(n for cat, n in estimate.peak_bytes_by_category.items() if cat in NOT_ACTIVATIONS)
            graph_act = estimate.peak_bytes - held
            eager = eager_step_peak(cfg, cpu)
            print(
                f"{name:10} {mode:10} {to_gib(estimate.peak_bytes):11.2f} {to_gib(eager.peak_bytes):11.2f} "
                f"{estimate.peak_bytes / eager.peak_bytes:10.3f} {to_gib(graph_act):10.2f} "
                f"{to_gib(eager.activation_bytes):10.2f} {graph_act / eager.activation_bytes:9.3f} "
                f"{time.perf_counter() - start:7.1f}",
                flush=True,
            )
            ratio = estimate.peak_bytes / eager.peak_bytes
            rows.append(
                [LABELS[name], mode, _size(estimate.peak_bytes), _size(eager.peak_bytes), f"{ratio:.3f}"]
                + [_size(graph_act), _size(eager.activation_bytes), f"{graph_act / eager.activation_bytes:.3f}"]
            )
            data.append({"config": name, "mode": mode, "graph_peak": estimate.peak_bytes, "graph_act": graph_act})
            data[-1].update(eager_peak=eager.peak_bytes, eager_act=eager.activation_bytes)
    if args.save:
        header = ["config", "AC mode", "graph peak", "eager peak", "graph / eager peak", "graph act", "eager act"]
        results.save(args.save, {"activations": results.markdown_table([*header, "act ratio"], rows)}, data)


def _size(nbytes: int) -> str:
    """GiB, or MiB below one GiB (the debug model's figures)."""
    return f"{to_gib(nbytes):.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.2f} MiB"


if __name__ == "__main__":
    main()
