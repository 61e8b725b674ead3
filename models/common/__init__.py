"""What every model family shares: the registry's spec type, the error for bad model arguments, norms and RoPE.

A family imports from here and from torch only; nothing under `models/` imports `graph_trainer`.
"""
