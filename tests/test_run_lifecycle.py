"""A run's life after its start: divergence, resume with changed options, resuming a finished run, signals.

Issue 8, defects 3 to 6. Each test drives `python -m graph_trainer` in a subprocess
(the helpers of `tests.checkpoint.test_run_folder`) and asserts the exit code, the one-line
message and the files left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from graph_trainer.distributed.launch import trainer_command
from tests.checkpoint.test_run_folder import REPO, TINY, cli, one_line_error
from tests.extras import child_pythonpath

# Every test here drives whole runs of `python -m graph_trainer` (resume, signals): over a few seconds each.
pytestmark = pytest.mark.integration

CKPT = ["--checkpoint.enable", "true", "--checkpoint.interval", "1"]
# Bitwise-reproducible and independent of training.steps (no decay horizon), so an interrupted run
# resumed to N steps can be compared with an uninterrupted N-step run whatever step the signal hit.
EXACT = ["--training.deterministic", "true", "--lr_scheduler.decay_type", "none"]


def summary(dump: Path) -> dict:
    return json.loads((dump / "summary.json").read_text())


def checkpoints(dump: Path) -> list[str]:
    return sorted(p.name for p in (dump / "checkpoint").glob("step-*") if p.suffix in (".pt", ".dcp"))


def start(*args: str, cwd: Path, python: list[str] | None = None) -> subprocess.Popen:
    """Start the trainer (or `python` + args) with SIGINT at its default: a background child inherits it ignored."""
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    command = python or [sys.executable, "-m", "graph_trainer"]
    return subprocess.Popen(
        [*command, *TINY, *args],
        cwd=cwd,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )


def wait_for_step(proc: subprocess.Popen, step: int) -> None:
    """Read the trainer's stdout until the console line of `step` (or a later one) appears."""
    for line in proc.stdout:
        if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= step:
            return
    raise AssertionError(f"the run ended before step {step}: {proc.stderr.read()[-2000:]}")


def test_divergence_exits_3_naming_what_was_kept(tmp_path):
    """Issue 8.3: lr 1e10 used to save a step-1 checkpoint of ~4e9 weights and call it the last good one."""
    dump = tmp_path / "run"
    proc = cli("--optimizer.lr", "1e10", *CKPT, "--training.steps", "10", "--job.dump_folder", str(dump), cwd=tmp_path)
    assert proc.returncode == 3, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("error: training diverged: the parameter norm exploded")
    assert "no checkpoint was saved" in proc.stderr
    assert checkpoints(dump) == []
    assert summary(dump)["final"]["status"] == "diverged"


def test_resume_honours_a_new_lr_and_refuses_a_new_batch_shape(tmp_path):
    """Issue 8.4: a changed optimizer.lr was ignored; a changed local_batch_size or seq_len silently accepted."""
    dump = tmp_path / "run"
    first = cli(*CKPT, "--training.steps", "2", "--job.dump_folder", str(dump), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p: p.read_bytes() for p in dump.rglob("*") if p.is_file()}
    refused = cli(
        *CKPT,
        "--training.steps",
        "4",
        "--job.dump_folder",
        str(dump),
        "--checkpoint.resume",
        "--training.local_batch_size",
        "4",
        "--training.seq_len",
        "8",
        cwd=tmp_path,
    )
    one_line_error(refused, "changed training.local_batch_size 4 (checkpoint: 2), training.seq_len 8 (checkpoint: 16)")
    assert "--training.local_batch_size 2 --training.seq_len 16" in refused.stderr
    assert {p: p.read_bytes() for p in dump.rglob("*") if p.is_file()} == before
    resumed = cli(
        *CKPT,
        "--training.steps",
        "3",
        "--job.dump_folder",
        str(dump),
        "--checkpoint.resume",
        "--optimizer.lr",
        "1e-6",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    log = resumed.stdout + resumed.stderr
    assert "optimizer.lr: 0.0008 in the checkpoint, 1e-06 now (honoured)" in log
    assert "training.steps: 2 in the checkpoint, 3 now (honoured)" in log
    steps = summary(dump)["steps"]
    assert [s["step"] for s in steps] == [1, 2, 3]
    assert steps[2]["lr"] == 1e-6  # step 3 is past the 2 warmup steps: the full new lr (linear decay starts at 1)


def test_resume_of_a_finished_run_writes_nothing_and_more_steps_extend_it(tmp_path):
    """Issue 8.5: resuming a finished run exited 0 and replaced its summary's final_loss, hashes and wall time."""
    dump = tmp_path / "run"
    args = [*CKPT, "--job.dump_folder", str(dump)]
    assert cli(*args, "--training.steps", "2", cwd=tmp_path).returncode == 0
    before = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in dump.rglob("*") if p.is_file()}
    again = cli(*args, "--training.steps", "2", "--checkpoint.resume", cwd=tmp_path)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "is already complete" in again.stdout + again.stderr
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in dump.rglob("*") if p.is_file()} == before
    more = cli(*args, "--training.steps", "3", "--checkpoint.resume", cwd=tmp_path)
    assert more.returncode == 0, more.stderr[-2000:]
    final = summary(dump)["final"]
    assert final["status"] == "ok" and final["final_step"] == 3 and isinstance(final["final_loss"], float)
    assert [s["step"] for s in summary(dump)["steps"]] == [1, 2, 3]


