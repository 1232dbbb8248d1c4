"""Data-parallel training over `torch.distributed`: joining the process group, sharing a batch's
groups among the ranks, and summing gradients, so that W ranks take the same step as one.

Roles. Rank 0 is the trainer the rest of the system sees: it runs the launcher's services
(engine, gateway, rollouts), computes advantages, pushes weights to the engine and writes logs and
checkpoints. Ranks 1..W-1 only hold a replica of the policy and its optimizer and `follow`: they
receive their share of each batch from rank 0, run forward and backward on it, and join the
gradient all-reduce. The weights stay equal on every rank because every rank applies the same
summed gradient with the same optimizer state (checked by a test).

How a batch is shared (`DistributedActor.update`). Rank 0 builds the whole `TrainBatch`,
computes advantages on all of it (group statistics, the uniform-group drop and the logged stats
are exactly those of one process), and computes each token's share of the *global* batch loss
(`token_weights` of the global loss mask: for `loss_agg: token`, 1 / all trained tokens of the
batch, not of a rank's part). It then gives each rank whole groups (`shard_groups`), balanced by
the tokens each rank must run forward, and scatters each rank its rows with their advantages and
loss shares (`Shard`). Whole groups, although advantages are already computed, so that a rank's
rows are a self-contained set of groups (a group is never split across ranks, and a rank could
recompute its own advantages and get the same numbers); advantages on the full batch, so that
nothing about them depends on the number of ranks. An SFT replay (PPO-ptx rows drawn by rank 0)
is shared row by row among the ranks that have RL tokens (`shard_replay`), each rank's NLL sum
divided by the whole replay's trained tokens, so that it too adds up to one process's loss.

Why the gradients are summed, not averaged, and why not the `DistributedDataParallel` wrapper.
Each rank's loss is already its exact share of the global loss, so the global gradient is the
*sum* of the ranks' gradients; DDP averages (divides by W), which would match one process only
for equal per-rank means. The actor also calls the decoder and the output head separately (the
head runs only on trained positions), which bypasses a DDP module's `forward` and thus its
reducer. So gradients accumulate locally over micro-batches and are all-reduced once per
optimizer step, in flat buckets (what DDP with `no_sync` does, without the wrapper).

A rank that got no trained tokens (fewer groups than ranks, dropped groups) contributes zeros;
a parameter that no rank touched keeps `grad = None`, as in one process, so AdamW leaves it as
it is there.

Imports: train (actor, losses, packing, config), errors, torch. Never launch: starting the
worker processes is `relayrl.launch.distributed`'s job.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from relayrl.errors import ConfigError
from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig
from relayrl.train.losses import merge_stats, token_weights
from relayrl.train.packing import TrainBatch

COLLECTIVE_TIMEOUT = timedelta(hours=12)
"""How long a rank waits in a collective. Followers wait in one while rank 0 rolls out and
evaluates, which can take long; a dead rank is caught by the launcher (torch elastic stops the
other workers when one fails), not by this timeout."""

BUCKET_BYTES = 32 << 20
"""Gradients are all-reduced in flat buckets of about this size (fewer, larger messages)."""


@dataclass(frozen=True)
class Shard:
    """One rank's part of an update: its rows, their advantages and their shares of the loss."""

    batch: TrainBatch
    adv_B_T: torch.Tensor
    weights_B_T: torch.Tensor
    """Each token's share of the *global* batch loss (so shares sum to 1 over all ranks)."""
    version: int
    """Rank 0's weight version (followers report staleness against it)."""
    prox_logprobs_B_T: torch.Tensor | None = None
    ref_logprobs_B_T: torch.Tensor | None = None
    replay: TrainBatch | None = None
    """This rank's rows of the step's SFT replay (warm-up traces), if any."""
    replay_tokens: int = 1
    """Trained tokens of the whole replay: each rank's NLL sum divides by them."""
    advance: bool = True
    """Whether this optimizer step ends the rollout batch (advances step and version)."""


@dataclass(frozen=True)
class _SyncState:
    """Command: take rank 0's weights, optimizer state, step and version."""


