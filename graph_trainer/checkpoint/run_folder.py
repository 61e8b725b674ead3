"""The run folder: what in it is ours, checks before anything is written, and a safe replace.

A run records every file it writes in `{dump_folder}/run_manifest.json` *before*
writing it (so a killed run is still fully described); a sharded checkpoint is
recorded as its folder, which owns everything below it. `--job.overwrite true`
removes exactly the recorded files that still exist, and nothing else: files a
user put in the dump folder, the checkpoint folder, next to the data or the
config survive. A checkpoint folder outside the dump folder (absolute, or with
`..`) must be empty or hold only files of this run.

`inspect` only reads; it runs before the data, tokenizer and preflight are
checked, and `RunFolder.prepare` (which deletes) runs only after all of them passed.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from graph_trainer.errors import UserError
from graph_trainer.observability.log import get_logger
from graph_trainer.runtime.fsutil import TEMP_SUFFIX, atomic_write_text, remove_path

logger = get_logger(__name__)

MANIFEST_FILE = "run_manifest.json"
CONFIG_FILE = "config.toml"
_SCHEMA = 1
# A checkpoint is a file (`step-*.pt`, one process or dp_replicate) or a DCP folder (`step-*.dcp`, dp_shard).
_CKPT_RE = re.compile(r"^step-\d{8,}\.(pt|dcp)$")


def _is_checkpoint_folder_name(name: str) -> bool:
    """A sharded checkpoint's folder (`step-*.dcp`), or its temp folder: the only folders a run records."""
    return (
        name.endswith(".dcp")
        and bool(_CKPT_RE.match(name))
        or (name.startswith(".step-") and name.endswith(f".dcp{TEMP_SUFFIX}"))
    )


def _is_within(path: Path, folder: Path) -> bool:
    return path == folder or folder in path.parents


def _writable_dir_or_creatable(folder: Path, option: str) -> None:
    """Raise UserError unless `folder` is a writable directory or can be created as one."""
    if folder.exists():
        if not folder.is_dir():
            raise UserError(f"{option} '{folder}' is a file, not a folder; choose a folder path")
        if not os.access(folder, os.W_OK | os.X_OK):
            raise UserError(f"{option} '{folder}' is not writable; choose a folder you can write to")
        return
    parent = folder.parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise UserError(f"{option} '{folder}' cannot be created: '{parent}' is a file; choose another path")
    # /proc and /sys pass os.access as root but refuse mkdir; probe with a real (removed) folder.
    try:
        probe = Path(os.path.join(parent, f".graph_trainer_probe_{os.getpid()}"))
        probe.mkdir()
        probe.rmdir()
    except OSError as e:
        raise UserError(
            f"{option} '{folder}' cannot be created ({e.strerror}); choose a folder in a writable place"
        ) from None


def _files_below(folder: Path) -> list[Path]:
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.rglob("*") if p.is_file() or p.is_symlink())


