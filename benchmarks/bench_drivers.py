"""What HostDriver's map / unmap / first touch cost, per call and per MiB, as a Markdown table.

Usage: python benchmarks/bench_drivers.py [--quick]

Configurations run interleaved (A B A B ... rounds) so drift in machine load hits all of
them alike; every figure is the median over all samples. Times are of the public driver
calls (bookkeeping included), and of the mmap call alone ("of which OS", from the driver's
counters). "resident" pages were used before and are still backed by
memory; "fresh" pages were just punched, so their first fault also allocates and zeroes.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

import torch
from vmkv.drivers import HostDriver

KIB = 1024
MIB = 1024 * KIB
PAGE_SIZES = [4 * KIB, 16 * KIB, 64 * KIB, 256 * KIB, 2 * MIB]
TOUCH_STRIDE = 4 * KIB  # the OS page: one write per 4 KiB faults every page once


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


class PageSizeCase:
    """One page size with or without populate: a one-page pool mapped at offset 0 of a reservation."""

    def __init__(self, page_size: int, populate: bool) -> None:
        self.page_size, self.populate = page_size, populate
        self.driver = HostDriver(num_pages=1, page_size=page_size, populate=populate)
        self.res = self.driver.reserve(page_size)
        self.page = self.driver.alloc(1)[0]
        # numpy over the view: the cheapest strided write Python can issue (one byte per OS page).
        self.bytes = self.driver.view(self.res, torch.uint8, (page_size,)).numpy()
        self.samples: dict[str, list[float]] = defaultdict(list)

    def touch(self) -> None:
        self.bytes[::TOUCH_STRIDE] = 1

    def run(self, iters: int) -> None:
        d, res, s = self.driver, self.res, self.samples
        for _ in range(iters):
            before = d.stats
            s["map"].append(timed(lambda: d.map(res, 0, [self.page])))
            s["touch_resident"].append(timed(self.touch))
            s["unmap"].append(timed(lambda: d.unmap(res, 0)))
            after = d.stats
            s["map_os"].append(after.map_seconds - before.map_seconds)
            s["unmap_os"].append(after.unmap_seconds - before.unmap_seconds)
            d.free([self.page], punch=True)
            (self.page,) = d.alloc(1)
            s["map_fresh"].append(timed(lambda: d.map(res, 0, [self.page])))
            s["touch_fresh"].append(timed(self.touch))
            d.unmap(res, 0)

    def row(self) -> list[str]:
        med = {k: statistics.median(v) * 1e6 for k, v in self.samples.items()}
        per_mib = (med["map"] + med["unmap"]) * MIB / self.page_size
        size = f"{self.page_size // MIB} MiB" if self.page_size >= MIB else f"{self.page_size // KIB} KiB"
        values = [
            med["map"],
            med["map_os"],
            med["unmap"],
            med["unmap_os"],
            per_mib,
            med["map_fresh"],
            med["touch_resident"],
            med["touch_fresh"],
        ]
        return [size, "yes" if self.populate else "no", *(f"{v:,.1f}" for v in values)]


class RunCase:
    """2 MiB of 64 KiB pages, physically consecutive: one map call for the run, or one per page."""

    PAGE = 64 * KIB
    COUNT = 2 * MIB // PAGE

    def __init__(self, one_call: bool) -> None:
        self.one_call = one_call
        self.driver = HostDriver(num_pages=self.COUNT, page_size=self.PAGE)
        self.res = self.driver.reserve(self.COUNT * self.PAGE)
        self.pages = self.driver.alloc(self.COUNT)
        self.samples: dict[str, list[float]] = defaultdict(list)

    def map(self) -> None:
        if self.one_call:
            self.driver.map(self.res, 0, self.pages)
        else:
            for i, p in enumerate(self.pages):
                self.driver.map(self.res, i * self.PAGE, [p])

    def unmap(self) -> None:
        if self.one_call:
            self.driver.unmap(self.res, 0, self.COUNT)
        else:
            for i in range(self.COUNT):
                self.driver.unmap(self.res, i * self.PAGE)

    def run(self, iters: int) -> None:
        for _ in range(iters):
            calls = self.driver.stats.map_calls
            self.samples["map"].append(timed(self.map))
            self.samples["calls"].append(self.driver.stats.map_calls - calls)
            self.samples["unmap"].append(timed(self.unmap))

    def row(self) -> list[str]:
        med = {k: statistics.median(v) for k, v in self.samples.items()}
        how = "one call for the run" if self.one_call else "one call per page"
        return [how, f"{med['calls']:.0f}", f"{med['map'] * 1e6:,.1f}", f"{med['unmap'] * 1e6:,.1f}"]


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer rounds (well under a minute)")
    args = parser.parse_args()
    rounds, iters = (5, 40) if args.quick else (15, 100)

    cases = [PageSizeCase(ps, populate) for ps in PAGE_SIZES for populate in (False, True)]
    run_cases = [RunCase(one_call=True), RunCase(one_call=False)]
    for _ in range(rounds):
        for case in [*cases, *run_cases]:
            case.run(iters)

    samples = rounds * iters
    print(f"HostDriver, medians of {samples} samples, microseconds\n")
    header = [
        "page",
        "populate",
        "map",
        "of which OS",
        "unmap",
        "of which OS",
        "map+unmap per MiB",
        "map (fresh page)",
        "first touch (resident)",
        "first touch (fresh)",
    ]
    print(table(header, [c.row() for c in cases]))
    print(f"\n2 MiB as {RunCase.COUNT} physically consecutive 64 KiB pages\n")
    print(table(["mapping", "map calls", "map", "unmap"], [c.row() for c in run_cases]))
    for case in [*cases, *run_cases]:
        case.driver.close()


if __name__ == "__main__":
    main()
