"""Job configuration: the schema, TOML loading, command-line overrides, validation.

The schema is plain dataclasses, one per TOML section, and `JobConfig` holds them
all. Each field carries its default, its one-line meaning and its declarative
limits (`choices`, `ge`/`gt`/`le`/`lt`) in one place; the command-line help, type
checks and range checks are all generated from them. Checks that involve more
than one field (seq_len against the model, data.path against data.source, the
activation-checkpoint op patterns) live in `validate`.

Precedence, lowest first: dataclass defaults, the `--config` TOML file, then
`--section.key VALUE` overrides. Every mistake raises `ConfigError` with a
one-line message naming the key, what is expected and what was given.
"""

import argparse
import dataclasses
import difflib
import math
import operator
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graph_trainer.errors import ConfigError

# Located relative to this file, so `--config llama3_debug` works from any cwd.
CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"


def _opt(default: Any, help: str, **limits: Any) -> Any:
    """A dataclass field with its meaning and limits kept next to its default.

    limits: `choices` (allowed values), `ge`, `gt`, `le`, `lt` (numeric bounds,
    applied to each element for list fields); see `_check_limits`.
    """
    meta = {"help": help, **limits}
    if isinstance(default, list):
        return field(default_factory=lambda: list(default), metadata=meta)
    return field(default=default, metadata=meta)


# ---------------------------------------------------------------------------
# Schema
# ---------------------------------------------------------------------------


@dataclass
class JobSection:
    dump_folder: str = _opt("./outputs", "folder for logs, TensorBoard events, checkpoints and the resolved config")
    description: str = _opt("", "free-text description of the run")
    overwrite: bool = _opt(False, "allow reusing a non-empty dump folder")


