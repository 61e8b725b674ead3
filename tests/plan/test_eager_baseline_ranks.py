"""The eager baseline per rank: `eager_step_peak` on the planning mesh (torch's fake process group, fake tensors)
equals the eager step's CPU peak measured on 2 real gloo ranks, with FSDP, expert parallelism and bf16 mixed
precision (the layout of the 16B per-rank comparison in docs/moe.md, on the debug model).

Selective AC (the all-to-alls saved, `eager.checkpointing`) is the mode that found the one difference between
the two: the fake kernel of `_c10d_functional.wait_tensor` returns a new tensor, the real one its input
(`eager_baseline._WaitReturnsItsInput`); without that, this test fails.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from graph_trainer.builder import build_job
from graph_trainer.distributed.launch import destroy, init_distributed
from graph_trainer.job_config.cli import load_config
from graph_trainer.observability.memory import LiveTensorTracker
from graph_trainer.plan.eager_baseline import eager_step_peak
from tests.multiprocess import assert_peaks_match, free_port, settled_bytes, spawn_ranks

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # two spawned ranks build and run one eager step: ~15-20 s on 2 cores
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]
WORLD = 2
ARGS = [
    "--config",
    "deepseek_v3_debug",
    "--parallelism.dp_shard",
    str(WORLD),
    "--parallelism.ep",
    str(WORLD),
    "--training.mixed_precision_param",
    "bfloat16",
    "--training.seq_len",
    "128",
    "--training.local_batch_size",
    "4",
    "--activation_checkpoint.mode",
    "selective",
    "--compile.trace_optimizer",
    "false",
]


def _worker(rank: int, port: int, out: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank)
    )
    torch.set_num_threads(1)
    cfg, _ = load_config(ARGS)
    mesh = init_distributed(cfg)
    try:
        job = build_job(cfg, mesh)
        step = job.eager_step(optimizer_update=False)
        b, s = cfg.training.local_batch_size, cfg.training.seq_len
        batch = {name: torch.randint(0, 256, (b, s)) for name in ("input", "labels")}
        tracker = LiveTensorTracker()
        tracker.track_existing([list(job.model.parameters()), list(job.model.buffers()), batch])
        with tracker:
            step(batch)
        end = settled_bytes(tracker)  # after gloo's workers dropped the step's collective buffers
        record = [tracker.peak_bytes, end, tracker.late_free_bytes]
        Path(out, f"rank{rank}.json").write_text(json.dumps(record))
        tracker.forget()
    finally:
        destroy(mesh, wait_for_all=True)


def test_eager_step_peak_on_the_planning_mesh_equals_two_real_ranks(tmp_path):
    spawn_ranks(_worker, WORLD, (free_port(), str(tmp_path)), timeout_s=300)
    cfg, _ = load_config(ARGS)
    planned = eager_step_peak(cfg, torch.device("cpu"))
    assert planned.activation_bytes > 0
    for rank in range(WORLD):
        measured, end, late = json.loads(Path(tmp_path, f"rank{rank}.json").read_text())
        assert end == planned.end_bytes, rank
        # Gloo's worker thread may drop a collective's buffer after the step's thread moved on: at most that much more.
        assert_peaks_match([(planned.peak_bytes, measured, late)], rank)
