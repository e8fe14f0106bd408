"""vmkv: a KV-cache engine with a virtual-memory (vAttention) layout and a paged layout."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vmkv.engine import LLM, SamplingParams

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> object:
    """Import the engine (and with it transformers) only when LLM or SamplingParams is used,
    so `import vmkv.drivers` and the CLI's help stay fast."""
    if name in __all__:
        import vmkv.engine

        return getattr(vmkv.engine, name)
    raise AttributeError(f"module 'vmkv' has no attribute {name!r}")