@dataclass
class ModelConfig:
    name: str = _opt("llama3", "model family in the models registry")
    flavor: str = _opt("debugmodel", "size preset of the model family")
    # Overrides of the flavor's ModelArgs; None keeps the flavor's value.
    n_layers: int | None = _opt(None, "override: number of transformer blocks", ge=1)
    dim: int | None = _opt(None, "override: model width", ge=1)
    n_heads: int | None = _opt(None, "override: attention heads", ge=1)
    n_kv_heads: int | None = _opt(None, "override: key/value heads (grouped-query attention)", ge=1)
    vocab_size: int | None = _opt(None, "override: vocabulary size (must cover the tokenizer's ids)", ge=1)
    ffn_dim_multiplier: float | None = _opt(None, "override: FFN hidden size multiplier", gt=0)
    multiple_of: int | None = _opt(None, "override: FFN hidden size is rounded up to a multiple of this", ge=1)
    rope_theta: float | None = _opt(None, "override: RoPE base frequency", gt=0)
    use_rope_scaling: bool | None = _opt(None, "override: apply Llama-3.1 RoPE frequency scaling")
    max_seq_len: int | None = _opt(None, "override: longest sequence the RoPE table covers", ge=1)
    dropout: float | None = _opt(None, "override: dropout probability", ge=0, lt=1)
    tie_embeddings: bool | None = _opt(None, "override: share the input embedding and output projection")
    norm_eps: float | None = _opt(None, "override: RMSNorm epsilon", gt=0)

    def overrides(self) -> dict[str, Any]:
        """The model-arg overrides that are set (not None), keyed by ModelArgs field name."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if f.name not in ("name", "flavor") and getattr(self, f.name) is not None
        }


@dataclass
class TrainingConfig:
    steps: int = _opt(20, "number of optimizer steps", ge=0)
    local_batch_size: int = _opt(8, "sequences per step on each data-parallel rank", ge=1)
    seq_len: int = _opt(256, "tokens per sequence (at most the model's max_seq_len)", ge=1)
    seed: int = _opt(0, "random seed for initialization and data")
    deterministic: bool = _opt(False, "use deterministic algorithms (bitwise reproducible runs)")
    max_norm: float = _opt(1.0, "gradient clipping max norm; <= 0 disables clipping")
    dtype: str = _opt("auto", "parameter/compute dtype; auto = float32 on CPU, bfloat16 on CUDA",
                      choices=("auto", "float32", "bfloat16"))
    device: str = _opt("auto", "device to train on; auto = cuda when available", choices=("auto", "cpu", "cuda"))


@dataclass
class OptimizerConfig:
    name: str = _opt("AdamW", "optimizer", choices=("AdamW",))
    lr: float = _opt(8e-4, "peak learning rate", gt=0)
    betas: list[float] = _opt([0.9, 0.95], "AdamW beta1, beta2", ge=0, lt=1)
    eps: float = _opt(1e-8, "AdamW epsilon", gt=0)
    weight_decay: float = _opt(0.1, "decoupled weight decay", ge=0)


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = _opt(2, "steps of linear warmup from ~0 to optimizer.lr", ge=0)
    decay_type: str = _opt("linear", "decay after warmup", choices=("linear", "cosine", "none"))
    min_lr_factor: float = _opt(0.0, "final lr as a fraction of optimizer.lr", ge=0, le=1)


@dataclass
class DataConfig:
    source: str = _opt("embedded", "training text: embedded corpus, a text file, a jsonl file, or random tokens",
                       choices=("embedded", "text", "jsonl", "synthetic"))
    path: str = _opt("", "input file (required for source text|jsonl)")
    tokenizer: str = _opt("byte", "'byte' (256 bytes + BOS/EOS) or a path to a HF tokenizer.json")


@dataclass
class ActivationCheckpointConfig:
    mode: str = _opt("none", "activation checkpointing", choices=("none", "selective", "full", "budget"))
    selective_ac_option: str | int = _opt(
        "op", "selective: 'op' = save compute-heavy ops, N = checkpoint every N-th layer")
    memory_budget: float = _opt(0.5, "budget: <= 1 = fraction of no-AC activation memory, > 1 = GiB", gt=0)
    save_list: list[str] = _opt([], "ops always saved, e.g. 'aten.mm' or 'layers.*.attention::aten.mm'")
    recompute_list: list[str] = _opt([], "ops always recomputed, same syntax as save_list")


@dataclass
class CompileConfig:
    mode: str = _opt("trace", "trace = whole step as one FX graph; eager = plain PyTorch baseline",
                     choices=("trace", "eager"))
    trace_optimizer: bool = _opt(False, "include the optimizer update in the traced graph")
    on_shape_change: str = _opt("retrace", "what to do when a batch has a new shape", choices=("retrace", "error"))
    dump_graphs: bool = _opt(False, "write the traced graphs (before/after passes) to the dump folder")
    disable_passes: list[str] = _opt([], "graph passes to skip, by registry name")
    log_saved_activations: bool = _opt(False, "log which activations the step graph keeps for backward")


@dataclass
class MetricsConfig:
    log_freq: int = _opt(1, "log every N steps", ge=1)
    enable_tensorboard: bool = _opt(True, "write TensorBoard events under the dump folder")
    track_memory: bool = _opt(True, "measure and log peak memory")


@dataclass
class CheckpointConfig:
    enable: bool = _opt(False, "save checkpoints")
    interval: int = _opt(10, "save every N steps", ge=1)
    folder: str = _opt("checkpoint", "checkpoint folder, relative to job.dump_folder")
    resume: bool = _opt(False, "resume from the latest checkpoint in the folder")
    keep_latest_k: int = _opt(2, "checkpoints to keep", ge=1)


@dataclass
class ParallelismConfig:
    dp_shard: int = _opt(1, "data-parallel degree (processes)", ge=1)


@dataclass
class JobConfig:
    """The whole job: one attribute per TOML section."""

    job: JobSection = field(default_factory=JobSection)
    model: ModelConfig = field(default_factory=ModelConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    activation_checkpoint: ActivationCheckpointConfig = field(default_factory=ActivationCheckpointConfig)
    compile: CompileConfig = field(default_factory=CompileConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in dataclasses.fields(JobConfig)}


def _fields(section_cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(section_cls)}


def _did_you_mean(name: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(name, candidates, n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


# ---------------------------------------------------------------------------
# Types
# ---------------------------------------------------------------------------

# Fields annotated `str | int` (selective_ac_option) accept both; the rest are
# `T`, `T | None` (model overrides) or `list[T]`.


def _type_parts(tp: Any) -> tuple[Any, ...]:
    """Non-None members of a union annotation (or the type itself)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(a for a in typing.get_args(tp) if a is not type(None))
    return (tp,)


