"""The trainer's batch (`TrainBatch`: right-padded rows with their labels) and its split into
micro-batches that fit a token budget.

Three layouts, all exact (a test checks each against one-row-at-a-time logprobs):

- `unpad` (default): a micro-batch is one row holding its rows' tokens end to end (after their
  common prefix, with `share_prefix`), position ids restarting per row; the model's products run
  on real tokens only, and attention alone lays the pieces out as padded rows
  (`relayrl.train.attention.Unpadded`), so padding costs only attention's share of the work.
  `plan_unpadded` cuts rows in token order where prefix + tokens + a pass's overhead is least.
  Within a micro-batch, rows that share more tokens after the prefix (a GRPO group's question)
  run them once as a stem piece, and their own pieces continue it (`plan_stems`); the budget
  counts them.
- `pad`: rows of similar length, sorted longest first, stacked and right-padded.
  With right padding a causal model never lets a real token see a pad, so no attention mask is
  needed and attention runs on the fast causal kernel.
- `pack`: rows concatenated into one sequence with position ids restarting at 0 per row;
  transformers (5.x) detects the restarts and builds a block-diagonal mask, so rows do not see
  each other. On flash-attention GPUs this wastes nothing; on CPU the masked attention falls
  back to the dense kernel and is several times slower than `pad`, hence not the default.

`pad` or `unpad` with `share_prefix` (the default in `TrainConfig`): rows that start with the same tokens
(an agent's episodes: one system prompt and tool list, and in a GRPO group one question) are cut
into that common prefix and their own suffixes. The prefix runs once; its keys and values,
repeated per row, are the suffixes' past, and every row's gradient flows back through the one
prefix pass, so the result is the full rows' (fp32: logprobs within 1e-5, gradients 1e-5
relative; tested). Two plans are made, rows grouped by their tokens (long common prefixes
together) and rows in length order cut where it pads least (one long reply gets its own pass
instead of padding 15 short ones to it), and the one that forwards the fewest tokens, plain `pad`
included, is used. The prefix
stops before the token that precedes a row's first trained token (that position's output is
read), so it never holds a trained position.

Rows without a trained token are skipped (no forward at all), so dropped groups cost nothing,
and a row's tokens after its last trained one are not forwarded (nothing reads them). In `pad`,
a micro-batch's length rounds up to a multiple of `bucket` (in `unpad`, its one row's) (the padded budget counts the rounded
length): a few stable shapes instead of one per batch, so the allocator and oneDNN reuse what
they made for the last step instead of growing the heap with buffers of never-repeated sizes.
A micro-batch lists where each trained token sits (its row in the micro-batch and position)
and its flat index in the `[B, T]` batch, so any per-token tensor of the batch is gathered with
one `take`.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from relayrl.errors import InvalidRequest
from relayrl.trajectory.roles import check_group_roles, role_group_id

if TYPE_CHECKING:
    from relayrl.trajectory.batch import RowBatch
    from relayrl.trajectory.export import TrajectoryRow


@dataclass(frozen=True)
class TrainBatch:
    """Right-padded rows: tokens, what to train, behaviour logprobs, rewards and labels.

    `behav_logprobs_B_T[b, t]` is the engine's log p(token t | tokens < t) at temperature 1, on
    trained tokens (0 elsewhere), the convention of the workflows' tensor dicts.
    """

    input_ids_B_T: torch.Tensor
    attention_mask_B_T: torch.Tensor
    loss_mask_B_T: torch.Tensor
    """bool: True on tokens the policy sampled (trained on)."""
    behav_logprobs_B_T: torch.Tensor
    versions_B_T: torch.Tensor
    rewards_B: torch.Tensor
    episode_ids: tuple[str, ...]
    group_ids: tuple[str, ...]
    turn_spans: tuple[tuple[tuple[int, int], ...], ...] | None = None
    """Per row, per turn: [start, end) of the turn's sampled tokens (needed for turn credit)."""
    turn_rewards: tuple[tuple[float, ...], ...] | None = None
    """Per row, per turn: the turn's credited return."""
    roles: tuple[str | None, ...] | None = None
    """Per row: the role whose samples it trains (None: no role); a group holds one role."""

    def __post_init__(self) -> None:
        b, t = self.input_ids_B_T.shape
        for name in ("attention_mask_B_T", "loss_mask_B_T", "behav_logprobs_B_T", "versions_B_T"):
            if tuple(getattr(self, name).shape) != (b, t):
                raise InvalidRequest(f"TrainBatch.{name}: shape {list(getattr(self, name).shape)}, "
                                     f"expected [{b}, {t}] like input_ids")
        if tuple(self.rewards_B.shape) != (b,):
            raise InvalidRequest(f"TrainBatch.rewards_B: shape {list(self.rewards_B.shape)}, "
                                 f"expected [{b}]")
        if len(self.episode_ids) != b or len(self.group_ids) != b:
            raise InvalidRequest(f"TrainBatch: {b} rows but {len(self.episode_ids)} episode ids "
                                 f"and {len(self.group_ids)} group ids")
        lengths_B = self.attention_mask_B_T.sum(-1)
        if not torch.equal(self.attention_mask_B_T, _prefix_mask(lengths_B, t)):
            raise InvalidRequest("TrainBatch: rows must be right-padded (attention mask a prefix)")
        if (self.loss_mask_B_T & ~self.attention_mask_B_T).any():
            raise InvalidRequest("TrainBatch: loss mask set on padding")
        if t and self.loss_mask_B_T[:, 0].any():
            raise InvalidRequest("TrainBatch: a row trains its first token, which has no context")
        for name in ("turn_spans", "turn_rewards", "roles"):
            value = getattr(self, name)
            if value is not None and len(value) != b:
                raise InvalidRequest(f"TrainBatch.{name}: {len(value)} entries for {b} rows")
        if self.roles is not None:  # advantages are per (task, role): never across roles
            check_group_roles(self.group_ids, self.roles)

    @property
    def num_rows(self) -> int:
        """Rows in the batch."""
        return int(self.input_ids_B_T.shape[0])

    @property
    def lengths_B(self) -> torch.Tensor:
        """Real (unpadded) length of each row."""
        return self.attention_mask_B_T.sum(-1)

    @property
    def num_trained_tokens(self) -> int:
        """Tokens that carry loss."""
        return int(self.loss_mask_B_T.sum())

    @classmethod
    def from_tensors(
        cls,
        tensors: Mapping[str, torch.Tensor],
        episode_ids: Sequence[str],
        group_ids: Sequence[str],
    ) -> TrainBatch:
        """From a workflow's tensor dict (input_ids, attention_mask, loss_mask, logprobs, versions,
        rewards) and per-row episode and group ids; loss_mask and logprobs are required here."""
        missing = [k for k in ("input_ids", "attention_mask", "loss_mask", "logprobs")
                   if k not in tensors]
        if missing:
            raise InvalidRequest(f"tensor dict lacks {missing}: the trainer needs what to train "
                                 "on and the behaviour logprobs of those tokens")
        ids = tensors["input_ids"]
        b, t = ids.shape
        return cls(
            input_ids_B_T=ids.long(),
            attention_mask_B_T=tensors["attention_mask"].bool(),
            loss_mask_B_T=tensors["loss_mask"].bool(),
            behav_logprobs_B_T=tensors["logprobs"].float(),
            versions_B_T=tensors.get("versions", torch.full((b, t), -1)).long(),
            rewards_B=tensors.get("rewards", torch.zeros(b)).float(),
            episode_ids=tuple(episode_ids),
            group_ids=tuple(group_ids),
        )

    @classmethod
    def from_rows(cls, rows: Sequence[TrajectoryRow], episode_ids: Sequence[str] | None = None,
                  group_ids: Sequence[str] | None = None) -> TrainBatch:
        """Rows as a padded batch, turn spans and turn rewards kept.

        Episode and group ids default to each row's session and task (the session if it has
        none). Rows that lack a loss mask or behaviour logprobs (a tensor dict without them)
        are refused: the trainer would otherwise train on made-up numbers.
        """
        from relayrl.trajectory.export import to_tensor_dict

        if not rows:
            raise InvalidRequest("no rows to train on")
        for r in rows:
            lacking = {"loss_mask", "logprobs"} & set(r.metadata.get("missing", ()))
            if lacking:
                raise InvalidRequest(f"rows lack {sorted(lacking)}: the trainer needs what to "
                                     "train on and the behaviour logprobs of those tokens")
        roles = tuple(r.role for r in rows)
        return replace(
            cls.from_tensors(
                to_tensor_dict(rows),
                episode_ids=episode_ids or [r.session_id for r in rows],
                group_ids=group_ids or [role_group_id(r.task_id or r.session_id, r.role)
                                        for r in rows],
            ),
            turn_spans=tuple(tuple((int(s), int(e)) for s, e in r.turn_spans) for r in rows),
            turn_rewards=tuple(tuple(float(x) for x in r.turn_rewards) for r in rows),
            roles=roles if any(r is not None for r in roles) else None,
        )

    @classmethod
    def from_row_batch(cls, batch: RowBatch) -> TrainBatch:
        """From the rollout's typed rows, with their episode and group labels."""
        return cls.from_rows(batch.rows, batch.episode_ids, batch.group_ids)

    def select(self, rows: Sequence[int]) -> TrainBatch:
        """The batch restricted to these rows, in this order (minibatches)."""
        index = torch.tensor(list(rows), dtype=torch.long)

        def pick(values: tuple[Any, ...] | None) -> Any:
            return None if values is None else tuple(values[i] for i in rows)

        return replace(
            self,
            input_ids_B_T=self.input_ids_B_T[index],
            attention_mask_B_T=self.attention_mask_B_T[index],
            loss_mask_B_T=self.loss_mask_B_T[index],
            behav_logprobs_B_T=self.behav_logprobs_B_T[index],
            versions_B_T=self.versions_B_T[index],
            rewards_B=self.rewards_B[index],
            episode_ids=pick(self.episode_ids),
            group_ids=pick(self.group_ids),
            turn_spans=pick(self.turn_spans),
            turn_rewards=pick(self.turn_rewards),
            roles=pick(self.roles),
        )

    def extended(self, other: TrainBatch) -> TrainBatch:
        """This batch's rows, then `other`'s, padded to the longer of the two (row `b` of this
        batch stays row `b`); turn spans and rewards kept only if both batches have them."""
        t = max(self.input_ids_B_T.shape[1], other.input_ids_B_T.shape[1])

        def cat(name: str) -> torch.Tensor:
            a, b = getattr(self, name), getattr(other, name)
            out = a.new_zeros(a.shape[0] + b.shape[0], t)
            out[: a.shape[0], : a.shape[1]] = a
            out[a.shape[0]:, : b.shape[1]] = b
            return out

        def join(name: str) -> Any:
            a, b = getattr(self, name), getattr(other, name)
            return None if a is None or b is None else a + b

        return replace(
            self,
            input_ids_B_T=cat("input_ids_B_T"),
            attention_mask_B_T=cat("attention_mask_B_T"),
            loss_mask_B_T=cat("loss_mask_B_T"),
            behav_logprobs_B_T=cat("behav_logprobs_B_T"),
            versions_B_T=cat("versions_B_T"),
            rewards_B=torch.cat([self.rewards_B, other.rewards_B]),
            episode_ids=self.episode_ids + other.episode_ids,
            group_ids=self.group_ids + other.group_ids,
            turn_spans=join("turn_spans"),
            turn_rewards=join("turn_rewards"),
            roles=_join_roles(self, other),
        )


