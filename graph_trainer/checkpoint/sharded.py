"""Checkpoints of a job that holds parameters in parts (FSDP, TP, EP and their compositions): every rank writes
its own parts with torch's DCP.

Layout: `{folder}/step-{step:08d}.dcp/`, a `torch.distributed.checkpoint` folder:
- `.metadata` and one `__{rank}_0.distcp` per rank: the tensors. Parameters and AdamW
  moments are saved as chunks of their *logical* (whole, unpadded) tensors; replicated
  tensors (buffers, AdamW step counts, the norms under TP) are written once.
- `rank{r}.pt` per rank: the plain state (step, lr schedule, this rank's data position and
  RNG state, the config), `torch.save`d so that it reads back with `weights_only=True`.
  (DCP's own `.metadata` is a pickle: it is read through `dcp_reader.SafeFileSystemReader`, which builds
  only DCP's metadata classes, so a tampered checkpoint runs no code.) No bytes item is written: DCP
  would unpickle it on load; the tensors only go through DCP.

Why chunks of the logical tensors: our parts are torch.chunk blocks with zero rows padding the
last ones (FSDP's rows, TP's blocks along their split dimension, FSDP's rows of TP's blocks).
`ParallelModel.local_slices` says which chunk of the logical tensor a rank's part holds, and
each rank hands DCP only that chunk (`checkpoint.logical_chunk`), so the padding never reaches
the file, and the checkpoint describes whole tensors that DCP can cut for any layout on load
(resharding) or write whole (`export_full`). On load the chunks are views of the live shards,
so DCP reads straight into them and the padding stays zero.

Atomic: all ranks write into `.step-{step:08d}.dcp.tmp`; after a barrier rank 0 fsyncs
it and renames it to its final name. Only complete folders match `step-*.dcp`; a torn
temp folder left by a kill is removed by the next save (if the run manifest owns it).
Rank 0 records the final folder in the manifest before any rank writes.

Resharding (another `dp_shard` or `tp` on resume): the tensors reshard through DCP; the data
position carries over only with the same global batch (`graph_trainer.job_config.resume`);
every rank then continues from rank 0's data position and RNG state (the ranks of the
saved run had the same position; their RNG streams cannot be mapped onto other ranks).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from graph_trainer.checkpoint.dcp_reader import SafeFileSystemReader
from graph_trainer.checkpoint.formats import SHARDED, refuse_other_format
from graph_trainer.checkpoint.logical_chunk import logical_chunk
from graph_trainer.checkpoint.single_file import CheckpointManager, check_compatible
from graph_trainer.distributed.parallelism import ParallelModel
from graph_trainer.errors import UserError
from graph_trainer.observability.log import get_logger
from graph_trainer.runtime.fsutil import (
    TEMP_SUFFIX,
    WriteError,
    atomic_write,
    fsync_dir,
    os_error_behind,
    remove_path,
    writing,
)

logger = get_logger(__name__)

SUFFIX = ".dcp"
_MODEL, _OPTIMIZER = "model", "optimizer"
# Plain (non-tensor) entries of the trainer's state, kept per rank in rank{r}.pt.
_PLAIN = ("lr_scheduler", "data", "rng", "step", "config")


def _rank_file(rank: int) -> str:
    return f"rank{rank}.pt"


class ShardedCheckpointManager(CheckpointManager):
    """Saves, prunes and loads `step-XXXXXXXX.dcp` folders of a job holding parameters in parts; every rank calls
    `save` and `load`.

    Pruning and the run manifest (`record`, `owns`, `forget`) are rank 0's, as with
    `CheckpointManager`. `optimizer` is the job's AdamW over the model's shards.
    """

    pattern = SHARDED
    reshardable = True

    def __init__(
        self,
        folder: Path,
        *,
        parallel: ParallelModel,
        optimizer: torch.optim.Optimizer,
        enable: bool,
        interval: int,
        keep_latest_k: int,
    ) -> None:
        super().__init__(folder, enable=enable, interval=interval, keep_latest_k=keep_latest_k)
        self.parallel, self.optimizer, self.group = parallel, optimizer, parallel.mesh.world_group
        self.rank, self.world_size = parallel.mesh.rank, parallel.mesh.world_size
        # Full shape of every name a shard is held under (tied weights have two names, one shard).
        self.full_shapes = parallel.full_shapes()

    @property
    def param_names(self) -> list[str]:
        """The name of each parameter the optimizer holds, in its order (read when used: pipeline stages drop the
        parameters other stages read after the first step)."""
        names = {id(p): name for name, p in self.parallel.model.named_parameters()}
        return [names[id(p)] for g in self.optimizer.param_groups for p in g["params"]]

    def path(self, step: int) -> Path:
        """The checkpoint folder for `step` (whether or not it exists)."""
        return self.folder / f"step-{step:08d}{SUFFIX}"

    def _temp(self, step: int) -> Path:
        return self.folder / f".{self.path(step).name}{TEMP_SUFFIX}"

    @contextlib.contextmanager
    def _dcp_call(self) -> Iterator[None]:
        """Around a DCP save or load: in one process (`no_dist`), without torch's warning that it assumes so, which
        it gives even when told."""
        with warnings.catch_warnings():
            if not self.parallel.mesh.is_distributed:
                warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            yield

    def _barrier(self) -> None:
        if self.parallel.mesh.is_distributed:  # one process (a sharded folder resumed alone): nothing to wait for
            dist.barrier(group=self.group)

    # --- the tensors, as DCP sees them -------------------------------------------------------------------

    def _tensors(self, model_state: dict[str, Any], optimizer_state: dict[str, Any]) -> dict[str, Any]:
        """What DCP saves or loads into: sharded tensors as DTensors (views of `model_state`/`optimizer_state`)."""
        # A pipeline stage's rank leaves out the other stages' blocks' buffers it keeps unused: their live copies
        # are the other ranks', and DCP writes one copy of a tensor several ranks hold.
        model = {name: self._logical(name, t) for name, t in model_state.items() if self.parallel.holds(name)}
        optimizer, param_names = {}, self.param_names
        for index, state in optimizer_state["state"].items():
            name = param_names[index]
            shard_shape = model_state[name].shape
            optimizer[name] = {
                k: self._logical(name, v) if isinstance(v, torch.Tensor) and v.shape == shard_shape else v
                for k, v in state.items()
            }
        return {_MODEL: model, _OPTIMIZER: optimizer}

    def _logical(self, name: str, local: torch.Tensor) -> torch.Tensor:
        """`local` (this rank's part of `name`, or a tensor shaped like it) as its chunk of the logical tensor, where
        the parallelisms say it sits; a tensor no parallelism splits as itself (every rank holds it whole)."""
        size = self.full_shapes.get(name)
        if size is None:
            return local.detach()
        return logical_chunk(local, self.parallel.local_slices(name, local), size)

    # --- save --------------------------------------------------------------------------------------------

    def save(self, step: int, state: dict[str, Any]) -> Path:
        """Every rank: write this rank's shards and plain state; rank 0 then renames the folder into place.

        `state` is the trainer's state dict (the single-file format: `model`, `optimizer`, plain entries).
        """
        path, temp = self.path(step), self._temp(step)
        start = time.perf_counter()
        failure = self._start_folder(path, temp) if self.rank == 0 else None
        if self.parallel.mesh.max_over_ranks(0 if failure is None else 1):  # as a barrier, and tells every rank
            raise failure or WriteError(temp, OSError("rank 0 could not create the checkpoint's folder"))
        self._write_parts(path, temp, state)  # every rank's files are written and fsynced, or every rank raises
        if self.rank == 0:
            fsync_dir(temp)
            if path.exists() and self._ours(path):  # a step saved again (cannot happen in one run; be safe)
                remove_path(path)  # one we did not write stays, and the rename below fails loudly instead
            os.replace(temp, path)
            fsync_dir(self.folder)
            self._prune()
        self._barrier()  # no rank looks for the checkpoint before it has its name
        logger.info(f"saved {path} ({self.world_size} ranks) in {time.perf_counter() - start:.2f} s")
        return path

    def _start_folder(self, path: Path, temp: Path) -> WriteError | None:
        """Rank 0: record the checkpoint in the manifest and create its temp folder; the error if that failed."""
        try:
            with writing(temp):
                self.folder.mkdir(parents=True, exist_ok=True)
                if self.record is not None:
                    self.record(path)  # before anything is written, so a kill leaves nothing unrecorded
                if self._ours(temp):
                    remove_path(temp)  # a torn save of this very step (killed run)
                temp.mkdir()  # one we do not own stays, and this fails rather than write into it
        except WriteError as e:
            return e
        return None

    def _write_parts(self, path: Path, temp: Path, state: dict[str, Any]) -> None:
        """Every rank: write this rank's shards (DCP) and plain state into `temp`. A failed write on any rank
        (a full disk) raises `WriteError` (naming `path`) on every rank, after rank 0 removed the torn `temp`."""
        failure: WriteError | None = None
        try:
            with self._dcp_call():
                dcp.save(
                    self._tensors(state[_MODEL], state[_OPTIMIZER]),
                    storage_writer=dcp.FileSystemWriter(temp),
                    process_group=self.group,
                    no_dist=not self.parallel.mesh.is_distributed,
                )
        except CheckpointException as e:  # DCP gathers every rank's failure and raises on all of them
            failure = _write_error(e, path)
        if failure is None:
            plain = {k: state[k] for k in _PLAIN if k in state} | {"world_size": self.world_size}
            try:
                atomic_write(temp / _rank_file(self.rank), lambda f: torch.save(plain, f))
            except WriteError as e:
                failure = e
        failed_rank = self.parallel.mesh.max_over_ranks(self.rank if failure is not None else -1)
        if failed_rank < 0:
            return
        if self.rank == 0 and self._ours(temp):
            remove_path(temp)
        if failure is None:
            failure = WriteError(path, OSError(f"rank {failed_rank} could not write its part; its error says why"))
        raise failure

    # --- load --------------------------------------------------------------------------------------------

    def load(
        self,
        step: int | None = None,
        *,
        map_location: str | torch.device = "cpu",
        before_tensors: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Every rank: load the checkpoint of `step` (default: the latest) into the live model and optimizer.

        Returns the state in the single-file format (`model`, `optimizer` as `state_dict()`s of the
        loaded shards, and the plain entries: this rank's, or rank 0's when the number of ranks changed).
        Shapes are checked against the model first (a mismatch is a UserError); then
        `before_tensors(plain entries)` runs (e.g. the config check, which may refuse the resume);
        only then are the tensors read, so a refused resume costs no reading of the shards.
        """
        path = self._existing(step)
        start = time.perf_counter()
        plain, saved_world = self._read_plain(path, map_location)
        reader = SafeFileSystemReader(path)
        self._check_shapes(reader.read_metadata(), path)
        if before_tensors is not None:
            before_tensors(plain)
        model_state, optimizer_state = self.parallel.model.state_dict(), self.optimizer.state_dict()
        with self._dcp_call():
            dcp.load(
                self._tensors(model_state, optimizer_state), storage_reader=reader, process_group=self.group,
                no_dist=not self.parallel.mesh.is_distributed,
            )  # fmt: skip
        if saved_world != self.world_size:
            logger.info(
                f"resume: {path} was written by {saved_world} ranks, now {self.world_size}: the shards were "
                "resharded; every rank continues from rank 0's data position and RNG state"
            )
        logger.info(f"loaded {path} ({self.world_size} ranks) in {time.perf_counter() - start:.2f} s")
        return {_MODEL: model_state, _OPTIMIZER: optimizer_state, **plain}

    def restore(self, step: int, model: torch.nn.Module, check: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
        """Every rank: load `step` into `model` (this manager's) and the optimizer; `check(plain state)` runs
        after the shapes and before any rank reads its shards, so a refused resume costs no large read."""
        return self.load(step, before_tensors=check)

    def refuse_other_format(self) -> None:
        refuse_other_format(self.folder, sharded=True)

    def _existing(self, step: int | None) -> Path:
        if step is None:
            step = self.latest_step()
            if step is None:
                raise UserError(
                    f"no checkpoint to resume from in {self.folder}; run without checkpoint.resume "
                    "or point checkpoint.folder at a folder holding step-*.dcp checkpoints"
                )
        path = self.path(step)
        if not path.is_dir():
            raise UserError(
                f"no checkpoint for step {step} in {self.folder} (saved steps: "
                f"{self.saved_steps() or 'none'}); pick one of the saved steps"
            )
        return path

    def _read_plain(self, path: Path, map_location: str | torch.device) -> tuple[dict[str, Any], int]:
        """This rank's plain entries (rank 0's when the number of ranks changed), and the saved number of ranks."""
        own = path / _rank_file(self.rank)
        first = path / _rank_file(0)
        try:
            saved_world = torch.load(first, map_location=map_location, weights_only=True)["world_size"]
            source = own if saved_world == self.world_size else first
            plain = torch.load(source, map_location=map_location, weights_only=True)
        except Exception as e:  # a missing or torn rank file
            raise UserError(
                f"checkpoint {path} cannot be read ({type(e).__name__}: "
                f"{str(e).splitlines()[0] if str(e) else ''}); delete it to resume from the previous "
                "one"
            ) from None
        plain.pop("world_size")
        return plain, saved_world

    def _check_shapes(self, metadata: Metadata, path: Path) -> None:
        """UserError naming the first model tensor whose full shape or dtype differs from the checkpoint's."""
        prefix = f"{_MODEL}."
        found = {
            k[len(prefix) :]: torch.empty(m.size, dtype=m.properties.dtype, device="meta")
            for k, m in metadata.state_dict_metadata.items()
            if k.startswith(prefix) and isinstance(m, TensorStorageMetadata)
        }
        # The whole model's tensors: a pipeline stage's checkpoint holds every stage's (the traced model is whole).
        shapes = self.parallel.whole_shapes()
        expected = {
            name: torch.empty(shapes[name], dtype=t.dtype, device="meta")
            for name, t in self.parallel.traced_model().state_dict().items()
        }
        check_compatible(expected, found)


def _write_error(error: CheckpointException, path: Path) -> WriteError:
    """The first rank's OSError behind DCP's failure (naming that rank), or DCP's error itself if none is."""
    for rank, (exc, _) in sorted(error.failures.items()):
        cause = os_error_behind(exc)
        if cause is not None:
            return WriteError(path, OSError(cause.errno, f"{cause.strerror or cause} (rank {rank})"))
    raise error


__all__ = ["SUFFIX", "ShardedCheckpointManager"]
