"""How much work one request may ask for, checked before any of it is done.

Without these, one request of 1,000 prompts x n=64 queued 64,000 samples, and a burst of
requests could grow the engine's waiting queue without bound. Each limit is a `vmkv serve`
flag; a request over one gets a 400 naming the field, and a request that arrives while the
queue is full gets a 429 with Retry-After, which OpenAI clients retry after a pause.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmkv.server.errors import APIError, bad_request

RETRY_AFTER_SECONDS = 1


@dataclass(frozen=True)
class RequestLimits:
    max_prompts: int = 64  # prompts in one /v1/completions request
    max_samples: int = 256  # prompts x n in one request
    max_stop_strings: int = 16
    max_waiting: int = 1024  # requests queued in the engine, beyond which new ones wait outside

    def __post_init__(self) -> None:
        for name, value in vars(self).items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")

    def check(self, num_prompts: int, n: int, num_stop_strings: int) -> None:
        if num_prompts > self.max_prompts:
            raise bad_request(f"{num_prompts} prompts in one request; at most {self.max_prompts}", "prompt")
        if num_prompts * n > self.max_samples:
            raise bad_request(
                f"{num_prompts} prompts x n={n} = {num_prompts * n} samples; at most {self.max_samples}", "n"
            )
        if num_stop_strings > self.max_stop_strings:
            raise bad_request(f"{num_stop_strings} stop strings; at most {self.max_stop_strings}", "stop")

    def check_queue(self, num_waiting: int) -> None:
        if num_waiting >= self.max_waiting:
            raise QueueFull(f"{num_waiting} requests are waiting, the most this server queues; retry shortly")


class QueueFull(APIError):
    def __init__(self, message: str) -> None:
        super().__init__(429, message, retry_after=RETRY_AFTER_SECONDS)
