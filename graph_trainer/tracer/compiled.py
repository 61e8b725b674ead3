"""The compile stage under the import path the README's tracer API documents; it lives in `graph_trainer.compiler`."""

from graph_trainer.compiler.inductor import InductorStage

__all__ = ["InductorStage"]
