"""Check CudaDriver on a real GPU and time the CUDA VMM calls per 2 MiB page.

Usage: python benchmarks/gpu_driver_check.py [--pages 100]
Exits 2 with a message when no GPU (or no cuda-python) is present.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from vmkv.drivers import CudaDriver, DriverUnavailableError

PAGE = 2 * 1024 * 1024


def check_mapping(drv: CudaDriver) -> None:
    """Write through views, remap a page and see its data, unmap; raise on any mismatch."""
    res = drv.reserve(2 * PAGE)
    a, b = drv.alloc(2)
    n = PAGE // 4
    drv.map(res, 0, [a])
    drv.map(res, PAGE, [b])
    drv.view(res, torch.float32, (n,), offset=0).fill_(1.0)
    drv.view(res, torch.float32, (n,), offset=PAGE).fill_(2.0)
    torch.cuda.synchronize(drv.device)
    drv.unmap(res, 0)
    drv.map(res, 0, [b])  # page b now at both offsets
    first = drv.view(res, torch.float32, (n,), offset=0)
    assert torch.all(first == 2.0), "remapped page does not show the other page's data"
    first.fill_(3.0)
    torch.cuda.synchronize(drv.device)
    assert torch.all(drv.view(res, torch.float32, (n,), offset=PAGE) == 3.0), "aliased write not seen"
    drv.unmap(res, 0)
    drv.map(res, 0, [a])
    assert torch.all(drv.view(res, torch.float32, (n,), offset=0) == 1.0), "page a lost its data"
    drv.release(res)
    drv.free([a, b])
    print(f"mapping check passed on {torch.cuda.get_device_name(drv.device)}")


def time_raw_calls(cu, device: int, count: int) -> dict[str, list[float]]:
    """Seconds per call of each VMM step, one 2 MiB page at a time, in the current context."""

    def ok(result):
        if result[0] != cu.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"CUDA call failed: {result[0]!r}")
        return result[1] if len(result) > 1 else None

    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = device
    access = cu.CUmemAccessDesc()
    access.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    access.location.id = device
    access.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    base = int(ok(cu.cuMemAddressReserve(count * PAGE, 0, 0, 0)))
    calls = ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap")
    times: dict[str, list[float]] = {name: [] for name in calls}

    def timed(name: str, call, *args):
        t0 = time.perf_counter()
        out = call(*args)
        times[name].append(time.perf_counter() - t0)
        return ok(out)

    handles = [timed("cuMemCreate", cu.cuMemCreate, PAGE, prop, 0) for _ in range(count)]
    for i, handle in enumerate(handles):
        timed("cuMemMap", cu.cuMemMap, base + i * PAGE, PAGE, 0, handle, 0)
        timed("cuMemSetAccess", cu.cuMemSetAccess, base + i * PAGE, PAGE, [access], 1)
    for i in range(count):
        timed("cuMemUnmap", cu.cuMemUnmap, base + i * PAGE, PAGE)
    for handle in handles:
        ok(cu.cuMemRelease(handle))
    ok(cu.cuMemAddressFree(base, count * PAGE))
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pages", type=int, default=100, help="pages timed per call (median reported)")
    parser.add_argument("--device", type=int, default=0)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("error: no CUDA GPU visible to torch; this check needs one", file=sys.stderr)
        return 2
    try:
        drv = CudaDriver(num_pages=4, page_size=PAGE, device=args.device)
    except DriverUnavailableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    torch.cuda.set_device(args.device)  # the raw timings run in this device's primary context
    with drv:
        check_mapping(drv)
        from cuda.bindings import driver as cu  # importable: CudaDriver just used it

        times = time_raw_calls(cu, args.device, args.pages)
    print(f"\n{'call (2 MiB page)':<20}{'median µs':>12}{'min µs':>10}{'max µs':>10}")
    for name, samples in times.items():
        us = [s * 1e6 for s in samples]
        print(f"{name:<20}{statistics.median(us):>12.1f}{min(us):>10.1f}{max(us):>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
