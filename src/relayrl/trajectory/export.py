"""Export: a session's calls and credited rewards as training rows, and rows as padded tensors.

Two styles. `individual`: one row per call (prompt + output; shared prefixes are repeated, so
it costs tokens but needs no assumption about how calls relate). `concat`: one row per
root-to-leaf path of each segment, one contiguous token sequence in which only the model's own
samples carry loss; prompt, tool results and template glue are context. Concat trains the same
tokens with far less recomputation, and is exact because a segment's calls extend each other's
tokens by construction (checked when they are recorded).

`concat` is the default everywhere (`DEFAULT_EXPORT_STYLE`; see docs/design-decisions.md).

Rows are plain Python lists so they can cross processes and files; `to_tensor_dict` (torch,
imported lazily) makes the trainer's padded batch.

May import: `relayrl.errors`, `relayrl.types`, `relayrl.chat.parsers` (the tool-call tag) and the
other `relayrl.trajectory` modules; torch only inside `to_tensor_dict`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from relayrl.chat.parsers import CALL_OPEN
from relayrl.errors import InvalidRequest, SessionClosed
from relayrl.trajectory.credit import DEFAULT_CREDIT_RULE, CreditFn, credit_rule, per_role
from relayrl.trajectory.records import Interaction, Segment
from relayrl.trajectory.session import Session, SessionState
from relayrl.types import PROMPT_VERSION

if TYPE_CHECKING:
    import torch



class ExportStyle(StrEnum):
    """How a session's calls become rows."""

    INDIVIDUAL = "individual"
    """One row per call (shared prefixes repeated)."""
    CONCAT = "concat"
    """One row per root-to-leaf path of each segment (each token once per path)."""


DEFAULT_EXPORT_STYLE = ExportStyle.CONCAT
"""The style used when none is named: what training consumes (docs/design-decisions.md)."""

_STYLES = frozenset(ExportStyle)


@dataclass(frozen=True)
class TrajectoryRow:
    """One training sequence: tokens, what to train on, and the credited rewards."""

    session_id: str
    task_id: str | None
    """The task (prompt) the episode came from; advantages are normalized per task group."""
    segment_id: str
    style: str
    """`individual` or `concat`."""
    interaction_ids: list[str]
    """Calls whose outputs this row trains on, in token order."""
    input_ids: list[int]
    loss_mask: list[int]
    """1 on tokens the policy sampled (trained on), 0 on prompt and glue tokens."""
    logprobs: list[float]
    """Behaviour logprob per token (0.0 where loss_mask is 0)."""
    versions: list[int]
    """Weight version that sampled each token (PROMPT_VERSION = -1 where loss_mask is 0)."""
    reward: float
    """The credited reward of the row's last call."""
    turn_spans: list[tuple[int, int]]
    """Per call in `interaction_ids`: [start, end) of its sampled tokens in `input_ids`."""
    turn_rewards: list[float]
    """Per call in `interaction_ids`: its credited reward."""
    metadata: dict[str, Any] = field(default_factory=dict)
    """JSON values: finish reasons, branch reason, credit rule, session metadata."""

    def __post_init__(self) -> None:
        n = len(self.input_ids)
        lengths = (len(self.loss_mask), len(self.logprobs), len(self.versions))
        if any(x != n for x in lengths):
            raise ValueError(f"row of {n} tokens has mask/logprobs/versions of {lengths}")
        k = len(self.interaction_ids)
        if len(self.turn_spans) != k or len(self.turn_rewards) != k:
            raise ValueError(f"row of {k} calls has {len(self.turn_spans)} spans, "
                             f"{len(self.turn_rewards)} turn rewards")
        prev_end = 0
        for start, end in self.turn_spans:
            if not prev_end <= start <= end <= n:
                raise ValueError(f"turn span [{start}, {end}) is out of order or out of range")
            prev_end = end
        if self.style not in _STYLES:
            raise ValueError(f"unknown style {self.style!r}")
        if not math.isfinite(self.reward):
            raise ValueError(f"reward {self.reward} is not finite")

    @property
    def role(self) -> str | None:
        """The role whose samples the row trains (`metadata["role"]`); None: no role."""
        role = self.metadata.get("role")
        return None if role is None else str(role)

    @property
    def num_tokens(self) -> int:
        """Sequence length."""
        return len(self.input_ids)