@dataclass(frozen=True)
class _Score:
    """Command: score these rows under the current weights and send the logprobs to rank 0."""

    batch: TrainBatch


@dataclass(frozen=True)
class _Stop:
    """Command: the run is over; leave `follow`."""


def backend_for(device: torch.device) -> str:
    """The collective backend for a device: nccl on CUDA, gloo on CPU."""
    return "nccl" if device.type == "cuda" else "gloo"


def rank_device(local_rank: int) -> torch.device:
    """The device of the rank with this LOCAL_RANK: its own GPU, or the CPU where CUDA is not."""
    if not torch.cuda.is_available():
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if local_rank >= count:
        # NCCL refuses two ranks on one GPU, and cuda:N past the last GPU fails deep in CUDA
        raise ConfigError(
            f"a trainer rank needs a GPU of its own: LOCAL_RANK={local_rank}, but this machine "
            f"has {count}; set train.world_size to at most {count} per machine")
    return torch.device("cuda", local_rank)


def join_process_group(world_size: int) -> torch.device:
    """Join (or check) the process group of `world_size` ranks; returns this rank's device.

    Reads the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, LOCAL_RANK),
    which `relayrl.launch.distributed` or `torchrun` set.
    """
    device = rank_device(int(os.environ.get("LOCAL_RANK", "0")))
    if not dist.is_initialized():
        env_size = os.environ.get("WORLD_SIZE")
        if env_size is None or int(env_size) != world_size:
            raise ConfigError(
                f"train.world_size={world_size}, but this process is not one of {world_size} "
                f"ranks (WORLD_SIZE={env_size}): start it with `relayrl train` (which launches "
                "the ranks) or with torchrun --nproc-per-node")
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(backend_for(device), init_method="env://",
                                timeout=COLLECTIVE_TIMEOUT)
    if dist.get_world_size() != world_size:
        raise ConfigError(f"train.world_size={world_size}, but the process group has "
                          f"{dist.get_world_size()} ranks")
    return device


def row_costs(batch: TrainBatch) -> list[int]:
    """Tokens each row costs in forward and backward: its length if it trains, else 0."""
    live_B = batch.loss_mask_B_T.any(-1)
    return (batch.lengths_B * live_B).tolist()


def shard_groups(group_ids: Sequence[str], costs: Sequence[int], world_size: int
                 ) -> list[list[int]]:
    """Row indices per rank: whole groups, balanced by cost (largest group to the lightest rank).

    Deterministic; each rank's rows keep the batch order. A rank may get no rows (fewer groups
    than ranks): it still joins the step with zero gradients.
    """
    members: dict[str, list[int]] = {}
    for i, g in enumerate(group_ids):
        members.setdefault(g, []).append(i)
    group_cost = {g: sum(costs[i] for i in rows) for g, rows in members.items()}
    order = sorted(members, key=lambda g: -group_cost[g])  # stable: ties keep batch order
    load = [0] * world_size
    count = [0] * world_size
    shards: list[list[int]] = [[] for _ in range(world_size)]
    for g in order:
        # lightest rank; among equals the one with fewer rows, then the lowest rank
        r = min(range(world_size), key=lambda k: (load[k], count[k], k))
        shards[r].extend(members[g])
        load[r] += group_cost[g]
        count[r] += len(members[g])
    return [sorted(s) for s in shards]


def shard_replay(costs: Sequence[int], rl_costs: Sequence[int]) -> list[list[int]]:
    """Replay row indices per rank: each row (largest first) to the least loaded rank that has
    RL tokens of its own, load counted with its RL rows; none where no rank has any."""
    live = [r for r, c in enumerate(rl_costs) if c > 0]
    shards: list[list[int]] = [[] for _ in rl_costs]
    if not live:
        return shards
    load = list(rl_costs)
    for i in sorted(range(len(costs)), key=lambda i: -costs[i]):  # stable: ties keep row order
        r = min(live, key=lambda k: (load[k], k))
        shards[r].append(i)
        load[r] += costs[i]
    return [sorted(s) for s in shards]


