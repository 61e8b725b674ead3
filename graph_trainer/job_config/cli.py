"""The command line: `--section.key VALUE` options generated from the config schema.

`parse_cli` splits argv into the front-end options (`--config`, `--print-config`,
`--dry-run`, `--help`) and raw overrides; `build_config` applies defaults, the
config file and then the overrides, and validates. argparse is wrapped so that
its errors become `ConfigError` (one line, exit 2) instead of usage + exit.
"""

import argparse
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from graph_trainer.errors import ConfigError, did_you_mean
from graph_trainer.job_config.data_source import apply_data_source
from graph_trainer.job_config.load import (
    apply_toml,
    canonical_key,
    load_toml,
    resolve_config_path,
    set_value,
    shipped_configs,
    validate,
)
from graph_trainer.job_config.pretrained import CONFIG_FILE, apply_pretrained_config, family_of, read_config
from graph_trainer.job_config.schema import JobConfig, section_fields, sections
from graph_trainer.job_config.values import limits_text, parse_cli_value, type_parts

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
    parts = type_parts(f.type)
    if parts == (str, int):
        return "op|INT"
    if parts == (str, float):
        return "SIZE|FRACTION"
    (tp,) = parts
    if typing.get_origin(tp) is list:
        return "LIST"
    return {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}[tp]


