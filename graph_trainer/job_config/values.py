"""Config values: checking a value against its field's annotation and declared limits.

Shared by TOML loading and command-line overrides (`graph_trainer.job_config.load`,
`graph_trainer.job_config.cli`), so a value is judged the same way wherever it comes from.
Every mistake raises `ConfigError` naming the key, what is expected and what was given.
"""

import math
import operator
import tomllib
import types
import typing
from typing import Any

from graph_trainer.errors import ConfigError

# Fields annotated `str | int` (selective_ac_option) or `str | float` (memory_budget) accept both; the rest are
# `T`, `T | None` (model overrides) or `list[T]`.


def type_parts(tp: Any) -> tuple[Any, ...]:
    """Non-None members of a union annotation (or the type itself)."""
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        return tuple(a for a in typing.get_args(tp) if a is not type(None))
    return (tp,)


def type_name(tp: Any) -> str:
    """A field type in words: int, float, bool, string, list of T."""
    if typing.get_origin(tp) is list:
        return f"list of {type_name(typing.get_args(tp)[0])}"
    return {int: "int", float: "float", bool: "bool", str: "string"}[tp]


def value_desc(value: Any) -> str:
    kind = {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "table"}.get(
        type(value), type(value).__name__
    )
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


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; return it normalized (int -> float for floats)."""
    parts = type_parts(tp)
    expected = " or ".join(type_name(p) for p in parts)
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
                    raise ConfigError(f"{key}[{i}] expects a {type_name(elem)}, got {value_desc(item)}") from None
            return out
        try:
            return _coerce_scalar(value, part)
        except TypeError:
            continue
    raise ConfigError(f"{key} expects {'an' if expected[0] in 'aeiou' else 'a'} {expected}, got {value_desc(value)}")


def parse_cli_value(raw: str, tp: Any) -> Any:
    """A command-line VALUE: a TOML value when it parses as one, else the raw string.

    String fields keep the raw text unless it is a quoted TOML string, so
    `--data.path 2024` means the file "2024". List fields also accept a bare
    comma-separated list (`--compile.disable_passes dce,cse`).
    """
    try:
        value = tomllib.loads(f"v = {raw}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw
    parts = type_parts(tp)
    if str in parts and not isinstance(value, str) and not any(_accepts(p, value) for p in parts):
        return raw
    if any(typing.get_origin(p) is list for p in parts) and isinstance(value, str):
        return [
            parse_cli_value(item.strip(), typing.get_args(parts[0])[0]) for item in value.split(",") if item.strip()
        ]
    return value


def _accepts(tp: Any, value: Any) -> bool:
    try:
        _coerce_scalar(value, tp)
        return True
    except TypeError:
        return False


# ---------------------------------------------------------------------------
# Validation

BOUNDS = {"ge": (operator.ge, ">="), "gt": (operator.gt, ">"), "le": (operator.le, "<="), "lt": (operator.lt, "<")}


def check_limits(key: str, value: Any, meta: typing.Mapping[str, Any]) -> None:
    """Apply a field's declared `choices` and bounds (to each element of a list)."""
    if value is None:
        return
    for item in value if isinstance(value, list) else [value]:
        # Every float option, declared bounds or not: nan and inf are never a setting (a nan max_norm once
        # trained without a word, an inf lr until the divergence guard stopped it).
        if isinstance(item, float) and not math.isfinite(item):
            raise ConfigError(f"{key} must be a finite number, got {item!r}: give a real value")
    if "choices" in meta and value not in meta["choices"]:
        raise ConfigError(f"{key} must be one of {'|'.join(meta['choices'])}, got {value!r}")
    for item in value if isinstance(value, list) else [value]:
        for name, (holds, word) in BOUNDS.items():
            # NaN fails every comparison, so it is rejected wherever a bound is declared.
            if name in meta and not holds(item, meta[name]):
                each = " (each element)" if isinstance(value, list) else ""
                raise ConfigError(f"{key} must be {word} {meta[name]}{each}, got {value!r}")


def limits_text(meta: typing.Mapping[str, Any]) -> str:
    """A field's declared bounds as text, e.g. ">= 0, < 1" (for --help)."""
    return ", ".join(f"{word} {meta[name]}" for name, (_, word) in BOUNDS.items() if name in meta)
