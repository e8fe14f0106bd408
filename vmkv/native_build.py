"""Builds the native kernels once per source, flags and machine: the C attention kernels
(decode, prefill) and the C++ torch operators (engine/gemv_kernel.py, engine/native_attention.py).

A kernel is compiled the first time it is used, into `$XDG_CACHE_HOME/vmkv/kernels` (default
`~/.cache`), under a hash of the source and what its binary depends on (the flags, and this
CPU's feature flags for `-march=native` builds or torch's version for an operator built
against its headers): later processes load it in milliseconds, and a cache directory shared
by different CPUs never hands one a binary built for the other.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sysconfig
import tempfile
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger(__name__)


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


def build_library(
    stem: str, source: str, suffix: str, depends_on: list[str], command: Callable[[Path, Path], list[str]]
) -> Path:
    """Compile `source` (written to a file ending in suffix) with command(source file, target)
    into a shared library, or reuse an earlier build of the same source and depends_on.
    Raises what `command` raises (FileNotFoundError without a compiler) or CalledProcessError
    (its stderr says why) when compilation fails."""
    key = "\n".join([source, *depends_on])
    target = kernel_cache_dir() / f"{stem}_{hashlib.sha256(key.encode()).hexdigest()[:16]}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src, built = Path(tmp) / f"{stem}{suffix}", Path(tmp) / target.name
        src.write_text(source)
        subprocess.run(command(src, built), check=True, capture_output=True, text=True)
        os.replace(built, target)  # atomic: concurrent builders leave one complete file
    return target


def build_c_library(stem: str, source: str, flags: list[str]) -> Path:
    """build_library for C source with the system C compiler (`$CC`, default `cc`)."""

    def command(src: Path, target: Path) -> list[str]:
        compiler = shutil.which(os.environ.get("CC", "cc"))
        if compiler is None:
            raise FileNotFoundError("no C compiler found (install one or set CC)")
        return [compiler, *flags, "-o", str(target), str(src), "-lm"]

    return build_library(stem, source, ".c", [" ".join(flags), cpu_identity()], command)


def load_c_library(stem: str, source: str, flags: list[str], unavailable: str) -> ctypes.CDLL | None:
    """build_c_library, loaded; None where it cannot be built or loaded, after a warning that
    starts with `unavailable` and says why."""
    try:
        return ctypes.CDLL(str(build_c_library(stem, source, flags)))
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("%s: %s", unavailable, build_failure(e))
        return None


def load_c_function(
    stem: str, source: str, flags: list[str], unavailable: str, symbol: str, restype: object, argtypes: list
) -> ctypes._CFuncPtr | None:
    """Function `symbol` of load_c_library's library, with its C signature; None where the library
    is unavailable. The function keeps its library loaded."""
    library = load_c_library(stem, source, flags, unavailable)
    if library is None:
        return None
    function = getattr(library, symbol)
    function.restype, function.argtypes = restype, argtypes
    function.library = library
    return function


def build_torch_library(stem: str, source: str, flags: tuple[str, ...]) -> Path:
    """build_library for C++ torch operators (TORCH_LIBRARY), built against this torch's headers
    with the system C++ compiler (`$CXX`, default `c++`); load the result with torch.ops.load_library."""
    import torch
    from torch.utils import cpp_extension  # ~120 ms to import; only a build needs it

    def command(src: Path, target: Path) -> list[str]:
        compiler = shutil.which(os.environ.get("CXX", "c++"))
        if compiler is None:
            raise FileNotFoundError("no C++ compiler found (install one or set CXX)")
        torch_lib = Path(torch.__file__).parent / "lib"
        return [
            compiler,
            *flags,
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
            *(f"-I{p}" for p in cpp_extension.include_paths()),
            f"-I{sysconfig.get_paths()['include']}",
            "-o",
            str(target),
            str(src),
            f"-L{torch_lib}",
            f"-Wl,-rpath,{torch_lib}",
            "-lc10",
            "-ltorch_cpu",
        ]

    return build_library(stem, source, ".cpp", [" ".join(flags), torch.__version__], command)


def build_failure(error: Exception) -> str:
    """Why a build or load failed: the compiler's last output, or the error itself."""
    if isinstance(error, subprocess.CalledProcessError):
        return error.stderr.strip()[-2000:]
    return str(error)
