"""graph_trainer: train Llama-class models with the whole step captured as one FX graph."""

__version__ = "0.1.0"
