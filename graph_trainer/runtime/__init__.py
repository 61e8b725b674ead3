"""The process a run lives in: device and dtype policy, determinism, signals, and atomic file writes.

- `device`: which device and dtype a job runs on, peak FLOP/s, determinism.
- `interrupts`: SIGINT/SIGTERM handled between steps.
- `fsutil`: atomic writes and directory fsyncs.
- `gc_pause`: the cyclic garbage collector paused while a step is planned.
"""
