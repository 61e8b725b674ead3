"""Finding a language model's repeated transformer blocks.

The tracer tags nodes with their layer index and eager activation
checkpointing wraps each block, so both need to know which modules are "the
layers" of a model we may not have written. A user can name the container
(`trace_step(..., layers="model.layers")`); otherwise it is guessed, and a guess
with rivals is logged as a warning, because activation checkpointing recomputes
inside the layers only.
"""

from __future__ import annotations

import torch.nn as nn

from graph_trainer.errors import UserError, did_you_mean
from graph_trainer.observability.log import get_logger

logger = get_logger(__name__)


def _is_stack(module: nn.Module) -> bool:
    """A ModuleList/ModuleDict whose children all share one class: what a stack of blocks looks like."""
    if not isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return False
    children = list(module.children())
    return bool(children) and len({type(m) for m in children}) == 1


def layer_containers(model: nn.Module) -> list[str]:
    """FQNs of the candidate layer stacks of `model`, outermost only, most parameters first.

    `model.layers` comes first when it is a stack (the common name, and the one our
    models use). A stack nested inside another one's blocks (e.g. MoE experts) is no
    rival: it is part of those blocks.
    """
    stacks = [name for name, module in model.named_modules() if name and _is_stack(module)]
    outer = [s for s in stacks if not any(s.startswith(other + ".") for other in stacks if other != s)]

    def size(name: str) -> int:
        return sum(p.numel() for p in model.get_submodule(name).parameters())

    return sorted(outer, key=lambda name: (name != "layers", -size(name)))


def transformer_layers(model: nn.Module, container: str | None = None) -> dict[str, int]:
    """Map each transformer block's FQN (e.g. 'layers.3') to its index.

    Args:
        model: the model.
        container: FQN of the module whose children are the blocks (e.g.
            "model.layers" for a Hugging Face Llama, "transformer.h" for GPT-2).
            None: guess (see `layer_containers`); when another stack also
            qualifies, a warning names both and how to choose.

    Returns {} when no container is named and the model has no stack of blocks.

    Raises:
        UserError: `container` is not a submodule of `model`, or has no children.
    """
    if container is None:
        candidates = layer_containers(model)
        if not candidates:
            return {}
        container = candidates[0]
        if len(candidates) > 1:
            logger.warning(
                f"took '{container}' as the model's transformer layers, but {candidates[1:]} "
                "also look like a stack of blocks; activation checkpointing recomputes inside the "
                f"layers only, so name them: trace_step(..., layers='{container}') or "
                "GraphStep(..., layers=...)"
            )
    else:
        names = [name for name, _ in model.named_modules() if name]
        try:
            module = model.get_submodule(container)
        except AttributeError:
            raise UserError(
                f"layers={container!r}: the model has no submodule of that name{did_you_mean(container, names)}"
            ) from None
        if not list(module.children()):
            raise UserError(
                f"layers={container!r} has no child modules; name the module that holds the "
                "transformer blocks (e.g. 'model.layers')"
            )
    blocks = model.get_submodule(container).named_children()
    return {f"{container}.{child}": i for i, (child, _) in enumerate(blocks)}
