"""Sequence lookups shared by the layouts that give each sequence one dense slot."""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

from vmkv.kv_cache import SequenceTooLong


class _SlotSeq(Protocol):
    slot: int  # -1 while swapped out


S = TypeVar("S", bound=_SlotSeq)


class DenseSlotSequences(Generic[S]):
    """Mixin for vattention and the contiguous baseline: both keep `seqs` by id and `max_len`."""

    max_len: int
    seqs: dict[int, S]

    def _check_len(self, length: int) -> None:
        if length > self.max_len:
            raise SequenceTooLong(f"{length} tokens exceed max_len {self.max_len}")

    def _get(self, seq_id: int) -> S:
        try:
            return self.seqs[seq_id]
        except KeyError:
            raise KeyError(f"sequence {seq_id} is not in the cache") from None

    def _resident(self, seq_id: int) -> S:
        seq = self._get(seq_id)
        if seq.slot < 0:
            raise ValueError(f"sequence {seq_id} is swapped out")
        return seq
