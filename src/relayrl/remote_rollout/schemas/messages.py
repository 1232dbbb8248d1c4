"""Protocol messages: chat messages with tool calls, tool definitions, and `GET /tools`'s answer.

Pydantic only. Messages follow OpenAI's Chat Completions shape, since the server sends them to the
trainer's `/v1/chat/completions` as they are; unknown keys are kept (a trainer may add some).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class FunctionCall(BaseModel):
    """The `function` of a tool call: a name and JSON-encoded arguments."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class ToolCall(BaseModel):
    """One tool call an assistant message makes."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(min_length=1)
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(BaseModel):
    """One conversation message (OpenAI Chat Completions shape)."""

    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def to_wire(self) -> dict[str, Any]:
        """The message as JSON for the trainer (None-valued keys left out)."""
        return self.model_dump(exclude_none=True)


class FunctionDefinition(BaseModel):
    """A tool's name, description and JSON-schema parameters."""

    name: str = Field(min_length=1)
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=dict)


class ToolDefinition(BaseModel):
    """A tool the agent may call, as chat templates and OpenAI's `tools` list take it."""

    type: Literal["function"] = "function"
    function: FunctionDefinition


class ToolsResponse(BaseModel):
    """Body of `GET /tools`."""

    tools: list[ToolDefinition]


__all__ = ["FunctionCall", "FunctionDefinition", "Message", "ToolCall", "ToolDefinition",
           "ToolsResponse"]