def _join_roles(a: TrainBatch, b: TrainBatch) -> tuple[str | None, ...] | None:
    """Both batches' roles, rows without one as None (None when neither has roles)."""
    if a.roles is None and b.roles is None:
        return None
    return (a.roles or (None,) * a.num_rows) + (b.roles or (None,) * b.num_rows)


def minibatch_rows(num_rows: int, minibatches: int) -> list[list[int]]:
    """Row indices split into `minibatches` contiguous, near-equal parts (empty parts dropped).

    For several optimizer steps per batch: compute proximal logprobs once for the whole batch,
    then `update(batch.select(rows), adv_B_T[rows], prox_B_T[rows])` per part.
    """
    bounds = [round(i * num_rows / minibatches) for i in range(minibatches + 1)]
    return [list(range(a, b)) for a, b in itertools.pairwise(bounds) if b > a]


def _prefix_mask(lengths_B: torch.Tensor, t: int) -> torch.Tensor:
    return torch.arange(t)[None, :] < lengths_B[:, None]


@dataclass(frozen=True)
class MicroBatch:
    """Model inputs of one forward pass, and where its trained tokens come from and sit."""

    input_ids_M_L: torch.Tensor
    position_ids_M_L: torch.Tensor
    target_m_N: torch.Tensor
    """Micro-batch row of each trained token."""
    target_l_N: torch.Tensor
    """Position of each trained token in its micro-batch row (always >= 1)."""
    source_N: torch.Tensor
    """Flat index `b * T + t` of each trained token in the `[B, T]` batch."""
    rows: tuple[int, ...]
    """Batch rows in this micro-batch."""
    prefix_ids_P: torch.Tensor | None = None
    """Tokens every row starts with, run once; the rows' ids, positions and `target_l_N` then
    count from the end of it (`position_ids_M_L` starts at P)."""
    piece_lengths: tuple[int, ...] | None = None
    """`unpad`: the micro-batch is one row holding its rows' pieces (after the prefix) end to
    end, these long (the last one padded up to the bucket); None: one row per batch row."""
    piece_stems: tuple[int, ...] | None = None
    """`unpad` with stems: per piece, the index of the stem piece it continues, or -1. A stem
    holds the tokens a run of rows shares after the prefix (a GRPO group's question), run once;
    its rows' pieces then hold only what follows it. None: no piece continues a stem."""

    @property
    def prefix_len(self) -> int:
        """Length of the shared prefix (0 when there is none)."""
        return 0 if self.prefix_ids_P is None else int(self.prefix_ids_P.numel())

    @property
    def num_tokens(self) -> int:
        """Tokens the forward passes process, padding and the shared prefix (once) included."""
        return int(self.input_ids_M_L.numel()) + self.prefix_len

    def take(self, values_B_T: torch.Tensor) -> torch.Tensor:
        """The trained tokens' entries of a `[B, T]` tensor, as a flat `[N]` vector."""
        return values_B_T.reshape(-1)[self.source_N]


