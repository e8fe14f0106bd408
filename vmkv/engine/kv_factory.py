"""The one place the kv_mode flag matters: build the KV cache the engine drives."""

from __future__ import annotations

from collections.abc import Callable

from vmkv.contiguous import ContiguousKVCache
from vmkv.engine.config import EngineConfig
from vmkv.kv_cache import KVCache, KVShape
from vmkv.paging import PagedKVCache
from vmkv.vattention import VAttentionKVCache


def build_kv_cache(
    config: EngineConfig,
    shape: KVShape,
    model_id: str,
    paged: type[PagedKVCache] = PagedKVCache,
    contiguous: type[ContiguousKVCache] = ContiguousKVCache,
    vattention: Callable[..., VAttentionKVCache] | None = None,
) -> KVCache:
    """A cache of config.kv_budget_bytes holding sequences up to config.max_model_len tokens.

    model_id keys both prefix caches (paged's blocks, vattention's chunks of pages), so KV is
    never shared across models; a request's cache_salt keys it per tenant. paged, contiguous
    and vattention may name subclasses (tensor parallelism's rank 0 records what its cache does).
    """
    if config.kv_mode == "vattention":
        options: dict[str, object] = {}  # unset ones: the layout's own (VAttentionConfig)
        if config.kv_order != "auto":
            options["order"] = config.kv_order
        if config.page_size is not None:
            options["page_size"] = config.page_size
        if config.kv_preallocate:
            options["preallocate"] = True
        return (vattention or VAttentionKVCache)(
            shape,
            config.max_model_len,
            config.kv_budget_bytes,
            config.device,
            model_id=model_id,
            prefix_caching=config.enable_prefix_caching,
            **options,
        )
    if config.kv_mode == "paged":
        return paged(
            shape,
            config.max_model_len,
            config.kv_budget_bytes,
            block_size=config.block_size,
            device=config.device,
            enable_prefix_caching=config.enable_prefix_caching,
            model_id=model_id,
        )
    return contiguous(shape, config.max_model_len, config.kv_budget_bytes, config.device)
