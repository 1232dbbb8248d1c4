"""`VLLMEngine`: the `InferenceEngine` protocol over HTTP to a running vLLM server (0.32).

Imports httpx and relayrl's lower layers only: no torch, no vllm (vLLM runs in its own venv, see
scripts/install_vllm.sh and `relayrl.engine.vllm_server`). Which vLLM route does which job, as read
in vLLM 0.32's own source:

- Generation: `POST /v1/completions` with the prompt as a list of token ids, `stream: true`,
  `return_token_ids: true` (each chunk carries its delta `token_ids`), `logprobs: k` with
  `return_tokens_as_token_ids: true` (tokens come back as "token_id:N", so top logprobs are ids),
  `ignore_eos: true` (relayrl engines add no end-of-sequence stop of their own: the renderer
  passes the end-of-turn ids as `stop_token_ids`), `skip_special_tokens: false`.
- Logprobs: vLLM's `ModelConfig.logprobs_mode` docstring says "Raw means the values before
  applying any logit processors ... Processed means the values after applying all processors,
  including temperature and top_k/top_p". relayrl's behaviour logprob is `log_softmax(logits/T)`
  before top-p/top-k (`relayrl.engine.sampling`). So the server runs with
  `--logprobs-mode processed_logprobs`: then vLLM's logprob is exactly relayrl's whenever a request
  truncates nothing (top_p = 1, top_k = 0), at any temperature; greedy requests get T = 1 as in
  relayrl. With truncation, vLLM's processed logprob is renormalised over the kept tokens and
  differs from relayrl's by that set's log-mass; no vLLM mode returns the untruncated scaled one,
  so `VLLMEngine` reports it as given and says so here (`truncation_warning`).
- Abort: closing the stream disconnects, and vLLM aborts a request whose client went away;
  `abort(request_id)` also calls `POST /abort_requests` (vLLM's docstring: "Abort in-flight
  requests without pausing the scheduler"), whose ids are vLLM's external ids, which for a
  completion are `cmpl-<request_id>-0`.
- Weight update from a checkpoint directory: `POST /pause?mode=keep` ("Freeze requests in
  queue; they resume on /resume"), `POST /collective_rpc` with method `relayrl_reload_weights`
  and `weights_path` (relayrl's worker extension: the worker's `reload_weights` "Reload a model's
  weights in place from a weights iterator or from disk", then the CPU kernels packed from tied
  weights rebuilt, see `vllm_ext/relayrl_vllm_worker.py`; plain `reload_weights` on a server
  started without the extension), `POST /reset_prefix_cache?reset_running_requests=true` (the scheduler's
  docstring: running requests are preempted and recomputed, so the frozen requests' KV is rebuilt
  with the new weights and no cached prefix from the old ones is reused), `/update_weight_version`,
  then `POST /resume`. `/update_weights`, `/start_weight_update` and `/finish_weight_update` belong
  to vLLM's weight-transfer engines (NCCL, CUDA IPC, ...), which move tensors between GPUs; they are
  not the path for a checkpoint on disk. These routes exist only when the server runs with
  `VLLM_SERVER_DEV_MODE=1` (vLLM registers its RL and dev routers only then).

Versions are kept here, on the client: every token is stamped with the version current when its
chunk arrived. An update pauses the server first (tokens that arrive while it is paused were
sampled before the pause: they keep the old version) and bumps the version just before resuming,
so every token sampled after the resume carries the new one.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx

from relayrl.engine.remote import RemoteEngine, elapsed_timings
from relayrl.errors import ContextLengthExceeded, EngineError, InvalidRequest
from relayrl.types import FinishReason, GenerateRequest, TokenChunk, TopLogprob

log = logging.getLogger(__name__)
RELOAD_WITH_REPACK = "relayrl_reload_weights"
"""The worker method of relayrl's vLLM extension (`relayrl.engine.vllm_server.WORKER_EXTENSION`)."""

_TOKEN_PREFIX = "token_id:"