def plan_micro_batches(lengths_B: Sequence[int], max_tokens: int, packing: str) -> list[list[int]]:
    """Group row indices into micro-batches of at most `max_tokens` (a longer row goes alone).

    `pad`: longest first, so each micro-batch holds rows of similar length, and its padded size
    (rows x longest) stays within the budget. `pack`: first-fit decreasing into sequences whose
    summed length stays within the budget.
    """
    order = sorted(range(len(lengths_B)), key=lambda i: (-lengths_B[i], i))
    plans: list[list[int]] = []
    if packing == "pad":
        for i in order:
            if plans and (len(plans[-1]) + 1) * lengths_B[plans[-1][0]] <= max_tokens:
                plans[-1].append(i)
            else:
                plans.append([i])
        return plans
    if packing == "pack":
        room: list[int] = []
        for i in order:
            fit = next((k for k, r in enumerate(room) if r >= lengths_B[i]), None)
            if fit is None:
                plans.append([i])
                room.append(max_tokens - lengths_B[i])
            else:
                plans[fit].append(i)
                room[fit] -= lengths_B[i]
        return plans
    raise ValueError(f"unknown packing {packing!r}; expected 'pad', 'unpad' or 'pack'")


def bucketed(length: int, bucket: int) -> int:
    """`length` rounded up to a multiple of `bucket`."""
    return -(-length // bucket) * bucket


MIN_SHARED_PREFIX = 32
"""A common prefix shorter than this is not run separately (a second pass costs more)."""

MIN_STEM = 8
"""Rows of an unpadded micro-batch that share fewer tokens than this after its prefix run them
each (a stem is one more attention row and widens every row's keys by its length)."""


def _worth(prefix: int) -> int:
    """A common prefix's length if it is worth a pass of its own, else 0."""
    return prefix if prefix >= MIN_SHARED_PREFIX else 0


def _plans_from_cuts(order: list[int], cut: list[tuple[int, int]]) -> list[tuple[list[int], int]]:
    """The micro-batches `(rows, prefix)` of a split of `order`: `cut[j]` is (start, prefix)
    of the one ending before position j."""
    plans: list[tuple[list[int], int]] = []
    j = len(order)
    while j > 0:  # bounded: j falls by at least one each pass
        i, prefix = cut[j]
        plans.append(([order[k] for k in range(i, j)], prefix))
        j = i
    return plans[::-1]


def common_prefix_len(a: torch.Tensor, b: torch.Tensor) -> int:
    """How many leading tokens two id vectors share."""
    n = min(len(a), len(b))
    differ = (a[:n] != b[:n]).nonzero()
    return int(differ[0]) if len(differ) else n


def plan_shared_prefix(
    rows: Sequence[torch.Tensor], first: Sequence[int], max_tokens: int, bucket: int
) -> list[tuple[list[int], int]]:
    """Rows grouped into micro-batches that run their common prefix once: `(rows, prefix)`.

    `rows[i]` are row i's ids up to its last trained token and `first[i]` its first trained
    position; a prefix stops at `first - 1` (that position's output scores the first trained
    token). Rows in token order, so rows with long common prefixes are neighbours (the common
    prefix of a run of sorted rows is that of its first and last); a row joins the current
    micro-batch while prefix + rows x bucketed suffix stays within `max_tokens`.
    """

    def cost(n: int, prefix: int, longest: int) -> int:
        return prefix + n * bucketed(longest - prefix, bucket)

    order = sorted(range(len(rows)), key=lambda i: rows[i].tolist())
    plans: list[tuple[list[int], int]] = []
    group: list[int] = []
    prefix = longest = 0
    for i in order:
        if group:
            joint = min(prefix, common_prefix_len(rows[group[0]], rows[i]), first[i] - 1)
            joint_longest = max(longest, len(rows[i]))
            if cost(len(group) + 1, _worth(joint), joint_longest) <= max_tokens:
                group.append(i)
                prefix, longest = joint, joint_longest
                continue
            plans.append((group, _worth(prefix) if len(group) > 1 else 0))
        group, prefix, longest = [i], first[i] - 1, len(rows[i])
    if group:
        plans.append((group, _worth(prefix) if len(group) > 1 else 0))
    return plans


MAX_ROWS_BY_LENGTH = 128
"""`plan_by_length` (quadratic in rows) runs for batches up to this many rows."""

PASS_TOKENS = 32
"""What one more forward pass costs, in tokens, when plans are compared: ties go to fewer passes."""


def plan_by_length(
    rows: Sequence[torch.Tensor], first: Sequence[int], max_tokens: int, bucket: int
) -> list[tuple[list[int], int]]:
    """Rows in length order, cut into the micro-batches (each with its common prefix) of least
    padded cost: `(rows, prefix)`, as `plan_shared_prefix` gives.

    `plan_shared_prefix` groups rows by their tokens, blind to lengths: one long reply among 16
    rows that share a system prompt pads all 16 to its length, or splits them in two passes that
    each run the prompt. In length order the long rows end up together, and an exact split of
    that order (dynamic programming over where micro-batches start) keeps the rest in one pass.
    """
    n = len(rows)
    order = sorted(range(n), key=lambda i: len(rows[i]))
    as_lists = [rows[i].tolist() for i in range(n)]

    best = [0] + [-1] * n  # best[j]: least cost of the first j rows in `order`
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # best[j]'s last micro-batch: (start, prefix)
    for j in range(1, n + 1):
        last = order[j - 1]
        lo = hi = last  # the group's lexicographically least and greatest rows
        common, limit = len(rows[last]), first[last] - 1
        for i in range(j - 1, -1, -1):
            row = order[i]
            if as_lists[row] < as_lists[lo]:
                lo = row
            elif as_lists[row] > as_lists[hi]:
                hi = row
            limit = min(limit, first[row] - 1)
            if i < j - 1:  # a set's common prefix is that of its least and greatest members
                common = common_prefix_len(rows[lo], rows[hi])
            prefix = _worth(min(common, limit)) if i < j - 1 else 0
            tokens = prefix + (j - i) * bucketed(len(rows[last]) - prefix, bucket)
            if tokens > max_tokens and i < j - 1:
                break  # a longer group only costs more
            cost = best[i] + tokens + PASS_TOKENS
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, (i, prefix)
    return _plans_from_cuts(order, cut)


def plan_unpadded(
    rows: Sequence[torch.Tensor], first: Sequence[int], max_tokens: int, bucket: int,
    stems: bool = False,
) -> list[tuple[list[int], int]]:
    """Rows cut into unpadded micro-batches (their common prefix once, then each row's own
    tokens end to end, after its stem with `stems`) of least cost: `(rows, prefix)`, as
    `plan_shared_prefix` gives.

    Rows in token order, so that a run of rows has the common prefix of its first and last;
    an exact split of that order (dynamic programming over where micro-batches start) weighs a
    longer common prefix against the passes that each run their own.
    """
    n = len(rows)
    order = sorted(range(n), key=lambda i: rows[i].tolist())
    # In token order, rows i < j share what the least-sharing neighbours between them share.
    common = [common_prefix_len(rows[a], rows[b]) for a, b in itertools.pairwise(order)]
    limits = [first[i] - 1 for i in order]

    best = [0] + [-1] * n  # best[j]: least cost of the first j rows in `order`
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)
    for j in range(1, n + 1):
        limit, total, shared = limits[j - 1], 0, 1 << 62
        tally = _Stems(0)
        for i in range(j - 1, -1, -1):
            limit = min(limit, limits[i])
            total += len(rows[order[i]])
            if i < j - 1:
                shared = min(shared, common[i])
            prefix = _worth(min(shared, limit)) if i < j - 1 else 0
            # Stems (each group's question once) are counted: a micro-batch of whole groups
            # then fits a budget that their rows, each running its question, would not.
            if stems:
                if prefix != tally.prefix:  # stems count from the prefix: tally them again
                    tally = _Stems(prefix)
                    for k in range(j - 1, i, -1):
                        tally.add_left(limits[k], common[k] if k < j - 1 else 0)
                tally.add_left(limits[i], common[i] if i < j - 1 else 0)
            tokens = prefix + bucketed(total - (j - i) * prefix - tally.saved, bucket)
            if tokens > max_tokens and i < j - 1:
                break  # a longer run only costs more
            cost = best[i] + tokens + PASS_TOKENS
            if best[j] < 0 or cost < best[j]:
                best[j], cut[j] = cost, (i, prefix)
    return _plans_from_cuts(order, cut)


