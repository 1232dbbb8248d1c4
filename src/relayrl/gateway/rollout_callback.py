"""The trainer side of the remote rollout protocol on the chat route: token ids out, masks checked.

A rollout server (docs/remote-rollout.md) calls `/v1/chat/completions` with two extra fields: `rollout_id` and
`response_mask`, one 0 per token it added since its previous call (tool outputs, template glue),
None on the first call. relayrl does not need the mask to build rows, since it builds every
prompt itself, so it *checks* it: the mask must equal the non-model tokens of relayrl's own
record of the call (the tokens its prompt adds to the parent's prompt + output), and a call that
opened a new segment must come with no mask. Each check and each disagreement is counted in the
session's metadata under `remote_rollout` (exported with every row), so a trainer can drop or keep
such rollouts, never train on them unawares. Asked for (`return_token_ids`, or any protocol
field), the answer carries `token_ids` (sampled, end-of-turn included) and `prompt_token_ids`.

May import the gateway's auth/core, trajectory and errors; nothing above the gateway.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from relayrl.chat.completion import Completion
from relayrl.errors import InvalidRequest
from relayrl.trajectory import Interaction, Session

log = logging.getLogger("relayrl.gateway")

METADATA_KEY = "remote_rollout"
"""Where the counters live in the session's metadata (and so in every exported row's)."""
MAX_EXAMPLES = 8
"""Disagreements kept verbatim per session (the counts are exact, the examples a sample)."""
MAX_MASK = 1 << 20


class _Fields(BaseModel):
    model_config = ConfigDict(extra="ignore")

    rollout_id: str | None = Field(default=None, max_length=256)
    response_mask: list[int] | None = Field(default=None, max_length=MAX_MASK)
    return_token_ids: bool | None = None


@dataclass(frozen=True)
class CallbackFields:
    """The protocol's fields of one chat call."""

    rollout_id: str | None
    response_mask: list[int] | None
    mask_sent: bool
    """Whether the body named `response_mask` at all (a protocol call), even as null."""


def from_body(body: Any) -> CallbackFields | None:
    """The protocol fields of a chat body, or None when it carries none of them (a 400 if bad)."""
    if not isinstance(body, Mapping) or not any(
            k in body for k in ("rollout_id", "response_mask", "return_token_ids")):
        return None
    try:
        f = _Fields.model_validate(body)
    except ValidationError as e:
        err = e.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "body"
        exc = InvalidRequest(f"{where}: {err['msg']}")
        exc.param = where
        raise exc from None
    if f.response_mask is not None and any(v not in (0, 1) for v in f.response_mask):
        exc = InvalidRequest("response_mask holds only 0 (token not sampled) and 1")
        exc.param = "response_mask"
        raise exc
    if f.rollout_id is None and "response_mask" not in body and not f.return_token_ids:
        return None
    return CallbackFields(f.rollout_id, f.response_mask, "response_mask" in body)


def check_request(fields: CallbackFields, session: Session | None, stream: bool) -> None:
    """Refuse protocol calls relayrl cannot check: outside a session, or streamed."""
    if session is None:
        raise InvalidRequest("rollout_id/response_mask/return_token_ids need a session: call "
                             "with the callback_api_key (a session key) or a session's base URL")
    if stream and (fields.mask_sent or fields.rollout_id is not None):
        exc = InvalidRequest("remote rollout callbacks are not streamed: send stream=false")
        exc.param = "stream"
        raise exc


def apply(session: Session, completion: Completion, fields: CallbackFields,
          payload: dict[str, Any]) -> None:
    """Check the mask against the recorded call and add the token ids to the answer."""
    records = [session.get(c.interaction_id) for c in completion.choices]
    first = records[0]
    payload["token_ids"] = list(first.output_ids)
    payload["prompt_token_ids"] = list(first.prompt_ids)
    for choice, rec in zip(payload.get("choices", ()), records, strict=False):
        choice["token_ids"] = list(rec.output_ids)  # extension: each choice's own samples
    if fields.mask_sent or fields.rollout_id is not None:
        _count(session, first, fields)


def expected_mask(session: Session, rec: Interaction) -> list[int] | None:
    """The mask relayrl's record implies: None for a segment's first call, else one 0 per
    token the prompt adds after the parent's prompt + output."""
    if rec.prompt_source != "extend" or rec.parent_id is None:
        return None
    parent = session.get(rec.parent_id)
    added = len(rec.prompt_ids) - len(parent.prompt_ids) - len(parent.output_ids)
    return [0] * added


def masks_agree(expected: list[int] | None, got: list[int] | None) -> bool:
    """Whether the server's mask says what relayrl's record says (None and [] mean the same)."""
    return (expected or []) == (got or [])


def _count(session: Session, rec: Interaction, fields: CallbackFields) -> None:
    expected = expected_mask(session, rec)
    ok = masks_agree(expected, fields.response_mask)
    stats = session.metadata.setdefault(METADATA_KEY, {
        "mask_checks": 0, "mask_mismatches": 0, "rollouts": {}, "mismatch_examples": []})
    stats["mask_checks"] += 1
    per = stats["rollouts"].setdefault(fields.rollout_id or "", {"checks": 0, "mismatches": 0})
    per["checks"] += 1
    if ok:
        return
    stats["mask_mismatches"] += 1
    per["mismatches"] += 1
    got = fields.response_mask
    example = {
        "interaction_id": rec.id, "rollout_id": fields.rollout_id,
        "expected_len": None if expected is None else len(expected),
        "got_len": None if got is None else len(got),
        "got_ones": sum(got or ()), "prompt_source": rec.prompt_source,
        "branch_reason": None if rec.branch_reason is None else str(rec.branch_reason),
    }
    if len(stats["mismatch_examples"]) < MAX_EXAMPLES:
        stats["mismatch_examples"].append(example)
    if stats["mask_mismatches"] == 1:  # once per session: the counts carry the rest
        log.warning("session %s (rollout %s): response_mask disagrees with the recorded call "
                    "%s (expected %s non-model tokens, got %s); the rollout server's tokenizer or "
                    "chat template differs from the policy's", session.id, fields.rollout_id,
                    rec.id, example["expected_len"], example["got_len"])


__all__ = ["METADATA_KEY", "CallbackFields", "apply", "check_request", "expected_mask",
           "from_body", "masks_agree"]
