"""The prefix-cache policy (hash chain, verified keys) lives in vmkv/prefix_cache.py, shared
with vattention; the paged layout imports it from here under its old name."""

from vmkv.prefix_cache import BlockKey, CacheIdentity, chain_hashes, hash_block

__all__ = ["BlockKey", "CacheIdentity", "chain_hashes", "hash_block"]
