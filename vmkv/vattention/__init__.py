"""The vAttention layout: per-sequence contiguous virtual KV, physical pages mapped on demand."""

from .cache import VAttentionConfig, VAttentionKVCache

__all__ = ["VAttentionConfig", "VAttentionKVCache"]
