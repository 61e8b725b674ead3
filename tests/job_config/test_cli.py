"""The `python -m graph_trainer` front end: exit codes, stderr messages, name resolution from another cwd."""

import os
import subprocess
import sys
import tomllib
import types
from pathlib import Path

import pytest

from graph_trainer import __main__ as cli
from graph_trainer.errors import UserError
from graph_trainer.job_config.schema import JobConfig

REPO = Path(__file__).resolve().parents[2]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "graph_trainer", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_help_exits_0_and_lists_options(tmp_path):
    result = _run(["--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "--training.steps" in result.stdout and "--activation_checkpoint.mode" in result.stdout


def test_help_with_a_hugging_face_folder_lists_its_familys_model_options(tmp_path, capsys):
    """--help listed Llama's [model] options for a DeepSeek-V3 folder, whose config.json sets the model."""
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"]}')
    assert cli.main(["--checkpoint.initial_load_path", str(tmp_path), "--help"]) == 0
    out = capsys.readouterr().out
    assert "[model] (family deepseek_v3):" in out and "--model.n_routed_experts" in out


def test_help_with_a_config_shows_its_values_as_defaults(tmp_path):
    """Issue 8.9: --help ignored --config and showed the built-in defaults as if they were the config's."""
    result = _run(["--config", "llama3_8b", "--help"], tmp_path)
    assert result.returncode == 0, result.stderr
    assert "Defaults shown below: llama3_8b.toml's values." in result.stdout
    assert "peak learning rate (default: 0.0003; > 0)" in result.stdout  # the 8B config's lr, not 8e-4
    plain = _run(["--help"], tmp_path).stdout
    assert "Defaults shown below: the built-in ones" in plain and "(default: 0.0008; > 0)" in plain


def test_print_config_resolves_a_shipped_name_from_another_directory(tmp_path):
    result = _run(["--config", "llama3_debug", "--training.steps", "7", "--print-config"], tmp_path)
    assert result.returncode == 0, result.stderr
    printed = tomllib.loads(result.stdout)
    assert printed["training"]["steps"] == 7 and printed["model"]["flavor"] == "debugmodel"


@pytest.mark.parametrize(
    "args, expected",
    [
        (["--training.stpes", "3"], "did you mean '--training.steps'?"),  # fails before torch is imported
        (["--config", "llama3_debug", "--training.seq_len", "100000"], "training.seq_len must be <="),
        (["--config"], "--config: expected one argument"),  # an argparse usage error
        # Disabling the memory policy while a mode asks for it would silently run without checkpointing.
        (
            [
                "--config",
                "llama3_debug",
                "--activation_checkpoint.mode",
                "selective",
                "--compile.disable_passes",
                "memory_policy",
            ],
            "compile.disable_passes has 'memory_policy', but activation_checkpoint.mode = 'selective' needs it",
        ),
        (
            [
                "--config",
                "llama3_debug",
                "--activation_checkpoint.mode",
                "full",
                "--compile.disable_passes",
                "activation_checkpoint",
            ],
            "pass 'activation_checkpoint' is now part of 'memory_policy'",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line_and_no_traceback(tmp_path, args, expected):
    result = _run(args, tmp_path)
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and expected in result.stderr
    assert result.stderr.count("\n") == 1


# In-process: the dispatch of main() to dry_run / Trainer and its exit codes.


def test_main_dispatches_dry_run_and_train(monkeypatch):
    calls = []
    monkeypatch.setitem(
        sys.modules,
        "graph_trainer.plan.dry_run",
        types.SimpleNamespace(dry_run=lambda cfg: calls.append(("dry_run", cfg))),
    )

    class FakeTrainer:
        def __init__(self, cfg: JobConfig, mesh=None):
            self.cfg = cfg

        def train(self):
            calls.append(("train", self.cfg))

    monkeypatch.setitem(sys.modules, "graph_trainer.trainer", types.SimpleNamespace(Trainer=FakeTrainer))
    assert cli.main(["--dry-run", "--training.steps", "3"]) == 0
    assert cli.main(["--training.steps", "4"]) == 0
    assert [(name, cfg.training.steps) for name, cfg in calls] == [("dry_run", 3), ("train", 4)]


def test_main_turns_user_errors_into_exit_2_and_interrupts_into_130(monkeypatch, capsys):
    def fail(cfg):
        raise UserError("dump folder is not empty: pass --job.overwrite")

    monkeypatch.setitem(sys.modules, "graph_trainer.plan.dry_run", types.SimpleNamespace(dry_run=fail))
    assert cli.main(["--dry-run"]) == 2
    assert capsys.readouterr().err == "error: dump folder is not empty: pass --job.overwrite\n"

    def interrupt(cfg):
        raise KeyboardInterrupt

    monkeypatch.setitem(sys.modules, "graph_trainer.plan.dry_run", types.SimpleNamespace(dry_run=interrupt))
    assert cli.main(["--dry-run"]) == 130


@pytest.mark.parametrize("option", [["--training.max_norm", "nan"], ["--optimizer.lr", "inf"]])
def test_a_non_finite_float_is_refused_before_the_run_starts(tmp_path, option):
    """Issue 22.6: `--training.max_norm nan` trained silently and `--optimizer.lr inf` ran until it diverged."""
    result = _run([*option, "--job.dump_folder", str(tmp_path / "run")], tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ") and result.stderr.count("\n") == 1, result.stderr
    assert option[0].removeprefix("--") in result.stderr and option[1] in result.stderr
    assert not (tmp_path / "run").exists()  # refused before anything was written
