"""Building a JobConfig: config file lookup, TOML reading and writing, setting values, validation.

`validate` holds the checks that involve more than one field (seq_len against
the model, data.path against data.source, the activation-checkpoint op
patterns); single-field checks come from the schema's declared limits.
Every mistake raises `ConfigError` with a one-line message naming the key, what
is expected and what was given.
"""

import dataclasses
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import tomli_w

from graph_trainer.errors import ConfigError, did_you_mean
from graph_trainer.job_config.batching import check_global_batch, check_grad_sync
from graph_trainer.job_config.memory_budget import check_memory_budget, parse_memory_budget
from graph_trainer.job_config.pretrained import model_name
from graph_trainer.job_config.schema import JobConfig, field_aliases, section_fields, sections
from graph_trainer.job_config.values import check_limits, coerce, value_desc

# Located relative to this file, so `--config llama3_debug` works from any cwd: an installed
# wheel carries them as package data (graph_trainer/configs/, see pyproject.toml), a source
# checkout (editable install, PYTHONPATH) has them at the repository's top level.
_PACKAGE = Path(__file__).resolve().parent.parent  # graph_trainer/
_INSTALLED_CONFIGS = _PACKAGE / "configs"
CONFIGS_DIR = _INSTALLED_CONFIGS if _INSTALLED_CONFIGS.is_dir() else _PACKAGE.parent / "configs"


def apply_toml(cfg: JobConfig, data: dict[str, Any], where: str) -> None:
    """Set every `[section] key = value` from parsed TOML `data` on `cfg` after type checks."""
    known = sections()
    for sec_name, table in data.items():
        if sec_name not in known and not isinstance(table, dict):
            homes = [f"{s}.{sec_name}" for s, cls in known.items() if sec_name in section_fields(cls)]
            hint = f" (did you mean '{homes[0]}'?)" if homes else ""
            raise ConfigError(f"{where}: key '{sec_name}' must be inside a [section]{hint}")
        if sec_name not in known:
            raise ConfigError(
                f"{where}: unknown section '[{sec_name}]'"
                f"{did_you_mean(sec_name, list(known))}; "
                f"sections are {', '.join(known)}"
            )
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: '{sec_name}' must be a [{sec_name}] table, got {value_desc(table)}")
        fields = section_fields(known[sec_name])
        section = getattr(cfg, sec_name)
        for key, value in table.items():
            set_value(section, sec_name, key, value, fields, where)


def canonical_key(sec_name: str, key: str) -> str:
    """The field name of `key` in section `sec_name` (an alias resolved; an unknown key as it is)."""
    return field_aliases(sections()[sec_name]).get(key, key)


def set_value(section: Any, sec_name: str, key: str, value: Any, fields: dict, where: str) -> None:
    """Type-check and set one value; `where` (the file, or "" for the command line) prefixes errors.

    `key` may be a field's declared alias (e.g. torchtitan's `tensor_parallel_degree` for `tp`)."""
    key = field_aliases(type(section)).get(key, key)
    full = f"{sec_name}.{key}"
    if key not in fields:
        suggestion = did_you_mean(full, [f"{sec_name}.{k}" for k in fields])
        raise ConfigError(f"{where}: unknown key '{full}'{suggestion}")
    try:
        setattr(section, key, coerce(full, value, fields[key].type))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


OP_PATTERN = re.compile(
    r"^(?:(?P<module>[A-Za-z0-9_.*?\[\]]+)::)?aten\.(?P<op>[A-Za-z_][A-Za-z0-9_]*)(?:\.(?P<overload>[A-Za-z_][A-Za-z0-9_]*))?$"
)


