"""Shared fixtures: the tiny stand-in model (built once per session) and the real default model."""

from __future__ import annotations

from pathlib import Path

import pytest

from vmkv.model.store import pull_default_model
from vmkv.model.tiny import build_tiny_model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama checkpoint with a byte-level tokenizer; loads in milliseconds."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """SmolLM2-135M-Instruct, pulled into the user cache on first use (~93 MB download, then cached)."""
    return pull_default_model()