@dataclass
class Manifest:
    """The files a run wrote, stored as JSON in the dump folder.

    Files inside the dump folder are recorded relative to it, so a run folder that was
    copied or moved names its own files, never the original's; only files outside it
    (a checkpoint folder elsewhere) are recorded as absolute paths. Those are trusted
    (owned, removable) only while the manifest is where it was written (`location`),
    and only as checkpoint files directly in a checkpoint folder it recorded
    (`outside`): a copied, moved or hand-edited manifest cannot name other files.
    """

    path: Path
    files: set[str] = field(default_factory=set)
    outside: set[str] = field(default_factory=set)  # checkpoint folders outside the dump folder, absolute
    location: str | None = None  # the dump folder the manifest was written in, absolute

    @property
    def _root(self) -> Path:
        return self.path.parent.absolute()

    def _key(self, path: Path) -> str:
        p = Path(os.path.normpath(Path(path).absolute()))
        return p.relative_to(self._root).as_posix() if _is_within(p, self._root) else str(p)

    def _resolve(self, entry: str) -> Path:
        return Path(os.path.normpath(self._root / entry))  # an absolute entry stays itself

    def _trusted(self, path: Path) -> bool:
        if _is_within(path, self._root):
            return True
        name = path.name
        checkpoint_like = bool(_CKPT_RE.match(name)) or (name.startswith(".step-") and name.endswith(TEMP_SUFFIX))
        return checkpoint_like and self.location == str(self._root) and str(path.parent) in self.outside

    @classmethod
    def read(cls, dump_folder: Path) -> Manifest | None:
        path = dump_folder / MANIFEST_FILE
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        if not isinstance(data, dict) or data.get("schema") != _SCHEMA:
            return None
        strings = lambda key: {str(f) for f in data.get(key, []) if isinstance(f, str)}  # noqa: E731
        location = data.get("dump_folder")
        return cls(
            path, strings("files"), strings("checkpoint_folders"), location if isinstance(location, str) else None
        )

    def owns(self, path: Path) -> bool:
        """Whether `path` is a recorded file or checkpoint folder, the temp file of one (left by a kill), or
        lies below a recorded checkpoint folder (a sharded checkpoint is recorded as its `step-*.dcp` folder,
        before any rank writes into it). Only such a folder owns what lies below it: an edited manifest
        naming any other folder (say the dump folder's `tb/`) owns nothing under it."""
        path = Path(os.path.normpath(Path(path).absolute()))
        if path == self.path.absolute():
            return True
        return self._owns_entry(path) or any(
            _is_checkpoint_folder_name(p.name) and self._owns_entry(p) for p in path.parents if p != p.parent
        )

    def _owns_entry(self, path: Path) -> bool:
        if not self._trusted(path):
            return False
        if self._key(path) in self.files:
            return True
        name = path.name
        if name.startswith(".") and name.endswith(TEMP_SUFFIX):
            return any(
                self._resolve(f).parent == path.parent and name.startswith(f".{Path(f).name}.") for f in self.files
            )
        return False

    def record(self, path: Path) -> None:
        """Add `path` (call before writing it) and save the manifest atomically if it is new."""
        p = self._key(path)
        if p in self.files:
            return
        self.files.add(p)
        if Path(p).is_absolute():
            self.outside.add(str(Path(p).parent))
        self.save()

    def forget(self, path: Path) -> None:
        """Drop `path` (after deleting it), so the manifest does not grow with every pruned checkpoint."""
        p = self._key(path)
        if p in self.files:
            self.files.discard(p)
            self.save()

    def save(self) -> None:
        data = {
            "schema": _SCHEMA,
            "files": sorted(self.files),
            "dump_folder": str(self._root),
            "checkpoint_folders": sorted(self.outside),
        }
        self.location = str(self._root)
        atomic_write_text(self.path, json.dumps(data, indent=1) + "\n")

    def existing(self) -> list[Path]:
        """The recorded files (and checkpoint folders) that exist and are trusted as ours (see the class doc).

        A recorded folder that is not a checkpoint folder is never ours to delete (an edited manifest).
        """
        return [
            p
            for p in map(self._resolve, sorted(self.files))
            if p.exists() and self._trusted(p) and (not p.is_dir() or _is_checkpoint_folder_name(p.name))
        ]

    def untrusted(self) -> list[Path]:
        """Recorded files outside the dump folder that are not trusted as ours: kept by `remove_run`."""
        return [p for p in map(self._resolve, sorted(self.files)) if p.exists() and not self._trusted(p)]


@dataclass
class RunFolder:
    """The dump folder and checkpoint folder of one run, checked (see `inspect`)."""

    dump_folder: Path
    checkpoint_folder: Path
    previous: Manifest | None  # the earlier run found there, if any
    replace: bool  # remove the previous run's files in `prepare`
    manifest: Manifest | None = None

    def holds_started_run(self) -> bool:
        """Whether the dump folder holds a run of ours that got past its start (wrote more than manifest + config)."""
        return _started(self.previous)

    def prepare(self) -> Manifest:
        """Remove the previous run's recorded files when replacing, create the folders, start the manifest.

        Call only once every input has been validated: this is the first write.
        """
        if self.replace and self.previous is not None:
            remove_run(self.previous)
        self.create_dump_folder()
        carried = self.previous is not None and not self.replace
        self.manifest = Manifest(
            self.dump_folder / MANIFEST_FILE,
            set(self.previous.files) if carried else set(),
            set(self.previous.outside) if carried else set(),
        )
        self.manifest.save()
        return self.manifest

    def create_dump_folder(self) -> None:
        """Create the dump folder (and its parents) if missing; UserError when that is impossible."""
        try:
            self.dump_folder.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise UserError(
                f"job.dump_folder '{self.dump_folder}' cannot be created ({e.strerror}); "
                "choose a folder in a writable place"
            ) from None

    def adopt_new_files(self, folder: Path, before: set[Path]) -> None:
        """Record files that appeared under `folder` during this run (TensorBoard events, graph dumps)."""
        if self.manifest is None:
            return
        for p in _files_below(folder):
            if p not in before:
                self.manifest.record(p)


