"""The model registry: a family's name maps to its `ModelSpec` (models/common/spec.py).

A new family adds one entry here and nothing anywhere else; models/README.md lists the files it brings.
The trainer looks families up through `graph_trainer.job_config.model_args`, which turns an unknown name
or an impossible argument into a one-line config error.
"""

from __future__ import annotations

from models.common.spec import ModelSpec
from models.deepseek_v3 import SPEC as DEEPSEEK_V3
from models.llama3 import SPEC as LLAMA3

MODELS: dict[str, ModelSpec] = {spec.name: spec for spec in (LLAMA3, DEEPSEEK_V3)}

__all__ = ["MODELS", "ModelSpec"]
