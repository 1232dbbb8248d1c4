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
- A compaction segment's trajectory (`extra.branch_reason: compaction`) marks the steps of its
  first prompt that were copied from the trajectory it continues (the summary message, the kept
  messages) `is_copied_context`; the summary itself is an agent step of the continued trajectory
  with its tokens. A sub-agent's trajectory is referenced from the step that spawned it.
- The trajectory reward (`final_reward`) is in `final_metrics.extra.reward`; session metadata
  and task id in the root's `extra.relayrl`.
- Roles (docs/multi-agent.md): a (sub-)trajectory whose calls were made under a role names that
  role as its `agent.name` (a sub-trajectory also in `extra.role`), and every sampled step carries
  its call's role in `extra.role`; so a planner's segment and a solver's are different agents.
  Rewards given to single roles are in `final_metrics.extra.role_rewards`.

Import (`atif_rows`) goes the other way, for supervised warm-starts from trajectories any tool
wrote: one `individual` row per agent step (embedded sub-trajectories included, copied-context
steps skipped), trained on the step's completion. A step whose `metrics` carry token ids is used
as it is, without re-tokenising, when the ids decode to the step's message with this model's
tokenizer; otherwise the conversation up to the step is rendered with the model's chat template
and the row's `metadata.tokens` says `"rendered"`.

May import: `relayrl.chat`, `relayrl.errors`, `relayrl.trajectory.records`, `.session`,
`.export`.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from relayrl.chat.conversation import Conversation, Message, Tool, ToolCall
from relayrl.chat.renderer import Renderer
from relayrl.errors import InvalidRequest
from relayrl.trajectory.export import TrajectoryRow
from relayrl.trajectory.links import copied_in
from relayrl.trajectory.records import BranchReason, Interaction, Segment
from relayrl.trajectory.session import Session
from relayrl.types import PROMPT_VERSION

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
    built = [_trajectory(seg, k, path, seen, agent_name, agent_version, model_name,
                         summary=_summary_call(session, seg))
             for seg, k, path in paths]
    root, subs = built[0], built[1:]
    _link_subagents(built, paths)
    root["session_id"] = session.id
    root["extra"] = {"relayrl": {"task_id": session.task_id, "state": str(session.state),
                                 "metadata": session.metadata}}
    root["final_metrics"]["extra"] = {"reward": session.final_reward}
    if session.role_rewards:
        root["final_metrics"]["extra"]["role_rewards"] = dict(session.role_rewards)
    if subs:
        root["subagent_trajectories"] = subs
    return root


def _summary_call(session: Session, seg: Segment) -> Interaction | None:
    """The call whose summary a compaction segment continues from (its parent), if any."""
    if seg.reason != BranchReason.COMPACTION or seg.parent_id is None:
        return None
    return session.get(seg.parent_id)


def _trajectory(seg: Segment, k: int, path: Sequence[Interaction],
                seen: set[bytes], agent_name: str, agent_version: str,
                model_name: str | None, *, summary: Interaction | None = None) -> dict[str, Any]:
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
        elif (summary is not None and m.role != "assistant" and i < len(path[0].conversation.messages)
              and (m.canonical_bytes in copied or copied_in(summary, m.content))):
            # after compaction, the continued history (the summary, the kept messages) was
            # copied from the trajectory it continues: context, trained where it was sampled
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
    _name_role(traj, path)
    if seg.parent_segment_id is not None:
        traj["extra"].update(parent_segment_id=seg.parent_segment_id, link_rule=seg.link_rule)
    return traj


def _name_role(traj: dict[str, Any], path: Sequence[Interaction]) -> None:
    """A trajectory of a role's calls is that role's agent: `agent.name` and `extra.role`."""
    role = next((c.role for c in path if c.role is not None), None)
    if role is not None:
        traj["agent"]["name"] = role
        traj["extra"]["role"] = role


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
    if call.role is not None:
        step["extra"]["role"] = call.role
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
                    paths: Sequence[tuple[Segment, int, Sequence[Interaction]]]) -> None:
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


# ------------------------------------------------------------------------------------- import


def read_sft_rows(path: str | Path, model_dir: str) -> list[TrajectoryRow]:
    """Rows to imitate from `path`: relayrl's JSONL rows, or ATIF (a `.json` file or a folder)."""
    from relayrl.trajectory.interchange import read_jsonl

    p = Path(path)
    if p.suffix == ".jsonl":
        return read_jsonl(p)
    return atif_rows(read_atif(p), Renderer.from_pretrained(model_dir))


def read_atif(path: str | Path) -> list[dict[str, Any]]:
    """ATIF trajectories from a `.json` file (one trajectory or a list) or a folder of them."""
    p = Path(path)
    files = sorted(p.glob("*.json")) if p.is_dir() else [p]
    out: list[dict[str, Any]] = []
    for f in files:
        data = json.loads(f.read_text())
        for t in data if isinstance(data, list) else [data]:
            if not str(t.get("schema_version", "")).startswith("ATIF-v1."):
                raise InvalidRequest(f"{f}: not an ATIF v1 trajectory "
                                     f"(schema_version {t.get('schema_version')!r})")
            out.append(t)
    return out


