"""Fixtures for the chat layer: both packaged models' directories, renderers and HF tokenizers.

Each is loaded once per test session; the Qwen model is provisioned on first use (about a minute).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from relayrl.chat.renderer import Renderer
from relayrl.models import model_path as packaged_model_path


@pytest.fixture(scope="session")
def model_path() -> Callable[[str], str]:
    """`model_path(name)`: the local HF directory of a packaged model (provisioned once)."""
    paths: dict[str, str] = {}

    def get(name: str) -> str:
        if name not in paths:
            paths[name] = packaged_model_path(name)
        return paths[name]

    return get


@pytest.fixture(scope="session")
def renderer_for(model_path: Callable[[str], str]) -> Callable[[str], Renderer]:
    """`renderer_for(name)`: the torch-free Renderer of a packaged model."""
    return lambda name: Renderer.from_pretrained(model_path(name))


@pytest.fixture(scope="session")
def hf_tokenizer_for(model_path: Callable[[str], str]) -> Callable[[str], Any]:
    """`hf_tokenizer_for(name)`: transformers' AutoTokenizer of a packaged model (the reference)."""
    from transformers import AutoTokenizer

    cache: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in cache:
            cache[name] = AutoTokenizer.from_pretrained(model_path(name))
        return cache[name]

    return get