def micro_batches(
    batch: TrainBatch, max_tokens: int, packing: str, mask_B_T: torch.Tensor | None = None,
    bucket: int = 1, share_prefix: bool = False,
) -> list[MicroBatch]:
    """The batch's rows that have trained tokens (per `mask_B_T`, default the loss mask), split.

    Rows are cut after their last trained token; in `pad`, lengths round up to `bucket`, and
    with `share_prefix` rows run their common prefix once when that processes fewer tokens.
    """
    mask_B_T = batch.loss_mask_B_T if mask_B_T is None else mask_B_T.bool()
    t = mask_B_T.shape[1]
    # Length up to the last trained token of each row, 0 for a row with none.
    last_B = (torch.where(mask_B_T, torch.arange(1, t + 1), 0).amax(-1) if t
              else torch.zeros(mask_B_T.shape[0], dtype=torch.long))
    needed = [int(n) for n in last_B.tolist()]
    live = [b for b in range(batch.num_rows) if needed[b] > 0]
    if packing == "unpad":
        first_B = torch.where(mask_B_T, torch.arange(t), t).amin(-1).tolist()
        ids = [batch.input_ids_B_T[b, :needed[b]] for b in live]
        first = [int(first_B[b]) if share_prefix else 1 for b in live]
        # The shortest row last: the padding up to the bucket follows it, so that attention's
        # padded rows are no longer for it (a piece of its own would be one more row there).
        stems_from = first_B if share_prefix else None
        return [_build_unpadded(batch, mask_B_T, sorted((live[i] for i in rows),
                                                        key=lambda b: -needed[b]),
                                prefix, needed, bucket, stems_from)
                for rows, prefix in plan_unpadded(ids, first, max_tokens, bucket,
                                                  stems=share_prefix)]
    if packing == "pad":
        planned = [bucketed(needed[b], bucket) for b in live]
    else:
        planned = [needed[b] for b in live]
    plans = plan_micro_batches(planned, max_tokens, packing)
    if packing != "pad":
        return [_build_packed(batch, mask_B_T, [live[i] for i in plan], needed) for plan in plans]
    padded = [([live[i] for i in plan], 0) for plan in plans]
    if share_prefix and len(live) > 1:
        first_B = torch.where(mask_B_T, torch.arange(t), t).amin(-1).tolist()
        ids = [batch.input_ids_B_T[b, :needed[b]] for b in live]
        first = [int(first_B[b]) for b in live]
        planners = [plan_shared_prefix] + ([plan_by_length] if len(live) <= MAX_ROWS_BY_LENGTH
                                           else [])
        candidates = [padded] + [[([live[i] for i in rows], prefix) for rows, prefix in
                                  planner(ids, first, max_tokens, bucket)]
                                 for planner in planners]

        def total(plan: list[tuple[list[int], int]]) -> int:
            return sum(p + len(rows) * bucketed(max(needed[b] for b in rows) - p, bucket)
                       + PASS_TOKENS for rows, p in plan)

        padded = min(candidates, key=total)  # the first of equals: plain padding, then by tokens
    return [_build_padded(batch, mask_B_T, rows, prefix,
                          bucketed(max(needed[b] for b in rows) - prefix, bucket))
            for rows, prefix in padded]


def _build_padded(
    batch: TrainBatch, mask_B_T: torch.Tensor, rows: list[int], prefix: int, length: int
) -> MicroBatch:
    index = torch.tensor(rows, dtype=torch.long)
    t = batch.input_ids_B_T.shape[1]
    real = min(prefix + length, t)
    mask_M_L = mask_B_T[index, prefix:real]
    target_m_N, target_l_N = mask_M_L.nonzero(as_tuple=True)
    ids_M_L = batch.input_ids_B_T[index, prefix:real]
    if prefix + length > real:  # the bucket is longer than the batch: pad further (id 0, never read)
        ids_M_L = torch.nn.functional.pad(ids_M_L, (0, prefix + length - real))
    # Pads keep counting positions (no restart), so transformers sees no packing and uses the
    # plain causal kernel; pads come after every real token, so no real token attends to one.
    return MicroBatch(
        input_ids_M_L=ids_M_L,
        position_ids_M_L=torch.arange(prefix, prefix + length).expand(len(rows), length),
        target_m_N=target_m_N,
        target_l_N=target_l_N,
        source_N=index[target_m_N] * t + target_l_N + prefix,
        rows=tuple(rows),
        prefix_ids_P=batch.input_ids_B_T[rows[0], :prefix] if prefix else None,
    )


