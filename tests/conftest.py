"""Shared fixtures: the tiny stand-in model (built once per session), the real default model,
single-threaded torch for the modules that opt in, and eager engines unless a test asks to compile."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from vmkv.engine import config
from vmkv.model.store import pull_default_model
from vmkv.model.tiny import build_tiny_model


@pytest.fixture(scope="session", autouse=True)
def eager_by_default() -> Iterator[None]:
    """Engines built here run eagerly unless a test passes compile_model=True: the suite builds
    ~150 short-lived engines, and compiling each would cost 15-30 s (tests/test_compiled.py and
    the compile_model=True cases cover the compiled path). The resolution itself is tested
    against the real default."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(config, "COMPILE_BY_DEFAULT", False)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama checkpoint with a byte-level tokenizer; loads in milliseconds."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct, pulled into the user cache on first use (~93 MB download, then cached)."""
    return pull_default_model()


@pytest.fixture
def one_torch_thread() -> Iterator[None]:
    """Run single-threaded: small shapes gain nothing from a second thread, and on a busy 2-core
    machine OpenMP barriers waiting for a descheduled thread made engine steps ~18x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
