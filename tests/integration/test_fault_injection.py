"""SIGKILL at random moments, half of them during a checkpoint write: every run resumes to the same bits.

Each trial starts the CLI with a checkpoint every step, kills it with SIGKILL
(no handler runs), then continues it as the messages say (`--checkpoint.resume`,
or `--job.overwrite true` when it died before its first checkpoint) to the end.
The loss curve in summary.json, the final parameter hash and every tensor of the
final checkpoint must be bitwise equal (`==`, `torch.equal`) to an uninterrupted run.

The even trial aims at the n-th checkpoint write (n random) on a simulated slow disk
(each checkpoint written in two halves with a pause between, in the killed process
only); the odd one kills a normal-speed run at a random moment (during a step, a
summary or checkpoint write, or after the run ended).
"""

from __future__ import annotations

import random
import sys
import time
from collections.abc import Callable

import pytest
import torch

from tests.test_run_lifecycle import CKPT, EXACT, checkpoints, cli, start, summary, wait_for_step

pytestmark = pytest.mark.integration

# One aimed at a checkpoint write, one at a random moment (each a run and its resume, about 25 s on 2 cores). Four
# trials took 112 s of CI; the kill points are seeded, so more trials only repeat these kinds of moment elsewhere.
TRIALS = 2
STEPS = "6"
SLOW_DISK = """
import io, sys, time, torch
from graph_trainer import __main__ as cli
_save = torch.save
def slow_save(obj, f, *args, **kwargs):
    buf = io.BytesIO()
    _save(obj, buf, *args, **kwargs)
    data = buf.getvalue()
    f.write(data[: len(data) // 2]); f.flush(); time.sleep(0.3); f.write(data[len(data) // 2:])
torch.save = slow_save
sys.exit(cli.main(sys.argv[1:]))
"""


def kill_during_write(proc, folder, nth: int, timeout: float = 120.0, kill: Callable[[], None] | None = None) -> None:
    """SIGKILL `proc` (or call `kill`, e.g. to kill every rank of a torchrun job) while it writes its `nth`
    checkpoint (seen as its temp file or folder)."""
    seen: set[str] = set()
    end = time.monotonic() + timeout
    while time.monotonic() < end and proc.poll() is None:
        seen.update(p.name for p in folder.glob(".step-*.tmp"))
        if len(seen) >= nth:
            break
        time.sleep(0.005)
    (kill or proc.kill)()


def _final_checkpoint(dump) -> dict:
    return torch.load(dump / "checkpoint" / f"step-{int(STEPS):08d}.pt", weights_only=True)["model"]


def test_sigkill_anywhere_then_resume_is_bitwise_equal_to_an_uninterrupted_run(tmp_path):
    args = [*EXACT, *CKPT, "--training.steps", STEPS]
    straight = tmp_path / "straight"
    assert cli(*args, "--job.dump_folder", str(straight), cwd=tmp_path).returncode == 0
    expected_losses = [s["loss"] for s in summary(straight)["steps"]]
    expected = _final_checkpoint(straight)
    rng = random.Random(8)
    mid_write = restarts = complete = matches = 0
    for trial in range(TRIALS):
        dump = tmp_path / f"trial{trial}"
        aimed = trial % 2 == 0
        proc = start(
            *args,
            "--job.dump_folder",
            str(dump),
            cwd=tmp_path,
            python=[sys.executable, "-c", SLOW_DISK] if aimed else None,
        )
        wait_for_step(proc, 1)
        if aimed:
            kill_during_write(proc, dump / "checkpoint", nth=rng.randint(1, int(STEPS)))
        else:
            time.sleep(rng.uniform(0.0, 0.4))
            proc.kill()
        proc.communicate(timeout=60)
        mid_write += any((dump / "checkpoint").glob(".step-*.tmp"))
        resumed = cli(*args, "--job.dump_folder", str(dump), "--checkpoint.resume", cwd=tmp_path)
        if resumed.returncode == 2 and "--job.overwrite true" in resumed.stderr:  # killed before a checkpoint
            restarts += 1
            resumed = cli(*args, "--job.dump_folder", str(dump), "--job.overwrite", "true", cwd=tmp_path)
        assert resumed.returncode == 0, f"trial {trial}: {resumed.stderr[-2000:]}"
        complete += "is already complete" in resumed.stdout + resumed.stderr
        assert [s["loss"] for s in summary(dump)["steps"]] == expected_losses, f"trial {trial}"
        assert summary(dump)["final"]["params_sha256"] == summary(straight)["final"]["params_sha256"]
        final = _final_checkpoint(dump)
        assert final.keys() == expected.keys() and all(torch.equal(final[k], expected[k]) for k in expected)
        assert not any((dump / "checkpoint").glob(".step-*.tmp")), "the resumed run cleans up torn writes"
        assert checkpoints(dump)[-1] == f"step-{int(STEPS):08d}.pt"
        matches += 1
    print(
        f"\nfault injection: {TRIALS} trials, {mid_write} killed mid-write, {TRIALS - restarts - complete} "
        f"resumed from a checkpoint, {restarts} started again (killed before the first checkpoint), {complete} "
        f"had finished before the kill, {matches} bitwise matches"
    )
    assert mid_write >= 1 and matches == TRIALS
