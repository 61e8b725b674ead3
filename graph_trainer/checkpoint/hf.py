"""Hugging Face weights: read a pretrained folder into the meta-built model, write a trained model as one.

A Hugging Face folder holds `config.json` and the weights as safetensors: `model.safetensors`, or shards
named by `model.safetensors.index.json`. Only safetensors are read: a folder with nothing but
`pytorch_model.bin` (a pickle, which runs code when loaded) is refused.

Loading (`checkpoint.initial_load_path`) fills the model tensor by tensor, straight into the parameters
of the model built on the meta device, after its parallelisms have cut it: each rank reads only its own
block (safetensors' `get_slice`: FSDP's rows, TP's row or column blocks, or FSDP's rows of those), converted by
the family's adapter (`ModelSpec.hf_adapter`, e.g. models/llama3/state_dict_adapter.py). Each tensor is read
through its own `safe_open`: the file is memory-mapped while open, and the pages a read touched stay in the
process's resident memory until the mapping closes, so one mapping for the whole file would hold the model a
second time. The peak is the model plus one tensor (measured: benchmarks/hf_load.py). A stacked parameter
(DeepSeek-V3's routed experts: one tensor per expert in the files) keeps its experts' files open until it is
filled, which is still one of our tensors.

Saving (`python -m graph_trainer.export ... --format hf`) writes `config.json` and safetensors, sharded
with an index above `max_shard_bytes`, that `transformers.AutoModelForCausalLM.from_pretrained` loads.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from graph_trainer.distributed.parallelism import ParallelModel
from graph_trainer.errors import UserError
from graph_trainer.job_config.pretrained import (
    CONFIG_FILE,
    INDEX_FILE,
    SINGLE_FILE,
    read_config,
    read_json,
    weights_file,
)
from graph_trainer.observability.log import get_logger
from graph_trainer.runtime.fsutil import TEMP_SUFFIX, fsync_dir

logger = get_logger(__name__)

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default shard size (5 GB)


def _safetensors() -> Any:
    """The safetensors package, or a UserError saying how to install it (it is an optional dependency)."""
    try:
        import safetensors
        import safetensors.torch  # noqa: F401 (save_file)
    except ImportError:
        raise UserError(
            "Hugging Face weights need the safetensors package, which is not installed: pip install safetensors"
        ) from None
    return safetensors


def hf_adapter(spec: Any, args: Any) -> Any:
    """The family's Hugging Face adapter for `args`; UserError for a family that has none."""
    if spec.hf_adapter is None:
        raise UserError(
            f"model {spec.name} has no Hugging Face state dict adapter, so it cannot read or write Hugging Face "
            "weights; drop checkpoint.initial_load_path (or --format hf)"
        )
    return spec.hf_adapter(args)


# --------------------------------------------------------------------------- reading a folder


@dataclass(frozen=True)
class HFFolder:
    """A Hugging Face folder, checked: its parsed `config.json` and which safetensors file holds each tensor."""

    path: Path
    config: dict[str, Any]
    files: dict[str, Path]  # Hugging Face tensor name -> its safetensors file

    @classmethod
    def open(cls, path: str | Path) -> HFFolder:
        """Check `path` and read its config and tensor names (no tensor is read).

        Raises:
            UserError: no such folder, no config.json, no safetensors (pickles only), or an unreadable file.
        """
        folder = Path(path).expanduser()
        return cls(folder, read_config(folder), _tensor_files(folder))

    def check(self, adapter: Any) -> None:
        """UserError naming the first `config.json` field that disagrees with the model arguments."""
        m = adapter.config_mismatch(self.config)
        if m is None:
            return
        fix = (
            f"set --{m.option} {json.dumps(m.found)}"
            if m.option.startswith("model.") and " " not in m.option
            else f"set {m.option} to match"
        )
        raise UserError(
            f"{self.path / CONFIG_FILE} does not match the model: {m.field} is {json.dumps(m.found)} there but "
            f"{json.dumps(m.expected)} here; {fix}, or load weights of the configured model"
        )


