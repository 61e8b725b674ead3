"""Export a checkpoint's weights for use outside the trainer: one file of full tensors, or a Hugging Face folder.

    python -m graph_trainer.export outputs/run/checkpoint/step-00000010.dcp model_full.pt
    python -m graph_trainer.export outputs/run/checkpoint/step-00000010.pt hf_model --format hf

`--format pt` (the default) writes `{parameter name: full tensor}` (unpadded, the shapes of the unsharded
model), readable with `torch.load(path, weights_only=True)` and `model.load_state_dict`. `--format hf`
writes `config.json` and safetensors (sharded with an index above `--max-shard-size`) that
`transformers.AutoModelForCausalLM.from_pretrained` loads; the model's shape comes from the config stored in
the checkpoint. A checkpoint is a `step-*.dcp` folder (FSDP: one process reads every rank's shards through
DCP, with no process group and no torchrun) or a `step-*.pt` file (one process, or dp_replicate).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graph_trainer.checkpoint.dcp_reader import SafeFileSystemReader
from graph_trainer.checkpoint.hf import DEFAULT_MAX_SHARD_BYTES, hf_adapter, parse_size, save_hf
from graph_trainer.errors import UserError
from graph_trainer.job_config.model_args import build_model_args, get_model_spec
from graph_trainer.runtime.device import DTYPES
from graph_trainer.runtime.fsutil import atomic_write

_PREFIX = "model."
_RANK0 = "rank0.pt"  # a sharded checkpoint's plain state of rank 0 (graph_trainer.checkpoint.sharded)


def full_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors from a `step-*.dcp` folder or a `step-*.pt` file (see graph_trainer.checkpoint)."""
    if checkpoint.is_file():
        return _single_file(checkpoint)["model"]
    reader = SafeFileSystemReader(checkpoint)  # reads .metadata without running any code in it
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError, ValueError) as e:
        raise UserError(
            f"{checkpoint} is not a readable sharded checkpoint ({type(e).__name__}); pass a "
            "step-*.dcp folder written by a parallelism.dp_shard run, or a step-*.pt file"
        ) from None
    state = {
        k[len(_PREFIX) :]: torch.empty(m.size, dtype=m.properties.dtype)
        for k, m in metadata.state_dict_metadata.items()
        if k.startswith(_PREFIX) and isinstance(m, TensorStorageMetadata)
    }
    with warnings.catch_warnings():  # DCP warns that it reads without a process group: that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load({"model": state}, storage_reader=reader, no_dist=True)
    return state


def _single_file(path: Path) -> dict[str, Any]:
    """A `step-*.pt` checkpoint, memory-mapped (the optimizer state it also holds is never read into memory)."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # a torn file, or not a checkpoint
        raise UserError(
            f"{path} is not a readable checkpoint ({type(e).__name__}); pass a step-*.pt file or a step-*.dcp folder"
        ) from None


def stored_model_config(checkpoint: Path) -> dict[str, Any]:
    """The `[model]` options the checkpoint was trained with (its stored config)."""
    plain = _single_file(checkpoint / _RANK0) if checkpoint.is_dir() else _single_file(checkpoint)
    config = plain.get("config") if isinstance(plain, dict) else None
    if not isinstance(config, dict) or "model" not in config:
        raise UserError(f"{checkpoint} stores no config (an older checkpoint), so its model shape is unknown")
    return config["model"]


def export_full(checkpoint: Path, out: Path) -> None:
    """Write the full model state of `checkpoint` to `out` atomically (torch.save)."""
    state = full_model_state(checkpoint)
    atomic_write(out, lambda f: torch.save(state, f))


def export_hf(checkpoint: Path, out: Path, *, dtype: torch.dtype, max_shard_bytes: int) -> list[Path]:
    """Write `checkpoint`'s weights as a Hugging Face folder `out` (config.json + safetensors in `dtype`)."""
    model = stored_model_config(checkpoint)
    overrides = {k: v for k, v in model.items() if k not in ("name", "flavor")}
    args = build_model_args(model["name"], model["flavor"], overrides)
    spec = get_model_spec(model["name"])
    adapter = hf_adapter(spec, args)
    state = full_model_state(checkpoint)
    with torch.device("meta"):  # the names the model has (shapes only, nothing allocated)
        names = spec.model_cls(args).state_dict().keys()
    # A folder without one of them would load in transformers with that tensor freshly initialized, and only a
    # warning there: refuse instead (e.g. DeepSeek-V3's router biases, which are buffers).
    missing = [name for name in names if adapter.in_hf_files(name) and name not in state]
    if missing:
        raise UserError(
            f"{checkpoint} holds no {missing[0]} (of {len(missing)} missing), which the Hugging Face folder needs; "
            "export a checkpoint this model's run wrote"
        )
    return save_hf(state, adapter, out, dtype=dtype, max_shard_bytes=max_shard_bytes)


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: list[str] | None = None) -> int:
    """Command line (see the module doc); 2 with one line on bad input."""
    parser = argparse.ArgumentParser(prog="python -m graph_trainer.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step-*.dcp folder or a step-*.pt file")
    parser.add_argument("out", type=Path, help="the file (pt) or folder (hf) to write")
    parser.add_argument("--format", choices=("pt", "hf"), default="pt", help="one torch file, or a Hugging Face folder")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32", help="hf: the tensors' dtype")
    parser.add_argument(
        "--max-shard-size", type=_size, default=DEFAULT_MAX_SHARD_BYTES, help="hf: split files above this (5GB)"
    )
    args = parser.parse_args(argv)
    try:
        if args.format == "hf":
            files = export_hf(args.checkpoint, args.out, dtype=DTYPES[args.dtype], max_shard_bytes=args.max_shard_size)
            print(f"wrote {args.out} ({len(files)} safetensors file{'s' if len(files) > 1 else ''} + config.json)")
            return 0
        export_full(args.checkpoint, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
