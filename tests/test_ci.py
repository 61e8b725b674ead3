"""CI cannot pass by not running: under CI=true tests/conftest.py fails a skip for a missing package or module
(and lets through only the legitimate ones it lists, such as a GPU test without CUDA), and `.ci/run` fails when
a pytest call collects nothing."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]
REPO = Path(__file__).resolve().parents[1]

MODULE = """
import pytest

def test_missing_package():
    pytest.importorskip("no_such_package_for_graph_trainer")

@pytest.mark.skipif(True, reason="needs torch.distributed with the gloo backend")
def test_missing_backend():
    pass

@pytest.mark.skipif(True, reason="needs a CUDA device")
def test_gpu_only():
    pass

def test_runs():
    pass
"""
MODULE_LEVEL = """
import pytest
pytest.importorskip("no_such_package_for_graph_trainer")

def test_never_collected():
    pass
"""


def _run(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, ci: bool, module: str) -> pytest.RunResult:
    pytester.makepyfile(test_mod=module)
    if ci:
        monkeypatch.setenv("CI", "true")
    else:
        monkeypatch.delenv("CI", raising=False)
    return pytester.runpytest_inprocess("-p", "tests.conftest", "-q")


def test_under_ci_a_skip_for_a_missing_package_fails_and_a_gpu_skip_without_cuda_does_not(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, True, MODULE)
    # the package skip fails (in the test's call); the backend skip is an error (in its setup)
    result.assert_outcomes(passed=1, failed=1, errors=1, skipped=1)
    result.stdout.fnmatch_lines(["*skipped under CI=true: could not import 'no_such_package_for_graph_trainer'*"])


def test_under_ci_a_module_skipped_for_a_missing_package_is_a_collection_error(pytester, monkeypatch):
    result = _run(pytester, monkeypatch, True, MODULE_LEVEL)
    result.assert_outcomes(errors=1)
    assert result.ret != 0


def test_a_gpu_skip_is_legitimate_only_on_a_machine_without_cuda(monkeypatch):
    from tests.conftest import is_legitimate

    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert is_legitimate("needs a CUDA device")
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert not is_legitimate("needs a CUDA device")
    assert not is_legitimate("needs torch.distributed with the gloo backend")


@pytest.mark.parametrize("module, skipped", [(MODULE, 3), (MODULE_LEVEL, 1)])
def test_without_ci_the_same_skips_skip(pytester, monkeypatch, module, skipped):
    result = _run(pytester, monkeypatch, False, module)
    result.assert_outcomes(passed=int(module == MODULE), skipped=skipped)


# Stand-ins for what `.ci/run` calls, so that its own logic runs in a second: `python3.11 -m venv` makes a
# .venv whose activate puts fake `pip`, `ruff` and `python` first on PATH; the fake python answers the unit
# pytest call with $UNIT_RC and the `-m integration` one with $INTEGRATION_RC (run_tests.py: 0).
FAKE_PYTHON = """#!/bin/sh
case "$*" in
  *"-m pytest"*integration*) exit "$INTEGRATION_RC" ;;
  *"-m pytest"*) exit "$UNIT_RC" ;;
esac
exit 0
"""
FAKE_VENV = """#!/bin/sh
mkdir -p .venv/bin && cp "$FAKES"/python "$FAKES"/pip "$FAKES"/ruff .venv/bin/
echo 'PATH="$PWD/.venv/bin:$PATH"' > .venv/bin/activate
"""


def _ci_run(tmp_path: Path, unit_rc: int, integration_rc: int) -> subprocess.CompletedProcess:
    clone, fakes = tmp_path / "clone", tmp_path / "fakes"
    (clone / ".ci").mkdir(parents=True)
    fakes.mkdir()
    shutil.copy2(REPO / ".ci" / "run", clone / ".ci" / "run")
    for name, text in {"python": FAKE_PYTHON, "pip": "#!/bin/sh\nexit 0\n", "ruff": "#!/bin/sh\nexit 0\n"}.items():
        (fakes / name).write_text(text)
    (fakes / "python3.11").write_text(FAKE_VENV)
    for f in fakes.iterdir():
        f.chmod(0o755)
    env = dict(os.environ, PATH=f"{fakes}:/usr/bin:/bin", FAKES=str(fakes))
    env |= {"UNIT_RC": str(unit_rc), "INTEGRATION_RC": str(integration_rc)}
    return subprocess.run(["bash", str(clone / ".ci" / "run")], env=env, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("unit_rc, integration_rc", [(5, 0), (0, 5)])
def test_ci_run_fails_when_a_pytest_call_collects_nothing(tmp_path, unit_rc, integration_rc):
    proc = _ci_run(tmp_path, unit_rc, integration_rc)
    assert proc.returncode == 5, proc.stdout + proc.stderr
    assert "5 means it collected no tests" in proc.stdout


def test_ci_run_passes_when_every_step_passes(tmp_path):
    proc = _ci_run(tmp_path, 0, 0)
    assert proc.returncode == 0, proc.stdout + proc.stderr


SLOW = """
import pytest

@pytest.mark.integration
@pytest.mark.slow(held_by={held_by!r})
def test_large():
    pass

@pytest.mark.integration
def test_small():
    pass
"""


@pytest.mark.parametrize(
    "held_by, words",
    [
        ("test_mod.py::test_small", None),
        ("test_mod.py::test_absent", "name the test CI runs that holds its claim"),
        ("", "name the test CI runs that holds its claim"),
        ("test_mod.py::test_large", "held_by naming itself"),
    ],
)
def test_a_slow_test_names_the_ci_test_that_holds_its_claim_and_ci_leaves_only_it_out(
    pytester, monkeypatch, held_by, words
):
    """`.ci/run` leaves `slow` tests out; each names the test CI runs in its place (`tests/conftest.py`)."""
    pytester.makepyfile(test_mod=SLOW.format(held_by=held_by))
    monkeypatch.delenv("CI", raising=False)
    result = pytester.runpytest_inprocess("-p", "tests.conftest", "-q", "-m", "integration and not slow")
    if words is None:
        result.assert_outcomes(passed=1, deselected=1)
    else:
        assert result.ret == pytest.ExitCode.USAGE_ERROR and words in result.stderr.str() + result.stdout.str()


def test_a_slow_test_that_is_not_integration_is_refused(pytester, monkeypatch):
    module = SLOW.format(held_by="test_mod.py::test_small").replace(
        "@pytest.mark.integration\n@pytest.mark.slow", "@pytest.mark.slow"
    )
    pytester.makepyfile(test_mod=module)
    result = pytester.runpytest_inprocess("-p", "tests.conftest", "-q")
    assert result.ret == pytest.ExitCode.USAGE_ERROR and "but not integration" in result.stderr.str()


def test_ci_leaves_out_only_the_slow_integration_tests():
    script = (REPO / ".ci" / "run").read_text()
    assert '-m "integration and not slow"' in script
