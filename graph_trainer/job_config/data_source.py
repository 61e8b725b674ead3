"""The data a path holds decides how it is read: `data.path` alone picks its source, and instruction rows turn
document masking on, unless the user said otherwise (an option they set always wins)."""

from __future__ import annotations

from collections.abc import Collection
from pathlib import Path

from graph_trainer.errors import ConfigError
from graph_trainer.job_config.schema import JobConfig


def apply_data_source(cfg: JobConfig, given: Collection[str]) -> None:
    """In place: with `data.path` given and `data.source` not, the source its files need (`loader.infer_source`);
    with the "chat" source and `data.document_masking` not given, masking on (each row attends only to itself).
    `given`: the `section.key` options the user set (config file and command line).

    Raises:
        ConfigError: a `data.path` that does not exist, when its files would pick the source.
    """
    from graph_trainer.data.loader import CHAT_SOURCE, infer_source

    if cfg.data.path and "data.source" not in given:
        if not Path(cfg.data.path).expanduser().exists():
            raise ConfigError(
                f"data.path '{cfg.data.path}' does not exist; set it to a file or folder of training data "
                "(text, jsonl, chat rows, parquet/json/arrow)"
            )
        cfg.data.source = infer_source(cfg.data.path)
    if cfg.data.source == CHAT_SOURCE and "data.document_masking" not in given:
        cfg.data.document_masking = True


__all__ = ["apply_data_source"]
