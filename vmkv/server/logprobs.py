"""Log-probabilities in the API's shapes: completions' parallel lists, chat's token objects and
vLLM's prompt_logprobs. One formatter per request, because return_tokens_as_token_ids decides
how each token is named there."""

from __future__ import annotations

from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase

from vmkv.engine.outputs import PromptLogprob
from vmkv.server.engine_client import TokenLogprob
from vmkv.server.protocol import (
    ChatLogprobs,
    CompletionLogprobs,
    PromptLogprobEntry,
    PromptLogprobs,
    TopLogprob,
)
from vmkv.server.protocol import TokenLogprob as ChatTokenLogprob


@dataclass
class LogprobFormatter:
    tokenizer: PreTrainedTokenizerBase
    as_token_ids: bool = False  # name tokens "token_id:<id>" (vLLM's return_tokens_as_token_ids)

    def text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def name(self, token_id: int) -> str:
        return f"token_id:{token_id}" if self.as_token_ids else self.text(token_id)

    def text_and_name(self, token_id: int) -> tuple[str, str]:
        """The token's text (completions' text offsets count it) and the name the answer gives it."""
        text = self.text(token_id)
        return text, f"token_id:{token_id}" if self.as_token_ids else text

    def completion(self, logprobs: list[TokenLogprob], text_start: int) -> CompletionLogprobs:
        """Generated tokens' logprobs; text offsets count characters of the text, whatever the names."""
        result = CompletionLogprobs()
        offset = text_start
        for entry in logprobs:
            text, token = self.text_and_name(entry.token_id)
            result.tokens.append(token)
            result.token_logprobs.append(entry.logprob)
            result.text_offset.append(offset)
            top = {token: entry.logprob}
            top.update((self.name(token_id), logprob) for token_id, logprob in entry.top)
            result.top_logprobs.append(top)
            offset += len(text)
        return result

    def echoed_prompt(
        self, prompt_ids: list[int], entries: list[PromptLogprob | None], k: int | None
    ) -> CompletionLogprobs:
        """An echoed prompt's tokens in the completions shape (vLLM's echo with logprobs): the
        first token has no logprob; each other one its own and the top k."""
        result = CompletionLogprobs()
        offset = 0
        for token_id, entry in zip(prompt_ids, entries, strict=True):
            text, token = self.text_and_name(token_id)
            result.tokens.append(token)
            result.text_offset.append(offset)
            offset += len(text)
            if entry is None:
                result.token_logprobs.append(None)
                result.top_logprobs.append(None)
                continue
            top = {token: entry[0][token_id]}
            top.update((self.name(t), lp) for t, lp in list(entry[0].items())[: k or 0])
            result.token_logprobs.append(entry[0][token_id])
            result.top_logprobs.append(top)
        return result

    def prompt(self, entries: list[PromptLogprob | None] | None, k: int | None) -> PromptLogprobs | None:
        """vLLM's prompt_logprobs: per prompt token, token id -> logprob, rank, decoded text.
        An entry holds the top-k best first, then the prompt's own token if it is not among them."""
        if entries is None or k is None:
            return None
        return [
            None
            if entry is None
            else {
                str(token_id): PromptLogprobEntry(
                    logprob=logprob, rank=i + 1 if i < k else entry[1], decoded_token=self.name(token_id)
                )
                for i, (token_id, logprob) in enumerate(entry[0].items())
            }
            for entry in entries
        ]

    def chat(self, logprobs: list[TokenLogprob]) -> ChatLogprobs:
        """Chat's shape; each token's `top` is already what the request asked for (the engine
        client cut it to top_logprobs, or to logprob_token_ids)."""

        def entry(token_id: int, logprob: float) -> TopLogprob:
            token = self.name(token_id)
            return TopLogprob(token=token, logprob=logprob, bytes=list(token.encode()))

        content = []
        for item in logprobs:
            chosen = entry(item.token_id, item.logprob)
            top = [entry(token_id, logprob) for token_id, logprob in item.top]
            content.append(ChatTokenLogprob(**chosen.model_dump(), top_logprobs=top))
        return ChatLogprobs(content=content)