def remove_run(manifest: Manifest) -> None:
    """Delete the recorded files of a run (and their temp files), then its folders that became empty.

    Files outside the dump folder that the manifest cannot vouch for (see `Manifest`) are kept, with a warning.
    """
    for path in manifest.untrusted():
        logger.warning(
            f"kept {path}: {manifest.path} names it, but it is outside the run folder and not in a "
            "checkpoint folder that run recorded there (a copied, moved or edited manifest?)"
        )
    folders = set()
    for path in manifest.existing():
        remove_path(path)
        folders.add(path.parent)
    for folder in list(folders):
        for stale in folder.glob(f".*{TEMP_SUFFIX}") if folder.is_dir() else []:
            if manifest.owns(stale):
                remove_path(stale)
    manifest.path.unlink(missing_ok=True)
    dump = manifest.path.parent
    for folder in sorted(folders, key=lambda p: len(p.parts), reverse=True):
        # Only folders inside the dump folder, and only when empty: never a folder that holds anything else.
        while _is_within(folder, dump) and folder != dump and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent


def _foreign(files: list[Path], manifest: Manifest | None) -> list[Path]:
    return [p for p in files if manifest is None or not manifest.owns(p)]


def _started(previous: Manifest | None) -> bool:
    return previous is not None and any(p.name not in (MANIFEST_FILE, CONFIG_FILE) for p in previous.existing())


def inspect(
    dump_folder: str, checkpoint_folder: str, *, resume: bool, overwrite: bool, checkpoint_enable: bool
) -> RunFolder:
    """Check the dump and checkpoint folders without writing; decide whether the previous run is replaced.

    A previous run is replaced only with `overwrite`, or when it never finished a
    step (nothing but its manifest and config). Raises UserError with the fix otherwise.
    """
    dump = Path(dump_folder).absolute()
    _writable_dir_or_creatable(dump, "job.dump_folder")
    ckpt = Path(os.path.normpath(dump / checkpoint_folder))
    if ckpt.exists() and not ckpt.is_dir():
        raise UserError(f"checkpoint.folder '{ckpt}' is a file, not a folder; choose a folder path")
    previous = Manifest.read(dump)
    files = _files_below(dump)
    foreign = _foreign(files, previous)
    started = _started(previous)

    if checkpoint_enable and not _is_within(ckpt, dump):
        alien = _foreign(_files_below(ckpt), previous)
        if alien:
            raise UserError(
                f"checkpoint.folder '{ckpt}' is outside job.dump_folder '{dump}' and holds files no run of "
                f"ours wrote (e.g. {alien[0]}); choose an empty folder or one inside job.dump_folder"
            )
        _writable_dir_or_creatable(ckpt, "checkpoint.folder")

    if resume:
        return RunFolder(dump, ckpt, previous, replace=False)
    # Files of others may share the folder (they are never touched), but none that this run would overwrite.
    clobbered = [p for p in (dump / "summary.json", dump / CONFIG_FILE) if p in foreign]
    checkpoints = [p for p in _files_below(ckpt) if p.name.startswith("step-")]
    checkpoints += [p for p in ckpt.iterdir() if p.is_dir() and p.name.startswith("step-")] if ckpt.is_dir() else []
    clobbered += _foreign(checkpoints, previous)
    if clobbered:
        raise UserError(
            f"'{clobbered[0]}' was not written by a run recorded in job.dump_folder '{dump}' and "
            "this run would overwrite it; move it away or choose another --job.dump_folder"
        )
    if started and not overwrite:
        saved = [p for p in previous.existing() if _CKPT_RE.match(p.name)]
        if saved:
            how = "--checkpoint.resume" if checkpoint_enable else "--checkpoint.enable true --checkpoint.resume"
            raise UserError(
                f"job.dump_folder '{dump}' already holds a run with checkpoints (latest {saved[-1]}); pass {how} to "
                "continue it, --job.overwrite true to replace it, or choose another --job.dump_folder"
            )
        raise UserError(
            f"job.dump_folder '{dump}' already holds a run (without checkpoints, so it cannot be "
            "resumed); pass --job.overwrite true to replace it, or choose another --job.dump_folder"
        )
    return RunFolder(dump, ckpt, previous, replace=previous is not None)