def export_session(
    session: Session,
    style: str = DEFAULT_EXPORT_STYLE,
    credit: str | CreditFn = DEFAULT_CREDIT_RULE,
    discount: float = 1.0,
    *,
    allow_aborted: bool = False,
) -> list[TrajectoryRow]:
    """Credit a session's calls and turn them into rows; pure (the session is not changed)."""
    if style not in _STYLES:
        raise InvalidRequest(f"unknown export style {style!r}; "
                             f"known: {[str(s) for s in ExportStyle]}")
    if session.state == SessionState.ABORTED and not allow_aborted:
        raise SessionClosed(f"session {session.id} was aborted: its calls are not for training")
    rule = credit_rule(credit) if isinstance(credit, str) else credit
    credited = per_role(rule, session.tree(), discount)
    base_meta = {
        "credit": str(credit) if isinstance(credit, str) else getattr(credit, "__name__", "custom"),
        "discount": discount,
        "final_reward": session.final_reward,
        "session": dict(session.metadata),
        # calls cut off before they finished make no row (their client never saw them)
        "aborted_calls": len(session.aborted_calls),
    }
    if session.role_rewards:
        base_meta["role_rewards"] = dict(session.role_rewards)
    if style == ExportStyle.INDIVIDUAL:
        return [_individual_row(session, c, credited[c.id], _with_role(base_meta, c))
                for c in session.interactions]
    rows: list[TrajectoryRow] = []
    for seg in session.segments():
        made: set[tuple[str, ...]] = set()
        for path in session.segment_paths(seg.id):
            meta = {**base_meta, "branch_reason": str(seg.reason)}
            meta.update(segment_link_meta(seg))
            # a path whose calls change role makes one row per run of one role: each row trains
            # one role's samples, the other role's tokens before it are context
            for run in role_runs(path):
                key = tuple(c.id for c in run)
                if key not in made:  # paths of a branched segment share their first runs
                    made.add(key)
                    rows.append(_concat_row(session, run, credited, _with_role(meta, run[0])))
    return rows


def role_runs(path: Sequence[Interaction]) -> list[Sequence[Interaction]]:
    """`path` cut into maximal runs of calls with one role (the whole path when it has one)."""
    runs: list[Sequence[Interaction]] = []
    start = 0
    for i in range(1, len(path) + 1):
        if i == len(path) or path[i].role != path[start].role:
            runs.append(path[start:i])
            start = i
    return runs


def _with_role(meta: dict[str, Any], call: Interaction) -> dict[str, Any]:
    """`meta` with the row's role (`relayrl.trajectory.roles.ROLE_META`) when its calls have one."""
    return meta if call.role is None else {**meta, "role": call.role}


def segment_link_meta(seg: Segment) -> dict[str, Any]:
    """Row metadata of a linked segment: the segment it continues and the rule that linked it."""
    if seg.parent_segment_id is None:
        return {}
    return {"parent_segment_id": seg.parent_segment_id, "link_rule": seg.link_rule}


def _individual_row(
    session: Session, c: Interaction, reward: float, meta: dict[str, Any]
) -> TrajectoryRow:
    p, o = len(c.prompt_ids), len(c.output_ids)
    return TrajectoryRow(
        session_id=session.id,
        task_id=session.task_id,
        segment_id=c.segment_id,
        style=ExportStyle.INDIVIDUAL.value,
        interaction_ids=[c.id],
        input_ids=list(c.token_ids),
        loss_mask=[0] * p + [1] * o,
        logprobs=[0.0] * p + list(c.logprobs),
        versions=[PROMPT_VERSION] * p + list(c.versions),
        reward=reward,
        turn_spans=[(p, p + o)],
        turn_rewards=[reward],
        metadata={**meta, **_call_meta([c]),
                  "branch_reason": None if c.branch_reason is None else str(c.branch_reason)},
    )


