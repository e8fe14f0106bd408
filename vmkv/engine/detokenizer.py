"""Incremental detokenization: turn each new token into the text it adds, safely across
multi-byte characters.

A byte-level token can end in the middle of a UTF-8 character; decoding it alone gives
U+FFFD. Like vLLM, we decode a short window ending at the new tokens and its prefix
without them, emit the difference, and hold tokens back while the window's text still
ends in an incomplete character. The window starts a few tokens back so that tokenizers
which strip a leading space decode the boundary as they would the whole text.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

INCOMPLETE = "\ufffd"
CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    def __init__(
        self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int], skip_special_tokens: bool = True
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.prefix_offset = max(len(prompt_ids) - CONTEXT_TOKENS, 0)
        self.read_offset = len(prompt_ids)

    def step(self, token_ids: list[int], final: bool = False) -> str:
        """Text added by the tokens after read_offset in token_ids (the whole sequence).

        Returns "" while the new tokens end in an incomplete character, unless `final`,
        which flushes whatever is left (a truly invalid byte sequence then shows as U+FFFD).
        """
        if len(token_ids) == self.read_offset:
            return ""
        decode = self.tokenizer.decode
        prefix = decode(
            token_ids[self.prefix_offset : self.read_offset], skip_special_tokens=self.skip_special_tokens
        )
        full = decode(token_ids[self.prefix_offset :], skip_special_tokens=self.skip_special_tokens)
        if not final and (len(full) <= len(prefix) or full.endswith(INCOMPLETE)):
            return ""  # nothing visible yet (special token) or a character still incomplete
        self.prefix_offset = self.read_offset
        self.read_offset = len(token_ids)
        return full[len(prefix) :]