class _Stems:
    """Rows in token order, added from the last to the first, cut into the runs that share a
    stem and save the most tokens.

    A run of rows saves (rows - 1) x its stem: the tokens they all share after the `prefix`,
    stopping at each row's `limit` (the position whose output scores its first trained token),
    if that is at least `MIN_STEM`. In token order the rows between two rows share at least what
    those two share, so runs are contiguous, and the best cut of the rows right of each row is
    kept (dynamic programming, each run no longer than its stem allows). Built from the right so
    that `plan_unpadded`, which grows a micro-batch to the left, adds one row at a time.
    """

    def __init__(self, prefix: int) -> None:
        self.prefix = prefix
        self.limits: list[int] = []  # from the right: row 0 is the last row
        self.commons: list[int] = []  # row r's tokens in common with row r - 1 (on its right)
        self.best = [0]  # best[q]: tokens saved by the best cut of the q last rows
        self.choice: list[tuple[int, int]] = [(0, 0)]  # best[q]'s first run: (rows, stem)

    def add_left(self, limit: int, common: int) -> None:
        """One more row on the left: its limit and what it shares with the row on its right
        (ignored for the first row)."""
        r = len(self.limits)
        self.limits.append(limit)
        self.commons.append(common)
        value, choice = self.best[r], (1, 0)  # the row alone
        stem, shared = limit - self.prefix, 1 << 62
        for n in range(2, r + 2):  # the run of rows r .. r - n + 1; bounded by the rows
            shared = min(shared, self.commons[r - n + 2])
            stem = min(stem, self.limits[r - n + 1] - self.prefix, shared - self.prefix)
            if stem < MIN_STEM:
                break  # a longer run shares no more
            if (n - 1) * stem + self.best[r + 1 - n] > value:
                value, choice = (n - 1) * stem + self.best[r + 1 - n], (n, stem)
        self.best.append(value)
        self.choice.append(choice)

    @property
    def saved(self) -> int:
        """Tokens the best cut does not forward."""
        return self.best[-1]

    def runs(self) -> list[tuple[int, int]]:
        """`(rows, stem)` of the best cut's runs, left to right (stem 0: a row alone)."""
        out, q = [], len(self.limits)
        while q > 0:  # bounded: each run takes at least one row
            out.append(self.choice[q])
            q -= self.choice[q][0]
        return out