# The trainer with its process killed (os._exit: no handler, no flush) right after the checkpoint of step N was saved.
KILL_AFTER_SAVE = """
import os, sys
from graph_trainer import __main__ as cli, trainer
_save = trainer.Trainer._save_checkpoint
def save_then_die(self, *args, **kwargs):
    _save(self, *args, **kwargs)
    if self.step == int(os.environ["KILL_AFTER_STEP"]):
        os._exit(9)
trainer.Trainer._save_checkpoint = save_then_die
sys.exit(cli.main(sys.argv[1:]))
"""


KILLED_RUN = [*EXACT, *CKPT, "--metrics.log_freq", "10", "--training.steps", "4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict:
    """The summary of KILLED_RUN trained without a kill: what each killed-and-resumed run must end as (one run
    for both kill points, not one each)."""
    folder = tmp_path_factory.mktemp("uninterrupted")
    assert cli(*KILLED_RUN, "--job.dump_folder", str(folder / "straight"), cwd=folder).returncode == 0
    return summary(folder / "straight")


@pytest.mark.parametrize("killed_after", [2, 4])
def test_a_kill_right_after_a_checkpoint_loses_no_step_and_no_final_record(
    tmp_path, monkeypatch, killed_after, uninterrupted
):
    """Killed after step 2's checkpoint with a console line every 10 steps, the resumed run's summary lacked steps
    1 and 2; killed after the last checkpoint, the resume found the run complete and summary.json kept no final
    record (no status, no params_sha256: a KeyError in the fault-injection test)."""
    args, dump = KILLED_RUN, tmp_path / "run"
    monkeypatch.setenv("KILL_AFTER_STEP", str(killed_after))
    killed = start(*args, "--job.dump_folder", str(dump), cwd=tmp_path, python=[sys.executable, "-c", KILL_AFTER_SAVE])
    killed.communicate(timeout=120)
    assert killed.returncode == 9
    resumed = cli(*args, "--job.dump_folder", str(dump), "--checkpoint.resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    expected = uninterrupted
    assert [s["loss"] for s in summary(dump)["steps"]] == [s["loss"] for s in expected["steps"]]
    final = summary(dump)["final"]
    assert final["status"] == "ok" and final["final_step"] == 4
    assert final["params_sha256"] == expected["final"]["params_sha256"]
    assert final["final_loss"] == expected["final"]["final_loss"]


def test_sigterm_finishes_the_step_saves_and_resumes_bitwise(tmp_path):
    """Issue 8.6: SIGTERM killed the run (-15, no message, no checkpoint, empty `final`)."""
    dump, straight = tmp_path / "run", tmp_path / "straight"
    proc = start(
        *EXACT,
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1000",
        "--training.steps",
        "100000",
        "--job.dump_folder",
        str(dump),
        cwd=tmp_path,
    )
    wait_for_step(proc, 2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-2000:]
    final = summary(dump)["final"]
    reached = final["final_step"]
    assert final["status"] == "interrupted" and final["signal"] == "SIGTERM"
    assert err.count("\n") == 1 and err.startswith(f"interrupted by SIGTERM after step {reached}; saved ")
    assert err.rstrip().endswith("to continue, run the same command with --checkpoint.resume")
    assert checkpoints(dump) == [f"step-{reached:08d}.pt"]
    end = str(reached + 2)
    resumed = cli(
        *EXACT,
        "--checkpoint.enable",
        "true",
        "--training.steps",
        end,
        "--job.dump_folder",
        str(dump),
        "--checkpoint.resume",
        cwd=tmp_path,
    )
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    reference = cli(*EXACT, "--training.steps", end, "--job.dump_folder", str(straight), cwd=tmp_path)
    assert reference.returncode == 0, reference.stderr[-2000:]
    assert [s["loss"] for s in summary(dump)["steps"]] == [s["loss"] for s in summary(straight)["steps"]]
    assert summary(dump)["final"]["params_sha256"] == summary(straight)["final"]["params_sha256"]


def test_sigint_exits_130_and_without_checkpoints_points_to_overwrite(tmp_path):
    """Issue 8.6: SIGINT printed only "interrupted"; after it, rerun and resume sent the user to each other."""
    dump = tmp_path / "run"
    proc = start("--training.steps", "100000", "--job.dump_folder", str(dump), cwd=tmp_path)
    wait_for_step(proc, 1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-2000:]
    assert err.startswith("interrupted by SIGINT after step ") and "--job.overwrite true" in err
    assert summary(dump)["final"]["status"] == "interrupted"
    rerun = cli("--training.steps", "1", "--job.dump_folder", str(dump), cwd=tmp_path)
    one_line_error(rerun, "without checkpoints, so it cannot be resumed); pass --job.overwrite true")
    resume = cli(*CKPT, "--training.steps", "1", "--job.dump_folder", str(dump), "--checkpoint.resume", cwd=tmp_path)
    one_line_error(resume, "nothing to resume; pass --job.overwrite true instead of --checkpoint.resume")
    overwrite = cli("--training.steps", "1", "--job.dump_folder", str(dump), "--job.overwrite", "true", cwd=tmp_path)
    assert overwrite.returncode == 0, overwrite.stderr[-2000:]


def test_a_checkpoint_without_a_stored_config_resumes_with_a_warning(tmp_path):
    """Checkpoints written before the config was stored still resume, as before, and say what is not checked."""
    dump = tmp_path / "run"
    assert cli(*CKPT, "--training.steps", "1", "--job.dump_folder", str(dump), cwd=tmp_path).returncode == 0
    path = dump / "checkpoint" / "step-00000001.pt"
    state = torch.load(path, weights_only=True)
    del state["config"]
    torch.save(state, path)
    resumed = cli(*CKPT, "--training.steps", "2", "--job.dump_folder", str(dump), "--checkpoint.resume", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "stores no config" in resumed.stdout + resumed.stderr
    assert [s["step"] for s in summary(dump)["steps"]] == [1, 2]


def worker_pid(launcher: subprocess.Popen, rank: int) -> int | None:
    """The pid of torchrun's worker process of `rank`, read from /proc (None until it has started)."""
    try:
        children = Path(f"/proc/{launcher.pid}/task/{launcher.pid}/children").read_text().split()
    except OSError:
        return None
    for pid in children:
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:
            return int(pid)
    return None


@pytest.mark.parametrize("parallelism,suffix", [("dp_replicate", ".pt"), ("dp_shard", ".dcp")])
def test_sigterm_to_one_rank_stops_every_rank_after_the_same_step_and_saves(tmp_path, parallelism, suffix):
    """Ranks agree on the stop (an all-reduced flag): a signal to one rank must neither hang the other
    in its next collective nor leave the checkpoint without the step they all reached (rank 0's file
    when replicated, every rank's shards in one DCP folder with FSDP)."""
    dump = tmp_path / "dp2"
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        [
            *trainer_command(2),
            *TINY,
            f"--parallelism.{parallelism}",
            "2",
            *CKPT[:2],
            "--checkpoint.interval",
            "1000",
            "--training.steps",
            "100000",
            "--job.dump_folder",
            str(dump),
        ],
        cwd=tmp_path,
        env=env,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    wait_for_step(launcher, 2)
    rank1 = worker_pid(launcher, 1)
    assert rank1 is not None
    os.kill(rank1, signal.SIGTERM)
    _, err = launcher.communicate(timeout=120)  # a hang fails here
    final = summary(dump)["final"]
    assert final["status"] == "interrupted" and final["signal"] == "SIGTERM", err[-3000:]
    assert checkpoints(dump) == [f"step-{final['final_step']:08d}{suffix}"]
    assert f"interrupted by SIGTERM after step {final['final_step']}; saved " in err
