"""Checkpoints: atomic save, pruning, resume, and the RNG state that makes resume exact.

Layout: `{folder}/step-{step:08d}.pt`, one file per saved step holding the whole
training state as a nested dict of tensors and plain Python values, readable
with `torch.load(..., weights_only=True)` (no pickled code runs on resume).
A save either completes or leaves the folder as it was (see `graph_trainer.runtime.fsutil`).
"""

from __future__ import annotations

import pickle
import random
import re
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from graph_trainer.checkpoint.formats import SINGLE_FILE, refuse_other_format
from graph_trainer.errors import ConfigError, UserError
from graph_trainer.runtime.fsutil import TEMP_SUFFIX, atomic_write, remove_path, writing

_RESUME_HINT = "resume with the model config the checkpoint was written with, or start a new job.dump_folder"

# What torch.load(weights_only=True) can rebuild, besides tensors and containers.
_PLAIN_TYPES = (bool, int, float, str, type(None), torch.dtype, torch.device, torch.Size)


def checkpoint_name(step: int) -> str:
    """The file name of the checkpoint for `step`."""
    return f"step-{step:08d}.pt"


def _check_loadable(value: Any, where: str) -> None:
    """Fail at save time, not at resume time, on anything weights_only loading would refuse."""
    if isinstance(value, torch.Tensor) or isinstance(value, _PLAIN_TYPES):
        return
    if isinstance(value, Mapping):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"checkpoint state key {k!r} under '{where}' must be a str or int")
            _check_loadable(v, f"{where}.{k}" if where else str(k))
        return
    if isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_loadable(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"checkpoint state '{where}' is a {type(value).__name__}, which torch.load(weights_only=True) "
        "cannot read back; store tensors, numbers, strings, lists or dicts"
    )


