"""The start-up heap freeze: garbage made at start-up is collected, live objects leave the
collector's reach, and frozen objects are still freed by reference counting. Each case runs
in a fresh interpreter, since a freeze is process-wide."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120, check=True
    )
    return result.stdout.strip()


def test_start_up_garbage_is_collected_and_live_objects_are_frozen() -> None:
    out = run_python(
        """
        import gc, weakref
        from vmkv.engine.gc_heap import freeze_start_up_heap

        class Node:
            pass

        garbage = Node(); garbage.self = garbage   # a cycle only the collector can free
        dead = weakref.ref(garbage); del garbage
        live = [Node() for _ in range(10_000)]
        gc.disable()                               # no automatic collection before the freeze
        freeze_start_up_heap()
        print(dead() is None, gc.get_freeze_count() >= len(live), all(gc.is_tracked(n) for n in live))
        """
    )
    assert out == "True True True"


def test_frozen_objects_are_freed_by_their_last_reference_and_later_garbage_collected() -> None:
    out = run_python(
        """
        import gc, weakref
        from vmkv.engine.gc_heap import freeze_start_up_heap

        class Node:
            pass

        frozen = Node()
        frozen_ref = weakref.ref(frozen)
        freeze_start_up_heap()
        del frozen                                  # no cycle: reference counting frees it
        later = Node(); later.self = later          # made after the freeze
        later_ref = weakref.ref(later); del later
        gc.collect()
        print(frozen_ref() is None, later_ref() is None)
        """
    )
    assert out == "True True"


def test_a_frozen_heap_exits_without_native_leak_reports() -> None:
    """Triton's nanobind bindings (imported by the paged cache) report the instances still alive
    at exit; frozen cycles holding them were never collected, so every served process ended
    with that report on stderr."""
    code = "import vmkv.paging\nfrom vmkv.engine.gc_heap import freeze_start_up_heap\nfreeze_start_up_heap()"
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert "leaked" not in result.stderr