def _concat_row(
    session: Session,
    path: Sequence[Interaction],
    credited: dict[str, float],
    meta: dict[str, Any],
) -> TrajectoryRow:
    leaf = path[-1]
    tokens = list(leaf.token_ids)
    n = len(tokens)
    mask, logprobs, versions = [0] * n, [0.0] * n, [PROMPT_VERSION] * n
    spans: list[tuple[int, int]] = []
    for c in path:
        # every call on the path is a token prefix of the leaf (checked when recorded), so its
        # output sits at [len(prompt), len(prompt) + len(output)) of the leaf's sequence
        start = len(c.prompt_ids)
        end = start + len(c.output_ids)
        mask[start:end] = [1] * (end - start)
        logprobs[start:end] = c.logprobs
        versions[start:end] = c.versions
        spans.append((start, end))
    return TrajectoryRow(
        session_id=session.id,
        task_id=session.task_id,
        segment_id=leaf.segment_id,
        style=ExportStyle.CONCAT.value,
        interaction_ids=[c.id for c in path],
        input_ids=tokens,
        loss_mask=mask,
        logprobs=logprobs,
        versions=versions,
        reward=credited[leaf.id],
        turn_spans=spans,
        turn_rewards=[credited[c.id] for c in path],
        metadata={**meta, **_call_meta(path)},
    )


def _call_meta(calls: Sequence[Interaction]) -> dict[str, list[Any]]:
    """Per call, in row order: finish reason, tool calls parsed, and whether a call failed to parse.

    A parse failure is a reply whose text still holds a tool-call opening tag: the model tried to
    call a tool, but the call was malformed and stayed as plain content (so no tool ran).
    """
    return {
        "finish_reasons": [c.finish_reason for c in calls],
        "tool_calls": [len(c.reply.tool_calls) for c in calls],
        "tool_parse_failures": [int(CALL_OPEN in c.reply.content) for c in calls],
    }


def to_tensor_dict(rows: Sequence[TrajectoryRow]) -> dict[str, torch.Tensor]:
    """Right-padded B x T tensors in the tensor-dict format's dtypes (input_ids int32, masks, rewards [B])."""
    import torch  # lazy: the gateway imports this package without torch

    if not rows:
        raise InvalidRequest("no rows to batch")
    b, t = len(rows), max(r.num_tokens for r in rows)
    input_ids_B_T = torch.zeros(b, t, dtype=torch.int32)
    attention_mask_B_T = torch.zeros(b, t, dtype=torch.bool)
    loss_mask_B_T = torch.zeros(b, t, dtype=torch.int32)
    logprobs_B_T = torch.zeros(b, t, dtype=torch.float32)
    versions_B_T = torch.full((b, t), PROMPT_VERSION, dtype=torch.int32)
    for i, r in enumerate(rows):
        n = r.num_tokens
        input_ids_B_T[i, :n] = torch.tensor(r.input_ids, dtype=torch.int32)
        attention_mask_B_T[i, :n] = True
        loss_mask_B_T[i, :n] = torch.tensor(r.loss_mask, dtype=torch.int32)
        logprobs_B_T[i, :n] = torch.tensor(r.logprobs, dtype=torch.float32)
        versions_B_T[i, :n] = torch.tensor(r.versions, dtype=torch.int32)
    return {
        "input_ids": input_ids_B_T,
        "attention_mask": attention_mask_B_T,
        "loss_mask": loss_mask_B_T,
        "logprobs": logprobs_B_T,
        "versions": versions_B_T,
        "rewards": torch.tensor([r.reward for r in rows], dtype=torch.float32),
    }
