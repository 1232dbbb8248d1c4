"""The Responses API's tool kinds, mapped onto the function tools a chat template renders.

Coding agents such as Codex CLI send more than `type: "function"` tools, and no provider setting
stops them. A chat template only knows functions, so each kind becomes one (or several), and the
model's call is turned back into the item the client expects:

| tool in the request | rendered as | a call comes back as |
| --- | --- | --- |
| `function` | itself | `function_call` |
| `namespace` (nested function tools) | one function per nested tool, named `NAMESPACE.NAME` | `function_call` with `name` and `namespace` |
| `custom` (freeform input, optional grammar) | a function with one string parameter `input`; the grammar goes into the description (not enforced: we do not constrain decoding) | `custom_tool_call` with `input` |
| `local_shell` | a function `local_shell` taking `command` (argv), `working_directory`, `timeout_ms` | `local_shell_call` with an `exec` action |
| hosted tools (`web_search`, `image_generation`, `file_search`, ...) | left out of the prompt: the policy cannot run them | never; their types are recorded in the call's metadata |

The mapping is reversible: the items a client echoes back (`function_call` with a `namespace`,
`custom_tool_call`, `local_shell_call`) become the same tool calls the model wrote, so a later
turn extends the recorded tokens instead of starting a new segment. Dots never occur in OpenAI
function names, so `NAMESPACE.NAME` cannot collide with a plain function.

May import: `relayrl.chat.conversation`, `.schema`, `.wire_common`. Pure functions, no I/O.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from relayrl.chat.conversation import Tool, ToolCall
from relayrl.chat.schema.openai_responses import FunctionTool
from relayrl.chat.wire_common import check_tools, invalid

LOCAL_SHELL = "local_shell"
HOSTED_TOOL_TYPES = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "file_search",
    "image_generation", "code_interpreter", "computer_use_preview", "computer_use", "mcp",
    "tool_search",
})
_LOCAL_SHELL_PARAMETERS: dict[str, Any] = {
    "type": "object",
    "properties": {
        "command": {"type": "array", "items": {"type": "string"},
                    "description": "The command and its arguments (argv)."},
        "working_directory": {"type": "string"},
        "timeout_ms": {"type": "integer"},
    },
    "required": ["command"],
}
_LOCAL_SHELL_DESCRIPTION = "Runs a shell command on the user's machine and returns its output."


@dataclass(frozen=True)
class ToolKinds:
    """Which rendered tool names stand for which Responses tool kinds (JSON-able via `as_dict`)."""

    namespaced: dict[str, tuple[str, str]] = field(default_factory=dict)
    """Rendered name -> (namespace, name inside it)."""
    custom: frozenset[str] = frozenset()
    local_shell: bool = False
    hosted: tuple[str, ...] = ()
    """Types of the hosted tools left out of the prompt."""

    def as_dict(self) -> dict[str, Any]:
        """Plain values for the request's metadata (recorded with the call)."""
        return {"namespaced": {k: list(v) for k, v in self.namespaced.items()},
                "custom": sorted(self.custom), "local_shell": self.local_shell,
                "hosted": list(self.hosted)}

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> ToolKinds:
        """The inverse of `as_dict` (an empty mapping when `d` is None)."""
        if not d:
            return cls()
        return cls(namespaced={k: (v[0], v[1]) for k, v in d.get("namespaced", {}).items()},
                   custom=frozenset(d.get("custom", ())), local_shell=bool(d.get("local_shell")),
                   hosted=tuple(d.get("hosted", ())))

    def plain(self) -> bool:
        """True when every rendered tool is a plain function tool."""
        return not (self.namespaced or self.custom or self.local_shell)


def qualified(namespace: str, name: str) -> str:
    """The rendered name of function `name` inside `namespace`."""
    return f"{namespace}.{name}"


