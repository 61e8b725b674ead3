"""Optional packages that some tests need: the `test` extra installs them, so CI (CI=true) must have them.

A test module calls `transformers = import_extra("transformers")`: without the package it is skipped on a
developer's machine, and fails under CI=true, where a skip would hide that the tests never ran.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def import_extra(name: str) -> ModuleType:
    """`name` imported; skip the calling module without it, or fail when CI=true."""
    try:
        return importlib.import_module(name)
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail(f"{name} is in pyproject's test extra but is not installed (CI=true)", pytrace=False)
        pytest.skip(f"{name} is not installed (pip install -e '.[test]')", allow_module_level=True)
