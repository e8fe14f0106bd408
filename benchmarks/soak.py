"""Soak benchmark: minutes of steady load on `vmkv serve` in each KV mode, with random client
disconnects and stop strings; prints, per mode, what completed, hung up and failed, how resident
memory and the KV layout's units moved from the first third of the run to the last, and what
the server held once idle. Exits 1 if anything failed, leaked or grew past the bounds.

    python benchmarks/soak.py --seconds 180 --rate 4 [--modes vattention,paged,contiguous]
        [--burst N]      (N of the longest requests at once a third of the way in)
        [--kv-budget-mib M]   (default 16: the tiny model's runs map, evict and preempt)
        [--model PATH]   (default: a tiny random Llama, built on the fly)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from vmkv.bench.soak import SoakConfig, run_soak
from vmkv.model.tiny import build_tiny_model

MAX_RSS_GROWTH_MIB = 16.0  # per process, first third -> last third


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=180.0)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--modes", default="vattention,paged,contiguous")
    parser.add_argument("--burst", type=int, default=0, help="requests of an overload a third of the way in")
    parser.add_argument("--kv-budget-mib", type=int, default=16)
    parser.add_argument("--model", default=None, help="checkpoint directory (default: the tiny model)")
    parser.add_argument("--out", type=Path, default=None, help="write every sample as JSON here")
    args = parser.parse_args()
    model = args.model or str(build_tiny_model(Path(tempfile.mkdtemp()) / "tiny-llama"))
    ok, results = True, []
    for mode in args.modes.split(","):
        config = SoakConfig(
            model=model,
            kv_mode=mode,
            seconds=args.seconds,
            rate=args.rate,
            burst=args.burst,
            kv_budget_mib=args.kv_budget_mib,
        )
        result = run_soak(config)
        print(result.summary(), flush=True)
        for failure in result.failed[:5]:
            print("  failed:", failure)
        grew = max(result.growth("server_rss_mib"), result.engine_growth_beyond_mappings())
        ok &= not result.failed and result.leaked_bytes == 0 and grew <= MAX_RSS_GROWTH_MIB
        results.append(asdict(result))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1, default=str))
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
