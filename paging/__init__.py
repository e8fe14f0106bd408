"""PagedAttention layout: block pool, block tables, copy-on-write, prefix caching, swap."""
