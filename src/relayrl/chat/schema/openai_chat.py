"""Request schema of OpenAI Chat Completions (`POST /v1/chat/completions`).

Fields follow the order of OpenAI's spec (`messages`, `model`, then alphabetical, as the OpenAPI
document and the `openai` SDK list them); fields the spec lacks are marked `# extension`. Types are
loose where agents are loose: an assistant message echoed back by an agent carries `null` for every
field it did not use (`refusal`, `audio`, `function_call`, `annotations`), and that must parse.
Whether we can honour a field is decided by `relayrl.chat.wire_openai_chat`, not here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import StrictFloat, StrictInt

from relayrl.chat.schema import WireModel


class ContentPart(WireModel):
    """One part of a list-valued `content`; only the text-bearing types are served.

    One class for every part type (the payload of `image_url`, `input_audio`, `file` stays in
    `model_extra`), so an unsupported part is refused by name instead of failing validation.
    """

    type: str
    text: str | None = None
    refusal: str | None = None


class FunctionCallSpec(WireModel):
    """The `function` of a tool call in an assistant message."""

    name: str
    arguments: str | dict[str, Any] = ""
    """JSON text per the spec; some clients send an object (accepted, re-serialized)."""


class ToolCallSpec(WireModel):
    """A tool call in an assistant message (as the server returned it, echoed back)."""

    id: str
    type: str | None = "function"
    function: FunctionCallSpec | None = None
    custom: Any = None


class ChatMessage(WireModel):
    """One message; a single class for every role (role-specific checks are the converter's)."""

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    # assistant
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    tool_calls: list[ToolCallSpec] | None = None
    annotations: Any = None
    reasoning_content: str | None = None  # extension: DeepSeek / SGLang / vLLM reasoning output
    reasoning: str | None = None  # extension: vLLM >= 0.10 / OpenRouter name for the same
    # tool
    tool_call_id: str | None = None


class FunctionDefinition(WireModel):
    """The `function` of a tool definition."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolSpec(WireModel):
    """A tool the model may call; only `type: "function"` is served."""

    type: str = "function"
    function: FunctionDefinition | None = None


class NamedFunction(WireModel):
    """`{"name": ...}` inside a named tool choice."""

    name: str


class NamedToolChoice(WireModel):
    """`{"type": "function", "function": {"name": ...}}`, or `allowed_tools` / `custom` forms."""

    type: str
    function: NamedFunction | None = None
    allowed_tools: dict[str, Any] | None = None
    custom: Any = None


class StreamOptions(WireModel):
    """`stream_options`."""

    include_obfuscation: bool | None = None
    include_usage: bool | None = None


class ResponseFormat(WireModel):
    """`response_format`: `text`, `json_object` or `json_schema`."""

    type: str
    json_schema: Any = None


class ChatCompletionRequest(WireModel):
    """Body of `POST /v1/chat/completions`."""

    messages: list[ChatMessage]
    model: str = "default"
    audio: Any = None
    frequency_penalty: float | None = None
    function_call: Any = None
    functions: list[Any] | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | None = None
    max_completion_tokens: StrictInt | None = None
    max_tokens: StrictInt | None = None
    metadata: dict[str, Any] | None = None
    modalities: list[str] | None = None
    moderation: Any = None
    n: StrictInt | None = None
    parallel_tool_calls: bool | None = None
    prediction: Any = None
    presence_penalty: float | None = None
    prompt_cache_key: str | None = None
    prompt_cache_options: Any = None
    prompt_cache_retention: str | None = None
    reasoning_effort: str | None = None
    response_format: ResponseFormat | None = None
    safety_identifier: str | None = None
    seed: StrictInt | None = None
    service_tier: str | None = None
    stop: str | list[str] | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: StrictFloat | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    tools: list[ToolSpec] | None = None
    top_logprobs: StrictInt | None = None
    top_p: StrictFloat | None = None
    user: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    top_k: StrictInt | None = None  # extension (vLLM, SGLang): -1 or 0 turns top-k off
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM, SGLang)
    return_token_ids: bool | None = None  # extension (vLLM): answer with token_ids
    rollout_id: str | None = None  # extension (remote rollout protocol)
    response_mask: list[int] | None = None  # extension (remote rollout protocol): checked


__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "ContentPart",
    "FunctionCallSpec",
    "FunctionDefinition",
    "NamedFunction",
    "NamedToolChoice",
    "ResponseFormat",
    "StreamOptions",
    "ToolCallSpec",
    "ToolSpec",
]
