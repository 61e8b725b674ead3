"""Finding a language model's repeated transformer blocks.

The tracer tags nodes with their layer index and eager activation
checkpointing wraps each block, so both need to know which modules are "the
layers" of a model we may not have written.
"""

from __future__ import annotations

import torch.nn as nn


def transformer_layers(model: nn.Module) -> dict[str, int]:
    """Map each transformer block's FQN (e.g. 'layers.3') to its index.

    The blocks are the children of `model.layers` when it exists, else of the first
    ModuleList/ModuleDict whose children all share one class (e.g. GPT-2's `h`).
    Returns {} when the model has no such container.
    """
    candidates = []
    if isinstance(getattr(model, "layers", None), (nn.ModuleList, nn.ModuleDict)):
        candidates.append(("layers", model.layers))
    candidates += [(name, mod) for name, mod in model.named_modules()
                   if isinstance(mod, (nn.ModuleList, nn.ModuleDict))]
    for name, container in candidates:
        children = list(container.named_children())
        if children and len({type(m) for _, m in children}) == 1:
            return {f"{name}.{child}": i for i, (child, _) in enumerate(children)}
    return {}
