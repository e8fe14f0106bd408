"""Errors a caller can act on: a request the engine will never be able to serve."""

from __future__ import annotations


class RequestRejected(ValueError):
    """Refused at admission: the request could never run (too long for max_model_len, larger
    than the whole KV budget, or invalid input). Raised before the engine holds any state for it."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param  # the request field to blame, if one is (an HTTP 400 names it)