def _type_name(tp: Any) -> str:
    if typing.get_origin(tp) is list:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    return {int: "int", float: "float", bool: "bool", str: "string"}[tp]


def _value_desc(value: Any) -> str:
    kind = {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "table"}.get(
        type(value), type(value).__name__)
    return f"{value!r} ({kind})"


def _coerce_scalar(value: Any, tp: type) -> Any:
    """`value` converted to `tp`, or raise TypeError. bool is not an int here, and int widens to float."""
    if tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    raise TypeError


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it normalized (int -> float for floats)."""
    parts = _type_parts(tp)
    expected = " or ".join(_type_name(p) for p in parts)
    for part in parts:
        if typing.get_origin(part) is list:
            if not isinstance(value, list):
                continue
            (elem,) = typing.get_args(part)
            out = []
            for i, item in enumerate(value):
                try:
                    out.append(_coerce_scalar(item, elem))
                except TypeError:
                    raise ConfigError(
                        f"{key}[{i}] expects a {_type_name(elem)}, got {_value_desc(item)}") from None
            return out
        try:
            return _coerce_scalar(value, part)
        except TypeError:
            continue
    raise ConfigError(f"{key} expects {'an' if expected[0] in 'aeiou' else 'a'} {expected}, "
                      f"got {_value_desc(value)}")


# ---------------------------------------------------------------------------
# Building a JobConfig from TOML data and overrides
# ---------------------------------------------------------------------------


def _apply(cfg: JobConfig, data: dict[str, Any], where: str) -> None:
    """Set every `[section] key = value` from parsed TOML `data` on `cfg` after type checks."""
    sections = _sections()
    for sec_name, table in data.items():
        if sec_name not in sections and not isinstance(table, dict):
            homes = [f"{s}.{sec_name}" for s, cls in sections.items() if sec_name in _fields(cls)]
            hint = f" (did you mean '{homes[0]}'?)" if homes else ""
            raise ConfigError(f"{where}: key '{sec_name}' must be inside a [section]{hint}")
        if sec_name not in sections:
            raise ConfigError(f"{where}: unknown section '[{sec_name}]'"
                              f"{_did_you_mean(sec_name, list(sections))}; "
                              f"sections are {', '.join(sections)}")
        if not isinstance(table, dict):
            raise ConfigError(f"{where}: '{sec_name}' must be a [{sec_name}] table, got {_value_desc(table)}")
        fields = _fields(sections[sec_name])
        section = getattr(cfg, sec_name)
        for key, value in table.items():
            _set(section, sec_name, key, value, fields, where)


def _set(section: Any, sec_name: str, key: str, value: Any, fields: dict, where: str) -> None:
    """Type-check and set one value; `where` (the file, or "" for the command line) prefixes errors."""
    full = f"{sec_name}.{key}"
    if key not in fields:
        suggestion = _did_you_mean(full, [f"{sec_name}.{k}" for k in fields])
        raise ConfigError(f"{where}: unknown key '{full}'{suggestion}")
    try:
        setattr(section, key, _coerce(full, value, fields[key].type))
    except ConfigError as e:
        raise ConfigError(f"{where}: {e}" if where else str(e)) from None


def _parse_cli_value(raw: str, tp: Any) -> Any:
    """A command-line VALUE: a TOML value when it parses as one, else the raw string.

    String fields keep the raw text unless it is a quoted TOML string, so
    `--data.path 2024` means the file "2024". List fields also accept a bare
    comma-separated list (`--compile.disable_passes dce,cse`).
    """
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    parts = _type_parts(tp)
    if str in parts and not isinstance(value, str) and not any(_accepts(p, value) for p in parts):
        return raw
    if any(typing.get_origin(p) is list for p in parts) and isinstance(value, str):
        return [_parse_cli_value(item.strip(), typing.get_args(parts[0])[0])
                for item in value.split(",") if item.strip()]
    return value


def _accepts(tp: Any, value: Any) -> bool:
    try:
        _coerce_scalar(value, tp)
        return True
    except TypeError:
        return False


# ---------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------

_OP_PATTERN = re.compile(
    r"^(?:(?P<module>[A-Za-z0-9_.*?\[\]]+)::)?aten\.(?P<op>[A-Za-z_][A-Za-z0-9_]*)(?:\.(?P<overload>[A-Za-z_][A-Za-z0-9_]*))?$"
)


_BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def _check_limits(key: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    """Apply a field's declared `choices` and bounds (to each element of a list)."""
    if value is None:
        return
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{key} must be one of {'|'.join(meta['choices'])}, got {value!r}")
    for item in value if isinstance(value, list) else [value]:
        for name, (holds, word) in _BOUNDS.items():
            # NaN fails every comparison, so it is rejected wherever a bound is declared.
            if name in meta and not holds(item, meta[name]):
                each = " (each element)" if isinstance(value, list) else ""
                raise ConfigError(f"{key} must be {word} {meta[name]}{each}, got {value!r}")


