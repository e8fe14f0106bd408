"""vmkv: a KV-cache engine with a virtual-memory (vAttention) layout and a paged layout."""
