"""Construction from a budget: how many page sets a byte budget or a driver holds, the page
size and order that follow, and the driver to build when none is given."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

import torch

from vmkv.drivers import CudaDriver, HostDriver, HostMemoryError, MemoryDriver, require_available
from vmkv.kv_cache import KVShape
from vmkv.vattention.config import VAttentionConfig, default_layout, device_page_size
from vmkv.vattention.geometry import SlotGeometry

logger = logging.getLogger(__name__)


@dataclass
class Sizing:
    """What a cache is built from: its driver, geometry and number of page sets."""

    config: VAttentionConfig
    driver: MemoryDriver
    owns_driver: bool  # built here, so the cache closes it
    geometry: SlotGeometry
    num_sets: int


def size_cache(
    shape: KVShape,
    max_len: int,
    kv_budget_bytes: int | None,
    device: torch.device | str | None,
    driver: MemoryDriver | None,
    config: VAttentionConfig | None,
    options: dict[str, object],
) -> Sizing:
    """Over `driver`, or over a driver of kv_budget_bytes for `device` when none is given
    (HostDriver on CPU; CudaDriver with 2 MiB pages on a GPU). options override config fields."""
    cfg = dataclasses.replace(config or VAttentionConfig(), **options)
    if driver is None and kv_budget_bytes is None:
        raise ValueError("give kv_budget_bytes or a driver")
    if driver is not None and "page_size" in options and options["page_size"] != driver.page_size:
        raise ValueError(f"page_size {options['page_size']} differs from the driver's {driver.page_size}")
    target = torch.device(device or (driver.device if driver is not None else "cpu"))
    order, page_size = resolve_layout(cfg, target.type, driver.page_size if driver is not None else None)
    probe = SlotGeometry(shape, max_len, cfg.max_slots or 1, page_size, order)  # validates
    budget_pages = driver.free_page_count if driver is not None else kv_budget_bytes // page_size
    if kv_budget_bytes is not None:
        budget_pages = min(budget_pages, kv_budget_bytes // page_size)
    num_sets = budget_pages // probe.units
    if num_sets < 1:
        raise ValueError(
            f"a budget of {budget_pages} pages holds no page set ({probe.units} pages of {page_size} B)"
        )
    owns_driver = driver is None
    if cfg.preallocate and (not owns_driver or target.type != "cpu"):
        raise ValueError(
            "preallocate backs the CPU pool a cache builds: a given driver backs its own pages, "
            "and the GPU driver creates every page at start"
        )
    if driver is None and target.type == "cuda":
        driver = CudaDriver(num_sets * probe.units, page_size, device=target.index or 0)
    elif driver is None:
        if target.type != "cpu":
            raise ValueError(f"no memory driver for device {target}")
        driver = HostDriver(num_sets * probe.units, page_size, cfg.populate, cfg.preallocate)
        _warn_if_unbackable(driver.num_pages * page_size)
    elif (target.type, target.index or 0) != (driver.device.type, driver.device.index or 0):
        raise ValueError(f"device {device} differs from the driver's {driver.device}")
    geometry = dataclasses.replace(
        probe, max_slots=cfg.max_slots or min(num_sets, 256), huge_run=driver.huge_run
    )
    return Sizing(cfg, driver, owns_driver, geometry, num_sets)


def resolve_layout(cfg: VAttentionConfig, device_type: str, driver_page: int | None) -> tuple[str, int]:
    """The order and page size a cache is built with: the given driver's page size, else the
    config's, else the device's; an "auto" order with neither given takes default_layout's."""
    page_size = driver_page or cfg.page_size
    if cfg.order == "auto" and page_size is None:
        return default_layout(device_type)
    return ("packed" if cfg.order == "auto" else cfg.order), page_size or device_page_size(device_type)


def _warn_if_unbackable(pool_bytes: int) -> None:
    """An on-demand pool may be larger than the memory the machine has (it is backed only as
    sequences grow, and other tenants may free theirs), but past that the kernel's OOM killer
    ends the process mid-step, so say so at start: the check that refuses a pool backed at once."""
    try:
        require_available(pool_bytes, "the KV pool")
    except HostMemoryError as error:
        logger.warning(
            "the KV pool (%.1f MiB) is larger than this machine's available memory (%.1f MiB): "
            "if sequences grow to fill it the kernel may kill the process; a smaller budget avoids it",
            error.requested / 2**20,
            error.available / 2**20,
        )
