"""Tensor parallelism on torch.distributed: one model split over ranks, one KV manager on rank 0.

The engine's process is rank 0 (scheduler, KV manager, sampling); `worker.py` is every other
rank. docs/scale-out.md has the process layout and what crosses between ranks each step.
"""
