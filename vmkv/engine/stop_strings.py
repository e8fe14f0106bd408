"""Stop strings: where generated text ends, and how much of it a stream may show yet.

Shared by the engine (when it detokenizes itself) and the API process's output processor
(when the engine runs in its own process and sends only token ids), so both cut text alike.
"""

from __future__ import annotations


def find_stop(text: str, stops: list[str], delta_len: int) -> tuple[int, str] | None:
    """The earliest stop string that the last `delta_len` characters of `text` completed, as
    (where it starts, the string); None if there is none. Earlier text was checked before."""
    found: tuple[int, str] | None = None
    for stop in stops:
        at = text.find(stop, max(0, len(text) - delta_len - len(stop) + 1))
        if at != -1 and (found is None or at < found[0]):
            found = (at, stop)
    return found


def cut_at_stop(text: str, at: int, stop: str, include_stop: bool) -> str:
    """The sample's final text: up to the stop string found at `at`, or through it if asked."""
    return text[: at + len(stop)] if include_stop else text[:at]


def partial_tag_len(text: str, tags: tuple[str, ...]) -> int:
    """How many characters at the end of `text` could begin one of `tags`: what a stream holds
    back until the next piece shows whether a tag (a parser's, not a stop string) is starting."""
    for size in range(min(max(map(len, tags)) - 1, len(text)), 0, -1):
        if any(tag.startswith(text[-size:]) for tag in tags):
            return size
    return 0


def stop_hold(stops: list[str]) -> int:
    """Characters a stream holds back while running: as many as a stop string could still cover."""
    return max((len(s) for s in stops), default=1) - 1


def visible_text(text: str, finished: bool, hold: int) -> str:
    """The part of a sample's text that no stop string can take back any more."""
    if finished or hold == 0:
        return text
    return text[: max(len(text) - hold, 0)]
