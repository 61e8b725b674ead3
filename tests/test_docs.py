"""Every command in every documentation page still works verbatim.

A command is a line of a ```bash block, a `$ ` line of any block, or an inline `python ...`,
`torchrun ...` or `pip ...` span, in README.md, docs/*.md, models/README.md and passes/README.md.
Each is checked as written, by the program it names:

- the trainer (`python -m graph_trainer ...`, also under `torchrun`): its arguments resolve through
  the trainer's own command line into a validated config (an option renamed or a value refused
  fails here), and under torchrun the process count is the data-parallel degree;
- the benchmarks, `run_tests.py` and `python -m graph_trainer.export`: the script's own argparse
  parser accepts the arguments (parsing stops it before any work);
- `python -m pytest`: every marker it selects is declared; pip: every extra it names exists;
- the quick-start commands: the test command is what `.ci/run` runs verbatim, and the training one
  installs the same way;
- the cheap trainer commands (--help, --print-config, a one-step run) run verbatim in a shell
  (`-m integration`), and the rest run in the tests named in RUN_ELSEWHERE.

Running every command (the 8B dry runs, 20-step trainings, the benchmarks) would add tens of
minutes of CI, so those are parsed here and run where the table says.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import runpy
import shlex
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path
from unittest import mock

import pytest

from graph_trainer.distributed.mesh import ParallelDims
from graph_trainer.job_config.cli import help_text, load_config
from graph_trainer.job_config.reference import COMMAND as REFERENCE_COMMAND

REPO = Path(__file__).resolve().parent.parent
PAGES = sorted(
    [REPO / "README.md", REPO / "models" / "README.md", REPO / "graph_trainer" / "passes" / "README.md"]
    + list((REPO / "docs").glob("*.md"))
)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
INLINE = re.compile(r"`((?:python|python3\.11|torchrun|pip) [^`]+)`")
# Inline spans that name a program without being a command to run.
FRAGMENTS = {
    "python -m graph_trainer ...",
    "torchrun --standalone",
    "python -m graph_trainer.export ... --format hf",
    "python -m graph_trainer.export",
}
# Shell utilities a page uses around the trainer (to wait, stop a run, show its exit code): nothing to check.
SHELL_UTILITIES = {"sleep", "kill", "echo"}
# `VAR=value` before a command: the environment it runs in.
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S+$")
# Commands run verbatim (or as their exact argv) by another test, which checks more than success.
RUN_ELSEWHERE = {
    "python -m graph_trainer --config llama3_8b.toml --dry-run": "tests/plan/test_planner.py",
    "python examples/bring_your_own_model.py": "tests/test_examples.py",
    "python examples/make_dataset.py outputs/data": "tests/data/test_hf_datasets.py",
    "python run_tests.py out/ --suite quick --collect-peak-memory --parallel 2": ".ci/run",
    REFERENCE_COMMAND: "tests/job_config/test_reference.py",
}
RUN_HERE = [
    "python -m graph_trainer --config llama3_debug.toml --help",
    "python -m graph_trainer --config llama3_debug.toml --print-config",
    "python -m graph_trainer --config llama3_debug.toml --compile.dump_graphs true --training.steps 1 "
    "--job.dump_folder outputs/graphs",
]


def _commands(text: str) -> list[str]:
    found = []
    for lang, body in FENCE.findall(text):
        body = body.replace("\\\n", " ")  # a line continued with a backslash is one command
        for line in body.splitlines():
            line = line.strip()
            if line.startswith("$ "):
                found.append(line[2:])
            elif lang == "bash" and line and not line.startswith("#"):
                found.append(line)
    for span in INLINE.findall(FENCE.sub("", text)):
        found.append(" ".join(span.split()))
    # Drop trailing comments; the command itself is kept as written.
    return [" ".join(shlex.split(c, comments=True)) if "#" in c else c for c in found]


def first_bash_block(page: Path, holding: str = "") -> list[str]:
    """The commands of the first ```bash block of `page` (that holds `holding`)."""
    body = next(body for lang, body in FENCE.findall(page.read_text()) if lang == "bash" and holding in body)
    return _commands(f"```bash\n{body}```\n")


# The Hugging Face round trip runs verbatim, one command after the other, in tests/checkpoint/test_hf_weights.py.
HF_ROUND_TRIP = first_bash_block(REPO / "docs" / "hf_weights.md")
RUN_ELSEWHERE.update(dict.fromkeys(HF_ROUND_TRIP, "tests/checkpoint/test_hf_weights.py"))
# So does the README's chat fine-tune (a stand-in instruct model and chats, trained, exported), in test_chat.py.
CHAT_FINETUNE = first_bash_block(REPO / "README.md", "examples/make_chat_model.py")
RUN_ELSEWHERE.update(dict.fromkeys(CHAT_FINETUNE, "tests/data/test_chat.py"))


def all_commands() -> list[tuple[str, str]]:
    """(page, command) for every command in every page."""
    return [(str(p.relative_to(REPO)), c) for p in PAGES for c in _commands(p.read_text())]


class _Parsed(Exception):
    """Raised once argparse has accepted a command line, so the program does no work."""


def _parse_only(run, argv: list[str]) -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise _Parsed

    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop):
        with mock.patch.object(sys, "argv", argv), pytest.raises(_Parsed):
            run()


# The folder the Hugging Face round trip's first command writes (a 6-layer Llama, docs/hf_weights.md); commands after
# it load it, and the config reads its config.json: a stand-in holds that file (and an empty weights file).
HF_TINY = "outputs/hf_tiny"
HF_TINY_ARGS = (
    "vocab_size=2048, hidden_size=64, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4, "
    "num_key_value_heads=2, rope_theta=500000.0, rms_norm_eps=1e-5"
)


@contextlib.contextmanager
def _documented_folders(argv: list[str]):
    """Run in a temporary folder that holds the round trip's `outputs/hf_tiny` when `argv` loads it."""
    if HF_TINY not in argv:
        yield
        return
    assert HF_TINY_ARGS in HF_ROUND_TRIP[0] and HF_TINY in HF_ROUND_TRIP[0], "the stand-in must be the documented model"
    config = {"model_type": "llama", **{k: json.loads(v) for k, v in (a.split("=") for a in HF_TINY_ARGS.split(", "))}}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp, HF_TINY)
        folder.mkdir(parents=True)
        (folder / "config.json").write_text(json.dumps(config))
        (folder / "model.safetensors").touch()
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            yield
        finally:
            os.chdir(cwd)


def _check_trainer(argv: list[str], nproc: int = 1) -> None:
    with _documented_folders(argv):
        cfg, opts = load_config(argv)
    if opts.help:
        assert "--training.steps" in help_text(opts.config)
        return
    if not opts.dry_run:  # a dry run plans one rank of N without a launch
        p = cfg.parallelism
        assert nproc == ParallelDims.from_config(p).world_size, "torchrun must start one process per rank of the mesh"


def _check_plan(argv: list[str]) -> None:
    """The planner's own options parse, and the rest resolve through the trainer's command line."""
    from graph_trainer.plan.__main__ import _parser, trainer_argv

    opts, rest = _parser().parse_known_args(argv)
    with _documented_folders(rest):
        load_config(trainer_argv(opts, rest))


def _check_pytest(argv: list[str]) -> None:
    markers = {
        m.split(":")[0]
        for m in tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    }
    for i, arg in enumerate(argv):
        if arg == "-m":
            assert set(re.findall(r"\w+", argv[i + 1])) - {"and", "or", "not"} <= markers, argv[i + 1]


def _check_pip(argv: list[str]) -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert argv[0] in ("install", "wheel"), argv
    if argv[0] == "wheel":  # graph_trainer's wheel alone (no GBs of dependency wheels), written outside the repository
        assert "--no-deps" in argv and "-w" in argv, argv
        wheel_dir = Path(argv[argv.index("-w") + 1]).resolve()
        assert REPO not in (wheel_dir, *wheel_dir.parents), argv
        argv = argv[: argv.index("-w")] + argv[argv.index("-w") + 2 :]
    for target in argv[1:]:
        if target.startswith("-"):
            continue
        name, _, rest = target.partition("[")
        assert name in (".", "graph_trainer"), target
        assert set(filter(None, rest.rstrip("]").split(","))) <= set(extras), target


# The README's test command: the unit tests on every core (pytest-xdist; each file's tests on one worker, so a
# module's shared training run is trained once).
TEST_COMMAND = "python -m pytest -q -n auto --dist loadfile"


def _check_quick_start(command: str) -> None:
    """The two quick-start lines: the test one is .ci/run's first command, the training one installs alike."""
    ci = (REPO / ".ci" / "run").read_text()
    steps = command.split(" && ")
    test_command = steps[:3] + ["pip install -e '.[test]'", TEST_COMMAND]
    assert " && ".join(test_command) in ci, "the README's test command must be what .ci/run runs"
    if steps[-1] != TEST_COMMAND:
        assert steps[3] == "pip install -e ." and steps[-1].startswith("python -m graph_trainer ")
        _check_trainer(shlex.split(steps[-1])[3:])


def check_command(command: str) -> None:
    """Check one documented command as written; an unknown program fails, so no command goes unchecked."""
    if command in FRAGMENTS or command in RUN_ELSEWHERE:
        return
    if command.startswith("python3.11 -m venv"):
        return _check_quick_start(command)
    argv = shlex.split(command.removesuffix("&").strip())  # `&`: the same command, in the background
    while argv and ENV_ASSIGNMENT.match(argv[0]):
        argv = argv[1:]
    if argv[0] in SHELL_UTILITIES:
        return None
    if argv[:3] == ["python", "-m", "graph_trainer"] or argv[:3] == ["python", "-m", "tests.faults"]:
        # tests.faults runs the trainer's own command line, with writes that fail as on a full disk.
        return _check_trainer(argv[3:])
    if argv[0] == "torchrun" and argv[1] == "--nproc_per_node" and argv[3:5] == ["-m", "graph_trainer"]:
        return _check_trainer(argv[5:], nproc=int(argv[2]))
    if argv[:3] == ["python", "-m", "graph_trainer.plan"]:
        return _check_plan(argv[3:])
    if argv[:3] == ["python", "-m", "graph_trainer.export"]:
        from graph_trainer import export

        return _parse_only(lambda: export.main(argv[3:]), argv[2:])
    if argv[:3] == ["python", "-m", "pytest"]:
        return _check_pytest(argv[3:])
    if argv[0] == "pip":
        return _check_pip(argv[1:])
    if argv[:2] == ["python", "-c"]:
        # A snippet: it must compile here (the round trip that holds them runs in tests/checkpoint/test_hf_weights.py).
        compile(argv[2], command, "exec")
        return None
    if argv[0] == "python" and (REPO / argv[1]).is_file() and argv[1].startswith("benchmarks/"):
        return _parse_only(lambda: runpy.run_path(str(REPO / argv[1]), run_name="__main__"), argv[1:])
    if argv[:2] == ["python", "-m"] and argv[2].startswith("benchmarks."):
        return _parse_only(lambda: runpy.run_module(argv[2], run_name="__main__"), argv[2:])
    if argv[:2] == ["python", "run_tests.py"]:
        return _parse_only(lambda: runpy.run_path(str(REPO / "run_tests.py"), run_name="__main__"), argv[1:])
    raise AssertionError(f"no check knows this command; add one to tests/test_docs.py: {command}")


@pytest.mark.parametrize(("page", "command"), all_commands())
def test_documented_command_is_accepted_as_written(page, command):
    check_command(command)


def test_the_pages_hold_the_commands_this_test_names():
    documented = {c for _, c in all_commands()}
    for command in [*RUN_ELSEWHERE, *RUN_HERE]:
        assert command in documented, f"no page documents {command!r} any more: update tests/test_docs.py"
    for where in RUN_ELSEWHERE.values():
        assert (REPO / where).is_file(), where
    readme = (REPO / "README.md").read_text()
    assert sum(c.startswith("python3.11 -m venv") for c in _commands(readme)) == 2, "exactly two quick-start commands"


def test_a_renamed_option_in_a_page_would_fail():
    with pytest.raises(Exception, match="unknown option"):
        check_command("python -m graph_trainer --config llama3_debug.toml --training.stepz 5")
    with pytest.raises(AssertionError, match="no check knows"):
        check_command("python somewhere/else.py")


@pytest.mark.integration
@pytest.mark.parametrize("command", RUN_HERE)
def test_cheap_trainer_command_runs_verbatim(command, tmp_path):
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",  # `python` is this interpreter
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
    }
    proc = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    if "--print-config" in command:
        assert tomllib.loads(proc.stdout)["model"]["flavor"] == "debugmodel"
    if "--training.steps 1" in command:
        assert any((tmp_path / "outputs" / "graphs" / "graphs").iterdir())


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (but - and _), spaces as dashes."""
    headings = [line.lstrip("#").strip() for line in FENCE.sub("", text).splitlines() if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lower()).replace(" ", "-") for h in headings}


def test_links_between_pages_resolve():
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", FENCE.sub("", page.read_text())):
            if target.startswith(("http://", "https://")):
                continue
            path, _, anchor = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.relative_to(REPO)} links to a missing {target}"
            if anchor:
                assert anchor in _anchors(linked.read_text()), f"{page.relative_to(REPO)}: no heading for {target}"