def build_parser(values: JobConfig | None = None, values_from: str | None = None) -> argparse.ArgumentParser:
    """The argument parser, with one `--section.key` option per config field.

    The help shows `values` (a config file's, named `values_from`) as each option's
    default; without them, the built-in defaults.
    """
    shown = "the built-in ones (with --config NAME, that config's)" if values is None else f"{values_from}'s values"
    parser = _Parser(
        prog="python -m graph_trainer",
        usage="%(prog)s [--config NAME_OR_PATH] [--print-config] [--dry-run] [--section.key VALUE ...]",
        description="Train a Llama-class model with the whole training step captured as one FX graph.\n"
        f"Defaults shown below: {shown}.",
        epilog="VALUE is read as a TOML value when it parses as one (numbers, true/false, [lists]), "
        "else as a string. A bool option given without a value means true. Command-line "
        "values override the config file.",
        add_help=False,
        allow_abbrev=False,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-h", "--help", action="store_true", help="show this help and exit")
    parser.add_argument(
        "--config",
        metavar="NAME_OR_PATH",
        help="TOML config: a shipped name (" + ", ".join(shipped_configs()) + ") or a path to a file",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as TOML and exit")
    parser.add_argument(
        "--dry-run", action="store_true", help="trace the step on fake tensors and report the memory plan; no training"
    )
    family = (values or JobConfig()).model.name  # [model] lists this family's options (each family has its own)
    for sec_name, sec_cls in sections().items():
        group = parser.add_argument_group(f"[{sec_name}]" if sec_name != "model" else f"[model] (family {family})")
        for name, f in section_fields(sec_cls).items():
            value = (
                (f.default_factory() if f.default is dataclasses.MISSING else f.default)
                if values is None
                else getattr(getattr(values, sec_name), name)
            )
            default = "flavor's value" if value is None else repr(value)
            limits = limits_text(f.metadata)
            extra = f"; {limits}" if limits else ""
            # Only bools may omit the value (`--checkpoint.resume` means true).
            optional_value = {"nargs": "?", "const": _NO_VALUE} if bool in type_parts(f.type) else {}
            alias = [f"--{sec_name}.{f.metadata['alias']}"] if "alias" in f.metadata else []
            words = f.metadata.get("help_by_family", {}).get(family)
            shown = f"override: {words}" if words else f.metadata["help"]
            other_family = "families" in f.metadata and family not in f.metadata["families"]
            group.add_argument(
                f"--{sec_name}.{name}",
                *alias,
                dest=f"{sec_name}.{name}",
                metavar=_metavar(f),
                default=argparse.SUPPRESS,
                **optional_value,
                # Another family's option is still parsed (and refused in one line if it is not the family's).
                help=argparse.SUPPRESS if other_family else f"{shown} (default: {default}{extra})".replace("%", "%%"),
            )
    return parser


def help_text(config: str | None = None, family: str | None = None) -> str:
    """The --help text, generated from the dataclasses; with `config` (a --config value), its values as defaults.
    [model] lists the options of `family` (a --model.name value), else of the config's or the default family."""
    values, values_from = JobConfig(), None
    if config is not None:
        path = resolve_config_path(config)
        apply_toml(values, load_toml(path), str(path))
        values_from = path.name
    if family is not None:
        values.model.name = family
    return build_parser(values if values_from or family else None, values_from or "the command line").format_help()


def help_family(opts: Any) -> str | None:
    """The family whose [model] options --help lists: the --model.name given, else the family of the Hugging Face
    folder --checkpoint.initial_load_path names (its config.json sets the model), else None (the config's).

    Raises:
        UserError: the folder's config.json cannot be read or names no family here (as a run would say).
    """
    overrides = dict(opts.overrides)
    if overrides.get("model.name"):
        return overrides["model.name"]
    folder = overrides.get("checkpoint.initial_load_path")
    if not folder:
        return None
    path = Path(folder).expanduser()
    return family_of(read_config(path), path / CONFIG_FILE)


def _attach_dash_values(argv: list[str]) -> list[str]:
    """Rewrite `--optimizer.lr -1e-3` as `--optimizer.lr=-1e-3`: argparse would take '-1e-3' for an option."""
    valued = {
        f"--{s}.{key}"
        for s, cls in sections().items()
        for k, f in section_fields(cls).items()
        if bool not in type_parts(f.type)
        for key in (k, f.metadata.get("alias", k))
    }
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
    keys = [f"--{s}.{k}" for s, cls in sections().items() for k in section_fields(cls)]
    known, extras = parser.parse_known_args(_attach_dash_values(argv))
    for arg in extras:
        if arg.startswith("--"):
            option = arg.split("=", 1)[0]
            front = ["--config", "--print-config", "--dry-run", "--help"]
            raise ConfigError(f"unknown option '{option}'{did_you_mean(option, keys + front)}")
        raise ConfigError(f"unexpected argument {arg!r}: options are --section.key VALUE (see --help)")
    values = vars(known)
    # argparse keeps only the last occurrence of each option; that is the one that wins anyway.
    overrides = [(k, None if v is _NO_VALUE else v) for k, v in values.items() if "." in k]
    return CliOptions(
        config=values["config"],
        print_config=values["print_config"],
        dry_run=values["dry_run"],
        help=values["help"],
        overrides=overrides,
    )


def given_keys(opts: CliOptions) -> set[str]:
    """section.key of every option the user set, in the --config file or on the command line (an option set to its
    default value is still given: a caller that fills in what the user left out must not read it off the value)."""
    given = {f"{key.split('.', 1)[0]}.{canonical_key(*key.split('.', 1))}" for key, _ in opts.overrides}
    if opts.config is not None:
        data = load_toml(resolve_config_path(opts.config))
        given |= {f"{s}.{canonical_key(s, k)}" for s, table in data.items() for k in table}
    return given


def build_config(opts: CliOptions) -> JobConfig:
    """Defaults, then the --config file, then command-line overrides; validated."""
    cfg = JobConfig()
    if opts.config is not None:
        path = resolve_config_path(opts.config)
        apply_toml(cfg, load_toml(path), str(path))
    known = sections()
    for key, raw in opts.overrides:
        sec_name, name = key.split(".", 1)
        fields = section_fields(known[sec_name])
        # A bool option given without a value means true.
        value: Any = True if raw is None else parse_cli_value(raw, fields[name].type)
        set_value(getattr(cfg, sec_name), sec_name, name, value, fields, "")
    given = given_keys(opts)
    apply_pretrained_config(cfg, given)  # the folder is the model: before the checks that read the model
    apply_data_source(cfg, given)  # the data path is the data: its files pick the source
    validate(cfg)
    return cfg


def load_config(argv: list[str]) -> tuple[JobConfig, CliOptions]:
    """Parse argv, load and override the config, validate it. For --help, the config is the defaults, unvalidated."""
    opts = parse_cli(argv)
    if opts.help:
        return JobConfig(), opts
    return build_config(opts), opts
