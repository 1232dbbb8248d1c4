"""Roles: which agent of a multi-agent episode made a call (planner, solver, a game's seat).

A role is a short name recorded on every call (`Interaction.role`) and on every row
(`row.metadata["role"]`). With roles switched on (`gateway.roles: true`) the gateway resolves
each call's role from, in order (the first that names one wins):

1. the `x-relayrl-role` request header;
2. a role-scoped base URL of the session (`/s/{key}/role/{role}/v1`, what `child_session`
   hands a sub-agent);
3. the `model` the agent sends: a name in `gateway.role_models`, else the part after `@`
   (`default@solver` -> `solver`);
4. the session's metadata `role` (set when the session is started);
5. none (the call has no role).

Groups and advantages are per (task, role): rows of different roles are never normalised against
each other (`check_group_roles` refuses a group that would mix them). Credit is per role too: each
role's calls form their own tree (a call's parent of another role is not its parent for credit),
and the reward credited at that tree's leaves is the role's own final reward when the agent set
one (`finalize` with `role_rewards`), else the episode's final reward.

May import: `relayrl.errors` only (pure Python).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from relayrl.errors import InvalidRequest

ROLE_HEADER = "x-relayrl-role"
"""The request header that names a call's role (it wins over every other source)."""

ROLE_META = "role"
"""The key of a session's metadata, and of a row's metadata, that holds the role."""

ROLE_SEPARATOR = "@"
"""`model` = `policy@role` names the role in the model name."""

_ROLE_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:-]{0,63}")


def check_role(role: str, source: str = "role") -> str:
    """`role` if it is a valid role name (1-64 of A-Z a-z 0-9 _ . : -); InvalidRequest otherwise."""
    if not isinstance(role, str) or not _ROLE_NAME.fullmatch(role):
        shown = role if isinstance(role, str) and len(role) <= 80 else f"{str(role)[:80]}..."
        raise InvalidRequest(f"{source} {shown!r} is not a role name: 1-64 characters of "
                             "A-Z a-z 0-9 _ . : - (not starting with . : -)")
    return role


def role_from_model(model: str | None, role_models: Mapping[str, str] | None = None) -> str | None:
    """The role a `model` name names: its entry in `role_models`, else the part after `@`."""
    if not model:
        return None
    if role_models and model in role_models:
        return check_role(role_models[model], f"gateway.role_models[{model!r}]")
    if ROLE_SEPARATOR in model:
        suffix = model.rsplit(ROLE_SEPARATOR, 1)[1]
        return check_role(suffix, f"the role in model {model!r}") if suffix else None
    return None


def resolve_role(*, header: str | None = None, path: str | None = None, model: str | None = None,
                 session_metadata: Mapping[str, object] | None = None,
                 role_models: Mapping[str, str] | None = None) -> str | None:
    """A call's role by the documented precedence: header, scoped URL, model, session metadata."""
    if header:
        return check_role(header.strip(), f"the {ROLE_HEADER} header")
    if path:
        return check_role(path, "the role in the URL")
    from_model = role_from_model(model, role_models)
    if from_model is not None:
        return from_model
    meta = (session_metadata or {}).get(ROLE_META)
    if meta is None or meta == "":
        return None
    return check_role(str(meta), "the session's metadata role")


def role_group_id(group_id: str, role: str | None) -> str:
    """The group of a (task, role): `group_id` for no role, else `group_id/role`."""
    return group_id if role is None else f"{group_id}/{role}"


def check_group_roles(group_ids: Sequence[str], roles: Sequence[str | None]) -> None:
    """Refuse (InvalidRequest) a batch in which one group holds rows of more than one role."""
    if len(group_ids) != len(roles):
        raise InvalidRequest(f"{len(group_ids)} group ids but {len(roles)} roles")
    seen: dict[str, str | None] = {}
    for group, role in zip(group_ids, roles, strict=True):
        first = seen.setdefault(group, role)
        if first != role:
            raise InvalidRequest(
                f"group {group!r} holds rows of roles {first!r} and {role!r}: advantages are "
                "normalised per (task, role), and a group that mixes roles would compare one "
                "agent's episodes with another's. Give each role its own group (leave the "
                "session's group_id unset so relayrl groups per role, or end it in the role)")
