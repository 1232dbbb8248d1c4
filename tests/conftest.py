"""Shared fixtures: the default model's directory (provisioned once per machine)."""

from __future__ import annotations

import pytest

from relayrl.models import DEFAULT_MODEL, model_path


@pytest.fixture(scope="session")
def model_dir() -> str:
    """Local HF directory of the default packaged model."""
    return model_path(DEFAULT_MODEL)
