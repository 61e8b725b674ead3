"""The op-pattern syntax of `activation_checkpoint.save_list` / `recompute_list`, parsed and matched here only.

    aten.mm                         every overload of aten.mm
    aten.mm.default                 one overload
    layers.*.attention::aten.mm     aten.mm inside modules matching the glob (or their children)

The graph's memory-policy pass matches patterns against FX nodes (op and the
node's module FQN); the eager `torch.utils.checkpoint` baseline matches them
against the ops its policy function sees, where no module is known (so it
accepts only patterns without a module glob).
"""

from __future__ import annotations

import dataclasses
import fnmatch
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from graph_trainer.errors import ConfigError
from graph_trainer.tracer import node_meta

SYNTAX = "'[<module glob>::]aten.<op>[.<overload>]', e.g. 'aten.mm' or 'layers.*.attention::aten.mm'"


def fqn_matches(fqn: str, pattern: str) -> bool:
    """True when the module FQN or one of its parents matches the glob.

    'layers.*.attention' matches 'layers.0.attention.wq'.
    """
    parts = fqn.split(".") if fqn else []
    return any(fnmatch.fnmatchcase(".".join(parts[:i]), pattern) for i in range(1, len(parts) + 1))


@dataclasses.dataclass(frozen=True)
class OpPattern:
    """One parsed override entry."""

    text: str
    module: str | None  # module glob, or None for any module
    op: str  # qualified packet name, e.g. 'aten::mm'
    overload: str | None

    def matches_op(self, op: Any) -> bool:
        """True when the ATen op (an OpOverload) is this pattern's op; the module glob is not consulted."""
        packet = getattr(op, "overloadpacket", None)
        return (
            packet is not None
            and packet._qualified_op_name == self.op
            and (self.overload is None or op._overloadname == self.overload)
        )

    def matches(self, node: torch.fx.Node) -> bool:
        """True when the graph node runs this pattern's op inside a module matching its glob."""
        return self.matches_op(node.target) and (
            self.module is None or fqn_matches(node_meta.module_fqn(node), self.module)
        )


def parse_op_pattern(text: str, where: str) -> OpPattern:
    """Parse and check one entry; the op (and overload) must exist in torch.ops.aten.

    Raises:
        ConfigError: naming `where` (e.g. 'activation_checkpoint.save_list[0]'), the entry and what is wrong.
    """
    module, _, op_text = text.rpartition("::")
    parts = op_text.split(".")
    if module == "" and "::" in text or len(parts) not in (2, 3) or parts[0] != "aten" or not all(parts):
        raise ConfigError(f"{where}: {text!r} is not {SYNTAX}")
    packet = getattr(torch.ops.aten, parts[1], None)
    if not isinstance(packet, torch._ops.OpOverloadPacket):
        raise ConfigError(
            f"{where}: {text!r} names no ATen op 'aten.{parts[1]}'; "
            "use names as they appear in the dumped graph (e.g. aten.mm, aten.silu)"
        )
    overload = parts[2] if len(parts) == 3 else None
    if overload is not None and overload not in packet.overloads():
        raise ConfigError(
            f"{where}: aten.{parts[1]} has no overload {overload!r}; choose one of {', '.join(packet.overloads())}"
        )
    return OpPattern(text, module or None, packet._qualified_op_name, overload)


def parse_overrides(
    save_list: Sequence[str], recompute_list: Sequence[str], *, section: str = "activation_checkpoint"
) -> tuple[list[OpPattern], list[OpPattern]]:
    """(save patterns, recompute patterns), validated; errors name `section`.save_list[i] / .recompute_list[i]."""
    save = [parse_op_pattern(p, f"{section}.save_list[{i}]") for i, p in enumerate(save_list)]
    recompute = [parse_op_pattern(p, f"{section}.recompute_list[{i}]") for i, p in enumerate(recompute_list)]
    return save, recompute
