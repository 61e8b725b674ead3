"""Resuming with changed options: which changes a checkpoint can take, and the log of what changed.

Every checkpoint stores the resolved config it was written with (`stored_config`).
On resume, `compare_on_resume` holds it against the current config, option by option:

- refused (one line, exit 2): options that change the data stream or the model's
  structure. The saved data position counts batches of the saved shape and order
  (`training.local_batch_size`, `training.seq_len`, `training.seed`, `data.*`,
  `parallelism.dp_shard`, `parallelism.dp_replicate`), and the saved weights fit one architecture (`model.*`
  except the options listed as honoured below).
- refused too: a change of the validation split (`validation.enable` with an empty
  `validation.path` holds every `validation.holdout_every`-th document out of training).
- honoured, and logged against the checkpoint's value: everything else, e.g.
  `optimizer.lr` and the other AdamW hyperparameters, the schedule, `training.steps`,
  clipping, dropout, AC and compile modes, logging and checkpoint options.

A sharded checkpoint (`parallelism.dp_shard`, see `graph_trainer.checkpoint.sharded`)
can be resumed on another layout of its data-parallel ranks (dp_shard, and dp_replicate with it: HSDP), but
only with the same global batch (`dp_replicate x dp_shard x local_batch_size`): then every step reads the very
windows the saved run would have read (data rank r of N takes the r-th slice of each global batch; with
`data.source = "hf_datasets"`, each sequence of the global batch reads its own rows whatever the degree), so the
data position carries over exactly and only the summation order changes. A different global batch would be a
different run from that step on, and is refused.

Gradient accumulation (`training.global_batch_size`): the data position counts whole steps' batches of
`accumulation steps x local_batch_size` sequences, so a resume that changes the number of accumulation steps
is refused (one line naming the checkpoint's value); a new value that keeps them (e.g. -1 written out as the
number it stood for) is honoured and logged.

A checkpoint without a stored config (written before this existed) is resumed as
before, with a warning that nothing could be compared.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import torch

from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import JobConfig

# section.key -> why a resumed run cannot take a new value.
_DATA = "the saved data position only fits the saved data, batch shape and order"
_MODEL = "the saved weights belong to the saved architecture"
REFUSED: dict[str, str] = {
    "training.local_batch_size": _DATA,
    "training.seq_len": _DATA,
    "training.seed": _DATA,
    "data.source": _DATA,
    "data.path": _DATA,
    "data.tokenizer": _DATA,
    "data.text_column": _DATA,
    "data.streaming": _DATA,  # a stream is cut into lanes another way than a loaded dataset
    "data.shuffle": _DATA,
    "data.shuffle_buffer": _DATA,
    "parallelism.dp_shard": _DATA,
    "parallelism.dp_replicate": _DATA,
    **{
        f"model.{f.name}": _MODEL
        for f in dataclasses.fields(JobConfig().model)
        if f.name not in ("dropout", "rope_theta", "use_rope_scaling", "max_seq_len", "norm_eps")
    },
}
# Options that say how to start, not what to train: their change is expected and not logged.
_NOT_COMPARED = ("checkpoint.resume", "job.overwrite", "checkpoint.initial_load_path", "checkpoint.initial_load_in_hf")


def _absolute_path(value: str) -> str:
    return str(Path(value).expanduser().absolute()) if value and value != "byte" else value


def stored_config(cfg: JobConfig) -> dict[str, dict[str, Any]]:
    """The config to store in a checkpoint: plain values (weights_only-loadable), data paths made absolute."""
    stored = dataclasses.asdict(cfg)
    stored["data"]["path"] = _absolute_path(stored["data"]["path"])
    stored["data"]["tokenizer"] = _absolute_path(stored["data"]["tokenizer"])
    return stored


def _flatten(config: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {f"{section}.{key}": value for section, values in config.items() for key, value in values.items()}


def _as_flag(key: str, value: Any) -> str:
    if value is None:
        return f"no --{key}"
    if isinstance(value, bool):
        value = str(value).lower()
    return f"--{key} {value!r}" if isinstance(value, str) and (not value or " " in value) else f"--{key} {value}"


_RESHARD = ("parallelism.dp_replicate", "parallelism.dp_shard", "training.local_batch_size")
_DATA_PARALLEL = _RESHARD[:2]  # their product is the number of data ranks
# A new layout of the same step: the data ranks, or the pipeline's stages (whose micro-batches are accumulation's:
# a pp checkpoint resumed in one process accumulates them).
_LAYOUT = (*_DATA_PARALLEL, "parallelism.pp")


def _data_ranks(config: dict[str, Any]) -> int:
    """How many ranks read different data (dp_replicate x dp_shard) in a flattened config."""
    return config["parallelism.dp_shard"] * config.get("parallelism.dp_replicate", 1)


def _accumulation_steps(config: dict[str, Any]) -> int:
    """Micro-batches per step of a flattened config (a checkpoint from before accumulation: 1)."""
    global_batch = config.get("training.global_batch_size", -1)
    if global_batch == -1:
        return 1
    return global_batch // (config["training.local_batch_size"] * _data_ranks(config))


def _global_batch(config: dict[str, Any]) -> int:
    """Sequences per step over the data ranks (every micro-batch of a step)."""
    return _data_ranks(config) * config["training.local_batch_size"] * _accumulation_steps(config)


def _accumulation_refusal(before: dict[str, Any], now: dict[str, Any], checkpoint: Path) -> UserError:
    was, will = _accumulation_steps(before), _accumulation_steps(now)
    return UserError(
        f"cannot resume {checkpoint} with training.global_batch_size {now['training.global_batch_size']} "
        f"({will} accumulation steps; checkpoint: {before.get('training.global_batch_size', -1)}, {was} steps): "
        f"the saved data position counts steps of {was} micro-batches; resume with "
        f"{_as_flag('training.global_batch_size', before.get('training.global_batch_size', -1))}, "
        "or start a new job.dump_folder"
    )


def _reshard_refusal(before: dict[str, Any], now: dict[str, Any], checkpoint: Path) -> UserError:
    n, batch = _data_ranks(now), _global_batch(before)
    fix = (
        f"--training.local_batch_size {batch // n} to keep it"
        if batch % n == 0
        else f"a data-parallel degree (parallelism.dp_replicate x parallelism.dp_shard) that divides {batch}"
    )
    layout = " x ".join(f"{k.split('.')[1]} {now[k]}" for k in _DATA_PARALLEL if now.get(k, 1) > 1)
    return UserError(
        f"cannot resume {checkpoint} on {n} data ranks ({layout}) with training.local_batch_size "
        f"{now['training.local_batch_size']}: the global batch (data ranks x local_batch_size) would be "
        f"{_global_batch(now)} instead of {batch}, and the saved data position counts batches of "
        f"{batch}; resume with {fix}"
    )


def _held_out_every(config: dict[str, Any]) -> int:
    """Every how many documents training skips one for validation (0: none), from a flattened config."""
    if config.get("validation.enable") and not config.get("validation.path"):
        return config["validation.holdout_every"]
    return 0


def _holdout_words(every: int) -> str:
    return f"every {every}th document held out for validation" if every else "no document held out"


def _check_held_out(before: dict[str, Any], now: dict[str, Any], checkpoint: Path) -> None:
    """UserError when the validation split would change which documents training reads."""
    if "validation.enable" not in before or _held_out_every(before) == _held_out_every(now):
        return
    saved, asked = _held_out_every(before), _held_out_every(now)
    fix = (
        f"--validation.enable true --validation.path '' --validation.holdout_every {saved}"
        if saved
        else "--validation.path FILE (a separate held-out set) or --validation.enable false"
    )
    raise UserError(
        f"cannot resume {checkpoint} with {_holdout_words(asked)} (checkpoint: {_holdout_words(saved)}): {_DATA}; "
        f"resume with {fix}, "
        "or start a new job.dump_folder"
    )


def compare_on_resume(
    saved: dict[str, dict[str, Any]], cfg: JobConfig, checkpoint: Path, *, reshardable: bool = False
) -> list[str]:
    """Lines naming each honoured change against the checkpoint's config; UserError if any change is refused.

    With `reshardable` (a sharded checkpoint), the layout (`parallelism.dp_shard`, `dp_replicate`, `pp`), the
    local batch and the accumulation steps may change together when the global batch stays the same.
    """
    before, now = _flatten(saved), _flatten(stored_config(cfg))
    if before["data.source"] in ("embedded", "synthetic"):
        before.pop("data.path", None)  # these sources read no file
        now.pop("data.path", None)
    changed = [k for k in now if k not in _NOT_COMPARED and k in before and before[k] != now[k]]
    _check_held_out(before, now, checkpoint)
    new_layout = any(k in changed for k in _LAYOUT)
    if _accumulation_steps(before) != _accumulation_steps(now) and not (reshardable and new_layout):
        raise _accumulation_refusal(before, now, checkpoint)
    resharded = reshardable and new_layout
    if resharded and _global_batch(before) != _global_batch(now):
        raise _reshard_refusal(before, now, checkpoint)
    refused = [k for k in changed if k in REFUSED and not (resharded and k in _RESHARD)]
    if refused:
        what = ", ".join(f"{k} {now[k]!r} (checkpoint: {before[k]!r})" for k in refused)
        fix = " ".join(_as_flag(k, before[k]) for k in refused)
        raise UserError(
            f"cannot resume {checkpoint} with changed {what}: {REFUSED[refused[0]]}; "
            f"resume with {fix}, or start a new job.dump_folder"
        )
    lines = [f"{k}: {before[k]!r} in the checkpoint, {now[k]!r} now (honoured)" for k in changed if k not in REFUSED]
    if resharded:
        lines += [
            f"{k}: {before[k]!r} in the checkpoint, {now[k]!r} now (resharded: the global batch of "
            f"{_global_batch(now)} and the data position are unchanged)"
            for k in _RESHARD
            if k in changed
        ]
    return lines


def load_optimizer_state(
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    optimizer_state: dict[str, Any],
    scheduler_state: dict[str, Any],
) -> None:
    """Load the optimizer and schedule state of a checkpoint, keeping this run's hyperparameters.

    torch's `load_state_dict` also restores each group's lr, betas, eps, weight decay,
    implementation flags and `initial_lr`, and the scheduler's `base_lrs`: a resumed run
    would silently keep the old `optimizer.lr`. The groups are built from the current
    config, so their hyperparameters are put back after loading; the moments, step
    counts and the schedule's position come from the checkpoint.
    """
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    optimizer.load_state_dict(optimizer_state)
    for group, values in zip(optimizer.param_groups, hyper, strict=True):
        group.update(values)
    scheduler.load_state_dict(scheduler_state)
    scheduler.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
