"""Errors a caller can act on: a request the engine will never be able to serve, an operator's
call its state refuses."""

from __future__ import annotations


class RequestRejected(ValueError):
    """Refused at admission: the request could never run (too long for max_model_len, larger
    than the whole KV budget, or invalid input). Raised before the engine holds any state for it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field to blame, if one is (an HTTP 400 names it)


class ControlRefused(RuntimeError):
    """An operator's call the engine's state refuses (resume while memory is asleep, say): the
    call changed nothing; another call first (wake_up) makes it possible."""
