"""`resolve_workflow`: whatever the user passed, as one `RolloutWorkflow`.

Accepted, in this order: a `RolloutWorkflow` instance; a `RolloutWorkflow` subclass (built with
`kwargs`); a dotted path `"package.module.Name"` (or `"package.module:Name"`) naming any of
these; an agent (any object or class with `run`), wrapped in `AgentWorkflow`; a function
`run(data, *, base_url, api_key, ...)` (async, or plain in subprocess mode), used as an agent's
`run` with `kwargs` bound to every call. With
`group_size > 1` the result is wrapped in `GroupedWorkflow`. Anything else is refused with a
message that lists what would have been accepted.

A `RolloutWorkflow` subclass that opens gateway sessions itself (several per episode, e.g. one
per seat of a game) says so with a class attribute `opens_sessions = True`, and is built with
`client=` (the gateway's `SessionClient`) and `agent_config=` added to its kwargs.
"""

from __future__ import annotations

import functools
import importlib
import inspect
from typing import Any

from relayrl.client.session_client import SessionClient
from relayrl.errors import ConfigError
from relayrl.workflow.agent import AgentConfig, AgentWorkflow, FunctionAgent, has_run
from relayrl.workflow.base import RolloutWorkflow
from relayrl.workflow.grouped import GroupedWorkflow

EXPECTED = ("a RolloutWorkflow instance, a RolloutWorkflow subclass (with kwargs), a dotted "
            "path 'module.Name', an agent: an object or class with "
            "`async def run(data, **extra_kwargs)`, or such a `run` function itself")


def resolve_workflow(workflow: Any, kwargs: dict[str, Any] | None = None, group_size: int = 1,
                     *, gateway: SessionClient | None = None,
                     agent_config: AgentConfig | None = None) -> RolloutWorkflow:
    """`workflow` as a RolloutWorkflow; agents need `gateway` (a SessionClient) to run against."""
    if group_size < 1:
        raise ConfigError(f"group_size must be >= 1, got {group_size}")
    resolved = _resolve(workflow, dict(kwargs or {}), gateway, agent_config, depth=0)
    if group_size > 1 and not isinstance(resolved, GroupedWorkflow):
        resolved = GroupedWorkflow(resolved, group_size)
    elif isinstance(resolved, GroupedWorkflow) and resolved.group_size != group_size:
        raise ConfigError(f"the workflow is grouped by {resolved.group_size}, but "
                          f"group_size={group_size} was asked for")
    return resolved


def _resolve(obj: Any, kwargs: dict[str, Any], gateway: SessionClient | None,
             agent_config: AgentConfig | None, depth: int) -> RolloutWorkflow:
    if isinstance(obj, str):
        if depth > 0:
            raise ConfigError(f"{obj!r} resolves to another string; expected {EXPECTED}")
        return _resolve(import_dotted(obj), kwargs, gateway, agent_config, depth + 1)
    if isinstance(obj, type):
        if issubclass(obj, RolloutWorkflow) or has_run(obj):
            if issubclass(obj, RolloutWorkflow) and getattr(obj, "opens_sessions", False):
                if gateway is None:
                    raise ConfigError(f"{obj.__qualname__} opens gateway sessions: pass "
                                      "gateway=SessionClient(...)")
                kwargs = {**kwargs, "client": gateway,
                          "agent_config": agent_config or AgentConfig()}
            try:
                instance = obj(**kwargs)
            except TypeError as e:
                raise ConfigError(f"cannot build {obj.__qualname__} with kwargs "
                                  f"{sorted(kwargs)}: {e}") from e
            return _resolve(instance, {}, gateway, agent_config, depth + 1)
        raise ConfigError(f"class {obj.__qualname__} is neither a RolloutWorkflow nor an agent "
                          f"with run(); expected {EXPECTED}")
    if _is_function(obj):
        return _resolve(FunctionAgent(obj, kwargs), {}, gateway, agent_config, depth + 1)
    if kwargs:
        raise ConfigError(f"kwargs {sorted(kwargs)} were given with an instance of "
                          f"{type(obj).__qualname__}; pass the class to have them used")
    if isinstance(obj, RolloutWorkflow):
        return obj
    if has_run(obj):
        if gateway is None:
            raise ConfigError(f"agent {type(obj).__qualname__} needs a gateway to run against: "
                              "pass gateway=SessionClient(...)")
        return AgentWorkflow(obj, gateway, agent_config)
    raise ConfigError(f"cannot use a {type(obj).__qualname__} as a workflow; expected {EXPECTED}")


def _is_function(obj: Any) -> bool:
    """A function (or a `functools.partial` of one) that is not itself an agent or workflow."""
    target = obj.func if isinstance(obj, functools.partial) else obj
    return inspect.isfunction(target) or inspect.ismethod(target) or inspect.isbuiltin(target)


def import_dotted(path: str) -> Any:
    """The object a dotted path names (`pkg.mod.Name` or `pkg.mod:Name`); ConfigError if none."""
    module_name, sep, attr = path.partition(":") if ":" in path else path.rpartition(".")
    if not module_name or not attr or not sep:
        raise ConfigError(f"workflow path {path!r} is not of the form 'module.Name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"workflow path {path!r}: cannot import module {module_name!r} "
                          f"({e})") from e
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ConfigError(f"workflow path {path!r}: {module_name!r} has no {attr!r}")
        obj = getattr(obj, part)
    return obj
