"""`SGLangEngine`: the `InferenceEngine` protocol over HTTP to a running SGLang server.

Imports httpx and relayrl's lower layers only. SGLang publishes no CPU wheel that runs here, so
this client is tested against a loopback stub that speaks SGLang's documented native API
(tests/engine/test_sglang_engine.py); the contract tests against a real server need a GPU
(docs/scale-out.md). Routes and fields, as read in SGLang's http_server.py and io_struct.py:

- Generation: `POST /generate` with `input_ids`, `sampling_params` (`max_new_tokens`,
  `temperature`, `top_p`, `top_k` (-1 = off), `stop`, `stop_token_ids`, `ignore_eos`,
  `skip_special_tokens`, `no_stop_trim`, `sampling_seed`), `return_logprob: true`,
  `top_logprobs_num`, `stream: true` and `rid` (the request id). Each SSE chunk holds
  `output_ids` and `meta_info` (`completion_tokens`, `output_token_logprobs` as
  [logprob, token id, text] triples, `output_top_logprobs`, `finish_reason` as
  {"type": "stop"|"length"|"abort", "matched": id or string}). By default the chunks are
  cumulative (the whole output so far); with `--incremental-streaming-output` they are deltas;
  `_new_tokens` accepts either, telling them apart by `completion_tokens`.
- Logprobs: SGLang's sampler takes `log(softmax(logits / T))` before top-k/top-p sampling, which
  is relayrl's convention, unless the server runs with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (then
  they are before temperature); do not set it.
- Abort: `POST /abort_request` with `rid`; closing the stream also aborts the request.
- Weight update: `POST /pause_generation` with `mode: "retract"` (running requests go back to the
  queue and their KV cache is recomputed after `continue_generation`, so no stale KV from the old
  weights survives), `POST /update_weights_from_disk` with `model_path`, `weight_version` and
  `flush_cache`, then `POST /continue_generation`. Versions are stamped on arrival, as in
  `relayrl.engine.vllm`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from relayrl.engine.remote import RemoteEngine, context_length_at, elapsed_timings
from relayrl.errors import ContextLengthExceeded, EngineError, InvalidRequest
from relayrl.types import FinishReason, GenerateRequest, TokenChunk, TopLogprob

_FINISH = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}


class SGLangEngine(RemoteEngine):
    """An `InferenceEngine` backed by an SGLang server at `url` (see the module docstring).

    Args:
        url: the server's root, e.g. "http://127.0.0.1:30000".
        model_path: a local HF directory for the vocabulary size and context length (default:
            the server's `model_path` from /get_model_info, when it exists on this machine).
        context_length: cap on prompt + output (default: the model config's
            max_position_embeddings).
        api_key: sent as a bearer token when the server was started with one.
        timeout_s: bound on connecting and on each read from the server.
        update_timeout_s: bound on one weight update (pause, load, continue).
    """

    server = "SGLang"

    def __init__(
        self,
        url: str,
        *,
        model_path: str | None = None,
        context_length: int | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        update_timeout_s: float = 900.0,
    ) -> None:
        super().__init__(url, api_key=api_key, timeout_s=timeout_s,
                         update_timeout_s=update_timeout_s)
        info = self._model_info()
        path = model_path or info.get("model_path")
        # a context_length given wins; else the model config's
        self._set_limits([context_length or context_length_at(path)], path)

    async def abort(self, request_id: str) -> None:
        """Ask the server to abort the request `request_id`."""
        await self._post("/abort_request", {"rid": request_id})

    async def pause(self, mode: str = "retract") -> None:
        """Pause generation ("abort", "retract" or "in_place", as SGLang defines them)."""
        await self._post("/pause_generation", {"mode": mode})

    async def resume(self) -> None:
        """Continue generation after `pause`."""
        await self._post("/continue_generation", {})

    # -- internals ---------------------------------------------------------------------------

    def _model_info(self) -> dict[str, Any]:
        """/get_model_info: the served model's path, and whether it generates."""
        info = self._model_card("/get_model_info")
        if info.get("is_generation") is False:
            raise EngineError(f"SGLang at {self.url} serves a model that does not generate")
        return info

    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        p = request.params
        sampling: dict[str, Any] = {
            "max_new_tokens": min(p.max_new_tokens, self._context_length - len(request.prompt_ids)),
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k if p.top_k > 0 else -1,
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True,  # the renderer passes the end-of-turn ids as stop_token_ids
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
        if p.stop:
            sampling["stop"] = list(p.stop)
        if p.seed is not None:
            sampling["sampling_seed"] = p.seed
        return {
            "input_ids": list(request.prompt_ids),
            "sampling_params": sampling,
            "return_logprob": True,
            "top_logprobs_num": p.top_logprobs,
            "logprob_start_len": -1,
            "stream": True,
            "rid": request.request_id,
        }

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        start = time.perf_counter()
        first: float | None = None
        received = 0
        want_tops = request.params.top_logprobs
        try:
            async with self._clients.get().stream(
                "POST", f"{self.url}/generate", json=self._body(request)
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _http_error(resp, "/generate")
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    data = json.loads(payload)
                    if "error" in data:
                        raise EngineError(f"SGLang failed mid-stream: {data['error']}")
                    ids, logprobs, tops = _new_tokens(data, received, want_tops)
                    received += len(ids)
                    finish, stop_string = _finish(data.get("meta_info") or {})
                    if ids and first is None:
                        first = time.perf_counter()
                    if not ids and finish is None:
                        continue
                    yield TokenChunk(
                        ids=ids,
                        logprobs=logprobs,
                        versions=[self._version] * len(ids),
                        top_logprobs=tops,
                        finish_reason=finish,
                        stop_string=stop_string,
                        timings=elapsed_timings(start, first) if finish is not None else None,
                    )
                    if finish is not None:
                        return
        except httpx.HTTPError as e:
            raise EngineError(f"SGLang at {self.url} failed mid-request: {e!r}") from e
        yield TokenChunk(
            [], [], [], finish_reason=FinishReason.ABORT, timings=elapsed_timings(start, first)
        )

    async def _reload(self, folder: str, version: int | None) -> int:
        async with self._update_lock:
            t = self.update_timeout_s
            new = version if version is not None else self._version + 1
            await self._post("/pause_generation", {"mode": "retract"}, timeout=t)
            try:
                result = await self._post(
                    "/update_weights_from_disk",
                    {"model_path": folder, "weight_version": str(new), "flush_cache": True},
                    timeout=t,
                )
                if isinstance(result, dict) and result.get("success") is False:
                    raise EngineError(f"SGLang could not load {folder}: {result.get('message')}")
                self._version = new  # before continuing: nothing is sampled while paused
            finally:
                await self._post("/continue_generation", {}, timeout=t)
            return self._version

    async def _post(self, path: str, body: dict[str, Any], timeout: float | None = None) -> Any:
        kw: dict[str, Any] = {"json": body}
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=30.0)
        try:
            resp = await self._clients.get().post(f"{self.url}{path}", **kw)
        except httpx.HTTPError as e:
            raise EngineError(f"SGLang at {self.url}{path} failed: {e!r}") from e
        if resp.status_code != 200:
            raise _http_error(resp, path)
        try:
            return resp.json() if resp.content else {}
        except json.JSONDecodeError:
            return {}


def _new_tokens(
    data: dict[str, Any], received: int, want_tops: int
) -> tuple[list[int], list[float], list[list[TopLogprob]] | None]:
    """The tokens of one chunk that were not yet received, cumulative or incremental."""
    meta = data.get("meta_info") or {}
    ids = [int(t) for t in data.get("output_ids") or []]
    lps = meta.get("output_token_logprobs") or []
    top = meta.get("output_top_logprobs") or []
    total = int(meta.get("completion_tokens", received + len(ids)))
    if len(ids) == total and received:
        # Cumulative chunk (SGLang's default): everything so far; keep the new tail.
        ids, lps, top = ids[received:], lps[received:], top[received:]
    elif len(ids) != total - received:
        raise EngineError(
            f"SGLang sent {len(ids)} ids with completion_tokens={total} after {received} received"
        )
    if len(lps) != len(ids):
        raise EngineError(f"SGLang sent {len(ids)} token ids but {len(lps)} logprobs")
    logprobs = []
    for (lp, token, *_), t in zip(lps, ids, strict=True):
        if int(token) != t:
            raise EngineError(f"SGLang's logprob is for token {token}, its output id is {t}")
        logprobs.append(float(lp))
    tops = None
    if want_tops > 0:
        tops = [
            [TopLogprob(int(e[1]), float(e[0])) for e in (entry or [])[:want_tops]]
            for entry in top[: len(ids)]
        ]
    return ids, logprobs, tops


def _finish(meta: dict[str, Any]) -> tuple[FinishReason | None, str | None]:
    reason = meta.get("finish_reason")
    if not reason:
        return None, None
    kind = reason.get("type") if isinstance(reason, dict) else str(reason)
    matched = reason.get("matched") if isinstance(reason, dict) else None
    finish = _FINISH.get(str(kind), FinishReason.ABORT)
    return finish, matched if finish == FinishReason.STOP and isinstance(matched, str) else None


def _http_error(resp: httpx.Response, path: str) -> Exception:
    try:
        data = resp.json()
        err = data.get("error", data) if isinstance(data, dict) else data
        message = err.get("message") if isinstance(err, dict) else str(err)
    except json.JSONDecodeError:
        message = resp.text[:500]
    if resp.status_code == 400:
        if "context length" in str(message).lower():
            return ContextLengthExceeded(f"SGLang: {message}")
        return InvalidRequest(f"SGLang: {message}")
    return EngineError(f"SGLang answered {resp.status_code} on {path}: {message}")
