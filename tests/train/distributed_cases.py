"""What each rank runs in the data-parallel tests (a module of its own: spawned ranks import it).

Imports: relayrl.train and torch only (not the test modules, whose fixtures must not load twice).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from relayrl.train.actor import Actor
from relayrl.train.config import TrainConfig
from relayrl.train.packing import TrainBatch
from relayrl.train.trainer import update_in_minibatches

Case = tuple[str, TrainConfig, TrainBatch, torch.Tensor, TrainBatch | None]
"""(name, trainer settings, batch with the drop applied, per-token advantages, SFT replay).
With `train.minibatches` > 1 the rows are split as the trainer splits them (`minibatch_steps`)."""


def capture_gradients(actor: Actor) -> dict[str, torch.Tensor]:
    """A dict filled, just before each optimizer step, with the gradients it is about to apply."""
    grads: dict[str, torch.Tensor] = {}

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        grads.clear()
        grads.update({n: p.grad.detach().clone() for n, p in actor.model.named_parameters()
                      if p.grad is not None})

    actor.optimizer.register_step_pre_hook(hook)
    return grads


def weights(actor: Actor) -> dict[str, torch.Tensor]:
    """A copy of the policy's parameters."""
    return {n: p.detach().clone() for n, p in actor.model.named_parameters()}


def minibatch_steps(actor: Actor, case: Case) -> dict[str, float]:
    """The case's update as `PPOTrainer` takes it: one optimizer step, or one per minibatch."""
    _, cfg, batch, adv_B_T, replay = case
    return update_in_minibatches(actor, batch, adv_B_T, cfg.minibatches, lambda: replay)


def one_step(actor: Actor, case: Case) -> dict[str, Any]:
    """One process: the step's (last) gradients, the weights after it and its metrics."""
    grads = capture_gradients(actor)
    metrics = minibatch_steps(actor, case)
    return {"grads": dict(grads), "weights": weights(actor), "metrics": metrics,
            "version": actor.version}


def rank_worker(model_dir: str, cases: list[Case], out_dir: str) -> int:
    """Every rank: a fresh actor per case; rank 0 updates on the whole batch, the others follow.

    Each rank saves what it applied to `out_dir/<case>.rank<r>.pt`; returns the rank.
    """
    import torch.distributed as dist

    from relayrl.train.distributed import DistributedActor, join_process_group

    torch.set_num_threads(1)  # two ranks on a shared 2-core machine
    device = join_process_group(2)
    rank = dist.get_rank()
    for case in cases:  # bounded by the cases
        name, cfg = case[0], case[1]
        actor = DistributedActor(model_dir, cfg, device)
        actor.sync_state()
        grads = capture_gradients(actor)
        metrics, commands = None, None
        if actor.is_leader:
            metrics = minibatch_steps(actor, case)
            actor.stop_followers()
        else:
            commands = actor.follow(max_messages=cfg.minibatches + 2)  # steps, a scoring, stop
        torch.save({"grads": dict(grads), "weights": weights(actor), "metrics": metrics,
                    "version": actor.version, "commands": commands},
                   Path(out_dir) / f"{name}.rank{rank}.pt")
    return rank


def crash_on_rank0(world_size: int) -> None:
    """Rank 0 fails while rank 1 waits for its part of an update (as a follower does)."""
    import torch.distributed as dist

    from relayrl.train.distributed import join_process_group

    join_process_group(world_size)
    if dist.get_rank() == 0:
        raise ValueError("rank 0 failed on purpose")
    out: list[Any] = [None]
    dist.scatter_object_list(out, None, src=0)  # never answered: rank 0 is gone
