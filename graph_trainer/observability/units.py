"""Byte units, defined once: GiB and MiB are binary (1024**3, 1024**2), as torch and dashboards report memory."""

from __future__ import annotations

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
