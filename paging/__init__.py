"""PagedAttention layout: block pool, block tables, copy-on-write, prefix caching, swap."""

from .cache import PagedKVCache

__all__ = ["PagedKVCache"]