def atif_rows(trajectories: Sequence[dict[str, Any]], renderer: Renderer) -> list[TrajectoryRow]:
    """One SFT row per agent step of each trajectory (sub-trajectories included)."""
    rows: list[TrajectoryRow] = []
    for t in trajectories:
        rows += _rows(t, renderer)
        rows += atif_rows(t.get("subagent_trajectories") or (), renderer)
    return rows


def _rows(traj: dict[str, Any], renderer: Renderer) -> list[TrajectoryRow]:
    tools = tuple(Tool(name=d["function"]["name"], description=d["function"].get("description")
                       or "", parameters=d["function"].get("parameters") or {})
                  for d in (traj.get("agent", {}).get("tool_definitions") or ())
                  if "function" in d)
    reward = ((traj.get("final_metrics") or {}).get("extra") or {}).get("reward")
    history: list[Message] = []
    rows: list[TrajectoryRow] = []
    for step in traj["steps"]:
        m = _message(step)
        trained = (m.role == "assistant" and not step.get("is_copied_context")
                   and step.get("llm_call_count") != 0 and history)
        if trained:
            own = (step.get("extra") or {}).get("reward")
            value = own if own is not None else reward
            rows.append(_row(traj, step, history, m, tools, renderer,
                             0.0 if value is None else float(value)))
        history.append(m)
        history += _observations(step)
    return rows


def _message(step: dict[str, Any]) -> Message:
    text = step.get("message")
    content = text if isinstance(text, str) else " ".join(
        p.get("text", "") for p in text or () if p.get("type") == "text")
    if step["source"] != "agent":
        return Message(role="system" if step["source"] == "system" else "user", content=content)
    calls = tuple(ToolCall(id=c["tool_call_id"], name=c["function_name"],
                           arguments=(c.get("extra") or {}).get("raw_arguments")
                           or json.dumps(c.get("arguments") or {}))
                  for c in step.get("tool_calls") or ())
    return Message(role="assistant", content=content, reasoning=step.get("reasoning_content"),
                   tool_calls=calls)


def _observations(step: dict[str, Any]) -> list[Message]:
    out = []
    for r in (step.get("observation") or {}).get("results", ()):
        if r.get("content") is None:
            continue  # a reference to a sub-agent's trajectory, not a tool result
        text = r["content"] if isinstance(r["content"], str) else " ".join(
            p.get("text", "") for p in r["content"] if p.get("type") == "text")
        out.append(Message(role="tool", content=text, tool_call_id=r.get("source_call_id")))
    return out


def _row(traj: dict[str, Any], step: dict[str, Any], history: list[Message], m: Message,
         tools: tuple[Tool, ...], renderer: Renderer, reward: float) -> TrajectoryRow:
    metrics = step.get("metrics") or {}
    prompt, completion = metrics.get("prompt_token_ids"), metrics.get("completion_token_ids")
    source = "recorded"
    if not (prompt and completion and _matches(renderer, completion, m)):
        conv = Conversation(messages=tuple(history), tools=tools)
        prompt = renderer.render(conv)
        full = renderer.render(Conversation(messages=(*history, m), tools=tools),
                               add_generation_prompt=False)
        if full[: len(prompt)] != prompt:
            raise InvalidRequest(f"step {step['step_id']}: the chat template does not extend the "
                                 "prompt with the assistant turn; cannot tell its tokens apart")
        completion, source = full[len(prompt):], "rendered"
    logprobs = metrics.get("logprobs") if source == "recorded" else None
    if not logprobs or len(logprobs) != len(completion):
        logprobs = [0.0] * len(completion)
    n, k = len(prompt), len(completion)
    sid = str(traj.get("session_id") or traj.get("trajectory_id") or "atif")
    return TrajectoryRow(
        session_id=sid, task_id=None, segment_id=str(traj.get("trajectory_id") or sid),
        style="individual", interaction_ids=[f"{sid}/step-{step['step_id']}"],
        input_ids=[*prompt, *completion], loss_mask=[0] * n + [1] * k,
        logprobs=[0.0] * n + list(logprobs), versions=[PROMPT_VERSION] * n + [0] * k,
        reward=reward, turn_spans=[(n, n + k)], turn_rewards=[reward],
        metadata={"source": "atif", "tokens": source})


def _matches(renderer: Renderer, completion: Sequence[int], m: Message) -> bool:
    """Whether recorded completion ids are this model's tokens for the step's message."""
    if any(not 0 <= t < renderer.vocab_size for t in completion):
        return False
    text = renderer.decode(completion)
    return all(part in text for part in (m.content.strip(), *(c.name for c in m.tool_calls)))


__all__ = ["ATIF_VERSION", "atif_rows", "read_atif", "read_sft_rows", "session_to_atif"]
