"""What a run reports: console logging, metrics and TensorBoard, memory measurement, digests, divergence.

- `log`: the `graph_trainer` logger (rank 0 prints progress).
- `metrics`: console lines, TensorBoard tags and `summary.json`.
- `memory`: the live-tensor tracker and the per-step memory monitor.
- `units`: bytes as GiB/MiB.
- `digest`: SHA-256 of tensors, for bitwise comparisons across runs.
- `divergence`: the guard that stops a run whose loss or weights stop being finite.
"""
