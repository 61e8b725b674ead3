"""The eager baseline: the same step run by plain autograd, and eager activation checkpointing.

Every numerics and memory claim of the traced step is measured against it.
"""

from graph_trainer.eager.step import EagerStep

__all__ = ["EagerStep"]
