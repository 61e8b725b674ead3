"""The optimizer: AdamW (eager, or traced into the step graph by `GraphAdamW`), the LR schedule, clipping.

from graph_trainer.optimizer import GraphAdamW
"""

from graph_trainer.optimizer.adamw import GraphAdamW

__all__ = ["GraphAdamW"]
