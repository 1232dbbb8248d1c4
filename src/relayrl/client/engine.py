"""`RunEngine`: the engine a workflow's `arun_episode(engine, data)` is handed during a run.

It is the run's policy engine (in-process, or a vLLM/SGLang server) together with the run's
gateway, so a custom workflow can do either of the two things workflows do:

* generate token ids directly: `await engine.generate(GenerateRequest(...))` (relayrl's own
  form), or `await engine.agenerate(ModelRequest(...))` (the `ModelRequest`/`ModelResponse`
  shape that AReaL-style workflows are written in), then build a tensor dict;
* make an OpenAI-compatible client bound to it: `DirectClient(engine=engine)`, whose calls are
  recorded token-exact in a session of the run's gateway, exactly like an agent's.

Names, for code written against AReaL's inference engine:

| AReaL                                  | relayrl                                               |
| -------------------------------------- | ----------------------------------------------------- |
| `engine.agenerate(ModelRequest)`       | `RunEngine.agenerate` (adapter) / `RunEngine.generate` |
| `engine.get_version()`                 | `RunEngine.get_version()` / `RunEngine.version`        |
| `ModelRequest.input_ids`               | `GenerateRequest.prompt_ids`                          |
| `ModelRequest.rid`                     | `GenerateRequest.request_id`                          |
| `GenerationHyperparameters`            | `SamplingParams` (`greedy` is `temperature=0`)        |
| `ModelResponse.output_tokens`          | `GenerateOutput.output_ids`                           |
| `ModelResponse.output_logprobs`        | `GenerateOutput.logprobs`                             |
| `ModelResponse.output_versions`        | `GenerateOutput.versions`                             |
| `ModelResponse.stop_reason`            | `GenerateOutput.finish_reason` ("interrupt": "abort") |
| `ArealOpenAI(engine=, tokenizer=)`     | `DirectClient(engine=, tokenizer=)`                   |

May import: httpx, `relayrl.types`, `relayrl.errors`, `relayrl.client.session_client`; never torch
(tokenizers are duck-typed: anything with `eos_token_id` and `decode`).
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any, Literal

from relayrl.client.session_client import SessionClient
from relayrl.errors import ConfigError, InvalidRequest
from relayrl.types import FinishReason, GenerateOutput, GenerateRequest, SamplingParams, TokenChunk

_TOP_K_OFF = 100_000_000
"""AReaL's default `top_k` (1e8) means no top-k: relayrl spells that 0."""


@dataclass
class GenerationHyperparameters:
    """Sampling settings in AReaL's names (`gconfig`); `to_sampling_params` gives relayrl's."""

    n_samples: int = 1          # completions per request; only 1 (run more with group_size)
    max_new_tokens: int = 256   # most tokens sampled per completion
    min_new_tokens: int = 0     # only 0 (relayrl's engines stop when the model ends its turn)
    greedy: bool = False        # greedy decoding (temperature 0)
    top_p: float = 1.0
    top_k: int = _TOP_K_OFF     # AReaL's 1e8 (or 0) turns top-k off
    temperature: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] | None = None

    @classmethod
    def coerce(cls, value: GenerationHyperparameters | Mapping[str, Any] | SamplingParams | None
               ) -> GenerationHyperparameters:
        """`value` as hyperparameters: a dict (e.g. from YAML workflow_kwargs) is read by name."""
        if value is None:
            return cls()
        if isinstance(value, GenerationHyperparameters):
            return value
        if isinstance(value, SamplingParams):
            return cls(max_new_tokens=value.max_new_tokens, greedy=value.temperature == 0,
                       top_p=value.top_p, top_k=value.top_k or _TOP_K_OFF,
                       temperature=value.temperature, stop_token_ids=list(value.stop_token_ids),
                       stop=list(value.stop) or None)
        if isinstance(value, Mapping):
            known = {f.name for f in fields(cls)}
            unknown = sorted(set(value) - known)
            if unknown:
                raise ConfigError(f"gconfig: unknown keys {unknown}; known: {sorted(known)}")
            return cls(**dict(value))
        raise ConfigError(f"gconfig must be GenerationHyperparameters or a dict, got "
                          f"{type(value).__name__}")

    def to_sampling_params(self, extra_stop_ids: Sequence[int] = ()) -> SamplingParams:
        """relayrl's `SamplingParams`; `extra_stop_ids` (the model's end of turn) are added."""
        if self.n_samples != 1:
            raise InvalidRequest(f"gconfig.n_samples={self.n_samples}: one completion per "
                                 "request; sample more episodes with rollout.group_size")
        if self.min_new_tokens:
            raise InvalidRequest("gconfig.min_new_tokens is not supported; leave it at 0")
        top_k = 0 if self.top_k >= _TOP_K_OFF else self.top_k
        stops = tuple(dict.fromkeys([*self.stop_token_ids, *extra_stop_ids]))
        return SamplingParams(max_new_tokens=self.max_new_tokens,
                              temperature=0.0 if self.greedy else self.temperature,
                              top_p=self.top_p, top_k=top_k, stop_token_ids=stops,
                              stop=tuple(self.stop or ()))


