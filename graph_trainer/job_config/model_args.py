"""Which model a config names: the registry lookup, the flavor and the overrides, as config errors.

args = build_model_args("llama3", "debugmodel", {"vocab_size": 32000, "n_layers": None})
model = get_model_spec("llama3").model_cls(args)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from graph_trainer.errors import ConfigError, closest_match
from models import MODELS, ModelSpec
from models.common.spec import ModelArgsError


def _unknown(kind: str, given: str, choices: list[str]) -> ConfigError:
    # Case-insensitive, so "8b" finds "8B".
    close = closest_match(given, choices, ignore_case=True)
    hint = f" Did you mean {close!r}?" if close else ""
    return ConfigError(f"unknown {kind} {given!r}; available: {', '.join(choices)}.{hint}")


def get_model_spec(name: str) -> ModelSpec:
    """The registered model family `name`; ConfigError (with a did-you-mean) if there is none."""
    if name not in MODELS:
        raise _unknown("model", name, list(MODELS))
    return MODELS[name]


def _field_names(spec: ModelSpec) -> list[str]:
    return [f.name for f in dataclasses.fields(spec.args_cls)]


def build_model_args(name: str, flavor: str, overrides: Mapping[str, Any] | None = None) -> Any:
    """The flavor's model arguments with the non-None `overrides` applied (e.g. from the command line).

    Raises:
        ConfigError: an unknown model, flavor or field, or arguments the family refuses (its `ModelArgsError`).
    """
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise _unknown(f"{name} flavor", flavor, list(spec.flavors))
    fields = _field_names(spec)
    changes = {key: value for key, value in (overrides or {}).items() if value is not None}
    for key in changes:
        if key not in fields:
            owners = [family for family, other in MODELS.items() if key in _field_names(other)]
            if owners:
                raise ConfigError(
                    f"model.{key} is an option of {' and '.join(owners)}, not of model.name {name!r}: set "
                    f"--model.name {owners[0]}, or drop --model.{key}"
                )
            raise _unknown(f"{name} model field", key, fields)
    try:
        return dataclasses.replace(spec.flavors[flavor], **changes)
    except ModelArgsError as e:
        raise ConfigError(str(e)) from None


__all__ = ["build_model_args", "get_model_spec"]
