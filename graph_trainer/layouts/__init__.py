"""The layout search behind `python -m graph_trainer.plan`: the cluster, the step-time cost model, the search over
parallel layouts and its report. It reads the trainer's plans and checks; nothing below it imports it."""
