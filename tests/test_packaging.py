"""A non-editable install works: the wheel carries every package and the shipped configs.

The wheel is built from this checkout and installed into a fresh virtual environment
with `--no-deps`; torch and the other dependencies come from the environment running
the tests (its site-packages is put on the new environment's path as a plain folder,
so an editable install of a checkout there is not activated). The trainer then runs
from an unrelated folder with no PYTHONPATH, so nothing can come from the checkout.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from tests.extras import import_extra

REPO = Path(__file__).resolve().parent.parent


def _packages_in_tree() -> set[str]:
    found = set()
    for top in ("graph_trainer", "models"):
        for init in (REPO / top).rglob("__init__.py"):
            found.add(".".join(init.parent.relative_to(REPO).parts))
    return found


def test_pyproject_lists_every_package_and_ships_the_configs():
    setuptools_cfg = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools_cfg["packages"])
    assert listed - {"graph_trainer.configs"} == _packages_in_tree()
    assert setuptools_cfg["package-dir"]["graph_trainer.configs"] == "configs"
    assert (REPO / "configs" / "llama3_debug.toml").is_file()


def _run(cmd: list, **kw) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, **kw)
    assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.mark.integration
def test_wheel_installed_in_a_fresh_venv_trains_a_shipped_config_from_another_folder(tmp_path):
    import_extra("setuptools")  # the wheel is built without build isolation (offline)
    wheels, venv, elsewhere = tmp_path / "wheels", tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    env["OMP_NUM_THREADS"] = env.get("OMP_NUM_THREADS", "1")
    # Built from a copy: setuptools leaves build/ and *.egg-info in the source tree, and a stale
    # build/ could put deleted modules into a later wheel.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("graph_trainer", "models", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    _run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", wheels, src],
        env=env,
        cwd=tmp_path,
    )
    (wheel,) = wheels.glob("graph_trainer-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", venv], env=env)
    python = venv / "bin" / "python"
    purelib = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], env=env).stdout.strip()
    )
    host_libs = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (purelib / "host_dependencies.pth").write_text("\n".join(sorted(host_libs)) + "\n")
    _run([sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index", "-q", wheel], env=env)

    where = _run(
        [python, "-c", "import graph_trainer, models; print(graph_trainer.__file__, models.__file__)"],
        env=env,
        cwd=elsewhere,
    ).stdout.split()
    assert all(Path(p).is_relative_to(venv) for p in where), where
    _run([python, "-m", "graph_trainer", "--config", "llama3_debug", "--training.steps", "1"], env=env, cwd=elsewhere)
    final = json.loads((elsewhere / "outputs" / "llama3_debug" / "summary.json").read_text())["final"]
    assert final["status"] == "ok" and final["final_step"] == 1
