"""The README's test command trains a module's shared fixture once, however many pytest-xdist workers run.

A multi-rank training run behind a module-scoped fixture costs minutes on 2 cores. When the scheduler spreads a
module's tests over workers, each worker trains it again: that happened unseen with `--dist loadgroup` after
pytest 9.2 stopped honouring the node ids pytest-xdist 3.8 rewrites for its groups (CI trained test_tp's two
4-rank runs twice each). This runs the command's scheduler on a small suite and counts the setups.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.test_docs import TEST_COMMAND

pytest.importorskip("xdist")

SUITE = """
import os
import pytest

@pytest.fixture(scope="module")
def run():
    with open(os.environ["SETUP_LOG"], "a") as log:
        log.write(__name__ + "\\n")

@pytest.mark.parametrize("mode", ["a", "b", "c"])
def test_reads_the_run(run, mode):
    pass

def test_alone(tmp_path):
    pass

def test_reads_it_again(run):
    pass
"""


def test_each_module_fixture_is_set_up_once_on_two_workers(tmp_path):
    words = TEST_COMMAND.split()
    dist = words[words.index("--dist") + 1]
    for name in ("test_one", "test_two", "test_three"):
        (tmp_path / f"{name}.py").write_text(SUITE)
    log = tmp_path / "setups.log"
    command = [sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", dist, "-p", "no:cacheprovider", str(tmp_path)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}  # not this session's options
    done = subprocess.run(
        command, cwd=tmp_path, env={**env, "SETUP_LOG": str(log)}, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert sorted(log.read_text().split()) == ["test_one", "test_three", "test_two"], done.stdout
