"""Byte units, defined once: GiB and MiB are binary (1024**3, 1024**2), as torch and dashboards report memory."""

from __future__ import annotations

import math

KIB = 1024
MIB = 1024**2
GIB = 1024**3
MIB_PER_GIB = GIB // MIB


def to_gib(nbytes: int | float | None) -> float | None:
    """Bytes -> GiB (1024**3); None stays None."""
    return None if nbytes is None else nbytes / GIB


def to_mib(nbytes: int | float | None) -> float | None:
    """Bytes -> MiB (1024**2); None stays None."""
    return None if nbytes is None else nbytes / MIB


def gib_text(nbytes: int | float) -> str:
    """A size in GiB to read in a sentence: three significant digits at any scale (a debug model's 0.0354, an 8B
    step's 61.2), where a fixed number of decimals printed a small size as 0."""
    return f"{nbytes / GIB:.3g}"


def gib_at_least(nbytes: int | float) -> str:
    """A GiB figure to suggest for a memory option: `nbytes` rounded *up*, to two significant digits below 10 GiB
    and to a whole GiB above, so the suggestion is never below what it has to hold (rounded to the nearest whole
    GiB, 5.3 needed read as 5, and a debug model's 0.02 as 0, which fits nothing)."""
    gib = nbytes / GIB
    if gib <= 0:
        return "0"
    exponent = math.floor(math.log10(gib))
    decimals = max(0, 1 - exponent)
    value = math.ceil(round(gib * 10**decimals, 9)) / 10**decimals  # round(): 0.3 * 10 is 3.0000000000000004
    text = f"{value:.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text
