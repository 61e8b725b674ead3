"""Parallelism: the process group and mesh, and each way of splitting a model over ranks.

- `launch`: torchrun's environment checked against the config; joining and leaving the process group.
- `fsdp`: fully sharded data parallelism with its collectives in the traced graph.
"""
