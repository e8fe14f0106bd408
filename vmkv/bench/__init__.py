"""`vmkv bench`: A/B comparison of the KV layouts (workloads, metrics, capacity, kernels, report)."""