def validate(cfg: JobConfig) -> None:
    """Check types, ranges, choices and cross-field rules; raise ConfigError on the first problem.

    Normalizes in place: ints in float fields become floats, and a digit-string
    selective_ac_option becomes an int.

    Resolves the model args through `graph_trainer.job_config.model_args.build_model_args` (imported here so
    that loading a config does not import the models package until needed).
    """
    for sec_name, sec_cls in sections().items():
        section = getattr(cfg, sec_name)
        for name, f in section_fields(sec_cls).items():
            key = f"{sec_name}.{name}"
            value = getattr(section, name)
            optional = type(None) in typing.get_args(f.type)
            if not (optional and value is None):
                setattr(section, name, coerce(key, value, f.type))
            check_limits(key, getattr(section, name), f.metadata)

    if len(cfg.optimizer.betas) != 2:
        raise ConfigError(f"optimizer.betas must be a list of 2 floats, got {cfg.optimizer.betas!r}")

    data = cfg.data
    file_sources = ("text", "jsonl", "chat", "hf_datasets")
    if data.source in file_sources and not data.path:
        raise ConfigError(f"data.path is required for data.source = '{data.source}': set --data.path to the input file")
    if data.source not in file_sources and data.path:
        raise ConfigError(
            f"data.path is set ({data.path!r}) but data.source = '{data.source}' does not "
            f"read files: set --data.source text, jsonl, chat or hf_datasets, or clear data.path"
        )
    if not data.tokenizer:
        raise ConfigError("data.tokenizer must be 'byte' or a path to a tokenizer.json, got ''")
    if data.shuffle and data.source != "hf_datasets":
        # An error, not an ignored option: these sources already visit their windows in a seeded random order.
        raise ConfigError(
            f"data.shuffle is for data.source = 'hf_datasets'; data.source = '{data.source}' always shuffles its "
            "windows (from training.seed): drop --data.shuffle"
        )

    ac = cfg.activation_checkpoint
    ac.selective_ac_option = parse_ac_option(ac.selective_ac_option)
    parse_memory_budget(ac.memory_budget)
    for list_name in ("save_list", "recompute_list"):
        for i, pattern in enumerate(getattr(ac, list_name)):
            if not OP_PATTERN.match(pattern):
                raise ConfigError(
                    f"activation_checkpoint.{list_name}[{i}] must look like 'aten.<op>[.<overload>]' "
                    f"or '<module glob>::aten.<op>' (e.g. 'aten.mm', 'layers.*.attention::aten.mm'), "
                    f"got {pattern!r}"
                )
    both = sorted(set(ac.save_list) & set(ac.recompute_list))
    if both:
        raise ConfigError(f"activation_checkpoint: {both[0]!r} is in both save_list and recompute_list; keep it in one")

    if not cfg.checkpoint.folder:
        raise ConfigError("checkpoint.folder must be a non-empty path, got ''")
    if cfg.checkpoint.resume and not cfg.checkpoint.enable:
        raise ConfigError("checkpoint.resume = true needs checkpoint.enable = true: add --checkpoint.enable")
    if cfg.checkpoint.initial_load_path and not cfg.checkpoint.initial_load_in_hf:
        raise ConfigError(
            "checkpoint.initial_load_in_hf = false (initial weights in this trainer's own format) is not "
            "supported: point checkpoint.initial_load_path at a Hugging Face folder, or continue a run of ours "
            "with --checkpoint.resume"
        )
    if not cfg.job.dump_folder:
        raise ConfigError("job.dump_folder must be a non-empty path, got ''")
    _check_mixed_precision(cfg)
    check_global_batch(cfg)
    check_grad_sync(cfg)
    check_memory_budget(cfg)

    args = resolve_model_args(cfg)
    max_seq_len = getattr(args, "max_seq_len", None)
    if max_seq_len is not None and cfg.training.seq_len > max_seq_len:
        raise ConfigError(
            f"training.seq_len must be <= the model's max_seq_len ({max_seq_len} for "
            f"{model_name(cfg)}), got {cfg.training.seq_len}: lower "
            f"--training.seq_len or raise --model.max_seq_len"
        )


