"""What both families' Hugging Face adapters share: the names outside the blocks, the block-name patterns, and how
a `config.json` field is compared with the model arguments. Plain Python and dataclasses, like the adapters."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# Our names <-> Hugging Face's, outside the blocks (the same in every decoder-only family here).
TOP_NAMES = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
OURS_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")
HF_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class ConfigMismatch:
    """A `config.json` field that disagrees with the model arguments: what each side says and which of our
    options sets it (for the fix)."""

    field: str
    found: Any
    expected: Any
    option: str


def same_value(found: Any, expected: Any) -> bool:
    """Equal, with floats compared as floats (JSON writes 500000.0 as 500000) to a relative 1e-9: a value
    written as text and read back differs by less."""
    if isinstance(found, Mapping) and isinstance(expected, Mapping):
        return found.keys() == expected.keys() and all(same_value(found[k], expected[k]) for k in found)
    if isinstance(found, bool) or isinstance(expected, bool):
        return found is expected
    if isinstance(found, (int, float)) and isinstance(expected, (int, float)):
        return math.isclose(found, expected, rel_tol=1e-9)
    return found == expected


__all__ = ["HF_LAYER", "OURS_LAYER", "TOP_NAMES", "ConfigMismatch", "same_value"]