def validate(cfg: JobConfig) -> None:
    """Check types, ranges, choices and cross-field rules; raise ConfigError on the first problem.

    Normalizes in place: ints in float fields become floats, and a digit-string
    selective_ac_option becomes an int.

    Resolves the model args through `models.build_model_args` (imported here so
    that loading a config does not import the models package until needed).
    """
    for sec_name, sec_cls in _sections().items():
        section = getattr(cfg, sec_name)
        for name, f in _fields(sec_cls).items():
            key = f"{sec_name}.{name}"
            value = getattr(section, name)
            optional = type(None) in typing.get_args(f.type)
            if not (optional and value is None):
                setattr(section, name, _coerce(key, value, f.type))
            _check_limits(key, getattr(section, name), f.metadata)

    if len(cfg.optimizer.betas) != 2:
        raise ConfigError(f"optimizer.betas must be a list of 2 floats, got {cfg.optimizer.betas!r}")

    data = cfg.data
    if data.source in ("text", "jsonl") and not data.path:
        raise ConfigError(f"data.path is required for data.source = '{data.source}': "
                          f"set --data.path to the input file")
    if data.source not in ("text", "jsonl") and data.path:
        raise ConfigError(f"data.path is set ({data.path!r}) but data.source = '{data.source}' does not "
                          f"read files: set --data.source text or jsonl, or clear data.path")
    if not data.tokenizer:
        raise ConfigError("data.tokenizer must be 'byte' or a path to a tokenizer.json, got ''")

    ac = cfg.activation_checkpoint
    ac.selective_ac_option = _parse_ac_option(ac.selective_ac_option)
    for list_name in ("save_list", "recompute_list"):
        for i, pattern in enumerate(getattr(ac, list_name)):
            if not _OP_PATTERN.match(pattern):
                raise ConfigError(
                    f"activation_checkpoint.{list_name}[{i}] must look like 'aten.<op>[.<overload>]' "
                    f"or '<module glob>::aten.<op>' (e.g. 'aten.mm', 'layers.*.attention::aten.mm'), "
                    f"got {pattern!r}")
    both = sorted(set(ac.save_list) & set(ac.recompute_list))
    if both:
        raise ConfigError(f"activation_checkpoint: {both[0]!r} is in both save_list and recompute_list; "
                          f"keep it in one")

    if not cfg.checkpoint.folder:
        raise ConfigError("checkpoint.folder must be a non-empty path, got ''")
    if cfg.checkpoint.resume and not cfg.checkpoint.enable:
        raise ConfigError("checkpoint.resume = true needs checkpoint.enable = true: "
                          "add --checkpoint.enable")
    if not cfg.job.dump_folder:
        raise ConfigError("job.dump_folder must be a non-empty path, got ''")

    args = resolve_model_args(cfg)
    max_seq_len = getattr(args, "max_seq_len", None)
    if max_seq_len is not None and cfg.training.seq_len > max_seq_len:
        raise ConfigError(
            f"training.seq_len must be <= the model's max_seq_len ({max_seq_len} for "
            f"{cfg.model.name}/{cfg.model.flavor}), got {cfg.training.seq_len}: lower "
            f"--training.seq_len or raise --model.max_seq_len")


