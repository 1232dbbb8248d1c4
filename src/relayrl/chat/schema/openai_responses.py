"""Request schema of OpenAI Responses (`POST /v1/responses`).

Fields follow the spec's order (`input`, `model`, then alphabetical, as the `openai` SDK lists
them); fields the spec lacks are marked `# extension`. Input items are a union picked by `type`
(a message may omit it); any item type we do not serve parses as `OtherItem`, so the converter can
refuse it by name rather than with a validation error.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, StrictFloat, StrictInt, Tag

from relayrl.chat.schema import WireModel


class InputContentPart(WireModel):
    """A content part of an input or output message (`input_text`, `output_text`, `input_image`...)."""

    type: str
    text: str | None = None
    refusal: str | None = None


class MessageItem(WireModel):
    """A message item; `EasyInputMessage` has no `type`, the full form has `type: "message"`."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputContentPart]
    id: str | None = None
    status: str | None = None
    phase: str | None = None


class FunctionCallItem(WireModel):
    """A function call the model made earlier (echoed back by the client)."""

    type: Literal["function_call"]
    arguments: str
    call_id: str
    name: str
    id: str | None = None
    status: str | None = None
    namespace: str | None = None


class FunctionCallOutputItem(WireModel):
    """The result of a function call, sent by the client."""

    type: Literal["function_call_output"]
    output: str | list[InputContentPart]
    call_id: str
    id: str | None = None
    status: str | None = None
    name: str | None = None


class ReasoningPart(WireModel):
    """A `summary_text` or `reasoning_text` part of a reasoning item."""

    type: str
    text: str = ""


class ReasoningItem(WireModel):
    """Reasoning the model did before its next assistant output."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[ReasoningPart] = Field(default_factory=list)
    content: list[ReasoningPart] | None = None
    encrypted_content: str | None = None
    status: str | None = None


class CustomToolCallItem(WireModel):
    """A call the model made earlier to a `custom` (freeform) tool, echoed back."""

    type: Literal["custom_tool_call"]
    call_id: str
    name: str
    input: str
    id: str | None = None
    status: str | None = None


class CustomToolCallOutputItem(WireModel):
    """The result of a `custom` tool call (also `local_shell_call_output`), sent by the client."""

    type: Literal["custom_tool_call_output", "local_shell_call_output"]
    call_id: str
    output: str | list[InputContentPart]
    id: str | None = None
    name: str | None = None


class LocalShellCallItem(WireModel):
    """A `local_shell` call the model made earlier, echoed back with its `exec` action."""

    type: Literal["local_shell_call"]
    call_id: str
    action: dict[str, Any]
    id: str | None = None
    status: str | None = None


class OtherItem(WireModel):
    """Any other item type (`item_reference`, `web_search_call`, ...): the converter decides."""

    type: str


_ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning",
               "custom_tool_call", "custom_tool_call_output", "local_shell_call_output",
               "local_shell_call")


def _item_tag(v: Any) -> str:
    t = v.get("type", "message") if isinstance(v, dict) else getattr(v, "type", "message")
    return t if t in _ITEM_TYPES else "other"


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")]
    | Annotated[CustomToolCallItem, Tag("custom_tool_call")]
    | Annotated[CustomToolCallOutputItem, Tag("custom_tool_call_output")]
    | Annotated[CustomToolCallOutputItem, Tag("local_shell_call_output")]
    | Annotated[LocalShellCallItem, Tag("local_shell_call")]
    | Annotated[OtherItem, Tag("other")],
    Discriminator(_item_tag),
]


class FunctionTool(WireModel):
    """A tool of any type: `function`, `namespace` (with `tools`), `custom` (with `format`),
    `local_shell` or a hosted tool; `relayrl.chat.responses_tools` says how each is served."""

    type: str
    name: str | None = None
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None
    tools: list[dict[str, Any]] | None = None
    format: dict[str, Any] | None = None


class ToolChoiceObject(WireModel):
    """`{"type": "function", "name": ...}`, `{"type": "allowed_tools", ...}` or a hosted tool."""

    type: str
    name: str | None = None
    mode: str | None = None
    tools: list[dict[str, Any]] | None = None


class TextFormat(WireModel):
    """`text.format`: `text`, `json_object` or `json_schema`."""

    type: str


class TextConfig(WireModel):
    """`text`: output format and verbosity."""

    format: TextFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(WireModel):
    """`reasoning`: effort and summary settings."""

    effort: str | None = None
    summary: str | None = None
    generate_summary: str | None = None


class ResponsesRequest(WireModel):
    """Body of `POST /v1/responses`."""

    input: str | list[InputItem]
    model: str = "default"
    background: bool | None = None
    conversation: Any = None
    include: list[str] | None = None
    instructions: str | None = None
    max_output_tokens: StrictInt | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    prompt: Any = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    reasoning: ReasoningConfig | None = None
    safety_identifier: str | None = None
    service_tier: str | None = None
    store: bool | None = None
    stream: bool | None = None
    stream_options: dict[str, Any] | None = None
    temperature: StrictFloat | None = None
    text: TextConfig | None = None
    tool_choice: Literal["none", "auto", "required"] | ToolChoiceObject | None = None
    tools: list[FunctionTool] | None = None
    top_logprobs: StrictInt | None = None
    top_p: StrictFloat | None = None
    truncation: str | None = None
    user: str | None = None
    top_k: StrictInt | None = None  # extension (vLLM)
    chat_template_kwargs: dict[str, Any] | None = None  # extension (vLLM, SGLang)


__all__ = [
    "CustomToolCallItem",
    "CustomToolCallOutputItem",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "InputContentPart",
    "InputItem",
    "LocalShellCallItem",
    "MessageItem",
    "OtherItem",
    "ReasoningConfig",
    "ReasoningItem",
    "ReasoningPart",
    "ResponsesRequest",
    "TextConfig",
    "TextFormat",
    "ToolChoiceObject",
]
