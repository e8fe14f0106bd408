"""The typed errors of tensor parallelism."""

from __future__ import annotations


class TensorParallelConfigError(ValueError):
    """The model cannot be split over that many ranks (its head or MLP counts do not divide)."""


class TensorParallelError(BaseException):
    """The ranks can no longer step together (a rank exited, a collective failed). Fatal to the
    engine: a rank that missed part of a step cannot be brought back in step.

    A BaseException, as SystemExit is, so that the handlers that keep an engine serving after
    a failed step (`except Exception`: the step's retry, the engine thread's loop) let it through
    and the engine stops: its front door then reports it dead (the server answers 503)."""
