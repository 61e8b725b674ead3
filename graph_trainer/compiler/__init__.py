"""Compiling the final step graph (`compile.backend = "inductor"`), whole or region by region.

- `inductor`: `InductorStage`, the compile stage a `GraphStep` transform ends with.
- `options`: which compile options run together (without importing Inductor).
- `regions`: cutting the final graph into per-layer regions, each distinct one compiled once.
"""
