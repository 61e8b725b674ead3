"""The global batch: how `training.global_batch_size` splits into ranks and gradient accumulation steps.

torchtitan's meaning: global batch = local batch x data-parallel degree x accumulation steps, so a step
reads `global_batch_size` sequences over all ranks, each rank `accumulation_steps` micro-batches of
`local_batch_size` sequences. -1 (the default) is one micro-batch per step: no accumulation.
"""

from __future__ import annotations

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.schema import JobConfig


def data_parallel_degree(cfg: JobConfig) -> int:
    """How many ranks read different data: dp_replicate x dp_shard."""
    return cfg.parallelism.dp_replicate * cfg.parallelism.dp_shard


def accumulation_steps(cfg: JobConfig) -> int:
    """Micro-batches per optimizer step on each rank (1: no accumulation); see `check_global_batch`."""
    t = cfg.training
    if t.global_batch_size == -1:
        return 1
    return t.global_batch_size // (t.local_batch_size * data_parallel_degree(cfg))


def check_global_batch(cfg: JobConfig) -> None:
    """ConfigError unless `training.global_batch_size` is -1 or a positive multiple of local batch x dp degree."""
    t, dp = cfg.training, data_parallel_degree(cfg)
    per_micro = t.local_batch_size * dp
    if t.global_batch_size == -1 or (t.global_batch_size > 0 and t.global_batch_size % per_micro == 0):
        return
    below = max(per_micro, t.global_batch_size // per_micro * per_micro)
    raise ConfigError(
        f"training.global_batch_size = {t.global_batch_size} is not a positive multiple of local_batch_size "
        f"{t.local_batch_size} x data-parallel degree {dp} = {per_micro} (it must be local batch x dp degree x "
        f"accumulation steps): use {below} or {below + per_micro}, or -1 for no accumulation"
    )


def check_grad_sync(cfg: JobConfig) -> None:
    """ConfigError for `parallelism.fsdp_grad_sync = "step"` without FSDP: there is no reduce-scatter to defer."""
    if cfg.parallelism.fsdp_grad_sync == "step" and cfg.parallelism.dp_shard <= 1:
        raise ConfigError(
            'parallelism.fsdp_grad_sync = "step" defers FSDP\'s reduce-scatter and needs parallelism.dp_shard > 1 '
            f"(got {cfg.parallelism.dp_shard}): set --parallelism.dp_shard N, or drop it"
        )


__all__ = ["accumulation_steps", "check_global_batch", "check_grad_sync", "data_parallel_degree"]
