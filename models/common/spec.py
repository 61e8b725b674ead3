"""The registry entry of a model family, and the error a family raises for impossible model arguments.

The trainer builds, counts and parallelizes a model through its `ModelSpec` alone, so a new family plugs in
by adding one entry to `models.MODELS` (see models/README.md).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn


class ModelArgsError(ValueError):
    """Model arguments that cannot build a model (e.g. a width that the heads do not divide).

    The message names the field and the fix; the trainer reports it to the user as a config error.
    """


def arg(default: Any, help: str, **limits: Any) -> Any:
    """A model argument's dataclass field with its meaning and limits beside its default: the trainer's `[model]`
    options (command line, TOML, --help) are generated from them.

    limits: `choices` (allowed values), `ge`, `gt`, `le`, `lt` (numeric bounds), as the trainer's own options.
    """
    return field(default=default, metadata={"help": help, **limits})


def arg_fields(args_cls: type) -> dict[str, tuple[Any, Mapping[str, Any]]]:
    """Name -> (resolved type, metadata: help and limits) of every field of a family's args dataclass."""
    hints = typing.get_type_hints(args_cls)
    return {f.name: (hints[f.name], f.metadata) for f in dataclasses.fields(args_cls)}


@dataclass(frozen=True)
class TensorParallelPlan:
    """How a family's modules split under tensor parallelism (Megatron-style, with sequence parallelism).

    Plain data: names of submodules, relative to one transformer block unless said otherwise. The trainer's
    `graph_trainer/distributed/tp.py` applies it.

    - `colwise`: Linear layers whose weight is split by output rows (each rank computes some outputs);
    - `rowwise`: Linear layers whose weight is split by input columns (each rank computes a partial sum);
    - `sequence_regions`: submodules entered with the whole sequence (an all-gather along the sequence before
      them) and left with this rank's part of it (a reduce-scatter of their row-parallel partial sums after);
    - `sequence_parallel`: the modules that run on this rank's part of the sequence, their weights replicated
      (the norms; the residual stream between them is sharded along the sequence too);
    - `local_counts`: (submodule, integer attributes) pairs: head counts that become per-rank counts;
    - `embedding`, `output`, `final_norm`: root-level names of the vocabulary-sharded token embedding, the
      vocabulary-sharded output projection (the loss is then vocab-parallel) and the last norm (sequence-sharded).
    """

    colwise: tuple[str, ...] = ()
    rowwise: tuple[str, ...] = ()
    sequence_regions: tuple[str, ...] = ()
    sequence_parallel: tuple[str, ...] = ()
    local_counts: tuple[tuple[str, tuple[str, ...]], ...] = ()
    embedding: str = ""
    output: str = ""
    final_norm: str = ""


@dataclass(frozen=True)
class ParallelPlan:
    """How a family's modules map onto the parallelisms, declared by the family and applied by the trainer.

    `layers` is the container of the repeated transformer blocks: fully sharded data parallelism gathers
    each block as one unit and everything else as the root unit, and activation checkpointing works
    block by block. `tensor_parallel` is the family's tensor-parallel plan (None: the family has none, and
    `parallelism.tp` > 1 is refused).
    """

    layers: str = "layers"
    tensor_parallel: TensorParallelPlan | None = None
    # Name suffix of the modules holding a mixture of experts' routed experts ("" for none): each holds every
    # expert's weights stacked along dim 0 and runs `forward(rows sorted by expert, offsets [experts] int32)`.
    # Expert parallelism splits their dim 0 over ranks and moves the rows to them.
    routed_experts: str = ""


@dataclass(frozen=True)
class ModelSpec:
    """Everything the trainer needs to build one model family and report on it.

    `num_params(args)` counts the parameters (tied weights once); `flops_per_token(args, seq_len)` is the
    training FLOPs per token (forward + backward) used for MFU. For a mixture of experts both count what a
    token activates, so MFU stays honest (`num_params` the total, `active_params` the activated ones).
    """

    name: str
    args_cls: type
    model_cls: type[nn.Module]
    flavors: Mapping[str, Any]
    num_params: Callable[[Any], int]
    flops_per_token: Callable[[Any, int], float]
    parallel_plan: ParallelPlan = field(default_factory=ParallelPlan)
    active_params: Callable[[Any], int] | None = None  # None: every parameter is active (a dense model)
    # What the trainer logs after each step besides the loss, read from the live model (e.g. a mixture of
    # experts' load per expert): name -> value. None: nothing.
    step_metrics: Callable[[nn.Module], dict[str, float]] | None = None
    # Once per training step, after the gradients (every micro-batch's), under no_grad: updates the family's own
    # per-step state in place (a mixture of experts' balancing bias). The trainer traces it into the graph that
    # holds the step's update. None: nothing.
    step_update: Callable[[nn.Module], None] | None = None
    # args -> how many first blocks differ from the rest (DeepSeek-V3's dense layers before its experts); a plan
    # extended in depth keys them one by one. None: every block is alike.
    leading_blocks: Callable[[Any], int] | None = None
    # args -> the family's Hugging Face state dict adapter (names, layouts, config.json); None: no HF weights.
    hf_adapter: Callable[[Any], Any] | None = None
    # The `model_type` and `architectures` names of a Hugging Face `config.json` that this family reads.
    hf_names: tuple[str, ...] = ()
    # (config.json, the args fields the user gave) -> the args fields the folder sets, so that a folder alone is the
    # model. A given value that describes the same model another way (Llama's FFN rule) is kept; ModelArgsError
    # for a config the args cannot represent. None: the family reads no config.json.
    args_from_hf_config: Callable[[Mapping[str, Any], Mapping[str, Any]], dict[str, Any]] | None = None
