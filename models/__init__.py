"""Model registry: a model name maps to its config class, module class and named flavors.

args = build_model_args("llama3", "debugmodel", {"vocab_size": 32000, "n_layers": None})
model = get_model_spec("llama3").model_cls(args)
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from graph_trainer.errors import ConfigError, closest_match
from models.llama3 import LLAMA3_FLAVORS, ModelArgs, Transformer


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to build one model family."""

    name: str
    args_cls: type
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]


MODELS: dict[str, ModelSpec] = {
    "llama3": ModelSpec(name="llama3", args_cls=ModelArgs, model_cls=Transformer, flavors=LLAMA3_FLAVORS),
}


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


def build_model_args(name: str, flavor: str, overrides: Mapping[str, Any] | None = None) -> ModelArgs:
    """The flavor's config with the non-None `overrides` applied (e.g. from the command line).

    Unknown model, flavor or field names raise ConfigError naming the valid ones.
    """
    spec = get_model_spec(name)
    if flavor not in spec.flavors:
        raise _unknown(f"{name} flavor", flavor, list(spec.flavors))
    fields = [f.name for f in dataclasses.fields(spec.args_cls)]
    changes = {key: value for key, value in (overrides or {}).items() if value is not None}
    for key in changes:
        if key not in fields:
            raise _unknown(f"{name} model field", key, fields)
    return dataclasses.replace(spec.flavors[flavor], **changes)
