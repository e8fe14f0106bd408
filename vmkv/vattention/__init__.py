"""The vAttention layout: per-sequence contiguous virtual KV, physical pages mapped on demand."""

from .cache import VAttentionKVCache
from .config import VAttentionConfig

__all__ = ["VAttentionConfig", "VAttentionKVCache"]
