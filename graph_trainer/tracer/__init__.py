"""Capture and execution of the whole training step as one FX graph.

    from graph_trainer.tracer import trace_step, GraphStep

`trace_step` traces one step into a `TracedStep`; `GraphStep` traces once per
batch signature and runs the graph every step. `node_meta` is the metadata
contract the graph passes read.
"""

from graph_trainer.tracer.capture import (
    GradReduce,
    GraphOptimizer,
    InputLayout,
    TracedStep,
    TraceError,
    batch_signature,
    trace_step,
)
from graph_trainer.tracer.executor import GraphStep, TraceStats, Transformed

__all__ = [
    "GradReduce",
    "GraphOptimizer",
    "GraphStep",
    "InputLayout",
    "TraceError",
    "TraceStats",
    "TracedStep",
    "Transformed",
    "batch_signature",
    "trace_step",
]