def _check_mixed_precision(cfg: JobConfig) -> None:
    """FSDP mixed precision needs FSDP, and bf16 gathered parameters leave autocast nothing to decide."""
    t, shard = cfg.training, cfg.parallelism.dp_shard
    for key in ("mixed_precision_param", "mixed_precision_reduce"):
        value = getattr(t, key)
        if value != "float32" and shard <= 1:
            # An error, not an ignored option: a user who asked for bf16 must not silently train in fp32.
            raise ConfigError(
                f"training.{key} = {value!r} is FSDP's and needs parallelism.dp_shard > 1 (got "
                f"{shard}): set --parallelism.dp_shard N, or drop it and use --training.dtype "
                "bfloat16 (autocast) for one process or dp_replicate"
            )
    if t.mixed_precision_param != "float32" and t.dtype == "bfloat16":
        raise ConfigError(
            "training.dtype = 'bfloat16' (autocast over float32 parameters) and "
            "training.mixed_precision_param = 'bfloat16' (bfloat16 gathered parameters) both set the "
            "compute dtype: drop --training.dtype (auto means no autocast with bfloat16 parameters)"
        )


def parse_ac_option(option: str | int) -> str | int:
    """'op' or a positive int; a string of digits (from the command line) becomes an int."""
    if isinstance(option, str) and option.isdigit():
        option = int(option)
    if option == "op" or (isinstance(option, int) and not isinstance(option, bool) and option >= 1):
        return option
    raise ConfigError(f"activation_checkpoint.selective_ac_option must be 'op' or a positive int, got {option!r}")


def resolve_model_args(cfg: JobConfig) -> Any:
    """The model's ModelArgs: the flavor's values with `cfg.model` overrides applied."""
    from graph_trainer.job_config.model_args import build_model_args

    return build_model_args(cfg.model.name, cfg.model.flavor, cfg.model.overrides())


def shipped_configs() -> list[str]:
    """Names (without .toml) of the shipped configs (the repository's configs/ folder)."""
    return sorted(p.stem for p in CONFIGS_DIR.glob("*.toml"))


def resolve_config_path(name_or_path: str) -> Path:
    """A path with a '/' or an existing file is used as is; a bare name is looked up in configs/."""
    path = Path(name_or_path)
    if "/" in name_or_path or path.is_file():
        if path.is_file():
            return path
        raise ConfigError(f"config file '{name_or_path}' not found")
    for candidate in (CONFIGS_DIR / name_or_path, CONFIGS_DIR / f"{name_or_path}.toml"):
        if candidate.is_file():
            return candidate
    shipped = shipped_configs()
    stem = name_or_path.removesuffix(".toml")
    raise ConfigError(
        f"config '{name_or_path}' not found in the current directory or {CONFIGS_DIR}"
        f"{did_you_mean(stem, shipped)}; shipped configs: {', '.join(shipped) or 'none'}"
    )


def load_toml(path: Path) -> dict[str, Any]:
    """Parse a TOML file; syntax errors become `file:line:col: message`."""
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"cannot read config file '{path}': {e.strerror}") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line, col = getattr(e, "lineno", None), getattr(e, "colno", None)
        msg = getattr(e, "msg", str(e))
        if line is None:  # Python < 3.14 has no lineno; the position is inside the message
            match = re.search(r"\(at line (\d+), column (\d+)\)", msg)
            if match:
                line, col = int(match.group(1)), int(match.group(2))
                msg = msg[: match.start()].rstrip()
        where = f"{path}:{line}:{col}" if line is not None else str(path)
        raise ConfigError(f"{where}: invalid TOML: {msg}") from None


def config_to_toml(cfg: JobConfig) -> str:
    """The config as TOML text that loads back to an equal JobConfig (None values are omitted)."""
    return tomli_w.dumps(
        {
            name: {key: value for key, value in dataclasses.asdict(getattr(cfg, name)).items() if value is not None}
            for name in sections()
        }
    )
