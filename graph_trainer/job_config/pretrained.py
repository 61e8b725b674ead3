"""The folder is the model: a Hugging Face folder's `config.json` as the `[model]` options.

With `checkpoint.initial_load_path DIR`, `config.json` names the family (`model_type` / `architectures`, matched
against each family's `ModelSpec.hf_names`) and sets every model argument through the family's own mapping
(`ModelSpec.args_from_hf_config`, e.g. models/llama3/state_dict_adapter.py). A `--model.*` option given as well
must say the same: every one that disagrees is named in one line. The folder's `tokenizer.json` is the tokenizer
unless `data.tokenizer` is given.

This runs once, when the config is built (`job_config.cli.build_config`), against the real model: everything
after it (the preflight's short models, the dry run, the planner's candidates) sees the resolved options and
never opens the folder again. Its tensors are read only by the build that materializes the model
(graph_trainer/checkpoint/hf.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from graph_trainer.errors import ConfigError, UserError
from graph_trainer.job_config.schema import JobConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TOKENIZER_FILE = "tokenizer.json"
_PICKLES = ("pytorch_model.bin", "pytorch_model.bin.index.json")


def model_name(cfg: JobConfig) -> str:
    """The model as messages name it: `family of FOLDER` when a Hugging Face folder set it (its config.json is the
    model then, not the flavor), else `family/flavor`."""
    if cfg.checkpoint.initial_load_path and cfg.checkpoint.initial_load_in_hf:
        return f"{cfg.model.name} of {cfg.checkpoint.initial_load_path}"
    return f"{cfg.model.name}/{cfg.model.flavor}"


def read_json(path: Path, what: str) -> Any:
    """The parsed JSON file `path` of a Hugging Face folder; UserError naming it when missing or unreadable."""
    if not path.is_file():
        raise UserError(
            f"{path.parent} has no {path.name} ({what}); point checkpoint.initial_load_path at a Hugging "
            "Face model folder (config.json + model.safetensors)"
        )
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"{path} cannot be read as JSON ({e}); use the file the model was published with") from None


def read_config(folder: Path) -> dict[str, Any]:
    """The folder's `config.json`; UserError when it is no folder, or the file is missing or not an object."""
    if not folder.is_dir():
        raise UserError(
            f"checkpoint.initial_load_path '{folder}' is not a folder; point it at a Hugging Face model "
            "folder (config.json + model.safetensors)"
        )
    config = read_json(folder / CONFIG_FILE, "its config")
    if not isinstance(config, dict):
        raise UserError(f"{folder / CONFIG_FILE} is not a JSON object; use the model's own config.json")
    return config


def weights_file(folder: Path) -> str:
    """Which safetensors the folder's weights are in: INDEX_FILE (shards) or SINGLE_FILE (no file is read).

    Raises:
        UserError: the folder holds only pickles (`pytorch_model.bin`, which run code when loaded), or nothing.
    """
    for name in (INDEX_FILE, SINGLE_FILE):
        if (folder / name).is_file():
            return name
    if any((folder / p).exists() for p in _PICKLES):
        raise UserError(
            f"{folder} holds pytorch_model.bin (a pickle, which can run code when loaded) and no safetensors; "
            "only safetensors are read: convert it to model.safetensors where you trust it"
        )
    raise UserError(f"{folder} holds neither {SINGLE_FILE} nor {INDEX_FILE}; point at a Hugging Face model folder")


def family_of(config: Mapping[str, Any], where: Path) -> str:
    """The registered family whose `hf_names` hold the config's `model_type` or one of its `architectures`."""
    from models import MODELS

    names = [config.get("model_type"), *(config.get("architectures") or [])]
    for family, spec in MODELS.items():
        if spec.args_from_hf_config is not None and any(n in spec.hf_names for n in names):
            return family
    known = "; ".join(f"{f}: {', '.join(s.hf_names)}" for f, s in MODELS.items() if s.args_from_hf_config)
    raise ConfigError(
        f"{where}: model_type {config.get('model_type')!r} (architectures {config.get('architectures')}) is no "
        f"model family here ({known}); load a folder of one of them"
    )


def _same(given: Any, found: Any) -> bool:
    """Equal, floats to a relative 1e-9 (a value written as text and read back differs by less)."""
    if isinstance(given, float) or isinstance(found, float):
        return isinstance(given, (int, float)) and isinstance(found, (int, float)) and math.isclose(given, found)
    return given == found and type(given) is type(found)


def apply_pretrained_config(cfg: JobConfig, given: Collection[str]) -> None:
    """Set `cfg`'s model (and tokenizer) from the folder `checkpoint.initial_load_path`, in place; nothing when
    there is none. `given`: the `section.key` options the user set (config file and command line), which the
    folder must agree with; the others take the folder's values.

    Raises:
        UserError: the folder, its config.json or its weight files cannot be used, or given options disagree with
            it (all of them named in one line).
    """
    if not cfg.checkpoint.initial_load_path or not cfg.checkpoint.initial_load_in_hf:
        return  # no folder, or one in a format `validate` refuses in its own words
    from models import MODELS
    from models.common.spec import ModelArgsError

    folder = Path(cfg.checkpoint.initial_load_path).expanduser()
    config = read_config(folder)
    where = folder / CONFIG_FILE
    family = family_of(config, where)
    if not cfg.checkpoint.resume:  # a resume reads its own checkpoint's weights: the folder's may be gone
        weights_file(folder)
    spec = MODELS[family]
    # The flavor only fills what config.json does not say (dropout, the init rule).
    names = [key.removeprefix("model.") for key in given if key.startswith("model.") and key != "model.flavor"]
    explicit = {name: getattr(cfg.model, name) for name in names}
    try:
        found = {"name": family, **spec.args_from_hf_config(config, explicit)}
    except ModelArgsError as e:
        raise ConfigError(f"{where}: {e}") from None
    disagree = [k for k, v in explicit.items() if v is not None and k in found and not _same(v, found[k])]
    if disagree:
        listed = ", ".join(
            f"--model.{k} {json.dumps(explicit[k])} (the folder: {json.dumps(found[k])})" for k in disagree
        )
        raise ConfigError(
            f"{listed} disagree{'s' if len(disagree) == 1 else ''} with {where}, which sets the model; drop "
            f"{'it' if len(disagree) == 1 else 'them'}, or load another folder"
        )
    for key, value in found.items():
        setattr(cfg.model, key, value)
    if "data.tokenizer" not in given and (folder / TOKENIZER_FILE).is_file():
        cfg.data.tokenizer = str(folder / TOKENIZER_FILE)


__all__ = [
    "CONFIG_FILE",
    "INDEX_FILE",
    "SINGLE_FILE",
    "TOKENIZER_FILE",
    "apply_pretrained_config",
    "family_of",
    "read_config",
    "read_json",
    "weights_file",
]
