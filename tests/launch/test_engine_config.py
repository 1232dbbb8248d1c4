"""`engine.*` keys of the run config reach the LocalEngine the launcher starts."""

from __future__ import annotations

import asyncio

import pytest

from relayrl.config import RelayConfig, load_config
from relayrl.engine.local import LocalEngine
from relayrl.errors import ConfigError
from relayrl.launch.local import start_engine


class _Actor:
    """What start_engine reads from the actor: its model directory and weight version."""

    version = 0

    def __init__(self, model_dir: str) -> None:
        self._dir = model_dir

    def model_dir(self) -> str:
        """The directory the engine loads."""
        return self._dir


def test_max_prefill_tokens_from_the_config_reaches_the_local_engine(model_dir: str) -> None:
    cfg = load_config(RelayConfig, None, ["engine.max_prefill_tokens=1024", "engine.num_threads=1",
                                          "engine.prefix_cache_mb=0"])
    assert cfg.engine.max_prefill_tokens == 1024

    async def main() -> tuple[int, int, bool]:
        engine, managed = await start_engine(cfg, _Actor(model_dir))  # type: ignore[arg-type]
        try:
            assert isinstance(engine, LocalEngine) and managed is None
            return engine.max_prefill_tokens, engine.num_threads, engine.prefix_stats is None
        finally:
            await engine.aclose()

    assert asyncio.run(main()) == (1024, 1, True)
    default = load_config(RelayConfig, None, [])
    assert default.engine.max_prefill_tokens == 4096  # LocalEngine's own default


def test_max_prefill_tokens_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="max_prefill_tokens"):
        load_config(RelayConfig, None, ["engine.max_prefill_tokens=0"])