class CheckpointManager:
    """Saves, prunes and loads `step-XXXXXXXX.pt` files in one folder.

    `interval` is in steps; the last step is always saved when enabled.
    `keep_latest_k <= 0` keeps every checkpoint. Subclasses with another on-disk
    format (`graph_trainer.checkpoint.sharded`) override `pattern`, `path`, `save` and `load`.
    """

    pattern = SINGLE_FILE  # names of complete checkpoints in the folder; group 1 is the step
    reshardable = False  # whether a resume may change the number of ranks (see resume_config)

    def __init__(
        self,
        folder: Path,
        *,
        enable: bool,
        interval: int,
        keep_latest_k: int,
        record: Callable[[Path], None] | None = None,
        owns: Callable[[Path], bool] | None = None,
        forget: Callable[[Path], None] | None = None,
    ) -> None:
        """`record(path)` is called before a file is written; pruning deletes only files `owns(path)` accepts,
        and calls `forget(path)` after deleting one."""
        if enable and interval < 1:
            raise ConfigError(f"checkpoint.interval must be >= 1, got {interval}; set a positive step count")
        self.folder = Path(folder)
        self.enable = enable
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.record = record
        self.owns = owns
        self.forget = forget

    def path(self, step: int) -> Path:
        """The checkpoint file for `step` (whether or not it exists)."""
        return self.folder / checkpoint_name(step)

    def should_save(self, step: int, last_step: bool) -> bool:
        """Whether the trainer should save after `step`."""
        return self.enable and (last_step or step % self.interval == 0)

    def saved_steps(self) -> list[int]:
        """Steps with a complete checkpoint on disk, ascending."""
        if not self.folder.is_dir():
            return []
        steps = (self.pattern.match(p.name) for p in self.folder.iterdir())
        return sorted(int(m.group(1)) for m in steps if m)

    def latest_step(self) -> int | None:
        """The newest saved step, or None if there is none."""
        steps = self.saved_steps()
        return steps[-1] if steps else None

    def save(self, step: int, state: Mapping[str, Any]) -> Path:
        """Write `state` atomically to `step-{step:08d}.pt`, then prune to the latest `keep_latest_k`.

        If writing fails, `WriteError` propagates, no temp file is left and earlier checkpoints are untouched.
        """
        _check_loadable(state, "")
        path = self.path(step)
        with writing(self.folder):
            self.folder.mkdir(parents=True, exist_ok=True)
        if self.record is not None:
            self.record(path)
        atomic_write(path, lambda f: torch.save(state, f))
        self._prune()
        return path

    def _prune(self) -> None:
        steps = self.saved_steps()
        if self.keep_latest_k > 0:
            for old in steps[: -self.keep_latest_k]:
                if self._ours(self.path(old)):
                    remove_path(self.path(old))
                    if self.forget is not None:
                        self.forget(self.path(old))
        # Temp files only outlive their save after a hard kill; by now they are garbage.
        for stale in self.folder.glob(f".step-*{TEMP_SUFFIX}"):
            if self._ours(stale):
                remove_path(stale)

    def _ours(self, path: Path) -> bool:
        return self.owns is None or self.owns(path)

    def restore(self, step: int, model: torch.nn.Module, check: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Load `step` and its model state into `model`; `check(state)` runs after the shapes were checked
        (a mismatch names the tensor first). Returns the whole state."""
        state = self.load(step)
        load_model_state(model, state["model"])
        check(state)
        return state

    def refuse_other_format(self) -> None:
        """UserError when the folder holds only checkpoints of the sharded format, which this job cannot read."""
        refuse_other_format(self.folder, sharded=False)

    def load(self, step: int | None = None, *, map_location: str | torch.device = "cpu") -> dict[str, Any]:
        """Load the checkpoint for `step` (default: the latest) with `weights_only=True`."""
        if step is None:
            step = self.latest_step()
            if step is None:
                raise UserError(
                    f"no checkpoint to resume from in {self.folder}; run without checkpoint.resume "
                    "or point checkpoint.folder at a folder holding step-*.pt files"
                )
        path = self.path(step)
        if not path.is_file():
            raise UserError(
                f"no checkpoint for step {step} in {self.folder} (saved steps: {self.saved_steps() or 'none'}); "
                "pick one of the saved steps"
            )
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except Exception as e:  # torn/corrupt file, or one whose pickle asks for a class or function
            # weights_only refused a global: the way a pickle runs code, so say that, not "cannot be read"
            refused = re.search(r"GLOBAL ([\w.]+)", str(e)) if isinstance(e, pickle.UnpicklingError) else None
            if refused is not None:
                raise UserError(code_refused(path, refused.group(1), path)) from None
            raise UserError(
                f"checkpoint {path} cannot be read ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); "
                "delete it to resume from the previous one"
            ) from None


def code_refused(path: Path, what: str, checkpoint: Path) -> str:
    """The one line refusing a checkpoint file that would run `what` if unpickled (nothing of it was run)."""
    return (
        f"{path} asks to run {what} while being read, which a checkpoint never does: it was not written by "
        f"graph_trainer or was tampered with; nothing of it was run; delete {checkpoint} and resume from an "
        "earlier checkpoint"
    )


def _describe_shape(shape: torch.Size) -> str:
    return "(" + ", ".join(str(d) for d in shape) + ")"


def check_compatible(model_state: Mapping[str, Any], ckpt_state: Mapping[str, Any]) -> None:
    """Raise UserError naming the first tensor where a checkpoint's model state does not fit the model.

    Checked in the model's key order (missing key, shape, dtype), then keys only the
    checkpoint has. Reads shapes and dtypes only, so nothing is loaded or written.
    """
    for key, expected in model_state.items():
        if key not in ckpt_state:
            raise UserError(f"checkpoint has no tensor '{key}' that the model expects; {_RESUME_HINT}")
        found = ckpt_state[key]
        if not isinstance(expected, torch.Tensor) or not isinstance(found, torch.Tensor):
            continue
        if found.shape != expected.shape:
            raise UserError(
                f"checkpoint tensor '{key}' has shape {_describe_shape(found.shape)} but the model expects "
                f"{_describe_shape(expected.shape)}; {_RESUME_HINT}"
            )
        if found.dtype != expected.dtype:
            raise UserError(
                f"checkpoint tensor '{key}' has dtype {found.dtype} but the model expects {expected.dtype}; "
                f"{_RESUME_HINT}"
            )
    for key in ckpt_state:
        if key not in model_state:
            raise UserError(f"checkpoint tensor '{key}' is not in the model; {_RESUME_HINT}")


def load_model_state(model: torch.nn.Module, state_dict: Mapping[str, Any]) -> None:
    """Check `state_dict` against `model` (see `check_compatible`), then load it strictly."""
    check_compatible(model.state_dict(), state_dict)
    model.load_state_dict(state_dict, strict=True)


def capture_rng_state(device: torch.device | str | None = None) -> dict[str, Any]:
    """Python `random`, torch CPU and (for a CUDA `device`) CUDA generator states, weights_only-loadable."""
    version, internal, gauss_next = random.getstate()
    state: dict[str, Any] = {
        # Mersenne Twister words are < 2**32, so int64 holds them exactly.
        "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss_next": gauss_next},
        "torch_cpu": torch.get_rng_state(),
    }
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(torch.device(device))
    return state


def restore_rng_state(state: Mapping[str, Any], device: torch.device | str | None = None) -> None:
    """Restore generators captured by `capture_rng_state` (CUDA onto `device`, default the current one)."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state:
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"], device if device is not None else "cuda")
        else:
            warnings.warn(
                "checkpoint holds a CUDA RNG state but CUDA is not available; "
                "resumed random numbers will differ from an uninterrupted run",
                stacklevel=2,
            )