def plan_stems(
    rows: Sequence[torch.Tensor], first: Sequence[int], prefix: int
) -> list[tuple[list[int], int]]:
    """An unpadded micro-batch's rows as runs that share a stem: `(rows, stem)`, where the stem is
    how many tokens after the `prefix` the run's rows all start with (0: each row runs its own).

    `rows[i]` are row i's ids (all starting with the same `prefix` tokens) and `first[i]` its
    first trained position; like the prefix, a stem stops at `first - 1`, whose output scores
    the first trained token. Rows in token order, so a GRPO group's episodes (one question) are
    neighbours (`_Stems` cuts them where the most tokens are saved).
    """
    order = sorted(range(len(rows)), key=lambda i: rows[i][prefix:].tolist())
    tally = _Stems(prefix)
    for k in range(len(order) - 1, -1, -1):  # bounded by the rows
        tally.add_left(first[order[k]] - 1, common_prefix_len(rows[order[k]], rows[order[k + 1]])
                       if k + 1 < len(order) else 0)
    out, start = [], 0
    for n, stem in tally.runs():
        out.append((order[start:start + n], stem))
        start += n
    return out


def _build_unpadded(
    batch: TrainBatch, mask_B_T: torch.Tensor, rows: list[int], prefix: int, lengths: list[int],
    bucket: int, first: Sequence[int] | None = None,
) -> MicroBatch:
    """One unpadded micro-batch of `rows` (longest first) after their common `prefix`; with
    `first` (each batch row's first trained position), runs of rows that share more tokens run
    them once as a stem piece, followed by their own pieces."""
    t = batch.input_ids_B_T.shape[1]
    runs = [(rows, 0)]
    if first is not None and len(rows) > 1:
        found = plan_stems([batch.input_ids_B_T[b, :lengths[b]] for b in rows],
                           [first[b] for b in rows], prefix)
        if any(stem for _, stem in found):
            # Runs with a stem first, then the rest; longest first within each, so that the
            # padding up to the bucket follows a short row.
            shared = [([rows[i] for i in run], stem) for run, stem in found if stem]
            alone = [rows[i] for run, stem in found if not stem for i in run]
            order = {b: k for k, b in enumerate(rows)}
            runs = [(sorted(run, key=order.__getitem__), stem) for run, stem in shared]
            runs += [(sorted(alone, key=order.__getitem__), 0)] if alone else []
    ids: list[torch.Tensor] = []
    positions: list[torch.Tensor] = []
    target_l: list[torch.Tensor] = []
    source: list[torch.Tensor] = []
    pieces: list[int] = []
    stems: list[int] = []
    offset = 0
    for run, stem in runs:  # bounded by the rows of one micro-batch
        parent = -1
        if stem:  # the run's shared tokens, once, as a piece no token is trained on
            ids.append(batch.input_ids_B_T[run[0], prefix:prefix + stem])
            positions.append(torch.arange(prefix, prefix + stem))
            parent = len(pieces)
            pieces.append(stem)
            stems.append(-1)
            offset += stem
        start = prefix + stem
        for b in run:
            n = lengths[b] - start
            ids.append(batch.input_ids_B_T[b, start:lengths[b]])
            positions.append(torch.arange(start, start + n))
            (trained,) = mask_B_T[b, start:lengths[b]].nonzero(as_tuple=True)
            target_l.append(trained + offset)
            source.append(b * t + start + trained)
            pieces.append(n)
            stems.append(parent)
            offset += n
    pad = bucketed(offset, bucket) - offset
    if pad:  # id 0, never read, after the last row's tokens (which never attend to it)
        last = int(positions[-1][-1]) + 1
        ids.append(torch.zeros(pad, dtype=batch.input_ids_B_T.dtype))
        positions.append(torch.arange(last, last + pad))
        pieces[-1] += pad
    target_l_N = torch.cat(target_l)
    return MicroBatch(
        input_ids_M_L=torch.cat(ids)[None],
        position_ids_M_L=torch.cat(positions)[None],
        target_m_N=torch.zeros_like(target_l_N),
        target_l_N=target_l_N,
        source_N=torch.cat(source),
        rows=tuple(b for run, _ in runs for b in run),
        prefix_ids_P=batch.input_ids_B_T[rows[0], :prefix] if prefix else None,
        piece_lengths=tuple(pieces),
        piece_stems=tuple(stems) if any(s >= 0 for s in stems) else None,
    )


def _build_packed(
    batch: TrainBatch, mask_B_T: torch.Tensor, rows: list[int], lengths: list[int]
) -> MicroBatch:
    # The same row of rows end to end as `unpad`'s, without a prefix or padding, and without
    # the pieces' lengths: transformers finds the rows from the restarting positions.
    return replace(_build_unpadded(batch, mask_B_T, rows, 0, lengths, 1), piece_lengths=None)
