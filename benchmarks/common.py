"""Shared pieces of the benchmark scripts: build trainers from CLI-style overrides, time steps side by side."""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path

import torch

from graph_trainer.job_config.cli import load_config
from graph_trainer.trainer import Trainer

# Shapes of the two benchmark configs: the shipped debug model, and a deeper one that still fits a CPU.
CONFIGS = {
    "debug": [],
    "deep": ["--model.n_layers", "16", "--training.local_batch_size", "8"],
}
# How a table row names each config.
CONFIG_LABELS = {"debug": "debug (6 layers, 16 x 512)", "deep": "deep (16 layers, 8 x 512)"}


def make_trainer(config: str, *overrides: str) -> Trainer:
    """A Trainer for `config` plus overrides, logging into a fresh temporary folder (no TensorBoard)."""
    folder = Path(tempfile.mkdtemp(prefix="gt_bench_"))
    cfg, _ = load_config(
        ["--config", config, *overrides, "--job.dump_folder", str(folder), "--metrics.enable_tensorboard", "false"]
    )
    return Trainer(cfg)


def next_batch(trainer: Trainer) -> dict[str, torch.Tensor]:
    if not hasattr(trainer, "_bench_iter"):
        trainer._bench_iter = iter(trainer.dataloader)
    return {k: v.to(trainer.device) for k, v in next(trainer._bench_iter).items()}


def interleaved_step_times(trainers: dict, *, warmup: int, steps: int, tracked: tuple = ()) -> dict[str, list[float]]:
    """Run the trainers' steps alternately (so machine noise hits all alike); step times after warm-up.

    Memory tracking is off (its dispatch overhead would distort the timing) except for `tracked` keys.
    """
    for name, t in trainers.items():
        t.memory.track = name in tracked
    times: dict[str, list[float]] = {name: [] for name in trainers}
    for i in range(warmup + steps):
        for name, t in trainers.items():
            record = t.train_step(next_batch(t))
            if i >= warmup:
                times[name].append(record["step_time_s"])
    return times


def measured_peak(trainer: Trainer) -> tuple[int, dict]:
    """Peak live bytes of one step with the exact tracker on, and that step's record."""
    trainer.memory.track = True
    record = trainer.train_step(next_batch(trainer))
    return record["peak_active_bytes"], record


def median(xs: list[float]) -> float:
    return statistics.median(xs)
