"""Helpers shared by the engines that talk to an inference server over HTTP (vLLM, SGLang).

Imports httpx, the standard library and relayrl.types only (torch only inside `save_state_dir`,
which is reached only by a caller that already holds torch tensors).
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

from relayrl.types import Timings

UNKNOWN_VOCAB = 1 << 31
"""Vocabulary size used for validation when no local config names one (the server checks)."""


class LoopClients:
    """One `httpx.AsyncClient` per event loop.

    An httpx client's connections belong to the loop that opened them, and callers (tests, the
    trainer's threads, the gateway) may drive one engine from several loops.
    """

    def __init__(self, timeout: httpx.Timeout, headers: Mapping[str, str]) -> None:
        self._timeout = timeout
        self._headers = dict(headers)
        self._clients: dict[int, httpx.AsyncClient] = {}

    def get(self) -> httpx.AsyncClient:
        """The running loop's client (made on first use)."""
        key = id(asyncio.get_running_loop())
        client = self._clients.get(key)
        if client is None or client.is_closed:
            client = httpx.AsyncClient(timeout=self._timeout, headers=self._headers)
            self._clients[key] = client
        return client

    async def aclose(self) -> None:
        """Close the running loop's client; forget the others (they die with their loops)."""
        clients, self._clients = self._clients, {}
        mine = clients.get(id(asyncio.get_running_loop()))
        if mine is not None:
            await mine.aclose()


def elapsed_timings(start: float, first: float | None) -> Timings:
    """Timings of a request that started at `start` (perf_counter) and is finishing now."""
    now = time.perf_counter()
    return Timings(queued_s=0.0, first_token_s=(first or now) - start, total_s=now - start)


def vocab_size_at(path: str | None) -> int:
    """The vocabulary size in `path`/config.json, when that directory is on this machine."""
    if not path:
        return UNKNOWN_VOCAB
    try:
        size = json.loads((Path(path) / "config.json").read_text()).get("vocab_size")
    except (OSError, json.JSONDecodeError):
        return UNKNOWN_VOCAB
    return int(size) if isinstance(size, int) and size > 0 else UNKNOWN_VOCAB


def context_length_at(path: str | None) -> int | None:
    """`max_position_embeddings` in `path`/config.json, when that directory is on this machine."""
    if not path:
        return None
    try:
        size = json.loads((Path(path) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, json.JSONDecodeError):
        return None
    return int(size) if isinstance(size, int) and size > 0 else None


def save_state_dir(weights: Mapping[str, Any]) -> str:
    """Write a state dict as model.safetensors in a new temporary directory; return its path."""
    from safetensors.torch import save_file

    folder = tempfile.mkdtemp(prefix="relayrl-weights-")
    try:
        # Cloned: tied weights share storage, which safetensors refuses to save.
        tensors = {k: v.detach().cpu().clone().contiguous() for k, v in weights.items()}
        save_file(tensors, str(Path(folder) / "model.safetensors"))
    except BaseException:
        # A full disk would otherwise keep the partial file (hundreds of MB) for good.
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder
