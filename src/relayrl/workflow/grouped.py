"""Running episodes: one at a time with a timeout and an outcome, and N at once as a group.

`run_episode` is the single place where an episode's fate is decided: *finished* (it produced
rows), *rejected* (it returned None or nothing) or *aborted* (it raised, timed out, or returned
something malformed). Aborted episodes keep their error and are never turned into rows.

`GroupedWorkflow` runs the same data `group_size` times concurrently, each member under its own
workflow context, and merges as AReaL's grouped rollouts do: tensor dicts are concatenated with padding,
interaction dicts are merged, Nones are dropped and an all-None group is None. Every row keeps
the ids of its episode and its group (tensor labels, or row metadata).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from relayrl.client.direct import close_clients, episode_clients
from relayrl.errors import EpisodeFailed, InvalidRequest
from relayrl.trajectory import TrajectoryRow
from relayrl.trajectory.batch import RowBatch
from relayrl.workflow.base import EpisodeResult, RolloutWorkflow, is_interaction_dict, to_rows
from relayrl.workflow.context import EpisodeContext, episode_scope
from relayrl.workflow.context import get as current_context
from relayrl.workflow.sessions import episode_metadata
from relayrl.workflow.tensors import concat_padded, validate_tensor_dict, with_labels


class EpisodeStatus(StrEnum):
    """How an episode ended."""

    FINISHED = "finished"
    """It produced at least one row."""
    REJECTED = "rejected"
    """It returned None (or no rows): excluded on purpose."""
    ABORTED = "aborted"
    """It raised, timed out, or returned something malformed: counted, never trained on."""


@dataclass(frozen=True)
class EpisodeOutcome:
    """One episode's fate and, when finished, its rows."""

    ctx: EpisodeContext
    status: EpisodeStatus
    result: EpisodeResult = None
    """What the episode returned, labelled with its episode and group (None unless finished)."""
    rows: RowBatch | None = None
    """The rows, labelled with their episode and group (None unless finished)."""
    error: str | None = None
    """`Type: message` of what aborted it."""
    elapsed_s: float = 0.0
    where: str | None = None
    """`file:line in function` where the error that aborted it was raised."""


def raised_at(error: BaseException) -> str | None:
    """`file:line in function` of the innermost frame of `error`'s traceback."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames:
        return None
    last = frames[-1]
    return f"{last.filename}:{last.lineno} in {last.name}"


def new_episode_id() -> str:
    """A fresh, unique episode id."""
    return f"ep-{uuid.uuid4().hex[:16]}"


def new_group_id() -> str:
    """A fresh, unique group id."""
    return f"grp-{uuid.uuid4().hex[:16]}"


async def run_episode(workflow: RolloutWorkflow, engine: Any, data: dict[str, Any],
                      ctx: EpisodeContext, timeout_s: float | None = None) -> EpisodeOutcome:
    """Run one episode under `ctx`, bounded by `timeout_s`, and classify how it ended.

    An awaitable returned by `arun_episode` (e.g. `client.export_interactions()` not awaited)
    is awaited. `DirectClient`s made during the episode are closed when it ends: their sessions
    are acknowledged if exported, aborted otherwise."""
    start = time.monotonic()
    with episode_scope(ctx), episode_clients(episode_metadata(ctx)) as clients:
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    result = await workflow.arun_episode(engine, data)
                    if inspect.isawaitable(result):
                        result = await result
            finally:
                if clients:  # shielded: a cancelled episode still frees its sessions
                    await asyncio.shield(close_clients(list(clients)))
            result = label_result(result, ctx)
            rows = to_rows(result, ctx)
        except TimeoutError:
            return EpisodeOutcome(ctx, EpisodeStatus.ABORTED,
                                  error=f"TimeoutError: episode ran past {timeout_s} s",
                                  elapsed_s=time.monotonic() - start)
        except Exception as e:  # any failure of user code aborts the episode, with its error
            return EpisodeOutcome(ctx, EpisodeStatus.ABORTED, error=f"{type(e).__name__}: {e}",
                                  elapsed_s=time.monotonic() - start, where=raised_at(e))
    status = EpisodeStatus.REJECTED if rows is None else EpisodeStatus.FINISHED
    return EpisodeOutcome(ctx, status, result if rows is not None else None, rows,
                          elapsed_s=time.monotonic() - start)


def label_result(result: EpisodeResult, ctx: EpisodeContext) -> EpisodeResult:
    """`result` with every row labelled with the episode and group of `ctx` (kept if present)."""
    if result is None or (isinstance(result, Mapping) and not result):
        return result
    if is_interaction_dict(result):
        return {k: _label_row(row, ctx) for k, row in result.items()}
    if isinstance(result, Mapping) and "input_ids" in result:
        validate_tensor_dict(result)
        return with_labels(result, ctx.episode_id, ctx.group_id)
    return result  # to_rows names what is wrong with it


def _label_row(row: TrajectoryRow, ctx: EpisodeContext) -> TrajectoryRow:
    meta = dict(row.metadata)
    session = meta.get("session")
    session_meta: Mapping[str, Any] = session if isinstance(session, Mapping) else {}
    meta.setdefault("episode_id", session_meta.get("episode_id") or ctx.episode_id)
    meta.setdefault("group_id", session_meta.get("group_id") or ctx.group_id)
    return dataclasses.replace(row, metadata=meta)


def merge_results(results: Sequence[EpisodeResult]) -> EpisodeResult:
    """The grouped merge: drop Nones; merge interaction dicts; concatenate tensor dicts."""
    valid = [r for r in results if r is not None and not (isinstance(r, Mapping) and not r)]
    if not valid:
        return None
    if all(is_interaction_dict(r) for r in valid):
        merged: dict[str, TrajectoryRow] = {}
        for r in valid:
            for key, row in r.items():
                if key in merged:
                    raise InvalidRequest(f"interaction {key!r} appears in two episodes")
                merged[key] = row
        return merged
    if any(is_interaction_dict(r) for r in valid):
        raise InvalidRequest("cannot merge interaction dicts with tensor dicts in one group")
    for r in valid:
        validate_tensor_dict(r)
    return concat_padded(valid)


class GroupedWorkflow(RolloutWorkflow):
    """Runs a workflow `group_size` times on the same data, concurrently, and merges the results."""

    def __init__(self, workflow: RolloutWorkflow, group_size: int) -> None:
        if group_size < 1:
            raise InvalidRequest(f"group_size must be >= 1, got {group_size}")
        if isinstance(workflow, GroupedWorkflow):
            raise InvalidRequest("a GroupedWorkflow cannot wrap another GroupedWorkflow")
        self.workflow = workflow
        self.group_size = group_size

    async def run_members(self, engine: Any, data: dict[str, Any],
                          timeout_s: float | None = None,
                          on_done: Callable[[EpisodeOutcome], None] | None = None,
                          first_index: int = 0) -> list[EpisodeOutcome]:
        """Every member's outcome (`on_done` sees each as it ends), in the current task/group;
        members are numbered from `first_index` (a group that grows runs more of them)."""
        parent = current_context()
        group_id = parent.group_id or new_group_id()
        ctxs = [dataclasses.replace(parent, group_id=group_id, episode_id=new_episode_id(),
                                    sample_index=first_index + i) for i in range(self.group_size)]

        async def member(ctx: EpisodeContext) -> EpisodeOutcome:
            outcome = await run_episode(self.workflow, engine, data, ctx, timeout_s)
            if on_done is not None:
                on_done(outcome)
            return outcome

        # each member is its own task, so each sees only its own context
        tasks = [asyncio.ensure_future(member(c)) for c in ctxs]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # let cleanups finish
            raise

    def counters(self) -> dict[str, float]:
        """The wrapped workflow's counters (the members share it)."""
        return self.workflow.counters()

    async def arun_episode(self, engine: Any, data: dict[str, Any]) -> EpisodeResult:
        """The merged result of all members; raises the first member's error if one aborted."""
        outcomes = await self.run_members(engine, data)
        aborted = [o for o in outcomes if o.status == EpisodeStatus.ABORTED]
        if aborted:
            raise EpisodeFailed(f"{len(aborted)} of {len(outcomes)} episodes in the group "
                               f"aborted; first: {aborted[0].error}")
        return merge_results([o.result for o in outcomes])

    async def aclose(self) -> None:
        """Close the wrapped workflow."""
        await self.workflow.aclose()
