"""Reasoning split from the answer: the `<think>...</think>` block reasoning models write first
goes to the message's `reasoning` (vLLM's field), the rest is the content.

`--reasoning-parser` names the convention (vLLM's names): deepseek_r1 reads everything up to
`</think>` as reasoning, the opening tag optional (DeepSeek-R1 and Qwen3 *-Thinking-2507 open
it in the prompt); qwen3 reads reasoning only from an answer that opens with `<think>`, so an
answer with thinking switched off is all content. Only a tag at the very start opens the block,
so whole and streamed readings agree.
"""

from __future__ import annotations

from dataclasses import dataclass

from vmkv.engine.stop_strings import partial_tag_len

REASONING_PARSERS = ("deepseek_r1", "qwen3")
START, END = "<think>", "</think>"


def split_reasoning(text: str, parser: str) -> tuple[str | None, str | None]:
    """(reasoning, content) of an answer; a block never closed (cut by max_tokens) is all reasoning."""
    stripped = text.lstrip()
    opened = stripped.startswith(START)
    if parser == "qwen3" and not opened:
        return None, text
    body = stripped[len(START) :] if opened else text
    if END not in body:
        return body, None
    reasoning, _, content = body.partition(END)
    return reasoning, content or None


def thinks_first(prompt: str) -> bool:
    """Whether the answer to this rendered prompt starts with thinking: not when the prompt's
    last thinking block is already closed (a template that switched thinking off writes an
    empty one)."""
    start = prompt.rfind(START)
    return start == -1 or END not in prompt[start:]


@dataclass
class ReasoningStream:
    """One choice's streamed text split as it comes; a tail that could begin a tag is held back
    until the next piece (or the end) shows what it is."""

    parser: str
    text: str = ""
    reasoning_sent: int = 0
    content_sent: int = 0

    def delta(self, new: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) for the choice's new text."""
        self.text += new
        visible = (
            self.text if finished else self.text[: len(self.text) - partial_tag_len(self.text, (START, END))]
        )
        reasoning, content = split_reasoning(visible, self.parser)
        reasoning, content = reasoning or "", content or ""
        new_reasoning, new_content = reasoning[self.reasoning_sent :], content[self.content_sent :]
        self.reasoning_sent, self.content_sent = len(reasoning), len(content)
        return new_reasoning, new_content
