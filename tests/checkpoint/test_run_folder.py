"""Nothing a run did not write is ever deleted; every input is checked before the first write (issue 8).

Each test drives `python -m graph_trainer` in a subprocess and asserts the exit
code, the one-line message and which files survive.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from graph_trainer.checkpoint.run_folder import MANIFEST_FILE, Manifest, remove_run
from tests.extras import child_pythonpath

REPO = Path(__file__).resolve().parents[2]
TINY = [
    "--config",
    "llama3_debug",
    "--model.n_layers",
    "1",
    "--model.dim",
    "32",
    "--model.n_heads",
    "2",
    "--model.n_kv_heads",
    "1",
    "--training.seq_len",
    "16",
    "--training.local_batch_size",
    "2",
    "--metrics.enable_tensorboard",
    "false",
]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": child_pythonpath(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "graph_trainer", *TINY, *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def one_line_error(proc: subprocess.CompletedProcess, expected: str) -> None:
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("error: ") and proc.stderr.count("\n") == 1, proc.stderr
    assert expected in proc.stderr, proc.stderr


def plant(*paths: Path) -> dict[Path, bytes]:
    decoys = {}
    for p in paths:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(b"not yours " + str(p).encode())
        decoys[p] = p.read_bytes()
    return decoys


def assert_survive(decoys: dict[Path, bytes]) -> None:
    for p, content in decoys.items():
        assert p.is_file() and p.read_bytes() == content, f"{p} was removed or changed"


@pytest.mark.integration  # whole runs of python -m graph_trainer
def test_overwrite_refuses_an_outside_checkpoint_folder_holding_foreign_files(tmp_path):
    """Issue 8.1: an absolute checkpoint.folder and `..` were wiped by --job.overwrite."""
    decoys = plant(tmp_path / "victim" / "other" / "important.pt", tmp_path / "parent" / "precious.txt")
    for folder, dump in ((str(tmp_path / "victim"), tmp_path / "ov"), ("..", tmp_path / "parent" / "run")):
        proc = cli(
            "--training.steps",
            "1",
            "--checkpoint.enable",
            "true",
            "--checkpoint.folder",
            folder,
            "--job.overwrite",
            "true",
            "--job.dump_folder",
            str(dump),
            cwd=tmp_path,
        )
        one_line_error(proc, "is outside job.dump_folder")
    assert_survive(decoys)


@pytest.mark.integration  # four runs: in the integration suite
def test_overwrite_removes_only_what_the_run_wrote(tmp_path):
    """Decoys everywhere a path option points (dump folder, checkpoint folder inside and outside, data,
    config) survive a run and its --job.overwrite replacement; the old run's own files are gone."""
    dump, outside = tmp_path / "run", tmp_path / "ckpt_out"
    config = tmp_path / "cfgdir" / "my.toml"
    config.parent.mkdir()
    config.write_text((REPO / "configs" / "llama3_debug.toml").read_text())
    data = dump / "data" / "corpus.txt"
    data.parent.mkdir(parents=True)
    data.write_text("hello world, a small corpus of text. " * 400)
    common = [
        "--config",
        str(config),
        "--data.source",
        "text",
        "--data.path",
        str(data),
        "--checkpoint.enable",
        "true",
        "--checkpoint.interval",
        "1",
        "--metrics.enable_tensorboard",
        "true",
    ]
    first = cli(*common, "--training.steps", "2", "--job.dump_folder", str(dump), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    decoys = plant(
        dump / "notes.txt",
        dump / "checkpoint" / "mine.pt",
        dump / "tb" / "keep.txt",
        tmp_path / "cfgdir" / "other.toml",
    )
    old = Manifest.read(dump)
    assert old is not None and any(f.endswith("step-00000002.pt") for f in old.files)
    assert any("tfevents" in f for f in old.files), "TensorBoard events are recorded as the run's"
    second = cli(
        *common, "--training.steps", "1", "--job.dump_folder", str(dump), "--job.overwrite", "true", cwd=tmp_path
    )
    assert second.returncode == 0, second.stderr[-2000:]
    assert_survive(decoys)
    assert data.is_file() and config.is_file()
    assert not (dump / "checkpoint" / "step-00000002.pt").exists()  # the old run's checkpoint went
    assert (dump / "checkpoint" / "step-00000001.pt").is_file()
    assert len(json.loads((dump / "summary.json").read_text())["steps"]) == 1
    # An outside checkpoint folder that is ours (recorded) is accepted and cleared of our files only.
    third = cli(
        *common,
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(tmp_path / "run3"),
        "--checkpoint.folder",
        str(outside),
        cwd=tmp_path,
    )
    assert third.returncode == 0, third.stderr[-2000:]
    fourth = cli(
        *common,
        "--training.steps",
        "1",
        "--job.dump_folder",
        str(tmp_path / "run3"),
        "--checkpoint.folder",
        str(outside),
        "--job.overwrite",
        "true",
        cwd=tmp_path,
    )
    assert fourth.returncode == 0, fourth.stderr[-2000:]
    assert sorted(p.name for p in outside.iterdir()) == ["step-00000001.pt"]


@pytest.mark.integration  # whole runs of python -m graph_trainer
def test_a_bad_data_path_with_overwrite_deletes_nothing_and_fails_before_preflight(tmp_path):
    """Issue 8.2: a typo in --data.path used to wipe the old run, then fail."""
    dump = tmp_path / "run"
    first = cli("--training.steps", "1", "--checkpoint.enable", "true", "--job.dump_folder", str(dump), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    before = {p: p.read_bytes() for p in dump.rglob("*") if p.is_file()}
    proc = cli(
        "--training.steps",
        "1",
        "--checkpoint.enable",
        "true",
        "--job.dump_folder",
        str(dump),
        "--job.overwrite",
        "true",
        "--data.source",
        "text",
        "--data.path",
        str(tmp_path / "typo.txt"),
        cwd=tmp_path,
    )
    one_line_error(proc, "does not exist")
    assert "preflight" not in proc.stdout  # the data is checked before the slow preflight
    assert_survive(before)


@pytest.mark.parametrize("where", ["file", "proc"])
def test_dump_folder_that_is_a_file_or_unwritable_is_one_line(tmp_path, where):
    """Issue 8.7: a raw traceback and exit 1 before."""
    target = tmp_path / "afile" if where == "file" else Path("/proc/graph_trainer_x")
    if where == "file":
        target.write_text("keep")
    proc = cli("--training.steps", "1", "--job.dump_folder", str(target), cwd=tmp_path)
    one_line_error(proc, "job.dump_folder")
    if where == "file":
        assert target.read_text() == "keep"


@pytest.mark.integration  # whole runs of python -m graph_trainer
def test_files_get_the_umask_mode_and_the_run_says_where_results_are(tmp_path):
    """Issue 8.9: summary.json and checkpoints were 0600; config.toml was promised but missing."""
    dump = tmp_path / "run"
    proc = cli("--training.steps", "1", "--checkpoint.enable", "true", "--job.dump_folder", str(dump), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    for p in (dump / "summary.json", dump / "checkpoint" / "step-00000001.pt", dump / "config.toml"):
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~0o022, p  # pytest runs with umask 022 here
    assert "[training]" in (dump / "config.toml").read_text()
    assert proc.stdout.strip().splitlines()[-1].startswith(f"results in {dump}")


def test_remove_run_leaves_unrecorded_files_and_non_empty_folders(tmp_path):
    ours, theirs = tmp_path / "a" / "x.pt", tmp_path / "a" / "y.pt"
    plant(ours, theirs, tmp_path / "b" / "z.pt")
    manifest = Manifest(tmp_path / MANIFEST_FILE, {str(ours), str(tmp_path / "b" / "z.pt")})
    manifest.save()
    remove_run(manifest)
    assert theirs.is_file() and not ours.exists() and not (tmp_path / "b").exists()
    assert not (tmp_path / MANIFEST_FILE).exists()


def test_overwriting_a_copied_run_folder_leaves_the_original_alone(tmp_path):
    """A manifest names its files relative to its own folder: a copy must not point at the original's."""
    original = tmp_path / "run1"
    original.mkdir()
    manifest = Manifest(original / MANIFEST_FILE)
    for name in ("summary.json", "checkpoint/step-00000001.pt"):
        manifest.record(original / name)
        plant(original / name)
    shutil.copytree(original, tmp_path / "run2")
    copy = Manifest.read(tmp_path / "run2")
    assert copy is not None
    remove_run(copy)
    assert (original / "summary.json").exists() and (original / "checkpoint" / "step-00000001.pt").exists()
    assert not (tmp_path / "run2" / "summary.json").exists()
    assert not (tmp_path / "run2" / "checkpoint").exists()


def test_a_copied_or_edited_manifest_deletes_nothing_outside_its_recorded_checkpoint_folder(tmp_path):
    """Absolute entries (a checkpoint folder outside the dump folder) are checked before deleting: only
    checkpoint files in a checkpoint folder the run recorded, and only from the manifest's own folder."""
    outside, original = tmp_path / "ckpts", tmp_path / "run1"
    original.mkdir()
    manifest = Manifest(original / MANIFEST_FILE)
    manifest.save()
    manifest.record(outside / "step-00000001.pt")
    ours = plant(outside / "step-00000001.pt")
    shutil.copytree(original, tmp_path / "run2")
    remove_run(Manifest.read(tmp_path / "run2"))  # the copy names run1's outside checkpoint
    assert_survive(ours)
    decoys = plant(tmp_path / "victim" / "step-00000001.pt", tmp_path / "notes.txt", outside / "notes.txt")
    data = json.loads((original / MANIFEST_FILE).read_text())
    data["files"] += [str(p) for p in decoys] + ["../victim/step-00000001.pt"]
    (original / MANIFEST_FILE).write_text(json.dumps(data))
    edited = Manifest.read(original)
    assert not any(edited.owns(p) for p in decoys)
    remove_run(edited)
    assert_survive(decoys)
    assert not (outside / "step-00000001.pt").exists()  # the one file the run did write there is removed


def test_an_edited_manifest_naming_a_folder_deletes_nothing_below_it(tmp_path):
    """Only a recorded checkpoint folder (step-*.dcp) owns what lies below it; a manifest edited to name
    another folder of the dump folder (or the dump folder itself) must not make overwrite delete its files."""
    run = tmp_path / "run"
    run.mkdir()
    manifest = Manifest(run / MANIFEST_FILE)
    manifest.save()
    manifest.record(run / "checkpoint" / "step-00000001.dcp")
    ours = plant(run / "checkpoint" / "step-00000001.dcp" / "__0_0.distcp")
    decoys = plant(run / "tb" / "events.user", run / "notes.txt")
    data = json.loads((run / MANIFEST_FILE).read_text())
    data["files"] += ["tb", "."]
    (run / MANIFEST_FILE).write_text(json.dumps(data))
    edited = Manifest.read(run)
    assert all(edited.owns(p) for p in ours) and not any(edited.owns(p) for p in decoys)
    remove_run(edited)
    assert_survive(decoys)
    assert not (run / "checkpoint" / "step-00000001.dcp").exists()