def _parse_ac_option(option: str | int) -> str | int:
    """'op' or a positive int; a string of digits (from the command line) becomes an int."""
    if isinstance(option, str) and option.isdigit():
        option = int(option)
    if option == "op" or (isinstance(option, int) and not isinstance(option, bool) and option >= 1):
        return option
    raise ConfigError(f"activation_checkpoint.selective_ac_option must be 'op' or a positive int, got {option!r}")


def resolve_model_args(cfg: JobConfig) -> Any:
    """The model's ModelArgs: the flavor's values with `cfg.model` overrides applied."""
    from models import build_model_args

    return build_model_args(cfg.model.name, cfg.model.flavor, cfg.model.overrides())


# ---------------------------------------------------------------------------
# Config file lookup and TOML
# ---------------------------------------------------------------------------


def shipped_configs() -> list[str]:
    """Names (without .toml) of the configs shipped in the repository's configs/ folder."""
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
    raise ConfigError(f"config '{name_or_path}' not found in the current directory or {CONFIGS_DIR}"
                      f"{_did_you_mean(stem, shipped)}; shipped configs: {', '.join(shipped) or 'none'}")


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


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def _toml_string(s: str) -> str:
    out = []
    for ch in s:
        if ch in ('"', "\\"):
            out.append("\\" + ch)
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\u{ord(ch):04x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def config_to_toml(cfg: JobConfig) -> str:
    """The config as TOML text that loads back to an equal JobConfig (None values are omitted)."""
    lines = []
    for sec_name in _sections():
        section = getattr(cfg, sec_name)
        lines.append(f"[{sec_name}]")
        for f in dataclasses.fields(section):
            value = getattr(section, f.name)
            if value is not None:
                lines.append(f"{f.name} = {_toml_value(value)}")
        lines.append("")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------

_NO_VALUE = object()  # argparse const for an option given without a value


@dataclass
class CliOptions:
    """What the command line asked for, besides the config values themselves."""

    config: str | None = None
    print_config: bool = False
    dry_run: bool = False
    help: bool = False
    # (section.key, raw value or None when given without a value), in order
    overrides: list[tuple[str, str | None]] = field(default_factory=list)


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> typing.NoReturn:
        raise ConfigError(f"{message} (see --help)")


def _metavar(f: dataclasses.Field) -> str:
    if "choices" in f.metadata:
        return "{" + ",".join(f.metadata["choices"]) + "}"
    parts = _type_parts(f.type)
    if parts == (str, int):
        return "op|INT"
    (tp,) = parts
    if typing.get_origin(tp) is list:
        return "LIST"
    return {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}[tp]


def _limits_text(meta: typing.Mapping[str, Any]) -> str:
    return ", ".join(f"{word} {meta[name]}" for name, (_, word) in _BOUNDS.items() if name in meta)


def build_parser() -> argparse.ArgumentParser:
    """The argument parser, with one `--section.key` option per config field."""
    parser = _Parser(
        prog="python -m graph_trainer",
        usage="%(prog)s [--config NAME_OR_PATH] [--print-config] [--dry-run] [--section.key VALUE ...]",
        description="Train a Llama-class model with the whole training step captured as one FX graph.",
        epilog="VALUE is read as a TOML value when it parses as one (numbers, true/false, [lists]), "
               "else as a string. A bool option given without a value means true. Command-line "
               "values override the config file.",
        add_help=False,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument("--config", metavar="NAME_OR_PATH",
                        help="TOML config: a shipped name (" + ", ".join(shipped_configs()) +
                             ") or a path to a file")
    parser.add_argument("--print-config", action="store_true",
                        help="print the resolved config as TOML and exit")
    parser.add_argument("--dry-run", action="store_true",
                        help="trace the step on fake tensors and report the memory plan; no training")
    for sec_name, sec_cls in _sections().items():
        group = parser.add_argument_group(f"[{sec_name}]")
        for name, f in _fields(sec_cls).items():
            default = "flavor's value" if f.default is None else repr(
                f.default_factory() if f.default is dataclasses.MISSING else f.default)
            limits = _limits_text(f.metadata)
            extra = f"; {limits}" if limits else ""
            # Only bools may omit the value (`--checkpoint.resume` means true).
            optional_value = {"nargs": "?", "const": _NO_VALUE} if bool in _type_parts(f.type) else {}
            group.add_argument(
                f"--{sec_name}.{name}", dest=f"{sec_name}.{name}", metavar=_metavar(f),
                default=argparse.SUPPRESS, **optional_value,
                help=f"{f.metadata['help']} (default: {default}{extra})".replace("%", "%%"),
            )
    return parser


def help_text() -> str:
    """The --help text, generated from the dataclasses."""
    return build_parser().format_help()


def _attach_dash_values(argv: list[str]) -> list[str]:
    """Rewrite `--optimizer.lr -1e-3` as `--optimizer.lr=-1e-3`: argparse would take '-1e-3' for an option."""
    valued = {f"--{s}.{k}" for s, cls in _sections().items()
              for k, f in _fields(cls).items() if bool not in _type_parts(f.type)}
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg in valued and i + 1 < len(argv) and argv[i + 1].startswith("-") and not argv[i + 1].startswith("--"):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
        else:
            out.append(arg)
            i += 1
    return out


def parse_cli(argv: list[str]) -> CliOptions:
    """Split argv into the front-end options and raw `--section.key` overrides (not yet type-checked)."""
    parser = build_parser()
    keys = [f"--{s}.{k}" for s, cls in _sections().items() for k in _fields(cls)]
    known, extras = parser.parse_known_args(_attach_dash_values(argv))
    for arg in extras:
        if arg.startswith("--"):
            option = arg.split("=", 1)[0]
            front = ["--config", "--print-config", "--dry-run", "--help"]
            raise ConfigError(f"unknown option '{option}'{_did_you_mean(option, keys + front)}")
        raise ConfigError(f"unexpected argument {arg!r}: options are --section.key VALUE (see --help)")
    values = vars(known)
    # argparse keeps only the last occurrence of each option; that is the one that wins anyway.
    overrides = [(k, None if v is _NO_VALUE else v) for k, v in values.items() if "." in k]
    return CliOptions(config=values["config"], print_config=values["print_config"],
                      dry_run=values["dry_run"], help=values["help"], overrides=overrides)


def build_config(opts: CliOptions) -> JobConfig:
    """Defaults, then the --config file, then command-line overrides; validated."""
    cfg = JobConfig()
    if opts.config is not None:
        path = resolve_config_path(opts.config)
        _apply(cfg, load_toml(path), str(path))
    sections = _sections()
    for key, raw in opts.overrides:
        sec_name, name = key.split(".", 1)
        f = _fields(sections[sec_name])[name]
        if raw is None:  # a bool option given without a value
            value: Any = True
        else:
            value = _parse_cli_value(raw, f.type)
        _set(getattr(cfg, sec_name), sec_name, name, value, _fields(sections[sec_name]), "")
    validate(cfg)
    return cfg


def load_config(argv: list[str]) -> tuple[JobConfig, CliOptions]:
    """Parse argv, load and override the config, validate it. For --help, the config is the defaults, unvalidated."""
    opts = parse_cli(argv)
    if opts.help:
        return JobConfig(), opts
    return build_config(opts), opts
