"""Optional packages that some tests need: the `test` extra installs them, so CI (CI=true) must have them.

A test calls `transformers = import_extra("transformers")` (at module level or inside the test): without the
package it is skipped on a developer's machine; under CI=true, tests/conftest.py turns that skip into a failure,
where it would hide that the tests never ran.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType

import pytest


def import_extra(name: str) -> ModuleType:
    """`name` imported; without it, the caller is skipped (a failure under CI=true: tests/conftest.py)."""
    return pytest.importorskip(name, reason=f"could not import {name}, a test extra (pip install -e '.[test]')")


def child_pythonpath(repo: Path) -> str:
    """A child trainer process's PYTHONPATH: the checkout, then the caller's own. On the GPU image the carried
    packages (tomli-w) may be found only through the caller's PYTHONPATH (`pip install --target`); replacing it made
    every GPU test that starts a trainer fail there with ModuleNotFoundError (H200, 2026-11-30)."""
    return os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
