"""VAttentionConfig: the layout's switches, each one vAttention optimisation or choice."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vmkv.dense.plan import DEFAULT_MAX_PADDING
from vmkv.drivers import DEFAULT_PAGE_SIZE

CUDA_PAGE_SIZE = 2 * 1024 * 1024  # the cuMemCreate granularity on current GPUs
AMX_PAGE_SIZE = 16 * 1024  # token-major's page where the CPU has AMX tiles (default_layout)


def default_layout(device_type: str) -> tuple[str, int]:
    """(order, page size) of a cache that sets neither, chosen by measurement
    (docs/vattention.md, "The default layout"; `vmkv bench --sections capacity`).

    A GPU's driver pages are 2 MiB, which only layer-packed fills with few tokens. On a CPU the
    page size is ours to choose. Layer-packed at 64 KiB holds the most sequences (SmolLM2, 360
    MiB: 149, token-major at 16 KiB 128, paged 140), but its layer's rows lie 23,040 B apart,
    and where AMX tiles make the GEMMs fast that read pattern costs the engine: on a 2-core AMX
    Xeon, offline 64 x 256/128, token-major at 16 KiB ran at ~0.93x paged's output and
    layer-packed at ~0.81x. Elsewhere (a Zen 4 EPYC) layer-packed ran level with paged.
    """
    if device_type != "cuda" and torch.cpu._is_amx_tile_supported():
        return "token", AMX_PAGE_SIZE
    return "packed", device_page_size(device_type)


def device_page_size(device_type: str) -> int:
    """The page size where an order is chosen but no page size: the GPU driver's, else 64 KiB."""
    return CUDA_PAGE_SIZE if device_type == "cuda" else DEFAULT_PAGE_SIZE


ATTENTION_PATHS = ("auto", "cpu_kernel", "sdpa")


@dataclass(frozen=True)
class VAttentionConfig:
    # None: the device's (CUDA_PAGE_SIZE on a GPU; on a CPU default_layout's, or DEFAULT_PAGE_SIZE
    # where the order is given)
    page_size: int | None = None
    # "token" [slot, len, Hkv, D] or "head" [slot, Hkv, len, D] per layer's K/V, "packed"
    # [slot, len, layers, 2, Hkv, D] for all of them (geometry.py), or "auto": default_layout's
    # where the page size is not given either, else layer-packed (the most sequences at any page)
    order: str = "auto"
    max_slots: int | None = None  # default: min(page sets, 256)
    combined_reservation: bool = False  # one reservation for every K/V tensor
    background_mapping: bool = True
    deferred_reclamation: bool = True
    eager_steps: int = 0
    # the background mapper backs a growing sequence this many bytes of page sets beyond its next
    # token (at least one set), so it wakes once every few pages, not at every page. With 64 KiB
    # packed sets (8 a job, ~22 tokens of SmolLM2), the at-once wave (64 x 256/128, bf16, compiled,
    # 2-core Zen 4 EPYC, 8 alternated waves in one process): 632 map calls a wave against 3,097,
    # the mapper's CPU 0.44 s against 0.58-0.61 s, output ahead in 6 of 8 pairs by 1.7% at the
    # median pair (docs/vattention.md, "A few pages a job").
    ahead_bytes: int = 512 << 10
    populate: bool = True  # pre-fault pages at map time (only for a driver this cache builds)
    # back the whole pool when the cache is built (a CPU driver this cache builds), as the paged
    # pool is: no step maps memory the machine never touched, and none goes back to the OS
    preallocate: bool = False
    max_padding: float = DEFAULT_MAX_PADDING
    group_pad_pages: int = 1  # pages a decode may get beyond its needs to join a batched call
    # pre-mapped idle slots for admissions (the reserve): with the mapper and deferred reclamation
    # on, the mapper keeps idle slots backed for the longest part of the last prompts that
    # admissions had to back themselves (premap_tokens before any), twice as many as the most
    # admitted in one step lately (premap_slots before any, and at most), so an admission maps
    # nothing on the step thread. The reserve holds at most premap_fraction of the page sets (whole slots
    # only), is reclaimed at once when a sequence needs the memory, and is dropped after
    # kept_idle_seconds without an admission. Measured (docs/vattention.md): in
    # benchmarks/bench_sharing.py (fp32, 256 MiB) the old 16 slots x 256 tokens held 180 MiB, this
    # bound 16 MiB; in vmkv bench's offline run (12 chat prompts at once, bf16, 512 MiB) 11 slots
    # of 128 tokens left 2 of 56 map calls on the step thread (5 slots of 256 tokens: 7-8 of 126-144).
    premap_slots: int = 16
    premap_tokens: int = 128
    premap_fraction: float = 1 / 16
    use_flash_attn: bool = True  # flash_attn_with_kvcache when importable and on a GPU
    # decode attention on the CPU: "cpu_kernel" (vmkv/decode_kernel.py, reads the slots in
    # place), "sdpa" (stock kernels, unmodified, on the virtual memory), or "auto": the kernel
    # where it can be built (bf16/fp16/fp32, head_dim a multiple of 16, a C compiler), else sdpa
    attention: str = "auto"
    debug: bool = False  # verify every range a kernel reads is mapped
    # automatic prefix caching: full chunks of written pages are indexed by a hash chain of their
    # tokens and the cache identity; a new prompt maps its longest verified cached prefix (prefix.py)
    prefix_caching: bool = False
    # pages kept for reuse (idle slots, cached chunks nobody maps; kept.py): up to this fraction of
    # the page sets stays; beyond it, sets idle this long go back to the OS (None: never on time),
    # and at once while the machine's available memory is under pressure_min_available of its total
    kept_watermark: float = 0.25
    kept_idle_seconds: float | None = 30.0
    pressure_min_available: float = 0.05

    def __post_init__(self) -> None:
        if self.eager_steps < 0:
            raise ValueError(f"eager_steps must be >= 0, got {self.eager_steps}")
        if self.ahead_bytes < 0:
            raise ValueError(f"ahead_bytes must be >= 0, got {self.ahead_bytes}")
        if self.premap_slots < 0 or self.premap_tokens < 1:
            raise ValueError(
                f"premap_slots must be >= 0 and premap_tokens >= 1, "
                f"got {self.premap_slots} and {self.premap_tokens}"
            )
        if not 0 <= self.premap_fraction <= 1:
            raise ValueError(f"premap_fraction must be in [0, 1], got {self.premap_fraction}")
        if not 0 <= self.kept_watermark <= 1:
            raise ValueError(f"kept_watermark must be in [0, 1], got {self.kept_watermark}")
        if self.kept_idle_seconds is not None and self.kept_idle_seconds < 0:
            raise ValueError(f"kept_idle_seconds must be >= 0, got {self.kept_idle_seconds}")
        if self.attention not in ATTENTION_PATHS:
            raise ValueError(f"attention must be one of {ATTENTION_PATHS}, got {self.attention!r}")
