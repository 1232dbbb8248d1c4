"""Recorded sessions as ATIF trajectories (Harbor's Agent Trajectory Interchange Format, v1.8).

ATIF is the field's message-level format; relayrl's own rows stay the training format. One
session becomes one ATIF trajectory, with the tokens kept:

- Steps follow the transcript of the session's first segment: system and user messages become
  `system`/`user` steps, assistant turns `agent` steps (reasoning, tool calls), and tool results
  the `observation` of the agent step whose call they answer.
- An agent step the policy sampled (a recorded call) carries `metrics` with the call's exact
  `prompt_token_ids`, `completion_token_ids` and `logprobs`, `llm_call_count: 1`, and in `extra`
  the interaction id, the weight version of every sampled token and the call's own reward.
  Assistant turns the client supplied (history it wrote itself) have no metrics.
- Every other segment (a sub-agent's calls, a continuation after compaction, a fork) becomes an
  embedded `subagent_trajectories` entry whose `extra.branch_reason` says why it was opened; the
  agent step of the call it branched from references it. In a later trajectory, an assistant
  turn that an earlier one already holds and that no call of this trajectory sampled is marked
  `is_copied_context` (it was trained where it was sampled).
- The trajectory reward (`final_reward`) is in `final_metrics.extra.reward`; session metadata
  and task id in the root's `extra.relayrl`.

May import: `relayrl.chat.conversation`, `relayrl.trajectory.records`, `.session`.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from typing import Any

from relayrl.chat.conversation import Message, ToolCall
from relayrl.trajectory.records import Interaction, Segment
from relayrl.trajectory.session import Session

ATIF_VERSION = "ATIF-v1.8"


def session_to_atif(session: Session, *, agent_name: str = "relayrl-agent",
                    agent_version: str = "unknown",
                    model_name: str | None = None) -> dict[str, Any]:
    """One session as an ATIF trajectory (a JSON-ready dict); sub-segments are embedded."""
    paths = [(seg, k, path) for seg in session.segments()
             for k, path in enumerate(session.segment_paths(seg.id)) if path]
    if not paths:
        raise ValueError(f"session {session.id} has no recorded calls to export")
    seen: set[bytes] = set()
    built = [_trajectory(seg, k, path, seen, agent_name, agent_version, model_name)
             for seg, k, path in paths]
    root, subs = built[0], built[1:]
    _link_subagents(built, paths)
    root["session_id"] = session.id
    root["extra"] = {"relayrl": {"task_id": session.task_id, "state": str(session.state),
                                 "metadata": session.metadata}}
    root["final_metrics"]["extra"] = {"reward": session.final_reward}
    if subs:
        root["subagent_trajectories"] = subs
    return root


def _trajectory(seg: Segment, k: int, path: Sequence[Interaction],
                seen: set[bytes], agent_name: str, agent_version: str,
                model_name: str | None) -> dict[str, Any]:
    last = path[-1]
    messages = (*last.conversation.messages, last.reply.to_message())
    sampled = {len(c.conversation.messages): c for c in path}
    steps: list[dict[str, Any]] = []
    copied = set(seen)
    for i, m in enumerate(messages):
        call = sampled.get(i)
        if m.role == "tool":
            _observe(steps, m)
            continue
        step = _step(len(steps) + 1, m, call, model_name)
        if m.role == "assistant" and call is None and m.canonical_bytes in copied:
            step["is_copied_context"] = True
        steps.append(step)
        seen.add(m.canonical_bytes)
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.parameters}}
             for t in last.conversation.tools]
    agent: dict[str, Any] = {"name": agent_name, "version": agent_version}
    if model_name:
        agent["model_name"] = model_name
    if tools:
        agent["tool_definitions"] = tools
    traj: dict[str, Any] = {
        "schema_version": ATIF_VERSION,
        "trajectory_id": seg.id if k == 0 else f"{seg.id}/{k}",
        "agent": agent,
        "steps": steps,
        "final_metrics": {
            "total_prompt_tokens": sum(len(c.prompt_ids) for c in path),
            "total_completion_tokens": sum(len(c.output_ids) for c in path),
            "total_steps": len(steps),
        },
        "extra": {"branch_reason": str(seg.reason), "parent_interaction_id": seg.parent_id},
    }
    return traj


def _step(step_id: int, m: Message, call: Interaction | None,
          model_name: str | None) -> dict[str, Any]:
    if m.role != "assistant":
        source = "system" if m.role == "system" else "user"
        return {"step_id": step_id, "source": source, "message": m.content}
    step: dict[str, Any] = {"step_id": step_id, "source": "agent", "message": m.content}
    if m.reasoning:
        step["reasoning_content"] = m.reasoning
    if m.tool_calls:
        step["tool_calls"] = [_tool_call(c) for c in m.tool_calls]
    if call is None:
        return step
    step["timestamp"] = dt.datetime.fromtimestamp(call.created, dt.UTC).isoformat()
    if model_name:
        step["model_name"] = model_name
    step["llm_call_count"] = 1
    step["metrics"] = {
        "prompt_tokens": len(call.prompt_ids), "completion_tokens": len(call.output_ids),
        "prompt_token_ids": list(call.prompt_ids),
        "completion_token_ids": list(call.output_ids),
        "logprobs": list(call.logprobs),
        "extra": {"versions": list(call.versions), "finish_reason": call.finish_reason},
    }
    step["extra"] = {"interaction_id": call.id, "reward": call.reward,
                     "segment_id": call.segment_id}
    return step


def _tool_call(c: ToolCall) -> dict[str, Any]:
    try:
        args = json.loads(c.arguments) if c.arguments else {}
    except ValueError:
        args = None
    out: dict[str, Any] = {"tool_call_id": c.id, "function_name": c.name,
                           "arguments": args if isinstance(args, dict) else {}}
    if not isinstance(args, dict):
        out["extra"] = {"raw_arguments": c.arguments}  # what the model wrote, not an object
    return out


def _observe(steps: list[dict[str, Any]], m: Message) -> None:
    """A tool result: the observation of the agent step that made the call, if there is one."""
    owner = next((s for s in reversed(steps) if s["source"] == "agent"), None)
    ids = {c["tool_call_id"] for c in (owner or {}).get("tool_calls", ())}
    result: dict[str, Any] = {"content": m.content}
    if m.tool_call_id in ids:
        result["source_call_id"] = m.tool_call_id
    if owner is None:  # a tool result with no agent turn before it: keep it as a system step
        owner = {"step_id": len(steps) + 1, "source": "system", "message": ""}
        steps.append(owner)
    owner.setdefault("observation", {"results": []})["results"].append(result)


def _link_subagents(built: list[dict[str, Any]],
                    paths: list[tuple[Segment, int, Sequence[Interaction]]]) -> None:
    """Reference each branched trajectory from the agent step of the call it branched from."""
    for traj, (seg, _, _) in zip(built[1:], paths[1:], strict=True):
        if seg.parent_id is None:
            continue
        for parent in built:
            step = next((s for s in parent["steps"]
                         if s.get("extra", {}).get("interaction_id") == seg.parent_id), None)
            if step is None:
                continue
            ref = {"trajectory_id": traj["trajectory_id"]}
            step.setdefault("observation", {"results": []})["results"].append(
                {"subagent_trajectory_ref": [ref], "extra": {"branch_reason": str(seg.reason)}})
            break


__all__ = ["ATIF_VERSION", "session_to_atif"]
