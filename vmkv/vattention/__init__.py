"""The vAttention layout: per-sequence contiguous virtual KV, physical pages mapped on demand."""
