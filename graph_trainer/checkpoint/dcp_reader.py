"""Reading a sharded checkpoint without running code from it.

torch's DCP reads a checkpoint's `.metadata` with `pickle.load`, and the bytes items of a checkpoint
with `torch.load(weights_only=False)`: a tampered checkpoint would run its code on `--checkpoint.resume`
or on an export. `SafeFileSystemReader` is DCP's file-system reader with two differences:

- `.metadata` is read by an unpickler that builds only DCP's metadata classes and the few torch and
  pathlib values they hold (sizes, dtypes, layouts, paths); any other class or function, which is how
  a pickle runs code, is refused in one line before anything is called;
- a checkpoint that declares a bytes item (`BytesStorageMetadata`) is refused: ours hold tensors only
  (the plain state lives in `rank{r}.pt`, read with `weights_only=True`), and DCP would unpickle one.

A digest of `.metadata` kept next to it would be no defence: whoever edits the one edits the other.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, StorageMeta

from graph_trainer.checkpoint.single_file import code_refused
from graph_trainer.errors import UserError

_METADATA_CLASSES = {
    "Metadata",
    "TensorStorageMetadata",
    "BytesStorageMetadata",  # built only to be refused by name below
    "ChunkStorageMetadata",
    "TensorProperties",
    "MetadataIndex",
    "StorageMeta",
    "_MEM_FORMAT_ENCODING",
}
# (module, name) -> the object; all are classes or value lookups that run nothing when called.
_ALLOWED: dict[tuple[str, str], Any] = {
    **{(dcp_metadata.__name__, n): getattr(dcp_metadata, n) for n in _METADATA_CLASSES},
    (dcp_filesystem.__name__, "_StorageInfo"): dcp_filesystem._StorageInfo,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,  # a lookup among torch's layouts
    ("pathlib", "PosixPath"): Path("").__class__,
    ("pathlib", "WindowsPath"): Path("").__class__,  # written on Windows; read back as this system's path
    ("pathlib", "Path"): Path,
    ("collections", "OrderedDict"): dict,
}


class RefusedPickle(pickle.UnpicklingError):
    """A pickle asked for an object outside the allowlist."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise RefusedPickle(f"{module}.{name}") from None


def read_dcp_metadata(path: Path) -> Metadata:
    """Unpickle a DCP `.metadata` file with the allowlist; UserError naming what it refused."""
    checkpoint = path.parent
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
    except RefusedPickle as e:
        raise UserError(code_refused(path, str(e), checkpoint)) from None
    except Exception as e:  # torn, truncated or not a pickle at all
        raise UserError(
            f"{checkpoint} is not a readable sharded checkpoint ({type(e).__name__} reading .metadata: "
            f"{str(e).splitlines()[0] if str(e) else ''}); pass a step-*.dcp folder written by a "
            "parallelism.dp_shard run, or delete it to resume from the previous one"
        ) from None
    if not isinstance(metadata, Metadata):
        raise UserError(f"{path} holds a {type(metadata).__name__}, not DCP metadata; delete {checkpoint}")
    refuse_bytes_items(metadata, checkpoint)
    return metadata


def refuse_bytes_items(metadata: Metadata, checkpoint: Path) -> None:
    """UserError when the checkpoint declares a pickled (bytes) item, which DCP would load with pickle."""
    pickled = sorted(k for k, m in metadata.state_dict_metadata.items() if isinstance(m, BytesStorageMetadata))
    if pickled:
        raise UserError(
            f"checkpoint {checkpoint} declares pickled items ({', '.join(pickled[:3])}), which graph_trainer never "
            "writes and DCP would unpickle; it was tampered with or written by another program: delete it"
        )


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's file-system reader whose `.metadata` goes through `read_dcp_metadata` (see the module doc)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self._get_metadata_path(kwargs.get("rank"))))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


__all__ = ["SafeFileSystemReader", "read_dcp_metadata", "refuse_bytes_items"]