def render_tools(specs: list[FunctionTool] | None) -> tuple[tuple[Tool, ...], ToolKinds]:
    """The function tools to render for a request's `tools`, and how to map calls back."""
    tools: list[Tool] = []
    namespaced: dict[str, tuple[str, str]] = {}
    custom: set[str] = set()
    hosted: list[str] = []
    local_shell = False
    for i, s in enumerate(specs or ()):
        where = f"tools[{i}]"
        if s.type == "function":
            tools.append(_function(s.name, s.description, s.parameters, where))
        elif s.type == "namespace":
            for j, inner in enumerate(s.tools or ()):
                inner_where = f"{where}.tools[{j}]"
                if inner.get("type", "function") != "function":
                    raise invalid(f"namespace tools must be function tools, got "
                                  f"{inner.get('type')!r}", inner_where)
                name = qualified(_name(s.name, where), _name(inner.get("name"), inner_where))
                namespaced[name] = (str(s.name), str(inner["name"]))
                tools.append(_function(name, inner.get("description"), inner.get("parameters"),
                                       inner_where))
        elif s.type == "custom":
            name = _name(s.name, where)
            custom.add(name)
            tools.append(Tool(name=name, description=_custom_description(s),
                              parameters={"type": "object",
                                          "properties": {"input": {"type": "string"}},
                                          "required": ["input"]}))
        elif s.type == LOCAL_SHELL:
            local_shell = True
            tools.append(Tool(name=LOCAL_SHELL, description=_LOCAL_SHELL_DESCRIPTION,
                              parameters=_LOCAL_SHELL_PARAMETERS))
        elif s.type in HOSTED_TOOL_TYPES:
            hosted.append(s.type)
        else:
            raise invalid(f"tool type {s.type!r} is not supported (function, namespace, custom, "
                          f"local_shell, or a hosted tool, which is left out)", where)
    check_tools(tools)
    return tuple(tools), ToolKinds(namespaced, frozenset(custom), local_shell, tuple(hosted))


def _name(name: Any, where: str) -> str:
    if not isinstance(name, str) or not name:
        raise invalid("a tool needs a name", where)
    return name


def _function(name: Any, description: Any, parameters: Any, where: str) -> Tool:
    if parameters is not None and not isinstance(parameters, dict):
        raise invalid("tool parameters must be a JSON schema object", where)
    return Tool(name=_name(name, where), description=str(description or ""),
                parameters=parameters or {})


def _custom_description(s: FunctionTool) -> str:
    fmt = s.format or {}
    text = s.description or ""
    if fmt.get("type") == "grammar" and fmt.get("definition"):
        text += (f"\n\nPass the whole input as the string `input`; it must follow this "
                 f"{fmt.get('syntax', '')} grammar:\n{fmt['definition']}")
    else:
        text += "\n\nPass the whole input as the string `input`."
    return text.strip()


# ------------------------------------------------------------ calls: model -> client


def call_item(kinds: ToolKinds, id_: str, call_id: str, name: str, arguments: str,
              status: str) -> dict[str, Any]:
    """The output item for a call the model wrote to rendered tool `name`."""
    if name in kinds.custom:
        return {"id": id_, "type": "custom_tool_call", "call_id": call_id, "name": name,
                "input": _custom_input(arguments), "status": status}
    if name == LOCAL_SHELL and kinds.local_shell:
        return {"id": id_, "type": "local_shell_call", "call_id": call_id, "status": status,
                "action": {"type": "exec", **_shell_args(arguments)}}
    item = {"id": id_, "type": "function_call", "call_id": call_id, "name": name,
            "arguments": arguments, "status": status}
    if name in kinds.namespaced:
        item["namespace"], item["name"] = kinds.namespaced[name]
    return item


def streams_as_function(kinds: ToolKinds, name: str) -> bool:
    """Whether a call to `name` streams as `function_call` argument deltas.

    Custom and shell calls are sent whole when the call ends: their fields (`input`, `action`)
    are decoded from the arguments' JSON, which is only valid once it is complete.
    """
    return name not in kinds.custom and not (name == LOCAL_SHELL and kinds.local_shell)


def _custom_input(arguments: str) -> str:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        return arguments  # what the model wrote is still what the client should see
    if isinstance(parsed, dict) and isinstance(parsed.get("input"), str):
        return parsed["input"]
    return arguments


def _shell_args(arguments: str) -> dict[str, Any]:
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    if not isinstance(parsed, dict):
        return {"command": [arguments]}
    return parsed


# ------------------------------------------------------------ items: client -> conversation


def namespaced_call(call_id: str, namespace: str, name: str, arguments: str) -> ToolCall:
    """An echoed `function_call` item that names its namespace, as the model wrote it."""
    return ToolCall(id=call_id, name=qualified(namespace, name), arguments=arguments)


def custom_call(call_id: str, name: str, input_: str) -> ToolCall:
    """An echoed `custom_tool_call` item, as the model wrote it (its `input` in JSON)."""
    return ToolCall(id=call_id, name=name, arguments=json.dumps({"input": input_},
                                                                ensure_ascii=False))


def shell_call(call_id: str, action: dict[str, Any]) -> ToolCall:
    """An echoed `local_shell_call` item, as the model wrote it (unset fields dropped)."""
    args = {k: v for k, v in action.items() if k != "type" and v is not None}
    return ToolCall(id=call_id, name=LOCAL_SHELL, arguments=json.dumps(args, ensure_ascii=False))


__all__ = [
    "HOSTED_TOOL_TYPES",
    "LOCAL_SHELL",
    "ToolKinds",
    "call_item",
    "custom_call",
    "namespaced_call",
    "qualified",
    "render_tools",
    "shell_call",
    "streams_as_function",
]
