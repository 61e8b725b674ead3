"""Running the real Trainer from a test: a tiny deterministic config plus overrides."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from graph_trainer.job_config.cli import load_config
from graph_trainer.trainer import Trainer, TrainResult
from tests.extras import child_pythonpath
from tests.tiny import TINY as TINY_RUN

REPO = Path(__file__).resolve().parents[2]

# GQA (4 query heads, 2 KV heads), small enough for CPU, deterministic kernels.
TINY = TINY_RUN

MODES = {
    "eager": ["--compile.mode", "eager"],
    "trace": ["--compile.mode", "trace"],
    "trace+selective": ["--activation_checkpoint.mode", "selective"],
    "trace+full": ["--activation_checkpoint.mode", "full"],
    "trace+budget": ["--activation_checkpoint.mode", "budget", "--activation_checkpoint.memory_budget", "0.8"],
    "trace+optimizer": ["--compile.trace_optimizer", "true"],
}


def train(folder: Path, *overrides: str, steps: int = 5, base: list[str] = TINY) -> tuple[TrainResult, Trainer]:
    """Train `steps` steps of the debug config with `base` + `overrides` into `folder`."""
    cfg, _ = load_config(
        [
            "--config",
            "llama3_debug",
            *base,
            "--training.steps",
            str(steps),
            "--job.dump_folder",
            str(folder),
            *overrides,
        ]
    )
    try:
        trainer = Trainer(cfg)
        return trainer.train(), trainer
    finally:
        torch.use_deterministic_algorithms(False)


def train_in_own_process(folder: Path, *overrides: str, steps: int = 5, base: list[str] = TINY) -> dict:
    """`train` through `python -m graph_trainer` in a fresh process: its summary.json (per-step records in
    "steps"). On CUDA the allocator's figures are the process's, not the step's: a trainer of the same process
    that ran before (its state, its cached blocks) counts in the next one's peaks."""
    args = ["--config", "llama3_debug", *base, "--training.steps", str(steps), "--job.dump_folder", str(folder)]
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    proc = subprocess.run([sys.executable, "-m", "graph_trainer", *args, *overrides], env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads((folder / "summary.json").read_text())
