"""Custom logits processors: user code that changes a step's logits, loaded by name.

`EngineConfig.logits_processors` names LogitsProcessor subclasses ("package.module:Class" or
"package.module.Class"); the engine makes one of each at start, in its own process, and the
sampler hands each the rows it applies to: after vmkv's own processors (masks, biases,
penalties), before the draw and before a spent thinking budget forces its end token. A
request opts in through `SamplingParams.extra_args` (the server's `vllm_xargs`), which a
processor reads in `applies_to`; rows it does not apply to never reach it, so a server with
processors loaded costs a request that uses none nothing but that check.

vLLM's v1 interface follows its persistent batch (requests added, moved, removed between
steps); vmkv's sampler sees each step's rows afresh, so a processor here gets the rows
themselves (their parameters, prompt and output tokens) and keeps no batch state in step.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from vmkv.engine.errors import RequestRejected
from vmkv.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from vmkv.engine.sampler import SampleRow


class LogitsProcessor(ABC):
    """One custom processor; the engine makes it with the model's vocabulary size and device."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device

    @classmethod  # noqa: B027 - optional: by default every request's extra_args are accepted
    def validate_params(cls, params: SamplingParams) -> None:
        """Raise ValueError for extra_args this processor cannot use: the request is refused
        (a 400 naming the problem) before it runs."""

    @abstractmethod
    def applies_to(self, params: SamplingParams) -> bool:
        """Whether this request's rows go through apply (from its extra_args, typically)."""

    @abstractmethod
    def apply(self, logits: torch.Tensor, rows: Sequence[SampleRow]) -> None:
        """Change, in place, the float32 logits [len(rows), vocab_size] of the rows it applies
        to; each row has its SamplingParams, prompt + output token ids and prompt length."""


def logits_processor_class(name: str) -> type[LogitsProcessor]:
    """The named class; ValueError saying why it cannot be used."""
    module_name, _, class_name = name.rpartition(":") if ":" in name else name.rpartition(".")
    if not module_name or not class_name:
        raise ValueError(f"logits processor {name!r}: give it as package.module:Class")
    try:
        found = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"logits processor {name!r} cannot be loaded: {error}") from error
    if not (isinstance(found, type) and issubclass(found, LogitsProcessor)):
        raise ValueError(f"logits processor {name!r} is not a vmkv.engine.LogitsProcessor subclass")
    return found


def check_extra_args(processors: Sequence[type[LogitsProcessor]], params: SamplingParams) -> None:
    """Raise RequestRejected (naming extra_args) if a processor refuses the request's arguments."""
    for processor in processors:
        try:
            processor.validate_params(params)
        except ValueError as error:
            raise RequestRejected(f"{processor.__name__}: {error}", "extra_args") from error
