"""Model loading: the pulled default SmolLM2 checkpoint, local checkpoints, a tiny test model."""