class VLLMEngine(RemoteEngine):
    """An `InferenceEngine` backed by a vLLM server at `url` (see the module docstring).

    Args:
        url: the server's root, e.g. "http://127.0.0.1:8100".
        model: the served model name (default: the first one /v1/models lists).
        model_path: a local HF directory whose config.json gives the vocabulary size for
            validation (default: the served model's path, when it exists on this machine).
        context_length: cap on prompt + output (default: the server's `max_model_len`).
        api_key: sent as a bearer token when the server was started with one.
        timeout_s: bound on connecting and on each read from the server.
        update_timeout_s: bound on one weight update (pause, reload, resume).

    Requests in flight during a weight update are frozen, not dropped: they continue with the
    new weights.
    """

    server = "vLLM"

    def __init__(
        self,
        url: str,
        *,
        model: str | None = None,
        model_path: str | None = None,
        context_length: int | None = None,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        update_timeout_s: float = 900.0,
    ) -> None:
        super().__init__(url, api_key=api_key, timeout_s=timeout_s,
                         update_timeout_s=update_timeout_s)
        card = self._served_card(model)
        self.model: str = card["id"]
        # max_model_len: what the server was started with
        self._set_limits([context_length, card.get("max_model_len")],
                         model_path or card.get("root"))
        self._reload_method = RELOAD_WITH_REPACK
        self._warned_truncation = False

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Sample a completion, yielding tokens as they arrive; bad requests raise here."""
        chunks = super().stream(request)
        p = request.params
        if (p.top_p < 1.0 or p.top_k > 0) and not self._warned_truncation:
            self._warned_truncation = True
            log.warning(truncation_warning())
        return chunks

    async def abort(self, request_id: str) -> int:
        """Ask the server to abort the request `request_id`; returns how many it aborted."""
        data = await self._post("/abort_requests", {"request_ids": [_vllm_id(request_id)]})
        return int(data.get("aborted", 0)) if isinstance(data, dict) else 0

    async def pause(self, mode: str = "keep") -> None:
        """Stop scheduling: "keep" freezes requests in flight, "wait" drains, "abort" drops them."""
        await self._post("/pause", None, params={"mode": mode})

    async def resume(self) -> None:
        """Resume scheduling after `pause`."""
        await self._post("/resume", None)

    async def is_paused(self) -> bool:
        """Whether the server is paused."""
        data = await self._get("/is_paused")
        return bool(data.get("is_paused"))

    # -- internals ---------------------------------------------------------------------------

    def _served_card(self, model: str | None) -> dict[str, Any]:
        """The /v1/models card of `model` (default: the first one served)."""
        cards = self._model_card("/v1/models").get("data") or []
        if not cards:
            raise EngineError(f"vLLM at {self.url} serves no model")
        if model is None:
            return cards[0]
        for card in cards:
            if card.get("id") == model:
                return card
        raise EngineError(f"vLLM at {self.url} does not serve {model!r}")

    def _client(self) -> httpx.AsyncClient:
        return self._clients.get()

    def _body(self, request: GenerateRequest) -> dict[str, Any]:
        p = request.params
        body: dict[str, Any] = {
            "model": self.model,
            "prompt": list(request.prompt_ids),
            "max_tokens": min(p.max_new_tokens, self._context_length - len(request.prompt_ids)),
            "temperature": p.temperature,
            "top_p": p.top_p,
            "top_k": p.top_k,  # vLLM: 0 (or -1) considers all tokens, as in relayrl
            "stop_token_ids": list(p.stop_token_ids),
            "ignore_eos": True,
            "skip_special_tokens": False,
            "logprobs": p.top_logprobs,
            "return_tokens_as_token_ids": True,
            "return_token_ids": True,
            "stream": True,
            "request_id": request.request_id,
        }
        if p.stop:
            body["stop"] = list(p.stop)
        if p.seed is not None:
            body["seed"] = p.seed
        return body

    async def _stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        start = time.perf_counter()
        first: float | None = None
        want_tops = request.params.top_logprobs
        client = self._client()
        try:
            async with client.stream(
                "POST", f"{self.url}/v1/completions", json=self._body(request)
            ) as resp:
                if resp.status_code != 200:
                    await resp.aread()
                    raise _http_error(resp)
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    chunk = _parse_chunk(json.loads(payload), want_tops)
                    if chunk is None:
                        continue
                    ids, logprobs, tops, finish, stop_string = chunk
                    if ids and first is None:
                        first = time.perf_counter()
                    if not ids and finish is None:
                        continue
                    version = self._version
                    yield TokenChunk(
                        ids=ids,
                        logprobs=logprobs,
                        versions=[version] * len(ids),
                        top_logprobs=tops,
                        finish_reason=finish,
                        stop_string=stop_string,
                        timings=elapsed_timings(start, first) if finish is not None else None,
                    )
                    if finish is not None:
                        return
        except httpx.HTTPError as e:
            raise EngineError(f"vLLM at {self.url} failed mid-request: {e!r}") from e
        # The stream ended with no finish reason: the server aborted it (or went away).
        yield TokenChunk(
            [], [], [], finish_reason=FinishReason.ABORT, timings=elapsed_timings(start, first)
        )

    async def _reload(self, folder: str, version: int | None) -> int:
        async with self._update_lock:
            t = self.update_timeout_s
            await self._post("/pause", None, params={"mode": "keep"}, timeout=t)
            try:
                await self._reload_in_place(folder, t)
                reset = await self._post(
                    "/reset_prefix_cache",
                    None,
                    params={"reset_running_requests": "true"},
                    timeout=t,
                )
                if isinstance(reset, dict) and reset.get("success") is False:
                    raise EngineError("vLLM could not reset its prefix cache after the update")
                new = version if version is not None else self._version + 1
                await self._post("/update_weight_version", {"new_version": str(new)}, timeout=t)
                # Bumped before resuming: nothing is sampled while paused (see module docstring).
                self._version = new
            finally:
                await self._post("/resume", None, timeout=t)
            return self._version

    async def _reload_in_place(self, folder: str, timeout: float) -> None:
        """The worker's reload: relayrl's extension when the server has it, else vLLM's own."""
        body = {"method": self._reload_method, "kwargs": {"weights_path": folder}}
        try:
            await self._post("/collective_rpc", body, timeout=timeout)
            return
        except EngineError as e:
            if self._reload_method != RELOAD_WITH_REPACK or RELOAD_WITH_REPACK not in str(e):
                raise
        log.warning(
            "vLLM at %s was started without relayrl's worker extension (--worker-extension-cls "
            "%s, see docs/scale-out.md): weights are reloaded with vLLM's reload_weights, which "
            "on a CPU server leaves a tied output head on its old weights", self.url,
            "relayrl_vllm_worker.RelayrlWorkerExtension")
        self._reload_method = "reload_weights"
        body["method"] = self._reload_method
        await self._post("/collective_rpc", body, timeout=timeout)

    async def _post(
        self,
        path: str,
        body: dict[str, Any] | None,
        params: dict[str, str] | None = None,
        timeout: float | None = None,
    ) -> Any:
        kw: dict[str, Any] = {"params": params}
        if body is not None:
            kw["json"] = body
        if timeout is not None:
            kw["timeout"] = httpx.Timeout(timeout, connect=30.0)
        try:
            resp = await self._client().post(f"{self.url}{path}", **kw)
        except httpx.HTTPError as e:
            raise EngineError(f"vLLM at {self.url}{path} failed: {e!r}") from e
        return _json_or_raise(resp, path)

    async def _get(self, path: str) -> Any:
        try:
            resp = await self._client().get(f"{self.url}{path}")
        except httpx.HTTPError as e:
            raise EngineError(f"vLLM at {self.url}{path} failed: {e!r}") from e
        return _json_or_raise(resp, path)


def truncation_warning() -> str:
    """What the engine says the first time a request truncates (top-p < 1 or top-k > 0)."""
    return (
        "vLLM's processed logprobs of a top-p/top-k request are renormalised over the kept "
        "tokens; relayrl's convention is the untruncated temperature-scaled distribution, so "
        "these behaviour logprobs are higher by the kept set's log-mass"
    )


def _vllm_id(request_id: str) -> str:
    # vLLM's completion handler names the engine request "cmpl-<request_id>-<prompt index>".
    return f"cmpl-{request_id}-0"


def _parse_chunk(
    data: dict[str, Any], want_tops: int
) -> (
    tuple[list[int], list[float], list[list[TopLogprob]] | None, FinishReason | None, str | None]
    | None
):
    if "error" in data and not data.get("choices"):
        err = data["error"]
        message = err.get("message") if isinstance(err, dict) else str(err)
        raise EngineError(f"vLLM failed mid-stream: {message}")
    choices = data.get("choices") or []
    if not choices:
        return None  # e.g. a usage-only chunk
    choice = choices[0]
    ids = [int(t) for t in choice.get("token_ids") or []]
    lp = choice.get("logprobs") or {}
    logprobs = [float(x) for x in lp.get("token_logprobs") or []]
    if len(logprobs) != len(ids):
        raise EngineError(
            f"vLLM sent {len(ids)} token ids but {len(logprobs)} logprobs; "
            "is it an older version without return_token_ids?"
        )
    tops = None
    if want_tops > 0:
        tops = []
        for entry in (lp.get("top_logprobs") or [])[: len(ids)]:
            pairs = sorted(
                ((_token_id(k), float(v)) for k, v in (entry or {}).items()), key=lambda x: -x[1]
            )
            tops.append([TopLogprob(t, v) for t, v in pairs[:want_tops]])
    finish_raw = choice.get("finish_reason")
    finish = None
    stop_string = None
    if finish_raw is not None:
        finish = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}.get(
            finish_raw, FinishReason.ABORT
        )
        reason = choice.get("stop_reason")
        if isinstance(reason, str):
            stop_string = reason
    return ids, logprobs, tops, finish, stop_string


def _token_id(key: str) -> int:
    if not key.startswith(_TOKEN_PREFIX):
        raise EngineError(f"vLLM returned token {key!r}, not 'token_id:N'")
    return int(key[len(_TOKEN_PREFIX) :])


def _json_or_raise(resp: httpx.Response, path: str) -> Any:
    if resp.status_code != 200:
        raise _http_error(resp, path)
    if not resp.content:
        return {}
    try:
        return resp.json()
    except json.JSONDecodeError:
        return {}


def _http_error(resp: httpx.Response, path: str = "/v1/completions") -> Exception:
    try:
        data = resp.json()
        err = data.get("error", data)
        message = err.get("message") or err.get("detail") if isinstance(err, dict) else str(err)
    except (json.JSONDecodeError, AttributeError):
        message = resp.text[:500]
    if resp.status_code == 400:
        if "context length" in str(message).lower() or "maximum" in str(message).lower():
            return ContextLengthExceeded(f"vLLM: {message}")
        return InvalidRequest(f"vLLM: {message}")
    if resp.status_code == 404:
        return EngineError(
            f"vLLM has no route {path} ({message}); weight updates, pause and abort need a server "
            "started with VLLM_SERVER_DEV_MODE=1"
        )
    return EngineError(f"vLLM answered {resp.status_code} on {path}: {message}")
