"""Builds the C kernels (decode and prefill attention) once per source, flags and CPU.

A kernel is compiled with the system C compiler (`$CC`, default `cc`) the first time it is
used, into `$XDG_CACHE_HOME/vmkv/kernels` (default `~/.cache`), under a hash of the source,
the flags and this CPU's feature flags: later processes load it in milliseconds, and a cache
directory shared by different CPUs never hands one a binary built with the other's
`-march=native`.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path


def kernel_cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(root) / "vmkv" / "kernels"


def cpu_identity() -> str:
    """The CPU's feature flags: a binary built with -march=native only runs where they match."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), platform.processor())
    except OSError:
        return platform.machine() + platform.processor()


def build_c_library(stem: str, source: str, flags: list[str]) -> Path:
    """Compile `source` into a shared library, or reuse an earlier build of the same source,
    flags and CPU. Raises FileNotFoundError without a compiler, CalledProcessError (its stderr
    says why) when compilation fails."""
    key = "\n".join([source, " ".join(flags), cpu_identity()])
    target = kernel_cache_dir() / f"{stem}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise FileNotFoundError("no C compiler found (install one or set CC)")
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = Path(tmp) / f"{stem}.c"
        src.write_text(source)
        built = Path(tmp) / target.name
        subprocess.run(
            [compiler, *flags, "-o", str(built), str(src), "-lm"], check=True, capture_output=True, text=True
        )
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    return target
