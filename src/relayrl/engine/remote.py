"""`RemoteEngine`: what the engines that talk to an inference server over HTTP (vLLM, SGLang)
share: the per-loop clients, the server's model card, the context length and vocabulary,
versions stamped on arrival, weight updates from a checkpoint directory, closing.

A subclass names its server, reads its model card, and writes `_stream` (one request) and
`_reload` (load a checkpoint directory under `_update_lock`, set `_version`).

Imports httpx, the standard library and relayrl's engine protocol, errors and types only (torch
only inside `save_state_dir`, which is reached only by a caller that already holds tensors).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any, ClassVar

import httpx

from relayrl.engine.base import validate_request
from relayrl.errors import EngineError, InvalidRequest
from relayrl.types import GenerateOutput, GenerateRequest, Timings, TokenChunk

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


class RemoteEngine:
    """The `InferenceEngine` protocol over HTTP to a server at `url` (see the module docstring)."""

    server: ClassVar[str] = "the server"
    """The server's name in errors ("vLLM", "SGLang")."""

    def __init__(self, url: str, *, api_key: str | None, timeout_s: float,
                 update_timeout_s: float) -> None:
        self.url = url.rstrip("/")
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._timeout = httpx.Timeout(timeout_s, connect=min(timeout_s, 30.0))
        self._clients = LoopClients(self._timeout, self._headers)
        self.update_timeout_s = update_timeout_s
        self._context_length = 0
        self.vocab_size = UNKNOWN_VOCAB
        self._version = 0
        self._update_lock = asyncio.Lock()
        self._closed = False

    @property
    def version(self) -> int:
        """Weight version that samples the next token."""
        return self._version

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + output) one sequence may hold."""
        return self._context_length

    def _set_limits(self, context_lengths: list[Any], model_path: str | None) -> None:
        """The smallest positive context length given, and the vocabulary at `model_path`."""
        limits = [int(x) for x in context_lengths if isinstance(x, int) and x > 0]
        if not limits:
            raise EngineError(f"no context length known for {self.server} at {self.url}: "
                              "pass context_length")
        self._context_length = min(limits)
        self.vocab_size = vocab_size_at(model_path)

    def _model_card(self, path: str) -> Any:
        """The JSON the server answers on GET `path` (its model card), at start-up."""
        try:
            resp = httpx.get(f"{self.url}{path}", headers=self._headers, timeout=30.0)
        except httpx.HTTPError as e:
            raise EngineError(f"cannot reach {self.server} at {self.url}: {e}") from e
        if resp.status_code != 200:
            raise EngineError(f"{self.server} at {self.url} answered {resp.status_code} to {path}")
        return resp.json()

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample a whole completion (streamed underneath, so every token gets its version)."""
        return GenerateOutput.from_chunks([c async for c in self.stream(request)])

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Sample a completion, yielding tokens as they arrive; bad requests raise here."""
        validate_request(request, self._context_length, self.vocab_size)
        if self._closed:
            raise EngineError("the engine is closed")
        return self._stream(request)

    async def update_weights(
        self, weights: Mapping[str, Any] | str | os.PathLike[str], version: int | None = None
    ) -> int:
        """Load a checkpoint directory (or a state dict, saved to a temporary one) into the server.

        The directory must be readable by the server process (same machine or shared disk).
        """
        if self._closed:
            raise EngineError("the engine is closed")
        if isinstance(weights, str | os.PathLike):
            folder = str(Path(weights).resolve())
            if not Path(folder).is_dir():
                raise InvalidRequest(f"checkpoint {str(weights)!r} is not a directory")
            return await self._reload(folder, version)
        if not weights:
            raise InvalidRequest("the state dict is empty")
        tmp = await asyncio.to_thread(save_state_dir, weights)
        try:
            return await self._reload(tmp, version)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    async def aclose(self) -> None:
        """Stop using the server (it keeps running: it is not ours to stop)."""
        self._closed = True
        await self._clients.aclose()

    def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """One request's chunks, versions stamped on arrival (the subclass's protocol)."""
        raise NotImplementedError

    async def _reload(self, folder: str, version: int | None) -> int:
        """Load the checkpoint directory `folder` into the server; the version it serves now."""
        raise NotImplementedError