@dataclass
class ModelRequest:
    """A token-in request in AReaL's shape (for `RunEngine.agenerate`)."""

    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    input_ids: list[int] = field(default_factory=list)
    gconfig: GenerationHyperparameters | Mapping[str, Any] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    tokenizer: Any = None
    """Its `eos_token_id` (and `pad_token_id`) also end the completion, as on AReaL's servers."""


@dataclass
class ModelResponse:
    """What `RunEngine.agenerate` returns: the prompt and exactly what was sampled, per token."""

    input_tokens: list[int] = field(default_factory=list)
    output_tokens: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    output_versions: list[int] = field(default_factory=list)
    stop_reason: Literal["length", "stop", "interrupt"] = "stop"
    tokenizer: Any = None
    latency: float = float("inf")
    ttft: float = float("inf")
    """Seconds to the first token."""

    @property
    def input_len(self) -> int:
        """Prompt tokens."""
        return len(self.input_tokens)

    @property
    def output_len(self) -> int:
        """Sampled tokens."""
        return len(self.output_tokens)


_STOP_REASONS: dict[FinishReason, Literal["length", "stop", "interrupt"]] = {
    FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "interrupt"}


class RunEngine:
    """The run's engine as workflows see it: generation, the weight version, and its gateway.

    `engine` is any `InferenceEngine`, or anything with its `generate`, `stream`, `version` and
    `context_length` (the Ray launcher's handle on the engine in its actor); None where only the
    gateway is reachable; `sessions` drives the run's gateway (what `DirectClient` opens
    sessions on); `app`, when the gateway is an in-process ASGI app rather than a URL;
    `stop_token_ids`, the model's end-of-turn ids, added to every direct request so a
    completion ends where the model ends its turn (the gateway does the same for its calls);
    `version_fn`, where the weight version is known elsewhere than on `engine`.
    """

    def __init__(self, engine: Any = None, sessions: SessionClient | None = None, *,
                 app: Any = None, stop_token_ids: Sequence[int] = (),
                 version_fn: Callable[[], int] | None = None, model_dir: str | None = None,
                 ) -> None:
        if engine is None and sessions is None:
            raise ConfigError("RunEngine needs an engine, a gateway (sessions=), or both")
        self.engine = engine
        self.sessions = sessions
        self.app = app
        self.stop_token_ids = tuple(stop_token_ids)
        self.model_dir = model_dir
        self._version_fn = version_fn

    @property
    def version(self) -> int:
        """The weight version the engine serves now (stamped on the tokens it samples)."""
        if self._version_fn is not None:
            return int(self._version_fn())
        if self.engine is not None:
            return int(self.engine.version)
        return 0

    def get_version(self) -> int:
        """`version`, under AReaL's name."""
        return self.version

    @property
    def context_length(self) -> int:
        """Most tokens (prompt + output) one sequence may hold."""
        return int(self._require_engine("context_length").context_length)

    def _require_engine(self, what: str) -> Any:
        if self.engine is None:
            raise ConfigError(f"{what}: this run's engine is not in this process (only its "
                              "gateway is); use DirectClient(engine=engine) or an agent instead")
        return self.engine

    async def generate(self, request: GenerateRequest) -> GenerateOutput:
        """Sample a whole completion (relayrl's `InferenceEngine.generate`)."""
        return await self._require_engine("generate").generate(request)

    def stream(self, request: GenerateRequest) -> AsyncIterator[TokenChunk]:
        """Sample a completion token by token (relayrl's `InferenceEngine.stream`)."""
        stream: AsyncIterator[TokenChunk] = self._require_engine("stream").stream(request)
        return stream

    async def agenerate(self, req: ModelRequest) -> ModelResponse:
        """AReaL's `agenerate`: one completion of `req.input_ids`, as a `ModelResponse`."""
        if not isinstance(req, ModelRequest):
            raise InvalidRequest(f"agenerate takes a ModelRequest, got {type(req).__name__}; "
                                 "for relayrl's GenerateRequest call generate()")
        gconfig = GenerationHyperparameters.coerce(req.gconfig)
        ends = [*self.stop_token_ids, *_tokenizer_ends(req.tokenizer)]
        params = gconfig.to_sampling_params(ends)
        prompt = [int(t) for t in req.input_ids]
        out = await self.generate(GenerateRequest(prompt, params, request_id=str(req.rid)))
        return ModelResponse(input_tokens=prompt, output_tokens=list(out.output_ids),
                             output_logprobs=list(out.logprobs),
                             output_versions=list(out.versions),
                             stop_reason=_STOP_REASONS[out.finish_reason],
                             tokenizer=req.tokenizer, latency=out.timings.total_s,
                             ttft=out.timings.first_token_s)

    def __repr__(self) -> str:
        where = type(self.engine).__name__ if self.engine is not None else "remote"
        return f"RunEngine({where}, version={self.version})"


def _tokenizer_ends(tokenizer: Any) -> list[int]:
    """The ids a tokenizer says end a sequence (eos, pad), as AReaL's servers stop on them."""
    if tokenizer is None:
        return []
    ids = [getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)]
    return [int(i) for i in ids if isinstance(i, int)]