def _tensor_files(folder: Path) -> dict[str, Path]:
    """Tensor name -> safetensors file, from the index (sharded) or the single file's header."""
    if weights_file(folder) == SINGLE_FILE:
        return dict.fromkeys(_names_in(folder / SINGLE_FILE), folder / SINGLE_FILE)
    index = read_json(folder / INDEX_FILE, "the shard index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict):
        raise UserError(f"{folder / INDEX_FILE} has no weight_map; use the index the model was published with")
    return {name: _shard_path(folder, file) for name, file in weight_map.items()}


def _shard_path(folder: Path, file: Any) -> Path:
    """A file the index names: a plain file name inside the folder (an index cannot send the reader elsewhere)."""
    if not isinstance(file, str) or Path(file).name != file or not file.endswith(".safetensors"):
        raise UserError(f"{folder / INDEX_FILE} names {file!r}, not a .safetensors file in the folder; fix the index")
    path = folder / file
    if not path.is_file():
        raise UserError(f"{folder / INDEX_FILE} names {file}, which is missing; download the whole model folder")
    return path


def _names_in(path: Path) -> list[str]:
    safetensors = _safetensors()
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            return list(f.keys())
    except Exception as e:  # safetensors raises its own error types for a torn or foreign file
        raise UserError(f"{path} is not a readable safetensors file ({e}); download it again") from None


@dataclass(frozen=True)
class Pretrained:
    """A checked Hugging Face folder and the adapter that maps it onto the configured model."""

    folder: HFFolder
    adapter: Any

    @classmethod
    def open(cls, path: str | Path, spec: Any, args: Any) -> Pretrained:
        """Open and check `path` against the model `args` of family `spec` (no tensor is read).

        Raises:
            UserError: see `HFFolder.open` and `HFFolder.check`, or a family without an adapter.
        """
        adapter = hf_adapter(spec, args)
        folder = HFFolder.open(path)
        folder.check(adapter)
        return cls(folder, adapter)

    def load_into(self, model: nn.Module, parallel: ParallelModel, device: Any) -> LoadReport:
        """See `load_hf_weights`."""
        return load_hf_weights(model, parallel, self.folder, self.adapter, device)


# --------------------------------------------------------------------------- loading into the model


@dataclass
class LoadReport:
    """What `load_hf_weights` read: tensors, bytes materialized on this rank, seconds."""

    tensors: int
    bytes: int
    seconds: float


def load_hf_weights(
    model: nn.Module, parallel: ParallelModel, folder: HFFolder, adapter: Any, device: Any
) -> LoadReport:
    """Materialize `model` (built on the meta device, its parallelisms applied) on `device` from `folder`.

    Every parameter gets this rank's part of its Hugging Face tensor, in its own dtype (a pipeline stage's rank:
    its stages' parameters only, the folder checked against the whole model); tied parameters stay one tensor;
    the buffers are computed by `model.init_buffers()`. Raises UserError naming the first tensor that is missing,
    extra, or of another shape.
    """
    start = time.perf_counter()
    params = _unique_parameters(model, adapter)
    held_buffers = adapter.buffers([n for n, _ in model.named_buffers()])  # the ones the files hold
    # The folder is checked against the whole model: a pipeline stage holds only its blocks, and reads only them.
    whole = _unique_parameters(parallel.traced_model(), adapter)
    _check_names(folder, adapter, [*whole, *held_buffers])
    total = 0
    full_shapes = parallel.full_shapes()
    for name, (param, slots) in params.items():
        full_shape = tuple(full_shapes.get(name, param.shape))
        loaded = _read_local(folder, adapter, name, param, parallel.local_slices(name, param), full_shape, device)
        loaded = nn.Parameter(loaded, param.requires_grad)
        for module, attr in slots:
            module._parameters[attr] = loaded
        total += loaded.numel() * loaded.element_size()
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None:
                module._buffers[key] = torch.empty_like(buf, device=device)
    model.init_buffers()
    for name in held_buffers:
        total += _read_buffer(folder, adapter, model, name)
    report = LoadReport(len(params), total, time.perf_counter() - start)
    logger.info(
        f"loaded {report.tensors} tensors ({report.bytes / 2**30:.3f} GiB on this rank) from {folder.path} "
        f"in {report.seconds:.2f} s"
    )
    return report


def _unique_parameters(model: nn.Module, adapter: Any) -> dict[str, tuple[nn.Parameter, list[tuple[nn.Module, str]]]]:
    """Name in the files -> (parameter, every (module, attribute) slot holding it): a tied weight is one entry,
    under the name its tensor has in the files (the embedding's, not the output projection's)."""
    by_id: dict[int, tuple[list[str], nn.Parameter, list]] = {}
    for mod_name, module in model.named_modules(remove_duplicate=False):
        for attr, p in module._parameters.items():
            if p is not None:
                names, _, slots = by_id.setdefault(id(p), ([], p, []))
                names.append(f"{mod_name}.{attr}" if mod_name else attr)
                slots.append((module, attr))
    return {
        next((n for n in names if adapter.in_hf_files(n)), names[0]): (p, slots) for names, p, slots in by_id.values()
    }


def _check_names(folder: HFFolder, adapter: Any, names: list[str]) -> None:
    """UserError naming the first tensor the model needs that the folder lacks, or the first it holds that the
    model has no place for. `names`: ours, of every parameter and every buffer the files hold."""
    wanted = {hf_name for n in names if adapter.in_hf_files(n) for hf_name in adapter.hf_names(n)}
    missing = sorted(wanted - folder.files.keys())
    if missing:
        raise UserError(f"{folder.path} has no tensor {missing[0]}, which the model needs; check the model folder")
    extra = [name for name in sorted(folder.files.keys() - wanted) if not _ignorable(adapter, name)]
    if extra:
        raise UserError(f"{folder.path} holds tensor {extra[0]}, which the model does not have; check the model folder")


def _ignorable(adapter: Any, hf_name: str) -> bool:
    """A tensor of the folder that the model rightly has no slot for."""
    name = adapter.our_name(hf_name)
    if name is not None and not adapter.in_hf_files(name):
        return True  # a tied output projection saved anyway: the embedding is the weight (as transformers does)
    if adapter.ignorable(hf_name):
        return True  # the family's own (DeepSeek-V3's multi-token-prediction layers)
    return hf_name.endswith("rotary_emb.inv_freq")  # older exports saved RoPE's frequencies, which the config sets


def _read_local(
    folder: HFFolder,
    adapter: Any,
    name: str,
    param: torch.Tensor,
    local: tuple[slice, ...],
    full_shape: tuple[int, ...],
    device: Any,
) -> torch.Tensor:
    """This rank's part `local` of parameter `name` (shaped like `param`, padding rows zero), from the folder."""
    out = torch.empty(param.shape, dtype=param.dtype, device=device)
    if adapter.is_stacked(name):
        return _read_local_experts(folder, adapter.hf_names(name), local, full_shape, out)
    (hf_name,) = adapter.hf_names(name)
    rows, rest = local[0], local[1:]
    block = adapter.rows_read_together(name)
    # Whole blocks around this rank's rows: the adapter converts (permutes) a block at a time.
    first, end = rows.start // block * block, math.ceil(rows.stop / block) * block
    with _safetensors().safe_open(folder.files[hf_name], framework="pt", device="cpu") as f:
        sliced = f.get_slice(hf_name)
        _check_shape(folder, hf_name, sliced.get_shape(), full_shape)
        # The other dimensions are cut in the read too (a row-parallel TP block is a block of columns).
        part = adapter.from_hf_rows(name, sliced[(slice(first, min(end, full_shape[0])), *rest)])
    n = rows.stop - rows.start
    out[:n].copy_(part[rows.start - first : rows.stop - first])
    # The padding rows stay zero: an FSDP shard's, and TP's vocabulary padding (masked logits, zero gradients, so
    # AdamW keeps them zero).
    out[n:].zero_()
    return out


def _read_local_experts(
    folder: HFFolder, hf_names: list[str], local: tuple[slice, ...], full_shape: tuple[int, ...], out: torch.Tensor
) -> torch.Tensor:
    """Fill `out` with this rank's experts `local[0]` of a stacked parameter [experts, in, out] (`hf_names`: each
    expert's own tensor [out, in] in the files), read only for the experts and columns this rank holds."""
    experts, rows_in, cols_out = local
    with contextlib.ExitStack() as files:
        opened: dict[Path, Any] = {}
        for i, e in enumerate(range(experts.start, experts.stop)):
            path = folder.files[hf_names[e]]
            if path not in opened:
                opened[path] = files.enter_context(_safetensors().safe_open(path, framework="pt", device="cpu"))
            sliced = opened[path].get_slice(hf_names[e])
            _check_shape(folder, hf_names[e], sliced.get_shape(), (full_shape[2], full_shape[1]))
            out[i].copy_(sliced[cols_out, rows_in].t())
    out[experts.stop - experts.start :].zero_()  # an FSDP shard's padding experts
    return out


def _check_shape(folder: HFFolder, hf_name: str, found: Any, expected: tuple[int, ...]) -> None:
    if tuple(found) != tuple(expected):
        raise UserError(
            f"{folder.path}: tensor {hf_name} has shape {tuple(found)} but the model expects {tuple(expected)}; "
            "check the model folder and --model options"
        )


def _read_buffer(folder: HFFolder, adapter: Any, model: nn.Module, name: str) -> int:
    """Read the buffer `name` whole (buffers are not sharded) into the model; its bytes."""
    (hf_name,) = adapter.hf_names(name)
    buffer = model.get_buffer(name)
    with _safetensors().safe_open(folder.files[hf_name], framework="pt", device="cpu") as f:
        tensor = f.get_tensor(hf_name)
    _check_shape(folder, hf_name, tensor.shape, buffer.shape)
    buffer.copy_(tensor)
    return buffer.numel() * buffer.element_size()


# --------------------------------------------------------------------------- writing a folder


def save_hf(
    state: Mapping[str, torch.Tensor],
    adapter: Any,
    out: Path,
    *,
    dtype: torch.dtype = torch.float32,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write our full model `state` as a Hugging Face folder `out`: config.json and safetensors in `dtype`,
    several shards with an index when the weights exceed `max_shard_bytes`. Atomic: written into a temp folder
    renamed to `out` once complete. Returns the safetensors files written.

    Raises:
        UserError: `out` exists and is not an empty folder.
    """
    out = Path(out)
    if out.exists() and not (out.is_dir() and not any(out.iterdir())):
        raise UserError(f"{out} already exists; choose a new folder for the Hugging Face export")
    save_file = _safetensors().torch.save_file
    out.parent.mkdir(parents=True, exist_ok=True)
    # A folder this call creates (never an existing one), so the clean-up below removes only what it wrote.
    temp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=TEMP_SUFFIX, dir=out.parent))
    try:
        shards = _plan_shards(state, adapter, dtype, max_shard_bytes)
        names = _shard_names(len(shards))
        for shard, file in zip(shards, names, strict=True):
            tensors = {
                hf_name: tensor
                for k in shard
                for hf_name, tensor in adapter.to_hf_tensors(
                    k, state[k].detach().to("cpu", adapter.export_dtype(k, dtype))
                ).items()
            }
            save_file(tensors, temp / file, metadata={"format": "pt"})
        if len(shards) > 1:
            _write_index(temp, shards, names, state, adapter, dtype)
        (temp / CONFIG_FILE).write_text(json.dumps(adapter.hf_config(dtype), indent=2) + "\n", encoding="utf-8")
        fsync_dir(temp)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(temp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return [out / f for f in names]


def _nbytes(t: torch.Tensor, dtype: torch.dtype) -> int:
    return t.numel() * dtype.itemsize


def _plan_shards(
    state: Mapping[str, torch.Tensor], adapter: Any, dtype: torch.dtype, max_bytes: int
) -> list[list[str]]:
    """Our names grouped into files in model order, a new file when the next tensor would pass `max_bytes`."""
    shards: list[list[str]] = [[]]
    size = 0
    for name in (k for k in state if adapter.in_hf_files(k)):
        nbytes = _nbytes(state[name], adapter.export_dtype(name, dtype))
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _shard_names(n: int) -> list[str]:
    """transformers' file names: one `model.safetensors`, or `model-00001-of-0000N.safetensors`, ..."""
    return [SINGLE_FILE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]


def _write_index(
    folder: Path,
    shards: list[list[str]],
    names: list[str],
    state: Mapping[str, torch.Tensor],
    adapter: Any,
    dtype: torch.dtype,
) -> None:
    weight_map = {
        hf_name: file
        for shard, file in zip(shards, names, strict=True)
        for k in shard
        for hf_name in adapter.hf_names(k)
    }
    total = sum(_nbytes(state[k], adapter.export_dtype(k, dtype)) for shard in shards for k in shard)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")


def parse_size(text: str) -> int:
    """'5GB', '500MB', '2GiB' or a byte count -> bytes; ValueError otherwise."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}
    s = text.strip().upper()
    number = s.rstrip("KMGIB")
    unit = s[len(number) :]
    if unit not in units or not number:
        raise ValueError(f"not a size: {text!r} (e.g. 5GB, 500MB, 2GiB)")
    return int(float(number) * units[unit])


__all__ = [
    "CONFIG_FILE",
    "DEFAULT_MAX_SHARD_BYTES",
    "HFFolder",
    "INDEX_FILE",
    "LoadReport",
    "Pretrained",
    "SINGLE_FILE",
    "hf_adapter",
    "load_hf_weights",
    "parse_size",
    "save_hf",
]
