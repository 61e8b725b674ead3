"""The torchrun CLI at pp 2, one rank killed with SIGKILL while the ranks write a checkpoint, then resumed, ends on
the losses of a run never interrupted (`==`), and no torn folder stays:

    torchrun --nproc_per_node 2 -m graph_trainer --config llama3_debug.toml --parallelism.pp 2 ...

on the debug config shrunk to tiny widths with 6 blocks (3 a stage), checkpoints every step (each rank writes its
stage's parameters into one DCP folder).
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import pytest
import torch.distributed as dist

from graph_trainer.distributed.launch import trainer_command
from tests.integration.test_fault_injection import kill_during_write
from tests.test_run_lifecycle import CKPT, EXACT, checkpoints, start, summary, wait_for_step, worker_pid

pytestmark = [
    pytest.mark.multiprocess,
    pytest.mark.integration,  # 3 torchrun launches of 2 ranks
    pytest.mark.skipif(
        not (dist.is_available() and dist.is_gloo_available()), reason="needs torch.distributed with the gloo backend"
    ),
]

WORLD, STEPS = 2, 6
FOREVER = "100000"  # the interrupted run never reaches its end (EXACT's schedule does not depend on it)
PP = ["--model.n_layers", "6", "--training.local_batch_size", "4", "--parallelism.pp", "2"]
ARGS = [*EXACT, *CKPT, *PP, "--parallelism.pp_microbatch_size", "2"]
TIMEOUT_S = 240


def _launch(dump: Path, steps: str, *extra: str) -> subprocess.Popen:
    return start(
        *ARGS, "--training.steps", steps, "--job.dump_folder", str(dump), *extra,
        cwd=dump.parent, python=trainer_command(WORLD),
    )  # fmt: skip


def _succeeds(proc: subprocess.Popen) -> None:
    err = proc.communicate(timeout=TIMEOUT_S)[1]
    assert proc.returncode == 0, err[-3000:]


def test_torchrun_pp_with_one_rank_killed_mid_write_resumes_to_the_uninterrupted_losses(tmp_path):
    straight, dump = tmp_path / "straight", tmp_path / "run"
    _succeeds(_launch(straight, str(STEPS)))

    proc = _launch(dump, FOREVER)
    wait_for_step(proc, 2)
    last_rank = worker_pid(proc, WORLD - 1)
    kill_during_write(proc, dump / "checkpoint", nth=1, kill=lambda: os.kill(last_rank, signal.SIGKILL))
    proc.communicate(timeout=TIMEOUT_S)
    assert proc.returncode != 0
    saved = checkpoints(dump)
    assert saved, "no complete checkpoint before the kill"

    _succeeds(_launch(dump, str(STEPS), "--checkpoint.resume"))
    print(f"\nSIGKILL to rank {WORLD - 1} while writing; resumed from {saved[-1]}")
    assert [s["loss"] for s in summary(dump)["steps"]] == [s["loss"] for s in summary(straight)["steps"]]
    assert not any((dump / "checkpoint").glob(".step-*.tmp")), "the resumed run removes the torn write"
