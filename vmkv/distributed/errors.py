"""The typed errors of tensor parallelism."""

from __future__ import annotations


class TensorParallelConfigError(ValueError):
    """The model cannot be split over that many ranks (its head or MLP counts do not divide)."""


class TensorParallelError(RuntimeError):
    """The ranks can no longer step together (a rank exited, a collective failed). Fatal to the
    engine: a rank that missed part of a step cannot be brought back in step."""
