"""Export the weights of a sharded checkpoint as one ordinary file, for use outside the trainer.

    python -m graph_trainer.export outputs/run/checkpoint/step-00000010.dcp model_full.pt

writes `{parameter name: full tensor}` (unpadded, the shapes of the unsharded model),
readable with `torch.load(path, weights_only=True)` and `model.load_state_dict`. One
process reads every rank's shards through DCP (no process group, no torchrun).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from graph_trainer.checkpoint.dcp_reader import SafeFileSystemReader
from graph_trainer.errors import UserError
from graph_trainer.runtime.fsutil import atomic_write

_PREFIX = "model."


def full_model_state(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The model's full tensors from a `step-*.dcp` checkpoint folder (see `graph_trainer.checkpoint.sharded`)."""
    reader = SafeFileSystemReader(checkpoint)  # reads .metadata without running any code in it
    try:
        metadata = reader.read_metadata()
    except (OSError, EOFError, ValueError) as e:
        raise UserError(
            f"{checkpoint} is not a readable sharded checkpoint ({type(e).__name__}); pass a "
            "step-*.dcp folder written by a parallelism.dp_shard run"
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


def export_full(checkpoint: Path, out: Path) -> None:
    """Write the full model state of `checkpoint` to `out` atomically (torch.save)."""
    state = full_model_state(checkpoint)
    atomic_write(out, lambda f: torch.save(state, f))


def main(argv: list[str] | None = None) -> int:
    """Command line: `python -m graph_trainer.export CHECKPOINT_DIR OUT.pt`; 2 with one line on bad input."""
    parser = argparse.ArgumentParser(prog="python -m graph_trainer.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path, help="a step-*.dcp folder")
    parser.add_argument("out", type=Path, help="the file to write")
    args = parser.parse_args(argv)
    try:
        export_full(args.checkpoint, args.out)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
