"""Whether flash-attn can serve a cache: decided once, before a layout picks its kernel.

`importlib.util.find_spec("flash_attn")` only says a package is installed. A build compiled
against another torch (or CUDA) fails with an ImportError (undefined symbol) at its first real
import, which used to happen mid-forward. Here the package is imported for real, once per
process, and the kernel's own limits are checked before it is chosen: CUDA, fp16/bf16,
head_dim at most 256 and a multiple of 8, compute capability 8.0 or newer (sm80+).
"""

from __future__ import annotations

import functools
import logging

import torch

log = logging.getLogger(__name__)

FLASH_DTYPES = (torch.float16, torch.bfloat16)
FLASH_MAX_HEAD_DIM = 256
FLASH_MIN_CAPABILITY = (8, 0)


@functools.cache
def flash_import_error() -> str | None:
    """None when flash_attn and its kernels import; otherwise why not (asked once per process)."""
    try:
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except Exception as e:  # a mismatched build raises ImportError or OSError from its .so
        return f"{type(e).__name__}: {e}"
    return None


def flash_unusable_reason(device: torch.device, dtype: torch.dtype, head_dim: int) -> str | None:
    """None when flash-attn can run attention of this shape on `device`, else the reason.

    The cheap checks go first, so a CPU cache never imports flash_attn.
    """
    if device.type != "cuda":
        return f"flash-attn runs on CUDA devices only, not {device.type}"
    if dtype not in FLASH_DTYPES:
        return f"flash-attn takes fp16 or bf16, not {dtype}"
    if head_dim > FLASH_MAX_HEAD_DIM or head_dim % 8:
        return f"flash-attn needs head_dim <= {FLASH_MAX_HEAD_DIM} and a multiple of 8, got {head_dim}"
    capability = torch.cuda.get_device_capability(device)
    if capability < FLASH_MIN_CAPABILITY:
        return f"flash-attn 2 needs compute capability 8.0 or newer, this GPU has {capability}"
    error = flash_import_error()
    if error is not None:
        return f"flash_attn does not import: {error}"
    return None


def flash_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """flash_unusable_reason as a bool; logs the reason once per distinct reason on a GPU."""
    reason = flash_unusable_reason(device, dtype, head_dim)
    if reason is not None and device.type == "cuda":
        _log_once(reason)
    return reason is None


@functools.cache
def _log_once(reason: str) -> None:
    log.info("not using flash-attn: %s", reason)