def all_reduce_gradients(params: Sequence[torch.nn.Parameter]) -> None:
    """Sum every parameter's gradient over the ranks, in place (a parameter no rank gave a
    gradient keeps `grad = None`)."""
    if not params:
        return
    device = params[0].device
    touched = torch.tensor([p.grad is not None for p in params], dtype=torch.float32,
                           device=device)
    dist.all_reduce(touched)
    live = [p for p, t in zip(params, touched.tolist(), strict=True) if t > 0]
    for p in live:
        if p.grad is None:  # this rank had no tokens reaching it: it adds zeros
            p.grad = torch.zeros_like(p)
    bucket: list[torch.Tensor] = []
    size = 0
    for p in live:  # bounded by the parameter count
        assert p.grad is not None
        bucket.append(p.grad)
        size += p.grad.numel() * p.grad.element_size()
        if size >= BUCKET_BYTES:
            _all_reduce_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _all_reduce_bucket(bucket)


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    for g, summed in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(summed)


def _select(values_B_T: torch.Tensor | None, rows: list[int]) -> torch.Tensor | None:
    return None if values_B_T is None else values_B_T[torch.tensor(rows, dtype=torch.long)]


class DistributedActor(Actor):
    """An `Actor` that is one rank of a data-parallel group (`join_process_group` first).

    Rank 0 calls `update(batch, ...)` with the whole batch, like a one-process actor; the other
    ranks call `follow()` and take their part of each update until rank 0 calls `stop_followers`.
    """

    def __init__(self, model_path: str, config: TrainConfig, device: str | torch.device = "cpu",
                 reference_path: str | None = None) -> None:
        super().__init__(model_path, config, str(device), reference_path)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()

    @property
    def is_leader(self) -> bool:
        """Rank 0: the rank that runs rollouts, pushes weights and writes logs."""
        return self.rank == 0

    # -- rank 0 -------------------------------------------------------------------------------

    def update(
        self,
        batch: TrainBatch,
        adv_B_T: torch.Tensor,
        prox_logprobs_B_T: torch.Tensor | None = None,
        ref_logprobs_B_T: torch.Tensor | None = None,
        weights_B_T: torch.Tensor | None = None,
        replay: TrainBatch | None = None,
        replay_tokens: int | None = None,
        advance: bool = True,
    ) -> dict[str, float]:
        """Rank 0: one optimizer step on the whole batch, shared among the ranks by groups.

        A `replay` (warm-up traces, PPO-ptx) is shared too, row by row, among the ranks that
        have RL tokens: its loss is the mean NLL over all its trained tokens, as in one process.
        """
        if not self.is_leader:
            raise RuntimeError("only rank 0 calls update(); the other ranks call follow()")
        if weights_B_T is None:  # shares of the global loss, whoever computes the token
            weights_B_T = token_weights(batch.loss_mask_B_T, self.config.loss_agg)
        costs = row_costs(batch)
        plan = shard_groups(batch.group_ids, costs, self.world_size)
        # One process skips the replay with a step that has no RL token; here a rank without
        # RL tokens gets none of it, so each replay row runs where the step is taken.
        use_replay = (replay is not None and self.config.sft_replay_coef > 0
                      and batch.num_trained_tokens > 0)
        replay_plan: list[list[int]] = [[] for _ in plan]
        if use_replay:
            assert replay is not None
            replay_plan = shard_replay(row_costs(replay),
                                       [sum(costs[i] for i in rows) for rows in plan])
            replay_tokens = replay_tokens or max(replay.num_trained_tokens, 1)
        shards = []
        for rows, replay_rows in zip(plan, replay_plan, strict=True):
            index = torch.tensor(rows, dtype=torch.long)
            shards.append(Shard(
                batch=batch.select(rows), adv_B_T=adv_B_T[index], weights_B_T=weights_B_T[index],
                version=self.version, prox_logprobs_B_T=_select(prox_logprobs_B_T, rows),
                ref_logprobs_B_T=_select(ref_logprobs_B_T, rows),
                replay=replay.select(replay_rows) if replay is not None and replay_rows else None,
                replay_tokens=replay_tokens or 1, advance=advance))
        return self._run_shard(self._scatter(shards))

    def sync_followers(self) -> None:
        """Rank 0, while the others `follow`: give them its weights and optimizer state."""
        self._scatter([_SyncState()] * self.world_size)
        self.sync_state()

    def proximal_logprobs(self, batch: TrainBatch) -> torch.Tensor:
        """Rank 0, while the others `follow`: the batch's logprobs, each rank scoring whole
        groups of it (the same split as an update's), gathered here."""
        if not self.is_leader:
            raise RuntimeError("only rank 0 calls proximal_logprobs(); the others follow()")
        plan = shard_groups(batch.group_ids, row_costs(batch), self.world_size)
        message = self._scatter([_Score(batch.select(rows)) for rows in plan])
        parts = self._gather_scores(message.batch)
        assert parts is not None
        out_B_T = torch.zeros(batch.loss_mask_B_T.shape, dtype=torch.float32)
        for rows, part in zip(plan, parts, strict=True):
            if rows:
                out_B_T[torch.tensor(rows, dtype=torch.long)] = part
        return out_B_T

    def _gather_scores(self, batch: TrainBatch) -> list[torch.Tensor] | None:
        """Every rank: score `batch`'s rows (none: nothing to do) and gather them on rank 0."""
        mine = (Actor.compute_logprobs(self, batch) if batch.num_rows
                else torch.zeros(batch.loss_mask_B_T.shape, dtype=torch.float32))
        gathered: list[Any] | None = [None] * self.world_size if self.is_leader else None
        dist.gather_object(mine, gathered, dst=0)
        return gathered

    def stop_followers(self) -> None:
        """Rank 0: end the other ranks' `follow`."""
        self._scatter([_Stop()] * self.world_size)

    # -- every rank ---------------------------------------------------------------------------

    def sync_state(self) -> None:
        """Collective: every rank takes rank 0's weights, optimizer state, step and version."""
        with torch.no_grad():
            for t in [*self.model.parameters(), *self.model.buffers()]:
                dist.broadcast(t.data, src=0)
        self.weights_changed()
        box: list[Any] = [(self.optimizer.state_dict(), self.step, self.version)
                          if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, device=self._collective_device())
        if not self.is_leader:
            state, self.step, self.version = box[0]
            self.optimizer.load_state_dict(state)

    def follow(self, max_messages: int) -> int:
        """Ranks 1..W-1: take part in rank 0's updates until it stops them; returns the count.

        Bounded: rank 0 sends at most `max_messages` commands in a run (its loop is bounded too).
        """
        for n in range(max_messages):
            message = self._scatter(None)
            if isinstance(message, _Stop):
                return n
            if isinstance(message, _SyncState):
                self.sync_state()
            elif isinstance(message, _Score):
                self._gather_scores(message.batch)
            else:
                self._run_shard(message)
        raise RuntimeError(f"rank {self.rank}: more than {max_messages} commands from rank 0")

    def _run_shard(self, shard: Shard) -> dict[str, float]:
        self.version = shard.version
        return Actor.update(self, shard.batch, shard.adv_B_T, shard.prox_logprobs_B_T,
                            shard.ref_logprobs_B_T, weights_B_T=shard.weights_B_T,
                            replay=shard.replay, replay_tokens=shard.replay_tokens,
                            advance=shard.advance)

    def _scatter(self, messages: list[Any] | None) -> Any:
        out: list[Any] = [None]
        dist.scatter_object_list(out, messages if self.is_leader else None, src=0)
        return out[0]

    def _collective_device(self) -> torch.device | None:
        return self.device if self.device.type == "cuda" else None

    # -- the actor's hooks --------------------------------------------------------------------

    def _across_ranks(self, metrics: dict[str, float]) -> dict[str, float]:
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, metrics)
        merged = merge_stats(gathered)
        tokens = [p.get("n_tokens", 0.0) for p in gathered]
        merged.update(dp_world_size=float(self.world_size), dp_rank_tokens_min=min(tokens),
                      dp_rank_tokens_max=max(tokens))
        return merged

    def _sync_gradients(self) -> None:
        all_reduce_gradients([p for p in self.model.parameters() if p.requires_grad])
