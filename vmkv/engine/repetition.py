"""Repetition detection (vLLM's `repetition_detection`): a sample whose output ends in the
same pattern of tokens repeated enough times has fallen into a loop, and is ended there
instead of holding its KV and a batch slot until max_tokens."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass
class RepetitionDetection:
    """End a sample when its output ends with a pattern of min_pattern_size to max_pattern_size
    tokens repeated min_count times in a row."""

    max_pattern_size: int
    min_count: int
    min_pattern_size: int = 1

    def __post_init__(self) -> None:
        for name in ("max_pattern_size", "min_count", "min_pattern_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"repetition_detection.{name} must be an integer, got {value!r}")
        if not 1 <= self.min_pattern_size <= self.max_pattern_size:
            raise ValueError(
                "repetition_detection needs 1 <= min_pattern_size <= max_pattern_size, got "
                f"{self.min_pattern_size} and {self.max_pattern_size}"
            )
        if self.min_count < 2:
            raise ValueError(f"repetition_detection.min_count must be at least 2, got {self.min_count}")

    @property
    def span(self) -> int:
        """The most output tokens a check reads."""
        return self.max_pattern_size * self.min_count

    def repeats(self, output: Sequence[int]) -> bool:
        """Whether `output` ends with a pattern of a size in range repeated min_count times.
        Checked after every token, so only the tail that the newest token completed is read."""
        for size in range(self.min_pattern_size, self.max_pattern_size + 1):
            span = size * self.min_count
            if span > len(output):
                return False
            tail = output[-span:]
            if all(tail[i] == tail[i % size] for i in range(size, span)):
                return True
        return False
